// SPDX-License-Identifier: Apache-2.0
// The scripted, deterministic workload of the fault sweep, and a runner that executes it on a
// fresh allocator over a fault-injecting host backend, checking after every step.
#pragma once

#include <algorithm>
#include <array>
#include <cstdio>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "support/pattern.hpp"
#include "support/fault_backend.hpp"
#include "support/host_alloc.hpp"
#include "support/stream_tag.hpp"
#include "vmmalloc/vmmalloc.hpp"

namespace vmm::test {

inline constexpr std::size_t KiB = std::size_t{1} << 10, MiB = std::size_t{1} << 20,
                             GiB = std::size_t{1} << 30;

struct step {
  enum kind_t { alloc, dealloc, trim } kind;
  int id = -1;
  std::size_t size = 0;   // alloc: bytes; trim: bytes kept
  std::size_t align = 0;  // alloc: 0 = default
  int stream = 0;         // 0 = default stream (nullptr), i = fake tag (void*)i
};

// Options of the sweep: release threshold 64 MiB (frees of big blocks unmap chunks during the
// workload), 2 GiB VA: the scripts hold under 1 GiB at once, and fill_reservation maps every hole
// of it after each fault.
inline options sweep_options() {
  options o;
  o.reservation_size = 2 * GiB;
  o.release_threshold = 64 * MiB;
  return o;
}
// And the allocator's sizes: huge reached at 16 MiB, geometric growth capped at 4 MiB (many
// chunks), huge blocks above 64 MiB created as several handles (a fault part-way through one growth).
inline tuning sweep_tuning() {
  tuning t;
  t.huge_threshold = 16 * MiB;
  t.max_handle = 64 * MiB;
  t.max_growth = 4 * MiB;
  return t;
}
inline host_backend_options sweep_host_options() {
  host_backend_options h;
  h.physical_limit = 32 * GiB;  // generous: only injected faults fail
  return h;
}

inline std::vector<step> sweep_script() {
  std::vector<step> s;
  auto A = [&](int id, std::size_t n, std::size_t align = 0, int stream = 0) {
    s.push_back({step::alloc, id, n, align, stream});
  };
  auto F = [&](int id, int stream = 0) { s.push_back({step::dealloc, id, 0, 0, stream}); };
  auto T = [&](std::size_t keep) { s.push_back({step::trim, -1, keep, 0, 0}); };

  // every path: small (100 B, 4 KiB, 64 KiB), large (300 KiB, 3 MiB), huge (40 MiB, 300 MiB)
  A(0, 100);
  A(1, 4 * KiB);
  A(2, 64 * KiB);
  A(3, 300 * KiB);
  A(4, 3 * MiB);
  A(5, 40 * MiB);
  A(6, 300 * MiB);
  // growth across many chunks (max_growth 4 MiB)
  for (int i = 0; i < 20; ++i) A(10 + i, MiB + MiB / 4 + i * 4 * KiB);
  // frees in mixed order (coalescing; a huge free above the release threshold unmaps)
  for (int id : {4, 1, 12, 11, 13, 6, 0, 15, 17, 16}) F(id);
  A(7, 300 * MiB);
  A(8, 40 * MiB);
  F(5);
  A(9, 40 * MiB);  // huge cache
  // streams: cross-stream frees (fences recorded), reuse on another stream
  A(40, 512 * KiB, 0, 1);
  F(40, 2);
  A(41, 1000, 0, 1);
  F(41, 2);
  A(42, 2000, 0, 2);
  A(43, 700 * KiB, 0, 2);
  A(46, 3000, 0, 3);
  // alignment above the default
  A(44, 256 * KiB, 64 * KiB);
  A(45, 5000, 4 * KiB);
  T(0);
  // growth again after the trim, then frees and a request served by stitching free chunks
  for (int i = 0; i < 10; ++i) A(50 + i, 2 * MiB + MiB / 2);
  for (int id : {53, 51, 54, 50, 59, 52, 58, 55, 57, 56}) F(id);
  A(60, 10 * MiB);
  A(61, 20 * MiB);  // huge again, possibly from idle handles
  T(32 * MiB);
  // free everything else in a scrambled order
  for (int id : {43, 2, 61, 10, 46, 3, 7, 19, 44, 14, 29, 18, 60, 42, 20, 9, 21, 45, 8, 22, 23,
                 24, 25, 26, 27, 28})
    F(id, id % 3);
  T(0);
  return s;
}

// A second script for the destructor: the allocator is destroyed with live blocks (small, large,
// huge), a cached free huge block, free chunks and idle handles, so that ~arena has unmaps,
// releases and the reservation to tear down. Default release threshold (keep everything).
inline options teardown_options() {
  options o = sweep_options();
  o.release_threshold = std::numeric_limits<std::size_t>::max();
  return o;
}
inline std::vector<step> teardown_script() {
  std::vector<step> s;
  auto A = [&](int id, std::size_t n, std::size_t align = 0, int stream = 0) {
    s.push_back({step::alloc, id, n, align, stream});
  };
  auto F = [&](int id, int stream = 0) { s.push_back({step::dealloc, id, 0, 0, stream}); };
  A(0, 100);
  A(1, 4 * KiB);
  A(2, 64 * KiB);
  A(3, 300 * KiB);
  A(4, 3 * MiB);
  A(5, 40 * MiB);
  A(6, 300 * MiB);
  for (int i = 0; i < 8; ++i) A(10 + i, MiB + MiB / 4);
  for (int id : {4, 11, 12, 13, 5}) F(id);  // free chunks and a cached huge block
  A(7, 24 * MiB);                           // stitching: free chunks become idle handles
  A(8, 700, 0, 1);
  return s;  // destroyed with everything else live
}

struct run_config {
  bool armed = false;
  op which = op::create;
  std::uint64_t k = 0;
  fault f = fault::out_of_memory;
  bool sticky = false;
  bool exceptions = false;  // allocate() + catch instead of try_allocate()
  // A combined fault (fault_state::arm_then): when the k-th call of `which` fails, the next
  // then_times calls of then_which fail with then_f, within the same API call (the runner disarms
  // after each step): a refusal inside the rollback of the first failure.
  bool then = false;
  op then_which = op::unmap;
  fault then_f = fault::not_permitted;
  std::uint64_t then_times = 2;
  // After a step with an injected fault: map every hole of the reservation (fill_reservation).
  bool fill = false;
};

struct run_result {
  std::array<std::uint64_t, op_count> after_open{}, after_workload{}, total{};
  std::uint64_t injected = 0, injected_in_dtor = 0;
  int failed_steps = 0;       // steps that reported an injected failure to the caller
  int absorbed = 0;           // steps with an injection that still succeeded (fallback path)
  int late_reports = 0;       // trims reporting a release refused during an earlier call
  bool ctor_failed = false;
  std::uint64_t injected_then = 0;   // failures of the second fault (arm_then)
  std::size_t stray_bytes_seen = 0;  // most bytes parked as strays right after a step
  int fills = 0;                     // fill_reservation probes run
  std::int64_t handles = 0, mappings = 0, reservations = 0;  // after destruction
  std::size_t bytes_verified = 0;
  std::vector<std::string> problems;
};

namespace detail {
inline std::string describe(const run_config& c) {
  if (!c.armed) return "unarmed";
  char b[240];
  int n = std::snprintf(b, sizeof b, "%s k=%llu %s%s%s", op_name(c.which),
                        static_cast<unsigned long long>(c.k), fault_name(c.f), c.sticky ? " sticky" : "",
                        c.exceptions ? " (exceptions)" : "");
  if (c.then && n > 0 && static_cast<std::size_t>(n) < sizeof b) {
    char t[16];
    if (c.then_times == fault_state::then_sticky) std::snprintf(t, sizeof t, "sticky");
    else std::snprintf(t, sizeof t, "x%llu", static_cast<unsigned long long>(c.then_times));
    std::snprintf(b + n, sizeof b - static_cast<std::size_t>(n), " then %s %s %s", op_name(c.then_which),
                  fault_name(c.then_f), t);
  }
  return b;
}
inline bool same_status(const status& a, const status& b) {
  return a.kind == b.kind && a.code == b.code && std::string(a.name) == b.name &&
         std::string(a.op) == b.op;
}
}  // namespace detail

// Maps every hole of the reservation through the allocator, then frees what it took: huge blocks
// of halving sizes down to huge_threshold (the allocator's tuning), then large blocks of one granularity each
// (every hole is a multiple of it), each size until out of memory. A range the arena counts as a
// hole while the driver still has it mapped (a stray put back among the holes, a mapping that
// leaked) makes the host backend refuse the map there (EINVAL): that, any failure other than
// out_of_memory, or a hole left at the end (mapped + stray mappings != reserved) is a problem. Each block gets a
// mark at both ends, checked before its free: fill blocks must not overlap each other.
// Cost: ~20-60 allocations of untouched memfd memory, a few ms.
// stray_mapped: bytes a refused rollback left mapped that the caller keeps refusing to unmap
// (0 when the driver is disarmed: the first mapping retries and unmaps them).
template <class Problem>
inline void fill_reservation(allocator& a, Problem&& problem, const std::string& where,
                             std::size_t stray_mapped = 0, std::size_t huge_threshold = sweep_tuning().huge_threshold) {
  struct blk {
    void* p;
    std::size_t n;
  };
  std::vector<blk> got;
  const std::size_t G = a.granularity(), reserved = a.stats().reserved;
  auto mark = [](void* p, std::size_t n, std::uint64_t id, bool check) {
    bool ok = true;
    for (std::size_t off : {std::size_t{0}, n - 64}) {
      auto* b = static_cast<std::uint64_t*>(static_cast<void*>(static_cast<unsigned char*>(p) + off));
      for (std::size_t i = 0; i < 8; ++i) {
        const std::uint64_t w = splitmix64(id * 131 + off + i);
        if (check) ok = ok && b[i] == w;
        else b[i] = w;
      }
    }
    return ok;
  };
  auto take = [&](std::size_t n) {
    for (;;) {
      void* p = a.try_allocate(n);
      if (!p) {
        if (last_error().st.kind != errc::out_of_memory)
          problem(where + ": filling the reservation: allocate(" + std::to_string(n) + ") failed with " +
                  last_error().message + " (a hole still mapped?)");
        return;
      }
      mark(p, n, got.size(), false);
      got.push_back({p, n});
    }
  };
  std::size_t n = G;
  while (n * 2 <= reserved / 2) n *= 2;
  for (; n >= huge_threshold && n >= G; n /= 2) take(n);
  take(G - 4096);  // the large path: one chunk of G per block once no span has room
  // Strays: bytes parked by a refused rollback (still mapped, or a handle still to release).
  // Stray mappings are not holes; with the driver refusing to undo them they stay in place.
  const allocator_stats s = a.stats();
  const std::size_t stray = s.physical - s.mapped - s.idle;
  if (s.mapped + stray_mapped != s.reserved)
    problem(where + ": after filling the reservation " + std::to_string((s.reserved - s.mapped) >> 20) +
            " MiB are not mapped by chunks (strays " + std::to_string(stray >> 20) + " MiB, of which " +
            std::to_string(stray_mapped >> 20) + " MiB expected still mapped)");
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (!mark(got[i].p, got[i].n, i, true)) problem(where + ": fill block " + std::to_string(i) + " overwritten");
    if (status d = a.try_deallocate(got[i].p); !d.ok()) problem(where + ": freeing a fill block: " + d.message());
  }
}

// Runs the script once on a fresh allocator. Every problem found is appended to result.problems.
// end_empty: the script frees everything and ends with trim(0), so stats and mappings must be back
// to zero before destruction; otherwise the allocator is destroyed with live blocks.
inline run_result run_workload(const run_config& cfg, const std::vector<step>& script,
                               const options& opts = sweep_options(), bool end_empty = true) {
  run_result res;
  auto st = std::make_shared<fault_state>();
  // The host backend outlives the allocator: its own live counts are read after destruction.
  // Violations of the driver's contract become problems of this run (the sweep reports them all,
  // each with its configuration, instead of stopping at the first).
  auto violations = std::make_shared<violation_log>();
  std::unique_ptr<backend_iface> host = make_backend<host_backend>(recording(violations, sweep_host_options()));
  host_backend* hb = backend_cast<host_backend>(*host);
  auto problem = [&](const std::string& what) { res.problems.push_back(detail::describe(cfg) + ": " + what); };
  auto done = [&]() -> run_result& {
    for (const std::string& v : violations->seen) problem("driver contract: " + v);
    return res;
  };
  if (cfg.armed && cfg.then) st->arm_then(cfg.which, cfg.k, cfg.f, cfg.then_which, cfg.then_f, cfg.then_times);
  else if (cfg.armed) st->arm(cfg.which, cfg.k, cfg.f, cfg.sticky);

  // ---- construction (granularity, reserve happen here) ----
  std::unique_ptr<allocator> a;
  for (int attempt = 0; attempt < 2 && !a; ++attempt) {
    std::uint64_t before = st->injected();
    std::optional<status> got;
    try {
      a = std::make_unique<allocator>(allocator_access::make(make_fault_over(*host, st), opts, sweep_tuning()));
    } catch (const out_of_memory& e) {
      got = e.st();
    } catch (const error& e) {
      got = e.st();
      if (e.code() != make_error_code(e.st().kind)) problem("constructor: error code does not match its status");
    }
    if (!got) break;
    res.ctor_failed = true;
    if (st->injected() == before) {
      problem("constructor failed without an injected fault: " + got->message());
      return done();
    }
    if (!st->was_injected(*got))
      problem("constructor: reported " + got->message() + ", injected " + st->last_injected().message());
    if (got->kind == errc::out_of_memory) {
      // must have been thrown as out_of_memory (checked by the catch clause order above)
    }
    if (!st->nothing_live() || hb->live_handles() || hb->live_mappings() || hb->live_reservations())
      problem("failed construction leaked backend objects");
    st->disarm();
  }
  if (!a) {
    problem("allocator could not be constructed after the fault was spent");
    return done();
  }
  res.after_open = st->all_calls();

  struct live_block {
    void* p;
    std::size_t size;
  };
  std::map<int, live_block> live;

  auto verify_all = [&](const char* when) {
    for (auto& [id, b] : live) {
      std::size_t bad;
      res.bytes_verified += verify_block(b.p, b.size, static_cast<std::uint64_t>(id), &bad);
      if (bad != SIZE_MAX)
        problem(std::string(when) + ": block " + std::to_string(id) + " corrupted at offset " +
                std::to_string(bad));
    }
  };
  auto counts_agree = [&]() {
    return st->live_handles() == static_cast<std::int64_t>(hb->live_handles()) &&
           st->live_mappings() == static_cast<std::int64_t>(hb->live_mappings()) &&
           st->live_reservations() == static_cast<std::int64_t>(hb->live_reservations());
  };

  // Executes one step; returns the failure status (ok() when it succeeded).
  auto execute = [&](const step& s) -> status {
    switch (s.kind) {
      case step::alloc: {
        void* p = nullptr;
        status fail_st;
        if (cfg.exceptions) {
          try {
            p = a->allocate(s.size, s.align, stream_tag(s.stream));
          } catch (const out_of_memory& e) {
            fail_st = e.st();
            if (e.st().kind != errc::out_of_memory) problem("out_of_memory thrown for a non-OOM status");
          } catch (const error& e) {
            fail_st = e.st();
            if (e.st().kind == errc::out_of_memory) problem("vmm::error thrown for an OOM status");
            if (e.code() != make_error_code(e.st().kind)) problem("vmm::error code does not match its status");
          }
        } else {
          p = a->try_allocate(s.size, s.align, stream_tag(s.stream));
          if (!p) {
            fail_st = last_error().st;
            if (last_error().message.empty()) problem("try_allocate failed with an empty last_error message");
          }
        }
        if (!p) {
          if (fail_st.ok()) problem("allocation failed with an ok status");
          return fail_st.ok() ? status{errc::other, 0, "?", "?"} : fail_st;
        }
        std::size_t align = s.align ? std::max<std::size_t>(s.align, 256) : 256;
        if (reinterpret_cast<std::uintptr_t>(p) % align) problem("misaligned block " + std::to_string(s.id));
        if (a->usable_size(p) < s.size) problem("usable_size below the request for block " + std::to_string(s.id));
        fill_block(p, s.size, static_cast<std::uint64_t>(s.id));
        live[s.id] = {p, s.size};
        return {};
      }
      case step::dealloc: {
        auto it = live.find(s.id);
        if (it == live.end()) return {};  // its allocation was skipped (cannot happen: retried)
        std::size_t bad;
        res.bytes_verified += verify_block(it->second.p, it->second.size, static_cast<std::uint64_t>(s.id), &bad);
        if (bad != SIZE_MAX)
          problem("block " + std::to_string(s.id) + " corrupted at offset " + std::to_string(bad) + " before its free");
        status d = a->try_deallocate(it->second.p, stream_tag(s.stream));
        if (!d.ok()) {
          // Only a refused fence record may fail a valid free (heap::deallocate: the free is
          // refused and the block stays allocated). The runner checks the status came from an
          // injected fault; here: the block must still be live and usable.
          if (a->usable_size(it->second.p) < it->second.size)
            problem("failed deallocate of block " + std::to_string(s.id) + " did not leave it allocated");
          return d;
        }
        live.erase(it);
        return {};
      }
      case step::trim: {
        try {
          a->trim(s.size);
        } catch (const out_of_memory& e) {
          return e.st();
        } catch (const error& e) {
          return e.st();
        }
        return {};
      }
    }
    return {};
  };

  // A refused release() is parked (its handle kept idle for a retry) and reported by the next
  // trim() (arena::take_parked_error): a trim may thus fail, with no fault injected during it, with
  // the status of a fault injected earlier in this run. That is a late report, not a spurious error.
  auto late_report = [&](const step& s, const status& r) {
    return s.kind == step::trim && st->injected() > 0 && st->was_injected(r);
  };
  for (std::size_t i = 0; i < script.size(); ++i) {
    const step& s = script[i];
    std::uint64_t before = st->injected();
    status r = execute(s);
    bool injected_now = st->injected() > before;
    if (injected_now) st->disarm();  // a sticky fault lasts one API call
    std::string where = "step " + std::to_string(i);
    if (!r.ok()) {
      if (injected_now) {
        ++res.failed_steps;
        // With a combined fault the caller sees the first failure, or the second one when the
        // first was absorbed (an out-of-memory reclaimed and retried) and the second was not.
        if (!st->was_injected(r))
          problem(where + " reported " + r.message() + " but the driver said " + st->last_injected().message());
      } else if (late_report(s, r)) {
        ++res.late_reports;
      } else {
        problem(where + " failed without an injected fault: " + r.message());
      }
    } else if (injected_now) {
      ++res.absorbed;
    }
    if (std::string c = a->check(); !c.empty()) problem(where + ": check() failed: " + c);
    if (!counts_agree()) problem(where + ": decorator live counts disagree with the host backend");
    if (injected_now) verify_all("after an injected fault");
    {
      const allocator_stats x = a->stats();
      res.stray_bytes_seen = std::max(res.stray_bytes_seen, x.physical - x.mapped - x.idle);
    }
    if (injected_now && cfg.fill) {
      ++res.fills;
      fill_reservation(*a, problem, where);
      verify_all("after filling the reservation");
      if (std::string c = a->check(); !c.empty()) problem(where + ": check() failed after the fill: " + c);
      if (!counts_agree()) problem(where + ": decorator live counts disagree with the host backend after the fill");
    }
    if (!r.ok()) {
      // The fault is spent: the same call must now succeed (a trim may first deliver one late
      // report of a release refused earlier).
      status r2 = execute(s);
      if (!r2.ok() && late_report(s, r2)) {
        ++res.late_reports;
        r2 = execute(s);
      }
      if (!r2.ok()) problem(where + " still fails after the fault was spent: " + r2.message());
      if (std::string c = a->check(); !c.empty()) problem(where + ": check() failed after the retry: " + c);
    }
  }
  res.after_workload = st->all_calls();

  allocator_stats sx = a->stats();
  if (end_empty) {
    if (!live.empty()) problem("script left blocks live");
    if (sx.requested || sx.allocated || sx.live) problem("stats not back to zero after every free");
    if (sx.mapped || sx.physical) problem("mapped/physical not zero after the final trim(0)");
  } else {
    verify_all("before destruction");
    if (sx.live != live.size()) problem("stats().live does not match the live blocks");
  }
  if (!counts_agree()) problem("decorator live counts disagree with the host backend at the end");

  // ---- destruction ----
  std::uint64_t before = st->injected();
  a.reset();
  res.injected_in_dtor = st->injected() - before;
  res.total = st->all_calls();
  res.injected = st->injected();
  res.injected_then = st->injected_then();
  res.handles = st->live_handles();
  res.mappings = st->live_mappings();
  res.reservations = st->live_reservations();

  if (!res.injected_in_dtor || !cfg.sticky) {
    // Nothing may leak. That includes a one-shot fault in the destructor: ~arena retries every
    // teardown call once (its documented policy), so a call refused once leaks nothing.
    if (!st->nothing_live())
      problem(std::string(res.injected_in_dtor ? "destructor fault: " : "") + "leak after destruction: handles " +
              std::to_string(res.handles) + ", mappings " + std::to_string(res.mappings) + ", reservations " +
              std::to_string(res.reservations));
  } else {
    // A sticky fault refuses every teardown call of its kind, retries included: the destructor
    // cannot report, goes on tearing down everything else, and leaks at most one object per
    // refused call, of the refused kind only. A mapping left behind also keeps the reservation
    // (the driver will not free a reservation with a live mapping in it).
    std::int64_t n = static_cast<std::int64_t>(res.injected_in_dtor);
    bool ok = true;
    switch (cfg.which) {
      case op::unmap: ok = res.handles == 0 && res.mappings >= 1 && res.mappings <= n && res.reservations == 1; break;
      case op::release: ok = res.handles >= 1 && res.handles <= n && res.mappings == 0 && res.reservations == 0; break;
      case op::free_reservation: ok = res.handles == 0 && res.mappings == 0 && res.reservations == 1; break;
      default: ok = st->nothing_live(); break;
    }
    if (!ok)
      problem("sticky destructor fault: leaked handles " + std::to_string(res.handles) + ", mappings " +
              std::to_string(res.mappings) + ", reservations " + std::to_string(res.reservations) + " for " +
              std::to_string(n) + " refused calls");
  }
  if (!counts_agree()) problem("after destruction the decorator's live counts disagree with the host backend's");
  if (res.handles < 0 || res.mappings < 0 || res.reservations < 0)
    problem("negative live counts: an object was destroyed twice");
  return done();
}

}  // namespace vmm::test
