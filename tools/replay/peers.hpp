// SPDX-License-Identifier: Apache-2.0
// Allocator peers: one small adapter per allocator, shared by vmm-replay, vmm-demo and the
// benchmarks, each made by its own factory (RMM's BENCHMARK_CAPTURE style). A peer never throws
// from allocate/deallocate: it returns null/false and error() says why, so a harness can report
// the exact event that failed.
//
// Cost of the abstraction: one virtual call per operation (~1-2 ns). The `null` peer goes through
// the same call, so subtracting its ns/event removes the harness and the dispatch together.
//
// CUDA peers exist when built with cudart (VMM_REPLAY_CUDA); every CUDA call's return code is
// checked. The torch peer exists only with VMM_REPLAY_TORCH (CMake option VMM_WITH_TORCH).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "vmmalloc/options.hpp"

namespace vmm {
class host_backend;
}

namespace vmm::replay {

// What a peer can say about its memory after a run. nullopt = not observable: printed "n/a",
// written as JSON null. Never guessed.
struct memory_report {
  std::optional<std::uint64_t> peak_mapped;    // physical bytes held at peak
  std::optional<std::uint64_t> peak_reserved;  // virtual address space held
  std::optional<std::uint64_t> driver_calls;
  std::string mapped_source;                   // how peak_mapped was obtained (honest label)
  std::vector<std::pair<std::string, double>> extra;  // more JSON keys
};

// What a peer holds right now (vmm-replay --samples calls it after every event of an untimed
// pass). nullopt = not observable here. Same quantities as memory_report's peaks.
struct memory_now {
  std::optional<std::uint64_t> mapped;     // physical bytes held (memory_report::peak_mapped's measure)
  std::optional<std::uint64_t> reserved;   // virtual address space held
  std::optional<std::uint64_t> requested;  // requested bytes live as the allocator counts them
  std::optional<std::uint64_t> driver_calls;  // memory_report::driver_calls so far
};

class peer {
 public:
  virtual ~peer() = default;
  virtual std::string name() const = 0;   // "vmmalloc", "cudaMalloc", ...
  virtual std::string detail() const { return {}; }  // "host backend, 2 MiB granularity"
  // nullptr on failure, error() says why. Thread-safe unless the peer says otherwise.
  virtual void* allocate(std::size_t n, void* stream) noexcept = 0;
  // false on failure, error() says why. n repeats the allocation's size.
  virtual bool deallocate(void* p, std::size_t n, void* stream) noexcept = 0;
  // The last failure on this thread.
  static const std::string& error() noexcept;

  // Waits for work queued by this peer (async frees), so a timed region ends when work is done.
  virtual bool synchronize() noexcept { return true; }
  // Whether sample() observes something; harnesses call it outside timed regions only.
  virtual bool wants_samples() const { return false; }
  virtual void sample() noexcept {}
  virtual void reset_peaks() noexcept {}
  // Current memory, for per-event timelines. Untimed only: may cost microseconds (cudaMemGetInfo).
  virtual memory_now current() noexcept { return {}; }
  // What the peer saw when current() first showed its highest mapped bytes (vmmalloc: its spans'
  // free blocks then), as JSON keys; empty when it has nothing to say.
  virtual std::vector<std::pair<std::string, double>> at_peak_mapped() const { return {}; }
  virtual memory_report report() = 0;
  // Invariant check, "" when fine (vmmalloc). Not thread-safe with concurrent allocations.
  virtual std::string check() const { return {}; }
  virtual bool has_check() const { return false; }
  // Requested bytes live as the allocator counts them, when it counts them (vmmalloc).
  virtual std::optional<std::uint64_t> live_requested() const { return std::nullopt; }
  // Copy / fill between this peer's allocations (memcpy, or cudaMemcpy on a device).
  virtual bool copy(void* dst, const void* src, std::size_t n) noexcept;
  virtual bool fill(void* p, int byte, std::size_t n) noexcept;
  virtual bool is_device() const { return false; }
  // Frees are stream-ordered (never synchronize the device), so a stream held back by --lag only
  // delays reuse. cudaMalloc's cudaFree synchronizes: a lag would stall it, so it says false.
  virtual bool stream_ordered() const { return false; }
  // vmmalloc over the host backend: the backend, for its test controls (--lag holds streams).
  virtual vmm::host_backend* host_backend() noexcept { return nullptr; }
  // Gives cached free memory back down to `keep` bytes (trim, pool trim): a trace's trim events,
  // and so the next workload starts cold. false on failure, error() says why.
  virtual bool release_cached(std::size_t keep = 0) noexcept {
    (void)keep;
    return true;
  }

 protected:
  static void set_error(std::string s) noexcept;
};

// ---- factories: one per peer ------------------------------------------------------------------
// They throw std::exception when the peer cannot exist here (no driver, no device).

// vmmalloc over the host backend: 2 MiB granularity (mirrors the GPUs), simulated device memory of
// `physical_limit` bytes (memfd pages are only real once touched, so a large limit is free).
// `o`: the allocator's options (vmm-replay --option); its device is the backend's.
std::unique_ptr<peer> make_vmmalloc_host(std::size_t physical_limit = std::size_t{256} << 30,
                                         const vmm::options& o = {});
// vmmalloc over the CUDA driver (loaded at run time). Throws vmm::error without a driver.
std::unique_ptr<peer> make_vmmalloc_cuda(int device = 0, vmm::options o = {});
// Fake increasing addresses, nothing else: measures the harness. One call at a time (a threaded
// replay's turns order the calls, so it measures the hand-offs too).
std::unique_ptr<peer> make_null();
// glibc malloc/free: the host reference (16 B alignment, not 256).
std::unique_ptr<peer> make_malloc();

// True when this binary has the CUDA peers (built with cudart).
bool have_cuda_peers();
// True when cudart sees a usable device; else false and *why says what failed.
bool cuda_device_present(std::string* why = nullptr, int device = 0);
// cudaMalloc/cudaFree. Peak mapped: device memory in use from cudaMemGetInfo, sampled.
std::unique_ptr<peer> make_cuda_malloc(int device = 0);
// cudaMallocAsync/cudaFreeAsync on the device's default pool with release threshold UINT64_MAX.
std::unique_ptr<peer> make_cuda_malloc_async(int device = 0);
// "NVIDIA H100 80GB HBM3, 79.1 GiB, driver 13.0" (empty without cudart or device).
std::string cuda_device_description(int device = 0);
// Creates n CUDA streams (non-blocking); nullptr entries are the default stream. Throws.
std::vector<void*> make_cuda_streams(std::size_t n);
void destroy_cuda_streams(const std::vector<void*>& s) noexcept;

// PyTorch's CUDA caching allocator (raw_alloc / raw_delete). Only with VMM_REPLAY_TORCH.
bool have_torch_peer();
std::unique_ptr<peer> make_torch(int device = 0);

}  // namespace vmm::replay
