// SPDX-License-Identifier: Apache-2.0
// vmmalloc adapters: a vmm::allocator behind the interfaces other libraries take. Header-only.
//
//   vmm::pmr_resource       std::pmr::memory_resource, host-accessible memory only      always
//   vmm::cuda_resource      cuda::mr stream-ordered resource, device_accessible         with CCCL
//   vmm::thrust_allocator   allocator for thrust::device_vector<T, vmm::thrust_allocator<T>>  with thrust
//
// Each adapter holds a pointer to a vmm::allocator it does not own (RMM's rule): the allocator
// must outlive the adapter and everything allocated through it. Equality is "same allocator" (and,
// for thrust_allocator, same stream). They add nothing to the allocator's costs: one call each.
//
// CCCL parts (cuda_resource, thrust_allocator) appear only where their headers are on the include
// path (nvcc always has them; a host compiler needs <cuda-toolkit>/include and, from CUDA 13,
// <cuda-toolkit>/include/cccl) and VMM_NO_CCCL is not defined. VMM_HAVE_CUDA_MR and
// VMM_HAVE_THRUST_ALLOCATOR say which are present. The file compiles in a TU without CCCL.
//
// cuda::mr: CCCL 3.1 renamed the interface; both forms are served, chosen by CCCL_VERSION:
//   CCCL 2.x - 3.0   allocate(bytes, align), deallocate(p, bytes, align)           synchronous
//                    allocate_async(bytes, align, stream), deallocate_async(p, bytes, align, stream)
//                    concept cuda::mr::async_resource_with<R, props...>
//   CCCL 3.1+        allocate_sync(bytes, align), deallocate_sync(p, bytes, align) synchronous
//                    allocate(stream, bytes, align), deallocate(stream, p, bytes, align)
//                    concept cuda::mr::resource_with<R, props...> (RMM's form too)
// VMM_CUDA_MR_STREAM_FIRST is 1 for the 3.1+ form, 0 for the older one. Before CCCL 3.2 that API
// (3.1: only resource_ref) is declared only when LIBCUDACXX_ENABLE_EXPERIMENTAL_MEMORY_RESOURCE is
// defined before <cuda/memory_resource> is first included; this header defines it there, so
// include it first (or define the macro for the whole build); otherwise it stops with #error.
#pragma once

#include <cstddef>
#include <memory_resource>
#include <string>
#include <type_traits>

#include "vmmalloc/vmmalloc.hpp"

#if !defined(VMM_NO_CCCL) && defined(__has_include)
#if __has_include(<cuda/memory_resource>) && __has_include(<cuda/stream_ref>) && \
    __has_include(<cuda_runtime_api.h>)
#if __has_include(<cuda/version>)
#include <cuda/version>  // CCCL_VERSION, and nothing of cuda::mr yet
#else
#include <cuda/std/version>
#endif
#if defined(CCCL_VERSION) && CCCL_VERSION >= 3001000
#define VMM_CUDA_MR_STREAM_FIRST 1
#else
#define VMM_CUDA_MR_STREAM_FIRST 0
#endif
#if !defined(CCCL_VERSION) || CCCL_VERSION < 3002000
#if !defined(LIBCUDACXX_ENABLE_EXPERIMENTAL_MEMORY_RESOURCE) && \
    (defined(_CUDA_MEMORY_RESOURCE) || defined(_CUDA__MEMORY_RESOURCE_RESOURCE_H))
#error "vmmalloc/adapters.hpp: <cuda/memory_resource> was included before it without LIBCUDACXX_ENABLE_EXPERIMENTAL_MEMORY_RESOURCE: include vmmalloc/adapters.hpp first, define the macro for the whole build, or define VMM_NO_CCCL"
#endif
#ifndef LIBCUDACXX_ENABLE_EXPERIMENTAL_MEMORY_RESOURCE
#define LIBCUDACXX_ENABLE_EXPERIMENTAL_MEMORY_RESOURCE
#endif
#endif
#include <cuda/memory_resource>
#include <cuda/stream_ref>
#define VMM_HAVE_CUDA_MR 1
#endif
#if __has_include(<thrust/device_malloc_allocator.h>)
#include <thrust/device_malloc_allocator.h>
#include <thrust/device_ptr.h>
#include <thrust/memory.h>
#define VMM_HAVE_THRUST_ALLOCATOR 1
#endif
#endif

namespace vmm {

// ---- std::pmr ----------------------------------------------------------------------------------

// std::pmr::memory_resource over host-accessible vmmalloc memory: an allocator on the host backend,
// or on the CUDA backend with options.location = host_numa (pinned host memory mapped through
// cuMemMap: the CPU and the GPUs granted access both reach it). Any other allocator serves device
// memory the CPU cannot touch: the constructor refuses it with vmm::error (invalid_value).
//   auto a = vmm::allocator::host();
//   vmm::pmr_resource r(a);
//   std::pmr::vector<int> v(&r);
// Zero-byte requests get a minimum block (pmr must return a pointer); alignment up to the
// granularity (2 MiB); failures throw vmm::out_of_memory (a std::bad_alloc) or vmm::error.
class pmr_resource final : public std::pmr::memory_resource {
 public:
  explicit pmr_resource(allocator& a) : a_(&a) {
    if (a.host_accessible()) return;
    throw error(status{errc::invalid_value, 0, "memory not host-accessible", "pmr_resource"},
                std::string("vmm::pmr_resource: the allocator (backend '") + a.backend_name() +
                    "', location device) serves device memory, which the CPU cannot access; use "
                    "the host backend or options.location = vmm::location_kind::host_numa");
  }
  allocator& upstream() const noexcept { return *a_; }

 private:
  void* do_allocate(std::size_t bytes, std::size_t alignment) override {
    return a_->allocate(bytes ? bytes : 1, alignment);
  }
  void do_deallocate(void* p, std::size_t, std::size_t) override { a_->deallocate(p); }
  bool do_is_equal(const std::pmr::memory_resource& o) const noexcept override {
    const auto* r = dynamic_cast<const pmr_resource*>(&o);
    return r && r->a_ == a_;
  }

  allocator* a_;
};

// ---- cuda::mr ----------------------------------------------------------------------------------

#ifdef VMM_HAVE_CUDA_MR
// A cuda::mr resource over a vmm::allocator, stream-ordered, in the form of the CCCL in use:
//   CCCL 3.1+                              CCCL 2.x - 3.0                           vmm::allocator
//   allocate_sync(bytes, align)            allocate(bytes, align)                   allocate(bytes, align) (null stream)
//   allocate(stream, bytes, align)         allocate_async(bytes, align, stream)     allocate(bytes, align, stream)
//   deallocate(stream, p, bytes, align)    deallocate_async(p, bytes, align, stream) deallocate(p, stream): reusable
//                                                                                   on that stream at once, on
//                                                                                   others after its work so far
// 0 bytes gives nullptr (deallocating nullptr is a no-op). Alignment: a power of two up to the
// granularity, default 256 (cudaMalloc's). Failures throw vmm::out_of_memory / vmm::error.
// Property: device_accessible. (On the host backend the "device" is simulated, and the memory is
// also host-accessible, which the type does not claim.)
class cuda_resource {
  static constexpr std::size_t default_alignment = ::cuda::mr::default_cuda_malloc_alignment;

 public:
  explicit cuda_resource(allocator& a) noexcept : a_(&a) {}

#if VMM_CUDA_MR_STREAM_FIRST
  void* allocate_sync(std::size_t bytes, std::size_t alignment = default_alignment) {
    return bytes ? a_->allocate(bytes, alignment) : nullptr;
  }
  void deallocate_sync(void* p, std::size_t /*bytes*/, std::size_t /*alignment*/ = default_alignment) {
    a_->deallocate(p);
  }
  void* allocate(::cuda::stream_ref s, std::size_t bytes, std::size_t alignment = default_alignment) {
    return bytes ? a_->allocate(bytes, alignment, static_cast<stream_t>(s.get())) : nullptr;
  }
  void deallocate(::cuda::stream_ref s, void* p, std::size_t /*bytes*/,
                  std::size_t /*alignment*/ = default_alignment) {
    a_->deallocate(p, static_cast<stream_t>(s.get()));
  }
#else
  void* allocate(std::size_t bytes, std::size_t alignment = default_alignment) {
    return bytes ? a_->allocate(bytes, alignment) : nullptr;
  }
  void deallocate(void* p, std::size_t /*bytes*/, std::size_t /*alignment*/ = default_alignment) {
    a_->deallocate(p);
  }
  void* allocate_async(std::size_t bytes, std::size_t alignment, ::cuda::stream_ref s) {
    return bytes ? a_->allocate(bytes, alignment, static_cast<stream_t>(s.get())) : nullptr;
  }
  void* allocate_async(std::size_t bytes, ::cuda::stream_ref s) {
    return allocate_async(bytes, default_alignment, s);
  }
  void deallocate_async(void* p, std::size_t /*bytes*/, std::size_t /*alignment*/,
                        ::cuda::stream_ref s) {
    a_->deallocate(p, static_cast<stream_t>(s.get()));
  }
  void deallocate_async(void* p, std::size_t bytes, ::cuda::stream_ref s) {
    deallocate_async(p, bytes, default_alignment, s);
  }
#endif

  allocator& upstream() const noexcept { return *a_; }
  friend bool operator==(const cuda_resource& x, const cuda_resource& y) noexcept { return x.a_ == y.a_; }
  friend bool operator!=(const cuda_resource& x, const cuda_resource& y) noexcept { return x.a_ != y.a_; }
  friend void get_property(const cuda_resource&, ::cuda::mr::device_accessible) noexcept {}

 private:
  allocator* a_;
};
#endif

// ---- thrust ------------------------------------------------------------------------------------

#ifdef VMM_HAVE_THRUST_ALLOCATOR
// thrust::device_vector<T, vmm::thrust_allocator<T>> v(n, vmm::thrust_allocator<T>(a));
// Also for temporary storage of algorithms: thrust::sort(thrust::cuda::par(
// vmm::thrust_allocator<char>(a)), ...). Allocations and frees are ordered on `stream` (default:
// the legacy default stream, where thrust runs unless told .on(stream)). A default-constructed
// allocator has no vmm::allocator: its allocate() throws vmm::error. deallocate() never throws
// (thrust calls it from destructors): a refused free leaves vmm::last_error() set.
template <class T>
class thrust_allocator : public thrust::device_malloc_allocator<T> {
  using base = thrust::device_malloc_allocator<T>;

 public:
  using value_type = T;
  using pointer = typename base::pointer;  // thrust::device_ptr<T>
  using size_type = typename base::size_type;
  using propagate_on_container_move_assignment = std::true_type;
  using propagate_on_container_swap = std::true_type;
  template <class U>
  struct rebind {
    using other = thrust_allocator<U>;
  };

  thrust_allocator() noexcept = default;
  explicit thrust_allocator(allocator& a, stream_t s = nullptr) noexcept : a_(&a), s_(s) {}
  template <class U>
  thrust_allocator(const thrust_allocator<U>& o) noexcept : a_(o.upstream_ptr()), s_(o.stream()) {}

  pointer allocate(size_type n) {
    if (!a_)
      throw error(status{errc::invalid_value, 0, "no allocator", "thrust_allocator"},
                  "vmm::thrust_allocator: default-constructed, no vmm::allocator to allocate from; "
                  "construct it as vmm::thrust_allocator<T>(allocator)");
    if (n == 0) return pointer(static_cast<T*>(nullptr));
    return thrust::device_pointer_cast(a_->template allocate_array<T>(n, s_));
  }
  void deallocate(pointer p, size_type) noexcept {
    if (a_) (void)a_->try_deallocate(thrust::raw_pointer_cast(p), s_);
  }

  allocator* upstream_ptr() const noexcept { return a_; }
  stream_t stream() const noexcept { return s_; }

 private:
  allocator* a_ = nullptr;
  stream_t s_ = nullptr;
};

template <class T, class U>
bool operator==(const thrust_allocator<T>& x, const thrust_allocator<U>& y) noexcept {
  return x.upstream_ptr() == y.upstream_ptr() && x.stream() == y.stream();
}
template <class T, class U>
bool operator!=(const thrust_allocator<T>& x, const thrust_allocator<U>& y) noexcept {
  return !(x == y);
}
#endif

}  // namespace vmm
