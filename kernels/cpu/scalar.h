// The scalar steps the CPU ops share: rounding to BF16 (the reference keeps activations in BF16
// between ops), the logistic function (kernels/fmath.h's, the GPU kernels' too), and the lanes
// order of the long sums.
#pragma once

#include <cmath>
#include <cstddef>

#include "kernels/cpu/formats.h"
#include "kernels/fmath.h"

namespace flashd::kernels::cpu {

inline float Bf(float x) { return Bf16ToFloat(FloatToBf16(x)); }
using fmath::Sigmoid;

// The order of HcMixParams' and RmsNormParams' long sums of the n terms term(i): kHcMixLanes
// lanes, each adding its terms in order, met by the fixed tree (a GPU's thread block does the
// same: kernels/gpu/mhc.cu's LaneSum, norm_rope.cu's RmsNormKernel).
template <class T, class Term>
T LaneSum(size_t n, Term term) {
  constexpr size_t kLanes = static_cast<size_t>(kHcMixLanes);
  T lanes[kLanes] = {};
  size_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (size_t l = 0; l < kLanes; ++l) lanes[l] += term(i + l);
  }
  for (size_t l = 0; i + l < n; ++l) lanes[l] += term(i + l);
  for (size_t s = kLanes / 2; s >= 1; s /= 2) {
    for (size_t l = 0; l < s; ++l) lanes[l] += lanes[l + s];
  }
  return lanes[0];
}  // The same bits as every GPU kernel's (kernels/fmath.h).

}  // namespace flashd::kernels::cpu
