// SPDX-License-Identifier: Apache-2.0
// Reliability under concurrency and pressure, on the host backend (CI runs these in the plain,
// ASan and TSan trees):
//   * options.memory_limit is a hard cap: peak_physical <= memory_limit with many threads,
//     growths of one handle or of several (the allocator's max_handle and limit_chunk)
//   * free memory is reclaimed before out-of-memory: after every free, limit - granularity fits
//     without a trim()
//   * a racing double free (with trim() beside it) is refused, never a use-after-free
//   * class_stats() / stats() / check() while other threads allocate and free
//   * set_memory_limit() at run time: lowered, raised and changed while other threads allocate
//   * the driver never sees two calls at once on one handle or VA range: six threads under a
//     memory limit with trim() beside them, on a host backend whose calls take as long as the
//     driver's (it aborts, naming both calls, on a violation)
//   * the same on six streams with the GPU running behind (held streams, late kernels): no
//     stream's queued kernel writes a block the allocator handed to another stream
#include <doctest/doctest.h>

#include <array>
#include <atomic>
#include <barrier>
#include <limits>
#include <mutex>
#include <chrono>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "frontend/allocator_access.hpp"
#include "support/marks.hpp"
#include "vmmalloc/host_backend.hpp"
#include "vmmalloc/vmmalloc.hpp"

using namespace vmm;

namespace {
constexpr std::size_t KiB = 1024, MiB = KiB * 1024, GiB = MiB * 1024;

// Sanitized trees run several times slower: fewer rounds there, same assertions.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr int kScale = 1;
#else
constexpr int kScale = 4;
#endif

options limited(std::size_t limit) {
  options o;
  o.reservation_size = 4 * GiB;
  o.memory_limit = limit;
  return o;
}

// Sizes 64 B .. 64 MiB, log-uniform: every path (thread cache, slab, large, huge with a lowered
// threshold) is taken.
std::size_t random_size(std::mt19937_64& r) {
  std::uniform_int_distribution<int> lg(6, 26);
  const std::size_t hi = std::size_t{1} << lg(r);
  return std::uniform_int_distribution<std::size_t>(hi / 2, hi)(r);
}

struct run_result {
  std::atomic<std::uint64_t> ok{0}, oom{0}, other{0};
  std::string other_message;
  std::mutex mu;
};

// Each thread allocates and frees random sizes, keeping up to `keep` blocks live.
void churn(allocator& a, int seed, int ops, std::size_t keep, run_result& res) {
  std::mt19937_64 r(static_cast<std::uint64_t>(seed));
  std::vector<void*> live;
  for (int i = 0; i < ops; ++i) {
    if (live.size() >= keep || (!live.empty() && r() % 3 == 0)) {
      std::size_t k = r() % live.size();
      a.deallocate(live[k]);
      live[k] = live.back();
      live.pop_back();
      continue;
    }
    void* p = a.try_allocate(random_size(r));
    if (p) {
      live.push_back(p);
      ++res.ok;
    } else if (last_error().st.kind == errc::out_of_memory) {
      ++res.oom;
    } else {
      ++res.other;
      std::lock_guard g(res.mu);
      res.other_message = last_error().message;
    }
  }
  for (void* p : live) a.deallocate(p);
}

// Three threads that allocate sizes lo .. lo + spread and free them (up to `keep` live) until
// stop(), while the test reads the allocator's state from its own thread.
struct background_churn {
  std::atomic<bool> done{false};
  std::vector<std::thread> ts;
  background_churn(allocator& a, std::uint64_t seed, std::size_t keep, std::size_t lo, std::size_t spread) {
    for (int t = 0; t < 3; ++t)
      ts.emplace_back([&a, this, seed, keep, lo, spread, t] {
        std::mt19937_64 r(seed + static_cast<std::uint64_t>(t));
        std::vector<void*> live;
        while (!done.load()) {
          if (live.size() > keep || (!live.empty() && r() % 2)) {
            a.deallocate(live.back());
            live.pop_back();
          } else {
            live.push_back(a.allocate(lo + r() % spread));
          }
        }
        for (void* p : live) a.deallocate(p);
      });
  }
  void stop() {
    done = true;
    for (auto& t : ts) t.join();
    ts.clear();
  }
  ~background_churn() { stop(); }
};
}  // namespace

TEST_CASE("memory_limit is a hard cap: six threads of mixed sizes never exceed it") {
  const std::size_t limit = 64 * MiB;
  const options o = limited(limit);
  tuning t;
  t.huge_threshold = 16 * MiB;
  // One handle a growth (limit_chunk 0), and growths of several handles (4 MiB huge, 8 MiB span
  // handles: several creates in one growth, freed huge blocks joining the spans).
  for (int round = 0; round < 4 * kScale; ++round) {
    t.max_handle = round % 2 ? 4 * MiB : 0;
    t.limit_chunk = round % 2 ? tuning{}.limit_chunk : 0;
    CAPTURE(t.max_handle);
    auto a = allocator_access::make(make_backend<host_backend>(), o, t);
    run_result res;
    std::vector<std::thread> ts;
    for (int t = 0; t < 6; ++t) ts.emplace_back([&, t] { churn(a, round * 100 + t, 400, 6, res); });
    for (auto& t : ts) t.join();
    CAPTURE(round);
    INFO("other failure: " << res.other_message);
    CHECK(res.other == 0);   // every failure is out_of_memory
    CHECK(res.ok > 0);
    const auto s = a.stats();
    CHECK(s.peak_physical <= limit);
    CHECK(s.live == 0);
    CHECK(a.check() == "");
  }
}

// The program that aborted on an H200 (a double free inside cuMemUnmap, in 3 of 12 runs): growths
// unmap retired ranges outside the allocator's lock while trim() and other growths release or map
// the same handles. Each host backend call stays in flight 30 us, as the driver's do, so an
// interleaving that puts two calls on one handle or range at once is seen within a run.
TEST_CASE("six threads, a memory limit and trim(): never two driver calls at once on one handle or range") {
  const std::size_t limit = 64 * MiB;
  options o = limited(limit);
  o.reservation_size = 1 * GiB;
  host_backend_options h;
  h.call_us = 30;
  h.reuse_handles = true;  // as the driver: a stale handle value names a newer handle
  for (bool caches : {true, false}) {
    CAPTURE(caches);
    const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(400 * kScale);
    o.thread_cache = caches;
    auto a = allocator::host(o, h);
    std::atomic<std::uint64_t> ok{0}, other{0};
    std::vector<std::thread> ts;
    for (int t = 0; t < 6; ++t)
      ts.emplace_back([&, t] {
        std::mt19937_64 r(static_cast<std::uint64_t>(t) + (caches ? 0 : 100));
        std::vector<void*> mine;
        for (std::uint64_t n = 1; std::chrono::steady_clock::now() < until; ++n) {
          if (n % 1000 == 0) a.trim(0);
          if (mine.size() < 32 && r() % 3 != 0) {
            const int k = std::uniform_int_distribution<int>(6, 25)(r);
            const std::size_t size = (std::size_t{1} << k) + r() % (std::size_t{1} << k);
            if (void* p = a.try_allocate(size)) mine.push_back(p), ++ok;
            else if (last_error().st.kind != errc::out_of_memory) ++other;
          } else if (!mine.empty()) {
            const std::size_t i = r() % mine.size();
            a.deallocate(mine[i]);
            mine[i] = mine.back();
            mine.pop_back();
          }
        }
        for (void* p : mine) a.deallocate(p);
      });
    for (auto& t : ts) t.join();
    CHECK(other == 0);
    CHECK(ok > 0);
    CHECK(a.stats().peak_physical <= limit);
    CHECK(a.check() == "");
    a.trim(0);
    CHECK(a.stats().physical == 0);
    void* half = a.try_allocate(limit / 2);
    CHECK(half != nullptr);
    a.deallocate(half);
  }
}

// The GPU race program on the host: six threads, each with its own stream, a memory limit and
// trim(), and a GPU that runs behind them: a seventh thread holds and completes the streams at
// random, so kernels (host_backend::launch) that write and check each block land late, and
// waits block until the stream completes. A block handed to one stream while another's queued
// kernel still writes it shows as wrong bytes here (and as a data race under TSan).
TEST_CASE("six threads on six streams, a memory limit, trim() and a GPU running behind: no stream's kernel lands in another's block") {
  const std::size_t limit = 64 * MiB;
  options o = limited(limit);
  o.reservation_size = 1 * GiB;
  host_backend_options h;
  h.call_us = 30;
  h.reuse_handles = true;
  h.waits_block = true;
  auto b = make_backend<host_backend>(h);
  host_backend* hb = backend_cast<host_backend>(*b);
  auto a = allocator_access::make(std::move(b), o, tuning{});
  // A count of operations, not a time: the TSan tree runs a hundred times slower.
  const std::uint64_t ops = 500 * kScale;
  std::array<stream_t, 6> streams;
  for (int t = 0; t < 6; ++t) streams[t] = reinterpret_cast<stream_t>(std::uintptr_t{0x100} + t);
  std::atomic<std::uint64_t> ok{0}, other{0}, bad{0}, checked{0};
  std::atomic<bool> done{false};
  std::thread gpu([&] {
    std::mt19937_64 r(99);
    std::array<bool, 6> held{};
    while (!done.load()) {
      const std::size_t i = r() % 6;
      if (held[i]) hb->complete_stream(streams[i]);
      else hb->hold_stream(streams[i]);
      held[i] = !held[i];
      std::this_thread::sleep_for(std::chrono::microseconds(r() % 300));
    }
    for (std::size_t i = 0; i < 6; ++i)
      if (held[i]) hb->complete_stream(streams[i]);
  });
  std::vector<std::thread> ts;
  for (int t = 0; t < 6; ++t)
    ts.emplace_back([&, t] {
      std::mt19937_64 r(static_cast<std::uint64_t>(t) + 7);
      const stream_t s = streams[t];
      struct blk { unsigned char* p; std::size_t n; unsigned char v; };
      std::vector<blk> mine;
      unsigned char next = 1;
      for (std::uint64_t n = 1; n <= ops; ++n) {
        if (n % 200 == 0) a.trim(0);
        if (mine.size() < 32 && r() % 3 != 0) {
          const int k = std::uniform_int_distribution<int>(6, 23)(r);
          const std::size_t size = (std::size_t{1} << k) + r() % (std::size_t{1} << k);
          auto* p = static_cast<unsigned char*>(a.try_allocate(size, 0, s));
          if (!p) {
            if (last_error().st.kind != errc::out_of_memory) ++other;
            continue;
          }
          ++ok;
          const unsigned char v = next++ | 1;
          hb->launch(s, [=] { test::put_mark(p, size, v); });
          mine.push_back({p, size, v});
        } else if (!mine.empty()) {
          const std::size_t i = r() % mine.size();
          const blk x = mine[i];
          if (r() % 4 == 0)
            hb->launch(s, [x, &bad, &checked] {  // stream-ordered: after the block's own kernel
              bad += test::wrong_marks(x.p, x.n, x.v);
              ++checked;
            });
          a.deallocate(x.p, s);
          mine[i] = mine.back();
          mine.pop_back();
        }
      }
      for (const blk& x : mine) a.deallocate(x.p, s);
    });
  for (auto& t : ts) t.join();
  done = true;
  gpu.join();
  MESSAGE(ok.load() << " allocations, " << checked.load() << " blocks checked");
  CHECK(other.load() == 0);
  CHECK(checked.load() > 50);
  CHECK(bad.load() == 0);
  CHECK(a.stats().peak_physical <= limit);
  CHECK(a.check() == "");
}

TEST_CASE("pressure: after every free, limit - granularity fits without trim()") {
  const std::size_t limit = 64 * MiB;
  tuning t;
  t.huge_threshold = 16 * MiB;
  auto a = allocator_access::make(make_backend<host_backend>(), limited(limit), t);
  run_result res;
  std::vector<std::thread> ts;
  for (int t = 0; t < 6; ++t) ts.emplace_back([&, t] { churn(a, 1000 + t, 300 * kScale, 6, res); });
  for (auto& t : ts) t.join();
  REQUIRE(a.stats().live == 0);
  // Memory stays mapped (empty slabs, free spans, idle handles): the request must reclaim it.
  void* big = a.try_allocate(limit - a.granularity());
  INFO("last error: " << last_error().message);
  CHECK(big != nullptr);
  if (big) a.deallocate(big);
  CHECK(a.stats().peak_physical <= limit);
  CHECK(a.check() == "");
}

TEST_CASE("set_memory_limit: lowered below what is held, then raised; the message names the new limit") {
  auto a = allocator::host(limited(std::numeric_limits<std::size_t>::max()));
  CHECK(a.memory_limit() == std::numeric_limits<std::size_t>::max());
  void* p = a.allocate(40 * MiB);
  void* q = a.allocate(40 * MiB);
  a.deallocate(q);  // stays mapped (free chunk): held 80 MiB, live 40 MiB
  a.set_memory_limit(48 * MiB);  // held 80 MiB: the free chunk goes back at once
  CHECK(a.memory_limit() == 48 * MiB);
  CHECK(a.opts().memory_limit == std::numeric_limits<std::size_t>::max());  // as constructed
  CHECK(a.stats().physical <= 48 * MiB);
  CHECK(a.stats().physical >= 40 * MiB);  // the live block stays
  CHECK(a.try_allocate(32 * MiB) == nullptr);  // 40 + 32 > 48
  CHECK(last_error().st.kind == errc::out_of_memory);
  CHECK(last_error().message.find("limit 48 MiB") != std::string::npos);
  void* r = a.try_allocate(4 * MiB);  // 40 + 4 fits
  CHECK(r != nullptr);
  if (r) a.deallocate(r);
  CHECK(a.stats().peak_physical <= 80 * MiB);
  a.set_memory_limit(128 * MiB);
  void* s = a.try_allocate(60 * MiB);
  CHECK(s != nullptr);
  CHECK(a.stats().physical <= 128 * MiB);
  a.deallocate(s);
  a.deallocate(p);
  a.set_memory_limit(0);  // a limit of 0 bytes: every new byte refused, frees still work
  a.trim();
  CHECK(a.try_allocate(1 * MiB) == nullptr);
  CHECK(a.stats().physical == 0);
  a.set_memory_limit(std::numeric_limits<std::size_t>::max());
  void* t = a.try_allocate(1 * MiB);
  CHECK(t != nullptr);
  if (t) a.deallocate(t);
  CHECK(a.check() == "");
}

TEST_CASE("set_memory_limit from another thread while six threads allocate: each phase's cap holds") {
  const std::size_t high = 96 * MiB, low = 32 * MiB;
  tuning t;
  t.huge_threshold = 16 * MiB;
  auto a = allocator_access::make(make_backend<host_backend>(), limited(high), t);
  std::atomic<bool> done{false};
  // Flips between the two limits: growths read it under their lock, the set takes none.
  std::thread flipper([&] {
    for (int i = 0; !done.load(); ++i) {
      a.set_memory_limit(i % 2 ? low : high);
      std::this_thread::yield();
    }
  });
  run_result res;
  std::vector<std::thread> ts;
  for (int t = 0; t < 6; ++t) ts.emplace_back([&, t] { churn(a, 2000 + t, 150 * kScale, 6, res); });
  for (auto& t : ts) t.join();
  done = true;
  flipper.join();
  INFO("other failure: " << res.other_message);
  CHECK(res.other == 0);
  CHECK(res.ok > 0);
  CHECK(a.stats().peak_physical <= high);
  // Settled at the lower limit: a second round never holds more than it.
  a.set_memory_limit(low);
  a.trim();
  a.reset_peaks();
  ts.clear();
  for (int t = 0; t < 6; ++t) ts.emplace_back([&, t] { churn(a, 3000 + t, 100 * kScale, 6, res); });
  for (auto& t : ts) t.join();
  CHECK(res.other == 0);
  CHECK(a.stats().peak_physical <= low);
  CHECK(a.stats().live == 0);
  CHECK(a.check() == "");
}

TEST_CASE("pressure: a real out-of-memory names what is live, what is held and the limit") {
  const std::size_t limit = 32 * MiB;
  auto a = allocator::host(limited(limit));
  void* p = a.allocate(20 * MiB);
  CHECK(a.try_allocate(20 * MiB) == nullptr);
  const auto& e = last_error();
  CHECK(e.st.kind == errc::out_of_memory);
  CHECK(e.message.find("live") != std::string::npos);
  CHECK(e.message.find("held") != std::string::npos);
  CHECK(e.message.find("limit") != std::string::npos);
  try {
    (void)a.allocate(20 * MiB);
    FAIL("allocate past the limit did not throw");
  } catch (const out_of_memory& x) {
    CHECK(std::string(x.what()).find("limit") != std::string::npos);
  }
  a.deallocate(p);
  CHECK(a.check() == "");
}

TEST_CASE("a racing double free beside trim() is refused, never a use-after-free") {
  // Several threads free the same pointer while another trims. Half of the freers have a slot of
  // another stream in their thread-cache bin for the class, so their free takes the locked path
  // and gives the slot straight back to its slab; the slab is then empty and trim() destroys it,
  // while the other freers may be on the lock-free path, reading its metadata and claiming the
  // slot with a compare-exchange.
  options o;
  o.reservation_size = GiB;
  tuning t;
  t.thread_cache_slots = 2;  // the allocating thread caches one slot at a time: p is alone in its slab
  const std::size_t size = 48 * KiB;
  auto a = allocator_access::make(make_backend<host_backend>(), o, t);
  const int rounds = 4000 * kScale, freers = 4;
  const stream_t other = reinterpret_cast<stream_t>(std::uintptr_t{7});
  std::atomic<void*> target{nullptr};
  std::atomic<int> wins{0}, refusals{0}, bad{0};
  std::barrier start(freers + 2), done(freers + 2);
  std::vector<std::thread> ts;
  for (int f = 0; f < freers; ++f)
    ts.emplace_back([&, f] {
      if (f % 2) a.deallocate(a.allocate(size, 0, other), other);  // bin holds `other`'s slot
      for (int i = 0; i < rounds; ++i) {
        start.arrive_and_wait();
        status s = a.try_deallocate(target.load());
        if (s.ok()) ++wins;
        else if (s.kind == errc::invalid_pointer) ++refusals;
        else ++bad;
        done.arrive_and_wait();
      }
    });
  ts.emplace_back([&] {
    for (int i = 0; i < rounds; ++i) {
      start.arrive_and_wait();
      a.trim(0);
      done.arrive_and_wait();
    }
  });
  for (int i = 0; i < rounds; ++i) {
    target = a.allocate(size);
    start.arrive_and_wait();
    done.arrive_and_wait();
  }
  for (auto& t : ts) t.join();
  CHECK(bad == 0);
  CHECK(wins == rounds);                   // exactly one free of each pointer succeeds
  CHECK(refusals == rounds * (freers - 1));  // and every other one is refused
  CHECK(a.check() == "");
  CHECK(a.stats().live == 0);
}

TEST_CASE("stale frees beside trim() and slab turnover read only valid metadata") {
  // One thread makes slabs appear and disappear (allocate a batch, free it, trim); another frees
  // pointers from earlier batches again, over and over, on the lock-free path. Such a free must be
  // refused (or, when the address was handed out again, free that block, as free(3) would); it must
  // never read or write a slab that trim() destroyed.
  options o;
  o.reservation_size = GiB;
  tuning t;
  t.thread_cache_slots = 2;
  auto a = allocator_access::make(make_backend<host_backend>(), o, t);
  constexpr int kBatch = 64;
  std::atomic<bool> stop{false};
  std::array<std::atomic<std::uintptr_t>, kBatch> stale{};
  std::atomic<std::uint64_t> attempts{0};
  std::thread hammer([&] {
    while (!stop.load(std::memory_order_relaxed))
      for (auto& x : stale)
        if (std::uintptr_t p = x.exchange(0)) {
          status s = a.try_deallocate(reinterpret_cast<void*>(p));
          CHECK((s.ok() || s.kind == errc::invalid_pointer));
          ++attempts;
        }
  });
  const int rounds = 300 * kScale;
  for (int r = 0; r < rounds; ++r) {
    std::vector<void*> batch;
    for (int k = 0; k < kBatch; ++k) batch.push_back(a.allocate(32 * KiB + static_cast<std::size_t>(r % 3) * 8 * KiB));
    for (int k = 0; k < kBatch; ++k) {
      (void)a.try_deallocate(batch[k]);  // may already be freed by the hammer (address reuse)
      stale[k].store(reinterpret_cast<std::uintptr_t>(batch[k]));
    }
    a.trim(0);
  }
  stop = true;
  hammer.join();
  CHECK(attempts > 0);
  CHECK(a.check() == "");
  CHECK(a.stats().live == 0);
}

TEST_CASE("a stale free racing the allocation that hands its slot out again frees the bytes that allocation asked for") {
  // One thread allocates one size over and over, each time from the slot it freed just before
  // (its thread cache's top); another frees that address again and again, as a program with a
  // double free would. When the second thread's free wins the slot, it must take back the bytes
  // the new allocation asked for, never those of none (the slot's requested bytes written after
  // the slot became the user's): the requested sum would drift by one block for good.
  options o;
  o.reservation_size = GiB;
  auto a = allocator_access::make(make_backend<host_backend>(), o, tuning{});
  std::atomic<std::uintptr_t> addr{0};
  std::atomic<bool> stop{false};
  std::atomic<std::uint64_t> stolen{0};
  std::atomic<bool> started{false};
  std::thread stale([&] {
    started = true;
    while (!stop.load(std::memory_order_relaxed))
      if (std::uintptr_t p = addr.load(std::memory_order_relaxed))
        if (a.try_deallocate(reinterpret_cast<void*>(p)).ok()) ++stolen;
  });
  while (!started) std::this_thread::yield();
  // At least `rounds`, and on until the other thread has won 2,000 races (a loaded machine may
  // run the two threads in turn rather than at once), for at most 20 s.
  const int rounds = 200000 * kScale;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  int r = 0;
  for (; r < rounds || (stolen < 2000 && std::chrono::steady_clock::now() < until); ++r) {
    void* p = a.try_allocate(32 * KiB + (r % 2) * 8 * KiB, 0, nullptr);
    REQUIRE(p);
    addr.store(reinterpret_cast<std::uintptr_t>(p), std::memory_order_relaxed);
    (void)a.try_deallocate(p);  // refused when the other thread freed it first
  }
  stop = true;
  stale.join();
  MESSAGE(stolen.load(), " of ", r, " blocks freed by the other thread");
  CHECK(stolen > 0);
  CHECK(a.check() == "");
  CHECK(a.stats().live == 0);
  CHECK(a.stats().requested == 0);
}

TEST_CASE("a thread frees the slot it handed out last after its slab was set up again 256 times") {
  // A thread keeps the reference of the slot it handed out last, to free it without the page-map
  // lookup. Here that slot is freed elsewhere, its slab is destroyed and set up again 256 times
  // (the 8-bit tag in each state word wraps), the last time for a smaller class, and the address
  // is handed out again as another slot of that class. The first thread's free must free that
  // slot, not the one its old reference names (a live block of the other thread).
  options o;
  o.reservation_size = GiB;
  tuning t;
  t.thread_cache_slots = 2;  // one slot per refill: slots come in index order
  auto a = allocator_access::make(make_backend<host_backend>(), o, t);
  const std::size_t big = 512, small = 256;
  void* p0 = a.allocate(big);  // slot 0 of a fresh slab
  void* p = a.allocate(big);   // slot 1, at 512 B: the one this thread handed out last
  REQUIRE(static_cast<char*>(p) == static_cast<char*>(p0) + big);
  std::vector<void*> held;
  bool setups_ok = true;
  std::thread([&] {
    a.deallocate(p0);
    a.deallocate(p);
    a.trim(0);  // the slab is empty: destroyed
    for (int k = 0; k < 255; ++k) {  // set up and destroyed again, 255 times
      void* x = a.allocate(k % 2 ? big : small);
      setups_ok = setups_ok && x == p0;
      a.deallocate(x);
      a.trim(0);
    }
    for (int k = 0; k < 3; ++k) held.push_back(a.allocate(small));  // the 256th: 0, 256, 512 B
  }).join();
  REQUIRE(setups_ok);  // every set-up took the same page
  REQUIRE(held[2] == p);
  CHECK(a.try_deallocate(p).ok());  // frees the other thread's block at 512 B
  std::thread([&] {
    CHECK(a.try_deallocate(held[1]).ok());  // still that thread's own block
    CHECK(a.try_deallocate(held[0]).ok());
  }).join();
  CHECK(a.check() == "");
  a.trim(0);
  CHECK(a.stats().live == 0);
  CHECK(a.stats().allocated == 0);
}

TEST_CASE("class_stats(), stats() and check() while other threads allocate and free") {
  options o;
  o.reservation_size = GiB;
  auto a = allocator::host(o);
  background_churn bg(a, 0, 64, 64, 32 * KiB);
  std::size_t seen = 0;
  const auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(300 * kScale);
  while (std::chrono::steady_clock::now() < end) {
    for (const auto& c : a.class_stats()) {
      CHECK(c.used_slots <= c.slots);
      CHECK(c.cached_slots <= c.used_slots);
      seen += c.slabs;
    }
    const auto s = a.stats();
    CHECK(s.requested <= s.allocated);
    CHECK(a.check() == "");
  }
  bg.stop();
  CHECK(seen > 0);
  CHECK(a.stats().live == 0);
}

TEST_CASE("span_free() while other threads allocate and free large blocks (thread caches on)") {
  options o;
  o.reservation_size = GiB;
  auto a = allocator::host(o);
  background_churn bg(a, 7, 16, 64 * KiB, 4 * MiB);  // the large path: span blocks
  std::size_t seen = 0;
  const auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(300 * kScale);
  while (std::chrono::steady_clock::now() < end) {
    const auto f = a.span_free();
    CHECK(f.whole_pages <= f.bytes);
    CHECK(f.largest <= f.bytes);
    CHECK((f.blocks == 0) == (f.bytes == 0));
    seen += f.blocks;
    CHECK(a.check() == "");
  }
  bg.stop();
  CHECK(seen > 0);
  CHECK(a.stats().live == 0);
}
