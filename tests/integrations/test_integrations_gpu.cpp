// SPDX-License-Identifier: Apache-2.0
// GPU cases of the adapters and device_vector (doctest, host compiler; kernels and thrust in
// integrations_gpu.cu). main() is tests/gpu's: exit 77 without a device or driver.
//
//  * thrust::sort on thrust::device_vector<int, vmm::thrust_allocator<int>> (1M random ints)
//  * device_vector<float>: written by a kernel, grown, pointer and contents kept, thrust::reduce
//  * cuda_resource: stream-ordered allocate / kernel / deallocate on a stream
//  * pmr_resource over the CUDA backend with location host_numa (its own ctest entry: see below)
#include "gpu_util.cuh"  // <cuda_runtime.h> before device_vector.hpp: cudaMemcpy is its copier

#include <doctest/doctest.h>

#include <csetjmp>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <memory_resource>
#include <vector>

#include "integrations_gpu.cuh"
#include "vmmalloc/adapters.hpp"
#include "vmmalloc/device_vector.hpp"

#ifndef VMM_HAVE_CUDA_MR
#error "the GPU test needs CCCL's <cuda/memory_resource> on the include path"
#endif

TEST_CASE("thrust::sort on thrust::device_vector<int, vmm::thrust_allocator<int>>") {
  vmm::allocator a;
  const std::string err = itest::thrust_sort_case(a, std::size_t{1} << 20, 12345);
  INFO("thrust_sort_case: ", err);
  CHECK(err.empty());
  CHECK(a.stats().live == 0);  // the vector and the sort's temporaries came back
  CHECK(a.check() == "");
}

TEST_CASE("device_vector<float>: a kernel's data survives growth at the same address; thrust::reduce") {
  REQUIRE((vmm::default_device_copy() == &vmm::cudart_copy));
  const std::size_t n = std::size_t{1} << 20;  // 4 MiB of float
  auto v = vmm::device_vector<float>::cuda(std::size_t{1} << 28);  // 1 GiB of VA, nothing mapped
  CHECK_FALSE(v.host_accessible());
  CHECK(v.max_size() == (std::size_t{1} << 28));

  v.resize(n);
  float* const p = v.data();
  itest::fill_index_mod(p, 0, n);
  GPU_CHECK(cudaDeviceSynchronize());

  v.resize(4 * n);  // maps 12 MiB more at the tail
  CHECK(v.data() == p);
  CHECK(v.size() == 4 * n);
  CHECK(v.capacity() >= 4 * n);
  CHECK(itest::count_index_mod_mismatches(v.data(), n) == 0);  // old contents, read on the GPU

  itest::fill_value(v.data(), n, 4 * n, 1.0f);
  GPU_CHECK(cudaDeviceSynchronize());
  // Exact in double: sum of (i % 1024) over n elements, plus 3n ones.
  const double want = static_cast<double>(n / 1024) * (1023.0 * 1024.0 / 2.0) + 3.0 * n;
  CHECK(itest::thrust_sum(v.data(), v.size()) == want);

  // Host copies through cudaMemcpy.
  CHECK(v.get(5) == 5.0f);
  CHECK(v.get(1024 + 7) == 7.0f);
  v.push_back(7.5f);
  CHECK(v.size() == 4 * n + 1);
  CHECK(v.get(4 * n) == 7.5f);
  std::vector<float> head(2048);
  v.copy_to_host(head.data(), head.size());
  bool head_ok = true;
  for (std::size_t i = 0; i < head.size(); ++i) head_ok &= head[i] == static_cast<float>(i % 1024);
  CHECK(head_ok);
  CHECK_THROWS_AS((void)v.at(0), vmm::error);  // device memory: no host references

  // Shrinking returns the tail chunk at once; the head stays.
  const std::size_t cap = v.capacity();
  v.resize(n);
  CHECK(v.capacity() < cap);
  CHECK(v.data() == p);
  CHECK(itest::count_index_mod_mismatches(v.data(), n) == 0);
  v.clear();
  CHECK(v.capacity() == 0);
}

// In the form of the toolkit's CCCL (adapters.hpp): 3.1+ allocate(stream, ...) / 3.0 allocate_async.
#if VMM_CUDA_MR_STREAM_FIRST
using device_ref = cuda::mr::resource_ref<cuda::mr::device_accessible>;
void* mr_allocate(auto& r, std::size_t n, cudaStream_t s) { return r.allocate(cuda::stream_ref(s), n, 256); }
void mr_deallocate(auto& r, void* p, std::size_t n, cudaStream_t s) { r.deallocate(cuda::stream_ref(s), p, n, 256); }
#else
using device_ref = cuda::mr::async_resource_ref<cuda::mr::device_accessible>;
void* mr_allocate(auto& r, std::size_t n, cudaStream_t s) { return r.allocate_async(n, 256, cuda::stream_ref(s)); }
void mr_deallocate(auto& r, void* p, std::size_t n, cudaStream_t s) { r.deallocate_async(p, n, 256, cuda::stream_ref(s)); }
#endif

TEST_CASE("cuda_resource: stream-ordered allocate, a kernel, deallocate on one stream") {
  vmm::allocator a;
  vmm::cuda_resource r(a);
  device_ref ref{r};
  cudaStream_t s = nullptr;
  GPU_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const std::size_t bytes = std::size_t{24} << 20;

  void* p = mr_allocate(ref, bytes, s);
  REQUIRE(p != nullptr);
  CHECK(a.usable_size(p) >= bytes);
  gpu::fill(p, bytes, 1, s);
  CHECK(gpu::verify(p, bytes, 1, s) == 0);
  mr_deallocate(ref, p, bytes, s);

  // Reuse on the same stream needs no wait: the next allocation may take the same block.
  void* q = mr_allocate(r, bytes, s);
  REQUIRE(q != nullptr);
  gpu::fill(q, bytes, 2, s);
  CHECK(gpu::verify(q, bytes, 2, s) == 0);
  mr_deallocate(r, q, bytes, s);

  GPU_CHECK(cudaStreamSynchronize(s));
  GPU_CHECK(cudaStreamDestroy(s));
  CHECK(a.stats().live == 0);
  CHECK(a.check() == "");
}

// ---- pmr over host_numa ------------------------------------------------------------------------
// Its own ctest entry (gpu.integrations.host_numa): if the CPU cannot touch the memory, the probe
// below turns the fault into a failed check instead of killing the other cases.

namespace {
sigjmp_buf g_probe;
void on_fault(int) { siglongjmp(g_probe, 1); }

// Writes and reads one byte at each end of [p, p + n) from the CPU; false if that faults.
bool cpu_can_touch(void* p, std::size_t n) {
  struct sigaction sa {}, old_segv{}, old_bus{};
  sa.sa_handler = on_fault;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGSEGV, &sa, &old_segv);
  sigaction(SIGBUS, &sa, &old_bus);
  bool ok = false;
  if (sigsetjmp(g_probe, 1) == 0) {
    volatile unsigned char* c = static_cast<unsigned char*>(p);
    c[0] = 1;
    c[n - 1] = 2;
    ok = c[0] == 1 && c[n - 1] == 2;
  }
  sigaction(SIGSEGV, &old_segv, nullptr);
  sigaction(SIGBUS, &old_bus, nullptr);
  return ok;
}
}  // namespace

TEST_CASE("pmr_resource over the CUDA backend, location host_numa") {
  vmm::options o;
  o.location = vmm::location_kind::host_numa;
  o.reservation_size = std::size_t{1} << 30;
  std::unique_ptr<vmm::allocator> a;
  try {
    a = std::make_unique<vmm::allocator>(o);
  } catch (const vmm::error& e) {
    if (e.st().kind == vmm::errc::not_supported) {
      MESSAGE("host_numa not supported here, case skipped: ", e.what());
      return;
    }
    throw;
  }
  vmm::pmr_resource r(*a);
  void* probe = nullptr;
  try {
    probe = r.allocate(4096, 64);  // the first cuMemCreate with CU_MEM_LOCATION_TYPE_HOST_NUMA
  } catch (const vmm::error& e) {
    if (e.st().kind == vmm::errc::not_supported) {
      MESSAGE("host_numa not supported here, case skipped: ", e.what());
      return;
    }
    throw;
  }
  const bool touch = cpu_can_touch(probe, 4096);
  INFO("the CPU faulted on host_numa memory mapped by the CUDA backend: cuda_backend::set_access "
       "must also grant CU_MEM_LOCATION_TYPE_HOST_NUMA access for host_numa chunks");
  REQUIRE(touch);

  // The GPU writes a pattern into the same memory; the CPU reads it back.
  const std::size_t bytes = std::size_t{4} << 20;
  void* g = r.allocate(bytes, 256);
  gpu::fill(g, bytes, 9);
  GPU_CHECK(cudaDeviceSynchronize());
  std::size_t bad = 0;
  for (std::size_t b = 0; b < bytes; ++b)
    bad += static_cast<unsigned char*>(g)[b] != gpu::pattern_byte(9, b);
  CHECK(bad == 0);
  r.deallocate(g, bytes, 256);
  r.deallocate(probe, 4096, 64);

  {
    std::pmr::vector<int> v(&r);
    for (int i = 0; i < 100'000; ++i) v.push_back(i);
    bool ok = true;
    for (int i = 0; i < 100'000; ++i) ok &= v[i] == i;
    CHECK(ok);
  }
  CHECK(a->stats().live == 0);
  CHECK(a->check() == "");
}
