// The bit-level definitions of the checkpoint's number formats (BF16 rounding, E4M3, E2M1, E8M0
// and the power-of-two scale rule), callable on the host and on a device, so the CPU reference
// (kernels/cpu/formats.h builds on them) and every GPU kernel encode and decode with the same
// code. formats_test checks them on every code against the plain definitions.
#pragma once

#include <cstdint>

#include "kernels/ops.h"  // FLASHD_OPS_HD

namespace flashd::kernels::codecs {

FLASHD_OPS_HD inline uint32_t Bits(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);  // The builtin: device code too.
  return u;
}
FLASHD_OPS_HD inline float FromBits(uint32_t u) {
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}

// The BF16 bits nearest to x, ties to even; NaN stays NaN (quiet).
FLASHD_OPS_HD inline uint16_t FloatToBf16(float x) {
  const uint32_t u = Bits(x);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1)) >> 16);
}
FLASHD_OPS_HD inline float Bf16ToFloat(uint16_t bits) {
  return FromBits(static_cast<uint32_t>(bits) << 16);
}
// x rounded to the nearest BF16 value.
FLASHD_OPS_HD inline float RoundBf16(float x) { return Bf16ToFloat(FloatToBf16(x)); }

FLASHD_OPS_HD inline float Pow2Ceil(float x) {
  const uint32_t u = Bits(x);
  const int exponent = static_cast<int>((u >> 23) & 0xFF) - 127 + ((u & 0x7FFFFF) != 0 ? 1 : 0);
  return FromBits(static_cast<uint32_t>(exponent + 127) << 23);
}

FLASHD_OPS_HD inline float E4M3ToFloat(uint8_t code) {
  const uint32_t magnitude = code & 0x7Fu;
  const float v = FromBits(magnitude << 20) * 0x1p120f;
  const float signed_v = (code & 0x80) ? -v : v;
  return magnitude == 0x7F ? FromBits(0x7FC00000u) : signed_v;  // Selects: loops vectorize.
}

// RNE, saturating at +-448; NaN -> 0x7F with its sign.
FLASHD_OPS_HD inline uint8_t FloatToE4M3(float value) {
  const uint32_t u = Bits(value);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80);
  const uint32_t mag = u & 0x7FFFFFFFu;
  if (mag > 0x7F800000u) return sign | 0x7F;
  const float a = FromBits(mag);
  if (a >= 448.0f) return sign | 0x7E;
  if (a < 0.015625f) {
    const float m = (a * 512.0f + 0x1p23f) - 0x1p23f;
    return sign | static_cast<uint8_t>(m);
  }
  const uint32_t rounded = (mag + 0x7FFFFu + ((mag >> 20) & 1)) >> 20;
  return sign | static_cast<uint8_t>(rounded - ((127 - 7) << 3));
}

FLASHD_OPS_HD inline float E2M1ToFloat(uint8_t code) {
  return FromBits(((code & 8u) << 28) | ((code & 7u) << 22)) * 0x1p126f;
}

// RNE to the even code at a midpoint, saturating at +-6; NaN -> 0.
FLASHD_OPS_HD inline uint8_t FloatToE2M1(float value) {
  const uint32_t u = Bits(value);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0;
  const uint8_t sign = (u >> 31) ? 8 : 0;
  const float a = FromBits(u & 0x7FFFFFFFu);
  const float mids[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
  uint8_t code = 0;
  while (code < 7 && a > mids[code]) ++code;
  if (code < 7 && a == mids[code] && (code & 1)) ++code;
  return sign | code;
}

// 2^(code-127); code 0 is the subnormal 2^-127, 0xFF NaN.
FLASHD_OPS_HD inline float E8M0ToFloat(uint8_t code) {
  if (code == 0xFF) return FromBits(0x7FC00000u);
  return FromBits(code == 0 ? 0x00400000u : static_cast<uint32_t>(code) << 23);
}

// The code of a power of two in the normal range (what Pow2Ceil gives the scale rules).
FLASHD_OPS_HD inline uint8_t NormalPow2ToE8M0(float pow2) {
  return static_cast<uint8_t>((Bits(pow2) >> 23) & 0xFF);
}

FLASHD_OPS_HD inline float Clamp(float v, float lo, float hi) {
  return v < lo ? lo : (v > hi ? hi : v);
}

}  // namespace flashd::kernels::codecs
