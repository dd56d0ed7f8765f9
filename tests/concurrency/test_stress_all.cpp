// SPDX-License-Identifier: Apache-2.0
// Concurrency stress: every public call at once, from many threads, for a bounded time, on the
// host backend; with and without options.memory_limit.
//
//   workers (4)   allocate / free mixed sizes (small, mid, large, huge with a lowered threshold) on
//                 four stream tags, write a pattern into each block and check it at the free;
//                 free their own blocks on the same or another stream, record_stream first, or
//                 hand them to another worker (cross-thread frees)
//   ipc (1)       a second allocator with options.ipc = posix_fd: allocate, export_ipc, import
//                 some exports through another host backend and read them back, close, free
//   streams (1)   holds a stream tag (its fences stay pending: deferred frees, busy chunks) for a
//                 few ms at a time, then completes it
//   admin (1)     trim(), grant()/revoke() of the simulated peer device 1
//   diag (1)      stats(), class_stats(), memory_map(), check() while all of it runs
//
// Asserted: check() is clean while everything runs and after; peak_physical <= memory_limit on
// both allocators; every allocation failure is errc::out_of_memory (any other failure is
// collected with its message and fails the case); every block reads back what was written; and
// once every thread is joined and every block freed, memory_limit - granularity is served without
// a trim() (the out-of-memory path reclaims what the allocator holds).
//
// A trim() may fail with the host backend's wait_fence EPERM while the stream is held: the host
// cannot block on a fence only the test completes (a GPU's wait would block instead). Counted apart.
//
// VMM_STRESS_MS: run time of each case (default 2000 ms, 600 ms in sanitizer builds).
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <limits>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "support/pattern.hpp"
#include "frontend/allocator_access.hpp"
#include "support/stream_tag.hpp"
#include "vmmalloc/host_backend.hpp"
#include "vmmalloc/ipc.hpp"
#include "vmmalloc/vmmalloc.hpp"

using namespace vmm;
using namespace vmm::test;

namespace {

constexpr std::size_t KiB = 1024, MiB = KiB * 1024, GiB = MiB * 1024;

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr int kDefaultMs = 600;
#else
constexpr int kDefaultMs = 2000;
#endif

int run_ms() {
  const char* e = std::getenv("VMM_STRESS_MS");
  return e && std::atoi(e) > 0 ? std::atoi(e) : kDefaultMs;
}

constexpr int kStreams = 4;    // nullptr, 1, 2, 3
constexpr int kHeldStream = 3;  // the one the streams thread holds

// Pattern coverage: small blocks in full, larger ones at both ends, a middle window and every MiB
// (pattern.hpp). Cheap enough for huge blocks.
constexpr std::size_t kFull = 4 * KiB;

struct block {
  void* p = nullptr;
  std::size_t n = 0;
  std::uint64_t id = 0;
  int stream = 0;
};

// Failures: out-of-memory is counted; anything else is kept with its message.
struct tally {
  std::atomic<std::uint64_t> allocs{0}, frees{0}, oom{0}, cross_thread{0}, cross_stream{0}, recorded{0},
      exports{0}, imports{0}, trims{0}, trim_wait_refused{0}, grants{0}, checks{0}, verified{0};
  std::mutex mu;
  std::vector<std::string> other;
  void fail(const std::string& s) {
    std::lock_guard g(mu);
    if (other.size() < 50) other.push_back(s);
  }
};

// Sizes: small (64 B .. 64 KiB), mid (64 KiB .. 2 MiB), large (2 .. 8 MiB), huge (8 .. 24 MiB,
// the allocator's huge threshold set to 8 MiB).
std::size_t pick_size(std::mt19937_64& r) {
  const unsigned k = static_cast<unsigned>(r() % 100);
  auto in = [&](std::size_t lo, std::size_t hi) { return lo + r() % (hi - lo); };
  if (k < 55) return in(64, 64 * KiB);
  if (k < 80) return in(64 * KiB, 2 * MiB);
  if (k < 93) return in(2 * MiB, 8 * MiB);
  return in(8 * MiB, 24 * MiB);
}

options stress_options(std::size_t limit) {
  options o;
  o.reservation_size = 8 * GiB;
  o.memory_limit = limit;
  return o;
}
tuning stress_tuning() {
  tuning t;
  t.huge_threshold = 8 * MiB;
  return t;
}

struct shared_state {
  allocator* a = nullptr;
  allocator* ipc_a = nullptr;
  host_backend* hb = nullptr;
  std::size_t limit = 0, ipc_limit = 0;
  std::atomic<bool> stop{false};
  std::atomic<std::uint64_t> next_id{1};
  std::mutex xmu;
  std::deque<block> exchange;  // blocks handed from one worker to another, freed by the taker
  tally t;
};

bool verify(shared_state& s, const block& b, const char* who) {
  std::size_t bad;
  s.t.verified += verify_block(b.p, b.n, b.id, &bad, kFull);
  if (bad == SIZE_MAX) return true;
  s.t.fail(std::string(who) + ": block " + std::to_string(b.id) + " of " + std::to_string(b.n) +
           " bytes corrupted at offset " + std::to_string(bad));
  return false;
}

void free_block(shared_state& s, allocator& a, const block& b, int on_stream, const char* who) {
  verify(s, b, who);
  status st = a.try_deallocate(b.p, stream_tag(on_stream));
  if (!st.ok()) s.t.fail(std::string(who) + ": free failed: " + st.message());
  ++s.t.frees;
  if (on_stream != b.stream) ++s.t.cross_stream;
}

void worker(shared_state& s, int w) {
  std::mt19937_64 r(0x5157 + static_cast<std::uint64_t>(w));
  allocator& a = *s.a;
  std::vector<block> mine;
  const std::size_t keep = 10;
  while (!s.stop.load(std::memory_order_relaxed)) {
    const unsigned k = static_cast<unsigned>(r() % 100);
    if (k < 45 || mine.empty()) {  // allocate
      if (mine.size() >= keep) continue;
      block b;
      b.n = pick_size(r);
      b.stream = static_cast<int>(r() % kStreams);
      b.p = a.try_allocate(b.n, 0, stream_tag(b.stream));
      if (!b.p) {
        if (last_error().st.kind == errc::out_of_memory) ++s.t.oom;
        else s.t.fail("allocate(" + std::to_string(b.n) + "): " + last_error().message);
        continue;
      }
      ++s.t.allocs;
      b.id = s.next_id.fetch_add(1);
      fill_block(b.p, b.n, b.id, kFull);
      mine.push_back(b);
      continue;
    }
    const std::size_t i = r() % mine.size();
    block b = mine[i];
    mine[i] = mine.back();
    mine.pop_back();
    if (k < 60) {  // hand it over: another worker frees it
      std::lock_guard g(s.xmu);
      s.exchange.push_back(b);
    } else if (k < 70) {  // used on another stream too: reused only once that stream is done
      const int other = (b.stream + 1 + static_cast<int>(r() % (kStreams - 1))) % kStreams;
      try {
        a.record_stream(b.p, stream_tag(other));
        ++s.t.recorded;
      } catch (const std::exception& e) {
        s.t.fail(std::string("record_stream: ") + e.what());
      }
      free_block(s, a, b, b.stream, "worker");
    } else if (k < 80) {  // freed on another stream
      free_block(s, a, b, static_cast<int>(r() % kStreams), "worker");
    } else {
      free_block(s, a, b, b.stream, "worker");
    }
    // Take one handed-over block now and then (cross-thread free).
    block x;
    {
      std::lock_guard g(s.xmu);
      if (!s.exchange.empty() && r() % 2) {
        x = s.exchange.front();
        s.exchange.pop_front();
      }
    }
    if (x.p) {
      free_block(s, a, x, x.stream, "cross-thread");
      ++s.t.cross_thread;
    }
  }
  for (const block& b : mine) free_block(s, a, b, b.stream, "worker exit");
}

// The exportable allocator: allocations are whole chunks; exported ones are never reused.
void ipc_worker(shared_state& s) {
  std::mt19937_64 r(0x1bc);
  allocator& a = *s.ipc_a;
  auto importer = make_backend<host_backend>();
  std::vector<block> live;
  while (!s.stop.load(std::memory_order_relaxed)) {
    if (live.size() < 4 && r() % 3) {
      block b;
      b.n = 256 * KiB + r() % (6 * MiB);
      b.p = a.try_allocate(b.n);
      if (!b.p) {
        if (last_error().st.kind == errc::out_of_memory) ++s.t.oom;
        else s.t.fail("ipc allocate: " + last_error().message);
        continue;
      }
      ++s.t.allocs;
      b.id = s.next_id.fetch_add(1);
      fill_block(b.p, b.n, b.id, kFull);
      ipc::export_handle h;
      status st = a.try_export_ipc(b.p, h);
      if (!st.ok()) {
        s.t.fail("export_ipc: " + st.message());
      } else {
        ++s.t.exports;
        if (r() % 2) {  // read it back through another process's view
          ipc::imported m;
          std::string why;
          if (status x = ipc::try_import(*importer, std::move(h), {}, m, &why); !x.ok()) {
            s.t.fail("import: " + why);
          } else {
            ++s.t.imports;
            verify(s, {m.get(), b.n, b.id, 0}, "import");
            if (!m.close().ok()) s.t.fail("imported::close failed");
          }
        }
        h.close_fds();  // (import consumed it already when taken)
      }
      live.push_back(b);
    } else if (!live.empty()) {
      const std::size_t i = r() % live.size();
      free_block(s, a, live[i], 0, "ipc");
      live[i] = live.back();
      live.pop_back();
    }
  }
  for (const block& b : live) free_block(s, a, b, 0, "ipc exit");
  auto* ihb = backend_cast<host_backend>(*importer);
  if (ihb->live_handles() || ihb->live_mappings() || ihb->live_reservations())
    s.t.fail("the importing backend holds objects after every import was closed");
}

void stream_holder(shared_state& s) {
  std::mt19937_64 r(0x57);
  while (!s.stop.load(std::memory_order_relaxed)) {
    s.hb->hold_stream(stream_tag(kHeldStream));
    std::this_thread::sleep_for(std::chrono::milliseconds(2 + r() % 15));
    s.hb->complete_stream(stream_tag(kHeldStream));
    std::this_thread::sleep_for(std::chrono::milliseconds(1 + r() % 5));
  }
  s.hb->complete_stream(stream_tag(kHeldStream));
}

void admin(shared_state& s) {
  std::mt19937_64 r(0xad);
  allocator& a = *s.a;
  bool granted = false;
  while (!s.stop.load(std::memory_order_relaxed)) {
    const unsigned k = static_cast<unsigned>(r() % 4);
    try {
      if (k == 0) {
        const std::size_t keep = r() % 2 ? 0 : 32 * MiB;
        try {
          a.trim(keep);
          ++s.t.trims;
        } catch (const vmm::error& e) {
          // The host backend refuses to wait on a fence of the held stream (a GPU would block).
          if (e.st().kind == errc::not_permitted && std::string(e.st().op) == "wait_fence") ++s.t.trim_wait_refused;
          else throw;
        }
        if (r() % 2) s.ipc_a->trim(0);
      } else if (k == 1) {
        if (granted) a.revoke(1);
        else a.grant(1, r() % 2 ? access_mode::read_write : access_mode::read);
        granted = !granted;
        ++s.t.grants;
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(200 + r() % 800));
      }
    } catch (const std::exception& e) {
      s.t.fail(std::string(k == 0 ? "trim: " : "grant/revoke: ") + e.what());
    }
  }
  if (granted) a.revoke(1);
}

void diag(shared_state& s) {
  while (!s.stop.load(std::memory_order_relaxed)) {
    for (allocator* a : {s.a, s.ipc_a}) {
      if (std::string c = a->check(); !c.empty()) s.t.fail("check() while running: " + c);
      const auto st = a->stats();
      const std::size_t lim = a == s.a ? s.limit : s.ipc_limit;
      if (st.peak_physical > lim)
        s.t.fail("peak_physical " + std::to_string(st.peak_physical) + " above the limit " + std::to_string(lim));
      if (st.requested > st.allocated) s.t.fail("stats: requested above allocated");
      for (const auto& c : a->class_stats())
        if (c.used_slots > c.slots || c.cached_slots > c.used_slots) s.t.fail("class_stats: counts out of order");
      for (const auto& seg : a->memory_map()) {
        std::uintptr_t x = seg.addr;
        for (const auto& b : seg.blocks) {
          if (b.addr != x || (b.state != block_state::live && b.requested != 0)) s.t.fail("memory_map: a block out of place");
          x += b.size;
        }
        if (x != seg.addr + seg.size) s.t.fail("memory_map: blocks do not tile their segment");
      }
      ++s.t.checks;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

void run_stress(bool limited) {
  const std::size_t limit = limited ? 128 * MiB : std::numeric_limits<std::size_t>::max();
  const std::size_t ipc_limit = limited ? 24 * MiB : std::numeric_limits<std::size_t>::max();
  host_backend_options h;
  h.device_count = 2;  // the owner and one peer for grant/revoke
  h.reuse_handles = true;  // as the driver: a stale handle value names a newer handle
  auto b = make_backend<host_backend>(h);
  host_backend* hb = backend_cast<host_backend>(*b);
  allocator a = allocator_access::make(std::move(b), stress_options(limit), stress_tuning());
  options io = stress_options(ipc_limit);
  io.ipc = ipc_kind::posix_fd;
  allocator ia = allocator_access::make(make_backend<host_backend>(), io, stress_tuning());

  shared_state s;
  s.a = &a;
  s.ipc_a = &ia;
  s.hb = hb;
  s.limit = limit;
  s.ipc_limit = ipc_limit;
  std::vector<std::thread> ts;
  for (int w = 0; w < 4; ++w) ts.emplace_back(worker, std::ref(s), w);
  ts.emplace_back(ipc_worker, std::ref(s));
  ts.emplace_back(stream_holder, std::ref(s));
  ts.emplace_back(admin, std::ref(s));
  ts.emplace_back(diag, std::ref(s));
  std::this_thread::sleep_for(std::chrono::milliseconds(run_ms()));
  s.stop = true;
  for (auto& t : ts) t.join();
  hb->complete_stream(stream_tag(kHeldStream));
  for (const block& x : s.exchange) free_block(s, a, x, x.stream, "leftover");
  s.exchange.clear();

  const tally& t = s.t;
  std::printf("%s: %llu allocs, %llu frees (%llu cross-thread, %llu cross-stream, %llu after record_stream), "
              "%llu out of memory, %llu exports (%llu imported), %llu trims (%llu refused waiting on the held "
              "stream), %llu grant/revoke, %llu diagnostics rounds, %llu bytes verified\n",
              limited ? "limited" : "unlimited", (unsigned long long)t.allocs, (unsigned long long)t.frees,
              (unsigned long long)t.cross_thread, (unsigned long long)t.cross_stream, (unsigned long long)t.recorded,
              (unsigned long long)t.oom, (unsigned long long)t.exports, (unsigned long long)t.imports,
              (unsigned long long)t.trims, (unsigned long long)t.trim_wait_refused, (unsigned long long)t.grants,
              (unsigned long long)t.checks, (unsigned long long)t.verified);
  std::fflush(stdout);
  for (const auto& m : s.t.other) FAIL_CHECK(m);
  CHECK(s.t.other.empty());
  CHECK(t.allocs > 100);
  CHECK(t.cross_thread > 0);
  CHECK(t.recorded > 0);
  CHECK(t.exports > 0);
  CHECK(t.grants > 0);
  CHECK(t.checks > 0);
  if (!limited) CHECK(t.oom == 0);  // nothing refuses without a limit (64 GiB simulated device)

  for (allocator* x : {&a, &ia}) {
    CHECK(x->check() == "");
    const auto st = x->stats();
    CHECK(st.live == 0);
    CHECK(st.requested == 0);
    CHECK(st.peak_physical <= (x == &a ? limit : ipc_limit));
  }
  CHECK(a.access().size() == 1);  // the last revoke left the owner only

  if (limited) {
    // Every thread is gone (their caches flushed), every block freed, the stream completed: the
    // memory still held (empty slabs, free chunks, idle handles, deferred frees) is reclaimed by
    // the out-of-memory path itself. No trim() here.
    for (allocator* x : {&a, &ia}) {
      const std::size_t lim = x == &a ? limit : ipc_limit;
      void* p = x->try_allocate(lim - x->granularity());
      INFO("last error: " << last_error().message);
      CHECK(p != nullptr);
      if (p) x->deallocate(p);
      CHECK(x->stats().peak_physical <= lim);
      CHECK(x->check() == "");
    }
  }
  a.trim(0);
  ia.trim(0);
  CHECK(a.stats().physical == 0);
  CHECK(ia.stats().physical == 0);
  CHECK(hb->live_handles() == 0);
  CHECK(hb->live_mappings() == 0);
}

}  // namespace

TEST_CASE("stress: every call at once from many threads, no memory limit") { run_stress(false); }

TEST_CASE("stress: every call at once from many threads, under options.memory_limit") { run_stress(true); }
