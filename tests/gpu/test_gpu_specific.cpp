// SPDX-License-Identifier: Apache-2.0
// GPU-only tests: what the host backend cannot show. main() is gpu_main.cpp: without a device
// this program exits 77.
//
//   access   kernels and cudaMemcpy reach every byte of allocations that span several chunks
//   meminfo  trim(0) and destruction give device memory back, as cudaMemGetInfo sees it
//   streams  a block freed on a busy stream is not handed to another stream until that stream's
//            work is done (content check + direct overlap check); the same stream reuses it at once;
//            record_stream extends the wait to the recorded stream
//   stress   16 threads, random sizes 1 B .. 64 MiB on random real streams, kernel patterns checked
//            at every free, frees stream-ordered behind pending kernels (VMM_GPU_STRESS_OPS)
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "gpu_util.cuh"
#include "tuned.hpp"
#include "vmmalloc/vmmalloc.hpp"

namespace {

constexpr std::size_t KiB = 1024, MiB = 1024 * KiB, GiB = 1024 * MiB;

vmm::options test_options() {
  vmm::options o;
  o.reservation_size = 16 * GiB;
  return o;
}

std::size_t meminfo_slack() { return gpu::env_u64("VMM_GPU_MEMINFO_SLACK_MIB", 8) * MiB; }

std::size_t free_device_memory() {
  std::size_t f = 0, t = 0;
  gpu::device_memory(f, t);
  return f;
}

// Asserts that free device memory is back within the slack of `before` (or only reports it under
// VMM_GPU_SKIP_MEMINFO=1).
void check_memory_back(std::size_t before, const char* when) {
  const std::size_t now = free_device_memory();
  const long long delta_mib =
      (static_cast<long long>(now) - static_cast<long long>(before)) / static_cast<long long>(MiB);
  MESSAGE("cudaMemGetInfo " << when << ": free " << (now >> 20) << " MiB, start " << (before >> 20)
                            << " MiB, change " << delta_mib << " MiB");
  if (gpu::skip_meminfo_checks()) return;
  CHECK_MESSAGE(now + meminfo_slack() >= before,
                "device memory not returned " << when << ": " << ((before - now) >> 20)
                                              << " MiB missing (slack " << (meminfo_slack() >> 20)
                                              << " MiB)");
}

// Runs one allocator through growth, cross-stream fences, trim and destruction, so driver-side
// one-time costs (event pools, page-table pools) are paid before a test measures free memory.
void warm_up_allocator() {
  vmm::allocator a(test_options());
  cudaStream_t s1 = gpu::stream(1), s2 = gpu::stream(2);
  void* p = a.allocate(8 * MiB, 0, s1);
  gpu::fill(p, 8 * MiB, 1, s1);
  a.deallocate(p, s1);
  void* q = a.allocate(8 * MiB, 0, s2);  // records a fence on s1
  a.deallocate(q, s2);
  void* h = a.allocate(300 * MiB, 0, s1);
  a.deallocate(h, s1);
  GPU_CHECK(cudaDeviceSynchronize());
  a.trim(0);
}

// Bytes of host copy `h` (n bytes) that differ from the pattern of `seed`. Word-wise: fast enough
// for a GiB.
std::size_t host_mismatches(const unsigned char* h, std::size_t n, std::uint64_t seed) {
  std::size_t bad = 0;
  const std::size_t full = n / 8;
  for (std::size_t w = 0; w < full; ++w) {
    std::uint64_t got;
    std::memcpy(&got, h + 8 * w, 8);
    const std::uint64_t want = gpu::pattern_word(seed, w);
    if (got != want)
      for (int k = 0; k < 8; ++k) bad += ((got ^ want) >> (8 * k) & 0xFF) != 0;
  }
  for (std::size_t b = full * 8; b < n; ++b) bad += h[b] != gpu::pattern_byte(seed, b);
  return bad;
}

void host_fill(unsigned char* h, std::size_t n, std::uint64_t seed) {
  const std::size_t full = n / 8;
  for (std::size_t w = 0; w < full; ++w) {
    const std::uint64_t v = gpu::pattern_word(seed, w);
    std::memcpy(h + 8 * w, &v, 8);
  }
  for (std::size_t b = full * 8; b < n; ++b) h[b] = gpu::pattern_byte(seed, b);
}

// Kernel writes, cudaMemcpy reads back, the host compares; then the host writes through
// cudaMemcpy and a kernel compares. Both directions over all n bytes of p.
void round_trip(void* p, std::size_t n, std::uint64_t seed) {
  CAPTURE(n);
  CAPTURE(p);
  std::vector<unsigned char> h(n);
  gpu::fill(p, n, seed, nullptr);
  GPU_CHECK(cudaMemcpy(h.data(), p, n, cudaMemcpyDeviceToHost));
  CHECK(host_mismatches(h.data(), n, seed) == 0);
  host_fill(h.data(), n, seed + 1);
  GPU_CHECK(cudaMemcpy(p, h.data(), n, cudaMemcpyHostToDevice));
  CHECK(gpu::verify(p, n, seed + 1, nullptr) == 0);
}

bool overlaps(const void* a, std::size_t an, const void* b, std::size_t bn) {
  const auto x = reinterpret_cast<std::uintptr_t>(a), y = reinterpret_cast<std::uintptr_t>(b);
  return x < y + bn && y < x + an;
}

bool stream_busy(cudaStream_t s) {
  const cudaError_t e = cudaStreamQuery(s);
  if (e == cudaErrorNotReady) return true;
  GPU_CHECK(e);
  return false;
}

std::uint64_t spin_ns() { return gpu::env_u64("VMM_GPU_SPIN_MS", 50) * 1000000ull; }

}  // namespace

// ---- (a) memory is really there -----------------------------------------------------------------

TEST_CASE("gpu access: blocks of many small chunks, crossing chunk boundaries, round-trip") {
  vmm::tuning t;
  t.max_growth = 0;  // one granule per growth: many chunks, adjacent in VA
  vmm::allocator a = gpu::tuned(test_options(), t);
  const std::size_t g = a.granularity();
  REQUIRE(g > 0);
  std::vector<std::pair<void*, std::size_t>> blocks;
  for (int i = 0; i < 24; ++i) {
    const std::size_t n = 1536 * KiB + (i % 3) * 4099;  // odd sizes: tail bytes too
    blocks.emplace_back(a.allocate(n), n);
  }
  int crossing = 0;
  for (auto& [p, n] : blocks) {
    const auto u = reinterpret_cast<std::uintptr_t>(p);
    crossing += (u / g) != ((u + n - 1) / g);
  }
  MESSAGE(blocks.size() << " blocks of ~1.5 MiB in " << a.stats().chunks << " chunks of "
                        << (g >> 10) << " KiB; " << crossing << " cross a chunk boundary");
  WARN_MESSAGE(crossing > 0, "no block crosses a chunk boundary: this case then only shows "
                             "per-chunk access; the stitched case below still spans chunks");
  std::uint64_t seed = 100;
  for (auto& [p, n] : blocks) round_trip(p, n, seed += 2);
  CHECK(a.check() == "");
  for (auto& [p, n] : blocks) a.deallocate(p);
}

TEST_CASE("gpu access: a stitched allocation (several physical chunks in one block) round-trips") {
  vmm::allocator a(test_options());
  void* p = a.allocate(300 * MiB);
  gpu::fill(p, 300 * MiB, 1, nullptr);
  a.deallocate(p);
  GPU_CHECK(cudaDeviceSynchronize());
  void* q = a.allocate(400 * MiB);  // reuses the 300 MiB handle + a new one (conformance asserts it)
  const auto s = a.stats();
  MESSAGE("stitched " << s.stitched << ", chunks " << s.chunks << ", physical "
                      << (s.physical >> 20) << " MiB");
  CHECK(s.stitched >= 1);
  round_trip(q, 400 * MiB, 7);
  a.deallocate(q);
  CHECK(a.check() == "");
}

TEST_CASE("gpu access: one 1 GiB allocation and odd sizes round-trip; the runtime sees device memory") {
  vmm::allocator a(test_options());
  for (std::size_t n : {std::size_t{1}, std::size_t{255}, std::size_t{4097}, 3 * MiB + 5,
                        70 * MiB + 3, 1 * GiB}) {
    void* p = a.allocate(n);
    cudaPointerAttributes attr{};
    GPU_CHECK(cudaPointerGetAttributes(&attr, p));
    CHECK(attr.type == cudaMemoryTypeDevice);
    CHECK(attr.device == 0);
    round_trip(p, n, n);
    // cudaMemset and a device-to-device copy through the runtime work on it too.
    if (n >= 4096) {
      void* ref = nullptr;
      GPU_CHECK(cudaMalloc(&ref, n));
      gpu::fill(ref, n, 77, nullptr);
      GPU_CHECK(cudaMemcpy(p, ref, n, cudaMemcpyDeviceToDevice));
      CHECK(gpu::verify(p, n, 77, nullptr) == 0);
      GPU_CHECK(cudaMemset(p, 0, n));
      GPU_CHECK(cudaMemcpy(ref, p, n, cudaMemcpyDeviceToDevice));
      std::vector<unsigned char> h(4096, 1);
      GPU_CHECK(cudaMemcpy(h.data(), static_cast<char*>(ref) + n - 4096, 4096,
                           cudaMemcpyDeviceToHost));
      CHECK(std::all_of(h.begin(), h.end(), [](unsigned char c) { return c == 0; }));
      GPU_CHECK(cudaFree(ref));
    }
    a.deallocate(p);
  }
  CHECK(a.check() == "");
}

// ---- (b) memory goes back to the driver ---------------------------------------------------------

TEST_CASE("gpu meminfo: trim(0) and destruction return device memory (cudaMemGetInfo)") {
  warm_up_allocator();
  const std::size_t f0 = free_device_memory();
  {
    vmm::allocator a(test_options());
    std::vector<std::pair<void*, std::size_t>> blocks;
    for (int i = 0; i < 1000; ++i) blocks.emplace_back(a.allocate(1000), 1000);
    for (int i = 0; i < 200; ++i) blocks.emplace_back(a.allocate(100 * KiB), 100 * KiB);
    for (int i = 0; i < 40; ++i) blocks.emplace_back(a.allocate(5 * MiB + 17), 5 * MiB + 17);
    for (int i = 0; i < 3; ++i) blocks.emplace_back(a.allocate(300 * MiB), 300 * MiB);
    std::uint64_t seed = 1;
    for (auto& [p, n] : blocks) gpu::fill(p, n, seed++, nullptr);
    GPU_CHECK(cudaDeviceSynchronize());
    auto s = a.stats();
    const std::size_t f_mid = free_device_memory();
    const long long taken_mib =
        (static_cast<long long>(f0) - static_cast<long long>(f_mid)) / static_cast<long long>(MiB);
    MESSAGE("physical " << (s.physical >> 20) << " MiB; the driver shows " << taken_mib
                        << " MiB taken");
    if (!gpu::skip_meminfo_checks()) CHECK(f_mid + s.physical <= f0 + meminfo_slack());
    seed = 1;
    for (auto& [p, n] : blocks) CHECK(gpu::verify(p, n, seed++, nullptr) == 0);
    for (auto& [p, n] : blocks) a.deallocate(p);
    CHECK(a.stats().mapped > 0);  // kept for reuse until trimmed
    a.trim(0);
    s = a.stats();
    CHECK(s.mapped == 0);
    CHECK(s.physical == 0);
    CHECK(s.chunks == 0);
    CHECK(a.check() == "");
    check_memory_back(f0, "after trim(0)");

    // Again, and this time destroy with live blocks and cached free memory.
    blocks.clear();
    for (int i = 0; i < 100; ++i) blocks.emplace_back(a.allocate(3 * MiB), 3 * MiB);
    blocks.emplace_back(a.allocate(600 * MiB), 600 * MiB);
    for (std::size_t i = 0; i < blocks.size(); i += 2) a.deallocate(blocks[i].first);
  }
  check_memory_back(f0, "after destruction with live blocks");
}

// ---- (c) stream-ordered reuse -------------------------------------------------------------------

TEST_CASE("gpu streams: a block freed on a busy stream is not handed to another stream early") {
  warm_up_allocator();
  cudaStream_t s1 = gpu::stream(1), s2 = gpu::stream(2);
  for (std::size_t n : {std::size_t{4 * KiB}, 8 * MiB, 300 * MiB}) {  // slab, large, huge paths
    CAPTURE(n);
    vmm::allocator a(test_options());  // fresh: the reuse below is then deterministic
    void* p = a.allocate(n, 0, s1);
    gpu::spin_fill(p, n, 0xA, spin_ns(), s1);  // s1 keeps writing p for ~50 ms
    a.deallocate(p, s1);                       // stream-ordered free behind that kernel

    // The same stream reuses the block at once: stream order makes it safe.
    void* r = a.allocate(n, 0, s1);
    CHECK(r == p);
    WARN_MESSAGE(stream_busy(s1), "s1's kernel already ended: increase VMM_GPU_SPIN_MS");
    gpu::fill(r, n, 0xC, s1);  // runs after the spin kernel
    a.deallocate(r, s1);

    // Another stream must not get that memory while s1 still works on it.
    void* q = a.allocate(n, 0, s2);
    if (stream_busy(s1))
      CHECK_MESSAGE(!overlaps(p, n, q, n),
                    "s2 was given memory of a block that s1's kernels still write");
    gpu::fill(q, n, 0xB, s2);
    WARN_MESSAGE(stream_busy(s1), "s1's kernels ended before s2's fill was queued: the content "
                                  "check below had no overlap in time to catch");
    GPU_CHECK(cudaStreamSynchronize(s1));
    GPU_CHECK(cudaStreamSynchronize(s2));
    CHECK(gpu::verify(q, n, 0xB, s2) == 0);  // nobody else wrote into s2's block
    a.deallocate(q, s2);
    CHECK(a.check() == "");
  }
}

TEST_CASE("gpu streams: record_stream makes reuse wait for the recorded stream") {
  warm_up_allocator();
  cudaStream_t s1 = gpu::stream(1), s2 = gpu::stream(2), s3 = gpu::stream(3);
  for (std::size_t n : {std::size_t{4 * KiB}, 8 * MiB, 300 * MiB}) {
    CAPTURE(n);
    vmm::allocator a(test_options());
    void* p = a.allocate(n, 0, s1);
    gpu::fill(p, n, 1, s1);
    GPU_CHECK(cudaStreamSynchronize(s1));
    gpu::spin_fill(p, n, 0xA, spin_ns(), s3);  // p is used on s3 too
    a.record_stream(p, s3);
    a.deallocate(p, s1);  // s1 itself is idle

    void* q1 = a.allocate(n, 0, s1);  // even the freeing stream must wait for s3
    if (stream_busy(s3))
      CHECK_MESSAGE(!overlaps(p, n, q1, n), "s1 reused a block that s3 (recorded) still writes");
    void* q2 = a.allocate(n, 0, s2);
    if (stream_busy(s3))
      CHECK_MESSAGE(!overlaps(p, n, q2, n), "s2 reused a block that s3 (recorded) still writes");
    gpu::fill(q1, n, 0xB, s1);
    gpu::fill(q2, n, 0xC, s2);
    GPU_CHECK(cudaDeviceSynchronize());
    CHECK(gpu::verify(q1, n, 0xB, s1) == 0);
    CHECK(gpu::verify(q2, n, 0xC, s2) == 0);
    a.deallocate(q1, s1);
    a.deallocate(q2, s2);
    CHECK(a.check() == "");
  }
}

// ---- (e) threads x streams stress ---------------------------------------------------------------

TEST_CASE("gpu stress: threads allocate, fill, verify and free on random streams") {
  const std::uint64_t total_ops = gpu::env_u64("VMM_GPU_STRESS_OPS", 20000);
  const int threads = static_cast<int>(std::max<std::uint64_t>(1, gpu::env_u64("VMM_GPU_STRESS_THREADS", 16)));
  const std::size_t max_bytes = std::max<std::uint64_t>(1, gpu::env_u64("VMM_GPU_STRESS_MAX_BYTES", 64 * MiB));
  const std::uint64_t ops_per_thread = std::max<std::uint64_t>(1, total_ops / threads);
  constexpr std::size_t kLivePerThread = 8;
  MESSAGE("stress: " << threads << " threads x " << ops_per_thread << " ops, sizes 1 B .. "
                     << max_bytes << " B, " << gpu::stream_pool_size << " streams");

  warm_up_allocator();
  const std::size_t f0 = free_device_memory();
  std::atomic<std::uint64_t> mismatched_bytes{0}, bad_blocks{0}, failures{0}, next_id{1};
  std::atomic<std::uint64_t> allocs{0}, frees{0}, bytes{0}, recorded{0};
  std::mutex err_m;
  std::string first_error;
  auto note_error = [&](const std::string& e) {
    failures++;
    std::lock_guard lk(err_m);
    if (first_error.empty()) first_error = e;
  };

  int max_bits = 0;
  while (max_bits < 62 && (std::size_t{2} << max_bits) <= max_bytes) ++max_bits;

  {
    // 16 threads x 8 live blocks of up to 64 MiB, plus frees held back by fences: more than the
    // 16 GiB the other tests reserve.
    vmm::options so = test_options();
    so.reservation_size = 128 * GiB;
    vmm::allocator a(so);
    auto worker = [&](int tid) {
      struct live_block {
        void* p;
        std::size_t n;
        std::uint64_t id;
        cudaStream_t s;
      };
      std::mt19937_64 rng(0x5eed0000u + static_cast<unsigned>(tid));
      std::vector<live_block> live;
      auto release = [&](live_block b) {
        const std::uint64_t bad = gpu::verify(b.p, b.n, b.id, b.s);  // syncs b.s
        if (bad) {
          mismatched_bytes += bad;
          bad_blocks++;
          std::ostringstream m;
          m << "block " << b.id << " (" << b.n << " B at " << b.p << ") has " << bad
            << " wrong bytes";
          note_error(m.str());
        }
        // Leave work pending on the block, then free it stream-ordered behind that work: a
        // reuse that does not wait for it gets its pattern overwritten, and its verify fails.
        if (rng() % 4 == 0) {
          cudaStream_t other = gpu::stream(static_cast<int>(rng() % gpu::stream_pool_size));
          gpu::fill(b.p, b.n, b.id, other);
          try {
            a.record_stream(b.p, other);
            recorded++;
          } catch (const std::exception& e) {
            note_error(std::string("record_stream: ") + e.what());
          }
        } else {
          gpu::fill(b.p, b.n, b.id, b.s);
        }
        try {
          a.deallocate(b.p, b.s);
          frees++;
        } catch (const std::exception& e) {
          note_error(std::string("deallocate: ") + e.what());
        }
      };
      for (std::uint64_t op = 0; op < ops_per_thread; ++op) {
        if (live.empty() || (live.size() < kLivePerThread && rng() % 100 < 55)) {
          const int bits = static_cast<int>(rng() % (max_bits + 1));
          std::size_t n = (std::size_t{1} << bits) + rng() % (std::size_t{1} << bits);
          n = std::clamp<std::size_t>(n, 1, max_bytes);
          cudaStream_t s = gpu::stream(static_cast<int>(rng() % gpu::stream_pool_size));
          void* p = nullptr;
          try {
            p = a.allocate(n, 0, s);
          } catch (const std::exception& e) {
            std::ostringstream m;
            m << "allocate(" << n << "): " << e.what();
            note_error(m.str());
            continue;
          }
          const std::uint64_t id = next_id++;
          gpu::fill(p, n, id, s);  // asynchronous; checked at free
          live.push_back({p, n, id, s});
          allocs++;
          bytes += n;
        } else {
          const std::size_t k = rng() % live.size();
          live_block b = live[k];
          live[k] = live.back();
          live.pop_back();
          release(b);
        }
      }
      for (auto& b : live) release(b);
    };
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t) pool.emplace_back(worker, t);
    for (auto& t : pool) t.join();
    GPU_CHECK(cudaDeviceSynchronize());

    auto s = a.stats();
    MESSAGE("stress: " << allocs.load() << " allocations (" << (bytes.load() >> 20) << " MiB), "
                       << frees.load() << " frees (" << recorded.load() << " with record_stream); "
                       << "peak mapped " << (s.peak_mapped >> 20) << " MiB, peak physical "
                       << (s.peak_physical >> 20) << " MiB, grows " << s.grows << ", driver calls "
                       << s.calls.total());
    CHECK_MESSAGE(failures.load() == 0, failures.load() << " failures; first: " << first_error);
    CHECK(mismatched_bytes.load() == 0);
    CHECK(bad_blocks.load() == 0);
    CHECK(allocs.load() == frees.load());
    CHECK(s.requested == 0);
    CHECK(s.live == 0);
    CHECK(a.check() == "");
    a.trim(0);
    s = a.stats();
    CHECK(s.mapped == 0);
    CHECK(s.physical == 0);
    CHECK(a.check() == "");
  }
  check_memory_back(f0, "after the stress");
}
