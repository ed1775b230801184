// A weight matrix in the checkpoint's stored formats, for kernel tests: FP8 with one UE8M0 scale
// per 32x32 tile, FP4 with one UE8M0 scale per 32 inputs, or dense floats (no codes), plus the
// values a kernel sees after decoding.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/cpu/formats.h"
#include "kernels/ops.h"

namespace flashd::testing {

struct QuantizedWeights {
  std::vector<uint8_t> codes{0}, scales{0};  // One byte when dense, so data() is never null.
  std::vector<float> decoded;                // [out, in]
};

inline QuantizedWeights QuantizeWeights(kernels::WeightFormat format, const std::vector<float>& w,
                                        int64_t out, int64_t in) {
  namespace k = kernels::cpu;
  QuantizedWeights q;
  q.decoded = w;
  if (format == kernels::WeightFormat::kFp8) {
    q.codes.resize(w.size());
    q.scales.resize(((out + 31) / 32) * (in / 32));
    k::QuantizeFp8Weight(w.data(), out, in, q.codes.data(), q.scales.data());
    k::DequantizeFp8Weight(q.codes.data(), q.scales.data(), out, in, q.decoded.data());
  } else if (format == kernels::WeightFormat::kFp4) {
    q.codes.resize(w.size() / 2);
    q.scales.resize(w.size() / 32);
    for (int64_t r = 0; r < out; ++r) {
      k::QuantizeFp4E8M0(&w[r * in], in, 32, &q.codes[r * in / 2], &q.scales[r * in / 32]);
      k::DequantizeFp4E8M0(&q.codes[r * in / 2], &q.scales[r * in / 32], in, 32,
                           &q.decoded[r * in]);
    }
  }
  return q;
}

}  // namespace flashd::testing
