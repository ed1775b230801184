// Router: maps (method, path pattern) to handlers, for both listeners.
//
// Patterns are literal paths with "{name}" segments ("/v1/sessions/{id}"). A path that matches a
// pattern under another method gets 405 with an Allow header; a path that matches nothing gets
// 404. Both carry the JSON error body every route uses. Routes are added before Install() and not
// changed afterwards, so Match() may be called from any listener thread without locking.
#pragma once

#include <httplib.h>

#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace flashd::api {

using PathParams = std::map<std::string, std::string>;
using RouteHandler =
    std::function<void(const httplib::Request&, httplib::Response&, const PathParams&)>;

// Writes {"error":{"type":...,"message":...}} with the given status.
void WriteError(httplib::Response& res, int status, const std::string& type,
                const std::string& message);

// Parses the request body as a JSON object; otherwise writes the 400 (naming the position of a
// syntax error) and returns false.
bool ParseJsonBody(const httplib::Request& req, httplib::Response& res, nlohmann::json* body);

class Router {
 public:
  struct Match {
    enum class Kind { kFound, kNotFound, kMethodNotAllowed } kind = Kind::kNotFound;
    const RouteHandler* handler = nullptr;
    std::string pattern;               // The matched pattern, for metrics labels.
    PathParams params;                 // Values of "{name}" segments.
    std::vector<std::string> allowed;  // Methods the path accepts, when kMethodNotAllowed.
  };

  // REQUIRES: called before Install().
  void Add(const std::string& method, const std::string& pattern, RouteHandler handler);

  Match Find(const std::string& method, const std::string& path) const;

  // Sends every method of every request on `server` through Find() and the matched handler.
  void Install(httplib::Server* server) const;

 private:
  struct Route {
    std::string method;
    std::string pattern;
    std::vector<std::string> segments;
    RouteHandler handler;
  };
  void Dispatch(const httplib::Request& req, httplib::Response& res) const;

  std::vector<Route> routes_;
};

}  // namespace flashd::api
