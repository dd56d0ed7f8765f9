// The CCCL adapters compiled by the host compiler (CI, no GPU): vmm::cuda_resource meets the
// cuda::mr async resource concept with device_accessible (static_assert), vmm::thrust_allocator
// meets what thrust::device_vector needs, and both work over a host-backend allocator (streams are
// tags there). Also: a TU that includes <cuda_runtime_api.h> first installs cudaMemcpy as the
// device_vector default copier before main().
#include <cuda_runtime_api.h>  // first, on purpose: see the last case

#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <cstdint>
#include <memory>
#include <type_traits>

#include "vmmalloc/adapters.hpp"
#include "support/host_alloc.hpp"
#include "vmmalloc/device_vector.hpp"

#ifndef VMM_HAVE_CUDA_MR
#error "CCCL's <cuda/memory_resource> is on the include path of this test but adapters.hpp did not enable cuda_resource"
#endif
#ifndef VMM_HAVE_THRUST_ALLOCATOR
#error "thrust is on the include path of this test but adapters.hpp did not enable thrust_allocator"
#endif

// ---- compile-time checks -----------------------------------------------------------------------

static_assert(cuda::mr::resource<vmm::cuda_resource>);
static_assert(cuda::mr::async_resource<vmm::cuda_resource>);
static_assert(cuda::mr::async_resource_with<vmm::cuda_resource, cuda::mr::device_accessible>);
static_assert(cuda::mr::resource_with<vmm::cuda_resource, cuda::mr::device_accessible>);
// It claims no host access (true on the host backend, false for device memory): not declared.
static_assert(!cuda::mr::async_resource_with<vmm::cuda_resource, cuda::mr::host_accessible>);

using talloc = vmm::thrust_allocator<int>;
using traits = std::allocator_traits<talloc>;
static_assert(std::is_same_v<traits::pointer, thrust::device_ptr<int>>);
static_assert(std::is_same_v<traits::rebind_alloc<double>, vmm::thrust_allocator<double>>);
static_assert(std::is_same_v<typename talloc::template rebind<char>::other, vmm::thrust_allocator<char>>);
static_assert(traits::propagate_on_container_move_assignment::value);
static_assert(!traits::is_always_equal::value);

namespace {
vmm::stream_t tag(std::uintptr_t k) { return reinterpret_cast<vmm::stream_t>(k); }
cudaStream_t cu_tag(std::uintptr_t k) { return reinterpret_cast<cudaStream_t>(k); }
}  // namespace

TEST_CASE("cuda_resource over the host backend: sync and stream-ordered allocation") {
  auto [hb, a] = vmm::test::make_host_alloc();
  vmm::cuda_resource r(a);
  CHECK(&r.upstream() == &a);

  void* p = r.allocate(1000);  // default alignment 256
  REQUIRE(p != nullptr);
  CHECK(reinterpret_cast<std::uintptr_t>(p) % 256 == 0);
  CHECK(a.usable_size(p) >= 1000);
  r.deallocate(p, 1000);
  CHECK(r.allocate(0) == nullptr);
  r.deallocate(nullptr, 0);

  void* q = r.allocate(3 << 20, 4096);
  CHECK(reinterpret_cast<std::uintptr_t>(q) % 4096 == 0);
  r.deallocate(q, 3 << 20, 4096);

  // Stream-ordered: a block freed on a stream whose work is pending is not handed to another one.
  hb->hold_stream(tag(0x10));
  void* s1 = r.allocate_async(1 << 20, 256, cuda::stream_ref(cu_tag(0x10)));
  REQUIRE(s1 != nullptr);
  r.deallocate_async(s1, 1 << 20, 256, cuda::stream_ref(cu_tag(0x10)));
  void* s2 = r.allocate_async(1 << 20, cuda::stream_ref(cu_tag(0x20)));
  CHECK(s2 != s1);  // stream 0x10's work is pending: its block is not reusable on 0x20 yet
  r.deallocate_async(s2, 1 << 20, cuda::stream_ref(cu_tag(0x20)));
  hb->complete_stream(tag(0x10));

  // Through the type-erased reference CCCL code takes.
  cuda::mr::async_resource_ref<cuda::mr::device_accessible> ref{r};
  void* t = ref.allocate_async(4096, 256, cuda::stream_ref(cu_tag(0x30)));
  CHECK(a.usable_size(t) >= 4096);
  ref.deallocate_async(t, 4096, 256, cuda::stream_ref(cu_tag(0x30)));

  // Bad input: thrown, nothing changed.
  CHECK_THROWS_AS(r.allocate(100, 3), vmm::error);
  int local = 0;
  CHECK_THROWS_AS(r.deallocate(&local, 4), vmm::error);
  CHECK(a.stats().live == 0);
  CHECK(a.check() == "");
}

TEST_CASE("cuda_resource equality is the allocator's identity") {
  auto a = vmm::allocator::host();
  auto b = vmm::allocator::host();
  CHECK(vmm::cuda_resource(a) == vmm::cuda_resource(a));
  CHECK(vmm::cuda_resource(a) != vmm::cuda_resource(b));
}

TEST_CASE("thrust_allocator over the host backend: allocate, rebind, equality, errors") {
  auto a = vmm::allocator::host();
  talloc al(a);
  thrust::device_ptr<int> p = al.allocate(1000);
  REQUIRE(thrust::raw_pointer_cast(p) != nullptr);
  CHECK(a.usable_size(thrust::raw_pointer_cast(p)) >= 1000 * sizeof(int));
  CHECK(a.stats().live == 1);
  al.deallocate(p, 1000);
  CHECK(a.stats().live == 0);
  CHECK(thrust::raw_pointer_cast(al.allocate(0)) == nullptr);

  traits::rebind_alloc<char> ac(al);  // what thrust does for temporary storage
  CHECK(ac == al);
  CHECK(ac.upstream_ptr() == &a);
  auto c = ac.allocate(5);
  ac.deallocate(c, 5);

  auto b = vmm::allocator::host();
  CHECK(talloc(a) != talloc(b));
  CHECK(talloc(a, tag(1)) != talloc(a));
  CHECK(talloc(a, tag(1)) == vmm::thrust_allocator<float>(a, tag(1)));

  // Overflowing count * sizeof(T) is out of memory, not a short block.
  CHECK_THROWS_AS(al.allocate(~std::size_t{0} / 2), vmm::out_of_memory);
  // Default-constructed: no allocator to draw from.
  talloc none;
  CHECK_THROWS_AS(none.allocate(1), vmm::error);
  none.deallocate(thrust::device_ptr<int>(), 0);  // harmless
  CHECK(a.stats().live == 0);
}

TEST_CASE("a TU with cudart installs cudaMemcpy as the device_vector default copier") {
  CHECK((vmm::default_device_copy() == &vmm::cudart_copy));
}
