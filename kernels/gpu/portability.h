// One kernel source for NVIDIA (nvcc), AMD (hipcc / clang -x hip) and the HIP CPU runtime (g++,
// for testing kernels' logic on machines without a GPU): this header maps the few runtime names
// the kernels use onto CUDA or HIP. Test __HIPCC__, which the HIP compiler defines before any
// header; __HIP_PLATFORM_AMD__ only appears after a HIP header is included. The CPU runtime
// build defines FLASHD_HIP_CPU.
//
// Kernels never assume a warp size (read warpSize: 32 on NVIDIA, 64 on AMD and in the CPU
// runtime) and launch through FLASHD_LAUNCH, because g++ cannot parse <<<>>>.
#pragma once

// The build names the backend (cuda, hip or hipcpu): it is the namespace of the compiled entry
// points.
#ifndef FLASHD_GPU_BACKEND
#error "FLASHD_GPU_BACKEND must be defined by the build (cuda, hip or hipcpu)"
#endif

#include <atomic>
#include <cstdint>

namespace flashd::kernels::FLASHD_GPU_BACKEND {
// Kernels this process has launched on this backend (every FLASHD_LAUNCH, on any of its
// devices); ops.h's KernelLaunches reads it.
inline std::atomic<uint64_t> launched_kernels{0};
}  // namespace flashd::kernels::FLASHD_GPU_BACKEND
#define FLASHD_COUNT_LAUNCH() \
  ::flashd::kernels::FLASHD_GPU_BACKEND::launched_kernels.fetch_add(1, std::memory_order_relaxed)

namespace flashd::kernels::FLASHD_GPU_BACKEND {
// Whether FLASHD_LAUNCH lets each kernel start before the kernel ahead of it on its stream has
// finished (NVIDIA's programmatic dependent launch, compute capability 9.0 and up; elsewhere it
// changes nothing): the kernel's thread blocks become resident and read what no kernel writes
// (their weights) while the kernel ahead finishes, and wait for it at FLASHD_GRID_BEGIN.
// Process-wide; the GPU backend sets it (GpuOptions::early_launch).
inline std::atomic<bool> early_launch{false};
}  // namespace flashd::kernels::FLASHD_GPU_BACKEND

#if defined(__HIPCC__) || defined(FLASHD_HIP_CPU)
#include <hip/hip_runtime.h>
#if defined(FLASHD_HIP_CPU) && defined(__GNUC__) && !defined(__clang__)
// The CPU runtime asks g++ for SIMD clones of every kernel, which a kernel taking a params struct
// cannot have (g++ warns); the tests need the plain function only.
#undef __global__
#define __global__ __attribute__((flatten))
#endif
using gpuError_t = hipError_t;
using gpuStream_t = hipStream_t;
#define gpuSuccess hipSuccess
#define gpuGetDeviceCount hipGetDeviceCount
#define gpuGetErrorString hipGetErrorString
#define gpuGetLastError hipGetLastError
#define gpuMalloc hipMalloc
#define gpuFree hipFree
#define gpuMemcpy hipMemcpy
#define gpuMemset hipMemset
#define gpuMemcpyHostToDevice hipMemcpyHostToDevice
#define gpuMemcpyDeviceToHost hipMemcpyDeviceToHost
#define gpuMemcpyDeviceToDevice hipMemcpyDeviceToDevice
#define gpuStreamSynchronize hipStreamSynchronize
#define gpuDeviceSynchronize hipDeviceSynchronize
#define gpuGetDevice hipGetDevice
#define gpuSetDevice hipSetDevice
#define gpuGetDeviceProperties hipGetDeviceProperties
#define gpuMemGetInfo hipMemGetInfo
#define gpuStreamCreate hipStreamCreate
#define gpuStreamDestroy hipStreamDestroy
#define gpuMemcpyAsync hipMemcpyAsync
#define gpuHostAllocPortable(ptr, bytes) hipHostMalloc(ptr, bytes, hipHostMallocPortable)
#define gpuFreeHost hipHostFree
using gpuDeviceProp_t = hipDeviceProp_t;
#if !defined(FLASHD_HIP_CPU)
using gpuGraph_t = hipGraph_t;
using gpuGraphExec_t = hipGraphExec_t;
#define gpuStreamBeginCapture hipStreamBeginCapture
#define gpuStreamCaptureModeThreadLocal hipStreamCaptureModeThreadLocal
#define gpuStreamEndCapture hipStreamEndCapture
#define gpuGraphInstantiate hipGraphInstantiateWithFlags
#define gpuGraphLaunch hipGraphLaunch
#define gpuGraphDestroy hipGraphDestroy
#define gpuGraphExecDestroy hipGraphExecDestroy
#endif
#if defined(FLASHD_HIP_CPU)
// The CPU runtime does not keep one stream's kernels in order: its processor thread drains the
// null stream from two executors in one pass (the null stream is also in its list of streams),
// so a kernel launched while the previous one is being picked up can run beside it and read its
// output half written (a host slowed between two launches makes it likely; StreamOrderCheck shows
// it). Here each launch waits for its kernel (a device synchronisation, which that thread runs
// after the pass in progress), so the stream never holds two kernels.
#define FLASHD_LAUNCH(kernel, grid, block, shared, stream, ...)                       \
  do {                                                                                \
    FLASHD_COUNT_LAUNCH();                                                            \
    hipLaunchKernelGGL(kernel, dim3(grid), dim3(block), shared, stream, __VA_ARGS__); \
    (void)hipDeviceSynchronize();                                                     \
  } while (0)
#else
#define FLASHD_LAUNCH(kernel, grid, block, shared, stream, ...)                       \
  do {                                                                                \
    FLASHD_COUNT_LAUNCH();                                                            \
    hipLaunchKernelGGL(kernel, dim3(grid), dim3(block), shared, stream, __VA_ARGS__); \
  } while (0)
#endif
#else
#include <cuda_runtime.h>
using gpuError_t = cudaError_t;
using gpuStream_t = cudaStream_t;
#define gpuSuccess cudaSuccess
#define gpuGetDeviceCount cudaGetDeviceCount
#define gpuGetErrorString cudaGetErrorString
#define gpuGetLastError cudaGetLastError
#define gpuMalloc cudaMalloc
#define gpuFree cudaFree
#define gpuMemcpy cudaMemcpy
#define gpuMemset cudaMemset
#define gpuMemcpyHostToDevice cudaMemcpyHostToDevice
#define gpuMemcpyDeviceToHost cudaMemcpyDeviceToHost
#define gpuMemcpyDeviceToDevice cudaMemcpyDeviceToDevice
#define gpuStreamSynchronize cudaStreamSynchronize
#define gpuDeviceSynchronize cudaDeviceSynchronize
#define gpuGetDevice cudaGetDevice
#define gpuSetDevice cudaSetDevice
#define gpuGetDeviceProperties cudaGetDeviceProperties
#define gpuMemGetInfo cudaMemGetInfo
#define gpuStreamCreate cudaStreamCreate
#define gpuStreamDestroy cudaStreamDestroy
#define gpuMemcpyAsync cudaMemcpyAsync
#define gpuHostAllocPortable(ptr, bytes) cudaHostAlloc(ptr, bytes, cudaHostAllocPortable)
#define gpuFreeHost cudaFreeHost
using gpuDeviceProp_t = cudaDeviceProp;
using gpuGraph_t = cudaGraph_t;
using gpuGraphExec_t = cudaGraphExec_t;
#define gpuStreamBeginCapture cudaStreamBeginCapture
#define gpuStreamCaptureModeThreadLocal cudaStreamCaptureModeThreadLocal
#define gpuStreamEndCapture cudaStreamEndCapture
#define gpuGraphInstantiate cudaGraphInstantiate
#define gpuGraphLaunch cudaGraphLaunch
#define gpuGraphDestroy cudaGraphDestroy
#define gpuGraphExecDestroy cudaGraphExecDestroy
#include <utility>
namespace flashd::kernels::FLASHD_GPU_BACKEND {
// `kernel` launched as a programmatic dependent of the kernel ahead of it on `stream`.
template <class... Params, class... Args>
inline void LaunchEarly(void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared,
                        cudaStream_t stream, Args&&... args) {
  cudaLaunchAttribute attribute[1] = {};
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = shared;
  config.stream = stream;
  config.attrs = attribute;
  config.numAttrs = 1;
  (void)cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);  // As gpuGetLastError.
}
}  // namespace flashd::kernels::FLASHD_GPU_BACKEND
#define FLASHD_LAUNCH(kernel, grid, block, shared, stream, ...)                                   \
  do {                                                                                            \
    FLASHD_COUNT_LAUNCH();                                                                        \
    if (::flashd::kernels::FLASHD_GPU_BACKEND::early_launch.load(std::memory_order_relaxed)) {    \
      ::flashd::kernels::FLASHD_GPU_BACKEND::LaunchEarly(kernel, dim3(grid), dim3(block), shared, \
                                                         stream, __VA_ARGS__);                    \
    } else {                                                                                      \
      kernel<<<grid, block, shared, stream>>>(__VA_ARGS__);                                       \
    }                                                                                             \
  } while (0)
#endif

// The first statement of every kernel (after its shared declarations, the indices it computes
// from its arguments and PrefetchL2 of its weights, none of which reads or writes what a kernel
// writes): waits for the kernels ahead of it on its stream to finish and their writes to be
// visible, then lets the next kernel start (early_launch). Nothing where kernels do not start
// early. tests/gpu/check-grid-begin.py holds every kernel to it.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && !defined(__HIPCC__)
#define FLASHD_GRID_BEGIN() \
  asm volatile("griddepcontrol.wait;\n\tgriddepcontrol.launch_dependents;" ::: "memory")
#else
#define FLASHD_GRID_BEGIN() ((void)0)
#endif

// Asks the L2 cache for bytes [p, p + bytes), the thread block's threads taking its 128-byte
// lines in turn: for a kernel's weights, before FLASHD_GRID_BEGIN, so that they are on their way
// while the kernel ahead finishes. Nothing where there is no such instruction.
#if defined(__CUDA_ARCH__) && !defined(__HIPCC__)
__device__ inline void PrefetchL2(const void* p, int64_t bytes) {
  const char* at = static_cast<const char*>(p);
  for (int64_t i = static_cast<int64_t>(threadIdx.x) * 128; i < bytes;
       i += static_cast<int64_t>(blockDim.x) * 128) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(at + i));
  }
}
#else
__device__ inline void PrefetchL2(const void*, int64_t) {}
#endif

// Dynamic shared memory (the launch's `shared` bytes) as `type* name`, 16-byte aligned. One
// declaration per kernel.
#if defined(FLASHD_HIP_CPU)
#define FLASHD_DYNAMIC_SHARED(type, name) \
  HIP_DYNAMIC_SHARED(float4, name##_raw)  \
  type* name = reinterpret_cast<type*>(name##_raw)
#else
#define FLASHD_DYNAMIC_SHARED(type, name)            \
  extern __shared__ float4 flashd_dynamic_shared_[]; \
  type* name = reinterpret_cast<type*>(flashd_dynamic_shared_)
#endif

// Lets `kernel` take `bytes` (over 48 KB) of dynamic shared memory: a gpuError_t.
#if defined(FLASHD_HIP_CPU)
#define FLASHD_ALLOW_SHARED(kernel, bytes) gpuSuccess
#elif defined(__HIPCC__)
#define FLASHD_ALLOW_SHARED(kernel, bytes)                   \
  hipFuncSetAttribute(reinterpret_cast<const void*>(kernel), \
                      hipFuncAttributeMaxDynamicSharedMemorySize, (bytes))
#else
#define FLASHD_ALLOW_SHARED(kernel, bytes) \
  cudaFuncSetAttribute((kernel), cudaFuncAttributeMaxDynamicSharedMemorySize, (bytes))
#endif
// a * b + c where the product a * b is exact (it needs no rounding): one fused instruction on a
// GPU (the builds turn off contraction elsewhere), which then rounds as the CPU's separate
// multiply and add do; the CPU runtime writes them apart.
#if defined(FLASHD_HIP_CPU)
#define FLASHD_EXACT_FMA(a, b, c) ((a) * (b) + (c))
#else
#define FLASHD_EXACT_FMA(a, b, c) fmaf((a), (b), (c))
#endif

// Before a device function that declares __shared__ arrays and is called from more than one
// kernel: inlined into each on AMD, where clang (LLVM 15) otherwise gives every kernel that calls
// such a function the shared memory of all of them in the file together (over the 64 KB a block).
#if defined(__HIPCC__) && !defined(FLASHD_HIP_CPU)
#define FLASHD_SHARED_TILE __forceinline__
#else
#define FLASHD_SHARED_TILE
#endif

// Before a loop of a known trip count: unrolled, so that register arrays it indexes stay in
// registers (a run-time index puts them in local memory).
#if defined(FLASHD_HIP_CPU) && defined(__GNUC__) && !defined(__clang__)
#define FLASHD_UNROLL _Pragma("GCC unroll 32")
#else
#define FLASHD_UNROLL _Pragma("unroll")
#endif
