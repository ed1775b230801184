#include "engine/block_manager.h"

#include <cstring>
#include <string>

namespace flashd::engine {

BlockReservation::BlockReservation(BlockReservation&& other) noexcept { *this = std::move(other); }

BlockReservation& BlockReservation::operator=(BlockReservation&& other) noexcept {
  if (this == &other) return *this;
  Rollback();
  pool_ = other.pool_;
  blocks_ = other.blocks_;
  old_size_ = other.old_size_;
  copies_ = std::move(other.copies_);
  open_ = other.open_;
  other.open_ = false;
  other.copies_.clear();
  return *this;
}

BlockReservation::~BlockReservation() { Rollback(); }

void BlockReservation::Commit() {
  if (!open_) return;
  for (const Copy& c : copies_) pool_->Unref(c.original);
  copies_.clear();
  open_ = false;
}

void BlockReservation::Rollback() {
  if (!open_) return;
  for (const Copy& c : copies_) {
    (*blocks_)[c.index] = c.original;
    pool_->Unref(c.copy);
  }
  for (size_t i = old_size_; i < blocks_->size(); ++i) pool_->Unref((*blocks_)[i]);
  blocks_->resize(old_size_);
  copies_.clear();
  open_ = false;
}

StatusOr<BlockReservation> BlockManager::Reserve(std::vector<int32_t>* blocks, size_t first,
                                                 size_t last) {
  BlockReservation r;
  r.pool_ = pool_.get();
  r.blocks_ = blocks;
  r.old_size_ = blocks->size();
  r.open_ = true;
  auto full = [&](const char* what) {
    return ResourceExhausted(std::string("KV pool full ") + what + " (" +
                             std::to_string(pool_->capacity_blocks()) + " blocks of " +
                             std::to_string(pool_->block_bytes()) + " bytes)");
  };
  while (blocks->size() < last) {
    const int32_t id = pool_->Allocate();
    if (id < 0) return full("for a new block");  // r's destructor gives back what it took.
    blocks->push_back(id);
  }
  for (size_t i = first; i < std::min(last, r.old_size_); ++i) {
    const int32_t original = (*blocks)[i];
    if (pool_->refs(original) <= 1) continue;
    // Shared with another sequence: this one writes its own copy.
    const int32_t copy = pool_->Allocate();
    if (copy < 0) return full("while copying a shared block");
    std::memcpy(pool_->mutable_data(copy), pool_->data(original), pool_->block_bytes());
    (*blocks)[i] = copy;
    r.copies_.push_back({i, original, copy});
  }
  return r;
}

}  // namespace flashd::engine
