// SPDX-License-Identifier: Apache-2.0
// The thread cache's large block: a thread keeps the large (or huge) block it freed last for its
// next request of that size, without the lock. Correctness around it: reuse, cross-thread frees,
// double frees, record_stream, trim, thread exit, stats, the heap taking a cached block back
// before it grows; and many threads at once (TSan tree).
#include <doctest/doctest.h>

#include <atomic>
#include <barrier>
#include <random>
#include <thread>
#include <vector>

#include "frontend/allocator_access.hpp"
#include "support/stream_tag.hpp"
#include "vmmalloc/host_backend.hpp"
#include "vmmalloc/vmmalloc.hpp"

using namespace vmm;
using vmm::test::stream_tag;

namespace {
constexpr std::size_t KiB = 1024, MiB = KiB * 1024, GiB = MiB * 1024;
// Huge from 32 MiB: both paths with small sizes.
allocator make() {
  options o;
  o.reservation_size = 4 * GiB;
  tuning t;
  t.huge_threshold = 32 * MiB;
  return allocator_access::make(make_backend<host_backend>(), o, t);
}
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr int kScale = 1;
#else
constexpr int kScale = 5;
#endif
}  // namespace

TEST_CASE("large cache: a pair takes the same block back, no heap call; stats see it as free") {
  auto a = make();
  for (std::size_t n : {256 * KiB, 1 * MiB, 16 * MiB, 100 * MiB}) {  // large and huge paths
    CAPTURE(n);
    void* p = a.allocate(n);
    const auto live = a.stats();
    a.deallocate(p);
    const auto freed = a.stats();
    CHECK(freed.live == live.live - 1);
    CHECK(freed.requested == live.requested - n);
    CHECK(a.usable_size(p) == 0);  // freed, although the cache holds its memory
    void* q = a.allocate(n);
    CHECK(q == p);
    CHECK(a.stats().allocs == live.allocs + 1);
    CHECK(a.stats().frees == live.frees + 1);
    CHECK(a.usable_size(q) >= n);
    a.deallocate(q);
    CHECK(a.check() == "");
  }
  a.trim(0);  // the calling thread's cached block goes back too
  CHECK(a.stats().mapped == 0);
}

TEST_CASE("large cache: a double free after the cached free is refused and changes nothing") {
  auto a = make();
  void* p = a.allocate(1 * MiB);
  a.deallocate(p);
  const auto before = a.stats();
  CHECK(a.try_deallocate(p).kind == errc::invalid_pointer);
  CHECK(a.stats().frees == before.frees);
  CHECK(a.check() == "");
  void* q = a.allocate(1 * MiB);  // the block is still the cache's, whole
  CHECK(q == p);
  a.deallocate(q);
}

TEST_CASE("large cache: another thread frees the block; the owner's stale reference never matches") {
  auto a = make();
  void* p = a.allocate(2 * MiB);  // this thread's cache remembers p
  std::thread([&] { a.deallocate(p); }).join();  // freed on another thread: the locked path
  CHECK(a.try_deallocate(p).kind == errc::invalid_pointer);  // a double free: refused
  // The address handed out again, to another thread through its own cache: a free of it by this
  // thread is a cross-thread free of that block, not a claim into this thread's cache.
  void* q = nullptr;
  std::thread([&] { q = a.allocate(2 * MiB); }).join();
  REQUIRE(q == p);
  CHECK(a.usable_size(q) >= 2 * MiB);
  a.deallocate(q);
  CHECK(a.usable_size(q) == 0);
  CHECK(a.stats().live == 0);
  CHECK(a.check() == "");
}

TEST_CASE("large cache: record_stream keeps the block out of the cache (its free waits for the stream)") {
  auto a = make();
  void* p = a.allocate(1 * MiB, 0, stream_tag(1));
  a.record_stream(p, stream_tag(2));
  a.deallocate(p, stream_tag(1));
  void* q = a.allocate(1 * MiB, 0, stream_tag(1));
  CHECK(a.check() == "");
  a.deallocate(q, stream_tag(1));
  CHECK(a.stats().live == 0);
}

TEST_CASE("large cache: a thread's cached block goes back when the thread ends") {
  auto a = make();
  std::thread([&] {
    void* p = a.allocate(8 * MiB);
    a.deallocate(p);
  }).join();
  a.trim(0);
  CHECK(a.stats().mapped == 0);
  CHECK(a.check() == "");
}

TEST_CASE("large cache: many threads, pairs and cross-thread frees of mid and large sizes") {
  auto a = make();
  const int threads = 6, rounds = 2000 * kScale;
  std::vector<std::atomic<void*>> mailbox(threads);
  for (auto& m : mailbox) m = nullptr;
  std::atomic<int> bad{0};
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; ++t)
    ts.emplace_back([&, t] {
      std::mt19937_64 r(static_cast<std::uint64_t>(t));
      for (int i = 0; i < rounds; ++i) {
        const std::size_t n = std::size_t{1} << (17 + r() % 8);  // 128 KiB .. 16 MiB
        void* p = a.allocate(n);
        if (a.usable_size(p) < n) ++bad;
        if (r() % 3 == 0) {
          // hand it to the next thread, take what the previous one left
          void* old = mailbox[(t + 1) % threads].exchange(p);
          if (old) a.deallocate(old);
        } else {
          // (No double free here: once another thread's growth has taken the cached block back
          // and handed it out, a second free would be a use after free. The single-thread tests
          // cover double frees of a cached block.)
          a.deallocate(p);
        }
      }
    });
  for (auto& t : ts) t.join();
  for (auto& m : mailbox)
    if (void* p = m.exchange(nullptr)) a.deallocate(p);
  CHECK(bad == 0);
  CHECK(a.stats().live == 0);
  CHECK(a.check() == "");
  a.trim(0);
  CHECK(a.stats().mapped == 0);
}

// A block one thread keeps for its next request is memory no other thread can use: before the
// heap grows for another thread's request, it takes the cached block back (the owner's reference
// then fails its compare-exchange and its next request takes the locked path).
TEST_CASE("large cache: another thread's request takes a cached block back before the heap grows") {
  for (std::size_t n : {16 * MiB, 64 * MiB}) {  // the large path and the huge path
    CAPTURE(n);
    auto a = make();
    std::barrier sync(2);
    void* mine = nullptr;
    std::thread owner([&] {
      mine = a.allocate(n);
      a.deallocate(mine);  // cached by this thread
      sync.arrive_and_wait();  // 1: the other thread allocates
      sync.arrive_and_wait();  // 2: its request is served
      void* again = a.allocate(n);  // the stale reference fails: the locked path
      CHECK(a.usable_size(again) >= n);
      a.deallocate(again);
    });
    sync.arrive_and_wait();  // 1
    const auto before = a.stats();
    CHECK(before.live == 0);
    CHECK(before.allocated == 0);  // the cached block counts as free
    void* p = a.allocate(n);
    const auto after = a.stats();
    CHECK(p == mine);  // the cached block, not new memory
    CHECK(after.mapped == before.mapped);
    CHECK(after.grows == before.grows);
    CHECK(after.live == 1);
    CHECK(after.allocated == a.usable_size(p));
    CHECK(a.check() == "");
    sync.arrive_and_wait();  // 2
    owner.join();
    CHECK(a.stats().live == 1);
    a.deallocate(p);
    CHECK(a.stats().live == 0);
    CHECK(a.stats().allocated == 0);
    CHECK(a.check() == "");
    a.trim(0);
    CHECK(a.stats().mapped == 0);
  }
}

// The owner's lock-free reuse and free against the heap taking its block back, many times: a
// grower thread gives free memory back (trim) and asks for more, so every few of its requests
// grow the heap and take back whatever the other threads hold cached at that moment.
TEST_CASE("large cache: pairs on many threads while growths take cached blocks back") {
  auto a = make();
  const int threads = 4, rounds = 300 * kScale;
  std::atomic<bool> stop{false};
  std::atomic<int> bad{0};
  std::thread grower([&] {
    std::mt19937_64 r(99);
    while (!stop.load()) {
      void* p = a.allocate((1 + r() % 24) * MiB);
      a.deallocate(p);
      a.trim(0);
    }
  });
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; ++t)
    ts.emplace_back([&, t] {
      std::mt19937_64 r(static_cast<std::uint64_t>(t));
      for (int i = 0; i < rounds; ++i) {
        const std::size_t n = (1 + r() % 3) * (std::size_t{1} << (18 + t % 4));  // 256 KiB .. 6 MiB
        auto* p = static_cast<unsigned char*>(a.allocate(n));
        if (a.usable_size(p) < n) ++bad;
        p[0] = static_cast<unsigned char>(t);  // host memory: a block handed out twice shows here
        p[n - 1] = static_cast<unsigned char>(i);
        if (p[0] != static_cast<unsigned char>(t)) ++bad;
        a.deallocate(p);
        std::this_thread::yield();  // cached meanwhile: the grower may take it
      }
    });
  for (auto& t : ts) t.join();
  stop = true;
  grower.join();
  CHECK(bad == 0);
  CHECK(a.stats().live == 0);
  CHECK(a.check() == "");
  a.trim(0);
  CHECK(a.stats().mapped == 0);
}
