// SPDX-License-Identifier: Apache-2.0
// C API over vmm::kv_cache (vmmalloc.h, "KV cache"). Exceptions never cross the boundary: every
// failure becomes a status and the thread-local last error shared with the allocator's C API,
// carrying the C++ exception's message. vmm::kv_cache is thread-safe itself: no lock here.
#include <string>

#include "backend/c_status.hpp"
#include "vmmalloc/host_backend.hpp"
#include "vmmalloc/kv_cache.hpp"
#include "vmmalloc/vmmalloc.h"

using namespace vmm::c_api;

struct vmm_kv_cache {
  explicit vmm_kv_cache(vmm::kv_cache&& x) : kv(std::move(x)) {}
  vmm::kv_cache kv;
};

namespace {

// Runs f on a non-NULL cache.
template <class F>
vmm_status with(const vmm_kv_cache* kv, const char* fn, F&& f) {
  if (!kv) return set(VMM_ERROR_INVALID_VALUE, std::string(fn) + ": kv cache is NULL");
  return guard([&] { f(const_cast<vmm_kv_cache*>(kv)->kv); });
}

}  // namespace

extern "C" {

void vmm_kv_config_init(vmm_kv_config* c) {
  if (!c) return;
  *c = vmm_kv_config{};
  c->elem_bytes = 2;
}

vmm_status vmm_kv_create(const vmm_kv_config* c, vmm_kv_cache** out) {
  if (!c || !out) return invalid("vmm_kv_create: config and out must not be NULL");
  *out = nullptr;
  if (c->peer_count && !c->peers) return invalid("vmm_kv_create: peers is NULL but peer_count > 0");
  const int backend = enum_value(c->backend);
  if (backend != VMM_BACKEND_CUDA && backend != VMM_BACKEND_HOST) return invalid("vmm_kv_create: unknown backend");
  vmm_kv_cache* made = nullptr;
  const vmm_status s = guard([&] {
    vmm::kv_cache_config k;
    k.layers = c->layers;
    k.kv_heads = c->kv_heads;
    k.head_dim = c->head_dim;
    k.elem_bytes = c->elem_bytes;
    k.max_seqs = c->max_seqs;
    k.max_tokens = c->max_tokens;
    k.page_size = c->page_size;
    k.device = c->device;
    for (size_t i = 0; i < c->peer_count; ++i) k.peers.push_back({c->peers[i], vmm::access_mode::read_write});
    k.map_ahead_pages = c->map_ahead_pages;
    k.map_ahead_tokens = c->map_ahead_tokens;
    k.pool_keep_pages = c->pool_keep_pages;
    k.retain_closed = c->retain_closed != 0;
    k.fused_kv = c->fused_kv != 0;
    if (c->layout != VMM_KV_PER_LAYER && c->layout != VMM_KV_PER_SEQUENCE)
      throw vmm::error({vmm::errc::invalid_value, 0, "unknown layout", "kv_cache"},
                       "vmm_kv_create: layout " + std::to_string(c->layout) +
                           " is neither VMM_KV_PER_LAYER nor VMM_KV_PER_SEQUENCE");
    k.layout = c->layout == VMM_KV_PER_SEQUENCE ? vmm::kv_layout::per_sequence : vmm::kv_layout::per_layer;
    if (backend == VMM_BACKEND_HOST) {
      vmm::host_backend_options h;
      if (c->host_granularity) h.granularity = c->host_granularity;
      if (c->host_physical_limit) h.physical_limit = c->host_physical_limit;
      made = new vmm_kv_cache(vmm::kv_cache::host(k, h));
    } else {
      made = new vmm_kv_cache(vmm::kv_cache::cuda(k));
    }
  });
  if (s == VMM_SUCCESS) *out = made;
  return s;
}

void vmm_kv_destroy(vmm_kv_cache* kv) { delete kv; }

vmm_status vmm_kv_open(vmm_kv_cache* kv, size_t* seq) {
  if (!seq) return invalid("vmm_kv_open: seq is NULL");
  return with(kv, "vmm_kv_open", [&](vmm::kv_cache& k) { *seq = k.open(); });
}
vmm_status vmm_kv_open_slot(vmm_kv_cache* kv, size_t slot) {
  return with(kv, "vmm_kv_open_slot", [&](vmm::kv_cache& k) { k.open(slot); });
}
vmm_status vmm_kv_append(vmm_kv_cache* kv, size_t seq, size_t n, size_t* old_length) {
  return with(kv, "vmm_kv_append", [&](vmm::kv_cache& k) {
    const size_t old = k.append(seq, n);
    if (old_length) *old_length = old;
  });
}
vmm_status vmm_kv_truncate(vmm_kv_cache* kv, size_t seq, size_t n) {
  return with(kv, "vmm_kv_truncate", [&](vmm::kv_cache& k) { k.truncate(seq, n); });
}
vmm_status vmm_kv_close(vmm_kv_cache* kv, size_t seq) {
  return with(kv, "vmm_kv_close", [&](vmm::kv_cache& k) { k.close(seq); });
}
vmm_status vmm_kv_share_prefix(vmm_kv_cache* kv, size_t src, size_t tokens, size_t* seq) {
  if (!seq) return invalid("vmm_kv_share_prefix: seq is NULL");
  return with(kv, "vmm_kv_share_prefix", [&](vmm::kv_cache& k) { *seq = k.share_prefix(src, tokens); });
}
vmm_status vmm_kv_trim(vmm_kv_cache* kv, size_t keep_pages, size_t* released) {
  return with(kv, "vmm_kv_trim", [&](vmm::kv_cache& k) {
    const size_t r = keep_pages == VMM_KV_KEEP_DEFAULT ? k.trim() : k.trim(keep_pages);
    if (released) *released = r;
  });
}
vmm_status vmm_kv_wait_map_ahead(vmm_kv_cache* kv) {
  return with(kv, "vmm_kv_wait_map_ahead", [&](vmm::kv_cache& k) { k.wait_map_ahead(); });
}

vmm_status vmm_kv_k(const vmm_kv_cache* kv, size_t seq, size_t layer, void** out) {
  if (!out) return invalid("vmm_kv_k: out is NULL");
  return with(kv, "vmm_kv_k", [&](vmm::kv_cache& k) { *out = k.k(seq, layer); });
}
vmm_status vmm_kv_v(const vmm_kv_cache* kv, size_t seq, size_t layer, void** out) {
  if (!out) return invalid("vmm_kv_v: out is NULL");
  return with(kv, "vmm_kv_v", [&](vmm::kv_cache& k) { *out = k.v(seq, layer); });
}

vmm_status vmm_kv_get_seq(const vmm_kv_cache* kv, size_t seq, vmm_kv_seq_info* out) {
  if (!out) return invalid("vmm_kv_get_seq: out is NULL");
  return with(kv, "vmm_kv_get_seq", [&](vmm::kv_cache& k) {
    const auto& c = k.config();
    if (seq >= c.max_seqs)
      throw vmm::error({vmm::errc::invalid_value, 0, "unknown sequence", "kv_cache"},
                       "vmm::kv_cache::get_seq: sequence " + std::to_string(seq) + " is out of range (max_seqs " +
                           std::to_string(c.max_seqs) + ")");
    vmm_kv_seq_info i{};
    // A concurrent close between is_open and length makes length throw: reported as the error.
    if (k.is_open(seq)) {
      i.open = 1;
      i.length = k.length(seq);
      i.mapped_pages = k.mapped_pages(seq);
      i.capacity = k.capacity(seq);
      i.shared_tokens = k.shared_tokens(seq);
    }
    *out = i;
  });
}

vmm_status vmm_kv_get_layout(const vmm_kv_cache* kv, vmm_kv_layout* out) {
  if (!out) return invalid("vmm_kv_get_layout: out is NULL");
  return with(kv, "vmm_kv_get_layout", [&](vmm::kv_cache& k) {
    const auto& c = k.config();
    vmm_kv_layout l{};
    l.base = k.base();
    l.reserved = k.reserved();
    l.token_bytes = k.token_bytes();
    l.seq_stride = k.seq_stride();
    l.buffer_stride = k.buffer_stride();
    l.page_size = k.page_size();
    l.tokens_per_page = k.tokens_per_page();
    l.max_pages = k.max_pages();
    l.granularity = k.granularity();
    l.layers = c.layers;
    l.kv_heads = c.kv_heads;
    l.head_dim = c.head_dim;
    l.elem_bytes = c.elem_bytes;
    l.max_seqs = c.max_seqs;
    l.max_tokens = c.max_tokens;
    l.token_stride = k.token_stride();
    l.layer_stride = k.layer_stride();
    l.kv_stride = k.kv_stride();
    l.layout = c.layout == vmm::kv_layout::per_sequence ? VMM_KV_PER_SEQUENCE : VMM_KV_PER_LAYER;
    *out = l;
  });
}

vmm_status vmm_kv_get_stats(const vmm_kv_cache* kv, vmm_kv_stats* out) {
  if (!out) return invalid("vmm_kv_get_stats: out is NULL");
  return with(kv, "vmm_kv_get_stats", [&](vmm::kv_cache& k) {
    const vmm::kv_cache_stats s = k.stats();
    vmm_kv_stats o{};
    o.pages_created = s.pages_created;
    o.pages_reused = s.pages_reused;
    o.pages_released = s.pages_released;
    o.pages_mapped = s.pages_mapped;
    o.pages_pooled = s.pages_pooled;
    o.mapped_bytes = s.mapped_bytes;
    o.used_bytes = s.used_bytes;
    o.open_seqs = s.open_seqs;
    o.appends = s.appends;
    o.driver_calls = s.driver_calls;
    o.append_driver_calls = s.append_driver_calls;
    o.map_ahead_driver_calls = s.map_ahead_driver_calls;
    o.map_ahead_pages = s.map_ahead_pages;
    o.map_ahead_failures = s.map_ahead_failures;
    o.append_waits = s.append_waits;
    o.failures = s.failures;
    o.pages_retained = s.pages_retained;
    o.pages_retained_reused = s.pages_retained_reused;
    o.pages_reclaimed = s.pages_reclaimed;
    o.pages_aliased = s.pages_aliased;
    if (auto* h = vmm::backend_cast<vmm::host_backend>(k.backend())) {
      o.live_handles = h->live_handles();
      o.live_mappings = h->live_mappings();
      o.live_reservations = h->live_reservations();
    }
    *out = o;
  });
}

}  // extern "C"
