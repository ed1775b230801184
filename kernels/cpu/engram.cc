// Engram: the gather of each token's n-gram rows and the gate that adds them to the stream.
#include <algorithm>
#include <cmath>

#include "kernels/cpu/formats.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/scalar.h"

namespace flashd::kernels::cpu {
OpStatus EngramGather(const EngramGatherParams& p) {
  if (p.tokens < 0 || p.columns <= 0 || p.head_dim <= 0 || p.head_dim % 32 != 0 ||
      p.column0 + p.columns > p.row_stride) {
    return OpStatus::kBadShape;
  }
  const size_t hd = static_cast<size_t>(p.head_dim);
  for (int64_t t = 0; t < p.tokens; ++t) {
    for (int64_t col = 0; col < p.columns; ++col) {
      const int64_t row = p.row_ids[t * p.row_stride + p.column0 + col];
      if (row < 0) return OpStatus::kBadArgument;
      float* dst = p.out + (t * p.columns + col) * p.head_dim;
      DequantizeFp8PerBlock(p.table + row * p.head_dim, p.table_scales + row * p.head_dim / 32, hd,
                            32, dst);
      for (size_t d = 0; d < hd; ++d) dst[d] = Bf(dst[d]);
    }
  }
  return OpStatus::kOk;
}

OpStatus EngramGate(const EngramGateParams& p) {
  if (p.tokens < 0 || p.hc <= 0 || p.dim <= 0) return OpStatus::kBadShape;
  const int64_t hc = p.hc, dim = p.dim;
  for (int64_t t = 0; t < p.tokens; ++t) {
    const float* value = p.kv + (t * (hc + 1) + hc) * dim;
    for (int64_t h = 0; h < hc; ++h) {
      float* stream = p.X + (t * hc + h) * dim;
      const float* key = p.kv + (t * (hc + 1) + h) * dim;
      double s2 = 0, k2 = 0, dot = 0;
      for (int64_t d = 0; d < dim; ++d) {
        s2 += double(stream[d]) * stream[d];
        k2 += double(key[d]) * key[d];
        dot += double(stream[d] * p.qk[h * dim + d] * key[d]);
      }
      const float rstd = (1.0f / std::sqrt(static_cast<float>(s2 / dim) + p.eps)) *
                         (1.0f / std::sqrt(static_cast<float>(k2 / dim) + p.eps));
      const float g = static_cast<float>(dot) * rstd / std::sqrt(static_cast<float>(dim));
      const float gate = Sigmoid(std::copysign(std::sqrt(std::max(std::fabs(g), 1e-6f)), g));
      for (int64_t d = 0; d < dim; ++d) stream[d] = Bf(stream[d] + gate * value[d]);
    }
  }
  return OpStatus::kOk;
}

}  // namespace flashd::kernels::cpu
