#include "engine/engine.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <set>

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
};

Engine::Engine(EngineOptions options) : options_(std::move(options)) {}

StatusOr<std::unique_ptr<Engine>> Engine::Open(const EngineOptions& options) {
  if (options.step_token_budget < 1 || options.prefill_chunk < 1 || options.max_running < 1) {
    return InvalidArgument("engine: step_token_budget, prefill_chunk and max_running must be >= 1");
  }
  std::unique_ptr<Engine> e(new Engine(options));
  FLASHD_ASSIGN_OR_RETURN(e->model_, Model::Load(options.model_dir));
  FLASHD_ASSIGN_OR_RETURN(e->forward_, CpuForward::Create(*e->model_));
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
  e->thread_ = std::thread([raw = e.get()] { raw->Loop(); });
  return e;
}

Engine::~Engine() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
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
  incoming_.push_back(std::move(seq));
  cv_.notify_all();
  return {handle, queue};
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
  e.step = step_;
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
    for (size_t i = 0; i < owners.size(); ++i) {
      items.push_back({&owners[i]->state, inputs[i], &logits[i]});
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
        const bool was_prefill = q.prompt_done < q.request.prompt.size();
        if (was_prefill) {
          q.prompt_done += inputs[i].size();
          prompt_tokens += static_cast<int64_t>(inputs[i].size());
          if (q.prompt_done < q.request.prompt.size()) continue;  // More prompt next step.
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
