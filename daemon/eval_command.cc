// `flashd eval`: token ids through the forward pass, logits (and every layer's output stream) out
// as .npy or safetensors, so a backend or a checkpoint can be checked against another
// implementation with nothing but numpy.
#include "daemon/eval_command.h"

#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

#include "engine/forward.h"
#include "engine/gpu_backend.h"
#include "engine/model.h"
#include "engine/safetensors.h"

namespace flashd::daemon {
namespace {

constexpr int kExitOk = 0;
constexpr int kExitFailed = 1;
constexpr int kExitUsage = 2;

void PrintEvalHelp() {
  std::printf(
      "Usage: flashd eval MODEL_DIR --out FILE [options]\n\n"
      "Runs token ids through the forward pass of MODEL_DIR (one sequence from position 0) and\n"
      "writes the fp32 logits of every position: FILE.npy holds them as [tokens, vocab];\n"
      "FILE.safetensors holds `logits` and, with --streams, `streams` [tokens, layers, hc, dim],\n"
      "the residual stream each layer produced.\n\n"
      "Options:\n"
      "  --tokens FILE           token ids: a JSON array or whitespace-separated integers\n"
      "                          (default: standard input)\n"
      "  --out FILE              .npy or .safetensors\n"
      "  --streams               also write every layer's output stream (safetensors only)\n"
      "  --forced-streams FILE   feed each layer l >= 1 the stream layer l-1 produced in another\n"
      "                          run, [tokens, layers, hc, dim] fp32 (.npy, or safetensors tensor\n"
      "                          `streams`), instead of this run's; so each layer is compared on\n"
      "                          identical inputs\n"
      "  --chunk N               prefill in calls of N tokens (default: all in one call; results\n"
      "                          are the same for any N)\n"
      "  --topk-order ORDER      total (default) or reference: how equal scores are ranked in the\n"
      "                          indexer and router (reference: the official code's CPU order)\n"
      "  --threads N             forward-pass threads (default: all cores)\n"
      "  --backend NAME          cpu (default), cuda, hip or hipcpu: where the ops run, so that\n"
      "                          two backends' outputs can be compared\n"
      "  --gpu-gemms KIND        exact (default) or matrix: how a GPU backend computes the FP8\n"
      "                          and FP4 linears (engine.gpu_gemms)\n");
}

int Fail(const std::string& message, int code = kExitUsage) {
  std::fprintf(stderr, "flashd eval: %s\n", message.c_str());
  return code;
}

bool EndsWith(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// Token ids from JSON-array or whitespace-separated text.
StatusOr<std::vector<int32_t>> ParseTokens(const std::string& text) {
  std::string cleaned = text;
  for (char& c : cleaned) {
    if (c == '[' || c == ']' || c == ',') c = ' ';
  }
  std::istringstream in(cleaned);
  std::vector<int32_t> ids;
  std::string word;
  while (in >> word) {
    char* end = nullptr;
    const long long v = std::strtoll(word.c_str(), &end, 10);
    if (end == word.c_str() || *end != '\0' || v < 0 || v > INT32_MAX) {
      return InvalidArgument("tokens: '" + word + "' is not a token id");
    }
    ids.push_back(static_cast<int32_t>(v));
  }
  if (ids.empty()) return InvalidArgument("tokens: none given");
  return ids;
}

// A version 1.0 .npy file of little-endian float32 in C order.
Status WriteNpy(const std::string& path, const std::vector<int64_t>& shape, const float* data) {
  std::string dims;
  size_t n = 1;
  for (int64_t d : shape) {
    dims += std::to_string(d) + ", ";
    n *= static_cast<size_t>(d);
  }
  if (shape.size() > 1) dims.resize(dims.size() - 2);
  std::string header = "{'descr': '<f4', 'fortran_order': False, 'shape': (" + dims + "), }";
  // Magic (6) + version (2) + length (2) + header, padded with spaces to a multiple of 64, \n last.
  const size_t total = (10 + header.size() + 1 + 63) / 64 * 64;
  header.append(total - 10 - header.size() - 1, ' ');
  header += '\n';
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  const uint16_t len = static_cast<uint16_t>(header.size());
  out.write("\x93NUMPY\x01\x00", 8);
  out.put(static_cast<char>(len & 0xFF));
  out.put(static_cast<char>(len >> 8));
  out << header;
  out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(n * sizeof(float)));
  if (!out) return IoError(path + ": cannot write");
  return Status::Ok();
}

// Reads a float32 C-order .npy written by numpy (version 1 or 2); returns its shape.
StatusOr<std::vector<float>> ReadNpy(const std::string& path, std::vector<int64_t>* shape) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return NotFound(path + ": cannot open");
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (bytes.size() < 10 || bytes.compare(0, 6, "\x93NUMPY") != 0) {
    return InvalidArgument(path + ": not a .npy file");
  }
  const int major = static_cast<unsigned char>(bytes[6]);
  size_t header_len = 0, start = 0;
  if (major == 1) {
    header_len = static_cast<unsigned char>(bytes[8]) | static_cast<unsigned char>(bytes[9]) << 8;
    start = 10;
  } else if (bytes.size() >= 12) {
    for (int i = 0; i < 4; ++i)
      header_len |= size_t{static_cast<unsigned char>(bytes[8 + i])} << (8 * i);
    start = 12;
  }
  if (start == 0 || start + header_len > bytes.size())
    return InvalidArgument(path + ": bad header");
  const std::string header = bytes.substr(start, header_len);
  if (header.find("'<f4'") == std::string::npos ||
      header.find("'fortran_order': False") == std::string::npos) {
    return InvalidArgument(path + ": expected little-endian float32 in C order");
  }
  const size_t open = header.find('('), close = header.find(')');
  if (open == std::string::npos || close == std::string::npos)
    return InvalidArgument(path + ": no shape");
  shape->clear();
  std::istringstream dims(header.substr(open + 1, close - open - 1));
  std::string d;
  size_t n = 1;
  while (std::getline(dims, d, ',')) {
    if (d.find_first_not_of(' ') == std::string::npos) continue;
    shape->push_back(std::stoll(d));
    n *= static_cast<size_t>(shape->back());
  }
  const size_t data = start + header_len;
  if (bytes.size() - data != n * sizeof(float))
    return InvalidArgument(path + ": size does not match its shape");
  std::vector<float> out(n);
  std::memcpy(out.data(), bytes.data() + data, n * sizeof(float));
  return out;
}

StatusOr<std::vector<float>> ReadStreams(const std::string& path, std::vector<int64_t>* shape) {
  if (EndsWith(path, ".npy")) return ReadNpy(path, shape);
  FLASHD_ASSIGN_OR_RETURN(auto file, engine::SafetensorsFile::Open(path));
  auto it = file->tensors().find("streams");
  if (it == file->tensors().end()) return InvalidArgument(path + ": no tensor named streams");
  const engine::TensorView& t = it->second;
  if (t.dtype != engine::DType::kF32) return InvalidArgument(path + ": streams must be F32");
  *shape = t.shape;
  std::vector<float> out(t.elements());
  std::memcpy(out.data(), t.data, out.size() * sizeof(float));
  return out;
}

struct EvalArgs {
  std::string model_dir, tokens_path, out, forced_path;
  bool streams = false;
  size_t chunk = 0;
  int threads = 0;
  kernels::TopKOrder order = kernels::TopKOrder::kTotal;
  std::string backend = "cpu";
  engine::GpuOptions gpu;
};

int Run(const EvalArgs& a) {
  std::string text;
  if (a.tokens_path.empty() || a.tokens_path == "-") {
    text.assign(std::istreambuf_iterator<char>(std::cin), std::istreambuf_iterator<char>());
  } else {
    std::ifstream in(a.tokens_path);
    if (!in) return Fail(a.tokens_path + ": cannot open", kExitFailed);
    text.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  StatusOr<std::vector<int32_t>> tokens = ParseTokens(text);
  if (!tokens.ok()) return Fail(tokens.status().message(), kExitFailed);
  auto model = engine::Model::Load(a.model_dir);
  if (!model.ok()) return Fail(model.status().ToString(), kExitFailed);
  std::string why;
  auto backend = engine::SelectBackend(a.backend, &why, 0, a.gpu);
  if (!backend.ok()) return Fail(backend.status().message(), kExitFailed);
  auto fwd = engine::CpuForward::Create(**model, "", 64, std::move(*backend));
  if (!fwd.ok()) return Fail(fwd.status().ToString(), kExitFailed);
  const engine::ModelConfig& c = (*fwd)->config();
  const int64_t T = static_cast<int64_t>(tokens->size()), L = c.num_hidden_layers;
  const int64_t width = c.hc_mult * c.hidden_size;
  std::vector<float> forced;
  if (!a.forced_path.empty()) {
    std::vector<int64_t> shape;
    StatusOr<std::vector<float>> f = ReadStreams(a.forced_path, &shape);
    if (!f.ok()) return Fail(f.status().message(), kExitFailed);
    const std::vector<int64_t> want = {T, L, c.hc_mult, c.hidden_size};
    if (shape != want) {
      return Fail(a.forced_path + ": streams must be [tokens, layers, hc, dim] = [" +
                      std::to_string(T) + ", " + std::to_string(L) + ", " +
                      std::to_string(c.hc_mult) + ", " + std::to_string(c.hidden_size) + "]",
                  kExitFailed);
    }
    forced = std::move(*f);
  }
  engine::SequenceState state = (*fwd)->NewSequence();
  std::vector<float> logits, part, streams, sublayers;
  const int64_t dim = c.hidden_size;
  if (a.streams) {
    streams.resize(static_cast<size_t>(T * L * width));
    sublayers.resize(static_cast<size_t>(T * L * 4 * dim));
  }
  const size_t chunk = a.chunk > 0 ? a.chunk : tokens->size();
  for (size_t done = 0; done < tokens->size(); done += chunk) {
    const size_t n = std::min(chunk, tokens->size() - done);
    engine::ForwardTrace trace;
    trace.record_streams = a.streams;
    engine::ForwardOptions o;
    o.all_logits = true;
    o.threads = a.threads;
    o.topk_order = a.order;
    if (a.streams) o.trace = &trace;
    if (!forced.empty()) o.forced_streams = forced.data() + done * L * width;
    Status s = (*fwd)->Forward(&state, std::span<const int32_t>(&(*tokens)[done], n), &part, o);
    if (!s.ok()) return Fail(s.ToString(), kExitFailed);
    logits.insert(logits.end(), part.begin(), part.end());
    for (int64_t l = 0; a.streams && l < L; ++l) {
      for (size_t t = 0; t < n; ++t) {
        std::memcpy(&streams[((done + t) * L + l) * width], &trace.streams[l][t * width],
                    width * sizeof(float));
        for (int64_t k = 0; k < 4; ++k) {
          std::memcpy(&sublayers[(((done + t) * L + l) * 4 + k) * dim],
                      &trace.sublayers[l * 4 + k][t * dim], dim * sizeof(float));
        }
      }
    }
  }
  Status s;
  const std::vector<int64_t> logits_shape = {T, c.vocab_size};
  if (EndsWith(a.out, ".npy")) {
    s = WriteNpy(a.out, logits_shape, logits.data());
  } else {
    auto tensor = [](std::string name, std::vector<int64_t> shape, const std::vector<float>& v) {
      engine::TensorData t{std::move(name), engine::DType::kF32, std::move(shape), {}};
      t.bytes.resize(v.size() * sizeof(float));
      std::memcpy(t.bytes.data(), v.data(), t.bytes.size());
      return t;
    };
    const engine::TensorData lt = tensor("logits", logits_shape, logits);
    std::vector<const engine::TensorData*> out = {&lt};
    engine::TensorData st, sl;
    if (a.streams) {
      st = tensor("streams", {T, L, c.hc_mult, c.hidden_size}, streams);
      sl = tensor("sublayers", {T, L, 4, dim}, sublayers);
      out.push_back(&st);
      out.push_back(&sl);
    }
    s = engine::WriteSafetensors(a.out, out, {{"model", a.model_dir}});
  }
  if (!s.ok()) return Fail(s.ToString(), kExitFailed);
  std::fprintf(stderr, "flashd eval: %lld tokens -> %s\n", static_cast<long long>(T),
               a.out.c_str());
  return kExitOk;
}

}  // namespace

int EvalCommand(const std::vector<std::string>& args) {
  EvalArgs a;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    auto value = [&](std::string* out) {
      if (i + 1 >= args.size()) return false;
      *out = args[++i];
      return true;
    };
    std::string v;
    if (arg == "--help" || arg == "-h") {
      PrintEvalHelp();
      return kExitOk;
    } else if (arg == "--tokens") {
      if (!value(&a.tokens_path)) return Fail("--tokens needs a file");
    } else if (arg == "--out") {
      if (!value(&a.out)) return Fail("--out needs a file");
    } else if (arg == "--forced-streams") {
      if (!value(&a.forced_path)) return Fail("--forced-streams needs a file");
    } else if (arg == "--streams") {
      a.streams = true;
    } else if (arg == "--chunk" || arg == "--threads") {
      if (!value(&v) || v.empty() || v.find_first_not_of("0123456789") != std::string::npos ||
          v.size() > 9 || std::stoi(v) <= 0) {
        return Fail(arg + " needs a positive integer");
      }
      if (arg == "--chunk") a.chunk = std::stoul(v);
      if (arg == "--threads") a.threads = std::stoi(v);
    } else if (arg == "--backend") {
      if (!value(&a.backend) || a.backend == "auto") {
        return Fail("--backend is cpu, cuda, hip or hipcpu");
      }
    } else if (arg == "--gpu-gemms") {
      if (!value(&v) || (v != "exact" && v != "matrix")) {
        return Fail("--gpu-gemms is exact or matrix");
      }
      a.gpu.matrix_gemms = v == "matrix";
    } else if (arg == "--topk-order") {
      if (!value(&v) || (v != "total" && v != "reference")) {
        return Fail("--topk-order is total or reference");
      }
      a.order = v == "total" ? kernels::TopKOrder::kTotal : kernels::TopKOrder::kReference;
    } else if (!arg.empty() && arg[0] == '-') {
      return Fail("unknown option " + arg + " (see flashd eval --help)");
    } else if (a.model_dir.empty()) {
      a.model_dir = arg;
    } else {
      return Fail("unexpected argument " + arg);
    }
  }
  if (a.model_dir.empty()) return Fail("a model directory is needed (see flashd eval --help)");
  if (a.out.empty()) return Fail("--out FILE.npy or FILE.safetensors is needed");
  if (!EndsWith(a.out, ".npy") && !EndsWith(a.out, ".safetensors")) {
    return Fail("--out must end in .npy or .safetensors");
  }
  if (a.streams && EndsWith(a.out, ".npy")) {
    return Fail("--streams needs a .safetensors output (a .npy file holds one array)");
  }
  return Run(a);
}

}  // namespace flashd::daemon
