// vmmalloc: a growable GPU memory allocator on CUDA's virtual memory management API.
// The C++ front end. Layering (each includes only the one below):
//   vmmalloc.hpp (front end) -> heap.hpp -> arena.hpp -> backend.hpp
//
//   vmm::allocator a;                          // CUDA device 0, driver loaded at run time
//   void* p = a.allocate(1 << 20);             // throws vmm::out_of_memory / vmm::error
//   a.deallocate(p);
//   auto h = vmm::allocator::host();           // same semantics over host memory (no GPU)
#pragma once

#include <cstddef>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <system_error>

#include "vmmalloc/heap.hpp"
#include "vmmalloc/ipc.hpp"

namespace vmm {

const std::error_category& category() noexcept;
inline std::error_code make_error_code(errc e) noexcept { return {static_cast<int>(e), category()}; }

// A failure with the driver's code and name: "cuMemMap: CUDA_ERROR_INVALID_VALUE (1)".
class error : public std::system_error {
 public:
  error(const status& s, const std::string& what);
  const char* what() const noexcept override { return what_.c_str(); }  // no category suffix
  const status& st() const noexcept { return st_; }

 private:
  status st_;
  std::string what_;
};

// Out of memory (physical, policy limit, or reservation). Catchable as std::bad_alloc.
class out_of_memory : public std::bad_alloc {
 public:
  out_of_memory(const status& s, std::string what) : st_(s), what_(std::move(what)) {}
  const char* what() const noexcept override { return what_.c_str(); }
  const status& st() const noexcept { return st_; }

 private:
  status st_;
  std::string what_;
};

// Throws the right exception for a failed status (out_of_memory for errc::out_of_memory).
[[noreturn]] void throw_status(const status& s, const std::string& context);

// The last error on this thread (try_* calls and the C API set it).
struct last_error_info {
  status st;
  std::string message;
};
const last_error_info& last_error() noexcept;

// Current values are exact. Peaks of requested/allocated are exact with options.thread_cache off;
// with thread caches they are sampled on the slow path and may miss up to the bytes the caches
// hold. Peaks of mapped/physical (the memory figures) are always exact.
struct allocator_stats {
  // bytes: current and peak
  std::size_t requested = 0, allocated = 0, mapped = 0, physical = 0, reserved = 0;
  std::size_t peak_requested = 0, peak_allocated = 0, peak_mapped = 0, peak_physical = 0;
  std::size_t chunks = 0, idle = 0, free_chunk_bytes = 0, slab_bytes = 0;
  std::uint64_t allocs = 0, frees = 0, live = 0, deferred = 0;
  std::uint64_t grows = 0, chunk_releases = 0, trims = 0, stitched = 0, compression_fallbacks = 0;
  std::size_t compressed = 0;           // mapped bytes the driver granted compression for
  std::uint64_t ipc_fallbacks = 0;      // fabric asked for, POSIX fds used
  std::uint64_t access_changes = 0;     // grant/revoke calls that changed the access table
  std::uint64_t exported = 0;           // export_ipc calls that succeeded
  std::uint64_t exported_released = 0;  // exported allocations freed (chunks released, never reused)
  std::uint64_t traced_events = 0;      // events written by trace recording (options.trace_path)
  // 1 - requested / mapped: the share of mapped memory not holding requested bytes (0 when
  // nothing is mapped). Rounding, free blocks in spans, slabs' free slots and cached chunks.
  double fragmentation = 0;
  driver_counts calls;                  // calls.map / calls.unmap: chunk maps and unmaps
};

class allocator {
 public:
  // CUDA backend on options.device. Throws vmm::error ("no CUDA driver ...") when unavailable.
  explicit allocator(const options& o = {});
  // Any backend (host, fault injection, ...). Throws vmm::error if the arena cannot open.
  allocator(std::unique_ptr<backend_iface> b, const options& o);
  ~allocator();
  allocator(allocator&&) noexcept;
  allocator& operator=(allocator&&) noexcept;

  // A host-backend allocator: real host memory, GPU semantics, 2 MiB granularity by default.
  static allocator host(const options& o = {}, const host_backend_options& h = {});

  // alignment 0 = options.alignment (256). Throws out_of_memory or error; never returns null.
  void* allocate(std::size_t bytes, std::size_t alignment = 0, stream_t s = nullptr);
  // nullptr on failure, with last_error() set. Never throws.
  void* try_allocate(std::size_t bytes, std::size_t alignment = 0, stream_t s = nullptr) noexcept;
  // count objects of T (uninitialised device memory), aligned to max(alignof(T), 256).
  // count * sizeof(T) overflowing size_t is out_of_memory, not a short allocation.
  template <class T>
  T* allocate_array(std::size_t count, stream_t s = nullptr) {
    std::size_t bytes;
    if (__builtin_mul_overflow(count, sizeof(T), &bytes))
      throw_status({errc::out_of_memory, 0, "count * sizeof(T) overflows", "allocate_array"},
                   "vmm::allocator::allocate_array");
    return static_cast<T*>(allocate(bytes, alignof(T) > 256 ? alignof(T) : 0, s));
  }
  // nullptr is a no-op. Throws vmm::error (errc::invalid_pointer) for foreign, interior or freed
  // pointers; the allocator's state is untouched.
  void deallocate(void* p, stream_t s = nullptr);
  status try_deallocate(void* p, stream_t s = nullptr) noexcept;
  // p is also used on s: its memory is reused only after s's work up to the free completes.
  void record_stream(void* p, stream_t s);
  std::size_t usable_size(const void* p) const;

  // ---- policies (see README "Policies") ----
  // Gives `device` access to every mapped chunk and every future one: one cuMemSetAccess per
  // contiguous mapped run. Throws vmm::error for the owner device, a device that cannot access
  // the owner, or a driver failure (then nothing changed).
  void grant(int device, access_mode mode = access_mode::read_write);
  void revoke(int device);             // access_mode::none for that device, same rules
  std::vector<access_desc> access() const;  // owner first, then peers

  // IPC (options.ipc = posix_fd or fabric): the live allocation starting at p as a handle another
  // process imports (vmm::ipc::import). Every allocation of an ipc policy owns whole chunks, so
  // the handle shares nothing else; once exported, freeing p releases its chunks (they are never
  // reused while an importer may map them). Throws vmm::error; try_ form returns the status.
  ipc::export_handle export_ipc(void* p);
  status try_export_ipc(void* p, ipc::export_handle& out) noexcept;

  // Releases empty slabs, free chunks and idle physical memory down to `keep` bytes kept.
  void trim(std::size_t keep = 0);
  allocator_stats stats() const;  // counters only: a lock and a copy, cheap enough to leave on
  // Per size class: slab count, slots, used slots, live bytes (walks the page map: diagnostics).
  std::vector<class_occupancy> class_stats() const;
  void reset_peaks();
  // Writes buffered trace events to options.trace_path now (also done when the buffer fills and
  // when the allocator is destroyed).
  void flush_trace();
  // Walks all metadata and verifies every invariant. "" when all hold, else what is wrong.
  std::string check() const;

  std::size_t granularity() const;
  const options& opts() const;
  backend_iface& backend();
  // The concrete backend, e.g. backend_as<host_backend>() for its test controls; null if other.
  template <vmm::backend B>
  B* backend_as() {
    auto* m = dynamic_cast<backend_model<B>*>(&backend());
    return m ? &m->get() : nullptr;
  }

  struct impl;  // opaque; public only so the implementation's thread caches can name it

 private:
  std::unique_ptr<impl> p_;
};


}  // namespace vmm

template <>
struct std::is_error_code_enum<vmm::errc> : std::true_type {};
