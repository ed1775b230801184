#include "kernels/cpu/formats.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>

#include "kernels/cpu/simd.h"

namespace flashd::kernels::cpu {
namespace {

constexpr float kE2M1Values[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};

const std::array<float, 256>& E4M3Table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int c = 0; c < 256; ++c) {
      int sign = c >> 7;
      int exp = (c >> 3) & 0xF;
      int mant = c & 7;
      float v;
      if (exp == 0xF && mant == 7) {
        v = std::nanf("");
      } else if (exp == 0) {
        v = std::ldexp(static_cast<float>(mant), -9);
      } else {
        v = std::ldexp(1.0f + mant / 8.0f, exp - 7);
      }
      t[c] = sign ? -v : v;
    }
    return t;
  }();
  return table;
}

float AbsMax(const float* x, size_t n) {
  float m = 0.0f;
  for (size_t i = 0; i < n; ++i) m = std::max(m, std::fabs(x[i]));
  return m;
}

}  // namespace

float F16ToFloat(uint16_t bits) {
  uint32_t sign = (bits >> 15) & 1;
  int exp = (bits >> 10) & 0x1F;
  uint32_t mant = bits & 0x3FF;
  float v;
  if (exp == 0) {
    v = std::ldexp(static_cast<float>(mant), -24);
  } else if (exp == 31) {
    v = mant ? std::nanf("") : INFINITY;
  } else {
    v = std::ldexp(1.0f + mant / 1024.0f, exp - 15);
  }
  return sign ? -v : v;
}

float E4M3ToFloat(uint8_t code) { return E4M3Table()[code]; }

const float* E4M3DecodeTable() { return E4M3Table().data(); }

uint8_t FloatToE4M3(float value) {
  return codecs::FloatToE4M3(value);  // RNE, saturating at +-448.
}

uint8_t FloatToE8M0(float value) {
  int e;
  std::frexp(value, &e);  // value = 0.5 * 2^e for a power of two.
  int code = e - 1 + 127;
  return static_cast<uint8_t>(std::clamp(code, 0, 254));
}

float E2M1ToFloat(uint8_t code) {
  float v = kE2M1Values[code & 7];
  return (code & 8) ? -v : v;
}

const float* E2M1PairTable() {
  static const std::array<float, 512> pairs = [] {
    std::array<float, 512> t{};
    for (int b = 0; b < 256; ++b) {
      t[2 * b] = E2M1ToFloat(static_cast<uint8_t>(b & 0xF));
      t[2 * b + 1] = E2M1ToFloat(static_cast<uint8_t>(b >> 4));
    }
    return t;
  }();
  return pairs.data();
}

uint8_t FloatToE2M1(float value) {
  return codecs::FloatToE2M1(value);  // RNE to the even code, saturating at +-6.
}

float Pow2Ceil(float x) {
  return codecs::Pow2Ceil(x);  // Read off the exponent and mantissa bits.
}

float Fp8BlockScale(float amax) { return Pow2Ceil(std::max(amax, 1e-4f) * (1.0f / kFp8Max)); }

float Fp4E8M0BlockScale(float amax) {
  return Pow2Ceil(std::max(amax, kFp4Max * 0x1p-126f) * (1.0f / kFp4Max));
}

uint8_t Fp4E4M3BlockScaleCode(float amax) {
  float s = std::min(std::max(amax, kFp4Max * 0x1p-9f) / kFp4Max, kFp8Max);
  return FloatToE4M3(s);
}

void QuantizeFp8PerBlock(const float* x, size_t n, size_t block, uint8_t* q, uint8_t* scales) {
  for (size_t b = 0; b * block < n; ++b) {
    const float* xb = x + b * block;
    float s = Fp8BlockScale(AbsMax(xb, block));
    scales[b] = FloatToE8M0(s);
    for (size_t i = 0; i < block; ++i) {
      q[b * block + i] = FloatToE4M3(std::clamp(xb[i] / s, -kFp8Max, kFp8Max));
    }
  }
}

void QuantizeFp8Rows(const float* x, int64_t rows, int64_t width, int64_t stride, uint8_t* codes,
                     uint8_t* scales) {
  for (int64_t r = 0; r < rows; ++r) {
    QuantizeFp8PerBlock(x + r * stride, static_cast<size_t>(width), 32, codes + r * width,
                        scales + r * (width / 32));
  }
}

// A block at a time, the codes by bit arithmetic: the inner loop vectorizes (the activations of
// every linear layer and the attention's keys pass through here).
FLASHD_VECTOR_CLONES void DequantizeFp8PerBlock(const uint8_t* q, const uint8_t* scales, size_t n,
                                                size_t block, float* out) {
  for (size_t b = 0; b * block < n; ++b) {
    const float s = E8M0ToFloat(scales[b]);
    const size_t end = std::min(n, (b + 1) * block);
    for (size_t i = b * block; i < end; ++i) out[i] = E4M3ToFloatArith(q[i]) * s;
  }
}

namespace {

// Shared body of the two FP4 quantizers: `scale_of` returns (scale value, scale code).
template <typename ScaleOf>
void QuantizeFp4(const float* x, size_t n, size_t block, uint8_t* packed, uint8_t* scales,
                 ScaleOf scale_of) {
  for (size_t b = 0; b * block < n; ++b) {
    const float* xb = x + b * block;
    auto [s, code] = scale_of(AbsMax(xb, block));
    scales[b] = code;
    for (size_t i = 0; i < block; i += 2) {
      uint8_t lo = FloatToE2M1(std::clamp(xb[i] / s, -kFp4Max, kFp4Max));
      uint8_t hi = FloatToE2M1(std::clamp(xb[i + 1] / s, -kFp4Max, kFp4Max));
      packed[(b * block + i) / 2] = static_cast<uint8_t>(lo | (hi << 4));
    }
  }
}

template <typename ScaleValue>
void DequantizeFp4(const uint8_t* packed, const uint8_t* scales, size_t n, size_t block, float* out,
                   ScaleValue scale_value) {
  for (size_t i = 0; i < n; i += 2) {
    uint8_t byte = packed[i / 2];
    float s = scale_value(scales[i / block]);
    out[i] = E2M1ToFloat(byte & 0xF) * s;
    out[i + 1] = E2M1ToFloat(byte >> 4) * s;
  }
}

}  // namespace

void QuantizeFp4E8M0(const float* x, size_t n, size_t block, uint8_t* packed, uint8_t* scales) {
  QuantizeFp4(x, n, block, packed, scales, [](float amax) {
    float s = Fp4E8M0BlockScale(amax);
    return std::pair<float, uint8_t>(s, FloatToE8M0(s));
  });
}

void DequantizeFp4E8M0(const uint8_t* packed, const uint8_t* scales, size_t n, size_t block,
                       float* out) {
  DequantizeFp4(packed, scales, n, block, out, E8M0ToFloat);
}

void QuantizeFp4E4M3(const float* x, size_t n, size_t block, uint8_t* packed, uint8_t* scales) {
  QuantizeFp4(x, n, block, packed, scales, [](float amax) {
    uint8_t code = Fp4E4M3BlockScaleCode(amax);
    return std::pair<float, uint8_t>(E4M3ToFloat(code), code);
  });
}

void DequantizeFp4E4M3(const uint8_t* packed, const uint8_t* scales, size_t n, size_t block,
                       float* out) {
  DequantizeFp4(packed, scales, n, block, out, E4M3ToFloat);
}

namespace {

// Rounds each block of x through a format: `scale_of(amax)` gives the block's scale, `round`
// one element's value at that scale.
template <typename ScaleOf, typename Round>
void RoundTrip(float* x, size_t n, size_t block, ScaleOf scale_of, Round round) {
  for (size_t b = 0; b * block < n; ++b) {
    float* xb = x + b * block;
    const float s = scale_of(AbsMax(xb, block));
    for (size_t i = 0; i < block; ++i) xb[i] = round(xb[i] / s) * s;
  }
}

float RoundFp8(float v) { return E4M3ToFloat(FloatToE4M3(std::clamp(v, -kFp8Max, kFp8Max))); }
float RoundFp4(float v) { return E2M1ToFloat(FloatToE2M1(std::clamp(v, -kFp4Max, kFp4Max))); }

}  // namespace

void RoundTripFp8(float* x, size_t n, size_t block) {
  RoundTrip(x, n, block, Fp8BlockScale, RoundFp8);
}

void RoundTripFp4E8M0(float* x, size_t n, size_t block) {
  RoundTrip(x, n, block, Fp4E8M0BlockScale, RoundFp4);
}

void RoundTripFp4E4M3(float* x, size_t n, size_t block) {
  RoundTrip(
      x, n, block, [](float amax) { return E4M3ToFloat(Fp4E4M3BlockScaleCode(amax)); }, RoundFp4);
}

void QuantizeFp8Weight(const float* w, size_t rows, size_t cols, uint8_t* q, uint8_t* scales) {
  const size_t tile = 32;
  const size_t scale_cols = (cols + tile - 1) / tile;
  for (size_t r0 = 0; r0 < rows; r0 += tile) {
    for (size_t c0 = 0; c0 < cols; c0 += tile) {
      const size_t r1 = std::min(rows, r0 + tile);
      const size_t c1 = std::min(cols, c0 + tile);
      float amax = 0.0f;
      for (size_t r = r0; r < r1; ++r) amax = std::max(amax, AbsMax(w + r * cols + c0, c1 - c0));
      float s = Fp8BlockScale(amax);
      scales[(r0 / tile) * scale_cols + c0 / tile] = FloatToE8M0(s);
      for (size_t r = r0; r < r1; ++r) {
        for (size_t c = c0; c < c1; ++c) {
          q[r * cols + c] = FloatToE4M3(std::clamp(w[r * cols + c] / s, -kFp8Max, kFp8Max));
        }
      }
    }
  }
}

void DequantizeFp8Weight(const uint8_t* q, const uint8_t* scales, size_t rows, size_t cols,
                         float* out) {
  const size_t scale_cols = (cols + 31) / 32;
  for (size_t r = 0; r < rows; ++r) {
    for (size_t c = 0; c < cols; ++c) {
      out[r * cols + c] =
          E4M3ToFloat(q[r * cols + c]) * E8M0ToFloat(scales[(r / 32) * scale_cols + c / 32]);
    }
  }
}

}  // namespace flashd::kernels::cpu
