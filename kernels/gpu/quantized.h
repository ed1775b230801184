// What the quantized GEMMs (kernels/gpu/linear.cu and linear_matrix.cu) share: the activations'
// quantizer (RmsNorm's codes too), the checks of their arguments and the rounding pass after them.
#pragma once

#include <cstdint>

#include "kernels/codecs.h"
#include "kernels/gpu/portability.h"
#include "kernels/ops.h"

namespace flashd::kernels::FLASHD_GPU_BACKEND {

// The scale (a power of two) of the 32-block of activations xb, as the CPU's QuantizeFp8PerBlock.
__device__ inline float BlockScale(const float* xb) {
  float amax = 0.0f;
  for (int64_t i = 0; i < 32; ++i) amax = fmaxf(amax, fabsf(xb[i]));
  return codecs::Pow2Ceil(fmaxf(amax, 1e-4f) * (1.0f / 448.0f));
}

// Activation v's FP8 code in a block of scale s.
__device__ inline uint8_t BlockCode(float v, float s) {
  return codecs::FloatToE4M3(codecs::Clamp(v / s, -448.0f, 448.0f));
}

// One 32-block of activations xb to FP8 codes q[0..31] and its UE8M0 scale code, as the CPU's
// QuantizeFp8PerBlock.
__device__ inline void QuantizeBlock(const float* xb, uint8_t* q, uint8_t* scale) {
  const float s = BlockScale(xb);
  *scale = codecs::NormalPow2ToE8M0(s);
  for (int64_t i = 0; i < 32; ++i) q[i] = BlockCode(xb[i], s);
}

// A row of `dim` values (a multiple of 32) that this thread block has just written to x, quantized
// as QuantizeBlock does into codes [dim] and scales [dim / 32], a thread a block, after a barrier
// (so every thread's writes are seen). REQUIRES: every thread of the block calls it.
__device__ inline void QuantizeRow(const float* x, int64_t dim, uint8_t* codes, uint8_t* scales) {
  __syncthreads();
  for (int64_t b = threadIdx.x; b < dim / 32; b += blockDim.x) {
    QuantizeBlock(x + 32 * b, codes + 32 * b, scales + b);
  }
}

// x[blocks x 32] to FP8 codes with a UE8M0 scale per 32, as the CPU's Linear quantizes its
// input, one thread a block; launched on `stream`.
void QuantizeActivations(const float* x, int64_t blocks, uint8_t* codes, uint8_t* scales,
                         gpuStream_t stream);
// ExpertLinear's rows (x's rows x_rows[r] where p gives them) so quantized into p's workspace.
void QuantizeExpertRows(const ExpertLinearParams& p, gpuStream_t stream);

// An op's status after its kernels, y's n values then rounded to BF16 by a RoundBf16 op unless
// `rounded` (the kernels did it as they wrote them, or round_output was not asked).
OpStatus RoundedAfter(OpStatus s, bool rounded, float* y, int64_t n, void* stream);
// A Linear's status after its kernels (and its rounding), then p.y_codes made from y by the
// activations' quantizer unless `coded` (a kernel wrote them as it wrote y, or none were asked).
OpStatus CodesAfter(OpStatus s, bool coded, const LinearParams& p);
// A Linear's status after its kernels, then y rotated by a Rope op as p's rope asks unless
// `rotated` (a kernel did it as it wrote y).
OpStatus RotatedAfter(OpStatus s, bool rotated, const LinearParams& p);
// Likewise an ExpertLinear's y_codes (its rows x out values).
OpStatus CodesAfter(OpStatus s, bool coded, const ExpertLinearParams& p);

inline bool Aligned(const void* p, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

// FP8 or FP4 weights' Linear arguments (the shape checked by the caller): K in whole 32-blocks,
// the weights 16-byte aligned, the activation codes `codes_align`-byte aligned.
inline OpStatus CheckQuantizedLinear(const LinearParams& p, uintptr_t codes_align) {
  if (p.in % 32 != 0) return OpStatus::kBadShape;
  if (p.w == nullptr || p.w_scales == nullptr || p.x_codes == nullptr || p.x_scales == nullptr) {
    return OpStatus::kBadArgument;
  }
  if (!Aligned(p.w, 16) || !Aligned(p.x_codes, codes_align)) return OpStatus::kBadArgument;
  return OpStatus::kOk;
}

// ExpertLinear's arguments, the activation codes `codes_align`-byte aligned (the weights are
// aligned as allocated); *none when there is nothing to compute.
inline OpStatus CheckExpertLinear(const ExpertLinearParams& p, uintptr_t codes_align, bool* none) {
  *none = false;
  if (p.rows < 0 || p.in <= 0 || p.out <= 0 || p.slots < 0 || p.experts <= 0) {
    return OpStatus::kBadShape;
  }
  if (p.format != WeightFormat::kFp8 && p.format != WeightFormat::kFp4) {
    return OpStatus::kBadArgument;
  }
  if (p.in % 32 != 0 || (p.x_rows != nullptr && p.x_count <= 0)) return OpStatus::kBadShape;
  if (!Aligned(p.x_codes, codes_align)) return OpStatus::kBadArgument;
  *none = p.rows == 0 || p.slots == 0;
  return OpStatus::kOk;
}

// The slot (MoeGroup's) holding the experts' row tile `tile`: the last s with
// slot_tiles[s] <= tile. REQUIRES: tile < slot_tiles[slots].
__device__ inline int64_t SlotOfTile(const int64_t* slot_tiles, int64_t slots, int64_t tile) {
  int64_t lo = 0, hi = slots;  // slot_tiles[lo] <= tile < slot_tiles[hi]
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    if (slot_tiles[mid] <= tile) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// The rows slot tile `tile` starts for a thread block of `toks` tokens (a multiple of
// kExpertTileRows): its first row m0, its rows (at most toks) and its slot's expert; false where
// the thread block has nothing to do (past the last slot's tiles, or a tile that the slot's tile
// before it takes).
__device__ inline bool ExpertTileOf(int64_t toks, int64_t tile, const int64_t* slot_expert,
                                    const int64_t* slot_offset, const int64_t* slot_tiles,
                                    int64_t slots, int64_t* m0, int64_t* rows, int64_t* e) {
  if (tile >= slot_tiles[slots]) return false;
  const int64_t lo = SlotOfTile(slot_tiles, slots, tile);
  if ((tile - slot_tiles[lo]) % (toks / kExpertTileRows) != 0) return false;
  *m0 = slot_offset[lo] + (tile - slot_tiles[lo]) * kExpertTileRows;
  const int64_t left = slot_offset[lo + 1] - *m0;
  *rows = left < toks ? left : toks;
  *e = slot_expert[lo];
  return true;
}

}  // namespace flashd::kernels::FLASHD_GPU_BACKEND
