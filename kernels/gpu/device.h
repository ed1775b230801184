// Framework-free entry points of a GPU backend. The same declarations are compiled once per
// backend, into namespace flashd::kernels::cuda (libflashd_kernels_cuda) or
// flashd::kernels::hip (libflashd_kernels_hip). No device types leak into callers.
#pragma once

#include <cstddef>
#include <string>

namespace flashd::kernels::FLASHD_GPU_BACKEND {

// Number of usable devices; 0 with `*reason` set when there are none or no driver.
int DeviceCount(std::string* reason);

// Copies x to the device, runs y = a * x + b there, copies y back. Returns "" or the error.
// A toolchain check: it proves that the backend compiles, links, launches and computes.
std::string ScaleAddRoundTrip(const float* x, float a, float b, float* y, size_t n);

// Device memory for callers that include no GPU header (tests, the backend's host side). Each
// returns "" or the runtime's error. Copies are synchronous.
std::string DeviceAlloc(void** ptr, size_t bytes);
std::string DeviceFree(void* ptr);
std::string CopyToDevice(void* dst, const void* src, size_t bytes);
std::string CopyToHost(void* dst, const void* src, size_t bytes);
std::string Synchronize();

}  // namespace flashd::kernels::FLASHD_GPU_BACKEND
