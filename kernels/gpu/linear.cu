// The linear layers on the device, as the portable correctness path: activations quantized to
// FP8 per 32 (one thread per block), then sums exactly as the CPU fast path's (per 32-block four
// lanes k % 4, the lanes' sum times the weight scale added in block order; dense weights: four
// lanes over K, the tail in lane 0). Both GEMMs work in tiles of 32 output columns: quantized
// weights (GemmTile below) read 16 bytes a load and decoded once for up to eight rows, dense ones
// (DenseGemmKernel) staged in shared memory a chunk of K at a time. Results equal the CPU's bit
// for bit. Matrix-core GEMMs come beside them, checked against them.

#include <algorithm>

#include "kernels/codecs.h"
#include "kernels/fmath.h"
#include "kernels/gpu/arrive.h"
#include "kernels/gpu/dense_gemv.h"
#include "kernels/gpu/norm_row.h"
#include "kernels/gpu/ops.h"
#include "kernels/gpu/portability.h"
#include "kernels/gpu/quantized.h"

namespace flashd::kernels::FLASHD_GPU_BACKEND {
namespace {

namespace c = flashd::kernels::codecs;
namespace fm = flashd::kernels::fmath;
constexpr unsigned kThreads = 256;
constexpr int64_t kBlock = 32;

__global__ void QuantizeKernel(const float* x, int64_t blocks, uint8_t* q, uint8_t* scales) {
  FLASHD_GRID_BEGIN();
  const int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b < blocks) QuantizeBlock(x + b * kBlock, q + b * kBlock, scales + b);
}

// Row r of the codes from row x_rows[r] of x ([.., K]); a thread a block.
__global__ void QuantizeGatheredKernel(const float* x, const int64_t* x_rows, int64_t rows,
                                       int64_t K, uint8_t* q, uint8_t* scales) {
  FLASHD_GRID_BEGIN();
  const int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t per_row = K / kBlock;
  if (b >= rows * per_row) return;
  QuantizeBlock(x + x_rows[b / per_row] * K + (b % per_row) * kBlock, q + b * kBlock, scales + b);
}

// The quantized GEMM's tile: kTileCols output columns of up to kGemmRows rows, by a thread block
// of kTileThreads, over the K-blocks [b_lo, b_hi) in chunks of kChunkBlocks. Per chunk:
//  1. the rows' activations of the chunk decoded once into shared memory (code times scale);
//  2. each (column, K-block) pair of the chunk taken by a thread, which reads the block's weights
//     with 16-byte loads (a warp's threads on neighbouring blocks of a weight row), decodes them
//     once for all rows and writes, for every row, the block's ((p0 + p1) + (p2 + p3)) times the
//     weight scale (lane p[k % 4] summing the products of values k);
//  3. a thread per (row, column) adds the chunk's block sums to its running sum in block order.
// So the sums are the CPU's, whatever the batch, and the weights are read once per tile, every
// load in flight before the first use. The products of the codes' values (at most 4 x 4
// significant bits) and of the powers of two are exact, so a fused multiply-add rounds as the
// CPU's multiply and add do. No warp size is assumed.
constexpr int64_t kGemmRows = 8;
constexpr int64_t kTileCols = 32;
constexpr unsigned kTileThreads = 128;
constexpr int64_t kChunkBlocks = 16;
constexpr int kPairsPerThread = static_cast<int>(kTileCols * kChunkBlocks / kTileThreads);
// A block's decoded activations padded by a 16-byte vector: the 16-byte reads of a quarter warp
// (eight neighbouring K-blocks) fall in different banks.
constexpr int64_t kXStride = kBlock + 4;
constexpr int64_t kPartStride = kChunkBlocks + 1;  // Odd: a warp's chains read different banks.

static_assert(kGemmRows == kExpertTileRows, "an expert slot's tiles are the GEMM's row groups");
static_assert(kLinearSplitRows <= kGemmRows && kLinearSplitRows % 2 == 0, "one tile of rows");
static_assert(kPairsPerThread * kTileThreads == kTileCols * kChunkBlocks, "whole pairs a thread");

// The weights' values are used scaled by a power of two, which saves the multiply that moves a
// code's exponent bias: an FP8 code's sign and magnitude moved to a float's sign and the low end
// of its exponent field read as the value times 2^-120 (an FP4 code's, times 2^-126), and the
// activations are staged times 2^kXShift to make up for part of that. Every product and partial
// sum is then the CPU's times 2^(kXShift - 120) (FP8) or 2^(kXShift - 126) (FP4), exactly:
// scaling by a power of two rounds the same while values stay normal, and the smallest product
// (a subnormal FP8 weight 2^-9 times an activation of at least 2^-9 x 2^-21, the quantizer's
// smallest scale) scaled is 2^-119, with every sum a multiple of it. The block's sum is brought
// back by 2^kUnscale before the weight scale, so the results equal the CPU's while activations
// stay below 2^87.
constexpr float kXShift = 0x1p40f;

template <int kFormat>
constexpr float kUnscale = kFormat == 0 ? 0x1p80f : 0x1p86f;

// Four FP8 codes (code i in byte i of `word`) as their values times 2^-120: the code shifted to
// the top, an arithmetic shift puts magnitude and sign where a float has them. With kExact (a
// block holding a NaN code, magnitude 0x7F), the codes are decoded one by one, NaN as the CPU's.
template <bool kExact>
__device__ inline void E4M3x4Scaled(uint32_t word, float* v) {
  FLASHD_UNROLL
  for (int i = 0; i < 4; ++i) {
    if (kExact) {
      v[i] = c::E4M3ToFloat(static_cast<uint8_t>(word >> (8 * i))) * 0x1p-120f;
    } else {
      const int32_t top = static_cast<int32_t>(word << (24 - 8 * i));
      v[i] = c::FromBits(static_cast<uint32_t>(top >> 4) & 0x87F00000u);
    }
  }
}

// Eight FP4 codes (code i in bits 4i..4i+3 of `word`) as their values times 2^-126.
__device__ inline void E2M1x8Scaled(uint32_t word, float* v) {
  FLASHD_UNROLL
  for (int i = 0; i < 8; ++i) {
    const int32_t top = static_cast<int32_t>(word << (28 - 4 * i));
    v[i] = c::FromBits(static_cast<uint32_t>(top >> 6) & 0x81C00000u);
  }
}

// A word of weight codes as their scaled values: four FP8 codes or eight FP4.
template <int kFormat, bool kExact>
__device__ inline void WordValues(uint32_t word, float* v) {
  if (kFormat == 0) {
    E4M3x4Scaled<kExact>(word, v);
  } else {
    E2M1x8Scaled(word, v);
  }
}

// Whether a block of FP8 codes holds a NaN code: a magnitude 0x7F plus one sets its byte's top.
__device__ inline bool HasNanCode(const uint4* raw) {
  const uint32_t m = 0x7F7F7F7Fu, one = 0x01010101u;
  const uint32_t any = ((raw[0].x & m) + one) | ((raw[0].y & m) + one) | ((raw[0].z & m) + one) |
                       ((raw[0].w & m) + one) | ((raw[1].x & m) + one) | ((raw[1].y & m) + one) |
                       ((raw[1].z & m) + one) | ((raw[1].w & m) + one);
  return (any & 0x80808080u) != 0;
}

// format 0: FP8 weights [N, K] with scales [ceil(N/32), K/32]; 1: FP4 [N, K/2], scales [N, K/32].
// The raw words of K-block b of weight row n (eight for FP8, four for FP4).
template <int kFormat>
__device__ inline void LoadWeightBlock(const uint8_t* w, int64_t n, int64_t K, int64_t b,
                                       uint4* raw) {
  if (kFormat == 0) {
    const uint4* at = reinterpret_cast<const uint4*>(w + n * K + b * kBlock);
    raw[0] = at[0];
    raw[1] = at[1];
  } else {
    raw[0] = *reinterpret_cast<const uint4*>(w + n * (K / 2) + b * (kBlock / 2));
  }
}

template <int kFormat>
__device__ inline float WeightScale(const uint8_t* ws, int64_t n, int64_t K, int64_t b) {
  const int64_t blocks = K / kBlock;
  return c::E8M0ToFloat(kFormat == 0 ? ws[(n / kBlock) * blocks + b] : ws[n * blocks + b]);
}

// p[r][k % 4] += x[r][blk][k] * w[k] for the block's values k in order (both scaled as above),
// each weight decoded once for all rows (a word of codes at a time: four FP8 values or eight FP4).
template <int kFormat, int kRows, bool kExact = false>
__device__ inline void BlockProducts(const uint4* raw,
                                     const float4 (*x)[kChunkBlocks][kXStride / 4], int64_t blk,
                                     int64_t rows, float (*p)[4]) {
  const uint32_t words[8] = {raw[0].x, raw[0].y, raw[0].z, raw[0].w,
                             raw[1].x, raw[1].y, raw[1].z, raw[1].w};
  constexpr int kWords = kFormat == 0 ? 8 : 4, kPerWord = kBlock / kWords;
  FLASHD_UNROLL
  for (int j = 0; j < kWords; ++j) {
    float v[kPerWord];
    WordValues<kFormat, kExact>(words[j], v);
    FLASHD_UNROLL
    for (int r = 0; r < kRows; ++r) {
      if (r >= rows) break;
      FLASHD_UNROLL
      for (int h = 0; h < kPerWord / 4; ++h) {
        const float4 x4 = x[r][blk][j * (kPerWord / 4) + h];
        p[r][0] = FLASHD_EXACT_FMA(x4.x, v[4 * h], p[r][0]);
        p[r][1] = FLASHD_EXACT_FMA(x4.y, v[4 * h + 1], p[r][1]);
        p[r][2] = FLASHD_EXACT_FMA(x4.z, v[4 * h + 2], p[r][2]);
        p[r][3] = FLASHD_EXACT_FMA(x4.w, v[4 * h + 3], p[r][3]);
      }
    }
  }
}

// Columns [n0, n0 + kTileCols) of rows [m0, m0 + rows) over K-blocks [b_lo, b_hi), by the whole
// thread block; `atomic`: the sums added into y (the free-order split), else stored. With
// `sums` ([rows of y][N][K / 32]) each block's sum is written there instead, for BlockSumsKernel
// to add in order (the fixed-order split).
template <int kFormat, int kRows>
FLASHD_SHARED_TILE __device__ void GemmTile(const uint8_t* xq, const uint8_t* xs, int64_t m0,
                                            int64_t rows, int64_t K, const uint8_t* w,
                                            const uint8_t* ws, int64_t N, int64_t n0, int64_t b_lo,
                                            int64_t b_hi, bool atomic, float* y,
                                            float* sums = nullptr) {
  constexpr int kChains =
      kRows * kTileCols / kTileThreads > 0 ? kRows * kTileCols / kTileThreads : 1;
  __shared__ float4 xf[kRows][kChunkBlocks][kXStride / 4];
  __shared__ float part[kRows][kTileCols][kPartStride];
  const int64_t blocks = K / kBlock;
  const unsigned t = threadIdx.x;
  float acc[kChains];
  FLASHD_UNROLL
  for (int q = 0; q < kChains; ++q) acc[q] = 0.0f;
  for (int64_t c0 = b_lo; c0 < b_hi; c0 += kChunkBlocks) {
    const int64_t nb = b_hi - c0 < kChunkBlocks ? b_hi - c0 : kChunkBlocks;
    // 1. The activations: a word of four codes a thread at a time.
    const int64_t words = rows * kChunkBlocks * (kBlock / 4);
    for (int64_t i = t; i < words; i += kTileThreads) {
      const int64_t r = i / (kChunkBlocks * (kBlock / 4));
      const int64_t blk = (i / (kBlock / 4)) % kChunkBlocks, k = (i % (kBlock / 4)) * 4;
      if (blk >= nb) continue;
      const int64_t m = m0 + r;
      const uint32_t code =
          *reinterpret_cast<const uint32_t*>(xq + m * K + (c0 + blk) * kBlock + k);
      const float scale = c::E8M0ToFloat(xs[m * blocks + c0 + blk]);
      float v[4];
      FLASHD_UNROLL
      for (int i = 0; i < 4; ++i) {
        v[i] = (c::E4M3ToFloat(static_cast<uint8_t>(code >> (8 * i))) * scale) * kXShift;
      }
      xf[r][blk][k / 4] = float4{v[0], v[1], v[2], v[3]};
    }
    // The weights of this thread's pairs, all loads issued before the barrier's wait.
    uint4 raw[kPairsPerThread][2];
    float w_scale[kPairsPerThread];
    FLASHD_UNROLL
    for (int j = 0; j < kPairsPerThread; ++j) {
      const int64_t pair = t + static_cast<int64_t>(j) * kTileThreads;
      const int64_t col = pair / kChunkBlocks, blk = pair % kChunkBlocks;
      if (blk < nb && n0 + col < N) {
        LoadWeightBlock<kFormat>(w, n0 + col, K, c0 + blk, raw[j]);
        w_scale[j] = WeightScale<kFormat>(ws, n0 + col, K, c0 + blk);
      }
    }
    __syncthreads();
    // 2. Each pair's block sums, every row.
    FLASHD_UNROLL
    for (int j = 0; j < kPairsPerThread; ++j) {
      const int64_t pair = t + static_cast<int64_t>(j) * kTileThreads;
      const int64_t col = pair / kChunkBlocks, blk = pair % kChunkBlocks;
      if (blk >= nb || n0 + col >= N) continue;
      float p[kRows][4] = {};
      if (kFormat == 0 && HasNanCode(raw[j])) {
        BlockProducts<kFormat, kRows, true>(raw[j], xf, blk, rows, p);
      } else {
        BlockProducts<kFormat, kRows>(raw[j], xf, blk, rows, p);
      }
      FLASHD_UNROLL
      for (int r = 0; r < kRows; ++r) {
        if (r >= rows) break;
        const float sum = ((p[r][0] + p[r][1]) + (p[r][2] + p[r][3])) * kUnscale<kFormat>;
        if (sums != nullptr) {
          sums[((m0 + r) * N + n0 + col) * blocks + c0 + blk] = sum * w_scale[j];
        } else {
          part[r][col][blk] = sum * w_scale[j];
        }
      }
    }
    __syncthreads();
    if (sums != nullptr) continue;  // Written out: no chains here.
    // 3. The chains: (row, column) adds its blocks in order. The next chunk's step 1 writes only
    // xf, which step 2 finished reading before the barrier above; its step 2 writes `part` after
    // the next barrier, when these reads are done.
    FLASHD_UNROLL
    for (int q = 0; q < kChains; ++q) {
      const int64_t chain = t + static_cast<int64_t>(q) * kTileThreads;
      const int64_t r = chain / kTileCols, col = chain % kTileCols;
      if (r >= rows) continue;
      for (int64_t b = 0; b < nb; ++b) acc[q] += part[r][col][b];
    }
  }
  if (sums != nullptr) return;
  FLASHD_UNROLL
  for (int q = 0; q < kChains; ++q) {
    const int64_t chain = t + static_cast<int64_t>(q) * kTileThreads;
    const int64_t r = chain / kTileCols, col = chain % kTileCols;
    if (r >= rows || n0 + col >= N) continue;
    if (atomic) {
      atomicAdd(&y[(m0 + r) * N + n0 + col], acc[q]);
    } else {
      y[(m0 + r) * N + n0 + col] = acc[q];
    }
  }
}

FLASHD_OPS_HD inline int64_t ColumnGroups(int64_t N) { return (N + kTileCols - 1) / kTileCols; }

// Thread blocks a multiprocessor is asked to hold: with one row a tile, enough to keep the
// weight reads in flight; with more, the registers the rows' sums take.
template <int kRows>
constexpr int kMinTiles = kRows == 1 ? 8 : 4;

// Row groups of kRows (1 for one sequence's decode step, else kGemmRows) by kTileCols columns.
template <int kFormat, int kRows>
__global__ void __launch_bounds__(kTileThreads, kMinTiles<kRows>)
    QuantizedGemmKernel(const uint8_t* xq, const uint8_t* xs, int64_t M, int64_t K,
                        const uint8_t* w, const uint8_t* ws, int64_t N, float* y) {
  FLASHD_GRID_BEGIN();
  const int64_t n0 = (blockIdx.x % ColumnGroups(N)) * kTileCols;
  const int64_t m0 = (blockIdx.x / ColumnGroups(N)) * kRows;
  const int64_t rows = M - m0 < kRows ? M - m0 : kRows;
  GemmTile<kFormat, kRows>(xq, xs, m0, rows, K, w, ws, N, n0, 0, K / kBlock, false, y);
}

// The experts' GEMMs over grouped rows: thread block (tile g, column group), g the slots' row
// groups of kGemmRows counted through (slot_tiles), each in tiles of kRows rows (1 when no slot
// has more: each token chooses an expert once, so one token's step); the tiles past the last
// slot's have nothing to do. A tile's slot is found by a binary search of slot_tiles.
template <int kFormat, int kRows>
__global__ void __launch_bounds__(kTileThreads, kMinTiles<kRows>)
    ExpertGemmKernel(const uint8_t* xq, const uint8_t* xs, int64_t K, const int64_t* slot_expert,
                     const int64_t* slot_offset, const int64_t* slot_tiles, int64_t slots,
                     const uint8_t* const* w, const uint8_t* const* ws, int64_t N, float* y) {
  FLASHD_GRID_BEGIN();
  const int64_t n0 = (blockIdx.x % ColumnGroups(N)) * kTileCols;
  int64_t m0 = 0, rows = 0, e = 0;
  if (!ExpertTileOf(kGemmRows, blockIdx.x / ColumnGroups(N), slot_expert, slot_offset, slot_tiles,
                    slots, &m0, &rows, &e)) {
    return;
  }
  for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
    GemmTile<kFormat, kRows>(xq, xs, m0 + r0, rows - r0 < kRows ? rows - r0 : kRows, K, w[e], ws[e],
                             N, n0, 0, K / kBlock, false, y);
  }
}

// A tile's K-blocks shared by `split` thread blocks, in one of two schedules. The free order
// (LinearFreeOrder, for measuring what the fixed order costs; `sums` null): the parts' sums land
// by atomic adds into a zeroed y in the order the blocks finish (split 1: stored, the fixed
// order's sums). The fixed order split (`sums` given): each part writes its K-blocks' sums there,
// which BlockSumsKernel adds in block order.
template <int kFormat, int kRows>
__global__ void __launch_bounds__(kTileThreads, kMinTiles<kRows>)
    PartsGemmKernel(const uint8_t* xq, const uint8_t* xs, int64_t M, int64_t K, const uint8_t* w,
                    const uint8_t* ws, int64_t N, int split, float* y, float* sums) {
  FLASHD_GRID_BEGIN();
  const int64_t tile = blockIdx.x / split, part = blockIdx.x % split;
  const int64_t n0 = (tile % ColumnGroups(N)) * kTileCols;
  const int64_t m0 = (tile / ColumnGroups(N)) * kRows;
  const int64_t rows = M - m0 < kRows ? M - m0 : kRows;
  const int64_t blocks = K / kBlock;
  const int64_t lo = blocks * part / split, hi = blocks * (part + 1) / split;
  GemmTile<kFormat, kRows>(xq, xs, m0, rows, K, w, ws, N, n0, lo, hi, split > 1, y, sums);
}

// s[0] + s[1] + ... + s[n - 1] from zero in order, eight loads issued together.
__device__ inline float SumInOrder(const float* s, int64_t n) {
  float acc = 0.0f;
  int64_t b = 0;
  for (; b + 8 <= n; b += 8) {
    float v[8];
    FLASHD_UNROLL
    for (int u = 0; u < 8; ++u) v[u] = s[b + u];
    FLASHD_UNROLL
    for (int u = 0; u < 8; ++u) acc += v[u];
  }
  for (; b < n; ++b) acc += s[b];
  return acc;
}

// y[m, n] = the block sums of (m, n) added from zero in block order, as GemmTile's chains do.
__global__ void BlockSumsKernel(const float* sums, int64_t outputs, int64_t blocks, float* y) {
  FLASHD_GRID_BEGIN();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= outputs) return;
  y[i] = SumInOrder(sums + i * blocks, blocks);
}

// One row (a sequence's decode step) in the same sums, with every weight load of a thread
// issued at once. The GEMM tile above takes K a chunk at a time with barriers between, so at one
// row its thread blocks wait for memory once per chunk with little in flight (the H200: 800 GB/s
// on a 42 MB weight). Here a thread block takes `groups` groups of output columns and all of K:
// item i (group i / blocks, K-block i % blocks, neighbouring threads on neighbouring blocks of a
// weight row) is a thread's, which loads the group's weights of the block (128 bytes: four FP8
// columns, eight FP4) and the row's activation codes of it, the next item's loads issued before
// this one is summed; decodes the activations once for the group; and writes each column's block
// sum (the tile's ((p0 + p1) + (p2 + p3)) times the weight scale) to shared memory, where a
// thread per column then adds them in block order. The same numbers as the tile's, bit for bit.
constexpr unsigned kGemvThreads = 128;
constexpr int64_t kGemvMaxSums = 8192;      // Floats of block sums a thread block holds.
constexpr int64_t kGemvItemsPerThread = 2;  // Groups are packed to give each thread about two.

// Columns an item takes: its weights are 128 bytes of a K-block.
template <int kFormat>
constexpr int kGemvCols = kFormat == 0 ? 4 : 8;
template <int kFormat>
constexpr int kWeightWords = kFormat == 0 ? 2 : 1;  // 16-byte words of a column's K-block.

static_assert(kGemvThreads % kGemvCols<1> == 0, "a thread per column for the adds");

// The block sums' row stride for K-blocks `blocks`: odd, so the column threads' reads of block b
// fall in different banks.
FLASHD_OPS_HD inline int64_t GemvStride(int64_t blocks) { return blocks | 1; }

// The 32 activations of K-block b of a row as the tile stages them, (code x scale) x 2^kXShift,
// each code's value from its bits (as the weights': the value times 2^-120, times 2^120 exactly),
// or one by one as the tile does when the block holds a NaN code (a NaN activation).
__device__ inline void GemvActivations(const uint4* codes, uint8_t scale_code, float* xv) {
  const float scale = c::E8M0ToFloat(scale_code);
  const uint32_t words[8] = {codes[0].x, codes[0].y, codes[0].z, codes[0].w,
                             codes[1].x, codes[1].y, codes[1].z, codes[1].w};
  if (HasNanCode(codes)) {
    FLASHD_UNROLL
    for (int k = 0; k < kBlock; ++k) {
      const float v = c::E4M3ToFloat(static_cast<uint8_t>(words[k / 4] >> (8 * (k % 4))));
      xv[k] = (v * scale) * kXShift;
    }
    return;
  }
  FLASHD_UNROLL
  for (int j = 0; j < 8; ++j) {
    float v[4];
    E4M3x4Scaled<false>(words[j], v);
    FLASHD_UNROLL
    for (int i = 0; i < 4; ++i) xv[4 * j + i] = ((v[i] * 0x1p120f) * scale) * kXShift;
  }
}

// A column's sum over one K-block against the activations xv, unscaled: the tile's.
template <int kFormat, bool kExact>
__device__ inline float GemvBlockSum(const uint4* raw, const float* xv) {
  const uint4 hi = kFormat == 0 ? raw[kWeightWords<kFormat> - 1] : uint4{0, 0, 0, 0};
  const uint32_t words[8] = {raw[0].x, raw[0].y, raw[0].z, raw[0].w, hi.x, hi.y, hi.z, hi.w};
  constexpr int kWords = kFormat == 0 ? 8 : 4, kPerWord = kBlock / kWords;
  float p[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  FLASHD_UNROLL
  for (int j = 0; j < kWords; ++j) {
    float v[kPerWord];
    WordValues<kFormat, kExact>(words[j], v);
    FLASHD_UNROLL
    for (int i = 0; i < kPerWord; ++i) {
      p[i % 4] = FLASHD_EXACT_FMA(xv[j * kPerWord + i], v[i], p[i % 4]);
    }
  }
  return ((p[0] + p[1]) + (p[2] + p[3])) * kUnscale<kFormat>;
}

// One item's loads: the group's weights of K-block b (columns past N not read) and the
// row's activation codes and scale code of it.
template <int kFormat>
struct GemvLoads {
  uint4 w[kGemvCols<kFormat>][kWeightWords<kFormat>];
  uint8_t w_scale[kGemvCols<kFormat>];
  uint4 x[2];
  uint8_t x_scale;
};

template <int kFormat>
__device__ inline void GemvLoad(const uint8_t* xq, const uint8_t* xs, const uint8_t* w,
                                const uint8_t* ws, int64_t K, int64_t N, int64_t n, int64_t b,
                                GemvLoads<kFormat>& l) {
  const int64_t blocks = K / kBlock;
  const uint4* at = reinterpret_cast<const uint4*>(xq + b * kBlock);
  l.x[0] = at[0];
  l.x[1] = at[1];
  l.x_scale = xs[b];
  FLASHD_UNROLL
  for (int c = 0; c < kGemvCols<kFormat>; ++c) {
    if (n + c >= N) break;
    LoadWeightBlock<kFormat>(w, n + c, K, b, l.w[c]);
    l.w_scale[c] = kFormat == 0 ? ws[((n + c) / kBlock) * blocks + b] : ws[(n + c) * blocks + b];
  }
}

// The gated pair's second matrix and its SwiGLU (ExpertLinearParams' up, row_weights, limit)
// for a GEMV tile; w null where the tile is not gated.
struct GemvPair {
  const uint8_t* w = nullptr;
  const uint8_t* ws = nullptr;
  const float* row_weight = nullptr;
  float limit = 0;
};

// Where a GEMV writes its row's codes as it writes the row (LinearParams::y_codes): the row's
// codes [N] and scales [N / 32], and a counter for each 32 columns (zeros, left zeros). Null
// codes: none.
struct GemvCodes {
  uint8_t* codes = nullptr;
  uint8_t* scales = nullptr;
  unsigned* arrivals = nullptr;
  // Row r's, of a matrix of N columns.
  __device__ GemvCodes Row(int64_t r, int64_t N) const {
    if (codes == nullptr) return {};
    return {codes + r * N, scales + r * (N / kBlock), arrivals + r * (N / kBlock)};
  }
};

// Where a GEMV rotates its row's heads as it writes them (LinearParams' rope, at the row's
// position positions[0]); rope_dim 0: none.
struct GemvRope {
  int64_t rope_dim = 0, head_dim = 0;
  const int64_t* positions = nullptr;
  const float* freqs = nullptr;
};

// After the thread blocks of a GEMV wrote their columns of y (this one [n0, n0 + width) of N, a
// multiple of 32; thread block j takes [j * width, + width)): each counts itself in for every 32
// columns it wrote, and the last of the 32 columns' thread blocks to arrive quantizes them
// (QuantizeBlock's codes, each of 32 threads computing the block's scale and its own code) and
// clears their counter. `stage`: 32 floats of shared memory. REQUIRES: every thread of the block
// calls it, at least 32 of them.
__device__ void GemvWriteCodes(const float* y, int64_t N, int64_t n0, int64_t width,
                               const GemvCodes& out, float* stage) {
  const int64_t end = n0 + width < N ? n0 + width : N;
  const unsigned t = threadIdx.x;
  for (int64_t b = n0 / kBlock; b * kBlock < end; ++b) {
    const int64_t first = b * kBlock / width, last = (b * kBlock + kBlock - 1) / width;
    if (!LastToArrive(out.arrivals + b, static_cast<unsigned>(last - first + 1))) continue;
    if (t < kBlock) stage[t] = static_cast<const volatile float*>(y)[b * kBlock + t];
    __syncthreads();
    if (t < kBlock) {
      const float scale = BlockScale(stage);
      out.codes[b * kBlock + t] = BlockCode(stage[t], scale);
      if (t == 0) {
        out.scales[b] = c::NormalPow2ToE8M0(scale);
        out.arrivals[b] = 0;
      }
    }
    __syncthreads();  // Before the stage is written again.
  }
}

// The weights of columns [n0, n0 + kGemvCols x groups) (whole rows of w, one after another) asked
// of the L2 cache, before the kernel waits for the one ahead (PrefetchL2); nothing for null w.
template <int kFormat>
__device__ inline void PrefetchGemvWeights(const uint8_t* w, int64_t K, int64_t N, int64_t n0,
                                           int64_t groups) {
  if (w == nullptr || n0 >= N) return;
  const int64_t cols = N - n0 < groups * kGemvCols<kFormat> ? N - n0 : groups * kGemvCols<kFormat>;
  const int64_t row_bytes = kFormat == 0 ? K : K / 2;
  PrefetchL2(w + n0 * row_bytes, cols * row_bytes);
}

// Columns [n0, n0 + kGemvCols x groups) of one row (codes xq, scale codes xs) into y (the row's
// outputs; rounded to BF16 where `round`, never with the gated pair), by the whole thread block;
// `sums` holds kGemvCols x groups x GemvStride(blocks) floats a matrix (at least 32). kGated: the
// same columns of pair.w too (each group of the weights w taken beside the same group of pair.w,
// so items 2g and 2g + 1 of a K-block are a group's two), and y gets SwigluValue of each column's
// two sums. With out.codes, y's codes then (GemvWriteCodes); with rope.rope_dim, each column of a
// head's rotated part rotated with its pair's (the neighbouring thread's, through shared memory)
// before it is written (never with the gated pair).
template <int kFormat, bool kGated = false>
__device__ void GemvTile(const uint8_t* xq, const uint8_t* xs, int64_t K, const uint8_t* w,
                         const uint8_t* ws, int64_t N, int64_t n0, int64_t groups, float* y,
                         float* sums, bool round, const GemvPair& pair = {},
                         const GemvCodes& out = {}, const GemvRope& rope = {}) {
  constexpr int64_t kMatrices = kGated ? 2 : 1;
  const int64_t blocks = K / kBlock, stride = GemvStride(blocks);
  const int64_t items = kMatrices * groups * blocks;
  const int64_t t = threadIdx.x;
  // Item i: group g = i / blocks of the pair's (matrix g % 2, column group g / 2) when gated.
  auto load = [&](int64_t i, GemvLoads<kFormat>& l) {
    const int64_t g = i / blocks, q = kGated ? g / 2 : g;
    const bool second = kGated && g % 2 == 1;
    GemvLoad<kFormat>(xq, xs, second ? pair.w : w, second ? pair.ws : ws, K, N,
                      n0 + q * kGemvCols<kFormat>, i % blocks, l);
  };
  GemvLoads<kFormat> next;
  if (t < items) load(t, next);
  for (int64_t i = t; i < items; i += kGemvThreads) {
    const GemvLoads<kFormat> cur = next;
    const int64_t g = i / blocks, b = i % blocks;
    const int64_t n = n0 + (kGated ? g / 2 : g) * kGemvCols<kFormat>;
    if (i + kGemvThreads < items) load(i + kGemvThreads, next);
    float xv[kBlock];
    GemvActivations(cur.x, cur.x_scale, xv);
    FLASHD_UNROLL
    for (int c = 0; c < kGemvCols<kFormat>; ++c) {
      if (n + c >= N) break;
      const float sum = kFormat == 0 && HasNanCode(cur.w[c])
                            ? GemvBlockSum<kFormat, true>(cur.w[c], xv)
                            : GemvBlockSum<kFormat, false>(cur.w[c], xv);
      sums[(g * kGemvCols<kFormat> + c) * stride + b] = sum * c::E8M0ToFloat(cur.w_scale[c]);
    }
  }
  __syncthreads();
  const bool mine = t < groups * kGemvCols<kFormat> && n0 + t < N;
  float v = 0;
  if (mine) {
    if constexpr (kGated) {
      // Column t's gate sums are group 2q's, its up sums group 2q + 1's (q = t / kGemvCols).
      const int64_t q = t / kGemvCols<kFormat>, c = t % kGemvCols<kFormat>;
      const float gate = SumInOrder(sums + (2 * q * kGemvCols<kFormat> + c) * stride, blocks);
      const float up = SumInOrder(sums + ((2 * q + 1) * kGemvCols<kFormat> + c) * stride, blocks);
      v = fm::SwigluValue(gate, up, pair.limit, pair.row_weight);
    } else {
      v = SumInOrder(sums + t * stride, blocks);
      if (round) v = c::RoundBf16(v);
    }
  }
  if (!kGated && rope.rope_dim > 0) {
    // n0 and the head size are even, so a pair's two columns are threads t and t ^ 1.
    __syncthreads();  // Every thread's sums read.
    if (mine) sums[t] = v;
    __syncthreads();
    const int64_t j = (n0 + t) % rope.head_dim, r0 = rope.head_dim - rope.rope_dim;
    if (mine && j >= r0) {
      const float other = sums[t ^ 1];
      const bool second = (j - r0) % 2 != 0;
      float sn, cs;
      PairSinCos(static_cast<float>(rope.positions[0]) * rope.freqs[(j - r0) / 2], false, &sn, &cs);
      v = RotatedValue(second ? other : v, second ? v : other, sn, cs, second);
    }
  }
  if (mine) y[n0 + t] = v;
  if (out.codes != nullptr) GemvWriteCodes(y, N, n0, groups * kGemvCols<kFormat>, out, sums);
}

// Linear's row: thread block j takes `groups` groups of columns from the j-th (kGated: of the
// gated pair, `pair` its up projection and SwiGLU).
template <int kFormat, bool kGated>
__global__ void __launch_bounds__(kGemvThreads)
    GemvKernel(const uint8_t* xq, const uint8_t* xs, int64_t K, const uint8_t* w, const uint8_t* ws,
               int64_t N, int64_t groups, float* y, bool round, GemvPair pair, GemvCodes out,
               GemvRope rope) {
  FLASHD_DYNAMIC_SHARED(float, sums);
  const int64_t n0 = blockIdx.x * groups * kGemvCols<kFormat>;
  PrefetchGemvWeights<kFormat>(w, K, N, n0, groups);
  PrefetchGemvWeights<kFormat>(kGated ? pair.w : nullptr, K, N, n0, groups);
  FLASHD_GRID_BEGIN();
  GemvTile<kFormat, kGated>(xq, xs, K, w, ws, N, n0, groups, y, sums, round, pair, out, rope);
}

// Several projections of one row (LinearParams::also) in one launch, each with its first thread
// block: thread block j takes the last projection whose first thread block is at most j (Of).
template <class P>
struct ProjectionList {
  P at[1 + kLinearMaxAlso];
  int count = 0;
  // Picked with a fixed trip count, so that the params are not indexed at run time.
  __device__ P Of(int64_t block) const {
    P p = at[0];
    FLASHD_UNROLL
    for (int i = 1; i < 1 + kLinearMaxAlso; ++i) {
      if (i < count && block >= at[i].first) p = at[i];
    }
    return p;
  }
};

// A projection's weights, outputs and column groups a thread block; its tiles as GemvKernel's.
struct GemvProjection {
  const uint8_t* w = nullptr;
  const uint8_t* ws = nullptr;
  int64_t N = 0, groups = 0, first = 0;
  float* y = nullptr;
  GemvRope rope;
};
using GemvProjections = ProjectionList<GemvProjection>;

template <int kFormat>
__global__ void __launch_bounds__(kGemvThreads)
    GemvProjectionsKernel(const uint8_t* xq, const uint8_t* xs, int64_t K, GemvProjections ps,
                          bool round) {
  FLASHD_DYNAMIC_SHARED(float, sums);
  const GemvProjection p = ps.Of(blockIdx.x);
  const int64_t n0 = (blockIdx.x - p.first) * p.groups * kGemvCols<kFormat>;
  PrefetchGemvWeights<kFormat>(p.w, K, p.N, n0, p.groups);
  FLASHD_GRID_BEGIN();
  GemvTile<kFormat>(xq, xs, K, p.w, p.ws, p.N, n0, p.groups, p.y, sums, round, {}, {}, p.rope);
}

// The experts' rows each on its own (a step of few tokens): thread block (row r, column tile
// j), r's slot the one whose rows hold it, its codes row r of xq (x_rows null) or row x_rows[r].
// kGated: the gated pair's SwiGLU of the rows' gate (w) and up (up) projections, row r weighted
// by row_weights[r] where given.
template <int kFormat, bool kGated>
__global__ void __launch_bounds__(kGemvThreads)
    ExpertGemvKernel(const uint8_t* xq, const uint8_t* xs, int64_t K, const int64_t* slot_expert,
                     const int64_t* slot_offset, int64_t slots, const uint8_t* const* w,
                     const uint8_t* const* ws, int64_t N, int64_t groups, int64_t tiles, float* y,
                     const uint8_t* const* up, const uint8_t* const* up_scales,
                     const float* row_weights, float limit, bool round, const int64_t* x_rows,
                     GemvCodes out) {
  FLASHD_GRID_BEGIN();
  FLASHD_DYNAMIC_SHARED(float, sums);
  __shared__ int64_t row_slot;
  const int64_t r = blockIdx.x / tiles, j = blockIdx.x % tiles;
  // The slot holding row r (the one non-empty slot whose rows hold it), by all threads at once:
  // a binary search would wait out one load after another before the first weight load.
  for (int64_t s = threadIdx.x; s < slots; s += kGemvThreads) {
    if (slot_offset[s] <= r && r < slot_offset[s + 1]) row_slot = s;
  }
  __syncthreads();
  const int64_t e = slot_expert[row_slot];
  GemvPair pair;
  if constexpr (kGated) {
    pair = {up[e], up_scales[e], row_weights != nullptr ? row_weights + r : nullptr, limit};
  }
  const int64_t xr = x_rows != nullptr ? x_rows[r] : r;
  GemvTile<kFormat, kGated>(xq + xr * K, xs + xr * (K / kBlock), K, w[e], ws[e], N,
                            j * groups * kGemvCols<kFormat>, groups, y + r * N, sums, round, pair,
                            out.Row(r, N));
}

// Column groups a thread block takes for K-blocks `blocks` and N columns (about two items a
// thread over its `matrices`: 2 for the gated pair), or 0 when the block sums would not fit (the
// GEMM tile then takes the row).
template <int kFormat>
int64_t GemvGroups(int64_t blocks, int64_t N, int64_t matrices = 1) {
  int64_t groups = kGemvItemsPerThread * kGemvThreads / (blocks * matrices);
  constexpr int64_t kMax = kGemvThreads / kGemvCols<kFormat>;  // A thread per column.
  groups = groups < 1 ? 1 : groups > kMax ? kMax : groups;
  const int64_t all = (N + kGemvCols<kFormat> - 1) / kGemvCols<kFormat>;
  if (groups > all) groups = all;
  return matrices * groups * kGemvCols<kFormat> * GemvStride(blocks) <= kGemvMaxSums ? groups : 0;
}

// The instance for a format (0 FP8, 1 FP4) and a bound of one row a tile or more.
template <template <int, int> class Kernel>
auto Pick(int format, bool one_row) {
  if (format == 0) return one_row ? Kernel<0, 1>::kFn : Kernel<0, kGemmRows>::kFn;
  return one_row ? Kernel<1, 1>::kFn : Kernel<1, kGemmRows>::kFn;
}
template <int kFormat, int kRows>
struct QuantizedGemm {
  static constexpr auto kFn = &QuantizedGemmKernel<kFormat, kRows>;
};
template <int kFormat, int kRows>
struct ExpertGemm {
  static constexpr auto kFn = &ExpertGemmKernel<kFormat, kRows>;
};
template <int kFormat, int kRows>
struct PartsGemm {
  static constexpr auto kFn = &PartsGemmKernel<kFormat, kRows>;
};

__global__ void ZeroKernel(float* y, int64_t n) {
  FLASHD_GRID_BEGIN();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) y[i] = 0.0f;
}

// Dense weights (fp32 values or BF16 codes: the same sums), in tiles of
// kTileCols output columns and up to kRows rows by kTileThreads threads: thread t keeps lane j = (t
// / 32) % 4 of column t % 32 for every row, the products of values k = j, j + 4, ... in order (the
// K % 4 last values in lane 0 after them), and the lanes meet as (p0 + p1) + (p2 + p3): the CPU's
// sums. K is taken in chunks of kDenseChunk, each chunk's weights and activations staged in
// shared memory by loads that neighbouring threads make on neighbouring addresses (a weight row
// is contiguous; one thread per output read rows K values apart). Products are not exact here
// (fp32 activations), so they are multiplied and added apart, as on the CPU.
constexpr int64_t kDenseChunk = 256;
constexpr int64_t kDenseStride = kDenseChunk + 1;  // Odd: a warp's 32 columns in 32 banks.

static_assert(kTileThreads == 4 * kTileCols, "a thread per lane and column");

template <class W, int kRows>
__global__ void __launch_bounds__(kTileThreads)
    DenseGemmKernel(const float* x, int64_t M, int64_t K, W w, int64_t N, float* y) {
  FLASHD_GRID_BEGIN();
  __shared__ float ws[kTileCols][kDenseStride];
  __shared__ float xs[kRows][kDenseChunk];
  __shared__ float lanes[kRows][4][kTileCols];
  const int64_t n0 = (blockIdx.x % ColumnGroups(N)) * kTileCols;
  const int64_t m0 = (blockIdx.x / ColumnGroups(N)) * kRows;
  const int64_t rows = M - m0 < kRows ? M - m0 : kRows;
  const unsigned t = threadIdx.x;
  const int64_t col = t % kTileCols, lane = t / kTileCols;
  const int64_t k4 = K - K % 4;  // Values from k4 on go to lane 0 after the rest.
  float p[kRows];
  FLASHD_UNROLL
  for (int r = 0; r < kRows; ++r) p[r] = 0.0f;
  for (int64_t c0 = 0; c0 < K; c0 += kDenseChunk) {
    const int64_t nk = K - c0 < kDenseChunk ? K - c0 : kDenseChunk;
    __syncthreads();  // The previous chunk's reads are done.
    for (int64_t i = t; i < kTileCols * kDenseChunk; i += kTileThreads) {
      const int64_t wc = i / kDenseChunk, k = i % kDenseChunk;
      if (k < nk && n0 + wc < N) ws[wc][k] = w(n0 + wc, c0 + k, K);
    }
    for (int64_t i = t; i < rows * kDenseChunk; i += kTileThreads) {
      const int64_t r = i / kDenseChunk, k = i % kDenseChunk;
      if (k < nk) xs[r][k] = x[(m0 + r) * K + c0 + k];
    }
    __syncthreads();
    if (n0 + col >= N) continue;
    const int64_t main_end = k4 - c0 < nk ? (k4 - c0 > 0 ? k4 - c0 : 0) : nk;
    for (int64_t k = lane; k < main_end; k += 4) {
      const float wk = ws[col][k];
      FLASHD_UNROLL
      for (int r = 0; r < kRows; ++r) {
        if (r < rows) p[r] += xs[r][k] * wk;
      }
    }
    if (lane == 0) {
      for (int64_t k = main_end; k < nk; ++k) {
        const float wk = ws[col][k];
        FLASHD_UNROLL
        for (int r = 0; r < kRows; ++r) {
          if (r < rows) p[r] += xs[r][k] * wk;
        }
      }
    }
  }
  FLASHD_UNROLL
  for (int r = 0; r < kRows; ++r) lanes[r][lane][col] = p[r];
  __syncthreads();
  for (int64_t i = t; i < rows * kTileCols; i += kTileThreads) {
    const int64_t r = i / kTileCols, cc = i % kTileCols;
    if (n0 + cc >= N) continue;
    y[(m0 + r) * N + n0 + cc] =
        (lanes[r][0][cc] + lanes[r][1][cc]) + (lanes[r][2][cc] + lanes[r][3][cc]);
  }
}

template <class W, bool kVectors>
__global__ void __launch_bounds__(kDenseGemvThreads)
    DenseGemvKernel(const float* x, int64_t K, W w, int64_t N, float* y) {
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * kDenseGemvCols;
  PrefetchDenseColumns(w, K, N, n0);
  FLASHD_GRID_BEGIN();
  DenseGemvColumns<W, kVectors>(x, K, w, N, y, n0);
}

// Several dense projections of one row (LinearParams::also) in one launch, as
// GemvProjectionsKernel's.
template <class W>
struct DenseProjection {
  W w{};
  int64_t N = 0, first = 0;
  float* y = nullptr;
};
template <class W>
using DenseProjections = ProjectionList<DenseProjection<W>>;

template <class W, bool kVectors>
__global__ void __launch_bounds__(kDenseGemvThreads)
    DenseGemvProjectionsKernel(const float* x, int64_t K, DenseProjections<W> ps) {
  const DenseProjection<W> p = ps.Of(blockIdx.x);
  const int64_t n0 = (static_cast<int64_t>(blockIdx.x) - p.first) * kDenseGemvCols;
  PrefetchDenseColumns(p.w, K, p.N, n0);
  FLASHD_GRID_BEGIN();
  DenseGemvColumns<W, kVectors>(x, K, p.w, p.N, p.y, n0);
}

// Thread blocks for M rows by N columns in tiles of one row (M == 1, one sequence's step) or of
// kGemmRows, each `times` times (the parts of a split, or side-by-side groups).
int64_t TileGrid(int64_t M, int64_t N, int64_t times = 1) {
  const int64_t tile_rows = M == 1 ? 1 : kGemmRows;
  return (M + tile_rows - 1) / tile_rows * ColumnGroups(N) * times;
}

template <class W>
OpStatus DenseLinear(const float* x, int64_t M, int64_t K, W w, int64_t N, float* y,
                     gpuStream_t stream) {
  if (M == 1) {
    const int64_t grid = (N + kDenseGemvCols - 1) / kDenseGemvCols;
    if (grid > int64_t{0x7FFFFFFF}) return OpStatus::kBadShape;
    const auto kernel =
        w.Vectors(K) && Aligned(x, 16) ? &DenseGemvKernel<W, true> : &DenseGemvKernel<W, false>;
    FLASHD_LAUNCH(kernel, static_cast<unsigned>(grid), kDenseGemvThreads, 0, stream, x, K, w, N, y);
    return gpuGetLastError() == gpuSuccess ? OpStatus::kOk : OpStatus::kDeviceError;
  }
  const int64_t grid = TileGrid(M, N);
  if (grid > int64_t{0x7FFFFFFF}) return OpStatus::kBadShape;
  const auto kernel = &DenseGemmKernel<W, kGemmRows>;
  FLASHD_LAUNCH(kernel, static_cast<unsigned>(grid), kTileThreads, 0, stream, x, M, K, w, N, y);
  return gpuGetLastError() == gpuSuccess ? OpStatus::kOk : OpStatus::kDeviceError;
}

// The tile reads weights 16 bytes and activation codes 4 bytes at a time.

unsigned Blocks(int64_t n) { return static_cast<unsigned>((n + kThreads - 1) / kThreads); }

// FP8 codes used as their values (kFp8Dense: wo_a), the dense sums over fp32 activations, for
// `groups` projections side by side. Each lane of the CPU's sums (values k = j, j + 4, ... of a
// row, in order) is one chain of adds, so a column can use four threads at most: thread t of a
// block takes column t / 4 of the tile's kTileCols and lane j = t % 4, and a launch has 4 x
// columns x groups threads (wo_a at batch 1: 32,768, where tiles of whole columns would give a
// fourth of that, each reading its rows a byte a load). K goes 64 values a step: the four
// threads of a column each load the step's 64 codes (four 16-byte loads at the same addresses,
// which the memory system serves once) and decode their lane's 16, byte j of every word; the
// loads of the next kAhead steps are in flight while a step is summed. A row's activations are
// staged in shared memory a chunk at a time, each lane's values together.
//
// A code is decoded as in the quantized tile (its value times 2^-120, without a multiply) and
// its 32x32 tile's scale s applied as s x 2^120 (exact for s <= 2^7): the product is the
// CPU's code value times s, the same real number rounded once, so the sums are the CPU's bit for
// bit. Larger scales take the exact decode. A NaN code (magnitude 0x7F) decodes as 480 x 2^-120,
// above every finite code's 448: a lane that met one gives NaN, as the CPU's sums do.
constexpr int64_t kValueStep = 64;
constexpr int64_t kValueChunk = 1024;
constexpr int64_t kValueLanes = kValueChunk / 4 + 4;  // float4-aligned, lanes four banks apart
constexpr float kValueScaledMax = 448.0f * 0x1p-120f;

template <int kRows>
constexpr int kValueAhead = kRows == 1 ? 8 : 4;

template <int kRows>
__global__ void __launch_bounds__(kTileThreads)
    Fp8ValuesKernel(const float* x, int64_t M, int64_t K, int64_t groups, const uint8_t* w,
                    const uint8_t* scales, int64_t row0, int64_t N, float* y, bool round,
                    uint8_t* codes, uint8_t* code_scales) {
  constexpr int kAhead = kValueAhead<kRows>;
  __shared__ float4 xt[kRows][4][kValueLanes / 4];
  __shared__ float lanes[kRows][kTileCols][5];
  const int64_t col_groups = ColumnGroups(N);
  const int64_t n0 = (blockIdx.x % col_groups) * kTileCols;
  const int64_t g = (blockIdx.x / col_groups) % groups;
  PrefetchL2(w + (g * N + n0) * K, (N - n0 < kTileCols ? N - n0 : kTileCols) * K);
  FLASHD_GRID_BEGIN();
  const int64_t m0 = blockIdx.x / (col_groups * groups) * kRows;
  const int64_t rows = kRows == 1 ? 1 : M - m0 < kRows ? M - m0 : kRows;
  const unsigned t = threadIdx.x;
  const int64_t col = t / 4, n = n0 + col;
  const int j = static_cast<int>(t % 4);
  const int64_t row = g * N + (n < N ? n : N - 1);  // Columns past N read the last row.
  const uint8_t* wrow = w + row * K;
  const uint8_t* srow = scales + (row0 + row) / kBlock * (K / kBlock);
  const float* xg = x + g * K;
  const int64_t x_stride = groups * K;

  const uint4* wq = reinterpret_cast<const uint4*>(wrow);
  const int whole_steps = static_cast<int>(K / kValueStep);  // Then one 32-block if K % 64.
  float p[kRows];
  FLASHD_UNROLL
  for (int r = 0; r < kRows; ++r) p[r] = 0.0f;
  float vmax = 0.0f;
  const int shift = 24 - 8 * j;
  // The chunk of activations from c0, lane by lane, once every thread is done with the last.
  const auto stage = [&](int64_t c0) {
    __syncthreads();
    for (int64_t i = t; i < rows * kValueChunk; i += kTileThreads) {
      const int64_t r = i / kValueChunk, kk = i % kValueChunk;
      if (c0 + kk < K) {
        reinterpret_cast<float*>(xt[r][kk % 4])[kk / 4] = xg[(m0 + r) * x_stride + c0 + kk];
      }
    }
    __syncthreads();
  };
  // The step at K-offset k0: its 16 words (8 when it holds one 32-block) with the two blocks'
  // scale codes in sc.
  const auto sum_step = [&](const uint32_t(&words)[16], uint32_t sc, int64_t k0, bool whole) {
    const int q0 = static_cast<int>(k0 % kValueChunk / 16);  // The step's first float4 a lane.
    const uint32_t e0 = sc & 0xFF, e1 = sc >> 8;
    const bool fast = e0 <= 134 && e1 <= 134;
    const float s_lo =
        fast ? c::FromBits((e0 + 120) << 23) : c::E8M0ToFloat(static_cast<uint8_t>(e0));
    const float s_hi =
        fast ? c::FromBits((e1 + 120) << 23) : c::E8M0ToFloat(static_cast<uint8_t>(e1));
    FLASHD_UNROLL
    for (int h = 0; h < 16; ++h) {
      if (h >= 8 && !whole) break;
      float wv;
      if (fast) {
        const int32_t top = static_cast<int32_t>(words[h] << shift);
        const float v = c::FromBits(static_cast<uint32_t>(top >> 4) & 0x87F00000u);
        vmax = fmaxf(vmax, fabsf(v));
        wv = v * (h < 8 ? s_lo : s_hi);
      } else {
        wv = c::E4M3ToFloat(static_cast<uint8_t>(words[h] >> (8 * j))) * (h < 8 ? s_lo : s_hi);
      }
      FLASHD_UNROLL
      for (int r = 0; r < kRows; ++r) {
        if (r >= rows) break;
        const float4 x4 = xt[r][j][q0 + h / 4];
        const float xv = h % 4 == 0 ? x4.x : h % 4 == 1 ? x4.y : h % 4 == 2 ? x4.z : x4.w;
        const float prod = xv * wv;
        p[r] = p[r] + prod;
      }
    }
  };
  const auto words_of = [](const uint4* q, uint32_t(&words)[16]) {
    FLASHD_UNROLL
    for (int i = 0; i < 4; ++i) {
      words[4 * i] = q[i].x;
      words[4 * i + 1] = q[i].y;
      words[4 * i + 2] = q[i].z;
      words[4 * i + 3] = q[i].w;
    }
  };
  // The whole steps, kAhead steps' loads in flight ahead of the sums.
  uint4 raw[kAhead][4];
  uint32_t sc[kAhead];
  FLASHD_UNROLL
  for (int a = 0; a < kAhead; ++a) {
    if (a >= whole_steps) break;
    FLASHD_UNROLL
    for (int i = 0; i < 4; ++i) raw[a][i] = wq[4 * a + i];
    sc[a] = srow[2 * a] | uint32_t{srow[2 * a + 1]} << 8;
  }
  for (int s0 = 0; s0 < whole_steps; s0 += kAhead) {
    FLASHD_UNROLL
    for (int a = 0; a < kAhead; ++a) {
      const int s = s0 + a;
      if (s >= whole_steps) break;
      const int64_t k0 = int64_t{s} * kValueStep;
      if (k0 % kValueChunk == 0) stage(k0);
      uint32_t words[16];
      words_of(raw[a], words);
      sum_step(words, sc[a], k0, true);
      const int next = s + kAhead;
      if (next < whole_steps) {
        FLASHD_UNROLL
        for (int i = 0; i < 4; ++i) raw[a][i] = wq[4 * next + i];
        sc[a] = srow[2 * next] | uint32_t{srow[2 * next + 1]} << 8;
      }
    }
  }
  if (K % kValueStep != 0) {  // One 32-block left.
    const int64_t k0 = int64_t{whole_steps} * kValueStep;
    if (k0 % kValueChunk == 0) stage(k0);
    const uint4 half[4] = {wq[4 * whole_steps], wq[4 * whole_steps + 1], uint4{0, 0, 0, 0},
                           uint4{0, 0, 0, 0}};
    uint32_t words[16];
    words_of(half, words);
    sum_step(words, srow[2 * whole_steps], k0, false);
  }
  if (vmax > kValueScaledMax) {  // A NaN code in this lane.
    FLASHD_UNROLL
    for (int r = 0; r < kRows; ++r) p[r] = c::FromBits(0x7FC00000u);
  }
  FLASHD_UNROLL
  for (int r = 0; r < kRows; ++r) lanes[r][col][j] = p[r];
  __syncthreads();
  for (int64_t i = t; i < rows * kTileCols; i += kTileThreads) {
    const int64_t r = i / kTileCols, cc = i % kTileCols;
    if (n0 + cc >= N) continue;
    const float v = (lanes[r][cc][0] + lanes[r][cc][1]) + (lanes[r][cc][2] + lanes[r][cc][3]);
    y[(m0 + r) * groups * N + g * N + n0 + cc] = round ? c::RoundBf16(v) : v;
  }
  if (codes != nullptr) {  // Each row's 32 outputs here are one block of its codes (N % 32 == 0).
    __syncthreads();
    for (int64_t r = t; r < rows; r += kTileThreads) {
      const int64_t at = (m0 + r) * groups * N + g * N + n0;
      QuantizeBlock(y + at, codes + at, code_scales + at / kBlock);
    }
  }
}

// The same sums for many rows (a prompt's chunk), as a register-blocked tile: a thread block
// takes 64 rows by 64 columns of one group, and each thread keeps one lane's chains (the lane of
// warp pair j = thread / 64) for 8 rows by 8 columns, 64 chains in registers. K goes 64 values a
// chunk: the chunk's activations (64 x 64 floats) and weight values (each code decoded once, as
// the CPU's dequantization: code value x tile scale) are staged in shared memory lane by lane,
// value k of a row at [k % 4][k / 4], so that a thread's step reads its 8 rows' and 8 columns'
// values of one k in four 16-byte loads and adds 64 products to its chains, k in order. The next
// chunk's loads are in registers while a chunk is summed. At the end the lanes meet through shared
// memory as the CPU's (p0 + p1) + (p2 + p3). The operations are the CPU's, value by value (a NaN
// code or scale gives a NaN value, which its lane carries): the same bits. The weights are read
// once per 64 rows (the row kernel above: once per 8).
constexpr int64_t kValueTileRows = 64, kValueTileCols = 64, kValueTileK = 64;
constexpr unsigned kValueTileThreads = 256;
constexpr int64_t kValueTilePitch = kValueTileRows + 4;  // Staged stores two banks apart at most.
constexpr int64_t kValueTileLane = kValueTileK / 4 * kValueTilePitch;  // Floats a lane's stage.
constexpr int64_t kValueTileMinRows = 64;  // Fewer rows take Fp8ValuesKernel.
static_assert(kValueTileRows == kValueTileCols && kValueTileThreads == 4 * 64,
              "a thread per (lane, 8 x 8 outputs) of the 64 x 64 tile");
static_assert(2 * 4 * kValueTileLane >= 2 * kValueTileRows * kValueTileCols,
              "two lanes' sums fit where the chunk was staged");

__global__ void __launch_bounds__(kValueTileThreads)
    Fp8ValuesTileKernel(const float* x, int64_t M, int64_t K, int64_t groups, const uint8_t* w,
                        const uint8_t* scales, int64_t row0, int64_t N, float* y) {
  FLASHD_GRID_BEGIN();
  __shared__ float4 stage4[2 * 4 * kValueTileLane / 4];
  float* xs = reinterpret_cast<float*>(stage4);  // [lane][k / 4][row], then the weights':
  float* ws = xs + 4 * kValueTileLane;           // [lane][k / 4][column].
  const int64_t col_tiles = (N + kValueTileCols - 1) / kValueTileCols;
  const int64_t n0 = blockIdx.x % col_tiles * kValueTileCols;
  const int64_t g = blockIdx.x / col_tiles % groups;
  const int64_t m0 = blockIdx.x / (col_tiles * groups) * kValueTileRows;
  const unsigned t = threadIdx.x;
  const int j = static_cast<int>(t / 64);     // The lane: k % 4.
  const int64_t mg = t % 64 / 8, ng = t % 8;  // This thread's rows and columns (row_of below).
  const int64_t x_stride = groups * K, blocks = K / kBlock;
  // Staging: x as 1,024 float4 (row f / 16, values 4 (f % 16) ...), four a thread; the weights as
  // 256 16-byte words (column t / 4, values 16 (t % 4) ...), one a thread.
  const int64_t w_col = t / 4, w_part = t % 4;
  const int64_t w_row = g * N + (n0 + w_col < N ? n0 + w_col : N - 1);
  const uint8_t* w_codes = w + w_row * K;
  const uint8_t* w_scales = scales + (row0 + w_row) / kBlock * blocks;
  float4 xr[4];
  uint4 wr;
  uint8_t wsc;
  const auto load = [&](int64_t c0) {
    FLASHD_UNROLL
    for (int i = 0; i < 4; ++i) {
      const int64_t f = t + i * kValueTileThreads, r = f / 16, k = c0 + 4 * (f % 16);
      xr[i] = m0 + r < M && k < K
                  ? *reinterpret_cast<const float4*>(x + (m0 + r) * x_stride + g * K + k)
                  : float4{0, 0, 0, 0};
    }
    const int64_t k = c0 + 16 * w_part;
    wr = k < K ? *reinterpret_cast<const uint4*>(w_codes + k) : uint4{0, 0, 0, 0};
    wsc = k < K ? w_scales[k / kBlock] : uint8_t{0};
  };
  const auto store = [&]() {
    FLASHD_UNROLL
    for (int i = 0; i < 4; ++i) {
      const int64_t f = t + i * kValueTileThreads, r = f / 16, q = f % 16;
      xs[0 * kValueTileLane + q * kValueTilePitch + r] = xr[i].x;
      xs[1 * kValueTileLane + q * kValueTilePitch + r] = xr[i].y;
      xs[2 * kValueTileLane + q * kValueTilePitch + r] = xr[i].z;
      xs[3 * kValueTileLane + q * kValueTilePitch + r] = xr[i].w;
    }
    const float scale = c::E8M0ToFloat(wsc);
    const uint32_t words[4] = {wr.x, wr.y, wr.z, wr.w};
    FLASHD_UNROLL
    for (int v = 0; v < 16; ++v) {
      const uint8_t code = static_cast<uint8_t>(words[v / 4] >> (8 * (v % 4)));
      const int64_t q = 4 * w_part + v / 4;  // (16 w_part + v) / 4
      ws[(v % 4) * kValueTileLane + q * kValueTilePitch + w_col] = c::E4M3ToFloat(code) * scale;
    }
  };
  float p[8][8];
  FLASHD_UNROLL
  for (int a = 0; a < 8; ++a) {
    FLASHD_UNROLL
    for (int b = 0; b < 8; ++b) p[a][b] = 0.0f;
  }
  load(0);
  for (int64_t c0 = 0; c0 < K; c0 += kValueTileK) {
    __syncthreads();  // The last chunk's readers are done.
    store();
    __syncthreads();
    if (c0 + kValueTileK < K) load(c0 + kValueTileK);
    const int64_t steps = (K - c0 < kValueTileK ? K - c0 : kValueTileK) / 4;
    const float* xl = xs + j * kValueTileLane;
    const float* wl = ws + j * kValueTileLane;
    for (int64_t q = 0; q < steps; ++q) {
      const float4* xq = reinterpret_cast<const float4*>(xl + q * kValueTilePitch);
      const float4* wq = reinterpret_cast<const float4*>(wl + q * kValueTilePitch);
      const float4 x0 = xq[mg], x1 = xq[8 + mg], w0 = wq[ng], w1 = wq[8 + ng];
      const float xv[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
      const float wv[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
      FLASHD_UNROLL
      for (int a = 0; a < 8; ++a) {
        FLASHD_UNROLL
        for (int b = 0; b < 8; ++b) {
          const float prod = xv[a] * wv[b];
          p[a][b] = p[a][b] + prod;
        }
      }
    }
  }
  // The lanes met as (p0 + p1) + (p2 + p3): lanes 1 and 3 hand their sums over, lanes 0 and 2
  // add them, lane 2 hands its pair's over, lane 0 adds and writes.
  // This thread's a-th row and b-th column of the tile (the two float4s it read a step).
  const auto row_of = [&](int a) { return a < 4 ? 4 * mg + a : 32 + 4 * mg + a - 4; };
  const auto col_of = [&](int b) { return b < 4 ? 4 * ng + b : 32 + 4 * ng + b - 4; };
  float* part = xs;  // [2][64 rows][64 columns]
  const auto at = [&](int which, int a, int b) {
    return part + (which * kValueTileRows + row_of(a)) * kValueTileCols + col_of(b);
  };
  __syncthreads();
  if (j == 1 || j == 3) {
    FLASHD_UNROLL
    for (int a = 0; a < 8; ++a) {
      FLASHD_UNROLL
      for (int b = 0; b < 8; ++b) *at(j / 2, a, b) = p[a][b];
    }
  }
  __syncthreads();
  if (j == 0 || j == 2) {
    FLASHD_UNROLL
    for (int a = 0; a < 8; ++a) {
      FLASHD_UNROLL
      for (int b = 0; b < 8; ++b) p[a][b] = p[a][b] + *at(j / 2, a, b);
    }
  }
  __syncthreads();
  if (j == 2) {
    FLASHD_UNROLL
    for (int a = 0; a < 8; ++a) {
      FLASHD_UNROLL
      for (int b = 0; b < 8; ++b) *at(0, a, b) = p[a][b];
    }
  }
  __syncthreads();
  if (j != 0) return;
  FLASHD_UNROLL
  for (int a = 0; a < 8; ++a) {
    const int64_t m = m0 + row_of(a);
    if (m >= M) continue;
    FLASHD_UNROLL
    for (int b = 0; b < 8; ++b) {
      const int64_t n = n0 + col_of(b);
      if (n < N) y[m * groups * N + g * N + n] = p[a][b] + *at(0, a, b);
    }
  }
}

// `*rounded`: whether the kernel rounded y as p.round_output asks.
// `*coded` set where the kernel wrote y's codes (LinearParams::y_codes) as it wrote y.
OpStatus Fp8ValuesLinear(const LinearParams& p, gpuStream_t stream, bool* rounded, bool* coded) {
  if (!Aligned(p.w, 16)) return OpStatus::kBadArgument;   // Rows are read 16 bytes a load.
  if (p.rows >= kValueTileMinRows && Aligned(p.x, 16)) {  // The tile reads x 16 bytes a load.
    const int64_t grid = (p.rows + kValueTileRows - 1) / kValueTileRows *
                         ((p.out + kValueTileCols - 1) / kValueTileCols) * p.groups;
    if (grid > int64_t{0x7FFFFFFF}) return OpStatus::kBadShape;
    FLASHD_LAUNCH(Fp8ValuesTileKernel, static_cast<unsigned>(grid), kValueTileThreads, 0, stream,
                  p.x, p.rows, p.in, p.groups, p.w, p.w_scales, p.w_row0, p.out, p.y);
    return gpuGetLastError() == gpuSuccess ? OpStatus::kOk : OpStatus::kDeviceError;
  }
  const bool one_row = p.rows == 1;
  const int64_t grid = TileGrid(p.rows, p.out, p.groups);  // Each group's tiles.
  if (grid > int64_t{0x7FFFFFFF}) return OpStatus::kBadShape;
  const auto kernel = one_row ? &Fp8ValuesKernel<1> : &Fp8ValuesKernel<kGemmRows>;
  uint8_t* codes = coded != nullptr ? p.y_codes : nullptr;
  FLASHD_LAUNCH(kernel, static_cast<unsigned>(grid), kTileThreads, 0, stream, p.x, p.rows, p.in,
                p.groups, p.w, p.w_scales, p.w_row0, p.out, p.y, p.round_output, codes,
                codes != nullptr ? p.y_code_scales : nullptr);
  *rounded = true;
  if (codes != nullptr) *coded = true;
  return gpuGetLastError() == gpuSuccess ? OpStatus::kOk : OpStatus::kDeviceError;
}

// FP8 or FP4 weights: the activations quantized, then the fixed-order GEMM (free false), split
// `split` ways over K through the block sums when split > 1, or the free-order one split
// `split` ways. `quantized`: x_codes hold x's codes already (LinearParams::also's projections).
OpStatus QuantizedLinear(const LinearParams& p, int split, bool free, bool quantized = false) {
  if (const OpStatus s = CheckQuantizedLinear(p, 4); s != OpStatus::kOk) return s;
  const int64_t outputs = p.rows * p.out, blocks = p.in / kBlock;
  if (!free && split > 1 && (p.block_sums == nullptr || p.block_sums_count < outputs * blocks)) {
    return OpStatus::kBadArgument;
  }
  const gpuStream_t stream = static_cast<gpuStream_t>(p.stream);
  const bool one_row = p.rows == 1;
  const int64_t grid = TileGrid(p.rows, p.out, split);
  if (grid > int64_t{0x7FFFFFFF}) return OpStatus::kBadShape;  // The grid's limit.
  const int64_t quantize = p.rows * blocks;
  const int format = p.format == WeightFormat::kFp8 ? 0 : 1;
  if (!quantized && !p.x_quantized) {
    QuantizeActivations(p.x, quantize, p.x_codes, p.x_scales, stream);
  }
  if (!free && split == 1) {
    const auto kernel = Pick<QuantizedGemm>(format, one_row);
    FLASHD_LAUNCH(kernel, static_cast<unsigned>(grid), kTileThreads, 0, stream, p.x_codes,
                  p.x_scales, p.rows, p.in, p.w, p.w_scales, p.out, p.y);
  } else {
    if (free && split > 1) {
      FLASHD_LAUNCH(ZeroKernel, Blocks(outputs), kThreads, 0, stream, p.y, outputs);
    }
    float* sums = free ? nullptr : p.block_sums;
    const auto kernel = Pick<PartsGemm>(format, one_row);
    FLASHD_LAUNCH(kernel, static_cast<unsigned>(grid), kTileThreads, 0, stream, p.x_codes,
                  p.x_scales, p.rows, p.in, p.w, p.w_scales, p.out, split, p.y, sums);
    if (!free) {
      FLASHD_LAUNCH(BlockSumsKernel, Blocks(outputs), kThreads, 0, stream, p.block_sums, outputs,
                    blocks, p.y);
    }
  }
  return gpuGetLastError() == gpuSuccess ? OpStatus::kOk : OpStatus::kDeviceError;
}

// A GEMV launch for `in` x `out` weights: column groups a thread block, thread blocks a row and
// the block sums' bytes; groups 0 when the GEMV does not take the row.
struct GemvShape {
  int64_t groups = 0, tiles = 0;
  size_t shared = 0;
};
GemvShape GemvShapeFor(WeightFormat format, int64_t in, int64_t out, int64_t matrices = 1) {
  const bool fp8 = format == WeightFormat::kFp8;
  const int64_t blocks = in / kBlock, cols = fp8 ? kGemvCols<0> : kGemvCols<1>;
  const int64_t groups =
      fp8 ? GemvGroups<0>(blocks, out, matrices) : GemvGroups<1>(blocks, out, matrices);
  if (groups == 0) return {};
  // The block sums, and at least the 32 floats GemvWriteCodes stages.
  const int64_t floats = std::max(matrices * groups * cols * GemvStride(blocks), kBlock);
  return {groups, ((out + cols - 1) / cols + groups - 1) / groups,
          static_cast<size_t>(floats) * sizeof(float)};
}

// The rotation a GEMV makes of p's y (LinearParams' rope).
GemvRope GemvRopeOf(const LinearParams& p) {
  if (p.rope_dim == 0) return {};
  return {p.rope_dim, p.rope_head_dim, p.rope_positions, p.rope_freqs};
}

// The codes a GEMV writes for p's y (LinearParams' or ExpertLinearParams'): none unless p asks
// for them and `arrivals` are given.
template <class P>
GemvCodes GemvCodesOf(const P& p, unsigned* arrivals) {
  if (arrivals == nullptr || p.y_codes == nullptr) return {};
  return {p.y_codes, p.y_code_scales, arrivals};
}

// Linear's one row through the GEMV (p checked; g.groups > 0; the gated pair's shape when p has
// one); `quantized` as QuantizedLinear's; `*coded` set where it writes y's codes (arrivals given);
// it rotates y as p's rope asks (`*rotated` set).
OpStatus GemvLinear(const LinearParams& p, const GemvShape& g, bool quantized, unsigned* arrivals,
                    bool* coded, bool* rotated) {
  if (g.tiles > int64_t{0x7FFFFFFF}) return OpStatus::kBadShape;
  const gpuStream_t stream = static_cast<gpuStream_t>(p.stream);
  if (!quantized) QuantizeActivations(p.x, p.in / kBlock, p.x_codes, p.x_scales, stream);
  const bool fp8 = p.format == WeightFormat::kFp8, gated = p.up != nullptr;
  const auto kernel = gated ? (fp8 ? &GemvKernel<0, true> : &GemvKernel<1, true>)
                            : (fp8 ? &GemvKernel<0, false> : &GemvKernel<1, false>);
  const GemvPair pair = {p.up, p.up_scales, p.row_weights, p.limit};
  const GemvCodes out = GemvCodesOf(p, arrivals);
  if (out.codes != nullptr && coded != nullptr) *coded = true;
  if (rotated != nullptr) *rotated = true;
  FLASHD_LAUNCH(kernel, static_cast<unsigned>(g.tiles), kGemvThreads, g.shared, stream, p.x_codes,
                p.x_scales, p.in, p.w, p.w_scales, p.out, g.groups, p.y, p.round_output, pair, out,
                GemvRopeOf(p));
  return gpuGetLastError() == gpuSuccess ? OpStatus::kOk : OpStatus::kDeviceError;
}

// Linear's one row and its `also` of dense or BF16 weights through one GEMV launch (p's weights
// there, also fitting).
template <class W>
OpStatus DenseProjectionsLinear(const LinearParams& p, W (*values)(const LinearParams&)) {
  DenseProjections<W> ps;
  int64_t blocks = 0;
  bool vectors = Aligned(p.x, 16);
  for (int64_t j = -1; j < p.also_count; ++j) {
    const LinearParams q = LinearAlone(p, j);
    ps.at[ps.count++] = {values(q), q.out, blocks, q.y};
    vectors = vectors && values(q).Vectors(q.in);
    blocks += (q.out + kDenseGemvCols - 1) / kDenseGemvCols;
  }
  if (blocks > int64_t{0x7FFFFFFF}) return OpStatus::kBadShape;
  const auto kernel =
      vectors ? &DenseGemvProjectionsKernel<W, true> : &DenseGemvProjectionsKernel<W, false>;
  FLASHD_LAUNCH(kernel, static_cast<unsigned>(blocks), kDenseGemvThreads, 0,
                static_cast<gpuStream_t>(p.stream), p.x, p.in, ps);
  return gpuGetLastError() == gpuSuccess ? OpStatus::kOk : OpStatus::kDeviceError;
}

// Linear's one row and its `also` through one GEMV launch, x quantized once (p checked, also
// fitting); false, launching nothing, where the GEMV does not take each of them alone. `*rotated`
// set where the launch rotates p's own projection as its rope asks.
bool GemvProjectionsLinear(const LinearParams& p, OpStatus* status, bool* rotated) {
  // Dense weights (whose GEMV does not round) at one row, unrounded.
  const bool dense_row = p.rows == 1 && !p.round_output;
  if (dense_row && p.format == WeightFormat::kDense && p.dense != nullptr) {
    *status = DenseProjectionsLinear<F32Values>(
        p, [](const LinearParams& q) { return F32Values{q.dense}; });
    return true;
  }
  if (dense_row && p.format == WeightFormat::kBf16 && p.w != nullptr) {
    *status = DenseProjectionsLinear<Bf16Values>(p, [](const LinearParams& q) {
      return Bf16Values{reinterpret_cast<const uint16_t*>(q.w)};
    });
    return true;
  }
  if (p.rows != 1 || (p.format != WeightFormat::kFp8 && p.format != WeightFormat::kFp4)) {
    return false;
  }
  GemvProjections ps;
  size_t shared = 0;
  int64_t tiles = 0;
  for (int64_t j = -1; j < p.also_count; ++j) {
    const LinearParams q = LinearAlone(p, j);
    const GemvShape g = GemvShapeFor(q.format, q.in, q.out);
    if (CheckQuantizedLinear(q, 16) != OpStatus::kOk || g.groups == 0) return false;
    ps.at[ps.count++] = {q.w, q.w_scales, q.out, g.groups, tiles, q.y, GemvRopeOf(q)};
    shared = std::max(shared, g.shared);
    tiles += g.tiles;
  }
  if (tiles > int64_t{0x7FFFFFFF}) return false;
  const gpuStream_t stream = static_cast<gpuStream_t>(p.stream);
  if (!p.x_quantized) QuantizeActivations(p.x, p.in / kBlock, p.x_codes, p.x_scales, stream);
  const auto kernel =
      p.format == WeightFormat::kFp8 ? &GemvProjectionsKernel<0> : &GemvProjectionsKernel<1>;
  FLASHD_LAUNCH(kernel, static_cast<unsigned>(tiles), kGemvThreads, shared, stream, p.x_codes,
                p.x_scales, p.in, ps, p.round_output);
  *status = gpuGetLastError() == gpuSuccess ? OpStatus::kOk : OpStatus::kDeviceError;
  *rotated = true;
  return true;
}

}  // namespace

void QuantizeActivations(const float* x, int64_t blocks, uint8_t* codes, uint8_t* scales,
                         gpuStream_t stream) {
  FLASHD_LAUNCH(QuantizeKernel, Blocks(blocks), kThreads, 0, stream, x, blocks, codes, scales);
}

void QuantizeExpertRows(const ExpertLinearParams& p, gpuStream_t stream) {
  if (p.x_quantized) return;  // x_codes hold them.
  const int64_t blocks = p.rows * (p.in / kBlock);
  if (p.x_rows == nullptr) return QuantizeActivations(p.x, blocks, p.x_codes, p.x_scales, stream);
  FLASHD_LAUNCH(QuantizeGatheredKernel, Blocks(blocks), kThreads, 0, stream, p.x, p.x_rows, p.rows,
                p.in, p.x_codes, p.x_scales);
}

namespace {
OpStatus ExpertLinearOnce(const ExpertLinearParams& p, unsigned* arrivals, bool* coded);
}  // namespace

OpStatus ExpertLinear(const ExpertLinearParams& p, unsigned* arrivals) {
  if (p.round_output && p.up != nullptr) return OpStatus::kBadArgument;
  if (const OpStatus s = ExpertCodesFit(p); s != OpStatus::kOk) return s;
  bool coded = p.y_codes == nullptr;
  const OpStatus s = ExpertLinearOnce(p, arrivals, &coded);
  return CodesAfter(s, coded, p);  // y's codes after y as the op leaves it.
}

namespace {

// ExpertLinear (p's codes checked), with `*coded` set where the GEMV wrote y's codes.
OpStatus ExpertLinearOnce(const ExpertLinearParams& p, unsigned* arrivals, bool* coded) {
  bool none = false;
  if (const OpStatus s = CheckExpertLinear(p, 4, &none); s != OpStatus::kOk) return s;
  if (none) return RoundedAfter(OpStatus::kOk, !p.round_output, p.y, p.rows * p.out, p.stream);
  // Every slot's rows in whole tiles: at most rows / kGemmRows plus one partial tile per slot.
  const int64_t grid = ((p.rows + kGemmRows - 1) / kGemmRows + p.slots) * ColumnGroups(p.out);
  if (grid > int64_t{0x7FFFFFFF}) return OpStatus::kBadShape;
  const gpuStream_t stream = static_cast<gpuStream_t>(p.stream);
  // A decode step's few tokens (at most kExpertGemvRows rows a slot) through the GEMV, each row
  // on its own: an expert chosen by several of the tokens is read once a row, which at a step of
  // a few sequences is about what the tile reads (their choices mostly differ), without the
  // tile's wait at every chunk of K.
  // The gated pair (w1 and w3 under SwiGLU) in one GEMV, the rows' activations quantized once
  // for both and the SwiGLU applied to the sums as they are made; else two products and a
  // Swiglu op.
  const bool gated = p.up != nullptr;
  const bool few = p.slot_rows >= 1 && p.slot_rows <= kExpertGemvRows;
  const GemvShape g = few ? GemvShapeFor(p.format, p.in, p.out, gated ? 2 : 1) : GemvShape{};
  const bool gemv = g.groups > 0 && Aligned(p.x_codes, 16);
  if (gemv && p.rows * g.tiles > int64_t{0x7FFFFFFF}) return OpStatus::kBadShape;
  if (gated && (!gemv || p.up_scales == nullptr)) {
    return GatedApart(  // y's codes after the SwiGLU (ExpertLinear).
        p, [](const ExpertLinearParams& q) { return ExpertLinear(q); },
        [](const SwigluParams& q) { return Swiglu(q); });
  }
  // The GEMV reads x's own rows' codes through x_rows where the op has them; else the rows are
  // quantized first (unless x_codes hold them).
  const bool given = gemv && p.x_rows != nullptr && p.x_row_codes != nullptr &&
                     p.x_row_scales != nullptr && Aligned(p.x_row_codes, 16);
  if (!given) QuantizeExpertRows(p, stream);
  if (gemv) {
    const bool fp8 = p.format == WeightFormat::kFp8;
    const auto kernel = gated ? (fp8 ? &ExpertGemvKernel<0, true> : &ExpertGemvKernel<1, true>)
                              : (fp8 ? &ExpertGemvKernel<0, false> : &ExpertGemvKernel<1, false>);
    const GemvCodes out = GemvCodesOf(p, arrivals);
    if (out.codes != nullptr) *coded = true;
    FLASHD_LAUNCH(kernel, static_cast<unsigned>(p.rows * g.tiles), kGemvThreads, g.shared, stream,
                  given ? p.x_row_codes : p.x_codes, given ? p.x_row_scales : p.x_scales, p.in,
                  p.slot_expert, p.slot_offset, p.slots, p.w, p.w_scales, p.out, g.groups, g.tiles,
                  p.y, p.up, p.up_scales, p.row_weights, p.limit, p.round_output,
                  given ? p.x_rows : nullptr, out);
    return gpuGetLastError() == gpuSuccess ? OpStatus::kOk : OpStatus::kDeviceError;
  }
  const auto kernel = Pick<ExpertGemm>(p.format == WeightFormat::kFp8 ? 0 : 1, p.slot_rows == 1);
  FLASHD_LAUNCH(kernel, static_cast<unsigned>(grid), kTileThreads, 0, stream, p.x_codes, p.x_scales,
                p.in, p.slot_expert, p.slot_offset, p.slot_tiles, p.slots, p.w, p.w_scales, p.out,
                p.y);
  const OpStatus s = gpuGetLastError() == gpuSuccess ? OpStatus::kOk : OpStatus::kDeviceError;
  return RoundedAfter(s, !p.round_output, p.y, p.rows * p.out, p.stream);
}

// Linear, with `*rounded` set where the kernel rounded y as p.round_output asks; `quantized` as
// QuantizedLinear's; `*coded` set where a kernel wrote y's codes (the GEMV given `arrivals`),
// `*rotated` where it rotated y as p's rope asks (the GEMV).
OpStatus LinearOnce(const LinearParams& p, bool* rounded, bool quantized = false,
                    bool* coded = nullptr, unsigned* arrivals = nullptr, bool* rotated = nullptr) {
  quantized = quantized || p.x_quantized;
  if (p.rows < 0 || p.in <= 0 || p.out <= 0 || p.x == nullptr || p.y == nullptr) {
    return OpStatus::kBadShape;
  }
  if (p.groups < 1) return OpStatus::kBadShape;
  if (p.groups > 1 && p.format != WeightFormat::kFp8Dense) return OpStatus::kBadArgument;
  if (p.up != nullptr && p.format != WeightFormat::kFp8 && p.format != WeightFormat::kFp4) {
    return OpStatus::kBadArgument;  // The gated pair is of quantized weights.
  }
  if (p.rows == 0) return OpStatus::kOk;
  const gpuStream_t stream = static_cast<gpuStream_t>(p.stream);
  if (p.format == WeightFormat::kDense) {
    if (p.dense == nullptr) return OpStatus::kBadArgument;
    return DenseLinear(p.x, p.rows, p.in, F32Values{p.dense}, p.out, p.y, stream);
  }
  if (p.format == WeightFormat::kBf16) {
    if (p.w == nullptr) return OpStatus::kBadArgument;
    return DenseLinear(p.x, p.rows, p.in, Bf16Values{reinterpret_cast<const uint16_t*>(p.w)}, p.out,
                       p.y, stream);
  }
  if (p.format == WeightFormat::kFp8Dense) {
    if (p.w == nullptr || p.w_scales == nullptr) return OpStatus::kBadArgument;
    if (p.w_row0 < 0 || p.in % kBlock != 0) return OpStatus::kBadShape;
    return Fp8ValuesLinear(p, stream, rounded, coded);
  }
  // Never split over K: on the H200 every split the earlier rule chose (enough parts to give
  // each multiprocessor four thread blocks, at one or two rows) was slower than none, the block
  // sums' round trip and the second kernel costing more than the parts gained (gpu_bench: wq_a
  // 39.9 against 30.8 us, wo_b 69.8 against 51.2; docs/benchmarks.md). LinearSplit keeps the
  // split for measuring, and at split 1 the GEMM tile at one row as well.
  // The gated pair (w1 and w3 under SwiGLU): at one row one GEMV makes both and the SwiGLU, else
  // two products and a Swiglu op.
  const bool gated = p.up != nullptr;
  if (gated && (p.up_scales == nullptr || p.groups != 1)) return OpStatus::kBadArgument;
  if (p.rows == 1) {
    if (const OpStatus s = CheckQuantizedLinear(p, 4); s != OpStatus::kOk) return s;
    const GemvShape g = GemvShapeFor(p.format, p.in, p.out, gated ? 2 : 1);
    if (g.groups > 0 && Aligned(p.x_codes, 16) && (!gated || Aligned(p.up, 16))) {
      *rounded = true;
      return GemvLinear(p, g, quantized, arrivals, coded, rotated);
    }
  }
  if (gated) {
    return GatedApart(  // y's codes after the SwiGLU (Linear).
        p, [](const LinearParams& q) { return Linear(q); },
        [](const SwigluParams& q) { return Swiglu(q); });
  }
  return QuantizedLinear(p, 1, false, quantized);
}

}  // namespace

OpStatus RoundedAfter(OpStatus s, bool rounded, float* y, int64_t n, void* stream) {
  if (s != OpStatus::kOk || rounded || n <= 0) return s;
  return RoundBf16({.x = y, .n = n, .stream = stream});
}

OpStatus RotatedAfter(OpStatus s, bool rotated, const LinearParams& p) {
  if (s != OpStatus::kOk || rotated || p.rope_dim == 0 || p.rows <= 0) return s;
  return Rope(LinearRope(p));
}

namespace {
// y's n values quantized into codes and scales after an op's kernels (CodesAfter).
OpStatus QuantizedAfter(OpStatus s, bool coded, const float* y, int64_t n, uint8_t* codes,
                        uint8_t* scales, void* stream) {
  if (s != OpStatus::kOk || coded || codes == nullptr || n <= 0) return s;
  QuantizeActivations(y, n / kBlock, codes, scales, static_cast<gpuStream_t>(stream));
  return gpuGetLastError() == gpuSuccess ? OpStatus::kOk : OpStatus::kDeviceError;
}
}  // namespace

OpStatus CodesAfter(OpStatus s, bool coded, const LinearParams& p) {
  return QuantizedAfter(s, coded, p.y, p.rows * p.groups * p.out, p.y_codes, p.y_code_scales,
                        p.stream);
}

OpStatus CodesAfter(OpStatus s, bool coded, const ExpertLinearParams& p) {
  return QuantizedAfter(s, coded, p.y, p.rows * p.out, p.y_codes, p.y_code_scales, p.stream);
}

OpStatus Linear(const LinearParams& p, unsigned* arrivals) {
  if (p.round_output && p.up != nullptr) return OpStatus::kBadArgument;
  if (const OpStatus s = LinearAlsoFits(p); s != OpStatus::kOk) return s;
  if (const OpStatus s = LinearCodesFit(p); s != OpStatus::kOk) return s;
  if (const OpStatus s = LinearRopeFits(p); s != OpStatus::kOk) return s;
  bool rotated = p.rope_dim == 0;
  if (p.also_count > 0) {
    // One row: one quantization and one GEMV for all; else an op a projection.
    if (p.rows < 0 || p.in <= 0 || p.out <= 0 || p.x == nullptr || p.y == nullptr) {
      return OpStatus::kBadShape;
    }
    OpStatus status = OpStatus::kOk;
    if (GemvProjectionsLinear(p, &status, &rotated)) return RotatedAfter(status, rotated, p);
    // The projections after the first read its codes; the rotation after them all.
    const bool codes = p.format == WeightFormat::kFp8 || p.format == WeightFormat::kFp4;
    for (int64_t j = -1; j < p.also_count && status == OpStatus::kOk; ++j) {
      LinearParams q = LinearAlone(p, j);
      q.rope_dim = 0;
      bool rounded = !q.round_output;
      status = LinearOnce(q, &rounded, codes && j >= 0);
      status = RoundedAfter(status, rounded, q.y, q.rows * q.out, q.stream);
    }
    return RotatedAfter(status, false, p);
  }
  bool rounded = !p.round_output, coded = p.y_codes == nullptr;
  const int64_t n = p.rows * p.groups * p.out;
  // Before `rounded`, `coded` and `rotated` are read.
  OpStatus s = LinearOnce(p, &rounded, false, &coded, arrivals, &rotated);
  s = RoundedAfter(s, rounded, p.y, n, p.stream);
  s = CodesAfter(s, coded, p);  // y's codes after y as the op leaves it.
  return RotatedAfter(s, rotated, p);
}

namespace {

// LinearFreeOrder's and LinearSplit's checks, then the schedule.
OpStatus SplitLinear(const LinearParams& p, int split, bool free) {
  if (p.rows < 0 || p.in <= 0 || p.out <= 0 || p.x == nullptr || p.y == nullptr) {
    return OpStatus::kBadShape;
  }
  if (split < 1 || p.groups != 1 ||
      (p.format != WeightFormat::kFp8 && p.format != WeightFormat::kFp4)) {
    return OpStatus::kBadArgument;
  }
  if (const OpStatus s = LinearRopeFits(p); s != OpStatus::kOk) return s;
  if (p.rows == 0) return OpStatus::kOk;
  const OpStatus s =
      RoundedAfter(QuantizedLinear(p, split, free), !p.round_output, p.y, p.rows * p.out, p.stream);
  return RotatedAfter(s, false, p);
}

}  // namespace

OpStatus LinearFreeOrder(const LinearParams& p, int split) { return SplitLinear(p, split, true); }

OpStatus LinearSplit(const LinearParams& p, int split) { return SplitLinear(p, split, false); }

}  // namespace flashd::kernels::FLASHD_GPU_BACKEND
