#include "tools-api/chat_parser.h"

#include <nlohmann/json.hpp>

#include "tools-api/chat_format.h"

namespace flashd::api {
namespace {

const std::string kThinkEnd = "</think>";
const std::string kEos = "<｜end▁of▁sentence｜>";
const std::string kCallsStart = "\n\n<｜DSML｜ calls>";
const std::string kCallsEnd = "</｜DSML｜ calls>";
const std::string kInvokeStart = "<｜DSML｜ invoke name=\"";
const std::string kInvokeEnd = "</｜DSML｜ invoke>";
const std::string kParamStart = "<｜DSML｜ parameter name=\"";
const std::string kParamEnd = "</｜DSML｜ parameter>";

// How many bytes at the end of `s` could be the start of one of `marks` (so must wait).
size_t HeldBack(const std::string& s, std::initializer_list<const std::string*> marks) {
  size_t hold = 0;
  for (const std::string* m : marks) {
    for (size_t n = std::min(s.size(), m->size() - 1); n > hold; --n) {
      if (s.compare(s.size() - n, n, *m, 0, n) == 0) {
        hold = n;
        break;
      }
    }
  }
  return hold;
}

// Also never split a UTF-8 character: the held-back point moves before any partial one.
size_t SafeEnd(const std::string& s, size_t end) {
  size_t i = end;
  while (i > 0 && i > end - std::min<size_t>(end, 3) &&
         (static_cast<unsigned char>(s[i - 1]) & 0xC0) == 0x80) {
    --i;
  }
  if (i > 0 && (static_cast<unsigned char>(s[i - 1]) & 0xC0) == 0xC0) {
    const unsigned char lead = static_cast<unsigned char>(s[i - 1]);
    const size_t need = lead >= 0xF0 ? 4 : lead >= 0xE0 ? 3 : 2;
    if (end - (i - 1) < need) return i - 1;
  }
  return end;
}

std::string JsonString(const std::string& s) { return PythonJson(ojson(s)); }

// A string's JSON encoding without the surrounding quotes, for streaming its pieces.
std::string JsonBody(const std::string& s) {
  std::string q = JsonString(s);
  return q.substr(1, q.size() - 2);
}

}  // namespace

ChatOutputParser::ChatOutputParser(bool thinking)
    : state_(thinking ? State::kReasoning : State::kContent) {}

std::vector<ParseEvent> ChatOutputParser::Feed(std::string_view text) {
  buf_.append(text);
  std::vector<ParseEvent> out;
  Run(&out, false);
  return out;
}

std::vector<ParseEvent> ChatOutputParser::Finish() {
  std::vector<ParseEvent> out;
  Run(&out, true);
  switch (state_) {
    case State::kReasoning:
      if (!buf_.empty()) EmitText(ParseEvent::Kind::kReasoning, buf_, &out);
      out.push_back({ParseEvent::Kind::kWarning, -1, "output ended inside the reasoning", ""});
      break;
    case State::kContent:
    case State::kRaw:
    case State::kAfterCalls:
      if (!buf_.empty()) EmitText(ParseEvent::Kind::kContent, buf_, &out);
      break;
    case State::kDone:
      break;
    default:
      Malformed("output ended inside a tool-call block", &out);
      if (!buf_.empty()) EmitText(ParseEvent::Kind::kContent, buf_, &out);
      break;
  }
  buf_.clear();
  state_ = State::kDone;
  return out;
}

void ChatOutputParser::EmitText(ParseEvent::Kind kind, std::string text,
                                std::vector<ParseEvent>* out) {
  if (text.empty()) return;
  if (!out->empty() && out->back().kind == kind && kind != ParseEvent::Kind::kToolArguments) {
    out->back().text += text;
    return;
  }
  out->push_back(
      {kind, kind == ParseEvent::Kind::kToolArguments ? call_index_ : -1, std::move(text), ""});
}

void ChatOutputParser::Malformed(const std::string& why, std::vector<ParseEvent>* out) {
  out->push_back({ParseEvent::Kind::kWarning, call_index_,
                  "malformed tool call output (" + why + "); passed on as text", ""});
  // The block so far becomes text again: nothing the model wrote is lost.
  buf_ = block_text_ + buf_;
  block_text_.clear();
  state_ = State::kRaw;
}

void ChatOutputParser::Run(std::vector<ParseEvent>* out, bool final) {
  for (;;) {
    switch (state_) {
      case State::kReasoning: {
        size_t at = buf_.find(kThinkEnd);
        if (at == std::string::npos) {
          size_t keep = final ? 0 : HeldBack(buf_, {&kThinkEnd});
          size_t end = SafeEnd(buf_, buf_.size() - keep);
          EmitText(ParseEvent::Kind::kReasoning, buf_.substr(0, end), out);
          buf_.erase(0, end);
          return;
        }
        EmitText(ParseEvent::Kind::kReasoning, buf_.substr(0, at), out);
        buf_.erase(0, at + kThinkEnd.size());
        state_ = State::kContent;
        continue;
      }
      case State::kContent: {
        size_t calls = buf_.find(kCallsStart);
        size_t eos = buf_.find(kEos);
        size_t at = std::min(calls, eos);
        if (at == std::string::npos) {
          size_t keep = final ? 0 : HeldBack(buf_, {&kCallsStart, &kEos});
          size_t end = SafeEnd(buf_, buf_.size() - keep);
          EmitText(ParseEvent::Kind::kContent, buf_.substr(0, end), out);
          buf_.erase(0, end);
          return;
        }
        EmitText(ParseEvent::Kind::kContent, buf_.substr(0, at), out);
        if (at == eos) {
          buf_.erase(0, at + kEos.size());
          state_ = State::kDone;
          continue;
        }
        block_text_ = kCallsStart;
        buf_.erase(0, at + kCallsStart.size());
        state_ = State::kCallsOpen;
        continue;
      }
      case State::kCallsOpen:
      case State::kAfterInvoke: {
        // Newlines, then the next call or the end of the block.
        size_t i = 0;
        while (i < buf_.size() && buf_[i] == '\n') ++i;
        block_text_ += buf_.substr(0, i);
        buf_.erase(0, i);
        if (buf_.compare(0, kInvokeStart.size(), kInvokeStart) == 0) {
          block_text_ += kInvokeStart;
          invoke_text_ = kInvokeStart;
          buf_.erase(0, kInvokeStart.size());
          state_ = State::kInvokeName;
          continue;
        }
        if (state_ == State::kAfterInvoke && buf_.compare(0, kCallsEnd.size(), kCallsEnd) == 0) {
          buf_.erase(0, kCallsEnd.size());
          block_text_.clear();
          state_ = State::kAfterCalls;
          continue;
        }
        const bool could_be = kInvokeStart.compare(0, buf_.size(), buf_) == 0 ||
                              kCallsEnd.compare(0, buf_.size(), buf_) == 0;
        if (buf_.size() < std::max(kInvokeStart.size(), kCallsEnd.size()) && could_be && !final) {
          return;  // Wait for more.
        }
        if (buf_.empty() && final) return;
        Malformed("expected an invoke tag", out);
        continue;
      }
      case State::kInvokeName: {
        size_t at = buf_.find("\">\n");
        if (at == std::string::npos) {
          if (buf_.find('\n') != std::string::npos || buf_.size() > 512) {
            Malformed("tool name not closed", out);
            continue;
          }
          return;
        }
        const std::string name = buf_.substr(0, at);
        block_text_ += buf_.substr(0, at + 3);
        invoke_text_ += buf_.substr(0, at + 3);
        buf_.erase(0, at + 3);
        ++call_index_;
        params_in_call_ = 0;
        out->push_back(
            {ParseEvent::Kind::kToolCallStart, call_index_, name, ToolCallLedger::NewId()});
        state_ = State::kInvokeBody;
        continue;
      }
      case State::kInvokeBody: {
        size_t i = 0;
        while (i < buf_.size() && buf_[i] == '\n') ++i;
        block_text_ += buf_.substr(0, i);
        invoke_text_ += buf_.substr(0, i);
        buf_.erase(0, i);
        if (buf_.compare(0, kParamStart.size(), kParamStart) == 0) {
          block_text_ += kParamStart;
          invoke_text_ += kParamStart;
          buf_.erase(0, kParamStart.size());
          state_ = State::kParamName;
          continue;
        }
        if (buf_.compare(0, kInvokeEnd.size(), kInvokeEnd) == 0) {
          block_text_ += kInvokeEnd;
          invoke_text_ += kInvokeEnd;
          buf_.erase(0, kInvokeEnd.size());
          EmitText(ParseEvent::Kind::kToolArguments, params_in_call_ == 0 ? "{}" : "}", out);
          out->push_back({ParseEvent::Kind::kToolCallEnd, call_index_, invoke_text_, ""});
          state_ = State::kAfterInvoke;
          continue;
        }
        const bool could_be = kParamStart.compare(0, buf_.size(), buf_) == 0 ||
                              kInvokeEnd.compare(0, buf_.size(), buf_) == 0;
        if (!final && could_be) return;
        if (buf_.empty() && final) return;
        Malformed("expected a parameter or the end of the call", out);
        continue;
      }
      case State::kParamName: {
        const std::string mid = "\" string=\"";
        size_t at = buf_.find(mid);
        size_t close = at == std::string::npos ? std::string::npos : buf_.find("\">", at);
        if (close == std::string::npos) {
          if (buf_.size() > 1024 || buf_.find('\n') != std::string::npos) {
            Malformed("parameter header not closed", out);
            continue;
          }
          return;
        }
        param_name_ = buf_.substr(0, at);
        const std::string flag = buf_.substr(at + mid.size(), close - at - mid.size());
        if (flag != "true" && flag != "false") {
          Malformed("string= must be true or false", out);
          continue;
        }
        param_is_string_ = flag == "true";
        block_text_ += buf_.substr(0, close + 2);
        invoke_text_ += buf_.substr(0, close + 2);
        buf_.erase(0, close + 2);
        EmitText(ParseEvent::Kind::kToolArguments,
                 std::string(params_in_call_ == 0 ? "{" : ", ") + JsonString(param_name_) + ": " +
                     (param_is_string_ ? "\"" : ""),
                 out);
        ++params_in_call_;
        param_value_.clear();
        state_ = State::kParamValue;
        continue;
      }
      case State::kParamValue: {
        size_t at = buf_.find(kParamEnd);
        size_t end = at;
        if (at == std::string::npos) {
          end = SafeEnd(buf_, buf_.size() - (final ? 0 : HeldBack(buf_, {&kParamEnd})));
        }
        const std::string piece = buf_.substr(0, end);
        block_text_ += piece;
        invoke_text_ += piece;
        buf_.erase(0, end);
        if (param_is_string_) {
          EmitText(ParseEvent::Kind::kToolArguments, JsonBody(piece), out);
        } else {
          param_value_ += piece;
        }
        if (at == std::string::npos) return;
        block_text_ += kParamEnd;
        invoke_text_ += kParamEnd;
        buf_.erase(0, kParamEnd.size());
        if (param_is_string_) {
          EmitText(ParseEvent::Kind::kToolArguments, "\"", out);
        } else if (nlohmann::json::accept(param_value_)) {
          EmitText(ParseEvent::Kind::kToolArguments, param_value_, out);
        } else {
          out->push_back({ParseEvent::Kind::kWarning, call_index_,
                          "parameter \"" + param_name_ +
                              "\" is marked non-string but is not JSON; passed on as a string",
                          ""});
          EmitText(ParseEvent::Kind::kToolArguments, JsonString(param_value_), out);
        }
        state_ = State::kInvokeBody;
        continue;
      }
      case State::kAfterCalls: {
        if (buf_.compare(0, kEos.size(), kEos) == 0) {
          buf_.erase(0, kEos.size());
          state_ = State::kDone;
          continue;
        }
        if (!final && kEos.compare(0, buf_.size(), buf_) == 0) return;
        if (buf_.empty()) return;
        out->push_back({ParseEvent::Kind::kWarning, -1,
                        "text after the tool calls; passed on as content", ""});
        state_ = State::kRaw;
        continue;
      }
      case State::kRaw:
        EmitText(ParseEvent::Kind::kContent, buf_, out);
        buf_.clear();
        return;
      case State::kDone:
        if (!buf_.empty()) {
          out->push_back({ParseEvent::Kind::kWarning, -1,
                          "text after the end of the message; passed on as content", ""});
          EmitText(ParseEvent::Kind::kContent, buf_, out);
          buf_.clear();
        }
        return;
    }
  }
}

}  // namespace flashd::api
