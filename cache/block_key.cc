#include "cache/block_key.h"

#include <xxhash.h>

#include <cstring>
#include <vector>

namespace flashd::cache {
namespace {

void PutU64(std::vector<unsigned char>* out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out->push_back(static_cast<unsigned char>(v >> (8 * i)));
}

void PutU32(std::vector<unsigned char>* out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out->push_back(static_cast<unsigned char>(v >> (8 * i)));
}

}  // namespace

std::string BlockKey::ToHex() const {
  static const char kDigits[] = "0123456789abcdef";
  std::string out(32, '0');
  for (int i = 0; i < 16; ++i) {
    out[15 - i] = kDigits[(hi >> (4 * i)) & 15];
    out[31 - i] = kDigits[(lo >> (4 * i)) & 15];
  }
  return out;
}

std::string BlockKey::ToBytes() const {
  std::string out(16, '\0');
  for (int i = 0; i < 8; ++i) {
    out[7 - i] = static_cast<char>((hi >> (8 * i)) & 0xff);
    out[15 - i] = static_cast<char>((lo >> (8 * i)) & 0xff);
  }
  return out;
}

BlockKey ChainBlockKey(const BlockKey& parent, std::span<const int32_t> tokens,
                       const KeyContext& context) {
  // A fixed little-endian serialisation, so the key does not depend on the host's layout.
  std::vector<unsigned char> buf;
  buf.reserve(64 + context.tenant_namespace.size() + context.numerics.size() + tokens.size() * 4);
  PutU64(&buf, parent.hi);
  PutU64(&buf, parent.lo);
  PutU64(&buf, context.model_fingerprint.hi);
  PutU64(&buf, context.model_fingerprint.lo);
  PutU32(&buf, context.format_version);
  PutU32(&buf, static_cast<uint32_t>(context.tenant_namespace.size()));
  buf.insert(buf.end(), context.tenant_namespace.begin(), context.tenant_namespace.end());
  PutU32(&buf, static_cast<uint32_t>(context.numerics.size()));
  buf.insert(buf.end(), context.numerics.begin(), context.numerics.end());
  PutU32(&buf, static_cast<uint32_t>(tokens.size()));
  for (int32_t t : tokens) PutU32(&buf, static_cast<uint32_t>(t));
  XXH128_hash_t h = XXH3_128bits(buf.data(), buf.size());
  BlockKey key{h.high64, h.low64};
  // The all-zero key means "no parent"; a real block never takes it.
  if (key.IsRoot()) key.lo = 1;
  return key;
}

BlockKey HashBytes(std::string_view bytes) {
  XXH128_hash_t h = XXH3_128bits(bytes.data(), bytes.size());
  return BlockKey{h.high64, h.low64};
}

}  // namespace flashd::cache
