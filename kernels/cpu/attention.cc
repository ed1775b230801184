// Sparse attention over each query's window and selected compressed entries, with the per-head
// attention sink.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/cpu/formats.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/parallel.h"

namespace flashd::kernels::cpu {
namespace {
inline float Bf(float x) { return Bf16ToFloat(FloatToBf16(x)); }
}  // namespace

OpStatus SparseAttention(const SparseAttentionParams& p) {
  if (p.tokens < 0 || p.heads <= 0 || p.head_dim <= 0 || p.head_dim % 32 != 0 || p.window <= 0 ||
      p.positions == nullptr || p.window_first == nullptr ||
      (p.selected_stride > 0 && (p.selected == nullptr || p.block_table == nullptr))) {
    return OpStatus::kBadShape;
  }
  const size_t hd = static_cast<size_t>(p.head_dim), H = static_cast<size_t>(p.heads);
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  auto attend = [&](int64_t t, std::vector<float>& keys, std::vector<float>& logit) {
    const int64_t pos = p.positions[t];
    keys.clear();
    for (int64_t q = p.window_first[t]; q <= pos; ++q) {
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
    logit.resize(nk);
    for (size_t h = 0; h < H; ++h) {
      const float* qh = p.q + (t * p.heads + static_cast<int64_t>(h)) * p.head_dim;
      float mx = p.sink[h];
      for (size_t j = 0; j < nk; ++j) {
        float dot = 0;
        for (size_t d = 0; d < hd; ++d) dot += qh[d] * keys[j * hd + d];
        logit[j] = dot * scale;
        mx = std::max(mx, logit[j]);
      }
      float denom = std::exp(p.sink[h] - mx);
      for (size_t j = 0; j < nk; ++j) denom += (logit[j] = std::exp(logit[j] - mx));
      float* oh = p.out + (t * p.heads + static_cast<int64_t>(h)) * p.head_dim;
      for (size_t d = 0; d < hd; ++d) {
        float acc = 0;
        for (size_t j = 0; j < nk; ++j) acc += (logit[j] / denom) * keys[j * hd + d];
        oh[d] = Bf(acc);
      }
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
                   std::vector<float> keys, logit;
                   for (size_t t = begin; t < end; ++t) {
                     attend(static_cast<int64_t>(t), keys, logit);
                   }
                 });
  return OpStatus::kOk;
}

}  // namespace flashd::kernels::cpu
