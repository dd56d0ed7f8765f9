// SPDX-License-Identifier: Apache-2.0
// One replay pass of a parsed trace through one peer: the loop vmm-replay times, shared by its
// warm-up, timed and sampling passes (and tests/replay/test_threaded_replay.cpp).
//
// Threads: with a schedule of several threads (a v2 trace), one std::thread per recorded thread
// performs that thread's events, and event i starts only after event i-1 has returned, whatever
// thread did it. The hand-off is a per-thread turn word: the thread that finishes event i-1 stores
// i into the next owner's word (release) and wakes it if it sleeps (std::atomic::notify_one); the
// owner polls its word with sched_yield in between, then sleeps in std::atomic::wait (futex).
// Consecutive events of one thread cost no atomic operation at all; a change of thread costs
// ~0.4 us on an idle 16-core host, ~2 us on a loaded 2-core one (tools/replay/README.md). Everything shared (the result, the stop bookkeeping, the peer itself
// when it is not thread-safe) is only touched by the thread holding the turn, ordered by those
// release/acquire pairs, so nothing else is locked.
//
// Lag (--lag N): a gpu_lag keeps each stream's work N events behind the CPU, acting with the turn
// held, outside the measured time.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "peers.hpp"
#include "trace.hpp"

namespace vmm {
class host_backend;
}

namespace vmm::replay {

using clk = std::chrono::steady_clock;

// ---- the GPU running behind the CPU ------------------------------------------------------------

class gpu_lag {
 public:
  explicit gpu_lag(std::size_t streams) : due_(streams, kNever) {}
  virtual ~gpu_lag() = default;
  gpu_lag(const gpu_lag&) = delete;
  gpu_lag& operator=(const gpu_lag&) = delete;

  // Before the first event of a pass / after the last (every stream catches up, so synchronize,
  // frees and trim never wait on held work). false + why on failure.
  virtual bool begin(std::string& why) = 0;
  virtual bool end(std::string& why) = 0;
  virtual std::string describe() const = 0;
  virtual std::uint64_t timeouts() const { return 0; }  // CUDA gates that opened by their timeout
  // At event i: the work queued on every stream so far completes, and what the allocator queues
  // until resume() runs at once (a trim waits for both).
  virtual void catch_up(std::size_t i) = 0;
  virtual void resume() {}

  // Every event, in order, with the turn held; two compares unless something is due.
  void before_event(std::size_t i, std::uint16_t stream) {
    if (i >= due_all_ || i >= due_[stream]) [[unlikely]] {
      auto t0 = clk::now();
      act(i, stream);
      seconds += std::chrono::duration<double>(clk::now() - t0).count();
    }
  }

  double seconds = 0;         // spent acting: excluded from the timed pass
  std::uint64_t actions = 0;  // host: ticks; CUDA: gate kernels launched

 protected:
  static constexpr std::size_t kNever = ~std::size_t{0};
  virtual void act(std::size_t i, std::uint16_t stream) = 0;
  std::size_t due_all_ = kNever;    // next event at which act() runs, whatever the stream
  std::vector<std::size_t> due_;    // per stream: next event on that stream at which act() runs
};

// Host backend: every stream is held (host_backend::hold_stream), and every N events each one is
// completed and held again (complete_stream). A fence recorded on a stream therefore completes at
// the next multiple of N: between 1 and N events later, N/2 on average (the test controls complete
// a stream's fences all at once, so finer is not possible through them).
std::unique_ptr<gpu_lag> make_host_lag(vmm::host_backend& hb, std::vector<void*> streams, std::uint64_t n);

// CUDA: at the first event on a stream in each window of G = max(1, N/8) events, a gate kernel is
// enqueued on that stream before the event's own call; it spins (one thread, __nanosleep) until the
// host's event counter, in mapped pinned memory, reaches its event + N. Work and fences queued
// after it complete between N-G and N events later. The counter is stored every max(1, N/32)
// events. A gate also opens after 2 s, counted in timeouts(): a CPU thread that waits for the GPU
// (cudaFree's implicit synchronize, an allocator waiting on a fence) would otherwise deadlock.
bool have_cuda_lag();  // built with nvcc
std::unique_ptr<gpu_lag> make_cuda_lag(std::vector<void*> streams, std::uint64_t n);

// ---- schedule: which thread performs which events ----------------------------------------------

struct schedule {
  std::size_t threads = 1;                            // replay threads
  std::vector<std::vector<std::uint32_t>> events_of;  // threads > 1: event indices of each thread, in order
  std::uint64_t handoffs = 0;                         // events whose thread differs from the previous one's
};
// One thread per recorded thread when `threaded` and the trace has several; else one.
schedule make_schedule(const trace& t, bool threaded);

// ---- one pass ----------------------------------------------------------------------------------

struct pass_opts {
  std::uint64_t check_every = 0;       // peer check() + live bytes every N events (untimed)
  bool progress = false;               // stderr progress line
  bool sample = false;                 // peer::sample() at stops (untimed)
  std::uint64_t sample_every = 16384;  // ~80 samples for 1.3 M events; each is a few us
  const char* label = "";
  const schedule* sched = nullptr;     // nullptr: one thread
  gpu_lag* lag = nullptr;              // nullptr: streams idle (run synchronously)
  // After every event (untimed passes only: it is a std::function call per event). Returns "" or
  // why the pass fails (exit 4).
  std::function<std::string(std::size_t)> after_event;
};

struct pass_result {
  int exit_code = 0;  // 0 ok, 3 alloc/free failure, 4 check failure, 1 lag setup failure
  std::string failure;
  double seconds = 0, paused = 0;  // seconds: measured, pauses (stops, lag actions) subtracted
  std::uint64_t checks = 0;
};

// Replays every event of t through a, ptr[slot] holding the blocks (ptr.size() >= t.slots).
// Blocks the trace leaves live stay allocated. Ends with lag->end() and a.synchronize().
pass_result run_pass(peer& a, const trace& t, const std::vector<void*>& streams, std::vector<void*>& ptr,
                     const pass_opts& o);

// "line L: a ADDR SIZE STREAM[ THREAD TIME]" as written in the trace.
std::string event_text(const trace& t, std::size_t i);
std::string mib(double bytes);

}  // namespace vmm::replay
