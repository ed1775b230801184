// End-to-end: POST /v1/completions on the real daemon with the shared tiny model, over TCP and
// the Unix socket.
#include <httplib.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <boost/test/unit_test.hpp>
#include <chrono>
#include <cmath>
#include <nlohmann/json.hpp>
#include <regex>
#include <thread>

#include "tests/e2e/daemon_process.h"

namespace flashd::testing {
namespace {
using nlohmann::json;
using namespace std::chrono_literals;

// Polls until the engine runs nothing and its KV pool is empty; false after `timeout`.
bool WaitIdle(httplib::Client& c, std::chrono::seconds timeout = 20s) {
  const auto end = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < end) {
    if (Metric(c, "flashd_engine_running") == 0 &&
        Metric(c, "flashd_engine_kv_pool_used_bytes") == 0) {
      return true;
    }
    std::this_thread::sleep_for(50ms);
  }
  return false;
}

struct Completion {
  int status = 0;
  std::string text;
  std::string finish_reason;
  json tokens;
  json token_logprobs;
  json usage;
  std::string raw;
};

Completion Complete(httplib::Client& c, const json& body) {
  Completion out;
  auto res = c.Post("/v1/completions", body.dump(), "application/json");
  if (!res) return out;
  out.status = res->status;
  out.raw = res->body;
  if (res->status != 200) return out;
  json j = json::parse(res->body);
  out.text = j["choices"][0]["text"];
  out.finish_reason = j["choices"][0]["finish_reason"];
  if (!j["choices"][0]["logprobs"].is_null()) {
    out.tokens = j["choices"][0]["logprobs"]["tokens"];
    out.token_logprobs = j["choices"][0]["logprobs"]["token_logprobs"];
  }
  out.usage = j["usage"];
  return out;
}

json Request(int i) {
  const std::vector<std::string> prompts = {
      "def add(a, b):",   "The quick brown fox", "int main() {",    "SELECT * FROM",
      "Once upon a time", "import numpy as np",  "# TODO: fix the", "fn main() -> ()"};
  return {{"prompt", prompts[i % prompts.size()]},
          {"max_tokens", 24},
          {"temperature", 0.9},
          {"top_p", 0.95},
          {"seed", 1000 + i},
          {"logprobs", 2}};
}

BOOST_AUTO_TEST_SUITE(completions_e2e)

// The backend the engine runs on is reported; with the GPU kernels (run on the CPU by the HIP
// CPU runtime where this build has it) the daemon serves the same seeded tokens as the CPU's; on
// matrix cores, whose sums round otherwise, the same tokens batched as alone, close to the CPU's.
BOOST_AUTO_TEST_CASE(each_backend_is_reported_and_the_gpu_kernels_serve_the_same_tokens) {
  // Backend, and the engine section of the config.
  std::vector<std::pair<std::string, std::string>> backends = {{"cpu", ""}};
#ifdef FLASHD_TEST_HIPCPU
  backends.push_back({"hipcpu", ""});
  // The hybrid mode: the routed experts on the CPU beside the GPU backend.
  backends.push_back({"hipcpu", "engine:\n  routed_experts: cpu\n"});
  // The linears on matrix cores (here the stand-in of kernels/gpu/mma.h).
  backends.push_back({"hipcpu", "engine:\n  gpu_gemms: matrix\n"});
#else
  BOOST_TEST_MESSAGE("this build has no HIP CPU runtime: the CPU backend only");
#endif
  std::vector<std::vector<Completion>> answers;
  for (const auto& [backend, yaml] : backends) {
    TempDir tmp;
    DaemonProcess d({tmp.path(), yaml, {{"FLASHD_BACKEND", backend}}, {}});
    BOOST_REQUIRE_MESSAGE(d.Start(), d.log());
    BOOST_REQUIRE(WaitHealthy("127.0.0.1", d.port()) == 200);
    BOOST_TEST(Contains(d.log(), "engine: backend " + backend + ": as configured"), d.log());
    const bool matrix = Contains(yaml, "gpu_gemms: matrix");
    const bool hybrid = Contains(yaml, "routed_experts: cpu");
    if (hybrid) {
      BOOST_TEST(Contains(d.log(), "engine: placement: routed experts on the CPU"), d.log());
    }
    if (matrix) {
      BOOST_TEST(Contains(d.log(), "FP8/FP4 GEMMs on matrix cores (a stand-in"), d.log());
    }
    const std::string placement = hybrid   ? "routed experts:cpu/4"
                                  : matrix ? backend + "-matrix/5"
                                           : backend + "/4";
    auto c = UnixClient(d);
    answers.emplace_back();
    for (int i = 0; i < 3; ++i) {
      answers.back().push_back(Complete(*c, Request(i)));
      BOOST_REQUIRE_MESSAGE(answers.back().back().status == 200, answers.back().back().raw);
    }
    if (matrix) {
      // The same requests at once: batched, the same tokens and log-probabilities bit for bit.
      std::vector<Completion> together(3);
      std::vector<std::thread> threads;
      for (int i = 0; i < 3; ++i) {
        threads.emplace_back([&, i] { together[i] = Complete(*UnixClient(d), Request(i)); });
      }
      for (auto& t : threads) t.join();
      for (int i = 0; i < 3; ++i) {
        BOOST_REQUIRE_MESSAGE(together[i].status == 200, together[i].raw);
        BOOST_TEST(together[i].tokens == answers.back()[i].tokens, "matrix, request " << i);
        BOOST_TEST(together[i].token_logprobs == answers.back()[i].token_logprobs,
                   "matrix, request " << i);
      }
    }
    auto health = c->Get("/health");
    BOOST_REQUIRE(health);
    const json h = json::parse(health->body);
    BOOST_TEST(h["backend"]["name"] == backend, h.dump());
    BOOST_TEST(h["speculative"] == "dspark", h.dump());  // The test model has the heads.
    BOOST_TEST(Contains(h["backend"]["placement"].get<std::string>(), placement), h.dump());
    BOOST_TEST(!h["backend"]["device"].get<std::string>().empty());
    BOOST_TEST(h["backend"]["gemms"] == (matrix ? "matrix stand-in" : "exact"), h.dump());
    if (backend != "cpu") {
      // Weights uploaded and workspace held on the device.
      BOOST_TEST(h["backend"]["memory_in_use_bytes"].get<uint64_t>() > 0u, h.dump());
      BOOST_TEST(h["backend"]["memory_total_bytes"].get<uint64_t>() > 0u, h.dump());
    }
    auto models = c->Get("/v1/models");
    BOOST_REQUIRE(models);
    BOOST_TEST(json::parse(models->body)["data"][0]["backend"]["name"] == backend);
    BOOST_TEST(d.Stop(SIGTERM) == 0);
  }
  for (size_t b = 1; b < answers.size(); ++b) {
    const bool matrix = Contains(backends[b].second, "gpu_gemms: matrix");
    for (size_t i = 0; i < answers[0].size(); ++i) {
      if (!matrix) {
        BOOST_TEST(answers[b][i].tokens == answers[0][i].tokens, "request " << i);
        BOOST_TEST(answers[b][i].token_logprobs == answers[0][i].token_logprobs, "request " << i);
        continue;
      }
      // Matrix cores round some sums (wo_a's BF16 products) otherwise than the CPU: the same
      // first token (the prompt's), then the same tokens until one parts, their
      // log-probabilities close to the CPU's.
      const Completion &m = answers[b][i], &cpu = answers[0][i];
      size_t same = 0;
      while (same < m.tokens.size() && same < cpu.tokens.size() &&
             m.tokens[same] == cpu.tokens[same]) {
        ++same;
      }
      BOOST_TEST_MESSAGE("matrix cores, request " << i << ": " << same << " of "
                                                  << cpu.tokens.size() << " tokens the CPU's");
      BOOST_TEST(same >= 1u, "request " << i);
      for (size_t k = 0; k < same; ++k) {
        const double a = m.token_logprobs[k], want = cpu.token_logprobs[k];
        BOOST_TEST(std::fabs(a - want) < 0.1, "request " << i << " token " << k);
      }
    }
  }
#ifdef FLASHD_TEST_HIPCPU
  // More GPUs than the machine has: the model is not loaded, /health says why, serving goes on.
  TempDir tmp;
  DaemonProcess d({tmp.path(), "engine:\n  gpus: 2\n", {{"FLASHD_BACKEND", "hipcpu"}}, {}});
  BOOST_REQUIRE_MESSAGE(d.Start(), d.log());
  httplib::Client c("127.0.0.1", d.port());
  json h = json::object();
  for (int i = 0; i < 600 && h.value("status", "") != "error"; ++i) {
    auto health = c.Get("/health");
    BOOST_REQUIRE(health);
    h = json::parse(health->body);
    std::this_thread::sleep_for(50ms);
  }
  BOOST_TEST(h["status"] == "error", h.dump());
  BOOST_TEST(Contains(h.value("reason", ""), "engine.gpus: 2 asked for: hipcpu: no device 1"),
             h.dump());
  BOOST_TEST(d.Stop(SIGTERM) == 0);
#endif
}

BOOST_AUTO_TEST_CASE(concurrent_generations_equal_each_alone_and_share_steps) {
  TempDir tmp;
  DaemonProcess d({tmp.path(), "", {}, {}});
  BOOST_REQUIRE_MESSAGE(d.Start(), d.log());
  BOOST_REQUIRE(WaitHealthy("127.0.0.1", d.port()) == 200);
  auto tcp = TcpClient(d);
  constexpr int kN = 8;

  // Each request alone, one after another.
  std::vector<Completion> alone;
  const double steps0 = Metric(*tcp, "flashd_engine_steps_total");
  for (int i = 0; i < kN; ++i) {
    alone.push_back(Complete(*tcp, Request(i)));
    BOOST_REQUIRE_MESSAGE(alone.back().status == 200, alone.back().raw);
  }
  const double steps1 = Metric(*tcp, "flashd_engine_steps_total");

  // All at once, half of them over the Unix socket.
  std::vector<Completion> together(kN);
  std::vector<std::thread> threads;
  for (int i = 0; i < kN; ++i) {
    threads.emplace_back([&, i] {
      auto c = i % 2 == 0 ? TcpClient(d) : UnixClient(d);
      together[i] = Complete(*c, Request(i));
    });
  }
  for (auto& t : threads) t.join();
  const double steps2 = Metric(*tcp, "flashd_engine_steps_total");

  for (int i = 0; i < kN; ++i) {
    BOOST_TEST_CONTEXT("request " << i) {
      BOOST_REQUIRE_MESSAGE(together[i].status == 200, together[i].raw);
      BOOST_TEST(together[i].text == alone[i].text);
      BOOST_TEST(together[i].tokens == alone[i].tokens);
      // Log-probabilities are bit-identical: batching does not change a sequence's arithmetic.
      BOOST_TEST(together[i].token_logprobs == alone[i].token_logprobs);
      BOOST_TEST(together[i].usage == alone[i].usage);
      BOOST_TEST(alone[i].usage["completion_tokens"].get<int>() ==
                 static_cast<int>(alone[i].tokens.size()));
      BOOST_TEST((alone[i].finish_reason == "length" || alone[i].finish_reason == "stop"));
      if (alone[i].finish_reason == "length") BOOST_TEST(alone[i].tokens.size() == 24u);
    }
  }
  // Different seeds and prompts give different text (the random model is not degenerate).
  BOOST_TEST(alone[0].text != alone[1].text);
  // Run together, the requests shared forward steps: far fewer than one after another.
  BOOST_TEST_MESSAGE("steps: alone " << steps1 - steps0 << ", together " << steps2 - steps1);
  BOOST_TEST(steps1 - steps0 >= kN * 10.0);
  BOOST_TEST(steps2 - steps1 < (steps1 - steps0) / 2,
             "together " << steps2 - steps1 << " steps, alone " << steps1 - steps0);
  BOOST_TEST(WaitIdle(*tcp));
  BOOST_TEST(d.Stop(SIGTERM) == 0);
}

// Splits an SSE body into its data payloads.
std::vector<std::string> SseData(const std::string& body) {
  std::vector<std::string> out;
  size_t pos = 0;
  while ((pos = body.find("data: ", pos)) != std::string::npos) {
    size_t end = body.find("\n\n", pos);
    out.push_back(body.substr(pos + 6, end - pos - 6));
    pos = end;
  }
  return out;
}

BOOST_AUTO_TEST_CASE(a_stream_carries_the_same_tokens_as_a_whole_response) {
  TempDir tmp;
  DaemonProcess d({tmp.path(), "", {}, {}});
  BOOST_REQUIRE_MESSAGE(d.Start(), d.log());
  BOOST_REQUIRE(WaitHealthy("127.0.0.1", d.port()) == 200);
  auto unix_client = UnixClient(d);
  json req = Request(3);
  req["echo"] = true;
  req.erase("logprobs");
  const Completion whole = Complete(*unix_client, req);
  BOOST_REQUIRE_MESSAGE(whole.status == 200, whole.raw);
  BOOST_TEST(whole.text.rfind("SELECT * FROM", 0) == 0u, whole.text);

  req["stream"] = true;
  req["stream_options"] = {{"include_usage", true}};
  auto res = unix_client->Post("/v1/completions", req.dump(), "application/json");
  BOOST_REQUIRE(res);
  BOOST_REQUIRE_MESSAGE(res->status == 200, res->body);
  BOOST_TEST(res->get_header_value("Content-Type").rfind("text/event-stream", 0) == 0u);
  std::vector<std::string> data = SseData(res->body);
  BOOST_REQUIRE(data.size() >= 4u);
  BOOST_TEST(data.back() == "[DONE]");
  std::string text;
  std::string finish;
  json usage;
  std::string id;
  for (size_t i = 0; i + 1 < data.size(); ++i) {
    json chunk = json::parse(data[i]);
    BOOST_TEST(chunk["object"] == "text_completion");
    if (id.empty()) id = chunk["id"];
    BOOST_TEST(chunk["id"] == id);  // One id for the whole stream.
    if (!chunk["usage"].is_null()) {
      BOOST_TEST(chunk["choices"].empty());
      usage = chunk["usage"];
      continue;
    }
    text += chunk["choices"][0]["text"].get<std::string>();
    if (!chunk["choices"][0]["finish_reason"].is_null()) {
      finish = chunk["choices"][0]["finish_reason"];
    }
  }
  BOOST_TEST(text == whole.text);
  BOOST_TEST(finish == whole.finish_reason);
  BOOST_TEST(usage == whole.usage);
  BOOST_TEST(d.Stop(SIGTERM) == 0);
}

// Folds a chat stream's deltas into one message, as a client would.
json FoldChatStream(const std::string& body, json* usage) {
  json message = {{"content", ""}, {"reasoning_content", ""}, {"tool_calls", json::array()}};
  std::vector<std::string> data = SseData(body);
  for (size_t i = 0; i + 1 < data.size(); ++i) {
    json chunk = json::parse(data[i]);
    if (chunk["choices"].empty()) {
      *usage = chunk["usage"];
      continue;
    }
    const json& d = chunk["choices"][0]["delta"];
    if (d.contains("content"))
      message["content"] = message["content"].get<std::string>() + d["content"].get<std::string>();
    if (d.contains("reasoning_content")) {
      message["reasoning_content"] = message["reasoning_content"].get<std::string>() +
                                     d["reasoning_content"].get<std::string>();
    }
    if (d.contains("tool_calls")) {
      const json& call = d["tool_calls"][0];
      if (call.contains("id")) {
        message["tool_calls"].push_back(
            {{"id", call["id"]}, {"name", call["function"]["name"]}, {"arguments", ""}});
      } else {
        json& last = message["tool_calls"].back();
        last["arguments"] =
            last["arguments"].get<std::string>() + call["function"]["arguments"].get<std::string>();
      }
    }
  }
  BOOST_TEST(data.back() == "[DONE]");
  return message;
}

BOOST_AUTO_TEST_CASE(chat_stream_folds_into_the_whole_message) {
  TempDir tmp;
  DaemonProcess d({tmp.path(), "", {}, {}});
  BOOST_REQUIRE_MESSAGE(d.Start(), d.log());
  BOOST_REQUIRE(WaitHealthy("127.0.0.1", d.port()) == 200);
  auto c = UnixClient(d);
  for (int seed = 0; seed < 6; ++seed) {
    BOOST_TEST_CONTEXT("seed " << seed) {
      json req = {{"messages", {{{"role", "user"}, {"content", "List the files."}}}},
                  {"tools",
                   {{{"type", "function"},
                     {"function",
                      {{"name", "ls"},
                       {"parameters", {{"type", "object"}, {"properties", json::object()}}}}}}}},
                  {"reasoning_effort", "high"},
                  {"max_tokens", 40},
                  {"temperature", 1.0},
                  {"seed", seed}};
      auto whole = c->Post("/v1/chat/completions", req.dump(), "application/json");
      BOOST_REQUIRE(whole);
      BOOST_REQUIRE_MESSAGE(whole->status == 200, whole->body);
      json w = json::parse(whole->body);
      const json& msg = w["choices"][0]["message"];
      BOOST_TEST(w["object"] == "chat.completion");
      req["stream"] = true;
      req["stream_options"] = {{"include_usage", true}};
      auto streamed = c->Post("/v1/chat/completions", req.dump(), "application/json");
      BOOST_REQUIRE(streamed);
      BOOST_REQUIRE(streamed->status == 200);
      json usage;
      json folded = FoldChatStream(streamed->body, &usage);
      BOOST_TEST(folded["content"] == (msg["content"].is_null() ? json("") : msg["content"]));
      BOOST_TEST(folded["reasoning_content"] == msg.value("reasoning_content", json("")));
      const json calls = msg.value("tool_calls", json::array());
      BOOST_REQUIRE(folded["tool_calls"].size() == calls.size());
      for (size_t i = 0; i < calls.size(); ++i) {
        BOOST_TEST(folded["tool_calls"][i]["id"].get<std::string>().rfind("call_", 0) == 0u);
        BOOST_TEST(folded["tool_calls"][i]["name"] == calls[i]["function"]["name"]);
        BOOST_TEST(folded["tool_calls"][i]["arguments"] == calls[i]["function"]["arguments"]);
      }
      BOOST_TEST(usage["completion_tokens"] == w["usage"]["completion_tokens"]);
      const json& u = w["usage"];
      BOOST_TEST(u["prompt_cache_hit_tokens"].get<int>() +
                     u["prompt_cache_miss_tokens"].get<int>() ==
                 u["prompt_tokens"].get<int>());
      BOOST_TEST(u["prompt_tokens_details"]["cached_tokens"] == u["prompt_cache_hit_tokens"]);
    }
  }
  // A named tool choice: the call is opened for the model, so the reply calls that tool.
  json named = {{"messages", {{{"role", "user"}, {"content", "Where am I?"}}}},
                {"tools",
                 {{{"type", "function"},
                   {"function", {{"name", "pwd"}, {"parameters", {{"type", "object"}}}}}},
                  {{"type", "function"},
                   {"function", {{"name", "ls"}, {"parameters", {{"type", "object"}}}}}}}},
                {"tool_choice", {{"type", "function"}, {"function", {{"name", "ls"}}}}},
                {"max_tokens", 6},
                {"seed", 1}};
  auto forced = c->Post("/v1/chat/completions", named.dump(), "application/json");
  BOOST_REQUIRE(forced);
  BOOST_REQUIRE_MESSAGE(forced->status == 200, forced->body);
  const json fm = json::parse(forced->body)["choices"][0]["message"];
  BOOST_REQUIRE_MESSAGE(fm.contains("tool_calls") && !fm["tool_calls"].empty(), fm.dump());
  BOOST_TEST(fm["tool_calls"][0]["function"]["name"] == "ls");
  named["stream"] = true;
  auto forced_stream = c->Post("/v1/chat/completions", named.dump(), "application/json");
  BOOST_REQUIRE(forced_stream);
  json forced_usage;
  const json fs = FoldChatStream(forced_stream->body, &forced_usage);
  BOOST_REQUIRE(!fs["tool_calls"].empty());
  BOOST_TEST(fs["tool_calls"][0]["name"] == "ls");
  BOOST_TEST(fs["tool_calls"][0]["arguments"] == fm["tool_calls"][0]["function"]["arguments"]);

  // A response format is rendered into the prompt (a system message is made for it).
  auto plain = c->Post("/v1/chat/completions",
                       R"({"messages": [{"role": "user", "content": "x"}], "max_tokens": 2})",
                       "application/json");
  auto formatted = c->Post(
      "/v1/chat/completions",
      R"({"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "response_format": {"type": "json_object"}})",
      "application/json");
  BOOST_REQUIRE(plain);
  BOOST_REQUIRE(formatted);
  BOOST_REQUIRE_MESSAGE(formatted->status == 200, formatted->body);
  BOOST_TEST(json::parse(formatted->body)["usage"]["prompt_tokens"].get<int>() >
             json::parse(plain->body)["usage"]["prompt_tokens"].get<int>() + 10);
  const std::vector<std::pair<std::string, std::string>> bad = {
      {R"({"messages": []})", "messages"},
      {R"({"messages": [{"role": "bogus", "content": "x"}]})", "messages[0].role"},
      {R"({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"})",
       "needs tools"},
      {R"({"messages": [{"role": "user", "content": "x"}], "tool_choice": "sometimes"})",
       "tool_choice"},
      {R"({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "ls"}}], "tool_choice": {"type": "function", "function": {"name": "rm"}}})",
       "no tool named \"rm\""},
      {R"({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "ls"}}], "tool_choice": "required", "reasoning_effort": "high"})",
       "thinking mode"},
      {R"({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "yaml"}})",
       "response_format.type"},
      {R"({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2})", "top_logprobs"},
      {R"({"messages": [{"role": "user", "content": "x"}], "thinking": {"type": "maybe"}})",
       "thinking"},
      {R"({"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "extreme"})",
       "reasoning_effort"},
      {R"({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0})",
       "max_completion_tokens"},
  };
  for (const auto& [body, needle] : bad) {
    BOOST_TEST_CONTEXT(body) {
      auto r = c->Post("/v1/chat/completions", body, "application/json");
      BOOST_REQUIRE(r);
      BOOST_TEST(r->status == 400);
      BOOST_TEST(json::parse(r->body)["error"]["message"].get<std::string>().find(needle) !=
                     std::string::npos,
                 r->body);
    }
  }
  BOOST_TEST(d.Stop(SIGTERM) == 0);
}

BOOST_AUTO_TEST_CASE(metrics_time_first_tokens_and_the_gaps_between_tokens) {
  TempDir tmp;
  DaemonProcess d({tmp.path(), "", {}, {}});
  BOOST_REQUIRE_MESSAGE(d.Start(), d.log());
  BOOST_REQUIRE(WaitHealthy("127.0.0.1", d.port()) == 200);
  auto c = TcpClient(d);
  BOOST_TEST(Metric(*c, "flashd_time_to_first_token_seconds_count") == 0);
  // Two generations of 8 tokens each, one whole and one streamed: 2 first tokens, 14 gaps.
  for (bool stream : {false, true}) {
    json req = {{"prompt", "x"}, {"max_tokens", 8}, {"ignore_eos", true}, {"stream", stream}};
    auto r = c->Post("/v1/completions", req.dump(), "application/json");
    BOOST_REQUIRE(r);
    BOOST_REQUIRE(r->status == 200);
  }
  BOOST_TEST(Metric(*c, "flashd_time_to_first_token_seconds_count") == 2);
  BOOST_TEST(Metric(*c, "flashd_inter_token_seconds_count") == 14);
  BOOST_TEST(Metric(*c, "flashd_time_to_first_token_seconds_sum") > 0);
  auto m = c->Get("/metrics");
  BOOST_REQUIRE(m);
  BOOST_TEST(m->body.find("flashd_inter_token_seconds_bucket{le=\"+Inf\"} 14") !=
             std::string::npos);
  BOOST_TEST(m->body.find("# TYPE flashd_time_to_first_token_seconds histogram") !=
             std::string::npos);
  BOOST_TEST(d.Stop(SIGTERM) == 0);
}

BOOST_AUTO_TEST_CASE(bad_requests_get_400s_naming_the_field_and_nothing_is_lost) {
  TempDir tmp;
  DaemonProcess d({tmp.path(), "", {}, {}});
  BOOST_REQUIRE_MESSAGE(d.Start(), d.log());
  BOOST_REQUIRE(WaitHealthy("127.0.0.1", d.port()) == 200);
  auto c = TcpClient(d);
  struct Case {
    std::string body;
    int status;
    std::string needle;
  };
  const std::vector<Case> cases = {
      {R"({"max_tokens": 4})", 400, "prompt: required"},
      {R"({"prompt": "x", "temperature": "hot"})", 400, "temperature"},
      {R"({"prompt": "x", "top_p": 0})", 400, "top_p"},
      {R"({"prompt": "x", "max_tokens": 0})", 400, "max_tokens"},
      {R"({"prompt": "x", "max_tokens": 1048576})", 400, "exceed the model's context of 1048576"},
      {R"({"prompt": "x", "n": 2})", 400, "n: only 1"},
      {R"({"prompt": "x", "stop": ["a", 3]})", 400, "stop"},
      {R"({"prompt": "x", "logprobs": 50})", 400, "logprobs"},
      {R"({"prompt": [1, 2, 99999999]})", 400, "prompt[2]"},
      {R"({"prompt": ["a", "b"]})", 400, "batches of prompts"},
      {R"({"prompt": "x", "model": "gpt-4o"})", 404, "gpt-4o"},
      {R"({"prompt": "x", "echo": true, "logprobs": 1})", 400, "echo"},
      {R"({"prompt": "x",)", 400, "not valid JSON"},
  };
  for (const Case& k : cases) {
    BOOST_TEST_CONTEXT(k.body) {
      auto res = c->Post("/v1/completions", k.body, "application/json");
      BOOST_REQUIRE(res);
      BOOST_TEST(res->status == k.status);
      json e = json::parse(res->body);
      BOOST_TEST(e["error"]["message"].get<std::string>().find(k.needle) != std::string::npos,
                 e.dump());
    }
  }
  // The chat routes: too many messages, and malformed JSON with the error's position.
  json many = {{"messages", json::array()}};
  for (int i = 0; i < 10001; ++i) many["messages"].push_back({{"role", "user"}, {"content", "x"}});
  auto too_many = c->Post("/v1/chat/completions", many.dump(), "application/json");
  BOOST_TEST(too_many->status == 400);
  BOOST_TEST(Contains(too_many->body, "10001 messages, more than 10000 (server.max_messages)"),
             too_many->body);
  auto broken = c->Post("/v1/chat/completions", R"({"messages": [})", "application/json");
  BOOST_TEST(broken->status == 400);
  BOOST_TEST(Contains(broken->body, "column 15"), broken->body);
  // A request that can never fit the memory budget is refused, naming the limit.
  TempDir tmp2;
  const std::string small_config = "server:\n  pid_file: " + (tmp2.path() / "flashd.pid").string() +
                                   "\nengine:\n  memory_budget_bytes: 1MiB\n";
  DaemonProcess small({tmp2.path(), small_config, {}, {}});
  BOOST_REQUIRE_MESSAGE(small.Start(), small.log());
  BOOST_REQUIRE(WaitHealthy("127.0.0.1", small.port()) == 200);
  auto sc = TcpClient(small);
  auto big =
      sc->Post("/v1/completions", R"({"prompt": "x", "max_tokens": 500000})", "application/json");
  BOOST_REQUIRE(big);
  BOOST_TEST(big->status == 400);
  BOOST_TEST(big->body.find("memory budget") != std::string::npos, big->body);
  BOOST_TEST(small.Stop(SIGTERM) == 0);

  // The daemon kept serving, and generation still works.
  const Completion ok = Complete(*c, Request(0));
  BOOST_TEST(ok.status == 200, ok.raw);
  BOOST_TEST(d.Stop(SIGTERM) == 0);
}

// Sends a raw HTTP request on a fresh TCP connection and returns the fd.
int SendRaw(int port, const std::string& body) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) return -1;
  const std::string req =
      "POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: "
      "application/json\r\nContent-Length: " +
      std::to_string(body.size()) + "\r\n\r\n" + body;
  if (::write(fd, req.data(), req.size()) != static_cast<ssize_t>(req.size())) return -1;
  return fd;
}

BOOST_AUTO_TEST_CASE(a_client_that_goes_away_cancels_its_generation) {
  TempDir tmp;
  DaemonProcess d({tmp.path(), "", {}, {}});
  BOOST_REQUIRE_MESSAGE(d.Start(), d.log());
  BOOST_REQUIRE(WaitHealthy("127.0.0.1", d.port()) == 200);
  auto c = TcpClient(d);
  for (bool stream : {true, false}) {
    BOOST_TEST_CONTEXT("stream " << stream) {
      const double before = Metric(*c, "flashd_engine_generated_tokens_total");
      json body = {
          {"prompt", "endless"}, {"max_tokens", 200000}, {"ignore_eos", true}, {"stream", stream}};
      int fd = SendRaw(d.port(), body.dump());
      BOOST_REQUIRE(fd >= 0);
      // Wait until it generates, then hang up.
      bool generating = false;
      for (int i = 0; i < 400 && !generating; ++i) {
        generating = Metric(*c, "flashd_engine_generated_tokens_total") > before + 5;
        std::this_thread::sleep_for(25ms);
      }
      BOOST_REQUIRE(generating);
      BOOST_TEST(Metric(*c, "flashd_engine_running") == 1);
      ::close(fd);
      // The generation stops and its KV blocks return to the pool.
      BOOST_TEST(WaitIdle(*c));
      const double stopped = Metric(*c, "flashd_engine_generated_tokens_total");
      std::this_thread::sleep_for(300ms);
      BOOST_TEST(Metric(*c, "flashd_engine_generated_tokens_total") == stopped);
    }
  }
  BOOST_TEST(d.log().find("client gone, cancelled") != std::string::npos, d.log());
  BOOST_TEST(d.Stop(SIGTERM) == 0);
}

// 64 open streams on a daemon that keeps only 2 ready workers: every stream is served at once
// and /health still answers at once.
BOOST_AUTO_TEST_CASE(open_streams_do_not_block_other_requests) {
  TempDir tmp;
  DaemonProcess d(
      {tmp.path(), "server:\n  http_threads: 2\n  shutdown_grace_seconds: 5\n", {}, {}});
  BOOST_REQUIRE_MESSAGE(d.Start(), d.log());
  BOOST_REQUIRE(WaitHealthy("127.0.0.1", d.port()) == 200);
  json body = {{"prompt", "open"}, {"max_tokens", 100000}, {"ignore_eos", true}, {"stream", true}};
  std::vector<int> fds;
  for (int i = 0; i < 64; ++i) {
    fds.push_back(SendRaw(d.port(), body.dump()));
    BOOST_REQUIRE(fds.back() >= 0);
  }
  // Every stream starts: each gets its first event (they are not waiting for a worker).
  for (int fd : fds) {
    timeval tv{30, 0};
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    std::string got;
    char buf[4096];
    while (got.find("data: ") == std::string::npos) {
      const ssize_t n = ::read(fd, buf, sizeof buf);
      if (n <= 0) break;
      got.append(buf, static_cast<size_t>(n));
    }
    BOOST_REQUIRE_MESSAGE(got.find("data: ") != std::string::npos, "a stream got no event");
  }
  httplib::Client h("127.0.0.1", d.port());
  h.set_connection_timeout(5);
  h.set_read_timeout(5);
  auto health = h.Get("/health");
  BOOST_REQUIRE(health);
  BOOST_TEST(health->status == 200);
  auto c = TcpClient(d);
  // All 64 are admitted together (the count is taken once per engine step: wait for it).
  double running = 0;
  for (int i = 0; i < 300 && running != 64; ++i) {
    running = Metric(*c, "flashd_engine_running");
    if (running != 64) std::this_thread::sleep_for(100ms);
  }
  BOOST_TEST(running == 64);
  for (int fd : fds) ::close(fd);
  BOOST_TEST(WaitIdle(*c, 60s));
  BOOST_TEST(d.Stop(SIGTERM) == 0);
}

// Reads and drops what arrives on a socket until Close() (or destruction) hangs up.
class SocketReader {
 public:
  explicit SocketReader(int fd)
      : fd_(fd), thread_([fd] {
          char buf[4096];
          while (::read(fd, buf, sizeof buf) > 0) {
          }
        }) {}
  ~SocketReader() { Close(); }
  void Close() {
    if (fd_ < 0) return;
    ::shutdown(fd_, SHUT_RDWR);
    thread_.join();
    ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_;
  std::thread thread_;
};

BOOST_AUTO_TEST_CASE(a_waiting_request_whose_client_goes_away_never_runs) {
  TempDir tmp;
  // One sequence at a time, so a second request waits for the first.
  const std::string config = "server:\n  pid_file: " + (tmp.path() / "flashd.pid").string() +
                             "\nengine:\n  max_running: 1\n";
  DaemonProcess d({tmp.path(), config, {}, {}});
  BOOST_REQUIRE_MESSAGE(d.Start(), d.log());
  BOOST_REQUIRE(WaitHealthy("127.0.0.1", d.port()) == 200);
  auto c = TcpClient(d);
  auto wait_for = [&](const std::string& metric, double value) {
    for (int i = 0; i < 400; ++i) {
      if (Metric(*c, metric) == value) return true;
      std::this_thread::sleep_for(25ms);
    }
    return false;
  };
  const int first = SendRaw(
      d.port(),
      json({{"prompt", "first"}, {"max_tokens", 200000}, {"ignore_eos", true}, {"stream", true}})
          .dump());
  BOOST_REQUIRE(first >= 0);
  // Read the first stream as a client would, so that its tokens never fill the socket.
  SocketReader reader(first);
  BOOST_REQUIRE(wait_for("flashd_engine_running", 1));
  for (bool stream : {true, false}) {
    BOOST_TEST_CONTEXT("stream " << stream) {
      const int second = SendRaw(
          d.port(), json({{"prompt", "second"}, {"max_tokens", 8}, {"stream", stream}}).dump());
      BOOST_REQUIRE(second >= 0);
      BOOST_REQUIRE(wait_for("flashd_engine_waiting", 1));
      ::close(second);
      // It leaves the queue while the first request is still generating.
      BOOST_TEST(wait_for("flashd_engine_waiting", 0));
      BOOST_TEST(Metric(*c, "flashd_engine_running") == 1);
    }
  }
  reader.Close();
  BOOST_TEST(WaitIdle(*c));
  BOOST_TEST(d.Stop(SIGTERM) == 0);
}

BOOST_AUTO_TEST_SUITE_END()

}  // namespace
}  // namespace flashd::testing
