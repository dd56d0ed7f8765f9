// SPDX-License-Identifier: Apache-2.0
// libvmmalloc_torch_ext.so: vmmalloc as PyTorch's CUDA allocator WITH the hooks that PyTorch's
// CUDAPluggableAllocator only takes from C++ (torch/csrc/cuda/CUDAPluggableAllocator.h):
//   set_begin_allocate_to_pool / set_end_allocate_to_pool_fn / set_release_pool
//       CUDA graphs (torch.cuda.graph, make_graphed_callables, torch.compile's CUDA graph trees)
//       and torch.cuda.use_mem_pool: a capture's memory comes from a vmmalloc graph pool and stays
//       its own until PyTorch releases the pool, so replays find their addresses as they were.
//   set_record_stream_fn
//       Tensor.record_stream: the block's reuse waits for that stream's work.
//   cacheInfo
//       cuDNN's benchmark mode (torch.backends.cudnn.benchmark) asks it for the largest block
//       the allocator can hand out before it searches algorithms; the base class refuses, so
//       every convolution there failed.
//   set_memory_fraction_fn, getMemoryFraction
//       torch.cuda.set_per_process_memory_fraction / get_per_process_memory_fraction: the
//       device's vmmalloc memory limit, as a fraction of its memory (the base class ignored the
//       setting and refuses the query).
//   set_reset_fn, getDeviceStats, resetPeakStats, resetAccumulatedStats
//       torch.cuda.empty_cache (vmmalloc's trim) and PyTorch's memory statistics
//       (torch.cuda.memory_allocated, max_memory_allocated, memory_reserved, memory_stats,
//       reset_peak_memory_stats), which the base class refuses with an error: programs and
//       libraries that print or budget memory through them (torch.compile's autotuning among
//       them) stopped there under a plain pluggable allocator.
//   shareIpcHandle, getIpcDevPtr
//       CUDA tensors sent to another process through torch.multiprocessing (with
//       VMMALLOC_IPC=posix_fd; torch_share.cpp in libvmmalloc_torch); the base class refuses.
//   malloc's out of memory
//       raised as c10::OutOfMemoryError (torch.OutOfMemoryError), not the base class's
//       RuntimeError.
// Without these hooks the plain pluggable allocator (python/vmmalloc/torch.py's fallback) gives a
// graph no private memory: blocks a capture frees are handed to other tensors while replays still
// write them.
//
// Built against the installed PyTorch (src/integrations/torch_ext/CMakeLists.txt, only where
// find_package(Torch) succeeds) and loaded by python/vmmalloc/torch.py with ctypes after
// `import torch`; no pybind, no Python headers. vmm_torch_ext_install() creates the allocator over
// the SAME copy of libvmmalloc_torch.so that Python loaded (dlopen of its path: one allocator per
// device per process) and installs it with changeCurrentAllocator, as torch.cuda.memory.
// change_current_allocator does.
//
// PyTorch's MempoolId_t (a pair of uint64) maps to a vmmalloc pool id (uint64) through a table;
// an entry lives while PyTorch holds uses of the pool (captures begun and not released, MemPool
// objects), as PyTorch's own allocator counts them (CUDACachingAllocator.cpp: beginAllocateToPool
// and createOrIncrefPool add one, releasePool takes one away). When the count reaches 0 the
// vmmalloc pool is released: its free memory goes back at once, the rest as tensors die.
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <sys/types.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <tuple>
#include <unordered_set>
#include <utility>
#include <vector>

#include "memory_history.hpp"

#if __has_include(<torch/version.h>)
#include <torch/version.h>
#endif
#ifndef TORCH_VERSION
#define TORCH_VERSION "unknown"
#endif

#define VMM_EXT_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

namespace tpa = torch::cuda::CUDAPluggableAllocator;
namespace cca = c10::cuda::CUDACachingAllocator;
using mempool_id = c10::cuda::MempoolId_t;
using stream_filter = std::function<bool(cudaStream_t)>;

// ---- libvmmalloc_torch.so's C functions (vmmalloc_torch.h), resolved from the loaded copy ------
struct library {
  void* (*malloc)(ssize_t, int, void*) = nullptr;
  void (*free)(void*, ssize_t, int, void*) = nullptr;
  int (*begin_pool)(int, std::uint64_t, int (*)(void*, void*), void*) = nullptr;
  int (*end_pool)(int, std::uint64_t) = nullptr;
  int (*release_pool)(int, std::uint64_t) = nullptr;
  int (*record_stream)(void*, void*) = nullptr;
  int (*pool_of)(const void*, std::uint64_t*) = nullptr;
  int (*pool_stats)(int, std::uint64_t, std::uint64_t*, std::uint64_t*, std::uint64_t*) = nullptr;
  int (*stats)(int, std::uint64_t*, int) = nullptr;
  const char* (*stat_names)() = nullptr;
  int (*trim)(int) = nullptr;
  int (*mem_info)(int, std::uint64_t*, std::uint64_t*) = nullptr;
  int (*set_fraction)(int, double) = nullptr;
  int (*fraction)(int, double*) = nullptr;
  int (*reset_peaks)(int) = nullptr;
  std::int64_t (*memory_map)(int, std::uint64_t*, std::int64_t) = nullptr;
  std::int64_t (*share)(const void*, char*, std::int64_t) = nullptr;
  void* (*import)(int, const char*, std::int64_t) = nullptr;
  int (*close_import)(void*) = nullptr;
  const char* (*last_error)() = nullptr;
};
library lib;

std::mutex err_mu;
std::string err_text;
thread_local std::string err_copy;

void set_error(std::string s) {
  std::lock_guard g(err_mu);
  err_text = std::move(s);
}

std::string lib_error() { return lib.last_error ? lib.last_error() : "(no message)"; }

// Called by vmmalloc with its lock held, on the allocating thread, between begin and end: the
// filter PyTorch handed to beginAllocateToPool (a capture id check, or "this thread"). It must not
// throw into C: an exception counts as "not this pool".
int call_filter(void* stream, void* user) {
  try {
    return (*static_cast<stream_filter*>(user))(static_cast<cudaStream_t>(stream)) ? 1 : 0;
  } catch (...) {
    return 0;
  }
}

// ---- PyTorch's memory statistics from vmmalloc's ---------------------------------------------
// One device's vmmalloc stats by name (vmm_torch_stat_names' order); every value 0 while the
// device has no allocator.
class stat_values {
 public:
  // vmm_torch_stats writes nothing when the device has no allocator: the zeros stay.
  explicit stat_values(int device) : v_(index().size()) {
    (void)lib.stats(device, v_.data(), static_cast<int>(v_.size()));
  }
  std::int64_t operator[](const char* name) const {
    auto it = index().find(name);
    return it == index().end() ? 0 : static_cast<std::int64_t>(v_[it->second]);
  }

 private:
  static const std::map<std::string, std::size_t>& index() {
    static const std::map<std::string, std::size_t> m = [] {
      std::map<std::string, std::size_t> r;
      std::string names = lib.stat_names();
      for (std::size_t at = 0, i = 0; at < names.size(); ++i) {
        std::size_t end = std::min(names.find(',', at), names.size());
        r.emplace(names.substr(at, end - at), i);
        at = end + 1;
      }
      return r;
    }();
    return m;
  }
  std::vector<std::uint64_t> v_;
};

// PyTorch's cumulative counters start again at resetAccumulatedStats: what vmmalloc's counters
// read then, per device.
struct accumulated {
  std::int64_t allocs = 0, frees = 0, creates = 0, releases = 0, failures = 0;
};
std::mutex acc_mu;
std::map<int, accumulated> acc_base;

accumulated accumulated_now(const stat_values& v) {
  return {v["allocs"], v["frees"], v["creates"], v["releases"], v["malloc_failures"]};
}

// The "all" entries (index 0, PyTorch's StatType::AGGREGATE); vmmalloc has no small and large
// pools in PyTorch's sense, so those entries stay 0. Counts carry no peak of their own (the
// current value stands in). requested_bytes and allocated_bytes (requests in 512 B units, as
// PyTorch's own allocator counts them) and their peaks are libvmmalloc_torch's counters of every
// malloc and free: exact. reserved_bytes is the device memory vmmalloc holds (mapped and idle).
template <class Stats>
Stats device_stats_of(int device) {
  Stats s{};
  const stat_values v(device);
  const accumulated now = accumulated_now(v);
  accumulated b;
  {
    std::lock_guard g(acc_mu);
    if (auto it = acc_base.find(device); it != acc_base.end()) b = it->second;
  }
  auto set = [](auto& st, std::int64_t current, std::int64_t peak) {
    st.current = current;
    st.peak = std::max(peak, current);
  };
  set(s.allocation[0], v["live"], v["live"]);
  s.allocation[0].allocated = now.allocs - b.allocs;
  s.allocation[0].freed = now.frees - b.frees;
  s.active[0] = s.allocation[0];
  set(s.allocated_bytes[0], v["allocated"], v["peak_allocated"]);
  s.active_bytes[0] = s.allocated_bytes[0];
  set(s.requested_bytes[0], v["requested"], v["peak_requested"]);
  set(s.reserved_bytes[0], v["physical"], v["peak_physical"]);
  set(s.segment[0], v["chunks"], v["chunks"]);
  s.num_device_alloc = now.creates - b.creates;
  s.num_device_free = now.releases - b.releases;
  s.num_ooms = now.failures - b.failures;
  return s;
}

// ---- the pool table ------------------------------------------------------------------------------
struct pool_entry {
  std::uint64_t id = 0;  // the vmmalloc pool
  int uses = 0;          // PyTorch's use count
  bool begun_once = false;  // a vmmalloc pool exists (MemPool objects make entries before that)
  std::vector<std::unique_ptr<stream_filter>> filters;  // captures begun, newest last
};

struct pool_table {
  std::mutex mu;  // taken before vmmalloc's lock, never inside it
  std::map<std::tuple<int, std::uint64_t, std::uint64_t>, pool_entry> pools;
  std::uint64_t next_id = 1;

  static std::tuple<int, std::uint64_t, std::uint64_t> key(int device, mempool_id id) {
    return {device, id.first, id.second};
  }
  pool_entry& entry(int device, mempool_id id) {
    pool_entry& e = pools[key(device, id)];
    if (e.id == 0) e.id = next_id++;
    return e;
  }
  pool_entry* find(int device, mempool_id id) {
    auto it = pools.find(key(device, id));
    return it == pools.end() ? nullptr : &it->second;
  }

  void begin(int device, mempool_id id, stream_filter filter) {
    std::lock_guard g(mu);
    const bool fresh = !find(device, id);
    pool_entry& e = entry(device, id);
    auto f = filter ? std::make_unique<stream_filter>(std::move(filter)) : nullptr;
    if (lib.begin_pool(device, e.id, f ? &call_filter : nullptr, f.get()) != 0) {
      const std::string why = lib_error();
      if (fresh) pools.erase(key(device, id));
      TORCH_CHECK(false, "vmmalloc: beginAllocateToPool(device ", device, ", pool (", id.first, ", ",
                  id.second, ")): ", why);
    }
    e.filters.push_back(std::move(f));
    e.begun_once = true;
    ++e.uses;
  }

  void end(int device, mempool_id id) {
    std::lock_guard g(mu);
    pool_entry* e = find(device, id);
    TORCH_CHECK(e && !e->filters.empty(), "vmmalloc: endAllocateToPool(device ", device, ", pool (",
                id.first, ", ", id.second, ")): not currently allocating to that pool");
    // vmmalloc ends the newest capture of the pool: its filter is the last one here, and it is
    // never called again once end_pool returns.
    TORCH_CHECK(lib.end_pool(device, e->id) == 0, "vmmalloc: endAllocateToPool: ", lib_error());
    e->filters.pop_back();
  }

  // Never throws: PyTorch calls it from CUDAGraph::reset, inside the graph's destructor.
  void release(int device, mempool_id id) noexcept {
    try {
      std::lock_guard g(mu);
      pool_entry* e = find(device, id);
      if (!e) return;  // a pool PyTorch never routed to vmmalloc
      if (--e->uses > 0) return;
      if (!e->filters.empty()) return;  // a capture still allocates to it (PyTorch never does this)
      if (e->begun_once && lib.release_pool(device, e->id) != 0)
        TORCH_WARN("vmmalloc: releasePool(device ", device, ", pool (", id.first, ", ", id.second,
                   ")): ", lib_error());
      pools.erase(key(device, id));
    } catch (...) {  // no memory for a message: the pool stays until exit
    }
  }

  void incref(int device, mempool_id id) {
    std::lock_guard g(mu);
    ++entry(device, id).uses;
  }

  int uses(int device, mempool_id id) {
    std::lock_guard g(mu);
    pool_entry* e = find(device, id);
    return e ? e->uses : 0;
  }

  // 0 when no vmmalloc pool exists for it (then it holds nothing).
  std::uint64_t vmm_id(int device, mempool_id id) {
    std::lock_guard g(mu);
    pool_entry* e = find(device, id);
    return e && e->begun_once ? e->id : 0;
  }

  int size() {
    std::lock_guard g(mu);
    return static_cast<int>(pools.size());
  }

  // PyTorch's id of vmmalloc pool `vid` on `device`; (0, 0) once PyTorch has let go of it.
  mempool_id torch_id(int device, std::uint64_t vid) {
    std::lock_guard g(mu);
    for (const auto& [k, e] : pools)
      if (std::get<0>(k) == device && e.id == vid) return {std::get<1>(k), std::get<2>(k)};
    return {0, 0};
  }
};
pool_table& table() {
  static auto* t = new pool_table;  // never destroyed: graphs die during interpreter shutdown
  return *t;
}

// ---- torch.cuda.memory_snapshot(): vmmalloc's memory map in PyTorch's form -------------------
// A segment is a run of contiguous mapped memory (a span of vmmalloc's heap, or a huge block's
// own chunk), not one cudaMalloc; its blocks tile it in address order, as PyTorch's do (Python
// computes each block's address from the sizes before it). allocated: the user's; active: also
// freed blocks waiting for another stream's work ("active_pending_free"); thread-cached and free
// blocks are "inactive". While torch.cuda.memory._record_memory_history is on, live blocks carry
// the stack of their allocation and device_traces the recorded events (memory_history.hpp).
vmm_torch_history::recorder& history() {
  static auto* h = new vmm_torch_history::recorder;  // never destroyed: frees run during shutdown
  return *h;
}

// PyTorch's id of the graph pool p's block belongs to ((0, 0): none), for history entries.
mempool_id pool_of_block(void* p, int device) {
  std::uint64_t vid = 0;
  return lib.pool_of(p, &vid) == 1 ? table().torch_id(device, vid) : mempool_id{0, 0};
}

// An allocation or free into the history. A failure to record (no host memory for the entry, a
// stack that cannot be gathered) must not fail or leak the allocation: the entry is dropped.
void note_history(bool allocated, void* p, size_t n, int device, cudaStream_t s) noexcept {
  try {
    if (allocated) history().allocated(p, n, device, s, pool_of_block(p, device));
    else history().freed(p, n, device, s, pool_of_block(p, device));
  } catch (...) {
  }
}

template <class B>
auto set_stack(B& b, vmm_torch_history::context_ptr ctx, int) -> decltype(b.context_when_allocated = ctx, void()) {
  b.context_when_allocated = std::move(ctx);  // the frames memory_viz shows for the block
}
template <class B>
void set_stack(B&, vmm_torch_history::context_ptr, long) {}

template <class F, class V>
void put(F& field, V v) {
  field = static_cast<F>(v);
}
template <class S>
auto mark_expandable(S& s, int) -> decltype(s.is_expandable = true, void()) {
  s.is_expandable = true;  // mapped on demand, as PyTorch's expandable segments are
}
template <class S>
void mark_expandable(S&, long) {}

constexpr int kMapDevices = 256;     // libvmmalloc_torch's device slots
constexpr std::size_t kMapWords = 8;  // VMM_TORCH_MAP_WORDS: uint64 words per block record

cca::SnapshotInfo snapshot_of(mempool_id only) {
  cca::SnapshotInfo out{};
  int devices = 0;  // device_traces: one (empty) list per device up to the last with memory
  std::vector<std::uint64_t> rec(std::size_t{4096} * kMapWords);  // grown when a map is larger
  const bool history_kept = history().on();
  for (int d = 0; d < kMapDevices; ++d) {
    std::int64_t n = 0;
    for (;;) {  // one walk when the map fits; it may grow between two calls: room for some more
      const auto room = static_cast<std::int64_t>(rec.size() / kMapWords);
      n = lib.memory_map(d, rec.data(), room);
      if (n <= room) break;
      rec.resize(static_cast<std::size_t>(n + n / 8 + 16) * kMapWords);
    }
    TORCH_CHECK(n >= 0, "vmmalloc: memory_snapshot (device ", d, "): ", lib_error());
    if (n == 0) continue;
    devices = std::max(devices, d + 1);
    cca::SegmentInfo* seg = nullptr;
    std::uint64_t seg_addr = 0;
    bool keep = false;
    for (std::int64_t i = 0; i < n; ++i) {
      const std::uint64_t* r = &rec[static_cast<std::size_t>(i) * kMapWords];
      if (!seg || r[0] != seg_addr) {
        const mempool_id owner = r[2] ? table().torch_id(d, r[2]) : mempool_id{0, 0};
        keep = only == mempool_id{0, 0} || owner == only;
        seg = nullptr;
        seg_addr = r[0];
        if (!keep) continue;
        seg = &out.segments.emplace_back();
        put(seg->device, d);
        put(seg->address, r[0]);
        put(seg->total_size, r[1]);
        seg->is_large = true;  // vmmalloc has no small-block segments in PyTorch's sense
        mark_expandable(*seg, 0);
        seg->owner_private_pool_id = owner;
      }
      if (!keep) continue;
      cca::BlockInfo& b = seg->blocks.emplace_back();
      const std::uint64_t state = r[7];  // 0 free, 1 live, 2 thread-cached, 3 waiting for a stream
      if (state == 1 && history_kept) set_stack(b, history().stack_of(r[4]), 0);
      put(b.size, r[5]);
      put(b.requested_size, state == 1 ? r[6] : 0);
      b.allocated = state == 1;
      b.active = state == 1 || state == 3;
      put(seg->requested_size, static_cast<std::uint64_t>(seg->requested_size) + (state == 1 ? r[6] : 0));
      if (b.allocated) put(seg->allocated_size, static_cast<std::uint64_t>(seg->allocated_size) + r[5]);
      if (b.active) put(seg->active_size, static_cast<std::uint64_t>(seg->active_size) + r[5]);
    }
  }
  out.device_traces = history().traces(static_cast<std::size_t>(devices));
  return out;
}

// ---- what the plain pluggable allocator refuses and graph code asks for --------------------------
// torch.compile's CUDA graph trees (torch/_inductor/cudagraph_trees.py) call getCheckpointState
// after every recording and checkPoolLiveAllocations around warm-ups and recordings
// (config.triton.slow_path_cudagraph_asserts, on by default); CUDAPluggableAllocator refuses
// both. MemPool objects call createOrIncrefPool / setUseOnOOM / setNoSplit / getPoolUseCount,
// which its base class refuses. Their signatures changed across PyTorch releases (a raw or a
// shared allocator pointer; setUseOnOOM with or without its flag): each form is declared here
// without `override`, so whichever the installed headers declare is overridden and the others are
// harmless overloads. vmm_torch_ext_install() then checks by calling them through the base class.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Woverloaded-virtual"
#if defined(__clang__)
#pragma GCC diagnostic ignored "-Winconsistent-missing-override"
#endif

// What getCheckpointState hands back: enough to say what it was taken of.
struct vmm_checkpoint final : cca::AllocatorState {
  int device = 0;
  mempool_id pool{0, 0};
};

struct vmm_allocator final : tpa::CUDAPluggableAllocator {
  vmm_allocator(std::function<void*(size_t, int, cudaStream_t)> a,
                std::function<void(void*, size_t, int, cudaStream_t)> f)
      : tpa::CUDAPluggableAllocator(std::move(a), std::move(f)) {}

  bool mempool_ok = false;  // set by install: MemPool's destructor calls will not throw
  bool snapshot_ok = false;  // set by install: PyTorch's snapshot call reaches the overrides below

  // True when the pool's live blocks are exactly `expected` (PyTorch's definition).
  bool checkPoolLiveAllocations(c10::DeviceIndex device, mempool_id id,
                                const std::unordered_set<void*>& expected) override {
    const std::uint64_t vid = table().vmm_id(device, id);
    if (vid == 0) return expected.empty();
    std::uint64_t live = 0;
    if (lib.pool_stats(device, vid, &live, nullptr, nullptr) != 1) return expected.empty();
    if (live != expected.size()) return false;
    for (void* p : expected) {
      std::uint64_t in = 0;
      if (lib.pool_of(p, &in) != 1 || in != vid) return false;
    }
    return true;
  }

  // A token, not a copy of the pool: vmmalloc cannot give a freed block back at its old address,
  // which restoring a checkpoint needs (setCheckpointPoolState below refuses).
  std::shared_ptr<cca::AllocatorState> getCheckpointState(c10::DeviceIndex device, mempool_id id) override {
    auto s = std::make_shared<vmm_checkpoint>();
    s->device = device;
    s->pool = id;
    return s;
  }

  cca::CheckpointDelta setCheckpointPoolState(c10::DeviceIndex device,
                                              std::shared_ptr<cca::AllocatorState>) override {
    TORCH_CHECK(false, "vmmalloc (device ", static_cast<int>(device),
                "): torch.compile's CUDA graph trees asked to restore a graph pool to a checkpoint "
                "(a new graph recorded after a replay on the same path, e.g. a new input shape); "
                "vmmalloc's graph pools cannot do that. Call torch.compiler.cudagraph_mark_step_begin() "
                "between iterations, keep shapes static, or use vmmalloc in MemPool mode "
                "(vmmalloc.torch.mem_pool()) for this part of the program.");
    return {};
  }

  void createOrIncrefPool(c10::DeviceIndex device, mempool_id id, std::shared_ptr<cca::CUDAAllocator> a) {
    incref(device, id, a.get());
  }
  void createOrIncrefPool(c10::DeviceIndex device, mempool_id id, cca::CUDAAllocator* a) {
    incref(device, id, a);
  }
  // The statistics PyTorch's own allocators keep (see device_stats_of); the base class refuses.
  using device_stats = decltype(std::declval<cca::CUDAAllocator&>().getDeviceStats(c10::DeviceIndex{0}));
  device_stats getDeviceStats(c10::DeviceIndex device) { return device_stats_of<device_stats>(device); }
  void resetPeakStats(c10::DeviceIndex device) { (void)lib.reset_peaks(device); }  // no allocator: nothing to reset

  // The largest block vmmalloc can hand out now, as a bound for cuDNN's workspace search: the
  // device's free memory plus the free chunks and idle handles vmmalloc holds. A guess, as
  // cudaMallocAsync's is: a workspace that then fails to allocate makes PyTorch search again.
  void cacheInfo(c10::DeviceIndex device, size_t* largest_block) {
    if (!largest_block) return;
    std::uint64_t free = 0, total = 0;
    if (lib.mem_info(device, &free, &total) != 0) free = 0;
    const stat_values v(device);
    *largest_block = static_cast<size_t>(free + v["free_chunk_bytes"] + v["idle"]);
  }
  // set_per_process_memory_fraction's counterpart (a hook: set_memory_fraction_fn below).
  double getMemoryFraction(c10::DeviceIndex device) {
    double f = 1.0;
    TORCH_CHECK(lib.fraction(device, &f) == 0, "vmmalloc: get_per_process_memory_fraction: ", lib_error());
    return f;
  }
  void resetAccumulatedStats(c10::DeviceIndex device) {
    const accumulated now = accumulated_now(stat_values(device));
    std::lock_guard g(acc_mu);
    acc_base[device] = now;
  }

  // torch.cuda.memory._record_memory_history (memory_history.hpp), in each form PyTorch declared.
  void recordHistory(bool enabled, cca::CreateContextFn gather, size_t max_entries, cca::RecordContext when,
                     bool clear, const std::vector<std::string>& skip) {
    set_history(enabled, gather, max_entries, when, clear, skip);
  }
  void recordHistory(bool enabled, cca::CreateContextFn gather, size_t max_entries, cca::RecordContext when,
                     bool clear) {
    set_history(enabled, gather, max_entries, when, clear, {});
  }
  void recordHistory(bool enabled, cca::CreateContextFn gather, size_t max_entries, cca::RecordContext when) {
    set_history(enabled, gather, max_entries, when, false, {});
  }
  bool isHistoryEnabled() { return history().on(); }

  // torch.cuda.memory_snapshot() and torch.cuda.memory._snapshot() (memory_viz): every device's
  // segments, or one pool's (PyTorch 2.6 and later pass the pool; (0, 0) = all). include_traces:
  // the trace is small (max_entries); it always comes along.
  cca::SnapshotInfo snapshot(mempool_id id, bool /*include_traces*/) { return snapshot_of(id); }
  cca::SnapshotInfo snapshot(mempool_id id) { return snapshot_of(id); }
  cca::SnapshotInfo snapshot() { return snapshot_of({0, 0}); }

  // torch.multiprocessing's CUDA tensors (reductions.reduce_tensor / rebuild_cuda_tensor): the
  // block's chunks as a handle (libvmmalloc_torch's vmm_torch_share: needs VMMALLOC_IPC=posix_fd),
  // and the receiver's mapping of it, unmapped when PyTorch drops the last storage on it. The
  // pointer PyTorch passes starts a block, so the offset is 0: the import points at the block.
  cca::ShareableHandle shareIpcHandle(void* ptr) override {
    std::string bytes(256, '\0');
    for (;;) {
      const std::int64_t n = lib.share(ptr, bytes.data(), static_cast<std::int64_t>(bytes.size()));
      TORCH_CHECK(n >= 0, "vmmalloc: cannot share this CUDA tensor with another process: ", lib_error());
      const bool fits = static_cast<std::size_t>(n) <= bytes.size();
      bytes.resize(static_cast<std::size_t>(n));
      if (fits) break;
    }
    cca::ShareableHandle h{};
    h.offset = 0;
    h.handle = std::move(bytes);
    return h;
  }
  // One mapping per handle while any storage uses it, as PyTorch's own allocator caches them.
  std::shared_ptr<void> getIpcDevPtr(std::string handle) override {
    std::lock_guard g(import_mu_);
    if (auto it = imports_.find(handle); it != imports_.end())
      if (auto p = it->second.lock()) return p;
    const int device = static_cast<int>(c10::cuda::current_device());
    void* p = lib.import(device, handle.data(), static_cast<std::int64_t>(handle.size()));
    TORCH_CHECK(p, "vmmalloc: cannot map a CUDA tensor shared by another process: ", lib_error());
    std::shared_ptr<void> sp(p, [](void* q) noexcept {
      if (lib.close_import(q) != 0) try {
          TORCH_WARN("vmmalloc: unmapping a shared CUDA tensor: ", lib_error());
        } catch (...) {  // a deleter must not throw (warnings turned into errors)
        }
    });
    for (auto it = imports_.begin(); it != imports_.end();)  // drop entries whose mapping is gone
      it = it->second.expired() ? imports_.erase(it) : std::next(it);
    imports_[handle] = sp;
    return sp;
  }

  int getPoolUseCount(c10::DeviceIndex device, mempool_id id) { return table().uses(device, id); }
  // vmmalloc has no last-resort pools and never splits across them: nothing to set.
  void setUseOnOOM(c10::DeviceIndex, mempool_id, bool) {}
  void setUseOnOOM(c10::DeviceIndex, mempool_id) {}
  void setNoSplit(c10::DeviceIndex, mempool_id) {}

 private:
  std::mutex import_mu_;
  std::map<std::string, std::weak_ptr<void>> imports_;

  static void set_history(bool enabled, cca::CreateContextFn gather, size_t max_entries, cca::RecordContext when,
                          bool clear, const std::vector<std::string>& skip) {
    TORCH_CHECK(!enabled || vmm_torch_history::available,
                "vmmalloc: torch.cuda.memory._record_memory_history needs the trace entries of PyTorch "
                "2.11 (this extension was built against ", TORCH_VERSION, "); memory_snapshot() works "
                "without it, and VMMALLOC_TRACE records every allocation for vmm-replay");
    history().set(enabled, gather, max_entries, when, clear, skip);
  }

  void incref(c10::DeviceIndex device, mempool_id id, cca::CUDAAllocator* a) {
    TORCH_CHECK(mempool_ok,
                "vmmalloc: torch.cuda.MemPool needs allocator hooks this PyTorch build does not let "
                "vmmalloc's extension provide; use vmmalloc in MemPool mode (vmmalloc.torch.mem_pool()) "
                "under PyTorch's own allocator instead");
    TORCH_CHECK(a == nullptr || a == this,
                "vmmalloc: a torch.cuda.MemPool with an allocator of its own cannot be used while "
                "vmmalloc is PyTorch's allocator (its memory would come from vmmalloc anyway)");
    table().incref(device, id);
  }
};
#pragma GCC diagnostic pop

// setUseOnOOM(device, id, false) through the base class, in whichever form it is declared:
// MemPool's destructor makes that call, and a throw there would end the process.
template <class A>
auto use_on_oom_off(A* a, int) -> decltype(a->setUseOnOOM(c10::DeviceIndex{0}, mempool_id{}, false), void()) {
  a->setUseOnOOM(c10::DeviceIndex{0}, mempool_id{}, false);
}
template <class A>
auto use_on_oom_off(A* a, long) -> decltype(a->setUseOnOOM(c10::DeviceIndex{0}, mempool_id{}), void()) {
  a->setUseOnOOM(c10::DeviceIndex{0}, mempool_id{});
}
template <class A>
void use_on_oom_off(A*, ...) {}

// Whether MemPool objects can work: createOrIncrefPool, getPoolUseCount and setUseOnOOM reach the
// overrides above (a pool id PyTorch never makes, undone at once).
bool probe_mempool(vmm_allocator& a) {
  cca::CUDAAllocator* base = &a;
  const mempool_id probe{~0ull, ~0ull};
  a.mempool_ok = true;
  try {
    base->createOrIncrefPool(0, probe, nullptr);
    const bool counted = table().uses(0, probe) == 1;
    use_on_oom_off(base, 0);
    table().release(0, probe);
    return counted;
  } catch (...) {
    table().release(0, probe);
    return false;
  }
}

// snapshot() through the base class, in whichever form this PyTorch declares.
template <int N>
struct rank : rank<N - 1> {};
template <>
struct rank<0> {};
template <class A>
auto base_snapshot(A* a, rank<2>) -> decltype(a->snapshot(mempool_id{}, false)) {
  return a->snapshot(mempool_id{~0ull, ~0ull}, false);
}
template <class A>
auto base_snapshot(A* a, rank<1>) -> decltype(a->snapshot(mempool_id{})) {
  return a->snapshot(mempool_id{~0ull, ~0ull});
}
template <class A>
auto base_snapshot(A* a, rank<0>) -> decltype(a->snapshot()) {
  return a->snapshot();
}

// Whether torch.cuda.memory_snapshot() reaches vmmalloc: the base class throws where none of the
// overloads above matches this PyTorch's declaration (a pool PyTorch never makes: nothing listed).
bool probe_snapshot(vmm_allocator& a) {
  cca::CUDAAllocator* base = &a;
  try {
    (void)base_snapshot(base, rank<2>{});
    return true;
  } catch (...) {
    return false;
  }
}

std::mutex install_mu;
// Also held by PyTorch (its current allocator). Never destroyed: PyTorch frees tensors during
// exit after static destructors ran (a tensor sent to another process is freed when PyTorch's
// static list of sent blocks goes), and a destroyed allocator there ends the process with "pure
// virtual method called".
std::shared_ptr<vmm_allocator>& installed = *new std::shared_ptr<vmm_allocator>;

template <class F>
bool resolve(void* h, const char* name, F& fn, std::string& missing) {
  void* s = dlsym(h, name);
  if (!s) missing += std::string(missing.empty() ? "" : ", ") + name;
  fn = reinterpret_cast<F>(s);
  return s != nullptr;
}

}  // namespace

// Makes vmmalloc PyTorch's CUDA allocator with every hook set. lib_path: the libvmmalloc_torch.so
// Python loaded (the same file gives the same copy: one allocator per device). Must run before
// the process's first CUDA allocation. 0, or -1 with vmm_torch_ext_last_error() saying why.
// A second call after success does nothing and returns 0.
VMM_EXT_EXPORT int vmm_torch_ext_install(const char* lib_path) {
  try {
    std::lock_guard g(install_mu);
    if (installed) return 0;
    if (!lib_path || !*lib_path) {
      set_error("vmm_torch_ext_install: no path to libvmmalloc_torch.so");
      return -1;
    }
    void* h = dlopen(lib_path, RTLD_NOW | RTLD_NOLOAD);  // the copy Python loaded
    if (!h) h = dlopen(lib_path, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
      const char* e = dlerror();
      set_error(std::string("vmm_torch_ext_install: cannot load ") + lib_path + ": " + (e ? e : "?"));
      return -1;
    }
    library l;
    std::string missing;
    resolve(h, "vmm_torch_malloc", l.malloc, missing);
    resolve(h, "vmm_torch_free", l.free, missing);
    resolve(h, "vmm_torch_begin_pool", l.begin_pool, missing);
    resolve(h, "vmm_torch_end_pool", l.end_pool, missing);
    resolve(h, "vmm_torch_release_pool", l.release_pool, missing);
    resolve(h, "vmm_torch_record_stream", l.record_stream, missing);
    resolve(h, "vmm_torch_pool_of", l.pool_of, missing);
    resolve(h, "vmm_torch_pool_stats", l.pool_stats, missing);
    resolve(h, "vmm_torch_stats", l.stats, missing);
    resolve(h, "vmm_torch_stat_names", l.stat_names, missing);
    resolve(h, "vmm_torch_trim", l.trim, missing);
    resolve(h, "vmm_torch_mem_info", l.mem_info, missing);
    resolve(h, "vmm_torch_set_memory_fraction", l.set_fraction, missing);
    resolve(h, "vmm_torch_memory_fraction", l.fraction, missing);
    resolve(h, "vmm_torch_reset_peaks", l.reset_peaks, missing);
    resolve(h, "vmm_torch_memory_map", l.memory_map, missing);
    resolve(h, "vmm_torch_share", l.share, missing);
    resolve(h, "vmm_torch_import", l.import, missing);
    resolve(h, "vmm_torch_close_import", l.close_import, missing);
    resolve(h, "vmm_torch_last_error", l.last_error, missing);
    if (!missing.empty()) {
      set_error(std::string("vmm_torch_ext_install: ") + lib_path + " lacks " + missing +
                ": it predates this extension; rebuild it");
      return -1;
    }
    lib = l;

    // PyTorch hands size_t; vmm_torch_malloc takes ssize_t (the same bits: Python's
    // CUDAPluggableAllocator passes the function pointer itself).
    // Out of memory becomes c10::OutOfMemoryError, torch.OutOfMemoryError in Python, as under
    // PyTorch's own allocator: code that catches it to retry smaller or free caches works.
    auto a = std::make_shared<vmm_allocator>(
        [](size_t n, int device, cudaStream_t s) -> void* {
          void* p = nullptr;
          try {
            p = lib.malloc(static_cast<ssize_t>(n), device, s);
          } catch (const std::bad_alloc& e) {
            TORCH_CHECK_WITH(OutOfMemoryError, false, e.what());
          }
          if (p && history().on()) note_history(true, p, n, device, s);
          return p;
        },
        [](void* p, size_t n, int device, cudaStream_t s) {
          if (p && history().on()) note_history(false, p, n, device, s);
          lib.free(p, static_cast<ssize_t>(n), device, s);
        });
    a->set_begin_allocate_to_pool([](int device, mempool_id id, stream_filter filter) {
      table().begin(device, id, std::move(filter));
    });
    a->set_end_allocate_to_pool_fn([](int device, mempool_id id) { table().end(device, id); });
    a->set_release_pool([](int device, mempool_id id) { table().release(device, id); });
    // A pointer of another allocator (a tensor PyTorch made from foreign memory) is refused by
    // the library and ignored here, as PyTorch's own allocator ignores what it does not own.
    a->set_record_stream_fn([](void* p, cudaStream_t s) { (void)lib.record_stream(p, s); });
    // torch.cuda.empty_cache(): free chunks and idle handles of every device go back.
    a->set_reset_fn([] { (void)lib.trim(-1); });
    // torch.cuda.set_per_process_memory_fraction(f, device): PyTorch has checked 0 <= f <= 1.
    // The limit counts what vmmalloc holds (mapped and idle), as PyTorch's counts what it reserved.
    a->set_memory_fraction_fn([](double f, int device) {
      TORCH_CHECK(lib.set_fraction(device, f) == 0, "vmmalloc: set_per_process_memory_fraction: ", lib_error());
    });
    a->mempool_ok = probe_mempool(*a);
    a->snapshot_ok = probe_snapshot(*a);
    // What torch._C._cuda_customAllocator does after creating one (createCustomAllocator): init
    // marks it initialized; its device count argument is unused without an init function.
    a->init(0);
    // Throws "Can't swap an already initialized allocator" after the first CUDA allocation.
    tpa::changeCurrentAllocator(a);
    installed = std::move(a);
    return 0;
  } catch (const c10::Error& e) {
    set_error(std::string("vmm_torch_ext_install: ") + e.what_without_backtrace());
  } catch (const std::exception& e) {
    set_error(std::string("vmm_torch_ext_install: ") + e.what());
  } catch (...) {
    set_error("vmm_torch_ext_install: unknown exception");
  }
  return -1;
}

// 1 once vmm_torch_ext_install() succeeded.
VMM_EXT_EXPORT int vmm_torch_ext_installed(void) {
  std::lock_guard g(install_mu);
  return installed ? 1 : 0;
}

// Bit 0: graph pools and record_stream hooks set (always, once installed); bit 1: MemPool
// objects work (createOrIncrefPool and setUseOnOOM reach vmmalloc in this PyTorch); bit 2:
// torch.cuda.memory_snapshot() reaches vmmalloc.
VMM_EXT_EXPORT int vmm_torch_ext_features(void) {
  std::lock_guard g(install_mu);
  if (!installed) return 0;
  return 1 | (installed->mempool_ok ? 2 : 0) | (installed->snapshot_ok ? 4 : 0);
}

// PyTorch pools the extension maps to vmmalloc pools now (captures not yet released, MemPool
// objects alive). Tests: back to its baseline once graphs and pools are gone.
VMM_EXT_EXPORT int vmm_torch_ext_pool_count(void) { return table().size(); }

// The vmmalloc pool id of PyTorch's pool (first, second) on `device`; 0 when it has none.
VMM_EXT_EXPORT std::uint64_t vmm_torch_ext_pool_id(int device, std::uint64_t first, std::uint64_t second) {
  return table().vmm_id(device, mempool_id{first, second});
}

// The PyTorch version the extension was compiled against ("2.11.0"...).
VMM_EXT_EXPORT const char* vmm_torch_ext_torch_version(void) { return TORCH_VERSION; }

VMM_EXT_EXPORT const char* vmm_torch_ext_last_error(void) {
  std::lock_guard g(err_mu);
  err_copy = err_text;
  return err_copy.c_str();
}
