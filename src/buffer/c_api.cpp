// SPDX-License-Identifier: Apache-2.0
// C API over vmm::growable_buffer (vmmalloc.h, "Growable buffer"). Exceptions never cross the
// boundary: every failure becomes a status and the thread-local last error shared with the
// allocator's C API, carrying the C++ exception's message.
#include <mutex>
#include <string>

#include "backend/c_status.hpp"
#include "vmmalloc/growable_buffer.hpp"
#include "vmmalloc/host_backend.hpp"
#include "vmmalloc/vmmalloc.h"

using namespace vmm::c_api;

struct vmm_buffer {
  explicit vmm_buffer(vmm::growable_buffer&& x) : b(std::move(x)) {}
  vmm::growable_buffer b;
  // The C++ buffer is single-threaded like std::vector; C callers (and Python threads) get a lock.
  mutable std::mutex mu;
};

namespace {

// Runs f on a locked, non-NULL buffer.
template <class F>
vmm_status locked(const vmm_buffer* b, const char* fn, F&& f) {
  if (!b) return set(VMM_ERROR_INVALID_VALUE, std::string(fn) + ": buffer is NULL");
  std::lock_guard g(b->mu);
  return guard([&] { f(const_cast<vmm_buffer*>(b)->b); });
}

}  // namespace

extern "C" {

void vmm_buffer_options_init(vmm_buffer_options* o) {
  if (o) *o = vmm_buffer_options{};
}

vmm_status vmm_buffer_create(const vmm_buffer_options* o, vmm_buffer** out) {
  if (!o || !out) return invalid("vmm_buffer_create: options and out must not be NULL");
  *out = nullptr;
  if (o->peer_count && !o->peers) return invalid("vmm_buffer_create: peers is NULL but peer_count > 0");
  const int backend = enum_value(o->backend);
  if (backend != VMM_BACKEND_CUDA && backend != VMM_BACKEND_HOST) return invalid("vmm_buffer_create: unknown backend");
  vmm_buffer* made = nullptr;
  const vmm_status s = guard([&] {
    vmm::growable_options g;
    g.device = o->device;
    g.min_chunk = o->min_chunk;
    g.geometric = o->geometric != 0;
    g.keep_idle = o->keep_idle;
    for (size_t i = 0; i < o->peer_count; ++i) g.peers.push_back({o->peers[i], vmm::access_mode::read_write});
    if (backend == VMM_BACKEND_HOST) {
      vmm::host_backend_options h;
      if (o->host_granularity) h.granularity = o->host_granularity;
      if (o->host_physical_limit) h.physical_limit = o->host_physical_limit;
      made = new vmm_buffer(vmm::growable_buffer::host(o->capacity_limit, h, g));
    } else {
      made = new vmm_buffer(vmm::growable_buffer::cuda(o->capacity_limit, o->device, g));
    }
  });
  if (s == VMM_SUCCESS) *out = made;
  return s;
}

void vmm_buffer_destroy(vmm_buffer* b) { delete b; }

vmm_status vmm_buffer_resize(vmm_buffer* b, size_t size) {
  return locked(b, "vmm_buffer_resize", [&](vmm::growable_buffer& g) { g.resize(size); });
}
vmm_status vmm_buffer_reserve(vmm_buffer* b, size_t bytes) {
  return locked(b, "vmm_buffer_reserve", [&](vmm::growable_buffer& g) { g.reserve(bytes); });
}
vmm_status vmm_buffer_shrink_to_fit(vmm_buffer* b) {
  return locked(b, "vmm_buffer_shrink_to_fit", [&](vmm::growable_buffer& g) { g.shrink_to_fit(); });
}
vmm_status vmm_buffer_release_idle(vmm_buffer* b) {
  return locked(b, "vmm_buffer_release_idle", [&](vmm::growable_buffer& g) { g.release_idle(); });
}

void* vmm_buffer_data(const vmm_buffer* b) {
  if (!b) return invalid("vmm_buffer_data: buffer is NULL"), nullptr;
  ok();
  return b->b.data();  // fixed at construction: no lock needed
}
size_t vmm_buffer_size(const vmm_buffer* b) {
  if (!b) return invalid("vmm_buffer_size: buffer is NULL"), 0;
  std::lock_guard g(b->mu);
  ok();
  return b->b.size();
}
size_t vmm_buffer_capacity(const vmm_buffer* b) {
  if (!b) return invalid("vmm_buffer_capacity: buffer is NULL"), 0;
  std::lock_guard g(b->mu);
  ok();
  return b->b.capacity();
}

vmm_status vmm_buffer_get_info(const vmm_buffer* b, vmm_buffer_info* out) {
  if (!out) return invalid("vmm_buffer_get_info: out is NULL");
  return locked(b, "vmm_buffer_get_info", [&](vmm::growable_buffer& g) {
    const auto& c = g.counts();
    vmm_buffer_info i{};
    i.data = g.data();
    i.size = g.size();
    i.capacity = g.capacity();
    i.capacity_limit = g.capacity_limit();
    i.reserved = g.reserved();
    i.granularity = g.granularity();
    i.chunks = g.chunk_count();
    i.idle_bytes = g.idle_bytes();
    i.reserve_calls = c.reserve;
    i.create_calls = c.create;
    i.map_calls = c.map;
    i.set_access_calls = c.set_access;
    i.unmap_calls = c.unmap;
    i.release_calls = c.release;
    i.failures = c.failures;
    if (auto* h = vmm::backend_cast<vmm::host_backend>(g.backend())) {
      i.live_handles = h->live_handles();
      i.live_mappings = h->live_mappings();
      i.live_reservations = h->live_reservations();
    }
    *out = i;
  });
}

}  // extern "C"
