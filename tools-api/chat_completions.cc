// POST /v1/chat/completions: OpenAI's chat completions on the engine.
//
// The messages and tools are rendered in the model's own chat format (chat_format.h), the text a
// client supplied is tokenized with special tokens off, and the output is split back into
// reasoning, content and tool calls as it is generated (chat_parser.h). Each sampled tool call's
// exact text is remembered under its id, so that a client sending the call back renders the very
// bytes the model wrote.
#include <spdlog/spdlog.h>

#include <chrono>
#include <ctime>
#include <map>
#include <nlohmann/json.hpp>

#include "tools-api/api.h"
#include "tools-api/chat_common.h"
#include "tools-api/chat_format.h"
#include "tools-api/chat_parser.h"
#include "tools-api/generation.h"

namespace flashd::api {
namespace {

using namespace gen;

constexpr int kDefaultMaxTokens = 4096;

}  // namespace

namespace chat {

static std::optional<FieldError> Invalid(std::string message) {
  return FieldError{400, "invalid_request_error", std::move(message)};
}

// The first message when it is a system (or developer) message, else a new empty system message
// put first: where the encoder expects tools and the response format.
static ojson& SystemMessage(ojson* messages) {
  const ojson& first = (*messages)[0];
  const bool system_first = first.is_object() && first.contains("role") &&
                            (first["role"] == "system" || first["role"] == "developer");
  if (!system_first)
    messages->insert(messages->begin(), ojson{{"role", "system"}, {"content", ""}});
  return (*messages)[0];
}

// Fills `out`; `ordered` is the same body with its keys in the client's order (tool schemas are
// rendered in that order).
std::optional<FieldError> ParseChat(const json& body, const ojson& ordered,
                                    const std::string& model_id, const engine::Engine& eng,
                                    const ToolCallLedger* ledger, ChatRequest* out) {
  if (auto e = CheckModel(body, model_id)) return e;
  if (!Present(body, "messages") || !body["messages"].is_array() || body["messages"].empty()) {
    return Invalid("messages: expected a non-empty array");
  }
  ojson messages = ordered["messages"];
  if (messages.size() > out->max_messages) {
    return Invalid("messages: " + std::to_string(messages.size()) + " messages, more than " +
                   std::to_string(out->max_messages) + " (server.max_messages)");
  }

  // tool_choice: "auto", "none", "required", or {"type": "function", "function": {"name": N}}.
  // The last two are kept by writing the opening of the model's tool-call block for it.
  std::string tool_choice = "auto";
  std::string forced_name;
  if (Present(body, "tool_choice")) {
    const json& c = body["tool_choice"];
    if (c.is_string() && (c == "auto" || c == "none" || c == "required")) {
      tool_choice = c.get<std::string>();
    } else if (c.is_object() && c.value("type", "") == "function" && c.contains("function") &&
               c["function"].is_object() && c["function"].contains("name") &&
               c["function"]["name"].is_string()) {
      tool_choice = "named";
      forced_name = c["function"]["name"].get<std::string>();
    } else {
      return Invalid(
          "tool_choice: expected \"auto\", \"none\", \"required\" or {\"type\": \"function\", "
          "\"function\": {\"name\": ...}}");
    }
  }
  if (tool_choice == "required" || tool_choice == "named") {
    if (!Present(body, "tools") || !body["tools"].is_array() || body["tools"].empty()) {
      return Invalid("tool_choice: \"" + tool_choice + "\" needs tools");
    }
    bool known = tool_choice == "required";
    for (const json& t : body["tools"]) {
      if (t.is_object() && t.contains("function") && t["function"].is_object() &&
          t["function"].value("name", "") == forced_name) {
        known = true;
      }
    }
    if (!known) return Invalid("tool_choice.function.name: no tool named \"" + forced_name + "\"");
    if (forced_name.find_first_of("\"<>\\\n") != std::string::npos) {
      return Invalid("tool_choice.function.name: not a valid tool name");
    }
    out->forced = "\n\n<｜DSML｜ calls>\n";
    if (tool_choice == "named") out->forced += "<｜DSML｜ invoke name=\"" + forced_name + "\">\n";
  }
  if (Present(body, "tools")) {
    if (!body["tools"].is_array()) return Invalid("tools: expected an array");
    if (tool_choice != "none" && !body["tools"].empty()) {
      SystemMessage(&messages)["tools"] = ordered["tools"];
    }
  }
  if (Present(body, "response_format")) {
    const json& f = body["response_format"];
    if (!f.is_object() || !f.contains("type") || !f["type"].is_string()) {
      return Invalid("response_format: expected {\"type\": ...}");
    }
    if (f["type"] != "text" && f["type"] != "json_object" && f["type"] != "json_schema") {
      return Invalid("response_format.type: expected text, json_object or json_schema");
    }
    // Rendered into the system prompt, as the model was trained; the output is not constrained
    // by a grammar.
    if (f["type"] != "text")
      SystemMessage(&messages)["response_format"] = ordered["response_format"];
  }

  // Thinking: OpenAI's reasoning_effort, or DeepSeek's {"thinking": {"type": "enabled"}}.
  if (Present(body, "thinking")) {
    const json& t = body["thinking"];
    if (!t.is_object() || !t.contains("type") ||
        (t["type"] != "enabled" && t["type"] != "disabled")) {
      return Invalid("thinking: expected {\"type\": \"enabled\"} or {\"type\": \"disabled\"}");
    }
    out->options.thinking = t["type"] == "enabled";
  }
  if (Present(body, "reasoning_effort")) {
    const json& r = body["reasoning_effort"];
    if (r.is_string() && r == "none") {
      out->options.thinking = false;
    } else {
      out->options.thinking = true;
      out->options.reasoning_effort = ordered["reasoning_effort"];
    }
  }

  if (!out->forced.empty() && out->options.thinking) {
    return Invalid("tool_choice: \"" + tool_choice +
                   "\" is not available in thinking mode; use \"auto\" or turn thinking off");
  }

  StatusOr<RenderedPrompt> prompt = RenderChat(messages, out->options, ledger);
  if (!prompt.ok()) return Invalid(prompt.status().message());
  std::vector<int64_t> marks;
  out->gen.prompt = eng.tokenizer()->EncodeWithPlainRanges(prompt->text, prompt->untrusted,
                                                           prompt->divergence_points, &marks);
  for (int64_t m : marks) {
    if (m > 0) out->gen.snapshot_at.push_back(m);
  }
  if (!out->forced.empty()) {
    std::vector<int32_t> forced = eng.tokenizer()->Encode(out->forced);
    out->gen.prompt.insert(out->gen.prompt.end(), forced.begin(), forced.end());
  }

  engine::SamplingParams& p = out->gen.sampling;
  const int64_t context = eng.config().max_position_embeddings;
  const int64_t room = context - static_cast<int64_t>(out->gen.prompt.size());
  const int default_max =
      static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(kDefaultMaxTokens, room)));
  if (auto e = ParseSampling(body, eng, default_max, &p)) return e;
  if (auto e = GetBool(body, "logprobs", &out->logprobs)) return e;
  if (auto e = GetBool(body, "parallel_tool_calls", &out->parallel_tool_calls)) return e;
  int64_t top = 0;
  if (auto e = GetInt(body, "top_logprobs", 0, 20, &top)) return e;
  if (top > 0 && !out->logprobs) return Invalid("top_logprobs: needs \"logprobs\": true");
  p.logprobs = static_cast<int>(top);
  p.want_logprob = out->logprobs;
  if (auto e = ParseStreamFlags(body, &out->stream, &out->include_usage)) return e;
  int64_t n = 1;
  if (auto e = GetInt(body, "n", 1, 1, &n)) {
    e->message = "n: only 1 choice per request is supported";
    return e;
  }
  return std::nullopt;
}

std::optional<FieldError> ParseChatBody(const ojson& body, const std::string& model_id,
                                        const engine::Engine& eng, const ToolCallLedger* ledger,
                                        ChatRequest* out) {
  return ParseChat(json::parse(body.dump()), body, model_id, eng, ledger, out);
}

bool ParseTranslated(const httplib::Request& req, httplib::Response& res, const engine::Engine* eng,
                     const Translate& translate, const std::string& model_id,
                     const ToolCallLedger* ledger, size_t max_messages, json* body,
                     ChatRequest* out) {
  if (eng == nullptr || eng->tokenizer() == nullptr) {
    WriteError(res, 503, "unavailable_error", "the model is not loaded yet; see /health");
    return false;
  }
  if (!ParseJsonBody(req, res, body)) return false;
  ojson chat_body;
  out->max_messages = max_messages;
  std::optional<FieldError> e = translate(ojson::parse(req.body), &chat_body);
  if (!e) e = ParseChatBody(chat_body, model_id, *eng, ledger, out);
  if (e) WriteError(res, e->status, e->type, e->message);
  return !e;
}

json ChatUsage(const GenerationEvent& done) {
  json u = Usage(done);
  // OpenAI's and DeepSeek's names for the prompt tokens the prefix cache restored.
  u["prompt_tokens_details"] = {{"cached_tokens", done.cached_tokens}};
  u["prompt_cache_hit_tokens"] = done.cached_tokens;
  u["prompt_cache_miss_tokens"] = done.prompt_tokens - done.cached_tokens;
  return u;
}

// OpenAI's chat logprobs entry for one token.
// The answer to a reply that was generated but could not be kept (a session turn whose save
// failed): the client must not take it for a committed turn.
static json StorageError(const Status& s) {
  return json{{"error",
               {{"type", "storage_error"},
                {"code", 507},
                {"message", "the reply could not be saved, so it is not part of the session: " +
                                s.message()}}}};
}

static json TokenLogprobs(const engine::Tokenizer* tok, const GenerationEvent& e) {
  auto entry = [tok](int32_t id, float logprob) {
    const int32_t one[1] = {id};
    const std::string raw = tok->Decode(one);
    json bytes = json::array();
    for (unsigned char c : raw) bytes.push_back(static_cast<int>(c));
    return json{{"token", engine::SanitizeUtf8(raw)}, {"logprob", logprob}, {"bytes", bytes}};
  };
  json item = entry(e.token.token, e.token.logprob);
  json top = json::array();
  for (const auto& [id, lp] : e.token.top) top.push_back(entry(id, lp));
  item["top_logprobs"] = top;
  return item;
}

std::string FinishReason(const GenerationEvent& done, bool called_tools) {
  return done.finish_reason == "stop" && called_tools ? "tool_calls" : done.finish_reason;
}

std::vector<json> Assembler::Deltas(const std::vector<ParseEvent>& events) {
  std::vector<json> out;
  for (const ParseEvent& e : events) {
    const bool call_event = e.kind == ParseEvent::Kind::kToolCallStart ||
                            e.kind == ParseEvent::Kind::kToolArguments ||
                            e.kind == ParseEvent::Kind::kToolCallEnd;
    if (!parallel_ && call_event && e.index > 0) {
      // parallel_tool_calls: false. The model wrote more than one call; only the first is
      // returned (and remembered), as if it had stopped there.
      if (e.kind == ParseEvent::Kind::kToolCallStart) {
        spdlog::info("parallel_tool_calls is false: dropping tool call {}", e.index);
      }
      continue;
    }
    switch (e.kind) {
      case ParseEvent::Kind::kReasoning:
        out.push_back({{"reasoning_content", e.text}});
        break;
      case ParseEvent::Kind::kContent:
        out.push_back({{"content", e.text}});
        break;
      case ParseEvent::Kind::kToolCallStart:
        ids_[e.index] = e.id;
        out.push_back(
            {{"tool_calls", json::array({{{"index", e.index},
                                          {"id", e.id},
                                          {"type", "function"},
                                          {"function", {{"name", e.text}, {"arguments", ""}}}}})}});
        break;
      case ParseEvent::Kind::kToolArguments:
        out.push_back({{"tool_calls", json::array({{{"index", e.index},
                                                    {"function", {{"arguments", e.text}}}}})}});
        break;
      case ParseEvent::Kind::kToolCallEnd:
        if (ids_.count(e.index)) ledger_->Remember(ids_[e.index], e.text);
        break;
      case ParseEvent::Kind::kWarning:
        spdlog::warn("model output: {}", e.text);
        break;
    }
  }
  return out;
}

}  // namespace chat

using namespace chat;

void Api::ChatCompletions(const httplib::Request& req, httplib::Response& res) const {
  const auto arrived = std::chrono::steady_clock::now();
  json body;
  if (!ParseJsonBody(req, res, &body)) return;
  ServeChat(body, ojson::parse(req.body), TenantOf(req), arrived, res, nullptr);
}

void Api::ServeChat(const json& body, const ojson& ordered, const std::string& tenant,
                    std::chrono::steady_clock::time_point arrived, httplib::Response& res,
                    ChatDone on_done) const {
  engine::Engine* eng = engine();
  if (eng == nullptr || eng->tokenizer() == nullptr) {
    return WriteError(res, 503, "unavailable_error",
                      "no model with a tokenizer is loaded yet; see /health");
  }
  ChatRequest cr;
  cr.max_messages = static_cast<size_t>(config_.server.max_messages);
  if (auto e = ParseChat(body, ordered, model_.id, *eng, &ledger_, &cr)) {
    return WriteError(res, e->status, e->type, e->message);
  }
  const std::string id = NewId("chatcmpl-");
  engine::Engine::PrefixKeys prompt_keys;
  if (on_done && eng->cache() != nullptr) prompt_keys = eng->KeysFor(cr.gen.prompt, tenant);
  std::shared_ptr<Generation> g = StartGeneration(eng, std::move(cr.gen), tenant, id, arrived, res);
  if (!g) return;
  const int64_t created = static_cast<int64_t>(std::time(nullptr));
  const engine::Tokenizer* tok = eng->tokenizer();
  auto assembler =
      std::make_shared<Assembler>(cr.options.thinking, &ledger_, cr.parallel_tool_calls);
  const std::vector<json> opening = assembler->Feed(cr.forced);
  const bool logprobs = cr.logprobs;
  struct State {
    std::string content;
    std::string reasoning;
    json tool_calls = json::array();
    json logprobs = json::array();
  };
  auto st = std::make_shared<State>();
  auto absorb = [st](const std::vector<json>& deltas) {
    for (const json& d : deltas) {
      if (d.contains("content")) st->content += d["content"].get<std::string>();
      if (d.contains("reasoning_content"))
        st->reasoning += d["reasoning_content"].get<std::string>();
      if (!d.contains("tool_calls")) continue;
      const json& call = d["tool_calls"][0];
      if (call.contains("id")) {
        st->tool_calls.push_back(
            {{"id", call["id"]},
             {"type", "function"},
             {"function", {{"name", call["function"]["name"]}, {"arguments", ""}}}});
      } else if (!st->tool_calls.empty()) {
        std::string args = st->tool_calls.back()["function"]["arguments"];
        st->tool_calls.back()["function"]["arguments"] =
            args + call["function"]["arguments"].get<std::string>();
      }
    }
  };
  absorb(opening);
  // The assistant message, as a client would send it back.
  auto message_of = [st]() {
    json message = {{"role", "assistant"}};
    message["content"] =
        st->content.empty() && !st->tool_calls.empty() ? json() : json(st->content);
    if (!st->reasoning.empty()) message["reasoning_content"] = st->reasoning;
    if (!st->tool_calls.empty()) message["tool_calls"] = st->tool_calls;
    return message;
  };

  if (cr.stream) {
    auto chunk = [id, created, model = model_.id, usage = cr.include_usage](
                     const json& delta, const json& lp, const json& finish) {
      json c = {
          {"id", id},
          {"object", "chat.completion.chunk"},
          {"created", created},
          {"model", model},
          {"choices",
           json::array(
               {{{"index", 0}, {"delta", delta}, {"logprobs", lp}, {"finish_reason", finish}}})}};
      if (usage) c["usage"] = nullptr;
      return c;
    };
    auto opened = std::make_shared<bool>(false);
    ServeStream(res, g, [=, usage = cr.include_usage](const GenerationEvent& e, std::string* out) {
      if (!*opened) {
        *opened = true;
        *out += SseEvent(chunk({{"role", "assistant"}, {"content", ""}}, nullptr, nullptr));
        for (const json& d : opening) *out += SseEvent(chunk(d, nullptr, nullptr));
      }
      if (e.kind == GenerationEvent::Kind::kToken) {
        std::vector<json> deltas = assembler->Feed(e.text);
        absorb(deltas);
        json lp = nullptr;
        if (logprobs) {
          lp = {{"content", json::array({TokenLogprobs(tok, e)})}};
          if (deltas.empty()) deltas.push_back(json::object());
        }
        for (size_t i = 0; i < deltas.size(); ++i) {
          *out += SseEvent(chunk(deltas[i], i == 0 ? lp : json(), nullptr));
        }
        return;
      }
      const std::vector<json> last = assembler->Finish();
      absorb(last);
      for (const json& d : last) *out += SseEvent(chunk(d, nullptr, nullptr));
      if (on_done) {
        if (Status saved = on_done(message_of(), e, prompt_keys); !saved.ok()) {
          *out += SseEvent(StorageError(saved));
          return;
        }
      }
      *out += SseEvent(chunk(json::object(), nullptr, FinishReason(e, assembler->called_tools())));
      if (usage) {
        json u = chunk(json::object(), nullptr, nullptr);
        u["choices"] = json::array();
        u["usage"] = ChatUsage(e);
        *out += SseEvent(u);
      }
    });
    return;
  }

  ServeWhole(
      res, g,
      [=](const GenerationEvent& e) {
        absorb(assembler->Feed(e.text));
        if (logprobs) st->logprobs.push_back(TokenLogprobs(tok, e));
      },
      [=, model = model_.id](const GenerationEvent& done) {
        absorb(assembler->Finish());
        const json message = message_of();
        if (on_done) {
          if (Status saved = on_done(message, done, prompt_keys); !saved.ok()) {
            return StorageError(saved);
          }
        }
        return json{
            {"id", id},
            {"object", "chat.completion"},
            {"created", created},
            {"model", model},
            {"choices",
             json::array({{{"index", 0},
                           {"message", message},
                           {"logprobs", logprobs ? json{{"content", st->logprobs}} : json()},
                           {"finish_reason", FinishReason(done, assembler->called_tools())}}})},
            {"usage", ChatUsage(done)}};
      });
}

}  // namespace flashd::api
