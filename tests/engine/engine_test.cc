// The engine runtime: batching, cancellation, admission, stops, and long prompts beside many
// short requests. Assertions are on results, order and progress (engine steps), never on time.
#include "engine/engine.h"

#include <boost/test/unit_test.hpp>
#include <cstdlib>
#include <map>
#include <optional>
#include <random>
#include <thread>

#include "engine/gpu_backend.h"
#include "tests/support/temp_dir.h"

namespace flashd::engine {
namespace {

using std::chrono::milliseconds;

struct Outcome {
  std::vector<int32_t> tokens;
  std::string text;
  std::string reason;
  Status error;
  std::vector<int64_t> queued_positions;
  int64_t first_token_step = -1;
  int64_t done_step = -1;
};

Outcome Drain(EventQueue& q) {
  Outcome o;
  for (;;) {
    auto e = q.Pop(milliseconds(600000));
    BOOST_REQUIRE_MESSAGE(e.has_value(), "no event within the timeout");
    switch (e->kind) {
      case GenerationEvent::Kind::kQueued:
        o.queued_positions.push_back(e->queue_position);
        break;
      case GenerationEvent::Kind::kToken:
        if (e->token.token >= 0) {
          o.tokens.push_back(e->token.token);
          if (o.first_token_step < 0) o.first_token_step = e->step;
        }
        o.text += e->text;
        break;
      case GenerationEvent::Kind::kDone:
        o.reason = e->finish_reason;
        o.error = e->error;
        o.done_step = e->step;
        return o;
    }
  }
}

EngineOptions GoldenOptions() {
  EngineOptions o;
  o.model_dir = FLASHD_GOLDEN_DIR;
  o.step_token_budget = 64;
  o.prefill_chunk = 16;
  return o;
}

std::vector<int32_t> Prompt(size_t n, uint32_t seed, int32_t vocab) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> d(3, vocab - 1);
  std::vector<int32_t> p(n);
  for (int32_t& t : p) t = d(rng);
  return p;
}

GenerationRequest Request(std::vector<int32_t> prompt, float temperature, uint64_t seed,
                          int max_tokens) {
  GenerationRequest r;
  r.prompt = std::move(prompt);
  r.sampling.temperature = temperature;
  r.sampling.seed = seed;
  r.sampling.max_tokens = max_tokens;
  r.sampling.stop_tokens = {};
  return r;
}

BOOST_AUTO_TEST_SUITE(engine)

// engine.backend: a named backend is used or refused with the reason; auto always finds one.
BOOST_AUTO_TEST_CASE(backends_are_chosen_by_name_or_automatically) {
  using testing::Contains;
  std::string why;
  auto cpu = SelectBackend("cpu", &why);
  BOOST_REQUIRE(cpu.ok());
  BOOST_TEST((*cpu)->name() == "cpu");
  auto bad = SelectBackend("tpu", &why);
  BOOST_TEST(bad.status().code() == StatusCode::kInvalidArgument);
  BOOST_TEST(Contains(bad.status().message(), "expected auto, cpu, cuda, hip or hipcpu"));
  auto automatic = SelectBackend("auto", &why);
  BOOST_REQUIRE(automatic.ok());
  BOOST_TEST(Contains(why, "(auto)"), why);
  if ((*automatic)->name() == "cpu") BOOST_TEST(Contains(why, "no usable GPU"), why);
  for (const char* gpu : {"cuda", "hip", "hipcpu"}) {
    auto b = SelectBackend(gpu, &why);
    const bool compiled = Contains(CompiledBackends() + "+", "+" + std::string(gpu) + "+");
    if (!compiled) {
      BOOST_TEST(b.status().code() == StatusCode::kUnavailable);
      BOOST_TEST(Contains(b.status().message(), "has no " + std::string(gpu)));
    } else if (b.ok()) {
      BOOST_TEST((*b)->name() == gpu);
      BOOST_TEST((*b)->numerics() != (*cpu)->numerics());
    } else {
      BOOST_TEST_MESSAGE(gpu << ": " << b.status().ToString());
    }
  }
#ifdef FLASHD_TEST_HIPCPU
  BOOST_TEST(SelectBackend("hipcpu", &why).ok(), why);  // Runs wherever the build has it.
#endif
}

BOOST_AUTO_TEST_CASE(batched_generation_equals_each_request_alone) {
  auto engine = Engine::Open(GoldenOptions());
  BOOST_REQUIRE_MESSAGE(engine.ok(), engine.status().ToString());
  const int32_t vocab = static_cast<int32_t>((*engine)->config().vocab_size);
  std::vector<GenerationRequest> requests;
  for (int i = 0; i < 6; ++i) {
    requests.push_back(Request(Prompt(5 + 9 * i, 100 + i, vocab), i % 2 ? 0.8f : 0.0f, 7 + i, 12));
    requests.back().tenant = "tenant-" + std::to_string(i % 3);
    requests.back().sampling.stop_tokens = {1};
  }
  std::vector<std::shared_ptr<EventQueue>> queues;
  for (const auto& r : requests) queues.push_back((*engine)->Submit(r).second);
  std::vector<Outcome> together;
  for (auto& q : queues) together.push_back(Drain(*q));
  for (size_t i = 0; i < requests.size(); ++i) {
    auto [h, q] = (*engine)->Submit(requests[i]);
    Outcome alone = Drain(*q);
    BOOST_TEST(alone.tokens == together[i].tokens, "request " << i);
    BOOST_TEST(alone.reason == together[i].reason);
    BOOST_TEST(!alone.tokens.empty());
  }
}

BOOST_AUTO_TEST_CASE(cancellation_stops_and_frees_memory) {
  auto engine = Engine::Open(GoldenOptions());
  BOOST_REQUIRE(engine.ok());
  auto [handle, q] = (*engine)->Submit(Request(Prompt(20, 1, 480), 1.0f, 3, 100000));
  for (int got = 0; got < 3;) {
    auto e = q->Pop(milliseconds(60000));
    BOOST_REQUIRE(e.has_value());
    if (e->kind == GenerationEvent::Kind::kToken) ++got;
  }
  BOOST_TEST((*engine)->stats().memory_reserved_bytes > 0u);
  BOOST_TEST((*engine)->stats().pool_used_bytes > 0u);
  (*engine)->Cancel(handle);
  Outcome o = Drain(*q);
  BOOST_TEST(o.reason == "cancelled");
  for (int i = 0; i < 1000 && (*engine)->stats().running > 0; ++i) {
    std::this_thread::sleep_for(milliseconds(5));
  }
  BOOST_TEST((*engine)->stats().running == 0);
  BOOST_TEST((*engine)->stats().memory_reserved_bytes == 0u);
  BOOST_TEST((*engine)->stats().pool_used_bytes == 0u);  // Every KV block is back.
}

BOOST_AUTO_TEST_CASE(admission_waits_for_memory_then_proceeds) {
  EngineOptions options = GoldenOptions();
  auto probe = Engine::Open(options);
  BOOST_REQUIRE(probe.ok());
  // Room for exactly one of these requests at a time.
  const uint64_t per_token = 106, per_sequence = 9260;  // Reported by model-info for this model.
  options.memory_budget_bytes = (30 + 10) * per_token + per_sequence + 100;
  probe->reset();
  auto engine = Engine::Open(options);
  BOOST_REQUIRE(engine.ok());
  std::vector<std::shared_ptr<EventQueue>> queues;
  for (int i = 0; i < 3; ++i) {
    queues.push_back((*engine)->Submit(Request(Prompt(30, 50 + i, 480), 0.0f, 1, 10)).second);
  }
  std::vector<Outcome> out;
  for (auto& q : queues) out.push_back(Drain(*q));
  for (const Outcome& o : out) BOOST_TEST(o.reason == "length");
  BOOST_TEST(out[0].queued_positions.empty());
  BOOST_REQUIRE(!out[1].queued_positions.empty());
  BOOST_TEST(out[1].queued_positions.front() == 0);
  BOOST_REQUIRE(!out[2].queued_positions.empty());
  BOOST_TEST(out[2].queued_positions.front() == 1);  // Behind the second.
  // One at a time: each starts after the one before it is done.
  BOOST_TEST(out[1].first_token_step > out[0].done_step);
  BOOST_TEST(out[2].first_token_step > out[1].done_step);

  // A request that can never fit ends at once, naming the limit.
  auto [h, q] = (*engine)->Submit(Request(Prompt(30, 9, 480), 0.0f, 1, 100000));
  Outcome big = Drain(*q);
  BOOST_TEST(big.reason == "error");
  BOOST_TEST(big.error.message().find("memory budget") != std::string::npos, big.error.message());
}

BOOST_AUTO_TEST_CASE(stop_tokens_stop_strings_and_max_tokens) {
  auto engine = Engine::Open(GoldenOptions());
  BOOST_REQUIRE(engine.ok());
  // A prompt whose greedy run of 20 tokens meets no end-of-sentence token.
  std::vector<int32_t> prompt;
  Outcome free_run;
  for (uint32_t seed = 77; seed < 177 && free_run.reason != "length"; ++seed) {
    prompt = Prompt(12, seed, 480);
    free_run = Drain(*(*engine)->Submit(Request(prompt, 0.0f, 1, 20)).second);
  }
  BOOST_REQUIRE(free_run.reason == "length");
  BOOST_TEST(free_run.tokens.size() == 20u);

  GenerationRequest by_token = Request(prompt, 0.0f, 1, 20);
  by_token.sampling.stop_tokens = {free_run.tokens[3]};
  Outcome t = Drain(*(*engine)->Submit(by_token).second);
  BOOST_TEST(t.reason == "stop");
  BOOST_TEST(t.tokens.size() <= 4u);

  // A stop string from the middle of the free run's text: output ends right before it.
  BOOST_REQUIRE(free_run.text.size() > 6u);
  const std::string stop = free_run.text.substr(free_run.text.size() / 2, 3);
  GenerationRequest by_string = Request(prompt, 0.0f, 1, 20);
  by_string.sampling.stop = {stop};
  Outcome s = Drain(*(*engine)->Submit(by_string).second);
  BOOST_TEST(s.reason == "stop");
  BOOST_TEST(s.text == free_run.text.substr(0, free_run.text.find(stop)));

  GenerationRequest bad = Request(prompt, -1.0f, 1, 5);
  Outcome b = Drain(*(*engine)->Submit(bad).second);
  BOOST_TEST(b.reason == "error");
  BOOST_TEST(b.error.message().rfind("temperature", 0) == 0u);
}

BOOST_AUTO_TEST_CASE(ignore_eos_generates_past_end_of_sentence) {
  auto engine = Engine::Open(GoldenOptions());
  BOOST_REQUIRE(engine.ok());
  const int32_t eos = static_cast<int32_t>((*engine)->config().eos_token_id);
  // Find a seeded run that ends on the end-of-sentence token.
  std::optional<Outcome> ended;
  uint64_t seed = 0;
  for (; seed < 400 && !ended; ++seed) {
    Outcome o = Drain(*(*engine)->Submit(Request(Prompt(8, 5, 480), 1.5f, seed, 48)).second);
    if (o.reason == "stop") ended = o;
  }
  BOOST_REQUIRE_MESSAGE(ended.has_value(), "no run of 400 met the end-of-sentence token");
  BOOST_TEST(ended->tokens.back() == eos);
  GenerationRequest past = Request(Prompt(8, 5, 480), 1.5f, seed - 1, 48);
  past.sampling.ignore_eos = true;
  Outcome o = Drain(*(*engine)->Submit(past).second);
  BOOST_TEST(o.reason == "length");
  BOOST_TEST(o.tokens.size() == 48u);
  // The same tokens up to and including the end-of-sentence, then more.
  BOOST_TEST(std::vector<int32_t>(o.tokens.begin(), o.tokens.begin() + ended->tokens.size()) ==
             ended->tokens);
}

BOOST_AUTO_TEST_CASE(a_flood_of_short_requests_beside_a_200k_token_prompt) {
  // A small window-only model, so a 200K-token prompt runs in seconds on two cores.
  flashd::testing::TempDir tmp;
  const std::string dir = (tmp.path() / "m").string();
  const std::string cmd =
      std::string(FLASHD_BINARY) + " mkmodel " + dir +
      " --set vocab_size=512 --set hidden_size=64 --set num_hidden_layers=2"
      " --set compress_ratios=[0,0] --set kv_source_layer_ids=[] --set index_source_layer_ids=[]"
      " --set candidate_source_layer_id=-1 --set engram_layer_ids=[]"
      " --set num_nextn_predict_layers=0 --set moe_intermediate_size=64 --set q_lora_rank=32"
      " --set head_dim=64 --set qk_rope_head_dim=16 --set o_lora_rank=32"
      " --set num_attention_heads=2 --set o_groups=1 --set sliding_window=16"
      " --set n_routed_experts=4 > /dev/null";
  BOOST_REQUIRE(std::system(cmd.c_str()) == 0);
  EngineOptions options;
  options.model_dir = dir;
  options.step_token_budget = 2048;
  options.prefill_chunk = 1024;
  auto engine = Engine::Open(options);
  BOOST_REQUIRE_MESSAGE(engine.ok(), engine.status().ToString());

  auto [long_handle, long_queue] = (*engine)->Submit(Request(Prompt(200000, 1, 512), 0.0f, 1, 2));
  std::vector<std::shared_ptr<EventQueue>> shorts;
  for (int i = 0; i < 200; ++i) {
    GenerationRequest r = Request(Prompt(8, 1000 + i, 512), 0.7f, i, 4);
    r.tenant = "agent-" + std::to_string(i % 5);
    shorts.push_back((*engine)->Submit(r).second);
  }
  std::vector<Outcome> short_out;
  for (auto& q : shorts) short_out.push_back(Drain(*q));
  Outcome long_out = Drain(*long_queue);
  BOOST_TEST(long_out.reason == "length");
  BOOST_TEST(long_out.tokens.size() == 2u);
  // The long prompt needs at least 200000 / 1024 steps of prefill; every short request is done
  // long before it produces its first token.
  BOOST_TEST(long_out.first_token_step >= 195);
  int64_t last_short = 0;
  for (const Outcome& o : short_out) {
    // Four tokens, or fewer when one of them is the end-of-sentence token.
    BOOST_TEST((o.reason == "length" || o.reason == "stop"));
    BOOST_TEST((o.tokens.size() == 4u || (o.reason == "stop" && !o.tokens.empty())));
    last_short = std::max(last_short, o.done_step);
  }
  BOOST_TEST(last_short < long_out.first_token_step / 4);
  BOOST_TEST((*engine)->stats().prompt_tokens_processed >= 200000 + 200 * 8);
}

BOOST_AUTO_TEST_SUITE_END()

}  // namespace
}  // namespace flashd::engine
