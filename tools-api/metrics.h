// Metrics: the daemon's counters, rendered in the Prometheus text format for GET /metrics.
//
// Thread-safe: listener threads record requests concurrently; Render() may run at any time.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>

namespace flashd::api {

class Metrics {
 public:
  Metrics();

  // `route` is the matched pattern ("/v1/sessions/{id}") or "unmatched", never a raw path, so
  // the number of series stays bounded whatever clients send.
  void RecordRequest(const std::string& route, int status, double seconds);

  void RequestStarted() { in_flight_.fetch_add(1, std::memory_order_relaxed); }
  void RequestFinished() { in_flight_.fetch_sub(1, std::memory_order_relaxed); }
  int64_t InFlight() const { return in_flight_.load(std::memory_order_relaxed); }

  std::string Render() const;

 private:
  struct Series {
    uint64_t count = 0;
    double seconds = 0;
  };
  const std::chrono::steady_clock::time_point start_;
  std::atomic<int64_t> in_flight_{0};
  mutable std::mutex mu_;
  std::map<std::pair<std::string, int>, Series> requests_;  // Guarded by mu_.
};

}  // namespace flashd::api
