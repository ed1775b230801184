// Tiny checkpoints in the exact released format, for tests and the embedded default model.
//
// The generator writes what the release has: config.json with the same keys, safetensors with
// the same tensor names, dtypes and scale layouts (FP8 32x32-block weights, FP4 experts as packed
// I8 with E8M0 scales, FP8 Engram rows), sharded with model.safetensors.index.json when asked,
// and the tokenizer files when given. Weights are random, from a fixed seed, scaled so that
// activations stay in range; the model they make writes meaningless text.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

#include "config/status.h"

namespace flashd::engine {

struct TinyModelOptions {
  uint64_t seed = 0;
  int shards = 1;             // 1: a single model.safetensors; more: an index and N shards.
  std::string tokenizer_dir;  // tokenizer.json and tokenizer_config.json are copied from here.
  // Called after each tensor is generated with the parameters done and in all (may be empty).
  std::function<void(uint64_t done, uint64_t total)> progress;
};

// The default tiny config (hidden 256, 6 layers, 8 experts, two Engram layers of a few thousand
// rows, one DSpark stage) with `overrides` applied: a JSON object of text_config keys, plus
// optional "quantization_config" and "vision_config" objects and top-level token ids. Returns
// config.json text; it is validated like any model's.
StatusOr<std::string> TinyConfigJson(std::string_view overrides_json);

// The released config (built in from tests/data/deepseek-v4.1-flash/config.json) cut to its
// first `layers` layers, every list of layer ids cut to match, with `overrides` applied as above.
StatusOr<std::string> ReleasedConfigJson(int layers, std::string_view overrides_json);
const char* ReleasedConfigText();

// Writes a checkpoint of any size without holding it: every tensor streamed to its shard as valid
// random codes of its kind (not the tiny model's quantized normals), a fixed seed. Its use is
// loading at the released model's scale (bench/load_bench); the values mean nothing.
Status WriteLargeModel(const std::string& dir, std::string_view config_json,
                       const TinyModelOptions& options);

// Writes config.json, the weights and the tokenizer files into `dir` (created if needed).
Status WriteTinyModel(const std::string& dir, std::string_view config_json,
                      const TinyModelOptions& options);

}  // namespace flashd::engine
