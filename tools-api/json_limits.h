// Checks on JSON text that comes from outside (request bodies, tool-call arguments) before any
// parser or renderer sees it. nlohmann's parser accepts raw bytes that are not UTF-8 inside
// strings (and throws later, when the value is written out), and every recursive walk over a
// value (copying, dumping, rendering a tool schema) uses one stack frame per nesting level, so a
// body nested 100,000 deep would overflow the stack. Both are refused up front, as client errors.
#pragma once

#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>

namespace flashd::api {

// Deepest nesting of arrays and objects accepted in a request. Tool schemas, the most deeply
// nested thing agents send, stay far below it.
inline constexpr int kMaxJsonDepth = 128;

// Nullopt when `text` is valid UTF-8 and nests at most `max_depth` arrays and objects; otherwise
// what is wrong and at which byte. Cheap (one pass) and never throws; it does not check the JSON
// grammar, which the parser does next.
std::optional<std::string> CheckJsonText(std::string_view text, int max_depth = kMaxJsonDepth);

// True when `text` is well-formed UTF-8 (no overlong forms, surrogates or values past U+10FFFF).
// `bad_at`, when given, receives the offset of the first byte that is not.
bool IsValidUtf8(std::string_view text, size_t* bad_at = nullptr);

// Parses outside JSON text after CheckJsonText; every parse or range error (a number like 1e999)
// becomes the returned message instead of an exception.
template <typename Json>
std::optional<std::string> ParseOutsideJson(std::string_view text, Json* out) {
  if (std::optional<std::string> bad = CheckJsonText(text)) return bad;
  try {
    *out = Json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    return std::string(e.what());
  }
  return std::nullopt;
}

}  // namespace flashd::api
