// For tests built once per GPU backend: exits 77 (ctest: skipped) with the reason printed when
// the machine has no usable device. Use: BOOST_TEST_GLOBAL_FIXTURE(flashd::testing::RequireDevice).
#pragma once

#include <cstdio>
#include <cstdlib>
#include <string>

#include "kernels/gpu/device.h"

namespace flashd::testing {

struct RequireDevice {
  RequireDevice() {
    std::string reason;
    if (kernels::FLASHD_GPU_BACKEND::DeviceCount(&reason) == 0) {
      std::printf("SKIP: %s\n", reason.c_str());
      std::fflush(stdout);
      std::exit(77);
    }
  }
};

}  // namespace flashd::testing
