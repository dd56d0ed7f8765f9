// SPDX-License-Identifier: Apache-2.0
// Growth and release under threads on the real driver. main() is gpu_main.cpp: without a device
// this program exits 77.
//
//   race    the program that aborted the process on an H200 (a double free inside cuMemUnmap):
//           six threads, memory_limit 64 MiB, 64 B .. 64 MiB requests, trim(0) every ~1000
//           operations, for VMM_GPU_RACE_MS (3000). Kernels write every block; the cap holds,
//           check() is clean, everything comes back.
//   matrix  tests/support/growth_matrix.hpp's cells (every combination of the options that change
//           growth and release; CI runs the same cells on the host backend) on the device, with
//           kernels filling and checking every block. Each cell runs VMM_GPU_MATRIX_MS (900);
//           VMM_GPU_MATRIX_CELLS=3,17 runs only those (compute-sanitizer runs one).
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <random>
#include <thread>
#include <vector>

#include "gpu_util.cuh"
#include "support/growth_matrix.hpp"
#include "vmmalloc/vmmalloc.hpp"

namespace {

constexpr std::size_t MiB = vmm::test::matrix::MiB, GiB = vmm::test::matrix::GiB;
using vmm::test::matrix::blk;
using vmm::test::matrix::clock_type;
using vmm::test::matrix::tally;

// The device's side of the matrix: kernels fill and check the blocks on each thread's stream.
struct gpu_env {
  using stream_type = cudaStream_t;
  vmm::allocator make(const vmm::options& o) { return vmm::allocator(o); }
  cudaStream_t stream(int i) { return gpu::stream(i); }
  void fill(void* p, std::size_t n, std::uint64_t seed, cudaStream_t s) { gpu::fill(p, n, seed, s); }
  std::uint64_t verify(const void* p, std::size_t n, std::uint64_t seed, cudaStream_t s) {
    return gpu::verify(p, n, seed, s);
  }
  void quiesce() { GPU_CHECK(cudaDeviceSynchronize()); }
  std::size_t free_memory() {
    std::size_t f = 0, total = 0;
    gpu::device_memory(f, total);
    return f;
  }
  void after() {}  // the device's free memory is compared once, after every cell
};

}  // namespace

TEST_CASE("gpu race: six threads, a memory limit and trim() beside growths (the program that aborted)") {
  const std::size_t limit = 64 * MiB;
  const auto run_for = std::chrono::milliseconds(gpu::env_u64("VMM_GPU_RACE_MS", 3000));
  vmm::options o;
  o.memory_limit = limit;
  o.reservation_size = 1 * GiB;
  vmm::allocator a(o);
  gpu_env env;
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
          vmm::test::matrix::allocate_into(a, env, t, seeds, size, s, mine);
        } else if (!mine.empty()) {
          const std::size_t k = r() % mine.size();
          if (r() % 4 == 0) t.wrong += gpu::verify(mine[k].p, mine[k].n, mine[k].seed, s);
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
  CHECK(t.wrong.load() == 0);
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

TEST_CASE("gpu matrix: every option that changes growth and release, under threads, streams and cross-thread frees") {
  const auto run_for = std::chrono::milliseconds(gpu::env_u64("VMM_GPU_MATRIX_MS", 900));
  std::size_t f0 = 0, total = 0;
  gpu::device_memory(f0, total);
  gpu_env env;
  vmm::test::matrix::run_all(env, run_for, "VMM_GPU_MATRIX_CELLS");
  std::size_t f1 = 0;
  gpu::device_memory(f1, total);
  MESSAGE("cudaMemGetInfo free: " << (f0 >> 20) << " MiB before the cells, " << (f1 >> 20) << " MiB after");
  if (!gpu::skip_meminfo_checks())
    CHECK(f1 + gpu::env_u64("VMM_GPU_MEMINFO_SLACK_MIB", 8) * MiB >= f0);
}
