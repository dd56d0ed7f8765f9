// SPDX-License-Identifier: Apache-2.0
// Fault-injection sweep.
//
// Two scripted workloads (workload.hpp) are run once unarmed to count the backend calls of each
// operation kind (construction + workload + destruction). Then, for every operation kind and every
// k from 1 to that count, a fresh allocator runs the workload with the k-th call of that kind
// failing, and the runner asserts after every step:
//   * an injected failure reaches the caller as nullptr + last_error() (or vmm::out_of_memory /
//     vmm::error from allocate()/trim(), or a status from try_deallocate() when a fence record is
//     refused) carrying the driver's own code, name and function; no step fails without an
//     injected fault, except a trim() reporting a release refused during an earlier call (parked
//     handles: arena::take_parked_error);
//   * check() == "" right after the failure; every live block's content is intact;
//   * the same call succeeds once the fault is spent, and the workload runs to the end with all
//     stats back to zero;
//   * after destruction the decorator's live handle / mapping / reservation counts are all 0,
//     destructor-phase one-shot faults included (~arena retries each teardown call once). Sticky
//     faults in the destructor leak at most one object of the refused kind per refused call
//     (documented policy: teardown cannot report, it goes on and leaks only what was refused).
// One-shot faults are swept with all three driver errors; sticky faults (the k-th and every later
// call of that kind fail until the API call returns) with one error per k, rotating.
// Combined faults: the k-th call of one kind fails and a second kind then fails inside its
// rollback (once, twice, or until the call returns); after that step the runner also maps every
// hole of the reservation (fill_reservation), so a range still mapped but counted as a hole shows.
//
// Extra options (before doctest's own): --ops=create,map,...  sweep only these kinds;
// --skip-ops=release,...  sweep all but these (to isolate a kind while debugging).
#include <doctest/doctest.h>

#include <chrono>
#include <cstdio>

#include "fault/workload.hpp"
#include "vmmalloc/vmmalloc.h"

using namespace vmm;
using namespace vmm::test;

namespace {

std::array<bool, op_count> g_enabled = [] {
  std::array<bool, op_count> a;
  a.fill(true);
  return a;
}();

// The two scripted workloads: "full" frees everything and trims (stats back to zero before
// destruction); "teardown" destroys the allocator with live blocks, free chunks and idle handles,
// so that destructor-phase calls are swept too.
struct workload {
  const char* name;
  std::vector<step> script;
  options opts;
  bool end_empty;
};
const std::vector<workload>& workloads() {
  static const std::vector<workload> w = {
      {"full", sweep_script(), sweep_options(), true},
      {"teardown", teardown_script(), teardown_options(), false},
  };
  return w;
}

const run_result& unarmed(std::size_t w) {
  static std::vector<run_result> r = [] {
    std::vector<run_result> v;
    for (auto& x : workloads()) v.push_back(run_workload({}, x.script, x.opts, x.end_empty));
    return v;
  }();
  return r[w];
}

void report_problems(const std::vector<std::string>& problems) {
  std::size_t shown = 0;
  for (auto& p : problems) {
    if (shown++ == 40) {
      std::printf("  ... %zu more\n", problems.size() - 40);
      break;
    }
    std::printf("  PROBLEM %s\n", p.c_str());
  }
}

struct sweep_totals {
  std::uint64_t points = 0, runs_failed_step = 0, absorbed = 0, ctor = 0, dtor = 0, late = 0;
  std::array<std::uint64_t, op_count> per_op{};
  std::vector<std::string> problems;
};

void sweep(std::size_t w, bool sticky, sweep_totals& t) {
  const workload& wl = workloads()[w];
  const run_result& base = unarmed(w);
  for (int o = 0; o < op_count; ++o) {
    if (!g_enabled[o]) continue;
    std::uint64_t n = base.total[o];
    for (std::uint64_t k = 1; k <= n; ++k) {
      for (int f = 0; f < fault_count; ++f) {
        if (sticky && f != static_cast<int>(k % fault_count)) continue;  // one error per k, rotating
        run_config c;
        c.armed = true;
        c.which = static_cast<op>(o);
        c.k = k;
        c.f = static_cast<fault>(f);
        c.sticky = sticky;
        c.exceptions = (k + f) % 2 == 1;
        run_result r = run_workload(c, wl.script, wl.opts, wl.end_empty);
        ++t.points;
        ++t.per_op[o];
        if (r.injected == 0)
          t.problems.push_back(std::string(wl.name) + ": " + op_name(c.which) + " k=" + std::to_string(k) +
                               ": fault never fired (workload not deterministic?)");
        t.runs_failed_step += r.failed_steps > 0;
        t.absorbed += r.absorbed > 0 && r.failed_steps == 0;
        t.ctor += r.ctor_failed;
        t.dtor += r.injected_in_dtor > 0;
        t.late += r.late_reports > 0;
        for (auto& p : r.problems) t.problems.push_back(std::string(wl.name) + ": " + p);
      }
    }
  }
}

void print_totals(const char* title, const sweep_totals& t, double secs) {
  std::printf("%s: %llu injection points in %.1f s\n", title, static_cast<unsigned long long>(t.points), secs);
  for (int o = 0; o < op_count; ++o)
    if (t.per_op[o]) std::printf("  %-16s %6llu\n", op_name(static_cast<op>(o)), static_cast<unsigned long long>(t.per_op[o]));
  std::printf("  runs where the fault surfaced to the caller: %llu, absorbed by a fallback: %llu, hit the constructor: %llu,"
              " the destructor: %llu; runs with a late report (refused release reported by a later trim): %llu\n",
              static_cast<unsigned long long>(t.runs_failed_step), static_cast<unsigned long long>(t.absorbed),
              static_cast<unsigned long long>(t.ctor), static_cast<unsigned long long>(t.dtor),
              static_cast<unsigned long long>(t.late));
  std::printf("  problems: %zu\n", t.problems.size());
  report_problems(t.problems);
  std::fflush(stdout);
}

void run_sweep(bool sticky) {
  auto t0 = std::chrono::steady_clock::now();
  sweep_totals t;
  for (std::size_t w = 0; w < workloads().size(); ++w) sweep(w, sticky, t);
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  print_totals(sticky ? "sticky sweep" : "one-shot sweep", t, secs);
  CHECK(t.points > 0);
  CHECK(t.problems.empty());
}

}  // namespace

TEST_CASE("fault backend: forwards, counts, fails exactly the k-th call") {
  auto st = std::make_shared<fault_state>();
  auto b = make_fault_host(st);
  chunk_props p;
  auto g = b->granularity(p);
  REQUIRE(g.ok());
  const std::size_t G = g.value.minimum;
  st->arm(op::create, 2, fault::not_permitted);
  auto h1 = b->create(G, p);
  CHECK(h1.ok());
  auto h2 = b->create(G, p);
  CHECK_FALSE(h2.ok());
  CHECK(h2.st.kind == errc::not_permitted);
  CHECK(h2.st.code == 800);
  CHECK(std::string(h2.st.name) == "CUDA_ERROR_NOT_PERMITTED");
  CHECK(std::string(h2.st.op) == "cuMemCreate");
  auto h3 = b->create(G, p);  // one-shot: spent
  CHECK(h3.ok());
  CHECK(st->calls(op::create) == 3);
  CHECK(st->injected() == 1);
  CHECK(st->live_handles() == 2);
  auto* fb = as_fault(*b);
  REQUIRE(fb);
  REQUIRE(fb->host());
  CHECK(fb->host()->live_handles() == 2);

  auto r = b->reserve(4 * G, G);
  REQUIRE(r.ok());
  CHECK(st->live_reservations() == 1);
  st->arm(op::map, 1, fault::out_of_memory, /*sticky=*/true);
  CHECK_FALSE(b->map(r.value, G, h1.value, 0).ok());
  CHECK_FALSE(b->map(r.value, G, h1.value, 0).ok());
  CHECK(fb->host()->live_mappings() == 0);  // an injected failure is not forwarded
  st->disarm();
  CHECK(b->map(r.value, G, h1.value, 0).ok());
  CHECK(st->live_mappings() == 1);
  CHECK(b->unmap(r.value, G).ok());
  CHECK(b->release(h1.value).ok());
  CHECK(b->release(h3.value).ok());
  CHECK(b->free_reservation(r.value, 4 * G).ok());
  b.reset();
  CHECK(st->nothing_live());  // readable after the backend is gone
}

TEST_CASE("fault sweep: the workloads are clean when nothing is injected") {
  for (std::size_t w = 0; w < workloads().size(); ++w) {
    const run_result& r = unarmed(w);
    CAPTURE(workloads()[w].name);
    report_problems(r.problems);
    CHECK(r.problems.empty());
    CHECK(r.injected == 0);
    std::printf("unarmed workload '%s': %zu steps, %llu bytes verified; backend calls (open / workload / destroy):\n",
                workloads()[w].name, workloads()[w].script.size(), static_cast<unsigned long long>(r.bytes_verified));
    for (int o = 0; o < op_count; ++o)
      if (r.total[o])
        std::printf("  %-16s %4llu  (%llu / %llu / %llu)\n", op_name(static_cast<op>(o)),
                    static_cast<unsigned long long>(r.total[o]), static_cast<unsigned long long>(r.after_open[o]),
                    static_cast<unsigned long long>(r.after_workload[o] - r.after_open[o]),
                    static_cast<unsigned long long>(r.total[o] - r.after_workload[o]));
    std::printf("  never called (no injection point): ");
    for (int o = 0; o < op_count; ++o)
      if (!r.total[o]) std::printf("%s ", op_name(static_cast<op>(o)));
    std::printf("\n");
  }
  // The workloads must reach the paths they are meant to reach.
  const run_result& full = unarmed(0);
  CHECK(full.total[static_cast<int>(op::create)] >= 10);
  CHECK(full.total[static_cast<int>(op::unmap)] >= 5);
  CHECK(full.total[static_cast<int>(op::record_fence)] >= 1);
  const run_result& td = unarmed(1);
  CHECK(td.total[static_cast<int>(op::unmap)] - td.after_workload[static_cast<int>(op::unmap)] >= 3);
  CHECK(td.total[static_cast<int>(op::release)] - td.after_workload[static_cast<int>(op::release)] >= 3);
}

TEST_CASE("fault sweep: one-shot faults, every op kind x every k x three driver errors") { run_sweep(false); }

TEST_CASE("fault sweep: sticky faults (the k-th and later calls fail until the API call returns)") { run_sweep(true); }

// ---- combined faults: a second refusal inside the rollback of the first ----------------------

namespace {

struct pair_spec {
  op first, second;
  bool reached;  // whether the allocator's undoing of `first` calls `second` at all
  const char* what;
};
// The rollback paths of arena::map_range (vm::mapping_txn): what undoing each failure calls.
// A refused create calls no release: the idle pieces taken for the range go back to the idle
// cache, and the one created piece is the last (fault_pairs.cpp checks that case directly).
constexpr pair_spec kPairs[] = {
    {op::map, op::unmap, true, "map refused, then unmapping an earlier piece refused"},
    {op::set_access, op::unmap, true, "set_access refused, then unmapping the range refused"},
    {op::set_access, op::release, true, "set_access refused, then releasing the created handle refused"},
    {op::map, op::release, true, "map refused, then releasing its created handle refused"},
    {op::create, op::release, false, "create refused (idle pieces taken), then any release in that call refused"},
};

struct pair_totals {
  std::uint64_t runs = 0, fired = 0, strays = 0, fills = 0;
};

}  // namespace

// Every k of the first kind x the second refused once (the rollback's retry absorbs it), twice
// (parked as a stray) or until the API call returns. After the step that met the faults the
// runner checks check(), live blocks, the decorator's counts against the host backend, and maps
// every hole of the reservation (fill_reservation: a range still mapped but counted as a hole
// makes the host backend refuse the map); the call then succeeds, the workload runs to its end
// (trim(0): zero mapped and physical) and destruction leaves nothing live.
TEST_CASE("fault sweep: combined faults, a refusal inside the rollback of another") {
  auto t0 = std::chrono::steady_clock::now();
  std::vector<std::string> problems;
  std::array<pair_totals, std::size(kPairs)> tot{};
  constexpr std::uint64_t times[] = {1, 2, fault_state::then_sticky};
  for (std::size_t w = 0; w < workloads().size(); ++w) {
    const workload& wl = workloads()[w];
    const run_result& base = unarmed(w);
    for (std::size_t pi = 0; pi < std::size(kPairs); ++pi) {
      const pair_spec& pr = kPairs[pi];
      for (std::uint64_t k = 1; k <= base.total[static_cast<int>(pr.first)]; ++k)
        for (std::size_t ti = 0; ti < std::size(times); ++ti) {
          run_config c;
          c.armed = true;
          c.which = pr.first;
          c.k = k;
          // A refused create is followed by more driver work only when it is out of memory (the
          // heap reclaims and retries; a release of idle handles may come then).
          c.f = pr.first == op::create ? fault::out_of_memory : static_cast<fault>(k % fault_count);
          c.then = true;
          c.then_which = pr.second;
          c.then_f = static_cast<fault>((k + ti + 1) % fault_count);
          c.then_times = times[ti];
          c.exceptions = (k + ti) % 2 == 1;
          c.fill = true;
          run_result r = run_workload(c, wl.script, wl.opts, wl.end_empty);
          pair_totals& t = tot[pi];
          ++t.runs;
          t.fired += r.injected_then > 0;
          t.strays += r.stray_bytes_seen > 0;
          t.fills += r.fills;
          if (r.injected == 0) problems.push_back(std::string(wl.name) + ": " + detail::describe(c) + ": never fired");
          for (auto& p : r.problems) problems.push_back(std::string(wl.name) + ": " + p);
        }
    }
  }
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("combined-fault sweep in %.1f s (runs / second fault fired / strays parked / reservation fills):\n", secs);
  for (std::size_t pi = 0; pi < std::size(kPairs); ++pi)
    std::printf("  %-12s -> %-8s %5llu / %5llu / %5llu / %5llu   %s\n", op_name(kPairs[pi].first),
                op_name(kPairs[pi].second), static_cast<unsigned long long>(tot[pi].runs),
                static_cast<unsigned long long>(tot[pi].fired), static_cast<unsigned long long>(tot[pi].strays),
                static_cast<unsigned long long>(tot[pi].fills), kPairs[pi].what);
  std::printf("  problems: %zu\n", problems.size());
  report_problems(problems);
  std::fflush(stdout);
  CHECK(problems.empty());
  for (std::size_t pi = 0; pi < std::size(kPairs); ++pi) {
    CAPTURE(kPairs[pi].what);
    if (kPairs[pi].reached) CHECK(tot[pi].fired > 0);  // the workloads reach this rollback
    CHECK(tot[pi].fills > 0);
  }
}

int main(int argc, char** argv) {
  std::vector<char*> rest;
  auto parse = [](const std::string& list, bool value) {
    std::array<bool, op_count> a;
    a.fill(!value);
    std::size_t i = 0;
    while (i <= list.size()) {
      std::size_t j = list.find(',', i);
      if (j == std::string::npos) j = list.size();
      std::string name = list.substr(i, j - i);
      bool found = false;
      for (int o = 0; o < op_count; ++o)
        if (name == op_name(static_cast<op>(o))) a[o] = value, found = true;
      if (!found && !name.empty()) {
        std::fprintf(stderr, "unknown op kind '%s'\n", name.c_str());
        std::exit(2);
      }
      i = j + 1;
    }
    return a;
  };
  for (int i = 0; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--ops=", 0) == 0) g_enabled = parse(a.substr(6), true);
    else if (a.rfind("--skip-ops=", 0) == 0) g_enabled = parse(a.substr(11), false);
    else rest.push_back(argv[i]);
  }
  doctest::Context ctx(static_cast<int>(rest.size()), rest.data());
  return ctx.run();
}
