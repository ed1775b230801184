#include "engine/placement_plan.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <limits>
#include <nlohmann/json.hpp>

#include "engine/model_info.h"
#include "engine/weights.h"

namespace flashd::engine {
namespace {

uint64_t Elements(const TensorSpec& t) {
  uint64_t n = 1;
  for (int64_t d : t.shape) n *= static_cast<uint64_t>(d);
  return n;
}

// Bytes a tensor takes as this build holds it: quantized tensors as stored (one byte per stored
// element: FP8, packed FP4 pairs, E8M0 scales; wo_a too, which runs as its FP8 values); BF16
// matrices as BF16 on a GPU and as the fp32 values the forward pass decodes them to on the host.
uint64_t HeldBytes(const TensorSpec& t, bool on_gpu) {
  switch (t.kind) {
    case TensorKind::kBf16:
      return Elements(t) * (on_gpu ? 2 : 4);
    case TensorKind::kF32:
      return Elements(t) * 4;
    default:
      return Elements(t);
  }
}

std::string Gib(uint64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f GiB", bytes / double(uint64_t{1} << 30));
  return buf;
}

std::string Thousands(int64_t v) {
  std::string s = std::to_string(v), out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (i > 0 && (s.size() - i) % 3 == 0) out += ',';
    out += s[i];
  }
  return out;
}

}  // namespace

StatusOr<std::vector<GpuSpec>> ParseGpus(std::string_view text) {
  std::vector<GpuSpec> out;
  if (text.empty() || text == "none") return out;
  std::string t(text);
  int64_t count = 1;
  if (const size_t x = t.find('x');
      x != std::string::npos && x > 0 && std::all_of(t.begin(), t.begin() + x, ::isdigit)) {
    count = std::stoll(t.substr(0, x));
    t = t.substr(x + 1);
  }
  if (count < 1 || count > 64) return InvalidArgument("--gpus: a count in [1, 64] expected");
  struct Known {
    const char* name;
    uint64_t gb;
  };
  static const Known kKnown[] = {{"A100", 80},    {"H100", 80},    {"H200", 141},  {"B200", 180},
                                 {"MI250X", 128}, {"MI300X", 192}, {"MI325X", 256}};
  GpuSpec spec;
  for (const Known& k : kKnown) {
    if (t == k.name) spec = {k.name, k.gb * 1000000000ull};
  }
  if (spec.memory_bytes == 0 && t.size() > 3 && t.substr(t.size() - 3) == "GiB" &&
      std::all_of(t.begin(), t.end() - 3, ::isdigit)) {
    spec = {t, std::stoull(t.substr(0, t.size() - 3)) << 30};
  }
  if (spec.memory_bytes == 0) {
    return InvalidArgument("--gpus: unknown GPU \"" + t +
                           "\" (A100, H100, H200, B200, MI250X, MI300X, MI325X, or a size such "
                           "as 96GiB)");
  }
  out.assign(static_cast<size_t>(count), spec);
  return out;
}

namespace {

// What a plan places: each layer's dense and routed-expert bytes and KV per token, the
// embedding and the head; the totals go into the plan.
struct Parts {
  std::vector<uint64_t> dense, experts;
  std::vector<double> kv;
  uint64_t embed = 0, head = 0;
};

Parts CountParts(const ModelConfig& c, bool gpu, PlacementPlan* plan) {
  const int layers = static_cast<int>(c.num_hidden_layers);
  const ModelStats stats = ComputeModelStats(c);
  plan->kv_bytes_per_token = stats.kv_bytes_per_token;
  Parts parts{std::vector<uint64_t>(layers, 0), std::vector<uint64_t>(layers, 0),
              std::vector<double>(layers, 0.0)};
  for (const KvSourceBytes& k : stats.kv_sources) parts.kv[k.layer] += k.bytes_per_token;
  for (const TensorSpec& t : ExpectedTensors(c)) {
    if (t.part == ModelPart::kDSpark || t.part == ModelPart::kVision) continue;
    const uint64_t b = HeldBytes(t, gpu);
    // The forward pass keeps its own fp32 copy of every BF16 matrix in host memory.
    if (gpu && t.kind == TensorKind::kBf16) plan->host_copies += HeldBytes(t, false);
    if (t.kind == TensorKind::kFp8Table || t.kind == TensorKind::kFp8RowScale) {
      plan->engram_bytes += b;
    } else if (t.layer < 0) {
      (t.name.find("embed") != std::string::npos ? parts.embed : parts.head) += b;
    } else if (t.expert >= 0) {
      parts.experts[t.layer] += b;
    } else {
      parts.dense[t.layer] += b;
    }
  }
  for (int l = 0; l < layers; ++l) {
    plan->dense_bytes += parts.dense[l];
    plan->expert_bytes += parts.experts[l];
  }
  return parts;
}

std::string HostMemory(const PlacementPlan& plan, const PlanOptions& o, const std::string& what,
                       uint64_t need, uint64_t usable) {
  return "host memory: " + what + " need " + Gib(need) + " and " + Gib(usable) + " is usable (" +
         Gib(o.host_ram_bytes) + " less " + Gib(o.host_reserve_bytes) + " kept free)" +
         (plan.engram_on_ssd ? "" : "; the Engram tables can stay on SSD (--engram-ssd SIZE)");
}

// Everything in host memory; "" or why it does not fit.
std::string PlanCpu(const Parts& parts, const PlanOptions& o, uint64_t host_usable,
                    PlacementPlan* plan) {
  plan->mode = PlacementPlan::Mode::kCpu;
  plan->host_weights = plan->dense_bytes + plan->expert_bytes + parts.embed + parts.head;
  const uint64_t need = plan->host_weights + plan->engram_host_bytes;
  if (need >= host_usable) {
    return HostMemory(*plan, o, "the weights and Engram tables", need, host_usable);
  }
  plan->kv_tokens = static_cast<int64_t>((host_usable - need) / plan->kv_bytes_per_token);
  plan->host_kv = static_cast<uint64_t>(plan->kv_tokens * plan->kv_bytes_per_token);
  return "";
}

// Whole layers in order over the GPUs, each taking its share of the bytes by its size (in hybrid
// mode without the routed experts). Whether every GPU's part fits.
bool SplitLayers(const Parts& parts, const PlanOptions& o, const std::vector<uint64_t>& usable,
                 bool hybrid, PlacementPlan* plan) {
  const size_t n = usable.size();
  const int layers = static_cast<int>(parts.dense.size());
  uint64_t total_usable = 0;
  for (uint64_t u : usable) total_usable += u;
  std::vector<uint64_t> layer_bytes(layers);
  uint64_t total = parts.embed + parts.head;
  for (int l = 0; l < layers; ++l) {
    layer_bytes[l] = parts.dense[l] + (hybrid ? 0 : parts.experts[l]);
    total += layer_bytes[l];
  }
  plan->gpus.assign(n, {});
  const double per_usable = double(total) / double(std::max<uint64_t>(total_usable, 1));
  double done = double(parts.embed), share_end = per_usable * double(usable[0]);
  size_t g = 0;
  plan->gpus[0].weights = parts.embed;
  for (int l = 0; l < layers; ++l) {
    while (g + 1 < n && done + double(layer_bytes[l]) / 2 > share_end) {
      ++g;
      share_end += per_usable * double(usable[g]);
    }
    plan->layer_gpu[l] = static_cast<int>(g);
    plan->gpus[g].weights += layer_bytes[l];
    plan->gpus[g].kv_per_token += parts.kv[l];
    done += double(layer_bytes[l]);
  }
  plan->gpus[plan->layer_gpu[layers - 1]].weights += parts.head;
  bool fits = true;
  for (size_t i = 0; i < n; ++i) {
    plan->gpus[i].name = o.gpus[i].name;
    plan->gpus[i].memory = o.gpus[i].memory_bytes;
    plan->gpus[i].reserve = o.gpu_reserve_bytes;
    fits = fits && plan->gpus[i].weights < usable[i];
  }
  plan->mode = hybrid ? PlacementPlan::Mode::kHybrid : PlacementPlan::Mode::kGpu;
  plan->host_weights = hybrid ? plan->expert_bytes : 0;
  return fits;
}

// All layers on the GPUs if they fit, else the routed experts in host memory; "" or why not.
std::string PlanGpus(const ModelConfig& c, const Parts& parts, const PlanOptions& o,
                     uint64_t host_usable, PlacementPlan* plan) {
  const size_t n = o.gpus.size();
  std::vector<uint64_t> usable(n);
  for (size_t g = 0; g < n; ++g) {
    usable[g] = o.gpus[g].memory_bytes > o.gpu_reserve_bytes
                    ? o.gpus[g].memory_bytes - o.gpu_reserve_bytes
                    : 0;
  }
  if (!SplitLayers(parts, o, usable, false, plan) && !SplitLayers(parts, o, usable, true, plan)) {
    uint64_t worst = 0;
    size_t at = 0;
    for (size_t i = 0; i < n; ++i) {
      if (plan->gpus[i].weights > usable[i] && plan->gpus[i].weights - usable[i] > worst) {
        worst = plan->gpus[i].weights - usable[i];
        at = i;
      }
    }
    return "GPU " + std::to_string(at) + ": even without the routed experts its layers need " +
           Gib(plan->gpus[at].weights) + " and " + Gib(usable[at]) + " is usable";
  }
  const uint64_t host_need = plan->host_weights + plan->engram_host_bytes + plan->host_copies;
  if (host_need >= host_usable) {
    return HostMemory(*plan, o,
                      std::string(plan->host_weights > 0 ? "the routed experts, " : "") +
                          "the Engram tables and the fp32 copies of the BF16 matrices",
                      host_need, host_usable);
  }
  // KV: every GPU holds the KV of its layers for the same tokens; the tightest decides.
  double tokens = std::numeric_limits<double>::infinity();
  for (size_t i = 0; i < n; ++i) {
    if (plan->gpus[i].kv_per_token > 0) {
      tokens =
          std::min(tokens, double(usable[i] - plan->gpus[i].weights) / plan->gpus[i].kv_per_token);
    }
  }
  if (!std::isfinite(tokens)) tokens = double(c.max_position_embeddings);
  plan->kv_tokens = static_cast<int64_t>(tokens);
  for (auto& d : plan->gpus) d.kv = static_cast<uint64_t>(plan->kv_tokens * d.kv_per_token);
  return "";
}

}  // namespace

PlacementPlan MakePlan(const ModelConfig& c, const PlanOptions& o) {
  PlacementPlan plan;
  const Parts parts = CountParts(c, !o.gpus.empty(), &plan);
  plan.engram_on_ssd = o.engram_ssd_cache_bytes >= 0 && plan.engram_bytes > 0;
  plan.engram_host_bytes =
      plan.engram_on_ssd
          ? std::min<uint64_t>(plan.engram_bytes, static_cast<uint64_t>(o.engram_ssd_cache_bytes))
          : plan.engram_bytes;
  plan.host_memory = o.host_ram_bytes;
  plan.host_reserve = o.host_reserve_bytes;
  plan.layer_gpu.assign(static_cast<size_t>(c.num_hidden_layers), -1);
  const uint64_t host_usable =
      o.host_ram_bytes > o.host_reserve_bytes ? o.host_ram_bytes - o.host_reserve_bytes : 0;
  std::string why = o.gpus.empty() ? PlanCpu(parts, o, host_usable, &plan)
                                   : PlanGpus(c, parts, o, host_usable, &plan);
  if (why.empty()) {
    plan.sequences = plan.kv_tokens / std::max<int64_t>(o.context_tokens, 1);
    if (plan.sequences < 1) {
      why = "KV: room for " + Thousands(plan.kv_tokens) + " tokens, less than one context of " +
            Thousands(o.context_tokens);
    }
  }
  plan.fits = why.empty();
  plan.why_not = std::move(why);
  return plan;
}

std::string DescribePlan(const PlacementPlan& p, const PlanOptions& o) {
  std::string s;
  auto line = [&](const std::string& t) { s += t + "\n"; };
  std::string machine = o.gpus.empty() ? "no GPU"
                                       : std::to_string(o.gpus.size()) + " x " + o.gpus[0].name +
                                             " (" + Gib(o.gpus[0].memory_bytes) + " each)";
  line("machine: " + machine + ", host memory " + Gib(o.host_ram_bytes));
  line("model: " + std::to_string(p.layer_gpu.size()) + " layers; dense parts " +
       Gib(p.dense_bytes) + ", routed experts " + Gib(p.expert_bytes) + ", Engram tables " +
       Gib(p.engram_bytes) + " (as held: FP8/FP4 as stored, BF16 as " +
       (p.gpus.empty() ? "fp32)" : "BF16)"));
  const char* mode = p.mode == PlacementPlan::Mode::kGpu      ? "every layer on the GPUs"
                     : p.mode == PlacementPlan::Mode::kHybrid ? "hybrid: attention and dense "
                                                                "parts on the GPUs, routed "
                                                                "experts in host memory on "
                                                                "the CPU"
                                                              : "everything on the CPU";
  line(std::string("mode: ") + mode);
  for (size_t g = 0; g < p.gpus.size(); ++g) {
    int first = -1, last = -1;
    for (size_t l = 0; l < p.layer_gpu.size(); ++l) {
      if (p.layer_gpu[l] == static_cast<int>(g)) {
        if (first < 0) first = static_cast<int>(l);
        last = static_cast<int>(l);
      }
    }
    const auto& d = p.gpus[g];
    line("  GPU " + std::to_string(g) + " (" + d.name + "): layers " +
         (first < 0 ? std::string("none") : std::to_string(first) + "-" + std::to_string(last)) +
         ", weights " + Gib(d.weights) + ", KV " + Gib(d.kv) + ", kept free " + Gib(d.reserve) +
         ", of " + Gib(d.memory));
  }
  line("  host: " + (p.host_weights > 0 ? "weights " + Gib(p.host_weights) + ", " : "") +
       (p.host_copies > 0 ? "fp32 copies of BF16 matrices " + Gib(p.host_copies) + ", " : "") +
       (p.engram_on_ssd ? "Engram hot-row cache " + Gib(p.engram_host_bytes) + " (tables on SSD)"
                        : "Engram tables " + Gib(p.engram_host_bytes)) +
       (p.host_kv > 0 ? ", KV " + Gib(p.host_kv) : "") + ", kept free " + Gib(p.host_reserve) +
       ", of " + Gib(p.host_memory));
  if (!p.fits) {
    line("does not fit: " + p.why_not);
    return s;
  }
  char kv[160];
  std::snprintf(kv, sizeof kv, "KV: %.1f bytes per token; ", p.kv_bytes_per_token);
  line(std::string(kv) + Thousands(p.kv_tokens) + " tokens in all: " + Thousands(p.sequences) +
       " sequences of " + Thousands(o.context_tokens) + " tokens");
  return s;
}

std::string PlanJson(const PlacementPlan& p) {
  nlohmann::json gpus = nlohmann::json::array();
  for (const auto& d : p.gpus) {
    gpus.push_back({{"name", d.name},
                    {"memory_bytes", d.memory},
                    {"weights_bytes", d.weights},
                    {"kv_bytes", d.kv},
                    {"reserve_bytes", d.reserve}});
  }
  const char* mode = p.mode == PlacementPlan::Mode::kGpu      ? "gpu"
                     : p.mode == PlacementPlan::Mode::kHybrid ? "hybrid"
                                                              : "cpu";
  nlohmann::json j = {{"fits", p.fits},
                      {"mode", mode},
                      {"layer_gpu", p.layer_gpu},
                      {"gpus", gpus},
                      {"host_weights_bytes", p.host_weights},
                      {"host_copies_bytes", p.host_copies},
                      {"engram_bytes", p.engram_bytes},
                      {"engram_host_bytes", p.engram_host_bytes},
                      {"engram_on_ssd", p.engram_on_ssd},
                      {"host_kv_bytes", p.host_kv},
                      {"kv_bytes_per_token", p.kv_bytes_per_token},
                      {"kv_tokens", p.kv_tokens},
                      {"sequences", p.sequences}};
  if (!p.fits) j["why_not"] = p.why_not;
  return j.dump();
}

}  // namespace flashd::engine
