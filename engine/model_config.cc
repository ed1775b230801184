#include "engine/model_config.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

namespace flashd::engine {
namespace {

using nlohmann::json;

// Reads typed fields of one JSON object, remembering the first error with the field's path.
class Fields {
 public:
  Fields(const json* object, std::string path, std::string source, Status* error)
      : object_(object), path_(std::move(path)), source_(std::move(source)), error_(error) {}

  template <typename T>
  void Get(const char* key, T* out, bool required = true) {
    if (!error_->ok()) return;
    const json* v = Find(key);
    if (v == nullptr) {
      if (required) Fail(key, "missing");
      return;
    }
    Convert(*v, key, out);
  }

  // A nested object; null when absent (an error only when required).
  const json* Object(const char* key, bool required) {
    if (!error_->ok()) return nullptr;
    const json* v = Find(key);
    if (v == nullptr) {
      if (required) Fail(key, "missing");
      return nullptr;
    }
    if (!v->is_object()) {
      Fail(key, "expected an object");
      return nullptr;
    }
    return v;
  }

  std::string Path(const std::string& key) const { return path_.empty() ? key : path_ + "." + key; }
  void Fail(const std::string& key, const std::string& what) {
    if (error_->ok()) *error_ = InvalidArgument(source_ + ": " + Path(key) + ": " + what);
  }

 private:
  const json* Find(const char* key) const {
    auto it = object_->find(key);
    if (it == object_->end() || it->is_null()) return nullptr;
    return &*it;
  }

  void Convert(const json& v, const char* key, std::string* out) {
    if (!v.is_string()) return Fail(key, "expected a string");
    *out = v.get<std::string>();
  }
  void Convert(const json& v, const char* key, bool* out) {
    if (!v.is_boolean()) return Fail(key, "expected true or false");
    *out = v.get<bool>();
  }
  void Convert(const json& v, const char* key, double* out) {
    if (!v.is_number()) return Fail(key, "expected a number");
    *out = v.get<double>();
  }
  template <typename I>
  requires std::is_integral_v<I>
  void Convert(const json& v, const char* key, I* out) {
    if (!v.is_number_integer()) return Fail(key, "expected an integer");
    int64_t x = v.get<int64_t>();
    if (x < std::numeric_limits<I>::min() || x > std::numeric_limits<I>::max()) {
      return Fail(key, "out of range");
    }
    *out = static_cast<I>(x);
  }
  template <typename I>
  void Convert(const json& v, const char* key, std::vector<I>* out) {
    if (!v.is_array()) return Fail(key, "expected a list");
    out->clear();
    for (size_t i = 0; i < v.size(); ++i) {
      I item{};
      Convert(v[i], (std::string(key) + "[" + std::to_string(i) + "]").c_str(), &item);
      if (!error_->ok()) return;
      out->push_back(item);
    }
  }

  const json* object_;
  std::string path_;
  std::string source_;
  Status* error_;
};

std::string Item(const char* list, size_t i) {
  return std::string("text_config.") + list + "[" + std::to_string(i) + "]";
}

// Builds an InvalidArgument naming the file and the field.
struct Complaint {
  const std::string& source;
  Status operator()(const std::string& field, const std::string& what) const {
    return InvalidArgument(source + ": " + field + ": " + what);
  }
};

// Model type, sizes, divisibility, routing and quantization settings.
Status ValidateShapes(const ModelConfig* c, const Complaint& bad) {
  if (c->model_type != "deepseek_v41") {
    return bad("model_type",
               "unknown model type \"" + c->model_type + "\" (flashd serves deepseek_v41)");
  }
  struct Positive {
    const char* name;
    int64_t value;
  };
  const Positive positives[] = {
      {"vocab_size", c->vocab_size},
      {"hidden_size", c->hidden_size},
      {"num_hidden_layers", c->num_hidden_layers},
      {"moe_intermediate_size", c->moe_intermediate_size},
      {"num_attention_heads", c->num_attention_heads},
      {"head_dim", c->head_dim},
      {"qk_rope_head_dim", c->qk_rope_head_dim},
      {"q_lora_rank", c->q_lora_rank},
      {"o_lora_rank", c->o_lora_rank},
      {"o_groups", c->o_groups},
      {"sliding_window", c->sliding_window},
      {"n_routed_experts", c->n_routed_experts},
      {"num_experts_per_tok", c->num_experts_per_tok},
      {"hc_mult", c->hc_mult},
      {"hc_sinkhorn_iters", c->hc_sinkhorn_iters},
      {"max_position_embeddings", c->max_position_embeddings},
  };
  for (const Positive& p : positives) {
    if (p.value <= 0) return bad(std::string("text_config.") + p.name, "must be positive");
  }
  // Every linear's input is quantized in blocks of 32; the FP4 KV in blocks of 16.
  const Positive multiples_of_32[] = {
      {"hidden_size", c->hidden_size}, {"q_lora_rank", c->q_lora_rank},
      {"head_dim", c->head_dim},       {"moe_intermediate_size", c->moe_intermediate_size},
      {"o_lora_rank", c->o_lora_rank},
  };
  for (const Positive& p : multiples_of_32) {
    if (p.value % 32 != 0) {
      return bad(std::string("text_config.") + p.name,
                 std::to_string(p.value) + " is not a multiple of the quantization block (32)");
    }
  }
  if (c->num_key_value_heads != 1) {
    return bad("text_config.num_key_value_heads", "must be 1 (the model shares one KV head)");
  }
  if (c->qk_rope_head_dim % 2 != 0 || c->qk_rope_head_dim >= c->head_dim) {
    return bad("text_config.qk_rope_head_dim", "must be even and smaller than head_dim");
  }
  if (c->num_attention_heads % c->o_groups != 0 ||
      (c->num_attention_heads / c->o_groups * c->head_dim) % 32 != 0) {
    return bad("text_config.o_groups",
               "must divide num_attention_heads into groups of a multiple of 32 dims");
  }
  if (c->num_experts_per_tok > c->n_routed_experts) {
    return bad("text_config.num_experts_per_tok", "exceeds n_routed_experts");
  }
  if (c->n_shared_experts != 1) {
    return bad("text_config.n_shared_experts", "must be 1 (one shared expert per layer)");
  }
  static const std::set<std::string> kScoring = {"softmax", "sigmoid", "sqrtsoftplus"};
  if (!kScoring.count(c->scoring_func)) {
    return bad("text_config.scoring_func", "unknown scoring function \"" + c->scoring_func + "\"");
  }
  if (!c->rope_scaling.type.empty() && c->rope_scaling.type != "yarn") {
    return bad("text_config.rope_scaling.type", "only \"yarn\" is supported");
  }
  if (c->quantization.quant_method != "fp8") {
    return bad("quantization_config.quant_method", "expected \"fp8\"");
  }
  if (c->quantization.weight_block_rows != 32 || c->quantization.weight_block_cols != 32) {
    return bad("quantization_config.weight_block_size", "expected [32, 32]");
  }
  if (c->quantization.scale_fmt != "ue8m0") {
    return bad("quantization_config.scale_fmt", "expected \"ue8m0\"");
  }
  if (!c->quantization.expert_dtype.empty() && c->quantization.expert_dtype != "fp4") {
    return bad("quantization_config.expert_dtype", "expected \"fp4\"");
  }

  return Status::Ok();
}

// compress_ratios and the source layer lists, turned into one LayerPlan per layer.
Status PlanLayers(ModelConfig* c, const Complaint& bad) {
  const int L = c->num_hidden_layers;
  const int total = L + c->num_nextn_predict_layers;
  if (static_cast<int>(c->compress_ratios.size()) != total) {
    return bad("text_config.compress_ratios",
               "has " + std::to_string(c->compress_ratios.size()) + " entries, expected " +
                   std::to_string(total) + " (num_hidden_layers + num_nextn_predict_layers)");
  }
  for (int i = 0; i < total; ++i) {
    if (c->compress_ratios[i] < 0) return bad(Item("compress_ratios", i), "must not be negative");
    if (i >= L && c->compress_ratios[i] != 0) {
      return bad(Item("compress_ratios", i), "DSpark layers attend over the window only (0)");
    }
  }

  // Checks a list of layer ids: in range, ascending, each with a compressing layer.
  auto check_ids = [&](const char* name, const std::vector<int>& ids) -> Status {
    for (size_t i = 0; i < ids.size(); ++i) {
      if (ids[i] < 0 || ids[i] >= L) {
        return bad(Item(name, i), "layer " + std::to_string(ids[i]) + " is out of range");
      }
      if (i > 0 && ids[i] <= ids[i - 1]) return bad(Item(name, i), "ids must be ascending");
      if (c->compress_ratios[ids[i]] == 0) {
        return bad(Item(name, i), "layer " + std::to_string(ids[i]) +
                                      " has compress ratio 0 (compress_ratios[" +
                                      std::to_string(ids[i]) + "]), so it cannot be a source");
      }
    }
    return Status::Ok();
  };
  FLASHD_RETURN_IF_ERROR(check_ids("kv_source_layer_ids", c->kv_source_layer_ids));
  FLASHD_RETURN_IF_ERROR(check_ids("index_source_layer_ids", c->index_source_layer_ids));

  c->layers.assign(L, LayerPlan{});
  const std::set<int> kv(c->kv_source_layer_ids.begin(), c->kv_source_layer_ids.end());
  const std::set<int> idx(c->index_source_layer_ids.begin(), c->index_source_layer_ids.end());
  int last_kv = -1;
  int last_index = -1;
  for (int l = 0; l < L; ++l) {
    LayerPlan& p = c->layers[l];
    p.compress_ratio = c->compress_ratios[l];
    p.is_kv_source = kv.count(l) > 0;
    p.is_index_source = idx.count(l) > 0;
    if (p.is_kv_source) last_kv = l;
    if (p.is_index_source) last_index = l;
    if (p.compress_ratio == 0) continue;
    const std::string layer = "layer " + std::to_string(l);
    if (last_kv < 0) {
      return bad(Item("compress_ratios", l),
                 layer + " compresses but no kv_source_layer_ids entry is at or before it");
    }
    if (c->compress_ratios[last_kv] != p.compress_ratio) {
      return bad(Item("compress_ratios", l),
                 layer + " has ratio " + std::to_string(p.compress_ratio) +
                     " but reads KV source " + std::to_string(last_kv) + " of ratio " +
                     std::to_string(c->compress_ratios[last_kv]));
    }
    p.kv_source = last_kv;
    if (last_index < 0) {
      return bad(Item("compress_ratios", l),
                 layer + " compresses but no index_source_layer_ids entry is at or before it");
    }
    p.index_source = last_index;
    if (c->layers[last_index].kv_source != last_kv) {
      return bad("text_config.index_source_layer_ids",
                 layer + " reads KV source " + std::to_string(last_kv) +
                     " but reuses the selection of index source " + std::to_string(last_index) +
                     ", which indexes KV source " +
                     std::to_string(c->layers[last_index].kv_source));
    }
  }
  // Every KV source is also an index source here: the loop above refused a KV source whose
  // selection would come from an earlier source's index. It writes the index keys.
  for (int l : c->kv_source_layer_ids) c->layers[l].owns_index_keys = true;
  if (!c->index_source_layer_ids.empty()) {
    if (c->index_n_heads <= 0) return bad("text_config.index_n_heads", "must be positive");
    if (c->index_head_dim <= 0 || c->index_head_dim % 32 != 0 ||
        c->index_head_dim < c->qk_rope_head_dim) {
      return bad("text_config.index_head_dim",
                 "must be a positive multiple of 32, at least qk_rope_head_dim");
    }
    if (c->index_topk <= 0) return bad("text_config.index_topk", "must be positive");
  }
  if (c->candidate_source_layer_id >= 0) {
    if (!idx.count(c->candidate_source_layer_id)) {
      return bad(
          "text_config.candidate_source_layer_id",
          "layer " + std::to_string(c->candidate_source_layer_id) + " is not an index source");
    }
    if (c->candidate_topk_blocks <= 0 || c->candidate_block_size <= 0) {
      return bad("text_config.candidate_topk_blocks",
                 "candidate_topk_blocks and candidate_block_size must be positive");
    }
    c->layers[c->candidate_source_layer_id].is_candidate_source = true;
    for (int l : c->index_source_layer_ids) {
      if (l > c->candidate_source_layer_id) c->layers[l].uses_candidates = true;
    }
  }

  return Status::Ok();
}

Status ValidateEngram(ModelConfig* c, const Complaint& bad) {
  const int L = c->num_hidden_layers;
  if (c->engram_layer_ids.size() != c->engram_num_embeddings.size()) {
    return bad("text_config.engram_num_embeddings", "needs one entry per engram_layer_ids entry (" +
                                                        std::to_string(c->engram_layer_ids.size()) +
                                                        ")");
  }
  for (size_t i = 0; i < c->engram_layer_ids.size(); ++i) {
    int l = c->engram_layer_ids[i];
    if (l < 0 || l >= L) return bad(Item("engram_layer_ids", i), "layer out of range");
    if (c->layers[l].engram_index >= 0) return bad(Item("engram_layer_ids", i), "duplicate");
    c->layers[l].engram_index = static_cast<int>(i);
  }
  if (!c->engram_layer_ids.empty()) {
    if (c->engram_max_ngram_size < 2) {
      return bad("text_config.engram_max_ngram_size", "must be at least 2");
    }
    if (c->engram_n_heads <= 0) return bad("text_config.engram_n_heads", "must be positive");
    if (c->engram_head_dim <= 0 || c->engram_head_dim % 32 != 0) {
      return bad("text_config.engram_head_dim", "must be a positive multiple of 32");
    }
    if (c->engram_vocab_size < 2) return bad("text_config.engram_vocab_size", "must be >= 2");
    if (c->engram_compressed_vocab_size <= 0) {
      return bad("text_config.engram_compressed_vocab_size", "must be positive");
    }
    c->engram_primes = EngramPrimes(*c);
    for (size_t i = 0; i < c->engram_layer_ids.size(); ++i) {
      int64_t rows = 0;
      for (const auto& per_n : c->engram_primes[i]) {
        for (int64_t p : per_n) rows += p;
      }
      if (rows != c->engram_num_embeddings[i]) {
        return bad(Item("engram_num_embeddings", i),
                   std::to_string(c->engram_num_embeddings[i]) +
                       " rows, but the prime layout from engram_vocab_size " +
                       std::to_string(c->engram_vocab_size) + " gives " + std::to_string(rows));
      }
    }
  }

  return Status::Ok();
}

Status ValidateDSpark(const ModelConfig* c, const Complaint& bad) {
  const int L = c->num_hidden_layers;
  if (c->num_nextn_predict_layers > 0) {
    if (c->dspark_block_size <= 0) return bad("text_config.dspark_block_size", "must be positive");
    if (c->dspark_target_layer_ids.empty()) {
      return bad("text_config.dspark_target_layer_ids", "must name at least one layer");
    }
    for (size_t i = 0; i < c->dspark_target_layer_ids.size(); ++i) {
      int l = c->dspark_target_layer_ids[i];
      if (l < 0 || l >= L) return bad(Item("dspark_target_layer_ids", i), "layer out of range");
    }
    if (c->dspark_n_routed_experts <= 0 || c->dspark_num_experts_per_tok <= 0 ||
        c->dspark_num_experts_per_tok > c->dspark_n_routed_experts) {
      return bad("text_config.dspark_n_routed_experts",
                 "DSpark expert counts must be positive, top-k at most the expert count");
    }
  }
  return Status::Ok();
}

Status Validate(ModelConfig* c, const std::string& source) {
  const Complaint bad{source};
  FLASHD_RETURN_IF_ERROR(ValidateShapes(c, bad));
  FLASHD_RETURN_IF_ERROR(PlanLayers(c, bad));
  FLASHD_RETURN_IF_ERROR(ValidateEngram(c, bad));
  return ValidateDSpark(c, bad);
  return Status::Ok();
}

}  // namespace

bool IsPrime(uint64_t n) {
  if (n < 2) return false;
  for (uint64_t p : {2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37}) {
    if (n % p == 0) return n == p;
  }
  // Deterministic Miller-Rabin for 64-bit n with the first 12 primes as bases.
  uint64_t d = n - 1;
  int r = 0;
  while ((d & 1) == 0) {
    d >>= 1;
    ++r;
  }
  auto mulmod = [n](uint64_t a, uint64_t b) {
    return static_cast<uint64_t>(static_cast<unsigned __int128>(a) * b % n);
  };
  auto powmod = [&](uint64_t a, uint64_t e) {
    uint64_t result = 1;
    a %= n;
    while (e) {
      if (e & 1) result = mulmod(result, a);
      a = mulmod(a, a);
      e >>= 1;
    }
    return result;
  };
  for (uint64_t a : {2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37}) {
    uint64_t x = powmod(a, d);
    if (x == 1 || x == n - 1) continue;
    bool composite = true;
    for (int i = 1; i < r; ++i) {
      x = mulmod(x, x);
      if (x == n - 1) {
        composite = false;
        break;
      }
    }
    if (composite) return false;
  }
  return true;
}

std::vector<std::vector<std::vector<int64_t>>> EngramPrimes(const ModelConfig& c) {
  std::set<int64_t> taken;
  std::vector<std::vector<std::vector<int64_t>>> out;
  for (size_t layer = 0; layer < c.engram_layer_ids.size(); ++layer) {
    std::vector<std::vector<int64_t>> per_layer;
    for (int n = 2; n <= c.engram_max_ngram_size; ++n) {
      std::vector<int64_t> heads;
      int64_t current = c.engram_vocab_size - 1;
      for (int h = 0; h < c.engram_n_heads; ++h) {
        int64_t candidate = current + 1;
        while (!IsPrime(static_cast<uint64_t>(candidate)) || taken.count(candidate)) ++candidate;
        taken.insert(candidate);
        heads.push_back(candidate);
        current = candidate;
      }
      per_layer.push_back(std::move(heads));
    }
    out.push_back(std::move(per_layer));
  }
  return out;
}

StatusOr<ModelConfig> ParseModelConfig(std::string_view json_text, std::string_view source_name) {
  const std::string source(source_name);
  json root;
  try {
    root = json::parse(json_text);
  } catch (const json::exception& e) {
    return InvalidArgument(source + ": not valid JSON: " + e.what());
  }
  if (!root.is_object()) return InvalidArgument(source + ": expected a JSON object");

  ModelConfig c;
  Status error;
  Fields top(&root, "", source, &error);
  top.Get("model_type", &c.model_type);
  if (error.ok() && c.model_type != "deepseek_v41") {
    return InvalidArgument(source + ": model_type: unknown model type \"" + c.model_type +
                           "\" (flashd serves deepseek_v41)");
  }
  top.Get("architectures", &c.architectures, false);
  top.Get("bos_token_id", &c.bos_token_id);
  top.Get("eos_token_id", &c.eos_token_id);
  top.Get("pad_token_id", &c.pad_token_id, false);
  top.Get("image_token_id", &c.image_token_id, false);

  if (const json* q = top.Object("quantization_config", true)) {
    Fields f(q, "quantization_config", source, &error);
    f.Get("quant_method", &c.quantization.quant_method);
    f.Get("activation_scheme", &c.quantization.activation_scheme, false);
    std::vector<int> block;
    f.Get("weight_block_size", &block);
    if (error.ok() && block.size() != 2) f.Fail("weight_block_size", "expected two numbers");
    if (error.ok()) {
      c.quantization.weight_block_rows = block[0];
      c.quantization.weight_block_cols = block[1];
    }
    f.Get("scale_fmt", &c.quantization.scale_fmt);
    f.Get("expert_dtype", &c.quantization.expert_dtype, false);
  }

  if (const json* t = top.Object("text_config", true)) {
    Fields f(t, "text_config", source, &error);
    f.Get("vocab_size", &c.vocab_size);
    f.Get("hidden_size", &c.hidden_size);
    f.Get("num_hidden_layers", &c.num_hidden_layers);
    f.Get("moe_intermediate_size", &c.moe_intermediate_size);
    f.Get("num_attention_heads", &c.num_attention_heads);
    f.Get("num_key_value_heads", &c.num_key_value_heads);
    f.Get("head_dim", &c.head_dim);
    f.Get("qk_rope_head_dim", &c.qk_rope_head_dim);
    f.Get("q_lora_rank", &c.q_lora_rank);
    f.Get("o_lora_rank", &c.o_lora_rank);
    f.Get("o_groups", &c.o_groups);
    f.Get("sliding_window", &c.sliding_window);
    f.Get("hidden_act", &c.hidden_act, false);
    f.Get("swiglu_limit", &c.swiglu_limit);
    f.Get("rms_norm_eps", &c.rms_norm_eps);
    f.Get("rope_theta", &c.rope_theta);
    f.Get("compress_rope_theta", &c.compress_rope_theta);
    if (const json* rs = f.Object("rope_scaling", false)) {
      Fields r(rs, "text_config.rope_scaling", source, &error);
      r.Get("type", &c.rope_scaling.type);
      r.Get("factor", &c.rope_scaling.factor);
      r.Get("beta_fast", &c.rope_scaling.beta_fast);
      r.Get("beta_slow", &c.rope_scaling.beta_slow);
      r.Get("original_max_position_embeddings", &c.rope_scaling.original_max_position_embeddings);
    }
    f.Get("max_position_embeddings", &c.max_position_embeddings);
    f.Get("n_routed_experts", &c.n_routed_experts);
    f.Get("n_shared_experts", &c.n_shared_experts);
    f.Get("num_experts_per_tok", &c.num_experts_per_tok);
    f.Get("scoring_func", &c.scoring_func);
    f.Get("topk_method", &c.topk_method);
    f.Get("norm_topk_prob", &c.norm_topk_prob);
    f.Get("routed_scaling_factor", &c.routed_scaling_factor);
    f.Get("compress_ratios", &c.compress_ratios);
    f.Get("kv_source_layer_ids", &c.kv_source_layer_ids);
    f.Get("index_source_layer_ids", &c.index_source_layer_ids);
    f.Get("index_n_heads", &c.index_n_heads);
    f.Get("index_head_dim", &c.index_head_dim);
    f.Get("index_topk", &c.index_topk);
    f.Get("candidate_source_layer_id", &c.candidate_source_layer_id, false);
    f.Get("candidate_topk_blocks", &c.candidate_topk_blocks, false);
    f.Get("candidate_block_size", &c.candidate_block_size, false);
    f.Get("hc_mult", &c.hc_mult);
    f.Get("hc_sinkhorn_iters", &c.hc_sinkhorn_iters);
    f.Get("hc_eps", &c.hc_eps);
    f.Get("engram_layer_ids", &c.engram_layer_ids, false);
    const bool engram = !c.engram_layer_ids.empty();
    f.Get("engram_num_embeddings", &c.engram_num_embeddings, engram);
    f.Get("engram_max_ngram_size", &c.engram_max_ngram_size, engram);
    f.Get("engram_vocab_size", &c.engram_vocab_size, engram);
    f.Get("engram_n_heads", &c.engram_n_heads, engram);
    f.Get("engram_head_dim", &c.engram_head_dim, engram);
    f.Get("engram_pad_token_id", &c.engram_pad_token_id, false);
    f.Get("engram_compressed_vocab_size", &c.engram_compressed_vocab_size, engram);
    f.Get("num_nextn_predict_layers", &c.num_nextn_predict_layers, false);
    const bool dspark = c.num_nextn_predict_layers > 0;
    f.Get("dspark_block_size", &c.dspark_block_size, dspark);
    f.Get("dspark_noise_token_id", &c.dspark_noise_token_id, dspark);
    f.Get("dspark_target_layer_ids", &c.dspark_target_layer_ids, dspark);
    f.Get("dspark_markov_rank", &c.dspark_markov_rank, dspark);
    f.Get("dspark_n_routed_experts", &c.dspark_n_routed_experts, dspark);
    f.Get("dspark_num_experts_per_tok", &c.dspark_num_experts_per_tok, dspark);
  }

  if (const json* v = top.Object("vision_config", false)) {
    Fields f(v, "vision_config", source, &error);
    f.Get("num_hidden_layers", &c.vision.num_hidden_layers);
    f.Get("hidden_size", &c.vision.hidden_size);
    f.Get("num_attention_heads", &c.vision.num_attention_heads);
    f.Get("intermediate_size", &c.vision.intermediate_size);
    f.Get("patch_size", &c.vision.patch_size);
    f.Get("downsample_ratio", &c.vision.downsample_ratio);
    f.Get("max_image_tokens", &c.vision.max_image_tokens, false);
    f.Get("min_pixels", &c.vision.min_pixels, false);
  }
  FLASHD_RETURN_IF_ERROR(error);
  FLASHD_RETURN_IF_ERROR(Validate(&c, source));
  return c;
}

StatusOr<ModelConfig> LoadModelConfig(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::path file = path;
  if (!fs::exists(file, ec)) {
    return NotFound(path + ": no such model directory or config.json");
  }
  if (fs::is_directory(file, ec)) file /= "config.json";
  std::ifstream in(file, std::ios::binary);
  if (!in) {
    return NotFound(file.string() + ": cannot read the model's config.json (" +
                    (fs::exists(file, ec) ? "unreadable" : "no such file") + ")");
  }
  std::stringstream ss;
  ss << in.rdbuf();
  return ParseModelConfig(ss.str(), file.string());
}

}  // namespace flashd::engine
