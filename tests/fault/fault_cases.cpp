// SPDX-License-Identifier: Apache-2.0
// Targeted fault-injection cases: regression tests for what the sweep found (the minimal
// reproducers, kept), stream-fence faults the sweep cannot observe (its streams
// are never held), and the C API.
//
// C API coverage: vmm_create builds its host allocator itself (vmm_policy has no way to pass a
// backend), so the fault decorator cannot be put under a C allocator. The C cases below use the
// host backend's own limits instead (host_physical_limit -> ENOMEM from create, memory_limit ->
// the policy's limit): real failures through the real path, but errno codes, not CUDA's.
#include <doctest/doctest.h>

#include <cstring>
#include <string>
#include <vector>

#include "support/pattern.hpp"
#include "support/fault_backend.hpp"
#include "support/stream_tag.hpp"
#include "vmmalloc/vmmalloc.h"
#include "vmmalloc/vmmalloc.hpp"

using namespace vmm;
using namespace vmm::test;

namespace {
constexpr std::size_t MiB = std::size_t{1} << 20, GiB = std::size_t{1} << 30;

options small_opts() {
  options o;
  o.reservation_size = GiB;
  return o;
}
}  // namespace

// A chunk whose handle is to be released (trim, release threshold) and whose release() is refused
// (again when retried at once) keeps its handle parked: trim() reports the refusal, a later trim
// or the destructor releases it, and nothing outlives the allocator.
TEST_CASE("fault: a refused release() during trim is parked, reported and released later") {
  auto st = std::make_shared<fault_state>();
  {
    allocator a(make_fault_host(st), small_opts());
    void* p = a.allocate(3 * MiB);
    a.deallocate(p);
    st->arm(op::release, 1, fault::out_of_memory, /*sticky=*/true);
    bool reported = false;
    try {
      a.trim(0);
    } catch (const std::exception&) {
      reported = true;
    }
    st->disarm();
    CHECK(st->injected() == 2);  // refused, and again when retried at once
    CHECK(a.check() == "");
    CHECK(reported);
    CHECK(a.stats().physical > 0);  // the parked handle is still held
    a.trim(0);                      // a retry with the fault gone
    CHECK(a.stats().physical == 0);
  }
  CHECK(st->live_handles() == 0);
  CHECK(st->live_mappings() == 0);
  CHECK(st->live_reservations() == 0);
}

// trim() retries a refused unmap or release once, as a growth does: a refusal that does not
// repeat costs nothing.
TEST_CASE("fault: a release refused once during trim is retried at once") {
  auto st = std::make_shared<fault_state>();
  {
    allocator a(make_fault_host(st), small_opts());
    void* p = a.allocate(3 * MiB);
    a.deallocate(p);
    st->arm(op::release, 1, fault::out_of_memory);
    CHECK_NOTHROW(a.trim(0));
    CHECK(st->injected() == 1);
    CHECK(a.stats().physical == 0);
    CHECK(a.check() == "");
  }
  CHECK(st->live_handles() == 0);
  CHECK(st->live_mappings() == 0);
  CHECK(st->live_reservations() == 0);
}

// A refusal is reported by the call that met it, once: a later trim() that releases everything
// reports success.
TEST_CASE("fault: a refused release is reported once, not again by a later trim that succeeds") {
  auto st = std::make_shared<fault_state>();
  allocator a(make_fault_host(st), small_opts());
  void* p = a.allocate(3 * MiB);
  void* q = a.allocate(12 * MiB);
  a.deallocate(q);
  a.deallocate(p);
  st->arm(op::release, 1, fault::out_of_memory, /*sticky=*/true);
  CHECK_THROWS_AS(a.trim(0), vmm::out_of_memory);  // the refusal, reported
  st->disarm();
  CHECK(a.check() == "");
  CHECK_NOTHROW(a.trim(0));
  CHECK(a.stats().physical == 0);
  CHECK_NOTHROW(a.trim(0));
}

// A cross-stream free records a fence on the freeing stream so the slab's stream does not reuse
// the slot before the freeing stream is done. When that fence cannot be recorded the free is
// refused (error returned, pointer still allocated): handing the slot out at once would give the
// slab's stream memory the other stream may still be writing.
TEST_CASE("fault: record_fence failure on a cross-stream small free must not hand the slot out early") {
  auto st = std::make_shared<fault_state>();
  allocator a(make_fault_host(st), small_opts());
  host_backend* hb = st->host;
  REQUIRE(hb);
  hb->hold_stream(stream_tag(2));  // stream 2's work is pending

  // Stream 1 then allocates enough blocks of the class to drain any thread cache and reach the
  // slab's free slots: none of them may be p while stream 2 is pending.
  auto reused = [&](void* p) {
    std::vector<void*> v;
    bool hit = false;
    for (int i = 0; i < 512; ++i) {
      v.push_back(a.allocate(1000, 0, stream_tag(1)));
      hit |= v.back() == p;
    }
    for (void* q : v) a.deallocate(q, stream_tag(1));
    return hit;
  };
  SUBCASE("control: no fault -> the slot is held back") {
    void* p = a.allocate(1000, 0, stream_tag(1));
    a.deallocate(p, stream_tag(2));
    CHECK_FALSE(reused(p));
  }
  SUBCASE("fault in record_fence") {
    void* p = a.allocate(1000, 0, stream_tag(1));
    st->arm(op::record_fence, 1, fault::not_permitted);
    status d = a.try_deallocate(p, stream_tag(2));
    CHECK(st->injected() == 1);
    if (d.ok()) {
      CHECK_FALSE(reused(p));  // not back to stream 1 while stream 2 may write it
    } else {                   // refusing the free, with p still allocated, is fine too
      CHECK(a.usable_size(p) > 0);
      a.deallocate(p, stream_tag(2));
    }
  }
  CHECK(a.check() == "");
  hb->complete_stream(stream_tag(2));
}

// Before unmapping a chunk the heap waits for the fence of the stream that freed its blocks. When
// that fence cannot be recorded, trim() fails and the chunk stays mapped (a missing fence is never
// taken for a completed one).
TEST_CASE("fault: record_fence failure must not let trim unmap memory a pending stream may use") {
  auto st = std::make_shared<fault_state>();
  allocator a(make_fault_host(st), small_opts());
  host_backend* hb = st->host;
  REQUIRE(hb);
  hb->hold_stream(stream_tag(2));
  void* p = a.allocate(3 * MiB, 0, stream_tag(1));  // large path, its own chunk
  a.deallocate(p, stream_tag(2));                   // freed on stream 2, whose work is pending
  const std::size_t mapped = a.stats().mapped;
  REQUIRE(mapped > 0);

  SUBCASE("control: no fault -> trim waits for stream 2 (host: refuses, EPERM) and keeps the chunk") {
    CHECK_THROWS_AS(a.trim(0), vmm::error);
    CHECK(a.stats().mapped == mapped);
  }
  SUBCASE("fault in record_fence") {
    st->arm(op::record_fence, 1, fault::out_of_memory);
    bool threw = false;
    try {
      a.trim(0);
    } catch (const std::exception&) {
      threw = true;
    }
    CHECK(st->injected() == 1);
    CHECK(a.check() == "");
    CHECK(a.stats().mapped == mapped);  // still mapped: stream 2 may use it
    (void)threw;
  }
  hb->complete_stream(stream_tag(2));
  a.trim(0);
  CHECK(a.stats().mapped == 0);
  CHECK(a.check() == "");
}

// A failed unmap during trim leaves the chunk mapped and accounted; a later trim finishes.
TEST_CASE("fault: unmap refused during trim -> error reported, chunk kept, retry works") {
  auto st = std::make_shared<fault_state>();
  {
    allocator a(make_fault_host(st), small_opts());
    void* p = a.allocate(3 * MiB);
    fill_block(p, 3 * MiB, 7);
    void* q = a.allocate(5 * MiB);
    a.deallocate(q);
    st->arm(op::unmap, 1, fault::not_permitted, /*sticky=*/true);
    try {
      a.trim(0);
      FAIL("trim should report the refused unmap");
    } catch (const vmm::error& e) {
      CHECK(e.st().kind == errc::not_permitted);
      CHECK(e.st().code == 800);
      CHECK(std::string(e.st().name) == "CUDA_ERROR_NOT_PERMITTED");
      CHECK(e.code() == make_error_code(errc::not_permitted));
    }
    st->disarm();
    CHECK(a.check() == "");
    std::size_t bad;
    verify_block(p, 3 * MiB, 7, &bad);
    CHECK(bad == SIZE_MAX);
    a.trim(0);
    a.deallocate(p);
    a.trim(0);
    CHECK(a.stats().mapped == 0);
  }
  CHECK(st->nothing_live());
}

// Chunks side by side go back in one cuMemUnmap; when the driver refuses it, each range is
// unmapped alone, so one refusal neither loses the others nor leaves a mapping behind.
TEST_CASE("fault: an unmap of several mappings refused -> each range unmapped alone, nothing lost") {
  auto st = std::make_shared<fault_state>();
  {
    allocator a(make_fault_host(st), small_opts());
    void* p = a.allocate(256 * MiB);  // a huge block: handles of 16 MiB side by side
    a.deallocate(p);
    const std::uint64_t before = st->calls(op::unmap);
    const std::size_t handles = a.stats().physical / (16 * MiB);
    REQUIRE(handles > 1);
    st->arm(op::unmap, 1, fault::not_permitted);  // the first unmap only: the joint one
    a.trim(0);
    CHECK(st->injected() == 1);
    CHECK(st->calls(op::unmap) - before == 1 + handles);  // refused together, then one a range
    CHECK(a.stats().mapped == 0);
    CHECK(a.stats().physical == 0);
    CHECK(a.check() == "");
    // Without the fault the same return takes one call.
    p = a.allocate(256 * MiB);
    a.deallocate(p);
    const std::uint64_t again = st->calls(op::unmap);
    a.trim(0);
    CHECK(st->calls(op::unmap) - again == 1);
    CHECK(a.stats().physical == 0);
  }
  CHECK(st->nothing_live());
}

// Constructor faults: the allocator cannot open; the exception carries the driver's status and
// nothing is left behind.
TEST_CASE("fault: reserve refused -> constructor throws out_of_memory, nothing leaked") {
  auto st = std::make_shared<fault_state>();
  st->arm(op::reserve, 1, fault::out_of_memory);
  try {
    allocator a(make_fault_host(st), small_opts());
    FAIL("constructor should throw");
  } catch (const vmm::out_of_memory& e) {
    CHECK(e.st().code == 2);
    CHECK(std::string(e.st().op) == "cuMemAddressReserve");
  }
  CHECK(st->nothing_live());
  st->arm(op::granularity, 1, fault::invalid_value);
  CHECK_THROWS_AS(allocator(make_fault_host(st), small_opts()), vmm::error);
  CHECK(st->nothing_live());
}

// ---- C API: failures through the real host limits (no injection possible, see the top) ----

TEST_CASE("C API: physical limit reached -> NULL, VMM_ERROR_OUT_OF_MEMORY, allocator intact") {
  vmm_policy pol;
  vmm_policy_init(&pol);
  pol.backend = VMM_BACKEND_HOST;
  pol.reservation_size = GiB;
  pol.host_physical_limit = 64 * MiB;
  vmm_allocator* a = nullptr;
  REQUIRE(vmm_create(&pol, &a) == VMM_SUCCESS);
  void* keep = vmm_malloc(a, 8 * MiB);
  REQUIRE(keep);
  std::memset(keep, 0x5a, 8 * MiB);
  vmm_stats before{};
  REQUIRE(vmm_get_stats(a, &before) == VMM_SUCCESS);

  void* p = vmm_malloc(a, 100 * MiB);
  CHECK(p == nullptr);
  CHECK(vmm_last_status() == VMM_ERROR_OUT_OF_MEMORY);
  CHECK(std::strlen(vmm_last_error()) > 0);
  CHECK(std::strstr(vmm_last_error(), "ENOMEM") != nullptr);  // the backend's own error name
  CHECK(vmm_check(a) == VMM_SUCCESS);
  vmm_stats after{};
  REQUIRE(vmm_get_stats(a, &after) == VMM_SUCCESS);
  CHECK(after.requested == before.requested);
  CHECK(after.live == before.live);

  void* q = vmm_malloc(a, 4 * MiB);  // still works
  CHECK(q != nullptr);
  CHECK(vmm_last_error()[0] == '\0');
  CHECK(vmm_free(a, q) == VMM_SUCCESS);
  for (std::size_t i = 0; i < 8 * MiB; i += 4096) CHECK_FALSE(static_cast<unsigned char*>(keep)[i] != 0x5a);
  CHECK(vmm_free(a, keep) == VMM_SUCCESS);
  CHECK(vmm_trim(a, 0) == VMM_SUCCESS);
  CHECK(vmm_check(a) == VMM_SUCCESS);
  vmm_destroy(a);
}

TEST_CASE("C API: policy memory_limit reached -> NULL, VMM_ERROR_OUT_OF_MEMORY, allocator intact") {
  vmm_policy pol;
  vmm_policy_init(&pol);
  pol.backend = VMM_BACKEND_HOST;
  pol.reservation_size = GiB;
  pol.memory_limit = 16 * MiB;
  vmm_allocator* a = nullptr;
  REQUIRE(vmm_create(&pol, &a) == VMM_SUCCESS);
  CHECK(vmm_malloc(a, 32 * MiB) == nullptr);
  CHECK(vmm_last_status() == VMM_ERROR_OUT_OF_MEMORY);
  CHECK(std::strlen(vmm_last_error()) > 0);
  CHECK(vmm_check(a) == VMM_SUCCESS);
  void* q = vmm_malloc(a, 1 * MiB);
  CHECK(q != nullptr);
  CHECK(vmm_free(a, q) == VMM_SUCCESS);
  // At run time: raised, the 32 MiB block fits; back to 0 = no limit; NULLs refused.
  std::size_t limit = 1;
  CHECK(vmm_get_memory_limit(a, &limit) == VMM_SUCCESS);
  CHECK(limit == 16 * MiB);
  CHECK(vmm_set_memory_limit(a, 64 * MiB) == VMM_SUCCESS);
  void* big = vmm_malloc(a, 32 * MiB);
  CHECK(big != nullptr);
  CHECK(vmm_free(a, big) == VMM_SUCCESS);
  CHECK(vmm_set_memory_limit(a, 0) == VMM_SUCCESS);
  CHECK(vmm_get_memory_limit(a, &limit) == VMM_SUCCESS);
  CHECK(limit == 0);
  CHECK(vmm_set_memory_limit(nullptr, MiB) == VMM_ERROR_INVALID_VALUE);
  CHECK(std::string(vmm_last_error()).find("allocator is NULL") != std::string::npos);
  CHECK(vmm_get_memory_limit(a, nullptr) == VMM_ERROR_INVALID_VALUE);
  CHECK(vmm_check(a) == VMM_SUCCESS);
  vmm_destroy(a);
}
