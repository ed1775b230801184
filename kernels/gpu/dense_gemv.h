// One row of dense weights (fp32 values or BF16 codes) as a GEMV, a thread block per two
// columns: the kernel of Linear's dense one-row path (kernels/gpu/linear.cu) and of the router's
// logits where the routing follows in the same kernel (kernels/gpu/moe.cu).
#pragma once

#include <cstdint>

#include "kernels/codecs.h"
#include "kernels/gpu/portability.h"
#include "kernels/gpu/quantized.h"

namespace flashd::kernels::FLASHD_GPU_BACKEND {

// A dense weight's value (n, k) of [N, K]: fp32 values or BF16 codes; Load4, values k to k + 3
// by one load (K a multiple of 4, the weights aligned as Vectors says).
struct F32Values {
  const float* w;
  __device__ float operator()(int64_t n, int64_t k, int64_t K) const { return w[n * K + k]; }
  __device__ void Load4(int64_t n, int64_t k, int64_t K, float* v) const {
    const float4 q = *reinterpret_cast<const float4*>(w + n * K + k);
    v[0] = q.x, v[1] = q.y, v[2] = q.z, v[3] = q.w;
  }
  bool Vectors(int64_t K) const { return K % 4 == 0 && Aligned(w, 16); }
};
struct Bf16Values {
  const uint16_t* w;
  __device__ float operator()(int64_t n, int64_t k, int64_t K) const {
    return codecs::Bf16ToFloat(w[n * K + k]);
  }
  __device__ void Load4(int64_t n, int64_t k, int64_t K, float* v) const {
    const uint2 q = *reinterpret_cast<const uint2*>(w + n * K + k);
    v[0] = codecs::Bf16ToFloat(static_cast<uint16_t>(q.x)), v[1] = codecs::Bf16ToFloat(q.x >> 16);
    v[2] = codecs::Bf16ToFloat(static_cast<uint16_t>(q.y)), v[3] = codecs::Bf16ToFloat(q.y >> 16);
  }
  bool Vectors(int64_t K) const { return K % 4 == 0 && Aligned(w, 8); }
};

// One row of the dense sums (the router's 384 columns at one token: 12 tiles of 32 columns
// would leave most multiprocessors idle and each chain of a column reading K / 4 values one
// after another from memory). Here a thread block takes kDenseGemvCols columns: per chunk of
// kDenseGemvChunk values all its threads load the columns' weights and the row's activations
// (four neighbouring values a load) and write the products to shared memory, then a thread per
// (column, lane) adds its lane's products in order; the next chunk's loads are issued before
// those adds. Each product is rounded as the tile's multiply rounds it and the lanes meet as the
// tile's do: the same numbers, bit for bit.
constexpr unsigned kDenseGemvThreads = 256;
constexpr int64_t kDenseGemvCols = 2;
constexpr int64_t kDenseGemvChunk = 2048;
constexpr int64_t kDenseGemvStride = kDenseGemvChunk + 4;  // The columns' lanes in other banks.
constexpr int kDenseGemvLoads = static_cast<int>(kDenseGemvChunk / 4 / kDenseGemvThreads);

static_assert(kDenseGemvLoads * 4 * kDenseGemvThreads == kDenseGemvChunk, "whole loads a thread");

// Columns [n0, n0 + kDenseGemvCols) of the row by the thread block.
template <class W, bool kVectors>
FLASHD_SHARED_TILE __device__ void DenseGemvColumns(const float* x, int64_t K, W w, int64_t N,
                                                    float* y, int64_t n0) {
  __shared__ float prod[kDenseGemvCols][kDenseGemvStride];
  __shared__ float lanes[kDenseGemvCols][4];
  const unsigned t = threadIdx.x;
  const int64_t k4 = K - K % 4;  // Values from k4 on go to lane 0 after the rest.
  float wv[kDenseGemvLoads][kDenseGemvCols][4], xv[kDenseGemvLoads][4];
  // Load a: values 4 (t + a x threads) .. + 3 of the chunk at c0.
  const auto load = [&](int64_t c0) {
    FLASHD_UNROLL
    for (int a = 0; a < kDenseGemvLoads; ++a) {
      const int64_t k = c0 + 4 * (t + a * static_cast<int64_t>(kDenseGemvThreads));
      if (k >= K) break;
      if (kVectors) {
        const float4 q = *reinterpret_cast<const float4*>(x + k);
        xv[a][0] = q.x, xv[a][1] = q.y, xv[a][2] = q.z, xv[a][3] = q.w;
      } else {
        FLASHD_UNROLL
        for (int i = 0; i < 4; ++i) xv[a][i] = k + i < K ? x[k + i] : 0.0f;
      }
      FLASHD_UNROLL
      for (int c = 0; c < kDenseGemvCols; ++c) {
        const int64_t n = n0 + c < N ? n0 + c : N - 1;  // Past N: the last row, unused.
        if (kVectors) {
          w.Load4(n, k, K, wv[a][c]);
        } else {
          FLASHD_UNROLL
          for (int i = 0; i < 4; ++i) wv[a][c][i] = k + i < K ? w(n, k + i, K) : 0.0f;
        }
      }
    }
  };
  const int64_t col = t / 4, lane = t % 4;
  float p = 0.0f;
  load(0);
  for (int64_t c0 = 0; c0 < K; c0 += kDenseGemvChunk) {
    const int64_t nk = K - c0 < kDenseGemvChunk ? K - c0 : kDenseGemvChunk;
    FLASHD_UNROLL
    for (int a = 0; a < kDenseGemvLoads; ++a) {
      const int64_t k = 4 * (t + a * static_cast<int64_t>(kDenseGemvThreads));
      if (k >= nk) break;
      FLASHD_UNROLL
      for (int c = 0; c < kDenseGemvCols; ++c) {
        FLASHD_UNROLL
        for (int i = 0; i < 4; ++i) prod[c][k + i] = xv[a][i] * wv[a][c][i];
      }
    }
    __syncthreads();
    if (c0 + kDenseGemvChunk < K) load(c0 + kDenseGemvChunk);
    if (col < kDenseGemvCols) {
      const float* pc = prod[col];
      const int64_t main_end = k4 - c0 < nk ? (k4 - c0 > 0 ? k4 - c0 : 0) : nk;
      int64_t k = lane;
      for (; k + 28 < main_end; k += 32) {  // Eight loads issued together, added in order.
        float v[8];
        FLASHD_UNROLL
        for (int u = 0; u < 8; ++u) v[u] = pc[k + 4 * u];
        FLASHD_UNROLL
        for (int u = 0; u < 8; ++u) p += v[u];
      }
      for (; k < main_end; k += 4) p += pc[k];
      if (lane == 0) {
        for (k = main_end; k < nk; ++k) p += pc[k];
      }
    }
    __syncthreads();  // The products read before the next chunk's are written.
  }
  if (col < kDenseGemvCols) lanes[col][lane] = p;
  __syncthreads();
  if (t < kDenseGemvCols && n0 + t < N) {
    y[n0 + t] = (lanes[t][0] + lanes[t][1]) + (lanes[t][2] + lanes[t][3]);
  }
}

// A dense GEMV thread block's weights (rows n0 and on of w) asked of the L2 cache, as
// PrefetchGemvWeights.
template <class W>
__device__ inline void PrefetchDenseColumns(const W& w, int64_t K, int64_t N, int64_t n0) {
  if (n0 >= N) return;
  const int64_t cols = N - n0 < kDenseGemvCols ? N - n0 : kDenseGemvCols;
  PrefetchL2(w.w + n0 * K, cols * K * static_cast<int64_t>(sizeof(w.w[0])));
}

}  // namespace flashd::kernels::FLASHD_GPU_BACKEND
