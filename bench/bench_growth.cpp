// bench_growth: growing a buffer from OLD to 2 x OLD (default 1 GiB -> 2 GiB).
//
//   growth_copy/<peer>   allocate 2 x OLD, copy OLD bytes, free the old buffer: what cudaMalloc
//                        users do today (ANCHORS: ~1,550 us on an H200 for 1 -> 2 GiB)
//   growth_alloc/<peer>  allocate 2 x OLD alone: the lower bound of growing in place (vmmalloc has
//                        no in-place growth API yet; a growable buffer would map only the extra OLD)
//
// Both start with nothing cached (peer.release_cached(): trim(0), pool trim, malloc_trim; untimed),
// so every iteration maps new memory, as a real growth would. The source is filled (untimed) so the
// copy reads real pages. On the host, first-touch page faults dominate growth_copy.
//
//   bench_growth [--old_mib=1024] [Google Benchmark flags]
#include "bench_common.hpp"

namespace {

using namespace vmm::bench;

std::size_t g_old = std::size_t{1} << 30;

void bm_growth(benchmark::State& st, factory make, bool copy) {
  std::unique_ptr<peer> a;
  try {
    a = make();
  } catch (const std::exception& e) {
    st.SkipWithError(e.what());
    return;
  }
  const std::size_t old_n = g_old, new_n = 2 * g_old;
  for (auto _ : st) {
    st.PauseTiming();
    a->release_cached();
    void* old_p = nullptr;
    if (copy) {
      old_p = a->allocate(old_n, nullptr);
      if (!old_p || !a->fill(old_p, 1, old_n) || !a->synchronize()) {
        skip(st, "allocate + fill the old buffer");
        break;
      }
    }
    st.ResumeTiming();
    void* new_p = a->allocate(new_n, nullptr);
    if (!new_p) {
      skip(st, "allocate the new buffer");
      break;
    }
    if (copy && (!a->copy(new_p, old_p, old_n) || !a->deallocate(old_p, old_n, nullptr))) {
      skip(st, "copy + free the old buffer");
      break;
    }
    if (!a->synchronize()) {
      skip(st, "synchronize");
      break;
    }
    st.PauseTiming();
    if (!a->deallocate(new_p, new_n, nullptr) || !a->synchronize()) {
      skip(st, "free the new buffer");
      break;
    }
    st.ResumeTiming();
  }
  a->release_cached();
  st.counters["old_MiB"] = double(old_n >> 20);
}

}  // namespace

int main(int argc, char** argv) {
  g_old = std::stoull(take_flag(argc, argv, "old_mib", "1024")) << 20;
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  if (g_old == 0) {
    std::fprintf(stderr, "bench_growth: --old_mib must be > 0\n");
    return 1;
  }
  for (const auto& k : available_peers()) {
    benchmark::RegisterBenchmark((std::string("growth_copy/") + k.name).c_str(), bm_growth, k.make, true)
        ->Unit(benchmark::kMillisecond)->UseRealTime();
    benchmark::RegisterBenchmark((std::string("growth_alloc/") + k.name).c_str(), bm_growth, k.make, false)
        ->Unit(benchmark::kMillisecond)->UseRealTime();
  }
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
