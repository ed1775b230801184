// The indexer on the device: scores (one thread per query and entry: the key decoded exactly from
// its FP4 codes, each head's dot product in the CPU's eight lanes, the same BF16 roundings, so the
// scores are equal bit for bit) and the candidate pre-filter (a thread block per query: block
// maxima, the newest block pinned, the best blocks in the total order).
#include <cmath>

#include "kernels/codecs.h"
#include "kernels/gpu/block_select.h"
#include "kernels/gpu/ops.h"
#include "kernels/gpu/portability.h"

namespace flashd::kernels::FLASHD_GPU_BACKEND {
namespace {

namespace c = flashd::kernels::codecs;
constexpr unsigned kThreads = 128;

__global__ void ScoreKernel(IndexerScoreParams p) {
  FLASHD_GRID_BEGIN();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= p.tokens * p.stride) return;
  const int64_t t = i / p.stride, j = i % p.stride;
  if (j >= p.visible[t] || (p.mask != nullptr && p.mask[i] == 0)) {
    p.scores[i] = -INFINITY;
    return;
  }
  const int64_t row = BlockRow(p.TableOf(t), p.key_codes.rows_per_block, j);
  const uint8_t* codes = p.key_codes.Row(row);
  const uint8_t* scales = p.key_scales.Row(row);
  float total = 0;
  for (int64_t h = 0; h < p.heads; ++h) {
    const float* q = p.q + (t * p.heads + h) * p.dim;
    float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t d = 0; d < p.dim; ++d) {
      const uint8_t byte = codes[d / 2];
      const float key = c::E2M1ToFloat((d % 2 == 0) ? (byte & 0xF) : (byte >> 4)) *
                        c::E8M0ToFloat(scales[d / 32]);
      lane[d % 8] += q[d] * key;
    }
    const float dot =
        ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
    total += c::RoundBf16(fmaxf(c::RoundBf16(dot), 0.0f) * p.weights[t * p.heads + h]);
  }
  p.scores[i] = c::RoundBf16(total);
}

// One thread block per query: the block maxima, the mask cleared, the best blocks (a block-wide
// selection), their entries marked.
constexpr unsigned kCandidateThreads = 256;

__global__ void CandidateKernel(CandidateFilterParams p) {
  FLASHD_GRID_BEGIN();
  const int64_t t = blockIdx.x;
  const unsigned tid = threadIdx.x;
  const int64_t bs = p.block, nb_stride = (p.stride + bs - 1) / bs;
  const int64_t visible = p.visible[t] < p.stride ? p.visible[t] : p.stride;
  const float* score = p.scores + t * p.stride;
  float* block_score = p.block_scores + t * nb_stride;
  const int64_t blocks = (visible + bs - 1) / bs;
  for (int64_t b = tid; b < blocks; b += kCandidateThreads) {
    // std::max(a, b) keeps a unless a < b: the same with NaN scores.
    float best = -INFINITY;
    const int64_t end = (b + 1) * bs < visible ? (b + 1) * bs : visible;
    for (int64_t j = b * bs; j < end; ++j) {
      if (best < score[j]) best = score[j];
    }
    block_score[b] = best;
  }
  uint8_t* mask = p.mask + t * p.stride;
  for (int64_t j = tid; j < p.stride; j += kCandidateThreads) mask[j] = 0;
  __syncthreads();
  if (tid == 0 && visible > 0) block_score[(visible - 1) / bs] = INFINITY;
  __syncthreads();
  int64_t* top = p.block_top + t * p.top_blocks;
  const int64_t got =
      gpu_select::BlockSelectTop<kCandidateThreads>(block_score, blocks, p.top_blocks, top);
  for (int64_t i = tid; i < got; i += kCandidateThreads) {
    const int64_t b = top[i];
    if (block_score[b] == -INFINITY) continue;
    const int64_t end = (b + 1) * bs < visible ? (b + 1) * bs : visible;
    for (int64_t j = b * bs; j < end; ++j) mask[j] = 1;
  }
}

}  // namespace

OpStatus IndexerScores(const IndexerScoreParams& p) {
  if (p.tokens < 0 || p.heads <= 0 || p.dim <= 0 || p.dim % 32 != 0 || p.stride < 0 ||
      (p.tokens > 0 && p.visible == nullptr) ||
      (p.stride > 0 && p.tokens > 0 &&
       (p.scores == nullptr ||
        (p.token_sequence == nullptr ? p.block_table == nullptr
                                     : p.block_tables == nullptr || p.sequence_count <= 0)))) {
    return OpStatus::kBadShape;
  }
  const int64_t n = p.tokens * p.stride;
  if (n == 0) return OpStatus::kOk;
  FLASHD_LAUNCH(ScoreKernel, static_cast<unsigned>((n + kThreads - 1) / kThreads), kThreads, 0,
                static_cast<gpuStream_t>(p.stream), p);
  return gpuGetLastError() == gpuSuccess ? OpStatus::kOk : OpStatus::kDeviceError;
}

OpStatus CandidateFilter(const CandidateFilterParams& p) {
  if (p.tokens < 0 || p.block <= 0 || p.top_blocks < 0 || p.visible == nullptr) {
    return OpStatus::kBadShape;
  }
  if (p.order != TopKOrder::kTotal) return OpStatus::kBadArgument;
  if (p.tokens == 0) return OpStatus::kOk;
  if (p.tokens > int64_t{0x7FFFFFFF}) return OpStatus::kBadShape;  // The grid's limit.
  FLASHD_LAUNCH(CandidateKernel, static_cast<unsigned>(p.tokens), kCandidateThreads, 0,
                static_cast<gpuStream_t>(p.stream), p);
  return gpuGetLastError() == gpuSuccess ? OpStatus::kOk : OpStatus::kDeviceError;
}

}  // namespace flashd::kernels::FLASHD_GPU_BACKEND
