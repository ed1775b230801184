// Engram's n-gram hashing: which table rows each token reads.
//
// Token ids are first mapped to compressed classes: every token's decoded text is normalised
// (NFKC, NFD, accents stripped, lowercase, whitespace runs collapsed, trimmed) and ids whose text
// normalises alike share a class. Then, for each Engram layer, n = 2..max_ngram_size and each
// head, the last n classes are combined with a multiply-XOR hash into that (n, head)'s
// prime-sized bucket range of the layer's table.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "config/status.h"
#include "engine/model_config.h"

namespace flashd::engine {

struct CompressedVocab {
  std::vector<int32_t> class_of;  // Token id -> class.
  int64_t classes = 0;
};

// Builds the class map from a Hugging Face tokenizer.json (byte-level BPE: vocab and added
// tokens), as the reference does with the tokenizers library's normalizers. Normalisation uses
// utf8proc.
StatusOr<CompressedVocab> BuildCompressedVocab(const std::string& tokenizer_json_path);

// The normalisation of one token's text (exposed for tests).
std::string NormalizeForEngram(const std::string& text);

class EngramHasher {
 public:
  // REQUIRES: config validated; vocab.classes == config.engram_compressed_vocab_size.
  EngramHasher(const ModelConfig& config, CompressedVocab vocab);

  int columns() const { return columns_; }  // (max_ngram_size - 1) * n_heads
  int history() const { return max_ngram_ - 1; }
  int32_t ClassOf(int32_t token) const;

  // Row ids for one position, for every Engram layer: out[layer * columns + col].
  // `classes` holds the classes of the last max_ngram_size tokens, newest last, with fewer
  // entries at the start of a sequence.
  void Hash(const int32_t* classes, int count, int64_t* out) const;

  const std::vector<std::vector<int64_t>>& multipliers() const { return multipliers_; }

 private:
  int max_ngram_;
  int heads_;
  int columns_;
  int32_t pad_class_;
  CompressedVocab vocab_;
  std::vector<std::vector<int64_t>> multipliers_;  // [layer][shift]
  std::vector<std::vector<int64_t>> primes_;       // [layer][col]
  std::vector<std::vector<int64_t>> offsets_;      // [layer][col]
};

}  // namespace flashd::engine
