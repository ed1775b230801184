#include "engine/numpy_rng.h"

#include <algorithm>
#include <cassert>
#include <limits>

namespace flashd::engine {
namespace {

// SeedSequence's hashing constants (numpy/random/bit_generator.pyx).
constexpr uint32_t kInitA = 0x43b0d7e5;
constexpr uint32_t kMultA = 0x931e8875;
constexpr uint32_t kInitB = 0x8b51f9dd;
constexpr uint32_t kMultB = 0x58f38ded;
constexpr uint32_t kMixMultL = 0xca01f9dd;
constexpr uint32_t kMixMultR = 0x4973f715;
constexpr int kXShift = 16;
constexpr int kPoolSize = 4;

uint32_t HashMix(uint32_t value, uint32_t* hash_const) {
  value ^= *hash_const;
  *hash_const *= kMultA;
  value *= *hash_const;
  value ^= value >> kXShift;
  return value;
}

uint32_t Mix(uint32_t x, uint32_t y) {
  uint32_t result = kMixMultL * x - kMixMultR * y;
  result ^= result >> kXShift;
  return result;
}

// SeedSequence(entropy).generate_state(4, np.uint64).
void SeedState(uint64_t entropy, uint64_t out[4]) {
  std::vector<uint32_t> words;
  do {
    words.push_back(static_cast<uint32_t>(entropy & 0xFFFFFFFFu));
    entropy >>= 32;
  } while (entropy > 0);
  uint32_t pool[kPoolSize];
  uint32_t hash_const = kInitA;
  for (int i = 0; i < kPoolSize; ++i) {
    pool[i] = HashMix(i < static_cast<int>(words.size()) ? words[i] : 0u, &hash_const);
  }
  for (int src = 0; src < kPoolSize; ++src) {
    for (int dst = 0; dst < kPoolSize; ++dst) {
      if (src != dst) pool[dst] = Mix(pool[dst], HashMix(pool[src], &hash_const));
    }
  }
  for (size_t src = kPoolSize; src < words.size(); ++src) {
    for (int dst = 0; dst < kPoolSize; ++dst)
      pool[dst] = Mix(pool[dst], HashMix(words[src], &hash_const));
  }
  uint32_t state[8];
  uint32_t hash_b = kInitB;
  for (int i = 0; i < 8; ++i) {
    uint32_t v = pool[i % kPoolSize];
    v ^= hash_b;
    hash_b *= kMultB;
    v *= hash_b;
    v ^= v >> kXShift;
    state[i] = v;
  }
  for (int i = 0; i < 4; ++i)
    out[i] = state[2 * i] | (static_cast<uint64_t>(state[2 * i + 1]) << 32);
}

const unsigned __int128 kPcgMultiplier =
    (static_cast<unsigned __int128>(0x2360ED051FC65DA4ULL) << 64) | 0x4385DF649FCCF645ULL;

}  // namespace

NumpyPcg64::NumpyPcg64(uint64_t seed) {
  uint64_t s[4];
  SeedState(seed, s);
  unsigned __int128 init_state = (static_cast<unsigned __int128>(s[0]) << 64) | s[1];
  unsigned __int128 init_seq = (static_cast<unsigned __int128>(s[2]) << 64) | s[3];
  state_ = 0;
  inc_ = (init_seq << 1) | 1;
  state_ = state_ * kPcgMultiplier + inc_;
  state_ += init_state;
  state_ = state_ * kPcgMultiplier + inc_;
}

uint64_t NumpyPcg64::Next64() {
  state_ = state_ * kPcgMultiplier + inc_;
  uint64_t hi = static_cast<uint64_t>(state_ >> 64);
  uint64_t lo = static_cast<uint64_t>(state_);
  unsigned rot = static_cast<unsigned>(hi >> 58);
  uint64_t x = hi ^ lo;
  return (x >> rot) | (x << ((64 - rot) & 63));
}

int64_t NumpyPcg64::Integer(int64_t high) {
  assert(high > (int64_t{1} << 32));
  const uint64_t rng = static_cast<uint64_t>(high) - 1;  // Inclusive range [0, rng].
  const uint64_t rng_excl = rng + 1;
  unsigned __int128 m = static_cast<unsigned __int128>(Next64()) * rng_excl;
  uint64_t leftover = static_cast<uint64_t>(m);
  if (leftover < rng_excl) {
    const uint64_t threshold = (std::numeric_limits<uint64_t>::max() - rng) % rng_excl;
    while (leftover < threshold) {
      m = static_cast<unsigned __int128>(Next64()) * rng_excl;
      leftover = static_cast<uint64_t>(m);
    }
  }
  return static_cast<int64_t>(m >> 64);
}

std::vector<std::vector<int64_t>> EngramMultipliers(const std::vector<int>& layer_ids, int n,
                                                    int64_t compressed_vocab) {
  const int64_t bound =
      std::max<int64_t>(1, (std::numeric_limits<int64_t>::max() / compressed_vocab) / 2);
  std::vector<std::vector<int64_t>> out;
  for (int layer : layer_ids) {
    NumpyPcg64 rng(10007ull * static_cast<uint64_t>(layer));
    std::vector<int64_t> row;
    for (int i = 0; i < n; ++i) row.push_back(rng.Integer(bound) * 2 + 1);
    out.push_back(std::move(row));
  }
  return out;
}

}  // namespace flashd::engine
