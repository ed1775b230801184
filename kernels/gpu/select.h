// Top-k in the total order (value descending, then index ascending, NaN first) for device code:
// the k best picked one after another, each the best of those ranking below the previous one, so
// it needs no memory and equals the CPU's kTotal order exactly.
#pragma once

#include <cstdint>

#include "kernels/ops.h"  // FLASHD_OPS_HD

namespace flashd::kernels::gpu_select {

// True when (a, ia) ranks above (b, ib).
FLASHD_OPS_HD inline bool Above(float a, int64_t ia, float b, int64_t ib) {
  const bool an = a != a, bn = b != b;
  if (an != bn) return an;
  if (!an && a != b) return a > b;
  return ia < ib;
}

FLASHD_OPS_HD inline int64_t SelectTop(const float* v, int64_t n, int64_t k, int64_t* out) {
  k = k < n ? k : n;
  for (int64_t i = 0; i < k; ++i) {
    int64_t best = -1;
    for (int64_t j = 0; j < n; ++j) {
      if (i > 0 && !Above(v[out[i - 1]], out[i - 1], v[j], j)) continue;  // Taken already.
      if (best < 0 || Above(v[j], j, v[best], best)) best = j;
    }
    out[i] = best;
  }
  return k;
}

}  // namespace flashd::kernels::gpu_select
