// Compares a GPU backend's ScaleAdd with the CPU reference. Built once per backend; exits 77
// (ctest: skipped) with the reason printed when the machine has no usable device.
#include <boost/test/unit_test.hpp>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "kernels/cpu/scale_add.h"
#include "kernels/gpu/device.h"
#include "tests/support/require_device.h"

namespace backend = flashd::kernels::FLASHD_GPU_BACKEND;

namespace {

using flashd::testing::RequireDevice;
BOOST_TEST_GLOBAL_FIXTURE(RequireDevice);

BOOST_AUTO_TEST_CASE(scale_add_matches_cpu_reference) {
  struct Case {
    size_t n;
    float a;
    float b;
  };
  const Case cases[] = {
      {1, 2.0f, 1.0f}, {31, -0.5f, 3.0f}, {256, 1.0f, 0.0f}, {1000, 3.25f, -7.0f}};
  for (const Case& c : cases) {
    std::vector<float> x(c.n), want(c.n), got(c.n, -1.0f);
    for (size_t i = 0; i < c.n; ++i) x[i] = static_cast<float>(i) * 0.25f - 3.0f;
    flashd::kernels::cpu::ScaleAdd(x.data(), c.a, c.b, want.data(), c.n);
    std::string err = backend::ScaleAddRoundTrip(x.data(), c.a, c.b, got.data(), c.n);
    BOOST_REQUIRE_MESSAGE(err.empty(), err);
    for (size_t i = 0; i < c.n; ++i) BOOST_TEST(got[i] == want[i], "n=" << c.n << " i=" << i);
  }
}

}  // namespace
