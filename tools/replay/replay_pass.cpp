// SPDX-License-Identifier: Apache-2.0
#include "replay_pass.hpp"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cinttypes>
#include <cstdio>
#include <thread>

#include "vmmalloc/host_backend.hpp"

#ifdef VMM_REPLAY_CUDA_LAG
#include <cuda_runtime_api.h>

#include "cuda_lag.hpp"
#endif

namespace vmm::replay {

std::string mib(double b) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.1f MiB", b / (1 << 20));
  return buf;
}

std::string event_text(const trace& t, std::size_t i) {
  const event& e = t.events[i];
  char buf[200];
  int k = std::snprintf(buf, sizeof buf, "line %" PRIu32 ": %c %" PRIx64 " %" PRIu64 " %" PRIu64, t.lines[i],
                        "aft"[static_cast<int>(e.kind)], t.names[i], e.size, t.stream_ids[e.stream]);
  if (!t.time_ns.empty() && k > 0 && std::size_t(k) < sizeof buf)
    std::snprintf(buf + k, sizeof buf - std::size_t(k), " %" PRIu64 " %" PRIu64, t.thread_ids[t.thread[i]],
                  t.time_ns[i]);
  return buf;
}

// ---- lag: host backend -------------------------------------------------------------------------

namespace {
class host_lag final : public gpu_lag {
 public:
  host_lag(vmm::host_backend& hb, std::vector<void*> streams, std::uint64_t n)
      : gpu_lag(streams.size()), hb_(hb), streams_(std::move(streams)), n_(n) {}
  bool begin(std::string&) override {
    for (void* s : streams_) hb_.hold_stream(s);
    due_all_ = n_;
    return true;
  }
  bool end(std::string&) override {
    for (void* s : streams_) hb_.complete_stream(s);  // also releases the hold
    due_all_ = kNever;
    return true;
  }
  void catch_up(std::size_t) override {
    for (void* s : streams_) hb_.complete_stream(s);  // also releases the hold
  }
  void resume() override {
    for (void* s : streams_) hb_.hold_stream(s);
  }
  std::string describe() const override {
    return "host backend: streams held, completed every " + std::to_string(n_) + " events (a fence waits 1.." +
           std::to_string(n_) + " events)";
  }

 protected:
  void act(std::size_t i, std::uint16_t) override {
    for (void* s : streams_) {
      hb_.complete_stream(s);
      hb_.hold_stream(s);
    }
    ++actions;
    due_all_ = (i / n_ + 1) * n_;
  }

 private:
  vmm::host_backend& hb_;
  std::vector<void*> streams_;
  std::uint64_t n_;
};
}  // namespace

std::unique_ptr<gpu_lag> make_host_lag(vmm::host_backend& hb, std::vector<void*> streams, std::uint64_t n) {
  if (n == 0) throw std::invalid_argument("make_host_lag: lag of 0 events");
  return std::make_unique<host_lag>(hb, std::move(streams), n);
}

// ---- lag: CUDA gate kernels --------------------------------------------------------------------

#ifdef VMM_REPLAY_CUDA_LAG
namespace {
std::string cuda_text(cudaError_t e, const char* call) {
  (void)cudaGetLastError();
  return std::string(call) + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")";
}

class cuda_lag final : public gpu_lag {
 public:
  cuda_lag(std::vector<void*> streams, std::uint64_t n)
      : gpu_lag(streams.size()), streams_(std::move(streams)), n_(n), g_(std::max<std::uint64_t>(1, n / 8)),
        store_every_(std::max<std::uint64_t>(1, n / 32)) {
    cudaError_t e = cudaHostAlloc(reinterpret_cast<void**>(&counter_), sizeof *counter_, cudaHostAllocMapped);
    if (e != cudaSuccess) throw std::runtime_error(cuda_text(e, "cudaHostAlloc"));
    *counter_ = 0;
    e = cudaHostGetDevicePointer(reinterpret_cast<void**>(&dev_counter_), counter_, 0);
    if (e == cudaSuccess) e = cudaMalloc(reinterpret_cast<void**>(&timeouts_), sizeof *timeouts_);
    if (e == cudaSuccess) e = cudaMemset(timeouts_, 0, sizeof *timeouts_);
    if (e != cudaSuccess) {
      std::string m = cuda_text(e, "cudaHostGetDevicePointer/cudaMalloc");
      release();
      throw std::runtime_error(m);
    }
  }
  ~cuda_lag() override { release(); }

  bool begin(std::string& why) override {
    floor_ = 0;
    store(0);
    std::fill(due_.begin(), due_.end(), 0);  // the first event on each stream enqueues a gate
    due_all_ = store_every_;
    if (!failure_.empty()) why = failure_;
    return failure_.empty();
  }
  bool end(std::string& why) override {
    store(~std::uint64_t{0});  // every gate opens
    due_all_ = kNever;
    std::fill(due_.begin(), due_.end(), kNever);
    if (!failure_.empty()) why = failure_;
    return failure_.empty();
  }
  // Opens every gate launched up to event i (their thresholds are at most i + n); the counter
  // never goes below that again, so none of them closes.
  void catch_up(std::size_t i) override {
    floor_ = i + n_;
    store(floor_);
  }
  std::string describe() const override {
    return "CUDA: gate kernel per stream every " + std::to_string(g_) + " events, open at event + " +
           std::to_string(n_) + " (a fence waits " + std::to_string(n_ - g_ + 1) + ".." + std::to_string(n_) +
           " events)";
  }
  std::uint64_t timeouts() const override {
    unsigned long long v = 0;
    if (timeouts_ && cudaMemcpy(&v, timeouts_, sizeof v, cudaMemcpyDeviceToHost) != cudaSuccess) (void)cudaGetLastError();
    return v;
  }

 protected:
  void act(std::size_t i, std::uint16_t s) override {
    if (i >= due_all_) {
      store(i);
      due_all_ = (i / store_every_ + 1) * store_every_;
    }
    if (i >= due_[s]) {
      cudaError_t e = vmm_replay_launch_gate(streams_[s], dev_counter_, i + n_, kTimeoutNs, timeouts_);
      if (e != cudaSuccess && failure_.empty()) failure_ = cuda_text(e, "gate kernel launch");
      ++actions;
      due_[s] = i + g_;
    }
  }

 private:
  static constexpr unsigned long long kTimeoutNs = 2'000'000'000ull;
  void store(std::uint64_t v) { __atomic_store_n(counter_, std::max<std::uint64_t>(v, floor_), __ATOMIC_RELEASE); }
  void release() noexcept {
    if (counter_) cudaFreeHost(counter_);
    if (timeouts_) cudaFree(timeouts_);
    counter_ = nullptr;
    timeouts_ = nullptr;
  }
  std::vector<void*> streams_;
  std::uint64_t n_, g_, store_every_;
  std::uint64_t floor_ = 0;                      // the counter's least value since the last catch_up
  std::uint64_t* counter_ = nullptr;             // host view of the event counter
  unsigned long long* dev_counter_ = nullptr;    // the device's view of the same memory
  unsigned long long* timeouts_ = nullptr;       // device memory: gates that timed out
  std::string failure_;
};
}  // namespace

bool have_cuda_lag() { return true; }
std::unique_ptr<gpu_lag> make_cuda_lag(std::vector<void*> streams, std::uint64_t n) {
  if (n == 0) throw std::invalid_argument("make_cuda_lag: lag of 0 events");
  return std::make_unique<cuda_lag>(std::move(streams), n);
}
#else
bool have_cuda_lag() { return false; }
std::unique_ptr<gpu_lag> make_cuda_lag(std::vector<void*>, std::uint64_t) {
  throw std::runtime_error("the CUDA lag needs nvcc: this vmm-replay was built without it");
}
#endif

// ---- schedule ----------------------------------------------------------------------------------

schedule make_schedule(const trace& t, bool threaded) {
  schedule s;
  const std::size_t n = t.events.size();
  for (std::size_t i = 1; i < n; ++i) s.handoffs += t.thread[i] != t.thread[i - 1];
  if (!threaded || t.thread_ids.size() <= 1) {
    s.handoffs = 0;
    return s;
  }
  s.threads = t.thread_ids.size();
  s.events_of.resize(s.threads);
  for (std::size_t i = 0; i < n; ++i) s.events_of[t.thread[i]].push_back(static_cast<std::uint32_t>(i));
  return s;
}

// ---- progress ----------------------------------------------------------------------------------

namespace {

// One overwritten stderr line: percent, events/s (wall clock, pauses included), ETA. Only on a
// terminal. Redrawn at most 5 times a second; the caller decides how often to offer an update.
class progress_line {
 public:
  progress_line(bool on, std::string label, std::size_t total)
      : on_(on), label_(std::move(label)), total_(total), start_(clk::now()), last_(start_) {}
  ~progress_line() { clear(); }
  void update(std::size_t done) {
    if (!on_) return;
    auto now = clk::now();
    if (done < total_ && now - last_ < std::chrono::milliseconds(200)) return;
    last_ = now;
    double el = std::chrono::duration<double>(now - start_).count();
    double rate = el > 0 ? double(done) / el : 0;
    char eta[32] = "?";
    if (rate > 0) {
      auto left = static_cast<unsigned long>(double(total_ - done) / rate + 0.5);
      std::snprintf(eta, sizeof eta, "%lu:%02lu", left / 60, left % 60);
    }
    std::fprintf(stderr, "\r  %s: %5.1f%% (%zu / %zu events), %.2f M events/s, ETA %s\033[K", label_.c_str(),
                 100.0 * double(done) / double(total_ ? total_ : 1), done, total_, rate / 1e6, eta);
    drawn_ = true;
  }
  void clear() {
    if (drawn_) std::fprintf(stderr, "\r\033[K");
    drawn_ = false;
  }

 private:
  bool on_;
  std::string label_;
  std::size_t total_;
  clk::time_point start_, last_;
  bool drawn_ = false;
};

// ---- the pass ----------------------------------------------------------------------------------

constexpr std::uint64_t kAbort = ~std::uint64_t{0};
constexpr std::uint64_t kNotYet = kAbort - 1;

// A thread's turn word: the index of the event it may perform now, kAbort to stop. Own cache line,
// so a hand-off touches only the two threads involved.
struct alignas(64) turn_slot {
  std::atomic<std::uint64_t> go{kNotYet};
};

class pass {
 public:
  pass(peer& a, const trace& t, const std::vector<void*>& streams, std::vector<void*>& ptr, const pass_opts& o)
      : a_(a), t_(t), o_(o), n_(t.events.size()), ev_(t.events.data()), slot_(ptr.data()), str_(streams.data()),
        peak_stop_(t.peak_live_event + 1), bar_(o.progress, o.label, n_) {
    next_stop_ = compute_stop(0);
  }

  pass_result run() {
    const bool lag = o_.lag != nullptr, hook = bool(o_.after_event);
    if (o_.lag) {
      o_.lag->seconds = 0;
      std::string why;
      if (!o_.lag->begin(why)) return setup_failure("lag: " + why);
    }
    auto t0 = clk::now();
    if (!o_.sched || o_.sched->threads <= 1) {
      if (lag) hook ? single<true, true>() : single<true, false>();
      else hook ? single<false, true>() : single<false, false>();
    } else {
      threaded(t0, lag, hook);
    }
    if (o_.lag) {
      std::string why;
      if (!o_.lag->end(why) && !r_.exit_code) {
        r_.exit_code = 3;
        r_.failure = "lag: " + why;
      }
    }
    if (!r_.exit_code && !a_.synchronize()) {
      r_.exit_code = 3;
      r_.failure = "synchronize after the replay failed: " + peer::error();
    }
    if (o_.lag) r_.paused += o_.lag->seconds;
    r_.seconds = std::chrono::duration<double>(clk::now() - t0).count() - r_.paused;
    bar_.clear();
    return r_;
  }

 private:
  static constexpr std::uint64_t progress_every = 1 << 17;

  pass_result setup_failure(std::string why) {
    r_.exit_code = 1;
    r_.failure = std::move(why);
    return r_;
  }

  // The next stop after event index i (a stop at s runs before event s; s == n after the last).
  std::size_t compute_stop(std::size_t i) const {
    auto next_multiple = [](std::size_t i, std::uint64_t k) { return (i / k + 1) * k; };
    std::size_t s = n_;
    if (o_.check_every) s = std::min<std::size_t>(s, next_multiple(i, o_.check_every));
    if (o_.sample) s = std::min<std::size_t>(s, next_multiple(i, o_.sample_every));
    if (o_.sample && peak_stop_ > i) s = std::min(s, peak_stop_);
    if (o_.progress) s = std::min<std::size_t>(s, next_multiple(i, progress_every));
    return s;
  }

  // A stop: sample / check / progress, all outside the measured time. false: the pass failed.
  bool at_stop(std::size_t i) {
    auto p0 = clk::now();
    bool ok = true;
    if (o_.sample && (i % o_.sample_every == 0 || i == peak_stop_ || i == n_)) a_.sample();
    if (o_.check_every && i % o_.check_every == 0 && i > 0) {
      ++r_.checks;
      std::string c = a_.check();
      if (!c.empty()) {
        r_.exit_code = 4;
        r_.failure = "check() failed after event " + std::to_string(i - 1) + " (" + event_text(t_, i - 1) + "): " + c;
        ok = false;
      } else if (auto live = a_.live_requested(); live && *live != t_.live_after[i - 1]) {
        r_.exit_code = 4;
        r_.failure = "stats().requested = " + std::to_string(*live) + " after event " + std::to_string(i - 1) + " (" +
                     event_text(t_, i - 1) + "), but the trace has " + std::to_string(t_.live_after[i - 1]) +
                     " bytes live";
        ok = false;
      }
    }
    if (ok && o_.progress && (i % progress_every == 0 || i == n_)) bar_.update(i);
    next_stop_ = i < n_ ? compute_stop(i) : n_ + 1;
    r_.paused += std::chrono::duration<double>(clk::now() - p0).count();
    return ok;
  }

  // What the measured loop reads, copied into locals by each loop: kept in registers across the
  // peer's virtual calls, where members would be reloaded from `this` after every call (~1 ns an
  // event on the null peer).
  struct hot {
    peer* a;
    const event* ev;
    void** slot;
    void* const* str;
    gpu_lag* lag;
  };
  hot hot_state() const { return {&a_, ev_, slot_, str_, o_.lag}; }

  // Event i: the measured work (one virtual call), plus the lag's and the hook's when enabled.
  // Always inlined: a call per event would cost as much as the null peer's whole event.
  template <bool Lag, bool Hook>
  [[gnu::always_inline]] bool step(const hot h, std::size_t i) {
    const event& e = h.ev[i];
    if constexpr (Lag) h.lag->before_event(i, e.stream);
    if (e.kind == op::alloc) {
      void* p = h.a->allocate(e.size, h.str[e.stream]);
      if (!p) [[unlikely]]
        return failed_event(i);
      h.slot[e.id] = p;
    } else if (e.kind == op::trim) [[unlikely]] {
      if (!trim(h, i)) return false;
    } else if (!h.a->deallocate(h.slot[e.id], e.size, h.str[e.stream])) [[unlikely]] {
      return failed_event(i);
    }
    if constexpr (Hook) {
      auto p0 = clk::now();
      std::string why = o_.after_event(i);
      r_.paused += std::chrono::duration<double>(clk::now() - p0).count();
      if (!why.empty()) return failed(4, std::move(why));
    }
    return true;
  }
  // The program emptied the cache: as PyTorch's empty_cache, after the GPU caught up (its work
  // queued so far completes; the lag holds what comes after).
  [[gnu::cold, gnu::noinline]] bool trim(const hot h, std::size_t i) {
    if (h.lag) h.lag->catch_up(i);
    const bool ok = h.a->release_cached(h.ev[i].size);
    if (h.lag) h.lag->resume();
    if (ok) return true;
    return failed(3, "trim failed at event " + std::to_string(i) + " (" + event_text(t_, i) + "): " + peer::error());
  }
  [[gnu::cold, gnu::noinline]] bool failed_event(std::size_t i) {
    if (t_.events[i].kind == op::alloc)
      return failed(3, "allocation failed at event " + std::to_string(i) + " (" + event_text(t_, i) +
                           "; live before it: " + mib(double(i ? t_.live_after[i - 1] : 0)) + "): " + peer::error());
    return failed(3, "free failed at event " + std::to_string(i) + " (" + event_text(t_, i) + "): " + peer::error());
  }
  [[gnu::cold, gnu::noinline]] bool failed(int code, std::string why) {
    r_.exit_code = code;
    r_.failure = std::move(why);
    return false;
  }

  // One thread: runs of events between stops, the stop bookkeeping out of the inner loop.
  template <bool Lag, bool Hook>
  void single() {
    const hot h = hot_state();
    std::size_t i = 0;
    for (;;) {
      const std::size_t stop = next_stop_;
      for (; i < stop; ++i)
        if (!step<Lag, Hook>(h, i)) return;
      if (!at_stop(i) || i == n_) return;
    }
  }

  // ---- several threads: the turn hand-off ----

  // Waits until event i is this thread's turn (false: the pass was aborted): polls the word with
  // sched_yield in between, up to 1000 times, then sleeps in std::atomic::wait (futex), woken by
  // pass_turn's notify_one. Measured (null work, runs of 8 events): a yield poll hands the turn on
  // in ~0.35-0.45 us with 2-8 threads on an idle 16-core host, where spinning with pause was no
  // faster, and in ~2 us on a loaded 2-core one (4 threads), where spinning steals the turn
  // holder's core and a futex sleep/wake costs ~15 us.
  bool wait_turn(turn_slot& me, std::uint64_t i) {
    for (int k = 0;; ++k) {
      std::uint64_t v = me.go.load(std::memory_order_acquire);
      if (v == i) return true;
      if (v == kAbort) return false;
      if (k < 1000) std::this_thread::yield();
      else me.go.wait(v, std::memory_order_acquire);
    }
  }
  void pass_turn(std::size_t i) {
    turn_slot& s = slots_[t_.thread[i]];
    s.go.store(i, std::memory_order_release);
    s.go.notify_one();
  }
  void abort_all() {
    for (std::size_t k = 0; k < nslots_; ++k) {
      slots_[k].go.store(kAbort, std::memory_order_release);
      slots_[k].go.notify_one();
    }
  }

  template <bool Lag, bool Hook>
  void worker(std::size_t k) {
    const std::vector<std::uint32_t>& mine = o_.sched->events_of[k];
    turn_slot& me = slots_[k];
    const hot h = hot_state();
    for (std::size_t j = 0; j < mine.size(); ++j) {
      const std::size_t i = mine[j];
      // The previous event was another thread's: wait until it has returned.
      if ((j == 0 || mine[j - 1] + 1 != i) && !wait_turn(me, i)) return;
      if (i == next_stop_ && !at_stop(i)) return abort_all();
      if (!step<Lag, Hook>(h, i)) return abort_all();
      if (i + 1 == n_) {
        at_stop(n_);
        return abort_all();  // wakes the threads waiting below
      }
      if (t_.thread[i + 1] != k) pass_turn(i + 1);
    }
    // A thread whose events are done stays until the pass ends, as a process's threads do: its
    // exit (its thread cache going back) would otherwise land between the other threads' events
    // where the scheduler puts it, and the same trace would replay to different results.
    for (std::uint64_t v; (v = me.go.load(std::memory_order_acquire)) != kAbort;) me.go.wait(v, std::memory_order_acquire);
  }

  void threaded(clk::time_point& t0, bool lag, bool hook) {
    nslots_ = o_.sched->threads;
    slots_ = std::make_unique<turn_slot[]>(nslots_);
    std::vector<std::thread> th;
    th.reserve(nslots_);
    std::atomic<std::size_t> ready{0};
    for (std::size_t k = 0; k < nslots_; ++k) {
      th.emplace_back([this, k, lag, hook, &ready] {
        ready.fetch_add(1, std::memory_order_relaxed);
        if (lag) hook ? worker<true, true>(k) : worker<true, false>(k);
        else hook ? worker<false, true>(k) : worker<false, false>(k);
      });
    }
    // Thread creation and start-up are not the replay's cost: the clock starts once every thread runs.
    while (ready.load(std::memory_order_relaxed) < nslots_) std::this_thread::yield();
    t0 = clk::now();
    pass_turn(0);
    for (auto& x : th) x.join();
  }

  peer& a_;
  const trace& t_;
  const pass_opts& o_;
  const std::size_t n_;
  const event* ev_;
  void** slot_;
  void* const* str_;
  const std::size_t peak_stop_;
  std::size_t next_stop_ = 0;
  progress_line bar_;
  pass_result r_;
  std::unique_ptr<turn_slot[]> slots_;
  std::size_t nslots_ = 0;
};

}  // namespace

pass_result run_pass(peer& a, const trace& t, const std::vector<void*>& streams, std::vector<void*>& ptr,
                     const pass_opts& o) {
  if (t.events.empty()) return {};
  return pass(a, t, streams, ptr, o).run();
}

}  // namespace vmm::replay
