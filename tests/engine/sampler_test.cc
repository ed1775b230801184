#include "engine/sampler.h"

#include <boost/test/unit_test.hpp>
#include <cmath>
#include <map>

namespace flashd::engine {
namespace {

SamplingParams Params(float temperature, uint64_t seed = 1) {
  SamplingParams p;
  p.temperature = temperature;
  p.seed = seed;
  return p;
}

// Logits whose softmax is the given probabilities.
std::vector<float> LogitsOf(const std::vector<double>& probs) {
  std::vector<float> l;
  for (double p : probs) l.push_back(static_cast<float>(std::log(p)));
  return l;
}

std::map<int32_t, int> Histogram(SamplingParams p, const std::vector<float>& logits, int draws) {
  Sampler s(p, {});
  std::map<int32_t, int> h;
  for (int i = 0; i < draws; ++i) h[s.Sample(logits).token] += 1;
  return h;
}

BOOST_AUTO_TEST_SUITE(sampler)

BOOST_AUTO_TEST_CASE(greedy_takes_the_largest_logit_lowest_id_on_ties) {
  Sampler s(Params(0.0f), {});
  BOOST_TEST(s.Sample(std::vector<float>{0.1f, 3.0f, -1.0f}).token == 1);
  Sampler t(Params(0.0f), {});
  BOOST_TEST(t.Sample(std::vector<float>{2.0f, 5.0f, 5.0f}).token == 1);
}

BOOST_AUTO_TEST_CASE(seeded_requests_are_reproducible) {
  const std::vector<float> logits = LogitsOf({0.2, 0.3, 0.1, 0.4});
  Sampler a(Params(1.0f, 42), {}), b(Params(1.0f, 42), {}), c(Params(1.0f, 43), {});
  std::vector<int32_t> ta, tb, tc;
  for (int i = 0; i < 200; ++i) {
    ta.push_back(a.Sample(logits).token);
    tb.push_back(b.Sample(logits).token);
    tc.push_back(c.Sample(logits).token);
  }
  BOOST_TEST(ta == tb);
  BOOST_TEST(ta != tc);
}

BOOST_AUTO_TEST_CASE(temperature_one_follows_the_softmax) {
  auto h = Histogram(Params(1.0f, 7), LogitsOf({0.5, 0.3, 0.2}), 20000);
  BOOST_TEST(std::fabs(h[0] / 20000.0 - 0.5) < 0.02);
  BOOST_TEST(std::fabs(h[1] / 20000.0 - 0.3) < 0.02);
  BOOST_TEST(std::fabs(h[2] / 20000.0 - 0.2) < 0.02);
  // A low temperature sharpens: the first token dominates.
  auto cold = Histogram(Params(0.1f, 7), LogitsOf({0.5, 0.3, 0.2}), 2000);
  BOOST_TEST(cold[0] > 1950);
}

BOOST_AUTO_TEST_CASE(top_k_top_p_and_min_p_cut_the_tail) {
  const std::vector<float> logits = LogitsOf({0.5, 0.3, 0.15, 0.05});
  SamplingParams k = Params(1.0f, 3);
  k.top_k = 2;
  auto hk = Histogram(k, logits, 3000);
  BOOST_TEST(hk.count(2) == 0u);
  BOOST_TEST(hk.count(3) == 0u);
  BOOST_TEST(std::fabs(hk[0] / 3000.0 - 0.5 / 0.8) < 0.03);
  SamplingParams p = Params(1.0f, 3);
  p.top_p = 0.6f;  // 0.5 + 0.3 reaches it.
  auto hp = Histogram(p, logits, 3000);
  BOOST_TEST(hp.count(2) == 0u);
  BOOST_TEST(hp[1] > 0);
  SamplingParams m = Params(1.0f, 3);
  m.min_p = 0.5f;  // Keeps p >= 0.25.
  auto hm = Histogram(m, logits, 3000);
  BOOST_TEST(hm.size() == 2u);
  SamplingParams one = Params(1.0f, 3);
  one.top_k = 1;
  BOOST_TEST(Histogram(one, logits, 100)[0] == 100);
}

BOOST_AUTO_TEST_CASE(penalties_change_the_choice) {
  const std::vector<float> logits = {2.0f, 1.9f, 0.0f};
  SamplingParams rep = Params(0.0f);
  rep.repetition_penalty = 1.5f;
  std::vector<int32_t> prompt = {0};
  Sampler r(rep, prompt);
  BOOST_TEST(r.Sample(logits).token == 1);  // 2.0 / 1.5 < 1.9
  SamplingParams freq = Params(0.0f);
  freq.frequency_penalty = 0.06f;
  Sampler f(freq, {});
  BOOST_TEST(f.Sample(logits).token == 0);
  BOOST_TEST(f.Sample(logits).token == 0);  // 2.0 - 0.06 > 1.9
  BOOST_TEST(f.Sample(logits).token == 1);  // 2.0 - 0.12 < 1.9
  SamplingParams pres = Params(0.0f);
  pres.presence_penalty = 0.2f;
  Sampler q(pres, {});
  BOOST_TEST(q.Sample(logits).token == 0);
  BOOST_TEST(q.Sample(logits).token == 1);
}

BOOST_AUTO_TEST_CASE(logprobs_are_of_the_raw_distribution) {
  SamplingParams p = Params(0.0f);
  p.logprobs = 2;
  Sampler s(p, {});
  SampledToken t = s.Sample(LogitsOf({0.25, 0.5, 0.25}));
  BOOST_TEST(t.token == 1);
  BOOST_TEST(std::fabs(t.logprob - std::log(0.5)) < 1e-5);
  BOOST_REQUIRE(t.top.size() == 2u);
  BOOST_TEST(t.top[0].first == 1);
  BOOST_TEST(t.top[1].first == 0);  // Ties to the lower id.
  BOOST_TEST(std::fabs(t.top[1].second - std::log(0.25)) < 1e-5);
}

BOOST_AUTO_TEST_CASE(invalid_params_name_the_field) {
  struct Case {
    SamplingParams p;
    const char* field;
  };
  std::vector<Case> cases(7);
  cases[0].p.temperature = -1;
  cases[0].field = "temperature";
  cases[1].p.top_p = 0;
  cases[1].field = "top_p";
  cases[2].p.min_p = 2;
  cases[2].field = "min_p";
  cases[3].p.max_tokens = 0;
  cases[3].field = "max_tokens";
  cases[4].p.logprobs = 21;
  cases[4].field = "logprobs";
  cases[5].p.stop = {""};
  cases[5].field = "stop";
  cases[6].p.presence_penalty = 3;
  cases[6].field = "presence_penalty";
  for (const Case& c : cases) {
    Status s = c.p.Validate();
    BOOST_TEST(s.message().rfind(c.field, 0) == 0u, s.message());
  }
  BOOST_TEST(SamplingParams().Validate().ok());
}

BOOST_AUTO_TEST_SUITE_END()

}  // namespace
}  // namespace flashd::engine
