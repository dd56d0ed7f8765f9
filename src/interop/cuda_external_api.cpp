// SPDX-License-Identifier: Apache-2.0
// external_api on the CUDA runtime (linked statically: it loads libcuda at run time, so a program
// starts on a machine without a driver and gets errc::no_driver from the first call).
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <string>

#include "vmmalloc/vulkan_interop.hpp"

namespace vmm::vk {
namespace {

errc kind_of(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return errc::ok;
    case cudaErrorMemoryAllocation: return errc::out_of_memory;
    case cudaErrorInvalidValue:
    case cudaErrorInvalidResourceHandle:
    case cudaErrorInvalidDevice: return errc::invalid_value;
    case cudaErrorNotSupported: return errc::not_supported;
    case cudaErrorNotPermitted: return errc::not_permitted;
    case cudaErrorInsufficientDriver:
    case cudaErrorNoDevice:
    case cudaErrorInitializationError: return errc::no_driver;
    default: return errc::other;
  }
}

status st_of(cudaError_t e, const char* op) {
  if (e == cudaSuccess) return {};
  return {kind_of(e), static_cast<int>(e), cudaGetErrorName(e), op};
}

// Makes `device` current for one call and restores the caller's device after it.
class device_scope {
 public:
  explicit device_scope(int device) {
    if (cudaGetDevice(&prev_) != cudaSuccess) prev_ = -1;
    if (prev_ != device) {
      st_ = st_of(cudaSetDevice(device), "cudaSetDevice");
      switched_ = st_.ok();
    }
  }
  ~device_scope() {
    if (switched_ && prev_ >= 0) cudaSetDevice(prev_);
  }
  const status& st() const { return st_; }

 private:
  int prev_ = -1;
  bool switched_ = false;
  status st_;
};

class cuda_api final : public external_api {
 public:
  explicit cuda_api(int device) : dev_(device) {}
  const char* name() override { return "cuda-runtime"; }

  result<void*> import_memory(int fd, std::uint64_t size, bool dedicated) override {
    device_scope d(dev_);
    if (!d.st().ok()) return {nullptr, d.st()};
    cudaExternalMemoryHandleDesc desc{};
    desc.type = cudaExternalMemoryHandleTypeOpaqueFd;
    desc.handle.fd = fd;
    desc.size = size;
    desc.flags = dedicated ? cudaExternalMemoryDedicated : 0;
    cudaExternalMemory_t m = nullptr;
    status s = st_of(cudaImportExternalMemory(&m, &desc), "cudaImportExternalMemory");
    return {s.ok() ? static_cast<void*>(m) : nullptr, s};
  }

  result<void*> map_buffer(void* memory, std::uint64_t offset, std::uint64_t size) override {
    device_scope d(dev_);
    if (!d.st().ok()) return {nullptr, d.st()};
    cudaExternalMemoryBufferDesc desc{};
    desc.offset = offset;
    desc.size = size;
    desc.flags = 0;
    void* p = nullptr;
    status s = st_of(cudaExternalMemoryGetMappedBuffer(&p, static_cast<cudaExternalMemory_t>(memory), &desc),
                     "cudaExternalMemoryGetMappedBuffer");
    return {s.ok() ? p : nullptr, s};
  }

  status free_buffer(void* ptr) override {
    device_scope d(dev_);
    if (!d.st().ok()) return d.st();
    return st_of(cudaFree(ptr), "cudaFree");
  }

  status destroy_memory(void* memory) override {
    device_scope d(dev_);
    if (!d.st().ok()) return d.st();
    return st_of(cudaDestroyExternalMemory(static_cast<cudaExternalMemory_t>(memory)), "cudaDestroyExternalMemory");
  }

  result<void*> import_semaphore(int fd, semaphore_kind kind) override {
    device_scope d(dev_);
    if (!d.st().ok()) return {nullptr, d.st()};
    cudaExternalSemaphoreHandleDesc desc{};
    desc.type = kind == semaphore_kind::timeline ? cudaExternalSemaphoreHandleTypeTimelineSemaphoreFd
                                                 : cudaExternalSemaphoreHandleTypeOpaqueFd;
    desc.handle.fd = fd;
    desc.flags = 0;
    cudaExternalSemaphore_t s = nullptr;
    status st = st_of(cudaImportExternalSemaphore(&s, &desc), "cudaImportExternalSemaphore");
    return {st.ok() ? static_cast<void*>(s) : nullptr, st};
  }

  status signal_semaphore(void* sem, std::uint64_t value, stream_t s) override {
    device_scope d(dev_);
    if (!d.st().ok()) return d.st();
    cudaExternalSemaphoreSignalParams p{};
    p.params.fence.value = value;
    auto h = static_cast<cudaExternalSemaphore_t>(sem);
    return st_of(cudaSignalExternalSemaphoresAsync(&h, &p, 1, static_cast<cudaStream_t>(s)),
                 "cudaSignalExternalSemaphoresAsync");
  }

  status wait_semaphore(void* sem, std::uint64_t value, stream_t s) override {
    device_scope d(dev_);
    if (!d.st().ok()) return d.st();
    cudaExternalSemaphoreWaitParams p{};
    p.params.fence.value = value;
    auto h = static_cast<cudaExternalSemaphore_t>(sem);
    return st_of(cudaWaitExternalSemaphoresAsync(&h, &p, 1, static_cast<cudaStream_t>(s)),
                 "cudaWaitExternalSemaphoresAsync");
  }

  status destroy_semaphore(void* sem) override {
    device_scope d(dev_);
    if (!d.st().ok()) return d.st();
    return st_of(cudaDestroyExternalSemaphore(static_cast<cudaExternalSemaphore_t>(sem)),
                 "cudaDestroyExternalSemaphore");
  }

  result<fence_t> record_fence(stream_t s) override {
    device_scope d(dev_);
    if (!d.st().ok()) return {0, d.st()};
    cudaEvent_t e = nullptr;
    if (status c = st_of(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreateWithFlags"); !c.ok())
      return {0, c};
    if (status r = st_of(cudaEventRecord(e, static_cast<cudaStream_t>(s)), "cudaEventRecord"); !r.ok()) {
      cudaEventDestroy(e);
      return {0, r};
    }
    return {reinterpret_cast<fence_t>(e), {}};
  }

  bool fence_done(fence_t f) override {
    if (!f) return true;
    device_scope d(dev_);
    // cudaErrorNotReady: pending. Any other error keeps the block deferred (a sticky context
    // error means the memory must not be handed out again anyway).
    return cudaEventQuery(reinterpret_cast<cudaEvent_t>(f)) == cudaSuccess;
  }

  status wait_fence(fence_t f) override {
    if (!f) return {};
    device_scope d(dev_);
    if (!d.st().ok()) return d.st();
    return st_of(cudaEventSynchronize(reinterpret_cast<cudaEvent_t>(f)), "cudaEventSynchronize");
  }

  void drop_fence(fence_t f) override {
    if (!f) return;
    device_scope d(dev_);
    cudaEventDestroy(reinterpret_cast<cudaEvent_t>(f));
  }

 private:
  int dev_;
};

}  // namespace

std::shared_ptr<external_api> cuda_external_api(int device) { return std::make_shared<cuda_api>(device); }

context context::open_for_cuda(int cuda_device) {
  cudaDeviceProp prop{};
  if (status s = st_of(cudaGetDeviceProperties(&prop, cuda_device), "cudaGetDeviceProperties"); !s.ok())
    throw_status(s, "vmm::vk::context::open_for_cuda(" + std::to_string(cuda_device) + ")");
  std::array<std::uint8_t, 16> uuid{};
  std::memcpy(uuid.data(), prop.uuid.bytes, 16);
  return open(&uuid);
}

}  // namespace vmm::vk
