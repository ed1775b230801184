#include "engine/model_info.h"

#include "engine/safetensors.h"
#include "engine/weights.h"

namespace flashd::engine {

ModelStats ComputeModelStats(const ModelConfig& c) {
  ModelStats s;
  const std::vector<TensorSpec> specs = ExpectedTensors(c);
  const uint64_t dim = static_cast<uint64_t>(c.hidden_size);
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    if (c.layers[l].is_kv_source) s.last_kv_source_layer = l;
  }

  // Per layer: parameters every token uses, and one routed expert's parameters.
  std::vector<uint64_t> layer_dense(c.num_hidden_layers, 0);
  std::vector<uint64_t> layer_expert(c.num_hidden_layers, 0);
  uint64_t head = 0;
  for (const TensorSpec& t : specs) {
    uint64_t elements = 1;
    for (int64_t d : t.shape) elements *= static_cast<uint64_t>(d);
    const std::string dtype(DTypeName(StoredDType(t.kind)));
    s.checkpoint_bytes_by_dtype[dtype] += DTypeBytes(StoredDType(t.kind), elements);
    s.checkpoint_bytes += DTypeBytes(StoredDType(t.kind), elements);
    switch (t.part) {
      case ModelPart::kBackbone:
        s.params_backbone += t.params;
        break;
      case ModelPart::kEngram:
        s.params_engram += t.params;
        break;
      case ModelPart::kDSpark:
        s.params_dspark += t.params;
        break;
      case ModelPart::kVision:
        s.params_vision += t.params;
        break;
    }
    if (t.name == "head.weight") head = t.params;
    if (t.layer < 0 || t.part == ModelPart::kDSpark) continue;
    if (t.kind == TensorKind::kFp8Table) {
      // An Engram lookup reads one row per hash column, not the table.
      layer_dense[t.layer] += static_cast<uint64_t>(c.engram_hash_columns() * c.engram_head_dim);
    } else if (t.expert == 0) {
      layer_expert[t.layer] += t.params;
    } else if (t.expert < 0) {
      layer_dense[t.layer] += t.params;
    }
  }

  // The vision tower's tensor names are not part of this engine's layout; estimate its size
  // from vision_config: per layer attention (4 h^2 + 4 h), a gated MLP (3 h i) and two norms,
  // the patch embedding (3 p^2 h), and an aligner projecting d^2 merged patches to the model.
  if (c.vision_enabled()) {
    const uint64_t h = c.vision.hidden_size;
    const uint64_t inter = c.vision.intermediate_size;
    const uint64_t p = c.vision.patch_size;
    const uint64_t d = c.vision.downsample_ratio;
    s.params_vision = c.vision.num_hidden_layers * (4 * h * h + 4 * h + 3 * h * inter + 2 * h) +
                      3 * p * p * h + h * d * d * dim + dim * dim;
  }

  uint64_t all_layers = 0;
  uint64_t encoder_layers = 0;
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    uint64_t active =
        layer_dense[l] + static_cast<uint64_t>(c.num_experts_per_tok) * layer_expert[l];
    all_layers += active;
    if (l <= s.last_kv_source_layer) encoder_layers += active;
  }
  const uint64_t final_norm = dim;
  s.params_active_decode = dim + all_layers + final_norm + head;
  s.params_active_prefill_full = dim + all_layers;
  s.params_active_prefill = dim + encoder_layers;

  for (int l = 0; l < c.num_hidden_layers; ++l) {
    const LayerPlan& p = c.layers[l];
    if (!p.is_kv_source) continue;
    KvSourceBytes k;
    k.layer = l;
    k.compress_ratio = p.compress_ratio;
    k.entry_bytes = static_cast<uint64_t>(c.head_dim / 2 + c.head_dim / 16);
    k.index_key_bytes =
        p.owns_index_keys ? static_cast<uint64_t>(c.index_head_dim / 2 + c.index_head_dim / 32) : 0;
    k.bytes_per_token = double(k.entry_bytes + k.index_key_bytes) / p.compress_ratio;
    s.kv_bytes_per_token += k.bytes_per_token;
    s.kv_sources.push_back(k);
  }

  const uint64_t window_row = static_cast<uint64_t>(c.head_dim + c.head_dim / 32);
  s.window_ring_bytes = static_cast<uint64_t>(c.num_hidden_layers * c.sliding_window) * window_row;
  for (const KvSourceBytes& k : s.kv_sources) {
    if (k.compress_ratio > 1) {
      s.compressor_state_bytes += 2ull * k.compress_ratio * c.head_dim * sizeof(float);
    }
  }
  s.logits_bytes = static_cast<uint64_t>(c.vocab_size) * sizeof(float);
  if (!c.engram_layer_ids.empty()) {
    s.engram_history_bytes = static_cast<uint64_t>(c.engram_max_ngram_size - 1) * sizeof(int32_t);
  }
  s.sequence_state_bytes =
      s.window_ring_bytes + s.compressor_state_bytes + s.logits_bytes + s.engram_history_bytes;
  s.dspark_window_bytes =
      static_cast<uint64_t>(c.num_nextn_predict_layers * c.sliding_window) * window_row;
  return s;
}

}  // namespace flashd::engine
