// The first kernel compiled for both GPU backends from this one source.
#include <algorithm>
#include <chrono>
#include <vector>

#include "kernels/codecs.h"
#include "kernels/gpu/device.h"
#include "kernels/gpu/portability.h"

namespace flashd::kernels::FLASHD_GPU_BACKEND {
namespace {

__global__ void ScaleAddKernel(const float* x, float a, float b, float* y, size_t n) {
  FLASHD_GRID_BEGIN();
  size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) y[i] = a * x[i] + b;
}

// A counter-based generator (splitmix64 of seed + index): any thread, any order, same bytes.
__device__ uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

__global__ void FillBytesKernel(uint8_t* dst, size_t n, uint64_t seed, uint8_t lo, uint8_t hi) {
  FLASHD_GRID_BEGIN();
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  const unsigned span = unsigned(hi) - lo + 1;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    dst[i] = static_cast<uint8_t>(lo + Mix(seed * 0x100000001b3ull + i) % span);
  }
}

__global__ void FillFloatsKernel(float* dst, size_t n, uint64_t seed, float scale) {
  FLASHD_GRID_BEGIN();
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const float u = static_cast<float>(Mix(seed * 0x100000001b3ull + i) >> 40) / 16777216.0f;
    dst[i] = codecs::RoundBf16((2.0f * u - 1.0f) * scale);
  }
}

// A thread block a run: its bytes, a thread each in turn.
__global__ void ScatterRunsKernel(const uint8_t* src, const ByteRun* runs) {
  FLASHD_GRID_BEGIN();
  const ByteRun r = runs[blockIdx.x];
  for (uint64_t i = threadIdx.x; i < r.bytes; i += blockDim.x) r.to[i] = src[r.from + i];
}

__global__ void GatherRunsKernel(uint8_t* dst, const ByteGather* runs) {
  FLASHD_GRID_BEGIN();
  const ByteGather r = runs[blockIdx.x];
  for (uint64_t i = threadIdx.x; i < r.bytes; i += blockDim.x) dst[r.to + i] = r.from[i];
}

// Stream order: the first kernel's values take a few hundred operations each, the second doubles
// them.
// What SlowStepKernel makes of a value: 64 dependent steps, on the device and for the checks.
FLASHD_OPS_HD inline float SlowStep(float v) {
  for (int k = 0; k < 64; ++k) v = v * 0.5f + 1.0f;
  return v;
}

__global__ void SlowStepKernel(const float* x, float* y, size_t n) {
  FLASHD_GRID_BEGIN();
  const size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) y[i] = SlowStep(x[i]);
}

__global__ void DoubleKernel(const float* y, float* z, size_t n) {
  FLASHD_GRID_BEGIN();
  const size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) z[i] = y[i] * 2.0f;
}

std::string Describe(const char* what, gpuError_t err) {
  return std::string(what) + ": " + gpuGetErrorString(err);
}

}  // namespace

int DeviceCount(std::string* reason) {
  int count = 0;
  gpuError_t err = gpuGetDeviceCount(&count);
  if (err != gpuSuccess) {
    // Without a driver the runtime reports an error code rather than zero devices.
    *reason = Describe("no usable GPU (device count query failed)", err);
    return 0;
  }
  if (count == 0) *reason = "no GPU device present";
  return count;
}

std::string ScaleAddRoundTrip(const float* x, float a, float b, float* y, size_t n) {
  if (n == 0) return "";
  float* dx = nullptr;
  float* dy = nullptr;
  std::string error;
  gpuError_t err = gpuMalloc(reinterpret_cast<void**>(&dx), n * sizeof(float));
  if (err == gpuSuccess) err = gpuMalloc(reinterpret_cast<void**>(&dy), n * sizeof(float));
  if (err != gpuSuccess) error = Describe("malloc", err);
  if (error.empty()) {
    err = gpuMemcpy(dx, x, n * sizeof(float), gpuMemcpyHostToDevice);
    if (err != gpuSuccess) error = Describe("copy to device", err);
  }
  if (error.empty()) {
    const unsigned threads = 256;
    const unsigned blocks = static_cast<unsigned>((n + threads - 1) / threads);
    FLASHD_LAUNCH(ScaleAddKernel, blocks, threads, 0, nullptr, dx, a, b, dy, n);
    err = gpuGetLastError();
    if (err != gpuSuccess) error = Describe("launch", err);
  }
  if (error.empty()) {
    err = gpuMemcpy(y, dy, n * sizeof(float), gpuMemcpyDeviceToHost);
    if (err != gpuSuccess) error = Describe("copy to host", err);
  }
  for (float* p : {dx, dy}) {
    if (p == nullptr) continue;
    gpuError_t free_err = gpuFree(p);
    if (free_err != gpuSuccess && error.empty()) error = Describe("free", free_err);
  }
  return error;
}

std::string StreamOrderCheck(int rounds, int max_pause_us, int* wrong) {
  *wrong = 0;
  constexpr size_t n = size_t{1} << 16;
  constexpr unsigned threads = 256, blocks = n / threads;
  std::vector<float> x(n), z(n);
  const std::vector<float> zeros(n, 0.0f);
  float* d[3] = {nullptr, nullptr, nullptr};
  std::string error;
  for (float*& p : d) {
    if (error.empty()) error = DeviceAlloc(reinterpret_cast<void**>(&p), n * sizeof(float));
  }
  for (int r = 0; r < rounds && error.empty(); ++r) {
    // The first kernel's output (d[1]) holds zeros before it runs: v * 0.5 + 1 from x >= 0 is
    // never 0, so a second kernel that ran early reads a 0 (or a half-written row) and differs.
    for (size_t i = 0; i < n; ++i) x[i] = static_cast<float>((i + static_cast<size_t>(r)) % 1000);
    error = CopyToDevice(d[0], x.data(), n * sizeof(float));
    if (error.empty()) error = CopyToDevice(d[1], zeros.data(), n * sizeof(float));
    if (!error.empty()) break;
    FLASHD_LAUNCH(SlowStepKernel, blocks, threads, 0, nullptr, d[0], d[1], n);
    const auto pause = std::chrono::microseconds(max_pause_us > 0 ? r % (max_pause_us + 1) : 0);
    const auto start = std::chrono::steady_clock::now();
    while (std::chrono::steady_clock::now() - start < pause) {
    }
    FLASHD_LAUNCH(DoubleKernel, blocks, threads, 0, nullptr, d[1], d[2], n);
    const gpuError_t err = gpuGetLastError();
    if (err != gpuSuccess) error = Describe("launch", err);
    if (error.empty()) error = Synchronize();
    if (error.empty()) error = CopyToHost(z.data(), d[2], n * sizeof(float));
    if (!error.empty()) break;
    for (size_t i = 0; i < n; ++i) {
      if (z[i] != SlowStep(x[i]) * 2.0f) {
        ++*wrong;
        break;
      }
    }
  }
  for (float* p : d) {
    if (p != nullptr) (void)DeviceFree(p);
  }
  return error;
}

std::string QueuedCopyCheck(int rounds, int* wrong) {
  *wrong = 0;
  constexpr size_t n = size_t{1} << 16;
  constexpr unsigned threads = 256, blocks = n / threads;
  std::vector<float> before(n), after(n), z(n);
  float* d[3] = {nullptr, nullptr, nullptr};
  float* pinned = nullptr;
  std::string error = HostAlloc(reinterpret_cast<void**>(&pinned), n * sizeof(float));
  for (float*& p : d) {
    if (error.empty()) error = DeviceAlloc(reinterpret_cast<void**>(&p), n * sizeof(float));
  }
  for (int r = 0; r < rounds && error.empty(); ++r) {
    for (size_t i = 0; i < n; ++i) {
      before[i] = static_cast<float>((i + static_cast<size_t>(r)) % 1000);
      after[i] = static_cast<float>((i * 7 + static_cast<size_t>(r)) % 1000 + 1000);
    }
    std::copy(after.begin(), after.end(), pinned);
    error = CopyToDevice(d[0], before.data(), n * sizeof(float));
    if (!error.empty()) break;
    FLASHD_LAUNCH(SlowStepKernel, blocks, threads, 0, nullptr, d[0], d[1], n);
    error = CopyToDeviceQueued(d[0], pinned, n * sizeof(float));
    if (!error.empty()) break;
    FLASHD_LAUNCH(SlowStepKernel, blocks, threads, 0, nullptr, d[0], d[2], n);
    const gpuError_t err = gpuGetLastError();
    if (err != gpuSuccess) error = Describe("launch", err);
    if (error.empty()) error = Synchronize();
    for (int which = 1; which <= 2 && error.empty(); ++which) {
      error = CopyToHost(z.data(), d[which], n * sizeof(float));
      const std::vector<float>& x = which == 1 ? before : after;
      for (size_t i = 0; i < n && error.empty(); ++i) {
        if (z[i] != SlowStep(x[i])) {
          ++*wrong;
          break;
        }
      }
    }
  }
  for (float* p : d) {
    if (p != nullptr) (void)DeviceFree(p);
  }
  if (pinned != nullptr) (void)HostFree(pinned);
  return error;
}

std::string DeviceAlloc(void** ptr, size_t bytes) {
  const gpuError_t err = gpuMalloc(ptr, bytes);
  return err == gpuSuccess ? "" : Describe("malloc", err);
}

std::string DeviceFree(void* ptr) {
  const gpuError_t err = gpuFree(ptr);
  return err == gpuSuccess ? "" : Describe("free", err);
}

std::string CopyToDevice(void* dst, const void* src, size_t bytes) {
  const gpuError_t err = gpuMemcpy(dst, src, bytes, gpuMemcpyHostToDevice);
  return err == gpuSuccess ? "" : Describe("copy to device", err);
}

std::string CopyToHost(void* dst, const void* src, size_t bytes) {
  const gpuError_t err = gpuMemcpy(dst, src, bytes, gpuMemcpyDeviceToHost);
  return err == gpuSuccess ? "" : Describe("copy to host", err);
}

std::string HostAlloc(void** ptr, size_t bytes) {
  const gpuError_t err = gpuHostAllocPortable(ptr, bytes);
  return err == gpuSuccess ? "" : Describe("pinned host alloc", err);
}

std::string HostFree(void* ptr) {
  const gpuError_t err = gpuFreeHost(ptr);
  return err == gpuSuccess ? "" : Describe("pinned host free", err);
}

std::string CopyToDeviceQueued(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return "";
#if defined(FLASHD_HIP_CPU)
  const gpuError_t err = gpuMemcpy(dst, src, bytes, gpuMemcpyHostToDevice);
#else
  const gpuError_t err = gpuMemcpyAsync(dst, src, bytes, gpuMemcpyHostToDevice, nullptr);
#endif
  return err == gpuSuccess ? "" : Describe("queued copy to device", err);
}

std::string CopyOnDevice(void* dst, const void* src, size_t bytes) {
  const gpuError_t err = gpuMemcpy(dst, src, bytes, gpuMemcpyDeviceToDevice);
  return err == gpuSuccess ? "" : Describe("copy on device", err);
}

std::string ZeroOnDevice(void* dst, size_t bytes) {
  if (bytes == 0) return "";
  const gpuError_t err = gpuMemset(dst, 0, bytes);
  return err == gpuSuccess ? "" : Describe("clear on device", err);
}

std::string ScatterOnDevice(const void* src, const ByteRun* runs, int64_t count) {
  if (count <= 0) return "";
  if (count > int64_t{0x7FFFFFFF}) return "scatter on device: more runs than a grid holds";
  FLASHD_LAUNCH(ScatterRunsKernel, static_cast<unsigned>(count), 256, 0, nullptr,
                static_cast<const uint8_t*>(src), runs);
  const gpuError_t err = gpuGetLastError();
  return err == gpuSuccess ? "" : Describe("scatter on device", err);
}

std::string GatherOnDevice(void* dst, const ByteGather* runs, int64_t count) {
  if (count <= 0) return "";
  if (count > int64_t{0x7FFFFFFF}) return "gather on device: more runs than a grid holds";
  FLASHD_LAUNCH(GatherRunsKernel, static_cast<unsigned>(count), 256, 0, nullptr,
                static_cast<uint8_t*>(dst), runs);
  const gpuError_t err = gpuGetLastError();
  return err == gpuSuccess ? "" : Describe("gather on device", err);
}

std::string FillBytes(void* dst, size_t bytes, uint64_t seed, uint8_t lo, uint8_t hi) {
  if (bytes == 0) return "";
  const unsigned threads = 256;
  const unsigned blocks =
      static_cast<unsigned>(std::min<size_t>((bytes + threads - 1) / threads, size_t{1} << 20));
  FLASHD_LAUNCH(FillBytesKernel, blocks, threads, 0, nullptr, static_cast<uint8_t*>(dst), bytes,
                seed, lo, hi);
  const gpuError_t err = gpuGetLastError();
  return err == gpuSuccess ? "" : Describe("fill", err);
}

std::string FillFloats(float* dst, size_t n, uint64_t seed, float scale) {
  if (n == 0) return "";
  const unsigned threads = 256;
  const unsigned blocks =
      static_cast<unsigned>(std::min<size_t>((n + threads - 1) / threads, size_t{1} << 20));
  FLASHD_LAUNCH(FillFloatsKernel, blocks, threads, 0, nullptr, dst, n, seed, scale);
  const gpuError_t err = gpuGetLastError();
  return err == gpuSuccess ? "" : Describe("fill", err);
}

std::string Synchronize() {
  const gpuError_t err = gpuDeviceSynchronize();
  return err == gpuSuccess ? "" : Describe("synchronize", err);
}

std::string StreamCreate(void** stream) {
  gpuStream_t s = nullptr;
  const gpuError_t err = gpuStreamCreate(&s);
  *stream = s;
  return err == gpuSuccess ? "" : Describe("stream create", err);
}

std::string StreamDestroy(void* stream) {
  const gpuError_t err = gpuStreamDestroy(static_cast<gpuStream_t>(stream));
  return err == gpuSuccess ? "" : Describe("stream destroy", err);
}

#if defined(FLASHD_HIP_CPU)
std::string CaptureBegin(void*) { return "graphs: the HIP CPU runtime has none"; }
std::string CaptureEnd(void*, void**) { return "graphs: the HIP CPU runtime has none"; }
std::string GraphLaunch(void*, void*) { return "graphs: the HIP CPU runtime has none"; }
std::string GraphDestroy(void*) { return ""; }
#else
std::string CaptureBegin(void* stream) {
  const gpuError_t err =
      gpuStreamBeginCapture(static_cast<gpuStream_t>(stream), gpuStreamCaptureModeThreadLocal);
  return err == gpuSuccess ? "" : Describe("begin capture", err);
}

std::string CaptureEnd(void* stream, void** graph) {
  gpuGraph_t g = nullptr;
  gpuError_t err = gpuStreamEndCapture(static_cast<gpuStream_t>(stream), &g);
  if (err != gpuSuccess) return Describe("end capture", err);
  gpuGraphExec_t exec = nullptr;
  err = gpuGraphInstantiate(&exec, g, 0);
  (void)gpuGraphDestroy(g);
  *graph = exec;
  return err == gpuSuccess ? "" : Describe("graph instantiate", err);
}

std::string GraphLaunch(void* graph, void* stream) {
  const gpuError_t err =
      gpuGraphLaunch(static_cast<gpuGraphExec_t>(graph), static_cast<gpuStream_t>(stream));
  return err == gpuSuccess ? "" : Describe("graph launch", err);
}

std::string GraphDestroy(void* graph) {
  const gpuError_t err = gpuGraphExecDestroy(static_cast<gpuGraphExec_t>(graph));
  return err == gpuSuccess ? "" : Describe("graph destroy", err);
}
#endif

uint64_t KernelLaunches() { return launched_kernels.load(std::memory_order_relaxed); }

bool AskDevice(void (*probe)(int*)) {
  int* flag = nullptr;
  if (gpuMalloc(reinterpret_cast<void**>(&flag), sizeof(int)) != gpuSuccess) return false;
  int native = 0;
  FLASHD_LAUNCH(probe, 1, 1, 0, nullptr, flag);
  const bool ok = gpuGetLastError() == gpuSuccess &&
                  gpuMemcpy(&native, flag, sizeof(int), gpuMemcpyDeviceToHost) == gpuSuccess;
  (void)gpuFree(flag);
  return ok && native == 1;
}

namespace {

// 1 where this code's FLASHD_GRID_BEGIN waits for the kernels ahead.
__global__ void GridWaitKernel(int* waits) {
  FLASHD_GRID_BEGIN();
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && !defined(__HIPCC__)
  *waits = 1;
#else
  *waits = 0;
#endif
}

}  // namespace

bool SetEarlyLaunch(bool on) {
  // The probe itself starts in turn.
  early_launch.store(false, std::memory_order_relaxed);
  on = on && AskDevice(GridWaitKernel);
  early_launch.store(on, std::memory_order_relaxed);
  return on;
}

bool EarlyLaunch() { return early_launch.load(std::memory_order_relaxed); }

std::string SetDevice(int device) {
  const gpuError_t err = gpuSetDevice(device);
  return err == gpuSuccess ? "" : Describe("set device", err);
}

std::string DeviceName(std::string* name) {
  int device = 0;
  gpuError_t err = gpuGetDevice(&device);
  gpuDeviceProp_t props{};
  if (err == gpuSuccess) err = gpuGetDeviceProperties(&props, device);
  if (err != gpuSuccess) return Describe("device properties", err);
  *name = props.name;
  return "";
}

std::string MemoryInfo(size_t* free_bytes, size_t* total_bytes) {
  const gpuError_t err = gpuMemGetInfo(free_bytes, total_bytes);
  return err == gpuSuccess ? "" : Describe("memory info", err);
}

}  // namespace flashd::kernels::FLASHD_GPU_BACKEND
