#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

namespace flashd::engine {

Status SamplingParams::Validate() const {
  if (!(temperature >= 0.0f && temperature <= 100.0f)) {
    return InvalidArgument("temperature: expected a number in [0, 100]");
  }
  if (top_k < 0) return InvalidArgument("top_k: expected 0 (off) or a positive integer");
  if (!(top_p > 0.0f && top_p <= 1.0f)) return InvalidArgument("top_p: expected (0, 1]");
  if (!(min_p >= 0.0f && min_p <= 1.0f)) return InvalidArgument("min_p: expected [0, 1]");
  if (!(repetition_penalty > 0.0f && repetition_penalty <= 10.0f)) {
    return InvalidArgument("repetition_penalty: expected (0, 10]");
  }
  if (!(presence_penalty >= -2.0f && presence_penalty <= 2.0f)) {
    return InvalidArgument("presence_penalty: expected [-2, 2]");
  }
  if (!(frequency_penalty >= -2.0f && frequency_penalty <= 2.0f)) {
    return InvalidArgument("frequency_penalty: expected [-2, 2]");
  }
  if (max_tokens < 1) return InvalidArgument("max_tokens: expected a positive integer");
  if (logprobs < 0 || logprobs > 20) return InvalidArgument("logprobs: expected 0 to 20");
  if (stop.size() > 16) return InvalidArgument("stop: at most 16 stop strings");
  for (const std::string& s : stop) {
    if (s.empty()) return InvalidArgument("stop: stop strings must not be empty");
  }
  return Status::Ok();
}

Sampler::Sampler(SamplingParams params, std::span<const int32_t> prompt)
    : params_(std::move(params)) {
  seed_ = params_.seed ? *params_.seed
                       : (uint64_t(std::random_device{}()) << 32) ^ std::random_device{}();
  state_ = seed_;
  if (params_.repetition_penalty != 1.0f) {
    for (int32_t t : prompt) seen_in_prompt_[t] += 1;
  }
}

double Sampler::Uniform() {
  // SplitMix64: a fixed, portable stream per request.
  uint64_t z = (state_ += 0x9E3779B97F4A7C15ULL);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  z ^= z >> 31;
  return static_cast<double>(z >> 11) * 0x1p-53;
}

double TokenDistribution::P(int32_t token) const {
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] == token) return weights[i] / total;
  }
  return 0;
}

SampledToken Sampler::Sample(std::span<const float> raw) {
  return Record(Draw(Distribution(raw)), raw);
}

TokenDistribution Sampler::Distribution(std::span<const float> raw) const {
  const size_t V = raw.size();
  std::vector<float> logits(raw.begin(), raw.end());

  // Penalties.
  if (params_.repetition_penalty != 1.0f) {
    auto penalize = [&](int32_t t) {
      float& l = logits[static_cast<size_t>(t)];
      l = l > 0 ? l / params_.repetition_penalty : l * params_.repetition_penalty;
    };
    for (const auto& [t, n] : seen_in_prompt_) {
      if (static_cast<size_t>(t) < V && !output_counts_.count(t)) penalize(t);
    }
    for (const auto& [t, n] : output_counts_) {
      if (static_cast<size_t>(t) < V) penalize(t);
    }
  }
  for (const auto& [t, n] : output_counts_) {
    if (static_cast<size_t>(t) >= V) continue;
    logits[static_cast<size_t>(t)] -= params_.presence_penalty + params_.frequency_penalty * n;
  }

  TokenDistribution d;
  if (params_.temperature == 0.0f) {
    d.ids = {static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin())};
    d.weights = {1.0};
    d.greedy = true;
    return d;
  }
  std::vector<int32_t> idx(V);
  std::iota(idx.begin(), idx.end(), 0);
  // Candidates in descending logit order (ties to the lower id), cut by top-k.
  size_t keep = params_.top_k > 0 ? std::min<size_t>(params_.top_k, V) : V;
  std::partial_sort(idx.begin(), idx.begin() + keep, idx.end(), [&](int32_t a, int32_t b) {
    return logits[a] != logits[b] ? logits[a] > logits[b] : a < b;
  });
  idx.resize(keep);
  const double inv_t = 1.0 / params_.temperature;
  const double top = logits[idx[0]];
  std::vector<double> p(keep);
  double sum = 0;
  for (size_t i = 0; i < keep; ++i) sum += (p[i] = std::exp((logits[idx[i]] - top) * inv_t));
  for (double& v : p) v /= sum;
  // top-p: the smallest prefix whose mass reaches top_p.
  if (params_.top_p < 1.0f) {
    double mass = 0;
    size_t n = 0;
    while (n < keep && mass < params_.top_p) mass += p[n++];
    keep = std::max<size_t>(n, 1);
  }
  // min-p: drop tokens below min_p times the most likely one.
  if (params_.min_p > 0.0f) {
    size_t n = 1;
    while (n < keep && p[n] >= params_.min_p * p[0]) ++n;
    keep = n;
  }
  double total = 0;
  for (size_t i = 0; i < keep; ++i) total += p[i];
  idx.resize(keep);
  p.resize(keep);
  d.ids = std::move(idx);
  d.weights = std::move(p);
  d.total = total;
  return d;
}

int32_t Sampler::Draw(const TokenDistribution& d) {
  if (d.greedy) return d.ids[0];
  double r = Uniform() * d.total;
  for (size_t i = 0; i < d.ids.size(); ++i) {
    r -= d.weights[i];
    if (r < 0) return d.ids[i];
  }
  return d.ids.back();
}

int32_t Sampler::Verify(std::span<const float> logits, int32_t drafted,
                        const TokenDistribution& draft, bool* accepted) {
  const TokenDistribution p = Distribution(logits);
  if (params_.temperature == 0.0f) {
    *accepted = p.ids[0] == drafted;
    return p.ids[0];
  }
  const double pd = p.P(drafted), qd = draft.P(drafted);
  if (qd > 0 && Uniform() * qd < pd) {
    *accepted = true;
    return drafted;
  }
  *accepted = false;
  // The residual max(0, p - q), normalised; p itself when it is empty (p == q).
  std::unordered_map<int32_t, double> q;
  q.reserve(draft.ids.size());
  for (size_t i = 0; i < draft.ids.size(); ++i) q[draft.ids[i]] = draft.weights[i] / draft.total;
  TokenDistribution r;
  r.total = 0;
  for (size_t i = 0; i < p.ids.size(); ++i) {
    const auto it = q.find(p.ids[i]);
    const double w = std::max(0.0, p.weights[i] / p.total - (it == q.end() ? 0.0 : it->second));
    if (w <= 0) continue;
    r.ids.push_back(p.ids[i]);
    r.weights.push_back(w);
    r.total += w;
  }
  if (r.ids.empty()) return Draw(p);
  if (r.ids.size() == 1) return r.ids[0];
  return Draw(r);
}

SampledToken Sampler::Record(int32_t chosen, std::span<const float> raw) {
  const size_t V = raw.size();
  output_counts_[chosen] += 1;

  // Log-probabilities of the raw distribution.
  SampledToken out;
  out.token = chosen;
  const float mx = *std::max_element(raw.begin(), raw.end());
  double z = 0;
  for (float l : raw) z += std::exp(double(l) - mx);
  const double log_z = mx + std::log(z);
  out.logprob = static_cast<float>(raw[chosen] - log_z);
  if (params_.logprobs > 0) {
    std::vector<int32_t> idx(V);
    std::iota(idx.begin(), idx.end(), 0);
    const size_t n = std::min<size_t>(params_.logprobs, V);
    std::partial_sort(idx.begin(), idx.begin() + n, idx.end(), [&](int32_t a, int32_t b) {
      return raw[a] != raw[b] ? raw[a] > raw[b] : a < b;
    });
    for (size_t i = 0; i < n; ++i)
      out.top.push_back({idx[i], static_cast<float>(raw[idx[i]] - log_z)});
  }
  return out;
}

}  // namespace flashd::engine
