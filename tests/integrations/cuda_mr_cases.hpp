// SPDX-License-Identifier: Apache-2.0
// vmm::cuda_resource against the cuda::mr concepts of whichever CCCL is on the include path, and
// over a host-backend allocator (streams are tags there). Included by test_integrations_cccl.cpp
// (the toolkit's CCCL) and test_integrations_cccl_standin.cpp (CCCL 3.1's interface, stand-in).
// Define VMM_TEST_NO_RESOURCE_REF where cuda::mr::resource_ref is not available.
#pragma once

#include <doctest/doctest.h>

#include <cstdint>

#include "support/host_alloc.hpp"
#include "vmmalloc/adapters.hpp"

#ifndef VMM_HAVE_CUDA_MR
#error "CCCL's <cuda/memory_resource> is on the include path of this test but adapters.hpp did not enable cuda_resource"
#endif

namespace mr_cases {

inline cudaStream_t tag(std::uintptr_t k) { return reinterpret_cast<cudaStream_t>(k); }
inline vmm::stream_t vtag(std::uintptr_t k) { return reinterpret_cast<vmm::stream_t>(k); }

// ---- compile-time: the concepts CCCL code and RMM constrain on -------------------------------------

#if VMM_CUDA_MR_STREAM_FIRST
static_assert(cuda::mr::synchronous_resource<vmm::cuda_resource>);
static_assert(cuda::mr::resource<vmm::cuda_resource>);
static_assert(cuda::mr::resource_with<vmm::cuda_resource, cuda::mr::device_accessible>);
static_assert(cuda::mr::synchronous_resource_with<vmm::cuda_resource, cuda::mr::device_accessible>);
// It claims no host access (true on the host backend, false for device memory): not declared.
static_assert(!cuda::mr::resource_with<vmm::cuda_resource, cuda::mr::host_accessible>);
// The 3.0 names are gone in this form: one set of names per CCCL, as CCCL itself has.
template <class R>
concept has_v30_names = requires(R& r, cuda::stream_ref s) { r.allocate_async(std::size_t{1}, std::size_t{1}, s); };
static_assert(!has_v30_names<vmm::cuda_resource>);

// Generic code written against CCCL 3.1+ (as RMM's is): only the concept, nothing of vmm.
template <class R>
  requires cuda::mr::resource_with<R, cuda::mr::device_accessible>
void* generic_allocate(R& r, cuda::stream_ref s, std::size_t bytes) {
  return r.allocate(s, bytes, cuda::mr::default_cuda_malloc_alignment);
}
template <class R>
  requires cuda::mr::resource_with<R, cuda::mr::device_accessible>
void generic_deallocate(R& r, cuda::stream_ref s, void* p, std::size_t bytes) {
  r.deallocate(s, p, bytes, cuda::mr::default_cuda_malloc_alignment);
}
#else
static_assert(cuda::mr::resource<vmm::cuda_resource>);
static_assert(cuda::mr::async_resource<vmm::cuda_resource>);
static_assert(cuda::mr::async_resource_with<vmm::cuda_resource, cuda::mr::device_accessible>);
static_assert(cuda::mr::resource_with<vmm::cuda_resource, cuda::mr::device_accessible>);
static_assert(!cuda::mr::async_resource_with<vmm::cuda_resource, cuda::mr::host_accessible>);

template <class R>
  requires cuda::mr::async_resource_with<R, cuda::mr::device_accessible>
void* generic_allocate(R& r, cuda::stream_ref s, std::size_t bytes) {
  return r.allocate_async(bytes, cuda::mr::default_cuda_malloc_alignment, s);
}
template <class R>
  requires cuda::mr::async_resource_with<R, cuda::mr::device_accessible>
void generic_deallocate(R& r, cuda::stream_ref s, void* p, std::size_t bytes) {
  r.deallocate_async(p, bytes, cuda::mr::default_cuda_malloc_alignment, s);
}
#endif

// The synchronous pair under either name.
inline void* sync_allocate(vmm::cuda_resource& r, std::size_t bytes, std::size_t align = 256) {
#if VMM_CUDA_MR_STREAM_FIRST
  return r.allocate_sync(bytes, align);
#else
  return r.allocate(bytes, align);
#endif
}
inline void sync_deallocate(vmm::cuda_resource& r, void* p, std::size_t bytes, std::size_t align = 256) {
#if VMM_CUDA_MR_STREAM_FIRST
  r.deallocate_sync(p, bytes, align);
#else
  r.deallocate(p, bytes, align);
#endif
}

}  // namespace mr_cases

TEST_CASE("cuda_resource over the host backend: synchronous and stream-ordered allocation") {
  using namespace mr_cases;
  auto [hb, a] = vmm::test::make_host_alloc();
  vmm::cuda_resource r(a);
  CHECK(&r.upstream() == &a);

  void* p = sync_allocate(r, 1000);
  REQUIRE(p != nullptr);
  CHECK(reinterpret_cast<std::uintptr_t>(p) % 256 == 0);
  CHECK(a.usable_size(p) >= 1000);
  sync_deallocate(r, p, 1000);
  CHECK(sync_allocate(r, 0) == nullptr);
  sync_deallocate(r, nullptr, 0);

  void* q = sync_allocate(r, 3 << 20, 4096);
  CHECK(reinterpret_cast<std::uintptr_t>(q) % 4096 == 0);
  sync_deallocate(r, q, 3 << 20, 4096);

  // Stream-ordered: a block freed on a stream whose work is pending is not handed to another one.
  hb->hold_stream(vtag(0x10));
  void* s1 = generic_allocate(r, cuda::stream_ref(tag(0x10)), 1 << 20);
  REQUIRE(s1 != nullptr);
  generic_deallocate(r, cuda::stream_ref(tag(0x10)), s1, 1 << 20);
  void* s2 = generic_allocate(r, cuda::stream_ref(tag(0x20)), 1 << 20);
  CHECK(s2 != s1);  // stream 0x10's work is pending: its block is not reusable on 0x20 yet
  generic_deallocate(r, cuda::stream_ref(tag(0x20)), s2, 1 << 20);
  hb->complete_stream(vtag(0x10));

  // Default alignment of the stream-ordered call: 256.
#if VMM_CUDA_MR_STREAM_FIRST
  void* d = r.allocate(cuda::stream_ref(tag(0x30)), 100);
  CHECK(reinterpret_cast<std::uintptr_t>(d) % 256 == 0);
  r.deallocate(cuda::stream_ref(tag(0x30)), d, 100);
#else
  void* d = r.allocate_async(100, cuda::stream_ref(tag(0x30)));
  CHECK(reinterpret_cast<std::uintptr_t>(d) % 256 == 0);
  r.deallocate_async(d, 100, cuda::stream_ref(tag(0x30)));
#endif

#ifndef VMM_TEST_NO_RESOURCE_REF
  // Through the type-erased reference CCCL code takes.
#if VMM_CUDA_MR_STREAM_FIRST
  cuda::mr::resource_ref<cuda::mr::device_accessible> ref{r};
  void* t = ref.allocate(cuda::stream_ref(tag(0x30)), 4096, 256);
  CHECK(a.usable_size(t) >= 4096);
  ref.deallocate(cuda::stream_ref(tag(0x30)), t, 4096, 256);
#else
  cuda::mr::async_resource_ref<cuda::mr::device_accessible> ref{r};
  void* t = ref.allocate_async(4096, 256, cuda::stream_ref(tag(0x30)));
  CHECK(a.usable_size(t) >= 4096);
  ref.deallocate_async(t, 4096, 256, cuda::stream_ref(tag(0x30)));
#endif
#endif

  // Bad input: thrown, nothing changed.
  CHECK_THROWS_AS(sync_allocate(r, 100, 3), vmm::error);
  int local = 0;
  CHECK_THROWS_AS(sync_deallocate(r, &local, 4), vmm::error);
  CHECK(a.stats().live == 0);
  CHECK(a.check() == "");
}

TEST_CASE("cuda_resource equality is the allocator's identity") {
  auto a = vmm::allocator::host();
  auto b = vmm::allocator::host();
  CHECK(vmm::cuda_resource(a) == vmm::cuda_resource(a));
  CHECK(vmm::cuda_resource(a) != vmm::cuda_resource(b));
}
