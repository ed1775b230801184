// BlockKey: the content address of one cached block of tokens.
//
// A block's key is a 128-bit XXH3 hash chained over its parent's key, so equal keys mean equal
// whole prefixes, not only equal blocks. The hash also covers the model fingerprint, the cache
// format version and the tenant namespace: a different model, format or tenant never hits.
// Keys are stable across restarts and machines (XXH3 output is specified and endian-fixed here).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>

namespace flashd::cache {

struct BlockKey {
  uint64_t hi = 0;
  uint64_t lo = 0;

  friend bool operator==(const BlockKey&, const BlockKey&) = default;
  bool IsRoot() const { return hi == 0 && lo == 0; }

  std::string ToHex() const;  // 32 lowercase hex digits, hi first.
  // 16 bytes, big-endian hi then lo: sorts like ToHex() and is the on-disk key.
  std::string ToBytes() const;
};

// Everything besides the tokens that decides whether a cached block may be reused.
struct KeyContext {
  BlockKey model_fingerprint;
  uint32_t format_version = 0;
  std::string_view tenant_namespace;
  // The backend's numerics ("cpu/1"): KV computed by backends whose last bits differ never
  // share a key, so a resume is bit-exact; backends proven equal declare the same string.
  std::string_view numerics;
};

// The key of the block holding `tokens` whose prefix ends at `parent` (the root key for the
// first block).
BlockKey ChainBlockKey(const BlockKey& parent, std::span<const int32_t> tokens,
                       const KeyContext& context);

// Hashes arbitrary bytes, e.g. a model's config and weight headers into its fingerprint.
BlockKey HashBytes(std::string_view bytes);

}  // namespace flashd::cache
