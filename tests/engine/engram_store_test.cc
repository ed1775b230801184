// EngramStore against the mapped checkpoint: every row and its scales read from the file equal
// the mapped bytes, with repeats, with a cache smaller than the call (evictions), with none, and
// with a table whose rows straddle 4 KiB blocks.
#include "engine/engram_store.h"

#include <boost/test/unit_test.hpp>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include "engine/backend.h"
#include "engine/engine.h"
#include "engine/forward.h"
#include "engine/model.h"
#include "engine/safetensors.h"
#include "tests/support/temp_dir.h"

namespace flashd::engine {
namespace {

struct Table {
  EngramTableFile file;
  const TensorView* rows = nullptr;
  const TensorView* scales = nullptr;
};

// The golden model's Engram tables as the engine finds them, with the mapped bytes to compare.
std::vector<Table> Tables(const Checkpoint& cp) {
  auto config = LoadModelConfig(FLASHD_GOLDEN_DIR);
  BOOST_REQUIRE_MESSAGE(config.ok(), config.status().ToString());
  auto files = EngramTableFiles(cp, *config);
  BOOST_REQUIRE_MESSAGE(files.ok(), files.status().ToString());
  std::vector<Table> out;
  for (size_t i = 0; i < files->size(); ++i) {
    const std::string p =
        "layers." + std::to_string(config->engram_layer_ids[i]) + ".engram.embed.";
    out.push_back({(*files)[i], cp.Find(p + "weight"), cp.Find(p + "scale")});
    BOOST_REQUIRE(out.back().rows != nullptr && out.back().scales != nullptr);
  }
  return out;
}

BOOST_AUTO_TEST_SUITE(engram_store)

BOOST_AUTO_TEST_CASE(rows_read_from_the_file_equal_the_mapped_rows) {
  auto cp = Checkpoint::Open(FLASHD_GOLDEN_DIR);
  BOOST_REQUIRE_MESSAGE(cp.ok(), cp.status().ToString());
  const std::vector<Table> tables = Tables(**cp);
  BOOST_REQUIRE(!tables.empty());
  std::vector<EngramTableFile> files;
  for (const Table& t : tables) files.push_back(t.file);
  // No cache, a cache smaller than one call, a cache holding everything.
  for (uint64_t cache : {uint64_t{0}, uint64_t{20 * 264}, uint64_t{1} << 26}) {
    auto store = EngramStore::Open(files, cache, 16);  // A shallow queue: several rounds.
    BOOST_REQUIRE_MESSAGE(store.ok(), store.status().ToString());
    for (int round = 0; round < 3; ++round) {
      for (size_t t = 0; t < tables.size(); ++t) {
        const int64_t rows = tables[t].file.rows;
        const size_t rb = tables[t].file.row_bytes, sb = tables[t].file.scale_bytes;
        std::mt19937_64 rng(3 + t);  // The same ids each round: later rounds can hit.
        std::vector<int64_t> ids = {0, rows - 1, 5, 5, rows / 2};
        for (int i = 0; i < 200; ++i) ids.push_back(static_cast<int64_t>(rng() % rows));
        ids.push_back(0);  // A repeat of a row read earlier in the call.
        std::vector<uint8_t> got(ids.size() * rb), got_scales(ids.size() * sb);
        BOOST_REQUIRE(
            (*store)
                ->Gather(static_cast<int>(t), ids.data(), ids.size(), got.data(), got_scales.data())
                .ok());
        for (size_t i = 0; i < ids.size(); ++i) {
          BOOST_TEST_REQUIRE(std::memcmp(&got[i * rb], tables[t].rows->data + ids[i] * rb, rb) ==
                             0);
          BOOST_TEST_REQUIRE(
              std::memcmp(&got_scales[i * sb], tables[t].scales->data + ids[i] * sb, sb) == 0);
        }
      }
    }
    const EngramStore::Stats s = (*store)->stats();
    BOOST_TEST(s.rows == 3u * tables.size() * 206u);
    BOOST_TEST(s.reads > 0u);
    if (cache == 0) BOOST_TEST(s.hits >= 3u * tables.size() * 2u);  // In-call repeats only.
    if (cache == (uint64_t{1} << 26)) BOOST_TEST(s.hits >= s.rows * 2 / 3);  // Rounds 2-3 hit.
  }
}

// A table at an unaligned offset whose scales end the file: rows straddling 4 KiB blocks, and a
// last read that ends early at the end of the file.
BOOST_AUTO_TEST_CASE(rows_straddling_blocks_and_the_end_of_the_file) {
  flashd::testing::TempDir dir;
  const std::string path = (dir.path() / "table.bin").string();
  const int64_t rows = 100;
  const int rb = 256, sb = 8;
  std::vector<uint8_t> bytes(100 + rows * (rb + sb));
  std::mt19937 rng(5);
  for (uint8_t& b : bytes) b = static_cast<uint8_t>(rng());
  {
    std::ofstream out(path, std::ios::binary);
    out.write(reinterpret_cast<const char*>(bytes.data()),
              static_cast<std::streamsize>(bytes.size()));
  }
  const uint64_t scales_at = 100 + rows * rb;
  auto store = EngramStore::Open({{path, 100, scales_at, path, rows, rb, sb}}, 0);
  BOOST_REQUIRE_MESSAGE(store.ok(), store.status().ToString());
  std::vector<int64_t> ids(rows);
  for (int64_t i = 0; i < rows; ++i) ids[static_cast<size_t>(i)] = rows - 1 - i;
  std::vector<uint8_t> got(rows * rb), got_scales(rows * sb);
  Status s = (*store)->Gather(0, ids.data(), ids.size(), got.data(), got_scales.data());
  BOOST_REQUIRE_MESSAGE(s.ok(), s.ToString());
  for (size_t i = 0; i < ids.size(); ++i) {
    BOOST_TEST_REQUIRE(std::memcmp(&got[i * rb], &bytes[100 + ids[i] * rb], rb) == 0);
    BOOST_TEST_REQUIRE(std::memcmp(&got_scales[i * sb], &bytes[scales_at + ids[i] * sb], sb) == 0);
  }
  // A file cut short of the table is an error, not garbage.
  std::filesystem::resize_file(path, scales_at + 50 * sb);
  auto cut = EngramStore::Open({{path, 100, scales_at, path, rows, rb, sb}}, 0);
  BOOST_REQUIRE(cut.ok());
  const int64_t last = rows - 1;
  Status bad = (*cut)->Gather(0, &last, 1, got.data(), got_scales.data());
  BOOST_TEST(bad.code() == StatusCode::kDataLoss);
}

BOOST_AUTO_TEST_CASE(an_id_outside_the_table_is_refused) {
  auto cp = Checkpoint::Open(FLASHD_GOLDEN_DIR);
  BOOST_REQUIRE(cp.ok());
  const std::vector<Table> tables = Tables(**cp);
  auto store = EngramStore::Open({tables[0].file}, 0);
  BOOST_REQUIRE(store.ok());
  const int64_t bad[] = {0, tables[0].file.rows};
  std::vector<uint8_t> rows(2 * tables[0].file.row_bytes), scales(2 * tables[0].file.scale_bytes);
  Status s = (*store)->Gather(0, bad, 2, rows.data(), scales.data());
  BOOST_TEST(s.code() == StatusCode::kInvalidArgument);
  BOOST_TEST(s.message().find("outside table 0") != std::string::npos);
  BOOST_TEST((*store)->stats().reads == 0u);
  BOOST_TEST(!(*store)->Gather(1, bad, 1, rows.data(), scales.data()).ok());
}

// The engine with its Engram rows from SSD gives the same tokens and log-probabilities, bit for
// bit, as with the mapped tables: a prompt in several chunks, then decoding; the cache a few
// rows (evictions all along), and none.
BOOST_AUTO_TEST_CASE(the_engine_reading_rows_from_ssd_equals_the_mapped_tables) {
  auto run = [](const std::string& engram, uint64_t cache) {
    EngineOptions o;
    o.model_dir = FLASHD_GOLDEN_DIR;
    o.step_token_budget = 64;
    o.prefill_chunk = 48;
    o.engram = engram;
    o.engram_cache_bytes = cache;
    auto e = Engine::Open(o);
    BOOST_REQUIRE_MESSAGE(e.ok(), e.status().ToString());
    BOOST_TEST(((*e)->engram_store() != nullptr) == (engram == "ssd"));
    std::vector<std::pair<int32_t, float>> out;
    std::mt19937 rng(9);
    for (int p = 0; p < 2; ++p) {
      GenerationRequest r;
      for (int i = 0; i < 150; ++i) r.prompt.push_back(static_cast<int32_t>(3 + rng() % 300));
      r.sampling.temperature = 0;
      r.sampling.max_tokens = 6;
      r.sampling.ignore_eos = true;
      r.sampling.want_logprob = true;  // Compared bit for bit.
      auto [h, q] = (*e)->Submit(std::move(r));
      for (;;) {
        auto ev = q->Pop(std::chrono::minutes(5));
        BOOST_REQUIRE(ev.has_value());
        if (ev->kind == GenerationEvent::Kind::kToken)
          out.push_back({ev->token.token, ev->token.logprob});
        if (ev->kind == GenerationEvent::Kind::kDone) {
          BOOST_REQUIRE_MESSAGE(ev->error.ok(), ev->error.ToString());
          break;
        }
      }
    }
    if (const EngramStore* store = (*e)->engram_store()) {
      const EngramStore::Stats s = store->stats();
      BOOST_TEST(s.rows > 0u);  // Every Engram row came through the store.
      BOOST_TEST(s.reads > 0u);
      if (cache > 0) BOOST_TEST(s.hits > 0u);
    }
    return out;
  };
  const auto mapped = run("memory", 0);
  BOOST_REQUIRE(mapped.size() == 12u);
  for (uint64_t cache : {uint64_t{0}, uint64_t{40 * 264}}) {
    const auto ssd = run("ssd", cache);
    BOOST_REQUIRE(ssd.size() == mapped.size());
    for (size_t i = 0; i < ssd.size(); ++i) {
      BOOST_TEST(ssd[i].first == mapped[i].first);
      BOOST_TEST(std::memcmp(&ssd[i].second, &mapped[i].second, 4) == 0);
    }
  }
}

// The CPU backend, but at each Engram layer's gate it notes how many Gather calls the store has
// had, waiting (up to a bound) until every Engram layer of the step has been asked for.
class WatchingBackend : public CpuBackend {
 public:
  explicit WatchingBackend(const EngramStore** store, uint64_t* want)
      : store_(store), want_(want) {}
  kernels::OpStatus EngramGate(const kernels::EngramGateParams& p) const override {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    uint64_t gathers = (*store_)->stats().gathers;
    while (gathers < *want_ && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      gathers = (*store_)->stats().gathers;
    }
    seen.push_back(gathers);
    return CpuBackend::EngramGate(p);
  }
  mutable std::vector<uint64_t> seen;

 private:
  const EngramStore** store_;
  const uint64_t* want_;
};

// A step asks for every Engram layer's rows when it starts, so the last layer's rows are being
// read while the first Engram layer computes. Read layer by layer as each is reached, the first
// gate would find one call and wait out its bound.
BOOST_AUTO_TEST_CASE(a_step_reads_every_engram_layers_rows_before_the_first_needs_them) {
  auto model = Model::Load(FLASHD_GOLDEN_DIR);
  BOOST_REQUIRE_MESSAGE(model.ok(), model.status().ToString());
  const size_t layers = (*model)->config().engram_layer_ids.size();
  BOOST_REQUIRE(layers >= 2u);
  const EngramStore* watched = nullptr;
  uint64_t want = 0;
  auto backend = std::make_unique<WatchingBackend>(&watched, &want);
  WatchingBackend* watch = backend.get();
  auto fwd = CpuForward::Create(**model, "", 64, std::move(backend));
  BOOST_REQUIRE_MESSAGE(fwd.ok(), fwd.status().ToString());
  auto tables = EngramTableFiles((*model)->checkpoint(), (*model)->config());
  BOOST_REQUIRE_MESSAGE(tables.ok(), tables.status().ToString());
  auto store = EngramStore::Open(std::move(*tables), 0);
  BOOST_REQUIRE_MESSAGE(store.ok(), store.status().ToString());
  std::shared_ptr<EngramStore> shared = std::move(*store);
  watched = shared.get();
  BOOST_REQUIRE((*fwd)->SetEngramStore(shared).ok());

  std::vector<int32_t> prompt;
  for (int i = 0; i < 40; ++i) prompt.push_back(5 + 7 * i % 250);
  SequenceState state = (*fwd)->NewSequence();
  std::vector<float> logits;
  for (int step = 0; step < 2; ++step) {
    want = (step + 1) * layers;
    const std::span<const int32_t> tokens =
        step == 0 ? std::span<const int32_t>(prompt) : std::span<const int32_t>(prompt).first(1);
    BOOST_REQUIRE((*fwd)->Forward(&state, tokens, &logits).ok());
  }
  // Every gate of a step saw all of the step's layers asked for.
  BOOST_REQUIRE(watch->seen.size() == 2 * layers);
  for (size_t i = 0; i < watch->seen.size(); ++i) {
    BOOST_TEST(watch->seen[i] == (i / layers + 1) * layers, "gate " << i);
  }
  BOOST_TEST(shared->stats().gathers == 2 * layers);  // One call per layer and step.
}

// The bounded replay drops rows of the step after the last KV source; the golden model's second
// Engram layer comes after it, so its rows gathered ahead must follow the rows kept.
BOOST_AUTO_TEST_CASE(rows_gathered_ahead_follow_the_bounded_replay) {
  auto model = Model::Load(FLASHD_GOLDEN_DIR);
  BOOST_REQUIRE_MESSAGE(model.ok(), model.status().ToString());
  const ModelConfig& c = (*model)->config();
  int last_source = -1;
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    if (c.layers[l].is_kv_source) last_source = l;
  }
  BOOST_REQUIRE(c.engram_layer_ids.back() > last_source);
  auto mapped = CpuForward::Create(**model);
  auto ssd = CpuForward::Create(**model);
  BOOST_REQUIRE(mapped.ok() && ssd.ok());
  auto tables = EngramTableFiles((*model)->checkpoint(), c);
  BOOST_REQUIRE_MESSAGE(tables.ok(), tables.status().ToString());
  auto store = EngramStore::Open(std::move(*tables), 0);
  BOOST_REQUIRE_MESSAGE(store.ok(), store.status().ToString());
  BOOST_REQUIRE((*ssd)->SetEngramStore(std::move(*store)).ok());
  std::vector<int32_t> prompt;
  for (int i = 0; i < 60; ++i) prompt.push_back(3 + (11 * i + 5) % 400);
  ForwardOptions options;
  options.replay_tokens = c.sliding_window;  // Fewer rows than the prompt's go on.
  BOOST_REQUIRE(options.replay_tokens < static_cast<int64_t>(prompt.size()));
  SequenceState a = (*mapped)->NewSequence(), b = (*ssd)->NewSequence();
  std::vector<float> want, got;
  BOOST_REQUIRE((*mapped)->Forward(&a, prompt, &want, options).ok());
  BOOST_REQUIRE((*ssd)->Forward(&b, prompt, &got, options).ok());
  BOOST_REQUIRE(want.size() == got.size());
  BOOST_TEST(std::memcmp(want.data(), got.data(), want.size() * sizeof(float)) == 0);
}

BOOST_AUTO_TEST_SUITE_END()

}  // namespace
}  // namespace flashd::engine
