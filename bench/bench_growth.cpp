// SPDX-License-Identifier: Apache-2.0
// bench_growth: growing a buffer from OLD to 2 x OLD (default 1 GiB -> 2 GiB).
//
//   growth_copy/<peer>   allocate 2 x OLD, copy OLD bytes, free the old buffer: what cudaMalloc
//                        users do today (~1,550 us on an H200 for 1 -> 2 GiB, docs/performance.md)
//   growth_alloc/<peer>  allocate 2 x OLD alone: what a fresh allocation of the new size costs
//   growth_inplace/<buf> vmm::growable_buffer resize(OLD -> 2 x OLD): maps only the extra OLD as one
//                        chunk (one create + map + set_access), pointer unchanged, nothing copied.
//                        Only resize() is timed; the shrink back to OLD (unmap + release) is not.
//   growth_inplace_kept/<buf>  the same, with options.keep_idle = OLD: the shrink back keeps the
//                        handle and the growth maps it again (map + set_access, no create).
//   growth_inplace_shared/<buf>  the same on growable_buffer::shared(allocator): the shrink back
//                        gives the handle to the allocator's idle pool, the growth maps it from there.
//   growth_inplace_2mib_chunks/<buf>  the same growth mapped 2 MiB at a time (512 map rounds per GiB).
//   growth_inplace_fresh/<buf>  the same growth into fresh memory: 8 buffers made first, each grown
//                        once (8 iterations), nothing released in between.
//   growth_steps/<buf>/64MiB_to_8GiB  the same buffer grown 64 MiB -> 8 GiB in 64 MiB steps; one
//                        iteration = one step (the time shown is per step). Back to 64 MiB untimed.
//                        The host variant keeps 8 GiB: memfd pages are never touched, so it maps
//                        address space only (no RSS).
//   <buf>: vmmalloc_host always; vmmalloc_cuda only when the CUDA backend opens a device here.
//
// Both start with nothing cached (peer.release_cached(): trim(0), pool trim, malloc_trim; untimed),
// so every iteration maps new memory, as a real growth would. The source is filled (untimed) so the
// copy reads real pages. On the host, first-touch page faults dominate growth_copy.
//
//   bench_growth [--old_mib=1024] [Google Benchmark flags]
#include "bench_common.hpp"

#include <algorithm>
#include <optional>

#include "vmmalloc/growable_buffer.hpp"
#include "vmmalloc/vmmalloc.hpp"

#ifdef VMM_REPLAY_CUDA
#include <cuda_runtime_api.h>
#endif

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

// ---- in-place growth: vmm::growable_buffer ----

using buffer_factory = vmm::growable_buffer (*)(std::size_t capacity_limit, const vmm::growable_options& o);

vmm::growable_buffer make_buffer_host(std::size_t limit, const vmm::growable_options& o) {
  vmm::host_backend_options h;
  h.physical_limit = std::max(h.physical_limit, limit);
  return vmm::growable_buffer::host(limit, h, o);
}
vmm::growable_buffer make_buffer_cuda(std::size_t limit, const vmm::growable_options& o) {
  return vmm::growable_buffer::cuda(limit, 0, o);
}

struct buffer_kind {
  const char* name;
  buffer_factory make;
};

// Host always; CUDA only when the backend opens a device (probed here, like available_peers()).
std::vector<buffer_kind> available_buffers() {
  std::vector<buffer_kind> k = {{"vmmalloc_host", make_buffer_host}};
  try {
    make_buffer_cuda(std::size_t{2} << 20, {});  // probe: driver + device + VMM support
    k.push_back({"vmmalloc_cuda", make_buffer_cuda});
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench: growth_inplace/vmmalloc_cuda left out: %s\n", e.what());
  }
  return k;
}

// The untimed shrink's cuMemRelease can leave work the driver finishes later, which the next
// timed cuMemCreate would then pay (seen on an H200: 1.39 ms real, 0.38 ms CPU). The copy variants
// synchronize in their untimed part; so does this one, to compare like with like.
void settle_device() {
#ifdef VMM_REPLAY_CUDA
  (void)cudaDeviceSynchronize();
#endif
}

// A buffer of capacity `limit` already grown to `size`; on failure the benchmark is skipped with
// the reason and nothing is returned.
std::optional<vmm::growable_buffer> open_buffer(benchmark::State& st, buffer_factory make, std::size_t limit,
                                                std::size_t size, const vmm::growable_options& o = {}) {
  try {
    std::optional<vmm::growable_buffer> b(make(limit, o));
    b->resize(size);
    return b;
  } catch (const std::exception& e) {
    st.SkipWithError(e.what());
    return std::nullopt;
  }
}

// OLD -> 2 x OLD in place on b (grown to OLD); only resize() is timed, the shrink back is not.
void time_regrowth(benchmark::State& st, vmm::growable_buffer& b) {
  const std::size_t old_n = g_old, new_n = 2 * g_old;
  void* const p = b.data();
  const auto creates0 = b.counts().create;
  try {
    for (auto _ : st) {
      b.resize(new_n);
      st.PauseTiming();
      if (b.data() != p) {
        st.SkipWithError("growable_buffer: data() moved");
        break;
      }
      b.resize(old_n);
      settle_device();
      st.ResumeTiming();
    }
  } catch (const std::exception& e) {
    st.SkipWithError(e.what());
    return;
  }
  st.counters["old_MiB"] = double(old_n >> 20);
  if (st.iterations())
    st.counters["creates_per_grow"] = double(b.counts().create - creates0) / double(st.iterations());
}

// The shrink back releases the grown chunk, so every iteration maps new physical memory, as a
// real growth would. kept: the buffer keeps the shrunk chunk's handle (options.keep_idle = OLD)
// and the growth maps it again: no create.
void bm_inplace(benchmark::State& st, buffer_factory make, bool kept) {
  vmm::growable_options o;
  if (kept) o.keep_idle = g_old;
  std::optional<vmm::growable_buffer> b = open_buffer(st, make, 2 * g_old, g_old, o);
  if (b) time_regrowth(st, *b);
}

// The same growth on a buffer sharing an allocator's idle pool (growable_buffer::shared): the
// shrink back gives the chunk to the allocator's pool, the growth maps it back from there (map +
// set_access, no create), as a buffer beside a running allocator would.
void bm_inplace_shared(benchmark::State& st, bool cuda) {
  const std::size_t new_n = 2 * g_old;
  std::optional<vmm::allocator> a;
  std::optional<vmm::growable_buffer> b;
  try {
    vmm::options o;
    o.reservation_size = 4 * new_n;
    if (cuda) {
      a.emplace(o);
    } else {
      vmm::host_backend_options h;
      h.physical_limit = std::max(h.physical_limit, 4 * new_n);
      a.emplace(vmm::allocator::host(o, h));
    }
    b.emplace(vmm::growable_buffer::shared(*a, new_n));
    b->resize(g_old);
  } catch (const std::exception& e) {
    st.SkipWithError(e.what());
    return;
  }
  time_regrowth(st, *b);
  st.counters["pool_MiB"] = double(a->stats().idle >> 20);
}

// 64 MiB -> 8 GiB in 64 MiB steps: one iteration = one step (one chunk, one driver round).
constexpr std::size_t step_bytes = std::size_t{64} << 20, steps_top = std::size_t{8} << 30;

void bm_steps(benchmark::State& st, buffer_factory make) {
  std::optional<vmm::growable_buffer> b = open_buffer(st, make, steps_top, step_bytes);
  if (!b) return;
  void* const p = b->data();
  const auto maps0 = b->counts().map;
  std::uint64_t rounds = 0;
  try {
    for (auto _ : st) {
      std::size_t n = b->size() + step_bytes;
      if (n > steps_top) {  // back to the first step, untimed (127 unmap + release)
        st.PauseTiming();
        b->resize(step_bytes);
        settle_device();
        st.ResumeTiming();
        n = 2 * step_bytes;
      }
      b->resize(n);
      ++rounds;
    }
  } catch (const std::exception& e) {
    st.SkipWithError(e.what());
    return;
  }
  if (b->data() != p) st.SkipWithError("growable_buffer: data() moved");
  st.counters["step_MiB"] = double(step_bytes >> 20);
  if (rounds) st.counters["maps_per_step"] = double(b->counts().map - maps0) / double(rounds);
}

}  // namespace

// OLD -> 2 x OLD in place into fresh physical memory: 8 buffers of OLD are made (untimed), then
// each iteration grows the next one once. Nothing is released between timed growths, so the
// driver never has a just-released gigabyte to finish first (growth_inplace releases every time).
void bm_inplace_fresh(benchmark::State& st, buffer_factory make) {
  constexpr int kBuffers = 8;
  const std::size_t old_n = g_old, new_n = 2 * g_old;
  std::vector<vmm::growable_buffer> bufs;
  for (int i = 0; i < kBuffers; ++i) {
    auto b = open_buffer(st, make, new_n, old_n);
    if (!b) return;
    bufs.push_back(std::move(*b));
  }
  settle_device();
  int i = 0;
  try {
    for (auto _ : st) {
      void* const p = bufs[i].data();
      bufs[i].resize(new_n);
      if (bufs[i].data() != p) {
        st.SkipWithError("growable_buffer: data() moved");
        break;
      }
      ++i;
    }
  } catch (const std::exception& e) {
    st.SkipWithError(e.what());
  }
  st.counters["old_MiB"] = double(old_n >> 20);
}

// OLD -> 2 x OLD in place, mapped 2 MiB at a time (one chunk per step, as a pool that only ever
// maps the granularity would): the per-call driver cost times OLD / 2 MiB. The shrink back is
// untimed and the device settled, as in growth_inplace.
void bm_inplace_2mib(benchmark::State& st, buffer_factory make) {
  const std::size_t old_n = g_old, new_n = 2 * g_old, step = std::size_t{2} << 20;
  std::optional<vmm::growable_buffer> b = open_buffer(st, make, new_n, old_n);
  if (!b) return;
  settle_device();
  const auto maps0 = b->counts().map;
  std::uint64_t rounds = 0;
  try {
    for (auto _ : st) {
      for (std::size_t n = old_n + step; n <= new_n; n += step) b->resize(n);
      ++rounds;
      st.PauseTiming();
      b->resize(old_n);
      settle_device();
      st.ResumeTiming();
    }
  } catch (const std::exception& e) {
    st.SkipWithError(e.what());
    return;
  }
  if (rounds) st.counters["maps_per_grow"] = double(b->counts().map - maps0) / double(rounds);
  st.counters["old_MiB"] = double(old_n >> 20);
}

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
  for (const auto& k : available_buffers()) {
    benchmark::RegisterBenchmark((std::string("growth_inplace/") + k.name).c_str(), bm_inplace, k.make, false)
        ->Unit(benchmark::kMicrosecond)->UseRealTime();
    benchmark::RegisterBenchmark((std::string("growth_inplace_kept/") + k.name).c_str(), bm_inplace, k.make, true)
        ->Unit(benchmark::kMicrosecond)->UseRealTime();
    benchmark::RegisterBenchmark((std::string("growth_inplace_shared/") + k.name).c_str(), bm_inplace_shared,
                                 std::string(k.name) == "vmmalloc_cuda")
        ->Unit(benchmark::kMicrosecond)->UseRealTime();
    benchmark::RegisterBenchmark((std::string("growth_inplace_2mib_chunks/") + k.name).c_str(), bm_inplace_2mib, k.make)
        ->Unit(benchmark::kMicrosecond)->UseRealTime();
    benchmark::RegisterBenchmark((std::string("growth_inplace_fresh/") + k.name).c_str(), bm_inplace_fresh, k.make)
        ->Unit(benchmark::kMicrosecond)->UseRealTime()->Iterations(8);
    benchmark::RegisterBenchmark((std::string("growth_steps/") + k.name + "/64MiB_to_8GiB").c_str(), bm_steps,
                                 k.make)
        ->Unit(benchmark::kMicrosecond)->UseRealTime();
  }
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
