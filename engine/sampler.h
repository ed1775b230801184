// Sampler: turns a step's logits into the next token for one request.
//
// Each request owns its sampler and its random stream, so a seeded request draws the same tokens
// whatever else shares its batch. Order of operations: penalties on the logits (repetition over
// prompt and output, presence and frequency over output), then greedy when temperature is 0,
// else temperature, top-k, top-p, min-p, and a draw. Log-probabilities are those of the model's
// raw logits (log-softmax before any penalty or temperature), as the OpenAI API reports them.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "config/status.h"

namespace flashd::engine {

struct SamplingParams {
  float temperature = 1.0f;         // 0: greedy.
  int top_k = 0;                    // 0: off.
  float top_p = 1.0f;               // 1: off.
  float min_p = 0.0f;               // 0: off.
  float repetition_penalty = 1.0f;  // 1: off; >1 discourages tokens already seen.
  float presence_penalty = 0.0f;    // OpenAI semantics, -2..2.
  float frequency_penalty = 0.0f;   // OpenAI semantics, -2..2.
  std::optional<uint64_t> seed;     // Unset: a random seed.
  int max_tokens = 256;
  std::vector<std::string> stop;     // Stop strings (not included in the output).
  std::vector<int32_t> stop_tokens;  // Besides the model's end-of-sentence token.
  bool ignore_eos = false;           // Generate past end-of-sentence (benchmarks, tests).
  int logprobs = 0;                  // Top-n log-probabilities per token (0-20).
  // The chosen token's log-probability (SampledToken::logprob; also when logprobs > 0). Off, a
  // token costs no pass over the vocabulary's exponentials (about 0.8 ms at 129,280 entries).
  bool want_logprob = false;

  // Checks ranges; errors name the field.
  Status Validate() const;
};

struct SampledToken {
  int32_t token = -1;
  float logprob = 0.0f;  // Of the chosen token (0 unless want_logprob or logprobs > 0).
  std::vector<std::pair<int32_t, float>> top;  // The top-n alternatives, when asked.
};

// The distribution a sampler draws from at one step: candidate ids with weights (summing to
// total), after penalties, temperature, top-k, top-p and min-p; one id when greedy.
struct TokenDistribution {
  std::vector<int32_t> ids;
  std::vector<double> weights;
  double total = 1;
  bool greedy = false;            // Temperature 0: the one id, drawn without a random number.
  double P(int32_t token) const;  // Probability of `token` (0 outside the candidates).
};

// The ids of the `keep` largest of `logits` (keep <= size), largest first, equal values (+0 and -0
// alike) in ascending id; NaNs last. The order a comparison sort of the ids by (value descending,
// id ascending) gives, made by a radix sort of the values' bits where most of the ids are kept,
// by a selection where few are: at 129,280 logits the comparison sort took about 14 ms.
std::vector<int32_t> CandidateOrder(std::span<const float> logits, size_t keep);

class Sampler {
 public:
  Sampler(SamplingParams params, std::span<const int32_t> prompt);

  // Picks the next token from vocab-sized logits and records it as output:
  // Record(Draw(Distribution(logits)), logits).
  SampledToken Sample(std::span<const float> logits);
  TokenDistribution Distribution(std::span<const float> logits) const;
  // One token from `d`: one random number unless greedy.
  int32_t Draw(const TokenDistribution& d);
  // Records `token` as output and reports its log-probabilities under the raw logits, those
  // the params ask for.
  SampledToken Record(int32_t token, std::span<const float> raw);
  // Speculative sampling: `drafted` was drawn from `draft`; returns the token to emit at this
  // step, drawn so that it follows Distribution(logits) exactly: the draft with probability
  // min(1, p/q), else a draw from the normalised residual max(0, p - q). Greedy: the argmax,
  // which is the draft when they agree. Does not record the token (Record does).
  int32_t Verify(std::span<const float> logits, int32_t drafted, const TokenDistribution& draft,
                 bool* accepted);
  const SamplingParams& params() const { return params_; }
  uint64_t seed() const { return seed_; }

 private:
  double Uniform();  // [0, 1), from the request's own stream.

  SamplingParams params_;
  uint64_t seed_;
  uint64_t state_;
  std::unordered_map<int32_t, int> seen_in_prompt_;
  std::unordered_map<int32_t, int> output_counts_;
};

}  // namespace flashd::engine
