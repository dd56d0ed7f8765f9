// SPDX-License-Identifier: Apache-2.0
// Growth and release under threads on the real driver. main() is gpu_main.cpp: without a device
// this program exits 77.
//
//   race    the program that aborted the process on an H200 (a double free inside cuMemUnmap):
//           six threads, memory_limit 64 MiB, 64 B .. 64 MiB requests, trim(0) every ~1000
//           operations, for VMM_GPU_RACE_MS (3000). Kernels write every block; the cap holds,
//           check() is clean, everything comes back.
//   matrix  every combination of the options that change growth and release: threads (1, 4, 16)
//           x {no limit, 256 MiB} x release_threshold {max, 0} x {trim racing, none} x
//           thread caches {on, off}, then free_memory_margin on, and ipc (posix_fd: every block on
//           chunks of its own) with and without the limit. Mixed sizes 64 B .. 384 MiB, one stream per thread, blocks
//           handed to other threads and freed there on their streams. Each cell runs
//           VMM_GPU_MATRIX_MS (900); VMM_GPU_MATRIX_CELLS=3,17 runs only those (compute-sanitizer
//           runs one). Every cell: no abort, check() clean, the cap never exceeded, every byte
//           back after trim(0). One table row per cell on stdout.
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "gpu_util.cuh"
#include "vmmalloc/vmmalloc.hpp"

namespace {

constexpr std::size_t KiB = 1024, MiB = 1024 * KiB, GiB = 1024 * MiB;
using clock_type = std::chrono::steady_clock;

struct blk {
  void* p;
  std::size_t n;
  std::uint64_t seed;
};

// What the threads of one run saw.
struct tally {
  std::atomic<std::uint64_t> ops{0}, allocs{0}, oom{0}, bad_bytes{0}, handed{0};
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

}  // namespace

TEST_CASE("gpu race: six threads, a memory limit and trim() beside growths (the program that aborted)") {
  const std::size_t limit = 64 * MiB;
  const auto run_for = std::chrono::milliseconds(gpu::env_u64("VMM_GPU_RACE_MS", 3000));
  vmm::options o;
  o.memory_limit = limit;
  o.reservation_size = 1 * GiB;
  vmm::allocator a(o);
  tally t;
  std::atomic<std::uint64_t> seeds{1};
  const auto until = clock_type::now() + run_for;
  std::vector<std::thread> ts;
  for (int i = 0; i < 6; ++i)
    ts.emplace_back([&, i] {
      std::mt19937_64 r(0x5eed + static_cast<std::uint64_t>(i));
      cudaStream_t s = gpu::stream(i);
      std::vector<blk> mine;
      for (std::uint64_t n = 1; clock_type::now() < until; ++n) {
        ++t.ops;
        if (n % 1000 == 0) a.trim(0);
        if (mine.size() < 32 && r() % 3 != 0) {
          const int k = std::uniform_int_distribution<int>(6, 25)(r);
          const std::size_t size = (std::size_t{1} << k) + r() % (std::size_t{1} << k);
          void* p = a.try_allocate(size, 0, s);
          if (!p) {
            if (vmm::last_error().st.kind == vmm::errc::out_of_memory) ++t.oom;
            else t.failed(vmm::last_error().message);
            continue;
          }
          ++t.allocs;
          const std::uint64_t seed = seeds.fetch_add(1);
          gpu::fill(p, size, seed, s);
          mine.push_back({p, size, seed});
        } else if (!mine.empty()) {
          const std::size_t k = r() % mine.size();
          if (r() % 4 == 0) t.bad_bytes += gpu::verify(mine[k].p, mine[k].n, mine[k].seed, s);
          a.deallocate(mine[k].p, s);  // stream-ordered behind its fill
          mine[k] = mine.back();
          mine.pop_back();
        }
      }
      for (const blk& b : mine) a.deallocate(b.p, s);
    });
  for (auto& th : ts) th.join();
  GPU_CHECK(cudaDeviceSynchronize());
  const auto s = a.stats();
  MESSAGE(t.ops.load() << " operations, " << t.allocs.load() << " allocations, " << t.oom.load()
                       << " out of memory; peak physical " << (s.peak_physical >> 20) << " MiB; driver calls: "
                       << s.calls.create << " create, " << s.calls.map << " map, " << s.calls.unmap << " unmap, "
                       << s.calls.release << " release");
  for (const auto& m : t.other) FAIL_CHECK("a failure that is not out_of_memory: " << m);
  CHECK(t.bad_bytes.load() == 0);
  CHECK(t.allocs.load() > 0);
  CHECK(s.peak_physical <= limit);
  CHECK(s.live == 0);
  CHECK(a.check() == "");
  void* half = a.try_allocate(limit / 2);
  INFO("last error: " << vmm::last_error().message);
  REQUIRE(half != nullptr);
  gpu::fill(half, limit / 2, 99, nullptr);
  CHECK(gpu::verify(half, limit / 2, 99, nullptr) == 0);
  a.deallocate(half);
  a.trim(0);
  CHECK(a.stats().physical == 0);
}

namespace {

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

std::vector<cell> all_cells() {
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
std::size_t pick(std::mt19937_64& r) {
  if (r() % 32 == 0) return 128 * MiB + r() % (256 * MiB);
  const int k = std::uniform_int_distribution<int>(6, 25)(r);
  return (std::size_t{1} << k) + r() % (std::size_t{1} << k);
}

// Runs one cell; returns its table row. Assertions inside are the cell's.
std::string run_cell(const cell& c, std::size_t index, std::chrono::milliseconds run_for) {
  const std::size_t limit = 256 * MiB;
  vmm::options o;
  o.reservation_size = 16 * GiB;
  if (c.limited) o.memory_limit = limit;
  if (c.release_all) o.release_threshold = 0;
  o.thread_cache = c.caches;
  if (c.ipc) o.ipc = vmm::ipc_kind::posix_fd;
  if (c.margin) {  // every growth past the first 512 MiB held finds the device short of the margin
    std::size_t f = 0, total = 0;
    gpu::device_memory(f, total);
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
    vmm::allocator a(o);
    std::vector<std::thread> ts;
    for (int i = 0; i < c.threads; ++i)
      ts.emplace_back([&, i] {
        std::mt19937_64 r(0xce11 + index * 131 + static_cast<std::uint64_t>(i));
        cudaStream_t st = gpu::stream(i);
        std::vector<blk> mine;
        auto free_one = [&](const blk& b) {
          if (r() % 8 == 0) t.bad_bytes += gpu::verify(b.p, b.n, b.seed, st);
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
            const std::size_t size = pick(r);
            void* p = a.try_allocate(size, 0, st);
            if (!p) {
              if (vmm::last_error().st.kind == vmm::errc::out_of_memory) ++t.oom;
              else t.failed(vmm::last_error().message);
              continue;
            }
            ++t.allocs;
            const std::uint64_t seed = seeds.fetch_add(1);
            gpu::fill(p, size, seed, st);
            mine.push_back({p, size, seed});
          } else if (!mine.empty()) {
            const std::size_t k = r() % mine.size();
            const blk x = mine[k];
            mine[k] = mine.back();
            mine.pop_back();
            if (c.threads > 1 && r() % 4 == 0) {
              // Handed over: its fill must be done before another stream touches it.
              t.bad_bytes += gpu::verify(x.p, x.n, x.seed, st);
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
    GPU_CHECK(cudaDeviceSynchronize());
    s = a.stats();
    problems = a.check();
    CHECK(problems == "");
    a.trim(0);
    const auto after = a.stats();
    CHECK(after.physical == 0);
    CHECK(after.live == 0);
  }
  for (const auto& m : t.other) FAIL_CHECK("a failure that is not out_of_memory: " << m);
  CHECK(t.bad_bytes.load() == 0);
  CHECK(t.allocs.load() > 0);
  if (c.limited) CHECK(s.peak_physical <= limit);
  const double secs = std::chrono::duration<double>(clock_type::now() - t0).count();
  char row[320];
  std::snprintf(row, sizeof row, "| %3zu | %-40s | %8llu | %7llu | %6llu | %7llu | %6zu | %6llu | %5.2f | %s |", index,
                c.name().c_str(), static_cast<unsigned long long>(t.ops.load()),
                static_cast<unsigned long long>(t.allocs.load()), static_cast<unsigned long long>(t.oom.load()),
                static_cast<unsigned long long>(t.handed.load()), s.peak_physical >> 20,
                static_cast<unsigned long long>(s.calls.create + s.calls.map + s.calls.unmap + s.calls.release +
                                                s.calls.set_access),
                secs, problems.empty() && t.other.empty() && t.bad_bytes == 0 ? "ok" : "FAILED");
  return row;
}

// VMM_GPU_MATRIX_CELLS, or every cell. A cell that does not exist fails the case (a run that
// names none would otherwise pass having run nothing).
std::vector<std::size_t> chosen_cells(std::size_t count) {
  std::vector<std::size_t> v;
  if (const char* e = std::getenv("VMM_GPU_MATRIX_CELLS"); e && *e) {
    std::stringstream ss(e);
    std::string item;
    while (std::getline(ss, item, ',')) {
      if (item.empty()) continue;
      const std::size_t i = std::strtoul(item.c_str(), nullptr, 10);
      if (item.find_first_not_of("0123456789") != std::string::npos || i >= count)
        FAIL("VMM_GPU_MATRIX_CELLS: no cell '" << item << "' (cells 0-" << count - 1 << ")");
      v.push_back(i);
    }
    REQUIRE_FALSE(v.empty());
    return v;
  }
  for (std::size_t i = 0; i < count; ++i) v.push_back(i);
  return v;
}

}  // namespace

TEST_CASE("gpu matrix: every option that changes growth and release, under threads, streams and cross-thread frees") {
  const auto cells = all_cells();
  const auto run_for = std::chrono::milliseconds(gpu::env_u64("VMM_GPU_MATRIX_MS", 900));
  std::printf("| cell | options | ops | allocs | oom | handed | peak MiB | driver calls | s | result |\n"
              "|---|---|---|---|---|---|---|---|---|---|\n");
  std::fflush(stdout);
  std::size_t f0 = 0, total = 0;
  gpu::device_memory(f0, total);
  for (std::size_t i : chosen_cells(cells.size())) {
    CAPTURE(cells[i].name());
    const std::string row = run_cell(cells[i], i, run_for);
    std::printf("%s\n", row.c_str());
    std::fflush(stdout);
  }
  std::size_t f1 = 0;
  gpu::device_memory(f1, total);
  MESSAGE("cudaMemGetInfo free: " << (f0 >> 20) << " MiB before the cells, " << (f1 >> 20) << " MiB after");
  if (!gpu::skip_meminfo_checks())
    CHECK(f1 + gpu::env_u64("VMM_GPU_MEMINFO_SLACK_MIB", 8) * MiB >= f0);
}
