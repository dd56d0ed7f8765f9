// SPDX-License-Identifier: Apache-2.0
// The CCCL adapters compiled by the host compiler against the toolkit's CCCL (CI, no GPU):
// vmm::cuda_resource meets the cuda::mr concepts of that CCCL's form (cuda_mr_cases.hpp: 3.0's
// async_resource_with or 3.1+'s resource_with), vmm::thrust_allocator meets what
// thrust::device_vector needs, and both work over a host-backend allocator (streams are tags
// there). Also: a TU that includes <cuda_runtime_api.h> first installs cudaMemcpy as the
// device_vector default copier before main().
#include <cuda_runtime_api.h>  // first, on purpose: see the last case

#include <doctest/doctest.h>

#include <cstdint>
#include <memory>
#include <type_traits>

#include "vmmalloc/adapters.hpp"
#include "cuda_mr_cases.hpp"
#include "support/host_alloc.hpp"
#include "vmmalloc/device_vector.hpp"

#ifndef VMM_HAVE_THRUST_ALLOCATOR
#error "thrust is on the include path of this test but adapters.hpp did not enable thrust_allocator"
#endif

// ---- compile-time checks -----------------------------------------------------------------------

using talloc = vmm::thrust_allocator<int>;
using traits = std::allocator_traits<talloc>;
static_assert(std::is_same_v<traits::pointer, thrust::device_ptr<int>>);
static_assert(std::is_same_v<traits::rebind_alloc<double>, vmm::thrust_allocator<double>>);
static_assert(std::is_same_v<typename talloc::template rebind<char>::other, vmm::thrust_allocator<char>>);
static_assert(traits::propagate_on_container_move_assignment::value);
static_assert(!traits::is_always_equal::value);

namespace {
vmm::stream_t tag(std::uintptr_t k) { return reinterpret_cast<vmm::stream_t>(k); }
}  // namespace

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
