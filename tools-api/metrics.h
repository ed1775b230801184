// Metrics: the daemon's counters, rendered in the Prometheus text format for GET /metrics.
//
// Thread-safe: listener threads record requests concurrently; Render() may run at any time.
#pragma once

#include <array>
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

  // Latencies of generated tokens: from a request's arrival to its first token, and between
  // consecutive tokens of one generation.
  void ObserveTimeToFirstToken(double seconds);
  void ObserveInterToken(double seconds);

  std::string Render() const;

 private:
  // A Prometheus histogram over fixed bucket bounds (seconds).
  struct Histogram {
    std::array<uint64_t, 14> counts{};  // Per bucket, not cumulative; the last is +Inf.
    uint64_t count = 0;
    double sum = 0;
    void Observe(double v);
    void Render(const char* name, const char* help, std::string* out) const;
  };
  struct Series {
    uint64_t count = 0;
    double seconds = 0;
  };
  const std::chrono::steady_clock::time_point start_;
  std::atomic<int64_t> in_flight_{0};
  mutable std::mutex mu_;
  std::map<std::pair<std::string, int>, Series> requests_;  // Guarded by mu_.
  Histogram ttft_;                                          // Guarded by mu_.
  Histogram inter_token_;                                   // Guarded by mu_.
};

}  // namespace flashd::api
