// SPDX-License-Identifier: Apache-2.0
// vmm::growable_buffer on the host backend: pointer stability, contents across growth, physical
// memory returned by shrinking, one driver round per growth, geometric growth, limits, rollback of
// every failed step (fault injection), move semantics, and nothing left behind.
//
// Host memory note: memfd pages are only allocated when touched, so buffers of 1-8 GiB cost
// nothing here as long as the test touches a few bytes per MiB.
#include <doctest/doctest.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <new>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "support/fault_backend.hpp"
#include "vmmalloc/growable_buffer.hpp"
#include "vmmalloc/vmmalloc.hpp"

namespace {

constexpr std::size_t MiB = std::size_t{1} << 20, G = 2 * MiB, GiB = std::size_t{1} << 30;

using vmm::growable_buffer;
using vmm::test::fault;
using vmm::test::fault_state;
using vmm::test::op;

vmm::host_backend& host_of(growable_buffer& b) {
  return dynamic_cast<vmm::backend_model<vmm::host_backend>&>(b.backend()).get();
}

unsigned char* bytes(growable_buffer& b) { return static_cast<unsigned char*>(b.data()); }

std::uint8_t pat(std::size_t i) { return static_cast<std::uint8_t>((i * 2654435761u) >> 13); }

// A buffer over a fault-injecting host backend; the state outlives the buffer (leak checks).
struct faulty {
  std::shared_ptr<fault_state> st = std::make_shared<fault_state>();
  growable_buffer buf;
  explicit faulty(std::size_t limit, vmm::growable_options o = {}, vmm::host_backend_options h = {})
      : buf(vmm::test::make_fault_host(st, h), limit, o) {}
};

// The chunk tiling and the live objects agree with what the buffer says.
void check_consistent(growable_buffer& b) {
  auto& h = host_of(b);
  CHECK(h.live_handles() == b.chunk_count());
  CHECK(h.live_mappings() == b.chunk_count());
  CHECK(h.live_reservations() == 1);
  CHECK(b.capacity() % b.granularity() == 0);
  CHECK(b.capacity() >= b.size());
  CHECK(b.capacity() <= b.reserved());
}

}  // namespace

TEST_CASE("construction reserves once and maps nothing") {
  auto b = growable_buffer::host(3 * MiB + 1);
  CHECK(b.data() != nullptr);
  CHECK(reinterpret_cast<std::uintptr_t>(b.data()) % G == 0);
  CHECK(b.size() == 0);
  CHECK(b.capacity() == 0);
  CHECK(b.chunk_count() == 0);
  CHECK(b.granularity() == G);
  CHECK(b.capacity_limit() == 3 * MiB + 1);
  CHECK(b.reserved() == 4 * MiB);
  CHECK(b.counts().reserve == 1);
  CHECK(b.counts().create == 0);
  check_consistent(b);

  CHECK_THROWS_AS(growable_buffer(nullptr, GiB), vmm::error);
  CHECK_THROWS_AS(growable_buffer::host(0), vmm::error);
}

TEST_CASE("data() is stable across many grow / shrink cycles, and every mapped byte is usable") {
  auto b = growable_buffer::host(512 * MiB);
  void* const p = b.data();
  std::mt19937_64 rng(42);
  for (int i = 0; i < 400; ++i) {
    std::size_t n = rng() % (512 * MiB + 1);
    if (i % 7 == 0) n = 0;
    b.resize(n);
    REQUIRE(b.data() == p);
    REQUIRE(b.size() == n);
    if (n) {  // first and last byte of the new size are mapped read_write
      bytes(b)[0] = 1;
      bytes(b)[n - 1] = 2;
      CHECK(bytes(b)[n - 1] == 2);
    }
    if (i % 50 == 0) check_consistent(b);
  }
  b.resize(0);
  CHECK(b.data() == p);
  CHECK(b.chunk_count() == 0);
  check_consistent(b);
}

TEST_CASE("contents survive growth 1 MiB -> 1 GiB (no copy: same pointer)") {
  auto b = growable_buffer::host(2 * GiB);
  b.resize(MiB);
  void* const p = b.data();
  for (std::size_t i = 0; i < 64 * 1024; ++i) bytes(b)[i] = pat(i);
  b.resize(16 * MiB);
  for (std::size_t o = MiB; o < 16 * MiB; o += MiB) bytes(b)[o] = pat(o);  // a byte per MiB
  b.resize(GiB);
  for (std::size_t o = 16 * MiB; o < GiB; o += MiB) bytes(b)[o] = pat(o);
  b.resize(GiB + 123);
  CHECK(b.data() == p);
  bool ok = true;
  for (std::size_t i = 0; i < 64 * 1024; ++i) ok = ok && bytes(b)[i] == pat(i);
  for (std::size_t o = MiB; o < GiB; o += MiB) ok = ok && bytes(b)[o] == pat(o);
  CHECK(ok);
  CHECK(b.chunk_count() == 4);  // 1 MiB -> 16 MiB -> 1 GiB -> 1 GiB + 123: one chunk per growth
  check_consistent(b);
}

TEST_CASE("shrinking returns physical memory") {
  vmm::host_backend_options h;
  h.physical_limit = 4 * GiB;
  auto b = growable_buffer::host(4 * GiB, h);
  auto& hb = host_of(b);
  const std::size_t free0 = hb.mem_info().value.free;
  CHECK(free0 == 4 * GiB);
  b.resize(64 * MiB);
  b.resize(1 * GiB);
  b.resize(2 * GiB);
  CHECK(b.chunk_count() == 3);
  CHECK(hb.mem_info().value.free == free0 - 2 * GiB);

  b.resize(1 * GiB);  // the third chunk lies wholly past 1 GiB: unmapped and released
  CHECK(b.chunk_count() == 2);
  CHECK(b.capacity() == 1 * GiB);
  CHECK(hb.mem_info().value.free == free0 - 1 * GiB);
  CHECK(hb.live_handles() == 2);

  // A chunk that straddles the new end stays whole (cuMemUnmap's rule: a chunk is one map()).
  b.resize(100 * MiB);
  CHECK(b.chunk_count() == 2);
  CHECK(b.capacity() == 1 * GiB);
  b.resize(10 * MiB);
  CHECK(b.chunk_count() == 1);
  CHECK(b.capacity() == 64 * MiB);

  b.resize(0);
  CHECK(b.chunk_count() == 0);
  CHECK(b.capacity() == 0);
  CHECK(hb.mem_info().value.free == free0);
  CHECK(hb.live_handles() == 0);
  CHECK(hb.live_mappings() == 0);
  CHECK(hb.live_reservations() == 1);  // the reservation stays for the buffer's life
}

TEST_CASE("reserve maps without changing size; shrink_to_fit returns it") {
  auto b = growable_buffer::host(GiB);
  b.reserve(256 * MiB);
  CHECK(b.size() == 0);
  CHECK(b.capacity() == 256 * MiB);
  CHECK(b.chunk_count() == 1);
  const auto creates = b.counts().create;
  b.resize(200 * MiB);  // within capacity: no driver call
  CHECK(b.counts().create == creates);
  CHECK(b.counts().map == 1);
  b.reserve(10 * MiB);  // never unmaps
  CHECK(b.capacity() == 256 * MiB);
  b.resize(0);  // shrinking returns whole chunks past the end, reserved ones included
  CHECK(b.capacity() == 0);
  b.reserve(64 * MiB);
  b.reserve(128 * MiB);
  b.resize(MiB);
  b.shrink_to_fit();  // the second chunk (64..128 MiB) lies wholly past 2 MiB
  CHECK(b.chunk_count() == 1);
  CHECK(b.capacity() == 64 * MiB);
  CHECK(b.size() == MiB);
  CHECK_THROWS_AS(b.reserve(GiB + 1), vmm::out_of_memory);
}

TEST_CASE("a large growth is one driver round") {
  auto b = growable_buffer::host(4 * GiB);
  b.resize(GiB);
  CHECK(b.counts().create == 1);
  CHECK(b.counts().map == 1);
  CHECK(b.counts().set_access == 1);
  CHECK(b.chunk_count() == 1);
  b.resize(2 * GiB);  // +1 GiB: one more chunk, not 512 of 2 MiB
  CHECK(b.counts().create == 2);
  CHECK(b.counts().map == 2);
  CHECK(b.counts().set_access == 2);
  CHECK(b.chunk_count() == 2);
  CHECK(b.capacity() == 2 * GiB);
  b.resize(0);
  CHECK(b.counts().unmap == 2);
  CHECK(b.counts().release == 2);
  CHECK(b.counts().failures == 0);
}

TEST_CASE("min_chunk and the reservation bound the chunk size") {
  vmm::growable_options o;
  o.min_chunk = 3 * MiB;  // rounded up to the granularity
  auto b = growable_buffer::host(GiB, {}, o);
  b.resize(1);
  CHECK(b.capacity() == 4 * MiB);
  CHECK(b.opts().min_chunk == 4 * MiB);

  o.min_chunk = 64 * MiB;
  auto c = growable_buffer::host(10 * MiB, {}, o);
  c.resize(1);
  CHECK(c.capacity() == 10 * MiB);  // never past the reservation
  c.resize(10 * MiB);
  CHECK(c.chunk_count() == 1);
}

TEST_CASE("small steps: linear driver rounds by default, O(log n) with geometric") {
  const std::size_t step = G, top = GiB;
  auto lin = growable_buffer::host(top);
  for (std::size_t n = step; n <= top; n += step) lin.resize(n);
  CHECK(lin.counts().create == top / step);  // 512 rounds: ~30 ms on an H200 (docs/performance.md)

  vmm::growable_options o;
  o.geometric = true;
  auto geo = growable_buffer::host(top, {}, o);
  void* const p = geo.data();
  for (std::size_t n = step; n <= top; n += step) {
    geo.resize(n);
    REQUIRE(geo.capacity() >= n);
    REQUIRE(geo.capacity() <= std::max<std::size_t>(n + n / 2 + 2 * G, n));  // at most ~1.5x mapped
  }
  CHECK(geo.data() == p);
  // Each round maps at least half of what is mapped: mapped grows by 1.5x per round.
  MESSAGE("geometric creates for 2 MiB steps to 1 GiB: " << geo.counts().create);
  CHECK(geo.counts().create <= 20);
  CHECK(geo.counts().create >= 9);
  check_consistent(geo);
}

TEST_CASE("growth past capacity_limit throws out_of_memory and changes nothing") {
  auto b = growable_buffer::host(100 * MiB);
  b.resize(50 * MiB);
  const auto cap = b.capacity();
  const auto creates = b.counts().create;
  CHECK_THROWS_AS(b.resize(100 * MiB + 1), vmm::out_of_memory);
  CHECK_THROWS_AS(b.resize(100 * MiB + 1), std::bad_alloc);
  try {
    b.resize(GiB);
  } catch (const vmm::out_of_memory& e) {
    CHECK(std::string(e.what()).find("capacity limit") != std::string::npos);
    CHECK(e.st().kind == vmm::errc::out_of_memory);
  }
  CHECK(b.size() == 50 * MiB);
  CHECK(b.capacity() == cap);
  CHECK(b.counts().create == creates);
  b.resize(100 * MiB);  // exactly the limit is fine
  CHECK(b.size() == 100 * MiB);
  check_consistent(b);
}

TEST_CASE("physical memory exhausted: out_of_memory, full rollback, no leaked handles") {
  vmm::host_backend_options h;
  h.physical_limit = 64 * MiB;
  auto b = growable_buffer::host(GiB, h);
  auto& hb = host_of(b);
  b.resize(32 * MiB);
  CHECK_THROWS_AS(b.resize(128 * MiB), vmm::out_of_memory);
  CHECK(b.size() == 32 * MiB);
  CHECK(b.capacity() == 32 * MiB);
  CHECK(b.chunk_count() == 1);
  CHECK(hb.live_handles() == 1);
  CHECK(hb.live_mappings() == 1);
  CHECK(hb.mem_info().value.free == 32 * MiB);
  b.resize(64 * MiB);  // what fits still works
  CHECK(b.chunk_count() == 2);
  check_consistent(b);
}

TEST_CASE("geometric growth falls back to the exact need when the larger chunk does not fit") {
  vmm::host_backend_options h;
  h.physical_limit = 80 * MiB;
  vmm::growable_options o;
  o.geometric = true;
  auto b = growable_buffer::host(GiB, h, o);
  b.resize(64 * MiB);
  b.resize(66 * MiB);  // geometric wants 32 MiB (only 16 MiB left): retried with 2 MiB
  CHECK(b.capacity() == 66 * MiB);
  CHECK(b.chunk_count() == 2);
  CHECK(b.counts().create == 3);
  CHECK(b.counts().failures == 1);
  CHECK_THROWS_AS(b.resize(90 * MiB), vmm::out_of_memory);
  CHECK(b.capacity() == 66 * MiB);
  check_consistent(b);
}

TEST_CASE("every failed growth step rolls back (fault injection)") {
  for (op which : {op::create, op::map, op::set_access}) {
    for (fault f : {fault::out_of_memory, fault::invalid_value, fault::not_permitted}) {
      CAPTURE(vmm::test::op_name(which));
      CAPTURE(vmm::test::fault_name(f));
      faulty t(GiB);
      t.buf.resize(10 * MiB);
      const auto cap = t.buf.capacity();
      t.st->arm(which, 1, f);
      bool oom = false, err = false;
      try {
        t.buf.resize(300 * MiB);
      } catch (const vmm::out_of_memory& e) {
        oom = true;
        CHECK(std::string(e.what()).find(vmm::test::driver_function(which)) != std::string::npos);
      } catch (const vmm::error& e) {
        err = true;
        CHECK(e.st().kind == vmm::test::fault_errc(f));
        CHECK(std::string(e.what()).find(vmm::test::fault_name(f)) != std::string::npos);
      }
      CHECK(oom == (f == fault::out_of_memory));
      CHECK(err == (f != fault::out_of_memory));
      CHECK(t.buf.size() == 10 * MiB);
      CHECK(t.buf.capacity() == cap);
      CHECK(t.buf.chunk_count() == 1);
      CHECK(t.st->live_handles() == 1);
      CHECK(t.st->live_mappings() == 1);
      // The next growth works: nothing was left at the tail.
      t.buf.resize(300 * MiB);
      CHECK(t.buf.chunk_count() == 2);
      bytes(t.buf)[300 * MiB - 1] = 7;
    }
  }
}

TEST_CASE("a refused rollback or release is parked, finished later, and nothing leaks") {
  // Two injectors stacked: the outer one fails the growth step, the inner one refuses the cleanup.
  auto outer = std::make_shared<fault_state>(), inner = std::make_shared<fault_state>();
  {
    growable_buffer b(std::make_unique<vmm::test::fault_backend>(vmm::test::make_fault_host(inner), outer),
                      GiB);
    b.resize(10 * MiB);

    // set_access fails, and the rollback's unmap is refused (twice): the mapping is parked.
    outer->arm(op::set_access, 1, fault::invalid_value);
    inner->arm(op::unmap, 1, fault::not_permitted, /*sticky=*/true);
    CHECK_THROWS_AS(b.resize(100 * MiB), vmm::error);
    CHECK(b.size() == 10 * MiB);
    CHECK(b.capacity() == 10 * MiB);
    CHECK(b.chunk_count() == 1);
    CHECK(inner->live_mappings() == 2);  // parked, not forgotten
    inner->disarm();
    b.resize(100 * MiB);  // finishes the parked rollback first, then grows at the same place
    CHECK(b.chunk_count() == 2);
    CHECK(inner->live_mappings() == 2);
    CHECK(inner->live_handles() == 2);

    // map fails, and the rollback's release is refused: the handle is parked.
    outer->arm(op::map, 1, fault::out_of_memory);
    inner->arm(op::release, 1, fault::not_permitted, /*sticky=*/true);
    CHECK_THROWS_AS(b.resize(200 * MiB), vmm::out_of_memory);
    CHECK(b.chunk_count() == 2);
    CHECK(inner->live_handles() == 3);
    inner->disarm();
    b.resize(200 * MiB);
    CHECK(inner->live_handles() == 3);  // the parked one released, a new one created
    CHECK(b.chunk_count() == 3);

    // A shrink whose release is refused: size changes, the VA is unmapped, the handle is parked.
    inner->arm(op::release, 1, fault::not_permitted, /*sticky=*/true);
    CHECK_THROWS_AS(b.resize(10 * MiB), vmm::error);
    CHECK(b.size() == 10 * MiB);
    CHECK(b.chunk_count() == 1);
    CHECK(b.capacity() == 10 * MiB);
    CHECK(inner->live_mappings() == 1);
    CHECK(inner->live_handles() == 3);  // both tail chunks unmapped; their handles parked
    inner->disarm();
    b.shrink_to_fit();  // retries the parked release
    CHECK(inner->live_handles() == 1);
  }
  CHECK(inner->nothing_live());
}

TEST_CASE("a refused unmap on shrink keeps the chunk mapped and usable") {
  faulty t(GiB);
  t.buf.resize(10 * MiB);
  t.buf.resize(100 * MiB);
  t.st->arm(op::unmap, 1, fault::not_permitted, /*sticky=*/true);
  CHECK_THROWS_AS(t.buf.resize(MiB), vmm::error);
  CHECK(t.buf.size() == MiB);
  CHECK(t.buf.chunk_count() == 2);
  CHECK(t.buf.capacity() == 100 * MiB);
  bytes(t.buf)[99 * MiB] = 1;  // still mapped read_write
  t.st->disarm();
  t.buf.shrink_to_fit();
  CHECK(t.buf.chunk_count() == 1);
  CHECK(t.st->live_mappings() == 1);
}

TEST_CASE("keep_idle: a shrink keeps its handles and the next growth maps them again, no create") {
  vmm::growable_options o;
  o.keep_idle = 512 * MiB;
  faulty t(2 * GiB, o);
  t.buf.resize(64 * MiB);
  t.buf.resize(256 * MiB);  // a second chunk of 192 MiB
  t.buf.resize(512 * MiB);  // a third of 256 MiB
  CHECK(t.buf.chunk_count() == 3);
  const auto c0 = t.buf.counts();

  t.buf.resize(64 * MiB);  // both tail chunks unmapped, their 448 MiB kept
  CHECK(t.buf.capacity() == 64 * MiB);
  CHECK(t.buf.idle_bytes() == 448 * MiB);
  CHECK(t.st->live_handles() == 3);
  CHECK(t.st->live_mappings() == 1);
  CHECK(t.buf.counts().release == c0.release);

  // Growing back maps the kept handles in their old order; one set_access covers both.
  t.buf.resize(512 * MiB);
  CHECK(t.buf.counts().create == c0.create);
  CHECK(t.buf.counts().map == c0.map + 2);
  CHECK(t.buf.counts().set_access == c0.set_access + 1);
  CHECK(t.buf.idle_bytes() == 0);
  CHECK(t.buf.capacity() == 512 * MiB);
  CHECK(t.buf.chunk_count() == 3);
  bytes(t.buf)[511 * MiB] = 3;

  // Past what was kept: the kept handles, then one created chunk for the rest.
  t.buf.resize(64 * MiB);
  t.buf.resize(GiB);
  CHECK(t.buf.counts().create == c0.create + 1);
  CHECK(t.buf.capacity() == GiB);
  CHECK(t.buf.chunk_count() == 4);
  bytes(t.buf)[GiB - 1] = 4;
  CHECK(t.st->live_handles() == t.buf.chunk_count());
  CHECK(t.st->live_mappings() == t.buf.chunk_count());

  // Beyond keep_idle a shrink releases: the first 512 MiB of tail chunks (popped tail first) are
  // kept while they fit, the rest goes back to the device.
  // Chunks now: 64 MiB, 192 MiB, 256 MiB, 512 MiB (tail). The 512 MiB one fits keep_idle; the
  // 256 MiB one would pass it and is released, so are the rest.
  t.buf.resize(0);
  CHECK(t.buf.chunk_count() == 0);
  CHECK(t.st->live_mappings() == 0);
  CHECK(t.buf.idle_bytes() == 512 * MiB);
  CHECK(t.st->live_handles() == 1);
  t.buf.release_idle();
  CHECK(t.buf.idle_bytes() == 0);
  CHECK(t.st->live_handles() == 0);
}

TEST_CASE("keep_idle: a failed growth hands the kept handles back; the destructor releases them") {
  vmm::growable_options o;
  o.keep_idle = GiB;
  for (op which : {op::map, op::set_access, op::create}) {
    CAPTURE(vmm::test::op_name(which));
    faulty t(2 * GiB, o);
    t.buf.resize(64 * MiB);
    t.buf.resize(256 * MiB);
    t.buf.resize(64 * MiB);
    CHECK(t.buf.idle_bytes() == 192 * MiB);
    // map: the first map (the kept handle) fails; set_access: after both maps; create: the rest.
    t.st->arm(which, 1, fault::invalid_value);
    CHECK_THROWS_AS(t.buf.resize(512 * MiB), vmm::error);
    CHECK(t.buf.size() == 64 * MiB);
    CHECK(t.buf.capacity() == 64 * MiB);
    CHECK(t.buf.idle_bytes() == 192 * MiB);  // handed back, not released, not lost
    CHECK(t.st->live_handles() == 2);
    CHECK(t.st->live_mappings() == 1);
    t.st->disarm();
    t.buf.resize(512 * MiB);
    CHECK(t.buf.idle_bytes() == 0);
    CHECK(t.st->live_handles() == 3);
  }

  // The destructor releases what is kept: nothing leaks.
  auto st = std::make_shared<fault_state>();
  {
    growable_buffer b(vmm::test::make_fault_host(st), GiB, o);
    b.resize(512 * MiB);
    b.resize(0);
    CHECK(b.idle_bytes() == 512 * MiB);
    CHECK(st->live_handles() == 1);
  }
  CHECK(st->nothing_live());
}

TEST_CASE("peers are granted on every chunk; a bad peer is refused at construction") {
  vmm::growable_options o;
  o.peers = {{1, vmm::access_mode::read}};
  auto b = growable_buffer::host(GiB, {}, o);
  b.resize(10 * MiB);
  b.resize(30 * MiB);
  auto va = reinterpret_cast<std::uintptr_t>(b.data());
  auto& hb = host_of(b);
  CHECK(hb.access_of(va, 0) == vmm::access_mode::read_write);
  CHECK(hb.access_of(va, 1) == vmm::access_mode::read);
  CHECK(hb.access_of(va + 20 * MiB, 1) == vmm::access_mode::read);
  CHECK(b.counts().set_access == 2);  // one call per chunk for all devices

  vmm::growable_options bad;
  bad.peers = {{5, vmm::access_mode::read_write}};
  CHECK_THROWS_AS(growable_buffer::host(GiB, {}, bad), vmm::error);
}

TEST_CASE("move construction and assignment transfer the buffer") {
  auto st1 = std::make_shared<fault_state>();
  auto st2 = std::make_shared<fault_state>();
  {
    growable_buffer a(vmm::test::make_fault_host(st1), GiB);
    a.resize(10 * MiB);
    bytes(a)[5] = 42;
    void* const p = a.data();

    growable_buffer b(std::move(a));
    CHECK(b.data() == p);
    CHECK(b.size() == 10 * MiB);
    CHECK(b.chunk_count() == 1);
    CHECK(bytes(b)[5] == 42);
    CHECK(a.data() == nullptr);  // NOLINT: moved-from is empty by contract
    CHECK(a.size() == 0);
    CHECK(a.capacity() == 0);
    CHECK(a.chunk_count() == 0);
    CHECK_THROWS_AS(a.resize(1), vmm::error);
    a.shrink_to_fit();  // no-op

    growable_buffer c(vmm::test::make_fault_host(st2), GiB);
    c.resize(20 * MiB);
    CHECK(st2->live_handles() == 1);
    c = std::move(b);  // c's own buffer is torn down first
    CHECK(st2->nothing_live());
    CHECK(c.data() == p);
    CHECK(bytes(c)[5] == 42);
    c.resize(100 * MiB);
    CHECK(c.data() == p);

    a = std::move(c);  // into a moved-from buffer
    CHECK(a.data() == p);
    CHECK(st1->live_handles() == 2);
  }
  CHECK(st1->nothing_live());
  CHECK(st2->nothing_live());
}

TEST_CASE("destruction leaves no handles, mappings or reservations") {
  auto st = std::make_shared<fault_state>();
  {
    vmm::growable_options o;
    o.geometric = true;
    growable_buffer b(vmm::test::make_fault_host(st), 8 * GiB, o);
    for (std::size_t n = MiB; n <= 2 * GiB; n += 37 * MiB) b.resize(n);
    CHECK(st->live_handles() == static_cast<std::int64_t>(b.chunk_count()));
    CHECK(st->live_mappings() == static_cast<std::int64_t>(b.chunk_count()));
    CHECK(st->live_reservations() == 1);
  }
  CHECK(st->nothing_live());

  // A teardown call refused once is retried.
  auto st2 = std::make_shared<fault_state>();
  {
    growable_buffer b(vmm::test::make_fault_host(st2), GiB);
    b.resize(100 * MiB);
    b.resize(300 * MiB);
    st2->arm(op::unmap, 1, fault::invalid_value);
  }
  CHECK(st2->nothing_live());
  auto st3 = std::make_shared<fault_state>();
  {
    growable_buffer b(vmm::test::make_fault_host(st3), GiB);
    b.resize(100 * MiB);
    st3->arm(op::free_reservation, 1, fault::invalid_value);
  }
  CHECK(st3->nothing_live());
}

TEST_CASE("cuda(): a buffer on the device, or vmm::error saying why not") {
  try {
    auto b = growable_buffer::cuda(GiB);
    b.resize(64 * MiB);
    CHECK(b.size() == 64 * MiB);
    CHECK(b.chunk_count() == 1);
    MESSAGE("CUDA device present: growable_buffer mapped 64 MiB");
  } catch (const vmm::error& e) {
    CHECK(!e.st().ok());
    CHECK(std::string(e.what()).size() > 0);
    MESSAGE("no CUDA here: " << std::string(e.what()));
  }
}

// ---- shared with an allocator's idle pool ------------------------------------------------------

namespace {
vmm::allocator shared_host_allocator(vmm::options o = {}) {
  o.reservation_size = 8 * GiB;
  return vmm::allocator::host(o);
}
}  // namespace

TEST_CASE("shared: a shrink gives the chunk to the allocator's idle pool, the next growth maps it back") {
  vmm::allocator a = shared_host_allocator();
  auto buf = growable_buffer::shared(a, 4 * GiB);
  CHECK(buf.granularity() == a.granularity());
  buf.resize(64 * MiB);
  for (std::size_t i = 0; i < 64 * MiB; i += 4096) bytes(buf)[i] = pat(i);
  CHECK(a.stats().idle == 0);
  buf.resize(0);
  CHECK(buf.capacity() == 0);
  CHECK(buf.idle_bytes() == 0);        // nothing kept by the buffer itself
  CHECK(a.stats().idle == 64 * MiB);   // the allocator holds it, counted as its physical memory
  CHECK(a.stats().physical >= 64 * MiB);
  CHECK(a.check() == "");
  const auto before = buf.counts();
  buf.resize(64 * MiB);                // maps the allocator's idle handle: no create
  CHECK(buf.counts().create == before.create);
  CHECK(buf.counts().map == before.map + 1);
  CHECK(a.stats().idle == 0);
  for (std::size_t i = 0; i < 64 * MiB; i += 4096) bytes(buf)[i] = pat(i + 1);
  for (std::size_t i = 0; i < 64 * MiB; i += 4096) REQUIRE(bytes(buf)[i] == pat(i + 1));
  CHECK(a.check() == "");
}

TEST_CASE("shared: the allocator's growth stitches what the buffer gave back") {
  vmm::allocator a = shared_host_allocator();
  {
    auto buf = growable_buffer::shared(a, 4 * GiB);
    buf.resize(256 * MiB);
    buf.resize(0);
  }
  CHECK(a.stats().idle == 256 * MiB);
  const auto s0 = a.stats();
  void* p = a.allocate(256 * MiB);  // a huge block: its own chunk, stitched from the idle handle
  const auto s1 = a.stats();
  CHECK(s1.stitched == s0.stitched + 1);
  CHECK(s1.calls.create == s0.calls.create);
  CHECK(s1.idle == 0);
  static_cast<char*>(p)[0] = 1;
  static_cast<char*>(p)[256 * MiB - 1] = 2;
  a.deallocate(p);
  CHECK(a.check() == "");
}

TEST_CASE("shared: a growth maps the allocator's idle handles first, creates only the rest") {
  vmm::allocator a = shared_host_allocator();
  {
    auto give = growable_buffer::shared(a, 4 * GiB);
    give.resize(64 * MiB);
    give.resize(160 * MiB);  // a second chunk: two handles go to the pool
    give.resize(0);
  }
  REQUIRE(a.stats().idle == 160 * MiB);
  auto buf = growable_buffer::shared(a, 4 * GiB);
  buf.resize(224 * MiB);
  CHECK(a.stats().idle == 0);
  CHECK(buf.counts().create == 1);  // the 64 MiB the pool did not cover
  CHECK(buf.counts().map == 3);
  CHECK(buf.chunk_count() == 3);
  CHECK(buf.capacity() == 224 * MiB);
  for (std::size_t i = 0; i < buf.size(); i += MiB) bytes(buf)[i] = pat(i);
  for (std::size_t i = 0; i < buf.size(); i += MiB) REQUIRE(bytes(buf)[i] == pat(i));
  CHECK(a.check() == "");
}

TEST_CASE("shared: a shrink that would pass the allocator's memory_limit releases instead") {
  vmm::options o;
  o.memory_limit = 32 * MiB;
  vmm::allocator a = shared_host_allocator(o);
  auto buf = growable_buffer::shared(a, 4 * GiB);
  buf.resize(64 * MiB);  // the buffer's own memory: not the allocator's to count
  const auto before = buf.counts();
  buf.resize(0);
  CHECK(a.stats().idle == 0);
  CHECK(buf.counts().release == before.release + 1);
  CHECK(host_of(buf).live_handles() == 0);
  CHECK(a.check() == "");
  void* p = a.try_allocate(32 * MiB);  // the limit is whole for the allocator
  CHECK(p != nullptr);
  a.deallocate(p);
}

TEST_CASE("shared: memory the allocator cannot lend is refused with a clear error") {
  vmm::options o;
  o.compression = vmm::compression_mode::prefer;
  vmm::allocator c = shared_host_allocator(o);
  CHECK_THROWS_WITH_AS(growable_buffer::shared(c, GiB), doctest::Contains("compressible"), vmm::error);
  vmm::options e;
  e.ipc = vmm::ipc_kind::posix_fd;
  vmm::allocator x = shared_host_allocator(e);
  CHECK_THROWS_WITH_AS(growable_buffer::shared(x, GiB), doctest::Contains("exportable"), vmm::error);
}

TEST_CASE("shared: buffers and the allocator's threads share one pool") {
  vmm::allocator a = shared_host_allocator();
  std::vector<std::thread> ts;
  std::atomic<int> bad{0};
  for (int t = 0; t < 3; ++t)
    ts.emplace_back([&, t] {
      auto buf = growable_buffer::shared(a, 2 * GiB);
      for (int i = 0; i < 40; ++i) {
        const std::size_t n = static_cast<std::size_t>(1 + (i * 7 + t) % 16) * 8 * MiB;
        buf.resize(n);
        bytes(buf)[n - 1] = static_cast<unsigned char>(i);
        if (bytes(buf)[n - 1] != static_cast<unsigned char>(i)) ++bad;
        buf.resize(n / 4);
        void* p = a.allocate(n / 2);  // maps what the buffers gave back, or creates
        static_cast<char*>(p)[0] = 1;
        a.deallocate(p);
      }
    });
  for (auto& t : ts) t.join();
  CHECK(bad == 0);
  CHECK(a.check() == "");
  a.trim(0);
  CHECK(a.stats().physical == 0);
}
