// Element-wise and row-local ops: BF16 rounding, add-and-round, row copies, SwiGLU, the fake
// quantizers, the embedding copy and the MoE combine. Each thread computes what the CPU
// reference computes for its element, in the same order and with the same exp (kernels/fmath.h),
// so results are equal bit for bit (the combine's bins fill in any order, and are sorted).
#include <cmath>

#include "kernels/codecs.h"
#include "kernels/fmath.h"
#include "kernels/gpu/norm_row.h"
#include "kernels/gpu/ops.h"
#include "kernels/gpu/portability.h"

namespace flashd::kernels::FLASHD_GPU_BACKEND {
namespace {

namespace c = flashd::kernels::codecs;
namespace fm = flashd::kernels::fmath;
constexpr unsigned kThreads = 256;

unsigned Blocks(int64_t n) { return static_cast<unsigned>((n + kThreads - 1) / kThreads); }
gpuStream_t Stream(void* s) { return static_cast<gpuStream_t>(s); }
OpStatus Launched() {
  return gpuGetLastError() == gpuSuccess ? OpStatus::kOk : OpStatus::kDeviceError;
}

__global__ void RoundKernel(float* x, int64_t n, float scale) {
  FLASHD_GRID_BEGIN();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  x[i] = scale == 1.0f ? c::RoundBf16(x[i]) : c::RoundBf16(c::RoundBf16(x[i]) * scale);
}

__global__ void AddRoundKernel(const float* a, const float* b, float* out, int64_t n) {
  FLASHD_GRID_BEGIN();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) out[i] = c::RoundBf16(a[i] + b[i]);
}

__global__ void SwigluKernel(const float* gate, const float* up, int64_t n, int64_t inter,
                             const float* row_weights, float limit, float* h) {
  FLASHD_GRID_BEGIN();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  h[i] = fm::SwigluValue(gate[i], up[i], limit,
                         row_weights != nullptr ? row_weights + i / inter : nullptr);
}

// One thread per block of `block` values: the block's scale from its largest magnitude, then
// each value through the format and back.
__global__ void FakeQuantKernel(float* x, int64_t blocks, int64_t block, int format) {
  FLASHD_GRID_BEGIN();
  const int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b < blocks) FakeQuantBlock(x + b * block, block, format);
}

// The table as fp32 values or as BF16 codes (embed_bf16 when embed is null).
__global__ void EmbedKernel(const int32_t* tokens, int64_t count, int64_t hc, int64_t dim,
                            const float* embed, const uint16_t* embed_bf16, float* X) {
  FLASHD_GRID_BEGIN();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= count * hc * dim) return;
  const int64_t t = i / (hc * dim), d = i % dim;
  const int64_t at = static_cast<int64_t>(tokens[t]) * dim + d;
  X[i] = embed != nullptr ? embed[at] : c::Bf16ToFloat(embed_bf16[at]);
}

// One thread per value; a row's values are neighbouring threads.
__global__ void CopyRowsKernel(const float* src, int64_t src_stride, const int64_t* index,
                               int64_t rows, int64_t cols, float* dst, int64_t dst_stride) {
  FLASHD_GRID_BEGIN();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * cols) return;
  const int64_t row = i / cols, col = i % cols;
  const int64_t from = index != nullptr ? index[row] : row;
  dst[row * dst_stride + col] = src[from * src_stride + col];
}

// One thread per dimension: the contributions added in their given order; with `add`, then
// out = BF16(y + add) for each of the y_rows rows (the thread's dimension of each).
__global__ void CombineKernel(const float* expert_out, const int64_t* rows, int64_t count,
                              int64_t dim, float* y, int64_t y_rows, const float* add, float* out) {
  FLASHD_GRID_BEGIN();
  const int64_t d = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (d >= dim) return;
  for (int64_t i = 0; i < count; ++i) y[rows[i] * dim + d] += expert_out[i * dim + d];
  if (add == nullptr) return;
  for (int64_t r = 0; r < y_rows; ++r)
    out[r * dim + d] = c::RoundBf16(y[r * dim + d] + add[r * dim + d]);
}

// The binned combine. Workspace: [y_rows] counts, then [y_rows, kCombineSlots] each row's
// entries in the order the bins filled (a row of more entries keeps only its count and takes the
// whole list in order instead).
constexpr int64_t kCombineSlots = 8;      // A token's experts: 6 in the model.
constexpr int64_t kCombineMinCount = 16;  // Fewer entries: CombineKernel's loop is short.

__global__ void ZeroIntsKernel(int32_t* v, int64_t n) {
  FLASHD_GRID_BEGIN();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) v[i] = 0;
}

// Threads take the entries last to first, so that where they run in order (the HIP CPU runtime)
// the bins fill out of entry order and the sort after is tested.
__global__ void BinKernel(const int64_t* rows, int64_t count, int64_t y_rows, int32_t* work) {
  FLASHD_GRID_BEGIN();
  const int64_t i = count - 1 - (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x);
  if (i < 0) return;
  const int64_t r = rows[i];
  const int32_t slot = atomicAdd(&work[r], 1);
  if (slot < kCombineSlots) work[y_rows + r * kCombineSlots + slot] = static_cast<int32_t>(i);
}

// Block (row r, dimension chunk): the row's entries sorted into entry order by one thread, then
// y[r][d] += expert_out[i][d] for them in that order, a thread a dimension.
__global__ void CombineRowsKernel(const float* expert_out, const int64_t* rows, int64_t count,
                                  int64_t dim, int64_t y_rows, const int32_t* work, float* y,
                                  const float* add, float* out) {
  FLASHD_GRID_BEGIN();
  __shared__ int32_t entries[kCombineSlots];
  __shared__ int32_t n;
  const int64_t chunks = (dim + kThreads - 1) / kThreads;
  const int64_t r = blockIdx.x / chunks, d = blockIdx.x % chunks * kThreads + threadIdx.x;
  if (threadIdx.x == 0) {
    n = work[r];
    if (n <= kCombineSlots) {
      for (int32_t a = 0; a < n; ++a) {  // Insertion sort of a few entries.
        const int32_t e = work[y_rows + r * kCombineSlots + a];
        int32_t b = a;
        for (; b > 0 && entries[b - 1] > e; --b) entries[b] = entries[b - 1];
        entries[b] = e;
      }
    }
  }
  __syncthreads();
  if (d >= dim) return;
  float v = y[r * dim + d];
  if (n > 0) {
    if (n <= kCombineSlots) {
      for (int32_t a = 0; a < n; ++a) v += expert_out[entries[a] * dim + d];
    } else {
      for (int64_t i = 0; i < count; ++i) {
        if (rows[i] == r) v += expert_out[i * dim + d];
      }
    }
    y[r * dim + d] = v;
  }
  if (add != nullptr) out[r * dim + d] = c::RoundBf16(v + add[r * dim + d]);
}

}  // namespace

OpStatus RoundBf16(const RoundBf16Params& p) {
  if (p.n < 0) return OpStatus::kBadArgument;
  if (p.n == 0) return OpStatus::kOk;
  FLASHD_LAUNCH(RoundKernel, Blocks(p.n), kThreads, 0, Stream(p.stream), p.x, p.n, p.scale);
  return Launched();
}

OpStatus AddRound(const AddRoundParams& p) {
  if (p.n < 0) return OpStatus::kBadShape;
  if (p.n == 0) return OpStatus::kOk;
  FLASHD_LAUNCH(AddRoundKernel, Blocks(p.n), kThreads, 0, Stream(p.stream), p.a, p.b, p.out, p.n);
  return Launched();
}

OpStatus CopyRows(const CopyRowsParams& p) {
  if (p.rows < 0 || p.cols < 0 || p.src_stride < p.cols || p.dst_stride < p.cols) {
    return OpStatus::kBadShape;
  }
  const int64_t n = p.rows * p.cols;
  if (n == 0) return OpStatus::kOk;
  FLASHD_LAUNCH(CopyRowsKernel, Blocks(n), kThreads, 0, Stream(p.stream), p.src, p.src_stride,
                p.index, p.rows, p.cols, p.dst, p.dst_stride);
  return Launched();
}

OpStatus Swiglu(const SwigluParams& p) {
  if (p.rows < 0 || p.inter <= 0) return OpStatus::kBadShape;
  const int64_t n = p.rows * p.inter;
  if (n == 0) return OpStatus::kOk;
  FLASHD_LAUNCH(SwigluKernel, Blocks(n), kThreads, 0, Stream(p.stream), p.gate, p.up, n, p.inter,
                p.row_weights, p.limit, p.h);
  return Launched();
}

OpStatus FakeQuant(const FakeQuantParams& p) {
  if (p.n < 0 || p.block <= 0 || p.n % p.block != 0) return OpStatus::kBadShape;
  const int64_t blocks = p.n / p.block;
  if (blocks == 0) return OpStatus::kOk;
  FLASHD_LAUNCH(FakeQuantKernel, Blocks(blocks), kThreads, 0, Stream(p.stream), p.x, blocks,
                p.block, static_cast<int>(p.format));
  return Launched();
}

OpStatus Embed(const EmbedParams& p) {
  if (p.count < 0 || p.hc <= 0 || p.dim <= 0 || p.vocab <= 0) return OpStatus::kBadShape;
  if ((p.embed == nullptr) == (p.embed_bf16 == nullptr)) return OpStatus::kBadArgument;
  const int64_t n = p.count * p.hc * p.dim;
  if (n == 0) return OpStatus::kOk;
  FLASHD_LAUNCH(EmbedKernel, Blocks(n), kThreads, 0, Stream(p.stream), p.tokens, p.count, p.hc,
                p.dim, p.embed, p.embed_bf16, p.X);
  return Launched();
}

int64_t MoeCombineWorkspaceInts(const MoeCombineParams& p) {
  return p.y_rows > 0 && p.count >= kCombineMinCount ? p.y_rows * (1 + kCombineSlots) : 0;
}

OpStatus MoeCombine(const MoeCombineParams& p) {
  if (p.count < 0 || p.dim <= 0 || p.y_rows < 0) return OpStatus::kBadShape;
  if (p.add != nullptr && (p.y_rows == 0 || p.out == nullptr)) return OpStatus::kBadShape;
  if (p.count == 0 && p.add != nullptr) {  // Nothing combined: the rounding alone.
    return AddRound(
        {.a = p.y, .b = p.add, .n = p.y_rows * p.dim, .out = p.out, .stream = p.stream});
  }
  if (p.count == 0) return OpStatus::kOk;
  const int64_t ints = MoeCombineWorkspaceInts(p);
  const gpuStream_t stream = Stream(p.stream);
  if (ints > 0 && p.workspace != nullptr && p.workspace_ints >= ints &&
      p.y_rows * ((p.dim + kThreads - 1) / kThreads) <= int64_t{0x7FFFFFFF} &&
      p.count <= int64_t{0x7FFFFFFF}) {
    FLASHD_LAUNCH(ZeroIntsKernel, Blocks(p.y_rows), kThreads, 0, stream, p.workspace, p.y_rows);
    FLASHD_LAUNCH(BinKernel, Blocks(p.count), kThreads, 0, stream, p.rows, p.count, p.y_rows,
                  p.workspace);
    FLASHD_LAUNCH(CombineRowsKernel,
                  static_cast<unsigned>(p.y_rows * ((p.dim + kThreads - 1) / kThreads)), kThreads,
                  0, stream, p.expert_out, p.rows, p.count, p.dim, p.y_rows, p.workspace, p.y,
                  p.add, p.out);
    return Launched();
  }
  FLASHD_LAUNCH(CombineKernel, Blocks(p.dim), kThreads, 0, stream, p.expert_out, p.rows, p.count,
                p.dim, p.y, p.y_rows, p.add, p.out);
  return Launched();
}

}  // namespace flashd::kernels::FLASHD_GPU_BACKEND
