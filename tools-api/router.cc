#include "tools-api/router.h"

#include <nlohmann/json.hpp>

#include "tools-api/json_limits.h"

namespace flashd::api {
namespace {

std::vector<std::string> SplitPath(const std::string& path) {
  std::vector<std::string> out;
  size_t i = 0;
  while (i < path.size()) {
    if (path[i] == '/') {
      ++i;
      continue;
    }
    size_t j = path.find('/', i);
    if (j == std::string::npos) j = path.size();
    out.push_back(path.substr(i, j - i));
    i = j;
  }
  return out;
}

bool IsParam(const std::string& segment) {
  return segment.size() > 2 && segment.front() == '{' && segment.back() == '}';
}

}  // namespace

void WriteError(httplib::Response& res, int status, const std::string& type,
                const std::string& message) {
  nlohmann::json body = {{"error", {{"type", type}, {"message", message}}}};
  res.status = status;
  // Messages may quote the client's bytes (a path whose %-escapes decode to invalid UTF-8):
  // those become U+FFFD, so writing an error can never throw.
  res.set_content(body.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace),
                  "application/json");
}

void Router::Add(const std::string& method, const std::string& pattern, RouteHandler handler) {
  routes_.push_back(Route{method, pattern, SplitPath(pattern), std::move(handler)});
}

Router::Match Router::Find(const std::string& method, const std::string& path) const {
  Match result;
  const std::vector<std::string> parts = SplitPath(path);
  // HEAD is answered by the GET handler, as HTTP requires.
  const std::string& effective = method == "HEAD" ? std::string("GET") : method;
  for (const Route& route : routes_) {
    if (route.segments.size() != parts.size()) continue;
    PathParams params;
    bool same = true;
    for (size_t i = 0; i < parts.size() && same; ++i) {
      if (IsParam(route.segments[i])) {
        params[route.segments[i].substr(1, route.segments[i].size() - 2)] = parts[i];
      } else {
        same = route.segments[i] == parts[i];
      }
    }
    if (!same) continue;
    if (route.method == effective) {
      result.kind = Match::Kind::kFound;
      result.handler = &route.handler;
      result.pattern = route.pattern;
      result.params = std::move(params);
      return result;
    }
    result.kind = Match::Kind::kMethodNotAllowed;
    result.pattern = route.pattern;
    result.allowed.push_back(route.method);
  }
  return result;
}

void Router::Dispatch(const httplib::Request& req, httplib::Response& res) const {
  Match m = Find(req.method, req.path);
  switch (m.kind) {
    case Match::Kind::kFound:
      (*m.handler)(req, res, m.params);
      return;
    case Match::Kind::kMethodNotAllowed: {
      std::string allow;
      for (const std::string& a : m.allowed) allow += (allow.empty() ? "" : ", ") + a;
      res.set_header("Allow", allow);
      WriteError(res, 405, "method_not_allowed_error",
                 req.method + " is not allowed on " + req.path + " (allowed: " + allow + ")");
      return;
    }
    case Match::Kind::kNotFound:
      WriteError(res, 404, "not_found_error", "no route for " + req.method + " " + req.path);
      return;
  }
}

void Router::Install(httplib::Server* server) const {
  auto dispatch = [this](const httplib::Request& req, httplib::Response& res) {
    Dispatch(req, res);
  };
  const std::string any = ".*";
  server->Get(any, dispatch);
  server->Post(any, dispatch);
  server->Put(any, dispatch);
  server->Patch(any, dispatch);
  server->Delete(any, dispatch);
  server->Options(any, dispatch);
}

bool ParseJsonBody(const httplib::Request& req, httplib::Response& res, nlohmann::json* body) {
  if (std::optional<std::string> e = ParseOutsideJson(req.body, body)) {
    WriteError(res, 400, "invalid_request_error", "request body is not valid JSON: " + *e);
    return false;
  }
  if (!body->is_object()) {
    WriteError(res, 400, "invalid_request_error", "request body must be a JSON object");
    return false;
  }
  return true;
}

}  // namespace flashd::api
