#include "engine/model.h"

#include <spdlog/spdlog.h>

#include <chrono>
#include <filesystem>
#include <fstream>

#include "engine/tiny_model.h"

namespace flashd::engine {
namespace {

// Bump when the default model's spec changes, so old copies are regenerated.
constexpr const char* kDefaultModelName = "default-tiny-v2";
constexpr uint64_t kDefaultModelSeed = 20260910;

}  // namespace

StatusOr<std::unique_ptr<Model>> Model::Load(const std::string& dir) {
  const auto start = std::chrono::steady_clock::now();
  std::unique_ptr<Model> m(new Model());
  m->dir_ = dir;
  FLASHD_ASSIGN_OR_RETURN(m->config_, LoadModelConfig(dir));
  spdlog::info("model {}: config valid: {} layers, hidden {}, {} experts", dir,
               m->config_.num_hidden_layers, m->config_.hidden_size, m->config_.n_routed_experts);
  FLASHD_ASSIGN_OR_RETURN(m->checkpoint_, Checkpoint::Open(dir));
  spdlog::info(
      "model {}: mapped {} files, {:.2f} GiB, {} tensors", dir, m->checkpoint_->files().size(),
      m->checkpoint_->total_file_bytes() / double(1ull << 30), m->checkpoint_->tensors().size());
  FLASHD_ASSIGN_OR_RETURN(m->weights_, BindWeights(m->config_, *m->checkpoint_));
  if (m->weights_.dspark) {
    spdlog::info("model {}: DSpark drafter complete ({} stages)", dir,
                 m->config_.num_nextn_predict_layers);
  } else if (m->config_.num_nextn_predict_layers > 0) {
    spdlog::info(
        "model {}: DSpark drafter incomplete ({} tensors missing): no speculative decoding", dir,
        m->weights_.dspark_missing);
  }
  for (const auto& [part, counts] : m->weights_.unused) {
    spdlog::info("model {}: {} {} tensors ({:.2f} GiB) present but not used by this engine yet",
                 dir, counts.first, ModelPartName(part), counts.second / double(1ull << 30));
  }
  if (!m->weights_.unexpected.empty()) {
    spdlog::warn("model {}: {} tensors match no part of the model, e.g. {}", dir,
                 m->weights_.unexpected.size(), m->weights_.unexpected.front());
  }
  m->stats_ = ComputeModelStats(m->config_);
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  spdlog::info("model {}: bound {} tensors in {:.2f} s; KV {:.0f} bytes/token", dir,
               m->weights_.tensors.size(), seconds, m->stats_.kv_bytes_per_token);
  return m;
}

std::string DefaultModelDir(const std::string& state_dir) {
  return (std::filesystem::path(state_dir) / "models" / kDefaultModelName).string();
}

std::string FindDefaultTokenizerDir() {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (ec) return "";
  const fs::path bin = exe.parent_path();
  for (const fs::path& dir : {bin / ".." / "share" / "flashd" / "tokenizer" / "deepseek-v4",
                              bin / ".." / "tokenizer" / "deepseek-v4"}) {
    if (fs::exists(dir / "tokenizer.json", ec)) return fs::weakly_canonical(dir, ec).string();
  }
  return "";
}

Status EnsureDefaultModel(const std::string& state_dir, const std::string& tokenizer_dir,
                          const std::function<void(uint64_t, uint64_t)>& progress) {
  namespace fs = std::filesystem;
  const fs::path dir = DefaultModelDir(state_dir);
  const fs::path done = dir / ".complete";
  std::error_code ec;
  const bool have_tokenizer =
      !tokenizer_dir.empty() && fs::exists(fs::path(tokenizer_dir) / "tokenizer.json", ec);
  if (fs::exists(done, ec) && fs::exists(dir / "config.json", ec) &&
      fs::exists(dir / "model.safetensors", ec)) {
    if (!have_tokenizer || fs::exists(dir / "tokenizer.json", ec)) return Status::Ok();
    spdlog::info(
        "the embedded default model in {} has no tokenizer and one is available now: "
        "writing it again",
        dir.string());
  } else if (fs::exists(dir, ec)) {
    spdlog::warn("the embedded default model in {} is incomplete: writing it again", dir.string());
  }
  spdlog::info("writing the embedded default model (random weights) to {}", dir.string());
  // Write aside and rename, so a crash mid-way never leaves a half model that looks complete.
  const fs::path tmp = dir.string() + ".tmp";
  fs::remove_all(tmp, ec);
  FLASHD_ASSIGN_OR_RETURN(std::string config, TinyConfigJson(""));
  TinyModelOptions options;
  options.seed = kDefaultModelSeed;
  options.progress = progress;
  if (have_tokenizer) {
    options.tokenizer_dir = tokenizer_dir;
  } else {
    spdlog::warn(
        "no tokenizer.json in \"{}\" (model.tokenizer_dir): the embedded default model "
        "will have no tokenizer, so it cannot tokenize or generate",
        tokenizer_dir);
  }
  Status written = WriteTinyModel(tmp.string(), config, options);
  if (written.ok()) {
    std::ofstream complete(tmp / ".complete");
    complete << kDefaultModelName << "\n";
    complete.close();
    if (!complete) written = IoError("cannot write " + (tmp / ".complete").string());
  }
  if (!written.ok()) {
    // A disk too small for the model must not keep a half-written copy of it.
    fs::remove_all(tmp, ec);
    return written;
  }
  fs::remove_all(dir, ec);
  fs::rename(tmp, dir, ec);
  if (ec)
    return IoError("cannot move " + tmp.string() + " to " + dir.string() + ": " + ec.message());
  return Status::Ok();
}

}  // namespace flashd::engine
