// The CPU forward pass of DeepSeek-V4.1-Flash: prefill (many tokens) and decode (one token) for
// sequences at any position, with all per-sequence state in SequenceState.
//
// Numerics follow the reference implementation: activations are rounded to BF16 between ops,
// norms, gates, mHC mixes and softmaxes run in FP32, every FP8/FP4 linear quantizes its input to
// FP8 per 32, the window KV is kept as FP8 with a UE8M0 scale per 32, compressed KV as FP4 with
// an E4M3 scale per 16, and index keys as FP4 with a UE8M0 scale per 32. Every per-token result
// depends only on that token and the state before it, so one prefill, any chunking, and token by
// token decoding give bit-identical results; so do a batch and each sequence alone.
//
// Thread-safety: a CpuForward is immutable after Create() and may be shared; one SequenceState
// must not be used by two calls at once.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "config/status.h"
#include "engine/engram.h"
#include "engine/kv_pool.h"
#include "engine/model.h"

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
  };
  std::vector<Ring> rings;  // One per layer.
  struct Source {
    std::vector<float> kv_partial;     // [ratio, head_dim] fp32, ratio > 1 only
    std::vector<float> score_partial;  // [ratio, head_dim] fp32
    int64_t entries = 0;               // Compressed entries written (rows in the blocks).
  };
  std::vector<Source> sources;          // Indexed by layer; empty for non-sources.
  std::vector<int32_t> engram_classes;  // The last max_ngram_size - 1 token classes.
  std::shared_ptr<KvPool> pool;
  std::shared_ptr<const KvBlockLayout> layout;
  std::vector<int32_t> blocks;  // Token positions [64 b, 64 b + 64) live in blocks[b].
  // Compressed entries of groups that end at or before this position are final (restored from
  // the prefix cache): the forward pass neither recomputes nor overwrites them.
  int64_t frozen_tokens = 0;

  // Row `entry` of KV source `layer`: the FP4 KV row followed by its index-key row.
  const uint8_t* Row(int layer, int64_t entry) const;
  // The same row, writable: allocates its block, or copies a shared one first. Fails when the
  // pool is full.
  StatusOr<uint8_t*> MutableRow(int layer, int64_t entry);

  // A versioned binary snapshot of everything above (format in docs/formats.md); restore with
  // CpuForward::Restore. Blocks before `first_block` are left out: the prefix cache stores those
  // once, as blocks shared by every snapshot that extends them.
  std::string Serialize(size_t first_block = 0) const;
};

// What a forward call can report besides logits, for tests against the reference.
struct ForwardTrace {
  // For each index-source layer and token: the compressed positions selected (ascending).
  struct Selection {
    int layer;
    int64_t position;
    std::vector<int64_t> entries;
  };
  std::vector<Selection> selections;
  std::vector<std::vector<int64_t>> engram_rows;  // Per token: rows of every Engram layer.
  // When record_streams is set: the residual streams after every layer, [tokens, hc, dim].
  bool record_streams = false;
  std::vector<std::vector<float>> streams;
  // With record_streams: each layer's attention input and output, FFN input and output,
  // [tokens, dim] each, in that order.
  std::vector<std::vector<float>> sublayers;
};

struct ForwardOptions {
  bool all_logits = false;  // Logits for every token, or only the last.
  int threads = 0;          // 0: all cores.
  ForwardTrace* trace = nullptr;
  // Layer-by-layer replay of another implementation's run: when set, the residual stream
  // entering layer l (l >= 1), and the final one, are taken from forced_streams
  // [tokens, layers, hc, dim] (the stream each layer produced there) instead of from this
  // model's previous layer. Each layer is then compared on identical inputs, which keeps one
  // rounding difference from compounding through the rest of the stack.
  const float* forced_streams = nullptr;
  // The decoder bounded replay (off with 0): layers after the last KV source run only on the
  // last max(replay_tokens, sliding_window) tokens of each sequence in the call. Earlier prompt
  // tokens reach those layers only through their window rings, which then start at the replay.
  // An approximation, measured in docs/benchmarks.md; needs all_logits off.
  int64_t replay_tokens = 0;
};

// One sequence's part of a batched call.
struct BatchItem {
  SequenceState* state;
  std::span<const int32_t> tokens;
  std::vector<float>* logits;
};

class CpuForward {
 public:
  // Prepares the model's weights for the CPU (decodes BF16 matrices, keeps FP8/FP4 mapped).
  // `tokenizer_json` is needed for Engram; "" means the model directory's own tokenizer.json.
  // `block_tokens` is the KV pool's block, which is also the prefix cache's block.
  static StatusOr<std::unique_ptr<CpuForward>> Create(const Model& model,
                                                      const std::string& tokenizer_json = "",
                                                      int64_t block_tokens = 64);
  int64_t block_tokens() const;
  ~CpuForward();

  const ModelConfig& config() const;
  SequenceState NewSequence() const;
  // Reads a snapshot written by SequenceState::Serialize into this model's pool. A snapshot
  // written without its first blocks needs them in `leading_blocks`: pool blocks holding their
  // bytes, whose one reference each the state takes over (also on failure).
  StatusOr<SequenceState> Restore(std::string_view snapshot,
                                  std::vector<int32_t> leading_blocks = {}) const;
  // A sequence at `position` (a multiple of 64) whose compressed KV for every earlier position is
  // already in `blocks` (taken over as above) but whose bounded state is unknown: its window
  // rings start empty and `tokens_before` (the whole prefix, or at least its last few tokens)
  // give the Engram history. Running the ExactReplayTokens() tokens before the blocks' end
  // again from such a state rebuilds the bounded state bit for bit (frozen_tokens keeps the
  // replay from touching the restored entries); what it yields before that point is not exact.
  StatusOr<SequenceState> ResumeAt(int64_t position, std::span<const int32_t> tokens_before,
                                   std::vector<int32_t> blocks) const;
  // Tokens a replay needs: each layer's window reaches sliding_window - 1 tokens back, so after
  // layers x (window - 1) tokens every layer's state is exact; rounded up to whole blocks.
  int64_t ExactReplayTokens() const;
  // The pool new sequences take their KV blocks from (unbounded until a capacity is set).
  const std::shared_ptr<KvPool>& pool() const;

  // Appends `tokens` to the sequence and writes vocab-sized fp32 logits for the last token, or
  // for every token with options.all_logits.
  Status Forward(SequenceState* state, std::span<const int32_t> tokens, std::vector<float>* logits,
                 const ForwardOptions& options = {}) const;

  // Several sequences in one call: row-wise work (projections, experts, head) runs over all
  // their tokens together; each sequence's results equal those of running it alone.
  // REQUIRES: distinct states.
  Status ForwardBatch(std::span<BatchItem> items, const ForwardOptions& options = {}) const;

  // The compressed Engram vocabulary's class count (99,092 for the released tokenizer).
  int64_t engram_classes() const;

 private:
  struct Impl;
  explicit CpuForward(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace flashd::engine
