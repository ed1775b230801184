// Measures the quantized linear kernels: the plain references against the threaded versions, in
// the same run, as a ratio. Shapes are the released model's decode-time projections scaled down
// where the reference would take minutes.
//
//   build/bench/linear_bench [threads]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <thread>
#include <vector>

#include "kernels/cpu/formats.h"
#include "kernels/cpu/linear.h"
#include "kernels/cpu/ops.h"

namespace k = flashd::kernels::cpu;

namespace {

template <typename Fn>
double Seconds(Fn fn, int repeats) {
  fn();  // Warm caches and the page tables of the output.
  auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < repeats; ++i) fn();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / repeats;
}

}  // namespace

int main(int argc, char** argv) {
  int threads =
      argc > 1 ? std::atoi(argv[1]) : static_cast<int>(std::thread::hardware_concurrency());
  struct Shape {
    const char* what;
    size_t M, K, N;
  };
  const Shape shapes[] = {
      {"wq_a  decode (1 x 5120 -> 1280)", 1, 5120, 1280},
      {"wq_a  batch 8", 8, 5120, 1280},
      {"expert w1 decode (1 x 5120 -> 2304)", 1, 5120, 2304},
  };
  std::mt19937 rng(1);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::printf("threads %d\n", threads);
  std::printf("%-38s %6s %12s %12s %8s\n", "shape", "format", "ref GFLOP/s", "fast GFLOP/s",
              "speedup");
  for (const Shape& s : shapes) {
    std::vector<float> x(s.M * s.K), w(s.N * s.K), y(s.M * s.N);
    for (float& v : x) v = dist(rng);
    for (float& v : w) v = dist(rng) * 0.02f;
    std::vector<uint8_t> xq(x.size()), xs(x.size() / 32);
    k::QuantizeFp8PerBlock(x.data(), x.size(), 32, xq.data(), xs.data());
    std::vector<uint8_t> w8(w.size()), w8s(((s.N + 31) / 32) * (s.K / 32));
    k::QuantizeFp8Weight(w.data(), s.N, s.K, w8.data(), w8s.data());
    std::vector<uint8_t> w4(w.size() / 2), w4s(w.size() / 32);
    for (size_t n = 0; n < s.N; ++n) {
      k::QuantizeFp4E8M0(w.data() + n * s.K, s.K, 32, w4.data() + n * s.K / 2,
                         w4s.data() + n * s.K / 32);
    }
    const double flops = 2.0 * s.M * s.K * s.N;
    double ref8 = Seconds(
        [&] {
          k::Fp8LinearRef(xq.data(), xs.data(), s.M, s.K, w8.data(), w8s.data(), s.N, y.data());
        },
        3);
    double fast8 = Seconds(
        [&] {
          k::Fp8Linear(xq.data(), xs.data(), s.M, s.K, w8.data(), w8s.data(), s.N, y.data(),
                       threads);
        },
        10);
    std::printf("%-38s %6s %12.2f %12.2f %7.1fx\n", s.what, "fp8", flops / ref8 / 1e9,
                flops / fast8 / 1e9, ref8 / fast8);
    double ref4 = Seconds(
        [&] {
          k::Fp4LinearRef(xq.data(), xs.data(), s.M, s.K, w4.data(), w4s.data(), s.N, y.data());
        },
        3);
    double fast4 = Seconds(
        [&] {
          k::Fp4Linear(xq.data(), xs.data(), s.M, s.K, w4.data(), w4s.data(), s.N, y.data(),
                       threads);
        },
        10);
    std::printf("%-38s %6s %12.2f %12.2f %7.1fx\n", s.what, "fp4", flops / ref4 / 1e9,
                flops / fast4 / 1e9, ref4 / fast4);
  }

  // wo_a, which the model runs dequantized: a group's GEMM over its fp32 values (what the forward
  // pass held) against the same sums over its FP8 codes and scales as stored (kFp8Dense), the
  // same results; the two alternated, best of five rounds each.
  std::printf("\n%-38s %12s %12s %8s\n", "wo_a group", "fp32 us", "fp8 us", "fp8/fp32");
  for (size_t M : {size_t{1}, size_t{8}}) {
    const size_t K = 4096, N = 1024;
    std::vector<float> x(M * K), w(N * K), y(M * N);
    for (float& v : x) v = dist(rng);
    for (float& v : w) v = dist(rng) * 0.02f;
    std::vector<uint8_t> w8(w.size()), w8s(((N + 31) / 32) * (K / 32));
    k::QuantizeFp8Weight(w.data(), N, K, w8.data(), w8s.data());
    std::vector<float> values(w.size());
    k::DequantizeFp8Weight(w8.data(), w8s.data(), N, K, values.data());
    namespace ops = flashd::kernels;
    ops::LinearParams dense{.x = x.data(),
                            .rows = static_cast<int64_t>(M),
                            .in = static_cast<int64_t>(K),
                            .out = static_cast<int64_t>(N),
                            .dense = values.data(),
                            .y = y.data()};
    ops::LinearParams fp8 = dense;
    fp8.format = ops::WeightFormat::kFp8Dense;
    fp8.dense = nullptr;
    fp8.w = w8.data();
    fp8.w_scales = w8s.data();
    double t32 = 1e30, t8 = 1e30;
    for (int round = 0; round < 5; ++round) {
      t32 = std::min(t32, Seconds([&] { (void)k::Linear(dense); }, 10));
      t8 = std::min(t8, Seconds([&] { (void)k::Linear(fp8); }, 10));
    }
    char what[64];
    std::snprintf(what, sizeof what, "%zu x 4096 -> 1024", M);
    std::printf("%-38s %12.1f %12.1f %7.2fx\n", what, t32 * 1e6, t8 * 1e6, t8 / t32);
  }
  return 0;
}
