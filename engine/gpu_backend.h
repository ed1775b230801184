// Choosing the backend the forward pass runs on (engine.backend), and the GPU backends: the ops
// of kernels/gpu behind the Backend interface, compiled once per GPU runtime from
// engine/gpu_backend.cc (namespace cuda, hip or hipcpu, as the kernels are).
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include "config/status.h"
#include "engine/backend.h"

namespace flashd::engine {

// How a GPU backend computes (engine.gpu_gemms).
struct GpuOptions {
  // FP8 and FP4 linears on matrix cores (kernels/gpu/ops.h LinearMatrix) for every row count,
  // instead of the exact GEMMs whose sums are the CPU's. A row's results still do not depend on
  // the rows beside it, so a prompt gives the same tokens however it is batched or chunked.
  bool matrix_gemms = false;
  // Copies of up to 1 MiB to the device staged in pinned memory and queued behind the kernels.
  // False: every copy a plain one, which waits for the kernels before it (to measure the two).
  bool queued_uploads = true;
  // Device memory for the copies of the sequences' window rings kept from step to step; past it
  // the least recently used go, and a ring that finds no room is copied for its op alone.
  uint64_t ring_cache_bytes = uint64_t{512} << 20;
  // Each kernel started while the kernel ahead of it finishes, its weights on their way (NVIDIA's
  // programmatic dependent launch, where the device's code has it: compute capability 9.0 and
  // up; elsewhere kernels start in turn). The same bits either way; for the whole process.
  // False: every kernel starts when the one ahead has finished (to measure the two).
  bool early_launch = true;
};

namespace cuda {
StatusOr<std::unique_ptr<Backend>> MakeGpuBackend(int device = 0, const GpuOptions& options = {});
}
namespace hip {
StatusOr<std::unique_ptr<Backend>> MakeGpuBackend(int device = 0, const GpuOptions& options = {});
}
namespace hipcpu {
StatusOr<std::unique_ptr<Backend>> MakeGpuBackend(int device = 0, const GpuOptions& options = {});
}

// The backends this build has, e.g. "cpu+cuda+hipcpu".
std::string CompiledBackends();

// The backend named by engine.backend: "cpu", "cuda", "hip", "hipcpu" (the GPU kernels run on
// the CPU by the HIP CPU runtime, for checking them), or "auto": the first usable GPU (CUDA,
// then HIP), else the CPU. `reason` gets one line saying which was chosen and why. A named
// backend that this build lacks or that finds no device is an error. `device` picks one of
// several GPUs of the kind (auto and cpu ignore it); `gpu` applies to a GPU backend alone.
StatusOr<std::unique_ptr<Backend>> SelectBackend(std::string_view kind, std::string* reason,
                                                 int device = 0, const GpuOptions& gpu = {});

}  // namespace flashd::engine
