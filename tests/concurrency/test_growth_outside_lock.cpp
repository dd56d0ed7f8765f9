// SPDX-License-Identifier: Apache-2.0
// Growth's driver calls run outside the allocator's lock: while one thread's growth sits in
// cuMemCreate, cuMemMap, the cuMemUnmap of a range it stitches from or the cuMemRelease of an
// idle handle it cannot use (here: a backend that blocks there until the test lets it go), other
// threads allocate and free from mapped memory, read stats and check the invariants. So do the
// unmaps and releases of frees, cache flushes and trim, and the waits of trim and of the
// out-of-memory reclaim for a stream that still uses freed memory. The memory
// limit counts the growth in flight, so two growths at once cannot pass it together. Host
// backend; CI runs it in the plain, ASan and TSan trees.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <future>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "frontend/allocator_access.hpp"
#include "vmmalloc/host_backend.hpp"
#include "vmmalloc/vmmalloc.hpp"

using namespace vmm;

namespace {
constexpr std::size_t MiB = std::size_t{1} << 20, GiB = MiB << 10;
using namespace std::chrono_literals;

// Blocks the first create (or map) after arm() until open(): a driver call that takes long.
class gate_backend final : public forwarding_backend {
 public:
  enum which { none, create_call, map_call, unmap_call, release_call, wait_call };
  using forwarding_backend::forwarding_backend;

  result<mem_handle> create(std::size_t n, const chunk_props& p) override {
    hold(create_call);
    return forwarding_backend::create(n, p);
  }
  status map(std::uintptr_t va, std::size_t n, mem_handle h, std::size_t off) override {
    hold(map_call);
    return forwarding_backend::map(va, n, h, off);
  }
  status unmap(std::uintptr_t va, std::size_t n) override {
    hold(unmap_call);
    return forwarding_backend::unmap(va, n);
  }
  status release(mem_handle h) override {
    hold(release_call);
    return forwarding_backend::release(h);
  }
  status wait_fence(fence_t f) override {
    hold(wait_call);
    return forwarding_backend::wait_fence(f);
  }

  void arm(which w) { armed_.store(w); }
  bool wait_entered(std::chrono::milliseconds t) {
    std::unique_lock l(mu_);
    return cv_.wait_for(l, t, [&] { return entered_; });
  }
  // Notifies under the mutex: a held thread that wakes early may let the test destroy the gate
  // (with its allocator) right after.
  void open() {
    std::lock_guard l(mu_);
    open_ = true;
    cv_.notify_all();
  }

 private:
  void hold(which w) {
    int e = w;
    if (!armed_.compare_exchange_strong(e, none)) return;
    std::unique_lock l(mu_);
    entered_ = true;
    cv_.notify_all();
    cv_.wait(l, [&] { return open_; });
  }
  std::atomic<int> armed_{none};
  std::mutex mu_;
  std::condition_variable cv_;
  bool entered_ = false, open_ = false;
};

struct fixture {
  gate_backend* gate = nullptr;
  std::unique_ptr<allocator> a;
  explicit fixture(options o = {}, const tuning& t = {}) {
    o.reservation_size = 8 * GiB;
    auto g = std::make_unique<gate_backend>(make_backend<host_backend>());
    gate = g.get();
    a = std::make_unique<allocator>(allocator_access::make(std::move(g), o, t));
  }
  // A test that stopped early must not leave its gate armed or closed for the teardown's calls.
  ~fixture() {
    if (!a) return;  // destroyed by the test, the gate with it
    gate->arm(gate_backend::none);
    gate->open();
  }
};

// Another thread's allocate + free pairs from mapped memory (large and small), then stats() and
// check(): pairs that succeeded, and what check() found.
std::pair<int, std::string> others_loop(allocator& a) {
  int ok = 0;
  for (int i = 0; i < 200; ++i) {
    void* p = a.try_allocate(1 * MiB + 4096 * (i % 7));  // the large path: under the lock
    void* q = a.try_allocate(3000);                       // a small class
    if (p && q) ++ok;
    a.deallocate(q);
    a.deallocate(p);
  }
  (void)a.stats();
  return std::make_pair(ok, a.check());
}
std::future<std::pair<int, std::string>> start_others(allocator& a) {
  return std::async(std::launch::async, [&a] { return others_loop(a); });
}

// While a driver call sits in the gate, other threads allocate and free from mapped memory: they
// must finish before the gate opens (`why` is the failure message), without losing a block.
void others_finish_while_gated(fixture& f, const char* why,
                               std::future<std::pair<int, std::string>> others = {}) {
  if (!others.valid()) others = start_others(*f.a);
  const bool finished = others.wait_for(10s) == std::future_status::ready;
  CHECK_MESSAGE(finished, why);
  f.gate->open();
  auto [ok, problems] = others.get();
  CHECK(ok == 200);
  CHECK(problems == "");
}

// Once every block is freed: trim(0) leaves no physical memory and the invariants hold.
void gives_everything_back(allocator& a) {
  a.trim(0);
  CHECK(a.stats().physical == 0);
  CHECK(a.check() == "");
}

// start_others on a thread whose cache is registered before `go`: a thread's first allocation
// registers its cache under a global lock, which a thread that is exiting holds.
std::future<std::pair<int, std::string>> start_registered_others(allocator& a, std::shared_future<void> go) {
  std::promise<void> ready;
  auto registered = ready.get_future();
  auto f = std::async(std::launch::async, [&a, go, r = std::move(ready)]() mutable {
    a.deallocate(a.allocate(3000));
    r.set_value();
    go.wait();
    return others_loop(a);
  });
  registered.wait();
  return f;
}

// A thread that frees small slots of its own, all of one fresh chunk, into its cache: the
// chunk is wholly free once the cache gives them back. Returns the chunk's bytes.
std::size_t cache_a_chunk(allocator& a, int slots) {
  const std::size_t before = a.stats().mapped;
  std::vector<void*> v;
  for (int i = 0; i < slots; ++i) v.push_back(a.allocate(60 * 1024));
  const std::size_t grown = a.stats().mapped - before;
  for (void* p : v) a.deallocate(p);
  return grown;
}

// While `grower` is blocked in the gated call, `others` must finish: it needs the allocator's
// lock only for memory that is already mapped.
// between: called after the warm allocations, before their frees.
void others_run_while_growth_blocks(fixture& f, gate_backend::which w, std::size_t grow_bytes,
                                    const std::function<void()>& before_growth = {},
                                    const std::function<void()>& between = {}) {
  allocator& a = *f.a;
  // Mapped, free memory for the other threads: a few MiB allocated and freed.
  std::vector<void*> warm;
  for (int i = 0; i < 8; ++i) warm.push_back(a.allocate(1 * MiB));
  if (between) between();
  for (void* p : warm) a.deallocate(p);
  if (before_growth) before_growth();

  f.gate->arm(w);
  auto grower = std::async(std::launch::async, [&] { return a.try_allocate(grow_bytes); });
  REQUIRE(f.gate->wait_entered(10s));

  // Before growth left the lock, the others waited for the gate: this timed out.
  others_finish_while_gated(f, "allocations from mapped memory waited for another thread's driver call");
  void* big = grower.get();
  REQUIRE(big != nullptr);
  static_cast<char*>(big)[0] = 1;
  static_cast<char*>(big)[grow_bytes - 1] = 2;
  a.deallocate(big);
  CHECK(a.check() == "");
}
}  // namespace

TEST_CASE("other threads allocate while a growth waits in create") {
  SUBCASE("a huge block (its own chunk)") {
    fixture f;
    others_run_while_growth_blocks(f, gate_backend::create_call, 512 * MiB);
  }
  SUBCASE("span memory") {
    fixture f;
    others_run_while_growth_blocks(f, gate_backend::create_call, 96 * MiB);
  }
  SUBCASE("thread caches off") {
    options o;
    o.thread_cache = false;
    fixture f(o);
    others_run_while_growth_blocks(f, gate_backend::create_call, 96 * MiB);
  }
}

TEST_CASE("a cached huge block grown in place is no other thread's while its growth waits in create") {
  // The growth maps the pages the block lacks after it, outside the lock: meanwhile another
  // thread's request of the block's size must not get it, and trim() must not unmap it.
  tuning t;
  t.thread_cache_large = false;  // the freed block goes to the heap's cache
  fixture f({}, t);
  allocator& a = *f.a;
  const std::size_t n = t.huge_threshold + 72 * MiB;
  void* p = a.allocate(n);
  a.deallocate(p);
  f.gate->arm(gate_backend::create_call);
  auto grower = std::async(std::launch::async, [&] { return a.try_allocate(n + 3 * MiB); });
  REQUIRE(f.gate->wait_entered(10s));
  auto other = std::async(std::launch::async, [&] {
    a.trim(0);
    void* q = a.try_allocate(n);
    if (q) static_cast<char*>(q)[n - 1] = 1;
    return std::make_pair(q, a.check());
  });
  const bool finished = other.wait_for(10s) == std::future_status::ready;
  CHECK_MESSAGE(finished, "another thread waited for the growth's driver call");
  f.gate->open();
  auto [q, problems] = other.get();
  void* r = grower.get();
  CHECK(problems == "");
  REQUIRE(q != nullptr);
  CHECK(r == p);  // grown in place
  CHECK(q != p);  // not handed out twice
  static_cast<char*>(r)[0] = 1;
  static_cast<char*>(r)[n + 3 * MiB - 1] = 2;
  CHECK(a.check() == "");
  a.deallocate(q);
  a.deallocate(r);
  gives_everything_back(a);
}

TEST_CASE("other threads allocate while a growth waits in map") {
  fixture f;
  others_run_while_growth_blocks(f, gate_backend::map_call, 512 * MiB);
}

TEST_CASE("other threads allocate while a growth unmaps retired ranges") {
  // Chunks freed on S1 while S1 runs behind are retired: their handles serve S1's next request,
  // their old VA stays mapped until S1's fence completes. The next growth unmaps those ranges
  // with its own driver calls, outside the lock (they used to be unmapped under it).
  tuning t;
  t.max_growth = 2 * MiB;  // chunks of 2 MiB: the 6 MiB request is stitched from freed ones
  fixture f({}, t);
  allocator& a = *f.a;
  auto& hb = *backend_cast<host_backend>(f.gate->inner());
  const stream_t s1 = reinterpret_cast<stream_t>(std::uintptr_t{1});
  std::vector<void*> v;
  for (int i = 0; i < 6; ++i) v.push_back(a.allocate(2 * MiB, 0, s1));
  void* keep = a.allocate(2 * MiB, 0, s1);
  for (int i = 0; i < 6; i += 2) a.deallocate(v[i], s1);  // three free chunks, not adjacent
  hb.hold_stream(s1);
  void* big = a.allocate(6 * MiB, 0, s1);
  REQUIRE(a.stats().retiring > 0);
  others_run_while_growth_blocks(f, gate_backend::unmap_call, 96 * MiB, [&] { hb.complete_stream(s1); });
  CHECK(a.stats().retiring == 0);  // the growth unmapped them, and their VA is a hole again
  a.deallocate(big, s1);
  a.deallocate(keep, s1);
  for (int i = 1; i < 6; i += 2) a.deallocate(v[i], s1);
  gives_everything_back(a);
}

TEST_CASE("a handle retired for one stream's growth is not mapped for another stream meanwhile") {
  // Stream A frees a 2 MiB chunk while A still runs behind, and asks for 6 MiB: its growth retires
  // that chunk (its handle serves A's later work, its old VA stays mapped until A's fence) and
  // evicts a 4 MiB chunk freed on B, whose unmap runs outside the lock (held here by the gate).
  // Meanwhile stream B asks for 2 MiB. The retired handle sits idle, but A's queued work may still
  // write its memory through the old VA: mapping it for B would let B's work and A's overlap.
  options o;
  o.thread_cache = false;
  fixture f(o);
  allocator& a = *f.a;
  auto& hb = *backend_cast<host_backend>(f.gate->inner());
  const stream_t sa = reinterpret_cast<stream_t>(std::uintptr_t{0xa}), sb = reinterpret_cast<stream_t>(std::uintptr_t{0xb});
  void* x1 = a.allocate(2 * MiB, 0, sa);  // chunk 1: 2 MiB
  void* x2 = a.allocate(4 * MiB, 0, sb);  // chunk 2: 4 MiB, after it
  const mem_handle h1 = hb.handle_at(reinterpret_cast<std::uintptr_t>(x1));
  REQUIRE(h1 != 0);
  REQUIRE(hb.handle_at(reinterpret_cast<std::uintptr_t>(x2)) != h1);
  hb.hold_stream(sa);  // A's work on x1 is still queued
  a.deallocate(x1, sa);
  a.deallocate(x2, sb);
  f.gate->arm(gate_backend::unmap_call);
  auto grower = std::async(std::launch::async, [&] { return a.try_allocate(6 * MiB, 0, sa); });
  REQUIRE(f.gate->wait_entered(10s));
  REQUIRE(a.stats().retiring >= 2 * MiB);
  void* y = a.allocate(2 * MiB, 0, sb);
  CHECK(hb.handle_at(reinterpret_cast<std::uintptr_t>(y)) != h1);
  f.gate->open();
  void* big = grower.get();
  REQUIRE(big != nullptr);
  a.deallocate(y, sb);
  a.deallocate(big, sa);
  hb.complete_stream(sa);
  gives_everything_back(a);
}

TEST_CASE("other threads allocate while a growth releases an idle handle it cannot use") {
  // A freed 512 MiB huge block's chunk, the oldest free one, is evicted for a 96 MiB growth: its
  // handle is larger than the growth, so it is released before the growth creates (the footprint
  // stays at one of the two). The release runs with the growth's other driver calls, outside the
  // lock, while the other threads use the mapped memory freed after it.
  fixture f;
  allocator& a = *f.a;
  void* big = nullptr;
  std::thread([&] { big = a.allocate(512 * MiB); }).join();  // not this thread's cached block
  REQUIRE(big != nullptr);
  others_run_while_growth_blocks(f, gate_backend::release_call, 96 * MiB, {}, [&] {
    a.deallocate(big);
    REQUIRE(a.stats().free_chunk_bytes >= 512 * MiB);
  });
  const auto st = a.stats();
  CHECK(st.physical < 512 * MiB);  // the 512 MiB handle is gone, not kept beside the new memory
  CHECK(st.calls.release >= 1);
  gives_everything_back(a);
}

TEST_CASE("other threads allocate while a free gives its chunk back") {
  // release_threshold 0: a free whose chunk becomes wholly free unmaps and releases it. Those
  // driver calls run after the free has dropped the lock, as a growth's do.
  options o;
  o.release_threshold = 0;
  fixture f(o);
  allocator& a = *f.a;
  void* keep = a.allocate(4 * MiB);  // memory the other threads use meanwhile: not given back
  void* big = a.allocate(96 * MiB);
  f.gate->arm(gate_backend::release_call);
  auto freer = std::async(std::launch::async, [&] { a.deallocate(big); });
  REQUIRE(f.gate->wait_entered(10s));
  others_finish_while_gated(f, "allocations waited for another thread's free to release its chunk");
  freer.get();
  const auto st = a.stats();
  CHECK(st.retiring == 0);             // the free's range was unmapped
  CHECK(st.physical < 96 * MiB);       // and its handle released
  a.deallocate(keep);
  gives_everything_back(a);
}

TEST_CASE("other threads allocate while a thread cache gives a chunk back") {
  // release_threshold 0: slots returned from a thread cache that leave a chunk wholly free unmap
  // and release it. Those driver calls run after the lock is dropped, as a free's do, whichever
  // way the slots go back: the thread's exit, a full bin, trim's return of the caller's cache.
  options o;
  o.release_threshold = 0;
  fixture f(o);
  allocator& a = *f.a;
  void* keep = a.allocate(4 * MiB);  // memory the other threads use meanwhile: not given back
  // Declared in this order, a test stopped early opens the gate, then lets the others go, then
  // waits for them.
  std::future<std::pair<int, std::string>> others;
  std::promise<void> go;
  struct opener {
    fixture& f;
    ~opener() {
      f.gate->arm(gate_backend::none);
      f.gate->open();
    }
  } open_at_end{f};
  others = start_registered_others(a, go.get_future().share());
  const auto released_before = a.stats().calls.release;
  std::size_t cached = 0;

  SUBCASE("at the thread's exit") {
    struct joined {
      std::thread t;
      fixture& f;
      ~joined() {
        f.gate->open();
        if (t.joinable()) t.join();
      }
    } j{std::thread([&] {
          cached = cache_a_chunk(a, 16);  // fits the bin: nothing goes back before the exit
          f.gate->arm(gate_backend::release_call);
        }),
        f};
    REQUIRE(f.gate->wait_entered(10s));
    go.set_value();
    others_finish_while_gated(f, "allocations waited for an exiting thread's cache to release a chunk",
                              std::move(others));
    j.t.join();
  }
  SUBCASE("when a full bin goes back") {
    auto freer = std::async(std::launch::async, [&] {
      std::vector<void*> v;
      for (int i = 0; i < 200; ++i) v.push_back(a.allocate(60 * 1024));
      f.gate->arm(gate_backend::release_call);
      // Every 17th free returns half the bin: the later chunks' slots go back, wholly.
      for (void* p : v) a.deallocate(p);
    });
    REQUIRE(f.gate->wait_entered(10s));
    go.set_value();
    others_finish_while_gated(f, "allocations waited for a thread's full bin to release a chunk", std::move(others));
    freer.get();
    cached = 1;
  }
  SUBCASE("when trim returns the caller's cache") {
    auto trimmer = std::async(std::launch::async, [&] {
      cached = cache_a_chunk(a, 16);
      f.gate->arm(gate_backend::release_call);
      a.trim(0);
    });
    REQUIRE(f.gate->wait_entered(10s));
    go.set_value();
    others_finish_while_gated(f, "allocations waited for trim's return of a thread cache", std::move(others));
    trimmer.get();
  }
  CHECK(cached > 0);  // the slots had a chunk of their own
  CHECK(a.stats().calls.release > released_before);
  a.deallocate(keep);
  gives_everything_back(a);
}

TEST_CASE("an allocator destroyed while a thread's exit gives a chunk back waits for that exit") {
  // The exiting thread flushes its cache without the registry's lock: the destructor must not
  // free the heap under it (ASan and TSan see it if it does).
  options o;
  o.release_threshold = 0;
  fixture f(o);
  gate_backend* gate = f.gate;
  // The layout of the test above: the slots get a chunk of their own.
  void* keep = f.a->allocate(4 * MiB);
  std::thread([&] { f.a->deallocate(f.a->allocate(3000)); }).join();
  std::thread t([&] {
    (void)cache_a_chunk(*f.a, 16);
    gate->arm(gate_backend::release_call);
  });
  if (!gate->wait_entered(10s)) {
    gate->open();
    t.join();
    FAIL("the exiting thread released no chunk");
  }
  auto destroyer = std::async(std::launch::async, [&] {
    f.a->deallocate(keep);
    f.a.reset();
  });
  CHECK(destroyer.wait_for(200ms) == std::future_status::timeout);  // waits for the exit
  gate->open();
  destroyer.get();
  t.join();
  CHECK(f.a == nullptr);
}

namespace {
// 96 MiB freed on a stream the GPU has not caught up with (held): a wholly free chunk that trim or
// a reclaim can give back only after waiting for that stream.
void* free_on_held_stream(fixture& f, stream_t s1) {
  auto& hb = *backend_cast<host_backend>(f.gate->inner());
  void* big = nullptr;
  std::thread([&] { big = f.a->allocate(96 * MiB, 0, s1); }).join();  // not this thread's cached block
  hb.hold_stream(s1);
  f.a->deallocate(big, s1);
  return big;
}
}  // namespace

TEST_CASE("other threads allocate while trim waits for a stream") {
  // trim(0) gives back a chunk a held stream may still use: it waits for that stream's fence,
  // without the lock; then the chunk goes.
  fixture f;
  allocator& a = *f.a;
  auto& hb = *backend_cast<host_backend>(f.gate->inner());
  const stream_t s1 = reinterpret_cast<stream_t>(std::uintptr_t{1});
  void* keep = a.allocate(4 * MiB);  // memory the other threads use meanwhile
  (void)free_on_held_stream(f, s1);
  f.gate->arm(gate_backend::wait_call);
  auto trimmer = std::async(std::launch::async, [&] { a.trim(0); });
  REQUIRE(f.gate->wait_entered(10s));
  hb.complete_stream(s1);  // the GPU catches up while trim waits
  others_finish_while_gated(f, "allocations waited for trim's wait on a stream");
  trimmer.get();
  const auto st = a.stats();
  CHECK(st.physical < 96 * MiB);  // the chunk went once its stream had caught up
  CHECK(st.calls.wait_fence >= 1);
  a.deallocate(keep);
  gives_everything_back(a);
}

TEST_CASE("other threads allocate while an out-of-memory reclaim waits for a stream") {
  // Under a 128 MiB limit, 64 MiB more fit only once the 96 MiB freed on a held stream are given
  // back: the reclaim waits for that stream without the lock, then the request is tried again.
  options o;
  o.memory_limit = 128 * MiB;
  fixture f(o);
  allocator& a = *f.a;
  auto& hb = *backend_cast<host_backend>(f.gate->inner());
  const stream_t s1 = reinterpret_cast<stream_t>(std::uintptr_t{1});
  void* keep = a.allocate(4 * MiB);
  (void)free_on_held_stream(f, s1);
  f.gate->arm(gate_backend::wait_call);
  auto requester = std::async(std::launch::async, [&] { return a.try_allocate(64 * MiB); });
  REQUIRE(f.gate->wait_entered(10s));
  hb.complete_stream(s1);
  others_finish_while_gated(f, "allocations waited for a reclaim's wait on a stream");
  void* p = requester.get();
  REQUIRE(p != nullptr);
  static_cast<char*>(p)[64 * MiB - 1] = 1;
  CHECK(a.stats().reclaims >= 1);
  CHECK(a.stats().peak_physical <= o.memory_limit);
  a.deallocate(p);
  a.deallocate(keep);
  CHECK(a.check() == "");
}

TEST_CASE("the memory limit counts a growth in flight") {
  options o;
  o.memory_limit = 256 * MiB;
  fixture f(o);
  allocator& a = *f.a;
  f.gate->arm(gate_backend::create_call);
  auto first = std::async(std::launch::async, [&] { return a.try_allocate(160 * MiB); });
  REQUIRE(f.gate->wait_entered(10s));
  struct seen {
    void* over;
    errc over_kind;
    void* fits;
    std::size_t physical;
    std::string problems;
  };
  // 160 MiB are being created: 128 more would pass the limit, 64 do not.
  auto second = std::async(std::launch::async, [&] {
    seen r{};
    r.over = a.try_allocate(128 * MiB);
    r.over_kind = r.over ? errc::ok : last_error().st.kind;
    r.fits = a.try_allocate(64 * MiB);
    r.physical = a.stats().physical;
    r.problems = a.check();
    return r;
  });
  const bool finished = second.wait_for(10s) == std::future_status::ready;
  CHECK_MESSAGE(finished, "a request waited for another thread's growth");
  f.gate->open();
  const seen r = second.get();
  CHECK(r.over == nullptr);
  CHECK(r.over_kind == errc::out_of_memory);
  CHECK(r.fits != nullptr);
  CHECK(r.physical <= o.memory_limit);
  CHECK(r.problems == "");
  void* p = first.get();
  CHECK(p != nullptr);
  CHECK(a.stats().peak_physical <= o.memory_limit);
  a.deallocate(p);
  a.deallocate(r.fits);
  if (r.over) a.deallocate(r.over);
  CHECK(a.check() == "");
}

TEST_CASE("other threads allocate while trim gives chunks back") {
  // trim(0) unmaps and releases every free chunk and idle handle. Those driver calls run after
  // trim has dropped the lock, as a free's do; trim returns once they are done.
  fixture f;
  allocator& a = *f.a;
  void* keep = a.allocate(4 * MiB);  // memory the other threads use meanwhile: not given back
  // The trimming thread frees the block itself: trim returns the calling thread's cache first.
  auto trimmer = std::async(std::launch::async, [&] {
    a.deallocate(a.allocate(96 * MiB));
    f.gate->arm(gate_backend::release_call);
    a.trim(0);
  });
  REQUIRE(f.gate->wait_entered(10s));
  others_finish_while_gated(f, "allocations waited for another thread's trim to release a chunk");
  trimmer.get();
  const auto st = a.stats();
  CHECK(st.retiring == 0);        // the free chunk's range was unmapped
  CHECK(st.physical < 96 * MiB);  // and its handle released before trim returned
  CHECK(st.calls.release >= 1);
  a.deallocate(keep);
  gives_everything_back(a);
}

TEST_CASE("a growth the driver refuses outside the lock leaves nothing behind") {
  // The host backend's simulated device memory: the create of the growth fails.
  host_backend_options ho;
  ho.physical_limit = 64 * MiB;
  options o;
  o.reservation_size = 8 * GiB;
  allocator a(make_backend<host_backend>(ho), o);
  void* p = a.allocate(8 * MiB);
  const auto before = a.stats();
  CHECK(a.try_allocate(512 * MiB) == nullptr);
  CHECK(last_error().st.kind == errc::out_of_memory);
  const auto after = a.stats();
  CHECK(after.mapped == before.mapped);
  CHECK(after.physical <= before.physical);
  CHECK(a.check() == "");
  void* q = a.try_allocate(32 * MiB);  // the hole and the limit's count came back
  CHECK(q != nullptr);
  a.deallocate(q);
  a.deallocate(p);
  CHECK(a.check() == "");
}
