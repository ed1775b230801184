// The indexer: scores of compressed entries for each query, the candidate pre-filter, and top-k
// under either tie order.
#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "kernels/cpu/formats.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/parallel.h"
#include "kernels/cpu/scalar.h"
#include "kernels/cpu/simd.h"

namespace flashd::kernels::cpu {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// The indexer's dot product, by definition: eight running sums, lane d % 8 taking element d,
// added pairwise at the end. The order never depends on batch or chunk.
float Dot8Plain(const float* a, const float* b, size_t n) {
  float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  size_t d = 0;
  for (; d + 8 <= n; d += 8) {
    for (size_t u = 0; u < 8; ++u) lane[u] += a[d + u] * b[d + u];
  }
  for (; d < n; ++d) lane[d % 8] += a[d] * b[d];
  return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}

#if FLASHD_X86_VECTORS
// The same lanes in two SSE registers (0-3 and 4-7).
float Dot8Sse(const float* a, const float* b, size_t n) {
  __m128 lo = _mm_setzero_ps(), hi = _mm_setzero_ps();
  size_t d = 0;
  for (; d + 8 <= n; d += 8) {
    lo = _mm_add_ps(lo, _mm_mul_ps(_mm_loadu_ps(a + d), _mm_loadu_ps(b + d)));
    hi = _mm_add_ps(hi, _mm_mul_ps(_mm_loadu_ps(a + d + 4), _mm_loadu_ps(b + d + 4)));
  }
  if (d == n) return LaneSum4(lo) + LaneSum4(hi);
  float lane[8];
  _mm_storeu_ps(lane, lo);
  _mm_storeu_ps(lane + 4, hi);
  for (; d < n; ++d) lane[d % 8] += a[d] * b[d];
  return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}

// The same lanes in one AVX register.
__attribute__((target("avx2"))) float Dot8Avx2(const float* a, const float* b, size_t n) {
  __m256 acc = _mm256_setzero_ps();
  size_t d = 0;
  for (; d + 8 <= n; d += 8) {
    acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d)));
  }
  if (d == n) {
    return LaneSum4(_mm256_castps256_ps128(acc)) + LaneSum4(_mm256_extractf128_ps(acc, 1));
  }
  float lane[8];
  _mm256_storeu_ps(lane, acc);
  for (; d < n; ++d) lane[d % 8] += a[d] * b[d];
  return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}
#endif

using DotFn = float (*)(const float*, const float*, size_t);
DotFn PickDot8() {
#if FLASHD_X86_VECTORS
  return __builtin_cpu_supports("avx2") ? Dot8Avx2 : Dot8Sse;
#else
  return Dot8Plain;
#endif
}

bool ScoreShapeOk(const IndexerScoreParams& p) {
  if (p.tokens < 0 || p.heads <= 0 || p.dim <= 0 || p.dim % 32 != 0 || p.stride < 0 ||
      (p.tokens > 0 && p.visible == nullptr)) {
    return false;
  }
  if (p.stride == 0 || p.tokens == 0) return true;
  if (p.scores == nullptr) return false;
  if (p.token_sequence == nullptr) return p.block_table != nullptr;
  if (p.block_tables == nullptr) return false;
  // Each query's sequence, and its block table where the query sees an entry (a sequence without
  // entries yet may have none).
  for (int64_t t = 0; t < p.tokens; ++t) {
    const int32_t s = p.token_sequence[t];
    if (s < 0 || s >= p.sequence_count) return false;
    if (p.block_tables[s] == nullptr && std::min(p.visible[t], p.stride) > 0) return false;
  }
  return true;
}

// One query's score for one decoded key.
inline float Score(const float* q, const float* w, const float* key, int64_t heads, size_t dim,
                   DotFn dot) {
  float total = 0;
  for (int64_t h = 0; h < heads; ++h) {
    total += Bf(std::max(Bf(dot(q + h * dim, key, dim)), 0.0f) * w[h]);
  }
  return Bf(total);
}

// Ranks under each order; NaN above every number in both.
bool ReferenceLarger(const std::pair<double, int64_t>& x, const std::pair<double, int64_t>& y) {
  return (std::isnan(x.first) && !std::isnan(y.first)) || x.first > y.first;
}
bool TotalLarger(const std::pair<double, int64_t>& x, const std::pair<double, int64_t>& y) {
  const bool xn = std::isnan(x.first), yn = std::isnan(y.first);
  if (xn != yn) return xn;
  if (!xn && x.first != y.first) return x.first > y.first;
  return x.second < y.second;
}

// The top k of v[0, n) into out (ranked order), returns how many.
int64_t SelectTop(const float* v, int64_t n, int64_t k, TopKOrder order, int64_t* out,
                  std::vector<std::pair<double, int64_t>>* queue) {
  k = std::min(k, n);
  if (k <= 0) return 0;
  queue->resize(static_cast<size_t>(n));
  for (int64_t j = 0; j < n; ++j) (*queue)[j] = {v[j], j};
  auto first = queue->begin(), kth = queue->begin() + k, last = queue->end();
  if (order == TopKOrder::kReference) {
    // The reference's CPU top-k: which of equal values wins follows from these exact calls.
    if (k * 64 <= n) {
      std::partial_sort(first, kth, last, ReferenceLarger);
    } else {
      std::nth_element(first, kth - 1, last, ReferenceLarger);
    }
  } else {
    if (k < n) std::nth_element(first, kth - 1, last, TotalLarger);
    std::sort(first, kth, TotalLarger);
  }
  for (int64_t j = 0; j < k; ++j) out[j] = (*queue)[j].second;
  return k;
}

}  // namespace

OpStatus IndexerScoresRef(const IndexerScoreParams& p) {
  if (!ScoreShapeOk(p)) return OpStatus::kBadShape;
  const size_t dim = static_cast<size_t>(p.dim);
  std::vector<float> key(dim);
  for (int64_t t = 0; t < p.tokens; ++t) {
    float* score = p.scores + t * p.stride;
    std::fill(score, score + p.stride, kNegInf);
    for (int64_t j = 0; j < std::min(p.visible[t], p.stride); ++j) {
      if (p.mask != nullptr && p.mask[t * p.stride + j] == 0) continue;
      const int64_t row = BlockRow(p.TableOf(t), p.key_codes.rows_per_block, j);
      DequantizeFp4E8M0(p.key_codes.Row(row), p.key_scales.Row(row), dim, 32, key.data());
      score[j] = Score(p.q + t * p.heads * p.dim, p.weights + t * p.heads, key.data(), p.heads, dim,
                       Dot8Plain);
    }
  }
  return OpStatus::kOk;
}

OpStatus IndexerScores(const IndexerScoreParams& p) {
  if (!ScoreShapeOk(p)) return OpStatus::kBadShape;
  static const DotFn dot = PickDot8();
  const size_t dim = static_cast<size_t>(p.dim);
  // The queries of each sequence, and the most entries any of them sees.
  struct Group {
    std::vector<int64_t> tokens;
    int64_t widest = 0;
  };
  std::vector<Group> groups(p.token_sequence != nullptr ? static_cast<size_t>(p.sequence_count)
                                                        : 1);
  int64_t widest = 0;
  for (int64_t t = 0; t < p.tokens; ++t) {
    std::fill(p.scores + t * p.stride, p.scores + (t + 1) * p.stride, kNegInf);
    Group& g = groups[p.token_sequence != nullptr ? p.token_sequence[t] : 0];
    g.tokens.push_back(t);
    g.widest = std::max(g.widest, std::min(p.visible[t], p.stride));
    widest = std::max(widest, g.widest);
  }
  const float* pairs = E2M1PairTable();
  // Entry-major: each sequence's key is decoded once, exactly (an E2M1 value times a power of
  // two), and scored for every query of the sequence that sees it.
  ParallelRanges(
      static_cast<size_t>(widest), StreamThreads(p.stream),
      [&](size_t begin, size_t end) {
        std::vector<float> key(dim);
        for (size_t j = begin; j < end; ++j) {
          for (const Group& g : groups) {
            if (static_cast<int64_t>(j) >= g.widest) continue;
            const int64_t row = BlockRow(p.TableOf(g.tokens.front()), p.key_codes.rows_per_block,
                                         static_cast<int64_t>(j));
            const uint8_t* codes = p.key_codes.Row(row);
            const uint8_t* scales = p.key_scales.Row(row);
            for (size_t b = 0; b < dim / 32; ++b) {
              const float s = E8M0ToFloat(scales[b]);
              for (size_t i = 0; i < 16; ++i) {
                const float* pair = pairs + 2 * codes[b * 16 + i];
                key[b * 32 + 2 * i] = pair[0] * s;
                key[b * 32 + 2 * i + 1] = pair[1] * s;
              }
            }
            for (const int64_t t : g.tokens) {
              if (static_cast<int64_t>(j) >= p.visible[t]) continue;
              if (p.mask != nullptr && p.mask[t * p.stride + j] == 0) continue;
              p.scores[t * p.stride + j] = Score(p.q + t * p.heads * p.dim, p.weights + t * p.heads,
                                                 key.data(), p.heads, dim, dot);
            }
          }
        }
      },
      64);
  return OpStatus::kOk;
}

OpStatus TopK(const TopKParams& p) {
  if (p.rows < 0 || p.k < 0 || p.n == nullptr || p.out == nullptr) return OpStatus::kBadShape;
  std::vector<std::pair<double, int64_t>> queue;
  for (int64_t r = 0; r < p.rows; ++r) {
    int64_t* out = p.out + r * p.k;
    const int64_t got =
        SelectTop(p.values + r * p.stride, std::min(p.n[r], p.stride), p.k, p.order, out, &queue);
    if (p.ascending) std::sort(out, out + got);
    std::fill(out + got, out + p.k, -1);
  }
  return OpStatus::kOk;
}

OpStatus CandidateFilter(const CandidateFilterParams& p) {
  if (p.tokens < 0 || p.block <= 0 || p.top_blocks < 0 || p.visible == nullptr) {
    return OpStatus::kBadShape;
  }
  const int64_t bs = p.block, nb_stride = (p.stride + bs - 1) / bs;
  std::vector<std::pair<double, int64_t>> queue;
  for (int64_t t = 0; t < p.tokens; ++t) {
    const int64_t visible = std::min(p.visible[t], p.stride);
    const float* score = p.scores + t * p.stride;
    float* block_score = p.block_scores + t * nb_stride;
    const int64_t blocks = (visible + bs - 1) / bs;
    std::fill(block_score, block_score + blocks, kNegInf);
    for (int64_t j = 0; j < visible; ++j)
      block_score[j / bs] = std::max(block_score[j / bs], score[j]);
    // The newest block is always a candidate.
    if (visible > 0) block_score[(visible - 1) / bs] = std::numeric_limits<float>::infinity();
    uint8_t* mask = p.mask + t * p.stride;
    std::fill(mask, mask + p.stride, 0);
    int64_t* top = p.block_top + t * p.top_blocks;
    const int64_t got = SelectTop(block_score, blocks, p.top_blocks, p.order, top, &queue);
    for (int64_t i = 0; i < got; ++i) {
      const int64_t b = top[i];
      if (block_score[b] == kNegInf) continue;
      std::fill(mask + b * bs, mask + std::min(visible, (b + 1) * bs), 1);
    }
  }
  return OpStatus::kOk;
}

}  // namespace flashd::kernels::cpu
