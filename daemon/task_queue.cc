#include "daemon/task_queue.h"

#include <chrono>
#include <thread>

namespace flashd::daemon {

ElasticTaskQueue::ElasticTaskQueue(size_t core, size_t max)
    : core_(core), max_(std::max(core, max)) {
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t i = 0; i < core_; ++i) Spawn(true);
}

ElasticTaskQueue::~ElasticTaskQueue() { shutdown(); }

void ElasticTaskQueue::Spawn(bool core) {
  threads_ += 1;
  // Detached: a worker that leaves must not wait to be joined; shutdown() waits on the count.
  std::thread([this, core] { Work(core); }).detach();
}

void ElasticTaskQueue::enqueue(std::function<void()> fn) {
  std::lock_guard<std::mutex> lock(mu_);
  jobs_.push_back(std::move(fn));
  if (idle_ < jobs_.size() && threads_ < max_ && !stopping_) Spawn(false);
  work_cv_.notify_one();
}

void ElasticTaskQueue::Work(bool core) {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    idle_ += 1;
    const auto ready = [&] { return stopping_ || !jobs_.empty(); };
    if (core) {
      work_cv_.wait(lock, ready);
    } else {
      work_cv_.wait_for(lock, std::chrono::minutes(1), ready);
    }
    idle_ -= 1;
    if (jobs_.empty()) {
      if (stopping_ || !core) break;
      continue;
    }
    std::function<void()> fn = std::move(jobs_.front());
    jobs_.pop_front();
    lock.unlock();
    fn();
    lock.lock();
  }
  threads_ -= 1;
  gone_cv_.notify_all();
}

void ElasticTaskQueue::shutdown() {
  std::unique_lock<std::mutex> lock(mu_);
  stopping_ = true;
  work_cv_.notify_all();
  gone_cv_.wait(lock, [&] { return threads_ == 0; });
}

size_t ElasticTaskQueue::threads() const {
  std::lock_guard<std::mutex> lock(mu_);
  return threads_;
}

}  // namespace flashd::daemon
