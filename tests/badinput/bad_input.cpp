// SPDX-License-Identifier: Apache-2.0
// Bad input: each misuse gives a clear error (or the documented no-op), the allocator's
// state is untouched (stats() equal before and after the bad call, check() == ""), and a normal
// allocate/deallocate still works afterwards.
//
// What each case expects (the table docs/errors.md carries):
//   double free (small, large, huge)          invalid_pointer (vmm::error), VMM_ERROR_INVALID_POINTER
//   free of a pointer never returned          invalid_pointer
//   free of an interior pointer               invalid_pointer
//   free(nullptr)                             no-op, success
//   size 0                                    invalid_value; C: NULL + VMM_ERROR_INVALID_VALUE
//   size > reservation, SIZE_MAX              out_of_memory (std::bad_alloc), no overflow
//   alignment not a power of two              invalid_value
//   alignment > granularity (2 MiB)           invalid_value
//   pointer of a destroyed allocator          invalid_pointer (unless the new allocator has since
//                                             handed out that very address: undetectable)
//   count x size overflow (allocate_array<T>,  out_of_memory, never a short block;
//                           vmm_calloc_n)     C: NULL + VMM_ERROR_OUT_OF_MEMORY
//
// A double free is detected only while the address is not handed out again: once another
// allocation reuses it, a second free of the old pointer frees the new block (as with any
// allocator without per-allocation generations).
#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "frontend/allocator_access.hpp"
#include "support/fault_backend.hpp"
#include "vmmalloc/vmmalloc.h"
#include "vmmalloc/vmmalloc.hpp"

using namespace vmm;
using namespace vmm::test;

namespace {
constexpr std::size_t KiB = std::size_t{1} << 10, MiB = std::size_t{1} << 20, GiB = std::size_t{1} << 30;

options opts() {
  options o;
  o.reservation_size = GiB;
  return o;
}
tuning tune() {
  tuning t;
  t.huge_threshold = 16 * MiB;
  return t;
}
host_backend_options host_opts() {
  host_backend_options h;
  h.physical_limit = 512 * MiB;
  return h;
}

// An allocator over the counting decorator (unarmed): leaks show after destruction.
struct fixture {
  std::shared_ptr<fault_state> st = std::make_shared<fault_state>();
  std::unique_ptr<allocator> a;
  explicit fixture(const options& o = opts(), const tuning& t = tune())
      : a(std::make_unique<allocator>(allocator_access::make(make_fault_host(st, host_opts()), o, t))) {}
  ~fixture() {
    a.reset();
    CHECK(st->nothing_live());
  }
};

// The parts of stats() a rejected call must not change.
void same_stats(const allocator_stats& x, const allocator_stats& y) {
  CHECK(x.requested == y.requested);
  CHECK(x.allocated == y.allocated);
  CHECK(x.live == y.live);
  CHECK(x.allocs == y.allocs);
  CHECK(x.frees == y.frees);
  CHECK(x.deferred == y.deferred);
  CHECK(x.mapped == y.mapped);
  CHECK(x.physical == y.physical);
  CHECK(x.chunks == y.chunks);
  CHECK(x.slab_bytes == y.slab_bytes);
  CHECK(x.free_chunk_bytes == y.free_chunk_bytes);
  CHECK(x.peak_mapped == y.peak_mapped);
}

// A normal allocate/deallocate of a few sizes still works and leaves stats as they were.
void still_works(allocator& a) {
  CHECK(a.check() == "");
  auto before = a.stats();
  for (std::size_t n : {std::size_t{100}, 8 * KiB, 300 * KiB, 20 * MiB}) {
    void* p = a.allocate(n);
    REQUIRE(p);
    std::memset(p, 0xab, std::min<std::size_t>(n, 64 * KiB));
    CHECK(a.usable_size(p) >= n);
    a.deallocate(p);
  }
  CHECK(a.check() == "");
  auto after = a.stats();
  CHECK(after.requested == before.requested);
  CHECK(after.live == before.live);
}

// deallocate(p) must be rejected with invalid_pointer, through both entry points, with the state
// untouched.
void expect_bad_free(allocator& a, void* p) {
  CAPTURE(p);
  CHECK(a.check() == "");
  auto before = a.stats();
  status s = a.try_deallocate(p);
  CHECK(s.kind == errc::invalid_pointer);
  CHECK(last_error().st.kind == errc::invalid_pointer);
  CHECK_FALSE(last_error().message.empty());
  try {
    a.deallocate(p);
    FAIL("deallocate should throw");
  } catch (const vmm::error& e) {
    CHECK(e.code() == make_error_code(errc::invalid_pointer));
    CHECK(e.st().kind == errc::invalid_pointer);
  }
  same_stats(before, a.stats());
  CHECK(a.check() == "");
  still_works(a);
}

// Comparison for a request that reached the backend and failed there (beyond the physical memory):
// before it reports out_of_memory the heap gives back what it holds free (empty slabs, wholly free
// chunks, idle handles) and tries once more, and that stays done when the request still fails. So
// what is held may only drop (mapped, physical, slab pages); what is live does not move at all.
void same_stats_after_backend_oom(const allocator_stats& x, const allocator_stats& y) {
  CHECK(x.requested == y.requested);
  CHECK(x.allocated == y.allocated);
  CHECK(x.live == y.live);
  CHECK(x.allocs == y.allocs);
  CHECK(x.frees == y.frees);
  CHECK(y.physical <= x.physical);
  CHECK(y.slab_bytes <= x.slab_bytes);
  CHECK(y.mapped <= x.mapped);
  CHECK(y.peak_physical == x.peak_physical);
  CHECK(y.reclaims > x.reclaims);  // the failure path did give memory back before it gave up
}

enum class compare { strict, backend_oom };

// allocate(n, align) must fail with `want`, through both entry points, with the state untouched.
void expect_bad_alloc(allocator& a, std::size_t n, std::size_t align, errc want, compare how = compare::strict) {
  CAPTURE(n);
  CAPTURE(align);
  auto before = a.stats();
  void* p = a.try_allocate(n, align);
  CHECK(p == nullptr);
  CHECK(last_error().st.kind == want);
  CHECK_FALSE(last_error().message.empty());
  if (want == errc::out_of_memory) {
    CHECK_THROWS_AS(a.allocate(n, align), vmm::out_of_memory);
    CHECK_THROWS_AS(a.allocate(n, align), std::bad_alloc);
  } else {
    try {
      a.allocate(n, align);
      FAIL("allocate should throw");
    } catch (const vmm::error& e) {
      CHECK(e.code() == make_error_code(want));
    }
  }
  if (how == compare::strict) same_stats(before, a.stats());
  else same_stats_after_backend_oom(before, a.stats());
  CHECK(a.check() == "");
  still_works(a);
}
}  // namespace

TEST_CASE("double free: small (size classes, thread cache)") {
  fixture f;
  void* keep = f.a->allocate(100);  // a neighbour in the same slab
  void* p = f.a->allocate(100);
  f.a->deallocate(p);
  expect_bad_free(*f.a, p);
  f.a->deallocate(keep);
  expect_bad_free(*f.a, keep);
}

TEST_CASE("double free: small, second free from another thread") {
  fixture f;
  void* p = f.a->allocate(100);
  f.a->deallocate(p);  // may sit in this thread's cache
  status s1, s2;
  std::thread t([&] {
    s1 = f.a->try_deallocate(p);
    void* q = f.a->allocate(100);  // the other thread's cache / slab
    f.a->deallocate(q);
    s2 = f.a->try_deallocate(q);
  });
  t.join();
  CHECK(s1.kind == errc::invalid_pointer);
  CHECK(s2.kind == errc::invalid_pointer);
  CHECK(f.a->check() == "");
  expect_bad_free(*f.a, p);
}

TEST_CASE("double free: small, freed on another stream (deferred free)") {
  fixture f;
  auto* hb = f.st->host;
  stream_t s1 = reinterpret_cast<stream_t>(1), s2 = reinterpret_cast<stream_t>(2);
  hb->hold_stream(s2);
  void* p = f.a->allocate(100, 0, s1);
  f.a->deallocate(p, s2);  // deferred until stream 2's fence completes
  expect_bad_free(*f.a, p);
  hb->complete_stream(s2);
  f.a->trim(0);
  expect_bad_free(*f.a, p);
}

TEST_CASE("double free: large") {
  fixture f;
  void* keep = f.a->allocate(300 * KiB);
  void* p = f.a->allocate(3 * MiB);
  f.a->deallocate(p);
  expect_bad_free(*f.a, p);
  f.a->deallocate(keep);
  expect_bad_free(*f.a, keep);
  f.a->trim(0);  // the chunk is gone: still a clear error
  expect_bad_free(*f.a, p);
}

TEST_CASE("double free: huge (cached, then released)") {
  fixture f;
  void* p = f.a->allocate(40 * MiB);
  f.a->deallocate(p);  // cached for a same-size request
  expect_bad_free(*f.a, p);
  f.a->trim(0);  // released
  expect_bad_free(*f.a, p);
}

TEST_CASE("free of a pointer never returned: stack, malloc, reservation, another allocator") {
  fixture f;
  int on_stack = 0;
  expect_bad_free(*f.a, &on_stack);
  auto heap_mem = std::make_unique<char[]>(64);
  expect_bad_free(*f.a, heap_mem.get());
  expect_bad_free(*f.a, reinterpret_cast<void*>(std::uintptr_t{1}));
  expect_bad_free(*f.a, reinterpret_cast<void*>(~std::uintptr_t{0} & ~std::uintptr_t{255}));

  // Addresses inside the reservation that were never handed out.
  auto* p = static_cast<char*>(f.a->allocate(3 * MiB));  // first chunk: at the reservation's base
  expect_bad_free(*f.a, p + 3 * MiB);          // start of the free rest of the chunk
  expect_bad_free(*f.a, p + 3 * MiB + 512 * KiB);  // middle of it
  expect_bad_free(*f.a, p + 256 * MiB);        // unmapped, far inside the 1 GiB reservation
  expect_bad_free(*f.a, p + GiB - 256);        // last 256 B of the reservation (p is its base)
  void* s = f.a->allocate(1000);
  expect_bad_free(*f.a, static_cast<char*>(s) + f.a->usable_size(s));  // the next slot, never used

  fixture g;  // a pointer of another live allocator
  void* q = g.a->allocate(1000);
  expect_bad_free(*f.a, q);
  g.a->deallocate(q);
  f.a->deallocate(s);
  f.a->deallocate(p);
}

TEST_CASE("free of an interior pointer: small, large, huge") {
  fixture f;
  auto* s = static_cast<char*>(f.a->allocate(1000));
  expect_bad_free(*f.a, s + 1);
  expect_bad_free(*f.a, s + 256);
  auto* l = static_cast<char*>(f.a->allocate(300 * KiB));
  expect_bad_free(*f.a, l + 1);
  expect_bad_free(*f.a, l + 4096);
  expect_bad_free(*f.a, l + 300 * KiB - 256);
  auto* h = static_cast<char*>(f.a->allocate(40 * MiB));
  expect_bad_free(*f.a, h + 256);
  expect_bad_free(*f.a, h + 4 * MiB);    // in a later page of the huge block
  expect_bad_free(*f.a, h + 40 * MiB - 256);
  // the blocks themselves are untouched and free normally
  f.a->deallocate(s);
  f.a->deallocate(l);
  f.a->deallocate(h);
  CHECK(f.a->stats().live == 0);
}

TEST_CASE("free(nullptr) is a no-op") {
  fixture f;
  void* keep = f.a->allocate(4 * KiB);
  auto before = f.a->stats();
  CHECK(f.a->try_deallocate(nullptr).ok());
  CHECK_NOTHROW(f.a->deallocate(nullptr));
  CHECK_NOTHROW(f.a->deallocate(nullptr, reinterpret_cast<stream_t>(3)));
  same_stats(before, f.a->stats());
  CHECK(f.a->check() == "");
  f.a->deallocate(keep);
  still_works(*f.a);
}

TEST_CASE("size 0: invalid_value") {
  fixture f;
  expect_bad_alloc(*f.a, 0, 0, errc::invalid_value);
  expect_bad_alloc(*f.a, 0, 4096, errc::invalid_value);
}

TEST_CASE("size larger than the reservation: out_of_memory") {
  fixture f;
  expect_bad_alloc(*f.a, GiB + 1, 0, errc::out_of_memory);
  expect_bad_alloc(*f.a, 2 * GiB, 0, errc::out_of_memory);
  // within the reservation but beyond the (simulated) physical memory: out_of_memory too
  expect_bad_alloc(*f.a, 768 * MiB, 0, errc::out_of_memory, compare::backend_oom);
}

TEST_CASE("SIZE_MAX and sizes near it: out_of_memory, no overflow") {
  fixture f;
  for (std::size_t n : {SIZE_MAX, SIZE_MAX - 1, SIZE_MAX - 255, SIZE_MAX - 2 * MiB + 1, SIZE_MAX / 2 + 1})
    for (std::size_t align : {std::size_t{0}, std::size_t{4096}, 2 * MiB})
      expect_bad_alloc(*f.a, n, align, errc::out_of_memory);
}

TEST_CASE("near-reservation sizes through the large path (no huge path): out_of_memory, no overflow") {
  tuning t;
  t.huge_threshold = SIZE_MAX;  // everything above small goes through TLSF spans and grow()
  fixture f(opts(), t);
  for (std::size_t n : {GiB, GiB - 1, GiB - 256, 900 * MiB})
    for (std::size_t align : {std::size_t{0}, std::size_t{1} << 20})
      expect_bad_alloc(*f.a, n, align, errc::out_of_memory, compare::backend_oom);
}

TEST_CASE("count x size overflow in typed allocation: out_of_memory, never a short block") {
  fixture f;
  struct big {
    char b[24];
  };
  struct alignas(4096) page {
    char b[4096];
  };
  for (std::size_t count : {SIZE_MAX, SIZE_MAX / 2, SIZE_MAX / 24 + 1, (SIZE_MAX >> 3) + 2}) {
    CAPTURE(count);
    auto before = f.a->stats();
    CHECK_THROWS_AS(f.a->allocate_array<big>(count), vmm::out_of_memory);
    CHECK_THROWS_AS(f.a->allocate_array<double>(count), std::bad_alloc);
    CHECK_THROWS_AS(f.a->allocate_array<page>(count), vmm::out_of_memory);
    same_stats(before, f.a->stats());
    CHECK(f.a->check() == "");
  }
  // count 0 is size 0
  CHECK_THROWS_AS(f.a->allocate_array<double>(0), vmm::error);
  CHECK(last_error().st.kind == errc::invalid_value);
  // just below the overflow: a product that fits but exceeds the reservation
  CHECK_THROWS_AS(f.a->allocate_array<big>(SIZE_MAX / 24), vmm::out_of_memory);
  // a fitting count works, aligned for T
  page* pg = f.a->allocate_array<page>(5);
  CHECK(reinterpret_cast<std::uintptr_t>(pg) % alignof(page) == 0);
  CHECK(f.a->usable_size(pg) >= 5 * sizeof(page));
  f.a->deallocate(pg);
  still_works(*f.a);
}

TEST_CASE("alignment not a power of two: invalid_value") {
  fixture f;
  for (std::size_t align : {std::size_t{3}, std::size_t{384}, std::size_t{1000}, std::size_t{4097}, 3 * MiB / 2, SIZE_MAX})
    for (std::size_t n : {std::size_t{100}, 300 * KiB, 40 * MiB})
      expect_bad_alloc(*f.a, n, align, errc::invalid_value);
}

TEST_CASE("alignment larger than the granularity (a chunk): invalid_value; equal to it works") {
  fixture f;
  const std::size_t G = f.a->granularity();
  REQUIRE(G == 2 * MiB);
  for (std::size_t align : {2 * G, 64 * G, std::size_t{1} << 63})
    for (std::size_t n : {std::size_t{100}, 300 * KiB, 40 * MiB})
      expect_bad_alloc(*f.a, n, align, errc::invalid_value);
  for (std::size_t n : {std::size_t{100}, 300 * KiB, 40 * MiB}) {
    void* p = f.a->allocate(n, G);
    CHECK(reinterpret_cast<std::uintptr_t>(p) % G == 0);
    f.a->deallocate(p);
  }
  CHECK(f.a->check() == "");
}

TEST_CASE("pointer of a destroyed allocator: invalid_pointer in a new one") {
  void* old_small;
  void* old_large;
  {
    fixture f;
    old_small = f.a->allocate(1000);
    old_large = f.a->allocate(3 * MiB);
  }  // destroyed with the blocks live: everything unmapped and released
  fixture g;  // likely gets the same address range back from the OS
  void* x = g.a->allocate(300 * KiB);
  if (x != old_small) expect_bad_free(*g.a, old_small);
  if (x != old_large) expect_bad_free(*g.a, old_large);
  g.a->deallocate(x);
}

TEST_CASE("record_stream and usable_size on bad pointers") {
  fixture f;
  int on_stack = 0;
  auto* p = static_cast<char*>(f.a->allocate(300 * KiB));
  auto before = f.a->stats();
  CHECK(f.a->usable_size(&on_stack) == 0);
  CHECK(f.a->usable_size(p + 256) == 0);
  CHECK(f.a->usable_size(nullptr) == 0);
  CHECK_THROWS_AS(f.a->record_stream(&on_stack, reinterpret_cast<stream_t>(1)), vmm::error);
  CHECK_THROWS_AS(f.a->record_stream(p + 256, reinterpret_cast<stream_t>(1)), vmm::error);
  same_stats(before, f.a->stats());
  f.a->deallocate(p);
  CHECK(f.a->usable_size(p) == 0);
  CHECK_THROWS_AS(f.a->record_stream(p, reinterpret_cast<stream_t>(1)), vmm::error);
  CHECK(f.a->check() == "");
}

// ---- the C API ----

namespace {
struct c_fixture {
  vmm_allocator* a = nullptr;
  c_fixture() {
    vmm_policy pol;
    vmm_policy_init(&pol);
    pol.backend = VMM_BACKEND_HOST;
    pol.reservation_size = GiB;
    pol.host_physical_limit = 512 * MiB;
    REQUIRE(vmm_create(&pol, &a) == VMM_SUCCESS);
  }
  ~c_fixture() { vmm_destroy(a); }
  vmm_stats stats() {
    vmm_stats s{};
    REQUIRE(vmm_get_stats(a, &s) == VMM_SUCCESS);
    return s;
  }
};
// backend_oom: the request reached the backend, which refused it; the allocator gave back what it
// held free before it reported out-of-memory, so mapped may drop (never rise).
void same_c_stats(const vmm_stats& x, const vmm_stats& y, bool backend_oom = false) {
  CHECK(x.requested == y.requested);
  CHECK(x.allocated == y.allocated);
  CHECK(x.live == y.live);
  CHECK(x.allocs == y.allocs);
  CHECK(x.frees == y.frees);
  if (backend_oom) CHECK(y.mapped <= x.mapped);
  else CHECK(x.mapped == y.mapped);
}
void c_still_works(vmm_allocator* a) {
  CHECK(vmm_check(a) == VMM_SUCCESS);
  void* p = vmm_malloc(a, 1000);
  CHECK(p != nullptr);
  CHECK(vmm_last_status() == VMM_SUCCESS);
  CHECK(vmm_free(a, p) == VMM_SUCCESS);
}
}  // namespace

TEST_CASE("C API: bad frees -> VMM_ERROR_INVALID_POINTER with a message") {
  c_fixture f;
  int on_stack = 0;
  auto* p = static_cast<char*>(vmm_malloc(f.a, 300 * KiB));
  REQUIRE(p);
  void* s = vmm_malloc(f.a, 100);
  REQUIRE(s);
  CHECK(vmm_free(f.a, s) == VMM_SUCCESS);
  for (void* bad : {static_cast<void*>(&on_stack), static_cast<void*>(p + 256), s}) {
    CAPTURE(bad);
    auto before = f.stats();
    CHECK(vmm_free(f.a, bad) == VMM_ERROR_INVALID_POINTER);
    CHECK(vmm_last_status() == VMM_ERROR_INVALID_POINTER);
    CHECK(std::strlen(vmm_last_error()) > 0);
    CHECK(vmm_free_async(f.a, bad, reinterpret_cast<void*>(1)) == VMM_ERROR_INVALID_POINTER);
    same_c_stats(before, f.stats());
    c_still_works(f.a);
  }
  CHECK(vmm_free(f.a, nullptr) == VMM_SUCCESS);  // no-op
  CHECK(vmm_last_error()[0] == '\0');
  CHECK(vmm_free(f.a, p) == VMM_SUCCESS);
  CHECK(vmm_free(f.a, p) == VMM_ERROR_INVALID_POINTER);  // double free
  c_still_works(f.a);
}

TEST_CASE("C API: bad sizes and alignments -> NULL with the right status") {
  c_fixture f;
  struct bad {
    std::size_t align, size;
    vmm_status want;
  };
  for (bad b : {bad{0, 0, VMM_ERROR_INVALID_VALUE}, bad{0, SIZE_MAX, VMM_ERROR_OUT_OF_MEMORY},
                bad{0, 2 * GiB, VMM_ERROR_OUT_OF_MEMORY}, bad{0, 768 * MiB, VMM_ERROR_OUT_OF_MEMORY},
                bad{3, 100, VMM_ERROR_INVALID_VALUE}, bad{4 * MiB, 100, VMM_ERROR_INVALID_VALUE},
                bad{256, 0, VMM_ERROR_INVALID_VALUE}}) {
    CAPTURE(b.align);
    CAPTURE(b.size);
    auto before = f.stats();
    void* p = b.align ? vmm_aligned_alloc(f.a, b.align, b.size) : vmm_malloc(f.a, b.size);
    CHECK(p == nullptr);
    CHECK(vmm_last_status() == b.want);
    CHECK(std::strlen(vmm_last_error()) > 0);
    same_c_stats(before, f.stats(), b.size == 768 * MiB);  // within the reservation, past physical memory
    c_still_works(f.a);
  }
  // count x size overflow
  for (std::size_t count : {SIZE_MAX, SIZE_MAX / 2, SIZE_MAX / 3 + 1}) {
    CAPTURE(count);
    auto before = f.stats();
    CHECK(vmm_calloc_n(f.a, count, 3) == nullptr);
    CHECK(vmm_last_status() == VMM_ERROR_OUT_OF_MEMORY);
    CHECK(std::strlen(vmm_last_error()) > 0);
    CHECK(vmm_calloc_n(f.a, 3, count) == nullptr);
    CHECK(vmm_last_status() == VMM_ERROR_OUT_OF_MEMORY);
    same_c_stats(before, f.stats());
    c_still_works(f.a);
  }
  CHECK(vmm_calloc_n(f.a, 0, 8) == nullptr);  // size 0
  CHECK(vmm_last_status() == VMM_ERROR_INVALID_VALUE);
  void* arr = vmm_calloc_n(f.a, 1000, 24);
  CHECK(arr != nullptr);
  CHECK(vmm_free(f.a, arr) == VMM_SUCCESS);
  // alignment 0 in vmm_aligned_alloc is an error (C11 aligned_alloc would be undefined)
  CHECK(vmm_aligned_alloc(f.a, 0, 100) == nullptr);
  CHECK(vmm_last_status() == VMM_ERROR_INVALID_VALUE);
  // NULL allocator
  CHECK(vmm_malloc(nullptr, 100) == nullptr);
  CHECK(vmm_last_status() == VMM_ERROR_INVALID_VALUE);
  CHECK(vmm_free(nullptr, nullptr) == VMM_ERROR_INVALID_VALUE);
  CHECK(vmm_check(nullptr) == VMM_ERROR_INVALID_VALUE);
  c_still_works(f.a);
}

TEST_CASE("C API: bad policies are rejected at vmm_create") {
  vmm_policy pol;
  vmm_policy_init(&pol);
  pol.backend = VMM_BACKEND_HOST;
  vmm_allocator* a = reinterpret_cast<vmm_allocator*>(1);
  pol.alignment = 384;
  CHECK(vmm_create(&pol, &a) == VMM_ERROR_INVALID_VALUE);
  CHECK(a == nullptr);
  CHECK(std::strlen(vmm_last_error()) > 0);
  pol.alignment = 0;
  CHECK(vmm_create(nullptr, &a) == VMM_ERROR_INVALID_VALUE);
  CHECK(vmm_create(&pol, nullptr) == VMM_ERROR_INVALID_VALUE);
}

// A C caller can put any int in an enum field. c_api.cpp used to read those fields as the C++ enum
// types, whose value range is only what their enumerators need (0..1 for vmm_backend_kind):
// loading 7 was undefined behaviour in C++ (UBSan: "load of value 7, which is not a valid value
// for type 'vmm_backend_kind'"). Regression test: run under -fsanitize=undefined (build-asan).
TEST_CASE("C API: out-of-range enum values in vmm_policy are rejected (C enum ABI)") {
  vmm_policy pol;
  vmm_policy_init(&pol);
  vmm_allocator* a = nullptr;
  int seven = 7;
  std::memcpy(&pol.backend, &seven, sizeof seven);  // what a C caller can do
  CHECK(vmm_create(&pol, &a) == VMM_ERROR_INVALID_VALUE);
  CHECK(a == nullptr);
  vmm_policy_init(&pol);
  pol.backend = VMM_BACKEND_HOST;
  std::memcpy(&pol.compression, &seven, sizeof seven);
  CHECK(vmm_create(&pol, &a) == VMM_ERROR_INVALID_VALUE);
  vmm_policy_init(&pol);
  pol.backend = VMM_BACKEND_HOST;
  std::memcpy(&pol.ipc, &seven, sizeof seven);
  CHECK(vmm_create(&pol, &a) == VMM_ERROR_INVALID_VALUE);
  CHECK(a == nullptr);
}
