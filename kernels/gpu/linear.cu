// The linear layers on the device, as the portable correctness path: activations quantized to
// FP8 per 32 (one thread per block), then sums exactly as the CPU fast path's (per 32-block four
// lanes k % 4, the lanes' sum times the weight scale added in block order; dense weights: four
// lanes over K, the tail in lane 0, one thread per output value). Quantized weights are read by
// a thread block per output column, its threads on neighbouring K-blocks, shared by up to eight
// rows. Results equal the CPU's bit for bit. Matrix-core GEMMs come beside it, checked against
// it.
#include "kernels/codecs.h"
#include "kernels/gpu/ops.h"
#include "kernels/gpu/portability.h"

namespace flashd::kernels::FLASHD_GPU_BACKEND {
namespace {

namespace c = flashd::kernels::codecs;
constexpr unsigned kThreads = 256;
constexpr int64_t kBlock = 32;

__global__ void QuantizeKernel(const float* x, int64_t blocks, uint8_t* q, uint8_t* scales) {
  const int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= blocks) return;
  const float* xb = x + b * kBlock;
  float amax = 0.0f;
  for (int64_t i = 0; i < kBlock; ++i) amax = fmaxf(amax, fabsf(xb[i]));
  const float s = c::Pow2Ceil(fmaxf(amax, 1e-4f) * (1.0f / 448.0f));
  scales[b] = c::NormalPow2ToE8M0(s);
  for (int64_t i = 0; i < kBlock; ++i) {
    q[b * kBlock + i] = c::FloatToE4M3(c::Clamp(xb[i] / s, -448.0f, 448.0f));
  }
}

// format 0: FP8 weights [N, K] with scales [ceil(N/32), K/32]; 1: FP4 [N, K/2], scales [N, K/32].
// K-block b of weight row n decoded into wv[0..kBlock); returns the block's scale.
__device__ inline float WeightBlock(const uint8_t* w, const uint8_t* ws, int64_t n, int64_t K,
                                    int64_t b, int format, float* wv) {
  for (int64_t k = 0; k < kBlock; ++k) {
    const int64_t col = b * kBlock + k;
    if (format == 0) {
      wv[k] = c::E4M3ToFloat(w[n * K + col]);
    } else {
      const uint8_t byte = w[n * (K / 2) + col / 2];
      wv[k] = c::E2M1ToFloat((col % 2 == 0) ? (byte & 0xF) : (byte >> 4));
    }
  }
  const int64_t blocks = K / kBlock;
  return c::E8M0ToFloat(format == 0 ? ws[(n / kBlock) * blocks + b] : ws[n * blocks + b]);
}

// One thread block per output column n and group of up to kGemmRows rows: thread t takes the
// K-blocks t, t + kGemmThreads, ... (neighbouring threads read neighbouring bytes of the weight
// row, which the group's rows share), computes each block's ((p0 + p1) + (p2 + p3)) times the
// weight scale for every row, and thread 0 adds those in block order. The sums are the CPU's;
// no warp size is assumed.
constexpr unsigned kGemmThreads = 64;
constexpr int64_t kGemmRows = 8;

static_assert(kGemmRows == kExpertTileRows, "an expert slot's tiles are the GEMM's row groups");

// Output column n of rows [m0, m0 + rows) (rows <= kGemmRows), by the whole thread block.
__device__ void GemmTile(const uint8_t* xq, const uint8_t* xs, int64_t m0, int64_t rows, int64_t K,
                         const uint8_t* w, const uint8_t* ws, int64_t N, int64_t n, int format,
                         float* y) {
  __shared__ float partial[kGemmRows][kGemmThreads];
  const int64_t blocks = K / kBlock;
  const unsigned t = threadIdx.x;
  float acc[kGemmRows];
  for (int64_t r = 0; r < kGemmRows; ++r) acc[r] = 0.0f;
  for (int64_t b0 = 0; b0 < blocks; b0 += kGemmThreads) {
    const int64_t b = b0 + t;
    if (b < blocks) {
      float wv[kBlock];
      const float w_scale = WeightBlock(w, ws, n, K, b, format, wv);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t m = m0 + r;
        const float x_scale = c::E8M0ToFloat(xs[m * blocks + b]);
        float p[4] = {0, 0, 0, 0};
        for (int64_t k = 0; k < kBlock; ++k) {
          p[k % 4] += (c::E4M3ToFloat(xq[m * K + b * kBlock + k]) * x_scale) * wv[k];
        }
        partial[r][t] = ((p[0] + p[1]) + (p[2] + p[3])) * w_scale;
      }
    }
    __syncthreads();
    if (t == 0) {
      const int64_t here = blocks - b0 < kGemmThreads ? blocks - b0 : kGemmThreads;
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t j = 0; j < here; ++j) acc[r] += partial[r][j];
      }
    }
    __syncthreads();
  }
  if (t == 0) {
    for (int64_t r = 0; r < rows; ++r) y[(m0 + r) * N + n] = acc[r];
  }
}

__global__ void QuantizedGemmKernel(const uint8_t* xq, const uint8_t* xs, int64_t M, int64_t K,
                                    const uint8_t* w, const uint8_t* ws, int64_t N, int format,
                                    float* y) {
  const int64_t n = blockIdx.x % N, m0 = (blockIdx.x / N) * kGemmRows;
  const int64_t rows = M - m0 < kGemmRows ? M - m0 : kGemmRows;
  GemmTile(xq, xs, m0, rows, K, w, ws, N, n, format, y);
}

// The experts' GEMMs over grouped rows: thread block (tile g, column n), g the slots' row groups
// counted through (slot_tiles); the tiles past the last slot's have nothing to do. A tile's slot
// is found by a binary search of slot_tiles.
__global__ void ExpertGemmKernel(const uint8_t* xq, const uint8_t* xs, int64_t K,
                                 const int64_t* slot_expert, const int64_t* slot_offset,
                                 const int64_t* slot_tiles, int64_t slots, const uint8_t* const* w,
                                 const uint8_t* const* ws, int64_t N, int format, float* y) {
  const int64_t n = blockIdx.x % N, g = blockIdx.x / N;
  if (g >= slot_tiles[slots]) return;
  int64_t lo = 0, hi = slots;  // slot_tiles[lo] <= g < slot_tiles[hi]
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    if (slot_tiles[mid] <= g) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  const int64_t m0 = slot_offset[lo] + (g - slot_tiles[lo]) * kGemmRows;
  const int64_t left = slot_offset[lo + 1] - m0;
  const int64_t e = slot_expert[lo];
  GemmTile(xq, xs, m0, left < kGemmRows ? left : kGemmRows, K, w[e], ws[e], N, n, format, y);
}

// The free-order schedule (LinearFreeOrder), for measuring what the fixed order costs: thread t
// keeps one running sum per row over its K-blocks, the block's threads meet in a tree, and with
// `split` > 1 the K-blocks are shared by `split` thread blocks per output tile, whose sums land
// by atomic adds into a zeroed output. Sums in no order the CPU has, and with atomics in the
// order the blocks finish.
__global__ void FreeOrderGemmKernel(const uint8_t* xq, const uint8_t* xs, int64_t M, int64_t K,
                                    const uint8_t* w, const uint8_t* ws, int64_t N, int format,
                                    int split, float* y) {
  __shared__ float partial[kGemmRows][kGemmThreads];
  const int64_t tile = blockIdx.x / split, part = blockIdx.x % split;
  const int64_t n = tile % N, m0 = (tile / N) * kGemmRows;
  const int64_t rows = M - m0 < kGemmRows ? M - m0 : kGemmRows;
  const int64_t blocks = K / kBlock;
  const int64_t lo = blocks * part / split, hi = blocks * (part + 1) / split;
  const unsigned t = threadIdx.x;
  float acc[kGemmRows];
  for (int64_t r = 0; r < kGemmRows; ++r) acc[r] = 0.0f;
  for (int64_t b = lo + t; b < hi; b += kGemmThreads) {
    float wv[kBlock];
    const float w_scale = WeightBlock(w, ws, n, K, b, format, wv);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t m = m0 + r;
      float dot = 0.0f;
      const uint8_t* xb = xq + m * K + b * kBlock;
      for (int64_t k = 0; k < kBlock; ++k) dot += c::E4M3ToFloat(xb[k]) * wv[k];
      acc[r] += dot * (c::E8M0ToFloat(xs[m * blocks + b]) * w_scale);
    }
  }
  for (int64_t r = 0; r < rows; ++r) partial[r][t] = acc[r];
  __syncthreads();
  for (unsigned half = kGemmThreads / 2; half > 0; half /= 2) {
    if (t < half) {
      for (int64_t r = 0; r < rows; ++r) partial[r][t] += partial[r][t + half];
    }
    __syncthreads();
  }
  if (t == 0) {
    for (int64_t r = 0; r < rows; ++r) {
      if (split == 1) {
        y[(m0 + r) * N + n] = partial[r][0];
      } else {
        atomicAdd(&y[(m0 + r) * N + n], partial[r][0]);
      }
    }
  }
}

__global__ void ZeroKernel(float* y, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) y[i] = 0.0f;
}

__device__ inline float Weight(const float* w, int64_t i) { return w[i]; }
__device__ inline float Weight(const uint16_t* w, int64_t i) { return c::Bf16ToFloat(w[i]); }

// Dense weights as fp32 values or BF16 codes (the same sums either way).
template <class W>
__global__ void DenseGemmKernel(const float* x, int64_t M, int64_t K, const W* w, int64_t N,
                                float* y) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= M * N) return;
  const int64_t m = i / N, n = i % N;
  const float* xm = x + m * K;
  const W* wn = w + n * K;
  float p0 = 0, p1 = 0, p2 = 0, p3 = 0;
  int64_t k = 0;
  for (; k + 4 <= K; k += 4) {
    p0 += xm[k] * Weight(wn, k);
    p1 += xm[k + 1] * Weight(wn, k + 1);
    p2 += xm[k + 2] * Weight(wn, k + 2);
    p3 += xm[k + 3] * Weight(wn, k + 3);
  }
  for (; k < K; ++k) p0 += xm[k] * Weight(wn, k);
  y[m * N + n] = (p0 + p1) + (p2 + p3);
}

unsigned Blocks(int64_t n) { return static_cast<unsigned>((n + kThreads - 1) / kThreads); }

// FP8 or FP4 weights: the activations quantized, then the fixed-order GEMM (split 0) or the
// free-order one split `split` ways over K.
OpStatus QuantizedLinear(const LinearParams& p, int split) {
  if (p.in % kBlock != 0) return OpStatus::kBadShape;
  if (p.w == nullptr || p.w_scales == nullptr || p.x_codes == nullptr || p.x_scales == nullptr) {
    return OpStatus::kBadArgument;
  }
  const gpuStream_t stream = static_cast<gpuStream_t>(p.stream);
  const int64_t groups = (p.rows + kGemmRows - 1) / kGemmRows;
  const int64_t grid = groups * p.out * (split > 1 ? split : 1);
  if (grid > int64_t{0x7FFFFFFF}) return OpStatus::kBadShape;  // The grid's limit.
  const int64_t blocks = p.rows * p.in / kBlock;
  const int format = p.format == WeightFormat::kFp8 ? 0 : 1;
  FLASHD_LAUNCH(QuantizeKernel, Blocks(blocks), kThreads, 0, stream, p.x, blocks, p.x_codes,
                p.x_scales);
  if (split == 0) {
    FLASHD_LAUNCH(QuantizedGemmKernel, static_cast<unsigned>(grid), kGemmThreads, 0, stream,
                  p.x_codes, p.x_scales, p.rows, p.in, p.w, p.w_scales, p.out, format, p.y);
  } else {
    if (split > 1) {
      FLASHD_LAUNCH(ZeroKernel, Blocks(p.rows * p.out), kThreads, 0, stream, p.y, p.rows * p.out);
    }
    FLASHD_LAUNCH(FreeOrderGemmKernel, static_cast<unsigned>(grid), kGemmThreads, 0, stream,
                  p.x_codes, p.x_scales, p.rows, p.in, p.w, p.w_scales, p.out, format, split, p.y);
  }
  return gpuGetLastError() == gpuSuccess ? OpStatus::kOk : OpStatus::kDeviceError;
}

}  // namespace

OpStatus ExpertLinear(const ExpertLinearParams& p) {
  if (p.rows < 0 || p.in <= 0 || p.out <= 0 || p.slots < 0 || p.experts <= 0) {
    return OpStatus::kBadShape;
  }
  if (p.format != WeightFormat::kFp8 && p.format != WeightFormat::kFp4) {
    return OpStatus::kBadArgument;
  }
  if (p.in % kBlock != 0) return OpStatus::kBadShape;
  if (p.rows == 0 || p.slots == 0) return OpStatus::kOk;
  // Every slot's rows in whole tiles: at most rows / kGemmRows plus one partial tile per slot.
  const int64_t grid = ((p.rows + kGemmRows - 1) / kGemmRows + p.slots) * p.out;
  if (grid > int64_t{0x7FFFFFFF}) return OpStatus::kBadShape;
  const gpuStream_t stream = static_cast<gpuStream_t>(p.stream);
  const int64_t blocks = p.rows * p.in / kBlock;
  FLASHD_LAUNCH(QuantizeKernel, Blocks(blocks), kThreads, 0, stream, p.x, blocks, p.x_codes,
                p.x_scales);
  FLASHD_LAUNCH(ExpertGemmKernel, static_cast<unsigned>(grid), kGemmThreads, 0, stream, p.x_codes,
                p.x_scales, p.in, p.slot_expert, p.slot_offset, p.slot_tiles, p.slots, p.w,
                p.w_scales, p.out, p.format == WeightFormat::kFp8 ? 0 : 1, p.y);
  return gpuGetLastError() == gpuSuccess ? OpStatus::kOk : OpStatus::kDeviceError;
}

OpStatus Linear(const LinearParams& p) {
  if (p.rows < 0 || p.in <= 0 || p.out <= 0 || p.x == nullptr || p.y == nullptr) {
    return OpStatus::kBadShape;
  }
  if (p.rows == 0) return OpStatus::kOk;
  const gpuStream_t stream = static_cast<gpuStream_t>(p.stream);
  if (p.format == WeightFormat::kDense) {
    if (p.dense == nullptr) return OpStatus::kBadArgument;
    FLASHD_LAUNCH(DenseGemmKernel<float>, Blocks(p.rows * p.out), kThreads, 0, stream, p.x, p.rows,
                  p.in, p.dense, p.out, p.y);
    return gpuGetLastError() == gpuSuccess ? OpStatus::kOk : OpStatus::kDeviceError;
  }
  if (p.format == WeightFormat::kBf16) {
    if (p.w == nullptr) return OpStatus::kBadArgument;
    FLASHD_LAUNCH(DenseGemmKernel<uint16_t>, Blocks(p.rows * p.out), kThreads, 0, stream, p.x,
                  p.rows, p.in, reinterpret_cast<const uint16_t*>(p.w), p.out, p.y);
    return gpuGetLastError() == gpuSuccess ? OpStatus::kOk : OpStatus::kDeviceError;
  }
  return QuantizedLinear(p, 0);
}

OpStatus LinearFreeOrder(const LinearParams& p, int split) {
  if (p.rows < 0 || p.in <= 0 || p.out <= 0 || p.x == nullptr || p.y == nullptr) {
    return OpStatus::kBadShape;
  }
  if (split < 1 || p.format == WeightFormat::kDense || p.format == WeightFormat::kBf16) {
    return OpStatus::kBadArgument;
  }
  if (p.rows == 0) return OpStatus::kOk;
  return QuantizedLinear(p, split);
}

}  // namespace flashd::kernels::FLASHD_GPU_BACKEND
