// SPDX-License-Identifier: Apache-2.0
// The conformance suite (tests/conformance.hpp) on the CUDA backend: real device memory, patterns
// written and checked by kernels, real non-blocking streams. main() is gpu_main.cpp: without a
// device this program exits 77.
#include <doctest/doctest.h>

#include "conformance.hpp"
#include "gpu_util.cuh"
#include "tuned.hpp"

namespace {

struct cuda_traits {
  static constexpr const char* name = "cuda";

  static vmm::allocator make(vmm::options o, const vmm::tuning& t = {}) { return gpu::tuned(o, t); }

  // Synchronous: the conformance cases read back right after, on the host thread.
  static void fill(void* p, std::size_t n, std::uint64_t seed) {
    gpu::fill(p, n, seed, nullptr);
    GPU_CHECK(cudaStreamSynchronize(nullptr));
  }

  static bool verify(const void* p, std::size_t n, std::uint64_t seed) {
    const std::uint64_t bad = gpu::verify(p, n, seed, nullptr);
    if (bad) MESSAGE(bad << " of " << n << " bytes at " << p << " differ from pattern " << seed);
    return bad == 0;
  }

  static bool device_memory(std::size_t& free, std::size_t& total) {
    if (gpu::skip_meminfo_checks()) return false;
    gpu::device_memory(free, total);
    return true;
  }

  static vmm::stream_t stream(int i) { return gpu::stream(i); }
};

}  // namespace

VMM_CONFORMANCE_INVOKE(cuda_traits)
