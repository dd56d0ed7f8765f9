// SPDX-License-Identifier: Apache-2.0
// CUDA stream capture and graph pools on a real device: what PyTorch's CUDA graphs do to an
// allocator. For every capture mode (global, thread-local, relaxed), a cold allocator (nothing
// mapped: the capture grows it) and a warm one (its memory mapped and free), and every size path
// (256 B, 64 KiB slab, 1 MiB large, 512 MiB large with growth, 2 GiB huge), a graph is captured
// that allocates, writes, checks, frees and allocates again inside the capture, with begin_pool /
// end_pool around it as PyTorch does (begin before cudaStreamBeginCapture, end after
// cudaStreamEndCapture). Then: cudaStreamEndCapture succeeded; the graph replays with its kernels
// checking their own data each time, while blocks allocated outside the pool between replays
// never overlap the pool's blocks and keep their contents; releasing the pool and freeing its last
// block bring pools and pool_held back to 0.
//
// Environment (compute-sanitizer runs set smaller values: tools/gpu-check):
//   VMM_GPU_CAPTURE_MAX_BYTES  largest size tried (2 GiB); larger sizes are skipped with a message
//   VMM_GPU_CAPTURE_REPLAYS    replays of the long-replay case (100)
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "gpu_util.cuh"
#include "tuned.hpp"
#include "vmmalloc/vmmalloc.hpp"

namespace {

constexpr std::size_t KiB = 1024, MiB = 1024 * KiB, GiB = 1024 * MiB;

vmm::stream_t vs(cudaStream_t s) { return static_cast<vmm::stream_t>(s); }

std::size_t max_bytes() { return gpu::env_u64("VMM_GPU_CAPTURE_MAX_BYTES", 2 * GiB); }
int replays() { return static_cast<int>(gpu::env_u64("VMM_GPU_CAPTURE_REPLAYS", 100)); }

vmm::allocator capture_allocator() {
  vmm::options o;
  o.reservation_size = 64 * GiB;  // address space only
  vmm::tuning t;
  t.huge_threshold = 1 * GiB;     // 512 MiB goes through the large path, 2 GiB gets its own chunks
  return gpu::tuned(o, t);
}

struct mode_case {
  cudaStreamCaptureMode mode;
  const char* name;
};
constexpr mode_case kModes[] = {{cudaStreamCaptureModeGlobal, "global"},
                                {cudaStreamCaptureModeThreadLocal, "thread-local"},
                                {cudaStreamCaptureModeRelaxed, "relaxed"}};

struct size_case {
  std::size_t n;
  const char* path;
};
constexpr size_case kSizes[] = {{256, "256 B (small class, thread-cache size)"},
                                {64 * KiB, "64 KiB (slab)"},
                                {1 * MiB, "1 MiB (large)"},
                                {512 * MiB, "512 MiB (large, growth)"},
                                {2 * GiB, "2 GiB (huge: chunks of its own)"}};

// A device counter of mismatching bytes, written by kernels inside graphs.
struct counter {
  unsigned long long* d = nullptr;
  counter() {
    GPU_CHECK(cudaMalloc(&d, sizeof *d));
    GPU_CHECK(cudaMemset(d, 0, sizeof *d));
  }
  ~counter() { cudaFree(d); }
  unsigned long long read(cudaStream_t s) const {
    unsigned long long v = ~0ull;
    GPU_CHECK(cudaMemcpyAsync(&v, d, sizeof v, cudaMemcpyDeviceToHost, s));
    GPU_CHECK(cudaStreamSynchronize(s));
    return v;
  }
};

struct range {
  std::uintptr_t lo, hi;
};
range span(void* p, std::size_t n) {
  const auto u = reinterpret_cast<std::uintptr_t>(p);
  return {u, u + n};
}
bool overlaps(range a, range b) { return a.lo < b.hi && b.lo < a.hi; }

// The filter PyTorch's CUDAGraph gives beginAllocateToPool: the stream's capture is this one.
// Before cudaStreamBeginCapture the stream captures nothing, so nothing is accepted.
struct capture_filter {
  cudaStream_t cs;
  unsigned long long* capture_id;  // set once the capture began
  bool operator()(vmm::stream_t s) const {
    cudaStreamCaptureStatus st{};
    unsigned long long id = 0;
    if (cudaStreamGetCaptureInfo(static_cast<cudaStream_t>(s), &st, &id) != cudaSuccess) {
      (void)cudaGetLastError();
      return false;
    }
    return st == cudaStreamCaptureStatusActive && id == *capture_id;
  }
};

// One graph over blocks of n bytes on stream cs, in pool `pool` of `a`:
//   t1, t2 allocated and filled; t1 checked and freed INSIDE the capture; t3 allocated (it may
//   take t1's memory: the same capture may reuse it) and filled; t2, t3 checked; out allocated,
//   filled, left live. Also one block on another stream during the capture: not the pool's.
// t2 and t3 are freed after the capture ended (back to the pool, not to other work).
struct captured {
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  void* out = nullptr;
  std::vector<range> pool_blocks;  // every block the graph touches
  std::size_t n = 0;
  std::uint64_t seed = 0;
};

captured capture_one(vmm::allocator& a, vmm::allocator::pool_id pool, std::size_t n, cudaStream_t cs,
                     cudaStreamCaptureMode mode, const counter& bad, std::uint64_t seed) {
  captured c;
  c.n = n;
  c.seed = seed;
  unsigned long long capture_id = 0;
  a.begin_pool(pool, capture_filter{cs, &capture_id});
  REQUIRE(cudaStreamBeginCapture(cs, mode) == cudaSuccess);
  cudaStreamCaptureStatus st{};
  REQUIRE(cudaStreamGetCaptureInfo(cs, &st, &capture_id) == cudaSuccess);
  REQUIRE(st == cudaStreamCaptureStatusActive);

  void* t1 = a.allocate(n, 0, vs(cs));
  gpu::fill(t1, n, seed + 1, cs);
  void* t2 = a.allocate(n, 0, vs(cs));
  gpu::fill(t2, n, seed + 2, cs);
  gpu::verify_into(t1, n, seed + 1, bad.d, cs);
  a.deallocate(t1, vs(cs));  // freed inside the capture
  void* t3 = a.allocate(n, 0, vs(cs));
  gpu::fill(t3, n, seed + 3, cs);
  gpu::verify_into(t2, n, seed + 2, bad.d, cs);
  gpu::verify_into(t3, n, seed + 3, bad.d, cs);
  c.out = a.allocate(n, 0, vs(cs));
  gpu::fill(c.out, n, seed + 4, cs);
  // Another stream allocates during the capture (an autograd thread would): not the pool's.
  void* other = a.allocate(n, 0, vs(gpu::stream(5)));
  vmm::allocator::pool_id in = 0;
  CHECK_FALSE(a.pool_of(other, in));
  CHECK(a.pool_of(t2, in));
  CHECK(in == pool);

  const cudaError_t e = cudaStreamEndCapture(cs, &c.graph);
  REQUIRE_MESSAGE(e == cudaSuccess, "cudaStreamEndCapture: " << cudaGetErrorName(e) << ": "
                                                             << cudaGetErrorString(e));
  REQUIRE(c.graph != nullptr);
  a.end_pool(pool);
  for (void* p : {t1, t2, t3, c.out}) c.pool_blocks.push_back(span(p, n));
  a.deallocate(t2, vs(cs));  // freed after the capture: back to the pool
  a.deallocate(t3, vs(cs));
  a.deallocate(other, vs(gpu::stream(5)));
  REQUIRE(cudaGraphInstantiate(&c.exec, c.graph, 0) == cudaSuccess);
  return c;
}

// Replays `c` `times` times. Before each replay, blocks of the same size are allocated outside the
// pool on cs and on another stream, filled, and must not overlap the graph's blocks; after it,
// the graph's own checks found nothing and those blocks still hold their patterns.
void replay_and_check(vmm::allocator& a, const captured& c, cudaStream_t cs, const counter& bad, int times) {
  const std::size_t n = c.n;
  for (int r = 0; r < times; ++r) {
    void* x = a.allocate(n, 0, vs(cs));
    void* y = a.allocate(n, 0, vs(gpu::stream(6)));
    for (const range& b : c.pool_blocks) {
      REQUIRE_FALSE(overlaps(span(x, n), b));
      REQUIRE_FALSE(overlaps(span(y, n), b));
    }
    gpu::fill(x, n, c.seed + 100 + r, cs);
    gpu::fill(y, n, c.seed + 200 + r, gpu::stream(6));
    GPU_CHECK(cudaStreamSynchronize(gpu::stream(6)));
    REQUIRE(cudaGraphLaunch(c.exec, cs) == cudaSuccess);
    REQUIRE(bad.read(cs) == 0);
    REQUIRE(gpu::verify(c.out, n, c.seed + 4, cs) == 0);
    REQUIRE(gpu::verify(x, n, c.seed + 100 + r, cs) == 0);
    REQUIRE(gpu::verify(y, n, c.seed + 200 + r, gpu::stream(6)) == 0);
    a.deallocate(x, vs(cs));
    a.deallocate(y, vs(gpu::stream(6)));
  }
}

void destroy(captured& c) {
  GPU_CHECK(cudaGraphExecDestroy(c.exec));
  GPU_CHECK(cudaGraphDestroy(c.graph));
  c.exec = nullptr;
  c.graph = nullptr;
}

// Frees the graph's last block after release_pool: the pool goes with it.
void release_and_check(vmm::allocator& a, vmm::allocator::pool_id pool, captured& c, cudaStream_t cs) {
  GPU_CHECK(cudaStreamSynchronize(cs));
  destroy(c);
  a.release_pool(pool);
  vmm::allocator_stats s = a.stats();
  CHECK(s.pools == 1);  // `out` is still live
  a.deallocate(c.out, vs(cs));
  s = a.stats();
  CHECK(s.pools == 0);
  CHECK(s.pool_held == 0);
  CHECK(s.pool_allocated == 0);
  CHECK(a.check() == "");
}

}  // namespace

TEST_CASE("gpu capture: every mode x cold/warm x size path: capture valid, replays checked, pool released") {
  const cudaStream_t cs = gpu::stream(0);
  counter bad;
  std::uint64_t seed = 1000;
  for (const mode_case& m : kModes)
    for (const bool warm : {false, true})
      for (const size_case& sz : kSizes) {
        if (sz.n > max_bytes()) {
          MESSAGE("skipped " << sz.path << " (VMM_GPU_CAPTURE_MAX_BYTES=" << max_bytes() << ")");
          continue;
        }
        CAPTURE(m.name);
        CAPTURE(warm);
        CAPTURE(sz.path);
        vmm::allocator a = capture_allocator();
        if (warm) {  // memory mapped and free before the capture: the pool takes it over
          std::vector<void*> w;
          for (int i = 0; i < 4; ++i) w.push_back(a.allocate(sz.n, 0, vs(cs)));
          for (void* p : w) a.deallocate(p, vs(cs));
          GPU_CHECK(cudaStreamSynchronize(cs));
          REQUIRE(a.stats().mapped >= sz.n);
        } else {
          CHECK(a.stats().mapped == 0);
        }
        const auto grows_before = a.stats().grows;
        captured c = capture_one(a, 7, sz.n, cs, m.mode, bad, seed);
        seed += 1000;
        const vmm::allocator_stats s = a.stats();
        CHECK(s.pools == 1);
        CHECK(s.pool_held >= sz.n);
        if (!warm) CHECK(s.grows > grows_before);  // a cold allocator grew inside the capture
        replay_and_check(a, c, cs, bad, 3);
        release_and_check(a, 7, c, cs);
        std::printf("  ok: %-12s %-4s %s\n", m.name, warm ? "warm" : "cold", sz.path);
      }
}

TEST_CASE("gpu capture: two captures share one pool; a graph replayed many times with checks each time") {
  const cudaStream_t cs = gpu::stream(0);
  counter bad;
  vmm::allocator a = capture_allocator();
  const std::size_t big = std::min<std::size_t>(512 * MiB, max_bytes());
  // The first graph mixes sizes across the paths; the second shares its pool (PyTorch's
  // make_graphed_callables and torch.compile's graph trees do this).
  captured g1 = capture_one(a, 3, 1 * MiB, cs, cudaStreamCaptureModeGlobal, bad, 50000);
  captured g2 = capture_one(a, 3, 64 * KiB, cs, cudaStreamCaptureModeGlobal, bad, 60000);
  captured g3 = capture_one(a, 3, big, cs, cudaStreamCaptureModeThreadLocal, bad, 70000);
  CHECK(a.stats().pools == 1);
  // The graphs share memory freed between their captures, as PyTorch's shared pools do: replay
  // them in capture order, as their users must.
  for (int r = 0; r < replays(); ++r) {
    for (captured* g : {&g1, &g2, &g3}) REQUIRE(cudaGraphLaunch(g->exec, cs) == cudaSuccess);
    REQUIRE(bad.read(cs) == 0);
    if (r % 10 == 0 || r + 1 == replays()) {
      REQUIRE(gpu::verify(g1.out, g1.n, g1.seed + 4, cs) == 0);
      REQUIRE(gpu::verify(g2.out, g2.n, g2.seed + 4, cs) == 0);
      REQUIRE(gpu::verify(g3.out, g3.n, g3.seed + 4, cs) == 0);
    }
  }
  std::printf("  ok: 3 graphs in one pool replayed %d times, kernels checking each replay\n", replays());
  // Outside allocations still never land on the pool's blocks.
  replay_and_check(a, g3, cs, bad, 2);
  GPU_CHECK(cudaStreamSynchronize(cs));
  destroy(g1);
  destroy(g2);
  a.release_pool(3);
  CHECK(a.stats().pools == 1);
  for (captured* g : {&g1, &g2}) a.deallocate(g->out, vs(cs));
  CHECK(a.stats().pools == 1);  // g3's output keeps it
  destroy(g3);
  a.deallocate(g3.out, vs(cs));
  const vmm::allocator_stats s = a.stats();
  CHECK(s.pools == 0);
  CHECK(s.pool_held == 0);
  CHECK(s.pool_allocated == 0);
  CHECK(a.check() == "");
}

TEST_CASE("gpu capture: another thread grows, frees and trims while this thread captures in global mode") {
  const cudaStream_t cs = gpu::stream(0);
  counter bad;
  vmm::allocator a = capture_allocator();
  std::atomic<int> phase{0};
  std::atomic<int> rounds{0};
  std::thread other([&] {
    // An autograd thread of PyTorch: allocations on its own stream while a capture is under way.
    while (phase.load() == 0) std::this_thread::yield();
    while (phase.load() == 1) {
      const int k = rounds.load();
      void* p = a.allocate(24 * MiB + (k % 32) * 2 * MiB, 0, vs(gpu::stream(3)));
      void* q = a.allocate(3000, 0, vs(gpu::stream(3)));
      a.deallocate(q, vs(gpu::stream(3)));
      a.deallocate(p, vs(gpu::stream(3)));
      if (k % 8 == 7) a.trim();  // unmaps and releases what it can: driver calls during the capture
      (void)a.stats();
      rounds.fetch_add(1);
    }
  });
  unsigned long long capture_id = 0;
  a.begin_pool(9, capture_filter{cs, &capture_id});
  REQUIRE(cudaStreamBeginCapture(cs, cudaStreamCaptureModeGlobal) == cudaSuccess);
  cudaStreamCaptureStatus st{};
  REQUIRE(cudaStreamGetCaptureInfo(cs, &st, &capture_id) == cudaSuccess);
  phase = 1;
  std::vector<void*> blocks;
  for (int i = 0; i < 16; ++i) {
    void* p = a.allocate((i + 1) * 3 * MiB, 0, vs(cs));
    gpu::fill(p, (i + 1) * 3 * MiB, 90000 + i, cs);
    blocks.push_back(p);
    while (rounds.load() < i) std::this_thread::yield();  // interleave with the other thread
  }
  for (int i = 0; i < 16; ++i) gpu::verify_into(blocks[i], (i + 1) * 3 * MiB, 90000 + i, bad.d, cs);
  cudaGraph_t graph = nullptr;
  const cudaError_t e = cudaStreamEndCapture(cs, &graph);
  phase = 2;
  other.join();
  REQUIRE_MESSAGE(e == cudaSuccess, "cudaStreamEndCapture: " << cudaGetErrorName(e));
  a.end_pool(9);
  cudaGraphExec_t exec = nullptr;
  REQUIRE(cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess);
  for (int r = 0; r < 5; ++r) REQUIRE(cudaGraphLaunch(exec, cs) == cudaSuccess);
  CHECK(bad.read(cs) == 0);
  std::printf("  ok: global capture survived %d rounds of another thread's growth and frees\n", rounds.load());
  GPU_CHECK(cudaGraphExecDestroy(exec));
  GPU_CHECK(cudaGraphDestroy(graph));
  a.release_pool(9);
  for (void* p : blocks) a.deallocate(p, vs(cs));
  CHECK(a.stats().pools == 0);
  CHECK(a.stats().pool_held == 0);
  CHECK(a.check() == "");
}
