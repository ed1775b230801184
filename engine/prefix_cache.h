// PrefixCache: the prefix cache's policy over a BlockStore. Which stored prefix a prompt resumes
// from (the deepest snapshot whose tail the prompt continues, else the stored blocks plus an
// exact replay of the tokens before their end), turning that plan into a sequence state, and
// what a running sequence stores (each full block once, a snapshot at the end of a prompt or a
// generation).
//
// Thread-safety: Plan reads only the store (itself thread-safe) and may run on any thread (the
// engine's loader); Apply, StoreNewBlocks and SaveSnapshot touch the KV pool and belong to the
// engine thread.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "cache/block_key.h"
#include "cache/block_store.h"
#include "config/status.h"
#include "engine/forward.h"

namespace flashd::engine {

struct PrefixKeys {
  std::vector<cache::BlockKey> blocks;  // The full blocks' chain.
  cache::BlockKey snapshot;             // The state at the end.
};

// What a prompt resumes from, with the bytes already read and checked.
struct RestorePlan {
  enum class Kind { kNone, kSnapshot, kReplay } kind = Kind::kNone;
  int64_t start = 0;  // Position the sequence resumes at.
  // The leading blocks, read by the store's threads straight into memory the KV pool adopts as
  // its blocks at Apply (no copy between the disk's buffer and the pool).
  std::vector<KvPool::BlockMemory> blocks;
  std::vector<cache::BlockKey> chain;  // Their keys.
  std::string snapshot;
  double seconds = 0;  // Spent finding, reading and checking.
};

class PrefixCache {
 public:
  // REQUIRES: store and forward outlive this object.
  PrefixCache(cache::BlockStore* store, const CpuForward* forward, cache::BlockKey fingerprint,
              uint32_t format);

  // The key context of namespace `ns` (a tenant, or "group:NAME"), for blocks or snapshots.
  cache::KeyContext KeyContextFor(const std::string& ns, bool snapshot) const;
  // Appends to `chain` the keys of `tokens`' blocks from chain->size() up to `blocks`.
  void ExtendChain(std::span<const int32_t> tokens, size_t blocks, const cache::KeyContext& ctx,
                   std::vector<cache::BlockKey>* chain) const;
  PrefixKeys KeysFor(std::span<const int32_t> tokens, const std::string& tenant) const;

  // The best restore for `prompt` of `tenant` (also from prefixes published to `shared`).
  RestorePlan Plan(std::span<const int32_t> prompt, const std::string& tenant,
                   std::span<const std::string> shared) const;
  // The state the plan describes (its blocks adopted by the pool, so `plan.blocks` is emptied),
  // or an error (the pool full, a snapshot that does not fit): the caller then prefills from the
  // start.
  StatusOr<SequenceState> Apply(RestorePlan& plan, std::span<const int32_t> prompt) const;

  // Stores every full block of `fed` (the tokens `state` has run) not stored yet, extending
  // `chain` (the keys of the blocks stored so far).
  void StoreNewBlocks(std::span<const int32_t> fed, const SequenceState& state,
                      const std::string& tenant, std::vector<cache::BlockKey>* chain) const;
  // The blocks, then a snapshot of the state at its position.
  void SaveSnapshot(std::span<const int32_t> fed, const SequenceState& state,
                    const std::string& tenant, std::vector<cache::BlockKey>* chain) const;

 private:
  cache::BlockStore* store_;
  const CpuForward* forward_;
  cache::BlockKey fingerprint_;
  uint32_t format_;
};

}  // namespace flashd::engine
