// SPDX-License-Identifier: Apache-2.0
// vm::driver: the backend with every call counted, in one place. Everything above the backend
// (arena, heap fences, growable_buffer, kv_cache, IPC import) calls the driver through this.
//
// Counting costs one relaxed atomic add per call and two steady-clock reads (~50 ns next to the
// driver's 1-600 us); the counters are atomic because kv_cache's map-ahead thread calls the
// driver without a lock.
// A `scope` counts the calls one thread makes while it lives (kv_cache splits its driver calls
// by path: append vs map-ahead).
//
// One call at a time per handle and VA range. The CUDA driver corrupts its own state when two
// threads call it at once on one handle (a double free inside cuMemUnmap on an H200: one thread
// unmapped a range of a handle while another mapped that handle elsewhere or released it), and
// the layers above hand handles from thread to thread (a growth runs outside the allocator's
// lock). So a call that touches existing VA or handles (map, unmap, set_access, release, export,
// free_reservation) first claims them: it waits while a call in flight on this driver holds one
// of its handles or overlaps its VA, and gives them back when the driver returns. Unrelated calls
// run side by side. The driver keeps which handle each range it mapped holds, so an unmap or a
// set_access claims the handles under its VA too. Cost: a short mutex and a map update per call,
// next to the driver's 1-600 us. create, import and reserve make new objects: no claim.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <condition_variable>
#include <list>
#include <map>
#include <mutex>
#include <span>
#include <unordered_map>
#include <vector>

#include "vmmalloc/backend.hpp"
#include "vmmalloc/stats.hpp"

namespace vmm::vm {

class driver {
 public:
  explicit driver(backend_iface* b) noexcept : b_(b), capture_(b && (b->capabilities() & cap_capture)) {}
  driver(const driver&) = delete;
  driver& operator=(const driver&) = delete;

  backend_iface& backend() noexcept { return *b_; }
  const char* name() { return b_->name(); }
  unsigned capabilities() { return b_->capabilities(); }

  result<granularity_info> granularity(const chunk_props& p) { return note(n_.granularity, b_->granularity(p)); }
  result<std::uintptr_t> reserve(std::size_t n, std::size_t align) { relaxed r(*this, n_.ns); return note(n_.reserve, b_->reserve(n, align)); }
  status free_reservation(std::uintptr_t va, std::size_t n);
  result<mem_handle> create(std::size_t n, const chunk_props& p) { relaxed r(*this, n_.ns); return note(n_.create, b_->create(n, p)); }
  // Closes the handle's exported fd (see export_handle) once the release succeeded.
  status release(mem_handle h);
  status map(std::uintptr_t va, std::size_t n, mem_handle h, std::size_t off);
  status unmap(std::uintptr_t va, std::size_t n);
  status set_access(std::uintptr_t va, std::size_t n, std::span<const access_desc> a);
  result<memory_info> mem_info() { relaxed r(*this, n_.ns); return note(n_.mem_info, b_->mem_info()); }
  // A handle is exported as a POSIX fd once (cuMemExportToShareableHandle took ~50 us on an
  // H200); later exports of it get a dup of that fd (~1 us, not counted as a
  // driver call), and release() closes it. Blocks that share a chunk (tuning::ipc_whole_chunks off) are
  // shared with one export of it. Every copy carries the export's id (shareable_handle::export_id).
  // Fabric handles are bytes: exported each time.
  result<shareable_handle> export_handle(mem_handle h, ipc_kind k);
  result<mem_handle> import_handle(const shareable_handle& s) { relaxed r(*this, n_.ns); return note(n_.import_handle, b_->import_handle(s)); }
  result<chunk_info> query(mem_handle h) { relaxed r(*this, n_.ns); return note(n_.query, b_->query(h)); }
  // Never on a capturing stream (an event recorded into a capture is no fence): callers check.
  result<fence_t> record_fence(stream_t s) {
    timed t(n_.fence_ns);
    return note(n_.record_fence, b_->record_fence(s));
  }
  bool fence_done(fence_t f) {
    bump(n_.fence_query);
    relaxed r(*this, n_.fence_ns);
    return b_->fence_done(f);
  }
  status wait_fence(fence_t f) { relaxed r(*this, n_.fence_ns); return note(n_.wait_fence, b_->wait_fence(f)); }
  void drop_fence(fence_t f) { b_->drop_fence(f); }  // frees an event: not a driver round trip we count
  bool can_access_peer(int device, int peer) { return b_->can_access_peer(device, peer); }
  // Whether s is being captured into a graph now (false on backends without capture).
  bool capturing(stream_t s) {
    if (!capture_) return false;
    auto c = b_->capture_of(s);
    // A failed query is not a capture: the fence call that follows fails on its own and says why.
    return c.ok() && c.value.state != capture_state::none;
  }

  // Teardown and rollback cannot leave memory behind on one refusal: the call is made once more.
  template <class F>
  static status twice(F&& f) {
    status s = f();
    return s.ok() ? s : f();
  }

  driver_counts counts() const;
  ~driver();  // closes the exported fds still held

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
  // Calls the driver counts as unsafe during a stream capture run with this thread in relaxed
  // mode (PyTorch does the same around its cudaMalloc), so the allocator's own driver work never
  // invalidates a capture on this thread or another. Two thread-local driver calls (~0.1 us)
  // around a 1-600 us call; nothing without the capture capability.
  // Adds the wall time of a call to a counter.
  struct timed {
    std::atomic<std::uint64_t>& ns;
    std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();
    explicit timed(std::atomic<std::uint64_t>& c) : ns(c) {}
    ~timed() {
      const auto d = std::chrono::steady_clock::now() - t0;
      ns.fetch_add(static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(d).count()),
                   std::memory_order_relaxed);
    }
    timed(const timed&) = delete;
    timed& operator=(const timed&) = delete;
  };
  struct relaxed {
    driver& d;
    capture_mode old = capture_mode::relaxed;
    timed t;
    relaxed(driver& x, std::atomic<std::uint64_t>& ns) : d(x), t(ns) {
      if (d.capture_) old = d.b_->exchange_capture_mode(capture_mode::relaxed);
    }
    ~relaxed() {
      if (d.capture_) d.b_->exchange_capture_mode(old);
    }
    relaxed(const relaxed&) = delete;
    relaxed& operator=(const relaxed&) = delete;
  };

  struct counters {
    std::atomic<std::uint64_t> reserve{0}, free_reservation{0}, create{0}, release{0}, map{0}, unmap{0},
        set_access{0}, export_handle{0}, import_handle{0}, granularity{0}, query{0}, mem_info{0},
        record_fence{0}, fence_query{0}, wait_fence{0}, failures{0}, ns{0}, fence_ns{0};
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
  bool capture_;  // the backend has the capture part

  // Claims (see the top): the VA and handles of each call in flight, and this driver's mappings.
  struct footprint {
    std::uintptr_t va = 0;
    std::size_t n = 0;  // 0: no VA
    std::vector<mem_handle> hs;
  };
  class claim {
   public:
    claim(driver& d, footprint f);  // waits until nothing in flight overlaps f
    ~claim();
    claim(const claim&) = delete;
    claim& operator=(const claim&) = delete;

   private:
    driver& d_;
    std::list<footprint>::iterator it_;
  };
  // Caller holds claim_mu_: the footprint of [va, va+n) with the handles this driver mapped there.
  footprint under(std::uintptr_t va, std::size_t n) const;
  std::mutex claim_mu_;
  std::condition_variable claim_cv_;
  std::list<footprint> inflight_;
  std::map<std::uintptr_t, std::pair<std::size_t, mem_handle>> mapped_;  // va -> size, handle

  std::mutex export_mu_;                          // taken before a claim, never while one is held
  struct exported {
    int fd;              // the driver's export, kept; callers get dups
    std::uint64_t id;    // shareable_handle::export_id
  };
  std::unordered_map<mem_handle, exported> exported_;
  std::atomic<std::size_t> n_exported_{0};        // release() looks only when not 0
  counters n_;
};

}  // namespace vmm::vm
