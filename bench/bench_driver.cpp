// SPDX-License-Identifier: Apache-2.0
// bench_driver: what moving physical handles to a new address costs, per mapping. Under a memory
// limit the heap serves a large request from free handles mapped elsewhere: each is mapped at the
// new range, the range gets one set_access, and the old ranges are unmapped. This times those
// three driver steps for N handles laid side by side, as the heap does.
//
//   remap/<backend>/handles:N         map N handles, one set_access over the N, unmap each mapping
//   remap_one_unmap/<backend>/handles:N
//                                     the same, the N mappings unmapped in one call over the range
//                                     (cuMemUnmap takes whole mappings side by side, as the arena
//                                     unmaps them)
//   remap_beside/<backend>/handles:N  remap while a second thread moves 64 handles of its own
//                                     without a pause (unmap each, map each, one set_access): one
//                                     thread's growth beside another's, both outside the
//                                     allocator's lock. Counter beside_moves: the second thread's
//                                     mappings per first-thread mapping.
//
// Counters, microseconds per mapping (averaged over iterations): map_us, access_us, unmap_us.
// On the CUDA backend the mapped memory is written (untimed) before the unmap, as live memory is.
// <backend>: host always; cuda only when the CUDA backend opens a device here.
//
//   bench_driver [--piece_mib=8] [Google Benchmark flags]
#include <benchmark/benchmark.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <optional>
#include <mutex>
#include <string>
#include <thread>
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

// A second thread moving `n` handles of its own (unmap each, map each, one set_access) until
// stopped; counts its mappings, keeps its first refusal.
template <class B>
class mover {
 public:
  mover(B& b, std::size_t n) : b_(b), n_(n) {}
  ~mover() { stop(); }
  std::string start() {
    auto va = b_.reserve(n_ * g_piece, g_piece);
    if (!va.ok()) return "reserve: " + va.st.message();
    va_ = va.value;
    for (std::size_t i = 0; i < n_; ++i) {
      auto h = b_.create(g_piece, vmm::chunk_props{});
      if (!h.ok()) return "create: " + h.st.message();
      hs_.push_back(h.value);
    }
    if (std::string e = map_all(); !e.empty()) return e;
    t_ = std::thread([this] {
      while (!stop_.load(std::memory_order_relaxed)) {
        for (std::size_t i = 0; i < n_; ++i) (void)b_.unmap(va_ + i * g_piece, g_piece);
        if (std::string e = map_all(); !e.empty()) {
          std::lock_guard<std::mutex> g(m_);
          err_ = e;
          return;
        }
        moves_.fetch_add(n_, std::memory_order_relaxed);
      }
    });
    return {};
  }
  std::uint64_t moves() const { return moves_.load(std::memory_order_relaxed); }
  std::string error() {
    std::lock_guard<std::mutex> g(m_);
    return err_;
  }
  void stop() {
    stop_ = true;
    if (t_.joinable()) t_.join();
    if (!va_) return;
    for (std::size_t i = 0; i < n_; ++i) (void)b_.unmap(va_ + i * g_piece, g_piece);
    for (auto h : hs_) (void)b_.release(h);
    (void)b_.free_reservation(va_, n_ * g_piece);
    va_ = 0;
  }

 private:
  std::string map_all() {
    for (std::size_t i = 0; i < n_; ++i)
      if (auto s = b_.map(va_ + i * g_piece, g_piece, hs_[i], 0); !s.ok()) return "map: " + s.message();
    const vmm::access_desc rw[1] = {{access_device(b_), vmm::access_mode::read_write}};
    if (auto s = b_.set_access(va_, n_ * g_piece, rw); !s.ok()) return "set_access: " + s.message();
    return {};
  }
  B& b_;
  std::size_t n_;
  std::uintptr_t va_ = 0;
  std::vector<vmm::mem_handle> hs_;
  std::thread t_;
  std::atomic<bool> stop_{false};
  std::atomic<std::uint64_t> moves_{0};
  std::mutex m_;
  std::string err_;
};

template <class B>
void bm_remap(benchmark::State& st, B& b, bool one_unmap, bool beside = false) {
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
  std::optional<mover<B>> other;
  std::uint64_t moves0 = 0;
  if (beside) {
    other.emplace(b, 64);
    err = other->start();
    moves0 = other->moves();
  }
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
  const double moves = other ? double(other->moves() - moves0) : 0;
  if (other) {
    if (std::string e = other->error(); err.empty() && !e.empty()) err = "second thread: " + e;
    other.reset();
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
  if (beside) st.counters["beside_moves"] = moves / per;
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
  add("remap_one_unmap/host", [](benchmark::State& st) { bm_remap(st, host, true); });
  add("remap_beside/host", [](benchmark::State& st) { bm_remap(st, host, false, true); });
  if (cuda) {
    add("remap/cuda", [](benchmark::State& st) { bm_remap(st, *cuda, false); });
    add("remap_one_unmap/cuda", [](benchmark::State& st) { bm_remap(st, *cuda, true); });
    add("remap_beside/cuda", [](benchmark::State& st) { bm_remap(st, *cuda, false, true); });
  }
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
