// ParallelRanges: runs a function over [0, n) split into contiguous ranges on the process's
// thread pool.
#pragma once

#include <algorithm>
#include <cstddef>

#include "kernels/cpu/thread_pool.h"

namespace flashd::kernels::cpu {

// Runs fn(begin, end) over [0, n) split into at most `threads` contiguous ranges of at least
// `min_items` items each (the caller's thread alone when one range is enough), and returns when
// all are done. fn must write only what its range owns, so results never depend on the number
// of threads.
template <typename Fn>
void ParallelRanges(size_t n, int threads, Fn fn, size_t min_items = 1) {
  const size_t most = std::max<size_t>(1, n / std::max<size_t>(1, min_items));
  const size_t ranges = std::clamp<size_t>(threads, 1, std::min(most, std::max<size_t>(1, n)));
  if (ranges == 1) {
    fn(size_t{0}, n);
    return;
  }
  const size_t chunk = (n + ranges - 1) / ranges;
  struct Job {
    Fn* fn;
    size_t n, chunk;
  } job{&fn, n, chunk};
  const size_t count = (n + chunk - 1) / chunk;
  ThreadPool::Process().Run(
      count, count - 1,
      [](void* context, size_t i) {
        Job& j = *static_cast<Job*>(context);
        (*j.fn)(i * j.chunk, std::min(j.n, (i + 1) * j.chunk));
      },
      &job);
}

}  // namespace flashd::kernels::cpu
