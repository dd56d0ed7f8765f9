// SPDX-License-Identifier: Apache-2.0
// The allocator's diagnostics: stats() merges the heap's, the arena's and the thread caches'
// counters; class_stats() and check() walk the metadata.
#include <algorithm>

#include "frontend/allocator_impl.hpp"

namespace vmm {

allocator_stats allocator::stats() const {
  std::lock_guard r(cache_registry_mutex());
  std::lock_guard g(p_->mu);
  heap_stats h = p_->hp->stats();
  arena_stats a = p_->ar->stats();
  // Graph pools' heaps: their live blocks and counters are the allocator's too.
  std::size_t pool_alloc = 0, pool_held = 0;
  for (const auto& [id, gp] : p_->pools) {
    const heap_stats x = gp.hp->stats();
    pool_alloc += x.allocated;
    pool_held += p_->ar->mapped_bytes(gp.hp->id());
    h.requested += x.requested;
    h.allocated += x.allocated;
    h.live += x.live;
    h.allocs += x.allocs;
    h.frees += x.frees;
    h.slab_bytes += x.slab_bytes;
    h.deferred += x.deferred;
    h.grows += x.grows;
    h.chunk_releases += x.chunk_releases;
    h.reclaims += x.reclaims;
    h.chunks_retired += x.chunks_retired;
    h.margin_trims += x.margin_trims;
  }
  // Slots in thread caches are allocated as far as the heap knows; the user sees them as free.
  std::uint64_t req = p_->retired_req, cached_b = 0, cached_n = 0, fa = p_->retired_allocs,
                ff = p_->retired_frees, rf = p_->retired_refilled, fl = p_->retired_flushed;
  for (auto& c : p_->caches) {
    req += c->req_delta.get();
    for (const auto& b : c->bins) {
      const std::uint64_t n = b.n.get();
      cached_n += n;
      cached_b += n * b.slot_size;
    }
    // A block the heap took back is the heap's free memory again (take_back_large), and the
    // heap's free of it no user free: its thread counts it flushed once it notices (return_large).
    const std::uint64_t held = c->large_cached.get(), taken = c->large_taken;
    fl += taken != 0;
    const std::uint64_t large = held > taken ? held - taken : 0;
    cached_b += large;
    cached_n += large != 0;
    fa += c->fast_allocs.get();
    ff += c->fast_frees.get();
    rf += c->refilled.get();
    fl += c->flushed.get();
  }
  allocator_stats s;
  // While other threads run, their caches' counters are read at slightly different moments: a
  // block allocated through one cache and freed through another can make the sum dip below zero
  // for an instant. Clamp to what is possible (0 <= requested <= allocated).
  std::uint64_t total = h.requested + req;
  s.requested = static_cast<std::int64_t>(total) < 0 ? 0 : total;
  s.allocated = h.allocated - cached_b;
  s.live = h.live - cached_n;
  s.requested = std::min<std::size_t>(s.requested, s.allocated);
  s.allocs = h.allocs - rf + fa;
  s.frees = h.frees - fl + ff;
  s.mapped = a.mapped;
  s.physical = a.physical;
  s.reserved = a.reserved;
  s.peak_mapped = a.peak_mapped;
  s.peak_physical = a.peak_physical;
  s.chunks = a.chunks;
  s.idle = a.idle;
  s.free_chunk_bytes = a.free_chunk_bytes;
  s.slab_bytes = h.slab_bytes;
  s.deferred = h.deferred;
  s.grows = h.grows;
  s.chunk_releases = h.chunk_releases;
  s.trims = h.trims;
  s.reclaims = h.reclaims;
  s.margin_trims = h.margin_trims;
  s.pools = p_->pools.size();
  s.pool_allocated = pool_alloc;
  s.pool_held = pool_held;
  s.chunks_retired = h.chunks_retired;
  s.retiring = a.retiring_bytes;
  s.stitched = a.stitched;
  s.compression_fallbacks = a.compression_fallbacks;
  s.ipc_fallbacks = a.ipc_fallbacks;
  s.compressed = a.compressed;
  s.access_changes = a.access_changes;
  s.exported = p_->exported;
  s.exported_released = h.exported_released;
  if (p_->trace) {
    std::lock_guard t(p_->trace->mu);
    s.traced_events = p_->trace->events;
  }
  s.fragmentation = s.mapped ? 1.0 - static_cast<double>(s.requested) / static_cast<double>(s.mapped) : 0.0;
  s.calls = a.calls;
  return s;
}


std::vector<class_occupancy> allocator::class_stats() const {
  std::lock_guard g(p_->mu);
  return p_->hp->occupancy();
}


span_free_stats allocator::span_free() const {
  std::lock_guard g(p_->mu);
  return p_->hp->span_free();
}


std::vector<segment_info> allocator::memory_map() const {
  std::lock_guard g(p_->mu);
  std::vector<segment_info> out;
  p_->hp->memory_map(0, out);
  for (const auto& [id, gp] : p_->pools) gp.hp->memory_map(id, out);
  std::sort(out.begin(), out.end(), [](const segment_info& x, const segment_info& y) { return x.addr < y.addr; });
  return out;
}


std::string allocator::check() const {
  // Structure, slab states, allocated/live bytes and chunk accounting are all changed under mu
  // only, so they are checked exactly even while other threads run. Other threads' caches are
  // theirs (bins are never read across threads); the bytes *requested* through them change
  // without the lock, so that one sum is checked only when no other thread holds a cache.
  std::lock_guard r(cache_registry_mutex());
  std::lock_guard g(p_->mu);
  std::uint64_t req = p_->retired_req;
  bool others = false;
  for (auto& c : p_->caches) {
    req += c->req_delta.get();
    if (is_own_thread_cache(p_->id, c.get())) {
      for (auto& b : c->bins)
        for (std::uint64_t k = 0; k < b.n.get(); ++k)
          if (b.e[k].r.state->load(std::memory_order_relaxed) != b.e[k].r.word(2) || b.e[k].r.size != b.slot_size)
            return "a thread-cached slot is not in state 2 of its class";
      if (c->large.cached != (c->large_cached.get() != 0) || (c->large.cached && c->large_cached.get() != c->large.r.size))
        return "thread cache's large block count is off";
      if (c->large.cached && !c->large_taken && p_->hp->usable_size(c->large.p) != 0)
        return "a thread-cached large block is still the user's";
    } else {
      others = true;
    }
  }
  if (std::string e = p_->hp->check(req, !others); !e.empty()) return e;
  for (const auto& [id, gp] : p_->pools)
    if (std::string e = gp.hp->check(0, true); !e.empty()) return "graph pool " + std::to_string(id) + ": " + e;
  return p_->ar->check();
}

}  // namespace vmm
