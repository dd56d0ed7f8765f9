// SPDX-License-Identifier: Apache-2.0
// The backend contract (contract.hpp) on the CUDA backend: the driver's own rules, checked through
// the same cases the host backends pass. The CPU never touches device memory here: contents are
// written and checked by kernels (gpu_util.cuh), access is read back with cuMemGetAccess, busy
// streams are real streams running a kernel. main() is tests/gpu/gpu_main.cpp: without a device
// this program exits 77.
#include <doctest/doctest.h>

#include <cuda.h>

#include "backend/contract.hpp"
#include "gpu_util.cuh"
#include "vmmalloc/cuda_backend.hpp"

namespace {

// cuMemGetAccess through the runtime's entry-point query (no link-time libcuda). Unlike
// gpu::mem_access_flags it does not abort on a driver error: nullopt, "no answer".
std::optional<vmm::access_mode> driver_access(std::uintptr_t va, int device) {
  using fn_t = CUresult (*)(unsigned long long*, const CUmemLocation*, CUdeviceptr);
  static fn_t fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    GPU_CHECK(cudaGetDriverEntryPointByVersion("cuMemGetAccess", &f, 12000, cudaEnableDefault, &q));
    REQUIRE(q == cudaDriverEntryPointSuccess);
    REQUIRE(f != nullptr);
    return reinterpret_cast<fn_t>(f);
  }();
  CUmemLocation loc{};
  loc.type = CU_MEM_LOCATION_TYPE_DEVICE;
  loc.id = device;
  unsigned long long flags = 0;
  const CUresult r = fn(&flags, &loc, static_cast<CUdeviceptr>(va));
  if (r != CUDA_SUCCESS) return std::nullopt;
  switch (flags) {
    case CU_MEM_ACCESS_FLAGS_PROT_NONE: return vmm::access_mode::none;
    case CU_MEM_ACCESS_FLAGS_PROT_READ: return vmm::access_mode::read;
    case CU_MEM_ACCESS_FLAGS_PROT_READWRITE: return vmm::access_mode::read_write;
    default: FAIL("cuMemGetAccess returned unknown flags " << flags); return std::nullopt;
  }
}

struct cuda_traits {
  static constexpr const char* name = "cuda";
  static constexpr bool host_access = false;
  static std::unique_ptr<vmm::backend_iface> make() {
    auto b = vmm::make_backend<vmm::cuda_backend>(0);
    auto* cb = vmm::backend_cast<vmm::cuda_backend>(*b);
    REQUIRE(cb != nullptr);
    REQUIRE_MESSAGE(cb->available(), cb->load_message());  // main() skipped already if it cannot be
    return b;
  }
  static void fill(vmm::backend_iface&, std::uintptr_t va, std::size_t n, std::uint64_t seed) {
    gpu::fill(reinterpret_cast<void*>(va), n, seed, nullptr);
    GPU_CHECK(cudaStreamSynchronize(nullptr));
  }
  static bool verify(vmm::backend_iface&, std::uintptr_t va, std::size_t n, std::uint64_t seed) {
    const std::uint64_t bad = gpu::verify(reinterpret_cast<const void*>(va), n, seed, nullptr);
    if (bad) MESSAGE(bad << " of " << n << " bytes at " << va << " differ from pattern " << seed);
    return bad == 0;
  }
  static std::optional<vmm::access_mode> access_of(vmm::backend_iface&, std::uintptr_t va, int device) {
    return driver_access(va, device);
  }
  static vmm::stream_t stream(int i) { return gpu::stream(i); }
  // A kernel rewriting [va, va + n) for VMM_GPU_SPIN_MS (50 ms): the fence recorded after it is
  // pending for that long, and wait_fence() has to block for it.
  static void keep_busy(vmm::backend_iface&, vmm::stream_t s, std::uintptr_t va, std::size_t n) {
    gpu::spin_fill(reinterpret_cast<void*>(va), n, 99, gpu::env_u64("VMM_GPU_SPIN_MS", 50) * 1000000ull,
                   static_cast<cudaStream_t>(s));
  }
  static void finish(vmm::backend_iface&, vmm::stream_t) {}  // the kernel ends by itself
  static int device_count() { return gpu::device_count(); }
  static bool peer_truth(int d, int p) {
    if (p >= device_count()) return false;
    int can = 0;
    GPU_CHECK(cudaDeviceCanAccessPeer(&can, d, p));
    // The accessing device must map VMM memory itself (a plain attribute read; -1: unknown).
    const int vmm = vmm::cuda_backend(d).attribute(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, d);
    return can != 0 && vmm != 0;
  }
  static std::optional<std::size_t> mem_slack() {
    if (gpu::skip_meminfo_checks()) return std::nullopt;  // compute-sanitizer takes memory of its own
    return gpu::env_u64("VMM_GPU_MEMINFO_SLACK_MIB", 8) << 20;
  }
};

}  // namespace

TYPE_TO_STRING(cuda_traits);

VMM_CONTRACT_INVOKE(cuda_traits);
