// Number formats of the DeepSeek-V4.1 checkpoint and its caches, bit-exact on the CPU.
//
// These are the references every other backend is tested against. Rounding follows the
// hardware casts the model's kernels use: round to nearest, ties to even, and saturation to the
// largest finite value (cvt.rn.satfinite) where a format has no infinity.
//
//   BF16       1-8-7, the storage type of norms, router and small projections.
//   F16        1-5-10, read only.
//   FP8 E4M3   1-4-3 "fn": no infinities, 0x7F/0xFF are NaN, largest finite 448.
//   E8M0       an 8-bit exponent: 2^(code-127), 0xFF is NaN. Scales only; always powers of two.
//   FP4 E2M1   1-2-1: {0, 0.5, 1, 1.5, 2, 3, 4, 6}, two per byte, low nibble = even element.
//
// Block formats (one scale per block of consecutive elements along the last dimension):
//   FP8 + UE8M0 per 32        activations before every linear, the window KV ring, Engram rows
//   FP8 + UE8M0 per 32x32     dense weights (one scale per 32 rows x 32 columns)
//   FP4 + UE8M0 per 32        routed-expert weights, indexer keys and queries
//   FP4 + E4M3 per 16         compressed KV
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <limits>

#include "kernels/codecs.h"

namespace flashd::kernels::cpu {

inline constexpr float kFp8Max = 448.0f;
inline constexpr float kFp4Max = 6.0f;

// --- Scalars --------------------------------------------------------------------------------
inline float Bf16ToFloat(uint16_t bits) { return codecs::Bf16ToFloat(bits); }
// Round to nearest even; NaN stays NaN (quiet).
inline uint16_t FloatToBf16(float value) { return codecs::FloatToBf16(value); }
float F16ToFloat(uint16_t bits);

float E4M3ToFloat(uint8_t code);
// The 256 decoded E4M3 values, indexed by code, for kernels that decode in bulk.
const float* E4M3DecodeTable();
uint8_t FloatToE4M3(float value);  // RNE; |value| >= 448 saturates to +-448; NaN -> 0x7F|sign.

// 2^(code-127) built from its bits (code 0 is the subnormal 2^-127), equal to
// std::ldexp(1.0f, code - 127) for every code; inline because kernels call it per block.
inline float E8M0ToFloat(uint8_t code) { return codecs::E8M0ToFloat(code); }
// The E4M3 value of `code` by bit arithmetic, branch-free so loops of it vectorize; equal to
// E4M3ToFloat (the table) on every code.
inline float E4M3ToFloatArith(uint8_t code) { return codecs::E4M3ToFloat(code); }
// REQUIRES: value is a power of two in [2^-127, 2^127] (what Pow2Ceil produces).
uint8_t FloatToE8M0(float value);

float E2M1ToFloat(uint8_t code);  // Low 4 bits: sign (bit 3) and magnitude code (bits 0-2).
// Both E2M1 values of every byte, low nibble first ([2 * byte], [2 * byte + 1]), for kernels that
// decode packed FP4 a byte at a time.
const float* E2M1PairTable();
uint8_t FloatToE2M1(float value);  // RNE to the even code; |value| > 6 saturates; NaN -> 0.

// 2^ceil(log2(x)) read off the float's exponent and mantissa bits, exact at powers of two. This
// is how every UE8M0 scale is rounded (the kernels' fast_round_scale).
float Pow2Ceil(float x);

// --- Scale rules ----------------------------------------------------------------------------
// FP8 per-block scale: amax floored at 1e-4, times float(1/448), rounded up to a power of two.
float Fp8BlockScale(float amax);
// FP4 scale stored as E8M0: amax floored at 6 * 2^-126, times float(1/6), power-of-two ceiling.
float Fp4E8M0BlockScale(float amax);
// FP4 scale stored as E4M3 (compressed KV): amax floored at 6 * 2^-9, over 6, at most 448, then
// cast to E4M3. Returns the E4M3 code.
uint8_t Fp4E4M3BlockScaleCode(float amax);

// --- Block quantizers -----------------------------------------------------------------------
// Each quantizes `n` elements (REQUIRES: n a multiple of the block) and writes one scale code per
// block. FP4 output is packed: n/2 bytes.
void QuantizeFp8PerBlock(const float* x, size_t n, size_t block, uint8_t* q, uint8_t* scales);
// `rows` rows of `width` values, `stride` floats apart, as Linear quantizes its x: each row through
// QuantizeFp8PerBlock in blocks of 32 into codes [rows, width] and scales [rows, width / 32].
void QuantizeFp8Rows(const float* x, int64_t rows, int64_t width, int64_t stride, uint8_t* codes,
                     uint8_t* scales);
void DequantizeFp8PerBlock(const uint8_t* q, const uint8_t* scales, size_t n, size_t block,
                           float* out);
void QuantizeFp4E8M0(const float* x, size_t n, size_t block, uint8_t* packed, uint8_t* scales);
void DequantizeFp4E8M0(const uint8_t* packed, const uint8_t* scales, size_t n, size_t block,
                       float* out);
void QuantizeFp4E4M3(const float* x, size_t n, size_t block, uint8_t* packed, uint8_t* scales);
void DequantizeFp4E4M3(const uint8_t* packed, const uint8_t* scales, size_t n, size_t block,
                       float* out);

// The model's in-place fake quantizers: round `x` through the format and back.
void RoundTripFp8(float* x, size_t n, size_t block);      // UE8M0 scale per `block`.
void RoundTripFp4E8M0(float* x, size_t n, size_t block);  // UE8M0 scale per `block`.
void RoundTripFp4E4M3(float* x, size_t n, size_t block);  // E4M3 scale per `block`.

// Dense weight [rows, cols] -> FP8 codes [rows, cols] and UE8M0 scales
// [ceil(rows/32), ceil(cols/32)], one per 32x32 tile (edge tiles are partial).
void QuantizeFp8Weight(const float* w, size_t rows, size_t cols, uint8_t* q, uint8_t* scales);
void DequantizeFp8Weight(const uint8_t* q, const uint8_t* scales, size_t rows, size_t cols,
                         float* out);

}  // namespace flashd::kernels::cpu
