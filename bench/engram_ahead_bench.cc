// The forward pass with its Engram rows read from SSD (engine.engram: ssd, the hot-row cache off
// so that every row is a disk read), two ways in the same run: each step asking for every Engram
// layer's rows when it starts (the default: one thread reads them while the layers before each
// Engram layer compute), and each Engram layer reading its rows when the step reaches it. For
// decode steps and prefill chunks: the step's time, the reads' time and the time the step waited
// for rows, per step.
//
//   build/bench/engram_ahead_bench MODEL_DIR [ROUNDS] [THREADS]
//
// MODEL_DIR: any checkpoint with Engram layers (tests/golden, or `flashd mkmodel --layers 16`).
// The two ways alternate, ROUNDS times each, on the same tokens within a round.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "engine/engram_store.h"
#include "engine/forward.h"
#include "engine/model.h"

using namespace flashd;
using Clock = std::chrono::steady_clock;

namespace {

struct Result {
  double step_ms = 0, read_ms = 0, wait_ms = 0;
};

// `steps` forward calls of `tokens_per_step` tokens each after a prompt of `prompt` tokens,
// per step: the mean time, the store's read time and the forward pass's wait.
Result Run(const engine::Model& model, int threads, bool ahead, uint32_t seed, int prompt,
           int steps, int tokens_per_step) {
  auto fwd = engine::CpuForward::Create(model, "", 64);
  if (!fwd.ok()) {
    std::fprintf(stderr, "%s\n", fwd.status().ToString().c_str());
    std::exit(1);
  }
  auto tables = engine::EngramTableFiles(model.checkpoint(), model.config());
  auto store = tables.ok() ? engine::EngramStore::Open(std::move(*tables), 0)
                           : StatusOr<std::unique_ptr<engine::EngramStore>>(tables.status());
  if (!store.ok()) {
    std::fprintf(stderr, "%s\n", store.status().ToString().c_str());
    std::exit(1);
  }
  std::shared_ptr<engine::EngramStore> shared = std::move(*store);
  if (Status s = (*fwd)->SetEngramStore(shared, ahead); !s.ok()) {
    std::fprintf(stderr, "%s\n", s.ToString().c_str());
    std::exit(1);
  }
  std::mt19937 rng(seed);
  const int64_t vocab = model.config().vocab_size;
  auto tokens = [&](int n) {
    std::vector<int32_t> t(static_cast<size_t>(n));
    for (int32_t& v : t) v = static_cast<int32_t>(3 + rng() % static_cast<uint32_t>(vocab - 3));
    return t;
  };
  engine::ForwardOptions options;
  options.threads = threads;
  engine::SequenceState state = (*fwd)->NewSequence();
  std::vector<float> logits;
  auto forward = [&](const std::vector<int32_t>& t) {
    if (Status s = (*fwd)->Forward(&state, t, &logits, options); !s.ok()) {
      std::fprintf(stderr, "%s\n", s.ToString().c_str());
      std::exit(1);
    }
  };
  if (prompt > 0) forward(tokens(prompt));
  const engine::EngramStore::Stats before = shared->stats();
  const auto start = Clock::now();
  for (int i = 0; i < steps; ++i) forward(tokens(tokens_per_step));
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  const engine::EngramStore::Stats after = shared->stats();
  return {1e3 * seconds / steps, 1e3 * (after.read_seconds - before.read_seconds) / steps,
          1e3 * (after.wait_seconds - before.wait_seconds) / steps};
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s MODEL_DIR [ROUNDS] [THREADS]\n", argv[0]);
    return 2;
  }
  const int rounds = argc > 2 ? std::atoi(argv[2]) : 3;
  const int threads = argc > 3 ? std::atoi(argv[3]) : 2;
  auto model = engine::Model::Load(argv[1]);
  if (!model.ok()) {
    std::fprintf(stderr, "%s\n", model.status().ToString().c_str());
    return 1;
  }
  if ((*model)->config().engram_layer_ids.empty()) {
    std::fprintf(stderr, "%s has no Engram layers\n", argv[1]);
    return 1;
  }
  std::printf("%d layers, Engram layers", (*model)->config().num_hidden_layers);
  for (int l : (*model)->config().engram_layer_ids) std::printf(" %d", l);
  std::printf(", %d threads\n", threads);
  struct Shape {
    const char* name;
    int prompt, steps, tokens;
  };
  for (const Shape& shape :
       {Shape{"decode (1 token)", 32, 48, 1}, Shape{"prefill (64)", 0, 6, 64}}) {
    std::printf("%-17s  %-9s  %9s  %9s  %9s\n", shape.name, "rows", "step ms", "read ms",
                "wait ms");
    for (int r = 0; r < rounds; ++r) {
      for (int v = 0; v < 2; ++v) {
        const bool ahead = (r + v) % 2 == 0;
        const Result res = Run(**model, threads, ahead, 7 + static_cast<uint32_t>(r), shape.prompt,
                               shape.steps, shape.tokens);
        std::printf("%-17s  %-9s  %9.3f  %9.3f  %9.3f\n", "", ahead ? "ahead" : "at layer",
                    res.step_ms, res.read_ms, res.wait_ms);
      }
    }
  }
  return 0;
}
