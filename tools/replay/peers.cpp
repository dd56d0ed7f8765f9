// SPDX-License-Identifier: Apache-2.0
#include "peers.hpp"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#include <malloc.h>

#include "vmmalloc/host_backend.hpp"
#include "vmmalloc/vmmalloc.hpp"

#ifdef VMM_REPLAY_CUDA
#include <cuda_runtime_api.h>
#endif

namespace vmm::replay {

namespace {
thread_local std::string tl_error;
}  // namespace

const std::string& peer::error() noexcept { return tl_error; }
void peer::set_error(std::string s) noexcept {
  try {
    tl_error = std::move(s);
  } catch (...) {
  }
}

bool peer::copy(void* dst, const void* src, std::size_t n) noexcept {
  std::memcpy(dst, src, n);
  return true;
}
bool peer::fill(void* p, int byte, std::size_t n) noexcept {
  std::memset(p, byte, n);
  return true;
}

#ifdef VMM_REPLAY_CUDA
namespace {
// Every CUDA call goes through here: false + a message naming the call on failure. Clears the
// (non-sticky) last error so a failed cudaMalloc does not poison the next call.
bool cuda_ok(cudaError_t e, const char* call) noexcept {
  if (e == cudaSuccess) return true;
  (void)cudaGetLastError();
  std::string m = call;
  m += ": ";
  m += cudaGetErrorName(e);
  m += " (";
  m += cudaGetErrorString(e);
  m += ")";
  tl_error = std::move(m);
  return false;
}
#define VMM_CUDA_OK(call) cuda_ok((call), #call)
void cuda_or_throw(cudaError_t e, const char* call) {
  if (!cuda_ok(e, call)) throw std::runtime_error(tl_error);
}
#define VMM_CUDA_THROW(call) cuda_or_throw((call), #call)

// Device memory in use (total - free), sampled; peaks relative to the usage at construction.
struct device_usage {
  std::uint64_t base = 0, peak = 0;
  bool valid = false;
  void start() noexcept {
    std::size_t f = 0, t = 0;
    valid = VMM_CUDA_OK(cudaMemGetInfo(&f, &t));
    base = valid ? t - f : 0;
    peak = 0;
  }
  void sample() noexcept {
    std::size_t f = 0, t = 0;
    if (!VMM_CUDA_OK(cudaMemGetInfo(&f, &t))) {
      valid = false;
      return;
    }
    std::uint64_t used = t - f;
    peak = std::max<std::uint64_t>(peak, used > base ? used - base : 0);
  }
  // In use now, above the start (also raises the peak: it is a sample too).
  std::optional<std::uint64_t> now() noexcept {
    std::size_t f = 0, t = 0;
    if (!valid || !VMM_CUDA_OK(cudaMemGetInfo(&f, &t))) return std::nullopt;
    std::uint64_t used = t - f, above = used > base ? used - base : 0;
    peak = std::max(peak, above);
    return above;
  }
};
}  // namespace
#endif

// ---- vmmalloc ---------------------------------------------------------------------------------

namespace {
class vmmalloc_peer final : public peer {
 public:
  vmmalloc_peer(vmm::allocator a, bool device, std::string detail, vmm::host_backend* hb = nullptr)
      : a_(std::move(a)), device_(device), detail_(std::move(detail)), hb_(hb) {
#ifdef VMM_REPLAY_CUDA
    if (device_) dev_.start();
#endif
  }
  std::string name() const override { return "vmmalloc"; }
  std::string detail() const override { return detail_; }
  void* allocate(std::size_t n, void* s) noexcept override {
    void* p = a_.try_allocate(n, 0, s);
    if (!p) set_error(vmm::last_error().message);
    return p;
  }
  bool deallocate(void* p, std::size_t, void* s) noexcept override {
    vmm::status st = a_.try_deallocate(p, s);
    if (st.ok()) return true;
    set_error(vmm::last_error().message.empty() ? st.message() : vmm::last_error().message);
    return false;
  }
  void reset_peaks() noexcept override {
    a_.reset_peaks();
#ifdef VMM_REPLAY_CUDA
    if (device_) dev_.start();
#endif
  }
  bool wants_samples() const override { return device_; }
  memory_now current() noexcept override {
    memory_now m;
    try {
      auto s = a_.stats();
      m.mapped = s.physical;  // same measure as report()'s peak_physical
      m.reserved = s.reserved;
      m.requested = s.requested;
      m.driver_calls = s.calls.total();
      // Walks the free lists: only at a new high of physical bytes (a few hundred times a trace).
      if (s.physical > at_peak_.physical) at_peak_ = {s.physical, s.allocated, s.idle, s.free_chunk_bytes, a_.span_free()};
    } catch (const std::exception& e) {
      set_error(e.what());
    }
    return m;
  }
  void sample() noexcept override {
#ifdef VMM_REPLAY_CUDA
    if (device_) dev_.sample();
#endif
  }
  bool synchronize() noexcept override {
#ifdef VMM_REPLAY_CUDA
    if (device_) return VMM_CUDA_OK(cudaDeviceSynchronize());
#endif
    return true;
  }
  memory_report report() override {
    auto s = a_.stats();
    memory_report r;
    r.peak_mapped = s.peak_physical;
    r.peak_reserved = s.reserved;
    r.driver_calls = s.calls.total();
    r.mapped_source = "vmmalloc stats().peak_physical (mapped + idle handles)";
    r.extra = {{"peak_mapped_va_bytes", double(s.peak_mapped)},
               {"calls_create", double(s.calls.create)},
               {"calls_map", double(s.calls.map)},
               {"calls_unmap", double(s.calls.unmap)},
               {"calls_set_access", double(s.calls.set_access)},
               {"calls_release", double(s.calls.release)},
               {"calls_failures", double(s.calls.failures)},
               {"grows", double(s.grows)},
               {"stitched", double(s.stitched)},
               {"chunk_releases", double(s.chunk_releases)},
               {"chunks_retired", double(s.chunks_retired)},
               {"calls_record_fence", double(s.calls.record_fence)},
               {"calls_wait_fence", double(s.calls.wait_fence)},
               {"driver_ms", double(s.calls.ns) / 1e6},
               {"fence_ms", double(s.calls.fence_ns) / 1e6}};
#ifdef VMM_REPLAY_CUDA
    if (device_ && dev_.valid) r.extra.push_back({"device_used_peak_sampled_bytes", double(dev_.peak)});
#endif
    return r;
  }
  std::vector<std::pair<std::string, double>> at_peak_mapped() const override {
    if (!at_peak_.physical) return {};
    const auto& p = at_peak_;
    return {{"physical_bytes", double(p.physical)},
            {"allocated_bytes", double(p.allocated)},
            {"idle_bytes", double(p.idle)},
            {"free_chunk_bytes", double(p.free_chunks)},
            {"span_free_bytes", double(p.spans.bytes)},
            {"span_free_blocks", double(p.spans.blocks)},
            {"span_free_whole_page_bytes", double(p.spans.whole_pages)},
            {"span_largest_free_bytes", double(p.spans.largest)}};
  }
  std::string check() const override { return a_.check(); }
  bool has_check() const override { return true; }
  std::optional<std::uint64_t> live_requested() const override { return a_.stats().requested; }
  bool copy(void* d, const void* s, std::size_t n) noexcept override {
    if (!device_) return peer::copy(d, s, n);
#ifdef VMM_REPLAY_CUDA
    return VMM_CUDA_OK(cudaMemcpy(d, s, n, cudaMemcpyDeviceToDevice));
#else
    set_error("vmmalloc (cuda): copy needs cudart (built without VMM_REPLAY_CUDA)");
    return false;
#endif
  }
  bool fill(void* p, int b, std::size_t n) noexcept override {
    if (!device_) return peer::fill(p, b, n);
#ifdef VMM_REPLAY_CUDA
    return VMM_CUDA_OK(cudaMemset(p, b, n));
#else
    set_error("vmmalloc (cuda): fill needs cudart (built without VMM_REPLAY_CUDA)");
    return false;
#endif
  }
  bool is_device() const override { return device_; }
  bool stream_ordered() const override { return true; }
  vmm::host_backend* host_backend() noexcept override { return hb_; }
  bool release_cached(std::size_t keep) noexcept override {
    try {
      a_.trim(keep);
      return true;
    } catch (const std::exception& e) {
      set_error(e.what());
      return false;
    }
  }

 private:
  vmm::allocator a_;
  bool device_;
  std::string detail_;
  vmm::host_backend* hb_;  // owned by a_ (host backend only)
  // current()'s first sample at the highest physical bytes so far, and the spans then.
  struct peak_state {
    std::size_t physical = 0, allocated = 0, idle = 0, free_chunks = 0;
    vmm::span_free_stats spans;
  };
  peak_state at_peak_;
#ifdef VMM_REPLAY_CUDA
  device_usage dev_;
#endif
};
}  // namespace

std::unique_ptr<peer> make_vmmalloc_host(std::size_t physical_limit, const vmm::options& o) {
  vmm::host_backend_options h;
  h.granularity = std::size_t{2} << 20;
  h.physical_limit = physical_limit;
  // The backend is made here, not by allocator::host(), to keep a pointer to its test controls.
  auto b = vmm::make_backend<vmm::host_backend>(h);
  vmm::host_backend* hb = vmm::backend_cast<vmm::host_backend>(*b);
  return std::make_unique<vmmalloc_peer>(vmm::allocator(std::move(b), o), false,
                                         "host backend, 2 MiB granularity, " +
                                             std::to_string(physical_limit >> 30) + " GiB limit",
                                         hb);
}

std::unique_ptr<peer> make_vmmalloc_cuda(int device, vmm::options o) {
  o.device = device;
  return std::make_unique<vmmalloc_peer>(vmm::allocator(o), true,
                                         "CUDA backend, device " + std::to_string(device));
}

// ---- null -------------------------------------------------------------------------------------

namespace {
class null_peer final : public peer {
 public:
  std::string name() const override { return "null"; }
  std::string detail() const override { return "fake addresses: the harness alone"; }
  // noinline: the harness pays one real call per event, as it does for every other peer.
  [[gnu::noinline]] void* allocate(std::size_t n, void*) noexcept override {
    void* p = reinterpret_cast<void*>(next_);
    next_ += (n + 255) & ~std::uintptr_t{255};
    return p;
  }
  [[gnu::noinline]] bool deallocate(void* p, std::size_t, void*) noexcept override {
    return p != nullptr;
  }
  memory_report report() override {
    memory_report r;
    r.driver_calls = 0;
    r.mapped_source = "none (null allocator)";
    return r;
  }
  bool copy(void*, const void*, std::size_t) noexcept override {
    set_error("null: no memory behind the addresses");
    return false;
  }
  bool fill(void*, int, std::size_t) noexcept override {
    set_error("null: no memory behind the addresses");
    return false;
  }

 private:
  std::uintptr_t next_ = std::uintptr_t{1} << 44;  // non-null, 256-aligned, never dereferenced
};
}  // namespace

std::unique_ptr<peer> make_null() { return std::make_unique<null_peer>(); }

// ---- malloc -----------------------------------------------------------------------------------

namespace {
class malloc_peer final : public peer {
 public:
  std::string name() const override { return "malloc"; }
  std::string detail() const override { return "glibc malloc/free (host reference)"; }
  void* allocate(std::size_t n, void*) noexcept override {
    void* p = std::malloc(n);
    if (!p) set_error("malloc(" + std::to_string(n) + "): out of memory");
    return p;
  }
  bool deallocate(void* p, std::size_t, void*) noexcept override {
    std::free(p);
    return true;
  }
  // mallinfo2 walks every arena (microseconds): sampled outside timed regions only.
  bool wants_samples() const override { return true; }
  void sample() noexcept override { (void)current(); }
  memory_now current() noexcept override {
    memory_now m;
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 33))
    struct mallinfo2 mi = mallinfo2();
    std::uint64_t held = mi.arena + mi.hblkhd;  // sbrk/arena heap + mmapped chunks
    std::uint64_t above = held > base_ ? held - base_ : 0;
    peak_ = std::max(peak_, above);
    sampled_ = true;
    m.mapped = above;
#endif
    return m;
  }
  // The base is what the process holds before the run (the harness's own vectors, heap kept from
  // an earlier pass after malloc_trim): peaks are counted above it.
  void reset_peaks() noexcept override {
    malloc_trim(0);
    peak_ = 0;
    base_ = 0;
    sample();
    base_ = peak_;
    peak_ = 0;
  }
  memory_report report() override {
    memory_report r;
    if (sampled_ && peak_ > 0) {  // 0: served from heap kept earlier, nothing new observed
      r.peak_mapped = peak_;
      r.mapped_source = "mallinfo2 arena + hblkhd above the start, sampled";
    }
    return r;
  }
  bool release_cached(std::size_t) noexcept override {
    malloc_trim(0);
    return true;
  }

 private:
  std::uint64_t peak_ = 0, base_ = 0;
  bool sampled_ = false;
};
}  // namespace

std::unique_ptr<peer> make_malloc() { return std::make_unique<malloc_peer>(); }

// ---- CUDA peers -------------------------------------------------------------------------------

#ifdef VMM_REPLAY_CUDA
bool have_cuda_peers() { return true; }

bool cuda_device_present(std::string* why, int device) {
  int n = 0;
  if (!VMM_CUDA_OK(cudaGetDeviceCount(&n))) {
    if (why) *why = tl_error;
    return false;
  }
  if (device >= n) {
    if (why) *why = "cudart sees " + std::to_string(n) + " device(s), wanted device " + std::to_string(device);
    return false;
  }
  // Creates the primary context now, so its ~100 ms is not charged to the first timed call.
  if (!VMM_CUDA_OK(cudaSetDevice(device)) || !VMM_CUDA_OK(cudaFree(nullptr))) {
    if (why) *why = tl_error;
    return false;
  }
  return true;
}

std::string cuda_device_description(int device) {
  cudaDeviceProp prop{};
  int drv = 0;
  if (!VMM_CUDA_OK(cudaGetDeviceProperties(&prop, device))) return {};
  if (!VMM_CUDA_OK(cudaDriverGetVersion(&drv))) drv = 0;
  char b[320];
  std::snprintf(b, sizeof b, "%s, %.1f GiB, driver API %d.%d", prop.name,
                double(prop.totalGlobalMem) / double(1ull << 30), drv / 1000, (drv % 1000) / 10);
  return b;
}

namespace {
class cuda_malloc_peer final : public peer {
 public:
  explicit cuda_malloc_peer(int device) : dev_(device) {
    VMM_CUDA_THROW(cudaSetDevice(device));
    VMM_CUDA_THROW(cudaFree(nullptr));
    usage_.start();
  }
  std::string name() const override { return "cudaMalloc"; }
  std::string detail() const override { return "cudaMalloc/cudaFree, device " + std::to_string(dev_); }
  void* allocate(std::size_t n, void*) noexcept override {
    void* p = nullptr;
    calls_.fetch_add(1, std::memory_order_relaxed);
    if (!VMM_CUDA_OK(cudaMalloc(&p, n))) return nullptr;
    return p;
  }
  bool deallocate(void* p, std::size_t, void*) noexcept override {
    calls_.fetch_add(1, std::memory_order_relaxed);
    return VMM_CUDA_OK(cudaFree(p));
  }
  bool synchronize() noexcept override { return VMM_CUDA_OK(cudaDeviceSynchronize()); }
  bool wants_samples() const override { return true; }
  void sample() noexcept override { usage_.sample(); }
  memory_now current() noexcept override { return {usage_.now(), std::nullopt, std::nullopt, std::nullopt}; }
  void reset_peaks() noexcept override { usage_.start(); }
  memory_report report() override {
    memory_report r;
    if (usage_.valid) {
      r.peak_mapped = usage_.peak;
      r.mapped_source = "device memory in use (cudaMemGetInfo total-free, minus before the run), sampled";
    }
    // The driver does not expose cudaMalloc's VA use: left unknown.
    r.driver_calls = calls_.load();
    if (usage_.valid) r.extra.push_back({"device_used_peak_sampled_bytes", double(usage_.peak)});
    return r;
  }
  bool copy(void* d, const void* s, std::size_t n) noexcept override {
    return VMM_CUDA_OK(cudaMemcpy(d, s, n, cudaMemcpyDeviceToDevice));
  }
  bool fill(void* p, int b, std::size_t n) noexcept override { return VMM_CUDA_OK(cudaMemset(p, b, n)); }
  bool is_device() const override { return true; }

 private:
  int dev_;
  device_usage usage_;
  std::atomic<std::uint64_t> calls_{0};  // cudaMalloc + cudaFree: each one enters the driver
};

class cuda_malloc_async_peer final : public peer {
 public:
  explicit cuda_malloc_async_peer(int device) : dev_(device) {
    VMM_CUDA_THROW(cudaSetDevice(device));
    VMM_CUDA_THROW(cudaFree(nullptr));
    VMM_CUDA_THROW(cudaDeviceGetDefaultMemPool(&pool_, device));
    VMM_CUDA_THROW(cudaMemPoolGetAttribute(pool_, cudaMemPoolAttrReleaseThreshold, &old_threshold_));
    // Keep everything the pool ever reserved: no release at synchronisation points (the pool's
    // fast mode, and what PyTorch-like caching does). Restored on destruction.
    std::uint64_t keep_all = UINT64_MAX;
    VMM_CUDA_THROW(cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReleaseThreshold, &keep_all));
    usage_.start();
    reset_peaks();
  }
  ~cuda_malloc_async_peer() override {
    (void)release_cached(0);
    (void)VMM_CUDA_OK(cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReleaseThreshold, &old_threshold_));
  }
  std::string name() const override { return "cudaMallocAsync"; }
  std::string detail() const override {
    return "default pool, release threshold UINT64_MAX, device " + std::to_string(dev_);
  }
  void* allocate(std::size_t n, void* s) noexcept override {
    void* p = nullptr;
    if (!VMM_CUDA_OK(cudaMallocAsync(&p, n, static_cast<cudaStream_t>(s)))) return nullptr;
    return p;
  }
  bool deallocate(void* p, std::size_t, void* s) noexcept override {
    return VMM_CUDA_OK(cudaFreeAsync(p, static_cast<cudaStream_t>(s)));
  }
  bool synchronize() noexcept override { return VMM_CUDA_OK(cudaDeviceSynchronize()); }
  bool wants_samples() const override { return true; }
  void sample() noexcept override { usage_.sample(); }
  // The pool's reserved memory now: the measure of report()'s ReservedMemHigh. Its VA is not
  // observable apart from that, so reserved stays unknown.
  memory_now current() noexcept override {
    memory_now m;
    std::uint64_t cur = 0;
    if (VMM_CUDA_OK(cudaMemPoolGetAttribute(pool_, cudaMemPoolAttrReservedMemCurrent, &cur))) m.mapped = cur;
    return m;
  }
  void reset_peaks() noexcept override {
    // Writing 0 resets a high-water attribute to the current value.
    std::uint64_t zero = 0;
    (void)VMM_CUDA_OK(cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReservedMemHigh, &zero));
    (void)VMM_CUDA_OK(cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrUsedMemHigh, &zero));
    usage_.start();
  }
  memory_report report() override {
    memory_report r;
    std::uint64_t reserved_high = 0, used_high = 0;
    if (VMM_CUDA_OK(cudaMemPoolGetAttribute(pool_, cudaMemPoolAttrReservedMemHigh, &reserved_high)))
      r.peak_mapped = reserved_high;
    r.mapped_source = "pool high-water, cudaMemPoolAttrReservedMemHigh";
    if (VMM_CUDA_OK(cudaMemPoolGetAttribute(pool_, cudaMemPoolAttrUsedMemHigh, &used_high)))
      r.extra.push_back({"pool_used_high_bytes", double(used_high)});
    if (usage_.valid) r.extra.push_back({"device_used_peak_sampled_bytes", double(usage_.peak)});
    // The pool's own driver calls (its VMM mapping work) are not observable: driver_calls unknown.
    return r;
  }
  bool copy(void* d, const void* s, std::size_t n) noexcept override {
    return VMM_CUDA_OK(cudaMemcpy(d, s, n, cudaMemcpyDeviceToDevice));
  }
  bool fill(void* p, int b, std::size_t n) noexcept override { return VMM_CUDA_OK(cudaMemset(p, b, n)); }
  bool is_device() const override { return true; }
  bool stream_ordered() const override { return true; }
  bool release_cached(std::size_t keep) noexcept override {
    return VMM_CUDA_OK(cudaDeviceSynchronize()) && VMM_CUDA_OK(cudaMemPoolTrimTo(pool_, keep));
  }

 private:
  int dev_;
  cudaMemPool_t pool_ = nullptr;
  std::uint64_t old_threshold_ = 0;
  device_usage usage_;
};
}  // namespace

std::unique_ptr<peer> make_cuda_malloc(int device) { return std::make_unique<cuda_malloc_peer>(device); }
std::unique_ptr<peer> make_cuda_malloc_async(int device) {
  return std::make_unique<cuda_malloc_async_peer>(device);
}

std::vector<void*> make_cuda_streams(std::size_t n) {
  std::vector<void*> v(n, nullptr);
  for (std::size_t i = 1; i < n; ++i) {  // index 0 stays the default stream
    cudaStream_t s = nullptr;
    if (!VMM_CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking))) {
      destroy_cuda_streams(v);
      throw std::runtime_error(tl_error);
    }
    v[i] = s;
  }
  return v;
}
void destroy_cuda_streams(const std::vector<void*>& v) noexcept {
  for (void* s : v)
    if (s) (void)VMM_CUDA_OK(cudaStreamDestroy(static_cast<cudaStream_t>(s)));
}

#else  // no cudart: the CUDA peers are absent, and say so.

bool have_cuda_peers() { return false; }
bool cuda_device_present(std::string* why, int) {
  if (why) *why = "built without cudart (VMM_REPLAY_CUDA off)";
  return false;
}
std::unique_ptr<peer> make_cuda_malloc(int) {
  throw std::runtime_error("cudaMalloc peer not built (no cudart / nvcc at configure time)");
}
std::unique_ptr<peer> make_cuda_malloc_async(int) {
  throw std::runtime_error("cudaMallocAsync peer not built (no cudart / nvcc at configure time)");
}
std::string cuda_device_description(int) { return {}; }
std::vector<void*> make_cuda_streams(std::size_t) {
  throw std::runtime_error("CUDA streams need cudart (built without VMM_REPLAY_CUDA)");
}
void destroy_cuda_streams(const std::vector<void*>&) noexcept {}
#endif

#ifndef VMM_REPLAY_TORCH
bool have_torch_peer() { return false; }
std::unique_ptr<peer> make_torch(int) {
  throw std::runtime_error("torch peer not built (configure with -DVMM_WITH_TORCH=ON and libtorch)");
}
#endif

}  // namespace vmm::replay
