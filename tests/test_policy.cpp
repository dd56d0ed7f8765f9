// SPDX-License-Identifier: Apache-2.0
// Policies and observability on the host backend: run-time grant/revoke, export of whole-chunk
// allocations, the fabric -> POSIX fd fallback, statistics (C++ and C) and trace recording.
#include <doctest/doctest.h>

#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "frontend/allocator_access.hpp"
#include "support/fault_backend.hpp"
#include "vmmalloc/ipc.hpp"
#include "vmmalloc/vmmalloc.h"
#include "vmmalloc/vmmalloc.hpp"

using namespace vmm;

namespace {
constexpr std::size_t MiB = std::size_t{1} << 20;

options small_reservation() {
  options o;
  o.reservation_size = 256 * MiB;
  return o;
}

std::uintptr_t u(const void* p) { return reinterpret_cast<std::uintptr_t>(p); }

// Host allocator behind a fault decorator (test keeps the state for counts and injections).
struct faulty {
  std::shared_ptr<test::fault_state> st = std::make_shared<test::fault_state>();
  allocator a;
  explicit faulty(const options& o, host_backend_options h = {}, const tuning& t = {})
      : a(allocator_access::make(std::make_unique<test::fault_backend>(make_backend<host_backend>(h), st), o, t)) {}
  host_backend& host() { return *st->host; }
};
}  // namespace

TEST_CASE("grant and revoke apply to every mapped run with one set_access each, and to later mappings") {
  tuning t;
  t.huge_threshold = 4 * MiB;  // dedicated chunks: easy to lay out runs
  t.huge_headroom_div = 0;     // side by side, no VA left between them
  faulty f(small_reservation(), {}, t);
  void* a = f.a.allocate(4 * MiB);
  void* b = f.a.allocate(4 * MiB);
  void* c = f.a.allocate(4 * MiB);
  REQUIRE(u(b) == u(a) + 4 * MiB);
  REQUIRE(u(c) == u(b) + 4 * MiB);
  f.a.deallocate(b);
  f.a.trim();  // b's chunk is unmapped: two mapped runs, [a] and [c]
  CHECK(f.a.stats().chunks == 2);
  CHECK(f.host().access_of(u(a), 1) == access_mode::none);

  const auto before = f.st->calls(test::op::set_access);
  f.a.grant(1, access_mode::read);
  CHECK(f.st->calls(test::op::set_access) - before == 2);  // one per run, not per chunk
  CHECK(f.host().access_of(u(a), 1) == access_mode::read);
  CHECK(f.host().access_of(u(c), 1) == access_mode::read);
  CHECK(f.host().access_of(u(a), 0) == access_mode::read_write);  // the owner is untouched
  auto acc = f.a.access();
  REQUIRE(acc.size() == 2);
  CHECK(acc[0].device == 0);
  CHECK(acc[1].device == 1);
  CHECK(acc[1].mode == access_mode::read);

  void* d = f.a.allocate(4 * MiB);  // a later mapping gets the grant too
  CHECK(f.host().access_of(u(d), 1) == access_mode::read);
  f.a.grant(1, access_mode::read_write);
  CHECK(f.host().access_of(u(d), 1) == access_mode::read_write);
  CHECK(f.host().access_of(u(a), 1) == access_mode::read_write);

  const auto calls = f.st->calls(test::op::set_access);
  f.a.grant(1, access_mode::read_write);  // no change: no driver call
  CHECK(f.st->calls(test::op::set_access) == calls);

  f.a.revoke(1);
  CHECK(f.host().access_of(u(a), 1) == access_mode::none);
  CHECK(f.host().access_of(u(d), 1) == access_mode::none);
  CHECK(f.a.access().size() == 1);
  void* e = f.a.allocate(4 * MiB);
  CHECK(f.host().access_of(u(e), 1) == access_mode::none);
  CHECK(f.a.stats().access_changes == 3);
  for (void* p : {a, c, d, e}) f.a.deallocate(p);
  CHECK(f.a.check() == "");
}

TEST_CASE("grant errors leave the access table and the mappings untouched") {
  tuning t;
  t.huge_threshold = 4 * MiB;
  faulty f(small_reservation(), {}, t);  // host backend: devices 0 and 1
  void* a = f.a.allocate(4 * MiB);
  void* b = f.a.allocate(4 * MiB);
  f.a.deallocate(b);
  f.a.trim();
  void* c = f.a.allocate(8 * MiB);  // lands after a's run? either way at least one run
  (void)c;

  CHECK_THROWS_WITH_AS(f.a.grant(0, access_mode::read), doctest::Contains("owner device"), vmm::error);
  CHECK_THROWS_WITH_AS(f.a.revoke(0), doctest::Contains("owner device"), vmm::error);
  CHECK_THROWS_WITH_AS(f.a.grant(7), doctest::Contains("cannot access"), vmm::error);
  CHECK_THROWS_AS(f.a.grant(-1), vmm::error);
  CHECK(f.a.access().size() == 1);

  // A driver failure part-way: the runs already changed are set back.
  f.st->arm(test::op::set_access, 2, test::fault::invalid_value);
  const auto runs_before = f.st->calls(test::op::set_access);
  bool threw = false;
  try {
    f.a.grant(1, access_mode::read_write);
  } catch (const vmm::error& e) {
    threw = true;
    CHECK(std::string(e.what()).find("CUDA_ERROR_INVALID_VALUE") != std::string::npos);
  }
  f.st->disarm();
  const bool several_runs = f.st->calls(test::op::set_access) - runs_before > 1;
  if (several_runs) {
    CHECK(threw);
    CHECK(f.host().access_of(u(a), 1) == access_mode::none);
    CHECK(f.host().access_of(u(c), 1) == access_mode::none);
    CHECK(f.a.access().size() == 1);
  }
  // The allocator still works and the grant succeeds once the driver does.
  f.a.grant(1, access_mode::read_write);
  CHECK(f.host().access_of(u(a), 1) == access_mode::read_write);
  f.a.deallocate(a);
  f.a.deallocate(c);
  CHECK(f.a.check() == "");
}

TEST_CASE("C API: grant, revoke, class stats, reset peaks, extended stats") {
  vmm_policy pol;
  vmm_policy_init(&pol);
  pol.backend = VMM_BACKEND_HOST;
  pol.reservation_size = 256 * MiB;
  vmm_allocator* a = nullptr;
  REQUIRE(vmm_create(&pol, &a) == VMM_SUCCESS);
  std::vector<void*> small;
  for (int i = 0; i < 100; ++i) small.push_back(vmm_malloc(a, 1000));
  void* big = vmm_malloc(a, 3 * MiB);
  REQUIRE(big);
  CHECK(vmm_grant(a, 1, 1) == VMM_SUCCESS);
  CHECK(vmm_grant(a, 0, 0) == VMM_ERROR_INVALID_VALUE);
  CHECK(std::string(vmm_last_error()).find("owner") != std::string::npos);
  CHECK(vmm_revoke(a, 1) == VMM_SUCCESS);
  CHECK(vmm_grant(nullptr, 1, 0) == VMM_ERROR_INVALID_VALUE);

  vmm_stats s;
  REQUIRE(vmm_get_stats(a, &s) == VMM_SUCCESS);
  CHECK(s.access_changes == 2);
  CHECK(s.requested == 100 * 1000 + 3 * MiB);
  CHECK(s.fragmentation > 0.0);
  CHECK(s.fragmentation < 1.0);
  CHECK(s.fragmentation == doctest::Approx(1.0 - double(s.requested) / double(s.mapped)));
  CHECK(s.slab_bytes > 0);

  size_t n = 0;
  REQUIRE(vmm_get_class_stats(a, nullptr, 0, &n) == VMM_SUCCESS);
  REQUIRE(n > 0);
  std::vector<vmm_class_stats> cs(n);
  REQUIRE(vmm_get_class_stats(a, cs.data(), n, &n) == VMM_SUCCESS);
  size_t live = 0, used = 0;
  for (auto& c : cs) {
    live += c.live_bytes;
    used += c.used_slots - c.cached_slots;
    CHECK(c.used_slots <= c.slots);
    if (c.live_bytes) CHECK(c.slot_size >= 1000);
  }
  CHECK(live == 100 * 1000);
  CHECK(used == 100);
  CHECK(vmm_get_class_stats(a, nullptr, 4, &n) == VMM_ERROR_INVALID_VALUE);

  // The memory map: the 100 small blocks and the 3 MiB one live, their requested bytes, every
  // block inside its segment; a short buffer gets what fits and the full count.
  REQUIRE(vmm_get_memory_map(a, nullptr, 0, &n) == VMM_SUCCESS);
  REQUIRE(n > 101);
  std::vector<vmm_block_record> map(n);
  REQUIRE(vmm_get_memory_map(a, map.data(), n, &n) == VMM_SUCCESS);
  size_t live_blocks = 0, live_requested = 0, segment_bytes = 0;
  uintptr_t segment = 0;
  for (const auto& r : map) {
    CHECK(r.addr >= r.segment_addr);
    CHECK(r.addr + r.size <= r.segment_addr + r.segment_size);
    if (r.segment_addr != segment) segment_bytes += r.segment_size;
    segment = r.segment_addr;
    if (r.state == VMM_BLOCK_LIVE) {
      ++live_blocks;
      live_requested += r.requested;
    }
    if (r.addr == reinterpret_cast<uintptr_t>(big)) CHECK(r.requested == 3 * MiB);
  }
  CHECK(live_blocks == 101);
  CHECK(live_requested == 100 * 1000 + 3 * MiB);
  CHECK(segment_bytes == s.mapped);
  vmm_block_record few[3];
  size_t total = 0;
  CHECK(vmm_get_memory_map(a, few, 3, &total) == VMM_SUCCESS);
  CHECK(total == n);
  CHECK(few[0].addr == map[0].addr);
  CHECK(vmm_get_memory_map(a, nullptr, 4, &n) == VMM_ERROR_INVALID_VALUE);
  CHECK(vmm_get_memory_map(nullptr, few, 3, &n) == VMM_ERROR_INVALID_VALUE);

  for (void* p : small) vmm_free(a, p);
  vmm_free(a, big);
  REQUIRE(vmm_get_stats(a, &s) == VMM_SUCCESS);
  CHECK(s.peak_mapped >= 3 * MiB);
  CHECK(vmm_trim(a, 0) == VMM_SUCCESS);
  REQUIRE(vmm_get_stats(a, &s) == VMM_SUCCESS);
  CHECK(s.peak_mapped > s.mapped);
  CHECK(vmm_reset_peaks(a) == VMM_SUCCESS);
  REQUIRE(vmm_get_stats(a, &s) == VMM_SUCCESS);
  CHECK(s.peak_mapped == s.mapped);
  CHECK(s.peak_physical == s.physical);
  vmm_destroy(a);
}

TEST_CASE("class_stats counts live slots per class, thread caches apart") {
  auto a = allocator::host(small_reservation());
  std::vector<void*> v;
  for (int i = 0; i < 50; ++i) v.push_back(a.allocate(256));
  for (int i = 0; i < 20; ++i) v.push_back(a.allocate(4000));
  auto cs = a.class_stats();
  std::size_t live256 = 0, live4k = 0;
  for (auto& c : cs) {
    if (c.slot_size == 256) live256 = c.live_bytes;
    if (c.slot_size >= 4000 && c.slot_size < 8192 && c.live_bytes) live4k += c.live_bytes;
  }
  CHECK(live256 == 50 * 256);
  CHECK(live4k == 20 * 4000);
  for (void* p : v) a.deallocate(p);
  std::size_t live = 0;
  for (auto& c : a.class_stats()) live += c.live_bytes;
  CHECK(live == 0);
}

TEST_CASE("span_free sees a freed block between live ones: its bytes, whole pages and size") {
  options o = small_reservation();
  o.thread_cache = false;  // a cached block would sit in the thread cache, not in the free lists
  auto a = allocator::host(o);
  const auto before = a.span_free();
  void* p1 = a.allocate(3 * MiB);
  void* p2 = a.allocate(9 * MiB);
  void* p3 = a.allocate(3 * MiB);
  const auto live = a.span_free();
  a.deallocate(p2);
  const auto s = a.span_free();
  CHECK(s.bytes >= live.bytes + 9 * MiB);
  CHECK(s.largest >= 9 * MiB);
  CHECK(s.largest <= s.bytes);
  CHECK(s.whole_pages >= 3 * 2 * MiB);  // 9 MiB at any 256-byte offset holds >= 3 pages of 2 MiB
  CHECK(s.whole_pages <= s.bytes);
  CHECK(s.blocks >= 1);
  void* p4 = a.allocate(9 * MiB);  // takes the hole back: no new memory, the free bytes shrink
  CHECK(a.span_free().bytes + 9 * MiB <= s.bytes);
  for (void* p : {p1, p3, p4}) a.deallocate(p);
  CHECK(a.span_free().bytes >= before.bytes);
  CHECK(a.check() == "");
}

// ---- IPC export on the host backend (the transport and import are tested in tests/ipc) ----

TEST_CASE("an ipc policy puts every allocation on chunks of its own; export hands out exactly those") {
  options o = small_reservation();
  o.ipc = ipc_kind::posix_fd;
  tuning t;
  t.max_handle = 1;  // the granularity: still one handle an exportable allocation (one export each)
  faulty f(o, {}, t);
  const std::size_t G = f.a.granularity();
  char* p = static_cast<char*>(f.a.allocate(100));
  char* q = static_cast<char*>(f.a.allocate(100));
  char* r = static_cast<char*>(f.a.allocate(G + 1));
  CHECK(f.a.usable_size(p) == G);
  CHECK(f.a.usable_size(r) == 2 * G);
  CHECK(u(q) - u(p) >= G);  // no two allocations in one chunk
  std::memset(p, 0x5a, 100);
  std::memset(q, 0x77, 100);

  auto h = f.a.export_ipc(p);
  CHECK(h.version == ipc::format_version);
  CHECK(h.kind == ipc_kind::posix_fd);
  CHECK(h.size == 100);
  CHECK(h.offset == 0);
  REQUIRE(h.chunks.size() == 1);
  CHECK(h.chunks[0].size == G);
  REQUIRE(h.chunks[0].handle.fd >= 0);
  // What an importer would map: p's bytes, and nothing of q.
  void* m = mmap(nullptr, G, PROT_READ, MAP_SHARED, h.chunks[0].handle.fd, 0);
  REQUIRE(m != MAP_FAILED);
  const auto* bytes = static_cast<const unsigned char*>(m);
  CHECK(bytes[0] == 0x5a);
  CHECK(bytes[99] == 0x5a);
  bool foreign = false;
  for (std::size_t i = 100; i < G; ++i) foreign |= bytes[i] == 0x77;
  CHECK_FALSE(foreign);

  auto hr = f.a.export_ipc(r);
  std::uint64_t total = 0;
  for (auto& c : hr.chunks) {
    total += c.size;
    CHECK(c.handle.fd >= 0);
  }
  CHECK(total == 2 * G);
  CHECK(hr.chunks.size() == 1);
  CHECK(hr.size == G + 1);
  CHECK(f.a.stats().exported == 2);

  // Freeing the exported allocation releases its chunk: the exporter never reuses it, so the
  // importer's view cannot show a later allocation.
  const auto handles_before = f.host().live_handles();
  f.a.deallocate(p);
  CHECK(f.host().live_handles() == handles_before - 1);
  CHECK(f.a.stats().exported_released == 1);
  std::vector<char*> later;
  for (int i = 0; i < 4; ++i) {
    later.push_back(static_cast<char*>(f.a.allocate(100)));
    std::memset(later.back(), 0x33, 100);
  }
  CHECK(bytes[0] == 0x5a);  // the importer's memory still holds the exported bytes
  munmap(m, G);
  for (char* x : later) f.a.deallocate(x);
  f.a.deallocate(q);
  f.a.deallocate(r);
  CHECK(f.a.check() == "");
}

TEST_CASE("export errors: no ipc policy, foreign, interior and freed pointers") {
  auto plain = allocator::host(small_reservation());
  void* p = plain.allocate(1000);
  ipc::export_handle h;
  CHECK(plain.try_export_ipc(p, h).kind == errc::not_supported);
  CHECK(std::string(last_error().message).find("options.ipc") != std::string::npos);
  plain.deallocate(p);

  options o = small_reservation();
  o.ipc = ipc_kind::posix_fd;
  auto a = allocator::host(o);
  char* q = static_cast<char*>(a.allocate(1000));
  CHECK(a.try_export_ipc(q + 256, h).kind == errc::invalid_pointer);
  int local = 0;
  CHECK(a.try_export_ipc(&local, h).kind == errc::invalid_pointer);
  CHECK_THROWS_AS(a.export_ipc(nullptr), vmm::error);
  a.deallocate(q);
  CHECK(a.try_export_ipc(q, h).kind == errc::invalid_pointer);
  CHECK(h.chunks.empty());
  CHECK(a.check() == "");
}

TEST_CASE("export failure part-way closes what was exported and leaves the allocation usable") {
  options o = small_reservation();
  o.ipc = ipc_kind::posix_fd;
  faulty f(o);
  const std::size_t G = f.a.granularity();
  // Two idle handles of G each make a 2G allocation out of two chunks.
  void* x = f.a.allocate(G);
  void* y = f.a.allocate(G);
  f.a.deallocate(x);
  f.a.deallocate(y);
  char* p = static_cast<char*>(f.a.allocate(2 * G));
  f.st->arm(test::op::export_handle, 2, test::fault::out_of_memory);
  ipc::export_handle h;
  status st = f.a.try_export_ipc(p, h);
  f.st->disarm();
  auto full = f.a.export_ipc(p);
  if (full.chunks.size() > 1) {
    CHECK(st.kind == errc::out_of_memory);
    CHECK(h.chunks.empty());
  }
  std::memset(p, 1, 2 * G);
  f.a.deallocate(p);
  CHECK(f.a.check() == "");
}

TEST_CASE("fabric falls back to POSIX fds where the device lacks it or the driver refuses, counted") {
  options o = small_reservation();
  o.ipc = ipc_kind::fabric;
  {
    auto a = allocator::host(o);  // host backend without fabric support
    void* p = a.allocate(1000);
    auto h = a.export_ipc(p);
    CHECK(h.kind == ipc_kind::posix_fd);
    CHECK(a.stats().ipc_fallbacks == 1);
    a.deallocate(p);
  }
  {
    host_backend_options hb;
    hb.fabric_supported = true;
    faulty f(o, hb);
    // The driver refuses fabric handles without an IMEX channel: CUDA_ERROR_NOT_PERMITTED.
    f.st->arm(test::op::create, 1, test::fault::not_permitted);
    void* p = f.a.allocate(1000);
    f.st->disarm();
    CHECK(f.a.stats().ipc_fallbacks == 1);
    auto h = f.a.export_ipc(p);
    CHECK(h.kind == ipc_kind::posix_fd);
    CHECK(h.chunks.at(0).handle.fd >= 0);
    f.a.deallocate(p);
  }
  {
    host_backend_options hb;
    hb.fabric_supported = true;
    auto a = allocator::host(o, hb);  // fabric granted: no fallback
    void* p = a.allocate(1000);
    CHECK(a.stats().ipc_fallbacks == 0);
    CHECK(a.export_ipc(p).chunks.size() == 1);
    a.deallocate(p);
  }
}

// ---- trace recording ----

namespace {
struct event {
  char kind;
  std::uintptr_t addr;
  std::size_t size;
  unsigned stream;
  unsigned thread;
  std::uint64_t time;
};
// A v2 trace as the library writes it: the header, then six fields a line.
std::vector<event> read_trace(const std::string& path) {
  std::ifstream in(path);
  std::vector<event> v;
  std::string line;
  REQUIRE(std::getline(in, line));
  REQUIRE_MESSAGE(line.rfind("# vmmalloc-trace v2", 0) == 0, "first line: " << line);
  while (std::getline(in, line)) {
    std::istringstream ss(line);
    event e{};
    std::string addr, rest;
    ss >> e.kind >> addr >> e.size >> e.stream >> e.thread >> e.time;
    REQUIRE_MESSAGE(!ss.fail(), "bad trace line: " << line);
    REQUIRE_MESSAGE(!(ss >> rest), "extra field in: " << line);
    e.addr = std::stoull(addr, nullptr, 16);
    v.push_back(e);
  }
  return v;
}
}  // namespace

TEST_CASE("trace recording writes every allocation and free as trace v2, in order, time never decreasing") {
  char tmpl[] = "/tmp/vmm-trace-XXXXXX";
  int fd = mkstemp(tmpl);
  REQUIRE(fd >= 0);
  close(fd);
  const std::string path = tmpl;
  int stream_tag = 0;
  std::uint64_t allocs = 0, frees = 0, traced = 0;
  {
    options o;
    o.reservation_size = std::size_t{8} << 30;  // 2 threads x 50 live x up to 3 MB, fragmented
    o.trace_path = path;
    auto a = allocator::host(o);
    std::atomic<int> thread_errors{0};
    auto work = [&](unsigned seed) {
      try {
        std::vector<std::pair<void*, stream_t>> live;
        for (unsigned i = 0; i < 50000; ++i) {  // ~3.5 MB of trace: crosses the 1 MiB buffer
          unsigned r = (seed * 2654435761u + i * 40503u) >> 7;
          stream_t s = (r & 4) ? static_cast<stream_t>(&stream_tag) : nullptr;
          if (live.size() < 50 && (r & 1)) {
            std::size_t n = (r & 8) ? 1 + r % 60000 : 100000 + r % 3000000;
            live.emplace_back(a.allocate(n, 0, s), s);
          } else if (!live.empty()) {
            auto [p, ls] = live.back();
            live.pop_back();
            a.deallocate(p, ls);
          }
        }
        for (auto [p, ls] : live) a.deallocate(p, ls);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "trace test thread: %s\n", e.what());
        ++thread_errors;
      }
    };
    // The main thread allocates first: it is thread 1, the workers 2 and 3.
    void* first = a.allocate(64);
    std::thread t1(work, 1), t2(work, 2);
    t1.join();
    t2.join();
    a.deallocate(first);
    REQUIRE(thread_errors == 0);
    auto s = a.stats();
    allocs = s.allocs;
    frees = s.frees;
    traced = s.traced_events;
  }  // destruction flushes the buffer
  auto ev = read_trace(path);
  CHECK(ev.size() == allocs + frees);
  CHECK(traced == allocs + frees);
  CHECK(ev.size() > 80000);  // several buffer flushes happened
  REQUIRE(ev.size() >= 2);
  CHECK((ev.front().kind == 'a' && ev.front().size == 64 && ev.front().thread == 1));
  CHECK((ev.back().kind == 'f' && ev.back().size == 64 && ev.back().thread == 1));
  std::map<std::uintptr_t, std::size_t> live;
  std::set<unsigned> streams, threads;
  std::map<unsigned, std::uint64_t> per_thread;
  bool order_ok = true, size_ok = true, time_ok = true;
  std::uint64_t prev_time = 0;
  for (auto& e : ev) {
    streams.insert(e.stream);
    threads.insert(e.thread);
    ++per_thread[e.thread];
    time_ok &= e.time >= prev_time;  // line order is time order, across threads
    prev_time = e.time;
    if (e.kind == 'a') {
      order_ok &= live.emplace(e.addr, e.size).second;  // never allocated twice while live
    } else {
      auto it = live.find(e.addr);
      order_ok &= it != live.end();  // freed after its allocation
      if (it != live.end()) size_ok &= it->second == e.size, live.erase(it);
    }
  }
  CHECK(order_ok);
  CHECK(size_ok);
  CHECK(time_ok);
  CHECK(prev_time > 0);
  CHECK(live.empty());
  CHECK(streams == std::set<unsigned>{0, 1});
  CHECK(threads == std::set<unsigned>{1, 2, 3});
  CHECK(per_thread[1] == 2);
  CHECK(per_thread[2] + per_thread[3] == ev.size() - 2);
  std::remove(path.c_str());
}

TEST_CASE("trace recording to a path that cannot be opened is a clear error") {
  options o = small_reservation();
  o.trace_path = "/nonexistent-dir/trace.txt";
  try {
    auto a = allocator::host(o);
    FAIL("no error");
  } catch (const vmm::error& e) {
    CHECK(std::string(e.what()).find("/nonexistent-dir/trace.txt") != std::string::npos);
    CHECK(std::string(e.what()).find("No such file") != std::string::npos);
  }
}
