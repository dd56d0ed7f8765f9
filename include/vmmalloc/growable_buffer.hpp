// SPDX-License-Identifier: Apache-2.0
// vmm::growable_buffer: one buffer that grows and shrinks in place. data() never changes.
//
//   auto buf = vmm::growable_buffer::cuda(64ull << 30);  // reserves 64 GiB of VA, maps nothing
//   buf.resize(1ull << 30);                               // maps 1 GiB: one driver round
//   void* p = buf.data();
//   buf.resize(2ull << 30);                               // maps 1 GiB more at the tail: p unchanged,
//                                                         // contents kept, no copy (~0.2 ms on an H200)
//   buf.resize(0);                                        // unmaps and releases: memory goes back
//
// Contract (stated once, here):
//  * The constructor reserves round_up(capacity_limit, G) bytes of VA once (G = granularity(), the
//    largest of the owner's and peers' minimum granularities). The reservation is the buffer's own;
//    data() is its base and never changes for the buffer's life. size() never exceeds
//    capacity_limit(): asking for more throws vmm::out_of_memory and changes nothing.
//  * Memory is mapped at the tail in chunks. A chunk is one physical handle mapped by one map()
//    call, so growing by D bytes is ONE driver round (create + map + set_access) of
//    max(round_up(D, G), min_chunk) bytes, whatever D is: the driver's cost is per call, not per
//    byte (H200, docs/performance.md: one 1 GiB chunk ~210 us; 512 chunks of 2 MiB ~30 ms). With
//    options.geometric, a chunk is also at least half the bytes already mapped, so growing in many
//    small steps costs O(log n) driver rounds (like std::vector's doubling) at the price of up to
//    50 % mapped-but-unused memory; when such a larger chunk does not fit in physical memory, the
//    exact need is tried once more before giving up.
//  * Growth (resize up, reserve) is all-or-nothing: any failed step is rolled back (the mapping
//    unmapped, the handle released) and size(), capacity() and chunk_count() are unchanged. It
//    throws vmm::out_of_memory for errc::out_of_memory, vmm::error otherwise.
//  * Contents survive growth: the old bytes are never moved. New bytes are NOT zeroed (cuMemCreate
//    gives no guarantee; the host backend happens to give zeros).
//  * Shrinking (resize down, shrink_to_fit) unmaps and releases whole chunks that lie entirely past
//    round_up(new size, G): cuMemUnmap must unmap exactly what one map() mapped, so a chunk is the
//    unit of return and a chunk that straddles the new end stays mapped (capacity() says how much).
//    Their physical memory goes back to the device. A refused unmap/release is retried once; if the
//    driver still refuses, size() is already the new size, the memory is kept (still mapped and
//    usable, or parked and retried by the next call and the destructor) and vmm::error is thrown.
//    Shrinking while GPU work still uses the tail is the caller's bug: synchronize first.
//  * options.keep_idle > 0: chunks returned by a shrink keep their physical handle (unmapped, the
//    memory still held and counted in idle_bytes()) up to that many bytes; the next growth maps
//    them again first (map + set_access: no create, no release, and no wait for a release the
//    driver is still finishing) and creates only what they do not cover. Kept memory is held
//    until release_idle() or the destructor: other users of the device cannot have it.
//  * The destructor unmaps every chunk, releases every handle and frees the reservation, retrying a
//    refused call once (it cannot report errors).
//  * Not thread-safe, like std::vector: one thread at a time (or the caller's lock) per buffer.
//  * Movable (the moved-from buffer is empty: data() == nullptr, holds nothing), not copyable.
//  * growable_buffer::shared(a, ...): the buffer runs on allocator a's backend and shares a's pool
//    of idle handles. A growth maps handles a holds idle (what its frees, trims and pressure
//    unmapped; at most 8, largest first) before it creates; a shrink gives its chunks to a's idle
//    pool instead of releasing them (keep_idle is not used), where a's next growth or this
//    buffer's maps them again without cuMemCreate. Handles in a's pool count against a's
//    memory_limit (a shrink that would pass it releases instead) and go back to the device with
//    a's trim() and pressure paths. a must outlive the buffer. The buffer's own driver calls run
//    without a's lock; only taking and giving a handle take it.
//
// Layering: a sibling of the arena, on top of the backend seam (backend.hpp). It owns its backend
// and reservation; only a shared buffer reaches into an allocator (its backend and idle pool).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "vmmalloc/backend.hpp"
#include "vmmalloc/error.hpp"
#include "vmmalloc/host_backend.hpp"
#include "vmmalloc/stats.hpp"

namespace vmm {

class allocator;

struct growable_options {
  int device = 0;                   // owner device: every chunk is created there, read_write
  std::vector<access_desc> peers;   // extra devices granted on every mapping (checked at construction)
  std::size_t min_chunk = 0;        // smallest chunk mapped by one growth; 0 = granularity (2 MiB)
  bool geometric = false;           // chunk >= mapped / 2: O(log n) driver rounds for many small steps
  std::size_t keep_idle = 0;        // bytes of shrunk chunks kept as handles for the next growth;
                                    // 0 = a shrink releases its chunks at once
};

class growable_buffer {
 public:
  // Reserves round_up(capacity_limit, G) of VA on `b`; maps nothing. Throws vmm::error when the
  // backend is null, capacity_limit is 0, a peer cannot access the owner, or the reserve fails.
  growable_buffer(std::unique_ptr<backend_iface> b, std::size_t capacity_limit,
                  const growable_options& o = {});
  // Host backend (memfd + mmap: host memory with the driver's rules, CI without a GPU).
  static growable_buffer host(std::size_t capacity_limit, const host_backend_options& h = {},
                              const growable_options& o = {});
  // CUDA backend on `device` (o.device is set to it). Throws vmm::error "no CUDA driver ..." when
  // the driver, the device or VMM support is missing.
  static growable_buffer cuda(std::size_t capacity_limit, int device = 0, growable_options o = {});

  // On allocator a's backend and device, sharing a's idle handles (see the contract). Throws
  // vmm::error when a's chunks cannot serve the buffer: compressible or exportable memory, host
  // memory, another device than o.device (set to a's), or peers needing a larger granularity.
  static growable_buffer shared(allocator& a, std::size_t capacity_limit, growable_options o = {});
  ~growable_buffer();
  growable_buffer(growable_buffer&&) noexcept;
  growable_buffer& operator=(growable_buffer&&) noexcept;
  growable_buffer(const growable_buffer&) = delete;
  growable_buffer& operator=(const growable_buffer&) = delete;

  // Sets size() to n. Growing past capacity() maps one chunk at the tail (see the contract);
  // shrinking below size() returns the chunks wholly past round_up(n, G).
  void resize(std::size_t n);
  // Maps up to n bytes without changing size(); never unmaps (n <= capacity() is a no-op).
  void reserve(std::size_t n);
  // Returns the chunks wholly past round_up(size(), G).
  void shrink_to_fit();
  // Releases the idle handles a shrink kept (options.keep_idle). A refused release is parked and
  // retried later; vmm::error says so.
  void release_idle();

  void* data() const noexcept { return reinterpret_cast<void*>(base_); }
  std::size_t size() const noexcept { return size_; }
  std::size_t capacity() const noexcept { return mapped_; }              // mapped bytes
  std::size_t capacity_limit() const noexcept { return limit_; }         // as given
  std::size_t reserved() const noexcept { return reserved_; }            // VA: round_up(limit, G)
  std::size_t granularity() const noexcept { return gran_; }
  std::size_t chunk_count() const noexcept { return chunks_; }            // mapped chunks
  std::size_t idle_bytes() const noexcept { return idle_; }              // kept handles, unmapped
  // Backend calls made by this buffer (attempts, retries included; failures = calls refused).
  driver_counts counts() const;
  const growable_options& opts() const noexcept { return opt_; }
  // The backend, e.g. dynamic_cast<backend_model<host_backend>&> for its test controls.
  // Precondition: not moved-from.
  backend_iface& backend() noexcept;

 private:
  struct impl;  // src/buffer: the driver, the reservation, the chunks, parked rollback work
  growable_buffer(std::unique_ptr<impl> m, std::size_t capacity_limit, const growable_options& o,
                  std::size_t min_granularity);
  void open(std::size_t min_granularity);
  void grow_to(std::size_t n, const char* what);
  void trim_to(std::size_t n, const char* what);
  void destroy() noexcept;

  std::unique_ptr<impl> p_;
  growable_options opt_;
  std::size_t gran_ = 0, limit_ = 0, reserved_ = 0;
  std::uintptr_t base_ = 0;
  std::size_t size_ = 0, mapped_ = 0, chunks_ = 0, idle_ = 0;
};

}  // namespace vmm
