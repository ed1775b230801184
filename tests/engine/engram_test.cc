// Engram hashing pieces: numpy-compatible multipliers, the normalisation, the class map.
#include "engine/engram.h"

#include <boost/test/unit_test.hpp>
#include <cstdio>
#include <filesystem>

#include "engine/numpy_rng.h"

namespace flashd::engine {
namespace {

BOOST_AUTO_TEST_SUITE(engram)

BOOST_AUTO_TEST_CASE(multipliers_equal_numpy_default_rng) {
  // numpy.random.default_rng(10007 * layer).integers(0, (INT64_MAX // 99092) // 2, 4) * 2 + 1,
  // as MODEL.md records them for the released config.
  auto m = EngramMultipliers({1, 14}, 4, 99092);
  const std::vector<std::vector<int64_t>> want = {
      {76632096046245, 4839876093313, 35959672319349, 73987337458391},
      {67716810739261, 51510806800915, 30921347202721, 82619226485591}};
  BOOST_TEST((m == want));
}

BOOST_AUTO_TEST_CASE(normalisation_follows_the_reference_steps) {
  struct Case {
    const char* in;
    const char* out;
  };
  const Case cases[] = {
      {"Hello", "hello"},   {" The", "the"},
      {"CAFÉ", "cafe"},     {"ﬁle", "file"},
      {"ｆｕｌｌ", "full"}, {" ", " "},
      {"  \t\n ", " "},     {"a  \t b", "a b"},
      {"\n\nX\n", "x"},     {"Ångström", "angstrom"},
      {"Straße", "straße"}, {"½", "1⁄2"},
      {"\xC2\xA0x", "x"},   {"", ""},
  };
  for (const Case& c : cases) BOOST_TEST(NormalizeForEngram(c.in) == c.out, "in: " << c.in);
}

BOOST_AUTO_TEST_CASE(class_map_of_deepseek_v3_tokenizer_equals_the_reference) {
  const std::string path = FLASHD_SHARED_DIR "/data/tokenizers/deepseek-v3/tokenizer.json";
  if (!std::filesystem::exists(path)) {
    std::printf("SKIP: %s is not present (it comes with the project's shared data)\n",
                path.c_str());
    return;
  }
  auto v = BuildCompressedVocab(path);
  BOOST_REQUIRE_MESSAGE(v.ok(), v.status().ToString());
  // The reference's build_compressed_token_map with Hugging Face tokenizers 0.23 gives 98,627
  // classes over 128,815 ids; its map hashes (FNV-1a 64 over the int32 classes) to the value
  // below. MODEL.md's 99,045 was counted with Python's own Unicode tables instead.
  BOOST_TEST(v->class_of.size() == 128815u);
  BOOST_TEST(v->classes == 98627);
  uint64_t h = 0xcbf29ce484222325ULL;
  for (int32_t c : v->class_of) {
    for (int b = 0; b < 4; ++b) {
      h ^= static_cast<uint8_t>(static_cast<uint32_t>(c) >> (8 * b));
      h *= 0x100000001b3ULL;
    }
  }
  BOOST_TEST(h == 0xa41ee0e295b5e30fULL);
}

BOOST_AUTO_TEST_SUITE_END()

}  // namespace
}  // namespace flashd::engine
