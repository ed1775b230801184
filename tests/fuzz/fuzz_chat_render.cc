// The chat renderer and the tokenizer on what a client controls: messages, tool schemas, tool
// calls and their arguments, then the rendered prompt tokenized with client text kept plain.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string_view>

#include "engine/tokenizer.h"
#include "tests/fuzz/golden_tokenizer.h"
#include "tools-api/chat_format.h"
#include "tools-api/json_limits.h"

using namespace flashd;
using namespace flashd::api;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string_view text(reinterpret_cast<const char*>(data) + 1, size - 1);
  ojson messages;
  if (ParseOutsideJson(text, &messages)) return 0;
  ChatOptions o;
  o.thinking = data[0] & 1;
  o.drop_thinking = data[0] & 2;
  if (data[0] & 4) o.reasoning_effort = data[0] >> 3;
  ToolCallLedger ledger;
  ledger.Remember("call_known", "<｜DSML｜ invoke name=\"f\">\n</｜DSML｜ invoke>");
  try {
    StatusOr<RenderedPrompt> r = RenderChat(messages, o, &ledger);
    if (!r.ok()) return 0;
    const std::vector<int32_t> ids =
        flashd::fuzz::GoldenTokenizer().EncodeWithPlainRanges(r->text, r->untrusted);
    (void)flashd::fuzz::GoldenTokenizer().Decode(ids);
  } catch (const nlohmann::json::type_error&) {
    // Answered 400 by the daemon's exception handler.
  }
  return 0;
}
