// BlockManager: the KV blocks a forward step writes, made present and exclusively owned before
// the step, all at once, so that no allocation happens between two ops and a full pool fails one
// sequence cleanly instead of a layer half-way through a batch.
//
// A BlockReservation changes a sequence's block list (new blocks appended, shared blocks replaced
// by private copies) but gives up nothing until Commit(): Rollback() (or destruction without a
// commit) restores the list and returns every block it took, so a step that fails leaves each
// sequence's blocks exactly as they were.
//
// Thread-safety: the engine thread only, like KvPool's counts.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "config/status.h"
#include "engine/kv_pool.h"

namespace flashd::engine {

class BlockReservation {
 public:
  BlockReservation() = default;
  BlockReservation(BlockReservation&& other) noexcept;
  BlockReservation& operator=(BlockReservation&& other) noexcept;
  BlockReservation(const BlockReservation&) = delete;
  BlockReservation& operator=(const BlockReservation&) = delete;
  ~BlockReservation();

  // Keeps the changes: the blocks the copies replaced lose this sequence's reference.
  void Commit();
  // Undoes the changes (idempotent; a no-op after Commit).
  void Rollback();

 private:
  friend class BlockManager;
  KvPool* pool_ = nullptr;
  std::vector<int32_t>* blocks_ = nullptr;
  size_t old_size_ = 0;
  struct Copy {
    size_t index;
    int32_t original, copy;
  };
  std::vector<Copy> copies_;
  bool open_ = false;
};

class BlockManager {
 public:
  explicit BlockManager(std::shared_ptr<KvPool> pool) : pool_(std::move(pool)) {}

  // Makes blocks [first, last) of `blocks` present (appending zeroed ones) and private (copying
  // any shared with another sequence). On failure nothing has changed and the status says the
  // pool is full. REQUIRES: `blocks` outlives the reservation and nobody else changes it
  // meanwhile.
  StatusOr<BlockReservation> Reserve(std::vector<int32_t>* blocks, size_t first, size_t last);

  KvPool& pool() { return *pool_; }

 private:
  std::shared_ptr<KvPool> pool_;
};

}  // namespace flashd::engine
