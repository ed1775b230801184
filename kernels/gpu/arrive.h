// Thread blocks counting themselves in as they finish, for a kernel whose last block to finish
// makes a final step over every block's results (the mHC split, the experts' grouping).
#pragma once

#include "kernels/gpu/portability.h"

namespace flashd::kernels::FLASHD_GPU_BACKEND {

// Whether this thread block is the last of `blocks` to count itself in at *count; every thread
// gets the answer. Every thread's writes before the call are seen device-wide before its block
// counts itself in, and the last block's reads after it (volatile, for what other blocks wrote)
// see them. The last block clears *count when it is done with it. REQUIRES: every thread of the
// block calls it. (A template, so that it is inline wherever FLASHD_SHARED_TILE is empty.)
template <class Count = unsigned>
FLASHD_SHARED_TILE __device__ bool LastToArrive(Count* count, Count blocks) {
  __shared__ bool last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(count, Count{1}) == blocks - 1;
  __syncthreads();
  if (!last) return false;
  __threadfence();
  return true;
}

}  // namespace flashd::kernels::FLASHD_GPU_BACKEND
