#include "engine/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

namespace flashd::engine {
namespace {

using nlohmann::json;

struct DTypeInfo {
  DType dtype;
  const char* name;
  uint32_t bits;
};

constexpr DTypeInfo kDTypes[] = {
    {DType::kBF16, "BF16", 16},     {DType::kF16, "F16", 16},       {DType::kF32, "F32", 32},
    {DType::kF64, "F64", 64},       {DType::kI64, "I64", 64},       {DType::kI32, "I32", 32},
    {DType::kI16, "I16", 16},       {DType::kU8, "U8", 8},          {DType::kI8, "I8", 8},
    {DType::kBool, "BOOL", 8},      {DType::kF8E4M3, "F8_E4M3", 8}, {DType::kF8E5M2, "F8_E5M2", 8},
    {DType::kF8E8M0, "F8_E8M0", 8}, {DType::kF4, "F4", 4},
};

// Header sizes beyond this are refused before anything is parsed (the released index has
// 96,085 tensors over 48 files; one shard's header is well under a megabyte).
constexpr uint64_t kMaxHeaderBytes = 256ull << 20;

}  // namespace

std::string_view DTypeName(DType dtype) {
  for (const DTypeInfo& d : kDTypes) {
    if (d.dtype == dtype) return d.name;
  }
  return "?";
}

bool ParseDType(std::string_view name, DType* out) {
  for (const DTypeInfo& d : kDTypes) {
    if (name == d.name) {
      *out = d.dtype;
      return true;
    }
  }
  return false;
}

uint64_t DTypeBytes(DType dtype, uint64_t elements) {
  for (const DTypeInfo& d : kDTypes) {
    if (d.dtype == dtype) return (elements * d.bits + 7) / 8;
  }
  return 0;
}

uint64_t TensorView::elements() const {
  uint64_t n = 1;
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);
  return n;
}

std::string TensorView::ShapeString() const {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  std::unique_ptr<SafetensorsFile> f(new SafetensorsFile());
  f->path_ = path;
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return NotFound(path + ": cannot open: " + std::strerror(errno));
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    return IoError(path + ": cannot stat: " + std::strerror(errno));
  }
  f->size_ = static_cast<uint64_t>(st.st_size);
  if (f->size_ < 8) {
    ::close(fd);
    return DataLoss(path + ": truncated: " + std::to_string(f->size_) +
                    " bytes, shorter than the 8-byte header length");
  }
  void* p = ::mmap(nullptr, f->size_, PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);
  if (p == MAP_FAILED) return IoError(path + ": cannot map: " + std::strerror(errno));
  f->base_ = static_cast<const uint8_t*>(p);
  // A header field of the wrong type (nlohmann's type errors) is damage like any other.
  try {
    FLASHD_RETURN_IF_ERROR(f->Parse());
  } catch (const json::exception& e) {
    return DataLoss(path + ": header: " + e.what());
  }
  return f;
}

SafetensorsFile::~SafetensorsFile() {
  if (base_ != nullptr) ::munmap(const_cast<uint8_t*>(base_), size_);
}

std::string_view SafetensorsFile::header() const {
  return std::string_view(reinterpret_cast<const char*>(base_ + 8), header_len_);
}

Status SafetensorsFile::Parse() {
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(base_[i]) << (8 * i);
  if (n > kMaxHeaderBytes || n > size_ - 8) {
    return DataLoss(path_ + ": header length " + std::to_string(n) + " exceeds the file (" +
                    std::to_string(size_) + " bytes): truncated or not a safetensors file");
  }
  header_len_ = n;
  json header;
  try {
    header = json::parse(this->header());
  } catch (const json::exception& e) {
    return DataLoss(path_ + ": header is not valid JSON: " + e.what());
  }
  if (!header.is_object()) return DataLoss(path_ + ": header is not a JSON object");
  const uint64_t data_start = 8 + n;
  const uint64_t data_size = size_ - data_start;

  struct Range {
    uint64_t begin, end;
    const std::string* name;
  };
  std::vector<Range> ranges;
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    const json& entry = it.value();
    if (name == "__metadata__") {
      if (!entry.is_object()) return DataLoss(path_ + ": __metadata__ is not an object");
      for (auto m = entry.begin(); m != entry.end(); ++m) {
        if (!m.value().is_string()) {
          return DataLoss(path_ + ": __metadata__." + m.key() + " is not a string");
        }
        metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    const std::string where = path_ + ": tensor " + name;
    if (!entry.is_object() || !entry.contains("dtype") || !entry.contains("shape") ||
        !entry.contains("data_offsets")) {
      return DataLoss(where + ": entry needs dtype, shape and data_offsets");
    }
    TensorView t;
    t.name = name;
    const json& dtype = entry["dtype"];
    if (!dtype.is_string()) return DataLoss(where + ": dtype is not a string");
    if (!ParseDType(dtype.get<std::string>(), &t.dtype)) {
      return InvalidArgument(where + ": unknown dtype \"" + dtype.get<std::string>() + "\"");
    }
    const json& shape = entry["shape"];
    if (!shape.is_array()) return DataLoss(where + ": shape is not a list");
    uint64_t elements = 1;
    for (const json& d : shape) {
      if (!d.is_number_unsigned() && !(d.is_number_integer() && d.get<int64_t>() >= 0)) {
        return DataLoss(where + ": shape has a negative or non-integer dimension");
      }
      uint64_t v = d.get<uint64_t>();
      if (v != 0 && elements > (1ull << 62) / v) return DataLoss(where + ": shape overflows");
      elements *= v;
      t.shape.push_back(static_cast<int64_t>(v));
    }
    const json& offsets = entry["data_offsets"];
    if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() ||
        !offsets[1].is_number_unsigned()) {
      return DataLoss(where + ": data_offsets must be two non-negative integers");
    }
    uint64_t begin = offsets[0].get<uint64_t>();
    uint64_t end = offsets[1].get<uint64_t>();
    if (end < begin) return DataLoss(where + ": data_offsets end before they begin");
    if (end > data_size) {
      return DataLoss(where + ": data ends at byte " + std::to_string(end) + " of " +
                      std::to_string(data_size) + ": the file is truncated");
    }
    uint64_t expected = DTypeBytes(t.dtype, elements);
    if (end - begin != expected) {
      return DataLoss(where + ": holds " + std::to_string(end - begin) + " bytes, but " +
                      std::string(DTypeName(t.dtype)) + " " + t.ShapeString() + " needs " +
                      std::to_string(expected));
    }
    t.data = base_ + data_start + begin;
    t.nbytes = end - begin;
    t.file = &path_;
    t.file_offset = data_start + begin;
    auto [pos, inserted] = tensors_.emplace(name, std::move(t));
    if (end > begin) ranges.push_back({begin, end, &pos->first});  // An empty one overlaps none.
  }
  std::sort(ranges.begin(), ranges.end(),
            [](const Range& a, const Range& b) { return a.begin < b.begin; });
  for (size_t i = 1; i < ranges.size(); ++i) {
    if (ranges[i].begin < ranges[i - 1].end) {
      return DataLoss(path_ + ": tensor " + *ranges[i].name + " overlaps tensor " +
                      *ranges[i - 1].name);
    }
  }
  return Status::Ok();
}

StatusOr<std::vector<std::string>> CheckpointFiles(const std::string& dir,
                                                   std::map<std::string, std::string>* weight_map) {
  namespace fs = std::filesystem;
  const fs::path index_path = fs::path(dir) / "model.safetensors.index.json";
  std::error_code ec;
  std::map<std::string, std::string> map;  // tensor -> file name
  std::vector<std::string> file_names;
  if (fs::exists(index_path, ec)) {
    std::ifstream in(index_path);
    std::stringstream ss;
    ss << in.rdbuf();
    json index;
    try {
      index = json::parse(ss.str());
    } catch (const json::exception& e) {
      return DataLoss(index_path.string() + ": not valid JSON: " + e.what());
    }
    if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object()) {
      return DataLoss(index_path.string() + ": has no weight_map object");
    }
    std::set<std::string> seen;
    for (auto it = index["weight_map"].begin(); it != index["weight_map"].end(); ++it) {
      if (!it.value().is_string()) {
        return DataLoss(index_path.string() + ": weight_map." + it.key() + " is not a file name");
      }
      std::string file = it.value().get<std::string>();
      if (file.find('/') != std::string::npos || file == "..") {
        return DataLoss(index_path.string() + ": weight_map." + it.key() + " names \"" + file +
                        "\" outside the model directory");
      }
      map[it.key()] = file;
      if (seen.insert(file).second) file_names.push_back(file);
    }
    for (const std::string& file : file_names) {
      if (!fs::exists(fs::path(dir) / file, ec)) {
        std::string example;
        for (const auto& [tensor, f] : map) {
          if (f == file) {
            example = tensor;
            break;
          }
        }
        return NotFound((fs::path(dir) / file).string() + ": shard is missing (it holds " +
                        example + " and other tensors listed in model.safetensors.index.json)");
      }
    }
  } else if (fs::exists(fs::path(dir) / "model.safetensors", ec)) {
    file_names.push_back("model.safetensors");
  } else {
    for (const auto& entry : fs::directory_iterator(dir, ec)) {
      if (entry.path().extension() == ".safetensors") {
        file_names.push_back(entry.path().filename().string());
      }
    }
    std::sort(file_names.begin(), file_names.end());
    if (file_names.empty()) {
      return NotFound(dir + ": no model.safetensors.index.json and no *.safetensors files");
    }
  }
  std::vector<std::string> paths;
  for (const std::string& name : file_names) paths.push_back((fs::path(dir) / name).string());
  if (weight_map != nullptr) *weight_map = std::move(map);
  return paths;
}

StatusOr<std::unique_ptr<Checkpoint>> Checkpoint::Open(const std::string& dir) {
  namespace fs = std::filesystem;
  auto cp = std::make_unique<Checkpoint>();
  std::map<std::string, std::string> weight_map;  // tensor -> file name
  FLASHD_ASSIGN_OR_RETURN(std::vector<std::string> paths, CheckpointFiles(dir, &weight_map));
  for (const std::string& path : paths) {
    const std::string name = fs::path(path).filename().string();
    FLASHD_ASSIGN_OR_RETURN(auto file, SafetensorsFile::Open(path));
    for (const auto& [tensor, view] : file->tensors()) {
      if (!weight_map.empty()) {
        auto it = weight_map.find(tensor);
        if (it == weight_map.end() || it->second != name) {
          return DataLoss(file->path() + ": tensor " + tensor +
                          (it == weight_map.end()
                               ? " is not listed in model.safetensors.index.json"
                               : " is listed in model.safetensors.index.json under " + it->second));
        }
      }
      if (!cp->index_.emplace(tensor, &view).second) {
        return DataLoss(file->path() + ": tensor " + tensor + " also appears in " +
                        *cp->index_[tensor]->file);
      }
    }
    cp->files_.push_back(std::move(file));
  }
  for (const auto& [tensor, file] : weight_map) {
    if (!cp->index_.count(tensor)) {
      return DataLoss((fs::path(dir) / file).string() + ": tensor " + tensor +
                      " is listed in model.safetensors.index.json but not in the file");
    }
  }
  return cp;
}

const TensorView* Checkpoint::Find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : it->second;
}

uint64_t Checkpoint::total_file_bytes() const {
  uint64_t total = 0;
  for (const auto& f : files_) total += f->file_bytes();
  return total;
}

Status WriteSafetensorsStreamed(const std::string& path, const std::vector<TensorHeader>& tensors,
                                const std::map<std::string, std::string>& metadata,
                                const TensorFill& fill) {
  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  // The format allows no holes between tensors, so they are laid out back to back, the widest
  // elements first (each class in the order given): every tensor then starts at a multiple of
  // its element size, the header being padded to 8 bytes.
  std::vector<uint64_t> sizes, widths;
  for (const TensorHeader& t : tensors) {
    uint64_t elements = 1;
    for (int64_t d : t.shape) elements *= static_cast<uint64_t>(d);
    sizes.push_back(DTypeBytes(t.dtype, elements));
    widths.push_back(std::max<uint64_t>(1, DTypeBytes(t.dtype, 8) / 8));
  }
  std::vector<size_t> order(tensors.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return widths[a] > widths[b]; });
  uint64_t offset = 0;
  for (size_t i : order) {
    const TensorHeader& t = tensors[i];
    header[t.name] = {{"dtype", std::string(DTypeName(t.dtype))},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + sizes[i]}}};
    offset += sizes[i];
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return IoError(path + ": cannot create: " + std::strerror(errno));
  uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) out.put(static_cast<char>((n >> (8 * i)) & 0xFF));
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
  constexpr uint64_t kChunk = 32ull << 20;
  std::vector<uint8_t> buf;
  for (size_t i : order) {
    for (uint64_t at = 0; at < sizes[i]; at += kChunk) {
      const uint64_t len = std::min(kChunk, sizes[i] - at);
      buf.resize(len);
      FLASHD_RETURN_IF_ERROR(fill(i, at, buf.data(), len));
      out.write(reinterpret_cast<const char*>(buf.data()), static_cast<std::streamsize>(len));
    }
  }
  out.flush();
  if (!out) return IoError(path + ": write failed: " + std::strerror(errno));
  return Status::Ok();
}

Status WriteSafetensors(const std::string& path, const std::vector<const TensorData*>& tensors,
                        const std::map<std::string, std::string>& metadata) {
  std::vector<TensorHeader> headers;
  for (const TensorData* t : tensors) {
    uint64_t elements = 1;
    for (int64_t d : t->shape) elements *= static_cast<uint64_t>(d);
    if (DTypeBytes(t->dtype, elements) != t->bytes.size()) {
      return Internal("WriteSafetensors: " + t->name + " has " + std::to_string(t->bytes.size()) +
                      " bytes for its shape");
    }
    headers.push_back({t->name, t->dtype, t->shape});
  }
  return WriteSafetensorsStreamed(path, headers, metadata,
                                  [&](size_t i, uint64_t offset, uint8_t* out, uint64_t n) {
                                    std::memcpy(out, tensors[i]->bytes.data() + offset, n);
                                    return Status::Ok();
                                  });
}

}  // namespace flashd::engine
