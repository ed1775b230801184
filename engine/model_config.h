// ModelConfig: a model directory's config.json (model_type deepseek_v41), validated, with the
// facts every other part derives from it computed once.
//
// Field names follow the released config.json; where the reference code calls a field otherwise
// the comment says so. Errors name the JSON path of the field at fault, e.g.
// "config.json: text_config.kv_source_layer_ids[1]: layer 8 has compress ratio 0".
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "config/status.h"

namespace flashd::engine {

struct RopeScaling {
  std::string type;  // "yarn"
  double factor = 1;
  double beta_fast = 32;
  double beta_slow = 1;
  int64_t original_max_position_embeddings = 0;
};

struct QuantizationConfig {
  std::string quant_method;  // "fp8"
  std::string activation_scheme;
  int weight_block_rows = 32;
  int weight_block_cols = 32;
  std::string scale_fmt;     // "ue8m0"
  std::string expert_dtype;  // "fp4", or "" for FP8 experts
};

struct VisionConfig {
  int num_hidden_layers = 0;  // 0: no vision tower.
  int hidden_size = 0;
  int num_attention_heads = 0;
  int intermediate_size = 0;
  int patch_size = 0;
  int downsample_ratio = 0;
  int max_image_tokens = 0;
  int64_t min_pixels = 0;
};

// What one backbone layer does, derived from the lists in the config.
struct LayerPlan {
  int compress_ratio = 0;        // 0: sliding window only.
  bool is_kv_source = false;     // Owns a compressor and the compressed KV cache.
  bool is_index_source = false;  // Runs its own indexer.
  bool owns_index_keys = false;  // Index source that is also a KV source.
  bool is_candidate_source = false;
  bool uses_candidates = false;  // Index source after the candidate source.
  int kv_source = -1;            // The KV source this layer reads (itself if a source); -1: none.
  int index_source = -1;         // The index source whose selection it uses; -1: none.
  int engram_index = -1;         // Position in engram_layer_ids, or -1.
};

struct ModelConfig {
  std::string model_type;
  std::vector<std::string> architectures;
  int64_t bos_token_id = 0;
  int64_t eos_token_id = 1;
  int64_t pad_token_id = 2;
  int64_t image_token_id = -1;

  // text_config
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int num_hidden_layers = 0;
  int64_t moe_intermediate_size = 0;
  int num_attention_heads = 0;
  int num_key_value_heads = 1;
  int64_t head_dim = 0;
  int64_t qk_rope_head_dim = 0;
  int64_t q_lora_rank = 0;
  int64_t o_lora_rank = 0;
  int o_groups = 0;
  int64_t sliding_window = 0;
  std::string hidden_act;
  double swiglu_limit = 0;
  double rms_norm_eps = 0;
  double rope_theta = 0;
  double compress_rope_theta = 0;
  RopeScaling rope_scaling;
  int64_t max_position_embeddings = 0;
  int n_routed_experts = 0;
  int n_shared_experts = 0;
  int num_experts_per_tok = 0;
  std::string scoring_func;
  std::string topk_method;
  bool norm_topk_prob = true;
  double routed_scaling_factor = 1;
  std::vector<int> compress_ratios;  // Backbone layers, then the DSpark layers.
  std::vector<int> kv_source_layer_ids;
  std::vector<int> index_source_layer_ids;
  int index_n_heads = 0;
  int64_t index_head_dim = 0;
  int64_t index_topk = 0;
  int candidate_source_layer_id = -1;  // -1: no candidate pre-filter.
  int64_t candidate_topk_blocks = 0;
  int64_t candidate_block_size = 0;
  int hc_mult = 0;
  int hc_sinkhorn_iters = 0;
  double hc_eps = 0;
  std::vector<int> engram_layer_ids;
  std::vector<int64_t> engram_num_embeddings;
  int engram_max_ngram_size = 0;
  int64_t engram_vocab_size = 0;
  int engram_n_heads = 0;
  int64_t engram_head_dim = 0;
  int64_t engram_pad_token_id = 2;
  int64_t engram_compressed_vocab_size = 0;
  int num_nextn_predict_layers = 0;  // DSpark blocks.
  int dspark_block_size = 0;
  int64_t dspark_noise_token_id = 0;
  std::vector<int> dspark_target_layer_ids;
  int64_t dspark_markov_rank = 0;
  int dspark_n_routed_experts = 0;
  int dspark_num_experts_per_tok = 0;

  QuantizationConfig quantization;
  VisionConfig vision;

  // Derived once by Validate().
  std::vector<LayerPlan> layers;                                 // num_hidden_layers entries.
  std::vector<std::vector<std::vector<int64_t>>> engram_primes;  // [layer][n-2][head]

  bool experts_fp4() const { return quantization.expert_dtype == "fp4"; }
  bool vision_enabled() const { return vision.num_hidden_layers > 0; }
  int64_t engram_hash_columns() const {
    return int64_t(engram_max_ngram_size - 1) * engram_n_heads;
  }
};

// Parses config.json text. `source` names the file in messages.
StatusOr<ModelConfig> ParseModelConfig(std::string_view json_text, std::string_view source);

// Reads `path`: a model directory (its config.json) or a config.json file.
StatusOr<ModelConfig> LoadModelConfig(const std::string& path);

// The prime bucket sizes of the Engram tables: for each Engram layer and n-gram size, the next
// unused primes above engram_vocab_size - 1, one per head (the reference's EngramLayout).
std::vector<std::vector<std::vector<int64_t>>> EngramPrimes(const ModelConfig& config);

bool IsPrime(uint64_t n);

}  // namespace flashd::engine
