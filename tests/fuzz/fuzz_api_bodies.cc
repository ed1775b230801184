// Request bodies of the routes that speak another API: the outside-JSON checks, then the
// Anthropic Messages and OpenAI Responses translations into a chat body, then its rendering.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "tools-api/chat_common.h"
#include "tools-api/chat_format.h"
#include "tools-api/json_limits.h"

using namespace flashd::api;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string_view text(reinterpret_cast<const char*>(data) + 1, size - 1);
  ojson body;
  if (ParseOutsideJson(text, &body) || !body.is_object()) return 0;
  // A field of an unexpected type that no check caught throws nlohmann's type_error, which the
  // daemon answers as a 400 (Api::Install's exception handler): not a finding. Anything else
  // that escapes is.
  try {
    ojson chat;
    std::optional<chat::FieldError> e = data[0] % 3 == 0 ? chat::AnthropicToChat(body, true, &chat)
                                        : data[0] % 3 == 1
                                            ? chat::AnthropicToChat(body, false, &chat)
                                            : chat::ResponsesToChat(body, &chat);
    if (e || !chat.contains("messages")) return 0;
    ChatOptions options;
    options.thinking = data[0] & 4;
    (void)RenderChat(chat["messages"], options, nullptr);
    (void)chat.dump(-1, ' ', false, ojson::error_handler_t::replace);
  } catch (const nlohmann::json::type_error&) {
  } catch (const nlohmann::json::out_of_range&) {
  }
  return 0;
}
