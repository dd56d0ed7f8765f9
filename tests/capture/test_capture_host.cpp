// SPDX-License-Identifier: Apache-2.0
// Stream capture (CUDA graphs) on the host backend, whose capture model follows the driver's rules:
// an event op on a capturing stream invalidates the capture, and a call the driver counts as
// unsafe invalidates the captures that prohibit it unless the calling thread is in relaxed mode.
// The allocator must never invalidate a capture, on any path; graph pools keep a capture's memory
// for its replays.
#include <doctest/doctest.h>

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "support/bulk_bytes.hpp"
#include "support/host_alloc.hpp"
#include "support/stream_tag.hpp"
#include "vmmalloc/vmmalloc.h"

using namespace vmm;
using vmm::test::bulk_set;
using vmm::test::stream_tag;
using vmm::test::make_host_alloc;

namespace {
constexpr std::size_t KiB = 1024, MiB = KiB * 1024, GiB = MiB * 1024;
options opts() {
  options o;
  o.reservation_size = 4 * GiB;
  return o;
}
tuning tune() {
  tuning t;
  t.huge_threshold = 64 * MiB;
  return t;
}
// Ends the capture and says why it was invalidated (empty: it was not).
std::string end(host_backend* hb, stream_t s) {
  std::string why;
  status st = hb->end_capture(s, &why);
  return st.ok() ? std::string() : "invalidated by " + why;
}
}  // namespace

TEST_CASE("capture: allocations that need growth, on every path, leave a global capture valid") {
  auto ha = make_host_alloc(opts(), tune());
  [[maybe_unused]] auto* hb = ha.hb;
  auto& a = ha.a;
  for (std::size_t n : {std::size_t{256}, 48 * KiB, 3 * MiB, 100 * MiB}) {  // cache/slab, large, huge
    CAPTURE(n);
    a.trim(0);  // nothing mapped: every size needs growth
    REQUIRE(hb->begin_capture(stream_tag(1)) != 0);
    void* p = a.allocate(n, 0, stream_tag(1));
    void* q = a.allocate(n, 0, stream_tag(1));
    a.deallocate(p, stream_tag(1));
    a.deallocate(q, stream_tag(1));
    CHECK(end(hb, stream_tag(1)) == "");
    CHECK(a.check() == "");
  }
}

TEST_CASE("capture: without the relaxed mode the model refuses growth (the model works)") {
  auto ha = make_host_alloc(opts(), tune());
  [[maybe_unused]] auto* hb = ha.hb;
  auto& a = ha.a;
  REQUIRE(hb->begin_capture(stream_tag(1)) != 0);
  // A direct backend call in global mode, as an allocator without capture support would make.
  auto h = hb->create(2 * MiB, {});
  CHECK_FALSE(h.ok());
  CHECK(end(hb, stream_tag(1)) == "invalidated by cuMemCreate");
}

TEST_CASE("capture: another thread's global capture survives this thread's growth, trim and stats") {
  auto ha = make_host_alloc(opts(), tune());
  [[maybe_unused]] auto* hb = ha.hb;
  auto& a = ha.a;
  std::atomic<int> phase{0};
  std::thread capturer([&] {
    hb->begin_capture(stream_tag(9));
    phase = 1;
    while (phase.load() != 2) std::this_thread::yield();
  });
  while (phase.load() != 1) std::this_thread::yield();
  void* p = a.allocate(200 * MiB, 0, stream_tag(1));
  void* q = a.allocate(5 * MiB, 0, stream_tag(2));
  a.deallocate(p, stream_tag(1));
  a.deallocate(q, stream_tag(1));  // cross-stream free: a fence on S1 (not capturing)
  a.trim(0);
  (void)a.stats();
  CHECK(a.check() == "");
  phase = 2;
  capturer.join();
  CHECK(end(hb, stream_tag(9)) == "");
}

TEST_CASE("capture: no fence is recorded on a capturing stream; what waits on it waits for the end") {
  auto ha = make_host_alloc(opts(), tune());
  [[maybe_unused]] auto* hb = ha.hb;
  auto& a = ha.a;
  // A large block freed on S1 during S1's capture: S2 may not reuse it (a fence on S1 would be a
  // graph node, not a point S1 reaches), and asking must not touch S1.
  void* warm = a.allocate(3 * MiB, 0, stream_tag(1));
  a.deallocate(warm, stream_tag(1));
  REQUIRE(hb->begin_capture(stream_tag(1)) != 0);
  void* p = a.allocate(3 * MiB, 0, stream_tag(1));
  a.deallocate(p, stream_tag(1));
  void* q = a.allocate(3 * MiB, 0, stream_tag(2));
  CHECK(q != p);
  // A small block of S2's slab freed on capturing S1: deferred until S1's capture is over.
  void* small = a.allocate(1000, 0, stream_tag(2));
  a.deallocate(small, stream_tag(1));
  CHECK(a.stats().deferred == 1);
  CHECK(end(hb, stream_tag(1)) == "");
  a.trim(0);  // polls deferred frees: S1 no longer captures, its fence is recorded and done
  CHECK(a.stats().deferred == 0);
  void* r = a.allocate(3 * MiB, 0, stream_tag(2));  // S1's free is covered now: S2 may reuse
  CHECK(r == p);
  a.deallocate(q, stream_tag(2));
  a.deallocate(r, stream_tag(2));
  CHECK(a.check() == "");
}

TEST_CASE("capture: memory freed on S while S runs behind is not retired during S's capture") {
  tuning t = tune();
  t.max_growth = 2 * MiB;
  auto ha = make_host_alloc(opts(), t);
  [[maybe_unused]] auto* hb = ha.hb;
  auto& a = ha.a;
  std::vector<void*> v;
  for (int i = 0; i < 4; ++i) v.push_back(a.allocate(2 * MiB, 0, stream_tag(1)));
  a.deallocate(v[0], stream_tag(1));
  a.deallocate(v[2], stream_tag(1));
  hb->hold_stream(stream_tag(1));
  REQUIRE(hb->begin_capture(stream_tag(1)) != 0);
  void* big = a.allocate(4 * MiB, 0, stream_tag(1));  // retiring would record a fence on S1
  CHECK(end(hb, stream_tag(1)) == "");
  CHECK(a.stats().chunks_retired == 0);
  hb->complete_stream(stream_tag(1));
  a.deallocate(big, stream_tag(1));
  a.deallocate(v[1], stream_tag(1));
  a.deallocate(v[3], stream_tag(1));
  a.trim(0);
  CHECK(a.stats().physical == 0);
}

TEST_CASE("graph pools: a capture's memory is its own until released; frees inside are reused inside only") {
  auto ha = make_host_alloc(opts(), tune());
  [[maybe_unused]] auto* hb = ha.hb;
  auto& a = ha.a;
  const stream_t cs = stream_tag(1);
  auto only = [cs](stream_t s) { return s == cs; };
  REQUIRE(hb->begin_capture(cs) != 0);
  a.begin_pool(7, only);
  void* t = a.allocate(100, 0, cs);          // a temporary of the graph (thread caches bypassed)
  void* big = a.allocate(3 * MiB, 0, cs);
  auto in = a.stats();
  CHECK(in.pools == 1);
  CHECK(in.pool_allocated >= 3 * MiB + 256);
  a.deallocate(t, cs);                      // freed during the capture
  void* t2 = a.allocate(100, 0, cs);        // reused by the same capture
  CHECK(t2 == t);
  void* other = a.allocate(100, 0, stream_tag(2));   // another stream: never the pool's memory
  CHECK(a.stats().pool_allocated == in.pool_allocated);
  a.end_pool(7);
  CHECK(end(hb, cs) == "");
  a.deallocate(t2, cs);                     // after the capture: back to the pool, not to others
  void* after = a.allocate(100, 0, cs);
  CHECK(after != t2);
  CHECK(a.stats().pool_held > 0);
  a.trim(0);                                // trim leaves a pool alone
  CHECK(a.stats().pool_held > 0);
  CHECK(a.check() == "");
  a.release_pool(7);                        // live blocks remain: it goes as they are freed
  CHECK(a.stats().pools == 1);
  a.deallocate(big, cs);
  CHECK(a.stats().pools == 0);
  CHECK(a.stats().pool_held == 0);
  a.deallocate(after, cs);
  a.deallocate(other, stream_tag(2));
  a.trim(0);
  CHECK(a.stats().physical == 0);
  CHECK(a.check() == "");
}

TEST_CASE("graph pools: two captures share a pool; two pools at once") {
  auto ha = make_host_alloc(opts(), tune());
  [[maybe_unused]] auto* hb = ha.hb;
  auto& a = ha.a;
  a.begin_pool(1, [](stream_t s) { return s == stream_tag(1); });
  void* x = a.allocate(1 * MiB, 0, stream_tag(1));
  a.deallocate(x, stream_tag(1));
  a.end_pool(1);
  a.begin_pool(1, [](stream_t s) { return s == stream_tag(1); });  // a second capture into the same pool
  a.begin_pool(2, [](stream_t s) { return s == stream_tag(2); });
  void* y = a.allocate(1 * MiB, 0, stream_tag(1));
  CHECK(y == x);  // the shared pool's memory
  void* z = a.allocate(1 * MiB, 0, stream_tag(2));
  CHECK(z != x);
  CHECK(a.stats().pools == 2);
  a.end_pool(2);
  a.end_pool(1);
  a.deallocate(y, stream_tag(1));
  a.deallocate(z, stream_tag(2));
  a.release_pool(1);
  a.release_pool(2);
  CHECK(a.stats().pools == 0);
  CHECK(a.check() == "");
}

TEST_CASE("graph pools: bad input is a clear error and loses nothing") {
  auto ha = make_host_alloc(opts(), tune());
  [[maybe_unused]] auto* hb = ha.hb;
  auto& a = ha.a;
  CHECK_THROWS_WITH_AS(a.end_pool(3), doctest::Contains("never begun"), vmm::error);
  CHECK_THROWS_WITH_AS(a.release_pool(3), doctest::Contains("no such pool"), vmm::error);
  a.begin_pool(3);
  void* p = a.allocate(4096, 0, stream_tag(1));
  CHECK_THROWS_WITH_AS(a.release_pool(3), doctest::Contains("still allocates"), vmm::error);
  a.end_pool(3);
  CHECK_THROWS_WITH_AS(a.end_pool(3), doctest::Contains("never begun"), vmm::error);
  a.release_pool(3);
  CHECK_THROWS_WITH_AS(a.begin_pool(3), doctest::Contains("released"), vmm::error);
  CHECK(a.usable_size(p) >= 4096);  // still a live block of the released pool
  a.deallocate(p, stream_tag(1));
  CHECK(a.stats().pools == 0);
  CHECK(a.check() == "");
}

TEST_CASE("graph pools through the C API") {
  vmm_policy pol;
  vmm_policy_init(&pol);
  pol.backend = VMM_BACKEND_HOST;
  pol.reservation_size = GiB;
  vmm_allocator* a = nullptr;
  REQUIRE(vmm_create(&pol, &a) == VMM_SUCCESS);
  auto filter = [](void* s, void* user) { return s == user ? 1 : 0; };
  REQUIRE(vmm_begin_pool(a, 5, filter, stream_tag(1)) == VMM_SUCCESS);
  void* p = vmm_malloc_async(a, 1 << 20, stream_tag(1));
  REQUIRE(p != nullptr);
  vmm_stats st{};
  REQUIRE(vmm_get_stats(a, &st) == VMM_SUCCESS);
  CHECK(st.pools == 1);
  CHECK(st.pool_allocated >= (1 << 20));
  CHECK(vmm_release_pool(a, 5) == VMM_ERROR_INVALID_VALUE);
  CHECK(std::strstr(vmm_last_error(), "still allocates") != nullptr);
  CHECK(vmm_end_pool(a, 5) == VMM_SUCCESS);
  CHECK(vmm_end_pool(a, 5) == VMM_ERROR_INVALID_VALUE);
  CHECK(vmm_free_async(a, p, stream_tag(1)) == VMM_SUCCESS);
  CHECK(vmm_release_pool(a, 5) == VMM_SUCCESS);
  REQUIRE(vmm_get_stats(a, &st) == VMM_SUCCESS);
  CHECK(st.pools == 0);
  CHECK(vmm_check(a) == VMM_SUCCESS);
  vmm_destroy(a);
}

TEST_CASE("graph pools: pool_stats, pool_of and owns say where a block lives") {
  auto ha = make_host_alloc(opts(), tune());
  [[maybe_unused]] auto* hb = ha.hb;
  auto& a = ha.a;
  allocator::pool_info pi;
  allocator::pool_id id = 0;
  CHECK_FALSE(a.pool_stats(4, pi));                  // never begun
  void* outside = a.allocate(3 * MiB, 0, stream_tag(2));
  a.begin_pool(4, [](stream_t s) { return s == stream_tag(1); });
  void* small = a.allocate(100, 0, stream_tag(1));
  void* big = a.allocate(5 * MiB, 0, stream_tag(1));
  REQUIRE(a.pool_stats(4, pi));
  CHECK(pi.live == 2);
  CHECK(pi.allocated >= 5 * MiB + 100);
  CHECK(pi.held >= 5 * MiB);
  CHECK(pi.begun == 1);
  CHECK_FALSE(pi.released);
  CHECK(a.pool_of(big, id));
  CHECK(id == 4);
  CHECK(a.pool_of(small, id));
  CHECK_FALSE(a.pool_of(static_cast<char*>(big) + 256, id));  // interior
  CHECK_FALSE(a.pool_of(outside, id));                         // the own heap's block
  CHECK(a.owns(outside));
  CHECK(a.owns(big));
  int local = 0;
  CHECK_FALSE(a.owns(&local));
  CHECK_FALSE(a.pool_of(&local, id));
  a.end_pool(4);
  a.deallocate(small, stream_tag(1));
  CHECK_FALSE(a.pool_of(small, id));                           // freed
  a.release_pool(4);
  REQUIRE(a.pool_stats(4, pi));                                // one live block keeps it
  CHECK(pi.released);
  CHECK(pi.live == 1);
  a.deallocate(big, stream_tag(1));
  CHECK_FALSE(a.pool_stats(4, pi));                            // dropped with its last block
  a.deallocate(outside, stream_tag(2));
  CHECK(a.check() == "");
}

// The GPU capture test's sequence, scaled down: for every size path, a warm allocator (its memory
// mapped and free, partly in this thread's cache) captures a graph that allocates, frees and
// allocates again inside the capture, with a pool whose filter accepts only this capture.
TEST_CASE("graph pools: warm allocator, every size path, the pool filtered by capture id") {
  for (bool held : {false, true})
  for (std::size_t n : {std::size_t{256}, 64 * KiB, 1 * MiB, 32 * MiB, 128 * MiB}) {
    CAPTURE(n);
    CAPTURE(held);
    auto ha = make_host_alloc(opts(), tune());
    [[maybe_unused]] auto* hb = ha.hb;
    auto& a = ha.a;
    const stream_t cs = stream_tag(1);
    if (held)  // the GPU runs behind: every fence stays pending
      for (int i : {1, 5, 6}) hb->hold_stream(stream_tag(i));
    std::vector<void*> w;
    for (int i = 0; i < 4; ++i) w.push_back(a.allocate(n, 0, cs));
    for (void* p : w) a.deallocate(p, cs);
    std::uint64_t id = 0;
    host_backend* b = hb;
    a.begin_pool(7, [b, cs, &id](stream_t s) {
      auto c = b->capture_of(s);
      return c.ok() && c.value.state == capture_state::active && c.value.id == id && s == cs;
    });
    id = hb->begin_capture(cs);
    REQUIRE(id != 0);
    void* t1 = a.allocate(n, 0, cs);
    void* t2 = a.allocate(n, 0, cs);
    bulk_set(t1, 1, n);
    bulk_set(t2, 2, n);
    a.deallocate(t1, cs);
    void* t3 = a.allocate(n, 0, cs);
    bulk_set(t3, 3, n);
    void* out = a.allocate(n, 0, cs);
    bulk_set(out, 4, n);
    void* other = a.allocate(n, 0, stream_tag(5));
    allocator::pool_id in = 0;
    CHECK_FALSE(a.pool_of(other, in));
    CHECK(a.pool_of(t2, in));
    CHECK(end(hb, cs) == "");
    a.end_pool(7);
    a.deallocate(t2, cs);
    a.deallocate(t3, cs);
    a.deallocate(other, stream_tag(5));
    for (int r = 0; r < 3; ++r) {
      void* x = a.allocate(n, 0, cs);
      void* y = a.allocate(n, 0, stream_tag(6));
      for (void* p : {t1, t2, t3, out}) {
        auto lo = reinterpret_cast<std::uintptr_t>(p);
        for (void* q : {x, y}) {
          auto u = reinterpret_cast<std::uintptr_t>(q);
          CHECK_FALSE((u < lo + n && lo < u + n));
        }
      }
      bulk_set(x, 5, n);
      bulk_set(y, 6, n);
      CHECK(static_cast<unsigned char*>(out)[n - 1] == 4);
      a.deallocate(x, cs);
      a.deallocate(y, stream_tag(6));
    }
    if (held)  // the GPU test synchronizes before releasing the pool
      for (int i : {1, 5, 6}) hb->complete_stream(stream_tag(i));
    a.release_pool(7);
    CHECK(a.stats().pools == 1);
    a.deallocate(out, cs);
    CHECK(a.stats().pools == 0);
    CHECK(a.stats().pool_held == 0);
    CHECK(a.check() == "");
  }
}
