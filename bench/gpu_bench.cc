// The GPU kernels at the released model's dimensions, on random weights made in device memory
// (no checkpoint, no file): each op of one decoding layer timed alone, the layer's step time at
// batch 1, 8 and 64 (as the sum of its ops, and launched back to back: each kernel starting in
// turn, early, and as one graph), extrapolated to the 40-layer model, the layer's
// prefill of 4,096 tokens of one sequence, and the prefill GEMMs against the device's dense FP8
// peak, and each GEMM against a free-order schedule (what the fixed order costs). Compiled once
// per GPU runtime (gpu_bench_cuda, gpu_bench_hip, gpu_bench_hipcpu; the last only checks the
// bench runs).
//
//   build/bench/gpu_bench_cuda [--tiny] [--reps N]
//
// Bytes are what an op must read or write at least: its weights as stored, its activations, and
// the KV rows it attends; achieved bandwidth is divided by the device's measured copy bandwidth
// (a device-to-device copy, read plus write). --tiny uses small dimensions (a dry run on a CPU).
//
// What the layer leaves out: the compressor and indexer ops of the layers that have them and
// the Engram gather of two layers; the layer estimate is the attention and MoE path every layer
// runs.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "kernels/gpu/device.h"
#include "kernels/gpu/ops.h"

namespace {

namespace k = flashd::kernels;
namespace g = flashd::kernels::FLASHD_GPU_BACKEND;
using Clock = std::chrono::steady_clock;

struct Dims {
  int64_t hidden = 5120, q_lora = 1280, heads = 64, head_dim = 512, rope = 64, o_lora = 1024,
          o_groups = 8, inter = 2304, experts = 384, topk = 6, hc = 4, window = 128, selected = 512,
          layers = 40, rows_per_block = 16;
};

Dims Tiny() {
  Dims d;
  d.hidden = 256, d.q_lora = 64, d.heads = 4, d.head_dim = 64, d.rope = 16, d.o_lora = 32;
  d.o_groups = 2, d.inter = 128, d.experts = 16, d.topk = 2, d.window = 16, d.selected = 32;
  return d;
}

void Check(const std::string& error, const char* what) {
  if (!error.empty()) {
    std::fprintf(stderr, "gpu_bench: %s: %s\n", what, error.c_str());
    std::exit(1);
  }
}

void CheckOp(k::OpStatus s, const char* what) {
  if (s != k::OpStatus::kOk) {
    std::fprintf(stderr, "gpu_bench: %s refused (status %d)\n", what, static_cast<int>(s));
    std::exit(1);
  }
}

uint64_t seed = 1;

template <class T>
T* Alloc(size_t count) {
  void* p = nullptr;
  Check(g::DeviceAlloc(&p, std::max<size_t>(count * sizeof(T), 1)), "alloc");
  return static_cast<T*>(p);
}

// FP8/FP4 codes and UE8M0/E4M3 scales in 0x30-0x3F (or up to `last`): finite values.
uint8_t* Codes(size_t bytes, uint8_t last = 0x3F) {
  uint8_t* p = Alloc<uint8_t>(bytes);
  Check(g::FillBytes(p, bytes, seed++, 0x30, last), "fill");
  return p;
}
float* Floats(size_t n, float scale = 1.0f) {
  float* p = Alloc<float>(n);
  Check(g::FillFloats(p, n, seed++, scale), "fill");
  return p;
}

struct Weight {
  k::WeightFormat format;
  const uint8_t* w = nullptr;
  const uint8_t* scales = nullptr;
  const float* dense = nullptr;
  int64_t in = 0, out = 0;
  int64_t groups = 1;  // kFp8Dense: projections side by side (LinearParams::groups), each [out, in]
  uint64_t bytes() const {
    if (format == k::WeightFormat::kDense) return uint64_t(out * in) * 4;
    const k::StoredBytes stored = k::QuantizedWeightBytes(format, groups * out, in);
    return uint64_t(stored.codes + stored.scales);
  }
};

// `last_scale`: the largest scale code (0x30 the least).
Weight Quantized(k::WeightFormat format, int64_t out, int64_t in, uint8_t last_scale = 0x3F) {
  const k::StoredBytes stored = k::QuantizedWeightBytes(format, out, in);
  return {format, Codes(stored.codes), Codes(stored.scales, last_scale), nullptr, in, out};
}
Weight Fp8(int64_t out, int64_t in) { return Quantized(k::WeightFormat::kFp8, out, in); }
// wo_a: `groups` FP8 matrices [out, in] run as their values, in one op.
Weight Fp8ValueGroups(int64_t groups, int64_t out, int64_t in) {
  Weight w = Quantized(k::WeightFormat::kFp8Dense, groups * out, in);
  w.out = out;
  w.groups = groups;
  return w;
}
// FP4 rows' scale codes at most 7 apart, so that the warpgroup tiles fold them into the codes
// (they do where a block's 64 rows lie within 11); Fp4Spread's 15 apart, so that they do not.
Weight Fp4(int64_t out, int64_t in) { return Quantized(k::WeightFormat::kFp4, out, in, 0x37); }
Weight Fp4Spread(int64_t out, int64_t in) { return Quantized(k::WeightFormat::kFp4, out, in); }
Weight Dense(int64_t out, int64_t in) {
  return {k::WeightFormat::kDense, nullptr, nullptr, Floats(out * in, 0.05f), in, out};
}

// Workspace for the fixed order's split over K (LinearParams::block_sums), for up to
// g::kLinearSplitRows rows of the widest weight.
float* block_sums = nullptr;
int64_t block_sums_count = 0;

// The shipped GEMM (Linear: the fixed order, at one row the GEMV), the fixed order's GEMM tile
// at any row count (LinearSplit at split 1), the free-order one split `split` ways over K, or the
// matrix-core one (LinearMatrix) through mma.sync, the warpgroup instruction or AMD's.
enum class Order { kShipped, kTile, kFree, kMatrix, kWgmma, kMfma };

g::MatrixInstruction InstructionOf(Order order) {
  return order == Order::kWgmma  ? g::MatrixInstruction::kWgmma
         : order == Order::kMfma ? g::MatrixInstruction::kMfma
                                 : g::MatrixInstruction::kMma;
}

// The vendor's own matrix instruction this build has: AMD's on HIP, the warpgroup one elsewhere
// (NVIDIA's, and the HIP CPU runtime's stand-in).
constexpr bool kAmdBuild = g::kBackendName == "hip";
// With `pair` (the up projection, the gated pair's workspace): w and it under SwiGLU as one op.
struct GatedPair {
  const Weight* up = nullptr;
  float *gate = nullptr, *up_out = nullptr;
};
// What the engine asks of a linear besides its product: x's codes made by the op before it
// (x_quantized), y's codes for the op after it (y_codes, with the backend's counters), and y's
// rotation (rope; its rope_dim, head_dim, positions and freqs).
struct LinearExtras {
  uint8_t *x_codes = nullptr, *x_scales = nullptr;
  uint8_t *y_codes = nullptr, *y_scales = nullptr;
  unsigned* arrivals = nullptr;
  const k::RopeParams* rope = nullptr;
};
void LinearOn(const Weight& w, const float* x, int64_t rows, uint8_t* xq, uint8_t* xs, float* y,
              void* stream, Order order = Order::kShipped, int split = 1,
              const GatedPair& pair = {}, bool round_output = false,
              const LinearExtras& extras = {}) {
  k::LinearParams p = {.x = x,
                       .rows = rows,
                       .in = w.in,
                       .out = w.out,
                       .format = w.format,
                       .w = w.w,
                       .w_scales = w.scales,
                       .dense = w.dense,
                       .x_codes = xq,
                       .x_scales = xs,
                       .y = y,
                       .stream = stream,
                       .groups = w.groups,
                       .block_sums = block_sums,
                       .block_sums_count = block_sums_count,
                       .up = pair.up != nullptr ? pair.up->w : nullptr,
                       .up_scales = pair.up != nullptr ? pair.up->scales : nullptr,
                       .limit = 10.0f,
                       .gate = pair.gate,
                       .up_out = pair.up_out,
                       .round_output = round_output};
  if (extras.x_codes != nullptr) {
    p.x_codes = extras.x_codes, p.x_scales = extras.x_scales, p.x_quantized = true;
  }
  p.y_codes = extras.y_codes, p.y_code_scales = extras.y_scales;
  if (extras.rope != nullptr) {
    p.rope_dim = extras.rope->rope_dim, p.rope_head_dim = extras.rope->head_dim;
    p.rope_positions = extras.rope->positions, p.rope_freqs = extras.rope->freqs;
  }
  // kMatrix: weights LinearMatrix does not take run as the backend runs them then (Linear).
  const bool matrix =
      (order == Order::kMatrix || order == Order::kWgmma || order == Order::kMfma) &&
      g::LinearMatrixTakes(p);
  CheckOp(matrix                  ? g::LinearMatrix(p, InstructionOf(order))
          : order == Order::kTile ? g::LinearSplit(p, 1)
          : order == Order::kFree ? g::LinearFreeOrder(p, split)
                                  : g::Linear(p, extras.arrivals),
          "Linear");
}

// Seconds per call of `op`, best of three rounds of `reps` calls each.
double Time(const std::function<void()>& op, int reps) {
  op();
  Check(g::Synchronize(), "sync");
  double best = 1e30;
  for (int round = 0; round < 3; ++round) {
    const auto t = Clock::now();
    for (int r = 0; r < reps; ++r) op();
    Check(g::Synchronize(), "sync");
    best = std::min(best, std::chrono::duration<double>(Clock::now() - t).count() / reps);
  }
  return best;
}

struct Row {
  std::string op;
  double seconds;
  uint64_t bytes;
};

class Layer {
 public:
  Layer(const Dims& d, int64_t max_rows) : d_(d) {
    Check(g::StreamCreate(&stream_), "stream");
    const int64_t mix = (2 + d.hc) * d.hc;
    hc_fn_ = Floats(mix * d.hc * d.hidden, 0.01f);
    hc_scale_ = Floats(3, 1.0f);
    hc_base_ = Floats(mix, 0.1f);
    norm_ = Floats(std::max(d.hidden, d.q_lora), 1.0f);
    wq_a_ = Fp8(d.q_lora, d.hidden);
    wq_b_ = Fp8(d.heads * d.head_dim, d.q_lora);
    wkv_ = Fp8(d.head_dim, d.hidden);
    wo_a_ = Fp8ValueGroups(d.o_groups, d.o_lora, d.heads * d.head_dim / d.o_groups);
    wo_b_ = Fp8(d.hidden, d.o_groups * d.o_lora);
    router_ = Dense(d.experts, d.hidden);
    router_bias_ = Floats(d.experts, 0.01f);
    for (int64_t e = 0; e < d.experts; ++e) {
      experts_.push_back({Fp4(d.inter, d.hidden), Fp4(d.inter, d.hidden), Fp4(d.hidden, d.inter)});
    }
    shared_ = {Fp8(d.inter, d.hidden), Fp8(d.inter, d.hidden), Fp8(d.hidden, d.inter)};
    if (block_sums == nullptr) {
      int64_t widest = 0;  // Outputs times K-blocks.
      for (const Weight* w : {&wq_a_, &wq_b_, &wkv_, &wo_b_, &shared_[0], &shared_[2],
                              &experts_[0][0], &experts_[0][2]}) {
        widest = std::max(widest, w->out * (w->in / 32));
      }
      block_sums_count = g::kLinearSplitRows * widest;
      block_sums = Alloc<float>(block_sums_count);
    }
    freqs_ = Floats(d.rope / 2, 0.5f);
    sink_ = Floats(d.heads, 1.0f);
    // Activations for up to max_rows tokens.
    const int64_t n = max_rows;
    X_ = Floats(n * d.hc * d.hidden, 1.0f);
    out_X_ = Floats(n * d.hc * d.hidden, 1.0f);
    mixes_ = Floats(n * mix), pre_ = Floats(n * d.hc), post_ = Floats(n * d.hc);
    comb_ = Floats(n * d.hc * d.hc);
    x_ = Floats(n * d.hidden, 1.0f);
    sub_ = Floats(n * d.hidden);
    fused_.arrivals = Alloc<unsigned>(n);
    Check(g::ZeroOnDevice(fused_.arrivals, n * sizeof(unsigned)), "zero");
    fused_.sums = Alloc<double>(n);
    const int64_t widest =
        std::max({d.hidden, d.heads * d.head_dim, d.o_groups * d.o_lora, d.inter, d.experts});
    xq_ = Alloc<uint8_t>(n * widest), xs_ = Alloc<uint8_t>(n * widest / 32);
    // The rows' codes made by the ops writing the rows, as the engine asks for them: the
    // collapse's (x_), the query latent's norm's, wo_a's and the gated pairs' (the shared
    // expert's and the routed experts' rows); the GEMV's counters for the last.
    x_codes_ = Codes(n * d.hidden), x_scales_ = Codes(n * d.hidden / 32);
    qa_codes_ = Codes(n * d.q_lora), qa_scales_ = Codes(n * d.q_lora / 32);
    og_codes_ = Codes(n * d.o_groups * d.o_lora),
    og_scales_ = Codes(n * d.o_groups * d.o_lora / 32);
    h_codes_ = Codes(n * d.inter), h_scales_ = Codes(n * d.inter / 32);
    hg_codes_ = Codes(n * d.topk * d.inter), hg_scales_ = Codes(n * d.topk * d.inter / 32);
    code_arrivals_ = Alloc<unsigned>(n * d.topk * d.inter / 32);
    Check(g::ZeroOnDevice(code_arrivals_, n * d.topk * d.inter / 32 * sizeof(unsigned)), "zero");
    qa_ = Floats(n * d.q_lora, 1.0f);
    q_ = Floats(n * d.heads * d.head_dim, 1.0f);
    o_ = Floats(n * d.heads * d.head_dim, 1.0f);
    og_ = Floats(n * d.o_groups * d.o_lora, 1.0f);
    kv_ = Floats(n * d.head_dim, 1.0f);
    kv_stage_ = Floats(n * d.head_dim);  // The window rows staged for the host, as a step keeps.
    logits_ = Floats(n * d.experts), scores_ = Floats(n * d.experts),
    biased_ = Floats(n * d.experts);
    chosen_ = Alloc<int64_t>(n * d.topk), weights_ = Floats(n * d.topk);
    gate_ = Floats(n * d.inter, 1.0f), up_ = Floats(n * d.inter, 1.0f),
    h_ = Floats(n * d.inter, 1.0f);
    y_ = Floats(n * d.hidden), expert_out_ = Floats(n * d.topk * d.hidden, 0.1f);
    // The routed experts as the engine runs them: grouped by expert (MoeGroup), each linear layer
    // one ExpertLinear over the grouped rows, its experts' weights through device tables.
    for (int which = 0; which < 3; ++which) {
      std::vector<const uint8_t*> codes, scales;
      for (const auto& e : experts_) {
        codes.push_back(e[which].w);
        scales.push_back(e[which].scales);
      }
      tables_[which][0] = Alloc<const uint8_t*>(codes.size());
      tables_[which][1] = Alloc<const uint8_t*>(scales.size());
      Check(g::CopyToDevice(tables_[which][0], codes.data(), codes.size() * 8), "copy");
      Check(g::CopyToDevice(tables_[which][1], scales.data(), scales.size() * 8), "copy");
    }
    const int64_t grouped = n * d.topk;
    slot_expert_ = Alloc<int64_t>(d.experts + 1), slot_offset_ = Alloc<int64_t>(d.experts + 1);
    slot_tiles_ = Alloc<int64_t>(d.experts + 1), token_of_ = Alloc<int64_t>(grouped);
    row_weights_ = Floats(grouped);
    gg_ = Floats(grouped * d.inter), ug_ = Floats(grouped * d.inter);
    hg_ = Floats(grouped * d.inter), og_routed_ = Floats(grouped * d.hidden);
    // The combine's bins, for the most rows a step has (fewer rows use a part of them).
    combine_work_ints_ =
        g::MoeCombineWorkspaceInts({.count = grouped, .dim = d.hidden, .y_rows = n});
    combine_work_ = Alloc<int32_t>(combine_work_ints_);
    xq_grouped_ = Alloc<uint8_t>(grouped * std::max(d.hidden, d.inter));
    xs_grouped_ = Alloc<uint8_t>(grouped * std::max(d.hidden, d.inter) / 32);
    // One sequence's attention state at position 65,536: a full window ring and `selected`
    // compressed entries spread over its blocks.
    position_ = 65536;
    ring_codes_ = Codes(d.window * d.head_dim), ring_scales_ = Codes(d.window * d.head_dim / 32);
    const int64_t entries = position_ / 4, blocks = entries / d.rows_per_block;
    const size_t kv_row = size_t(d.head_dim / 2), scale_row = size_t(d.head_dim / 16);
    block_bytes_ = size_t(d.rows_per_block) * (kv_row + scale_row);
    arena_ = Codes(size_t(blocks) * block_bytes_);
    std::vector<uint8_t*> table(blocks);
    std::vector<int32_t> block_table(blocks);
    for (int64_t b = 0; b < blocks; ++b) {
      table[b] = arena_ + size_t(b) * block_bytes_;
      block_table[b] = static_cast<int32_t>(b);
    }
    blocks_ = Alloc<uint8_t*>(blocks);
    Check(g::CopyToDevice(blocks_, table.data(), blocks * sizeof(uint8_t*)), "copy");
    block_table_ = Alloc<int32_t>(blocks);
    Check(g::CopyToDevice(block_table_, block_table.data(), blocks * 4), "copy");
    std::mt19937_64 rng(7);
    std::vector<int64_t> selected(d.selected);
    for (int64_t& s : selected) s = static_cast<int64_t>(rng() % uint64_t(entries));
    std::sort(selected.begin(), selected.end());
    // Decode: every sequence at `position_`. Prefill: one sequence's last max_rows tokens before
    // it, each with its own window and the same selection.
    std::vector<int64_t> at(max_rows, position_), first(max_rows, position_ - d.window + 1);
    std::vector<int64_t> chunk(max_rows), chunk_first(max_rows), chunk_selected;
    for (int64_t t = 0; t < max_rows; ++t) {
      chunk[t] = position_ - max_rows + 1 + t;
      chunk_first[t] = chunk[t] - d.window + 1;
      chunk_selected.insert(chunk_selected.end(), selected.begin(), selected.end());
    }
    auto upload = [](const std::vector<int64_t>& v) {
      int64_t* p = Alloc<int64_t>(v.size());
      Check(g::CopyToDevice(p, v.data(), v.size() * 8), "copy");
      return p;
    };
    selected_ = upload(selected);
    positions_ = upload(at);
    window_first_ = upload(first);
    chunk_positions_ = upload(chunk);
    chunk_window_first_ = upload(chunk_first);
    chunk_selected_ = upload(chunk_selected);
    std::vector<int64_t> stage_rows(max_rows);
    for (int64_t t = 0; t < max_rows; ++t) stage_rows[t] = t;
    stage_rows_ = upload(stage_rows);
    max_rows_ = max_rows;
    // A decode step's sequences in one call (as the engine makes it): sequence s its own fresh
    // row, the ring and block table shared (the bytes read are those of separate sequences).
    std::vector<k::AttentionSequence> sequences(max_rows);
    std::vector<int32_t> token_sequence(max_rows);
    for (int64_t s = 0; s < max_rows; ++s) {
      sequences[s] = {.ring_codes = ring_codes_,
                      .ring_scales = ring_scales_,
                      .fresh = kv_ + s * d.head_dim,
                      .fresh_first = position_,
                      .block_table = block_table_};
      token_sequence[s] = static_cast<int32_t>(s);
    }
    sequences_ = Alloc<k::AttentionSequence>(max_rows);
    Check(g::CopyToDevice(sequences_, sequences.data(), max_rows * sizeof(sequences[0])), "copy");
    token_sequence_ = Alloc<int32_t>(max_rows);
    Check(g::CopyToDevice(token_sequence_, token_sequence.data(), max_rows * 4), "copy");
    kv_rows_ = {blocks_, d.rows_per_block, 0, kv_row};
    kv_scales_ = {blocks_, d.rows_per_block, size_t(d.rows_per_block) * kv_row, scale_row};
    // The attention's workspace (one call at a time, so one serves the decode step's sequences
    // and the prefill chunk).
    attention_work_floats_ = std::max({g::SparseAttentionWorkspaceFloats(Attention(0)),
                                       g::SparseAttentionWorkspaceFloats(ChunkAttention()),
                                       g::SparseAttentionWorkspaceFloats(StepAttention(max_rows))});
    attention_work_ = Alloc<float>(attention_work_floats_);
  }

  // One decode step of this layer for `batch` sequences, op by op; with `prefill`, a chunk of
  // max_rows tokens of one sequence instead (batch must be max_rows).
  std::vector<Row> Decode(int64_t batch, int reps, std::mt19937_64& rng, bool prefill = false) {
    PickExperts(batch, rng);
    return Ops(batch, prefill, [&](const std::function<void()>& op) { return Time(op, reps); });
  }

  // The same step's ops launched back to back, no wait between them (as the engine launches a
  // step's): seconds per step, best of three rounds of `reps`.
  double DecodeBackToBack(int64_t batch, int reps, std::mt19937_64& rng) {
    PickExperts(batch, rng);
    return Time(
        [&] {
          Ops(batch, false, [](const std::function<void()>& op) {
            op();
            return 0.0;
          });
        },
        reps);
  }

  // The same step's ops recorded as one graph and replayed: seconds per step, best of three
  // rounds of `reps`, without the host's launch of each kernel between them; "" or why not.
  std::string DecodeAsGraph(int64_t batch, int reps, std::mt19937_64& rng, bool prefill,
                            double* seconds) {
    PickExperts(batch, rng);
    std::string error = g::CaptureBegin(stream_);
    if (!error.empty()) return error;
    Ops(batch, prefill, [](const std::function<void()>& op) {
      op();
      return 0.0;
    });
    void* graph = nullptr;
    error = g::CaptureEnd(stream_, &graph);
    if (!error.empty()) return error;
    *seconds = Time([&] { Check(g::GraphLaunch(graph, stream_), "graph launch"); }, reps);
    return g::GraphDestroy(graph);
  }

 private:
  // Each token picks topk distinct experts at random, uploaded as the router's choices (what the
  // routed experts read).
  void PickExperts(int64_t batch, std::mt19937_64& rng) {
    tokens_of_.clear();
    std::vector<int64_t> picks;
    for (int64_t t = 0; t < batch; ++t) {
      std::vector<int64_t> picked;
      while (static_cast<int64_t>(picked.size()) < d_.topk) {
        const int64_t e = static_cast<int64_t>(rng() % uint64_t(d_.experts));
        if (std::find(picked.begin(), picked.end(), e) == picked.end()) picked.push_back(e);
      }
      for (int64_t e : picked) ++tokens_of_[e];
      picks.insert(picks.end(), picked.begin(), picked.end());
    }
    Check(g::CopyToDevice(chosen_, picks.data(), picks.size() * 8), "copy");
  }

  // The step's ops in order, each passed to `time` (which runs it and says how long it took).
  std::vector<Row> Ops(int64_t batch, bool prefill,
                       const std::function<double(const std::function<void()>&)>& time) {
    std::vector<Row> rows;
    const Dims& d = d_;
    const int64_t mix = (2 + d.hc) * d.hc;
    auto add = [&](const std::string& name, uint64_t bytes, const std::function<void()>& op) {
      rows.push_back({name, time(op), bytes});
    };
    const uint64_t act = uint64_t(batch) * 4;
    // The step before each sublayer as the engine makes it, one op: the last sublayer's
    // expansion, the mixes, the collapse and its norm (one kernel at a decode step's rows).
    add("hc steps: expand, mix, collapse (x2)",
        2 * (uint64_t(mix * d.hc * d.hidden) * 4 + act * (2 * d.hc * d.hidden + 2 * d.hidden)),
        [&] {
          for (int i = 0; i < 2; ++i) CheckOp(g::HcMix(StepsParams(batch), &fused_), "HcMix");
        });
    add("wq_a + wkv (FP8, one op)", wq_a_.bytes() + wkv_.bytes(), [&] { QueryAndKeys(batch); });
    // The query latent's norm writing its codes, and the window keys' norm, rotation and FP8
    // steps and their rows staged for the host, in one op.
    add("q norm (writing its codes) + kv norm", act * (2 * d.q_lora + 3 * d.head_dim), [&] {
      const k::RmsNormParams keys = {.x = kv_,
                                     .rows = batch,
                                     .dim = d.head_dim,
                                     .stride = d.head_dim,
                                     .weight = norm_,
                                     .eps = 1e-6f,
                                     .round_input = true,
                                     .rope_dim = d.rope,
                                     .positions = positions_,
                                     .freqs = freqs_,
                                     .fake_quant_fp8 = true,
                                     .copy_to = kv_stage_,
                                     .copy_rows = stage_rows_};
      CheckOp(g::RmsNorm({.x = qa_,
                          .rows = batch,
                          .dim = d.q_lora,
                          .stride = d.q_lora,
                          .weight = norm_,
                          .eps = 1e-6f,
                          .stream = stream_,
                          .codes = qa_codes_,
                          .code_scales = qa_scales_,
                          .next = &keys}),
              "RmsNorm");
    });
    // The queries rotated by wq_b's op, as the engine asks.
    const k::RopeParams rope{
        .head_dim = d.head_dim, .rope_dim = d.rope, .positions = positions_, .freqs = freqs_};
    add("wq_b (FP8, rotating q)", wq_b_.bytes(), [&] {
      Apply(wq_b_, qa_, batch, q_, {}, true,
            {.x_codes = qa_codes_, .x_scales = qa_scales_, .rope = &rope});
    });
    const uint64_t kv_bytes = uint64_t(d.window) * (d.head_dim + d.head_dim / 32) +
                              uint64_t(d.selected) * (d.head_dim / 2 + d.head_dim / 16) +
                              uint64_t(d.heads) * d.head_dim * 8;
    add("sparse attention", uint64_t(batch) * kv_bytes, [&] {
      if (prefill) {
        CheckOp(g::SparseAttention(ChunkAttention()), "Attention");
        return;
      }
      CheckOp(g::SparseAttention(batch == 1 ? Attention(0) : StepAttention(batch)), "Attention");
    });
    add("wo_a (FP8 as values, its groups in one op)", wo_a_.bytes(), [&] {
      Apply(wo_a_, o_, batch, og_, {}, true, {.y_codes = og_codes_, .y_scales = og_scales_});
    });
    add("wo_b (FP8)", wo_b_.bytes(), [&] {
      Apply(wo_b_, og_, batch, sub_, {}, true, {.x_codes = og_codes_, .x_scales = og_scales_});
    });
    // The router's logits and the choices grouped by expert in the routing's op (one kernel at
    // one token), as the engine asks.
    const k::MoeGroupParams group = GroupParams(batch);
    add("router (dense) + route and group", router_.bytes(), [&] {
      const k::LinearParams router{.x = x_,
                                   .rows = batch,
                                   .in = router_.in,
                                   .out = router_.out,
                                   .dense = router_.dense,
                                   .y = logits_,
                                   .stream = stream_};
      k::MoeRouteParams route = RouteParams(batch);
      route.group = &group;
      route.router = &router;
      CheckOp(g::MoeRoute(route, fused_.arrivals), "MoeRoute");
    });
    // Routed experts: the picked experts' rows grouped and run as the engine runs them
    // (Step::GroupedExperts).
    uint64_t expert_bytes = 0;
    for (const auto& [e, m] : tokens_of_) {
      for (const Weight& w : experts_[e]) expert_bytes += w.bytes();
    }
    add("routed experts (FP4, " + std::to_string(tokens_of_.size()) + " touched)", expert_bytes,
        [&] { RoutedExperts(batch, false); });
    uint64_t shared_bytes = 0;
    for (const Weight& w : shared_) shared_bytes += w.bytes();
    add("shared expert (FP8)", shared_bytes, [&] { Expert(shared_, batch); });
    // The routed sum, and the shared expert's output added in the same op, as the engine makes
    // them.
    add("combine + add (one op)", act * d.hidden * (d.topk + 3), [&] {
      CheckOp(g::MoeCombine({.expert_out = og_routed_,
                             .rows = token_of_,
                             .count = batch * d.topk,
                             .dim = d.hidden,
                             .y = y_,
                             .stream = stream_,
                             .y_rows = batch,
                             .workspace = combine_work_,
                             .workspace_ints = combine_work_ints_,
                             .add = expert_out_,
                             .out = sub_}),
              "MoeCombine");
    });
    return rows;
  }

 public:
  // One sequence's decode-step attention (or with `prefill`, the prefill chunk's) in the given
  // layout: seconds per call.
  // The routed experts of a step of `batch` tokens (one set of picks), or the shared expert,
  // with w1 and w3 as one gated op, as the engine runs them (first), and apart with a Swiglu op
  // (second): seconds.
  std::pair<double, double> TimeGatedPair(int64_t batch, int reps, std::mt19937_64& rng,
                                          bool routed) {
    PickExperts(batch, rng);
    auto run = [&] { routed ? RoutedExperts(batch) : Expert(shared_, batch); };
    const double gated = Time(run, reps);
    gated_experts_ = false;
    const double apart = Time(run, reps);
    gated_experts_ = true;
    return {gated, apart};
  }

  // The router's choices for `batch` tokens and their grouping by expert in one kernel, as the
  // engine makes them (first), and a kernel each (second): seconds.
  std::pair<double, double> TimeRouteGroup(int64_t batch, int reps) {
    const int64_t total = batch * d_.topk;
    const k::MoeGroupParams group = {.slots = std::min(d_.experts, total),
                                     .slot_expert = slot_expert_,
                                     .slot_offset = slot_offset_,
                                     .slot_tiles = slot_tiles_,
                                     .rows = token_of_,
                                     .row_weights = row_weights_};
    k::MoeRouteParams route = RouteParams(batch);
    route.group = &group;
    return {Time([&] { CheckOp(g::MoeRoute(route, fused_.arrivals), "MoeRoute"); }, reps),
            Time([&] { CheckOp(g::MoeRoute(route), "MoeRoute"); }, reps)};
  }

  // wq_a and wkv at `batch` rows in one op (first) and apart (second): seconds.
  std::pair<double, double> TimeQueryAndKeys(int64_t batch, int reps) {
    return {Time([&] { QueryAndKeys(batch); }, reps),
            Time([&] { QueryAndKeys(batch, false); }, reps)};
  }

  // The step between two sublayers at `batch` rows in one kernel (where batch <= kHcFusedRows),
  // as the engine makes it (first), and a kernel a step (second): seconds.
  std::pair<double, double> TimeHcSteps(int64_t batch, int reps) {
    const k::HcMixParams p = StepsParams(batch);
    const double one = Time([&] { CheckOp(g::HcMix(p, &fused_), "HcMix"); }, reps);
    const double apart = Time([&] { CheckOp(g::HcMix(p), "HcMix"); }, reps);
    return {one, apart};
  }

  double TimeAttention(g::AttentionSchedule schedule, int reps, bool prefill = false) {
    const k::SparseAttentionParams p = prefill ? ChunkAttention() : Attention(0);
    return Time([&] { CheckOp(g::SparseAttentionScheduled(p, schedule), "Attention"); }, reps);
  }

  // A decode step's attention for `batch` sequences: one call for all (first), and a call a
  // sequence (second), as the engine made it before: seconds.
  std::pair<double, double> TimeStepAttention(int64_t batch, int reps) {
    const k::SparseAttentionParams all = StepAttention(batch);
    const double one = Time([&] { CheckOp(g::SparseAttention(all), "Attention"); }, reps);
    const double each = Time(
        [&] {
          for (int64_t s = 0; s < batch; ++s)
            CheckOp(g::SparseAttention(Attention(s)), "Attention");
        },
        reps);
    return {one, each};
  }

  // A linear layer at `rows` tokens: seconds per call (order and split as LinearOn's).
  double TimeLinear(const Weight& w, int64_t rows, int reps, Order order = Order::kShipped,
                    int split = 1) {
    float* x = Floats(rows * w.groups * w.in, 1.0f);
    float* y = Alloc<float>(rows * w.groups * w.out);
    uint8_t* xq = Alloc<uint8_t>(rows * w.groups * w.in);
    uint8_t* xs = Alloc<uint8_t>(rows * w.groups * w.in / 32);
    const double s = Time([&] { LinearOn(w, x, rows, xq, xs, y, stream_, order, split); }, reps);
    for (void* p : {static_cast<void*>(x), static_cast<void*>(y), static_cast<void*>(xq),
                    static_cast<void*>(xs)}) {
      g::DeviceFree(p);
    }
    return s;
  }

  // The FP8 and FP4 linears (the experts' too) on matrix cores from now on, as the backend
  // runs them with engine.gpu_gemms: matrix.
  void UseMatrixGemms(bool on, g::MatrixInstruction instruction) {
    matrix_ = on;
    instruction_ = instruction;
  }

  const Weight& wq_a() const { return wq_a_; }
  const Weight& wq_b() const { return wq_b_; }
  const Weight& wkv() const { return wkv_; }
  const Weight& wo_b() const { return wo_b_; }
  const Weight& wo_a() const { return wo_a_; }
  const std::vector<Weight>& shared() const { return shared_; }
  const std::vector<Weight>& expert(int64_t e) const { return experts_[e]; }

 private:
  // The router's choices for `batch` tokens from logits_.
  k::MoeRouteParams RouteParams(int64_t batch) const {
    return {.logits = logits_,
            .bias = router_bias_,
            .tokens = batch,
            .experts = d_.experts,
            .k = d_.topk,
            .scoring = k::RouteScoring::kSqrtSoftplus,
            .norm_topk = true,
            .scale = 1.5f,
            .scores = scores_,
            .biased = biased_,
            .chosen = chosen_,
            .weights = weights_,
            .stream = stream_};
  }

  // The engine's step between two sublayers: the expansion of sub_, the mixes, the collapse.
  k::HcMixParams StepsParams(int64_t batch) const {
    return {.X = X_,
            .rows = batch,
            .hc = d_.hc,
            .dim = d_.hidden,
            .fn = hc_fn_,
            .scale = hc_scale_,
            .base = hc_base_,
            .iters = 20,
            .hc_eps = 1e-6f,
            .norm_eps = 1e-20f,
            .mixes = mixes_,
            .pre = pre_,
            .post = post_,
            .comb = comb_,
            .stream = stream_,
            .sub = sub_,
            .expand_post = post_,
            .expand_comb = comb_,
            .expanded = out_X_,
            .collapse_weights = pre_,
            .collapse_norm = norm_,
            .collapse_eps = 1e-6f,
            .x = x_,
            .x_codes = x_codes_,
            .x_code_scales = x_scales_};
  }

  // The grouping of `batch` tokens' choices into the bench's slots.
  k::MoeGroupParams GroupParams(int64_t batch) const {
    const int64_t total = batch * d_.topk;
    return {.chosen = chosen_,
            .weights = weights_,
            .tokens = batch,
            .experts = d_.experts,
            .k = d_.topk,
            .slots = std::min(d_.experts, total),
            .slot_expert = slot_expert_,
            .slot_offset = slot_offset_,
            .slot_tiles = slot_tiles_,
            .rows = token_of_,
            .row_weights = row_weights_,
            .stream = stream_};
  }

  k::SparseAttentionParams Attention(int64_t s) const {
    return {.q = q_ + s * d_.heads * d_.head_dim,
            .tokens = 1,
            .heads = d_.heads,
            .head_dim = d_.head_dim,
            .rope_dim = d_.rope,
            .positions = positions_,
            .ring_codes = ring_codes_,
            .ring_scales = ring_scales_,
            .window = d_.window,
            .fresh = kv_ + s * d_.head_dim,
            .fresh_first = position_,
            .window_first = window_first_,
            .selected = selected_,
            .selected_stride = d_.selected,
            .block_table = block_table_,
            .kv_codes = kv_rows_,
            .kv_scales = kv_scales_,
            .sink = sink_,
            .freqs = freqs_,
            .out = o_ + s * d_.heads * d_.head_dim,
            .workspace = attention_work_,
            .workspace_floats = attention_work_floats_,
            .stream = stream_};
  }

  // A decode step of `batch` sequences in one call.
  k::SparseAttentionParams StepAttention(int64_t batch) const {
    k::SparseAttentionParams p = Attention(0);
    p.tokens = batch;
    p.selected = chunk_selected_;  // `selected` entries a row, the same in each.
    p.ring_codes = p.ring_scales = nullptr;
    p.fresh = nullptr;
    p.block_table = nullptr;
    p.token_sequence = token_sequence_;
    p.sequences = sequences_;
    p.sequence_count = batch;
    return p;
  }

  // Prefill: all max_rows tokens of one sequence in one call.
  k::SparseAttentionParams ChunkAttention() const {
    k::SparseAttentionParams p = Attention(0);
    p.tokens = max_rows_;
    p.positions = chunk_positions_;
    p.fresh_first = position_ - max_rows_ + 1;
    p.window_first = chunk_window_first_;
    p.selected = chunk_selected_;
    return p;
  }

  // y = w(x); round_output as the engine asks it (q, wo_a's and wo_b's outputs, the experts').
  void Apply(const Weight& w, const float* x, int64_t rows, float* y, const GatedPair& pair = {},
             bool round_output = false, const LinearExtras& extras = {}) {
    LinearOn(w, x, rows, xq_, xs_, y, stream_,
             !matrix_                                       ? Order::kShipped
             : instruction_ == g::MatrixInstruction::kWgmma ? Order::kWgmma
             : instruction_ == g::MatrixInstruction::kMfma  ? Order::kMfma
                                                            : Order::kMatrix,
             1, pair, round_output, extras);
  }

  // wq_a and wkv of the same x as the engine runs them (`together`): one op, x quantized once
  // (one GEMV launch at one row); on matrix cores an op each, as the backend runs them there.
  // Both read the collapse's codes of x, as the engine's do.
  void QueryAndKeys(int64_t rows, bool together = true) {
    if (matrix_ || !together) {
      Apply(wq_a_, x_, rows, qa_, {}, false, {.x_codes = x_codes_, .x_scales = x_scales_});
      Apply(wkv_, x_, rows, kv_, {}, false, {.x_codes = x_codes_, .x_scales = x_scales_});
      return;
    }
    const k::LinearProjection wkv{.w = wkv_.w, .w_scales = wkv_.scales, .out = wkv_.out, .y = kv_};
    CheckOp(g::Linear({.x = x_,
                       .rows = rows,
                       .in = wq_a_.in,
                       .out = wq_a_.out,
                       .format = wq_a_.format,
                       .w = wq_a_.w,
                       .w_scales = wq_a_.scales,
                       .x_codes = x_codes_,
                       .x_scales = x_scales_,
                       .y = qa_,
                       .stream = stream_,
                       .x_quantized = true,
                       .also = &wkv,
                       .also_count = 1}),
            "Linear");
  }

  // The shared expert as the engine runs it: x's codes the collapse's, and (gated) h's codes
  // made by the gated op for w2.
  void Expert(const std::vector<Weight>& e, int64_t rows) {
    const LinearExtras x_codes{.x_codes = x_codes_, .x_scales = x_scales_};
    if (gated_experts_) {  // w1 and w3 under SwiGLU in one op, as the engine runs them.
      LinearExtras codes = x_codes;
      codes.y_codes = h_codes_, codes.y_scales = h_scales_, codes.arrivals = code_arrivals_;
      Apply(e[0], x_, rows, h_, {&e[1], gate_, up_}, false, codes);
      Apply(e[2], h_, rows, expert_out_, {}, true, {.x_codes = h_codes_, .x_scales = h_scales_});
      return;
    }
    Apply(e[0], x_, rows, gate_, {}, false, x_codes);
    Apply(e[1], x_, rows, up_, {}, false, x_codes);
    Activate(gate_, up_, rows, nullptr, h_);
    Apply(e[2], h_, rows, expert_out_, {}, true);
  }

  void Activate(const float* gate, const float* up, int64_t rows, const float* w, float* h) {
    CheckOp(g::Swiglu({.gate = gate,
                       .up = up,
                       .rows = rows,
                       .inter = d_.inter,
                       .row_weights = w,
                       .limit = 10.0f,
                       .h = h,
                       .stream = stream_}),
            "Swiglu");
  }

  // MoeGroup over the router's choices for `rows` tokens (unless `group` is false: the routing
  // grouped them), then the experts over the grouped rows.
  void RoutedExperts(int64_t rows, bool group = true) {
    const int64_t total = rows * d_.topk, slots = std::min(d_.experts, total);
    if (group) CheckOp(g::MoeGroup(GroupParams(rows)), "MoeGroup");
    // w1 and w3 read the step's rows through token_of_ (ExpertLinearParams::x_rows) and their
    // codes the collapse's, as Step::GroupedExperts does; w2 the grouped rows, and (gated) the
    // codes the gated op made of them.
    auto linear = [&](int which, const float* x, float* y, bool gated = false) {
      const Weight& w = experts_[0][which];
      k::ExpertLinearParams p = {.x = x,
                                 .rows = total,
                                 .in = w.in,
                                 .out = w.out,
                                 .slot_expert = slot_expert_,
                                 .slot_offset = slot_offset_,
                                 .slot_tiles = slot_tiles_,
                                 .slots = slots,
                                 .experts = d_.experts,
                                 .format = w.format,
                                 .w = tables_[which][0],
                                 .w_scales = tables_[which][1],
                                 .x_codes = xq_grouped_,
                                 .x_scales = xs_grouped_,
                                 .y = y,
                                 .stream = stream_,
                                 .slot_rows = rows,
                                 .up = gated ? tables_[1][0] : nullptr,
                                 .up_scales = gated ? tables_[1][1] : nullptr,
                                 .row_weights = gated ? row_weights_ : nullptr,
                                 .limit = 10.0f,
                                 .gate = gg_,
                                 .up_out = ug_,
                                 .round_output = which == 2,
                                 .x_rows = which < 2 ? token_of_ : nullptr,
                                 .x_count = rows};
      if (which < 2) p.x_row_codes = x_codes_, p.x_row_scales = x_scales_;
      if (gated) p.y_codes = hg_codes_, p.y_code_scales = hg_scales_;
      if (which == 2 && gated_experts_) {
        p.x_codes = hg_codes_, p.x_scales = hg_scales_, p.x_quantized = true;
      }
      CheckOp(matrix_ ? g::ExpertLinearMatrix(p, instruction_)
                      : g::ExpertLinear(p, gated ? code_arrivals_ : nullptr),
              "ExpertLinear");
    };
    if (gated_experts_) {  // w1 and w3 under SwiGLU in one op, as Step::GroupedExperts.
      linear(0, x_, hg_, true);
    } else {
      linear(0, x_, gg_);
      linear(1, x_, ug_);
      Activate(gg_, ug_, total, row_weights_, hg_);
    }
    linear(2, hg_, og_routed_);  // Its rows rounded to BF16 in the op, as the engine asks.
  }

  Dims d_;
  bool gated_experts_ = true;  // The experts' w1 and w3 as one gated op (else apart).
  bool matrix_ = false;        // UseMatrixGemms.
  g::MatrixInstruction instruction_ = g::MatrixInstruction::kMma;
  void* stream_ = nullptr;  // The ops' stream (one of the bench's own, so graphs can record it).
  std::map<int64_t, int64_t> tokens_of_;  // The picked experts and their tokens.
  const uint8_t** tables_[3][2] = {};     // w1, w3, w2: codes, scales
  int64_t *slot_expert_, *slot_offset_, *slot_tiles_, *token_of_;
  float *row_weights_, *gg_, *ug_, *hg_, *og_routed_;
  uint8_t *xq_grouped_, *xs_grouped_;
  // Rows' codes made by the op writing the rows (Ops), and the GEMV's counters for the gated's.
  uint8_t *x_codes_, *x_scales_, *qa_codes_, *qa_scales_, *og_codes_, *og_scales_;
  uint8_t *h_codes_, *h_scales_, *hg_codes_, *hg_scales_;
  unsigned* code_arrivals_;
  float *hc_fn_, *hc_scale_, *hc_base_, *norm_, *router_bias_, *freqs_, *sink_;
  Weight wq_a_, wq_b_, wkv_, wo_a_, wo_b_, router_;
  std::vector<Weight> shared_;
  std::vector<std::vector<Weight>> experts_;
  g::HcMixFused fused_;  // The fused hc steps' counts (zeros) and sums.
  float *X_, *out_X_, *mixes_, *pre_, *post_, *comb_, *x_, *sub_, *qa_, *q_, *o_, *og_, *kv_;
  float *logits_, *scores_, *biased_, *weights_, *gate_, *up_, *h_, *y_, *expert_out_;
  uint8_t *xq_, *xs_, *ring_codes_, *ring_scales_, *arena_;
  float* kv_stage_;
  int64_t *chosen_, *selected_, *positions_, *window_first_, *stage_rows_;
  int64_t *chunk_positions_, *chunk_window_first_, *chunk_selected_;
  int64_t max_rows_ = 0;
  k::AttentionSequence* sequences_ = nullptr;
  int32_t* token_sequence_ = nullptr;
  uint8_t** blocks_;
  int32_t* block_table_;
  size_t block_bytes_ = 0;
  int64_t position_ = 0;
  k::PagedRows kv_rows_, kv_scales_;
  float* attention_work_ = nullptr;
  int64_t attention_work_floats_ = 0;
  int32_t* combine_work_ = nullptr;
  int64_t combine_work_ints_ = 0;
};

// The free-order GEMM's best time over splits 1, 2, 4, ... max_split (each thread block keeping
// at least one chunk of the tile's K-blocks, 16): seconds, and the split that gave it in
// `*split`.
double FreeOrderBest(Layer& layer, const Weight& w, int64_t rows, int reps, int* split,
                     int max_split = 32) {
  double best = 1e30;
  for (int s = 1; s <= max_split && (s == 1 || w.in / 32 / s >= 16); s *= 2) {
    const double t = layer.TimeLinear(w, rows, reps, Order::kFree, s);
    if (t < best) best = t, *split = s;
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  Dims d;
  int reps = 20;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--tiny") == 0) {
      d = Tiny();
    } else if (std::strcmp(argv[i], "--reps") == 0 && i + 1 < argc) {
      reps = std::max(1, std::atoi(argv[++i]));
    } else {
      std::fprintf(stderr, "usage: gpu_bench [--tiny] [--reps N]\n");
      return 2;
    }
  }
  std::string reason;
  if (g::DeviceCount(&reason) == 0) {
    std::fprintf(stderr, "gpu_bench: %s\n", reason.c_str());
    return 77;
  }
  std::string device;
  Check(g::DeviceName(&device), "device name");
  size_t free_bytes = 0, total = 0;
  Check(g::MemoryInfo(&free_bytes, &total), "memory");
  std::printf("device: %s, %.1f GiB\n", device.c_str(), total / double(1ull << 30));
  // As the engine does (GpuOptions::early_launch); the layer's step is timed both ways below.
  const bool early = g::SetEarlyLaunch(true);
  std::printf("kernels start early (programmatic dependent launch): %s\n",
              early ? "yes" : "no, this device's code starts them in turn");

  // Copy bandwidth: read plus write of a device-to-device copy.
  const size_t copy_bytes = d.hidden >= 5120 ? (size_t{2} << 30) : (size_t{64} << 20);
  uint8_t* a = Codes(copy_bytes);
  uint8_t* b = Alloc<uint8_t>(copy_bytes);
  const double copy_s =
      Time([&] { Check(g::CopyOnDevice(b, a, copy_bytes), "copy"); }, std::max(1, reps / 4));
  const double bandwidth = 2.0 * copy_bytes / copy_s;
  g::DeviceFree(a);
  g::DeviceFree(b);
  std::printf("copy bandwidth (read + write): %.0f GB/s\n\n", bandwidth / 1e9);

  const int64_t tokens = d.hidden >= 5120 ? 4096 : 256;  // The prefill chunk.
  Layer layer(d, tokens);
  std::mt19937_64 rng(11);
  std::printf("decode, batch 1, one layer (position 65,536: window %lld + %lld selected)\n",
              static_cast<long long>(d.window), static_cast<long long>(d.selected));
  std::printf("%-40s %10s %12s %10s %8s\n", "op", "us", "bytes", "GB/s", "of copy");
  double total_s = 0;
  uint64_t total_bytes = 0;
  for (const Row& r : layer.Decode(1, reps, rng)) {
    std::printf("%-40s %10.1f %12llu %10.1f %7.1f%%\n", r.op.c_str(), r.seconds * 1e6,
                static_cast<unsigned long long>(r.bytes), r.bytes / r.seconds / 1e9,
                100.0 * r.bytes / r.seconds / bandwidth);
    total_s += r.seconds;
    total_bytes += r.bytes;
  }
  std::printf("%-40s %10.1f %12llu %10.1f %7.1f%%\n", "layer", total_s * 1e6,
              static_cast<unsigned long long>(total_bytes), total_bytes / total_s / 1e9,
              100.0 * total_bytes / total_s / bandwidth);
  std::printf("layer time / time to read its bytes at copy bandwidth: %.2fx (goal <= 1.6x)\n",
              total_s / (total_bytes / bandwidth));
  // The sum above times each op alone, so a short op's time is mostly the host launching it; a
  // graph of the whole layer launches its kernels back to back from the device.
  double graph_s = 0;
  const std::string graph_error = layer.DecodeAsGraph(1, reps, rng, false, &graph_s);
  if (graph_error.empty()) {
    std::printf("the layer as one graph: %.1f us, %.2fx the time to read its bytes\n\n",
                graph_s * 1e6, graph_s / (total_bytes / bandwidth));
  } else {
    std::printf("the layer as one graph: not measured (%s)\n\n", graph_error.c_str());
  }

  // The attention of one decode step in each layout (SparseAttention takes the keys decoded
  // once where it has the workspace, as here and in the backend).
  std::printf(
      "decode attention, one thread block a head: %.1f us; two: %.1f us; keys decoded once: "
      "%.1f us\n",
      layer.TimeAttention(g::AttentionSchedule::kHeadBlocks, reps) * 1e6,
      layer.TimeAttention(g::AttentionSchedule::kHeadBlocksSplit, reps) * 1e6,
      layer.TimeAttention(g::AttentionSchedule::kKeysOnce, reps) * 1e6);
  // A step's sequences in one attention call, against a call a sequence.
  for (int64_t batch : {8, 64}) {
    const auto [one, each] = layer.TimeStepAttention(batch, reps);
    std::printf(
        "decode attention at batch %lld: one call %.1f us, a call a sequence %.1f us (%.2fx)\n",
        static_cast<long long>(batch), one * 1e6, each * 1e6, each / one);
  }
  std::printf("\n");

  // The step's ops timed alone and summed, then launched back to back as the engine does, each
  // kernel starting when the one ahead has finished ("in turn") and where the device has it
  // early, then replayed as one graph.
  std::printf("%5s %12s %12s %12s %14s %18s %26s\n", "batch", "ops alone us", "in turn us",
              "early us", "as a graph us", "tokens/s per layer", "tokens/s, 40 layers (est.)");
  for (int64_t batch : {1, 8, 64}) {
    double s = 0, graph = 0;
    for (const Row& r : layer.Decode(batch, reps, rng)) s += r.seconds;
    g::SetEarlyLaunch(false);
    const double in_turn = layer.DecodeBackToBack(batch, reps, rng);
    g::SetEarlyLaunch(early);
    const double ahead = early ? layer.DecodeBackToBack(batch, reps, rng) : in_turn;
    // The fastest way measured: what a step launched that way gets.
    const bool as_graph = layer.DecodeAsGraph(batch, reps, rng, false, &graph).empty();
    const double best = std::min({s, in_turn, ahead, as_graph ? graph : s});
    char graph_us[32] = "-", early_us[32] = "-";
    if (as_graph) std::snprintf(graph_us, sizeof graph_us, "%.1f", graph * 1e6);
    if (early) std::snprintf(early_us, sizeof early_us, "%.1f", ahead * 1e6);
    std::printf("%5lld %12.1f %12.1f %12s %14s %18.0f %26.1f\n", static_cast<long long>(batch),
                s * 1e6, in_turn * 1e6, early_us, graph_us, batch / best,
                batch / (best * d.layers));
  }
  // The hc steps between two sublayers in one kernel (the engine's at these batches) against a
  // kernel a step.
  for (int64_t batch : {1, 8, 32}) {
    const auto [one, apart] = layer.TimeHcSteps(batch, reps);
    std::printf("hc steps at batch %lld: one kernel %.1f us; a kernel a step %.1f us\n",
                static_cast<long long>(batch), one * 1e6, apart * 1e6);
  }
  // The routing and its grouping in one kernel (the engine's) against a kernel each.
  for (int64_t batch : {1, 8, 64}) {
    const auto [one, apart] = layer.TimeRouteGroup(batch, reps);
    std::printf("route and group at batch %lld: one kernel %.1f us; a kernel each %.1f us\n",
                static_cast<long long>(batch), one * 1e6, apart * 1e6);
  }
  // wq_a and wkv of one x in one op (the engine's) against an op each.
  for (int64_t batch : {1, 8}) {
    const auto [one, apart] = layer.TimeQueryAndKeys(batch, reps);
    std::printf("wq_a and wkv at batch %lld: one op %.1f us; an op each %.1f us\n",
                static_cast<long long>(batch), one * 1e6, apart * 1e6);
  }
  // The experts' w1 and w3 as one gated op (the engine's) against two ops and a Swiglu.
  for (const bool routed : {true, false}) {
    for (int64_t batch : {1, 8}) {
      const auto [gated, apart] = layer.TimeGatedPair(batch, reps, rng, routed);
      std::printf("%s at batch %lld: w1 and w3 as one gated op %.1f us; apart %.1f us\n",
                  routed ? "routed experts" : "shared expert", static_cast<long long>(batch),
                  gated * 1e6, apart * 1e6);
    }
  }

  // What the fixed order costs: the shipped GEMMs (the CPU's order, the same whatever the batch:
  // "fixed", at one row the GEMV; "tile": the GEMM tile, one thread block a tile of 32 columns,
  // which takes more rows) against the free-order schedule at its best split for each shape,
  // which no backend uses.
  std::printf(
      "\nfixed order vs free order (the same tiles, K split over thread blocks whose sums land by "
      "atomic adds, the best of splits 1-32)\n");
  std::printf("%-22s %5s %6s %6s %12s %12s %12s %6s %10s\n", "GEMM", "M", "N", "K", "tile us",
              "fixed us", "free us", "split", "fixed/free");
  struct Decode {
    std::string name;
    const Weight* w;
  };
  const std::vector<Decode> decode_gemms = {{"wq_a (FP8)", &layer.wq_a()},
                                            {"wq_b (FP8)", &layer.wq_b()},
                                            {"wkv (FP8)", &layer.wkv()},
                                            {"wo_b (FP8)", &layer.wo_b()},
                                            {"shared gate (FP8)", &layer.shared()[0]},
                                            {"shared down (FP8)", &layer.shared()[2]},
                                            {"expert gate (FP4)", &layer.expert(0)[0]},
                                            {"expert down (FP4)", &layer.expert(0)[2]}};
  for (int64_t batch : {1, 8, 64}) {
    double tile_sum = 0, fixed_sum = 0, free_sum = 0;
    for (const Decode& gm : decode_gemms) {
      int split = 1;
      const double tile = layer.TimeLinear(*gm.w, batch, reps, Order::kTile);
      const double fixed = layer.TimeLinear(*gm.w, batch, reps);
      const double free = FreeOrderBest(layer, *gm.w, batch, reps, &split);
      tile_sum += tile, fixed_sum += fixed, free_sum += free;
      std::printf("%-22s %5lld %6lld %6lld %12.1f %12.1f %12.1f %6d %9.2fx\n", gm.name.c_str(),
                  static_cast<long long>(batch), static_cast<long long>(gm.w->out),
                  static_cast<long long>(gm.w->in), tile * 1e6, fixed * 1e6, free * 1e6, split,
                  fixed / free);
    }
    std::printf("%-22s %5lld %6s %6s %12.1f %12.1f %12.1f %6s %9.2fx\n", "these GEMMs",
                static_cast<long long>(batch), "", "", tile_sum * 1e6, fixed_sum * 1e6,
                free_sum * 1e6, "", fixed_sum / free_sum);
  }

  // Prefill: one layer over a chunk of one sequence's tokens, the same ops.
  const std::vector<Row> exact_rows = layer.Decode(tokens, std::max(1, reps / 10), rng, true);
  double prefill_s = 0;
  for (const Row& r : exact_rows) prefill_s += r.seconds;
  std::printf(
      "\nprefill, %lld tokens of one sequence: one layer %.1f ms, %.0f tokens/s per layer, "
      "%.1f tokens/s for 40 layers (est.)\n",
      static_cast<long long>(tokens), prefill_s * 1e3, tokens / prefill_s,
      tokens / (prefill_s * d.layers));
  // The chunk's attention in both layouts (the layer above takes the keys decoded once).
  const int prefill_reps = std::max(1, reps / 10);
  std::printf(
      "prefill attention, %lld queries, eight heads a thread block: %.1f ms; keys "
      "decoded once: %.1f ms\n",
      static_cast<long long>(tokens),
      layer.TimeAttention(g::AttentionSchedule::kHeadBlocks, prefill_reps, true) * 1e3,
      layer.TimeAttention(g::AttentionSchedule::kKeysOnce, prefill_reps, true) * 1e3);

  // The same prefill with the linears on matrix cores, op by op beside the exact GEMMs'.
  // The instruction the backend takes: the warpgroup one where the device's code has it, AMD's
  // where that device's code has it, else mma.sync (or its stand-in).
  const bool wgmma = g::MatrixWgmmaNative();
  const bool mfma = !wgmma && g::MatrixMfmaNative();
  layer.UseMatrixGemms(true, wgmma  ? g::MatrixInstruction::kWgmma
                             : mfma ? g::MatrixInstruction::kMfma
                                    : g::MatrixInstruction::kMma);
  const std::vector<Row> matrix_rows = layer.Decode(tokens, std::max(1, reps / 10), rng, true);
  layer.UseMatrixGemms(false, g::MatrixInstruction::kMma);
  const char* matrix_cores = wgmma                    ? "the warpgroup instruction (wgmma)"
                             : mfma                   ? "AMD's matrix instruction (mfma)"
                             : g::MatrixCoresNative() ? "the device's mma.sync"
                                                      : "the stand-in (no instruction)";
  std::printf("\nprefill, %lld tokens, op by op: exact GEMMs against matrix cores, %s\n",
              static_cast<long long>(tokens), matrix_cores);
  std::printf("%-44s %12s %12s %8s\n", "op", "exact us", "matrix us", "ratio");
  double matrix_s = 0;
  for (size_t i = 0; i < exact_rows.size() && i < matrix_rows.size(); ++i) {
    matrix_s += matrix_rows[i].seconds;
    std::printf("%-44s %12.1f %12.1f %7.2fx\n", exact_rows[i].op.c_str(),
                exact_rows[i].seconds * 1e6, matrix_rows[i].seconds * 1e6,
                exact_rows[i].seconds / matrix_rows[i].seconds);
  }
  std::printf("%-44s %12.1f %12.1f %7.2fx; %.0f against %.0f tokens/s per layer\n", "layer",
              prefill_s * 1e6, matrix_s * 1e6, prefill_s / matrix_s, tokens / prefill_s,
              tokens / matrix_s);

  // Prefill GEMMs at 4,096 tokens: FP8 projections, and an FP4 expert with its share of them.
  const int64_t per_expert = tokens * d.topk / d.experts;
  const bool hopper =
      device.find("H100") != std::string::npos || device.find("H200") != std::string::npos;
  std::printf("\nprefill GEMMs (%lld tokens)%s; matrix cores: %s\n", static_cast<long long>(tokens),
              hopper ? "; peak: 1979 TFLOP/s dense FP8 (NVIDIA's H100/H200 SXM datasheet)" : "",
              matrix_cores);
  std::printf("%-28s %6s %6s %6s %10s %10s %8s %12s %10s %10s %8s %10s %10s %8s\n", "GEMM", "M",
              "N", "K", "us", "TFLOP/s", "of peak", "free-order us", "mma us", "TFLOP/s", "of peak",
              kAmdBuild ? "mfma us" : "wgmma us", "TFLOP/s", "of peak");
  struct Gemm {
    std::string name;
    const Weight* w;
    int64_t rows;
  };
  // The last row: an expert gate whose rows' scales are too far apart for the warpgroup tiles
  // to fold (the other columns: the same work as the gate's row).
  const Weight& gate = layer.expert(0)[0];
  const Weight spread = Fp4Spread(gate.out, gate.in);
  const std::vector<Gemm> gemms = {{"wq_a (FP8)", &layer.wq_a(), tokens},
                                   {"wo_b (FP8)", &layer.wo_b(), tokens},
                                   {"shared gate (FP8)", &layer.shared()[0], tokens},
                                   {"expert gate (FP4)", &gate, per_expert},
                                   {"expert down (FP4)", &layer.expert(0)[2], per_expert},
                                   {"expert gate (FP4, unfolded)", &spread, per_expert}};
  for (const Gemm& gm : gemms) {
    const double s = layer.TimeLinear(*gm.w, gm.rows, std::max(1, reps / 4));
    const double tflops = 2.0 * gm.rows * gm.w->out * gm.w->in / s / 1e12;
    int split = 1;
    // Thousands of rows fill the device without a split.
    const double free =
        FreeOrderBest(layer, *gm.w, gm.rows, std::max(1, reps / 4), &split, gm.rows <= 64 ? 32 : 1);
    // The matrix-core GEMM (the stand-in where the device lacks the instruction: see the header).
    const double m = layer.TimeLinear(*gm.w, gm.rows, std::max(1, reps / 4), Order::kMatrix);
    const double m_tflops = 2.0 * gm.rows * gm.w->out * gm.w->in / m / 1e12;
    // The vendor's instruction: the warpgroup one (its stand-in where the device's code lacks
    // it), AMD's on HIP.
    const double wg = layer.TimeLinear(*gm.w, gm.rows, std::max(1, reps / 4),
                                       kAmdBuild ? Order::kMfma : Order::kWgmma);
    const double wg_tflops = 2.0 * gm.rows * gm.w->out * gm.w->in / wg / 1e12;
    std::printf(
        "%-28s %6lld %6lld %6lld %10.1f %10.2f %7.2f%% %12.1f %10.1f %10.2f %7.2f%% %10.1f %10.2f "
        "%7.2f%%\n",
        gm.name.c_str(), static_cast<long long>(gm.rows), static_cast<long long>(gm.w->out),
        static_cast<long long>(gm.w->in), s * 1e6, tflops, hopper ? 100.0 * tflops / 1979.0 : 0.0,
        free * 1e6, m * 1e6, m_tflops, hopper ? 100.0 * m_tflops / 1979.0 : 0.0, wg * 1e6,
        wg_tflops, hopper ? 100.0 * wg_tflops / 1979.0 : 0.0);
  }
  // wo_a: FP8 values over BF16 activations, its groups in one op; exact (the CPU's order) and on
  // matrix cores (the BF16 instruction, whichever instruction the others take), against the
  // dense BF16 peak.
  {
    const Weight& w = layer.wo_a();
    const double flop = 2.0 * tokens * w.groups * w.out * w.in;
    const double s = layer.TimeLinear(w, tokens, std::max(1, reps / 4));
    const double m = layer.TimeLinear(w, tokens, std::max(1, reps / 4), Order::kMatrix);
    char share[64] = "";
    if (hopper) {
      std::snprintf(share, sizeof share, ", %.2f%% of the 989 dense BF16",
                    100.0 * flop / m / 1e12 / 989.0);
    }
    std::printf(
        "wo_a (FP8 values, %lld groups of %lld x %lld) at %lld tokens: exact %.1f us "
        "(%.2f TFLOP/s), matrix cores %.1f us (%.2f TFLOP/s%s)\n",
        static_cast<long long>(w.groups), static_cast<long long>(w.out),
        static_cast<long long>(w.in), static_cast<long long>(tokens), s * 1e6, flop / s / 1e12,
        m * 1e6, flop / m / 1e12, share);
  }
  return 0;
}
