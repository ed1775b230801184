// `flashd model-info` and `flashd mkmodel` as an operator runs them.
#include <sys/wait.h>

#include <algorithm>
#include <boost/test/unit_test.hpp>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

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

// flashd plan: a plan per machine, exit 1 when it does not fit, 2 for a bad spec.
BOOST_AUTO_TEST_CASE(plan_places_the_released_model_or_says_why_not) {
  const Run eight = flashd::testing::RunCommand(std::string(FLASHD_BINARY) + " plan " + kReleased +
                                                " --gpus 8xH200 --host-ram 512GiB --json");
  BOOST_REQUIRE(eight.code == 0);
  const json j = json::parse(eight.out);
  BOOST_TEST(j["mode"] == "gpu");
  BOOST_TEST(j["gpus"].size() == 8u);
  BOOST_TEST(j["layer_gpu"].back() == 7);
  const Run one = Flashd("plan " + kReleased + " --gpus 1xH200 --host-ram 512GiB");
  BOOST_TEST(one.code == 0, one.out);
  BOOST_TEST(Contains(one.out, "mode: hybrid"), one.out);
  const Run small = Flashd("plan " + kReleased + " --gpus H200 --host-ram 64GiB");
  BOOST_TEST(small.code == 1, small.out);
  BOOST_TEST(Contains(small.out, "does not fit: host memory"), small.out);
  const Run bad = Flashd("plan " + kReleased + " --gpus 2xTPU");
  BOOST_TEST(bad.code == 2, bad.out);
  BOOST_TEST(Contains(bad.out, "unknown GPU \"TPU\""), bad.out);
}

BOOST_AUTO_TEST_CASE(model_info_text_and_a_tiny_directory) {
  TempDir tmp;
  std::string dir = (tmp.path() / "m").string();
  Run mk = Flashd("mkmodel " + dir + " --set vocab_size=1024 --set dspark_noise_token_id=1000");
  BOOST_REQUIRE_MESSAGE(mk.code == 0, mk.out);
  Run info = Flashd("model-info " + dir);
  BOOST_TEST(info.code == 0, info.out);
  BOOST_TEST(Contains(info.out, "bytes/token"), info.out);
  BOOST_TEST(Contains(info.out, "555 bound"), info.out);  // 495 + the drafter's 60.
  BOOST_TEST(Contains(info.out, "dspark: the drafter's 1 stages are complete"), info.out);
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

// --layers: the released dimensions cut to N layers (the writer itself is model_files_test's).
BOOST_AUTO_TEST_CASE(mkmodel_layers_prints_the_released_config_cut) {
  Run printed = Flashd("mkmodel --print-config --layers 3 --set engram_vocab_size=1000");
  BOOST_REQUIRE_MESSAGE(printed.code == 0, printed.out);
  json c = json::parse(printed.out);
  json released;
  std::ifstream(kReleased) >> released;
  BOOST_TEST(c["text_config"]["num_hidden_layers"] == 3);
  BOOST_TEST(c["text_config"]["hidden_size"] == released["text_config"]["hidden_size"]);
  BOOST_TEST(c["text_config"]["n_routed_experts"] == released["text_config"]["n_routed_experts"]);
  BOOST_TEST(c["text_config"]["kv_source_layer_ids"] == json::array({2}));
  BOOST_TEST(c["text_config"]["compress_ratios"].size() ==
             3u + released["text_config"]["num_nextn_predict_layers"].get<size_t>());
  Run bad = Flashd("mkmodel /tmp/never --layers 0");
  BOOST_TEST(bad.code == 2);
  BOOST_TEST(Contains(bad.out, "--layers must be at least 1"), bad.out);
  Run too_many = Flashd("mkmodel --print-config --layers 41");
  BOOST_TEST(too_many.code == 2);
  BOOST_TEST(Contains(too_many.out, "--layers must be between 1 and 40"), too_many.out);
}

// --- flashd eval -------------------------------------------------------------------------------

// A float32 .npy as numpy writes it (the header is checked, not trusted blindly).
std::vector<float> ReadNpy(const std::string& path, std::vector<int64_t>* shape) {
  std::ifstream in(path, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  BOOST_REQUIRE(bytes.size() > 10 && bytes.compare(0, 6, "\x93NUMPY") == 0);
  const size_t len = static_cast<unsigned char>(bytes[8]) | static_cast<unsigned char>(bytes[9])
                                                                << 8;
  const std::string header = bytes.substr(10, len);
  BOOST_REQUIRE(Contains(header, "'descr': '<f4'"));
  BOOST_REQUIRE((10 + len) % 64 == 0);  // numpy's alignment.
  shape->clear();
  std::string dims = header.substr(header.find('(') + 1);
  dims = dims.substr(0, dims.find(')'));
  for (size_t at = 0; at < dims.size();) {
    const size_t comma = dims.find(',', at);
    const std::string d =
        dims.substr(at, comma == std::string::npos ? std::string::npos : comma - at);
    if (d.find_first_not_of(' ') != std::string::npos) shape->push_back(std::stoll(d));
    if (comma == std::string::npos) break;
    at = comma + 1;
  }
  std::vector<float> v((bytes.size() - 10 - len) / 4);
  std::memcpy(v.data(), bytes.data() + 10 + len, v.size() * 4);
  return v;
}

// One F32 tensor of a safetensors file.
std::vector<float> ReadTensor(const std::string& path, const std::string& name,
                              std::vector<int64_t>* shape) {
  std::ifstream in(path, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  const json header = json::parse(bytes.substr(8, n));
  const json& t = header.at(name);
  BOOST_REQUIRE(t["dtype"] == "F32");
  *shape = t["shape"].get<std::vector<int64_t>>();
  const size_t begin = t["data_offsets"][0], end = t["data_offsets"][1];
  std::vector<float> v((end - begin) / 4);
  std::memcpy(v.data(), bytes.data() + 8 + n + begin, end - begin);
  return v;
}

void WriteNpy(const std::string& path, const std::vector<int64_t>& shape,
              const std::vector<float>& v) {
  std::string dims;
  for (int64_t d : shape) dims += std::to_string(d) + ", ";
  std::string header = "{'descr': '<f4', 'fortran_order': False, 'shape': (" + dims + "), }";
  header.append(64 - (10 + header.size() + 1) % 64, ' ');
  header += '\n';
  std::ofstream out(path, std::ios::binary);
  out.write("\x93NUMPY\x01\x00", 8);
  out.put(static_cast<char>(header.size() & 0xFF));
  out.put(static_cast<char>(header.size() >> 8));
  out << header;
  out.write(reinterpret_cast<const char*>(v.data()), static_cast<std::streamsize>(v.size() * 4));
}

// The golden short prompt and its continuation, as the reference ran them.
struct GoldenRun {
  std::vector<int32_t> tokens;
  size_t prompt = 0;
  std::vector<float> logits;   // The reference's, [tokens, vocab].
  std::vector<float> streams;  // The reference's, [tokens, layers, hc, dim] (BF16 widened).
};

GoldenRun LoadGoldenRun() {
  const json meta = json::parse(std::ifstream(FLASHD_GOLDEN_DIR "/golden.json"));
  const json& run = meta["runs"][0];
  GoldenRun g;
  g.tokens = run["prompt"].get<std::vector<int32_t>>();
  g.prompt = g.tokens.size();
  for (int32_t t : run["continuation"].get<std::vector<int32_t>>()) g.tokens.push_back(t);
  const size_t vocab = meta["vocab_size"].get<size_t>(), width = 10 * 4 * 128;
  std::ifstream lf(FLASHD_GOLDEN_DIR "/logits.f32", std::ios::binary);
  g.logits.resize(g.tokens.size() * vocab);
  lf.read(reinterpret_cast<char*>(g.logits.data()),
          static_cast<std::streamsize>(g.logits.size() * 4));
  std::ifstream sf(FLASHD_GOLDEN_DIR "/streams.bf16", std::ios::binary);
  std::vector<uint16_t> bf(g.tokens.size() * width);
  sf.read(reinterpret_cast<char*>(bf.data()), static_cast<std::streamsize>(bf.size() * 2));
  for (uint16_t b : bf) {
    const uint32_t bits = static_cast<uint32_t>(b) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    g.streams.push_back(f);
  }
  return g;
}

double MaxAbsDiff(const float* a, const float* b, size_t n) {
  double worst = 0;
  for (size_t i = 0; i < n; ++i) worst = std::max(worst, double(std::fabs(a[i] - b[i])));
  return worst;
}

BOOST_AUTO_TEST_CASE(eval_writes_the_logits_the_reference_computed) {
  TempDir tmp;
  const GoldenRun g = LoadGoldenRun();
  std::string ids = "[";
  for (int32_t t : g.tokens) ids += std::to_string(t) + ",";
  ids.back() = ']';
  std::ofstream(tmp.path() / "tokens.json") << ids;
  const std::string base = "eval " FLASHD_GOLDEN_DIR " --topk-order reference --tokens " +
                           (tmp.path() / "tokens.json").string();
  const std::string whole = (tmp.path() / "whole.npy").string();
  const Run r = Flashd(base + " --out " + whole);
  BOOST_REQUIRE_MESSAGE(r.code == 0, r.out);
  std::vector<int64_t> shape;
  const std::vector<float> logits = ReadNpy(whole, &shape);
  const int64_t T = static_cast<int64_t>(g.tokens.size());
  BOOST_REQUIRE((shape == std::vector<int64_t>{T, 480}));
  // The first positions agree with the reference within the golden test's tolerance (its first
  // rounding flip, an RMSNorm output one BF16 step apart, is at position 5 of this run).
  BOOST_REQUIRE(g.prompt >= 5u);
  BOOST_TEST(MaxAbsDiff(logits.data(), g.logits.data(), 5 * 480) < 1e-3);
  // Chunked prefill through the command gives the same bytes.
  const std::string chunked = (tmp.path() / "chunked.npy").string();
  BOOST_REQUIRE(Flashd(base + " --chunk 3 --out " + chunked).code == 0);
  BOOST_TEST((ReadNpy(chunked, &shape) == logits));
  // Streams out, then fed back in: forcing a run's own streams reproduces it exactly.
  const std::string st = (tmp.path() / "run.safetensors").string();
  BOOST_REQUIRE(Flashd(base + " --streams --out " + st).code == 0);
  std::vector<int64_t> sshape;
  const std::vector<float> streams = ReadTensor(st, "streams", &sshape);
  BOOST_REQUIRE((sshape == std::vector<int64_t>{T, 10, 4, 128}));
  BOOST_TEST((ReadTensor(st, "logits", &shape) == logits));
  const std::string own = (tmp.path() / "own.npy").string();
  WriteNpy(own, sshape, streams);
  const std::string forced = (tmp.path() / "forced.npy").string();
  BOOST_REQUIRE(Flashd(base + " --forced-streams " + own + " --out " + forced).code == 0);
  BOOST_TEST((ReadNpy(forced, &shape) == logits));
  // The reference's own streams, layer by layer: every position's logits then come from the
  // reference's final stream, so they agree with its logits everywhere, continuation included.
  const std::string ref = (tmp.path() / "reference.npy").string();
  WriteNpy(ref, sshape, g.streams);
  const std::string layered = (tmp.path() / "layered.npy").string();
  BOOST_REQUIRE(Flashd(base + " --forced-streams " + ref + " --out " + layered).code == 0);
  const std::vector<float> by_layer = ReadNpy(layered, &shape);
  BOOST_TEST(MaxAbsDiff(by_layer.data(), g.logits.data(), by_layer.size()) < 1e-2);
#ifdef FLASHD_TEST_HIPCPU
  // The same run on the GPU kernels (through the HIP CPU runtime), to compare backends.
  const std::string gpu = (tmp.path() / "gpu.npy").string();
  const Run on_gpu = Flashd(base + " --backend hipcpu --out " + gpu);
  BOOST_REQUIRE_MESSAGE(on_gpu.code == 0, on_gpu.out);
  const std::vector<float> gpu_logits = ReadNpy(gpu, &shape);
  BOOST_REQUIRE(gpu_logits.size() == logits.size());
  BOOST_TEST(MaxAbsDiff(gpu_logits.data(), logits.data(), logits.size()) < 1e-3);
#endif
}

BOOST_AUTO_TEST_CASE(eval_refuses_bad_arguments_clearly) {
  TempDir tmp;
  std::ofstream(tmp.path() / "t.txt") << "1 2 x";
  const Run bad_token =
      Flashd("eval " FLASHD_GOLDEN_DIR " --tokens " + (tmp.path() / "t.txt").string() + " --out " +
             (tmp.path() / "o.npy").string());
  BOOST_TEST(bad_token.code == 1);
  BOOST_TEST(Contains(bad_token.out, "'x' is not a token id"), bad_token.out);
  const Run streams_npy = Flashd("eval " FLASHD_GOLDEN_DIR " --streams --out x.npy");
  BOOST_TEST(streams_npy.code == 2);
  BOOST_TEST(Contains(streams_npy.out, "needs a .safetensors output"), streams_npy.out);
  std::ofstream(tmp.path() / "ok.txt") << "5 6 7";
  std::ofstream(tmp.path() / "junk.npy") << "5 6 7";
  const Run wrong_shape =
      Flashd("eval " FLASHD_GOLDEN_DIR " --tokens " + (tmp.path() / "ok.txt").string() +
             " --forced-streams " + (tmp.path() / "junk.npy").string() + " --out " +
             (tmp.path() / "o.npy").string());
  BOOST_TEST(wrong_shape.code == 1);
  BOOST_TEST(Contains(wrong_shape.out, "not a .npy file"), wrong_shape.out);
  const Run tpu = Flashd("eval " FLASHD_GOLDEN_DIR " --tokens " + (tmp.path() / "ok.txt").string() +
                         " --backend tpu --out " + (tmp.path() / "o.npy").string());
  BOOST_TEST(tpu.code == 1);
  BOOST_TEST(Contains(tpu.out, "unknown backend \"tpu\""), tpu.out);
}

BOOST_AUTO_TEST_SUITE_END()

}  // namespace
