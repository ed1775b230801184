// The one matrix-core instruction the kernels use, and its stand-in: a 16 x 8 x 32 product of
// FP8 (E4M3) codes with fp32 sums by a group of 32 threads (a warp on NVIDIA), as NVIDIA's
// mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 lays it out (PTX ISA, "Matrix Fragments
// for mma.m16n8k32"). With g = lane / 4 and t = lane % 4 (lane = threadIdx.x % 32):
//   a[0]: A's row g,     columns 4t..4t+3 (byte i: column 4t + i); a[1]: row g + 8, the same;
//   a[2]: A's row g,     columns 16 + 4t..;                         a[3]: row g + 8, the same;
//   b[0]: B's column g,  rows 4t..4t+3;                             b[1]: rows 16 + 4t..;
//   d[i]: D's row g + 8 (i / 2), column 2t + i % 2.
// Devices that have the instruction (NVIDIA from sm_89) run it; elsewhere (the HIP CPU runtime,
// AMD until an MFMA path exists, older NVIDIA) every thread of the block passes its fragments
// through `scratch` (one MmaScratch a thread, shared memory) and computes its outputs from the
// group's: the same layout, so a kernel's fragment loads and output stores are tested on the CPU.
// The stand-in sums the 32 exact products in fp32 in a tree (neighbouring columns in pairs, then
// neighbouring pairs, ...) and adds that to d: an order other than the exact GEMMs' column by
// column on purpose, as the instruction's adder is, so that tests on the CPU see results whose
// rounding differs from the exact path's. The instruction's own rounding is the hardware's (a
// kernel's results are the same whatever else is in its tiles, but not the stand-in's bit for
// bit). REQUIRES: every thread of the block calls it the same number of times (the stand-in
// synchronises the block), blockDim.x a multiple of 32.
#pragma once

#include <cstdint>

#include "kernels/codecs.h"
#include "kernels/gpu/portability.h"

namespace flashd::kernels::FLASHD_GPU_BACKEND {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#define FLASHD_MMA_E4M3_NATIVE 1
#endif

struct MmaScratch {
  uint32_t a[4];
  uint32_t b[2];
};

// The stand-ins' common part: every thread's fragments through `scratch`, then each of d's four
// outputs (row g + 8 (i / 2), column 2t + i % 2) gets the kK products of its row of A and column
// of B, product(group, row, col, k) (group: the group's scratch), summed in a tree (neighbouring
// k in pairs, then neighbouring pairs, ...) and added.
template <unsigned kK, class Product>
__device__ inline void MmaStandIn(const uint32_t (&a)[4], const uint32_t (&b)[2], float (&d)[4],
                                  MmaScratch* scratch, Product product) {
  const unsigned self = threadIdx.x, lane = self % 32;
  for (int i = 0; i < 4; ++i) scratch[self].a[i] = a[i];
  scratch[self].b[0] = b[0];
  scratch[self].b[1] = b[1];
  __syncthreads();
  const MmaScratch* group = scratch + (self - lane);
  for (int i = 0; i < 4; ++i) {
    const unsigned row = lane / 4 + 8 * (i / 2), col = (lane % 4) * 2 + i % 2;
    float sums[kK];
    for (unsigned k = 0; k < kK; ++k) sums[k] = product(group, row, col, k);
    for (unsigned width = 1; width < kK; width *= 2) {
      for (unsigned k = 0; k < kK; k += 2 * width) sums[k] += sums[k + width];
    }
    d[i] += sums[0];
  }
  __syncthreads();  // The group's scratch is read before anyone's next call writes it.
}

__device__ inline void MmaE4M3(const uint32_t (&a)[4], const uint32_t (&b)[2], float (&d)[4],
                               MmaScratch* scratch) {
#if defined(FLASHD_MMA_E4M3_NATIVE)
  (void)scratch;
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
  MmaStandIn<32>(a, b, d, scratch,
                 [](const MmaScratch* group, unsigned row, unsigned col, unsigned k) {
                   // Who holds A(row, k) and B(k, col), in which register and byte.
                   const unsigned t = (k % 16) / 4, byte = 8 * (k % 4);
                   const uint32_t aw = group[(row % 8) * 4 + t].a[row / 8 + 2 * (k / 16)];
                   const uint32_t bw = group[col * 4 + t].b[k / 16];
                   return codecs::E4M3ToFloat(static_cast<uint8_t>(aw >> byte)) *
                          codecs::E4M3ToFloat(static_cast<uint8_t>(bw >> byte));
                 });
#endif
}

// The BF16 instruction of the same shape family: a 16 x 8 x 16 product of BF16 values with fp32
// sums, as mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 lays it out (PTX ISA, "Matrix
// Fragments for mma.m16n8k16 with floating point type"). With g = lane / 4, t = lane % 4, each
// register two values, the lower column or row in its low half:
//   a[0]: A's row g, columns 2t, 2t + 1;  a[1]: row g + 8, the same;
//   a[2]: A's row g, columns 8 + 2t, ..;   a[3]: row g + 8, the same;
//   b[0]: B's column g, rows 2t, 2t + 1;  b[1]: rows 8 + 2t, ..;
//   d[i]: D's row g + 8 (i / 2), column 2t + i % 2 (as MmaE4M3's).
// NVIDIA from sm_80 runs it; elsewhere the stand-in (MmaE4M3's: the group's fragments through
// `scratch`, the 16 exact products summed in a tree and added to d). Same REQUIRES as MmaE4M3.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define FLASHD_MMA_BF16_NATIVE 1
#endif

__device__ inline void MmaBf16(const uint32_t (&a)[4], const uint32_t (&b)[2], float (&d)[4],
                               MmaScratch* scratch) {
#if defined(FLASHD_MMA_BF16_NATIVE)
  (void)scratch;
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
  MmaStandIn<16>(a, b, d, scratch,
                 [](const MmaScratch* group, unsigned row, unsigned col, unsigned k) {
                   // Who holds A(row, k) and B(k, col), in which register and half.
                   const unsigned t = (k % 8) / 2, half = 16 * (k % 2);
                   const uint32_t aw = group[(row % 8) * 4 + t].a[row / 8 + 2 * (k / 8)];
                   const uint32_t bw = group[col * 4 + t].b[k / 8];
                   return codecs::Bf16ToFloat(static_cast<uint16_t>(aw >> half)) *
                          codecs::Bf16ToFloat(static_cast<uint16_t>(bw >> half));
                 });
#endif
}

// Four FP4 (E2M1) codes, code i in bits 4i..4i+3 of `nibbles`, as four E4M3 codes (byte i)
// whose values are the FP4 values times 2^-6, exactly: the FP4 exponent and mantissa bits become
// the low exponent bits and the top mantissa bit (normal and subnormal values alike).
FLASHD_OPS_HD inline uint32_t E2M1x4ToE4M3(uint32_t nibbles) {
  uint32_t x = nibbles & 0xFFFFu;
  x = (x | (x << 8)) & 0x00FF00FFu;  // Codes 0, 1 in byte 0; 2, 3 in byte 2.
  x = (x | (x << 4)) & 0x0F0F0F0Fu;  // Code i in the low half of byte i.
  return ((x & 0x08080808u) << 4) | ((x & 0x07070707u) << 2);
}

// Byte n of the result is byte (s >> 4n) & 7 of the eight bytes x (0-3) then y (4-7): CUDA's
// __byte_perm, one instruction on NVIDIA.
FLASHD_OPS_HD inline uint32_t BytePerm(uint32_t x, uint32_t y, uint32_t s) {
#if defined(__CUDA_ARCH__)
  return __byte_perm(x, y, s);
#else
  const uint64_t bytes = x | static_cast<uint64_t>(y) << 32;
  uint32_t r = 0;
  for (int n = 0; n < 4; ++n)
    r |= static_cast<uint32_t>(bytes >> 8 * ((s >> 4 * n) & 7) & 0xFF) << 8 * n;
  return r;
#endif
}

// The largest shift E2M1x4ToE4M3Shifted takes: FP4's largest value, 6, times 2^(11 - 5) is
// E4M3's 1.5 x 2^8 (exponent field 15, not NaN).
constexpr uint32_t kFp4MaxShift = 11;

// Four FP4 codes as E2M1x4ToE4M3 takes them, as four E4M3 codes whose values are the FP4 values
// times 2^(shift - 5), exactly, for shift 0..kFp4MaxShift: every nonzero value is then a normal
// E4M3 number (FP4's 0.5 at shift 0 is E4M3's smallest normal, 2^-6), so a shift is an add to
// the exponent field. The eight magnitudes' codes are a table of two words that one byte
// permutation indexes with the codes' low three bits; another moves each code's sign bit to its
// byte's top bit.
FLASHD_OPS_HD inline uint32_t E2M1x4ToE4M3Shifted(uint32_t nibbles, uint32_t shift) {
  // Magnitudes 0, 0.5, 1, 1.5 | 2, 3, 4, 6 at shift 0: exponent fields 0, 1, 2, 2 | 3, 3, 4, 4.
  const uint32_t step = shift * 0x08080808u;
  const uint32_t low = 0x14100800u + (step & 0xFFFFFF00u), high = 0x24201C18u + step;
  const uint32_t magnitudes = BytePerm(low, high, nibbles & 0x7777u);
  // Code i's sign (bit 4i + 3) is the top bit of byte 0 of nibbles << 4 (i = 0), byte 0 of
  // nibbles (1), byte 1 of nibbles << 4 (2), byte 1 of nibbles (3).
  return magnitudes | (BytePerm(nibbles << 4, nibbles, 0x5140u) & 0x80808080u);
}

}  // namespace flashd::kernels::FLASHD_GPU_BACKEND
