// SPDX-License-Identifier: Apache-2.0
// bench_alloc_free: a warm allocate + free pair of one size in a tight loop, 1-16 threads sharing
// one allocator. Sizes 256 B .. 1 GiB. Time per iteration = one pair (items/s = pairs/s).
//
//   bench_alloc_free [--benchmark_filter=alloc_free/vmmalloc_host/.*] [Google Benchmark flags]
//
// Peers: vmmalloc_host and malloc always; vmmalloc_cuda, cudaMalloc, cudaMallocAsync when a device
// answers at run time; torch (PyTorch's caching allocator, raw_alloc / raw_delete) in a build
// configured with -DVMM_WITH_TORCH=ON against libtorch (tools/gpu-check's bench step makes one). Each peer is one shared instance (created on first use) so threads contend
// on it exactly as an application's threads would.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <map>
#include <mutex>
#include <thread>

#include "bench_common.hpp"
#include "vmmalloc/vmmalloc.hpp"

namespace {

using namespace vmm::bench;

std::mutex g_mu;
std::map<std::string, std::unique_ptr<peer>> g_shared;

peer* shared(const peer_kind& k) {
  std::lock_guard g(g_mu);
  auto& p = g_shared[k.name];
  if (!p) {
    try {
      p = k.make();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "bench_alloc_free: %s: %s\n", k.name, e.what());
      return nullptr;
    }
  }
  return p.get();
}

void bm_alloc_free(benchmark::State& st, const peer_kind* k) {
  peer* a = shared(*k);
  if (!a) {
    st.SkipWithError("cannot create the allocator");
    return;
  }
  const std::size_t n = static_cast<std::size_t>(st.range(0));
  // One pair before timing: the size class / chunk / pool is warm, as in a running program.
  if (void* w = a->allocate(n, nullptr); !w || !a->deallocate(w, n, nullptr)) {
    skip(st, "warm-up pair");
    return;
  }
  for (auto _ : st) {
    void* p = a->allocate(n, nullptr);
    if (!p) {
      skip(st, "allocate(" + std::to_string(n) + ")");
      break;
    }
    benchmark::DoNotOptimize(p);
    if (!a->deallocate(p, n, nullptr)) {
      skip(st, "deallocate");
      break;
    }
  }
  if (!a->synchronize()) skip(st, "synchronize");
  st.SetItemsProcessed(st.iterations());
}

// Trace recording's cost: the same warm pair on two host-backend allocators, one recording
// every event to a file (options.trace_path), one not. range(1): 0 off, 1 on.
std::string g_trace_file;
std::unique_ptr<vmm::allocator> g_traced[2];
std::once_flag g_traced_once;

void bm_trace(benchmark::State& st) {
  std::call_once(g_traced_once, [] {
    char tmpl[] = "/tmp/vmm-bench-trace-XXXXXX";
    int fd = mkstemp(tmpl);
    if (fd >= 0) close(fd);
    g_trace_file = tmpl;
    vmm::options o;
    o.reservation_size = std::size_t{8} << 30;
    g_traced[0] = std::make_unique<vmm::allocator>(vmm::allocator::host(o));
    o.trace_path = g_trace_file;
    g_traced[1] = std::make_unique<vmm::allocator>(vmm::allocator::host(o));
  });
  vmm::allocator& a = *g_traced[st.range(1)];
  const std::size_t n = static_cast<std::size_t>(st.range(0));
  a.deallocate(a.allocate(n));
  for (auto _ : st) {
    void* p = a.allocate(n);
    benchmark::DoNotOptimize(p);
    a.deallocate(p);
  }
  st.SetItemsProcessed(st.iterations());
  st.SetLabel(st.range(1) ? "trace on" : "trace off");
}

// Pairs beside a growing thread: while the benchmark's threads make allocate + free pairs of
// sizes above the small classes (256 KiB .. 4 MiB in turn, so each takes the allocator's lock),
// one more thread keeps growing: a 256 MiB block (a chunk of its own: create + map + set_access)
// at a time, 8 held, then freed and trimmed (unmap + release, outside the lock). Time per
// iteration = one pair; counter growths = growths/s.
std::map<std::string, std::unique_ptr<peer>> g_growing;

void bm_beside_growth(benchmark::State& st, bool cuda) {
  const std::string key = cuda ? "cuda" : "host";
  peer* a = nullptr;
  {
    std::lock_guard g(g_mu);
    auto& p = g_growing[key];
    if (!p) {
      vmm::options o;
      try {
        p = cuda ? vmm::replay::make_vmmalloc_cuda(0, o) : vmm::replay::make_vmmalloc_host(std::size_t{256} << 30, o);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "bench_alloc_free: %s: %s\n", key.c_str(), e.what());
      }
    }
    a = p.get();
  }
  if (!a) {
    st.SkipWithError("cannot create the allocator");
    return;
  }
  static constexpr std::size_t sizes[] = {256 << 10, 384 << 10, 512 << 10, 768 << 10,
                                          1 << 20,   3 << 19,   2 << 20,   4 << 20};
  std::atomic<bool> stop{false};
  std::atomic<std::uint64_t> growths{0};
  std::thread grower;
  if (st.thread_index() == 0) {
    grower = std::thread([&] {
      constexpr std::size_t big = std::size_t{256} << 20;
      std::vector<void*> held;
      while (!stop.load(std::memory_order_relaxed)) {
        void* p = a->allocate(big, nullptr);
        if (!p) break;
        held.push_back(p);
        growths.fetch_add(1, std::memory_order_relaxed);
        if (held.size() == 8) {
          for (void* q : held) a->deallocate(q, big, nullptr);
          held.clear();
          a->release_cached();
        }
      }
      for (void* q : held) a->deallocate(q, big, nullptr);
      a->release_cached();
    });
  }
  std::size_t i = static_cast<std::size_t>(st.thread_index());
  for (auto _ : st) {
    const std::size_t n = sizes[i++ % 8];
    void* p = a->allocate(n, nullptr);
    if (!p) {
      skip(st, "allocate(" + std::to_string(n) + ")");
      break;
    }
    benchmark::DoNotOptimize(p);
    a->deallocate(p, n, nullptr);
  }
  if (st.thread_index() == 0) {
    stop.store(true);
    grower.join();
    st.counters["growths"] = benchmark::Counter(static_cast<double>(growths.load()), benchmark::Counter::kIsRate);
  }
  st.SetItemsProcessed(st.iterations());
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  const std::vector<std::int64_t> sizes = {256, 4 << 10, 64 << 10, 256 << 10, 1 << 20, 16 << 20, 256 << 20, 1 << 30};
  for (const auto& k : available_peers()) {
    auto* b = benchmark::RegisterBenchmark((std::string("alloc_free/") + k.name).c_str(), bm_alloc_free, &k);
    for (auto s : sizes) b->Arg(s);
    b->ArgName("bytes")->ThreadRange(1, 16)->UseRealTime();
  }
  for (const bool cuda : {false, true}) {
    const bool have = std::any_of(available_peers().begin(), available_peers().end(),
                                  [&](const peer_kind& k) { return std::string(k.name) == (cuda ? "vmmalloc_cuda" : "vmmalloc_host"); });
    if (!have) continue;
    benchmark::RegisterBenchmark(cuda ? "beside_growth/vmmalloc_cuda" : "beside_growth/vmmalloc_host",
                                 bm_beside_growth, cuda)
        ->ThreadRange(1, 8)
        ->UseRealTime();
  }
  benchmark::RegisterBenchmark("trace_overhead/vmmalloc_host", bm_trace)
      ->ArgsProduct({{256, 1 << 20}, {0, 1}})
      ->ArgNames({"bytes", "trace"})
      ->ThreadRange(1, 4)
      ->UseRealTime();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  g_traced[0].reset();
  g_traced[1].reset();
  if (!g_trace_file.empty()) std::remove(g_trace_file.c_str());
  g_shared.clear();  // CUDA peers go before cudart's own teardown
  g_growing.clear();
  return 0;
}
