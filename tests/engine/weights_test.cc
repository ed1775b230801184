// Weight binding against tiny checkpoints written by `flashd mkmodel` (the real binary, so the
// generator and the loader meet in the released format).
#include "engine/weights.h"

#include <boost/test/unit_test.hpp>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "engine/model.h"
#include "tests/support/temp_dir.h"

namespace flashd::engine {
namespace {

namespace fs = std::filesystem;
using flashd::testing::Contains;
using flashd::testing::TempDir;

int MkModel(const fs::path& dir, const std::string& extra) {
  std::string cmd = std::string(FLASHD_BINARY) + " mkmodel " + dir.string() +
                    " --set vocab_size=1024 --set dspark_noise_token_id=1000 " + extra +
                    " > /dev/null";
  return std::system(cmd.c_str());
}

std::string ReadAll(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

BOOST_AUTO_TEST_SUITE(weights)

BOOST_AUTO_TEST_CASE(tiny_model_binds_every_tensor_by_released_name) {
  TempDir tmp;
  BOOST_REQUIRE(MkModel(tmp.path() / "m", "") == 0);
  auto model = Model::Load((tmp.path() / "m").string());
  BOOST_REQUIRE_MESSAGE(model.ok(), model.status().ToString());
  const BoundWeights& w = (*model)->weights();
  for (const char* name :
       {"embed.weight", "head.weight", "norm.weight", "layers.0.attn.wq_a.weight",
        "layers.0.attn.wq_a.scale", "layers.1.attn.compressor.wgate.weight",
        "layers.3.attn.indexer.wk.weight", "layers.4.attn.indexer.wq_b.scale",
        "layers.2.ffn.experts.7.w2.weight", "layers.2.ffn.shared_experts.w1.scale",
        "layers.1.engram.embed.weight", "layers.3.engram.wkv.scale"}) {
    BOOST_TEST(w.tensors.count(name) == 1u, name);
  }
  // Layer 3 has ratio 1: a compressor without a gate. Layer 4 reindexes but owns no keys.
  BOOST_TEST(w.tensors.count("layers.3.attn.compressor.wgate.weight") == 0u);
  BOOST_TEST(w.tensors.count("layers.4.attn.indexer.wk.weight") == 0u);
  const TensorView* expert = w.tensors.at("layers.2.ffn.experts.0.w1.weight");
  BOOST_TEST(DTypeName(expert->dtype) == "I8");
  BOOST_TEST(expert->ShapeString() == "[128, 128]");  // 256 inputs, two per byte.
  BOOST_TEST(w.tensors.at("layers.2.ffn.experts.0.w1.scale")->ShapeString() == "[128, 8]");
  BOOST_TEST(w.tensors.at("layers.0.attn.wq_b.scale")->ShapeString() == "[16, 2]");
  // The DSpark stage is present, checked and bound like the rest.
  BOOST_TEST(w.dspark);
  BOOST_TEST(w.dspark_missing == 0);
  BOOST_TEST(w.unused.count(ModelPart::kDSpark) == 0u);
  BOOST_TEST(w.tensors.count("mtp.0.main_proj.weight") == 1u);
  BOOST_TEST(w.tensors.count("mtp.0.confidence_head.proj.weight") == 1u);
  BOOST_TEST(w.unexpected.empty());
}

BOOST_AUTO_TEST_CASE(sharded_and_single_file_models_hold_the_same_tensors) {
  TempDir tmp;
  BOOST_REQUIRE(MkModel(tmp.path() / "one", "--seed 5") == 0);
  BOOST_REQUIRE(MkModel(tmp.path() / "four", "--seed 5 --shards 4") == 0);
  BOOST_TEST(fs::exists(tmp.path() / "four" / "model-00004-of-00004.safetensors"));
  BOOST_TEST(fs::exists(tmp.path() / "four" / "model.safetensors.index.json"));
  auto one = Checkpoint::Open((tmp.path() / "one").string());
  auto four = Checkpoint::Open((tmp.path() / "four").string());
  BOOST_REQUIRE(one.ok());
  BOOST_REQUIRE(four.ok());
  BOOST_TEST((*four)->files().size() == 4u);
  BOOST_REQUIRE((*one)->tensors().size() == (*four)->tensors().size());
  for (const auto& [name, view] : (*one)->tensors()) {
    const TensorView* other = (*four)->Find(name);
    BOOST_REQUIRE(other != nullptr);
    BOOST_TEST(
        (view->nbytes == other->nbytes && std::memcmp(view->data, other->data, view->nbytes) == 0),
        name);
  }
}

BOOST_AUTO_TEST_CASE(generation_is_deterministic_per_seed) {
  TempDir tmp;
  BOOST_REQUIRE(MkModel(tmp.path() / "a", "--seed 1") == 0);
  BOOST_REQUIRE(MkModel(tmp.path() / "b", "--seed 1") == 0);
  BOOST_REQUIRE(MkModel(tmp.path() / "c", "--seed 2") == 0);
  std::string a = ReadAll(tmp.path() / "a" / "model.safetensors");
  BOOST_TEST(a.size() > 1000u);
  BOOST_TEST((a == ReadAll(tmp.path() / "b" / "model.safetensors")));
  BOOST_TEST((a != ReadAll(tmp.path() / "c" / "model.safetensors")));
}

// Rewrites `dir`'s single file without `drop`, and with `replace` swapped in when given.
void Rewrite(const fs::path& dir, const std::string& drop, const TensorData* replace) {
  auto cp = Checkpoint::Open(dir.string());
  BOOST_REQUIRE(cp.ok());
  std::vector<TensorData> kept;
  for (const auto& [name, view] : (*cp)->tensors()) {
    if (name == drop) continue;
    if (replace != nullptr && name == replace->name) {
      kept.push_back(*replace);
      continue;
    }
    kept.push_back(TensorData{name, view->dtype, view->shape,
                              std::vector<uint8_t>(view->data, view->data + view->nbytes)});
  }
  cp->reset();
  std::vector<const TensorData*> ptrs;
  for (const TensorData& t : kept) ptrs.push_back(&t);
  BOOST_REQUIRE(WriteSafetensors((dir / "model.safetensors").string(), ptrs).ok());
}

BOOST_AUTO_TEST_CASE(missing_and_mismatched_tensors_are_named) {
  TempDir tmp;
  fs::path dir = tmp.path() / "m";
  BOOST_REQUIRE(MkModel(dir, "") == 0);
  Rewrite(dir, "layers.2.ffn.experts.3.w3.scale", nullptr);
  auto missing = Model::Load(dir.string());
  BOOST_REQUIRE(!missing.ok());
  BOOST_TEST(Contains(missing.status().message(), "lacks 1 tensors"), missing.status().message());
  BOOST_TEST(Contains(missing.status().message(), "layers.2.ffn.experts.3.w3.scale"));

  BOOST_REQUIRE(MkModel(dir, "") == 0);
  TensorData wrong_shape{
      "layers.0.attn.wkv.weight", DType::kF8E4M3, {128, 128}, std::vector<uint8_t>(128 * 128)};
  Rewrite(dir, "", &wrong_shape);
  auto shape = Model::Load(dir.string());
  BOOST_REQUIRE(!shape.ok());
  BOOST_TEST(Contains(shape.status().message(),
                      "tensor layers.0.attn.wkv.weight: shape [128, 128], expected [128, 256]"),
             shape.status().message());
  BOOST_TEST(Contains(shape.status().message(), "model.safetensors"));

  BOOST_REQUIRE(MkModel(dir, "") == 0);
  TensorData wrong_dtype{
      "layers.0.attn_norm.weight", DType::kI32, {256}, std::vector<uint8_t>(256 * 4)};
  Rewrite(dir, "", &wrong_dtype);
  auto dtype = Model::Load(dir.string());
  BOOST_REQUIRE(!dtype.ok());
  BOOST_TEST(Contains(dtype.status().message(), "dtype I32, expected BF16 or F32"),
             dtype.status().message());
}

BOOST_AUTO_TEST_CASE(vision_and_stray_tensors_are_reported) {
  TempDir tmp;
  fs::path dir = tmp.path() / "m";
  BOOST_REQUIRE(MkModel(dir, "") == 0);
  auto cp = Checkpoint::Open(dir.string());
  BOOST_REQUIRE(cp.ok());
  std::vector<TensorData> all;
  for (const auto& [name, view] : (*cp)->tensors()) {
    all.push_back(TensorData{name, view->dtype, view->shape,
                             std::vector<uint8_t>(view->data, view->data + view->nbytes)});
  }
  cp->reset();
  all.push_back(TensorData{
      "vision.blocks.0.attn.qkv.weight", DType::kBF16, {4, 4}, std::vector<uint8_t>(32)});
  all.push_back(TensorData{"something.else", DType::kF32, {2}, std::vector<uint8_t>(8)});
  std::vector<const TensorData*> ptrs;
  for (const TensorData& t : all) ptrs.push_back(&t);
  BOOST_REQUIRE(WriteSafetensors((dir / "model.safetensors").string(), ptrs).ok());
  auto model = Model::Load(dir.string());
  BOOST_REQUIRE_MESSAGE(model.ok(), model.status().ToString());
  BOOST_TEST((*model)->weights().unused.at(ModelPart::kVision).first == 1u);
  BOOST_TEST((*model)->weights().unused.at(ModelPart::kVision).second == 32u);
  BOOST_REQUIRE((*model)->weights().unexpected.size() == 1u);
  BOOST_TEST((*model)->weights().unexpected[0] == "something.else");
}

BOOST_AUTO_TEST_SUITE_END()

}  // namespace
}  // namespace flashd::engine
