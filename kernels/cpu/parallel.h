// ParallelRanges: runs a function over [0, n) split into contiguous ranges on threads.
#pragma once

#include <algorithm>
#include <cstddef>
#include <thread>
#include <vector>

namespace flashd::kernels::cpu {

// Runs fn(begin, end) over [0, n) split into at most `threads` contiguous ranges, each on its own
// thread (the caller's alone when one range is enough), and returns when all are done. fn must
// write only what its range owns, so results never depend on the number of threads.
template <typename Fn>
void ParallelRanges(size_t n, int threads, Fn fn) {
  const size_t workers = std::clamp<size_t>(threads, 1, std::max<size_t>(1, n));
  if (workers == 1) {
    fn(size_t{0}, n);
    return;
  }
  std::vector<std::thread> pool;
  const size_t chunk = (n + workers - 1) / workers;
  for (size_t begin = chunk; begin < n; begin += chunk) {
    pool.emplace_back(fn, begin, std::min(n, begin + chunk));
  }
  fn(size_t{0}, std::min(n, chunk));
  for (std::thread& t : pool) t.join();
}

}  // namespace flashd::kernels::cpu
