// engine.backend: which backends this build has (FLASHD_WITH_CUDA, FLASHD_WITH_HIP,
// FLASHD_WITH_HIPCPU from the build) and choosing one.
#include <memory>
#include <string>
#include <string_view>

#include "engine/backend.h"
#include "engine/gpu_backend.h"

namespace flashd::engine {
namespace {

// One GPU backend by name, or why not.
StatusOr<std::unique_ptr<Backend>> MakeNamed(std::string_view kind, int device,
                                             const GpuOptions& gpu) {
  (void)device;  // A build with the CPU backend alone has no use for them.
  (void)gpu;
#ifdef FLASHD_WITH_CUDA
  if (kind == "cuda") return cuda::MakeGpuBackend(device, gpu);
#endif
#ifdef FLASHD_WITH_HIP
  if (kind == "hip") return hip::MakeGpuBackend(device, gpu);
#endif
#ifdef FLASHD_WITH_HIPCPU
  if (kind == "hipcpu") return hipcpu::MakeGpuBackend(device, gpu);
#endif
  if (kind == "cuda" || kind == "hip" || kind == "hipcpu") {
    return Unavailable("this build of flashd has no " + std::string(kind) + " backend (it has " +
                       CompiledBackends() + ")");
  }
  return InvalidArgument("unknown backend \"" + std::string(kind) +
                         "\" (expected auto, cpu, cuda, hip or hipcpu)");
}

}  // namespace

std::string CompiledBackends() {
  std::string s = "cpu";
#ifdef FLASHD_WITH_CUDA
  s += "+cuda";
#endif
#ifdef FLASHD_WITH_HIP
  s += "+hip";
#endif
#ifdef FLASHD_WITH_HIPCPU
  s += "+hipcpu";
#endif
  return s;
}

StatusOr<std::unique_ptr<Backend>> SelectBackend(std::string_view kind, std::string* reason,
                                                 int device, const GpuOptions& gpu) {
  if (kind == "cpu") {
    *reason = "backend cpu: as configured";
    return std::unique_ptr<Backend>(std::make_unique<CpuBackend>());
  }
  if (kind != "auto") {
    auto backend = MakeNamed(kind, device, gpu);
    if (backend.ok()) {
      const BackendReport r = (*backend)->Report();
      *reason = "backend " + r.backend + ": as configured, on " + r.device;
    }
    return backend;
  }
  std::string why;
  for (std::string_view name : {"cuda", "hip"}) {
    auto backend = MakeNamed(name, 0, gpu);
    if (backend.ok()) {
      const BackendReport r = (*backend)->Report();
      *reason = "backend " + r.backend + " (auto): " + r.device;
      return backend;
    }
    why += (why.empty() ? "" : "; ") + backend.status().message();
  }
  *reason = "backend cpu (auto): no usable GPU (" + why + ")";
  return std::unique_ptr<Backend>(std::make_unique<CpuBackend>());
}

}  // namespace flashd::engine
