#include "tools-api/chat_format.h"

#include <cstdio>
#include <random>
#include <set>

#include "tools-api/json_limits.h"

namespace flashd::api {
namespace {

constexpr const char* kBos = "<｜begin▁of▁sentence｜>";
constexpr const char* kEos = "<｜end▁of▁sentence｜>";
constexpr const char* kThinkStart = "<think>";
constexpr const char* kThinkEnd = "</think>";
constexpr const char* kDsml = "｜DSML｜";
constexpr const char* kUser = "<｜User｜>";
constexpr const char* kAssistant = "<｜Assistant｜>";
constexpr const char* kSystem = "<｜System｜>";
constexpr const char* kLatestReminder = "<｜latest_reminder｜>";

const std::map<std::string, std::string>& TaskTokens() {
  static const std::map<std::string, std::string> t = {
      {"action", "<｜action｜>"}, {"query", "<｜query｜>"}, {"authority", "<｜authority｜>"},
      {"domain", "<｜domain｜>"}, {"title", "<｜title｜>"}, {"read_url", "<｜read_url｜>"}};
  return t;
}

std::string ToolsText(const std::string& schemas) {
  const std::string calls = std::string("<") + kDsml + " calls>";
  const std::string calls_end = std::string("</") + kDsml + " calls>";
  const std::string invoke = std::string("<") + kDsml + " invoke";
  const std::string invoke_end = std::string("</") + kDsml + " invoke>";
  const std::string param = std::string("<") + kDsml + " parameter";
  const std::string param_end = std::string("</") + kDsml + " parameter>";
  return "## Tools\n\nYou have access to a set of tools to help answer the user's question. You "
         "can "
         "invoke tools by writing a \"" +
         calls + "\" block like the following:\n\n" + calls + "\n" + invoke +
         " name=\"$TOOL_NAME\">\n" + param +
         " name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE" + param_end +
         "\n...\n" + invoke_end + "\n" + invoke + " name=\"$TOOL_NAME2\">\n...\n" + invoke_end +
         "\n" + calls_end +
         "\n\nString parameters should be specified as is and set `string=\"true\"`. For all other "
         "types (numbers, booleans, arrays, objects), pass the value in JSON format and set "
         "`string=\"false\"`.\n\nIf thinking_mode is enabled (triggered by <think>), you MUST "
         "output your complete reasoning inside <think>...</think> BEFORE any tool calls or final "
         "response.\n\nOtherwise, output directly after </think> with tool calls or final "
         "response.\n\n### Available Tool Schemas\n\n" +
         schemas +
         "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke "
         "tool calls.\n";
}

void AppendEscaped(const std::string& s, std::string* out) {
  *out += '"';
  for (unsigned char c : s) {
    switch (c) {
      case '"':
        *out += "\\\"";
        break;
      case '\\':
        *out += "\\\\";
        break;
      case '\n':
        *out += "\\n";
        break;
      case '\r':
        *out += "\\r";
        break;
      case '\t':
        *out += "\\t";
        break;
      case '\b':
        *out += "\\b";
        break;
      case '\f':
        *out += "\\f";
        break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          *out += buf;
        } else {
          *out += static_cast<char>(c);
        }
    }
  }
  *out += '"';
}

void Dump(const ojson& v, std::string* out) {
  switch (v.type()) {
    case ojson::value_t::object: {
      *out += '{';
      bool first = true;
      for (auto it = v.begin(); it != v.end(); ++it) {
        if (!first) *out += ", ";
        first = false;
        AppendEscaped(it.key(), out);
        *out += ": ";
        Dump(it.value(), out);
      }
      *out += '}';
      return;
    }
    case ojson::value_t::array: {
      *out += '[';
      for (size_t i = 0; i < v.size(); ++i) {
        if (i) *out += ", ";
        Dump(v[i], out);
      }
      *out += ']';
      return;
    }
    case ojson::value_t::string:
      AppendEscaped(v.get_ref<const std::string&>(), out);
      return;
    case ojson::value_t::number_float: {
      // Python writes integral floats with ".0" and large/small ones in exponent form; the
      // shortest round-trip digits are the same as nlohmann's.
      std::string s = v.dump();
      size_t e = s.find('e');
      if (e != std::string::npos) {
        // nlohmann writes 1e+16 / 1e-05 like Python; keep as is.
      }
      *out += s;
      return;
    }
    default:
      *out += v.dump();  // null, true, false, integers.
  }
}

bool IsUserLike(const ojson& messages, size_t idx) {
  const std::string role = messages[idx].value("role", "");
  return role == "user" || role == "developer" || (role == "system" && idx > 0);
}

int LastUserIndex(const ojson& messages) {
  for (int i = static_cast<int>(messages.size()) - 1; i >= 0; --i) {
    if (IsUserLike(messages, static_cast<size_t>(i))) return i;
  }
  return -1;
}

std::string ContentText(const ojson& content) {
  if (content.is_string()) return content.get<std::string>();
  if (content.is_array()) {  // OpenAI content parts: text parts joined.
    std::string out;
    for (const ojson& part : content) {
      if (part.is_object() && part.value("type", "") == "text") {
        if (!out.empty()) out += "\n\n";
        out += part.value("text", "");
      }
    }
    return out;
  }
  return "";
}

// Tool results become tool_result blocks of a user message; consecutive user messages merge.
ojson MergeToolMessages(const ojson& messages) {
  ojson merged = ojson::array();
  for (ojson msg : messages) {
    const std::string role = msg.value("role", "");
    if (role == "tool") {
      ojson block = {{"type", "tool_result"},
                     {"tool_use_id", msg.value("tool_call_id", "")},
                     {"content", msg.contains("content") ? msg["content"] : ojson("")}};
      if (!merged.empty() && merged.back().value("role", "") == "user" &&
          merged.back().contains("content_blocks")) {
        merged.back()["content_blocks"].push_back(block);
      } else {
        merged.push_back({{"role", "user"}, {"content_blocks", ojson::array({block})}});
      }
    } else if (role == "user") {
      ojson blocks =
          msg.contains("content_blocks")
              ? msg["content_blocks"]
              : ojson::array({{{"type", "text"}, {"text", ContentText(msg["content"])}}});
      if (!merged.empty() && merged.back().value("role", "") == "user" &&
          merged.back().contains("content_blocks") &&
          (!merged.back().contains("task") || merged.back()["task"].is_null())) {
        for (const ojson& b : blocks) merged.back()["content_blocks"].push_back(b);
      } else {
        msg["content_blocks"] = blocks;
        merged.push_back(msg);
      }
    } else {
      merged.push_back(msg);
    }
  }
  return merged;
}

// Orders tool_result blocks by the order of the calls in the preceding assistant message.
void SortToolResults(ojson* messages) {
  std::map<std::string, int> order;
  for (ojson& msg : *messages) {
    const std::string role = msg.value("role", "");
    if (role == "assistant" && msg.contains("tool_calls") && msg["tool_calls"].is_array() &&
        !msg["tool_calls"].empty()) {
      order.clear();
      int idx = 0;
      for (const ojson& tc : msg["tool_calls"]) {
        std::string id = tc.value("id", "");
        if (id.empty() && tc.contains("function")) id = tc["function"].value("id", "");
        if (!id.empty()) order[id] = idx;
        ++idx;
      }
    } else if (role == "user" && msg.contains("content_blocks")) {
      std::vector<ojson> results;
      for (const ojson& b : msg["content_blocks"]) {
        if (b.value("type", "") == "tool_result") results.push_back(b);
      }
      if (results.size() > 1 && !order.empty()) {
        std::stable_sort(results.begin(), results.end(), [&](const ojson& a, const ojson& b) {
          auto key = [&](const ojson& x) {
            auto it = order.find(x.value("tool_use_id", ""));
            return it == order.end() ? 0 : it->second;
          };
          return key(a) < key(b);
        });
        size_t next = 0;
        for (ojson& b : msg["content_blocks"]) {
          if (b.value("type", "") == "tool_result") b = results[next++];
        }
      }
    }
  }
}

ojson DropThinking(const ojson& messages) {
  const int last = LastUserIndex(messages);
  static const std::set<std::string> keep = {"user", "system", "tool", "latest_reminder",
                                             "direct_search_results"};
  ojson out = ojson::array();
  for (size_t i = 0; i < messages.size(); ++i) {
    const std::string role = messages[i].value("role", "");
    if (keep.count(role) || static_cast<int>(i) >= last) {
      out.push_back(messages[i]);
    } else if (role == "assistant") {
      ojson m = messages[i];
      m.erase("reasoning_content");
      out.push_back(m);
    }
  }
  return out;
}

// Accumulates the prompt, remembering which bytes came from the client.
struct Builder {
  RenderedPrompt p;
  // The message whose later content blocks start divergence points too (RenderChat).
  size_t split_message = static_cast<size_t>(-1);
  void Control(const std::string& s) { p.text += s; }
  void Data(const std::string& s) {
    if (s.empty()) return;
    p.untrusted.push_back({p.text.size(), p.text.size() + s.size()});
    p.text += s;
  }
};

Status RenderInvokeInto(const ojson& call, const ToolCallLedger* ledger, const std::string& where,
                        Builder* b) {
  std::string remembered;
  const std::string id = call.value("id", "");
  if (ledger != nullptr && !id.empty() && ledger->Lookup(id, &remembered)) {
    b->Data(remembered);  // The model's own bytes, exactly as sampled.
    return Status::Ok();
  }
  if (!call.contains("function") || !call["function"].is_object()) {
    return InvalidArgument(where + ".function: expected an object");
  }
  const ojson& fn = call["function"];
  if (!fn.contains("name") || !fn["name"].is_string()) {
    return InvalidArgument(where + ".function.name: expected a string");
  }
  ojson args;
  if (fn.contains("arguments") && fn["arguments"].is_string()) {
    if (std::optional<std::string> e =
            ParseOutsideJson(fn["arguments"].get<std::string>(), &args)) {
      return InvalidArgument(where + ".function.arguments: not valid JSON: " + *e);
    }
  } else if (fn.contains("arguments")) {
    args = fn["arguments"];
  }
  if (!args.is_object()) {
    return InvalidArgument(where + ".function.arguments: expected a JSON object");
  }
  b->Control(std::string("<") + kDsml + " invoke name=\"");
  b->Data(fn["name"].get<std::string>());
  b->Control("\">\n");
  bool first = true;
  for (auto it = args.begin(); it != args.end(); ++it) {
    if (!first) b->Control("\n");
    first = false;
    b->Control(std::string("<") + kDsml + " parameter name=\"");
    b->Data(it.key());
    const bool is_string = it.value().is_string();
    b->Control(std::string("\" string=\"") + (is_string ? "true" : "false") + "\">");
    b->Data(is_string ? it.value().get<std::string>() : PythonJson(it.value()));
    b->Control(std::string("</") + kDsml + " parameter>");
  }
  b->Control(std::string("\n</") + kDsml + " invoke>");
  return Status::Ok();
}

Status RenderMessage(size_t index, const ojson& messages, const ChatOptions& o, bool drop,
                     const ToolCallLedger* ledger, Builder* b) {
  const ojson& msg = messages[index];
  const std::string where = "messages[" + std::to_string(index) + "]";
  const int last_user = LastUserIndex(messages);
  const std::string role = msg.value("role", "");
  const std::string content = msg.contains("content") ? ContentText(msg["content"]) : "";

  // The reasoning effort, in thinking mode, opens the prompt.
  std::string effort_text;
  if (index == 0 && o.thinking) {
    int budget = 50;
    const ojson& e = o.reasoning_effort;
    if (e.is_number_integer()) {
      budget = e.get<int>();
    } else if (e.is_string()) {
      static const std::map<std::string, int> names = {
          {"low", 25}, {"high", 50}, {"xhigh", 75}, {"max", 100}};
      budget = names.at(e.get<std::string>());
    }
    effort_text = "Reasoning Effort: " + std::to_string(budget) +
                  " (range 1-100, the higher the value, the more thorough the reasoning)\n\n";
  }
  if (index == 0 && (!effort_text.empty() || role == "system")) b->Control(kSystem);
  b->Control(effort_text);

  auto render_tools_and_format = [&]() -> Status {
    if (msg.contains("tools") && msg["tools"].is_array() && !msg["tools"].empty()) {
      std::string schemas;
      for (size_t i = 0; i < msg["tools"].size(); ++i) {
        const ojson& tool = msg["tools"][i];
        if (!tool.is_object() || !tool.contains("function")) {
          return InvalidArgument(where + ".tools[" + std::to_string(i) +
                                 "]: expected {\"type\": \"function\", \"function\": {...}}");
        }
        if (i) schemas += "\n";
        schemas += PythonJson(tool["function"]);
      }
      // The schemas are the client's; the template around them is the model's.
      const std::string full = ToolsText(schemas);
      const size_t at = full.find(schemas);
      b->Control("\n\n" + full.substr(0, at));
      b->Data(schemas);
      b->Control(full.substr(at + schemas.size()));
    }
    if (msg.contains("response_format") && !msg["response_format"].is_null() &&
        !(msg["response_format"].is_object() && msg["response_format"].empty())) {
      b->Control(
          "\n\n## Response Format:\n\nYou MUST strictly adhere to the following schema to "
          "reply:\n");
      b->Data(PythonJson(msg["response_format"]));
    }
    return Status::Ok();
  };

  if (role == "system") {
    if (index > 0) b->Control(kSystem);
    b->Data(content);
    FLASHD_RETURN_IF_ERROR(render_tools_and_format());
  } else if (role == "developer") {
    if (content.empty()) return InvalidArgument(where + ".content: a developer message needs text");
    b->Control(kUser);
    b->Data(content);
    FLASHD_RETURN_IF_ERROR(render_tools_and_format());
  } else if (role == "user") {
    b->Control(kUser);
    const ojson& blocks = msg["content_blocks"];
    for (size_t i = 0; i < blocks.size(); ++i) {
      if (i) b->Control("\n\n");
      // Consecutive user messages render as one turn; in the first turn after the system
      // block, where each part began (Codex's environment, then the task) is where sessions and
      // their subagents part.
      if (i && index == b->split_message) b->p.divergence_points.push_back(b->p.text.size());
      const ojson& block = blocks[i];
      const std::string type = block.value("type", "");
      if (type == "text") {
        b->Data(block.value("text", ""));
      } else if (type == "tool_result") {
        std::string text;
        const ojson& c = block.contains("content") ? block["content"] : ojson("");
        if (c.is_array()) {
          for (size_t k = 0; k < c.size(); ++k) {
            if (k) text += "\n\n";
            text += c[k].value("type", "") == "text"
                        ? c[k].value("text", "")
                        : "[Unsupported " + c[k].value("type", "") + "]";
          }
        } else if (c.is_string()) {
          text = c.get<std::string>();
        }
        b->Control("<tool_result>");
        b->Data(text);
        b->Control("</tool_result>");
      } else {
        b->Control("[Unsupported " + type + "]");
      }
    }
  } else if (role == "latest_reminder") {
    b->Control(kLatestReminder);
    b->Data(content);
  } else if (role == "assistant") {
    const bool prev_has_task =
        index > 0 && messages[index - 1].contains("task") && !messages[index - 1]["task"].is_null();
    if (o.thinking && !prev_has_task && (!drop || static_cast<int>(index) > last_user)) {
      b->Data(msg.value("reasoning_content", ""));
      b->Control(kThinkEnd);
    }
    b->Data(content);
    if (msg.contains("tool_calls") && msg["tool_calls"].is_array() && !msg["tool_calls"].empty()) {
      b->Control(std::string("\n\n<") + kDsml + " calls>\n");
      for (size_t i = 0; i < msg["tool_calls"].size(); ++i) {
        if (i) b->Control("\n");
        FLASHD_RETURN_IF_ERROR(RenderInvokeInto(
            msg["tool_calls"][i], ledger, where + ".tool_calls[" + std::to_string(i) + "]", b));
      }
      b->Control(std::string("\n</") + kDsml + " calls>");
    }
    if (!msg.value("wo_eos", false)) b->Control(kEos);
  } else {
    return InvalidArgument(where + ".role: unsupported role \"" + role + "\"");
  }

  // What follows the message: nothing if the next one is not the assistant's, else the
  // assistant header (or a task token).
  if (index + 1 < messages.size()) {
    const std::string next = messages[index + 1].value("role", "");
    if (next != "assistant" && next != "latest_reminder") return Status::Ok();
  }
  if (msg.contains("task") && !msg["task"].is_null()) {
    const std::string task = msg["task"].is_string() ? msg["task"].get<std::string>() : "";
    auto it = TaskTokens().find(task);
    if (it == TaskTokens().end()) return InvalidArgument(where + ".task: unknown task");
    if (task != "action") {
      b->Control(it->second);
    } else {
      b->Control(kAssistant);
      b->Control(o.thinking ? kThinkStart : kThinkEnd);
      b->Control(it->second);
    }
  } else if (IsUserLike(messages, index)) {
    b->Control(kAssistant);
    if (!drop && o.thinking) {
      b->Control(kThinkStart);
    } else if (drop && o.thinking && static_cast<int>(index) >= last_user) {
      b->Control(kThinkStart);
    } else {
      b->Control(kThinkEnd);
    }
  }
  return Status::Ok();
}

}  // namespace

std::string PythonJson(const ojson& value) {
  std::string out;
  Dump(value, &out);
  return out;
}

StatusOr<std::string> RenderInvoke(const std::string& name, const ojson& arguments) {
  Builder b;
  ojson call = {{"function", {{"name", name}, {"arguments", arguments}}}};
  FLASHD_RETURN_IF_ERROR(RenderInvokeInto(call, nullptr, "tool_call", &b));
  return b.p.text;
}

StatusOr<RenderedPrompt> RenderChat(const ojson& input, const ChatOptions& o,
                                    const ToolCallLedger* ledger) {
  if (!input.is_array()) return InvalidArgument("messages: expected an array");
  for (size_t i = 0; i < input.size(); ++i) {
    const std::string where = "messages[" + std::to_string(i) + "]";
    if (!input[i].is_object()) return InvalidArgument(where + ": expected an object");
    if (!input[i].contains("role") || !input[i]["role"].is_string()) {
      return InvalidArgument(where + ".role: expected a string");
    }
    if (input[i].contains("content") && !input[i]["content"].is_null() &&
        !input[i]["content"].is_string() && !input[i]["content"].is_array()) {
      return InvalidArgument(where + ".content: expected a string or an array of parts");
    }
  }
  if (o.thinking && !o.reasoning_effort.is_null()) {
    const ojson& e = o.reasoning_effort;
    const bool ok = (e.is_number_integer() && e.get<int>() >= 1 && e.get<int>() <= 100) ||
                    (e.is_string() && (e == "low" || e == "high" || e == "xhigh" || e == "max"));
    if (!ok) {
      return InvalidArgument("reasoning_effort: expected 1-100 or one of low, high, xhigh, max");
    }
  }
  ojson messages = MergeToolMessages(input);
  SortToolResults(&messages);
  bool drop = o.drop_thinking;
  for (const ojson& m : messages) {
    if (m.contains("tools") && m["tools"].is_array() && !m["tools"].empty()) drop = false;
  }
  if (o.thinking && drop) messages = DropThinking(messages);
  Builder b;
  if (o.add_bos) b.Control(kBos);
  size_t first_other = 0;
  while (first_other < messages.size() && messages[first_other].value("role", "") == "system") {
    ++first_other;
  }
  b.split_message = first_other;
  for (size_t i = 0; i < messages.size(); ++i) {
    // After each leading system message, and after the first message past them (often per-
    // session context: Codex's environment, a repository's instructions), which a session's
    // subagents and its compacted continuation share before they part.
    if (i > 0 && (messages[i - 1].value("role", "") == "system" || i - 1 == first_other)) {
      b.p.divergence_points.push_back(b.p.text.size());
    }
    FLASHD_RETURN_IF_ERROR(RenderMessage(i, messages, o, drop, ledger, &b));
  }
  return b.p;
}

std::string ToolCallLedger::NewId() {
  static const char kAlphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
  std::random_device rd;  // The kernel's entropy: ids must not be guessable.
  std::string id = "call_";
  for (int i = 0; i < 24; ++i) id += kAlphabet[rd() % 62];
  return id;
}

void ToolCallLedger::Attach(Store store, Load load) {
  std::lock_guard<std::mutex> lock(mu_);
  store_ = std::move(store);
  load_ = std::move(load);
}

void ToolCallLedger::KeepLocked(const std::string& id, std::string invoke_text) const {
  if (calls_.insert_or_assign(id, std::move(invoke_text)).second) order_.push_back(id);
  while (calls_.size() > kMemoryCalls) {
    calls_.erase(order_.front());
    order_.pop_front();
  }
}

void ToolCallLedger::Remember(const std::string& id, std::string invoke_text) {
  std::lock_guard<std::mutex> lock(mu_);
  if (store_) store_(id, invoke_text);
  KeepLocked(id, std::move(invoke_text));
}

bool ToolCallLedger::Lookup(const std::string& id, std::string* invoke_text) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = calls_.find(id);
  if (it != calls_.end()) {
    *invoke_text = it->second;
    return true;
  }
  if (!load_) return false;
  std::optional<std::string> stored = load_(id);
  if (!stored) return false;
  *invoke_text = *stored;
  KeepLocked(id, std::move(*stored));
  return true;
}

size_t ToolCallLedger::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return calls_.size();
}

}  // namespace flashd::api
