// SPDX-License-Identifier: Apache-2.0
// vmm::device_vector<T> and vmm::pmr_resource on the host backend (CI, no GPU).
//
// This TU is compiled WITHOUT the CUDA include path: adapters.hpp must compile without CCCL, and
// device_vector.hpp must not pick up cudart (the device-memory copy path is tested here with a
// backend that hides cap_host_access, so the vector treats its memory as device memory).
#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <memory_resource>
#include <new>
#include <numeric>
#include <stdexcept>
#include <vector>

#include "support/fault_backend.hpp"
#include "vmmalloc/adapters.hpp"
#include "vmmalloc/device_vector.hpp"

#if defined(VMM_HAVE_CUDA_MR) || defined(VMM_HAVE_THRUST_ALLOCATOR) || defined(VMM_DEVICE_VECTOR_CUDART)
#error "this TU must build without CCCL / cudart: the point is that the headers compile without them"
#endif

namespace {

constexpr std::size_t MiB = std::size_t{1} << 20, G = 2 * MiB;

// Forwards to a host backend, but without cap_host_access: memory the vector must treat as
// device memory (no operator[] / at(), copies through a copier). Keeps the host backend reachable
// for its live counts.
class device_like final : public vmm::forwarding_backend {
 public:
  device_like() : forwarding_backend(vmm::make_backend<vmm::host_backend>()) {}
  vmm::host_backend& host() { return *vmm::backend_cast<vmm::host_backend>(inner()); }
  const char* name() override { return "device-like"; }
  unsigned capabilities() override { return inner().capabilities() & ~unsigned{vmm::cap_host_access}; }
};

// A host backend whose live counts stay readable: the vector owns the backend.
struct tracked {
  vmm::host_backend* host = nullptr;
  vmm::device_vector<int> v;
  static tracked make(std::size_t max_elements, vmm::growable_options o = {}) {
    auto b = std::make_unique<vmm::backend_model<vmm::host_backend>>();
    vmm::host_backend* h = &b->get();
    return {h, vmm::device_vector<int>(vmm::growable_buffer(std::move(b), max_elements * sizeof(int), o))};
  }
};

int value_at(std::size_t i) { return static_cast<int>(i * 2654435761u); }

// A copier that counts its calls (stands in for cudaMemcpy).
int g_copies = 0;
void counting_copy(void* d, const void* s, std::size_t n) {
  ++g_copies;
  std::memcpy(d, s, n);
}

}  // namespace

TEST_CASE("device_vector: growth keeps data() and the contents; new memory is usable") {
  auto v = vmm::device_vector<int>::host(std::size_t{64} << 20);  // 256 MiB limit
  CHECK(v.host_accessible());
  CHECK(v.size() == 0);
  CHECK(v.capacity() == 0);
  CHECK(v.max_size() == (std::size_t{64} << 20));
  int* const p = v.data();
  REQUIRE(p != nullptr);

  v.resize(1000);
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = value_at(i);
  CHECK(v.capacity() == G / sizeof(int));  // one granule mapped

  const std::size_t big = 3 * MiB;  // 12 MiB of int: several more granules, one new chunk
  v.resize(big);
  CHECK(v.data() == p);
  CHECK(v.size() == big);
  CHECK(v.capacity() >= big);
  CHECK(v.buffer().chunk_count() == 2);  // one chunk per growth, whatever its size
  for (std::size_t i = 0; i < 1000; ++i) REQUIRE(v[i] == value_at(i));
  for (std::size_t i = 1000; i < big; i += 4099) v[i] = value_at(i);
  v[big - 1] = 7;
  CHECK(v.at(big - 1) == 7);
  auto s = v.host_span();
  CHECK(s.size() == big);
  CHECK(s.data() == p);
}

TEST_CASE("device_vector: shrinking returns whole chunks at once; reserve maps ahead until shrink_to_fit") {
  auto t = tracked::make(std::size_t{64} << 20);
  auto& v = t.v;
  v.resize(G / sizeof(int));        // chunk 1: 2 MiB
  v.resize(5 * G / sizeof(int));    // chunk 2: 8 MiB more
  CHECK(t.host->live_handles() == 2);
  CHECK(v.capacity() * sizeof(int) == 5 * G);
  v[0] = 42;

  // Down to 1.5 granules: chunk 2 [2 MiB, 10 MiB) is not wholly past round_up(3 MiB) = 4 MiB: kept.
  v.resize(3 * MiB / 2 / sizeof(int) * 2);
  CHECK(t.host->live_handles() == 2);
  // Down to one granule: chunk 2 lies wholly past 2 MiB: unmapped and released now.
  v.resize(G / sizeof(int));
  CHECK(t.host->live_handles() == 1);
  CHECK(t.host->live_mappings() == 1);
  CHECK(v.capacity() * sizeof(int) == G);
  CHECK(v[0] == 42);

  // reserve maps without changing size; shrink_to_fit gives it back.
  v.reserve(4 * G / sizeof(int));
  CHECK(v.size() == G / sizeof(int));
  CHECK(v.capacity() * sizeof(int) == 4 * G);
  CHECK(t.host->live_handles() == 2);
  v.reserve(1);  // no-op: never unmaps
  CHECK(t.host->live_handles() == 2);
  v.shrink_to_fit();
  CHECK(t.host->live_handles() == 1);
  CHECK(v[0] == 42);

  // clear() returns everything.
  v.clear();
  CHECK(v.size() == 0);
  CHECK(v.capacity() == 0);
  CHECK(t.host->live_handles() == 0);
  CHECK(t.host->live_mappings() == 0);
  CHECK(t.host->live_reservations() == 1);  // the reservation stays: data() is still the base
}

TEST_CASE("device_vector: errors throw and leave size, capacity, data() and contents intact") {
  auto v = vmm::device_vector<int>::host(G / sizeof(int) + 10);  // limit: 2 MiB + 40 B
  v.resize(100);
  std::iota(v.host_span().begin(), v.host_span().end(), 0);
  int* const p = v.data();
  const std::size_t cap = v.capacity();

  auto intact = [&] {
    CHECK(v.size() == 100);
    CHECK(v.capacity() == cap);
    CHECK(v.data() == p);
    for (int i = 0; i < 100; ++i) REQUIRE(v[i] == i);
  };

  CHECK_THROWS_AS(v.resize(v.max_size() + 1), vmm::out_of_memory);
  intact();
  CHECK_THROWS_AS(v.reserve(v.max_size() + 1), vmm::out_of_memory);
  intact();
  // n * sizeof(T) overflowing size_t is out of memory, not a short buffer.
  CHECK_THROWS_AS(v.resize(std::numeric_limits<std::size_t>::max() / 2), vmm::out_of_memory);
  intact();
  std::vector<int> lots(v.max_size(), 1);
  CHECK_THROWS_AS(v.append(lots.data(), lots.size()), vmm::out_of_memory);  // 100 + max > max
  intact();
  CHECK_THROWS_AS(v.resize(v.max_size() + 1, 5), vmm::out_of_memory);
  intact();
  try {
    v.resize(v.max_size() + 1);
  } catch (const vmm::out_of_memory& e) {
    CHECK(std::string(e.what()).find("capacity limit") != std::string::npos);
  }
  CHECK_THROWS_AS((void)v.at(100), std::out_of_range);
  int out[2];
  CHECK_THROWS_AS(v.copy_to_host(out, 2, 99), std::out_of_range);
  CHECK_THROWS_AS(v.copy_from_host(out, 1, 100), std::out_of_range);
  intact();

  // Up to the limit exactly is fine.
  v.resize(v.max_size());
  CHECK(v.size() == v.max_size());
  CHECK(v.data() == p);
  CHECK(v[99] == 99);
  CHECK_THROWS_AS(v.push_back(1), vmm::out_of_memory);
  CHECK(v.size() == v.max_size());
}

TEST_CASE("device_vector: a refused driver call during growth changes nothing, and the next try works") {
  auto st = std::make_shared<vmm::test::fault_state>();
  vmm::device_vector<int> v(vmm::growable_buffer(vmm::test::make_fault_host(st), 64 * MiB));
  const std::size_t per = G / sizeof(int);
  for (std::size_t i = 0; i < per; ++i) v.push_back(value_at(i));  // exactly one full granule
  CHECK(v.capacity() == per);
  int* const p = v.data();

  for (auto which : {vmm::test::op::create, vmm::test::op::map, vmm::test::op::set_access}) {
    st->arm(which, 1, vmm::test::fault::out_of_memory);
    CHECK_THROWS_AS(v.push_back(-1), vmm::out_of_memory);
    CHECK(v.size() == per);
    CHECK(v.capacity() == per);
    CHECK(v.data() == p);
    CHECK(st->live_handles() == 1);
    CHECK(st->live_mappings() == 1);
  }
  v.push_back(-1);
  CHECK(v.size() == per + 1);
  for (std::size_t i = 0; i < per; i += 1021) REQUIRE(v[i] == value_at(i));
  CHECK(v[per] == -1);
  CHECK(st->live_handles() == 2);
}

TEST_CASE("device_vector: push_back many (geometric growth: few driver rounds), append, resize with a value") {
  vmm::growable_options o;
  o.geometric = true;
  auto v = vmm::device_vector<std::uint64_t>::host(std::size_t{1} << 26, {}, o);
  const std::size_t n = 3'000'000;  // 24 MB
  for (std::size_t i = 0; i < n; ++i) v.push_back(i * 3);
  CHECK(v.size() == n);
  for (std::size_t i = 0; i < n; ++i)
    if (v[i] != i * 3) REQUIRE(v[i] == i * 3);
  // Geometric: each chunk >= half of what is mapped (x1.5 per round), so 24 MB take 6 chunks
  // (2, 2, 2, 4, 6, 8 MiB) instead of 12 granules.
  CHECK(v.buffer().chunk_count() <= 6);
  CHECK(v.buffer().counts().create == v.buffer().chunk_count());

  const std::vector<std::uint64_t> more = {1, 2, 3};
  v.append(more.data(), more.size());
  CHECK(v.size() == n + 3);
  CHECK(v[n + 2] == 3);

  v.resize(n + 3 + 300'000, 77);  // filled in 1 MiB blocks
  CHECK(v[n + 2] == 3);
  CHECK(v[n + 3] == 77);
  CHECK(v[v.size() - 1] == 77);
  CHECK(v.to_host().size() == v.size());
}

TEST_CASE("device_vector: device memory is reached only through a copier") {
  auto mk = [](vmm::copy_fn c) {
    auto b = std::make_unique<device_like>();
    return vmm::device_vector<int>(vmm::growable_buffer(std::move(b), 64 * MiB), c);
  };
  REQUIRE((vmm::default_device_copy() == nullptr));  // no cudart in this TU (or any other here)

  auto v = mk(nullptr);
  CHECK_FALSE(v.host_accessible());
  v.resize(10);  // mapping needs no copier
  try {
    v.push_back(1);
    FAIL("push_back on device memory without a copier must throw");
  } catch (const vmm::error& e) {
    CHECK(e.st().kind == vmm::errc::not_supported);
    CHECK(std::string(e.what()).find("copier") != std::string::npos);
  }
  CHECK(v.size() == 10);
  CHECK_THROWS_AS((void)v.at(0), vmm::error);
  CHECK_THROWS_AS((void)v.host_span(), vmm::error);
  CHECK_THROWS_AS((void)v.get(0), vmm::error);

  // An explicit copier: every host<->memory copy goes through it.
  g_copies = 0;
  auto w = mk(&counting_copy);
  w.push_back(5);
  const int src[3] = {6, 7, 8};
  w.append(src, 3);
  CHECK(g_copies == 2);
  CHECK(w.get(0) == 5);
  CHECK(w.get(3) == 8);
  w.set(1, 60);
  auto h = w.to_host();
  CHECK(h == std::vector<int>{5, 60, 7, 8});
  w.resize(1000, -3);  // 996 new elements: one 1 MiB block, one copy
  CHECK(w.get(999) == -3);
  CHECK(w.get(3) == 8);

  // The process default, used when none was given.
  vmm::set_default_device_copy(&counting_copy);
  g_copies = 0;
  v.set(0, 11);
  CHECK(v.get(0) == 11);
  CHECK(g_copies == 2);
  vmm::set_default_device_copy(nullptr);
}

TEST_CASE("device_vector: construction rules, moves") {
  auto b = vmm::growable_buffer::host(8 * MiB);
  b.resize(100);
  CHECK_THROWS_AS(vmm::device_vector<int>(std::move(b)), vmm::error);  // not empty
  auto v = vmm::device_vector<int>::host(1000);
  v.push_back(3);
  int* p = v.data();
  auto w = std::move(v);
  CHECK(w.data() == p);
  CHECK(w[0] == 3);
  CHECK(v.data() == nullptr);  // NOLINT: moved-from is empty by contract
  CHECK(v.size() == 0);
  CHECK_THROWS_AS(vmm::device_vector<int>::host(std::numeric_limits<std::size_t>::max() / 2),
                  vmm::out_of_memory);
}

// ---- std::pmr ----------------------------------------------------------------------------------

TEST_CASE("pmr_resource: std::pmr::vector and a pool over the host backend") {
  auto a = vmm::allocator::host();
  {
    vmm::pmr_resource r(a);
    std::pmr::vector<int> v(&r);
    for (int i = 0; i < 200'000; ++i) v.push_back(i);
    for (int i = 0; i < 200'000; ++i) REQUIRE(v[i] == i);
    CHECK(a.usable_size(v.data()) >= v.size() * sizeof(int));  // the memory is vmmalloc's
    CHECK(a.stats().live >= 1);

    // As the upstream of a standard pool.
    std::pmr::unsynchronized_pool_resource pool(&r);
    std::pmr::vector<std::pmr::vector<int>> vv(&pool);
    for (int i = 0; i < 100; ++i) vv.emplace_back(static_cast<std::size_t>(i + 1), i);
    CHECK(vv[99].size() == 100);
    CHECK(vv[99][99] == 99);

    void* z = r.allocate(0, 8);  // pmr must return a pointer even for 0 bytes
    CHECK(z != nullptr);
    r.deallocate(z, 0, 8);
    volatile std::size_t bad_align = 3;  // not a power of two (volatile: no compile-time warning)
    CHECK_THROWS_AS((void)r.allocate(16, bad_align), vmm::error);
  }
  CHECK(a.stats().live == 0);  // everything came back
  CHECK(a.check() == "");
}

TEST_CASE("pmr_resource: equality and refusal of memory the CPU cannot reach") {
  auto a = vmm::allocator::host();
  auto b = vmm::allocator::host();
  vmm::pmr_resource r1(a), r2(a), r3(b);
  CHECK(r1 == r2);
  CHECK(r1 != r3);
  CHECK(&r1.upstream() == &a);

  vmm::options o;
  vmm::allocator dev(std::make_unique<device_like>(), o);
  try {
    vmm::pmr_resource r(dev);
    FAIL("a device-memory allocator must be refused");
  } catch (const vmm::error& e) {
    CHECK(e.st().kind == vmm::errc::invalid_value);
    CHECK(std::string(e.what()).find("host_numa") != std::string::npos);
  }
  // location host_numa is pinned host memory mapped through the driver: accepted.
  o.location = vmm::location_kind::host_numa;
  vmm::allocator numa(std::make_unique<device_like>(), o);
  vmm::pmr_resource r(numa);
  CHECK(&r.upstream() == &numa);
}
