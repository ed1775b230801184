// Sparse attention on the device, as the portable correctness path: one thread per query and
// head walks that query's keys (window rows from the fresh rows or the FP8 ring, then the
// selected FP4 rows through the block table) three times: the largest logit (the sink
// included), the softmax denominator, then the weighted sum of the keys accumulated in the
// output in key order. Each dot product sums over the dimensions in order, as the CPU's does, so
// only exp() may differ in the last bit. The output is rounded to BF16 and rotated back by the
// Rope op. The split-KV kernels for long contexts come beside it, checked against it.
#include <cmath>

#include "kernels/codecs.h"
#include "kernels/gpu/ops.h"
#include "kernels/gpu/portability.h"

namespace flashd::kernels::FLASHD_GPU_BACKEND {
namespace {

namespace c = flashd::kernels::codecs;
constexpr unsigned kThreads = 64;

// Value d of key `j` of query t: window keys first (positions window_first .. window_last, which
// is the query's own position unless given), then the
// selected compressed rows that are not -1.
struct Keys {
  SparseAttentionParams p;
  int64_t t, window_keys;

  __device__ __host__ float Value(int64_t j, int64_t d) const {
    if (j < window_keys) {
      const int64_t q = p.window_first[t] + j;
      if (q >= p.fresh_first) return p.fresh[(q - p.fresh_first) * p.head_dim + d];
      const int64_t slot = q % p.window;
      return c::E4M3ToFloat(p.ring_codes[slot * p.head_dim + d]) *
             c::E8M0ToFloat(p.ring_scales[slot * p.head_dim / 32 + d / 32]);
    }
    const int64_t entry = SelectedEntry(j - window_keys);
    const int64_t row = BlockRow(p.block_table, p.kv_codes.rows_per_block, entry);
    const uint8_t byte = p.kv_codes.Row(row)[d / 2];
    const uint8_t code = (d % 2 == 0) ? (byte & 0xF) : (byte >> 4);
    return c::E2M1ToFloat(code) * c::E4M3ToFloat(p.kv_scales.Row(row)[d / 16]);
  }
  // The i-th selected entry that is not -1.
  __device__ __host__ int64_t SelectedEntry(int64_t i) const {
    for (int64_t s = 0; s < p.selected_stride; ++s) {
      const int64_t e = p.selected[t * p.selected_stride + s];
      if (e < 0) continue;
      if (i-- == 0) return e;
    }
    return -1;
  }
  __device__ __host__ int64_t Count() const {
    int64_t n = window_keys;
    for (int64_t s = 0; s < p.selected_stride; ++s) n += p.selected[t * p.selected_stride + s] >= 0;
    return n;
  }
};

__global__ void AttendKernel(SparseAttentionParams p) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= p.tokens * p.heads) return;
  const int64_t t = i / p.heads, h = i % p.heads, hd = p.head_dim;
  const int64_t last = p.window_last != nullptr ? p.window_last[t] : p.positions[t];
  const Keys keys{p, t, last - p.window_first[t] + 1};
  const int64_t nk = keys.Count();
  const float* q = p.q + i * hd;
  const float scale = 1.0f / sqrtf(static_cast<float>(hd));
  auto logit = [&](int64_t j) {
    float dot = 0;
    for (int64_t d = 0; d < hd; ++d) dot += q[d] * keys.Value(j, d);
    return dot * scale;
  };
  float mx = p.sink[h];
  for (int64_t j = 0; j < nk; ++j) mx = fmaxf(mx, logit(j));
  float denom = expf(p.sink[h] - mx);
  for (int64_t j = 0; j < nk; ++j) denom += expf(logit(j) - mx);
  float* out = p.out + i * hd;
  for (int64_t d = 0; d < hd; ++d) out[d] = 0;
  for (int64_t j = 0; j < nk; ++j) {
    const float pj = expf(logit(j) - mx) / denom;
    for (int64_t d = 0; d < hd; ++d) out[d] += pj * keys.Value(j, d);
  }
  for (int64_t d = 0; d < hd; ++d) out[d] = c::RoundBf16(out[d]);
}

}  // namespace

OpStatus SparseAttention(const SparseAttentionParams& p) {
  if (p.tokens < 0 || p.heads <= 0 || p.head_dim <= 0 || p.head_dim % 32 != 0 || p.window <= 0 ||
      p.positions == nullptr || p.window_first == nullptr ||
      (p.selected_stride > 0 && (p.selected == nullptr || p.block_table == nullptr))) {
    return OpStatus::kBadShape;
  }
  const int64_t n = p.tokens * p.heads;
  if (n == 0) return OpStatus::kOk;
  FLASHD_LAUNCH(AttendKernel, static_cast<unsigned>((n + kThreads - 1) / kThreads), kThreads, 0,
                static_cast<gpuStream_t>(p.stream), p);
  if (gpuGetLastError() != gpuSuccess) return OpStatus::kDeviceError;
  // Each head rotated back by its query's position.
  return Rope({.x = p.out,
               .rows = p.tokens,
               .heads = p.heads,
               .head_dim = p.head_dim,
               .rope_dim = p.rope_dim,
               .row_stride = p.heads * p.head_dim,
               .positions = p.positions,
               .freqs = p.freqs,
               .inverse = true,
               .stream = p.stream});
}

}  // namespace flashd::kernels::FLASHD_GPU_BACKEND
