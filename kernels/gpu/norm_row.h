// RMSNorm of one row by a thread block, shared by RmsNorm and the mHC collapse's fused norm.
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels/codecs.h"
#include "kernels/gpu/portability.h"
#include "kernels/ops.h"

namespace flashd::kernels::FLASHD_GPU_BACKEND {

// The thread block RMSNorm takes: the sum of squares in LaneSum's order (kernels/cpu/scalar.h),
// a lane a thread, then the fixed tree.
constexpr unsigned kNormThreads = static_cast<unsigned>(kHcMixLanes);

// Row `row` of `dim` values made by value(i) (thread l makes i = l, l + kNormThreads, ... in
// order, and writes each to row[i]), then normalized in place: the squares summed in double in
// the lanes and the tree, scale = 1 / sqrt(mean + eps) in fp32, row[i] = BF16(weight[i] * (row[i]
// * scale)), as the CPU's. `partial`: kNormThreads doubles of shared memory. REQUIRES: a thread
// block of kNormThreads threads, all calling it.
template <class Value>
__device__ void NormRow(float* row, int64_t dim, const float* weight, float eps, Value value,
                        double* partial) {
  const unsigned l = threadIdx.x;
  double sum = 0;
  for (int64_t i = l; i < dim; i += kNormThreads) {
    const float v = value(i);
    row[i] = v;
    sum += static_cast<double>(v) * v;
  }
  partial[l] = sum;
  __syncthreads();
  for (unsigned half = kNormThreads / 2; half > 0; half /= 2) {
    if (l < half) partial[l] += partial[l + half];
    __syncthreads();
  }
  const float scale = 1.0f / sqrtf(static_cast<float>(partial[0] / dim) + eps);
  for (int64_t i = l; i < dim; i += kNormThreads) {
    row[i] = codecs::RoundBf16(weight[i] * (row[i] * scale));
  }
}

}  // namespace flashd::kernels::FLASHD_GPU_BACKEND
