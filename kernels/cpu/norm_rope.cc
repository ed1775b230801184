// RMSNorm, RoPE (with YaRN), BF16 rounding and the fake quantizers.
#include <algorithm>
#include <cmath>
#include <thread>

#include "kernels/cpu/formats.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/parallel.h"
#include "kernels/cpu/scalar.h"
#include "kernels/cpu/thread_pool.h"

namespace flashd::kernels::cpu {
int StreamThreads(const void* stream) {
  // hardware_concurrency() reads /sys on every call; the process's pool fixes the count anyway.
  static const int cores = static_cast<int>(ThreadPool::Process().workers()) + 1;
  const int threads = stream != nullptr ? static_cast<const CpuStream*>(stream)->threads : 0;
  return threads > 0 ? threads : cores;
}

OpStatus RoundBf16(const RoundBf16Params& p) {
  if (p.n < 0 || (p.n > 0 && p.x == nullptr)) return OpStatus::kBadArgument;
  if (p.scale == 1.0f) {
    for (int64_t i = 0; i < p.n; ++i) p.x[i] = Bf(p.x[i]);
  } else {
    for (int64_t i = 0; i < p.n; ++i) p.x[i] = Bf(Bf(p.x[i]) * p.scale);
  }
  return OpStatus::kOk;
}

OpStatus RmsNorm(const RmsNormParams& p) {
  if (const OpStatus s = RmsNormFits(p); s != OpStatus::kOk) return s;
  if (p.next != nullptr) {  // This op, then the next.
    RmsNormParams q = p;
    q.next = nullptr;
    if (const OpStatus s = RmsNorm(q); s != OpStatus::kOk) return s;
    return RmsNorm(*p.next);
  }
  if (p.rope_dim > 0 || p.fake_quant_fp8 || p.codes != nullptr || p.copy_to != nullptr) {
    // The norm, then the rotation, the quantizer, the codes and the copy.
    RmsNormParams q = p;
    q.rope_dim = 0;
    q.fake_quant_fp8 = false;
    q.codes = q.code_scales = nullptr;
    q.copy_to = nullptr;
    q.copy_rows = nullptr;
    if (const OpStatus s = RmsNorm(q); s != OpStatus::kOk) return s;
    if (p.rope_dim > 0) {
      if (const OpStatus s = Rope({.x = p.x,
                                   .rows = p.rows,
                                   .head_dim = p.dim,
                                   .rope_dim = p.rope_dim,
                                   .row_stride = p.stride,
                                   .positions = p.positions,
                                   .freqs = p.freqs});
          s != OpStatus::kOk) {
        return s;
      }
    }
    for (int64_t r = 0; p.fake_quant_fp8 && r < p.rows; ++r) {
      if (const OpStatus s = FakeQuant({.x = p.x + r * p.stride, .n = p.dim, .block = 32});
          s != OpStatus::kOk) {
        return s;
      }
    }
    if (p.codes != nullptr) QuantizeFp8Rows(p.x, p.rows, p.dim, p.stride, p.codes, p.code_scales);
    for (int64_t r = 0; p.copy_to != nullptr && r < p.rows; ++r) {
      if (p.copy_rows[r] < 0) continue;
      std::copy_n(p.x + r * p.stride, p.dim, p.copy_to + p.copy_rows[r] * p.dim);
    }
    return OpStatus::kOk;
  }
  for (int64_t r = 0; r < p.rows; ++r) {
    float* x = p.x + r * p.stride;
    if (p.round_input) {
      for (int64_t i = 0; i < p.dim; ++i) x[i] = Bf(x[i]);
    }
    const double sum =
        LaneSum<double>(static_cast<size_t>(p.dim), [&](size_t i) { return double(x[i]) * x[i]; });
    const float scale = 1.0f / std::sqrt(static_cast<float>(sum / p.dim) + p.eps);
    for (int64_t i = 0; i < p.dim; ++i) x[i] = Bf(p.weight[i] * (x[i] * scale));
  }
  return OpStatus::kOk;
}

OpStatus Rope(const RopeParams& p) {
  if (!RopeFits(p)) return OpStatus::kBadShape;
  const int64_t pairs = p.rope_dim / 2;
  for (int64_t r = 0; r < p.rows; ++r) {
    const float pos = static_cast<float>(p.positions[r]);
    for (int64_t h = 0; h < p.heads; ++h) {
      float* x = p.x + r * p.row_stride + h * p.head_dim + p.head_dim - p.rope_dim;
      for (int64_t i = 0; i < pairs; ++i) {
        const float angle = pos * p.freqs[i];
        float s, c;
        fmath::SinCos(angle, &s, &c);
        if (p.inverse) s = -s;
        const float a = x[2 * i], b = x[2 * i + 1];
        x[2 * i] = Bf(a * c - b * s);
        x[2 * i + 1] = Bf(a * s + b * c);
      }
    }
  }
  for (int64_t r = 0; p.fake_quant_block > 0 && r < p.rows; ++r) {  // Then each head's blocks.
    for (int64_t h = 0; h < p.heads; ++h) {
      FLASHD_OP_RETURN_IF_ERROR(FakeQuant({.x = p.x + r * p.row_stride + h * p.head_dim,
                                           .n = p.head_dim,
                                           .block = p.fake_quant_block,
                                           .format = p.fake_quant_format}));
    }
  }
  return OpStatus::kOk;
}

void RopeFrequencies(int dim, int64_t original, double base, double factor, double beta_fast,
                     double beta_slow, float* freqs) {
  for (int i = 0; i < dim / 2; ++i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(dim);
    freqs[i] = 1.0f / std::pow(static_cast<float>(base), exponent);
  }
  if (original <= 0) return;
  auto corrected = [&](double rotations) {
    return dim * std::log(original / (rotations * 2 * M_PI)) / (2 * std::log(base));
  };
  const double low = std::max(std::floor(corrected(beta_fast)), 0.0);
  const double high = std::min(std::ceil(corrected(beta_slow)), static_cast<double>(dim - 1));
  const float span = static_cast<float>(std::max(high - low, 1e-3));
  for (int i = 0; i < dim / 2; ++i) {
    const float ramp =
        std::clamp((static_cast<float>(i) - static_cast<float>(low)) / span, 0.0f, 1.0f);
    const float smooth = 1.0f - ramp;
    freqs[i] = freqs[i] / static_cast<float>(factor) * (1.0f - smooth) + freqs[i] * smooth;
  }
}

OpStatus FakeQuant(const FakeQuantParams& p) {
  if (p.n < 0 || p.block <= 0 || p.n % p.block != 0) return OpStatus::kBadShape;
  const size_t n = static_cast<size_t>(p.n), block = static_cast<size_t>(p.block);
  switch (p.format) {
    case FakeQuantFormat::kFp8E8M0:
      RoundTripFp8(p.x, n, block);
      break;
    case FakeQuantFormat::kFp4E8M0:
      RoundTripFp4E8M0(p.x, n, block);
      break;
    case FakeQuantFormat::kFp4E4M3:
      RoundTripFp4E4M3(p.x, n, block);
      break;
  }
  return OpStatus::kOk;
}

}  // namespace flashd::kernels::cpu
