// The part of numpy's random module Engram depends on: np.random.default_rng(seed).integers(0,
// high, size, dtype=int64), bit for bit. default_rng is PCG64 (XSL-RR 128/64) seeded through
// SeedSequence; integers draws with Lemire's multiply-shift rejection on 64-bit words.
#pragma once

#include <cstdint>
#include <vector>

namespace flashd::engine {

class NumpyPcg64 {
 public:
  // As np.random.default_rng(seed) for a non-negative integer seed.
  explicit NumpyPcg64(uint64_t seed);

  uint64_t Next64();
  // As Generator.integers(0, high, dtype=np.int64) for one value. REQUIRES: high > 2^32.
  int64_t Integer(int64_t high);

 private:
  unsigned __int128 state_ = 0;
  unsigned __int128 inc_ = 0;
};

// Engram's multipliers: for each layer id, default_rng(10007 * id).integers(0, bound, size=n)
// * 2 + 1 with bound = (INT64_MAX // compressed_vocab) // 2.
std::vector<std::vector<int64_t>> EngramMultipliers(const std::vector<int>& layer_ids, int n,
                                                    int64_t compressed_vocab);

}  // namespace flashd::engine
