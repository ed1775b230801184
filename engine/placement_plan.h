// The placement plan: where each part of a model goes on a machine (its GPUs, host memory), and
// how much KV fits, from the config alone. `flashd plan` prints it for any machine; the numbers
// are arithmetic over the tensors the config implies, as stored (docs/deploy.md).
//
// What goes where, in order of preference:
//  1. every layer on the GPUs, whole layers split in order across them (only the residual
//     streams cross a device boundary), the embedding on the first, the head on the last;
//  2. if the layers do not fit: the hybrid mode, the routed experts in host memory run by the
//     CPU while attention and the dense parts stay on the GPUs;
//  3. without GPUs, everything in host memory on the CPU.
// The Engram tables stay in host memory (a step's rows are known from its tokens), or, with
// PlanOptions::engram_ssd_cache_bytes, on SSD with only their cache of hot rows in memory
// (engine.engram: ssd, engine/engram_store.h); a plan whose tables do not fit is refused with
// the numbers. KV lives with the layers that produce it, in the memory left.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "config/status.h"
#include "engine/model_config.h"

namespace flashd::engine {

struct GpuSpec {
  std::string name;  // "H200", or "96GiB" for a size given directly.
  uint64_t memory_bytes = 0;
};

// "8xH200", "4xMI300X", "H100", "2x80GiB", "none" (no GPU). Known: A100, H100, H200, B200,
// MI250X, MI300X, MI325X (their memory as sold).
StatusOr<std::vector<GpuSpec>> ParseGpus(std::string_view text);

struct PlanOptions {
  std::vector<GpuSpec> gpus;
  uint64_t host_ram_bytes = 0;
  // Kept free on each GPU for workspace, activations and the runtime, and in host memory for
  // the operating system and the daemon.
  uint64_t gpu_reserve_bytes = uint64_t{6} << 30;
  uint64_t host_reserve_bytes = uint64_t{16} << 30;
  int64_t context_tokens = 131072;  // The context the "sequences" figure is for.
  // The Engram tables on SSD with a hot-row cache of this many bytes in host memory; -1: the
  // tables in host memory.
  int64_t engram_ssd_cache_bytes = -1;
};

struct PlacementPlan {
  enum class Mode { kGpu, kHybrid, kCpu };
  Mode mode = Mode::kCpu;
  bool fits = false;
  std::string why_not;  // When it does not fit: which memory, by how much.

  std::vector<int> layer_gpu;  // Per layer: its GPU, or -1 (the CPU).
  struct Device {
    std::string name;
    uint64_t memory = 0, weights = 0, kv = 0, reserve = 0;
    double kv_per_token = 0;  // KV bytes per token of the layers it holds.
  };
  std::vector<Device> gpus;        // Weights, KV (the bytes the plan gives it) per GPU.
  uint64_t host_weights = 0;       // Routed experts (hybrid) or everything (CPU), Engram excluded.
  uint64_t engram_bytes = 0;       // The Engram tables.
  uint64_t engram_host_bytes = 0;  // Of Engram, in host memory: the tables, or on SSD their cache.
  bool engram_on_ssd = false;
  uint64_t host_copies = 0;  // With GPUs: the forward pass's fp32 copies of BF16 matrices.
  uint64_t host_kv = 0;      // KV in host memory (CPU mode).
  uint64_t host_memory = 0, host_reserve = 0;
  uint64_t dense_bytes = 0, expert_bytes = 0;  // Over all layers, as stored.
  int64_t kv_tokens = 0;  // Tokens of KV the plan holds (all sequences together).
  int64_t sequences = 0;  // Of PlanOptions::context_tokens each.
  double kv_bytes_per_token = 0;
};

PlacementPlan MakePlan(const ModelConfig& config, const PlanOptions& options);

// The plan as text (flashd plan) and as JSON (--json, /health).
std::string DescribePlan(const PlacementPlan& plan, const PlanOptions& options);
std::string PlanJson(const PlacementPlan& plan);

}  // namespace flashd::engine
