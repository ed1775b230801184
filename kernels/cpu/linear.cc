#include "kernels/cpu/linear.h"

#include <algorithm>
#include <cstring>
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
#endif

// The paired layout: each pair of blocks (b, b + 1) as 8 steps of 8 floats, step s holding
// elements 4s..4s+3 of block b, then the same of block b + 1; a last odd block stays as it is.
// One 256-bit load is then one step of both blocks, in the lanes the fixed order adds.
size_t PairedIndex(size_t k) {
  const size_t b = k / kQuantBlock, i = k % kQuantBlock;
  const size_t pair = b / 2;
  return pair * 2 * kQuantBlock + (i / 4) * 8 + (b % 2) * 4 + i % 4;
}

void ToPaired(const float* in, size_t K, float* out) {
  const size_t whole = (K / kQuantBlock) / 2 * 2 * kQuantBlock;  // What the pairs cover.
  for (size_t k = 0; k < whole; ++k) out[PairedIndex(k)] = in[k];
  for (size_t k = whole; k < K; ++k) out[k] = in[k];
}

#if FLASHD_X86_VECTORS
// Rows x + r x_stride (r < R; R = 1, 4 or 8), paired, against one paired weight row: for each
// row the same lanes, additions and order as ScaledBlockDotPlain, the weight loads shared by the
// R rows. The lane sums of four rows close together: two horizontal adds give each row's
// (p0 + p1) + (p2 + p3) for both blocks of a pair.
template <int R>
__attribute__((target("avx2"))) void PairedDotAvx2(const float* x, size_t x_stride, const float* w,
                                                   const float* scales, size_t blocks, float* out) {
  constexpr int G = R >= 4 ? R / 4 : 1;  // Groups of four rows (one group holds a single row).
  __m128 acc[G];
  for (int g = 0; g < G; ++g) acc[g] = _mm_setzero_ps();
  const size_t pairs = blocks / 2;
  for (size_t p = 0; p < pairs; ++p) {
    const float* wp = w + p * 2 * kQuantBlock;
    __m256 sum[R];
    for (int r = 0; r < R; ++r) sum[r] = _mm256_setzero_ps();
    for (size_t step = 0; step < 8; ++step) {
      const __m256 wv = _mm256_loadu_ps(wp + step * 8);
      for (int r = 0; r < R; ++r) {
        const __m256 xv = _mm256_loadu_ps(x + r * x_stride + p * 2 * kQuantBlock + step * 8);
        sum[r] = _mm256_add_ps(sum[r], _mm256_mul_ps(xv, wv));
      }
    }
    const __m128 s0 = _mm_set1_ps(scales[2 * p]), s1 = _mm_set1_ps(scales[2 * p + 1]);
    for (int g = 0; g < G; ++g) {
      __m256 h;
      if constexpr (R == 1) {
        const __m256 h01 = _mm256_hadd_ps(sum[0], sum[0]);
        h = _mm256_hadd_ps(h01, h01);
      } else {
        const __m256 h01 = _mm256_hadd_ps(sum[4 * g], sum[4 * g + 1]);
        const __m256 h23 = _mm256_hadd_ps(sum[4 * g + 2], sum[4 * g + 3]);
        h = _mm256_hadd_ps(h01, h23);  // Low half: block 2p of rows 4g..4g+3; high: 2p + 1.
      }
      acc[g] = _mm_add_ps(acc[g], _mm_mul_ps(_mm256_castps256_ps128(h), s0));
      acc[g] = _mm_add_ps(acc[g], _mm_mul_ps(_mm256_extractf128_ps(h, 1), s1));
    }
  }
  if (blocks % 2 == 1) {  // The odd last block, in plain order.
    const size_t at = pairs * 2 * kQuantBlock;
    const __m128 sb = _mm_set1_ps(scales[blocks - 1]);
    for (int g = 0; g < G; ++g) {
      __m128 q[4];
      constexpr int rows = R == 1 ? 1 : 4;
      for (int r = 0; r < rows; ++r) {
        q[r] = _mm_setzero_ps();
        const float* xr = x + (4 * g + r) * x_stride + at;
        for (size_t k = 0; k < kQuantBlock; k += 4) {
          q[r] = _mm_add_ps(q[r], _mm_mul_ps(_mm_loadu_ps(xr + k), _mm_loadu_ps(w + at + k)));
        }
      }
      if constexpr (R == 1) q[1] = q[2] = q[3] = q[0];
      const __m128 t = _mm_hadd_ps(_mm_hadd_ps(q[0], q[1]), _mm_hadd_ps(q[2], q[3]));
      acc[g] = _mm_add_ps(acc[g], _mm_mul_ps(t, sb));
    }
  }
  if constexpr (R == 1) {
    out[0] = _mm_cvtss_f32(acc[0]);
  } else {
    for (int g = 0; g < G; ++g) _mm_storeu_ps(out + 4 * g, acc[g]);
  }
}

void PairedDot8Avx2(const float* x, size_t x_stride, const float* w, const float* scales,
                    size_t blocks, float* out) {
  PairedDotAvx2<8>(x, x_stride, w, scales, blocks, out);
}
void PairedDot4Avx2(const float* x, size_t x_stride, const float* w, const float* scales,
                    size_t blocks, float* out) {
  PairedDotAvx2<4>(x, x_stride, w, scales, blocks, out);
}
float PairedDot1Avx2(const float* x, const float* w, const float* scales, size_t blocks) {
  float out;
  PairedDotAvx2<1>(x, 0, w, scales, blocks, &out);
  return out;
}

// Eight FP8 codes (code i in byte i of `codes`) as floats, each equal to E4M3ToFloat's: the
// magnitude's bits moved into a float's, times 2^120; the sign; NaN.
__attribute__((target("avx2"))) inline __m256 Fp8x8Avx2(uint64_t codes) {
  const __m256i mag_mask = _mm256_set1_epi32(0x7F), sign_mask = _mm256_set1_epi32(0x80);
  const __m256i c = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(codes)));
  const __m256i mag = _mm256_and_si256(c, mag_mask);
  const __m256 v =
      _mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(mag, 20)), _mm256_set1_ps(0x1p120f));
  const __m256 sign = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(c, sign_mask), 24));
  const __m256 is_nan = _mm256_castsi256_ps(_mm256_cmpeq_epi32(mag, mag_mask));
  const __m256 nan = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000));
  return _mm256_blendv_ps(_mm256_or_ps(v, sign), nan, is_nan);
}

// The eight FP8 codes at `w` times `scale`: their exact values when `scale` is their block's (as
// DequantizeFp8Weight gives them).
__attribute__((target("avx2"))) inline __m256 Fp8x8ScaledAvx2(const uint8_t* w, __m256 scale) {
  uint64_t codes;
  std::memcpy(&codes, w, 8);
  return _mm256_mul_ps(Fp8x8Avx2(codes), scale);
}

// An FP8 weight row's exact values (code times its 32-block's scale), eight values per step; K a
// multiple of 32.
__attribute__((target("avx2"))) void DecodeFp8RowScaledAvx2(const uint8_t* w, const uint8_t* s,
                                                            size_t K, float* out) {
  for (size_t b = 0; b < K / kQuantBlock; ++b) {
    const __m256 scale = _mm256_set1_ps(E8M0ToFloat(s[b]));
    for (size_t k = b * kQuantBlock; k < (b + 1) * kQuantBlock; k += 8) {
      _mm256_storeu_ps(out + k, Fp8x8ScaledAvx2(w + k, scale));
    }
  }
}

// DenseDot1Sse's sums over an FP8 row's exact values decoded on the way (no row buffer): the
// same multiplies and adds in the same order, so the same result; the decoding overlaps the
// chain of adds that bounds that loop. K a multiple of 32.
__attribute__((target("avx2"))) float DenseDot1Fp8Avx2(const float* x, const uint8_t* w,
                                                       const uint8_t* s, size_t K) {
  __m128 p = _mm_setzero_ps();
  for (size_t b = 0; b < K / kQuantBlock; ++b) {
    const __m256 scale = _mm256_set1_ps(E8M0ToFloat(s[b]));
    for (size_t k = b * kQuantBlock; k < (b + 1) * kQuantBlock; k += 8) {
      const __m256 value = Fp8x8ScaledAvx2(w + k, scale);
      p = _mm_add_ps(p, _mm_mul_ps(_mm_loadu_ps(x + k), _mm256_castps256_ps128(value)));
      p = _mm_add_ps(p, _mm_mul_ps(_mm_loadu_ps(x + k + 4), _mm256_extractf128_ps(value, 1)));
    }
  }
  float lane[4];
  _mm_storeu_ps(lane, p);
  return (lane[0] + lane[1]) + (lane[2] + lane[3]);
}

// Weight rows decoded straight into the paired layout, eight values per step.
__attribute__((target("avx2"))) void DecodeFp8RowPairedAvx2(const uint8_t* w, size_t K,
                                                            float* out) {
  const size_t blocks = K / kQuantBlock, pairs = blocks / 2;
  for (size_t p = 0; p < pairs; ++p) {
    const uint8_t* b0 = w + 2 * p * kQuantBlock;
    const uint8_t* b1 = b0 + kQuantBlock;
    for (size_t step = 0; step < 8; ++step) {
      uint32_t lo, hi;
      std::memcpy(&lo, b0 + 4 * step, 4);
      std::memcpy(&hi, b1 + 4 * step, 4);
      _mm256_storeu_ps(out + p * 2 * kQuantBlock + step * 8, Fp8x8Avx2(lo | uint64_t{hi} << 32));
    }
  }
  for (size_t k = pairs * 2 * kQuantBlock; k < K; ++k) out[k] = E4M3ToFloatArith(w[k]);
}

__attribute__((target("avx2"))) void DecodeFp4RowPairedAvx2(const uint8_t* w, size_t K,
                                                            float* out) {
  const size_t blocks = K / kQuantBlock, pairs = blocks / 2;
  float magnitudes[8];
  for (int c = 0; c < 8; ++c) magnitudes[c] = E2M1ToFloat(static_cast<uint8_t>(c));
  const __m256 table = _mm256_loadu_ps(magnitudes);
  const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
  const __m256i nibble = _mm256_set1_epi32(0xF), sign_bit = _mm256_set1_epi32(8);
  constexpr size_t kBlockBytes = kQuantBlock / 2;
  for (size_t p = 0; p < pairs; ++p) {
    const uint8_t* b0 = w + 2 * p * kBlockBytes;
    const uint8_t* b1 = b0 + kBlockBytes;
    for (size_t step = 0; step < 8; ++step) {
      uint16_t lo, hi;  // Four codes of each block: elements 4s..4s+3, low nibble first.
      std::memcpy(&lo, b0 + 2 * step, 2);
      std::memcpy(&hi, b1 + 2 * step, 2);
      const __m256i u = _mm256_set1_epi32(static_cast<int>(lo | uint32_t{hi} << 16));
      const __m256i c = _mm256_and_si256(_mm256_srlv_epi32(u, shifts), nibble);
      const __m256 mag = _mm256_permutevar8x32_ps(table, c);  // Reads the low 3 bits.
      const __m256 sign = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(c, sign_bit), 28));
      _mm256_storeu_ps(out + p * 2 * kQuantBlock + step * 8, _mm256_or_ps(mag, sign));
    }
  }
  const float* pairs_table = E2M1PairTable();
  for (size_t k = pairs * 2 * kQuantBlock; k < K; k += 2) {
    out[k] = pairs_table[2 * w[k / 2]];
    out[k + 1] = pairs_table[2 * w[k / 2] + 1];
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
float DenseDot1Sse(const float* x, const float* w, size_t K) {
  __m128 p = _mm_setzero_ps();
  size_t k = 0;
  for (; k + 4 <= K; k += 4)
    p = _mm_add_ps(p, _mm_mul_ps(_mm_loadu_ps(x + k), _mm_loadu_ps(w + k)));
  float lane[4];
  _mm_storeu_ps(lane, p);
  for (; k < K; ++k) lane[0] += x[k] * w[k];
  return (lane[0] + lane[1]) + (lane[2] + lane[3]);
}

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
  return ScaledBlockDotSse(x, w, scales, blocks);
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

#if FLASHD_X86_VECTORS
constexpr auto kDecodeFp8Paired = internal::DecodeFp8RowPairedAvx2;
constexpr auto kDecodeFp4Paired = internal::DecodeFp4RowPairedAvx2;
#else
constexpr auto kDecodeFp8Paired = DecodeFp8Row;
constexpr auto kDecodeFp4Paired = DecodeFp4Row;
#endif

// The shared fast path: w_scale(n, b) gives the weight scale of row n, K-block b. With AVX2 the
// activations and each decoded weight row are in the paired layout (decode_paired) and up to
// eight rows share each weight load; without it, natural order (decode) and one row at a time.
// Both add in the order ScaledBlockDotPlain defines.
template <typename DecodeRow, typename RowBytes, typename WeightScale>
void FastLinear(const uint8_t* x_q, const uint8_t* x_s, size_t M, size_t K, const uint8_t* w,
                size_t N, float* y, int threads, DecodeRow decode, DecodeRow decode_paired,
                RowBytes row_bytes, WeightScale w_scale) {
  const size_t blocks = K / kQuantBlock;
  const bool paired = FLASHD_X86_VECTORS && internal::CpuHasAvx2();
  // Activations are decoded once with their scales applied; a power-of-two scale makes that exact.
  std::vector<float> x(M * K), natural(paired ? K : 0);
  for (size_t m = 0; m < M; ++m) {
    float* out = paired ? natural.data() : x.data() + m * K;
    DequantizeFp8PerBlock(x_q + m * K, x_s + m * blocks, K, kQuantBlock, out);
    if (paired) internal::ToPaired(natural.data(), K, x.data() + m * K);
  }
  // A range is worth waking a worker for from about 64K multiply-adds.
  const size_t min_rows = std::max<size_t>(1, (size_t{1} << 16) / (M * K));
  ParallelRanges(
      N, threads,
      [&](size_t begin, size_t end) {
        std::vector<float> row(K), scales(blocks);
        for (size_t n = begin; n < end; ++n) {
          (paired ? decode_paired : decode)(w + n * row_bytes, K, row.data());
          for (size_t b = 0; b < blocks; ++b) scales[b] = w_scale(n, b);
          size_t m = 0;
#if FLASHD_X86_VECTORS
          if (paired) {
            float out[8];
            for (; m + 8 <= M; m += 8) {
              internal::PairedDot8Avx2(x.data() + m * K, K, row.data(), scales.data(), blocks, out);
              for (size_t i = 0; i < 8; ++i) y[(m + i) * N + n] = out[i];
            }
            for (; m + 4 <= M; m += 4) {
              internal::PairedDot4Avx2(x.data() + m * K, K, row.data(), scales.data(), blocks, out);
              for (size_t i = 0; i < 4; ++i) y[(m + i) * N + n] = out[i];
            }
            for (; m < M; ++m) {
              y[m * N + n] =
                  internal::PairedDot1Avx2(x.data() + m * K, row.data(), scales.data(), blocks);
            }
          }
#endif
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
  FastLinear(x_q, x_s, M, K, w_q, N, y, threads, DecodeFp8Row, kDecodeFp8Paired, K,
             [&](size_t n, size_t b) { return E8M0ToFloat(w_s[(n / kQuantBlock) * blocks + b]); });
  return KernelStatus::kOk;
}

KernelStatus Fp4Linear(const uint8_t* x_q, const uint8_t* x_s, size_t M, size_t K,
                       const uint8_t* w_packed, const uint8_t* w_s, size_t N, float* y,
                       int threads) {
  if (!ShapeOk(M, K, N)) return KernelStatus::kBadShape;
  const size_t blocks = K / kQuantBlock;
  FastLinear(x_q, x_s, M, K, w_packed, N, y, threads, DecodeFp4Row, kDecodeFp4Paired, K / 2,
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

// Output column n (y[m * y_stride + n] for every row m) from weight row wn, row m of the input
// at x + m * x_stride.
void DenseColumn(const float* x, size_t x_stride, size_t M, size_t K, const float* wn, size_t n,
                 float* y, size_t y_stride) {
  size_t m = 0;
#if FLASHD_X86_VECTORS
  // Four rows at once, each in its own register of the same four lanes.
  for (; m + 4 <= M; m += 4) {
    float out[4];
    internal::DenseDot4Sse(x + m * x_stride, x_stride, wn, K, out);
    for (size_t r = 0; r < 4; ++r) y[(m + r) * y_stride + n] = out[r];
  }
  for (; m < M; ++m) y[m * y_stride + n] = internal::DenseDot1Sse(x + m * x_stride, wn, K);
#else
  for (; m < M; ++m) y[m * y_stride + n] = internal::DenseDotPlain(x + m * x_stride, wn, K);
#endif
}

}  // namespace

void DenseLinear(const float* x, size_t M, size_t K, const float* w, size_t N, float* y,
                 int threads) {
  // A range is worth waking a worker for from about 64K multiply-adds.
  const size_t min_rows = std::max<size_t>(1, (size_t{1} << 16) / (M * K));
  ParallelRanges(
      N, threads,
      [&](size_t begin, size_t end) {
        for (size_t n = begin; n < end; ++n) DenseColumn(x, K, M, K, w + n * K, n, y, N);
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
          DenseColumn(x, K, M, K, row.data(), n, y, N);
        }
      },
      min_rows);
}

// DenseLinear over FP8 codes and their 32x32 tiles' scales (rows from row0 of the scales'
// matrix): each weight row decoded to its exact values, then summed as DenseLinear does; for
// `groups` projections side by side (LinearParams::groups), their G * N columns split among the
// threads.
void DenseLinearFp8(const float* x, size_t M, size_t K, const uint8_t* w, const uint8_t* scales,
                    size_t row0, size_t N, size_t groups, float* y, int threads) {
  const size_t min_rows = std::max<size_t>(1, (size_t{1} << 16) / (M * K));
  const size_t scale_cols = K / 32;  // The op requires whole 32-blocks.
  const size_t x_stride = groups * K, y_stride = groups * N;
  [[maybe_unused]] const bool avx2 = internal::CpuHasAvx2();
  ParallelRanges(
      groups * N, threads,
      [&](size_t begin, size_t end) {
        std::vector<float> row(K);
        for (size_t i = begin; i < end; ++i) {
          const size_t g = i / N, n = i % N;
          const float* xg = x + g * K;
          float* yg = y + g * N;
          const uint8_t* wn = w + i * K;  // Row g * N + n.
          const uint8_t* s = scales + (row0 + i) / 32 * scale_cols;
#if FLASHD_X86_VECTORS
          if (avx2 && M == 1) {  // One row: decoded straight into its sums.
            yg[n] = internal::DenseDot1Fp8Avx2(xg, wn, s, K);
            continue;
          }
          if (avx2) {
            internal::DecodeFp8RowScaledAvx2(wn, s, K, row.data());
            DenseColumn(xg, x_stride, M, K, row.data(), n, yg, y_stride);
            continue;
          }
#endif
          DequantizeFp8Weight(wn, s, 1, K, row.data());
          DenseColumn(xg, x_stride, M, K, row.data(), n, yg, y_stride);
        }
      },
      min_rows);
}

}  // namespace flashd::kernels::cpu

namespace flashd::kernels::cpu {

namespace {
// Linear without round_output (nor `also`); `quantized`: x_codes already hold x's codes.
OpStatus Unrounded(const LinearParams& p, bool quantized = false);
}  // namespace

OpStatus Linear(const LinearParams& p) {
  if (p.round_output && p.up != nullptr) return OpStatus::kBadArgument;
  if (const OpStatus s = LinearAlsoFits(p); s != OpStatus::kOk) return s;
  if (const OpStatus s = LinearCodesFit(p); s != OpStatus::kOk) return s;
  if (const OpStatus s = LinearRopeFits(p); s != OpStatus::kOk) return s;
  if (p.rope_dim > 0) {  // The op, then its rotation.
    LinearParams q = p;
    q.rope_dim = 0;
    if (const OpStatus s = Linear(q); s != OpStatus::kOk) return s;
    return Rope(LinearRope(p));
  }
  if (p.y_codes != nullptr) {  // The op, then its rows' codes.
    LinearParams q = p;
    q.y_codes = q.y_code_scales = nullptr;
    if (const OpStatus s = Linear(q); s != OpStatus::kOk) return s;
    const int64_t width = p.groups * p.out;
    QuantizeFp8Rows(p.y, p.rows, width, width, p.y_codes, p.y_code_scales);
    return OpStatus::kOk;
  }
  // The op's projection, then each of `also` from the same codes.
  for (int64_t j = -1; j < p.also_count; ++j) {
    const LinearParams q = LinearAlone(p, j);
    const OpStatus s = Unrounded(q, j >= 0 || p.x_quantized);
    if (s != OpStatus::kOk) return s;
    if (!q.round_output) continue;
    if (const OpStatus r = RoundBf16({.x = q.y, .n = q.rows * q.groups * q.out});
        r != OpStatus::kOk)
      return r;
  }
  return OpStatus::kOk;
}

namespace {

OpStatus Unrounded(const LinearParams& p, bool quantized) {
  if (p.rows < 0 || p.in <= 0 || p.out <= 0 || p.x == nullptr || p.y == nullptr) {
    return OpStatus::kBadShape;
  }
  if (p.up != nullptr) {  // The gated pair: two products, then the SwiGLU.
    if (p.format != WeightFormat::kFp8 && p.format != WeightFormat::kFp4) {
      return OpStatus::kBadArgument;
    }
    return GatedApart(
        p, [](const LinearParams& q) { return Linear(q); },
        [](const SwigluParams& q) { return Swiglu(q); });
  }
  if (p.groups < 1) return OpStatus::kBadShape;
  if (p.groups > 1 && p.format != WeightFormat::kFp8Dense) return OpStatus::kBadArgument;
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
  if (p.format == WeightFormat::kFp8Dense) {
    if (p.w == nullptr || p.w_scales == nullptr) return OpStatus::kBadArgument;
    if (p.w_row0 < 0 || p.in % kQuantBlock != 0) return OpStatus::kBadShape;
    DenseLinearFp8(p.x, rows, in, p.w, p.w_scales, static_cast<size_t>(p.w_row0), out,
                   static_cast<size_t>(p.groups), p.y, threads);
    return OpStatus::kOk;
  }
  if (p.in % kQuantBlock != 0) return OpStatus::kBadShape;
  if (p.w == nullptr || p.w_scales == nullptr || p.x_codes == nullptr || p.x_scales == nullptr) {
    return OpStatus::kBadArgument;
  }
  if (!quantized) QuantizeFp8Rows(p.x, p.rows, p.in, p.in, p.x_codes, p.x_scales);
  const KernelStatus s =
      p.format == WeightFormat::kFp8
          ? Fp8Linear(p.x_codes, p.x_scales, rows, in, p.w, p.w_scales, out, p.y, threads)
          : Fp4Linear(p.x_codes, p.x_scales, rows, in, p.w, p.w_scales, out, p.y, threads);
  return s == KernelStatus::kOk ? OpStatus::kOk : OpStatus::kBadShape;
}

}  // namespace

}  // namespace flashd::kernels::cpu
