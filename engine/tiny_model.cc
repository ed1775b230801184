#include "engine/tiny_model.h"

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <vector>

#include "engine/model_config.h"
#include "engine/safetensors.h"
#include "engine/weights.h"
#include "kernels/cpu/formats.h"

namespace flashd::engine {
namespace {

using nlohmann::json;
namespace k = flashd::kernels::cpu;

constexpr const char* kDefaultConfig = R"({
  "architectures": ["DeepseekV41ForCausalLM"],
  "model_type": "deepseek_v41",
  "bos_token_id": 0,
  "eos_token_id": 1,
  "pad_token_id": 2,
  "image_token_id": 129264,
  "quantization_config": {
    "quant_method": "fp8",
    "activation_scheme": "dynamic",
    "weight_block_size": [32, 32],
    "scale_fmt": "ue8m0",
    "expert_dtype": "fp4"
  },
  "text_config": {
    "vocab_size": 129280,
    "hidden_size": 256,
    "num_hidden_layers": 6,
    "moe_intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 128,
    "qk_rope_head_dim": 32,
    "q_lora_rank": 64,
    "o_lora_rank": 64,
    "o_groups": 2,
    "sliding_window": 32,
    "hidden_act": "silu",
    "swiglu_limit": 10.0,
    "rms_norm_eps": 1e-20,
    "rope_theta": 10000,
    "compress_rope_theta": 160000,
    "rope_scaling": {"type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                     "original_max_position_embeddings": 65536},
    "max_position_embeddings": 1048576,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": true,
    "routed_scaling_factor": 1.5,
    "compress_ratios": [0, 2, 2, 1, 1, 0, 0],
    "kv_source_layer_ids": [1, 3],
    "index_source_layer_ids": [1, 3, 4],
    "index_n_heads": 4,
    "index_head_dim": 64,
    "index_topk": 16,
    "candidate_source_layer_id": 3,
    "candidate_topk_blocks": 4,
    "candidate_block_size": 4,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "engram_layer_ids": [1, 3],
    "engram_num_embeddings": [0, 0],
    "engram_max_ngram_size": 4,
    "engram_vocab_size": 1000,
    "engram_n_heads": 2,
    "engram_head_dim": 64,
    "engram_pad_token_id": 2,
    "engram_compressed_vocab_size": 99092,
    "num_nextn_predict_layers": 1,
    "dspark_block_size": 5,
    "dspark_noise_token_id": 128799,
    "dspark_target_layer_ids": [3, 4, 5],
    "dspark_markov_rank": 32,
    "dspark_n_routed_experts": 4,
    "dspark_num_experts_per_tok": 2
  }
})";

const std::set<std::string> kTopLevelKeys = {"bos_token_id", "eos_token_id", "pad_token_id",
                                             "image_token_id", "architectures"};

// A small, fast, well-mixed generator (SplitMix64) with Box-Muller normals: deterministic on
// every platform, and seeded per tensor so adding a tensor does not change the others.
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t Next() {
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
  }
  float Normal() {
    double u1 = (static_cast<double>(Next() >> 11) + 0.5) * 0x1p-53;
    double u2 = static_cast<double>(Next() >> 11) * 0x1p-53;
    return static_cast<float>(std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
  }

 private:
  uint64_t state_;
};

uint64_t SeedFor(uint64_t seed, const std::string& name) {
  uint64_t h = 1469598103934665603ULL ^ seed;
  for (char ch : name) h = (h ^ static_cast<uint8_t>(ch)) * 1099511628211ULL;
  return h;
}

std::vector<float> Normals(uint64_t seed, const std::string& name, size_t n, float stddev) {
  Rng rng(SeedFor(seed, name));
  std::vector<float> v(n);
  for (float& x : v) x = rng.Normal() * stddev;
  return v;
}

bool EndsWith(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// The value every element of a BF16/F32 tensor of this name takes in a written checkpoint, where
// it has one: norms, q/k weights and scales 1, bases, sinks and gate biases 0.
std::optional<float> FixedValue(const std::string& name) {
  if (EndsWith(name, "norm.weight") || EndsWith(name, "q_weight") || EndsWith(name, "k_weight") ||
      EndsWith(name, "_scale")) {
    return 1.0f;
  }
  if (EndsWith(name, "_base") || EndsWith(name, "attn_sink") || EndsWith(name, "gate.bias") ||
      EndsWith(name, "gate.bias_vl")) {
    return 0.0f;
  }
  return std::nullopt;
}

std::vector<uint8_t> AsBytes(const std::vector<float>& v, DType dtype) {
  std::vector<uint8_t> out;
  if (dtype == DType::kF32) {
    out.resize(v.size() * 4);
    std::memcpy(out.data(), v.data(), out.size());
  } else {
    out.resize(v.size() * 2);
    for (size_t i = 0; i < v.size(); ++i) {
      uint16_t b = k::FloatToBf16(v[i]);
      out[2 * i] = static_cast<uint8_t>(b & 0xFF);
      out[2 * i + 1] = static_cast<uint8_t>(b >> 8);
    }
  }
  return out;
}

// Fills `tensors` with every tensor of `specs`, in order. Quantized weights produce their
// ".scale" sibling at the same time.
Status Generate(const std::vector<TensorSpec>& specs, uint64_t seed,
                std::map<std::string, TensorData>* tensors,
                const std::function<void(uint64_t, uint64_t)>& progress) {
  uint64_t total = 0, done = 0;
  for (const TensorSpec& s : specs) total += s.params;
  for (const TensorSpec& s : specs) {
    done += s.params;
    if (progress) progress(done, total);
    if (tensors->count(s.name)) continue;  // A scale already made with its weight.
    TensorData t{s.name, StoredDType(s.kind), s.shape, {}};
    const size_t rows = static_cast<size_t>(s.shape[0]);
    const size_t cols = s.shape.size() > 1 ? static_cast<size_t>(s.shape[1]) : 1;
    const std::string base = s.name.substr(0, s.name.rfind('.'));
    switch (s.kind) {
      case TensorKind::kFp8Weight: {
        std::vector<float> w = Normals(seed, s.name, rows * cols, 1.0f / std::sqrt(float(cols)));
        TensorData scale{base + ".scale",
                         DType::kF8E8M0,
                         {int64_t((rows + 31) / 32), int64_t((cols + 31) / 32)},
                         {}};
        t.bytes.resize(rows * cols);
        scale.bytes.resize(((rows + 31) / 32) * ((cols + 31) / 32));
        k::QuantizeFp8Weight(w.data(), rows, cols, t.bytes.data(), scale.bytes.data());
        (*tensors)[scale.name] = std::move(scale);
        break;
      }
      case TensorKind::kFp4Weight: {
        const size_t in = cols * 2;
        std::vector<float> w = Normals(seed, s.name, rows * in, 1.0f / std::sqrt(float(in)));
        TensorData scale{base + ".scale", DType::kF8E8M0, {int64_t(rows), int64_t(in / 32)}, {}};
        t.bytes.resize(rows * cols);
        scale.bytes.resize(rows * in / 32);
        for (size_t r = 0; r < rows; ++r) {
          k::QuantizeFp4E8M0(w.data() + r * in, in, 32, t.bytes.data() + r * cols,
                             scale.bytes.data() + r * in / 32);
        }
        (*tensors)[scale.name] = std::move(scale);
        break;
      }
      case TensorKind::kFp8Table: {
        std::vector<float> w = Normals(seed, s.name, rows * cols, 1.0f);
        std::string scale_name = base + ".scale";
        TensorData scale{scale_name, DType::kF8E8M0, {int64_t(rows), int64_t(cols / 32)}, {}};
        t.bytes.resize(rows * cols);
        scale.bytes.resize(rows * cols / 32);
        k::QuantizeFp8PerBlock(w.data(), rows * cols, 32, t.bytes.data(), scale.bytes.data());
        (*tensors)[scale_name] = std::move(scale);
        break;
      }
      case TensorKind::kFp8Scale:
      case TensorKind::kFp4Scale:
      case TensorKind::kFp8RowScale:
        return Internal("mkmodel: scale " + s.name + " precedes its weight");
      case TensorKind::kBf16:
      case TensorKind::kF32: {
        std::vector<float> v;
        const size_t n = rows * cols;
        if (const std::optional<float> fixed = FixedValue(s.name)) {
          v.assign(n, *fixed);
        } else if (s.name == "embed.weight" || EndsWith(s.name, "markov_head.embed.weight")) {
          v = Normals(seed, s.name, n, 1.0f);
        } else if (s.name.find(".hc_") != std::string::npos) {
          v = Normals(seed, s.name, n, 0.02f);
        } else {
          v = Normals(seed, s.name, n, 1.0f / std::sqrt(float(cols)));
        }
        t.bytes = AsBytes(v, t.dtype);
        break;
      }
    }
    (*tensors)[s.name] = std::move(t);
  }
  return Status::Ok();
}

Status CopyFile(const std::filesystem::path& from, const std::filesystem::path& to) {
  std::error_code ec;
  std::filesystem::copy_file(from, to, std::filesystem::copy_options::overwrite_existing, ec);
  if (ec)
    return IoError("cannot copy " + from.string() + " to " + to.string() + ": " + ec.message());
  return Status::Ok();
}

}  // namespace

namespace {

// `base` (a whole config.json) with `overrides_json` applied, Engram table sizes recomputed from
// the other Engram keys unless given, validated like any model's config.
StatusOr<std::string> WithOverrides(json config, std::string_view overrides_json) {
  bool sizes_given = false;
  if (!overrides_json.empty()) {
    json overrides;
    try {
      overrides = json::parse(overrides_json);
    } catch (const json::exception& e) {
      return InvalidArgument(std::string("model spec is not valid JSON: ") + e.what());
    }
    if (!overrides.is_object()) return InvalidArgument("model spec must be a mapping of keys");
    for (auto it = overrides.begin(); it != overrides.end(); ++it) {
      if (it.key() == "quantization_config" || it.key() == "vision_config") {
        if (!it.value().is_object()) {
          return InvalidArgument("model spec: " + it.key() + " must be a mapping");
        }
        config[it.key()].merge_patch(it.value());
      } else if (kTopLevelKeys.count(it.key())) {
        config[it.key()] = it.value();
      } else if (config["text_config"].contains(it.key())) {
        config["text_config"][it.key()] = it.value();
        sizes_given = sizes_given || it.key() == "engram_num_embeddings";
      } else {
        return InvalidArgument("model spec: unknown key \"" + it.key() +
                               "\" (use the text_config keys of config.json)");
      }
    }
  }
  // Engram table sizes follow from the other Engram keys unless given: compute them the way
  // the release's config does, so the self-check in ParseModelConfig holds.
  json& text = config["text_config"];
  if (!sizes_given && text.contains("engram_layer_ids")) {
    ModelConfig probe;
    probe.engram_layer_ids = text["engram_layer_ids"].get<std::vector<int>>();
    probe.engram_max_ngram_size = text["engram_max_ngram_size"].get<int>();
    probe.engram_vocab_size = text["engram_vocab_size"].get<int64_t>();
    probe.engram_n_heads = text["engram_n_heads"].get<int>();
    std::vector<int64_t> rows;
    for (const auto& layer : EngramPrimes(probe)) {
      int64_t sum = 0;
      for (const auto& per_n : layer) {
        for (int64_t p : per_n) sum += p;
      }
      rows.push_back(sum);
    }
    text["engram_num_embeddings"] = rows;
  }
  std::string out = config.dump(2);
  FLASHD_RETURN_IF_ERROR(ParseModelConfig(out, "model spec").status());
  return out;
}

}  // namespace

StatusOr<std::string> TinyConfigJson(std::string_view overrides_json) {
  return WithOverrides(json::parse(kDefaultConfig), overrides_json);
}

StatusOr<std::string> ReleasedConfigJson(int layers, std::string_view overrides_json) {
  json config = json::parse(ReleasedConfigText());
  json& text = config.contains("text_config") ? config["text_config"] : config;
  const int released = text["num_hidden_layers"].get<int>();
  if (layers < 1 || layers > released) {
    return InvalidArgument("--layers must be between 1 and " + std::to_string(released));
  }
  // The first `layers` layers, and every list of layer ids cut to them: the sources, the
  // candidate source (the last index source left, else none), the Engram layers, and DSpark's
  // target layers moved to the last layers there are.
  std::vector<int> ratios = text["compress_ratios"].get<std::vector<int>>();
  std::vector<int> cut(ratios.begin(), ratios.begin() + layers);
  cut.insert(cut.end(), ratios.begin() + released, ratios.end());
  text["compress_ratios"] = cut;
  text["num_hidden_layers"] = layers;
  auto below = [&](const char* key) {
    std::vector<int> kept;
    for (int l : text[key].get<std::vector<int>>()) {
      if (l < layers) kept.push_back(l);
    }
    return kept;
  };
  const std::vector<int> index_sources = below("index_source_layer_ids");
  text["kv_source_layer_ids"] = below("kv_source_layer_ids");
  text["index_source_layer_ids"] = index_sources;
  if (text["candidate_source_layer_id"].get<int>() >= layers) {
    text["candidate_source_layer_id"] = index_sources.empty() ? -1 : index_sources.back();
  }
  const std::vector<int> engram = below("engram_layer_ids");
  const std::vector<int64_t> tables = text["engram_num_embeddings"].get<std::vector<int64_t>>();
  text["engram_layer_ids"] = engram;
  text["engram_num_embeddings"] =
      std::vector<int64_t>(tables.begin(), tables.begin() + engram.size());
  const size_t targets = text["dspark_target_layer_ids"].size();
  std::vector<int> moved;
  for (int l = std::max(0, layers - static_cast<int>(targets)); l < layers; ++l) moved.push_back(l);
  text["dspark_target_layer_ids"] = moved;
  return WithOverrides(std::move(config), overrides_json);
}

namespace {

// Bytes of one tensor chunk for WriteLargeModel: valid codes of the tensor's kind from a
// generator seeded by the tensor and the chunk, so any chunk can be made on its own. FP8 codes
// stay below 1 in magnitude (no NaN code), UE8M0 scales between 2^-7 and 2^-4, FP4 codes are all
// valid; norms are 1, biases and sinks 0, other BF16/F32 values small and uniform.
void FillCodes(const TensorSpec& spec, DType dtype, uint64_t seed, uint64_t offset, uint8_t* out,
               uint64_t n) {
  Rng rng(SeedFor(seed, spec.name) ^ (offset * 0x9E3779B97F4A7C15ULL));
  auto bytes = [&](uint8_t mask, uint8_t add) {
    uint64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      uint64_t r = rng.Next();
      for (int b = 0; b < 8; ++b) out[i + b] = static_cast<uint8_t>(((r >> (8 * b)) & mask) + add);
    }
    for (uint64_t r = rng.Next(); i < n; ++i, r >>= 8)
      out[i] = static_cast<uint8_t>((r & mask) + add);
  };
  switch (spec.kind) {
    case TensorKind::kFp8Weight:
    case TensorKind::kFp8Table:
      return bytes(0xB7, 0);
    case TensorKind::kFp4Weight:
      return bytes(0xFF, 0);
    case TensorKind::kFp8Scale:
    case TensorKind::kFp4Scale:
    case TensorKind::kFp8RowScale:
      return bytes(0x03, 120);
    case TensorKind::kBf16:
    case TensorKind::kF32:
      break;
  }
  const size_t width = dtype == DType::kF32 ? 4 : 2;
  const std::optional<float> fixed = FixedValue(spec.name);
  // Chunks are whole elements (WriteSafetensorsStreamed's chunk is a multiple of 4).
  for (uint64_t i = 0; i + width <= n; i += width) {
    const float v =
        fixed ? *fixed : (static_cast<float>(rng.Next() >> 40) * 0x1p-24f - 0.5f) * 0.02f;
    if (width == 4) {
      std::memcpy(out + i, &v, 4);
    } else {
      const uint16_t b = k::FloatToBf16(v);
      std::memcpy(out + i, &b, 2);
    }
  }
}

}  // namespace

namespace {

// Tensors of `bytes` (in spec order) cut into `shards` runs of about equal bytes.
std::vector<std::vector<size_t>> SplitShards(const std::vector<uint64_t>& bytes, int shards) {
  uint64_t total = 0;
  for (uint64_t b : bytes) total += b;
  const uint64_t per_shard = (total + shards - 1) / shards;
  std::vector<std::vector<size_t>> out(static_cast<size_t>(shards));
  uint64_t filled = 0;
  size_t current = 0;
  for (size_t i = 0; i < bytes.size(); ++i) {
    if (filled >= per_shard * (current + 1) && current + 1 < out.size()) ++current;
    out[current].push_back(i);
    filled += bytes[i];
  }
  return out;
}

std::string ShardName(size_t k, int shards) {
  if (shards == 1) return "model.safetensors";
  char name[64];
  std::snprintf(name, sizeof name, "model-%05zu-of-%05d.safetensors", k + 1, shards);
  return name;
}

Status CreateModelDir(const std::string& dir, const TinyModelOptions& options) {
  if (options.shards < 1) return InvalidArgument("mkmodel: --shards must be at least 1");
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return IoError(dir + ": cannot create: " + ec.message());
  return Status::Ok();
}

// What goes beside the weights: the index (several shards), config.json, the tokenizer's files.
Status WriteBesideWeights(const std::string& dir, std::string_view config_json,
                          const json& weight_map, uint64_t total, const TinyModelOptions& options) {
  namespace fs = std::filesystem;
  if (options.shards > 1) {
    json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
    std::ofstream(fs::path(dir) / "model.safetensors.index.json") << index.dump(2) << "\n";
  }
  std::ofstream out(fs::path(dir) / "config.json");
  out << config_json << "\n";
  if (!out) return IoError(dir + "/config.json: write failed");
  std::error_code ec;
  if (!options.tokenizer_dir.empty()) {
    for (const char* file : {"tokenizer.json", "tokenizer_config.json"}) {
      fs::path from = fs::path(options.tokenizer_dir) / file;
      if (fs::exists(from, ec)) FLASHD_RETURN_IF_ERROR(CopyFile(from, fs::path(dir) / file));
    }
  }
  return Status::Ok();
}

const std::map<std::string, std::string> kShardMetadata = {{"format", "pt"}};

}  // namespace

Status WriteLargeModel(const std::string& dir, std::string_view config_json,
                       const TinyModelOptions& options) {
  FLASHD_ASSIGN_OR_RETURN(ModelConfig config, ParseModelConfig(config_json, "model spec"));
  FLASHD_RETURN_IF_ERROR(CreateModelDir(dir, options));
  const std::vector<TensorSpec> specs = ExpectedTensors(config);
  std::vector<uint64_t> sizes;
  uint64_t total = 0;
  for (const TensorSpec& s : specs) {
    uint64_t elements = 1;
    for (int64_t d : s.shape) elements *= static_cast<uint64_t>(d);
    sizes.push_back(DTypeBytes(StoredDType(s.kind), elements));
    total += sizes.back();
  }
  const std::vector<std::vector<size_t>> shards = SplitShards(sizes, options.shards);
  json weight_map = json::object();
  uint64_t done = 0;
  for (size_t k = 0; k < shards.size(); ++k) {
    const std::string name = ShardName(k, options.shards);
    std::vector<TensorHeader> headers;
    for (size_t i : shards[k]) {
      headers.push_back({specs[i].name, StoredDType(specs[i].kind), specs[i].shape});
      weight_map[specs[i].name] = name;
    }
    FLASHD_RETURN_IF_ERROR(WriteSafetensorsStreamed(
        (std::filesystem::path(dir) / name).string(), headers, kShardMetadata,
        [&](size_t j, uint64_t offset, uint8_t* out, uint64_t n) {
          const TensorSpec& spec = specs[shards[k][j]];
          FillCodes(spec, StoredDType(spec.kind), options.seed, offset, out, n);
          done += n;
          if (options.progress) options.progress(done, total);
          return Status::Ok();
        }));
  }
  return WriteBesideWeights(dir, config_json, weight_map, total, options);
}

Status WriteTinyModel(const std::string& dir, std::string_view config_json,
                      const TinyModelOptions& options) {
  FLASHD_ASSIGN_OR_RETURN(ModelConfig config, ParseModelConfig(config_json, "model spec"));
  FLASHD_RETURN_IF_ERROR(CreateModelDir(dir, options));
  const std::vector<TensorSpec> specs = ExpectedTensors(config);
  std::map<std::string, TensorData> tensors;
  FLASHD_RETURN_IF_ERROR(Generate(specs, options.seed, &tensors, options.progress));
  std::vector<uint64_t> sizes;
  uint64_t total = 0;
  for (const TensorSpec& s : specs) {
    sizes.push_back(tensors.at(s.name).bytes.size());
    total += sizes.back();
  }
  json weight_map = json::object();
  const std::vector<std::vector<size_t>> shards = SplitShards(sizes, options.shards);
  for (size_t k = 0; k < shards.size(); ++k) {
    const std::string name = ShardName(k, options.shards);
    std::vector<const TensorData*> in_shard;
    for (size_t i : shards[k]) {
      in_shard.push_back(&tensors.at(specs[i].name));
      weight_map[specs[i].name] = name;
    }
    FLASHD_RETURN_IF_ERROR(
        WriteSafetensors((std::filesystem::path(dir) / name).string(), in_shard, kShardMetadata));
  }
  return WriteBesideWeights(dir, config_json, weight_map, total, options);
}

}  // namespace flashd::engine
