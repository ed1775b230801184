#include "engine/prefix_cache.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cstring>

namespace flashd::engine {

PrefixCache::PrefixCache(cache::BlockStore* store, const CpuForward* forward,
                         cache::BlockKey fingerprint, uint32_t format)
    : store_(store), forward_(forward), fingerprint_(fingerprint), format_(format) {}

cache::KeyContext PrefixCache::KeyContextFor(const std::string& ns, bool snapshot) const {
  // Snapshots hash under their own format number, so no snapshot key can equal a block key.
  return cache::KeyContext{fingerprint_, format_ | (snapshot ? 0x80000000u : 0u), ns,
                           forward_->numerics()};
}

void PrefixCache::ExtendChain(std::span<const int32_t> tokens, size_t blocks,
                              const cache::KeyContext& ctx,
                              std::vector<cache::BlockKey>* chain) const {
  const size_t B = static_cast<size_t>(forward_->block_tokens());
  for (size_t j = chain->size(); j < blocks; ++j) {
    const cache::BlockKey parent = j == 0 ? cache::BlockKey{} : (*chain)[j - 1];
    chain->push_back(cache::ChainBlockKey(parent, tokens.subspan(j * B, B), ctx));
  }
}

PrefixKeys PrefixCache::KeysFor(std::span<const int32_t> tokens, const std::string& tenant) const {
  const size_t B = static_cast<size_t>(forward_->block_tokens());
  PrefixKeys k;
  ExtendChain(tokens, tokens.size() / B, KeyContextFor(tenant, false), &k.blocks);
  const cache::BlockKey parent = k.blocks.empty() ? cache::BlockKey{} : k.blocks.back();
  k.snapshot = cache::ChainBlockKey(parent, tokens.subspan(k.blocks.size() * B),
                                    KeyContextFor(tenant, true));
  return k;
}

RestorePlan PrefixCache::Plan(std::span<const int32_t> prompt, const std::string& tenant,
                              std::span<const std::string> shared) const {
  const auto t0 = std::chrono::steady_clock::now();
  RestorePlan result;
  const int64_t B = forward_->pool()->block_bytes() > 0 ? forward_->block_tokens() : 0;
  if (B == 0 || prompt.size() < 2) return result;
  // At least the last prompt token is always run: its logits give the first output token.
  const int64_t usable = static_cast<int64_t>(prompt.size()) - 1;
  const cache::KeyContext ctx = KeyContextFor(tenant, false);
  const cache::KeyContext snap_ctx = KeyContextFor(tenant, true);
  const size_t full = static_cast<size_t>(usable / B);
  // The chain of the prompt's full blocks: the tenant's own, or a prefix published to a group
  // the tenant belongs to, continued in the tenant's namespace; whichever holds more.
  std::vector<cache::BlockKey> keys;
  ExtendChain(prompt, full, ctx, &keys);
  size_t have = store_->PresentPrefix(keys);
  cache::KeyContext shared_snap_ctx = snap_ctx;
  for (const std::string& ns : shared) {
    std::vector<cache::BlockKey> k;
    ExtendChain(prompt, full, KeyContextFor(ns, false), &k);
    const size_t from_group = store_->PresentPrefix(k);
    if (from_group == 0) continue;
    k.resize(from_group);
    ExtendChain(prompt, full, ctx, &k);
    const size_t n = store_->PresentPrefix(k);
    if (n <= have) continue;
    keys = std::move(k);
    have = n;
    shared_snap_ctx = KeyContextFor(ns, true);
  }
  const int64_t replay = forward_->ExactReplayTokens();
  for (int attempt = 0; attempt < 3; ++attempt) {
    RestorePlan plan;
    // The deepest snapshot along the stored chain whose tail the prompt continues.
    int64_t snap_at = -1;
    size_t snap_blocks = 0;
    cache::BlockKey snap_key;
    std::vector<int32_t> snap_tail;
    for (size_t j = have + 1; j-- > 0 && snap_at < 0;) {
      const cache::BlockKey under = j == 0 ? cache::BlockKey{} : keys[j - 1];
      for (auto& ref : store_->SnapshotsUnder(under)) {
        const int64_t at = static_cast<int64_t>(j) * B + static_cast<int64_t>(ref.tail.size());
        if (at > usable || at <= snap_at) continue;
        if (!std::equal(ref.tail.begin(), ref.tail.end(), prompt.begin() + j * B)) continue;
        if (!(cache::ChainBlockKey(under, ref.tail, snap_ctx) == ref.key) &&
            !(cache::ChainBlockKey(under, ref.tail, shared_snap_ctx) == ref.key)) {
          continue;
        }
        snap_at = at;
        snap_blocks = j;
        snap_key = ref.key;
        snap_tail = ref.tail;
      }
    }
    const int64_t replay_start = static_cast<int64_t>(have) * B - replay;
    size_t read = 0;
    if (snap_at > 0 && snap_at >= replay_start) {
      plan.kind = RestorePlan::Kind::kSnapshot;
      plan.start = snap_at;
      read = snap_blocks;
    } else if (replay_start > 0) {
      plan.kind = RestorePlan::Kind::kReplay;
      plan.start = replay_start;
      read = have;
    } else {
      break;
    }
    std::vector<std::span<const int32_t>> spans;
    for (size_t j = 0; j < read; ++j) spans.push_back(prompt.subspan(j * B, B));
    plan.blocks.resize(read);
    const size_t block_bytes = forward_->pool()->block_bytes();
    // Each block goes from the store's reading thread straight into memory the pool adopts.
    auto got = store_->ReadBlocksInto(std::span(keys).first(read), spans,
                                      [&](size_t i, size_t bytes) -> uint8_t* {
                                        if (bytes != block_bytes) return nullptr;
                                        plan.blocks[i] = KvPool::NewBlockMemory(block_bytes);
                                        return plan.blocks[i].get();
                                      });
    size_t ok = 0;
    while (ok < read && got[ok]) ++ok;
    if (ok < read) {
      have = ok;  // A block went missing or failed its check: plan again with less.
      continue;
    }
    if (plan.kind == RestorePlan::Kind::kSnapshot) {
      std::optional<std::string> snap = store_->ReadSnapshot(snap_key, snap_tail);
      if (!snap) continue;  // Dropped as corrupt; the next plan cannot pick it again.
      plan.snapshot = std::move(*snap);
    }
    plan.chain.assign(keys.begin(), keys.begin() + static_cast<std::ptrdiff_t>(read));
    result = std::move(plan);
    break;
  }
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return result;
}

StatusOr<SequenceState> PrefixCache::Apply(RestorePlan& plan,
                                           std::span<const int32_t> prompt) const {
  if (plan.kind == RestorePlan::Kind::kNone) return Internal("nothing to restore");
  KvPool& pool = *forward_->pool();
  if (pool.capacity_blocks() - std::min(pool.capacity_blocks(), pool.used_blocks()) <
      plan.blocks.size()) {
    return ResourceExhausted("the KV pool has no room for the restored blocks");
  }
  std::vector<int32_t> ids;
  for (KvPool::BlockMemory& memory : plan.blocks) {
    const int32_t id = pool.Adopt(std::move(memory));
    if (id < 0) {
      for (int32_t taken : ids) pool.Unref(taken);
      return ResourceExhausted("the KV pool has no room for the restored blocks");
    }
    ids.push_back(id);
  }
  plan.blocks.clear();
  StatusOr<SequenceState> state =
      plan.kind == RestorePlan::Kind::kSnapshot
          ? forward_->Restore(plan.snapshot, std::move(ids))
          : forward_->ResumeAt(plan.start, prompt.first(plan.start), std::move(ids));
  if (state.ok() && state->position != plan.start) {
    return DataLoss("the restored state is at position " + std::to_string(state->position) +
                    ", the plan at " + std::to_string(plan.start));
  }
  return state;
}

void PrefixCache::StoreNewBlocks(std::span<const int32_t> fed, const SequenceState& state,
                                 const std::string& tenant,
                                 std::vector<cache::BlockKey>* chain) const {
  const size_t B = static_cast<size_t>(forward_->block_tokens());
  const KvPool& pool = *forward_->pool();
  const size_t from = chain->size();
  ExtendChain(fed, static_cast<size_t>(state.position) / B, KeyContextFor(tenant, false), chain);
  for (size_t j = from; j < chain->size(); ++j) {
    if (store_->Contains((*chain)[j])) continue;
    const uint8_t* bytes = pool.data(state.blocks[j]);
    store_->Put(cache::BlockStore::Kind::kBlock, (*chain)[j],
                j == 0 ? cache::BlockKey{} : (*chain)[j - 1], static_cast<uint32_t>(j + 1),
                fed.subspan(j * B, B),
                std::string(reinterpret_cast<const char*>(bytes), pool.block_bytes()));
  }
}

void PrefixCache::SaveSnapshot(std::span<const int32_t> fed, const SequenceState& state,
                               const std::string& tenant,
                               std::vector<cache::BlockKey>* chain) const {
  if (state.position == 0) return;
  StoreNewBlocks(fed, state, tenant, chain);
  const int64_t B = forward_->block_tokens();
  // A replayed restore read blocks past the position and is still re-running up to their end;
  // a state taken inside that stretch is not one a restore could reproduce, so none is stored.
  if (static_cast<int64_t>(chain->size()) * B > state.position) return;
  const size_t c = chain->size();
  const cache::BlockKey parent = c == 0 ? cache::BlockKey{} : (*chain)[c - 1];
  const std::span<const int32_t> tail =
      fed.subspan(c * B, static_cast<size_t>(state.position) - c * B);
  const cache::BlockKey key = cache::ChainBlockKey(parent, tail, KeyContextFor(tenant, true));
  if (store_->Contains(key)) return;
  store_->Put(cache::BlockStore::Kind::kSnapshot, key, parent, static_cast<uint32_t>(c), tail,
              state.Serialize(c));
}

}  // namespace flashd::engine
