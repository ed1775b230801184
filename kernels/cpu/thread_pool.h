// ThreadPool: the process's worker threads for the CPU kernels, started once.
//
// Starting threads per call cost the CPU forward pass about a sixth of its time at decode (tens
// of thousands of thread creations per benchmark run); one pool, woken per call, does not.
//
// Thread-safety: Run may be called from any thread. One call uses the workers at a time; a call
// made while another is running, or from inside a task, runs its tasks on the calling thread, so
// nested and concurrent calls neither deadlock nor change results (each task writes only what it
// owns).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <mutex>
#include <thread>
#include <vector>

namespace flashd::kernels::cpu {

class ThreadPool {
 public:
  // The process's pool: hardware_concurrency() - 1 workers (the caller is the last one), started
  // on first use and stopped at exit. It is the one piece of process-wide state in the kernels,
  // because cores are a process-wide resource.
  static ThreadPool& Process();

  explicit ThreadPool(size_t workers);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  size_t workers() const { return threads_.size(); }

  // Calls task(context, i) for every i in [0, count), on the caller and at most `helpers`
  // workers, and returns when every call has returned.
  void Run(size_t count, size_t helpers, void (*task)(void*, size_t), void* context);

 private:
  void Work();
  void Drain();

  std::vector<std::thread> threads_;
  std::mutex run_mu_;  // Held by the one caller using the workers.
  std::mutex mu_;
  std::condition_variable wake_, done_cv_;
  bool stop_ = false;
  uint64_t generation_ = 0;
  size_t wanted_ = 0;  // Workers the current generation asks for.
  size_t joined_ = 0;  // Workers that took part in it.
  size_t active_ = 0;  // Workers inside Drain.
  // The current job.
  void (*task_)(void*, size_t) = nullptr;
  void* context_ = nullptr;
  size_t count_ = 0;
  std::atomic<size_t> next_{0};
  std::atomic<size_t> finished_{0};
};

}  // namespace flashd::kernels::cpu
