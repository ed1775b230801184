// The quantized GEMMs (FP8 weights with 32 x 32 scale tiles, FP4 with a scale per 32 inputs)
// on matrix cores, for long prompts: LinearMatrix and ExpertLinearMatrix (kernels/gpu/ops.h).
// The activations are quantized to FP8 per 32 as for Linear; FP4 codes become E4M3 codes of
// their values times 2^-6 as they are staged (exact). Each output's sum: per K-block of 32 one
// instruction's sum of the 32 products of codes (mma.h, from zero), times the block's weight and
// activation scales (powers of two: exact), added to the output's running sum in block order by
// a fused multiply-add. That order is the same for every output whatever the shape of its thread
// block or the rows beside it, so results do not depend on the batch; they differ from Linear's
// (the CPU's lanes) by the instruction's rounding of each block's sum.
//
// A thread block takes 128 weight rows (output columns) by 128 tokens (Wide), 64 (Medium) or 8
// (Narrow, few rows), in K-chunks of four blocks staged in shared memory (the next chunk's loads in
// flight while this one is summed); groups of 32 threads each take 16-row by 8-token instructions,
// each thread's operands read by 8-byte loads in an order that the staging's swizzle keeps free of
// bank conflicts. Inside a 32-block the instruction's columns 4t..4t+3 and 16 + 4t.. are the
// staged bytes 8t..8t+7 (for weights and activations alike: the products are the block's).
#include <cstdint>
#include <type_traits>

#include "kernels/codecs.h"
#include "kernels/gpu/device.h"
#include "kernels/gpu/mfma.h"
#include "kernels/gpu/mma.h"
#include "kernels/gpu/ops.h"
#include "kernels/gpu/portability.h"
#include "kernels/gpu/quantized.h"
#include "kernels/gpu/wgmma.h"

namespace flashd::kernels::FLASHD_GPU_BACKEND {
namespace {

namespace c = flashd::kernels::codecs;
constexpr int64_t kBlock = 32;
constexpr int kGroup = 32;                  // Threads of one instruction (mma.h).
constexpr int kInsRows = 16, kInsToks = 8;  // Weight rows and tokens of one instruction.
constexpr int kChunkBlocks = 4;             // K-blocks staged at a time.
constexpr int kRowPieces = kChunkBlocks * kBlock / 16;  // 16-byte pieces of a staged row.
constexpr int kTileRows = 128;
constexpr unsigned kThreads = 256;

// A thread block: kGroupsRows x kGroupsToks groups of 32 threads, each taking kRowTiles x
// kTokTiles instructions a K-block.
template <int kRowTilesT, int kTokTilesT, int kGroupsRowsT>
struct Shape {
  static constexpr int kRowTiles = kRowTilesT, kTokTiles = kTokTilesT, kGroupsRows = kGroupsRowsT;
  static constexpr int kGroupsToks = static_cast<int>(kThreads) / kGroup / kGroupsRows;
  static constexpr int kToks = kInsToks * kTokTiles * kGroupsToks;
  static_assert(kInsRows * kRowTiles * kGroupsRows == kTileRows, "the tile's rows");
  static_assert(kRowTiles == 1 || kRowTiles % 2 == 0, "a group's rows in whole FP8 scale tiles");
};
using Wide = Shape<4, 4, 2>;    // 128 tokens
using Medium = Shape<2, 4, 4>;  // 64 tokens: an expert's rows in a long prompt
using Narrow = Shape<1, 1, 8>;  // 8 tokens
// Linear's matrix path: Narrow tiles up to kNarrowTo rows, Medium up to kMediumTo, else Wide
// (fewer thread blocks, each weight row read fewer times, without tiles mostly empty).
constexpr int64_t kNarrowTo = 16, kMediumTo = 64;
static_assert(Narrow::kToks == kExpertTileRows, "an expert slot's tiles are Narrow's tokens");
static_assert(Medium::kToks % kExpertTileRows == 0, "Medium's tokens are whole slot tiles");

// The staged rows' swizzle: the 16-byte piece p of row r is kept at p ^ (2 (r % 4)), so the
// 8-byte reads of one instruction's operands (rows g = 0..7, bytes 8t.. of one K-block) fall in
// 32 different banks for each half of a group.
__device__ inline int Swizzled(int piece, int64_t row) {
  return piece ^ static_cast<int>(2 * (row % 4));
}

// AMD's instruction (mfma.h) in the same tiles: wave w (64 threads) takes weight rows
// 32w .. 32w + 31 of the tile by its tokens in 32s (Narrow's 8 padded with zeros), each lane one
// weight row's 16 outputs of a 32-token tile; a K-block's operands are one staged 16-byte piece
// of a weight row and of a token's row a lane.
static_assert(kThreads / kMfmaLanes * 32 == kTileRows, "a wave's 32 rows of the tile");
template <class S>
constexpr int kMfmaTokTiles = (S::kToks + 31) / 32;

#if defined(FLASHD_MMA_E4M3_NATIVE)
constexpr bool kMmaNative = true;
#else
constexpr bool kMmaNative = false;
#endif
#if defined(FLASHD_MFMA_NATIVE)
constexpr bool kMfmaNative = true;
#else
constexpr bool kMfmaNative = false;
#endif

// y[m0 + i, n0 + j] for i < rows (tokens), j < min(128, N - n0), over all of K, by kIns (kMma or
// kMfma); rounded to BF16 as written where `round`.
template <int kFormat, class S, MatrixInstruction kIns>
FLASHD_SHARED_TILE __device__ void MatrixTile(const uint8_t* xq, const uint8_t* xs, int64_t m0,
                                              int64_t rows, int64_t K, const uint8_t* w,
                                              const uint8_t* ws, int64_t N, int64_t n0, float* y,
                                              bool round) {
  constexpr bool kMfma = kIns == MatrixInstruction::kMfma;
  using Scratch = std::conditional_t<kMfma, MfmaScratch, MmaScratch>;
  __shared__ uint4 a_s[kTileRows][kRowPieces];
  __shared__ uint4 b_s[S::kToks][kRowPieces];
  __shared__ float a_scale[kTileRows][kChunkBlocks];
  __shared__ float b_scale[S::kToks][kChunkBlocks];
  // The stand-in's (one unused entry where the device has the instruction).
  __shared__ Scratch scratch[(kMfma ? kMfmaNative : kMmaNative) ? 1 : kThreads];
  constexpr int kAPieces = kFormat == 0 ? kTileRows * kRowPieces : kTileRows * kChunkBlocks;
  constexpr int kALoads = kAPieces / static_cast<int>(kThreads);
  constexpr int kBPieces = S::kToks * kRowPieces;
  constexpr int kBLoads = (kBPieces + static_cast<int>(kThreads) - 1) / static_cast<int>(kThreads);
  static_assert(kALoads * static_cast<int>(kThreads) == kAPieces, "whole loads a thread");
  const int64_t blocks = K / kBlock;
  const unsigned t = threadIdx.x, lane = t % kGroup, g = lane / 4, q = lane % 4;
  const int group_rows = static_cast<int>(t / kGroup) % S::kGroupsRows;
  const int group_toks = static_cast<int>(t / kGroup) / S::kGroupsRows;
  const uint4 zero{0, 0, 0, 0};

  uint4 ra[kALoads], rb[kBLoads];
  // The chunk's codes from global memory into registers (zeros past the ends).
  auto load = [&](int64_t c0, int64_t nb) {
    FLASHD_UNROLL
    for (int j = 0; j < kALoads; ++j) {
      const int i = static_cast<int>(t) + j * static_cast<int>(kThreads);
      if (kFormat == 0) {
        const int64_t r = i / kRowPieces, piece = i % kRowPieces;
        ra[j] = piece < 2 * nb && n0 + r < N
                    ? *reinterpret_cast<const uint4*>(w + (n0 + r) * K + c0 * kBlock + piece * 16)
                    : zero;
      } else {
        const int64_t r = i / kChunkBlocks, blk = i % kChunkBlocks;
        ra[j] = blk < nb && n0 + r < N ? *reinterpret_cast<const uint4*>(w + (n0 + r) * (K / 2) +
                                                                         (c0 + blk) * (kBlock / 2))
                                       : zero;
      }
    }
    FLASHD_UNROLL
    for (int j = 0; j < kBLoads; ++j) {
      const int i = static_cast<int>(t) + j * static_cast<int>(kThreads);
      const int64_t tok = i / kRowPieces, piece = i % kRowPieces;
      if (i < kBPieces) {
        rb[j] =
            piece < 2 * nb && tok < rows
                ? *reinterpret_cast<const uint4*>(xq + (m0 + tok) * K + c0 * kBlock + piece * 16)
                : zero;
      }
    }
  };
  // The registers into shared memory (FP4 widened to E4M3 here), with the chunk's scales.
  auto store = [&](int64_t c0, int64_t nb) {
    FLASHD_UNROLL
    for (int j = 0; j < kALoads; ++j) {
      const int i = static_cast<int>(t) + j * static_cast<int>(kThreads);
      if (kFormat == 0) {
        const int64_t r = i / kRowPieces;
        a_s[r][Swizzled(i % kRowPieces, r)] = ra[j];
      } else {
        const int64_t r = i / kChunkBlocks;
        const int blk = i % kChunkBlocks;
        const uint4 v = ra[j];
        a_s[r][Swizzled(2 * blk, r)] = uint4{E2M1x4ToE4M3(v.x), E2M1x4ToE4M3(v.x >> 16),
                                             E2M1x4ToE4M3(v.y), E2M1x4ToE4M3(v.y >> 16)};
        a_s[r][Swizzled(2 * blk + 1, r)] = uint4{E2M1x4ToE4M3(v.z), E2M1x4ToE4M3(v.z >> 16),
                                                 E2M1x4ToE4M3(v.w), E2M1x4ToE4M3(v.w >> 16)};
      }
    }
    FLASHD_UNROLL
    for (int j = 0; j < kBLoads; ++j) {
      const int i = static_cast<int>(t) + j * static_cast<int>(kThreads);
      if (i < kBPieces) {
        const int64_t tok = i / kRowPieces;
        b_s[tok][Swizzled(i % kRowPieces, tok)] = rb[j];
      }
    }
    for (int i = static_cast<int>(t); i < kTileRows * kChunkBlocks; i += kThreads) {
      const int64_t r = i / kChunkBlocks, blk = i % kChunkBlocks, n = n0 + r;
      float s = 0.0f;
      if (blk < nb && n < N) {
        s = kFormat == 0 ? c::E8M0ToFloat(ws[(n / kBlock) * blocks + c0 + blk])
                         : c::E8M0ToFloat(ws[n * blocks + c0 + blk]) * 0x1p6f;
      }
      a_scale[r][blk] = s;
    }
    for (int i = static_cast<int>(t); i < S::kToks * kChunkBlocks; i += kThreads) {
      const int64_t tok = i / kChunkBlocks, blk = i % kChunkBlocks;
      b_scale[tok][blk] =
          blk < nb && tok < rows ? c::E8M0ToFloat(xs[(m0 + tok) * blocks + c0 + blk]) : 0.0f;
    }
  };

  // mma: [row tile][token tile][output]; mfma: [0][token tile][output].
  constexpr int kAccRows = kMfma ? 1 : S::kRowTiles;
  constexpr int kAccToks = kMfma ? kMfmaTokTiles<S> : S::kTokTiles, kAccOut = kMfma ? 16 : 4;
  float acc[kAccRows][kAccToks][kAccOut];
  FLASHD_UNROLL
  for (int i = 0; i < kAccRows; ++i) {
    FLASHD_UNROLL
    for (int j = 0; j < kAccToks; ++j) {
      FLASHD_UNROLL
      for (int e = 0; e < kAccOut; ++e) acc[i][j][e] = 0.0f;
    }
  }
  // mfma: this lane's weight row of the tile and half of a block's codes.
  const int mf_row = static_cast<int>(t / kMfmaLanes) * 32 + static_cast<int>(t % 32);
  const int mf_half = static_cast<int>(t % kMfmaLanes) / 32;
  // Token of output v of mfma token tile j.
  auto mf_tok = [&](int j, int v) { return 32 * j + 8 * (v / 4) + 4 * mf_half + v % 4; };
  const int row_base = group_rows * kInsRows * S::kRowTiles;
  const int tok_base = group_toks * kInsToks * S::kTokTiles;
  if (blocks > 0) load(0, blocks < kChunkBlocks ? blocks : kChunkBlocks);
  for (int64_t c0 = 0; c0 < blocks; c0 += kChunkBlocks) {
    const int64_t nb = blocks - c0 < kChunkBlocks ? blocks - c0 : kChunkBlocks;
    __syncthreads();  // The previous chunk's reads are done.
    store(c0, nb);
    __syncthreads();
    const int64_t next = c0 + kChunkBlocks;
    if (next < blocks) load(next, blocks - next < kChunkBlocks ? blocks - next : kChunkBlocks);
    if constexpr (kMfma) {
      for (int kb = 0; kb < nb; ++kb) {
        const int piece = 2 * kb + mf_half;
        const uint4 wv = a_s[mf_row][Swizzled(piece, mf_row)];
        // The product's scaling by the instruction's codes undone in the weight's scale (exact).
        const float w_scale = a_scale[mf_row][kb] * kMfmaProductScale;
        FLASHD_UNROLL
        for (int j = 0; j < kMfmaTokTiles<S>; ++j) {
          const int tok = 32 * j + static_cast<int>(t % 32);
          const uint4 xv = tok < S::kToks ? b_s[tok][Swizzled(piece, tok)] : zero;
          float d[16];
          FLASHD_UNROLL
          for (int v = 0; v < 16; ++v) d[v] = 0.0f;
          MfmaE4M3Block(xv, wv, d, scratch);
          FLASHD_UNROLL
          for (int v = 0; v < 16; ++v) {
            const int tv = mf_tok(j, v);
            const float scale = w_scale * (tv < S::kToks ? b_scale[tv][kb] : 0.0f);
            acc[0][j][v] = FLASHD_EXACT_FMA(d[v], scale, acc[0][j][v]);
          }
        }
      }
    } else {
      for (int kb = 0; kb < nb; ++kb) {
        const int chunk8 = kb * 4 + static_cast<int>(q);  // This thread's 8 bytes of the block.
        uint32_t af[S::kRowTiles][4];
        float as[S::kRowTiles][2];
        FLASHD_UNROLL
        for (int i = 0; i < S::kRowTiles; ++i) {
          const int r = row_base + i * kInsRows + static_cast<int>(g);
          const uint2 lo = reinterpret_cast<const uint2*>(a_s[r])[chunk8 ^ 4 * (r % 4)];
          const uint2 hi = reinterpret_cast<const uint2*>(a_s[r + 8])[chunk8 ^ 4 * (r % 4)];
          af[i][0] = lo.x, af[i][1] = hi.x, af[i][2] = lo.y, af[i][3] = hi.y;
          as[i][0] = a_scale[r][kb], as[i][1] = a_scale[r + 8][kb];
        }
        uint32_t bf[S::kTokTiles][2];
        float bs[S::kTokTiles][2];
        FLASHD_UNROLL
        for (int j = 0; j < S::kTokTiles; ++j) {
          const int tok = tok_base + j * kInsToks + static_cast<int>(g);
          const uint2 v = reinterpret_cast<const uint2*>(b_s[tok])[chunk8 ^ 4 * (tok % 4)];
          bf[j][0] = v.x, bf[j][1] = v.y;
          const int tok2 = tok_base + j * kInsToks + 2 * static_cast<int>(q);
          bs[j][0] = b_scale[tok2][kb], bs[j][1] = b_scale[tok2 + 1][kb];
        }
        // The products of weight and activation scales, before the instructions. FP8 weights have
        // one scale a 32-row tile (the rows of instructions 2h and 2h + 1, whose first row is a
        // multiple of 32 from the tile's start), so one product serves both instructions' rows
        // (a quarter of the multiplies); FP4 weights have one a row.
        constexpr int kScaleRows = kFormat == 0 ? (S::kRowTiles + 1) / 2 : S::kRowTiles;
        float ps[kScaleRows][2][S::kTokTiles][2];
        FLASHD_UNROLL
        for (int i = 0; i < kScaleRows; ++i) {
          FLASHD_UNROLL
          for (int h = 0; h < 2; ++h) {
            const float a = kFormat == 0 ? as[2 * i][0] : as[i][h];
            FLASHD_UNROLL
            for (int j = 0; j < S::kTokTiles; ++j) {
              ps[i][h][j][0] = a * bs[j][0], ps[i][h][j][1] = a * bs[j][1];
            }
          }
        }
        FLASHD_UNROLL
        for (int i = 0; i < S::kRowTiles; ++i) {
          FLASHD_UNROLL
          for (int j = 0; j < S::kTokTiles; ++j) {
            float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            MmaE4M3(af[i], bf[j], d, scratch);
            FLASHD_UNROLL
            for (int e = 0; e < 4; ++e) {
              const float scale = kFormat == 0 ? ps[i / 2][0][j][e % 2] : ps[i][e / 2][j][e % 2];
              acc[i][j][e] = FLASHD_EXACT_FMA(d[e], scale, acc[i][j][e]);
            }
          }
        }
      }
    }
  }
  if constexpr (kMfma) {
    FLASHD_UNROLL
    for (int j = 0; j < kAccToks; ++j) {
      FLASHD_UNROLL
      for (int v = 0; v < 16; ++v) {
        const int64_t n = n0 + mf_row, tok = mf_tok(j, v);
        if (n < N && tok < rows) {
          y[(m0 + tok) * N + n] = round ? c::RoundBf16(acc[0][j][v]) : acc[0][j][v];
        }
      }
    }
  } else {
    FLASHD_UNROLL
    for (int i = 0; i < S::kRowTiles; ++i) {
      FLASHD_UNROLL
      for (int j = 0; j < S::kTokTiles; ++j) {
        FLASHD_UNROLL
        for (int e = 0; e < 4; ++e) {
          const int64_t n = n0 + row_base + i * kInsRows + g + 8 * (e / 2);
          const int64_t tok = tok_base + j * kInsToks + 2 * q + e % 2;
          if (n < N && tok < rows) {
            y[(m0 + tok) * N + n] = round ? c::RoundBf16(acc[i][j][e]) : acc[i][j][e];
          }
        }
      }
    }
  }
}

FLASHD_OPS_HD inline int64_t RowTiles(int64_t N) { return (N + kTileRows - 1) / kTileRows; }

template <int kFormat, class S, MatrixInstruction kIns>
__global__ void __launch_bounds__(kThreads)
    MatrixGemmKernel(const uint8_t* xq, const uint8_t* xs, int64_t M, int64_t K, const uint8_t* w,
                     const uint8_t* ws, int64_t N, float* y, bool round) {
  FLASHD_GRID_BEGIN();
  const int64_t n0 = (blockIdx.x % RowTiles(N)) * kTileRows;
  const int64_t m0 = (blockIdx.x / RowTiles(N)) * S::kToks;
  MatrixTile<kFormat, S, kIns>(xq, xs, m0, M - m0 < S::kToks ? M - m0 : S::kToks, K, w, ws, N, n0,
                               y, round);
}

// The experts' rows (MoeGroup's slots) in tiles of S's tokens: thread block (tile, row tile),
// the tiles of kExpertTileRows counted through slot_tiles (ExpertGemmKernel's mapping,
// kernels/gpu/linear.cu). With S wider than a slot tile, the thread block of a slot's first tile
// of every S::kToks rows takes them all and the others have nothing to do (a thread block that
// returns at once; the grid needs no count of the wider tiles, which only the device knows).
template <int kFormat, class S, MatrixInstruction kIns>
__global__ void __launch_bounds__(kThreads)
    MatrixExpertKernel(const uint8_t* xq, const uint8_t* xs, int64_t K, const int64_t* slot_expert,
                       const int64_t* slot_offset, const int64_t* slot_tiles, int64_t slots,
                       const uint8_t* const* w, const uint8_t* const* ws, int64_t N, float* y) {
  FLASHD_GRID_BEGIN();
  int64_t m0 = 0, rows = 0, e = 0;
  if (!ExpertTileOf(S::kToks, blockIdx.x / RowTiles(N), slot_expert, slot_offset, slot_tiles, slots,
                    &m0, &rows, &e)) {
    return;  // The whole thread block: no barrier is left waiting.
  }
  MatrixTile<kFormat, S, kIns>(xq, xs, m0, rows, K, w[e], ws[e], N,
                               (blockIdx.x % RowTiles(N)) * kTileRows, y, false);
}

// ---- The warpgroup instruction (wgmma.h) ------------------------------------------------------
// The same sums (per K-block one instruction's sum of the 32 products from zero, times the
// block's weight and activation scales, added to the running sum by a fused multiply-add, blocks
// in order) with Hopper's warpgroup instruction, which reads both operands from shared memory:
// a thread block of two warpgroups takes 128 weight rows (64 each) by kToks tokens (8, 64 or
// 128: one instruction a K-block and warpgroup), K four blocks a chunk through a ring of
// kWgStages chunks that cp.async fills while earlier chunks are summed. FP4 codes are copied
// as they are stored and widened to E4M3 in shared memory before their chunk's instructions.
// Each warpgroup issues block kb + 1's instruction before it adds block kb's outputs, so the
// matrix unit and the adds overlap.
//
// FP4 weights have a scale a row and K-block, so each output's block would take a multiply of
// the two scales besides its fused multiply-add. Where a warpgroup's 64 rows' scale codes of a
// K-block lie within kFp4MaxShift of their least (the anchor), each row's codes are widened
// times 2^(its code - the anchor) instead (E2M1x4ToE4M3Shifted: exact), so the instruction's sum
// of a row's block is the unfolded sum times that power of two, rounded alike (each product is
// scaled the same); the block's sums then take the anchor's scale times the token's, one product
// a (warpgroup, block, token), as FP8's tiles do. Where a chunk's four blocks all fold, its
// warpgroup adds that way; else (a NaN scale, codes further apart) the two scales are multiplied
// for each output, as before. The same value either way wherever the scales' products are normal
// floats, so which way a chunk goes, a property of the weights alone, changes no bits.
constexpr unsigned kWgThreads = 2 * kWgmmaThreads;
constexpr int kWgStages = 4;
// An FP4 row's 64 staged bytes a chunk, padded to 80: the widening's 8-byte reads of eight
// neighbouring rows fall in different banks.
constexpr int kRawStride = 80;
static_assert(kChunkBlocks * kBlock == kWgmmaChunkBytes, "a chunk is a staged row group's K");

// One stage of the ring, in bytes: weight codes as E4M3 (staged), FP4's raw codes, the tokens'
// codes (staged), then floats. FP8: the products of weight and token scales, [32-row tile][block]
// [token] (a tile's rows share a scale, so the products are few and each output's block takes
// one from shared memory, no multiply); FP4: the rows' scales ([row][block]), the tokens'
// ([block][token]), then what the fold below takes.
template <int kFormat, int kToks>
struct WgStage {
  static constexpr int kA = kTileRows * kWgmmaChunkBytes;
  static constexpr int kRaw = kFormat == 1 ? kTileRows * kRawStride : 0;
  static constexpr int kB = kToks * kWgmmaChunkBytes;
  static constexpr int kAScales = kFormat == 0 ? 0 : kTileRows * kChunkBlocks;
  static constexpr int kScales =
      kFormat == 0 ? kTileRows / kBlock * kChunkBlocks * kToks : kAScales + kChunkBlocks * kToks;
  // FP4's fold (WgmmaTile): the folded products, the anchors' scales and codes, a first and a
  // second round of the anchors' partial sums (ints), and the rows' codes (bytes).
  static constexpr int kProducts = kFormat == 1 ? 2 * kChunkBlocks * kToks : 0;
  static constexpr int kAnchors = kFormat == 1 ? 2 * kChunkBlocks : 0;
  static constexpr int kPartials = kFormat == 1 ? static_cast<int>(kWgThreads) : 0;
  static constexpr int kPartials2 = kPartials / 4;
  static constexpr int kCodes = kFormat == 1 ? kTileRows * kChunkBlocks : 0;
  static constexpr int kBytes =
      kA + kRaw + kB + 4 * (kScales + kProducts + 2 * kAnchors + kPartials + kPartials2) + kCodes;
  static constexpr int kScaleLoads = (kScales + kWgThreads - 1) / kWgThreads;
  static_assert(kToks % 8 == 0 && kBytes % 16 == 0, "whole row groups, aligned stages");
  // FP4: load j < 2 of thread t is row (t / 128) * 64 + t % 32 + 32 j, block (t / 32) % 4, so
  // each 32 threads hold one warpgroup's 64 rows of one block.
  static_assert(kFormat == 0 || (kAScales == 2 * static_cast<int>(kWgThreads) &&
                                 kWgThreads == 2 * 32 * kChunkBlocks && kTileRows == 128),
                "FP4 rows' scale loads: one (warpgroup, block) each 32 threads");
};
template <int kFormat, int kToks>
constexpr int kWgSharedBytes = kWgStages* WgStage<kFormat, kToks>::kBytes;
static_assert(kWgSharedBytes<1, 128> <= 227 * 1024, "the widest ring in an H100/H200 block");

// FP4: the row and the block of a thread's row scale load j (< 2), as WgStage lays them out:
// threads 32g..32g + 31 hold group g's rows, warpgroup g / 4 and block g % 4.
FLASHD_OPS_HD inline int FoldBlock(int t) { return (t / 32) % kChunkBlocks; }
FLASHD_OPS_HD inline int FoldRow(int t, int j) { return (t / 128) * 64 + t % 32 + 32 * j; }

// y[m0 + i, n0 + j] for i < rows (tokens), j < min(128, N - n0), over all of K (rounded to BF16
// as written where `round`); `smem` holds kWgSharedBytes.
template <int kFormat, int kToks>
__device__ void WgmmaTile(const uint8_t* xq, const uint8_t* xs, int64_t m0, int64_t rows, int64_t K,
                          const uint8_t* w, const uint8_t* ws, int64_t N, int64_t n0, float* y,
                          uint8_t* smem, bool round) {
  using St = WgStage<kFormat, kToks>;
  constexpr int kH = kToks / 2;  // Outputs a thread.
  const int64_t blocks = K / kBlock, chunks = (blocks + kChunkBlocks - 1) / kChunkBlocks;
  const int t = static_cast<int>(threadIdx.x);
  auto stage = [&](int64_t c) { return smem + (c % kWgStages) * St::kBytes; };
  auto floats = [&](int64_t c) {
    return reinterpret_cast<float*>(stage(c) + St::kA + St::kRaw + St::kB);
  };
  // FP4: the stage's folded products ([warpgroup][block][token]), the anchors' scales times
  // 2^5 and codes ([warpgroup][block]; code -1 where the group does not fold), the partial least
  // and largest codes, and the rows' codes ([row][block]; 255 for none).
  auto products_of = [&](int64_t c) { return floats(c) + St::kScales; };
  auto anchors_of = [&](int64_t c) { return products_of(c) + St::kProducts; };
  auto anchor_codes_of = [&](int64_t c) {
    return reinterpret_cast<int32_t*>(anchors_of(c) + St::kAnchors);
  };
  auto partials_of = [&](int64_t c) { return anchor_codes_of(c) + St::kAnchors; };
  auto codes_of = [&](int64_t c) {
    return reinterpret_cast<uint8_t*>(partials_of(c) + St::kPartials + St::kPartials2);
  };
  // FP4: whether warpgroup `wg`'s rows fold in chunk c, all four of its blocks (its adds take
  // one way for a whole chunk).
  auto warpgroup_folds = [&](int64_t c, int wg) {
    const int4 a = reinterpret_cast<const int4*>(anchor_codes_of(c))[wg];
    return a.x >= 0 && a.y >= 0 && a.z >= 0 && a.w >= 0;
  };

  // Chunk c's codes copied into its stage (rows past N, tokens past `rows` and blocks past K as
  // zeros), as one group of this thread's copies, in WgmmaPiece's order.
  auto copy = [&](int64_t c) {
    uint8_t* s = stage(c);
    const int64_t b0 = c * kChunkBlocks;
    if constexpr (kFormat == 0) {
      FLASHD_UNROLL
      for (int j = 0; j < kTileRows * 8 / static_cast<int>(kWgThreads); ++j) {
        const int i = t + j * static_cast<int>(kWgThreads);
        const int r = WgmmaPieceRow(i), piece = WgmmaPiece(i);
        const bool ok = n0 + r < N && b0 + piece / 2 < blocks;
        CopyAsync16(s + WgmmaStaged(r, 16 * piece),
                    ok ? w + (n0 + r) * K + b0 * kBlock + piece * 16 : w, ok);
      }
    } else {
      FLASHD_UNROLL
      for (int j = 0; j < kTileRows * 4 / static_cast<int>(kWgThreads); ++j) {
        const int i = t + j * static_cast<int>(kWgThreads);
        const int r = i / 4, blk = i % 4;
        const bool ok = n0 + r < N && b0 + blk < blocks;
        CopyAsync16(s + St::kA + r * kRawStride + blk * 16,
                    ok ? w + (n0 + r) * (K / 2) + (b0 + blk) * (kBlock / 2) : w, ok);
      }
    }
    for (int i = t; i < kToks * 8; i += static_cast<int>(kWgThreads)) {
      const int tok = WgmmaPieceRow(i), piece = WgmmaPiece(i);
      const bool ok = tok < rows && b0 + piece / 2 < blocks;
      CopyAsync16(s + St::kA + St::kRaw + WgmmaStaged(tok, 16 * piece),
                  ok ? xq + (m0 + tok) * K + b0 * kBlock + piece * 16 : xq, ok);
    }
    CopyAsyncCommit();
  };
  // Chunk c's scale codes into registers (-1: none, a zero scale; FP8: the weight's code, the
  // token's above it), and later as floats into its stage, so that their loads are in flight
  // while a chunk is summed.
  int32_t scale_codes[St::kScaleLoads];
  auto load_scales = [&](int64_t c) {
    const int64_t b0 = c * kChunkBlocks;
    FLASHD_UNROLL
    for (int j = 0; j < St::kScaleLoads; ++j) {
      const int e = t + j * static_cast<int>(kWgThreads);
      int32_t code = -1;
      if (kFormat == 0) {
        const int64_t tok = e % kToks, blk = b0 + (e / kToks) % kChunkBlocks;
        const int64_t tile = e / (kToks * kChunkBlocks);
        if (e < St::kScales && n0 + tile * kBlock < N && tok < rows && blk < blocks) {
          code = ws[(n0 / kBlock + tile) * blocks + blk] | xs[(m0 + tok) * blocks + blk] << 8;
        }
      } else if (e < St::kAScales) {
        const int64_t blk = b0 + FoldBlock(t), r = FoldRow(t, j);
        if (n0 + r < N && blk < blocks) code = ws[(n0 + r) * blocks + blk];
      } else if (e < St::kScales) {
        const int64_t blk = b0 + (e - St::kAScales) / kToks, tok = (e - St::kAScales) % kToks;
        if (tok < rows && blk < blocks) code = xs[(m0 + tok) * blocks + blk];
      }
      scale_codes[j] = code;
    }
  };
  auto store_scales = [&](int64_t c) {
    float* scales = floats(c);
    FLASHD_UNROLL
    for (int j = 0; j < St::kScaleLoads; ++j) {
      const int e = t + j * static_cast<int>(kWgThreads);
      if (e >= St::kScales) continue;
      const int32_t code = scale_codes[j];
      float v = code < 0 ? 0.0f : c::E8M0ToFloat(static_cast<uint8_t>(code));
      if (kFormat == 0 && code >= 0) v *= c::E8M0ToFloat(static_cast<uint8_t>(code >> 8));
      if (kFormat == 1 && e < St::kAScales) {
        v *= 0x1p5f;  // The widened codes' 2^-5.
        scales[FoldRow(t, j) * kChunkBlocks + FoldBlock(t)] = v;
      } else {
        scales[e] = v;
      }
    }
    if constexpr (kFormat == 1) {
      // The rows' codes for widen, and this thread's least and largest (+ 1) of them, packed,
      // for the anchors (fold_partials, fold_anchors). Codes -1 (rows past N, blocks past K,
      // whose codes are zeros) take no part.
      uint8_t* codes = codes_of(c);
      int32_t least = 256, most = 0;
      FLASHD_UNROLL
      for (int j = 0; j < 2; ++j) {
        const int32_t code = scale_codes[j];
        codes[FoldRow(t, j) * kChunkBlocks + FoldBlock(t)] =
            static_cast<uint8_t>(code < 0 ? 255 : code);
        if (code >= 0) {
          least = code < least ? code : least;
          most = code + 1 > most ? code + 1 : most;
        }
      }
      partials_of(c)[t] = least | most << 16;
    }
  };
  // FP4: the least and largest codes of each (warpgroup, block), in two rounds a barrier apart
  // (each after store_scales has stored the chunk and everyone has passed a barrier): the first
  // combines each group's 32 partials four at a time (64 threads), the second the eight that
  // gives (8 threads, one a group). A group folds where its largest code is no NaN (255) and
  // within kFp4MaxShift of its least, the anchor; a group of no rows folds trivially.
  auto combine = [](int32_t a, int32_t b) {
    const int32_t least = (a & 0xFFFF) < (b & 0xFFFF) ? (a & 0xFFFF) : (b & 0xFFFF);
    const int32_t most = (a >> 16) > (b >> 16) ? (a >> 16) : (b >> 16);
    return least | most << 16;
  };
  auto fold_partials = [&](int64_t c) {
    if (t >= St::kPartials2) return;
    const int4 v = *reinterpret_cast<const int4*>(partials_of(c) + 4 * t);
    partials_of(c)[St::kPartials + t] = combine(combine(v.x, v.y), combine(v.z, v.w));
  };
  auto fold_anchors = [&](int64_t c) {
    if (t >= St::kAnchors) return;
    const int4* p = reinterpret_cast<const int4*>(partials_of(c) + St::kPartials + 8 * t);
    const int4 a = p[0], b = p[1];
    const int32_t v = combine(combine(combine(a.x, a.y), combine(a.z, a.w)),
                              combine(combine(b.x, b.y), combine(b.z, b.w)));
    const int32_t least = v & 0xFFFF, largest = (v >> 16) - 1;
    const bool none = largest < 0;
    const bool folds =
        none || (largest < 255 && largest - least <= static_cast<int32_t>(kFp4MaxShift));
    const int32_t anchor = none ? 127 : least;
    anchor_codes_of(c)[t] = folds ? anchor : -1;
    anchors_of(c)[t] = c::E8M0ToFloat(static_cast<uint8_t>(anchor)) * 0x1p5f;
  };
  // FP4: chunk c's raw codes widened into the staged layout, a thread per (row, 16 K-bytes),
  // each row's block shifted by its code less the anchor where its warpgroup folds; then the
  // folded products.
  auto widen = [&](int64_t c) {
    uint8_t* s = stage(c);
    const uint8_t* codes = codes_of(c);
    // Each thread's pieces are of one block and rows of both warpgroups; a warpgroup's rows are
    // shifted where it folds.
    static_assert(kWgThreads % 64 == 0, "WgmmaPiece(t + j * kWgThreads) is WgmmaPiece(t)");
    const int kb = WgmmaPiece(t) / 2;
    const bool folds0 = warpgroup_folds(c, 0), folds1 = warpgroup_folds(c, 1);
    FLASHD_UNROLL
    for (int j = 0; j < kTileRows * 8 / static_cast<int>(kWgThreads); ++j) {
      const int i = t + j * static_cast<int>(kWgThreads);
      const int r = WgmmaPieceRow(i), piece = WgmmaPiece(i);
      const int32_t code = codes[r * kChunkBlocks + kb];
      const int32_t anchor = anchor_codes_of(c)[(r < 64 ? 0 : kChunkBlocks) + kb];
      const uint32_t shift =
          (r < 64 ? folds0 : folds1) && code != 255 ? static_cast<uint32_t>(code - anchor) : 0;
      const uint2 v = *reinterpret_cast<const uint2*>(s + St::kA + r * kRawStride + 8 * piece);
      *reinterpret_cast<uint4*>(s + WgmmaStaged(r, 16 * piece)) =
          uint4{E2M1x4ToE4M3Shifted(v.x, shift), E2M1x4ToE4M3Shifted(v.x >> 16, shift),
                E2M1x4ToE4M3Shifted(v.y, shift), E2M1x4ToE4M3Shifted(v.y >> 16, shift)};
    }
    const float* tokens = floats(c) + St::kAScales;
    const float* anchors = anchors_of(c);
    float* products = products_of(c);
    FLASHD_UNROLL
    for (int j = 0; j < (St::kProducts + kWgThreads - 1) / static_cast<int>(kWgThreads); ++j) {
      // [warpgroup][block][token]; unfolded blocks' products are not read. (Unsigned: the
      // divisions are shifts.)
      const unsigned e = threadIdx.x % kWgThreads + static_cast<unsigned>(j) * kWgThreads;
      if (St::kProducts % kWgThreads == 0 || e < St::kProducts) {
        products[e] = anchors[e / kToks] * tokens[e % (kChunkBlocks * kToks)];
      }
    }
  };

  const int wg = t / kWgmmaThreads, lane = t % 32, q = lane % 4;
  const int r0 = wg * 64 + ((t % kWgmmaThreads) / 32) * 16 + lane / 4;  // And r0 + 8.
  float acc[kH], d0[kH], d1[kH];
  FLASHD_UNROLL
  for (int i = 0; i < kH; ++i) acc[i] = d0[i] = d1[i] = 0.0f;

  for (int64_t c = 0; c < kWgStages - 1; ++c) {
    if (c < chunks) {
      copy(c);
      load_scales(c);
      store_scales(c);
    } else {
      CopyAsyncCommit();  // Empty, so that each wait below counts chunks.
    }
  }
  // FP4: the anchors of chunk k are found two iterations ahead of its widening (its two rounds
  // after the barriers of iteration k - 2), those of chunks 0 and 1 here.
  if constexpr (kFormat == 1) {
    __syncthreads();
    for (int64_t c = 0; c < 2 && c < chunks; ++c) fold_partials(c);
    __syncthreads();
    for (int64_t c = 0; c < 2 && c < chunks; ++c) fold_anchors(c);
  }
  for (int64_t c = 0; c < chunks; ++c) {
    CopyAsyncWait<kWgStages - 2>();  // This thread's copies of chunk c are in.
    if constexpr (kFormat == 1) {
      __syncthreads();
      if (c + 2 < chunks) fold_partials(c + 2);
      widen(c);
    }
    WgmmaSharedFence();
    __syncthreads();  // Everyone's are in, and chunk c - 1's stage is no longer read.
    if constexpr (kFormat == 1) {
      if (c + 2 < chunks) fold_anchors(c + 2);
    }
    const int64_t ahead = c + kWgStages - 1;
    if (ahead < chunks) {
      copy(ahead);
      load_scales(ahead);
    } else {
      CopyAsyncCommit();
    }

    const uint8_t* s = stage(c);
    const uint8_t* a = s + wg * 8 * kWgmmaGroupBytes;  // This warpgroup's 64 rows.
    const uint8_t* b = s + St::kA + St::kRaw;
    const float* a_scales = floats(c);
    const float* b_scales = a_scales + St::kAScales;
    // A block's products of scales, [block][token]: FP8's for rows r0 and r0 + 8 (which share a
    // 32-row tile), FP4's folded ones for this warpgroup.
    const float* products = kFormat == 0 ? a_scales + (r0 / kBlock) * kChunkBlocks * kToks
                                         : products_of(c) + wg * kChunkBlocks * kToks;
    // FP4: whether this warpgroup's rows fold in chunk c.
    bool folded = true;
    if constexpr (kFormat == 1) folded = warpgroup_folds(c, wg);
    const int64_t nb =
        blocks - c * kChunkBlocks < kChunkBlocks ? blocks - c * kChunkBlocks : kChunkBlocks;
    auto issue = [&](int kb, float(&d)[kH]) {
      WgmmaFence();
      WgmmaE4M3<kToks>(a + 2 * kb * kWgmmaPieceBytes, b + 2 * kb * kWgmmaPieceBytes, d);
      WgmmaCommit();
    };
    // Block kb's sums (in d) added to the outputs' chains, one product of scales a (block,
    // token).
    auto add_products = [&](int kb, float(&d)[kH]) {
      WgmmaDone(d);
      FLASHD_UNROLL
      for (int j = 0; j < kToks / 8; ++j) {
        const float2 p = *reinterpret_cast<const float2*>(products + kb * kToks + 8 * j + 2 * q);
        acc[4 * j + 0] = FLASHD_EXACT_FMA(d[4 * j + 0], p.x, acc[4 * j + 0]);
        acc[4 * j + 1] = FLASHD_EXACT_FMA(d[4 * j + 1], p.y, acc[4 * j + 1]);
        acc[4 * j + 2] = FLASHD_EXACT_FMA(d[4 * j + 2], p.x, acc[4 * j + 2]);
        acc[4 * j + 3] = FLASHD_EXACT_FMA(d[4 * j + 3], p.y, acc[4 * j + 3]);
      }
    };
    // FP4 unfolded: the row's scale times the token's, a multiply an output.
    auto add_rows = [&](int kb, float(&d)[kH]) {
      WgmmaDone(d);
      const float w0 = a_scales[r0 * kChunkBlocks + kb];
      const float w1 = a_scales[(r0 + 8) * kChunkBlocks + kb];
      FLASHD_UNROLL
      for (int j = 0; j < kToks / 8; ++j) {
        const float2 x = *reinterpret_cast<const float2*>(b_scales + kb * kToks + 8 * j + 2 * q);
        acc[4 * j + 0] = FLASHD_EXACT_FMA(d[4 * j + 0], w0 * x.x, acc[4 * j + 0]);
        acc[4 * j + 1] = FLASHD_EXACT_FMA(d[4 * j + 1], w0 * x.y, acc[4 * j + 1]);
        acc[4 * j + 2] = FLASHD_EXACT_FMA(d[4 * j + 2], w1 * x.x, acc[4 * j + 2]);
        acc[4 * j + 3] = FLASHD_EXACT_FMA(d[4 * j + 3], w1 * x.y, acc[4 * j + 3]);
      }
    };
    auto whole_chunk = [&](auto add) {
      // Straight-line, so that the compiler sees which instruction each wait leaves running:
      // block kb + 1's instruction issued before block kb's sums are added.
      issue(0, d0);
      issue(1, d1);
      WgmmaWait<1>();
      add(0, d0);
      issue(2, d0);
      WgmmaWait<1>();
      add(1, d1);
      issue(3, d1);
      WgmmaWait<1>();
      add(2, d0);
      WgmmaWait<0>();
      add(3, d1);
    };
    if (nb == kChunkBlocks) {
      if (folded) {
        whole_chunk(add_products);
      } else {
        whole_chunk(add_rows);
      }
    } else {
      for (int kb = 0; kb < nb; ++kb) {
        issue(kb, d0);
        WgmmaWait<0>();
        if (folded) {
          add_products(kb, d0);
        } else {
          add_rows(kb, d0);
        }
      }
    }

    if (ahead < chunks) store_scales(ahead);
  }
  FLASHD_UNROLL
  for (int j = 0; j < kToks / 8; ++j) {
    FLASHD_UNROLL
    for (int i = 0; i < 4; ++i) {
      const int64_t n = n0 + r0 + 8 * (i / 2), tok = 8 * j + 2 * q + i % 2;
      if (n < N && tok < rows) {
        y[(m0 + tok) * N + n] = round ? c::RoundBf16(acc[4 * j + i]) : acc[4 * j + i];
      }
    }
  }
}

template <int kFormat, int kToks>
__global__ void __launch_bounds__(kWgThreads, 1)
    WgmmaGemmKernel(const uint8_t* xq, const uint8_t* xs, int64_t M, int64_t K, const uint8_t* w,
                    const uint8_t* ws, int64_t N, float* y, bool round) {
  FLASHD_GRID_BEGIN();
  FLASHD_DYNAMIC_SHARED(uint8_t, smem);
  const int64_t n0 = (blockIdx.x % RowTiles(N)) * kTileRows;
  const int64_t m0 = (blockIdx.x / RowTiles(N)) * kToks;
  WgmmaTile<kFormat, kToks>(xq, xs, m0, M - m0 < kToks ? M - m0 : kToks, K, w, ws, N, n0, y, smem,
                            round);
}

// MatrixExpertKernel's mapping with the warpgroup tile.
template <int kFormat, int kToks>
__global__ void __launch_bounds__(kWgThreads, 1)
    WgmmaExpertKernel(const uint8_t* xq, const uint8_t* xs, int64_t K, const int64_t* slot_expert,
                      const int64_t* slot_offset, const int64_t* slot_tiles, int64_t slots,
                      const uint8_t* const* w, const uint8_t* const* ws, int64_t N, float* y) {
  FLASHD_GRID_BEGIN();
  FLASHD_DYNAMIC_SHARED(uint8_t, smem);
  int64_t m0 = 0, rows = 0, e = 0;
  if (!ExpertTileOf(kToks, blockIdx.x / RowTiles(N), slot_expert, slot_offset, slot_tiles, slots,
                    &m0, &rows, &e)) {
    return;
  }
  WgmmaTile<kFormat, kToks>(xq, xs, m0, rows, K, w[e], ws[e], N,
                            (blockIdx.x % RowTiles(N)) * kTileRows, y, smem, false);
}

__global__ void WgmmaNativeKernel(int* native) {
  FLASHD_GRID_BEGIN();
#if defined(FLASHD_WGMMA_NATIVE)
  *native = 1;
#else
  *native = 0;
#endif
}

__global__ void MfmaNativeKernel(int* native) {
  FLASHD_GRID_BEGIN();
  *native = kMfmaNative ? 1 : 0;
}

// Whether this build has kMfma's kernels: AMD's and the HIP CPU runtime's (NVIDIA's answer
// kBadArgument, as AMD's do for kWgmma).
constexpr bool MfmaBuilt() {
#if defined(__HIPCC__) || defined(FLASHD_HIP_CPU)
  return true;
#else
  return false;
#endif
}

// Whether this build launches kWgmma's kernels: NVIDIA's and the HIP CPU runtime's (AMD's 64 KB
// of shared memory a block hold no ring of their stages).
constexpr bool WgmmaBuilt() {
#if defined(__HIPCC__) && !defined(FLASHD_HIP_CPU)
  return false;
#else
  return true;
#endif
}

__global__ void NativeKernel(int* native) {
  FLASHD_GRID_BEGIN();
#if defined(FLASHD_MMA_E4M3_NATIVE)
  *native = 1;
#else
  *native = 0;
#endif
}

OpStatus Launched() {
  return gpuGetLastError() == gpuSuccess ? OpStatus::kOk : OpStatus::kDeviceError;
}

}  // namespace

bool MatrixCoresNative() { return AskDevice(NativeKernel); }

bool MatrixWgmmaNative() { return AskDevice(WgmmaNativeKernel); }

bool MatrixMfmaNative() { return AskDevice(MfmaNativeKernel); }

namespace {

// The warpgroup kernels' launch: a kernel's shared memory allowed the first time (the attribute
// is the kernel's, whatever the device), then the grid.
template <auto kKernel, class... Args>
OpStatus LaunchWgmma(int bytes, int64_t grid, gpuStream_t stream, Args... args) {
  if constexpr (!WgmmaBuilt()) {
    (void)bytes, (void)grid, (void)stream, ((void)args, ...);
    return OpStatus::kBadArgument;
  } else {
    static const gpuError_t allowed = FLASHD_ALLOW_SHARED(kKernel, bytes);
    if (allowed != gpuSuccess) return OpStatus::kDeviceError;
    FLASHD_LAUNCH(kKernel, static_cast<unsigned>(grid), kWgThreads, bytes, stream, args...);
    return Launched();
  }
}

template <int kFormat, int kToks>
OpStatus WgmmaLinear(const LinearParams& p, int64_t grid, gpuStream_t stream) {
  return LaunchWgmma<&WgmmaGemmKernel<kFormat, kToks>>(kWgSharedBytes<kFormat, kToks>, grid, stream,
                                                       p.x_codes, p.x_scales, p.rows, p.in, p.w,
                                                       p.w_scales, p.out, p.y, p.round_output);
}

template <int kFormat, int kToks>
OpStatus WgmmaExperts(const ExpertLinearParams& p, int64_t grid, gpuStream_t stream) {
  return LaunchWgmma<&WgmmaExpertKernel<kFormat, kToks>>(
      kWgSharedBytes<kFormat, kToks>, grid, stream, p.x_codes, p.x_scales, p.in, p.slot_expert,
      p.slot_offset, p.slot_tiles, p.slots, p.w, p.w_scales, p.out, p.y);
}

// ---- FP8 values over BF16 activations (kFp8Dense: wo_a) ---------------------------------------
// wo_a's grouped projections on matrix cores: its FP8 codes are values (code times the 32 x 32
// tile's scale), its activations the attention's outputs, BF16 values (rounded, rotated, rounded
// again), so both sides are BF16 exactly (an E4M3 code's value is one) and the BF16 instruction
// (mma.h, MmaBf16) makes their products exactly. Each output's sum: per K-block of 32 two
// instructions (16 values each, from zero) make the block's sum of code times activation, the
// block's weight scale (a power of two) multiplies it and a fused multiply-add adds it to the
// output's running sum, blocks in order: the same for every output whatever its tile, so the
// results do not depend on the batch, and differ from Linear's (the CPU's lanes over fp32
// values) by the instruction's rounding of the blocks' sums. Activations that are not BF16 values
// are rounded to the nearest (the model gives none).
//
// A thread block of 4 groups of 32 threads takes 64 weight rows of one group by kDmToks tokens (64,
// or 8 for a decode step's rows), K kDmChunk blocks a chunk staged in shared memory as BF16 (a
// row's values at a stride of kLd, so the fragment loads of a group, rows g at words 2t, fall
// in 32 different banks); group q takes the tile's rows 16q.. by the tokens, an instruction per
// 8 tokens a 16-value step. AMD's instruction (kIns kMfma; mfma.h, MfmaBf16Block) takes the same
// staged chunk: wave w (64 threads) the tile's weight rows 32w.. by its tokens in 32s (8 padded
// with zeros), lane l the 16 values 16 (l / 32).. of a block of weight row 32w + l % 32 and of
// token l % 32 (two 16-byte reads each, the rows' stride keeping 8 lanes' reads in 32 banks), four
// instructions of K 8 a block; the lane's 16 outputs are one weight row's, so one scale.
constexpr unsigned kDmThreads = 128;
constexpr int kDmRows = 64;
static_assert(kDmThreads / kMfmaLanes * 32 == kDmRows, "a wave's 32 rows of the tile");
#if defined(FLASHD_MMA_BF16_NATIVE)
constexpr bool kMmaBf16Native = true;
#else
constexpr bool kMmaBf16Native = false;
#endif

template <int kDmToks, int kDmChunk, MatrixInstruction kIns>
__global__ void __launch_bounds__(kDmThreads)
    Fp8ValuesMatrixKernel(const float* x, int64_t M, int64_t K, int64_t groups, const uint8_t* w,
                          const uint8_t* scales, int64_t row0, int64_t N, float* y, bool round) {
  FLASHD_GRID_BEGIN();
  constexpr bool kMfma = kIns == MatrixInstruction::kMfma;
  // A row of staged values: the chunk's and 8 more, so that row g starts 4g banks on.
  constexpr int kLd = kDmChunk * kBlock + 8;
  __shared__ uint4 stage[(kDmRows + kDmToks) * kLd * 2 / 16];  // 16-byte aligned.
  uint16_t* ws = reinterpret_cast<uint16_t*>(stage);           // [kDmRows][kLd], then
  uint16_t* xs = ws + kDmRows * kLd;                           // [kDmToks][kLd].
  __shared__ float sc[kDmRows * kDmChunk];
  using Scratch = std::conditional_t<kMfma, MfmaBf16Scratch, MmaScratch>;
  // The stand-in's (one unused entry where the device has the instruction).
  __shared__ Scratch scratch[(kMfma ? kMfmaNative : kMmaBf16Native) ? 1 : kDmThreads];
  const int64_t row_tiles = (N + kDmRows - 1) / kDmRows;
  const int64_t n0 = blockIdx.x % row_tiles * kDmRows;
  const int64_t g = blockIdx.x / row_tiles % groups;
  const int64_t m0 = blockIdx.x / (row_tiles * groups) * kDmToks;
  const unsigned t = threadIdx.x, lane = t % kGroup, q = t / kGroup;
  const int64_t blocks = K / kBlock, x_stride = groups * K;
  // mma: [8-token tile][output]; mfma: [32-token tile][output].
  constexpr int kRunToks = kMfma ? (kDmToks + 31) / 32 : kDmToks / 8, kRunOut = kMfma ? 16 : 4;
  float run[kRunToks][kRunOut] = {};
  // mfma: this lane's weight row of the tile and half of a block's values; the token of output v
  // of 32-token tile j.
  const int mf_row = static_cast<int>(t / kMfmaLanes) * 32 + static_cast<int>(t % 32);
  const int mf_half = static_cast<int>(t % kMfmaLanes) / 32;
  auto mf_tok = [&](int j, int v) { return 32 * j + 8 * (v / 4) + 4 * mf_half + v % 4; };
  for (int64_t c0 = 0; c0 < blocks; c0 += kDmChunk) {
    const int nb = blocks - c0 < kDmChunk ? static_cast<int>(blocks - c0) : kDmChunk;
    // The weights: 16 codes a piece, each as its BF16 value; rows past N and blocks past K zero.
    for (unsigned i = t; i < kDmRows * kDmChunk * 2; i += kDmThreads) {
      const unsigned r = i / (kDmChunk * 2), piece = i % (kDmChunk * 2);
      const int64_t n = n0 + r;
      uint4 v = make_uint4(0, 0, 0, 0);
      if (n < N && piece < static_cast<unsigned>(nb) * 2) {
        v = *reinterpret_cast<const uint4*>(w + (g * N + n) * K + c0 * kBlock + piece * 16);
      }
      const uint32_t words[4] = {v.x, v.y, v.z, v.w};
      uint32_t out[8];
      FLASHD_UNROLL
      for (int j = 0; j < 8; ++j) {
        const uint32_t word = words[j / 2], shift = 16 * (j % 2);
        // An E4M3 value is a BF16 value: its float's top half, exactly (NaN too).
        const uint32_t lo = c::Bits(c::E4M3ToFloat(static_cast<uint8_t>(word >> shift))) >> 16;
        const uint32_t hi =
            c::Bits(c::E4M3ToFloat(static_cast<uint8_t>(word >> (shift + 8)))) >> 16;
        out[j] = lo | hi << 16;
      }
      uint4* dst = reinterpret_cast<uint4*>(&ws[r * kLd + piece * 16]);
      dst[0] = make_uint4(out[0], out[1], out[2], out[3]);
      dst[1] = make_uint4(out[4], out[5], out[6], out[7]);
    }
    for (unsigned i = t; i < kDmRows * kDmChunk; i += kDmThreads) {
      const unsigned r = i / kDmChunk, b = i % kDmChunk;
      const int64_t n = n0 + r;
      sc[i] = n < N && b < static_cast<unsigned>(nb)
                  ? c::E8M0ToFloat(scales[(row0 + g * N + n) / kBlock * blocks + c0 + b])
                  : 0.0f;
    }
    // The activations: four a piece, as BF16.
    for (unsigned i = t; i < kDmToks * kDmChunk * 8; i += kDmThreads) {
      const unsigned r = i / (kDmChunk * 8), piece = i % (kDmChunk * 8);
      const int64_t m = m0 + r;
      float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      if (m < M && piece < static_cast<unsigned>(nb) * 8) {
        v = *reinterpret_cast<const float4*>(x + m * x_stride + g * K + c0 * kBlock + piece * 4);
      }
      uint32_t* dst = reinterpret_cast<uint32_t*>(&xs[r * kLd + piece * 4]);
      dst[0] = c::FloatToBf16(v.x) | static_cast<uint32_t>(c::FloatToBf16(v.y)) << 16;
      dst[1] = c::FloatToBf16(v.z) | static_cast<uint32_t>(c::FloatToBf16(v.w)) << 16;
    }
    __syncthreads();
    if constexpr (kMfma) {
      for (int b = 0; b < nb; ++b) {
        const int k = b * kBlock + 16 * mf_half;
        const uint4* wr = reinterpret_cast<const uint4*>(&ws[mf_row * kLd + k]);
        const uint4 wv[2] = {wr[0], wr[1]};
        const float s = sc[mf_row * kDmChunk + b];
        FLASHD_UNROLL
        for (int j = 0; j < kRunToks; ++j) {
          const int tok = 32 * j + static_cast<int>(t % 32);
          uint4 xv[2] = {make_uint4(0, 0, 0, 0), make_uint4(0, 0, 0, 0)};
          if (tok < kDmToks) {
            const uint4* xr = reinterpret_cast<const uint4*>(&xs[tok * kLd + k]);
            xv[0] = xr[0], xv[1] = xr[1];
          }
          float sums[16] = {};
          MfmaBf16Block(xv, wv, sums, scratch);
          FLASHD_UNROLL
          for (int v = 0; v < 16; ++v) run[j][v] = fmaf(sums[v], s, run[j][v]);
        }
      }
    } else {
      for (int b = 0; b < nb; ++b) {
        float sums[kDmToks / 8][4] = {};
        FLASHD_UNROLL
        for (int step = 0; step < 2; ++step) {
          const unsigned k = b * kBlock + step * 16 + 2 * (lane % 4);
          const unsigned ra = q * 16 + lane / 4;
          const uint32_t a[4] = {*reinterpret_cast<const uint32_t*>(&ws[ra * kLd + k]),
                                 *reinterpret_cast<const uint32_t*>(&ws[(ra + 8) * kLd + k]),
                                 *reinterpret_cast<const uint32_t*>(&ws[ra * kLd + k + 8]),
                                 *reinterpret_cast<const uint32_t*>(&ws[(ra + 8) * kLd + k + 8])};
          FLASHD_UNROLL
          for (int j = 0; j < kDmToks / 8; ++j) {
            const unsigned rb = j * 8 + lane / 4;
            const uint32_t bf[2] = {*reinterpret_cast<const uint32_t*>(&xs[rb * kLd + k]),
                                    *reinterpret_cast<const uint32_t*>(&xs[rb * kLd + k + 8])};
            MmaBf16(a, bf, sums[j], scratch);
          }
        }
        const float s0 = sc[(q * 16 + lane / 4) * kDmChunk + b];
        const float s1 = sc[(q * 16 + lane / 4 + 8) * kDmChunk + b];
        FLASHD_UNROLL
        for (int j = 0; j < kDmToks / 8; ++j) {
          FLASHD_UNROLL
          for (int i = 0; i < 4; ++i) run[j][i] = fmaf(sums[j][i], i < 2 ? s0 : s1, run[j][i]);
        }
      }
    }
    __syncthreads();  // The chunk is summed before the next is staged over it.
  }
  FLASHD_UNROLL
  for (int j = 0; j < kRunToks; ++j) {
    FLASHD_UNROLL
    for (int i = 0; i < kRunOut; ++i) {
      // mfma: output i is token mf_tok(j, i) (past kDmToks: padding) of the lane's weight row.
      const int tok = kMfma ? mf_tok(j, i) : j * 8 + 2 * static_cast<int>(lane % 4) + i % 2;
      const int64_t n = kMfma ? n0 + mf_row : n0 + q * 16 + lane / 4 + 8 * (i / 2);
      if (n < N && tok < kDmToks && m0 + tok < M) {
        y[(m0 + tok) * groups * N + g * N + n] = round ? c::RoundBf16(run[j][i]) : run[j][i];
      }
    }
  }
}

OpStatus Fp8ValuesMatrix(const LinearParams& p, MatrixInstruction instruction) {
  if (instruction == MatrixInstruction::kMfma && !MfmaBuilt()) return OpStatus::kBadArgument;
  if (p.w == nullptr || p.w_scales == nullptr) return OpStatus::kBadArgument;
  if (p.w_row0 < 0 || p.in % kBlock != 0 || p.groups < 1) return OpStatus::kBadShape;
  if (p.rows == 0) return OpStatus::kOk;
  // Up to 16 rows (a decode step's), tiles of 8 tokens and K four blocks a chunk, so that a
  // thread block's weight loads in flight are not spent on tokens it does not have; else 64 and
  // two. Each output's sums are the same either way.
  const bool narrow = p.rows <= 16;
  const int64_t toks = narrow ? 8 : 64;
  const int64_t grid = (p.out + kDmRows - 1) / kDmRows * p.groups * ((p.rows + toks - 1) / toks);
  if (grid > int64_t{0x7FFFFFFF}) return OpStatus::kBadShape;
  constexpr auto kMma = MatrixInstruction::kMma;
  constexpr auto kMf = MfmaBuilt() ? MatrixInstruction::kMfma : kMma;
  const bool mfma = instruction == MatrixInstruction::kMfma;
  const auto kernel =
      narrow ? (mfma ? &Fp8ValuesMatrixKernel<8, 4, kMf> : &Fp8ValuesMatrixKernel<8, 4, kMma>)
             : (mfma ? &Fp8ValuesMatrixKernel<64, 2, kMf> : &Fp8ValuesMatrixKernel<64, 2, kMma>);
  FLASHD_LAUNCH(kernel, static_cast<unsigned>(grid), kDmThreads, 0,
                static_cast<gpuStream_t>(p.stream), p.x, p.rows, p.in, p.groups, p.w, p.w_scales,
                p.w_row0, p.out, p.y, p.round_output);
  return Launched();
}

}  // namespace

bool LinearMatrixTakes(const LinearParams& p) {
  return p.format == WeightFormat::kFp8Dense ||
         (p.groups == 1 && (p.format == WeightFormat::kFp8 || p.format == WeightFormat::kFp4));
}

namespace {
OpStatus QuantizedMatrix(const LinearParams& p, MatrixInstruction instruction);
}

OpStatus LinearMatrix(const LinearParams& p, MatrixInstruction instruction) {
  if (p.rows < 0 || p.in <= 0 || p.out <= 0 || p.x == nullptr || p.y == nullptr) {
    return OpStatus::kBadShape;
  }
  if (!LinearMatrixTakes(p)) return OpStatus::kBadArgument;
  if (p.round_output && p.up != nullptr) return OpStatus::kBadArgument;
  if (const OpStatus s = LinearCodesFit(p); s != OpStatus::kOk) return s;
  if (const OpStatus s = LinearRopeFits(p); s != OpStatus::kOk) return s;
  if (p.y_codes != nullptr) {  // The op, then y's codes.
    LinearParams q = p;
    q.y_codes = q.y_code_scales = nullptr;
    return CodesAfter(LinearMatrix(q, instruction), false, p);
  }
  if (p.rope_dim > 0) {  // The op, then its rotation.
    LinearParams q = p;
    q.rope_dim = 0;
    return RotatedAfter(LinearMatrix(q, instruction), false, p);
  }
  if (p.format == WeightFormat::kFp8Dense) {
    if (p.up != nullptr) return OpStatus::kBadArgument;
    return Fp8ValuesMatrix(p, instruction);
  }
  return QuantizedMatrix(p, instruction);  // y rounded as the kernels write it.
}

namespace {

// LinearMatrix of FP8 or FP4 weights.
OpStatus QuantizedMatrix(const LinearParams& p, MatrixInstruction instruction) {
  if (const OpStatus s = CheckQuantizedLinear(p, 16); s != OpStatus::kOk) return s;
  if (p.rows == 0) return OpStatus::kOk;
  if (p.up != nullptr) {  // The gated pair: each product as the ungated op makes it.
    return GatedApart(
        p, [&](const LinearParams& q) { return LinearMatrix(q, instruction); },
        [](const SwigluParams& q) { return Swiglu(q); });
  }
  const int shape = p.rows <= kNarrowTo ? 0 : p.rows <= kMediumTo ? 1 : 2;
  const int64_t toks = shape == 0 ? Narrow::kToks : shape == 1 ? Medium::kToks : Wide::kToks;
  const int64_t grid = (p.rows + toks - 1) / toks * RowTiles(p.out);
  if (grid > int64_t{0x7FFFFFFF}) return OpStatus::kBadShape;
  const gpuStream_t stream = static_cast<gpuStream_t>(p.stream);
  if (!p.x_quantized) {
    QuantizeActivations(p.x, p.rows * (p.in / kBlock), p.x_codes, p.x_scales, stream);
  }
  const bool fp8 = p.format == WeightFormat::kFp8;
  if (instruction == MatrixInstruction::kWgmma) {
    if (shape == 0) {
      return fp8 ? WgmmaLinear<0, Narrow::kToks>(p, grid, stream)
                 : WgmmaLinear<1, Narrow::kToks>(p, grid, stream);
    }
    if (shape == 1) {
      return fp8 ? WgmmaLinear<0, Medium::kToks>(p, grid, stream)
                 : WgmmaLinear<1, Medium::kToks>(p, grid, stream);
    }
    return fp8 ? WgmmaLinear<0, Wide::kToks>(p, grid, stream)
               : WgmmaLinear<1, Wide::kToks>(p, grid, stream);
  }
  if (instruction == MatrixInstruction::kMfma && !MfmaBuilt()) return OpStatus::kBadArgument;
  using Kernel = void (*)(const uint8_t*, const uint8_t*, int64_t, int64_t, const uint8_t*,
                          const uint8_t*, int64_t, float*, bool);
  // (NVIDIA's table holds the mma kernels twice, never the unused mfma ones.)
  constexpr auto kMma = MatrixInstruction::kMma;
  constexpr auto kMf = MfmaBuilt() ? MatrixInstruction::kMfma : kMma;
  const Kernel kernels[2][2][3] = {
      {{&MatrixGemmKernel<0, Narrow, kMma>, &MatrixGemmKernel<0, Medium, kMma>,
        &MatrixGemmKernel<0, Wide, kMma>},
       {&MatrixGemmKernel<1, Narrow, kMma>, &MatrixGemmKernel<1, Medium, kMma>,
        &MatrixGemmKernel<1, Wide, kMma>}},
      {{&MatrixGemmKernel<0, Narrow, kMf>, &MatrixGemmKernel<0, Medium, kMf>,
        &MatrixGemmKernel<0, Wide, kMf>},
       {&MatrixGemmKernel<1, Narrow, kMf>, &MatrixGemmKernel<1, Medium, kMf>,
        &MatrixGemmKernel<1, Wide, kMf>}}};
  const Kernel kernel =
      kernels[instruction == MatrixInstruction::kMfma ? 1 : 0][fp8 ? 0 : 1][shape];
  FLASHD_LAUNCH(kernel, static_cast<unsigned>(grid), kThreads, 0, stream, p.x_codes, p.x_scales,
                p.rows, p.in, p.w, p.w_scales, p.out, p.y, p.round_output);
  return Launched();
}

// ExpertLinearMatrix, y not rounded.
OpStatus ExpertMatrixUnrounded(const ExpertLinearParams& p, MatrixInstruction instruction) {
  bool none = false;
  if (const OpStatus s = CheckExpertLinear(p, 16, &none); s != OpStatus::kOk || none) return s;
  if (p.up != nullptr) {  // The gated pair: each product as the ungated op makes it.
    return GatedApart(
        p, [&](const ExpertLinearParams& q) { return ExpertLinearMatrix(q, instruction); },
        [](const SwigluParams& q) { return Swiglu(q); });
  }
  const int64_t grid =
      ((p.rows + kExpertTileRows - 1) / kExpertTileRows + p.slots) * RowTiles(p.out);
  if (grid > int64_t{0x7FFFFFFF}) return OpStatus::kBadShape;
  const gpuStream_t stream = static_cast<gpuStream_t>(p.stream);
  QuantizeExpertRows(p, stream);
  // Medium tiles when the slots average more than a Narrow tile's rows (a prompt's), else
  // Narrow (a decode step's few rows an expert); each output's sums are the same either way.
  const bool medium = p.rows > p.slots * kExpertTileRows;
  const bool fp8 = p.format == WeightFormat::kFp8;
  if (instruction == MatrixInstruction::kWgmma) {
    if (medium) {
      return fp8 ? WgmmaExperts<0, Medium::kToks>(p, grid, stream)
                 : WgmmaExperts<1, Medium::kToks>(p, grid, stream);
    }
    return fp8 ? WgmmaExperts<0, Narrow::kToks>(p, grid, stream)
               : WgmmaExperts<1, Narrow::kToks>(p, grid, stream);
  }
  if (instruction == MatrixInstruction::kMfma && !MfmaBuilt()) return OpStatus::kBadArgument;
  using Kernel = void (*)(const uint8_t*, const uint8_t*, int64_t, const int64_t*, const int64_t*,
                          const int64_t*, int64_t, const uint8_t* const*, const uint8_t* const*,
                          int64_t, float*);
  // (NVIDIA's table holds the mma kernels twice, never the unused mfma ones.)
  constexpr auto kMma = MatrixInstruction::kMma;
  constexpr auto kMf = MfmaBuilt() ? MatrixInstruction::kMfma : kMma;
  const Kernel kernels[2][2][2] = {
      {{&MatrixExpertKernel<0, Narrow, kMma>, &MatrixExpertKernel<0, Medium, kMma>},
       {&MatrixExpertKernel<1, Narrow, kMma>, &MatrixExpertKernel<1, Medium, kMma>}},
      {{&MatrixExpertKernel<0, Narrow, kMf>, &MatrixExpertKernel<0, Medium, kMf>},
       {&MatrixExpertKernel<1, Narrow, kMf>, &MatrixExpertKernel<1, Medium, kMf>}}};
  const Kernel kernel =
      kernels[instruction == MatrixInstruction::kMfma ? 1 : 0][fp8 ? 0 : 1][medium ? 1 : 0];
  FLASHD_LAUNCH(kernel, static_cast<unsigned>(grid), kThreads, 0, stream, p.x_codes, p.x_scales,
                p.in, p.slot_expert, p.slot_offset, p.slot_tiles, p.slots, p.w, p.w_scales, p.out,
                p.y);
  return Launched();
}

}  // namespace

OpStatus ExpertLinearMatrix(const ExpertLinearParams& p, MatrixInstruction instruction) {
  if (p.round_output && p.up != nullptr) return OpStatus::kBadArgument;
  if (const OpStatus s = ExpertCodesFit(p); s != OpStatus::kOk) return s;
  if (p.y_codes != nullptr) {  // The op, then y's codes.
    ExpertLinearParams q = p;
    q.y_codes = q.y_code_scales = nullptr;
    return CodesAfter(ExpertLinearMatrix(q, instruction), false, p);
  }
  const OpStatus s = ExpertMatrixUnrounded(p, instruction);
  return RoundedAfter(s, !p.round_output, p.y, p.rows * p.out, p.stream);
}

}  // namespace flashd::kernels::FLASHD_GPU_BACKEND
