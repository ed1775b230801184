// The tokenizer on arbitrary bytes (invalid UTF-8, special-token text, long runs), both with
// added tokens recognised and as plain client text; decoding any ids back, whole and streamed.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string_view>

#include "engine/tokenizer.h"
#include "tests/fuzz/golden_tokenizer.h"

using namespace flashd::engine;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string_view text(reinterpret_cast<const char*>(data) + 1, size - 1);
  const std::vector<int32_t> ids = flashd::fuzz::GoldenTokenizer().Encode(text, data[0] & 1);
  const std::vector<std::pair<size_t, size_t>> plain = {{0, text.size() / 2}};
  (void)flashd::fuzz::GoldenTokenizer().EncodeWithPlainRanges(text, plain);
  (void)flashd::fuzz::GoldenTokenizer().Decode(ids);
  // Ids from the bytes themselves, some out of range.
  std::vector<int32_t> raw;
  for (size_t i = 0; i + 1 < size; i += 2) raw.push_back((data[i] << 8 | data[i + 1]) - 2000);
  (void)flashd::fuzz::GoldenTokenizer().Decode(raw);
  StreamDecoder stream(&flashd::fuzz::GoldenTokenizer());
  for (int32_t id : raw) (void)stream.Push(id);
  (void)stream.Finish();
  (void)SanitizeUtf8(text);
  return 0;
}
