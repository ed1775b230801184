// The embedding and mHC's mixes: the hc copies of the residual stream, their Sinkhorn-balanced
// combination matrix, the collapse before a sublayer and the expansion after it.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "kernels/cpu/formats.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/parallel.h"
#include "kernels/cpu/scalar.h"

namespace flashd::kernels::cpu {
namespace {

// pre, post and the Sinkhorn-normalised comb from one row of mixes.
void HcSplit(const float* mixes, const float* scale, const float* base, int hc, int iters,
             float eps, float* pre, float* post, float* comb) {
  for (int i = 0; i < hc; ++i) {
    pre[i] = Sigmoid(mixes[i] * scale[0] + base[i]) + eps;
    post[i] = 2.0f * Sigmoid(mixes[hc + i] * scale[1] + base[hc + i]);
  }
  for (int i = 0; i < hc; ++i) {
    float row_max = -std::numeric_limits<float>::infinity();
    for (int j = 0; j < hc; ++j) {
      comb[i * hc + j] = mixes[2 * hc + i * hc + j] * scale[2] + base[2 * hc + i * hc + j];
      row_max = std::max(row_max, comb[i * hc + j]);
    }
    float sum = 0;
    for (int j = 0; j < hc; ++j) sum += (comb[i * hc + j] = fmath::Exp(comb[i * hc + j] - row_max));
    for (int j = 0; j < hc; ++j) comb[i * hc + j] = comb[i * hc + j] / sum + eps;
  }
  auto normalize_cols = [&] {
    for (int j = 0; j < hc; ++j) {
      float sum = 0;
      for (int i = 0; i < hc; ++i) sum += comb[i * hc + j];
      for (int i = 0; i < hc; ++i) comb[i * hc + j] /= sum + eps;
    }
  };
  auto normalize_rows = [&] {
    for (int i = 0; i < hc; ++i) {
      float sum = 0;
      for (int j = 0; j < hc; ++j) sum += comb[i * hc + j];
      for (int j = 0; j < hc; ++j) comb[i * hc + j] /= sum + eps;
    }
  };
  normalize_cols();
  for (int it = 0; it < iters - 1; ++it) {
    normalize_rows();
    normalize_cols();
  }
}

}  // namespace

OpStatus Embed(const EmbedParams& p) {
  if (p.count < 0 || p.hc <= 0 || p.dim <= 0 || p.vocab <= 0) return OpStatus::kBadShape;
  for (int64_t t = 0; t < p.count; ++t) {
    if (p.tokens[t] < 0 || p.tokens[t] >= p.vocab) return OpStatus::kBadArgument;
  }
  if ((p.embed == nullptr) == (p.embed_bf16 == nullptr)) return OpStatus::kBadArgument;
  const size_t dim = static_cast<size_t>(p.dim);
  for (int64_t t = 0; t < p.count; ++t) {
    float* row = p.X + t * p.hc * p.dim;
    const size_t at = static_cast<size_t>(p.tokens[t]) * dim;
    if (p.embed != nullptr) {
      std::memcpy(row, p.embed + at, dim * sizeof(float));
    } else {
      for (size_t d = 0; d < dim; ++d) row[d] = Bf16ToFloat(p.embed_bf16[at + d]);
    }
    for (int64_t h = 1; h < p.hc; ++h) std::memcpy(row + h * p.dim, row, dim * sizeof(float));
  }
  return OpStatus::kOk;
}

OpStatus HcMix(const HcMixParams& p) {
  if (p.rows < 0 || p.hc <= 0 || p.dim <= 0 || p.iters < 1) return OpStatus::kBadShape;
  if (const OpStatus s = HcStepsFit(p); s != OpStatus::kOk) return s;
  if (p.rows == 0) return OpStatus::kOk;
  // The steps in turn, then the mixes.
  const float* X = nullptr;
  const OpStatus steps = HcStepsApart(
      p, [](const HcExpandParams& q) { return HcExpand(q); },
      [](const HcCollapseParams& q) { return HcCollapse(q); }, &X);
  if (steps != OpStatus::kOk) return steps;
  const size_t rows = static_cast<size_t>(p.rows), width = static_cast<size_t>(p.hc * p.dim);
  const size_t mix = static_cast<size_t>((2 + p.hc) * p.hc);
  ParallelRanges(
      rows * mix, StreamThreads(p.stream),
      [&](size_t begin, size_t end) {
        for (size_t i = begin; i < end; ++i) {
          const size_t t = i / mix, j = i % mix;
          const float* x = X + t * width;
          const float* w = p.fn + j * width;
          p.mixes[i] = LaneSum<float>(width, [&](size_t k) { return x[k] * w[k]; });
        }
      },
      std::max<size_t>(1, (size_t{1} << 16) / width));
  for (size_t t = 0; t < rows; ++t) {
    const float* x = X + t * width;
    const double sum = LaneSum<double>(width, [&](size_t k) { return double(x[k]) * x[k]; });
    const float r = 1.0f / std::sqrt(static_cast<float>(sum / width) + p.norm_eps);
    for (size_t j = 0; j < mix; ++j) p.mixes[t * mix + j] *= r;
    HcSplit(p.mixes + t * mix, p.scale, p.base, static_cast<int>(p.hc), p.iters, p.hc_eps,
            p.pre + t * p.hc, p.post + t * p.hc, p.comb + t * p.hc * p.hc);
  }
  return OpStatus::kOk;
}

OpStatus HcCollapse(const HcCollapseParams& p) {
  if (p.rows < 0 || p.hc <= 0 || p.dim <= 0) return OpStatus::kBadShape;
  if (const OpStatus s = RowCodesFit(p.codes, p.code_scales, p.dim); s != OpStatus::kOk) return s;
  if (p.codes != nullptr) {  // The collapse, then its rows' codes.
    HcCollapseParams q = p;
    q.codes = q.code_scales = nullptr;
    if (const OpStatus s = HcCollapse(q); s != OpStatus::kOk) return s;
    QuantizeFp8Rows(p.x, p.rows, p.dim, p.dim, p.codes, p.code_scales);
    return OpStatus::kOk;
  }
  const int64_t hc = p.hc, dim = p.dim;
  for (int64_t t = 0; t < p.rows; ++t) {
    for (int64_t d = 0; d < dim; ++d) {
      float acc = 0;
      for (int64_t h = 0; h < hc; ++h) acc += p.weights[t * hc + h] * p.X[(t * hc + h) * dim + d];
      p.x[t * dim + d] = Bf(acc);
    }
  }
  if (p.norm_weight == nullptr) return OpStatus::kOk;
  return RmsNorm({.x = p.x,
                  .rows = p.rows,
                  .dim = dim,
                  .stride = dim,
                  .weight = p.norm_weight,
                  .eps = p.eps,
                  .stream = p.stream});
}

OpStatus HcExpand(const HcExpandParams& p) {
  if (p.rows < 0 || p.hc <= 0 || p.dim <= 0 || p.out == p.X) return OpStatus::kBadShape;
  const int64_t hc = p.hc, dim = p.dim;
  for (int64_t t = 0; t < p.rows; ++t) {
    for (int64_t j = 0; j < hc; ++j) {
      for (int64_t d = 0; d < dim; ++d) {
        const float acc = p.post[t * hc + j] * p.sub[t * dim + d];
        float mixed = 0;
        for (int64_t i = 0; i < hc; ++i) {
          mixed += p.comb[(t * hc + i) * hc + j] * p.X[(t * hc + i) * dim + d];
        }
        p.out[(t * hc + j) * dim + d] = Bf(acc + mixed);
      }
    }
  }
  return OpStatus::kOk;
}

}  // namespace flashd::kernels::cpu
