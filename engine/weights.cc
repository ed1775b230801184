#include "engine/weights.h"

#include <algorithm>
#include <set>

namespace flashd::engine {
namespace {

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

class SpecBuilder {
 public:
  explicit SpecBuilder(std::vector<TensorSpec>* out) : out_(out) {}

  ModelPart part = ModelPart::kBackbone;
  int layer = -1;
  int expert = -1;

  void Add(const std::string& name, TensorKind kind, std::vector<int64_t> shape, uint64_t params) {
    TensorSpec s;
    s.name = name;
    s.kind = kind;
    s.shape = std::move(shape);
    s.part = part;
    s.layer = layer;
    s.params = params;
    s.expert = expert;
    out_->push_back(std::move(s));
  }
  void Vector(const std::string& name, TensorKind kind, int64_t n) {
    Add(name, kind, {n}, static_cast<uint64_t>(n));
  }
  void Matrix(const std::string& name, TensorKind kind, int64_t rows, int64_t cols) {
    Add(name, kind, {rows, cols}, static_cast<uint64_t>(rows * cols));
  }
  void Fp8Linear(const std::string& prefix, int64_t out, int64_t in) {
    Add(prefix + ".weight", TensorKind::kFp8Weight, {out, in}, static_cast<uint64_t>(out * in));
    Add(prefix + ".scale", TensorKind::kFp8Scale, {CeilDiv(out, 32), CeilDiv(in, 32)}, 0);
  }
  void Fp4Linear(const std::string& prefix, int64_t out, int64_t in) {
    Add(prefix + ".weight", TensorKind::kFp4Weight, {out, in / 2}, static_cast<uint64_t>(out * in));
    Add(prefix + ".scale", TensorKind::kFp4Scale, {out, in / 32}, 0);
  }
  void Bf16Linear(const std::string& prefix, int64_t out, int64_t in) {
    Matrix(prefix + ".weight", TensorKind::kBf16, out, in);
  }

 private:
  std::vector<TensorSpec>* out_;
};

// One transformer block's tensors (backbone layer or DSpark stage).
void AddBlock(const ModelConfig& c, SpecBuilder& b, const std::string& p, int compress_ratio,
              const LayerPlan* plan, int n_experts) {
  const int64_t dim = c.hidden_size;
  const int64_t hc = c.hc_mult;
  const int64_t mix = (2 + hc) * hc;
  b.Vector(p + "attn_norm.weight", TensorKind::kBf16, dim);
  b.Vector(p + "ffn_norm.weight", TensorKind::kBf16, dim);
  for (const char* sub : {"attn", "ffn"}) {
    b.Matrix(p + "hc_" + sub + "_fn", TensorKind::kF32, mix, hc * dim);
    b.Vector(p + "hc_" + sub + "_base", TensorKind::kF32, mix);
    b.Vector(p + "hc_" + sub + "_scale", TensorKind::kF32, 3);
  }
  const std::string a = p + "attn.";
  const int64_t heads = c.num_attention_heads;
  b.Vector(a + "attn_sink", TensorKind::kF32, heads);
  b.Fp8Linear(a + "wq_a", c.q_lora_rank, dim);
  b.Vector(a + "q_norm.weight", TensorKind::kBf16, c.q_lora_rank);
  b.Fp8Linear(a + "wq_b", heads * c.head_dim, c.q_lora_rank);
  b.Fp8Linear(a + "wkv", c.head_dim, dim);
  b.Vector(a + "kv_norm.weight", TensorKind::kBf16, c.head_dim);
  b.Fp8Linear(a + "wo_a", c.o_groups * c.o_lora_rank, heads * c.head_dim / c.o_groups);
  b.Fp8Linear(a + "wo_b", dim, c.o_groups * c.o_lora_rank);
  if (plan != nullptr && plan->is_kv_source) {
    b.Bf16Linear(a + "compressor.wkv", c.head_dim, dim);
    if (compress_ratio > 1) b.Bf16Linear(a + "compressor.wgate", c.head_dim, dim);
    b.Vector(a + "compressor.norm.weight", TensorKind::kBf16, c.head_dim);
  }
  if (plan != nullptr && plan->is_index_source) {
    b.Fp8Linear(a + "indexer.wq_b", c.index_n_heads * c.index_head_dim, c.q_lora_rank);
    b.Bf16Linear(a + "indexer.weights_proj", c.index_n_heads, dim);
    if (plan->owns_index_keys) {
      b.Bf16Linear(a + "indexer.wk", c.index_head_dim, c.head_dim);
      b.Vector(a + "indexer.k_norm.weight", TensorKind::kBf16, c.index_head_dim);
    }
  }
  const std::string f = p + "ffn.";
  b.Bf16Linear(f + "gate", n_experts, dim);
  b.Vector(f + "gate.bias", TensorKind::kF32, n_experts);
  if (c.vision_enabled()) b.Vector(f + "gate.bias_vl", TensorKind::kF32, n_experts);
  const int64_t inter = c.moe_intermediate_size;
  for (int e = 0; e < n_experts; ++e) {
    b.expert = e;
    const std::string x = f + "experts." + std::to_string(e) + ".";
    if (c.experts_fp4()) {
      b.Fp4Linear(x + "w1", inter, dim);
      b.Fp4Linear(x + "w2", dim, inter);
      b.Fp4Linear(x + "w3", inter, dim);
    } else {
      b.Fp8Linear(x + "w1", inter, dim);
      b.Fp8Linear(x + "w2", dim, inter);
      b.Fp8Linear(x + "w3", inter, dim);
    }
  }
  b.expert = -1;
  b.Fp8Linear(f + "shared_experts.w1", inter, dim);
  b.Fp8Linear(f + "shared_experts.w2", dim, inter);
  b.Fp8Linear(f + "shared_experts.w3", inter, dim);
}

bool AcceptedDType(TensorKind kind, DType d) {
  switch (kind) {
    case TensorKind::kFp8Weight:
    case TensorKind::kFp8Table:
      return d == DType::kF8E4M3;
    case TensorKind::kFp8Scale:
    case TensorKind::kFp4Scale:
    case TensorKind::kFp8RowScale:
      return d == DType::kF8E8M0;
    case TensorKind::kFp4Weight:
      return d == DType::kI8 || d == DType::kU8 || d == DType::kF4;
    case TensorKind::kBf16:
      return d == DType::kBF16 || d == DType::kF32;
    case TensorKind::kF32:
      return d == DType::kF32;
  }
  return false;
}

const char* AcceptedNames(TensorKind kind) {
  switch (kind) {
    case TensorKind::kFp8Weight:
    case TensorKind::kFp8Table:
      return "F8_E4M3";
    case TensorKind::kFp8Scale:
    case TensorKind::kFp4Scale:
    case TensorKind::kFp8RowScale:
      return "F8_E8M0";
    case TensorKind::kFp4Weight:
      return "I8 (packed FP4) or F4";
    case TensorKind::kBf16:
      return "BF16 or F32";
    case TensorKind::kF32:
      return "F32";
  }
  return "?";
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

bool IsVisionName(const std::string& name) {
  for (const char* prefix : {"vision.", "aligner.", "image_start", "image_end", "image_newline"}) {
    if (name.rfind(prefix, 0) == 0) return true;
  }
  return false;
}

}  // namespace

const char* ModelPartName(ModelPart part) {
  switch (part) {
    case ModelPart::kBackbone:
      return "backbone";
    case ModelPart::kEngram:
      return "engram";
    case ModelPart::kDSpark:
      return "dspark";
    case ModelPart::kVision:
      return "vision";
  }
  return "?";
}

DType StoredDType(TensorKind kind) {
  switch (kind) {
    case TensorKind::kFp8Weight:
    case TensorKind::kFp8Table:
      return DType::kF8E4M3;
    case TensorKind::kFp8Scale:
    case TensorKind::kFp4Scale:
    case TensorKind::kFp8RowScale:
      return DType::kF8E8M0;
    case TensorKind::kFp4Weight:
      return DType::kI8;
    case TensorKind::kBf16:
      return DType::kBF16;
    case TensorKind::kF32:
      return DType::kF32;
  }
  return DType::kF32;
}

std::vector<TensorSpec> ExpectedTensors(const ModelConfig& c) {
  std::vector<TensorSpec> out;
  SpecBuilder b(&out);
  const int64_t dim = c.hidden_size;
  b.Matrix("embed.weight", TensorKind::kBf16, c.vocab_size, dim);
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    const LayerPlan& plan = c.layers[l];
    const std::string p = "layers." + std::to_string(l) + ".";
    b.layer = l;
    b.part = ModelPart::kBackbone;
    AddBlock(c, b, p, plan.compress_ratio, &plan, c.n_routed_experts);
    if (plan.engram_index >= 0) {
      b.part = ModelPart::kEngram;
      const int64_t rows = c.engram_num_embeddings[plan.engram_index];
      const int64_t hd = c.engram_head_dim;
      b.Add(p + "engram.embed.weight", TensorKind::kFp8Table, {rows, hd},
            static_cast<uint64_t>(rows * hd));
      b.Add(p + "engram.embed.scale", TensorKind::kFp8RowScale, {rows, hd / 32}, 0);
      b.Fp8Linear(p + "engram.wkv", dim * (c.hc_mult + 1), c.engram_hash_columns() * hd);
      b.Matrix(p + "engram.q_weight", TensorKind::kBf16, c.hc_mult, dim);
      b.Matrix(p + "engram.k_weight", TensorKind::kBf16, c.hc_mult, dim);
    }
  }
  b.layer = -1;
  b.part = ModelPart::kBackbone;
  b.Vector("norm.weight", TensorKind::kBf16, dim);
  b.Matrix("head.weight", TensorKind::kBf16, c.vocab_size, dim);

  b.part = ModelPart::kDSpark;
  for (int s = 0; s < c.num_nextn_predict_layers; ++s) {
    const std::string p = "mtp." + std::to_string(s) + ".";
    AddBlock(c, b, p, 0, nullptr, c.dspark_n_routed_experts);
    if (s == 0) {
      const int64_t targets = static_cast<int64_t>(c.dspark_target_layer_ids.size());
      b.Fp8Linear(p + "main_proj", dim, dim * targets);
      b.Vector(p + "main_norm.weight", TensorKind::kBf16, dim);
    }
    if (s == c.num_nextn_predict_layers - 1) {
      b.Vector(p + "norm.weight", TensorKind::kBf16, dim);
      b.Matrix(p + "markov_head.embed.weight", TensorKind::kBf16, c.vocab_size,
               c.dspark_markov_rank);
      b.Matrix(p + "markov_head.head.weight", TensorKind::kBf16, c.vocab_size,
               c.dspark_markov_rank);
      b.Matrix(p + "confidence_head.proj.weight", TensorKind::kBf16, 1, dim + c.dspark_markov_rank);
    }
  }
  return out;
}

StatusOr<BoundWeights> BindWeights(const ModelConfig& config, const Checkpoint& checkpoint) {
  BoundWeights bound;
  std::vector<std::string> missing;
  std::set<std::string> explained;
  for (const TensorSpec& spec : ExpectedTensors(config)) {
    explained.insert(spec.name);
    const TensorView* t = checkpoint.Find(spec.name);
    if (t == nullptr) {
      // The drafter is optional: without all of its tensors the model runs without it.
      if (spec.part == ModelPart::kDSpark) {
        bound.dspark_missing += 1;
      } else {
        missing.push_back(spec.name);
      }
      continue;
    }
    const std::string where = *t->file + ": tensor " + spec.name;
    if (!AcceptedDType(spec.kind, t->dtype)) {
      return InvalidArgument(where + ": dtype " + std::string(DTypeName(t->dtype)) + ", expected " +
                             AcceptedNames(spec.kind));
    }
    std::vector<int64_t> want = spec.shape;
    if (spec.kind == TensorKind::kFp4Weight && t->dtype == DType::kF4) want.back() *= 2;
    if (t->shape != want) {
      return InvalidArgument(where + ": shape " + t->ShapeString() + ", expected " +
                             ShapeString(want) + " from config.json");
    }
    bound.tensors[spec.name] = t;
  }
  if (!missing.empty()) {
    std::string list;
    const size_t shown = std::min<size_t>(missing.size(), 24);
    for (size_t i = 0; i < shown; ++i) list += (i ? ", " : "") + missing[i];
    if (shown < missing.size()) list += ", ...";
    return NotFound("checkpoint lacks " + std::to_string(missing.size()) +
                    " tensors the config implies: " + list);
  }
  bool any_dspark = false;
  for (const auto& [name, view] : bound.tensors) any_dspark |= name.rfind("mtp.", 0) == 0;
  bound.dspark = any_dspark && bound.dspark_missing == 0;
  for (const auto& [name, view] : checkpoint.tensors()) {
    if (bound.tensors.count(name)) {
      if (bound.dspark || name.rfind("mtp.", 0) != 0) continue;
    }
    ModelPart part;
    if (name.rfind("mtp.", 0) == 0) {
      part = ModelPart::kDSpark;
    } else if (IsVisionName(name)) {
      part = ModelPart::kVision;
    } else {
      bound.unexpected.push_back(name);
      continue;
    }
    auto& [count, bytes] = bound.unused[part];
    count += 1;
    bytes += view->nbytes;
  }
  return bound;
}

}  // namespace flashd::engine
