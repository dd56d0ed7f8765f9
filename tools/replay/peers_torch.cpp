// SPDX-License-Identifier: Apache-2.0
// PyTorch's CUDA caching allocator as a peer: raw_alloc_with_stream / raw_delete, the calls
// PyTorch's own tensors end up in. Built only with -DVMM_WITH_TORCH=ON when find_package(Torch)
// succeeds (VMM_REPLAY_TORCH). UNTESTED: no libtorch was available where this was written; it
// uses only long-stable entry points. PYTORCH_CUDA_ALLOC_CONF (e.g. expandable_segments:True)
// applies as usual.
#include "peers.hpp"

#include <ATen/ATen.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <cuda_runtime_api.h>

namespace vmm::replay {

namespace {
namespace cca = c10::cuda::CUDACachingAllocator;

class torch_peer final : public peer {
 public:
  explicit torch_peer(int device) : dev_(device) {
    // Any CUDA tensor initialises the caching allocator (lazy CUDA init).
    auto t = at::empty({1}, at::TensorOptions().device(at::kCUDA, device));
    (void)t;
    reset_peaks();
  }
  std::string name() const override { return "torch"; }
  std::string detail() const override { return "PyTorch CUDA caching allocator, device " + std::to_string(dev_); }
  void* allocate(std::size_t n, void* s) noexcept override {
    try {
      return cca::raw_alloc_with_stream(n, static_cast<cudaStream_t>(s));
    } catch (const std::exception& e) {
      set_error(std::string("torch raw_alloc: ") + e.what());
      return nullptr;
    }
  }
  bool deallocate(void* p, std::size_t, void*) noexcept override {
    try {
      cca::raw_delete(p);
      return true;
    } catch (const std::exception& e) {
      set_error(std::string("torch raw_delete: ") + e.what());
      return false;
    }
  }
  bool synchronize() noexcept override {
    cudaError_t e = cudaDeviceSynchronize();
    if (e != cudaSuccess) set_error(std::string("cudaDeviceSynchronize: ") + cudaGetErrorName(e));
    return e == cudaSuccess;
  }
  void reset_peaks() noexcept override {
    try {
      cca::resetPeakStats(static_cast<c10::DeviceIndex>(dev_));
    } catch (...) {
    }
  }
  // Segments held now: the measure of report()'s reserved_bytes.peak.
  memory_now current() noexcept override {
    memory_now m;
    try {
      auto s = cca::getDeviceStats(static_cast<c10::DeviceIndex>(dev_));
      m.mapped = static_cast<std::uint64_t>(s.reserved_bytes[0].current);
    } catch (const std::exception& e) {
      set_error(std::string("torch getDeviceStats: ") + e.what());
    }
    return m;
  }
  memory_report report() override {
    memory_report r;
    auto s = cca::getDeviceStats(static_cast<c10::DeviceIndex>(dev_));
    // Index 0 is StatType::AGGREGATE in every version (its namespace moved between releases).
    r.peak_mapped = static_cast<std::uint64_t>(s.reserved_bytes[0].peak);
    r.mapped_source = "torch reserved_bytes.peak (segments held)";
    r.extra = {{"peak_allocated_bytes", double(s.allocated_bytes[0].peak)},
               {"num_alloc_retries", double(s.num_alloc_retries)}};
    return r;
  }
  bool copy(void* d, const void* src, std::size_t n) noexcept override {
    cudaError_t e = cudaMemcpy(d, src, n, cudaMemcpyDeviceToDevice);
    if (e != cudaSuccess) set_error(std::string("cudaMemcpy: ") + cudaGetErrorName(e));
    return e == cudaSuccess;
  }
  bool fill(void* p, int b, std::size_t n) noexcept override {
    cudaError_t e = cudaMemset(p, b, n);
    if (e != cudaSuccess) set_error(std::string("cudaMemset: ") + cudaGetErrorName(e));
    return e == cudaSuccess;
  }
  bool is_device() const override { return true; }
  bool stream_ordered() const override { return true; }  // raw_delete records events, never syncs
  bool release_cached(std::size_t) noexcept override {  // empty_cache has no `keep`
    try {
      cca::emptyCache();
      return true;
    } catch (const std::exception& e) {
      set_error(e.what());
      return false;
    }
  }

 private:
  int dev_;
};
}  // namespace

bool have_torch_peer() { return true; }
std::unique_ptr<peer> make_torch(int device) { return std::make_unique<torch_peer>(device); }

}  // namespace vmm::replay
