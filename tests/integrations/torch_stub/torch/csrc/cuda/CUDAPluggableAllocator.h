// SPDX-License-Identifier: Apache-2.0
// A stand-in for PyTorch 2.11's torch/csrc/cuda/CUDAPluggableAllocator.h (the members the
// extension uses, with PyTorch's signatures). Its hooks are public here so the test can play
// PyTorch's part (in PyTorch they are protected and called by CUDAGraph, MemPool, recordStream).
#pragma once
#include <c10/cuda/CUDACachingAllocator.h>

namespace torch::cuda::CUDAPluggableAllocator {

struct CUDAPluggableAllocator : c10::cuda::CUDACachingAllocator::CUDAAllocator {
  CUDAPluggableAllocator(std::function<void*(size_t, int, cudaStream_t)> alloc_fn,
                         std::function<void(void*, size_t, int, cudaStream_t)> free_fn)
      : alloc_fn_(std::move(alloc_fn)), free_fn_(std::move(free_fn)) {}
  CUDAPluggableAllocator(CUDAPluggableAllocator& other) = delete;
  CUDAPluggableAllocator(CUDAPluggableAllocator&& other) = delete;

  void set_reset_fn(std::function<void()> f) { reset_fn_ = std::move(f); }
  void set_memory_fraction_fn(std::function<void(double, int)> f) { memory_fraction_fn_ = std::move(f); }
  void set_record_stream_fn(std::function<void(void* ptr, cudaStream_t stream)> f) { record_stream_fn_ = std::move(f); }
  void set_begin_allocate_to_pool(
      std::function<void(int, c10::cuda::MempoolId_t, std::function<bool(cudaStream_t)>)> f) {
    begin_allocate_to_pool_fn_ = std::move(f);
  }
  void set_end_allocate_to_pool_fn(std::function<void(int, c10::cuda::MempoolId_t)> f) {
    end_allocate_to_pool_fn_ = std::move(f);
  }
  void set_release_pool(std::function<void(int, c10::cuda::MempoolId_t)> f) { relase_pool_fn_ = std::move(f); }

  std::string name() override { return "pluggable"; }
  void init(int) override { initialized_ = true; }
  // As PyTorch's: emptyCache calls the reset function; the statistics are refused.
  void emptyCache(c10::cuda::MempoolId_t = {0, 0}) override {
    if (reset_fn_) reset_fn_();
  }
  // As PyTorch's: the setting goes to the hook when there is one, else it is dropped.
  void setMemoryFraction(double fraction, c10::DeviceIndex device) override {
    if (memory_fraction_fn_) memory_fraction_fn_(fraction, device);
  }
  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex) override {
    throw c10::Error("CUDAPluggableAllocator does not yet support getDeviceStats");
  }
  void resetAccumulatedStats(c10::DeviceIndex) override {
    throw c10::Error("CUDAPluggableAllocator does not yet support resetAccumulatedStats");
  }
  void cacheInfo(c10::DeviceIndex, size_t*) override {
    throw c10::Error("CUDAPluggableAllocator does not yet support cacheInfo");
  }
  void resetPeakStats(c10::DeviceIndex) override {
    throw c10::Error("CUDAPluggableAllocator does not yet support resetPeakStats");
  }
#ifdef VMM_STUB_OLD_API
  c10::cuda::CUDACachingAllocator::SnapshotInfo snapshot() override {
#else
  c10::cuda::CUDACachingAllocator::SnapshotInfo snapshot(c10::cuda::MempoolId_t, bool) override {
#endif
    throw c10::Error("CUDAPluggableAllocator does not yet support snapshot");
  }
#ifndef VMM_STUB_OLD_API
  void recordHistory(bool, c10::cuda::CUDACachingAllocator::CreateContextFn, size_t,
                     c10::cuda::CUDACachingAllocator::RecordContext, bool, const std::vector<std::string>&) override {
    throw c10::Error("CUDAPluggableAllocator does not yet support recordHistory");
  }
#endif
  c10::cuda::CUDACachingAllocator::ShareableHandle shareIpcHandle(void*) override {
    throw c10::Error("CUDAPluggableAllocator does not yet support shareIPcHandle");
  }
  std::shared_ptr<void> getIpcDevPtr(std::string) override {
    throw c10::Error("CUDAPluggableAllocator does not yet support getIpcDevPtr");
  }
  std::shared_ptr<c10::cuda::CUDACachingAllocator::AllocatorState> getCheckpointState(
      c10::DeviceIndex, c10::cuda::MempoolId_t) override {
    throw c10::Error("CUDAPluggableAllocator does not yet support getCheckpointState");
  }
  c10::cuda::CUDACachingAllocator::CheckpointDelta setCheckpointPoolState(
      c10::DeviceIndex, std::shared_ptr<c10::cuda::CUDACachingAllocator::AllocatorState>) override {
    throw c10::Error("CUDAPluggableAllocator does not yet support setCheckpointPoolState");
  }

  std::function<void*(size_t, int, cudaStream_t)> alloc_fn_;
  std::function<void(void*, size_t, int, cudaStream_t)> free_fn_;
  std::function<void()> reset_fn_;
  std::function<void(double, int)> memory_fraction_fn_;
  std::function<void(void* ptr, cudaStream_t stream)> record_stream_fn_;
  std::function<void(int, c10::cuda::MempoolId_t, std::function<bool(cudaStream_t)>)> begin_allocate_to_pool_fn_;
  std::function<void(int, c10::cuda::MempoolId_t)> end_allocate_to_pool_fn_;
  std::function<void(int, c10::cuda::MempoolId_t)> relase_pool_fn_;
  bool initialized_ = false;
};

// PyTorch's current allocator (c10::cuda::CUDACachingAllocator::allocator there).
inline std::shared_ptr<c10::cuda::CUDACachingAllocator::CUDAAllocator> current_custom_allocator;
inline void changeCurrentAllocator(const std::shared_ptr<c10::cuda::CUDACachingAllocator::CUDAAllocator>& a) {
  if (current_custom_allocator) throw c10::Error("Can't swap an already initialized allocator");
  current_custom_allocator = a;
}

}  // namespace torch::cuda::CUDAPluggableAllocator
