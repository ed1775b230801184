// The activations' quantizer shared by the quantized GEMMs (kernels/gpu/linear.cu and
// linear_matrix.cu): x[blocks x 32] to FP8 codes with a UE8M0 scale per 32, as the CPU's
// Linear quantizes its input, one thread a block; launched on `stream`.
#pragma once

#include <cstdint>

#include "kernels/gpu/portability.h"

namespace flashd::kernels::FLASHD_GPU_BACKEND {

void QuantizeActivations(const float* x, int64_t blocks, uint8_t* codes, uint8_t* scales,
                         gpuStream_t stream);

}  // namespace flashd::kernels::FLASHD_GPU_BACKEND
