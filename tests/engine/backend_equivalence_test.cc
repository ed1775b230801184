// A GPU backend (FLASHD_TEST_BACKEND: cuda, hip, or hipcpu, which runs the same kernels on the
// CPU) against the CPU backend on the golden model: sublayer by sublayer on identical inputs,
// logits of whole prompts, greedy continuations, and the two in one forward pass (a layer split,
// and the routed experts on the CPU).
//
// What agreement to expect: the GPU kernels equal the CPU ops bit for bit (kernels/gpu/ops.h:
// the same orders of summation, and exp, sin and cos from kernels/fmath.h), so every sublayer,
// every logit and every continued token is the CPU's. Layers are also compared on the CPU's own
// input streams (ForwardOptions::forced_streams), so that a difference names its layer.
#include <boost/test/unit_test.hpp>
#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "engine/forward.h"
#include "engine/kv_pool.h"
#include "kernels/codecs.h"
#include "kernels/cpu/formats.h"
#include "kernels/cpu/ops.h"
#include "tests/support/moe_choices.h"
#include "tests/support/test_backend.h"

namespace flashd::engine {
namespace {

using nlohmann::json;
const std::string kDir = testing::GoldenDir();

struct Pair {
  std::unique_ptr<Model> model;
  std::unique_ptr<CpuForward> cpu, gpu;
  json meta;
};

const Pair& Load() {
  static Pair* p = [] {
    const std::string name = testing::TestBackendName();
    if (name == "cpu") {
      std::printf("SKIP: FLASHD_TEST_BACKEND names no GPU backend (cuda, hip or hipcpu)\n");
      std::exit(77);
    }
    auto* out = new Pair();
    std::unique_ptr<Backend> backend = testing::TestBackend(name);
    auto model = Model::Load(kDir);
    BOOST_REQUIRE_MESSAGE(model.ok(), model.status().ToString());
    out->model = std::move(*model);
    auto cpu = CpuForward::Create(*out->model);
    BOOST_REQUIRE_MESSAGE(cpu.ok(), cpu.status().ToString());
    out->cpu = std::move(*cpu);
    auto gpu = CpuForward::Create(*out->model, "", 64, std::move(backend));
    BOOST_REQUIRE_MESSAGE(gpu.ok(), gpu.status().ToString());
    out->gpu = std::move(*gpu);
    std::ifstream in(kDir + "/golden.json");
    std::stringstream ss;
    ss << in.rdbuf();
    out->meta = json::parse(ss.str());
    return out;
  }();
  return *p;
}

std::vector<int32_t> Prompt(size_t run) {
  return Load().meta["runs"][run]["prompt"].get<std::vector<int32_t>>();
}

// BF16 steps between two BF16 values (their codes' distance on the ordered line).
int64_t Steps(float a, float b) {
  auto ordered = [](float v) {
    const int32_t code = kernels::cpu::FloatToBf16(v);
    return (code & 0x8000) ? -(code & 0x7fff) : code;
  };
  return std::llabs(int64_t{ordered(a)} - ordered(b));
}

struct Agreement {
  size_t values = 0, equal = 0, one_step = 0;
  int64_t worst = 0;
  void Add(const std::vector<float>& want, const std::vector<float>& got) {
    BOOST_REQUIRE(want.size() == got.size());
    for (size_t i = 0; i < want.size(); ++i) {
      const int64_t s = Steps(want[i], got[i]);
      ++values;
      equal += s == 0;
      one_step += s <= 1;
      worst = std::max(worst, s);
    }
  }
};

BOOST_AUTO_TEST_SUITE(backend_equivalence)

BOOST_AUTO_TEST_CASE(the_backend_is_the_one_named) {
  const Pair& p = Load();
  BOOST_TEST(p.gpu->backend().name() == testing::TestBackendName());
  BOOST_TEST(p.gpu->numerics() != p.cpu->numerics());
  const BackendReport r = p.gpu->backend().Report();
  BOOST_TEST(!r.device.empty());
  BOOST_TEST_MESSAGE("device " << r.device << ", " << r.memory_in_use << " bytes in use of "
                               << r.memory_total);
}

// BF16 matrices go to the device as BF16 (never widened), other fp32 ones as fp32, and both
// multiply as the CPU does.
BOOST_AUTO_TEST_CASE(bf16_matrices_are_held_as_bf16) {
  Load();
  std::unique_ptr<Backend> gpu = testing::TestBackend();
  CpuBackend cpu;
  const int64_t rows = 3, in = 128, out = 64;
  std::vector<float> x(rows * in), y(rows * out), want(rows * out);
  for (size_t i = 0; i < x.size(); ++i) x[i] = kernels::cpu::Bf16ToFloat(0x3f80 + i % 64);
  auto run = [&](const Backend& b, const std::vector<float>& w, std::vector<float>* into) {
    return b.Linear({.x = x.data(),
                     .rows = rows,
                     .in = in,
                     .out = out,
                     .format = kernels::WeightFormat::kDense,
                     .dense = w.data(),
                     .y = into->data()});
  };
  std::vector<float> warm(in * out, 1.0f), bf16(in * out), wide(in * out);
  for (size_t i = 0; i < bf16.size(); ++i) {
    bf16[i] = kernels::cpu::Bf16ToFloat(static_cast<uint16_t>(0x3c00 + i % 997));
    wide[i] = 1.0f / static_cast<float>(3 + i % 97);  // Not BF16 numbers.
  }
  BOOST_REQUIRE(run(*gpu, warm, &y) == kernels::OpStatus::kOk);  // Workspace made.
  const uint64_t before = gpu->Report().memory_in_use;
  BOOST_REQUIRE(run(*gpu, bf16, &y) == kernels::OpStatus::kOk);
  const uint64_t after_bf16 = gpu->Report().memory_in_use;
  BOOST_TEST(after_bf16 - before == uint64_t(in * out * 2));
  BOOST_REQUIRE(run(cpu, bf16, &want) == kernels::OpStatus::kOk);
  BOOST_TEST(std::memcmp(y.data(), want.data(), y.size() * 4) == 0);
  BOOST_REQUIRE(run(*gpu, wide, &y) == kernels::OpStatus::kOk);
  BOOST_TEST(gpu->Report().memory_in_use - after_bf16 == uint64_t(in * out * 4));
  BOOST_REQUIRE(run(cpu, wide, &want) == kernels::OpStatus::kOk);
  BOOST_TEST(std::memcmp(y.data(), want.data(), y.size() * 4) == 0);
}

// Dense projections of one x in one op (LinearParams::also) give the CPU's values: one kernel at
// one row where the device holds every weight alike (all BF16 numbers), and an op a projection,
// the same values, where one is held as fp32.
BOOST_AUTO_TEST_CASE(dense_projections_of_one_x_are_one_op_when_held_alike) {
  Load();
  std::unique_ptr<Backend> gpu = testing::TestBackend();
  CpuBackend cpu;
  const int64_t in = 96;
  const std::vector<int64_t> outs = {40, 7, 33};
  std::vector<std::vector<float>> bf16, wide;
  for (size_t j = 0; j < outs.size(); ++j) {
    bf16.emplace_back(outs[j] * in), wide.emplace_back(outs[j] * in);
    for (size_t i = 0; i < bf16[j].size(); ++i) {
      bf16[j][i] = kernels::cpu::Bf16ToFloat(static_cast<uint16_t>(0x3c00 + (i * (j + 3)) % 997));
      wide[j][i] = 1.0f / static_cast<float>(3 + (i + j) % 97);  // Not BF16 numbers.
    }
  }
  for (const int64_t rows : {int64_t{1}, int64_t{3}}) {
    std::vector<float> x(rows * in);
    for (size_t i = 0; i < x.size(); ++i) x[i] = kernels::cpu::Bf16ToFloat(0x3f80 + i % 64);
    for (const bool mixed : {false, true}) {
      BOOST_TEST_CONTEXT("rows " << rows << " mixed " << mixed) {
        // The last projection's weights are not BF16 numbers when mixed.
        const auto weights = [&](size_t j) {
          return mixed && j + 1 == outs.size() ? wide[j].data() : bf16[j].data();
        };
        auto run = [&](const Backend& b, std::vector<std::vector<float>>* ys) {
          ys->clear();
          for (const int64_t out : outs) ys->emplace_back(rows * out);
          std::vector<kernels::LinearProjection> also;
          for (size_t j = 1; j < outs.size(); ++j) {
            also.push_back({.dense = weights(j), .out = outs[j], .y = (*ys)[j].data()});
          }
          return b.Linear({.x = x.data(),
                           .rows = rows,
                           .in = in,
                           .out = outs[0],
                           .format = kernels::WeightFormat::kDense,
                           .dense = weights(0),
                           .y = (*ys)[0].data(),
                           .also = also.data(),
                           .also_count = static_cast<int64_t>(also.size())});
        };
        std::vector<std::vector<float>> got, want;
        BOOST_REQUIRE(run(*gpu, &got) == kernels::OpStatus::kOk);  // The weights uploaded.
        const BackendReport before = gpu->Report();
        BOOST_REQUIRE(run(*gpu, &got) == kernels::OpStatus::kOk);
        const BackendReport after = gpu->Report();
        BOOST_REQUIRE(run(cpu, &want) == kernels::OpStatus::kOk);
        for (size_t j = 0; j < outs.size(); ++j) {
          BOOST_TEST(std::memcmp(got[j].data(), want[j].data(), want[j].size() * 4) == 0,
                     "projection " << j);
        }
        const uint64_t ops = mixed ? outs.size() : 1;
        BOOST_TEST(after.device_ops - before.device_ops == (mixed ? ops + 1 : ops));
        // At one row: a GEMV an op, and the one op's three outputs (host buffers here) come
        // back gathered by one more kernel.
        if (rows == 1) {
          BOOST_TEST(after.kernel_launches - before.kernel_launches == (mixed ? ops : 2u));
        }
      }
    }
  }
  // BF16 codes given as such (kBf16): the projections' codes go to the device too.
  for (const int64_t rows : {int64_t{1}, int64_t{3}}) {
    std::vector<float> x(rows * in);
    for (size_t i = 0; i < x.size(); ++i) x[i] = kernels::cpu::Bf16ToFloat(0x3f80 + i % 64);
    std::vector<std::vector<uint8_t>> codes;
    for (const std::vector<float>& w : bf16) {
      codes.emplace_back();
      for (const float v : w) {
        const uint16_t code = kernels::cpu::FloatToBf16(v);
        codes.back().push_back(static_cast<uint8_t>(code));
        codes.back().push_back(static_cast<uint8_t>(code >> 8));
      }
    }
    auto run = [&](const Backend& b, std::vector<std::vector<float>>* ys) {
      ys->clear();
      for (const int64_t out : outs) ys->emplace_back(rows * out);
      std::vector<kernels::LinearProjection> also;
      for (size_t j = 1; j < outs.size(); ++j) {
        also.push_back({.w = codes[j].data(), .out = outs[j], .y = (*ys)[j].data()});
      }
      return b.Linear({.x = x.data(),
                       .rows = rows,
                       .in = in,
                       .out = outs[0],
                       .format = kernels::WeightFormat::kBf16,
                       .w = codes[0].data(),
                       .y = (*ys)[0].data(),
                       .also = also.data(),
                       .also_count = static_cast<int64_t>(also.size())});
    };
    std::vector<std::vector<float>> got, want;
    BOOST_REQUIRE(run(*gpu, &got) == kernels::OpStatus::kOk);
    BOOST_REQUIRE(run(cpu, &want) == kernels::OpStatus::kOk);
    for (size_t j = 0; j < outs.size(); ++j) {
      BOOST_TEST(std::memcmp(got[j].data(), want[j].data(), want[j].size() * 4) == 0,
                 "BF16 codes, rows " << rows << ", projection " << j);
    }
  }
}

// Each layer on the CPU's input stream: its attention and FFN outputs and the stream it
// produces, for every token of every golden prompt.
BOOST_AUTO_TEST_CASE(every_sublayer_on_identical_inputs) {
  const Pair& p = Load();
  const ModelConfig& c = p.cpu->config();
  const size_t layers = static_cast<size_t>(c.num_hidden_layers);
  const size_t width = static_cast<size_t>(c.hc_mult * c.hidden_size);
  Agreement sub, streams;
  for (size_t run = 0; run < p.meta["runs"].size(); ++run) {
    const std::vector<int32_t> prompt = Prompt(run);
    const size_t tokens = prompt.size();
    ForwardTrace want_trace;
    want_trace.record_streams = true;
    ForwardOptions options;
    options.trace = &want_trace;
    SequenceState cs = p.cpu->NewSequence();
    std::vector<float> want_logits, got_logits;
    BOOST_REQUIRE(p.cpu->Forward(&cs, prompt, &want_logits, options).ok());
    BOOST_REQUIRE(want_trace.streams.size() == layers);
    std::vector<float> forced(tokens * layers * width);
    for (size_t l = 0; l < layers; ++l) {
      for (size_t t = 0; t < tokens; ++t) {
        std::memcpy(&forced[(t * layers + l) * width], &want_trace.streams[l][t * width],
                    width * sizeof(float));
      }
    }
    ForwardTrace got_trace;
    got_trace.record_streams = true;
    options.trace = &got_trace;
    options.forced_streams = forced.data();
    SequenceState gs = p.gpu->NewSequence();
    const Status s = p.gpu->Forward(&gs, prompt, &got_logits, options);
    BOOST_REQUIRE_MESSAGE(s.ok(), s.ToString());
    BOOST_REQUIRE(got_trace.sublayers.size() == want_trace.sublayers.size());
    for (size_t i = 0; i < want_trace.sublayers.size(); ++i) {
      sub.Add(want_trace.sublayers[i], got_trace.sublayers[i]);
    }
    for (size_t l = 0; l < layers; ++l) streams.Add(want_trace.streams[l], got_trace.streams[l]);
  }
  BOOST_TEST_MESSAGE("sublayers: " << sub.equal << " of " << sub.values << " values equal, "
                                   << sub.one_step << " within one BF16 step, worst " << sub.worst);
  BOOST_TEST_MESSAGE("streams: " << streams.equal << " of " << streams.values << " equal, "
                                 << streams.one_step << " within one step, worst "
                                 << streams.worst);
  // Every op gives the CPU's bits (kernels/gpu/ops.h), so every value is equal.
  BOOST_TEST(sub.equal == sub.values);
  BOOST_TEST(streams.equal == streams.values);
}

// Whole prompts, then 16 greedy steps one token per call: the same tokens on both backends.
BOOST_AUTO_TEST_CASE(greedy_continuations_are_identical) {
  const Pair& p = Load();
  const size_t vocab = static_cast<size_t>(p.cpu->config().vocab_size);
  for (size_t run = 0; run < p.meta["runs"].size(); ++run) {
    std::vector<std::vector<int32_t>> out(2);
    double worst = 0;
    std::vector<float> first_logits;
    for (int b = 0; b < 2; ++b) {
      const CpuForward& f = b == 0 ? *p.cpu : *p.gpu;
      SequenceState st = f.NewSequence();
      std::vector<float> logits;
      BOOST_REQUIRE(f.Forward(&st, Prompt(run), &logits).ok());
      if (b == 0) first_logits = logits;
      for (size_t v = 0; b == 1 && v < vocab; ++v) {
        worst = std::max(worst, double(std::fabs(logits[v] - first_logits[v])));
      }
      for (int step = 0; step < 16; ++step) {
        const int32_t next =
            static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
        out[b].push_back(next);
        BOOST_REQUIRE(f.Forward(&st, std::span<const int32_t>(&next, 1), &logits).ok());
      }
    }
    BOOST_TEST(out[0] == out[1], boost::test_tools::per_element());
    BOOST_TEST_MESSAGE("run " << run << ": prompt logits within " << worst);
    BOOST_TEST(worst == 0.0);
  }
}

// A backend that counts the ops it is given, by name, and passes them to another; with `keep`
// off it keeps no activations on the device (each op's operands are then copied for it).
class Counting final : public Backend {
 public:
  Counting(std::unique_ptr<Backend> inner, std::map<std::string, int>* counts, bool keep = true)
      : inner_(std::move(inner)), counts_(counts), keep_(keep) {}
  std::string_view name() const override { return inner_->name(); }
  std::string_view numerics() const override { return inner_->numerics(); }
  BackendReport Report() const override { return inner_->Report(); }
#define FLASHD_COUNTED(Op, Params)                                \
  kernels::OpStatus Op(const kernels::Params& p) const override { \
    ++(*counts_)[#Op];                                            \
    return inner_->Op(p);                                         \
  }
  FLASHD_COUNTED(Linear, LinearParams)
  FLASHD_COUNTED(RoundBf16, RoundBf16Params)
  FLASHD_COUNTED(RmsNorm, RmsNormParams)
  FLASHD_COUNTED(Rope, RopeParams)
  FLASHD_COUNTED(FakeQuant, FakeQuantParams)
  FLASHD_COUNTED(Embed, EmbedParams)
  FLASHD_COUNTED(HcMix, HcMixParams)
  FLASHD_COUNTED(HcCollapse, HcCollapseParams)
  FLASHD_COUNTED(HcExpand, HcExpandParams)
  FLASHD_COUNTED(CompressPool, CompressPoolParams)
  FLASHD_COUNTED(CompressWrite, CompressWriteParams)
  FLASHD_COUNTED(IndexerScores, IndexerScoreParams)
  FLASHD_COUNTED(TopK, TopKParams)
  FLASHD_COUNTED(CandidateFilter, CandidateFilterParams)
  FLASHD_COUNTED(SparseAttention, SparseAttentionParams)
  FLASHD_COUNTED(MoeRoute, MoeRouteParams)
  FLASHD_COUNTED(Swiglu, SwigluParams)
  FLASHD_COUNTED(MoeCombine, MoeCombineParams)
  FLASHD_COUNTED(MoeGroup, MoeGroupParams)
  FLASHD_COUNTED(ExpertLinear, ExpertLinearParams)
  FLASHD_COUNTED(AddRound, AddRoundParams)
  FLASHD_COUNTED(CopyRows, CopyRowsParams)
  FLASHD_COUNTED(EngramGather, EngramGatherParams)
  FLASHD_COUNTED(EngramGate, EngramGateParams)
#undef FLASHD_COUNTED
  // Weights and kept activations: passed on uncounted.
  bool copies_weights() const override { return inner_->copies_weights(); }
  kernels::OpStatus Upload(const void* host, size_t bytes) const override {
    return inner_->Upload(host, bytes);
  }
  kernels::OpStatus UploadDense(const float* host, size_t count) const override {
    return inner_->UploadDense(host, count);
  }
  void Keep(float* host, size_t count, KeepAs as, uint64_t content) const override {
    if (keep_) inner_->Keep(host, count, as, content);
  }
  void Release(const float* host, uint64_t content) const override {
    inner_->Release(host, content);
  }
  kernels::OpStatus ToHost(const float* host, size_t count) const override {
    return inner_->ToHost(host, count);
  }
  kernels::OpStatus HostWrote(const float* host, size_t count) const override {
    return inner_->HostWrote(host, count);
  }
  kernels::OpStatus Settle() const override { return inner_->Settle(); }

 private:
  std::unique_ptr<Backend> inner_;
  std::map<std::string, int>* counts_;
  bool keep_;
};

// UploadWeights places every weight the ops use before the first step: a prompt and decode
// steps afterwards upload no weight, on the layer's backend nor on the experts' (the CPU, which
// uploads nothing), and the progress reaches its total.
BOOST_AUTO_TEST_CASE(weights_are_on_the_device_before_the_first_step) {
  const Pair& p = Load();
  for (bool cpu_experts : {false, true}) {
    Placement placement;
    placement.backends.push_back(testing::TestBackend());
    if (cpu_experts) {
      placement.backends.push_back(std::make_unique<CpuBackend>());
      placement.routed_experts = 1;
    }
    auto f = CpuForward::Create(*p.model, "", 64, std::move(placement));
    BOOST_REQUIRE_MESSAGE(f.ok(), f.status().ToString());
    const Backend& gpu = (*f)->backend();
    BOOST_TEST(gpu.Report().weight_bytes == 0u);
    uint64_t last = 0, total = 0, calls = 0;
    bool rising = true;
    BOOST_REQUIRE((*f)->UploadWeights([&](uint64_t done, uint64_t all) {
                        rising = rising && done > last;
                        last = done;
                        total = all;
                        ++calls;
                      })
                      .ok());
    BOOST_TEST(rising);
    BOOST_TEST(calls > 10u);
    BOOST_TEST(last == total);
    const uint64_t placed = gpu.Report().weight_bytes;
    BOOST_TEST_MESSAGE((cpu_experts ? "experts on the CPU: " : "")
                       << placed << " weight bytes on the device for " << total
                       << " bytes of weights as the host holds them");
    BOOST_TEST(placed > 0u);
    BOOST_TEST(placed <= total);  // BF16 matrices take half their fp32 bytes.
    SequenceState st = (*f)->NewSequence();
    std::vector<float> logits;
    BOOST_REQUIRE((*f)->Forward(&st, Prompt(2), &logits).ok());
    for (int step = 0; step < 3; ++step) {
      const int32_t next =
          static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
      BOOST_REQUIRE((*f)->Forward(&st, std::span<const int32_t>(&next, 1), &logits).ok());
    }
    BOOST_TEST(gpu.Report().weight_bytes == placed);
  }
}

// Golden prompt `run`, then four greedy decode steps on `f`, whose backend is `b`: every logit
// in order, and b's reports around the decode steps.
struct Decoded {
  std::vector<float> logits;
  BackendReport before, after;
};
Decoded PromptAndFourSteps(const CpuForward& f, const Backend& b, size_t run) {
  SequenceState st = f.NewSequence();
  std::vector<float> logits;
  BOOST_REQUIRE(f.Forward(&st, Prompt(run), &logits).ok());
  Decoded d{logits, b.Report(), {}};
  for (int step = 0; step < 4; ++step) {
    const int32_t next =
        static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
    BOOST_REQUIRE(f.Forward(&st, std::span<const int32_t>(&next, 1), &logits).ok());
    d.logits.insert(d.logits.end(), logits.begin(), logits.end());
  }
  d.after = b.Report();
  return d;
}

// Activations stay on the device between ops: a prompt and decode steps with them kept give the
// logits of copying every op's operands for it, bit for bit, while the decode steps move a
// fraction of the bytes back to the host and wait for the device a fraction of the times.
BOOST_AUTO_TEST_CASE(kept_activations_give_the_same_logits_with_less_traffic) {
  const Pair& p = Load();
  struct Result {
    std::vector<float> logits;
    uint64_t to_device = 0, to_host = 0, waits = 0;
  };
  auto run = [&](bool keep) {
    std::map<std::string, int> counts;
    auto backend = std::make_unique<Counting>(testing::TestBackend(), &counts, keep);
    const Backend* gpu = backend.get();
    auto f = CpuForward::Create(*p.model, "", 64, std::move(backend));
    BOOST_REQUIRE_MESSAGE(f.ok(), f.status().ToString());
    const Decoded d = PromptAndFourSteps(**f, *gpu, 1);
    Result r;
    r.logits = d.logits;
    r.to_device = d.after.bytes_to_device - d.before.bytes_to_device;
    r.to_host = d.after.bytes_to_host - d.before.bytes_to_host;
    r.waits = d.after.waits - d.before.waits;
    BOOST_TEST_MESSAGE((keep ? "kept" : "copied per op")
                       << ": 4 decode steps moved " << r.to_device << " bytes to the device, "
                       << r.to_host << " to the host, and waited " << r.waits << " times");
    return r;
  };
  const Result copied = run(false), kept = run(true);
  BOOST_REQUIRE(kept.logits.size() == copied.logits.size());
  BOOST_TEST(std::memcmp(kept.logits.data(), copied.logits.data(), kept.logits.size() * 4) == 0);
  BOOST_TEST(kept.to_host * 3 < copied.to_host);
  BOOST_TEST(kept.waits * 3 < copied.waits);
  BOOST_TEST(kept.to_device < copied.to_device);
}

// Small copies queued behind the kernels (GpuOptions::queued_uploads) give the bits of copies
// the host waits for: on a device the stream's order is what makes them equal. Each way does
// what it says: queued, a decode step waits for no upload; waited, it queues none.
BOOST_AUTO_TEST_CASE(queued_uploads_give_the_logits_of_waited_ones) {
  const Pair& p = Load();
  auto run = [&](bool queued) {
    std::string reason;
    auto backend =
        SelectBackend(testing::TestBackendName(), &reason, 0,
                      {.matrix_gemms = testing::TestMatrixGemms(), .queued_uploads = queued});
    BOOST_REQUIRE_MESSAGE(backend.ok(), backend.status().ToString());
    const Backend* gpu = backend->get();
    auto f = CpuForward::Create(*p.model, "", 64, std::move(*backend));
    BOOST_REQUIRE_MESSAGE(f.ok(), f.status().ToString());
    const Decoded d = PromptAndFourSteps(**f, *gpu, 2);
    const uint64_t queued_ups = d.after.uploads_queued - d.before.uploads_queued;
    const uint64_t waited_ups = d.after.uploads_waited - d.before.uploads_waited;
    BOOST_TEST((queued ? queued_ups : waited_ups) > 0u);
    BOOST_TEST((queued ? waited_ups : queued_ups) == 0u);
    return d.logits;
  };
  const std::vector<float> queued = run(true), waited = run(false);
  BOOST_REQUIRE(queued.size() == waited.size());
  BOOST_TEST(std::memcmp(queued.data(), waited.data(), queued.size() * 4) == 0);
}

// Greedy tokens of every golden prompt (16 steps) and the prompt's last logits.
std::vector<int32_t> Greedy(const CpuForward& f, size_t run, std::vector<float>* prompt_logits) {
  SequenceState st = f.NewSequence();
  std::vector<float> logits;
  BOOST_REQUIRE(f.Forward(&st, Prompt(run), &logits).ok());
  *prompt_logits = logits;
  std::vector<int32_t> out;
  for (int step = 0; step < 16; ++step) {
    const int32_t next =
        static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
    out.push_back(next);
    BOOST_REQUIRE(f.Forward(&st, std::span<const int32_t>(&next, 1), &logits).ok());
  }
  return out;
}

// Several backends in one forward pass: the first half of the layers on the CPU and the rest on
// the GPU backend, and every layer on the GPU backend with the routed experts on the CPU (the
// hybrid mode of one GPU beside a large host memory). Both give the CPU's tokens.
BOOST_AUTO_TEST_CASE(a_layer_split_and_cpu_experts_give_the_cpu_tokens) {
  const Pair& p = Load();
  const int layers = static_cast<int>(p.cpu->config().num_hidden_layers);
  struct Case {
    const char* name;
    bool gpu_first;
    std::vector<int> layer_backend;
    int routed_experts;
  };
  std::vector<int> split(layers, 0);
  for (int l = layers / 2; l < layers; ++l) split[l] = 1;
  const std::vector<Case> cases = {{"layer split", false, split, -1}, {"cpu experts", true, {}, 1}};
  for (const Case& c : cases) {
    Placement placement;
    std::map<std::string, int> gpu_ops, cpu_ops;
    auto gpu = std::make_unique<Counting>(testing::TestBackend(), &gpu_ops);
    auto cpu = std::make_unique<Counting>(std::make_unique<CpuBackend>(), &cpu_ops);
    if (c.gpu_first) {
      placement.backends.push_back(std::move(gpu));
      placement.backends.push_back(std::move(cpu));
    } else {
      placement.backends.push_back(std::move(cpu));
      placement.backends.push_back(std::move(gpu));
    }
    placement.layer_backend = c.layer_backend;
    placement.routed_experts = c.routed_experts;
    auto mixed = CpuForward::Create(*p.model, "", 64, std::move(placement));
    BOOST_REQUIRE_MESSAGE(mixed.ok(), mixed.status().ToString());
    const std::string numerics((*mixed)->numerics());
    BOOST_TEST_MESSAGE(c.name << ": numerics " << numerics);
    BOOST_TEST(numerics != p.cpu->numerics());
    BOOST_TEST(numerics.find(std::string(p.gpu->numerics())) != std::string::npos, numerics);
    for (size_t run = 0; run < p.meta["runs"].size(); ++run) {
      std::vector<float> want_logits, got_logits;
      const std::vector<int32_t> want = Greedy(*p.cpu, run, &want_logits);
      const std::vector<int32_t> got = Greedy(**mixed, run, &got_logits);
      BOOST_TEST(got == want, boost::test_tools::per_element());
      double worst = 0;
      for (size_t v = 0; v < want_logits.size(); ++v) {
        worst = std::max(worst, double(std::fabs(got_logits[v] - want_logits[v])));
      }
      BOOST_TEST(worst < 0.05, c.name << " run " << run);
    }
    // Each backend ran its part: attention on both sides of a split; with the experts apart,
    // the CPU saw only expert ops.
    BOOST_TEST(gpu_ops["SparseAttention"] > 0);
    if (c.routed_experts < 0) {
      BOOST_TEST(cpu_ops["SparseAttention"] > 0);
      BOOST_TEST(cpu_ops["Embed"] > 0);
      BOOST_TEST(gpu_ops["Embed"] == 0);
    } else {
      // The experts' linears (the gated pair, w1 and w3 under SwiGLU, and w2) and the combine.
      BOOST_TEST(cpu_ops["ExpertLinear"] + cpu_ops["Linear"] > 0);
      BOOST_TEST(cpu_ops["MoeCombine"] > 0);
      for (const auto& [op, n] : cpu_ops) {
        const bool expert_op = op == "Linear" || op == "Swiglu" || op == "RoundBf16" ||
                               op == "MoeCombine" || op == "CopyRows" || op == "MoeGroup" ||
                               op == "ExpertLinear";
        BOOST_TEST(expert_op, op << " ran on the CPU " << n << " times");
      }
      BOOST_TEST(gpu_ops["MoeCombine"] == 0);
    }
  }
  // A placement that names no backend is refused.
  Placement bad;
  bad.backends.push_back(std::make_unique<CpuBackend>());
  bad.layer_backend.assign(layers, 1);
  BOOST_TEST(!CpuForward::Create(*p.model, "", 64, std::move(bad)).ok());
}

// A pool of blocks of 16 entries of head_dim 64 and index_dim 64: KV codes and scales, then the
// index keys' codes and scales, as KvBlockLayout lays out a source that owns its keys.
struct TestPool {
  static constexpr int64_t kPer = 16, kDim = 64;
  static constexpr size_t kKvCodes = 0, kKvScales = kPer * kDim / 2;
  static constexpr size_t kKeyCodes = kKvScales + kPer * kDim / 16;
  static constexpr size_t kKeyScales = kKeyCodes + kPer * kDim / 2;
  static constexpr size_t kBytes = kKeyScales + kPer * kDim / 32;
  KvPool pool{kBytes, 64};
  kernels::PagedRows Rows(size_t offset, size_t row_bytes) {
    return {pool.block_table(), kPer, offset, row_bytes, pool.versions(), kBytes};
  }
  // Random FP4 index keys in every entry of `block`.
  void FillKeys(int32_t block, std::mt19937* rng) {
    std::normal_distribution<float> d(0.0f, 2.0f);
    uint8_t* b = pool.mutable_data(block);
    for (int64_t r = 0; r < kPer; ++r) {
      std::vector<float> key(kDim);
      for (float& v : key) v = d(*rng);
      kernels::cpu::QuantizeFp4E8M0(key.data(), kDim, 32, b + kKeyCodes + r * kDim / 2,
                                    b + kKeyScales + r * kDim / 32);
    }
  }
};

// Index scores of three queries over the entries of `table`'s blocks in `pool`.
std::vector<float> Scores(const Backend& b, TestPool* pool, const std::vector<int32_t>& table) {
  const int64_t tokens = 3, heads = 3, dim = TestPool::kDim;
  const int64_t stride = static_cast<int64_t>(table.size()) * TestPool::kPer - 5;
  std::mt19937 rng(7);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> q(tokens * heads * dim), w(tokens * heads);
  for (float& v : q) v = d(rng);
  for (float& v : w) v = d(rng);
  kernels::cpu::FakeQuant({.x = q.data(),
                           .n = static_cast<int64_t>(q.size()),
                           .block = 32,
                           .format = kernels::FakeQuantFormat::kFp4E8M0});
  const std::vector<int64_t> visible = {stride, stride - 17, 1};
  std::vector<float> scores(tokens * stride);
  BOOST_REQUIRE(b.IndexerScores({.q = q.data(),
                                 .weights = w.data(),
                                 .tokens = tokens,
                                 .heads = heads,
                                 .dim = dim,
                                 .visible = visible.data(),
                                 .block_table = table.data(),
                                 .key_codes = pool->Rows(TestPool::kKeyCodes, dim / 2),
                                 .key_scales = pool->Rows(TestPool::kKeyScales, dim / 32),
                                 .stride = stride,
                                 .scores = scores.data()}) == kernels::OpStatus::kOk);
  return scores;
}

// The KV pool's blocks stay on the device: an op reads each block's device copy, made when
// the block was first read and made again only after the block's version moved on, and sees
// the same values as the CPU reading the host blocks.
BOOST_AUTO_TEST_CASE(kv_blocks_stay_on_the_device_until_their_version_moves) {
  Load();
  std::unique_ptr<Backend> gpu = testing::TestBackend();
  CpuBackend cpu;
  TestPool tp;
  std::mt19937 rng(3);
  for (int i = 0; i < 6; ++i) {
    const int32_t id = tp.pool.Allocate();
    BOOST_REQUIRE(id == i);
    tp.FillKeys(id, &rng);
  }
  const std::vector<int32_t> table = {4, 2, 0, 2, 5, 1};  // Five distinct blocks.
  auto copied = [&] { return gpu->Report().kv_blocks_copied; };
  BOOST_TEST(copied() == 0u);
  const std::vector<float> first = Scores(cpu, &tp, table);
  BOOST_TEST(Scores(*gpu, &tp, table) == first, boost::test_tools::per_element());
  BOOST_TEST(copied() == 5u);
  BOOST_TEST(gpu->Report().kv_device_bytes >= 5 * TestPool::kBytes);
  BOOST_TEST(Scores(*gpu, &tp, table) == first, boost::test_tools::per_element());
  BOOST_TEST(copied() == 5u);  // Nothing changed: nothing copied.

  // New keys through the pool: the block's version moves on, its copy is made again.
  tp.FillKeys(2, &rng);
  const std::vector<float> second = Scores(cpu, &tp, table);
  BOOST_TEST(second != first);
  BOOST_TEST(Scores(*gpu, &tp, table) == second, boost::test_tools::per_element());
  BOOST_TEST(copied() == 6u);

  // Bytes changed behind the pool's back (no version) are not seen: the op read the device
  // copy, not the host block. Once the version moves on they are.
  uint8_t* raw = tp.pool.block_table()[4];
  std::memset(raw + TestPool::kKeyCodes, 0x77, TestPool::kPer * TestPool::kDim / 2);
  const std::vector<float> third = Scores(cpu, &tp, table);
  BOOST_TEST(third != second);
  BOOST_TEST(Scores(*gpu, &tp, table) == second, boost::test_tools::per_element());
  tp.pool.mutable_data(4);
  BOOST_TEST(Scores(*gpu, &tp, table) == third, boost::test_tools::per_element());
  BOOST_TEST(copied() == 7u);

  // A block freed and given out again is a new version: copied again when read.
  tp.pool.Unref(5);
  BOOST_REQUIRE(tp.pool.Allocate() == 5);
  tp.FillKeys(5, &rng);
  BOOST_TEST(Scores(*gpu, &tp, table) == Scores(cpu, &tp, table), boost::test_tools::per_element());
  BOOST_TEST(copied() == 8u);
}

// Rows a kernel writes into device copies reach the host blocks when the backend settles (what
// the prefix cache and snapshots read after a step), with the blocks' versions moved on; the
// copies stay current, so reading the written blocks copies nothing.
BOOST_AUTO_TEST_CASE(rows_written_on_the_device_reach_the_host_blocks) {
  Load();
  std::unique_ptr<Backend> gpu = testing::TestBackend();
  CpuBackend cpu;
  TestPool on_gpu, on_cpu;
  std::mt19937 rng(5);
  for (int i = 0; i < 3; ++i) {
    BOOST_REQUIRE(on_gpu.pool.Allocate() == i);
    BOOST_REQUIRE(on_cpu.pool.Allocate() == i);
    on_gpu.FillKeys(i, &rng);
    std::memcpy(on_cpu.pool.mutable_data(i), on_gpu.pool.data(i), TestPool::kBytes);
  }
  const std::vector<int32_t> table = {0, 1, 2};
  BOOST_REQUIRE(Scores(*gpu, &on_gpu, table) == Scores(cpu, &on_cpu, table));  // 3 copies.
  const int64_t groups = 13, dim = TestPool::kDim;
  std::vector<float> freqs(8);
  kernels::cpu::RopeFrequencies(16, 0, 10000.0, 1, 0, 0, freqs.data());
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> latent(groups * dim), key(groups * dim);
  for (float& v : latent) v = d(rng);
  for (float& v : key) v = d(rng);
  std::vector<int64_t> positions(groups), rows(groups);
  for (int64_t g = 0; g < groups; ++g) {
    positions[g] = 4 * g;
    rows[g] = g % 5 == 2 ? -1 : (g * 7) % 32;  // Blocks 0 and 1 only; one entry skipped.
  }
  auto write = [&](const Backend& b, TestPool* tp) {
    std::vector<float> l = latent, k = key;
    return b.CompressWrite({.latent = l.data(),
                            .key = k.data(),
                            .groups = groups,
                            .head_dim = dim,
                            .index_dim = dim,
                            .rope_dim = 0,
                            .positions = positions.data(),
                            .freqs = freqs.data(),
                            .rows = rows.data(),
                            .kv_codes = tp->Rows(TestPool::kKvCodes, dim / 2),
                            .kv_scales = tp->Rows(TestPool::kKvScales, dim / 16),
                            .key_codes = tp->Rows(TestPool::kKeyCodes, dim / 2),
                            .key_scales = tp->Rows(TestPool::kKeyScales, dim / 32)});
  };
  const uint64_t before = gpu->Report().kv_blocks_copied;
  BOOST_TEST(before == 3u);
  const std::vector<uint64_t> versions(on_gpu.pool.versions(), on_gpu.pool.versions() + 3);
  BOOST_REQUIRE(write(*gpu, &on_gpu) == kernels::OpStatus::kOk);
  BOOST_REQUIRE(write(cpu, &on_cpu) == kernels::OpStatus::kOk);
  // The written rows reach the host blocks when the backend settles.
  BOOST_REQUIRE(gpu->Settle() == kernels::OpStatus::kOk);
  for (int32_t b = 0; b < 3; ++b) {
    BOOST_TEST(std::memcmp(on_gpu.pool.data(b), on_cpu.pool.data(b), TestPool::kBytes) == 0,
               "block " << b);
    // Blocks 0 and 1 were written, block 2 was not.
    BOOST_TEST((on_gpu.pool.version(b) > versions[b]) == (b < 2), "block " << b);
    BOOST_TEST((on_cpu.pool.version(b) > versions[b]) == (b < 2), "block " << b);
  }
  BOOST_TEST(Scores(*gpu, &on_gpu, table) == Scores(cpu, &on_cpu, table),
             boost::test_tools::per_element());
  BOOST_TEST(gpu->Report().kv_blocks_copied == before);
}

// Decoding writes one entry at a time into blocks the device holds already: after the prompt,
// steps that stay in the sequence's last block copy no block again.
BOOST_AUTO_TEST_CASE(decoding_copies_no_kv_block_again) {
  const Pair& p = Load();
  const std::vector<int32_t> prompt = Prompt(0);
  SequenceState st = p.gpu->NewSequence();
  std::vector<float> logits;
  BOOST_REQUIRE(p.gpu->Forward(&st, prompt, &logits).ok());
  const uint64_t after_prompt = p.gpu->backend().Report().kv_blocks_copied;
  BOOST_TEST(after_prompt > 0u);
  const int64_t block = p.gpu->block_tokens();
  int steps = 0;
  while (st.position % block != block - 1 && steps < 8) {
    const int32_t next =
        static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
    BOOST_REQUIRE(p.gpu->Forward(&st, std::span<const int32_t>(&next, 1), &logits).ok());
    ++steps;
  }
  BOOST_TEST(steps > 0);
  BOOST_TEST(p.gpu->backend().Report().kv_blocks_copied == after_prompt);
}

// The window rings stay on the device too: after the first step that reads a ring whole, a
// decode step copies the one slot the step before wrote, in each layer's ring.
BOOST_AUTO_TEST_CASE(decoding_copies_one_ring_slot_per_layer) {
  const Pair& p = Load();
  SequenceState st = p.gpu->NewSequence();
  std::vector<float> logits;
  BOOST_REQUIRE(p.gpu->Forward(&st, Prompt(0), &logits).ok());
  auto decode = [&] {
    const int32_t next =
        static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
    BOOST_REQUIRE(p.gpu->Forward(&st, std::span<const int32_t>(&next, 1), &logits).ok());
  };
  const BackendReport before = p.gpu->backend().Report();
  decode();  // Reads every ring whole (the prompt's step gave the slots their versions).
  const BackendReport first = p.gpu->backend().Report();
  const uint64_t layers = static_cast<uint64_t>(p.gpu->config().num_hidden_layers);
  const uint64_t window = static_cast<uint64_t>(p.gpu->config().sliding_window);
  BOOST_TEST(first.ring_slots_copied - before.ring_slots_copied == layers * window);
  BOOST_TEST(first.ring_device_bytes >=
             layers * window * static_cast<uint64_t>(p.gpu->config().head_dim));
  for (int step = 1; step <= 3; ++step) {
    decode();
    BOOST_TEST(p.gpu->backend().Report().ring_slots_copied - first.ring_slots_copied ==
               layers * static_cast<uint64_t>(step));
  }
}

// The experts' output starts as zeros: its device copy is cleared on the device, not copied
// from the host (a layer's rows times the hidden size, every layer, every step), and the first
// expert's combine reads those zeros (every greedy and equivalence test depends on them).
BOOST_AUTO_TEST_CASE(the_experts_output_is_cleared_on_the_device) {
  const Pair& p = Load();
  SequenceState st = p.gpu->NewSequence(), cpu = p.cpu->NewSequence();
  std::vector<float> logits, want;
  BOOST_REQUIRE(p.gpu->Forward(&st, Prompt(0), &logits).ok());
  BOOST_REQUIRE(p.cpu->Forward(&cpu, Prompt(0), &want).ok());
  const uint64_t layers = static_cast<uint64_t>(p.gpu->config().num_hidden_layers);
  const uint64_t dim = static_cast<uint64_t>(p.gpu->config().hidden_size);
  for (int step = 0; step < 2; ++step) {
    const BackendReport before = p.gpu->backend().Report();
    const int32_t next =
        static_cast<int32_t>(std::max_element(want.begin(), want.end()) - want.begin());
    BOOST_REQUIRE(p.gpu->Forward(&st, std::span<const int32_t>(&next, 1), &logits).ok());
    BOOST_TEST(p.gpu->backend().Report().bytes_zeroed - before.bytes_zeroed == layers * dim * 4);
    BOOST_REQUIRE(p.cpu->Forward(&cpu, std::span<const int32_t>(&next, 1), &want).ok());
    BOOST_TEST(std::memcmp(want.data(), logits.data(), want.size() * 4) == 0);
  }
}

// Nothing a layer makes is waited for: the experts' choices are grouped on the device, the
// window rows come back with the step's last Settle, the candidate mask stays on the device for
// the layers that use it and the indexer's picks for the attention that reads them, so a decode
// step waits for the logits and that Settle only, each one copy to the host. Its uploads
// (positions, tables, ring slots) are all queued behind the kernels from pinned staging: none is
// waited for.
BOOST_AUTO_TEST_CASE(a_decode_step_waits_twice) {
  const Pair& p = Load();
  SequenceState st = p.gpu->NewSequence();
  std::vector<float> logits;
  BOOST_REQUIRE(p.gpu->Forward(&st, Prompt(0), &logits).ok());
  int64_t selecting = 0;
  for (const auto& layer : p.gpu->config().layers) selecting += layer.is_index_source ? 1 : 0;
  BOOST_REQUIRE(selecting > 0);
  const uint64_t layers = static_cast<uint64_t>(p.gpu->config().num_hidden_layers);
  for (int step = 0; step < 3; ++step) {
    const BackendReport before = p.gpu->backend().Report();
    const int32_t next =
        static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
    BOOST_REQUIRE(p.gpu->Forward(&st, std::span<const int32_t>(&next, 1), &logits).ok());
    const BackendReport after = p.gpu->backend().Report();
    BOOST_TEST(after.waits - before.waits == 2u);
    BOOST_TEST(after.downloads - before.downloads == 2u);
    BOOST_TEST(after.uploads_queued - before.uploads_queued >= layers);
    BOOST_TEST(after.uploads_waited == before.uploads_waited);
  }
}

// Grouping for more experts than the GPU kernel's one thread block holds runs on the host for
// the backend, with the CPU's result; within the limit the kernel does, with the same result.
BOOST_AUTO_TEST_CASE(moe_group_beyond_the_kernels_experts_runs_on_the_host) {
  Load();
  std::unique_ptr<Backend> gpu = testing::TestBackend();
  std::mt19937 rng(31);
  for (int64_t experts : {int64_t{384}, kernels::kMoeGroupMaxExperts + 476}) {
    const int64_t tokens = 40, k = 6, total = tokens * k, slots = std::min(experts, total);
    const std::vector<int64_t> chosen = testing::DistinctChoices(
        tokens, k, [&] { return static_cast<int64_t>(rng() % static_cast<uint64_t>(experts)); });
    std::vector<float> weights(chosen.size());
    for (float& w : weights) w = static_cast<float>(rng() % 1000) / 1000.0f;
    auto run = [&](const Backend& b) {
      testing::GroupedRows o(slots, total);
      BOOST_REQUIRE(b.MoeGroup(o.Params(chosen.data(), weights.data(), tokens, experts, k)) ==
                    kernels::OpStatus::kOk);
      return o;
    };
    const testing::GroupedRows want = run(CpuBackend()), got = run(*gpu);
    BOOST_TEST(got.expert == want.expert, boost::test_tools::per_element());
    BOOST_TEST(got.offset == want.offset, boost::test_tools::per_element());
    BOOST_TEST(got.tiles == want.tiles, boost::test_tools::per_element());
    BOOST_TEST(got.rows == want.rows, boost::test_tools::per_element());
    BOOST_TEST(got.weights == want.weights, boost::test_tools::per_element());
  }
}

// An op reads a ring's device copy, made current slot by slot from the slots' versions: bytes
// changed without a new version are not seen, and a slot's new version copies that slot alone,
// its codes and scales as one copy.
// The reference is the same kernel given the whole ring for the call (no versions).
BOOST_AUTO_TEST_CASE(ring_slots_are_copied_when_their_version_moves) {
  Load();
  std::unique_ptr<Backend> gpu = testing::TestBackend();
  const int64_t heads = 2, hd = 64, window = 16, position = 40;
  std::mt19937 rng(11);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> rows(window * hd), q(heads * hd), fresh(hd), sink(heads), freqs(8);
  for (float& v : rows) v = d(rng);
  for (float& v : q) v = kernels::codecs::Bf16ToFloat(kernels::codecs::FloatToBf16(0.3f * d(rng)));
  for (float& v : fresh) v = d(rng);
  kernels::cpu::RoundTripFp8(fresh.data(), fresh.size(), 32);
  for (float& v : sink) v = d(rng);
  kernels::cpu::RopeFrequencies(16, 0, 10000.0, 1, 0, 0, freqs.data());
  std::vector<uint8_t> codes(window * hd), scales(window * hd / 32);
  kernels::cpu::QuantizeFp8PerBlock(rows.data(), rows.size(), 32, codes.data(), scales.data());
  std::vector<uint64_t> versions(window);
  for (int64_t i = 0; i < window; ++i) versions[i] = 100 + i;
  const int64_t pos = position, first = position - window + 1;
  auto attend = [&](bool cached) {
    std::vector<float> out(heads * hd);
    BOOST_REQUIRE(gpu->SparseAttention({.q = q.data(),
                                        .tokens = 1,
                                        .heads = heads,
                                        .head_dim = hd,
                                        .rope_dim = 16,
                                        .positions = &pos,
                                        .ring_codes = codes.data(),
                                        .ring_scales = scales.data(),
                                        .ring_versions = cached ? versions.data() : nullptr,
                                        .window = window,
                                        .fresh = fresh.data(),
                                        .fresh_first = position,
                                        .window_first = &first,
                                        .kv_codes = {},
                                        .kv_scales = {},
                                        .sink = sink.data(),
                                        .freqs = freqs.data(),
                                        .out = out.data()}) == kernels::OpStatus::kOk);
    return out;
  };
  const std::vector<float> whole = attend(false);
  BOOST_TEST(gpu->Report().ring_slots_copied == 0u);
  BOOST_TEST(attend(true) == whole, boost::test_tools::per_element());
  BOOST_TEST(gpu->Report().ring_slots_copied == static_cast<uint64_t>(window));
  // A slot's codes and scales, to 16 bytes a slot.
  BOOST_TEST(gpu->Report().ring_device_bytes >= static_cast<uint64_t>(window * (hd + hd / 32)));
  BOOST_TEST(gpu->Report().ring_device_bytes < static_cast<uint64_t>(window * (hd + hd / 32 + 16)));
  const BackendReport up = gpu->Report();
  BOOST_TEST(attend(true) == whole, boost::test_tools::per_element());
  // The op's other operands.
  const uint64_t op_bytes = gpu->Report().bytes_to_device - up.bytes_to_device;
  const uint64_t op_copies = gpu->Report().uploads_queued - up.uploads_queued;
  BOOST_TEST(gpu->Report().ring_slots_copied == static_cast<uint64_t>(window));

  // A slot rewritten on the host without a new version: the device copy is what the op reads.
  const int64_t slot = (position - 3) % window;
  for (int64_t i = 0; i < hd; ++i) rows[slot * hd + i] = 3.0f * d(rng);
  kernels::cpu::QuantizeFp8PerBlock(&rows[slot * hd], hd, 32, &codes[slot * hd],
                                    &scales[slot * hd / 32]);
  const std::vector<float> changed = attend(false);
  BOOST_TEST(changed != whole);
  BOOST_TEST(attend(true) == whole, boost::test_tools::per_element());
  // Its new version: that slot alone is copied, and the op sees it.
  versions[slot] = 1000;
  const BackendReport before = gpu->Report();
  BOOST_TEST(attend(true) == changed, boost::test_tools::per_element());
  BOOST_TEST(gpu->Report().ring_slots_copied == static_cast<uint64_t>(window + 1));
  BOOST_TEST(gpu->Report().bytes_to_device - before.bytes_to_device == op_bytes + hd + hd / 32);
  BOOST_TEST(gpu->Report().uploads_queued - before.uploads_queued == op_copies + 1);
}

// Behind a context of 200 blocks, a sequence's block table goes to the device once: the first
// decode step copies its entries, the next ones none (it changes only when a block is added),
// though every attention and indexer op reads it; the blocks' versions are compared with their
// device copies' once after the host wrote blocks (the first step's first op), then only those
// of blocks added or written since, not by every op; the logits are the CPU's, also after the
// host rewrites the context's blocks between two steps.
BOOST_AUTO_TEST_CASE(a_long_contexts_block_table_goes_to_the_device_once) {
  const Pair& p = Load();
  constexpr int64_t kBlocks = 200;
  std::vector<uint64_t> compared;
  auto run = [&](const CpuForward& f, std::vector<uint64_t>* copied) {
    std::mt19937 rng(17);
    std::uniform_int_distribution<int> byte(0x30, 0x3F);  // Finite codes and small scales.
    KvPool& pool = *f.pool();
    std::vector<int32_t> blocks;
    for (int64_t b = 0; b < kBlocks; ++b) {
      const int32_t id = pool.Allocate();
      BOOST_REQUIRE(id >= 0);
      uint8_t* data = pool.mutable_data(id);
      for (size_t i = 0; i < pool.block_bytes(); ++i) data[i] = static_cast<uint8_t>(byte(rng));
      blocks.push_back(id);
    }
    const int64_t position = kBlocks * f.block_tokens();
    auto st = f.ResumeAt(position, Prompt(0), std::move(blocks));
    BOOST_REQUIRE_MESSAGE(st.ok(), st.status().ToString());
    std::vector<float> logits, all;
    int32_t next = 5;
    for (int step = 0; step < 4; ++step) {
      if (step == 3) {
        for (int64_t b = 0; b < kBlocks; ++b) {
          const int32_t id = st->blocks[static_cast<size_t>(b)];
          uint8_t* data = pool.mutable_data(id);
          for (size_t i = 0; i < pool.block_bytes(); ++i) data[i] = static_cast<uint8_t>(byte(rng));
        }
      }
      BOOST_REQUIRE(f.Forward(&*st, std::span<const int32_t>(&next, 1), &logits).ok());
      copied->push_back(f.backend().Report().table_entries_copied);
      compared.push_back(f.backend().Report().kv_versions_compared);
      all.insert(all.end(), logits.begin(), logits.end());
      next = static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
    }
    return all;
  };
  std::vector<uint64_t> cpu_copied, gpu_copied;
  const std::vector<float> want = run(*p.cpu, &cpu_copied);
  const uint64_t before = p.gpu->backend().Report().table_entries_copied;
  const uint64_t compared_before = p.gpu->backend().Report().kv_versions_compared;
  compared.clear();
  const std::vector<float> got = run(*p.gpu, &gpu_copied);
  BOOST_REQUIRE(got.size() == want.size());
  BOOST_TEST(std::memcmp(got.data(), want.data(), got.size() * 4) == 0);
  // The first step's table: the context's blocks and the one the step added, no more.
  BOOST_TEST(gpu_copied[0] - before >= static_cast<uint64_t>(kBlocks));
  BOOST_TEST(gpu_copied[0] - before <= static_cast<uint64_t>(kBlocks) + 1);
  BOOST_TEST(gpu_copied[2] == gpu_copied[0]);
  BOOST_TEST(gpu_copied[3] == gpu_copied[0]);
  // Versions: the first step's every block at least once, the next steps fewer than a table.
  BOOST_TEST_MESSAGE("versions compared a step: "
                     << compared[0] - compared_before << ", " << compared[1] - compared[0] << ", "
                     << compared[2] - compared[1] << ", " << compared[3] - compared[2]);
  BOOST_TEST(compared[0] - compared_before >= static_cast<uint64_t>(kBlocks));
  BOOST_TEST(compared[1] - compared[0] < static_cast<uint64_t>(kBlocks));
  BOOST_TEST(compared[2] - compared[1] < static_cast<uint64_t>(kBlocks));
  // After the host's writes, the table's blocks once more, and once.
  BOOST_TEST(compared[3] - compared[2] >= static_cast<uint64_t>(kBlocks));
  BOOST_TEST(compared[3] - compared[2] < static_cast<uint64_t>(2 * kBlocks));
}

// A bounded replay that drops rows part-way (after the last KV source layer) gives the CPU's
// logits and state: the indexer's picks, which stay where they are made, come to the host and
// are gathered with the rows they belong to.
BOOST_AUTO_TEST_CASE(a_bounded_replay_that_drops_rows_gives_the_cpu_logits) {
  const Pair& p = Load();
  const std::vector<int32_t> prompt = Prompt(2);  // The longest.
  ForwardOptions options;
  options.replay_tokens = 10;
  BOOST_REQUIRE(prompt.size() > 2 * static_cast<size_t>(std::max<int64_t>(
                                        options.replay_tokens, p.cpu->config().sliding_window)));
  auto run = [&](const CpuForward& f, std::string* state) {
    SequenceState st = f.NewSequence();
    std::vector<float> logits, all;
    BOOST_REQUIRE(f.Forward(&st, prompt, &logits, options).ok());
    all = logits;
    const int32_t next =
        static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
    BOOST_REQUIRE(f.Forward(&st, std::span<const int32_t>(&next, 1), &logits).ok());
    all.insert(all.end(), logits.begin(), logits.end());
    *state = st.Serialize();
    return all;
  };
  std::string want_state, got_state;
  const std::vector<float> want = run(*p.cpu, &want_state);
  const std::vector<float> got = run(*p.gpu, &got_state);
  BOOST_REQUIRE(got.size() == want.size());
  BOOST_TEST(std::memcmp(got.data(), want.data(), got.size() * 4) == 0);
  BOOST_TEST((got_state == want_state));
}

// A sequence's compressor partial groups stay on the device from step to step, named by their
// version: a decode step copies none of them up again. A fork decoded beside its origin (the
// same version: one takes the device copy, the other's is copied), a restored snapshot (no
// version) and a step that keeps one of its two tokens (the groups written on the host) all
// give the CPU's logits, and the next steps find their groups on the device again.
BOOST_AUTO_TEST_CASE(partial_groups_stay_on_the_device_from_step_to_step) {
  const Pair& p = Load();
  const ModelConfig& c = p.cpu->config();
  uint64_t groups = 0;  // Kept buffers a sequence's partial groups are, two a pooling layer.
  for (const LayerPlan& l : c.layers) groups += l.is_kv_source && l.compress_ratio > 1 ? 2 : 0;
  BOOST_REQUIRE(groups > 0);
  auto greedy = [](const std::vector<float>& l) {
    return static_cast<int32_t>(std::max_element(l.begin(), l.end()) - l.begin());
  };
  // Every call's logits, and the backend's kept_reused after each call.
  auto run = [&](const CpuForward& f, std::vector<uint64_t>* reused) {
    std::vector<float> all, la, lb;
    auto note = [&](std::initializer_list<const std::vector<float>*> logits) {
      reused->push_back(f.backend().Report().kept_reused);
      for (const std::vector<float>* l : logits) all.insert(all.end(), l->begin(), l->end());
    };
    SequenceState a = f.NewSequence();
    BOOST_REQUIRE(f.Forward(&a, Prompt(0), &la).ok());
    note({&la});
    for (int step = 0; step < 2; ++step) {
      const int32_t t = greedy(la);
      BOOST_REQUIRE(f.Forward(&a, std::span<const int32_t>(&t, 1), &la).ok());
      note({&la});
    }
    SequenceState b = a.Fork();
    int32_t ta = greedy(la), tb = (ta + 1) % static_cast<int32_t>(c.vocab_size);
    for (int step = 0; step < 2; ++step) {
      std::vector<BatchItem> items = {{&a, std::span<const int32_t>(&ta, 1), &la},
                                      {&b, std::span<const int32_t>(&tb, 1), &lb}};
      BOOST_REQUIRE(f.ForwardBatch(items).ok());
      note({&la, &lb});
      ta = greedy(la);
      tb = greedy(lb);
    }
    auto restored = f.Restore(a.Serialize());
    BOOST_REQUIRE_MESSAGE(restored.ok(), restored.status().ToString());
    SequenceState d = std::move(*restored);
    std::vector<float> ld;
    BOOST_REQUIRE(f.Forward(&d, std::span<const int32_t>(&ta, 1), &ld).ok());
    note({&ld});
    const std::vector<int32_t> two = {tb, ta};
    BatchItem item{&b, two, &lb};
    item.accept = [](std::span<const float>) { return int64_t{1}; };
    BOOST_REQUIRE(f.ForwardBatch(std::span<BatchItem>(&item, 1)).ok());
    note({&lb});
    for (int step = 0; step < 2; ++step) {
      const int32_t t = step == 0 ? ta : greedy(lb);
      BOOST_REQUIRE(f.Forward(&b, std::span<const int32_t>(&t, 1), &lb).ok());
      note({&lb});
    }
    return all;
  };
  std::vector<uint64_t> cpu_reused, gpu_reused;
  const std::vector<float> want = run(*p.cpu, &cpu_reused);
  const std::vector<float> got = run(*p.gpu, &gpu_reused);
  BOOST_REQUIRE(got.size() == want.size());
  BOOST_TEST(std::memcmp(got.data(), want.data(), got.size() * 4) == 0);
  std::vector<uint64_t> per_call;
  for (size_t i = 1; i < gpu_reused.size(); ++i) {
    per_call.push_back(gpu_reused[i] - gpu_reused[i - 1]);
  }
  // Two decode steps; the fork beside its origin, then both; the restored state; the step
  // keeping one token; the step after it (its groups written on the host), then the next.
  const std::vector<uint64_t> expected = {groups, groups, groups, 2 * groups, 0, groups, 0, groups};
  BOOST_TEST(per_call == expected, boost::test_tools::per_element());
}

// A batched decode step attends once a layer, every sequence's queries in one op, scores the
// indexer's entries once an indexing layer, pools the compressor's groups once a pooling layer,
// and gives the CPU's logits for every sequence: with the
// rings kept on the device, and with a ring budget of one ring and a half, where each op finds room
// for one sequence's ring (the others' copied for it alone, in the host's layout, in the same op)
// and no ring an op reads is dropped before it.
BOOST_AUTO_TEST_CASE(a_batched_step_attends_once_a_layer_with_its_rings_in_or_out_of_the_cache) {
  const Pair& p = Load();
  const ModelConfig& c = p.cpu->config();
  const uint64_t ring_bytes =
      static_cast<uint64_t>(c.sliding_window) * ((c.head_dim + c.head_dim / 32 + 15) / 16 * 16);
  const size_t runs = p.meta["runs"].size(), count = 3;
  constexpr int kSteps = 3;
  // Each sequence's prompt alone, then kSteps greedy steps of all of them in one batch: every
  // step's logits.
  BackendReport before, after;  // The GPU backend's, around the batched steps.
  auto decode = [&](const CpuForward& f, const std::map<std::string, int>* counts = nullptr) {
    std::vector<SequenceState> st;
    std::vector<std::vector<float>> logits(count);
    for (size_t i = 0; i < count; ++i) {
      st.push_back(f.NewSequence());
      BOOST_REQUIRE(f.Forward(&st[i], Prompt(i % runs), &logits[i]).ok());
    }
    std::vector<float> all;
    const auto ops = [&](const char* name) {
      return counts != nullptr && counts->contains(name) ? counts->at(name) : 0;
    };
    const int attention_before = ops("SparseAttention"), index_before = ops("IndexerScores");
    const int pool_before = ops("CompressPool");
    for (int step = 0; step < kSteps; ++step) {
      // The first step reads each ring whole (the prompt wrote it); the later ones, a slot.
      if (step == 1) before = f.backend().Report();
      std::vector<int32_t> next(count);
      std::vector<BatchItem> items;
      for (size_t i = 0; i < count; ++i) {
        next[i] = static_cast<int32_t>(std::max_element(logits[i].begin(), logits[i].end()) -
                                       logits[i].begin());
        items.push_back({&st[i], std::span<const int32_t>(&next[i], 1), &logits[i]});
      }
      BOOST_REQUIRE(f.ForwardBatch(items).ok());
      for (const std::vector<float>& l : logits) all.insert(all.end(), l.begin(), l.end());
    }
    after = f.backend().Report();
    if (counts != nullptr) {
      int index_layers = 0, pool_layers = 0;
      for (const LayerPlan& l : c.layers) {
        index_layers += l.is_index_source ? 1 : 0;
        pool_layers += l.is_kv_source && l.compress_ratio > 1 ? 1 : 0;
      }
      BOOST_TEST(ops("SparseAttention") - attention_before == kSteps * c.num_hidden_layers);
      BOOST_TEST(ops("IndexerScores") - index_before == kSteps * index_layers);
      BOOST_TEST(ops("CompressPool") - pool_before == kSteps * pool_layers);
      BOOST_TEST(index_layers > 0);
      BOOST_TEST(pool_layers > 0);
    }
    return all;
  };
  const std::vector<float> want = decode(*p.cpu);
  for (const uint64_t budget : {uint64_t{512} << 20, ring_bytes * 3 / 2}) {
    std::string reason;
    auto selected =
        SelectBackend(testing::TestBackendName(), &reason, 0,
                      {.matrix_gemms = testing::TestMatrixGemms(), .ring_cache_bytes = budget});
    BOOST_REQUIRE_MESSAGE(selected.ok(), selected.status().ToString());
    std::map<std::string, int> counts;
    auto backend = std::make_unique<Counting>(std::move(*selected), &counts);
    const Backend* gpu = backend.get();
    auto f = CpuForward::Create(*p.model, "", 64, std::move(backend));
    BOOST_REQUIRE_MESSAGE(f.ok(), f.status().ToString());
    const std::vector<float> got = decode(**f, &counts);
    BOOST_REQUIRE(got.size() == want.size());
    BOOST_TEST(std::memcmp(got.data(), want.data(), got.size() * 4) == 0, "ring budget " << budget);
    BOOST_TEST(gpu->Report().ring_device_bytes <= budget);
    BOOST_TEST(gpu->Report().ring_device_bytes >= ring_bytes);
    // Each time the host waits for the device it takes what it needs in one copy, however many
    // sequences wrote KV rows and partial groups (gathered on the device).
    BOOST_TEST(after.downloads - before.downloads == after.waits - before.waits);
    BOOST_TEST(after.waits > before.waits);
    // The rings cached: each step after the first copies every sequence's new slot of each
    // layer, and each layer's slots in one copy.
    if (budget > 3 * ring_bytes) {
      const uint64_t layer_steps =
          uint64_t{kSteps - 1} * static_cast<uint64_t>(c.num_hidden_layers);
      BOOST_TEST(after.ring_slots_copied - before.ring_slots_copied == layer_steps * count);
      BOOST_TEST(after.ring_uploads - before.ring_uploads == layer_steps);
    }
  }
}

BOOST_AUTO_TEST_SUITE_END()

}  // namespace
}  // namespace flashd::engine
