// SPDX-License-Identifier: Apache-2.0
// Threaded replay of v2 traces and the host-backend lag (tools/replay/replay_pass.hpp), on the
// host backend: events run in the recorded order on the recorded threads, blocks freed by another
// thread than the one that allocated them replay cleanly, and --lag holds stream-ordered reuse back.
#include <doctest/doctest.h>

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "peers.hpp"
#include "replay_pass.hpp"
#include "trace.hpp"
#include "vmmalloc/vmmalloc.hpp"

using namespace vmm::replay;

namespace {

// A v2 trace of `events` events over `threads` threads and `streams` streams: runs of 1-8 events
// per thread, and every free made by a random thread, so most frees cross threads. Sizes are the
// event's index + 1 when `unique_sizes` (a spy peer can then tell events apart), else random.
std::string make_v2(int threads, int streams, int events, unsigned seed, bool unique_sizes) {
  std::mt19937 rng(seed);
  std::string out = "# vmmalloc-trace v2\n";
  std::vector<std::pair<unsigned, std::uint64_t>> live;  // name, size
  unsigned next_name = 0x1000;
  int th = 0, run = 0;
  for (int i = 0; i < events; ++i) {
    if (run-- <= 0) {
      th = int(rng() % unsigned(threads));
      run = int(rng() % 8);
    }
    const int st = int(rng() % unsigned(streams));
    const bool alloc = live.empty() || (live.size() < 64 && rng() % 2);
    std::uint64_t size = unique_sizes ? std::uint64_t(i + 1) : std::uint64_t(1) << (rng() % 22);
    unsigned name;
    if (alloc) {
      name = next_name++;
      live.push_back({name, size});
    } else {
      auto k = rng() % live.size();
      name = live[k].first;
      size = live[k].second;
      live[k] = live.back();
      live.pop_back();
    }
    char line[128];
    std::snprintf(line, sizeof line, "%c %x %llu %d %d %d\n", alloc ? 'a' : 'f', name, (unsigned long long)size,
                  st, 100 + th, i * 10);
    out += line;
  }
  return out;
}

// Records each call (kind and size: with unique allocation sizes that names the event, a free
// repeating its allocation's size) and which OS thread made it.
class spy_peer final : public peer {
 public:
  std::string name() const override { return "spy"; }
  void* allocate(std::size_t n, void*) noexcept override {
    note(op::alloc, n);
    return reinterpret_cast<void*>(std::uintptr_t{1} << 40 | n << 8);
  }
  bool deallocate(void* p, std::size_t n, void*) noexcept override {
    note(op::free, n);
    return p != nullptr;
  }
  memory_report report() override { return {}; }
  std::vector<std::pair<op, std::size_t>> calls;  // in call order
  std::vector<std::thread::id> caller;            // the thread of each call

 private:
  void note(op k, std::size_t n) {
    // The turn hand-off orders these calls already; the lock only keeps a broken hand-off from
    // corrupting the vectors, so the test reports the wrong order instead of crashing.
    std::lock_guard g(mu_);
    calls.push_back({k, n});
    caller.push_back(std::this_thread::get_id());
  }
  std::mutex mu_;
};

const std::vector<void*> kOneStream{nullptr};

// One pass of t through p on the recorded threads of s, one stream; the blocks land in ptr.
pass_result replay_threaded(peer& p, const trace& t, const schedule& s, std::vector<void*>& ptr) {
  ptr.assign(t.slots, nullptr);
  pass_opts o;
  o.sched = &s;
  return run_pass(p, t, kOneStream, ptr, o);
}

std::vector<void*> host_streams(const trace& t) {
  std::vector<void*> s(t.stream_ids.size(), nullptr);
  for (std::size_t k = 0; k < s.size(); ++k)
    if (t.stream_ids[k] != 0) s[k] = reinterpret_cast<void*>(std::uintptr_t{0x1000} + k);
  return s;
}

}  // namespace

TEST_CASE("schedule: one thread per recorded thread, events in order, hand-offs counted") {
  trace t = parse_text("# vmmalloc-trace v2\na 1 8 0 7 0\na 2 8 0 7 1\nf 1 8 0 9 2\nf 2 8 0 7 3\n");
  schedule s = make_schedule(t, true);
  CHECK(s.threads == 2);
  CHECK(s.events_of[0] == std::vector<std::uint32_t>{0, 1, 3});
  CHECK(s.events_of[1] == std::vector<std::uint32_t>{2});
  CHECK(s.handoffs == 2);
  schedule one = make_schedule(t, false);
  CHECK(one.threads == 1);
  CHECK(one.events_of.empty());
  CHECK(make_schedule(parse_text("a 1 8 0\nf 1 8 0\n"), true).threads == 1);  // v1: one thread
}

TEST_CASE("threaded replay performs every event in the recorded order, each on its recorded thread") {
  for (unsigned seed = 1; seed <= 20; ++seed) {
    trace t = parse_text(make_v2(4, 1, 3000, seed, true));
    REQUIRE(t.thread_ids.size() == 4);
    schedule s = make_schedule(t, true);
    REQUIRE(s.threads == 4);
    REQUIRE(s.handoffs > 100);
    spy_peer spy;
    std::vector<void*> ptr;
    pass_result r = replay_threaded(spy, t, s, ptr);
    REQUIRE(r.exit_code == 0);
    REQUIRE(spy.calls.size() == t.events.size());
    std::size_t out_of_order = 0, wrong_thread = 0;
    std::map<std::thread::id, std::uint16_t> thread_of;  // OS thread -> recorded thread, first call decides
    for (std::size_t i = 0; i < spy.calls.size(); ++i) {
      out_of_order += spy.calls[i] != std::pair(t.events[i].kind, std::size_t(t.events[i].size));
      auto [it, fresh] = thread_of.try_emplace(spy.caller[i], t.thread[i]);
      wrong_thread += it->second != t.thread[i];
    }
    CHECK(out_of_order == 0);
    CHECK(wrong_thread == 0);
    CHECK(thread_of.size() == 4);  // four distinct OS threads did the work
    CHECK(thread_of.count(std::this_thread::get_id()) == 0);
  }
}

TEST_CASE("vmmalloc: blocks freed by another thread replay without errors, many times") {
  for (unsigned seed = 1; seed <= 25; ++seed) {
    trace t = parse_text(make_v2(3, 2, 4000, seed, false));
    REQUIRE(t.cross_thread_frees > 500);
    schedule s = make_schedule(t, true);
    auto a = make_vmmalloc_host(std::size_t{16} << 30);
    auto streams = host_streams(t);
    std::vector<void*> ptr(t.slots);
    pass_opts o;
    o.sched = &s;
    o.check_every = 500;  // check() and requested bytes against the trace, mid-run
    pass_result r = run_pass(*a, t, streams, ptr, o);
    INFO("seed ", seed, ": ", r.failure);
    REQUIRE(r.exit_code == 0);
    CHECK(r.checks == 8);
    CHECK(a->live_requested() == t.live_after.back());
    for (const auto& b : t.live_at_end) REQUIRE(a->deallocate(ptr[b.id], b.size, streams[b.stream]));
    CHECK(a->check() == "");
    CHECK(a->live_requested() == 0);
  }
}

// Counts the calls made, and at each replay thread's exit how many had been made by then.
class exit_spy final : public peer {
 public:
  std::string name() const override { return "exit spy"; }
  void* allocate(std::size_t n, void*) noexcept override {
    if (n == slow_size) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    count();
    return reinterpret_cast<void*>(std::uintptr_t{1} << 40 | n << 8);
  }
  bool deallocate(void* p, std::size_t, void*) noexcept override {
    count();
    return p != nullptr;
  }
  memory_report report() override { return {}; }
  std::size_t slow_size = 0;
  std::atomic<std::size_t> calls{0};
  std::mutex mu;
  std::vector<std::size_t> calls_at_exit;  // one entry per thread that called

 private:
  // A thread-local object whose destructor runs at the thread's exit, as a thread cache's does.
  struct at_exit {
    exit_spy* spy = nullptr;
    ~at_exit() {
      if (!spy) return;
      std::lock_guard g(spy->mu);
      spy->calls_at_exit.push_back(spy->calls.load());
    }
  };
  void count() {
    thread_local at_exit x;
    x.spy = this;
    calls.fetch_add(1);
  }
};

TEST_CASE("a replay thread whose events are done stays until the pass ends") {
  // Thread 8's events end at event 2; thread 7's last event is slow. A thread that left at once
  // would run its exit (vmmalloc: its thread cache going back) during that event, at a point the
  // scheduler picks, and replays of one trace would differ.
  trace t = parse_text("# vmmalloc-trace v2\na 1 8 0 7 0\na 2 8 0 8 1\nf 2 8 0 8 2\na 3 64 0 7 3\nf 1 8 0 7 4\n");
  schedule s = make_schedule(t, true);
  REQUIRE(s.threads == 2);
  exit_spy spy;
  spy.slow_size = 64;
  std::vector<void*> ptr;
  pass_result r = replay_threaded(spy, t, s, ptr);
  REQUIRE(r.exit_code == 0);
  CHECK(spy.calls.load() == t.events.size());
  REQUIRE(spy.calls_at_exit.size() == 2);
  for (std::size_t c : spy.calls_at_exit) CHECK(c == t.events.size());
}

TEST_CASE("a failure on one replay thread stops every thread and names the event") {
  // vmmalloc refuses size 0: event 3 (thread 8) fails; the others must not hang.
  trace t = parse_text(
      "# vmmalloc-trace v2\na 1 8 0 7 0\na 2 8 0 8 1\na 3 8 0 9 2\na 4 0 0 8 3\nf 1 8 0 9 4\nf 2 8 0 7 5\n");
  schedule s = make_schedule(t, true);
  auto a = make_vmmalloc_host(std::size_t{1} << 30);
  std::vector<void*> ptr;
  pass_result r = replay_threaded(*a, t, s, ptr);
  CHECK(r.exit_code == 3);
  CHECK(r.failure.find("allocation failed at event 3 (line 5: a 4 0 0 8 3") == 0);
  for (int k = 0; k < 3; ++k) CHECK(a->deallocate(ptr[t.events[k].id], 8, nullptr));
}

TEST_CASE("host lag: held streams delay cross-stream reuse; the run completes and reports") {
  // 64 rounds of: allocate 8 MiB on stream 1, free it there, allocate 8 MiB on stream 2, free it
  // there. Without a lag the freed block is reused across streams at once (its fence is done);
  // with one, the fence stays pending until the next tick, so the allocator must map more.
  std::string text = "# vmmalloc-trace v2\n";
  for (int k = 0; k < 64; ++k) {
    text += "a 10 8388608 1 1 " + std::to_string(4 * k) + "\n";
    text += "f 10 8388608 1 1 " + std::to_string(4 * k + 1) + "\n";
    text += "a 20 8388608 2 1 " + std::to_string(4 * k + 2) + "\n";
    text += "f 20 8388608 2 1 " + std::to_string(4 * k + 3) + "\n";
  }
  trace t = parse_text(text);
  auto streams = host_streams(t);
  auto replay = [&](std::uint64_t lag_events, std::uint64_t& ticks) {
    auto a = make_vmmalloc_host(std::size_t{16} << 30);
    REQUIRE(a->host_backend() != nullptr);
    std::unique_ptr<gpu_lag> lag;
    if (lag_events) lag = make_host_lag(*a->host_backend(), streams, lag_events);
    std::vector<void*> ptr(t.slots);
    pass_opts o;
    o.lag = lag.get();
    o.check_every = 32;
    pass_result r = run_pass(*a, t, streams, ptr, o);
    INFO(r.failure);
    REQUIRE(r.exit_code == 0);
    CHECK(r.checks == 8);
    ticks = lag ? lag->actions : 0;
    CHECK(a->check() == "");
    CHECK(a->live_requested() == 0);
    a->release_cached();  // trim waits on no held fence: lag->end() let the streams catch up
    return *a->report().peak_mapped;
  };
  std::uint64_t ticks0 = 0, ticks = 0;
  const std::uint64_t plain = replay(0, ticks0);
  const std::uint64_t lagged = replay(64, ticks);
  CHECK(ticks == 3);  // at events 64, 128, 192
  MESSAGE("peak mapped: " << plain / 1048576 << " MiB without lag, " << lagged / 1048576 << " MiB with --lag 64");
  CHECK(lagged > plain);

  // The same with the recorded threads: alternate rounds on two threads.
  std::string two = "# vmmalloc-trace v2\n";
  for (int k = 0; k < 64; ++k)
    for (int j = 0; j < 4; ++j) {
      static const char* ops[] = {"a 10 8388608 1", "f 10 8388608 1", "a 20 8388608 2", "f 20 8388608 2"};
      two += std::string(ops[j]) + " " + std::to_string(1 + (k + j / 2) % 2) + " " + std::to_string(4 * k + j) + "\n";
    }
  trace u = parse_text(two);
  schedule s = make_schedule(u, true);
  REQUIRE(s.threads == 2);
  auto a = make_vmmalloc_host(std::size_t{16} << 30);
  auto lag = make_host_lag(*a->host_backend(), host_streams(u), 16);
  std::vector<void*> ptr(u.slots);
  pass_opts o;
  o.sched = &s;
  o.lag = lag.get();
  auto us = host_streams(u);
  pass_result r = run_pass(*a, u, us, ptr, o);
  CHECK(r.exit_code == 0);
  CHECK(lag->actions == 15);
  CHECK(a->live_requested() == 0);
}

TEST_CASE("a trace the library records (v2) parses and replays on its recorded threads") {
  char tmpl[] = "/tmp/vmm-recorded-XXXXXX";
  int fd = mkstemp(tmpl);
  REQUIRE(fd >= 0);
  close(fd);
  const std::string path = tmpl;
  int tag = 0;
  {
    vmm::options o;
    o.reservation_size = std::size_t{4} << 30;
    o.trace_path = path;
    auto a = vmm::allocator::host(o);
    // Three threads hand blocks to each other through a shared list: many frees cross threads.
    // They take turns of 8 operations (whatever the scheduler does), so the list mixes all three.
    std::mutex mu;
    std::vector<std::pair<void*, vmm::stream_t>> shared;
    std::atomic<int> turn{0};
    auto work = [&](unsigned id) {
      std::mt19937 rng(id + 1);
      for (int round = 0; round < 375; ++round) {
        while (turn.load() % 3 != static_cast<int>(id)) std::this_thread::yield();
        for (int i = 0; i < 8; ++i) {
          vmm::stream_t s = rng() % 3 == 0 ? static_cast<vmm::stream_t>(&tag) : nullptr;
          std::lock_guard g(mu);  // the list, not the allocator: it is thread-safe
          if (shared.size() < 40 && rng() % 2) {
            shared.emplace_back(a.allocate(std::size_t{1} << (rng() % 22), 0, s), s);
          } else if (!shared.empty()) {
            auto k = rng() % shared.size();
            a.deallocate(shared[k].first, shared[k].second);
            shared[k] = shared.back();
            shared.pop_back();
          }
        }
        turn.fetch_add(1);
      }
    };
    std::thread t1(work, 0), t2(work, 1), t3(work, 2);
    t1.join(), t2.join(), t3.join();
    // The main thread is a fourth recorded thread: it frees what is left (the list may be empty
    // by chance) and one block of its own.
    shared.emplace_back(a.allocate(4096), nullptr);
    for (auto [p, s] : shared) a.deallocate(p, s);
    a.trim(3 << 20);  // recorded with what it keeps
  }
  trace t = parse_file(path);
  std::remove(path.c_str());
  CHECK(t.version == 2);
  CHECK(t.thread_ids.size() == 4);
  CHECK(t.stream_ids.size() == 2);
  CHECK(t.events.size() > 5000);
  MESSAGE("recorded " << t.events.size() << " events, " << t.cross_thread_frees << " frees across threads");
  CHECK(t.cross_thread_frees > 200);
  CHECK(t.live_at_end.empty());
  CHECK(t.trims == 1);
  CHECK(t.events.back().kind == op::trim);
  CHECK(t.events.back().size == std::size_t{3} << 20);
  REQUIRE(t.time_ns.size() == t.events.size());
  CHECK(t.time_ns.back() > t.time_ns.front());
  schedule s = make_schedule(t, true);
  REQUIRE(s.threads == 4);
  auto b = make_vmmalloc_host(std::size_t{16} << 30);
  auto streams = host_streams(t);
  std::vector<void*> ptr(t.slots);
  pass_opts po;
  po.sched = &s;
  po.check_every = 1000;
  pass_result r = run_pass(*b, t, streams, ptr, po);
  INFO(r.failure);
  CHECK(r.exit_code == 0);
  CHECK(b->live_requested() == 0);
  CHECK(b->check() == "");
}

TEST_CASE("a trim event gives the free memory back where the program trimmed, after the held streams ran") {
  // 64 MiB allocated and freed on a stream the lag holds (it never ticks in 4 events): the trim
  // must let that stream's work complete first, or it could neither unmap the block nor return.
  const std::string text =
      "# vmmalloc-trace v2\na 10 67108864 1 1 0\nf 10 67108864 1 1 1\nt 0 0 0 1 2\na 20 4096 1 1 3\n";
  trace t = parse_text(text);
  REQUIRE(t.trims == 1);
  auto streams = host_streams(t);
  auto a = make_vmmalloc_host(std::size_t{16} << 30);
  auto lag = make_host_lag(*a->host_backend(), streams, 1000);
  std::uint64_t mapped_after_trim = ~0ull;
  std::vector<void*> ptr(t.slots);
  pass_opts o;
  o.lag = lag.get();
  o.after_event = [&](std::size_t i) -> std::string {
    if (t.events[i].kind == op::trim) mapped_after_trim = a->current().mapped.value_or(~0ull);
    return "";
  };
  pass_result r = run_pass(*a, t, streams, ptr, o);
  INFO(r.failure);
  REQUIRE(r.exit_code == 0);
  CHECK(mapped_after_trim == 0);
  CHECK(*a->report().peak_mapped >= std::uint64_t{64} << 20);
  REQUIRE(a->deallocate(ptr[t.events[3].id], 4096, streams[t.events[3].stream]));
  CHECK(a->check() == "");
}
