// Routing for the grouped-expert tests: `k` distinct experts per token, as the router picks
// them, and MoeGroup's outputs sized for a number of slots and grouped rows.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernels/ops.h"

namespace flashd::testing {

// tokens * k expert ids, token by token: each token's k ids distinct, each drawn by `draw()`
// (which returns an id) until it is new for that token.
template <class Draw>
std::vector<int64_t> DistinctChoices(int64_t tokens, int64_t k, Draw draw) {
  std::vector<int64_t> chosen;
  for (int64_t t = 0; t < tokens; ++t) {
    std::vector<int64_t> pick;
    while (static_cast<int64_t>(pick.size()) < k) {
      const int64_t e = draw();
      if (std::find(pick.begin(), pick.end(), e) == pick.end()) pick.push_back(e);
    }
    chosen.insert(chosen.end(), pick.begin(), pick.end());
  }
  return chosen;
}

// MoeGroup's outputs for `slots` slots over `total` grouped rows (tokens * k).
struct GroupedRows {
  std::vector<int64_t> expert, offset, tiles, rows;
  std::vector<float> weights;
  GroupedRows(int64_t slots, int64_t total)
      : expert(static_cast<size_t>(slots)),
        offset(static_cast<size_t>(slots + 1)),
        tiles(static_cast<size_t>(slots + 1)),
        rows(static_cast<size_t>(total)),
        weights(static_cast<size_t>(total)) {}
  // MoeGroup's parameters writing into these (host memory).
  kernels::MoeGroupParams Params(const int64_t* chosen, const float* choice_weights, int64_t tokens,
                                 int64_t experts, int64_t k) {
    return {.chosen = chosen,
            .weights = choice_weights,
            .tokens = tokens,
            .experts = experts,
            .k = k,
            .slots = static_cast<int64_t>(expert.size()),
            .slot_expert = expert.data(),
            .slot_offset = offset.data(),
            .slot_tiles = tiles.data(),
            .rows = rows.data(),
            .row_weights = weights.data()};
  }
};

}  // namespace flashd::testing
