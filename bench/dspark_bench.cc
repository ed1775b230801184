// DSpark speculative decoding: the cost of drafting a block and of verifying k drafted tokens,
// relative to one plain decode step, at batch 1, 8 and 32, measured in one run; then the decode
// speed with an oracle draft (the main model's own greedy continuation: every token accepted),
// and through the engine with the checkpoint's drafter against no drafting (with random weights
// no draft is accepted, so the adaptive length must switch drafting down). The speed-up at the
// acceptance lengths peers publish follows from the measured costs.
//
//   build/bench/dspark_bench MODEL_DIR [--steps N] [--batch B] [--no-engine]
//                            [--profile decode|verify]
//
// --batch measures that batch only; --no-engine leaves out the engine rows; --profile runs only
// plain decode steps or only verifications of a whole block, --steps of them (under perf).
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "engine/forward.h"

using namespace flashd::engine;
using Clock = std::chrono::steady_clock;

namespace {

double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

int32_t Argmax(std::span<const float> l) {
  return static_cast<int32_t>(std::max_element(l.begin(), l.end()) - l.begin());
}

// Tokens per second through the engine for `batch` greedy requests of `tokens` tokens each.
double EngineTokensPerSecond(const std::string& dir, const std::string& speculative, int batch,
                             int tokens, double* mean_accepted) {
  EngineOptions o;
  o.model_dir = dir;
  o.speculative = speculative;
  auto e = Engine::Open(o);
  if (!e.ok()) {
    std::fprintf(stderr, "%s\n", e.status().ToString().c_str());
    std::exit(1);
  }
  std::mt19937 rng(7);
  std::vector<std::shared_ptr<EventQueue>> queues;
  const auto t = Clock::now();
  for (int i = 0; i < batch; ++i) {
    GenerationRequest r;
    for (int j = 0; j < 64; ++j) r.prompt.push_back(3 + static_cast<int32_t>(rng() % 400));
    r.sampling.temperature = 0;
    r.sampling.max_tokens = tokens;
    r.sampling.ignore_eos = true;
    queues.push_back((*e)->Submit(std::move(r)).second);
  }
  double first_token = 0;
  for (auto& q : queues) {
    for (;;) {
      auto ev = q->Pop(std::chrono::seconds(600));
      if (!ev) std::exit(1);
      if (ev->kind == GenerationEvent::Kind::kToken && first_token == 0) first_token = Since(t);
      if (ev->kind == GenerationEvent::Kind::kDone) break;
    }
  }
  const double seconds = Since(t) - first_token;  // Decode only, after the prefills.
  const Engine::Stats s = (*e)->stats();
  *mean_accepted = s.spec_steps ? 1.0 + double(s.spec_accepted) / double(s.spec_steps) : 1.0;
  return batch * (tokens - 1) / seconds;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: dspark_bench MODEL_DIR [--steps N]\n");
    return 2;
  }
  const std::string dir = argv[1];
  int steps = 24;
  std::vector<int> batches = {1, 8, 32};
  bool engine = true;
  std::string profile;
  for (int i = 2; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--steps" && i + 1 < argc) steps = std::atoi(argv[++i]);
    if (a == "--batch" && i + 1 < argc) batches = {std::atoi(argv[++i])};
    if (a == "--no-engine") engine = false;
    if (a == "--profile" && i + 1 < argc) profile = argv[++i];
  }
  if (!profile.empty() && profile != "decode" && profile != "verify") {
    std::fprintf(stderr, "--profile: decode or verify, not %s\n", profile.c_str());
    return 2;
  }
  auto model = Model::Load(dir);
  if (!model.ok()) {
    std::fprintf(stderr, "%s\n", model.status().ToString().c_str());
    return 1;
  }
  auto fwd = CpuForward::Create(**model);
  if (!fwd.ok() || !(*fwd)->EnableDSpark().ok()) {
    std::fprintf(stderr, "the model has no DSpark heads\n");
    return 1;
  }
  CpuForward& f = **fwd;
  const int block = f.dspark_block();
  std::mt19937 rng(1);
  auto prompt = [&] {
    std::vector<int32_t> p(64);
    for (int32_t& t : p) t = 3 + static_cast<int32_t>(rng() % 400);
    return p;
  };

  std::printf("costs relative to one plain decode step (same batch, same run)\n");
  std::printf("batch  decode ms  draft/decode  verify k=1..%d / decode\n", block);
  std::vector<double> oracle_speedup;
  for (int batch : batches) {
    std::vector<SequenceState> states;
    std::vector<std::vector<float>> logits(batch);
    std::vector<int32_t> pending(batch);
    for (int i = 0; i < batch; ++i) {
      states.push_back(f.NewSequence());
      if (!f.Forward(&states.back(), prompt(), &logits[i]).ok()) return 1;
      pending[i] = Argmax(logits[i]);
    }
    // Plain decode: one token per sequence per step.
    auto decode = [&](int n) {
      auto t = Clock::now();
      for (int s = 0; s < n; ++s) {
        std::vector<std::vector<int32_t>> in(batch);
        std::vector<BatchItem> items;
        for (int i = 0; i < batch; ++i) {
          in[i] = {pending[i]};
          items.push_back({&states[i], in[i], &logits[i]});
        }
        if (!f.ForwardBatch(items).ok()) std::exit(1);
        for (int i = 0; i < batch; ++i) pending[i] = Argmax(logits[i]);
      }
      return Since(t) / n;
    };
    if (profile == "decode") {
      std::printf("%d plain decode steps at batch %d: %.2f ms each\n", steps, batch,
                  decode(steps) * 1e3);
      continue;
    }
    const double t1 = decode(profile.empty() ? steps : 1);
    // Drafting a block for every sequence.
    std::vector<std::vector<int32_t>> drafted(batch);
    std::vector<std::vector<float>> conf(batch);
    auto draft = [&] {
      std::vector<DraftItem> items;
      for (int i = 0; i < batch; ++i) {
        items.push_back({&states[i], pending[i],
                         [](int64_t, std::span<const float> l) { return Argmax(l); }, &drafted[i],
                         &conf[i]});
      }
      if (!f.Draft(items).ok()) std::exit(1);
    };
    auto t = Clock::now();
    const int draft_steps = profile.empty() ? steps : 1;
    for (int s = 0; s < draft_steps; ++s) draft();
    const double td = Since(t) / draft_steps;
    // Verifying k drafted tokens (k + 1 inputs), keeping one (the pending token): the state
    // stays where it was, so every k runs on the same context.
    std::printf("%5d  %9.2f  %12.2f ", batch, t1 * 1e3, td / t1);
    std::vector<double> tv(block + 1);
    for (int k = profile.empty() ? 1 : block; k <= block; ++k) {
      auto t0 = Clock::now();
      for (int s = 0; s < steps; ++s) {
        std::vector<std::vector<int32_t>> in(batch);
        std::vector<BatchItem> items;
        for (int i = 0; i < batch; ++i) {
          in[i] = {pending[i]};
          in[i].insert(in[i].end(), drafted[i].begin(), drafted[i].begin() + k);
          BatchItem it{&states[i], in[i], &logits[i]};
          it.all_logits = true;
          it.accept = [](std::span<const float>) { return int64_t{0}; };
          items.push_back(std::move(it));
        }
        if (!f.ForwardBatch(items).ok()) return 1;
      }
      tv[k] = Since(t0) / steps;
      std::printf(" %5.2f", tv[k] / t1);
    }
    std::printf("\n");
    if (!profile.empty()) continue;
    // Speed-up at mean accepted drafts a per step with k = block verified: (a + 1) tokens per
    // draft + verify.
    std::printf("       speed-up at accepted drafts a = 0..%d per step (k = %d):", block, block);
    for (int a = 0; a <= block; ++a) std::printf(" %5.2f", (a + 1) * t1 / (td + tv[block]));
    std::printf("\n");
    // The oracle: drafts are the main model's own greedy continuation, every one accepted.
    {
      std::vector<SequenceState> o;
      std::vector<std::vector<int32_t>> cont(batch);
      std::vector<int32_t> first(batch);
      for (int i = 0; i < batch; ++i) {
        o.push_back(f.NewSequence());
        std::vector<float> l;
        const std::vector<int32_t> p = prompt();
        SequenceState probe = f.NewSequence();
        if (!f.Forward(&o.back(), p, &l).ok() || !f.Forward(&probe, p, &l).ok()) return 1;
        first[i] = Argmax(l);
        int32_t next = first[i];
        for (int s = 0; s < (steps + 1) * (block + 1) + 1; ++s) {  // The continuation, plainly.
          cont[i].push_back(next);
          if (!f.Forward(&probe, std::span<const int32_t>(&next, 1), &l).ok()) return 1;
          next = Argmax(l);
        }
      }
      std::vector<size_t> at(batch, 0);
      int64_t emitted = 0;
      auto t0 = Clock::now();
      for (int s = 0; s < steps; ++s) {
        draft();  // Its cost counts; its tokens are replaced by the oracle's.
        std::vector<std::vector<int32_t>> in(batch);
        std::vector<std::vector<float>> l(batch);
        std::vector<BatchItem> items;
        for (int i = 0; i < batch; ++i) {
          in[i].assign(cont[i].begin() + at[i], cont[i].begin() + at[i] + block + 1);
          BatchItem it{&o[i], in[i], &l[i]};
          it.all_logits = true;
          const size_t V = static_cast<size_t>(f.config().vocab_size);
          it.accept = [&, i, V](std::span<const float> x) {
            int64_t keep = 1;  // Accepted while the model's argmax is the next draft.
            while (keep < block + 1 && Argmax(x.subspan((keep - 1) * V, V)) == in[i][keep]) ++keep;
            return keep;
          };
          items.push_back(std::move(it));
        }
        if (!f.ForwardBatch(items).ok()) return 1;
        for (int i = 0; i < batch; ++i) {
          const size_t kept = static_cast<size_t>(o[i].position) - 64 - at[i];
          at[i] += kept;
          emitted += static_cast<int64_t>(kept);
        }
      }
      const double oracle = emitted / Since(t0);
      oracle_speedup.push_back(oracle / (batch / t1));
      std::printf("       oracle draft: %.1f tokens/s vs %.1f plain: %.2fx (mean accepted %.2f)\n",
                  oracle, batch / t1, oracle_speedup.back(), double(emitted) / (steps * batch));
    }
    std::fflush(stdout);
  }
  if (!engine) return 0;
  std::printf("engine, greedy, the checkpoint's drafter (adaptive) vs off\n");
  std::printf("batch  off tokens/s  dspark tokens/s  ratio  mean accepted length\n");
  for (int batch : {1, 8}) {
    double unused = 0, accepted = 0;
    const double off = EngineTokensPerSecond(dir, "off", batch, 4 * steps, &unused);
    const double on = EngineTokensPerSecond(dir, "dspark", batch, 4 * steps, &accepted);
    std::printf("%5d  %12.1f  %15.1f  %5.2f  %20.2f\n", batch, off, on, on / off, accepted);
    std::fflush(stdout);
  }
  return 0;
}
