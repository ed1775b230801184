// The operations of the DeepSeek-V4.1-Flash forward pass, as plain parameter structs shared by
// every backend (kernels/cpu/ops.h today; the GPU namespace implements the same structs).
//
// Rules every op follows:
// - A params struct holds pointers, sizes, strides and a stream; an op never allocates device
//   memory, never throws and returns an OpStatus (shape and dtype checks happen once, in the
//   engine). Buffers sized by the step are the caller's; the CPU ops keep small per-thread host
//   scratch (a decoded key, a queue for top-k) of their own.
// - Activations are fp32 arrays whose values are BF16 numbers wherever the reference rounds to
//   BF16 (each op says which outputs it rounds). Keeping them in fp32 containers makes a backend's
//   results comparable bit for bit with the CPU reference; the bytes they cost are small next to
//   the weights.
// - Weights come as stored in the checkpoint: FP8 E4M3 with UE8M0 scales per 32x32, FP4 E2M1
//   with UE8M0 scales per 32 inputs, or fp32 values decoded from BF16.
// - Compressed KV and index keys live in fixed-size blocks addressed by row id: row r of a
//   region is block r / rows_per_block, row r % rows_per_block (PagedRows); -1 means none.
// - `stream` is the backend's queue. The CPU reads it, when set, as a CpuStream (how many
//   threads an op may use); a GPU backend passes its gpuStream_t.
#pragma once

#include <cstddef>
#include <cstdint>

// Helpers that kernels call on the device too.
#if defined(__HIPCC__) && defined(__clang__)
#define FLASHD_OPS_HD __attribute__((host, device))
#elif defined(__CUDACC__)
#define FLASHD_OPS_HD __host__ __device__
#else
#define FLASHD_OPS_HD
#endif

namespace flashd::kernels {

// kDeviceError: a GPU launch or runtime call failed (never returned by the CPU ops).
enum class OpStatus { kOk = 0, kBadShape, kBadArgument, kDeviceError };

#define FLASHD_OP_RETURN_IF_ERROR(expr)                                                  \
  do {                                                                                   \
    const ::flashd::kernels::OpStatus flashd_op_status_ = (expr);                        \
    if (flashd_op_status_ != ::flashd::kernels::OpStatus::kOk) return flashd_op_status_; \
  } while (0)

// The CPU's stream: the most threads an op may use (0: every core).
struct CpuStream {
  int threads = 0;
};

// One region (KV rows, index-key codes or their scales) of every block of a pool: row r lives
// at blocks[r / rows_per_block] + offset + (r % rows_per_block) * stride.
//
// `versions` (the pool's, engine/kv_pool.h; optional) counts the writes of each block: an op
// that writes rows adds one to each block it wrote, so a backend that keeps device copies of
// blocks (of `block_bytes` bytes each) knows a copy current while the count is the one it copied.
// Without versions a backend copies the rows an op needs for that op alone. `writes` (the pool's,
// optional with versions) counts the writes made on the host, every one of which also moves a
// block's version on: while it stands still, a backend's copies found current stay current
// except for the blocks its own kernels wrote, so it need not compare their versions again.
// Kernels read neither; a host kernel writing rows moves both on.
struct PagedRows {
  uint8_t* const* blocks = nullptr;  // Block id -> its bytes.
  int64_t rows_per_block = 0;
  size_t offset = 0;
  size_t stride = 0;
  uint64_t* versions = nullptr;  // Block id -> its write count, or null.
  size_t block_bytes = 0;        // A whole block's bytes (with versions).
  uint64_t* writes = nullptr;    // The pool's count of host writes (with versions), or null.
  FLASHD_OPS_HD uint8_t* Row(int64_t r) const {
    return blocks[r / rows_per_block] + offset + static_cast<size_t>(r % rows_per_block) * stride;
  }
};

// --- Linear layers ----------------------------------------------------------------------------
// kDense: fp32 values; kBf16: the same values as BF16 codes (how a GPU keeps BF16 matrices,
// never widened): both give the same results, bit for bit. kFp8Dense: FP8 codes with their
// scales as for kFp8, used as their exact values (code times scale) in kDense's sums, the input
// not quantized (in a multiple of 32): an FP8 matrix the model runs dequantized (wo_a), kept as
// stored.
enum class WeightFormat { kFp8, kFp4, kDense, kBf16, kFp8Dense };

// The stored bytes of an FP8 or FP4 weight [out, in]: its codes and its UE8M0 scales (FP8, and
// FP8 run as values: one per 32x32 tile; FP4: one per 32 inputs). Zero for the other formats.
struct StoredBytes {
  int64_t codes = 0, scales = 0;
};
inline StoredBytes QuantizedWeightBytes(WeightFormat format, int64_t out, int64_t in) {
  if (format == WeightFormat::kFp8 || format == WeightFormat::kFp8Dense) {
    return {out * in, (out + 31) / 32 * (in / 32)};
  }
  if (format == WeightFormat::kFp4) return {out * in / 2, out * (in / 32)};
  return {};
}

// y[rows, out] = x[rows, in] . W^T in fp32 (not rounded). For FP8 and FP4 weights the input is
// first quantized to FP8 with a UE8M0 scale per 32 (as the model's linear() does), into
// x_codes/x_scales ([rows, in] and [rows, in / 32], caller-owned workspace).
// One more projection of a Linear op's x (LinearParams::also): its weights as the op's (w and
// w_scales, or dense), its out and y.
struct LinearProjection {
  const uint8_t* w = nullptr;
  const uint8_t* w_scales = nullptr;
  const float* dense = nullptr;
  int64_t out = 0;
  float* y = nullptr;
};
inline constexpr int64_t kLinearMaxAlso = 3;

struct LinearParams {
  const float* x = nullptr;
  int64_t rows = 0, in = 0, out = 0;
  WeightFormat format = WeightFormat::kDense;
  const uint8_t* w = nullptr;         // FP8 [out, in], FP4 packed [out, in / 2], or kBf16:
                                      // [out, in] BF16 codes (2 bytes each, little-endian).
  const uint8_t* w_scales = nullptr;  // FP8: [ceil(out/32), in/32]; FP4: [out, in/32].
  const float* dense = nullptr;       // kDense: [out, in].
  uint8_t* x_codes = nullptr;
  uint8_t* x_scales = nullptr;
  float* y = nullptr;
  void* stream = nullptr;
  // kFp8/kFp4: x_codes and x_scales hold x's codes already, as the op would write them (FP8 with
  // a UE8M0 scale per 32 of each row: QuantizeFp8PerBlock's; RmsNormParams::codes writes them),
  // so the op reads them and does not quantize x. x is still given.
  bool x_quantized = false;
  // kFp8Dense: `w` may be rows of a larger matrix whose scales `w_scales` are, its first row
  // being that matrix's row w_row0 (scale row (w_row0 + n) / 32 for row n).
  int64_t w_row0 = 0;
  // kFp8Dense: `groups` independent projections in one op (wo_a's grouped LoRA): x [rows,
  // groups * in], y [rows, groups * out], group g taking x's columns [g * in, (g + 1) * in) to
  // y's [g * out, (g + 1) * out) through weight rows [g * out, (g + 1) * out) (scale rows from
  // w_row0 + g * out). Each group's sums are those of a separate op on its slices. Other formats
  // take one group.
  int64_t groups = 1;
  // kFp8/kFp4, workspace of block_sums_count floats for a GPU's LinearSplit (rows x out x in / 32:
  // a GEMM split over K, each 32-block's sum written out, then added in block order, the same
  // results whatever the split; kept for measuring). Linear and the CPUs ignore it.
  float* block_sums = nullptr;
  int64_t block_sums_count = 0;
  // Optional, kFp8/kFp4: a gated pair (an expert's w1 and w3 under SwiGLU) in one op, as
  // ExpertLinearParams' (`up`, `up_scales` the up projection's weights as w's; y gets the
  // SwiGLU; `gate` and `up_out` workspace for a backend that makes the two apart).
  const uint8_t* up = nullptr;
  const uint8_t* up_scales = nullptr;
  const float* row_weights = nullptr;
  float limit = 0;
  float* gate = nullptr;
  float* up_out = nullptr;
  // y rounded to BF16 (RoundBf16Params' with scale 1): the op's values, then a RoundBf16 op over
  // all of y, bit for bit (a GPU's decode kernels round as they write; elsewhere a rounding pass
  // follows). Not with the gated pair (kBadArgument).
  bool round_output = false;
  // Optional: up to kLinearMaxAlso more projections of the same x in this op (kFp8, kFp4, kDense
  // or kBf16; one group, not the gated pair; kBadArgument otherwise), each the values of an op of
  // its own (this op's format, rows, in and round_output) bit for bit. x is quantized once (into
  // x_codes), and a GPU's one-row GEMV makes them all in one kernel (dense weights' when not
  // rounded). `also` is host memory on every backend (the projections' pointers are the op's
  // kind of memory).
  const LinearProjection* also = nullptr;
  int64_t also_count = 0;
  // Optional: y's rows' codes as a Linear quantizes its x (FP8 [rows, groups * out] with a UE8M0
  // scale per 32, [rows, groups * out / 32], of y as the op leaves it: rounded with
  // round_output, the SwiGLU's with the gated pair), for the Linear that reads y next
  // (x_quantized). out a multiple of 32 (kBadShape); not with `also` (kBadArgument). A GPU's FP8
  // values kernel (wo_a at a decode step) and its one-row GEMV (given counters) write them as they
  // write y; elsewhere a quantization follows.
  uint8_t* y_codes = nullptr;
  uint8_t* y_code_scales = nullptr;
  // Optional: y's rows rotated after the op (and its rounding), as heads of rope_head_dim values
  // (even; out a multiple of it), each head's last rope_dim values by its row's position
  // (rope_positions [rows], rope_freqs [rope_dim / 2]): the op's values, then a Rope op's (not
  // inverse) over y, bit for bit (LinearRope). The op's own projection only (not `also`'s); not
  // with groups, the gated pair or y_codes (kBadArgument). A GPU's one-row GEMV rotates as it
  // writes y; elsewhere a Rope op follows.
  int64_t rope_dim = 0, rope_head_dim = 0;
  const int64_t* rope_positions = nullptr;
  const float* rope_freqs = nullptr;
};

// A row's codes (RmsNormParams', HcCollapseParams', HcMixParams' x_codes, Linear's and
// ExpertLinear's y_codes) as every backend checks them: none, or both arrays for rows of whole
// 32-blocks (kBadArgument for codes without scales or scales without codes, kBadShape for a `dim`
// not a multiple of 32).
inline OpStatus RowCodesFit(const uint8_t* codes, const uint8_t* scales, int64_t dim) {
  if ((codes == nullptr) != (scales == nullptr)) return OpStatus::kBadArgument;
  return codes == nullptr || dim % 32 == 0 ? OpStatus::kOk : OpStatus::kBadShape;
}

// LinearParams' rope checked as every backend checks it.
inline OpStatus LinearRopeFits(const LinearParams& p) {
  if (p.rope_dim == 0) return OpStatus::kOk;
  if (p.groups != 1 || p.up != nullptr || p.y_codes != nullptr) return OpStatus::kBadArgument;
  if (p.rope_dim < 0 || p.rope_dim % 2 != 0 || p.rope_head_dim < p.rope_dim ||
      p.rope_head_dim % 2 != 0 || p.out % p.rope_head_dim != 0 || p.rope_positions == nullptr ||
      p.rope_freqs == nullptr) {
    return OpStatus::kBadShape;
  }
  return OpStatus::kOk;
}

// LinearParams' y_codes checked as every backend checks them.
inline OpStatus LinearCodesFit(const LinearParams& p) {
  if (p.y_codes == nullptr && p.y_code_scales == nullptr) return OpStatus::kOk;
  if (p.also_count > 0) return OpStatus::kBadArgument;
  return RowCodesFit(p.y_codes, p.y_code_scales, p.out);
}

// LinearParams' `also` checked as every backend checks it: kOk when there is none or they fit,
// kBadArgument for a format, group count or gated pair that does not take them (or over
// kLinearMaxAlso, or weights missing), kBadShape for a projection without outputs.
inline OpStatus LinearAlsoFits(const LinearParams& p) {
  if (p.also_count == 0) return OpStatus::kOk;
  if (p.also_count < 0 || p.also_count > kLinearMaxAlso || p.also == nullptr) {
    return OpStatus::kBadArgument;
  }
  const bool quantized = p.format == WeightFormat::kFp8 || p.format == WeightFormat::kFp4;
  if ((!quantized && p.format != WeightFormat::kDense && p.format != WeightFormat::kBf16) ||
      p.groups != 1 || p.up != nullptr) {
    return OpStatus::kBadArgument;
  }
  for (int64_t j = 0; j < p.also_count; ++j) {
    const LinearProjection& a = p.also[j];
    if (a.out <= 0 || a.y == nullptr) return OpStatus::kBadShape;
    const bool weights = quantized ? a.w != nullptr && a.w_scales != nullptr
                         : p.format == WeightFormat::kDense ? a.dense != nullptr
                                                            : a.w != nullptr;
    if (!weights) return OpStatus::kBadArgument;
  }
  return OpStatus::kOk;
}

// Projection j of p's `also` as an op of its own (j = -1: p's own projection without them).
inline LinearParams LinearAlone(const LinearParams& p, int64_t j) {
  LinearParams q = p;
  q.also = nullptr;
  q.also_count = 0;
  if (j < 0) return q;
  q.rope_dim = 0;  // The rotation is the op's own projection's.
  const LinearProjection& a = p.also[j];
  q.w = a.w;
  q.w_scales = a.w_scales;
  q.dense = a.dense;
  q.out = a.out;
  q.y = a.y;
  return q;
}

// --- Element-wise and row ops -----------------------------------------------------------------
// x = BF16(BF16(x) * scale): BF16(x) with the default scale of 1.
struct RoundBf16Params {
  float* x = nullptr;
  int64_t n = 0;
  void* stream = nullptr;
  float scale = 1.0f;
};

// x = BF16(weight * (x * rsqrt(mean(x^2) + eps))) per row, the sum of squares in double in
// HcMixParams' order (kHcMixLanes lanes, then the fixed tree); with round_input the row is rounded
// to BF16 first (the projection it comes from is fp32).
struct RmsNormParams {
  float* x = nullptr;
  int64_t rows = 0, dim = 0, stride = 0;  // stride: floats between rows.
  const float* weight = nullptr;
  float eps = 0;
  bool round_input = false;
  void* stream = nullptr;
  // Optional, after the norm (the window keys' steps in one op): with rope_dim > 0 each row's
  // last rope_dim values rotated as a Rope op of one head of dim values (positions [rows],
  // freqs [rope_dim / 2]), then with fake_quant_fp8 each row through FakeQuant's kFp8E8M0 in
  // blocks of 32 (dim a multiple of 32): the values of those ops in turn, bit for bit.
  int64_t rope_dim = 0;
  const int64_t* positions = nullptr;
  const float* freqs = nullptr;
  bool fake_quant_fp8 = false;
  // Optional, last: each row's values as a Linear quantizes its x (FP8 codes [rows, dim] and a
  // UE8M0 scale code per 32, [rows, dim / 32]; dim a multiple of 32), for the Linear that reads
  // the rows next (LinearParams::x_quantized), which then launches no quantization of its own.
  uint8_t* codes = nullptr;
  uint8_t* code_scales = nullptr;
  // Optional, last: row r's values (after every step above) also written to row copy_rows[r] of
  // copy_to (rows of dim floats) where copy_rows[r] >= 0 (copy_rows [rows]); no two rows to one:
  // a CopyRows of those rows after the op, bit for bit (the window rows a step keeps, staged).
  float* copy_to = nullptr;
  const int64_t* copy_rows = nullptr;
  // Optional: another norm in the same op (its own rows, x, dim, weight and steps; no `next` of
  // its own; host memory), over rows apart from this op's: this op's values, then that op's, bit
  // for bit (a layer's query latent and window keys, one launch on a GPU).
  const RmsNormParams* next = nullptr;
};

// Whether RmsNormParams' steps after the norm (rope_dim, fake_quant_fp8, codes, the copy) fit its
// row: every backend refuses the rest as kBadShape.
inline bool RmsNormStepsFit(const RmsNormParams& p) {
  const bool rope_fits = p.rope_dim <= 0 || (p.rope_dim % 2 == 0 && p.rope_dim <= p.dim &&
                                             p.positions != nullptr && p.freqs != nullptr);
  const bool codes_fit = RowCodesFit(p.codes, p.code_scales, p.dim) == OpStatus::kOk;
  const bool copy_fits = (p.copy_to == nullptr) == (p.copy_rows == nullptr);
  return rope_fits && codes_fit && copy_fits && (!p.fake_quant_fp8 || p.dim % 32 == 0);
}

// RmsNormParams checked as every backend checks them, its `next` too, before anything is written:
// kBadShape for a shape or steps that do not fit, kBadArgument for a `next` with its own.
inline OpStatus RmsNormFits(const RmsNormParams& p) {
  if (p.rows < 0 || p.dim <= 0 || p.stride < p.dim || p.weight == nullptr || !RmsNormStepsFit(p)) {
    return OpStatus::kBadShape;
  }
  if (p.next == nullptr) return OpStatus::kOk;
  if (p.next->next != nullptr) return OpStatus::kBadArgument;
  return RmsNormFits(*p.next);
}

// The model's fake quantizers: x = dequantize(quantize(x)) in blocks of `block` along each row.
enum class FakeQuantFormat { kFp8E8M0, kFp4E8M0, kFp4E4M3 };

// Rotates the last rope_dim values of each head of each row by the row's position, rounding to
// BF16: x[r, h, head_dim - rope_dim + 2i : +2] by angle positions[r] * freqs[i] (negated when
// inverse). freqs comes from RopeFrequencies (YaRN when original_max_positions > 0).
struct RopeParams {
  float* x = nullptr;
  int64_t rows = 0, heads = 1, head_dim = 0, rope_dim = 0;
  int64_t row_stride = 0;  // Floats between rows; heads are head_dim apart.
  const int64_t* positions = nullptr;
  const float* freqs = nullptr;  // [rope_dim / 2]
  bool inverse = false;
  void* stream = nullptr;
  // Optional, after the rotation (fake_quant_block > 0, dividing head_dim): each head's values
  // through FakeQuant's fake_quant_format in blocks of fake_quant_block: the Rope op, then a
  // FakeQuant op of each head, bit for bit (the indexer's queries, one launch on a GPU).
  int64_t fake_quant_block = 0;
  FakeQuantFormat fake_quant_format = FakeQuantFormat::kFp8E8M0;
};

// RopeParams checked as every backend checks them (kBadShape for the rest).
inline bool RopeFits(const RopeParams& p) {
  return p.rows >= 0 && p.heads > 0 && p.rope_dim > 0 && p.rope_dim % 2 == 0 &&
         p.rope_dim <= p.head_dim && p.row_stride >= p.heads * p.head_dim &&
         p.positions != nullptr && p.freqs != nullptr &&
         (p.fake_quant_block <= 0 || p.head_dim % p.fake_quant_block == 0);
}

// The Rope op after a Linear of p's rope (LinearParams::rope_dim > 0): over its y.
inline RopeParams LinearRope(const LinearParams& p) {
  return {.x = p.y,
          .rows = p.rows,
          .heads = p.out / p.rope_head_dim,
          .head_dim = p.rope_head_dim,
          .rope_dim = p.rope_dim,
          .row_stride = p.out,
          .positions = p.rope_positions,
          .freqs = p.rope_freqs,
          .stream = p.stream};
}

// The model's fake quantizers (FakeQuantFormat above) over n values in blocks of `block`.
struct FakeQuantParams {
  float* x = nullptr;
  int64_t n = 0, block = 32;
  FakeQuantFormat format = FakeQuantFormat::kFp8E8M0;
  void* stream = nullptr;
};

// --- mHC: the hc residual copies ----------------------------------------------------------------
// mixes = (flatten(X[r]) . fn^T) * rsqrt(mean(X[r]^2) + norm_eps), split into pre (sigmoid + eps),
// post (2 sigmoid) and comb (a softmax, then `iters` alternating Sinkhorn normalisations).
// The long sums (hc x dim terms: 20,480 at the released shape) in one fixed order on every
// backend: kHcMixLanes lanes, lane l adding the products of elements l, l + kHcMixLanes, ... in
// order, then the lanes met by a fixed tree (lane l += lane l + s, for s = kHcMixLanes / 2 down
// to 1); the dot products in fp32, the sum of squares in double. A GPU gives each sum
// kHcMixLanes threads (one chain of 20,480 adds would take longer than the layer's weights).
inline constexpr int64_t kHcMixLanes = 256;
struct HcMixParams {
  const float* X = nullptr;  // [rows, hc, dim]
  int64_t rows = 0, hc = 0, dim = 0;
  const float* fn = nullptr;     // [(2 + hc) * hc, hc * dim]
  const float* scale = nullptr;  // [3]
  const float* base = nullptr;   // [(2 + hc) * hc]
  int iters = 0;
  float hc_eps = 0, norm_eps = 0;
  float* mixes = nullptr;  // Workspace [rows, (2 + hc) * hc].
  float* pre = nullptr;    // [rows, hc]
  float* post = nullptr;   // [rows, hc]
  float* comb = nullptr;   // [rows, hc, hc]
  void* stream = nullptr;
  // Optional, the steps either side of the mixes (the forward pass's step between two sublayers
  // in one op), bit for bit HcExpand, HcCollapse and HcMix in turn: with `sub` set, X is first
  // expanded as HcExpandParams' (sub, expand_post, expand_comb) into `expanded` (not X), and the
  // mixes are `expanded`'s; with `x` set, the stream (X, or `expanded`) is collapsed as
  // HcCollapseParams' (collapse_weights, collapse_norm or none, collapse_eps) into x. Every input
  // is read before an output is written: pre, post and comb may be collapse_weights, expand_post
  // and expand_comb.
  const float* sub = nullptr;               // [rows, dim]
  const float* expand_post = nullptr;       // [rows, hc]
  const float* expand_comb = nullptr;       // [rows, hc, hc]
  float* expanded = nullptr;                // [rows, hc, dim]
  const float* collapse_weights = nullptr;  // [rows, hc]
  const float* collapse_norm = nullptr;     // [dim]
  float collapse_eps = 0;
  float* x = nullptr;  // [rows, dim]
  // Optional with x: x's rows quantized as a Linear quantizes its x (HcCollapseParams' codes).
  uint8_t* x_codes = nullptr;        // [rows, dim]
  uint8_t* x_code_scales = nullptr;  // [rows, dim / 32]
};

// HcMixParams' steps around the mixes as every backend checks them: kBadShape for an expansion
// into X itself, kBadArgument for a step without its inputs or output.
inline OpStatus HcStepsFit(const HcMixParams& p) {
  if (p.sub != nullptr && p.expanded == p.X) return OpStatus::kBadShape;
  if (p.sub != nullptr &&
      (p.expanded == nullptr || p.expand_post == nullptr || p.expand_comb == nullptr)) {
    return OpStatus::kBadArgument;
  }
  if (p.x != nullptr && p.collapse_weights == nullptr) return OpStatus::kBadArgument;
  if (const OpStatus s = RowCodesFit(p.x_codes, p.x_code_scales, p.dim); s != OpStatus::kOk) {
    return s;
  }
  return p.x_codes != nullptr && p.x == nullptr ? OpStatus::kBadShape : OpStatus::kOk;
}

// x[r] = BF16(sum_h weights[r, h] * X[r, h]), then RMSNorm with norm_weight when it is set.
struct HcCollapseParams {
  const float* X = nullptr;
  const float* weights = nullptr;  // [rows, hc]
  int64_t rows = 0, hc = 0, dim = 0;
  const float* norm_weight = nullptr;
  float eps = 0;
  float* x = nullptr;  // [rows, dim]
  void* stream = nullptr;
  // Optional, last: x's rows quantized as a Linear quantizes its x (RmsNormParams' codes; dim a
  // multiple of 32), for the Linears that read x next (LinearParams::x_quantized).
  uint8_t* codes = nullptr;        // [rows, dim]
  uint8_t* code_scales = nullptr;  // [rows, dim / 32]
};

// out[r, j] = BF16(post[r, j] * sub[r] + sum_i comb[r, i, j] * X[r, i]).
struct HcExpandParams {
  const float* X = nullptr;
  const float* sub = nullptr;  // [rows, dim]
  const float* post = nullptr;
  const float* comb = nullptr;
  int64_t rows = 0, hc = 0, dim = 0;
  float* out = nullptr;  // [rows, hc, dim], not aliasing X.
  void* stream = nullptr;
};

// HcMix's steps before its mixes as ops of their own, in turn: the expansion, then the collapse
// (which reads its weights before the mixes may write them), through a backend's `expand` and
// `collapse` (its HcExpand and HcCollapse). *X: the stream the mixes read then (X or expanded).
template <class Expand, class Collapse>
OpStatus HcStepsApart(const HcMixParams& p, Expand expand, Collapse collapse, const float** X) {
  *X = p.X;
  if (p.sub != nullptr) {
    const OpStatus s = expand(HcExpandParams{.X = p.X,
                                             .sub = p.sub,
                                             .post = p.expand_post,
                                             .comb = p.expand_comb,
                                             .rows = p.rows,
                                             .hc = p.hc,
                                             .dim = p.dim,
                                             .out = p.expanded,
                                             .stream = p.stream});
    if (s != OpStatus::kOk) return s;
    *X = p.expanded;
  }
  if (p.x == nullptr) return OpStatus::kOk;
  return collapse(HcCollapseParams{.X = *X,
                                   .weights = p.collapse_weights,
                                   .rows = p.rows,
                                   .hc = p.hc,
                                   .dim = p.dim,
                                   .norm_weight = p.collapse_norm,
                                   .eps = p.collapse_eps,
                                   .x = p.x,
                                   .stream = p.stream,
                                   .codes = p.x_codes,
                                   .code_scales = p.x_code_scales});
}

// --- Compressor ---------------------------------------------------------------------------------
// Gated pooling of `ratio` consecutive tokens (ratio > 1): each row's projections go into slot
// positions[r] % ratio of the sequence's partial group; a row that completes a group (position
// + 1 a multiple of ratio) pools it: per dimension a softmax of the scores over the group weights
// the values, rounded to BF16, written to pooled[g] for the g-th completing row. One call may
// pool the rows of several sequences, each into its own partial group (sequence_rows): the
// sequences' rows one after another, pooled in row order across them.
struct CompressPoolParams {
  const float* kv = nullptr;     // [rows, dim] fp32 projections
  const float* score = nullptr;  // [rows, dim]
  int64_t rows = 0, dim = 0, ratio = 0;
  const int64_t* positions = nullptr;
  float* kv_partial = nullptr;     // [ratio, dim], the sequence's state
  float* score_partial = nullptr;  // [ratio, dim]
  float* pooled = nullptr;         // [completing rows, dim]
  void* stream = nullptr;
  // Optional: several sequences. [sequence_count + 1] row offsets (sequence s's rows are
  // [sequence_rows[s], sequence_rows[s + 1]), the last rows), and each sequence's partial groups
  // [sequence_count], which then replace kv_partial and score_partial.
  const int64_t* sequence_rows = nullptr;
  float* const* kv_partials = nullptr;
  float* const* score_partials = nullptr;
  int64_t sequence_count = 0;
};

// Writes compressed entries: each latent (normalised, not yet rotated) is rotated at its group's
// first position and stored as FP4 with an E4M3 scale per 16 into KV row rows[g]; with keys,
// the index key (normalised, not rotated) likewise as FP4 with a UE8M0 scale per 32 into the
// key regions. rows[g] == -1 skips the entry (it is final already). Inputs are modified. With
// kv_codes.versions, each block written has its count moved on by one per row (and
// kv_codes.writes by one).
struct CompressWriteParams {
  float* latent = nullptr;  // [groups, head_dim]
  float* key = nullptr;     // [groups, index_dim] or null
  int64_t groups = 0, head_dim = 0, index_dim = 0, rope_dim = 0;
  const int64_t* positions = nullptr;  // Rotation position of each entry.
  const float* freqs = nullptr;
  const int64_t* rows = nullptr;
  PagedRows kv_codes, kv_scales, key_codes, key_scales;
  void* stream = nullptr;
};

// --- Indexer ------------------------------------------------------------------------------------
// score[t, j] = BF16(sum_h BF16(max(BF16(q[t, h] . key_j), 0) * weights[t, h])) for the visible
// entries j < visible[t] of query t (all of one sequence), key_j decoded exactly from its FP4
// codes and UE8M0 scales at row BlockRow(block_table, j); the dot product sums in eight lanes
// (element d in lane d % 8, lanes added pairwise at the end). Entries with mask[t, j] == 0 (when
// a mask is given) and entries past visible[t] score -inf. The queries of several sequences may
// share a call (token_sequence, block_tables): each reads its own sequence's entries.
struct IndexerScoreParams {
  const float* q = nullptr;        // [tokens, heads, dim], rotated and FP4 round-tripped
  const float* weights = nullptr;  // [tokens, heads]
  int64_t tokens = 0, heads = 0, dim = 0;
  const int64_t* visible = nullptr;      // [tokens], each <= stride
  const int32_t* block_table = nullptr;  // The sequence's blocks, in order.
  PagedRows key_codes, key_scales;
  const uint8_t* mask = nullptr;  // Optional [tokens, stride].
  int64_t stride = 0;
  float* scores = nullptr;  // [tokens, stride]
  void* stream = nullptr;
  // Optional: [tokens] each query's sequence, an index into block_tables [sequence_count], which
  // then replace block_table. Null: one sequence.
  const int32_t* token_sequence = nullptr;
  const int32_t* const* block_tables = nullptr;
  int64_t sequence_count = 0;

  // Query t's block table.
  FLASHD_OPS_HD const int32_t* TableOf(int64_t t) const {
    return token_sequence != nullptr ? block_tables[token_sequence[t]] : block_table;
  }
};

// The pool row of a sequence's entry j: its block from the block table, its row within it.
FLASHD_OPS_HD inline int64_t BlockRow(const int32_t* block_table, int64_t rows_per_block,
                                      int64_t j) {
  return static_cast<int64_t>(block_table[j / rows_per_block]) * rows_per_block +
         j % rows_per_block;
}

// How equal values are ordered when a top-k must choose among them.
enum class TopKOrder {
  // Value descending, then index ascending: a total order any backend can reproduce.
  kTotal,
  // The official reference's CPU selection (libstdc++'s partial_sort or nth_element over
  // (value, index) pairs in index order, comparing values alone): what the golden data was made
  // with. NaN ranks above every number in both orders.
  kReference,
};

// The indices of the k largest of each row's first n[t] values (fewer when n[t] < k), padded
// with -1 to k. kTotal lists them in rank order; kReference in the order its selection leaves
// them (which decides, e.g., the order the router sums the chosen weights in).
// With `ascending`, each row's picks (the same ones) are listed in ascending index order instead,
// the -1 padding after them: the order the sparse attention reads a selection in, so that the
// picks need no host between the two (on a GPU at most 5,632 of them).
struct TopKParams {
  const float* values = nullptr;  // [rows, stride]
  int64_t rows = 0, stride = 0, k = 0;
  const int64_t* n = nullptr;  // [rows]
  TopKOrder order = TopKOrder::kTotal;
  int64_t* out = nullptr;  // [rows, k]
  void* stream = nullptr;
  bool ascending = false;
};

// The indexer's candidate pre-filter: per query, the best `top_blocks` blocks of `block`
// consecutive entries by their highest score (the newest block always kept, blocks with no
// finite score never), as a 0/1 mask over the visible entries.
struct CandidateFilterParams {
  const float* scores = nullptr;  // [tokens, stride]
  int64_t tokens = 0, stride = 0, block = 0, top_blocks = 0;
  const int64_t* visible = nullptr;
  TopKOrder order = TopKOrder::kTotal;
  float* block_scores = nullptr;  // Workspace [tokens, ceil(stride / block)]
  int64_t* block_top = nullptr;   // Workspace [tokens, top_blocks]
  uint8_t* mask = nullptr;        // [tokens, stride]
  void* stream = nullptr;
};

// --- Attention ----------------------------------------------------------------------------------
// Sparse attention of each query over its window rows (FP8 with a UE8M0 scale per 32, in the
// sequence's ring: positions window_first[t] .. window_last[t], slot p % window, or taken from
// this call's fresh rows when p >= fresh_first) and its selected compressed rows (FP4 with E4M3
// scales per 16), with a per-head sink logit in the softmax. Keys are the values. Each output
// head is rounded to BF16 and rotated back (inverse RoPE at the query's position).
//
// The softmax is the release's kernel's: the query's keys form one list, walked in blocks of
// kAttentionBlock entries with a running maximum (starting at -1e30, the sink not in it). Per
// block: m' = max(m, the block's logits), p = exp(logit - m') in fp32; the denominator is
// sum * exp(m - m') + (the block's p, summed in list order), and the output accumulator
// acc * exp(m - m') + (the block's BF16(p) times the keys, summed in list order). At the end
// the sink adds exp(sink - m) to the denominator and out = BF16(acc / denominator). So the
// probabilities meet the values rounded to BF16, against the maximum of the blocks so far.
// Logits are (q . key, summed over the dimensions in order) * fp32(1 / sqrt(head_dim)).
//
// The list, as the release lays it out for one query decoded after another: the window's
// `window` slots, slot i holding position t - window + 1 + i for the query at position t (empty
// before window_first), then the selected entries that are not -1, in their order. A draft block
// (window_last given) lists its ring rows (positions before fresh_first) by ring slot, p %
// window, then the block's fresh rows in position order, then the selected entries.
//
// One call may hold the queries of several sequences (token_sequence and sequences): each query
// then reads its own sequence's ring, fresh rows and block table, and gets the bits it gets in a
// call of its sequence alone.
constexpr int64_t kAttentionBlock = 64;

// What a query reads of its own sequence: its window ring (ring_slot_bytes as
// SparseAttentionParams'), this call's fresh rows of it (fresh[0] at position fresh_first) and its
// block table.
struct AttentionSequence {
  const uint8_t* ring_codes = nullptr;
  const uint8_t* ring_scales = nullptr;
  int64_t ring_slot_bytes = 0;
  const uint64_t* ring_versions = nullptr;  // As SparseAttentionParams::ring_versions.
  const float* fresh = nullptr;
  int64_t fresh_first = 0;
  const int32_t* block_table = nullptr;
};

struct SparseAttentionParams {
  const float* q = nullptr;  // [tokens, heads, head_dim], BF16 values, rotated
  int64_t tokens = 0, heads = 0, head_dim = 0, rope_dim = 0;
  const int64_t* positions = nullptr;
  // Window.
  const uint8_t* ring_codes = nullptr;   // [window, head_dim]
  const uint8_t* ring_scales = nullptr;  // [window, head_dim / 32]
  // Bytes from a ring slot's codes (and scales) to the next slot's; 0: head_dim for the codes
  // and head_dim / 32 for the scales, the two arrays above. A backend that interleaves them
  // (each slot's scales after its codes, one copy a run of slots) gives its slot's size here.
  int64_t ring_slot_bytes = 0;
  // Optional [window]: the ring slots' versions (SequenceState::Ring::versions). Kernels ignore
  // them; a backend that keeps the ring on its device copies only the slots whose version moved.
  const uint64_t* ring_versions = nullptr;
  int64_t window = 0;
  const float* fresh = nullptr;  // [tokens, head_dim] this call's window rows, FP8 round-tripped
  int64_t fresh_first = 0;       // Position of fresh[0].
  const int64_t* window_first = nullptr;  // [tokens]
  // [tokens] the last window position each query attends to; null: its own position (causal).
  // A DSpark draft block's queries all see the whole block.
  const int64_t* window_last = nullptr;
  // With window_last: at least every query's window_last - window_first + 1 (its window keys), or
  // 0 (unknown). A GPU backend needs it to give a draft block's queries the keys-once kernels.
  int64_t draft_keys = 0;
  // Compressed rows: the sequence's entries, read through its block table.
  const int64_t* selected = nullptr;  // [tokens, selected_stride] entries, -1 = none
  int64_t selected_stride = 0;
  // Optional [tokens]: every entry query t selects is below selected_bound[t] (the entries it can
  // see). Kernels ignore it; a backend that has `selected` on its device (where the indexer's
  // picks stay) maps the blocks under the bounds rather than read the entries on the host.
  const int64_t* selected_bound = nullptr;
  const int32_t* block_table = nullptr;
  PagedRows kv_codes, kv_scales;
  const float* sink = nullptr;   // [heads]
  const float* freqs = nullptr;  // For the inverse rotation.
  float* out = nullptr;          // [tokens, heads, head_dim]
  // Optional scratch for a GPU backend (kernels/gpu/ops.h: SparseAttentionWorkspaceFloats says
  // how much it takes); the CPU ignores it.
  float* workspace = nullptr;
  int64_t workspace_floats = 0;
  void* stream = nullptr;
  // Optional: the queries of several sequences in one call. [tokens] each query's sequence, an
  // index into sequences [sequence_count], whose rings, fresh rows and block tables replace the
  // fields above (ring_codes .. fresh_first and block_table, then unused). The fresh rows of a
  // sequence are its queries' rows, as for a call of its own. Null: one sequence, the fields
  // above.
  const int32_t* token_sequence = nullptr;
  const AttentionSequence* sequences = nullptr;
  int64_t sequence_count = 0;

  // Query t's sequence.
  FLASHD_OPS_HD AttentionSequence SequenceOf(int64_t t) const {
    if (token_sequence != nullptr) return sequences[token_sequence[t]];
    return {ring_codes, ring_scales, ring_slot_bytes, ring_versions,
            fresh,      fresh_first, block_table};
  }
  // Ring slot `slot`'s head_dim codes and head_dim / 32 scales of sequence s, in the layout its
  // ring_slot_bytes names.
  FLASHD_OPS_HD const uint8_t* RingCodes(const AttentionSequence& s, int64_t slot) const {
    return s.ring_codes + slot * (s.ring_slot_bytes > 0 ? s.ring_slot_bytes : head_dim);
  }
  FLASHD_OPS_HD const uint8_t* RingScales(const AttentionSequence& s, int64_t slot) const {
    return s.ring_scales + slot * (s.ring_slot_bytes > 0 ? s.ring_slot_bytes : head_dim / 32);
  }
};

// Query t's window keys in list order (SparseAttentionParams): key j's position and its index
// in the list; the selected entries follow from list index selected_base().
struct AttentionKeys {
  int64_t first = 0, last = 0, window = 1;
  bool draft = false;
  int64_t ring_end = 0, wrapped = 0;  // Draft: ring positions are those < ring_end.

  FLASHD_OPS_HD static AttentionKeys Of(const SparseAttentionParams& p, int64_t t) {
    return Of(p, t, p.SequenceOf(t).fresh_first);
  }
  // With query t's sequence's fresh_first known.
  FLASHD_OPS_HD static AttentionKeys Of(const SparseAttentionParams& p, int64_t t,
                                        int64_t fresh_first) {
    AttentionKeys k;
    k.first = p.window_first[t];
    k.window = p.window;
    k.draft = p.window_last != nullptr;
    k.last = k.draft ? p.window_last[t] : p.positions[t];
    if (k.draft) {
      k.ring_end = k.last + 1 < fresh_first ? k.last + 1 : fresh_first;
      if (k.ring_end < k.first) k.ring_end = k.first;
      // The ring rows by slot: those past the first wrap to slot 0 come first.
      const int64_t w0 = k.first - k.first % k.window + k.window;
      k.wrapped = k.ring_end > w0 ? k.ring_end - w0 : 0;
    }
    return k;
  }
  FLASHD_OPS_HD int64_t count() const { return last >= first ? last - first + 1 : 0; }
  FLASHD_OPS_HD int64_t Position(int64_t j) const {
    if (!draft || j >= ring_end - first) return first + j;
    return j < wrapped ? ring_end - wrapped + j : first + (j - wrapped);
  }
  FLASHD_OPS_HD int64_t ListIndex(int64_t j) const {
    return draft ? j : first + j - (last - window + 1);
  }
  FLASHD_OPS_HD int64_t selected_base() const { return draft ? count() : window; }
};

// --- MoE ----------------------------------------------------------------------------------------
enum class RouteScoring { kSoftmax, kSigmoid, kSqrtSoftplus };

// Per token: expert scores from the router logits, the top k by score + bias (the bias only
// chooses), weights = the chosen scores, normalised when norm_topk (and k > 1), times scale.
struct MoeGroupParams;
struct MoeRouteParams {
  const float* logits = nullptr;  // [tokens, experts]
  const float* bias = nullptr;    // [experts]
  int64_t tokens = 0, experts = 0, k = 0;
  RouteScoring scoring = RouteScoring::kSqrtSoftplus;
  bool norm_topk = false;
  float scale = 1;
  TopKOrder order = TopKOrder::kTotal;
  float* scores = nullptr;    // Workspace [tokens, experts]
  float* biased = nullptr;    // Workspace [tokens, experts]
  int64_t* chosen = nullptr;  // [tokens, k] expert ids, in ranked order
  float* weights = nullptr;   // [tokens, k]
  void* stream = nullptr;
  // Optional: then the choices grouped by expert (MoeGroup of chosen and weights; the tokens,
  // experts and k these), bit for bit the two ops in turn. Host memory on every backend (its
  // pointers the op's kind of memory), as MoeGroupParams' chosen, weights and shape are ignored.
  const MoeGroupParams* group = nullptr;
  // Optional: the logits made first, in the op, by this Linear (its y the logits, its rows the
  // tokens, its outputs the experts; host memory, as group): bit for bit the Linear op, then this
  // op without it.
  const LinearParams* router = nullptr;
};

// The expert's activation: h = BF16(weight * silu(gate) * up) with gate and up rounded to BF16
// and clamped by limit (> 0): up to [-limit, limit], gate to at most limit.
struct SwigluParams {
  const float* gate = nullptr;  // [rows, inter]
  const float* up = nullptr;
  int64_t rows = 0, inter = 0;
  const float* row_weights = nullptr;  // [rows] or null (1)
  float limit = 0;
  float* h = nullptr;
  void* stream = nullptr;
};

// Scatter-adds expert outputs into the routed sum: y[rows[i]] += expert_out[i], i in order (the
// engine's experts come in ascending id, so each token's sum has a fixed order).
struct MoeCombineParams {
  const float* expert_out = nullptr;  // [count, dim]
  const int64_t* rows = nullptr;      // [count] token rows
  int64_t count = 0, dim = 0;
  float* y = nullptr;
  void* stream = nullptr;
  // Rows of y, more than any of `rows`; 0: found from `rows` (which a GPU backend then reads on
  // the host, so `rows` made on the device must come with it).
  int64_t y_rows = 0;
  // Optional scratch for a GPU backend (kernels/gpu/ops.h: MoeCombineWorkspaceInts); the CPU
  // ignores it.
  int32_t* workspace = nullptr;
  int64_t workspace_ints = 0;
  // Optional (with y_rows > 0): then out = BF16(y + add) over all y_rows rows, bit for bit an
  // AddRound op (a = y, b = add) after the combine: the routed sum and the shared expert's output
  // in the combine's op.
  const float* add = nullptr;
  float* out = nullptr;
};

// The tokens grouped by the experts that chose them, on the device that routed them (the host
// never reads the choices): entries in ascending expert order, each expert's tokens in token
// order, so one range of the grouped rows per expert, and a token's entries in ascending expert
// order (MoeCombine over the grouped rows adds each token's experts as the per-expert loop did).
// `slots` = min(experts, tokens * k): the experts chosen at all, ascending, fill the first slots;
// the rest have expert -1 and no rows. slot_tiles counts each slot's rows in tiles of
// kExpertTileRows (a GPU kernel's tile, from the slot's range), cumulatively. Ids outside
// [0, experts) (MoeRoute makes none): the CPU refuses them, a GPU leaves their entries unwritten.
constexpr int64_t kExpertTileRows = 8;
constexpr int64_t kMoeGroupMaxExperts = 1024;  // A GPU's MoeGroup (larger: on the host).
struct MoeGroupParams {
  const int64_t* chosen = nullptr;  // [tokens, k] expert ids (MoeRoute)
  const float* weights = nullptr;   // [tokens, k]
  int64_t tokens = 0, experts = 0, k = 0, slots = 0;
  int64_t* slot_expert = nullptr;  // [slots]
  int64_t* slot_offset = nullptr;  // [slots + 1]: slot s's rows are [offset[s], offset[s + 1])
  int64_t* slot_tiles = nullptr;   // [slots + 1]
  int64_t* rows = nullptr;         // [tokens * k] each grouped entry's token row
  float* row_weights = nullptr;    // [tokens * k] its routing weight
  void* stream = nullptr;
};

// MoeGroupParams' shape as every backend checks it (slots = min(experts, tokens x k)).
inline bool MoeGroupFits(const MoeGroupParams& p) {
  const int64_t n = p.tokens * p.k;
  return p.tokens >= 0 && p.experts > 0 && p.k > 0 && p.slots == (p.experts < n ? p.experts : n);
}

// MoeRouteParams' grouping (p.group set) with its choices and shape.
inline MoeGroupParams MoeRouteGroup(const MoeRouteParams& p) {
  MoeGroupParams g = *p.group;
  g.chosen = p.chosen;
  g.weights = p.weights;
  g.tokens = p.tokens;
  g.experts = p.experts;
  g.k = p.k;
  g.stream = p.stream;
  return g;
}

// Whether MoeRouteParams' router, where it has one, writes the op's logits for its tokens and
// experts; every backend refuses the rest as kBadShape, before anything is written.
inline bool MoeRouterFits(const MoeRouteParams& p) {
  return p.router == nullptr || (p.router->y == p.logits && p.router->rows == p.tokens &&
                                 p.router->out == p.experts && p.router->groups <= 1);
}

// MoeRouteParams' shape (tokens, experts, k), grouping and router checked as every backend checks
// them: false for what each refuses as kBadShape.
inline bool MoeRouteFits(const MoeRouteParams& p) {
  return p.tokens >= 0 && p.experts > 0 && p.k > 0 && p.k <= p.experts &&
         (p.group == nullptr || MoeGroupFits(MoeRouteGroup(p))) && MoeRouterFits(p);
}

// The routed experts' linear layers over grouped rows (MoeGroup): rows [offset[s], offset[s +
// 1]) of x times expert slot_expert[s]'s weights, for every slot. Every expert's weights have the
// format (FP8 or FP4) and shape given; each row's sums are Linear's, bit for bit.
struct ExpertLinearParams {
  const float* x = nullptr;  // [rows, in] grouped rows
  int64_t rows = 0, in = 0, out = 0;
  const int64_t* slot_expert = nullptr;  // [slots]
  const int64_t* slot_offset = nullptr;  // [slots + 1]
  const int64_t* slot_tiles = nullptr;   // [slots + 1]
  int64_t slots = 0, experts = 0;
  WeightFormat format = WeightFormat::kFp4;
  const uint8_t* const* w = nullptr;         // [experts]: each expert's weights, as for Linear
  const uint8_t* const* w_scales = nullptr;  // [experts]
  uint8_t* x_codes = nullptr;                // Workspace [rows, in] (x's codes with x_quantized)
  uint8_t* x_scales = nullptr;               // Workspace [rows, in / 32]
  float* y = nullptr;                        // [rows, out]
  void* stream = nullptr;
  // Optional: no slot has more rows than this (0: unknown). A step of n tokens has at most n rows
  // a slot; a GPU backend takes a row at a time where that is few.
  int64_t slot_rows = 0;
  // Optional, the experts' gated pair (w1 and w3 under SwiGLU) in one op: `up` and `up_scales`
  // are the up projections' weights, as w's for the gates', and y [rows, out] gets SwigluParams'
  // h of the two (row_weights [rows] or null, limit): the values of two ExpertLinear ops and a
  // Swiglu op, bit for bit. `gate` and `up_out` ([rows, out] each) are workspace for a backend
  // that computes the two apart (GatedApart); a GPU's one-row path does not touch them.
  const uint8_t* const* up = nullptr;
  const uint8_t* const* up_scales = nullptr;
  const float* row_weights = nullptr;
  float limit = 0;
  float* gate = nullptr;
  float* up_out = nullptr;
  // As LinearParams' round_output: every row of y [rows, out] rounded, those no slot writes too.
  bool round_output = false;
  // Optional: the op's row r is row x_rows[r] of x, which then has x_count rows (MoeGroup's
  // rows, read where they are): the values of the op over those rows copied out first
  // (CopyRows), bit for bit. Null: x is [rows, in].
  const int64_t* x_rows = nullptr;
  int64_t x_count = 0;
  // Optional with x_rows: the codes of x's own rows ([x_count, in] and [x_count, in / 32], as
  // HcMixParams::x_codes writes them), which the op may read through x_rows instead of
  // quantizing its rows into x_codes: the same values (a backend may ignore them; a GPU's
  // one-row path reads them).
  const uint8_t* x_row_codes = nullptr;
  const uint8_t* x_row_scales = nullptr;
  // Without x_rows: x_codes and x_scales hold the codes of x's rows already (as the op would
  // write them: LinearParams::x_quantized's), so the op reads them and does not quantize x.
  bool x_quantized = false;
  // Optional: y's rows' codes, as LinearParams::y_codes ([rows, out] and [rows, out / 32], of y
  // as the op leaves it), for the ExpertLinear that reads y next (x_quantized). out a multiple of
  // 32 (kBadShape).
  uint8_t* y_codes = nullptr;
  uint8_t* y_code_scales = nullptr;
};

// ExpertLinearParams' codes (x_quantized, y_codes) checked as every backend checks them.
inline OpStatus ExpertCodesFit(const ExpertLinearParams& p) {
  if (p.x_quantized && (p.x_rows != nullptr || p.x_codes == nullptr || p.x_scales == nullptr)) {
    return OpStatus::kBadArgument;
  }
  return RowCodesFit(p.y_codes, p.y_code_scales, p.out);
}

// A gated pair (LinearParams' or ExpertLinearParams') as two ops (`one`, given p without the
// pair) into the workspace and a Swiglu op (`swiglu`): the definition every backend's fused path
// is held to. y's codes (y_codes) are not made here.
template <class P, class One, class SwigluOp>
OpStatus GatedApart(const P& p, One one, SwigluOp swiglu) {
  if (p.up == nullptr || p.up_scales == nullptr || p.gate == nullptr || p.up_out == nullptr ||
      p.round_output) {
    return OpStatus::kBadArgument;
  }
  P q = p;
  q.up = q.up_scales = nullptr;
  q.row_weights = nullptr;
  q.gate = q.up_out = nullptr;
  q.y_codes = q.y_code_scales = nullptr;  // Codes are of the SwiGLU's y: the caller's to make.
  q.y = p.gate;
  if (const OpStatus s = one(q); s != OpStatus::kOk) return s;
  q.w = p.up;
  q.w_scales = p.up_scales;
  q.y = p.up_out;
  if (const OpStatus s = one(q); s != OpStatus::kOk) return s;
  return swiglu(SwigluParams{.gate = p.gate,
                             .up = p.up_out,
                             .rows = p.rows,
                             .inter = p.out,
                             .row_weights = p.row_weights,
                             .limit = p.limit,
                             .h = p.y,
                             .stream = p.stream});
}

// out = BF16(a + b), element-wise (out may alias a or b).
struct AddRoundParams {
  const float* a = nullptr;
  const float* b = nullptr;
  int64_t n = 0;
  float* out = nullptr;
  void* stream = nullptr;
};

// --- Data movement ------------------------------------------------------------------------------
// dst[i * dst_stride + j] = src[r(i) * src_stride + j] for i < rows, j < cols, where r(i) =
// index[i] with an index, else i: a strided block copied, or rows gathered. Exact; src and dst
// must not overlap.
struct CopyRowsParams {
  const float* src = nullptr;
  int64_t src_stride = 0;
  const int64_t* index = nullptr;  // Optional [rows], each >= 0.
  int64_t rows = 0, cols = 0;
  float* dst = nullptr;
  int64_t dst_stride = 0;
  void* stream = nullptr;
  // Rows of src, more than any index; 0: found from the index (which a GPU backend then reads
  // on the host, so an index made on the device must come with it).
  int64_t src_rows = 0;
};

// --- Engram -------------------------------------------------------------------------------------
// Gathers the FP8 n-gram rows of each token (row ids per column) into BF16 values [tokens,
// columns * head_dim].
struct EngramGatherParams {
  const uint8_t* table = nullptr;         // [table rows, head_dim] FP8
  const uint8_t* table_scales = nullptr;  // [table rows, head_dim / 32] UE8M0
  const int64_t* row_ids = nullptr;       // [tokens, row_stride], columns used from `column0`
  int64_t tokens = 0, columns = 0, head_dim = 0, row_stride = 0, column0 = 0;
  float* out = nullptr;
  void* stream = nullptr;
};

// Each hc copy of the stream gets gate * value, gate from the normalised dot product of the copy
// with its key (weighted by qk), through a signed square root and a sigmoid.
struct EngramGateParams {
  float* X = nullptr;         // [tokens, hc, dim]
  const float* kv = nullptr;  // [tokens, hc + 1, dim]: hc keys, then the value
  const float* qk = nullptr;  // [hc, dim]
  int64_t tokens = 0, hc = 0, dim = 0;
  float eps = 0;
  void* stream = nullptr;
};

// --- Embedding ----------------------------------------------------------------------------------
// X[t, h] = embed[tokens[t]] for every copy h. A token outside [0, vocab) is kBadArgument (the
// GPU kernels cannot check device-resident ids; their backend checks them before the launch).
struct EmbedParams {
  const int32_t* tokens = nullptr;
  int64_t count = 0, hc = 0, dim = 0, vocab = 0;
  const float* embed = nullptr;          // [vocab, dim]
  const uint16_t* embed_bf16 = nullptr;  // Or the same table as BF16 codes (instead of embed).
  float* X = nullptr;
  void* stream = nullptr;
};

}  // namespace flashd::kernels
