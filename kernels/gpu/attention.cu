// Sparse attention on the device, as the portable correctness path: one thread per query and
// head walks that query's key list (kernels/ops.h: the window's slots, then the selected
// entries) in blocks of kAttentionBlock, with the release's online softmax: the block's
// largest logit, then its probabilities (fp32 into the denominator, BF16 into the values'
// sum), the running sums rescaled by exp(m - m'). Each dot product sums over the dimensions in
// order and each block's weighted sum over its keys in list order, as the CPU's do, so only
// exp() may differ in the last bit. The output is rounded to BF16 and rotated back by the Rope
// op. The split-KV kernels for long contexts come beside it, checked against it.
#include <cmath>

#include "kernels/codecs.h"
#include "kernels/gpu/ops.h"
#include "kernels/gpu/portability.h"

namespace flashd::kernels::FLASHD_GPU_BACKEND {
namespace {

namespace c = flashd::kernels::codecs;
constexpr unsigned kThreads = 64;

// Key j of query t in list order: the window keys first (AttentionKeys), then the selected
// compressed rows that are not -1.
struct Keys {
  SparseAttentionParams p;
  int64_t t;
  AttentionKeys window;

  __device__ __host__ float Value(int64_t j, int64_t d) const {
    if (j < window.count()) {
      const int64_t q = window.Position(j);
      if (q >= p.fresh_first) return p.fresh[(q - p.fresh_first) * p.head_dim + d];
      const int64_t slot = q % p.window;
      return c::E4M3ToFloat(p.ring_codes[slot * p.head_dim + d]) *
             c::E8M0ToFloat(p.ring_scales[slot * p.head_dim / 32 + d / 32]);
    }
    const int64_t entry = SelectedEntry(j - window.count());
    const int64_t row = BlockRow(p.block_table, p.kv_codes.rows_per_block, entry);
    const uint8_t byte = p.kv_codes.Row(row)[d / 2];
    const uint8_t code = (d % 2 == 0) ? (byte & 0xF) : (byte >> 4);
    return c::E2M1ToFloat(code) * c::E4M3ToFloat(p.kv_scales.Row(row)[d / 16]);
  }
  // Key j's block of the list.
  __device__ __host__ int64_t Block(int64_t j) const {
    const int64_t w = window.count();
    return (j < w ? window.ListIndex(j) : window.selected_base() + (j - w)) / kAttentionBlock;
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
    int64_t n = window.count();
    for (int64_t s = 0; s < p.selected_stride; ++s) n += p.selected[t * p.selected_stride + s] >= 0;
    return n;
  }
};

__global__ void AttendKernel(SparseAttentionParams p) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= p.tokens * p.heads) return;
  const int64_t t = i / p.heads, h = i % p.heads, hd = p.head_dim;
  const Keys keys{p, t, AttentionKeys::Of(p, t)};
  const int64_t nk = keys.Count();
  const float* q = p.q + i * hd;
  const float scale = static_cast<float>(1.0 / sqrt(static_cast<double>(hd)));
  auto logit = [&](int64_t j) {
    float dot = 0;
    for (int64_t d = 0; d < hd; ++d) dot += q[d] * keys.Value(j, d);
    return dot * scale;
  };
  float* out = p.out + i * hd;  // The accumulator, then the output.
  for (int64_t d = 0; d < hd; ++d) out[d] = 0;
  float m = -1e30f, denom = 0;
  float weight[kAttentionBlock];
  for (int64_t j0 = 0; j0 < nk;) {
    const int64_t b = keys.Block(j0);
    int64_t j1 = j0;
    float block_max = -INFINITY;
    for (; j1 < nk && keys.Block(j1) == b; ++j1) block_max = fmaxf(block_max, logit(j1));
    const float m_new = fmaxf(m, block_max);
    const float rescale = expf(m - m_new);
    float sum = 0;
    for (int64_t j = j0; j < j1; ++j) {
      const float pj = expf(logit(j) - m_new);
      sum += pj;
      weight[j - j0] = c::RoundBf16(pj);
    }
    denom = denom * rescale + sum;
    for (int64_t d = 0; d < hd; ++d) {
      float block = 0;
      for (int64_t j = j0; j < j1; ++j) block += weight[j - j0] * keys.Value(j, d);
      out[d] = out[d] * rescale + block;
    }
    m = m_new;
    j0 = j1;
  }
  denom += expf(p.sink[h] - m);
  for (int64_t d = 0; d < hd; ++d) out[d] = c::RoundBf16(out[d] / denom);
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
