// bench_alloc_free: a warm allocate + free pair of one size in a tight loop, 1-16 threads sharing
// one allocator. Sizes 256 B .. 1 GiB. Time per iteration = one pair (items/s = pairs/s).
//
//   bench_alloc_free [--benchmark_filter=alloc_free/vmmalloc_host/.*] [Google Benchmark flags]
//
// Peers: vmmalloc_host and malloc always; vmmalloc_cuda, cudaMalloc, cudaMallocAsync when a device
// answers at run time. Each peer is one shared instance (created on first use) so threads contend
// on it exactly as an application's threads would.
#include <map>
#include <mutex>

#include "bench_common.hpp"

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

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  const std::vector<std::int64_t> sizes = {256, 4 << 10, 64 << 10, 1 << 20, 16 << 20, 256 << 20, 1 << 30};
  for (const auto& k : available_peers()) {
    auto* b = benchmark::RegisterBenchmark((std::string("alloc_free/") + k.name).c_str(), bm_alloc_free, &k);
    for (auto s : sizes) b->Arg(s);
    b->ArgName("bytes")->ThreadRange(1, 16)->UseRealTime();
  }
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  g_shared.clear();  // CUDA peers go before cudart's own teardown
  return 0;
}
