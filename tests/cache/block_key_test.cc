#include "cache/block_key.h"

#include <boost/test/unit_test.hpp>
#include <set>
#include <vector>

namespace flashd::cache {
namespace {

BOOST_AUTO_TEST_SUITE(block_key)

const KeyContext kContext{HashBytes("model A"), 1, "tenant-a", "cpu/1"};

BOOST_AUTO_TEST_CASE(same_input_same_key) {
  std::vector<int32_t> tokens = {1, 2, 3, 4};
  BOOST_TEST(ChainBlockKey({}, tokens, kContext).ToHex() ==
             ChainBlockKey({}, tokens, kContext).ToHex());
}

BOOST_AUTO_TEST_CASE(every_input_changes_the_key) {
  std::vector<int32_t> tokens = {1, 2, 3, 4};
  BlockKey base = ChainBlockKey({}, tokens, kContext);
  std::vector<int32_t> other_tokens = {1, 2, 3, 5};
  std::set<std::string> keys = {
      base.ToHex(),
      ChainBlockKey({}, other_tokens, kContext).ToHex(),
      ChainBlockKey(base, tokens, kContext).ToHex(),
      ChainBlockKey({}, tokens, {HashBytes("model B"), 1, "tenant-a", "cpu/1"}).ToHex(),
      ChainBlockKey({}, tokens, {kContext.model_fingerprint, 2, "tenant-a", "cpu/1"}).ToHex(),
      ChainBlockKey({}, tokens, {kContext.model_fingerprint, 1, "tenant-b", "cpu/1"}).ToHex(),
      // KV from a backend with other numerics is another entry.
      ChainBlockKey({}, tokens, {kContext.model_fingerprint, 1, "tenant-a", "gpu/1"}).ToHex(),
  };
  BOOST_TEST(keys.size() == 7u);
}

BOOST_AUTO_TEST_CASE(chain_depends_on_whole_prefix) {
  std::vector<int32_t> a = {10, 11}, b = {20, 21}, c = {30, 31};
  BlockKey ab = ChainBlockKey(ChainBlockKey({}, a, kContext), b, kContext);
  BlockKey cb = ChainBlockKey(ChainBlockKey({}, c, kContext), b, kContext);
  BOOST_TEST(ab.ToHex() != cb.ToHex());
}

BOOST_AUTO_TEST_CASE(tenant_boundaries_are_not_ambiguous) {
  // "ab" + tokens must not collide with "a" + different bytes: lengths are hashed too.
  std::vector<int32_t> t = {0x62};
  BlockKey k1 = ChainBlockKey({}, t, {kContext.model_fingerprint, 1, "ab", "cpu/1"});
  BlockKey k2 = ChainBlockKey({}, t, {kContext.model_fingerprint, 1, "a", "cpu/1"});
  BOOST_TEST(k1.ToHex() != k2.ToHex());
}

BOOST_AUTO_TEST_CASE(encodings) {
  BlockKey k{0x0123456789abcdefULL, 0xfedcba9876543210ULL};
  BOOST_TEST(k.ToHex() == "0123456789abcdeffedcba9876543210");
  std::string bytes = k.ToBytes();
  BOOST_REQUIRE(bytes.size() == 16u);
  BOOST_TEST(static_cast<unsigned char>(bytes[0]) == 0x01);
  BOOST_TEST(static_cast<unsigned char>(bytes[15]) == 0x10);
}

BOOST_AUTO_TEST_CASE(hash_is_xxh3_128) {
  // XXH3-128 of the empty input, as published with xxHash's test vectors.
  BlockKey empty = HashBytes("");
  BOOST_TEST(empty.ToHex() == "99aa06d3014798d86001c324468d497f");
}

BOOST_AUTO_TEST_SUITE_END()

}  // namespace
}  // namespace flashd::cache
