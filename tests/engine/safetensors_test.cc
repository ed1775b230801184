#include "engine/safetensors.h"

#include <boost/test/unit_test.hpp>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "tests/support/temp_dir.h"

namespace flashd::engine {
namespace {

namespace fs = std::filesystem;
using flashd::testing::Contains;
using flashd::testing::TempDir;

// A raw safetensors file: length prefix, header text, data bytes.
void WriteRaw(const fs::path& path, const std::string& header, const std::string& data) {
  std::ofstream out(path, std::ios::binary);
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out.put(static_cast<char>((n >> (8 * i)) & 0xFF));
  out << header << data;
}

std::string OpenError(const fs::path& path) {
  auto f = SafetensorsFile::Open(path.string());
  BOOST_REQUIRE_MESSAGE(!f.ok(), "expected an error for " << path);
  return f.status().message();
}

TensorData Make(const std::string& name, DType dtype, std::vector<int64_t> shape, uint8_t fill) {
  uint64_t n = 1;
  for (int64_t d : shape) n *= d;
  return TensorData{name, dtype, shape, std::vector<uint8_t>(DTypeBytes(dtype, n), fill)};
}

BOOST_AUTO_TEST_SUITE(safetensors)

BOOST_AUTO_TEST_CASE(round_trip_every_dtype) {
  TempDir tmp;
  std::vector<TensorData> data = {
      Make("a.bf16", DType::kBF16, {3, 5}, 1),   Make("b.f16", DType::kF16, {7}, 2),
      Make("c.f32", DType::kF32, {2, 2}, 3),     Make("d.i64", DType::kI64, {3}, 4),
      Make("e.i32", DType::kI32, {1}, 5),        Make("f.u8", DType::kU8, {9}, 6),
      Make("g.i8", DType::kI8, {4, 8}, 7),       Make("h.e4m3", DType::kF8E4M3, {5, 3}, 8),
      Make("i.e8m0", DType::kF8E8M0, {2, 1}, 9), Make("j.f4", DType::kF4, {3, 5}, 10),
      Make("k.scalar", DType::kF32, {}, 11),     Make("l.empty", DType::kF32, {0, 4}, 0),
  };
  std::vector<const TensorData*> ptrs;
  for (const TensorData& t : data) ptrs.push_back(&t);
  fs::path path = tmp.path() / "m.safetensors";
  BOOST_REQUIRE(WriteSafetensors(path.string(), ptrs, {{"format", "pt"}}).ok());

  auto f = SafetensorsFile::Open(path.string());
  BOOST_REQUIRE_MESSAGE(f.ok(), f.status().ToString());
  BOOST_TEST((*f)->metadata().at("format") == "pt");
  BOOST_REQUIRE((*f)->tensors().size() == data.size());
  for (const TensorData& t : data) {
    const TensorView& v = (*f)->tensors().at(t.name);
    BOOST_TEST(DTypeName(v.dtype) == DTypeName(t.dtype));
    BOOST_TEST(v.shape == t.shape);
    BOOST_TEST(v.nbytes == t.bytes.size());
    BOOST_TEST((v.nbytes == 0 || std::memcmp(v.data, t.bytes.data(), v.nbytes) == 0), t.name);
  }
  BOOST_TEST((*f)->tensors().at("j.f4").nbytes == 8u);  // 15 four-bit values round up to 8 bytes.
}

BOOST_AUTO_TEST_CASE(corrupt_files_are_errors_naming_file_and_tensor) {
  TempDir tmp;
  const std::string ok_entry = R"("w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]})";
  struct Case {
    const char* what;
    std::string header;
    std::string data;
    std::string expected;
  };
  const Case cases[] = {
      {"data cut short", "{" + ok_entry + "}", std::string(8, 'x'),
       "tensor w: data ends at byte 16"},
      {"header not JSON", "{\"w\": [", "", "header is not valid JSON"},
      {"unknown dtype", R"({"w": {"dtype": "F12", "shape": [2], "data_offsets": [0, 4]}})",
       std::string(4, 'x'), "tensor w: unknown dtype \"F12\""},
      {"size mismatch", R"({"w": {"dtype": "BF16", "shape": [3], "data_offsets": [0, 4]}})",
       std::string(4, 'x'), "tensor w: holds 4 bytes, but BF16 [3] needs 6"},
      {"overlap",
       R"({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
           "b": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]}})",
       std::string(6, 'x'), "tensor b overlaps tensor a"},
      {"offsets reversed", R"({"w": {"dtype": "U8", "shape": [0], "data_offsets": [4, 0]}})",
       std::string(4, 'x'), "tensor w: data_offsets end before they begin"},
      {"negative dim", R"({"w": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 0]}})", "",
       "tensor w: shape has a negative"},
      {"missing keys", R"({"w": {"dtype": "U8"}})", "", "tensor w: entry needs dtype"},
  };
  int i = 0;
  for (const Case& c : cases) {
    fs::path path = tmp.path() / ("case" + std::to_string(i++) + ".safetensors");
    WriteRaw(path, c.header, c.data);
    std::string message = OpenError(path);
    BOOST_TEST_CONTEXT(c.what) {
      BOOST_TEST(Contains(message, path.string()), message);
      BOOST_TEST(Contains(message, c.expected), message);
    }
  }

  // A header length pointing past the end of the file, and a file shorter than the length.
  fs::path huge = tmp.path() / "huge.safetensors";
  {
    std::ofstream out(huge, std::ios::binary);
    uint64_t n = 1ull << 40;
    for (int b = 0; b < 8; ++b) out.put(static_cast<char>((n >> (8 * b)) & 0xFF));
    out << "{}";
  }
  BOOST_TEST(Contains(OpenError(huge), "header length"));
  fs::path tiny = tmp.path() / "tiny.safetensors";
  std::ofstream(tiny, std::ios::binary) << "abc";
  BOOST_TEST(Contains(OpenError(tiny), "truncated"));
  BOOST_TEST(Contains(OpenError(tmp.path() / "absent.safetensors"), "cannot open"));
}

BOOST_AUTO_TEST_CASE(truncating_a_valid_file_anywhere_never_reads_out_of_bounds) {
  TempDir tmp;
  TensorData a = Make("layers.0.attn.wq_a.weight", DType::kF8E4M3, {64, 32}, 3);
  TensorData b = Make("layers.0.attn.wq_a.scale", DType::kF8E8M0, {2, 1}, 127);
  fs::path path = tmp.path() / "full.safetensors";
  BOOST_REQUIRE(WriteSafetensors(path.string(), {&a, &b}).ok());
  const uint64_t size = fs::file_size(path);
  for (uint64_t cut = 0; cut < size; cut += 7) {
    fs::path part = tmp.path() / "part.safetensors";
    fs::copy_file(path, part, fs::copy_options::overwrite_existing);
    fs::resize_file(part, cut);
    auto f = SafetensorsFile::Open(part.string());
    BOOST_TEST(!f.ok(), "cut at " << cut);
  }
}

BOOST_AUTO_TEST_CASE(sharded_checkpoint_and_its_errors) {
  TempDir tmp;
  TensorData a = Make("a", DType::kF32, {4}, 1);
  TensorData b = Make("b", DType::kBF16, {8}, 2);
  fs::path dir = tmp.path() / "model";
  fs::create_directories(dir);
  BOOST_REQUIRE(WriteSafetensors((dir / "model-00001-of-00002.safetensors").string(), {&a}).ok());
  BOOST_REQUIRE(WriteSafetensors((dir / "model-00002-of-00002.safetensors").string(), {&b}).ok());
  nlohmann::json index = {
      {"metadata", {{"total_size", 32}}},
      {"weight_map",
       {{"a", "model-00001-of-00002.safetensors"}, {"b", "model-00002-of-00002.safetensors"}}}};
  std::ofstream(dir / "model.safetensors.index.json") << index.dump();
  auto cp = Checkpoint::Open(dir.string());
  BOOST_REQUIRE_MESSAGE(cp.ok(), cp.status().ToString());
  BOOST_TEST((*cp)->tensors().size() == 2u);
  BOOST_TEST((*cp)->Find("b")->nbytes == 16u);
  BOOST_TEST((*cp)->Find("zzz") == nullptr);
  BOOST_TEST(Contains(*(*cp)->Find("b")->file, "model-00002-of-00002"));

  // The index names a tensor the shard does not hold.
  index["weight_map"]["c"] = "model-00002-of-00002.safetensors";
  std::ofstream(dir / "model.safetensors.index.json") << index.dump();
  auto missing_tensor = Checkpoint::Open(dir.string());
  BOOST_TEST(Contains(missing_tensor.status().message(), "tensor c is listed"));

  // A shard file is gone.
  index["weight_map"].erase("c");
  std::ofstream(dir / "model.safetensors.index.json") << index.dump();
  fs::remove(dir / "model-00002-of-00002.safetensors");
  auto missing_shard = Checkpoint::Open(dir.string());
  BOOST_TEST(!missing_shard.ok());
  BOOST_TEST(Contains(missing_shard.status().message(),
                      "model-00002-of-00002.safetensors: shard is missing (it holds b"));

  // A directory with nothing to read.
  fs::create_directories(tmp.path() / "empty");
  auto empty = Checkpoint::Open((tmp.path() / "empty").string());
  BOOST_TEST(Contains(empty.status().message(), "no model.safetensors.index.json"));
}

BOOST_AUTO_TEST_SUITE_END()

}  // namespace
}  // namespace flashd::engine
