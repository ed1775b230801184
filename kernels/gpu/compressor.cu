// The compressor on the device. Pooling: one thread per dimension walks the rows in order (the
// partial group is per dimension, so the threads never share state), pooling where a group ends:
// the CPU's steps and functions (kernels/fmath.h), so the same bits. Row write: one thread per
// entry rotates its latent (and key) and quantizes them into their rows with the shared codecs.
#include <cmath>

#include "kernels/codecs.h"
#include "kernels/fmath.h"
#include "kernels/gpu/ops.h"
#include "kernels/gpu/portability.h"

namespace flashd::kernels::FLASHD_GPU_BACKEND {
namespace {

namespace c = flashd::kernels::codecs;
namespace fm = flashd::kernels::fmath;
constexpr unsigned kThreads = 128;

// Thread blocks (sequence, dimensions): with several sequences, each walks its own rows into its
// own partial group, its first pooled row after the completing rows of the sequences before it.
__global__ void PoolKernel(CompressPoolParams p, int64_t dim_blocks) {
  FLASHD_GRID_BEGIN();
  const int64_t seq = blockIdx.x / dim_blocks, dim = p.dim, ratio = p.ratio;
  const int64_t d = static_cast<int64_t>(blockIdx.x % dim_blocks) * blockDim.x + threadIdx.x;
  if (d >= dim) return;
  const bool several = p.sequence_rows != nullptr;
  const int64_t r0 = several ? p.sequence_rows[seq] : 0;
  const int64_t r1 = several ? p.sequence_rows[seq + 1] : p.rows;
  float* kv_partial = several ? p.kv_partials[seq] : p.kv_partial;
  float* score_partial = several ? p.score_partials[seq] : p.score_partial;
  int64_t groups = 0;
  for (int64_t t = 0; t < r0; ++t) groups += (p.positions[t] + 1) % ratio == 0 ? 1 : 0;
  const float *kv = p.kv, *score = p.score;
  const int64_t* positions = p.positions;
  float* pooled = p.pooled;
  for (int64_t t = r0; t < r1; ++t) {
    const int64_t pos = positions[t], slot = pos % ratio;
    kv_partial[slot * dim + d] = kv[t * dim + d];
    score_partial[slot * dim + d] = score[t * dim + d];
    if ((pos + 1) % ratio != 0) continue;
    float mx = -INFINITY;
    for (int64_t s = 0; s < ratio; ++s) mx = fmaxf(mx, score_partial[s * dim + d]);
    float sum = 0;
    for (int64_t s = 0; s < ratio; ++s) sum += fm::Exp(score_partial[s * dim + d] - mx);
    float acc = 0;
    for (int64_t s = 0; s < ratio; ++s) {
      acc += kv_partial[s * dim + d] * (fm::Exp(score_partial[s * dim + d] - mx) / sum);
    }
    pooled[groups * dim + d] = c::RoundBf16(acc);
    groups += 1;
  }
}

__device__ void RotateRow(float* x, int64_t n, int64_t rope_dim, int64_t pos, const float* freqs) {
  float* r = x + n - rope_dim;
  for (int64_t i = 0; i < rope_dim / 2; ++i) {
    const float angle = static_cast<float>(pos) * freqs[i];
    float sn, cs;
    fm::SinCos(angle, &sn, &cs);
    const float a = r[2 * i], b = r[2 * i + 1];
    r[2 * i] = c::RoundBf16(a * cs - b * sn);
    r[2 * i + 1] = c::RoundBf16(a * sn + b * cs);
  }
}

// FP4 codes of x (n values) with one scale per `block`: E8M0 (e4m3_scales false) or E4M3.
__device__ void QuantizeFp4(const float* x, int64_t n, int64_t block, bool e4m3_scales,
                            uint8_t* packed, uint8_t* scales) {
  for (int64_t b = 0; b < n / block; ++b) {
    const float* xb = x + b * block;
    float amax = 0.0f;
    for (int64_t i = 0; i < block; ++i) amax = fmaxf(amax, fabsf(xb[i]));
    float s;
    if (e4m3_scales) {
      const uint8_t code = c::FloatToE4M3(fminf(fmaxf(amax, 6.0f * 0x1p-9f) / 6.0f, 448.0f));
      scales[b] = code;
      s = c::E4M3ToFloat(code);
    } else {
      s = c::Pow2Ceil(fmaxf(amax, 6.0f * 0x1p-126f) * (1.0f / 6.0f));
      scales[b] = c::NormalPow2ToE8M0(s);
    }
    for (int64_t i = 0; i < block; i += 2) {
      const uint8_t lo = c::FloatToE2M1(c::Clamp(xb[i] / s, -6.0f, 6.0f));
      const uint8_t hi = c::FloatToE2M1(c::Clamp(xb[i + 1] / s, -6.0f, 6.0f));
      packed[(b * block + i) / 2] = static_cast<uint8_t>(lo | (hi << 4));
    }
  }
}

__global__ void WriteKernel(CompressWriteParams p) {
  FLASHD_GRID_BEGIN();
  const int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (g >= p.groups || p.rows[g] < 0) return;
  const int64_t row = p.rows[g];
  if (p.key != nullptr) {
    float* key = p.key + g * p.index_dim;
    if (p.rope_dim > 0) RotateRow(key, p.index_dim, p.rope_dim, p.positions[g], p.freqs);
    QuantizeFp4(key, p.index_dim, 32, false, p.key_codes.Row(row), p.key_scales.Row(row));
  }
  float* latent = p.latent + g * p.head_dim;
  if (p.rope_dim > 0) RotateRow(latent, p.head_dim, p.rope_dim, p.positions[g], p.freqs);
  QuantizeFp4(latent, p.head_dim, 16, true, p.kv_codes.Row(row), p.kv_scales.Row(row));
}

}  // namespace

OpStatus CompressPool(const CompressPoolParams& p) {
  if (p.rows < 0 || p.dim <= 0 || p.ratio < 2 || p.positions == nullptr) {
    return OpStatus::kBadShape;
  }
  if (p.sequence_rows != nullptr &&
      (p.sequence_count <= 0 || p.kv_partials == nullptr || p.score_partials == nullptr)) {
    return OpStatus::kBadShape;
  }
  if (p.rows == 0) return OpStatus::kOk;
  const int64_t dim_blocks = (p.dim + kThreads - 1) / kThreads;
  const int64_t blocks = dim_blocks * (p.sequence_rows != nullptr ? p.sequence_count : 1);
  if (blocks > int64_t{0x7FFFFFFF}) return OpStatus::kBadShape;  // The grid's limit.
  FLASHD_LAUNCH(PoolKernel, static_cast<unsigned>(blocks), kThreads, 0,
                static_cast<gpuStream_t>(p.stream), p, dim_blocks);
  return gpuGetLastError() == gpuSuccess ? OpStatus::kOk : OpStatus::kDeviceError;
}

OpStatus CompressWrite(const CompressWriteParams& p) {
  if (p.groups < 0 || p.head_dim % 32 != 0 || p.rope_dim > p.head_dim ||
      (p.groups > 0 && p.rows == nullptr) ||
      (p.key != nullptr && (p.index_dim % 32 != 0 || p.rope_dim > p.index_dim))) {
    return OpStatus::kBadShape;
  }
  if (p.groups == 0) return OpStatus::kOk;
  FLASHD_LAUNCH(WriteKernel, static_cast<unsigned>((p.groups + kThreads - 1) / kThreads), kThreads,
                0, static_cast<gpuStream_t>(p.stream), p);
  return gpuGetLastError() == gpuSuccess ? OpStatus::kOk : OpStatus::kDeviceError;
}

}  // namespace flashd::kernels::FLASHD_GPU_BACKEND
