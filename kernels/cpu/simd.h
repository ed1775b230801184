// Run-time choice of vector instructions for the CPU kernels.
//
// The package is built for plain x86-64 so that it runs on any such CPU; the few loops that pay
// for wider vectors are compiled once per instruction set with FLASHD_VECTOR_CLONES, and the
// loader picks the widest one the CPU has (GCC function multi-versioning). Every clone is the
// same source: floating-point results are equal to the plain build's because the compiler may
// neither reorder float additions (no -ffast-math) nor fuse a multiply and an add
// (-ffp-contract=off for the kernels), so a wider vector only does more of the same lanes at
// once. kernels_test runs them against the scalar references on whatever CPU runs the tests.
#pragma once

// Hand-written x86 vector paths (SSE2 is part of x86-64; AVX2 is chosen at run time).
#if defined(__x86_64__)
#define FLASHD_X86_VECTORS 1
#else
#define FLASHD_X86_VECTORS 0
#endif

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && \
    !defined(__SANITIZE_ADDRESS__)
#define FLASHD_VECTOR_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
// Clang's sanitizer and fuzzing builds (and other targets) use the baseline instructions.
#define FLASHD_VECTOR_CLONES
#endif

#if FLASHD_X86_VECTORS
#include <immintrin.h>

namespace flashd::kernels::cpu {
// (p0 + p1) + (p2 + p3) of a register's four lanes: how the kernels close a four-lane sum.
inline float LaneSum4(__m128 p) {
  const __m128 pairs = _mm_add_ps(p, _mm_shuffle_ps(p, p, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtss_f32(_mm_add_ss(pairs, _mm_movehl_ps(pairs, pairs)));
}
}  // namespace flashd::kernels::cpu
#endif
