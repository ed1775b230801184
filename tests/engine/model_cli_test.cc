// `flashd model-info` and `flashd mkmodel` as an operator runs them.
#include <sys/wait.h>

#include <algorithm>
#include <boost/test/unit_test.hpp>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>

#include "tests/support/temp_dir.h"

namespace {

using flashd::testing::Contains;
using flashd::testing::TempDir;
using nlohmann::json;

using Run = flashd::testing::CommandResult;

// The flashd binary with `args`, stdout and stderr together.
Run Flashd(const std::string& args) {
  return flashd::testing::RunCommand(std::string(FLASHD_BINARY) + " " + args + " 2>&1");
}

const std::string kReleased = FLASHD_TEST_DATA_DIR "/deepseek-v4.1-flash/config.json";

BOOST_AUTO_TEST_SUITE(model_cli)

BOOST_AUTO_TEST_CASE(model_info_json_for_the_released_config) {
  std::string cmd = std::string(FLASHD_BINARY) + " model-info " + kReleased + " --json";
  const Run run = flashd::testing::RunCommand(cmd);
  BOOST_REQUIRE(run.code == 0);
  const std::string& out = run.out;
  json j = json::parse(out);  // stdout holds the JSON object and nothing else.
  for (const char* key : {"kv_bytes_per_token", "params_backbone", "params_engram", "params_dspark",
                          "params_vision", "params_active_prefill", "params_active_decode"}) {
    BOOST_TEST(j[key].is_number_integer(), key);
  }
  BOOST_TEST(j["kv_bytes_per_token"].get<int64_t>() == 890);
  BOOST_TEST(j["params_backbone"].get<int64_t>() > 550'000'000'000);
}

BOOST_AUTO_TEST_CASE(model_info_text_and_a_tiny_directory) {
  TempDir tmp;
  std::string dir = (tmp.path() / "m").string();
  Run mk = Flashd("mkmodel " + dir + " --set vocab_size=1024 --set dspark_noise_token_id=1000");
  BOOST_REQUIRE_MESSAGE(mk.code == 0, mk.out);
  Run info = Flashd("model-info " + dir);
  BOOST_TEST(info.code == 0, info.out);
  BOOST_TEST(Contains(info.out, "bytes/token"), info.out);
  BOOST_TEST(Contains(info.out, "495 bound"), info.out);
  BOOST_TEST(Contains(info.out, "not used yet: 60 dspark tensors"), info.out);
}

BOOST_AUTO_TEST_CASE(model_info_reports_engram_classes_of_the_v4_tokenizer) {
  const std::string tokenizer_dir = FLASHD_V4_TOKENIZER_DIR;
  if (!std::filesystem::exists(tokenizer_dir + "/tokenizer.json")) {
    std::printf("SKIP: %s not fetched (packaging/fetch-tokenizer.sh)\n", tokenizer_dir.c_str());
    return;
  }
  TempDir tmp;
  std::string dir = (tmp.path() / "m").string();
  // The full vocabulary with a narrow hidden size, so the checkpoint stays small.
  Run mk = Flashd("mkmodel " + dir + " --tokenizer " + tokenizer_dir + " --set hidden_size=64");
  BOOST_REQUIRE_MESSAGE(mk.code == 0, mk.out);
  std::string cmd = std::string(FLASHD_BINARY) + " model-info " + dir + " --json 2>/dev/null";
  const Run run = flashd::testing::RunCommand(cmd);
  BOOST_REQUIRE(run.code == 0);
  const std::string& out = run.out;
  json j = json::parse(out);
  // DeepSeek's V4 tokenizer normalises to the 99,092 classes the released config declares.
  BOOST_TEST(j["engram_tokenizer_classes"].get<int64_t>() == 99092);
  BOOST_TEST(j["engram_classes_match_config"].get<bool>());
}

BOOST_AUTO_TEST_CASE(bad_input_is_one_line_and_exit_code_2) {
  TempDir tmp;
  Run none = Flashd("model-info " + (tmp.path() / "nothing").string());
  BOOST_TEST(none.code == 2);
  BOOST_TEST(Contains(none.out, "no such model directory"), none.out);
  BOOST_TEST(std::count(none.out.begin(), none.out.end(), '\n') == 1);

  Run bad_key = Flashd("mkmodel " + (tmp.path() / "x").string() + " --set hiden_size=64");
  BOOST_TEST(bad_key.code == 2);
  BOOST_TEST(Contains(bad_key.out, "unknown key \"hiden_size\""), bad_key.out);

  Run bad_value = Flashd("mkmodel " + (tmp.path() / "x").string() + " --set hidden_size=100");
  BOOST_TEST(bad_value.code == 2);
  BOOST_TEST(Contains(bad_value.out, "text_config.hidden_size: 100 is not a multiple"),
             bad_value.out);

  Run type = Flashd("mkmodel --print-config --set model_type=x");
  BOOST_TEST(type.code == 2);
}

BOOST_AUTO_TEST_CASE(mkmodel_spec_file_and_print_config) {
  TempDir tmp;
  std::string spec = (tmp.path() / "spec.yaml").string();
  FILE* f = std::fopen(spec.c_str(), "w");
  std::fputs(
      "hidden_size: 128\nnum_hidden_layers: 4\ncompress_ratios: [0, 2, 1, 0, 0]\n"
      "kv_source_layer_ids: [1, 2]\nindex_source_layer_ids: [1, 2]\n"
      "candidate_source_layer_id: 2\nengram_layer_ids: [1]\n"
      "dspark_target_layer_ids: [2]\nvocab_size: 512\ndspark_noise_token_id: 500\n",
      f);
  std::fclose(f);
  Run printed = Flashd("mkmodel --print-config --spec " + spec);
  BOOST_REQUIRE_MESSAGE(printed.code == 0, printed.out);
  json c = json::parse(printed.out);
  BOOST_TEST(c["model_type"] == "deepseek_v41");
  BOOST_TEST(c["text_config"]["hidden_size"] == 128);
  BOOST_TEST(c["text_config"]["engram_num_embeddings"].size() == 1u);
  BOOST_TEST(c["quantization_config"]["expert_dtype"] == "fp4");
}

BOOST_AUTO_TEST_SUITE_END()

}  // namespace
