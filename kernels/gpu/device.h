// Framework-free entry points of a GPU backend. The same declarations are compiled once per
// backend, into namespace flashd::kernels::cuda (libflashd_kernels_cuda) or
// flashd::kernels::hip (libflashd_kernels_hip). No device types leak into callers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#define FLASHD_GPU_STR2(x) #x
#define FLASHD_GPU_STR(x) FLASHD_GPU_STR2(x)

namespace flashd::kernels::FLASHD_GPU_BACKEND {

// This build's backend by name: "cuda", "hip" or "hipcpu".
inline constexpr std::string_view kBackendName = FLASHD_GPU_STR(FLASHD_GPU_BACKEND);

// Number of usable devices; 0 with `*reason` set when there are none or no driver.
int DeviceCount(std::string* reason);

// Copies x to the device, runs y = a * x + b there, copies y back. Returns "" or the error.
// A toolchain check: it proves that the backend compiles, links, launches and computes.
std::string ScaleAddRoundTrip(const float* x, float a, float b, float* y, size_t n);

// Stream order: `rounds` times, two kernels launched on one stream, the second reading what the
// first wrote, the host pausing from 0 up to `max_pause_us` microseconds between the launches
// (what a loaded host does); `*wrong` gets the rounds whose result was not the finished first
// kernel's. Returns "" or the runtime's error. A runtime that lets the second kernel start before
// the first has finished fails it.
std::string StreamOrderCheck(int rounds, int max_pause_us, int* wrong);

// Device memory for callers that include no GPU header (tests, the backend's host side). Each
// returns "" or the runtime's error. Copies are synchronous.
std::string DeviceAlloc(void** ptr, size_t bytes);
std::string DeviceFree(void* ptr);
std::string CopyToDevice(void* dst, const void* src, size_t bytes);
std::string CopyToHost(void* dst, const void* src, size_t bytes);
std::string CopyOnDevice(void* dst, const void* src, size_t bytes);
std::string ZeroOnDevice(void* dst, size_t bytes);  // Ordered after the kernels launched before.
std::string Synchronize();
// Pinned (page-locked) host memory, usable with every device: a copy from it can be queued.
std::string HostAlloc(void** ptr, size_t bytes);
std::string HostFree(void* ptr);
// A copy to the device queued on the stream the kernels run on, the host not waiting for it:
// it runs after the kernels launched before it and before those launched after. `src` must be
// pinned (HostAlloc) and stay as it is until the copy is done, which a Synchronize or a
// CopyToHost after it says. (The CPU runtime, whose stream does not keep its order, copies
// before it returns.)
std::string CopyToDeviceQueued(void* dst, const void* src, size_t bytes);
// Runs of bytes moved on the device by one kernel, ordered after the kernels launched before it:
// run i's `bytes` from src + from to `to`. `src` and `runs` [count] are device memory; the
// runs' targets must not overlap src or each other. What one upload of many small pieces, each
// for a place of its own, is spread by.
struct ByteRun {
  uint8_t* to;
  uint64_t from, bytes;
};
std::string ScatterOnDevice(const void* src, const ByteRun* runs, int64_t count);
// The reverse, what many small pieces come back to the host in one copy by: run i's `bytes`
// from `from` to dst + to, by one kernel ordered after the kernels launched before it. `dst` and
// `runs` [count] are device memory; the runs' targets must not overlap each other or a source.
struct ByteGather {
  const uint8_t* from;
  uint64_t to, bytes;
};
std::string GatherOnDevice(void* dst, const ByteGather* runs, int64_t count);
// Stream order of queued copies: `rounds` times, a kernel reads a buffer, a queued copy
// overwrites it from pinned memory, a second kernel reads it; `*wrong` gets the rounds where
// the first kernel did not see the old bytes or the second the new ones.
std::string QueuedCopyCheck(int rounds, int* wrong);
// Fill device memory without a host copy (benchmarks): bytes uniform in [lo, hi], or floats
// uniform in [-scale, scale] rounded to BF16; the same seed gives the same contents.
std::string FillBytes(void* dst, size_t bytes, uint64_t seed, uint8_t lo, uint8_t hi);
std::string FillFloats(float* dst, size_t n, uint64_t seed, float scale);
// Streams and graphs (benchmarks): a stream of the caller's own, and the kernels launched on it
// between CaptureBegin and CaptureEnd recorded, not run, as one graph that GraphLaunch replays
// on it. The CPU runtime has no graphs: CaptureBegin says so.
std::string StreamCreate(void** stream);
std::string StreamDestroy(void* stream);
std::string CaptureBegin(void* stream);
std::string CaptureEnd(void* stream, void** graph);  // `*graph`: ready to launch
std::string GraphLaunch(void* graph, void* stream);
std::string GraphDestroy(void* graph);
// Makes `device` the calling thread's current device.
std::string SetDevice(int device);
// The current device's name and its memory (free and total bytes), or the runtime's error.
std::string DeviceName(std::string* name);
std::string MemoryInfo(size_t* free_bytes, size_t* total_bytes);
// Kernels this process has launched on this backend since it started, on any of its devices.
uint64_t KernelLaunches();
// What `probe` (a kernel of one thread) writes on the current device: asked of the code the
// device runs (the machine code or PTX it loaded for this build's architectures), not of its
// compute capability. False where the launch or the copy fails.
bool AskDevice(void (*probe)(int*));
// Asks that kernels start early (portability.h's early_launch: each kernel's thread blocks
// resident, reading their weights, while the kernel ahead of it on its stream finishes) or not,
// for the whole process; returns whether they now do. It takes only where the current device's
// code waits at every kernel's FLASHD_GRID_BEGIN (NVIDIA, compiled for compute capability 9.0
// or up); elsewhere kernels start in turn.
bool SetEarlyLaunch(bool on);
bool EarlyLaunch();

}  // namespace flashd::kernels::FLASHD_GPU_BACKEND
