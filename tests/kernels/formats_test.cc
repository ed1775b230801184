// Number formats against hand-computed tables: every expected code below was worked out from the
// format definitions (see kernels/cpu/formats.h), not produced by the code under test.
#include "kernels/cpu/formats.h"

#include <boost/test/unit_test.hpp>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

namespace flashd::kernels::cpu {
namespace {

BOOST_AUTO_TEST_SUITE(formats)

BOOST_AUTO_TEST_CASE(e4m3_encode_table) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  struct Case {
    float in;
    uint8_t code;
  };
  const Case cases[] = {
      {0.0f, 0x00},           {-0.0f, 0x80},  {1.0f, 0x38},   {-1.0f, 0xB8},
      {448.0f, 0x7E},         {500.0f, 0x7E},  // saturates
      {-1e9f, 0xFE},          {inf, 0x7E},    {-inf, 0xFE},   {nan, 0x7F},
      {0.015625f, 0x08},                                       // 2^-6, smallest normal
      {0x1p-9f, 0x01},                                         // smallest subnormal
      {0x1p-10f, 0x00},                                        // tie 0|1 -> even 0
      {3 * 0x1p-10f, 0x02},                                    // tie 1|2 -> even 2
      {7.5f * 0x1p-9f, 0x08},                                  // tie 7|8 -> normal
      {1.0625f, 0x38},                                         // tie m0|m1 -> m0
      {1.1875f, 0x3A},                                         // tie m1|m2 -> m2
      {240.0f, 0x77},         {416.0f, 0x7D}, {432.0f, 0x7E},  // tie 416|448 -> 448
      {0.1f, 0x1D},                                            // 1.625 * 2^-4
      {-0.3f, 0xAA},  // 1.2 * 2^-2: (1.2 - 1) * 8 = 1.6 rounds to m 2, i.e. 1.25 * 2^-2
  };
  for (const Case& c : cases) {
    BOOST_TEST(static_cast<int>(FloatToE4M3(c.in)) == static_cast<int>(c.code), "in=" << c.in);
  }
}

BOOST_AUTO_TEST_CASE(e4m3_decode_table) {
  BOOST_TEST(std::isnan(E4M3ToFloat(0x7F)));
  BOOST_TEST(std::isnan(E4M3ToFloat(0xFF)));
  BOOST_TEST(E4M3ToFloat(0x7E) == 448.0f);
  BOOST_TEST(E4M3ToFloat(0xFE) == -448.0f);
  BOOST_TEST(E4M3ToFloat(0x01) == 0x1p-9f);
  BOOST_TEST(E4M3ToFloat(0x07) == 7 * 0x1p-9f);
  BOOST_TEST(E4M3ToFloat(0x08) == 0x1p-6f);
  BOOST_TEST(E4M3ToFloat(0x38) == 1.0f);
  BOOST_TEST(E4M3ToFloat(0x1D) == 0.1015625f);
  BOOST_TEST(std::signbit(E4M3ToFloat(0x80)));
  // Every finite code survives a round trip.
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7F) == 0x7F) continue;
    BOOST_TEST(static_cast<int>(FloatToE4M3(E4M3ToFloat(static_cast<uint8_t>(c)))) == c);
  }
}

// The bit-level decoders the fast kernels use equal the plain definitions on every code.
BOOST_AUTO_TEST_CASE(bit_level_decoders_equal_their_definitions) {
  for (int c = 0; c < 255; ++c) {
    const float want = std::ldexp(1.0f, c - 127);
    BOOST_TEST(E8M0ToFloat(static_cast<uint8_t>(c)) == want, "code " << c);
  }
  BOOST_TEST(std::isnan(E8M0ToFloat(255)));
  for (int c = 0; c < 256; ++c) {
    const float table = E4M3ToFloat(static_cast<uint8_t>(c));
    const float arith = E4M3ToFloatArith(static_cast<uint8_t>(c));
    if (std::isnan(table)) {
      BOOST_TEST(std::isnan(arith), "code " << c);
    } else {
      BOOST_TEST(std::bit_cast<uint32_t>(arith) == std::bit_cast<uint32_t>(table), "code " << c);
    }
  }
}

// FloatToE4M3 against a search of the decode table: the nearest finite code, ties to the even
// code, saturating at 448; on every midpoint between neighbours, just beside each, and on
// random floats over the whole range.
BOOST_AUTO_TEST_CASE(e4m3_encode_is_the_nearest_code_ties_to_even) {
  auto oracle = [](float x) {
    const float a = std::fabs(x);
    int best = 0;
    for (int c = 0; c <= 0x7E; ++c) {
      const float d = std::fabs(E4M3ToFloat(static_cast<uint8_t>(c)) - a);
      const float bd = std::fabs(E4M3ToFloat(static_cast<uint8_t>(best)) - a);
      if (d < bd || (d == bd && c % 2 == 0 && best % 2 == 1)) best = c;
    }
    return static_cast<uint8_t>((std::signbit(x) ? 0x80 : 0) | best);
  };
  std::vector<float> inputs;
  for (int c = 0; c < 0x7E; ++c) {
    const float lo = E4M3ToFloat(static_cast<uint8_t>(c));
    const float hi = E4M3ToFloat(static_cast<uint8_t>(c + 1));
    const float mid = (lo + hi) / 2;  // Exact: neighbours differ in one binary digit.
    for (float v : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1000.0f), lo, hi}) {
      inputs.push_back(v);
      inputs.push_back(-v);
    }
  }
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> mant(1.0f, 2.0f);
  std::uniform_int_distribution<int> exp(-14, 9);
  for (int i = 0; i < 200000; ++i) {
    inputs.push_back(std::ldexp(mant(rng), exp(rng)) * (i % 2 ? -1.0f : 1.0f));
  }
  for (float v : inputs) {
    BOOST_TEST(static_cast<int>(FloatToE4M3(v)) == static_cast<int>(oracle(v)), "in=" << v);
  }
}

BOOST_AUTO_TEST_CASE(e8m0_and_pow2_ceil) {
  BOOST_TEST(E8M0ToFloat(127) == 1.0f);
  BOOST_TEST(E8M0ToFloat(0) == 0x1p-127f);
  BOOST_TEST(E8M0ToFloat(254) == 0x1p127f);
  BOOST_TEST(std::isnan(E8M0ToFloat(255)));
  BOOST_TEST(static_cast<int>(FloatToE8M0(1.0f)) == 127);
  BOOST_TEST(static_cast<int>(FloatToE8M0(0.25f)) == 125);
  BOOST_TEST(static_cast<int>(FloatToE8M0(0x1p-127f)) == 0);

  BOOST_TEST(Pow2Ceil(1.0f) == 1.0f);  // Exact at powers of two: no spurious doubling.
  BOOST_TEST(Pow2Ceil(std::nextafter(1.0f, 2.0f)) == 2.0f);
  BOOST_TEST(Pow2Ceil(0.75f) == 1.0f);
  BOOST_TEST(Pow2Ceil(3.0f) == 4.0f);
  BOOST_TEST(Pow2Ceil(0x1p-130f) == 0x1p-126f);  // Subnormal input.
}

BOOST_AUTO_TEST_CASE(scale_rules) {
  BOOST_TEST(Fp8BlockScale(448.0f) == 1.0f);  // 448 * float(1/448) rounds to exactly 1.
  BOOST_TEST(Fp8BlockScale(449.0f) == 2.0f);
  BOOST_TEST(Fp8BlockScale(15.5f) == 0.0625f);  // 15.5/448 = 0.0346 -> 2^-4
  BOOST_TEST(Fp8BlockScale(0.0f) == 0x1p-22f);  // amax floored at 1e-4: 2.23e-7 -> 2^-22
  BOOST_TEST(Fp4E8M0BlockScale(6.0f) == 1.0f);
  BOOST_TEST(Fp4E8M0BlockScale(12.0f) == 2.0f);
  BOOST_TEST(Fp4E8M0BlockScale(0.0f) == 0x1p-126f);
  BOOST_TEST(static_cast<int>(Fp4E4M3BlockScaleCode(3.0f)) == 0x30);  // 0.5
  BOOST_TEST(static_cast<int>(Fp4E4M3BlockScaleCode(0.0f)) == 0x01);  // floor 6*2^-9 -> 2^-9
  BOOST_TEST(static_cast<int>(Fp4E4M3BlockScaleCode(1e5f)) == 0x7E);  // capped at 448
  BOOST_TEST(static_cast<int>(Fp4E4M3BlockScaleCode(4.2f)) == 0x33);  // 0.7 -> 0.6875
}

BOOST_AUTO_TEST_CASE(e2m1_table) {
  struct Case {
    float in;
    uint8_t code;
  };
  const Case cases[] = {
      {0.0f, 0x0},  {-0.0f, 0x8}, {0.5f, 0x1},  {6.0f, 0x7}, {7.0f, 0x7},  // saturates
      {-9.0f, 0xF}, {0.25f, 0x0},                                          // tie -> even code 0
      {0.75f, 0x2},                                                        // tie 1|2 -> 2 (1.0)
      {1.25f, 0x2},                                                        // tie 2|3 -> 2 (1.0)
      {1.75f, 0x4},                                                        // tie 3|4 -> 4 (2.0)
      {2.5f, 0x4},                                                         // tie 4|5 -> 4 (2.0)
      {3.5f, 0x6},                                                         // tie 5|6 -> 6 (4.0)
      {5.0f, 0x6},                                                         // tie 6|7 -> 6 (4.0)
      {-0.6f, 0x9}, {2.6f, 0x5},  {0.26f, 0x1},
  };
  for (const Case& c : cases) {
    BOOST_TEST(static_cast<int>(FloatToE2M1(c.in)) == static_cast<int>(c.code), "in=" << c.in);
  }
  const float values[8] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6};
  for (int c = 0; c < 16; ++c) {
    BOOST_TEST(E2M1ToFloat(static_cast<uint8_t>(c)) == ((c & 8) ? -values[c & 7] : values[c & 7]));
  }
}

BOOST_AUTO_TEST_CASE(bf16_and_f16) {
  BOOST_TEST(FloatToBf16(1.0f) == 0x3F80);
  BOOST_TEST(FloatToBf16(1.0f + 0x1p-8f) == 0x3F80);      // tie -> even
  BOOST_TEST(FloatToBf16(1.0f + 3 * 0x1p-8f) == 0x3F82);  // tie -> even
  BOOST_TEST(FloatToBf16(-2.0f) == 0xC000);
  BOOST_TEST(std::isnan(Bf16ToFloat(FloatToBf16(std::nanf("")))));
  BOOST_TEST(Bf16ToFloat(0x3F80) == 1.0f);
  BOOST_TEST(F16ToFloat(0x3C00) == 1.0f);
  BOOST_TEST(F16ToFloat(0x0001) == 0x1p-24f);
  BOOST_TEST(F16ToFloat(0xC000) == -2.0f);
  BOOST_TEST(std::isinf(F16ToFloat(0x7C00)));
}

BOOST_AUTO_TEST_CASE(fp8_activation_block) {
  std::vector<float> x(32);
  for (int i = 0; i < 32; ++i) x[i] = (i % 2 ? -0.5f : 0.5f) * i;  // amax 15.5
  std::vector<uint8_t> q(32), s(1);
  QuantizeFp8PerBlock(x.data(), 32, 32, q.data(), s.data());
  BOOST_TEST(E8M0ToFloat(s[0]) == 0.0625f);
  // x/s = 8i: exact up to 8*15 = 120 (step 8 at 64..128); 248 = 1.9375*128 is a tie -> 256.
  BOOST_TEST(static_cast<int>(q[31]) == 0xF8);  // -256
  BOOST_TEST(static_cast<int>(q[2]) == 0x58);   // +16 = 2^4: exponent field 4 + 7 = 11
  std::vector<float> back(32);
  DequantizeFp8PerBlock(q.data(), s.data(), 32, 32, back.data());
  BOOST_TEST(back[31] == -16.0f);
  BOOST_TEST(back[2] == 1.0f);
  std::vector<float> rt = x;
  RoundTripFp8(rt.data(), 32, 32);
  for (int i = 0; i < 32; ++i) BOOST_TEST(rt[i] == back[i]);
}

BOOST_AUTO_TEST_CASE(fp4_e8m0_block_packs_low_nibble_first) {
  std::vector<float> x(32, 0.0f);
  x[0] = 6.0f;   // code 7
  x[1] = -3.0f;  // code 0xD
  x[2] = 0.75f;  // tie -> 1.0, code 2
  x[3] = 5.0f;   // tie -> 4.0, code 6
  std::vector<uint8_t> packed(16), s(1);
  QuantizeFp4E8M0(x.data(), 32, 32, packed.data(), s.data());
  BOOST_TEST(E8M0ToFloat(s[0]) == 1.0f);
  BOOST_TEST(static_cast<int>(packed[0]) == 0xD7);
  BOOST_TEST(static_cast<int>(packed[1]) == 0x62);
  std::vector<float> back(32);
  DequantizeFp4E8M0(packed.data(), s.data(), 32, 32, back.data());
  BOOST_TEST(back[1] == -3.0f);
  BOOST_TEST(back[2] == 1.0f);
  BOOST_TEST(back[3] == 4.0f);
  std::vector<float> rt = x;
  RoundTripFp4E8M0(rt.data(), 32, 32);
  for (int i = 0; i < 32; ++i) BOOST_TEST(rt[i] == back[i]);

  // A block with amax 12 gets scale 2: 12*float(1/6) rounds to exactly 2.
  x[0] = 12.0f;
  QuantizeFp4E8M0(x.data(), 32, 32, packed.data(), s.data());
  BOOST_TEST(E8M0ToFloat(s[0]) == 2.0f);
}

BOOST_AUTO_TEST_CASE(fp4_e4m3_block_of_16) {
  std::vector<float> x(32, 0.0f);
  x[0] = 3.0f;   // Block 0: amax 3 -> scale 0.5; 3/0.5 = 6 -> code 7.
  x[1] = 1.0f;   // 2.0 -> code 4
  x[16] = 0.0f;  // Block 1: all zero -> floor scale 2^-9, codes 0.
  std::vector<uint8_t> packed(16), s(2);
  QuantizeFp4E4M3(x.data(), 32, 16, packed.data(), s.data());
  BOOST_TEST(static_cast<int>(s[0]) == 0x30);
  BOOST_TEST(static_cast<int>(s[1]) == 0x01);
  BOOST_TEST(static_cast<int>(packed[0]) == 0x47);
  BOOST_TEST(static_cast<int>(packed[8]) == 0x00);
  std::vector<float> back(32);
  DequantizeFp4E4M3(packed.data(), s.data(), 32, 16, back.data());
  BOOST_TEST(back[0] == 3.0f);
  BOOST_TEST(back[1] == 1.0f);
  std::vector<float> rt = x;
  RoundTripFp4E4M3(rt.data(), 32, 16);
  for (int i = 0; i < 32; ++i) BOOST_TEST(rt[i] == back[i]);
}

BOOST_AUTO_TEST_CASE(fp8_weight_tiles_of_32x32) {
  // 40 x 40: four tiles, three of them partial. Tile (r, c) holds values up to 448 * 2^(r+2c).
  const size_t n = 40;
  std::vector<float> w(n * n);
  for (size_t r = 0; r < n; ++r) {
    for (size_t c = 0; c < n; ++c) {
      float tile_max = 448.0f * std::ldexp(1.0f, static_cast<int>(r / 32 + 2 * (c / 32)));
      w[r * n + c] = ((r + c) % 7 == 0) ? tile_max : tile_max / 3.0f;
    }
  }
  std::vector<uint8_t> q(n * n), s(4);
  QuantizeFp8Weight(w.data(), n, n, q.data(), s.data());
  BOOST_TEST(E8M0ToFloat(s[0]) == 1.0f);  // tile (0,0)
  BOOST_TEST(E8M0ToFloat(s[1]) == 4.0f);  // tile (0,1)
  BOOST_TEST(E8M0ToFloat(s[2]) == 2.0f);  // tile (1,0)
  BOOST_TEST(E8M0ToFloat(s[3]) == 8.0f);  // tile (1,1)
  std::vector<float> back(n * n);
  DequantizeFp8Weight(q.data(), s.data(), n, n, back.data());
  BOOST_TEST(back[0] == w[0]);  // 448 * scale: exact
  for (size_t i = 0; i < n * n; ++i) {
    BOOST_TEST(std::fabs(back[i] - w[i]) <= std::fabs(w[i]) / 16.0f, "i=" << i);
  }
}

BOOST_AUTO_TEST_SUITE_END()

}  // namespace
}  // namespace flashd::kernels::cpu
