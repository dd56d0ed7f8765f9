// SPDX-License-Identifier: Apache-2.0
// Host backend: the conformance suite, plus what only the host backend can show in CI (the
// driver's rules enforced, controllable fences, simulated peers, the C API, no-driver handling).
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <random>
#include <thread>
#include <vector>

#include <unistd.h>

#include "conformance.hpp"
#include "vmmalloc/cuda_backend.hpp"
#include "vmmalloc/vmmalloc.h"
#include "arena/arena.hpp"
#include "support/bulk_bytes.hpp"
#include "support/fault_backend.hpp"
#include "support/host_alloc.hpp"
#include "support/marks.hpp"
#include "support/pattern.hpp"

namespace {

// The conformance fill of `seed`: the first 64 KiB unit of the tests' pattern (support/pattern.hpp),
// repeated, with each unit's first word replaced by a stamp of its index (a chunk mapped in the
// wrong place, or twice, shows); a tail takes the unit's first bytes. Written and checked a unit at
// a time by memcpy and memcmp (bulk_bytes: a loop over bytes took 24 s of the plain conformance run
// for its 1 GiB blocks).
constexpr std::size_t kUnit = 64 << 10;
std::vector<std::uint64_t> pattern_unit(std::uint64_t seed) {
  std::vector<std::uint64_t> u(kUnit / 8);
  for (std::size_t w = 0; w < u.size(); ++w) u[w] = vmm::test::pattern_word(seed, w);
  return u;
}
std::uint64_t unit_stamp(std::uint64_t seed, std::size_t i) { return vmm::test::pattern_word(~seed, i); }

struct host_traits {
  static constexpr const char* name = "host";
  static vmm::allocator make(vmm::options o, const vmm::tuning& t = {}) {
    vmm::host_backend_options h;
    h.physical_limit = std::size_t{32} << 30;
    return vmm::allocator_access::make(vmm::make_backend<vmm::host_backend>(h), o, t);
  }
  static void fill(void* p, std::size_t n, std::uint64_t seed) {
    auto* b = static_cast<std::uint8_t*>(p);
    std::vector<std::uint64_t> u = pattern_unit(seed);
    for (std::size_t i = 0, off = 0; off < n; ++i, off += kUnit) {
      u[0] = unit_stamp(seed, i);
      vmm::test::bulk_copy(b + off, u.data(), std::min(kUnit, n - off));
    }
  }
  static bool verify(const void* p, std::size_t n, std::uint64_t seed) {
    auto* b = static_cast<const std::uint8_t*>(p);
    std::vector<std::uint64_t> u = pattern_unit(seed);
    for (std::size_t i = 0, off = 0; off < n; ++i, off += kUnit) {
      u[0] = unit_stamp(seed, i);
      if (!vmm::test::bulk_equal(b + off, u.data(), std::min(kUnit, n - off))) return false;
    }
    return true;
  }
  static bool device_memory(std::size_t&, std::size_t&) { return false; }
  static vmm::stream_t stream(int i) { return reinterpret_cast<vmm::stream_t>(std::uintptr_t(0x1000 + i)); }
  // The allocator owns its backend and destroys it with itself; to count what is left, the host
  // backend lives in `live` and the allocator gets a non-owning forwarding_backend over it.
  static vmm::allocator make_watched(vmm::options o, std::function<conf::live_counts()>& live) {
    vmm::host_backend_options h;
    h.physical_limit = std::size_t{32} << 30;
    std::shared_ptr<vmm::backend_iface> host = vmm::make_backend<vmm::host_backend>(h);
    vmm::host_backend* hb = vmm::backend_cast<vmm::host_backend>(*host);
    live = [host, hb] { return conf::live_counts{hb->live_handles(), hb->live_mappings(), hb->live_reservations()}; };
    return vmm::allocator(std::make_unique<vmm::forwarding_backend>(*host), o);
  }
};

constexpr std::size_t MiB = std::size_t{1} << 20, G2 = 2 * MiB;

// small_options without thread caches (small or large): every free reaches the heap at once.
vmm::options heap_only_options() {
  vmm::options o = conf::small_options();
  o.thread_cache = false;
  return o;
}

}  // namespace

VMM_CONFORMANCE_INVOKE(host_traits)

// ---- backend: the driver's rules, enforced by the host backend ----

namespace {
// A call the driver would refuse: refused as an invalid value, and the violation logged with the
// call and the reason named.
void refused(vmm::test::violation_log& log, const vmm::status& st, const char* call, const char* why) {
  CHECK(st.kind == vmm::errc::invalid_value);
  INFO(log.last());
  CHECK(log.last().find(call) != std::string::npos);
  CHECK(log.last().find(why) != std::string::npos);
}
}  // namespace

TEST_CASE("host backend: map only inside a reservation, unmap whole mappings") {
  auto log = std::make_shared<vmm::test::violation_log>();
  vmm::host_backend b(vmm::test::recording(log));
  vmm::chunk_props props;
  auto r = b.reserve(8 * G2, G2);
  REQUIRE(r.ok());
  auto h = b.create(2 * G2, props);
  REQUIRE(h.ok());
  CHECK(b.map(r.value + G2, 2 * G2, h.value, 0).ok());
  refused(*log, b.map(r.value + 2 * G2, G2, h.value, 0), "cuMemMap", "over VA that is mapped");
  refused(*log, b.map(r.value + 100, G2, h.value, 0), "cuMemMap", "off the granularity");
  refused(*log, b.map(r.value + 7 * G2, 2 * G2, h.value, 0), "cuMemMap", "outside every reservation");
  refused(*log, b.unmap(r.value + G2, G2), "cuMemUnmap", "not whole mappings");
  refused(*log, b.free_reservation(r.value, 8 * G2), "cuMemAddressFree", "still holds mappings");
  refused(*log, b.set_access(r.value, 2 * G2, {}), "cuMemSetAccess", "not wholly mapped");
  CHECK(b.unmap(r.value + G2, 2 * G2).ok());
  CHECK(b.release(h.value).ok());
  refused(*log, b.release(h.value), "cuMemRelease", "not a live handle");         // twice
  refused(*log, b.map(r.value, 2 * G2, h.value, 0), "cuMemMap", "not a live handle");  // after its release
  CHECK(log->count() == 8);
  CHECK(b.free_reservation(r.value, 8 * G2).ok());
  CHECK(b.live_handles() == 0);
  CHECK(b.live_mappings() == 0);
  CHECK(b.live_reservations() == 0);
}

TEST_CASE("host backend: one unmap takes several whole mappings side by side, never a gap or part of one") {
  auto log = std::make_shared<vmm::test::violation_log>();
  vmm::host_backend b(vmm::test::recording(log));
  vmm::chunk_props props;
  auto r = b.reserve(8 * G2, G2);
  REQUIRE(r.ok());
  std::vector<vmm::mem_handle> hs;
  for (int i = 0; i < 3; ++i) {
    auto h = b.create(G2, props);
    REQUIRE(h.ok());
    hs.push_back(h.value);
  }
  // Pages 0, 1 and 3: 0-1 are side by side, 2 is a gap.
  REQUIRE(b.map(r.value, G2, hs[0], 0).ok());
  REQUIRE(b.map(r.value + G2, G2, hs[1], 0).ok());
  REQUIRE(b.map(r.value + 3 * G2, G2, hs[2], 0).ok());
  refused(*log, b.unmap(r.value, 4 * G2), "cuMemUnmap", "no mapping starts at");     // over the gap
  refused(*log, b.unmap(r.value + G2, 3 * G2), "cuMemUnmap", "no mapping starts at");  // from page 1 over the gap
  refused(*log, b.unmap(r.value, 5 * G2), "cuMemUnmap", "no mapping starts at");     // past the last mapping
  CHECK(log->count() == 3);
  CHECK(b.live_mappings() == 3);  // a refused call unmaps nothing
  CHECK(b.unmap(r.value, 2 * G2).ok());  // pages 0 and 1 in one call
  CHECK(b.live_mappings() == 1);
  // The VA is a reservation again: the handles map there anew.
  CHECK(b.map(r.value + G2, G2, hs[0], 0).ok());
  CHECK(b.unmap(r.value + G2, G2).ok());
  CHECK(b.unmap(r.value + 3 * G2, G2).ok());
  for (auto h : hs) CHECK(b.release(h).ok());
  CHECK(log->count() == 3);
  CHECK(b.free_reservation(r.value, 8 * G2).ok());
  CHECK(b.live_handles() == 0);
  CHECK(b.live_reservations() == 0);
}

// The driver may corrupt its own state (a double free inside cuMemUnmap was seen on an H200) when
// two threads call it at once on one handle or on overlapping VA: the host backend sees every call
// in flight, whichever thread the scheduler runs first, and names both.
TEST_CASE("host backend: two calls in flight at once on one handle or on overlapping VA are violations") {
  auto log = std::make_shared<vmm::test::violation_log>();
  vmm::host_backend_options o = vmm::test::recording(log);
  o.call_us = 200000;  // each call stays in flight 0.2 s: the second thread's call starts meanwhile
  vmm::host_backend b(o);
  auto r = b.reserve(4 * G2, G2);
  auto h = b.create(G2, {});
  auto h2 = b.create(G2, {});
  REQUIRE((r.ok() && h.ok() && h2.ok()));
  REQUIRE(b.map(r.value, G2, h.value, 0).ok());
  auto race = [&](auto first, auto second) {
    std::thread t(first);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    vmm::status st = second();
    t.join();
    return st;
  };
  // A release of the handle another thread is unmapping.
  vmm::status rel = race([&] { CHECK(b.unmap(r.value, G2).ok()); }, [&] { return b.release(h.value); });
  CHECK_FALSE(rel.ok());
  CHECK(log->last().find("cuMemRelease(handle") != std::string::npos);
  CHECK(log->last().find("while cuMemUnmap(va") != std::string::npos);
  CHECK(log->last().find("on one handle") != std::string::npos);
  // The handle mapped at a second place while its first mapping's unmap is in flight.
  REQUIRE(b.map(r.value, G2, h.value, 0).ok());
  vmm::status second = race([&] { CHECK(b.unmap(r.value, G2).ok()); },
                            [&] { return b.map(r.value + 2 * G2, G2, h.value, 0); });
  CHECK_FALSE(second.ok());
  CHECK(log->last().find("cuMemMap(va") != std::string::npos);
  CHECK(log->last().find("on one handle") != std::string::npos);
  // The VA mapped again (another handle) before its unmap returned.
  REQUIRE(b.map(r.value, G2, h.value, 0).ok());
  vmm::status reuse = race([&] { CHECK(b.unmap(r.value, G2).ok()); }, [&] { return b.map(r.value, G2, h2.value, 0); });
  CHECK_FALSE(reuse.ok());
  CHECK(log->last().find("on overlapping VA") != std::string::npos);
  CHECK(log->count() == 3);
  // Calls on other handles and other VA run side by side.
  REQUIRE(b.map(r.value, G2, h.value, 0).ok());
  CHECK(race([&] { CHECK(b.unmap(r.value, G2).ok()); }, [&] { return b.map(r.value + G2, G2, h2.value, 0); }).ok());
  CHECK(log->count() == 3);
  CHECK(b.unmap(r.value + G2, G2).ok());

  CHECK(b.release(h.value).ok());
  CHECK(b.release(h2.value).ok());
  CHECK(b.free_reservation(r.value, 4 * G2).ok());
}

// A fence is a CUDA event: querying, waiting on or destroying one that was destroyed is undefined
// on the driver (a segfault in cuEventQuery was seen on an H200), so the host backend names it.
TEST_CASE("host backend: a fence used after its drop is a violation") {
  auto log = std::make_shared<vmm::test::violation_log>();
  vmm::host_backend b(vmm::test::recording(log));
  const auto s = reinterpret_cast<vmm::stream_t>(std::uintptr_t{0x3000});
  b.hold_stream(s);
  auto f = b.record_fence(s);
  REQUIRE((f.ok() && f.value != 0));
  CHECK_FALSE(b.fence_done(f.value));
  b.drop_fence(f.value);
  CHECK(log->count() == 0);
  CHECK_FALSE(b.fence_done(f.value));  // never taken for "done"
  CHECK(log->last().find("cuEventQuery") != std::string::npos);
  CHECK(log->last().find("destroyed") != std::string::npos);
  CHECK_FALSE(b.wait_fence(f.value).ok());
  CHECK(log->last().find("cuEventSynchronize") != std::string::npos);
  b.drop_fence(f.value);
  CHECK(log->last().find("cuEventDestroy") != std::string::npos);
  CHECK(log->count() == 3);
  b.complete_stream(s);
}

TEST_CASE("host backend: a mapping has no access until set_access, then the CPU can use it") {
  vmm::host_backend b;
  auto r = b.reserve(G2, G2);
  auto h = b.create(G2, {});
  REQUIRE(b.map(r.value, G2, h.value, 0).ok());
  CHECK(b.access_of(r.value, 0) == vmm::access_mode::none);
  vmm::access_desc d{0, vmm::access_mode::read_write};
  REQUIRE(b.set_access(r.value, G2, {&d, 1}).ok());
  CHECK(b.access_of(r.value, 0) == vmm::access_mode::read_write);
  std::memset(reinterpret_cast<void*>(r.value), 0x5a, G2);
  CHECK(reinterpret_cast<unsigned char*>(r.value)[G2 - 1] == 0x5a);
  // Released while mapped: the memory stays valid until unmapped (driver reference counting).
  CHECK(b.release(h.value).ok());
  CHECK(reinterpret_cast<unsigned char*>(r.value)[12345] == 0x5a);
  CHECK(b.unmap(r.value, G2).ok());
  CHECK(b.free_reservation(r.value, G2).ok());
}

TEST_CASE("host backend: the simulated device memory limit gives ENOMEM as out_of_memory") {
  vmm::host_backend_options o;
  o.physical_limit = 4 * G2;
  vmm::host_backend b(o);
  auto h1 = b.create(3 * G2, {});
  REQUIRE(h1.ok());
  auto h2 = b.create(2 * G2, {});
  CHECK(h2.st.kind == vmm::errc::out_of_memory);
  CHECK(std::string(h2.st.name) == "ENOMEM");
  CHECK(h2.st.message().find("memfd_create") != std::string::npos);
  CHECK(b.release(h1.value).ok());
  auto h3 = b.create(4 * G2, {});
  CHECK(h3.ok());
  b.release(h3.value);
}

TEST_CASE("host backend: export dups the memfd and import maps the same bytes") {
  vmm::host_backend b;
  vmm::chunk_props props;
  props.ipc = vmm::ipc_kind::posix_fd;
  auto h = b.create(G2, props);
  auto ex = b.export_handle(h.value, vmm::ipc_kind::posix_fd);
  REQUIRE(ex.ok());
  auto im = b.import_handle(ex.value);
  REQUIRE(im.ok());
  auto r = b.reserve(2 * G2, G2);
  vmm::access_desc d{0, vmm::access_mode::read_write};
  REQUIRE(b.map(r.value, G2, h.value, 0).ok());
  REQUIRE(b.map(r.value + G2, G2, im.value, 0).ok());
  REQUIRE(b.set_access(r.value, 2 * G2, {&d, 1}).ok());
  auto* p = reinterpret_cast<char*>(r.value);
  p[100] = 42;
  CHECK(p[G2 + 100] == 42);  // two views of one physical chunk
  b.unmap(r.value, G2);
  b.unmap(r.value + G2, G2);
  b.release(h.value);
  b.release(im.value);
  ::close(ex.value.fd);
  b.free_reservation(r.value, 2 * G2);
  CHECK(b.live_handles() == 0);
}

TEST_CASE("host backend: fences are pending while the test holds the stream") {
  vmm::host_backend b;
  auto s = reinterpret_cast<vmm::stream_t>(0x77);
  auto f0 = b.record_fence(s);
  CHECK(b.fence_done(f0.value));
  b.hold_stream(s);
  auto f1 = b.record_fence(s);
  CHECK_FALSE(b.fence_done(f1.value));
  CHECK_FALSE(b.wait_fence(f1.value).ok());  // would deadlock: reported, not hung
  b.complete_stream(s);
  CHECK(b.fence_done(f1.value));
}

TEST_CASE("backend concept: both backends satisfy it and report capabilities") {
  static_assert(vmm::backend<vmm::host_backend>);
  static_assert(vmm::backend<vmm::cuda_backend>);
  vmm::host_backend h;
  CHECK((h.capabilities() & vmm::cap_host_access) != 0);
  CHECK((h.capabilities() & vmm::cap_export_posix_fd) != 0);
  CHECK((h.capabilities() & vmm::cap_compression) == 0);
  auto g = h.granularity({});
  CHECK(g.value.minimum == G2);
}

// ---- CUDA backend without a driver ----

TEST_CASE("cuda backend: without a driver, construction reports 'no CUDA driver' and nothing dies") {
  vmm::cuda_backend cb(0);
  if (cb.available()) {
    MESSAGE("a CUDA driver is present here; the no-driver path is not exercised");
    return;
  }
  CHECK(cb.load_status().kind == vmm::errc::no_driver);
  CHECK(cb.load_message().find("no CUDA") != std::string::npos);
  CHECK_FALSE(cb.create(G2, {}).ok());
  CHECK_FALSE(cb.reserve(G2, G2).ok());
  try {
    vmm::allocator a;
    FAIL("allocator on a machine without a driver");
  } catch (const vmm::error& e) {
    CHECK(e.st().kind == vmm::errc::no_driver);
    CHECK(std::string(e.what()).find("no CUDA driver") != std::string::npos);
  }
  vmm_policy pol;
  vmm_policy_init(&pol);
  vmm_allocator* ca = nullptr;
  CHECK(vmm_create(&pol, &ca) == VMM_ERROR_NO_DRIVER);
  CHECK(ca == nullptr);
  CHECK(std::string(vmm_last_error()).find("no CUDA driver") != std::string::npos);
}

// ---- cross-stream reuse, proven with test-controlled fences ----

TEST_CASE("streams: a block freed on S1 with its fence pending is never handed to S2") {
  auto [hb, a] = vmm::test::make_host_alloc(conf::small_options());
  REQUIRE(hb != nullptr);
  auto s1 = host_traits::stream(1), s2 = host_traits::stream(2);
  for (std::size_t n : {300 * std::size_t{1024}, 300 * MiB}) {  // large and huge paths
    CAPTURE(n);
    hb->hold_stream(s1);  // S1's work is still running
    void* p = a.allocate(n, 0, s1);
    a.deallocate(p, s1);
    void* q = a.allocate(n, 0, s2);
    CHECK(q != p);
    void* same = a.allocate(n, 0, s1);  // S1 itself may reuse at once (stream order)
    CHECK(same == p);
    a.deallocate(same, s1);
    hb->complete_stream(s1);  // S1's fence completes
    void* r = a.allocate(n, 0, s2);
    CHECK(r == p);
    a.deallocate(q, s2);
    a.deallocate(r, s2);
    CHECK(a.check() == "");
  }
}

using vmm::test::put_mark;
using vmm::test::wrong_marks;

// The GPU race program's failure, on the host: a kernel still queued on stream S writes the block
// S freed after the allocator handed that memory to another stream. Held streams' kernels
// (host_backend::launch) land when the stream completes; every block is checked before its free.
TEST_CASE("streams: work queued on a held stream never lands in another stream's block (growth under a limit)") {
  // Seeds whose runs met the fault before the fix (of 1-16 at 3,000 operations: 2, 4, 5, 10, 12, 15).
  for (std::uint64_t seed : {5, 10, 12, 15}) {
    CAPTURE(seed);
    vmm::options o = conf::small_options();
    o.memory_limit = 64 * MiB;
    auto [hb, a] = vmm::test::make_host_alloc(o);
    REQUIRE(hb != nullptr);
    std::mt19937_64 r(seed);
    struct blk { unsigned char* p; std::size_t n; unsigned char v; vmm::stream_t s; };
    const vmm::stream_t streams[4] = {host_traits::stream(1), host_traits::stream(2), host_traits::stream(3),
                                      host_traits::stream(4)};
    bool held[4] = {};
    std::vector<blk> live;
    std::size_t bad = 0, allocs = 0;
    unsigned char next = 1;
    auto is_held = [&](vmm::stream_t s) { return held[std::find(streams, streams + 4, s) - streams]; };
    for (int op = 0; op < 3000; ++op) {
      const unsigned pick = static_cast<unsigned>(r() % 100);
      if (pick < 45 && live.size() < 24) {
        const vmm::stream_t s = streams[r() % 4];
        const int k = static_cast<int>(6 + r() % 17);
        const std::size_t n = (std::size_t{1} << k) + r() % (std::size_t{1} << k);
        auto* p = static_cast<unsigned char*>(a.try_allocate(n, 0, s));
        if (!p) {
          REQUIRE(vmm::last_error().st.kind == vmm::errc::out_of_memory);
          continue;
        }
        ++allocs;
        const unsigned char v = next++ | 1;
        hb->launch(s, [p, n, v] { put_mark(p, n, v); });
        live.push_back({p, n, v, s});
      } else if (pick < 85 && !live.empty()) {
        const std::size_t k = r() % live.size();
        const blk b = live[k];
        if (!is_held(b.s)) bad += wrong_marks(b.p, b.n, b.v);  // its own kernel has run
        a.deallocate(b.p, b.s);
        live[k] = live.back();
        live.pop_back();
      } else if (pick < 95) {
        const std::size_t i = r() % 4;
        if (held[i]) hb->complete_stream(streams[i]);
        else hb->hold_stream(streams[i]);
        held[i] = !held[i];
      } else if (std::count(held, held + 4, true) == 0) {
        a.trim(0);  // it waits for streams' work: a held stream's would never come (EPERM)
      }
    }
    for (int i = 0; i < 4; ++i)
      if (held[i]) hb->complete_stream(streams[i]);
    for (const blk& b : live) {
      bad += wrong_marks(b.p, b.n, b.v);
      a.deallocate(b.p, b.s);
    }
    CHECK(allocs > 500);
    CHECK(bad == 0);
    CHECK(a.check() == "");
  }
}

TEST_CASE("stats: driver calls and fences are timed") {
  vmm::options o = conf::small_options();
  auto a = vmm::allocator::host(o);
  const auto s0 = a.stats().calls;
  void* p = a.allocate(4 * MiB);  // a growth: create, map, set_access
  const auto s1 = a.stats().calls;
  CHECK(s1.total() > s0.total());
  CHECK(s1.ns > s0.ns);
  a.deallocate(p);
  void* q = a.allocate(4 * MiB);  // the same memory again: no call, no time
  CHECK(a.stats().calls.ns == s1.ns);
  const vmm::stream_t other = reinterpret_cast<vmm::stream_t>(std::uintptr_t{9});
  a.record_stream(q, other);  // its free waits for a fence on `other`
  a.deallocate(q);
  const auto s2 = a.stats().calls;
  CHECK(s2.record_fence > s1.record_fence);
  CHECK(s2.fence_ns > s1.fence_ns);
  CHECK(a.check() == "");
}

TEST_CASE("a huge request served from a free span block keeps its alignment") {
  vmm::tuning t;
  t.huge_threshold = 16 * MiB;
  t.thread_cache_large = false;
  auto a = host_traits::make(conf::small_options(), t);
  void* off = a.allocate(3 * MiB + 256);  // the span's free memory starts off any power of two
  std::vector<void*> v;
  for (int i = 0; i < 8; ++i) v.push_back(a.allocate(8 * MiB));
  for (void* p : v) a.deallocate(p);
  const auto calls = a.stats().calls.total();
  for (std::size_t align : {std::size_t{256}, std::size_t{4096}, MiB, 2 * MiB}) {
    CAPTURE(align);
    void* h = a.allocate(20 * MiB, align);  // huge, fits the free span memory
    CHECK(reinterpret_cast<std::uintptr_t>(h) % align == 0);
    vmm::test::bulk_set(h, 5, 20 * MiB);
    a.deallocate(h);
  }
  CHECK(a.stats().calls.total() == calls);  // every one from the span: no driver call
  CHECK(a.check() == "");
  a.deallocate(off);
}

TEST_CASE("under a memory limit a freed huge block serves other sizes with no driver call, in stream order") {
  // Freed huge blocks join the spans while a limit is set (what the limit lets the reclaim give
  // back); without one a freed huge block is cached whole.
  for (bool split : {false, true}) {
    CAPTURE(split);
    vmm::options o = conf::small_options();
    if (split) o.memory_limit = 8 * conf::GiB;  // set, never reached
    vmm::tuning t;
    t.split_cached_huge = false;  // without it a cached block is split anyway, not remapped
    t.thread_cache_large = false;
    auto [hb, a] = vmm::test::make_host_alloc(o, t);
    auto s1 = host_traits::stream(1), s2 = host_traits::stream(2);
    const std::size_t huge = std::max<std::size_t>(t.huge_threshold, 64 * MiB) * 2;
    void* p = a.allocate(huge, 0, s1);
    a.deallocate(p, s1);
    const auto c0 = a.stats().calls.total();
    // Another size than the freed block's (the huge cache serves up to 1/8 larger), and a mid size.
    void* q = a.allocate(huge / 2 + huge / 4, 0, s1);
    void* r = a.allocate(huge / 8, 0, s1);
    host_traits::fill(q, huge / 2 + huge / 4, 7);
    host_traits::fill(r, huge / 8, 8);
    const auto c1 = a.stats().calls.total();
    if (split) {
      CHECK(c1 == c0);  // split from the freed block's memory
      CHECK(a.stats().physical == huge);
    } else {
      CHECK(c1 > c0);   // its own chunk: the freed one remapped or released and created again
    }
    CHECK(host_traits::verify(q, huge / 2 + huge / 4, 7));
    CHECK(host_traits::verify(r, huge / 8, 8));
    CHECK(a.check() == "");
    a.deallocate(q, s1);
    a.deallocate(r, s1);
    // Freed on S1 while S1 runs behind: never S2's before S1's fence completes.
    void* h = a.allocate(huge, 0, s1);
    hb->hold_stream(s1);
    a.deallocate(h, s1);
    void* other = a.allocate(huge / 2, 0, s2);
    const auto in = [&](void* x) {
      auto u = reinterpret_cast<std::uintptr_t>(x), b = reinterpret_cast<std::uintptr_t>(h);
      return u >= b && u < b + huge;
    };
    CHECK_FALSE(in(other));
    void* mine = a.allocate(huge / 2, 0, s1);  // S1 itself may reuse at once (stream order)
    if (split) CHECK(in(mine));
    hb->complete_stream(s1);
    a.deallocate(mine, s1);
    a.deallocate(other, s2);
    CHECK(a.check() == "");
    a.trim(0);
    CHECK(a.stats().mapped == 0);
  }
}

TEST_CASE("a huge request smaller than a cached block splits it, not remaps it") {
  // 3/4 of the block: more than the cache's 1/8 slack; 1/3: less than half of it.
  struct shape { bool split; int num, den; };
  for (const shape c : {shape{false, 3, 4}, shape{true, 3, 4}, shape{false, 1, 3}, shape{true, 1, 3}}) {
    const bool split = c.split;
    const int num = c.num, den = c.den;
    CAPTURE(split);
    CAPTURE(num);
    CAPTURE(den);
    vmm::tuning t;
    t.split_cached_huge = split;
    t.thread_cache_large = false;
    auto [hb, a] = vmm::test::make_host_alloc(conf::small_options(), t);
    auto s1 = host_traits::stream(1), s2 = host_traits::stream(2);
    const std::size_t huge = std::max<std::size_t>(t.huge_threshold, 64 * MiB) * 4;
    const std::size_t part = huge / den * num;
    REQUIRE(part >= t.huge_threshold);
    void* p = a.allocate(huge, 0, s1);
    a.deallocate(p, s1);  // cached whole
    const auto c0 = a.stats().calls.total();
    void* q = a.allocate(part, 0, s1);
    host_traits::fill(q, part, 7);
    const auto c1 = a.stats().calls.total();
    if (split) {
      CHECK(c1 == c0);  // carved from the cached block's memory
      CHECK(a.stats().physical == huge);
      // The rest is span memory now: a mid size fits with no driver call either.
      void* r = a.allocate(huge / 8, 0, s1);
      CHECK(a.stats().calls.total() == c0);
      a.deallocate(r, s1);
    } else {
      CHECK(c1 > c0);  // its own chunk: the cached one remapped or released and created again
    }
    CHECK(host_traits::verify(q, part, 7));
    CHECK(a.check() == "");
    a.deallocate(q, s1);
    // A block freed on S1 while S1 runs behind is not S2's to split before S1's fence completes.
    void* h = a.allocate(huge, 0, s1);
    hb->hold_stream(s1);
    a.deallocate(h, s1);
    void* other = a.allocate(part, 0, s2);
    auto u = reinterpret_cast<std::uintptr_t>(other), b = reinterpret_cast<std::uintptr_t>(h);
    CHECK_FALSE((u >= b && u < b + huge));
    hb->complete_stream(s1);
    a.deallocate(other, s2);
    CHECK(a.check() == "");
    a.trim(0);
    CHECK(a.stats().mapped == 0);
  }
}

TEST_CASE("spans: a chunk given back from a span's middle is mapped again to join the free blocks either side") {
  // Fourteen 1 MiB blocks in one span of chunks c0 (2 MiB: blocks 0-1), c1 (2-5), c2 (6-9) and
  // c3 (10-13), 4 MiB each after the first. Blocks 4-11 freed: c2 wholly free, the free run
  // starting in c1 and ending in c3. trim gives c2 back and cuts the span in two: a 2 MiB free
  // tail on the left, a 2 MiB free head on the right. An 8 MiB request fits across the cut:
  // mapping the 4 MiB hole joins the spans. Without the join it takes 8 MiB at the far end.
  vmm::tuning t;
  t.max_growth = 4 * MiB;
  auto [hb, a] = vmm::test::make_host_alloc(heap_only_options(), t);
  std::vector<void*> v;
  for (int i = 0; i < 14; ++i) v.push_back(a.allocate(MiB));
  for (int i = 1; i < 14; ++i)
    REQUIRE(static_cast<char*>(v[i]) == static_cast<char*>(v[0]) + i * MiB);  // one span, in order
  REQUIRE(a.stats().mapped == 14 * MiB);
  for (int i = 4; i <= 11; ++i) a.deallocate(v[i]);
  a.trim(0);  // gives back the one wholly free chunk, c2
  REQUIRE(a.stats().mapped == 10 * MiB);
  REQUIRE(a.check() == "");
  const auto before = a.stats();
  void* p = a.allocate(8 * MiB);
  REQUIRE(p != nullptr);
  CHECK(p == v[4]);  // across the cut, where block 4 was
  CHECK(a.stats().physical == before.physical + 4 * MiB);
  CHECK(a.stats().mapped == 14 * MiB);
  host_traits::fill(p, 8 * MiB, 9);
  CHECK(host_traits::verify(p, 8 * MiB, 9));
  CHECK(a.check() == "");
  a.deallocate(p);
  for (int i : {0, 1, 2, 3, 12, 13}) a.deallocate(v[i]);
  a.trim(0);
  CHECK(a.stats().physical == 0);
  CHECK(hb->live_mappings() == 0);
}

TEST_CASE("huge blocks in handles: a split huge block's wholly free handles serve the next huge request") {
  // One handle per huge block: a small block left in its memory keeps the whole handle mapped,
  // and a larger huge request creates all of its memory again. Handles of huge/8: only the one
  // holding the small block stays; the other seven are mapped again for the next request.
  for (bool chunked : {false, true}) {
    CAPTURE(chunked);
    vmm::tuning t;
    t.thread_cache_large = false;
    const std::size_t huge = std::max<std::size_t>(t.huge_threshold, 64 * MiB) * 2;
    t.max_handle = chunked ? huge / 8 : 0;
    auto [hb, a] = vmm::test::make_host_alloc(conf::small_options(), t);
    const auto c0 = a.stats().calls;
    void* p = a.allocate(huge);
    CHECK(a.stats().calls.create - c0.create == (chunked ? 8u : 1u));
    CHECK(a.stats().chunks == (chunked ? 8u : 1u));
    a.deallocate(p);                                // cached whole
    void* q = a.allocate(huge / 2 + huge / 4);      // splits it: the rest is span memory
    void* s = a.allocate(MiB);                      // lands in the rest
    host_traits::fill(s, MiB, 9);
    a.deallocate(q);
    REQUIRE(a.stats().physical == huge);
    void* r = a.allocate(huge - huge / 8 + 2 * MiB);  // no free block this large: new memory
    host_traits::fill(r, huge - huge / 8 + 2 * MiB, 4);
    if (chunked) CHECK(a.stats().physical <= huge + huge / 4);  // the seven wholly free handles mapped again
    else CHECK(a.stats().physical >= huge + huge / 2);          // all of it created
    CHECK(host_traits::verify(s, MiB, 9));
    CHECK(host_traits::verify(r, huge - huge / 8 + 2 * MiB, 4));
    CHECK(a.check() == "");
    a.deallocate(r);
    a.deallocate(s);
    a.trim(0);
    CHECK(a.stats().mapped == 0);
  }
}

TEST_CASE("a cached huge block a little smaller than the next request grows in place by the pages it lacks") {
  // A tensor grown by torch.cat a token at a time: the freed block is one page short of the next
  // request every few tokens. It is mapped again only where it lacks pages, right after its end
  // (huge blocks are placed with unmapped VA after them), not remapped whole.
  vmm::tuning t;
  t.thread_cache_large = false;  // the freed block goes to the heap's cache
  auto [hb, a] = vmm::test::make_host_alloc(conf::small_options(), t);
  const std::size_t n = t.huge_threshold + 72 * MiB;
  void* p = a.allocate(n);
  host_traits::fill(p, n, 3);
  a.deallocate(p);
  const auto c0 = a.stats().calls;
  void* q = a.allocate(n + 3 * MiB);  // two pages more
  CHECK(q == p);
  const auto c1 = a.stats().calls;
  CHECK(c1.create - c0.create == 1);
  CHECK(c1.map - c0.map == 1);
  CHECK(c1.set_access - c0.set_access == 1);
  CHECK(c1.unmap == c0.unmap);
  CHECK(a.stats().physical == n + 4 * MiB);
  CHECK(host_traits::verify(p, n, 3));  // the old pages kept their bytes
  host_traits::fill(q, n + 3 * MiB, 4);
  CHECK(a.check() == "");
  a.deallocate(q);
  void* r = a.allocate(n);  // the grown block, up to 1/8 larger, serves the old size again
  CHECK(r == p);
  CHECK(a.stats().calls.total() == c1.total());
  a.deallocate(r);
  a.trim(0);
  CHECK(a.stats().physical == 0);
  CHECK(a.check() == "");
}

TEST_CASE("after a trim, growths create handles of one page; later ones of max_handle again") {
  // A 32 MiB request grows by its size in handles of max_handle (16 MiB): two creates. After a
  // trim, the next trim_growths growths create one handle a page (16 for the same request), so
  // the next trim can give back every wholly free page; after them, max_handle again.
  vmm::tuning t;
  t.trim_growths = 3;
  t.trim_own_handle = 0;  // pages for every request
  auto [hb, a] = vmm::test::make_host_alloc(heap_only_options(), t);
  const std::size_t n = 32 * MiB;
  REQUIRE(n < t.huge_threshold);
  auto creates_for = [&](std::size_t bytes) {
    const auto c0 = a.stats().calls.create;
    void* p = a.allocate(bytes);
    REQUIRE(p != nullptr);
    host_traits::fill(p, bytes, 5);
    CHECK(host_traits::verify(p, bytes, 5));
    return std::pair{p, a.stats().calls.create - c0};
  };
  auto [p0, c0] = creates_for(n);
  CHECK(c0 == 2);
  a.deallocate(p0);
  a.trim(0);
  REQUIRE(a.stats().physical == 0);
  std::vector<void*> keep;
  for (int g = 0; g < 3; ++g) {  // the three growths after the trim: pages
    auto [p, c] = creates_for(n);
    CHECK(c == n / (2 * MiB));
    keep.push_back(p);
  }
  auto [p4, c4] = creates_for(n);  // the fourth: max_handle again
  CHECK(c4 == 2);
  keep.push_back(p4);
  CHECK(a.check() == "");
  for (void* p : keep) a.deallocate(p);
  a.trim(0);
  CHECK(a.stats().physical == 0);
  CHECK(hb->live_handles() == 0);
}

TEST_CASE("after a trim, a request of trim_own_handle or more grows by one handle of its size, which the next trim gives back in one release") {
  // Pages for a 16 MiB request (8 creates), one handle for a 48 MiB span request and one for a
  // 160 MiB huge request; freed, each of the large blocks goes back whole at the next trim.
  vmm::tuning t;
  auto [hb, a] = vmm::test::make_host_alloc(heap_only_options(), t);
  REQUIRE(t.trim_own_handle == 32 * MiB);
  const std::size_t small = 16 * MiB, span = 48 * MiB, huge = 160 * MiB;
  REQUIRE((span < t.huge_threshold && huge >= t.huge_threshold));
  a.deallocate(a.allocate(small));
  a.trim(0);
  REQUIRE(a.stats().physical == 0);
  auto grow = [&](std::size_t bytes, std::uint64_t creates) {
    const auto c0 = a.stats().calls.create;
    void* p = a.allocate(bytes);
    REQUIRE(p != nullptr);
    CHECK(a.stats().calls.create - c0 == creates);
    host_traits::fill(p, bytes, 7);
    CHECK(host_traits::verify(p, bytes, 7));
    return p;
  };
  void* s = grow(small, small / (2 * MiB));
  void* m = grow(span, 1);
  void* h = grow(huge, 1);
  CHECK(a.stats().physical == small + span + huge);
  CHECK(a.check() == "");
  for (void* p : {m, h}) {
    const auto before = a.stats();
    a.deallocate(p);
    a.trim(0);
    const auto after = a.stats();
    CHECK(after.calls.release - before.calls.release == 1);
    CHECK(before.physical - after.physical == (p == m ? span : huge));
    CHECK(host_traits::verify(s, small, 7));
  }
  CHECK(a.stats().physical == small);
  CHECK(a.check() == "");
  a.deallocate(s);
  a.trim(0);
  CHECK(a.stats().physical == 0);
  CHECK(hb->live_handles() == 0);
}

TEST_CASE("a growth maps idle handles that fill whole pieces; smaller ones are released, the range created whole") {
  // Sixteen one-page handles (a growth after a trim) go idle when their block is freed and a
  // larger request evicts them: the growth creates handles of max_handle (16 MiB) instead of
  // mapping the pages, each of which would cost a mapping every time its memory moves again.
  vmm::tuning t;
  t.trim_growths = 1;
  t.trim_own_handle = 0;  // the growth after the trim in pages
  auto [hb, a] = vmm::test::make_host_alloc(heap_only_options(), t);
  const std::size_t n = 32 * MiB;
  REQUIRE(2 * n < t.huge_threshold);
  a.deallocate(a.allocate(n));
  a.trim(0);
  REQUIRE(a.stats().physical == 0);
  const auto c0 = a.stats().calls;
  void* pages = a.allocate(n);  // the growth after the trim: one handle a page
  void* q = a.allocate(n);      // max_handle again
  REQUIRE((pages && q));
  CHECK(a.stats().calls.create - c0.create == n / (2 * MiB) + n / t.max_handle);
  a.deallocate(pages);
  const auto c1 = a.stats().calls;
  void* r = a.allocate(2 * n);  // the pages' handles are evicted: released, not mapped
  REQUIRE(r != nullptr);
  host_traits::fill(r, 2 * n, 3);
  CHECK(host_traits::verify(r, 2 * n, 3));
  const auto c2 = a.stats().calls;
  CHECK(c2.map - c1.map == 2 * n / t.max_handle);
  CHECK(c2.create - c1.create == 2 * n / t.max_handle);
  CHECK(c2.release - c1.release == n / (2 * MiB));
  CHECK(a.stats().physical == 3 * n);
  CHECK(hb->live_handles() == 3 * n / t.max_handle);
  CHECK(a.check() == "");
  a.deallocate(q);
  a.deallocate(r);
  a.trim(0);
  CHECK(a.stats().physical == 0);
  CHECK(hb->live_handles() == 0);
}

TEST_CASE("under a memory limit, pages freed beside a live block go back when the limit binds") {
  // One 24 MiB growth; a 22 MiB block and a 1 MiB block then share its memory, and the 22 MiB one
  // is freed. Under a 64 MiB limit a 48 MiB request fits only if the 16 MiB of wholly free pages
  // beside the live block can be given back: with one handle per growth (limit_chunk 0) they
  // cannot; with handles of 8 MiB two of the three go back. The limit set at construction and at
  // run time alike; without a limit the growth is one handle either way.
  enum class how { option, at_run_time, none };
  for (std::size_t lc : {std::size_t{0}, vmm::tuning{}.limit_chunk})
    for (how h : {how::option, how::at_run_time, how::none}) {
      CAPTURE(lc);
      CAPTURE(static_cast<int>(h));
      vmm::options o = conf::small_options();
      vmm::tuning t;
      t.thread_cache_large = false;  // the freed block goes to the heap, not to this thread
      t.max_handle = 0;              // without a limit, one handle a growth
      t.limit_chunk = lc;
      if (h == how::option) o.memory_limit = 64 * MiB;
      auto [hb, a] = vmm::test::make_host_alloc(o, t);
      if (h == how::at_run_time) a.set_memory_limit(64 * MiB);
      const bool chunked = lc && h != how::none;
      void* z = a.allocate(24 * MiB);
      CHECK(a.stats().chunks == (chunked ? 3u : 1u));
      a.deallocate(z);
      void* x = a.allocate(22 * MiB);  // the front of z's memory
      void* y = a.allocate(MiB);       // the rest: y shares the last handle (or the only one)
      host_traits::fill(y, MiB, 7);
      a.deallocate(x);
      REQUIRE(a.stats().physical == 24 * MiB);
      void* r = nullptr;
      try {
        r = a.allocate(48 * MiB);
      } catch (const vmm::out_of_memory& e) {
        CHECK(std::string(e.what()).find("memory limit") != std::string::npos);
      }
      if (h == how::none || lc) {
        REQUIRE(r != nullptr);
        host_traits::fill(r, 48 * MiB, 5);
        if (h != how::none) CHECK(a.stats().physical <= 64 * MiB);
      } else {
        CHECK(r == nullptr);  // 24 MiB held in one handle + 48 MiB new > 64 MiB
        CHECK(a.stats().physical == 24 * MiB);
      }
      CHECK(host_traits::verify(y, MiB, 7));
      CHECK(a.check() == "");
      if (r) a.deallocate(r);
      a.deallocate(y);
      a.trim(0);
      CHECK(a.stats().mapped == 0);
    }
}

TEST_CASE("streams: memory freed on S while S runs behind serves S's next growth, not new memory") {
  // The GPU behind the CPU: S's fences stay pending. Free chunks S alone may still use are
  // retired (their handles mapped where S's next request needs them, their old VA unmapped once
  // S catches up) instead of skipped; another stream never gets them early.
  vmm::tuning t;
  t.max_growth = 2 * MiB;  // chunks of 2 MiB: a 3-chunk request must be stitched from them
  auto [hb, a] = vmm::test::make_host_alloc(conf::small_options(), t);
  auto s1 = host_traits::stream(1), s2 = host_traits::stream(2);
  std::vector<void*> v;
  for (int i = 0; i < 6; ++i) v.push_back(a.allocate(2 * MiB, 0, s1));  // one chunk each
  void* keep = a.allocate(2 * MiB, 0, s1);
  for (int i = 0; i < 6; i += 2) a.deallocate(v[i], s1);  // three free chunks, not adjacent
  hb->hold_stream(s1);  // S1's work on them is still running
  const auto before = a.stats();
  CHECK(before.free_chunk_bytes >= 6 * MiB);
  // Another stream may not take them while S1 runs: it gets new memory.
  void* other = a.allocate(5 * MiB, 0, s2);
  CHECK(a.stats().chunks_retired == before.chunks_retired);
  CHECK(a.stats().physical > before.physical);
  const auto mid = a.stats();
  // S1 itself: its next growth maps the retired handles, no new memory.
  void* big = a.allocate(6 * MiB, 0, s1);
  const auto after = a.stats();
  CHECK(after.chunks_retired > mid.chunks_retired);
  CHECK(after.retiring > 0);                 // old VA still mapped: S1 may still be using it
  CHECK(after.physical <= mid.physical);     // no memory created for the request
  host_traits::fill(big, 6 * MiB, 42);
  CHECK(host_traits::verify(big, 6 * MiB, 42));
  CHECK(a.check() == "");
  hb->complete_stream(s1);
  a.trim(0);                                 // S1 caught up: the retired ranges are unmapped
  CHECK(a.stats().retiring == 0);
  CHECK(a.check() == "");
  a.deallocate(big, s1);
  a.deallocate(other, s2);
  a.deallocate(keep, s1);
  for (int i = 1; i < 6; i += 2) a.deallocate(v[i], s1);
  a.trim(0);
  CHECK(a.stats().physical == 0);
  CHECK(hb->live_mappings() == 0);
}

TEST_CASE("growth: below the allocated high-water mark new memory is created, above it free chunks move") {
  // Moving a free chunk to where a growth needs it costs an unmap and a map; creating costs a
  // create and a map. Below the most the heap ever had allocated, creating cannot raise the peak
  // held, so the growth creates; above it, free chunks are moved and nothing is created.
  vmm::tuning t;
  t.max_growth = 2 * MiB;  // chunks of 2 MiB
  t.trim_growths = 0;      // handles as without a trim
  t.thread_cache_large = false;
  auto [hb, a] = vmm::test::make_host_alloc(conf::small_options(), t);
  std::vector<void*> top;
  for (int i = 0; i < 8; ++i) top.push_back(a.allocate(2 * MiB));
  for (void* p : top) a.deallocate(p);
  a.trim(0);  // 16 MiB allocated at most, nothing held
  REQUIRE(a.stats().physical == 0);
  std::vector<void*> v;
  for (int i = 0; i < 4; ++i) v.push_back(a.allocate(2 * MiB));
  a.deallocate(v[0]);
  a.deallocate(v[2]);  // two free chunks, not adjacent: a 4 MiB request fits neither
  const auto before = a.stats();
  REQUIRE(before.free_chunk_bytes == 4 * MiB);
  void* p = a.allocate(4 * MiB);  // 8 + 4 MiB held <= 16: created, nothing moved
  REQUIRE(p);
  const auto mid = a.stats();
  CHECK(mid.calls.unmap == before.calls.unmap);
  CHECK(mid.calls.create > before.calls.create);
  CHECK(mid.physical == before.physical + 4 * MiB);
  CHECK(mid.free_chunk_bytes == 4 * MiB);
  void* q = a.allocate(6 * MiB);  // 12 + 6 MiB > 16: the two free chunks move, 2 MiB is created
  REQUIRE(q);
  const auto after = a.stats();
  CHECK(after.calls.unmap == mid.calls.unmap + 2);
  CHECK(after.physical == mid.physical + 2 * MiB);
  CHECK(after.free_chunk_bytes == 0);
  host_traits::fill(q, 6 * MiB, 9);
  CHECK(host_traits::verify(q, 6 * MiB, 9));
  CHECK(a.check() == "");
  a.deallocate(p);
  a.deallocate(q);
  a.deallocate(v[1]);
  a.deallocate(v[3]);
  a.trim(0);
  CHECK(a.stats().physical == 0);
  CHECK(hb->live_mappings() == 0);
}

TEST_CASE("streams: a freed huge block larger than S's next request serves it while S runs behind") {
  // Training with varying shapes: a 96 MiB activation freed, a 70 MiB one asked for on the same
  // stream while the GPU is still behind. Its handle is mapped whole for the request (retired):
  // no new memory, where skipping the larger chunk created 70 MiB more.
  vmm::tuning t;
  t.huge_threshold = 32 * MiB;
  t.thread_cache_large = false;  // the heap's path, not this thread's cached block
  t.split_cached_huge = false;   // the remapping path (splitting would carve the block instead)
  auto [hb, a] = vmm::test::make_host_alloc(conf::small_options(), t);
  auto s1 = host_traits::stream(1);
  void* big = a.allocate(96 * MiB, 0, s1);
  host_traits::fill(big, 96 * MiB, 7);
  hb->hold_stream(s1);  // S1's kernels on `big` still run
  a.deallocate(big, s1);
  const auto before = a.stats();
  void* p = a.allocate(70 * MiB, 0, s1);
  const auto after = a.stats();
  CHECK(after.chunks_retired > before.chunks_retired);
  CHECK(after.physical == before.physical);  // the freed block's memory, nothing created
  CHECK(after.peak_physical == before.peak_physical);
  host_traits::fill(p, 70 * MiB, 9);
  CHECK(host_traits::verify(p, 70 * MiB, 9));
  CHECK(a.check() == "");
  hb->complete_stream(s1);
  a.deallocate(p, s1);
  a.trim(0);
  CHECK(a.stats().physical == 0);
  CHECK(a.stats().retiring == 0);
  CHECK(hb->live_mappings() == 0);
}

TEST_CASE("slabs: a few slots of many classes share one page; a page goes back with its last slab") {
  auto [hb, a] = vmm::test::make_host_alloc(heap_only_options());
  REQUIRE(a.granularity() == G2);
  // Slots of 256 B to 8 KiB: slabs of one unit (G / 8) each, all in one page of slabs.
  std::vector<void*> ps;
  for (std::size_t n = 256; n <= 8192; n *= 2) ps.push_back(a.allocate(n));
  CHECK(a.stats().slab_bytes == G2);
  CHECK(a.check() == "");
  // 64 KiB slots: a slab of 32 slots is a page; it takes one of its own.
  void* big = a.allocate(64 * 1024);
  CHECK(a.stats().slab_bytes == 2 * G2);
  // Every slot in its own slab's units: the memory map lists each as live, inside a slab page.
  std::size_t live_small = 0;
  for (const auto& seg : a.memory_map())
    for (const auto& b : seg.blocks)
      if (b.state == vmm::block_state::live && b.size <= 64 * 1024) ++live_small;
  CHECK(live_small == ps.size() + 1);
  a.deallocate(big);
  for (void* p : ps) a.deallocate(p);
  a.trim(0);  // empty slabs go, then their pages, then the memory
  CHECK(a.stats().slab_bytes == 0);
  CHECK(a.stats().mapped == 0);
  CHECK(a.check() == "");
}

TEST_CASE("streams: small blocks freed on another stream wait for that stream's fence") {
  auto [hb, a] = vmm::test::make_host_alloc(heap_only_options());  // the heap's own rules, slot by slot
  auto s1 = host_traits::stream(1), s2 = host_traits::stream(2);
  // Slabs belong to a stream: S2 never draws from S1's slots while S1 runs.
  hb->hold_stream(s1);
  void* p = a.allocate(100, 0, s1);
  a.deallocate(p, s1);
  CHECK(a.allocate(100, 0, s2) != p);
  CHECK(a.allocate(100, 0, s1) == p);  // S1 reuses at once
  // Freed on S2 (the last user), while S2 runs: S1's slab must not reuse it yet.
  hb->hold_stream(s2);
  a.deallocate(p, s2);
  CHECK(a.stats().deferred == 1);
  void* q = a.allocate(100, 0, s1);
  CHECK(q != p);
  hb->complete_stream(s2);
  a.trim(std::size_t(-1));  // polls the deferred free: the slot is free again
  CHECK(a.stats().deferred == 0);
  CHECK(a.allocate(100, 0, s1) == p);
  a.deallocate(q, s1);
  hb->complete_stream(s1);
  CHECK(a.check() == "");
}

TEST_CASE("streams: record_stream holds a block until the extra stream's fence completes") {
  auto [hb, a] = vmm::test::make_host_alloc(conf::small_options());
  auto s1 = host_traits::stream(1), s2 = host_traits::stream(2);
  for (std::size_t n : {std::size_t{4096}, 3 * MiB, 300 * MiB}) {  // small, large, huge
    CAPTURE(n);
    hb->hold_stream(s2);
    void* p = a.allocate(n, 0, s1);
    a.record_stream(p, s2);
    a.deallocate(p, s1);
    CHECK(a.stats().deferred >= 1);
    CHECK(a.usable_size(p) == 0);
    CHECK_THROWS_AS(a.deallocate(p, s1), vmm::error);  // already freed (pending)
    void* q = a.allocate(n, 0, s1);
    CHECK(q != p);  // even its own stream must wait for S2
    CHECK(a.check() == "");
    hb->complete_stream(s2);
    a.trim(std::size_t(-1));  // polls deferred frees
    CHECK(a.stats().deferred == 0);
    a.deallocate(q, s1);
    CHECK(a.check() == "");
  }
}

TEST_CASE("memory_map: segments tile the mapped memory, every block with its state and pool") {
  auto [hb, a] = vmm::test::make_host_alloc(conf::small_options());
  auto s1 = host_traits::stream(1), s2 = host_traits::stream(2);
  // Walks the map: blocks tile their segments in address order; returns the block at each start.
  std::vector<vmm::segment_info> keep;
  auto walk = [&a = a, &keep](std::size_t& mapped) {
    std::map<std::uintptr_t, std::pair<vmm::block_info, const vmm::segment_info*>> at;
    keep = a.memory_map();
    mapped = 0;
    std::uintptr_t last_end = 0;
    for (const auto& seg : keep) {
      CHECK(seg.addr >= last_end);
      std::uintptr_t x = seg.addr;
      for (const auto& b : seg.blocks) {
        CHECK(b.addr == x);
        CHECK(b.size > 0);
        if (b.state != vmm::block_state::live) CHECK(b.requested == 0);
        at[b.addr] = {b, &seg};
        x += b.size;
      }
      CHECK(x == seg.addr + seg.size);
      last_end = x;
      mapped += seg.size;
    }
    return at;
  };
  auto key = [](void* p) { return reinterpret_cast<std::uintptr_t>(p); };

  void* small = a.allocate(1000, 0, s1);
  void* large = a.allocate(3 * MiB + 5, 0, s1);
  void* huge = a.allocate(300 * MiB, 0, s1);
  void* gone = a.allocate(5 * MiB, 0, s1);
  a.deallocate(gone, s1);
  hb->hold_stream(s2);
  void* pend = a.allocate(2 * MiB, 0, s1);
  a.record_stream(pend, s2);
  a.deallocate(pend, s1);
  a.begin_pool(7);
  void* pooled = a.allocate(1 * MiB, 0, s1);
  a.end_pool(7);

  std::size_t mapped = 0;
  auto at = walk(mapped);
  const auto st = a.stats();
  CHECK(mapped == st.mapped);
  REQUIRE(at.count(key(small)));
  CHECK(at[key(small)].first.state == vmm::block_state::live);
  CHECK(at[key(small)].first.requested == 1000);
  CHECK(at[key(small)].first.size == a.usable_size(small));
  CHECK(at[key(large)].first.state == vmm::block_state::live);
  CHECK(at[key(large)].first.requested == 3 * MiB + 5);
  CHECK(at[key(huge)].first.state == vmm::block_state::live);
  CHECK(at[key(huge)].second->huge);
  CHECK(at[key(pend)].first.state == vmm::block_state::pending_free);
  REQUIRE(at.count(key(pooled)));
  CHECK(at[key(pooled)].first.state == vmm::block_state::live);
  CHECK(at[key(pooled)].second->pool == 7);
  CHECK(at[key(small)].second->pool == 0);
  if (at.count(key(gone))) {  // kept by the thread cache, or merged into a free neighbour
    CHECK(at[key(gone)].first.state != vmm::block_state::live);
  }
  std::size_t live = 0, requested = 0;
  for (auto& [p, e] : at)
    if (e.first.state == vmm::block_state::live) {
      ++live;
      requested += e.first.requested;
    }
  CHECK(live == st.live);
  CHECK(requested == st.requested);
  CHECK(a.check() == "");

  for (void* p : {small, large, huge, pooled}) a.deallocate(p, s1);
  a.release_pool(7);
  hb->complete_stream(s2);
  a.trim(std::size_t(-1));
  at = walk(mapped);
  CHECK(mapped == a.stats().mapped);
  for (auto& [p, e] : at) CHECK(e.first.state != vmm::block_state::live);
  CHECK(a.check() == "");
}

TEST_CASE("streams: trim waits only for the fences of chunks it unmaps") {
  auto [hb, a] = vmm::test::make_host_alloc(conf::small_options());
  auto s1 = host_traits::stream(1);
  void* p = a.allocate(300 * MiB, 0, s1);
  a.deallocate(p, s1);  // freed on S1, fence not recorded yet
  hb->hold_stream(s1);
  // The host backend reports a wait on a held stream as an error instead of hanging: trim must
  // try to wait for S1 (the only stream that touched the chunk) and report that it could not.
  CHECK_THROWS_AS(a.trim(0), vmm::error);
  CHECK(a.check() == "");
  CHECK(a.stats().mapped >= 300 * MiB);  // nothing was unmapped under a running stream
  hb->complete_stream(s1);
  a.trim(0);
  CHECK(a.stats().mapped == 0);
}

// ---- policies on the host backend ----

TEST_CASE("policy: peers are granted on every mapping with their own mode") {
  vmm::options o = conf::small_options();
  o.peers = {{1, vmm::access_mode::read}};
  auto [hb, a] = vmm::test::make_host_alloc(o);
  void* p = a.allocate(5 * MiB);
  auto u = reinterpret_cast<std::uintptr_t>(p);
  CHECK(hb->access_of(u, 0) == vmm::access_mode::read_write);
  CHECK(hb->access_of(u, 1) == vmm::access_mode::read);
  a.deallocate(p);
}

TEST_CASE("policy: an unknown peer device is a clear error at creation") {
  vmm::options o = conf::small_options();
  o.peers = {{5, vmm::access_mode::read_write}};
  CHECK_THROWS_AS(host_traits::make(o), vmm::error);
}

TEST_CASE("policy: compression require fails clearly where it is not supported; prefer falls back") {
  vmm::options o = conf::small_options();
  o.compression = vmm::compression_mode::require;
  try {
    host_traits::make(o);
    FAIL("compression required on a backend without it");
  } catch (const vmm::error& e) {
    CHECK(e.st().kind == vmm::errc::not_supported);
  }
  o.compression = vmm::compression_mode::prefer;
  auto a = host_traits::make(o);
  a.deallocate(a.allocate(100));
  CHECK(a.stats().compression_fallbacks >= 1);
}

TEST_CASE("policy: granularity follows the backend (4 KiB host pages)") {
  vmm::host_backend_options h;
  h.granularity = 4096;
  auto a = vmm::allocator::host(conf::small_options(), h);
  CHECK(a.granularity() == 4096);
  void* p = a.allocate(10000);
  std::memset(p, 1, 10000);
  a.deallocate(p);
  a.trim(0);
  CHECK(a.stats().mapped == 0);
}

// The device's free memory (other processes included) decides. 512 MiB is held free in two spans
// that a huge block H keeps apart; a 300 MiB request fits neither, so it grows, stitching free
// chunks. Without pressure it takes what it needs and the rest stays held; when the device is
// short of the margin everything free is given back first.
TEST_CASE("policy: free_memory_margin gives free memory back before a growth that leaves the device short") {
  constexpr std::size_t M = std::size_t{1} << 20;
  struct outcome {
    std::size_t physical, device_free;
    std::uint64_t margin_trims;
  };
  auto run = [&](std::size_t margin, std::size_t device, std::size_t other) {
    auto st = std::make_shared<vmm::test::fault_state>();
    vmm::host_backend_options h;
    h.physical_limit = device;
    vmm::options o;
    o.reservation_size = 4 * device;
    o.free_memory_margin = margin;
    vmm::tuning t;
    t.thread_cache_large = false;  // every block goes back to the heap at once
    t.huge_headroom_div = 0;       // H between the spans A and B, which stay apart
    auto a = vmm::allocator_access::make(vmm::test::make_fault_host(st, h), o, t);
    std::vector<void*> v;
    for (int i = 0; i < 16; ++i) v.push_back(a.allocate(16 * M));  // span A
    void* hb = a.allocate(300 * M);                                 // H: its own chunk after A
    for (int i = 0; i < 16; ++i) v.push_back(a.allocate(16 * M));  // span B, after H
    for (void* p : v) a.deallocate(p);
    CHECK(a.stats().free_chunk_bytes >= 512 * M);  // freed memory stays mapped (release_threshold max)
    CHECK(a.stats().margin_trims == 0);
    vmm::mem_handle taken = 0;
    if (other) taken = st->host->create(other, vmm::chunk_props{}).value;  // another user of the device
    void* big = a.allocate(300 * M);  // fits neither span: a growth
    vmm::test::bulk_set(big, 1, 300 * M);
    const auto s = a.stats();
    outcome r{s.physical, st->host->mem_info().value.free, s.margin_trims};
    CHECK(a.check() == "");
    a.deallocate(big);
    a.deallocate(hb);
    if (taken) CHECK(st->host->release(taken).ok());
    return r;
  };
  const outcome off = run(0, 2048 * M, 512 * M);
  const outcome short_ = run(512 * M, 2048 * M, 512 * M);
  const outcome roomy = run(512 * M, 8192 * M, 512 * M);
  CHECK(off.margin_trims == 0);
  CHECK(roomy.margin_trims == 0);
  CHECK(short_.margin_trims == 1);
  // Off, or with room on the device: the growth stitches ~300 MiB of free chunks and the rest of
  // the 512 MiB stays held. Short: the rest goes back, the device has it again.
  CHECK(off.physical >= 800 * M);
  CHECK(roomy.physical == off.physical);
  CHECK(short_.physical <= 620 * M);
  CHECK(short_.physical >= 600 * M);
  CHECK(short_.device_free >= off.device_free + 150 * M);
}

TEST_CASE("policy: the default reservation is twice the device memory") {
  vmm::host_backend_options h;
  h.physical_limit = 3ull << 30;
  auto a = vmm::allocator::host({}, h);
  CHECK(a.stats().reserved == 6ull << 30);
}

// ---- arena: holes, chunk table and rollback, seen directly ----

TEST_CASE("arena: plan, run, commit: the job owns its range until commit; a chunk given back is stitched") {
  vmm::options o;
  o.reservation_size = 64 * MiB;
  o.peers = {{1, vmm::access_mode::read_write}};
  vmm::host_backend_options ho;
  ho.device_count = 2;
  auto backend = vmm::make_backend<vmm::host_backend>(ho);
  vmm::host_backend* hb = vmm::backend_cast<vmm::host_backend>(*backend);
  vmm::arena ar(std::move(backend), o);
  REQUIRE(ar.open().ok());
  auto settle = [&] {
    vmm::arena::job j = ar.take_work();
    ar.run(j);
    return ar.commit(j);
  };
  auto r = ar.map_range(4 * MiB, 0, 0, nullptr);
  REQUIRE(r.ok());
  CHECK(ar.has_work());
  CHECK(ar.check() == "");                // planned: no hole, no chunk, no driver call yet
  CHECK(ar.stats().mapped == 0);
  CHECK(ar.stats().calls.create == 0);
  CHECK(hb->live_mappings() == 0);
  CHECK(settle().ok());
  CHECK(ar.check() == "");
  auto s = ar.stats();
  CHECK(s.mapped == 4 * MiB);
  CHECK(s.free_chunk_bytes == 4 * MiB);
  CHECK(hb->access_of(r.value, 1) == vmm::access_mode::read_write);  // one set_access, owner and peer
  // Out of VA: a clean failure, nothing planned.
  auto r2 = ar.map_range(64 * MiB, 0, 0, nullptr);
  CHECK(r2.st.kind == vmm::errc::out_of_memory);
  CHECK_FALSE(ar.has_work());
  CHECK(ar.check() == "");
  auto id = ar.chunk_at(r.value);
  REQUIRE(id != vmm::arena::no_chunk);
  ar.give_back_chunk(id, true);  // out of the table at once; its unmap is the job's
  CHECK(ar.stats().mapped == 0);
  CHECK(ar.stats().idle == 4 * MiB);
  CHECK(hb->live_mappings() == 1);
  auto r3 = ar.map_range(4 * MiB, 0, 0, nullptr);  // stitched from the idle handle, in the same job
  REQUIRE(r3.ok());
  CHECK(settle().ok());
  CHECK(hb->live_mappings() == 1);
  CHECK(ar.stats().stitched == 1);
  CHECK(ar.stats().calls.create == 1);
  CHECK(ar.stats().calls.unmap == 1);
  CHECK(ar.check() == "");
}

// ---- C API ----

TEST_CASE("C API: create, malloc, free, stats, check, trim, errors") {
  vmm_policy pol;
  vmm_policy_init(&pol);
  pol.backend = VMM_BACKEND_HOST;
  pol.reservation_size = 4ull << 30;
  vmm_allocator* a = nullptr;
  REQUIRE(vmm_create(&pol, &a) == VMM_SUCCESS);
  void* p = vmm_malloc(a, 1000);
  REQUIRE(p);
  std::memset(p, 3, 1000);
  void* q = vmm_aligned_alloc(a, 4096, 5000);
  REQUIRE(q);
  CHECK(reinterpret_cast<std::uintptr_t>(q) % 4096 == 0);
  vmm_stats s;
  CHECK(vmm_get_stats(a, &s) == VMM_SUCCESS);
  CHECK(s.requested == 6000);
  CHECK(s.live == 2);
  CHECK(s.driver_calls > 0);
  CHECK(s.driver_ns > 0);  // the growth's calls, timed
  CHECK(vmm_check(a) == VMM_SUCCESS);
  CHECK(vmm_free(a, p) == VMM_SUCCESS);
  CHECK(vmm_free(a, p) == VMM_ERROR_INVALID_POINTER);
  CHECK(std::string(vmm_last_error()).find("double free") != std::string::npos);
  CHECK(vmm_free(a, nullptr) == VMM_SUCCESS);
  CHECK(vmm_malloc(a, 0) == nullptr);
  CHECK(vmm_last_status() == VMM_ERROR_INVALID_VALUE);
  CHECK(vmm_aligned_alloc(a, 3, 10) == nullptr);
  CHECK(vmm_malloc(a, SIZE_MAX) == nullptr);
  CHECK(vmm_last_status() == VMM_ERROR_OUT_OF_MEMORY);
  CHECK(vmm_free(a, q) == VMM_SUCCESS);
  CHECK(vmm_trim(a, 0) == VMM_SUCCESS);
  CHECK(vmm_get_stats(a, &s) == VMM_SUCCESS);
  CHECK(s.mapped == 0);
  CHECK(vmm_check(a) == VMM_SUCCESS);
  CHECK(std::string(vmm_status_string(VMM_ERROR_OUT_OF_MEMORY)) == "out of memory");
  vmm_destroy(a);
  vmm_destroy(nullptr);
  CHECK(vmm_create(nullptr, &a) == VMM_ERROR_INVALID_VALUE);
  CHECK(vmm_malloc(nullptr, 10) == nullptr);
}

TEST_CASE("C API: the memory limit and the host physical limit give VMM_ERROR_OUT_OF_MEMORY") {
  vmm_policy pol;
  vmm_policy_init(&pol);
  pol.backend = VMM_BACKEND_HOST;
  pol.reservation_size = 1ull << 30;
  pol.host_physical_limit = 16 * MiB;
  vmm_allocator* a = nullptr;
  REQUIRE(vmm_create(&pol, &a) == VMM_SUCCESS);
  void* p = vmm_malloc(a, 12 * MiB);
  REQUIRE(p);
  CHECK(vmm_malloc(a, 12 * MiB) == nullptr);
  CHECK(vmm_last_status() == VMM_ERROR_OUT_OF_MEMORY);
  CHECK(std::string(vmm_last_error()).find("ENOMEM") != std::string::npos);
  CHECK(vmm_check(a) == VMM_SUCCESS);
  CHECK(vmm_free(a, p) == VMM_SUCCESS);
  CHECK(vmm_malloc(a, 12 * MiB) != nullptr);
  vmm_destroy(a);
}

// ---- threads ----

TEST_CASE("threads: concurrent small and large traffic keeps every byte and every invariant") {
  auto a = host_traits::make(conf::small_options());
  std::atomic<int> bad{0};
  std::vector<std::thread> ts;
  for (int t = 0; t < 6; ++t)
    ts.emplace_back([&, t] {
      std::mt19937_64 rng(t);
      std::vector<std::pair<void*, std::size_t>> live;
      for (int i = 0; i < 20000; ++i) {
        if (live.size() < 64 && (live.empty() || rng() % 2)) {
          std::size_t n = rng() % 8 ? 1 + rng() % 4096 : 1 + rng() % (3 * MiB);
          auto* p = static_cast<unsigned char*>(a.allocate(n));
          std::memset(p, t + 1, std::min<std::size_t>(n, 512));
          live.push_back({p, n});
        } else {
          std::size_t k = rng() % live.size();
          auto* p = static_cast<unsigned char*>(live[k].first);
          for (std::size_t j = 0; j < std::min<std::size_t>(live[k].second, 512); ++j)
            if (p[j] != t + 1) ++bad;
          // Half the frees happen on another thread's behalf: the block goes to this thread's cache.
          a.deallocate(p);
          live[k] = live.back();
          live.pop_back();
        }
      }
      for (auto& [p, n] : live) a.deallocate(p);
    });
  for (auto& t : ts) t.join();
  CHECK(bad == 0);
  CHECK(a.check() == "");
  auto s = a.stats();
  CHECK(s.requested == 0);
  CHECK(s.live == 0);
  CHECK(s.allocs == s.frees);
  CHECK(s.allocs > 60000);
}

TEST_CASE("threads: a block allocated on one thread and freed on another") {
  auto a = host_traits::make(conf::small_options());
  std::vector<void*> ps;
  for (int i = 0; i < 1000; ++i) ps.push_back(a.allocate(64 + i % 300));
  std::thread([&] {
    for (void* p : ps) a.deallocate(p);
    CHECK_THROWS_AS(a.deallocate(ps[0]), vmm::error);  // double free, seen across threads
  }).join();  // the thread's cache goes back to the heap when it ends
  CHECK(a.check() == "");
  CHECK(a.stats().live == 0);
  a.trim(0);
  CHECK(a.stats().mapped == 0);
}

// ---- typed allocation, destroyed allocators ----

TEST_CASE("bad input: count * size overflow in typed allocation is out_of_memory, not a short block") {
  auto a = host_traits::make(conf::small_options());
  auto before = a.stats();
  CHECK_THROWS_AS(a.allocate_array<double>(SIZE_MAX / 4), vmm::out_of_memory);
  CHECK_THROWS_AS(a.allocate_array<std::uint64_t>((SIZE_MAX >> 3) + 2), vmm::out_of_memory);
  struct alignas(4096) page { char b[4096]; };
  page* pg = a.allocate_array<page>(3);
  CHECK(reinterpret_cast<std::uintptr_t>(pg) % 4096 == 0);
  CHECK(a.usable_size(pg) >= 3 * 4096);
  a.deallocate(pg);
  CHECK(a.stats().live == before.live);
  CHECK(a.check() == "");
  vmm_policy pol;
  vmm_policy_init(&pol);
  pol.backend = VMM_BACKEND_HOST;
  pol.reservation_size = 1ull << 30;
  vmm_allocator* c = nullptr;
  REQUIRE(vmm_create(&pol, &c) == VMM_SUCCESS);
  CHECK(vmm_calloc_n(c, SIZE_MAX / 2, 3) == nullptr);
  CHECK(vmm_last_status() == VMM_ERROR_OUT_OF_MEMORY);
  void* q = vmm_calloc_n(c, 10, 100);
  CHECK(q != nullptr);
  CHECK(vmm_record_stream(c, q, reinterpret_cast<void*>(0x5)) == VMM_SUCCESS);
  CHECK(vmm_free(c, q) == VMM_SUCCESS);
  CHECK(vmm_record_stream(c, q, nullptr) == VMM_ERROR_INVALID_POINTER);
  CHECK(vmm_check(c) == VMM_SUCCESS);
  vmm_destroy(c);
}

TEST_CASE("bad input: a pointer from a destroyed allocator is refused by the next one") {
  void* old = nullptr;
  void* old_large = nullptr;
  {
    auto a = host_traits::make(conf::small_options());
    old = a.allocate(100);
    old_large = a.allocate(5 * MiB);
  }  // destroyed with both blocks live: everything unmapped
  auto b = host_traits::make(conf::small_options());  // may well reuse the same address range
  auto before = b.stats();
  CHECK(b.try_deallocate(old).kind == vmm::errc::invalid_pointer);
  CHECK(b.try_deallocate(old_large).kind == vmm::errc::invalid_pointer);
  CHECK(b.check() == "");
  CHECK(b.stats().live == before.live);
  b.deallocate(b.allocate(100));
}

TEST_CASE("thread caches: a default alignment above 256 holds on the fast path too") {
  vmm::options o = conf::small_options();
  o.alignment = 4096;
  auto a = host_traits::make(o);
  // An explicit 256-byte alignment fills this thread's cache with 512-byte slots...
  a.deallocate(a.allocate(512, 256));
  std::size_t cached = 0;
  for (const auto& c : a.class_stats()) cached += c.cached_slots;
  REQUIRE(cached > 0);
  // ...which requests with the default alignment must not take.
  for (int i = 0; i < 4; ++i) {
    void* p = a.allocate(512);
    CHECK(reinterpret_cast<std::uintptr_t>(p) % 4096 == 0);
    a.deallocate(p);
  }
  CHECK(a.check() == "");
}

TEST_CASE("stats: a block allocated through a thread cache and freed on the locked path is counted once") {
  auto a = host_traits::make(conf::small_options());
  auto s1 = host_traits::stream(1), s2 = host_traits::stream(2);
  void* p = a.allocate(100, 0, s1);  // served by this thread's cache (requested counted there)
  a.deallocate(p, s2);               // another stream: the locked path subtracts it in the heap
  void* big = a.allocate(3 * MiB);   // a locked-path allocation updates the heap's peak
  a.deallocate(big);
  std::vector<void*> v;
  for (int i = 0; i < 64; ++i) v.push_back(a.allocate(5000));  // cache refills (locked path)
  for (void* q : v) a.deallocate(q);
  auto s = a.stats();
  CHECK(s.requested == 0);
  CHECK(s.allocated == 0);
  CHECK(s.live == 0);
  CHECK(s.allocs == s.frees);
  CHECK(a.check() == "");
}
