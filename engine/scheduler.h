// Scheduler: admission and batching for the engine's steps. Plain C++ over sizes and tenants,
// no model and no device, so every policy here is tested directly (tests/engine/scheduler_test).
//
//   Admission: first come, first served, while the memory budget and the running slots allow;
//   the first request that does not fit waits, and so does everyone behind it (no overtaking,
//   so a large request is never starved by small ones).
//   Batching: every decoding sequence's next token first (decode latency is what users feel),
//   then prompt chunks of at most prefill_chunk tokens, one tenant's oldest prefilling sequence
//   at a time in round-robin (the turn moves on every step), until the step's token budget is
//   spent.
//
// Thread-safety: the engine thread only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

namespace flashd::engine {

struct SchedulerOptions {
  int64_t step_token_budget = 0;
  int64_t prefill_chunk = 0;
  int64_t max_running = 0;
  uint64_t memory_budget_bytes = 0;
};

class Scheduler {
 public:
  explicit Scheduler(SchedulerOptions options) : options_(options) {}

  // How many of the waiting requests (their memory needs, in arrival order) start now, given
  // what the running ones reserve and how many run.
  size_t Admit(std::span<const uint64_t> needs, uint64_t reserved, size_t running) const;

  // A running sequence as the batcher sees it.
  struct Candidate {
    std::string_view tenant;
    size_t prompt_left = 0;  // 0: decoding.
  };
  // One sequence's share of the step: `tokens` of its prompt, or its next token (1).
  struct Pick {
    size_t index;  // Into the candidates.
    size_t tokens;
  };
  // The next step's batch, decodes first.
  std::vector<Pick> Batch(std::span<const Candidate> running);

 private:
  SchedulerOptions options_;
  size_t tenant_turn_ = 0;
};

}  // namespace flashd::engine
