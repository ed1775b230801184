// Measures the quantized linear kernels: the plain references against the threaded versions, in
// the same run, as a ratio. Shapes are the released model's decode-time projections scaled down
// where the reference would take minutes.
//
//   build/bench/linear_bench [threads]
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <thread>
#include <vector>

#include "kernels/cpu/formats.h"
#include "kernels/cpu/linear.h"

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
  return 0;
}
