// SPDX-License-Identifier: Apache-2.0
// check(): walks all heap metadata and verifies the invariants written in heap.hpp.
#include "heap/heap_impl.hpp"

namespace vmm {


std::string heap::check(std::uint64_t requested_outside, bool exact_requested) const {
  auto& m = *p_;
  using block = impl::block;
  // 1. free lists: every entry free, in its class, links consistent
  std::size_t listed = 0;
  for (int fl = 0; fl < kFlCount; ++fl)
    for (int sl = 0; sl < kSlCount; ++sl) {
      bool bit = (m.sl_bitmap[fl] >> sl) & 1;
      if (bit != (m.lists[fl][sl] != nullptr)) return "free-list bitmap does not match the lists";
      if (bit && !((m.fl_bitmap >> fl) & 1)) return "first-level bitmap is off";
      for (block* b = m.lists[fl][sl]; b; b = b->next_free) {
        int f, s;
        mapping(b->size, f, s);
        if (f != fl || s != sl) return "free block in the wrong list";
        if (!(b->flags & impl::f_free) || (b->flags & (impl::f_huge | impl::f_sentinel))) return "listed block is not a free span block";
        if (b->next_free && b->next_free->prev_free != b) return "free-list links broken";
        ++listed;
      }
    }
  // 2. spans: contiguous, coalesced, mapped; sum live bytes per chunk
  std::unordered_map<std::uint32_t, std::size_t> used;
  std::size_t free_blocks = 0, blocks = 0, allocated = 0, requested = 0, live = 0;
  auto add_used = [&](std::uintptr_t addr, std::size_t size) -> bool {
    for (std::uintptr_t x = addr; x < addr + size;) {
      std::uint32_t id = m.a.chunk_at(x);
      if (id == arena::no_chunk) return false;
      auto& c = m.a.get(id);
      std::size_t n = std::min<std::uintptr_t>(addr + size, c.va + c.size) - x;
      used[id] += n;
      x += n;
    }
    return true;
  };
  for (auto& [end, s] : m.span_ends) {
    if (s->addr != end || !(s->flags & impl::f_sentinel)) return "span sentinel is off";
    if (m.span_head_at(end)) return "a span starts where another ends (not joined)";
    std::uintptr_t expect = end;
    for (block* b = s->prev_phys; b; b = b->prev_phys) {
      if (b->addr + b->size != expect) return "blocks of a span do not tile it";
      if (b->next_phys->prev_phys != b) return "span links broken";
      if (b->size == 0 || b->size % kUnit) return "block size is not a multiple of 256";
      ++blocks;
      if (m.block_at(b->addr) != b) return "block missing from its page chain";
      if (b->flags & impl::f_free) {
        ++free_blocks;
        if (b->prev_phys && impl::compatible(b->prev_phys, b)) return "adjacent free blocks not coalesced";
        for (std::uintptr_t x = b->addr; x < b->addr + b->size; x += m.G)
          if (m.a.chunk_at(x) == arena::no_chunk) return "free block over unmapped memory";
      } else {
        if (!add_used(b->addr, b->size)) return "live block over unmapped memory";
        if (!(b->flags & impl::f_slab)) {
          bool deferred = false;
          for (auto& d : m.deferred_frees) deferred |= d.p == b->addr;
          if (!deferred) {
            allocated += b->size;
            requested += b->requested();
            ++live;
          }
        }
      }
      expect = b->addr;
    }
  }
  if (free_blocks != listed) return "a free block is missing from the free lists";
  // 3. huge blocks, slabs, page chains
  std::size_t chained = 0, slabs = 0, slab_pages = 0, huge_cached = 0, huge_seen = 0;
  for (std::size_t pg = 0; pg < m.pages.size(); ++pg) {
    for (block* b = m.pages[pg].starts; b; b = b->page_next) {
      ++chained;
      if (m.a.page_of(b->addr) != pg) return "block chained under the wrong page";
      if (b->flags & impl::f_slab) {  // a slab page: its units, its slabs
        auto pit = m.slab_pages.find(b->addr);
        if (pit == m.slab_pages.end() || pit->second.blk != b || b->size != m.G) return "a slab page is not listed";
        ++slab_pages;
        for (unsigned u = 0; u < impl::kUnitsPerPage; ++u) {
          const std::uintptr_t ua = b->addr + u * m.U;
          impl::slab* s = m.slab_of(ua);
          if (!s != !(pit->second.used >> u & 1)) return "a slab page's unit map and used units differ";
          if (!s || s->base != ua) continue;  // a free unit, or a slab's later unit
          if (s->blk != b || s->stream != pit->second.stream) return "a slab is not its page's";
          if (!s->bytes || (s->base - b->addr) % s->bytes || s->base + s->bytes > b->addr + m.G) return "slab not at its units";
          for (std::uintptr_t x = s->base; x < s->base + s->bytes; x += m.U)
            if (m.slab_of(x) != s) return "a slab's unit names another slab";
          ++slabs;
          std::size_t held = 0, pending = 0;
          if (s->seq.load() & 1) return "a slab is half set up";
          for (std::uint32_t i = 0; i < s->nslots; ++i) {
            if ((s->state[i].load(std::memory_order_relaxed) & 0xff00) != s->tag) return "a slot state carries another slab's tag";
            if (s->get(i) != impl::slot_free) {
              ++held;
              allocated += s->slot;
              if (exact_requested) requested += s->requested(i);  // others may be writing it
              ++live;
            } else if (s->requested(i) != 0) {
              return "a free slot still records requested bytes";
            }
          }
          for (auto& d : m.deferred_frees) pending += d.p - s->base < s->bytes;
          if (s->used != held + pending) return "slab used count is off";
          if (s->free.size() != s->nslots - s->used) return "slab free stack size is off";
          for (auto i : s->free)
            if (s->get(i) != impl::slot_free) return "a live slot is on the free stack";
          if (s->listed != !s->free.empty()) return "slab class list membership is off";
        }
        continue;
      }
      if (b->flags & impl::f_huge) {
        ++huge_seen;
        if (auto it = m.extending.find(b->addr + b->size); it != m.extending.end() && it->second == b) {  // reserved by a planned growth: out of the cache, its chunks held
          if (!(b->flags & impl::f_free)) return "a huge block being extended is not free";
          if (!add_used(b->addr, b->size)) return "huge block over unmapped memory";
          continue;
        }
        if (b->flags & impl::f_free) {
          ++huge_cached;
          continue;
        }
        if (!add_used(b->addr, b->size)) return "huge block over unmapped memory";
        bool deferred = false;
        for (auto& d : m.deferred_frees) deferred |= d.p == b->addr;
        if (deferred) continue;  // freed, waiting for a fence: no longer counted as live
        allocated += b->size;
        requested += b->requested();
        ++live;
      }
    }
  }
  if (chained != blocks + huge_seen) return "page chains hold blocks that are in no span";
  if (huge_cached != m.huge_cache.size()) return "huge cache does not match the free huge blocks";
  if (slabs != m.st.slabs) return "slab count is off";
  if (slab_pages != m.slab_pages.size() || m.st.slab_bytes != slab_pages * m.G) return "slab pages are off";
  if (allocated != m.st.allocated || live != m.st.live ||
      (exact_requested && requested != m.st.requested + requested_outside))
    return "heap stats do not add up (allocated/requested/live)";
  for (std::uint32_t id = 0; id < m.a.chunk_slots(); ++id) {
    auto& c = m.a.get(id);
    if (!c.size || c.heap != m.hid) continue;  // other heaps' chunks are theirs to check
    auto it = used.find(id);
    if ((it == used.end() ? 0 : it->second) != c.used) return "chunk used bytes do not match its live blocks";
  }
  return {};
}

}  // namespace vmm
