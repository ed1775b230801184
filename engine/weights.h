// The tensors a config implies, by their released names, and binding them to a checkpoint.
//
// ExpectedTensors() is the one description of the checkpoint layout: the loader checks against
// it, `flashd mkmodel` writes it, and `flashd model-info` counts it. Names follow the reference
// module tree: "layers.{L}.attn.wq_a.weight" with its "layers.{L}.attn.wq_a.scale",
// "layers.{L}.ffn.experts.{E}.w1.weight", "layers.{L}.engram.embed.weight", "embed.weight",
// "head.weight", "norm.weight", and "mtp.{i}.*" for the DSpark drafter.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "config/status.h"
#include "engine/model_config.h"
#include "engine/safetensors.h"

namespace flashd::engine {

// Which part of the model a tensor belongs to, for parameter counts and load reports.
enum class ModelPart { kBackbone, kEngram, kDSpark, kVision };
const char* ModelPartName(ModelPart part);

// How a tensor is stored, which decides its accepted dtypes and shapes.
enum class TensorKind {
  kFp8Weight,    // F8_E4M3 [out, in]
  kFp8Scale,     // F8_E8M0 [ceil(out/32), ceil(in/32)]
  kFp4Weight,    // I8 [out, in/2] (two E2M1 per byte), or F4 [out, in]
  kFp4Scale,     // F8_E8M0 [out, in/32]
  kFp8Table,     // Engram rows: F8_E4M3 [rows, dim]
  kFp8RowScale,  // Engram row scales: F8_E8M0 [rows, dim/32]
  kBf16,         // BF16 (F32 accepted): norms, router, small projections, embeddings
  kF32,          // F32: mHC mixers, sinks, router biases
};

struct TensorSpec {
  std::string name;
  TensorKind kind;
  std::vector<int64_t> shape;  // As stored in the release (FP4: [out, in/2]).
  ModelPart part;
  int layer = -1;  // Backbone layer, or -1.
  // Parameters in logical values: FP4 counts two per byte, scales count zero.
  uint64_t params = 0;
  int expert = -1;  // Routed expert index, or -1 for tensors every token of the layer uses.
};

// Every tensor the config implies (backbone, Engram, DSpark), in a stable order.
std::vector<TensorSpec> ExpectedTensors(const ModelConfig& config);

// The release's dtype for a kind (the first accepted one).
DType StoredDType(TensorKind kind);

// Tensors bound to one checkpoint, plus what the checkpoint holds beyond them.
struct BoundWeights {
  // Every expected backbone/Engram tensor, and the DSpark tensors the checkpoint has.
  std::map<std::string, const TensorView*> tensors;
  // The DSpark drafter: every one of its tensors is present (checked like the rest), or how
  // many the config implies that are not.
  bool dspark = false;
  int64_t dspark_missing = 0;
  // Present but not used by this engine, by part (vision; DSpark when incomplete), with bytes.
  std::map<ModelPart, std::pair<uint64_t, uint64_t>> unused;  // part -> (tensors, bytes)
  std::vector<std::string> unexpected;  // Names no part of the model explains.
};

// Binds every backbone, Engram and present DSpark tensor by name, checking dtype and shape. Fails
// listing the missing tensors (up to a few dozen names and the total) or naming the first mismatch.
StatusOr<BoundWeights> BindWeights(const ModelConfig& config, const Checkpoint& checkpoint);

}  // namespace flashd::engine
