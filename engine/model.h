// Model: a model directory opened for serving: its validated config, its checkpoint mapped
// read-only, and every backbone and Engram tensor bound by name.
//
// Load() is slow for real checkpoints (it maps and checks hundreds of files); the daemon runs it
// on a background thread and reports "loading" until it returns. The object is immutable after
// Load() and may be read from any thread.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "config/status.h"
#include "engine/model_config.h"
#include "engine/model_info.h"
#include "engine/safetensors.h"
#include "engine/weights.h"

namespace flashd::engine {

class Model {
 public:
  static StatusOr<std::unique_ptr<Model>> Load(const std::string& dir);

  const std::string& dir() const { return dir_; }
  const ModelConfig& config() const { return config_; }
  const Checkpoint& checkpoint() const { return *checkpoint_; }
  const BoundWeights& weights() const { return weights_; }
  const ModelStats& stats() const { return stats_; }

 private:
  Model() = default;

  std::string dir_;
  ModelConfig config_;
  std::unique_ptr<Checkpoint> checkpoint_;
  BoundWeights weights_;
  ModelStats stats_;
};

// The directory of the embedded default model under `state_dir`. EnsureDefaultModel() writes it
// (a fixed seed, so every install gets the same weights) unless a complete copy is there, with
// the tokenizer files of `tokenizer_dir` when that holds them.
// A copy is complete when its marker, config and weights are there and, if a tokenizer is
// available now, it holds one: a copy written before the tokenizer was installed is written
// again, not kept without one forever.
std::string DefaultModelDir(const std::string& state_dir);
// `progress`, when given, hears of the parameters generated so far and in all.
Status EnsureDefaultModel(const std::string& state_dir, const std::string& tokenizer_dir,
                          const std::function<void(uint64_t, uint64_t)>& progress = nullptr);

// Where the embedded default model's tokenizer is when model.tokenizer_dir is "": installed with
// the binary (PREFIX/share/flashd/tokenizer/deepseek-v4 for PREFIX/bin/flashd), else in the
// build tree (build/tokenizer/deepseek-v4 for build/bin/flashd). Empty when neither holds
// tokenizer.json. Independent of the working directory.
std::string FindDefaultTokenizerDir();

}  // namespace flashd::engine
