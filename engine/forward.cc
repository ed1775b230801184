#include "engine/forward.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <future>
#include <limits>
#include <map>
#include <optional>
#include <thread>
#include <unordered_map>

#include "engine/backend.h"
#include "engine/block_manager.h"
#include "engine/engram_store.h"
#include "engine/forward_plan.h"
#include "kernels/cpu/formats.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/scalar.h"

namespace flashd::engine {
namespace {

namespace k = flashd::kernels::cpu;
using kernels::OpStatus;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// A version: unique in the process, so it names one content (a window ring slot's,
// SequenceState::Ring::versions; a compressor's partial groups, SequenceState::Compressor).
uint64_t NewVersion() {
  static std::atomic<uint64_t> next{1};
  return next.fetch_add(1, std::memory_order_relaxed);
}

// An op that refuses its arguments is a bug in the engine's op layer, not bad input.
Status Check(OpStatus s, const char* op) {
  if (s == OpStatus::kOk) return Status::Ok();
  if (s == OpStatus::kDeviceError) {
    return Unavailable(std::string("forward: op ") + op + " failed on the device");
  }
  return Internal(std::string("forward: op ") + op + " refused its arguments (" +
                  (s == OpStatus::kBadShape ? "shape" : "argument") + ")");
}
// Every op goes through the step's backend.
#define FLASHD_OP(op, ...) FLASHD_RETURN_IF_ERROR(Check(b_->op(__VA_ARGS__), #op))

std::vector<float> DecodeFloats(const TensorView& t) {
  std::vector<float> out(t.elements());
  if (t.dtype == DType::kF32) {
    std::memcpy(out.data(), t.data, out.size() * 4);
  } else {
    for (size_t i = 0; i < out.size(); ++i) {
      uint16_t b = static_cast<uint16_t>(t.data[2 * i] | (t.data[2 * i + 1] << 8));
      out[i] = k::Bf16ToFloat(b);
    }
  }
  return out;
}

// A linear layer's weights as stored: FP8 (32x32 scales), FP4 (scales per 32 along K), or
// dense floats decoded from BF16.
struct Linear {
  kernels::WeightFormat format = kernels::WeightFormat::kDense;
  const uint8_t* w = nullptr;
  const uint8_t* s = nullptr;
  std::vector<float> dense;
  int64_t out = 0, in = 0;
};

struct Expert {
  Linear w1, w2, w3;
};

// The routed experts' weights as ExpertLinear takes them: each expert's w1, w2 or w3 (codes and
// scales), when every expert's are quantized alike (as released: FP4, or FP8); empty otherwise.
struct ExpertTables {
  kernels::WeightFormat format = kernels::WeightFormat::kFp4;
  int64_t in = 0, out = 0;
  std::vector<const uint8_t*> w, s;
};

std::optional<ExpertTables> TablesOf(const std::vector<Expert>& experts, Linear Expert::*which) {
  if (experts.empty()) return std::nullopt;
  ExpertTables t;
  const Linear& first = experts.front().*which;
  t.format = first.format;
  t.in = first.in;
  t.out = first.out;
  if (t.format != kernels::WeightFormat::kFp8 && t.format != kernels::WeightFormat::kFp4) {
    return std::nullopt;
  }
  for (const Expert& e : experts) {
    const Linear& lin = e.*which;
    if (lin.format != t.format || lin.in != t.in || lin.out != t.out || !lin.w || !lin.s) {
      return std::nullopt;
    }
    t.w.push_back(lin.w);
    t.s.push_back(lin.s);
  }
  return t;
}

// All three of the routed experts' linear layers as tables.
struct GroupedWeights {
  ExpertTables w1, w3, w2;
};

std::optional<GroupedWeights> GroupedOf(const std::vector<Expert>& experts) {
  std::optional<ExpertTables> w1 = TablesOf(experts, &Expert::w1);
  std::optional<ExpertTables> w3 = TablesOf(experts, &Expert::w3);
  std::optional<ExpertTables> w2 = TablesOf(experts, &Expert::w2);
  if (!w1 || !w3 || !w2) return std::nullopt;
  return GroupedWeights{std::move(*w1), std::move(*w3), std::move(*w2)};
}

struct Layer {
  std::vector<float> attn_norm, ffn_norm;
  std::vector<float> hc_attn_fn, hc_attn_base, hc_attn_scale;
  std::vector<float> hc_ffn_fn, hc_ffn_base, hc_ffn_scale;
  std::vector<float> attn_sink;
  Linear wq_a, wq_b, wkv, wo_b;
  std::vector<float> q_norm, kv_norm;
  Linear wo_a;  // FP8 [groups * o_lora, heads * head_dim / groups], run as its exact values
  // Compressor (KV sources).
  Linear comp_wkv, comp_wgate;
  std::vector<float> comp_norm;
  // Indexer (index sources).
  Linear idx_wq_b, idx_weights_proj, idx_wk;
  std::vector<float> idx_k_norm;
  // MoE.
  std::vector<float> gate_w, gate_bias;
  int64_t top_k = 0;  // Routed experts per token.
  std::vector<Expert> experts;
  // The experts' w1, w3 and w2 for ExpertLinear (empty: the per-expert loop runs).
  std::optional<GroupedWeights> grouped;
  Expert shared;
  // Engram.
  const uint8_t* engram_rows = nullptr;
  const uint8_t* engram_row_scales = nullptr;
  Linear engram_wkv;
  std::vector<float> engram_qk;  // q_weight * k_weight, [hc, dim]
  // RoPE frequencies of this layer (YaRN at compress_rope_theta for compressing layers).
  std::vector<float> freqs;
};

// FP8 or FP4 weights: a linear of them quantizes its x (or reads its codes).
bool QuantizedFormat(kernels::WeightFormat f) {
  return f == kernels::WeightFormat::kFp8 || f == kernels::WeightFormat::kFp4;
}

// Whether `lin` (a Linear, or the experts' ExpertTables) reads the codes of its x, rows of `width`
// values, where the op writing x makes them (LinearParams::x_quantized).
template <class L>
bool ReadsCodes(const L& lin, int64_t width) {
  return QuantizedFormat(lin.format) && width % 32 == 0 && lin.in == width;
}

kernels::RouteScoring Scoring(const std::string& name) {
  if (name == "softmax") return kernels::RouteScoring::kSoftmax;
  if (name == "sigmoid") return kernels::RouteScoring::kSigmoid;
  return kernels::RouteScoring::kSqrtSoftplus;
}

}  // namespace

// The DSpark drafter's own tensors; its stages are Layers after the backbone's.
struct DSparkWeights {
  int stages = 0, block = 0;
  int32_t noise = 0;
  std::vector<int> targets;  // Backbone layers whose attention input feeds main_proj.
  Linear main_proj;
  std::vector<float> main_norm, norm;
  int64_t rank = 0;
  std::vector<float> markov_embed;  // [vocab, rank], BF16 values
  std::vector<float> markov_head;   // [vocab, rank]
  std::vector<float> confidence;    // [dim + rank]
};

// The plan of a DSpark stage: window attention only.
const LayerPlan kDraftLayerPlan{};

struct CpuForward::Impl {
  const Model* model = nullptr;
  ModelConfig c;
  std::vector<Layer> layers;  // The backbone's, then the DSpark stages' (when enabled).
  std::unique_ptr<DSparkWeights> dspark;
  size_t ring_count() const {
    return static_cast<size_t>(c.num_hidden_layers + (dspark ? dspark->stages : 0));
  }
  // A window ring holding nothing yet: zero codes, unit (UE8M0 127) scales.
  SequenceState::Ring EmptyRing() const {
    const size_t hd = static_cast<size_t>(c.head_dim), win = static_cast<size_t>(c.sliding_window);
    return {std::vector<uint8_t>(win * hd, 0), std::vector<uint8_t>(win * hd / 32, 127), {}};
  }
  const LayerPlan& Plan(int l) const {
    return l < c.num_hidden_layers ? c.layers[l] : kDraftLayerPlan;
  }
  Status LoadBlock(const std::string& p, const LayerPlan& plan, int experts, int top_k, Layer* L);
  Status EnableDSpark();
  std::vector<float> embed, head, final_norm;
  std::unique_ptr<EngramHasher> engram;
  // The Engram rows from SSD (engine/engram_store.h) instead of the mapped tables; table i is
  // the i-th Engram layer's.
  std::shared_ptr<EngramStore> engram_store;
  bool engram_read_ahead = true;
  std::shared_ptr<const KvBlockLayout> layout;
  int64_t block_tokens = 64;
  std::shared_ptr<KvPool> pool;
  std::unique_ptr<BlockManager> blocks;
  // Where each part runs (Placement): the backends, each layer's, the routed experts'.
  std::vector<std::unique_ptr<Backend>> backends;
  std::vector<int> layer_backend;
  int routed_experts = -1;
  std::string numerics;
  const Backend* LayerBackend(int l) const { return backends[layer_backend[l]].get(); }
  Status Place(Placement placement);

  // One region of a KV source in every block of the pool, with the pool's block versions and
  // its count of host writes.
  kernels::PagedRows Rows(const KvBlockLayout::Source& src,
                          const KvBlockLayout::Region& region) const {
    return {pool->block_table(), src.entries_per_block, region.offset, region.row_bytes,
            pool->versions(),    layout->block_bytes,   pool->writes()};
  }

  Status Prepare(const Model& m, const std::string& tokenizer_json);
  const TensorView& T(const std::string& name) const { return *model->weights().tensors.at(name); }
  Linear Lin(const std::string& prefix) const;
};

Linear CpuForward::Impl::Lin(const std::string& prefix) const {
  Linear lin;
  const TensorView& w = T(prefix + ".weight");
  lin.out = w.shape[0];
  if (w.dtype == DType::kF8E4M3) {
    lin.format = kernels::WeightFormat::kFp8;
    lin.in = w.shape[1];
    lin.w = w.data;
    lin.s = T(prefix + ".scale").data;
  } else if (w.dtype == DType::kI8 || w.dtype == DType::kU8 || w.dtype == DType::kF4) {
    lin.format = kernels::WeightFormat::kFp4;
    lin.in = w.dtype == DType::kF4 ? w.shape[1] : w.shape[1] * 2;
    lin.w = w.data;
    lin.s = T(prefix + ".scale").data;
  } else {
    lin.format = kernels::WeightFormat::kDense;
    lin.in = w.shape[1];
    lin.dense = DecodeFloats(w);
  }
  return lin;
}

Status CpuForward::Impl::LoadBlock(const std::string& p, const LayerPlan& plan, int experts,
                                   int top_k, Layer* out) {
  Layer& L = *out;
  L.attn_norm = DecodeFloats(T(p + "attn_norm.weight"));
  L.ffn_norm = DecodeFloats(T(p + "ffn_norm.weight"));
  L.hc_attn_fn = DecodeFloats(T(p + "hc_attn_fn"));
  L.hc_attn_base = DecodeFloats(T(p + "hc_attn_base"));
  L.hc_attn_scale = DecodeFloats(T(p + "hc_attn_scale"));
  L.hc_ffn_fn = DecodeFloats(T(p + "hc_ffn_fn"));
  L.hc_ffn_base = DecodeFloats(T(p + "hc_ffn_base"));
  L.hc_ffn_scale = DecodeFloats(T(p + "hc_ffn_scale"));
  L.attn_sink = DecodeFloats(T(p + "attn.attn_sink"));
  L.wq_a = Lin(p + "attn.wq_a");
  L.wq_b = Lin(p + "attn.wq_b");
  L.wkv = Lin(p + "attn.wkv");
  L.wo_b = Lin(p + "attn.wo_b");
  L.q_norm = DecodeFloats(T(p + "attn.q_norm.weight"));
  L.kv_norm = DecodeFloats(T(p + "attn.kv_norm.weight"));
  // The release stores wo_a as FP8 and the reference runs it dequantized in BF16 (exact): the
  // ops take its codes and scales as they are (kFp8Dense), never a widened copy.
  L.wo_a = Lin(p + "attn.wo_a");
  if (plan.is_kv_source) {
    L.comp_wkv = Lin(p + "attn.compressor.wkv");
    if (plan.compress_ratio > 1) L.comp_wgate = Lin(p + "attn.compressor.wgate");
    L.comp_norm = DecodeFloats(T(p + "attn.compressor.norm.weight"));
  }
  if (plan.is_index_source) {
    L.idx_wq_b = Lin(p + "attn.indexer.wq_b");
    L.idx_weights_proj = Lin(p + "attn.indexer.weights_proj");
    if (plan.owns_index_keys) {
      L.idx_wk = Lin(p + "attn.indexer.wk");
      L.idx_k_norm = DecodeFloats(T(p + "attn.indexer.k_norm.weight"));
    }
  }
  L.gate_w = DecodeFloats(T(p + "ffn.gate.weight"));
  L.gate_bias = DecodeFloats(T(p + "ffn.gate.bias"));
  L.top_k = top_k;
  for (int e = 0; e < experts; ++e) {
    const std::string x = p + "ffn.experts." + std::to_string(e) + ".";
    L.experts.push_back({Lin(x + "w1"), Lin(x + "w2"), Lin(x + "w3")});
  }
  L.grouped = GroupedOf(L.experts);
  L.shared = {Lin(p + "ffn.shared_experts.w1"), Lin(p + "ffn.shared_experts.w2"),
              Lin(p + "ffn.shared_experts.w3")};
  if (plan.engram_index >= 0) {
    L.engram_rows = T(p + "engram.embed.weight").data;
    L.engram_row_scales = T(p + "engram.embed.scale").data;
    L.engram_wkv = Lin(p + "engram.wkv");
    std::vector<float> q = DecodeFloats(T(p + "engram.q_weight"));
    std::vector<float> kw = DecodeFloats(T(p + "engram.k_weight"));
    L.engram_qk.resize(q.size());
    for (size_t i = 0; i < q.size(); ++i) L.engram_qk[i] = q[i] * kw[i];
  }
  L.freqs.resize(static_cast<size_t>(c.qk_rope_head_dim / 2));
  if (plan.compress_ratio > 0) {
    k::RopeFrequencies(static_cast<int>(c.qk_rope_head_dim),
                       c.rope_scaling.original_max_position_embeddings, c.compress_rope_theta,
                       c.rope_scaling.factor, c.rope_scaling.beta_fast, c.rope_scaling.beta_slow,
                       L.freqs.data());
  } else {
    k::RopeFrequencies(static_cast<int>(c.qk_rope_head_dim), 0, c.rope_theta, 1, 0, 0,
                       L.freqs.data());
  }
  return Status::Ok();
}

// The DSpark stages (mtp.*) after the backbone's layers, and the drafter's heads.
Status CpuForward::Impl::EnableDSpark() {
  if (dspark) return Status::Ok();
  if (c.num_nextn_predict_layers <= 0) {
    return FailedPrecondition(
        "DSpark: config.json names no draft stages (num_nextn_predict_layers)");
  }
  const std::string last = "mtp." + std::to_string(c.num_nextn_predict_layers - 1) + ".";
  if (!model->weights().dspark) {
    return FailedPrecondition("DSpark: the checkpoint lacks " +
                              std::to_string(model->weights().dspark_missing) +
                              " of the drafter's tensors (mtp.*)");
  }
  auto d = std::make_unique<DSparkWeights>();
  d->stages = c.num_nextn_predict_layers;
  d->block = c.dspark_block_size;
  d->noise = static_cast<int32_t>(c.dspark_noise_token_id);
  d->targets = c.dspark_target_layer_ids;
  d->rank = c.dspark_markov_rank;
  d->main_proj = Lin("mtp.0.main_proj");
  d->main_norm = DecodeFloats(T("mtp.0.main_norm.weight"));
  d->norm = DecodeFloats(T(last + "norm.weight"));
  d->markov_embed = DecodeFloats(T(last + "markov_head.embed.weight"));
  d->markov_head = DecodeFloats(T(last + "markov_head.head.weight"));
  d->confidence = DecodeFloats(T(last + "confidence_head.proj.weight"));
  std::vector<Layer> stages(static_cast<size_t>(d->stages));
  for (int s = 0; s < d->stages; ++s) {
    FLASHD_RETURN_IF_ERROR(LoadBlock("mtp." + std::to_string(s) + ".", kDraftLayerPlan,
                                     c.dspark_n_routed_experts, c.dspark_num_experts_per_tok,
                                     &stages[s]));
  }
  layers.resize(static_cast<size_t>(c.num_hidden_layers));
  for (Layer& L : stages) layers.push_back(std::move(L));
  dspark = std::move(d);
  return Status::Ok();
}

Status CpuForward::Impl::Prepare(const Model& m, const std::string& tokenizer_json) {
  model = &m;
  c = m.config();
  embed = DecodeFloats(T("embed.weight"));
  head = DecodeFloats(T("head.weight"));
  final_norm = DecodeFloats(T("norm.weight"));
  layers.resize(c.num_hidden_layers);
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    FLASHD_RETURN_IF_ERROR(LoadBlock("layers." + std::to_string(l) + ".", c.layers[l],
                                     c.n_routed_experts, c.num_experts_per_tok, &layers[l]));
  }
  FLASHD_ASSIGN_OR_RETURN(KvBlockLayout block_layout, KvBlockLayout::For(c, block_tokens));
  layout = std::make_shared<const KvBlockLayout>(std::move(block_layout));
  pool = std::make_shared<KvPool>(layout->block_bytes, std::numeric_limits<size_t>::max());
  blocks = std::make_unique<BlockManager>(pool);
  if (!c.engram_layer_ids.empty()) {
    std::string path = tokenizer_json;
    if (path.empty()) path = (std::filesystem::path(m.dir()) / "tokenizer.json").string();
    FLASHD_ASSIGN_OR_RETURN(CompressedVocab vocab, BuildCompressedVocab(path));
    if (vocab.classes != c.engram_compressed_vocab_size) {
      return FailedPrecondition(path + ": the tokenizer normalises to " +
                                std::to_string(vocab.classes) +
                                " Engram classes, but config.json's engram_compressed_vocab_size "
                                "is " +
                                std::to_string(c.engram_compressed_vocab_size) +
                                ": every Engram hash would differ from training");
    }
    engram = std::make_unique<EngramHasher>(c, std::move(vocab));
  }
  return Status::Ok();
}

namespace {

// One forward call: the plan, the batch's activations, and each sequence's state as the call
// leaves it, staged here and applied to the sequences only when every op has succeeded.
class Step {
 public:
  Step(const CpuForward::Impl& m, std::span<BatchItem> items, const ForwardOptions& options,
       ForwardPlan plan)
      : m_(m),
        b_(m.backends[0].get()),
        c_(m.c),
        items_(items),
        options_(options),
        plan_(std::move(plan)) {
    stream_.threads = options.threads;
  }

  ~Step();
  Step(const Step&) = delete;
  Step& operator=(const Step&) = delete;

  Status Run();
  // A DSpark draft block per sequence (the plan CpuForward::Draft makes): the stages, the head,
  // the Markov head and the confidence. Changes no state.
  Status RunDraft(std::span<DraftItem> drafts);
  void SetWindowLast(std::vector<int64_t> last) { window_last_ = std::move(last); }
  // Applies the staged state; keep[i] of item i's tokens (all of them when keep is empty).
  void Commit(const std::vector<int64_t>& keep = {});

 private:
  size_t n() const { return plan_.rows(); }
  // y = lin(x) as the Linear op gives it; round_output: then rounded to BF16 (in the same op).
  Status Apply(const Linear& lin, const float* x, int64_t rows, float* y,
               bool round_output = false);
  // x's codes where the op that made x wrote them (RmsNormParams::codes), each buffer a kept
  // vector of floats holding the bytes: a Linear of x reads them (LinearParams::x_quantized).
  struct XCodes {
    std::vector<float> codes, scales;
    XCodes() = default;
    XCodes(int64_t rows, int64_t in) { Size(rows, in); }
    void Size(int64_t rows, int64_t in) {
      codes.resize(static_cast<size_t>((rows * in + 3) / 4));
      scales.resize(static_cast<size_t>((rows * in / 32 + 3) / 4));
    }
    uint8_t* Codes() { return reinterpret_cast<uint8_t*>(codes.data()); }
    uint8_t* Scales() { return reinterpret_cast<uint8_t*>(scales.data()); }
  };
  // y = lin(x), and each of `more` (a linear, its output) of the same x: one op where they share
  // lin's format and inputs (x quantized once), else an op each; with `codes`, x's codes (the
  // quantized formats read them and quantize nothing).
  // With `rope`, lin's y then rotated (its rope_dim, head_dim, positions and freqs; `more`'s
  // are not).
  Status ApplyAll(const Linear& lin, const float* x, int64_t rows, float* y, bool round_output,
                  const std::vector<std::pair<const Linear*, float*>>& more,
                  XCodes* codes = nullptr, const kernels::RopeParams* rope = nullptr);
  Status Engram(int l);
  void StartEngramReads();
  void ReadEngramRows(size_t e);
  Status Attention(int l);
  Status QueriesAndWindow(int l, std::vector<float>* qr, std::vector<float>* q,
                          std::vector<float>* kv, std::vector<float>* iq);
  Status Attend(int l, const std::vector<float>& q, const std::vector<float>& kv,
                std::vector<float>* o);
  Status Output(int l, const std::vector<float>& o);
  Status Compress(int l, const float* kvp, const float* score);
  Status Index(int l, float* iq, const float* weights);
  Status Moe(int l);
  // route: the routing, made here with the grouping in one op (else chosen and weights hold
  // its choices already). With `shared` (the shared expert's output), sub_ = BF16(y + shared) in
  // the combine's op.
  Status GroupedExperts(const Layer& L, const kernels::MoeRouteParams* route,
                        const std::vector<int64_t>& chosen, const std::vector<float>& weights,
                        std::vector<float>& y, const float* shared = nullptr);
  Status Embed();
  Status Collapse(const float* weights, const std::vector<float>& norm);
  Status Expand();
  // X_ made current: the last sublayer's expansion made when it is pending (RunBlock leaves it to
  // the next sublayer's mixes, which make it in their op).
  Status Expanded();
  Status RunBlock(int l, bool record);
  void RecordHidden(int target);
  Status SeedDrafts();
  Status WindowKeys(const Layer& L, const float* x, int64_t rows, const int64_t* positions,
                    std::vector<float>* kv);
  Status NormWindowKeys(const Layer& L, int64_t rows, const int64_t* positions, float* kv);
  kernels::RmsNormParams WindowKeysNorm(const Layer& L, int64_t rows, const int64_t* positions,
                                        float* kv) const;
  Status Force(int layer);
  Status Truncate(size_t keep);
  Status Logits();

  // Activations kept on the backends' devices between ops (Backend::Keep): the step's own
  // streams from Embed to the end, a function's own vectors while it runs (Kept). Only the
  // current backend's device copies can be newer than the host; Use settles both backends when
  // another takes over, and every host read or write of a kept buffer says so (ToHost,
  // HostWrote).
  class Kept;
  // Keeps `v` (when not empty) on every backend and notes its address in `kept`; Release gives
  // back every buffer `kept` notes.
  // (Vectors of other 4- or 8-byte values too: expert ids and rows.)
  // `content` (Backend::Keep): a number naming v's bytes across steps, or 0.
  template <class T>
  void Keep(std::vector<T>* v, KeepAs as, std::vector<const float*>* kept, uint64_t content = 0);
  void Release(std::vector<const float*>* kept);
  void KeepStreams(bool fresh);
  void ReleaseStreams();
  template <class T>
  Status ToHost(const std::vector<T>& v);
  Status HostWrote(const std::vector<float>& v);
  Status Use(const Backend* b);

  const CpuForward::Impl& m_;
  const Backend* b_;  // The current layer's backend (the first for the embedding).
  const ModelConfig& c_;
  std::span<BatchItem> items_;
  const ForwardOptions& options_;
  ForwardPlan plan_;
  kernels::CpuStream stream_;
  std::vector<uint8_t> xq_, xs_;      // The linear layers' quantized inputs.
  void QuantScratch(int64_t values);  // xq_ and xs_ for at least `values` inputs.
  std::vector<float> X_, next_, x_, sub_, mixes_, pre_mix_, pre_a_, pre_f_, post_, comb_;
  // x_'s codes, made by the collapse before each sublayer (where the hidden size is in whole
  // 32-blocks), which the sublayer's quantized linears read (LinearParams::x_quantized): the
  // sublayers run right after it. CollapseCodes() is null where there are none.
  XCodes x_codes_;
  XCodes* CollapseCodes() { return x_codes_.codes.empty() ? nullptr : &x_codes_; }
  // The indexer's picks as the last indexing layer left them: per row index_topk compressed
  // entries, ascending, -1 after (TopKParams::ascending), made at picks_ratio_'s compression.
  // Kept with the streams, so that on a GPU the attention reads them where the indexer made them
  // and the host never waits for them. Empty when the model has no indexer; picks_ratio_ 0 until
  // an indexing layer of the step has run.
  std::vector<int64_t> picks_;
  int64_t picks_ratio_ = 0;
  std::vector<std::vector<char>> candidates_;  // Per row: the candidate filter's choice.
  // The candidate filter's mask where it was made ([rows, candidates_stride_] bytes in floats'
  // storage, kept), while the host's candidates_ are not filled in (candidates_on_device_): the
  // layers that use it read it there when their rows are the filter's (one chunk, the same
  // compression), and the host gets it (CandidatesToHost) only for anything else.
  std::vector<float> candidates_mask_;
  std::vector<const float*> candidates_kept_;  // It, as kept (released before the last Settle).
  bool candidates_on_device_ = false;
  int64_t candidates_stride_ = 0, candidates_ratio_ = 0;
  Status CandidatesToHost();
  // Staged per segment: compressor state by layer, entries by layer, the window rows written.
  std::vector<std::vector<SequenceState::Compressor>> compressors_;
  struct RingRows {
    int64_t first_position = 0;
    std::vector<float> rows;  // FP8 round-tripped, [count, head_dim]
  };
  std::vector<std::vector<RingRows>> ring_rows_;  // [segment][layer]
  // Those rows as the layers make them, kept where they are made until the step's end (one
  // wait for all layers): [layer][segment's rows from ring_stage_at_[segment]][head_dim], each
  // segment's ring_keep_[segment] rows.
  std::vector<float> ring_stage_;
  std::vector<size_t> ring_keep_, ring_stage_at_;
  size_t ring_stage_rows_ = 0;
  // DSpark: the target layers' attention inputs (hc mean) of each segment's last rows, and the
  // stage window rows made from them.
  struct Hidden {
    int64_t first_position = 0;
    size_t count = 0;
    std::vector<float> rows;  // [count, targets * dim]
  };
  std::vector<Hidden> hidden_;
  std::vector<std::vector<RingRows>> draft_rows_;  // [segment][stage]
  // For items committing part of their tokens: the compressor inputs by segment and layer.
  struct CompressorRows {
    std::vector<float> kv, score;
  };
  std::vector<std::vector<CompressorRows>> compressor_rows_;
  bool draft_ = false;
  // The last sublayer's output not yet expanded into X_ (Expanded).
  bool expand_pending_ = false;
  std::vector<int64_t> window_last_;  // Draft blocks: every query sees the whole block.
  // Engram rows from the SSD store, gathered ahead: per Engram layer, the step's distinct ids,
  // each of the step's ids as its row in the layer's small table, and when it is ready. One
  // thread reads the layers in order from the step's start, while the layers before each one
  // compute.
  struct EngramRows {
    std::vector<int64_t> distinct;
    std::vector<int64_t> renumbered;  // [rows, columns]; follows the step's rows (Truncate).
    std::vector<uint8_t> table, scales;
    std::promise<Status> read;
    std::future<Status> ready;
  };
  std::vector<EngramRows> engram_gathered_;
  // GroupedExperts' slots and grouped rows (their ints, then their floats).
  struct GroupedRows {
    std::array<std::vector<int64_t>, 4> ints;
    std::array<std::vector<float>, 5> floats;
    XCodes h_codes;  // The SwiGLU's rows' codes, made by the gated op for w2.
  };
  GroupedRows grouped_;
  std::vector<const float*> streams_kept_;  // KeepStreams' buffers, as kept.
  std::vector<const float*> state_kept_;    // The compressors' partial groups, as kept.
  // The partial groups the commit named: by host address, their content (Backend::Release)
  // and the backend whose ops wrote them (their layer's), the one that may keep its copy.
  struct Named {
    uint64_t content;
    const Backend* backend;
  };
  std::map<const float*, Named> named_;
  std::future<void> engram_reader_;  // Declared last: joined before anything it writes goes.
};

// A function's own activation vectors kept on the step's backends until it returns (empty ones
// are not). Made once the vectors have their sizes; each is released at the address it was kept
// at, so a vector that moved anyway leaves no stale entry.
class Step::Kept {
 public:
  template <class T>
  Kept(Step* step, std::initializer_list<std::vector<T>*> vectors, KeepAs as = KeepAs::kUnwritten)
      : step_(step) {
    for (std::vector<T>* v : vectors) step_->Keep(v, as, &kept_);
  }
  ~Kept() { step_->Release(&kept_); }
  Kept(const Kept&) = delete;
  Kept& operator=(const Kept&) = delete;

 private:
  Step* step_;
  std::vector<const float*> kept_;
};

// A step that failed part-way still leaves the KV rows it wrote on the host.
Step::~Step() {
  ReleaseStreams();
  Release(&candidates_kept_);
  (void)b_->Settle();
  Release(&state_kept_);
}

template <class T>
void Step::Keep(std::vector<T>* v, KeepAs as, std::vector<const float*>* kept, uint64_t content) {
  static_assert(sizeof(T) % sizeof(float) == 0);
  if (v->empty()) return;
  float* host = reinterpret_cast<float*>(v->data());
  for (const auto& b : m_.backends) {
    b->Keep(host, v->size() * (sizeof(T) / sizeof(float)), as, content);
  }
  kept->push_back(host);
}

void Step::Release(std::vector<const float*>* kept) {
  for (const float* p : *kept) {
    const auto named = named_.find(p);
    for (const auto& b : m_.backends) {
      const bool keeps = named != named_.end() && named->second.backend == b.get();
      b->Release(p, keeps ? named->second.content : 0);
    }
  }
  kept->clear();
}

// The contents of a compressor's two partial groups (Backend::Keep), from its version.
uint64_t PartialContent(const SequenceState::Compressor& comp, int which) {
  return comp.version == 0 ? 0 : 2 * comp.version + static_cast<uint64_t>(which);
}

// The step's streams and mixes; `fresh` when no op has written them yet (X_ and pre_mix_ hold
// host values after a truncation).
void Step::KeepStreams(bool fresh) {
  ReleaseStreams();
  for (std::vector<float>* v : {&X_, &next_, &x_, &sub_, &mixes_, &pre_a_, &pre_f_, &post_, &comb_,
                                &pre_mix_, &x_codes_.codes, &x_codes_.scales}) {
    const bool host_values = v == &pre_mix_ || (!fresh && v == &X_);
    Keep(v, host_values ? KeepAs::kHostBytes : KeepAs::kUnwritten, &streams_kept_);
  }
  Keep(&picks_, fresh ? KeepAs::kUnwritten : KeepAs::kHostBytes, &streams_kept_);
}

void Step::ReleaseStreams() { Release(&streams_kept_); }

template <class T>
Status Step::ToHost(const std::vector<T>& v) {
  return Check(
      b_->ToHost(reinterpret_cast<const float*>(v.data()), v.size() * (sizeof(T) / sizeof(float))),
      "ToHost");
}

Status Step::HostWrote(const std::vector<float>& v) {
  return Check(b_->HostWrote(v.data(), v.size()), "HostWrote");
}

// The backend leaving brings its newer device bytes to the host; the one coming starts from the
// host's (what it holds from before, or never wrote, may be out of date).
Status Step::Use(const Backend* b) {
  if (b == b_) return Status::Ok();
  FLASHD_RETURN_IF_ERROR(Check(b_->Settle(), "Settle"));
  FLASHD_RETURN_IF_ERROR(Check(b->Settle(), "Settle"));
  b_ = b;
  return Status::Ok();
}

void Step::QuantScratch(int64_t values) {
  const size_t need = static_cast<size_t>(values);
  if (xq_.size() >= need) return;
  xq_.resize(need);
  xs_.resize(need / 32);
}

Status Step::Apply(const Linear& lin, const float* x, int64_t rows, float* y, bool round_output) {
  return ApplyAll(lin, x, rows, y, round_output, {});
}

Status Step::ApplyAll(const Linear& lin, const float* x, int64_t rows, float* y, bool round_output,
                      const std::vector<std::pair<const Linear*, float*>>& more, XCodes* codes,
                      const kernels::RopeParams* rope) {
  const bool quantized = QuantizedFormat(lin.format);
  const bool dense = lin.format == kernels::WeightFormat::kDense;
  bool together = more.empty() || ((quantized || dense) &&
                                   static_cast<int64_t>(more.size()) <= kernels::kLinearMaxAlso);
  for (const auto& [other, out] : more) {
    together = together && other->format == lin.format && other->in == lin.in;
  }
  if (!together) {
    FLASHD_RETURN_IF_ERROR(ApplyAll(lin, x, rows, y, round_output, {}, codes, rope));
    for (const auto& [other, out] : more) {
      FLASHD_RETURN_IF_ERROR(
          ApplyAll(*other, x, rows, out, round_output, {}, other->in == lin.in ? codes : nullptr));
    }
    return Status::Ok();
  }
  std::vector<kernels::LinearProjection> also;
  for (const auto& [other, out] : more) {
    also.push_back({.w = other->w,
                    .w_scales = other->s,
                    .dense = other->dense.data(),
                    .out = other->out,
                    .y = out});
  }
  const bool given = quantized && codes != nullptr;
  if (!dense && !given) QuantScratch(rows * lin.in);
  FLASHD_OP(Linear, {.x = x,
                     .rows = rows,
                     .in = lin.in,
                     .out = lin.out,
                     .format = lin.format,
                     .w = lin.w,
                     .w_scales = lin.s,
                     .dense = lin.dense.data(),
                     .x_codes = given ? codes->Codes() : xq_.data(),
                     .x_scales = given ? codes->Scales() : xs_.data(),
                     .y = y,
                     .stream = &stream_,
                     .x_quantized = given,
                     .round_output = round_output,
                     .also = also.empty() ? nullptr : also.data(),
                     .also_count = static_cast<int64_t>(also.size()),
                     .rope_dim = rope != nullptr ? rope->rope_dim : 0,
                     .rope_head_dim = rope != nullptr ? rope->head_dim : 0,
                     .rope_positions = rope != nullptr ? rope->positions : nullptr,
                     .rope_freqs = rope != nullptr ? rope->freqs : nullptr});
  return Status::Ok();
}

// The plan's tokens embedded into hc copies, the first copy's pre-mix, the step's buffers.
Status Step::Embed() {
  const int64_t dim = c_.hidden_size, hc = c_.hc_mult;
  const size_t rows = n();
  ReleaseStreams();
  expand_pending_ = false;
  X_.resize(rows * hc * dim);
  next_.resize(X_.size());
  pre_mix_.assign(rows * hc, 0.0f);
  for (size_t t = 0; t < rows; ++t) pre_mix_[t * hc] = 1.0f;
  picks_.assign(c_.index_source_layer_ids.empty() ? 0 : rows * static_cast<size_t>(c_.index_topk),
                -1);
  picks_ratio_ = 0;
  candidates_.assign(rows, {});
  candidates_on_device_ = false;
  x_.resize(rows * dim);
  x_codes_.Size(dim % 32 == 0 ? static_cast<int64_t>(rows) : 0, dim);
  sub_.resize(rows * dim);
  mixes_.resize(rows * (2 + hc) * hc);
  pre_a_.resize(rows * hc);
  pre_f_.resize(rows * hc);
  post_.resize(rows * hc);
  comb_.resize(rows * hc * hc);
  KeepStreams(true);
  FLASHD_OP(Embed, {.tokens = plan_.tokens.data(),
                    .count = static_cast<int64_t>(rows),
                    .hc = hc,
                    .dim = dim,
                    .vocab = c_.vocab_size,
                    .embed = m_.embed.data(),
                    .X = X_.data()});
  return Status::Ok();
}

Status Step::Run() {
  const size_t rows = n();
  StartEngramReads();
  FLASHD_RETURN_IF_ERROR(Embed());
  compressors_.resize(plan_.segments.size());
  ring_rows_.assign(plan_.segments.size(), std::vector<RingRows>(c_.num_hidden_layers));
  ring_keep_.assign(plan_.segments.size(), 0);
  ring_stage_at_.assign(plan_.segments.size(), 0);
  ring_stage_rows_ = 0;
  for (size_t i = 0; i < plan_.segments.size(); ++i) {
    ring_keep_[i] =
        std::min<size_t>(plan_.segments[i].count, static_cast<size_t>(c_.sliding_window));
    ring_stage_at_[i] = ring_stage_rows_;
    ring_stage_rows_ += ring_keep_[i];
  }
  ring_stage_.resize(static_cast<size_t>(c_.num_hidden_layers) * ring_stage_rows_ *
                     static_cast<size_t>(c_.head_dim));
  Keep(&ring_stage_, KeepAs::kUnwritten, &state_kept_);
  for (size_t i = 0; i < items_.size(); ++i) compressors_[i] = items_[i].state->sources;
  // The compressors' partial groups stay on the device through the step (until the Settle at
  // its end); the vectors keep their buffers when the commit moves them into the states, which
  // names them (named_) so that a backend may keep them there for the next step.
  for (std::vector<SequenceState::Compressor>& sources : compressors_) {
    for (SequenceState::Compressor& comp : sources) {
      Keep(&comp.kv_partial, KeepAs::kHostBytes, &state_kept_, PartialContent(comp, 0));
      Keep(&comp.score_partial, KeepAs::kHostBytes, &state_kept_, PartialContent(comp, 1));
    }
  }
  if (options_.trace != nullptr) {
    for (size_t t = 0; t < rows; ++t) {
      options_.trace->engram_rows.emplace_back(
          plan_.engram_rows.begin() + t * plan_.engram_stride,
          plan_.engram_rows.begin() + (t + 1) * plan_.engram_stride);
    }
  }
  int last_kv_source = -1;
  for (int l = 0; l < c_.num_hidden_layers; ++l) {
    if (c_.layers[l].is_kv_source) last_kv_source = l;
  }
  const bool record = options_.trace != nullptr && options_.trace->record_streams;
  for (int l = 0; l < c_.num_hidden_layers; ++l) {
    FLASHD_RETURN_IF_ERROR(Use(m_.LayerBackend(l)));
    if (options_.forced_streams != nullptr && l > 0) FLASHD_RETURN_IF_ERROR(Force(l - 1));
    if (c_.layers[l].engram_index >= 0) {
      FLASHD_RETURN_IF_ERROR(Expanded());
      FLASHD_RETURN_IF_ERROR(Engram(l));
    }
    if (m_.dspark) {
      const std::vector<int>& targets = m_.dspark->targets;
      const auto it = std::find(targets.begin(), targets.end(), l);
      if (it != targets.end()) {
        FLASHD_RETURN_IF_ERROR(Expanded());
        FLASHD_RETURN_IF_ERROR(ToHost(X_));
        RecordHidden(static_cast<int>(it - targets.begin()));
      }
    }
    FLASHD_RETURN_IF_ERROR(RunBlock(l, record));
    if (record) {
      FLASHD_RETURN_IF_ERROR(Expanded());
      FLASHD_RETURN_IF_ERROR(ToHost(X_));
      options_.trace->streams.push_back(X_);
    }
    if (l == last_kv_source && options_.replay_tokens > 0) {
      FLASHD_RETURN_IF_ERROR(Expanded());
      FLASHD_RETURN_IF_ERROR(Truncate(
          static_cast<size_t>(std::max<int64_t>(options_.replay_tokens, c_.sliding_window))));
    }
  }
  if (m_.dspark) FLASHD_RETURN_IF_ERROR(SeedDrafts());
  if (options_.forced_streams != nullptr) {
    FLASHD_RETURN_IF_ERROR(Force(c_.num_hidden_layers - 1));
  }
  FLASHD_RETURN_IF_ERROR(Collapse(pre_mix_.data(), m_.final_norm));
  FLASHD_RETURN_IF_ERROR(Logits());
  // The host's KV blocks and staged state (compressor groups, window rows) up to date for the
  // commit and the prefix cache; the streams and the candidate mask are done with.
  ReleaseStreams();
  candidates_on_device_ = false;
  Release(&candidates_kept_);
  FLASHD_RETURN_IF_ERROR(Check(b_->Settle(), "Settle"));
  const size_t hd = static_cast<size_t>(c_.head_dim);
  for (size_t i = 0; i < ring_rows_.size(); ++i) {
    for (size_t l = 0; l < ring_rows_[i].size(); ++l) {
      const float* at = &ring_stage_[(l * ring_stage_rows_ + ring_stage_at_[i]) * hd];
      ring_rows_[i][l].rows.assign(at, at + ring_keep_[i] * hd);
    }
  }
  return Status::Ok();
}

// One block (a backbone layer or a DSpark stage): attention, then the MoE, each between the
// hyper-connection mixes.
Status Step::RunBlock(int l, bool record) {
  const Layer& L = m_.layers[l];
  const int64_t dim = c_.hidden_size, hc = c_.hc_mult;
  const float eps = static_cast<float>(c_.rms_norm_eps);
  // The step before a sublayer, one op: the last sublayer's expansion when it is pending (nothing
  // came between), the mixes (pre into `pre`), and the collapse with `weights` and `norm`.
  auto between = [&](const std::vector<float>& fn, const std::vector<float>& scale,
                     const std::vector<float>& base, float* pre, const float* weights,
                     const std::vector<float>& norm) {
    kernels::HcMixParams p{.X = X_.data(),
                           .rows = static_cast<int64_t>(n()),
                           .hc = hc,
                           .dim = dim,
                           .fn = fn.data(),
                           .scale = scale.data(),
                           .base = base.data(),
                           .iters = c_.hc_sinkhorn_iters,
                           .hc_eps = static_cast<float>(c_.hc_eps),
                           .norm_eps = eps,
                           .mixes = mixes_.data(),
                           .pre = pre,
                           .post = post_.data(),
                           .comb = comb_.data(),
                           .stream = &stream_,
                           .collapse_weights = weights,
                           .collapse_norm = norm.empty() ? nullptr : norm.data(),
                           .collapse_eps = eps,
                           .x = x_.data()};
    // x's codes for the sublayer's quantized linears (wq_a and its pair, the shared expert's).
    if (CollapseCodes() != nullptr) {
      p.x_codes = x_codes_.Codes();
      p.x_code_scales = x_codes_.Scales();
    }
    if (expand_pending_) {
      p.sub = sub_.data();
      p.expand_post = post_.data();
      p.expand_comb = comb_.data();
      p.expanded = next_.data();
    }
    FLASHD_RETURN_IF_ERROR(Check(b_->HcMix(p), "HcMix"));
    if (expand_pending_) {
      X_.swap(next_);
      expand_pending_ = false;
    }
    return Status::Ok();
  };
  // Attention sublayer: its mixes give post/comb now and the FFN's pre.
  FLASHD_RETURN_IF_ERROR(between(L.hc_attn_fn, L.hc_attn_scale, L.hc_attn_base, pre_a_.data(),
                                 pre_mix_.data(), L.attn_norm));
  FLASHD_RETURN_IF_ERROR(Attention(l));
  if (record) {
    FLASHD_RETURN_IF_ERROR(ToHost(x_));
    FLASHD_RETURN_IF_ERROR(ToHost(sub_));
    options_.trace->sublayers.push_back(x_);
    options_.trace->sublayers.push_back(sub_);
  }
  expand_pending_ = true;
  // FFN sublayer: collapses with the attention's pre; its own pre goes to the next layer.
  FLASHD_RETURN_IF_ERROR(between(L.hc_ffn_fn, L.hc_ffn_scale, L.hc_ffn_base, pre_f_.data(),
                                 pre_a_.data(), L.ffn_norm));
  FLASHD_RETURN_IF_ERROR(Moe(l));
  if (record) {
    FLASHD_RETURN_IF_ERROR(ToHost(x_));
    FLASHD_RETURN_IF_ERROR(ToHost(sub_));
    options_.trace->sublayers.push_back(x_);
    options_.trace->sublayers.push_back(sub_);
  }
  // The FFN's expansion waits for the next mixes (or Expanded); its pre is the next layer's, and
  // pre_f_ is written again before it is read.
  expand_pending_ = true;
  pre_mix_.swap(pre_f_);
  return Status::Ok();
}

Status Step::RunDraft(std::span<DraftItem> drafts) {
  const DSparkWeights& d = *m_.dspark;
  const int64_t dim = c_.hidden_size, V = c_.vocab_size;
  const size_t rows = n();
  draft_ = true;
  FLASHD_RETURN_IF_ERROR(Use(m_.LayerBackend(c_.num_hidden_layers - 1)));
  FLASHD_RETURN_IF_ERROR(Embed());
  for (int st = 0; st < d.stages; ++st) {
    FLASHD_RETURN_IF_ERROR(RunBlock(c_.num_hidden_layers + st, false));
  }
  // The stages' output collapsed (kept for the confidence head), normed, through the head.
  FLASHD_RETURN_IF_ERROR(Collapse(pre_mix_.data(), {}));
  FLASHD_RETURN_IF_ERROR(ToHost(x_));
  const std::vector<float> hidden = x_;
  FLASHD_OP(RmsNorm, {.x = x_.data(),
                      .rows = static_cast<int64_t>(rows),
                      .dim = dim,
                      .stride = dim,
                      .weight = d.norm.data(),
                      .eps = static_cast<float>(c_.rms_norm_eps)});
  // Position by position: the confidence of [hidden, Markov embedding of the token before],
  // whether to go on, the head's logits, the Markov head's bias, the pick.
  const int64_t rank = d.rank, B = d.block;
  std::vector<float> logits(static_cast<size_t>(V)), bias(static_cast<size_t>(V));
  std::vector<float> joint(static_cast<size_t>(dim + rank));
  for (size_t i = 0; i < drafts.size(); ++i) {
    DraftItem& item = drafts[i];
    item.drafted->clear();
    item.confidence->clear();
    const int64_t limit = item.limit > 0 ? std::min(item.limit, B) : B;
    int32_t prev = item.token;
    for (int64_t j = 0; j < limit; ++j) {
      const size_t row = plan_.segments[i].offset + static_cast<size_t>(j);
      const float* emb = &d.markov_embed[static_cast<size_t>(prev) * rank];
      std::copy_n(&hidden[row * dim], dim, joint.begin());
      std::copy_n(emb, rank, joint.begin() + dim);
      float conf = 0;
      FLASHD_OP(Linear, {.x = joint.data(),
                         .rows = 1,
                         .in = dim + rank,
                         .out = 1,
                         .dense = d.confidence.data(),
                         .y = &conf,
                         .stream = &stream_});
      if (j > 0 && conf < item.min_confidence) break;
      FLASHD_OP(Linear, {.x = &x_[row * dim],
                         .rows = 1,
                         .in = dim,
                         .out = V,
                         .dense = m_.head.data(),
                         .y = logits.data(),
                         .stream = &stream_});
      FLASHD_OP(Linear, {.x = emb,
                         .rows = 1,
                         .in = rank,
                         .out = V,
                         .dense = d.markov_head.data(),
                         .y = bias.data(),
                         .stream = &stream_});
      for (int64_t v = 0; v < V; ++v) logits[v] += bias[v];
      item.confidence->push_back(conf);
      prev = item.pick(j, std::span<const float>(logits.data(), static_cast<size_t>(V)));
      if (prev < 0 || prev >= V) return InvalidArgument("draft: a pick outside the vocabulary");
      item.drafted->push_back(prev);
    }
  }
  return Status::Ok();
}

Status Step::Collapse(const float* weights, const std::vector<float>& norm) {
  FLASHD_RETURN_IF_ERROR(Expanded());
  FLASHD_OP(HcCollapse, {.X = X_.data(),
                         .weights = weights,
                         .rows = static_cast<int64_t>(n()),
                         .hc = c_.hc_mult,
                         .dim = c_.hidden_size,
                         .norm_weight = norm.empty() ? nullptr : norm.data(),
                         .eps = static_cast<float>(c_.rms_norm_eps),
                         .x = x_.data()});
  return Status::Ok();
}

Status Step::Expand() {
  FLASHD_OP(HcExpand, {.X = X_.data(),
                       .sub = sub_.data(),
                       .post = post_.data(),
                       .comb = comb_.data(),
                       .rows = static_cast<int64_t>(n()),
                       .hc = c_.hc_mult,
                       .dim = c_.hidden_size,
                       .out = next_.data()});
  X_.swap(next_);
  return Status::Ok();
}

Status Step::Expanded() {
  if (!expand_pending_) return Status::Ok();
  expand_pending_ = false;
  return Expand();
}

// X = the forced output of `layer` (a batch of one; see ForwardOptions::forced_streams).
Status Step::Force(int layer) {
  FLASHD_RETURN_IF_ERROR(Expanded());
  const size_t width = static_cast<size_t>(c_.hc_mult * c_.hidden_size);
  const size_t layers = static_cast<size_t>(c_.num_hidden_layers);
  for (size_t t = 0; t < n(); ++t) {
    std::memcpy(&X_[t * width], options_.forced_streams + (t * layers + layer) * width,
                width * sizeof(float));
  }
  return HostWrote(X_);
}

// The bounded replay: only the last `keep` rows of each sequence go on. Between layers: no
// function's own vectors are kept then.
Status Step::Truncate(size_t keep) {
  FLASHD_RETURN_IF_ERROR(CandidatesToHost());  // Gathered below, by the plan's positions now.
  FLASHD_RETURN_IF_ERROR(ToHost(X_));
  FLASHD_RETURN_IF_ERROR(ToHost(pre_mix_));
  FLASHD_RETURN_IF_ERROR(ToHost(picks_));
  ReleaseStreams();
  const std::vector<size_t> kept = plan_.Truncate(keep);
  const size_t hc = static_cast<size_t>(c_.hc_mult), dim = static_cast<size_t>(c_.hidden_size);
  GatherRows(&X_, kept, hc * dim);
  GatherRows(&pre_mix_, kept, hc);
  GatherRows(&picks_, kept, static_cast<size_t>(c_.index_topk));
  GatherRows(&candidates_, kept, 1);
  if (!engram_gathered_.empty()) {
    const size_t cols = static_cast<size_t>(plan_.engram_stride) / engram_gathered_.size();
    for (EngramRows& r : engram_gathered_) GatherRows(&r.renumbered, kept, cols);
  }
  const size_t rows = kept.size();
  next_.resize(X_.size());
  x_.resize(rows * dim);
  x_codes_.Size(dim % 32 == 0 ? static_cast<int64_t>(rows) : 0, dim);
  sub_.resize(rows * dim);
  mixes_.resize(rows * (2 + hc) * hc);
  pre_a_.resize(rows * hc);
  pre_f_.resize(rows * hc);
  post_.resize(rows * hc);
  comb_.resize(rows * hc * hc);
  KeepStreams(false);
  return Status::Ok();
}

void Step::StartEngramReads() {
  if (!m_.engram_store) return;
  const size_t layers = c_.engram_layer_ids.size();
  const int64_t rows = static_cast<int64_t>(n());
  const int64_t cols = plan_.engram_stride / static_cast<int64_t>(layers);
  const size_t hdim = static_cast<size_t>(c_.engram_head_dim);
  engram_gathered_ = std::vector<EngramRows>(layers);
  for (size_t e = 0; e < layers; ++e) {
    EngramRows& r = engram_gathered_[e];
    std::unordered_map<int64_t, int64_t> index;  // Id -> its row in the table.
    r.renumbered.resize(static_cast<size_t>(rows * cols));
    for (int64_t t = 0; t < rows; ++t) {
      for (int64_t c = 0; c < cols; ++c) {
        const int64_t id = plan_.engram_rows[static_cast<size_t>(
            t * plan_.engram_stride + static_cast<int64_t>(e) * cols + c)];
        auto [it, fresh] = index.emplace(id, static_cast<int64_t>(r.distinct.size()));
        if (fresh) r.distinct.push_back(id);
        r.renumbered[static_cast<size_t>(t * cols + c)] = it->second;
      }
    }
    r.table.resize(r.distinct.size() * hdim);
    r.scales.resize(r.distinct.size() * (hdim / 32));
    r.ready = r.read.get_future();
  }
  if (!m_.engram_read_ahead) return;  // Engram(l) reads each layer's rows.
  auto read_all = [this] {
    for (size_t e = 0; e < engram_gathered_.size(); ++e) ReadEngramRows(e);
  };
  try {
    engram_reader_ = std::async(std::launch::async, read_all);
  } catch (const std::system_error&) {
    read_all();  // No thread to be had: read them now.
  }
}

void Step::ReadEngramRows(size_t e) {
  EngramRows& r = engram_gathered_[e];
  r.read.set_value(m_.engram_store->Gather(static_cast<int>(e), r.distinct.data(),
                                           r.distinct.size(), r.table.data(), r.scales.data()));
}

Status Step::Engram(int l) {
  const Layer& L = m_.layers[l];
  const int64_t rows = static_cast<int64_t>(n()), hc = c_.hc_mult, dim = c_.hidden_size;
  const int64_t cols = plan_.engram_stride / static_cast<int64_t>(c_.engram_layer_ids.size());
  const int64_t hdim = c_.engram_head_dim;
  std::vector<float> e(static_cast<size_t>(rows * cols * hdim));
  std::vector<float> kv(static_cast<size_t>(rows * dim * (hc + 1)));
  const Kept kept(this, {&kv});
  const int64_t column0 = c_.layers[l].engram_index * cols;
  if (m_.engram_store) {
    // The layer's rows, gathered ahead into a small table of the step's own (StartEngramReads);
    // the op reads that table with the ids renumbered.
    const size_t index = static_cast<size_t>(c_.layers[l].engram_index);
    const auto start = std::chrono::steady_clock::now();
    if (!m_.engram_read_ahead) ReadEngramRows(index);
    EngramRows& r = engram_gathered_[index];
    const Status read = r.ready.get();
    m_.engram_store->AddWait(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    FLASHD_RETURN_IF_ERROR(read);
    FLASHD_OP(EngramGather, {.table = r.table.data(),
                             .table_scales = r.scales.data(),
                             .row_ids = r.renumbered.data(),
                             .tokens = rows,
                             .columns = cols,
                             .head_dim = hdim,
                             .row_stride = cols,
                             .column0 = 0,
                             .out = e.data()});
  } else {
    FLASHD_OP(EngramGather, {.table = L.engram_rows,
                             .table_scales = L.engram_row_scales,
                             .row_ids = plan_.engram_rows.data(),
                             .tokens = rows,
                             .columns = cols,
                             .head_dim = hdim,
                             .row_stride = plan_.engram_stride,
                             .column0 = column0,
                             .out = e.data()});
  }
  FLASHD_RETURN_IF_ERROR(Apply(L.engram_wkv, e.data(), rows, kv.data(), true));
  FLASHD_OP(EngramGate, {.X = X_.data(),
                         .kv = kv.data(),
                         .qk = L.engram_qk.data(),
                         .tokens = rows,
                         .hc = hc,
                         .dim = dim,
                         .eps = static_cast<float>(c_.rms_norm_eps)});
  return Status::Ok();
}

// The layer's queries (low-rank projection, norm, up-projection, rotation), window keys (= values:
// normed, rotated, FP8 with a UE8M0 scale per 32) and, on an indexing layer (iq not null), the
// indexer's queries (unrotated): wq_a and wkv of the same x in one op, and wq_b and the indexer's
// wq_b of the same qr.
Status Step::QueriesAndWindow(int l, std::vector<float>* qr_out, std::vector<float>* q_out,
                              std::vector<float>* kv_out, std::vector<float>* iq) {
  const Layer& L = m_.layers[l];
  const int64_t rows = static_cast<int64_t>(n()), H = c_.num_attention_heads;
  const int64_t hd = c_.head_dim, rd = c_.qk_rope_head_dim, qlr = c_.q_lora_rank;
  const float eps = static_cast<float>(c_.rms_norm_eps);
  std::vector<float>& qr = *qr_out;
  std::vector<float>& q = *q_out;
  std::vector<float>& kv = *kv_out;
  qr.resize(static_cast<size_t>(rows * qlr));
  q.resize(static_cast<size_t>(rows * H * hd));
  kv.resize(static_cast<size_t>(rows * hd));
  FLASHD_RETURN_IF_ERROR(
      ApplyAll(L.wq_a, x_.data(), rows, qr.data(), false, {{&L.wkv, kv.data()}}, CollapseCodes()));
  // The normed latent's codes made by the norm, for wq_b (and the indexer's) to read.
  const bool coded = ReadsCodes(L.wq_b, qlr);
  XCodes codes(coded ? rows : 0, qlr);
  const Kept kept(this, {&codes.codes, &codes.scales});
  // The window keys' steps after wkv in the same op (the next norm), which also stages the rows
  // each sequence's ring keeps (its last `window`), to reach the host with the step's last Settle
  // (Run): row ring_stage_at_[i] + j of the layer's staging takes sequence i's kept row j.
  kernels::RmsNormParams keys = WindowKeysNorm(L, rows, plan_.positions.data(), kv.data());
  std::vector<int64_t> stage_rows;
  if (!draft_) {
    stage_rows.assign(static_cast<size_t>(rows), -1);
    for (size_t i = 0; i < plan_.segments.size(); ++i) {
      const ForwardPlan::Segment& sg = plan_.segments[i];
      // A truncation (a replay) keeps at least a window of every sequence's rows.
      if (ring_keep_[i] != std::min<size_t>(sg.count, static_cast<size_t>(c_.sliding_window))) {
        return Internal("window rows: a sequence's rows changed under the step");
      }
      const size_t first = sg.offset + sg.count - ring_keep_[i];
      for (size_t j = 0; j < ring_keep_[i]; ++j) {
        stage_rows[first + j] = static_cast<int64_t>(ring_stage_at_[i] + j);
      }
    }
    keys.copy_to =
        &ring_stage_[static_cast<size_t>(l) * ring_stage_rows_ * static_cast<size_t>(hd)];
    keys.copy_rows = stage_rows.data();
  }
  FLASHD_OP(RmsNorm, {.x = qr.data(),
                      .rows = rows,
                      .dim = qlr,
                      .stride = qlr,
                      .weight = L.q_norm.data(),
                      .eps = eps,
                      .round_input = true,
                      .codes = coded ? codes.Codes() : nullptr,
                      .code_scales = coded ? codes.Scales() : nullptr,
                      .next = &keys});
  std::vector<std::pair<const Linear*, float*>> more;
  if (iq != nullptr) more.push_back({&L.idx_wq_b, iq->data()});
  // The queries rotated by wq_b's op (the indexer's are not).
  const kernels::RopeParams rope{
      .head_dim = hd, .rope_dim = rd, .positions = plan_.positions.data(), .freqs = L.freqs.data()};
  if (L.wq_b.out != H * hd) return Internal("wq_b: its outputs are not the heads");
  FLASHD_RETURN_IF_ERROR(
      ApplyAll(L.wq_b, qr.data(), rows, q.data(), true, more, coded ? &codes : nullptr, &rope));
  return Status::Ok();
}

// Window keys (= values) of `rows` inputs: normed, rotated, FP8 with a UE8M0 scale per 32.
Status Step::WindowKeys(const Layer& L, const float* x, int64_t rows, const int64_t* positions,
                        std::vector<float>* kv_out) {
  std::vector<float>& kv = *kv_out;
  kv.resize(static_cast<size_t>(rows * c_.head_dim));
  FLASHD_RETURN_IF_ERROR(Apply(L.wkv, x, rows, kv.data()));
  return NormWindowKeys(L, rows, positions, kv.data());
}

// The window keys' steps after wkv: normed, rotated and through FP8 (blocks of 32 along each row),
// in one op.
Status Step::NormWindowKeys(const Layer& L, int64_t rows, const int64_t* positions, float* kv) {
  FLASHD_OP(RmsNorm, WindowKeysNorm(L, rows, positions, kv));
  return Status::Ok();
}

// That op's params.
kernels::RmsNormParams Step::WindowKeysNorm(const Layer& L, int64_t rows, const int64_t* positions,
                                            float* kv) const {
  const int64_t hd = c_.head_dim;
  return {.x = kv,
          .rows = rows,
          .dim = hd,
          .stride = hd,
          .weight = L.kv_norm.data(),
          .eps = static_cast<float>(c_.rms_norm_eps),
          .round_input = true,
          .rope_dim = c_.qk_rope_head_dim,
          .positions = positions,
          .freqs = L.freqs.data(),
          .fake_quant_fp8 = true};
}

// The hc mean of each segment's last rows (up to a window) entering DSpark target `target`.
void Step::RecordHidden(int target) {
  const size_t dim = static_cast<size_t>(c_.hidden_size), hc = static_cast<size_t>(c_.hc_mult);
  const size_t targets = m_.dspark->targets.size();
  if (hidden_.empty()) hidden_.resize(plan_.segments.size());
  for (size_t i = 0; i < plan_.segments.size(); ++i) {
    const ForwardPlan::Segment& sg = plan_.segments[i];
    const size_t keep = std::min<size_t>(sg.count, static_cast<size_t>(c_.sliding_window));
    const size_t first = sg.offset + sg.count - keep;
    Hidden& h = hidden_[i];
    if (h.rows.empty()) {
      h.first_position = plan_.positions[first];
      h.count = keep;
      h.rows.assign(keep * targets * dim, 0.0f);
    }
    for (size_t r = 0; r < h.count; ++r) {
      const float* X = &X_[(first + r) * hc * dim];
      float* out = &h.rows[(r * targets + static_cast<size_t>(target)) * dim];
      for (size_t d = 0; d < dim; ++d) {
        float sum = 0;
        for (size_t j = 0; j < hc; ++j) sum += X[j * dim + d];
        out[d] = k::Bf(sum / static_cast<float>(hc));
      }
    }
  }
}

// Each DSpark stage's window rows for the recorded positions: main_proj over the targets'
// inputs, its norm, then the stage's window keys.
Status Step::SeedDrafts() {
  const DSparkWeights& d = *m_.dspark;
  const int64_t dim = c_.hidden_size;
  draft_rows_.assign(plan_.segments.size(), std::vector<RingRows>(d.stages));
  if (hidden_.empty()) return Status::Ok();
  std::vector<float> in, mx;
  std::vector<int64_t> positions;
  for (const Hidden& h : hidden_) {
    in.insert(in.end(), h.rows.begin(), h.rows.end());
    for (size_t r = 0; r < h.count; ++r) positions.push_back(h.first_position + int64_t(r));
  }
  const int64_t rows = static_cast<int64_t>(positions.size());
  mx.resize(static_cast<size_t>(rows * dim));
  FLASHD_RETURN_IF_ERROR(Apply(d.main_proj, in.data(), rows, mx.data()));
  FLASHD_OP(RmsNorm, {.x = mx.data(),
                      .rows = rows,
                      .dim = dim,
                      .stride = dim,
                      .weight = d.main_norm.data(),
                      .eps = static_cast<float>(c_.rms_norm_eps),
                      .round_input = true});
  const size_t hd = static_cast<size_t>(c_.head_dim);
  for (int st = 0; st < d.stages; ++st) {
    std::vector<float> kv;
    FLASHD_RETURN_IF_ERROR(
        WindowKeys(m_.layers[c_.num_hidden_layers + st], mx.data(), rows, positions.data(), &kv));
    size_t at = 0;
    for (size_t i = 0; i < hidden_.size(); ++i) {
      RingRows& rr = draft_rows_[i][st];
      rr.first_position = hidden_[i].first_position;
      rr.rows.assign(kv.begin() + at * hd, kv.begin() + (at + hidden_[i].count) * hd);
      at += hidden_[i].count;
    }
  }
  return Status::Ok();
}

// Sparse attention of every sequence's rows over its window and selected entries, in one op (each
// query reads its own sequence's ring and blocks, and gets the bits a call of its sequence alone
// gives); stages the window rows each ring keeps.
Status Step::Attend(int l, const std::vector<float>& q, const std::vector<float>& kv,
                    std::vector<float>* o) {
  const Layer& L = m_.layers[l];
  const LayerPlan& lp = m_.Plan(l);
  const int64_t H = c_.num_attention_heads, hd = c_.head_dim, rd = c_.qk_rope_head_dim;
  const size_t rows = n(), count = plan_.segments.size();
  // The indexer's picks where they are, and each query's bound on them (the entries the indexer
  // let it see), by which a GPU backend maps the blocks they may reach without reading them.
  const int64_t width = lp.compress_ratio > 0 && picks_ratio_ > 0 ? c_.index_topk : 0;
  std::vector<int64_t> bound(width > 0 ? rows : 0);
  for (size_t t = 0; t < bound.size(); ++t) bound[t] = (plan_.positions[t] + 1) / picks_ratio_;
  kernels::PagedRows kv_codes, kv_scales;
  if (width > 0) {
    const KvBlockLayout::Source& src = m_.layout->sources[m_.layout->source_of_layer[lp.kv_source]];
    kv_codes = m_.Rows(src, src.kv_codes);
    kv_scales = m_.Rows(src, src.kv_scales);
  }
  // Each sequence's ring, fresh rows and block table, and each row's sequence.
  std::vector<kernels::AttentionSequence> sequences(count);
  const std::vector<int32_t> token_sequence = plan_.RowSegments();
  for (size_t i = 0; i < count; ++i) {
    const ForwardPlan::Segment& sg = plan_.segments[i];
    const SequenceState& st = *items_[i].state;
    const SequenceState::Ring& ring = st.rings[l];
    sequences[i] = {.ring_codes = ring.codes.data(),
                    .ring_scales = ring.scales.data(),
                    .ring_versions = ring.versions.size() == static_cast<size_t>(c_.sliding_window)
                                         ? ring.versions.data()
                                         : nullptr,
                    .fresh = &kv[sg.offset * hd],
                    .fresh_first = sg.start,
                    .block_table = st.blocks.data()};
  }
  kernels::SparseAttentionParams p{.q = q.data(),
                                   .tokens = static_cast<int64_t>(rows),
                                   .heads = H,
                                   .head_dim = hd,
                                   .rope_dim = rd,
                                   .positions = plan_.positions.data(),
                                   .window = c_.sliding_window,
                                   .window_first = plan_.window_first.data(),
                                   .window_last = draft_ ? window_last_.data() : nullptr,
                                   .selected = width > 0 ? picks_.data() : nullptr,
                                   .selected_stride = width,
                                   .selected_bound = width > 0 ? bound.data() : nullptr,
                                   .kv_codes = kv_codes,
                                   .kv_scales = kv_scales,
                                   .sink = L.attn_sink.data(),
                                   .freqs = L.freqs.data(),
                                   .out = o->data(),
                                   .stream = &stream_};
  if (count == 1) {  // One sequence: its fields in the op's own.
    const kernels::AttentionSequence& s = sequences[0];
    p.ring_codes = s.ring_codes, p.ring_scales = s.ring_scales, p.ring_versions = s.ring_versions;
    p.fresh = s.fresh, p.fresh_first = s.fresh_first, p.block_table = s.block_table;
  } else {
    p.token_sequence = token_sequence.data();
    p.sequences = sequences.data();
    p.sequence_count = static_cast<int64_t>(count);
  }
  FLASHD_OP(SparseAttention, p);
  // The window ring keeps the last `window` rows (staged by the window keys' norm), written when
  // the step commits.
  if (draft_) return Status::Ok();
  for (size_t i = 0; i < count; ++i) {
    const ForwardPlan::Segment& sg = plan_.segments[i];
    ring_rows_[i][l].first_position = sg.start + static_cast<int64_t>(sg.count - ring_keep_[i]);
  }
  return Status::Ok();
}

// Grouped output LoRA (BF16), then wo_b, into sub_.
Status Step::Output(int l, const std::vector<float>& o) {
  const Layer& L = m_.layers[l];
  const int64_t rows = static_cast<int64_t>(n()), H = c_.num_attention_heads, hd = c_.head_dim;
  const int64_t G = c_.o_groups, olr = c_.o_lora_rank, gin = H * hd / G;
  std::vector<float> og(static_cast<size_t>(rows * G * olr));
  // og's codes made by wo_a's op, for wo_b to read.
  const bool coded = ReadsCodes(L.wo_b, G * olr) && olr % 32 == 0;  // wo_a's y_codes: its blocks.
  XCodes codes(coded ? rows : 0, G * olr);
  const Kept kept(this, {&og, &codes.codes, &codes.scales});
  // The groups in one op: group g's slice of the heads to its o_lora outputs.
  FLASHD_OP(Linear, {.x = o.data(),
                     .rows = rows,
                     .in = gin,
                     .out = olr,
                     .format = kernels::WeightFormat::kFp8Dense,
                     .w = L.wo_a.w,
                     .w_scales = L.wo_a.s,
                     .y = og.data(),
                     .stream = &stream_,
                     .groups = G,
                     .round_output = true,
                     .y_codes = coded ? codes.Codes() : nullptr,
                     .y_code_scales = coded ? codes.Scales() : nullptr});
  FLASHD_RETURN_IF_ERROR(
      ApplyAll(L.wo_b, og.data(), rows, sub_.data(), true, {}, coded ? &codes : nullptr));
  return Status::Ok();
}

Status Step::Attention(int l) {
  const Layer& L = m_.layers[l];
  const LayerPlan& lp = m_.Plan(l);
  const int64_t rows = static_cast<int64_t>(n()), H = c_.num_attention_heads;
  const int64_t hd = c_.head_dim;
  const size_t rows_hd = static_cast<size_t>(rows * hd);
  std::vector<float> qr(static_cast<size_t>(rows * c_.q_lora_rank));
  std::vector<float> q(static_cast<size_t>(rows * H * hd)), kv(rows_hd);
  // The compressor's projections and every sequence's entries, then the selections and the
  // attention of all rows.
  std::vector<float> kvp(lp.is_kv_source ? rows_hd : 0);
  std::vector<float> score(lp.is_kv_source && lp.compress_ratio > 1 ? rows_hd : 0);
  std::vector<float> iw(lp.is_index_source ? static_cast<size_t>(rows * c_.index_n_heads) : 0);
  std::vector<float> iq(
      lp.is_index_source ? static_cast<size_t>(rows * c_.index_n_heads * c_.index_head_dim) : 0);
  std::vector<float> o(static_cast<size_t>(rows * H * hd));
  const Kept kept(this, {&qr, &q, &kv, &kvp, &score, &iw, &iq, &o});
  FLASHD_RETURN_IF_ERROR(QueriesAndWindow(l, &qr, &q, &kv, lp.is_index_source ? &iq : nullptr));
  // The compressor's and the indexer's projections of the same row, one op.
  std::vector<std::pair<const Linear*, float*>> projections;
  if (lp.is_kv_source) projections.push_back({&L.comp_wkv, kvp.data()});
  if (lp.is_kv_source && lp.compress_ratio > 1)
    projections.push_back({&L.comp_wgate, score.data()});
  if (lp.is_index_source) projections.push_back({&L.idx_weights_proj, iw.data()});
  if (!projections.empty()) {
    const auto [first, y] = projections.front();
    projections.erase(projections.begin());
    FLASHD_RETURN_IF_ERROR(ApplyAll(*first, x_.data(), rows, y, false, projections));
  }
  if (lp.is_index_source) {
    const int64_t ih = c_.index_n_heads, idd = c_.index_head_dim;
    const float wscale =
        static_cast<float>(std::pow(double(idd), -0.5) * std::pow(double(ih), -0.5));
    FLASHD_OP(RoundBf16, {.x = iw.data(), .n = static_cast<int64_t>(iw.size()), .scale = wscale});
  }
  if (lp.is_kv_source) {
    FLASHD_RETURN_IF_ERROR(Compress(l, kvp.data(), score.empty() ? nullptr : score.data()));
  }
  // A sequence under verification keeps its rows' projections, to replay the groups of the
  // tokens it accepts.
  for (size_t i = 0; i < plan_.segments.size(); ++i) {
    const ForwardPlan::Segment& sg = plan_.segments[i];
    if (lp.is_kv_source && items_[i].accept && lp.compress_ratio > 1) {
      FLASHD_RETURN_IF_ERROR(ToHost(kvp));
      FLASHD_RETURN_IF_ERROR(ToHost(score));
      if (compressor_rows_.empty()) compressor_rows_.resize(plan_.segments.size());
      compressor_rows_[i].resize(static_cast<size_t>(c_.num_hidden_layers));
      CompressorRows& cr = compressor_rows_[i][l];
      cr.kv.assign(kvp.begin() + sg.offset * hd, kvp.begin() + (sg.offset + sg.count) * hd);
      cr.score.assign(score.begin() + sg.offset * hd, score.begin() + (sg.offset + sg.count) * hd);
    }
  }
  // The selections of every sequence at once (a sequence's compressed entries are written above,
  // each into its own blocks), then the attention of all.
  if (lp.is_index_source) FLASHD_RETURN_IF_ERROR(Index(l, iq.data(), iw.data()));
  FLASHD_RETURN_IF_ERROR(Attend(l, q, kv, &o));
  return Output(l, o);
}

// Compressed KV of every sequence of the step, written by a KV source before anyone reads it: each
// op once for all the sequences (the pooling keeps each sequence's partial group its own), the
// entries in the sequences' order.
Status Step::Compress(int l, const float* kvp, const float* score) {
  const Layer& L = m_.layers[l];
  const LayerPlan& lp = m_.Plan(l);
  const int64_t hd = c_.head_dim, idd = c_.index_head_dim;
  const float eps = static_cast<float>(c_.rms_norm_eps);
  const int source = m_.layout->source_of_layer[l];
  const size_t count = plan_.segments.size();
  // The groups each sequence completes, one sequence after another.
  std::vector<int64_t> positions, rows;
  for (size_t i = 0; i < count; ++i) {
    const ForwardPlan::Groups& g = plan_.groups[i][source];
    positions.insert(positions.end(), g.positions.begin(), g.positions.end());
    rows.insert(rows.end(), g.rows.begin(), g.rows.end());
  }
  const int64_t groups = static_cast<int64_t>(positions.size());
  std::vector<float> latents(static_cast<size_t>(groups * hd));
  std::vector<float> keys(lp.owns_index_keys ? static_cast<size_t>(groups * idd) : 0);
  const Kept kept(this, {&latents, &keys});
  if (lp.compress_ratio == 1) {
    // Every row is a group of its own.
    if (groups != static_cast<int64_t>(n())) {
      return Internal("compressor: a ratio-1 source's groups are not the step's rows");
    }
    FLASHD_OP(CopyRows, {.src = kvp,
                         .src_stride = hd,
                         .rows = groups,
                         .cols = hd,
                         .dst = latents.data(),
                         .dst_stride = hd});
    FLASHD_OP(RmsNorm, {.x = latents.data(),
                        .rows = groups,
                        .dim = hd,
                        .stride = hd,
                        .weight = L.comp_norm.data(),
                        .eps = eps,
                        .round_input = true});
  } else {
    std::vector<int64_t> sequence_rows;
    std::vector<float*> kv_partials, score_partials;
    for (size_t i = 0; i < count; ++i) {
      SequenceState::Compressor& comp = compressors_[i][l];
      sequence_rows.push_back(static_cast<int64_t>(plan_.segments[i].offset));
      kv_partials.push_back(comp.kv_partial.data());
      score_partials.push_back(comp.score_partial.data());
    }
    sequence_rows.push_back(static_cast<int64_t>(n()));
    kernels::CompressPoolParams pool{.kv = kvp,
                                     .score = score,
                                     .rows = static_cast<int64_t>(n()),
                                     .dim = hd,
                                     .ratio = lp.compress_ratio,
                                     .positions = plan_.positions.data(),
                                     .pooled = latents.data()};
    if (count == 1) {  // One sequence: its partial groups in the op's own fields.
      pool.kv_partial = kv_partials[0];
      pool.score_partial = score_partials[0];
    } else {
      pool.sequence_rows = sequence_rows.data();
      pool.kv_partials = kv_partials.data();
      pool.score_partials = score_partials.data();
      pool.sequence_count = static_cast<int64_t>(count);
    }
    FLASHD_OP(CompressPool, pool);
    if (groups > 0) {
      FLASHD_OP(RmsNorm, {.x = latents.data(),
                          .rows = groups,
                          .dim = hd,
                          .stride = hd,
                          .weight = L.comp_norm.data(),
                          .eps = eps});
    }
  }
  if (groups > 0 && !keys.empty()) {
    FLASHD_RETURN_IF_ERROR(Apply(L.idx_wk, latents.data(), groups, keys.data()));
    FLASHD_OP(RmsNorm, {.x = keys.data(),
                        .rows = groups,
                        .dim = idd,
                        .stride = idd,
                        .weight = L.idx_k_norm.data(),
                        .eps = eps,
                        .round_input = true});
  }
  if (groups > 0) {
    const KvBlockLayout::Source& src = m_.layout->sources[source];
    FLASHD_OP(CompressWrite, {.latent = latents.data(),
                              .key = keys.empty() ? nullptr : keys.data(),
                              .groups = groups,
                              .head_dim = hd,
                              .index_dim = idd,
                              .rope_dim = c_.qk_rope_head_dim,
                              .positions = positions.data(),
                              .freqs = L.freqs.data(),
                              .rows = rows.data(),
                              .kv_codes = m_.Rows(src, src.kv_codes),
                              .kv_scales = m_.Rows(src, src.kv_scales),
                              .key_codes = m_.Rows(src, src.key_codes),
                              .key_scales = m_.Rows(src, src.key_scales)});
  }
  for (size_t i = 0; i < count; ++i) {
    const ForwardPlan::Groups& g = plan_.groups[i][source];
    compressors_[i][l].entries = g.first_entry + static_cast<int64_t>(g.positions.size());
  }
  return Status::Ok();
}

// Which compressed entries each row attends to, for every sequence of the step at once: the
// queries of all rows in one projection, each sequence's scores over its own blocks into rows of
// one score matrix (the widest sequence's width; a row scores -inf past what it sees), then one
// candidate filter and one top-k over all of them, so the host waits for the picks once per
// chunk, not once per sequence. Every row's choice is made from its own scores alone, so it does
// not depend on which sequences share the step.
// The indexer's choices; iq: its queries (idx_wq_b's, rounded), rotated and fake-quantized here.
Status Step::Index(int l, float* iq, const float* weights) {
  const Layer& L = m_.layers[l];
  const LayerPlan& lp = m_.Plan(l);
  const int64_t ih = c_.index_n_heads, idd = c_.index_head_dim, ratio = lp.compress_ratio;
  const int64_t count = static_cast<int64_t>(n());
  // Rotated, then FP4 in blocks of 32 along each head (the config's index_head_dim is in 32s),
  // in one op.
  FLASHD_OP(Rope, {.x = iq,
                   .rows = count,
                   .heads = ih,
                   .head_dim = idd,
                   .rope_dim = c_.qk_rope_head_dim,
                   .row_stride = ih * idd,
                   .positions = plan_.positions.data(),
                   .freqs = L.freqs.data(),
                   .fake_quant_block = 32,
                   .fake_quant_format = kernels::FakeQuantFormat::kFp4E8M0});
  // Only the entries a query can see take part, so the choice for a token never depends on how
  // many tokens share its call (the reference's decode step does the same).
  std::vector<int64_t> visible(static_cast<size_t>(count));
  int64_t stride = 0;
  for (int64_t t = 0; t < count; ++t) {
    visible[t] = (plan_.positions[t] + 1) / ratio;
    stride = std::max(stride, visible[t]);
  }
  // Each row's sequence, and each sequence's block table.
  const std::vector<int32_t> token_sequence = plan_.RowSegments();
  std::vector<const int32_t*> tables(plan_.segments.size());
  for (size_t i = 0; i < plan_.segments.size(); ++i) tables[i] = items_[i].state->blocks.data();
  const KvBlockLayout::Source& src = m_.layout->sources[m_.layout->source_of_layer[lp.kv_source]];
  const kernels::PagedRows key_codes = m_.Rows(src, src.key_codes);
  const kernels::PagedRows key_scales = m_.Rows(src, src.key_scales);
  const int64_t topk = c_.index_topk, bs = c_.candidate_block_size;
  // Rows go in chunks whose score rows fit in about 64 MiB.
  const int64_t chunk = std::max<int64_t>(1, (int64_t{16} << 20) / std::max<int64_t>(1, stride));
  // A chunk's scores, kept on the device from the indexer to the selections.
  std::vector<float> scores(static_cast<size_t>(std::min(chunk, count) * stride));
  const Kept kept_scores(this, {&scores});
  std::vector<uint8_t> mask;
  for (int64_t t0 = 0; t0 < count; t0 += chunk) {
    const int64_t rows = std::min(chunk, count - t0);
    const uint8_t* use_mask = nullptr;
    if (lp.uses_candidates && !lp.is_candidate_source) {
      // The filter's mask where it was made, when these are its rows and columns.
      if (candidates_on_device_ && rows == count && stride == candidates_stride_ &&
          ratio == candidates_ratio_) {
        use_mask = reinterpret_cast<const uint8_t*>(candidates_mask_.data());
      } else {
        FLASHD_RETURN_IF_ERROR(CandidatesToHost());
        mask.assign(static_cast<size_t>(rows * stride), 0);
        for (int64_t t = 0; t < rows; ++t) {
          const std::vector<char>& keep = candidates_[t0 + t];
          for (int64_t j = 0; j < std::min<int64_t>(stride, keep.size()); ++j) {
            mask[t * stride + j] = keep[j] != 0;
          }
        }
        use_mask = mask.data();
      }
    }
    // One call over the chunk's rows, each reading its own sequence's block table.
    kernels::IndexerScoreParams sp{.q = &iq[t0 * ih * idd],
                                   .weights = weights + t0 * ih,
                                   .tokens = rows,
                                   .heads = ih,
                                   .dim = idd,
                                   .visible = &visible[t0],
                                   .key_codes = key_codes,
                                   .key_scales = key_scales,
                                   .mask = use_mask,
                                   .stride = stride,
                                   .scores = scores.data(),
                                   .stream = &stream_};
    if (token_sequence[t0] == token_sequence[t0 + rows - 1]) {  // One sequence's rows.
      sp.block_table = tables[token_sequence[t0]];
    } else {
      sp.token_sequence = &token_sequence[t0];
      sp.block_tables = tables.data();
      sp.sequence_count = static_cast<int64_t>(tables.size());
    }
    FLASHD_OP(IndexerScores, sp);
    if (lp.is_candidate_source) {
      // Level one: the best blocks of candidate_block_size entries; the newest pinned.
      const int64_t blocks = (stride + bs - 1) / bs;
      std::vector<float> block_scores(static_cast<size_t>(rows * blocks));
      std::vector<int64_t> block_top(static_cast<size_t>(rows * c_.candidate_topk_blocks));
      // All rows in one chunk: the mask stays where it is made, for the layers that use it.
      const bool in_place = rows == count;
      uint8_t* out = nullptr;
      if (in_place) {
        Release(&candidates_kept_);
        candidates_mask_.resize(static_cast<size_t>((rows * stride + 3) / 4));
        Keep(&candidates_mask_, KeepAs::kUnwritten, &candidates_kept_);
        out = reinterpret_cast<uint8_t*>(candidates_mask_.data());
      } else {
        mask.resize(static_cast<size_t>(rows * stride));
        out = mask.data();
      }
      FLASHD_OP(CandidateFilter, {.scores = scores.data(),
                                  .tokens = rows,
                                  .stride = stride,
                                  .block = bs,
                                  .top_blocks = c_.candidate_topk_blocks,
                                  .visible = &visible[t0],
                                  .order = options_.topk_order,
                                  .block_scores = block_scores.data(),
                                  .block_top = block_top.data(),
                                  .mask = out});
      candidates_on_device_ = in_place;
      candidates_stride_ = stride;
      candidates_ratio_ = ratio;
      for (int64_t t = 0; t < rows && !in_place; ++t) {
        candidates_[t0 + t].assign(mask.begin() + t * stride,
                                   mask.begin() + t * stride + visible[t0 + t]);
      }
    }
    // The picks in ascending order where the op runs: the attention reads them there.
    FLASHD_OP(TopK, {.values = scores.data(),
                     .rows = rows,
                     .stride = stride,
                     .k = topk,
                     .n = &visible[t0],
                     .order = options_.topk_order,
                     .out = &picks_[static_cast<size_t>(t0 * topk)],
                     .ascending = true});
  }
  picks_ratio_ = ratio;
  if (options_.trace != nullptr) {
    FLASHD_RETURN_IF_ERROR(ToHost(picks_));
    for (int64_t t = 0; t < count; ++t) {
      const auto first = picks_.begin() + t * topk;
      options_.trace->selections.push_back(
          {l, plan_.positions[t], std::vector<int64_t>(first, std::find(first, first + topk, -1))});
    }
  }
  return Status::Ok();
}

// The candidate filter's mask, kept where it was made, into the host's candidates_ (each row's
// visible entries at the filter's compression).
Status Step::CandidatesToHost() {
  if (!candidates_on_device_) return Status::Ok();
  candidates_on_device_ = false;
  FLASHD_RETURN_IF_ERROR(ToHost(candidates_mask_));
  const char* mask = reinterpret_cast<const char*>(candidates_mask_.data());
  for (size_t t = 0; t < candidates_.size(); ++t) {
    const int64_t visible = (plan_.positions[t] + 1) / candidates_ratio_;
    const char* row = mask + static_cast<int64_t>(t) * candidates_stride_;
    candidates_[t].assign(row, row + std::min(visible, candidates_stride_));
  }
  return Status::Ok();
}

Status Step::Moe(int l) {
  const Layer& L = m_.layers[l];
  const int64_t rows = static_cast<int64_t>(n()), dim = c_.hidden_size;
  const int64_t E = static_cast<int64_t>(L.experts.size()), K = L.top_k;
  std::vector<float> logits(static_cast<size_t>(rows * E)), s(logits.size()), b(logits.size());
  const Kept kept(this, {&logits, &s, &b});
  // The router's logits made in the routing's op (one kernel for them, the routing and the
  // grouping at a step of one token, on a GPU).
  const kernels::LinearParams router{.x = x_.data(),
                                     .rows = rows,
                                     .in = dim,
                                     .out = E,
                                     .dense = L.gate_w.data(),
                                     .y = logits.data(),
                                     .stream = &stream_};
  // The choices stay where they are made: grouped there by expert, the host never waits for
  // them (unless the experts' weights are not alike, and the per-expert loop below groups them).
  std::vector<int64_t> chosen(static_cast<size_t>(rows * K));
  std::vector<float> weights(chosen.size());
  const Kept kept_chosen(this, {&chosen}), kept_weights(this, {&weights});
  const kernels::MoeRouteParams route{.logits = logits.data(),
                                      .bias = L.gate_bias.data(),
                                      .tokens = rows,
                                      .experts = E,
                                      .k = K,
                                      .scoring = Scoring(c_.scoring_func),
                                      .norm_topk = c_.norm_topk_prob,
                                      .scale = static_cast<float>(c_.routed_scaling_factor),
                                      .order = options_.topk_order,
                                      .scores = s.data(),
                                      .biased = b.data(),
                                      .chosen = chosen.data(),
                                      .weights = weights.data(),
                                      .router = &router};
  // Grouped where they are routed: the grouping in the routing's op (GroupedExperts).
  const bool group_at_route = L.grouped && m_.routed_experts < 0;
  if (!group_at_route) FLASHD_RETURN_IF_ERROR(Check(b_->MoeRoute(route), "MoeRoute"));
  // `codes`: x's codes where the collapse made them (the shared expert's x_).
  auto expert = [&](const Expert& e, const float* x, int64_t m, const float* w, float* out,
                    XCodes* codes = nullptr) {
    const int64_t inter = e.w1.out;
    std::vector<float> g(static_cast<size_t>(m * inter)), u(g.size()), h(g.size());
    const Kept kept_gate(this, {&g, &u, &h});
    const kernels::WeightFormat f = e.w1.format;
    const bool pair =
        QuantizedFormat(f) && e.w3.format == f && e.w3.in == e.w1.in && e.w3.out == inter;
    // h's codes made by the gated op, for w2 to read.
    const bool h_coded = pair && ReadsCodes(e.w2, inter);
    XCodes h_codes(h_coded ? m : 0, inter);
    const Kept kept_codes(this, {&h_codes.codes, &h_codes.scales});
    if (pair) {
      // w1 and w3 under SwiGLU as one op (g and u its workspace).
      if (codes == nullptr) QuantScratch(m * e.w1.in);
      FLASHD_OP(Linear, {.x = x,
                         .rows = m,
                         .in = e.w1.in,
                         .out = inter,
                         .format = f,
                         .w = e.w1.w,
                         .w_scales = e.w1.s,
                         .x_codes = codes != nullptr ? codes->Codes() : xq_.data(),
                         .x_scales = codes != nullptr ? codes->Scales() : xs_.data(),
                         .y = h.data(),
                         .stream = &stream_,
                         .x_quantized = codes != nullptr,
                         .up = e.w3.w,
                         .up_scales = e.w3.s,
                         .row_weights = w,
                         .limit = static_cast<float>(c_.swiglu_limit),
                         .gate = g.data(),
                         .up_out = u.data(),
                         .y_codes = h_coded ? h_codes.Codes() : nullptr,
                         .y_code_scales = h_coded ? h_codes.Scales() : nullptr});
    } else {
      FLASHD_RETURN_IF_ERROR(ApplyAll(e.w1, x, m, g.data(), false, {}, codes));
      FLASHD_RETURN_IF_ERROR(ApplyAll(e.w3, x, m, u.data(), false, {}, codes));
      FLASHD_OP(Swiglu, {.gate = g.data(),
                         .up = u.data(),
                         .rows = m,
                         .inter = inter,
                         .row_weights = w,
                         .limit = static_cast<float>(c_.swiglu_limit),
                         .h = h.data()});
    }
    FLASHD_RETURN_IF_ERROR(
        ApplyAll(e.w2, h.data(), m, out, true, {}, h_coded ? &h_codes : nullptr));
    return Status::Ok();
  };
  // y starts as zeros (on the host, and cleared where it is kept): rows no routed expert took
  // stay zero.
  std::vector<float> y(static_cast<size_t>(rows * dim), 0.0f), shared(y.size());
  const Kept kept_y(this, {&y}, KeepAs::kZeros), kept_shared(this, {&shared});
  // Routed and grouped where the layer runs: the shared expert first, and the routed sum and
  // its output added in the combine's op (the two are independent: the same bits either way).
  if (group_at_route) {
    FLASHD_RETURN_IF_ERROR(
        expert(L.shared, x_.data(), rows, nullptr, shared.data(), CollapseCodes()));
    return GroupedExperts(L, &route, chosen, weights, y, shared.data());
  }
  // The routed experts may run elsewhere than the layer (Placement::routed_experts).
  const Backend* layer_backend = b_;
  if (m_.routed_experts >= 0) FLASHD_RETURN_IF_ERROR(Use(m_.backends[m_.routed_experts].get()));
  if (L.grouped) {
    FLASHD_RETURN_IF_ERROR(GroupedExperts(L, nullptr, chosen, weights, y));
  } else {
    // Tokens by expert, in token order, on the host.
    FLASHD_RETURN_IF_ERROR(ToHost(chosen));
    FLASHD_RETURN_IF_ERROR(ToHost(weights));
    std::vector<std::vector<int64_t>> token_rows(static_cast<size_t>(E));
    std::vector<std::vector<float>> token_weights(static_cast<size_t>(E));
    for (int64_t t = 0; t < rows; ++t) {
      for (int64_t i = 0; i < K; ++i) {
        token_rows[chosen[t * K + i]].push_back(t);
        token_weights[chosen[t * K + i]].push_back(weights[t * K + i]);
      }
    }
    for (int64_t e = 0; e < E; ++e) {
      const int64_t m = static_cast<int64_t>(token_rows[e].size());
      if (m == 0) continue;
      std::vector<float> xe(static_cast<size_t>(m * dim)), oe(xe.size());
      const Kept kept_expert(this, {&xe, &oe});
      FLASHD_OP(CopyRows, {.src = x_.data(),
                           .src_stride = dim,
                           .index = token_rows[e].data(),
                           .rows = m,
                           .cols = dim,
                           .dst = xe.data(),
                           .dst_stride = dim});
      FLASHD_RETURN_IF_ERROR(
          expert(L.experts[e], xe.data(), m, token_weights[e].data(), oe.data()));
      FLASHD_OP(MoeCombine, {.expert_out = oe.data(),
                             .rows = token_rows[e].data(),
                             .count = m,
                             .dim = dim,
                             .y = y.data()});
    }
  }
  FLASHD_RETURN_IF_ERROR(Use(layer_backend));
  FLASHD_RETURN_IF_ERROR(
      expert(L.shared, x_.data(), rows, nullptr, shared.data(), CollapseCodes()));
  FLASHD_OP(
      AddRound,
      {.a = y.data(), .b = shared.data(), .n = static_cast<int64_t>(y.size()), .out = sub_.data()});
  return Status::Ok();
}

// The routed experts over the tokens grouped by expert (MoeGroup) where they were routed: each
// op runs once for every expert's rows, and the combine adds each token's experts in ascending
// id, as the per-expert loop does, so the sums are the same bit for bit.
Status Step::GroupedExperts(const Layer& L, const kernels::MoeRouteParams* route,
                            const std::vector<int64_t>& chosen, const std::vector<float>& weights,
                            std::vector<float>& y, const float* shared) {
  const int64_t rows = static_cast<int64_t>(n()), dim = c_.hidden_size, K = L.top_k;
  const int64_t E = static_cast<int64_t>(L.experts.size()), total = rows * K;
  const GroupedWeights& gw = *L.grouped;
  const int64_t slots = std::min(E, total), inter = gw.w1.out;
  // The step's buffers for this, kept from layer to layer: the same sizes every layer, so after
  // the first no memory is allocated (or faulted in) again.
  GroupedRows& r = grouped_;
  auto& [slot_expert, slot_offset, slot_tiles, token_of] = r.ints;
  auto& [row_weights, g, u, h, og] = r.floats;
  slot_expert.resize(static_cast<size_t>(slots));
  slot_offset.resize(slot_expert.size() + 1);
  slot_tiles.resize(slot_offset.size());
  token_of.resize(static_cast<size_t>(total));
  row_weights.resize(static_cast<size_t>(total));
  og.resize(static_cast<size_t>(total * dim));
  for (std::vector<float>* v : {&g, &u, &h}) v->resize(static_cast<size_t>(total * inter));
  // h's codes made by the gated op, for w2 to read.
  const bool h_coded = ReadsCodes(gw.w2, inter);
  XCodes& h_codes = r.h_codes;
  h_codes.Size(h_coded ? total : 0, inter);
  const Kept kept_slots(this, {&slot_expert, &slot_offset, &slot_tiles, &token_of});
  const Kept kept_rows(this, {&row_weights, &g, &u, &h, &og});
  const Kept kept_codes(this, {&h_codes.codes, &h_codes.scales});
  const kernels::MoeGroupParams group{.chosen = chosen.data(),
                                      .weights = weights.data(),
                                      .tokens = rows,
                                      .experts = E,
                                      .k = K,
                                      .slots = slots,
                                      .slot_expert = slot_expert.data(),
                                      .slot_offset = slot_offset.data(),
                                      .slot_tiles = slot_tiles.data(),
                                      .rows = token_of.data(),
                                      .row_weights = row_weights.data()};
  if (route != nullptr) {
    kernels::MoeRouteParams p = *route;
    p.group = &group;
    FLASHD_RETURN_IF_ERROR(Check(b_->MoeRoute(p), "MoeRoute"));
  } else {
    FLASHD_RETURN_IF_ERROR(Check(b_->MoeGroup(group), "MoeGroup"));
  }
  // x_rows: x's row of each grouped row (null: x is the grouped rows). The gated pair (up)
  // writes h's codes, and w2 (!up, x_rows null) reads them.
  auto linear = [&](const ExpertTables& t, const float* x, const int64_t* x_rows, float* out,
                    const ExpertTables* up = nullptr, bool round_output = false) {
    // x_'s codes where the collapse made them, read through x_rows.
    const bool row_codes = x_rows != nullptr && x == x_.data() && CollapseCodes() != nullptr;
    const bool reads_h = h_coded && up == nullptr && x_rows == nullptr;
    if (!reads_h) QuantScratch(total * t.in);
    FLASHD_OP(ExpertLinear,
              {.x = x,
               .rows = total,
               .in = t.in,
               .out = t.out,
               .slot_expert = slot_expert.data(),
               .slot_offset = slot_offset.data(),
               .slot_tiles = slot_tiles.data(),
               .slots = slots,
               .experts = E,
               .format = t.format,
               .w = t.w.data(),
               .w_scales = t.s.data(),
               .x_codes = reads_h ? h_codes.Codes() : xq_.data(),
               .x_scales = reads_h ? h_codes.Scales() : xs_.data(),
               .y = out,
               .stream = &stream_,
               .slot_rows = rows,  // A token chooses an expert once.
               .up = up != nullptr ? up->w.data() : nullptr,
               .up_scales = up != nullptr ? up->s.data() : nullptr,
               .row_weights = up != nullptr ? row_weights.data() : nullptr,
               .limit = static_cast<float>(c_.swiglu_limit),
               .gate = up != nullptr ? g.data() : nullptr,
               .up_out = up != nullptr ? u.data() : nullptr,
               .round_output = round_output,
               .x_rows = x_rows,
               .x_count = rows,
               .x_row_codes = row_codes ? x_codes_.Codes() : nullptr,
               .x_row_scales = row_codes ? x_codes_.Scales() : nullptr,
               .x_quantized = reads_h,
               .y_codes = h_coded && up != nullptr ? h_codes.Codes() : nullptr,
               .y_code_scales = h_coded && up != nullptr ? h_codes.Scales() : nullptr});
    return Status::Ok();
  };
  // w1 and w3 under SwiGLU as one op (g and u its workspace) over the step's rows each grouped
  // entry names, then w2, its rows rounded.
  FLASHD_RETURN_IF_ERROR(linear(gw.w1, x_.data(), token_of.data(), h.data(), &gw.w3));
  FLASHD_RETURN_IF_ERROR(linear(gw.w2, h.data(), nullptr, og.data(), nullptr, true));
  FLASHD_OP(MoeCombine, {.expert_out = og.data(),
                         .rows = token_of.data(),
                         .count = total,
                         .dim = dim,
                         .y = y.data(),
                         .y_rows = rows,
                         .add = shared,
                         .out = shared != nullptr ? sub_.data() : nullptr});
  return Status::Ok();
}

Status Step::Logits() {
  const int64_t dim = c_.hidden_size, V = c_.vocab_size;
  auto head = [&](const float* x, int64_t rows, float* y) {
    FLASHD_OP(Linear, {.x = x,
                       .rows = rows,
                       .in = dim,
                       .out = V,
                       .dense = m_.head.data(),
                       .y = y,
                       .stream = &stream_});
    return Status::Ok();
  };
  // Sequences that want their last row's logits alone share one pass over the head (the head
  // is read once for all of them, and the host waits once); the others get all their rows.
  std::vector<int64_t> last;
  std::vector<size_t> last_items;
  for (size_t i = 0; i < plan_.segments.size(); ++i) {
    const ForwardPlan::Segment& sg = plan_.segments[i];
    const bool all = options_.all_logits || items_[i].all_logits;
    if (!all) {
      last.push_back(static_cast<int64_t>(sg.offset + sg.count - 1));
      last_items.push_back(i);
      continue;
    }
    const int64_t rows = static_cast<int64_t>(sg.count);
    items_[i].logits->assign(static_cast<size_t>(rows * V), 0.0f);
    FLASHD_RETURN_IF_ERROR(head(&x_[sg.offset * dim], rows, items_[i].logits->data()));
  }
  if (last.size() == 1) {
    std::vector<float>& y = *items_[last_items[0]].logits;
    y.assign(static_cast<size_t>(V), 0.0f);
    return head(&x_[last[0] * dim], 1, y.data());
  }
  if (last.empty()) return Status::Ok();
  const int64_t rows = static_cast<int64_t>(last.size());
  std::vector<float> xs(static_cast<size_t>(rows * dim)), ys(static_cast<size_t>(rows * V));
  const Kept kept(this, {&xs, &ys});
  FLASHD_OP(CopyRows, {.src = x_.data(),
                       .src_stride = dim,
                       .index = last.data(),
                       .rows = rows,
                       .cols = dim,
                       .dst = xs.data(),
                       .dst_stride = dim});
  FLASHD_RETURN_IF_ERROR(head(xs.data(), rows, ys.data()));
  FLASHD_RETURN_IF_ERROR(ToHost(ys));
  for (size_t j = 0; j < last_items.size(); ++j) {
    items_[last_items[j]].logits->assign(ys.begin() + j * V, ys.begin() + (j + 1) * V);
  }
  return Status::Ok();
}

// Applies the staged state: positions, compressor partial groups and entries, window rings
// (the DSpark stages' too), Engram histories. An item keeping only its first keep[i] tokens ends
// as if it had run just those: every kept ring row and compressor row is in this step's staging
// (such items have at most a window of tokens), and compressed entries past the kept position
// are written again, with the tokens that end up there, before anything reads them.
void Step::Commit(const std::vector<int64_t>& keep) {
  const size_t hd = static_cast<size_t>(c_.head_dim);
  const int64_t win = c_.sliding_window;
  // Every slot written gets a new version; a ring without versions gets them all first.
  auto write_rows = [&](const RingRows& rr, int64_t end, SequenceState::Ring* ring) {
    if (ring->versions.size() != static_cast<size_t>(win)) {
      ring->versions.resize(static_cast<size_t>(win));
      for (uint64_t& v : ring->versions) v = NewVersion();
    }
    for (size_t r = 0; r < rr.rows.size() / hd; ++r) {
      const int64_t pos = rr.first_position + static_cast<int64_t>(r);
      if (pos >= end) break;
      const size_t slot = static_cast<size_t>(pos % win);
      k::QuantizeFp8PerBlock(&rr.rows[r * hd], hd, 32, &ring->codes[slot * hd],
                             &ring->scales[slot * hd / 32]);
      ring->versions[slot] = NewVersion();
    }
  };
  for (size_t i = 0; i < items_.size(); ++i) {
    SequenceState& st = *items_[i].state;
    const int64_t count = static_cast<int64_t>(items_[i].tokens.size());
    const int64_t kept = keep.empty() ? count : std::clamp<int64_t>(keep[i], 0, count);
    const int64_t start = st.position, end = start + kept;
    if (kept == count) {
      st.sources = std::move(compressors_[i]);
      st.engram_classes = std::move(plan_.engram_history[i]);
      // The groups as the step's last Settle left them, on the host and on their layer's
      // backend: a new version, by which that backend keeps its copy (Release).
      for (int l = 0; l < c_.num_hidden_layers; ++l) {
        SequenceState::Compressor& comp = st.sources[l];
        if (comp.kv_partial.empty()) continue;
        comp.version = NewVersion();
        named_[comp.kv_partial.data()] = {PartialContent(comp, 0), m_.LayerBackend(l)};
        named_[comp.score_partial.data()] = {PartialContent(comp, 1), m_.LayerBackend(l)};
      }
    } else {
      for (int l = 0; l < c_.num_hidden_layers; ++l) {
        const LayerPlan& lp = c_.layers[l];
        if (!lp.is_kv_source) continue;
        SequenceState::Compressor& comp = st.sources[l];
        comp.entries = end / lp.compress_ratio;
        if (lp.compress_ratio <= 1 || kept == 0) continue;
        comp.version = 0;  // Written here: no device copy holds these bytes.
        const CompressorRows& cr = compressor_rows_[i][l];
        for (int64_t t = 0; t < kept; ++t) {
          const size_t slot = static_cast<size_t>((start + t) % lp.compress_ratio);
          std::copy_n(&cr.kv[t * hd], hd, &comp.kv_partial[slot * hd]);
          std::copy_n(&cr.score[t * hd], hd, &comp.score_partial[slot * hd]);
        }
      }
      if (m_.engram) {
        std::vector<int32_t>& h = st.engram_classes;
        for (int64_t t = 0; t < kept; ++t) h.push_back(m_.engram->ClassOf(items_[i].tokens[t]));
        const size_t history = static_cast<size_t>(m_.engram->history());
        if (h.size() > history) h.erase(h.begin(), h.end() - static_cast<std::ptrdiff_t>(history));
      }
    }
    st.position = end;
    for (int l = 0; l < c_.num_hidden_layers; ++l) write_rows(ring_rows_[i][l], end, &st.rings[l]);
    if (!draft_rows_.empty() && st.rings.size() > static_cast<size_t>(c_.num_hidden_layers)) {
      for (size_t s = 0; s < draft_rows_[i].size(); ++s) {
        write_rows(draft_rows_[i][s], end, &st.rings[c_.num_hidden_layers + s]);
      }
    }
  }
}

}  // namespace

CpuForward::CpuForward(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CpuForward::~CpuForward() = default;

StatusOr<std::unique_ptr<CpuForward>> CpuForward::Create(const Model& model,
                                                         const std::string& tokenizer_json,
                                                         int64_t block_tokens,
                                                         std::unique_ptr<Backend> backend) {
  Placement placement;
  placement.backends.push_back(backend ? std::move(backend) : std::make_unique<CpuBackend>());
  return Create(model, tokenizer_json, block_tokens, std::move(placement));
}

StatusOr<std::unique_ptr<CpuForward>> CpuForward::Create(const Model& model,
                                                         const std::string& tokenizer_json,
                                                         int64_t block_tokens,
                                                         Placement placement) {
  auto impl = std::make_unique<Impl>();
  impl->block_tokens = block_tokens;
  FLASHD_RETURN_IF_ERROR(impl->Prepare(model, tokenizer_json));
  FLASHD_RETURN_IF_ERROR(impl->Place(std::move(placement)));
  return std::unique_ptr<CpuForward>(new CpuForward(std::move(impl)));
}

Status CpuForward::Impl::Place(Placement placement) {
  const int layers = static_cast<int>(c.num_hidden_layers);
  const int n = static_cast<int>(placement.backends.size());
  if (n == 0) return InvalidArgument("placement: no backend");
  for (const auto& b : placement.backends) {
    if (b == nullptr) return InvalidArgument("placement: a backend is null");
  }
  if (placement.layer_backend.empty()) placement.layer_backend.assign(layers, 0);
  if (static_cast<int>(placement.layer_backend.size()) != layers) {
    return InvalidArgument("placement: " + std::to_string(placement.layer_backend.size()) +
                           " layer entries for " + std::to_string(layers) + " layers");
  }
  for (int b : placement.layer_backend) {
    if (b < 0 || b >= n) return InvalidArgument("placement: a layer names no backend");
  }
  if (placement.routed_experts < -1 || placement.routed_experts >= n) {
    return InvalidArgument("placement: the routed experts name no backend");
  }
  // The numerics of the whole: the one backend's, or which backend ran which layers.
  std::string parts;
  for (int l = 0; l < layers;) {
    int end = l;
    while (end + 1 < layers && placement.layer_backend[end + 1] == placement.layer_backend[l]) {
      ++end;
    }
    if (!parts.empty()) parts += ',';
    parts += "layers ";
    parts += std::to_string(l);
    parts += '-';
    parts += std::to_string(end);
    parts += ':';
    parts += placement.backends[placement.layer_backend[l]]->numerics();
    l = end + 1;
  }
  const bool one = placement.routed_experts < 0 &&
                   std::all_of(placement.layer_backend.begin(), placement.layer_backend.end(),
                               [&](int b) { return b == placement.layer_backend[0]; });
  numerics = one ? std::string(placement.backends[placement.layer_backend[0]]->numerics()) : parts;
  if (placement.routed_experts >= 0) {
    numerics += ";routed experts:";
    numerics += placement.backends[placement.routed_experts]->numerics();
  }
  backends = std::move(placement.backends);
  layer_backend = std::move(placement.layer_backend);
  routed_experts = placement.routed_experts;
  return Status::Ok();
}

const ModelConfig& CpuForward::config() const { return impl_->c; }
std::string_view CpuForward::numerics() const { return impl_->numerics; }
const Backend& CpuForward::backend() const { return *impl_->backends[0]; }
int64_t CpuForward::block_tokens() const { return impl_->layout->block_tokens; }

const std::shared_ptr<KvPool>& CpuForward::pool() const { return impl_->pool; }

const EngramStore* CpuForward::engram_store() const { return impl_->engram_store.get(); }

Status CpuForward::SetEngramStore(std::shared_ptr<EngramStore> store, bool read_ahead) {
  const ModelConfig& c = impl_->c;
  if (store && store->tables() != static_cast<int>(c.engram_layer_ids.size())) {
    return InvalidArgument("the Engram store has " + std::to_string(store->tables()) +
                           " tables, the model " + std::to_string(c.engram_layer_ids.size()));
  }
  for (int i = 0; store && i < store->tables(); ++i) {
    if (store->table(i).rows != c.engram_num_embeddings[static_cast<size_t>(i)] ||
        store->table(i).row_bytes != c.engram_head_dim) {
      return InvalidArgument("the Engram store's table " + std::to_string(i) +
                             " does not have the model's shape");
    }
  }
  impl_->engram_store = std::move(store);
  impl_->engram_read_ahead = read_ahead;
  return Status::Ok();
}

StatusOr<SequenceState> RestoreSequence(std::string_view bytes, std::shared_ptr<KvPool> pool,
                                        std::shared_ptr<const KvBlockLayout> layout,
                                        std::vector<int32_t> leading_blocks);

StatusOr<SequenceState> CpuForward::Restore(std::string_view snapshot,
                                            std::vector<int32_t> leading_blocks) const {
  FLASHD_ASSIGN_OR_RETURN(SequenceState s, RestoreSequence(snapshot, impl_->pool, impl_->layout,
                                                           std::move(leading_blocks)));
  const size_t layers = static_cast<size_t>(impl_->c.num_hidden_layers);
  if (s.rings.size() < layers || s.sources.size() != layers) {
    return DataLoss("sequence snapshot: made for a model with another number of layers");
  }
  // The DSpark stages' rings: dropped when this model does not draft; a snapshot made without
  // them gets empty ones (its drafts are then weaker for a window of tokens, never wrong).
  s.rings.resize(impl_->ring_count(), impl_->EmptyRing());
  return s;
}

StatusOr<SequenceState> CpuForward::ResumeAt(int64_t position,
                                             std::span<const int32_t> tokens_before,
                                             std::vector<int32_t> blocks) const {
  SequenceState s = NewSequence();
  s.blocks = std::move(blocks);  // Owned from here, whatever happens below.
  const int64_t block = impl_->layout->block_tokens;
  if (position < 0 || position % block != 0 ||
      static_cast<int64_t>(s.blocks.size()) * block < position) {
    return InvalidArgument("resume: position " + std::to_string(position) + " with " +
                           std::to_string(s.blocks.size()) + " blocks");
  }
  s.position = position;
  s.frozen_tokens = static_cast<int64_t>(s.blocks.size()) * block;
  for (int l = 0; l < impl_->c.num_hidden_layers; ++l) {
    const LayerPlan& p = impl_->c.layers[l];
    if (p.is_kv_source) s.sources[l].entries = position / p.compress_ratio;
  }
  if (impl_->engram) {
    const size_t keep = static_cast<size_t>(impl_->engram->history());
    const size_t from = tokens_before.size() > keep ? tokens_before.size() - keep : 0;
    for (size_t i = from; i < tokens_before.size(); ++i) {
      s.engram_classes.push_back(impl_->engram->ClassOf(tokens_before[i]));
    }
  }
  return s;
}

int64_t CpuForward::ExactReplayTokens() const {
  const ModelConfig& c = impl_->c;
  const int64_t block = impl_->layout->block_tokens;
  const int64_t reach = static_cast<int64_t>(c.num_hidden_layers) * (c.sliding_window - 1) + 1;
  return (reach + block - 1) / block * block;
}

Status CpuForward::EnableDSpark() { return impl_->EnableDSpark(); }

namespace {

// A weight as an op is given it: `bytes` at `host` (dense: `bytes` / 4 fp32 values), on `b`.
struct WeightRef {
  const Backend* b;
  const void* host;
  size_t bytes;
  bool dense;
};

void AddLinear(const Backend* b, const Linear& lin, std::vector<WeightRef>* out) {
  if (QuantizedFormat(lin.format)) {
    const kernels::StoredBytes stored = kernels::QuantizedWeightBytes(lin.format, lin.out, lin.in);
    out->push_back({b, lin.w, static_cast<size_t>(stored.codes), false});
    out->push_back({b, lin.s, static_cast<size_t>(stored.scales), false});
  } else if (!lin.dense.empty()) {
    out->push_back({b, lin.dense.data(), lin.dense.size() * 4, true});
  }
}

void AddFloats(const Backend* b, const std::vector<float>& v, std::vector<WeightRef>* out) {
  if (!v.empty()) out->push_back({b, v.data(), v.size() * 4, false});
}

}  // namespace

Status CpuForward::UploadWeights(
    const std::function<void(uint64_t done, uint64_t total)>& progress) const {
  const Impl& m = *impl_;
  const ModelConfig& c = m.c;
  std::vector<WeightRef> weights;
  const Backend* last = m.LayerBackend(c.num_hidden_layers - 1);
  weights.push_back({m.backends[0].get(), m.embed.data(), m.embed.size() * 4, true});
  for (size_t l = 0; l < m.layers.size(); ++l) {
    const Layer& L = m.layers[l];
    const bool stage = l >= static_cast<size_t>(c.num_hidden_layers);
    const Backend* b = stage ? last : m.LayerBackend(static_cast<int>(l));
    const Backend* experts = m.routed_experts >= 0 ? m.backends[m.routed_experts].get() : b;
    for (const std::vector<float>* v :
         {&L.attn_norm, &L.ffn_norm, &L.hc_attn_fn, &L.hc_attn_base, &L.hc_attn_scale, &L.hc_ffn_fn,
          &L.hc_ffn_base, &L.hc_ffn_scale, &L.attn_sink, &L.q_norm, &L.kv_norm, &L.comp_norm,
          &L.idx_k_norm, &L.gate_bias, &L.engram_qk, &L.freqs}) {
      AddFloats(b, *v, &weights);
    }
    for (const Linear* lin : {&L.wq_a, &L.wq_b, &L.wkv, &L.wo_b, &L.comp_wkv, &L.comp_wgate,
                              &L.idx_wq_b, &L.idx_weights_proj, &L.idx_wk, &L.engram_wkv,
                              &L.shared.w1, &L.shared.w2, &L.shared.w3}) {
      AddLinear(b, *lin, &weights);
    }
    // wo_a goes to the ops whole, its groups in one op.
    if (L.wo_a.w != nullptr) {
      const kernels::StoredBytes stored =
          kernels::QuantizedWeightBytes(kernels::WeightFormat::kFp8Dense, L.wo_a.out, L.wo_a.in);
      weights.push_back({b, L.wo_a.w, static_cast<size_t>(stored.codes), false});
      weights.push_back({b, L.wo_a.s, static_cast<size_t>(stored.scales), false});
    }
    if (!L.gate_w.empty()) weights.push_back({b, L.gate_w.data(), L.gate_w.size() * 4, true});
    for (const Expert& e : L.experts) {
      for (const Linear* lin : {&e.w1, &e.w2, &e.w3}) AddLinear(experts, *lin, &weights);
    }
  }
  AddFloats(last, m.final_norm, &weights);
  weights.push_back({last, m.head.data(), m.head.size() * 4, true});
  if (m.dspark) {
    const DSparkWeights& d = *m.dspark;
    AddLinear(last, d.main_proj, &weights);
    AddFloats(last, d.main_norm, &weights);
    AddFloats(last, d.norm, &weights);
    weights.push_back({last, d.markov_head.data(), d.markov_head.size() * 4, true});
    weights.push_back({last, d.confidence.data(), d.confidence.size() * 4, true});
  }
  std::erase_if(weights, [](const WeightRef& w) {
    return w.host == nullptr || w.bytes == 0 || !w.b->copies_weights();
  });
  uint64_t total = 0, done = 0;
  for (const WeightRef& w : weights) total += w.bytes;
  // The checkpoint's pages of the next weights, asked for ahead of their uploads (up to 256 MiB
  // ahead); for the ones decoded into memory at start-up the advice does nothing.
  const uint64_t ahead = uint64_t{256} << 20;
  const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  size_t next = 0;
  uint64_t asked = 0;
  for (size_t i = 0; i < weights.size(); ++i) {
    for (; next < weights.size() && asked < done + ahead; ++next) {
      const WeightRef& w = weights[next];
      asked += w.bytes;
      const uintptr_t lo = reinterpret_cast<uintptr_t>(w.host) / page * page;
      const uintptr_t hi = reinterpret_cast<uintptr_t>(w.host) + w.bytes;
      ::madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_WILLNEED);  // Advice only.
    }
    const WeightRef& w = weights[i];
    const kernels::OpStatus s =
        w.dense ? w.b->UploadDense(static_cast<const float*>(w.host), w.bytes / 4)
                : w.b->Upload(w.host, w.bytes);
    FLASHD_RETURN_IF_ERROR(Check(s, "Upload"));
    done += w.bytes;
    if (progress) progress(done, total);
  }
  return Status::Ok();
}
bool CpuForward::dspark() const { return impl_->dspark != nullptr; }
int CpuForward::dspark_block() const { return impl_->dspark ? impl_->dspark->block : 0; }

Status CpuForward::Draft(std::span<DraftItem> items, const ForwardOptions& options) const {
  const ModelConfig& c = impl_->c;
  if (!impl_->dspark) return FailedPrecondition("draft: DSpark is not enabled");
  if (items.empty()) return InvalidArgument("draft: empty batch");
  const int64_t B = impl_->dspark->block, win = c.sliding_window;
  ForwardPlan plan;
  std::vector<int64_t> last;
  for (const DraftItem& it : items) {
    if (it.state == nullptr || it.state->rings.size() != impl_->ring_count() ||
        it.state->layout != impl_->layout) {
      return InvalidArgument("draft: sequence state does not belong to this drafting model");
    }
    if (it.state->position < 1) return InvalidArgument("draft: the sequence has run no token");
    if (it.token < 0 || it.token >= c.vocab_size || !it.pick || it.drafted == nullptr ||
        it.confidence == nullptr) {
      return InvalidArgument("draft: a bad item (token, pick or outputs)");
    }
    const int64_t P = it.state->position;
    plan.segments.push_back({plan.tokens.size(), static_cast<size_t>(B), P, 0});
    for (int64_t j = 0; j < B; ++j) {
      plan.tokens.push_back(j == 0 ? it.token : impl_->dspark->noise);
      plan.positions.push_back(P + j);
      // The ring (the main positions before P, up to a window) and the whole block.
      plan.window_first.push_back(std::max<int64_t>(0, P - win));
      last.push_back(P + B - 1);
    }
  }
  std::vector<BatchItem> none(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    none[i].state = const_cast<SequenceState*>(items[i].state);  // Read only: draft_ mode.
  }
  ForwardOptions o = options;
  o.trace = nullptr;
  o.forced_streams = nullptr;
  o.replay_tokens = 0;
  Step step(*impl_, none, o, std::move(plan));
  step.SetWindowLast(std::move(last));
  return step.RunDraft(items);
}

int64_t CpuForward::engram_classes() const {
  return impl_->engram ? impl_->c.engram_compressed_vocab_size : 0;
}

SequenceState CpuForward::NewSequence() const {
  const ModelConfig& c = impl_->c;
  SequenceState s;
  const size_t hd = static_cast<size_t>(c.head_dim);
  s.rings.assign(impl_->ring_count(), impl_->EmptyRing());
  s.pool = impl_->pool;
  s.layout = impl_->layout;
  s.sources.resize(c.num_hidden_layers);
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    const LayerPlan& p = c.layers[l];
    if (!p.is_kv_source || p.compress_ratio <= 1) continue;
    s.sources[l].kv_partial.assign(p.compress_ratio * hd, 0.0f);
    s.sources[l].score_partial.assign(p.compress_ratio * hd, kNegInf);
  }
  return s;
}

Status CpuForward::Forward(SequenceState* state, std::span<const int32_t> tokens,
                           std::vector<float>* logits, const ForwardOptions& options) const {
  BatchItem item{state, tokens, logits};
  return ForwardBatch(std::span<BatchItem>(&item, 1), options);
}

Status CpuForward::ForwardBatch(std::span<BatchItem> items, const ForwardOptions& options) const {
  const ModelConfig& c = impl_->c;
  if (items.empty()) return InvalidArgument("forward: empty batch");
  if (options.trace != nullptr && items.size() != 1) {
    return InvalidArgument("forward: a trace needs a batch of one sequence");
  }
  if (options.replay_tokens > 0 && options.all_logits) {
    return InvalidArgument("forward: the bounded replay gives logits for the last tokens only");
  }
  for (const BatchItem& it : items) {
    if (it.tokens.empty()) return InvalidArgument("forward: a sequence has no tokens");
    for (int32_t t : it.tokens) {
      if (t < 0 || t >= c.vocab_size) {
        return InvalidArgument("forward: token id " + std::to_string(t) +
                               " outside the vocabulary (" + std::to_string(c.vocab_size) + ")");
      }
    }
    if (it.state->rings.size() != impl_->ring_count() || it.state->layout != impl_->layout) {
      return InvalidArgument("forward: sequence state does not belong to this model");
    }
    if (it.accept && static_cast<int64_t>(it.tokens.size()) > c.sliding_window) {
      return InvalidArgument("forward: a verified block is longer than the window");
    }
  }
  // Every block the step writes, allocated before any math. A sequence that does not fit is left
  // out when it can report so on its own; otherwise the call fails with nothing changed.
  std::vector<PlanRequest> requests;
  for (const BatchItem& it : items) requests.push_back({it.state, it.tokens});
  ForwardPlan plan = PlanForward(c, *impl_->layout, impl_->engram.get(), requests);
  std::vector<BatchItem> run;
  std::vector<PlanRequest> kept;
  std::vector<BlockReservation> reservations;
  for (size_t i = 0; i < items.size(); ++i) {
    BatchItem& it = items[i];
    const auto [first, last] = plan.write_blocks[i];
    StatusOr<BlockReservation> r = impl_->blocks->Reserve(&it.state->blocks, first, last);
    if (!r.ok()) {
      if (it.status == nullptr) return r.status();  // The reservations so far roll back.
      *it.status = r.status();
      continue;
    }
    if (it.status != nullptr) *it.status = Status::Ok();
    reservations.push_back(std::move(*r));
    run.push_back(it);
    kept.push_back(requests[i]);
  }
  if (run.empty()) return Status::Ok();
  // Planning reads the sequences only, so a plan of the sequences that fit equals the full plan
  // without the others; it is made again only when one was left out.
  if (run.size() != items.size()) {
    requests = std::move(kept);
    plan = PlanForward(c, *impl_->layout, impl_->engram.get(), requests);
  }
  AssignRows(*impl_->layout, requests, &plan);
  Step step(*impl_, run, options, std::move(plan));
  FLASHD_RETURN_IF_ERROR(step.Run());
  std::vector<int64_t> keep;
  for (size_t i = 0; i < run.size(); ++i) {
    if (!run[i].accept) continue;
    if (keep.empty()) {
      for (const BatchItem& it : run) keep.push_back(static_cast<int64_t>(it.tokens.size()));
    }
    keep[i] = run[i].accept(*run[i].logits);
  }
  step.Commit(keep);
  for (BlockReservation& r : reservations) r.Commit();
  return Status::Ok();
}

}  // namespace flashd::engine
