// SPDX-License-Identifier: Apache-2.0
// vmmalloc host backend: real host memory with the driver's semantics, so every layer above runs
// without a GPU (CI). memfd chunks, PROT_NONE reservations, MAP_FIXED mappings, mprotect for
// access, dup for export. Devices are simulated ids (0 = owner, others are peers); the CPU's page
// protection follows the owner's (device 0's) access mode.
//
// It is also the model of the CUDA driver's contract that every CI test runs against. A call the
// driver would refuse or corrupt its own state on is a violation, reported loudly (the process
// aborts with both calls named, as the driver may crash):
//   - two calls in flight at once on overlapping VA ranges or on one handle (map, unmap,
//     set_access, release, export, free_reservation): a release of a handle another thread is
//     unmapping, a VA mapped again before its unmap returned;
//   - an unmap of part of a mapping or over a gap (whole mappings side by side go in one call),
//     a map over mapped VA or outside a reservation;
//   - a handle used after its release (values are never reused unless reuse_handles, so a stale
//     one is unknown; with reuse_handles they come back as the driver's do, and a stale value
//     names a newer handle, which only the allocator's own checks can catch);
//   - a fence (a CUDA event) queried, waited on or dropped after its drop;
//   - sizes, addresses and offsets off the granularity, a set_access over unmapped VA, a free of a
//     reservation that still holds mappings.
// Calls run outside the backend's own mutex: it registers each call in flight and checks the
// others before it serialises anything, so it cannot hide a race the driver would not survive.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "vmmalloc/backend.hpp"

namespace vmm {

struct host_backend_options {
  std::size_t granularity = std::size_t{2} << 20;  // mirrors the GPUs' 2 MiB
  std::size_t physical_limit = std::size_t{64} << 30;  // simulated device memory (create fails past it)
  int device_count = 2;                               // simulated devices, for access policies
  bool fabric_supported = false;                      // simulate fabric export (falls back otherwise)
  // A violation of the driver's contract (see above): empty = print both calls and abort. A
  // handler (tests of the contract itself) gets the text instead, and the call is refused.
  std::function<void(const std::string&)> on_violation;
  // Microseconds each map, unmap, set_access, create, release and export stays in flight (the
  // real driver takes 1-600 us): races the driver's windows expose show up here too. 0 = as fast
  // as mmap.
  unsigned call_us = 0;
  // Hand released handle values out again, the last released first, as the driver does (its
  // handles are addresses of its own records): a value kept past its release then names a newer
  // handle, and only the allocator's own checks can tell. Off: values are never reused, so any
  // use after release is a violation.
  bool reuse_handles = false;
  // wait_fence on a held stream's fence blocks until complete_stream() (another thread plays the
  // GPU). Off: it fails with EPERM at once, as a single-threaded test would wait forever.
  bool waits_block = false;
};

class host_backend {
 public:
  explicit host_backend(host_backend_options o = {});
  ~host_backend();
  host_backend(host_backend&&) noexcept;
  host_backend& operator=(host_backend&&) = delete;

  const char* name() { return "host"; }
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
  result<capture_info> capture_of(stream_t);
  capture_mode exchange_capture_mode(capture_mode);

  // --- test controls (no driver analogue) ---
  // While a stream is held, fences recorded on it stay pending until complete_stream(), and work
  // launched on it waits: the GPU running behind the CPU.
  void hold_stream(stream_t);
  // Runs the stream's launched work in launch order, then completes every pending fence of the
  // stream and releases it; a wait_fence blocked on one of them returns (waits_block).
  void complete_stream(stream_t);
  // A kernel: runs now on a stream that is not held, else when complete_stream() runs (it writes
  // the block's memory then, wherever the allocator has put other blocks meanwhile).
  void launch(stream_t, std::function<void()> work);
  // Stream capture, modelled on the driver's rules (see backend.hpp, R11): begin returns the
  // capture's id (0: the stream already captures); end reports a capture that an event op on the
  // stream or a refused unsafe call invalidated (why, optional, names the call).
  std::uint64_t begin_capture(stream_t, capture_mode = capture_mode::global);
  status end_capture(stream_t, std::string* why = nullptr);
  // Simulated access a device has at va (what cuMemGetAccess would report).
  access_mode access_of(std::uintptr_t va, int device);
  // The memfd behind a live handle (-1: none), for tests that look at the files themselves.
  int fd_of(mem_handle);
  // The handle mapped at va (0: none): which physical memory an address is on.
  mem_handle handle_at(std::uintptr_t va);
  // Live object counts, for leak checks.
  std::size_t live_handles();
  std::size_t live_mappings();
  std::size_t live_reservations();

 private:
  struct impl;
  std::unique_ptr<impl> p_;
};
static_assert(backend<host_backend>);
static_assert(backend_ipc<host_backend> && backend_fences<host_backend> && backend_peers<host_backend> &&
              backend_compression<host_backend> && backend_capture<host_backend>);

}  // namespace vmm
