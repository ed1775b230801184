// The CPU forward pass: prefill speed with and without the decoder bounded replay, and the
// replay's effect on the last position's logits, measured in the same run.
//
//   build/bench/forward_bench MODEL_DIR [prompt_tokens] [decode_steps]
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>

#include "engine/forward.h"

using namespace flashd::engine;

namespace {

double Seconds(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: forward_bench MODEL_DIR [prompt_tokens] [decode_steps]\n");
    return 2;
  }
  const size_t n = argc > 2 ? std::strtoul(argv[2], nullptr, 10) : 512;
  const int steps = argc > 3 ? std::atoi(argv[3]) : 16;
  auto model = Model::Load(argv[1]);
  if (!model.ok()) {
    std::fprintf(stderr, "%s\n", model.status().ToString().c_str());
    return 1;
  }
  auto fwd = CpuForward::Create(**model);
  if (!fwd.ok()) {
    std::fprintf(stderr, "%s\n", fwd.status().ToString().c_str());
    return 1;
  }
  const ModelConfig& c = (*fwd)->config();
  std::mt19937 rng(7);
  std::uniform_int_distribution<int32_t> dist(3, static_cast<int32_t>(c.vocab_size) - 1);
  std::vector<int32_t> prompt(n);
  for (int32_t& t : prompt) t = dist(rng);

  std::vector<float> full, replay;
  SequenceState a = (*fwd)->NewSequence();
  auto start = std::chrono::steady_clock::now();
  if (!(*fwd)->Forward(&a, prompt, &full).ok()) return 1;
  const double t_full = Seconds(start);

  ForwardOptions options;
  options.replay_tokens = c.sliding_window;
  SequenceState b = (*fwd)->NewSequence();
  start = std::chrono::steady_clock::now();
  if (!(*fwd)->Forward(&b, prompt, &replay, options).ok()) return 1;
  const double t_replay = Seconds(start);

  double max_diff = 0;
  size_t am_full = 0, am_replay = 0;
  for (size_t v = 0; v < full.size(); ++v) {
    max_diff = std::max(max_diff, double(std::fabs(full[v] - replay[v])));
    if (full[v] > full[am_full]) am_full = v;
    if (replay[v] > replay[am_replay]) am_replay = v;
  }

  // Decode: one token per call after the prompt.
  std::vector<float> logits;
  start = std::chrono::steady_clock::now();
  for (int i = 0; i < steps; ++i) {
    int32_t next = dist(rng);
    if (!(*fwd)->Forward(&a, std::span<const int32_t>(&next, 1), &logits).ok()) return 1;
  }
  const double t_decode = Seconds(start);

  std::printf(
      "model %s: %d layers, hidden %lld, last KV source %d of %d\n", argv[1], c.num_hidden_layers,
      static_cast<long long>(c.hidden_size),
      [&] {
        int last = -1;
        for (int l = 0; l < c.num_hidden_layers; ++l) {
          if (c.layers[l].is_kv_source) last = l;
        }
        return last;
      }(),
      c.num_hidden_layers);
  std::printf(
      "prefill %zu tokens: %.1f tokens/s; with bounded replay (%lld tokens) %.1f tokens/s "
      "(%.2fx)\n",
      n, n / t_full, static_cast<long long>(options.replay_tokens), n / t_replay,
      t_full / t_replay);
  std::printf("bounded replay, last position: max |logit difference| %.4g, same argmax: %s\n",
              max_diff, am_full == am_replay ? "yes" : "no");
  std::printf("decode after %zu tokens: %.1f tokens/s\n", n, steps / t_decode);
  return 0;
}
