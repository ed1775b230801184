// The process's thread pool: every task runs exactly once, and nested or concurrent calls
// finish with the same results as serial ones.
#include "kernels/cpu/thread_pool.h"

#include <atomic>
#include <boost/test/unit_test.hpp>
#include <thread>
#include <vector>

#include "kernels/cpu/parallel.h"

namespace flashd::kernels::cpu {
namespace {

BOOST_AUTO_TEST_SUITE(thread_pool)

BOOST_AUTO_TEST_CASE(every_task_runs_once) {
  ThreadPool pool(3);
  for (size_t count : {0, 1, 2, 5, 100, 1000}) {
    std::vector<std::atomic<int>> hits(count);
    struct Ctx {
      std::vector<std::atomic<int>>* hits;
    } ctx{&hits};
    pool.Run(
        count, 3, [](void* c, size_t i) { (*static_cast<Ctx*>(c)->hits)[i] += 1; }, &ctx);
    for (size_t i = 0; i < count; ++i) BOOST_TEST(hits[i].load() == 1, "task " << i);
  }
}

BOOST_AUTO_TEST_CASE(ranges_cover_every_item_with_a_minimum_size) {
  for (size_t n : {1, 7, 64, 1000}) {
    for (size_t min_items : {1, 10, 5000}) {
      std::vector<int> seen(n, 0);
      std::atomic<int> ranges{0};
      ParallelRanges(
          n, 4,
          [&](size_t begin, size_t end) {
            ranges += 1;
            BOOST_CHECK(end - begin >= std::min(n, min_items) || end == n);
            for (size_t i = begin; i < end; ++i) seen[i] += 1;
          },
          min_items);
      for (size_t i = 0; i < n; ++i) BOOST_TEST(seen[i] == 1);
      BOOST_TEST(static_cast<size_t>(ranges.load()) <= std::max<size_t>(1, n / min_items));
    }
  }
}

// A task that itself calls ParallelRanges, and two threads calling at once: both run to the end
// (the inner or second call runs on its caller) with every item done once.
BOOST_AUTO_TEST_CASE(nested_and_concurrent_calls_complete) {
  std::atomic<long> total{0};
  auto work = [&] {
    for (int rep = 0; rep < 50; ++rep) {
      ParallelRanges(8, 8, [&](size_t begin, size_t end) {
        for (size_t i = begin; i < end; ++i) {
          ParallelRanges(16, 4, [&](size_t b, size_t e) { total += static_cast<long>(e - b); });
        }
      });
    }
  };
  std::thread other(work);
  work();
  other.join();
  BOOST_TEST(total.load() == 2L * 50 * 8 * 16);
}

BOOST_AUTO_TEST_SUITE_END()

}  // namespace
}  // namespace flashd::kernels::cpu
