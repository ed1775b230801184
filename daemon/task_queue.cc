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
  for (size_t slot : left_) {
    workers_[slot].join();  // It has returned: nothing left for it to lock.
    workers_.erase(slot);
  }
  left_.clear();
  threads_ += 1;
  const size_t slot = next_slot_++;
  workers_[slot] = std::thread([this, core, slot] { Work(core, slot); });
}

void ElasticTaskQueue::enqueue(std::function<void()> fn) {
  std::lock_guard<std::mutex> lock(mu_);
  jobs_.push_back(std::move(fn));
  if (idle_ < jobs_.size() && threads_ < max_ && !stopping_) Spawn(false);
  work_cv_.notify_one();
}

void ElasticTaskQueue::Work(bool core, size_t slot) {
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
  left_.push_back(slot);
  gone_cv_.notify_all();
}

void ElasticTaskQueue::shutdown() {
  std::unique_lock<std::mutex> lock(mu_);
  stopping_ = true;
  work_cv_.notify_all();
  gone_cv_.wait(lock, [&] { return threads_ == 0; });
  std::map<size_t, std::thread> workers;
  workers.swap(workers_);
  left_.clear();
  lock.unlock();
  for (auto& [slot, t] : workers) t.join();
}

size_t ElasticTaskQueue::threads() const {
  std::lock_guard<std::mutex> lock(mu_);
  return threads_;
}

}  // namespace flashd::daemon
