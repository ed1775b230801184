// The transcendental functions the ops use (exp, the logistic function, sine and cosine,
// softplus), written once for the host and every device: each is a fixed sequence of IEEE double
// additions, multiplications and divisions (no fused multiply-add: the CPU build and every GPU
// build turn contraction off), so the CPU reference and the GPU kernels give the same bits, where
// each platform's own expf, sinf and cosf differ in the last place (CUDA's are within 2 ulp).
//
// Each works in double and rounds once to float: a range reduction exact for the arguments the
// model produces, then a Taylor polynomial whose error (below 1e-14 relative) leaves the float
// result correctly rounded but for arguments within 1e-14 of a rounding midpoint. fmath_test
// holds each to the C library's double functions.
#pragma once

#include <cstdint>

#include "kernels/codecs.h"
#include "kernels/ops.h"  // FLASHD_OPS_HD

namespace flashd::kernels::fmath {

namespace detail {

FLASHD_OPS_HD inline uint64_t Bits(double d) {
  uint64_t u;
  __builtin_memcpy(&u, &d, 8);
  return u;
}
FLASHD_OPS_HD inline double FromBits(uint64_t u) {
  double d;
  __builtin_memcpy(&d, &u, 8);
  return d;
}
// 2^k for a normal double's exponent range.
FLASHD_OPS_HD inline double Pow2(int64_t k) {
  return FromBits(static_cast<uint64_t>(k + 1023) << 52);
}
// x rounded to the nearest integer (ties to even), for |x| < 2^51.
FLASHD_OPS_HD inline double Nearest(double x) {
  constexpr double kShift = 0x1.8p52;
  return (x + kShift) - kShift;
}

// ln 2 in two parts: the high part has 32 significant bits, so k * kLn2Hi is exact for |k| < 2^21.
constexpr double kLn2Hi = 0x1.62e42fee00000p-1;
constexpr double kLn2Lo = 0x1.a39ef35793c76p-33;

// e^x for |x| <= 700: x = k ln2 + r with |r| <= ln2 / 2, e^r by Taylor's series to r^12.
FLASHD_OPS_HD inline double ExpCore(double x) {
  const double k = Nearest(x * 0x1.71547652b82fep+0);  // x / ln 2
  const double r = (x - k * kLn2Hi) - k * kLn2Lo;
  double p = 0x1.1eed8eff8d898p-29;  // 1/12!
  p = p * r + 0x1.ae64567f544e4p-26;
  p = p * r + 0x1.27e4fb7789f5cp-22;
  p = p * r + 0x1.71de3a556c734p-19;
  p = p * r + 0x1.a01a01a01a01ap-16;
  p = p * r + 0x1.a01a01a01a01ap-13;
  p = p * r + 0x1.6c16c16c16c17p-10;
  p = p * r + 0x1.1111111111111p-7;
  p = p * r + 0x1.5555555555555p-5;
  p = p * r + 0x1.5555555555555p-3;
  p = p * r + 0.5;
  p = p * r + 1.0;
  p = p * r + 1.0;
  return p * Pow2(static_cast<int64_t>(k));
}

// ln u for a finite u >= 1: u = m 2^e with m in [sqrt(1/2), sqrt(2)), ln m = 2 atanh(s) with
// s = (m - 1) / (m + 1), |s| <= 0.172, by its series to s^23.
FLASHD_OPS_HD inline double LogCore(double u) {
  const uint64_t bits = Bits(u);
  int64_t e = static_cast<int64_t>((bits >> 52) & 0x7FF) - 1023;
  double m = FromBits((bits & 0x000FFFFFFFFFFFFFull) | 0x3FF0000000000000ull);
  if (m > 0x1.6a09e667f3bcdp+0) {  // sqrt(2)
    m *= 0.5;
    e += 1;
  }
  const double f = m - 1.0;
  const double s = f / (2.0 + f);
  const double s2 = s * s;
  double t = 0x1.642c8590b2164p-5;  // 1/23
  t = t * s2 + 0x1.8618618618618p-5;
  t = t * s2 + 0x1.af286bca1af28p-5;
  t = t * s2 + 0x1.e1e1e1e1e1e1ep-5;
  t = t * s2 + 0x1.1111111111111p-4;
  t = t * s2 + 0x1.3b13b13b13b14p-4;
  t = t * s2 + 0x1.745d1745d1746p-4;
  t = t * s2 + 0x1.c71c71c71c71cp-4;
  t = t * s2 + 0x1.2492492492492p-3;
  t = t * s2 + 0x1.999999999999ap-3;
  t = t * s2 + 0x1.5555555555555p-2;
  t = t * s2;
  const double ed = static_cast<double>(e);
  return ed * kLn2Hi + (2.0 * s + (2.0 * s * t + ed * kLn2Lo));
}

}  // namespace detail

// e^x, rounded to float; NaN for NaN, +inf above the float range, 0 below it.
FLASHD_OPS_HD inline float Exp(float x) {
  if (!(x == x)) return x;
  if (x > 89.0f) return codecs::FromBits(0x7F800000u);
  if (x < -104.0f) return 0.0f;
  return static_cast<float>(detail::ExpCore(x));
}

// The logistic function, 1 / (1 + e^-x), in float as the reference computes it.
FLASHD_OPS_HD inline float Sigmoid(float x) { return 1.0f / (1.0f + Exp(-x)); }

// One value of the experts' SwiGLU (SwigluParams), the same steps on every backend: gate and up
// rounded to BF16; where limit > 0, up clamped to [-limit, limit] and gate to at most limit (a
// NaN stays NaN, as the reference's clamp keeps it); gate x sigmoid(gate) x up, times the row's
// weight where there is one, rounded to BF16.
FLASHD_OPS_HD inline float SwigluValue(float gate, float up, float limit, const float* weight) {
  gate = codecs::RoundBf16(gate);
  up = codecs::RoundBf16(up);
  if (limit > 0) {
    up = codecs::Clamp(up, -limit, limit);
    gate = limit < gate ? limit : gate;
  }
  float v = gate * Sigmoid(gate) * up;
  if (weight != nullptr) v = *weight * v;
  return codecs::RoundBf16(v);
}

// ln(1 + e^x), rounded to float; x itself above 88 (e^-88 is below x's last place).
FLASHD_OPS_HD inline float Softplus(float x) {
  if (!(x == x) || x > 88.0f) return x;
  if (x < -104.0f) return 0.0f;
  const double y = detail::ExpCore(x);
  const double u = 1.0 + y;
  // ln(1 + y) from the rounded 1 + y, corrected by y / (u - 1) (exact while u - 1 is).
  return static_cast<float>(u == 1.0 ? y : detail::LogCore(u) * (y / (u - 1.0)));
}

// sin x and cos x, each rounded to float; NaN for NaN and infinities. x = k pi/2 + r, pi/2 in
// three 33-bit parts (exact products for |k| < 2^20, so |x| up to about 1.6e6: every rotary
// angle of a million-token context), then Taylor's series on |r| <= pi/4.
FLASHD_OPS_HD inline void SinCos(float x, float* sin_x, float* cos_x) {
  const uint32_t bits = codecs::Bits(x);
  if ((bits & 0x7F800000u) == 0x7F800000u) {
    *sin_x = *cos_x = codecs::FromBits(0x7FC00000u);
    return;
  }
  const double xd = x;
  const double k = detail::Nearest(xd * 0x1.45f306dc9c883p-1);  // x / (pi/2)
  const double r =
      ((xd - k * 0x1.921fb54400000p+0) - k * 0x1.0b4611a600000p-34) - k * 0x1.3198a2e000000p-69;
  const double r2 = r * r;
  double s = -0x1.ae7f3e733b81fp-41;  // -1/15!
  s = s * r2 + 0x1.6124613a86d09p-33;
  s = s * r2 - 0x1.ae64567f544e4p-26;
  s = s * r2 + 0x1.71de3a556c734p-19;
  s = s * r2 - 0x1.a01a01a01a01ap-13;
  s = s * r2 + 0x1.1111111111111p-7;
  s = s * r2 - 0x1.5555555555555p-3;
  s = r + r * (s * r2);
  double c = 0x1.ae7f3e733b81fp-45;  // 1/16!
  c = c * r2 - 0x1.93974a8c07c9dp-37;
  c = c * r2 + 0x1.1eed8eff8d898p-29;
  c = c * r2 - 0x1.27e4fb7789f5cp-22;
  c = c * r2 + 0x1.a01a01a01a01ap-16;
  c = c * r2 - 0x1.6c16c16c16c17p-10;
  c = c * r2 + 0x1.5555555555555p-5;
  c = c * r2 - 0.5;
  c = 1.0 + c * r2;
  switch (static_cast<int64_t>(k) & 3) {
    case 0:
      *sin_x = static_cast<float>(s), *cos_x = static_cast<float>(c);
      break;
    case 1:
      *sin_x = static_cast<float>(c), *cos_x = static_cast<float>(-s);
      break;
    case 2:
      *sin_x = static_cast<float>(-s), *cos_x = static_cast<float>(-c);
      break;
    default:
      *sin_x = static_cast<float>(-c), *cos_x = static_cast<float>(s);
      break;
  }
}

}  // namespace flashd::kernels::fmath
