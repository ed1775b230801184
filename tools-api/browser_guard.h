// Defences against web pages in a browser on the same machine, which can send requests to a
// loopback daemon although they cannot read the answers (without CORS):
//   - DNS rebinding: a page on evil.example whose name is re-pointed at 127.0.0.1 sends requests
//     the browser deems same-origin, with "Host: evil.example". A loopback TCP listener answers
//     only to loopback names and server.allowed_hosts.
//   - Cross-site requests: a page can POST a "simple" request (text/plain, form data) to any
//     origin without asking first. Requests with an Origin header are refused unless the origin
//     is in server.cors_origins, and JSON routes refuse bodies that are not declared JSON, which a
//     simple request cannot declare.
// The Unix socket is out of a browser's reach, so only the Content-Type rule applies there.
#pragma once

#include <httplib.h>

#include <optional>
#include <string>

#include "config/config.h"

namespace flashd::api {

struct Refusal {
  int status = 403;
  std::string type = "permission_error";
  std::string message;
};

class BrowserGuard {
 public:
  BrowserGuard(const ServerConfig& server, bool tcp_listener);

  // Nullopt when the request may go on. Adds the CORS headers to `res` for an allowed origin.
  std::optional<Refusal> Check(const httplib::Request& req, httplib::Response& res) const;

  // True (and the answer written) for a CORS preflight from an allowed origin.
  bool AnswerPreflight(const httplib::Request& req, httplib::Response& res) const;

 private:
  bool HostAllowed(const std::string& host_header) const;
  bool OriginAllowed(const std::string& origin) const;

  const ServerConfig& server_;
  bool check_host_;  // A TCP listener on a loopback address.
};

// True for "application/json" and "application/*+json", with any parameters, in any case.
bool IsJsonContentType(const std::string& value);

}  // namespace flashd::api
