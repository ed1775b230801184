// Safetensors checkpoints: one file or a sharded set (model.safetensors.index.json), memory-mapped
// read-only, with zero-copy views of each tensor.
//
// Format (safetensors): 8-byte little-endian header length N, N bytes of JSON mapping each tensor
// name to {dtype, shape, data_offsets: [begin, end]} relative to the byte after the header, then
// the data. Everything is validated at open: header size and JSON, known dtypes, offsets inside
// the file, byte sizes equal to shape x dtype size, no two tensors overlapping. A corrupt or
// truncated file is an error naming the file and tensor, never an out-of-bounds read.
//
// The released DeepSeek-V4.1 checkpoint stores FP8 weights as F8_E4M3, their scales as F8_E8M0,
// and FP4 routed experts as I8 holding two E2M1 values per byte (low nibble first), with shape
// [rows, cols/2]. The newer "F4" dtype (shape in 4-bit elements, two per byte) is read as well.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "config/status.h"

namespace flashd::engine {

enum class DType {
  kBF16,
  kF16,
  kF32,
  kF64,
  kI64,
  kI32,
  kI16,
  kU8,
  kI8,
  kBool,
  kF8E4M3,
  kF8E5M2,
  kF8E8M0,
  kF4
};

std::string_view DTypeName(DType dtype);  // The safetensors spelling: "BF16", "F8_E4M3", ...
bool ParseDType(std::string_view name, DType* out);
// Bytes for `elements` elements (F4 packs two per byte, rounding up).
uint64_t DTypeBytes(DType dtype, uint64_t elements);

struct TensorView {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;  // Into the mapping; valid while the file is open.
  uint64_t nbytes = 0;
  const std::string* file = nullptr;  // The shard it lives in.
  uint64_t file_offset = 0;           // Where its bytes start in that file.

  uint64_t elements() const;
  std::string ShapeString() const;  // "[1280, 5120]"
};

// One mapped .safetensors file.
class SafetensorsFile {
 public:
  static StatusOr<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  uint64_t file_bytes() const { return size_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::map<std::string, TensorView>& tensors() const { return tensors_; }
  // The raw header JSON, e.g. for a model fingerprint.
  std::string_view header() const;

 private:
  SafetensorsFile() = default;
  Status Parse();

  std::string path_;
  const uint8_t* base_ = nullptr;
  uint64_t size_ = 0;
  uint64_t header_len_ = 0;
  std::map<std::string, std::string> metadata_;
  std::map<std::string, TensorView> tensors_;
};

// The weight files of a model directory (paths), in the order Checkpoint::Open reads them: the
// shards model.safetensors.index.json names (each must exist), else model.safetensors, else
// every *.safetensors file, sorted. `weight_map`, when given, gets the index's tensor -> file
// name (empty without an index).
StatusOr<std::vector<std::string>> CheckpointFiles(
    const std::string& dir, std::map<std::string, std::string>* weight_map = nullptr);

// Every tensor of a model directory, whichever file holds it.
class Checkpoint {
 public:
  // `dir` holds model.safetensors.index.json (sharded), or model.safetensors, or other
  // *.safetensors files that are all read.
  static StatusOr<std::unique_ptr<Checkpoint>> Open(const std::string& dir);

  const TensorView* Find(const std::string& name) const;
  const std::map<std::string, const TensorView*>& tensors() const { return index_; }
  const std::vector<std::unique_ptr<SafetensorsFile>>& files() const { return files_; }
  uint64_t total_file_bytes() const;

 private:
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, const TensorView*> index_;
};

// Writes tensors in the safetensors format (for mkmodel and tests), as other readers (the
// safetensors library) accept it: the header padded to a multiple of 8 with spaces, then the
// tensors back to back with no hole between them, the widest elements first (in the order
// given within each width), so that each starts at a multiple of its element size.
struct TensorData {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};
Status WriteSafetensors(const std::string& path, const std::vector<const TensorData*>& tensors,
                        const std::map<std::string, std::string>& metadata = {});

// The same layout for tensors too large to hold: the header from names, dtypes and shapes, then
// each tensor's bytes asked of `fill(tensor index, offset, out, n)` a chunk at a time.
struct TensorHeader {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
};
using TensorFill = std::function<Status(size_t i, uint64_t offset, uint8_t* out, uint64_t n)>;
Status WriteSafetensorsStreamed(const std::string& path, const std::vector<TensorHeader>& tensors,
                                const std::map<std::string, std::string>& metadata,
                                const TensorFill& fill);

}  // namespace flashd::engine
