// mHC's collapse and expansion on the device: one thread per output value, the copies summed in
// the CPU reference's order, so results are equal bit for bit (the collapse's optional norm is
// RmsNorm's).
#include "kernels/gpu/codecs.h"
#include "kernels/gpu/ops.h"
#include "kernels/gpu/portability.h"

namespace flashd::kernels::FLASHD_GPU_BACKEND {
namespace {

namespace c = flashd::kernels::gpu_codecs;
constexpr unsigned kThreads = 256;

__global__ void CollapseKernel(const float* X, const float* weights, int64_t rows, int64_t hc,
                               int64_t dim, float* x) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * dim) return;
  const int64_t t = i / dim, d = i % dim;
  float acc = 0;
  for (int64_t h = 0; h < hc; ++h) acc += weights[t * hc + h] * X[(t * hc + h) * dim + d];
  x[i] = c::RoundBf16(acc);
}

__global__ void ExpandKernel(const float* X, const float* sub, const float* post, const float* comb,
                             int64_t rows, int64_t hc, int64_t dim, float* out) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * hc * dim) return;
  const int64_t t = i / (hc * dim), j = (i / dim) % hc, d = i % dim;
  const float acc = post[t * hc + j] * sub[t * dim + d];
  float mixed = 0;
  for (int64_t k = 0; k < hc; ++k) mixed += comb[(t * hc + k) * hc + j] * X[(t * hc + k) * dim + d];
  out[i] = c::RoundBf16(acc + mixed);
}

}  // namespace

OpStatus HcCollapse(const HcCollapseParams& p) {
  if (p.rows < 0 || p.hc <= 0 || p.dim <= 0) return OpStatus::kBadShape;
  const int64_t n = p.rows * p.dim;
  if (n == 0) return OpStatus::kOk;
  FLASHD_LAUNCH(CollapseKernel, static_cast<unsigned>((n + kThreads - 1) / kThreads), kThreads, 0,
                static_cast<gpuStream_t>(p.stream), p.X, p.weights, p.rows, p.hc, p.dim, p.x);
  if (gpuGetLastError() != gpuSuccess) return OpStatus::kDeviceError;
  if (p.norm_weight == nullptr) return OpStatus::kOk;
  return RmsNorm({.x = p.x,
                  .rows = p.rows,
                  .dim = p.dim,
                  .stride = p.dim,
                  .weight = p.norm_weight,
                  .eps = p.eps,
                  .stream = p.stream});
}

OpStatus HcExpand(const HcExpandParams& p) {
  if (p.rows < 0 || p.hc <= 0 || p.dim <= 0 || p.out == p.X) return OpStatus::kBadShape;
  const int64_t n = p.rows * p.hc * p.dim;
  if (n == 0) return OpStatus::kOk;
  FLASHD_LAUNCH(ExpandKernel, static_cast<unsigned>((n + kThreads - 1) / kThreads), kThreads, 0,
                static_cast<gpuStream_t>(p.stream), p.X, p.sub, p.post, p.comb, p.rows, p.hc, p.dim,
                p.out);
  return gpuGetLastError() == gpuSuccess ? OpStatus::kOk : OpStatus::kDeviceError;
}

}  // namespace flashd::kernels::FLASHD_GPU_BACKEND
