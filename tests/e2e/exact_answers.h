// Completions whose exactness end-to-end tests check: greedy, with log-probabilities, compared
// with what a daemon with an empty cache answers for the same prompt.
#pragma once

#include <httplib.h>

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace flashd::testing {

// `n` token ids of the shared tiny model's vocabulary, from a seeded generator.
std::vector<int> Ids(size_t n, uint32_t seed);
std::vector<int> Concat(std::vector<int> a, const std::vector<int>& b);

struct Answer {
  int status = 0;
  std::string text;
  nlohmann::json logprobs;  // Compared as JSON text: equal floats print equally.
  int64_t cached = -1;
  std::string raw;
};

// A greedy /v1/completions of `prompt` with log-probabilities and the cached-token count.
Answer Ask(httplib::Client& c, const std::vector<int>& prompt, int max_tokens = 8);

// Both answered, with the same text and the same log-probabilities to the last bit.
bool Same(const Answer& a, const Answer& b);

// What a daemon with an empty cache answers (a fresh daemon in a temporary directory).
Answer Fresh(const std::vector<int>& prompt, int max_tokens = 8);

}  // namespace flashd::testing
