#include "tools-api/router.h"

#include <boost/test/unit_test.hpp>
#include <nlohmann/json.hpp>

namespace flashd::api {
namespace {

BOOST_AUTO_TEST_SUITE(router)

Router MakeRouter(std::string* hit) {
  Router r;
  auto mark = [hit](std::string name) {
    return [hit, name](const httplib::Request&, httplib::Response&, const PathParams& p) {
      *hit = name;
      for (const auto& [k, v] : p) *hit += " " + k + "=" + v;
    };
  };
  r.Add("GET", "/health", mark("health"));
  r.Add("GET", "/v1/sessions/{id}", mark("get-session"));
  r.Add("DELETE", "/v1/sessions/{id}", mark("delete-session"));
  r.Add("POST", "/v1/sessions/{id}/turns", mark("turn"));
  return r;
}

BOOST_AUTO_TEST_CASE(finds_literal_and_parameter_routes) {
  std::string hit;
  Router r = MakeRouter(&hit);
  httplib::Request req;
  httplib::Response res;
  Router::Match m = r.Find("GET", "/health");
  BOOST_REQUIRE(m.kind == Router::Match::Kind::kFound);
  (*m.handler)(req, res, m.params);
  BOOST_TEST(hit == "health");

  m = r.Find("POST", "/v1/sessions/abc123/turns");
  BOOST_REQUIRE(m.kind == Router::Match::Kind::kFound);
  BOOST_TEST(m.pattern == "/v1/sessions/{id}/turns");
  (*m.handler)(req, res, m.params);
  BOOST_TEST(hit == "turn id=abc123");

  m = r.Find("DELETE", "/v1/sessions/x");
  (*m.handler)(req, res, m.params);
  BOOST_TEST(hit == "delete-session id=x");
}

BOOST_AUTO_TEST_CASE(head_is_served_by_get) {
  std::string hit;
  Router r = MakeRouter(&hit);
  BOOST_TEST((r.Find("HEAD", "/health").kind == Router::Match::Kind::kFound));
}

BOOST_AUTO_TEST_CASE(wrong_method_lists_allowed_methods) {
  std::string hit;
  Router r = MakeRouter(&hit);
  Router::Match m = r.Find("PUT", "/v1/sessions/x");
  BOOST_REQUIRE(m.kind == Router::Match::Kind::kMethodNotAllowed);
  BOOST_TEST(m.allowed.size() == 2u);
  BOOST_TEST(m.allowed[0] == "GET");
  BOOST_TEST(m.allowed[1] == "DELETE");
}

BOOST_AUTO_TEST_CASE(unknown_paths_are_not_found) {
  std::string hit;
  Router r = MakeRouter(&hit);
  BOOST_TEST((r.Find("GET", "/nope").kind == Router::Match::Kind::kNotFound));
  BOOST_TEST((r.Find("GET", "/v1/sessions").kind == Router::Match::Kind::kNotFound));
  BOOST_TEST((r.Find("POST", "/v1/sessions/a/turns/b").kind == Router::Match::Kind::kNotFound));
}

BOOST_AUTO_TEST_CASE(error_body_shape) {
  httplib::Response res;
  WriteError(res, 404, "not_found_error", "no route for GET /x");
  BOOST_TEST(res.status == 404);
  auto body = nlohmann::json::parse(res.body);
  BOOST_TEST(body["error"]["type"].get<std::string>() == "not_found_error");
  BOOST_TEST(body["error"]["message"].get<std::string>() == "no route for GET /x");
}

BOOST_AUTO_TEST_SUITE_END()

}  // namespace
}  // namespace flashd::api
