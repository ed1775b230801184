#include "tools-api/metrics.h"

#include <cstdio>

namespace flashd::api {
namespace {

// Prometheus label values escape backslash, quote and newline.
std::string EscapeLabel(const std::string& v) {
  std::string out;
  for (char c : v) {
    if (c == '\\' || c == '"') {
      out += '\\';
      out += c;
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

}  // namespace

Metrics::Metrics() : start_(std::chrono::steady_clock::now()) {}

void Metrics::RecordRequest(const std::string& route, int status, double seconds) {
  std::lock_guard<std::mutex> lock(mu_);
  Series& s = requests_[{route, status}];
  s.count += 1;
  s.seconds += seconds;
}

std::string Metrics::Render() const {
  std::string out;
  char line[512];
  double uptime = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  out += "# HELP flashd_uptime_seconds Seconds since the daemon started.\n";
  out += "# TYPE flashd_uptime_seconds gauge\n";
  std::snprintf(line, sizeof line, "flashd_uptime_seconds %.3f\n", uptime);
  out += line;
  out += "# HELP flashd_http_requests_in_flight Requests being handled now.\n";
  out += "# TYPE flashd_http_requests_in_flight gauge\n";
  out += "flashd_http_requests_in_flight " + std::to_string(InFlight()) + "\n";

  std::lock_guard<std::mutex> lock(mu_);
  out += "# HELP flashd_http_requests_total Requests answered, by route pattern and status.\n";
  out += "# TYPE flashd_http_requests_total counter\n";
  for (const auto& [key, s] : requests_) {
    out += "flashd_http_requests_total{route=\"" + EscapeLabel(key.first) + "\",status=\"" +
           std::to_string(key.second) + "\"} " + std::to_string(s.count) + "\n";
  }
  out += "# HELP flashd_http_request_seconds_total Time spent answering, by route and status.\n";
  out += "# TYPE flashd_http_request_seconds_total counter\n";
  for (const auto& [key, s] : requests_) {
    std::snprintf(line, sizeof line, "%.6f", s.seconds);
    out += "flashd_http_request_seconds_total{route=\"" + EscapeLabel(key.first) + "\",status=\"" +
           std::to_string(key.second) + "\"} " + line + "\n";
  }
  return out;
}

}  // namespace flashd::api
