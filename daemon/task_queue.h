// ElasticTaskQueue: the HTTP listeners' workers. httplib runs each connection on one worker for as
// long as the connection lives, and a streamed generation keeps its connection for the whole
// generation; with a fixed pool, as many open streams as workers would leave /health and every
// other request waiting. This queue keeps `core` workers and starts another whenever none is
// idle, up to `max`; workers beyond the core leave after a minute without work.
#pragma once

#include <httplib.h>

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

namespace flashd::daemon {

class ElasticTaskQueue : public httplib::TaskQueue {
 public:
  ElasticTaskQueue(size_t core, size_t max);
  ~ElasticTaskQueue() override;

  void enqueue(std::function<void()> fn) override;
  // Runs what is queued, then stops every worker; returns when they are gone.
  void shutdown() override;

  size_t threads() const;

 private:
  void Spawn(bool core);  // Requires mu_.
  void Work(bool core, size_t slot);

  const size_t core_, max_;
  mutable std::mutex mu_;
  std::condition_variable work_cv_, gone_cv_;
  std::deque<std::function<void()>> jobs_;  // Guarded by mu_.
  size_t threads_ = 0;                      // Guarded by mu_.
  size_t idle_ = 0;                         // Guarded by mu_.
  bool stopping_ = false;                   // Guarded by mu_.
  // Every worker's thread, joined when it has left (a later Spawn) or at shutdown: a thread is
  // never left running against a destroyed queue.
  std::map<size_t, std::thread> workers_;  // Guarded by mu_.
  std::vector<size_t> left_;               // Guarded by mu_: workers that have returned.
  size_t next_slot_ = 0;                   // Guarded by mu_.
};

}  // namespace flashd::daemon
