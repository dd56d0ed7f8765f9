// SPDX-License-Identifier: Apache-2.0
// vmm::device_vector<T>: a vector of trivially copyable T on a vmm::growable_buffer. data() never
// changes for the vector's life: growing maps memory at the tail of its own reservation, nothing
// is copied or moved, so pointers held by kernels stay valid across resize().
//
//   auto v = vmm::device_vector<float>::cuda(1ull << 30);  // up to 2^30 floats: 4 GiB of VA, 0 mapped
//   v.resize(1 << 20);                  // maps 4 MiB (one driver round); contents NOT initialised
//   my_kernel<<<g, b>>>(v.data(), v.size());
//   v.resize(4 << 20);                  // data() unchanged, the first 2^20 floats kept
//   float s = thrust::reduce(thrust::device_pointer_cast(v.data()),
//                            thrust::device_pointer_cast(v.data()) + v.size());
//   v.push_back(1.0f);                  // one host->device copy (see "Copies")
//
// Contract (growable_buffer.hpp states the memory rules; this adds the element view):
//  * size() elements of T at data(); capacity() = mapped bytes / sizeof(T); max_size() = the
//    capacity limit given at construction (the reservation), in elements. Asking for more than
//    max_size() throws vmm::out_of_memory and changes nothing; so does n * sizeof(T) overflowing.
//  * Growth (resize up, reserve, push_back, append) is all-or-nothing: on any exception size(),
//    data() and every element are unchanged, and so is capacity() when mapping failed. When the
//    copier fails after the mapping, the memory mapped for it stays (shrink_to_fit() returns it).
//  * New elements are NOT initialised by resize(n) (like cuMemCreate's memory); resize(n, value)
//    fills them (through the copier, in 1 MiB host blocks: one copy per MiB).
//  * Shrinking returns memory: resize(n < size()) and clear() unmap and release, right away, every
//    chunk lying wholly past round_up(n * sizeof(T), G) (G = granularity, 2 MiB on H100/H200). A
//    chunk straddling the new end stays mapped. Memory mapped ahead by reserve() stays until
//    shrink_to_fit() or a shrink. Shrinking while GPU work still reads the tail is the caller's
//    bug: synchronize first.
//  * Not thread-safe (like std::vector); movable, not copyable (a copy is a device copy: do it
//    explicitly).
//
// Copies. The library does not link cudart, so the vector never calls CUDA by itself:
//  * Host-accessible memory (the host backend) is copied with memcpy, and also reachable through
//    operator[], at() and host_span(). On device memory those throw vmm::error (not_permitted).
//  * Device memory is copied by a copy_fn: the one given at construction, else the process
//    default, default_device_copy(). Every translation unit that includes this header with cudart
//    available installs cudaMemcpy(cudaMemcpyDefault) as that default before main(): "available"
//    means compiled by nvcc, or <cuda_runtime_api.h> included before this header, or
//    VMM_WITH_CUDART=1 defined (the TU then links cudart). Otherwise copies on device memory
//    throw vmm::error (not_supported) naming the three ways to get one, or set_default_device_copy().
//    The copy_fn must be synchronous: when it returns, the bytes have landed.
//  * push_back costs one copy (~10 us through cudaMemcpy): batch host data with append().
//
// Kernels and thrust take the raw pointer: kernel<<<...>>>(v.data(), v.size()), and
// thrust::device_pointer_cast(v.data()) for thrust algorithms (a raw T* would make thrust run on
// the host). There are deliberately no begin()/end() for that reason.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstring>
#include <limits>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "vmmalloc/growable_buffer.hpp"

#if defined(__CUDACC__) || defined(CUDART_VERSION) || (defined(VMM_WITH_CUDART) && VMM_WITH_CUDART)
#define VMM_DEVICE_VECTOR_CUDART 1
#include <cuda_runtime_api.h>
#endif

namespace vmm {

// Copies `bytes` between host memory and a vector's memory, either direction, synchronously.
// Throws on failure (vmm::error preferred).
using copy_fn = void (*)(void* dst, const void* src, std::size_t bytes);

namespace detail {

inline std::atomic<copy_fn>& default_copy_slot() noexcept {
  static std::atomic<copy_fn> slot{nullptr};
  return slot;
}

// Whether the CPU can read and write memory mapped by `b` for owner `device`: the host backend's
// CPU protection follows simulated device 0 (backend.hpp), so device 0 must have read_write.
inline bool cpu_can_access(backend_iface& b, int device, const std::vector<access_desc>& peers) {
  if (!(b.capabilities() & cap_host_access)) return false;
  if (device == 0) return true;
  for (const auto& p : peers)
    if (p.device == 0 && p.mode == access_mode::read_write) return true;
  return false;
}

[[noreturn]] inline void throw_errc(errc k, const char* op, const char* name, const std::string& what) {
  throw error(status{k, 0, name, op}, what);
}

}  // namespace detail

inline void set_default_device_copy(copy_fn f) noexcept { detail::default_copy_slot().store(f); }
inline copy_fn default_device_copy() noexcept { return detail::default_copy_slot().load(); }

#ifdef VMM_DEVICE_VECTOR_CUDART
// cudaMemcpy with cudaMemcpyDefault (unified addressing infers the direction). Synchronous for the
// host; throws vmm::error carrying cudart's error code and name.
inline void cudart_copy(void* dst, const void* src, std::size_t bytes) {
  const cudaError_t e = cudaMemcpy(dst, src, bytes, cudaMemcpyDefault);
  if (e != cudaSuccess)
    throw error(status{errc::other, static_cast<int>(e), cudaGetErrorName(e), "cudaMemcpy"},
                std::string("vmm::device_vector: cudaMemcpy of ") + std::to_string(bytes) +
                    " bytes failed: " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
}
namespace detail {
inline bool install_cudart_copy() noexcept {
  copy_fn expected = nullptr;  // keep a copier the program already chose
  default_copy_slot().compare_exchange_strong(expected, &cudart_copy);
  return true;
}
// Installed before main() by every TU that sees cudart. Internal linkage on purpose: an unused
// inline variable would not be emitted, and with it the installation would silently vanish.
[[maybe_unused]] static const bool cudart_copy_installed = install_cudart_copy();
}  // namespace detail
#endif

template <class T>
class device_vector {
  static_assert(std::is_trivially_copyable_v<T>,
                "vmm::device_vector<T>: T must be trivially copyable (elements are moved as bytes "
                "between host and device, never constructed or destroyed)");

 public:
  using value_type = T;
  using size_type = std::size_t;
  using pointer = T*;
  using const_pointer = const T*;

  // Takes an empty buffer (any backend; size() != 0 is vmm::error). copy = nullptr: memcpy where
  // the CPU can reach the memory, else default_device_copy() at the time of each copy.
  explicit device_vector(growable_buffer buf, copy_fn copy = nullptr)
      : buf_(std::move(buf)), copy_(copy) {
    if (!buf_.data())
      detail::throw_errc(errc::invalid_value, "device_vector", "moved-from buffer",
                         "vmm::device_vector: the buffer is moved-from");
    if (buf_.size() != 0)
      detail::throw_errc(errc::invalid_value, "device_vector", "buffer not empty",
                         "vmm::device_vector: the buffer must be empty (size() == 0)");
    if (buf_.granularity() % alignof(T) != 0)
      detail::throw_errc(errc::invalid_value, "device_vector", "alignment",
                         "vmm::device_vector: alignof(T) does not divide the granularity");
    host_ = detail::cpu_can_access(buf_.backend(), buf_.opts().device, buf_.opts().peers);
  }

  // Host backend (CI, no GPU): memcpy copies, operator[] works.
  static device_vector host(size_type max_elements, const host_backend_options& h = {},
                            const growable_options& o = {}) {
    return device_vector(growable_buffer::host(bytes_of(max_elements, "host"), h, o));
  }
  // CUDA device memory on `device`. Throws vmm::error "no CUDA driver ..." without one.
  static device_vector cuda(size_type max_elements, int device = 0, growable_options o = {},
                            copy_fn copy = nullptr) {
    return device_vector(growable_buffer::cuda(bytes_of(max_elements, "cuda"), device, std::move(o)),
                         copy);
  }

  device_vector(device_vector&&) noexcept = default;
  device_vector& operator=(device_vector&&) noexcept = default;
  device_vector(const device_vector&) = delete;
  device_vector& operator=(const device_vector&) = delete;

  T* data() noexcept { return static_cast<T*>(buf_.data()); }
  const T* data() const noexcept { return static_cast<const T*>(buf_.data()); }
  size_type size() const noexcept { return buf_.size() / sizeof(T); }
  bool empty() const noexcept { return buf_.size() == 0; }
  size_type capacity() const noexcept { return buf_.capacity() / sizeof(T); }   // mapped
  size_type max_size() const noexcept { return buf_.capacity_limit() / sizeof(T); }
  bool host_accessible() const noexcept { return host_; }
  // The buffer underneath: chunk_count(), counts(), granularity().
  const growable_buffer& buffer() const noexcept { return buf_; }

  // Maps memory for n elements without changing size(); never unmaps.
  void reserve(size_type n) { buf_.reserve(bytes_of(n, "reserve")); }

  // Sets size() to n. Growth maps at the tail (new elements uninitialised); shrinking returns
  // the chunks wholly past the new end (see the contract).
  void resize(size_type n) { buf_.resize(bytes_of(n, "resize")); }

  // Like resize(n), and the new elements [old size, n) are set to value.
  void resize(size_type n, const T& value) {
    const size_type old = size();
    if (n <= old) return resize(n);
    reserve(n);                 // all-or-nothing; the fill below writes past size() first
    fill_range(old, n, value);  // throws: size() is still old
    resize(n);                  // within capacity: only sets the size
  }

  // Appends one element from the host: one copy (batch with append()).
  void push_back(const T& value) { append(&value, 1); }

  // Appends n elements from host memory with one copy.
  void append(const T* src, size_type n) {
    if (n == 0) return;
    const size_type old = size();
    if (n > max_size() - old) too_many(old, n, "append");
    reserve(old + n);
    copy_bytes(data() + old, src, n * sizeof(T));  // past size(): a failure changes nothing
    resize(old + n);
  }

  // Returns all memory (size 0, every chunk unmapped and released).
  void clear() { resize(0); }
  // Returns the chunks wholly past the end (memory mapped ahead by reserve()).
  void shrink_to_fit() { buf_.shrink_to_fit(); }

  // ---- copies (any memory) ----
  // Elements [first, first + n) to / from host memory, through the copier. Out of range:
  // std::out_of_range, nothing copied.
  void copy_to_host(T* dst, size_type n, size_type first = 0) const {
    check_range(first, n, "copy_to_host");
    if (n) copy_bytes(dst, data() + first, n * sizeof(T));
  }
  void copy_from_host(const T* src, size_type n, size_type first = 0) {
    check_range(first, n, "copy_from_host");
    if (n) copy_bytes(data() + first, src, n * sizeof(T));
  }
  std::vector<T> to_host() const {
    std::vector<T> out(size());
    copy_to_host(out.data(), out.size());
    return out;
  }
  T get(size_type i) const {
    T v;
    copy_to_host(&v, 1, i);
    return v;
  }
  void set(size_type i, const T& v) { copy_from_host(&v, 1, i); }

  // ---- direct host access (host-accessible memory only) ----
  // operator[] checks nothing (like std::vector); at() checks the index and the memory.
  T& operator[](size_type i) noexcept { return data()[i]; }
  const T& operator[](size_type i) const noexcept { return data()[i]; }
  T& at(size_type i) {
    require_host("at");
    check_range(i, 1, "at");
    return data()[i];
  }
  const T& at(size_type i) const {
    require_host("at");
    check_range(i, 1, "at");
    return data()[i];
  }
  std::span<T> host_span() {
    require_host("host_span");
    return {data(), size()};
  }
  std::span<const T> host_span() const {
    require_host("host_span");
    return {data(), size()};
  }

 private:
  static std::size_t bytes_of(size_type n, const char* what) {
    if (n > std::numeric_limits<std::size_t>::max() / sizeof(T))
      throw out_of_memory(status{errc::out_of_memory, 0, "n * sizeof(T) overflows", "device_vector"},
                          std::string("vmm::device_vector::") + what + ": " + std::to_string(n) +
                              " elements of " + std::to_string(sizeof(T)) +
                              " bytes overflow size_t");
    return n * sizeof(T);
  }
  [[noreturn]] void too_many(size_type old, size_type n, const char* what) const {
    throw out_of_memory(status{errc::out_of_memory, 0, "capacity limit exceeded", "device_vector"},
                        std::string("vmm::device_vector::") + what + ": " + std::to_string(old) +
                            " + " + std::to_string(n) + " elements exceed max_size() " +
                            std::to_string(max_size()));
  }
  void check_range(size_type first, size_type n, const char* what) const {
    if (first > size() || n > size() - first)
      throw std::out_of_range(std::string("vmm::device_vector::") + what + ": elements [" +
                              std::to_string(first) + ", " + std::to_string(first) + " + " +
                              std::to_string(n) + ") out of range (size " + std::to_string(size()) + ")");
  }
  void require_host(const char* what) const {
    if (!host_)
      detail::throw_errc(errc::not_permitted, "device_vector", "not host-accessible",
                         std::string("vmm::device_vector::") + what +
                             ": the memory is device memory, not host-accessible; use "
                             "copy_to_host / copy_from_host / get / set");
  }
  void copy_bytes(void* dst, const void* src, std::size_t n) const {
    if (host_) {
      std::memcpy(dst, src, n);
      return;
    }
    copy_fn f = copy_ ? copy_ : default_device_copy();
    if (!f)
      detail::throw_errc(errc::not_supported, "device_vector", "no copier",
                         "vmm::device_vector: copying device memory needs a copier: compile this "
                         "file with nvcc, include <cuda_runtime_api.h> before "
                         "vmmalloc/device_vector.hpp, define VMM_WITH_CUDART=1, pass a copy_fn, "
                         "or call vmm::set_default_device_copy()");
    f(dst, src, n);
  }
  void fill_range(size_type first, size_type last, const T& value) {
    // A staging block of copies of value: one copy per MiB, whatever the copier costs per call.
    const size_type per = std::max<size_type>(1, (std::size_t{1} << 20) / sizeof(T));
    std::vector<T> block(std::min(per, last - first), value);
    for (size_type i = first; i < last; i += block.size()) {
      const size_type k = std::min(block.size(), last - i);
      copy_bytes(data() + i, block.data(), k * sizeof(T));
    }
  }

  growable_buffer buf_;
  copy_fn copy_ = nullptr;
  bool host_ = false;
};

}  // namespace vmm
