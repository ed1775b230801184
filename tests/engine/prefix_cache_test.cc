// The engine with the persistent prefix cache: restored prompts give bit-identical results to
// prefilling them, across restarts, through both restore paths (snapshot and block replay);
// shared prefixes are stored once; tenants never hit each other; a corrupt block is never used.
#include <boost/test/unit_test.hpp>
#include <cstring>
#include <future>
#include <random>

#include "engine/engine.h"
#include "tests/support/temp_dir.h"

namespace flashd::engine {
namespace {

using flashd::testing::TempDir;
using std::chrono::milliseconds;

struct Outcome {
  std::vector<int32_t> tokens;
  std::vector<float> logprobs;
  std::string reason;
  int64_t cached = -1;
};

Outcome Run(Engine& engine, std::vector<int32_t> prompt, int max_tokens,
            const std::string& tenant = "default", std::vector<int64_t> snapshot_at = {}) {
  GenerationRequest r;
  r.prompt = std::move(prompt);
  r.snapshot_at = std::move(snapshot_at);
  r.sampling.temperature = 0;
  r.sampling.max_tokens = max_tokens;
  r.sampling.ignore_eos = true;
  r.sampling.want_logprob = true;  // Compared bit for bit.
  r.tenant = tenant;
  auto [handle, queue] = engine.Submit(std::move(r));
  Outcome o;
  for (;;) {
    auto e = queue->Pop(milliseconds(600000));
    BOOST_REQUIRE_MESSAGE(e.has_value(), "no event within the timeout");
    if (e->kind == GenerationEvent::Kind::kToken && e->token.token >= 0) {
      o.tokens.push_back(e->token.token);
      o.logprobs.push_back(e->token.logprob);
    }
    if (e->kind == GenerationEvent::Kind::kDone) {
      BOOST_REQUIRE_MESSAGE(e->error.ok(), e->error.ToString());
      o.reason = e->finish_reason;
      o.cached = e->cached_tokens;
      return o;
    }
  }
}

bool SameOutput(const Outcome& a, const Outcome& b) {
  return a.tokens == b.tokens && a.logprobs.size() == b.logprobs.size() &&
         std::memcmp(a.logprobs.data(), b.logprobs.data(), a.logprobs.size() * 4) == 0;
}

std::vector<int32_t> Tokens(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> d(3, 400);
  std::vector<int32_t> p(n);
  for (int32_t& t : p) t = d(rng);
  return p;
}

std::vector<int32_t> Concat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

std::shared_ptr<cache::BlockStore> OpenStore(const std::filesystem::path& dir) {
  cache::StoreOptions o;
  o.dir = (dir / "cache").string();
  auto store = cache::BlockStore::Open(o);
  BOOST_REQUIRE_MESSAGE(store.ok(), store.status().ToString());
  return std::shared_ptr<cache::BlockStore>(std::move(store).value());
}

std::unique_ptr<Engine> OpenEngine(
    std::shared_ptr<cache::BlockStore> store,
    std::function<void(const GenerationRequest&)> before_lookup = nullptr) {
  EngineOptions o;
  o.before_lookup_for_test = std::move(before_lookup);
  o.model_dir = FLASHD_GOLDEN_DIR;
  o.step_token_budget = 256;
  o.prefill_chunk = 128;
  o.cache = std::move(store);
  auto e = Engine::Open(o);
  BOOST_REQUIRE_MESSAGE(e.ok(), e.status().ToString());
  return std::move(e).value();
}

// What prefilling everything gives: the reference every restored run must equal.
Outcome Uncached(std::vector<int32_t> prompt, int max_tokens) {
  static std::unique_ptr<Engine> plain = OpenEngine(nullptr);
  Outcome o = Run(*plain, std::move(prompt), max_tokens);
  BOOST_TEST(o.cached == 0);
  return o;
}

BOOST_AUTO_TEST_SUITE(prefix_cache)

BOOST_AUTO_TEST_CASE(resume_after_restart_is_bit_exact_from_a_snapshot) {
  TempDir dir;
  const std::vector<int32_t> first = Tokens(300, 1);
  Outcome turn1;
  {
    auto engine = OpenEngine(OpenStore(dir.path()));
    turn1 = Run(*engine, first, 12);
    BOOST_TEST(turn1.cached == 0);
  }  // Engine and store closed: the daemon restarting.
  // The next turn: everything the model saw (prompt, then all output but the last token, which
  // was sampled and never run), plus new text.
  std::vector<int32_t> second = first;
  second.insert(second.end(), turn1.tokens.begin(), turn1.tokens.end());
  second = Concat(second, Tokens(40, 2));
  auto store = OpenStore(dir.path());
  auto engine = OpenEngine(store);
  Outcome turn2 = Run(*engine, second, 12);
  BOOST_TEST(turn2.cached == 300 + 11);  // The generation-end snapshot: zero recomputation.
  BOOST_TEST(engine->stats().cache_snapshot_hits == 1);
  BOOST_TEST(SameOutput(turn2, Uncached(second, 12)));
  // The first turn again: its prompt-end snapshot is at the last prompt token, which always
  // runs, so this one resumes from stored blocks plus the exact replay.
  Outcome again = Run(*engine, first, 12);
  BOOST_TEST(SameOutput(again, turn1));
  BOOST_TEST(again.cached == 256 - engine->exact_replay_tokens());
  BOOST_TEST(engine->stats().cache_replay_hits == 1);
}

BOOST_AUTO_TEST_CASE(a_prompt_diverging_between_snapshots_replays_exactly) {
  TempDir dir;
  auto store = OpenStore(dir.path());
  auto engine = OpenEngine(store);
  const std::vector<int32_t> a = Tokens(700, 3);
  Run(*engine, a, 4);
  store->Flush();
  // Shares 650 tokens with a: ten full blocks, no snapshot on its path.
  std::vector<int32_t> b(a.begin(), a.begin() + 650);
  b = Concat(b, Tokens(90, 4));
  Outcome got = Run(*engine, b, 8);
  BOOST_TEST(got.cached == 640 - engine->exact_replay_tokens());
  BOOST_TEST(SameOutput(got, Uncached(b, 8)));
  BOOST_TEST(engine->stats().cache_replay_hits == 1);
  BOOST_TEST(engine->stats().cache_snapshot_hits == 0);
}

BOOST_AUTO_TEST_CASE(a_requested_snapshot_spares_later_prompts_the_replay) {
  TempDir dir;
  auto store = OpenStore(dir.path());
  auto engine = OpenEngine(store);
  // A shared head of 650 tokens (a client's system prompt and tools), then a session's own text.
  const std::vector<int32_t> head = Tokens(650, 8);
  const std::vector<int32_t> a = Concat(head, Tokens(200, 9));
  // Positions outside the prompt and repeats are ignored; 650 is where sessions part.
  Outcome first = Run(*engine, a, 4, "default", {0, 650, 650, 5000, -3});
  BOOST_TEST(first.cached == 0);
  BOOST_TEST(SameOutput(first, Uncached(a, 4)));  // Chunking at the snapshot changes nothing.
  store->Flush();
  const auto stored = store->stats();
  BOOST_TEST(stored.snapshots == 3u);  // At 650, at the prompt's end, at the generation's end.
  // Another session: the same head, then its own text. It resumes at the head's end exactly,
  // with no replay, where without the snapshot it would replay from block 10 - the window.
  const std::vector<int32_t> b = Concat(head, Tokens(120, 10));
  Outcome got = Run(*engine, b, 8);
  BOOST_TEST(got.cached == 650);
  BOOST_TEST(engine->stats().cache_snapshot_hits == 1);
  BOOST_TEST(engine->stats().cache_replayed_tokens == 0);
  BOOST_TEST(SameOutput(got, Uncached(b, 8)));
  // Without a requested snapshot the same divergence costs the replay.
  const std::vector<int32_t> head2 = Tokens(650, 11);
  Run(*engine, Concat(head2, Tokens(200, 12)), 4);
  Outcome replayed = Run(*engine, Concat(head2, Tokens(120, 13)), 8);
  BOOST_TEST(replayed.cached == 640 - engine->exact_replay_tokens());
}

// A requested snapshot inside the stretch a replayed restore re-runs (the blocks read reach past
// it) is not stored; the request and a later one parting there are still exact.
BOOST_AUTO_TEST_CASE(a_requested_snapshot_inside_a_replay_is_placed_right) {
  TempDir dir;
  auto store = OpenStore(dir.path());
  auto engine = OpenEngine(store);
  const int64_t replay = engine->exact_replay_tokens();
  const std::vector<int32_t> a = Tokens(700, 14);
  Run(*engine, a, 4);
  store->Flush();
  std::vector<int32_t> b(a.begin(), a.begin() + 650);
  b = Concat(b, Tokens(90, 15));
  const int64_t at = 640 - replay / 2;  // Between the replay's start and the blocks' end.
  Outcome got = Run(*engine, b, 8, "default", {at});
  BOOST_TEST(got.cached == 640 - replay);
  BOOST_TEST(SameOutput(got, Uncached(b, 8)));
  store->Flush();
  std::vector<int32_t> c(b.begin(), b.begin() + at);
  c = Concat(c, Tokens(50, 16));
  Outcome later = Run(*engine, c, 8);
  BOOST_TEST(later.cached == at / 64 * 64 - replay);
  BOOST_TEST(SameOutput(later, Uncached(c, 8)));
}

BOOST_AUTO_TEST_CASE(a_shared_prefix_is_stored_once) {
  TempDir dir;
  auto store = OpenStore(dir.path());
  auto engine = OpenEngine(store);
  const std::vector<int32_t> common = Tokens(10240, 5);  // 160 blocks.
  Run(*engine, Concat(common, Tokens(100, 6)), 1);
  store->Flush();
  const auto after_one = store->stats();
  BOOST_TEST(after_one.blocks == 161u);  // 10,340 prompt tokens: 161 full blocks.
  Outcome two = Run(*engine, Concat(common, Tokens(100, 7)), 1);
  store->Flush();
  const auto after_two = store->stats();
  // The second conversation adds only its own full block (and its snapshot).
  BOOST_TEST(after_two.blocks - after_one.blocks == 1u);
  BOOST_TEST(after_two.snapshots - after_one.snapshots == 1u);
  BOOST_TEST(two.cached == 10240 - engine->exact_replay_tokens());
}

BOOST_AUTO_TEST_CASE(tenants_never_hit_each_others_prefixes) {
  TempDir dir;
  auto store = OpenStore(dir.path());
  auto engine = OpenEngine(store);
  const std::vector<int32_t> p = Tokens(400, 8);
  Run(*engine, p, 3, "alice");
  store->Flush();
  std::vector<int32_t> longer = Concat(p, Tokens(30, 9));
  BOOST_TEST(Run(*engine, longer, 3, "bob").cached == 0);
  // Alice's prompt-end snapshot (the generation's does not match: other text follows it).
  BOOST_TEST(Run(*engine, longer, 3, "alice").cached == 400);
}

BOOST_AUTO_TEST_CASE(a_corrupt_block_is_never_used) {
  TempDir dir;
  const std::vector<int32_t> p = Tokens(520, 10);
  cache::BlockKey fingerprint;
  {
    auto engine = OpenEngine(OpenStore(dir.path()));
    Run(*engine, p, 2);
    fingerprint = engine->model_fingerprint();
  }
  // Flip one byte of the third block's KV on disk.
  cache::KeyContext ctx{fingerprint, Engine::kCacheFormat, "default", kCpuNumerics};
  cache::BlockKey key;
  for (int j = 0; j < 3; ++j)
    key = cache::ChainBlockKey(key, std::span(p).subspan(j * 64, 64), ctx);
  auto store = OpenStore(dir.path());
  std::string v = *store->RawValue(cache::BlockStore::Kind::kBlock, key);
  v[v.size() / 2] ^= 1;
  BOOST_REQUIRE(store->OverwriteRawValue(cache::BlockStore::Kind::kBlock, key, v).ok());
  auto engine = OpenEngine(store);
  std::vector<int32_t> longer = Concat(p, Tokens(20, 11));
  Outcome got = Run(*engine, longer, 6);
  BOOST_TEST(store->stats().corruptions == 1u);
  // Only the two blocks before the bad one could be used; the output is still exact.
  BOOST_TEST(got.cached <= 128);
  BOOST_TEST(SameOutput(got, Uncached(longer, 6)));
}

BOOST_AUTO_TEST_CASE(a_slow_lookup_holds_no_other_request) {
  TempDir dir;
  const std::vector<int32_t> a = Tokens(300, 12), b = Tokens(300, 13);
  std::promise<void> release, entered;
  std::shared_future<void> released = release.get_future().share();
  std::future<void> slow_entered = entered.get_future();
  {
    auto engine = OpenEngine(OpenStore(dir.path()));
    Run(*engine, a, 1, "slow");
    Run(*engine, b, 1);
  }
  // The "slow" tenant's lookup waits inside the loader until the other request has finished:
  // with one loader thread the other request would wait behind it, and this test would hang.
  auto engine = OpenEngine(OpenStore(dir.path()), [&](const GenerationRequest& r) {
    if (r.tenant != "slow") return;
    entered.set_value();
    released.wait();
  });
  const std::vector<int32_t> a2 = Concat(a, Tokens(10, 14)), b2 = Concat(b, Tokens(10, 15));
  auto slow = std::async(std::launch::async, [&] { return Run(*engine, a2, 3, "slow"); });
  slow_entered.wait();  // A loader holds the slow request now.
  Outcome other = Run(*engine, b2, 3);
  BOOST_TEST(other.cached == 300);
  BOOST_TEST((slow.wait_for(milliseconds(0)) == std::future_status::timeout));
  release.set_value();
  Outcome got = slow.get();
  BOOST_TEST(got.cached == 300);
  BOOST_TEST(SameOutput(got, Uncached(a2, 3)));
  BOOST_TEST(SameOutput(other, Uncached(b2, 3)));
}

BOOST_AUTO_TEST_SUITE_END()

}  // namespace
}  // namespace flashd::engine
