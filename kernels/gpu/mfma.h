// AMD's matrix-core instructions and their stand-in. For the quantized GEMMs: one K-block's 32 x 32
// product over 32 E4M3 codes with fp32 sums, by a wave of 64 threads (lane = threadIdx.x % 64; the
// waves of a thread block are its threads 64w .. 64w + 63). Lane l gives `a`, the 16 codes
// 16 (l / 32) .. 16 (l / 32) + 15 of the block in A's row l % 32 (one 16-byte word), and `b`, the
// same codes of B's column l % 32; the block's K order is the lanes' for A and B alike, so every
// product pairs the right codes. The block's sums are added to d: d[v] is D's row
// 8 (v / 4) + 4 (l / 32) + v % 4, column l % 32 (the 32 x 32 instructions' output layout in
// AMD's CDNA instruction set guides).
//
// CDNA 2 (gfx908, gfx90a) has no FP8 products: each code becomes the FP16 of its value times 2^-8
// by moving its bits (the exponent into FP16's low exponent bits, the mantissa into its top
// bits; subnormal codes to subnormal FP16, NaN codes to a NaN), four instructions of K 8
// (v_mfma_f32_32x32x8f16; products of FP16 are exact in fp32). CDNA 3 (gfx940-gfx942) multiplies
// FP8, in an E4M3 of its own (exponent bias 8, so half the value of the same bits; 0x80 its one
// NaN, no negative zero): negative zeros become zeros and NaN codes 0x80, two instructions of K
// 16 (v_mfma_f32_32x32x16_fp8_fp8). kMfmaProductScale undoes what the codes' scaling did to a
// product (a power of two: exact). Elsewhere (the HIP CPU runtime, NVIDIA, AMD without the
// instruction) every lane passes its words through `scratch` (one MfmaScratch a thread, shared
// memory) and computes its outputs from the wave's, the 32 exact products of each summed in fp32
// in a tree in K order: the same layout, so a kernel's operand loads and output stores are tested
// on the CPU. The instruction's own order of adding is the hardware's. REQUIRES: every thread of
// the block calls it the same number of times (the stand-in synchronises the block), blockDim.x
// a multiple of 64. For FP8 values over BF16 activations (wo_a): MfmaBf16Block, below.
#pragma once

#include <cstdint>

#include "kernels/codecs.h"
#include "kernels/gpu/portability.h"

namespace flashd::kernels::FLASHD_GPU_BACKEND {

#if defined(__HIP_DEVICE_COMPILE__) && \
    (defined(__gfx940__) || defined(__gfx941__) || defined(__gfx942__))
#define FLASHD_MFMA_FP8 1
#elif defined(__HIP_DEVICE_COMPILE__) && (defined(__gfx908__) || defined(__gfx90a__))
#define FLASHD_MFMA_F16 1
#endif
#if defined(FLASHD_MFMA_FP8) || defined(FLASHD_MFMA_F16)
#define FLASHD_MFMA_NATIVE 1
#endif

constexpr int kMfmaLanes = 64;
#if defined(FLASHD_MFMA_F16)
constexpr float kMfmaProductScale = 0x1p16f;  // Each operand's codes times 2^-8.
#elif defined(FLASHD_MFMA_FP8)
constexpr float kMfmaProductScale = 4.0f;  // Each operand read at half its value.
#else
constexpr float kMfmaProductScale = 1.0f;
#endif

struct MfmaScratch {
  uint4 a, b;
};

// Byte i (< 16) of a 16-byte word.
FLASHD_OPS_HD inline uint8_t ByteOf(const uint4& w, int i) {
  const uint32_t word = i < 4 ? w.x : i < 8 ? w.y : i < 12 ? w.z : w.w;
  return static_cast<uint8_t>(word >> (8 * (i % 4)));
}

// Four E4M3 codes (byte i of `x`) as CDNA 3's FP8: 0x80 (negative zero) as 0x00, the NaN codes
// (low seven bits all set) as 0x80, the others' bits as they are.
FLASHD_OPS_HD inline uint32_t E4M3x4ToFnuz(uint32_t x) {
  const uint32_t low = x & 0x7F7F7F7Fu;
  const uint32_t nan = (low + 0x01010101u) & 0x80808080u;      // Low bits 0x7F.
  const uint32_t nonzero = (low + 0x7F7F7F7Fu) & 0x80808080u;  // Low bits not 0.
  const uint32_t negative_zero = x & 0x80808080u & ~nonzero;
  return ((x ^ negative_zero) & ~((nan >> 7) * 0xFFu)) | nan;
}

// Two E4M3 codes (bits 0-7 and 16-23 of `p`, the rest zero) as two FP16 (bits 0-15 and 16-31)
// of their values times 2^-8; NaN codes as NaN.
FLASHD_OPS_HD inline uint32_t E4M3x2ToHalf(uint32_t p) {
  const uint32_t low = p & 0x007F007Fu;
  const uint32_t nan = (low + 0x00010001u) & 0x00800080u;
  return ((p & 0x00800080u) << 8) | (low << 7) | (nan >> 7) * 0x7E00u;
}

#if defined(FLASHD_MFMA_NATIVE)
typedef float MfmaFloat16 __attribute__((ext_vector_type(16)));
typedef _Float16 MfmaHalf4 __attribute__((ext_vector_type(4)));
typedef uint32_t MfmaWord2 __attribute__((ext_vector_type(2)));
#endif

// The stand-ins' common part: every lane's operands (`mine`) through `scratch`, then each of d's
// 16 outputs (row 8 (v / 4) + 4 (l / 32) + v % 4, column l % 32) gets the 32 products of its row
// of A and column of B, product(wave, row, col, k) (wave: the wave's scratch), summed in fp32 in
// a tree in K order and added.
template <class Scratch, class Product>
__device__ inline void MfmaStandIn(const Scratch& mine, float (&d)[16], Scratch* scratch,
                                   Product product) {
  const unsigned self = threadIdx.x, lane = self % kMfmaLanes;
  scratch[self] = mine;
  __syncthreads();
  const Scratch* wave = scratch + (self - lane);
  const unsigned col = lane % 32, half = lane / 32;
  for (int v = 0; v < 16; ++v) {
    const unsigned row = 8 * (v / 4) + 4 * half + v % 4;
    float sums[32];
    for (unsigned k = 0; k < 32; ++k) sums[k] = product(wave, row, col, k);
    for (unsigned width = 1; width < 32; width *= 2) {
      for (unsigned k = 0; k < 32; k += 2 * width) sums[k] += sums[k + width];
    }
    d[v] += sums[0];
  }
  __syncthreads();  // The wave's scratch is read before anyone's next call writes it.
}

__device__ inline void MfmaE4M3Block(const uint4& a, const uint4& b, float (&d)[16],
                                     MfmaScratch* scratch) {
#if defined(FLASHD_MFMA_NATIVE)
  (void)scratch;
  MfmaFloat16 acc;
  FLASHD_UNROLL
  for (int v = 0; v < 16; ++v) acc[v] = d[v];
  const uint32_t aw[4] = {a.x, a.y, a.z, a.w}, bw[4] = {b.x, b.y, b.z, b.w};
#if defined(FLASHD_MFMA_F16)
  // Instruction s: the lane's codes 4s .. 4s + 3.
  auto halves = [](uint32_t x) {
    const uint32_t lo = (x & 0xFFu) | ((x & 0xFF00u) << 8);
    const uint32_t hi = ((x >> 16) & 0xFFu) | ((x >> 8) & 0xFF0000u);
    return __builtin_bit_cast(MfmaHalf4, MfmaWord2{E4M3x2ToHalf(lo), E4M3x2ToHalf(hi)});
  };
  FLASHD_UNROLL
  for (int s = 0; s < 4; ++s) {
    acc = __builtin_amdgcn_mfma_f32_32x32x8f16(halves(aw[s]), halves(bw[s]), acc, 0, 0, 0);
  }
#else
  // Instruction s: the lane's codes 8s .. 8s + 7.
  FLASHD_UNROLL
  for (int s = 0; s < 2; ++s) {
    const long av =
        __builtin_bit_cast(long, MfmaWord2{E4M3x4ToFnuz(aw[2 * s]), E4M3x4ToFnuz(aw[2 * s + 1])});
    const long bv =
        __builtin_bit_cast(long, MfmaWord2{E4M3x4ToFnuz(bw[2 * s]), E4M3x4ToFnuz(bw[2 * s + 1])});
    acc = __builtin_amdgcn_mfma_f32_32x32x16_fp8_fp8(av, bv, acc, 0, 0, 0);
  }
#endif
  FLASHD_UNROLL
  for (int v = 0; v < 16; ++v) d[v] = acc[v];
#else
  MfmaStandIn(MfmaScratch{a, b}, d, scratch,
              [](const MfmaScratch* wave, unsigned row, unsigned col, unsigned k) {
                // A(row, k) and B(k, col): the lanes holding codes 16 (k / 16) .., byte k % 16.
                const uint8_t ac = ByteOf(wave[row + 32 * (k / 16)].a, k % 16);
                const uint8_t bc = ByteOf(wave[col + 32 * (k / 16)].b, k % 16);
                return codecs::E4M3ToFloat(ac) * codecs::E4M3ToFloat(bc);
              });
#endif
}

// The BF16 instruction in the same layout: one K-block's 32 x 32 product over 32 BF16 values
// with fp32 sums (products of BF16 values are exact in fp32). Lane l gives `a`, the 16 values
// 16 (l / 32) .. 16 (l / 32) + 15 of the block in A's row l % 32 (two 16-byte words, the lower
// value of each 32-bit word in its low half), and `b`, the same values of B's column l % 32; d
// as MfmaE4M3Block's. CDNA 2's gfx90a and CDNA 3 run four v_mfma_f32_32x32x8bf16_1k (K 8: the
// lane's values 4s .. 4s + 3 in instruction s), gfx908 eight v_mfma_f32_32x32x4bf16 (K 4: values
// 2s, 2s + 1); elsewhere the stand-in (MfmaE4M3Block's, the products of the values). Same
// REQUIRES as MfmaE4M3Block.
struct MfmaBf16Scratch {
  uint4 a[2], b[2];
};

// 16-bit value i (< 16) of two 16-byte words.
FLASHD_OPS_HD inline uint16_t HalfOf(const uint4 (&w)[2], int i) {
  const uint4& q = w[i / 8];
  const int j = i % 8;
  const uint32_t word = j < 2 ? q.x : j < 4 ? q.y : j < 6 ? q.z : q.w;
  return static_cast<uint16_t>(word >> (16 * (j % 2)));
}

#if defined(FLASHD_MFMA_NATIVE)
typedef short MfmaShort4 __attribute__((ext_vector_type(4)));
typedef short MfmaShort2 __attribute__((ext_vector_type(2)));
#endif

__device__ inline void MfmaBf16Block(const uint4 (&a)[2], const uint4 (&b)[2], float (&d)[16],
                                     MfmaBf16Scratch* scratch) {
#if defined(FLASHD_MFMA_NATIVE)
  (void)scratch;
  MfmaFloat16 acc;
  FLASHD_UNROLL
  for (int v = 0; v < 16; ++v) acc[v] = d[v];
  const uint32_t aw[8] = {a[0].x, a[0].y, a[0].z, a[0].w, a[1].x, a[1].y, a[1].z, a[1].w};
  const uint32_t bw[8] = {b[0].x, b[0].y, b[0].z, b[0].w, b[1].x, b[1].y, b[1].z, b[1].w};
#if defined(__gfx908__)
  FLASHD_UNROLL
  for (int s = 0; s < 8; ++s) {
    acc = __builtin_amdgcn_mfma_f32_32x32x4bf16(
        __builtin_bit_cast(MfmaShort2, aw[s]), __builtin_bit_cast(MfmaShort2, bw[s]), acc, 0, 0, 0);
  }
#else
  FLASHD_UNROLL
  for (int s = 0; s < 4; ++s) {
    const MfmaShort4 av = __builtin_bit_cast(MfmaShort4, MfmaWord2{aw[2 * s], aw[2 * s + 1]});
    const MfmaShort4 bv = __builtin_bit_cast(MfmaShort4, MfmaWord2{bw[2 * s], bw[2 * s + 1]});
    acc = __builtin_amdgcn_mfma_f32_32x32x8bf16_1k(av, bv, acc, 0, 0, 0);
  }
#endif
  FLASHD_UNROLL
  for (int v = 0; v < 16; ++v) d[v] = acc[v];
#else
  MfmaStandIn(MfmaBf16Scratch{{a[0], a[1]}, {b[0], b[1]}}, d, scratch,
              [](const MfmaBf16Scratch* wave, unsigned row, unsigned col, unsigned k) {
                // A(row, k) and B(k, col): the lanes holding values 16 (k / 16) .., value k % 16.
                const uint16_t av = HalfOf(wave[row + 32 * (k / 16)].a, k % 16);
                const uint16_t bv = HalfOf(wave[col + 32 * (k / 16)].b, k % 16);
                return codecs::Bf16ToFloat(av) * codecs::Bf16ToFloat(bv);
              });
#endif
}

}  // namespace flashd::kernels::FLASHD_GPU_BACKEND
