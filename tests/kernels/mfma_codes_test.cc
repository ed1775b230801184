// The operand conversions of AMD's matrix instruction (kernels/gpu/mfma.h), checked on the host
// for every E4M3 code against codecs::E4M3ToFloat: the FP16 words of CDNA 2's path, decoded here
// from their bits, hold each code's value times 2^-8; CDNA 3's FP8 bytes, decoded with that
// format's bias of 8, hold half of it. The kernels' use of them is gpu_ops_test's linear_matrix
// case; these conversions run only on AMD hardware there, so their values are checked here.
#include <boost/test/unit_test.hpp>
#include <cmath>
#include <cstdint>
#include <random>

#include "kernels/codecs.h"
#include "kernels/gpu/mfma.h"

namespace {

namespace gpu = flashd::kernels::FLASHD_GPU_BACKEND;
using flashd::kernels::codecs::E4M3ToFloat;

// IEEE half: 1 sign, 5 exponent (bias 15), 10 mantissa bits.
float HalfValue(uint16_t h) {
  const int sign = h >> 15, exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
  float magnitude;
  if (exponent == 0x1F) {
    magnitude = mantissa != 0 ? NAN : INFINITY;
  } else if (exponent == 0) {
    magnitude = std::ldexp(static_cast<float>(mantissa), -24);
  } else {
    magnitude = std::ldexp(static_cast<float>(mantissa | 0x400), exponent - 25);
  }
  return sign != 0 ? -magnitude : magnitude;
}

// CDNA 3's E4M3: 4 exponent bits with bias 8, 3 mantissa bits, 0x80 the only NaN, no infinity.
float FnuzValue(uint8_t code) {
  if (code == 0x80) return NAN;
  const int exponent = (code >> 3) & 0xF, mantissa = code & 7;
  const float magnitude = exponent == 0
                              ? std::ldexp(static_cast<float>(mantissa), -10)
                              : std::ldexp(static_cast<float>(mantissa | 8), exponent - 11);
  return (code & 0x80) != 0 ? -magnitude : magnitude;
}

// Same value, or NaN both; zeros compared with their signs.
bool SameValue(float got, float want) {
  if (std::isnan(want)) return std::isnan(got);
  return got == want && std::signbit(got) == std::signbit(want);
}

BOOST_AUTO_TEST_CASE(half_words_hold_every_code_times_two_to_the_minus_8) {
  int checked = 0;
  for (uint32_t a = 0; a < 256; ++a) {
    for (uint32_t b = 0; b < 256; ++b) {
      const uint32_t halves = gpu::E4M3x2ToHalf(a | b << 16);
      const float lo = HalfValue(static_cast<uint16_t>(halves)), hi = HalfValue(halves >> 16);
      const float want_lo = std::ldexp(E4M3ToFloat(static_cast<uint8_t>(a)), -8);
      const float want_hi = std::ldexp(E4M3ToFloat(static_cast<uint8_t>(b)), -8);
      if (!SameValue(lo, want_lo) || !SameValue(hi, want_hi)) {
        BOOST_ERROR("codes " << a << ", " << b << ": halves " << std::hex << halves << std::dec
                             << " are " << lo << ", " << hi << "; want " << want_lo << ", "
                             << want_hi);
        return;
      }
      ++checked;
    }
  }
  BOOST_TEST(checked == 256 * 256);
}

BOOST_AUTO_TEST_CASE(fnuz_bytes_hold_half_of_every_code_in_any_byte) {
  std::mt19937 rng(7);
  for (int position = 0; position < 4; ++position) {
    for (uint32_t code = 0; code < 256; ++code) {
      const uint32_t word = (rng() & ~(0xFFu << 8 * position)) | code << 8 * position;
      const uint32_t fnuz = gpu::E4M3x4ToFnuz(word);
      for (int i = 0; i < 4; ++i) {
        const uint8_t in = static_cast<uint8_t>(word >> 8 * i),
                      out = static_cast<uint8_t>(fnuz >> 8 * i);
        const float want = E4M3ToFloat(in), got = 2.0f * FnuzValue(out);
        // Negative zero has no code of its own there: it becomes zero.
        const float want_signed = want == 0.0f ? 0.0f : want;
        if (!SameValue(got, want_signed)) {
          BOOST_ERROR("byte " << i << " of " << std::hex << word << ": code " << int{in}
                              << " became " << int{out} << std::dec << ", value " << got
                              << "; want " << want_signed);
          return;
        }
      }
    }
  }
  // The two codes the format cannot keep: negative zero and the NaNs.
  BOOST_TEST(gpu::E4M3x4ToFnuz(0x80808080u) == 0u);
  BOOST_TEST(gpu::E4M3x4ToFnuz(0x7FFF7FFFu) == 0x80808080u);
}

}  // namespace
