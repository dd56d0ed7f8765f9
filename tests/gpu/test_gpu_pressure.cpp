// SPDX-License-Identifier: Apache-2.0
// GPU memory pressure on the CUDA backend. main() is gpu_main.cpp: without a device this program
// exits 77.
//
//   limit   threads allocate mixed sizes under options.memory_limit = 256 MiB, kernels write a
//           pattern into every block and check it before the (sometimes stream-ordered) free;
//           peak_physical never exceeds the limit, every failure is out_of_memory, and once every
//           thread is done limit - granularity is served without a trim()
//   device  the card itself runs out: cudaMalloc fillers take free memory down to a margin
//           (VMM_GPU_PRESSURE_MARGIN_MIB, 1024; never below 512 MiB free), then a request larger
//           than what is left fails cleanly (try_allocate: null + errc::out_of_memory; allocate:
//           vmm::out_of_memory), the allocator keeps serving what fits (a kernel writes and
//           checks it), and after freeing everything and destroying the allocator cudaMemGetInfo
//           shows the starting free memory again (within VMM_GPU_MEMINFO_SLACK_MIB)
//   margin  options.free_memory_margin: held free memory goes back when another user of the card
//           leaves a growth short of the margin (stats and cudaMemGetInfo both show it)
// Nothing here changes the card's settings.
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gpu_util.cuh"
#include "tuned.hpp"
#include "vmmalloc/vmmalloc.hpp"

namespace {

constexpr std::size_t KiB = 1024, MiB = 1024 * KiB, GiB = 1024 * MiB;

std::size_t slack() { return gpu::env_u64("VMM_GPU_MEMINFO_SLACK_MIB", 8) * MiB; }

std::size_t free_device_memory() {
  std::size_t f = 0, t = 0;
  gpu::device_memory(f, t);
  return f;
}

void check_memory_back(std::size_t before, const char* when) {
  const std::size_t now = free_device_memory();
  const long long delta_mib = (static_cast<long long>(now) - static_cast<long long>(before)) / static_cast<long long>(MiB);
  MESSAGE("cudaMemGetInfo " << when << ": free " << (now >> 20) << " MiB, at the start " << (before >> 20)
                            << " MiB, change " << delta_mib << " MiB");
  if (gpu::skip_meminfo_checks()) return;
  CHECK_MESSAGE(now + slack() >= before, "device memory not returned " << when << ": "
                                                                       << ((before - now) >> 20) << " MiB missing");
}

// Driver-side one-time costs (event pools, page tables) are paid before free memory is measured.
void warm_up() {
  vmm::options o;
  o.reservation_size = 4 * GiB;
  vmm::allocator a(o);
  cudaStream_t s1 = gpu::stream(1), s2 = gpu::stream(2);
  void* p = a.allocate(8 * MiB, 0, s1);
  gpu::fill(p, 8 * MiB, 1, s1);
  a.deallocate(p, s1);
  void* q = a.allocate(8 * MiB, 0, s2);
  a.deallocate(q, s2);
  GPU_CHECK(cudaDeviceSynchronize());
  a.trim(0);
}

// Log-uniform 256 B .. 96 MiB: small, mid, large and (threshold 32 MiB) huge.
std::size_t pick_size(std::mt19937_64& r) {
  std::uniform_int_distribution<int> lg(8, 26);
  const std::size_t hi = std::size_t{1} << lg(r);
  const std::size_t n = std::uniform_int_distribution<std::size_t>(hi / 2, hi)(r);
  return r() % 16 ? n : n + 64 * MiB;
}

}  // namespace

TEST_CASE("gpu pressure: memory_limit holds under threads, kernels write what they got") {
  const std::size_t limit = 256 * MiB;
  const int threads = 8;
  const std::uint64_t ops = std::max<std::uint64_t>(1, gpu::env_u64("VMM_GPU_PRESSURE_OPS", 4000) / threads);
  warm_up();
  const std::size_t f0 = free_device_memory();
  {
    vmm::options o;
    o.reservation_size = 16 * GiB;
    o.memory_limit = limit;
    vmm::tuning t;
    t.huge_threshold = 32 * MiB;
    vmm::allocator a = gpu::tuned(o, t);
    std::atomic<std::uint64_t> allocs{0}, oom{0}, bad_bytes{0}, next_seed{1};
    std::mutex mu;
    std::vector<std::string> other;  // failures that are not out_of_memory
    auto worker = [&](int t) {
      std::mt19937_64 r(0x9e55 + static_cast<std::uint64_t>(t));
      cudaStream_t s = gpu::stream(t);
      struct blk {
        void* p;
        std::size_t n;
        std::uint64_t seed;
      };
      std::vector<blk> live;
      auto release = [&](const blk& b) {
        if (r() % 2) bad_bytes += gpu::verify(b.p, b.n, b.seed, s);  // synchronises s
        a.deallocate(b.p, s);  // else stream-ordered, behind the fill still queued on s
      };
      for (std::uint64_t i = 0; i < ops; ++i) {
        if (live.size() >= 4 || (!live.empty() && r() % 3 == 0)) {
          const std::size_t k = r() % live.size();
          release(live[k]);
          live[k] = live.back();
          live.pop_back();
          continue;
        }
        const std::size_t n = pick_size(r);
        void* p = a.try_allocate(n, 0, s);
        if (!p) {
          if (vmm::last_error().st.kind == vmm::errc::out_of_memory) {
            ++oom;
          } else {
            std::lock_guard g(mu);
            other.push_back(vmm::last_error().message);
          }
          continue;
        }
        ++allocs;
        const std::uint64_t seed = next_seed.fetch_add(1);
        gpu::fill(p, n, seed, s);
        live.push_back({p, n, seed});
      }
      for (const blk& b : live) release(b);
    };
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t) pool.emplace_back(worker, t);
    for (auto& t : pool) t.join();
    GPU_CHECK(cudaDeviceSynchronize());
    MESSAGE(allocs.load() << " allocations, " << oom.load() << " out of memory, peak physical "
                          << (a.stats().peak_physical >> 20) << " MiB (limit " << (limit >> 20) << " MiB)");
    for (const auto& m : other) FAIL_CHECK("a failure that is not out_of_memory: " << m);
    CHECK(bad_bytes.load() == 0);
    CHECK(allocs.load() > 0);
    CHECK(a.stats().peak_physical <= limit);
    CHECK(a.stats().live == 0);
    CHECK(a.check() == "");
    // Every thread done, every free's stream synchronised: what the allocator holds is reclaimed by
    // the out-of-memory path itself, without a trim().
    void* big = a.try_allocate(limit - a.granularity());
    INFO("last error: " << vmm::last_error().message);
    CHECK(big != nullptr);
    if (big) {
      gpu::fill(big, limit - a.granularity(), 77, nullptr);
      CHECK(gpu::verify(big, limit - a.granularity(), 77, nullptr) == 0);
      a.deallocate(big);
    }
    CHECK(a.stats().peak_physical <= limit);
    CHECK(a.check() == "");
  }
  check_memory_back(f0, "after destroying the limited allocator");
}

TEST_CASE("gpu pressure: the device itself out of memory -> clean out_of_memory, still serving, all memory back") {
  const std::size_t margin = std::max<std::size_t>(gpu::env_u64("VMM_GPU_PRESSURE_MARGIN_MIB", 1024) * MiB, 512 * MiB);
  const std::size_t floor = 512 * MiB;  // never take the card below this
  warm_up();
  const std::size_t f0 = free_device_memory();
  MESSAGE("free at the start: " << (f0 >> 20) << " MiB; fill down to about " << (margin >> 20) << " MiB");
  std::vector<void*> fillers;
  // Large pieces first, halving as free memory nears the margin; a refused cudaMalloc only halves
  // the piece (its error is cleared: a failed cudaMalloc is not sticky).
  for (std::size_t piece = 4 * GiB; piece >= 64 * MiB;) {
    const std::size_t f = free_device_memory();
    if (f <= margin + 64 * MiB) break;
    if (f < piece + margin || f - piece < floor) {
      piece /= 2;
      continue;
    }
    void* p = nullptr;
    if (cudaMalloc(&p, piece) != cudaSuccess) {
      (void)cudaGetLastError();
      piece /= 2;
      continue;
    }
    fillers.push_back(p);
  }
  const std::size_t f_full = free_device_memory();
  MESSAGE("cudaMalloc fillers: " << fillers.size() << ", free now " << (f_full >> 20) << " MiB");
  REQUIRE(f_full >= floor);
  {
    vmm::options o;
    o.reservation_size = 16 * GiB;
    vmm::allocator a(o);
    void* keep = a.allocate(64 * MiB);  // live across the failures: must stay intact
    gpu::fill(keep, 64 * MiB, 5, nullptr);

    const std::size_t held = a.stats().physical;
    const std::size_t too_much = f_full + GiB;
    CHECK(a.try_allocate(too_much) == nullptr);
    CHECK(vmm::last_error().st.kind == vmm::errc::out_of_memory);
    MESSAGE("try_allocate(" << (too_much >> 20) << " MiB): " << vmm::last_error().message);
    CHECK_THROWS_AS((void)a.allocate(too_much), vmm::out_of_memory);
    CHECK(a.check() == "");
    CHECK(a.stats().physical <= held);  // the failed requests left nothing mapped or held

    // Still serving what fits: a quarter of what is left, and small blocks beside it.
    const std::size_t fits = std::max<std::size_t>((f_full / 4) / MiB * MiB, 64 * MiB);
    void* p = a.try_allocate(fits);
    INFO("last error: " << vmm::last_error().message);
    REQUIRE(p != nullptr);
    gpu::fill(p, fits, 11, nullptr);
    CHECK(gpu::verify(p, fits, 11, nullptr) == 0);
    std::vector<void*> small;
    for (int i = 0; i < 64; ++i) {
      void* q = a.try_allocate(1000 + 37 * static_cast<std::size_t>(i));
      CHECK(q != nullptr);
      if (q) {
        gpu::fill(q, 1000, 100 + static_cast<std::uint64_t>(i), nullptr);
        small.push_back(q);
      }
    }
    for (std::size_t i = 0; i < small.size(); ++i) CHECK(gpu::verify(small[i], 1000, 100 + i, nullptr) == 0);
    CHECK(gpu::verify(keep, 64 * MiB, 5, nullptr) == 0);

    // Once more past the end while memory is in use: refused again, nothing else disturbed.
    CHECK(a.try_allocate(too_much) == nullptr);
    CHECK(vmm::last_error().st.kind == vmm::errc::out_of_memory);
    CHECK(gpu::verify(p, fits, 11, nullptr) == 0);

    for (void* q : small) a.deallocate(q);
    a.deallocate(p);
    a.deallocate(keep);
    GPU_CHECK(cudaDeviceSynchronize());
    CHECK(a.check() == "");
  }
  for (void* p : fillers) GPU_CHECK(cudaFree(p));
  check_memory_back(f0, "after freeing the fillers and destroying the allocator");
}

// free_memory_margin on the card: the allocator holds 1 GiB of freed memory in two spans that a
// live huge block keeps apart; another user of the device (cudaMalloc) takes 2 GiB; the next
// growth (a 600 MiB block fits neither span) would leave less free than the margin, so every free
// chunk goes back first (what the growth can use is mapped again) and cudaMemGetInfo sees it.
TEST_CASE("gpu pressure: free_memory_margin gives held free memory back before a growth leaves the device short") {
  warm_up();
  const std::size_t f0 = free_device_memory();
  REQUIRE(f0 > 8 * GiB);
  vmm::options o;
  o.reservation_size = 16 * GiB;
  o.free_memory_margin = f0 - 3 * GiB;  // pressed once free memory falls near f0 - 3 GiB
  vmm::tuning t;
  t.thread_cache_large = false;  // every freed block goes back to the heap at once
  t.huge_headroom_div = 0;       // the huge block between spans A and B, which stay apart
  {
    vmm::allocator a = gpu::tuned(o, t);
    std::vector<void*> v;
    for (int i = 0; i < 16; ++i) v.push_back(a.allocate(32 * MiB));  // span A
    void* h = a.allocate(300 * MiB);                                  // a huge block after A
    for (int i = 0; i < 16; ++i) v.push_back(a.allocate(32 * MiB));  // span B, after it
    CHECK(a.stats().margin_trims == 0);  // the device had room for every growth
    for (void* p : v) a.deallocate(p);
    GPU_CHECK(cudaDeviceSynchronize());
    const std::size_t held = a.stats().physical;
    CHECK(held >= GiB + 300 * MiB);

    void* other = nullptr;
    GPU_CHECK(cudaMalloc(&other, 2 * GiB));  // another user of the device
    void* big = a.allocate(600 * MiB);       // fits neither span: a growth, now short of the margin
    gpu::fill(big, 600 * MiB, 21, nullptr);
    CHECK(gpu::verify(big, 600 * MiB, 21, nullptr) == 0);
    const auto s = a.stats();
    CHECK(s.margin_trims == 1);
    CHECK(s.physical <= 900 * MiB + 16 * MiB);  // the huge block and the new one; the rest went back
    const std::size_t f1 = free_device_memory();
    MESSAGE("held " << (held >> 20) << " MiB before; after the growth physical " << (s.physical >> 20)
                    << " MiB, device free " << (f1 >> 20) << " MiB (start " << (f0 >> 20) << " MiB)");
    if (!gpu::skip_meminfo_checks()) CHECK(f1 + 64 * MiB >= f0 - 2 * GiB - 900 * MiB);
    CHECK(a.check() == "");
    a.deallocate(big);
    a.deallocate(h);
    GPU_CHECK(cudaFree(other));
  }
  check_memory_back(f0, "after the margin case");
}
