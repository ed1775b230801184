// POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API on the engine, what
// Claude Code and the anthropic SDKs speak.
//
// A request is translated into the OpenAI chat shape and goes the same way as
// /v1/chat/completions (chat_common.h): system text and tools into the system message,
// tool_use / tool_result / thinking blocks into tool calls, tool messages and reasoning. The
// output comes back as content blocks: thinking, text and tool_use, streamed with Anthropic's
// event sequence (message_start, content_block_start/delta/stop, message_delta, message_stop,
// ping). cache_control is accepted and ignored: every prompt goes through the prefix cache.
// Lines naming a per-request billing header, which some clients put first in the system prompt
// and change every request, are removed before rendering so they do not defeat the cache.
#include <spdlog/spdlog.h>

#include <chrono>
#include <nlohmann/json.hpp>
#include <sstream>

#include "tools-api/api.h"
#include "tools-api/chat_common.h"
#include "tools-api/generation.h"

namespace flashd::api {
namespace {

using namespace gen;
using chat::Assembler;
using chat::ChatRequest;

std::optional<FieldError> Invalid(std::string message) {
  return FieldError{400, "invalid_request_error", std::move(message)};
}

std::string_view Trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t' || s.front() == '\r'))
    s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r'))
    s.remove_suffix(1);
  return s;
}

// System prompt lines that change on every request without changing its meaning.
bool VolatileLine(std::string_view line) {
  return line.rfind("x-anthropic-billing-header:", 0) == 0;
}

// The system prompt's lines less the volatile ones, in two parts. Claude Code's system prompt
// carries text that differs per session: the environment block (<env> ... </env>: working
// directory, platform, today's date) and the git status at the session's start (from a
// "gitStatus:" line to the end). Rendered where the client puts it, before the tool
// definitions, it would make every session's system prompt and tools (10-25K tokens) its own.
// Split off here, it becomes a second system message after the tools, so all sessions of a
// client share that prefix; no other line is dropped or changed. Returns {the rest, the
// per-session lines}; the second is empty when there are none (or an <env> is never closed:
// then everything stays in the first).
std::pair<std::string, std::string> SplitSystemLines(const std::string& text) {
  struct Part {
    std::string text;
    bool any = false;
    void Add(const std::string& line) {
      if (any) text += "\n";
      text += line;
      any = true;
    }
  };
  Part kept, stable, session;
  std::istringstream in(text);
  std::string line;
  bool in_env = false, in_git = false;
  while (std::getline(in, line)) {
    if (VolatileLine(line)) continue;
    const std::string_view t = Trim(line);
    if (!in_git && t == "<env>") in_env = true;
    if (!in_env && line.rfind("gitStatus:", 0) == 0) in_git = true;
    kept.Add(line);
    (in_env || in_git ? session : stable).Add(line);
    if (in_env && t == "</env>") in_env = false;
  }
  if (in_env || !session.any) return {kept.text, ""};
  return {stable.text, session.text};
}

// Text of a string or an array of blocks; only text blocks are allowed.
std::optional<FieldError> TextOf(const ojson& v, const std::string& where, std::string* out) {
  if (v.is_string()) {
    *out = v.get<std::string>();
    return std::nullopt;
  }
  if (!v.is_array()) return Invalid(where + ": expected a string or an array of content blocks");
  std::string text;
  for (size_t i = 0; i < v.size(); ++i) {
    const ojson& b = v[i];
    const std::string at = where + "[" + std::to_string(i) + "]";
    if (!b.is_object() || !b.contains("type") || !b["type"].is_string()) {
      return Invalid(at + ": expected a content block with a type");
    }
    if (b["type"] != "text") {
      return Invalid(at + ".type: \"" + b["type"].get<std::string>() +
                     "\" is not supported here (text only)");
    }
    if (!b.contains("text") || !b["text"].is_string())
      return Invalid(at + ".text: expected a string");
    if (!text.empty()) text += "\n";
    text += b["text"].get<std::string>();
  }
  *out = std::move(text);
  return std::nullopt;
}

// The Anthropic body as an OpenAI chat body. `need_max_tokens`: /v1/messages requires it,
// count_tokens does not take it.
std::optional<FieldError> ToChat(const ojson& in, bool need_max_tokens, ojson* out) {
  ojson chat = ojson::object();
  if (in.contains("model")) chat["model"] = in["model"];
  if (need_max_tokens && (!in.contains("max_tokens") || !in["max_tokens"].is_number_integer())) {
    return Invalid("max_tokens: required, an integer");
  }
  if (in.contains("max_tokens")) chat["max_tokens"] = in["max_tokens"];
  for (const char* k : {"temperature", "top_p", "top_k", "stream"}) {
    if (in.contains(k)) chat[k] = in[k];
  }
  if (in.contains("stop_sequences")) chat["stop"] = in["stop_sequences"];

  ojson messages = ojson::array();
  if (in.contains("system") && !in["system"].is_null()) {
    std::string system;
    if (auto e = TextOf(in["system"], "system", &system)) return e;
    auto [stable, session] = SplitSystemLines(system);
    messages.push_back({{"role", "system"}, {"content", stable}});
    if (!session.empty()) messages.push_back({{"role", "system"}, {"content", session}});
  }
  if (!in.contains("messages") || !in["messages"].is_array() || in["messages"].empty()) {
    return Invalid("messages: expected a non-empty array");
  }
  const ojson& msgs = in["messages"];
  for (size_t i = 0; i < msgs.size(); ++i) {
    const ojson& m = msgs[i];
    const std::string at = "messages[" + std::to_string(i) + "]";
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string()) {
      return Invalid(at + ".role: expected \"user\" or \"assistant\"");
    }
    const std::string role = m["role"];
    if (role != "user" && role != "assistant") {
      return Invalid(at + ".role: expected \"user\" or \"assistant\"");
    }
    if (!m.contains("content")) return Invalid(at + ".content: required");
    const ojson& content = m["content"];
    if (content.is_string()) {
      messages.push_back({{"role", role}, {"content", content}});
      continue;
    }
    if (!content.is_array()) return Invalid(at + ".content: expected a string or an array");
    std::string text, reasoning;
    ojson calls = ojson::array();
    for (size_t j = 0; j < content.size(); ++j) {
      const ojson& b = content[j];
      const std::string bat = at + ".content[" + std::to_string(j) + "]";
      if (!b.is_object() || !b.contains("type") || !b["type"].is_string()) {
        return Invalid(bat + ".type: required");
      }
      const std::string type = b["type"];
      if (type == "text") {
        if (!b.contains("text") || !b["text"].is_string())
          return Invalid(bat + ".text: expected a string");
        text += b["text"].get<std::string>();
      } else if (type == "thinking" && role == "assistant") {
        if (b.contains("thinking") && b["thinking"].is_string())
          reasoning += b["thinking"].get<std::string>();
      } else if (type == "redacted_thinking" && role == "assistant") {
        // Opaque to this model; nothing to render.
      } else if (type == "tool_use" && role == "assistant") {
        if (!b.contains("id") || !b["id"].is_string() || !b.contains("name") ||
            !b["name"].is_string()) {
          return Invalid(bat + ": a tool_use block needs id and name");
        }
        const ojson input = b.contains("input") ? b["input"] : ojson::object();
        calls.push_back({{"id", b["id"]},
                         {"type", "function"},
                         {"function", {{"name", b["name"]}, {"arguments", input.dump()}}}});
      } else if (type == "tool_result" && role == "user") {
        if (!b.contains("tool_use_id") || !b["tool_use_id"].is_string()) {
          return Invalid(bat + ".tool_use_id: required");
        }
        std::string result;
        if (b.contains("content")) {
          if (auto e = TextOf(b["content"], bat + ".content", &result)) return e;
        }
        if (b.value("is_error", false)) result = "Error: " + result;
        // Tool results answer the previous assistant turn, before this turn's own text.
        messages.push_back(
            {{"role", "tool"}, {"tool_call_id", b["tool_use_id"]}, {"content", result}});
      } else {
        return Invalid(bat + ".type: \"" + type + "\" is not supported in a " + role + " message");
      }
    }
    if (role == "assistant") {
      ojson a = {{"role", "assistant"}, {"content", text}};
      if (!reasoning.empty()) a["reasoning_content"] = reasoning;
      if (!calls.empty()) a["tool_calls"] = calls;
      messages.push_back(a);
    } else if (!text.empty()) {
      messages.push_back({{"role", "user"}, {"content", text}});
    }
  }
  chat["messages"] = messages;

  if (in.contains("tools") && !in["tools"].is_null()) {
    if (!in["tools"].is_array()) return Invalid("tools: expected an array");
    ojson tools = ojson::array();
    for (size_t i = 0; i < in["tools"].size(); ++i) {
      const ojson& t = in["tools"][i];
      const std::string at = "tools[" + std::to_string(i) + "]";
      if (!t.is_object()) return Invalid(at + ": expected an object");
      if (t.contains("type") && t["type"] != "custom") {
        // A server tool (web search, code execution...): the provider runs those, and flashd
        // has none to run. It is left out, so the rest of the request still works.
        spdlog::info("tools[{}]: server tool type {} is not available here; left out", i,
                     t["type"].dump());
        continue;
      }
      if (!t.contains("name") || !t["name"].is_string()) return Invalid(at + ".name: required");
      if (!t.contains("input_schema") || !t["input_schema"].is_object()) {
        return Invalid(at + ".input_schema: expected an object");
      }
      ojson fn = {{"name", t["name"]}};
      if (t.contains("description")) fn["description"] = t["description"];
      fn["parameters"] = t["input_schema"];
      tools.push_back({{"type", "function"}, {"function", fn}});
    }
    if (!tools.empty()) chat["tools"] = tools;
  }
  if (in.contains("tool_choice") && !in["tool_choice"].is_null()) {
    const ojson& c = in["tool_choice"];
    const std::string type = c.is_object() ? c.value("type", "") : "";
    if (type == "auto" || type == "none") {
      chat["tool_choice"] = type;
    } else if (type == "any") {
      chat["tool_choice"] = "required";
    } else if (type == "tool" && c.contains("name") && c["name"].is_string()) {
      chat["tool_choice"] = {{"type", "function"}, {"function", {{"name", c["name"]}}}};
    } else {
      return Invalid(
          "tool_choice: expected {\"type\": \"auto\" | \"any\" | \"none\"} or "
          "{\"type\": \"tool\", \"name\": ...}");
    }
    if (c.value("disable_parallel_tool_use", false)) chat["parallel_tool_calls"] = false;
  }
  if (in.contains("thinking") && !in["thinking"].is_null()) {
    const ojson& t = in["thinking"];
    const std::string type = t.is_object() && t.contains("type") && t["type"].is_string()
                                 ? t["type"].get<std::string>()
                                 : "";
    if (type != "enabled" && type != "adaptive" && type != "disabled") {
      return Invalid("thinking.type: expected \"enabled\", \"adaptive\" or \"disabled\"");
    }
    chat["thinking"] = {{"type", type == "disabled" ? "disabled" : "enabled"}};
  }
  if (in.contains("output_config") && in["output_config"].is_object()) {
    const ojson& oc = in["output_config"];
    if (oc.contains("effort") && oc["effort"].is_string()) {
      // The model's efforts are 1-100; Anthropic's names map onto its named ones.
      const std::string effort = oc["effort"];
      if (effort == "medium") {
        chat["reasoning_effort"] = 38;
      } else if (effort == "low" || effort == "high" || effort == "xhigh" || effort == "max") {
        chat["reasoning_effort"] = effort;
      } else {
        return Invalid("output_config.effort: expected low, medium, high, xhigh or max");
      }
      if (chat.contains("thinking") && chat["thinking"]["type"] == "disabled") {
        chat.erase("reasoning_effort");
      }
    }
    if (oc.contains("format") && oc["format"].is_object()) {
      const ojson& f = oc["format"];
      if (f.value("type", "") != "json_schema" || !f.contains("schema")) {
        return Invalid(
            "output_config.format: expected {\"type\": \"json_schema\", \"schema\": ...}");
      }
      chat["response_format"] = {{"type", "json_schema"},
                                 {"json_schema", {{"name", "output"}, {"schema", f["schema"]}}}};
    }
  }
  *out = std::move(chat);
  return std::nullopt;
}

const char* AnthropicErrorType(int status) {
  switch (status) {
    case 400:
    case 413:
    case 422:
      return "invalid_request_error";
    case 401:
      return "authentication_error";
    case 403:
      return "permission_error";
    case 404:
      return "not_found_error";
    case 429:
      return "rate_limit_error";
    case 503:
    case 529:
      return "overloaded_error";
    default:
      return "api_error";
  }
}

json AnthropicError(int status, const std::string& message) {
  return {{"type", "error"},
          {"error", {{"type", AnthropicErrorType(status)}, {"message", message}}}};
}

// An error another layer wrote in OpenAI's shape, rewritten in Anthropic's.
void ToAnthropicError(httplib::Response& res) {
  if (res.status < 400) return;
  json body = json::parse(res.body, nullptr, false);
  std::string message = res.body;
  if (body.is_object() && body.contains("error") && body["error"].is_object()) {
    message = body["error"].value("message", res.body);
  }
  res.set_content(AnthropicError(res.status, message).dump(), "application/json");
}

std::string StopReason(const GenerationEvent& done, bool called_tools) {
  if (done.finish_reason == "length") return "max_tokens";
  if (called_tools) return "tool_use";
  return "end_turn";
}

json AnthropicUsage(const GenerationEvent& e, int64_t output_tokens) {
  // Input tokens read from the prefix cache are reported apart from those computed, as the
  // Messages API does; nothing is billed for writing the cache, which happens for every prompt.
  return {{"input_tokens", e.prompt_tokens - e.cached_tokens},
          {"output_tokens", output_tokens},
          {"cache_read_input_tokens", e.cached_tokens},
          {"cache_creation_input_tokens", 0}};
}

// Folds OpenAI-style deltas into Anthropic content blocks, as whole blocks or as stream events.
class Blocks {
 public:
  // One server-sent event of the Messages stream.
  static std::string Event(const char* name, const json& data) { return SseEvent(name, data); }

  // Stream events for `deltas`.
  std::string Events(const std::vector<json>& deltas) {
    std::string out;
    for (const json& d : deltas) {
      if (d.contains("reasoning_content")) {
        Open("thinking", {{"type", "thinking"}, {"thinking", ""}, {"signature", ""}}, &out);
        Delta({{"type", "thinking_delta"}, {"thinking", d["reasoning_content"]}}, &out);
      } else if (d.contains("content")) {
        const std::string text = d["content"];
        if (text.empty()) continue;
        Open("text", {{"type", "text"}, {"text", ""}}, &out);
        Delta({{"type", "text_delta"}, {"text", text}}, &out);
      } else if (d.contains("tool_calls")) {
        const json& call = d["tool_calls"][0];
        if (call.contains("id")) {
          if (!current_.empty()) Stop(&out);  // Every call is a block of its own.
          Open("tool_use",
               {{"type", "tool_use"},
                {"id", call["id"]},
                {"name", call["function"]["name"]},
                {"input", json::object()}},
               &out);
        } else {
          Delta({{"type", "input_json_delta"}, {"partial_json", call["function"]["arguments"]}},
                &out);
        }
      }
    }
    return out;
  }
  std::string Close() {
    std::string out;
    if (!current_.empty()) Stop(&out);
    return out;
  }

  // Whole blocks for a non-streamed reply.
  void Absorb(const std::vector<json>& deltas) {
    for (const json& d : deltas) {
      if (d.contains("reasoning_content")) {
        Append("thinking", "thinking", d["reasoning_content"]);
      } else if (d.contains("content")) {
        if (!d["content"].get<std::string>().empty()) Append("text", "text", d["content"]);
      } else if (d.contains("tool_calls")) {
        const json& call = d["tool_calls"][0];
        if (call.contains("id")) {
          whole_.push_back({{"type", "tool_use"},
                            {"id", call["id"]},
                            {"name", call["function"]["name"]},
                            {"input", ""}});
        } else if (!whole_.empty() && whole_.back()["type"] == "tool_use") {
          whole_.back()["input"] = whole_.back()["input"].get<std::string>() +
                                   call["function"]["arguments"].get<std::string>();
        }
      }
    }
  }
  json Whole() const {
    json blocks = whole_;
    for (json& b : blocks) {
      if (b["type"] == "thinking") b["signature"] = "";
      if (b["type"] != "tool_use") continue;
      const std::string args = b["input"];
      json input = json::parse(args.empty() ? "{}" : args, nullptr, false);
      if (!input.is_object()) {
        spdlog::warn("tool_use {}: arguments are not a JSON object", b["id"].get<std::string>());
        input = json::object();
      }
      b["input"] = input;
    }
    return blocks;
  }

 private:
  void Open(const std::string& kind, const json& block, std::string* out) {
    if (current_ == kind) return;
    if (!current_.empty()) Stop(out);
    current_ = kind;
    *out += Event("content_block_start",
                  {{"type", "content_block_start"}, {"index", index_}, {"content_block", block}});
  }
  void Delta(const json& delta, std::string* out) {
    *out += Event("content_block_delta",
                  {{"type", "content_block_delta"}, {"index", index_}, {"delta", delta}});
  }
  void Stop(std::string* out) {
    *out += Event("content_block_stop", {{"type", "content_block_stop"}, {"index", index_}});
    ++index_;
    current_.clear();
  }
  void Append(const char* type, const char* field, const json& text) {
    if (whole_.empty() || whole_.back()["type"] != type) {
      whole_.push_back({{"type", type}, {field, ""}});
    }
    whole_.back()[field] = whole_.back()[field].get<std::string>() + text.get<std::string>();
  }

  std::string current_;  // Kind of the open block, "" when none.
  int index_ = 0;
  json whole_ = json::array();
};

}  // namespace

namespace chat {
std::optional<FieldError> AnthropicToChat(const ojson& in, bool need_max_tokens, ojson* out) {
  return ToChat(in, need_max_tokens, out);
}
}  // namespace chat

void Api::Messages(const httplib::Request& req, httplib::Response& res) const {
  const auto arrived = std::chrono::steady_clock::now();
  MessagesImpl(req, res, arrived);
  ToAnthropicError(res);
}

void Api::MessagesImpl(const httplib::Request& req, httplib::Response& res,
                       std::chrono::steady_clock::time_point arrived) const {
  engine::Engine* eng = engine();
  json body;
  ChatRequest cr;
  const auto translate = [](const ojson& in, ojson* out) { return ToChat(in, true, out); };
  if (!chat::ParseTranslated(req, res, eng, translate, model_.id, &ledger_,
                             static_cast<size_t>(config_.server.max_messages), &body, &cr)) {
    return;
  }
  const std::string id = NewId("msg_");
  std::shared_ptr<Generation> g =
      StartGeneration(eng, std::move(cr.gen), TenantOf(req), id, arrived, res);
  if (!g) return;
  auto assembler =
      std::make_shared<Assembler>(cr.options.thinking, &ledger_, cr.parallel_tool_calls);
  const std::vector<json> opening = assembler->Feed(cr.forced);
  auto blocks = std::make_shared<Blocks>();
  const std::string model = model_.id;

  if (cr.stream) {
    auto started = std::make_shared<bool>(false);
    auto output = std::make_shared<int64_t>(0);
    StreamStyle style;
    style.keep_alive = Blocks::Event("ping", {{"type", "ping"}});
    style.queue_comments = false;
    style.error = [](int status, const std::string& message) {
      return Blocks::Event("error", AnthropicError(status, message));
    };
    style.trailer = "";
    ServeStream(
        res, g,
        [=](const GenerationEvent& e, std::string* out) {
          if (!*started) {
            *started = true;
            json message = {{"id", id},
                            {"type", "message"},
                            {"role", "assistant"},
                            {"model", model},
                            {"content", json::array()},
                            {"stop_reason", nullptr},
                            {"stop_sequence", nullptr},
                            {"usage", AnthropicUsage(e, 0)}};
            *out +=
                Blocks::Event("message_start", {{"type", "message_start"}, {"message", message}});
            *out += blocks->Events(opening);
          }
          if (e.kind == GenerationEvent::Kind::kToken) {
            if (e.token.token >= 0) *output += 1;
            *out += blocks->Events(assembler->Feed(e.text));
            return;
          }
          *out += blocks->Events(assembler->Finish());
          *out += blocks->Close();
          *out += Blocks::Event("message_delta",
                                {{"type", "message_delta"},
                                 {"delta",
                                  {{"stop_reason", StopReason(e, assembler->called_tools())},
                                   {"stop_sequence", nullptr}}},
                                 {"usage", AnthropicUsage(e, e.completion_tokens)}});
          *out += Blocks::Event("message_stop", {{"type", "message_stop"}});
        },
        style);
    return;
  }
  blocks->Absorb(opening);
  ServeWhole(
      res, g, [=](const GenerationEvent& e) { blocks->Absorb(assembler->Feed(e.text)); },
      [=](const GenerationEvent& done) {
        blocks->Absorb(assembler->Finish());
        return json{{"id", id},
                    {"type", "message"},
                    {"role", "assistant"},
                    {"model", model},
                    {"content", blocks->Whole()},
                    {"stop_reason", StopReason(done, assembler->called_tools())},
                    {"stop_sequence", nullptr},
                    {"usage", AnthropicUsage(done, done.completion_tokens)}};
      });
}

void Api::CountTokens(const httplib::Request& req, httplib::Response& res) const {
  json body;
  ChatRequest cr;
  const auto translate = [](const ojson& in, ojson* out) { return ToChat(in, false, out); };
  if (!chat::ParseTranslated(req, res, engine(), translate, model_.id, &ledger_,
                             static_cast<size_t>(config_.server.max_messages), &body, &cr)) {
    return ToAnthropicError(res);
  }
  res.set_content(json{{"input_tokens", cr.gen.prompt.size()}}.dump(), "application/json");
}

}  // namespace flashd::api
