#include "tests/e2e/exact_answers.h"

#include <boost/test/unit_test.hpp>
#include <random>

#include "tests/e2e/daemon_process.h"

namespace flashd::testing {

using nlohmann::json;

std::vector<int> Ids(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> d(3, 390);
  std::vector<int> v(n);
  for (int& t : v) t = d(rng);
  return v;
}

std::vector<int> Concat(std::vector<int> a, const std::vector<int>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

Answer Ask(httplib::Client& c, const std::vector<int>& prompt, int max_tokens) {
  json body = {{"prompt", prompt},
               {"max_tokens", max_tokens},
               {"temperature", 0},
               {"logprobs", 1},
               {"ignore_eos", true}};
  Answer a;
  auto res = c.Post("/v1/completions", body.dump(), "application/json");
  if (!res) return a;
  a.status = res->status;
  a.raw = res->body;
  if (res->status != 200) return a;
  const json j = json::parse(res->body);
  a.text = j["choices"][0]["text"];
  a.logprobs = j["choices"][0]["logprobs"]["token_logprobs"];
  a.cached = j["usage"]["prompt_tokens_details"]["cached_tokens"];
  return a;
}

bool Same(const Answer& a, const Answer& b) {
  return a.status == 200 && b.status == 200 && a.text == b.text &&
         a.logprobs.dump() == b.logprobs.dump();
}

Answer Fresh(const std::vector<int>& prompt, int max_tokens) {
  TempDir tmp;
  DaemonProcess d({tmp.path(), "", {}, {}});
  BOOST_REQUIRE_MESSAGE(d.Start() && WaitHealthy("127.0.0.1", d.port()) == 200, d.log());
  Answer a = Ask(*TcpClient(d, 300), prompt, max_tokens);
  BOOST_REQUIRE_MESSAGE(a.status == 200, a.raw);
  BOOST_TEST(a.cached == 0);
  return a;
}

}  // namespace flashd::testing
