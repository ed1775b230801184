#include "tools-api/chat_parser.h"

#include <boost/test/unit_test.hpp>
#include <fstream>
#include <sstream>

#include "tools-api/chat_common.h"
#include "tools-api/chat_format.h"

namespace flashd::api {
namespace {

struct Parsed {
  std::string content, reasoning;
  std::vector<std::string> names, arguments, invoke_texts, ids;
  std::vector<std::string> warnings;
  bool name_before_arguments_done = true;
};

// Feeds `text` in pieces of `chunk` bytes and collects what the events say.
Parsed Parse(const std::string& text, bool thinking, size_t chunk) {
  ChatOutputParser parser(thinking);
  Parsed p;
  std::vector<bool> closed;
  auto take = [&](const std::vector<ParseEvent>& events) {
    for (const ParseEvent& e : events) {
      switch (e.kind) {
        case ParseEvent::Kind::kReasoning:
          p.reasoning += e.text;
          break;
        case ParseEvent::Kind::kContent:
          p.content += e.text;
          break;
        case ParseEvent::Kind::kToolCallStart:
          BOOST_REQUIRE(e.index == static_cast<int>(p.names.size()));
          p.names.push_back(e.text);
          p.ids.push_back(e.id);
          p.arguments.emplace_back();
          closed.push_back(false);
          break;
        case ParseEvent::Kind::kToolArguments:
          BOOST_REQUIRE(e.index >= 0 && e.index < static_cast<int>(p.arguments.size()));
          if (closed[e.index]) p.name_before_arguments_done = false;
          p.arguments[e.index] += e.text;
          break;
        case ParseEvent::Kind::kToolCallEnd:
          closed[e.index] = true;
          p.invoke_texts.push_back(e.text);
          break;
        case ParseEvent::Kind::kWarning:
          p.warnings.push_back(e.text);
          break;
      }
    }
  };
  for (size_t i = 0; i < text.size(); i += chunk) take(parser.Feed(text.substr(i, chunk)));
  take(parser.Finish());
  return p;
}

BOOST_AUTO_TEST_SUITE(chat_parser)

BOOST_AUTO_TEST_CASE(parses_like_the_official_decoder_in_any_chunking) {
  std::ifstream in(FLASHD_PARSE_CASES);
  std::stringstream ss;
  ss << in.rdbuf();
  ojson cases = ojson::parse(ss.str());
  BOOST_REQUIRE(cases.size() >= 6u);
  for (const ojson& c : cases) {
    const std::string text = c["completion"].get<std::string>();
    for (size_t chunk : {1u, 2u, 3u, 7u, 64u, 100000u}) {
      BOOST_TEST_CONTEXT("case " << c["name"].get<std::string>() << ", chunks of " << chunk) {
        Parsed p = Parse(text, c["thinking"].get<bool>(), chunk);
        const ojson& want = c["expected"];
        BOOST_TEST(p.content == want["content"].get<std::string>());
        BOOST_TEST(p.reasoning == want["reasoning_content"].get<std::string>());
        BOOST_REQUIRE(p.names.size() == want["tool_calls"].size());
        for (size_t i = 0; i < p.names.size(); ++i) {
          BOOST_TEST(p.names[i] == want["tool_calls"][i]["name"].get<std::string>());
          BOOST_TEST(p.arguments[i] == want["tool_calls"][i]["arguments"].get<std::string>());
          // The exact sampled bytes of each call are there, for replay.
          BOOST_TEST(text.find(p.invoke_texts[i]) != std::string::npos);
          BOOST_TEST(p.ids[i].rfind("call_", 0) == 0u);
        }
        BOOST_TEST(p.warnings.empty());
        BOOST_TEST(p.name_before_arguments_done);
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(tool_name_is_known_before_the_arguments_finish) {
  ChatOutputParser parser(false);
  auto a =
      parser.Feed("ok\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"search\">\n<｜DSML｜ parameter");
  bool started = false;
  for (const ParseEvent& e : a) started = started || e.kind == ParseEvent::Kind::kToolCallStart;
  BOOST_TEST(started);
  auto b = parser.Feed(" name=\"q\" string=\"true\">long qu");
  std::string args;
  for (const ParseEvent& e : b) {
    if (e.kind == ParseEvent::Kind::kToolArguments) args += e.text;
  }
  BOOST_TEST(args == "{\"q\": \"long qu");  // Arguments stream as they are generated.
}

BOOST_AUTO_TEST_CASE(malformed_output_becomes_text_with_a_warning) {
  struct Case {
    const char* what;
    std::string text;
    std::string must_contain;  // In content.
  };
  const Case cases[] = {
      {"unclosed block",
       "hi\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"f\">\n<｜DSML｜ parameter",
       "<｜DSML｜ invoke name=\"f\">"},
      {"garbage instead of invoke", "hi\n\n<｜DSML｜ calls>\nnot a tag at all", "not a tag at all"},
      {"bad string flag",
       "x\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"f\">\n<｜DSML｜ parameter name=\"a\" "
       "string=\"maybe\">1</｜DSML｜ parameter>",
       "string=\"maybe\""},
      {"text after the message", "done<｜end▁of▁sentence｜>trailing", "trailing"},
  };
  for (const Case& c : cases) {
    for (size_t chunk : {1u, 5u, 1000u}) {
      BOOST_TEST_CONTEXT(c.what << ", chunks of " << chunk) {
        Parsed p = Parse(c.text, false, chunk);
        BOOST_TEST(!p.warnings.empty());
        BOOST_TEST(p.content.find(c.must_contain) != std::string::npos, p.content);
      }
    }
  }
  // A non-string parameter that is not JSON is kept, as a string.
  Parsed p = Parse(
      "\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"f\">\n<｜DSML｜ parameter name=\"n\" "
      "string=\"false\">not json</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n</｜DSML｜ "
      "calls><｜end▁of▁sentence｜>",
      false, 3);
  BOOST_REQUIRE(p.arguments.size() == 1u);
  BOOST_TEST(p.arguments[0] == "{\"n\": \"not json\"}");
  BOOST_TEST(p.warnings.size() == 1u);
  // Output that ends inside the reasoning keeps every byte.
  Parsed r = Parse("thinking hard <｜", true, 2);
  BOOST_TEST(r.reasoning == "thinking hard <｜");
  BOOST_TEST(!r.warnings.empty());
}

// parallel_tool_calls: false keeps the first call of a reply that makes two.
BOOST_AUTO_TEST_CASE(one_call_only_when_parallel_calls_are_off) {
  const ojson messages = ojson::parse(R"([
    {"role": "user", "content": "go"},
    {"role": "assistant", "content": "", "tool_calls": [
      {"id": "call_a", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}},
      {"id": "call_b", "type": "function", "function": {"name": "g", "arguments": "{\"y\": 2}"}}]}
  ])");
  auto rendered = RenderChat(messages, ChatOptions{});
  BOOST_REQUIRE(rendered.ok());
  const std::string& text = rendered->text;
  const size_t from = text.find("\n\n<｜DSML｜ calls>");
  BOOST_REQUIRE(from != std::string::npos);
  const std::string output = text.substr(from);  // What the model wrote for the two calls.
  for (bool parallel : {true, false}) {
    ToolCallLedger ledger;
    chat::Assembler a(false, &ledger, parallel);
    std::vector<nlohmann::json> deltas = a.Feed(output);
    for (auto& d : a.Finish()) deltas.push_back(d);
    std::vector<std::string> names;
    for (const auto& d : deltas) {
      if (d.contains("tool_calls") && d["tool_calls"][0].contains("id")) {
        names.push_back(d["tool_calls"][0]["function"]["name"]);
      }
    }
    BOOST_TEST(names.size() == (parallel ? 2u : 1u), "parallel " << parallel);
    BOOST_TEST(names[0] == "f");
    BOOST_TEST(ledger.size() == (parallel ? 2u : 1u));
  }
}

BOOST_AUTO_TEST_SUITE_END()

}  // namespace
}  // namespace flashd::api
