#include "engine/kv_pool.h"

#include <algorithm>
#include <cassert>
#include <cstdlib>
#include <cstring>

namespace flashd::engine {

StatusOr<KvBlockLayout> KvBlockLayout::For(const ModelConfig& c, int64_t block_tokens) {
  KvBlockLayout layout;
  layout.block_tokens = block_tokens;
  layout.source_of_layer.assign(c.num_hidden_layers, -1);
  size_t offset = 0;
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    const LayerPlan& p = c.layers[l];
    if (!p.is_kv_source) continue;
    if (block_tokens % p.compress_ratio != 0) {
      return InvalidArgument("layer " + std::to_string(l) + ": compress ratio " +
                             std::to_string(p.compress_ratio) + " does not divide the " +
                             std::to_string(block_tokens) + "-token cache block");
    }
    Source s;
    s.layer = l;
    s.ratio = p.compress_ratio;
    s.entries_per_block = block_tokens / p.compress_ratio;
    const size_t entries = static_cast<size_t>(s.entries_per_block);
    auto region = [&](size_t row_bytes) {
      offset = (offset + 15) / 16 * 16;
      Region r{offset, row_bytes};
      offset += entries * row_bytes;
      return r;
    };
    s.kv_codes = region(static_cast<size_t>(c.head_dim / 2));
    s.kv_scales = region(static_cast<size_t>(c.head_dim / 16));
    if (p.owns_index_keys) {
      s.key_codes = region(static_cast<size_t>(c.index_head_dim / 2));
      s.key_scales = region(static_cast<size_t>(c.index_head_dim / 32));
    }
    layout.source_of_layer[l] = static_cast<int>(layout.sources.size());
    layout.sources.push_back(s);
  }
  layout.block_bytes = (offset + 15) / 16 * 16;
  return layout;
}

KvPool::KvPool(size_t block_bytes, size_t capacity_blocks)
    : block_bytes_(block_bytes), capacity_(capacity_blocks) {}

namespace {

size_t PaddedBytes(size_t block_bytes) { return (std::max<size_t>(block_bytes, 1) + 63) / 64 * 64; }

}  // namespace

KvPool::BlockMemory KvPool::NewBlockMemory(size_t block_bytes) {
  const size_t bytes = PaddedBytes(block_bytes);
  BlockMemory m(static_cast<uint8_t*>(std::aligned_alloc(64, bytes)));
  if (m) std::memset(m.get() + block_bytes, 0, bytes - block_bytes);
  return m;
}

int32_t KvPool::Adopt(BlockMemory memory) {
  if (!memory || used_ >= capacity_) return -1;
  int32_t id;
  if (!free_.empty()) {
    id = free_.back();
    free_.pop_back();
    table_[static_cast<size_t>(id)] = memory.get();
    blocks_[static_cast<size_t>(id)] = std::move(memory);
  } else {
    id = static_cast<int32_t>(blocks_.size());
    table_.push_back(memory.get());
    blocks_.push_back(std::move(memory));
    refs_.push_back(0);
    versions_.push_back(0);
  }
  refs_[static_cast<size_t>(id)] = 1;
  Wrote(id);
  used_ += 1;
  return id;
}

int32_t KvPool::Allocate() {
  if (used_ >= capacity_) return -1;
  int32_t id;
  if (!free_.empty()) {
    id = free_.back();
    free_.pop_back();
    std::memset(blocks_[id].get(), 0, block_bytes_);
  } else {
    id = static_cast<int32_t>(blocks_.size());
    const size_t bytes = PaddedBytes(block_bytes_);
    uint8_t* block = static_cast<uint8_t*>(std::aligned_alloc(64, bytes));
    if (block == nullptr) return -1;
    std::memset(block, 0, bytes);
    blocks_.emplace_back(block);
    table_.push_back(block);
    refs_.push_back(0);
    versions_.push_back(0);
  }
  refs_[id] = 1;
  Wrote(id);
  used_ += 1;
  return id;
}

void KvPool::Free::operator()(uint8_t* p) const { std::free(p); }

void KvPool::Ref(int32_t block) { refs_[static_cast<size_t>(block)] += 1; }

void KvPool::Unref(int32_t block) {
  int& r = refs_[static_cast<size_t>(block)];
  assert(r > 0);
  if (--r == 0) {
    free_.push_back(block);
    used_ -= 1;
  }
}

}  // namespace flashd::engine
