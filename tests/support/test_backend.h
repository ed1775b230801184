// The backend a forward-pass test runs on: FLASHD_TEST_BACKEND (cpu when unset), so that one test
// binary is registered once per backend. A GPU backend this build has but this machine cannot
// run exits the test with 77 (ctest: skipped), saying why. Also where the golden model is, for
// binaries carried to another machine: FLASHD_TEST_GOLDEN_DIR, else the build's
// FLASHD_GOLDEN_DIR.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "engine/gpu_backend.h"

namespace flashd::testing {

inline std::string TestBackendName() {
  const char* name = std::getenv("FLASHD_TEST_BACKEND");
  return name == nullptr || *name == '\0' ? "cpu" : name;
}

#ifdef FLASHD_GOLDEN_DIR
inline std::string GoldenDir() {
  const char* dir = std::getenv("FLASHD_TEST_GOLDEN_DIR");
  return dir == nullptr || *dir == '\0' ? FLASHD_GOLDEN_DIR : dir;
}
#endif

// FLASHD_TEST_GPU_GEMMS=matrix: a GPU backend's FP8/FP4 linears on matrix cores
// (engine.gpu_gemms), so that the forward pass's tests run once more that way.
inline bool TestMatrixGemms() {
  const char* gemms = std::getenv("FLASHD_TEST_GPU_GEMMS");
  return gemms != nullptr && std::string(gemms) == "matrix";
}

inline std::unique_ptr<engine::Backend> TestBackend(const std::string& name = TestBackendName()) {
  std::string reason;
  auto backend = engine::SelectBackend(name, &reason, 0, {.matrix_gemms = TestMatrixGemms()});
  if (!backend.ok()) {
    std::printf("SKIP: backend %s: %s\n", name.c_str(), backend.status().ToString().c_str());
    std::fflush(stdout);
    std::exit(77);
  }
  return std::move(*backend);
}

}  // namespace flashd::testing
