#include "kernels/cpu/scale_add.h"

namespace flashd::kernels::cpu {

void ScaleAdd(const float* x, float a, float b, float* y, size_t n) {
  for (size_t i = 0; i < n; ++i) y[i] = a * x[i] + b;
}

}  // namespace flashd::kernels::cpu
