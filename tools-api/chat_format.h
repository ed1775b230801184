// The chat format DeepSeek-V4.1 was trained on: messages, tool definitions, tool calls, tool
// results and thinking modes rendered into prompt text, and model output parsed back.
//
// Rendering follows the release's encoder byte for byte (docs/chat-format.md describes the
// format and where a later turn does not extend an earlier one). What a client supplied (message
// text, tool schemas, arguments, results) is marked untrusted in the result, so the tokenizer
// can encode it with special-token matching off: a user who types "<｜Assistant｜>" gets plain
// text, not a turn boundary.
#pragma once

#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "config/status.h"

namespace flashd::api {

using ojson = nlohmann::ordered_json;

struct ChatOptions {
  bool thinking = false;  // "thinking" mode; false is "chat" (non-think).
  // Reasoning effort in thinking mode: 1-100, or low/high/xhigh/max (25/50/75/100).
  ojson reasoning_effort = nullptr;  // null: the default, "high".
  bool drop_thinking = true;         // Drop the reasoning of turns before the last user turn.
  bool add_bos = true;
};

struct RenderedPrompt {
  std::string text;
  // Byte ranges [begin, end) of text that came from the client.
  std::vector<std::pair<size_t, size_t>> untrusted;
  // Byte offsets where later prompts of the same client are likely to part from this one, so a
  // state snapshot there saves them a replay: the end of each leading system message (the
  // system prompt and tool definitions every session of a client shares; a second one holds
  // per-session lines, tools/messages.cc) and of the first message after them and of each
  // part of it (per-session context that a session's subagents and compacted continuation
  // share: consecutive user messages render as one turn).
  std::vector<size_t> divergence_points;
};

// Exact replay of sampled tool calls: the daemon remembers, by call id, the DSML text the model
// wrote for each call, and renders that text when a client sends the call back, so that the
// client's re-serialisation of the arguments cannot change the prompt's bytes.
// Thread-safe.
//
// In memory it keeps the newest kMemoryCalls calls; with a store attached (the catalog) every
// call is also written there and a lookup the memory misses reads it, so replay survives
// restarts and a long-running daemon's memory stays bounded.
class ToolCallLedger {
 public:
  static constexpr size_t kMemoryCalls = 65536;
  using Store = std::function<void(const std::string& id, const std::string& invoke_text)>;
  using Load = std::function<std::optional<std::string>(const std::string& id)>;

  // A new unguessable id ("call_" + 24 random letters and digits).
  static std::string NewId();
  void Attach(Store store, Load load);
  void Remember(const std::string& id, std::string invoke_text);
  bool Lookup(const std::string& id, std::string* invoke_text) const;
  size_t size() const;  // Calls in memory.

 private:
  void KeepLocked(const std::string& id, std::string invoke_text) const;

  mutable std::mutex mu_;
  mutable std::map<std::string, std::string> calls_;  // Guarded by mu_.
  mutable std::deque<std::string> order_;             // Ids, oldest first. Guarded by mu_.
  Store store_;
  Load load_;
};

// Renders `messages` (OpenAI chat shape: role, content, tool_calls, tool_call_id,
// reasoning_content, tools, response_format, task, wo_eos). Errors name the message and field.
StatusOr<RenderedPrompt> RenderChat(const ojson& messages, const ChatOptions& options,
                                    const ToolCallLedger* ledger = nullptr);

// json.dumps(value, ensure_ascii=False) as Python writes it: ", " and ": " separators, floats in
// their shortest round-trip form, non-ASCII kept.
std::string PythonJson(const ojson& value);

// The DSML text of one call, as the model writes it: <｜DSML｜ invoke name="...">, then one
// parameter line per argument (string="true" for strings, JSON otherwise).
StatusOr<std::string> RenderInvoke(const std::string& name, const ojson& arguments);

}  // namespace flashd::api
