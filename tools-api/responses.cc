// POST /v1/responses: OpenAI's Responses API on the engine, what Codex speaks.
//
// The request (instructions, input items: messages, function_call, function_call_output,
// reasoning; flat function tools) is translated into the chat shape and goes the way of
// /v1/chat/completions (chat_common.h). The output comes back as items (reasoning, message,
// function_call), whole or as the Responses event lifecycle: response.created, in_progress, per
// item output_item.added / deltas / done, and response.completed, .incomplete (max_output_tokens)
// or .failed, every event numbered by sequence_number. Responses are not stored:
// previous_response_id is refused, a client sends the whole input each time (the prefix cache
// makes that cheap).
#include <spdlog/spdlog.h>

#include <chrono>
#include <ctime>
#include <nlohmann/json.hpp>

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

// Text of a message item's content: a string or input_text / output_text parts.
std::optional<FieldError> ContentText(const ojson& c, const std::string& where, std::string* out) {
  if (c.is_string()) {
    *out = c.get<std::string>();
    return std::nullopt;
  }
  if (!c.is_array()) return Invalid(where + ": expected a string or an array of parts");
  std::string text;
  for (size_t i = 0; i < c.size(); ++i) {
    const ojson& p = c[i];
    const std::string type = p.is_object() ? p.value("type", "") : "";
    if (type != "input_text" && type != "output_text" && type != "text") {
      return Invalid(where + "[" + std::to_string(i) + "].type: \"" + type +
                     "\" is not supported (text parts only)");
    }
    if (!p.contains("text") || !p["text"].is_string()) {
      return Invalid(where + "[" + std::to_string(i) + "].text: expected a string");
    }
    text += p["text"].get<std::string>();
  }
  *out = std::move(text);
  return std::nullopt;
}

std::optional<FieldError> ToChat(const ojson& in, ojson* out) {
  ojson chat = ojson::object();
  if (in.contains("model")) chat["model"] = in["model"];
  if (in.contains("previous_response_id") && !in["previous_response_id"].is_null()) {
    return Invalid(
        "previous_response_id: responses are not stored; send the whole input (the prefix cache "
        "restores what was seen before)");
  }
  if (in.contains("max_output_tokens") && !in["max_output_tokens"].is_null()) {
    chat["max_tokens"] = in["max_output_tokens"];
  }
  for (const char* k : {"temperature", "top_p", "stream", "parallel_tool_calls"}) {
    if (in.contains(k) && !in[k].is_null()) chat[k] = in[k];
  }
  ojson messages = ojson::array();
  if (in.contains("instructions") && in["instructions"].is_string()) {
    messages.push_back({{"role", "system"}, {"content", in["instructions"]}});
  }
  if (!in.contains("input")) return Invalid("input: required");
  const ojson& input = in["input"];
  if (input.is_string()) {
    messages.push_back({{"role", "user"}, {"content", input}});
  } else if (input.is_array()) {
    std::string reasoning;  // For the next assistant message.
    // The assistant message being built: text, then calls that follow it.
    auto assistant = [&]() -> ojson& {
      if (messages.empty() || messages.back()["role"] != "assistant") {
        messages.push_back({{"role", "assistant"}, {"content", ""}});
      }
      if (!reasoning.empty()) {
        messages.back()["reasoning_content"] = reasoning;
        reasoning.clear();
      }
      return messages.back();
    };
    for (size_t i = 0; i < input.size(); ++i) {
      const ojson& item = input[i];
      const std::string at = "input[" + std::to_string(i) + "]";
      if (!item.is_object()) return Invalid(at + ": expected an object");
      const std::string type = item.value("type", item.contains("role") ? "message" : "");
      if (type == "message") {
        const std::string role = item.value("role", "");
        if (role != "user" && role != "assistant" && role != "system" && role != "developer") {
          return Invalid(at + ".role: expected user, assistant, system or developer");
        }
        std::string text;
        if (!item.contains("content")) return Invalid(at + ".content: required");
        if (auto e = ContentText(item["content"], at + ".content", &text)) return e;
        if (role == "assistant") {
          ojson& a = assistant();
          if (a.contains("tool_calls")) {
            messages.push_back({{"role", "assistant"}, {"content", text}});
          } else {
            a["content"] = a["content"].get<std::string>() + text;
          }
        } else {
          messages.push_back({{"role", role}, {"content", text}});
        }
      } else if (type == "function_call") {
        if (!item.contains("call_id") || !item["call_id"].is_string() || !item.contains("name") ||
            !item["name"].is_string()) {
          return Invalid(at + ": a function_call needs call_id and name");
        }
        ojson& a = assistant();
        if (!a.contains("tool_calls")) a["tool_calls"] = ojson::array();
        a["tool_calls"].push_back(
            {{"id", item["call_id"]},
             {"type", "function"},
             {"function",
              {{"name", item["name"]},
               {"arguments", item.contains("arguments") ? item["arguments"] : ojson("{}")}}}});
      } else if (type == "function_call_output") {
        if (!item.contains("call_id") || !item["call_id"].is_string()) {
          return Invalid(at + ".call_id: required");
        }
        std::string output;
        if (item.contains("output")) {
          if (auto e = ContentText(item["output"], at + ".output", &output)) return e;
        }
        messages.push_back(
            {{"role", "tool"}, {"tool_call_id", item["call_id"]}, {"content", output}});
      } else if (type == "reasoning") {
        for (const char* field : {"content", "summary"}) {
          if (!item.contains(field) || !item[field].is_array()) continue;
          for (const ojson& p : item[field]) {
            if (p.is_object() && p.contains("text") && p["text"].is_string()) {
              reasoning += p["text"].get<std::string>();
            }
          }
          if (!reasoning.empty()) break;  // The full text when given, else the summary.
        }
      } else {
        return Invalid(at + ".type: \"" + type + "\" is not supported");
      }
    }
  } else {
    return Invalid("input: expected a string or an array of items");
  }
  chat["messages"] = messages;

  if (in.contains("tools") && in["tools"].is_array()) {
    ojson tools = ojson::array();
    for (size_t i = 0; i < in["tools"].size(); ++i) {
      const ojson& t = in["tools"][i];
      const std::string at = "tools[" + std::to_string(i) + "]";
      if (!t.is_object()) return Invalid(at + ": expected an object");
      if (t.value("type", "") != "function") {
        // Hosted tools (web_search, file_search...) and freeform custom tools: none can run
        // here. Left out, so that the rest of the request still works.
        spdlog::info("tools[{}]: tool type {} is not available here; left out", i,
                     t.contains("type") ? t["type"].dump() : "(none)");
        continue;
      }
      if (!t.contains("name") || !t["name"].is_string()) return Invalid(at + ".name: required");
      ojson fn = {{"name", t["name"]}};
      if (t.contains("description")) fn["description"] = t["description"];
      fn["parameters"] = t.contains("parameters") ? t["parameters"] : ojson::object();
      tools.push_back({{"type", "function"}, {"function", fn}});
    }
    if (!tools.empty()) chat["tools"] = tools;
  }
  if (in.contains("tool_choice") && !in["tool_choice"].is_null()) {
    const ojson& c = in["tool_choice"];
    if (c.is_string()) {
      chat["tool_choice"] = c;
    } else if (c.is_object() && c.value("type", "") == "function" && c.contains("name")) {
      chat["tool_choice"] = {{"type", "function"}, {"function", {{"name", c["name"]}}}};
    } else {
      return Invalid(
          "tool_choice: expected auto, none, required or {\"type\": \"function\", "
          "\"name\": ...}");
    }
  }
  if (in.contains("reasoning") && in["reasoning"].is_object()) {
    const ojson& r = in["reasoning"];
    if (r.contains("effort") && r["effort"].is_string()) {
      const std::string effort = r["effort"];
      if (effort == "none" || effort == "minimal") {
        chat["reasoning_effort"] = "none";
      } else if (effort == "medium") {
        chat["reasoning_effort"] = 38;
      } else if (effort == "low" || effort == "high" || effort == "xhigh") {
        chat["reasoning_effort"] = effort;
      } else {
        return Invalid("reasoning.effort: expected none, minimal, low, medium, high or xhigh");
      }
    }
  }
  if (in.contains("text") && in["text"].is_object() && in["text"].contains("format")) {
    const ojson& f = in["text"]["format"];
    const std::string type = f.is_object() && f.contains("type") && f["type"].is_string()
                                 ? f["type"].get<std::string>()
                                 : "";
    if (type == "json_object") {
      chat["response_format"] = {{"type", "json_object"}};
    } else if (type == "json_schema") {
      chat["response_format"] = {
          {"type", "json_schema"},
          {"json_schema",
           {{"name", f.value("name", "output")},
            {"schema", f.contains("schema") ? f["schema"] : ojson::object()}}}};
    } else if (type != "text") {
      return Invalid("text.format.type: expected text, json_object or json_schema");
    }
  }
  *out = std::move(chat);
  return std::nullopt;
}

// Builds the output items from the deltas, and the stream's events with their sequence numbers.
class Items {
 public:
  explicit Items(std::string response_id) : rid_(std::move(response_id)) {}

  int64_t Next() { return seq_++; }
  std::string Event(json e) {
    e["sequence_number"] = Next();
    return SseEvent(e["type"].get<std::string>(), e);
  }

  // Events for the deltas (stream) and the items' growing state (both modes).
  std::string Feed(const std::vector<json>& deltas) {
    std::string out;
    for (const json& d : deltas) {
      if (d.contains("reasoning_content")) {
        if (kind_ != "reasoning") {
          out += Close();
          Open({{"type", "reasoning"}, {"id", NewId("rs_")}, {"summary", json::array()}}, &out);
          kind_ = "reasoning";
          out += Event({{"type", "response.reasoning_summary_part.added"},
                        {"item_id", items_.back()["id"]},
                        {"output_index", items_.size() - 1},
                        {"summary_index", 0},
                        {"part", {{"type", "summary_text"}, {"text", ""}}}});
        }
        text_ += d["reasoning_content"].get<std::string>();
        out += Event({{"type", "response.reasoning_summary_text.delta"},
                      {"item_id", items_.back()["id"]},
                      {"output_index", items_.size() - 1},
                      {"summary_index", 0},
                      {"delta", d["reasoning_content"]}});
      } else if (d.contains("content")) {
        const std::string text = d["content"];
        if (text.empty()) continue;
        if (kind_ != "message") {
          out += Close();
          Open({{"type", "message"},
                {"id", NewId("msg_")},
                {"status", "in_progress"},
                {"role", "assistant"},
                {"content", json::array()}},
               &out);
          kind_ = "message";
          out += Event({{"type", "response.content_part.added"},
                        {"item_id", items_.back()["id"]},
                        {"output_index", items_.size() - 1},
                        {"content_index", 0},
                        {"part", Part("")}});
        }
        text_ += text;
        out += Event({{"type", "response.output_text.delta"},
                      {"item_id", items_.back()["id"]},
                      {"output_index", items_.size() - 1},
                      {"content_index", 0},
                      {"delta", text},
                      {"logprobs", json::array()}});
      } else if (d.contains("tool_calls")) {
        const json& call = d["tool_calls"][0];
        if (call.contains("id")) {
          out += Close();
          Open({{"type", "function_call"},
                {"id", NewId("fc_")},
                {"call_id", call["id"]},
                {"name", call["function"]["name"]},
                {"arguments", ""},
                {"status", "in_progress"}},
               &out);
          kind_ = "function_call";
        } else if (kind_ == "function_call") {
          text_ += call["function"]["arguments"].get<std::string>();
          out += Event({{"type", "response.function_call_arguments.delta"},
                        {"item_id", items_.back()["id"]},
                        {"output_index", items_.size() - 1},
                        {"delta", call["function"]["arguments"]}});
        }
      }
    }
    return out;
  }

  // Finishes the open item.
  std::string Close() {
    std::string out;
    if (kind_.empty()) return out;
    json& item = items_.back();
    const size_t index = items_.size() - 1;
    if (kind_ == "reasoning") {
      item["summary"] = json::array({{{"type", "summary_text"}, {"text", text_}}});
      out += Event({{"type", "response.reasoning_summary_text.done"},
                    {"item_id", item["id"]},
                    {"output_index", index},
                    {"summary_index", 0},
                    {"text", text_}});
      out += Event({{"type", "response.reasoning_summary_part.done"},
                    {"item_id", item["id"]},
                    {"output_index", index},
                    {"summary_index", 0},
                    {"part", {{"type", "summary_text"}, {"text", text_}}}});
    } else if (kind_ == "message") {
      item["status"] = "completed";
      item["content"] = json::array({Part(text_)});
      out += Event({{"type", "response.output_text.done"},
                    {"item_id", item["id"]},
                    {"output_index", index},
                    {"content_index", 0},
                    {"text", text_},
                    {"logprobs", json::array()}});
      out += Event({{"type", "response.content_part.done"},
                    {"item_id", item["id"]},
                    {"output_index", index},
                    {"content_index", 0},
                    {"part", Part(text_)}});
    } else {
      item["status"] = "completed";
      item["arguments"] = text_;
      out += Event({{"type", "response.function_call_arguments.done"},
                    {"item_id", item["id"]},
                    {"output_index", index},
                    {"arguments", text_}});
    }
    out += Event({{"type", "response.output_item.done"}, {"output_index", index}, {"item", item}});
    kind_.clear();
    text_.clear();
    return out;
  }

  const json& items() const { return items_; }

 private:
  static json Part(const std::string& text) {
    return {{"type", "output_text"}, {"text", text}, {"annotations", json::array()}};
  }
  void Open(json item, std::string* out) {
    items_.push_back(item);
    *out += Event({{"type", "response.output_item.added"},
                   {"output_index", items_.size() - 1},
                   {"item", item}});
  }

  std::string rid_;
  int64_t seq_ = 0;
  json items_ = json::array();
  std::string kind_;  // Of the open item: reasoning, message, function_call; "" when none.
  std::string text_;  // Its text so far.
};

json ResponsesUsage(const GenerationEvent& e) {
  return {{"input_tokens", e.prompt_tokens},
          {"input_tokens_details", {{"cached_tokens", e.cached_tokens}}},
          {"output_tokens", e.completion_tokens},
          {"output_tokens_details", {{"reasoning_tokens", 0}}},
          {"total_tokens", e.prompt_tokens + e.completion_tokens}};
}

}  // namespace

namespace chat {
std::optional<FieldError> ResponsesToChat(const ojson& in, ojson* out) { return ToChat(in, out); }
}  // namespace chat

void Api::Responses(const httplib::Request& req, httplib::Response& res) const {
  const auto arrived = std::chrono::steady_clock::now();
  engine::Engine* eng = engine();
  json body;
  ChatRequest cr;
  if (!chat::ParseTranslated(req, res, eng, ToChat, model_.id, &ledger_,
                             static_cast<size_t>(config_.server.max_messages), &body, &cr)) {
    return;
  }
  const std::string id = NewId("resp_");
  std::shared_ptr<Generation> g =
      StartGeneration(eng, std::move(cr.gen), TenantOf(req), id, arrived, res);
  if (!g) return;
  auto assembler =
      std::make_shared<Assembler>(cr.options.thinking, &ledger_, cr.parallel_tool_calls);
  const std::vector<json> opening = assembler->Feed(cr.forced);
  auto items = std::make_shared<Items>(id);
  // The response object: its fixed fields, then status, output and usage as they become known.
  json shell = {{"id", id},
                {"object", "response"},
                {"created_at", static_cast<int64_t>(std::time(nullptr))},
                {"status", "in_progress"},
                {"error", nullptr},
                {"incomplete_details", nullptr},
                {"instructions", body.value("instructions", json())},
                {"max_output_tokens", body.value("max_output_tokens", json())},
                {"model", model_.id},
                {"output", json::array()},
                {"parallel_tool_calls", cr.parallel_tool_calls},
                {"temperature", body.value("temperature", json())},
                {"top_p", body.value("top_p", json())},
                {"tool_choice", body.value("tool_choice", json("auto"))},
                {"tools", body.value("tools", json::array())},
                {"metadata", body.value("metadata", json::object())},
                {"usage", nullptr}};
  auto finish = [shell, items](const GenerationEvent& done) {
    json r = shell;
    r["output"] = items->items();
    r["usage"] = ResponsesUsage(done);
    if (done.finish_reason == "length") {
      r["status"] = "incomplete";
      r["incomplete_details"] = {{"reason", "max_output_tokens"}};
    } else {
      r["status"] = "completed";
    }
    return r;
  };

  if (body.value("stream", false)) {
    auto started = std::make_shared<bool>(false);
    StreamStyle style;
    style.keep_alive = ": keep-alive\n\n";
    style.queue_comments = true;
    style.error = [shell, items](int status, const std::string& message) {
      json r = shell;
      r["status"] = "failed";
      r["error"] = {{"code", ErrorTypeFor(status)}, {"message", message}};
      r["output"] = items->items();
      return items->Event({{"type", "response.failed"}, {"response", r}});
    };
    style.trailer = "";
    ServeStream(
        res, g,
        [=](const GenerationEvent& e, std::string* out) {
          if (!*started) {
            *started = true;
            *out += items->Event({{"type", "response.created"}, {"response", shell}});
            *out += items->Event({{"type", "response.in_progress"}, {"response", shell}});
            *out += items->Feed(opening);
          }
          if (e.kind == GenerationEvent::Kind::kToken) {
            *out += items->Feed(assembler->Feed(e.text));
            return;
          }
          *out += items->Feed(assembler->Finish());
          *out += items->Close();
          const json r = finish(e);
          *out += items->Event(
              {{"type", r["status"] == "completed" ? "response.completed" : "response.incomplete"},
               {"response", r}});
        },
        style);
    return;
  }
  items->Feed(opening);
  ServeWhole(
      res, g, [=](const GenerationEvent& e) { items->Feed(assembler->Feed(e.text)); },
      [=](const GenerationEvent& done) {
        items->Feed(assembler->Finish());
        items->Close();
        return finish(done);
      });
}

}  // namespace flashd::api
