// The first kernel compiled for both GPU backends from this one source.
#include "kernels/gpu/device.h"
#include "kernels/gpu/portability.h"

namespace flashd::kernels::FLASHD_GPU_BACKEND {
namespace {

__global__ void ScaleAddKernel(const float* x, float a, float b, float* y, size_t n) {
  size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) y[i] = a * x[i] + b;
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

std::string Synchronize() {
  const gpuError_t err = gpuDeviceSynchronize();
  return err == gpuSuccess ? "" : Describe("synchronize", err);
}

}  // namespace flashd::kernels::FLASHD_GPU_BACKEND
