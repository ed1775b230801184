// Every op of kernels/ops.h on the CPU against an oracle computed independently (in double
// precision, or exactly where the result is a format conversion), over a table of shapes with
// the awkward cases: 1 and 257 rows, widths that are not multiples of 32 where the op allows
// them, blocks shared by several entries, and -1 entries. Tolerances by kind of output:
// bit-exact for codecs and copies, 1-2 BF16 ulps for BF16-rounded results, a normalised mean
// squared error for fp32 GEMMs, equal sets (ties in a stated order) for top-k.
#include "kernels/cpu/ops.h"

#include <algorithm>
#include <bit>
#include <boost/test/unit_test.hpp>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "kernels/cpu/formats.h"
#include "tests/support/moe_choices.h"
#include "tests/support/quantized_weights.h"

namespace flashd::kernels::cpu {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

struct Rng {
  std::mt19937 gen;
  explicit Rng(uint32_t seed) : gen(seed) {}
  std::vector<float> Normal(size_t n, float sd = 1.0f) {
    std::normal_distribution<float> d(0.0f, sd);
    std::vector<float> v(n);
    for (float& x : v) x = d(gen);
    return v;
  }
  std::vector<float> Bf16Normal(size_t n, float sd = 1.0f) {
    std::vector<float> v = Normal(n, sd);
    for (float& x : v) x = Bf16ToFloat(FloatToBf16(x));
    return v;
  }
  int64_t Int(int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(gen);
  }
};

float Bf(double x) { return Bf16ToFloat(FloatToBf16(static_cast<float>(x))); }

// How many BF16 steps (at the larger magnitude) apart two values are.
double Bf16Ulps(float a, float b) {
  if (a == b) return 0;
  const float m = std::max(std::fabs(a), std::fabs(b));
  int e;
  std::frexp(m, &e);
  return std::fabs(double(a) - double(b)) / std::ldexp(1.0, e - 8);
}

void CheckBf16Close(const std::vector<float>& got, const std::vector<double>& want, double ulps,
                    const char* what) {
  BOOST_REQUIRE_EQUAL(got.size(), want.size());
  double worst = 0;
  size_t at = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double u = Bf16Ulps(got[i], Bf(want[i]));
    if (u > worst) worst = u, at = i;
  }
  BOOST_TEST(worst <= ulps, what << ": " << worst << " BF16 ulps at " << at << " (got " << got[at]
                                 << ", want " << want[at] << ")");
}

double Nmse(const std::vector<float>& got, const std::vector<double>& want) {
  double err = 0, ref = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    err += (got[i] - want[i]) * (got[i] - want[i]);
    ref += want[i] * want[i];
  }
  return ref > 0 ? err / ref : err;
}

bool BitEqual(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

const int64_t kRowCounts[] = {1, 3, 257};

BOOST_AUTO_TEST_SUITE(ops)

// --- Linear -----------------------------------------------------------------------------------
BOOST_AUTO_TEST_CASE(linear_all_formats_against_a_double_product) {
  struct Case {
    WeightFormat format;
    int64_t in, out;
  };
  const Case cases[] = {{WeightFormat::kFp8, 64, 33},   {WeightFormat::kFp8, 96, 70},
                        {WeightFormat::kFp4, 64, 33},   {WeightFormat::kFp4, 160, 5},
                        {WeightFormat::kDense, 45, 31}, {WeightFormat::kDense, 128, 1}};
  Rng rng(1);
  for (const Case& c : cases) {
    for (int64_t rows : kRowCounts) {
      std::vector<float> x = rng.Bf16Normal(rows * c.in), w = rng.Normal(c.out * c.in, 0.2f);
      // The weights as stored, and as the op sees them.
      const testing::QuantizedWeights qw = testing::QuantizeWeights(c.format, w, c.out, c.in);
      const std::vector<float>& wd = qw.decoded;
      // The activations as the op sees them: FP8 per 32 for quantized weights.
      std::vector<float> xd = x;
      if (c.format != WeightFormat::kDense) RoundTripFp8(xd.data(), xd.size(), 32);
      std::vector<double> want(rows * c.out);
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t o = 0; o < c.out; ++o) {
          double acc = 0;
          for (int64_t i = 0; i < c.in; ++i) acc += double(xd[r * c.in + i]) * wd[o * c.in + i];
          want[r * c.out + o] = acc;
        }
      }
      std::vector<uint8_t> xq(x.size()), xs(x.size() / 32 + 1);
      std::vector<float> y(rows * c.out, -1.0f);
      CpuStream two{2};
      BOOST_REQUIRE(Linear({.x = x.data(),
                            .rows = rows,
                            .in = c.in,
                            .out = c.out,
                            .format = c.format,
                            .w = qw.codes.data(),
                            .w_scales = qw.scales.data(),
                            .dense = w.data(),
                            .x_codes = xq.data(),
                            .x_scales = xs.data(),
                            .y = y.data(),
                            .stream = &two}) == OpStatus::kOk);
      BOOST_TEST(Nmse(y, want) < 1e-10, "format " << int(c.format) << " rows " << rows);
    }
  }
  float y;
  BOOST_TEST(
      (Linear({.x = &y, .rows = 1, .in = 40, .out = 1, .format = WeightFormat::kFp8, .y = &y}) ==
       OpStatus::kBadShape));
}

// --- Rounding, norm, rotation, fake quantization ----------------------------------------------
BOOST_AUTO_TEST_CASE(round_bf16_is_nearest_even) {
  Rng rng(2);
  std::vector<float> x = rng.Normal(5000, 100.0f);
  x.push_back(1.0f + 0x1p-8f);      // A tie: rounds to even (1.0).
  x.push_back(1.0f + 3 * 0x1p-8f);  // A tie: rounds to even (1 + 2^-6).
  std::vector<float> got = x;
  BOOST_REQUIRE(RoundBf16({.x = got.data(), .n = static_cast<int64_t>(got.size())}) ==
                OpStatus::kOk);
  for (size_t i = 0; i < x.size(); ++i) {
    // The two BF16 neighbours by truncation, then the nearer, ties to an even mantissa.
    const uint32_t bits = std::bit_cast<uint32_t>(x[i]);
    const float lo = std::bit_cast<float>(bits & 0xFFFF0000u);
    const float hi = std::bit_cast<float>((bits & 0xFFFF0000u) + 0x10000u);
    const double dl = std::fabs(double(x[i]) - lo), dh = std::fabs(double(hi) - x[i]);
    const float want = dl < dh ? lo : dh < dl ? hi : ((bits >> 16) & 1) == 0 ? lo : hi;
    BOOST_TEST(got[i] == want, "x=" << x[i]);
  }
  BOOST_TEST(got[5000] == 1.0f);
  BOOST_TEST(got[5001] == 1.0f + 0x1p-6f);
  // With a scale: the rounded value scaled, rounded again (two roundings, not one).
  std::vector<float> scaled = x;
  const float s = 0.0883883f;
  BOOST_REQUIRE(RoundBf16({.x = scaled.data(), .n = static_cast<int64_t>(x.size()), .scale = s}) ==
                OpStatus::kOk);
  size_t twice_differs = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    BOOST_TEST(scaled[i] == Bf(got[i] * s), "x=" << x[i]);
    twice_differs += scaled[i] != Bf(x[i] * s);
  }
  BOOST_TEST(twice_differs > 0u);  // The first rounding matters for some inputs.
}

BOOST_AUTO_TEST_CASE(rms_norm_against_double) {
  Rng rng(3);
  for (int64_t dim : {7, 32, 100}) {
    for (int64_t rows : kRowCounts) {
      for (bool round_input : {false, true}) {
        const int64_t stride = dim + 3;  // Rows need not be packed.
        std::vector<float> x = rng.Normal(rows * stride, 3.0f), w = rng.Bf16Normal(dim);
        std::vector<float> got = x;
        BOOST_REQUIRE(RmsNorm({.x = got.data(),
                               .rows = rows,
                               .dim = dim,
                               .stride = stride,
                               .weight = w.data(),
                               .eps = 1e-6f,
                               .round_input = round_input}) == OpStatus::kOk);
        std::vector<float> out;
        std::vector<double> want;
        for (int64_t r = 0; r < rows; ++r) {
          std::vector<double> v(dim);
          double ss = 0;
          for (int64_t i = 0; i < dim; ++i) {
            v[i] = round_input ? Bf(x[r * stride + i]) : x[r * stride + i];
            ss += v[i] * v[i];
          }
          const double scale = 1.0 / std::sqrt(ss / dim + 1e-6);
          for (int64_t i = 0; i < dim; ++i) {
            want.push_back(w[i] * v[i] * scale);
            out.push_back(got[r * stride + i]);
          }
          // The padding between rows is untouched.
          for (int64_t i = dim; i < stride; ++i)
            BOOST_TEST(got[r * stride + i] == x[r * stride + i]);
        }
        CheckBf16Close(out, want, 1, "rms_norm");
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(rope_and_yarn_frequencies_against_double) {
  // Frequencies: plain and YaRN, against the formulas in double.
  const int dim = 64;
  std::vector<float> plain(dim / 2), yarn(dim / 2);
  RopeFrequencies(dim, 0, 10000.0, 1, 0, 0, plain.data());
  RopeFrequencies(dim, 65536, 160000.0, 16, 32, 1, yarn.data());
  for (int i = 0; i < dim / 2; ++i) {
    const double f = std::pow(10000.0, -2.0 * i / dim);
    BOOST_TEST(std::fabs(plain[i] - f) <= 1e-6 * f);
    const double fy = std::pow(160000.0, -2.0 * i / dim);
    BOOST_TEST(yarn[i] <= fy * (1 + 1e-6));       // Never faster than the base frequency,
    BOOST_TEST(yarn[i] >= fy / 16 * (1 - 1e-6));  // never slower than base / factor.
  }
  BOOST_TEST(std::fabs(yarn[0] - std::pow(160000.0, 0)) < 1e-6);  // High frequencies kept.
  BOOST_TEST(std::fabs(yarn[dim / 2 - 1] - std::pow(160000.0, -2.0 * 31 / 64) / 16) < 1e-9);
  Rng rng(4);
  for (int64_t rows : kRowCounts) {
    for (int64_t heads : {1, 3}) {
      const int64_t head_dim = 96, rope_dim = 64, stride = heads * head_dim;
      std::vector<float> x = rng.Bf16Normal(rows * stride);
      std::vector<int64_t> pos(rows);
      for (int64_t& p : pos) p = rng.Int(0, 1 << 20);
      for (bool inverse : {false, true}) {
        std::vector<float> got = x;
        BOOST_REQUIRE(Rope({.x = got.data(),
                            .rows = rows,
                            .heads = heads,
                            .head_dim = head_dim,
                            .rope_dim = rope_dim,
                            .row_stride = stride,
                            .positions = pos.data(),
                            .freqs = yarn.data(),
                            .inverse = inverse}) == OpStatus::kOk);
        std::vector<float> out;
        std::vector<double> want;
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t h = 0; h < heads; ++h) {
            const float* in = &x[r * stride + h * head_dim];
            const float* o = &got[r * stride + h * head_dim];
            for (int64_t i = 0; i < head_dim - rope_dim; ++i) BOOST_TEST(o[i] == in[i]);
            const float* a = in + head_dim - rope_dim;
            for (int64_t i = 0; i < rope_dim / 2; ++i) {
              // The angle is an fp32 product, as the reference's table is.
              const double angle = static_cast<float>(static_cast<float>(pos[r]) * yarn[i]);
              const double c = std::cos(angle), s = (inverse ? -1 : 1) * std::sin(angle);
              want.push_back(a[2 * i] * c - a[2 * i + 1] * s);
              want.push_back(a[2 * i] * s + a[2 * i + 1] * c);
              out.push_back(o[head_dim - rope_dim + 2 * i]);
              out.push_back(o[head_dim - rope_dim + 2 * i + 1]);
            }
          }
        }
        CheckBf16Close(out, want, 2, "rope");
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(fake_quant_is_the_codec_round_trip) {
  Rng rng(5);
  const FakeQuantFormat formats[] = {FakeQuantFormat::kFp8E8M0, FakeQuantFormat::kFp4E8M0,
                                     FakeQuantFormat::kFp4E4M3};
  for (FakeQuantFormat f : formats) {
    const int64_t block = f == FakeQuantFormat::kFp4E4M3 ? 16 : 32;
    std::vector<float> x = rng.Normal(257 * block, 5.0f), got = x;
    BOOST_REQUIRE(FakeQuant({.x = got.data(),
                             .n = static_cast<int64_t>(got.size()),
                             .block = block,
                             .format = f}) == OpStatus::kOk);
    std::vector<float> want(x.size());
    std::vector<uint8_t> q(x.size()), s(x.size() / block);
    if (f == FakeQuantFormat::kFp8E8M0) {
      QuantizeFp8PerBlock(x.data(), x.size(), block, q.data(), s.data());
      DequantizeFp8PerBlock(q.data(), s.data(), x.size(), block, want.data());
    } else if (f == FakeQuantFormat::kFp4E8M0) {
      QuantizeFp4E8M0(x.data(), x.size(), block, q.data(), s.data());
      DequantizeFp4E8M0(q.data(), s.data(), x.size(), block, want.data());
    } else {
      QuantizeFp4E4M3(x.data(), x.size(), block, q.data(), s.data());
      DequantizeFp4E4M3(q.data(), s.data(), x.size(), block, want.data());
    }
    BOOST_TEST(BitEqual(got, want));
  }
  float x[20];
  BOOST_TEST((FakeQuant({.x = x, .n = 20, .block = 32}) == OpStatus::kBadShape));
}

// --- mHC ----------------------------------------------------------------------------------------
BOOST_AUTO_TEST_CASE(embed_copies_each_row_hc_times) {
  Rng rng(6);
  const int64_t vocab = 50, dim = 24, hc = 4;
  std::vector<float> table = rng.Normal(vocab * dim);
  std::vector<int32_t> tokens = {0, 49, 7, 7};
  std::vector<float> X(tokens.size() * hc * dim);
  BOOST_REQUIRE(Embed({.tokens = tokens.data(),
                       .count = 4,
                       .hc = hc,
                       .dim = dim,
                       .vocab = vocab,
                       .embed = table.data(),
                       .X = X.data()}) == OpStatus::kOk);
  for (size_t t = 0; t < tokens.size(); ++t) {
    for (int64_t h = 0; h < hc; ++h) {
      BOOST_TEST(std::memcmp(&X[(t * hc + h) * dim], &table[tokens[t] * dim], dim * 4) == 0);
    }
  }
  // A token past the table is refused, not read.
  tokens[1] = static_cast<int32_t>(vocab);
  BOOST_TEST((Embed({.tokens = tokens.data(),
                     .count = 4,
                     .hc = hc,
                     .dim = dim,
                     .vocab = vocab,
                     .embed = table.data(),
                     .X = X.data()}) == OpStatus::kBadArgument));
}

BOOST_AUTO_TEST_CASE(hc_mix_against_double_sinkhorn) {
  Rng rng(7);
  const int64_t hc = 4, dim = 40, mix = (2 + hc) * hc;
  const int iters = 20;
  for (int64_t rows : kRowCounts) {
    std::vector<float> X = rng.Bf16Normal(rows * hc * dim), fn = rng.Normal(mix * hc * dim, 0.05f);
    std::vector<float> scale = {0.7f, 1.3f, 0.9f}, base = rng.Normal(mix, 0.5f);
    std::vector<float> mixes(rows * mix), pre(rows * hc), post(rows * hc), comb(rows * hc * hc);
    BOOST_REQUIRE(HcMix({.X = X.data(),
                         .rows = rows,
                         .hc = hc,
                         .dim = dim,
                         .fn = fn.data(),
                         .scale = scale.data(),
                         .base = base.data(),
                         .iters = iters,
                         .hc_eps = 1e-6f,
                         .norm_eps = 1e-6f,
                         .mixes = mixes.data(),
                         .pre = pre.data(),
                         .post = post.data(),
                         .comb = comb.data()}) == OpStatus::kOk);
    double worst = 0, col_err = 0;
    for (int64_t t = 0; t < rows; ++t) {
      const float* xt = &X[t * hc * dim];
      double ss = 0;
      for (int64_t i = 0; i < hc * dim; ++i) ss += double(xt[i]) * xt[i];
      const double r = 1.0 / std::sqrt(ss / (hc * dim) + 1e-6);
      std::vector<double> m(mix);
      for (int64_t j = 0; j < mix; ++j) {
        double acc = 0;
        for (int64_t i = 0; i < hc * dim; ++i) acc += double(xt[i]) * fn[j * hc * dim + i];
        m[j] = acc * r;
      }
      auto sig = [](double v) { return 1 / (1 + std::exp(-v)); };
      std::vector<double> c(hc * hc);
      for (int64_t i = 0; i < hc; ++i) {
        worst = std::max(worst, std::fabs(pre[t * hc + i] - (sig(m[i] * 0.7 + base[i]) + 1e-6)));
        worst =
            std::max(worst, std::fabs(post[t * hc + i] - 2 * sig(m[hc + i] * 1.3 + base[hc + i])));
        double mx = -1e300, sum = 0;
        for (int64_t j = 0; j < hc; ++j) {
          c[i * hc + j] = m[2 * hc + i * hc + j] * 0.9 + base[2 * hc + i * hc + j];
          mx = std::max(mx, c[i * hc + j]);
        }
        for (int64_t j = 0; j < hc; ++j) sum += (c[i * hc + j] = std::exp(c[i * hc + j] - mx));
        for (int64_t j = 0; j < hc; ++j) c[i * hc + j] = c[i * hc + j] / sum + 1e-6;
      }
      auto cols = [&] {
        for (int64_t j = 0; j < hc; ++j) {
          double s = 0;
          for (int64_t i = 0; i < hc; ++i) s += c[i * hc + j];
          for (int64_t i = 0; i < hc; ++i) c[i * hc + j] /= s + 1e-6;
        }
      };
      auto rows_ = [&] {
        for (int64_t i = 0; i < hc; ++i) {
          double s = 0;
          for (int64_t j = 0; j < hc; ++j) s += c[i * hc + j];
          for (int64_t j = 0; j < hc; ++j) c[i * hc + j] /= s + 1e-6;
        }
      };
      cols();
      for (int it = 0; it < iters - 1; ++it) rows_(), cols();
      for (int64_t i = 0; i < hc * hc; ++i) {
        worst = std::max(worst, std::fabs(comb[t * hc * hc + i] - c[i]));
      }
      // Sinkhorn's point: every column of comb sums to one.
      for (int64_t j = 0; j < hc; ++j) {
        double s = 0;
        for (int64_t i = 0; i < hc; ++i) s += comb[t * hc * hc + i * hc + j];
        col_err = std::max(col_err, std::fabs(s - 1));
      }
    }
    BOOST_TEST(worst < 2e-5, "rows " << rows);
    BOOST_TEST(col_err < 1e-4);
  }
}

BOOST_AUTO_TEST_CASE(hc_collapse_and_expand_against_double) {
  Rng rng(8);
  const int64_t hc = 4, dim = 33;
  for (int64_t rows : kRowCounts) {
    std::vector<float> X = rng.Bf16Normal(rows * hc * dim), w = rng.Normal(rows * hc);
    std::vector<float> norm = rng.Bf16Normal(dim), x(rows * dim);
    for (bool with_norm : {false, true}) {
      BOOST_REQUIRE(HcCollapse({.X = X.data(),
                                .weights = w.data(),
                                .rows = rows,
                                .hc = hc,
                                .dim = dim,
                                .norm_weight = with_norm ? norm.data() : nullptr,
                                .eps = 1e-6f,
                                .x = x.data()}) == OpStatus::kOk);
      std::vector<double> want(rows * dim);
      for (int64_t t = 0; t < rows; ++t) {
        double ss = 0;
        for (int64_t d = 0; d < dim; ++d) {
          double acc = 0;
          for (int64_t h = 0; h < hc; ++h) acc += double(w[t * hc + h]) * X[(t * hc + h) * dim + d];
          want[t * dim + d] = with_norm ? Bf(acc) : acc;
          ss += double(Bf(acc)) * Bf(acc);
        }
        if (with_norm) {
          const double r = 1 / std::sqrt(ss / dim + 1e-6);
          for (int64_t d = 0; d < dim; ++d) want[t * dim + d] *= norm[d] * r;
        }
      }
      CheckBf16Close(x, want, with_norm ? 2 : 1, "hc_collapse");
    }
    std::vector<float> sub = rng.Bf16Normal(rows * dim), post = rng.Normal(rows * hc);
    std::vector<float> comb = rng.Normal(rows * hc * hc), out(X.size());
    BOOST_REQUIRE(HcExpand({.X = X.data(),
                            .sub = sub.data(),
                            .post = post.data(),
                            .comb = comb.data(),
                            .rows = rows,
                            .hc = hc,
                            .dim = dim,
                            .out = out.data()}) == OpStatus::kOk);
    std::vector<double> want(X.size());
    for (int64_t t = 0; t < rows; ++t) {
      for (int64_t j = 0; j < hc; ++j) {
        for (int64_t d = 0; d < dim; ++d) {
          double acc = double(post[t * hc + j]) * sub[t * dim + d];
          for (int64_t i = 0; i < hc; ++i) {
            acc += double(comb[(t * hc + i) * hc + j]) * X[(t * hc + i) * dim + d];
          }
          want[(t * hc + j) * dim + d] = acc;
        }
      }
    }
    CheckBf16Close(out, want, 1, "hc_expand");
  }
  float X[4];
  BOOST_TEST((HcExpand({.X = X, .rows = 1, .hc = 1, .dim = 4, .out = X}) == OpStatus::kBadShape));
}

// --- Compressor ---------------------------------------------------------------------------------
BOOST_AUTO_TEST_CASE(compress_pool_groups_across_calls) {
  Rng rng(9);
  const int64_t dim = 32;
  for (int64_t ratio : {2, 4}) {
    for (int64_t rows : {int64_t{1}, int64_t{3}, int64_t{257}}) {
      const int64_t start = rng.Int(0, 9);  // The call may begin inside a group.
      std::vector<float> kv = rng.Normal(rows * dim), score = rng.Normal(rows * dim);
      std::vector<int64_t> pos(rows);
      std::iota(pos.begin(), pos.end(), start);
      // The partial group the sequence carries in: slots of positions before `start`.
      std::vector<float> kv_part = rng.Normal(ratio * dim), score_part = rng.Normal(ratio * dim);
      std::vector<float> kv_in = kv_part, score_in = score_part;
      std::vector<float> pooled(rows * dim);
      BOOST_REQUIRE(CompressPool({.kv = kv.data(),
                                  .score = score.data(),
                                  .rows = rows,
                                  .dim = dim,
                                  .ratio = ratio,
                                  .positions = pos.data(),
                                  .kv_partial = kv_part.data(),
                                  .score_partial = score_part.data(),
                                  .pooled = pooled.data()}) == OpStatus::kOk);
      // Oracle: each completed group from its members (this call's rows, or the carried slots).
      std::vector<float> got;
      std::vector<double> want;
      for (int64_t t = 0; t < rows; ++t) {
        if ((pos[t] + 1) % ratio != 0) continue;
        for (int64_t d = 0; d < dim; ++d) {
          std::vector<double> v(ratio), s(ratio);
          for (int64_t k = 0; k < ratio; ++k) {
            const int64_t p = pos[t] - ratio + 1 + k, row = p - start;
            v[k] = row >= 0 ? kv[row * dim + d] : kv_in[(p % ratio) * dim + d];
            s[k] = row >= 0 ? score[row * dim + d] : score_in[(p % ratio) * dim + d];
          }
          const double mx = *std::max_element(s.begin(), s.end());
          double sum = 0, acc = 0;
          for (int64_t k = 0; k < ratio; ++k) sum += std::exp(s[k] - mx);
          for (int64_t k = 0; k < ratio; ++k) acc += v[k] * std::exp(s[k] - mx) / sum;
          want.push_back(acc);
          got.push_back(pooled[(want.size() - 1) / dim * dim + d]);
        }
      }
      CheckBf16Close(got, want, 1, "compress_pool");
      // The partial state now holds the last rows' slots.
      for (int64_t t = std::max<int64_t>(0, rows - ratio); t < rows; ++t) {
        BOOST_TEST(std::memcmp(&kv_part[(pos[t] % ratio) * dim], &kv[t * dim], dim * 4) == 0);
      }
    }
  }
}

// Pools of a few blocks, as the KV pool lays them out: regions of rows, addressed by row id.
struct Pool {
  int64_t per_block;
  size_t block_bytes;
  std::vector<std::vector<uint8_t>> blocks;
  std::vector<uint8_t*> table;
  Pool(int nblocks, int64_t per, size_t bytes) : per_block(per), block_bytes(bytes) {
    for (int i = 0; i < nblocks; ++i) blocks.emplace_back(bytes, 0xAB);
    for (auto& b : blocks) table.push_back(b.data());
  }
  PagedRows Region(size_t offset, size_t row_bytes) {
    return {table.data(), per_block, offset, row_bytes};
  }
};

BOOST_AUTO_TEST_CASE(compress_write_quantizes_rotated_rows_into_their_blocks) {
  Rng rng(10);
  const int64_t hd = 64, idd = 32, rd = 16, per = 8, groups = 13;
  // Regions: KV codes, KV scales, key codes, key scales.
  const size_t kc = 0, ks = kc + per * hd / 2, qc = ks + per * hd / 16, qs = qc + per * idd / 2;
  Pool pool(4, per, qs + per * idd / 32);
  std::vector<float> freqs(rd / 2);
  RopeFrequencies(rd, 0, 10000.0, 1, 0, 0, freqs.data());
  std::vector<float> latent = rng.Bf16Normal(groups * hd), key = rng.Bf16Normal(groups * idd);
  std::vector<int64_t> pos(groups), rows(groups);
  for (int64_t g = 0; g < groups; ++g) {
    pos[g] = 4 * g;
    rows[g] = g % 5 == 2 ? -1 : (g * 7) % (4 * per);  // Scattered over blocks; some frozen.
  }
  std::vector<float> l_in = latent, k_in = key;
  const std::vector<std::vector<uint8_t>> before = pool.blocks;
  BOOST_REQUIRE(CompressWrite({.latent = latent.data(),
                               .key = key.data(),
                               .groups = groups,
                               .head_dim = hd,
                               .index_dim = idd,
                               .rope_dim = rd,
                               .positions = pos.data(),
                               .freqs = freqs.data(),
                               .rows = rows.data(),
                               .kv_codes = pool.Region(kc, hd / 2),
                               .kv_scales = pool.Region(ks, hd / 16),
                               .key_codes = pool.Region(qc, idd / 2),
                               .key_scales = pool.Region(qs, idd / 32)}) == OpStatus::kOk);
  std::vector<std::vector<uint8_t>> want = before;
  for (int64_t g = 0; g < groups; ++g) {
    if (rows[g] < 0) continue;
    std::vector<float> l(&l_in[g * hd], &l_in[(g + 1) * hd]),
        k(&k_in[g * idd], &k_in[(g + 1) * idd]);
    Rope({.x = l.data(),
          .rows = 1,
          .head_dim = hd,
          .rope_dim = rd,
          .row_stride = hd,
          .positions = &pos[g],
          .freqs = freqs.data()});
    Rope({.x = k.data(),
          .rows = 1,
          .head_dim = idd,
          .rope_dim = rd,
          .row_stride = idd,
          .positions = &pos[g],
          .freqs = freqs.data()});
    uint8_t* b = want[rows[g] / per].data();
    const size_t r = static_cast<size_t>(rows[g] % per);
    QuantizeFp4E4M3(l.data(), hd, 16, b + kc + r * hd / 2, b + ks + r * hd / 16);
    QuantizeFp4E8M0(k.data(), idd, 32, b + qc + r * idd / 2, b + qs + r * idd / 32);
  }
  // Written rows are exactly the codec's; every other byte (frozen rows too) is untouched.
  BOOST_TEST((pool.blocks == want));
}

// --- Indexer ------------------------------------------------------------------------------------
struct KeyPool {
  int64_t per = 16, dim;
  Pool pool;
  std::vector<float> keys;  // Decoded keys of every pool row.
  KeyPool(int nblocks, int64_t d, Rng& rng)
      : dim(d), pool(nblocks, 16, static_cast<size_t>(16 * (d / 2 + d / 32))) {
    keys.resize(nblocks * per * dim);
    for (int64_t row = 0; row < nblocks * per; ++row) {
      std::vector<float> k = rng.Normal(dim, 2.0f);
      uint8_t* b = pool.table[row / per];
      const size_t r = static_cast<size_t>(row % per);
      QuantizeFp4E8M0(k.data(), dim, 32, b + r * dim / 2, b + per * dim / 2 + r * dim / 32);
      DequantizeFp4E8M0(b + r * dim / 2, b + per * dim / 2 + r * dim / 32, dim, 32,
                        &keys[row * dim]);
    }
  }
  PagedRows Codes() { return pool.Region(0, dim / 2); }
  PagedRows Scales() { return pool.Region(per * dim / 2, dim / 32); }
};

BOOST_AUTO_TEST_CASE(indexer_scores_fast_equals_reference_and_double) {
  Rng rng(11);
  const int64_t heads = 3, dim = 64;
  KeyPool kp(6, dim, rng);
  // The sequence's blocks: block 2 appears twice (a block shared by two ranges of entries).
  const std::vector<int32_t> table = {4, 2, 0, 2, 5, 1};
  for (int64_t tokens : kRowCounts) {
    const int64_t stride = 90;
    std::vector<float> q = rng.Bf16Normal(tokens * heads * dim), w = rng.Bf16Normal(tokens * heads);
    FakeQuant({.x = q.data(),
               .n = static_cast<int64_t>(q.size()),
               .block = 32,
               .format = FakeQuantFormat::kFp4E8M0});
    std::vector<int64_t> visible(tokens);
    for (int64_t& v : visible) v = rng.Int(0, stride);
    std::vector<uint8_t> mask(tokens * stride);
    for (uint8_t& m : mask) m = rng.Int(0, 3) != 0;
    for (bool masked : {false, true}) {
      IndexerScoreParams p{.q = q.data(),
                           .weights = w.data(),
                           .tokens = tokens,
                           .heads = heads,
                           .dim = dim,
                           .visible = visible.data(),
                           .block_table = table.data(),
                           .key_codes = kp.Codes(),
                           .key_scales = kp.Scales(),
                           .mask = masked ? mask.data() : nullptr,
                           .stride = stride};
      std::vector<float> ref(tokens * stride), fast(tokens * stride);
      p.scores = ref.data();
      BOOST_REQUIRE(IndexerScoresRef(p) == OpStatus::kOk);
      CpuStream two{2};
      p.scores = fast.data();
      p.stream = &two;
      BOOST_REQUIRE(IndexerScores(p) == OpStatus::kOk);
      BOOST_TEST(BitEqual(ref, fast), "tokens " << tokens << " masked " << masked);
      // Against double: per head a dot product, its ReLU times the weight, summed.
      std::vector<float> got;
      std::vector<double> want;
      for (int64_t t = 0; t < tokens; ++t) {
        for (int64_t j = 0; j < stride; ++j) {
          const float s = ref[t * stride + j];
          if (j >= visible[t] || (masked && !mask[t * stride + j])) {
            BOOST_TEST(s == -kInf);
            continue;
          }
          const int64_t row = BlockRow(table.data(), 16, j);
          double total = 0, magnitude = 0;
          for (int64_t h = 0; h < heads; ++h) {
            double dot = 0;
            for (int64_t d = 0; d < dim; ++d) {
              dot += double(q[(t * heads + h) * dim + d]) * kp.keys[row * dim + d];
            }
            total += std::max(dot, 0.0) * w[t * heads + h];
            magnitude += std::fabs(dot * w[t * heads + h]);
          }
          // Each head's term is rounded to BF16 three times and the sum once more: within four
          // BF16 half-steps of the terms' magnitudes.
          const double bound = 4 * 0x1p-9 * magnitude + 0x1p-8 * std::fabs(total) + 1e-30;
          BOOST_TEST(std::fabs(s - total) <= bound, "t " << t << " j " << j);
          want.push_back(total);
          got.push_back(s);
        }
      }
      BOOST_TEST(!got.empty());
    }
  }
  // Entries in the shared block score alike for the same query.
  std::vector<float> q = rng.Bf16Normal(heads * dim), w = rng.Bf16Normal(heads), s(96);
  const int64_t visible = 96;
  BOOST_REQUIRE(IndexerScores({.q = q.data(),
                               .weights = w.data(),
                               .tokens = 1,
                               .heads = heads,
                               .dim = dim,
                               .visible = &visible,
                               .block_table = table.data(),
                               .key_codes = kp.Codes(),
                               .key_scales = kp.Scales(),
                               .stride = 96,
                               .scores = s.data()}) == OpStatus::kOk);
  for (int64_t j = 0; j < 16; ++j) BOOST_TEST(s[16 + j] == s[48 + j]);
}

// The k largest under the total order, by sorting everything.
std::vector<int64_t> SortedTop(const std::vector<float>& v, int64_t n, int64_t k) {
  std::vector<int64_t> idx(n);
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](int64_t a, int64_t b) {
    const bool an = std::isnan(v[a]), bn = std::isnan(v[b]);
    if (an != bn) return an;
    return !an && v[a] > v[b];
  });
  idx.resize(std::min(n, k));
  return idx;
}

BOOST_AUTO_TEST_CASE(top_k_total_order_and_reference_sets) {
  Rng rng(12);
  struct Case {
    int64_t n, k;
    int distinct;  // Values drawn from this many levels: ties galore when small.
  };
  const Case cases[] = {{1, 1, 5},     {5, 8, 3},     {257, 8, 4},
                        {257, 100, 7}, {2000, 16, 2}, {64, 1, 64}};
  for (const Case& c : cases) {
    const int64_t rows = 3, stride = c.n + 2;
    std::vector<float> v(rows * stride);
    for (float& x : v) x = static_cast<float>(rng.Int(0, c.distinct - 1));
    v[0] = -kInf;
    v[stride + 1] = std::numeric_limits<float>::quiet_NaN();  // NaN ranks first.
    std::vector<int64_t> n(rows, c.n), total(rows * c.k), ref(rows * c.k);
    BOOST_REQUIRE(TopK({.values = v.data(),
                        .rows = rows,
                        .stride = stride,
                        .k = c.k,
                        .n = n.data(),
                        .order = TopKOrder::kTotal,
                        .out = total.data()}) == OpStatus::kOk);
    BOOST_REQUIRE(TopK({.values = v.data(),
                        .rows = rows,
                        .stride = stride,
                        .k = c.k,
                        .n = n.data(),
                        .order = TopKOrder::kReference,
                        .out = ref.data()}) == OpStatus::kOk);
    for (int64_t r = 0; r < rows; ++r) {
      std::vector<float> row(v.begin() + r * stride, v.begin() + (r + 1) * stride);
      const std::vector<int64_t> want = SortedTop(row, c.n, c.k);
      const int64_t got_n = std::min(c.n, c.k);
      // Total order: exactly the stable sort's first k, in rank order, then -1.
      for (int64_t i = 0; i < c.k; ++i) {
        BOOST_TEST(total[r * c.k + i] == (i < got_n ? want[i] : -1), "n " << c.n << " i " << i);
      }
      // Reference order: a valid top-k set (equal to the oracle's up to ties at the boundary).
      std::multiset<float> a, b;
      for (int64_t i = 0; i < got_n; ++i) {
        const float x = row[ref[r * c.k + i]], y = row[want[i]];
        a.insert(std::isnan(x) ? kInf : x);
        b.insert(std::isnan(y) ? kInf : y);
      }
      BOOST_TEST((a == b));
    }
  }
}

BOOST_AUTO_TEST_CASE(candidate_filter_keeps_the_best_blocks_and_the_newest) {
  Rng rng(13);
  const int64_t tokens = 4, stride = 37, block = 4, top = 3;
  std::vector<float> scores = rng.Normal(tokens * stride);
  std::vector<int64_t> visible = {37, 1, 0, 10};
  for (int64_t j = 0; j < stride; ++j) scores[3 * stride + j] = j < 10 ? -kInf : 0.0f;
  const int64_t nb = (stride + block - 1) / block;
  std::vector<float> bs(tokens * nb);
  std::vector<int64_t> bt(tokens * top);
  std::vector<uint8_t> mask(tokens * stride, 9);
  BOOST_REQUIRE(CandidateFilter({.scores = scores.data(),
                                 .tokens = tokens,
                                 .stride = stride,
                                 .block = block,
                                 .top_blocks = top,
                                 .visible = visible.data(),
                                 .block_scores = bs.data(),
                                 .block_top = bt.data(),
                                 .mask = mask.data()}) == OpStatus::kOk);
  for (int64_t t = 0; t < tokens; ++t) {
    // Oracle: block maxima, newest pinned, best `top` blocks with a finite maximum.
    const int64_t v = visible[t], blocks = (v + block - 1) / block;
    std::vector<float> m(blocks, -kInf);
    for (int64_t j = 0; j < v; ++j) m[j / block] = std::max(m[j / block], scores[t * stride + j]);
    if (v > 0) m[blocks - 1] = kInf;
    std::set<int64_t> keep;
    for (int64_t b : SortedTop(m, blocks, top)) {
      if (m[b] != -kInf) keep.insert(b);
    }
    for (int64_t j = 0; j < stride; ++j) {
      const bool want = j < v && keep.count(j / block) > 0;
      BOOST_TEST(mask[t * stride + j] == (want ? 1 : 0), "t " << t << " j " << j);
    }
  }
}

// --- Attention ----------------------------------------------------------------------------------
// One query's keys in the release's list order, written out from its definition: for a query
// decoded at position t the window's slots (slot i: position t - window + 1 + i), empty ones
// kept as -1; for a draft block the ring rows by ring slot, then the block's rows; then the
// selected entries. Each key: its list index and a pointer to its values.
std::vector<std::pair<int64_t, const float*>> ReleaseKeyList(
    int64_t t, int64_t pos, int64_t wfirst, int64_t wlast, bool whole, int64_t window,
    int64_t first, const std::vector<float>& fresh, const std::vector<float>& ring,
    const std::vector<int64_t>& sel, int64_t width, const std::vector<float>& comp,
    const std::vector<int32_t>& table, int64_t per, int64_t hd) {
  std::vector<std::pair<int64_t, const float*>> list;
  auto row = [&](int64_t q) {
    return q >= first ? &fresh[(q - first) * hd] : &ring[(q % window) * hd];
  };
  int64_t index = 0;
  if (!whole) {
    for (int64_t i = 0; i < window; ++i, ++index) {
      const int64_t q = pos - window + 1 + i;
      if (q >= wfirst && q <= pos) list.push_back({index, row(q)});
    }
  } else {
    std::vector<int64_t> ring_positions;
    for (int64_t q = wfirst; q <= wlast && q < first; ++q) ring_positions.push_back(q);
    std::stable_sort(ring_positions.begin(), ring_positions.end(),
                     [&](int64_t a, int64_t b) { return a % window < b % window; });
    for (int64_t q : ring_positions) list.push_back({index++, row(q)});
    for (int64_t q = std::max(wfirst, first); q <= wlast; ++q) list.push_back({index++, row(q)});
  }
  for (int64_t i = 0; i < width; ++i) {
    const int64_t j = sel[t * width + i];
    if (j >= 0) list.push_back({index++, &comp[BlockRow(table.data(), per, j) * hd]});
  }
  return list;
}

// Sparse attention against two oracles of the release's kernel (an online softmax over blocks
// of 64 list entries, probabilities rounded to BF16 against the running maximum): one in
// double but for that rounding (within 2 BF16 steps), and one in float summing in the order the
// op documents (bit-equal, so that a key in the wrong block or order is caught). Cases: short
// windows, windows longer than a block with empty slots in front, draft blocks whose ring
// wraps, -1 selections, shared blocks.
BOOST_AUTO_TEST_CASE(sparse_attention_against_the_release_kernel) {
  Rng rng(14);
  const int64_t heads = 2, hd = 64, rd = 16, per = 4;
  std::vector<float> freqs(rd / 2);
  RopeFrequencies(rd, 0, 10000.0, 1, 0, 0, freqs.data());
  // Compressed rows: 5 blocks of 4, FP4 with E4M3 scales per 16.
  Pool pool(5, per, per * (hd / 2 + hd / 16));
  std::vector<float> comp(5 * per * hd);
  for (int64_t row = 0; row < 5 * per; ++row) {
    std::vector<float> k = rng.Bf16Normal(hd);
    uint8_t* b = pool.table[row / per];
    const size_t r = static_cast<size_t>(row % per);
    QuantizeFp4E4M3(k.data(), hd, 16, b + r * hd / 2, b + per * hd / 2 + r * hd / 16);
    DequantizeFp4E4M3(b + r * hd / 2, b + per * hd / 2 + r * hd / 16, hd, 16, &comp[row * hd]);
  }
  const std::vector<int32_t> table = {3, 0, 0, 4};  // Block 0 shared by two entry ranges.
  struct Case {
    int64_t tokens, window, width, first;
    bool whole;  // Every query sees every row of the call (a DSpark draft block, window_last).
  };
  // first: position of the call's first row. The windows of 80 and 150 span two and three
  // blocks, the first with empty slots in front (positions before 0); width 60 puts the
  // selections across a block boundary.
  const Case cases[] = {{1, 8, 5, 30, false},     {5, 8, 5, 30, false},   {20, 8, 5, 30, false},
                        {5, 8, 5, 30, true},      {20, 8, 5, 30, true},   {6, 80, 60, 10, false},
                        {4, 150, 60, 170, false}, {5, 100, 0, 130, true}, {5, 100, 0, 40, true}};
  for (const Case& k : cases) {
    const int64_t tokens = k.tokens, window = k.window, width = k.width, first = k.first;
    std::vector<float> ring_rows = rng.Bf16Normal(window * hd);
    std::vector<uint8_t> ring_codes(window * hd), ring_scales(window * hd / 32);
    QuantizeFp8PerBlock(ring_rows.data(), ring_rows.size(), 32, ring_codes.data(),
                        ring_scales.data());
    std::vector<float> ring(window * hd);
    DequantizeFp8PerBlock(ring_codes.data(), ring_scales.data(), ring.size(), 32, ring.data());
    std::vector<float> fresh = rng.Bf16Normal(tokens * hd);
    RoundTripFp8(fresh.data(), fresh.size(), 32);
    std::vector<float> q = rng.Bf16Normal(tokens * heads * hd, 0.5f), sink = rng.Normal(heads);
    std::vector<int64_t> pos(tokens), wfirst(tokens);
    std::vector<int64_t> sel(tokens * width);
    for (int64_t t = 0; t < tokens; ++t) {
      pos[t] = first + t;
      if (k.whole) {
        wfirst[t] = std::max<int64_t>(0, first - window);  // The ring, then the block.
      } else {
        wfirst[t] = std::max<int64_t>(t % 3 == 0 ? first + t - 2 : 0, pos[t] - window + 1);
      }
      for (int64_t i = 0; i < width; ++i) sel[t * width + i] = i == 2 ? -1 : rng.Int(0, 15);
    }
    std::vector<int64_t> wlast(tokens, first + tokens - 1);
    std::vector<float> out(tokens * heads * hd);
    CpuStream two{2};
    BOOST_REQUIRE(SparseAttention({.q = q.data(),
                                   .tokens = tokens,
                                   .heads = heads,
                                   .head_dim = hd,
                                   .rope_dim = rd,
                                   .positions = pos.data(),
                                   .ring_codes = ring_codes.data(),
                                   .ring_scales = ring_scales.data(),
                                   .window = window,
                                   .fresh = fresh.data(),
                                   .fresh_first = first,
                                   .window_first = wfirst.data(),
                                   .window_last = k.whole ? wlast.data() : nullptr,
                                   .selected = width > 0 ? sel.data() : nullptr,
                                   .selected_stride = width,
                                   .block_table = table.data(),
                                   .kv_codes = pool.Region(0, hd / 2),
                                   .kv_scales = pool.Region(per * hd / 2, hd / 16),
                                   .sink = sink.data(),
                                   .freqs = freqs.data(),
                                   .out = out.data(),
                                   .stream = &two}) == OpStatus::kOk);
    std::vector<double> want(out.size());
    std::vector<float> exact(out.size());
    size_t blocks_seen = 0;
    for (int64_t t = 0; t < tokens; ++t) {
      const auto list = ReleaseKeyList(t, pos[t], wfirst[t], wlast[t], k.whole, window, first,
                                       fresh, ring, sel, width, comp, table, per, hd);
      blocks_seen = std::max<size_t>(blocks_seen, list.back().first / 64 + 1);
      for (int64_t h = 0; h < heads; ++h) {
        const float* qh = &q[(t * heads + h) * hd];
        const float scale = static_cast<float>(1.0 / std::sqrt(double(hd)));
        std::vector<double> logit(list.size());
        std::vector<float> logit_f(list.size());
        for (size_t j = 0; j < list.size(); ++j) {
          double dot = 0;
          float dot_f = 0;
          for (int64_t d = 0; d < hd; ++d) {
            dot += double(qh[d]) * list[j].second[d];
            dot_f += qh[d] * list[j].second[d];
          }
          logit[j] = dot / std::sqrt(double(hd));
          logit_f[j] = dot_f * scale;
        }
        // Block by block, both ways.
        double m = -1e30, denom = 0;
        float mf = -1e30f, denom_f = 0;
        std::vector<double> acc(hd, 0.0);
        std::vector<float> acc_f(hd, 0.0f);
        for (size_t j0 = 0; j0 < list.size();) {
          size_t j1 = j0;
          double bm = -kInf;
          float bmf = -std::numeric_limits<float>::infinity();
          for (; j1 < list.size() && list[j1].first / 64 == list[j0].first / 64; ++j1) {
            bm = std::max(bm, logit[j1]);
            bmf = std::max(bmf, logit_f[j1]);
          }
          const double mn = std::max(m, bm);
          const float mnf = std::max(mf, bmf);
          const double rescale = std::exp(m - mn);
          const float rescale_f = std::exp(mf - mnf);
          denom *= rescale;
          for (double& a : acc) a *= rescale;
          float sum_f = 0;
          std::vector<float> block_f(hd, 0.0f), w_f(j1 - j0);
          for (size_t j = j0; j < j1; ++j) {
            const double pj = std::exp(logit[j] - mn);
            denom += pj;
            const double w = Bf(static_cast<float>(pj));
            for (int64_t d = 0; d < hd; ++d) acc[d] += w * list[j].second[d];
            const float pf = std::exp(logit_f[j] - mnf);
            sum_f += pf;
            w_f[j - j0] = Bf(pf);
          }
          for (int64_t d = 0; d < hd; ++d) {
            for (size_t j = j0; j < j1; ++j) block_f[d] += w_f[j - j0] * list[j].second[d];
            acc_f[d] = acc_f[d] * rescale_f + block_f[d];
          }
          denom_f = denom_f * rescale_f + sum_f;
          m = mn;
          mf = mnf;
          j0 = j1;
        }
        denom += std::exp(double(sink[h]) - m);
        denom_f += std::exp(sink[h] - mf);
        double* o = &want[(t * heads + h) * hd];
        float* of = &exact[(t * heads + h) * hd];
        for (int64_t d = 0; d < hd; ++d) {
          o[d] = Bf(acc[d] / denom);
          of[d] = Bf(acc_f[d] / denom_f);
        }
        for (int64_t i = 0; i < rd / 2; ++i) {  // Rotate back by the query's position.
          const double angle = static_cast<float>(static_cast<float>(pos[t]) * freqs[i]);
          const double c = std::cos(angle), s = -std::sin(angle);
          double* x = o + hd - rd + 2 * i;
          const double a = x[0], b = x[1];
          x[0] = a * c - b * s;
          x[1] = a * s + b * c;
        }
      }
      BOOST_REQUIRE(Rope({.x = &exact[t * heads * hd],
                          .rows = 1,
                          .heads = heads,
                          .head_dim = hd,
                          .rope_dim = rd,
                          .row_stride = heads * hd,
                          .positions = &pos[t],
                          .freqs = freqs.data(),
                          .inverse = true}) == OpStatus::kOk);
    }
    BOOST_TEST_MESSAGE("sparse attention, window " << window << ", " << tokens << " queries"
                                                   << (k.whole ? " (draft)" : "") << ": "
                                                   << blocks_seen << " blocks");
    CheckBf16Close(out, want, 2, "sparse_attention");
    BOOST_TEST(BitEqual(out, exact),
               "window " << window << " tokens " << tokens << (k.whole ? " draft" : ""));
  }
}

// --- MoE ----------------------------------------------------------------------------------------
BOOST_AUTO_TEST_CASE(moe_route_swiglu_combine_against_double) {
  Rng rng(15);
  const int64_t experts = 12, k = 3;
  const RouteScoring scorings[] = {RouteScoring::kSoftmax, RouteScoring::kSigmoid,
                                   RouteScoring::kSqrtSoftplus};
  for (RouteScoring sc : scorings) {
    for (int64_t tokens : kRowCounts) {
      std::vector<float> logits = rng.Normal(tokens * experts, 2.0f), bias = rng.Normal(experts);
      std::vector<float> s(logits.size()), b(logits.size()), weights(tokens * k);
      std::vector<int64_t> chosen(tokens * k);
      BOOST_REQUIRE(MoeRoute({.logits = logits.data(),
                              .bias = bias.data(),
                              .tokens = tokens,
                              .experts = experts,
                              .k = k,
                              .scoring = sc,
                              .norm_topk = true,
                              .scale = 2.5f,
                              .scores = s.data(),
                              .biased = b.data(),
                              .chosen = chosen.data(),
                              .weights = weights.data()}) == OpStatus::kOk);
      for (int64_t t = 0; t < tokens; ++t) {
        std::vector<double> score(experts), biased(experts);
        double sum = 0;
        for (int64_t e = 0; e < experts; ++e) {
          const double v = logits[t * experts + e];
          score[e] = sc == RouteScoring::kSoftmax   ? std::exp(v)
                     : sc == RouteScoring::kSigmoid ? 1 / (1 + std::exp(-v))
                                                    : std::sqrt(std::log1p(std::exp(v)));
          sum += score[e];
        }
        for (int64_t e = 0; e < experts; ++e) {
          if (sc == RouteScoring::kSoftmax) score[e] /= sum;
          biased[e] = score[e] + bias[e];
        }
        std::vector<int64_t> order(experts);
        std::iota(order.begin(), order.end(), 0);
        std::sort(order.begin(), order.end(),
                  [&](int64_t x, int64_t y) { return biased[x] > biased[y]; });
        double chosen_sum = 0;
        for (int64_t i = 0; i < k; ++i) chosen_sum += score[order[i]];
        for (int64_t i = 0; i < k; ++i) {
          BOOST_TEST(chosen[t * k + i] == order[i]);
          const double want = score[order[i]] / chosen_sum * 2.5;
          BOOST_TEST(std::fabs(weights[t * k + i] - want) < 1e-5 * want + 1e-7);
        }
      }
    }
  }
  // SwiGLU with clamps and row weights.
  for (int64_t rows : kRowCounts) {
    const int64_t inter = 35;
    std::vector<float> g = rng.Normal(rows * inter, 4.0f), u = rng.Normal(rows * inter, 4.0f);
    std::vector<float> rw = rng.Normal(rows), h(g.size());
    for (float limit : {0.0f, 3.0f}) {
      BOOST_REQUIRE(Swiglu({.gate = g.data(),
                            .up = u.data(),
                            .rows = rows,
                            .inter = inter,
                            .row_weights = rw.data(),
                            .limit = limit,
                            .h = h.data()}) == OpStatus::kOk);
      std::vector<double> want(h.size());
      for (int64_t i = 0; i < rows * inter; ++i) {
        double gate = Bf(g[i]), up = Bf(u[i]);
        if (limit > 0) {
          up = std::clamp<double>(up, -limit, limit);
          gate = std::min<double>(gate, limit);
        }
        want[i] = rw[i / inter] * gate / (1 + std::exp(-gate)) * up;
      }
      CheckBf16Close(h, want, 1, "swiglu");
    }
  }
  // Combine: scatter-add in order; AddRound: BF16 of the sum.
  std::vector<float> y(3 * 4, 0.5f), eo = rng.Normal(5 * 4), want = y;
  std::vector<int64_t> rows = {2, 0, 2, 1, 2};
  BOOST_REQUIRE(
      MoeCombine(
          {.expert_out = eo.data(), .rows = rows.data(), .count = 5, .dim = 4, .y = y.data()}) ==
      OpStatus::kOk);
  for (int64_t i = 0; i < 5; ++i) {
    for (int64_t d = 0; d < 4; ++d) want[rows[i] * 4 + d] += eo[i * 4 + d];
  }
  BOOST_TEST(BitEqual(y, want));
  std::vector<float> a = rng.Normal(257), bb = rng.Normal(257), sum(257);
  BOOST_REQUIRE(AddRound({.a = a.data(), .b = bb.data(), .n = 257, .out = sum.data()}) ==
                OpStatus::kOk);
  std::vector<double> wsum(257);
  for (int i = 0; i < 257; ++i) wsum[i] = double(a[i]) + bb[i];
  CheckBf16Close(sum, wsum, 1, "add_round");
}

// The experts over grouped rows against the per-expert loop built here from the choices: each
// expert's tokens gathered in token order, its Linear (FP8 and FP4), the outputs scattered into
// y expert by expert. Grouping, ExpertLinear and one MoeCombine over all grouped rows give the
// same y bit for bit; the slots list the chosen experts ascending, then -1; bad input refused.
BOOST_AUTO_TEST_CASE(grouped_experts_equal_the_per_expert_loop) {
  Rng rng(23);
  const int64_t tokens = 13, experts = 7, k = 3, in = 64, out = 24;
  // The last expert is never chosen.
  const std::vector<int64_t> chosen = flashd::testing::DistinctChoices(
      tokens, k, [&] { return static_cast<int64_t>(rng.Int(0, experts - 2)); });
  const std::vector<float> weights = rng.Normal(chosen.size());
  const int64_t total = tokens * k, slots = std::min(experts, total);
  flashd::testing::GroupedRows grouped(slots, total);
  const std::vector<int64_t>& slot_expert = grouped.expert;
  const std::vector<int64_t>& slot_offset = grouped.offset;
  const std::vector<int64_t>& slot_tiles = grouped.tiles;
  const std::vector<int64_t>& rows = grouped.rows;
  const std::vector<float>& row_weights = grouped.weights;
  MoeGroupParams group = grouped.Params(chosen.data(), weights.data(), tokens, experts, k);
  BOOST_REQUIRE(MoeGroup(group) == OpStatus::kOk);
  // Per expert, in id order: its tokens in token order and their weights.
  std::vector<std::vector<int64_t>> of(experts);
  std::vector<std::vector<float>> w_of(experts);
  for (int64_t i = 0; i < total; ++i) {
    of[chosen[i]].push_back(i / k);
    w_of[chosen[i]].push_back(weights[i]);
  }
  int64_t s = 0, at = 0;
  for (int64_t e = 0; e < experts; ++e) {
    if (of[e].empty()) continue;
    BOOST_TEST(slot_expert[s] == e);
    BOOST_TEST(slot_offset[s] == at);
    BOOST_TEST(slot_tiles[s + 1] - slot_tiles[s] ==
               (static_cast<int64_t>(of[e].size()) + kExpertTileRows - 1) / kExpertTileRows);
    for (size_t j = 0; j < of[e].size(); ++j) {
      BOOST_TEST(rows[at + j] == of[e][j]);
      BOOST_TEST(row_weights[at + j] == w_of[e][j]);
    }
    at += static_cast<int64_t>(of[e].size());
    ++s;
  }
  BOOST_TEST(s < slots);  // An expert no token chose leaves a slot empty.
  for (; s < slots; ++s) {
    BOOST_TEST(slot_expert[s] == -1);
    BOOST_TEST(slot_offset[s + 1] == total);
  }
  const std::vector<float> x = rng.Bf16Normal(tokens * in);
  for (WeightFormat format : {WeightFormat::kFp8, WeightFormat::kFp4}) {
    std::vector<testing::QuantizedWeights> q;
    std::vector<const uint8_t*> w, ws;
    for (int64_t e = 0; e < experts; ++e) {
      q.push_back(testing::QuantizeWeights(format, rng.Normal(out * in, 0.2f), out, in));
    }
    for (const auto& qe : q) {
      w.push_back(qe.codes.data());
      ws.push_back(qe.scales.data());
    }
    std::vector<uint8_t> xq(total * in), xs(total * in / 32);
    // The loop.
    std::vector<float> want(tokens * out, 0.0f);
    for (int64_t e = 0; e < experts; ++e) {
      const int64_t m = static_cast<int64_t>(of[e].size());
      if (m == 0) continue;
      std::vector<float> xe(m * in), ye(m * out);
      for (int64_t r = 0; r < m; ++r) {
        std::copy_n(&x[of[e][r] * in], in, &xe[r * in]);
      }
      BOOST_REQUIRE(Linear({.x = xe.data(),
                            .rows = m,
                            .in = in,
                            .out = out,
                            .format = format,
                            .w = w[e],
                            .w_scales = ws[e],
                            .x_codes = xq.data(),
                            .x_scales = xs.data(),
                            .y = ye.data()}) == OpStatus::kOk);
      BOOST_REQUIRE(MoeCombine({.expert_out = ye.data(),
                                .rows = of[e].data(),
                                .count = m,
                                .dim = out,
                                .y = want.data()}) == OpStatus::kOk);
    }
    // Grouped.
    std::vector<float> xg(total * in), yg(total * out), got(tokens * out, 0.0f);
    BOOST_REQUIRE(CopyRows({.src = x.data(),
                            .src_stride = in,
                            .index = rows.data(),
                            .rows = total,
                            .cols = in,
                            .dst = xg.data(),
                            .dst_stride = in,
                            .src_rows = tokens}) == OpStatus::kOk);
    ExpertLinearParams lin{.x = xg.data(),
                           .rows = total,
                           .in = in,
                           .out = out,
                           .slot_expert = slot_expert.data(),
                           .slot_offset = slot_offset.data(),
                           .slot_tiles = slot_tiles.data(),
                           .slots = slots,
                           .experts = experts,
                           .format = format,
                           .w = w.data(),
                           .w_scales = ws.data(),
                           .x_codes = xq.data(),
                           .x_scales = xs.data(),
                           .y = yg.data()};
    BOOST_REQUIRE(ExpertLinear(lin) == OpStatus::kOk);
    BOOST_REQUIRE(MoeCombine({.expert_out = yg.data(),
                              .rows = rows.data(),
                              .count = total,
                              .dim = out,
                              .y = got.data(),
                              .y_rows = tokens}) == OpStatus::kOk);
    BOOST_TEST(BitEqual(got, want), "format " << static_cast<int>(format));
    lin.format = WeightFormat::kDense;
    BOOST_TEST((ExpertLinear(lin) == OpStatus::kBadArgument));
  }
  // An expert id out of range, or slots that are not min(experts, tokens * k).
  std::vector<int64_t> bad = chosen;
  bad[4] = experts;
  group.chosen = bad.data();
  BOOST_TEST((MoeGroup(group) == OpStatus::kBadArgument));
  group.chosen = chosen.data();
  group.slots = slots - 1;
  BOOST_TEST((MoeGroup(group) == OpStatus::kBadShape));
  // A gather index past src_rows.
  std::vector<float> dst(4);
  const int64_t index[] = {5};
  BOOST_TEST((CopyRows({.src = x.data(),
                        .src_stride = 4,
                        .index = index,
                        .rows = 1,
                        .cols = 4,
                        .dst = dst.data(),
                        .dst_stride = 4,
                        .src_rows = 5}) == OpStatus::kBadArgument));
}

// --- Data movement ------------------------------------------------------------------------------
// A strided block and a gather of rows (repeated and out of order), each value where the
// definition puts it and the rest of dst untouched; bad shapes and a negative index refused.
BOOST_AUTO_TEST_CASE(copy_rows_copies_and_gathers) {
  Rng rng(15);
  const int64_t cols = 37, src_stride = 41, dst_stride = 40;
  const std::vector<float> src = rng.Normal(9 * src_stride);
  for (bool gather : {false, true}) {
    const std::vector<int64_t> index = {8, 0, 3, 3, 7};
    const int64_t rows = gather ? 5 : 9;
    std::vector<float> dst(rows * dst_stride, -7.0f);
    BOOST_REQUIRE(CopyRows({.src = src.data(),
                            .src_stride = src_stride,
                            .index = gather ? index.data() : nullptr,
                            .rows = rows,
                            .cols = cols,
                            .dst = dst.data(),
                            .dst_stride = dst_stride}) == OpStatus::kOk);
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t r = gather ? index[i] : i;
      for (int64_t j = 0; j < dst_stride; ++j) {
        const float want = j < cols ? src[r * src_stride + j] : -7.0f;
        BOOST_TEST(std::memcmp(&dst[i * dst_stride + j], &want, 4) == 0, i << "," << j);
      }
    }
  }
  std::vector<float> dst(64);
  const std::vector<int64_t> bad = {1, -1};
  BOOST_TEST((CopyRows({.src = src.data(),
                        .src_stride = 4,
                        .rows = 2,
                        .cols = 5,
                        .dst = dst.data(),
                        .dst_stride = 5}) == OpStatus::kBadShape));
  BOOST_TEST((CopyRows({.src = src.data(),
                        .src_stride = 5,
                        .index = bad.data(),
                        .rows = 2,
                        .cols = 5,
                        .dst = dst.data(),
                        .dst_stride = 5}) == OpStatus::kBadArgument));
}

// --- Engram -------------------------------------------------------------------------------------
BOOST_AUTO_TEST_CASE(engram_gather_and_gate) {
  Rng rng(16);
  const int64_t table_rows = 40, hd = 32, columns = 3, stride = 6, hc = 4, dim = 24;
  std::vector<float> t = rng.Normal(table_rows * hd, 3.0f);
  std::vector<uint8_t> codes(t.size()), scales(t.size() / 32);
  QuantizeFp8PerBlock(t.data(), t.size(), 32, codes.data(), scales.data());
  for (int64_t tokens : kRowCounts) {
    std::vector<int64_t> ids(tokens * stride);
    for (int64_t& id : ids) id = rng.Int(0, table_rows - 1);
    std::vector<float> out(tokens * columns * hd);
    BOOST_REQUIRE(EngramGather({.table = codes.data(),
                                .table_scales = scales.data(),
                                .row_ids = ids.data(),
                                .tokens = tokens,
                                .columns = columns,
                                .head_dim = hd,
                                .row_stride = stride,
                                .column0 = 3,
                                .out = out.data()}) == OpStatus::kOk);
    for (int64_t i = 0; i < tokens; ++i) {
      for (int64_t c = 0; c < columns; ++c) {
        std::vector<float> want(hd);
        const int64_t row = ids[i * stride + 3 + c];
        DequantizeFp8PerBlock(&codes[row * hd], &scales[row * hd / 32], hd, 32, want.data());
        for (float& v : want) v = Bf(v);
        BOOST_TEST(std::memcmp(&out[(i * columns + c) * hd], want.data(), hd * 4) == 0);
      }
    }
    std::vector<float> X = rng.Bf16Normal(tokens * hc * dim),
                       kv = rng.Bf16Normal(tokens * (hc + 1) * dim);
    std::vector<float> qk = rng.Normal(hc * dim), got = X;
    BOOST_REQUIRE(EngramGate({.X = got.data(),
                              .kv = kv.data(),
                              .qk = qk.data(),
                              .tokens = tokens,
                              .hc = hc,
                              .dim = dim,
                              .eps = 1e-6f}) == OpStatus::kOk);
    std::vector<double> want(X.size());
    for (int64_t i = 0; i < tokens; ++i) {
      const float* value = &kv[(i * (hc + 1) + hc) * dim];
      for (int64_t h = 0; h < hc; ++h) {
        const float* s = &X[(i * hc + h) * dim];
        const float* key = &kv[(i * (hc + 1) + h) * dim];
        double s2 = 0, k2 = 0, dot = 0;
        for (int64_t d = 0; d < dim; ++d) {
          s2 += double(s[d]) * s[d];
          k2 += double(key[d]) * key[d];
          dot += double(s[d]) * qk[h * dim + d] * key[d];
        }
        const double g =
            dot / std::sqrt(s2 / dim + 1e-6) / std::sqrt(k2 / dim + 1e-6) / std::sqrt(double(dim));
        const double gate =
            1 / (1 + std::exp(-std::copysign(std::sqrt(std::max(std::fabs(g), 1e-6)), g)));
        for (int64_t d = 0; d < dim; ++d) want[(i * hc + h) * dim + d] = s[d] + gate * value[d];
      }
    }
    CheckBf16Close(got, want, 1, "engram_gate");
  }
  std::vector<int64_t> bad = {-1};
  float out[32];
  BOOST_TEST((EngramGather({.table = codes.data(),
                            .table_scales = scales.data(),
                            .row_ids = bad.data(),
                            .tokens = 1,
                            .columns = 1,
                            .head_dim = 32,
                            .row_stride = 1,
                            .out = out}) == OpStatus::kBadArgument));
}

BOOST_AUTO_TEST_SUITE_END()

}  // namespace
}  // namespace flashd::kernels::cpu
