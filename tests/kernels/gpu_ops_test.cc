// Every GPU op against its CPU reference (kernels/cpu), on the same inputs: bit-equal (the
// kernels sum in the reference's order and share its exp, sin and cos, kernels/fmath.h), but for
// the free-order and matrix-core GEMMs, held within rounding. Built once per GPU backend; the HIP
// CPU runtime build runs in every `make test`, the CUDA and HIP builds exit 77 (skipped) without a
// device.
#include <algorithm>
#include <bit>
#include <boost/test/unit_test.hpp>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "kernels/codecs.h"
#include "kernels/cpu/formats.h"
#include "kernels/cpu/ops.h"
#include "kernels/gpu/device.h"
#include "kernels/gpu/ops.h"
#include "tests/support/moe_choices.h"
#include "tests/support/quantized_weights.h"
#include "tests/support/require_device.h"

namespace gpu = flashd::kernels::FLASHD_GPU_BACKEND;
namespace cpu = flashd::kernels::cpu;
using namespace flashd::kernels;

namespace {

using flashd::testing::RequireDevice;
BOOST_TEST_GLOBAL_FIXTURE(RequireDevice);

// A device copy of a host vector, copied back on request.
template <typename T>
class Dev {
 public:
  explicit Dev(const std::vector<T>& host) : n_(host.size()) {
    BOOST_REQUIRE(gpu::DeviceAlloc(&ptr_, std::max<size_t>(1, n_) * sizeof(T)).empty());
    if (n_ > 0) BOOST_REQUIRE(gpu::CopyToDevice(ptr_, host.data(), n_ * sizeof(T)).empty());
  }
  ~Dev() { (void)gpu::DeviceFree(ptr_); }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
  T* get() const { return static_cast<T*>(ptr_); }
  std::vector<T> Host() const {
    BOOST_REQUIRE(gpu::Synchronize().empty());
    std::vector<T> out(n_);
    if (n_ > 0) BOOST_REQUIRE(gpu::CopyToHost(out.data(), ptr_, n_ * sizeof(T)).empty());
    return out;
  }

 private:
  void* ptr_ = nullptr;
  size_t n_;
};

// KV blocks on the host and the same blocks on the device, each side with its table of block
// pointers (what PagedRows reads).
struct Blocks {
  std::vector<std::vector<uint8_t>> host;
  std::vector<uint8_t*> host_table, dev_ptrs;
  std::vector<std::unique_ptr<Dev<uint8_t>>> dev;
  std::unique_ptr<Dev<uint8_t*>> dev_table;

  // Copies the host blocks to the device (call after filling them).
  void Upload() {
    host_table.clear();
    for (auto& b : host) host_table.push_back(b.data());
    for (auto& b : host) {
      dev.push_back(std::make_unique<Dev<uint8_t>>(b));
      dev_ptrs.push_back(dev.back()->get());
    }
    dev_table = std::make_unique<Dev<uint8_t*>>(dev_ptrs);
  }
};

std::vector<float> Normal(std::mt19937& rng, size_t n, float sd = 1.0f) {
  std::normal_distribution<float> d(0.0f, sd);
  std::vector<float> v(n);
  for (float& x : v) x = cpu::Bf16ToFloat(cpu::FloatToBf16(d(rng)));
  return v;
}

bool BitEqual(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

// TopK in the total order of `rows` rows of `stride` values (row r's first n[r]) by the CPU op
// (first) and by the device's (second); `ascending` as TopKParams'.
std::pair<std::vector<int64_t>, std::vector<int64_t>> TopKBoth(const std::vector<float>& v,
                                                               int64_t rows, int64_t stride,
                                                               int64_t k,
                                                               const std::vector<int64_t>& n,
                                                               bool ascending = false) {
  std::vector<int64_t> want(rows * k);
  cpu::TopK({.values = v.data(),
             .rows = rows,
             .stride = stride,
             .k = k,
             .n = n.data(),
             .order = TopKOrder::kTotal,
             .out = want.data(),
             .ascending = ascending});
  Dev<float> dv(v);
  Dev<int64_t> dn(n), dout(std::vector<int64_t>(want.size()));
  BOOST_REQUIRE(gpu::TopK({.values = dv.get(),
                           .rows = rows,
                           .stride = stride,
                           .k = k,
                           .n = dn.get(),
                           .order = TopKOrder::kTotal,
                           .out = dout.get(),
                           .ascending = ascending}) == OpStatus::kOk);
  return {std::move(want), dout.Host()};
}

// Each row of `picks` [rows, k] sorted ascending, its -1 padding kept after the picks.
std::vector<int64_t> SortedPicks(std::vector<int64_t> picks, int64_t k) {
  for (size_t r = 0; r < picks.size(); r += static_cast<size_t>(k)) {
    const auto end = std::find(picks.begin() + r, picks.begin() + r + k, -1);
    std::sort(picks.begin() + r, end);
  }
  return picks;
}

// A linear layer's shape; Params fills a LinearParams of it with the given buffers (host ones
// for the CPU op, device ones for the GPU's).
struct LinearShape {
  WeightFormat format;
  int64_t rows, in, out;
  LinearParams Params(const float* x, const uint8_t* w, const uint8_t* w_scales, const float* dense,
                      uint8_t* x_codes, uint8_t* x_scales, float* y) const {
    return {.x = x,
            .rows = rows,
            .in = in,
            .out = out,
            .format = format,
            .w = w,
            .w_scales = w_scales,
            .dense = dense,
            .x_codes = x_codes,
            .x_scales = x_scales,
            .y = y};
  }
};

// A quantized GEMM's weight format and dimensions, and the CPU's results for `rows` rows of x
// (the activation codes and scales it made in *xq and *xs).
struct GemmCase {
  WeightFormat format;
  int64_t in, out;
  std::vector<float> Cpu(int64_t rows, const std::vector<float>& x,
                         const flashd::testing::QuantizedWeights& qw, std::vector<uint8_t>* xq,
                         std::vector<uint8_t>* xs) const {
    std::vector<float> y(rows * out);
    xq->resize(rows * in), xs->resize(rows * in / 32 + 1);
    const LinearShape shape{format, rows, in, out};
    BOOST_REQUIRE(cpu::Linear(shape.Params(x.data(), qw.codes.data(), qw.scales.data(), nullptr,
                                           xq->data(), xs->data(), y.data())) == OpStatus::kOk);
    return y;
  }
};

const int64_t kRows[] = {1, 3, 257};

// The backend these tests run: cuda, hip or hipcpu.
constexpr std::string_view kBackend = gpu::kBackendName;

BOOST_AUTO_TEST_SUITE(gpu_ops)

// Two kernels launched on one stream run in launch order, also when the host is slow between the
// launches (a loaded machine): each op's second kernel (the GEMM after the activations'
// quantization, RoPE after attention) reads the first's output.
BOOST_AUTO_TEST_CASE(kernels_on_one_stream_run_in_order) {
  int wrong = -1;
  const std::string err = gpu::StreamOrderCheck(200, 150, &wrong);
  BOOST_REQUIRE_MESSAGE(err.empty(), err);
  BOOST_TEST(wrong == 0, wrong << " of 200 rounds read the first kernel's output early");
}

// Kernels start early only where the device's code waits for the kernels ahead at
// FLASHD_GRID_BEGIN (NVIDIA's, compute capability 9.0 and up): never through the HIP CPU runtime
// or on AMD. Either way a kernel reads what the kernel ahead of it wrote, not what was there.
BOOST_AUTO_TEST_CASE(kernels_start_early_only_where_they_wait_for_the_one_ahead) {
  const bool was = gpu::EarlyLaunch();
  const bool early = gpu::SetEarlyLaunch(true);
  BOOST_TEST(gpu::EarlyLaunch() == early);
  if (kBackend != "cuda") BOOST_TEST(!early);
  BOOST_TEST(!gpu::SetEarlyLaunch(false));
  BOOST_TEST(!gpu::EarlyLaunch());
  for (const bool on : {false, early}) {
    BOOST_TEST(gpu::SetEarlyLaunch(on) == on);
    int wrong = -1;
    const std::string err = gpu::StreamOrderCheck(100, 150, &wrong);
    BOOST_REQUIRE_MESSAGE(err.empty(), err);
    BOOST_TEST(wrong == 0,
               wrong << " of 100 rounds read the first kernel's output early (early " << on << ")");
  }
  gpu::SetEarlyLaunch(was);
}

// A copy queued from pinned memory between two kernels lands after the first has read the
// buffer and before the second does (the backend queues a step's small uploads this way).
BOOST_AUTO_TEST_CASE(a_queued_copy_runs_between_the_kernels_around_it) {
  int wrong = -1;
  const std::string err = gpu::QueuedCopyCheck(50, &wrong);
  BOOST_REQUIRE_MESSAGE(err.empty(), err);
  BOOST_TEST(wrong == 0, wrong << " of 100 kernel outputs read the buffer out of order");
}

// The portable GEMMs sum in the CPU fast path's order: equal bit for bit, all three formats.
BOOST_AUTO_TEST_CASE(linear_all_formats_bit_equal) {
  std::mt19937 rng(6);
  struct Case {
    WeightFormat format;
    int64_t in, out;
  };
  // 70 and 130 K-blocks: more than one chunk of the tile, the last part; the one-row GEMV with
  // many column groups a thread block (2 and 3 K-blocks), a group cut by N, and 257 K-blocks (a
  // thread's third item, one group).
  const Case cases[] = {{WeightFormat::kFp8, 64, 33},  {WeightFormat::kFp8, 160, 70},
                        {WeightFormat::kFp8, 2240, 9}, {WeightFormat::kFp4, 96, 33},
                        {WeightFormat::kFp4, 4160, 5}, {WeightFormat::kDense, 45, 31},
                        {WeightFormat::kFp8, 8224, 7}, {WeightFormat::kFp4, 8224, 13}};
  for (const Case& c : cases) {
    for (int64_t rows : kRows) {
      std::vector<float> x = Normal(rng, rows * c.in), w = Normal(rng, c.out * c.in, 0.2f);
      const flashd::testing::QuantizedWeights qw =
          flashd::testing::QuantizeWeights(c.format, w, c.out, c.in);
      const std::vector<uint8_t>& wq = qw.codes;
      const std::vector<uint8_t>& ws = qw.scales;
      std::vector<uint8_t> xq(x.size()), xs(x.size() / 32 + 1);
      std::vector<float> want(rows * c.out);
      const LinearShape shape{c.format, rows, c.in, c.out};
      BOOST_REQUIRE(cpu::Linear(shape.Params(x.data(), wq.data(), ws.data(), w.data(), xq.data(),
                                             xs.data(), want.data())) == OpStatus::kOk);
      Dev<float> dx(x), dw(w), dy(std::vector<float>(want.size()));
      Dev<uint8_t> dwq(wq), dws(ws), dxq(xq), dxs(xs);
      BOOST_REQUIRE(gpu::Linear(shape.Params(dx.get(), dwq.get(), dws.get(), dw.get(), dxq.get(),
                                             dxs.get(), dy.get())) == OpStatus::kOk);
      BOOST_TEST(BitEqual(dy.Host(), want),
                 "format " << static_cast<int>(c.format) << " rows " << rows);
      if (c.format != WeightFormat::kDense) {
        BOOST_TEST((dxq.Host() == xq));  // The activation codes too.
      }
    }
  }
}

// One row whose block sums outgrow the one-row GEMV's shared memory (FP8 past 2,048 K-blocks, FP4
// past 1,023) goes to the GEMM tile: the same sums, bit for bit.
BOOST_AUTO_TEST_CASE(linear_one_row_past_the_gemv_bit_equal) {
  std::mt19937 rng(7);
  for (const auto& [format, in] : {std::pair{WeightFormat::kFp8, int64_t{65600}},
                                   std::pair{WeightFormat::kFp4, int64_t{32800}}}) {
    const int64_t out = 3;
    std::vector<float> x = Normal(rng, in), w = Normal(rng, out * in, 0.2f);
    const flashd::testing::QuantizedWeights qw =
        flashd::testing::QuantizeWeights(format, w, out, in);
    std::vector<uint8_t> xq(in), xs(in / 32);
    std::vector<float> want(out);
    const LinearShape shape{format, 1, in, out};
    BOOST_REQUIRE(cpu::Linear(shape.Params(x.data(), qw.codes.data(), qw.scales.data(), nullptr,
                                           xq.data(), xs.data(), want.data())) == OpStatus::kOk);
    Dev<float> dx(x), dy(std::vector<float>(out, 0.0f));
    Dev<uint8_t> dwq(qw.codes), dws(qw.scales), dxq(xq), dxs(xs);
    BOOST_REQUIRE(gpu::Linear(shape.Params(dx.get(), dwq.get(), dws.get(), nullptr, dxq.get(),
                                           dxs.get(), dy.get())) == OpStatus::kOk);
    BOOST_TEST(BitEqual(dy.Host(), want), "format " << static_cast<int>(format));
  }
}

// Every weight code, NaN codes included, block scales from 2^-27 to 2^20, and activations at
// both ends of the quantizer's range (below its smallest scale, and near 1e20): the GEMMs decode
// codes through scaled bit patterns and stage activations scaled, so these check that every
// value comes out as the CPU's, bit for bit (a NaN where the CPU has one).
BOOST_AUTO_TEST_CASE(linear_every_code_and_extreme_activations_bit_equal) {
  std::mt19937 rng(31);
  const int64_t in = 2048, out = 40;
  for (WeightFormat format : {WeightFormat::kFp8, WeightFormat::kFp4}) {
    for (bool nan_codes : {false, true}) {
      if (format == WeightFormat::kFp4 && nan_codes) continue;  // E2M1 has no NaN.
      const int64_t code_bytes = format == WeightFormat::kFp8 ? out * in : out * in / 2;
      std::vector<uint8_t> wq(code_bytes);
      for (int64_t i = 0; i < code_bytes; ++i) {
        uint8_t code = static_cast<uint8_t>(rng());
        if (format == WeightFormat::kFp8 && (code & 0x7F) == 0x7F) code ^= 1;  // Not NaN.
        wq[i] = code;
      }
      if (nan_codes) {
        wq[3 * in + 100] = 0x7F;   // Column 3: a NaN.
        wq[5 * in + 2047] = 0xFF;  // Column 5: -NaN, in its last block.
      }
      const int64_t scale_rows = format == WeightFormat::kFp8 ? (out + 31) / 32 : out;
      std::vector<uint8_t> ws(scale_rows * (in / 32));
      for (uint8_t& s : ws) s = static_cast<uint8_t>(100 + rng() % 48);  // 2^-27 .. 2^20
      std::vector<float> x = Normal(rng, 3 * in);
      for (int64_t k = 0; k < in; ++k) {
        x[in + k] *= 1e-7f;  // Below the quantizer's smallest scale: subnormal codes.
        x[2 * in + k] *= 1e20f;
      }
      for (int64_t rows : {int64_t{1}, int64_t{3}}) {
        std::vector<uint8_t> xq(rows * in), xs(rows * in / 32);
        std::vector<float> want(rows * out);
        const LinearShape shape{format, rows, in, out};
        BOOST_REQUIRE(cpu::Linear(shape.Params(x.data(), wq.data(), ws.data(), nullptr, xq.data(),
                                               xs.data(), want.data())) == OpStatus::kOk);
        Dev<float> dx(std::vector<float>(x.begin(), x.begin() + rows * in));
        Dev<float> dy(std::vector<float>(want.size()));
        Dev<uint8_t> dwq(wq), dws(ws), dxq(xq), dxs(xs);
        BOOST_REQUIRE(gpu::Linear(shape.Params(dx.get(), dwq.get(), dws.get(), nullptr, dxq.get(),
                                               dxs.get(), dy.get())) == OpStatus::kOk);
        const std::vector<float> got = dy.Host();
        int nans = 0;
        for (size_t i = 0; i < want.size(); ++i) {
          if (std::isnan(want[i])) {
            ++nans;
            BOOST_TEST(std::isnan(got[i]), "value " << i << ": " << got[i] << ", want NaN");
          } else {
            BOOST_TEST(codecs::Bits(got[i]) == codecs::Bits(want[i]),
                       "format " << static_cast<int>(format) << " rows " << rows << " value " << i
                                 << ": " << got[i] << " want " << want[i]);
          }
        }
        BOOST_TEST(nans == (nan_codes ? 2 * rows : 0));
      }
    }
  }
}

// The fixed order split over K (each 32-block's sum written out, then added in block order)
// gives the CPU's results bit for bit whatever the split: parts of one block or many, parts
// ending inside a chunk of the tile, more parts than blocks (some empty); and Linear, given the
// workspace, gives the same without using it.
BOOST_AUTO_TEST_CASE(linear_split_over_k_is_the_cpu_order) {
  std::mt19937 rng(61);
  const int64_t in = 3200, out = 70;  // 100 K-blocks; three column tiles, the last part full.
  for (WeightFormat format : {WeightFormat::kFp8, WeightFormat::kFp4}) {
    const flashd::testing::QuantizedWeights qw =
        flashd::testing::QuantizeWeights(format, Normal(rng, out * in, 0.05f), out, in);
    Dev<uint8_t> dwq(qw.codes), dws(qw.scales);
    for (int64_t rows : {int64_t{1}, int64_t{3}, int64_t{8}}) {
      const std::vector<float> x = Normal(rng, rows * in);
      std::vector<uint8_t> xq(rows * in), xs(rows * in / 32);
      std::vector<float> want(rows * out);
      const LinearShape shape{format, rows, in, out};
      BOOST_REQUIRE(cpu::Linear(shape.Params(x.data(), qw.codes.data(), qw.scales.data(), nullptr,
                                             xq.data(), xs.data(), want.data())) == OpStatus::kOk);
      Dev<float> dx(x), dy(std::vector<float>(want.size()));
      Dev<float> dsums(std::vector<float>(rows * out * (in / 32)));
      Dev<uint8_t> dxq(xq), dxs(xs);
      LinearParams p =
          shape.Params(dx.get(), dwq.get(), dws.get(), nullptr, dxq.get(), dxs.get(), dy.get());
      p.block_sums = dsums.get();
      p.block_sums_count = rows * out * (in / 32);
      // NaN in the workspace before each run: a block sum not written shows.
      const std::vector<float> poison(rows * out * (in / 32), std::nanf(""));
      for (int split : {1, 2, 3, 7, 13, 100, 130}) {
        BOOST_REQUIRE(gpu::ZeroOnDevice(dy.get(), want.size() * 4).empty());
        BOOST_REQUIRE(gpu::CopyToDevice(dsums.get(), poison.data(), poison.size() * 4).empty());
        BOOST_REQUIRE(gpu::LinearSplit(p, split) == OpStatus::kOk);
        BOOST_TEST(BitEqual(dy.Host(), want),
                   "format " << static_cast<int>(format) << " rows " << rows << " split " << split);
      }
      BOOST_REQUIRE(gpu::ZeroOnDevice(dy.get(), want.size() * 4).empty());
      BOOST_REQUIRE(gpu::Linear(p) == OpStatus::kOk);
      BOOST_TEST(BitEqual(dy.Host(), want), "Linear, rows " << rows);
      // Linear does not split (the H200 measured no split faster: docs/benchmarks.md): the
      // workspace, poisoned before it ran, is untouched.
      BOOST_REQUIRE(gpu::CopyToDevice(dsums.get(), poison.data(), poison.size() * 4).empty());
      BOOST_REQUIRE(gpu::Linear(p) == OpStatus::kOk);
      const std::vector<float> sums_after = dsums.Host();
      BOOST_TEST(
          std::all_of(sums_after.begin(), sums_after.end(), [](float v) { return std::isnan(v); }),
          "rows " << rows);
      // Without room for the sums there is no split.
      p.block_sums_count = rows * out * (in / 32) - 1;
      BOOST_TEST((gpu::LinearSplit(p, 2) == OpStatus::kBadArgument));
      BOOST_REQUIRE(gpu::ZeroOnDevice(dy.get(), want.size() * 4).empty());
      BOOST_REQUIRE(gpu::Linear(p) == OpStatus::kOk);
      BOOST_TEST(BitEqual(dy.Host(), want), "Linear without the sums' room, rows " << rows);
    }
  }
}

// Choices of `k` distinct experts of `experts` per token, some experts chosen by many tokens
// (more than one GEMM tile's rows), some by none; weights random.
void RandomChoices(std::mt19937& rng, int64_t tokens, int64_t experts, int64_t k,
                   std::vector<int64_t>* chosen, std::vector<float>* weights) {
  // Half the picks from the first few experts, so those take many tokens.
  *chosen = flashd::testing::DistinctChoices(tokens, k, [&] {
    return rng() % 2 == 0 ? static_cast<int64_t>(rng() % std::min<int64_t>(experts, 3))
                          : static_cast<int64_t>(rng() % experts);
  });
  *weights = Normal(rng, chosen->size());
}

using Grouped = flashd::testing::GroupedRows;

// `tokens` tokens' random choices of k of `experts` (RandomChoices), grouped by the CPU's
// MoeGroup: the slots the experts' GEMMs run over.
Grouped GroupedChoices(std::mt19937& rng, int64_t tokens, int64_t experts, int64_t k) {
  std::vector<int64_t> chosen;
  std::vector<float> weights;
  RandomChoices(rng, tokens, experts, k, &chosen, &weights);
  const int64_t total = tokens * k;
  Grouped g(std::min(experts, total), total);
  BOOST_REQUIRE(cpu::MoeGroup(g.Params(chosen.data(), weights.data(), tokens, experts, k)) ==
                OpStatus::kOk);
  return g;
}

// Random quantized weights for each of `experts` experts, on the host and on the device, with
// the tables of their addresses the experts' GEMMs take (host: w, ws; device: dw, dws).
struct ExpertWeights {
  std::vector<flashd::testing::QuantizedWeights> host;
  std::vector<std::unique_ptr<Dev<uint8_t>>> dev;
  std::vector<const uint8_t*> w, ws, dw, dws;
  ExpertWeights(std::mt19937& rng, WeightFormat format, int64_t experts, int64_t out, int64_t in) {
    for (int64_t e = 0; e < experts; ++e) {
      host.push_back(
          flashd::testing::QuantizeWeights(format, Normal(rng, out * in, 0.2f), out, in));
    }
    for (const auto& q : host) {
      w.push_back(q.codes.data());
      ws.push_back(q.scales.data());
      dev.push_back(std::make_unique<Dev<uint8_t>>(q.codes));
      dw.push_back(dev.back()->get());
      dev.push_back(std::make_unique<Dev<uint8_t>>(q.scales));
      dws.push_back(dev.back()->get());
    }
  }
};

// ExpertLinear's parameters over g's grouping and ew's weights (the host's tables) for the rows x
// [rows, in] and their workspace xq, xs; y is the caller's.
ExpertLinearParams ExpertParams(const Grouped& g, const ExpertWeights& ew, WeightFormat format,
                                int64_t in, int64_t out, const std::vector<float>& x,
                                std::vector<uint8_t>* xq, std::vector<uint8_t>* xs) {
  return {.x = x.data(),
          .rows = static_cast<int64_t>(x.size()) / in,
          .in = in,
          .out = out,
          .slot_expert = g.expert.data(),
          .slot_offset = g.offset.data(),
          .slot_tiles = g.tiles.data(),
          .slots = static_cast<int64_t>(g.expert.size()),
          .experts = static_cast<int64_t>(ew.w.size()),
          .format = format,
          .w = ew.w.data(),
          .w_scales = ew.ws.data(),
          .x_codes = xq->data(),
          .x_scales = xs->data()};
}

// ExpertParams' inputs copied to the device (the grouping, the weight tables, the rows and their
// workspace); On gives host parameters' device twin.
struct DeviceExpertInputs {
  Dev<float> x;
  Dev<int64_t> expert, offset, tiles;
  Dev<const uint8_t*> w, ws;
  Dev<uint8_t> xq, xs;
  DeviceExpertInputs(const ExpertLinearParams& p, const Grouped& g, const ExpertWeights& ew)
      : x(std::vector<float>(p.x, p.x + p.rows * p.in)),
        expert(g.expert),
        offset(g.offset),
        tiles(g.tiles),
        w(ew.dw),
        ws(ew.dws),
        xq(std::vector<uint8_t>(p.x_codes, p.x_codes + p.rows * p.in)),
        xs(std::vector<uint8_t>(p.x_scales, p.x_scales + p.rows * p.in / 32)) {}
  ExpertLinearParams On(ExpertLinearParams p, float* y) {
    p.x = x.get();
    p.slot_expert = expert.get();
    p.slot_offset = offset.get();
    p.slot_tiles = tiles.get();
    p.w = w.get();
    p.w_scales = ws.get();
    p.x_codes = xq.get();
    p.x_scales = xs.get();
    p.y = y;
    return p;
  }
};

// Tokens grouped by expert: the GPU's grouping is the CPU's, entry for entry (released shape:
// 384 experts, 6 per token; a small one where every expert is chosen and slots run out).
BOOST_AUTO_TEST_CASE(moe_group_is_the_cpu_grouping) {
  std::mt19937 rng(21);
  struct Case {
    int64_t tokens, experts, k;
  };
  for (const Case& c : {Case{1, 384, 6}, Case{37, 384, 6}, Case{37, 8, 3}, Case{2, 8, 3}}) {
    std::vector<int64_t> chosen;
    std::vector<float> weights;
    RandomChoices(rng, c.tokens, c.experts, c.k, &chosen, &weights);
    const int64_t total = c.tokens * c.k, slots = std::min(c.experts, total);
    Grouped want(slots, total);
    BOOST_REQUIRE(cpu::MoeGroup(want.Params(chosen.data(), weights.data(), c.tokens, c.experts,
                                            c.k)) == OpStatus::kOk);
    Dev<int64_t> dchosen(chosen), dexpert(want.expert), doffset(want.offset), dtiles(want.tiles),
        drows(want.rows);
    Dev<float> dweights(weights), drow_weights(want.weights);
    BOOST_REQUIRE(gpu::MoeGroup({.chosen = dchosen.get(),
                                 .weights = dweights.get(),
                                 .tokens = c.tokens,
                                 .experts = c.experts,
                                 .k = c.k,
                                 .slots = slots,
                                 .slot_expert = dexpert.get(),
                                 .slot_offset = doffset.get(),
                                 .slot_tiles = dtiles.get(),
                                 .rows = drows.get(),
                                 .row_weights = drow_weights.get()}) == OpStatus::kOk);
    BOOST_TEST(dexpert.Host() == want.expert, boost::test_tools::per_element());
    BOOST_TEST(doffset.Host() == want.offset, boost::test_tools::per_element());
    BOOST_TEST(dtiles.Host() == want.tiles, boost::test_tools::per_element());
    BOOST_TEST(drows.Host() == want.rows, boost::test_tools::per_element());
    BOOST_TEST(BitEqual(drow_weights.Host(), want.weights));
  }
  // More experts than the one thread block holds: refused (the backend runs those on the host).
  const int64_t many = kMoeGroupMaxExperts + 1;
  BOOST_TEST(
      (gpu::MoeGroup({.tokens = 1, .experts = many, .k = 6, .slots = 6}) == OpStatus::kBadShape));
}

// The experts' GEMMs over grouped rows equal the CPU's bit for bit: FP8 and FP4, slots of one
// row and of several tiles, slots left empty at the end.
BOOST_AUTO_TEST_CASE(expert_linear_is_the_cpu_per_expert_linear) {
  std::mt19937 rng(22);
  const int64_t tokens = 29, experts = 6, k = 3;
  const Grouped g = GroupedChoices(rng, tokens, experts, k);
  const int64_t total = tokens * k, slots = static_cast<int64_t>(g.expert.size());
  BOOST_TEST(g.offset[1] - g.offset[0] > 8);  // A slot of more than one tile.
  // 3 K-blocks; 73 (the one-row GEMV's thread blocks: several a row, the last cut by N).
  for (const auto& [format, in, out] :
       {std::tuple{WeightFormat::kFp8, int64_t{96}, int64_t{40}},
        std::tuple{WeightFormat::kFp4, int64_t{96}, int64_t{40}},
        std::tuple{WeightFormat::kFp8, int64_t{2336}, int64_t{44}},
        std::tuple{WeightFormat::kFp4, int64_t{2336}, int64_t{44}}}) {
    const ExpertWeights ew(rng, format, experts, out, in);
    const std::vector<float> x = Normal(rng, total * in);
    std::vector<uint8_t> xq(x.size()), xs(x.size() / 32);
    std::vector<float> want(total * out, -1.0f);
    ExpertLinearParams p = ExpertParams(g, ew, format, in, out, x, &xq, &xs);
    BOOST_REQUIRE(p.slots == slots);
    p.y = want.data();
    BOOST_REQUIRE(cpu::ExpertLinear(p) == OpStatus::kOk);
    DeviceExpertInputs dev(p, g, ew);
    Dev<float> dy(std::vector<float>(want.size(), -1.0f));
    p = dev.On(p, dy.get());
    BOOST_REQUIRE(gpu::ExpertLinear(p) == OpStatus::kOk);
    BOOST_TEST(BitEqual(dy.Host(), want), "format " << static_cast<int>(format));
    // The GEMV a row at a time (what a step of at most 8 tokens asks for), here over slots of
    // many rows: each row on its own, the same sums.
    Dev<float> dy1(std::vector<float>(want.size(), -1.0f));
    p.y = dy1.get();
    p.slot_rows = 1;
    BOOST_REQUIRE(gpu::ExpertLinear(p) == OpStatus::kOk);
    BOOST_TEST(BitEqual(dy1.Host(), want),
               "format " << static_cast<int>(format) << ", one-row tiles");
  }
}

// The experts' rows read where they are (x_rows: each grouped row's token row of x) give the op
// over the rows copied out, bit for bit: on the CPU, and on the device by the tile, the GEMV a
// row at a time, the gated pair and the matrix GEMMs with each instruction the backend has; a
// missing row count refused.
BOOST_AUTO_TEST_CASE(expert_rows_read_through_their_index_are_the_copied_rows) {
  std::mt19937 rng(37);
  const int64_t tokens = 7, experts = 6, k = 3, in = 96, out = 40;
  const Grouped g = GroupedChoices(rng, tokens, experts, k);
  const int64_t total = tokens * k;
  for (const WeightFormat format : {WeightFormat::kFp8, WeightFormat::kFp4}) {
    const ExpertWeights ew(rng, format, experts, out, in), up(rng, format, experts, out, in);
    const std::vector<float> source = Normal(rng, tokens * in, 2.0f);
    std::vector<float> copied(total * in);
    for (int64_t r = 0; r < total; ++r) {
      std::copy_n(source.begin() + g.rows[r] * in, in, copied.begin() + r * in);
    }
    std::vector<uint8_t> xq(copied.size()), xs(copied.size() / 32);
    std::vector<float> gate(total * out), up_out(gate.size());
    for (const bool gated : {false, true}) {
      BOOST_TEST_CONTEXT("format " << static_cast<int>(format) << " gated " << gated) {
        ExpertLinearParams p = ExpertParams(g, ew, format, in, out, copied, &xq, &xs);
        if (gated) {
          p.up = up.w.data(), p.up_scales = up.ws.data();
          p.gate = gate.data(), p.up_out = up_out.data();
        }
        std::vector<float> want(total * out), got(want.size());
        p.y = want.data();
        BOOST_REQUIRE(cpu::ExpertLinear(p) == OpStatus::kOk);
        ExpertLinearParams q = p;
        q.x = source.data();
        q.x_rows = g.rows.data();
        q.x_count = tokens;
        q.y = got.data();
        BOOST_REQUIRE(cpu::ExpertLinear(q) == OpStatus::kOk);
        BOOST_TEST(BitEqual(got, want), "cpu");
        DeviceExpertInputs dev(p, g, ew);
        Dev<float> dsource(source), dy(std::vector<float>(want.size(), 7.0f));
        Dev<int64_t> drows(g.rows);
        Dev<const uint8_t*> dup(up.dw), dup_s(up.dws);
        Dev<float> dg(gate), du(up_out);
        ExpertLinearParams d = dev.On(q, dy.get());
        d.x = dsource.get();
        d.x_rows = drows.get();
        if (gated)
          d.up = dup.get(), d.up_scales = dup_s.get(), d.gate = dg.get(), d.up_out = du.get();
        for (const int64_t slot_rows : {int64_t{0}, tokens}) {
          d.slot_rows = slot_rows;
          BOOST_REQUIRE(gpu::ExpertLinear(d) == OpStatus::kOk);
          BOOST_TEST(BitEqual(dy.Host(), want), "slot_rows " << slot_rows);
        }
        {
          // Given x's own rows' codes (x_row_codes), the GEMV reads them through x_rows: the same
          // values with one launch fewer; given the codes of twice the rows, their values. The
          // CPU may ignore them: its values are the rows' either way.
          std::vector<float> doubled(source.size());
          for (size_t i = 0; i < source.size(); ++i) doubled[i] = 2.0f * source[i];
          std::vector<uint8_t> rc(tokens * in), rs(tokens * in / 32), dc(rc.size()), ds(rs.size());
          for (int64_t t = 0; t < tokens; ++t) {
            cpu::QuantizeFp8PerBlock(&source[t * in], in, 32, &rc[t * in], &rs[t * in / 32]);
            cpu::QuantizeFp8PerBlock(&doubled[t * in], in, 32, &dc[t * in], &ds[t * in / 32]);
          }
          std::vector<float> want2(want.size()), cpu_got(want.size());
          ExpertLinearParams q2 = q;
          q2.x = doubled.data(), q2.y = want2.data();
          BOOST_REQUIRE(cpu::ExpertLinear(q2) == OpStatus::kOk);
          q2 = q;
          q2.x_row_codes = rc.data(), q2.x_row_scales = rs.data(), q2.y = cpu_got.data();
          BOOST_REQUIRE(cpu::ExpertLinear(q2) == OpStatus::kOk);
          BOOST_TEST(BitEqual(cpu_got, want), "cpu given codes");
          d.slot_rows = tokens;
          const uint64_t before = gpu::KernelLaunches();
          BOOST_REQUIRE(gpu::ExpertLinear(d) == OpStatus::kOk);
          const uint64_t quantizing = gpu::KernelLaunches() - before;
          for (const auto& [codes, scales, expect] :
               {std::tuple{&rc, &rs, &want}, {&dc, &ds, &want2}}) {
            Dev<uint8_t> dcodes(*codes), dscales(*scales);
            ExpertLinearParams e = d;
            e.x_row_codes = dcodes.get(), e.x_row_scales = dscales.get();
            const uint64_t at = gpu::KernelLaunches();
            BOOST_REQUIRE(gpu::ExpertLinear(e) == OpStatus::kOk);
            BOOST_TEST(gpu::KernelLaunches() - at == quantizing - 1);
            BOOST_TEST(BitEqual(dy.Host(), *expect), "given codes");
          }
        }
        for (const gpu::MatrixInstruction ins :
             {gpu::MatrixInstruction::kMma, gpu::MatrixInstruction::kMfma}) {
          if (ins == gpu::MatrixInstruction::kMfma && kBackend == "cuda") continue;
          // The matrix GEMMs' own results, from the copied rows, against the indexed rows'.
          Dev<float> dcopied_y(std::vector<float>(want.size(), 7.0f));
          BOOST_REQUIRE(gpu::ExpertLinearMatrix(
                            [&] {
                              ExpertLinearParams c = d;
                              c.x = dev.x.get();
                              c.x_rows = nullptr;
                              c.y = dcopied_y.get();
                              return c;
                            }(),
                            ins) == OpStatus::kOk);
          BOOST_REQUIRE(gpu::ExpertLinearMatrix(d, ins) == OpStatus::kOk);
          BOOST_TEST(BitEqual(dy.Host(), dcopied_y.Host()), "matrix " << static_cast<int>(ins));
        }
        d.x_count = 0;
        BOOST_TEST((gpu::ExpertLinear(d) == OpStatus::kBadShape));
        q.x_count = 0;
        BOOST_TEST((cpu::ExpertLinear(q) == OpStatus::kBadShape));
      }
    }
  }
}

// A gated pair's definition, computed here: `one` (the CPU's ungated op) for the gates' weights
// and for the ups', then the CPU's Swiglu of the two.
template <class P, class One>
std::vector<float> TwoOpsAndSwiglu(const P& p, One one) {
  const size_t n = static_cast<size_t>(p.rows * p.out);
  std::vector<float> g(n), u(n), h(n);
  P q = p;
  q.up = q.up_scales = nullptr;
  q.y_codes = q.y_code_scales = nullptr;
  q.y = g.data();
  BOOST_REQUIRE(one(q) == OpStatus::kOk);
  q.w = p.up;
  q.w_scales = p.up_scales;
  q.y = u.data();
  BOOST_REQUIRE(one(q) == OpStatus::kOk);
  BOOST_REQUIRE(cpu::Swiglu({.gate = g.data(),
                             .up = u.data(),
                             .rows = p.rows,
                             .inter = p.out,
                             .row_weights = p.row_weights,
                             .limit = p.limit,
                             .h = h.data()}) == OpStatus::kOk);
  return h;
}

// The experts' gated pair (w1 and w3 under SwiGLU) in one op: the CPU's is two ExpertLinear ops
// and a Swiglu op; the device's, whether its one-row GEMV makes both sums and the SwiGLU in one
// kernel or the tile makes them apart, gives the same values bit for bit (NaN where the CPU's is
// NaN: a NaN weight code in one expert's gate, which the limit's clamp keeps), with and without
// row weights and a limit, FP8 and FP4, slots of one row and of many, K of 3 and of 73 blocks.
BOOST_AUTO_TEST_CASE(expert_gated_pair_is_two_linears_and_swiglu) {
  std::mt19937 rng(23);
  const int64_t tokens = 29, experts = 6, k = 3;
  const Grouped g = GroupedChoices(rng, tokens, experts, k);
  const int64_t total = tokens * k, slots = static_cast<int64_t>(g.expert.size());
  for (const auto& [format, in, out] :
       {std::tuple{WeightFormat::kFp8, int64_t{96}, int64_t{40}},
        std::tuple{WeightFormat::kFp4, int64_t{96}, int64_t{40}},
        std::tuple{WeightFormat::kFp8, int64_t{2336}, int64_t{44}},
        std::tuple{WeightFormat::kFp4, int64_t{2336}, int64_t{44}}}) {
    ExpertWeights gate(rng, format, experts, out, in), up(rng, format, experts, out, in);
    if (format == WeightFormat::kFp8) {
      // Column 3 of expert 1's gate holds a NaN code (E4M3 0x7F): its gates are NaN.
      const int64_t e = 1;
      auto& codes = gate.host[e].codes;
      codes[3 * in + 5] = 0x7F;
      gate.dev[2 * e] = std::make_unique<Dev<uint8_t>>(codes);
      gate.dw[e] = gate.dev[2 * e]->get();
    }
    const std::vector<float> x = Normal(rng, total * in, 2.0f);
    const std::vector<float> row_weights = Normal(rng, total);
    std::vector<uint8_t> xq(x.size()), xs(x.size() / 32);
    for (const bool weighted : {false, true}) {
      for (const float limit : {0.0f, 1.0f}) {
        std::vector<float> want(total * out, -1.0f), wg(want.size()), wu(want.size());
        ExpertLinearParams p{.x = x.data(),
                             .rows = total,
                             .in = in,
                             .out = out,
                             .slot_expert = g.expert.data(),
                             .slot_offset = g.offset.data(),
                             .slot_tiles = g.tiles.data(),
                             .slots = slots,
                             .experts = experts,
                             .format = format,
                             .w = gate.w.data(),
                             .w_scales = gate.ws.data(),
                             .x_codes = xq.data(),
                             .x_scales = xs.data(),
                             .y = want.data(),
                             .up = up.w.data(),
                             .up_scales = up.ws.data(),
                             .row_weights = weighted ? row_weights.data() : nullptr,
                             .limit = limit,
                             .gate = wg.data(),
                             .up_out = wu.data()};
        BOOST_REQUIRE(cpu::ExpertLinear(p) == OpStatus::kOk);
        BOOST_TEST(BitEqual(
            TwoOpsAndSwiglu(p, [](const ExpertLinearParams& q) { return cpu::ExpertLinear(q); }),
            want));
        const int64_t nans =
            std::count_if(want.begin(), want.end(), [](float v) { return std::isnan(v); });
        BOOST_TEST((format == WeightFormat::kFp8) == (nans > 0));
        Dev<float> dx(x), drw(row_weights);
        Dev<int64_t> dexpert(g.expert), doffset(g.offset), dtiles(g.tiles);
        Dev<const uint8_t*> dgate(gate.dw), dgate_s(gate.dws), dup(up.dw), dup_s(up.dws);
        Dev<uint8_t> dxq(xq), dxs(xs);
        Dev<float> dg(std::vector<float>(want.size())), du(std::vector<float>(want.size()));
        ExpertLinearParams d = p;
        d.x = dx.get();
        d.slot_expert = dexpert.get();
        d.slot_offset = doffset.get();
        d.slot_tiles = dtiles.get();
        d.w = dgate.get();
        d.w_scales = dgate_s.get();
        d.up = dup.get();
        d.up_scales = dup_s.get();
        d.row_weights = weighted ? drw.get() : nullptr;
        d.x_codes = dxq.get();
        d.x_scales = dxs.get();
        d.gate = dg.get();
        d.up_out = du.get();
        // slot_rows 0: the tile, apart; 1: the one-row GEMV, fused.
        for (const int64_t slot_rows : {int64_t{0}, int64_t{1}}) {
          Dev<float> dy(std::vector<float>(want.size(), -1.0f));
          d.y = dy.get();
          d.slot_rows = slot_rows;
          BOOST_REQUIRE(gpu::ExpertLinear(d) == OpStatus::kOk);
          const std::vector<float> got = dy.Host();
          int64_t wrong = 0;
          for (size_t i = 0; i < want.size(); ++i) {
            const bool nan = std::isnan(want[i]) && std::isnan(got[i]);
            wrong += !nan && codecs::Bits(got[i]) != codecs::Bits(want[i]);
          }
          BOOST_TEST(wrong == 0, "format " << static_cast<int>(format) << ", in " << in
                                           << ", weighted " << weighted << ", limit " << limit
                                           << ", slot_rows " << slot_rows);
        }
      }
    }
  }
  // The pair without its workspace, where the op makes the two apart: refused.
  const ExpertWeights w(rng, WeightFormat::kFp8, 1, 8, 32);
  std::vector<float> x(32), y(8);
  std::vector<uint8_t> xq(32), xs(1);
  const std::vector<int64_t> expert = {0}, offset = {0, 1}, tiles = {0, 1};
  BOOST_TEST((cpu::ExpertLinear({.x = x.data(),
                                 .rows = 1,
                                 .in = 32,
                                 .out = 8,
                                 .slot_expert = expert.data(),
                                 .slot_offset = offset.data(),
                                 .slot_tiles = tiles.data(),
                                 .slots = 1,
                                 .experts = 1,
                                 .format = WeightFormat::kFp8,
                                 .w = w.w.data(),
                                 .w_scales = w.ws.data(),
                                 .x_codes = xq.data(),
                                 .x_scales = xs.data(),
                                 .y = y.data(),
                                 .up = w.w.data(),
                                 .up_scales = w.ws.data()}) == OpStatus::kBadArgument));
}

// The rows of y (rows x width) quantized as a Linear quantizes its x: codes, then scales.
std::pair<std::vector<uint8_t>, std::vector<uint8_t>> RowCodes(const std::vector<float>& y,
                                                               int64_t rows, int64_t width) {
  std::vector<uint8_t> codes(rows * width), scales(rows * width / 32);
  for (int64_t r = 0; r < rows; ++r) {
    cpu::QuantizeFp8PerBlock(&y[r * width], width, 32, &codes[r * width], &scales[r * width / 32]);
  }
  return {codes, scales};
}

// Linear's gated pair (the shared expert's w1 and w3 under SwiGLU): the one-row GEMV's fused
// kernel and the apart path at more rows give the CPU's definition bit for bit. Its codes
// (y_codes: the SwiGLU's rows quantized as a Linear quantizes its x) are the CPU's: where the
// device's one-row GEMV is given counters it writes them in its own kernel (the last of the thread
// blocks writing each 32 columns to finish quantizes them), one launch where the op alone is one,
// the counters left zero; the column groups its thread blocks take (4 to 128 columns, FP8 and
// FP4, K of 1, 32, 42 and 73 blocks) fall on the 32-blocks in every way: several a thread block,
// and a 32-block's columns split among two to eight thread blocks, at offsets that move.
// Elsewhere (more rows, no counters) a quantization follows.
BOOST_AUTO_TEST_CASE(linear_gated_pair_is_two_linears_and_swiglu) {
  std::mt19937 rng(24);
  using Shape = std::tuple<WeightFormat, int64_t, int64_t>;
  std::vector<Shape> shapes = {{WeightFormat::kFp8, 96, 40},
                               {WeightFormat::kFp4, 96, 40},
                               {WeightFormat::kFp8, 2336, 44},
                               {WeightFormat::kFp4, 2336, 44}};
  for (const WeightFormat format : {WeightFormat::kFp8, WeightFormat::kFp4}) {
    for (const auto& [in, out] :
         {std::pair<int64_t, int64_t>{32, 96}, {1024, 64}, {1344, 96}, {2336, 64}}) {
      shapes.push_back({format, in, out});
    }
  }
  for (const auto& [format, in, out] : shapes) {
    const flashd::testing::QuantizedWeights gate =
        flashd::testing::QuantizeWeights(format, Normal(rng, out * in, 0.2f), out, in);
    const flashd::testing::QuantizedWeights up =
        flashd::testing::QuantizeWeights(format, Normal(rng, out * in, 0.2f), out, in);
    for (const int64_t rows : {int64_t{1}, int64_t{3}}) {
      const std::vector<float> x = Normal(rng, rows * in, 2.0f), rw = Normal(rng, rows);
      std::vector<uint8_t> xq(x.size()), xs(x.size() / 32);
      for (const float limit : {0.0f, 1.0f}) {
        std::vector<float> want(rows * out), g(want.size()), u(want.size());
        LinearParams p{.x = x.data(),
                       .rows = rows,
                       .in = in,
                       .out = out,
                       .format = format,
                       .w = gate.codes.data(),
                       .w_scales = gate.scales.data(),
                       .x_codes = xq.data(),
                       .x_scales = xs.data(),
                       .y = want.data(),
                       .up = up.codes.data(),
                       .up_scales = up.scales.data(),
                       .row_weights = rw.data(),
                       .limit = limit,
                       .gate = g.data(),
                       .up_out = u.data()};
        BOOST_REQUIRE(cpu::Linear(p) == OpStatus::kOk);
        BOOST_TEST(BitEqual(
            TwoOpsAndSwiglu(p, [](const LinearParams& q) { return cpu::Linear(q); }), want));
        Dev<float> dx(x), drw(rw), dy(std::vector<float>(want.size(), -1.0f));
        Dev<float> dg(std::vector<float>(want.size())), du(std::vector<float>(want.size()));
        Dev<uint8_t> dgw(gate.codes), dgs(gate.scales), duw(up.codes), dus(up.scales);
        Dev<uint8_t> dxq(xq), dxs(xs);
        LinearParams d = p;
        d.x = dx.get();
        d.w = dgw.get();
        d.w_scales = dgs.get();
        d.up = duw.get();
        d.up_scales = dus.get();
        d.row_weights = drw.get();
        d.x_codes = dxq.get();
        d.x_scales = dxs.get();
        d.y = dy.get();
        d.gate = dg.get();
        d.up_out = du.get();
        uint64_t at = gpu::KernelLaunches();
        BOOST_REQUIRE(gpu::Linear(d) == OpStatus::kOk);
        const uint64_t alone = gpu::KernelLaunches() - at;
        const std::string what = "format " + std::to_string(static_cast<int>(format)) + ", in " +
                                 std::to_string(in) + ", rows " + std::to_string(rows) +
                                 ", limit " + std::to_string(limit);
        BOOST_TEST(BitEqual(dy.Host(), want), what);
        if (out % 32 != 0) continue;
        // y's codes, on the CPU and on the device with and without counters (y cleared first).
        const auto [codes, scales] = RowCodes(want, rows, out);
        std::vector<uint8_t> wc(want.size(), 0xAA), ws(want.size() / 32, 0xAA);
        p.y_codes = wc.data(), p.y_code_scales = ws.data();
        BOOST_REQUIRE(cpu::Linear(p) == OpStatus::kOk);
        BOOST_TEST((wc == codes && ws == scales), "cpu codes, " << what);
        Dev<unsigned> arrivals(std::vector<unsigned>(rows * out / 32, 0u));
        for (const bool counters : {false, true}) {
          Dev<uint8_t> dc(std::vector<uint8_t>(want.size(), 0xAA));
          Dev<uint8_t> ds(std::vector<uint8_t>(want.size() / 32, 0xAA));
          BOOST_REQUIRE(gpu::ZeroOnDevice(dy.get(), want.size() * 4).empty());
          d.y_codes = dc.get(), d.y_code_scales = ds.get();
          at = gpu::KernelLaunches();
          BOOST_REQUIRE(gpu::Linear(d, counters ? arrivals.get() : nullptr) == OpStatus::kOk);
          BOOST_TEST(gpu::KernelLaunches() - at == alone + (counters && rows == 1 ? 0 : 1));
          BOOST_TEST((BitEqual(dy.Host(), want) && dc.Host() == codes && ds.Host() == scales),
                     "device codes, counters " << counters << ", " << what);
        }
        d.y_codes = d.y_code_scales = nullptr;
        const std::vector<unsigned> left = arrivals.Host();
        BOOST_TEST(std::all_of(left.begin(), left.end(), [](unsigned c) { return c == 0; }));
      }
    }
  }
  // Only quantized weights come as a gated pair.
  std::vector<float> dense(8 * 32), x(32), y(8);
  const uint8_t codes[1] = {};
  BOOST_TEST((cpu::Linear({.x = x.data(),
                           .rows = 1,
                           .in = 32,
                           .out = 8,
                           .dense = dense.data(),
                           .y = y.data(),
                           .up = codes,
                           .up_scales = codes}) == OpStatus::kBadArgument));
}

// The experts' gated pair's codes (ExpertLinearParams::y_codes) are the CPU's: the device's GEMV
// (a step of up to 8 tokens) given counters writes them in its kernel as Linear's does (the
// launches counted, the counters left zero, y cleared first), the tile quantizes after; FP8 and
// FP4, K of 2 and 42 blocks. An ExpertLinear given them (x_quantized) then gives the op's values
// on its own x, with one launch fewer; on the CPU too.
BOOST_AUTO_TEST_CASE(expert_gated_pair_codes_are_its_swiglu_quantized) {
  std::mt19937 rng(53);
  // A step of 7 tokens (a row at a time through the GEMV, slot_rows 7) and the tile (slot_rows
  // 0), then w2 over the SwiGLU's rows given their codes.
  const int64_t tokens = 7, experts = 6, k = 3, total = tokens * k;
  const Grouped g = GroupedChoices(rng, tokens, experts, k);
  for (const WeightFormat format : {WeightFormat::kFp8, WeightFormat::kFp4}) {
    for (const auto& [in, inter] : {std::pair<int64_t, int64_t>{64, 96}, {1344, 64}}) {
      const ExpertWeights w1(rng, format, experts, inter, in), w3(rng, format, experts, inter, in);
      const ExpertWeights w2(rng, format, experts, 48, inter);
      const std::vector<float> x = Normal(rng, total * in, 2.0f), rw = Normal(rng, total);
      std::vector<uint8_t> xq(x.size()), xs(x.size() / 32);
      std::vector<float> h(total * inter), hg(h.size()), hu(h.size());
      std::vector<uint8_t> hc(h.size(), 0xAA), hs(h.size() / 32, 0xAA);
      ExpertLinearParams p = ExpertParams(g, w1, format, in, inter, x, &xq, &xs);
      p.y = h.data(), p.up = w3.w.data(), p.up_scales = w3.ws.data(), p.row_weights = rw.data();
      p.limit = 1.0f, p.gate = hg.data(), p.up_out = hu.data();
      p.y_codes = hc.data(), p.y_code_scales = hs.data();
      BOOST_REQUIRE(cpu::ExpertLinear(p) == OpStatus::kOk);
      const auto [codes, scales] = RowCodes(h, total, inter);
      BOOST_TEST((hc == codes && hs == scales), "experts on the cpu, in " << in);
      // w2 over h: quantizing h, and reading the gated op's codes.
      std::vector<uint8_t> hq(h.size()), hqs(h.size() / 32);
      std::vector<float> want(total * 48), got(want.size());
      ExpertLinearParams p2 = ExpertParams(g, w2, format, inter, 48, h, &hq, &hqs);
      p2.y = want.data();
      BOOST_REQUIRE(cpu::ExpertLinear(p2) == OpStatus::kOk);
      ExpertLinearParams given = p2;
      given.x_codes = hc.data(), given.x_scales = hs.data(), given.x_quantized = true;
      given.y = got.data();
      BOOST_REQUIRE(cpu::ExpertLinear(given) == OpStatus::kOk);
      BOOST_TEST(BitEqual(got, want), "w2 given its codes on the cpu, in " << in);
      DeviceExpertInputs dev(p, g, w1);
      Dev<const uint8_t*> dup(w3.dw), dup_s(w3.dws);
      Dev<float> drw(rw), dh(std::vector<float>(h.size(), -1.0f));
      Dev<float> dg(std::vector<float>(h.size())), du(std::vector<float>(h.size()));
      Dev<unsigned> arrivals(std::vector<unsigned>(total * inter / 32, 0u));
      ExpertLinearParams d = dev.On(p, dh.get());
      d.up = dup.get(), d.up_scales = dup_s.get(), d.row_weights = drw.get();
      d.gate = dg.get(), d.up_out = du.get();
      DeviceExpertInputs dev2(p2, g, w2);
      for (const int64_t slot_rows : {int64_t{0}, tokens}) {
        BOOST_TEST_CONTEXT("experts, format " << static_cast<int>(format) << ", in " << in
                                              << ", slot_rows " << slot_rows) {
          d.slot_rows = slot_rows;
          d.y_codes = d.y_code_scales = nullptr;
          uint64_t at = gpu::KernelLaunches();
          BOOST_REQUIRE(gpu::ExpertLinear(d) == OpStatus::kOk);
          const uint64_t alone = gpu::KernelLaunches() - at;
          Dev<uint8_t> dc(std::vector<uint8_t>(h.size(), 0xAA));
          Dev<uint8_t> ds(std::vector<uint8_t>(h.size() / 32, 0xAA));
          BOOST_REQUIRE(gpu::ZeroOnDevice(dh.get(), h.size() * 4).empty());
          d.y_codes = dc.get(), d.y_code_scales = ds.get();
          at = gpu::KernelLaunches();
          BOOST_REQUIRE(gpu::ExpertLinear(d, arrivals.get()) == OpStatus::kOk);
          BOOST_TEST(gpu::KernelLaunches() - at == alone + (slot_rows > 0 ? 0 : 1));
          BOOST_TEST((BitEqual(dh.Host(), h) && dc.Host() == codes && ds.Host() == scales));
          const std::vector<unsigned> left = arrivals.Host();
          BOOST_TEST(std::all_of(left.begin(), left.end(), [](unsigned c) { return c == 0; }));
          // w2: quantizing h on the device, then reading the gated op's codes.
          Dev<float> dy(std::vector<float>(want.size(), -1.0f));
          ExpertLinearParams e = dev2.On(p2, dy.get());
          e.x = dh.get();
          e.slot_rows = slot_rows;
          at = gpu::KernelLaunches();
          BOOST_REQUIRE(gpu::ExpertLinear(e) == OpStatus::kOk);
          const uint64_t quantizing = gpu::KernelLaunches() - at;
          BOOST_TEST(BitEqual(dy.Host(), want), "w2");
          Dev<float> dy2(std::vector<float>(want.size(), -1.0f));
          e.y = dy2.get();
          e.x_codes = dc.get(), e.x_scales = ds.get(), e.x_quantized = true;
          at = gpu::KernelLaunches();
          BOOST_REQUIRE(gpu::ExpertLinear(e) == OpStatus::kOk);
          BOOST_TEST(gpu::KernelLaunches() - at == quantizing - 1);
          BOOST_TEST(BitEqual(dy2.Host(), want), "w2 given its codes");
        }
      }
    }
  }
  // Codes without scales, or of rows not in 32-blocks; given codes with x_rows or without them.
  std::vector<float> v(4096);
  std::vector<uint8_t> b(4096);
  const std::vector<int64_t> expert = {0}, offset = {0, 1}, tiles = {0, 1}, x_rows = {0};
  const uint8_t* table[1] = {b.data()};
  const ExpertLinearParams ok{.x = v.data(),
                              .rows = 1,
                              .in = 64,
                              .out = 32,
                              .slot_expert = expert.data(),
                              .slot_offset = offset.data(),
                              .slot_tiles = tiles.data(),
                              .slots = 1,
                              .experts = 1,
                              .format = WeightFormat::kFp8,
                              .w = table,
                              .w_scales = table,
                              .x_codes = b.data(),
                              .x_scales = b.data(),
                              .y = v.data(),
                              .y_codes = b.data(),
                              .y_code_scales = b.data()};
  ExpertLinearParams no_scales = ok, odd = ok, rows_given = ok, none_given = ok;
  no_scales.y_code_scales = nullptr;
  odd.out = 40;
  rows_given.x_quantized = true, rows_given.x_rows = x_rows.data(), rows_given.x_count = 1;
  none_given.x_quantized = true, none_given.x_codes = nullptr;
  for (const auto& [q, want] : {std::pair{no_scales, OpStatus::kBadArgument},
                                {odd, OpStatus::kBadShape},
                                {rows_given, OpStatus::kBadArgument},
                                {none_given, OpStatus::kBadArgument}}) {
    BOOST_TEST((cpu::ExpertLinear(q) == want));
    BOOST_TEST((gpu::ExpertLinear(q) == want));
    BOOST_TEST((gpu::ExpertLinearMatrix(q) == want));
  }
}

// A Linear's rope (LinearParams::rope_dim) is the op and then a Rope op over its y, on the CPU and
// on the device: the one-row GEMV rotates as it writes y (one launch where the op alone is one,
// also with `also`, whose projection is not rotated), the other paths rotate after (a launch
// more); FP8, FP4 and dense weights, rounded or not, 1 and 3 rows, heads of 64 values with 16
// rotated and of 32 with all rotated, K of 1 and 42 blocks (a thread block's columns crossing a
// head's end); the matrix GEMMs too. Shapes that do not take it refused alike.
BOOST_AUTO_TEST_CASE(linear_rope_is_the_op_then_a_rope) {
  std::mt19937 rng(59);
  for (const WeightFormat format : {WeightFormat::kFp8, WeightFormat::kFp4, WeightFormat::kDense}) {
    for (const auto& [in, out, hd, rd] :
         {std::tuple<int64_t, int64_t, int64_t, int64_t>{32, 128, 64, 16}, {1344, 96, 32, 32}}) {
      std::vector<float> freqs(rd / 2);
      cpu::RopeFrequencies(rd, 65536, 160000.0, 16, 32, 1, freqs.data());
      const std::vector<float> w = Normal(rng, out * in, 0.2f), w2 = Normal(rng, 32 * in, 0.2f);
      const flashd::testing::QuantizedWeights qw =
          format == WeightFormat::kDense ? flashd::testing::QuantizedWeights{}
                                         : flashd::testing::QuantizeWeights(format, w, out, in);
      const flashd::testing::QuantizedWeights qw2 =
          format == WeightFormat::kDense ? flashd::testing::QuantizedWeights{}
                                         : flashd::testing::QuantizeWeights(format, w2, 32, in);
      for (const int64_t rows : {int64_t{1}, int64_t{3}}) {
        for (const bool round : {false, true}) {
          for (const bool with_also : {false, true}) {
            BOOST_TEST_CONTEXT("format " << static_cast<int>(format) << ", in " << in << ", head "
                                         << hd << ", rows " << rows << ", round " << round
                                         << ", also " << with_also) {
              const std::vector<float> x = Normal(rng, rows * in, 2.0f);
              std::vector<int64_t> pos(rows);
              for (int64_t r = 0; r < rows; ++r) pos[r] = 1000 + 77 * r;
              std::vector<uint8_t> xq(x.size()), xs(x.size() / 32);
              std::vector<float> want(rows * out), want2(rows * 32);
              const auto params = [&](const float* px, const uint8_t* pw, const uint8_t* pws,
                                      const float* pd, uint8_t* pxq, uint8_t* pxs, float* y) {
                return LinearParams{.x = px,
                                    .rows = rows,
                                    .in = in,
                                    .out = out,
                                    .format = format,
                                    .w = pw,
                                    .w_scales = pws,
                                    .dense = pd,
                                    .x_codes = pxq,
                                    .x_scales = pxs,
                                    .y = y,
                                    .round_output = round};
              };
              // The definition: the op, then a Rope op.
              LinearParams p = params(x.data(), qw.codes.data(), qw.scales.data(), w.data(),
                                      xq.data(), xs.data(), want.data());
              BOOST_REQUIRE(cpu::Linear(p) == OpStatus::kOk);
              BOOST_REQUIRE(cpu::Rope({.x = want.data(),
                                       .rows = rows,
                                       .heads = out / hd,
                                       .head_dim = hd,
                                       .rope_dim = rd,
                                       .row_stride = out,
                                       .positions = pos.data(),
                                       .freqs = freqs.data()}) == OpStatus::kOk);
              LinearParams p2 = params(x.data(), qw2.codes.data(), qw2.scales.data(), w2.data(),
                                       xq.data(), xs.data(), want2.data());
              p2.out = 32;
              BOOST_REQUIRE(cpu::Linear(p2) == OpStatus::kOk);
              // The CPU's op with its rope.
              std::vector<float> got(want.size(), -1.0f), got2(want2.size(), -1.0f);
              const LinearProjection more{.w = qw2.codes.data(),
                                          .w_scales = qw2.scales.data(),
                                          .dense = w2.data(),
                                          .out = 32,
                                          .y = got2.data()};
              p.y = got.data();
              p.rope_dim = rd, p.rope_head_dim = hd, p.rope_positions = pos.data();
              p.rope_freqs = freqs.data();
              if (with_also) p.also = &more, p.also_count = 1;
              BOOST_REQUIRE(cpu::Linear(p) == OpStatus::kOk);
              BOOST_TEST(BitEqual(got, want), "cpu");
              if (with_also) BOOST_TEST(BitEqual(got2, want2), "cpu, also");
              // The device's, against the op alone (its launches) and the definition.
              Dev<float> dx(x), dw(w), dw2(w2), dfreqs(freqs);
              Dev<uint8_t> dq(qw.codes), ds(qw.scales), dq2(qw2.codes), ds2(qw2.scales);
              Dev<uint8_t> dxq(xq), dxs(xs);
              Dev<int64_t> dpos(pos);
              Dev<float> dy(std::vector<float>(want.size(), -1.0f));
              Dev<float> dy2(std::vector<float>(want2.size(), -1.0f));
              const LinearProjection dmore{.w = dq2.get(),
                                           .w_scales = ds2.get(),
                                           .dense = dw2.get(),
                                           .out = 32,
                                           .y = dy2.get()};
              LinearParams d =
                  params(dx.get(), dq.get(), ds.get(), dw.get(), dxq.get(), dxs.get(), dy.get());
              if (with_also) d.also = &dmore, d.also_count = 1;
              uint64_t at = gpu::KernelLaunches();
              BOOST_REQUIRE(gpu::Linear(d) == OpStatus::kOk);
              const uint64_t alone = gpu::KernelLaunches() - at;
              d.rope_dim = rd, d.rope_head_dim = hd, d.rope_positions = dpos.get();
              d.rope_freqs = dfreqs.get();
              at = gpu::KernelLaunches();
              BOOST_REQUIRE(gpu::Linear(d) == OpStatus::kOk);
              const bool gemv = rows == 1 && format != WeightFormat::kDense;
              BOOST_TEST(gpu::KernelLaunches() - at == alone + (gemv ? 0 : 1));
              BOOST_TEST(BitEqual(dy.Host(), want), "device");
              if (with_also) BOOST_TEST(BitEqual(dy2.Host(), want2), "device, also");
              if (with_also || format == WeightFormat::kDense) continue;
              // The matrix GEMMs: their op, then the rotation.
              for (const gpu::MatrixInstruction ins :
                   {gpu::MatrixInstruction::kMma, gpu::MatrixInstruction::kMfma}) {
                if (ins == gpu::MatrixInstruction::kMfma && kBackend == "cuda") continue;
                LinearParams m = d;
                m.rope_dim = 0;
                BOOST_REQUIRE(gpu::LinearMatrix(m, ins) == OpStatus::kOk);
                std::vector<float> mwant = dy.Host();
                BOOST_REQUIRE(cpu::Rope({.x = mwant.data(),
                                         .rows = rows,
                                         .heads = out / hd,
                                         .head_dim = hd,
                                         .rope_dim = rd,
                                         .row_stride = out,
                                         .positions = pos.data(),
                                         .freqs = freqs.data()}) == OpStatus::kOk);
                BOOST_REQUIRE(gpu::LinearMatrix(d, ins) == OpStatus::kOk);
                BOOST_TEST(BitEqual(dy.Host(), mwant), "matrix " << static_cast<int>(ins));
              }
            }
          }
        }
      }
    }
  }
  // An odd head, outputs not in whole heads, no positions, and with the gated pair, y's codes or
  // groups.
  std::vector<float> v(4096);
  std::vector<uint8_t> b(4096);
  const int64_t pos[1] = {3};
  const LinearParams ok{.x = v.data(),
                        .rows = 1,
                        .in = 64,
                        .out = 64,
                        .format = WeightFormat::kFp8,
                        .w = b.data(),
                        .w_scales = b.data(),
                        .x_codes = b.data(),
                        .x_scales = b.data(),
                        .y = v.data(),
                        .rope_dim = 16,
                        .rope_head_dim = 32,
                        .rope_positions = pos,
                        .rope_freqs = v.data()};
  LinearParams odd = ok, partial = ok, unplaced = ok, gated = ok, coded = ok, grouped = ok;
  odd.rope_head_dim = 33;
  partial.out = 48;
  unplaced.rope_positions = nullptr;
  gated.up = b.data(), gated.up_scales = b.data(), gated.gate = v.data(), gated.up_out = v.data();
  coded.y_codes = b.data(), coded.y_code_scales = b.data();
  grouped.format = WeightFormat::kFp8Dense, grouped.groups = 2;
  for (const auto& [q, want] : {std::pair{odd, OpStatus::kBadShape},
                                {partial, OpStatus::kBadShape},
                                {unplaced, OpStatus::kBadShape},
                                {gated, OpStatus::kBadArgument},
                                {coded, OpStatus::kBadArgument},
                                {grouped, OpStatus::kBadArgument}}) {
    BOOST_TEST((cpu::Linear(q) == want));
    BOOST_TEST((gpu::Linear(q) == want));
  }
}

// v's values rounded to BF16.
std::vector<float> RoundedBf16(std::vector<float> v) {
  for (float& x : v) x = codecs::RoundBf16(x);
  return v;
}

// For each matrix instruction the backend has: op(p, instruction) without round_output, then
// with it; the second's y (`y`, on the device) is the first's rounded.
template <class P, class Op>
void MatrixRoundsAsItWrites(P p, const Dev<float>& y, Op op) {
  for (const gpu::MatrixInstruction ins :
       {gpu::MatrixInstruction::kMma, gpu::MatrixInstruction::kMfma}) {
    if (ins == gpu::MatrixInstruction::kMfma && kBackend == "cuda") continue;
    p.round_output = false;
    BOOST_REQUIRE(op(p, ins) == OpStatus::kOk);
    const std::vector<float> raw = y.Host();
    p.round_output = true;
    BOOST_REQUIRE(op(p, ins) == OpStatus::kOk);
    BOOST_TEST(BitEqual(y.Host(), RoundedBf16(raw)),
               "matrix instruction " << static_cast<int>(ins));
  }
}

// y rounded to BF16 as the op writes it (round_output) is the op's y and then a RoundBf16 op, on
// the CPU and on the device, for every path of Linear, LinearMatrix, ExpertLinear and
// ExpertLinearMatrix: the kernels that round as they write (the one-row GEMV and its experts',
// FP8 values at few rows, the quantized matrix GEMMs and wo_a's) and the ones followed by a
// rounding pass (the tiles, dense weights, the experts' matrix GEMMs). The exact paths' rounded
// values are the CPU's too. Not with the gated pair.
// A Linear op with more projections of its x (`also`) gives each projection's op alone, bit for
// bit: on the CPU (x quantized once, the others read its codes) and on the device, where one row
// of FP8 or FP4 weights is one quantization and one GEMV launch for all (counted) and more rows an
// op a projection; outputs of several widths (a GEMV's tail columns), rounded or not; dense and
// BF16 weights; what does not take them refused alike.
// RmsNorm's codes are each normed row quantized as a Linear quantizes its x, and a Linear given
// them (x_quantized) reads them instead of quantizing: its values are those of the Linear of the
// rows, with one launch fewer on the device; given another row's codes, it gives that row's.
BOOST_AUTO_TEST_CASE(rms_norm_codes_feed_a_linear_that_quantizes_nothing) {
  std::mt19937 rng(41);
  const int64_t out = 70;
  for (const int64_t dim : {int64_t{96}, int64_t{1024}}) {
    for (const int64_t rows : {int64_t{1}, int64_t{3}, int64_t{33}}) {
      BOOST_TEST_CONTEXT("dim " << dim << " rows " << rows) {
        const int64_t stride = dim + 32;
        const std::vector<float> x = Normal(rng, rows * stride, 3.0f), w = Normal(rng, dim);
        Dev<float> dw(w);
        // The norm alone, then its rows quantized (QuantizeFp8PerBlock, as cpu::Linear does).
        std::vector<float> normed = x;
        RmsNormParams p{.x = normed.data(),
                        .rows = rows,
                        .dim = dim,
                        .stride = stride,
                        .weight = w.data(),
                        .eps = 1e-6f,
                        .round_input = true};
        BOOST_REQUIRE(cpu::RmsNorm(p) == OpStatus::kOk);
        std::vector<uint8_t> codes(rows * dim), scales(rows * dim / 32);
        for (int64_t r = 0; r < rows; ++r) {
          cpu::QuantizeFp8PerBlock(&normed[r * stride], dim, 32, &codes[r * dim],
                                   &scales[r * dim / 32]);
        }
        // With codes: the same rows, and the codes, on the CPU and the device.
        std::vector<float> cx = x;
        std::vector<uint8_t> cc(codes.size(), 0xAA), cs(scales.size(), 0xAA);
        p.x = cx.data();
        p.codes = cc.data();
        p.code_scales = cs.data();
        BOOST_REQUIRE(cpu::RmsNorm(p) == OpStatus::kOk);
        BOOST_TEST(BitEqual(cx, normed));
        BOOST_TEST((cc == codes && cs == scales));
        Dev<float> dx(x);
        Dev<uint8_t> dc(std::vector<uint8_t>(codes.size(), 0xAA));
        Dev<uint8_t> ds(std::vector<uint8_t>(scales.size(), 0xAA));
        RmsNormParams d = p;
        d.x = dx.get(), d.weight = dw.get(), d.codes = dc.get(), d.code_scales = ds.get();
        BOOST_REQUIRE(gpu::RmsNorm(d) == OpStatus::kOk);
        BOOST_TEST(BitEqual(dx.Host(), normed));
        BOOST_TEST((dc.Host() == codes && ds.Host() == scales));
        // A Linear of the normed rows (packed), from them or from their codes.
        std::vector<float> packed(rows * dim), doubled(rows * dim);
        for (int64_t r = 0; r < rows; ++r) {
          std::copy_n(&normed[r * stride], dim, &packed[r * dim]);
        }
        for (size_t i = 0; i < packed.size(); ++i) doubled[i] = 2.0f * packed[i];
        std::vector<uint8_t> other(codes.size()), other_scales(scales.size());
        for (int64_t r = 0; r < rows; ++r) {
          cpu::QuantizeFp8PerBlock(&doubled[r * dim], dim, 32, &other[r * dim],
                                   &other_scales[r * dim / 32]);
        }
        for (const WeightFormat format : {WeightFormat::kFp8, WeightFormat::kFp4}) {
          for (const bool round : {false, true}) {
            BOOST_TEST_CONTEXT("format " << static_cast<int>(format) << " round " << round) {
              const flashd::testing::QuantizedWeights q =
                  flashd::testing::QuantizeWeights(format, Normal(rng, out * dim, 0.2f), out, dim);
              std::vector<uint8_t> xq(codes.size()), xs(scales.size());
              auto linear = [&](const float* px, uint8_t* pxq, uint8_t* pxs, float* y) {
                return LinearParams{.x = px,
                                    .rows = rows,
                                    .in = dim,
                                    .out = out,
                                    .format = format,
                                    .w = q.codes.data(),
                                    .w_scales = q.scales.data(),
                                    .x_codes = pxq,
                                    .x_scales = pxs,
                                    .y = y,
                                    .round_output = round};
              };
              std::vector<float> want(rows * out), want2(rows * out);
              BOOST_REQUIRE(cpu::Linear(linear(packed.data(), xq.data(), xs.data(), want.data())) ==
                            OpStatus::kOk);
              BOOST_REQUIRE(cpu::Linear(linear(doubled.data(), xq.data(), xs.data(),
                                               want2.data())) == OpStatus::kOk);
              // The CPU given the codes, and given the doubled rows' codes.
              for (const auto& [given, given_scales, expect] :
                   {std::tuple{&codes, &scales, &want}, {&other, &other_scales, &want2}}) {
                std::vector<uint8_t> gc = *given, gs = *given_scales;
                std::vector<float> y(rows * out);
                LinearParams l = linear(packed.data(), gc.data(), gs.data(), y.data());
                l.x_quantized = true;
                BOOST_REQUIRE(cpu::Linear(l) == OpStatus::kOk);
                BOOST_TEST(BitEqual(y, *expect));
                BOOST_TEST((gc == *given && gs == *given_scales));  // Read, not written.
                // The device: one launch fewer than quantizing x itself.
                Dev<float> dp(packed), dy(std::vector<float>(rows * out));
                Dev<uint8_t> dwc(q.codes), dws(q.scales), dgc(*given), dgs(*given_scales);
                l = linear(dp.get(), dgc.get(), dgs.get(), dy.get());
                l.w = dwc.get(), l.w_scales = dws.get(), l.x_quantized = true;
                const uint64_t before = gpu::KernelLaunches();
                BOOST_REQUIRE(gpu::Linear(l) == OpStatus::kOk);
                const uint64_t quantized_launches = gpu::KernelLaunches() - before;
                BOOST_TEST(BitEqual(dy.Host(), *expect));
                BOOST_TEST((dgc.Host() == *given && dgs.Host() == *given_scales));
                // Quantizing x itself, into workspace.
                Dev<uint8_t> wq(std::vector<uint8_t>(codes.size()));
                Dev<uint8_t> wsc(std::vector<uint8_t>(scales.size()));
                l.x_codes = wq.get(), l.x_scales = wsc.get(), l.x_quantized = false;
                const uint64_t again = gpu::KernelLaunches();
                BOOST_REQUIRE(gpu::Linear(l) == OpStatus::kOk);
                BOOST_TEST(gpu::KernelLaunches() - again == quantized_launches + 1);
                BOOST_TEST(BitEqual(dy.Host(), want));
              }
            }
          }
        }
      }
    }
  }
  std::vector<float> x(64), w(64);
  std::vector<uint8_t> codes(64);
  // Codes without scales, or of rows not in whole 32-blocks: refused alike.
  const RmsNormParams bad[] = {{.x = x.data(),
                                .rows = 1,
                                .dim = 64,
                                .stride = 64,
                                .weight = w.data(),
                                .codes = codes.data()},
                               {.x = x.data(),
                                .rows = 1,
                                .dim = 40,
                                .stride = 40,
                                .weight = w.data(),
                                .codes = codes.data(),
                                .code_scales = codes.data()}};
  for (const RmsNormParams& p : bad) {
    BOOST_TEST((cpu::RmsNorm(p) == OpStatus::kBadShape));
    BOOST_TEST((gpu::RmsNorm(p) == OpStatus::kBadShape));
  }
}

BOOST_AUTO_TEST_CASE(linear_also_is_an_op_a_projection) {
  std::mt19937 rng(37);
  const int64_t in = 160;
  const std::vector<int64_t> outs = {70, 32, 150, 9};  // The op's, then its projections'.
  for (const WeightFormat format :
       {WeightFormat::kFp8, WeightFormat::kFp4, WeightFormat::kDense, WeightFormat::kBf16}) {
    // Each projection's weights in the format.
    std::vector<std::vector<float>> w;
    std::vector<flashd::testing::QuantizedWeights> qw;
    for (const int64_t out : outs) {
      w.push_back(Normal(rng, out * in, 0.2f));
      flashd::testing::QuantizedWeights q;
      if (format == WeightFormat::kBf16) {
        q.codes.clear();
        for (float v : w.back()) {
          const uint16_t code = codecs::FloatToBf16(v);
          q.codes.push_back(static_cast<uint8_t>(code));
          q.codes.push_back(static_cast<uint8_t>(code >> 8));
        }
        q.scales.assign(1, 0);
      } else if (format == WeightFormat::kDense) {
        q.codes.assign(1, 0), q.scales.assign(1, 0);
      } else {
        q = flashd::testing::QuantizeWeights(format, w.back(), out, in);
      }
      qw.push_back(std::move(q));
    }
    for (const int64_t rows : {int64_t{1}, int64_t{3}}) {
      for (const int64_t more : {int64_t{0}, int64_t{1}, int64_t{3}}) {
        for (const bool round : {false, true}) {
          BOOST_TEST_CONTEXT("format " << static_cast<int>(format) << " rows " << rows << " also "
                                       << more << " round " << round) {
            const std::vector<float> x = Normal(rng, rows * in);
            std::vector<uint8_t> xq(x.size()), xs(x.size() / 32);
            // The ops alone, on the CPU.
            const auto alone = [&](size_t j, const float* px, const uint8_t* pw, const uint8_t* pws,
                                   const float* dense, uint8_t* pxq, uint8_t* pxs, float* y) {
              return LinearParams{.x = px,
                                  .rows = rows,
                                  .in = in,
                                  .out = outs[j],
                                  .format = format,
                                  .w = pw,
                                  .w_scales = pws,
                                  .dense = dense,
                                  .x_codes = pxq,
                                  .x_scales = pxs,
                                  .y = y,
                                  .round_output = round};
            };
            std::vector<std::vector<float>> want;
            for (size_t j = 0; j <= static_cast<size_t>(more); ++j) {
              want.emplace_back(rows * outs[j]);
              BOOST_REQUIRE(cpu::Linear(alone(j, x.data(), qw[j].codes.data(), qw[j].scales.data(),
                                              w[j].data(), xq.data(), xs.data(), want[j].data())) ==
                            OpStatus::kOk);
            }
            // One op on the CPU.
            std::vector<std::vector<float>> got(want.size());
            std::vector<LinearProjection> also;
            for (size_t j = 0; j < want.size(); ++j) {
              got[j].assign(want[j].size(), 7.0f);
              if (j == 0) continue;
              also.push_back({.w = qw[j].codes.data(),
                              .w_scales = qw[j].scales.data(),
                              .dense = w[j].data(),
                              .out = outs[j],
                              .y = got[j].data()});
            }
            LinearParams one = alone(0, x.data(), qw[0].codes.data(), qw[0].scales.data(),
                                     w[0].data(), xq.data(), xs.data(), got[0].data());
            one.also = also.data();
            one.also_count = more;
            BOOST_REQUIRE(cpu::Linear(one) == OpStatus::kOk);
            for (size_t j = 0; j < want.size(); ++j) {
              BOOST_TEST(BitEqual(got[j], want[j]), "cpu, projection " << j);
            }
            // One op on the device.
            Dev<float> dx(x);
            // The codes start as zeros: each projection reads what this op wrote.
            Dev<uint8_t> dxq(std::vector<uint8_t>(xq.size())), dxs(std::vector<uint8_t>(xs.size()));
            std::vector<std::unique_ptr<Dev<float>>> dw, dy;
            std::vector<std::unique_ptr<Dev<uint8_t>>> dq, ds;
            std::vector<LinearProjection> dalso;
            for (size_t j = 0; j < want.size(); ++j) {
              dw.push_back(std::make_unique<Dev<float>>(w[j]));
              dq.push_back(std::make_unique<Dev<uint8_t>>(qw[j].codes));
              ds.push_back(std::make_unique<Dev<uint8_t>>(qw[j].scales));
              dy.push_back(std::make_unique<Dev<float>>(std::vector<float>(want[j].size(), 7.0f)));
              if (j == 0) continue;
              dalso.push_back({.w = dq[j]->get(),
                               .w_scales = ds[j]->get(),
                               .dense = dw[j]->get(),
                               .out = outs[j],
                               .y = dy[j]->get()});
            }
            LinearParams d = alone(0, dx.get(), dq[0]->get(), ds[0]->get(), dw[0]->get(), dxq.get(),
                                   dxs.get(), dy[0]->get());
            d.also = dalso.data();
            d.also_count = more;
            const uint64_t launches = gpu::KernelLaunches();
            BOOST_REQUIRE(gpu::Linear(d) == OpStatus::kOk);
            const bool quantized = format == WeightFormat::kFp8 || format == WeightFormat::kFp4;
            // One quantization, then one GEMV at one row; more rows a tile (and a rounding
            // pass) a projection. Dense weights: one GEMV at one row unrounded, else an op (and
            // a rounding pass) a projection.
            const uint64_t ops = (1 + more) * (round ? 2 : 1);
            const uint64_t launched = gpu::KernelLaunches() - launches;
            if (quantized) BOOST_TEST(launched == 1 + (rows == 1 ? 1 : ops));
            if (!quantized) BOOST_TEST(launched == (rows == 1 && !round ? 1 : ops));
            for (size_t j = 0; j < want.size(); ++j) {
              BOOST_TEST(BitEqual(dy[j]->Host(), want[j]), "device, projection " << j);
            }
          }
        }
      }
    }
  }
  // What does not take them: too many, FP8 values, the gated pair, a projection without
  // outputs or weights.
  std::vector<float> x(64), y(64);
  std::vector<uint8_t> codes(64 * 64), scales(64);
  LinearProjection ok{.w = codes.data(), .w_scales = scales.data(), .out = 2, .y = y.data()};
  const LinearProjection four[4] = {ok, ok, ok, ok};
  LinearProjection none = ok, blind = ok;
  none.out = 0;
  blind.w_scales = nullptr;
  const LinearParams base{.x = x.data(),
                          .rows = 1,
                          .in = 64,
                          .out = 2,
                          .format = WeightFormat::kFp8,
                          .w = codes.data(),
                          .w_scales = scales.data(),
                          .x_codes = codes.data(),
                          .x_scales = scales.data(),
                          .y = y.data()};
  struct Bad {
    LinearParams p;
    OpStatus want;
  };
  std::vector<Bad> bad;
  bad.push_back({base, OpStatus::kBadArgument});
  bad.back().p.also = four, bad.back().p.also_count = 4;
  bad.push_back({base, OpStatus::kBadArgument});
  bad.back().p.also = &ok, bad.back().p.also_count = 1,
  bad.back().p.format = WeightFormat::kFp8Dense;
  bad.push_back({base, OpStatus::kBadArgument});
  bad.back().p.also = &ok, bad.back().p.also_count = 1, bad.back().p.up = codes.data();
  bad.back().p.up_scales = scales.data();
  bad.push_back({base, OpStatus::kBadShape});
  bad.back().p.also = &none, bad.back().p.also_count = 1;
  bad.push_back({base, OpStatus::kBadArgument});
  bad.back().p.also = &blind, bad.back().p.also_count = 1;
  for (const Bad& b : bad) {
    BOOST_TEST((cpu::Linear(b.p) == b.want));
    BOOST_TEST((gpu::Linear(b.p) == b.want));
  }
}

// A Linear's y_codes are its rows as it leaves them (rounded or not) quantized as a Linear
// quantizes its x: on the CPU and the device, FP8 values in groups at 1, 3 and 70 rows (the row
// kernel writes them as it writes y, no launch more; the tile, one more) and FP8 weights (one
// more), and on matrix cores; the shapes and arguments that do not take them refused alike.
BOOST_AUTO_TEST_CASE(linear_y_codes_are_its_rows_quantized) {
  std::mt19937 rng(47);
  struct Case {
    WeightFormat format;
    int64_t rows, in, out, groups;
    bool in_kernel;  // The device writes the codes in the op's own kernel.
  };
  const Case cases[] = {{WeightFormat::kFp8Dense, 1, 128, 64, 2, true},
                        {WeightFormat::kFp8Dense, 3, 128, 32, 2, true},
                        {WeightFormat::kFp8Dense, 70, 128, 64, 2, false},
                        {WeightFormat::kFp8, 1, 160, 64, 1, false},
                        {WeightFormat::kFp8, 3, 160, 96, 1, false}};
  for (const Case& c : cases) {
    for (const bool round : {false, true}) {
      BOOST_TEST_CONTEXT("format " << static_cast<int>(c.format) << " rows " << c.rows << " round "
                                   << round) {
        const int64_t wrows = c.groups * c.out, width = c.groups * c.out, n = c.rows * width;
        const std::vector<float> x = Normal(rng, c.rows * c.groups * c.in),
                                 w = Normal(rng, wrows * c.in, 0.2f);
        const flashd::testing::QuantizedWeights qw =
            flashd::testing::QuantizeWeights(WeightFormat::kFp8, w, wrows, c.in);
        std::vector<uint8_t> xq(x.size()), xs(x.size() / 32 + 1);
        const auto params = [&](const float* px, const uint8_t* pw, const uint8_t* pws,
                                uint8_t* pxq, uint8_t* pxs, float* y) {
          return LinearParams{.x = px,
                              .rows = c.rows,
                              .in = c.in,
                              .out = c.out,
                              .format = c.format,
                              .w = pw,
                              .w_scales = pws,
                              .x_codes = pxq,
                              .x_scales = pxs,
                              .y = y,
                              .groups = c.groups,
                              .round_output = round};
        };
        std::vector<float> want(n);
        BOOST_REQUIRE(cpu::Linear(params(x.data(), qw.codes.data(), qw.scales.data(), xq.data(),
                                         xs.data(), want.data())) == OpStatus::kOk);
        std::vector<uint8_t> codes(n), scales(n / 32);
        for (int64_t r = 0; r < c.rows; ++r) {
          cpu::QuantizeFp8PerBlock(&want[r * width], width, 32, &codes[r * width],
                                   &scales[r * width / 32]);
        }
        std::vector<float> got(n);
        std::vector<uint8_t> gc(n, 0xAA), gs(n / 32, 0xAA);
        LinearParams p =
            params(x.data(), qw.codes.data(), qw.scales.data(), xq.data(), xs.data(), got.data());
        p.y_codes = gc.data(), p.y_code_scales = gs.data();
        BOOST_REQUIRE(cpu::Linear(p) == OpStatus::kOk);
        BOOST_TEST((BitEqual(got, want) && gc == codes && gs == scales), "cpu");
        Dev<float> dx(x), dy(std::vector<float>(n, 7.0f));
        Dev<uint8_t> dwq(qw.codes), dws(qw.scales), dxq(xq), dxs(xs);
        Dev<uint8_t> dc(std::vector<uint8_t>(n, 0xAA)), ds(std::vector<uint8_t>(n / 32, 0xAA));
        LinearParams d = params(dx.get(), dwq.get(), dws.get(), dxq.get(), dxs.get(), dy.get());
        uint64_t at = gpu::KernelLaunches();
        BOOST_REQUIRE(gpu::Linear(d) == OpStatus::kOk);
        const uint64_t without = gpu::KernelLaunches() - at;
        d.y_codes = dc.get(), d.y_code_scales = ds.get();
        at = gpu::KernelLaunches();
        BOOST_REQUIRE(gpu::Linear(d) == OpStatus::kOk);
        BOOST_TEST(gpu::KernelLaunches() - at == without + (c.in_kernel ? 0 : 1));
        // The row kernel rounds and writes the codes as it writes y: one launch in all.
        if (c.in_kernel) BOOST_TEST(gpu::KernelLaunches() - at == 1u);
        BOOST_TEST((BitEqual(dy.Host(), want) && dc.Host() == codes && ds.Host() == scales),
                   "device");
        if (gpu::LinearMatrixTakes(d)) {
          for (const gpu::MatrixInstruction ins :
               {gpu::MatrixInstruction::kMma, gpu::MatrixInstruction::kMfma}) {
            if (ins == gpu::MatrixInstruction::kMfma && kBackend == "cuda") continue;
            Dev<uint8_t> mc(std::vector<uint8_t>(n, 0xAA)), ms(std::vector<uint8_t>(n / 32, 0xAA));
            d.y_codes = mc.get(), d.y_code_scales = ms.get();
            BOOST_REQUIRE(gpu::LinearMatrix(d, ins) == OpStatus::kOk);
            const std::vector<float> my = dy.Host();
            std::vector<uint8_t> mcodes(n), mscales(n / 32);
            for (int64_t r = 0; r < c.rows; ++r) {
              cpu::QuantizeFp8PerBlock(&my[r * width], width, 32, &mcodes[r * width],
                                       &mscales[r * width / 32]);
            }
            BOOST_TEST((mc.Host() == mcodes && ms.Host() == mscales),
                       "matrix " << static_cast<int>(ins));
          }
        }
      }
    }
  }
  // Codes without scales, with `also`, or of rows not in 32-blocks.
  std::vector<float> v(4096);
  std::vector<uint8_t> b(4096);
  const LinearProjection more{.w = b.data(), .w_scales = b.data(), .out = 32, .y = v.data()};
  const LinearParams ok{.x = v.data(),
                        .rows = 1,
                        .in = 64,
                        .out = 32,
                        .format = WeightFormat::kFp8,
                        .w = b.data(),
                        .w_scales = b.data(),
                        .x_codes = b.data(),
                        .x_scales = b.data(),
                        .y = v.data(),
                        .y_codes = b.data(),
                        .y_code_scales = b.data()};
  LinearParams no_scales = ok, also = ok, odd = ok;
  no_scales.y_code_scales = nullptr;
  also.also = &more, also.also_count = 1;
  odd.out = 40;
  for (const auto& [p, want] : {std::pair{no_scales, OpStatus::kBadArgument},
                                {also, OpStatus::kBadArgument},
                                {odd, OpStatus::kBadShape}}) {
    BOOST_TEST((cpu::Linear(p) == want));
    BOOST_TEST((gpu::Linear(p) == want));
  }
}

BOOST_AUTO_TEST_CASE(round_output_is_the_op_then_a_rounding) {
  std::mt19937 rng(29);
  const auto differ = [](const std::vector<float>& a, const std::vector<float>& b) {
    return !std::equal(a.begin(), a.end(), b.begin(),
                       [](float u, float v) { return std::memcmp(&u, &v, 4) == 0; });
  };
  struct Case {
    WeightFormat format;
    int64_t rows, in, out, groups;
  };
  // FP8 and FP4 at one row (the GEMV) and three (the tile); FP8 values at one row, 3 and 70 rows
  // (the row kernel, the tile), in groups; dense fp32 and BF16 weights.
  const Case cases[] = {
      {WeightFormat::kFp8, 1, 160, 70, 1},       {WeightFormat::kFp8, 3, 160, 70, 1},
      {WeightFormat::kFp4, 1, 96, 33, 1},        {WeightFormat::kFp4, 3, 96, 33, 1},
      {WeightFormat::kFp8Dense, 1, 128, 40, 2},  {WeightFormat::kFp8Dense, 3, 128, 40, 2},
      {WeightFormat::kFp8Dense, 70, 128, 40, 2}, {WeightFormat::kDense, 3, 45, 31, 1},
      {WeightFormat::kBf16, 1, 64, 20, 1}};
  for (const Case& c : cases) {
    BOOST_TEST_CONTEXT("format " << static_cast<int>(c.format) << " rows " << c.rows) {
      const int64_t wrows = c.groups * c.out, n = c.rows * c.groups * c.out;
      std::vector<float> x = Normal(rng, c.rows * c.groups * c.in),
                         w = Normal(rng, wrows * c.in, 0.2f);
      flashd::testing::QuantizedWeights qw;
      if (c.format == WeightFormat::kBf16) {
        qw.codes.clear();
        for (float v : w) {
          const uint16_t code = codecs::FloatToBf16(v);
          qw.codes.push_back(static_cast<uint8_t>(code));
          qw.codes.push_back(static_cast<uint8_t>(code >> 8));
        }
        qw.scales.assign(1, 0);
      } else if (c.format == WeightFormat::kDense) {
        qw.codes.assign(1, 0), qw.scales.assign(1, 0);
      } else {
        qw = flashd::testing::QuantizeWeights(
            c.format == WeightFormat::kFp8Dense ? WeightFormat::kFp8 : c.format, w, wrows, c.in);
      }
      std::vector<uint8_t> xq(x.size()), xs(x.size() / 32 + 1);
      const auto params = [&](const float* px, const uint8_t* pw, const uint8_t* pws,
                              const float* dense, uint8_t* pxq, uint8_t* pxs, float* y,
                              bool round) {
        return LinearParams{.x = px,
                            .rows = c.rows,
                            .in = c.in,
                            .out = c.out,
                            .format = c.format,
                            .w = pw,
                            .w_scales = pws,
                            .dense = dense,
                            .x_codes = pxq,
                            .x_scales = pxs,
                            .y = y,
                            .groups = c.groups,
                            .round_output = round};
      };
      std::vector<float> raw(n), want(n);
      BOOST_REQUIRE(cpu::Linear(params(x.data(), qw.codes.data(), qw.scales.data(), w.data(),
                                       xq.data(), xs.data(), raw.data(), false)) == OpStatus::kOk);
      BOOST_REQUIRE(cpu::Linear(params(x.data(), qw.codes.data(), qw.scales.data(), w.data(),
                                       xq.data(), xs.data(), want.data(), true)) == OpStatus::kOk);
      BOOST_TEST(BitEqual(want, RoundedBf16(raw)));
      BOOST_TEST(differ(want, raw));  // The sums are not BF16 values as they are.
      Dev<float> dx(x), dw(w);
      Dev<uint8_t> dwq(qw.codes), dws(qw.scales), dxq(xq), dxs(xs);
      Dev<float> dy(std::vector<float>(n, 7.0f));
      BOOST_REQUIRE(gpu::Linear(params(dx.get(), dwq.get(), dws.get(), dw.get(), dxq.get(),
                                       dxs.get(), dy.get(), true)) == OpStatus::kOk);
      BOOST_TEST(BitEqual(dy.Host(), want), "the exact path's rounded values are the CPU's");
      LinearParams m =
          params(dx.get(), dwq.get(), dws.get(), dw.get(), dxq.get(), dxs.get(), dy.get(), false);
      if (gpu::LinearMatrixTakes(m)) {
        MatrixRoundsAsItWrites(m, dy, [](const LinearParams& q, gpu::MatrixInstruction ins) {
          return gpu::LinearMatrix(q, ins);
        });
      }
    }
  }
  // The experts' rows: the GEMV a row at a time (slot_rows 5) and the tile (0), and on matrix
  // cores, FP8 and FP4.
  const int64_t tokens = 5, experts = 6, k = 2, in = 96, out = 40;
  const Grouped g = GroupedChoices(rng, tokens, experts, k);
  const int64_t total = tokens * k;
  for (const WeightFormat format : {WeightFormat::kFp8, WeightFormat::kFp4}) {
    ExpertWeights ew(rng, format, experts, out, in);
    const std::vector<float> x = Normal(rng, total * in, 2.0f);
    std::vector<uint8_t> xq(x.size()), xs(x.size() / 32);
    ExpertLinearParams p = ExpertParams(g, ew, format, in, out, x, &xq, &xs);
    std::vector<float> raw(total * out), want(raw.size());
    p.y = raw.data();
    BOOST_REQUIRE(cpu::ExpertLinear(p) == OpStatus::kOk);
    p.y = want.data();
    p.round_output = true;
    BOOST_REQUIRE(cpu::ExpertLinear(p) == OpStatus::kOk);
    BOOST_TEST(BitEqual(want, RoundedBf16(raw)));
    BOOST_TEST(differ(want, raw));
    DeviceExpertInputs dev(p, g, ew);
    Dev<float> dy(std::vector<float>(want.size(), 7.0f));
    ExpertLinearParams d = dev.On(p, dy.get());
    for (const int64_t slot_rows : {int64_t{0}, tokens}) {
      d.slot_rows = slot_rows;
      BOOST_REQUIRE(gpu::ExpertLinear(d) == OpStatus::kOk);
      BOOST_TEST(BitEqual(dy.Host(), want), "slot_rows " << slot_rows);
    }
    MatrixRoundsAsItWrites(d, dy, [](const ExpertLinearParams& q, gpu::MatrixInstruction ins) {
      return gpu::ExpertLinearMatrix(q, ins);
    });
    d.round_output = true;
    // Not with the gated pair.
    std::vector<float> gate(want.size()), up_out(want.size());
    p.up = ew.w.data(), p.up_scales = ew.ws.data(), p.gate = gate.data(), p.up_out = up_out.data();
    BOOST_TEST((cpu::ExpertLinear(p) == OpStatus::kBadArgument));
    d.up = dev.w.get(), d.up_scales = dev.ws.get();
    BOOST_TEST((gpu::ExpertLinear(d) == OpStatus::kBadArgument));
    BOOST_TEST((gpu::ExpertLinearMatrix(d) == OpStatus::kBadArgument));
  }
  std::vector<float> one(40), y(1), gate(1), up(1);
  std::vector<uint8_t> codes(32, 0x38), scales(1, 127), xq(32), xs(1);
  const LinearParams gated{.x = one.data(),
                           .rows = 1,
                           .in = 32,
                           .out = 1,
                           .format = WeightFormat::kFp8,
                           .w = codes.data(),
                           .w_scales = scales.data(),
                           .x_codes = xq.data(),
                           .x_scales = xs.data(),
                           .y = y.data(),
                           .up = codes.data(),
                           .up_scales = scales.data(),
                           .gate = gate.data(),
                           .up_out = up.data(),
                           .round_output = true};
  BOOST_TEST((cpu::Linear(gated) == OpStatus::kBadArgument));
  BOOST_TEST((gpu::Linear(gated) == OpStatus::kBadArgument));  // Refused before any device use.
}

// RmsNorm with the window keys' steps after it (rope_dim, fake_quant_fp8) is RmsNorm, Rope and
// FakeQuant in turn, on the CPU and on the device, bit for bit: each step alone and both, at
// 1, 3 and 257 rows, dim 96 (rope_dim 32) and 512 (64, the released keys' shape), rows strided;
// the bad shapes refused alike.
BOOST_AUTO_TEST_CASE(rms_norm_with_rope_and_fp8_is_the_three_ops) {
  std::mt19937 rng(31);
  for (int64_t rows : kRows) {
    for (const auto& [dim, rope_dim] : {std::pair<int64_t, int64_t>{96, 32}, {512, 64}}) {
      const int64_t stride = dim + 32;
      std::vector<float> x = Normal(rng, rows * stride, 3.0f), w = Normal(rng, dim);
      std::vector<float> freqs(rope_dim / 2);
      cpu::RopeFrequencies(rope_dim, 65536, 160000.0, 16, 32, 1, freqs.data());
      std::vector<int64_t> pos(rows);
      std::uniform_int_distribution<int64_t> pick(0, 1 << 20);
      for (int64_t& v : pos) v = pick(rng);
      Dev<float> dw(w), df(freqs);
      Dev<int64_t> dp(pos);
      for (const auto& [rope, fake] : {std::pair{true, false}, {false, true}, {true, true}}) {
        RmsNormParams p{.rows = rows,
                        .dim = dim,
                        .stride = stride,
                        .weight = w.data(),
                        .eps = 1e-6f,
                        .round_input = true};
        std::vector<float> want = x;
        p.x = want.data();
        BOOST_REQUIRE(cpu::RmsNorm(p) == OpStatus::kOk);
        if (rope) {
          BOOST_REQUIRE(cpu::Rope({.x = want.data(),
                                   .rows = rows,
                                   .head_dim = dim,
                                   .rope_dim = rope_dim,
                                   .row_stride = stride,
                                   .positions = pos.data(),
                                   .freqs = freqs.data()}) == OpStatus::kOk);
        }
        for (int64_t r = 0; fake && r < rows; ++r) {
          BOOST_REQUIRE(cpu::FakeQuant({.x = want.data() + r * stride, .n = dim}) == OpStatus::kOk);
        }
        std::vector<float> fused = x;
        p.x = fused.data();
        p.rope_dim = rope ? rope_dim : 0;
        p.positions = pos.data();
        p.freqs = freqs.data();
        p.fake_quant_fp8 = fake;
        BOOST_REQUIRE(cpu::RmsNorm(p) == OpStatus::kOk);
        BOOST_TEST(BitEqual(fused, want), "cpu rows " << rows << " dim " << dim);
        Dev<float> dx(x);
        p.x = dx.get();
        p.weight = dw.get();
        p.positions = dp.get();
        p.freqs = df.get();
        BOOST_REQUIRE(gpu::RmsNorm(p) == OpStatus::kOk);
        BOOST_TEST(BitEqual(dx.Host(), want), "device rows " << rows << " dim " << dim);
      }
    }
  }
  std::vector<float> x(64), w(40);
  std::vector<int64_t> pos(1);
  const RmsNormParams bad[] = {
      {.x = x.data(),
       .rows = 1,
       .dim = 40,
       .stride = 40,
       .weight = w.data(),
       .fake_quant_fp8 = true},
      {.x = x.data(),
       .rows = 1,
       .dim = 40,
       .stride = 40,
       .weight = w.data(),
       .rope_dim = 3,
       .positions = pos.data(),
       .freqs = w.data()},
      {.x = x.data(), .rows = 1, .dim = 40, .stride = 40, .weight = w.data(), .rope_dim = 8}};
  for (const RmsNormParams& p : bad) {
    BOOST_TEST((cpu::RmsNorm(p) == OpStatus::kBadShape));
    BOOST_TEST((gpu::RmsNorm(p) == OpStatus::kBadShape));  // Refused before any device use.
  }
}

// Two norms in one op (RmsNormParams::next: the query latent's with its codes and the window
// keys' with their rotation and FP8 steps and their rows copied to the ring staging, as a layer
// asks) are the two ops in turn and the copy, on the CPU and on the device, where they are one
// launch; 1 and 3 rows of one and 1 and 5 of the other, some rows not copied and the copies in
// another order, the staging's other rows untouched. A next with one of its own, of a shape that
// does not fit or with a copy and no rows for it, refused alike with nothing written.
BOOST_AUTO_TEST_CASE(two_norms_in_one_op_are_the_two_ops) {
  std::mt19937 rng(61);
  const int64_t qdim = 96, kdim = 64, rope_dim = 16;
  std::vector<float> freqs(rope_dim / 2);
  cpu::RopeFrequencies(rope_dim, 65536, 160000.0, 16, 32, 1, freqs.data());
  const std::vector<float> qw = Normal(rng, qdim), kw = Normal(rng, kdim);
  Dev<float> dqw(qw), dkw(kw), df(freqs);
  for (const int64_t qrows : {int64_t{1}, int64_t{3}}) {
    for (const int64_t krows : {int64_t{1}, int64_t{5}}) {
      BOOST_TEST_CONTEXT("rows " << qrows << " and " << krows) {
        const std::vector<float> qx = Normal(rng, qrows * qdim, 3.0f);
        const std::vector<float> kx = Normal(rng, krows * kdim, 3.0f);
        std::vector<int64_t> pos(krows);
        for (int64_t r = 0; r < krows; ++r) pos[r] = 4000 + 9 * r;
        // The keys' rows into a staging of 7 rows: rows 1 and 4 of five not copied.
        const std::vector<int64_t> to =
            krows == 1 ? std::vector<int64_t>{2} : std::vector<int64_t>{3, -1, 0, 6, -1};
        const std::vector<float> staging(7 * kdim, 7.0f);
        const auto norms = [&](float* q, float* k, const float* w1, const float* w2,
                               const int64_t* positions, const float* f, uint8_t* codes,
                               uint8_t* scales) {
          return std::pair{RmsNormParams{.x = q,
                                         .rows = qrows,
                                         .dim = qdim,
                                         .stride = qdim,
                                         .weight = w1,
                                         .eps = 1e-6f,
                                         .round_input = true,
                                         .codes = codes,
                                         .code_scales = scales},
                           RmsNormParams{.x = k,
                                         .rows = krows,
                                         .dim = kdim,
                                         .stride = kdim,
                                         .weight = w2,
                                         .eps = 1e-6f,
                                         .round_input = true,
                                         .rope_dim = rope_dim,
                                         .positions = positions,
                                         .freqs = f,
                                         .fake_quant_fp8 = true}};
        };
        std::vector<float> wq = qx, wk = kx;
        std::vector<uint8_t> wc(qx.size()), ws(qx.size() / 32);
        auto [a, b] = norms(wq.data(), wk.data(), qw.data(), kw.data(), pos.data(), freqs.data(),
                            wc.data(), ws.data());
        BOOST_REQUIRE(cpu::RmsNorm(a) == OpStatus::kOk);
        BOOST_REQUIRE(cpu::RmsNorm(b) == OpStatus::kOk);
        std::vector<float> wstage = staging;  // The copy, after the two ops.
        for (int64_t r = 0; r < krows; ++r) {
          if (to[r] >= 0) std::copy_n(&wk[r * kdim], kdim, &wstage[to[r] * kdim]);
        }
        std::vector<float> gq = qx, gk = kx, gstage = staging;
        std::vector<uint8_t> gc(qx.size()), gs(qx.size() / 32);
        auto [c, e] = norms(gq.data(), gk.data(), qw.data(), kw.data(), pos.data(), freqs.data(),
                            gc.data(), gs.data());
        e.copy_to = gstage.data(), e.copy_rows = to.data();
        c.next = &e;
        BOOST_REQUIRE(cpu::RmsNorm(c) == OpStatus::kOk);
        BOOST_TEST((BitEqual(gq, wq) && BitEqual(gk, wk) && gc == wc && gs == ws), "cpu");
        BOOST_TEST(BitEqual(gstage, wstage), "cpu's copy");
        Dev<float> dq(qx), dk(kx), dstage(staging);
        Dev<int64_t> dp(pos), dto(to);
        Dev<uint8_t> dc(std::vector<uint8_t>(qx.size())), ds(std::vector<uint8_t>(qx.size() / 32));
        auto [d, n] =
            norms(dq.get(), dk.get(), dqw.get(), dkw.get(), dp.get(), df.get(), dc.get(), ds.get());
        n.copy_to = dstage.get(), n.copy_rows = dto.get();
        d.next = &n;
        const uint64_t at = gpu::KernelLaunches();
        BOOST_REQUIRE(gpu::RmsNorm(d) == OpStatus::kOk);
        BOOST_TEST(gpu::KernelLaunches() - at == 1u);
        BOOST_TEST((BitEqual(dq.Host(), wq) && BitEqual(dk.Host(), wk) && dc.Host() == wc &&
                    ds.Host() == ws),
                   "device");
        BOOST_TEST(BitEqual(dstage.Host(), wstage), "device's copy");
      }
    }
  }
  // A next with a next of its own; a next whose rotation does not fit its row.
  std::vector<float> x(64, 1.0f), w(64, 1.0f);
  const std::vector<int64_t> pos = {0};
  const RmsNormParams last{
      .x = x.data() + 32, .rows = 1, .dim = 32, .stride = 32, .weight = w.data()};
  RmsNormParams chained = last, odd = last, rowless = last;
  chained.next = &last;
  odd.rope_dim = 3, odd.positions = pos.data(), odd.freqs = w.data();
  std::vector<float> staging(32);
  rowless.copy_to = staging.data();
  for (const auto& [next, want] : {std::pair{&chained, OpStatus::kBadArgument},
                                   {&odd, OpStatus::kBadShape},
                                   {&rowless, OpStatus::kBadShape}}) {
    const RmsNormParams p{
        .x = x.data(), .rows = 1, .dim = 32, .stride = 32, .weight = w.data(), .next = next};
    BOOST_TEST((cpu::RmsNorm(p) == want));
    BOOST_TEST((gpu::RmsNorm(p) == want));  // Refused before any device use.
    BOOST_TEST(std::all_of(x.begin(), x.end(), [](float v) { return v == 1.0f; }));
  }
}

// Ops on a stream of the caller's own give the results they give on the default one; recorded
// as a graph (gpu_bench's layer timing), they do not run until the graph is launched, then give
// the same results again. The CPU runtime has no graphs: that part needs a device.
BOOST_AUTO_TEST_CASE(ops_on_a_stream_and_replayed_as_a_graph) {
  std::mt19937 rng(41);
  const int64_t rows = 3, in = 256, out = 70;
  const std::vector<float> x = Normal(rng, rows * in);
  const flashd::testing::QuantizedWeights qw =
      flashd::testing::QuantizeWeights(WeightFormat::kFp8, Normal(rng, out * in, 0.2f), out, in);
  Dev<float> dx(x), want(std::vector<float>(rows * out)), got(std::vector<float>(rows * out, 5.0f));
  Dev<uint8_t> dwq(qw.codes), dws(qw.scales), dxq(std::vector<uint8_t>(x.size())),
      dxs(std::vector<uint8_t>(x.size() / 32));
  const LinearShape shape{WeightFormat::kFp8, rows, in, out};
  BOOST_REQUIRE(gpu::Linear(shape.Params(dx.get(), dwq.get(), dws.get(), nullptr, dxq.get(),
                                         dxs.get(), want.get())) == OpStatus::kOk);
  void* stream = nullptr;
  BOOST_REQUIRE_EQUAL(gpu::StreamCreate(&stream), "");
  LinearParams p =
      shape.Params(dx.get(), dwq.get(), dws.get(), nullptr, dxq.get(), dxs.get(), got.get());
  p.stream = stream;
  BOOST_REQUIRE(gpu::Linear(p) == OpStatus::kOk);
  BOOST_REQUIRE_EQUAL(gpu::Synchronize(), "");
  BOOST_TEST(BitEqual(got.Host(), want.Host()));
  Dev<float> later(std::vector<float>(rows * out, 5.0f));  // Before the capture: it copies.
  const std::string capture = gpu::CaptureBegin(stream);
  if (!capture.empty()) {
    BOOST_TEST_MESSAGE("graphs not checked: " << capture);
    BOOST_REQUIRE_EQUAL(gpu::StreamDestroy(stream), "");
    return;
  }
  p.y = later.get();
  BOOST_REQUIRE(gpu::Linear(p) == OpStatus::kOk);
  void* graph = nullptr;
  BOOST_REQUIRE_EQUAL(gpu::CaptureEnd(stream, &graph), "");
  BOOST_REQUIRE_EQUAL(gpu::Synchronize(), "");
  BOOST_TEST((later.Host() == std::vector<float>(rows * out, 5.0f)));  // Recorded, not run.
  for (int round = 0; round < 2; ++round) {
    BOOST_REQUIRE_EQUAL(gpu::GraphLaunch(graph, stream), "");
    BOOST_REQUIRE_EQUAL(gpu::Synchronize(), "");
    BOOST_TEST(BitEqual(later.Host(), want.Host()), "replay " << round);
  }
  BOOST_REQUIRE_EQUAL(gpu::GraphDestroy(graph), "");
  BOOST_REQUIRE_EQUAL(gpu::StreamDestroy(stream), "");
}

// The free-order GEMM (gpu_bench's comparison for the fixed order's cost) gives the CPU's results
// within rounding, split over K or not: each value within 1e-5 of its row's largest magnitude
// (a K-block dropped or counted twice, or a scale misplaced, moves values by far more). Dense
// weights are refused.
BOOST_AUTO_TEST_CASE(linear_free_order_agrees_within_rounding) {
  std::mt19937 rng(16);
  const GemmCase cases[] = {{WeightFormat::kFp8, 64, 33},
                            {WeightFormat::kFp8, 4480, 9},
                            {WeightFormat::kFp4, 96, 40},
                            {WeightFormat::kFp4, 4160, 5}};
  for (const GemmCase& c : cases) {
    for (int64_t rows : {int64_t{1}, int64_t{3}, int64_t{13}}) {
      std::vector<float> x = Normal(rng, rows * c.in), w = Normal(rng, c.out * c.in, 0.2f);
      const flashd::testing::QuantizedWeights qw =
          flashd::testing::QuantizeWeights(c.format, w, c.out, c.in);
      std::vector<uint8_t> xq, xs;
      const std::vector<float> want = c.Cpu(rows, x, qw, &xq, &xs);
      const LinearShape shape{c.format, rows, c.in, c.out};
      for (int split : {1, 3, 4}) {
        Dev<float> dx(x), dy(std::vector<float>(want.size(), 7.0f));
        Dev<uint8_t> dwq(qw.codes), dws(qw.scales), dxq(xq), dxs(xs);
        BOOST_REQUIRE(gpu::LinearFreeOrder(shape.Params(dx.get(), dwq.get(), dws.get(), nullptr,
                                                        dxq.get(), dxs.get(), dy.get()),
                                           split) == OpStatus::kOk);
        const std::vector<float> got = dy.Host();
        double worst = 0;
        for (int64_t r = 0; r < rows; ++r) {
          double largest = 0;
          for (int64_t n = 0; n < c.out; ++n) {
            largest = std::max(largest, double(std::fabs(want[r * c.out + n])));
          }
          for (int64_t n = 0; n < c.out; ++n) {
            worst = std::max(worst,
                             std::fabs(double(got[r * c.out + n]) - want[r * c.out + n]) / largest);
          }
        }
        BOOST_TEST(worst <= 1e-5, "format " << static_cast<int>(c.format) << " rows " << rows
                                            << " split " << split << ": " << worst);
      }
    }
  }
  const std::vector<float> x(32, 1.0f), dense(32, 1.0f);
  std::vector<float> y(1);
  Dev<float> dx(x), dd(dense), dy(y);
  const LinearShape dense_shape{WeightFormat::kDense, 1, 32, 1};
  BOOST_TEST((gpu::LinearFreeOrder(dense_shape.Params(dx.get(), nullptr, nullptr, dd.get(), nullptr,
                                                      nullptr, dy.get()),
                                   1) == OpStatus::kBadArgument));
}

// The matrix-core GEMM (LinearMatrix), with each instruction: each output within rounding of
// the CPU's Linear (its error at most 1e-3 of the sum of the products' magnitudes: the
// instruction rounds each block's sum its own way), a NaN weight code or scale giving NaN where
// the CPU's does, and every row's results the same bits whatever the rows beside it (1, 3, 70 or
// 257 rows: Narrow and Wide tiles, several token tiles); the grouped experts' rows equal
// LinearMatrix per expert. K-chunks of four blocks whole and partial (K of 1376: 43 blocks, 10
// whole chunks and 3 blocks; of 544: 4 chunks and 1 block; of 64 and 96: one partial chunk),
// output tiles whole and partial. Where all three instructions
// are stand-ins, FP4's results (whose block sums never round there) are the same bits with
// each: their staging, operand offsets and output layouts pair every product as the others'
// do. FP8's may differ: mma's stand-in sums a block in its instruction's column order, which
// the staging permutes within the block, the warpgroup's and AMD's in the order of K.
void LinearMatrixCases(gpu::MatrixInstruction ins, std::vector<std::vector<float>>* first);

BOOST_AUTO_TEST_CASE(linear_matrix_within_rounding_and_the_same_for_any_rows) {
  std::vector<std::vector<float>>
      first_results;  // Each case's, rows `most`, the first instruction.
  for (const gpu::MatrixInstruction ins :
       {gpu::MatrixInstruction::kMma, gpu::MatrixInstruction::kWgmma,
        gpu::MatrixInstruction::kMfma}) {
    BOOST_TEST_CONTEXT("instruction " << (ins == gpu::MatrixInstruction::kMma     ? "mma"
                                          : ins == gpu::MatrixInstruction::kWgmma ? "wgmma"
                                                                                  : "mfma")) {
      LinearMatrixCases(ins, &first_results);
    }
  }
}

void LinearMatrixCases(gpu::MatrixInstruction ins, std::vector<std::vector<float>>* first) {
  if (ins == gpu::MatrixInstruction::kWgmma && kBackend == "hip") {
    BOOST_TEST_MESSAGE("the warpgroup instruction's path is NVIDIA's and the CPU runtime's");
    return;
  }
  if (ins == gpu::MatrixInstruction::kMfma && kBackend == "cuda") {
    BOOST_TEST_MESSAGE("AMD's instruction's path is AMD's and the CPU runtime's");
    return;
  }
  const bool native = ins == gpu::MatrixInstruction::kMma     ? gpu::MatrixCoresNative()
                      : ins == gpu::MatrixInstruction::kWgmma ? gpu::MatrixWgmmaNative()
                                                              : gpu::MatrixMfmaNative();
  const bool all_stand_ins =
      !gpu::MatrixCoresNative() && !gpu::MatrixWgmmaNative() && !gpu::MatrixMfmaNative();
  size_t case_index = 0;
  std::mt19937 rng(61);
  const GemmCase cases[] = {{WeightFormat::kFp8, 64, 33},
                            {WeightFormat::kFp8, 1376, 130},
                            {WeightFormat::kFp4, 96, 40},
                            {WeightFormat::kFp4, 544, 136}};
  const int64_t most = 257;
  for (const GemmCase& c : cases) {
    std::vector<float> x = Normal(rng, most * c.in), w = Normal(rng, c.out * c.in, 0.2f);
    // FP4: one row's block 2^13 times its neighbours' (scale codes 13 apart, further than the
    // warpgroup tiles fold), so that its chunk takes the unfolded adds there.
    if (c.format == WeightFormat::kFp4 && c.in > 6 * 32) {
      for (int64_t k = 5 * 32; k < 6 * 32; ++k) w[21 * c.in + k] *= 0x1p13f;
    }
    flashd::testing::QuantizedWeights qw =
        flashd::testing::QuantizeWeights(c.format, w, c.out, c.in);
    if (c.format == WeightFormat::kFp8) {
      qw.codes[5 * c.in + 7] = 0x7F;    // A NaN code in column 5.
      qw.scales[c.in / 32 + 1] = 0xFF;  // A NaN scale: columns 32.. of block 1.
    } else {
      qw.scales[9 * (c.in / 32) + 2] = 0xFF;  // Column 9, block 2.
    }
    Dev<uint8_t> dwq(qw.codes), dws(qw.scales);
    Dev<float> dx(x);
    Dev<uint8_t> dxq(std::vector<uint8_t>(x.size())), dxs(std::vector<uint8_t>(x.size() / 32));
    std::vector<std::vector<float>> got;
    int64_t differ = 0;  // Outputs whose bits differ from the CPU's (another order of sums).
    // Narrow, Medium and Wide tiles (8, 64 and 128 tokens), the last ones part full.
    for (int64_t rows : {int64_t{1}, int64_t{3}, int64_t{40}, int64_t{70}, most}) {
      std::vector<uint8_t> xq, xs;
      const std::vector<float> want = c.Cpu(rows, x, qw, &xq, &xs);
      const LinearShape shape{c.format, rows, c.in, c.out};
      Dev<float> dy(std::vector<float>(want.size(), 7.0f));
      BOOST_REQUIRE(gpu::LinearMatrix(shape.Params(dx.get(), dwq.get(), dws.get(), nullptr,
                                                   dxq.get(), dxs.get(), dy.get()),
                                      ins) == OpStatus::kOk);
      got.push_back(dy.Host());
      const std::vector<float>& y = got.back();
      int64_t off = 0, nan_mismatch = 0;
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t n = 0; n < c.out; ++n) {
          const float a = y[r * c.out + n], b = want[r * c.out + n];
          if (std::isnan(a) || std::isnan(b)) {
            nan_mismatch += std::isnan(a) != std::isnan(b);
            continue;
          }
          differ += a != b;
          double magnitude = 0;  // The products' magnitudes, in double.
          for (int64_t k = 0; k < c.in; ++k) {
            magnitude +=
                std::fabs(double(codecs::E4M3ToFloat(xq[r * c.in + k])) *
                          codecs::E8M0ToFloat(xs[(r * c.in + k) / 32]) * qw.decoded[n * c.in + k]);
          }
          off += std::fabs(double(a) - b) > 1e-3 * magnitude + 1e-30;
        }
      }
      BOOST_TEST(off == 0, "format " << static_cast<int>(c.format) << " in " << c.in << " rows "
                                     << rows << ": " << off << " outputs off");
      BOOST_TEST(nan_mismatch == 0, "rows " << rows << ": NaN where the CPU has none or back");
    }
    BOOST_TEST_MESSAGE("format " << static_cast<int>(c.format) << " in " << c.in << ": " << differ
                                 << " outputs differ from the CPU's bits");
    // The stand-in sums each block in a tree, the CPU in four lanes: FP8 products have the bits
    // to round differently, so the tolerance above is exercised (FP4's are too short to round).
    if (!native && c.format == WeightFormat::kFp8) BOOST_TEST(differ > 0);
    // Every row's bits the same in each call (a call's rows are the first of the largest's).
    for (size_t i = 0; i + 1 < got.size(); ++i) {
      const std::vector<float> head(got.back().begin(), got.back().begin() + got[i].size());
      BOOST_TEST(BitEqual(got[i], head), "format " << static_cast<int>(c.format) << ": rows "
                                                   << got[i].size() / c.out << " against " << most);
    }
    if (first->size() <= case_index) {
      first->push_back(got.back());
    } else if (all_stand_ins && c.format == WeightFormat::kFp4) {
      BOOST_TEST(BitEqual(got.back(), (*first)[case_index]),
                 "format " << static_cast<int>(c.format) << " in " << c.in
                           << ": the instructions' stand-ins apart");
    }
    ++case_index;
  }
  // The grouped experts' rows: LinearMatrix's over each expert's rows, in Narrow tiles (5
  // tokens: 15 rows over 6 slots), one Medium tile a slot (29) and several with a part (150).
  for (const int64_t tokens : {5, 29, 150}) {
    const int64_t experts = 6, k = 3, in = 160, out = 136;
    const Grouped g = GroupedChoices(rng, tokens, experts, k);
    const int64_t total = tokens * k, slots = static_cast<int64_t>(g.expert.size());
    for (WeightFormat format : {WeightFormat::kFp8, WeightFormat::kFp4}) {
      const ExpertWeights ew(rng, format, experts, out, in);
      const std::vector<float> x = Normal(rng, total * in);
      Dev<float> dx(x), dy(std::vector<float>(total * out, -1.0f));
      Dev<int64_t> dexpert(g.expert), doffset(g.offset), dtiles(g.tiles);
      Dev<const uint8_t*> dtable(ew.dw), dstable(ew.dws);
      Dev<uint8_t> dxq(std::vector<uint8_t>(x.size())), dxs(std::vector<uint8_t>(x.size() / 32));
      BOOST_REQUIRE(gpu::ExpertLinearMatrix({.x = dx.get(),
                                             .rows = total,
                                             .in = in,
                                             .out = out,
                                             .slot_expert = dexpert.get(),
                                             .slot_offset = doffset.get(),
                                             .slot_tiles = dtiles.get(),
                                             .slots = slots,
                                             .experts = experts,
                                             .format = format,
                                             .w = dtable.get(),
                                             .w_scales = dstable.get(),
                                             .x_codes = dxq.get(),
                                             .x_scales = dxs.get(),
                                             .y = dy.get()},
                                            ins) == OpStatus::kOk);
      const std::vector<float> grouped = dy.Host();
      for (int64_t s = 0; s < slots; ++s) {
        const int64_t r0 = g.offset[s], rows = g.offset[s + 1] - r0, e = g.expert[s];
        if (rows == 0) continue;
        Dev<float> dxe(std::vector<float>(x.begin() + r0 * in, x.begin() + (r0 + rows) * in));
        Dev<float> dye(std::vector<float>(rows * out, -2.0f));
        const LinearShape shape{format, rows, in, out};
        BOOST_REQUIRE(gpu::LinearMatrix(shape.Params(dxe.get(), ew.dw[e], ew.dws[e], nullptr,
                                                     dxq.get(), dxs.get(), dye.get()),
                                        ins) == OpStatus::kOk);
        const std::vector<float> one(grouped.begin() + r0 * out,
                                     grouped.begin() + (r0 + rows) * out);
        BOOST_TEST(BitEqual(dye.Host(), one), "format " << static_cast<int>(format) << " slot " << s
                                                        << " of " << tokens << " tokens");
      }
    }
  }
  // What it does not take: groups, dense weights, activation codes off a 16-byte boundary.
  Dev<float> dx(std::vector<float>(64, 1.0f)), dy(std::vector<float>(4));
  Dev<uint8_t> dw(std::vector<uint8_t>(64 * 2, 0x38)), ds(std::vector<uint8_t>(2, 127));
  Dev<uint8_t> dxq(std::vector<uint8_t>(80)), dxs(std::vector<uint8_t>(4));
  LinearShape shape{WeightFormat::kFp8, 1, 64, 2};
  LinearParams p =
      shape.Params(dx.get(), dw.get(), ds.get(), nullptr, dxq.get(), dxs.get(), dy.get());
  BOOST_TEST((gpu::LinearMatrix(p, ins) == OpStatus::kOk));
  p.x_codes = dxq.get() + 4;
  BOOST_TEST((gpu::LinearMatrix(p, ins) == OpStatus::kBadArgument));
  p.x_codes = dxq.get();
  p.groups = 2;
  BOOST_TEST((gpu::LinearMatrix(p, ins) == OpStatus::kBadArgument));
  p.groups = 1;
  p.format = WeightFormat::kDense;
  BOOST_TEST((gpu::LinearMatrix(p, ins) == OpStatus::kBadArgument));
}

// An FP8 matrix run as its exact values (kFp8Dense, how wo_a is held) gives kDense's results over
// its dequantized values, on the CPU and on the device, also for rows of a larger matrix whose
// first row is inside a 32-row scale tile (the scales then those of the whole matrix).
BOOST_AUTO_TEST_CASE(fp8_values_equal_their_dequantized_matrix) {
  std::mt19937 rng(51);
  const int64_t all_rows = 100, in = 1056;  // Four K chunks and a part.
  // Each 32x32 tile a different power of two, so a misplaced scale changes values.
  std::vector<float> w = Normal(rng, all_rows * in, 0.2f);
  for (int64_t r = 0; r < all_rows; ++r) {
    for (int64_t k = 0; k < in; ++k) w[r * in + k] *= std::ldexp(1.0f, int(r / 32 + (k / 32) % 3));
  }
  const flashd::testing::QuantizedWeights qw =
      flashd::testing::QuantizeWeights(WeightFormat::kFp8, w, all_rows, in);
  std::vector<float> values(all_rows * in);
  flashd::kernels::cpu::DequantizeFp8Weight(qw.codes.data(), qw.scales.data(), all_rows, in,
                                            values.data());
  Dev<uint8_t> dcodes(qw.codes), dscales(qw.scales);
  struct Slice {
    int64_t row0, out;
  };
  for (const Slice& sl : {Slice{0, all_rows}, Slice{40, 45}, Slice{96, 4}}) {
    for (int64_t rows : kRows) {
      const std::vector<float> x = Normal(rng, rows * in);
      std::vector<float> want(rows * sl.out), cpu_fp8(want.size());
      BOOST_REQUIRE(cpu::Linear({.x = x.data(),
                                 .rows = rows,
                                 .in = in,
                                 .out = sl.out,
                                 .format = WeightFormat::kDense,
                                 .dense = values.data() + sl.row0 * in,
                                 .y = want.data()}) == OpStatus::kOk);
      LinearParams p{.x = x.data(),
                     .rows = rows,
                     .in = in,
                     .out = sl.out,
                     .format = WeightFormat::kFp8Dense,
                     .w = qw.codes.data() + sl.row0 * in,
                     .w_scales = qw.scales.data(),
                     .y = cpu_fp8.data(),
                     .w_row0 = sl.row0};
      BOOST_REQUIRE(cpu::Linear(p) == OpStatus::kOk);
      BOOST_TEST(BitEqual(cpu_fp8, want), "cpu, row0 " << sl.row0 << " rows " << rows);
      Dev<float> dx(x), dy(std::vector<float>(want.size()));
      p.x = dx.get();
      p.w = dcodes.get() + sl.row0 * in;
      p.w_scales = dscales.get();
      p.y = dy.get();
      BOOST_REQUIRE(gpu::Linear(p) == OpStatus::kOk);
      BOOST_TEST(BitEqual(dy.Host(), want), "device, row0 " << sl.row0 << " rows " << rows);
    }
  }
  // As for kFp8, the inputs come in whole 32-blocks (the scales' columns).
  const std::vector<float> x(40, 1.0f);
  std::vector<float> y(1);
  BOOST_TEST((cpu::Linear({.x = x.data(),
                           .rows = 1,
                           .in = 40,
                           .out = 1,
                           .format = WeightFormat::kFp8Dense,
                           .w = qw.codes.data(),
                           .w_scales = qw.scales.data(),
                           .y = y.data()}) == OpStatus::kBadShape));
}

// wo_a's grouped projection in one op: each group's columns as a separate op on its slices, on
// both sides, over every FP8 code (NaN codes included), tile scales from 2^-127 to 2^60 (the
// device decodes scales up to 2^7 one way, larger ones another), a NaN scale, K in whole
// 64-value steps and with a 32-block left over, one to two chunks of activations, several
// groups of row tiles, and columns past the last whole tile; 70 and 129 rows take the 64 x 64
// tile (rows and columns past its last whole tile, K's last chunk half).
BOOST_AUTO_TEST_CASE(fp8_values_in_groups_equal_one_op_per_group) {
  std::mt19937 rng(57);
  struct Shape {
    int64_t groups, rows, in, out;
  };
  for (const Shape& sh : {Shape{3, 1, 96, 45}, Shape{3, 9, 96, 45}, Shape{2, 1, 2080, 64},
                          Shape{2, 3, 2080, 64}, Shape{1, 1, 4096, 40}, Shape{8, 2, 256, 32},
                          Shape{3, 70, 96, 45}, Shape{2, 129, 2080, 130}}) {
    const int64_t G = sh.groups, rows = sh.rows, in = sh.in, out = sh.out;
    const int64_t all_rows = G * out;
    std::vector<uint8_t> codes(all_rows * in);
    for (uint8_t& c : codes) {
      c = static_cast<uint8_t>(rng());
      if ((c & 0x7F) == 0x7F) c ^= 1;  // NaN codes only where placed:
    }
    codes[3 * in + in - 1] = 0x7F;           // a column's last value,
    codes[(all_rows - 1) * in + 40] = 0xFF;  // and the last column's 41st (-NaN).
    std::vector<uint8_t> scales((all_rows + 31) / 32 * (in / 32));
    for (size_t i = 0; i < scales.size(); ++i) {
      // Mostly the weights' own range; every eighth tile large, one tile 2^-127, one NaN.
      scales[i] = static_cast<uint8_t>(i % 8 == 5 ? 135 + rng() % 52 : 110 + rng() % 20);
    }
    scales[0] = 0;
    if (scales.size() > 3) scales[3] = 0xFF;
    const std::vector<float> x = Normal(rng, rows * G * in);
    const LinearParams grouped{.x = x.data(),
                               .rows = rows,
                               .in = in,
                               .out = out,
                               .format = WeightFormat::kFp8Dense,
                               .w = codes.data(),
                               .w_scales = scales.data(),
                               .groups = G};
    std::vector<float> want(rows * G * out, -1.0f);
    LinearParams p = grouped;
    p.y = want.data();
    BOOST_REQUIRE(cpu::Linear(p) == OpStatus::kOk);
    // Each group as its own op on its slices.
    for (int64_t g = 0; g < G; ++g) {
      std::vector<float> gx(rows * in), gy(rows * out);
      for (int64_t r = 0; r < rows; ++r) {
        std::copy_n(&x[(r * G + g) * in], in, &gx[r * in]);
      }
      LinearParams one = grouped;
      one.x = gx.data();
      one.w = codes.data() + g * out * in;
      one.w_row0 = g * out;
      one.groups = 1;
      one.y = gy.data();
      BOOST_REQUIRE(cpu::Linear(one) == OpStatus::kOk);
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t n = 0; n < out; ++n) {
          const float a = want[(r * G + g) * out + n], b = gy[r * out + n];
          BOOST_TEST((codecs::Bits(a) == codecs::Bits(b) || (std::isnan(a) && std::isnan(b))),
                     "cpu group " << g << " row " << r << " column " << n);
        }
      }
    }
    Dev<float> dx(x), dy(std::vector<float>(want.size(), -2.0f));
    Dev<uint8_t> dcodes(codes), dscales(scales);
    p.x = dx.get();
    p.w = dcodes.get();
    p.w_scales = dscales.get();
    p.y = dy.get();
    BOOST_REQUIRE(gpu::Linear(p) == OpStatus::kOk);
    const std::vector<float> got = dy.Host();
    int64_t nans = 0, wrong = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      if (std::isnan(want[i])) ++nans;
      if (codecs::Bits(got[i]) != codecs::Bits(want[i]) &&
          !(std::isnan(got[i]) && std::isnan(want[i]))) {
        if (++wrong <= 5) {
          BOOST_TEST_MESSAGE("value " << i << ": " << got[i] << ", want " << want[i]);
        }
      }
    }
    BOOST_TEST(wrong == 0, "groups " << G << " rows " << rows << " in " << in << " out " << out);
    BOOST_TEST(nans > 0);                                  // Some columns hold a NaN code,
    BOOST_TEST(nans < static_cast<int64_t>(want.size()));  // not all.
  }
  // One group is all other formats take; groups count from one.
  const std::vector<float> x(64, 1.0f);
  std::vector<float> y(4);
  std::vector<uint8_t> codes(4 * 64, 0x38), scales(4 * 2, 127);
  LinearParams bad{.x = x.data(),
                   .rows = 1,
                   .in = 32,
                   .out = 2,
                   .format = WeightFormat::kFp8,
                   .w = codes.data(),
                   .w_scales = scales.data(),
                   .x_codes = codes.data(),
                   .x_scales = scales.data(),
                   .y = y.data(),
                   .groups = 2};
  BOOST_TEST((cpu::Linear(bad) == OpStatus::kBadArgument));
  BOOST_TEST((gpu::Linear(bad) == OpStatus::kBadArgument));
  bad.format = WeightFormat::kFp8Dense;
  bad.groups = 0;
  BOOST_TEST((cpu::Linear(bad) == OpStatus::kBadShape));
  BOOST_TEST((gpu::Linear(bad) == OpStatus::kBadShape));
}

// wo_a on matrix cores (LinearMatrix with kFp8Dense: the BF16 instruction, two a K-block, over
// BF16 activations) against the CPU's exact sums: each output within the rounding of its block
// sums, NaN where the CPU has NaN, and every row's bits the same whatever rows are beside it
// (1, 3, 64, 70 and 129 rows: one 64-token tile, a part, two and a part, three); groups side by
// side, a slice of a larger matrix whose scales start inside a tile, K of one partial chunk (96:
// three blocks), many chunks (2,080: 65 blocks) and whole ones (256), 45, 64 and 130 columns.
// Each instruction the backend has (mma.sync's, the warpgroup's, which takes mma.sync's here,
// and AMD's, with tiles of 32 tokens an instruction); where mma.sync's and AMD's are both
// stand-ins, the same bits with either (each block's two halves summed in K order, then added),
// so the 32 x 32 layout pairs every product as the 16 x 8 one does.
void Fp8ValuesCases(gpu::MatrixInstruction ins, std::vector<std::vector<float>>* results);

BOOST_AUTO_TEST_CASE(fp8_values_on_matrix_cores_within_rounding_and_the_same_for_any_rows) {
  std::vector<std::vector<float>> mma, mfma;
  Fp8ValuesCases(gpu::MatrixInstruction::kMma, &mma);
  if (kBackend != "hip") {  // The warpgroup instruction is NVIDIA's and the CPU runtime's.
    BOOST_TEST_CONTEXT("instruction wgmma") {
      Fp8ValuesCases(gpu::MatrixInstruction::kWgmma, nullptr);
    }
  }
  if (kBackend == "cuda") {
    BOOST_TEST_MESSAGE("AMD's instruction's path is AMD's and the CPU runtime's");
  } else {
    BOOST_TEST_CONTEXT("instruction mfma") { Fp8ValuesCases(gpu::MatrixInstruction::kMfma, &mfma); }
    if (!gpu::MatrixMfmaNative() && !gpu::MatrixCoresNative()) {
      BOOST_REQUIRE(mma.size() == mfma.size());
      for (size_t i = 0; i < mma.size(); ++i) {
        BOOST_TEST(BitEqual(mma[i], mfma[i]), "result " << i << ": mfma's bits are not mma's");
      }
    }
  }
  // K in whole blocks, no gated pair; AMD's instruction only where it is built.
  Dev<float> dx(std::vector<float>(64, 1.0f)), dy(std::vector<float>(4));
  Dev<uint8_t> dw(std::vector<uint8_t>(4 * 64, 0x38)), ds(std::vector<uint8_t>(4, 127));
  LinearParams p{.x = dx.get(),
                 .rows = 1,
                 .in = 64,
                 .out = 2,
                 .format = WeightFormat::kFp8Dense,
                 .w = dw.get(),
                 .w_scales = ds.get(),
                 .y = dy.get()};
  BOOST_TEST((gpu::LinearMatrix(p) == OpStatus::kOk));
  BOOST_TEST(dy.Host()[0] == 64.0f);  // 64 products of 1 x 1.
  BOOST_TEST((gpu::LinearMatrix(p, gpu::MatrixInstruction::kMfma) ==
              (kBackend == "cuda" ? OpStatus::kBadArgument : OpStatus::kOk)));
  p.in = 40;
  BOOST_TEST((gpu::LinearMatrix(p) == OpStatus::kBadShape));
  p.in = 64;
  p.up = dw.get();
  BOOST_TEST((gpu::LinearMatrix(p) == OpStatus::kBadArgument));
}

// The cases above for one instruction; each call's outputs appended to `results` where given.
void Fp8ValuesCases(gpu::MatrixInstruction ins, std::vector<std::vector<float>>* results) {
  std::mt19937 rng(67);
  struct Shape {
    int64_t groups, in, out, row0;
  };
  for (const Shape& sh : {Shape{3, 96, 45, 0}, Shape{2, 2080, 130, 0}, Shape{8, 256, 64, 0},
                          Shape{1, 1056, 45, 40}}) {
    const int64_t G = sh.groups, in = sh.in, out = sh.out, all_rows = sh.row0 + G * out;
    // Each 32x32 tile a different power of two, so a misplaced scale changes values.
    std::vector<float> w = Normal(rng, all_rows * in, 0.2f);
    for (int64_t r = 0; r < all_rows; ++r) {
      for (int64_t k = 0; k < in; ++k)
        w[r * in + k] *= std::ldexp(1.0f, int(r / 32 + (k / 32) % 3));
    }
    flashd::testing::QuantizedWeights qw =
        flashd::testing::QuantizeWeights(WeightFormat::kFp8, w, all_rows, in);
    qw.codes[(sh.row0 + 5) * in + 7] = 0x7F;  // A NaN code in column 5 (of group 0).
    std::vector<float> values(all_rows * in);
    flashd::kernels::cpu::DequantizeFp8Weight(qw.codes.data(), qw.scales.data(), all_rows, in,
                                              values.data());
    const int64_t most = 129;
    std::vector<float> x = Normal(rng, most * G * in);
    for (float& v : x) v = codecs::RoundBf16(v);  // wo_a's inputs are BF16 values.
    Dev<uint8_t> dcodes(qw.codes), dscales(qw.scales);
    Dev<float> dx(x);
    std::vector<std::vector<float>> got;
    int64_t differ = 0;
    for (int64_t rows : {int64_t{1}, int64_t{3}, int64_t{64}, int64_t{70}, most}) {
      std::vector<float> want(rows * G * out);
      LinearParams p{.x = x.data(),
                     .rows = rows,
                     .in = in,
                     .out = out,
                     .format = WeightFormat::kFp8Dense,
                     .w = qw.codes.data() + sh.row0 * in,
                     .w_scales = qw.scales.data(),
                     .y = want.data(),
                     .w_row0 = sh.row0,
                     .groups = G};
      BOOST_REQUIRE(cpu::Linear(p) == OpStatus::kOk);
      Dev<float> dy(std::vector<float>(want.size(), 7.0f));
      p.x = dx.get();
      p.w = dcodes.get() + sh.row0 * in;
      p.w_scales = dscales.get();
      p.y = dy.get();
      BOOST_REQUIRE(gpu::LinearMatrixTakes(p));
      BOOST_REQUIRE(gpu::LinearMatrix(p, ins) == OpStatus::kOk);
      got.push_back(dy.Host());
      if (results != nullptr) results->push_back(got.back());
      const std::vector<float>& y = got.back();
      int64_t off = 0, nan_mismatch = 0, nans = 0;
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t g = 0; g < G; ++g) {
          for (int64_t n = 0; n < out; ++n) {
            const size_t i = static_cast<size_t>((r * G + g) * out + n);
            const float a = y[i], b = want[i];
            if (std::isnan(a) || std::isnan(b)) {
              nan_mismatch += std::isnan(a) != std::isnan(b);
              nans += std::isnan(b);
              continue;
            }
            differ += a != b;
            double magnitude = 0;  // The products' magnitudes, in double.
            const float* wr = &values[(sh.row0 + g * out + n) * in];
            for (int64_t k = 0; k < in; ++k) {
              magnitude += std::fabs(double(wr[k]) * x[(r * G + g) * in + k]);
            }
            off += std::fabs(double(a) - b) > 1e-4 * magnitude + 1e-30;
          }
        }
      }
      BOOST_TEST(off == 0, "groups " << G << " in " << in << " out " << out << " rows " << rows
                                     << ": " << off << " outputs off");
      BOOST_TEST(nan_mismatch == 0, "rows " << rows << ": NaN where the CPU has none or back");
      BOOST_TEST(nans == rows);  // Column 5 of group 0, every row.
    }
    BOOST_TEST_MESSAGE("groups " << G << " in " << in << ": " << differ
                                 << " outputs differ from the CPU's bits");
    // Every row's bits the same in each call (a call's rows are the first of the largest's).
    for (size_t i = 0; i + 1 < got.size(); ++i) {
      const std::vector<float> head(got.back().begin(), got.back().begin() + got[i].size());
      BOOST_TEST(BitEqual(got[i], head), "groups " << G << " in " << in << ": rows "
                                                   << got[i].size() / (G * out) << " against "
                                                   << most);
    }
  }
}

// BF16 matrices kept as BF16 codes (how the GPU backend holds them) give the fp32 path's results,
// for the dense GEMM and the embedding, on both sides.
BOOST_AUTO_TEST_CASE(bf16_weights_equal_their_fp32_values) {
  std::mt19937 rng(8);
  const int64_t in = 45, out = 31;
  std::vector<float> w = Normal(rng, out * in, 0.2f);
  std::vector<uint16_t> codes(w.size());
  for (size_t i = 0; i < w.size(); ++i) {
    codes[i] = flashd::kernels::codecs::FloatToBf16(w[i]);
    w[i] = flashd::kernels::codecs::Bf16ToFloat(codes[i]);
  }
  // The GEMMs at the embedding's shape, and at one of several K chunks (1,030 values: four
  // whole, a part and a K % 4 tail) and three column tiles; one row's at three of its chunks,
  // read four values a load (4,100) and one by one with a tail (4,099), with a column pair cut.
  for (const auto& [in_, out_] :
       {std::pair<int64_t, int64_t>{in, out}, {1030, 70}, {4100, 5}, {4099, 3}}) {
    const int64_t gin = in_, gout = out_;
    std::vector<float> gw = Normal(rng, gout * gin, 0.2f);
    std::vector<uint16_t> gcodes(gw.size());
    for (size_t i = 0; i < gw.size(); ++i) {
      gcodes[i] = flashd::kernels::codecs::FloatToBf16(gw[i]);
      gw[i] = flashd::kernels::codecs::Bf16ToFloat(gcodes[i]);
    }
    const auto* code_bytes = reinterpret_cast<const uint8_t*>(gcodes.data());
    for (int64_t rows : kRows) {
      std::vector<float> x = Normal(rng, rows * gin), want(rows * gout), cpu_bf16(rows * gout);
      BOOST_REQUIRE(cpu::Linear({.x = x.data(),
                                 .rows = rows,
                                 .in = gin,
                                 .out = gout,
                                 .format = WeightFormat::kDense,
                                 .dense = gw.data(),
                                 .y = want.data()}) == OpStatus::kOk);
      BOOST_REQUIRE(cpu::Linear({.x = x.data(),
                                 .rows = rows,
                                 .in = gin,
                                 .out = gout,
                                 .format = WeightFormat::kBf16,
                                 .w = code_bytes,
                                 .y = cpu_bf16.data()}) == OpStatus::kOk);
      BOOST_TEST(BitEqual(cpu_bf16, want), "rows " << rows);
      Dev<float> dx(x), dy(std::vector<float>(want.size())), dyf(std::vector<float>(want.size()));
      Dev<uint16_t> dw(gcodes);
      Dev<float> dwf(gw);
      BOOST_REQUIRE(gpu::Linear({.x = dx.get(),
                                 .rows = rows,
                                 .in = gin,
                                 .out = gout,
                                 .format = WeightFormat::kBf16,
                                 .w = reinterpret_cast<const uint8_t*>(dw.get()),
                                 .y = dy.get()}) == OpStatus::kOk);
      BOOST_TEST(BitEqual(dy.Host(), want), "in " << gin << " rows " << rows);
      BOOST_REQUIRE(gpu::Linear({.x = dx.get(),
                                 .rows = rows,
                                 .in = gin,
                                 .out = gout,
                                 .format = WeightFormat::kDense,
                                 .dense = dwf.get(),
                                 .y = dyf.get()}) == OpStatus::kOk);
      BOOST_TEST(BitEqual(dyf.Host(), want), "fp32, in " << gin << " rows " << rows);
    }
  }
  // The embedding: rows of the table as fp32 values or as BF16 codes.
  const int64_t vocab = 31, dim = 45, hc = 2;
  const std::vector<int32_t> tokens = {30, 0, 7};
  std::vector<float> want(tokens.size() * hc * dim), got(want.size());
  BOOST_REQUIRE(cpu::Embed({.tokens = tokens.data(),
                            .count = 3,
                            .hc = hc,
                            .dim = dim,
                            .vocab = vocab,
                            .embed = w.data(),
                            .X = want.data()}) == OpStatus::kOk);
  BOOST_REQUIRE(cpu::Embed({.tokens = tokens.data(),
                            .count = 3,
                            .hc = hc,
                            .dim = dim,
                            .vocab = vocab,
                            .embed_bf16 = codes.data(),
                            .X = got.data()}) == OpStatus::kOk);
  BOOST_TEST(BitEqual(got, want));
  Dev<uint16_t> dtable(codes);
  Dev<int32_t> dtok(tokens);
  Dev<float> dX(std::vector<float>(want.size()));
  BOOST_REQUIRE(gpu::Embed({.tokens = dtok.get(),
                            .count = 3,
                            .hc = hc,
                            .dim = dim,
                            .vocab = vocab,
                            .embed_bf16 = dtable.get(),
                            .X = dX.get()}) == OpStatus::kOk);
  BOOST_TEST(BitEqual(dX.Host(), want));
  // One table, not two.
  BOOST_TEST((cpu::Embed({.tokens = tokens.data(),
                          .count = 3,
                          .hc = hc,
                          .dim = dim,
                          .vocab = vocab,
                          .embed = w.data(),
                          .embed_bf16 = codes.data(),
                          .X = got.data()}) == OpStatus::kBadArgument));
}

BOOST_AUTO_TEST_CASE(round_add_and_combine_are_bit_equal) {
  std::mt19937 rng(1);
  std::normal_distribution<float> d(0.0f, 50.0f);
  std::vector<float> x(1000), y(1000);
  for (float& v : x) v = d(rng);
  for (float& v : y) v = d(rng);
  x[0] = std::nanf("");
  std::vector<float> want = x;
  cpu::RoundBf16({.x = want.data(), .n = 1000});
  Dev<float> dx(x);
  BOOST_REQUIRE(gpu::RoundBf16({.x = dx.get(), .n = 1000}) == OpStatus::kOk);
  const std::vector<float> got = dx.Host();
  BOOST_TEST(std::isnan(got[0]));
  BOOST_TEST(std::memcmp(got.data() + 1, want.data() + 1, 999 * 4) == 0);
  // Scaled between two roundings.
  std::vector<float> scaled = x;
  cpu::RoundBf16({.x = scaled.data(), .n = 1000, .scale = 0.0883883f});
  Dev<float> dscaled(x);
  BOOST_REQUIRE(gpu::RoundBf16({.x = dscaled.get(), .n = 1000, .scale = 0.0883883f}) ==
                OpStatus::kOk);
  const std::vector<float> gscaled = dscaled.Host();
  BOOST_TEST(std::memcmp(gscaled.data() + 1, scaled.data() + 1, 999 * 4) == 0);
  std::vector<float> sum(1000);
  cpu::AddRound({.a = x.data() + 0, .b = y.data(), .n = 1000, .out = sum.data()});
  Dev<float> a(x), b(y), out(std::vector<float>(1000));
  BOOST_REQUIRE(gpu::AddRound({.a = a.get(), .b = b.get(), .n = 1000, .out = out.get()}) ==
                OpStatus::kOk);
  const std::vector<float> gsum = out.Host();
  BOOST_TEST(std::memcmp(gsum.data() + 1, sum.data() + 1, 999 * 4) == 0);
  // Combine: rows repeat, so the order of additions matters; it is kept.
  const int64_t dim = 37;
  std::vector<float> eo = Normal(rng, 9 * dim), acc = Normal(rng, 4 * dim), cacc = acc;
  const std::vector<int64_t> rows = {3, 0, 3, 1, 3, 2, 0, 3, 1};
  cpu::MoeCombine(
      {.expert_out = eo.data(), .rows = rows.data(), .count = 9, .dim = dim, .y = cacc.data()});
  Dev<float> deo(eo), dacc(acc);
  Dev<int64_t> drows(rows);
  BOOST_REQUIRE(gpu::MoeCombine({.expert_out = deo.get(),
                                 .rows = drows.get(),
                                 .count = 9,
                                 .dim = dim,
                                 .y = dacc.get()}) == OpStatus::kOk);
  BOOST_TEST(BitEqual(dacc.Host(), cacc));
  // Many entries through the bins (the workspace starting as garbage): rows of up to six entries
  // (a token's experts), rows of none, and rows of more than the bins hold (their whole list
  // taken in order), over a row wider than a thread block. The same adds in the same order.
  {
    const int64_t y_rows = 100, count = 300, wide = 300;
    std::vector<int64_t> many(count);
    std::uniform_int_distribution<int64_t> row(0, 89);  // Rows 90-99 get none.
    for (int64_t i = 0; i < count; ++i) many[i] = i % 10 == 0 ? 7 : row(rng);  // Row 7: 30 or more.
    // Values of full precision (BF16 values' sums of a few would be exact in any order).
    std::normal_distribution<float> full(0.0f, 1.0f);
    std::vector<float> meo(count * wide), my(y_rows * wide);
    for (float& v : meo) v = full(rng);
    for (float& v : my) v = full(rng);
    const std::vector<float> y0 = my;
    std::vector<float> cy = my;
    cpu::MoeCombine({.expert_out = meo.data(),
                     .rows = many.data(),
                     .count = count,
                     .dim = wide,
                     .y = cy.data(),
                     .y_rows = y_rows});
    Dev<float> dmeo(meo), dmy(my);
    Dev<int64_t> dmany(many);
    MoeCombineParams mp{.expert_out = dmeo.get(),
                        .rows = dmany.get(),
                        .count = count,
                        .dim = wide,
                        .y = dmy.get(),
                        .y_rows = y_rows};
    const int64_t ints = gpu::MoeCombineWorkspaceInts(mp);
    BOOST_TEST(ints > 0);
    Dev<int32_t> dwork(std::vector<int32_t>(ints, 12345));
    mp.workspace = dwork.get();
    mp.workspace_ints = ints;
    BOOST_REQUIRE(gpu::MoeCombine(mp) == OpStatus::kOk);
    BOOST_TEST(BitEqual(dmy.Host(), cy));
    // The order shows: the entries added last to first give other bits.
    std::vector<float> reversed = y0;
    for (int64_t i = count - 1; i >= 0; --i) {
      for (int64_t d = 0; d < wide; ++d) reversed[many[i] * wide + d] += meo[i * wide + d];
    }
    BOOST_TEST(!BitEqual(reversed, cy));
  }
  // The combine with the shared expert's output added (MoeCombineParams::add): the combine then
  // an AddRound over every row, rows no entry names too; the few entries' kernel and the bins',
  // and no entries at all.
  for (const int64_t count : {int64_t{0}, int64_t{9}, int64_t{300}}) {
    const int64_t y_rows = count == 300 ? 100 : 5, wide = count == 300 ? 300 : 37;
    std::vector<int64_t> at(count);
    std::uniform_int_distribution<int64_t> row(0, y_rows - 2);  // The last row gets none.
    for (int64_t& r : at) r = row(rng);
    std::normal_distribution<float> full(0.0f, 1.0f);
    std::vector<float> eo2(count * wide), y2(y_rows * wide), add(y2.size());
    for (float& v : eo2) v = full(rng);
    for (float& v : y2) v = full(rng);
    for (float& v : add) v = full(rng);
    std::vector<float> want_y = y2, want(y2.size());
    cpu::MoeCombine({.expert_out = eo2.data(),
                     .rows = at.data(),
                     .count = count,
                     .dim = wide,
                     .y = want_y.data(),
                     .y_rows = y_rows});
    cpu::AddRound({.a = want_y.data(), .b = add.data(), .n = y_rows * wide, .out = want.data()});
    std::vector<float> cy2 = y2, cout(y2.size());
    BOOST_REQUIRE(cpu::MoeCombine({.expert_out = eo2.data(),
                                   .rows = at.data(),
                                   .count = count,
                                   .dim = wide,
                                   .y = cy2.data(),
                                   .y_rows = y_rows,
                                   .add = add.data(),
                                   .out = cout.data()}) == OpStatus::kOk);
    BOOST_TEST((BitEqual(cy2, want_y) && BitEqual(cout, want)), "cpu, count " << count);
    Dev<float> deo2(eo2), dy2(y2), dadd(add), dout(std::vector<float>(y2.size()));
    Dev<int64_t> dat(at);
    MoeCombineParams mp{.expert_out = deo2.get(),
                        .rows = dat.get(),
                        .count = count,
                        .dim = wide,
                        .y = dy2.get(),
                        .y_rows = y_rows,
                        .add = dadd.get(),
                        .out = dout.get()};
    const int64_t ints = gpu::MoeCombineWorkspaceInts(mp);
    Dev<int32_t> dwork(std::vector<int32_t>(std::max<int64_t>(ints, 1), 12345));
    mp.workspace = ints > 0 ? dwork.get() : nullptr;
    mp.workspace_ints = ints;
    BOOST_REQUIRE(gpu::MoeCombine(mp) == OpStatus::kOk);
    BOOST_TEST(BitEqual(dy2.Host(), want_y), "device y, count " << count);
    BOOST_TEST(BitEqual(dout.Host(), want), "device out, count " << count);
  }
  // `add` needs the rows of y and an output.
  float v = 0;
  const int64_t none = 0;
  BOOST_TEST((cpu::MoeCombine({.rows = &none, .dim = 1, .y = &v, .add = &v, .out = &v}) ==
              OpStatus::kBadShape));
  BOOST_TEST((gpu::MoeCombine({.rows = &none, .dim = 1, .y = &v, .add = &v, .out = &v}) ==
              OpStatus::kBadShape));
}

// Row copies: a strided block and a gather of repeated, unordered rows, bit for bit the CPU's,
// the bytes between dst's rows untouched.
BOOST_AUTO_TEST_CASE(copy_rows_is_the_cpu_copy) {
  std::mt19937 rng(14);
  const int64_t cols = 300, src_stride = 311, dst_stride = 305;
  const std::vector<float> src = Normal(rng, 13 * src_stride);
  for (bool gather : {false, true}) {
    const std::vector<int64_t> index = {12, 0, 5, 5, 11, 3, 12};
    const int64_t rows = gather ? 7 : 13;
    std::vector<float> want(rows * dst_stride, -3.0f);
    CopyRowsParams p{.src = src.data(),
                     .src_stride = src_stride,
                     .index = gather ? index.data() : nullptr,
                     .rows = rows,
                     .cols = cols,
                     .dst = want.data(),
                     .dst_stride = dst_stride};
    BOOST_REQUIRE(cpu::CopyRows(p) == OpStatus::kOk);
    Dev<float> dsrc(src), ddst(std::vector<float>(want.size(), -3.0f));
    Dev<int64_t> dindex(index);
    p.src = dsrc.get();
    p.index = gather ? dindex.get() : nullptr;
    p.dst = ddst.get();
    BOOST_REQUIRE(gpu::CopyRows(p) == OpStatus::kOk);
    BOOST_TEST(BitEqual(ddst.Host(), want));
  }
}

BOOST_AUTO_TEST_CASE(fake_quantizers_are_bit_equal) {
  std::mt19937 rng(2);
  const FakeQuantFormat formats[] = {FakeQuantFormat::kFp8E8M0, FakeQuantFormat::kFp4E8M0,
                                     FakeQuantFormat::kFp4E4M3};
  for (FakeQuantFormat f : formats) {
    const int64_t block = f == FakeQuantFormat::kFp4E4M3 ? 16 : 32;
    std::vector<float> x = Normal(rng, 257 * block, 4.0f);
    for (int64_t i = 0; i < block; ++i) x[i] = 0.0f;  // An all-zero block.
    x[block + 3] = 1e-30f;                            // Tiny values.
    std::vector<float> want = x;
    cpu::FakeQuant(
        {.x = want.data(), .n = static_cast<int64_t>(x.size()), .block = block, .format = f});
    Dev<float> dx(x);
    BOOST_REQUIRE(
        gpu::FakeQuant(
            {.x = dx.get(), .n = static_cast<int64_t>(x.size()), .block = block, .format = f}) ==
        OpStatus::kOk);
    BOOST_TEST(BitEqual(dx.Host(), want), "format " << static_cast<int>(f));
  }
}

BOOST_AUTO_TEST_CASE(swiglu_and_embed_bit_equal) {
  std::mt19937 rng(3);
  for (int64_t rows : kRows) {
    const int64_t inter = 45;
    std::vector<float> g = Normal(rng, rows * inter, 4.0f), u = Normal(rng, rows * inter, 4.0f);
    std::vector<float> w = Normal(rng, rows), want(g.size());
    g[0] = std::numeric_limits<float>::quiet_NaN();  // Stays NaN under the limit's clamp.
    for (float limit : {0.0f, 3.0f}) {
      cpu::Swiglu({.gate = g.data(),
                   .up = u.data(),
                   .rows = rows,
                   .inter = inter,
                   .row_weights = w.data(),
                   .limit = limit,
                   .h = want.data()});
      Dev<float> dg(g), du(u), dw(w), dh(std::vector<float>(g.size()));
      BOOST_REQUIRE(gpu::Swiglu({.gate = dg.get(),
                                 .up = du.get(),
                                 .rows = rows,
                                 .inter = inter,
                                 .row_weights = dw.get(),
                                 .limit = limit,
                                 .h = dh.get()}) == OpStatus::kOk);
      std::vector<float> got = dh.Host();
      BOOST_TEST((std::isnan(want[0]) && std::isnan(got[0])), "limit " << limit);
      got[0] = want[0];  // NaN's bits may differ between a device and the CPU.
      BOOST_TEST(BitEqual(got, want), "rows " << rows);
    }
  }
  const int64_t vocab = 20, dim = 24, hc = 4;
  std::vector<float> table = Normal(rng, vocab * dim);
  const std::vector<int32_t> tokens = {19, 0, 7, 7, 3};
  std::vector<float> want(tokens.size() * hc * dim);
  cpu::Embed({.tokens = tokens.data(),
              .count = 5,
              .hc = hc,
              .dim = dim,
              .vocab = vocab,
              .embed = table.data(),
              .X = want.data()});
  Dev<float> dt(table), dX(std::vector<float>(want.size()));
  Dev<int32_t> dtok(tokens);
  BOOST_REQUIRE(gpu::Embed({.tokens = dtok.get(),
                            .count = 5,
                            .hc = hc,
                            .dim = dim,
                            .vocab = vocab,
                            .embed = dt.get(),
                            .X = dX.get()}) == OpStatus::kOk);
  BOOST_TEST(BitEqual(dX.Host(), want));
}

BOOST_AUTO_TEST_CASE(rms_norm_and_rope_bit_equal) {
  std::mt19937 rng(4);
  for (int64_t rows : kRows) {
    for (int64_t dim : {7, 96, 1000}) {
      const int64_t stride = dim + 5;
      std::vector<float> x = Normal(rng, rows * stride, 3.0f), w = Normal(rng, dim);
      for (bool round_input : {false, true}) {
        std::vector<float> want = x;
        cpu::RmsNorm({.x = want.data(),
                      .rows = rows,
                      .dim = dim,
                      .stride = stride,
                      .weight = w.data(),
                      .eps = 1e-6f,
                      .round_input = round_input});
        Dev<float> dx(x), dw(w);
        BOOST_REQUIRE(gpu::RmsNorm({.x = dx.get(),
                                    .rows = rows,
                                    .dim = dim,
                                    .stride = stride,
                                    .weight = dw.get(),
                                    .eps = 1e-6f,
                                    .round_input = round_input}) == OpStatus::kOk);
        BOOST_TEST(BitEqual(dx.Host(), want), "rows " << rows << " dim " << dim);
      }
    }
    const int64_t heads = 3, head_dim = 64, rope_dim = 32, stride = heads * head_dim;
    std::vector<float> freqs(rope_dim / 2);
    cpu::RopeFrequencies(rope_dim, 65536, 160000.0, 16, 32, 1, freqs.data());
    std::vector<float> x = Normal(rng, rows * stride);
    std::vector<int64_t> pos(rows);
    std::uniform_int_distribution<int64_t> p(0, 1 << 20);
    for (int64_t& v : pos) v = p(rng);
    for (bool inverse : {false, true}) {
      std::vector<float> want = x;
      cpu::Rope({.x = want.data(),
                 .rows = rows,
                 .heads = heads,
                 .head_dim = head_dim,
                 .rope_dim = rope_dim,
                 .row_stride = stride,
                 .positions = pos.data(),
                 .freqs = freqs.data(),
                 .inverse = inverse});
      Dev<float> dx(x), df(freqs);
      Dev<int64_t> dp(pos);
      BOOST_REQUIRE(gpu::Rope({.x = dx.get(),
                               .rows = rows,
                               .heads = heads,
                               .head_dim = head_dim,
                               .rope_dim = rope_dim,
                               .row_stride = stride,
                               .positions = dp.get(),
                               .freqs = df.get(),
                               .inverse = inverse}) == OpStatus::kOk);
      BOOST_TEST(BitEqual(dx.Host(), want), "rope rows " << rows);
    }
  }
}

// A Rope with its fake quantizer after it (RopeParams::fake_quant_block: the indexer's queries)
// is the Rope op, then a FakeQuant op of each head, bit for bit: the CPU's op and the device's
// (one launch) at 1 to 257 rows, heads of 64 values with 16 rotated and of 128 with 64, every
// format, blocks of 32 and 16, rows packed and apart (the gap between them untouched), forward
// and inverse. A block that does not divide a head refused alike, nothing written.
BOOST_AUTO_TEST_CASE(rope_then_fake_quant_is_the_two_ops) {
  std::mt19937 rng(47);
  struct Shape {
    int64_t heads, head_dim, rope_dim, block, gap;
  };
  for (const Shape& sh :
       {Shape{3, 64, 16, 32, 0}, Shape{2, 128, 64, 32, 7}, Shape{4, 64, 64, 16, 0}}) {
    std::vector<float> freqs(sh.rope_dim / 2);
    cpu::RopeFrequencies(sh.rope_dim, 65536, 160000.0, 16, 32, 1, freqs.data());
    Dev<float> df(freqs);
    const int64_t stride = sh.heads * sh.head_dim + sh.gap;
    for (const int64_t rows : {int64_t{1}, int64_t{3}, int64_t{257}}) {
      const std::vector<float> x = Normal(rng, rows * stride, 4.0f);
      std::vector<int64_t> pos(rows);
      for (int64_t r = 0; r < rows; ++r) pos[r] = 11 * r + 5000;
      Dev<int64_t> dp(pos);
      for (const FakeQuantFormat format :
           {FakeQuantFormat::kFp8E8M0, FakeQuantFormat::kFp4E8M0, FakeQuantFormat::kFp4E4M3}) {
        for (const bool inverse : {false, true}) {
          BOOST_TEST_CONTEXT("heads " << sh.heads << " x " << sh.head_dim << " rows " << rows
                                      << " format " << static_cast<int>(format) << " inverse "
                                      << inverse) {
            const auto rope = [&](float* xx, const int64_t* positions, const float* f) {
              return RopeParams{.x = xx,
                                .rows = rows,
                                .heads = sh.heads,
                                .head_dim = sh.head_dim,
                                .rope_dim = sh.rope_dim,
                                .row_stride = stride,
                                .positions = positions,
                                .freqs = f,
                                .inverse = inverse};
            };
            // The two ops.
            std::vector<float> want = x;
            BOOST_REQUIRE(cpu::Rope(rope(want.data(), pos.data(), freqs.data())) == OpStatus::kOk);
            for (int64_t r = 0; r < rows; ++r) {
              for (int64_t h = 0; h < sh.heads; ++h) {
                BOOST_REQUIRE(cpu::FakeQuant({.x = &want[r * stride + h * sh.head_dim],
                                              .n = sh.head_dim,
                                              .block = sh.block,
                                              .format = format}) == OpStatus::kOk);
              }
            }
            std::vector<float> got = x;
            RopeParams p = rope(got.data(), pos.data(), freqs.data());
            p.fake_quant_block = sh.block, p.fake_quant_format = format;
            BOOST_REQUIRE(cpu::Rope(p) == OpStatus::kOk);
            BOOST_TEST(BitEqual(got, want), "cpu");
            Dev<float> dx(x);
            RopeParams d = rope(dx.get(), dp.get(), df.get());
            d.fake_quant_block = sh.block, d.fake_quant_format = format;
            const uint64_t at = gpu::KernelLaunches();
            BOOST_REQUIRE(gpu::Rope(d) == OpStatus::kOk);
            BOOST_TEST(gpu::KernelLaunches() - at == 1u);
            BOOST_TEST(BitEqual(dx.Host(), want), "device");
          }
        }
      }
    }
  }
  // Blocks of 24 in heads of 64.
  std::vector<float> x(128, 1.0f), freqs(8, 0.5f);
  const std::vector<int64_t> pos = {3};
  const RopeParams p{.x = x.data(),
                     .rows = 1,
                     .heads = 2,
                     .head_dim = 64,
                     .rope_dim = 16,
                     .row_stride = 128,
                     .positions = pos.data(),
                     .freqs = freqs.data(),
                     .fake_quant_block = 24};
  BOOST_TEST((cpu::Rope(p) == OpStatus::kBadShape));
  BOOST_TEST((gpu::Rope(p) == OpStatus::kBadShape));  // Refused before any device use.
  BOOST_TEST(std::all_of(x.begin(), x.end(), [](float v) { return v == 1.0f; }));
}

// The mixes in HcMixParams' lanes-and-tree order on both sides: widths under one round of lanes,
// whole rounds with a part (4,400 = 17 x 256 + 48), and the released 20,480; the model's 4 copies
// and others (the split a thread per value), and 16 (more values than threads: one thread).
BOOST_AUTO_TEST_CASE(hc_mix_bit_equal) {
  std::mt19937 rng(10);
  struct Shape {
    int64_t dim, rows, hc;
  };
  for (const auto& [dim, rows, hc] :
       {Shape{40, 1, 4}, Shape{40, 3, 4}, Shape{40, 257, 4}, Shape{1100, 1, 4}, Shape{1100, 5, 4},
        Shape{5120, 2, 4}, Shape{40, 3, 3}, Shape{1100, 2, 2}, Shape{40, 2, 16}}) {
    const int64_t mix = (2 + hc) * hc;
    std::vector<float> X = Normal(rng, rows * hc * dim), fn = Normal(rng, mix * hc * dim, 0.05f);
    std::vector<float> scale = {0.7f, 1.3f, 0.9f}, base = Normal(rng, mix, 0.5f);
    std::vector<float> mixes(rows * mix), pre(rows * hc), post(rows * hc), comb(rows * hc * hc);
    cpu::HcMix({.X = X.data(),
                .rows = rows,
                .hc = hc,
                .dim = dim,
                .fn = fn.data(),
                .scale = scale.data(),
                .base = base.data(),
                .iters = 20,
                .hc_eps = 1e-6f,
                .norm_eps = 1e-6f,
                .mixes = mixes.data(),
                .pre = pre.data(),
                .post = post.data(),
                .comb = comb.data()});
    Dev<float> dX(X), dfn(fn), dsc(scale), dba(base), dmx(mixes), dpre(pre), dpost(post),
        dcomb(comb);
    BOOST_REQUIRE(gpu::HcMix({.X = dX.get(),
                              .rows = rows,
                              .hc = hc,
                              .dim = dim,
                              .fn = dfn.get(),
                              .scale = dsc.get(),
                              .base = dba.get(),
                              .iters = 20,
                              .hc_eps = 1e-6f,
                              .norm_eps = 1e-6f,
                              .mixes = dmx.get(),
                              .pre = dpre.get(),
                              .post = dpost.get(),
                              .comb = dcomb.get()}) == OpStatus::kOk);
    BOOST_TEST(BitEqual(dmx.Host(), mixes));
    BOOST_TEST(BitEqual(dpre.Host(), pre));
    BOOST_TEST(BitEqual(dpost.Host(), post));
    BOOST_TEST(BitEqual(dcomb.Host(), comb));
  }
}

// HcMix with its steps either side (the expansion before the mixes, the collapse after) is
// HcExpand, HcCollapse and HcMix in turn, bit for bit, on both sides: on the device through the
// fused kernel (one launch, its counts left zero) for up to kHcFusedRows rows and without its
// workspace through a kernel a step; with each step alone and both, the collapse normed or not;
// pre, post and comb written over the inputs they may alias (the engine's post and comb, and here
// pre over the collapse's weights).
// The collapse's codes (HcMixParams::x_codes, HcCollapseParams::codes) are its rows quantized as
// a Linear quantizes its x: on the CPU and the device, in the fused kernel and a kernel a step,
// normed or not, the collapse itself unchanged.
BOOST_AUTO_TEST_CASE(collapse_codes_are_its_rows_quantized) {
  std::mt19937 rng(43);
  const int64_t hc = 4, mix = (2 + hc) * hc, over = gpu::kHcFusedRows + 1;
  for (const auto& [dim, rows] :
       {std::pair<int64_t, int64_t>{64, 1}, {5120, 1}, {96, 3}, {64, over}}) {
    const std::vector<float> X = Normal(rng, rows * hc * dim),
                             fn = Normal(rng, mix * hc * dim, 0.05f);
    const std::vector<float> scale = {0.7f, 1.3f, 0.9f}, base = Normal(rng, mix, 0.5f);
    const std::vector<float> weights = Normal(rng, rows * hc), norm = Normal(rng, dim);
    for (const bool normed : {false, true}) {
      BOOST_TEST_CONTEXT("dim " << dim << " rows " << rows << " normed " << normed) {
        std::vector<float> x(rows * dim);
        HcCollapseParams c{.X = X.data(),
                           .weights = weights.data(),
                           .rows = rows,
                           .hc = hc,
                           .dim = dim,
                           .norm_weight = normed ? norm.data() : nullptr,
                           .eps = 1e-6f,
                           .x = x.data()};
        BOOST_REQUIRE(cpu::HcCollapse(c) == OpStatus::kOk);
        std::vector<uint8_t> codes(rows * dim), scales(rows * dim / 32);
        for (int64_t r = 0; r < rows; ++r) {
          cpu::QuantizeFp8PerBlock(&x[r * dim], dim, 32, &codes[r * dim], &scales[r * dim / 32]);
        }
        // HcCollapse with codes, both sides.
        std::vector<float> cx(rows * dim);
        std::vector<uint8_t> cc(codes.size(), 0xAA), cs(scales.size(), 0xAA);
        HcCollapseParams q = c;
        q.x = cx.data(), q.codes = cc.data(), q.code_scales = cs.data();
        BOOST_REQUIRE(cpu::HcCollapse(q) == OpStatus::kOk);
        BOOST_TEST((BitEqual(cx, x) && cc == codes && cs == scales));
        Dev<float> dX(X), dw(weights), dn(norm), dx(std::vector<float>(rows * dim));
        Dev<uint8_t> dc(std::vector<uint8_t>(codes.size(), 0xAA));
        Dev<uint8_t> ds(std::vector<uint8_t>(scales.size(), 0xAA));
        q.X = dX.get(), q.weights = dw.get(), q.norm_weight = normed ? dn.get() : nullptr;
        q.x = dx.get(), q.codes = dc.get(), q.code_scales = ds.get();
        BOOST_REQUIRE(gpu::HcCollapse(q) == OpStatus::kOk);
        BOOST_TEST((BitEqual(dx.Host(), x) && dc.Host() == codes && ds.Host() == scales));
        // HcMix's collapse with codes: the CPU's, then the device's fused and apart.
        std::vector<float> mixes(rows * mix), pre(rows * hc), post(rows * hc), comb(rows * hc * hc);
        HcMixParams m{.X = X.data(),
                      .rows = rows,
                      .hc = hc,
                      .dim = dim,
                      .fn = fn.data(),
                      .scale = scale.data(),
                      .base = base.data(),
                      .iters = 20,
                      .hc_eps = 1e-6f,
                      .norm_eps = 1e-6f,
                      .mixes = mixes.data(),
                      .pre = pre.data(),
                      .post = post.data(),
                      .comb = comb.data(),
                      .collapse_weights = weights.data(),
                      .collapse_norm = normed ? norm.data() : nullptr,
                      .collapse_eps = 1e-6f,
                      .x = cx.data(),
                      .x_codes = cc.data(),
                      .x_code_scales = cs.data()};
        std::fill(cc.begin(), cc.end(), 0xAA);
        std::fill(cs.begin(), cs.end(), 0xAA);
        BOOST_REQUIRE(cpu::HcMix(m) == OpStatus::kOk);
        BOOST_TEST((BitEqual(cx, x) && cc == codes && cs == scales));
        for (const bool with_workspace : {false, true}) {
          Dev<float> dfn(fn), dsc(scale), dba(base), dmx(mixes), dpre(pre), dpost(post),
              dcomb(comb), dmx2(std::vector<float>(rows * mix));
          Dev<float> dx2(std::vector<float>(rows * dim));
          Dev<uint8_t> dc2(std::vector<uint8_t>(codes.size(), 0xAA));
          Dev<uint8_t> ds2(std::vector<uint8_t>(scales.size(), 0xAA));
          Dev<unsigned> arrivals(std::vector<unsigned>(rows, 0u));
          Dev<double> sums{std::vector<double>(rows)};
          const gpu::HcMixFused fused{.arrivals = arrivals.get(), .sums = sums.get()};
          HcMixParams d = m;
          d.X = dX.get(), d.fn = dfn.get(), d.scale = dsc.get(), d.base = dba.get();
          d.mixes = dmx2.get(), d.pre = dpre.get(), d.post = dpost.get(), d.comb = dcomb.get();
          d.collapse_weights = dw.get(), d.collapse_norm = normed ? dn.get() : nullptr;
          d.x = dx2.get(), d.x_codes = dc2.get(), d.x_code_scales = ds2.get();
          BOOST_REQUIRE(gpu::HcMix(d, with_workspace ? &fused : nullptr) == OpStatus::kOk);
          BOOST_TEST((BitEqual(dx2.Host(), x) && dc2.Host() == codes && ds2.Host() == scales),
                     "workspace " << with_workspace);
        }
      }
    }
  }
  // Codes without their scales or without x, or of rows not in whole 32-blocks: refused alike.
  std::vector<float> v(4 * 40 * 4 + 64);
  std::vector<uint8_t> b(64);
  HcMixParams ok{.X = v.data(),
                 .rows = 1,
                 .hc = 4,
                 .dim = 40,
                 .fn = v.data(),
                 .scale = v.data(),
                 .base = v.data(),
                 .iters = 1,
                 .mixes = v.data(),
                 .pre = v.data(),
                 .post = v.data(),
                 .comb = v.data(),
                 .collapse_weights = v.data(),
                 .x = v.data()};
  HcMixParams no_scales = ok, no_x = ok, odd = ok;
  no_scales.x_codes = b.data();
  no_x.x = nullptr, no_x.x_codes = b.data(), no_x.x_code_scales = b.data();
  odd.x_codes = b.data(), odd.x_code_scales = b.data();
  for (const auto& [p, want] : {std::pair{no_scales, OpStatus::kBadArgument},
                                {no_x, OpStatus::kBadShape},
                                {odd, OpStatus::kBadShape}}) {
    BOOST_TEST((cpu::HcMix(p) == want));
    BOOST_TEST((gpu::HcMix(p, nullptr) == want));
  }
}

BOOST_AUTO_TEST_CASE(hc_steps_in_one_op_are_the_three_ops) {
  std::mt19937 rng(31);
  struct Shape {
    int64_t dim, rows, hc;
  };
  const int64_t over = gpu::kHcFusedRows + 1;
  for (const auto& [dim, rows, hc] :
       {Shape{40, 1, 4}, Shape{40, 3, 4}, Shape{1100, 2, 4}, Shape{5120, 1, 4}, Shape{40, over, 4},
        Shape{40, 2, 2}, Shape{40, 2, 16}}) {
    const int64_t mix = (2 + hc) * hc;
    const std::vector<float> X = Normal(rng, rows * hc * dim),
                             fn = Normal(rng, mix * hc * dim, 0.05f);
    const std::vector<float> scale = {0.7f, 1.3f, 0.9f}, base = Normal(rng, mix, 0.5f);
    const std::vector<float> sub = Normal(rng, rows * dim), post0 = Normal(rng, rows * hc);
    const std::vector<float> comb0 = Normal(rng, rows * hc * hc), weights = Normal(rng, rows * hc);
    const std::vector<float> norm = Normal(rng, dim);
    for (const bool expand : {false, true}) {
      for (const int collapse : {0, 1, 2}) {  // None, plain, normed.
        // The CPU's three ops in turn.
        std::vector<float> expanded(X.size()), x(rows * dim), mixes(rows * mix);
        std::vector<float> pre(rows * hc), post(rows * hc), comb(rows * hc * hc);
        const float* stream = X.data();
        if (expand) {
          BOOST_REQUIRE(cpu::HcExpand({.X = X.data(),
                                       .sub = sub.data(),
                                       .post = post0.data(),
                                       .comb = comb0.data(),
                                       .rows = rows,
                                       .hc = hc,
                                       .dim = dim,
                                       .out = expanded.data()}) == OpStatus::kOk);
          stream = expanded.data();
        }
        if (collapse > 0) {
          BOOST_REQUIRE(cpu::HcCollapse({.X = stream,
                                         .weights = weights.data(),
                                         .rows = rows,
                                         .hc = hc,
                                         .dim = dim,
                                         .norm_weight = collapse == 2 ? norm.data() : nullptr,
                                         .eps = 1e-6f,
                                         .x = x.data()}) == OpStatus::kOk);
        }
        HcMixParams want{.X = stream,
                         .rows = rows,
                         .hc = hc,
                         .dim = dim,
                         .fn = fn.data(),
                         .scale = scale.data(),
                         .base = base.data(),
                         .iters = 20,
                         .hc_eps = 1e-6f,
                         .norm_eps = 1e-6f,
                         .mixes = mixes.data(),
                         .pre = pre.data(),
                         .post = post.data(),
                         .comb = comb.data()};
        BOOST_REQUIRE(cpu::HcMix(want) == OpStatus::kOk);
        // One op: the CPU's, and the device's with and without the fused kernel's workspace.
        // pre starts as the collapse's weights, post and comb as the expansion's.
        const auto params = [&](const float* dX, const float* dfn, const float* dsc,
                                const float* dba, const float* dsub, const float* dnorm,
                                float* dexp, float* dx, float* dmx, float* dpre, float* dpost,
                                float* dcomb) {
          HcMixParams p = want;
          p.X = dX;
          p.fn = dfn;
          p.scale = dsc;
          p.base = dba;
          p.mixes = dmx;
          p.pre = dpre;
          p.post = dpost;
          p.comb = dcomb;
          if (expand) {
            p.sub = dsub;
            p.expand_post = dpost;
            p.expand_comb = dcomb;
            p.expanded = dexp;
          }
          if (collapse > 0) {
            p.collapse_weights = dpre;
            p.collapse_norm = collapse == 2 ? dnorm : nullptr;
            p.collapse_eps = 1e-6f;
            p.x = dx;
          }
          return p;
        };
        const std::string what = "dim " + std::to_string(dim) + " rows " + std::to_string(rows) +
                                 " hc " + std::to_string(hc) + " expand " + std::to_string(expand) +
                                 " collapse " + std::to_string(collapse);
        {
          std::vector<float> e(X.size()), cx(rows * dim), cm(rows * mix),
              cpre = weights, cpost = post0, ccomb = comb0;
          BOOST_REQUIRE(cpu::HcMix(params(X.data(), fn.data(), scale.data(), base.data(),
                                          sub.data(), norm.data(), e.data(), cx.data(), cm.data(),
                                          cpre.data(), cpost.data(), ccomb.data())) ==
                        OpStatus::kOk);
          if (expand) BOOST_TEST(BitEqual(e, expanded), "cpu " << what);
          if (collapse > 0) BOOST_TEST(BitEqual(cx, x), "cpu " << what);
          BOOST_TEST((BitEqual(cm, mixes) && BitEqual(cpre, pre) && BitEqual(cpost, post) &&
                      BitEqual(ccomb, comb)),
                     "cpu " << what);
        }
        for (const bool with_workspace : {false, true}) {
          Dev<float> dX(X), dfn(fn), dsc(scale), dba(base), dsub(sub), dnorm(norm);
          Dev<float> dexp(std::vector<float>(X.size())), dx(std::vector<float>(rows * dim));
          Dev<float> dmx(std::vector<float>(rows * mix)), dpre(weights), dpost(post0), dcomb(comb0);
          Dev<unsigned> arrivals(std::vector<unsigned>(rows, 0u));
          Dev<double> sums{std::vector<double>(rows)};
          const gpu::HcMixFused fused{.arrivals = arrivals.get(), .sums = sums.get()};
          const uint64_t launches = gpu::KernelLaunches();
          BOOST_REQUIRE(gpu::HcMix(params(dX.get(), dfn.get(), dsc.get(), dba.get(), dsub.get(),
                                          dnorm.get(), dexp.get(), dx.get(), dmx.get(), dpre.get(),
                                          dpost.get(), dcomb.get()),
                                   with_workspace ? &fused : nullptr) == OpStatus::kOk);
          const bool one = with_workspace && rows <= gpu::kHcFusedRows;
          const uint64_t apart = 2 + (expand ? 1 : 0) + (collapse > 0 ? 1 : 0);
          BOOST_TEST(gpu::KernelLaunches() - launches == (one ? 1 : apart), what);
          const std::string on = (one ? "fused " : "apart ") + what;
          if (expand) BOOST_TEST(BitEqual(dexp.Host(), expanded), on);
          if (collapse > 0) BOOST_TEST(BitEqual(dx.Host(), x), on);
          BOOST_TEST(BitEqual(dmx.Host(), mixes), on);
          BOOST_TEST(BitEqual(dpre.Host(), pre), on);
          BOOST_TEST(BitEqual(dpost.Host(), post), on);
          BOOST_TEST(BitEqual(dcomb.Host(), comb), on);
          const std::vector<unsigned> left = arrivals.Host();
          BOOST_TEST((std::count(left.begin(), left.end(), 0u) == rows), on);
        }
      }
    }
  }
  // The expansion may not write over X, and a step needs its inputs.
  std::vector<float> v(4 * 8), w(v.size());
  const HcMixParams base{.X = v.data(), .rows = 1, .hc = 2, .dim = 2, .iters = 1};
  std::vector<std::pair<HcMixParams, OpStatus>> bad(3, {base, OpStatus::kBadArgument});
  bad[0].first.sub = v.data(), bad[0].first.expand_post = v.data();
  bad[0].first.expand_comb = v.data(), bad[0].first.expanded = v.data();
  bad[0].second = OpStatus::kBadShape;
  bad[1].first.sub = v.data(), bad[1].first.expanded = w.data();  // No post or comb.
  bad[2].first.x = w.data();                                      // No collapse weights.
  for (const auto& [p, want] : bad) {
    BOOST_TEST((cpu::HcMix(p) == want));
    BOOST_TEST((gpu::HcMix(p) == want));
  }
}

// Several sequences pooled in one call (sequence_rows, kv_partials, score_partials): each
// sequence's rows at positions of its own, into its own partial groups, one sequence without rows;
// the pooled rows, in row order, and every partial group equal those of a call a sequence, on the
// CPU and the device.
BOOST_AUTO_TEST_CASE(compressor_pool_of_several_sequences_bit_equal) {
  std::mt19937 rng(17);
  const int64_t dim = 160;  // Two thread blocks of dimensions.
  for (const int64_t ratio : {2, 4}) {
    const std::vector<int64_t> counts = {1, 7, 0, 3, 12}, starts = {3, 10, 40, 0, 21};
    const int64_t S = static_cast<int64_t>(counts.size());
    std::vector<int64_t> sequence_rows = {0}, pos;
    for (int64_t s = 0; s < S; ++s) {
      sequence_rows.push_back(sequence_rows.back() + counts[s]);
      for (int64_t t = 0; t < counts[s]; ++t) pos.push_back(starts[s] + t);
    }
    const int64_t rows = sequence_rows.back();
    const std::vector<float> kv = Normal(rng, rows * dim), score = Normal(rng, rows * dim);
    std::vector<std::vector<float>> kp, sp;
    for (int64_t s = 0; s < S; ++s) {
      kp.push_back(Normal(rng, ratio * dim));
      sp.push_back(Normal(rng, ratio * dim));
    }
    // A call a sequence: the pooled rows one sequence after another, and each partial group.
    std::vector<float> want;
    std::vector<std::vector<float>> want_kp = kp, want_sp = sp;
    for (int64_t s = 0; s < S; ++s) {
      std::vector<float> pooled(counts[s] * dim, 0.0f);
      const int64_t r0 = sequence_rows[s];
      BOOST_REQUIRE(cpu::CompressPool({.kv = &kv[r0 * dim],
                                       .score = &score[r0 * dim],
                                       .rows = counts[s],
                                       .dim = dim,
                                       .ratio = ratio,
                                       .positions = &pos[r0],
                                       .kv_partial = want_kp[s].data(),
                                       .score_partial = want_sp[s].data(),
                                       .pooled = pooled.data()}) == OpStatus::kOk);
      int64_t done = 0;
      for (int64_t t = r0; t < r0 + counts[s]; ++t) done += (pos[t] + 1) % ratio == 0 ? 1 : 0;
      want.insert(want.end(), pooled.begin(), pooled.begin() + done * dim);
    }
    BOOST_TEST(!want.empty());
    // All in one call on the CPU.
    std::vector<std::vector<float>> got_kp = kp, got_sp = sp;
    std::vector<float*> kps, sps;
    for (int64_t s = 0; s < S; ++s)
      kps.push_back(got_kp[s].data()), sps.push_back(got_sp[s].data());
    std::vector<float> got(want.size() + dim, -1.0f);
    CompressPoolParams all{.kv = kv.data(),
                           .score = score.data(),
                           .rows = rows,
                           .dim = dim,
                           .ratio = ratio,
                           .positions = pos.data(),
                           .pooled = got.data(),
                           .sequence_rows = sequence_rows.data(),
                           .kv_partials = kps.data(),
                           .score_partials = sps.data(),
                           .sequence_count = S};
    BOOST_REQUIRE(cpu::CompressPool(all) == OpStatus::kOk);
    got.resize(want.size());
    BOOST_TEST(BitEqual(got, want), "CPU, ratio " << ratio);
    for (int64_t s = 0; s < S; ++s) {
      BOOST_TEST(BitEqual(got_kp[s], want_kp[s]), "CPU, sequence " << s);
      BOOST_TEST(BitEqual(got_sp[s], want_sp[s]), "CPU, sequence " << s);
    }
    // Row offsets that do not cover the rows: refused.
    {
      CompressPoolParams bad = all;
      std::vector<int64_t> short_rows = sequence_rows;
      short_rows.back() -= 1;
      bad.sequence_rows = short_rows.data();
      BOOST_TEST((cpu::CompressPool(bad) == OpStatus::kBadShape));
    }
    // On the device.
    std::vector<std::unique_ptr<Dev<float>>> dkp, dsp;
    std::vector<float*> dkps, dsps;
    for (int64_t s = 0; s < S; ++s) {
      dkp.push_back(std::make_unique<Dev<float>>(kp[s]));
      dsp.push_back(std::make_unique<Dev<float>>(sp[s]));
      dkps.push_back(dkp.back()->get());
      dsps.push_back(dsp.back()->get());
    }
    Dev<float> dkv(kv), dsc(score), dpooled(std::vector<float>(want.size(), -1.0f));
    Dev<int64_t> dpos(pos), drows(sequence_rows);
    Dev<float*> dkpt(dkps), dspt(dsps);
    CompressPoolParams on = all;
    on.kv = dkv.get();
    on.score = dsc.get();
    on.positions = dpos.get();
    on.pooled = dpooled.get();
    on.sequence_rows = drows.get();
    on.kv_partials = dkpt.get();
    on.score_partials = dspt.get();
    BOOST_REQUIRE(gpu::CompressPool(on) == OpStatus::kOk);
    BOOST_TEST(BitEqual(dpooled.Host(), want), "device, ratio " << ratio);
    for (int64_t s = 0; s < S; ++s) {
      BOOST_TEST(BitEqual(dkp[s]->Host(), want_kp[s]), "device, sequence " << s);
      BOOST_TEST(BitEqual(dsp[s]->Host(), want_sp[s]), "device, sequence " << s);
    }
  }
}

BOOST_AUTO_TEST_CASE(compressor_pool_and_row_write) {
  std::mt19937 rng(11);
  const int64_t dim = 64;
  for (int64_t ratio : {2, 4}) {
    for (int64_t rows : kRows) {
      std::vector<float> kv = Normal(rng, rows * dim), score = Normal(rng, rows * dim);
      std::vector<int64_t> pos(rows);
      for (int64_t t = 0; t < rows; ++t) pos[t] = 5 + t;  // Starts inside a group.
      std::vector<float> kp = Normal(rng, ratio * dim), sp = Normal(rng, ratio * dim);
      std::vector<float> pooled(rows * dim, 0.0f), ckp = kp, csp = sp;
      cpu::CompressPool({.kv = kv.data(),
                         .score = score.data(),
                         .rows = rows,
                         .dim = dim,
                         .ratio = ratio,
                         .positions = pos.data(),
                         .kv_partial = ckp.data(),
                         .score_partial = csp.data(),
                         .pooled = pooled.data()});
      Dev<float> dkv(kv), dsc(score), dkp(kp), dsp(sp), dpooled(std::vector<float>(pooled.size()));
      Dev<int64_t> dpos(pos);
      BOOST_REQUIRE(gpu::CompressPool({.kv = dkv.get(),
                                       .score = dsc.get(),
                                       .rows = rows,
                                       .dim = dim,
                                       .ratio = ratio,
                                       .positions = dpos.get(),
                                       .kv_partial = dkp.get(),
                                       .score_partial = dsp.get(),
                                       .pooled = dpooled.get()}) == OpStatus::kOk);
      BOOST_TEST(BitEqual(dpooled.Host(), pooled), "ratio " << ratio << " rows " << rows);
      BOOST_TEST(BitEqual(dkp.Host(), ckp));
      BOOST_TEST(BitEqual(dsp.Host(), csp));
    }
  }
  // Row write into a pool of 3 blocks of 8 rows: KV codes, KV scales, key codes, key scales.
  const int64_t hd = 64, idd = 32, per = 8, groups = 13;
  const size_t kc = 0, ks = per * hd / 2, qc = ks + per * hd / 16, qs = qc + per * idd / 2;
  const size_t bytes = qs + per * idd / 32;
  std::vector<float> freqs(8);
  cpu::RopeFrequencies(16, 0, 10000.0, 1, 0, 0, freqs.data());
  for (int64_t rope_dim : {0, 16}) {
    std::vector<float> latent = Normal(rng, groups * hd), key = Normal(rng, groups * idd);
    std::vector<int64_t> gpos(groups), rows(groups);
    for (int64_t g = 0; g < groups; ++g) {
      gpos[g] = 4 * g;
      rows[g] = g % 5 == 2 ? -1 : (g * 7) % (3 * per);
    }
    Blocks blocks;
    blocks.host.assign(3, std::vector<uint8_t>(bytes, 0xAB));
    blocks.Upload();
    std::vector<std::vector<uint8_t>>& host = blocks.host;
    uint8_t* const* host_table = blocks.host_table.data();
    uint8_t* const* dev_table = blocks.dev_table->get();
    auto region = [&](uint8_t* const* table, size_t offset, size_t row_bytes) {
      return PagedRows{table, per, offset, row_bytes};
    };
    std::vector<float> cl = latent, ck = key;
    cpu::CompressWrite({.latent = cl.data(),
                        .key = ck.data(),
                        .groups = groups,
                        .head_dim = hd,
                        .index_dim = idd,
                        .rope_dim = rope_dim,
                        .positions = gpos.data(),
                        .freqs = freqs.data(),
                        .rows = rows.data(),
                        .kv_codes = region(host_table, kc, hd / 2),
                        .kv_scales = region(host_table, ks, hd / 16),
                        .key_codes = region(host_table, qc, idd / 2),
                        .key_scales = region(host_table, qs, idd / 32)});
    Dev<float> dl(latent), dk(key), df(freqs);
    Dev<int64_t> dp(gpos), dr(rows);
    BOOST_REQUIRE(gpu::CompressWrite({.latent = dl.get(),
                                      .key = dk.get(),
                                      .groups = groups,
                                      .head_dim = hd,
                                      .index_dim = idd,
                                      .rope_dim = rope_dim,
                                      .positions = dp.get(),
                                      .freqs = df.get(),
                                      .rows = dr.get(),
                                      .kv_codes = region(dev_table, kc, hd / 2),
                                      .kv_scales = region(dev_table, ks, hd / 16),
                                      .key_codes = region(dev_table, qc, idd / 2),
                                      .key_scales = region(dev_table, qs, idd / 32)}) ==
                  OpStatus::kOk);
    size_t differ = 0, total = 0;
    for (size_t b = 0; b < host.size(); ++b) {
      const std::vector<uint8_t> got = blocks.dev[b]->Host();
      for (size_t i = 0; i < bytes; ++i) differ += got[i] != host[b][i];
      total += bytes;
    }
    BOOST_TEST(differ == 0u, differ << " of " << total << " bytes differ");
  }
}

// `count` blocks of `per` index keys each (FP4 codes, then UE8M0 scales per 32), on the host and
// the device.
Blocks IndexKeyBlocks(std::mt19937& rng, int64_t dim, int64_t per, int64_t count) {
  Blocks blocks;
  blocks.host.assign(count, std::vector<uint8_t>(per * (dim / 2 + dim / 32)));
  for (auto& b : blocks.host) {
    for (int64_t r = 0; r < per; ++r) {
      std::vector<float> k = Normal(rng, dim, 2.0f);
      cpu::QuantizeFp4E8M0(k.data(), dim, 32, b.data() + r * dim / 2,
                           b.data() + per * dim / 2 + r * dim / 32);
    }
  }
  blocks.Upload();
  return blocks;
}

// Index scores, bit-equal: keys decoded exactly, the same lanes and roundings; then the
// candidate filter's mask.
BOOST_AUTO_TEST_CASE(indexer_scores_and_candidates_bit_equal) {
  std::mt19937 rng(12);
  const int64_t heads = 3, dim = 64, per = 16, nblocks = 6;
  Blocks blocks = IndexKeyBlocks(rng, dim, per, nblocks);
  uint8_t* const* host_table = blocks.host_table.data();
  uint8_t* const* dev_table = blocks.dev_table->get();
  const std::vector<int32_t> table = {4, 2, 0, 2, 5, 1};
  Dev<int32_t> dtab(table);
  const int64_t stride = 90;
  for (int64_t tokens : kRows) {
    std::vector<float> q = Normal(rng, tokens * heads * dim), w = Normal(rng, tokens * heads);
    cpu::FakeQuant({.x = q.data(),
                    .n = static_cast<int64_t>(q.size()),
                    .block = 32,
                    .format = FakeQuantFormat::kFp4E8M0});
    std::vector<int64_t> visible(tokens);
    std::uniform_int_distribution<int64_t> vis(0, stride);
    for (int64_t& v : visible) v = vis(rng);
    std::vector<uint8_t> mask(tokens * stride);
    for (size_t i = 0; i < mask.size(); ++i) mask[i] = (i * 7) % 3 != 0;
    std::vector<float> want(tokens * stride);
    IndexerScoreParams params{.q = q.data(),
                              .weights = w.data(),
                              .tokens = tokens,
                              .heads = heads,
                              .dim = dim,
                              .visible = visible.data(),
                              .block_table = table.data(),
                              .key_codes = {host_table, per, 0, static_cast<size_t>(dim / 2)},
                              .key_scales = {host_table, per, static_cast<size_t>(per * dim / 2),
                                             static_cast<size_t>(dim / 32)},
                              .mask = mask.data(),
                              .stride = stride,
                              .scores = want.data()};
    BOOST_REQUIRE(cpu::IndexerScoresRef(params) == OpStatus::kOk);
    Dev<float> dq(q), dw(w), dscores(std::vector<float>(want.size()));
    Dev<int64_t> dvis(visible);
    Dev<uint8_t> dmask(mask);
    params.q = dq.get();
    params.weights = dw.get();
    params.visible = dvis.get();
    params.block_table = dtab.get();
    params.key_codes.blocks = dev_table;
    params.key_scales.blocks = dev_table;
    params.mask = dmask.get();
    params.scores = dscores.get();
    BOOST_REQUIRE(gpu::IndexerScores(params) == OpStatus::kOk);
    BOOST_TEST(BitEqual(dscores.Host(), want), "tokens " << tokens);
    // The candidate filter over these scores.
    const int64_t block = 4, top = 3, nb = (stride + block - 1) / block;
    std::vector<float> bs(tokens * nb);
    std::vector<int64_t> bt(tokens * top);
    std::vector<uint8_t> cmask(tokens * stride);
    cpu::CandidateFilter({.scores = want.data(),
                          .tokens = tokens,
                          .stride = stride,
                          .block = block,
                          .top_blocks = top,
                          .visible = visible.data(),
                          .block_scores = bs.data(),
                          .block_top = bt.data(),
                          .mask = cmask.data()});
    Dev<float> dbs(bs);
    Dev<int64_t> dbt(bt);
    Dev<uint8_t> dcmask(std::vector<uint8_t>(cmask.size(), 9));
    BOOST_REQUIRE(gpu::CandidateFilter({.scores = dscores.get(),
                                        .tokens = tokens,
                                        .stride = stride,
                                        .block = block,
                                        .top_blocks = top,
                                        .visible = dvis.get(),
                                        .block_scores = dbs.get(),
                                        .block_top = dbt.get(),
                                        .mask = dcmask.get()}) == OpStatus::kOk);
    BOOST_TEST((dcmask.Host() == cmask));
  }
}

BOOST_AUTO_TEST_CASE(hc_collapse_and_expand) {
  std::mt19937 rng(5);
  const int64_t hc = 4;
  // Copies of full precision at 600 (a thread's several values of the norm's lanes; the copies'
  // order shows) and of BF16 values at 40.
  std::normal_distribution<float> full(0.0f, 1.0f);
  for (const auto& [dim, rows] :
       {std::pair{int64_t{40}, int64_t{1}}, std::pair{int64_t{40}, int64_t{3}},
        std::pair{int64_t{40}, int64_t{257}}, std::pair{int64_t{600}, int64_t{1}},
        std::pair{int64_t{600}, int64_t{5}}}) {
    std::vector<float> X = Normal(rng, rows * hc * dim), w = Normal(rng, rows * hc);
    if (dim > 256) {
      for (float& v : X) v = full(rng);
      for (float& v : w) v = full(rng);
    }
    std::vector<float> norm = Normal(rng, dim);
    for (bool with_norm : {false, true}) {
      std::vector<float> want(rows * dim);
      cpu::HcCollapse({.X = X.data(),
                       .weights = w.data(),
                       .rows = rows,
                       .hc = hc,
                       .dim = dim,
                       .norm_weight = with_norm ? norm.data() : nullptr,
                       .eps = 1e-6f,
                       .x = want.data()});
      Dev<float> dX(X), dw(w), dn(norm), dx(std::vector<float>(want.size()));
      BOOST_REQUIRE(gpu::HcCollapse({.X = dX.get(),
                                     .weights = dw.get(),
                                     .rows = rows,
                                     .hc = hc,
                                     .dim = dim,
                                     .norm_weight = with_norm ? dn.get() : nullptr,
                                     .eps = 1e-6f,
                                     .x = dx.get()}) == OpStatus::kOk);
      const std::vector<float> got = dx.Host();
      BOOST_TEST(BitEqual(got, want), "rows " << rows << " dim " << dim << " norm " << with_norm);
    }
    std::vector<float> sub = Normal(rng, rows * dim), post = Normal(rng, rows * hc);
    std::vector<float> comb = Normal(rng, rows * hc * hc), want(X.size());
    cpu::HcExpand({.X = X.data(),
                   .sub = sub.data(),
                   .post = post.data(),
                   .comb = comb.data(),
                   .rows = rows,
                   .hc = hc,
                   .dim = dim,
                   .out = want.data()});
    Dev<float> dX(X), ds(sub), dp(post), dc(comb), dout(std::vector<float>(X.size()));
    BOOST_REQUIRE(gpu::HcExpand({.X = dX.get(),
                                 .sub = ds.get(),
                                 .post = dp.get(),
                                 .comb = dc.get(),
                                 .rows = rows,
                                 .hc = hc,
                                 .dim = dim,
                                 .out = dout.get()}) == OpStatus::kOk);
    BOOST_TEST(BitEqual(dout.Host(), want), "expand rows " << rows);
  }
}

BOOST_AUTO_TEST_CASE(engram_gather_and_gate_bit_equal) {
  std::mt19937 rng(7);
  const int64_t table_rows = 40, hd = 32, columns = 3, stride = 6, hc = 4, dim = 24;
  std::vector<float> t = Normal(rng, table_rows * hd, 3.0f);
  std::vector<uint8_t> codes(t.size()), scales(t.size() / 32);
  cpu::QuantizeFp8PerBlock(t.data(), t.size(), 32, codes.data(), scales.data());
  std::uniform_int_distribution<int64_t> row(0, table_rows - 1);
  for (int64_t tokens : kRows) {
    std::vector<int64_t> ids(tokens * stride);
    for (int64_t& id : ids) id = row(rng);
    std::vector<float> want(tokens * columns * hd);
    cpu::EngramGather({.table = codes.data(),
                       .table_scales = scales.data(),
                       .row_ids = ids.data(),
                       .tokens = tokens,
                       .columns = columns,
                       .head_dim = hd,
                       .row_stride = stride,
                       .column0 = 3,
                       .out = want.data()});
    Dev<uint8_t> dc(codes), ds(scales);
    Dev<int64_t> di(ids);
    Dev<float> dout(std::vector<float>(want.size()));
    BOOST_REQUIRE(gpu::EngramGather({.table = dc.get(),
                                     .table_scales = ds.get(),
                                     .row_ids = di.get(),
                                     .tokens = tokens,
                                     .columns = columns,
                                     .head_dim = hd,
                                     .row_stride = stride,
                                     .column0 = 3,
                                     .out = dout.get()}) == OpStatus::kOk);
    BOOST_TEST(BitEqual(dout.Host(), want));
    std::vector<float> X = Normal(rng, tokens * hc * dim),
                       kv = Normal(rng, tokens * (hc + 1) * dim);
    std::vector<float> qk = Normal(rng, hc * dim), gate_want = X;
    cpu::EngramGate({.X = gate_want.data(),
                     .kv = kv.data(),
                     .qk = qk.data(),
                     .tokens = tokens,
                     .hc = hc,
                     .dim = dim,
                     .eps = 1e-6f});
    Dev<float> dX(X), dkv(kv), dqk(qk);
    BOOST_REQUIRE(gpu::EngramGate({.X = dX.get(),
                                   .kv = dkv.get(),
                                   .qk = dqk.get(),
                                   .tokens = tokens,
                                   .hc = hc,
                                   .dim = dim,
                                   .eps = 1e-6f}) == OpStatus::kOk);
    BOOST_TEST(BitEqual(dX.Host(), gate_want));
  }
}

BOOST_AUTO_TEST_CASE(top_k_in_the_total_order_and_routing) {
  std::mt19937 rng(8);
  std::uniform_int_distribution<int> level(0, 5);
  const int64_t rows = 257, stride = 70, k = 8;
  std::vector<float> v(rows * stride);
  for (float& x : v) x = static_cast<float>(level(rng));  // Ties everywhere.
  v[5] = std::nanf("");
  std::vector<int64_t> n(rows);
  for (int64_t r = 0; r < rows; ++r) n[r] = r % 71;  // Including rows shorter than k.
  const auto [want, got] = TopKBoth(v, rows, stride, k, n);
  BOOST_TEST((got == want));
  // Ascending: the same picks in index order, the padding after, on both.
  const auto [up_want, up_got] = TopKBoth(v, rows, stride, k, n, true);
  BOOST_TEST((up_want == SortedPicks(want, k)));
  BOOST_TEST((up_got == up_want));
  BOOST_TEST((up_want != want));
  Dev<float> dv(v);
  Dev<int64_t> dn(n), dout(std::vector<int64_t>(rows * k));
  BOOST_TEST((gpu::TopK({.values = dv.get(),
                         .rows = rows,
                         .stride = stride,
                         .k = k,
                         .n = dn.get(),
                         .order = TopKOrder::kReference,
                         .out = dout.get()}) == OpStatus::kBadArgument));
  // Long rows and large k, as the indexer's: several radix passes over ties, both zeros,
  // infinities and NaNs; k beyond one entry per thread, and beyond what the threads order (one
  // thread then selects).
  {
    const int64_t long_rows = 3, long_stride = 6000;
    std::vector<float> lv(long_rows * long_stride);
    std::normal_distribution<float> d(0.0f, 1.0f);
    for (size_t i = 0; i < lv.size(); ++i) {
      lv[i] = i % 3 == 0 ? static_cast<float>(level(rng)) : d(rng);
    }
    for (size_t i = 7; i < lv.size(); i += 611) lv[i] = 0.0f;
    for (size_t i = 11; i < lv.size(); i += 613) lv[i] = -0.0f;
    for (size_t i = 13; i < lv.size(); i += 997) lv[i] = std::nanf("");
    lv[100] = INFINITY;
    lv[200] = -INFINITY;
    for (int64_t lk : {600, 5000}) {
      const auto [lwant, lgot] = TopKBoth(lv, long_rows, long_stride, lk, {long_stride, 4500, 100});
      BOOST_TEST((lgot == lwant), "k " << lk);
      const auto [up_want, up_got] =
          TopKBoth(lv, long_rows, long_stride, lk, {long_stride, 4500, 100}, true);
      BOOST_TEST((up_want == SortedPicks(lwant, lk)), "k " << lk);
      BOOST_TEST((up_got == up_want), "k " << lk);
    }
    // More picks than the device sorts in shared memory: refused, not cut short.
    Dev<float> dlv(lv);
    Dev<int64_t> dln(std::vector<int64_t>{long_stride, 4500, 100});
    Dev<int64_t> dlout(std::vector<int64_t>(long_rows * 5633));
    BOOST_TEST((gpu::TopK({.values = dlv.get(),
                           .rows = long_rows,
                           .stride = long_stride,
                           .k = 5633,
                           .n = dln.get(),
                           .out = dlout.get(),
                           .ascending = true}) == OpStatus::kBadShape));
  }
  const RouteScoring scorings[] = {RouteScoring::kSoftmax, RouteScoring::kSigmoid,
                                   RouteScoring::kSqrtSoftplus};
  // Few experts for many tokens, and the model's 384 experts (more than a thread block's threads).
  struct RouteShape {
    int64_t tokens, experts, top;
  };
  for (const RouteShape& shape : {RouteShape{257, 12, 3}, RouteShape{9, 384, 6}}) {
    for (RouteScoring sc : scorings) {
      const int64_t tokens = shape.tokens, experts = shape.experts, top = shape.top;
      std::vector<float> logits(tokens * experts), bias(experts);
      std::normal_distribution<float> d(0.0f, 2.0f);
      for (float& x : logits) x = d(rng);
      for (float& x : bias) x = d(rng);
      std::vector<float> s(logits.size()), b(logits.size()), w(tokens * top);
      std::vector<int64_t> chosen(tokens * top);
      // The op's params over host or device buffers.
      const auto params = [&](const float* l, const float* bi, float* sc_out, float* biased,
                              int64_t* ch, float* wt) {
        return MoeRouteParams{.logits = l,
                              .bias = bi,
                              .tokens = tokens,
                              .experts = experts,
                              .k = top,
                              .scoring = sc,
                              .norm_topk = true,
                              .scale = 2.5f,
                              .scores = sc_out,
                              .biased = biased,
                              .chosen = ch,
                              .weights = wt};
      };
      BOOST_REQUIRE(cpu::MoeRoute(params(logits.data(), bias.data(), s.data(), b.data(),
                                         chosen.data(), w.data())) == OpStatus::kOk);
      Dev<float> dl(logits), db(bias), dsc(s), dbi(b), dw(w);
      Dev<int64_t> dch(chosen);
      BOOST_REQUIRE(gpu::MoeRoute(params(dl.get(), db.get(), dsc.get(), dbi.get(), dch.get(),
                                         dw.get())) == OpStatus::kOk);
      BOOST_TEST((dch.Host() == chosen));
      BOOST_TEST(BitEqual(dsc.Host(), s));
      BOOST_TEST(BitEqual(dw.Host(), w));
    }
  }
}

// The route tests' MoeRouteParams (square-rooted softplus scores, the top k normalised).
MoeRouteParams RouteTestParams(int64_t tokens, int64_t experts, int64_t top, float scale,
                               const float* logits, const float* bias, float* scores, float* biased,
                               int64_t* chosen, float* weights) {
  return {.logits = logits,
          .bias = bias,
          .tokens = tokens,
          .experts = experts,
          .k = top,
          .scoring = RouteScoring::kSqrtSoftplus,
          .norm_topk = true,
          .scale = scale,
          .scores = scores,
          .biased = biased,
          .chosen = chosen,
          .weights = weights};
}

// MoeGroup's outputs on the device (the slots' experts starting as -7), and their check against
// the CPU's.
struct DeviceGrouped {
  int64_t slots;
  Dev<int64_t> expert, offset, tiles, rows;
  Dev<float> weights;
  explicit DeviceGrouped(const Grouped& like)
      : slots(static_cast<int64_t>(like.expert.size())),
        expert(std::vector<int64_t>(like.expert.size(), -7)),
        offset(std::vector<int64_t>(like.offset.size())),
        tiles(std::vector<int64_t>(like.tiles.size())),
        rows(std::vector<int64_t>(like.rows.size())),
        weights(std::vector<float>(like.weights.size())) {}
  MoeGroupParams Params() {
    return {.slots = slots,
            .slot_expert = expert.get(),
            .slot_offset = offset.get(),
            .slot_tiles = tiles.get(),
            .rows = rows.get(),
            .row_weights = weights.get()};
  }
  void Check(const Grouped& want) {
    BOOST_TEST(expert.Host() == want.expert, boost::test_tools::per_element());
    BOOST_TEST(offset.Host() == want.offset, boost::test_tools::per_element());
    BOOST_TEST(tiles.Host() == want.tiles, boost::test_tools::per_element());
    BOOST_TEST(rows.Host() == want.rows, boost::test_tools::per_element());
    BOOST_TEST(BitEqual(weights.Host(), want.weights));
  }
};

// MoeRoute with its grouping (MoeRouteParams::group) is MoeRoute then MoeGroup, bit for bit: the
// CPU's op, and the device's in one kernel where it has its counter (one launch, the counter
// left zero; the last thread block to finish groups the others' choices) and in two without;
// one token, a decode batch and more tokens than experts; a wrong slot count refused alike.
BOOST_AUTO_TEST_CASE(route_and_group_in_one_op_are_the_two_ops) {
  std::mt19937 rng(41);
  struct Shape {
    int64_t tokens, experts, top;
  };
  for (const Shape& shape : {Shape{1, 384, 6}, Shape{8, 384, 6}, Shape{70, 12, 3}}) {
    const int64_t tokens = shape.tokens, experts = shape.experts, top = shape.top;
    const int64_t total = tokens * top, slots = std::min(experts, total);
    std::vector<float> logits(tokens * experts), bias(experts);
    std::normal_distribution<float> d(0.0f, 2.0f);
    for (float& x : logits) x = d(rng);
    for (float& x : bias) x = d(rng);
    const auto params = [&](const float* l, const float* bi, float* sc, float* biased, int64_t* ch,
                            float* wt) {
      return RouteTestParams(tokens, experts, top, 1.5f, l, bi, sc, biased, ch, wt);
    };
    // The two CPU ops.
    std::vector<float> s(logits.size()), b(logits.size()), w(total);
    std::vector<int64_t> chosen(total);
    BOOST_REQUIRE(cpu::MoeRoute(params(logits.data(), bias.data(), s.data(), b.data(),
                                       chosen.data(), w.data())) == OpStatus::kOk);
    Grouped want(slots, total);
    BOOST_REQUIRE(cpu::MoeGroup(want.Params(chosen.data(), w.data(), tokens, experts, top)) ==
                  OpStatus::kOk);
    // The CPU's one op.
    {
      std::vector<float> s1(s.size()), b1(b.size()), w1(w.size());
      std::vector<int64_t> c1(chosen.size());
      Grouped got(slots, total);
      const MoeGroupParams g = got.Params(nullptr, nullptr, 0, 0, 0);
      MoeRouteParams p =
          params(logits.data(), bias.data(), s1.data(), b1.data(), c1.data(), w1.data());
      p.group = &g;
      BOOST_REQUIRE(cpu::MoeRoute(p) == OpStatus::kOk);
      BOOST_TEST((c1 == chosen && got.expert == want.expert && got.offset == want.offset &&
                  got.tiles == want.tiles && got.rows == want.rows));
      BOOST_TEST(BitEqual(got.weights, want.weights));
    }
    // The device's, with its counter and without.
    for (const bool counter : {true, false}) {
      BOOST_TEST_CONTEXT("tokens " << tokens << " experts " << experts << " counter " << counter) {
        Dev<float> dl(logits), db(bias), dsc(s), dbi(b), dw(std::vector<float>(w.size()));
        Dev<int64_t> dch(std::vector<int64_t>(chosen.size()));
        DeviceGrouped grouped(want);
        Dev<unsigned> arrivals(std::vector<unsigned>(1, 0u));
        const MoeGroupParams g = grouped.Params();
        MoeRouteParams p = params(dl.get(), db.get(), dsc.get(), dbi.get(), dch.get(), dw.get());
        p.group = &g;
        const uint64_t launches = gpu::KernelLaunches();
        BOOST_REQUIRE(gpu::MoeRoute(p, counter ? arrivals.get() : nullptr) == OpStatus::kOk);
        BOOST_TEST(gpu::KernelLaunches() - launches == (counter ? 1u : 2u));
        BOOST_TEST((dch.Host() == chosen));
        BOOST_TEST(BitEqual(dw.Host(), w));
        grouped.Check(want);
        BOOST_TEST(arrivals.Host()[0] == 0u);
      }
    }
    // A grouping whose slots are not min(experts, tokens x k).
    MoeGroupParams wrong = want.Params(nullptr, nullptr, 0, 0, 0);
    wrong.slots = slots + 1;
    MoeRouteParams p =
        params(logits.data(), bias.data(), s.data(), b.data(), chosen.data(), w.data());
    p.group = &wrong;
    BOOST_TEST((cpu::MoeRoute(p) == OpStatus::kBadShape));
    BOOST_TEST((gpu::MoeRoute(p) == OpStatus::kBadShape));
  }
}

// MoeRoute with its router (MoeRouteParams::router: the logits made in the op by a dense Linear)
// is the Linear op, then the routing (and its grouping where asked), bit for bit: the CPU's op,
// and the device's in one kernel at one token with the grouping and its counter (the logits'
// GEMV, whose last thread block routes and groups; the counter left zero), else the Linear's
// launches and the routing's; hidden sizes with and without whole 16-byte loads. A router that
// does not write the op's logits for its tokens and experts refused alike, nothing written.
BOOST_AUTO_TEST_CASE(route_with_its_router_is_the_linear_then_the_route) {
  std::mt19937 rng(43);
  struct Shape {
    int64_t tokens, experts, top, hidden;
  };
  for (const Shape& shape :
       {Shape{1, 384, 6, 320}, Shape{1, 40, 4, 203}, Shape{3, 12, 3, 64}, Shape{9, 384, 6, 96}}) {
    const int64_t tokens = shape.tokens, experts = shape.experts, top = shape.top;
    const int64_t hidden = shape.hidden, total = tokens * top, slots = std::min(experts, total);
    const std::vector<float> x = Normal(rng, tokens * hidden), gate = Normal(rng, experts * hidden);
    const std::vector<float> bias = Normal(rng, experts, 0.1f);
    const auto router = [&](const float* xx, const float* ww, float* y) {
      return LinearParams{
          .x = xx, .rows = tokens, .in = hidden, .out = experts, .dense = ww, .y = y};
    };
    const auto params = [&](const float* l, const float* bi, float* sc, float* biased, int64_t* ch,
                            float* wt) {
      return RouteTestParams(tokens, experts, top, 2.5f, l, bi, sc, biased, ch, wt);
    };
    // The CPU's ops in turn: the Linear, the routing, the grouping.
    std::vector<float> logits(tokens * experts), s(logits.size()), b(logits.size()), w(total);
    std::vector<int64_t> chosen(total);
    BOOST_REQUIRE(cpu::Linear(router(x.data(), gate.data(), logits.data())) == OpStatus::kOk);
    BOOST_REQUIRE(cpu::MoeRoute(params(logits.data(), bias.data(), s.data(), b.data(),
                                       chosen.data(), w.data())) == OpStatus::kOk);
    Grouped want(slots, total);
    BOOST_REQUIRE(cpu::MoeGroup(want.Params(chosen.data(), w.data(), tokens, experts, top)) ==
                  OpStatus::kOk);
    BOOST_TEST_CONTEXT("tokens " << tokens << " experts " << experts << " hidden " << hidden) {
      // The CPU's one op.
      {
        std::vector<float> l1(logits.size(), NAN), s1(s.size()), b1(b.size()), w1(w.size());
        std::vector<int64_t> c1(chosen.size());
        Grouped got(slots, total);
        const MoeGroupParams g = got.Params(nullptr, nullptr, 0, 0, 0);
        const LinearParams r = router(x.data(), gate.data(), l1.data());
        MoeRouteParams p =
            params(l1.data(), bias.data(), s1.data(), b1.data(), c1.data(), w1.data());
        p.group = &g, p.router = &r;
        BOOST_REQUIRE(cpu::MoeRoute(p) == OpStatus::kOk);
        BOOST_TEST((BitEqual(l1, logits) && c1 == chosen && BitEqual(w1, w)), "cpu");
        BOOST_TEST(
            (got.expert == want.expert && got.offset == want.offset && got.tiles == want.tiles &&
             got.rows == want.rows && BitEqual(got.weights, want.weights)),
            "cpu's grouping");
      }
      // The device's Linear alone, its launches counted; the weights also as BF16 codes (the
      // values are BF16 ones: the same sums).
      std::vector<uint16_t> codes(gate.size());
      for (size_t i = 0; i < gate.size(); ++i) codes[i] = cpu::FloatToBf16(gate[i]);
      Dev<float> dx(x), dgate(gate), dbias(bias);
      Dev<uint16_t> dcodes(codes);
      uint64_t linear_launches = 0;
      {
        Dev<float> dy(std::vector<float>(logits.size()));
        const uint64_t at = gpu::KernelLaunches();
        BOOST_REQUIRE(gpu::Linear(router(dx.get(), dgate.get(), dy.get())) == OpStatus::kOk);
        linear_launches = gpu::KernelLaunches() - at;
        BOOST_TEST(BitEqual(dy.Host(), logits), "the device's Linear");
      }
      for (const int variant : {0, 1, 2, 3, 4}) {
        // Grouped with the counter, fp32 then BF16 weights; grouped without it; not grouped,
        // without the counter and with it (and BF16 weights).
        const bool grouped = variant <= 2, counter = variant != 2 && variant != 3;
        const bool bf16 = variant == 1 || variant == 4;
        BOOST_TEST_CONTEXT("grouped " << grouped << " counter " << counter << " bf16 " << bf16) {
          Dev<float> dl(std::vector<float>(logits.size(), NAN)), dsc(std::vector<float>(s.size())),
              dbi(std::vector<float>(b.size())), dw(std::vector<float>(w.size()));
          Dev<int64_t> dch(std::vector<int64_t>(chosen.size()));
          DeviceGrouped device_grouped(want);
          Dev<unsigned> arrivals(std::vector<unsigned>(1, 0u));
          const MoeGroupParams g = device_grouped.Params();
          LinearParams r = router(dx.get(), dgate.get(), dl.get());
          if (bf16) {
            r.format = WeightFormat::kBf16, r.dense = nullptr;
            r.w = reinterpret_cast<const uint8_t*>(dcodes.get());
          }
          MoeRouteParams p =
              params(dl.get(), dbias.get(), dsc.get(), dbi.get(), dch.get(), dw.get());
          p.router = &r;
          if (grouped) p.group = &g;
          const bool one = tokens == 1 && grouped && counter;
          BOOST_TEST(gpu::RouterInKernel(p) == (tokens == 1 && grouped));
          const uint64_t at = gpu::KernelLaunches();
          BOOST_REQUIRE(gpu::MoeRoute(p, counter ? arrivals.get() : nullptr) == OpStatus::kOk);
          const uint64_t routing = grouped ? (counter ? 1u : 2u) : 1u;
          BOOST_TEST(gpu::KernelLaunches() - at == (one ? 1u : linear_launches + routing));
          BOOST_TEST(BitEqual(dl.Host(), logits));
          BOOST_TEST((dch.Host() == chosen));
          BOOST_TEST(BitEqual(dsc.Host(), s));
          BOOST_TEST(BitEqual(dw.Host(), w));
          if (grouped) device_grouped.Check(want);
          BOOST_TEST(arrivals.Host()[0] == 0u);
        }
      }
      // Routers that do not write the op's logits: into another buffer, of another row count.
      std::vector<float> other(logits.size(), 3.0f), mine(logits.size(), 3.0f);
      for (const bool elsewhere : {true, false}) {
        LinearParams r = router(x.data(), gate.data(), elsewhere ? other.data() : mine.data());
        if (!elsewhere) r.rows = tokens + 1;
        MoeRouteParams p =
            params(mine.data(), bias.data(), s.data(), b.data(), chosen.data(), w.data());
        p.router = &r;
        BOOST_TEST((cpu::MoeRoute(p) == OpStatus::kBadShape));
        BOOST_TEST((gpu::MoeRoute(p) == OpStatus::kBadShape));  // Refused before any device use.
        BOOST_TEST((other == std::vector<float>(logits.size(), 3.0f) &&
                    mine == std::vector<float>(logits.size(), 3.0f)));
      }
    }
  }
}

// A draft block's bound on its queries' window keys (SparseAttentionParams::draft_keys).
int64_t DraftKeys(const std::vector<int64_t>& window_first,
                  const std::vector<int64_t>& window_last) {
  int64_t keys = 0;
  for (size_t t = 0; t < window_first.size(); ++t) {
    keys = std::max(keys, window_last[t] - window_first[t] + 1);
  }
  return keys;
}

// p (its operands on the device, its workspace given) in every layout: a thread block a head, two
// a head (each half the weighted sums), and the keys decoded once into the workspace: each
// output equal to want.
void EveryScheduleGives(SparseAttentionParams p, const std::vector<float>& want,
                        const std::string& what) {
  using gpu::AttentionSchedule;
  for (const AttentionSchedule schedule :
       {AttentionSchedule::kAuto, AttentionSchedule::kHeadBlocks,
        AttentionSchedule::kHeadBlocksSplit, AttentionSchedule::kKeysOnce}) {
    Dev<float> out(std::vector<float>(want.size(), -1.0f));
    p.out = out.get();
    const uint64_t before = gpu::KernelLaunches();
    BOOST_REQUIRE(gpu::SparseAttentionScheduled(p, schedule) == OpStatus::kOk);
    const uint64_t launched = gpu::KernelLaunches() - before;
    BOOST_TEST(BitEqual(out.Host(), want), what << ", schedule " << static_cast<int>(schedule));
    // The keys decoded once: two kernels a pass of 16 queries, the rotation back in the last
    // (a thread block of a head's attention, one or two a head: its kernel, then the Rope op's).
    if (schedule == AttentionSchedule::kKeysOnce) {
      BOOST_TEST(launched == 2 * static_cast<uint64_t>((p.tokens + 15) / 16), what);
    } else if (schedule != AttentionSchedule::kAuto) {
      BOOST_TEST(launched == 2u, what);
    }
  }
}

// Attention over window rows (fresh and from the FP8 ring) and selected FP4 rows read through
// device block pointers, -1 entries and a block shared by two entry ranges included; windows
// and selections spanning several of the softmax's blocks, and a draft block whose ring wraps;
// the ring's and the blocks' codes also a byte off 16-byte alignment (the keys' codes then read a
// byte at a time).
BOOST_AUTO_TEST_CASE(sparse_attention_bit_equal) {
  std::mt19937 rng(9);
  struct Case {
    int64_t tokens, window, width, first;
    bool whole;  // Every query sees every row of the call (a DSpark draft block, window_last).
  };
  struct Shape {
    int64_t heads, hd;
    std::vector<Case> cases;
  };
  // Queries one head to a thread block (under 16 tokens) and eight (16 and more, 9 heads: a
  // group part empty); key lists within one pass of 256 entries and over two (window 300), at the
  // model's head_dim (512: two dimensions a thread) and the golden model's; selection rows of
  // over 256 entries (two rounds of ranks), over 16 heads (the logits' second head group), and
  // 17 to 35 queries (two and three passes of the keys decoded once).
  const Shape shapes[] = {
      {2,
       64,
       {{1, 8, 5, 30, false},
        {5, 8, 5, 30, false},
        {20, 8, 5, 30, false},
        {5, 8, 5, 30, true},
        {20, 8, 5, 30, true},
        {6, 80, 60, 10, false},
        {4, 150, 60, 170, false},
        {5, 100, 0, 130, true},
        {35, 80, 60, 10, false}}},
      {9,
       512,
       {{3, 300, 60, 400, false},
        {17, 300, 60, 400, false},
        {16, 300, 40, 280, true},
        {2, 128, 20, 90, false},
        {1, 128, 300, 600, false}}},
      {20, 64, {{1, 8, 40, 30, false}, {3, 70, 290, 100, false}, {18, 70, 100, 100, false}}}};
  for (const size_t shift : {size_t{0}, size_t{1}}) {
    for (const Shape& shape : shapes) {
      const int64_t heads = shape.heads, hd = shape.hd, rd = 16, per = 4, nblocks = 5;
      const size_t block_bytes = shift + per * (hd / 2 + hd / 16);
      std::vector<std::vector<uint8_t>> host_blocks(nblocks, std::vector<uint8_t>(block_bytes));
      for (auto& b : host_blocks) {
        for (int64_t r = 0; r < per; ++r) {
          std::vector<float> k = Normal(rng, hd);
          cpu::QuantizeFp4E4M3(k.data(), hd, 16, b.data() + shift + r * hd / 2,
                               b.data() + shift + per * hd / 2 + r * hd / 16);
        }
      }
      Blocks blocks;
      blocks.host = host_blocks;
      blocks.Upload();
      uint8_t* const* host_table = blocks.host_table.data();
      uint8_t* const* dev_table = blocks.dev_table->get();
      const std::vector<int32_t> table = {3, 0, 0, 4};
      std::vector<float> freqs(rd / 2);
      cpu::RopeFrequencies(rd, 0, 10000.0, 1, 0, 0, freqs.data());
      for (const Case& k : shape.cases) {
        const int64_t tokens = k.tokens, window = k.window, width = k.width, first = k.first;
        const bool whole = k.whole;
        std::vector<float> ring_rows = Normal(rng, window * hd);
        std::vector<uint8_t> ring_codes(shift + window * hd), ring_scales(window * hd / 32);
        cpu::QuantizeFp8PerBlock(ring_rows.data(), ring_rows.size(), 32, ring_codes.data() + shift,
                                 ring_scales.data());
        std::vector<float> fresh = Normal(rng, tokens * hd);
        cpu::RoundTripFp8(fresh.data(), fresh.size(), 32);
        std::vector<float> q = Normal(rng, tokens * heads * hd, 0.3f), sink = Normal(rng, heads);
        std::vector<int64_t> pos(tokens), wfirst(tokens), sel(tokens * width);
        std::uniform_int_distribution<int64_t> entry(0, 15);
        for (int64_t t = 0; t < tokens; ++t) {
          pos[t] = first + t;
          wfirst[t] = whole
                          ? std::max<int64_t>(0, first - window)
                          : std::max<int64_t>(t % 3 == 0 ? first + t - 2 : 0, pos[t] - window + 1);
          for (int64_t i = 0; i < width; ++i) sel[t * width + i] = i == 2 ? -1 : entry(rng);
        }
        std::vector<int64_t> wlast(tokens, first + tokens - 1);
        SparseAttentionParams params{
            .q = q.data(),
            .tokens = tokens,
            .heads = heads,
            .head_dim = hd,
            .rope_dim = rd,
            .positions = pos.data(),
            .ring_codes = ring_codes.data() + shift,
            .ring_scales = ring_scales.data(),
            .window = window,
            .fresh = fresh.data(),
            .fresh_first = first,
            .window_first = wfirst.data(),
            .window_last = whole ? wlast.data() : nullptr,
            .selected = width > 0 ? sel.data() : nullptr,
            .selected_stride = width,
            .block_table = table.data(),
            .kv_codes = {host_table, per, shift, static_cast<size_t>(hd / 2)},
            .kv_scales = {host_table, per, shift + per * hd / 2, static_cast<size_t>(hd / 16)},
            .sink = sink.data(),
            .freqs = freqs.data()};
        std::vector<float> want(tokens * heads * hd);
        params.out = want.data();
        BOOST_REQUIRE(cpu::SparseAttention(params) == OpStatus::kOk);
        const SparseAttentionParams on_host = params;
        Dev<float> dq(q), dfresh(fresh), dsink(sink), dfreqs(freqs), dout(want);
        Dev<uint8_t> drc(ring_codes), drs(ring_scales);
        Dev<int64_t> dpos(pos), dwf(wfirst), dwl(wlast), dsel(sel);
        Dev<int32_t> dtab(table);
        params.q = dq.get();
        params.positions = dpos.get();
        params.ring_codes = drc.get() + shift;
        params.ring_scales = drs.get();
        params.fresh = dfresh.get();
        params.window_first = dwf.get();
        if (whole) params.window_last = dwl.get();
        if (width > 0) params.selected = dsel.get();
        params.block_table = dtab.get();
        params.kv_codes.blocks = dev_table;
        params.kv_scales.blocks = dev_table;
        params.sink = dsink.get();
        params.freqs = dfreqs.get();
        params.out = dout.get();
        BOOST_REQUIRE(gpu::SparseAttention(params) == OpStatus::kOk);
        BOOST_TEST(BitEqual(dout.Host(), want), "head_dim " << hd << " tokens " << tokens
                                                            << " window " << window << " whole "
                                                            << whole << " shift " << shift);
        // Every layout: a thread block a head, two a head (each half the weighted sums), and the
        // keys decoded once into the workspace (16 queries a pass, one head or eight a block; the
        // workspace starts as NaNs, so a slot read before it is written shows): the same bits.
        if (whole) {  // A draft block takes the keys-once kernels with its bound on the keys.
          BOOST_TEST(gpu::SparseAttentionWorkspaceFloats(params) == 0);
          params.draft_keys = DraftKeys(wfirst, wlast);
        }
        const int64_t floats = gpu::SparseAttentionWorkspaceFloats(params);
        BOOST_TEST(floats > 0);
        Dev<float> dwork(std::vector<float>(std::max<int64_t>(floats, 1), std::nanf("")));
        params.workspace = dwork.get();
        params.workspace_floats = floats;
        const auto every_schedule = [&](const char* ring) {
          std::ostringstream what;
          what << ring << " ring, head_dim " << hd << " tokens " << tokens << " window " << window
               << " width " << width;
          EveryScheduleGives(params, want, what.str());
        };
        every_schedule("separate");
        // The ring interleaved as the backend's ring cache holds it (each slot's scales after
        // its codes, unpadded here: unaligned slots but at head_dim 512), on the CPU and in
        // every layout: the same bits.
        {
          const int64_t slot = hd + hd / 32;
          std::vector<uint8_t> ring(shift + window * slot);
          for (int64_t i = 0; i < window; ++i) {
            std::memcpy(&ring[shift + i * slot], &ring_codes[shift + i * hd], hd);
            std::memcpy(&ring[shift + i * slot + hd], &ring_scales[i * hd / 32], hd / 32);
          }
          SparseAttentionParams host = on_host;
          std::vector<float> got(want.size(), -1.0f);
          host.ring_codes = ring.data() + shift;
          host.ring_scales = ring.data() + shift + hd;
          host.ring_slot_bytes = slot;
          host.out = got.data();
          BOOST_REQUIRE(cpu::SparseAttention(host) == OpStatus::kOk);
          BOOST_TEST(BitEqual(got, want), "interleaved ring on the CPU, head_dim " << hd);
          Dev<uint8_t> dring(ring);
          params.ring_codes = dring.get() + shift;
          params.ring_scales = dring.get() + shift + hd;
          params.ring_slot_bytes = slot;
          every_schedule("interleaved");
          params.ring_codes = drc.get() + shift;
          params.ring_scales = drs.get();
          params.ring_slot_bytes = 0;
        }
        // A workspace a float short: refused, not overrun.
        params.workspace_floats = floats - 1;
        BOOST_TEST((gpu::SparseAttentionScheduled(params, gpu::AttentionSchedule::kKeysOnce) ==
                    OpStatus::kBadArgument));
      }
    }
  }
}

// Index scores of several sequences' queries in one call (token_sequence, block_tables), the
// queries interleaved and each sequence's table of its own length: each query's scores are those
// of a call of its own, on the CPU (both paths) and on the device.
BOOST_AUTO_TEST_CASE(indexer_scores_of_several_sequences_bit_equal) {
  std::mt19937 rng(13);
  const int64_t heads = 3, dim = 64, per = 16, nblocks = 6, stride = 90;
  Blocks blocks = IndexKeyBlocks(rng, dim, per, nblocks);
  const PagedRows codes{blocks.host_table.data(), per, 0, static_cast<size_t>(dim / 2)};
  const PagedRows scales{blocks.host_table.data(), per, static_cast<size_t>(per * dim / 2),
                         static_cast<size_t>(dim / 32)};
  // Three sequences' tables: 2, 6 and 4 blocks (32, 96 and 64 entries at most).
  const std::vector<std::vector<int32_t>> tables = {{5, 1}, {4, 2, 0, 2, 5, 1}, {3, 3, 0, 4}};
  for (const int64_t tokens : {int64_t{3}, int64_t{7}, int64_t{40}}) {
    std::vector<float> q = Normal(rng, tokens * heads * dim), w = Normal(rng, tokens * heads);
    cpu::FakeQuant({.x = q.data(),
                    .n = static_cast<int64_t>(q.size()),
                    .block = 32,
                    .format = FakeQuantFormat::kFp4E8M0});
    std::vector<int32_t> token_sequence(tokens);
    std::vector<int64_t> visible(tokens);
    std::vector<uint8_t> mask(tokens * stride);
    for (size_t i = 0; i < mask.size(); ++i) mask[i] = (i * 5) % 4 != 0;
    for (int64_t t = 0; t < tokens; ++t) {
      token_sequence[t] = static_cast<int32_t>((t * 2 + t / 3) % 3);
      const int64_t most = std::min<int64_t>(stride, tables[token_sequence[t]].size() * per);
      visible[t] = std::uniform_int_distribution<int64_t>(0, most)(rng);
    }
    IndexerScoreParams one{
        .heads = heads, .dim = dim, .key_codes = codes, .key_scales = scales, .stride = stride};
    // Each query alone.
    std::vector<float> want(tokens * stride);
    for (int64_t t = 0; t < tokens; ++t) {
      one.q = &q[t * heads * dim];
      one.weights = &w[t * heads];
      one.tokens = 1;
      one.visible = &visible[t];
      one.block_table = tables[token_sequence[t]].data();
      one.mask = &mask[t * stride];
      one.scores = &want[t * stride];
      BOOST_REQUIRE(cpu::IndexerScoresRef(one) == OpStatus::kOk);
    }
    std::vector<const int32_t*> host_tables;
    for (const auto& t : tables) host_tables.push_back(t.data());
    IndexerScoreParams all{.q = q.data(),
                           .weights = w.data(),
                           .tokens = tokens,
                           .heads = heads,
                           .dim = dim,
                           .visible = visible.data(),
                           .key_codes = codes,
                           .key_scales = scales,
                           .mask = mask.data(),
                           .stride = stride,
                           .token_sequence = token_sequence.data(),
                           .block_tables = host_tables.data(),
                           .sequence_count = 3};
    for (const bool reference : {true, false}) {
      std::vector<float> got(want.size(), 7.0f);
      all.scores = got.data();
      BOOST_REQUIRE((reference ? cpu::IndexerScoresRef(all) : cpu::IndexerScores(all)) ==
                    OpStatus::kOk);
      BOOST_TEST(BitEqual(got, want), "CPU, reference " << reference << ", tokens " << tokens);
    }
    {
      IndexerScoreParams bad = all;
      std::vector<int32_t> wrong = token_sequence;
      wrong.front() = 3;
      bad.token_sequence = wrong.data();
      BOOST_TEST((cpu::IndexerScores(bad) == OpStatus::kBadShape));
    }
    std::vector<std::unique_ptr<Dev<int32_t>>> dev_tables;
    std::vector<const int32_t*> dev_table_ptrs;
    for (const auto& t : tables) {
      dev_tables.push_back(std::make_unique<Dev<int32_t>>(t));
      dev_table_ptrs.push_back(dev_tables.back()->get());
    }
    Dev<const int32_t*> dtables(dev_table_ptrs);
    Dev<int32_t> dts(token_sequence);
    Dev<float> dq(q), dw(w), dscores(std::vector<float>(want.size(), 7.0f));
    Dev<int64_t> dvis(visible);
    Dev<uint8_t> dmask(mask);
    IndexerScoreParams on = all;
    on.q = dq.get();
    on.weights = dw.get();
    on.visible = dvis.get();
    on.key_codes.blocks = blocks.dev_table->get();
    on.key_scales.blocks = blocks.dev_table->get();
    on.mask = dmask.get();
    on.scores = dscores.get();
    on.token_sequence = dts.get();
    on.block_tables = dtables.get();
    BOOST_REQUIRE(gpu::IndexerScores(on) == OpStatus::kOk);
    BOOST_TEST(BitEqual(dscores.Host(), want), "device, tokens " << tokens);
    // A fourth sequence with no entries yet, and so no block table, its query last: it scores
    // -inf throughout, the others as before; given an entry to see, it is refused.
    {
      std::vector<float> q4 = q, w4 = w, got((tokens + 1) * stride, 7.0f);
      q4.resize((tokens + 1) * heads * dim, 0.5f);
      w4.resize((tokens + 1) * heads, 1.0f);
      std::vector<int64_t> visible4 = visible;
      visible4.push_back(0);
      std::vector<uint8_t> mask4 = mask;
      mask4.resize((tokens + 1) * stride, 1);
      std::vector<int32_t> ts4 = token_sequence;
      ts4.push_back(3);
      std::vector<const int32_t*> tables4 = host_tables;
      tables4.push_back(nullptr);
      IndexerScoreParams four = all;
      four.q = q4.data();
      four.weights = w4.data();
      four.tokens = tokens + 1;
      four.visible = visible4.data();
      four.mask = mask4.data();
      four.token_sequence = ts4.data();
      four.block_tables = tables4.data();
      four.sequence_count = 4;
      four.scores = got.data();
      BOOST_REQUIRE(cpu::IndexerScores(four) == OpStatus::kOk);
      std::vector<float> want4 = want;
      want4.resize(got.size(), -std::numeric_limits<float>::infinity());
      BOOST_TEST(BitEqual(got, want4), "a sequence without entries, tokens " << tokens);
      visible4.back() = 1;
      BOOST_TEST((cpu::IndexerScores(four) == OpStatus::kBadShape));
    }
  }
}

// Runs of bytes spread by one kernel (ScatterOnDevice): runs of 1 to 700 bytes, at odd offsets
// in the source and odd targets, land where each says and nothing else changes. Then gathered
// back by one kernel (GatherOnDevice) into another buffer at other odd offsets: each lands where
// its run says, the bytes between untouched.
BOOST_AUTO_TEST_CASE(scattered_and_gathered_runs_land_where_each_says) {
  std::mt19937 rng(5);
  std::uniform_int_distribution<int> byte(0, 255);
  const std::vector<std::pair<uint64_t, uint64_t>> pieces = {
      // (bytes, target offset)
      {1, 3}, {17, 40}, {528, 101}, {700, 1000}, {64, 2000}, {3, 1717}};
  std::vector<uint8_t> src(1400);
  for (uint8_t& b : src) b = static_cast<uint8_t>(byte(rng));
  std::vector<uint8_t> target(2100, 0xAB), want = target;
  Dev<uint8_t> dtarget(target), dsrc(src);
  std::vector<gpu::ByteRun> runs;
  uint64_t from = 5;
  for (const auto& [bytes, at] : pieces) {
    runs.push_back({dtarget.get() + at, from, bytes});
    std::memcpy(&want[at], &src[from], bytes);
    from += bytes % 3 == 0 ? bytes : bytes + 1;
  }
  BOOST_REQUIRE(from <= src.size());
  Dev<gpu::ByteRun> druns(runs);
  BOOST_REQUIRE(gpu::ScatterOnDevice(dsrc.get(), druns.get(), 0).empty());
  BOOST_TEST((dtarget.Host() == target));
  BOOST_REQUIRE(
      gpu::ScatterOnDevice(dsrc.get(), druns.get(), static_cast<int64_t>(runs.size())).empty());
  BOOST_TEST((dtarget.Host() == want));

  std::vector<uint8_t> back(src.size(), 0xCD), want_back = back;
  Dev<uint8_t> dback(back);
  std::vector<gpu::ByteGather> gathers;
  uint64_t to = 2;
  for (const gpu::ByteRun& r : runs) {
    gathers.push_back({r.to, to, r.bytes});
    std::memcpy(&want_back[to], &src[r.from], r.bytes);
    to += r.bytes + 3;
  }
  BOOST_REQUIRE(to <= back.size() + 3);
  Dev<gpu::ByteGather> dgathers(gathers);
  BOOST_REQUIRE(gpu::GatherOnDevice(dback.get(), dgathers.get(), 0).empty());
  BOOST_TEST((dback.Host() == back));
  BOOST_REQUIRE(
      gpu::GatherOnDevice(dback.get(), dgathers.get(), static_cast<int64_t>(gathers.size()))
          .empty());
  BOOST_TEST((dback.Host() == want_back));
}

// The queries of several sequences in one call (token_sequence, sequences): each sequence its own
// ring (two arrays, or interleaved with padded slots, as the backend's ring cache holds it, side
// by side in one call), fresh rows, positions and block table, their queries interleaved in the
// call's order. Each query gets the bits of a call of its sequence alone, on the CPU and in every
// device layout; decode steps (a query a sequence), prompt chunks and draft blocks.
BOOST_AUTO_TEST_CASE(sparse_attention_of_several_sequences_bit_equal) {
  std::mt19937 rng(31);
  struct Seq {
    int64_t tokens, first;
  };
  struct Case {
    int64_t heads, hd, window, width;
    bool whole;
    std::vector<Seq> seqs;
  };
  // A decode step (one query each, a thread block a head), a mix under 16 queries, one of 16 and
  // more (eight heads a thread block, two passes of the keys decoded once), draft blocks, and the
  // model's head_dim.
  const Case cases[] = {
      {4, 64, 8, 6, false, {{1, 30}, {1, 5}, {1, 200}, {1, 2}}},
      {4, 64, 40, 6, false, {{3, 30}, {1, 90}, {5, 12}}},
      {4, 64, 40, 70, false, {{9, 30}, {1, 90}, {12, 150}}},
      {4, 64, 40, 6, true, {{3, 60}, {4, 41}}},
      {9, 512, 128, 20, false, {{1, 300}, {2, 140}, {1, 7}}},
  };
  const int64_t rd = 16, per = 4, nblocks = 6;
  std::vector<float> freqs(rd / 2);
  cpu::RopeFrequencies(rd, 0, 10000.0, 1, 0, 0, freqs.data());
  std::uniform_int_distribution<int64_t> entry(0, per * 4 - 1);
  for (const Case& k : cases) {
    const int64_t heads = k.heads, hd = k.hd, window = k.window, width = k.width;
    const int64_t S = static_cast<int64_t>(k.seqs.size());
    const size_t block_bytes = per * (hd / 2 + hd / 16);
    std::vector<std::vector<uint8_t>> host_blocks(nblocks, std::vector<uint8_t>(block_bytes));
    for (auto& b : host_blocks) {
      for (int64_t r = 0; r < per; ++r) {
        std::vector<float> v = Normal(rng, hd);
        cpu::QuantizeFp4E4M3(v.data(), hd, 16, b.data() + r * hd / 2,
                             b.data() + per * hd / 2 + r * hd / 16);
      }
    }
    Blocks blocks;
    blocks.host = host_blocks;
    blocks.Upload();
    const PagedRows kv_codes{blocks.host_table.data(), per, 0, static_cast<size_t>(hd / 2)};
    const PagedRows kv_scales{blocks.host_table.data(), per, static_cast<size_t>(per * hd / 2),
                              static_cast<size_t>(hd / 16)};
    const int64_t slot = (hd + hd / 32 + 15) / 16 * 16;  // An interleaved ring's padded slot.
    // Per sequence: its ring (odd sequences interleaved), block table, fresh rows, queries.
    struct Data {
      std::vector<uint8_t> codes, scales;
      int64_t slot_bytes = 0;
      std::vector<int32_t> table;
      std::vector<float> fresh, q;
      std::vector<int64_t> pos, wfirst, wlast, sel;
      std::vector<float> want;
    };
    std::vector<Data> d(static_cast<size_t>(S));
    const std::vector<float> sink = Normal(rng, heads);
    for (int64_t s = 0; s < S; ++s) {
      Data& x = d[s];
      const Seq& sq = k.seqs[s];
      std::vector<float> rows = Normal(rng, window * hd);
      std::vector<uint8_t> codes(window * hd), scales(window * hd / 32);
      cpu::QuantizeFp8PerBlock(rows.data(), rows.size(), 32, codes.data(), scales.data());
      if (s % 2 == 1) {
        x.slot_bytes = slot;
        x.codes.assign(window * slot, 0xEE);
        for (int64_t i = 0; i < window; ++i) {
          std::memcpy(&x.codes[i * slot], &codes[i * hd], hd);
          std::memcpy(&x.codes[i * slot + hd], &scales[i * hd / 32], hd / 32);
        }
      } else {
        x.codes = codes;
        x.scales = scales;
      }
      std::uniform_int_distribution<int32_t> block(0, nblocks - 1);
      for (int i = 0; i < 4; ++i) x.table.push_back(block(rng));
      x.fresh = Normal(rng, sq.tokens * hd);
      cpu::RoundTripFp8(x.fresh.data(), x.fresh.size(), 32);
      x.q = Normal(rng, sq.tokens * heads * hd, 0.3f);
      for (int64_t t = 0; t < sq.tokens; ++t) {
        x.pos.push_back(sq.first + t);
        x.wfirst.push_back(k.whole ? std::max<int64_t>(0, sq.first - window)
                                   : std::max<int64_t>(0, sq.first + t - window + 1));
        x.wlast.push_back(sq.first + sq.tokens - 1);
        for (int64_t i = 0; i < width; ++i) x.sel.push_back(i % 5 == 2 ? -1 : entry(rng));
      }
    }
    // The call's order: the sequences' queries interleaved, one of each in turn.
    int64_t longest = 0;
    for (const Seq& sq : k.seqs) longest = std::max(longest, sq.tokens);
    std::vector<std::pair<int64_t, int64_t>> order;  // (sequence, its query)
    for (int64_t t = 0; t < longest; ++t) {
      for (int64_t s = 0; s < S; ++s) {
        if (t < k.seqs[s].tokens) order.push_back({s, t});
      }
    }
    const int64_t tokens = static_cast<int64_t>(order.size());
    // Each sequence alone on the CPU: the bits every other run must give.
    std::vector<AttentionSequence> host_seqs;
    for (int64_t s = 0; s < S; ++s) {
      Data& x = d[s];
      const int64_t n = k.seqs[s].tokens;
      x.want.assign(n * heads * hd, -1.0f);
      SparseAttentionParams one{
          .q = x.q.data(),
          .tokens = n,
          .heads = heads,
          .head_dim = hd,
          .rope_dim = rd,
          .positions = x.pos.data(),
          .ring_codes = x.codes.data(),
          .ring_scales = x.slot_bytes > 0 ? x.codes.data() + hd : x.scales.data(),
          .ring_slot_bytes = x.slot_bytes,
          .window = window,
          .fresh = x.fresh.data(),
          .fresh_first = k.seqs[s].first,
          .window_first = x.wfirst.data(),
          .window_last = k.whole ? x.wlast.data() : nullptr,
          .selected = width > 0 ? x.sel.data() : nullptr,
          .selected_stride = width,
          .block_table = x.table.data(),
          .kv_codes = kv_codes,
          .kv_scales = kv_scales,
          .sink = sink.data(),
          .freqs = freqs.data(),
          .out = x.want.data()};
      BOOST_REQUIRE(cpu::SparseAttention(one) == OpStatus::kOk);
      host_seqs.push_back(one.SequenceOf(0));
    }
    // The call's rows, in its order.
    std::vector<float> q, want;
    std::vector<int64_t> pos, wfirst, wlast, sel;
    std::vector<int32_t> token_sequence;
    for (const auto& [s, t] : order) {
      const Data& x = d[s];
      q.insert(q.end(), x.q.begin() + t * heads * hd, x.q.begin() + (t + 1) * heads * hd);
      want.insert(want.end(), x.want.begin() + t * heads * hd,
                  x.want.begin() + (t + 1) * heads * hd);
      pos.push_back(x.pos[t]);
      wfirst.push_back(x.wfirst[t]);
      wlast.push_back(x.wlast[t]);
      sel.insert(sel.end(), x.sel.begin() + t * width, x.sel.begin() + (t + 1) * width);
      token_sequence.push_back(static_cast<int32_t>(s));
    }
    SparseAttentionParams all{.q = q.data(),
                              .tokens = tokens,
                              .heads = heads,
                              .head_dim = hd,
                              .rope_dim = rd,
                              .positions = pos.data(),
                              .window = window,
                              .window_first = wfirst.data(),
                              .window_last = k.whole ? wlast.data() : nullptr,
                              .selected = width > 0 ? sel.data() : nullptr,
                              .selected_stride = width,
                              .kv_codes = kv_codes,
                              .kv_scales = kv_scales,
                              .sink = sink.data(),
                              .freqs = freqs.data(),
                              .token_sequence = token_sequence.data(),
                              .sequences = host_seqs.data(),
                              .sequence_count = S};
    std::vector<float> got(want.size(), -1.0f);
    all.out = got.data();
    BOOST_REQUIRE(cpu::SparseAttention(all) == OpStatus::kOk);
    BOOST_TEST(BitEqual(got, want), "several sequences on the CPU, head_dim " << hd);
    // A query naming a sequence the call does not have: refused.
    {
      SparseAttentionParams bad = all;
      std::vector<int32_t> wrong = token_sequence;
      wrong.back() = static_cast<int32_t>(S);
      bad.token_sequence = wrong.data();
      BOOST_TEST((cpu::SparseAttention(bad) == OpStatus::kBadShape));
    }
    // A sequence with no entries yet may come without a block table: its queries' selection rows
    // all -1, the results those of its table given; an entry to read without one is refused.
    if (width > 0) {
      std::vector<int64_t> none = sel;
      for (int64_t t = 0; t < tokens; ++t) {
        if (token_sequence[t] == 0) std::fill_n(&none[t * width], width, -1);
      }
      std::vector<AttentionSequence> tableless = host_seqs;
      tableless[0].block_table = nullptr;
      std::vector<float> with(want.size()), without(want.size(), -1.0f);
      SparseAttentionParams a = all;
      a.selected = none.data();
      a.out = with.data();
      BOOST_REQUIRE(cpu::SparseAttention(a) == OpStatus::kOk);
      a.sequences = tableless.data();
      a.out = without.data();
      BOOST_REQUIRE(cpu::SparseAttention(a) == OpStatus::kOk);
      BOOST_TEST(BitEqual(without, with));
      a.selected = sel.data();
      BOOST_TEST((cpu::SparseAttention(a) == OpStatus::kBadShape));
    }
    // On the device: the sequences' rings, fresh rows and tables there, and every layout.
    std::vector<std::unique_ptr<Dev<uint8_t>>> rings, scales;
    std::vector<std::unique_ptr<Dev<float>>> fresh;
    std::vector<std::unique_ptr<Dev<int32_t>>> tables;
    std::vector<AttentionSequence> dev_seqs;
    for (int64_t s = 0; s < S; ++s) {
      const Data& x = d[s];
      rings.push_back(std::make_unique<Dev<uint8_t>>(x.codes));
      scales.push_back(std::make_unique<Dev<uint8_t>>(x.slot_bytes > 0 ? x.codes : x.scales));
      fresh.push_back(std::make_unique<Dev<float>>(x.fresh));
      tables.push_back(std::make_unique<Dev<int32_t>>(x.table));
      AttentionSequence v = host_seqs[s];
      v.ring_codes = rings.back()->get();
      v.ring_scales = x.slot_bytes > 0 ? rings.back()->get() + hd : scales.back()->get();
      v.ring_versions = nullptr;
      v.fresh = fresh.back()->get();
      v.block_table = tables.back()->get();
      dev_seqs.push_back(v);
    }
    Dev<AttentionSequence> dseqs(dev_seqs);
    Dev<int32_t> dts(token_sequence);
    Dev<float> dq(q), dsink(sink), dfreqs(freqs);
    Dev<int64_t> dpos(pos), dwf(wfirst), dwl(wlast), dsel(sel);
    SparseAttentionParams on = all;
    on.q = dq.get();
    on.positions = dpos.get();
    on.window_first = dwf.get();
    if (k.whole) on.window_last = dwl.get();
    if (width > 0) on.selected = dsel.get();
    on.kv_codes.blocks = blocks.dev_table->get();
    on.kv_scales.blocks = blocks.dev_table->get();
    on.sink = dsink.get();
    on.freqs = dfreqs.get();
    on.token_sequence = dts.get();
    on.sequences = dseqs.get();
    if (k.whole) on.draft_keys = DraftKeys(wfirst, wlast);
    const int64_t floats = gpu::SparseAttentionWorkspaceFloats(on);
    BOOST_TEST(floats > 0);
    Dev<float> dwork(std::vector<float>(std::max<int64_t>(floats, 1), std::nanf("")));
    on.workspace = dwork.get();
    on.workspace_floats = floats;
    std::ostringstream what;
    what << "several sequences, head_dim " << hd << " tokens " << tokens << " whole " << k.whole;
    EveryScheduleGives(on, want, what.str());
  }
}

BOOST_AUTO_TEST_SUITE_END()

}  // namespace
