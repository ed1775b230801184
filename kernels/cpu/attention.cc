// Sparse attention over each query's window and selected compressed entries, with the per-head
// attention sink.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/cpu/formats.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/parallel.h"
#include "kernels/cpu/scalar.h"
#include "kernels/cpu/simd.h"

namespace flashd::kernels::cpu {
namespace {

// logit[j] = (sum over d, in order, of q[d] * key_j[d]) * scale, keys_t[d * nk + j] = key_j[d]:
// one vector lane per key, each summing its products in the plain order.
FLASHD_VECTOR_CLONES void LogitsByLane(const float* q, const float* keys_t, size_t hd, size_t nk,
                                       float scale, float* logit) {
  for (size_t j = 0; j < nk; ++j) logit[j] = 0;
  for (size_t d = 0; d < hd; ++d) {
    const float qd = q[d];
    const float* row = keys_t + d * nk;
    for (size_t j = 0; j < nk; ++j) logit[j] += qd * row[j];
  }
  for (size_t j = 0; j < nk; ++j) logit[j] *= scale;
}

// out[d] = sum over keys j, in order, of (weight[j] / denom) * key_j[d]: one lane per dimension.
FLASHD_VECTOR_CLONES void WeightedSumByLane(const float* weight, float denom, const float* keys,
                                            size_t nk, size_t hd, float* out) {
  for (size_t d = 0; d < hd; ++d) out[d] = 0;
  for (size_t j = 0; j < nk; ++j) {
    const float pj = weight[j] / denom;
    const float* key = keys + j * hd;
    for (size_t d = 0; d < hd; ++d) out[d] += pj * key[d];
  }
}
}  // namespace

OpStatus SparseAttention(const SparseAttentionParams& p) {
  if (p.tokens < 0 || p.heads <= 0 || p.head_dim <= 0 || p.head_dim % 32 != 0 || p.window <= 0 ||
      p.positions == nullptr || p.window_first == nullptr ||
      (p.selected_stride > 0 && (p.selected == nullptr || p.block_table == nullptr))) {
    return OpStatus::kBadShape;
  }
  const size_t hd = static_cast<size_t>(p.head_dim), H = static_cast<size_t>(p.heads);
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  auto attend = [&](int64_t t, std::vector<float>& keys, std::vector<float>& keys_t,
                    std::vector<float>& logit) {
    const int64_t last = p.window_last != nullptr ? p.window_last[t] : p.positions[t];
    keys.clear();
    for (int64_t q = p.window_first[t]; q <= last; ++q) {
      keys.resize(keys.size() + hd);
      float* dst = &keys[keys.size() - hd];
      if (q >= p.fresh_first) {
        std::memcpy(dst, p.fresh + (q - p.fresh_first) * p.head_dim, hd * sizeof(float));
      } else {
        const size_t slot = static_cast<size_t>(q % p.window);
        DequantizeFp8PerBlock(p.ring_codes + slot * hd, p.ring_scales + slot * hd / 32, hd, 32,
                              dst);
      }
    }
    for (int64_t i = 0; i < p.selected_stride; ++i) {
      const int64_t j = p.selected[t * p.selected_stride + i];
      if (j < 0) continue;
      const int64_t row = BlockRow(p.block_table, p.kv_codes.rows_per_block, j);
      keys.resize(keys.size() + hd);
      DequantizeFp4E4M3(p.kv_codes.Row(row), p.kv_scales.Row(row), hd, 16, &keys[keys.size() - hd]);
    }
    const size_t nk = keys.size() / hd;
    // The keys transposed, so that each key's dot product (summed over d in order) runs in its
    // own vector lane; the output runs one lane per dimension (summed over keys in order).
    keys_t.resize(nk * hd);
    for (size_t j = 0; j < nk; ++j) {
      for (size_t d = 0; d < hd; ++d) keys_t[d * nk + j] = keys[j * hd + d];
    }
    logit.resize(nk);
    for (size_t h = 0; h < H; ++h) {
      const float* qh = p.q + (t * p.heads + static_cast<int64_t>(h)) * p.head_dim;
      LogitsByLane(qh, keys_t.data(), hd, nk, scale, logit.data());
      float mx = p.sink[h];
      for (size_t j = 0; j < nk; ++j) mx = std::max(mx, logit[j]);
      float denom = std::exp(p.sink[h] - mx);
      for (size_t j = 0; j < nk; ++j) denom += (logit[j] = std::exp(logit[j] - mx));
      float* oh = p.out + (t * p.heads + static_cast<int64_t>(h)) * p.head_dim;
      WeightedSumByLane(logit.data(), denom, keys.data(), nk, hd, oh);
      for (size_t d = 0; d < hd; ++d) oh[d] = Bf(oh[d]);
    }
    return Rope({.x = p.out + t * p.heads * p.head_dim,
                 .rows = 1,
                 .heads = p.heads,
                 .head_dim = p.head_dim,
                 .rope_dim = p.rope_dim,
                 .row_stride = p.heads * p.head_dim,
                 .positions = &p.positions[t],
                 .freqs = p.freqs,
                 .inverse = true});
  };
  // Each query is its own: queries are spread over the threads.
  ParallelRanges(static_cast<size_t>(p.tokens), StreamThreads(p.stream),
                 [&](size_t begin, size_t end) {
                   std::vector<float> keys, keys_t, logit;
                   for (size_t t = begin; t < end; ++t) {
                     attend(static_cast<int64_t>(t), keys, keys_t, logit);
                   }
                 });
  return OpStatus::kOk;
}

}  // namespace flashd::kernels::cpu
