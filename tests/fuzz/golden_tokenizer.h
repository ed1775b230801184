// The golden model's tokenizer (tests/golden), loaded once per fuzz process.
#pragma once

#include <memory>

#include "engine/tokenizer.h"

namespace flashd::fuzz {

inline const engine::Tokenizer& GoldenTokenizer() {
  static std::unique_ptr<engine::Tokenizer> t = [] {
    auto loaded = engine::Tokenizer::Load(FLASHD_GOLDEN_DIR "/tokenizer.json");
    if (!loaded.ok()) __builtin_trap();
    return std::move(*loaded);
  }();
  return *t;
}

}  // namespace flashd::fuzz
