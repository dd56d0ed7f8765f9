// SPDX-License-Identifier: Apache-2.0
// Consumer check, nvcc: vmmalloc's C++ headers and the cuda::mr adapter in a .cu file. It runs on
// the host backend and makes no CUDA call (the kernel is compiled, never launched): no GPU needed.
static_assert(__cplusplus >= 202002L, "nvcc did not compile this as C++20: cuda_std_20 did not reach it");

#include <cstdint>
#include <cstdio>

#include <vmmalloc/adapters.hpp>
#include <vmmalloc/vmmalloc.hpp>

#ifndef VMM_HAVE_CUDA_MR
#error "nvcc puts CCCL on the include path: adapters.hpp should have enabled vmm::cuda_resource"
#endif

__global__ void touch(char* p) { p[threadIdx.x] = 1; }

int main() {
  vmm::options o;
  o.reservation_size = std::size_t{1} << 30;
  vmm::allocator a = vmm::allocator::host(o);
  vmm::cuda_resource r(a);
#if VMM_CUDA_MR_STREAM_FIRST
  void* p = r.allocate_sync(4096);
  r.deallocate_sync(p, 4096);
#else
  void* p = r.allocate(4096);
  r.deallocate(p, 4096);
#endif
  const bool aligned = reinterpret_cast<std::uintptr_t>(p) % 256 == 0;
  if (!p || !aligned || a.stats().live != 0 || !a.check().empty()) {
    std::printf("consumer_cu FAILED: p=%p live=%zu\n", p, static_cast<std::size_t>(a.stats().live));
    return 1;
  }
  (void)&touch;
  std::printf("consumer_cu ok\n");
  return 0;
}
