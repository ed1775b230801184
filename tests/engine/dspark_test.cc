// DSpark speculative decoding: the forward pass's partial commit (a verified block keeps exactly
// the tokens it accepts), the drafter's state (rings filled by every call, carried by forks and
// snapshots), the draft call's determinism, and the engine's loop: greedy output identical with
// and without drafting, sampled output reproducible under a seed.
#include <boost/test/unit_test.hpp>
#include <chrono>
#include <cstring>
#include <memory>
#include <random>
#include <thread>

#include "engine/engine.h"
#include "engine/forward.h"
#include "engine/model.h"
#include "engine/tiny_model.h"
#include "engine/tokenizer.h"
#include "tests/support/temp_dir.h"

namespace flashd::engine {
namespace {

// A tiny model in the released format with two DSpark stages and a window of 8 (rings wrap
// often; a verified block of 6 fits), on the golden tokenizer.
struct DraftModel {
  flashd::testing::TempDir tmp;
  std::string dir;
  std::unique_ptr<Model> model;
  std::unique_ptr<CpuForward> forward;

  DraftModel() {
    dir = (tmp.path() / "m").string();
    auto json = TinyConfigJson(R"({"vocab_size": 480, "engram_compressed_vocab_size": 389,
        "dspark_noise_token_id": 400, "sliding_window": 8, "num_nextn_predict_layers": 2,
        "compress_ratios": [0, 2, 2, 1, 1, 0, 0, 0], "hidden_size": 128,
        "moe_intermediate_size": 64})");
    BOOST_REQUIRE_MESSAGE(json.ok(), json.status().ToString());
    TinyModelOptions o;
    o.seed = 5;
    o.tokenizer_dir = FLASHD_GOLDEN_DIR;
    const Status w = WriteTinyModel(dir, *json, o);
    BOOST_REQUIRE_MESSAGE(w.ok(), w.ToString());
    auto m = Model::Load(dir);
    BOOST_REQUIRE_MESSAGE(m.ok(), m.status().ToString());
    model = std::move(*m);
    BOOST_REQUIRE(model->weights().dspark);
    auto f = CpuForward::Create(*model, "", 16);
    BOOST_REQUIRE(f.ok());
    forward = std::move(*f);
    const Status e = forward->EnableDSpark();
    BOOST_REQUIRE_MESSAGE(e.ok(), e.ToString());
  }
};

DraftModel& Shared() {
  static DraftModel* m = new DraftModel();  // Kept for the process: tests share it.
  return *m;
}

std::vector<int32_t> Tokens(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> d(3, 479);
  std::vector<int32_t> t(n);
  for (int32_t& v : t) v = d(rng);
  return t;
}

struct Draft {
  std::vector<int32_t> tokens;
  std::vector<float> confidence;
  std::vector<std::vector<float>> logits;
};

// A greedy draft (each pick the argmax) after `token`.
Draft GreedyDraft(const CpuForward& f, const SequenceState& s, int32_t token) {
  Draft d;
  DraftItem item;
  item.state = &s;
  item.token = token;
  item.pick = [&d](int64_t, std::span<const float> l) {
    d.logits.emplace_back(l.begin(), l.end());
    return static_cast<int32_t>(std::max_element(l.begin(), l.end()) - l.begin());
  };
  item.drafted = &d.tokens;
  item.confidence = &d.confidence;
  const Status st = f.Draft(std::span<DraftItem>(&item, 1));
  BOOST_REQUIRE_MESSAGE(st.ok(), st.ToString());
  return d;
}

BOOST_AUTO_TEST_SUITE(dspark)

BOOST_AUTO_TEST_CASE(a_checkpoint_without_the_heads_cannot_draft) {
  auto m = Model::Load(FLASHD_GOLDEN_DIR);
  BOOST_REQUIRE(m.ok());
  BOOST_TEST(!(*m)->weights().dspark);
  auto f = CpuForward::Create(**m, "", 16);
  BOOST_REQUIRE(f.ok());
  const Status s = (*f)->EnableDSpark();
  BOOST_TEST(s.code() == StatusCode::kFailedPrecondition);
  BOOST_TEST(!(*f)->dspark());
}

// Every byte of the bounded state: window rings (the drafter's too), compressor groups and
// entries, Engram history. (Pool rows past the position are not part of the state: they are
// written again, with the tokens that end up there, before anything reads them.)
bool SameBoundedState(const SequenceState& a, const SequenceState& b) {
  if (a.position != b.position || a.engram_classes != b.engram_classes ||
      a.rings.size() != b.rings.size() || a.sources.size() != b.sources.size()) {
    return false;
  }
  for (size_t i = 0; i < a.rings.size(); ++i) {
    if (a.rings[i].codes != b.rings[i].codes || a.rings[i].scales != b.rings[i].scales) {
      return false;
    }
  }
  for (size_t i = 0; i < a.sources.size(); ++i) {
    if (a.sources[i].kv_partial != b.sources[i].kv_partial ||
        a.sources[i].score_partial != b.sources[i].score_partial ||
        a.sources[i].entries != b.sources[i].entries) {
      return false;
    }
  }
  return true;
}

// A verified block keeps k of its tokens: the sequence then equals one that ran only those:
// the logits, the bounded state byte for byte, and every later token's logits, whatever k.
BOOST_AUTO_TEST_CASE(a_verified_block_keeps_exactly_the_accepted_tokens) {
  const CpuForward& f = *Shared().forward;
  const std::vector<int32_t> prompt = Tokens(29, 1), more = Tokens(60, 2);
  SequenceState a = f.NewSequence(), b = f.NewSequence();
  std::vector<float> la, lb;
  BOOST_REQUIRE(f.Forward(&a, prompt, &la).ok());
  BOOST_REQUIRE(f.Forward(&b, prompt, &lb).ok());
  const size_t V = static_cast<size_t>(f.config().vocab_size);
  std::mt19937 rng(3);
  size_t done = 0;  // Tokens of `more` both have run.
  int partial = 0;
  while (done + 6 <= more.size()) {
    const size_t n = 1 + rng() % 6;
    const int64_t keep = static_cast<int64_t>(rng() % (n + 1));
    partial += keep < static_cast<int64_t>(n);
    // b runs n tokens, keeps `keep`.
    std::vector<float> block;
    BatchItem item{&b, std::span<const int32_t>(&more[done], n), &block};
    item.all_logits = true;
    std::vector<float> seen;
    item.accept = [&](std::span<const float> l) {
      seen.assign(l.begin(), l.end());
      return keep;
    };
    BOOST_REQUIRE(f.ForwardBatch(std::span<BatchItem>(&item, 1)).ok());
    BOOST_REQUIRE(seen.size() == n * V);
    // a runs the kept tokens one at a time: the same logits, bit for bit.
    for (int64_t t = 0; t < keep; ++t) {
      BOOST_REQUIRE(f.Forward(&a, std::span<const int32_t>(&more[done + t], 1), &la).ok());
      BOOST_TEST(std::memcmp(la.data(), &seen[t * V], V * sizeof(float)) == 0, "token " << t);
    }
    done += static_cast<size_t>(keep);
    BOOST_REQUIRE(a.position == b.position);
    BOOST_TEST(SameBoundedState(a, b), "after " << done << " tokens");
  }
  BOOST_TEST(partial > 3);
  // And both go on alike, over the compressed entries the blocks wrote again.
  const std::vector<int32_t> rest = Tokens(40, 9);
  ForwardOptions all;
  all.all_logits = true;
  std::vector<float> ta, tb;
  BOOST_REQUIRE(f.Forward(&a, rest, &ta, all).ok());
  BOOST_REQUIRE(f.Forward(&b, rest, &tb, all).ok());
  BOOST_TEST(ta == tb);
  BOOST_TEST(SameBoundedState(a, b));
}

// The drafter's rings are filled by every call, so any chunking of the same tokens drafts the
// same block; a fork and a restored snapshot draft it too; batching changes nothing.
BOOST_AUTO_TEST_CASE(drafts_depend_on_the_tokens_alone) {
  const CpuForward& f = *Shared().forward;
  const std::vector<int32_t> tokens = Tokens(41, 4);
  SequenceState whole = f.NewSequence(), steps = f.NewSequence();
  std::vector<float> l;
  BOOST_REQUIRE(f.Forward(&whole, tokens, &l).ok());
  for (size_t i = 0; i < tokens.size(); i += 3) {
    const size_t n = std::min<size_t>(3, tokens.size() - i);
    BOOST_REQUIRE(f.Forward(&steps, std::span<const int32_t>(&tokens[i], n), &l).ok());
  }
  const Draft d = GreedyDraft(f, whole, 17);
  BOOST_REQUIRE(d.tokens.size() == static_cast<size_t>(f.dspark_block()));
  BOOST_REQUIRE(d.confidence.size() == d.tokens.size());
  BOOST_TEST(d.logits.size() == d.tokens.size());
  const Draft s = GreedyDraft(f, steps, 17);
  BOOST_TEST(s.tokens == d.tokens);
  BOOST_TEST(s.confidence == d.confidence);
  BOOST_TEST(s.logits == d.logits);
  SequenceState fork = whole.Fork();
  BOOST_TEST(GreedyDraft(f, fork, 17).logits == d.logits);
  auto restored = f.Restore(whole.Serialize());
  BOOST_REQUIRE(restored.ok());
  BOOST_TEST(GreedyDraft(f, *restored, 17).logits == d.logits);
  // The draft reads the state: another pending token or another history drafts otherwise.
  BOOST_TEST(GreedyDraft(f, whole, 18).logits != d.logits);
  SequenceState other = f.NewSequence();
  BOOST_REQUIRE(f.Forward(&other, Tokens(41, 5), &l).ok());
  const Draft o = GreedyDraft(f, other, 17);
  BOOST_TEST(o.logits != d.logits);
  // Two sequences in one call draft as each alone.
  std::vector<int32_t> t0, t1;
  std::vector<float> c0, c1;
  auto argmax = [](int64_t, std::span<const float> x) {
    return static_cast<int32_t>(std::max_element(x.begin(), x.end()) - x.begin());
  };
  std::vector<DraftItem> items(2);
  items[0] = {&whole, 17, argmax, &t0, &c0};
  items[1] = {&other, 17, argmax, &t1, &c1};
  BOOST_REQUIRE(f.Draft(items).ok());
  BOOST_TEST(t0 == d.tokens);
  BOOST_TEST(c0 == d.confidence);
  BOOST_TEST(t1 == o.tokens);
  BOOST_TEST(c1 == o.confidence);
  // A pick sees the Markov bias of the token before: forcing another first pick changes the
  // second position's logits.
  std::vector<std::vector<float>> forced;
  std::vector<int32_t> ft;
  std::vector<float> fc;
  DraftItem item{&whole, 17,
                 [&](int64_t i, std::span<const float> x) {
                   forced.emplace_back(x.begin(), x.end());
                   return i == 0 ? (d.tokens[0] + 1) % 480 : argmax(i, x);
                 },
                 &ft, &fc};
  BOOST_REQUIRE(f.Draft(std::span<DraftItem>(&item, 1)).ok());
  BOOST_TEST(forced[0] == d.logits[0]);
  BOOST_TEST(forced[1] != d.logits[1]);
  // A limit or a confidence floor drafts fewer tokens, each as in the whole block (the head
  // runs per position; the stages always see the whole block).
  std::vector<int32_t> lt;
  std::vector<float> lc;
  DraftItem limited{&whole, 17, argmax, &lt, &lc};
  limited.limit = 2;
  BOOST_REQUIRE(f.Draft(std::span<DraftItem>(&limited, 1)).ok());
  BOOST_TEST(lt == std::vector<int32_t>(d.tokens.begin(), d.tokens.begin() + 2));
  BOOST_TEST(lc == std::vector<float>(d.confidence.begin(), d.confidence.begin() + 2));
  limited.limit = 0;
  limited.min_confidence = 1e30f;
  BOOST_REQUIRE(f.Draft(std::span<DraftItem>(&limited, 1)).ok());
  BOOST_TEST(lt.size() == 1u);  // The first position is always drafted.
  BOOST_TEST(lt[0] == d.tokens[0]);
  // Bad input is refused, not run.
  SequenceState fresh = f.NewSequence();
  BOOST_TEST(
      f.Draft(std::span<DraftItem>(&(items[0] = {&fresh, 17, argmax, &t0, &c0}), 1)).code() ==
      StatusCode::kInvalidArgument);
  BOOST_TEST(
      f.Draft(std::span<DraftItem>(&(items[0] = {&whole, 480, argmax, &t0, &c0}), 1)).code() ==
      StatusCode::kInvalidArgument);
}

// A sequence resumed from its KV blocks alone (the prefix cache's replay path) rebuilds the
// drafter's rings by the same exact replay: it drafts what the original drafts.
BOOST_AUTO_TEST_CASE(a_replayed_resume_rebuilds_the_drafters_rings) {
  const CpuForward& f = *Shared().forward;
  const int64_t block = f.block_tokens();
  const int64_t replay = f.ExactReplayTokens();
  const int64_t P = replay + 2 * block;  // Resume at P from its blocks, replaying `replay`.
  const std::vector<int32_t> tokens = Tokens(static_cast<size_t>(P + 5), 12);
  SequenceState whole = f.NewSequence();
  std::vector<float> l;
  BOOST_REQUIRE(f.Forward(&whole, tokens, &l).ok());
  KvPool& pool = *f.pool();
  auto copy_blocks = [&](size_t count) {
    std::vector<int32_t> ids;
    for (size_t b = 0; b < count; ++b) {
      const int32_t id = pool.Allocate();
      BOOST_REQUIRE(id >= 0);
      std::memcpy(pool.mutable_data(id), pool.data(whole.blocks[b]), pool.block_bytes());
      ids.push_back(id);
    }
    return ids;
  };
  auto resumed = f.ResumeAt(P - replay, std::span(tokens).first(static_cast<size_t>(P - replay)),
                            copy_blocks(static_cast<size_t>(P / block)));
  BOOST_REQUIRE_MESSAGE(resumed.ok(), resumed.status().ToString());
  std::vector<int32_t> rest(tokens.begin() + (P - replay), tokens.end());
  BOOST_REQUIRE(f.Forward(&*resumed, rest, &l).ok());
  BOOST_REQUIRE(resumed->position == whole.position);
  BOOST_TEST(SameBoundedState(*resumed, whole));
  BOOST_TEST(GreedyDraft(f, *resumed, 33).logits == GreedyDraft(f, whole, 33).logits);
}

std::vector<int32_t> Generate(Engine& e, std::vector<int32_t> prompt, float temperature,
                              uint64_t seed, int max_tokens, std::vector<int32_t> stop = {},
                              std::vector<std::string> stop_strings = {},
                              std::string* text = nullptr) {
  GenerationRequest r;
  r.sampling.stop = std::move(stop_strings);
  r.prompt = std::move(prompt);
  r.sampling.temperature = temperature;
  r.sampling.seed = seed;
  r.sampling.max_tokens = max_tokens;
  r.sampling.ignore_eos = true;
  r.sampling.stop_tokens = std::move(stop);
  auto [h, q] = e.Submit(std::move(r));
  std::vector<int32_t> out;
  for (;;) {
    auto ev = q->Pop(std::chrono::seconds(120));
    BOOST_REQUIRE(ev.has_value());
    if (ev->kind == GenerationEvent::Kind::kToken && ev->token.token >= 0) {
      out.push_back(ev->token.token);
    }
    if (ev->kind == GenerationEvent::Kind::kToken && text != nullptr) *text += ev->text;
    if (ev->kind == GenerationEvent::Kind::kDone) {
      BOOST_REQUIRE_MESSAGE(ev->error.ok(), ev->error.ToString());
      BOOST_TEST(ev->completion_tokens == static_cast<int64_t>(out.size()));
      return out;
    }
  }
}

// Greedy decoding gives the same tokens with and without DSpark, adaptive or with a fixed
// number of drafts, for many prompts decoded together; a seeded sampled request is reproducible.
BOOST_AUTO_TEST_CASE(greedy_output_is_identical_with_and_without_drafting) {
  EngineOptions plain;
  plain.model_dir = Shared().dir;
  plain.block_tokens = 16;
  plain.speculative = "off";
  auto off = Engine::Open(plain);
  BOOST_REQUIRE(off.ok());
  BOOST_TEST(!(*off)->speculative());
  std::vector<std::vector<int32_t>> prompts;
  for (uint32_t i = 0; i < 10; ++i) prompts.push_back(Tokens(3 + 7 * i, 50 + i));
  std::vector<std::vector<int32_t>> want;
  for (const auto& p : prompts) want.push_back(Generate(**off, p, 0.0f, 1, 20));
  // A stop token inside a verified block ends the output on it, as without drafting.
  const int32_t stop = want[4][9];
  const std::vector<int32_t> stopped = Generate(**off, prompts[4], 0.0f, 1, 20, {stop});
  BOOST_TEST(stopped.size() <= 10u);
  BOOST_TEST(stopped.back() == stop);
  // A stop string completed by a token inside a verified block ends the output there too: the
  // text of three tokens from the middle of a run, whole characters (streamed as they are; a
  // partial one streams as U+FFFD), taken where it first appears in the run's text.
  const auto decode = [&](size_t from, size_t n) {
    return (*off)->tokenizer()->Decode(std::span<const int32_t>(&want[6][from], n));
  };
  const std::string full = decode(0, want[6].size());
  std::string later;
  size_t at = 0;
  for (size_t k = 8; k + 3 <= want[6].size() && later.empty(); ++k) {
    const std::string head = decode(0, k), text = decode(k, 3);
    if (!text.empty() && SanitizeUtf8(text) == text && full.compare(0, head.size(), head) == 0 &&
        full.find(text) == head.size()) {
      later = text;
      at = k;
    }
  }
  BOOST_REQUIRE_MESSAGE(!later.empty(), "no three tokens of the run stand alone in its text");
  std::string stopped_text;
  const std::vector<int32_t> by_string =
      Generate(**off, prompts[6], 0.0f, 1, 20, {}, {later}, &stopped_text);
  BOOST_TEST(by_string.size() <= at + 3);
  BOOST_TEST(stopped_text.find(later) == std::string::npos);
  off->reset();
  for (int fixed : {0, 3, 5}) {
    EngineOptions spec = plain;
    spec.speculative = "dspark";
    spec.speculative_tokens = fixed;
    auto on = Engine::Open(spec);
    BOOST_REQUIRE(on.ok());
    BOOST_TEST((*on)->speculative());
    // All at once, so verifications share steps with each other and with prefills.
    std::vector<std::thread> threads;
    std::vector<std::vector<int32_t>> got(prompts.size());
    for (size_t i = 0; i < prompts.size(); ++i) {
      threads.emplace_back([&, i] { got[i] = Generate(**on, prompts[i], 0.0f, 1, 20); });
    }
    for (auto& t : threads) t.join();
    for (size_t i = 0; i < prompts.size(); ++i) {
      BOOST_TEST(got[i] == want[i], "prompt " << i << " speculative_tokens " << fixed);
    }
    // A step's counts land just after its last events: wait for them.
    Engine::Stats s = (*on)->stats();
    for (int i = 0; i < 500 && s.tokens_generated < 10 * 20; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      s = (*on)->stats();
    }
    BOOST_TEST(s.spec_steps > 0);
    BOOST_TEST(s.spec_drafted >= s.spec_steps);
    BOOST_TEST(s.spec_accepted <= s.spec_drafted);
    BOOST_TEST(s.tokens_generated == 10 * 20);
    if (fixed > 0) BOOST_TEST(s.spec_drafted <= s.spec_steps * fixed);
    BOOST_TEST(Generate(**on, prompts[4], 0.0f, 1, 20, {stop}) == stopped);
    std::string text;
    BOOST_TEST(Generate(**on, prompts[6], 0.0f, 1, 20, {}, {later}, &text) == by_string);
    BOOST_TEST(text == stopped_text);
    // Sampling: the same seed gives the same tokens again.
    const std::vector<int32_t> s1 = Generate(**on, prompts[3], 0.9f, 77, 24);
    const std::vector<int32_t> s2 = Generate(**on, prompts[3], 0.9f, 77, 24);
    BOOST_TEST(s1 == s2);
    BOOST_TEST(s1.size() == 24u);
  }
}

BOOST_AUTO_TEST_SUITE_END()

}  // namespace
}  // namespace flashd::engine
