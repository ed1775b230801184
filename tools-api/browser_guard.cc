#include "tools-api/browser_guard.h"

#include <algorithm>
#include <cctype>

namespace flashd::api {
namespace {

std::string Lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s;
}

bool IsLoopbackHost(const std::string& host) {
  return host == "localhost" || host == "::1" || host == "[::1]" || host.rfind("127.", 0) == 0;
}

// The host part of a Host header: "[::1]:8741" -> "[::1]", "localhost:80" -> "localhost".
std::string HostPart(const std::string& header) {
  if (!header.empty() && header.front() == '[') {
    const size_t end = header.find(']');
    return end == std::string::npos ? header : header.substr(0, end + 1);
  }
  return header.substr(0, header.find(':'));
}

}  // namespace

bool IsJsonContentType(const std::string& value) {
  std::string type = Lower(value.substr(0, value.find(';')));
  type.erase(
      std::remove_if(type.begin(), type.end(), [](unsigned char c) { return std::isspace(c); }),
      type.end());
  if (type == "application/json") return true;
  return type.rfind("application/", 0) == 0 && type.size() > 5 &&
         type.compare(type.size() - 5, 5, "+json") == 0;
}

BrowserGuard::BrowserGuard(const ServerConfig& server, bool tcp_listener)
    : server_(server), check_host_(tcp_listener && IsLoopbackHost(server.listen_host)) {}

bool BrowserGuard::HostAllowed(const std::string& header) const {
  const std::string host = Lower(HostPart(header));
  if (IsLoopbackHost(host) || host == Lower(server_.listen_host)) return true;
  for (const std::string& h : server_.allowed_hosts) {
    if (host == Lower(h)) return true;
  }
  return false;
}

bool BrowserGuard::OriginAllowed(const std::string& origin) const {
  return std::find(server_.cors_origins.begin(), server_.cors_origins.end(), origin) !=
         server_.cors_origins.end();
}

std::optional<Refusal> BrowserGuard::Check(const httplib::Request& req,
                                           httplib::Response& res) const {
  // HTTP/1.1 clients always send Host; an HTTP/1.0 client without one is no browser.
  if (check_host_ && req.has_header("Host") && !HostAllowed(req.get_header_value("Host"))) {
    return Refusal{403, "permission_error",
                   "Host \"" + req.get_header_value("Host") +
                       "\" is not a name of this daemon (add it to server.allowed_hosts)"};
  }
  if (req.has_header("Origin")) {
    const std::string origin = req.get_header_value("Origin");
    if (!OriginAllowed(origin)) {
      return Refusal{403, "permission_error",
                     "requests from the web origin \"" + origin +
                         "\" are not allowed (add it to server.cors_origins)"};
    }
    res.set_header("Access-Control-Allow-Origin", origin);
    res.set_header("Vary", "Origin");
  }
  // This runs before the body is read: a body is announced by its length or a chunked coding.
  const std::string length = req.get_header_value("Content-Length");
  const bool has_body = (!length.empty() && length.find_first_not_of("0") != std::string::npos) ||
                        req.has_header("Transfer-Encoding");
  if ((req.method == "POST" || req.method == "PUT" || req.method == "PATCH") && has_body) {
    const std::string type = req.get_header_value("Content-Type");
    if (!IsJsonContentType(type)) {
      return Refusal{415, "invalid_request_error",
                     "Content-Type: expected application/json, got \"" + type + "\""};
    }
  }
  return std::nullopt;
}

bool BrowserGuard::AnswerPreflight(const httplib::Request& req, httplib::Response& res) const {
  if (req.method != "OPTIONS" || !req.has_header("Origin") ||
      !req.has_header("Access-Control-Request-Method")) {
    return false;
  }
  const std::string origin = req.get_header_value("Origin");
  if (!OriginAllowed(origin)) return false;
  res.status = 204;
  res.set_header("Access-Control-Allow-Origin", origin);
  res.set_header("Vary", "Origin");
  res.set_header("Access-Control-Allow-Methods", "GET, POST, DELETE, OPTIONS");
  res.set_header("Access-Control-Allow-Headers",
                 "Authorization, Content-Type, x-api-key, anthropic-version, anthropic-beta, "
                 "openai-organization, openai-project");
  res.set_header("Access-Control-Max-Age", "600");
  return true;
}

}  // namespace flashd::api
