// RMSNorm of one row by a thread block, shared by RmsNorm and the mHC collapse's fused norm; and
// the steps RmsNorm may take after it (the window keys'), one rotated pair and one fake-quantized
// block, shared with the Rope and FakeQuant kernels (and the rotation with the attention's sums).
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels/codecs.h"
#include "kernels/fmath.h"
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

// The sine (negated when inverse) and cosine of a pair's angle, with kernels/fmath.h's.
__device__ inline void PairSinCos(float angle, bool inverse, float* sn, float* cs) {
  fmath::SinCos(angle, sn, cs);
  if (inverse) *sn = -*sn;
}

// One value of the pair (a, b) rotated (PairSinCos's sn, cs), rounded to BF16: the first's
// (second false) or the second's. Rope's step; a kernel whose threads hold one value of a pair
// each calls it on both.
__device__ inline float RotatedValue(float a, float b, float sn, float cs, bool second) {
  return codecs::RoundBf16(second ? a * sn + b * cs : a * cs - b * sn);
}

// The pair v[0], v[1] rotated in place by `angle` (negated when inverse).
__device__ inline void RotatePair(float* v, float angle, bool inverse) {
  float sn, cs;
  PairSinCos(angle, inverse, &sn, &cs);
  const float a = v[0], b = v[1];
  v[0] = RotatedValue(a, b, sn, cs, false);
  v[1] = RotatedValue(a, b, sn, cs, true);
}

// One block of `block` values through FakeQuant's `format` (FakeQuantFormat's value), in place.
__device__ inline void FakeQuantBlock(float* xb, int64_t block, int format) {
  namespace c = codecs;
  float amax = 0.0f;
  for (int64_t i = 0; i < block; ++i) amax = fmaxf(amax, fabsf(xb[i]));
  float s;
  if (format == static_cast<int>(FakeQuantFormat::kFp8E8M0)) {
    s = c::Pow2Ceil(fmaxf(amax, 1e-4f) * (1.0f / 448.0f));
  } else if (format == static_cast<int>(FakeQuantFormat::kFp4E8M0)) {
    s = c::Pow2Ceil(fmaxf(amax, 6.0f * 0x1p-126f) * (1.0f / 6.0f));
  } else {
    s = c::E4M3ToFloat(c::FloatToE4M3(fminf(fmaxf(amax, 6.0f * 0x1p-9f) / 6.0f, 448.0f)));
  }
  for (int64_t i = 0; i < block; ++i) {
    const float v = xb[i] / s;
    const float r = format == static_cast<int>(FakeQuantFormat::kFp8E8M0)
                        ? c::E4M3ToFloat(c::FloatToE4M3(c::Clamp(v, -448.0f, 448.0f)))
                        : c::E2M1ToFloat(c::FloatToE2M1(c::Clamp(v, -6.0f, 6.0f)));
    xb[i] = r * s;
  }
}

}  // namespace flashd::kernels::FLASHD_GPU_BACKEND
