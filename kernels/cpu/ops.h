// The CPU implementation of every op in kernels/ops.h: the plain references every other backend
// is tested against, and where it pays a faster version that tests/kernels/ops_test.cc holds to
// its reference. One file per family: norm_rope.cc, linear.cc, mhc.cc, compressor.cc,
// indexer.cc, attention.cc, moe.cc, engram.cc.
//
// Ops run on the calling thread and the process's thread pool (CpuStream::threads bounds how
// many threads); results never depend on the number of threads.
#pragma once

#include "kernels/ops.h"

namespace flashd::kernels::cpu {

// Threads an op may use, from its stream.
int StreamThreads(const void* stream);

OpStatus Linear(const LinearParams& p);
OpStatus RoundBf16(const RoundBf16Params& p);
OpStatus RmsNorm(const RmsNormParams& p);
OpStatus Rope(const RopeParams& p);
OpStatus FakeQuant(const FakeQuantParams& p);
// The rotary frequencies as the reference precomputes them in fp32: base^(-2i/dim), with YaRN's
// ramp between beta_fast and beta_slow when original_max_positions > 0. Writes dim / 2 floats.
void RopeFrequencies(int dim, int64_t original_max_positions, double base, double factor,
                     double beta_fast, double beta_slow, float* freqs);

OpStatus Embed(const EmbedParams& p);
OpStatus HcMix(const HcMixParams& p);
OpStatus HcCollapse(const HcCollapseParams& p);
OpStatus HcExpand(const HcExpandParams& p);

OpStatus CompressPool(const CompressPoolParams& p);
OpStatus CompressWrite(const CompressWriteParams& p);

// IndexerScoresRef decodes each key through the format reference and runs one query at a time;
// IndexerScores decodes each key once for every query of the call and uses vector lanes.
OpStatus IndexerScoresRef(const IndexerScoreParams& p);
OpStatus IndexerScores(const IndexerScoreParams& p);
OpStatus TopK(const TopKParams& p);
OpStatus CandidateFilter(const CandidateFilterParams& p);

OpStatus SparseAttention(const SparseAttentionParams& p);

OpStatus MoeRoute(const MoeRouteParams& p);
OpStatus Swiglu(const SwigluParams& p);
OpStatus MoeCombine(const MoeCombineParams& p);
OpStatus MoeGroup(const MoeGroupParams& p);
OpStatus ExpertLinear(const ExpertLinearParams& p);
OpStatus AddRound(const AddRoundParams& p);
OpStatus CopyRows(const CopyRowsParams& p);

OpStatus EngramGather(const EngramGatherParams& p);
OpStatus EngramGate(const EngramGateParams& p);

}  // namespace flashd::kernels::cpu
