// SPDX-License-Identifier: Apache-2.0
// Combined faults: a second refusal inside the rollback of the first (fault_state::arm_then).
//
//   * targeted allocator cases that look at what a refused rollback leaves behind (strays) while
//     the driver keeps refusing: the stray's VA is never handed out, it counts against
//     options.memory_limit, and a refused create gives the idle pieces it took back untouched;
//   * sweeps over every k of the first kind for growable_buffer (resize), kv_cache (append, with
//     pooled and created pages in one mapping) and IPC import (try_import of a three-chunk export),
//     with the second refused once (absorbed by the rollback's retry), twice (parked as a stray),
//     three times, or until the call returns.
// After each: the call failed with an injected status and changed nothing visible, the decorator's
// live counts agree with the host backend's, the object keeps serving (the call succeeds once the
// fault is spent; then everything it can map is mapped and written), and once it is emptied and
// destroyed the host backend holds nothing.
//
// The allocator's own sweep over pairs is in fault_sweep.cpp ("combined faults").
#include <doctest/doctest.h>

#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "fault/workload.hpp"
#include "vmmalloc/growable_buffer.hpp"
#include "vmmalloc/ipc.hpp"
#include "vmmalloc/kv_cache.hpp"

using namespace vmm;
using namespace vmm::test;

namespace {

constexpr std::uint64_t kSticky = fault_state::then_sticky;
constexpr std::uint64_t kTimes[] = {1, 2, 3, kSticky};

struct pair_spec {
  op first, second;
  bool reached;  // whether undoing `first` calls `second` in this scenario
};

std::string times_name(std::uint64_t t) { return t == kSticky ? "sticky" : "x" + std::to_string(t); }

std::string describe(const pair_spec& p, std::uint64_t k, fault f, fault f2, std::uint64_t t) {
  return std::string(op_name(p.first)) + " k=" + std::to_string(k) + " " + fault_name(f) + " then " +
         op_name(p.second) + " " + fault_name(f2) + " " + times_name(t);
}

struct host_counts {
  std::size_t handles = 0, mappings = 0, reservations = 0;
  friend bool operator==(const host_counts&, const host_counts&) = default;
};
host_counts counts_of(host_backend& hb) { return {hb.live_handles(), hb.live_mappings(), hb.live_reservations()}; }
bool agree(const fault_state& st, host_backend& hb) {
  const host_counts h = counts_of(hb);
  return st.live_handles() == static_cast<std::int64_t>(h.handles) &&
         st.live_mappings() == static_cast<std::int64_t>(h.mappings) &&
         st.live_reservations() == static_cast<std::int64_t>(h.reservations);
}

// The failure a call threw (ok when it did not throw).
status caught(const std::function<void()>& f) {
  try {
    f();
  } catch (const vmm::out_of_memory& e) {
    return e.st();
  } catch (const vmm::error& e) {
    return e.st();
  }
  return {};
}

struct sweep_tally {
  std::uint64_t runs = 0, fired = 0;
  std::vector<std::string> problems;
  void print(const char* title, const pair_spec& p) const {
    std::printf("  %-14s %-12s -> %-8s runs %4llu, second fault fired in %4llu\n", title, op_name(p.first),
                op_name(p.second), static_cast<unsigned long long>(runs), static_cast<unsigned long long>(fired));
  }
};

void report(const std::vector<std::string>& problems) {
  for (std::size_t i = 0; i < problems.size() && i < 40; ++i) std::printf("  PROBLEM %s\n", problems[i].c_str());
  if (problems.size() > 40) std::printf("  ... %zu more\n", problems.size() - 40);
  std::fflush(stdout);
}

// One pair swept: the first fault at every k up to `calls`, the second refused kTimes[ti] times
// (faults varied with k and ti); run(k, first, second, times, tally) makes one run. Prints the
// tally and its problems; the caller asserts on it.
template <class Run>
sweep_tally sweep_pair(const char* title, const pair_spec& pr, std::uint64_t calls, Run run) {
  sweep_tally t;
  for (std::uint64_t k = 1; k <= calls; ++k)
    for (std::size_t ti = 0; ti < std::size(kTimes); ++ti)
      run(k, static_cast<fault>((k + ti) % fault_count), static_cast<fault>(ti % fault_count), kTimes[ti], t);
  t.print(title, pr);
  report(t.problems);
  return t;
}

options small_opts() {
  options o;
  o.reservation_size = std::size_t{1} << 30;
  return o;
}
tuning small_tuning() {
  tuning t;
  t.huge_threshold = 4 * MiB;
  t.thread_cache_large = false;  // frees go straight back: the cases lay out free chunks exactly
  return t;
}
// An allocator over the fault backend with these cases' options (o) and sizes.
allocator make(std::unique_ptr<backend_iface> b, const options& o = small_opts(), const tuning& t = small_tuning()) {
  return allocator_access::make(std::move(b), o, t);
}
// For two_free_chunks: handles of at most 4 MiB, so the freed ones are whole pieces a growth maps.
tuning stitch_tuning() {
  tuning t = small_tuning();
  t.max_handle = 4 * MiB;
  return t;
}

// Two huge blocks of 4 MiB, freed: two free chunks (release threshold max keeps them). A 12 MiB
// request then unmaps them into idle handles (stitching) and maps three pieces: idle, idle,
// created, in that order (with stitch_tuning: idle handles smaller than a piece are released).
void two_free_chunks(allocator& a) {
  void* x = a.allocate(4 * MiB);
  void* y = a.allocate(4 * MiB);
  a.deallocate(x);
  a.deallocate(y);
  REQUIRE(a.stats().free_chunk_bytes == 8 * MiB);
}

std::size_t stray_bytes(const allocator_stats& s) { return s.physical - s.mapped - s.idle; }

}  // namespace

// ---- the probe itself ------------------------------------------------------------------------

TEST_CASE("fill_reservation reports a range the arena counts as a hole while it is mapped") {
  // The arena's map over the foreign mapping breaks the driver's contract: kept, not aborted.
  auto violations = std::make_shared<violation_log>();
  auto host = make_backend<host_backend>(recording(violations, sweep_host_options()));
  host_backend* hb = backend_cast<host_backend>(*host);
  auto st = std::make_shared<fault_state>();
  {
    allocator a = make(make_fault_over(*host, st));
    void* p = a.allocate(8 * MiB);
    a.deallocate(p);
    a.trim(0);  // p's range is a hole again
    std::vector<std::string> problems;
    auto problem = [&](const std::string& s) { problems.push_back(s); };
    fill_reservation(a, problem, "clean", 0, 4 * MiB);
    CHECK(problems.empty());
    a.trim(0);
    // Map a handle behind the allocator's back where it will map next: the lowest hole.
    auto h = hb->create(a.granularity(), {});
    REQUIRE(h.ok());
    const auto at = reinterpret_cast<std::uintptr_t>(p);
    REQUIRE(hb->map(at, a.granularity(), h.value, 0).ok());
    fill_reservation(a, problem, "foreign mapping", 0, 4 * MiB);
    CHECK_FALSE(problems.empty());  // the host backend refused a map there (EINVAL): reported
    if (!problems.empty()) MESSAGE("the probe said: " << problems.front());
    CHECK(violations->last().find("over VA that is mapped") != std::string::npos);
    CHECK(hb->unmap(at, a.granularity()).ok());
    CHECK(hb->release(h.value).ok());
    a.trim(0);
    CHECK(a.check() == "");
  }
  CHECK(counts_of(*hb) == host_counts{});
}

// ---- allocator: strays under a driver that keeps refusing -----------------------------------

TEST_CASE("pair: map refused, then unmapping an earlier piece refused twice -> a stray mapping, never a hole") {
  auto host = make_backend<host_backend>(sweep_host_options());
  host_backend* hb = backend_cast<host_backend>(*host);
  auto st = std::make_shared<fault_state>();
  {
    allocator a = make(make_fault_over(*host, st), small_opts(), stitch_tuning());
    void* keep = a.allocate(3 * MiB);  // a live large block, checked after everything
    fill_block(keep, 3 * MiB, 5);
    two_free_chunks(a);
    const allocator_stats before = a.stats();
    // Third map of the request: its created piece. Rollback unmaps piece 1 (refused twice: stray),
    // then piece 0 (fine: back to the idle cache).
    st->arm_then(op::map, 3, fault::invalid_value, op::unmap, fault::not_permitted, 2);
    CHECK(a.try_allocate(12 * MiB) == nullptr);
    CHECK(last_error().st.kind == errc::invalid_value);
    CHECK(std::string(last_error().st.op) == "cuMemMap");  // the first failure is what the caller sees
    CHECK(st->injected_then() == 2);
    CHECK(a.check() == "");
    const allocator_stats s = a.stats();
    CHECK(stray_bytes(s) == 4 * MiB);          // piece 1, still mapped
    CHECK(s.idle == 4 * MiB);                  // piece 0, back to the idle cache
    CHECK(s.physical == before.physical);      // nothing lost, nothing created and kept
    CHECK(s.mapped == before.mapped - 8 * MiB);
    CHECK(agree(*st, *hb));

    // The driver keeps refusing unmaps: the stray stays mapped, and everything else fills.
    st->arm(op::unmap, 1, fault::not_permitted, /*sticky=*/true);
    std::vector<std::string> problems;
    fill_reservation(a, [&](const std::string& p) { problems.push_back(p); }, "unmap refused", 4 * MiB, 4 * MiB);
    for (auto& p : problems) FAIL_CHECK(p);
    CHECK(stray_bytes(a.stats()) == 4 * MiB);
    CHECK(a.check() == "");

    st->disarm();
    // Retries the stray: unmapped and released. (It may also re-report the allocation's map
    // failure: see "trim() reports no failure ..." below.)
    (void)caught([&] { a.trim(0); });
    CHECK(stray_bytes(a.stats()) == 0);
    std::size_t bad;
    verify_block(keep, 3 * MiB, 5, &bad);
    CHECK(bad == SIZE_MAX);
    a.deallocate(keep);
    a.trim(0);
    CHECK(a.stats().physical == 0);
    CHECK(counts_of(*hb) == host_counts{0, 0, 1});  // the reservation only
    CHECK(a.check() == "");
  }
  CHECK(st->nothing_live());
  CHECK(counts_of(*hb) == host_counts{});
}

TEST_CASE("pair: set_access refused, then releasing the created handle refused twice -> parked, counted against the limit") {
  auto host = make_backend<host_backend>(sweep_host_options());
  host_backend* hb = backend_cast<host_backend>(*host);
  auto st = std::make_shared<fault_state>();
  const std::size_t limit = 32 * MiB;
  {
    options o = small_opts();
    o.memory_limit = limit;
    allocator a = make(make_fault_over(*host, st), o);
    // invalid_value: an out-of-memory would make the heap reclaim (retrying the parked release,
    // which then succeeds) and retry.
    st->arm_then(op::set_access, 1, fault::invalid_value, op::release, fault::not_permitted, 2);
    CHECK(a.try_allocate(8 * MiB) == nullptr);
    CHECK(last_error().st.kind == errc::invalid_value);
    CHECK(st->injected_then() == 2);
    CHECK(a.check() == "");
    CHECK(stray_bytes(a.stats()) == 8 * MiB);  // the handle, unmapped, still held
    CHECK(a.stats().mapped == 0);
    CHECK(hb->live_handles() == 1);
    CHECK(hb->live_mappings() == 0);

    // Releases keep being refused: the parked handle is part of what the limit counts.
    st->arm(op::release, 1, fault::not_permitted, /*sticky=*/true);
    void* p = a.try_allocate(limit - 8 * MiB);
    CHECK(p != nullptr);
    void* q = a.try_allocate(a.granularity());
    CHECK(q == nullptr);
    CHECK(last_error().st.kind == errc::out_of_memory);
    CHECK(a.stats().peak_physical <= limit);
    st->disarm();
    a.deallocate(p);
    (void)caught([&] { a.trim(0); });  // may re-report the set_access failure (see below)
    CHECK(a.stats().physical == 0);
    void* r = a.try_allocate(limit - a.granularity());  // everything is back
    CHECK(r != nullptr);
    a.deallocate(r);
    CHECK(a.check() == "");
  }
  CHECK(st->nothing_live());
  CHECK(counts_of(*hb) == host_counts{});
}

TEST_CASE("pair: create refused with idle pieces taken -> they go back to the idle cache, no release") {
  auto host = make_backend<host_backend>(sweep_host_options());
  host_backend* hb = backend_cast<host_backend>(*host);
  auto st = std::make_shared<fault_state>();
  {
    allocator a = make(make_fault_over(*host, st), small_opts(), stitch_tuning());
    two_free_chunks(a);
    const allocator_stats before = a.stats();
    // invalid_value: no out-of-memory reclaim and retry, only the undoing of this request.
    st->arm_then(op::create, 1, fault::invalid_value, op::release, fault::not_permitted, kSticky);
    CHECK(a.try_allocate(12 * MiB) == nullptr);
    CHECK(std::string(last_error().st.op) == "cuMemCreate");
    CHECK(st->injected_then() == 0);  // the pieces were lent, not created: nothing to release
    st->disarm();
    const allocator_stats s = a.stats();
    CHECK(s.idle == 8 * MiB);  // both pieces, unmapped for the request, kept
    CHECK(s.physical == before.physical);
    CHECK(stray_bytes(s) == 0);
    CHECK(a.check() == "");
    CHECK(agree(*st, *hb));
    void* p = a.try_allocate(12 * MiB);  // now served, stitching both idle handles
    REQUIRE(p != nullptr);
    CHECK(a.stats().stitched == before.stitched + 2);
    fill_block(p, 12 * MiB, 9);
    std::size_t bad;
    verify_block(p, 12 * MiB, 9, &bad);
    CHECK(bad == SIZE_MAX);
    a.deallocate(p);
    a.trim(0);
    CHECK(a.stats().physical == 0);
  }
  CHECK(st->nothing_live());
  CHECK(counts_of(*hb) == host_counts{});
}

// A failure inside map_range whose rollback parks a stray also sets the arena's parked error,
// which the next trim() throws: the status of the map / set_access that failed, although the
// allocation already reported it (or, after a reclaim, succeeded) and although that trim undoes
// the stray. A trim that does everything it is asked should report success; a refusal should be
// reported once, by the call that met it (as "a refused release is reported once" in
// fault_cases.cpp holds for trim's own refusals).
TEST_CASE("trim() reports no failure that an earlier call met, once nothing is left parked") {
  auto st = std::make_shared<fault_state>();
  allocator a = make(make_fault_host(st));
  SUBCASE("the allocation failed and said so") {
    st->arm_then(op::set_access, 1, fault::invalid_value, op::release, fault::not_permitted, 2);
    CHECK(a.try_allocate(8 * MiB) == nullptr);
    CHECK(stray_bytes(a.stats()) == 8 * MiB);  // the created handle, parked
  }
  SUBCASE("out of memory: the reclaim before the retry already released the parked handle") {
    st->arm_then(op::set_access, 1, fault::out_of_memory, op::release, fault::not_permitted, 2);
    void* p = a.try_allocate(8 * MiB);  // reported, or served by the retry: either is fine
    CHECK(st->injected() == 3);
    CHECK(stray_bytes(a.stats()) == 0);  // nothing parked any more
    if (p) a.deallocate(p);
  }
  st->disarm();
  status r = caught([&] { a.trim(0); });
  CHECK_MESSAGE(r.ok(), "trim(0) threw " << r.message());
  CHECK(stray_bytes(a.stats()) == 0);
  CHECK(a.stats().physical == 0);
  CHECK(a.check() == "");
}

// ---- growable_buffer -------------------------------------------------------------------------

namespace {

// Sizes a buffer goes through; marks (one word every 256 KiB) are written on the bytes each growth
// adds and checked on [0, size) after every step.
constexpr std::size_t kGbLimit = 64 * MiB;
const std::vector<std::size_t> kGbScript = {3 * MiB, 9 * MiB, 1 * MiB, 20 * MiB, 6 * MiB, 40 * MiB, 0, 12 * MiB};
constexpr std::size_t kGbStride = 256 * KiB;

std::uint64_t gb_word(std::size_t off, std::uint64_t epoch) { return splitmix64(off * 7 + epoch); }

void gb_run(const pair_spec* pr, std::uint64_t k, fault f, fault f2, std::uint64_t times, bool geometric,
            sweep_tally& t, std::array<std::uint64_t, op_count>* count_calls) {
  auto host = make_backend<host_backend>(sweep_host_options());
  host_backend* hb = backend_cast<host_backend>(*host);
  auto st = std::make_shared<fault_state>();
  const std::string what = (pr ? describe(*pr, k, f, f2, times) : std::string("unarmed")) +
                           (geometric ? " (geometric)" : "");
  auto problem = [&](const std::string& s) { t.problems.push_back("growable_buffer " + what + ": " + s); };
  {
    growable_options go;
    go.geometric = geometric;
    growable_buffer buf(make_fault_over(*host, st), kGbLimit, go);
    if (pr) st->arm_then(pr->first, k, f, pr->second, f2, times);
    std::vector<std::uint64_t> epoch(kGbLimit / kGbStride, 0);  // which write a mark is from
    std::uint64_t writes = 0;
    auto* base = static_cast<unsigned char*>(buf.data());
    auto mark = [&](std::size_t from, std::size_t to) {
      ++writes;
      for (std::size_t o = (from + kGbStride - 1) / kGbStride * kGbStride; o < to; o += kGbStride) {
        epoch[o / kGbStride] = writes;
        const std::uint64_t w = gb_word(o, writes);
        std::memcpy(base + o, &w, 8);
      }
    };
    auto intact = [&](std::size_t to) {
      for (std::size_t o = 0; o < to; o += kGbStride) {
        std::uint64_t w;
        std::memcpy(&w, base + o, 8);
        if (w != gb_word(o, epoch[o / kGbStride])) return false;
      }
      return true;
    };
    for (std::size_t i = 0; i < kGbScript.size(); ++i) {
      const std::size_t n = kGbScript[i], old = buf.size(), cap = buf.capacity(), chunks = buf.chunk_count();
      const std::uint64_t inj = st->injected();
      status r = caught([&] { buf.resize(n); });
      const bool now = st->injected() > inj;
      if (now) st->disarm();
      const std::string where = "step " + std::to_string(i) + " (resize " + std::to_string(n >> 20) + " MiB)";
      if (!r.ok()) {
        if (!now || !st->was_injected(r)) problem(where + " failed with " + r.message() + ", not an injected fault");
        if (buf.size() != old || buf.capacity() != cap || buf.chunk_count() != chunks)
          problem(where + ": a failed growth changed size, capacity or chunk count");
        if (buf.data() != base) problem(where + ": data() moved");
        if (!intact(old)) problem(where + ": contents changed by a failed growth");
        if (!agree(*st, *hb)) problem(where + ": decorator and host backend disagree after the failure");
        r = caught([&] { buf.resize(n); });  // the fault is spent: the same call succeeds
        if (!r.ok()) problem(where + ": still fails after the fault was spent: " + r.message());
      }
      if (buf.size() != n) problem(where + ": size is not the size asked for");
      if (!intact(std::min(old, n))) problem(where + ": contents lost");
      if (n > old) mark(old, n);
      if (!agree(*st, *hb)) problem(where + ": decorator and host backend disagree");
      if (hb->live_mappings() < buf.chunk_count()) problem(where + ": fewer mappings than chunks");
    }
    if (count_calls) *count_calls = st->all_calls();
    // Keeps serving: the whole limit maps (a mapping left at the tail would refuse it), contents kept.
    const std::size_t before = buf.size();
    if (status r = caught([&] { buf.resize(kGbLimit); }); !r.ok()) problem("growing to the limit: " + r.message());
    if (!intact(before)) problem("contents lost growing to the limit");
    mark(before, buf.size());
    if (!intact(buf.size())) problem("marks of the whole buffer do not read back");
    if (status r = caught([&] { buf.resize(0); }); !r.ok()) problem("resize(0): " + r.message());
    if (buf.chunk_count() != 0 || buf.capacity() != 0) problem("resize(0) kept chunks");
    if (counts_of(*hb) != host_counts{0, 0, 1}) problem("an empty buffer still holds handles or mappings");
  }
  if (!st->nothing_live() || counts_of(*hb) != host_counts{}) problem("objects left after destruction");
  t.fired += st->injected_then() > 0;
  ++t.runs;
}

}  // namespace

TEST_CASE("pairs in growable_buffer::resize: every k, the second refused 1, 2, 3 times or until the call returns") {
  const pair_spec pairs[] = {
      {op::map, op::release, true},         // txn.map releases the handle it created
      {op::set_access, op::unmap, true},    // rollback unmaps the new chunk
      {op::set_access, op::release, true},  // then releases it
      {op::create, op::release, false},     // nothing was created: nothing to release
      {op::map, op::unmap, false},          // one chunk a growth: no earlier mapping to undo
  };
  for (bool geometric : {false, true}) {
    sweep_tally base;
    std::array<std::uint64_t, op_count> calls{};
    gb_run(nullptr, 0, {}, {}, 0, geometric, base, &calls);
    report(base.problems);
    REQUIRE(base.problems.empty());
    for (const auto& pr : pairs) {
      const sweep_tally t = sweep_pair(
          geometric ? "buffer (geo)" : "buffer", pr, calls[static_cast<int>(pr.first)],
          [&](std::uint64_t k, fault f, fault f2, std::uint64_t times, sweep_tally& tt) {
            gb_run(&pr, k, f, f2, times, geometric, tt, nullptr);
          });
      CAPTURE(op_name(pr.first));
      CAPTURE(op_name(pr.second));
      CHECK(t.runs > 0);
      CHECK(t.problems.empty());
      if (pr.reached) CHECK(t.fired > 0);
    }
  }
}

// ---- kv_cache --------------------------------------------------------------------------------

namespace {

kv_cache_config kv_config() {
  kv_cache_config c;
  c.layers = 1;  // two buffers (K, V)
  c.kv_heads = 1;
  c.head_dim = 1024;
  c.elem_bytes = 2;  // 2 KiB a token: 1024 tokens a 2 MiB page
  c.max_seqs = 3;
  c.max_tokens = 3072;  // 3 pages
  return c;
}

struct kv_step {
  enum kind_t { open, append, truncate, close, trim } kind;
  std::size_t seq = 0, n = 0;
};
// Created pages, pooled pages, then a mapping that takes pooled ones and creates the rest.
const std::vector<kv_step> kKvScript = {
    {kv_step::open, 0},          {kv_step::append, 0, 1500},  // 2 pages x 2 buffers created
    {kv_step::open, 1},          {kv_step::append, 1, 2500},  // 3 pages x 2 created
    {kv_step::close, 0},                                      // 4 pooled
    {kv_step::open, 2},          {kv_step::append, 2, 3000},  // 4 pooled + 2 created
    {kv_step::truncate, 1, 100},                              // 4 pooled again
    {kv_step::append, 1, 2900},                               // 4 pooled
    {kv_step::open, 0},          {kv_step::append, 0, 3072},  // 6 created
    {kv_step::close, 2},         {kv_step::trim, 0, 2},       // 6 pooled, 2 kept
    {kv_step::append, 1, 72},                                 // no new page
    {kv_step::open, 2},          {kv_step::append, 2, 3000},  // 2 pooled + 4 created
    {kv_step::close, 1},
};

void kv_run(const pair_spec* pr, std::uint64_t k, fault f, fault f2, std::uint64_t times, sweep_tally& t,
            std::array<std::uint64_t, op_count>* count_calls) {
  auto host = make_backend<host_backend>(sweep_host_options());
  host_backend* hb = backend_cast<host_backend>(*host);
  auto st = std::make_shared<fault_state>();
  const std::string what = pr ? describe(*pr, k, f, f2, times) : std::string("unarmed");
  auto problem = [&](const std::string& s) { t.problems.push_back("kv_cache " + what + ": " + s); };
  {
    kv_cache kv(make_fault_over(*host, st), kv_config());
    const std::size_t P = kv.page_size(), seqs = kv.config().max_seqs;
    if (pr) st->arm_then(pr->first, k, f, pr->second, f2, times);
    // A mark word at the start of every page in use, per (slot, buffer, page), with the epoch of
    // the write; rewritten for the pages an append adds.
    std::vector<std::uint64_t> epoch(seqs * 2 * kv.max_pages(), 0);
    std::uint64_t writes = 0;
    auto page_ptr = [&](std::size_t s, std::size_t buf, std::size_t p) {
      return static_cast<unsigned char*>(buf ? kv.v(s, 0) : kv.k(s, 0)) + p * P;
    };
    auto slot = [&](std::size_t s, std::size_t buf, std::size_t p) { return (s * 2 + buf) * kv.max_pages() + p; };
    auto mark = [&](std::size_t s, std::size_t from, std::size_t to) {
      ++writes;
      for (std::size_t buf = 0; buf < 2; ++buf)
        for (std::size_t p = from; p < to; ++p) {
          epoch[slot(s, buf, p)] = writes;
          const std::uint64_t w = splitmix64(slot(s, buf, p) * 1000003 + writes);
          std::memcpy(page_ptr(s, buf, p), &w, 8);
        }
    };
    auto intact = [&]() {
      for (std::size_t s = 0; s < seqs; ++s) {
        if (!kv.is_open(s)) continue;
        for (std::size_t buf = 0; buf < 2; ++buf)
          for (std::size_t p = 0; p < kv.pages_for(kv.length(s)); ++p) {
            std::uint64_t w;
            std::memcpy(&w, page_ptr(s, buf, p), 8);
            if (w != splitmix64(slot(s, buf, p) * 1000003 + epoch[slot(s, buf, p)])) return false;
          }
      }
      return true;
    };
    auto run_step = [&](const kv_step& x) {
      return caught([&] {
        switch (x.kind) {
          case kv_step::open: (void)kv.open(x.seq); break;
          case kv_step::append: {
            const std::size_t from = kv.pages_for(kv.length(x.seq));
            kv.append(x.seq, x.n);
            mark(x.seq, from, kv.pages_for(kv.length(x.seq)));
            break;
          }
          case kv_step::truncate: kv.truncate(x.seq, x.n); break;
          case kv_step::close: kv.close(x.seq); break;
          case kv_step::trim: (void)kv.trim(x.n); break;
        }
      });
    };
    for (std::size_t i = 0; i < kKvScript.size(); ++i) {
      const kv_step& x = kKvScript[i];
      const bool was_open = kv.is_open(x.seq);
      const std::size_t len = was_open ? kv.length(x.seq) : 0, pages = was_open ? kv.mapped_pages(x.seq) : 0;
      const std::uint64_t inj = st->injected();
      status r = run_step(x);
      const bool now = st->injected() > inj;
      if (now) st->disarm();
      const std::string where = "step " + std::to_string(i);
      if (!r.ok()) {
        if (!now || !st->was_injected(r)) problem(where + " failed with " + r.message() + ", not an injected fault");
        if (x.kind == kv_step::append && (kv.length(x.seq) != len || kv.mapped_pages(x.seq) != pages))
          problem(where + ": a failed append changed the length or the mapped pages");
        if (!agree(*st, *hb)) problem(where + ": decorator and host backend disagree after the failure");
        if (!intact()) problem(where + ": contents changed by a failed call");
        if (x.kind == kv_step::append) {
          r = run_step(x);  // the fault is spent: the same call succeeds
          if (!r.ok()) problem(where + ": still fails after the fault was spent: " + r.message());
        }
      }
      if (!intact()) problem(where + ": contents lost");
      if (!agree(*st, *hb)) problem(where + ": decorator and host backend disagree");
      const auto s = kv.stats();
      if (hb->live_handles() < s.pages_mapped + s.pages_pooled)
        problem(where + ": the host holds fewer handles than the cache maps and pools");
    }
    if (count_calls) *count_calls = st->all_calls();
    // Keeps serving: every slot open at max_tokens (every page of the reservation mapped: a stray
    // mapping counted as unmapped would make a map refused), written and read back.
    for (std::size_t s = 0; s < seqs; ++s) {
      if (!kv.is_open(s)) (void)kv.open(s);
      const std::size_t from = kv.pages_for(kv.length(s));
      if (status r = caught([&] { kv.append(s, kv.config().max_tokens - kv.length(s)); }); !r.ok())
        problem("filling slot " + std::to_string(s) + ": " + r.message());
      mark(s, from, kv.max_pages());
    }
    if (!intact()) problem("contents lost filling every slot");
    if (kv.stats().pages_mapped != seqs * 2 * kv.max_pages()) problem("not every page of the layout is mapped");
    for (std::size_t s = 0; s < seqs; ++s) kv.close(s);
    if (status r = caught([&] { (void)kv.trim(0); }); !r.ok()) problem("trim(0): " + r.message());
    if (counts_of(*hb) != host_counts{0, 0, 1}) problem("an emptied, trimmed cache still holds handles or mappings");
  }
  if (!st->nothing_live() || counts_of(*hb) != host_counts{}) problem("objects left after destruction");
  t.fired += st->injected_then() > 0;
  ++t.runs;
}

}  // namespace

TEST_CASE("pairs in kv_cache::append (pooled and created pages in one mapping): every k, second refused 1-3 times or sticky") {
  const pair_spec pairs[] = {
      {op::create, op::release, true},      // pages created earlier in the job are released
      {op::map, op::unmap, true},           // earlier pages of the job are unmapped
      {op::map, op::release, true},         // the created page that failed to map is released
      {op::set_access, op::unmap, true},
      {op::set_access, op::release, true},
  };
  sweep_tally base;
  std::array<std::uint64_t, op_count> calls{};
  kv_run(nullptr, 0, {}, {}, 0, base, &calls);
  report(base.problems);
  REQUIRE(base.problems.empty());
  for (const auto& pr : pairs) {
    const sweep_tally t = sweep_pair("kv_cache", pr, calls[static_cast<int>(pr.first)],
                                     [&](std::uint64_t k, fault f, fault f2, std::uint64_t times, sweep_tally& tt) {
                                       kv_run(&pr, k, f, f2, times, tt, nullptr);
                                     });
    CAPTURE(op_name(pr.first));
    CAPTURE(op_name(pr.second));
    CHECK(t.runs > 0);
    CHECK(t.problems.empty());
    if (pr.reached) CHECK(t.fired > 0);
  }
}

// ---- IPC import --------------------------------------------------------------------------------

namespace {

struct exporter {
  allocator a;
  void* p = nullptr;
  std::size_t n = 12 * MiB;
  static options opts() {
    options o;
    o.ipc = ipc_kind::posix_fd;
    o.reservation_size = std::size_t{1} << 30;
    return o;
  }
  exporter() : a(allocator::host(opts())) {
    two_free_chunks(a);  // under an ipc policy every allocation is whole chunks (the huge path)
    p = a.allocate(n);   // three chunks: two stitched idle handles and a created one
    fill_block(p, n, 77, n);
  }
  ~exporter() { a.deallocate(p); }
};

// Rollback bookkeeping of try_import: a release refused twice is parked and retried (twice more)
// before the call returns; only what is still refused then leaks, and the message says so.
void ipc_run(exporter& ex, const pair_spec& pr, std::uint64_t k, fault f, fault f2, std::uint64_t times,
             sweep_tally& t) {
  auto host = make_backend<host_backend>(sweep_host_options());
  host_backend* hb = backend_cast<host_backend>(*host);
  auto st = std::make_shared<fault_state>();
  const std::string what = describe(pr, k, f, f2, times);
  auto problem = [&](const std::string& s) { t.problems.push_back("import " + what + ": " + s); };
  auto fb = make_fault_over(*host, st);
  host_counts leaked{};
  {
    ipc::export_handle h = ex.a.export_ipc(ex.p);
    if (h.chunks.size() != 3) problem("the export has " + std::to_string(h.chunks.size()) + " chunks, not 3");
    st->arm_then(pr.first, k, f, pr.second, f2, times);
    ipc::imported m;
    std::string why;
    status r = ipc::try_import(*fb, std::move(h), {}, m, &why);
    const std::uint64_t fired = st->injected_then();
    st->disarm();
    if (r.ok() || !st->was_injected(r)) problem("returned " + (r.ok() ? std::string("success") : r.message()));
    if (m) problem("a failed import produced a mapping");
    if (!agree(*st, *hb)) problem("decorator and host backend disagree after the failure");
    leaked = counts_of(*hb);
    const bool leak_reported = why.find("leaked") != std::string::npos;
    if (times != kSticky && leaked != host_counts{})
      problem("a refusal the rollback's retries absorb left objects: handles " + std::to_string(leaked.handles) +
              ", mappings " + std::to_string(leaked.mappings) + ", reservations " + std::to_string(leaked.reservations));
    if (leaked != host_counts{} && !leak_reported) problem("objects left behind without saying so: " + why);
    if (leaked == host_counts{} && leak_reported) problem("a leak reported, none found: " + why);
    if (leaked.mappings && !leaked.reservations) problem("a mapping left behind without its reservation");
    t.fired += fired > 0;
  }
  {
    // Keeps serving: the same export imports, reads the exporter's bytes, and closes to nothing.
    ipc::imported m;
    std::string why;
    status r = ipc::try_import(*fb, ex.a.export_ipc(ex.p), {}, m, &why);
    if (!r.ok()) {
      problem("import after the fault was spent: " + why);
    } else {
      std::size_t bad;
      verify_block(m.get(), ex.n, 77, &bad, ex.n);
      if (bad != SIZE_MAX) problem("imported bytes differ at " + std::to_string(bad));
      if (!m.close().ok()) problem("close() failed");
    }
    if (counts_of(*hb) != leaked) problem("an import and close left objects behind");
  }
  ++t.runs;
}

}  // namespace

TEST_CASE("pairs in ipc::try_import of a three-chunk export: every k, second refused 1-3 times or sticky") {
  exporter ex;
  const pair_spec pairs[] = {
      {op::import_handle, op::release, true},  // chunks imported before the refused one
      {op::map, op::unmap, true},
      {op::map, op::release, true},
      {op::set_access, op::unmap, true},
      {op::set_access, op::release, true},
  };
  for (const auto& pr : pairs) {
    // One import of three chunks: three import_handle and map calls, one set_access.
    const std::uint64_t n = pr.first == op::set_access ? 1 : 3;
    const sweep_tally t = sweep_pair("ipc import", pr, n,
                                     [&](std::uint64_t k, fault f, fault f2, std::uint64_t times, sweep_tally& tt) {
                                       ipc_run(ex, pr, k, f, f2, times, tt);
                                     });
    CAPTURE(op_name(pr.first));
    CAPTURE(op_name(pr.second));
    CHECK(t.problems.empty());
    CHECK(t.fired > 0);
  }
  CHECK(ex.a.check() == "");
}
