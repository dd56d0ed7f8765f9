// SPDX-License-Identifier: Apache-2.0
// bench_driver: what moving physical handles to a new address costs, per mapping. Under a memory
// limit the heap serves a large request from free handles mapped elsewhere: each is mapped at the
// new range, the range gets one set_access, and the old ranges are unmapped. This times those
// three driver steps for N handles laid side by side, as the heap does.
//
//   remap/<backend>/handles:N      map N handles, one set_access over the N, unmap each mapping
//   remap_one_unmap/cuda/handles:N the same, the N mappings unmapped in one call over the range
//                                  (the driver takes a range over several mappings; the host
//                                  backend unmaps only what one map mapped, so it has no variant)
//
// Counters, microseconds per mapping (averaged over iterations): map_us, access_us, unmap_us.
// On the CUDA backend the mapped memory is written (untimed) before the unmap, as live memory is.
// <backend>: host always; cuda only when the CUDA backend opens a device here.
//
//   bench_driver [--piece_mib=8] [Google Benchmark flags]
#include <benchmark/benchmark.h>

#include <chrono>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "vmmalloc/cuda_backend.hpp"
#include "vmmalloc/host_backend.hpp"

#ifdef VMM_REPLAY_CUDA
#include <cuda_runtime_api.h>
#endif

namespace {

std::size_t g_piece = std::size_t{8} << 20;

double us_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
}

// The device a backend's mappings are made accessible to.
int access_device(vmm::host_backend&) { return 0; }
int access_device(vmm::cuda_backend& b) { return b.device(); }

// Writes the range through the GPU and waits (untimed): unmapping memory the GPU touched.
bool touch(vmm::host_backend&, std::uintptr_t, std::size_t) { return true; }
bool touch([[maybe_unused]] vmm::cuda_backend& b, [[maybe_unused]] std::uintptr_t va, [[maybe_unused]] std::size_t n) {
#ifdef VMM_REPLAY_CUDA
  return cudaSetDevice(b.device()) == cudaSuccess && cudaMemset(reinterpret_cast<void*>(va), 1, n) == cudaSuccess &&
         cudaDeviceSynchronize() == cudaSuccess;
#else
  return true;
#endif
}

template <class B>
void bm_remap(benchmark::State& st, B& b, bool one_unmap) {
  const auto n = static_cast<std::size_t>(st.range(0));
  const vmm::chunk_props props{};
  std::vector<vmm::mem_handle> handles;
  auto va = b.reserve(n * g_piece, g_piece);
  if (!va.ok()) {
    st.SkipWithError(("reserve: " + va.st.message()).c_str());
    return;
  }
  auto cleanup = [&] {
    for (auto h : handles) (void)b.release(h);
    (void)b.free_reservation(va.value, n * g_piece);
  };
  for (std::size_t i = 0; i < n; ++i) {
    auto h = b.create(g_piece, props);
    if (!h.ok()) {
      st.SkipWithError(("create: " + h.st.message()).c_str());
      cleanup();
      return;
    }
    handles.push_back(h.value);
  }
  const vmm::access_desc rw[1] = {{access_device(b), vmm::access_mode::read_write}};
  double map_us = 0, access_us = 0, unmap_us = 0;
  std::string err;
  for (auto _ : st) {
    auto t0 = std::chrono::steady_clock::now();
    for (std::size_t i = 0; i < n && err.empty(); ++i)
      if (auto s = b.map(va.value + i * g_piece, g_piece, handles[i], 0); !s.ok()) err = "map: " + s.message();
    map_us += us_since(t0);
    t0 = std::chrono::steady_clock::now();
    if (err.empty())
      if (auto s = b.set_access(va.value, n * g_piece, rw); !s.ok()) err = "set_access: " + s.message();
    access_us += us_since(t0);
    st.PauseTiming();
    if (err.empty() && !touch(b, va.value, n * g_piece)) err = "write the mapped memory";
    st.ResumeTiming();
    t0 = std::chrono::steady_clock::now();
    bool unmapped = false;
    if (one_unmap) {
      if (auto s = b.unmap(va.value, n * g_piece); s.ok()) unmapped = true;
      else if (err.empty()) err = "one unmap over " + std::to_string(n) + " mappings refused: " + s.message();
    }
    if (!unmapped)
      for (std::size_t i = 0; i < n; ++i) (void)b.unmap(va.value + i * g_piece, g_piece);
    unmap_us += us_since(t0);
    if (!err.empty()) break;
  }
  cleanup();
  if (!err.empty()) {
    st.SkipWithError(err.c_str());
    return;
  }
  const double per = double(st.iterations()) * double(n);
  st.counters["map_us"] = map_us / per;
  st.counters["access_us"] = access_us / per;
  st.counters["unmap_us"] = unmap_us / per;
  st.counters["piece_MiB"] = double(g_piece >> 20);
}

}  // namespace

int main(int argc, char** argv) {
  g_piece = std::size_t(std::stoull(vmm::bench::take_flag(argc, argv, "piece_mib", "8"))) << 20;
  static vmm::host_backend host;  // its default simulated device (64 GiB) holds the largest N
  static std::optional<vmm::cuda_backend> cuda;
  cuda.emplace();
  if (!cuda->available()) {
    std::fprintf(stderr, "bench: remap/cuda left out: %s\n", cuda->load_message().c_str());
    cuda.reset();
  }
  auto add = [](const std::string& name, auto run) {
    benchmark::RegisterBenchmark(name.c_str(), run)->ArgName("handles")->Arg(1)->Arg(64)->Arg(256)->Unit(benchmark::kMillisecond);
  };
  add("remap/host", [](benchmark::State& st) { bm_remap(st, host, false); });
  if (cuda) {
    add("remap/cuda", [](benchmark::State& st) { bm_remap(st, *cuda, false); });
    add("remap_one_unmap/cuda", [](benchmark::State& st) { bm_remap(st, *cuda, true); });
  }
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
