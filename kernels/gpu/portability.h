// One kernel source for NVIDIA (nvcc) and AMD (hipcc / clang -x hip): this header maps the few
// runtime names the kernels use onto CUDA or HIP. Test __HIPCC__, which the HIP compiler defines
// before any header; __HIP_PLATFORM_AMD__ only appears after a HIP header is included.
#pragma once

// The build names the backend (cuda or hip): it is the namespace of the compiled entry points.
#ifndef FLASHD_GPU_BACKEND
#error "FLASHD_GPU_BACKEND must be defined by the build (cuda or hip)"
#endif

#if defined(__HIPCC__)
#include <hip/hip_runtime.h>
using gpuError_t = hipError_t;
using gpuStream_t = hipStream_t;
#define gpuSuccess hipSuccess
#define gpuGetDeviceCount hipGetDeviceCount
#define gpuGetErrorString hipGetErrorString
#define gpuGetLastError hipGetLastError
#define gpuMalloc hipMalloc
#define gpuFree hipFree
#define gpuMemcpy hipMemcpy
#define gpuMemcpyHostToDevice hipMemcpyHostToDevice
#define gpuMemcpyDeviceToHost hipMemcpyDeviceToHost
#define gpuStreamSynchronize hipStreamSynchronize
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
#define gpuMemcpyHostToDevice cudaMemcpyHostToDevice
#define gpuMemcpyDeviceToHost cudaMemcpyDeviceToHost
#define gpuStreamSynchronize cudaStreamSynchronize
#endif
