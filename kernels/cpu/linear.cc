#include "kernels/cpu/linear.h"

#include <algorithm>
#include <thread>
#include <vector>

#include "kernels/cpu/formats.h"
#include "kernels/cpu/parallel.h"

namespace flashd::kernels::cpu {
namespace {

bool ShapeOk(size_t M, size_t K, size_t N) {
  return M > 0 && N > 0 && K > 0 && K % kQuantBlock == 0;
}

// Decodes one weight row to floats without its scales: the value grid of each format.
void DecodeFp8Row(const uint8_t* w, size_t K, float* out) {
  const float* table = E4M3DecodeTable();
  for (size_t k = 0; k < K; ++k) out[k] = table[w[k]];
}

void DecodeFp4Row(const uint8_t* w, size_t K, float* out) {
  // Both values of every byte, so a row decodes with one lookup per byte.
  static const std::vector<float> pairs = [] {
    std::vector<float> t(512);
    for (int b = 0; b < 256; ++b) {
      t[2 * b] = E2M1ToFloat(static_cast<uint8_t>(b & 0xF));
      t[2 * b + 1] = E2M1ToFloat(static_cast<uint8_t>(b >> 4));
    }
    return t;
  }();
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
  ParallelRanges(N, threads, [&](size_t begin, size_t end) {
    std::vector<float> row(K);
    for (size_t n = begin; n < end; ++n) {
      decode(w + n * row_bytes, K, row.data());
      for (size_t m = 0; m < M; ++m) {
        const float* xm = x.data() + m * K;
        float acc = 0.0f;
        for (size_t b = 0; b < blocks; ++b) {
          const float* xb = xm + b * kQuantBlock;
          const float* wb = row.data() + b * kQuantBlock;
          float p0 = 0, p1 = 0, p2 = 0, p3 = 0;
          for (size_t k = 0; k < kQuantBlock; k += 4) {
            p0 += xb[k] * wb[k];
            p1 += xb[k + 1] * wb[k + 1];
            p2 += xb[k + 2] * wb[k + 2];
            p3 += xb[k + 3] * wb[k + 3];
          }
          acc += ((p0 + p1) + (p2 + p3)) * w_scale(n, b);
        }
        y[m * N + n] = acc;
      }
    }
  });
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

void DenseLinear(const float* x, size_t M, size_t K, const float* w, size_t N, float* y,
                 int threads) {
  // Small products are not worth a thread start.
  if (M * N * K < (1u << 16)) threads = 1;
  ParallelRanges(N, threads, [&](size_t begin, size_t end) {
    for (size_t n = begin; n < end; ++n) {
      const float* wn = w + n * K;
      for (size_t m = 0; m < M; ++m) {
        const float* xm = x + m * K;
        float p0 = 0, p1 = 0, p2 = 0, p3 = 0;
        size_t k = 0;
        for (; k + 4 <= K; k += 4) {
          p0 += xm[k] * wn[k];
          p1 += xm[k + 1] * wn[k + 1];
          p2 += xm[k + 2] * wn[k + 2];
          p3 += xm[k + 3] * wn[k + 3];
        }
        for (; k < K; ++k) p0 += xm[k] * wn[k];
        y[m * N + n] = (p0 + p1) + (p2 + p3);
      }
    }
  });
}

}  // namespace flashd::kernels::cpu
