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

#include "kernels/codecs.h"
#include "kernels/gpu/mma.h"
#include "kernels/gpu/ops.h"
#include "kernels/gpu/portability.h"
#include "kernels/gpu/quantized.h"

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

// y[m0 + i, n0 + j] for i < rows (tokens), j < min(128, N - n0), over all of K.
template <int kFormat, class S>
__device__ void MatrixTile(const uint8_t* xq, const uint8_t* xs, int64_t m0, int64_t rows,
                           int64_t K, const uint8_t* w, const uint8_t* ws, int64_t N, int64_t n0,
                           float* y) {
  __shared__ uint4 a_s[kTileRows][kRowPieces];
  __shared__ uint4 b_s[S::kToks][kRowPieces];
  __shared__ float a_scale[kTileRows][kChunkBlocks];
  __shared__ float b_scale[S::kToks][kChunkBlocks];
#if defined(FLASHD_MMA_E4M3_NATIVE)
  MmaScratch* scratch = nullptr;
#else
  __shared__ MmaScratch scratch[kThreads];
#endif
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

  float acc[S::kRowTiles][S::kTokTiles][4];
  FLASHD_UNROLL
  for (int i = 0; i < S::kRowTiles; ++i) {
    FLASHD_UNROLL
    for (int j = 0; j < S::kTokTiles; ++j) {
      FLASHD_UNROLL
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;
    }
  }
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
  FLASHD_UNROLL
  for (int i = 0; i < S::kRowTiles; ++i) {
    FLASHD_UNROLL
    for (int j = 0; j < S::kTokTiles; ++j) {
      FLASHD_UNROLL
      for (int e = 0; e < 4; ++e) {
        const int64_t n = n0 + row_base + i * kInsRows + g + 8 * (e / 2);
        const int64_t tok = tok_base + j * kInsToks + 2 * q + e % 2;
        if (n < N && tok < rows) y[(m0 + tok) * N + n] = acc[i][j][e];
      }
    }
  }
}

FLASHD_OPS_HD inline int64_t RowTiles(int64_t N) { return (N + kTileRows - 1) / kTileRows; }

template <int kFormat, class S>
__global__ void __launch_bounds__(kThreads)
    MatrixGemmKernel(const uint8_t* xq, const uint8_t* xs, int64_t M, int64_t K, const uint8_t* w,
                     const uint8_t* ws, int64_t N, float* y) {
  const int64_t n0 = (blockIdx.x % RowTiles(N)) * kTileRows;
  const int64_t m0 = (blockIdx.x / RowTiles(N)) * S::kToks;
  MatrixTile<kFormat, S>(xq, xs, m0, M - m0 < S::kToks ? M - m0 : S::kToks, K, w, ws, N, n0, y);
}

// The experts' rows (MoeGroup's slots) in tiles of S's tokens: thread block (tile, row tile),
// the tiles of kExpertTileRows counted through slot_tiles (ExpertGemmKernel's mapping,
// kernels/gpu/linear.cu). With S wider than a slot tile, the thread block of a slot's first tile
// of every S::kToks rows takes them all and the others have nothing to do (a thread block that
// returns at once; the grid needs no count of the wider tiles, which only the device knows).
template <int kFormat, class S>
__global__ void __launch_bounds__(kThreads)
    MatrixExpertKernel(const uint8_t* xq, const uint8_t* xs, int64_t K, const int64_t* slot_expert,
                       const int64_t* slot_offset, const int64_t* slot_tiles, int64_t slots,
                       const uint8_t* const* w, const uint8_t* const* ws, int64_t N, float* y) {
  constexpr int64_t kPer = S::kToks / kExpertTileRows;  // Slot tiles a thread block takes.
  const int64_t n0 = (blockIdx.x % RowTiles(N)) * kTileRows, tile = blockIdx.x / RowTiles(N);
  if (tile >= slot_tiles[slots]) return;  // The whole thread block: no barrier is left waiting.
  const int64_t lo = SlotOfTile(slot_tiles, slots, tile);
  if ((tile - slot_tiles[lo]) % kPer != 0) return;  // Taken by the slot's tile before it.
  const int64_t m0 = slot_offset[lo] + (tile - slot_tiles[lo]) * kExpertTileRows;
  const int64_t left = slot_offset[lo + 1] - m0;
  const int64_t e = slot_expert[lo];
  MatrixTile<kFormat, S>(xq, xs, m0, left < S::kToks ? left : S::kToks, K, w[e], ws[e], N, n0, y);
}

__global__ void NativeKernel(int* native) {
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

bool MatrixCoresNative() {
  // Asked of the code the device runs (the machine code or PTX it loaded for this build's
  // architectures), not of its compute capability: 1 where that code has the instruction.
  int* flag = nullptr;
  if (gpuMalloc(reinterpret_cast<void**>(&flag), sizeof(int)) != gpuSuccess) return false;
  int native = 0;
  FLASHD_LAUNCH(NativeKernel, 1, 1, 0, nullptr, flag);
  const bool ok = gpuGetLastError() == gpuSuccess &&
                  gpuMemcpy(&native, flag, sizeof(int), gpuMemcpyDeviceToHost) == gpuSuccess;
  gpuFree(flag);
  return ok && native == 1;
}

bool LinearMatrixTakes(const LinearParams& p) {
  return p.groups == 1 && (p.format == WeightFormat::kFp8 || p.format == WeightFormat::kFp4);
}

OpStatus LinearMatrix(const LinearParams& p) {
  if (p.rows < 0 || p.in <= 0 || p.out <= 0 || p.x == nullptr || p.y == nullptr) {
    return OpStatus::kBadShape;
  }
  if (!LinearMatrixTakes(p)) return OpStatus::kBadArgument;
  if (const OpStatus s = CheckQuantizedLinear(p, 16); s != OpStatus::kOk) return s;
  if (p.rows == 0) return OpStatus::kOk;
  const int shape = p.rows <= kNarrowTo ? 0 : p.rows <= kMediumTo ? 1 : 2;
  const int64_t toks = shape == 0 ? Narrow::kToks : shape == 1 ? Medium::kToks : Wide::kToks;
  const int64_t grid = (p.rows + toks - 1) / toks * RowTiles(p.out);
  if (grid > int64_t{0x7FFFFFFF}) return OpStatus::kBadShape;
  const gpuStream_t stream = static_cast<gpuStream_t>(p.stream);
  QuantizeActivations(p.x, p.rows * (p.in / kBlock), p.x_codes, p.x_scales, stream);
  const bool fp8 = p.format == WeightFormat::kFp8;
  using Kernel = void (*)(const uint8_t*, const uint8_t*, int64_t, int64_t, const uint8_t*,
                          const uint8_t*, int64_t, float*);
  const Kernel kernels[2][3] = {
      {&MatrixGemmKernel<0, Narrow>, &MatrixGemmKernel<0, Medium>, &MatrixGemmKernel<0, Wide>},
      {&MatrixGemmKernel<1, Narrow>, &MatrixGemmKernel<1, Medium>, &MatrixGemmKernel<1, Wide>}};
  const Kernel kernel = kernels[fp8 ? 0 : 1][shape];
  FLASHD_LAUNCH(kernel, static_cast<unsigned>(grid), kThreads, 0, stream, p.x_codes, p.x_scales,
                p.rows, p.in, p.w, p.w_scales, p.out, p.y);
  return Launched();
}

OpStatus ExpertLinearMatrix(const ExpertLinearParams& p) {
  bool none = false;
  if (const OpStatus s = CheckExpertLinear(p, 16, &none); s != OpStatus::kOk || none) return s;
  const int64_t grid =
      ((p.rows + kExpertTileRows - 1) / kExpertTileRows + p.slots) * RowTiles(p.out);
  if (grid > int64_t{0x7FFFFFFF}) return OpStatus::kBadShape;
  const gpuStream_t stream = static_cast<gpuStream_t>(p.stream);
  QuantizeActivations(p.x, p.rows * (p.in / kBlock), p.x_codes, p.x_scales, stream);
  // Medium tiles when the slots average more than a Narrow tile's rows (a prompt's), else
  // Narrow (a decode step's few rows an expert); each output's sums are the same either way.
  const bool medium = p.rows > p.slots * kExpertTileRows;
  const bool fp8 = p.format == WeightFormat::kFp8;
  const auto kernel = medium
                          ? (fp8 ? &MatrixExpertKernel<0, Medium> : &MatrixExpertKernel<1, Medium>)
                          : (fp8 ? &MatrixExpertKernel<0, Narrow> : &MatrixExpertKernel<1, Narrow>);
  FLASHD_LAUNCH(kernel, static_cast<unsigned>(grid), kThreads, 0, stream, p.x_codes, p.x_scales,
                p.in, p.slot_expert, p.slot_offset, p.slot_tiles, p.slots, p.w, p.w_scales, p.out,
                p.y);
  return Launched();
}

}  // namespace flashd::kernels::FLASHD_GPU_BACKEND
