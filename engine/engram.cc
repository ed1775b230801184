#include "engine/engram.h"

#include <utf8proc.h>

#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <unordered_map>

#include "engine/numpy_rng.h"

namespace flashd::engine {
namespace {

using nlohmann::json;

// GPT-2's byte-level alphabet: byte b is written as the code point ByteChar(b).
std::vector<int32_t> ByteLevelAlphabet() {
  std::vector<int32_t> chars(256);
  int n = 0;
  for (int b = 0; b < 256; ++b) {
    bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
    chars[b] = printable ? b : 256 + n++;
  }
  return chars;
}

std::vector<int32_t> DecodeUtf8(const std::string& s) {
  std::vector<int32_t> out;
  const auto* p = reinterpret_cast<const utf8proc_uint8_t*>(s.data());
  utf8proc_ssize_t len = static_cast<utf8proc_ssize_t>(s.size());
  while (len > 0) {
    utf8proc_int32_t cp;
    utf8proc_ssize_t n = utf8proc_iterate(p, len, &cp);
    if (n <= 0) {
      out.push_back(0xFFFD);
      n = 1;
    } else {
      out.push_back(cp);
    }
    p += n;
    len -= n;
  }
  return out;
}

std::string EncodeUtf8(const std::vector<int32_t>& cps) {
  std::string out;
  for (int32_t cp : cps) {
    utf8proc_uint8_t buf[4];
    utf8proc_ssize_t n = utf8proc_encode_char(cp, buf);
    out.append(reinterpret_cast<char*>(buf), static_cast<size_t>(n));
  }
  return out;
}

std::string Map(const std::string& s, int options) {
  utf8proc_uint8_t* out = nullptr;
  utf8proc_ssize_t n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(s.data()),
                                    static_cast<utf8proc_ssize_t>(s.size()), &out,
                                    static_cast<utf8proc_option_t>(options));
  if (n < 0) return s;
  std::string r(reinterpret_cast<char*>(out), static_cast<size_t>(n));
  std::free(out);
  return r;
}

bool IsWhiteSpace(int32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F ||
         c == 0x3000;
}

bool IsMark(int32_t c) {
  utf8proc_category_t cat = utf8proc_category(c);
  return cat == UTF8PROC_CATEGORY_MN || cat == UTF8PROC_CATEGORY_MC || cat == UTF8PROC_CATEGORY_ME;
}

// Decodes one token's string as the byte-level decoder does: each character through the byte
// alphabet, or the token's own UTF-8 when a character is outside it; invalid UTF-8 becomes
// U+FFFD.
std::string DecodeToken(const std::string& token, const std::unordered_map<int32_t, int>& byte_of) {
  std::string bytes;
  for (int32_t cp : DecodeUtf8(token)) {
    auto it = byte_of.find(cp);
    if (it == byte_of.end()) {
      bytes = token;
      break;
    }
    bytes.push_back(static_cast<char>(it->second));
  }
  return EncodeUtf8(DecodeUtf8(bytes));
}

}  // namespace

std::string NormalizeForEngram(const std::string& text) {
  std::string s = Map(text, UTF8PROC_STABLE | UTF8PROC_COMPOSE | UTF8PROC_COMPAT);  // NFKC
  s = Map(s, UTF8PROC_STABLE | UTF8PROC_DECOMPOSE);                                 // NFD
  std::vector<int32_t> cps;
  bool in_space_run = false;
  for (int32_t c : DecodeUtf8(s)) {
    if (IsMark(c)) continue;  // Strip accents.
    c = utf8proc_tolower(c);
    if (c == ' ' || c == '\t' || c == '\r' || c == '\n') {
      if (!in_space_run) cps.push_back(' ');
      in_space_run = true;
      continue;
    }
    in_space_run = false;
    cps.push_back(c);
  }
  // A text that is exactly one space survives the trim (the reference protects it).
  if (cps.size() == 1 && cps[0] == ' ') return " ";
  size_t begin = 0, end = cps.size();
  while (begin < end && IsWhiteSpace(cps[begin])) ++begin;
  while (end > begin && IsWhiteSpace(cps[end - 1])) --end;
  return EncodeUtf8(std::vector<int32_t>(cps.begin() + begin, cps.begin() + end));
}

StatusOr<CompressedVocab> BuildCompressedVocab(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return NotFound(path + ": cannot read tokenizer.json");
  std::stringstream ss;
  ss << in.rdbuf();
  json j;
  try {
    j = json::parse(ss.str());
  } catch (const json::exception& e) {
    return DataLoss(path + ": not valid JSON: " + e.what());
  }
  if (!j.contains("model") || !j["model"].contains("vocab") || !j["model"]["vocab"].is_object()) {
    return InvalidArgument(path + ": model.vocab missing (a byte-level BPE tokenizer is expected)");
  }
  std::map<int64_t, std::string> id_to_token;
  std::map<int64_t, bool> added;
  for (auto it = j["model"]["vocab"].begin(); it != j["model"]["vocab"].end(); ++it) {
    id_to_token[it.value().get<int64_t>()] = it.key();
  }
  if (j.contains("added_tokens") && j["added_tokens"].is_array()) {
    for (const json& t : j["added_tokens"]) {
      int64_t id = t.at("id").get<int64_t>();
      id_to_token[id] = t.at("content").get<std::string>();
      added[id] = true;
    }
  }
  if (id_to_token.empty()) return InvalidArgument(path + ": empty vocabulary");
  const int64_t size = id_to_token.rbegin()->first + 1;
  std::unordered_map<int32_t, int> byte_of;
  std::vector<int32_t> alphabet = ByteLevelAlphabet();
  for (int b = 0; b < 256; ++b) byte_of[alphabet[b]] = b;

  CompressedVocab v;
  v.class_of.assign(static_cast<size_t>(size), 0);
  std::unordered_map<std::string, int32_t> classes;
  for (int64_t id = 0; id < size; ++id) {
    auto it = id_to_token.find(id);
    std::string token = it == id_to_token.end() ? std::string() : it->second;
    std::string text = DecodeToken(token, byte_of);
    std::string key;
    if (text.find("\xEF\xBF\xBD") != std::string::npos) {
      key = token;  // A partial UTF-8 byte token: keyed by its raw form.
    } else {
      std::string normalized = NormalizeForEngram(text);
      key = normalized.empty() ? text : normalized;
    }
    auto [pos, inserted] = classes.emplace(key, static_cast<int32_t>(classes.size()));
    v.class_of[static_cast<size_t>(id)] = pos->second;
  }
  v.classes = static_cast<int64_t>(classes.size());
  return v;
}

EngramHasher::EngramHasher(const ModelConfig& c, CompressedVocab vocab)
    : max_ngram_(c.engram_max_ngram_size),
      heads_(c.engram_n_heads),
      columns_(static_cast<int>(c.engram_hash_columns())),
      vocab_(std::move(vocab)) {
  pad_class_ = ClassOf(static_cast<int32_t>(c.engram_pad_token_id));
  multipliers_ = EngramMultipliers(c.engram_layer_ids, max_ngram_, vocab_.classes);
  for (const auto& layer : c.engram_primes) {
    std::vector<int64_t> primes, offsets;
    int64_t offset = 0;
    for (const auto& per_n : layer) {
      for (int64_t p : per_n) {
        primes.push_back(p);
        offsets.push_back(offset);
        offset += p;
      }
    }
    primes_.push_back(std::move(primes));
    offsets_.push_back(std::move(offsets));
  }
}

int32_t EngramHasher::ClassOf(int32_t token) const {
  if (token < 0 || static_cast<size_t>(token) >= vocab_.class_of.size()) return pad_class_;
  return vocab_.class_of[static_cast<size_t>(token)];
}

void EngramHasher::Hash(const int32_t* classes, int count, int64_t* out) const {
  for (size_t layer = 0; layer < multipliers_.size(); ++layer) {
    const std::vector<int64_t>& mult = multipliers_[layer];
    int64_t rolling = 0;
    for (int shift = 0; shift < max_ngram_; ++shift) {
      const int64_t cls = shift < count ? classes[count - 1 - shift] : pad_class_;
      const int64_t product = cls * mult[shift];
      rolling = shift == 0 ? product : (rolling ^ product);
      if (shift == 0) continue;
      for (int h = 0; h < heads_; ++h) {
        const int col = (shift - 1) * heads_ + h;
        out[layer * columns_ + col] = rolling % primes_[layer][col] + offsets_[layer][col];
      }
    }
  }
}

}  // namespace flashd::engine
