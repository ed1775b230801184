// Sparse attention on the device, as the portable path: a thread block per query and head walks
// that query's key list (kernels/ops.h: the window's slots, then the selected entries) once, in
// blocks of kAttentionBlock, each key's logit computed once (a thread per key), with the
// release's online softmax: the block's largest logit, then its probabilities (fp32 into the
// denominator, BF16 into the values' sum), the running sums rescaled by exp(m - m'). Each dot
// product sums over the dimensions in order and each block's weighted sum over its keys in list
// order, as the CPU's do, with the CPU's exp (kernels/fmath.h): the same bits. The output is
// rounded to BF16 and rotated back by the Rope op. The split-KV kernels for long contexts come
// beside it, checked against it.
#include <cmath>

#include "kernels/codecs.h"
#include "kernels/fmath.h"
#include "kernels/gpu/ops.h"
#include "kernels/gpu/portability.h"

namespace flashd::kernels::FLASHD_GPU_BACKEND {
namespace {

namespace c = flashd::kernels::codecs;
namespace fm = flashd::kernels::fmath;
constexpr unsigned kThreads = 64;

// Where key j of query t comes from, in list order: the window keys first (AttentionKeys),
// fresh rows or ring slots, then the selected compressed rows that are not -1.
enum class KeySource : uint8_t { kFresh, kRing, kCompressed };

struct Key {
  KeySource source;
  int64_t index;  // The fresh row, the ring slot or the KV row.
};

__device__ __host__ inline float KeyValue(const SparseAttentionParams& p, Key k, int64_t d) {
  switch (k.source) {
    case KeySource::kFresh:
      return p.fresh[k.index * p.head_dim + d];
    case KeySource::kRing:
      return c::E4M3ToFloat(p.ring_codes[k.index * p.head_dim + d]) *
             c::E8M0ToFloat(p.ring_scales[k.index * p.head_dim / 32 + d / 32]);
    default: {
      const uint8_t byte = p.kv_codes.Row(k.index)[d / 2];
      const uint8_t code = (d % 2 == 0) ? (byte & 0xF) : (byte >> 4);
      return c::E2M1ToFloat(code) * c::E4M3ToFloat(p.kv_scales.Row(k.index)[d / 16]);
    }
  }
}

// Walks query t's keys in list order, each looked up once: the selection row is read once for
// the whole list.
struct KeyWalk {
  const SparseAttentionParams& p;
  int64_t t;
  AttentionKeys window;
  int64_t j = 0;         // The next key's place in the list.
  int64_t selected = 0;  // The next place in the selection row to look at.

  __device__ __host__ bool Done() {
    if (j < window.count()) return false;
    while (selected < p.selected_stride && p.selected[t * p.selected_stride + selected] < 0) {
      ++selected;
    }
    return selected >= p.selected_stride;
  }
  // REQUIRES: !Done(). The next key's block of the list.
  __device__ __host__ int64_t Block() const {
    const int64_t w = window.count();
    return (j < w ? window.ListIndex(j) : window.selected_base() + (j - w)) / kAttentionBlock;
  }
  // REQUIRES: !Done(). The next key, and a step past it.
  __device__ __host__ Key Next() {
    if (j < window.count()) {
      const int64_t q = window.Position(j++);
      if (q >= p.fresh_first) return {KeySource::kFresh, q - p.fresh_first};
      return {KeySource::kRing, q % p.window};
    }
    const int64_t entry = p.selected[t * p.selected_stride + selected++];
    ++j;
    return {KeySource::kCompressed, BlockRow(p.block_table, p.kv_codes.rows_per_block, entry)};
  }
};

// One thread block per query and head. Thread 0 walks the key list and gathers a block of it;
// the threads compute its logits (a key each, its dot product over the dimensions in order);
// thread 0 takes the block's largest logit and its probabilities and denominator in list order;
// then each thread updates its dimensions of the accumulator (dimension d: the block's keys in
// list order). The same sums in the same order as the CPU's, spread over the threads.
__global__ void AttendKernel(SparseAttentionParams p) {
  __shared__ Key key[kAttentionBlock];
  __shared__ float weight[kAttentionBlock];  // The block's logits, then its BF16 probabilities.
  __shared__ int64_t count;                  // The block's keys; 0: the list is done.
  __shared__ float rescale, denom;
  const int64_t i = blockIdx.x, t = i / p.heads, h = i % p.heads, hd = p.head_dim;
  const unsigned tid = threadIdx.x, threads = blockDim.x;
  KeyWalk keys{p, t, AttentionKeys::Of(p, t)};  // Walked by thread 0 only.
  const float* q = p.q + i * hd;
  const float scale = static_cast<float>(1.0 / sqrt(static_cast<double>(hd)));
  float* out = p.out + i * hd;  // The accumulator, then the output.
  for (int64_t d = tid; d < hd; d += threads) out[d] = 0;
  float m = -1e30f;  // Thread 0's running maximum.
  if (tid == 0) denom = 0;
  for (;;) {
    if (tid == 0) {
      int64_t n = 0;
      if (!keys.Done()) {
        const int64_t b = keys.Block();
        do {
          key[n++] = keys.Next();
        } while (!keys.Done() && keys.Block() == b);
      }
      count = n;
    }
    __syncthreads();
    const int64_t n = count;
    if (n == 0) break;
    for (int64_t j = tid; j < n; j += threads) {
      float dot = 0;
      for (int64_t d = 0; d < hd; ++d) dot += q[d] * KeyValue(p, key[j], d);
      weight[j] = dot * scale;
    }
    __syncthreads();
    if (tid == 0) {
      float block_max = -INFINITY;
      for (int64_t j = 0; j < n; ++j) block_max = fmaxf(block_max, weight[j]);
      const float m_new = fmaxf(m, block_max);
      rescale = fm::Exp(m - m_new);
      float sum = 0;
      for (int64_t j = 0; j < n; ++j) {
        const float pj = fm::Exp(weight[j] - m_new);
        sum += pj;
        weight[j] = c::RoundBf16(pj);
      }
      denom = denom * rescale + sum;
      m = m_new;
    }
    __syncthreads();
    for (int64_t d = tid; d < hd; d += threads) {
      float block = 0;
      for (int64_t j = 0; j < n; ++j) block += weight[j] * KeyValue(p, key[j], d);
      out[d] = out[d] * rescale + block;
    }
    __syncthreads();  // Before thread 0 gathers the next block.
  }
  if (tid == 0) denom += fm::Exp(p.sink[h] - m);
  __syncthreads();
  for (int64_t d = tid; d < hd; d += threads) out[d] = c::RoundBf16(out[d] / denom);
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
  if (n > int64_t{0x7FFFFFFF}) return OpStatus::kBadShape;  // The grid's limit.
  FLASHD_LAUNCH(AttendKernel, static_cast<unsigned>(n), kThreads, 0,
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
