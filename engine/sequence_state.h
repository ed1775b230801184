// SequenceState: everything one sequence carries between forward calls. The snapshot format is
// documented in docs/formats.md.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "engine/kv_pool.h"

namespace flashd::engine {

// Everything a sequence carries between calls. Bounded parts (window rings, compressor partial
// groups, Engram history) plus the compressed KV and index keys that grow with the context,
// which live in KvPool blocks the sequence references. Move-only: Fork() shares the blocks.
struct SequenceState {
  SequenceState() = default;
  SequenceState(SequenceState&& other) noexcept;
  SequenceState& operator=(SequenceState&& other) noexcept;
  SequenceState(const SequenceState&) = delete;
  SequenceState& operator=(const SequenceState&) = delete;
  ~SequenceState();

  // A second sequence continuing from this one's position: the bounded state is copied, every
  // KV block is shared until one of them writes to it.
  SequenceState Fork() const;

  int64_t position = 0;  // Tokens processed so far.
  struct Ring {
    std::vector<uint8_t> codes;   // [window, head_dim] FP8 E4M3
    std::vector<uint8_t> scales;  // [window, head_dim / 32] UE8M0
    // [window] or empty: per slot a number no other slot content ever had (the forward pass
    // gives a new one to every slot it writes; a copy keeps them with the rows they name), so a
    // backend keeping a copy of the ring copies only the slots whose number moved. Empty (a
    // ring not written since it was made or restored): every op takes the ring whole.
    std::vector<uint64_t> versions;
  };
  std::vector<Ring> rings;  // One per layer.
  // A KV source's compressor: the partial group and how many entries it has written.
  struct Compressor {
    std::vector<float> kv_partial;     // [ratio, head_dim] fp32, ratio > 1 only
    std::vector<float> score_partial;  // [ratio, head_dim] fp32
    int64_t entries = 0;               // Compressed entries written (rows in the blocks).
    // A number no other partial groups' contents ever had, or 0: the forward pass gives a new
    // one to the groups each step commits (a copy keeps it with the bytes it names), so a
    // backend that kept its device copy of them knows it for the same bytes and copies nothing.
    // Not serialized: a restored state starts at 0.
    uint64_t version = 0;
  };
  std::vector<Compressor> sources;      // Indexed by layer; empty for non-sources.
  std::vector<int32_t> engram_classes;  // The last max_ngram_size - 1 token classes.
  std::shared_ptr<KvPool> pool;
  std::shared_ptr<const KvBlockLayout> layout;
  std::vector<int32_t> blocks;  // Token positions [64 b, 64 b + 64) live in blocks[b].
  // Compressed entries of groups that end at or before this position are final (restored from
  // the prefix cache): the forward pass neither recomputes nor overwrites them.
  int64_t frozen_tokens = 0;

  // A versioned binary snapshot of everything above (format in docs/formats.md); restore with
  // CpuForward::Restore. Blocks before `first_block` are left out: the prefix cache stores those
  // once, as blocks shared by every snapshot that extends them.
  std::string Serialize(size_t first_block = 0) const;
};

}  // namespace flashd::engine
