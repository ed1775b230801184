// Reading a model's files before serving (engine/model_files.h), SHA256SUMS checks, and the
// checkpoints `flashd mkmodel --layers` writes: the released config cut to N layers, streamed
// to disk, loadable like the release.
#include "engine/model_files.h"

#include <boost/test/unit_test.hpp>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "engine/model.h"
#include "engine/model_config.h"
#include "engine/tiny_model.h"
#include "engine/weights.h"
#include "tests/support/temp_dir.h"

namespace flashd::engine {
namespace {

using flashd::testing::TempDir;
namespace fs = std::filesystem;

std::string WriteFile(const fs::path& path, size_t bytes, uint32_t seed) {
  std::mt19937 rng(seed);
  std::string s(bytes, '\0');
  for (char& c : s) c = static_cast<char>(rng());
  std::ofstream(path, std::ios::binary) << s;
  return s;
}

// Known SHA-256 values: FIPS 180-2's "abc" and the empty input.
constexpr const char* kAbc = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";
constexpr const char* kEmpty = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";

BOOST_AUTO_TEST_SUITE(model_files)

BOOST_AUTO_TEST_CASE(every_byte_is_read_once_in_chunks_on_several_threads) {
  TempDir dir;
  std::vector<std::string> paths;
  uint64_t total = 0;
  for (size_t bytes : {size_t{3500000}, size_t{100}, size_t{0}, size_t{1048576}}) {
    const fs::path path = dir.path() / "f";
    paths.push_back(path.string() + std::to_string(paths.size()));
    total += WriteFile(paths.back(), bytes, static_cast<uint32_t>(bytes)).size();
  }
  for (int threads : {1, 3}) {
    ReadFilesOptions o;
    o.threads = threads;
    o.chunk_bytes = 1 << 20;  // Several chunks in the first file.
    uint64_t last = 0, calls = 0;
    o.progress = [&](uint64_t done, uint64_t all) {
      BOOST_TEST(all == total);
      BOOST_TEST(done >= last);
      last = done;
      ++calls;
    };
    auto got = ReadFiles(paths, o);
    BOOST_REQUIRE_MESSAGE(got.ok(), got.status().ToString());
    BOOST_TEST(got->bytes == total);
    BOOST_TEST(last == total);  // The last report is the end.
    BOOST_TEST(calls >= 1u);
    BOOST_TEST(got->sha256.empty());
  }
  auto missing = ReadFiles({(dir.path() / "nope").string()}, {});
  BOOST_TEST(!missing.ok());
  BOOST_TEST(missing.status().message().find("nope") != std::string::npos);
}

BOOST_AUTO_TEST_CASE(sha256_of_each_file_and_sha256sums) {
  TempDir dir;
  std::ofstream(dir.path() / "model-00001-of-00002.safetensors") << "abc";
  std::ofstream(dir.path() / "model-00002-of-00002.safetensors") << "";
  nlohmann::json index = {
      {"weight_map",
       {{"a", "model-00001-of-00002.safetensors"}, {"b", "model-00002-of-00002.safetensors"}}}};
  std::ofstream(dir.path() / "model.safetensors.index.json") << index.dump();
  auto files = CheckpointFiles(dir.path().string());
  BOOST_REQUIRE(files.ok());
  BOOST_REQUIRE(files->size() == 2u);
  ReadFilesOptions o;
  o.sha256 = true;
  auto got = ReadFiles(*files, o);
  BOOST_REQUIRE(got.ok());
  BOOST_TEST(got->sha256.at((*files)[0]) == kAbc);
  BOOST_TEST(got->sha256.at((*files)[1]) == kEmpty);

  // No SHA256SUMS: verifying says so.
  Status none = VerifyModelFiles(dir.path().string(), {});
  BOOST_TEST(none.code() == StatusCode::kNotFound);
  // Matching sums (either `sha256sum` mode, upper case too) pass.
  std::string upper = kAbc;
  for (char& c : upper) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  std::ofstream(dir.path() / "SHA256SUMS") << upper << "  model-00001-of-00002.safetensors\n"
                                           << kEmpty << " *model-00002-of-00002.safetensors\n";
  BOOST_TEST(VerifyModelFiles(dir.path().string(), {}).ok());
  // A changed file, and a file with no line, are both named.
  std::ofstream(dir.path() / "model-00001-of-00002.safetensors") << "abd";
  std::ofstream(dir.path() / "SHA256SUMS") << kAbc << "  model-00001-of-00002.safetensors\n";
  Status bad = VerifyModelFiles(dir.path().string(), {});
  BOOST_TEST(bad.code() == StatusCode::kDataLoss);
  BOOST_TEST(bad.message().find("model-00001-of-00002.safetensors: SHA-256") != std::string::npos);
  BOOST_TEST(bad.message().find("model-00002-of-00002.safetensors: not in SHA256SUMS") !=
             std::string::npos);
  // A malformed line names its line number.
  std::ofstream(dir.path() / "SHA256SUMS") << kAbc << "  a\nnot a checksum line\n";
  auto sums = ReadSha256Sums(dir.path().string());
  BOOST_TEST(!sums.ok());
  BOOST_TEST(sums.status().message().find("SHA256SUMS:2") != std::string::npos);
}

// Every cut of the released config is a valid config whose lists stay inside it, and the full
// cut is the release itself.
BOOST_AUTO_TEST_CASE(the_released_config_cut_to_any_number_of_layers) {
  auto released = ParseModelConfig(ReleasedConfigText(), "released");
  BOOST_REQUIRE(released.ok());
  for (int n = 1; n <= released->num_hidden_layers; ++n) {
    auto text = ReleasedConfigJson(n, "");
    BOOST_REQUIRE_MESSAGE(text.ok(), n << ": " << text.status().ToString());
    auto c = ParseModelConfig(*text, "cut");
    BOOST_REQUIRE(c.ok());
    BOOST_TEST(c->num_hidden_layers == n);
    BOOST_TEST(c->hidden_size == released->hidden_size);
    BOOST_TEST(c->n_routed_experts == released->n_routed_experts);
    for (int l : c->dspark_target_layer_ids) BOOST_TEST(l < n);
    for (int l : c->engram_layer_ids) BOOST_TEST(l < n);
  }
  auto full = ParseModelConfig(*ReleasedConfigJson(released->num_hidden_layers, ""), "full");
  BOOST_TEST(full->kv_source_layer_ids == released->kv_source_layer_ids);
  BOOST_TEST(full->dspark_target_layer_ids == released->dspark_target_layer_ids);
  BOOST_TEST(full->engram_num_embeddings == released->engram_num_embeddings);
  BOOST_TEST(full->candidate_source_layer_id == released->candidate_source_layer_id);
  BOOST_TEST(!ReleasedConfigJson(0, "").ok());
  BOOST_TEST(!ReleasedConfigJson(released->num_hidden_layers + 1, "").ok());
}

// The streamed writer's checkpoint loads like the release: every tensor by name, dtype and
// shape, in shards with an index; the same seed writes the same bytes.
BOOST_AUTO_TEST_CASE(a_streamed_checkpoint_loads_like_the_release) {
  TempDir dir;
  auto config = TinyConfigJson("");
  BOOST_REQUIRE(config.ok());
  TinyModelOptions o;
  o.shards = 3;
  BOOST_REQUIRE(WriteLargeModel((dir.path() / "a").string(), *config, o).ok());
  BOOST_REQUIRE(WriteLargeModel((dir.path() / "b").string(), *config, o).ok());
  auto model = Model::Load((dir.path() / "a").string());
  BOOST_REQUIRE_MESSAGE(model.ok(), model.status().ToString());
  BOOST_TEST((*model)->checkpoint().files().size() == 3u);
  BOOST_TEST((*model)->weights().dspark);
  auto files = CheckpointFiles((dir.path() / "a").string());
  BOOST_REQUIRE(files.ok());
  BOOST_TEST(files->size() == 3u);
  ReadFilesOptions sha;
  sha.sha256 = true;
  auto a = ReadFiles(*files, sha);
  auto b = ReadFiles(*CheckpointFiles((dir.path() / "b").string()), sha);
  BOOST_REQUIRE(a.ok() && b.ok());
  std::vector<std::string> ha, hb;
  for (auto& [p, h] : a->sha256) ha.push_back(h);
  for (auto& [p, h] : b->sha256) hb.push_back(h);
  BOOST_TEST(ha == hb);
  // FP8 codes are never NaN; scales stay in range.
  const TensorView* w = (*model)->checkpoint().Find("layers.0.attn.wq_a.weight");
  BOOST_REQUIRE(w != nullptr);
  for (uint64_t i = 0; i < w->nbytes; ++i) BOOST_TEST_REQUIRE((w->data[i] & 0x7F) != 0x7F);
}

BOOST_AUTO_TEST_SUITE_END()

}  // namespace
}  // namespace flashd::engine
