#include "engine/engine.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

namespace flashd::engine {

void EventQueue::Push(GenerationEvent event) {
  event.time = std::chrono::steady_clock::now();
  {
    std::lock_guard<std::mutex> lock(mu_);
    events_.push_back(std::move(event));
  }
  cv_.notify_one();
}

std::optional<GenerationEvent> EventQueue::Pop(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!cv_.wait_for(lock, timeout, [&] { return !events_.empty(); })) return std::nullopt;
  GenerationEvent e = std::move(events_.front());
  events_.pop_front();
  return e;
}

struct Engine::Sequence {
  Handle handle = 0;
  GenerationRequest request;
  std::shared_ptr<EventQueue> queue;
  std::unique_ptr<Sampler> sampler;
  std::unique_ptr<StreamDecoder> decoder;
  SequenceState state;
  size_t prompt_done = 0;   // Prompt tokens already run.
  int32_t next_input = -1;  // The last sampled token, to run next (decode).
  int64_t generated = 0;
  uint64_t reserved = 0;
  std::string pending_text;  // Decoded text held back while it could start a stop string.
  int64_t last_reported_position = -1;
  bool done = false;
  // Prefix cache.
  std::vector<int32_t> fed;            // Every token run so far: prompt, then generated.
  std::vector<cache::BlockKey> chain;  // Keys of its full blocks, in order.
  struct Restore {
    enum class Kind { kNone, kSnapshot, kReplay } kind = Kind::kNone;
    int64_t start = 0;                // Position the sequence resumes at.
    std::vector<std::string> blocks;  // Leading blocks' bytes.
    std::string snapshot;
    double seconds = 0;
  } restore;
  int64_t cached_tokens = 0;
};

namespace {

// The block size, config, shard headers, and 4 KiB from each end of the first and last tensors:
// equal for a copy of the same checkpoint anywhere, different for other weights with the same
// shapes.
cache::BlockKey Fingerprint(const Model& model, int64_t block_tokens) {
  std::string bytes = "block_tokens=" + std::to_string(block_tokens) + "\n";
  std::ifstream config(std::filesystem::path(model.dir()) / "config.json", std::ios::binary);
  bytes.append(std::istreambuf_iterator<char>(config), std::istreambuf_iterator<char>());
  for (const auto& f : model.checkpoint().files()) bytes += f->header();
  const auto& tensors = model.checkpoint().tensors();
  for (const TensorView* t : {tensors.empty() ? nullptr : tensors.begin()->second,
                              tensors.empty() ? nullptr : tensors.rbegin()->second}) {
    if (t == nullptr || t->data == nullptr) continue;
    const size_t n = static_cast<size_t>(std::min<uint64_t>(t->nbytes, 4096));
    bytes.append(reinterpret_cast<const char*>(t->data), n);
    bytes.append(reinterpret_cast<const char*>(t->data + t->nbytes - n), n);
  }
  return cache::HashBytes(bytes);
}

}  // namespace

Engine::Engine(EngineOptions options) : options_(std::move(options)) {}

StatusOr<std::unique_ptr<Engine>> Engine::Open(const EngineOptions& options) {
  if (options.step_token_budget < 1 || options.prefill_chunk < 1 || options.max_running < 1) {
    return InvalidArgument("engine: step_token_budget, prefill_chunk and max_running must be >= 1");
  }
  std::unique_ptr<Engine> e(new Engine(options));
  FLASHD_ASSIGN_OR_RETURN(e->model_, Model::Load(options.model_dir));
  FLASHD_ASSIGN_OR_RETURN(e->forward_, CpuForward::Create(*e->model_, "", options.block_tokens));
  const std::string tokenizer =
      (std::filesystem::path(options.model_dir) / "tokenizer.json").string();
  if (std::filesystem::exists(tokenizer)) {
    FLASHD_ASSIGN_OR_RETURN(e->tokenizer_, Tokenizer::Load(tokenizer));
  }
  const ModelStats& s = e->model_->stats();
  e->per_token_bytes_ = static_cast<uint64_t>(std::ceil(s.kv_bytes_per_token));
  e->per_sequence_bytes_ = s.sequence_state_bytes;
  e->stats_.memory_budget_bytes = options.memory_budget_bytes;
  // The KV pool holds at most what the memory budget allows.
  KvPool& pool = *e->forward_->pool();
  if (pool.block_bytes() > 0) {
    pool.set_capacity_blocks(
        std::max<uint64_t>(1, options.memory_budget_bytes / pool.block_bytes()));
  }
  e->fingerprint_ = Fingerprint(*e->model_, options.block_tokens);
  e->thread_ = std::thread([raw = e.get()] { raw->Loop(); });
  if (options.cache) e->loader_ = std::thread([raw = e.get()] { raw->LoaderLoop(); });
  return e;
}

Engine::~Engine() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  loader_cv_.notify_all();
  if (loader_.joinable()) loader_.join();
  if (thread_.joinable()) thread_.join();
}

const ModelConfig& Engine::config() const { return forward_->config(); }

Engine::Stats Engine::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

std::pair<Engine::Handle, std::shared_ptr<EventQueue>> Engine::Submit(GenerationRequest request) {
  auto seq = std::make_unique<Sequence>();
  seq->queue = std::make_shared<EventQueue>();
  seq->request = std::move(request);
  auto queue = seq->queue;
  Status invalid = seq->request.sampling.Validate();
  if (invalid.ok() && seq->request.prompt.empty()) invalid = InvalidArgument("prompt: empty");
  for (int32_t t : seq->request.prompt) {
    if (invalid.ok() && (t < 0 || t >= config().vocab_size)) {
      invalid =
          InvalidArgument("prompt: token id " + std::to_string(t) + " outside the vocabulary");
    }
  }
  const int64_t context = config().max_position_embeddings;
  const int64_t wanted = static_cast<int64_t>(seq->request.prompt.size()) +
                         static_cast<int64_t>(seq->request.sampling.max_tokens);
  if (invalid.ok() && context > 0 && wanted > context) {
    invalid = InvalidArgument(
        "prompt: " + std::to_string(seq->request.prompt.size()) + " tokens plus max_tokens " +
        std::to_string(seq->request.sampling.max_tokens) + " exceed the model's context of " +
        std::to_string(context) + " tokens");
  }
  // A request that cannot fit even alone is refused now, not after waiting its turn.
  const uint64_t need = MemoryNeed(seq->request);
  if (invalid.ok() && need > options_.memory_budget_bytes) {
    invalid = ResourceExhausted("the request needs " + std::to_string(need) +
                                " bytes of KV and state, more than the engine's memory budget (" +
                                std::to_string(options_.memory_budget_bytes) + " bytes)");
  }
  if (invalid.ok() && !seq->request.sampling.stop.empty() && !tokenizer_) {
    invalid = InvalidArgument("stop: stop strings need the model's tokenizer.json");
  }
  std::lock_guard<std::mutex> lock(mu_);
  seq->handle = next_handle_++;
  const Handle handle = seq->handle;
  if (!invalid.ok()) {
    GenerationEvent e;
    e.kind = GenerationEvent::Kind::kDone;
    e.finish_reason = "error";
    e.error = invalid;
    queue->Push(std::move(e));
    return {handle, queue};
  }
  if (options_.cache) {
    // The loader finds and reads what the cache holds for it, off the engine thread.
    loading_.insert(handle);
    lookups_.push_back(std::move(seq));
    loader_cv_.notify_one();
    return {handle, queue};
  }
  incoming_.push_back(std::move(seq));
  cv_.notify_all();
  return {handle, queue};
}

void Engine::LoaderLoop() {
  for (;;) {
    std::unique_ptr<Sequence> s;
    {
      std::unique_lock<std::mutex> lock(mu_);
      loader_cv_.wait(lock, [&] { return stopping_ || !lookups_.empty(); });
      if (stopping_) {
        for (auto& q : lookups_) Finish(*q, "cancelled");
        lookups_.clear();
        return;
      }
      s = std::move(lookups_.front());
      lookups_.pop_front();
    }
    PlanRestore(*s);
    {
      std::lock_guard<std::mutex> lock(mu_);
      loading_.erase(s->handle);
      if (cancel_after_load_.erase(s->handle)) {
        Finish(*s, "cancelled");
        continue;
      }
      incoming_.push_back(std::move(s));
    }
    cv_.notify_all();
  }
}

cache::KeyContext Engine::KeyContextFor(const std::string& ns, bool snapshot) const {
  // Snapshots hash under their own format number, so no snapshot key can equal a block key.
  return cache::KeyContext{fingerprint_, kCacheFormat | (snapshot ? 0x80000000u : 0u), ns,
                           forward_->numerics()};
}

void Engine::ExtendChain(std::span<const int32_t> tokens, size_t blocks,
                         const cache::KeyContext& ctx, std::vector<cache::BlockKey>* chain) const {
  const size_t B = static_cast<size_t>(forward_->block_tokens());
  for (size_t j = chain->size(); j < blocks; ++j) {
    const cache::BlockKey parent = j == 0 ? cache::BlockKey{} : (*chain)[j - 1];
    chain->push_back(cache::ChainBlockKey(parent, tokens.subspan(j * B, B), ctx));
  }
}

Engine::PrefixKeys Engine::KeysFor(std::span<const int32_t> tokens,
                                   const std::string& tenant) const {
  const size_t B = static_cast<size_t>(forward_->block_tokens());
  PrefixKeys k;
  ExtendChain(tokens, tokens.size() / B, KeyContextFor(tenant, false), &k.blocks);
  const cache::BlockKey parent = k.blocks.empty() ? cache::BlockKey{} : k.blocks.back();
  k.snapshot = cache::ChainBlockKey(parent, tokens.subspan(k.blocks.size() * B),
                                    KeyContextFor(tenant, true));
  return k;
}

void Engine::PlanRestore(Sequence& s) {
  const auto t0 = std::chrono::steady_clock::now();
  cache::BlockStore& store = *options_.cache;
  const std::vector<int32_t>& prompt = s.request.prompt;
  const int64_t B = forward_->pool()->block_bytes() > 0 ? forward_->block_tokens() : 0;
  if (B == 0 || prompt.size() < 2) return;
  // At least the last prompt token is always run: its logits give the first output token.
  const int64_t usable = static_cast<int64_t>(prompt.size()) - 1;
  const std::string& tenant = s.request.tenant;
  const cache::KeyContext ctx = KeyContextFor(tenant, false);
  const cache::KeyContext snap_ctx = KeyContextFor(tenant, true);
  const size_t full = static_cast<size_t>(usable / B);
  // The chain of the prompt's full blocks: the tenant's own, or a prefix published to a group
  // the tenant belongs to, continued in the tenant's namespace; whichever holds more.
  std::vector<cache::BlockKey> keys;
  ExtendChain(prompt, full, ctx, &keys);
  size_t have = store.PresentPrefix(keys);
  cache::KeyContext shared_snap_ctx = snap_ctx;
  for (const std::string& ns : s.request.shared_namespaces) {
    std::vector<cache::BlockKey> k;
    ExtendChain(prompt, full, KeyContextFor(ns, false), &k);
    const size_t shared = store.PresentPrefix(k);
    if (shared == 0) continue;
    k.resize(shared);
    ExtendChain(prompt, full, ctx, &k);
    const size_t n = store.PresentPrefix(k);
    if (n <= have) continue;
    keys = std::move(k);
    have = n;
    shared_snap_ctx = KeyContextFor(ns, true);
  }
  const int64_t replay = forward_->ExactReplayTokens();
  for (int attempt = 0; attempt < 3; ++attempt) {
    Sequence::Restore plan;
    // The deepest snapshot along the stored chain whose tail the prompt continues.
    int64_t snap_at = -1;
    size_t snap_blocks = 0;
    cache::BlockKey snap_key;
    std::vector<int32_t> snap_tail;
    for (size_t j = have + 1; j-- > 0 && snap_at < 0;) {
      const cache::BlockKey under = j == 0 ? cache::BlockKey{} : keys[j - 1];
      for (auto& ref : store.SnapshotsUnder(under)) {
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
      plan.kind = Sequence::Restore::Kind::kSnapshot;
      plan.start = snap_at;
      read = snap_blocks;
    } else if (replay_start > 0) {
      plan.kind = Sequence::Restore::Kind::kReplay;
      plan.start = replay_start;
      read = have;
    } else {
      break;
    }
    std::vector<std::span<const int32_t>> spans;
    for (size_t j = 0; j < read; ++j) spans.push_back(std::span(prompt).subspan(j * B, B));
    auto got = store.ReadBlocks(std::span(keys).first(read), spans);
    size_t ok = 0;
    while (ok < read && got[ok].has_value()) ++ok;
    if (ok < read) {
      have = ok;  // A block went missing or failed its check: plan again with less.
      continue;
    }
    if (plan.kind == Sequence::Restore::Kind::kSnapshot) {
      std::optional<std::string> snap = store.ReadSnapshot(snap_key, snap_tail);
      if (!snap) continue;  // Dropped as corrupt; the next plan cannot pick it again.
      plan.snapshot = std::move(*snap);
    }
    for (auto& b : got) plan.blocks.push_back(std::move(*b));
    s.chain.assign(keys.begin(), keys.begin() + static_cast<std::ptrdiff_t>(read));
    s.restore = std::move(plan);
    break;
  }
  s.restore.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void Engine::ApplyRestore(Sequence& s) {
  using Kind = Sequence::Restore::Kind;
  Sequence::Restore plan = std::move(s.restore);
  s.restore = {};
  s.fed.clear();
  if (plan.kind == Kind::kNone) {
    s.chain.clear();
    return;
  }
  KvPool& pool = *forward_->pool();
  std::vector<int32_t> ids;
  bool ok = true;
  for (const std::string& bytes : plan.blocks) {
    const int32_t id = bytes.size() == pool.block_bytes() ? pool.Allocate() : -1;
    if (id < 0) {
      ok = false;
      break;
    }
    std::memcpy(pool.data(id), bytes.data(), bytes.size());
    ids.push_back(id);
  }
  StatusOr<SequenceState> state = Internal("not restored");
  if (!ok) {
    for (int32_t id : ids) pool.Unref(id);
  } else if (plan.kind == Kind::kSnapshot) {
    state = forward_->Restore(plan.snapshot, std::move(ids));
  } else {
    const std::span<const int32_t> before = std::span(s.request.prompt).first(plan.start);
    state = forward_->ResumeAt(plan.start, before, std::move(ids));
  }
  if (!ok || !state.ok() || state->position != plan.start) {
    spdlog::warn("prefix cache: restore failed, prefilling instead: {}",
                 state.ok() ? "position mismatch" : state.status().ToString());
    s.chain.clear();
    return;
  }
  s.state = std::move(*state);
  s.prompt_done = static_cast<size_t>(plan.start);
  s.fed.assign(s.request.prompt.begin(), s.request.prompt.begin() + plan.start);
  s.cached_tokens = plan.start;
  std::lock_guard<std::mutex> lock(mu_);
  if (plan.kind == Kind::kSnapshot) {
    stats_.cache_snapshot_hits += 1;
  } else {
    stats_.cache_replay_hits += 1;
    stats_.cache_replayed_tokens +=
        static_cast<int64_t>(s.chain.size()) * forward_->block_tokens() - plan.start;
  }
  stats_.cache_restore_seconds += plan.seconds;
}

void Engine::StoreNewBlocks(Sequence& s) {
  if (!options_.cache) return;
  const size_t B = static_cast<size_t>(forward_->block_tokens());
  const KvPool& pool = *forward_->pool();
  const size_t from = s.chain.size();
  ExtendChain(s.fed, static_cast<size_t>(s.state.position) / B,
              KeyContextFor(s.request.tenant, false), &s.chain);
  for (size_t j = from; j < s.chain.size(); ++j) {
    if (options_.cache->Contains(s.chain[j])) continue;
    const uint8_t* bytes = pool.data(s.state.blocks[j]);
    options_.cache->Put(cache::BlockStore::Kind::kBlock, s.chain[j],
                        j == 0 ? cache::BlockKey{} : s.chain[j - 1], static_cast<uint32_t>(j + 1),
                        std::span(s.fed).subspan(j * B, B),
                        std::string(reinterpret_cast<const char*>(bytes), pool.block_bytes()));
  }
}

void Engine::SaveSnapshot(Sequence& s) {
  if (!options_.cache || s.state.position == 0) return;
  StoreNewBlocks(s);
  const int64_t B = forward_->block_tokens();
  const size_t c = s.chain.size();
  const cache::BlockKey parent = c == 0 ? cache::BlockKey{} : s.chain[c - 1];
  const std::span<const int32_t> tail =
      std::span(s.fed).subspan(c * B, static_cast<size_t>(s.state.position) - c * B);
  const cache::BlockKey key =
      cache::ChainBlockKey(parent, tail, KeyContextFor(s.request.tenant, true));
  if (options_.cache->Contains(key)) return;
  options_.cache->Put(cache::BlockStore::Kind::kSnapshot, key, parent, static_cast<uint32_t>(c),
                      tail, s.state.Serialize(c));
}

uint64_t Engine::MemoryNeed(const GenerationRequest& r) const {
  return (r.prompt.size() + static_cast<uint64_t>(r.sampling.max_tokens)) * per_token_bytes_ +
         per_sequence_bytes_;
}

void Engine::Cancel(Handle handle) {
  std::lock_guard<std::mutex> lock(mu_);
  cancels_.push_back(handle);
  cv_.notify_all();
}

void Engine::Finish(Sequence& s, const std::string& reason, Status error) {
  if (s.done) return;
  s.done = true;
  GenerationEvent e;
  e.kind = GenerationEvent::Kind::kDone;
  e.finish_reason = reason;
  e.error = std::move(error);
  e.prompt_tokens = static_cast<int64_t>(s.request.prompt.size());
  e.completion_tokens = s.generated;
  e.cached_tokens = s.cached_tokens;
  e.step = step_;
  if (reason == "stop" || reason == "length") SaveSnapshot(s);
  if (reason != "stop" && !s.pending_text.empty()) {
    // Held-back text that turned out not to be a stop string is delivered before the end.
    GenerationEvent t;
    t.kind = GenerationEvent::Kind::kToken;
    t.token.token = -1;
    t.text = std::move(s.pending_text);
    s.queue->Push(std::move(t));
  }
  s.queue->Push(std::move(e));
}

void Engine::Loop() {
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] {
        return stopping_ || !incoming_.empty() || !cancels_.empty() || !running_.empty() ||
               !waiting_.empty();
      });
      if (stopping_) break;
    }
    Step();
  }
  // Shutting down: everything outstanding ends as cancelled.
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& s : incoming_) Finish(*s, "cancelled");
  for (auto& s : waiting_) Finish(*s, "cancelled");
  for (auto& s : running_) Finish(*s, "cancelled");
}

bool Engine::Step() {
  std::vector<Handle> cancels;
  {
    std::lock_guard<std::mutex> lock(mu_);
    while (!incoming_.empty()) {
      waiting_.push_back(std::move(incoming_.front()));
      incoming_.pop_front();
    }
    cancels.swap(cancels_);
  }
  ++step_;
  uint64_t reserved = 0;
  for (auto& s : running_) reserved += s->reserved;

  // Cancellations: waiting ones simply leave; running ones free what they hold.
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (Handle h : cancels) {
      if (loading_.count(h)) cancel_after_load_.insert(h);
    }
  }
  for (Handle h : cancels) {
    for (auto& s : waiting_) {
      if (s->handle == h) Finish(*s, "cancelled");
    }
    for (auto& s : running_) {
      if (s->handle == h) Finish(*s, "cancelled");
    }
  }

  // Admission, first come first served, while memory and slots allow.
  for (auto it = waiting_.begin(); it != waiting_.end();) {
    Sequence& s = **it;
    if (s.done) {
      it = waiting_.erase(it);
      continue;
    }
    const uint64_t need = MemoryNeed(s.request);
    if (reserved + need > options_.memory_budget_bytes ||
        static_cast<int64_t>(running_.size()) >= options_.max_running) {
      break;
    }
    s.reserved = need;
    reserved += need;
    s.state = forward_->NewSequence();
    if (options_.cache) {
      ApplyRestore(s);
      std::lock_guard<std::mutex> lock(mu_);
      stats_.cache_lookups += 1;
      stats_.cache_hit_tokens += s.cached_tokens;
      stats_.cache_miss_tokens += static_cast<int64_t>(s.request.prompt.size()) - s.cached_tokens;
    }
    s.sampler = std::make_unique<Sampler>(s.request.sampling, s.request.prompt);
    if (tokenizer_) s.decoder = std::make_unique<StreamDecoder>(tokenizer_.get());
    running_.push_back(std::move(*it));
    it = waiting_.erase(it);
  }
  // Whoever still waits learns its place in the queue when it changes.
  int64_t position = 0;
  for (auto& s : waiting_) {
    if (s->last_reported_position != position) {
      GenerationEvent e;
      e.kind = GenerationEvent::Kind::kQueued;
      e.queue_position = position;
      e.step = step_;
      s->queue->Push(std::move(e));
      s->last_reported_position = position;
    }
    ++position;
  }

  // The batch: every decoding sequence's next token first, then prefill chunks by tenant.
  std::vector<Sequence*> decoding, prefilling;
  for (auto& s : running_) {
    if (s->done) continue;
    (s->prompt_done < s->request.prompt.size() ? prefilling : decoding).push_back(s.get());
  }
  int64_t budget = options_.step_token_budget;
  std::vector<BatchItem> items;
  std::vector<Sequence*> owners;
  std::vector<std::vector<float>> logits(decoding.size() + prefilling.size());
  std::vector<std::vector<int32_t>> inputs(logits.size());
  for (Sequence* s : decoding) {
    if (budget <= 0) break;
    inputs[owners.size()] = {s->next_input};
    owners.push_back(s);
    --budget;
  }
  // Round-robin over tenants: each tenant's oldest prefilling sequence in turn.
  std::map<std::string, std::deque<Sequence*>> by_tenant;
  for (Sequence* s : prefilling) by_tenant[s->request.tenant].push_back(s);
  std::vector<std::string> tenants;
  for (auto& [t, q] : by_tenant) tenants.push_back(t);
  size_t turn = tenants.empty() ? 0 : tenant_turn_ % tenants.size();
  tenant_turn_ += 1;
  while (budget > 0 && !by_tenant.empty()) {
    const std::string& tenant = tenants[turn % tenants.size()];
    ++turn;
    auto found = by_tenant.find(tenant);
    if (found == by_tenant.end()) continue;
    Sequence* s = found->second.front();
    found->second.pop_front();
    if (found->second.empty()) by_tenant.erase(found);
    const size_t left = s->request.prompt.size() - s->prompt_done;
    const size_t n = std::min<size_t>(
        {left, static_cast<size_t>(options_.prefill_chunk), static_cast<size_t>(budget)});
    inputs[owners.size()].assign(s->request.prompt.begin() + s->prompt_done,
                                 s->request.prompt.begin() + s->prompt_done + n);
    owners.push_back(s);
    budget -= static_cast<int64_t>(n);
  }

  int64_t prompt_tokens = 0;
  if (!owners.empty()) {
    // A sequence whose KV blocks do not fit ends with its own error; the others go on.
    std::vector<Status> item_status(owners.size());
    for (size_t i = 0; i < owners.size(); ++i) {
      items.push_back({&owners[i]->state, inputs[i], &logits[i], &item_status[i]});
    }
    ForwardOptions fo;
    fo.threads = options_.threads;
    Status s = forward_->ForwardBatch(items, fo);
    if (!s.ok()) {
      spdlog::error("engine step {}: {}", step_, s.ToString());
      for (Sequence* o : owners) Finish(*o, "error", s);
    } else {
      for (size_t i = 0; i < owners.size(); ++i) {
        Sequence& q = *owners[i];
        if (!item_status[i].ok()) {
          spdlog::warn("engine step {}: {}", step_, item_status[i].ToString());
          Finish(q, "error", item_status[i]);
          continue;
        }
        const bool was_prefill = q.prompt_done < q.request.prompt.size();
        if (options_.cache) {
          q.fed.insert(q.fed.end(), inputs[i].begin(), inputs[i].end());
          StoreNewBlocks(q);
        }
        if (was_prefill) {
          q.prompt_done += inputs[i].size();
          prompt_tokens += static_cast<int64_t>(inputs[i].size());
          if (q.prompt_done < q.request.prompt.size()) continue;  // More prompt next step.
          SaveSnapshot(q);
        }
        SampledToken t = q.sampler->Sample(logits[i]);
        q.generated += 1;
        q.next_input = t.token;
        const SamplingParams& sp = q.request.sampling;
        const bool stop_token = (t.token == config().eos_token_id && !sp.ignore_eos) ||
                                std::find(sp.stop_tokens.begin(), sp.stop_tokens.end(), t.token) !=
                                    sp.stop_tokens.end();
        GenerationEvent e;
        e.kind = GenerationEvent::Kind::kToken;
        e.token = t;
        e.step = step_;
        e.prompt_tokens = static_cast<int64_t>(q.request.prompt.size());
        e.cached_tokens = q.cached_tokens;
        bool stop_string = false;
        if (q.decoder && !stop_token) {
          q.pending_text += q.decoder->Push(t.token);
          // A stop string ends the output before it; text that could start one waits.
          size_t cut = std::string::npos;
          for (const std::string& st : sp.stop) cut = std::min(cut, q.pending_text.find(st));
          if (cut != std::string::npos) {
            e.text = q.pending_text.substr(0, cut);
            q.pending_text.clear();
            stop_string = true;
          } else {
            size_t hold = 0;
            for (const std::string& st : sp.stop) {
              for (size_t n = std::min(st.size() - 1, q.pending_text.size()); n > hold; --n) {
                if (q.pending_text.compare(q.pending_text.size() - n, n, st, 0, n) == 0) {
                  hold = n;
                  break;
                }
              }
            }
            e.text = q.pending_text.substr(0, q.pending_text.size() - hold);
            q.pending_text.erase(0, q.pending_text.size() - hold);
          }
        }
        q.queue->Push(std::move(e));
        if (stop_token || stop_string) {
          Finish(q, "stop");
        } else if (q.generated >= sp.max_tokens) {
          Finish(q, "length");
        }
      }
    }
  }

  // Finished sequences leave and give back their memory.
  int64_t generated = 0;
  for (Sequence* o : owners) generated += o->prompt_done >= o->request.prompt.size() ? 1 : 0;
  running_.erase(std::remove_if(running_.begin(), running_.end(),
                                [](const std::unique_ptr<Sequence>& s) { return s->done; }),
                 running_.end());
  waiting_.erase(std::remove_if(waiting_.begin(), waiting_.end(),
                                [](const std::unique_ptr<Sequence>& s) { return s->done; }),
                 waiting_.end());
  uint64_t still_reserved = 0;
  for (auto& s : running_) still_reserved += s->reserved;
  std::lock_guard<std::mutex> lock(mu_);
  stats_.waiting = static_cast<int64_t>(waiting_.size() + incoming_.size());
  stats_.running = static_cast<int64_t>(running_.size());
  stats_.memory_reserved_bytes = still_reserved;
  stats_.steps = step_;
  stats_.tokens_generated += generated;
  stats_.prompt_tokens_processed += prompt_tokens;
  const KvPool& pool = *forward_->pool();
  stats_.pool_used_bytes = pool.used_blocks() * pool.block_bytes();
  stats_.pool_capacity_bytes = pool.capacity_blocks() * pool.block_bytes();
  return !owners.empty();
}

}  // namespace flashd::engine
