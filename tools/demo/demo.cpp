// SPDX-License-Identifier: Apache-2.0
// vmm-demo: what tools/run-demo runs (docs/tools.md). Compares vmmalloc with the allocators it
// replaces on a few workload shapes and prints one table.
//
//   On a GPU (vmmalloc's CUDA backend loads AND cudart sees a device):
//       vmmalloc (CUDA backend) vs cudaMalloc vs cudaMallocAsync (default pool, keep-all threshold)
//   Without one: vmmalloc's host backend (memfd + mmap: the same arena and heap code) vs glibc
//       malloc, and it says so: those numbers say nothing about GPU performance.
//
// Workloads (fixed seeds; each allocator gets a fresh instance per workload):
//   pair 256 B / 64 KiB / 1 MiB  warm allocate + free of one size in a loop (time-boxed)
//   mixed random                 30,000 operations, sizes 256 B - 32 MiB (80 % <= 64 KiB), <= 1,024 live
//   grow 1 GiB -> 2 GiB          allocate 2 GiB + copy 1 GiB + free the old 1 GiB, nothing cached
//                                before (trim(0) / pool trim), median of 5 on a GPU, 1 run on
//                                the host (page faults dominate there); for vmmalloc also "allocate 2 GiB"
//                                alone: the API has no in-place growth yet, that is its lower bound.
// Runs in well under 30 s. Never crashes without a driver: every failure is a message.
#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "peers.hpp"
#include "tool_cli.hpp"

namespace {

using namespace vmm::replay;
using clk = std::chrono::steady_clock;
using factory = std::function<std::unique_ptr<peer>()>;

struct contender {
  std::string label;
  factory make;
};

struct result_row {
  std::string workload, allocator, time;
  std::optional<std::uint64_t> mapped;
  std::uint64_t live = 0;
  std::string note;
};

double secs(clk::time_point a, clk::time_point b) { return std::chrono::duration<double>(b - a).count(); }

std::string fmt_time(double ns, const char* per) {
  char b[64];
  if (ns >= 1e6) std::snprintf(b, sizeof b, "%.2f ms/%s", ns / 1e6, per);
  else if (ns >= 1e4) std::snprintf(b, sizeof b, "%.1f us/%s", ns / 1e3, per);
  else std::snprintf(b, sizeof b, "%.0f ns/%s", ns, per);
  return b;
}
std::string fmt_bytes(std::uint64_t v) {
  char b[64];
  if (v >= (1ull << 30)) std::snprintf(b, sizeof b, "%.2f GiB", double(v) / double(1ull << 30));
  else if (v >= (1ull << 20)) std::snprintf(b, sizeof b, "%.1f MiB", double(v) / double(1ull << 20));
  else std::snprintf(b, sizeof b, "%.1f KiB", double(v) / 1024.0);
  return b;
}

struct failure : std::runtime_error {
  using std::runtime_error::runtime_error;
};
[[noreturn]] void fail(const std::string& what) { throw failure(what + ": " + peer::error()); }

// Warm pairs: one untimed pair first, then batches until ~0.2 s or 2 M pairs.
result_row run_pairs(peer& a, std::size_t size) {
  a.reset_peaks();
  void* w = a.allocate(size, nullptr);
  if (!w) fail("warm-up allocate");
  if (a.wants_samples()) a.sample();  // untimed, while the block is live
  if (!a.deallocate(w, size, nullptr)) fail("warm-up free");
  std::uint64_t pairs = 0;
  auto t0 = clk::now();
  double el = 0;
  do {
    for (int k = 0; k < 64; ++k) {
      void* p = a.allocate(size, nullptr);
      if (!p) fail("allocate");
      if (!a.deallocate(p, size, nullptr)) fail("deallocate");
    }
    pairs += 64;
    el = secs(t0, clk::now());
  } while (el < 0.2 && pairs < 2'000'000);
  if (!a.synchronize()) fail("synchronize");
  el = secs(t0, clk::now());
  result_row r;
  r.time = fmt_time(el * 1e9 / double(pairs), "pair");
  r.live = size;
  r.mapped = a.report().peak_mapped;
  r.note = std::to_string(pairs) + " pairs";
  return r;
}

// Mixed random workload: allocate with p = 0.55 while under 1,024 live, else free a random block.
result_row run_mixed(peer& a) {
  std::mt19937_64 rng(42);
  std::uniform_real_distribution<double> u(0, 1);
  auto draw_size = [&] {
    bool small = u(rng) < 0.8;
    double lo = small ? 8 : 16, hi = small ? 16 : 25;  // log2: 256 B..64 KiB, 64 KiB..32 MiB
    return static_cast<std::size_t>(std::exp2(lo + (hi - lo) * u(rng)));
  };
  struct blk {
    void* p;
    std::size_t n;
  };
  std::vector<blk> live;
  live.reserve(1024);
  std::uint64_t live_bytes = 0, peak_live = 0;
  const int ops = 30'000;
  double paused = 0;
  a.reset_peaks();
  auto t0 = clk::now();
  for (int i = 0; i < ops; ++i) {
    bool alloc = live.empty() || (live.size() < 1024 && u(rng) < 0.55);
    if (alloc) {
      std::size_t n = draw_size();
      void* p = a.allocate(n, nullptr);
      if (!p) fail("allocate(" + std::to_string(n) + ")");
      live.push_back({p, n});
      live_bytes += n;
      peak_live = std::max(peak_live, live_bytes);
    } else {
      std::size_t k = rng() % live.size();
      if (!a.deallocate(live[k].p, live[k].n, nullptr)) fail("deallocate");
      live_bytes -= live[k].n;
      live[k] = live.back();
      live.pop_back();
    }
    if (a.wants_samples() && (i & 255) == 0) {  // memory sampling, outside the measured time
      auto s0 = clk::now();
      a.sample();
      paused += secs(s0, clk::now());
    }
  }
  if (!a.synchronize()) fail("synchronize");
  double el = secs(t0, clk::now()) - paused;
  for (auto& b : live)
    if (!a.deallocate(b.p, b.n, nullptr)) fail("deallocate");
  result_row r;
  r.time = fmt_time(el * 1e9 / ops, "op");
  r.live = peak_live;
  r.mapped = a.report().peak_mapped;
  r.note = std::to_string(ops) + " ops";
  return r;
}

// Growth 1 GiB -> 2 GiB, median of `reps`, nothing cached before each.
result_row run_growth(peer& a, bool alloc_only, int reps) {
  const std::size_t old_n = std::size_t{1} << 30, new_n = std::size_t{2} << 30;
  std::vector<double> t;
  a.reset_peaks();
  for (int r = 0; r < reps; ++r) {
    a.release_cached();
    void* old_p = nullptr;
    if (!alloc_only) {
      old_p = a.allocate(old_n, nullptr);
      if (!old_p) fail("allocate 1 GiB");
      if (!a.fill(old_p, 1, old_n) || !a.synchronize()) fail("fill 1 GiB");
    }
    auto t0 = clk::now();
    double paused = 0;
    void* new_p = a.allocate(new_n, nullptr);
    if (!new_p) fail("allocate 2 GiB");
    if (!alloc_only && !a.copy(new_p, old_p, old_n)) fail("copy 1 GiB");
    if (a.wants_samples()) {  // both buffers live: the peak; sampling time not counted
      auto s0 = clk::now();
      a.sample();
      paused = secs(s0, clk::now());
    }
    if (!alloc_only && !a.deallocate(old_p, old_n, nullptr)) fail("free 1 GiB");
    if (!a.synchronize()) fail("synchronize");
    t.push_back(secs(t0, clk::now()) - paused);
    if (!a.deallocate(new_p, new_n, nullptr)) fail("free 2 GiB");
    if (!a.synchronize()) fail("synchronize");
  }
  a.release_cached();
  std::sort(t.begin(), t.end());
  result_row row;
  row.time = fmt_time(t[t.size() / 2] * 1e9, "grow");
  row.live = alloc_only ? new_n : old_n + new_n;
  row.mapped = a.report().peak_mapped;
  row.note = reps == 1 ? "1 run" : "median of " + std::to_string(reps);
  return row;
}

}  // namespace

int main(int argc, char** argv) {
  // No options: CLI11 gives --help (exit 0) and refuses anything else (exit 2) instead of
  // silently running a demo the caller did not ask for.
  CLI::App app{"vmmalloc vs cudaMalloc / cudaMallocAsync on a GPU, vs glibc malloc on the host (host backend): "
               "a few workload shapes, one table, well under 30 s.",
               "vmm-demo"};
  vmm::tools::parse_or_exit(app, argc, argv);
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  auto start = clk::now();

  // Which world are we in? vmmalloc's CUDA backend loads libcuda at run time; cudart is the peers'.
  std::string why_vmm, why_rt;
  bool vmm_gpu = false;
  try {
    make_vmmalloc_cuda(0).reset();
    vmm_gpu = true;
  } catch (const std::exception& e) {
    why_vmm = e.what();
  }
  bool rt_gpu = vmm_gpu && cuda_device_present(&why_rt, 0);

  std::vector<contender> who;
  bool gpu = vmm_gpu;
  if (gpu) {
    std::string desc = cuda_device_description(0);
    std::printf("vmm-demo: GPU found%s%s. Comparing vmmalloc (CUDA backend) with %s.\n",
                desc.empty() ? "" : ": ", desc.c_str(),
                rt_gpu ? "cudaMalloc and cudaMallocAsync" : "nothing else");
    if (!rt_gpu) std::printf("  (the CUDA peers are unavailable: %s)\n", why_rt.c_str());
    who.push_back({"vmmalloc", [] { return make_vmmalloc_cuda(0); }});
    if (rt_gpu) {
      who.push_back({"cudaMalloc", [] { return make_cuda_malloc(0); }});
      who.push_back({"cudaMallocAsync", [] { return make_cuda_malloc_async(0); }});
    }
  } else {
    std::printf("vmm-demo: no GPU found (%s).\n", why_vmm.c_str());
    std::printf("  Comparing vmmalloc's host backend (memfd + mmap, 2 MiB granularity: the same arena and\n"
                "  heap code that runs on a GPU) with glibc malloc instead. These are host numbers; they say\n"
                "  nothing about GPU performance. Run on a GPU machine for vmmalloc vs cudaMalloc/cudaMallocAsync.\n");
    who.push_back({"vmmalloc (host)", [] { return make_vmmalloc_host(); }});
    who.push_back({"malloc", [] { return make_malloc(); }});
  }

  struct workload {
    std::string name;
    std::function<result_row(peer&)> run;
    bool vmm_only = false;
  };
  // On the host a growth is dominated by first-touch page faults (~1.5 s for 2 GiB): one run keeps
  // the demo well under 30 s. On a GPU it is milliseconds: median of 5.
  const int reps = gpu ? 5 : 1;
  std::vector<workload> work = {
      {"pair 256 B", [](peer& a) { return run_pairs(a, 256); }},
      {"pair 64 KiB", [](peer& a) { return run_pairs(a, 64 << 10); }},
      {"pair 1 MiB", [](peer& a) { return run_pairs(a, 1 << 20); }},
      {"mixed random", [](peer& a) { return run_mixed(a); }},
      {"grow 1->2 GiB (alloc+copy+free)", [reps](peer& a) { return run_growth(a, false, reps); }},
      {"grow 1->2 GiB (allocate 2 GiB only)", [reps](peer& a) { return run_growth(a, true, reps); }, true},
  };

  std::vector<result_row> rows;
  int failures = 0;
  for (auto& w : work) {
    for (auto& c : who) {
      if (w.vmm_only && c.label.rfind("vmmalloc", 0) != 0) continue;
      result_row r;
      try {
        auto a = c.make();
        r = w.run(*a);
      } catch (const std::exception& e) {
        r.time = "failed";
        r.note = e.what();
        ++failures;
        std::fprintf(stderr, "vmm-demo: %s, %s: %s\n", w.name.c_str(), c.label.c_str(), e.what());
      }
      r.workload = w.name;
      r.allocator = c.label;
      rows.push_back(r);
    }
  }

  std::printf("\n| workload | allocator | time | peak live | peak mapped | mapped/live | note |\n");
  std::printf("|---|---|---:|---:|---:|---:|---|\n");
  for (auto& r : rows) {
    char ratio[32] = "n/a";
    if (r.mapped && r.live) std::snprintf(ratio, sizeof ratio, "%.2f", double(*r.mapped) / double(r.live));
    std::printf("| %s | %s | %s | %s | %s | %s | %s |\n", r.workload.c_str(), r.allocator.c_str(), r.time.c_str(),
                r.live ? fmt_bytes(r.live).c_str() : "-", r.mapped ? fmt_bytes(*r.mapped).c_str() : "n/a", ratio,
                r.note.c_str());
  }
  std::printf("\npeak mapped: %s\n",
              gpu ? "vmmalloc stats().peak_physical; cudaMallocAsync pool reserved high-water; cudaMalloc device "
                    "memory in use (cudaMemGetInfo), sampled"
                  : "vmmalloc stats().peak_physical (memfd pages are only real once touched); malloc mallinfo2 "
                    "(arena + mmapped), sampled");
  std::printf("time: wall clock; pairs are warm (one pair before timing); grow includes synchronisation.\n");
  std::printf("total demo time %.1f s\n", secs(start, clk::now()));
  return failures ? 1 : 0;
}
