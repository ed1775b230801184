// y[i] = a * x[i] + b: the CPU reference for the GPU toolchain check (kernels/gpu/scale_add.cu).
#pragma once

#include <cstddef>

namespace flashd::kernels::cpu {

void ScaleAdd(const float* x, float a, float b, float* y, size_t n);

}  // namespace flashd::kernels::cpu
