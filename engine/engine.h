// Engine: the model resident in one engine thread, serving many generations at once.
//
// Submit() queues a request and returns at once with its event queue; the engine thread admits
// requests as memory allows, and every step runs one forward pass over a batch that mixes one
// decode token of every running sequence with prefill chunks of the others, under a token
// budget. A long prompt is prefilled in chunks, so it delays others' decodes by at most one
// chunk per step; prefill chunks go round-robin across tenants, so one tenant's huge prompt
// cannot starve another's. Results of a sequence do not depend on what it is batched with.
//
// Threads: Submit, Cancel and stats() may be called from any thread; all model and sequence
// state belongs to the engine thread. Events reach callers through EventQueue.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "cache/block_key.h"
#include "cache/block_store.h"
#include "config/config.h"
#include "config/status.h"
#include "engine/engram_store.h"
#include "engine/forward.h"
#include "engine/model.h"
#include "engine/prefix_cache.h"
#include "engine/sampler.h"
#include "engine/scheduler.h"
#include "engine/tokenizer.h"

namespace flashd::engine {

// The engine's settings: the scheduling and memory knobs are config.yaml's `engine` section
// (EngineConfig, one set of defaults for both), plus what the daemon decides itself.
struct GenerationRequest;

struct EngineOptions : EngineConfig {
  std::string model_dir;
  int64_t block_tokens = CacheConfig{}.block_tokens;  // KV pool and prefix cache block; every
                                                      // compress ratio divides it.
  // The persistent prefix cache (none: every prompt is prefilled). Prompts resume from the
  // longest stored prefix: a snapshot of the state there (no recomputation), or the stored
  // blocks plus an exact replay of the tokens before their end (CpuForward::ResumeAt). Full
  // blocks are written as they complete, a snapshot at the end of every prompt and generation.
  std::shared_ptr<cache::BlockStore> cache;
  // Hears how far the weights' upload to the GPUs is (bytes done and in all), during Open.
  std::function<void(uint64_t done, uint64_t total)> upload_progress;
  // Test hook: called on a loader thread before it looks a request up in the cache.
  std::function<void(const GenerationRequest&)> before_lookup_for_test;
};

struct GenerationRequest {
  std::vector<int32_t> prompt;
  SamplingParams sampling;
  std::string tenant = "default";  // Also the prefix cache's namespace: tenants never share.
  // Namespaces whose stored prefixes this request may also start from (prefixes published to a
  // group the tenant belongs to); what it stores itself stays in the tenant's namespace.
  std::vector<std::string> shared_namespaces;
  // Prompt positions (ascending) where the prefix cache also stores a state snapshot, besides
  // the prompt's end: where later prompts are likely to part from this one (the end of a
  // client's system prompt and tools), so that they resume there without a replay.
  std::vector<int64_t> snapshot_at;
};

struct GenerationEvent {
  enum class Kind {
    kQueued,  // Waiting for memory; queue_position says how many are ahead.
    kToken,   // One generated token.
    kDone,    // The end: finish_reason "stop", "length", "cancelled" or "error".
  };
  Kind kind = Kind::kToken;
  int64_t queue_position = 0;
  SampledToken token;
  std::string text;  // Text this token completed (never half a character, never a stop string).
  std::string finish_reason;
  Status error;
  int64_t prompt_tokens = 0;
  int64_t completion_tokens = 0;
  // Prompt tokens restored from the prefix cache, not recomputed (tokens and the end carry it).
  int64_t cached_tokens = 0;
  int64_t step = 0;                            // The engine step that produced the event.
  std::chrono::steady_clock::time_point time;  // When it was queued.
};

// The one queue between the engine thread and a request's consumer; it hides every mutex.
class EventQueue {
 public:
  void Push(GenerationEvent event);
  // The next event, or nullopt after `timeout`.
  std::optional<GenerationEvent> Pop(std::chrono::milliseconds timeout);

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<GenerationEvent> events_;  // Guarded by mu_.
};

class Engine {
 public:
  using Handle = uint64_t;

  // Loads the model and starts the engine thread.
  static StatusOr<std::unique_ptr<Engine>> Open(const EngineOptions& options);
  ~Engine();  // Cancels what is outstanding and joins the engine thread.

  // Never blocks. Invalid requests end at once with an error event naming the field.
  std::pair<Handle, std::shared_ptr<EventQueue>> Submit(GenerationRequest request);
  // Stops a request within one step and frees what it held; its queue gets kDone "cancelled".
  void Cancel(Handle handle);

  struct Stats {
    int64_t waiting = 0;
    int64_t running = 0;
    uint64_t memory_reserved_bytes = 0;  // Returns to 0 when nothing runs.
    uint64_t memory_budget_bytes = 0;
    int64_t steps = 0;
    int64_t tokens_generated = 0;
    int64_t prompt_tokens_processed = 0;
    uint64_t pool_used_bytes = 0;  // KV blocks in use (shared blocks counted once).
    uint64_t pool_capacity_bytes = 0;
    // The prefix cache, counted per request.
    int64_t cache_lookups = 0;
    int64_t cache_hit_tokens = 0;   // Restored, not recomputed.
    int64_t cache_miss_tokens = 0;  // Prefilled (including replayed tokens).
    int64_t cache_snapshot_hits = 0;
    int64_t cache_replay_hits = 0;
    int64_t cache_replayed_tokens = 0;
    double cache_restore_seconds = 0;  // Reading and checking restored bytes.
    // DSpark speculative decoding.
    int64_t spec_steps = 0;          // Decode steps that verified drafted tokens.
    int64_t spec_drafted = 0;        // Drafted tokens verified.
    int64_t spec_accepted = 0;       // Of those, accepted.
    double spec_draft_seconds = 0;   // Drafting (the stages and heads).
    double spec_verify_seconds = 0;  // Forward steps that verified drafts (with whatever else
                                     // they carried).
  };
  Stats stats() const;
  const ModelConfig& config() const;
  // The backend the forward pass runs on, its device and the device memory it holds.
  BackendReport backend() const;
  // Which backend runs which layers and the routed experts, as the numerics of the whole (the
  // one backend's numerics when a single backend runs everything).
  std::string placement() const { return std::string(forward_->numerics()); }
  const Tokenizer* tokenizer() const { return tokenizer_.get(); }
  // Whether DSpark drafts: engine.speculative is dspark and the checkpoint has the heads.
  bool speculative() const { return forward_->dspark(); }
  // The Engram rows read from SSD (engine.engram: ssd; thread-safe itself), or null.
  const EngramStore* engram_store() const { return forward_->engram_store(); }
  // The prefix cache (thread-safe itself), or null.
  cache::BlockStore* cache() const { return options_.cache.get(); }
  // What the prefix cache's keys cover besides tokens and tenant: the model's config.json, every
  // shard's header and a sample of its first and last tensor bytes, and the cache format.
  const cache::BlockKey& model_fingerprint() const { return fingerprint_; }
  // 2: planar KV blocks (engine/kv_pool.h) and sequence snapshots v5; keys carry the backend's
  // numerics. The block store empties a store written in another payload format at open.
  static constexpr uint32_t kCacheFormat = 2;
  // Threads that look requests up in the prefix cache and read what they resume from.
  static constexpr int kLoaderThreads = 4;
  static constexpr const char* kCachePayloadFormat =
      "flashd kv blocks v2 (planar), snapshots v5 (DSpark rings)";
  // The prefix cache's keys for `tokens` of `tenant`: every full block, and the snapshot at the
  // end (what a prompt of exactly these tokens leaves behind).
  using PrefixKeys = engine::PrefixKeys;
  PrefixKeys KeysFor(std::span<const int32_t> tokens, const std::string& tenant) const;
  // Bytes of one KV block (the prefix cache's unit).
  size_t block_bytes() const { return forward_->pool()->block_bytes(); }
  int64_t block_tokens() const { return forward_->block_tokens(); }
  // Tokens a restore from blocks alone runs again (CpuForward::ExactReplayTokens).
  int64_t exact_replay_tokens() const { return forward_->ExactReplayTokens(); }

 private:
  struct Sequence;
  explicit Engine(EngineOptions options);
  void Loop();
  void LoaderLoop();
  bool Step();  // One scheduling round; false when there was nothing to do.
  std::vector<Handle> Intake();
  void Admit();
  int64_t RunBatch(const std::vector<Sequence*>& owners,
                   const std::vector<std::vector<int32_t>>& inputs);
  void Deliver(Sequence& q, const SampledToken& t);
  // Verifies a sequence's drafted tokens against the step's logits (speculative sampling); the
  // tokens it emits go to q.emitted; returns how many of its inputs the sequence keeps.
  int64_t Verify(Sequence& q, std::span<const float> logits);
  // Drafts the next block of every decoding sequence (DSpark).
  void DraftAll(const std::vector<Sequence*>& owners);
  // Prefix cache (PrefixCache's policy): what to restore (loader thread), restoring it at
  // admission, and writing.
  void PlanRestore(Sequence& s);
  void ApplyRestore(Sequence& s);
  void StoreNewBlocks(Sequence& s);
  void SaveSnapshot(Sequence& s);
  // Prompt tokens `s` may run in its next prefill chunk (up to a requested snapshot position).
  size_t PromptRunLeft(const Sequence& s) const;
  void Finish(Sequence& s, const std::string& reason, Status error = Status::Ok());
  // KV for the prompt and max_tokens, plus the bounded per-sequence state.
  uint64_t MemoryNeed(const GenerationRequest& request) const;

  EngineOptions options_;
  std::unique_ptr<Model> model_;
  std::unique_ptr<CpuForward> forward_;
  std::unique_ptr<Tokenizer> tokenizer_;
  uint64_t per_token_bytes_ = 0;
  uint64_t per_sequence_bytes_ = 0;
  cache::BlockKey fingerprint_;
  std::unique_ptr<PrefixCache> prefix_;  // With a cache only.

  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;                           // Guarded by mu_.
  Handle next_handle_ = 1;                          // Guarded by mu_.
  std::deque<std::unique_ptr<Sequence>> incoming_;  // Guarded by mu_.
  std::deque<std::unique_ptr<Sequence>> lookups_;   // Guarded by mu_: for the loader.
  std::set<Handle> loading_;                        // Guarded by mu_: with the loader now.
  std::set<Handle> cancel_after_load_;              // Guarded by mu_.
  std::condition_variable loader_cv_;
  std::vector<Handle> cancels_;  // Guarded by mu_.
  Stats stats_;                  // Guarded by mu_.

  // Engine-thread state.
  std::deque<std::unique_ptr<Sequence>> waiting_;
  std::vector<std::unique_ptr<Sequence>> running_;
  Scheduler scheduler_;
  int64_t step_ = 0;
  std::thread thread_;
  std::vector<std::thread> loaders_;
};

}  // namespace flashd::engine
