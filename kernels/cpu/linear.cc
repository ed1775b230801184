#include "kernels/cpu/linear.h"

#include <algorithm>
#include <thread>
#include <vector>

#include "kernels/cpu/formats.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/parallel.h"
#include "kernels/cpu/simd.h"

namespace flashd::kernels::cpu {
namespace internal {

// sum over blocks b, in order, of (the 32 products of block b summed in four lanes k % 4, then
// (p0 + p1) + (p2 + p3)) times scales[b]: the fast path's fixed order of additions. The plain
// version is the definition; the vector versions compute the same lanes, one block per 128 bits.
float ScaledBlockDotPlain(const float* x, const float* w, const float* scales, size_t blocks) {
  float acc = 0.0f;
  for (size_t b = 0; b < blocks; ++b) {
    const float* xb = x + b * kQuantBlock;
    const float* wb = w + b * kQuantBlock;
    float p0 = 0, p1 = 0, p2 = 0, p3 = 0;
    for (size_t k = 0; k < kQuantBlock; k += 4) {
      p0 += xb[k] * wb[k];
      p1 += xb[k + 1] * wb[k + 1];
      p2 += xb[k + 2] * wb[k + 2];
      p3 += xb[k + 3] * wb[k + 3];
    }
    acc += ((p0 + p1) + (p2 + p3)) * scales[b];
  }
  return acc;
}

#if FLASHD_X86_VECTORS
// (p0 + p1) + (p2 + p3) of one block's four lanes.

float ScaledBlockDotSse(const float* x, const float* w, const float* scales, size_t blocks) {
  float acc = 0.0f;
  for (size_t b = 0; b < blocks; ++b) {
    __m128 p = _mm_setzero_ps();
    for (size_t k = 0; k < kQuantBlock; k += 4) {
      p = _mm_add_ps(p, _mm_mul_ps(_mm_loadu_ps(x + b * kQuantBlock + k),
                                   _mm_loadu_ps(w + b * kQuantBlock + k)));
    }
    acc += LaneSum4(p) * scales[b];
  }
  return acc;
}

// Two blocks at once, one per 128-bit half.
__attribute__((target("avx2"))) float ScaledBlockDotAvx2(const float* x, const float* w,
                                                         const float* scales, size_t blocks) {
  float acc = 0.0f;
  size_t b = 0;
  for (; b + 2 <= blocks; b += 2) {
    const float* x0 = x + b * kQuantBlock;
    const float* w0 = w + b * kQuantBlock;
    __m256 p = _mm256_setzero_ps();
    for (size_t k = 0; k < kQuantBlock; k += 4) {
      const __m256 xv = _mm256_set_m128(_mm_loadu_ps(x0 + kQuantBlock + k), _mm_loadu_ps(x0 + k));
      const __m256 wv = _mm256_set_m128(_mm_loadu_ps(w0 + kQuantBlock + k), _mm_loadu_ps(w0 + k));
      p = _mm256_add_ps(p, _mm256_mul_ps(xv, wv));
    }
    acc += LaneSum4(_mm256_castps256_ps128(p)) * scales[b];
    acc += LaneSum4(_mm256_extractf128_ps(p, 1)) * scales[b + 1];
  }
  if (b < blocks) {
    acc += ScaledBlockDotSse(x + b * kQuantBlock, w + b * kQuantBlock, scales + b, 1);
  }
  return acc;
}
#endif

#if FLASHD_X86_VECTORS
// Four activation rows against one weight row: the same lanes and order as ScaledBlockDotAvx2
// for each row, with the weight loads shared and four independent chains in flight.
__attribute__((target("avx2"))) void ScaledBlockDot4Avx2(const float* x, size_t x_stride,
                                                         const float* w, const float* scales,
                                                         size_t blocks, float* out) {
  float acc[4] = {0, 0, 0, 0};
  size_t b = 0;
  for (; b + 2 <= blocks; b += 2) {
    const float* w0 = w + b * kQuantBlock;
    __m256 p[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                   _mm256_setzero_ps()};
    for (size_t k = 0; k < kQuantBlock; k += 4) {
      const __m256 wv = _mm256_set_m128(_mm_loadu_ps(w0 + kQuantBlock + k), _mm_loadu_ps(w0 + k));
      for (size_t r = 0; r < 4; ++r) {
        const float* x0 = x + r * x_stride + b * kQuantBlock;
        const __m256 xv = _mm256_set_m128(_mm_loadu_ps(x0 + kQuantBlock + k), _mm_loadu_ps(x0 + k));
        p[r] = _mm256_add_ps(p[r], _mm256_mul_ps(xv, wv));
      }
    }
    for (size_t r = 0; r < 4; ++r) {
      acc[r] += LaneSum4(_mm256_castps256_ps128(p[r])) * scales[b];
      acc[r] += LaneSum4(_mm256_extractf128_ps(p[r], 1)) * scales[b + 1];
    }
  }
  for (size_t r = 0; r < 4; ++r) {
    if (b < blocks) {
      acc[r] +=
          ScaledBlockDotSse(x + r * x_stride + b * kQuantBlock, w + b * kQuantBlock, scales + b, 1);
    }
    out[r] = acc[r];
  }
}
#endif

float DenseDotPlain(const float* x, const float* w, size_t K) {
  float p0 = 0, p1 = 0, p2 = 0, p3 = 0;
  size_t k = 0;
  for (; k + 4 <= K; k += 4) {
    p0 += x[k] * w[k];
    p1 += x[k + 1] * w[k + 1];
    p2 += x[k + 2] * w[k + 2];
    p3 += x[k + 3] * w[k + 3];
  }
  for (; k < K; ++k) p0 += x[k] * w[k];
  return (p0 + p1) + (p2 + p3);
}

#if FLASHD_X86_VECTORS
void DenseDot4Sse(const float* x, size_t x_stride, const float* w, size_t K, float* out) {
  __m128 p[4] = {_mm_setzero_ps(), _mm_setzero_ps(), _mm_setzero_ps(), _mm_setzero_ps()};
  size_t k = 0;
  for (; k + 4 <= K; k += 4) {
    const __m128 wv = _mm_loadu_ps(w + k);
    for (size_t r = 0; r < 4; ++r) {
      p[r] = _mm_add_ps(p[r], _mm_mul_ps(_mm_loadu_ps(x + r * x_stride + k), wv));
    }
  }
  for (size_t r = 0; r < 4; ++r) {
    float lane[4];
    _mm_storeu_ps(lane, p[r]);
    for (size_t t = k; t < K; ++t) lane[0] += x[r * x_stride + t] * w[t];
    out[r] = (lane[0] + lane[1]) + (lane[2] + lane[3]);
  }
}
#endif

bool CpuHasAvx2() {
#if FLASHD_X86_VECTORS
  static const bool avx2 = __builtin_cpu_supports("avx2");
  return avx2;
#else
  return false;
#endif
}

float ScaledBlockDot(const float* x, const float* w, const float* scales, size_t blocks) {
#if FLASHD_X86_VECTORS
  return CpuHasAvx2() ? ScaledBlockDotAvx2(x, w, scales, blocks)
                      : ScaledBlockDotSse(x, w, scales, blocks);
#else
  return ScaledBlockDotPlain(x, w, scales, blocks);
#endif
}

}  // namespace internal

namespace {
using internal::ScaledBlockDot;

bool ShapeOk(size_t M, size_t K, size_t N) {
  return M > 0 && N > 0 && K > 0 && K % kQuantBlock == 0;
}

// Decodes one weight row to floats without its scales: the value grid of each format.
FLASHD_VECTOR_CLONES void DecodeFp8Row(const uint8_t* w, size_t K, float* out) {
  for (size_t k = 0; k < K; ++k) out[k] = E4M3ToFloatArith(w[k]);
}

void DecodeFp4Row(const uint8_t* w, size_t K, float* out) {
  const float* pairs = E2M1PairTable();
  for (size_t k = 0; k < K; k += 2) {
    const float* p = &pairs[2 * w[k / 2]];
    out[k] = p[0];
    out[k + 1] = p[1];
  }
}

// The shared fast path: w_row_scale(n, kb) gives the weight scale of row n, K-block kb.
template <typename DecodeRow, typename RowBytes, typename WeightScale>
void FastLinear(const uint8_t* x_q, const uint8_t* x_s, size_t M, size_t K, const uint8_t* w,
                size_t N, float* y, int threads, DecodeRow decode, RowBytes row_bytes,
                WeightScale w_scale) {
  const size_t blocks = K / kQuantBlock;
  // Activations are decoded once with their scales applied; a power-of-two scale makes that exact.
  std::vector<float> x(M * K);
  for (size_t m = 0; m < M; ++m) {
    DequantizeFp8PerBlock(x_q + m * K, x_s + m * blocks, K, kQuantBlock, x.data() + m * K);
  }
  // A range is worth waking a worker for from about 64K multiply-adds.
  const size_t min_rows = std::max<size_t>(1, (size_t{1} << 16) / (M * K));
  ParallelRanges(
      N, threads,
      [&](size_t begin, size_t end) {
        std::vector<float> row(K), scales(blocks);
        for (size_t n = begin; n < end; ++n) {
          decode(w + n * row_bytes, K, row.data());
          for (size_t b = 0; b < blocks; ++b) scales[b] = w_scale(n, b);
          size_t m = 0;
          if (internal::CpuHasAvx2()) {
            float out[4];
            for (; m + 4 <= M; m += 4) {
              internal::ScaledBlockDot4Avx2(x.data() + m * K, K, row.data(), scales.data(), blocks,
                                            out);
              for (size_t i = 0; i < 4; ++i) y[(m + i) * N + n] = out[i];
            }
          }
          for (; m < M; ++m) {
            y[m * N + n] = ScaledBlockDot(x.data() + m * K, row.data(), scales.data(), blocks);
          }
        }
      },
      min_rows);
}

}  // namespace

KernelStatus Fp8LinearRef(const uint8_t* x_q, const uint8_t* x_s, size_t M, size_t K,
                          const uint8_t* w_q, const uint8_t* w_s, size_t N, float* y) {
  if (!ShapeOk(M, K, N)) return KernelStatus::kBadShape;
  const size_t blocks = K / kQuantBlock;
  for (size_t m = 0; m < M; ++m) {
    for (size_t n = 0; n < N; ++n) {
      float acc = 0.0f;
      for (size_t b = 0; b < blocks; ++b) {
        float partial = 0.0f;
        for (size_t k = b * kQuantBlock; k < (b + 1) * kQuantBlock; ++k) {
          partial += E4M3ToFloat(x_q[m * K + k]) * E4M3ToFloat(w_q[n * K + k]);
        }
        acc += partial * E8M0ToFloat(x_s[m * blocks + b]) *
               E8M0ToFloat(w_s[(n / kQuantBlock) * blocks + b]);
      }
      y[m * N + n] = acc;
    }
  }
  return KernelStatus::kOk;
}

KernelStatus Fp4LinearRef(const uint8_t* x_q, const uint8_t* x_s, size_t M, size_t K,
                          const uint8_t* w_packed, const uint8_t* w_s, size_t N, float* y) {
  if (!ShapeOk(M, K, N)) return KernelStatus::kBadShape;
  const size_t blocks = K / kQuantBlock;
  for (size_t m = 0; m < M; ++m) {
    for (size_t n = 0; n < N; ++n) {
      float acc = 0.0f;
      for (size_t b = 0; b < blocks; ++b) {
        float partial = 0.0f;
        for (size_t k = b * kQuantBlock; k < (b + 1) * kQuantBlock; ++k) {
          uint8_t byte = w_packed[n * (K / 2) + k / 2];
          uint8_t code = (k % 2 == 0) ? (byte & 0xF) : (byte >> 4);
          partial += E4M3ToFloat(x_q[m * K + k]) * E2M1ToFloat(code);
        }
        acc += partial * E8M0ToFloat(x_s[m * blocks + b]) * E8M0ToFloat(w_s[n * blocks + b]);
      }
      y[m * N + n] = acc;
    }
  }
  return KernelStatus::kOk;
}

KernelStatus Fp8Linear(const uint8_t* x_q, const uint8_t* x_s, size_t M, size_t K,
                       const uint8_t* w_q, const uint8_t* w_s, size_t N, float* y, int threads) {
  if (!ShapeOk(M, K, N)) return KernelStatus::kBadShape;
  const size_t blocks = K / kQuantBlock;
  FastLinear(x_q, x_s, M, K, w_q, N, y, threads, DecodeFp8Row, K,
             [&](size_t n, size_t b) { return E8M0ToFloat(w_s[(n / kQuantBlock) * blocks + b]); });
  return KernelStatus::kOk;
}

KernelStatus Fp4Linear(const uint8_t* x_q, const uint8_t* x_s, size_t M, size_t K,
                       const uint8_t* w_packed, const uint8_t* w_s, size_t N, float* y,
                       int threads) {
  if (!ShapeOk(M, K, N)) return KernelStatus::kBadShape;
  const size_t blocks = K / kQuantBlock;
  FastLinear(x_q, x_s, M, K, w_packed, N, y, threads, DecodeFp4Row, K / 2,
             [&](size_t n, size_t b) { return E8M0ToFloat(w_s[n * blocks + b]); });
  return KernelStatus::kOk;
}

void DenseLinearRef(const float* x, size_t M, size_t K, const float* w, size_t N, float* y) {
  for (size_t m = 0; m < M; ++m) {
    for (size_t n = 0; n < N; ++n) {
      float acc = 0.0f;
      for (size_t k = 0; k < K; ++k) acc += x[m * K + k] * w[n * K + k];
      y[m * N + n] = acc;
    }
  }
}

namespace {

// Output column n (y[m, n] for every row m) from weight row wn.
void DenseColumn(const float* x, size_t M, size_t K, const float* wn, size_t N, size_t n,
                 float* y) {
  size_t m = 0;
#if FLASHD_X86_VECTORS
  // Four rows at once, each in its own register of the same four lanes.
  for (; m + 4 <= M; m += 4) {
    float out[4];
    internal::DenseDot4Sse(x + m * K, K, wn, K, out);
    for (size_t r = 0; r < 4; ++r) y[(m + r) * N + n] = out[r];
  }
#endif
  for (; m < M; ++m) y[m * N + n] = internal::DenseDotPlain(x + m * K, wn, K);
}

}  // namespace

void DenseLinear(const float* x, size_t M, size_t K, const float* w, size_t N, float* y,
                 int threads) {
  // A range is worth waking a worker for from about 64K multiply-adds.
  const size_t min_rows = std::max<size_t>(1, (size_t{1} << 16) / (M * K));
  ParallelRanges(
      N, threads,
      [&](size_t begin, size_t end) {
        for (size_t n = begin; n < end; ++n) DenseColumn(x, M, K, w + n * K, N, n, y);
      },
      min_rows);
}

// DenseLinear over BF16 codes: each weight row decoded to the fp32 values DenseLinear would be
// given, then summed the same way, so the two agree bit for bit.
void DenseLinearBf16(const float* x, size_t M, size_t K, const uint16_t* w, size_t N, float* y,
                     int threads) {
  const size_t min_rows = std::max<size_t>(1, (size_t{1} << 16) / (M * K));
  ParallelRanges(
      N, threads,
      [&](size_t begin, size_t end) {
        std::vector<float> row(K);
        for (size_t n = begin; n < end; ++n) {
          for (size_t k = 0; k < K; ++k) row[k] = Bf16ToFloat(w[n * K + k]);
          DenseColumn(x, M, K, row.data(), N, n, y);
        }
      },
      min_rows);
}

}  // namespace flashd::kernels::cpu

namespace flashd::kernels::cpu {

OpStatus Linear(const LinearParams& p) {
  if (p.rows < 0 || p.in <= 0 || p.out <= 0 || p.x == nullptr || p.y == nullptr) {
    return OpStatus::kBadShape;
  }
  if (p.rows == 0) return OpStatus::kOk;
  const size_t rows = static_cast<size_t>(p.rows), in = static_cast<size_t>(p.in);
  const size_t out = static_cast<size_t>(p.out);
  const int threads = StreamThreads(p.stream);
  if (p.format == WeightFormat::kDense) {
    if (p.dense == nullptr) return OpStatus::kBadArgument;
    DenseLinear(p.x, rows, in, p.dense, out, p.y, threads);
    return OpStatus::kOk;
  }
  if (p.format == WeightFormat::kBf16) {
    if (p.w == nullptr) return OpStatus::kBadArgument;
    DenseLinearBf16(p.x, rows, in, reinterpret_cast<const uint16_t*>(p.w), out, p.y, threads);
    return OpStatus::kOk;
  }
  if (p.in % kQuantBlock != 0) return OpStatus::kBadShape;
  if (p.w == nullptr || p.w_scales == nullptr || p.x_codes == nullptr || p.x_scales == nullptr) {
    return OpStatus::kBadArgument;
  }
  for (size_t r = 0; r < rows; ++r) {
    QuantizeFp8PerBlock(p.x + r * in, in, kQuantBlock, p.x_codes + r * in,
                        p.x_scales + r * in / kQuantBlock);
  }
  const KernelStatus s =
      p.format == WeightFormat::kFp8
          ? Fp8Linear(p.x_codes, p.x_scales, rows, in, p.w, p.w_scales, out, p.y, threads)
          : Fp4Linear(p.x_codes, p.x_scales, rows, in, p.w, p.w_scales, out, p.y, threads);
  return s == KernelStatus::kOk ? OpStatus::kOk : OpStatus::kBadShape;
}

}  // namespace flashd::kernels::cpu
