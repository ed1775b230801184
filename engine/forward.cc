#include "engine/forward.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <numeric>
#include <thread>

#include "kernels/cpu/formats.h"
#include "kernels/cpu/linear.h"
#include "kernels/cpu/parallel.h"

namespace flashd::engine {
namespace {

namespace k = flashd::kernels::cpu;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Rounds to the nearest BF16 value: the reference keeps activations in BF16 between ops.
inline float Bf(float x) { return k::Bf16ToFloat(k::FloatToBf16(x)); }

// The indexer's dot product: eight running sums, lane d % 8 taking element d, added pairwise at
// the end. The order is fixed (it never depends on batch or chunk), and the compiler turns the
// lanes into vector registers.
inline float Dot(const float* a, const float* b, size_t n) {
  float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  size_t d = 0;
  for (; d + 8 <= n; d += 8) {
    for (size_t u = 0; u < 8; ++u) lane[u] += a[d + u] * b[d + u];
  }
  for (; d < n; ++d) lane[d % 8] += a[d] * b[d];
  return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}
void RoundBf(float* x, size_t n) {
  for (size_t i = 0; i < n; ++i) x[i] = Bf(x[i]);
}

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

// A linear layer: FP8 (32x32 scales), FP4 (scales per 32 along K), or dense floats.
struct Linear {
  enum class Kind { kFp8, kFp4, kDense } kind = Kind::kDense;
  const uint8_t* w = nullptr;
  const uint8_t* s = nullptr;
  std::vector<float> dense;
  size_t out = 0, in = 0;

  // y[rows, out] = x[rows, in] . W^T, fp32 (not rounded).
  void Apply(const float* x, size_t rows, float* y, int threads) const {
    if (kind == Kind::kDense) {
      k::DenseLinear(x, rows, in, dense.data(), out, y, threads);
      return;
    }
    std::vector<uint8_t> xq(rows * in), xs(rows * in / 32);
    for (size_t r = 0; r < rows; ++r) {
      k::QuantizeFp8PerBlock(x + r * in, in, 32, xq.data() + r * in, xs.data() + r * in / 32);
    }
    if (kind == Kind::kFp8) {
      k::Fp8Linear(xq.data(), xs.data(), rows, in, w, s, out, y, threads);
    } else {
      k::Fp4Linear(xq.data(), xs.data(), rows, in, w, s, out, y, threads);
    }
  }
};

struct Expert {
  Linear w1, w2, w3;
};

struct Layer {
  std::vector<float> attn_norm, ffn_norm;
  std::vector<float> hc_attn_fn, hc_attn_base, hc_attn_scale;
  std::vector<float> hc_ffn_fn, hc_ffn_base, hc_ffn_scale;
  std::vector<float> attn_sink;
  Linear wq_a, wq_b, wkv, wo_b;
  std::vector<float> q_norm, kv_norm;
  std::vector<float> wo_a;  // [groups * o_lora, heads * head_dim / groups], BF16 values
  // Compressor (KV sources).
  Linear comp_wkv, comp_wgate;
  std::vector<float> comp_norm;
  // Indexer (index sources).
  Linear idx_wq_b, idx_weights_proj, idx_wk;
  std::vector<float> idx_k_norm;
  // MoE.
  std::vector<float> gate_w, gate_bias;
  std::vector<Expert> experts;
  Expert shared;
  // Engram.
  const uint8_t* engram_rows = nullptr;
  const uint8_t* engram_row_scales = nullptr;
  Linear engram_wkv;
  std::vector<float> engram_qk;  // q_weight * k_weight, [hc, dim]
  // RoPE frequencies of this layer (YaRN at compress_rope_theta for compressing layers).
  std::vector<float> freqs;
};

// Rotary frequencies, as the reference precomputes them in fp32 (YaRN when original > 0).
std::vector<float> RopeFreqs(int dim, int64_t original, double base, double factor,
                             double beta_fast, double beta_slow) {
  std::vector<float> freqs(dim / 2);
  for (int i = 0; i < dim / 2; ++i) {
    float exponent = static_cast<float>(2 * i) / static_cast<float>(dim);
    freqs[i] = 1.0f / std::pow(static_cast<float>(base), exponent);
  }
  if (original > 0) {
    auto corrected = [&](double rotations) {
      return dim * std::log(original / (rotations * 2 * M_PI)) / (2 * std::log(base));
    };
    double low = std::max(std::floor(corrected(beta_fast)), 0.0);
    double high = std::min(std::ceil(corrected(beta_slow)), static_cast<double>(dim - 1));
    float span = static_cast<float>(std::max(high - low, 1e-3));
    for (int i = 0; i < dim / 2; ++i) {
      float ramp = std::clamp((static_cast<float>(i) - static_cast<float>(low)) / span, 0.0f, 1.0f);
      float smooth = 1.0f - ramp;
      freqs[i] = freqs[i] / static_cast<float>(factor) * (1.0f - smooth) + freqs[i] * smooth;
    }
  }
  return freqs;
}

// Rotates the pairs of x[0..dim) by position `pos`, rounding to BF16 as the reference does.
void Rope(float* x, const std::vector<float>& freqs, int64_t pos, bool inverse) {
  for (size_t i = 0; i < freqs.size(); ++i) {
    float angle = static_cast<float>(pos) * freqs[i];
    float c = std::cos(angle), s = std::sin(angle);
    if (inverse) s = -s;
    float a = x[2 * i], b = x[2 * i + 1];
    x[2 * i] = Bf(a * c - b * s);
    x[2 * i + 1] = Bf(a * s + b * c);
  }
}

// RMSNorm: BF16(weight * (x * rsqrt(mean(x^2) + eps))).
void RmsNorm(float* x, size_t n, const std::vector<float>& w, double eps) {
  double sum = 0;
  for (size_t i = 0; i < n; ++i) sum += double(x[i]) * x[i];
  float r = 1.0f / std::sqrt(static_cast<float>(sum / n) + static_cast<float>(eps));
  for (size_t i = 0; i < n; ++i) x[i] = Bf(w[i] * (x[i] * r));
}

float Sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// pre, post and the Sinkhorn-normalised comb from one projection of the flattened stream.
void HcSplit(const float* mixes, const std::vector<float>& scale, const std::vector<float>& base,
             int hc, int iters, float eps, float* pre, float* post, float* comb) {
  for (int i = 0; i < hc; ++i) {
    pre[i] = Sigmoid(mixes[i] * scale[0] + base[i]) + eps;
    post[i] = 2.0f * Sigmoid(mixes[hc + i] * scale[1] + base[hc + i]);
  }
  for (int i = 0; i < hc; ++i) {
    float row_max = kNegInf;
    for (int j = 0; j < hc; ++j) {
      comb[i * hc + j] = mixes[2 * hc + i * hc + j] * scale[2] + base[2 * hc + i * hc + j];
      row_max = std::max(row_max, comb[i * hc + j]);
    }
    float sum = 0;
    for (int j = 0; j < hc; ++j) sum += (comb[i * hc + j] = std::exp(comb[i * hc + j] - row_max));
    for (int j = 0; j < hc; ++j) comb[i * hc + j] = comb[i * hc + j] / sum + eps;
  }
  auto normalize_cols = [&] {
    for (int j = 0; j < hc; ++j) {
      float sum = 0;
      for (int i = 0; i < hc; ++i) sum += comb[i * hc + j];
      for (int i = 0; i < hc; ++i) comb[i * hc + j] /= sum + eps;
    }
  };
  auto normalize_rows = [&] {
    for (int i = 0; i < hc; ++i) {
      float sum = 0;
      for (int j = 0; j < hc; ++j) sum += comb[i * hc + j];
      for (int j = 0; j < hc; ++j) comb[i * hc + j] /= sum + eps;
    }
  };
  normalize_cols();
  for (int it = 0; it < iters - 1; ++it) {
    normalize_rows();
    normalize_cols();
  }
}

float SqrtSoftplus(float x) { return std::sqrt(x > 20.0f ? x : std::log1p(std::exp(x))); }

// The indices of the `k` largest values. Which of several equal values wins decides which KV
// entries and experts are used, and BF16 scores tie often, so this selects exactly as the
// reference's CPU top-k does: (value, index) pairs in index order, std::partial_sort when
// k * 64 <= n, else std::nth_element, with a comparator on the value alone. The set returned
// does not depend on the order within it.
std::vector<int64_t> TopK(const std::vector<float>& v, size_t k) {
  k = std::min(k, v.size());
  if (k == 0) return {};
  using Elem = std::pair<double, int64_t>;
  std::vector<Elem> queue(v.size());
  for (size_t j = 0; j < v.size(); ++j) queue[j] = {v[j], static_cast<int64_t>(j)};
  auto larger = [](const Elem& x, const Elem& y) {
    return (std::isnan(x.first) && !std::isnan(y.first)) || x.first > y.first;
  };
  if (k * 64 <= v.size()) {
    std::partial_sort(queue.begin(), queue.begin() + k, queue.end(), larger);
  } else {
    std::nth_element(queue.begin(), queue.begin() + (k - 1), queue.end(), larger);
  }
  std::vector<int64_t> out(k);
  for (size_t j = 0; j < k; ++j) out[j] = queue[j].second;
  return out;
}

}  // namespace

struct CpuForward::Impl {
  const Model* model = nullptr;
  ModelConfig c;
  std::vector<Layer> layers;
  std::vector<float> embed, head, final_norm;
  std::unique_ptr<EngramHasher> engram;
  std::shared_ptr<const KvBlockLayout> layout;
  int64_t block_tokens = 64;
  std::shared_ptr<KvPool> pool;

  Status Prepare(const Model& m, const std::string& tokenizer_json);
  const TensorView& T(const std::string& name) const { return *model->weights().tensors.at(name); }
  Linear Lin(const std::string& prefix) const;

  // Attention for `n` rows of one sequence starting at position P. selection and cand point
  // at those rows' entries.
  Status Attention(int l, SequenceState* st, const float* x, size_t n, int64_t P,
                   int64_t window_floor, float* out, std::vector<int64_t>* selection,
                   std::vector<char>* cand, int threads, ForwardTrace* trace) const;
  void Moe(int l, const float* x, size_t n, float* out, int threads) const;
  void ExpertForward(const Expert& e, const float* x, size_t n, const float* weights, float* out,
                     int threads) const;
};

Linear CpuForward::Impl::Lin(const std::string& prefix) const {
  Linear lin;
  const TensorView& w = T(prefix + ".weight");
  lin.out = static_cast<size_t>(w.shape[0]);
  if (w.dtype == DType::kF8E4M3) {
    lin.kind = Linear::Kind::kFp8;
    lin.in = static_cast<size_t>(w.shape[1]);
    lin.w = w.data;
    lin.s = T(prefix + ".scale").data;
  } else if (w.dtype == DType::kI8 || w.dtype == DType::kU8 || w.dtype == DType::kF4) {
    lin.kind = Linear::Kind::kFp4;
    lin.in = static_cast<size_t>(w.dtype == DType::kF4 ? w.shape[1] : w.shape[1] * 2);
    lin.w = w.data;
    lin.s = T(prefix + ".scale").data;
  } else {
    lin.kind = Linear::Kind::kDense;
    lin.in = static_cast<size_t>(w.shape[1]);
    lin.dense = DecodeFloats(w);
  }
  return lin;
}

Status CpuForward::Impl::Prepare(const Model& m, const std::string& tokenizer_json) {
  model = &m;
  c = m.config();
  embed = DecodeFloats(T("embed.weight"));
  head = DecodeFloats(T("head.weight"));
  final_norm = DecodeFloats(T("norm.weight"));
  layers.resize(c.num_hidden_layers);
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    const LayerPlan& plan = c.layers[l];
    Layer& L = layers[l];
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
    {
      // The release stores wo_a as FP8; the reference runs it dequantized in BF16 (exact).
      const TensorView& w = T(p + "attn.wo_a.weight");
      const size_t rows = static_cast<size_t>(w.shape[0]), cols = static_cast<size_t>(w.shape[1]);
      L.wo_a.resize(rows * cols);
      k::DequantizeFp8Weight(w.data, T(p + "attn.wo_a.scale").data, rows, cols, L.wo_a.data());
    }
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
    for (int e = 0; e < c.n_routed_experts; ++e) {
      const std::string x = p + "ffn.experts." + std::to_string(e) + ".";
      L.experts.push_back({Lin(x + "w1"), Lin(x + "w2"), Lin(x + "w3")});
    }
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
    if (plan.compress_ratio > 0) {
      L.freqs =
          RopeFreqs(static_cast<int>(c.qk_rope_head_dim),
                    c.rope_scaling.original_max_position_embeddings, c.compress_rope_theta,
                    c.rope_scaling.factor, c.rope_scaling.beta_fast, c.rope_scaling.beta_slow);
    } else {
      L.freqs = RopeFreqs(static_cast<int>(c.qk_rope_head_dim), 0, c.rope_theta, 1, 0, 0);
    }
  }
  FLASHD_ASSIGN_OR_RETURN(KvBlockLayout block_layout, KvBlockLayout::For(c, block_tokens));
  layout = std::make_shared<const KvBlockLayout>(std::move(block_layout));
  pool = std::make_shared<KvPool>(layout->block_bytes, std::numeric_limits<size_t>::max());
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

void CpuForward::Impl::ExpertForward(const Expert& e, const float* x, size_t n,
                                     const float* weights, float* out, int threads) const {
  const size_t inter = e.w1.out, dim = e.w2.out;
  std::vector<float> g(n * inter), u(n * inter), h(n * inter);
  e.w1.Apply(x, n, g.data(), threads);
  e.w3.Apply(x, n, u.data(), threads);
  const float limit = static_cast<float>(c.swiglu_limit);
  for (size_t i = 0; i < n * inter; ++i) {
    float gate = Bf(g[i]), up = Bf(u[i]);
    if (limit > 0) {
      up = std::clamp(up, -limit, limit);
      gate = std::min(gate, limit);
    }
    float v = gate * Sigmoid(gate) * up;
    if (weights != nullptr) v = weights[i / inter] * v;
    h[i] = Bf(v);
  }
  e.w2.Apply(h.data(), n, out, threads);
  RoundBf(out, n * dim);
}

void CpuForward::Impl::Moe(int l, const float* x, size_t n, float* out, int threads) const {
  const Layer& L = layers[l];
  const size_t dim = static_cast<size_t>(c.hidden_size);
  const size_t E = static_cast<size_t>(c.n_routed_experts);
  std::vector<float> scores(n * E);
  k::DenseLinear(x, n, dim, L.gate_w.data(), E, scores.data(), threads);
  std::vector<std::vector<std::pair<size_t, float>>> routed(E);  // expert -> (token, weight)
  for (size_t t = 0; t < n; ++t) {
    std::vector<float> s(E), biased(E);
    for (size_t e = 0; e < E; ++e) {
      const float v = scores[t * E + e];
      // Softmax scores are normalised below, once every expert's score is known.
      s[e] = c.scoring_func == "softmax"   ? v
             : c.scoring_func == "sigmoid" ? Sigmoid(v)
                                           : SqrtSoftplus(v);
    }
    if (c.scoring_func == "softmax") {
      float mx = *std::max_element(s.begin(), s.end()), sum = 0;
      for (float& v : s) sum += (v = std::exp(v - mx));
      for (float& v : s) v /= sum;
    }
    for (size_t e = 0; e < E; ++e) biased[e] = s[e] + L.gate_bias[e];
    std::vector<int64_t> top = TopK(biased, static_cast<size_t>(c.num_experts_per_tok));
    float sum = 0;
    for (int64_t e : top) sum += s[e];
    for (int64_t e : top) {
      float w = s[e];
      if (c.norm_topk_prob && top.size() > 1) w /= sum + 1e-20f;
      w *= static_cast<float>(c.routed_scaling_factor);
      routed[e].push_back({t, w});
    }
  }
  std::vector<float> y(n * dim, 0.0f);
  for (size_t e = 0; e < E; ++e) {
    if (routed[e].empty()) continue;
    const size_t m = routed[e].size();
    std::vector<float> xe(m * dim), we(m), oe(m * dim);
    for (size_t i = 0; i < m; ++i) {
      std::memcpy(&xe[i * dim], x + routed[e][i].first * dim, dim * sizeof(float));
      we[i] = routed[e][i].second;
    }
    ExpertForward(L.experts[e], xe.data(), m, we.data(), oe.data(), threads);
    for (size_t i = 0; i < m; ++i) {
      for (size_t d = 0; d < dim; ++d) y[routed[e][i].first * dim + d] += oe[i * dim + d];
    }
  }
  std::vector<float> shared(n * dim);
  ExpertForward(L.shared, x, n, nullptr, shared.data(), threads);
  for (size_t i = 0; i < n * dim; ++i) out[i] = Bf(y[i] + shared[i]);
}

Status CpuForward::Impl::Attention(int l, SequenceState* st, const float* x, size_t n, int64_t P,
                                   int64_t window_floor, float* out,
                                   std::vector<int64_t>* selection, std::vector<char>* cand,
                                   int threads, ForwardTrace* trace) const {
  const Layer& L = layers[l];
  const LayerPlan& plan = c.layers[l];
  const size_t dim = static_cast<size_t>(c.hidden_size);
  const size_t H = static_cast<size_t>(c.num_attention_heads);
  const size_t hd = static_cast<size_t>(c.head_dim);
  const size_t rd = static_cast<size_t>(c.qk_rope_head_dim);
  const size_t qlr = static_cast<size_t>(c.q_lora_rank);
  const int64_t win = c.sliding_window;

  // Queries.
  std::vector<float> qr(n * qlr), q(n * H * hd);
  L.wq_a.Apply(x, n, qr.data(), threads);
  for (size_t t = 0; t < n; ++t) {
    RoundBf(&qr[t * qlr], qlr);
    RmsNorm(&qr[t * qlr], qlr, L.q_norm, c.rms_norm_eps);
  }
  L.wq_b.Apply(qr.data(), n, q.data(), threads);
  RoundBf(q.data(), q.size());
  for (size_t t = 0; t < n; ++t) {
    for (size_t h = 0; h < H; ++h) Rope(&q[(t * H + h) * hd + hd - rd], L.freqs, P + t, false);
  }

  // Window keys (= values): FP8 with a UE8M0 scale per 32, rotated.
  std::vector<float> kv(n * hd);
  L.wkv.Apply(x, n, kv.data(), threads);
  for (size_t t = 0; t < n; ++t) {
    float* row = &kv[t * hd];
    RoundBf(row, hd);
    RmsNorm(row, hd, L.kv_norm, c.rms_norm_eps);
    Rope(row + hd - rd, L.freqs, P + t, false);
    k::RoundTripFp8(row, hd, 32);
  }
  SequenceState::Ring& ring = st->rings[l];
  auto window_row = [&](int64_t pos, float* dst) {
    if (pos >= P) {
      std::memcpy(dst, &kv[(pos - P) * hd], hd * sizeof(float));
    } else {
      const size_t slot = static_cast<size_t>(pos % win);
      k::DequantizeFp8PerBlock(&ring.codes[slot * hd], &ring.scales[slot * hd / 32], hd, 32, dst);
    }
  };

  // Compressed KV, written by KV sources before anyone reads it.
  const int ratio = plan.compress_ratio;
  if (plan.is_kv_source) {
    SequenceState::Source& src = st->sources[l];
    std::vector<float> latents;  // Completed groups of this chunk, pre-RoPE, [g, hd]
    std::vector<int64_t> groups;
    if (ratio == 1) {
      latents.resize(n * hd);
      L.comp_wkv.Apply(x, n, latents.data(), threads);
      for (size_t t = 0; t < n; ++t) {
        RoundBf(&latents[t * hd], hd);
        RmsNorm(&latents[t * hd], hd, L.comp_norm, c.rms_norm_eps);
        groups.push_back(P + static_cast<int64_t>(t));
      }
    } else {
      std::vector<float> kvp(n * hd), score(n * hd);
      L.comp_wkv.Apply(x, n, kvp.data(), threads);
      L.comp_wgate.Apply(x, n, score.data(), threads);
      for (size_t t = 0; t < n; ++t) {
        const int64_t pos = P + static_cast<int64_t>(t);
        const size_t slot = static_cast<size_t>(pos % ratio);
        std::memcpy(&src.kv_partial[slot * hd], &kvp[t * hd], hd * sizeof(float));
        std::memcpy(&src.score_partial[slot * hd], &score[t * hd], hd * sizeof(float));
        if ((pos + 1) % ratio != 0) continue;
        std::vector<float> pooled(hd);
        for (size_t d = 0; d < hd; ++d) {
          float mx = kNegInf;
          for (int s = 0; s < ratio; ++s) mx = std::max(mx, src.score_partial[s * hd + d]);
          float sum = 0;
          for (int s = 0; s < ratio; ++s) sum += std::exp(src.score_partial[s * hd + d] - mx);
          float acc = 0;
          for (int s = 0; s < ratio; ++s) {
            acc +=
                src.kv_partial[s * hd + d] * (std::exp(src.score_partial[s * hd + d] - mx) / sum);
          }
          pooled[d] = Bf(acc);
        }
        RmsNorm(pooled.data(), hd, L.comp_norm, c.rms_norm_eps);
        latents.insert(latents.end(), pooled.begin(), pooled.end());
        groups.push_back(pos / ratio);
      }
    }
    const size_t idd = static_cast<size_t>(c.index_head_dim);
    for (size_t g = 0; g < groups.size(); ++g) {
      float* latent = &latents[g * hd];
      const int64_t rope_pos = groups[g] * ratio;  // A group stands for its first token.
      if (rope_pos + ratio <= st->frozen_tokens) {
        src.entries += 1;  // Restored from the cache: final already.
        continue;
      }
      StatusOr<uint8_t*> row = st->MutableRow(l, src.entries);
      if (!row.ok()) return row.status();
      uint8_t* kv_row = *row;
      if (plan.owns_index_keys) {
        std::vector<float> key(idd);
        L.idx_wk.Apply(latent, 1, key.data(), 1);
        RoundBf(key.data(), idd);
        RmsNorm(key.data(), idd, L.idx_k_norm, c.rms_norm_eps);
        Rope(key.data() + idd - rd, L.freqs, rope_pos, false);
        uint8_t* key_row = kv_row + hd / 2 + hd / 16;
        k::QuantizeFp4E8M0(key.data(), idd, 32, key_row, key_row + idd / 2);
      }
      Rope(latent + hd - rd, L.freqs, rope_pos, false);
      k::QuantizeFp4E4M3(latent, hd, 16, kv_row, kv_row + hd / 2);
      src.entries += 1;
    }
  }

  // Which compressed entries each query attends to.
  if (plan.is_index_source) {
    const size_t ih = static_cast<size_t>(c.index_n_heads);
    const size_t idd = static_cast<size_t>(c.index_head_dim);
    std::vector<float> iq(n * ih * idd), w(n * ih);
    L.idx_wq_b.Apply(qr.data(), n, iq.data(), threads);
    RoundBf(iq.data(), iq.size());
    L.idx_weights_proj.Apply(x, n, w.data(), threads);
    const float wscale =
        static_cast<float>(std::pow(double(idd), -0.5) * std::pow(double(ih), -0.5));
    for (float& v : w) v = Bf(Bf(v) * wscale);
    const int64_t width = (P + static_cast<int64_t>(n)) / ratio;
    std::vector<float> keys(static_cast<size_t>(width) * idd);
    for (int64_t j = 0; j < width; ++j) {
      const uint8_t* key_row = st->Row(plan.kv_source, j) + hd / 2 + hd / 16;
      k::DequantizeFp4E8M0(key_row, key_row + idd / 2, idd, 32, &keys[j * idd]);
    }
    // Each query's choice is its own, so queries are spread over the threads.
    auto select = [&](size_t t) {
      const int64_t pos = P + static_cast<int64_t>(t);
      for (size_t h = 0; h < ih; ++h) {
        float* qh = &iq[(t * ih + h) * idd];
        Rope(qh + idd - rd, L.freqs, pos, false);
        k::RoundTripFp4E8M0(qh, idd, 32);
      }
      // Only the entries this query can see take part, so the choice for a token never depends
      // on how many tokens share its call (the reference's decode step does the same).
      const int64_t visible = (pos + 1) / ratio;
      std::vector<float> score(static_cast<size_t>(visible), kNegInf);
      for (int64_t j = 0; j < visible; ++j) {
        float total = 0;
        for (size_t h = 0; h < ih; ++h) {
          const float* qh = &iq[(t * ih + h) * idd];
          const float dot = Dot(qh, &keys[j * idd], idd);
          total += Bf(std::max(Bf(dot), 0.0f) * w[t * ih + h]);
        }
        score[j] = Bf(total);
      }
      if (plan.is_candidate_source) {
        // Level one: the best blocks of candidate_block_size positions; the newest pinned.
        const int64_t bs = c.candidate_block_size;
        const int64_t blocks = (visible + bs - 1) / bs;
        std::vector<float> block_score(static_cast<size_t>(blocks), kNegInf);
        for (int64_t j = 0; j < visible; ++j) {
          block_score[j / bs] = std::max(block_score[j / bs], score[j]);
        }
        if (visible > 0) block_score[(visible - 1) / bs] = std::numeric_limits<float>::infinity();
        std::vector<char>& keep = cand[t];
        keep.assign(static_cast<size_t>(visible), 0);
        for (int64_t b : TopK(block_score, static_cast<size_t>(c.candidate_topk_blocks))) {
          if (block_score[b] == kNegInf) continue;
          for (int64_t j = b * bs; j < std::min(visible, (b + 1) * bs); ++j) keep[j] = 1;
        }
      } else if (plan.uses_candidates) {
        const std::vector<char>& keep = cand[t];
        for (int64_t j = 0; j < visible; ++j) {
          if (j >= static_cast<int64_t>(keep.size()) || !keep[j]) score[j] = kNegInf;
        }
      }
      std::vector<int64_t> top = TopK(score, static_cast<size_t>(c.index_topk));
      std::vector<int64_t>& sel = selection[t];
      sel.clear();
      for (int64_t j : top) {
        if (j < visible) sel.push_back(j);
      }
      std::sort(sel.begin(), sel.end());
    };
    k::ParallelRanges(n, threads, [&](size_t begin, size_t end) {
      for (size_t t = begin; t < end; ++t) select(t);
    });
    if (trace != nullptr) {
      for (size_t t = 0; t < n; ++t) {
        trace->selections.push_back({l, P + static_cast<int64_t>(t), selection[t]});
      }
    }
  }

  // Sparse attention over the window and the selected compressed entries, with sinks.
  std::vector<float> o(n * H * hd);
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  auto attend = [&](size_t t) {
    const int64_t pos = P + static_cast<int64_t>(t);
    std::vector<float> keys;
    for (int64_t p = std::max<int64_t>(window_floor, pos - win + 1); p <= pos; ++p) {
      keys.resize(keys.size() + hd);
      window_row(p, &keys[keys.size() - hd]);
    }
    if (ratio > 0) {
      for (int64_t j : selection[t]) {
        keys.resize(keys.size() + hd);
        const uint8_t* kv_row = st->Row(plan.kv_source, j);
        k::DequantizeFp4E4M3(kv_row, kv_row + hd / 2, hd, 16, &keys[keys.size() - hd]);
      }
    }
    const size_t nk = keys.size() / hd;
    std::vector<float> logit(nk);
    for (size_t h = 0; h < H; ++h) {
      const float* qh = &q[(t * H + h) * hd];
      float mx = L.attn_sink[h];
      for (size_t j = 0; j < nk; ++j) {
        float dot = 0;
        for (size_t d = 0; d < hd; ++d) dot += qh[d] * keys[j * hd + d];
        logit[j] = dot * scale;
        mx = std::max(mx, logit[j]);
      }
      float denom = std::exp(L.attn_sink[h] - mx);
      for (size_t j = 0; j < nk; ++j) denom += (logit[j] = std::exp(logit[j] - mx));
      float* oh = &o[(t * H + h) * hd];
      for (size_t d = 0; d < hd; ++d) {
        float acc = 0;
        for (size_t j = 0; j < nk; ++j) acc += (logit[j] / denom) * keys[j * hd + d];
        oh[d] = Bf(acc);
      }
      Rope(oh + hd - rd, L.freqs, pos, true);
    }
  };
  k::ParallelRanges(n, threads, [&](size_t begin, size_t end) {
    for (size_t t = begin; t < end; ++t) attend(t);
  });

  // Grouped output LoRA (BF16), then wo_b.
  const size_t G = static_cast<size_t>(c.o_groups);
  const size_t olr = static_cast<size_t>(c.o_lora_rank);
  const size_t gin = H * hd / G;
  std::vector<float> og(n * G * olr);
  for (size_t t = 0; t < n; ++t) {
    for (size_t g = 0; g < G; ++g) {
      k::DenseLinear(&o[t * H * hd + g * gin], 1, gin, &L.wo_a[g * olr * gin], olr,
                     &og[(t * G + g) * olr], 1);
    }
  }
  RoundBf(og.data(), og.size());
  L.wo_b.Apply(og.data(), n, out, threads);
  RoundBf(out, n * dim);

  // The window ring keeps the last `win` rows.
  for (size_t t = n > static_cast<size_t>(win) ? n - win : 0; t < n; ++t) {
    const size_t slot = static_cast<size_t>((P + static_cast<int64_t>(t)) % win);
    k::QuantizeFp8PerBlock(&kv[t * hd], hd, 32, &ring.codes[slot * hd],
                           &ring.scales[slot * hd / 32]);
  }
  return Status::Ok();
}

CpuForward::CpuForward(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CpuForward::~CpuForward() = default;

StatusOr<std::unique_ptr<CpuForward>> CpuForward::Create(const Model& model,
                                                         const std::string& tokenizer_json,
                                                         int64_t block_tokens) {
  auto impl = std::make_unique<Impl>();
  impl->block_tokens = block_tokens;
  FLASHD_RETURN_IF_ERROR(impl->Prepare(model, tokenizer_json));
  return std::unique_ptr<CpuForward>(new CpuForward(std::move(impl)));
}

const ModelConfig& CpuForward::config() const { return impl_->c; }
int64_t CpuForward::block_tokens() const { return impl_->layout->block_tokens; }

const std::shared_ptr<KvPool>& CpuForward::pool() const { return impl_->pool; }

StatusOr<SequenceState> RestoreSequence(std::string_view bytes, std::shared_ptr<KvPool> pool,
                                        std::shared_ptr<const KvBlockLayout> layout,
                                        std::vector<int32_t> leading_blocks);

StatusOr<SequenceState> CpuForward::Restore(std::string_view snapshot,
                                            std::vector<int32_t> leading_blocks) const {
  FLASHD_ASSIGN_OR_RETURN(SequenceState s, RestoreSequence(snapshot, impl_->pool, impl_->layout,
                                                           std::move(leading_blocks)));
  if (s.rings.size() != static_cast<size_t>(impl_->c.num_hidden_layers) ||
      s.sources.size() != static_cast<size_t>(impl_->c.num_hidden_layers)) {
    return DataLoss("sequence snapshot: made for a model with another number of layers");
  }
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

int64_t CpuForward::engram_classes() const {
  return impl_->engram ? impl_->c.engram_compressed_vocab_size : 0;
}

SequenceState CpuForward::NewSequence() const {
  const ModelConfig& c = impl_->c;
  SequenceState s;
  const size_t hd = static_cast<size_t>(c.head_dim);
  const size_t win = static_cast<size_t>(c.sliding_window);
  s.rings.resize(c.num_hidden_layers);
  for (auto& r : s.rings) {
    r.codes.assign(win * hd, 0);
    r.scales.assign(win * hd / 32, 127);
  }
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
  const Impl& m = *impl_;
  const ModelConfig& c = m.c;
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
    if (it.state->rings.size() != static_cast<size_t>(c.num_hidden_layers)) {
      return InvalidArgument("forward: sequence state does not belong to this model");
    }
  }
  const int threads =
      options.threads > 0 ? options.threads : std::max(1u, std::thread::hardware_concurrency());
  const size_t dim = static_cast<size_t>(c.hidden_size);
  const size_t hc = static_cast<size_t>(c.hc_mult);
  const size_t mix = (2 + hc) * hc;
  const float hc_eps = static_cast<float>(c.hc_eps);

  // Rows of the batch: each sequence's tokens, one after another.
  struct Segment {
    size_t offset, count;
    int64_t start;         // Position of the first row.
    int64_t window_floor;  // Window rows before this position are not attended (replay).
  };
  std::vector<Segment> segs;
  std::vector<int32_t> tokens;
  for (const BatchItem& it : items) {
    segs.push_back({tokens.size(), it.tokens.size(), it.state->position, 0});
    tokens.insert(tokens.end(), it.tokens.begin(), it.tokens.end());
  }
  size_t n = tokens.size();

  // Engram rows for every token, and each sequence's history.
  const int cols = m.engram ? m.engram->columns() : 0;
  const size_t n_engram = c.engram_layer_ids.size();
  const size_t engram_stride = n_engram * static_cast<size_t>(cols);
  std::vector<int64_t> engram_rows(n * engram_stride);
  if (m.engram) {
    for (size_t i = 0; i < items.size(); ++i) {
      std::vector<int32_t>& history = items[i].state->engram_classes;
      for (size_t t = segs[i].offset; t < segs[i].offset + segs[i].count; ++t) {
        history.push_back(m.engram->ClassOf(tokens[t]));
        const int count = std::min<int>(m.engram->history() + 1, static_cast<int>(history.size()));
        m.engram->Hash(history.data() + history.size() - count, count,
                       &engram_rows[t * engram_stride]);
        if (options.trace != nullptr) {
          options.trace->engram_rows.emplace_back(engram_rows.begin() + t * engram_stride,
                                                  engram_rows.begin() + (t + 1) * engram_stride);
        }
        if (static_cast<int>(history.size()) > m.engram->history()) {
          history.erase(history.begin(), history.end() - m.engram->history());
        }
      }
    }
  }

  // The residual stream: hc copies of every token's embedding.
  std::vector<float> X(n * hc * dim);
  for (size_t t = 0; t < n; ++t) {
    for (size_t h = 0; h < hc; ++h) {
      std::memcpy(&X[(t * hc + h) * dim], &m.embed[static_cast<size_t>(tokens[t]) * dim],
                  dim * sizeof(float));
    }
  }
  std::vector<float> pre_mix(n * hc, 0.0f);
  for (size_t t = 0; t < n; ++t) pre_mix[t * hc] = 1.0f;

  std::vector<std::vector<int64_t>> selection(n);
  std::vector<std::vector<char>> candidates(n);
  std::vector<float> x(n * dim), sub(n * dim), mixes(n * mix);
  std::vector<float> pre_a(n * hc), post(n * hc), comb(n * hc * hc), pre_f(n * hc);

  // mixes = (flatten(X) . fn^T) * rsqrt(mean(X^2) + eps), then split into pre/post/comb.
  auto hc_mixes = [&](const std::vector<float>& fn, const std::vector<float>& scale,
                      const std::vector<float>& base, float* pre_out) {
    k::DenseLinear(X.data(), n, hc * dim, fn.data(), mix, mixes.data(), threads);
    for (size_t t = 0; t < n; ++t) {
      double sum = 0;
      for (size_t i = 0; i < hc * dim; ++i)
        sum += double(X[t * hc * dim + i]) * X[t * hc * dim + i];
      const float r = 1.0f / std::sqrt(static_cast<float>(sum / (hc * dim)) +
                                       static_cast<float>(c.rms_norm_eps));
      for (size_t j = 0; j < mix; ++j) mixes[t * mix + j] *= r;
      HcSplit(&mixes[t * mix], scale, base, static_cast<int>(hc), c.hc_sinkhorn_iters, hc_eps,
              pre_out + t * hc, &post[t * hc], &comb[t * hc * hc]);
    }
  };
  auto collapse = [&](const float* weights, const std::vector<float>& norm) {
    for (size_t t = 0; t < n; ++t) {
      for (size_t d = 0; d < dim; ++d) {
        float acc = 0;
        for (size_t h = 0; h < hc; ++h) acc += weights[t * hc + h] * X[(t * hc + h) * dim + d];
        x[t * dim + d] = Bf(acc);
      }
      if (!norm.empty()) RmsNorm(&x[t * dim], dim, norm, c.rms_norm_eps);
    }
  };
  auto expand = [&]() {  // X[j] = post[j] * sub + sum_i comb[i][j] * X[i]
    std::vector<float> next(X.size());
    for (size_t t = 0; t < n; ++t) {
      for (size_t j = 0; j < hc; ++j) {
        for (size_t d = 0; d < dim; ++d) {
          float acc = post[t * hc + j] * sub[t * dim + d];
          float mixed = 0;
          for (size_t i = 0; i < hc; ++i)
            mixed += comb[(t * hc + i) * hc + j] * X[(t * hc + i) * dim + d];
          next[(t * hc + j) * dim + d] = Bf(acc + mixed);
        }
      }
    }
    X.swap(next);
  };
  const size_t n_layers = static_cast<size_t>(c.num_hidden_layers);
  auto force = [&](int layer) {  // X = the forced output of `layer` (batch of one).
    for (size_t t = 0; t < n; ++t) {
      std::memcpy(&X[t * hc * dim], options.forced_streams + (t * n_layers + layer) * hc * dim,
                  hc * dim * sizeof(float));
    }
  };
  // Keeps only the last `keep` rows of every longer sequence (the bounded replay).
  auto truncate = [&](size_t keep) {
    std::vector<size_t> rows;
    for (Segment& sg : segs) {
      const size_t drop = sg.count > keep ? sg.count - keep : 0;
      for (size_t t = sg.offset + drop; t < sg.offset + sg.count; ++t) rows.push_back(t);
      sg.start += static_cast<int64_t>(drop);
      sg.window_floor = drop > 0 ? sg.start : 0;
      sg.count -= drop;
    }
    size_t offset = 0;
    for (Segment& sg : segs) {
      sg.offset = offset;
      offset += sg.count;
    }
    auto gather = [&](auto& v, size_t width) {
      std::remove_reference_t<decltype(v)> out(rows.size() * width);
      for (size_t i = 0; i < rows.size(); ++i) {
        std::copy(v.begin() + rows[i] * width, v.begin() + (rows[i] + 1) * width,
                  out.begin() + i * width);
      }
      v.swap(out);
    };
    gather(X, hc * dim);
    gather(pre_mix, hc);
    gather(engram_rows, engram_stride);
    gather(selection, 1);
    gather(candidates, 1);
    gather(tokens, 1);
    n = rows.size();
    x.resize(n * dim);
    sub.resize(n * dim);
    mixes.resize(n * mix);
    pre_a.resize(n * hc);
    post.resize(n * hc);
    comb.resize(n * hc * hc);
    pre_f.resize(n * hc);
  };

  int last_kv_source = -1;
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    if (c.layers[l].is_kv_source) last_kv_source = l;
  }
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    const Layer& L = m.layers[l];
    const LayerPlan& plan = c.layers[l];
    if (options.forced_streams != nullptr && l > 0) force(l - 1);
    if (plan.engram_index >= 0) {
      const size_t hdim = static_cast<size_t>(c.engram_head_dim);
      const size_t in = static_cast<size_t>(cols) * hdim;
      std::vector<float> e(n * in), kvv(n * dim * (hc + 1));
      for (size_t t = 0; t < n; ++t) {
        for (int col = 0; col < cols; ++col) {
          const int64_t row = engram_rows[t * engram_stride + plan.engram_index * cols + col];
          float* dst = &e[t * in + col * hdim];
          k::DequantizeFp8PerBlock(L.engram_rows + row * hdim,
                                   L.engram_row_scales + row * hdim / 32, hdim, 32, dst);
          RoundBf(dst, hdim);
        }
      }
      L.engram_wkv.Apply(e.data(), n, kvv.data(), threads);
      RoundBf(kvv.data(), kvv.size());
      for (size_t t = 0; t < n; ++t) {
        const float* value = &kvv[t * dim * (hc + 1) + hc * dim];
        for (size_t h = 0; h < hc; ++h) {
          float* stream = &X[(t * hc + h) * dim];
          const float* key = &kvv[t * dim * (hc + 1) + h * dim];
          double s2 = 0, k2 = 0, dot = 0;
          for (size_t d = 0; d < dim; ++d) {
            s2 += double(stream[d]) * stream[d];
            k2 += double(key[d]) * key[d];
            dot += double(stream[d] * L.engram_qk[h * dim + d] * key[d]);
          }
          const float eps = static_cast<float>(c.rms_norm_eps);
          float rstd = (1.0f / std::sqrt(static_cast<float>(s2 / dim) + eps)) *
                       (1.0f / std::sqrt(static_cast<float>(k2 / dim) + eps));
          float g = static_cast<float>(dot) * rstd / std::sqrt(static_cast<float>(dim));
          float gate = Sigmoid(std::copysign(std::sqrt(std::max(std::fabs(g), 1e-6f)), g));
          for (size_t d = 0; d < dim; ++d) stream[d] = Bf(stream[d] + gate * value[d]);
        }
      }
    }
    // Attention sublayer: its mixes give post/comb now and the FFN's pre.
    hc_mixes(L.hc_attn_fn, L.hc_attn_scale, L.hc_attn_base, pre_a.data());
    collapse(pre_mix.data(), L.attn_norm);
    for (size_t i = 0; i < segs.size(); ++i) {
      const Segment& sg = segs[i];
      FLASHD_RETURN_IF_ERROR(m.Attention(l, items[i].state, &x[sg.offset * dim], sg.count, sg.start,
                                         sg.window_floor, &sub[sg.offset * dim],
                                         &selection[sg.offset], &candidates[sg.offset], threads,
                                         options.trace));
    }
    const bool record = options.trace != nullptr && options.trace->record_streams;
    if (record) {
      options.trace->sublayers.push_back(x);
      options.trace->sublayers.push_back(sub);
    }
    expand();
    // FFN sublayer: collapses with the attention's pre; its own pre goes to the next layer.
    hc_mixes(L.hc_ffn_fn, L.hc_ffn_scale, L.hc_ffn_base, pre_f.data());
    collapse(pre_a.data(), L.ffn_norm);
    m.Moe(l, x.data(), n, sub.data(), threads);
    if (record) {
      options.trace->sublayers.push_back(x);
      options.trace->sublayers.push_back(sub);
    }
    expand();
    pre_mix = pre_f;
    if (record) options.trace->streams.push_back(X);
    if (l == last_kv_source && options.replay_tokens > 0) {
      truncate(static_cast<size_t>(std::max<int64_t>(options.replay_tokens, c.sliding_window)));
    }
  }
  for (BatchItem& it : items) it.state->position += static_cast<int64_t>(it.tokens.size());
  if (options.forced_streams != nullptr) force(c.num_hidden_layers - 1);

  collapse(pre_mix.data(), m.final_norm);
  const size_t V = static_cast<size_t>(c.vocab_size);
  for (size_t i = 0; i < items.size(); ++i) {
    const Segment& sg = segs[i];
    const size_t first = options.all_logits ? sg.offset : sg.offset + sg.count - 1;
    const size_t rows = sg.offset + sg.count - first;
    items[i].logits->assign(rows * V, 0.0f);
    k::DenseLinear(&x[first * dim], rows, dim, m.head.data(), V, items[i].logits->data(), threads);
  }
  return Status::Ok();
}

}  // namespace flashd::engine
