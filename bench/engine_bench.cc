// Decode and prefill speed of the forward pass, with the weight bytes one decode step reads and
// the share of the machine's memory bandwidth that is, measured in the same run.
//
//   build/bench/engine_bench MODEL_DIR [PREFILL_CONTEXT...] [--decode-at CONTEXT]...
//                            [--backend auto|cpu|cuda|hip|hipcpu] [--gpu-gemms exact|matrix]
//                            [--uploads queued|waited] [--launch early|in-turn]
//
// --backend runs every op on that backend (default cpu); the bandwidth figure is the host's.
// --gpu-gemms matrix puts a GPU backend's FP8/FP4 linears on matrix cores (engine.gpu_gemms). A
// GPU backend's decode rows (--decode-at's too) are followed by what one step moved between host
// and device and how many times the host waited for the device (BackendReport). --uploads waited
// makes every copy to the device a plain one, which waits for the kernels before it (the
// backend's way before its small copies were queued: GpuOptions::queued_uploads). --launch
// in-turn starts each kernel when the one ahead has finished (GpuOptions::early_launch off; the
// first line says whether kernels start early).
// Weights are uploaded first, as the engine does (the time is printed for a GPU backend).
// --decode-at measures decode at batch 1 behind a context of CONTEXT tokens without prefilling
// it: the sequence resumes from KV blocks filled with valid random codes (every byte in
// 0x30-0x3F: finite FP4 pairs, E4M3 scales in [0.5, 2), small UE8M0 scales), so a million-token
// context costs seconds to set up and the step does the work a real one does.
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "engine/forward.h"
#include "engine/gpu_backend.h"
#include "engine/weights.h"

using namespace flashd::engine;
using Clock = std::chrono::steady_clock;

namespace {

double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// Streaming read bandwidth: the sum of a 1 GiB buffer, best of three.
double ReadBandwidth() {
  const size_t n = (1ull << 30) / sizeof(uint64_t);
  std::vector<uint64_t> buf(n, 1);
  double best = 0;
  volatile uint64_t sink = 0;
  for (int rep = 0; rep < 3; ++rep) {
    auto t = Clock::now();
    uint64_t a = 0, b = 0, c = 0, d = 0;
    for (size_t i = 0; i < n; i += 4) {
      a += buf[i];
      b += buf[i + 1];
      c += buf[i + 2];
      d += buf[i + 3];
    }
    sink = a + b + c + d;
    best = std::max(best, (n * sizeof(uint64_t)) / Since(t) / 1e9);
  }
  (void)sink;
  return best;
}

// A GPU backend's traffic per step between two reports (nothing for the CPU).
void PrintTraffic(const BackendReport& before, const BackendReport& after, int steps) {
  if (after.backend == "cpu") return;
  std::printf(
      "       per step: %.1f ops (%.1f kernels), %.1f KB to the device (%.1f copies queued, %.1f "
      "waited for), %.1f KB to the host (%.1f copies), %.1f waits, %.1f kept buffers found on "
      "the device, %.1f block versions compared\n",
      double(after.device_ops - before.device_ops) / steps,
      double(after.kernel_launches - before.kernel_launches) / steps,
      (after.bytes_to_device - before.bytes_to_device) / 1e3 / steps,
      double(after.uploads_queued - before.uploads_queued) / steps,
      double(after.uploads_waited - before.uploads_waited) / steps,
      (after.bytes_to_host - before.bytes_to_host) / 1e3 / steps,
      double(after.downloads - before.downloads) / steps,
      double(after.waits - before.waits) / steps,
      double(after.kept_reused - before.kept_reused) / steps,
      double(after.kv_versions_compared - before.kv_versions_compared) / steps);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: engine_bench MODEL_DIR [PREFILL_CONTEXT...]\n");
    return 2;
  }
  // Prefill contexts; 131072 takes tens of minutes on a small CPU, so it is asked for by name.
  std::vector<size_t> contexts, decode_at;
  std::string backend_name = "cpu";
  GpuOptions gpu;
  for (int i = 2; i < argc; ++i) {
    if (std::strcmp(argv[i], "--backend") == 0 && i + 1 < argc) {
      backend_name = argv[++i];
    } else if (std::strcmp(argv[i], "--gpu-gemms") == 0 && i + 1 < argc) {
      const std::string kind = argv[++i];
      if (kind != "exact" && kind != "matrix") {
        return (std::fprintf(stderr, "--gpu-gemms is exact or matrix\n"), 2);
      }
      gpu.matrix_gemms = kind == "matrix";
    } else if (std::strcmp(argv[i], "--uploads") == 0 && i + 1 < argc) {
      const std::string kind = argv[++i];
      if (kind != "queued" && kind != "waited") {
        return (std::fprintf(stderr, "--uploads is queued or waited\n"), 2);
      }
      gpu.queued_uploads = kind == "queued";
    } else if (std::strcmp(argv[i], "--launch") == 0 && i + 1 < argc) {
      const std::string kind = argv[++i];
      if (kind != "early" && kind != "in-turn") {
        return (std::fprintf(stderr, "--launch is early or in-turn\n"), 2);
      }
      gpu.early_launch = kind == "early";
    } else if (std::strcmp(argv[i], "--decode-at") == 0 && i + 1 < argc) {
      decode_at.push_back(std::stoul(argv[++i]));
    } else {
      contexts.push_back(std::stoul(argv[i]));
    }
  }
  if (contexts.empty() && decode_at.empty()) contexts = {1024, 4096, 32768};
  auto model = Model::Load(argv[1]);
  if (!model.ok()) return (std::fprintf(stderr, "%s\n", model.status().ToString().c_str()), 1);
  std::string why;
  auto backend = SelectBackend(backend_name, &why, 0, gpu);
  if (!backend.ok()) return (std::fprintf(stderr, "%s\n", backend.status().ToString().c_str()), 1);
  const BackendReport report = (*backend)->Report();
  std::printf("%s; GEMMs %s%s\n", why.c_str(), report.gemms.c_str(),
              report.early_launch ? "; kernels start early" : "");
  auto fwd = CpuForward::Create(**model, "", 64, std::move(*backend));
  if (!fwd.ok()) return (std::fprintf(stderr, "%s\n", fwd.status().ToString().c_str()), 1);
  {
    // As the engine does at start-up: every weight on the device before the first step.
    const auto t = Clock::now();
    uint64_t bytes = 0;
    if (!(*fwd)->UploadWeights([&](uint64_t done, uint64_t) { bytes = done; }).ok()) return 1;
    if (bytes > 0)
      std::printf("weights uploaded: %llu bytes in %.3f s\n",
                  static_cast<unsigned long long>(bytes), Since(t));
  }
  const ModelConfig& c = (*fwd)->config();
  std::mt19937 rng(1);
  std::uniform_int_distribution<int32_t> tok(3, static_cast<int32_t>(c.vocab_size) - 1);
  auto tokens = [&](size_t n) {
    std::vector<int32_t> t(n);
    for (int32_t& v : t) v = tok(rng);
    return t;
  };

  const double bandwidth = ReadBandwidth();
  std::printf("memory read bandwidth: %.1f GB/s\n", bandwidth);

  // Weight bytes one decode step reads: every dense tensor, and per layer the routed experts
  // the batch touches (at most batch x top-k of them).
  uint64_t dense = 0, per_expert = 0;
  for (const TensorSpec& t : ExpectedTensors(c)) {
    if (t.part == ModelPart::kDSpark) continue;
    const TensorView* v = (*model)->weights().tensors.at(t.name);
    if (t.kind == TensorKind::kFp8Table || t.kind == TensorKind::kFp8RowScale) continue;
    if (t.expert == 0) per_expert += v->nbytes;
    if (t.expert < 0) dense += v->nbytes;
  }
  if (!decode_at.empty()) {
    std::printf("context  first step ms  decode ms/token (batch 1)\n");
    std::uniform_int_distribution<int> byte(0x30, 0x3F);
    const int64_t block = (*fwd)->block_tokens();
    for (size_t n : decode_at) {
      const int64_t position = static_cast<int64_t>(n) / block * block;
      std::vector<int32_t> blocks;
      KvPool& pool = *(*fwd)->pool();
      for (int64_t b = 0; b < position / block; ++b) {
        const int32_t id = pool.Allocate();
        uint8_t* data = pool.mutable_data(id);
        for (size_t i = 0; i < pool.block_bytes(); ++i) data[i] = static_cast<uint8_t>(byte(rng));
        blocks.push_back(id);
      }
      std::vector<int32_t> before = tokens(8);
      auto st = (*fwd)->ResumeAt(position, before, std::move(blocks));
      if (!st.ok()) return (std::fprintf(stderr, "%s\n", st.status().ToString().c_str()), 1);
      std::vector<float> l;
      std::vector<int32_t> next(1);
      // The first step also reads the whole context in (a GPU backend copies its blocks to the
      // device then); the steps after it are what decoding behind that context costs.
      auto t = Clock::now();
      next[0] = tok(rng);
      if (!(*fwd)->Forward(&*st, next, &l).ok()) return 1;
      const double first = Since(t) * 1e3;
      const int steps = 8;
      const BackendReport start = (*fwd)->backend().Report();
      t = Clock::now();
      for (int s = 0; s < steps; ++s) {
        next[0] = tok(rng);
        if (!(*fwd)->Forward(&*st, next, &l).ok()) return 1;
      }
      std::printf("%7lld  %14.2f  %25.2f\n", static_cast<long long>(position), first,
                  Since(t) * 1e3 / steps);
      PrintTraffic(start, (*fwd)->backend().Report(), steps);
      std::fflush(stdout);
    }
    if (contexts.empty()) return 0;
  }
  std::printf("batch  decode tokens/s  weight bytes/step  read GB/s  share of bandwidth\n");
  for (int batch : {1, 8, 32}) {
    std::vector<SequenceState> states;
    std::vector<std::vector<float>> logits(batch);
    for (int i = 0; i < batch; ++i) {
      states.push_back((*fwd)->NewSequence());
      std::vector<float> l;
      if (!(*fwd)->Forward(&states.back(), tokens(64), &l).ok()) return 1;
    }
    const int steps = 64;
    std::vector<std::vector<int32_t>> next(batch, std::vector<int32_t>(1));
    const BackendReport before = (*fwd)->backend().Report();
    auto t = Clock::now();
    for (int s = 0; s < steps; ++s) {
      std::vector<BatchItem> items;
      for (int i = 0; i < batch; ++i) {
        next[i][0] = tok(rng);
        items.push_back({&states[i], next[i], &logits[i]});
      }
      if (!(*fwd)->ForwardBatch(items).ok()) return 1;
    }
    const double seconds = Since(t);
    const uint64_t experts_touched =
        std::min<uint64_t>(c.n_routed_experts, uint64_t(batch) * c.num_experts_per_tok);
    // per_expert already sums expert 0 of every layer: one expert's bytes across the stack.
    const uint64_t step_bytes = dense + experts_touched * per_expert;
    const double gbs = step_bytes * (steps / seconds) / 1e9;
    std::printf("%5d  %15.1f  %17llu  %9.2f  %17.1f%%\n", batch, batch * steps / seconds,
                static_cast<unsigned long long>(step_bytes), gbs, 100.0 * gbs / bandwidth);
    PrintTraffic(before, (*fwd)->backend().Report(), steps);
  }
  std::printf("context  prefill tokens/s (whole prompt)  last chunk tokens/s\n");
  for (size_t n : contexts) {
    SequenceState st = (*fwd)->NewSequence();
    std::vector<int32_t> p = tokens(n);
    std::vector<float> l;
    auto t = Clock::now();
    double last = 0;
    for (size_t done = 0; done < n; done += 512) {
      const size_t len = std::min<size_t>(512, n - done);
      auto c0 = Clock::now();
      if (!(*fwd)->Forward(&st, std::span<const int32_t>(&p[done], len), &l).ok()) return 1;
      last = len / Since(c0);
    }
    std::printf("%7zu  %31.1f  %19.1f\n", n, n / Since(t), last);
    std::fflush(stdout);
  }
  return 0;
}
