// MoE: routing, the experts' SwiGLU activation, and the combination of expert outputs; and the
// row copies that gather the experts' inputs.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/cpu/formats.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/scalar.h"

namespace flashd::kernels::cpu {
namespace {
inline float SqrtSoftplus(float x) { return std::sqrt(x > 20.0f ? x : fmath::Softplus(x)); }
}  // namespace

OpStatus MoeRoute(const MoeRouteParams& p) {
  if (!MoeRouteFits(p)) return OpStatus::kBadShape;
  if (p.router != nullptr) FLASHD_OP_RETURN_IF_ERROR(Linear(*p.router));  // The logits first.
  const int64_t E = p.experts;
  for (int64_t t = 0; t < p.tokens; ++t) {
    float* s = p.scores + t * E;
    float* biased = p.biased + t * E;
    for (int64_t e = 0; e < E; ++e) {
      const float v = p.logits[t * E + e];
      // Softmax scores are normalised below, once every expert's score is known.
      s[e] = p.scoring == RouteScoring::kSoftmax   ? v
             : p.scoring == RouteScoring::kSigmoid ? Sigmoid(v)
                                                   : SqrtSoftplus(v);
    }
    if (p.scoring == RouteScoring::kSoftmax) {
      float mx = *std::max_element(s, s + E), sum = 0;
      for (int64_t e = 0; e < E; ++e) sum += (s[e] = fmath::Exp(s[e] - mx));
      for (int64_t e = 0; e < E; ++e) s[e] /= sum;
    }
    for (int64_t e = 0; e < E; ++e) biased[e] = s[e] + p.bias[e];
    int64_t* chosen = p.chosen + t * p.k;
    const int64_t n = E;
    FLASHD_OP_RETURN_IF_ERROR(TopK({.values = biased,
                                    .rows = 1,
                                    .stride = E,
                                    .k = p.k,
                                    .n = &n,
                                    .order = p.order,
                                    .out = chosen}));
    float sum = 0;
    for (int64_t i = 0; i < p.k; ++i) sum += s[chosen[i]];
    for (int64_t i = 0; i < p.k; ++i) {
      float w = s[chosen[i]];
      if (p.norm_topk && p.k > 1) w /= sum + 1e-20f;
      p.weights[t * p.k + i] = w * p.scale;
    }
  }
  return p.group != nullptr ? MoeGroup(MoeRouteGroup(p)) : OpStatus::kOk;
}

OpStatus Swiglu(const SwigluParams& p) {
  if (p.rows < 0 || p.inter <= 0) return OpStatus::kBadShape;
  for (int64_t r = 0; r < p.rows; ++r) {
    const float* weight = p.row_weights != nullptr ? p.row_weights + r : nullptr;
    for (int64_t i = r * p.inter; i < (r + 1) * p.inter; ++i) {
      p.h[i] = fmath::SwigluValue(p.gate[i], p.up[i], p.limit, weight);
    }
  }
  return OpStatus::kOk;
}

OpStatus MoeCombine(const MoeCombineParams& p) {
  if (p.count < 0 || p.dim <= 0) return OpStatus::kBadShape;
  if (p.add != nullptr && (p.y_rows <= 0 || p.out == nullptr)) return OpStatus::kBadShape;
  for (int64_t i = 0; i < p.count; ++i) {
    float* y = p.y + p.rows[i] * p.dim;
    const float* o = p.expert_out + i * p.dim;
    for (int64_t d = 0; d < p.dim; ++d) y[d] += o[d];
  }
  if (p.add == nullptr) return OpStatus::kOk;
  return AddRound({.a = p.y, .b = p.add, .n = p.y_rows * p.dim, .out = p.out});
}

OpStatus MoeGroup(const MoeGroupParams& p) {
  if (!MoeGroupFits(p)) return OpStatus::kBadShape;
  const int64_t n = p.tokens * p.k;
  if (n == 0) return OpStatus::kOk;
  std::vector<int64_t> count(static_cast<size_t>(p.experts), 0);
  for (int64_t i = 0; i < n; ++i) {
    if (p.chosen[i] < 0 || p.chosen[i] >= p.experts) return OpStatus::kBadArgument;
    count[static_cast<size_t>(p.chosen[i])] += 1;
  }
  std::vector<int64_t> at(count.size());
  int64_t s = 0, offset = 0, tiles = 0;
  for (int64_t e = 0; e < p.experts; ++e) {
    at[e] = offset;
    if (count[e] == 0) continue;
    p.slot_expert[s] = e;
    p.slot_offset[s] = offset;
    p.slot_tiles[s] = tiles;
    offset += count[e];
    tiles += (count[e] + kExpertTileRows - 1) / kExpertTileRows;
    ++s;
  }
  for (; s < p.slots; ++s) {
    p.slot_expert[s] = -1;
    p.slot_offset[s] = offset;
    p.slot_tiles[s] = tiles;
  }
  p.slot_offset[p.slots] = offset;
  p.slot_tiles[p.slots] = tiles;
  for (int64_t t = 0; t < p.tokens; ++t) {
    for (int64_t i = 0; i < p.k; ++i) {
      const int64_t j = at[p.chosen[t * p.k + i]]++;
      p.rows[j] = t;
      p.row_weights[j] = p.weights[t * p.k + i];
    }
  }
  return OpStatus::kOk;
}

OpStatus ExpertLinear(const ExpertLinearParams& p) {
  if (const OpStatus s = ExpertCodesFit(p); s != OpStatus::kOk) return s;
  if (p.y_codes != nullptr) {  // The op, then its rows' codes.
    ExpertLinearParams q = p;
    q.y_codes = q.y_code_scales = nullptr;
    if (const OpStatus s = ExpertLinear(q); s != OpStatus::kOk) return s;
    QuantizeFp8Rows(p.y, p.rows, p.out, p.out, p.y_codes, p.y_code_scales);
    return OpStatus::kOk;
  }
  if (p.x_rows != nullptr) {  // The rows copied out, then the op over them.
    if (p.rows < 0 || p.in <= 0 || p.x == nullptr || p.x_count <= 0) return OpStatus::kBadShape;
    // The thread's copy stays from call to call, as the grouped rows' buffer did when the engine
    // copied them: a decode step's layers fault in no fresh pages for it.
    thread_local std::vector<float> rows;
    rows.resize(static_cast<size_t>(p.rows * p.in));
    if (const OpStatus s = CopyRows({.src = p.x,
                                     .src_stride = p.in,
                                     .index = p.x_rows,
                                     .rows = p.rows,
                                     .cols = p.in,
                                     .dst = rows.data(),
                                     .dst_stride = p.in,
                                     .src_rows = p.x_count});
        s != OpStatus::kOk) {
      return s;
    }
    ExpertLinearParams q = p;
    q.x = rows.data();
    q.x_rows = nullptr;
    return ExpertLinear(q);
  }
  if (p.round_output && p.up == nullptr) {  // The products, then every row rounded.
    ExpertLinearParams q = p;
    q.round_output = false;
    const OpStatus s = ExpertLinear(q);
    if (s != OpStatus::kOk || p.rows <= 0) return s;
    return RoundBf16({.x = p.y, .n = p.rows * p.out});
  }
  if (p.up != nullptr) {  // The gated pair: two products, then the SwiGLU.
    return GatedApart(
        p, [](const ExpertLinearParams& q) { return ExpertLinear(q); },
        [](const SwigluParams& q) { return Swiglu(q); });
  }
  if (p.rows < 0 || p.in <= 0 || p.out <= 0 || p.slots < 0 || p.experts <= 0) {
    return OpStatus::kBadShape;
  }
  if (p.format != WeightFormat::kFp8 && p.format != WeightFormat::kFp4) {
    return OpStatus::kBadArgument;
  }
  for (int64_t s = 0; s < p.slots; ++s) {
    const int64_t e = p.slot_expert[s], from = p.slot_offset[s], to = p.slot_offset[s + 1];
    if (e < 0 || to == from) continue;
    if (e >= p.experts || from < 0 || to < from || to > p.rows) return OpStatus::kBadArgument;
    // With x_quantized each slot reads its rows' codes; else they are quantized into the
    // workspace's first rows.
    const int64_t at = p.x_quantized ? from : 0;
    FLASHD_OP_RETURN_IF_ERROR(Linear({.x = p.x + from * p.in,
                                      .rows = to - from,
                                      .in = p.in,
                                      .out = p.out,
                                      .format = p.format,
                                      .w = p.w[e],
                                      .w_scales = p.w_scales[e],
                                      .x_codes = p.x_codes + at * p.in,
                                      .x_scales = p.x_scales + at * (p.in / 32),
                                      .y = p.y + from * p.out,
                                      .stream = p.stream,
                                      .x_quantized = p.x_quantized}));
  }
  return OpStatus::kOk;
}

OpStatus AddRound(const AddRoundParams& p) {
  if (p.n < 0) return OpStatus::kBadShape;
  for (int64_t i = 0; i < p.n; ++i) p.out[i] = Bf(p.a[i] + p.b[i]);
  return OpStatus::kOk;
}

OpStatus CopyRows(const CopyRowsParams& p) {
  if (p.rows < 0 || p.cols < 0 || p.src_stride < p.cols || p.dst_stride < p.cols) {
    return OpStatus::kBadShape;
  }
  for (int64_t i = 0; i < p.rows; ++i) {
    const int64_t r = p.index != nullptr ? p.index[i] : i;
    if (r < 0 || (p.src_rows > 0 && r >= p.src_rows)) return OpStatus::kBadArgument;
    std::memcpy(p.dst + i * p.dst_stride, p.src + r * p.src_stride,
                static_cast<size_t>(p.cols) * sizeof(float));
  }
  return OpStatus::kOk;
}

}  // namespace flashd::kernels::cpu
