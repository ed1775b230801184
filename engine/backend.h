// Backend: the seam between the layer loop and the kernels. The forward pass (engine/forward.cc)
// is written once against this interface, one call per op of kernels/ops.h; a backend runs each
// op on its device. CpuBackend runs the CPU references (kernels/cpu); the GPU backend implements
// the same calls with the kernels of kernels/gpu.
//
// A backend also names its numerics: the version of the exact results its ops give, which the
// prefix cache puts in every key (two backends share cached KV only when their numerics are the
// same, i.e. bit-equal).
//
// Thread-safety: ops may be called from one thread at a time per stream; a backend holds no
// per-call state.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "kernels/cpu/ops.h"
#include "kernels/ops.h"

namespace flashd::engine {

// The CPU backend's numerics version (3: mHC's mixes summed in lanes and a tree, HcMixParams;
// 4: exp, sin and cos from kernels/fmath.h, RMSNorm's sum of squares in HcMixParams' lanes).
inline constexpr std::string_view kCpuNumerics = "cpu/4";

// What a backend runs on, for /health, /v1/models and the start-up log.
struct BackendReport {
  std::string backend;         // "cpu", "cuda", "hip" or "hipcpu".
  std::string device;          // The device's name ("cpu" for the CPU).
  uint64_t memory_in_use = 0;  // Device bytes the backend holds (weights, KV and workspace).
  uint64_t memory_total = 0;   // The device's memory; 0 for the CPU.
  // How the FP8 and FP4 linears are computed: "exact" (the CPU's sums), "matrix" (on matrix
  // cores, engine.gpu_gemms), "matrix wgmma" (the same through Hopper's warpgroup instruction),
  // "matrix mfma" (through AMD's) or "matrix stand-in" (the same layout without the instruction).
  std::string gemms = "exact";
  // Kernels start while the kernel ahead of them finishes (GpuOptions::early_launch, where the
  // device has it).
  bool early_launch = false;
  // The KV pool's blocks kept on the device (a GPU backend's KV arena): its bytes, and how many
  // times a block was copied there (once when first read, again after its host bytes changed).
  uint64_t kv_device_bytes = 0;
  uint64_t kv_blocks_copied = 0;
  // The sequences' window rings kept on the device: their bytes, how many ring slots were
  // copied there (each slot when first read and again after the forward pass wrote it), and in
  // how many copies (an op's slots in one, however many sequences it reads).
  uint64_t ring_device_bytes = 0;
  uint64_t ring_slots_copied = 0, ring_uploads = 0;
  // The sequences' block tables kept on the device: how many of their entries were copied there
  // (each when first read and again after it changed, not once an op).
  uint64_t table_entries_copied = 0;
  // KV block versions compared with those of the blocks' device copies (the ops' walks of their
  // blocks: a table's blocks once after each host write to the pool, not once an op).
  uint64_t kv_versions_compared = 0;
  uint64_t weight_bytes = 0;  // Device bytes of weights.
  // Bytes copied to the device and back since start, and how many times the host waited for
  // the device (a synchronisation, or a read of activations it kept).
  uint64_t bytes_to_device = 0, bytes_to_host = 0, waits = 0;
  // Copies to the device queued behind the kernels (the host going on), and copies the host
  // waited for (those of more than 1 MiB, which wait for the kernels before them too).
  uint64_t uploads_queued = 0, uploads_waited = 0;
  // Copies to the host (each waits for the kernels before it): the kept activations the host
  // reads, the KV rows and kept buffers brought back when the backend settles, op outputs.
  uint64_t downloads = 0;
  // Kept buffers that start as zeros, cleared on the device instead of copied (KeepAs::kZeros).
  uint64_t bytes_zeroed = 0;
  // Ops run on the device since start, each one kernel launch or a few, and the kernels
  // launched (by this process on the backend's kind of device, all its devices together).
  uint64_t device_ops = 0, kernel_launches = 0;
  // Kept buffers whose bytes were on the device already from an earlier step (Backend::Keep's
  // content: the compressors' partial groups), so not copied there again.
  uint64_t kept_reused = 0;
};

// What a kept buffer's device copy starts as (Backend::Keep).
enum class KeepAs : uint8_t {
  kUnwritten,  // Nothing: no op reads it before ops have written it.
  kHostBytes,  // The host's bytes, copied to the device before an op reads them.
  kZeros,      // Zeros, as the host's bytes are: cleared on the device, nothing copied.
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string_view name() const = 0;
  virtual std::string_view numerics() const = 0;
  virtual BackendReport Report() const { return {std::string(name()), "cpu", 0, 0}; }

  virtual kernels::OpStatus Linear(const kernels::LinearParams& p) const = 0;
  virtual kernels::OpStatus RoundBf16(const kernels::RoundBf16Params& p) const = 0;
  virtual kernels::OpStatus RmsNorm(const kernels::RmsNormParams& p) const = 0;
  virtual kernels::OpStatus Rope(const kernels::RopeParams& p) const = 0;
  virtual kernels::OpStatus FakeQuant(const kernels::FakeQuantParams& p) const = 0;
  virtual kernels::OpStatus Embed(const kernels::EmbedParams& p) const = 0;
  virtual kernels::OpStatus HcMix(const kernels::HcMixParams& p) const = 0;
  virtual kernels::OpStatus HcCollapse(const kernels::HcCollapseParams& p) const = 0;
  virtual kernels::OpStatus HcExpand(const kernels::HcExpandParams& p) const = 0;
  virtual kernels::OpStatus CompressPool(const kernels::CompressPoolParams& p) const = 0;
  virtual kernels::OpStatus CompressWrite(const kernels::CompressWriteParams& p) const = 0;
  virtual kernels::OpStatus IndexerScores(const kernels::IndexerScoreParams& p) const = 0;
  virtual kernels::OpStatus TopK(const kernels::TopKParams& p) const = 0;
  virtual kernels::OpStatus CandidateFilter(const kernels::CandidateFilterParams& p) const = 0;
  virtual kernels::OpStatus SparseAttention(const kernels::SparseAttentionParams& p) const = 0;
  virtual kernels::OpStatus MoeRoute(const kernels::MoeRouteParams& p) const = 0;
  virtual kernels::OpStatus Swiglu(const kernels::SwigluParams& p) const = 0;
  virtual kernels::OpStatus MoeCombine(const kernels::MoeCombineParams& p) const = 0;
  virtual kernels::OpStatus MoeGroup(const kernels::MoeGroupParams& p) const = 0;
  virtual kernels::OpStatus ExpertLinear(const kernels::ExpertLinearParams& p) const = 0;
  virtual kernels::OpStatus AddRound(const kernels::AddRoundParams& p) const = 0;
  virtual kernels::OpStatus CopyRows(const kernels::CopyRowsParams& p) const = 0;
  virtual kernels::OpStatus EngramGather(const kernels::EngramGatherParams& p) const = 0;
  virtual kernels::OpStatus EngramGate(const kernels::EngramGateParams& p) const = 0;

  // Weights placed before the first op needs them: `bytes` at `host` as stored (FP8/FP4 codes,
  // their scales, fp32 vectors), or `count` fp32 values of a matrix the ops take as dense (kept
  // as BF16 codes on a GPU when they all are BF16 numbers), keyed as the ops key them. A backend
  // that copies weights (copies_weights) uploads them now; the CPU reads them in place, so
  // these do nothing there.
  virtual bool copies_weights() const { return false; }
  virtual kernels::OpStatus Upload(const void* host, size_t bytes) const {
    (void)host, (void)bytes;
    return kernels::OpStatus::kOk;
  }
  virtual kernels::OpStatus UploadDense(const float* host, size_t count) const {
    (void)host, (void)count;
    return kernels::OpStatus::kOk;
  }

  // Activations kept on the device from op to op (a GPU backend; on the CPU these do nothing).
  // From Keep to Release, `count` floats at `host` have a device copy that ops read and write in
  // place (also through pointers into the middle of it): an op's outputs there stay on the
  // device, and the host bytes catch up only when ToHost asks for a range. A host write into a
  // kept buffer is announced with HostWrote (the bytes go to the device copy). `as`: what the
  // device copy starts as (the host's bytes, zeros, or nothing when ops write it first).
  // Settle brings every kept buffer's host bytes up to date and makes the host the only valid
  // copy, and brings the KV rows ops wrote on the device to the host blocks; the forward pass
  // calls it on the backend it leaves and on the one that takes over, and at the end of a step.
  // `content` (0: none) names bytes across steps, a number no other bytes ever had (the
  // compressors' partial groups, SequenceState::Compressor::version): Release with a content
  // says the host bytes are those the last Settle left, nothing written since, and that the
  // number names them from now on, so the backend may keep its device copy; a later Keep of the
  // same content (KeepAs::kHostBytes) then takes that copy as it is, nothing copied, wherever
  // the host bytes now are. A backend keeps a copy only where its own ops were the last to
  // write the bytes. REQUIRES: kept buffers do not overlap; Release before the host memory goes.
  virtual void Keep(float* host, size_t count, KeepAs as, uint64_t content) const {
    (void)host, (void)count, (void)as, (void)content;
  }
  virtual void Release(const float* host, uint64_t content) const { (void)host, (void)content; }
  virtual kernels::OpStatus ToHost(const float* host, size_t count) const {
    (void)host, (void)count;
    return kernels::OpStatus::kOk;
  }
  virtual kernels::OpStatus HostWrote(const float* host, size_t count) const {
    (void)host, (void)count;
    return kernels::OpStatus::kOk;
  }
  virtual kernels::OpStatus Settle() const { return kernels::OpStatus::kOk; }
};

class CpuBackend : public Backend {
 public:
  std::string_view name() const override { return "cpu"; }
  // Bump when any CPU op's results change in their last bits.
  std::string_view numerics() const override { return kCpuNumerics; }

  kernels::OpStatus Linear(const kernels::LinearParams& p) const override {
    return kernels::cpu::Linear(p);
  }
  kernels::OpStatus RoundBf16(const kernels::RoundBf16Params& p) const override {
    return kernels::cpu::RoundBf16(p);
  }
  kernels::OpStatus RmsNorm(const kernels::RmsNormParams& p) const override {
    return kernels::cpu::RmsNorm(p);
  }
  kernels::OpStatus Rope(const kernels::RopeParams& p) const override {
    return kernels::cpu::Rope(p);
  }
  kernels::OpStatus FakeQuant(const kernels::FakeQuantParams& p) const override {
    return kernels::cpu::FakeQuant(p);
  }
  kernels::OpStatus Embed(const kernels::EmbedParams& p) const override {
    return kernels::cpu::Embed(p);
  }
  kernels::OpStatus HcMix(const kernels::HcMixParams& p) const override {
    return kernels::cpu::HcMix(p);
  }
  kernels::OpStatus HcCollapse(const kernels::HcCollapseParams& p) const override {
    return kernels::cpu::HcCollapse(p);
  }
  kernels::OpStatus HcExpand(const kernels::HcExpandParams& p) const override {
    return kernels::cpu::HcExpand(p);
  }
  kernels::OpStatus CompressPool(const kernels::CompressPoolParams& p) const override {
    return kernels::cpu::CompressPool(p);
  }
  kernels::OpStatus CompressWrite(const kernels::CompressWriteParams& p) const override {
    return kernels::cpu::CompressWrite(p);
  }
  kernels::OpStatus IndexerScores(const kernels::IndexerScoreParams& p) const override {
    return kernels::cpu::IndexerScores(p);
  }
  kernels::OpStatus TopK(const kernels::TopKParams& p) const override {
    return kernels::cpu::TopK(p);
  }
  kernels::OpStatus CandidateFilter(const kernels::CandidateFilterParams& p) const override {
    return kernels::cpu::CandidateFilter(p);
  }
  kernels::OpStatus SparseAttention(const kernels::SparseAttentionParams& p) const override {
    return kernels::cpu::SparseAttention(p);
  }
  kernels::OpStatus MoeRoute(const kernels::MoeRouteParams& p) const override {
    return kernels::cpu::MoeRoute(p);
  }
  kernels::OpStatus Swiglu(const kernels::SwigluParams& p) const override {
    return kernels::cpu::Swiglu(p);
  }
  kernels::OpStatus MoeCombine(const kernels::MoeCombineParams& p) const override {
    return kernels::cpu::MoeCombine(p);
  }
  kernels::OpStatus MoeGroup(const kernels::MoeGroupParams& p) const override {
    return kernels::cpu::MoeGroup(p);
  }
  kernels::OpStatus ExpertLinear(const kernels::ExpertLinearParams& p) const override {
    return kernels::cpu::ExpertLinear(p);
  }
  kernels::OpStatus AddRound(const kernels::AddRoundParams& p) const override {
    return kernels::cpu::AddRound(p);
  }
  kernels::OpStatus CopyRows(const kernels::CopyRowsParams& p) const override {
    return kernels::cpu::CopyRows(p);
  }
  kernels::OpStatus EngramGather(const kernels::EngramGatherParams& p) const override {
    return kernels::cpu::EngramGather(p);
  }
  kernels::OpStatus EngramGate(const kernels::EngramGateParams& p) const override {
    return kernels::cpu::EngramGate(p);
  }
};

}  // namespace flashd::engine
