// SPDX-License-Identifier: Apache-2.0
// A stand-in for the part of PyTorch's c10/cuda/CUDACachingAllocator.h that
// src/integrations/torch_ext/vmm_torch_ext.cpp uses, so the extension's logic builds and runs in CI
// without PyTorch (test_torch_ext_stub.cpp). Declarations follow PyTorch 2.11's; with
// -DVMM_STUB_OLD_API the MemPool calls take the older forms (a raw allocator pointer,
// setUseOnOOM without its flag) and getMemoryFraction is absent. The base class refuses what PyTorch's base class refuses.
#pragma once
#include <cuda_runtime_api.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <ctime>
#include <exception>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

namespace c10 {
using DeviceIndex = std::int8_t;
struct Error : std::exception {
  std::string msg;
  explicit Error(std::string m) : msg(std::move(m)) {}
  const char* what() const noexcept override { return msg.c_str(); }
  const char* what_without_backtrace() const noexcept { return msg.c_str(); }
};
struct OutOfMemoryError : Error {  // torch.OutOfMemoryError in Python
  using Error::Error;
};
template <class... A>
std::string str(const A&... a) {
  std::ostringstream o;
  (o << ... << a);
  return o.str();
}
struct GatheredContext {  // a captured stack (c10/util: Python and C++ frames in PyTorch)
  virtual ~GatheredContext() = default;
};
struct DataPtr {
  void* p = nullptr;
  void* get() const { return p; }
};
namespace CachingAllocator {
struct Stat {
  std::int64_t current = 0, peak = 0, allocated = 0, freed = 0;
};
enum struct StatType : std::uint64_t { AGGREGATE = 0, SMALL_POOL = 1, LARGE_POOL = 2, NUM_TYPES = 3 };
using StatArray = std::array<Stat, static_cast<std::size_t>(StatType::NUM_TYPES)>;
}  // namespace CachingAllocator
namespace CachingDeviceAllocator {
using namespace c10::CachingAllocator;
struct DeviceStats {
  StatArray allocation, segment, active, inactive_split;
  StatArray allocated_bytes, reserved_bytes, active_bytes, inactive_split_bytes, requested_bytes;
  std::int64_t num_alloc_retries = 0, num_ooms = 0;
  Stat oversize_allocations, oversize_segments;
  std::int64_t num_sync_all_streams = 0, num_device_alloc = 0, num_device_free = 0, max_split_size = 0;
};
}  // namespace CachingDeviceAllocator
namespace cuda {
using CaptureId_t = unsigned long long;
using MempoolId_t = std::pair<CaptureId_t, CaptureId_t>;
namespace CUDACachingAllocator {
struct AllocatorState {
  virtual ~AllocatorState() = default;
};
struct CheckpointDelta {
  std::vector<void*> ptrs_freed;
  std::vector<DataPtr> dataptrs_allocd;
};
// What snapshot() returns (torch.cuda.memory_snapshot()): 2.11's fields that the extension
// fills; the older form has int64 sizes, no is_expandable and no history (an empty TraceEntry).
#ifdef VMM_STUB_OLD_API
using snapshot_size = std::int64_t;
#else
using snapshot_size = std::size_t;
#endif
struct BlockInfo {
  snapshot_size size = 0, requested_size = 0;
  std::int32_t gc_counter = 0;
  bool allocated = false, active = false;
#ifndef VMM_STUB_OLD_API
  std::shared_ptr<GatheredContext> context_when_allocated;
#endif
};
struct SegmentInfo {
  c10::DeviceIndex device = 0;
  snapshot_size address = 0, total_size = 0, requested_size = 0, allocated_size = 0, active_size = 0;
  cudaStream_t stream = nullptr;
  bool is_large = false;
#ifndef VMM_STUB_OLD_API
  bool is_expandable = false;
#endif
  MempoolId_t owner_private_pool_id = {0, 0};
  std::vector<BlockInfo> blocks;
};
#ifdef VMM_STUB_OLD_API
struct TraceEntry {};  // an older release's entry: the extension builds without history
#else
using approx_time_t = std::int64_t;
struct TraceEntry {
  enum Action { ALLOC, FREE_REQUESTED, FREE_COMPLETED, SEGMENT_ALLOC, SEGMENT_FREE, SEGMENT_MAP, SEGMENT_UNMAP, SNAPSHOT, OOM };
  TraceEntry(Action action, c10::DeviceIndex device, std::size_t addr, std::size_t size, cudaStream_t stream,
             MempoolId_t mempool, approx_time_t time, std::shared_ptr<GatheredContext> context = nullptr,
             std::string compile_context = "", std::string user_metadata = "")
      : action_(action), device_(device), addr_(addr), context_(std::move(context)), stream_(stream), size_(size),
        mempool_(std::move(mempool)), compile_context_(std::move(compile_context)),
        user_metadata_(std::move(user_metadata)) {
    time_.approx_t_ = time;
  }
  Action action_;
  c10::DeviceIndex device_;
  std::size_t addr_;
  std::shared_ptr<GatheredContext> context_;
  cudaStream_t stream_{};
  std::size_t size_;
  MempoolId_t mempool_;
  union {
    std::time_t t_;
    approx_time_t approx_t_;
  } time_{};
  std::string compile_context_, user_metadata_;
};
#endif
struct ShareableHandle {  // what shareIpcHandle returns: torch.multiprocessing pickles both
  std::ptrdiff_t offset = 0;
  std::string handle;
};
enum struct RecordContext { NEVER = 0, STATE = 1, ALLOC = 2, ALL = 3 };
using CreateContextFn = std::shared_ptr<GatheredContext> (*)();
struct SnapshotInfo {
  std::vector<SegmentInfo> segments;
  std::vector<std::vector<TraceEntry>> device_traces;
};
struct CUDAAllocator {
  virtual ~CUDAAllocator() = default;
  virtual std::string name() = 0;
  virtual void init(int device_count) = 0;
  virtual void emptyCache(MempoolId_t mempool_id = {0, 0}) = 0;
  virtual c10::CachingDeviceAllocator::DeviceStats getDeviceStats(DeviceIndex device) = 0;
  virtual void resetAccumulatedStats(DeviceIndex device) = 0;
  virtual void resetPeakStats(DeviceIndex device) = 0;
  virtual void cacheInfo(DeviceIndex device, size_t* largestBlock) = 0;
  virtual void setMemoryFraction(double fraction, DeviceIndex device) = 0;
#ifdef VMM_STUB_OLD_API
  virtual SnapshotInfo snapshot() = 0;
#else
  virtual SnapshotInfo snapshot(MempoolId_t mempool_id = {0, 0}, bool include_traces = true) = 0;
#endif
#ifndef VMM_STUB_OLD_API
  virtual bool isHistoryEnabled() { throw Error(name() + " does not yet support recordHistory"); }
  virtual void recordHistory(bool enabled, CreateContextFn context_recorder, size_t alloc_trace_max_entries,
                             RecordContext when, bool clearHistory, const std::vector<std::string>& skip_actions) = 0;
#endif
  virtual ShareableHandle shareIpcHandle(void* ptr) = 0;
  virtual std::shared_ptr<void> getIpcDevPtr(std::string handle) = 0;
  virtual std::shared_ptr<AllocatorState> getCheckpointState(DeviceIndex, MempoolId_t) = 0;
  virtual CheckpointDelta setCheckpointPoolState(DeviceIndex, std::shared_ptr<AllocatorState>) = 0;
  virtual bool checkPoolLiveAllocations(DeviceIndex, MempoolId_t, const std::unordered_set<void*>&) {
    throw Error(name() + " does not yet support checkPoolLiveAllocations");
  }
#ifdef VMM_STUB_OLD_API
  virtual void createOrIncrefPool(DeviceIndex, MempoolId_t, CUDAAllocator* = nullptr) {
    throw Error(name() + " does not yet support createOrIncrefPool");
  }
  virtual void setUseOnOOM(DeviceIndex, MempoolId_t) { throw Error(name() + " does not yet support setUseOnOOM"); }
#else
  virtual void createOrIncrefPool(DeviceIndex, MempoolId_t, std::shared_ptr<CUDAAllocator> = nullptr) {
    throw Error(name() + " does not yet support createOrIncrefPool");
  }
  virtual void setUseOnOOM(DeviceIndex, MempoolId_t, bool) { throw Error(name() + " does not yet support setUseOnOOM"); }
  // Newer releases only (torch.cuda.get_per_process_memory_fraction).
  virtual double getMemoryFraction(DeviceIndex) { throw Error(name() + " does not yet support getMemoryFraction"); }
#endif
  virtual void setNoSplit(DeviceIndex, MempoolId_t) { throw Error(name() + " does not yet support setNoSplit"); }
  virtual int getPoolUseCount(DeviceIndex, MempoolId_t) { throw Error(name() + " does not yet support getPoolUseCount"); }
};
}  // namespace CUDACachingAllocator
}  // namespace cuda
}  // namespace c10

#define TORCH_CHECK(cond, ...)                              \
  do {                                                      \
    if (!(cond)) throw ::c10::Error(::c10::str(__VA_ARGS__)); \
  } while (0)
#define TORCH_CHECK_WITH(error_t, cond, ...)                    \
  do {                                                          \
    if (!(cond)) throw ::c10::error_t(::c10::str(__VA_ARGS__)); \
  } while (0)
#define TORCH_WARN(...) (void)::c10::str(__VA_ARGS__)
