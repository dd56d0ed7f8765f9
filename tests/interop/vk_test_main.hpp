// SPDX-License-Identifier: Apache-2.0
// Shared by the Vulkan test programs: a doctest main that opens the Vulkan context first and exits
// 77 (ctest: skipped) with the reason when there is none. VMM_VK_REQUIRE=1 turns that skip into a
// failure (for runs on the GPU machine, where a skip would hide a broken setup).
#pragma once

#include <doctest/doctest.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>

#include "vmmalloc/vulkan_interop.hpp"

namespace vktest {

constexpr int kSkip = 77;

inline std::unique_ptr<vmm::vk::context>& ctx_slot() {
  static std::unique_ptr<vmm::vk::context> c;
  return c;
}
inline vmm::vk::context& ctx() { return *ctx_slot(); }

inline bool require() {
  const char* e = std::getenv("VMM_VK_REQUIRE");
  return e && std::strcmp(e, "1") == 0;
}

// Prints why and returns the exit code for "cannot run here".
inline int skip(const std::string& why) {
  if (require()) {
    std::printf("FAIL: %s (VMM_VK_REQUIRE=1: skipping not allowed)\n", why.c_str());
    return 1;
  }
  std::printf("SKIP (exit 77): %s\n", why.c_str());
  return kSkip;
}

inline bool listing(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--list", 0) == 0 || a.rfind("-ltc", 0) == 0 || a.rfind("-lts", 0) == 0 || a == "-h" ||
        a == "--help" || a == "-?")
      return true;
  }
  return false;
}

// open: makes the context (throws vmm::error). Missing loader / ICD / device / extension: skip.
inline int run(int argc, char** argv, const std::function<vmm::vk::context()>& open) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  if (!listing(argc, argv)) {
    try {
      ctx_slot() = std::make_unique<vmm::vk::context>(open());
    } catch (const vmm::error& e) {
      const vmm::errc k = e.st().kind;
      if (k == vmm::errc::no_driver || k == vmm::errc::not_supported)
        return skip(std::string("Vulkan unavailable: ") + e.what());
      std::printf("FAIL: opening Vulkan: %s\n", e.what());
      return 1;
    }
    const auto& i = ctx().info();
    std::printf("Vulkan loader %s; device %s\n", vmm::vk::version_string(i.loader_version).c_str(),
                vmm::vk::describe(i).c_str());
  }
  doctest::Context dc(argc, argv);
  const int rc = dc.run();
  ctx_slot().reset();
  return rc;
}

}  // namespace vktest
