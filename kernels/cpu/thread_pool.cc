#include "kernels/cpu/thread_pool.h"

#include <algorithm>

namespace flashd::kernels::cpu {
namespace {
thread_local bool in_task = false;
}  // namespace

ThreadPool& ThreadPool::Process() {
  static ThreadPool pool(std::max(1u, std::thread::hardware_concurrency()) - 1);
  return pool;
}

ThreadPool::ThreadPool(size_t workers) {
  threads_.reserve(workers);
  for (size_t i = 0; i < workers; ++i) threads_.emplace_back([this] { Work(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  for (std::thread& t : threads_) t.join();
}

// Takes tasks of the current job until none is left.
void ThreadPool::Drain() {
  for (size_t i = next_.fetch_add(1); i < count_; i = next_.fetch_add(1)) {
    task_(context_, i);
    if (finished_.fetch_add(1) + 1 == count_) {
      std::lock_guard<std::mutex> lock(mu_);
      done_cv_.notify_all();
    }
  }
}

void ThreadPool::Work() {
  in_task = true;
  uint64_t seen = 0;
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    wake_.wait(lock, [&] { return stop_ || (generation_ != seen && joined_ < wanted_); });
    if (stop_) return;
    seen = generation_;
    joined_ += 1;
    active_ += 1;
    lock.unlock();
    Drain();
    lock.lock();
    if (--active_ == 0) done_cv_.notify_all();
  }
}

void ThreadPool::Run(size_t count, size_t helpers, void (*task)(void*, size_t), void* context) {
  helpers = std::min({helpers, threads_.size(), count > 0 ? count - 1 : 0});
  std::unique_lock<std::mutex> run(run_mu_, std::defer_lock);
  if (helpers == 0 || in_task || !run.try_lock()) {
    for (size_t i = 0; i < count; ++i) task(context, i);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    task_ = task;
    context_ = context;
    count_ = count;
    next_ = 0;
    finished_ = 0;
    wanted_ = helpers;
    joined_ = 0;
    generation_ += 1;
  }
  if (helpers == threads_.size()) {
    wake_.notify_all();
  } else {
    for (size_t i = 0; i < helpers; ++i) wake_.notify_one();
  }
  in_task = true;
  Drain();
  in_task = false;
  // Every worker that joined must have left Drain before the job's fields may change; closing
  // the job (wanted_ = 0) under the same lock keeps late wakers from joining it.
  std::unique_lock<std::mutex> lock(mu_);
  done_cv_.wait(lock, [&] { return finished_.load() == count_ && active_ == 0; });
  wanted_ = 0;
}

}  // namespace flashd::kernels::cpu
