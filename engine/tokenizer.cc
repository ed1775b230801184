#include "engine/tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <atomic>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <queue>
#include <sstream>
#include <unordered_map>

namespace flashd::engine {
namespace {

using nlohmann::json;

// GPT-2's byte-level alphabet: byte b is written as the code point ByteChar[b].
struct ByteLevel {
  std::string encoded[256];  // UTF-8 of the code point standing for each byte.
  std::unordered_map<uint32_t, uint8_t> decode;
  ByteLevel() {
    int n = 0;
    for (int b = 0; b < 256; ++b) {
      bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      uint32_t cp = printable ? b : 256 + n++;
      encoded[b] = Utf8(cp);
      decode[cp] = static_cast<uint8_t>(b);
    }
  }
  static std::string Utf8(uint32_t cp) {
    std::string s;
    if (cp < 0x80) {
      s += static_cast<char>(cp);
    } else if (cp < 0x800) {
      s += static_cast<char>(0xC0 | (cp >> 6));
      s += static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      s += static_cast<char>(0xE0 | (cp >> 12));
      s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      s += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
      s += static_cast<char>(0xF0 | (cp >> 18));
      s += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
      s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      s += static_cast<char>(0x80 | (cp & 0x3F));
    }
    return s;
  }
};

const ByteLevel& Bytes() {
  static const ByteLevel b;
  return b;
}

// What a UTF-8 lead byte promises: the character's length (0: not a lead byte) and the range
// its second byte must fall in (narrower than 80..BF after E0, ED, F0 and F4).
struct LeadByte {
  size_t length = 0;
  uint8_t lo = 0x80, hi = 0xBF;
};

LeadByte ClassifyLead(uint8_t c) {
  LeadByte l;
  if (c < 0x80) {
    l.length = 1;
  } else if (c >= 0xC2 && c <= 0xDF) {
    l.length = 2;
  } else if (c >= 0xE0 && c <= 0xEF) {
    l.length = 3;
    if (c == 0xE0) l.lo = 0xA0;
    if (c == 0xED) l.hi = 0x9F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    l.length = 4;
    if (c == 0xF0) l.lo = 0x90;
    if (c == 0xF4) l.hi = 0x8F;
  }
  return l;
}

// How many bytes after the lead at s[i] continue its character correctly (at most length - 1).
size_t ContinuationBytes(std::string_view s, size_t i, const LeadByte& l) {
  size_t k = 1;
  for (; k < l.length && i + k < s.size(); ++k) {
    const uint8_t d = static_cast<uint8_t>(s[i + k]);
    if (k == 1 ? (d < l.lo || d > l.hi) : (d < 0x80 || d > 0xBF)) break;
  }
  return k - 1;
}

// Length of the valid UTF-8 character at s[i], or 0 if the bytes there are not one.
size_t ValidCharLength(std::string_view s, size_t i) {
  const LeadByte l = ClassifyLead(static_cast<uint8_t>(s[i]));
  if (l.length == 0) return 0;
  return ContinuationBytes(s, i, l) == l.length - 1 ? l.length : 0;
}

// Bytes a maximal invalid subpart at s[i] spans (the Unicode recommendation for U+FFFD).
size_t InvalidSpan(std::string_view s, size_t i) {
  const LeadByte l = ClassifyLead(static_cast<uint8_t>(s[i]));
  if (l.length < 2) return 1;
  return 1 + ContinuationBytes(s, i, l);
}

std::atomic<uint64_t> next_instance{1};

struct PairHash {
  size_t operator()(uint64_t v) const { return std::hash<uint64_t>()(v * 0x9E3779B97F4A7C15ULL); }
};

}  // namespace

std::string SanitizeUtf8(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  size_t i = 0;
  while (i < text.size()) {
    size_t n = ValidCharLength(text, i);
    if (n > 0) {
      out.append(text.substr(i, n));
      i += n;
    } else {
      out += "\xEF\xBF\xBD";
      i += InvalidSpan(text, i);
    }
  }
  return out;
}

struct Tokenizer::Impl {
  uint64_t instance = next_instance++;
  std::unordered_map<std::string, int32_t> vocab;
  std::vector<std::string> id_to_token;  // Model tokens in byte-level form; added ones as text.
  std::vector<bool> is_added;
  // Merge of two ids -> (rank, merged id).
  std::unordered_map<uint64_t, std::pair<int32_t, int32_t>, PairHash> merges;
  std::vector<pcre2_code*> splits;  // The Split pre-tokenizers, in order.
  // Added tokens, by text, and a trie over their bytes for leftmost-longest matching.
  std::unordered_map<std::string, int32_t> added;
  struct Node {
    std::map<uint8_t, int> next;
    int32_t id = -1;
  };
  std::vector<Node> trie{Node{}};

  ~Impl() {
    for (pcre2_code* re : splits) pcre2_code_free(re);
  }

  Status AddSplit(const std::string& pattern, const std::string& source) {
    int error = 0;
    PCRE2_SIZE offset = 0;
    pcre2_code* re =
        pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                      PCRE2_UTF | PCRE2_UCP | PCRE2_NO_UTF_CHECK, &error, &offset, nullptr);
    if (re == nullptr) {
      PCRE2_UCHAR message[256];
      pcre2_get_error_message(error, message, sizeof message);
      return InvalidArgument(source + ": pre_tokenizer regex does not compile at offset " +
                             std::to_string(offset) + ": " + reinterpret_cast<char*>(message));
    }
    pcre2_jit_compile(re, PCRE2_JIT_COMPLETE);
    splits.push_back(re);
    return Status::Ok();
  }

  void AddToTrie(const std::string& text, int32_t id) {
    int node = 0;
    for (unsigned char c : text) {
      auto it = trie[node].next.find(c);
      if (it == trie[node].next.end()) {
        trie.push_back(Node{});
        it = trie[node].next.emplace(c, static_cast<int>(trie.size() - 1)).first;
      }
      node = it->second;
    }
    trie[node].id = id;
  }

  // Splits `piece` with regex `level` and the ones after it, appending the pieces to out.
  void PreTokenize(std::string_view piece, size_t level, pcre2_match_data* md,
                   std::vector<std::string_view>* out) const {
    if (level == splits.size()) {
      out->push_back(piece);
      return;
    }
    size_t last = 0, start = 0;
    while (start < piece.size()) {
      int rc = pcre2_match(splits[level], reinterpret_cast<PCRE2_SPTR>(piece.data()), piece.size(),
                           start, PCRE2_NO_UTF_CHECK, md, nullptr);
      if (rc < 0) break;
      PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
      size_t s = ov[0], e = ov[1];
      if (e == s) {  // An empty match: move on by one character.
        start = s + 1;
        while (start < piece.size() && (static_cast<uint8_t>(piece[start]) & 0xC0) == 0x80) ++start;
        continue;
      }
      if (s > last) PreTokenize(piece.substr(last, s - last), level + 1, md, out);
      PreTokenize(piece.substr(s, e - s), level + 1, md, out);
      last = start = e;
    }
    if (last < piece.size()) PreTokenize(piece.substr(last), level + 1, md, out);
  }

  // BPE over one pre-tokenized piece: merges the adjacent pair of lowest rank until none is left.
  void Bpe(std::string_view piece, std::vector<int32_t>* out) const {
    struct Sym {
      int32_t id;
      int prev, next;
    };
    std::vector<Sym> syms;
    const ByteLevel& bl = Bytes();
    for (unsigned char c : piece) {
      auto it = vocab.find(bl.encoded[c]);
      syms.push_back({it == vocab.end() ? -1 : it->second, static_cast<int>(syms.size()) - 1,
                      static_cast<int>(syms.size()) + 1});
    }
    if (syms.empty()) return;
    syms.back().next = -1;
    struct Cand {
      int32_t rank;
      int pos;
      int32_t left, right;
      bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
    };
    std::priority_queue<Cand, std::vector<Cand>, std::greater<Cand>> heap;
    auto push = [&](int pos) {
      const int nx = syms[pos].next;
      if (nx < 0 || syms[pos].id < 0 || syms[nx].id < 0) return;
      auto it = merges.find((uint64_t(uint32_t(syms[pos].id)) << 32) | uint32_t(syms[nx].id));
      if (it != merges.end()) heap.push({it->second.first, pos, syms[pos].id, syms[nx].id});
    };
    for (int i = 0; i + 1 < static_cast<int>(syms.size()); ++i) push(i);
    while (!heap.empty()) {
      Cand c = heap.top();
      heap.pop();
      Sym& left = syms[c.pos];
      if (left.id != c.left || left.next < 0 || syms[left.next].id != c.right) continue;
      const int gone = left.next;
      left.id = merges.at((uint64_t(uint32_t(c.left)) << 32) | uint32_t(c.right)).second;
      left.next = syms[gone].next;
      if (left.next >= 0) syms[left.next].prev = c.pos;
      syms[gone].id = -2;  // Removed.
      if (left.prev >= 0) push(left.prev);
      push(c.pos);
    }
    for (int i = 0; i >= 0; i = syms[i].next) {
      if (syms[i].id >= 0) out->push_back(syms[i].id);
    }
  }

  void EncodePlain(std::string_view text, std::vector<int32_t>* out) const {
    // Per-thread caches of whole pieces, keyed by tokenizer instance.
    thread_local std::unordered_map<uint64_t, std::unordered_map<std::string, std::vector<int32_t>>>
        caches;
    // Freed when the thread ends (HTTP workers come and go).
    thread_local std::unique_ptr<pcre2_match_data, decltype(&pcre2_match_data_free)> owned(
        pcre2_match_data_create(4, nullptr), &pcre2_match_data_free);
    pcre2_match_data* md = owned.get();
    auto& cache = caches[instance];
    if (cache.size() > 200000) cache.clear();
    std::vector<std::string_view> pieces;
    PreTokenize(text, 0, md, &pieces);
    for (std::string_view piece : pieces) {
      auto it = cache.find(std::string(piece));
      if (it == cache.end()) {
        std::vector<int32_t> ids;
        Bpe(piece, &ids);
        it = cache.emplace(std::string(piece), std::move(ids)).first;
      }
      out->insert(out->end(), it->second.begin(), it->second.end());
    }
  }
};

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::~Tokenizer() = default;

StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::Load(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return NotFound(path + ": cannot read tokenizer.json");
  std::stringstream ss;
  ss << in.rdbuf();
  return FromJson(ss.str(), path);
}

StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromJson(std::string_view text,
                                                         const std::string& source) {
  auto impl = std::make_unique<Impl>();
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    return DataLoss(source + ": not valid JSON: " + e.what());
  }
  try {
    const json& model = j.at("model");
    if (model.value("type", "") != "BPE") {
      return InvalidArgument(source + ": model.type \"" + model.value("type", "") +
                             "\" is not supported (BPE only)");
    }
    if (model.value("byte_fallback", false)) {
      return InvalidArgument(source + ": model.byte_fallback is not supported");
    }
    int32_t max_id = -1;
    for (auto it = model.at("vocab").begin(); it != model.at("vocab").end(); ++it) {
      int32_t id = it.value().get<int32_t>();
      impl->vocab[it.key()] = id;
      max_id = std::max(max_id, id);
    }
    std::vector<std::pair<int32_t, std::string>> added_list;
    if (j.contains("added_tokens")) {
      for (const json& t : j["added_tokens"]) {
        added_list.push_back({t.at("id").get<int32_t>(), t.at("content").get<std::string>()});
        max_id = std::max(max_id, added_list.back().first);
      }
    }
    impl->id_to_token.assign(max_id + 1, std::string());
    impl->is_added.assign(max_id + 1, false);
    for (const auto& [token, id] : impl->vocab) impl->id_to_token[id] = token;
    for (const auto& [id, content] : added_list) {
      impl->id_to_token[id] = content;
      impl->is_added[id] = true;
      impl->added[content] = id;
      impl->AddToTrie(content, id);
    }
    int32_t rank = 0;
    for (const json& m : model.at("merges")) {
      std::string a, b;
      if (m.is_string()) {
        const std::string s = m.get<std::string>();
        const size_t sp = s.find(' ');
        if (sp == std::string::npos) return DataLoss(source + ": merge \"" + s + "\" has no space");
        a = s.substr(0, sp);
        b = s.substr(sp + 1);
      } else {
        a = m.at(0).get<std::string>();
        b = m.at(1).get<std::string>();
      }
      auto ia = impl->vocab.find(a), ib = impl->vocab.find(b), im = impl->vocab.find(a + b);
      if (ia == impl->vocab.end() || ib == impl->vocab.end() || im == impl->vocab.end()) {
        return DataLoss(source + ": merge \"" + a + " " + b + "\" names a token not in the vocab");
      }
      impl->merges.emplace((uint64_t(uint32_t(ia->second)) << 32) | uint32_t(ib->second),
                           std::make_pair(rank++, im->second));
    }
    // Pre-tokenizers: Split regexes (isolated) then the byte-level mapping.
    std::vector<json> pre;
    if (j.contains("pre_tokenizer") && !j["pre_tokenizer"].is_null()) {
      const json& p = j["pre_tokenizer"];
      if (p.value("type", "") == "Sequence") {
        for (const json& x : p.at("pretokenizers")) pre.push_back(x);
      } else {
        pre.push_back(p);
      }
    }
    for (const json& p : pre) {
      const std::string type = p.value("type", "");
      if (type == "Split") {
        if (p.value("behavior", "") != "Isolated" || p.value("invert", false)) {
          return InvalidArgument(source +
                                 ": only Isolated, non-inverted Split pre-tokenizers are "
                                 "supported");
        }
        const json& pat = p.at("pattern");
        std::string regex = pat.contains("Regex") ? pat["Regex"].get<std::string>() : std::string();
        if (pat.contains("String")) {
          for (char ch : pat["String"].get<std::string>()) {
            if (std::string("\\^$.|?*+()[]{}").find(ch) != std::string::npos) regex += '\\';
            regex += ch;
          }
        }
        FLASHD_RETURN_IF_ERROR(impl->AddSplit(regex, source));
      } else if (type == "ByteLevel") {
        if (p.value("use_regex", true)) {
          FLASHD_RETURN_IF_ERROR(impl->AddSplit(
              R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)",
              source));
        }
        if (p.value("add_prefix_space", false)) {
          return InvalidArgument(source + ": ByteLevel add_prefix_space is not supported");
        }
      } else {
        return InvalidArgument(source + ": pre_tokenizer type \"" + type + "\" is not supported");
      }
    }
    if (j.contains("normalizer") && !j["normalizer"].is_null()) {
      const json& n = j["normalizer"];
      if (!(n.value("type", "") == "Sequence" && n.value("normalizers", json::array()).empty())) {
        return InvalidArgument(source + ": normalizers are not supported");
      }
    }
  } catch (const json::exception& e) {
    return DataLoss(source + ": unexpected tokenizer.json layout: " + e.what());
  }
  return std::unique_ptr<Tokenizer>(new Tokenizer(std::move(impl)));
}

std::vector<int32_t> Tokenizer::Encode(std::string_view raw, bool allow_added) const {
  if (allow_added) return EncodeWithPlainRanges(raw, {});
  std::vector<int32_t> out;
  impl_->EncodePlain(SanitizeUtf8(raw), &out);
  return out;
}

std::vector<int32_t> Tokenizer::EncodeWithPlainRanges(
    std::string_view raw, const std::vector<std::pair<size_t, size_t>>& plain) const {
  return EncodeWithPlainRanges(raw, plain, {}, nullptr);
}

std::vector<int32_t> Tokenizer::EncodeWithPlainRanges(
    std::string_view raw, const std::vector<std::pair<size_t, size_t>>& plain,
    const std::vector<size_t>& marks, std::vector<int64_t>* mark_tokens) const {
  // Sanitising can change byte offsets; the ranges refer to valid UTF-8, which it leaves alone.
  const std::string text = SanitizeUtf8(raw);
  std::vector<int32_t> out;
  out.reserve(text.size() / 3);
  if (mark_tokens != nullptr) mark_tokens->assign(marks.size(), -1);
  size_t next_mark = 0;
  // Encodes the run of text [from, to) between added tokens. A mark inside it has a token
  // position when the run's tokens split there: encoding the two halves apart gives the same
  // ids (true at most boundaries the pre-tokenizer cuts anyway, such as before a line's text).
  const auto run = [&](size_t from, size_t to) {
    const std::string_view t = std::string_view(text).substr(from, to - from);
    if (mark_tokens == nullptr || next_mark >= marks.size() || marks[next_mark] >= to) {
      if (!t.empty()) impl_->EncodePlain(t, &out);
      return;
    }
    std::vector<int32_t> whole;
    impl_->EncodePlain(t, &whole);
    for (; next_mark < marks.size() && marks[next_mark] < to; ++next_mark) {
      const size_t m = marks[next_mark];
      if (m < from) continue;
      if (m == from) {
        (*mark_tokens)[next_mark] = static_cast<int64_t>(out.size());
        continue;
      }
      std::vector<int32_t> head, tail;
      impl_->EncodePlain(t.substr(0, m - from), &head);
      impl_->EncodePlain(t.substr(m - from), &tail);
      if (head.size() + tail.size() == whole.size() &&
          std::equal(head.begin(), head.end(), whole.begin()) &&
          std::equal(tail.begin(), tail.end(), whole.begin() + static_cast<long>(head.size()))) {
        (*mark_tokens)[next_mark] = static_cast<int64_t>(out.size() + head.size());
      }
    }
    out.insert(out.end(), whole.begin(), whole.end());
  };
  // Marks at `at`, where an added token begins or the text ends.
  const auto settle = [&](size_t at) {
    if (mark_tokens == nullptr) return;
    while (next_mark < marks.size() && marks[next_mark] <= at) {
      if (marks[next_mark] == at) (*mark_tokens)[next_mark] = static_cast<int64_t>(out.size());
      ++next_mark;
    }
  };
  size_t last = 0, i = 0, next_plain = 0;
  const auto& trie = impl_->trie;
  while (i < text.size()) {
    while (next_plain < plain.size() && plain[next_plain].second <= i) ++next_plain;
    if (next_plain < plain.size() && plain[next_plain].first <= i) {
      i = plain[next_plain].second;  // No added token starts inside client text.
      continue;
    }
    const size_t limit = next_plain < plain.size() ? plain[next_plain].first : text.size();
    // The longest added token starting at i that ends before the next plain range.
    int node = 0;
    int32_t found = -1;
    size_t found_len = 0;
    for (size_t k = i; k < limit; ++k) {
      auto it = trie[node].next.find(static_cast<uint8_t>(text[k]));
      if (it == trie[node].next.end()) break;
      node = it->second;
      if (trie[node].id >= 0) {
        found = trie[node].id;
        found_len = k - i + 1;
      }
    }
    if (found < 0) {
      ++i;
      continue;
    }
    run(last, i);
    settle(i);
    out.push_back(found);
    i += found_len;
    last = i;
  }
  run(last, text.size());
  settle(text.size());
  return out;
}

std::string Tokenizer::Decode(std::span<const int32_t> ids) const {
  std::string out;
  const ByteLevel& bl = Bytes();
  for (int32_t id : ids) {
    if (id < 0 || static_cast<size_t>(id) >= impl_->id_to_token.size()) continue;
    const std::string& token = impl_->id_to_token[id];
    if (impl_->is_added[id]) {
      out += token;
      continue;
    }
    // Each code point of a model token stands for one byte.
    for (size_t k = 0; k < token.size();) {
      uint32_t cp;
      unsigned char c = static_cast<unsigned char>(token[k]);
      size_t n = c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
      cp = n == 1 ? c : n == 2 ? (c & 0x1F) : n == 3 ? (c & 0x0F) : (c & 0x07);
      for (size_t m = 1; m < n && k + m < token.size(); ++m) {
        cp = (cp << 6) | (static_cast<unsigned char>(token[k + m]) & 0x3F);
      }
      auto it = bl.decode.find(cp);
      if (it != bl.decode.end()) {
        out += static_cast<char>(it->second);
      } else {
        out.append(token, k, n);
      }
      k += n;
    }
  }
  return out;
}

int32_t Tokenizer::TokenId(std::string_view text) const {
  auto it = impl_->added.find(std::string(text));
  return it == impl_->added.end() ? -1 : it->second;
}

size_t Tokenizer::size() const { return impl_->id_to_token.size(); }

std::string StreamDecoder::Push(int32_t id) {
  pending_ += tokenizer_->Decode(std::span<const int32_t>(&id, 1));
  // Emit everything up to the last position where a complete character ends.
  size_t i = 0, emit = 0;
  while (i < pending_.size()) {
    size_t n = ValidCharLength(pending_, i);
    if (n > 0) {
      i += n;
      emit = i;
      continue;
    }
    // An incomplete character at the end waits; an invalid one is passed on as U+FFFD.
    const size_t span = InvalidSpan(pending_, i);
    if (i + span >= pending_.size()) break;
    i += span;
    emit = i;
  }
  std::string out = SanitizeUtf8(std::string_view(pending_).substr(0, emit));
  pending_.erase(0, emit);
  return out;
}

std::string StreamDecoder::Finish() {
  std::string out = SanitizeUtf8(pending_);
  pending_.clear();
  return out;
}

}  // namespace flashd::engine
