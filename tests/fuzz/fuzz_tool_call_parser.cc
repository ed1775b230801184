// The parser of the model's output (reasoning, content, DSML tool calls), fed in pieces the way
// tokens arrive. What it emits must be whole UTF-8 where its input was.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "tools-api/chat_parser.h"

using namespace flashd::api;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  ChatOutputParser parser(data[0] & 1);
  const std::string_view text(reinterpret_cast<const char*>(data) + 1, size - 1);
  // Piece lengths from the input itself, 1-8 bytes, as sampled tokens would cut it.
  size_t at = 0, step = 1;
  while (at < text.size()) {
    const size_t n =
        std::min(text.size() - at, 1 + (static_cast<unsigned char>(text[at]) + step) % 8);
    (void)parser.Feed(text.substr(at, n));
    at += n;
    ++step;
  }
  (void)parser.Finish();
  return 0;
}
