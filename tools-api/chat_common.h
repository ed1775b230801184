// What the chat-shaped routes share (/v1/chat/completions, /v1/messages): an OpenAI chat body
// parsed into a generation request, and the model's output assembled into OpenAI-style deltas.
// Internal to tools-api.
#pragma once

#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "tools-api/chat_format.h"
#include "tools-api/chat_parser.h"
#include "tools-api/generation.h"

namespace flashd::api::chat {

using gen::FieldError;
using nlohmann::json;

struct ChatRequest {
  size_t max_messages = 10000;  // Set by the caller (server.max_messages) before ParseChat.
  engine::GenerationRequest gen;
  ChatOptions options;
  bool stream = false;
  bool include_usage = false;
  bool logprobs = false;
  bool parallel_tool_calls = true;  // false: only the first tool call of a reply is returned.
  // Output written for the model before it starts (a forced tool-call opening); part of the
  // prompt, and parsed as the start of the output.
  std::string forced;
};

// Fills `out` from an OpenAI chat body; `ordered` is the same body with its keys in the client's
// order (tool schemas are rendered in that order). Errors name the field.
std::optional<FieldError> ParseChat(const json& body, const ojson& ordered,
                                    const std::string& model_id, const engine::Engine& eng,
                                    const ToolCallLedger* ledger, ChatRequest* out);

// ParseChat for an ordered body (one another API was translated into, or a stored session).
std::optional<FieldError> ParseChatBody(const ojson& body, const std::string& model_id,
                                        const engine::Engine& eng, const ToolCallLedger* ledger,
                                        ChatRequest* out);

// The start of a route that speaks another API: the model must be ready and the body a JSON
// object (into `body`); `translate` turns it into a chat body, which is parsed into `out`. On an
// error it has answered, and returns false.
using Translate = std::function<std::optional<FieldError>(const ojson& request, ojson* chat)>;
bool ParseTranslated(const httplib::Request& req, httplib::Response& res, const engine::Engine* eng,
                     const Translate& translate, const std::string& model_id,
                     const ToolCallLedger* ledger, size_t max_messages, json* body,
                     ChatRequest* out);

// The translations of the routes that speak another API into an OpenAI chat body: Anthropic's
// Messages (`need_max_tokens` for /v1/messages; count_tokens does not take it) and OpenAI's
// Responses. Pure functions of the request; errors name the field.
std::optional<FieldError> AnthropicToChat(const ojson& in, bool need_max_tokens, ojson* out);
std::optional<FieldError> ResponsesToChat(const ojson& in, ojson* out);

// OpenAI usage plus the prefix cache's counts under OpenAI's and DeepSeek's names.
json ChatUsage(const engine::GenerationEvent& done);

// "tool_calls" when a normal stop follows tool calls, else the engine's reason.
std::string FinishReason(const engine::GenerationEvent& done, bool called_tools);

// The model's output as OpenAI deltas ({"content"}, {"reasoning_content"}, {"tool_calls"}), one
// piece of text at a time; every finished tool call is remembered in the ledger under its id.
class Assembler {
 public:
  Assembler(bool thinking, ToolCallLedger* ledger, bool parallel_tool_calls = true)
      : parser_(thinking), ledger_(ledger), parallel_(parallel_tool_calls) {}

  std::vector<json> Feed(const std::string& text) { return Deltas(parser_.Feed(text)); }
  std::vector<json> Finish() { return Deltas(parser_.Finish()); }
  bool called_tools() const { return !ids_.empty(); }

 private:
  std::vector<json> Deltas(const std::vector<ParseEvent>& events);

  ChatOutputParser parser_;
  ToolCallLedger* ledger_;
  bool parallel_;
  std::map<int, std::string> ids_;
};

}  // namespace flashd::api::chat
