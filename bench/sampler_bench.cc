// Sampling's cost on the host at the released vocabulary: each mode's time a token for one
// sequence, the candidates' order made by a comparison sort (how the sampler ordered them
// before) against CandidateOrder, and a batch's sampling one sequence after another against the
// sequences spread over the process's threads (as the engine does).
//
//   build/bench/sampler_bench [VOCAB] [--batch N]
//
// The logits are random (normal, sd 3, with a few larger values), the same for every mode.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "engine/sampler.h"
#include "kernels/cpu/parallel.h"

namespace {

using flashd::engine::Sampler;
using flashd::engine::SamplingParams;

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// The best of five rounds of `reps` calls, in microseconds a call.
template <class F>
double Time(int reps, F f) {
  double best = 1e30;
  for (int round = 0; round < 5; ++round) {
    const double t0 = Now();
    for (int i = 0; i < reps; ++i) f();
    best = std::min(best, (Now() - t0) / reps * 1e6);
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  size_t vocab = 129280;
  size_t batch = 32;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--batch") == 0 && i + 1 < argc) {
      batch = std::strtoul(argv[++i], nullptr, 10);
    } else {
      vocab = std::strtoul(argv[i], nullptr, 10);
    }
  }
  if (vocab < 2 || batch < 1) {
    std::fprintf(stderr, "usage: sampler_bench [VOCAB] [--batch N]\n");
    return 2;
  }
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<float> logits(vocab);
  for (float& l : logits) l = normal(rng);
  for (int i = 0; i < 8; ++i) logits[rng() % vocab] = 18.0f + static_cast<float>(i);

  std::printf("vocabulary %zu, one thread\n", vocab);
  std::printf("%-32s %12s\n", "mode", "us a token");
  struct Mode {
    const char* name;
    float temperature;
    float top_p;
    int top_k;
    bool logprob;
    int logprobs;
  };
  const Mode modes[] = {
      {"greedy", 0.0f, 1.0f, 0, false, 0},
      {"greedy, its logprob", 0.0f, 1.0f, 0, true, 0},
      {"greedy, top 5 logprobs", 0.0f, 1.0f, 0, true, 5},
      {"temperature 1", 1.0f, 1.0f, 0, false, 0},
      {"temperature 0.7, top_p 0.95", 0.7f, 0.95f, 0, false, 0},
      {"temperature 1, top_k 50", 1.0f, 1.0f, 50, false, 0},
  };
  int64_t sink = 0;
  for (const Mode& m : modes) {
    SamplingParams p;
    p.temperature = m.temperature;
    p.top_p = m.top_p;
    p.top_k = m.top_k;
    p.want_logprob = m.logprob;
    p.logprobs = m.logprobs;
    p.seed = 1;
    Sampler s(p, {});
    const double us = Time(10, [&] { sink += s.Sample(logits).token; });
    std::printf("%-32s %12.1f\n", m.name, us);
  }

  // The order of every candidate (temperature without top_k): the comparison sort against
  // CandidateOrder, checked equal.
  std::vector<int32_t> sorted;
  const double comparison = Time(5, [&] {
    sorted.resize(vocab);
    std::iota(sorted.begin(), sorted.end(), 0);
    std::sort(sorted.begin(), sorted.end(), [&](int32_t a, int32_t b) {
      return logits[a] != logits[b] ? logits[a] > logits[b] : a < b;
    });
  });
  std::vector<int32_t> ordered;
  const double radix = Time(5, [&] { ordered = flashd::engine::CandidateOrder(logits, vocab); });
  if (ordered != sorted) {
    std::fprintf(stderr, "CandidateOrder differs from the comparison sort\n");
    return 1;
  }
  std::printf("every candidate's order: comparison sort %.1f us, CandidateOrder %.1f us (%.1fx)\n",
              comparison, radix, comparison / radix);

  // A batch's tokens at temperature 1: one sequence after another, and spread over the threads.
  const int threads = static_cast<int>(flashd::kernels::cpu::ThreadPool::Process().workers() + 1);
  std::vector<Sampler> samplers;
  SamplingParams p;
  p.seed = 1;
  for (size_t b = 0; b < batch; ++b) samplers.emplace_back(p, std::vector<int32_t>{});
  std::vector<int32_t> tokens(batch);
  const double serial = Time(2, [&] {
    for (size_t b = 0; b < batch; ++b) tokens[b] = samplers[b].Sample(logits).token;
  });
  const double spread = Time(2, [&] {
    flashd::kernels::cpu::ParallelRanges(batch, threads, [&](size_t begin, size_t end) {
      for (size_t b = begin; b < end; ++b) tokens[b] = samplers[b].Sample(logits).token;
    });
  });
  std::printf(
      "a batch of %zu at temperature 1: one after another %.2f ms, on %d threads %.2f ms"
      " (%.1fx)\n",
      batch, serial / 1e3, threads, spread / 1e3, serial / spread);
  return sink == 42 ? 3 : 0;
}
