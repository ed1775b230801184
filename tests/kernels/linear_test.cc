// The quantized linear kernels: the threaded versions against the plain references, and the
// references against a double-precision product of the dequantized operands.
#include "kernels/cpu/linear.h"

#include <bit>
#include <boost/test/unit_test.hpp>
#include <cmath>
#include <random>
#include <vector>

#include "kernels/cpu/formats.h"

namespace flashd::kernels::cpu {
namespace {

struct Shape {
  size_t M, K, N;
};
const Shape kShapes[] = {{1, 32, 1}, {3, 64, 33}, {5, 256, 70}, {2, 96, 40}, {8, 512, 129}};

struct Operands {
  std::vector<uint8_t> x_q, x_s;
  std::vector<float> x;  // Dequantized activations.
};

Operands QuantizedActivations(const Shape& s, std::mt19937& rng) {
  std::normal_distribution<float> dist(0.0f, 2.0f);
  Operands o;
  std::vector<float> raw(s.M * s.K);
  for (float& v : raw) v = dist(rng);
  o.x_q.resize(s.M * s.K);
  o.x_s.resize(s.M * s.K / 32);
  QuantizeFp8PerBlock(raw.data(), raw.size(), 32, o.x_q.data(), o.x_s.data());
  o.x.resize(raw.size());
  DequantizeFp8PerBlock(o.x_q.data(), o.x_s.data(), raw.size(), 32, o.x.data());
  return o;
}

// Relative error against the largest magnitude in the expected output.
void CheckClose(const std::vector<float>& got, const std::vector<double>& want, double tol) {
  double scale = 1e-30;
  for (double v : want) scale = std::max(scale, std::fabs(v));
  for (size_t i = 0; i < want.size(); ++i) {
    BOOST_TEST(std::fabs(got[i] - want[i]) / scale <= tol, "i=" << i);
  }
}

std::vector<double> Exact(const std::vector<float>& x, const std::vector<float>& w,
                          const Shape& s) {
  std::vector<double> y(s.M * s.N, 0.0);
  for (size_t m = 0; m < s.M; ++m) {
    for (size_t n = 0; n < s.N; ++n) {
      for (size_t k = 0; k < s.K; ++k) y[m * s.N + n] += double(x[m * s.K + k]) * w[n * s.K + k];
    }
  }
  return y;
}

BOOST_AUTO_TEST_SUITE(linear)

BOOST_AUTO_TEST_CASE(fp8_linear_matches_reference_and_exact_product) {
  std::mt19937 rng(7);
  for (const Shape& s : kShapes) {
    BOOST_TEST_CONTEXT("M=" << s.M << " K=" << s.K << " N=" << s.N) {
      Operands a = QuantizedActivations(s, rng);
      std::normal_distribution<float> dist(0.0f, 0.05f);
      std::vector<float> w(s.N * s.K);
      for (float& v : w) v = dist(rng);
      std::vector<uint8_t> w_q(w.size()), w_s(((s.N + 31) / 32) * (s.K / 32));
      QuantizeFp8Weight(w.data(), s.N, s.K, w_q.data(), w_s.data());
      std::vector<float> w_deq(w.size());
      DequantizeFp8Weight(w_q.data(), w_s.data(), s.N, s.K, w_deq.data());

      std::vector<float> ref(s.M * s.N), fast1(s.M * s.N), fast3(s.M * s.N);
      BOOST_REQUIRE(Fp8LinearRef(a.x_q.data(), a.x_s.data(), s.M, s.K, w_q.data(), w_s.data(), s.N,
                                 ref.data()) == KernelStatus::kOk);
      BOOST_REQUIRE(Fp8Linear(a.x_q.data(), a.x_s.data(), s.M, s.K, w_q.data(), w_s.data(), s.N,
                              fast1.data(), 1) == KernelStatus::kOk);
      BOOST_REQUIRE(Fp8Linear(a.x_q.data(), a.x_s.data(), s.M, s.K, w_q.data(), w_s.data(), s.N,
                              fast3.data(), 3) == KernelStatus::kOk);
      std::vector<double> exact = Exact(a.x, w_deq, s);
      CheckClose(ref, exact, 1e-5);
      CheckClose(fast1, exact, 1e-5);
      for (size_t i = 0; i < ref.size(); ++i) BOOST_TEST(fast1[i] == fast3[i]);
    }
  }
}

BOOST_AUTO_TEST_CASE(fp4_linear_matches_reference_and_exact_product) {
  std::mt19937 rng(11);
  for (const Shape& s : kShapes) {
    BOOST_TEST_CONTEXT("M=" << s.M << " K=" << s.K << " N=" << s.N) {
      Operands a = QuantizedActivations(s, rng);
      std::normal_distribution<float> dist(0.0f, 0.05f);
      std::vector<float> w(s.N * s.K);
      for (float& v : w) v = dist(rng);
      std::vector<uint8_t> w_p(w.size() / 2), w_s(s.N * s.K / 32);
      for (size_t n = 0; n < s.N; ++n) {
        QuantizeFp4E8M0(w.data() + n * s.K, s.K, 32, w_p.data() + n * s.K / 2,
                        w_s.data() + n * s.K / 32);
      }
      std::vector<float> w_deq(w.size());
      DequantizeFp4E8M0(w_p.data(), w_s.data(), w.size(), 32, w_deq.data());

      std::vector<float> ref(s.M * s.N), fast(s.M * s.N);
      BOOST_REQUIRE(Fp4LinearRef(a.x_q.data(), a.x_s.data(), s.M, s.K, w_p.data(), w_s.data(), s.N,
                                 ref.data()) == KernelStatus::kOk);
      BOOST_REQUIRE(Fp4Linear(a.x_q.data(), a.x_s.data(), s.M, s.K, w_p.data(), w_s.data(), s.N,
                              fast.data(), 4) == KernelStatus::kOk);
      std::vector<double> exact = Exact(a.x, w_deq, s);
      CheckClose(ref, exact, 1e-5);
      CheckClose(fast, exact, 1e-5);
    }
  }
}

BOOST_AUTO_TEST_CASE(dense_linear_matches_reference) {
  std::mt19937 rng(3);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  const Shape shapes[] = {{1, 5, 3}, {4, 128, 129}, {7, 33, 300}};
  for (const Shape& s : shapes) {
    std::vector<float> x(s.M * s.K), w(s.N * s.K), ref(s.M * s.N), fast(s.M * s.N);
    for (float& v : x) v = dist(rng);
    for (float& v : w) v = dist(rng);
    DenseLinearRef(x.data(), s.M, s.K, w.data(), s.N, ref.data());
    DenseLinear(x.data(), s.M, s.K, w.data(), s.N, fast.data(), 2);
    std::vector<double> exact(s.M * s.N, 0.0);
    for (size_t m = 0; m < s.M; ++m) {
      for (size_t n = 0; n < s.N; ++n) {
        for (size_t k = 0; k < s.K; ++k)
          exact[m * s.N + n] += double(x[m * s.K + k]) * w[n * s.K + k];
      }
    }
    CheckClose(ref, exact, 1e-5);
    CheckClose(fast, exact, 1e-5);
  }
}

// Every instruction-set version of the fast path's dot product gives the plain definition's
// bits: same lanes, same order. Odd block counts exercise the paired layout's unpaired tail.
BOOST_AUTO_TEST_CASE(vector_dot_products_equal_the_plain_one_bit_for_bit) {
  std::mt19937 rng(7);
  std::normal_distribution<float> dist(0.0f, 3.0f);
  std::uniform_int_distribution<int> scale_exp(-20, 20);
  for (size_t blocks : {1, 2, 3, 7, 8, 16, 33}) {
    const size_t K = blocks * 32;
    for (int rep = 0; rep < 20; ++rep) {
      std::vector<float> x(8 * K), w(K), scales(blocks);
      for (float& v : x) v = dist(rng);
      for (float& v : w) v = dist(rng);
      for (float& v : scales) v = std::ldexp(1.0f, scale_exp(rng));
      if (rep == 0) x[3] = -0.0f;  // A signed zero product in some lane.
      std::vector<float> want(8);
      for (size_t r = 0; r < 8; ++r) {
        want[r] = internal::ScaledBlockDotPlain(&x[r * K], w.data(), scales.data(), blocks);
      }
      const float got = internal::ScaledBlockDot(x.data(), w.data(), scales.data(), blocks);
      BOOST_TEST(std::bit_cast<uint32_t>(got) == std::bit_cast<uint32_t>(want[0]),
                 "blocks " << blocks);
#if defined(__x86_64__)
      const float sse = internal::ScaledBlockDotSse(x.data(), w.data(), scales.data(), blocks);
      BOOST_TEST(std::bit_cast<uint32_t>(sse) == std::bit_cast<uint32_t>(want[0]));
      if (internal::CpuHasAvx2()) {
        std::vector<float> px(8 * K), pw(K);
        for (size_t r = 0; r < 8; ++r) internal::ToPaired(&x[r * K], K, &px[r * K]);
        internal::ToPaired(w.data(), K, pw.data());
        float eight[8], four[4];
        internal::PairedDot8Avx2(px.data(), K, pw.data(), scales.data(), blocks, eight);
        internal::PairedDot4Avx2(px.data() + 4 * K, K, pw.data(), scales.data(), blocks, four);
        for (size_t r = 0; r < 8; ++r) {
          const float one = internal::PairedDot1Avx2(&px[r * K], pw.data(), scales.data(), blocks);
          BOOST_TEST(std::bit_cast<uint32_t>(one) == std::bit_cast<uint32_t>(want[r]),
                     "blocks " << blocks << " row " << r);
          BOOST_TEST(std::bit_cast<uint32_t>(eight[r]) == std::bit_cast<uint32_t>(want[r]),
                     "blocks " << blocks << " row " << r);
          if (r >= 4) {
            BOOST_TEST(std::bit_cast<uint32_t>(four[r - 4]) == std::bit_cast<uint32_t>(want[r]));
          }
        }
      }
#endif
    }
  }
  if (!internal::CpuHasAvx2()) BOOST_TEST_MESSAGE("this CPU has no AVX2: that path was not run");
}

// The paired layout is a permutation, and the decoders that write it give every code's value
// where that permutation puts it: all 256 FP8 codes (NaN too) and all 256 FP4 byte values.
BOOST_AUTO_TEST_CASE(paired_decoders_equal_the_plain_decoding_of_every_code) {
  for (size_t blocks : {1, 2, 3, 8, 9}) {
    const size_t K = blocks * 32;
    std::vector<int> seen(K, 0);
    for (size_t k = 0; k < K; ++k) {
      BOOST_REQUIRE(internal::PairedIndex(k) < K || (blocks % 2 == 1 && k >= K - 32));
      if (k < K / 64 * 64) ++seen[internal::PairedIndex(k)];
    }
    for (size_t k = 0; k < K / 64 * 64; ++k) BOOST_TEST(seen[k] == 1);
  }
#if defined(__x86_64__)
  if (!internal::CpuHasAvx2()) {
    BOOST_TEST_MESSAGE("this CPU has no AVX2: the paired decoders were not run");
    return;
  }
  for (size_t blocks : {1, 2, 3, 8, 9}) {
    const size_t K = blocks * 32;
    std::vector<uint8_t> codes(K);
    for (int start = 0; start < 256; start += static_cast<int>(K)) {
      for (size_t k = 0; k < K; ++k) codes[k] = static_cast<uint8_t>((start + k * 37) % 256);
      std::vector<float> plain(K), want(K), got(K);
      for (size_t k = 0; k < K; ++k) plain[k] = E4M3ToFloatArith(codes[k]);  // NaN unsigned.
      internal::ToPaired(plain.data(), K, want.data());
      internal::DecodeFp8RowPairedAvx2(codes.data(), K, got.data());
      for (size_t k = 0; k < K; ++k) {
        BOOST_TEST(std::bit_cast<uint32_t>(got[k]) == std::bit_cast<uint32_t>(want[k]),
                   "fp8 k " << k);
      }
      // FP4: the same bytes as K / 2 packed pairs (low nibble first), then the other half.
      for (size_t half = 0; half < 2; ++half) {
        const uint8_t* packed = codes.data() + half * K / 2;
        for (size_t k = 0; k < K; ++k) {
          plain[k] = E2M1ToFloat(k % 2 == 0 ? packed[k / 2] & 0xF : packed[k / 2] >> 4);
        }
        internal::ToPaired(plain.data(), K, want.data());
        internal::DecodeFp4RowPairedAvx2(packed, K, got.data());
        for (size_t k = 0; k < K; ++k) {
          BOOST_TEST(std::bit_cast<uint32_t>(got[k]) == std::bit_cast<uint32_t>(want[k]),
                     "fp4 k " << k);
        }
      }
    }
  }
#else
  BOOST_TEST_MESSAGE("no AVX2 path on this architecture");
#endif
}

BOOST_AUTO_TEST_CASE(dense_vector_dots_equal_the_plain_one_bit_for_bit) {
#if defined(__x86_64__)
  std::mt19937 rng(9);
  std::normal_distribution<float> dist(0.0f, 2.0f);
  for (size_t K : {1, 3, 4, 31, 64, 130}) {
    std::vector<float> x(4 * K), w(K);
    for (float& v : x) v = dist(rng);
    for (float& v : w) v = dist(rng);
    float four[4];
    internal::DenseDot4Sse(x.data(), K, w.data(), K, four);
    for (size_t r = 0; r < 4; ++r) {
      const float one = internal::DenseDotPlain(&x[r * K], w.data(), K);
      BOOST_TEST(std::bit_cast<uint32_t>(four[r]) == std::bit_cast<uint32_t>(one), "K " << K);
      const float sse = internal::DenseDot1Sse(&x[r * K], w.data(), K);
      BOOST_TEST(std::bit_cast<uint32_t>(sse) == std::bit_cast<uint32_t>(one), "K " << K);
    }
  }
#else
  BOOST_TEST_MESSAGE("no SSE path on this architecture");
#endif
}

BOOST_AUTO_TEST_CASE(bad_shapes_are_refused) {
  std::vector<uint8_t> b(64);
  std::vector<float> y(4);
  BOOST_TEST((Fp8LinearRef(b.data(), b.data(), 1, 33, b.data(), b.data(), 1, y.data()) ==
              KernelStatus::kBadShape));
  BOOST_TEST((Fp4Linear(b.data(), b.data(), 0, 32, b.data(), b.data(), 1, y.data(), 2) ==
              KernelStatus::kBadShape));
}

BOOST_AUTO_TEST_SUITE_END()

}  // namespace
}  // namespace flashd::kernels::cpu
