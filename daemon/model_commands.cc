#include "daemon/model_commands.h"

#include <yaml-cpp/yaml.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>

#include "config/config.h"
#include "engine/engram.h"
#include "engine/gpu_backend.h"
#include "engine/model.h"
#include "engine/model_config.h"
#include "engine/model_info.h"
#include "engine/placement_plan.h"
#include "engine/tiny_model.h"
#include "engine/tokenizer.h"

namespace flashd::daemon {
namespace {

using nlohmann::json;

constexpr int kExitOk = 0;
constexpr int kExitUsage = 2;

bool WantsHelp(const std::vector<std::string>& args) {
  for (const std::string& a : args) {
    if (a == "--help" || a == "-h") return true;
  }
  return false;
}

// A YAML value as JSON: integers, floats and booleans keep their type, the rest are strings.
json YamlToJson(const YAML::Node& node) {
  switch (node.Type()) {
    case YAML::NodeType::Sequence: {
      json out = json::array();
      for (const auto& item : node) out.push_back(YamlToJson(item));
      return out;
    }
    case YAML::NodeType::Map: {
      json out = json::object();
      for (const auto& kv : node) out[kv.first.as<std::string>()] = YamlToJson(kv.second);
      return out;
    }
    case YAML::NodeType::Scalar: {
      const std::string s = node.Scalar();
      if (node.Tag() != "!") {  // Quoted scalars stay strings.
        int64_t i;
        if (YAML::convert<int64_t>::decode(node, i)) return i;
        double d;
        if (YAML::convert<double>::decode(node, d)) return d;
        bool b;
        if (YAML::convert<bool>::decode(node, b)) return b;
      }
      return s;
    }
    default:
      return nullptr;
  }
}

void PrintMkModelHelp() {
  std::printf(
      "Usage: flashd mkmodel OUT_DIR [options]\n\n"
      "Writes a tiny checkpoint in the exact released DeepSeek-V4.1-Flash format (config.json,\n"
      "safetensors with the released tensor names, dtypes and scale layouts) with random\n"
      "weights from a fixed seed. The default is hidden 256, 6 layers, 8 experts, two Engram\n"
      "layers of a few thousand rows and one DSpark stage.\n\n"
      "Options:\n"
      "  --spec FILE       YAML mapping of text_config keys to change (e.g. hidden_size: 512);\n"
      "                    quantization_config / vision_config mappings are merged too\n"
      "  --set KEY=VALUE   one key, VALUE in YAML syntax (e.g. --set compress_ratios=[0,2,1])\n"
      "  --shards N        split into N files with model.safetensors.index.json (default 1)\n"
      "  --layers N        the released dimensions instead, cut to the first N layers (every\n"
      "                    list of layer ids cut to match), written as random codes of each\n"
      "                    tensor's kind streamed to disk: checkpoints of tens of GB for\n"
      "                    loading benchmarks (shrink Engram with --set engram_vocab_size=V)\n"
      "  --seed N          random seed (default 0)\n"
      "  --tokenizer DIR   copy tokenizer.json and tokenizer_config.json from DIR\n"
      "  --print-config    print the resulting config.json and write nothing\n");
}

void PrintModelInfoHelp() {
  std::printf(
      "Usage: flashd model-info DIR|config.json [--json]\n\n"
      "Reports parameter counts (backbone, Engram, DSpark, vision), active parameters per token\n"
      "for prefill and decode, KV cache bytes per token and per-sequence state, and checkpoint\n"
      "bytes by dtype. Given a directory with safetensors files, also binds every tensor and\n"
      "reports what the checkpoint holds beyond what the engine uses. The formulas are in\n"
      "docs/model.md.\n\n"
      "  --json   print one JSON object\n");
}

std::string Billions(uint64_t n) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.3fB (%llu)", n / 1e9, static_cast<unsigned long long>(n));
  return buf;
}

}  // namespace

int MkModelCommand(const std::vector<std::string>& args) {
  if (WantsHelp(args)) {
    PrintMkModelHelp();
    return kExitOk;
  }
  std::string out_dir;
  json overrides = json::object();
  engine::TinyModelOptions options;
  bool print_only = false;
  int layers = 0;  // 0: the tiny model.
  auto fail = [](const std::string& message) {
    std::fprintf(stderr, "flashd mkmodel: %s\n", message.c_str());
    return kExitUsage;
  };
  try {
    for (size_t i = 0; i < args.size(); ++i) {
      const std::string& a = args[i];
      auto value = [&]() -> std::string {
        if (i + 1 >= args.size()) throw std::invalid_argument(a + " needs a value");
        return args[++i];
      };
      if (a == "--spec") {
        std::string path = value();
        YAML::Node spec = YAML::LoadFile(path);
        if (!spec.IsNull() && !spec.IsMap()) return fail(path + ": expected a mapping of keys");
        if (spec.IsMap()) overrides.merge_patch(YamlToJson(spec));
      } else if (a == "--set") {
        std::string kv = value();
        size_t eq = kv.find('=');
        if (eq == std::string::npos || eq == 0) return fail("--set expects KEY=VALUE, got " + kv);
        overrides[kv.substr(0, eq)] = YamlToJson(YAML::Load(kv.substr(eq + 1)));
      } else if (a == "--shards") {
        options.shards = std::stoi(value());
      } else if (a == "--layers") {
        layers = std::stoi(value());
        if (layers < 1) return fail("--layers must be at least 1");
      } else if (a == "--seed") {
        options.seed = std::stoull(value());
      } else if (a == "--tokenizer") {
        options.tokenizer_dir = value();
      } else if (a == "--print-config") {
        print_only = true;
      } else if (!a.empty() && a[0] == '-') {
        return fail("unknown option " + a + " (see flashd mkmodel --help)");
      } else if (out_dir.empty()) {
        out_dir = a;
      } else {
        return fail("unexpected argument " + a);
      }
    }
  } catch (const YAML::Exception& e) {
    return fail(std::string("spec: ") + e.what());
  } catch (const std::exception& e) {
    return fail(e.what());
  }
  if (out_dir.empty() && !print_only) return fail("missing OUT_DIR (see flashd mkmodel --help)");
  StatusOr<std::string> config = layers > 0 ? engine::ReleasedConfigJson(layers, overrides.dump())
                                            : engine::TinyConfigJson(overrides.dump());
  if (!config.ok()) return fail(config.status().message());
  if (print_only) {
    std::printf("%s\n", config->c_str());
    return kExitOk;
  }
  if (layers > 0) {
    // Progress on stderr: tens of GB take a while.
    int last = -1;
    options.progress = [&last](uint64_t done, uint64_t total) {
      const int pct = static_cast<int>(100 * done / std::max<uint64_t>(total, 1));
      if (pct / 5 == last / 5) return;
      last = pct;
      std::fprintf(stderr, "\rwriting: %d%% of %.1f GB", pct, total / 1e9);
      if (done == total) std::fprintf(stderr, "\n");
    };
  }
  Status s = layers > 0 ? engine::WriteLargeModel(out_dir, *config, options)
                        : engine::WriteTinyModel(out_dir, *config, options);
  if (!s.ok()) return fail(s.message());
  std::printf("wrote %s\n", out_dir.c_str());
  return kExitOk;
}

int ModelInfoCommand(const std::vector<std::string>& args) {
  if (WantsHelp(args)) {
    PrintModelInfoHelp();
    return kExitOk;
  }
  std::string path;
  bool as_json = false;
  for (const std::string& a : args) {
    if (a == "--json") {
      as_json = true;
    } else if (path.empty() && (a.empty() || a[0] != '-')) {
      path = a;
    } else {
      std::fprintf(stderr, "flashd model-info: unexpected argument %s\n", a.c_str());
      return kExitUsage;
    }
  }
  if (path.empty()) {
    std::fprintf(stderr, "flashd model-info: missing DIR or config.json\n");
    return kExitUsage;
  }
  StatusOr<engine::ModelConfig> config = engine::LoadModelConfig(path);
  if (!config.ok()) {
    std::fprintf(stderr, "flashd model-info: %s\n", config.status().message().c_str());
    return kExitUsage;
  }
  const engine::ModelStats s = engine::ComputeModelStats(*config);

  // With a checkpoint beside the config, bind it too: the check an operator wants first.
  namespace fs = std::filesystem;
  std::error_code ec;
  std::unique_ptr<engine::Model> model;
  if (fs::is_directory(path, ec)) {
    bool has_weights = fs::exists(fs::path(path) / "model.safetensors.index.json", ec);
    for (const auto& e : fs::directory_iterator(path, ec)) {
      has_weights = has_weights || e.path().extension() == ".safetensors";
    }
    if (has_weights) {
      auto loaded = engine::Model::Load(path);
      if (!loaded.ok()) {
        std::fprintf(stderr, "flashd model-info: %s\n", loaded.status().message().c_str());
        return kExitUsage;
      }
      model = std::move(*loaded);
    }
  }

  json kv = json::array();
  for (const engine::KvSourceBytes& k : s.kv_sources) {
    kv.push_back({{"layer", k.layer},
                  {"compress_ratio", k.compress_ratio},
                  {"entry_bytes", k.entry_bytes},
                  {"index_key_bytes", k.index_key_bytes},
                  {"bytes_per_token", k.bytes_per_token}});
  }
  json j = {
      {"model_type", config->model_type},
      {"params_backbone", s.params_backbone},
      {"params_engram", s.params_engram},
      {"params_dspark", s.params_dspark},
      {"params_vision", s.params_vision},
      {"params_active_prefill", s.params_active_prefill},
      {"params_active_prefill_without_replay", s.params_active_prefill_full},
      {"params_active_decode", s.params_active_decode},
      {"kv_bytes_per_token", static_cast<uint64_t>(std::llround(s.kv_bytes_per_token))},
      {"kv_bytes_per_token_exact", s.kv_bytes_per_token},
      {"kv_sources", kv},
      {"sequence_state_bytes", s.sequence_state_bytes},
      {"sequence_state",
       {{"window_rings", s.window_ring_bytes},
        {"compressor_partial_groups", s.compressor_state_bytes},
        {"logits", s.logits_bytes},
        {"engram_history", s.engram_history_bytes},
        {"dspark_window_rings", s.dspark_window_bytes}}},
      {"checkpoint_bytes_by_dtype", s.checkpoint_bytes_by_dtype},
      {"checkpoint_bytes", s.checkpoint_bytes},
  };
  // Engram's compressed classes, from the model directory's own tokenizer when it has one.
  std::optional<int64_t> classes;
  if (fs::is_directory(path, ec) && fs::exists(fs::path(path) / "tokenizer.json", ec)) {
    auto vocab = engine::BuildCompressedVocab((fs::path(path) / "tokenizer.json").string());
    if (vocab.ok()) classes = vocab->classes;
  }
  if (classes) {
    j["engram_tokenizer_classes"] = *classes;
    j["engram_classes_match_config"] = *classes == config->engram_compressed_vocab_size;
  }
  if (model) {
    json unused = json::object();
    for (const auto& [part, counts] : model->weights().unused) {
      unused[engine::ModelPartName(part)] = {{"tensors", counts.first}, {"bytes", counts.second}};
    }
    j["checkpoint"] = {{"files", model->checkpoint().files().size()},
                       {"file_bytes", model->checkpoint().total_file_bytes()},
                       {"tensors", model->checkpoint().tensors().size()},
                       {"bound", model->weights().tensors.size()},
                       {"dspark", model->weights().dspark},
                       {"unused", unused},
                       {"unexpected", model->weights().unexpected}};
  }
  if (as_json) {
    std::printf("%s\n", j.dump(2).c_str());
    return kExitOk;
  }
  std::printf("model %s (%s)\n", path.c_str(), config->model_type.c_str());
  std::printf("parameters\n");
  std::printf("  backbone                 %s\n", Billions(s.params_backbone).c_str());
  std::printf("  engram                   %s\n", Billions(s.params_engram).c_str());
  std::printf("  dspark                   %s\n", Billions(s.params_dspark).c_str());
  std::printf("  vision (estimate)        %s\n", Billions(s.params_vision).c_str());
  std::printf("active parameters per token\n");
  std::printf("  decode                   %s\n", Billions(s.params_active_decode).c_str());
  std::printf("  prefill, bounded replay  %s (layers 0-%d)\n",
              Billions(s.params_active_prefill).c_str(), s.last_kv_source_layer);
  std::printf("  prefill, every layer     %s\n", Billions(s.params_active_prefill_full).c_str());
  std::printf("KV cache, persistent       %.2f bytes/token (1M tokens: %.3f GB)\n",
              s.kv_bytes_per_token, s.kv_bytes_per_token * 1e6 / 1e9);
  for (const engine::KvSourceBytes& k : s.kv_sources) {
    std::printf("  layer %-3d ratio %d        (%llu + %llu) / %d = %.2f bytes/token\n", k.layer,
                k.compress_ratio, static_cast<unsigned long long>(k.entry_bytes),
                static_cast<unsigned long long>(k.index_key_bytes), k.compress_ratio,
                k.bytes_per_token);
  }
  std::printf(
      "per-sequence state         %llu bytes (window rings %llu, compressor %llu, "
      "logits %llu, engram %llu)\n",
      static_cast<unsigned long long>(s.sequence_state_bytes),
      static_cast<unsigned long long>(s.window_ring_bytes),
      static_cast<unsigned long long>(s.compressor_state_bytes),
      static_cast<unsigned long long>(s.logits_bytes),
      static_cast<unsigned long long>(s.engram_history_bytes));
  if (classes) {
    std::printf("engram classes from tokenizer.json: %lld (config: %lld)%s\n",
                static_cast<long long>(*classes),
                static_cast<long long>(config->engram_compressed_vocab_size),
                *classes == config->engram_compressed_vocab_size ? "" : "  MISMATCH");
  }
  std::printf("checkpoint bytes (without vision) %.3f GB\n", s.checkpoint_bytes / 1e9);
  for (const auto& [dtype, bytes] : s.checkpoint_bytes_by_dtype) {
    std::printf("  %-8s %.3f GB\n", dtype.c_str(), bytes / 1e9);
  }
  if (model) {
    std::printf("checkpoint on disk: %zu files, %.3f GB, %zu tensors, %zu bound\n",
                model->checkpoint().files().size(), model->checkpoint().total_file_bytes() / 1e9,
                model->checkpoint().tensors().size(), model->weights().tensors.size());
    if (model->weights().dspark) {
      std::printf("  dspark: the drafter's %d stages are complete (speculative decoding)\n",
                  config->num_nextn_predict_layers);
    } else if (config->num_nextn_predict_layers > 0) {
      std::printf("  dspark: %lld of the drafter's tensors missing: no speculative decoding\n",
                  static_cast<long long>(model->weights().dspark_missing));
    }
    for (const auto& [part, counts] : model->weights().unused) {
      std::printf("  not used yet: %llu %s tensors (%.3f GB)\n",
                  static_cast<unsigned long long>(counts.first), engine::ModelPartName(part),
                  counts.second / 1e9);
    }
    for (const std::string& name : model->weights().unexpected) {
      std::printf("  unexpected tensor: %s\n", name.c_str());
    }
  }
  return kExitOk;
}

namespace {

// Parses "--tokenizer FILE" (or "--tokenizer=FILE"); prints help or errors itself.
bool TokenizerArgs(const std::vector<std::string>& args, const char* command, std::string* path,
                   bool* plain, int* exit_code) {
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--help" || args[i] == "-h") {
      std::printf(
          "Usage: flashd %s --tokenizer FILE [--no-special]\n\n%s\n"
          "  --tokenizer FILE  a tokenizer.json (Hugging Face format)\n"
          "  --no-special      tokenize the text of special tokens as plain text\n",
          command,
          std::string(command) == "tokenize"
              ? "Reads text on stdin and prints its token ids as one JSON array; no special\n"
                "tokens are added, and special-token text in the input is recognised."
              : "Reads a JSON array of token ids on stdin and prints their text.");
      *exit_code = kExitOk;
      return false;
    }
    if (args[i] == "--tokenizer" && i + 1 < args.size()) {
      *path = args[++i];
    } else if (args[i].rfind("--tokenizer=", 0) == 0) {
      *path = args[i].substr(12);
    } else if (args[i] == "--no-special") {
      *plain = true;
    } else {
      std::fprintf(stderr, "flashd %s: unexpected argument %s\n", command, args[i].c_str());
      *exit_code = kExitUsage;
      return false;
    }
  }
  if (path->empty()) {
    std::fprintf(stderr, "flashd %s: --tokenizer FILE is required\n", command);
    *exit_code = kExitUsage;
    return false;
  }
  return true;
}

}  // namespace

int TokenizeCommand(const std::vector<std::string>& args) {
  std::string path;
  bool plain = false;
  int code = kExitOk;
  if (!TokenizerArgs(args, "tokenize", &path, &plain, &code)) return code;
  auto tok = engine::Tokenizer::Load(path);
  if (!tok.ok()) {
    std::fprintf(stderr, "flashd tokenize: %s\n", tok.status().message().c_str());
    return kExitUsage;
  }
  std::string text((std::istreambuf_iterator<char>(std::cin)), std::istreambuf_iterator<char>());
  std::vector<int32_t> ids = (*tok)->Encode(text, !plain);
  std::string out = "[";
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i > 0) out += ',';
    out += std::to_string(ids[i]);
  }
  out += "]\n";
  std::fwrite(out.data(), 1, out.size(), stdout);
  return kExitOk;
}

int DetokenizeCommand(const std::vector<std::string>& args) {
  std::string path;
  bool plain = false;
  int code = kExitOk;
  if (!TokenizerArgs(args, "detokenize", &path, &plain, &code)) return code;
  auto tok = engine::Tokenizer::Load(path);
  if (!tok.ok()) {
    std::fprintf(stderr, "flashd detokenize: %s\n", tok.status().message().c_str());
    return kExitUsage;
  }
  std::string text((std::istreambuf_iterator<char>(std::cin)), std::istreambuf_iterator<char>());
  std::vector<int32_t> ids;
  try {
    json j = json::parse(text);
    ids = j.get<std::vector<int32_t>>();
  } catch (const json::exception& e) {
    std::fprintf(stderr, "flashd detokenize: stdin is not a JSON array of token ids (%s)\n",
                 e.what());
    return kExitUsage;
  }
  for (int32_t id : ids) {
    if (id < 0 || static_cast<size_t>(id) >= (*tok)->size()) {
      std::fprintf(stderr, "flashd detokenize: token id %d is outside the vocabulary (%zu)\n", id,
                   (*tok)->size());
      return kExitUsage;
    }
  }
  std::string out = (*tok)->Decode(ids);
  std::fwrite(out.data(), 1, out.size(), stdout);
  return kExitOk;
}

}  // namespace flashd::daemon

namespace flashd::daemon {
namespace {

void PrintPlanHelp() {
  std::printf(
      "Usage: flashd plan DIR|config.json [--gpus SPEC] [--host-ram SIZE] [--context N] "
      "[--json]\n\n"
      "Where the model's parts go on a machine and how much KV fits, from the config alone:\n"
      "every layer on the GPUs (whole layers split in order across them), else the routed\n"
      "experts in host memory on the CPU (hybrid), else everything on the CPU; the Engram\n"
      "tables in host memory. Exits 1 when the model does not fit, saying by how much.\n\n"
      "  --gpus SPEC       e.g. 8xH200, 4xMI300X, 2x96GiB, none (default: this machine's)\n"
      "  --host-ram SIZE   e.g. 512GiB (default: this machine's)\n"
      "  --engram-ssd SIZE the Engram tables on SSD (engine.engram: ssd) with a hot-row cache\n"
      "                    of SIZE in host memory, e.g. 4GiB\n"
      "  --context N       tokens per sequence for the sequence count (default 131072)\n"
      "  --json            print one JSON object\n");
}

uint64_t MachineRam() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  uint64_t kb = 0;
  while (in >> key >> kb) {
    if (key == "MemTotal:") return kb * 1024;
    in.ignore(std::numeric_limits<std::streamsize>::max(), '\n');
  }
  return 0;
}

}  // namespace

int PlanCommand(const std::vector<std::string>& args) {
  if (WantsHelp(args)) {
    PrintPlanHelp();
    return kExitOk;
  }
  std::string path, gpus_text;
  bool gpus_given = false, as_json = false;
  engine::PlanOptions options;
  options.host_ram_bytes = MachineRam();
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    const bool has_value = i + 1 < args.size();
    if (a == "--json") {
      as_json = true;
    } else if (a == "--gpus" && has_value) {
      gpus_text = args[++i];
      gpus_given = true;
    } else if (a == "--host-ram" && has_value) {
      auto bytes = ParseByteSize(args[++i]);
      if (!bytes.ok()) {
        std::fprintf(stderr, "flashd plan: --host-ram: %s\n", bytes.status().message().c_str());
        return kExitUsage;
      }
      options.host_ram_bytes = *bytes;
    } else if (a == "--engram-ssd" && has_value) {
      auto bytes = ParseByteSize(args[++i]);
      if (!bytes.ok()) {
        std::fprintf(stderr, "flashd plan: --engram-ssd: %s\n", bytes.status().message().c_str());
        return kExitUsage;
      }
      options.engram_ssd_cache_bytes = static_cast<int64_t>(*bytes);
    } else if (a == "--context" && has_value) {
      options.context_tokens = std::atoll(args[++i].c_str());
      if (options.context_tokens < 1) {
        std::fprintf(stderr, "flashd plan: --context: a positive token count expected\n");
        return kExitUsage;
      }
    } else if (path.empty() && (a.empty() || a[0] != '-')) {
      path = a;
    } else {
      std::fprintf(stderr, "flashd plan: unexpected argument %s\n", a.c_str());
      return kExitUsage;
    }
  }
  if (path.empty()) {
    std::fprintf(stderr, "flashd plan: missing DIR or config.json\n");
    return kExitUsage;
  }
  StatusOr<engine::ModelConfig> config = engine::LoadModelConfig(path);
  if (!config.ok()) {
    std::fprintf(stderr, "flashd plan: %s\n", config.status().message().c_str());
    return kExitUsage;
  }
  if (gpus_given) {
    auto gpus = engine::ParseGpus(gpus_text);
    if (!gpus.ok()) {
      std::fprintf(stderr, "flashd plan: %s\n", gpus.status().message().c_str());
      return kExitUsage;
    }
    options.gpus = *gpus;
  } else {
    // This machine's GPUs of the kind the engine would choose (auto), every device of it.
    std::string why;
    auto backend = engine::SelectBackend("auto", &why);
    const std::string kind = backend.ok() ? std::string((*backend)->name()) : "cpu";
    for (int device = 0; kind != "cpu" && device < 64; ++device) {
      auto b = engine::SelectBackend(kind, &why, device);
      if (!b.ok()) break;
      const engine::BackendReport r = (*b)->Report();
      options.gpus.push_back({r.device, r.memory_total});
    }
  }
  const engine::PlacementPlan plan = engine::MakePlan(*config, options);
  if (as_json) {
    std::printf("%s\n", engine::PlanJson(plan).c_str());
  } else {
    std::printf("%s", engine::DescribePlan(plan, options).c_str());
  }
  return plan.fits ? kExitOk : 1;
}

}  // namespace flashd::daemon
