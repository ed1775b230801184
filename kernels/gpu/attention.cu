// Sparse attention on the device, in the CPU's order (kernels/cpu/attention.cc) so the results
// are its bits: each logit sums its products over the dimensions in order, each attention block
// (kAttentionBlock list entries) runs the release's online softmax (its largest logit, fp32
// probabilities summed in list order into the denominator, BF16 probabilities times the keys
// summed in list order per dimension, the running sums rescaled by exp(m - m')), with the CPU's
// exp (kernels/fmath.h). The output is rounded to BF16 and rotated back by the Rope op's step (by
// the Rope op after AttendKernel; in SoftmaxSumsKernel's last step where keys are decoded once).
//
// A thread block serves one query and a group of G heads (G = 8 for prompts, where the keys,
// shared by the heads, are decoded once for eight; G = 1 for decode steps, where the heads are
// the only parallelism; and where even those leave half the multiprocessors idle, two thread
// blocks a head, each computing all the logits and the weighted sums of half the dimensions).
// The query's key list is taken kPassKeys list entries at a time (whole attention blocks): a
// thread per key reads its values kLogitDims at a time and keeps its G dot products; the softmax's
// steps run a thread per head and block (the sequential sums) or per probability (the exps); then a
// thread per pair of dimensions reads them from every key and keeps its G heads' block sums and
// accumulators in registers. No key value goes through shared memory; each is read from its row
// twice, once for the logits and once for the sums.
//
// Given a workspace, two other kernels take the queries instead, which decode each key once for
// 16 heads and spread the logits over (head, key) threads ("Each query's keys decoded
// once" below); the same bits.
#include <algorithm>
#include <atomic>
#include <cmath>

#include "kernels/codecs.h"
#include "kernels/fmath.h"
#include "kernels/gpu/norm_row.h"
#include "kernels/gpu/ops.h"
#include "kernels/gpu/portability.h"

namespace flashd::kernels::FLASHD_GPU_BACKEND {
namespace {

namespace c = flashd::kernels::codecs;
namespace fm = flashd::kernels::fmath;

// Where a key's values come from: a fresh row (fp32), a ring slot (FP8 codes and UE8M0 scales per
// 32) or a compressed KV row (FP4 codes and E4M3 scales per 16), its row's addresses resolved
// once when the key list is built.
enum class KeySource : uint8_t { kFresh, kRing, kCompressed };

struct KeyRow {
  const void* codes;      // The fresh row's floats, or the row's codes.
  const uint8_t* scales;  // Null for a fresh row.
  KeySource source;
};

// A key's values at dimensions [d0, d0 + 32) (d0 a multiple of 32) in two steps, so that the
// loads of the next dimensions are in flight while these are summed: LoadKeyChunk reads a ring
// slot's 32 E4M3 codes and its UE8M0 scale code or a compressed row's 32 E2M1 codes and its two
// E4M3 scale codes (16 bytes a load where the row is 16-byte aligned, else a byte at a time);
// DecodeKeyChunk makes the values, the codes times their scales as the CPU's, and reads a fresh
// row's floats itself (a step's own rows: few).
struct KeyChunk {
  uint4 raw[2];
  uint32_t scales;
};

__device__ inline uint32_t LoadWord(const uint8_t* p) {
  return uint32_t{p[0]} | uint32_t{p[1]} << 8 | uint32_t{p[2]} << 16 | uint32_t{p[3]} << 24;
}

// Word i (0-7) of the raw words; i known to the compiler, so raw stays in registers.
__device__ inline uint32_t RawWord(const uint4* raw, int i) {
  const uint4& q = raw[i / 4];
  return i % 4 == 0 ? q.x : i % 4 == 1 ? q.y : i % 4 == 2 ? q.z : q.w;
}

__device__ inline void LoadKeyChunk(const KeyRow& k, int64_t d0, KeyChunk& r) {
  if (k.source == KeySource::kFresh) return;
  const bool ring = k.source == KeySource::kRing;
  const uint8_t* at = static_cast<const uint8_t*>(k.codes) + (ring ? d0 : d0 / 2);
  const int loads = ring ? 2 : 1;
  FLASHD_UNROLL
  for (int i = 0; i < 2; ++i) {
    if (i >= loads) break;
    if (reinterpret_cast<uintptr_t>(at) % 16 == 0) {
      r.raw[i] = reinterpret_cast<const uint4*>(at)[i];
    } else {
      r.raw[i] = uint4{LoadWord(at + 16 * i), LoadWord(at + 16 * i + 4), LoadWord(at + 16 * i + 8),
                       LoadWord(at + 16 * i + 12)};
    }
  }
  r.scales = ring ? uint32_t{k.scales[d0 / 32]}
                  : uint32_t{k.scales[d0 / 16]} | uint32_t{k.scales[d0 / 16 + 1]} << 8;
}

__device__ inline void DecodeKeyChunk(const KeyRow& k, int64_t d0, const KeyChunk& r, float* v) {
  switch (k.source) {
    case KeySource::kFresh: {
      const float* row = static_cast<const float*>(k.codes) + d0;
      FLASHD_UNROLL
      for (int dd = 0; dd < 32; ++dd) v[dd] = row[dd];
      break;
    }
    case KeySource::kRing: {
      const float s = c::E8M0ToFloat(static_cast<uint8_t>(r.scales));
      FLASHD_UNROLL
      for (int dd = 0; dd < 32; ++dd) {
        v[dd] = c::E4M3ToFloat(static_cast<uint8_t>(RawWord(r.raw, dd / 4) >> (8 * (dd % 4)))) * s;
      }
      break;
    }
    default: {
      const float s0 = c::E4M3ToFloat(static_cast<uint8_t>(r.scales)),
                  s1 = c::E4M3ToFloat(static_cast<uint8_t>(r.scales >> 8));
      FLASHD_UNROLL
      for (int dd = 0; dd < 32; ++dd) {
        const uint32_t byte = (RawWord(r.raw, dd / 8) >> (8 * ((dd / 2) % 4))) & 0xFFu;
        const uint8_t code = static_cast<uint8_t>(dd % 2 == 0 ? (byte & 0xFu) : (byte >> 4));
        v[dd] = c::E2M1ToFloat(code) * (dd < 16 ? s0 : s1);
      }
    }
  }
}

// A key's values at dimensions d and d + 1 (d even: one byte of FP4 codes, one scale), the same
// products as DecodeKeyChunk's, in two steps so that a thread can issue several keys' loads
// before it uses any: LoadKey2 reads the raw bytes (a fresh row's two floats as their bits),
// DecodeKey2 makes the values.
struct Key2 {
  uint32_t a = 0, b = 0;  // Two floats' bits, two FP8 codes, or one byte of two FP4 codes.
  uint8_t scale = 0;
};

__device__ __host__ inline Key2 LoadKey2(const KeyRow& k, int64_t d) {
  switch (k.source) {
    case KeySource::kFresh: {
      const float* row = static_cast<const float*>(k.codes);
      return {c::Bits(row[d]), c::Bits(row[d + 1]), 0};
    }
    case KeySource::kRing: {
      const uint8_t* row = static_cast<const uint8_t*>(k.codes);
      return {row[d], row[d + 1], k.scales[d / 32]};
    }
    default:
      return {static_cast<const uint8_t*>(k.codes)[d / 2], 0, k.scales[d / 16]};
  }
}

__device__ __host__ inline void DecodeKey2(KeySource source, const Key2& r, float* v) {
  switch (source) {
    case KeySource::kFresh:
      v[0] = c::FromBits(r.a), v[1] = c::FromBits(r.b);
      break;
    case KeySource::kRing: {
      const float s = c::E8M0ToFloat(r.scale);
      v[0] = c::E4M3ToFloat(static_cast<uint8_t>(r.a)) * s;
      v[1] = c::E4M3ToFloat(static_cast<uint8_t>(r.b)) * s;
      break;
    }
    default: {
      const float s = c::E4M3ToFloat(r.scale);
      v[0] = c::E2M1ToFloat(static_cast<uint8_t>(r.a & 0xF)) * s;
      v[1] = c::E2M1ToFloat(static_cast<uint8_t>(r.a >> 4 & 0xF)) * s;
    }
  }
}

__device__ __host__ inline void KeyValues2(const KeyRow& k, int64_t d, float* v) {
  DecodeKey2(k.source, LoadKey2(k, d), v);
}

constexpr unsigned kAttendThreads = 256;
constexpr int64_t kPassKeys = 256;  // List entries per pass: whole attention blocks.
constexpr int64_t kPassBlocks = kPassKeys / kAttentionBlock;
constexpr int64_t kLogitDims = 32;     // A key's values loaded at a time by its thread.
constexpr int64_t kDimsPerThread = 2;  // Of the weighted sums: so head_dim <= 512 (the model's).
static_assert(kDimsPerThread == 2, "KeyValues2 loads a thread's two neighbouring dimensions");
constexpr int64_t kMaxHeadDim = kDimsPerThread * kAttendThreads;
constexpr int64_t kAheadKeys = 16;    // Keys whose values a thread loads before summing them.
constexpr int64_t kGroupTokens = 16;  // Queries from which heads are taken eight at a time.
// The softmax's sequential steps (a thread per head) load this many probabilities together
// before taking them in order: shared memory's latency once per eight, not per value.
constexpr int kSerialAhead = 8;
static_assert(kPassKeys % kAttentionBlock == 0 && kPassKeys == kAttendThreads);
static_assert(kLogitDims == 32, "KeyChunk holds a key's values 32 at a time");

// f(j, v[j]) for j in [lo, hi) in order, kSerialAhead values loaded together before they are
// used (f may write v[j] back).
template <class F>
__device__ inline void InOrder(float* v, int64_t lo, int64_t hi, F f) {
  int64_t j = lo;
  for (; j + kSerialAhead <= hi; j += kSerialAhead) {
    float w[kSerialAhead];
    FLASHD_UNROLL
    for (int u = 0; u < kSerialAhead; ++u) w[u] = v[j + u];
    FLASHD_UNROLL
    for (int u = 0; u < kSerialAhead; ++u) f(j + u, w[u]);
  }
  for (; j < hi; ++j) f(j, v[j]);
}

// The exclusive prefix sum of each thread's `flag` over the thread block (through `scan`,
// kAttendThreads ints of shared memory), and the total in *total.
__device__ int ExclusiveScan(int flag, int* scan, int* total) {
  const unsigned tid = threadIdx.x;
  scan[tid] = flag;
  __syncthreads();
  for (unsigned step = 1; step < kAttendThreads; step *= 2) {
    const int add = tid >= step ? scan[tid - step] : 0;
    __syncthreads();
    scan[tid] += add;
    __syncthreads();
  }
  const int inclusive = scan[tid];
  *total = scan[kAttendThreads - 1];
  __syncthreads();  // scan may be reused.
  return inclusive - flag;
}

// Where query t's list starts: the first window entry, else the selected entries' base.
__device__ inline int64_t ListStart(const AttentionKeys& window) {
  return window.count() > 0 ? window.ListIndex(0) : window.selected_base();
}

// The rows of query t's list entries [lo, hi) into key[li - lo], their addresses resolved once, by
// the whole thread block: the window's entries by position (fresh rows or ring slots), the
// selected entries by their ranks among the selection row's entries that are not -1 (a prefix sum
// kAttendThreads entries at a time, through the whole row with `whole_row`, else until the ranks
// pass hi). Returns the ranks counted: with `whole_row`, the selected entries of the list.
__device__ int64_t ListKeys(const SparseAttentionParams& p, const AttentionKeys& window, int64_t t,
                            int64_t lo, int64_t hi, bool whole_row, KeyRow* key, int* scan) {
  const int64_t hd = p.head_dim, sb = window.selected_base(), w0 = ListStart(window);
  const AttentionSequence s = p.SequenceOf(t);
  for (int64_t li = (lo > w0 ? lo : w0) + threadIdx.x; li < hi && li < sb; li += kAttendThreads) {
    const int64_t q = window.Position(li - w0);
    if (q >= s.fresh_first) {
      key[li - lo] = {s.fresh + (q - s.fresh_first) * hd, nullptr, KeySource::kFresh};
    } else {
      const int64_t slot = q % p.window;
      key[li - lo] = {p.RingCodes(s, slot), p.RingScales(s, slot), KeySource::kRing};
    }
  }
  const int64_t* selected = p.selected + t * p.selected_stride;
  int64_t rank0 = 0;  // Ranks of the selection row's entries before the current chunk.
  for (int64_t c0 = 0; c0 < p.selected_stride && (whole_row || sb + rank0 < hi);
       c0 += kAttendThreads) {
    const int64_t i = c0 + threadIdx.x;
    const int64_t entry = i < p.selected_stride ? selected[i] : -1;
    int total;
    const int64_t li = sb + rank0 + ExclusiveScan(entry >= 0 ? 1 : 0, scan, &total);
    if (entry >= 0 && li >= lo && li < hi) {
      const int64_t row = BlockRow(s.block_table, p.kv_codes.rows_per_block, entry);
      key[li - lo] = {p.kv_codes.Row(row), p.kv_scales.Row(row), KeySource::kCompressed};
    }
    rank0 += total;
  }
  return rank0;
}

// A thread block per query and group of G heads. The key list in list order: the window's keys
// (list entries [w0, sb): AttentionKeys), then the selected rows that are not -1 (entries sb,
// sb + 1, ... in the selection row's order). Each pass takes the keys of list entries [L0, L0 +
// kPassKeys), built by all threads at once (the selected rows' ranks by a prefix sum over the
// selection row), each key's row addresses resolved once. Logits: thread j reads key j's values
// 32 at a time, 16 bytes a load (the codes of the next two 32s in flight while these are
// summed) against the group's queries, held in shared memory. Weighted sums: thread i reads
// dimensions 2i and 2i + 1 of each key (one byte of FP4 codes and one scale; neighbouring threads,
// neighbouring bytes), kAheadKeys keys' loads ahead of their sums.
template <int G>
__global__ void __launch_bounds__(kAttendThreads)
    AttendKernel(SparseAttentionParams p, int slices) {
  FLASHD_GRID_BEGIN();
  __shared__ float qs[G][kMaxHeadDim];
  __shared__ float prob[G][kPassKeys];  // Logits, then probabilities, then their BF16 values.
  __shared__ KeyRow key[kPassKeys];
  __shared__ int scan[kAttendThreads];
  __shared__ float block_m[G][kPassBlocks], block_rescale[G][kPassBlocks];
  __shared__ float run_m[G], denom[G];
  const int64_t groups = (p.heads + G - 1) / G;
  const int64_t slice = blockIdx.x % slices, query_group = blockIdx.x / slices;
  const int64_t t = query_group / groups, h0 = (query_group % groups) * G, hd = p.head_dim;
  // The dimensions whose weighted sums this thread block keeps: [d_lo, d_lo + span).
  const int64_t span = hd / slices, d_lo = slice * span;
  const unsigned tid = threadIdx.x;
  const float scale = static_cast<float>(1.0 / sqrt(static_cast<double>(hd)));
  for (int64_t i = tid; i < G * hd; i += kAttendThreads) {
    const int64_t g = i / hd, d = i % hd;
    qs[g][d] = h0 + g < p.heads ? p.q[(t * p.heads + h0 + g) * hd + d] : 0.0f;
  }
  const AttentionKeys window = AttentionKeys::Of(p, t);
  const int64_t sb = window.selected_base(), w0 = ListStart(window);
  // The list's end: the selection row's entries that are not -1 counted (no entry resolved).
  const int64_t list_end = sb + ListKeys(p, window, t, 0, 0, true, key, scan);
  if (tid < G) run_m[tid] = -1e30f, denom[tid] = 0;
  float acc[G][kDimsPerThread], part[G][kDimsPerThread];
  FLASHD_UNROLL
  for (int g = 0; g < G; ++g) {
    FLASHD_UNROLL
    for (int e = 0; e < kDimsPerThread; ++e) acc[g][e] = 0, part[g][e] = 0;
  }
  for (int64_t L0 = w0 - w0 % kPassKeys; L0 < list_end; L0 += kPassKeys) {
    // The pass's keys: list entries [lo, hi), key s at entry lo + s.
    const int64_t lo = L0 > w0 ? L0 : w0;
    const int64_t hi = L0 + kPassKeys < list_end ? L0 + kPassKeys : list_end;
    const int64_t n = hi - lo;
    __syncthreads();  // The last pass's readers of the key list are done.
    ListKeys(p, window, t, lo, hi, false, key, scan);
    // Attention block b of the pass: keys [begin(b), begin(b + 1)).
    auto begin = [&](int64_t b) {
      const int64_t e = L0 + b * kAttentionBlock - lo;
      return e < 0 ? int64_t{0} : e > n ? n : e;
    };
    __syncthreads();
    // Logits: thread j keeps key j's dot products with the group's queries, dimensions in order;
    // the raw words of two chunks ahead are in flight (a and b in turn) while one is summed.
    if (tid < n) {
      const KeyRow k = key[tid];
      float dot[G], v[kLogitDims];
      FLASHD_UNROLL
      for (int g = 0; g < G; ++g) dot[g] = 0;
      const auto sum = [&](int64_t d0) {
        FLASHD_UNROLL
        for (int dd = 0; dd < kLogitDims; ++dd) {
          FLASHD_UNROLL
          for (int g = 0; g < G; ++g) dot[g] += qs[g][d0 + dd] * v[dd];
        }
      };
      KeyChunk a, b;
      LoadKeyChunk(k, 0, a);
      if (kLogitDims < hd) LoadKeyChunk(k, kLogitDims, b);
      for (int64_t d0 = 0; d0 < hd; d0 += 2 * kLogitDims) {
        DecodeKeyChunk(k, d0, a, v);
        if (d0 + 2 * kLogitDims < hd) LoadKeyChunk(k, d0 + 2 * kLogitDims, a);
        sum(d0);
        if (d0 + kLogitDims >= hd) break;
        DecodeKeyChunk(k, d0 + kLogitDims, b, v);
        if (d0 + 3 * kLogitDims < hd) LoadKeyChunk(k, d0 + 3 * kLogitDims, b);
        sum(d0 + kLogitDims);
      }
      FLASHD_UNROLL
      for (int g = 0; g < G; ++g) prob[g][tid] = dot[g] * scale;
    }
    __syncthreads();
    // Each block's running maximum and rescale, a thread per head through the blocks in order.
    if (tid < G) {
      float m = run_m[tid];
      for (int64_t b = 0; b < kPassBlocks; ++b) {
        if (begin(b) == begin(b + 1)) continue;
        float block_max = -INFINITY;
        InOrder(prob[tid], begin(b), begin(b + 1),
                [&](int64_t, float v) { block_max = fmaxf(block_max, v); });
        const float m_new = fmaxf(m, block_max);
        block_rescale[tid][b] = fm::Exp(m - m_new);
        block_m[tid][b] = m_new;
        m = m_new;
      }
      run_m[tid] = m;
    }
    __syncthreads();
    for (int64_t i = tid; i < G * n; i += kAttendThreads) {
      const int64_t g = i / n, j = i % n;
      prob[g][j] =
          fm::Exp(prob[g][j] - block_m[g][(lo + j) / kAttentionBlock - L0 / kAttentionBlock]);
    }
    __syncthreads();
    // The denominator: each block's probabilities summed in list order, a thread per head.
    if (tid < G) {
      float den = denom[tid];
      for (int64_t b = 0; b < kPassBlocks; ++b) {
        if (begin(b) == begin(b + 1)) continue;
        float sum = 0;
        InOrder(prob[tid], begin(b), begin(b + 1), [&](int64_t j, float v) {
          sum += v;
          prob[tid][j] = c::RoundBf16(v);
        });
        den = den * block_rescale[tid][b] + sum;
      }
      denom[tid] = den;
    }
    __syncthreads();
    // The weighted sums: thread i's dimensions 2i and 2i + 1 of each of the block's keys in list
    // order; at a block's end the accumulator takes acc * rescale + the block's sum.
    int64_t b = 0;
    for (int64_t j0 = 0; j0 < n; j0 += kAheadKeys) {
      float v[kAheadKeys][kDimsPerThread];
      FLASHD_UNROLL
      for (int u = 0; u < kAheadKeys; ++u) {
        if (j0 + u < n && 2 * tid < span) {
          KeyValues2(key[j0 + u], d_lo + 2 * tid, v[u]);
        } else {
          v[u][0] = v[u][1] = 0.0f;
        }
      }
      FLASHD_UNROLL
      for (int u = 0; u < kAheadKeys; ++u) {
        const int64_t j = j0 + u;
        if (j >= n) break;
        FLASHD_UNROLL
        for (int e = 0; e < kDimsPerThread; ++e) {
          FLASHD_UNROLL
          for (int g = 0; g < G; ++g) part[g][e] += prob[g][j] * v[u][e];
        }
        while (begin(b + 1) <= j) ++b;
        if (j + 1 == begin(b + 1)) {  // The block's last key.
          FLASHD_UNROLL
          for (int g = 0; g < G; ++g) {
            FLASHD_UNROLL
            for (int e = 0; e < kDimsPerThread; ++e) {
              acc[g][e] = acc[g][e] * block_rescale[g][b] + part[g][e];
              part[g][e] = 0;
            }
          }
        }
      }
    }
  }
  __syncthreads();
  if (tid < G && h0 + tid < p.heads) denom[tid] += fm::Exp(p.sink[h0 + tid] - run_m[tid]);
  __syncthreads();
  FLASHD_UNROLL
  for (int g = 0; g < G; ++g) {
    if (h0 + g >= p.heads) break;
    float* out = p.out + (t * p.heads + h0 + g) * hd;
    FLASHD_UNROLL
    for (int e = 0; e < kDimsPerThread; ++e) {
      const int64_t d = 2 * tid + e;
      if (d < span) out[d_lo + d] = c::RoundBf16(acc[g][e] / denom[g]);
    }
  }
}

// --- Each query's keys decoded once --------------------------------------------------------------
// Where the caller gives a workspace (and for a DSpark draft block, the bound on its window keys),
// two kernels replace AttendKernel, neither bound to a head's thread block:
//   LogitsKernel: each (head, key) logit, a thread each, the dimensions in order, 16 keys and 16
//     heads a thread block staging 128 dimensions of each at a time in shared memory, the keys'
//     values made there from their rows (the products KeyValues2 makes), so once for 16 heads
//     (AttendKernel makes each once per head, or per eight), and written to the workspace once
//     for all the heads by the first group of 16;
//   SoftmaxSumsKernel: per query, group of heads (one for a decode step's few queries, eight for
//     a prompt's, which then share each key value loaded) and 128 dimensions, the softmax's steps
//     (block maxima and block sums a thread per head and attention block, the running maximum and
//     the denominator a thread per head through the blocks, the exps a thread per value) and the
//     weighted sums, a thread per dimension through the keys in list order.
// Every value is made by the same operations in the same order as AttendKernel's: the same bits.
// The queries go kOncePassTokens at a time (a pass), so the workspace stays within L2 (1.5 MB a
// query at the model's shape).
//
// The workspace, for a pass's queries: [pass] list ends (floats, exact), padded to 4; [pass,
// capacity, head_dim] key values; [pass, heads, capacity] logits; a key's slot is its list index
// (the window's slots first, so the capacity is window + selected_stride, or for a draft block
// draft_keys + selected_stride).
constexpr int64_t kOncePassTokens = 16;
constexpr int64_t kOnceLogitKeys = 16, kOnceLogitHeads = 16;
constexpr int64_t kOnceStageDims = 128;  // Dimensions a LogitsKernel block stages at a time.
constexpr int64_t kOnceStagePitch = kOnceStageDims + 4;  // Rows 16 bytes apart in banks.
constexpr unsigned kOnceLogitThreads = kOnceLogitKeys * kOnceLogitHeads;
constexpr unsigned kOnceSumThreads = 128;  // Dimensions a SoftmaxSumsKernel block keeps.
// Keys a thread's loads run ahead of its sums (fewer with eight heads: each key then serves
// eight heads' products, and the registers hold eight heads' sums).
template <int H>
constexpr int kOnceSumAhead = H == 1 ? 32 : 16;
constexpr size_t kOnceSharedMax = 48 * 1024;
// A LogitsKernel thread's pairs of key dimensions a stage, and the stages of the longest head.
constexpr int kOncePairsAThread = kOnceLogitKeys * kOnceStageDims / 2 / kOnceLogitThreads;
constexpr int kOnceStages = kMaxHeadDim / kOnceStageDims;
static_assert(kOnceLogitThreads == kAttendThreads, "ListKeys' prefix sums: a thread an entry");
static_assert(kOncePairsAThread * kOnceLogitThreads * 2 == kOnceLogitKeys * kOnceStageDims);
static_assert(kOnceStages * kOnceStageDims == kMaxHeadDim);

struct OnceLayout {
  int64_t capacity = 0, pass = 0;           // Slots a query; queries a pass.
  int64_t keys = 0, logits = 0, total = 0;  // Offsets and size in floats.
  int64_t t0 = 0;                           // The pass's first query.
};

OnceLayout OnceLayoutOf(const SparseAttentionParams& p) {
  OnceLayout l;
  l.capacity = (p.window_last != nullptr ? p.draft_keys : p.window) + p.selected_stride;
  l.pass = p.tokens < kOncePassTokens ? p.tokens : kOncePassTokens;
  l.keys = (l.pass + 3) / 4 * 4;
  l.logits = l.keys + l.pass * l.capacity * p.head_dim;
  l.total = l.logits + l.pass * p.heads * l.capacity;
  return l;
}

// SoftmaxSumsKernel's shared memory for `heads` a block: a probability per head and slot, per
// head and attention block its maximum, running maximum, rescale and sum, and a value a thread
// (the rotation's pairs).
size_t OnceSumShared(int64_t capacity, int heads) {
  const int64_t blocks = (capacity + kAttentionBlock - 1) / kAttentionBlock;
  return static_cast<size_t>(heads * (capacity + 4 * blocks) + kOnceSumThreads) * sizeof(float);
}

// The heads a SoftmaxSumsKernel block takes for p (8 for a prompt's queries, 1 for a decode
// step's), or 0 where the keys-once kernels do not take p (a draft block without its bound on the
// window keys, or its slots past shared memory).
int OnceHeads(const SparseAttentionParams& p) {
  if (p.window_last != nullptr && p.draft_keys <= 0) return 0;
  const int64_t capacity = OnceLayoutOf(p).capacity;
  if (p.tokens >= kGroupTokens && OnceSumShared(capacity, 8) <= kOnceSharedMax) return 8;
  return OnceSumShared(capacity, 1) <= kOnceSharedMax ? 1 : 0;
}

// Block (t, key chunk, head group): logits[t][h][li] (t of the pass) for the chunk's kOnceLogitKeys
// list entries and the group's kOnceLogitHeads heads, thread (key tid % 16, head tid / 16) summing
// q . key over the dimensions in order, both staged kOnceStageDims dimensions at a time in shared
// memory. The keys' values are made here from their rows (KeyValues2's products, every load a
// thread makes for the chunk issued before the first value is made); the first head group's
// blocks also write them to the workspace for SoftmaxSumsKernel, and chunk 0's the list's end.
__global__ void __launch_bounds__(kOnceLogitThreads)
    LogitsKernel(SparseAttentionParams p, OnceLayout l) {
  __shared__ float4 ks4[kOnceLogitKeys][kOnceStagePitch / 4];
  __shared__ float4 qs[kOnceLogitHeads][kOnceStagePitch / 4];
  __shared__ KeyRow key[kOnceLogitKeys];
  __shared__ int scan[kAttendThreads];
  FLASHD_GRID_BEGIN();
  const int64_t chunks = (l.capacity + kOnceLogitKeys - 1) / kOnceLogitKeys;
  const int64_t groups = (p.heads + kOnceLogitHeads - 1) / kOnceLogitHeads;
  const int64_t tl = blockIdx.x / (chunks * groups), rest = blockIdx.x % (chunks * groups);
  const int64_t t = l.t0 + tl;
  const int64_t L = rest / groups * kOnceLogitKeys, h0 = rest % groups * kOnceLogitHeads;
  const int64_t hd = p.head_dim;
  const unsigned tid = threadIdx.x, kk = tid % kOnceLogitKeys, hh = tid / kOnceLogitKeys;
  const AttentionKeys window = AttentionKeys::Of(p, t);
  const int64_t sb = window.selected_base(), w0 = ListStart(window);
  // Chunk 0 counts the whole selection row (the list's end); another, until its last entry, so
  // `end` is past the chunk's last listed entry.
  const int64_t end = sb + ListKeys(p, window, t, L, L + kOnceLogitKeys, L == 0, key, scan);
  if (L == 0 && h0 == 0 && tid == 0) p.workspace[tl] = static_cast<float>(end);
  __syncthreads();                                   // The chunk's rows.
  if (L + kOnceLogitKeys <= w0 || L >= end) return;  // The whole block: no key of the list.
  // Stage s's pair i (i = tid + kOnceLogitThreads * j): key i / (dims / 2), dimensions 2 (i %
  // (dims / 2)) and the next of the stage.
  const auto listed = [&](int64_t r) { return L + r >= w0 && L + r < end; };
  Key2 raw[kOnceStages][kOncePairsAThread];
  FLASHD_UNROLL
  for (int s = 0; s < kOnceStages; ++s) {
    const int64_t d0 = s * kOnceStageDims;
    if (d0 >= hd) break;
    const int64_t half = (hd - d0 < kOnceStageDims ? hd - d0 : kOnceStageDims) / 2;
    FLASHD_UNROLL
    for (int j = 0; j < kOncePairsAThread; ++j) {
      const int64_t i = tid + kOnceLogitThreads * j, r = i / half;
      if (r < kOnceLogitKeys && listed(r)) raw[s][j] = LoadKey2(key[r], d0 + 2 * (i % half));
    }
  }
  float* keys = h0 == 0 ? p.workspace + l.keys + (tl * l.capacity + L) * hd : nullptr;
  const float* q = p.q + (t * p.heads + h0) * hd;
  const float scale = static_cast<float>(1.0 / sqrt(static_cast<double>(hd)));
  float* ks = reinterpret_cast<float*>(ks4);  // [key][kOnceStagePitch].
  float dot = 0;
  FLASHD_UNROLL
  for (int s = 0; s < kOnceStages; ++s) {
    const int64_t d0 = s * kOnceStageDims;
    if (d0 >= hd) break;
    const int64_t dims = hd - d0 < kOnceStageDims ? hd - d0 : kOnceStageDims, half = dims / 2;
    __syncthreads();  // The last stage's readers are done.
    FLASHD_UNROLL
    for (int j = 0; j < kOncePairsAThread; ++j) {
      const int64_t i = tid + kOnceLogitThreads * j, r = i / half, c = 2 * (i % half);
      if (r >= kOnceLogitKeys) break;
      float v[2] = {0, 0};
      if (listed(r)) {
        DecodeKey2(key[r].source, raw[s][j], v);
        if (keys != nullptr) keys[r * hd + d0 + c] = v[0], keys[r * hd + d0 + c + 1] = v[1];
      }
      ks[r * kOnceStagePitch + c] = v[0], ks[r * kOnceStagePitch + c + 1] = v[1];
    }
    for (int64_t i = tid; i < kOnceLogitHeads * dims / 4; i += kOnceLogitThreads) {
      const int64_t r = i / (dims / 4), c4 = i % (dims / 4);
      float4 x = {0, 0, 0, 0};
      if (h0 + r < p.heads) x = reinterpret_cast<const float4*>(q + r * hd + d0)[c4];
      qs[r][c4] = x;
    }
    __syncthreads();
    for (int64_t c4 = 0; c4 < dims / 4; ++c4) {
      const float4 k = ks4[kk][c4], x = qs[hh][c4];
      dot += x.x * k.x;
      dot += x.y * k.y;
      dot += x.z * k.z;
      dot += x.w * k.w;
    }
  }
  const int64_t li = L + kk, h = h0 + hh;
  if (listed(kk) && h < p.heads) {
    p.workspace[l.logits + (tl * p.heads + h) * l.capacity + li] = dot * scale;
  }
}

// Block (t, head group, slice): the pass's query t, heads [h0, h0 + H), the output's dimensions
// [slice * 128, + 128), a thread each. The softmax as AttendKernel's (the same operations on the
// same values), then each thread's weighted sums through the keys in list order, each key value
// loaded once for the group's heads.
template <int H>
__global__ void __launch_bounds__(kOnceSumThreads)
    SoftmaxSumsKernel(SparseAttentionParams p, OnceLayout l) {
  FLASHD_GRID_BEGIN();
  FLASHD_DYNAMIC_SHARED(float, shared);
  __shared__ float run_m[H], denom[H];
  const int64_t hd = p.head_dim, slices = (hd + kOnceSumThreads - 1) / kOnceSumThreads;
  const int64_t groups = (p.heads + H - 1) / H;
  const int64_t tl = blockIdx.x / (groups * slices), t = l.t0 + tl;
  const int64_t h0 = blockIdx.x / slices % groups * H;
  const int hn = static_cast<int>(p.heads - h0 < H ? p.heads - h0 : H);  // The group's heads.
  const int64_t d = blockIdx.x % slices * kOnceSumThreads + threadIdx.x;
  const int64_t cap = l.capacity, blocks = (cap + kAttentionBlock - 1) / kAttentionBlock;
  float* prob = shared;  // [H][cap]: a logit, then its probability, then that rounded to BF16.
  float* block_max = shared + H * cap;  // Each [H][blocks].
  float* block_m = block_max + H * blocks;
  float* block_rescale = block_m + H * blocks;
  float* block_sum = block_rescale + H * blocks;
  const unsigned tid = threadIdx.x;
  const int64_t w0 = ListStart(AttentionKeys::Of(p, t));
  const int64_t end = static_cast<int64_t>(p.workspace[tl]), n = end > w0 ? end - w0 : 0;
  const float* logits = p.workspace + l.logits + (tl * p.heads + h0) * cap;
  for (int64_t i = tid; i < hn * n; i += kOnceSumThreads) {
    const int64_t g = i / n, j = w0 + i % n;
    prob[g * cap + j] = logits[g * cap + j];
  }
  // Attention blocks [b0, b1) hold the list; block b's entries are [lo(b), hi(b)).
  const int64_t b0 = w0 / kAttentionBlock, b1 = n > 0 ? (end - 1) / kAttentionBlock + 1 : b0;
  const int64_t nb = b1 - b0;
  auto lo = [&](int64_t b) { return b * kAttentionBlock > w0 ? b * kAttentionBlock : w0; };
  auto hi = [&](int64_t b) {
    return (b + 1) * kAttentionBlock < end ? (b + 1) * kAttentionBlock : end;
  };
  __syncthreads();
  for (int64_t i = tid; i < hn * nb; i += kOnceSumThreads) {
    const int64_t g = i / nb, b = b0 + i % nb;
    float m = -INFINITY;
    InOrder(prob + g * cap, lo(b), hi(b), [&](int64_t, float v) { m = fmaxf(m, v); });
    block_max[g * blocks + b] = m;
  }
  __syncthreads();
  if (tid < hn) {
    float m = -1e30f;
    for (int64_t b = b0; b < b1; ++b) {
      const float m_new = fmaxf(m, block_max[tid * blocks + b]);
      block_rescale[tid * blocks + b] = fm::Exp(m - m_new);
      block_m[tid * blocks + b] = m_new;
      m = m_new;
    }
    run_m[tid] = m;
  }
  __syncthreads();
  for (int64_t i = tid; i < hn * n; i += kOnceSumThreads) {
    const int64_t g = i / n, j = w0 + i % n;
    prob[g * cap + j] = fm::Exp(prob[g * cap + j] - block_m[g * blocks + j / kAttentionBlock]);
  }
  __syncthreads();
  for (int64_t i = tid; i < hn * nb; i += kOnceSumThreads) {
    const int64_t g = i / nb, b = b0 + i % nb;
    float* pg = prob + g * cap;
    float sum = 0;
    InOrder(pg, lo(b), hi(b), [&](int64_t j, float v) {
      sum += v;
      pg[j] = c::RoundBf16(v);
    });
    block_sum[g * blocks + b] = sum;
  }
  __syncthreads();
  if (tid < hn) {
    float den = 0;
    for (int64_t b = b0; b < b1; ++b) {
      den = den * block_rescale[tid * blocks + b] + block_sum[tid * blocks + b];
    }
    denom[tid] = den + fm::Exp(p.sink[h0 + tid] - run_m[tid]);
  }
  __syncthreads();
  // The keys in list order, kOnceSumAhead<H> at a time, the next ones' loads issued before these
  // are summed; at an attention block's last key each head's accumulator takes acc * rescale +
  // the block's sum. A thread past the head's dimensions sums nothing (it stays for the barriers
  // of the rotation below).
  const float* keys = p.workspace + l.keys + tl * cap * hd + d;
  const auto load = [&](int64_t j0, float* v) {
    FLASHD_UNROLL
    for (int u = 0; u < kOnceSumAhead<H>; ++u) v[u] = j0 + u < end ? keys[(j0 + u) * hd] : 0.0f;
  };
  float acc[H], part[H], now[kOnceSumAhead<H>] = {}, next[kOnceSumAhead<H>] = {};
  FLASHD_UNROLL
  for (int g = 0; g < H; ++g) acc[g] = 0, part[g] = 0;
  int64_t b = b0;
  const int64_t sum_end = d < hd ? end : w0;
  if (d < hd) load(w0, now);
  for (int64_t j0 = w0; j0 < sum_end; j0 += kOnceSumAhead<H>) {
    if (j0 + kOnceSumAhead<H> < end) load(j0 + kOnceSumAhead<H>, next);
    FLASHD_UNROLL
    for (int u = 0; u < kOnceSumAhead<H>; ++u) {
      const int64_t j = j0 + u;
      if (j >= end) break;
      FLASHD_UNROLL
      for (int g = 0; g < H; ++g) {
        if (g < hn) part[g] += prob[g * cap + j] * now[u];
      }
      if (j + 1 == hi(b)) {
        FLASHD_UNROLL
        for (int g = 0; g < H; ++g) {
          if (g >= hn) break;
          acc[g] = acc[g] * block_rescale[g * blocks + b] + part[g];
          part[g] = 0;
        }
        ++b;
      }
    }
    FLASHD_UNROLL
    for (int u = 0; u < kOnceSumAhead<H>; ++u) now[u] = next[u];
  }
  // Each head's output rounded to BF16, its last rope_dim dimensions then rotated back by the
  // query's position (the Rope op's step: the two values of a pair are neighbouring threads', so
  // each writes its own to shared memory and reads the other's).
  float* pair = block_sum + H * blocks;  // kOnceSumThreads floats.
  const int64_t r0 = hd - p.rope_dim;
  const bool rotated = d >= r0 && d < hd;
  float sn = 0, cs = 1;
  if (rotated) {
    PairSinCos(static_cast<float>(p.positions[t]) * p.freqs[(d - r0) / 2], true, &sn, &cs);
  }
  const bool second = (d - r0) % 2 != 0;
  for (int g = 0; g < hn; ++g) {
    float v = 0;
    FLASHD_UNROLL
    for (int q = 0; q < H; ++q) {
      if (q == g) v = c::RoundBf16(acc[q] / denom[q]);
    }
    pair[tid] = v;
    __syncthreads();
    const float other = pair[tid ^ 1u];
    __syncthreads();  // Before the next head's values.
    if (rotated) v = RotatedValue(second ? other : v, second ? v : other, sn, cs, second);
    if (d < hd) p.out[(t * p.heads + h0 + g) * hd + d] = v;
  }
}

// The current device's multiprocessors, asked of the runtime once per device.
int Multiprocessors() {
  constexpr int kDevices = 64;
  static std::atomic<int> known[kDevices] = {};
  int device = 0;
  if (gpuGetDevice(&device) != gpuSuccess || device < 0 || device >= kDevices) return 1;
  int count = known[device].load(std::memory_order_relaxed);
  if (count == 0) {
    gpuDeviceProp_t prop{};
    count = gpuGetDeviceProperties(&prop, device) == gpuSuccess && prop.multiProcessorCount > 0
                ? prop.multiProcessorCount
                : 1;
    known[device].store(count, std::memory_order_relaxed);
  }
  return count;
}

bool ValidShape(const SparseAttentionParams& p) {
  return p.tokens >= 0 && p.heads > 0 && p.head_dim > 0 && p.head_dim % 32 == 0 &&
         p.head_dim <= kMaxHeadDim && p.window > 0 && p.positions != nullptr &&
         p.window_first != nullptr && p.rope_dim > 0 && p.rope_dim % 2 == 0 &&
         p.rope_dim <= p.head_dim && p.freqs != nullptr &&
         (p.selected_stride == 0 ||
          (p.selected != nullptr && (p.block_table != nullptr || p.token_sequence != nullptr))) &&
         (p.token_sequence == nullptr || (p.sequences != nullptr && p.sequence_count > 0));
}

// The output's heads rotated back, each by its query's position.
OpStatus RotateBack(const SparseAttentionParams& p) {
  return Rope({.x = p.out,
               .rows = p.tokens,
               .heads = p.heads,
               .head_dim = p.head_dim,
               .rope_dim = p.rope_dim,
               .row_stride = p.heads * p.head_dim,
               .positions = p.positions,
               .freqs = p.freqs,
               .inverse = true,
               .stream = p.stream});
}

template <int H>
OpStatus AttendOnce(const SparseAttentionParams& p) {
  OnceLayout l = OnceLayoutOf(p);
  const size_t shared = OnceSumShared(l.capacity, H);
  const auto stream = static_cast<gpuStream_t>(p.stream);
  for (l.t0 = 0; l.t0 < p.tokens; l.t0 += l.pass) {
    const int64_t queries = p.tokens - l.t0 < l.pass ? p.tokens - l.t0 : l.pass;
    const int64_t logit_blocks = queries * ((l.capacity + kOnceLogitKeys - 1) / kOnceLogitKeys) *
                                 ((p.heads + kOnceLogitHeads - 1) / kOnceLogitHeads);
    const int64_t sum_blocks =
        queries * ((p.heads + H - 1) / H) * ((p.head_dim + kOnceSumThreads - 1) / kOnceSumThreads);
    if (std::max(logit_blocks, sum_blocks) > int64_t{0x7FFFFFFF}) {
      return OpStatus::kBadShape;  // The grid's limit.
    }
    FLASHD_LAUNCH(LogitsKernel, static_cast<unsigned>(logit_blocks), kOnceLogitThreads, 0, stream,
                  p, l);
    FLASHD_LAUNCH(SoftmaxSumsKernel<H>, static_cast<unsigned>(sum_blocks), kOnceSumThreads, shared,
                  stream, p, l);
    if (gpuGetLastError() != gpuSuccess) return OpStatus::kDeviceError;
  }
  return OpStatus::kOk;
}

// AttendKernel over `slices` (1 or 2) thread blocks a head; 0: two where a query's heads, one a
// thread block, leave half the SMs idle.
OpStatus Attend(const SparseAttentionParams& p, int slices) {
  // Heads eight to a thread block where the queries are many; one where they are few.
  const bool grouped = p.tokens >= kGroupTokens;
  if (slices == 0) slices = !grouped && p.tokens * p.heads * 2 <= Multiprocessors() ? 2 : 1;
  const int64_t n = p.tokens * (grouped ? (p.heads + 7) / 8 : p.heads) * slices;
  if (n > int64_t{0x7FFFFFFF}) return OpStatus::kBadShape;  // The grid's limit.
  const auto stream = static_cast<gpuStream_t>(p.stream);
  if (grouped) {
    FLASHD_LAUNCH(AttendKernel<8>, static_cast<unsigned>(n), kAttendThreads, 0, stream, p, slices);
  } else {
    FLASHD_LAUNCH(AttendKernel<1>, static_cast<unsigned>(n), kAttendThreads, 0, stream, p, slices);
  }
  if (gpuGetLastError() != gpuSuccess) return OpStatus::kDeviceError;
  return RotateBack(p);
}

}  // namespace

int64_t SparseAttentionWorkspaceFloats(const SparseAttentionParams& p) {
  return p.tokens > 0 && OnceHeads(p) > 0 ? OnceLayoutOf(p).total : 0;
}

OpStatus SparseAttentionScheduled(const SparseAttentionParams& p, AttentionSchedule schedule) {
  if (!ValidShape(p)) return OpStatus::kBadShape;
  if (p.tokens == 0) return OpStatus::kOk;
  const int heads = OnceHeads(p);
  const bool once = heads > 0 && p.workspace != nullptr &&
                    p.workspace_floats >= OnceLayoutOf(p).total &&
                    reinterpret_cast<uintptr_t>(p.q) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(p.workspace) % 16 == 0;
  const auto attend_once = [&] { return heads == 8 ? AttendOnce<8>(p) : AttendOnce<1>(p); };
  switch (schedule) {
    case AttentionSchedule::kAuto:
      return once ? attend_once() : Attend(p, 0);
    case AttentionSchedule::kHeadBlocks:
      return Attend(p, 1);
    case AttentionSchedule::kHeadBlocksSplit:
      return Attend(p, 2);
    case AttentionSchedule::kKeysOnce:
      return once ? attend_once() : OpStatus::kBadArgument;
  }
  return OpStatus::kBadArgument;
}

OpStatus SparseAttention(const SparseAttentionParams& p) {
  return SparseAttentionScheduled(p, AttentionSchedule::kAuto);
}

}  // namespace flashd::kernels::FLASHD_GPU_BACKEND
