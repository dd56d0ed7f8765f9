// SPDX-License-Identifier: Apache-2.0
// memory_map(): every span and huge block of the heap as a segment of blocks in address order
// (the segments themselves unordered: the allocator sorts its heaps' together).
#include <unordered_set>

#include "heap/heap_impl.hpp"

namespace vmm {

void heap::memory_map(std::uint64_t pool, std::vector<segment_info>& out) const {
  auto& m = *p_;
  using block = impl::block;
  std::unordered_set<std::uintptr_t> deferred;
  for (auto& d : m.deferred_frees) deferred.insert(d.p);
  // A block the heap counts as allocated is the user's, a thread cache's, or freed and waiting.
  auto held_state = [&](std::uintptr_t p, bool thread_cached) {
    if (deferred.count(p)) return block_state::pending_free;
    return thread_cached ? block_state::cached : block_state::live;
  };
  auto add_slots = [&](const impl::slab& s, std::size_t bytes, std::vector<block_info>& v) {
    for (std::uint32_t i = 0; i < s.nslots; ++i) {
      const std::uintptr_t p = s.base + std::size_t{i} * s.slot;
      const auto st = s.get(i);
      block_info bi{p, s.slot, 0, block_state::free};
      if (st == impl::slot_user || st == impl::slot_user_recorded) {
        bi.state = block_state::live;
        bi.requested = s.requested(i);
      } else if (st == impl::slot_cached) {
        bi.state = block_state::cached;
      } else if (deferred.count(p)) {
        bi.state = block_state::pending_free;  // its slot state is free; the slab still counts it
      }
      v.push_back(bi);
    }
    const std::size_t used = std::size_t{s.nslots} * s.slot;
    if (bytes > used) v.push_back({s.base + used, bytes - used, 0, block_state::free});
  };
  auto block_of = [&](const block* b, std::vector<block_info>& v) {
    if (b->flags & impl::f_slab) {  // a slab page: its slabs slot by slot, its free units
      for (std::uintptr_t u = b->addr; u < b->addr + b->size;) {
        const impl::slab* s = m.slab_of(u);
        if (s && s->base == u && s->blk == b) {
          add_slots(*s, s->bytes, v);
          u += s->bytes;
        } else {
          v.push_back({u, m.U, 0, block_state::free});
          u += m.U;
        }
      }
      return;
    }
    block_info bi{b->addr, b->size, 0, block_state::free};
    if (b->flags & impl::f_free) {
      if (b->flags & impl::f_huge) bi.state = block_state::cached;
    } else {
      const bool cached = (b->tword.load(std::memory_order_acquire) & 0xff) >= 2;
      bi.state = held_state(b->addr, cached);
      if (bi.state == block_state::live) bi.requested = b->requested();
    }
    v.push_back(bi);
  };

  for (auto& [end, sentinel] : m.span_ends) {
    std::vector<const block*> chain;  // the span's blocks, last first
    for (const block* b = sentinel->prev_phys; b; b = b->prev_phys) chain.push_back(b);
    if (chain.empty()) continue;
    segment_info seg;
    seg.addr = chain.back()->addr;
    seg.size = end - seg.addr;
    seg.pool = pool;
    for (auto it = chain.rbegin(); it != chain.rend(); ++it) block_of(*it, seg.blocks);
    out.push_back(std::move(seg));
  }
  for (std::size_t pg = 0; pg < m.pages.size(); ++pg)
    for (const block* b = m.pages[pg].starts; b; b = b->page_next) {
      if (!(b->flags & impl::f_huge)) continue;
      segment_info seg;
      seg.addr = b->addr;
      seg.size = b->size;
      seg.pool = pool;
      seg.huge = true;
      block_of(b, seg.blocks);
      out.push_back(std::move(seg));
    }
}

}  // namespace vmm
