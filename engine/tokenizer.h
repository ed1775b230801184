// Tokenizer: Hugging Face tokenizer.json files of DeepSeek's kind (byte-level BPE with merges, a
// Sequence of Split pre-tokenizers with Unicode-class regexes, and added/special tokens),
// encoding and decoding exactly as the `tokenizers` library does.
//
// Encode first cuts the text at added tokens (leftmost, longest match), then splits the rest with
// the regexes (PCRE2, with Unicode classes), maps bytes to the byte-level alphabet, and applies
// BPE merges by rank. Invalid UTF-8 in the input is replaced by U+FFFD first, as a string the
// library could be given would be. Thread-safe after Load(): the word cache is per thread.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "config/status.h"

namespace flashd::engine {

class Tokenizer {
 public:
  static StatusOr<std::unique_ptr<Tokenizer>> Load(const std::string& tokenizer_json_path);
  static StatusOr<std::unique_ptr<Tokenizer>> FromJson(std::string_view json_text,
                                                       const std::string& source);
  ~Tokenizer();

  // `allow_added` false treats the text of added and special tokens as plain text (what the
  // chat renderer does with user-supplied content, so that "<｜Assistant｜>" typed by a user
  // cannot open a turn).
  std::vector<int32_t> Encode(std::string_view text, bool allow_added = true) const;

  // Encodes `text` recognising added tokens everywhere except inside `plain` (sorted,
  // non-overlapping byte ranges [begin, end), e.g. the client-supplied parts of a rendered
  // chat). Text is tokenized as one string, so the ids equal Encode(text) wherever no added
  // token's text appears inside a plain range.
  std::vector<int32_t> EncodeWithPlainRanges(
      std::string_view text, const std::vector<std::pair<size_t, size_t>>& plain) const;
  // The same, also saying for each of `marks` (sorted byte offsets of `text`) the index of the
  // token that starts there, in `mark_tokens`, or -1 where no token starts there (a token
  // straddles the offset). Costs one more encoding of each run of text holding a mark.
  std::vector<int32_t> EncodeWithPlainRanges(std::string_view text,
                                             const std::vector<std::pair<size_t, size_t>>& plain,
                                             const std::vector<size_t>& marks,
                                             std::vector<int64_t>* mark_tokens) const;

  // The bytes of the tokens, concatenated (added tokens as their text). Unknown ids are skipped.
  std::string Decode(std::span<const int32_t> ids) const;

  // The id of an added or special token's exact text, or -1.
  int32_t TokenId(std::string_view text) const;
  // Number of ids (model vocabulary and added tokens).
  size_t size() const;

 private:
  struct Impl;
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Turns a stream of ids into text without ever emitting part of a UTF-8 character: bytes of a
// character split across tokens wait until the character is complete.
class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer* tokenizer) : tokenizer_(tokenizer) {}
  // The text that became complete with this token (possibly empty).
  std::string Push(int32_t id);
  // Whatever is left at the end, with incomplete characters as U+FFFD.
  std::string Finish();

 private:
  const Tokenizer* tokenizer_;
  std::string pending_;
};

// Replaces each invalid UTF-8 sequence with U+FFFD (one per maximal invalid subpart).
std::string SanitizeUtf8(std::string_view text);

}  // namespace flashd::engine
