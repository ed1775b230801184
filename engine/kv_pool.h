// KvPool: the compressed KV and index keys of every sequence, in fixed-size blocks of 64 tokens
// (the prefix cache's block), reference-counted so that sequences sharing a prefix share its
// blocks; a sequence writing into a shared block first copies it (copy on write).
//
// One block holds, for its 64 token positions, every KV source's rows, planar: for a source of
// ratio r, its 64 / r entries' FP4 KV codes (head_dim/2 bytes each), then their E4M3 scales
// (head_dim/16), then the FP4 index-key codes (index_head_dim/2) and their UE8M0 scales
// (index_head_dim/32) when the source writes keys. Every region starts 16-byte aligned, so vector
// loads and TMA can read a region's rows as one array (docs/formats.md). For the released model
// that is 64 x 890 = 56,960 bytes a block (its regions need no padding).
//
// Thread-safety: allocation and reference counts belong to the thread that runs the forward
// pass (the engine thread); used_blocks() and capacity_blocks() may be read from any thread.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "config/status.h"
#include "engine/model_config.h"

namespace flashd::engine {

struct KvBlockLayout {
  // One region of a block: entries_per_block rows of row_bytes each, from offset.
  struct Region {
    size_t offset = 0;
    size_t row_bytes = 0;  // 0: the source has no such region.
  };
  struct Source {
    int layer = 0;
    int ratio = 1;
    int64_t entries_per_block = 0;
    Region kv_codes, kv_scales, key_codes, key_scales;
  };
  int64_t block_tokens = 64;
  std::vector<Source> sources;
  std::vector<int> source_of_layer;  // Layer -> index in sources, or -1.
  size_t block_bytes = 0;

  static StatusOr<KvBlockLayout> For(const ModelConfig& config, int64_t block_tokens = 64);
};

class KvPool {
 public:
  struct Free {
    void operator()(uint8_t* p) const;
  };
  // A block's memory as the pool allocates it (64-byte aligned, rounded up to 64 bytes), which a
  // reader outside the engine thread may fill (a restore) and the pool then adopts without a copy.
  using BlockMemory = std::unique_ptr<uint8_t, Free>;
  // Uninitialised but for the padding after block_bytes, which is zeroed; null when out of memory.
  static BlockMemory NewBlockMemory(size_t block_bytes);

  KvPool(size_t block_bytes, size_t capacity_blocks);

  // A zeroed block with one reference, or -1 when the pool is at capacity.
  int32_t Allocate();
  // A block with one reference whose bytes are `memory` (from NewBlockMemory(block_bytes())),
  // or -1 when the pool is at capacity (the memory is then freed).
  int32_t Adopt(BlockMemory memory);
  void Ref(int32_t block);
  void Unref(int32_t block);  // The last reference returns the block to the pool.
  int refs(int32_t block) const { return refs_[static_cast<size_t>(block)]; }
  const uint8_t* data(int32_t block) const { return table_[static_cast<size_t>(block)]; }
  // The block's bytes for writing: counts as a write (its version moves on).
  uint8_t* mutable_data(int32_t block) {
    Wrote(block);
    return table_[static_cast<size_t>(block)];
  }
  // Block id -> its bytes (64-byte aligned), for kernels that address rows by block id. Valid
  // until the next Allocate or Adopt.
  uint8_t* const* block_table() const { return table_.data(); }
  // Block id -> its version: a count that every write of the block's bytes moves on (Allocate,
  // Adopt, mutable_data, and an op writing rows through block_table(), which adds one itself;
  // kernels::PagedRows::versions). It never goes back, also across a block's reuse, so a device
  // copy of a block made at version v is the block's bytes exactly while the version is still v.
  // Valid until the next Allocate or Adopt.
  uint64_t* versions() { return versions_.data(); }
  uint64_t version(int32_t block) const { return versions_[static_cast<size_t>(block)]; }
  // How many times a version was moved on by the host (all of the above but the device's own
  // writes, which a backend makes current itself): while it stands still no block changed on
  // the host (kernels::PagedRows::writes). Valid for the pool's life.
  uint64_t* writes() { return &writes_; }

  size_t block_bytes() const { return block_bytes_; }
  size_t used_blocks() const { return used_.load(std::memory_order_relaxed); }
  size_t capacity_blocks() const { return capacity_.load(std::memory_order_relaxed); }
  void set_capacity_blocks(size_t capacity) { capacity_ = capacity; }

 private:
  // A host write of the block: its version and the pool's count move on together.
  void Wrote(int32_t block) {
    versions_[static_cast<size_t>(block)] += 1;
    writes_ += 1;
  }

  size_t block_bytes_;
  std::atomic<size_t> capacity_;
  std::atomic<size_t> used_{0};
  std::vector<BlockMemory> blocks_;
  std::vector<uint8_t*> table_;
  std::vector<int> refs_;
  std::vector<uint64_t> versions_;
  uint64_t writes_ = 0;
  std::vector<int32_t> free_;
};

}  // namespace flashd::engine
