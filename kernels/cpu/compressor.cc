// The compressor: gated pooling of each group of `ratio` tokens, and the write of finished
// entries (rotated, FP4-quantized) into their KV and index-key rows.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "kernels/cpu/formats.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/scalar.h"

namespace flashd::kernels::cpu {
namespace {

// Rows [r0, r1) of p, one sequence's, into its partial groups, pooling where a group completes
// into pooled[0, ...): returns how many groups it pooled.
int64_t PoolSequence(const CompressPoolParams& p, int64_t r0, int64_t r1, float* kv_partial,
                     float* score_partial, float* pooled) {
  const int64_t dim = p.dim, ratio = p.ratio;
  const size_t bytes = static_cast<size_t>(dim) * sizeof(float);
  int64_t groups = 0;
  for (int64_t t = r0; t < r1; ++t) {
    const int64_t pos = p.positions[t];
    const int64_t slot = pos % ratio;
    std::memcpy(kv_partial + slot * dim, p.kv + t * dim, bytes);
    std::memcpy(score_partial + slot * dim, p.score + t * dim, bytes);
    if ((pos + 1) % ratio != 0) continue;
    float* out = pooled + groups * dim;
    for (int64_t d = 0; d < dim; ++d) {
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t s = 0; s < ratio; ++s) mx = std::max(mx, score_partial[s * dim + d]);
      float sum = 0;
      for (int64_t s = 0; s < ratio; ++s) sum += fmath::Exp(score_partial[s * dim + d] - mx);
      float acc = 0;
      for (int64_t s = 0; s < ratio; ++s) {
        acc += kv_partial[s * dim + d] * (fmath::Exp(score_partial[s * dim + d] - mx) / sum);
      }
      out[d] = Bf(acc);
    }
    groups += 1;
  }
  return groups;
}

}  // namespace

OpStatus CompressPool(const CompressPoolParams& p) {
  if (p.rows < 0 || p.dim <= 0 || p.ratio < 2 || p.positions == nullptr) {
    return OpStatus::kBadShape;
  }
  if (p.sequence_rows == nullptr) {
    PoolSequence(p, 0, p.rows, p.kv_partial, p.score_partial, p.pooled);
    return OpStatus::kOk;
  }
  // Several sequences: each its rows into its own partial group, pooled in row order.
  if (p.sequence_count <= 0 || p.kv_partials == nullptr || p.score_partials == nullptr ||
      p.sequence_rows[0] != 0 || p.sequence_rows[p.sequence_count] != p.rows) {
    return OpStatus::kBadShape;
  }
  int64_t pooled = 0;
  for (int64_t s = 0; s < p.sequence_count; ++s) {
    const int64_t r0 = p.sequence_rows[s], r1 = p.sequence_rows[s + 1];
    if (r1 < r0) return OpStatus::kBadShape;
    pooled +=
        PoolSequence(p, r0, r1, p.kv_partials[s], p.score_partials[s], p.pooled + pooled * p.dim);
  }
  return OpStatus::kOk;
}

OpStatus CompressWrite(const CompressWriteParams& p) {
  if (p.groups < 0 || p.head_dim % 32 != 0 || p.rope_dim > p.head_dim ||
      (p.groups > 0 && p.rows == nullptr) ||
      (p.key != nullptr && (p.index_dim % 32 != 0 || p.rope_dim > p.index_dim))) {
    return OpStatus::kBadShape;
  }
  for (int64_t g = 0; g < p.groups; ++g) {
    const int64_t row = p.rows[g];
    if (row < 0) continue;
    if (p.key != nullptr) {
      float* key = p.key + g * p.index_dim;
      Rope({.x = key,
            .rows = 1,
            .head_dim = p.index_dim,
            .rope_dim = p.rope_dim,
            .row_stride = p.index_dim,
            .positions = &p.positions[g],
            .freqs = p.freqs});
      QuantizeFp4E8M0(key, static_cast<size_t>(p.index_dim), 32, p.key_codes.Row(row),
                      p.key_scales.Row(row));
    }
    float* latent = p.latent + g * p.head_dim;
    Rope({.x = latent,
          .rows = 1,
          .head_dim = p.head_dim,
          .rope_dim = p.rope_dim,
          .row_stride = p.head_dim,
          .positions = &p.positions[g],
          .freqs = p.freqs});
    QuantizeFp4E4M3(latent, static_cast<size_t>(p.head_dim), 16, p.kv_codes.Row(row),
                    p.kv_scales.Row(row));
    if (p.kv_codes.versions != nullptr) p.kv_codes.versions[row / p.kv_codes.rows_per_block] += 1;
    if (p.kv_codes.writes != nullptr) *p.kv_codes.writes += 1;
  }
  return OpStatus::kOk;
}

}  // namespace flashd::kernels::cpu
