// The FP4 widening with a shift (kernels/gpu/mma.h), which the warpgroup GEMM tiles use to fold
// FP4 rows' block scales into the staged codes: checked on the host, for every four codes in
// every shift, against codecs' FP4 and E4M3 decoders. The tiles' use of it is gpu_ops_test's
// linear_matrix case (where a device runs it, through CUDA's byte permutation, which the host
// build replaces by its own, also checked here).
#include <boost/test/unit_test.hpp>
#include <cmath>
#include <cstdint>

#include "kernels/codecs.h"
#include "kernels/gpu/mma.h"

namespace {

namespace gpu = flashd::kernels::FLASHD_GPU_BACKEND;
namespace codecs = flashd::kernels::codecs;

BOOST_AUTO_TEST_CASE(every_four_codes_at_every_shift_are_their_values_times_the_power) {
  int64_t checked = 0;
  for (uint32_t shift = 0; shift <= gpu::kFp4MaxShift; ++shift) {
    for (uint32_t nibbles = 0; nibbles < 0x10000; ++nibbles) {
      // Bits above the four codes are the next codes of a word: they must not leak in.
      const uint32_t word = nibbles | (0xA5C3u << 16);
      const uint32_t bytes = gpu::E2M1x4ToE4M3Shifted(word, shift);
      for (int i = 0; i < 4; ++i) {
        const uint8_t code = static_cast<uint8_t>(bytes >> 8 * i);
        const float got = codecs::E4M3ToFloat(code);
        const float want =
            std::ldexp(codecs::E2M1ToFloat(static_cast<uint8_t>((nibbles >> 4 * i) & 0xF)),
                       static_cast<int>(shift) - 5);
        // Exactly, the sign of zero too; and a nonzero value's code is normal (exponent field
        // at least 1), so that the tile's shift is an add to that field.
        if (got != want || std::signbit(got) != std::signbit(want) ||
            (want != 0.0f && (code & 0x78) == 0)) {
          BOOST_ERROR("shift " << shift << ", codes " << std::hex << nibbles << ": byte " << i
                               << " is " << int{code} << std::dec << " (" << got << "), want "
                               << want);
          return;
        }
        ++checked;
      }
    }
  }
  BOOST_TEST(checked == int64_t{12} * 0x10000 * 4);
}

// At shift 0 the codes are E2M1x4ToE4M3's (values times 2^-6) times two.
BOOST_AUTO_TEST_CASE(shift_zero_is_twice_the_plain_widening) {
  for (uint32_t nibbles = 0; nibbles < 0x10000; ++nibbles) {
    const uint32_t a = gpu::E2M1x4ToE4M3Shifted(nibbles, 0), b = gpu::E2M1x4ToE4M3(nibbles);
    for (int i = 0; i < 4; ++i) {
      const float x = codecs::E4M3ToFloat(static_cast<uint8_t>(a >> 8 * i));
      const float y = codecs::E4M3ToFloat(static_cast<uint8_t>(b >> 8 * i));
      BOOST_TEST_REQUIRE(x == 2.0f * y);
    }
  }
}

// The host's byte permutation against its definition, every selector digit in every place.
BOOST_AUTO_TEST_CASE(byte_permutation_picks_the_selected_bytes) {
  const uint32_t x = 0x33221100u, y = 0x77665544u;
  for (uint32_t s = 0; s < 0x10000; s += 7) {
    const uint32_t r = gpu::BytePerm(x, y, s);
    for (int n = 0; n < 4; ++n) {
      const uint32_t pick = (s >> 4 * n) & 7;
      BOOST_TEST_REQUIRE(((r >> 8 * n) & 0xFF) == pick * 0x11);
    }
  }
}

}  // namespace
