// The golden model (tests/golden) loaded once per test binary, for tests of the forward pass, on
// the backend FLASHD_TEST_BACKEND names (tests/support/test_backend.h).
// REQUIRES: the binary defines FLASHD_GOLDEN_DIR and links flashd_engine.
#pragma once

#include <boost/test/unit_test.hpp>
#include <memory>

#include "engine/forward.h"
#include "tests/support/test_backend.h"

namespace flashd::testing {

inline const engine::CpuForward& GoldenForward() {
  static std::unique_ptr<engine::Model> model = [] {
    auto m = engine::Model::Load(GoldenDir());
    BOOST_REQUIRE_MESSAGE(m.ok(), m.status().ToString());
    return std::move(*m);
  }();
  // Kept until the process ends: a GPU runtime must not be called from static destructors
  // (the HIP CPU runtime's worker pool is gone by then).
  static engine::CpuForward* fwd = [] {
    auto f = engine::CpuForward::Create(*model, "", 64, TestBackend());
    BOOST_REQUIRE_MESSAGE(f.ok(), f.status().ToString());
    return f->release();
  }();
  return *fwd;
}

}  // namespace flashd::testing
