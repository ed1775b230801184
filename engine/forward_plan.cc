#include "engine/forward_plan.h"

#include <algorithm>

#include "kernels/ops.h"

namespace flashd::engine {

ForwardPlan PlanForward(const ModelConfig& c, const KvBlockLayout& layout,
                        const EngramHasher* engram, std::span<const PlanRequest> requests) {
  ForwardPlan plan;
  const int64_t win = c.sliding_window;
  for (const PlanRequest& r : requests) {
    const SequenceState& st = *r.state;
    const int64_t P = st.position;
    ForwardPlan::Segment seg{plan.tokens.size(), r.tokens.size(), P, 0};
    plan.segments.push_back(seg);
    plan.tokens.insert(plan.tokens.end(), r.tokens.begin(), r.tokens.end());
    for (size_t t = 0; t < r.tokens.size(); ++t) {
      const int64_t pos = P + static_cast<int64_t>(t);
      plan.positions.push_back(pos);
      plan.window_first.push_back(std::max<int64_t>(0, pos - win + 1));
    }
    // Completed groups of every KV source, and the blocks their entries live in.
    std::vector<ForwardPlan::Groups> groups(layout.sources.size());
    size_t first_block = SIZE_MAX, last_block = 0;
    for (size_t s = 0; s < layout.sources.size(); ++s) {
      const KvBlockLayout::Source& src = layout.sources[s];
      ForwardPlan::Groups& g = groups[s];
      g.first_entry = st.sources[src.layer].entries;
      for (size_t t = 0; t < r.tokens.size(); ++t) {
        const int64_t pos = P + static_cast<int64_t>(t);
        if ((pos + 1) % src.ratio != 0) continue;
        const int64_t rope_pos = pos / src.ratio * src.ratio;
        const int64_t entry = g.first_entry + static_cast<int64_t>(g.positions.size());
        g.positions.push_back(rope_pos);
        const bool frozen = rope_pos + src.ratio <= st.frozen_tokens;
        g.rows.push_back(frozen ? -1 : 0);  // AssignRows fills in the row.
        if (!frozen) {
          const size_t b = static_cast<size_t>(entry / src.entries_per_block);
          first_block = std::min(first_block, b);
          last_block = std::max(last_block, b + 1);
        }
      }
    }
    plan.groups.push_back(std::move(groups));
    plan.write_blocks.push_back(first_block == SIZE_MAX ? std::pair<size_t, size_t>{0, 0}
                                                        : std::pair{first_block, last_block});
  }
  // Engram rows for every token, and each sequence's history after it.
  if (engram != nullptr) {
    plan.engram_stride = static_cast<int>(c.engram_layer_ids.size()) * engram->columns();
    plan.engram_rows.resize(plan.tokens.size() * plan.engram_stride);
    for (size_t i = 0; i < requests.size(); ++i) {
      std::vector<int32_t> history = requests[i].state->engram_classes;
      const ForwardPlan::Segment& sg = plan.segments[i];
      for (size_t t = sg.offset; t < sg.offset + sg.count; ++t) {
        history.push_back(engram->ClassOf(plan.tokens[t]));
        const int count = std::min<int>(engram->history() + 1, static_cast<int>(history.size()));
        engram->Hash(history.data() + history.size() - count, count,
                     &plan.engram_rows[t * plan.engram_stride]);
        if (static_cast<int>(history.size()) > engram->history()) {
          history.erase(history.begin(), history.end() - engram->history());
        }
      }
      plan.engram_history.push_back(std::move(history));
    }
  } else {
    plan.engram_history.resize(requests.size());
    for (size_t i = 0; i < requests.size(); ++i) {
      plan.engram_history[i] = requests[i].state->engram_classes;
    }
  }
  return plan;
}

void AssignRows(const KvBlockLayout& layout, std::span<const PlanRequest> requests,
                ForwardPlan* plan) {
  for (size_t i = 0; i < requests.size(); ++i) {
    const std::vector<int32_t>& blocks = requests[i].state->blocks;
    for (size_t s = 0; s < layout.sources.size(); ++s) {
      ForwardPlan::Groups& g = plan->groups[i][s];
      const int64_t per_block = layout.sources[s].entries_per_block;
      for (size_t k = 0; k < g.rows.size(); ++k) {
        if (g.rows[k] < 0) continue;
        g.rows[k] =
            kernels::BlockRow(blocks.data(), per_block, g.first_entry + static_cast<int64_t>(k));
      }
    }
  }
}

std::vector<int32_t> ForwardPlan::RowSegments() const {
  std::vector<int32_t> of(rows());
  for (size_t i = 0; i < segments.size(); ++i) {
    const Segment& sg = segments[i];
    std::fill_n(of.begin() + static_cast<std::ptrdiff_t>(sg.offset), sg.count,
                static_cast<int32_t>(i));
  }
  return of;
}

std::vector<size_t> ForwardPlan::Truncate(size_t keep) {
  std::vector<size_t> kept;
  size_t offset = 0;
  for (Segment& sg : segments) {
    const size_t drop = sg.count > keep ? sg.count - keep : 0;
    for (size_t t = sg.offset + drop; t < sg.offset + sg.count; ++t) kept.push_back(t);
    sg.start += static_cast<int64_t>(drop);
    sg.window_floor = drop > 0 ? sg.start : 0;
    sg.count -= drop;
    sg.offset = offset;
    offset += sg.count;
  }
  GatherRows(&tokens, kept, 1);
  GatherRows(&positions, kept, 1);
  GatherRows(&window_first, kept, 1);
  if (engram_stride > 0) GatherRows(&engram_rows, kept, static_cast<size_t>(engram_stride));
  for (const Segment& sg : segments) {
    for (size_t t = sg.offset; t < sg.offset + sg.count; ++t) {
      window_first[t] = std::max(window_first[t], sg.window_floor);
    }
  }
  return kept;
}

}  // namespace flashd::engine
