#include "engine/sampler.h"

#include <algorithm>
#include <bit>
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

namespace {

// A logit's rank as an unsigned key: a larger value a smaller key, +0 and -0 one key, NaN the
// largest key.
uint32_t DescendingKey(float f) {
  if (std::isnan(f)) return UINT32_MAX;
  if (f == 0.0f) f = 0.0f;
  const uint32_t u = std::bit_cast<uint32_t>(f);
  const uint32_t ascending = (u & 0x80000000u) != 0 ? ~u : u | 0x80000000u;
  return ~ascending;
}

// Orders items (a key above an id) by key, keeping equal keys in the order they came: least
// significant digit first, 11 bits of the key a pass, each pass stable, the passes' counts made
// in one read.
void SortByKey(std::vector<uint64_t>* items) {
  constexpr int kBits = 11, kPasses = 3;
  constexpr size_t kDigits = size_t{1} << kBits;
  const size_t n = items->size();
  std::vector<size_t> start(kPasses * kDigits, 0);
  for (uint64_t v : *items) {
    for (int pass = 0; pass < kPasses; ++pass) {
      ++start[pass * kDigits + ((v >> (32 + pass * kBits)) & (kDigits - 1))];
    }
  }
  thread_local std::vector<uint64_t> other;
  other.resize(n);
  for (int pass = 0; pass < kPasses; ++pass) {
    size_t* first = &start[pass * kDigits];
    if (std::find(first, first + kDigits, n) != first + kDigits) continue;  // One digit.
    for (size_t d = 0, sum = 0; d < kDigits; ++d) {
      const size_t count = first[d];
      first[d] = sum;
      sum += count;
    }
    const int shift = 32 + pass * kBits;
    for (uint64_t v : *items) other[first[(v >> shift) & (kDigits - 1)]++] = v;
    items->swap(other);
  }
}

}  // namespace

std::vector<int32_t> CandidateOrder(std::span<const float> logits, size_t keep) {
  const size_t n = logits.size();
  keep = std::min(keep, n);
  // The work buffers stay with the thread from call to call (a sampling thread's few MB), so
  // that each call does not fault in fresh pages for them.
  thread_local std::vector<uint32_t> keys;
  thread_local std::vector<uint64_t> items;
  keys.resize(n);
  items.clear();
  for (size_t i = 0; i < n; ++i) keys[i] = DescendingKey(logits[i]);
  // Each candidate as its key above its id, in id order: ordered by key, equal keys stay in
  // id order.
  if (keep * 8 < n) {
    // Few kept: only the ids whose key's top 11 bits are at most those of the keep-th.
    std::vector<size_t> count(size_t{1} << 11, 0);
    for (uint32_t k : keys) ++count[k >> 21];
    uint32_t last = 0;  // The keep-th's top bits.
    size_t below = 0;   // Candidates with smaller top bits.
    while (below + count[last] < keep) below += count[last++];
    for (size_t i = 0; i < n; ++i) {
      if ((keys[i] >> 21) <= last) items.push_back(uint64_t{keys[i]} << 32 | i);
    }
  } else {
    items.resize(n);
    for (size_t i = 0; i < n; ++i) items[i] = uint64_t{keys[i]} << 32 | i;
  }
  if (items.size() > 4096) {
    SortByKey(&items);
  } else {
    std::sort(items.begin(), items.end());
  }
  std::vector<int32_t> ids(keep);
  for (size_t i = 0; i < keep; ++i) ids[i] = static_cast<int32_t>(items[i] & 0xFFFFFFFFu);
  return ids;
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
  // Candidates in descending logit order (ties to the lower id), cut by top-k.
  size_t keep = params_.top_k > 0 ? std::min<size_t>(params_.top_k, V) : V;
  std::vector<int32_t> idx = CandidateOrder(logits, keep);
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

  // Log-probabilities of the raw distribution, when asked.
  SampledToken out;
  out.token = chosen;
  if (!params_.want_logprob && params_.logprobs <= 0) return out;
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
