// The scalar steps the CPU ops share: rounding to BF16 (the reference keeps activations in BF16
// between ops) and the logistic function, both as the reference computes them in fp32.
#pragma once

#include <cmath>

#include "kernels/cpu/formats.h"

namespace flashd::kernels::cpu {

inline float Bf(float x) { return Bf16ToFloat(FloatToBf16(x)); }
inline float Sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

}  // namespace flashd::kernels::cpu
