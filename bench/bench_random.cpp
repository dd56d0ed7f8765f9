// SPDX-License-Identifier: Apache-2.0
// bench_random: RMM's random_allocations benchmark shape (rapidsai/rmm,
// benchmarks/random_allocations): 2N steps; each step allocates (size uniform in [1, max] bytes)
// with probability 0.73 while fewer than N allocations were made in total and live bytes stay under
// 16,000 MiB, else frees a random live block (swap-remove). A failed allocation becomes a free, as
// in RMM. Same default_random_engine and default seed in every iteration and for every peer.
//
//   bench_random            short default set: N in {1e3, 1e4} x max in {1, 64} MiB
//   bench_random --full     RMM's grid: N in {1e3, 1e4, 1e5} x max in {1, 4, 64, 256, 1024, 4096} MiB
//   (filter as usual: --benchmark_filter='random/vmmalloc_host/N:100000/.*')
//
// One allocator per benchmark (cold at its first iteration, warm after: RMM's resource_wrapper).
// Counters: ops (allocations + frees per iteration), peak_live_MiB, and mapped/live where the peer
// reports its peak memory (vmmalloc: peak_physical; cudaMallocAsync: pool reserved high-water).
#include <random>

#include "bench_common.hpp"

namespace {

using namespace vmm::bench;

constexpr std::size_t MiB = std::size_t{1} << 20;
constexpr std::size_t max_usage = 16000 * MiB;  // RMM's cap

struct run_stats {
  std::uint64_t ops = 0, peak_live = 0;
};

bool random_allocations(peer& a, std::size_t num, std::size_t max_size, run_stats& rs) {
  std::default_random_engine gen;
  std::uniform_int_distribution<std::size_t> size_dist(1, max_size);
  std::uniform_int_distribution<int> op_dist(0, 99);
  std::uniform_int_distribution<std::size_t> index_dist(0, num - 1);
  struct blk {
    void* p;
    std::size_t n;
  };
  std::vector<blk> live;
  live.reserve(num);
  std::size_t count = 0, live_bytes = 0;
  for (std::size_t i = 0; i < 2 * num; ++i) {
    std::size_t size = size_dist(gen);
    bool do_alloc = true;
    if (!live.empty())
      do_alloc = op_dist(gen) < 73 && count < num && live_bytes + size < max_usage;
    void* p = nullptr;
    if (do_alloc) p = a.allocate(size, nullptr);
    if (p) {
      live.push_back({p, size});
      ++count;
      live_bytes += size;
      rs.peak_live = std::max<std::uint64_t>(rs.peak_live, live_bytes);
      ++rs.ops;
    } else if (!live.empty()) {
      std::size_t k = index_dist(gen) % live.size();
      if (!a.deallocate(live[k].p, live[k].n, nullptr)) return false;
      live_bytes -= live[k].n;
      live[k] = live.back();
      live.pop_back();
      ++rs.ops;
    }
  }
  for (auto& b : live) {
    if (!a.deallocate(b.p, b.n, nullptr)) return false;
    ++rs.ops;
  }
  return a.synchronize();
}

void bm_random(benchmark::State& st, factory make) {
  std::unique_ptr<peer> a;
  try {
    a = make();
  } catch (const std::exception& e) {
    st.SkipWithError(e.what());
    return;
  }
  const auto num = static_cast<std::size_t>(st.range(0));
  const auto max_size = static_cast<std::size_t>(st.range(1)) * MiB;
  a->reset_peaks();
  run_stats rs;
  for (auto _ : st) {
    if (!random_allocations(*a, num, max_size, rs)) {
      skip(st, "deallocate");
      break;
    }
  }
  st.SetItemsProcessed(static_cast<std::int64_t>(rs.ops));
  if (st.iterations()) st.counters["ops"] = double(rs.ops) / double(st.iterations());
  st.counters["peak_live_MiB"] = double(rs.peak_live) / double(MiB);
  auto rep = a->report();
  if (rep.peak_mapped && rs.peak_live) st.counters["mapped/live"] = double(*rep.peak_mapped) / double(rs.peak_live);
}

}  // namespace

int main(int argc, char** argv) {
  const bool full = take_flag(argc, argv, "full", "0") != "0";
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  const std::vector<std::int64_t> nums = full ? std::vector<std::int64_t>{1000, 10000, 100000}
                                              : std::vector<std::int64_t>{1000, 10000};
  const std::vector<std::int64_t> maxes = full ? std::vector<std::int64_t>{1, 4, 64, 256, 1024, 4096}
                                               : std::vector<std::int64_t>{1, 64};
  for (const auto& k : available_peers()) {
    auto* b = benchmark::RegisterBenchmark((std::string("random/") + k.name).c_str(), bm_random, k.make);
    for (auto n : nums)
      for (auto m : maxes) b->Args({n, m});
    b->ArgNames({"N", "max_MiB"})->Unit(benchmark::kMillisecond)->UseRealTime();
  }
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
