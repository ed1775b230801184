// mHC on the device: the mixes' long sums by a thread block of kHcMixLanes threads each, in the
// lanes-and-tree order HcMixParams fixes (so equal to the CPU's bit for bit); the collapse and
// expansion one thread per output value, the copies summed in the CPU reference's order (the
// collapse's optional norm is RmsNorm's, in the same kernel); for a decode step, the expansion,
// mixes and collapse between two sublayers in one kernel (HcStepsKernel).
#include <cmath>

#include "kernels/codecs.h"
#include "kernels/fmath.h"
#include "kernels/gpu/arrive.h"
#include "kernels/gpu/norm_row.h"
#include "kernels/gpu/ops.h"
#include "kernels/gpu/portability.h"
#include "kernels/gpu/quantized.h"

namespace flashd::kernels::FLASHD_GPU_BACKEND {
namespace {

namespace c = flashd::kernels::codecs;
namespace fm = flashd::kernels::fmath;
constexpr unsigned kThreads = 256;

// Value d of token t's collapse, copy h of its stream being stream(h): the CPU's sum in its order.
template <class Stream>
__device__ float CollapsedValue(const float* weights, int64_t t, int64_t hc, Stream stream) {
  float acc = 0;
  for (int64_t h = 0; h < hc; ++h) acc += weights[t * hc + h] * stream(h);
  return c::RoundBf16(acc);
}

__global__ void CollapseKernel(const float* X, const float* weights, int64_t rows, int64_t hc,
                               int64_t dim, float* x) {
  FLASHD_GRID_BEGIN();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * dim) return;
  const int64_t t = i / dim, d = i % dim;
  x[i] = CollapsedValue(weights, t, hc, [&](int64_t h) { return X[(t * hc + h) * dim + d]; });
}

// The collapse and its norm, a thread block a row: each thread makes the outputs that are its
// lane of the norm's sum (NormRow), so the row is made and normalized in one kernel.
__global__ void __launch_bounds__(kNormThreads)
    CollapseNormKernel(const float* X, const float* weights, int64_t hc, int64_t dim,
                       const float* norm_weight, float eps, float* x, uint8_t* codes,
                       uint8_t* code_scales) {
  FLASHD_GRID_BEGIN();
  __shared__ double partial[kNormThreads];
  const int64_t t = blockIdx.x;
  const auto value = [&](int64_t d) {
    return CollapsedValue(weights, t, hc, [&](int64_t h) { return X[(t * hc + h) * dim + d]; });
  };
  NormRow(x + t * dim, dim, norm_weight, eps, value, partial);
  if (codes != nullptr) {
    QuantizeRow(x + t * dim, dim, codes + t * dim, code_scales + t * (dim / 32));
  }
}

// Value (j, d) of token t's expanded stream: the CPU's steps in its order.
__device__ inline float ExpandedValue(const float* X, const float* sub, const float* post,
                                      const float* comb, int64_t t, int64_t hc, int64_t dim,
                                      int64_t j, int64_t d) {
  const float acc = post[t * hc + j] * sub[t * dim + d];
  float mixed = 0;
  for (int64_t k = 0; k < hc; ++k) mixed += comb[(t * hc + k) * hc + j] * X[(t * hc + k) * dim + d];
  return c::RoundBf16(acc + mixed);
}

__global__ void ExpandKernel(const float* X, const float* sub, const float* post, const float* comb,
                             int64_t rows, int64_t hc, int64_t dim, float* out) {
  FLASHD_GRID_BEGIN();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * hc * dim) return;
  const int64_t t = i / (hc * dim), j = (i / dim) % hc, d = i % dim;
  out[i] = ExpandedValue(X, sub, post, comb, t, hc, dim, j, d);
}

// pre, post and the Sinkhorn-normalised comb from one row of mixes: the CPU's steps in its order,
// by one thread (hc past what a thread block's threads split between them; not the model's).
__device__ void HcSplit(const float* mixes, const float* scale, const float* base, int64_t hc,
                        int iters, float eps, float* pre, float* post, float* comb) {
  for (int64_t i = 0; i < hc; ++i) {
    pre[i] = fm::Sigmoid(mixes[i] * scale[0] + base[i]) + eps;
    post[i] = 2.0f * fm::Sigmoid(mixes[hc + i] * scale[1] + base[hc + i]);
  }
  for (int64_t i = 0; i < hc; ++i) {
    float row_max = -INFINITY;
    for (int64_t j = 0; j < hc; ++j) {
      comb[i * hc + j] = mixes[2 * hc + i * hc + j] * scale[2] + base[2 * hc + i * hc + j];
      row_max = fmaxf(row_max, comb[i * hc + j]);
    }
    float sum = 0;
    for (int64_t j = 0; j < hc; ++j)
      sum += (comb[i * hc + j] = fm::Exp(comb[i * hc + j] - row_max));
    for (int64_t j = 0; j < hc; ++j) comb[i * hc + j] = comb[i * hc + j] / sum + eps;
  }
  for (int it = 0; it < iters; ++it) {
    if (it > 0) {
      for (int64_t i = 0; i < hc; ++i) {
        float sum = 0;
        for (int64_t j = 0; j < hc; ++j) sum += comb[i * hc + j];
        for (int64_t j = 0; j < hc; ++j) comb[i * hc + j] /= sum + eps;
      }
    }
    for (int64_t j = 0; j < hc; ++j) {
      float sum = 0;
      for (int64_t i = 0; i < hc; ++i) sum += comb[i * hc + j];
      for (int64_t i = 0; i < hc; ++i) comb[i * hc + j] /= sum + eps;
    }
  }
}

// The same split by the thread block: a thread per pre and post value and per comb element (i, j)
// (thread i * hc + j), each doing that value's operations of HcSplit in its order; a row's or a
// column's sum is read from shared memory in order by each of its threads, the comb passing
// between two buffers, so a pass is one barrier. `m` (shared) holds the row's scaled mixes.
// REQUIRES: (2 + hc) * hc <= kHcMixLanes.
__device__ void HcSplitByThreads(const float* m, const float* scale, const float* base, int64_t hc,
                                 int iters, float eps, float* pre, float* post, float* comb,
                                 float (*buf)[kHcMixLanes]) {
  const int64_t tid = threadIdx.x, i = tid / hc, j = tid % hc;
  const bool mine = tid < hc * hc;
  if (tid < hc) {
    pre[tid] = fm::Sigmoid(m[tid] * scale[0] + base[tid]) + eps;
    post[tid] = 2.0f * fm::Sigmoid(m[hc + tid] * scale[1] + base[hc + tid]);
  }
  float v = 0;
  if (mine) buf[0][tid] = v = m[2 * hc + tid] * scale[2] + base[2 * hc + tid];
  __syncthreads();
  if (mine) {
    float row_max = -INFINITY;
    for (int64_t k = 0; k < hc; ++k) row_max = fmaxf(row_max, buf[0][i * hc + k]);
    buf[1][tid] = v = fm::Exp(v - row_max);
  }
  __syncthreads();
  if (mine) {
    float sum = 0;
    for (int64_t k = 0; k < hc; ++k) sum += buf[1][i * hc + k];
    buf[0][tid] = v = v / sum + eps;
  }
  __syncthreads();
  int now = 0;  // The buffer holding the comb.
  // A pass: each value divided by its row's sum (from element i * hc, step 1) or its column's
  // (from j, step hc) + eps, the sum taken in order.
  const auto pass = [&](int64_t first, int64_t step) {
    if (mine) {
      float sum = 0;
      for (int64_t k = 0; k < hc; ++k) sum += buf[now][first + k * step];
      buf[now ^ 1][tid] = v /= sum + eps;
    }
    __syncthreads();
    now ^= 1;
  };
  for (int it = 0; it < iters; ++it) {
    if (it > 0) pass(i * hc, 1);
    pass(j, hc);
  }
  if (mine) comb[tid] = v;
}

// HcMixParams' order for a sum of `n` terms term(i), by the thread block's kHcMixLanes threads:
// thread l's lane, then the fixed tree through `lanes` (shared). Every thread gets the sum.
template <class T, class Term>
__device__ T LaneSum(int64_t n, Term term, T* lanes) {
  const int64_t l = threadIdx.x;
  T acc = 0;
  int64_t i = l;
  // Forty terms' loads in flight (a thread block per sum: its loads are all the memory traffic
  // an SM has; the model's 20,480 terms are 80 a lane, two rounds), added in order. The kernels
  // ask for one thread block an SM (__launch_bounds__), so ptxas issues all forty before the
  // first add (asked for more, it kept about nine in flight).
  constexpr int kAhead = 40;
  for (; i + (kAhead - 1) * kHcMixLanes < n; i += kAhead * kHcMixLanes) {
    T v[kAhead];
    FLASHD_UNROLL
    for (int u = 0; u < kAhead; ++u) v[u] = term(i + u * kHcMixLanes);
    FLASHD_UNROLL
    for (int u = 0; u < kAhead; ++u) acc += v[u];
  }
  for (; i < n; i += kHcMixLanes) acc += term(i);
  lanes[l] = acc;
  for (int64_t s = kHcMixLanes / 2; s >= 1; s /= 2) {
    __syncthreads();
    if (l < s) lanes[l] += lanes[l + s];
  }
  __syncthreads();
  const T sum = lanes[0];
  __syncthreads();  // lanes may be reused.
  return sum;
}

// Thread block (token t, mix j): the unscaled mix, flatten(X[t]) . fn[j].
__global__ void __launch_bounds__(kHcMixLanes, 1)
    HcDotKernel(const float* X, const float* fn, int64_t width, int64_t mix, float* mixes) {
  FLASHD_GRID_BEGIN();
  __shared__ float lanes[kHcMixLanes];
  const int64_t t = blockIdx.x / mix, j = blockIdx.x % mix;
  const float* x = X + t * width;
  const float* w = fn + j * width;
  const float sum = LaneSum<float>(
      width, [&](int64_t i) { return x[i] * w[i]; }, lanes);
  if (threadIdx.x == 0) mixes[blockIdx.x] = sum;
}

// Token t's mixes scaled by the norm of its stream (`sum` its double sum of squares), then split
// (by the thread block where its threads cover the values, as for the model's 4 copies; else by
// one thread). The mixes are read as volatile: other thread blocks of the kernel may have written
// them. REQUIRES: a thread block of kHcMixLanes threads, all calling it.
FLASHD_SHARED_TILE __device__ void ScaleAndSplit(int64_t t, double sum, int64_t hc, int64_t dim,
                                                 const float* scale, const float* base, int iters,
                                                 float hc_eps, float norm_eps, float* mixes,
                                                 float* pre, float* post, float* comb) {
  __shared__ float m[kHcMixLanes], buf[2][kHcMixLanes];
  const int64_t width = hc * dim, mix = (2 + hc) * hc;
  volatile float* row = mixes + t * mix;
  const float r = 1.0f / sqrtf(static_cast<float>(sum / width) + norm_eps);
  if (mix <= kHcMixLanes) {
    const int64_t tid = threadIdx.x;
    if (tid < mix) row[tid] = m[tid] = row[tid] * r;
    __syncthreads();
    HcSplitByThreads(m, scale, base, hc, iters, hc_eps, pre + t * hc, post + t * hc,
                     comb + t * hc * hc, buf);
    return;
  }
  if (threadIdx.x != 0) return;
  for (int64_t j = 0; j < mix; ++j) row[j] = row[j] * r;
  HcSplit(mixes + t * mix, scale, base, hc, iters, hc_eps, pre + t * hc, post + t * hc,
          comb + t * hc * hc);
}

// Thread block per token: the norm of the flattened stream (a double sum of squares), then the
// scaled mixes' split.
__global__ void __launch_bounds__(kHcMixLanes, 1)
    MixSplitKernel(const float* X, int64_t hc, int64_t dim, const float* scale, const float* base,
                   int iters, float hc_eps, float norm_eps, float* mixes, float* pre, float* post,
                   float* comb) {
  FLASHD_GRID_BEGIN();
  __shared__ double lanes[kHcMixLanes];
  const int64_t t = blockIdx.x;
  const float* x = X + t * hc * dim;
  const double sum = LaneSum<double>(
      hc * dim, [&](int64_t i) { return static_cast<double>(x[i]) * x[i]; }, lanes);
  ScaleAndSplit(t, sum, hc, dim, scale, base, iters, hc_eps, norm_eps, mixes, pre, post, comb);
}

// HcMix's steps in one kernel (kernels/gpu/ops.h, HcMixFused): mix + 2 thread blocks a token,
// blocks j < mix making mix j, block mix the sum of squares (and the expanded stream's values),
// block mix + 1 the collapse; each counts itself in arrivals[t] when done, and the last scales and
// splits the mixes (every input read by then: pre, post and comb may alias inputs) and clears
// the count.
template <bool kExpand>
__global__ void __launch_bounds__(kHcMixLanes, 1)
    HcStepsKernel(HcMixParams p, unsigned* arrivals, double* sums) {
  FLASHD_GRID_BEGIN();
  __shared__ double dlanes[kHcMixLanes];
  __shared__ float flanes[kHcMixLanes];
  const int64_t hc = p.hc, dim = p.dim, width = hc * dim, mix = (2 + hc) * hc;
  const int64_t t = blockIdx.x / (mix + 2), role = blockIdx.x % (mix + 2);
  // Value (h, d) of the token's stream, expanded from X when kExpand.
  const auto value = [&](int64_t h, int64_t d) {
    if constexpr (kExpand) {
      return ExpandedValue(p.X, p.sub, p.expand_post, p.expand_comb, t, hc, dim, h, d);
    } else {
      return p.X[(t * hc + h) * dim + d];
    }
  };
  // Element i of the flattened stream (a width under 2^31: 32-bit division).
  const auto element = [&](int64_t i) {
    const uint32_t h = static_cast<uint32_t>(i) / static_cast<uint32_t>(dim);
    return value(h, static_cast<uint32_t>(i) - h * static_cast<uint32_t>(dim));
  };
  if (role < mix) {
    const float* w = p.fn + role * width;
    const float sum = LaneSum<float>(
        width, [&](int64_t i) { return element(i) * w[i]; }, flanes);
    if (threadIdx.x == 0) p.mixes[t * mix + role] = sum;
  } else if (role == mix) {
    float* out = kExpand ? p.expanded + t * width : nullptr;
    const double sum = LaneSum<double>(
        width,
        [&](int64_t i) {
          const float v = element(i);
          if constexpr (kExpand) out[i] = v;
          return static_cast<double>(v) * v;
        },
        dlanes);
    if (threadIdx.x == 0) sums[t] = sum;
  } else if (p.x != nullptr) {
    const auto collapsed = [&](int64_t d) {
      return CollapsedValue(p.collapse_weights, t, hc, [&](int64_t h) { return value(h, d); });
    };
    if (p.collapse_norm != nullptr) {
      NormRow(p.x + t * dim, dim, p.collapse_norm, p.collapse_eps, collapsed, dlanes);
    } else {
      for (int64_t d = threadIdx.x; d < dim; d += kHcMixLanes) p.x[t * dim + d] = collapsed(d);
    }
    if (p.x_codes != nullptr) {
      QuantizeRow(p.x + t * dim, dim, p.x_codes + t * dim, p.x_code_scales + t * (dim / 32));
    }
  }
  if (!LastToArrive(&arrivals[t], static_cast<unsigned>(mix + 2))) return;
  const double sum = *static_cast<volatile double*>(sums + t);
  ScaleAndSplit(t, sum, hc, dim, p.scale, p.base, p.iters, p.hc_eps, p.norm_eps, p.mixes, p.pre,
                p.post, p.comb);
  if (threadIdx.x == 0) arrivals[t] = 0;
}

}  // namespace

OpStatus HcMix(const HcMixParams& p, const HcMixFused* fused) {
  if (p.rows < 0 || p.hc <= 0 || p.dim <= 0 || p.iters < 1) return OpStatus::kBadShape;
  if (const OpStatus s = HcStepsFit(p); s != OpStatus::kOk) return s;
  if (p.rows == 0) return OpStatus::kOk;
  const int64_t width = p.hc * p.dim, mix = (2 + p.hc) * p.hc;
  if (p.rows * (mix + 2) > int64_t{0x7FFFFFFF}) return OpStatus::kBadShape;
  const gpuStream_t stream = static_cast<gpuStream_t>(p.stream);
  if (fused != nullptr && fused->arrivals != nullptr && fused->sums != nullptr &&
      p.rows <= kHcFusedRows && width <= int64_t{0x7FFFFFFF}) {
    HcMixParams d = p;
    d.stream = nullptr;
    const unsigned grid = static_cast<unsigned>(p.rows * (mix + 2));
    if (p.sub != nullptr) {
      FLASHD_LAUNCH(HcStepsKernel<true>, grid, kHcMixLanes, 0, stream, d, fused->arrivals,
                    fused->sums);
    } else {
      FLASHD_LAUNCH(HcStepsKernel<false>, grid, kHcMixLanes, 0, stream, d, fused->arrivals,
                    fused->sums);
    }
    return gpuGetLastError() == gpuSuccess ? OpStatus::kOk : OpStatus::kDeviceError;
  }
  // A kernel a step.
  const float* X = nullptr;
  const OpStatus steps = HcStepsApart(
      p, [](const HcExpandParams& q) { return HcExpand(q); },
      [](const HcCollapseParams& q) { return HcCollapse(q); }, &X);
  if (steps != OpStatus::kOk) return steps;
  FLASHD_LAUNCH(HcDotKernel, static_cast<unsigned>(p.rows * mix), kHcMixLanes, 0, stream, X, p.fn,
                width, mix, p.mixes);
  FLASHD_LAUNCH(MixSplitKernel, static_cast<unsigned>(p.rows), kHcMixLanes, 0, stream, X, p.hc,
                p.dim, p.scale, p.base, p.iters, p.hc_eps, p.norm_eps, p.mixes, p.pre, p.post,
                p.comb);
  return gpuGetLastError() == gpuSuccess ? OpStatus::kOk : OpStatus::kDeviceError;
}

OpStatus HcCollapse(const HcCollapseParams& p) {
  if (p.rows < 0 || p.hc <= 0 || p.dim <= 0) return OpStatus::kBadShape;
  if (const OpStatus s = RowCodesFit(p.codes, p.code_scales, p.dim); s != OpStatus::kOk) return s;
  const int64_t n = p.rows * p.dim;
  if (n == 0) return OpStatus::kOk;
  const gpuStream_t stream = static_cast<gpuStream_t>(p.stream);
  if (p.norm_weight != nullptr) {
    if (p.rows > int64_t{0x7FFFFFFF}) return OpStatus::kBadShape;  // The grid's limit.
    FLASHD_LAUNCH(CollapseNormKernel, static_cast<unsigned>(p.rows), kNormThreads, 0, stream, p.X,
                  p.weights, p.hc, p.dim, p.norm_weight, p.eps, p.x, p.codes, p.code_scales);
  } else {
    FLASHD_LAUNCH(CollapseKernel, static_cast<unsigned>((n + kThreads - 1) / kThreads), kThreads, 0,
                  stream, p.X, p.weights, p.rows, p.hc, p.dim, p.x);
    // The codes by the activations' quantizer (no thread block holds a row here).
    if (p.codes != nullptr) QuantizeActivations(p.x, n / 32, p.codes, p.code_scales, stream);
  }
  return gpuGetLastError() == gpuSuccess ? OpStatus::kOk : OpStatus::kDeviceError;
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
