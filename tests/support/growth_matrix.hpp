// SPDX-License-Identifier: Apache-2.0
// The growth/release matrix: every combination of the options that change growth and release,
// under threads, streams and cross-thread frees. One definition for both backends: the GPU suite
// runs it on the real driver (tests/gpu/test_gpu_matrix.cpp, tools/gpu-check's matrix step), CI
// on the host backend with the driver's call times, handle reuse and streams running behind
// (tests/concurrency/test_matrix.cpp), so that a combination that breaks fails in CI first.
//
// Cells: threads (1, 4, 16) x {no limit, 256 MiB} x release_threshold {max, 0} x {trim racing,
// none} x thread caches {on, off}, then free_memory_margin on, and ipc (posix_fd: every block on
// chunks of its own) with and without the limit. Mixed sizes 64 B .. 384 MiB, one stream per
// thread, blocks handed to other threads and freed there on their streams. Every cell: no failure
// but out_of_memory, check() clean, the cap never exceeded, every block reads back what was
// written, everything back after trim(0). One table row per cell on stdout.
//
// The backend's side, Env:
//   stream_type                                    a stream (cudaStream_t, or a host tag)
//   vmm::allocator make(const vmm::options&)       the allocator of one cell
//   stream_type stream(int i)                      thread i's stream
//   void fill(void*, size_t, uint64_t seed, stream_type)
//   uint64_t verify(const void*, size_t, uint64_t seed, stream_type)  what reads back wrong, once
//                                                  the stream's earlier work is done (0: intact)
//   void quiesce()                                 every stream's work done; before the checks
//   size_t free_memory()                           the device's free memory (the margin's cells)
//   void after()                                   checks once the cell's allocator is destroyed
#pragma once

#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "vmmalloc/vmmalloc.hpp"

namespace vmm::test::matrix {

constexpr std::size_t MiB = std::size_t{1} << 20, GiB = std::size_t{1} << 30;
constexpr std::size_t kLimit = 256 * MiB;  // the limited cells' memory_limit
using clock_type = std::chrono::steady_clock;

struct blk {
  void* p;
  std::size_t n;
  std::uint64_t seed;
};

// What the threads of one run saw.
struct tally {
  std::atomic<std::uint64_t> ops{0}, allocs{0}, oom{0}, wrong{0}, handed{0};
  std::mutex mu;
  std::vector<std::string> other;  // failures that are not out_of_memory
  void failed(const std::string& m) {
    std::lock_guard g(mu);
    if (other.size() < 8) other.push_back(m);
  }
};

// Blocks one thread hands to another, which frees them on its own stream.
struct handoff {
  std::mutex mu;
  std::vector<blk> v;
  void put(const blk& b) {
    std::lock_guard g(mu);
    v.push_back(b);
  }
  bool take(blk& b) {
    std::lock_guard g(mu);
    if (v.empty()) return false;
    b = v.back();
    v.pop_back();
    return true;
  }
};

struct cell {
  int threads;
  bool limited, release_all, trim_racing, caches;
  bool margin = false, ipc = false;
  std::string name() const {
    std::ostringstream s;
    s << threads << "t " << (limited ? "limit" : "nolimit") << ' ' << (release_all ? "rt0" : "rtmax") << ' '
      << (trim_racing ? "trim" : "notrim") << ' ' << (caches ? "caches" : "nocaches");
    if (margin) s << " margin";
    if (ipc) s << " ipc";
    return s.str();
  }
};

inline std::vector<cell> all_cells() {
  std::vector<cell> v;
  for (int th : {1, 4, 16})
    for (bool lim : {false, true})
      for (bool rt : {false, true})
        for (bool tr : {true, false})
          for (bool tc : {true, false}) v.push_back({th, lim, rt, tr, tc});
  cell margin{16, false, false, true, true};
  margin.margin = true;
  v.push_back(margin);
  margin.trim_racing = false;
  margin.caches = false;
  v.push_back(margin);
  cell ipc{16, false, false, true, true};
  ipc.ipc = true;
  v.push_back(ipc);
  ipc.limited = true;
  v.push_back(ipc);
  return v;
}

// Log-uniform 64 B .. 64 MiB, and 1 in 32 a block of 128-384 MiB.
inline std::size_t pick(std::mt19937_64& r) {
  if (r() % 32 == 0) return 128 * MiB + r() % (256 * MiB);
  const int k = std::uniform_int_distribution<int>(6, 25)(r);
  return (std::size_t{1} << k) + r() % (std::size_t{1} << k);
}

// One allocation of `size` on stream st, filled and kept in `mine`; a refusal other than
// out_of_memory is kept in the tally.
template <class Env, class Stream>
void allocate_into(vmm::allocator& a, Env& env, tally& t, std::atomic<std::uint64_t>& seeds, std::size_t size,
                   Stream st, std::vector<blk>& mine) {
  void* p = a.try_allocate(size, 0, st);
  if (!p) {
    if (vmm::last_error().st.kind == vmm::errc::out_of_memory) ++t.oom;
    else t.failed(vmm::last_error().message);
    return;
  }
  ++t.allocs;
  const std::uint64_t seed = seeds.fetch_add(1);
  env.fill(p, size, seed, st);
  mine.push_back({p, size, seed});
}

// Runs one cell; returns its table row. Assertions inside are the cell's.
template <class Env>
std::string run_cell(Env& env, const cell& c, std::size_t index, std::chrono::milliseconds run_for) {
  vmm::options o;
  o.reservation_size = 16 * GiB;
  if (c.limited) o.memory_limit = kLimit;
  if (c.release_all) o.release_threshold = 0;
  o.thread_cache = c.caches;
  if (c.ipc) o.ipc = vmm::ipc_kind::posix_fd;
  if (c.margin) {  // every growth past the first 512 MiB held finds the device short of the margin
    const std::size_t f = env.free_memory();
    o.free_memory_margin = f > GiB ? f - 512 * MiB : f / 2;
  }
  tally t;
  handoff h;
  std::atomic<std::uint64_t> seeds{1};
  const auto t0 = clock_type::now();
  const auto until = t0 + run_for;
  vmm::allocator_stats s;
  std::string problems;
  {
    vmm::allocator a = env.make(o);
    std::vector<std::thread> ts;
    for (int i = 0; i < c.threads; ++i)
      ts.emplace_back([&, i] {
        std::mt19937_64 r(0xce11 + index * 131 + static_cast<std::uint64_t>(i));
        const auto st = env.stream(i);
        std::vector<blk> mine;
        auto free_one = [&](const blk& b) {
          if (r() % 8 == 0) t.wrong += env.verify(b.p, b.n, b.seed, st);
          a.deallocate(b.p, st);
        };
        for (std::uint64_t n = 1; clock_type::now() < until; ++n) {
          ++t.ops;
          if (c.trim_racing && n % 500 == 0) a.trim(0);
          blk b{};
          if (r() % 8 == 0 && h.take(b)) {  // another thread's block: freed here, on this stream
            free_one(b);
            continue;
          }
          if (mine.size() < 12 && r() % 3 != 0) {
            allocate_into(a, env, t, seeds, pick(r), st, mine);
          } else if (!mine.empty()) {
            const std::size_t k = r() % mine.size();
            const blk x = mine[k];
            mine[k] = mine.back();
            mine.pop_back();
            if (c.threads > 1 && r() % 4 == 0) {
              // Handed over: its fill must be done before another stream touches it.
              t.wrong += env.verify(x.p, x.n, x.seed, st);
              h.put(x);
              ++t.handed;
            } else {
              free_one(x);
            }
          }
        }
        for (const blk& b : mine) a.deallocate(b.p, st);
      });
    for (auto& th : ts) th.join();
    blk b{};
    while (h.take(b)) a.deallocate(b.p);
    env.quiesce();
    s = a.stats();
    problems = a.check();
    CHECK(problems == "");
    a.trim(0);
    const auto after = a.stats();
    CHECK(after.physical == 0);
    CHECK(after.live == 0);
  }
  env.after();
  for (const auto& m : t.other) FAIL_CHECK("a failure that is not out_of_memory: " << m);
  CHECK(t.wrong.load() == 0);
  CHECK(t.allocs.load() > 0);
  if (c.limited) CHECK(s.peak_physical <= kLimit);
  const double secs = std::chrono::duration<double>(clock_type::now() - t0).count();
  char row[320];
  std::snprintf(row, sizeof row, "| %3zu | %-40s | %8llu | %7llu | %6llu | %7llu | %6zu | %6llu | %5.2f | %s |", index,
                c.name().c_str(), static_cast<unsigned long long>(t.ops.load()),
                static_cast<unsigned long long>(t.allocs.load()), static_cast<unsigned long long>(t.oom.load()),
                static_cast<unsigned long long>(t.handed.load()), s.peak_physical >> 20,
                static_cast<unsigned long long>(s.calls.create + s.calls.map + s.calls.unmap + s.calls.release +
                                                s.calls.set_access),
                secs, problems.empty() && t.other.empty() && t.wrong == 0 ? "ok" : "FAILED");
  return row;
}

// The cells named in the variable `cells_var` (a comma list of indices), or every cell. A cell
// that does not exist fails the case (a run that names none would otherwise pass having run
// nothing).
inline std::vector<std::size_t> chosen_cells(std::size_t count, const char* cells_var) {
  std::vector<std::size_t> v;
  if (const char* e = std::getenv(cells_var); e && *e) {
    std::stringstream ss(e);
    std::string item;
    while (std::getline(ss, item, ',')) {
      if (item.empty()) continue;
      const std::size_t i = std::strtoul(item.c_str(), nullptr, 10);
      if (item.find_first_not_of("0123456789") != std::string::npos || i >= count)
        FAIL(cells_var << ": no cell '" << item << "' (cells 0-" << count - 1 << ")");
      v.push_back(i);
    }
    REQUIRE_FALSE(v.empty());
    return v;
  }
  for (std::size_t i = 0; i < count; ++i) v.push_back(i);
  return v;
}

// Every chosen cell, each for run_for, a table row each.
template <class Env>
void run_all(Env& env, std::chrono::milliseconds run_for, const char* cells_var) {
  const auto cells = all_cells();
  std::printf("| cell | options | ops | allocs | oom | handed | peak MiB | driver calls | s | result |\n"
              "|---|---|---|---|---|---|---|---|---|---|\n");
  std::fflush(stdout);
  for (std::size_t i : chosen_cells(cells.size(), cells_var)) {
    CAPTURE(cells[i].name());
    const std::string row = run_cell(env, cells[i], i, run_for);
    std::printf("%s\n", row.c_str());
    std::fflush(stdout);
  }
}

}  // namespace vmm::test::matrix
