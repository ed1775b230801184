#include "engine/engine.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <sstream>

#include "engine/engram_store.h"
#include "engine/gpu_backend.h"
#include "engine/placement_plan.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/parallel.h"

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
  RestorePlan restore;                 // Found by the loader, applied at admission.
  int64_t cached_tokens = 0;
  // DSpark: the drafted tokens to verify after next_input, the distributions they were drawn
  // from, the tokens the last verification emitted, and how many drafts may be verified at once
  // (halved when none is accepted, grown when all are; 0 waits `probe_in` steps, a wait that
  // doubles, up to 256, each time a probe of one draft fails again).
  std::vector<int32_t> draft;
  std::vector<TokenDistribution> draft_q;
  std::vector<SampledToken> emitted;
  int draft_cap = 0;
  int probe_in = 0;
  int probe_wait = 8;
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

// The backends of engine.backend, engine.gpus and engine.routed_experts, and which layers run
// on which (the layer split of `flashd plan` over the GPUs' memory).
StatusOr<Placement> PlaceModel(const EngineOptions& options, const Model& model) {
  Placement placement;
  std::string why;
  const GpuOptions gpu{.matrix_gemms = options.gpu_gemms == "matrix"};
  FLASHD_ASSIGN_OR_RETURN(std::unique_ptr<Backend> first,
                          SelectBackend(options.backend, &why, 0, gpu));
  const std::string kind(first->name());
  const BackendReport report = first->Report();
  const std::string& gemms = report.gemms;
  if (gpu.matrix_gemms && kind == "cpu") {
    why += "; engine.gpu_gemms: matrix has no effect on the CPU";
  } else if (gemms != "exact") {
    why += "; FP8/FP4 GEMMs on matrix cores";
    if (gemms == "matrix wgmma") why += " (Hopper's warpgroup instruction)";
    if (gemms == "matrix mfma") why += " (AMD's 32 x 32 matrix instruction)";
    if (gemms == "matrix stand-in") {
      why += " (a stand-in: this device lacks the instruction, slow)";
    }
  }
  if (report.early_launch) {
    why += "; kernels start early (programmatic dependent launch)";
  }
  spdlog::info("engine: {}", why);
  if (options.gpus > 1 && kind == "cpu") {
    return InvalidArgument("engine.gpus: " + std::to_string(options.gpus) +
                           " GPUs asked for, but the engine runs on the CPU (" + why + ")");
  }
  placement.backends.push_back(std::move(first));
  for (int i = 1; i < options.gpus; ++i) {
    std::string ignored;
    auto next = SelectBackend(kind, &ignored, i, gpu);
    if (!next.ok()) {
      return InvalidArgument("engine.gpus: " + std::to_string(options.gpus) +
                             " asked for: " + next.status().message());
    }
    placement.backends.push_back(std::move(*next));
  }
  std::string where;
  if (options.gpus > 1) {
    PlanOptions plan_options;
    for (const auto& b : placement.backends) {
      const BackendReport r = b->Report();
      plan_options.gpus.push_back({r.device, r.memory_total});
    }
    placement.layer_backend = MakePlan(model.config(), plan_options).layer_gpu;
    for (size_t l = 0; l < placement.layer_backend.size(); ++l) {
      if (l == 0 || placement.layer_backend[l] != placement.layer_backend[l - 1]) {
        where += where.empty() ? "layers " : ", ";
        where += std::to_string(l) + "+ on " + kind + ":";
        where += std::to_string(placement.layer_backend[l]);
      }
    }
  }
  if (options.routed_experts == "cpu") {
    placement.backends.push_back(std::make_unique<CpuBackend>());
    placement.routed_experts = static_cast<int>(placement.backends.size()) - 1;
    where += where.empty() ? "" : "; ";
    where += "routed experts on the CPU";
  }
  if (!where.empty()) spdlog::info("engine: placement: {}", where);
  return placement;
}

}  // namespace

Engine::Engine(EngineOptions options)
    : options_(std::move(options)),
      scheduler_({.step_token_budget = options_.step_token_budget,
                  .prefill_chunk = options_.prefill_chunk,
                  .max_running = options_.max_running,
                  .memory_budget_bytes = options_.memory_budget_bytes}) {}

StatusOr<std::unique_ptr<Engine>> Engine::Open(const EngineOptions& options) {
  if (options.step_token_budget < 1 || options.prefill_chunk < 1 || options.max_running < 1) {
    return InvalidArgument("engine: step_token_budget, prefill_chunk and max_running must be >= 1");
  }
  std::unique_ptr<Engine> e(new Engine(options));
  FLASHD_ASSIGN_OR_RETURN(e->model_, Model::Load(options.model_dir));
  FLASHD_ASSIGN_OR_RETURN(Placement placement, PlaceModel(options, *e->model_));
  FLASHD_ASSIGN_OR_RETURN(
      e->forward_, CpuForward::Create(*e->model_, "", options.block_tokens, std::move(placement)));
  if (options.engram == "ssd" && !e->model_->config().engram_layer_ids.empty()) {
    // Engram rows read from the checkpoint's files behind a cache of hot rows, instead of the
    // mapped tables (which the kernel would otherwise page in and out of memory).
    FLASHD_ASSIGN_OR_RETURN(std::vector<EngramTableFile> tables,
                            EngramTableFiles(e->model_->checkpoint(), e->model_->config()));
    FLASHD_ASSIGN_OR_RETURN(auto store,
                            EngramStore::Open(std::move(tables), options.engram_cache_bytes));
    FLASHD_RETURN_IF_ERROR(e->forward_->SetEngramStore(std::move(store)));
    spdlog::info("engine: Engram rows read from SSD with io_uring, {:.0f} MiB cache of hot rows",
                 options.engram_cache_bytes / 1048576.0);
  }
  if (options.speculative == "dspark") {
    if (e->model_->weights().dspark) {
      FLASHD_RETURN_IF_ERROR(e->forward_->EnableDSpark());
      spdlog::info("engine: speculative decoding with DSpark ({} stages, blocks of {}, {})",
                   e->model_->config().num_nextn_predict_layers, e->forward_->dspark_block(),
                   options.speculative_tokens == 0
                       ? std::string("adaptive")
                       : std::to_string(options.speculative_tokens) + " verified per step");
    } else {
      spdlog::info("engine: speculative decoding off: the checkpoint has no DSpark heads");
    }
  }
  {
    // Every weight on its GPU now, not during the first request.
    const auto start = std::chrono::steady_clock::now();
    uint64_t uploaded = 0;
    FLASHD_RETURN_IF_ERROR(e->forward_->UploadWeights([&](uint64_t done, uint64_t total) {
      uploaded = done;
      if (options.upload_progress) options.upload_progress(done, total);
    }));
    if (uploaded > 0) {
      const double s =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      spdlog::info("engine: weights on the device: {:.2f} GiB in {:.2f} s ({:.0f} MB/s)",
                   uploaded / 1073741824.0, s, s > 0 ? uploaded / s / 1e6 : 0.0);
    }
  }
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
  if (options.cache) {
    e->prefix_ = std::make_unique<PrefixCache>(options.cache.get(), e->forward_.get(),
                                               e->fingerprint_, kCacheFormat);
  }
  e->thread_ = std::thread([raw = e.get()] { raw->Loop(); });
  // Several loaders, so that one long restore (a million-token chain read from disk) never
  // holds the lookups of every request behind it.
  for (int i = 0; options.cache && i < kLoaderThreads; ++i) {
    e->loaders_.emplace_back([raw = e.get()] { raw->LoaderLoop(); });
  }
  return e;
}

Engine::~Engine() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  loader_cv_.notify_all();
  for (std::thread& t : loaders_) t.join();
  if (thread_.joinable()) thread_.join();
}

const ModelConfig& Engine::config() const { return forward_->config(); }
BackendReport Engine::backend() const { return forward_->backend().Report(); }

Engine::Stats Engine::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

std::pair<Engine::Handle, std::shared_ptr<EventQueue>> Engine::Submit(GenerationRequest request) {
  auto seq = std::make_unique<Sequence>();
  seq->queue = std::make_shared<EventQueue>();
  seq->request = std::move(request);
  auto queue = seq->queue;
  {
    // Snapshot positions strictly inside the prompt, ascending, each once; none without a cache.
    std::vector<int64_t>& at = seq->request.snapshot_at;
    if (!options_.cache) at.clear();
    const auto n = static_cast<int64_t>(seq->request.prompt.size());
    at.erase(std::remove_if(at.begin(), at.end(), [n](int64_t p) { return p <= 0 || p >= n; }),
             at.end());
    std::sort(at.begin(), at.end());
    at.erase(std::unique(at.begin(), at.end()), at.end());
  }
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

Engine::PrefixKeys Engine::KeysFor(std::span<const int32_t> tokens,
                                   const std::string& tenant) const {
  return prefix_ ? prefix_->KeysFor(tokens, tenant) : PrefixKeys{};
}

void Engine::PlanRestore(Sequence& s) {
  if (options_.before_lookup_for_test) options_.before_lookup_for_test(s.request);
  s.restore = prefix_->Plan(s.request.prompt, s.request.tenant, s.request.shared_namespaces);
}

void Engine::ApplyRestore(Sequence& s) {
  RestorePlan plan = std::move(s.restore);
  s.restore = {};
  s.fed.clear();
  s.chain.clear();
  if (plan.kind == RestorePlan::Kind::kNone) return;
  StatusOr<SequenceState> state = prefix_->Apply(plan, s.request.prompt);
  if (!state.ok()) {
    spdlog::warn("prefix cache: restore failed, prefilling instead: {}", state.status().ToString());
    return;
  }
  s.state = std::move(*state);
  s.prompt_done = static_cast<size_t>(plan.start);
  s.fed.assign(s.request.prompt.begin(), s.request.prompt.begin() + plan.start);
  s.cached_tokens = plan.start;
  s.chain = std::move(plan.chain);
  std::lock_guard<std::mutex> lock(mu_);
  if (plan.kind == RestorePlan::Kind::kSnapshot) {
    stats_.cache_snapshot_hits += 1;
  } else {
    stats_.cache_replay_hits += 1;
    stats_.cache_replayed_tokens +=
        static_cast<int64_t>(s.chain.size()) * forward_->block_tokens() - plan.start;
  }
  stats_.cache_restore_seconds += plan.seconds;
}

void Engine::StoreNewBlocks(Sequence& s) {
  if (prefix_) prefix_->StoreNewBlocks(s.fed, s.state, s.request.tenant, &s.chain);
}

size_t Engine::PromptRunLeft(const Sequence& s) const {
  const size_t left = s.request.prompt.size() - s.prompt_done;
  if (left == 0) return left;
  // A prefill chunk ends at the next requested snapshot position, so the state there is saved.
  const auto next = std::upper_bound(s.request.snapshot_at.begin(), s.request.snapshot_at.end(),
                                     static_cast<int64_t>(s.prompt_done));
  if (next == s.request.snapshot_at.end()) return left;
  return std::min(left, static_cast<size_t>(*next) - s.prompt_done);
}

void Engine::SaveSnapshot(Sequence& s) {
  if (prefix_) prefix_->SaveSnapshot(s.fed, s.state, s.request.tenant, &s.chain);
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

// Takes what Submit and the loader queued, and the cancellations.
std::vector<Engine::Handle> Engine::Intake() {
  std::vector<Handle> cancels;
  std::lock_guard<std::mutex> lock(mu_);
  while (!incoming_.empty()) {
    waiting_.push_back(std::move(incoming_.front()));
    incoming_.pop_front();
  }
  cancels.swap(cancels_);
  // A request still with the loader is cancelled when it comes back.
  for (Handle h : cancels) {
    if (loading_.count(h)) cancel_after_load_.insert(h);
  }
  return cancels;
}

// Admission (the scheduler's policy), then the queue positions of whoever still waits.
void Engine::Admit() {
  waiting_.erase(std::remove_if(waiting_.begin(), waiting_.end(),
                                [](const std::unique_ptr<Sequence>& s) { return s->done; }),
                 waiting_.end());
  uint64_t reserved = 0;
  for (auto& s : running_) reserved += s->reserved;
  std::vector<uint64_t> needs;
  for (auto& s : waiting_) needs.push_back(MemoryNeed(s->request));
  const size_t admit = scheduler_.Admit(needs, reserved, running_.size());
  for (size_t i = 0; i < admit; ++i) {
    Sequence& s = *waiting_.front();
    s.reserved = needs[i];
    s.state = forward_->NewSequence();
    if (options_.cache) {
      ApplyRestore(s);
      std::lock_guard<std::mutex> lock(mu_);
      stats_.cache_lookups += 1;
      stats_.cache_hit_tokens += s.cached_tokens;
      stats_.cache_miss_tokens += static_cast<int64_t>(s.request.prompt.size()) - s.cached_tokens;
    }
    s.sampler = std::make_unique<Sampler>(s.request.sampling, s.request.prompt);
    s.draft_cap = std::min(2, forward_->dspark_block());  // Grows while drafts are accepted.
    if (tokenizer_) s.decoder = std::make_unique<StreamDecoder>(tokenizer_.get());
    running_.push_back(std::move(waiting_.front()));
    waiting_.pop_front();
  }
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
}

namespace {

// Text a token completed, against the stop strings: a stop string ends the output before it
// (returns true); text that could start one waits in `pending`. `out` gets what may be sent.
bool CutAtStop(const std::vector<std::string>& stops, std::string* pending, std::string* out) {
  size_t cut = std::string::npos;
  for (const std::string& st : stops) cut = std::min(cut, pending->find(st));
  if (cut != std::string::npos) {
    *out = pending->substr(0, cut);
    pending->clear();
    return true;
  }
  size_t hold = 0;
  for (const std::string& st : stops) {
    for (size_t n = std::min(st.size() - 1, pending->size()); n > hold; --n) {
      if (pending->compare(pending->size() - n, n, st, 0, n) == 0) {
        hold = n;
        break;
      }
    }
  }
  *out = pending->substr(0, pending->size() - hold);
  pending->erase(0, pending->size() - hold);
  return false;
}

// Whether `token` ends the output by itself: the model's end of sentence (unless ignored) or
// one of the request's stop tokens.
bool IsStopToken(const SamplingParams& sp, int64_t eos, int32_t token) {
  return (token == eos && !sp.ignore_eos) ||
         std::find(sp.stop_tokens.begin(), sp.stop_tokens.end(), token) != sp.stop_tokens.end();
}

}  // namespace

// Delivers the sequence's next token, with the text it completes (held back while it could be
// the start of a stop string); ends the sequence on a stop token, a stop string or max_tokens.
void Engine::Deliver(Sequence& q, const SampledToken& t) {
  q.generated += 1;
  q.next_input = t.token;
  const SamplingParams& sp = q.request.sampling;
  const bool stop_token = IsStopToken(sp, config().eos_token_id, t.token);
  GenerationEvent e;
  e.kind = GenerationEvent::Kind::kToken;
  e.token = t;
  e.step = step_;
  e.prompt_tokens = static_cast<int64_t>(q.request.prompt.size());
  e.cached_tokens = q.cached_tokens;
  bool stop_string = false;
  if (q.decoder && !stop_token) {
    q.pending_text += q.decoder->Push(t.token);
    stop_string = CutAtStop(sp.stop, &q.pending_text, &e.text);
  }
  q.queue->Push(std::move(e));
  if (stop_token || stop_string) {
    Finish(q, "stop");
  } else if (q.generated >= sp.max_tokens) {
    Finish(q, "length");
  }
}

// Speculative sampling over a verified block [next_input, d1 .. dk]: row j of the logits
// decides the token after d_j (row 0: after next_input). Drafts are accepted in order while
// they agree (Sampler::Verify); the first disagreement, or the row after the last draft, gives
// one more token. A token that ends the sequence (a stop token, a stop string, max_tokens) is
// the last emitted and, as when decoding one token at a time, is not run: the sequence keeps
// exactly the tokens before each emitted one.
int64_t Engine::Verify(Sequence& q, std::span<const float> logits) {
  const size_t V = static_cast<size_t>(config().vocab_size);
  const SamplingParams& sp = q.request.sampling;
  const size_t k = q.draft.size();
  q.emitted.clear();
  int64_t accepted = 0;
  // Stop strings, checked as Deliver will check them, on copies of the text state.
  std::optional<StreamDecoder> text;
  std::string pending = q.pending_text, unused;
  if (q.decoder && !sp.stop.empty()) text.emplace(*q.decoder);
  for (size_t j = 0; j <= k; ++j) {
    const std::span<const float> row = logits.subspan(j * V, V);
    int32_t token;
    bool agreed = false;
    if (j < k) {
      token = q.sampler->Verify(row, q.draft[j], q.draft_q[j], &agreed);
    } else {
      token = q.sampler->Draw(q.sampler->Distribution(row));
    }
    q.emitted.push_back(q.sampler->Record(token, row));
    accepted += agreed ? 1 : 0;
    const bool stop_token = IsStopToken(sp, config().eos_token_id, token);
    bool stop_string = false;
    if (text && !stop_token) {
      pending += text->Push(token);
      stop_string = CutAtStop(sp.stop, &pending, &unused);
    }
    const bool stop = stop_token || stop_string ||
                      q.generated + static_cast<int64_t>(q.emitted.size()) >= sp.max_tokens;
    if (!agreed || stop) break;
  }
  // The cap adapts: halved when nothing was accepted, one more when everything was.
  const int block = forward_->dspark_block();
  if (accepted == 0) {
    if (q.draft_cap <= 1) {
      q.draft_cap = 0;
      q.probe_in = q.probe_wait;
      q.probe_wait = std::min(256, q.probe_wait * 2);
    } else {
      q.draft_cap /= 2;
    }
  } else {
    q.probe_wait = 8;
    if (static_cast<size_t>(accepted) == k) q.draft_cap = std::min(block, q.draft_cap + 1);
  }
  std::lock_guard<std::mutex> lock(mu_);
  stats_.spec_steps += 1;
  stats_.spec_drafted += static_cast<int64_t>(k);
  stats_.spec_accepted += accepted;
  return static_cast<int64_t>(q.emitted.size());
}

// One DSpark draft call for every sequence that decodes next step. Each picks its drafts from
// its own sampler's distribution (greedy: the argmax); the confidence head, the sequence's cap
// and engine.speculative_tokens decide how many to verify.
void Engine::DraftAll(const std::vector<Sequence*>& owners) {
  const int block = forward_->dspark_block();
  std::vector<Sequence*> drafting;
  for (Sequence* q : owners) {
    if (q->done || q->prompt_done < q->request.prompt.size() || q->next_input < 0) continue;
    if (q->state.position < 1) continue;
    if (options_.speculative_tokens == 0 && q->draft_cap == 0) {
      if (q->probe_in > 0) {
        q->probe_in -= 1;
        continue;
      }
      q->draft_cap = 1;  // Probe again with one token.
    }
    drafting.push_back(q);
  }
  if (drafting.empty()) return;
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::vector<int32_t>> drafted(drafting.size());
  std::vector<std::vector<float>> confidence(drafting.size());
  std::vector<std::vector<TokenDistribution>> dists(drafting.size());
  std::vector<DraftItem> items;
  std::vector<size_t> used;  // Index into drafting of each item.
  for (size_t i = 0; i < drafting.size(); ++i) {
    Sequence* q = drafting[i];
    DraftItem item{&q->state, q->next_input,
                   [q, &dists, i](int64_t, std::span<const float> l) {
                     dists[i].push_back(q->sampler->Distribution(l));
                     return q->sampler->Draw(dists[i].back());
                   },
                   &drafted[i], &confidence[i]};
    // Fixed: that many. Adaptive: up to the cap, while the confidence head expects acceptance
    // (a logit >= 0), at least one (it costs little beside the decode it rides with).
    const int64_t room = std::min<int64_t>(config().sliding_window - 1,
                                           q->request.sampling.max_tokens - q->generated - 1);
    if (options_.speculative_tokens > 0) {
      item.limit = std::min<int64_t>({options_.speculative_tokens, block, room});
    } else {
      item.limit = std::min<int64_t>({q->draft_cap, block, room});
      item.min_confidence = 0.0f;
    }
    if (item.limit <= 0) continue;
    items.push_back(std::move(item));
    used.push_back(i);
  }
  if (items.empty()) return;
  ForwardOptions fo;
  fo.threads = options_.threads;
  if (Status s = forward_->Draft(items, fo); !s.ok()) {
    spdlog::warn("engine step {}: drafting failed, decoding without drafts: {}", step_,
                 s.ToString());
    return;
  }
  for (size_t i : used) {
    drafting[i]->draft = std::move(drafted[i]);
    drafting[i]->draft_q = std::move(dists[i]);
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::lock_guard<std::mutex> lock(mu_);
  stats_.spec_draft_seconds += seconds;
}

// Runs one batch through the model and hands each sequence its result; returns the prompt
// tokens it processed.
int64_t Engine::RunBatch(const std::vector<Sequence*>& owners,
                         const std::vector<std::vector<int32_t>>& inputs) {
  std::vector<std::vector<float>> logits(owners.size());
  // A sequence whose KV blocks do not fit ends with its own error; the others go on.
  std::vector<Status> item_status(owners.size());
  std::vector<BatchItem> items;
  std::vector<int64_t> kept(owners.size());
  bool verifying = false;
  for (size_t i = 0; i < owners.size(); ++i) {
    Sequence* q = owners[i];
    BatchItem item{&q->state, inputs[i], &logits[i], &item_status[i]};
    kept[i] = static_cast<int64_t>(inputs[i].size());
    if (inputs[i].size() > 1 && q->prompt_done >= q->request.prompt.size()) {
      item.all_logits = true;
      item.accept = [this, q, &kept, i](std::span<const float> l) {
        return kept[i] = Verify(*q, l);
      };
      verifying = true;
    }
    items.push_back(std::move(item));
  }
  ForwardOptions fo;
  fo.threads = options_.threads;
  const auto t0 = std::chrono::steady_clock::now();
  const Status forward_status = forward_->ForwardBatch(items, fo);
  if (verifying) {
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::lock_guard<std::mutex> lock(mu_);
    stats_.spec_verify_seconds += seconds;
  }
  if (Status s = forward_status; !s.ok()) {
    spdlog::error("engine step {}: {}", step_, s.ToString());
    for (Sequence* o : owners) Finish(*o, "error", s);
    return 0;
  }
  int64_t prompt_tokens = 0;
  std::vector<size_t> publish;  // The sequences that take a token from their logits.
  for (size_t i = 0; i < owners.size(); ++i) {
    Sequence& q = *owners[i];
    if (!item_status[i].ok()) {
      spdlog::warn("engine step {}: {}", step_, item_status[i].ToString());
      Finish(q, "error", item_status[i]);
      continue;
    }
    const bool was_prefill = q.prompt_done < q.request.prompt.size();
    if (options_.cache) {
      q.fed.insert(q.fed.end(), inputs[i].begin(), inputs[i].begin() + kept[i]);
      StoreNewBlocks(q);
    }
    if (!was_prefill && !q.draft.empty()) {
      // A verified block: its emitted tokens, in order, until one ends the sequence.
      q.draft.clear();
      q.draft_q.clear();
      for (const SampledToken& t : q.emitted) {
        if (q.done) break;
        q.next_input = t.token;
        Deliver(q, t);
      }
      continue;
    }
    if (was_prefill) {
      q.prompt_done += inputs[i].size();
      prompt_tokens += static_cast<int64_t>(inputs[i].size());
      if (q.prompt_done < q.request.prompt.size()) {
        if (std::binary_search(q.request.snapshot_at.begin(), q.request.snapshot_at.end(),
                               static_cast<int64_t>(q.prompt_done))) {
          SaveSnapshot(q);  // A point where later prompts are likely to part from this one.
        }
        continue;  // More prompt next step.
      }
      SaveSnapshot(q);
    }
    publish.push_back(i);
  }
  // Each sequence samples from its own logits with its own sampler, on the CPU's threads (a
  // vocabulary-sized pass or two a sequence, idle cores while a GPU runs the steps); the tokens
  // are delivered in batch order after.
  std::vector<SampledToken> sampled(publish.size());
  const kernels::CpuStream stream{options_.threads};
  kernels::cpu::ParallelRanges(
      publish.size(), kernels::cpu::StreamThreads(&stream), [&](size_t begin, size_t end) {
        for (size_t j = begin; j < end; ++j) {
          sampled[j] = owners[publish[j]]->sampler->Sample(logits[publish[j]]);
        }
      });
  for (size_t j = 0; j < publish.size(); ++j) Deliver(*owners[publish[j]], sampled[j]);
  return prompt_tokens;
}

// The algorithm: take new requests and cancellations, admit, batch, run, publish, clean up.
bool Engine::Step() {
  const std::vector<Handle> cancels = Intake();
  ++step_;
  for (Handle h : cancels) {
    for (auto& s : waiting_) {
      if (s->handle == h) Finish(*s, "cancelled");
    }
    for (auto& s : running_) {
      if (s->handle == h) Finish(*s, "cancelled");
    }
  }
  Admit();
  std::vector<Sequence*> live;
  std::vector<Scheduler::Candidate> candidates;
  for (auto& s : running_) {
    if (s->done) continue;
    live.push_back(s.get());
    candidates.push_back({s->request.tenant, PromptRunLeft(*s)});
  }
  std::vector<Sequence*> owners;
  std::vector<std::vector<int32_t>> inputs;
  for (const Scheduler::Pick& pick : scheduler_.Batch(candidates)) {
    Sequence* s = live[pick.index];
    owners.push_back(s);
    if (s->prompt_done >= s->request.prompt.size()) {
      std::vector<int32_t> in = {s->next_input};
      in.insert(in.end(), s->draft.begin(), s->draft.end());
      inputs.push_back(std::move(in));
    } else {
      const auto first = s->request.prompt.begin() + static_cast<std::ptrdiff_t>(s->prompt_done);
      inputs.emplace_back(first, first + static_cast<std::ptrdiff_t>(pick.tokens));
    }
  }
  std::vector<int64_t> generated_before;
  for (Sequence* o : owners) generated_before.push_back(o->generated);
  const int64_t prompt_tokens = owners.empty() ? 0 : RunBatch(owners, inputs);
  if (forward_->dspark()) DraftAll(owners);

  // Finished sequences leave and give back their memory.
  int64_t generated = 0;
  for (size_t i = 0; i < owners.size(); ++i)
    generated += owners[i]->generated - generated_before[i];
  auto done = [](const std::unique_ptr<Sequence>& s) { return s->done; };
  running_.erase(std::remove_if(running_.begin(), running_.end(), done), running_.end());
  waiting_.erase(std::remove_if(waiting_.begin(), waiting_.end(), done), waiting_.end());
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
