// The golden model (tests/golden) loaded once per test binary, for tests of the forward pass.
// REQUIRES: the binary defines FLASHD_GOLDEN_DIR and links flashd_engine.
#pragma once

#include <boost/test/unit_test.hpp>
#include <memory>

#include "engine/forward.h"

namespace flashd::testing {

inline const engine::CpuForward& GoldenForward() {
  static std::unique_ptr<engine::Model> model = [] {
    auto m = engine::Model::Load(FLASHD_GOLDEN_DIR);
    BOOST_REQUIRE_MESSAGE(m.ok(), m.status().ToString());
    return std::move(*m);
  }();
  static std::unique_ptr<engine::CpuForward> fwd = [] {
    auto f = engine::CpuForward::Create(*model);
    BOOST_REQUIRE_MESSAGE(f.ok(), f.status().ToString());
    return std::move(*f);
  }();
  return *fwd;
}

}  // namespace flashd::testing
