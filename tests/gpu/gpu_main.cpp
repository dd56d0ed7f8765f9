// SPDX-License-Identifier: Apache-2.0
// doctest main of the GPU test programs. Exits 77 (ctest: skipped) when there is no CUDA device or
// no CUDA driver, after saying why; otherwise runs the cases like any doctest program.
//
// Extra options (taken out before doctest sees the command line), also settable as environment:
//   --stress-ops=N       VMM_GPU_STRESS_OPS       total operations of the stress case (20000)
//   --stress-threads=N   VMM_GPU_STRESS_THREADS   threads of the stress case (16)
//   --stress-max=BYTES   VMM_GPU_STRESS_MAX_BYTES largest stress allocation (64 MiB)
//   VMM_GPU_SKIP_MEMINFO=1       report cudaMemGetInfo comparisons instead of asserting them
//   VMM_GPU_MEMINFO_SLACK_MIB=N  tolerance of those comparisons (8 MiB)
//   VMM_GPU_MIN_DEVICES=N        exit 77 unless at least N devices are present
//   VMM_GPU_SPIN_MS=N            how long the stream-order cases keep a stream busy (50 ms)
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "gpu_util.cuh"
#include "vmmalloc/cuda_backend.hpp"
#include "vmmalloc/vmmalloc.hpp"

namespace {

constexpr int kSkip = 77;

// "--stress-ops=N" -> setenv("VMM_GPU_STRESS_OPS", "N"). Returns true when the argument was ours.
bool take_option(const char* arg) {
  static const struct {
    const char* flag;
    const char* env;
  } map[] = {{"--stress-ops=", "VMM_GPU_STRESS_OPS"},
             {"--stress-threads=", "VMM_GPU_STRESS_THREADS"},
             {"--stress-max=", "VMM_GPU_STRESS_MAX_BYTES"}};
  for (const auto& m : map) {
    const std::size_t k = std::strlen(m.flag);
    if (std::strncmp(arg, m.flag, k) == 0) {
      setenv(m.env, arg + k, 1);
      return true;
    }
  }
  return false;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<char*> args;
  for (int i = 0; i < argc; ++i)
    if (i == 0 || !take_option(argv[i])) args.push_back(argv[i]);

  // Listing or help needs no device.
  bool listing = false;
  for (std::size_t i = 1; i < args.size(); ++i) {
    const std::string a = args[i];
    if (a.rfind("--list", 0) == 0 || a.rfind("-ltc", 0) == 0 || a.rfind("-lts", 0) == 0 ||
        a == "-h" || a == "--help" || a == "-?")
      listing = true;
  }

  if (!listing) {
    std::string why;
    const bool runtime_sees_device = gpu::has_device(&why);
    vmm::status backend_status;
    std::string backend_message;
    {
      vmm::cuda_backend probe(0);  // released before the runtime makes its context
      backend_status = probe.load_status();
      backend_message = probe.load_message();
    }
    if (!runtime_sees_device) {
      std::printf("SKIP (exit 77): no CUDA device: %s\n  vmmalloc's CUDA backend says: %s\n",
                  why.c_str(), backend_status.ok() ? "available" : backend_message.c_str());
      return kSkip;
    }
    if (!backend_status.ok()) {
      // The runtime sees a device but the backend cannot use it. No VMM support is a reason to
      // skip; anything else (the loader failing with a driver present) is a bug to report.
      if (backend_status.kind == vmm::errc::not_supported ||
          backend_status.kind == vmm::errc::no_driver) {
        std::printf("SKIP (exit 77): vmmalloc's CUDA backend is unavailable: %s\n",
                    backend_message.c_str());
        return kSkip;
      }
      std::printf("FAIL: the CUDA runtime sees a device but vmmalloc's CUDA backend failed: %s\n",
                  backend_message.c_str());
      return 1;
    }
    // VMM_GPU_MIN_DEVICES=N: a program (or one ctest entry) that needs N devices skips with 77
    // on a machine with fewer, so a one-GPU run shows it as skipped, not passed.
    if (const char* need = std::getenv("VMM_GPU_MIN_DEVICES")) {
      const int n = std::atoi(need), have = gpu::device_count();
      if (have < n) {
        std::printf("SKIP (exit 77): needs %d CUDA devices, this machine has %d\n", n, have);
        return kSkip;
      }
    }
    gpu::init();
    std::printf("GPU: %s\n", gpu::describe_device().c_str());
    std::fflush(stdout);
  }

  doctest::Context ctx(static_cast<int>(args.size()), args.data());
  const int rc = ctx.run();
  if (!listing) gpu::shutdown();
  return rc;
}
