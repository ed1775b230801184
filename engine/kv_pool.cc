#include "engine/kv_pool.h"

#include <cassert>
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
    s.kv_row = static_cast<size_t>(c.head_dim / 2 + c.head_dim / 16);
    s.key_row =
        p.owns_index_keys ? static_cast<size_t>(c.index_head_dim / 2 + c.index_head_dim / 32) : 0;
    s.offset = offset;
    offset += static_cast<size_t>(s.entries_per_block) * (s.kv_row + s.key_row);
    layout.source_of_layer[l] = static_cast<int>(layout.sources.size());
    layout.sources.push_back(s);
  }
  layout.block_bytes = offset;
  return layout;
}

KvPool::KvPool(size_t block_bytes, size_t capacity_blocks)
    : block_bytes_(block_bytes), capacity_(capacity_blocks) {}

int32_t KvPool::Allocate() {
  if (used_ >= capacity_) return -1;
  int32_t id;
  if (!free_.empty()) {
    id = free_.back();
    free_.pop_back();
    std::memset(blocks_[id].get(), 0, block_bytes_);
  } else {
    id = static_cast<int32_t>(blocks_.size());
    blocks_.push_back(std::make_unique<uint8_t[]>(std::max<size_t>(block_bytes_, 1)));
    refs_.push_back(0);
  }
  refs_[id] = 1;
  used_ += 1;
  return id;
}

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
