// RMSNorm and RoPE on the device. RMSNorm: one block per row, the sum of squares in double in the
// CPU's lanes and fixed tree (so a row's result never depends on the batch), then the same fp32
// scale and BF16 rounding as the CPU. RoPE: one thread per rotated pair, the angle an fp32 product
// as on the CPU, its sine and cosine kernels/fmath.h's.
#include <cmath>

#include "kernels/codecs.h"
#include "kernels/fmath.h"
#include "kernels/gpu/norm_row.h"
#include "kernels/gpu/ops.h"
#include "kernels/gpu/portability.h"

namespace flashd::kernels::FLASHD_GPU_BACKEND {
namespace {

namespace c = flashd::kernels::codecs;
namespace fm = flashd::kernels::fmath;
__global__ void __launch_bounds__(kNormThreads)
    RmsNormKernel(float* x, int64_t dim, int64_t stride, const float* weight, float eps,
                  bool round_input) {
  __shared__ double partial[kNormThreads];
  float* row = x + static_cast<int64_t>(blockIdx.x) * stride;
  NormRow(
      row, dim, weight, eps, [&](int64_t i) { return round_input ? c::RoundBf16(row[i]) : row[i]; },
      partial);
}

__global__ void RopeKernel(float* x, int64_t rows, int64_t heads, int64_t head_dim,
                           int64_t rope_dim, int64_t row_stride, const int64_t* positions,
                           const float* freqs, bool inverse) {
  const int64_t pairs = rope_dim / 2;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * heads * pairs) return;
  const int64_t r = i / (heads * pairs), h = (i / pairs) % heads, k = i % pairs;
  float* v = x + r * row_stride + h * head_dim + head_dim - rope_dim + 2 * k;
  const float angle = static_cast<float>(positions[r]) * freqs[k];
  float sn, cs;
  fm::SinCos(angle, &sn, &cs);
  if (inverse) sn = -sn;
  const float a = v[0], b = v[1];
  v[0] = c::RoundBf16(a * cs - b * sn);
  v[1] = c::RoundBf16(a * sn + b * cs);
}

}  // namespace

OpStatus RmsNorm(const RmsNormParams& p) {
  if (p.rows < 0 || p.dim <= 0 || p.stride < p.dim || p.weight == nullptr) {
    return OpStatus::kBadShape;
  }
  if (p.rows == 0) return OpStatus::kOk;
  FLASHD_LAUNCH(RmsNormKernel, static_cast<unsigned>(p.rows), kNormThreads, 0,
                static_cast<gpuStream_t>(p.stream), p.x, p.dim, p.stride, p.weight, p.eps,
                p.round_input);
  return gpuGetLastError() == gpuSuccess ? OpStatus::kOk : OpStatus::kDeviceError;
}

OpStatus Rope(const RopeParams& p) {
  if (p.rows < 0 || p.heads <= 0 || p.rope_dim <= 0 || p.rope_dim % 2 != 0 ||
      p.rope_dim > p.head_dim || p.row_stride < p.heads * p.head_dim || p.positions == nullptr ||
      p.freqs == nullptr) {
    return OpStatus::kBadShape;
  }
  const int64_t n = p.rows * p.heads * (p.rope_dim / 2);
  if (n == 0) return OpStatus::kOk;
  const unsigned threads = 256;
  FLASHD_LAUNCH(RopeKernel, static_cast<unsigned>((n + threads - 1) / threads), threads, 0,
                static_cast<gpuStream_t>(p.stream), p.x, p.rows, p.heads, p.head_dim, p.rope_dim,
                p.row_stride, p.positions, p.freqs, p.inverse);
  return gpuGetLastError() == gpuSuccess ? OpStatus::kOk : OpStatus::kDeviceError;
}

}  // namespace flashd::kernels::FLASHD_GPU_BACKEND
