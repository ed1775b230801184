// ForwardPlan: every index one forward step needs, computed on the host before any math: the
// rows of the batch and their positions, each row's first window position, the compressed
// entries each KV source completes (their rotation positions and the pool rows they go to, -1
// for entries restored from the cache, which stay as they are), the KV blocks each sequence
// writes, and the Engram row ids of every token with each sequence's new n-gram history.
//
// Building a plan reads the sequences and changes nothing; a step applies the plan's new state
// (positions, entries, histories) only once every op has succeeded.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "config/status.h"
#include "engine/engram.h"
#include "engine/kv_pool.h"
#include "engine/model_config.h"
#include "engine/sequence_state.h"

namespace flashd::engine {

struct ForwardPlan {
  // One sequence's rows.
  struct Segment {
    size_t offset = 0, count = 0;
    int64_t start = 0;         // Position of the first row.
    int64_t window_floor = 0;  // Window rows before this position are not attended (replay).
  };
  // The entries one KV source completes in one segment, in order.
  struct Groups {
    int64_t first_entry = 0;
    std::vector<int64_t> positions;  // Rotation position: the group's first token.
    std::vector<int64_t> rows;       // Pool row id of each entry, -1: frozen (restored).
  };

  std::vector<Segment> segments;
  std::vector<int32_t> tokens;              // [rows]
  std::vector<int64_t> positions;           // [rows]
  std::vector<int64_t> window_first;        // [rows]: the first position each row attends to.
  std::vector<std::vector<Groups>> groups;  // [segment][KV source index]
  // Blocks [first, last) of each segment's sequence that the step writes (first == last: none).
  std::vector<std::pair<size_t, size_t>> write_blocks;
  int engram_stride = 0;                             // Row ids per token (all Engram layers).
  std::vector<int64_t> engram_rows;                  // [rows, engram_stride]
  std::vector<std::vector<int32_t>> engram_history;  // [segment]: the history after the step.

  size_t rows() const { return tokens.size(); }
  // Each row's segment (its index in segments).
  std::vector<int32_t> RowSegments() const;

  // The bounded replay: keeps only the last `keep` rows of every longer segment, whose window
  // then starts at its first kept row. Returns the kept rows' old indices.
  std::vector<size_t> Truncate(size_t keep);
};

// Keeps the rows `kept` (indices, in order) of `v`, each `width` elements wide.
template <typename V>
void GatherRows(V* v, const std::vector<size_t>& kept, size_t width) {
  V out(kept.size() * width);
  for (size_t i = 0; i < kept.size(); ++i) {
    std::copy(v->begin() + kept[i] * width, v->begin() + (kept[i] + 1) * width,
              out.begin() + i * width);
  }
  v->swap(out);
}

struct PlanRequest {
  const SequenceState* state;
  std::span<const int32_t> tokens;
};

// REQUIRES: every state belongs to a model with config `c` and block layout `layout`; tokens
// are in the vocabulary (the forward pass checks both first). `engram` may be null.
ForwardPlan PlanForward(const ModelConfig& c, const KvBlockLayout& layout,
                        const EngramHasher* engram, std::span<const PlanRequest> requests);

// Fills in the pool rows of every non-frozen entry, once each sequence's write_blocks are
// present in its block list (BlockManager::Reserve).
void AssignRows(const KvBlockLayout& layout, std::span<const PlanRequest> requests,
                ForwardPlan* plan);

}  // namespace flashd::engine
