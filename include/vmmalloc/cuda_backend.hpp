// SPDX-License-Identifier: Apache-2.0
// vmmalloc CUDA backend: the driver API, loaded at run time with dlopen("libcuda.so.1") +
// cuGetProcAddress. The library has no link-time dependency on libcuda: one binary runs on a
// machine without a GPU and reports "no CUDA driver" as an error, not a loader failure.
#pragma once

#include <memory>
#include <string>

#include "vmmalloc/backend.hpp"

namespace vmm {

class cuda_backend {
 public:
  explicit cuda_backend(int device = 0);
  ~cuda_backend();
  cuda_backend(cuda_backend&&) noexcept;
  cuda_backend& operator=(cuda_backend&&) = delete;

  // ok() when the driver loaded, cuInit succeeded and the device exists with VMM support;
  // otherwise the reason ("no CUDA driver: libcuda.so.1: cannot open shared object file").
  const status& load_status() const;
  bool available() const { return load_status().ok(); }
  const std::string& load_message() const;
  int device() const;

  const char* name() { return "cuda"; }
  unsigned capabilities();
  result<granularity_info> granularity(const chunk_props&);
  result<std::uintptr_t> reserve(std::size_t size, std::size_t align);
  status free_reservation(std::uintptr_t va, std::size_t size);
  result<mem_handle> create(std::size_t size, const chunk_props&);
  status release(mem_handle);
  result<chunk_info> query(mem_handle);
  status map(std::uintptr_t va, std::size_t size, mem_handle, std::size_t offset);
  status unmap(std::uintptr_t va, std::size_t size);
  status set_access(std::uintptr_t va, std::size_t size, std::span<const access_desc>);
  result<shareable_handle> export_handle(mem_handle, ipc_kind);
  result<mem_handle> import_handle(const shareable_handle&);
  result<fence_t> record_fence(stream_t);
  bool fence_done(fence_t);
  status wait_fence(fence_t);
  void drop_fence(fence_t);
  result<memory_info> mem_info();
  bool can_access_peer(int device, int peer);
  result<capture_info> capture_of(stream_t);             // cuStreamGetCaptureInfo
  capture_mode exchange_capture_mode(capture_mode);      // cuThreadExchangeStreamCaptureMode

  // Device facts for tools (vmm-info): attribute by CUdevice_attribute number; -1 when unknown.
  int attribute(int cu_attribute, int device) const;
  int device_count() const;
  std::string device_name(int device) const;
  int driver_version() const;

 private:
  struct impl;
  std::unique_ptr<impl> p_;
};
static_assert(backend<cuda_backend>);
static_assert(backend_ipc<cuda_backend> && backend_fences<cuda_backend> && backend_peers<cuda_backend> &&
              backend_compression<cuda_backend> && backend_capture<cuda_backend>);

}  // namespace vmm
