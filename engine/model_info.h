// ModelStats: what a config implies for memory and compute, as `flashd model-info` reports it.
// The formulas are documented in docs/model.md.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "engine/model_config.h"

namespace flashd::engine {

struct KvSourceBytes {
  int layer = 0;
  int compress_ratio = 0;
  uint64_t entry_bytes = 0;      // One compressed KV entry: FP4 values + E4M3 scales per 16.
  uint64_t index_key_bytes = 0;  // One index key: FP4 values + E8M0 scales per 32 (0: none).
  double bytes_per_token = 0;    // (entry + index key) / ratio.
};

struct ModelStats {
  uint64_t params_backbone = 0;  // Embedding, head, every layer's attention and experts.
  uint64_t params_engram = 0;    // Engram tables and their projections.
  uint64_t params_dspark = 0;    // The DSpark drafter (mtp.*).
  uint64_t params_vision = 0;    // Vision tower and aligner: an estimate from vision_config.
  // Parameters one token touches: decode runs every layer and the head; prefill with the
  // decoder bounded replay runs only the layers up to the last KV source for all but the last
  // window of the prompt, and needs no head; without it prefill runs every layer.
  uint64_t params_active_decode = 0;
  uint64_t params_active_prefill = 0;
  uint64_t params_active_prefill_full = 0;
  int last_kv_source_layer = -1;

  std::vector<KvSourceBytes> kv_sources;
  double kv_bytes_per_token = 0;  // Persistent: what the prefix cache stores per token.

  // Bounded per-sequence state (does not grow with the context).
  uint64_t window_ring_bytes = 0;       // Every layer's FP8 window ring with its scales.
  uint64_t compressor_state_bytes = 0;  // Partial groups of ratio > 1 sources (fp32 kv + score).
  uint64_t logits_bytes = 0;            // Next-token logits, fp32.
  uint64_t engram_history_bytes = 0;    // The last max_ngram_size - 1 token classes.
  uint64_t sequence_state_bytes = 0;    // The sum of the four above.
  uint64_t dspark_window_bytes = 0;     // Extra window rings when the drafter runs.

  std::map<std::string, uint64_t> checkpoint_bytes_by_dtype;  // Vision excluded.
  uint64_t checkpoint_bytes = 0;
};

ModelStats ComputeModelStats(const ModelConfig& config);

}  // namespace flashd::engine
