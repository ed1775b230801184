// For tests built once per GPU backend: exits 77 (ctest: skipped) with the reason printed when
// the machine has no usable device. Use: BOOST_TEST_GLOBAL_FIXTURE(flashd::testing::RequireDevice).
// Kernels then start as the GPU backend starts them: early where the device has it
// (GpuOptions::early_launch), in turn with FLASHD_TEST_LAUNCH=in-turn; a line says which.
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
    const char* launch = std::getenv("FLASHD_TEST_LAUNCH");
    const bool early = kernels::FLASHD_GPU_BACKEND::SetEarlyLaunch(
        launch == nullptr || std::string(launch) != "in-turn");
    std::printf("kernels start %s\n", early ? "early" : "in turn");
    std::fflush(stdout);
  }
};

}  // namespace flashd::testing
