// ChatOutputParser: the model's output, fed as it is generated, split into reasoning, content and
// tool calls, so a stream can send each tool call's name as soon as it is known and its
// arguments as they arrive.
//
// Arguments are assembled into the JSON object text the official decoder produces:
// {"key": value, ...} with string parameters JSON-encoded and other parameters as written.
// Malformed output (an unexpected tag, an unclosed block, a non-string parameter that is not
// JSON) never throws and never drops text: what cannot be parsed is passed on as content, with a
// warning event saying why. Not thread-safe; one parser per generation.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace flashd::api {

struct ParseEvent {
  enum class Kind {
    kReasoning,      // text: a reasoning delta
    kContent,        // text: a content delta
    kToolCallStart,  // index, name (in text), id
    kToolArguments,  // index, text: the next fragment of the arguments JSON
    kToolCallEnd,    // index; text: the exact DSML of the call, for exact replay
    kWarning,        // text: what was malformed
  };
  Kind kind;
  int index = -1;
  std::string text;
  std::string id;
};

class ChatOutputParser {
 public:
  // `thinking`: generation starts inside the reasoning (the prompt ended with "<think>").
  explicit ChatOutputParser(bool thinking);

  std::vector<ParseEvent> Feed(std::string_view text);
  // The end of generation: flushes held-back text and reports anything left open.
  std::vector<ParseEvent> Finish();

 private:
  enum class State {
    kReasoning,
    kContent,
    kCallsOpen,
    kInvokeName,
    kInvokeBody,
    kParamName,
    kParamValue,
    kAfterInvoke,
    kAfterCalls,
    kRaw,
    kDone,
  };
  void Run(std::vector<ParseEvent>* out, bool final);
  void Malformed(const std::string& why, std::vector<ParseEvent>* out);
  void EmitText(ParseEvent::Kind kind, std::string text, std::vector<ParseEvent>* out);

  State state_;
  std::string buf_;          // Unconsumed output.
  std::string block_text_;   // Raw text of the tool-calls block so far (for the malformed case).
  std::string invoke_text_;  // Raw text of the current call.
  std::string param_name_;
  bool param_is_string_ = false;
  std::string param_value_;  // Non-string values wait for their end to be checked.
  int call_index_ = -1;
  int params_in_call_ = 0;
};

}  // namespace flashd::api
