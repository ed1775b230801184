// The GPU implementation of the ops of kernels/ops.h, compiled from one source per op family
// (kernels/gpu/*.cu) into namespace flashd::kernels::cuda, ::hip or ::hipcpu (the HIP CPU
// runtime, which runs the same kernels on the CPU so that their logic is tested everywhere).
// Every pointer in the params is device memory; `stream` is a gpuStream_t (null: the default
// stream). An op launches its kernels on the stream and returns without waiting.
//
// Numerics: every op is bit-equal to its CPU reference (kernels are compiled without fused
// multiply-add, sums run in the CPU's order, and exp, sin and cos are kernels/fmath.h's, shared
// with the CPU); only the matrix-core GEMMs (linear_matrix.h) sum a 32-block in another order.
// tests/kernels/gpu_ops_test.cc holds each op to its reference.
#pragma once

#include "kernels/ops.h"

namespace flashd::kernels::FLASHD_GPU_BACKEND {

// FP8 weights over at most kLinearSplitRows rows (FP4: half as many) can be split over K in the
// fixed order (LinearSplit), their block sums then at most a quarter of the weight's bytes.
constexpr int64_t kLinearSplitRows = 2;
// Linear never splits over K (the H200 measured no split faster) and leaves block_sums alone.
// One row (a decode step) of FP8 or FP4 weights runs as a GEMV (every weight load of a thread
// issued at once, the block sums added in order from shared memory), dense weights likewise; more
// rows as tiles of 32 columns. The same sums either way.
// `arrivals` (optional, out / 32 counters, zeros, left zeros): the one-row GEMV's thread blocks
// count themselves in for each 32 columns of y they write, and the last of them writes the
// columns' codes (p.y_codes), so no quantization follows. Else (and on the other paths) one does.
OpStatus Linear(const LinearParams& p, unsigned* arrivals = nullptr);
// FP8 and FP4 weights in a free order, for measuring what Linear's fixed order costs: each
// thread's K-blocks summed in its registers, the thread block's threads by a tree, and K shared
// by `split` thread blocks (1 or more) whose sums meet by atomic adds, so results depend on
// `split` and on the order the blocks finish. Never used by the backend (gpu_bench compares
// the two; gpu_ops_test holds it to the CPU's results within rounding).
OpStatus LinearFreeOrder(const LinearParams& p, int split);
// Linear's fixed order for FP8 and FP4 weights through the GEMM tile (also at one row), with K
// split `split` ways (the results are the same for every split): for the tests, and for
// gpu_bench to compare splits and the tile against the GEMV. REQUIRES: p's block sums workspace
// for rows x out x in / 32 floats when split > 1.
OpStatus LinearSplit(const LinearParams& p, int split);
// FP8 and FP4 weights on matrix cores (kernels/gpu/linear_matrix.cu), for long prompts: per
// K-block one instruction sums the 32 products of codes, the block's scales applied and the
// blocks added in order, so a row's results do not depend on the rows beside it; they differ from
// Linear's by the instruction's rounding of each block's sum. Takes Linear's params (one group,
// weights and x_codes 16-byte aligned). Runs everywhere: where the device has no such
// instruction (MatrixCoresNative() false) a stand-in with the same data layout computes it.
//
// Two instructions, each with its stand-in: kMma, the 16 x 8 x 32 mma.sync (mma.h; a thread block
// stages K from registers, two chunks in flight), and kWgmma, Hopper's warpgroup instruction
// (wgmma.h; operands read from shared memory, a ring of four chunks filled by cp.async, the next
// block's instruction issued before the last one's sums are added). The same chain of block sums
// either way; whether the two instructions round a block's sum alike is the device's to say, so
// a backend uses one for every row. kWgmma is NVIDIA's and the HIP CPU runtime's (kBadArgument on
// AMD, whose shared memory holds no such ring). kMfma, AMD's 32 x 32 matrix instructions (mfma.h;
// the mma tiles' staging, a wave of 64 threads taking 32 weight rows by 32 tokens an instruction),
// is AMD's and the HIP CPU runtime's (kBadArgument on NVIDIA). FP8 values (kFp8Dense, wo_a's
// groups) take a BF16 instruction, the activations as BF16 values (wo_a's are): with kMfma AMD's
// 32 x 32 x 8 (mfma.h, MfmaBf16Block: native on gfx908, gfx90a and gfx940-gfx942), four a
// K-block's sum; else the 16 x 8 x 16 mma.sync (mma.h, MmaBf16: native from sm_80), two; the
// stand-ins elsewhere; then the block's weight scale and the running sum as above.
enum class MatrixInstruction { kMma, kWgmma, kMfma };
OpStatus LinearMatrix(const LinearParams& p,
                      MatrixInstruction instruction = MatrixInstruction::kMma);
// Whether LinearMatrix takes p's weights: FP8 or FP4, one group; FP8 values, any groups.
bool LinearMatrixTakes(const LinearParams& p);
// ExpertLinear's grouped rows on matrix cores, each row's sums LinearMatrix's.
OpStatus ExpertLinearMatrix(const ExpertLinearParams& p,
                            MatrixInstruction instruction = MatrixInstruction::kMma);
// Whether the code the current device runs has the matrix-core instruction (built for NVIDIA
// sm_89 or newer) rather than the stand-in: asked of the device with a kernel, so not while the
// device is busy with work one must not wait for.
bool MatrixCoresNative();
// Likewise for the warpgroup instruction (NVIDIA code built for sm_90a).
bool MatrixWgmmaNative();
// Likewise for AMD's (code built for gfx908, gfx90a or gfx940-gfx942).
bool MatrixMfmaNative();
OpStatus RoundBf16(const RoundBf16Params& p);
OpStatus AddRound(const AddRoundParams& p);
OpStatus CopyRows(const CopyRowsParams& p);
OpStatus Swiglu(const SwigluParams& p);
OpStatus FakeQuant(const FakeQuantParams& p);
OpStatus Embed(const EmbedParams& p);
// With y_rows and the workspace MoeCombineWorkspaceInts(p) asks for: each entry binned to its
// row (an atomic count), then a thread per row and dimension adding the row's entries in entry
// order (a row's few entries sorted first), so the adds are the CPU's whatever order the bins
// filled in. Otherwise (and for a few entries) a thread per dimension through the entries.
OpStatus MoeCombine(const MoeCombineParams& p);
// The ints of workspace MoeCombine takes for p (y_rows and count), 0 where it takes none.
int64_t MoeCombineWorkspaceInts(const MoeCombineParams& p);
// One thread block (experts <= kMoeGroupMaxExperts): each expert's thread finds its tokens by
// reading every choice, so the cost grows with tokens * k per expert (a prefill's few thousand
// tokens: a few hundred thousand reads per thread, next to the experts' GEMMs).
OpStatus MoeGroup(const MoeGroupParams& p);
// ExpertLinear takes the GEMV up to this many rows a slot (slot_rows: a step of up to 8 tokens).
// `arrivals` (optional, rows x out / 32 counters, zeros, left zeros): the GEMV writes y_codes as
// it writes y, as Linear's does.
constexpr int64_t kExpertGemvRows = 8;
OpStatus ExpertLinear(const ExpertLinearParams& p, unsigned* arrivals = nullptr);
OpStatus RmsNorm(const RmsNormParams& p);
OpStatus Rope(const RopeParams& p);
// HcMix with its steps either side (HcMixParams' sub and x) in one kernel where `fused` is given
// and rows <= kHcFusedRows (a decode step's): a token's thread blocks each make one of its mixes,
// its stream's sum of squares (writing the expanded stream) or its collapse, expanding each value
// of the stream they read as they read it (in ExpandKernel's steps), and the last of them to
// finish (counted in `arrivals`) scales and splits the mixes. Otherwise a kernel a step. The same
// bits either way: the fused kernel saves a decode step's launches (three a sublayer), the
// expansion made again by every thread block costing more than it saves at longer batches.
constexpr int64_t kHcFusedRows = 32;
struct HcMixFused {
  unsigned* arrivals = nullptr;  // [rows] zeros, left zeros.
  double* sums = nullptr;        // Workspace [rows].
};
OpStatus HcMix(const HcMixParams& p, const HcMixFused* fused = nullptr);
OpStatus HcCollapse(const HcCollapseParams& p);
OpStatus HcExpand(const HcExpandParams& p);
OpStatus CompressPool(const CompressPoolParams& p);
OpStatus CompressWrite(const CompressWriteParams& p);
OpStatus EngramGather(const EngramGatherParams& p);
OpStatus EngramGate(const EngramGateParams& p);
// The total order only (kReference gives kBadArgument: it is the CPU library's order).
OpStatus TopK(const TopKParams& p);
OpStatus IndexerScores(const IndexerScoreParams& p);
OpStatus CandidateFilter(const CandidateFilterParams& p);  // Total order only.
// With p.group, MoeGroup of the choices follows: in one kernel where `arrivals` (one counter, zero,
// left zero) is given and experts <= kMoeGroupMaxExperts (the last thread block to route its
// token groups them all), else a kernel each.
// With p.router, its Linear makes the logits first: in the same kernel where arrivals are given
// and RouterInKernel(p) (one token, the grouping asked, one row of fp32 weights and nothing
// more: the last thread block of the logits' GEMV routes and groups), else the Linear op's
// launches, then the rest.
OpStatus MoeRoute(const MoeRouteParams& p, unsigned* arrivals = nullptr);
bool RouterInKernel(const MoeRouteParams& p);
// Where p gives the workspace SparseAttentionWorkspaceFloats(p) asks for (16-byte aligned, as q;
// a DSpark draft block also its draft_keys): the logits a thread per (head, key), each thread
// block decoding its 16 keys for its 16 heads (the first 16 heads' blocks writing them to the
// workspace), then the softmax and weighted sums a thread block per query, head (eight heads for
// 16 queries or more) and 128 dimensions; 16 queries at a time, two kernels each. Otherwise a
// thread block per query and head (eight heads where the queries are 16 or more), and where the
// query's heads leave half the multiprocessors idle, two a head, each computing all the logits and
// half the weighted sums. The same bits every way.
OpStatus SparseAttention(const SparseAttentionParams& p);
// The floats of workspace SparseAttention takes for p's shape (tokens, heads, head_dim, window,
// selected_stride; for a draft block draft_keys), 0 where it takes none: 1.5 MB a query at the
// model's shape, for at most 16 queries. REQUIRES of a draft block given the workspace: no query
// has more window keys than draft_keys.
int64_t SparseAttentionWorkspaceFloats(const SparseAttentionParams& p);
// SparseAttention's layouts, forced whatever the device: for the tests and gpu_bench.
enum class AttentionSchedule {
  kAuto,             // What SparseAttention picks.
  kHeadBlocks,       // A thread block a head (eight heads for 16 queries or more).
  kHeadBlocksSplit,  // Two thread blocks a head, each half the weighted sums.
  kKeysOnce,         // Keys decoded once (kBadArgument where SparseAttention could not).
};
OpStatus SparseAttentionScheduled(const SparseAttentionParams& p, AttentionSchedule schedule);

}  // namespace flashd::kernels::FLASHD_GPU_BACKEND
