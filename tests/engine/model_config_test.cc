#include "engine/model_config.h"

#include <boost/test/unit_test.hpp>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

namespace flashd::engine {
namespace {

using nlohmann::json;

const char* kReleasedConfig = FLASHD_TEST_DATA_DIR "/deepseek-v4.1-flash/config.json";

json Released() {
  std::ifstream in(kReleasedConfig);
  BOOST_REQUIRE_MESSAGE(in, "cannot read " << kReleasedConfig);
  std::stringstream ss;
  ss << in.rdbuf();
  return json::parse(ss.str());
}

bool Contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

BOOST_AUTO_TEST_SUITE(model_config)

BOOST_AUTO_TEST_CASE(released_config_parses_with_derived_plan) {
  StatusOr<ModelConfig> c = LoadModelConfig(kReleasedConfig);
  BOOST_REQUIRE_MESSAGE(c.ok(), c.status().ToString());
  BOOST_TEST(c->num_hidden_layers == 40);
  BOOST_TEST(c->hidden_size == 5120);
  BOOST_TEST(c->num_nextn_predict_layers == 3);
  BOOST_TEST(c->vision_enabled());
  BOOST_TEST(c->experts_fp4());
  BOOST_REQUIRE(c->layers.size() == 40u);
  // MODEL.md: 3-7 read 2, 9-13 read 8, 15-19 read 14, 21-37 read 20.
  for (int l : {3, 7}) BOOST_TEST(c->layers[l].kv_source == 2);
  for (int l : {9, 13}) BOOST_TEST(c->layers[l].kv_source == 8);
  for (int l : {15, 19}) BOOST_TEST(c->layers[l].kv_source == 14);
  for (int l : {21, 30, 37, 39}) BOOST_TEST(c->layers[l].kv_source == 20);
  for (int l : {0, 1}) {
    BOOST_TEST(c->layers[l].compress_ratio == 0);
    BOOST_TEST(c->layers[l].kv_source == -1);
  }
  BOOST_TEST(c->layers[25].index_source == 24);  // Reuses 24's selection.
  BOOST_TEST(c->layers[23].index_source == 20);
  BOOST_TEST(c->layers[20].is_candidate_source);
  for (int l : {24, 28, 32, 36}) {
    BOOST_TEST(c->layers[l].uses_candidates);
    BOOST_TEST(!c->layers[l].owns_index_keys);
  }
  for (int l : {2, 8, 14, 20}) BOOST_TEST(c->layers[l].owns_index_keys);
  BOOST_TEST(!c->layers[14].uses_candidates);
  BOOST_TEST(c->layers[1].engram_index == 0);
  BOOST_TEST(c->layers[14].engram_index == 1);
  BOOST_TEST(c->engram_hash_columns() == 24);
}

BOOST_AUTO_TEST_CASE(engram_prime_layout_reproduces_released_table_sizes) {
  StatusOr<ModelConfig> c = LoadModelConfig(kReleasedConfig);
  BOOST_REQUIRE(c.ok());
  BOOST_REQUIRE(c->engram_primes.size() == 2u);
  // The first prime above engram_vocab_size - 1 = 15,999,999, and every bucket distinct.
  BOOST_TEST(c->engram_primes[0][0][0] == 16000057);
  std::set<int64_t> all;
  for (size_t layer = 0; layer < 2; ++layer) {
    int64_t rows = 0;
    for (const auto& per_n : c->engram_primes[layer]) {
      BOOST_TEST(per_n.size() == 8u);
      for (int64_t p : per_n) {
        BOOST_TEST(IsPrime(static_cast<uint64_t>(p)));
        all.insert(p);
        rows += p;
      }
    }
    BOOST_TEST(rows == (layer == 0 ? 384006168 : 384016682));
  }
  BOOST_TEST(all.size() == 48u);
}

BOOST_AUTO_TEST_CASE(primality) {
  for (uint64_t p : {2ull, 3ull, 5ull, 16000057ull, 2147483647ull, 1000000007ull}) {
    BOOST_TEST(IsPrime(p), p);
  }
  for (uint64_t n : {0ull, 1ull, 4ull, 16000001ull, 3215031751ull /* strong pseudoprime */}) {
    BOOST_TEST(!IsPrime(n), n);
  }
}

BOOST_AUTO_TEST_CASE(bad_configs_name_the_field) {
  struct Case {
    const char* what;
    std::function<void(json&)> mutate;
    std::string expected;
  };
  const Case cases[] = {
      {"model type", [](json& j) { j["model_type"] = "llama"; },
       "model_type: unknown model type \"llama\""},
      {"missing field", [](json& j) { j["text_config"].erase("hidden_size"); },
       "text_config.hidden_size: missing"},
      {"wrong type", [](json& j) { j["text_config"]["hidden_size"] = "5120"; },
       "text_config.hidden_size: expected an integer"},
      {"kv source with ratio 0",
       [](json& j) {
         j["text_config"]["kv_source_layer_ids"] = {1, 2, 8, 14, 20};
       },
       "text_config.kv_source_layer_ids[0]: layer 1 has compress ratio 0"},
      {"kv sources out of order",
       [](json& j) {
         j["text_config"]["kv_source_layer_ids"] = {8, 2, 14, 20};
       },
       "text_config.kv_source_layer_ids[1]: ids must be ascending"},
      {"ratio list length", [](json& j) { j["text_config"]["compress_ratios"].erase(42); },
       "text_config.compress_ratios: has 42 entries, expected 43"},
      {"dspark layer compressing", [](json& j) { j["text_config"]["compress_ratios"][41] = 1; },
       "text_config.compress_ratios[41]: DSpark layers"},
      {"engram table size",
       [](json& j) { j["text_config"]["engram_num_embeddings"][1] = 384016683; },
       "text_config.engram_num_embeddings[1]: 384016683 rows, but the prime layout"},
      {"not a multiple of 32", [](json& j) { j["text_config"]["hidden_size"] = 5100; },
       "text_config.hidden_size: 5100 is not a multiple"},
      {"kv source whose keys nobody writes",
       [](json& j) { j["text_config"]["index_source_layer_ids"] = {2, 14, 20, 24, 28, 32, 36}; },
       "layer 8 reads KV source 8 but reuses the selection of index source 2"},
      {"candidate source not indexing",
       [](json& j) { j["text_config"]["candidate_source_layer_id"] = 21; },
       "text_config.candidate_source_layer_id: layer 21 is not an index source"},
      {"ratio differs from its source",
       [](json& j) { j["text_config"]["compress_ratios"][21] = 2; },
       "layer 21 has ratio 2 but reads KV source 20 of ratio 1"},
      {"no quantization", [](json& j) { j.erase("quantization_config"); },
       "quantization_config: missing"},
      {"scale format", [](json& j) { j["quantization_config"]["scale_fmt"] = "fp32"; },
       "quantization_config.scale_fmt"},
      {"scoring", [](json& j) { j["text_config"]["scoring_func"] = "relu"; },
       "text_config.scoring_func: unknown scoring function"},
      {"top-k above experts", [](json& j) { j["text_config"]["num_experts_per_tok"] = 400; },
       "text_config.num_experts_per_tok"},
      {"several kv heads", [](json& j) { j["text_config"]["num_key_value_heads"] = 8; },
       "text_config.num_key_value_heads"},
  };
  for (const Case& c : cases) {
    json j = Released();
    c.mutate(j);
    StatusOr<ModelConfig> parsed = ParseModelConfig(j.dump(), "config.json");
    BOOST_TEST_CONTEXT(c.what) {
      BOOST_REQUIRE(!parsed.ok());
      BOOST_TEST(Contains(parsed.status().message(), "config.json: "));
      BOOST_TEST(Contains(parsed.status().message(), c.expected), parsed.status().message());
    }
  }
}

BOOST_AUTO_TEST_CASE(invalid_json_and_missing_files) {
  StatusOr<ModelConfig> c = ParseModelConfig("{\"model_type\": ", "x/config.json");
  BOOST_TEST(!c.ok());
  BOOST_TEST(Contains(c.status().message(), "x/config.json: not valid JSON"));
  StatusOr<ModelConfig> missing = LoadModelConfig("/nonexistent/model");
  BOOST_TEST(missing.status().code() == StatusCode::kNotFound);
  BOOST_TEST(Contains(missing.status().message(), "/nonexistent/model"));
}

BOOST_AUTO_TEST_SUITE_END()

}  // namespace
}  // namespace flashd::engine
