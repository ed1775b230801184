#include "tools-api/metrics.h"

#include <array>
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

// Upper bounds of the latency buckets, in seconds; a last bucket takes the rest (+Inf).
constexpr std::array<double, 13> kBounds = {0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                                            1,     2.5,  5,     10,   30,  60};

}  // namespace

void Metrics::Histogram::Observe(double v) {
  size_t b = 0;
  while (b < kBounds.size() && v > kBounds[b]) ++b;
  counts[b] += 1;
  count += 1;
  sum += v;
}

void Metrics::Histogram::Render(const char* name, const char* help, std::string* out) const {
  char line[256];
  *out += std::string("# HELP ") + name + " " + help + "\n# TYPE " + name + " histogram\n";
  uint64_t cumulative = 0;
  for (size_t b = 0; b <= kBounds.size(); ++b) {
    cumulative += counts[b];
    if (b < kBounds.size()) {
      std::snprintf(line, sizeof line, "%s_bucket{le=\"%g\"} %llu\n", name, kBounds[b],
                    static_cast<unsigned long long>(cumulative));
    } else {
      std::snprintf(line, sizeof line, "%s_bucket{le=\"+Inf\"} %llu\n", name,
                    static_cast<unsigned long long>(cumulative));
    }
    *out += line;
  }
  std::snprintf(line, sizeof line, "%s_sum %.6f\n%s_count %llu\n", name, sum, name,
                static_cast<unsigned long long>(count));
  *out += line;
}

void Metrics::ObserveTimeToFirstToken(double seconds) {
  std::lock_guard<std::mutex> lock(mu_);
  ttft_.Observe(seconds);
}

void Metrics::ObserveInterToken(double seconds) {
  std::lock_guard<std::mutex> lock(mu_);
  inter_token_.Observe(seconds);
}

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
  ttft_.Render("flashd_time_to_first_token_seconds",
               "From a generation request's arrival to its first token.", &out);
  inter_token_.Render("flashd_inter_token_seconds", "Between consecutive tokens of one generation.",
                      &out);
  return out;
}

}  // namespace flashd::api
