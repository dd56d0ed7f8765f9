// vm::driver: the backend with every call counted, in one place. Everything above the backend
// (arena, heap fences, growable_buffer, kv_cache, IPC import) calls the driver through this.
//
// Counting costs one relaxed atomic add per call (a few ns next to the driver's 1-600 us); the
// counters are atomic because kv_cache's map-ahead thread calls the driver without a lock.
// A `scope` counts the calls one thread makes while it lives (kv_cache splits its driver calls
// by path: append vs map-ahead).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <span>

#include "vmmalloc/backend.hpp"
#include "vmmalloc/stats.hpp"

namespace vmm::vm {

class driver {
 public:
  explicit driver(backend_iface* b) noexcept : b_(b) {}  // b must be set before any call
  driver(const driver&) = delete;
  driver& operator=(const driver&) = delete;

  backend_iface& backend() noexcept { return *b_; }
  const char* name() { return b_->name(); }
  unsigned capabilities() { return b_->capabilities(); }

  result<granularity_info> granularity(const chunk_props& p) { return note(n_.granularity, b_->granularity(p)); }
  result<std::uintptr_t> reserve(std::size_t n, std::size_t align) { return note(n_.reserve, b_->reserve(n, align)); }
  status free_reservation(std::uintptr_t va, std::size_t n) { return note(n_.free_reservation, b_->free_reservation(va, n)); }
  result<mem_handle> create(std::size_t n, const chunk_props& p) { return note(n_.create, b_->create(n, p)); }
  status release(mem_handle h) { return note(n_.release, b_->release(h)); }
  status map(std::uintptr_t va, std::size_t n, mem_handle h, std::size_t off) { return note(n_.map, b_->map(va, n, h, off)); }
  status unmap(std::uintptr_t va, std::size_t n) { return note(n_.unmap, b_->unmap(va, n)); }
  status set_access(std::uintptr_t va, std::size_t n, std::span<const access_desc> a) {
    return note(n_.set_access, b_->set_access(va, n, a));
  }
  result<memory_info> mem_info() { return note(n_.mem_info, b_->mem_info()); }
  result<shareable_handle> export_handle(mem_handle h, ipc_kind k) { return note(n_.export_handle, b_->export_handle(h, k)); }
  result<mem_handle> import_handle(const shareable_handle& s) { return note(n_.import_handle, b_->import_handle(s)); }
  result<chunk_info> query(mem_handle h) { return note(n_.query, b_->query(h)); }
  result<fence_t> record_fence(stream_t s) { return note(n_.record_fence, b_->record_fence(s)); }
  bool fence_done(fence_t f) {
    bump(n_.fence_query);
    return b_->fence_done(f);
  }
  status wait_fence(fence_t f) { return note(n_.wait_fence, b_->wait_fence(f)); }
  void drop_fence(fence_t f) { b_->drop_fence(f); }  // frees an event: not a driver round trip we count
  bool can_access_peer(int device, int peer) { return b_->can_access_peer(device, peer); }

  // Teardown and rollback cannot leave memory behind on one refusal: the call is made once more.
  template <class F>
  static status twice(F&& f) {
    status s = f();
    return s.ok() ? s : f();
  }

  driver_counts counts() const;

  // Counts the calls this thread makes through any driver while the scope lives.
  class scope {
   public:
    explicit scope(std::uint64_t& calls, std::uint64_t& failures) noexcept;
    ~scope();
    scope(const scope&) = delete;
    scope& operator=(const scope&) = delete;

   private:
    friend class driver;
    std::uint64_t& calls_;
    std::uint64_t& failures_;
    scope* outer_;
  };

 private:
  struct counters {
    std::atomic<std::uint64_t> reserve{0}, free_reservation{0}, create{0}, release{0}, map{0}, unmap{0},
        set_access{0}, export_handle{0}, import_handle{0}, granularity{0}, query{0}, mem_info{0},
        record_fence{0}, fence_query{0}, wait_fence{0}, failures{0};
  };
  void bump(std::atomic<std::uint64_t>& c) noexcept;
  void failed() noexcept;
  status note(std::atomic<std::uint64_t>& c, status s) {
    bump(c);
    if (!s.ok()) failed();
    return s;
  }
  template <class T>
  result<T> note(std::atomic<std::uint64_t>& c, result<T> r) {
    bump(c);
    if (!r.ok()) failed();
    return r;
  }

  backend_iface* b_;
  counters n_;
};

}  // namespace vmm::vm
