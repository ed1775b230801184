// Engram on the device: the gather of each token's FP8 n-gram rows (one thread per value, exact)
// and the gate (one thread per token and copy: the double sums in the CPU's order and the CPU's
// sigmoid, kernels/fmath.h: the same bits).
#include <cmath>

#include "kernels/codecs.h"
#include "kernels/fmath.h"
#include "kernels/gpu/ops.h"
#include "kernels/gpu/portability.h"

namespace flashd::kernels::FLASHD_GPU_BACKEND {
namespace {

namespace c = flashd::kernels::codecs;
namespace fm = flashd::kernels::fmath;
constexpr unsigned kThreads = 256;

__global__ void GatherKernel(const uint8_t* table, const uint8_t* scales, const int64_t* row_ids,
                             int64_t tokens, int64_t columns, int64_t head_dim, int64_t row_stride,
                             int64_t column0, float* out) {
  FLASHD_GRID_BEGIN();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= tokens * columns * head_dim) return;
  const int64_t t = i / (columns * head_dim), col = (i / head_dim) % columns, d = i % head_dim;
  const int64_t row = row_ids[t * row_stride + column0 + col];
  const float v = c::E4M3ToFloat(table[row * head_dim + d]) *
                  c::E8M0ToFloat(scales[row * head_dim / 32 + d / 32]);
  out[i] = c::RoundBf16(v);
}

__global__ void GateKernel(float* X, const float* kv, const float* qk, int64_t tokens, int64_t hc,
                           int64_t dim, float eps) {
  FLASHD_GRID_BEGIN();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= tokens * hc) return;
  const int64_t t = i / hc, h = i % hc;
  const float* value = kv + (t * (hc + 1) + hc) * dim;
  float* stream = X + (t * hc + h) * dim;
  const float* key = kv + (t * (hc + 1) + h) * dim;
  double s2 = 0, k2 = 0, dot = 0;
  for (int64_t d = 0; d < dim; ++d) {
    s2 += static_cast<double>(stream[d]) * stream[d];
    k2 += static_cast<double>(key[d]) * key[d];
    dot += static_cast<double>(stream[d] * qk[h * dim + d] * key[d]);
  }
  const float rstd = (1.0f / sqrtf(static_cast<float>(s2 / dim) + eps)) *
                     (1.0f / sqrtf(static_cast<float>(k2 / dim) + eps));
  const float g = static_cast<float>(dot) * rstd / sqrtf(static_cast<float>(dim));
  const float root = sqrtf(fmaxf(fabsf(g), 1e-6f));
  const float gate = fm::Sigmoid(copysignf(root, g));
  for (int64_t d = 0; d < dim; ++d) stream[d] = c::RoundBf16(stream[d] + gate * value[d]);
}

unsigned Blocks(int64_t n) { return static_cast<unsigned>((n + kThreads - 1) / kThreads); }

}  // namespace

OpStatus EngramGather(const EngramGatherParams& p) {
  if (p.tokens < 0 || p.columns <= 0 || p.head_dim <= 0 || p.head_dim % 32 != 0 ||
      p.column0 + p.columns > p.row_stride) {
    return OpStatus::kBadShape;
  }
  const int64_t n = p.tokens * p.columns * p.head_dim;
  if (n == 0) return OpStatus::kOk;
  FLASHD_LAUNCH(GatherKernel, Blocks(n), kThreads, 0, static_cast<gpuStream_t>(p.stream), p.table,
                p.table_scales, p.row_ids, p.tokens, p.columns, p.head_dim, p.row_stride, p.column0,
                p.out);
  return gpuGetLastError() == gpuSuccess ? OpStatus::kOk : OpStatus::kDeviceError;
}

OpStatus EngramGate(const EngramGateParams& p) {
  if (p.tokens < 0 || p.hc <= 0 || p.dim <= 0) return OpStatus::kBadShape;
  const int64_t n = p.tokens * p.hc;
  if (n == 0) return OpStatus::kOk;
  FLASHD_LAUNCH(GateKernel, Blocks(n), kThreads, 0, static_cast<gpuStream_t>(p.stream), p.X, p.kv,
                p.qk, p.tokens, p.hc, p.dim, p.eps);
  return gpuGetLastError() == gpuSuccess ? OpStatus::kOk : OpStatus::kDeviceError;
}

}  // namespace flashd::kernels::FLASHD_GPU_BACKEND
