// RMSNorm and RoPE on the device. RMSNorm: one block per row, the sum of squares in double in the
// CPU's lanes and fixed tree (so a row's result never depends on the batch), then the same fp32
// scale and BF16 rounding as the CPU (and where asked the row's rotation and FP8 fake quantizer
// after it, as the Rope and FakeQuant kernels compute them). RoPE: one thread per rotated pair, the
// angle an fp32 product as on the CPU, its sine and cosine kernels/fmath.h's.
#include <cmath>

#include "kernels/codecs.h"
#include "kernels/fmath.h"
#include "kernels/gpu/norm_row.h"
#include "kernels/gpu/ops.h"
#include "kernels/gpu/portability.h"
#include "kernels/gpu/quantized.h"

namespace flashd::kernels::FLASHD_GPU_BACKEND {
namespace {

namespace c = flashd::kernels::codecs;
// A thread block a row, of a's rows and then b's (RmsNormParams' next; b.rows 0 where there is
// none): the norm, then (rope_dim > 0) a thread per rotated pair, then (fake_quant_fp8) a thread
// per block of 32, then (codes) a thread per block of 32 quantizing it as Linear does, then
// (copy_to) the row copied, each step after a barrier.
__global__ void __launch_bounds__(kNormThreads) RmsNormKernel(RmsNormParams a, RmsNormParams b) {
  FLASHD_GRID_BEGIN();
  __shared__ double partial[kNormThreads];
  const bool first = blockIdx.x < a.rows;
  const RmsNormParams p = first ? a : b;
  const int64_t r = first ? blockIdx.x : blockIdx.x - a.rows, dim = p.dim;
  float* row = p.x + r * p.stride;
  NormRow(
      row, dim, p.weight, p.eps,
      [&](int64_t i) { return p.round_input ? c::RoundBf16(row[i]) : row[i]; }, partial);
  if (p.rope_dim > 0) {
    __syncthreads();
    const float position = static_cast<float>(p.positions[r]);
    for (int64_t k = threadIdx.x; k < p.rope_dim / 2; k += kNormThreads) {
      RotatePair(row + dim - p.rope_dim + 2 * k, position * p.freqs[k], false);
    }
  }
  if (p.fake_quant_fp8) {
    __syncthreads();
    for (int64_t b = threadIdx.x; b < dim / 32; b += kNormThreads) {
      FakeQuantBlock(row + 32 * b, 32, static_cast<int>(FakeQuantFormat::kFp8E8M0));
    }
  }
  if (p.codes != nullptr) {
    QuantizeRow(row, dim, p.codes + r * dim, p.code_scales + r * (dim / 32));
  }
  if (p.copy_to != nullptr && p.copy_rows[r] >= 0) {
    __syncthreads();  // Every step's values written.
    float* to = p.copy_to + p.copy_rows[r] * dim;
    // A 32-bit index (a row's values are few): with a 64-bit one ptxas spills a register here.
    for (unsigned i = threadIdx.x; i < static_cast<unsigned>(dim); i += kNormThreads)
      to[i] = row[i];
  }
}

__global__ void RopeKernel(float* x, int64_t rows, int64_t heads, int64_t head_dim,
                           int64_t rope_dim, int64_t row_stride, const int64_t* positions,
                           const float* freqs, bool inverse) {
  FLASHD_GRID_BEGIN();
  const int64_t pairs = rope_dim / 2;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * heads * pairs) return;
  const int64_t r = i / (heads * pairs), h = (i / pairs) % heads, k = i % pairs;
  RotatePair(x + r * row_stride + h * head_dim + head_dim - rope_dim + 2 * k,
             static_cast<float>(positions[r]) * freqs[k], inverse);
}

// Rope then FakeQuant of each head (RopeParams::fake_quant_block): a thread block a row, a thread
// per rotated pair, then after a barrier a thread per block.
__global__ void __launch_bounds__(kNormThreads) RopeQuantKernel(RopeParams p) {
  FLASHD_GRID_BEGIN();
  // 32-bit indices within the row (a row's values are few).
  const unsigned pairs = static_cast<unsigned>(p.rope_dim / 2);
  const unsigned heads = static_cast<unsigned>(p.heads), hd = static_cast<unsigned>(p.head_dim);
  float* row = p.x + static_cast<int64_t>(blockIdx.x) * p.row_stride;
  const float position = static_cast<float>(p.positions[blockIdx.x]);
  for (unsigned i = threadIdx.x; i < heads * pairs; i += kNormThreads) {
    const unsigned h = i / pairs, k = i % pairs;
    RotatePair(row + h * hd + hd - static_cast<unsigned>(p.rope_dim) + 2 * k, position * p.freqs[k],
               p.inverse);
  }
  __syncthreads();
  const unsigned block = static_cast<unsigned>(p.fake_quant_block), blocks = hd / block;
  for (unsigned i = threadIdx.x; i < heads * blocks; i += kNormThreads) {
    FakeQuantBlock(row + i / blocks * hd + i % blocks * block, block,
                   static_cast<int>(p.fake_quant_format));
  }
}

}  // namespace

OpStatus RmsNorm(const RmsNormParams& p) {
  if (const OpStatus s = RmsNormFits(p); s != OpStatus::kOk) return s;
  // Both norms' rows in one launch, the next's thread blocks after this op's.
  RmsNormParams a = p, b = p.next != nullptr ? *p.next : RmsNormParams{};
  a.next = b.next = nullptr;
  const int64_t rows = a.rows + b.rows;
  if (rows == 0) return OpStatus::kOk;
  if (rows > int64_t{0x7FFFFFFF}) return OpStatus::kBadShape;  // The grid's limit.
  FLASHD_LAUNCH(RmsNormKernel, static_cast<unsigned>(rows), kNormThreads, 0,
                static_cast<gpuStream_t>(p.stream), a, b);
  return gpuGetLastError() == gpuSuccess ? OpStatus::kOk : OpStatus::kDeviceError;
}

OpStatus Rope(const RopeParams& p) {
  if (!RopeFits(p)) return OpStatus::kBadShape;
  const int64_t n = p.rows * p.heads * (p.rope_dim / 2);
  if (n == 0) return OpStatus::kOk;
  if (p.fake_quant_block > 0) {  // The rows' rotations and their heads' quantizers, one launch.
    // The grid's limit, and the kernel's 32-bit indices within a row.
    if (p.rows > int64_t{0x7FFFFFFF} || p.heads * p.head_dim > int64_t{0x7FFFFFFF}) {
      return OpStatus::kBadShape;
    }
    RopeParams d = p;
    d.stream = nullptr;
    FLASHD_LAUNCH(RopeQuantKernel, static_cast<unsigned>(p.rows), kNormThreads, 0,
                  static_cast<gpuStream_t>(p.stream), d);
    return gpuGetLastError() == gpuSuccess ? OpStatus::kOk : OpStatus::kDeviceError;
  }
  const unsigned threads = 256;
  FLASHD_LAUNCH(RopeKernel, static_cast<unsigned>((n + threads - 1) / threads), threads, 0,
                static_cast<gpuStream_t>(p.stream), p.x, p.rows, p.heads, p.head_dim, p.rope_dim,
                p.row_stride, p.positions, p.freqs, p.inverse);
  return gpuGetLastError() == gpuSuccess ? OpStatus::kOk : OpStatus::kDeviceError;
}

}  // namespace flashd::kernels::FLASHD_GPU_BACKEND
