// Top-k in the total order of select.h (value descending, then index ascending, NaN first) by a
// whole thread block: every thread of the block calls BlockSelectTop with the same arguments.
// Each (value, index) becomes a 64-bit key that orders as the total order does, all keys
// distinct; a radix select finds the k-th largest key 8 bits at a time (a shared histogram per
// pass), the keys at or above it are gathered, and each one's place is the number of gathered
// keys above it. Equal to SelectTop, in the same order; the work per thread is n / threads per
// pass and k^2 / threads to order, where SelectTop's one thread does k * n. For kernel sources
// only.
#pragma once

#include <cstdint>

#include "kernels/codecs.h"
#include "kernels/gpu/portability.h"
#include "kernels/gpu/select.h"

namespace flashd::kernels::gpu_select {

// Larger keys rank higher: NaN above everything, then the value (both zeros equal), then the
// lower index. REQUIRES: 0 <= i < 2^32.
FLASHD_OPS_HD inline uint64_t RankKey(float v, int64_t i) {
  uint32_t ordered = 0xFFFFFFFFu;
  if (v == v) {
    const uint32_t u = v == 0.0f ? 0u : codecs::Bits(v);
    ordered = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  }
  return (static_cast<uint64_t>(ordered) << 32) | (0xFFFFFFFFu - static_cast<uint32_t>(i));
}

// The most selected entries a thread orders: k may be up to kBlockSelectPerThread * threads.
constexpr int64_t kBlockSelectPerThread = 16;

// out[0, min(k, n)) = the indices of the min(k, n) best values of v[0, n), best first. Returns
// min(k, n). Every thread of the block must call it; out is complete for all of them on return.
template <unsigned kThreads>
__device__ int64_t BlockSelectTop(const float* v, int64_t n, int64_t k, int64_t* out) {
  __shared__ unsigned histogram[256];
  __shared__ uint64_t shared_prefix;
  __shared__ int64_t shared_remaining;
  __shared__ unsigned gathered;
  const unsigned t = threadIdx.x;
  k = k < n ? k : n;
  if (k <= 0) return 0;
  if (k > kBlockSelectPerThread * static_cast<int64_t>(kThreads)) {
    if (t == 0) SelectTop(v, n, k, out);  // Beyond what the threads can order: one thread.
    __syncthreads();
    return k;
  }
  // The k-th largest key, its bits from the top, 8 at a time.
  uint64_t prefix = 0, mask = 0;
  int64_t remaining = k;  // How many of the keys matching the prefix are still to be taken.
  if (k < n) {
    for (int shift = 56; shift >= 0; shift -= 8) {
      for (unsigned d = t; d < 256; d += kThreads) histogram[d] = 0;
      __syncthreads();
      for (int64_t j = t; j < n; j += kThreads) {
        const uint64_t key = RankKey(v[j], j);
        if ((key & mask) == prefix) atomicAdd(&histogram[(key >> shift) & 255], 1u);
      }
      __syncthreads();
      if (t == 0) {
        int64_t above = 0;
        int d = 255;
        for (; d > 0 && above + histogram[d] < remaining; --d) above += histogram[d];
        shared_prefix = prefix | (static_cast<uint64_t>(d) << shift);
        shared_remaining = remaining - above;
      }
      __syncthreads();
      prefix = shared_prefix;
      remaining = shared_remaining;
      mask |= uint64_t{255} << shift;
      __syncthreads();  // Everyone has read the pass's result before the next pass writes.
    }
  }
  const uint64_t threshold = k < n ? prefix : 0;  // Exactly k keys are >= it.
  if (t == 0) gathered = 0;
  __syncthreads();
  for (int64_t j = t; j < n; j += kThreads) {
    if (RankKey(v[j], j) >= threshold) out[atomicAdd(&gathered, 1u)] = j;
  }
  __syncthreads();
  // Each gathered key's place: the number of gathered keys above it.
  int64_t index[kBlockSelectPerThread], place[kBlockSelectPerThread];
  int mine = 0;
  for (int64_t c = t; c < k; c += kThreads, ++mine) {
    index[mine] = out[c];
    const uint64_t key = RankKey(v[index[mine]], index[mine]);
    int64_t above = 0;
    for (int64_t o = 0; o < k; ++o) above += RankKey(v[out[o]], out[o]) > key;
    place[mine] = above;
  }
  __syncthreads();
  for (int i = 0; i < mine; ++i) out[place[i]] = index[i];
  __syncthreads();
  return k;
}

}  // namespace flashd::kernels::gpu_select
