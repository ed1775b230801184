#include "engine/sampler.h"

#include <algorithm>
#include <boost/test/unit_test.hpp>
#include <cmath>
#include <limits>
#include <map>
#include <numeric>
#include <random>

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

BOOST_AUTO_TEST_CASE(the_chosen_tokens_logprob_only_when_asked) {
  const std::vector<float> logits = LogitsOf({0.25, 0.5, 0.25});
  SamplingParams p = Params(0.0f);
  Sampler off(p, {});
  BOOST_TEST(off.Sample(logits).logprob == 0.0f);
  p.want_logprob = true;
  Sampler on(p, {});
  const SampledToken t = on.Sample(logits);
  BOOST_TEST(std::fabs(t.logprob - std::log(0.5)) < 1e-5);
  BOOST_TEST(t.top.empty());
}

// The candidates' order against its definition, a comparison sort of the ids by (value
// descending, id ascending), on both of CandidateOrder's ways (a selection for few candidates,
// a radix sort for many): values with many ties, +0 and -0 (equal), infinities, denormals.
BOOST_AUTO_TEST_CASE(candidate_order_is_the_comparison_sorts) {
  std::mt19937 rng(11);
  const float inf = std::numeric_limits<float>::infinity();
  for (size_t n : {size_t{1}, size_t{2}, size_t{7}, size_t{1000}, size_t{4099}, size_t{129280}}) {
    std::vector<float> logits(n);
    std::uniform_int_distribution<int> kind(0, 9);
    std::normal_distribution<float> normal(0.0f, 4.0f);
    for (float& l : logits) {
      switch (kind(rng)) {
        case 0:
          l = 0.0f;
          break;
        case 1:
          l = -0.0f;
          break;
        case 2:
          l = static_cast<float>(static_cast<int>(rng() % 7) - 3);
          break;  // Ties.
        case 3:
          l = (rng() & 1) != 0 ? inf : -inf;
          break;
        case 4:
          l = ((rng() & 1) != 0 ? 1.0f : -1.0f) * 1e-40f;
          break;  // Denormal.
        default:
          l = normal(rng);
          break;
      }
    }
    std::vector<int32_t> reference(n);
    std::iota(reference.begin(), reference.end(), 0);
    std::sort(reference.begin(), reference.end(), [&](int32_t a, int32_t b) {
      return logits[a] != logits[b] ? logits[a] > logits[b] : a < b;
    });
    for (size_t keep : {size_t{1}, size_t{3}, n / 8, n / 8 + 1, n / 2, n - 1, n}) {
      if (keep == 0 || keep > n) continue;
      const std::vector<int32_t> got = CandidateOrder(logits, keep);
      BOOST_REQUIRE(got.size() == keep);
      BOOST_TEST(std::equal(got.begin(), got.end(), reference.begin()),
                 "n " << n << ", keep " << keep);
    }
  }
  // NaNs go last, the others in order.
  const std::vector<int32_t> got =
      CandidateOrder(std::vector<float>{1.0f, std::nanf(""), 3.0f, -2.0f}, 4);
  BOOST_TEST(got == (std::vector<int32_t>{2, 0, 3, 1}), boost::test_tools::per_element());
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

// Speculative sampling: tokens drafted from q and verified against the model's logits follow
// the model's own sampling distribution p exactly. 200,000 verifications per case over 1,000
// seeds, a chi-square test over the candidates at a false-alarm rate of 1e-4 (critical values
// below). Power: a bias of 0.01 in the probability of two tokens of p ~ 0.1 gives a
// non-centrality of about 400, so such an error is caught with certainty; emitting the draft
// unverified (the distribution q) gives thousands.
BOOST_AUTO_TEST_CASE(speculative_sampling_keeps_the_models_distribution) {
  struct Case {
    const char* name;
    SamplingParams params;
    std::vector<double> p, q;
  };
  SamplingParams top3 = Params(1.0f, 11);
  top3.top_k = 3;
  SamplingParams hot = Params(0.7f, 12);
  std::vector<Case> cases = {
      {"t=1",
       Params(1.0f, 10),
       {0.3, 0.2, 0.15, 0.1, 0.1, 0.08, 0.05, 0.02},
       {0.05, 0.1, 0.3, 0.05, 0.2, 0.1, 0.1, 0.1}},
      {"top_k=3", top3, {0.3, 0.25, 0.2, 0.1, 0.1, 0.05}, {0.1, 0.1, 0.1, 0.3, 0.2, 0.2}},
      {"t=0.7", hot, {0.4, 0.3, 0.2, 0.1}, {0.25, 0.25, 0.25, 0.25}},
  };
  // Chi-square critical values at 1e-4 by degrees of freedom.
  const std::map<size_t, double> critical = {{2, 18.42}, {3, 21.11}, {7, 29.88}};
  for (const Case& c : cases) {
    const std::vector<float> target = LogitsOf(c.p), draft = LogitsOf(c.q);
    const TokenDistribution q = Sampler(Params(1.0f), {}).Distribution(draft);
    const TokenDistribution want = Sampler(c.params, {}).Distribution(target);
    // 1,000 seeds (a request's sampler each), 200 verifications per seed.
    const int n = 200000;
    std::map<int32_t, int> h;
    int accepted = 0;
    for (uint64_t seed = 0; seed < 1000; ++seed) {
      Sampler drafter(Params(1.0f, 5000 + seed), {});
      SamplingParams vp = c.params;
      vp.seed = seed;
      Sampler verifier(vp, {});
      for (int i = 0; i < n / 1000; ++i) {
        const int32_t d = drafter.Draw(q);
        bool ok = false;
        const int32_t t = verifier.Verify(target, d, q, &ok);
        if (ok) BOOST_REQUIRE(t == d);
        accepted += ok;
        h[t] += 1;
      }
    }
    double chi2 = 0;
    for (size_t i = 0; i < want.ids.size(); ++i) {
      const double e = n * want.P(want.ids[i]);
      const double o = h.count(want.ids[i]) ? h[want.ids[i]] : 0;
      chi2 += (o - e) * (o - e) / e;
    }
    int outside = n;
    for (int32_t id : want.ids) outside -= h.count(id) ? h[id] : 0;
    BOOST_TEST(outside == 0, c.name);
    const size_t df = want.ids.size() - 1;
    BOOST_REQUIRE(critical.count(df));
    BOOST_TEST(chi2 < critical.at(df), c.name << " chi2 " << chi2 << " df " << df);
    // The acceptance rate is sum over x of min(p, q).
    double overlap = 0;
    for (int32_t id : want.ids) overlap += std::min(want.P(id), q.P(id));
    BOOST_TEST(std::abs(double(accepted) / n - overlap) < 0.01, c.name);
  }
  // Greedy: the argmax, accepted exactly when the draft is it; no random numbers drawn.
  Sampler g(Params(0.0f), {});
  const std::vector<float> l = {0.1f, 2.0f, 1.0f};
  TokenDistribution any = g.Distribution(std::vector<float>{1.0f, 0.0f, 0.0f});
  bool ok = false;
  BOOST_TEST(g.Verify(l, 1, any, &ok) == 1);
  BOOST_TEST(ok);
  BOOST_TEST(g.Verify(l, 2, any, &ok) == 1);
  BOOST_TEST(!ok);
}

// Sample() is Record(Draw(Distribution())): the refactoring into parts changed no draw.
BOOST_AUTO_TEST_CASE(sample_is_distribution_draw_record) {
  SamplingParams p = Params(0.8f, 5);
  p.top_p = 0.9f;
  p.presence_penalty = 0.5f;
  Sampler a(p, {}), b(p, {});
  const std::vector<float> logits = {0.5f, 1.5f, -0.2f, 1.0f, 0.9f, 0.0f};
  for (int i = 0; i < 200; ++i) {
    const int32_t x = a.Sample(logits).token;
    const int32_t y = b.Record(b.Draw(b.Distribution(logits)), logits).token;
    BOOST_REQUIRE(x == y);
  }
}

BOOST_AUTO_TEST_SUITE_END()

}  // namespace
}  // namespace flashd::engine
