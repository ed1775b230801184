// Hopper's warpgroup matrix instruction, its operands' staging, and their stand-ins: a 64 x N x
// 32 product of FP8 (E4M3) codes with fp32 sums by a warpgroup (128 consecutive threads, the
// first a multiple of 128), both operands read from shared memory
// (wgmma.mma_async.sync.aligned.m64nNk32.f32.e4m3.e4m3 with descriptors, PTX ISA "Asynchronous
// Warpgroup Level Matrix Multiply-Accumulate"), and cp.async's 16-byte copies to stage them.
//
// Staging (the instruction's K-major layout without swizzle): an operand's rows are kept in
// groups of 8 and its K bytes in pieces of 16; the "core matrix" of row group G and piece P (8
// rows of 16 bytes, row after row) lies at G x kWgmmaGroupBytes + P x kWgmmaPieceBytes. The
// descriptor's leading byte offset is the step from one piece to the next along K
// (kWgmmaPieceBytes), its stride byte offset the step from one row group to the next
// (kWgmmaGroupBytes). A chunk of kWgmmaChunkBytes of K is staged per row group.
//
// Outputs (d, N / 2 floats a thread): with warp w = (thread % 128) / 32, g = lane / 4 and t =
// lane % 4, d[4j + i] is row 16w + g + 8 (i / 2), column 8j + 2t + i % 2 (the m16n8 layout of
// mma.h, one per 8 columns). Each call sums its block from zero (the instruction's scale-d 0).
//
// Devices whose code has the instruction (NVIDIA sm_90a: FLASHD_WGMMA_NATIVE) run it; elsewhere
// (the HIP CPU runtime, AMD, NVIDIA built without sm_90a) every thread computes its own outputs
// from the staged bytes as the layout above places them, summing a block's 32 exact products in
// the tree mma.h's stand-in uses, so the CPU's tests check the staging, the offsets and the
// output layout. The copies are then plain loads and stores, done at once.
#pragma once

#include <cstdint>

#include "kernels/codecs.h"
#include "kernels/gpu/portability.h"

namespace flashd::kernels::FLASHD_GPU_BACKEND {

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FLASHD_WGMMA_NATIVE 1
#endif
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define FLASHD_CP_ASYNC_NATIVE 1
#endif

constexpr int kWgmmaThreads = 128;
constexpr int kWgmmaPieceBytes = 128;                   // 8 rows x 16 bytes.
constexpr int kWgmmaChunkBytes = 128;                   // K bytes of a row group staged.
constexpr int kWgmmaGroupBytes = 8 * kWgmmaChunkBytes;  // A row group's core matrices.

// Where byte `k` (< kWgmmaChunkBytes) of a staged operand's row `row` lies.
FLASHD_OPS_HD inline int WgmmaStaged(int row, int k) {
  return (row / 8) * kWgmmaGroupBytes + (k / 16) * kWgmmaPieceBytes + (row % 8) * 16 + k % 16;
}

// The i-th 16-byte piece of a staged chunk, in the order that fills core matrices one after
// another: a row group's eight rows of piece 0, of piece 1, ..., then the next row group. So
// eight neighbouring threads write one core matrix's 128 contiguous bytes, and a warp reads 64
// contiguous bytes of each of its eight rows.
FLASHD_OPS_HD inline int WgmmaPieceRow(int i) { return (i / 64) * 8 + i % 8; }
FLASHD_OPS_HD inline int WgmmaPiece(int i) { return (i / 8) % 8; }

// 16 bytes from global memory into shared memory, zeros where !valid (gmem is then not read,
// but must be a valid address). Both 16-byte aligned.
__device__ inline void CopyAsync16(void* smem, const void* gmem, bool valid) {
#if defined(FLASHD_CP_ASYNC_NATIVE)
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem),
               "r"(valid ? 16 : 0)
               : "memory");
#else
  *static_cast<uint4*>(smem) = valid ? *static_cast<const uint4*>(gmem) : uint4{0, 0, 0, 0};
#endif
}
// The copies this thread issued since the last commit, as one group.
__device__ inline void CopyAsyncCommit() {
#if defined(FLASHD_CP_ASYNC_NATIVE)
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}
// Until at most kPending of this thread's groups are still being copied.
template <int kPending>
__device__ inline void CopyAsyncWait() {
#if defined(FLASHD_CP_ASYNC_NATIVE)
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
#endif
}
// This thread's writes to shared memory made visible to the matrix instruction's reads (the
// async proxy); then a barrier, before another thread's instruction reads them.
__device__ inline void WgmmaSharedFence() {
#if defined(FLASHD_WGMMA_NATIVE)
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}
// Before an instruction whose output registers other instructions have used.
__device__ inline void WgmmaFence() {
#if defined(FLASHD_WGMMA_NATIVE)
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
// The instructions issued since the last commit, as one group.
__device__ inline void WgmmaCommit() {
#if defined(FLASHD_WGMMA_NATIVE)
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
// Until at most kPending groups are running; then the outputs of the others are read through
// WgmmaDone, which keeps the compiler from reading them earlier.
template <int kPending>
__device__ inline void WgmmaWait() {
#if defined(FLASHD_WGMMA_NATIVE)
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
#endif
}
template <int kN>
__device__ inline void WgmmaDone(float (&d)[kN]) {
#if defined(FLASHD_WGMMA_NATIVE)
  FLASHD_UNROLL
  for (int i = 0; i < kN; ++i) asm volatile("" : "+f"(d[i])::"memory");
#else
  (void)d;
#endif
}

#if defined(FLASHD_WGMMA_NATIVE)
// A staged operand's descriptor: address, leading and stride byte offsets (each >> 4), no
// swizzle, base offset 0.
__device__ inline uint64_t WgmmaDescriptor(const void* smem) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  return static_cast<uint64_t>((a & 0x3FFFF) >> 4) |
         (static_cast<uint64_t>(kWgmmaPieceBytes >> 4) << 16) |
         (static_cast<uint64_t>(kWgmmaGroupBytes >> 4) << 32);
}
#endif

// d = A B^T over one 32-byte K-block: A's 64 rows and B's kN rows staged as above, `a` and `b`
// pointing at the block's first piece of their first row group. Asynchronous on a device with
// the instruction: commit, wait, then WgmmaDone(d) before reading d. REQUIRES: every thread of
// the warpgroup calls it, kN in {8, 64, 128}.
template <int kN>
__device__ inline void WgmmaE4M3(const uint8_t* a, const uint8_t* b, float (&d)[kN / 2]) {
  static_assert(kN == 8 || kN == 64 || kN == 128, "the instruction shapes used");
#if defined(FLASHD_WGMMA_NATIVE)
  const uint64_t da = WgmmaDescriptor(a), db = WgmmaDescriptor(b);
  if constexpr (kN == 8) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0, %1, %2, %3}, %4, %5, 0, 1, 1;\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "l"(da), "l"(db));
  } else if constexpr (kN == 64) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "%32, %33, 0, 1, 1;\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
          "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
          "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
          "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(da), "l"(db));
  } else {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "%64, %65, 0, 1, 1;\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
          "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
          "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
          "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
          "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
          "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
          "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
          "+f"(d[63])
        : "l"(da), "l"(db));
  }
#else
  const int t = static_cast<int>(threadIdx.x % kWgmmaThreads), lane = t % 32;
  const int row0 = 16 * (t / 32) + lane / 4, col0 = 2 * (lane % 4);
  for (int j = 0; j < kN / 8; ++j) {
    for (int i = 0; i < 4; ++i) {
      const int row = row0 + 8 * (i / 2), col = 8 * j + col0 + i % 2;
      float sums[32];
      for (int k = 0; k < 32; ++k) {
        sums[k] = codecs::E4M3ToFloat(a[WgmmaStaged(row, k)]) *
                  codecs::E4M3ToFloat(b[WgmmaStaged(col, k)]);
      }
      for (int width = 1; width < 32; width *= 2) {
        for (int k = 0; k < 32; k += 2 * width) sums[k] += sums[k + width];
      }
      d[4 * j + i] = sums[0];
    }
  }
#endif
}

}  // namespace flashd::kernels::FLASHD_GPU_BACKEND
