// Quantized linear layers on the CPU: y[M,N] = x[M,K] . W[N,K]^T with x already quantized to FP8
// per 32 along K (QuantizeFp8PerBlock), as the model's linear() does before every GEMM.
//
//   FP8 weights: codes [N, K], UE8M0 scales [ceil(N/32), K/32] (one per 32x32 tile).
//   FP4 weights: packed [N, K/2] (low nibble = even k), UE8M0 scales [N, K/32].
//
// Each comes as a plain reference (one thread, one block at a time: the sum of the 32 products of
// a block, then times both scales, added to the output) and a faster threaded version that
// decodes each weight row once and splits the rows over threads. They compute the same function;
// only the order of floating-point additions differs. Kernels never allocate device or output
// memory: the caller owns every buffer.
#pragma once

#include <cstddef>
#include <cstdint>

namespace flashd::kernels::cpu {

enum class KernelStatus { kOk = 0, kBadShape };

inline constexpr size_t kQuantBlock = 32;

KernelStatus Fp8LinearRef(const uint8_t* x_q, const uint8_t* x_s, size_t M, size_t K,
                          const uint8_t* w_q, const uint8_t* w_s, size_t N, float* y);
KernelStatus Fp4LinearRef(const uint8_t* x_q, const uint8_t* x_s, size_t M, size_t K,
                          const uint8_t* w_packed, const uint8_t* w_s, size_t N, float* y);

// `threads` <= 1 runs on the calling thread.
KernelStatus Fp8Linear(const uint8_t* x_q, const uint8_t* x_s, size_t M, size_t K,
                       const uint8_t* w_q, const uint8_t* w_s, size_t N, float* y, int threads);
KernelStatus Fp4Linear(const uint8_t* x_q, const uint8_t* x_s, size_t M, size_t K,
                       const uint8_t* w_packed, const uint8_t* w_s, size_t N, float* y,
                       int threads);

// y[M,N] = x[M,K] . W[N,K]^T in fp32 for weights kept as floats (BF16 projections, fp32 mixers,
// the head). The reference sums each dot product in order; the threaded version splits N.
void DenseLinearRef(const float* x, size_t M, size_t K, const float* w, size_t N, float* y);
void DenseLinear(const float* x, size_t M, size_t K, const float* w, size_t N, float* y,
                 int threads);

// The fast path's dot product of one activation row with one decoded weight row, per
// instruction set, for the tests that hold each to the plain definition. Sse exists on x86-64
// only.
namespace internal {
float ScaledBlockDotPlain(const float* x, const float* w, const float* scales, size_t blocks);
float ScaledBlockDotSse(const float* x, const float* w, const float* scales, size_t blocks);
float ScaledBlockDot(const float* x, const float* w, const float* scales, size_t blocks);
// The AVX2 path's layout: blocks in pairs, each pair as 8 steps of (4 elements of the first
// block, the same 4 of the second); an odd last block as it is. PairedIndex(k) is where element
// k goes; ToPaired lays out a row of K (a multiple of 32) floats.
size_t PairedIndex(size_t k);
void ToPaired(const float* in, size_t K, float* out);
// x86-64 only, REQUIRE CpuHasAvx2(): paired rows x + r x_stride (8, 4 or 1 of them) against
// one paired weight row, each equal to ScaledBlockDotPlain on the natural rows; weight rows
// decoded straight into the paired layout (without their scales).
void PairedDot8Avx2(const float* x, size_t x_stride, const float* w, const float* scales,
                    size_t blocks, float* out);
void PairedDot4Avx2(const float* x, size_t x_stride, const float* w, const float* scales,
                    size_t blocks, float* out);
float PairedDot1Avx2(const float* x, const float* w, const float* scales, size_t blocks);
void DecodeFp8RowPairedAvx2(const uint8_t* w, size_t K, float* out);
void DecodeFp4RowPairedAvx2(const uint8_t* w, size_t K, float* out);
bool CpuHasAvx2();
// The dense path's dot product (four lanes k % 4, the tail in lane 0), plain, in one SSE
// register, and four rows of x at once in SSE registers.
float DenseDotPlain(const float* x, const float* w, size_t K);
float DenseDot1Sse(const float* x, const float* w, size_t K);
void DenseDot4Sse(const float* x, size_t x_stride, const float* w, size_t K, float* out);
}  // namespace internal

}  // namespace flashd::kernels::cpu
