// Top-k in the total order and the MoE router on the device. Top-k: a thread block per row
// selects in the total order (value descending, then index ascending, NaN first;
// block_select.h), the CPU's order exactly; the router likewise, a thread block per token. The
// reference's libstdc++ order exists on the CPU only.
#include <cmath>
#include <type_traits>

#include "kernels/fmath.h"
#include "kernels/gpu/arrive.h"
#include "kernels/gpu/block_select.h"
#include "kernels/gpu/dense_gemv.h"
#include "kernels/gpu/ops.h"
#include "kernels/gpu/portability.h"

namespace flashd::kernels::FLASHD_GPU_BACKEND {
namespace {

namespace fm = flashd::kernels::fmath;

// One thread block per row.
constexpr unsigned kSelectThreads = 256;
// The most picks an ascending row sorts in shared memory: 44 KB, which with BlockSelectTop's own
// (about 1 KB) stays within the 48 KB a launch has without asking for more.
constexpr int64_t kAscendingMost = 5632;

// Ascending: the picks then go to shared memory ([k] indices, dynamic) and each to the place its
// rank among them gives (the indices are distinct).
__global__ void TopKKernel(const float* values, int64_t stride, int64_t k, const int64_t* n,
                           bool ascending, int64_t* out) {
  FLASHD_GRID_BEGIN();
  const int64_t r = blockIdx.x;
  const int64_t count = n[r] < stride ? n[r] : stride;
  int64_t* row = out + r * k;
  const int64_t got =
      gpu_select::BlockSelectTop<kSelectThreads>(values + r * stride, count, k, row);
  for (int64_t i = got + threadIdx.x; i < k; i += kSelectThreads) row[i] = -1;
  if (!ascending) return;
  FLASHD_DYNAMIC_SHARED(int64_t, picks);
  __syncthreads();
  for (int64_t i = threadIdx.x; i < got; i += kSelectThreads) picks[i] = row[i];
  __syncthreads();
  for (int64_t i = threadIdx.x; i < got; i += kSelectThreads) {
    const int64_t v = picks[i];
    int64_t rank = 0;
    for (int64_t j = 0; j < got; ++j) rank += picks[j] < v ? 1 : 0;
    row[rank] = v;
  }
}

// One thread block per token: the experts' scores a thread per expert (a softmax's sum by one
// thread, in expert order, as on the CPU), the top k by BlockSelectTop, then the weights by one
// thread in rank order.
// Token t's routing by the thread block (every thread returns from it). kFresh: the logits were
// written by other thread blocks of the kernel, so they are read as volatile.
template <bool kFresh = false>
FLASHD_SHARED_TILE __device__ void RouteToken(int64_t t, const float* logits_in, const float* bias,
                                              int64_t E, int64_t k, int scoring, bool norm_topk,
                                              float scale, float* scores, float* biased,
                                              int64_t* chosen, float* weights) {
  __shared__ float softmax_max, softmax_sum;
  using Logit = std::conditional_t<kFresh, const volatile float, const float>;
  Logit* logits = logits_in;
  const unsigned tid = threadIdx.x;
  float* s = scores + t * E;
  float* b = biased + t * E;
  const bool softmax = scoring == static_cast<int>(RouteScoring::kSoftmax);
  for (int64_t e = tid; e < E; e += kSelectThreads) {
    const float v = logits[t * E + e];
    if (softmax) {
      s[e] = v;
    } else if (scoring == static_cast<int>(RouteScoring::kSigmoid)) {
      s[e] = fm::Sigmoid(v);
    } else {
      s[e] = sqrtf(v > 20.0f ? v : fm::Softplus(v));
    }
  }
  if (softmax) {
    __syncthreads();
    if (tid == 0) {
      float mx = s[0];
      for (int64_t e = 1; e < E; ++e) mx = s[e] > mx ? s[e] : mx;
      softmax_max = mx;
    }
    __syncthreads();
    for (int64_t e = tid; e < E; e += kSelectThreads) s[e] = fm::Exp(s[e] - softmax_max);
    __syncthreads();
    if (tid == 0) {
      float sum = 0;
      for (int64_t e = 0; e < E; ++e) sum += s[e];
      softmax_sum = sum;
    }
    __syncthreads();
    for (int64_t e = tid; e < E; e += kSelectThreads) s[e] /= softmax_sum;
  }
  for (int64_t e = tid; e < E; e += kSelectThreads) b[e] = s[e] + bias[e];
  __syncthreads();
  int64_t* top = chosen + t * k;
  gpu_select::BlockSelectTop<kSelectThreads>(b, E, k, top);
  if (tid != 0) return;
  float sum = 0;
  for (int64_t i = 0; i < k; ++i) sum += s[top[i]];
  for (int64_t i = 0; i < k; ++i) {
    float w = s[top[i]];
    if (norm_topk && k > 1) w /= sum + 1e-20f;
    weights[t * k + i] = w * scale;
  }
}

__global__ void __launch_bounds__(kSelectThreads)
    RouteKernel(const float* logits, const float* bias, int64_t E, int64_t k, int scoring,
                bool norm_topk, float scale, float* scores, float* biased, int64_t* chosen,
                float* weights) {
  FLASHD_GRID_BEGIN();
  RouteToken(blockIdx.x, logits, bias, E, k, scoring, norm_topk, scale, scores, biased, chosen,
             weights);
}

// MoeGroup in one thread block: a thread per expert counts its choices, thread 0 lays out the
// slots in ascending expert order, then each expert's thread writes its entries in token order.
constexpr unsigned kGroupThreads = 256;
constexpr int64_t kGroupMaxExperts = kMoeGroupMaxExperts;

// The grouping by the thread block (any number of threads). kFresh: the choices were written by
// other thread blocks of the kernel, so they are read as volatile.
template <bool kFresh>
FLASHD_SHARED_TILE __device__ void GroupChoices(const int64_t* chosen_in, const float* weights_in,
                                                int64_t tokens, int64_t E, int64_t k, int64_t slots,
                                                int64_t* slot_expert, int64_t* slot_offset,
                                                int64_t* slot_tiles, int64_t* rows,
                                                float* row_weights) {
  __shared__ int64_t count[kGroupMaxExperts];
  __shared__ int64_t start[kGroupMaxExperts];
  using Chosen = std::conditional_t<kFresh, const volatile int64_t, const int64_t>;
  using Weight = std::conditional_t<kFresh, const volatile float, const float>;
  Chosen* chosen = chosen_in;
  Weight* weights = weights_in;
  const int64_t n = tokens * k;
  for (int64_t e = threadIdx.x; e < E; e += blockDim.x) {
    int64_t c = 0;
    for (int64_t i = 0; i < n; ++i) c += chosen[i] == e ? 1 : 0;
    count[e] = c;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int64_t s = 0, offset = 0, tiles = 0;
    for (int64_t e = 0; e < E; ++e) {
      start[e] = offset;
      if (count[e] == 0) continue;
      slot_expert[s] = e;
      slot_offset[s] = offset;
      slot_tiles[s] = tiles;
      offset += count[e];
      tiles += (count[e] + kExpertTileRows - 1) / kExpertTileRows;
      ++s;
    }
    for (; s < slots; ++s) {
      slot_expert[s] = -1;
      slot_offset[s] = offset;
      slot_tiles[s] = tiles;
    }
    slot_offset[slots] = offset;
    slot_tiles[slots] = tiles;
  }
  __syncthreads();
  for (int64_t e = threadIdx.x; e < E; e += blockDim.x) {
    if (count[e] == 0) continue;
    int64_t j = start[e];
    for (int64_t i = 0; i < n; ++i) {
      if (chosen[i] != e) continue;
      rows[j] = i / k;
      row_weights[j] = weights[i];
      ++j;
    }
  }
}

__global__ void __launch_bounds__(kGroupThreads)
    GroupKernel(const int64_t* chosen, const float* weights, int64_t tokens, int64_t E, int64_t k,
                int64_t slots, int64_t* slot_expert, int64_t* slot_offset, int64_t* slot_tiles,
                int64_t* rows, float* row_weights) {
  FLASHD_GRID_BEGIN();
  GroupChoices<false>(chosen, weights, tokens, E, k, slots, slot_expert, slot_offset, slot_tiles,
                      rows, row_weights);
}

// MoeRoute and its grouping in one kernel: a thread block a token routes it and counts itself in
// `arrivals` when done; the last groups every token's choices and clears the count.
__global__ void __launch_bounds__(kSelectThreads)
    RouteGroupKernel(MoeRouteParams p, MoeGroupParams g, unsigned* arrivals) {
  FLASHD_GRID_BEGIN();
  RouteToken(blockIdx.x, p.logits, p.bias, p.experts, p.k, static_cast<int>(p.scoring), p.norm_topk,
             p.scale, p.scores, p.biased, p.chosen, p.weights);
  if (!LastToArrive(arrivals, static_cast<unsigned>(gridDim.x))) return;
  GroupChoices<true>(p.chosen, p.weights, p.tokens, p.experts, p.k, g.slots, g.slot_expert,
                     g.slot_offset, g.slot_tiles, g.rows, g.row_weights);
  if (threadIdx.x == 0) *arrivals = 0;
}

// The router's logits of one token (DenseGemvKernel's thread blocks, two experts each; fp32
// values or BF16 codes), then the last block to finish routes the token and groups its choices
// (RouteGroupKernel's steps).
static_assert(kDenseGemvThreads == kSelectThreads, "the GEMV's thread blocks route");
template <class W, bool kVectors>
__global__ void __launch_bounds__(kDenseGemvThreads)
    RouterRouteGroupKernel(const float* x, int64_t K, W w, float* logits, MoeRouteParams p,
                           MoeGroupParams g, unsigned* arrivals) {
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * kDenseGemvCols;
  PrefetchDenseColumns(w, K, p.experts, n0);
  FLASHD_GRID_BEGIN();
  DenseGemvColumns<W, kVectors>(x, K, w, p.experts, logits, n0);
  if (!LastToArrive(arrivals, static_cast<unsigned>(gridDim.x))) return;
  RouteToken<true>(0, logits, p.bias, p.experts, p.k, static_cast<int>(p.scoring), p.norm_topk,
                   p.scale, p.scores, p.biased, p.chosen, p.weights);
  __syncthreads();  // The choices and weights written.
  GroupChoices<false>(p.chosen, p.weights, 1, p.experts, p.k, g.slots, g.slot_expert, g.slot_offset,
                      g.slot_tiles, g.rows, g.row_weights);
  if (threadIdx.x == 0) *arrivals = 0;
}

}  // namespace

bool RouterInKernel(const MoeRouteParams& p) {
  if (p.router == nullptr || p.tokens != 1 || p.group == nullptr) return false;
  const LinearParams& r = *p.router;  // One row of dense weights and nothing more.
  const bool dense = (r.format == WeightFormat::kDense && r.dense != nullptr) ||
                     (r.format == WeightFormat::kBf16 && r.w != nullptr);
  return MoeRouterFits(p) && p.order == TopKOrder::kTotal && p.experts <= kGroupMaxExperts &&
         dense && r.in > 0 && r.x != nullptr && !r.round_output && r.also_count == 0 &&
         r.up == nullptr && r.y_codes == nullptr && r.rope_dim == 0;
}

OpStatus MoeGroup(const MoeGroupParams& p) {
  if (!MoeGroupFits(p) || p.experts > kGroupMaxExperts) return OpStatus::kBadShape;
  const int64_t n = p.tokens * p.k;
  if (n == 0) return OpStatus::kOk;
  FLASHD_LAUNCH(GroupKernel, 1, kGroupThreads, 0, static_cast<gpuStream_t>(p.stream), p.chosen,
                p.weights, p.tokens, p.experts, p.k, p.slots, p.slot_expert, p.slot_offset,
                p.slot_tiles, p.rows, p.row_weights);
  return gpuGetLastError() == gpuSuccess ? OpStatus::kOk : OpStatus::kDeviceError;
}

OpStatus TopK(const TopKParams& p) {
  if (p.rows < 0 || p.k < 0 || p.n == nullptr || p.out == nullptr) return OpStatus::kBadShape;
  if (p.order != TopKOrder::kTotal) return OpStatus::kBadArgument;
  if (p.rows == 0 || p.k == 0) return OpStatus::kOk;
  if (p.rows > int64_t{0x7FFFFFFF}) return OpStatus::kBadShape;  // The grid's limit.
  if (p.ascending && p.k > kAscendingMost) return OpStatus::kBadShape;
  const unsigned shared = p.ascending ? static_cast<unsigned>(p.k * sizeof(int64_t)) : 0;
  FLASHD_LAUNCH(TopKKernel, static_cast<unsigned>(p.rows), kSelectThreads, shared,
                static_cast<gpuStream_t>(p.stream), p.values, p.stride, p.k, p.n, p.ascending,
                p.out);
  return gpuGetLastError() == gpuSuccess ? OpStatus::kOk : OpStatus::kDeviceError;
}

OpStatus MoeRoute(const MoeRouteParams& p, unsigned* arrivals) {
  if (!MoeRouteFits(p)) return OpStatus::kBadShape;
  if (p.order != TopKOrder::kTotal) return OpStatus::kBadArgument;
  if (p.k > gpu_select::kBlockSelectPerThread * kSelectThreads) return OpStatus::kBadShape;
  MoeGroupParams g;
  if (p.group != nullptr) {
    g = MoeRouteGroup(p);
    if (p.experts > kGroupMaxExperts) return OpStatus::kBadShape;
  }
  if (p.tokens > int64_t{0x7FFFFFFF}) return OpStatus::kBadShape;  // The grid's limit.
  if (p.router != nullptr) {
    const LinearParams& r = *p.router;
    if (arrivals != nullptr && RouterInKernel(p)) {
      // One kernel: the logits, the routing and the grouping.
      MoeRouteParams d = p;
      d.group = nullptr;
      d.router = nullptr;
      d.stream = nullptr;
      g.stream = nullptr;
      const auto launch = [&](auto w) {
        using W = decltype(w);
        const auto kernel = w.Vectors(r.in) && Aligned(r.x, 16) ? &RouterRouteGroupKernel<W, true>
                                                                : &RouterRouteGroupKernel<W, false>;
        FLASHD_LAUNCH(kernel,
                      static_cast<unsigned>((p.experts + kDenseGemvCols - 1) / kDenseGemvCols),
                      kDenseGemvThreads, 0, static_cast<gpuStream_t>(p.stream), r.x, r.in, w, r.y,
                      d, g, arrivals);
      };
      if (r.format == WeightFormat::kDense) {
        launch(F32Values{r.dense});
      } else {
        launch(Bf16Values{reinterpret_cast<const uint16_t*>(r.w)});
      }
      return gpuGetLastError() == gpuSuccess ? OpStatus::kOk : OpStatus::kDeviceError;
    }
    if (const OpStatus s = Linear(r); s != OpStatus::kOk) return s;  // The logits, then the rest.
    MoeRouteParams rest = p;
    rest.router = nullptr;
    return MoeRoute(rest, arrivals);
  }
  if (p.tokens == 0) return OpStatus::kOk;
  if (p.group != nullptr && arrivals != nullptr) {
    MoeRouteParams d = p;
    d.group = nullptr;
    d.stream = nullptr;
    g.stream = nullptr;
    FLASHD_LAUNCH(RouteGroupKernel, static_cast<unsigned>(p.tokens), kSelectThreads, 0,
                  static_cast<gpuStream_t>(p.stream), d, g, arrivals);
    return gpuGetLastError() == gpuSuccess ? OpStatus::kOk : OpStatus::kDeviceError;
  }
  FLASHD_LAUNCH(RouteKernel, static_cast<unsigned>(p.tokens), kSelectThreads, 0,
                static_cast<gpuStream_t>(p.stream), p.logits, p.bias, p.experts, p.k,
                static_cast<int>(p.scoring), p.norm_topk, p.scale, p.scores, p.biased, p.chosen,
                p.weights);
  if (gpuGetLastError() != gpuSuccess) return OpStatus::kDeviceError;
  return p.group != nullptr ? MoeGroup(g) : OpStatus::kOk;
}

}  // namespace flashd::kernels::FLASHD_GPU_BACKEND
