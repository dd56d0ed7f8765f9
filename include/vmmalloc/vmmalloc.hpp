// SPDX-License-Identifier: Apache-2.0
// vmmalloc: a growable GPU memory allocator on CUDA's virtual memory management API.
// The C++ front end.
//
//   vmm::allocator a;                          // CUDA device 0, driver loaded at run time
//   void* p = a.allocate(1 << 20);             // throws vmm::out_of_memory / vmm::error
//   a.deallocate(p);
//   auto h = vmm::allocator::host();           // same semantics over host memory (no GPU)
//
// Pulls in only what the allocator's signatures need: errors, options, stats, and the host
// backend's options. export_ipc's handle type is in <vmmalloc/ipc.hpp>; a custom backend is
// written against <vmmalloc/backend.hpp>.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "vmmalloc/backend.hpp"
#include "vmmalloc/error.hpp"
#include "vmmalloc/host_backend.hpp"
#include "vmmalloc/options.hpp"
#include "vmmalloc/stats.hpp"

namespace vmm {

namespace ipc {
struct export_handle;  // <vmmalloc/ipc.hpp>
}
struct tuning;  // the allocator's own sizes and thresholds (internal)

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

  // ---- policies (docs/policies.md) ----
  // Gives `device` access to every mapped chunk and every future one: one cuMemSetAccess per
  // contiguous mapped run. Throws vmm::error for the owner device, a device that cannot access
  // the owner, or a driver failure (then nothing changed).
  void grant(int device, access_mode mode = access_mode::read_write);
  void revoke(int device);             // access_mode::none for that device, same rules
  std::vector<access_desc> access() const;  // owner first, then peers

  // IPC (options.ipc = posix_fd or fabric): the live allocation starting at p as a handle another
  // process imports (vmm::ipc::import). Every allocation of an ipc policy owns whole chunks, so
  // the handle shares nothing else; once exported, freeing p releases its chunks (they are never
  // reused while an importer may map them). In libvmmalloc_torch (PyTorch), allocations share
  // chunks: the handle carries the chunks under p (neighbours' bytes too; offset says where p
  // starts), and they are reused as usual once p is freed, so the importer must be done by then.
  // Throws vmm::error; try_ form returns the status.
  ipc::export_handle export_ipc(void* p);
  status try_export_ipc(void* p, ipc::export_handle& out) noexcept;

  // ---- graph pools (CUDA graphs: PyTorch's private pools) ----
  // Between begin_pool(id, filter) and end_pool(id), allocations on the streams `filter` accepts
  // (all, when it is empty) come from pool `id` (made at its first begin); its memory goes to no
  // other work until release_pool(id), so replays of the captured graph find their addresses as
  // they were. A block of the pool freed during the capture is reusable by later allocations of
  // that capture only; freed after, it returns to the pool. Several captures may share a pool
  // (begin it again), several pools may be begun at once. While any pool is begun, thread caches
  // are bypassed. Allocation and free never invalidate a capture: no event is recorded or queried
  // on a capturing stream, and the driver's calls run with the thread in relaxed capture mode.
  using pool_id = std::uint64_t;
  void begin_pool(pool_id id, std::function<bool(stream_t)> filter = {});
  // Throws vmm::error for a pool that is not begun.
  void end_pool(pool_id id);
  // The pool's free memory goes back now, the rest as its blocks are freed. Throws vmm::error for
  // an unknown pool or one still begun.
  void release_pool(pool_id id);
  // A pool's state, for integrations that answer questions about it (PyTorch's
  // checkPoolLiveAllocations): false when no such pool is alive (never begun, or dropped after
  // its release once its last block went).
  struct pool_info {
    std::uint64_t live = 0;      // live blocks
    std::size_t allocated = 0;   // their bytes (rounded)
    std::size_t held = 0;        // mapped bytes the pool owns
    int begun = 0;               // captures allocating to it now
    bool released = false;
  };
  bool pool_stats(pool_id id, pool_info& out) const;
  // Whether p is the start of a live block of a graph pool; `id` gets the pool. Takes the lock.
  bool pool_of(const void* p, pool_id& id) const;
  // Whether p lies in this allocator's reserved address range, where every block it hands out
  // lies (so: which of several allocators a pointer may belong to). No lock, no driver call.
  bool owns(const void* p) const noexcept;

  // Releases empty slabs, free chunks and idle physical memory down to `keep` bytes kept.
  void trim(std::size_t keep = 0);
  // The cap on physical bytes (mapped + idle handles), options.memory_limit until changed here;
  // SIZE_MAX = none. Safe from any thread. Lowered below what is held, free chunks and idle
  // handles are released until it fits (live blocks stay; allocations needing new memory fail as
  // out of memory until enough is freed). growable_buffer::shared over this allocator counts
  // against it too. opts() keeps the value given at construction. The limit is set even when
  // that release is refused, which throws vmm::error as trim() does.
  void set_memory_limit(std::size_t bytes);
  std::size_t memory_limit() const noexcept;
  allocator_stats stats() const;  // counters only: a lock and a copy, cheap enough to leave on
  // Per size class: slab count, slots, used slots, live bytes (walks the page map: diagnostics).
  std::vector<class_occupancy> class_stats() const;
  // Free span memory of the allocator's heap (graph pools not included). Walks the free lists
  // under the lock: microseconds per hundred free blocks, for diagnostics (vmm-replay --samples).
  span_free_stats span_free() const;
  // Every segment of mapped memory with its blocks and their states (live, free, thread-cached,
  // waiting for a stream), graph pools' included, in address order; block sizes are what each
  // covers (a slab's slot for small sizes). Walks every block under the lock: milliseconds for
  // a large heap, other threads' allocations wait (PyTorch's torch.cuda.memory_snapshot()).
  std::vector<segment_info> memory_map() const;
  void reset_peaks();
  // Writes buffered trace events to options.trace_path now (also done when the buffer fills and
  // when the allocator is destroyed).
  void flush_trace();
  // Walks all metadata and verifies every invariant. "" when all hold, else what is wrong.
  std::string check() const;

  std::size_t granularity() const;
  const options& opts() const;
  const char* backend_name() const;  // "cuda", "host", or a custom backend's name
  // Whether the CPU can read and write this allocator's memory: pinned host memory (host_numa),
  // or a backend with host access whose CPU protection follows device 0 with read_write.
  bool host_accessible() const;

 private:
  struct impl;  // src/frontend/allocator_impl.hpp: heap, arena, thread caches, trace
  friend struct allocator_access;
  // The allocator's own choices other than the defaults (src/arena/tuning.hpp): tests and tools.
  allocator(std::unique_ptr<backend_iface> b, const options& o, const tuning& t);
  std::unique_ptr<impl> p_;
};

}  // namespace vmm

struct vmm_allocator;  // the C API's handle (vmmalloc.h)

namespace vmm {
// The C++ allocator behind a live C API handle (not NULL): C code creates it, C++ code may use
// all of it (opts(), access(), export_ipc ...). Owned by the handle: vmm_destroy ends it.
allocator& from_c(vmm_allocator* a) noexcept;
}  // namespace vmm
