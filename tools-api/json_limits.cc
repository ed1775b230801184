#include "tools-api/json_limits.h"

namespace flashd::api {

bool IsValidUtf8(std::string_view text, size_t* bad_at) {
  const auto* s = reinterpret_cast<const unsigned char*>(text.data());
  const size_t n = text.size();
  size_t i = 0;
  while (i < n) {
    const unsigned char c = s[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    size_t len = 0;
    uint32_t cp = 0;
    if (c >= 0xC2 && c <= 0xDF) {
      len = 2;
      cp = c & 0x1F;
    } else if (c >= 0xE0 && c <= 0xEF) {
      len = 3;
      cp = c & 0x0F;
    } else if (c >= 0xF0 && c <= 0xF4) {
      len = 4;
      cp = c & 0x07;
    } else {
      if (bad_at) *bad_at = i;
      return false;
    }
    if (i + len > n) {
      if (bad_at) *bad_at = i;
      return false;
    }
    for (size_t k = 1; k < len; ++k) {
      if ((s[i + k] & 0xC0) != 0x80) {
        if (bad_at) *bad_at = i;
        return false;
      }
      cp = (cp << 6) | (s[i + k] & 0x3F);
    }
    const bool overlong = (len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000);
    if (overlong || (cp >= 0xD800 && cp <= 0xDFFF) || cp > 0x10FFFF) {
      if (bad_at) *bad_at = i;
      return false;
    }
    i += len;
  }
  return true;
}

std::optional<std::string> CheckJsonText(std::string_view text, int max_depth) {
  size_t bad = 0;
  if (!IsValidUtf8(text, &bad)) {
    return "invalid UTF-8 at byte " + std::to_string(bad) + " (JSON text must be UTF-8)";
  }
  int depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') {
        ++i;  // The escaped character cannot end the string.
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > max_depth) {
        return "JSON nested deeper than " + std::to_string(max_depth) + " levels at byte " +
               std::to_string(i);
      }
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return std::nullopt;
}

}  // namespace flashd::api
