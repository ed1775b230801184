// The CPU forward pass against the official reference implementation's own outputs, recorded in
// tests/golden (tests/golden/README.md says how). Nothing here needs torch.
//
// What agreement to expect. Both sides round activations to BF16 between ops and quantize to
// FP8/FP4 at the same points, but they sum in different orders (the reference's fp32 GEMMs and
// reductions run through BLAS). A different order changes an fp32 result in its last bits;
// rounded to BF16 (8 significant bits) that is almost always the same value, and then the two
// sides stay identical: logits agree to ~1e-6, which is why the tolerance below is 1e-3, far
// under any semantic error (those move logits by 0.1 to 1 on this model). Rarely, a value lands
// on a rounding boundary and flips by one BF16 ulp; an FP4 code has only 8 levels, so that can
// change a compressed key by a third of an element, a top-k selection, and from there every
// later token that attends to it. So:
//  - the short prompt's greedy continuation and every selection on the way must be identical;
//  - every prompt is compared exactly up to its first rounding flip, which the test locates
//    and reports, and which must not come before the first compressed groups and selections;
//  - the long prompts are also compared layer by layer with the reference's own input streams
//    forced into each layer (ForwardOptions::forced_streams), which stops a flip compounding
//    across layers; there a large majority of (layer, token) outputs must agree within 2 BF16
//    ulps and the greedy choice at every step must be the reference's.
#include <boost/test/unit_test.hpp>
#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "engine/forward.h"
#include "engine/numpy_rng.h"
#include "kernels/cpu/formats.h"
#include "tests/support/test_backend.h"

namespace flashd::engine {
namespace {

// The golden data was made by the reference, whose top-k breaks ties its own way.
ForwardOptions Reference() {
  ForwardOptions options;
  options.topk_order = kernels::TopKOrder::kReference;
  return options;
}

using nlohmann::json;
const std::string kDir = testing::GoldenDir();
constexpr double kLogitTolerance = 1e-3;
// Every prompt agrees exactly (logits to kLogitTolerance) over at least its first positions:
// the first compressed groups of ratios 1 and 2, the first selections of all four index layers
// and the candidate filter's. Where the first rounding flip comes is chance: in this data at
// positions 5, 4 and 32, each an RMSNorm output one BF16 step apart (the reference sums the
// squares in fp32 in torch's order, flashd in double), which then spreads as described above.
constexpr size_t kFirstExact = 4;

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  BOOST_REQUIRE_MESSAGE(in, "cannot read " << path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

struct Golden {
  json meta;
  std::vector<float> logits;   // [rows, vocab]: each run's prompt rows, then its 16 steps.
  std::vector<float> streams;  // [rows, layers, hc, dim]: the output of every layer.
  std::unique_ptr<Model> model;
  std::unique_ptr<CpuForward> forward;
  size_t vocab = 0, layers = 0, stream = 0;
};

const Golden& Load() {
  static Golden* g = [] {
    auto* out = new Golden();
    out->meta = json::parse(ReadFile(kDir + "/golden.json"));
    std::string logits = ReadFile(kDir + "/logits.f32");
    out->logits.resize(logits.size() / 4);
    std::memcpy(out->logits.data(), logits.data(), logits.size());
    std::string streams = ReadFile(kDir + "/streams.bf16");
    out->streams.resize(streams.size() / 2);
    for (size_t i = 0; i < out->streams.size(); ++i) {
      uint16_t v;
      std::memcpy(&v, &streams[2 * i], 2);
      out->streams[i] = kernels::cpu::Bf16ToFloat(v);
    }
    auto model = Model::Load(kDir);
    BOOST_REQUIRE_MESSAGE(model.ok(), model.status().ToString());
    out->model = std::move(*model);
    auto fwd = CpuForward::Create(*out->model, "", 64, testing::TestBackend());
    BOOST_REQUIRE_MESSAGE(fwd.ok(), fwd.status().ToString());
    out->forward = std::move(*fwd);
    const ModelConfig& c = out->forward->config();
    out->vocab = static_cast<size_t>(c.vocab_size);
    out->layers = static_cast<size_t>(c.num_hidden_layers);
    out->stream = static_cast<size_t>(c.hc_mult * c.hidden_size);
    return out;
  }();
  return *g;
}

// The first row of golden row `first` on whose logits `got` ([rows, vocab]) differs by more than
// the tolerance; rows.size() when none does. Also returns the largest difference before it.
size_t FirstDivergence(const Golden& g, const std::vector<float>& got, size_t first, size_t rows,
                       double* worst_before) {
  *worst_before = 0;
  for (size_t r = 0; r < rows; ++r) {
    double row_max = 0;
    for (size_t v = 0; v < g.vocab; ++v) {
      row_max = std::max(
          row_max, double(std::fabs(got[r * g.vocab + v] - g.logits[(first + r) * g.vocab + v])));
    }
    if (row_max > kLogitTolerance) return r;
    *worst_before = std::max(*worst_before, row_max);
  }
  return rows;
}

size_t ArgMax(const float* v, size_t n) { return std::max_element(v, v + n) - v; }

// The reference's selections of one run, by (layer, position): the compressed entries chosen,
// ascending (its indices are offset by the window rows they follow, and -1 marks none).
std::map<std::pair<int, int64_t>, std::vector<int64_t>> ReferenceSelections(const json& run) {
  std::map<std::pair<int, int64_t>, std::vector<int64_t>> out;
  for (const json& sel : run["selections"]) {
    const int64_t start = sel["start_pos"].get<int64_t>();
    const int offset = sel["offset"].get<int>();
    for (size_t r = 0; r < sel["idxs"].size(); ++r) {
      std::vector<int64_t> entries;
      for (int v : sel["idxs"][r].get<std::vector<int>>()) {
        if (v >= 0) entries.push_back(v - offset);
      }
      std::sort(entries.begin(), entries.end());
      out[{sel["layer"].get<int>(), start + static_cast<int64_t>(r)}] = entries;
    }
  }
  return out;
}

BOOST_AUTO_TEST_SUITE(golden)

BOOST_AUTO_TEST_CASE(engram_classes_multipliers_and_hash_ids_match) {
  const Golden& g = Load();
  auto vocab = BuildCompressedVocab(kDir + "/tokenizer.json");
  BOOST_REQUIRE(vocab.ok());
  BOOST_TEST(vocab->classes == g.meta["compressed_vocab_size"].get<int64_t>());
  BOOST_TEST(vocab->class_of == g.meta["token_map"].get<std::vector<int32_t>>(),
             boost::test_tools::per_element());
  const ModelConfig& c = g.forward->config();
  auto mult = EngramMultipliers(c.engram_layer_ids, c.engram_max_ngram_size, vocab->classes);
  BOOST_TEST((mult == g.meta["multipliers"].get<std::vector<std::vector<int64_t>>>()));

  // Row ids for every position of one prompt, every Engram layer and column.
  const json& run = g.meta["runs"][g.meta["engram_hash_ids_prompt"].get<int>()];
  std::vector<int32_t> prompt = run["prompt"].get<std::vector<int32_t>>();
  SequenceState st = g.forward->NewSequence();
  ForwardTrace trace;
  std::vector<float> logits;
  ForwardOptions options = Reference();
  options.trace = &trace;
  BOOST_REQUIRE(g.forward->Forward(&st, prompt, &logits, options).ok());
  auto want = g.meta["engram_hash_ids"].get<std::vector<std::vector<std::vector<int64_t>>>>();
  BOOST_REQUIRE(trace.engram_rows.size() == want.size());
  for (size_t t = 0; t < want.size(); ++t) {
    std::vector<int64_t> flat;
    for (const auto& layer : want[t]) flat.insert(flat.end(), layer.begin(), layer.end());
    BOOST_TEST(trace.engram_rows[t] == flat, "position " << t);
  }
}

BOOST_AUTO_TEST_CASE(short_prompt_and_greedy_continuation_match_exactly) {
  const Golden& g = Load();
  const json& run = g.meta["runs"][0];
  std::vector<int32_t> prompt = run["prompt"].get<std::vector<int32_t>>();
  std::vector<int32_t> want = run["continuation"].get<std::vector<int32_t>>();
  SequenceState st = g.forward->NewSequence();
  ForwardTrace trace;
  ForwardOptions options = Reference();
  options.all_logits = true;
  options.trace = &trace;
  std::vector<float> logits;
  BOOST_REQUIRE(g.forward->Forward(&st, prompt, &logits, options).ok());
  // Greedy decoding, one token per call, from this model's own choices.
  std::vector<int32_t> got;
  std::vector<float> all = logits;
  for (size_t step = 0; step < want.size(); ++step) {
    int32_t next = static_cast<int32_t>(ArgMax(&all[all.size() - g.vocab], g.vocab));
    got.push_back(next);
    std::vector<float> step_logits;
    options.all_logits = false;
    BOOST_REQUIRE(
        g.forward->Forward(&st, std::span<const int32_t>(&next, 1), &step_logits, options).ok());
    all.insert(all.end(), step_logits.begin(), step_logits.end());
  }
  BOOST_TEST(got == want, boost::test_tools::per_element());
  double worst = 0;
  const size_t rows = prompt.size() + want.size();
  // Exact until the first rounding flip (kFirstExact); after it the logits may differ by a few
  // hundredths without changing any choice or selection (both compared in full).
  const size_t first = FirstDivergence(g, all, 0, rows, &worst);
  BOOST_TEST(first >= kFirstExact);
  BOOST_TEST_MESSAGE("short prompt: exact (within " << worst << ") for " << first << " of " << rows
                                                    << " rows");
  // Every selection of every index layer at every position, prefill and decode.
  const auto reference = ReferenceSelections(run);
  size_t compared = 0;
  for (const ForwardTrace::Selection& s : trace.selections) {
    // The reference skips its indexer while nothing is visible yet: an empty selection.
    auto it = reference.find({s.layer, s.position});
    const std::vector<int64_t> want = it == reference.end() ? std::vector<int64_t>() : it->second;
    BOOST_TEST(s.entries == want, "layer " << s.layer << " position " << s.position);
    ++compared;
  }
  BOOST_TEST(compared == 4u * rows);  // Four index layers.
}

BOOST_AUTO_TEST_CASE(long_prompts_match_until_their_first_rounding_flip) {
  const Golden& g = Load();
  size_t row = 0;
  for (const json& run : g.meta["runs"]) {
    std::vector<int32_t> prompt = run["prompt"].get<std::vector<int32_t>>();
    SequenceState st = g.forward->NewSequence();
    ForwardOptions options = Reference();
    options.all_logits = true;
    std::vector<float> logits;
    BOOST_REQUIRE(g.forward->Forward(&st, prompt, &logits, options).ok());
    double worst = 0;
    size_t first = FirstDivergence(g, logits, row, prompt.size(), &worst);
    BOOST_TEST_MESSAGE("prompt of " << prompt.size() << " tokens: logits agree within " << worst
                                    << " for the first " << first << " positions");
    BOOST_TEST(first >= kFirstExact);
    row += prompt.size() + run["continuation"].size();
  }
}

BOOST_AUTO_TEST_CASE(every_layer_matches_on_the_reference_inputs) {
  const Golden& g = Load();
  size_t row = 0, pairs = 0, pairs_close = 0, selections = 0, selections_same = 0;
  std::vector<size_t> layer_close(g.layers, 0), layer_pairs(g.layers, 0);
  for (const json& run : g.meta["runs"]) {
    std::vector<int32_t> prompt = run["prompt"].get<std::vector<int32_t>>();
    std::vector<int32_t> cont = run["continuation"].get<std::vector<int32_t>>();
    std::vector<int32_t> all = prompt;
    all.insert(all.end(), cont.begin(), cont.end());
    SequenceState st = g.forward->NewSequence();
    const auto reference = ReferenceSelections(run);
    std::vector<std::pair<size_t, size_t>> calls = {{0, prompt.size()}};
    for (size_t i = 0; i < cont.size(); ++i) calls.push_back({prompt.size() + i, 1});
    for (auto [start, count] : calls) {
      ForwardTrace trace;
      trace.record_streams = true;
      ForwardOptions options = Reference();
      options.all_logits = true;
      options.trace = &trace;
      options.forced_streams = &g.streams[row * g.layers * g.stream];
      std::vector<float> logits;
      BOOST_REQUIRE(
          g.forward->Forward(&st, std::span<const int32_t>(&all[start], count), &logits, options)
              .ok());
      for (size_t t = 0; t < count; ++t) {
        // From the reference's final stream, the head must pick the reference's next token.
        const size_t r = row + t;
        BOOST_TEST(ArgMax(&logits[t * g.vocab], g.vocab) == ArgMax(&g.logits[r * g.vocab], g.vocab),
                   "row " << r);
        for (size_t l = 0; l < g.layers; ++l) {
          bool close = true;
          for (size_t i = 0; i < g.stream && close; ++i) {
            const float want = g.streams[(r * g.layers + l) * g.stream + i];
            const float got = trace.streams[l][t * g.stream + i];
            const double ulp = std::max(std::fabs(want), 1e-2f) / 128.0;
            close = std::fabs(got - want) <= 2 * ulp;
          }
          ++pairs;
          pairs_close += close;
          ++layer_pairs[l];
          layer_close[l] += close;
        }
      }
      for (const ForwardTrace::Selection& s : trace.selections) {
        ++selections;
        auto it = reference.find({s.layer, s.position});
        selections_same +=
            s.entries == (it == reference.end() ? std::vector<int64_t>() : it->second);
      }
      row += count;
    }
  }
  const double close_fraction = double(pairs_close) / pairs;
  const double same_fraction = double(selections_same) / selections;
  std::string per_layer;
  double worst_layer = 1;
  for (size_t l = 0; l < g.layers; ++l) {
    const double f = double(layer_close[l]) / layer_pairs[l];
    worst_layer = std::min(worst_layer, f);
    if (l > 0) per_layer += ' ';
    per_layer += std::to_string(static_cast<int>(100 * f + 0.5));
  }
  BOOST_TEST_MESSAGE("layer outputs within 2 BF16 ulps: "
                     << pairs_close << "/" << pairs << " (by layer, %: " << per_layer
                     << "); identical selections: " << selections_same << "/" << selections);
  // Measured 0.81 overall, every layer at least 0.74, and 0.94 of the selections (with the
  // attention probabilities kept in fp32 instead of the kernel's BF16: 0.67 against the data
  // made that way, 0.01 against this). An error in any op of a layer puts nearly every output
  // of that layer, and nearly every selection, outside these bounds.
  BOOST_TEST(close_fraction >= 0.75);
  BOOST_TEST(worst_layer >= 0.6);
  BOOST_TEST(same_fraction >= 0.9);
  BOOST_TEST(selections == 772u);
}

BOOST_AUTO_TEST_SUITE_END()

}  // namespace
}  // namespace flashd::engine
