// Stored cache values as the block store reads them back: header, format, sizes, CRC32C over
// key and value, token ids. Half of the inputs get a correct CRC, so the checks past it run too.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "cache/block_store.h"

using namespace flashd::cache;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  std::vector<int32_t> tokens(data[0] % 70);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>(i * 7 + data[1]);
  std::string value(reinterpret_cast<const char*>(data) + 2, size - 2);
  BlockKey key;
  if (data[1] & 1 && value.size() >= BlockStore::kChecksumOffset + 4) {
    const uint32_t crc = BlockStore::ValueChecksum(key.ToBytes(), value);
    std::memcpy(&value[BlockStore::kChecksumOffset], &crc, 4);
  }
  if (auto payload = BlockStore::CheckValue(value, key, tokens)) {
    if (payload->size() > value.size()) __builtin_trap();
  }
  return 0;
}
