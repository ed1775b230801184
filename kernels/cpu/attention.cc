// Sparse attention over each query's window and selected compressed entries, with the per-head
// attention sink.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
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

// out[d] = sum over keys j, in order, of weight[j] * key_j[d]: one lane per dimension.
FLASHD_VECTOR_CLONES void WeightedSumByLane(const float* weight, const float* keys, size_t nk,
                                            size_t hd, float* out) {
  for (size_t d = 0; d < hd; ++d) out[d] = 0;
  for (size_t j = 0; j < nk; ++j) {
    const float w = weight[j];
    const float* key = keys + j * hd;
    for (size_t d = 0; d < hd; ++d) out[d] += w * key[d];
  }
}

// acc = acc * scale + block, per dimension.
FLASHD_VECTOR_CLONES void RescaleAdd(float* acc, float scale, const float* block, size_t hd) {
  for (size_t d = 0; d < hd; ++d) acc[d] = acc[d] * scale + block[d];
}
}  // namespace

OpStatus SparseAttention(const SparseAttentionParams& p) {
  if (p.tokens < 0 || p.heads <= 0 || p.head_dim <= 0 || p.head_dim % 32 != 0 || p.window <= 0 ||
      p.positions == nullptr || p.window_first == nullptr ||
      (p.token_sequence == nullptr && p.selected_stride > 0 &&
       (p.selected == nullptr || p.block_table == nullptr)) ||
      (p.token_sequence != nullptr && (p.sequences == nullptr || p.sequence_count <= 0 ||
                                       (p.selected_stride > 0 && p.selected == nullptr)))) {
    return OpStatus::kBadShape;
  }
  // Several sequences: each query's sequence, and its block table where the query reads an
  // entry (a sequence without entries yet may have none).
  for (int64_t t = 0; p.token_sequence != nullptr && t < p.tokens; ++t) {
    const int32_t s = p.token_sequence[t];
    if (s < 0 || s >= p.sequence_count) return OpStatus::kBadShape;
    const int64_t* row = p.selected + t * p.selected_stride;
    if (p.sequences[s].block_table == nullptr &&
        std::any_of(row, row + p.selected_stride, [](int64_t e) { return e >= 0; })) {
      return OpStatus::kBadShape;
    }
  }
  const size_t hd = static_cast<size_t>(p.head_dim), H = static_cast<size_t>(p.heads);
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(hd)));
  struct Scratch {
    std::vector<float> keys, keys_t, logit, weight, block, acc;
    std::vector<int64_t> list;  // Each key's index in the query's list.
  };
  auto attend = [&](int64_t t, Scratch& w) {
    const AttentionSequence sq = p.SequenceOf(t);
    const AttentionKeys ak = AttentionKeys::Of(p, t, sq.fresh_first);
    std::vector<float>& keys = w.keys;
    keys.clear();
    w.list.clear();
    for (int64_t j = 0; j < ak.count(); ++j) {
      const int64_t q = ak.Position(j);
      keys.resize(keys.size() + hd);
      float* dst = &keys[keys.size() - hd];
      if (q >= sq.fresh_first) {
        std::memcpy(dst, sq.fresh + (q - sq.fresh_first) * p.head_dim, hd * sizeof(float));
      } else {
        const int64_t slot = q % p.window;
        DequantizeFp8PerBlock(p.RingCodes(sq, slot), p.RingScales(sq, slot), hd, 32, dst);
      }
      w.list.push_back(ak.ListIndex(j));
    }
    int64_t next = ak.selected_base();
    for (int64_t i = 0; i < p.selected_stride; ++i) {
      const int64_t j = p.selected[t * p.selected_stride + i];
      if (j < 0) continue;
      const int64_t row = BlockRow(sq.block_table, p.kv_codes.rows_per_block, j);
      keys.resize(keys.size() + hd);
      DequantizeFp4E4M3(p.kv_codes.Row(row), p.kv_scales.Row(row), hd, 16, &keys[keys.size() - hd]);
      w.list.push_back(next++);
    }
    const size_t nk = keys.size() / hd;
    // The keys transposed, so that each key's dot product (summed over d in order) runs in its
    // own vector lane; the output runs one lane per dimension (summed over keys in order).
    w.keys_t.resize(nk * hd);
    for (size_t j = 0; j < nk; ++j) {
      for (size_t d = 0; d < hd; ++d) w.keys_t[d * nk + j] = keys[j * hd + d];
    }
    w.logit.resize(nk);
    w.weight.resize(nk);
    w.block.resize(hd);
    w.acc.resize(hd);
    for (size_t h = 0; h < H; ++h) {
      const float* qh = p.q + (t * p.heads + static_cast<int64_t>(h)) * p.head_dim;
      LogitsByLane(qh, w.keys_t.data(), hd, nk, scale, w.logit.data());
      // The release's online softmax over blocks of the list (kernels/ops.h).
      float m = -1e30f, denom = 0;
      std::fill(w.acc.begin(), w.acc.end(), 0.0f);
      for (size_t j0 = 0; j0 < nk;) {
        const int64_t b = w.list[j0] / kAttentionBlock;
        size_t j1 = j0;
        float block_max = -std::numeric_limits<float>::infinity();
        for (; j1 < nk && w.list[j1] / kAttentionBlock == b; ++j1) {
          block_max = std::max(block_max, w.logit[j1]);
        }
        const float m_new = std::max(m, block_max);
        const float rescale = fmath::Exp(m - m_new);
        float sum = 0;
        for (size_t j = j0; j < j1; ++j) {
          const float pj = fmath::Exp(w.logit[j] - m_new);
          sum += pj;
          w.weight[j] = Bf(pj);
        }
        denom = denom * rescale + sum;
        WeightedSumByLane(&w.weight[j0], &keys[j0 * hd], j1 - j0, hd, w.block.data());
        RescaleAdd(w.acc.data(), rescale, w.block.data(), hd);
        m = m_new;
        j0 = j1;
      }
      denom += fmath::Exp(p.sink[h] - m);
      float* oh = p.out + (t * p.heads + static_cast<int64_t>(h)) * p.head_dim;
      for (size_t d = 0; d < hd; ++d) oh[d] = Bf(w.acc[d] / denom);
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
                   Scratch w;
                   for (size_t t = begin; t < end; ++t) attend(static_cast<int64_t>(t), w);
                 });
  return OpStatus::kOk;
}

}  // namespace flashd::kernels::cpu
