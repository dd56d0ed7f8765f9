// SPDX-License-Identifier: Apache-2.0
// Spans of mapped VA: split and coalesce blocks, grow by mapping chunks, release wholly free
// chunks (stitching their handles, the release threshold). See heap.hpp.
#include "heap/heap_impl.hpp"

namespace vmm {


result<heap::impl::block*> heap::impl::allocate_large(std::size_t n, std::size_t align, stream_t x, bool may_grow) {
  std::size_t size = align_up(std::max<std::size_t>(n, 1), kUnit);
  std::size_t need = size + (align > kUnit ? align - kUnit : 0);
  if (size < n || need < size) return {nullptr, fail(errc::out_of_memory, "size overflows")};
  block* b = find_free(need, x);
  // None fits: a growth is planned (or, grow_mode::never, nothing happens); the caller runs it and
  // asks again.
  if (!b) return {nullptr, may_grow ? grow(need, x) : status{}};
  remove_free(b);
  if (align > kUnit) {
    std::uintptr_t at = align_up(b->addr, align);
    if (at > b->addr) {
      block* nb = split(b, at);
      insert_free(b);
      b = nb;
    }
  }
  if (b->size - size >= kUnit) insert_free(split(b, b->addr + size));
  b->flags = 0;
  b->set_requested(n);
  b->stream = x;
  account(b->addr, b->size, true);
  return {b, {}};
}

void heap::impl::free_large(block* b, stream_t s) {
  account(b->addr, b->size, false);
  b->flags = f_free | f_tagged;
  b->stream = s;
  b->free_seq = ++seq;
  b->set_requested(0);
  if (b->prev_phys && compatible(b->prev_phys, b)) {
    block* l = b->prev_phys;
    remove_free(l);
    absorb(l, b);
    b = l;
  }
  if (b->next_phys && compatible(b, b->next_phys)) {
    remove_free(b->next_phys);
    absorb(b, b->next_phys);
  }
  insert_free(b);
}

void heap::impl::add_span_range(std::uintptr_t va, std::size_t size, stream_t x, std::uint64_t freed_seq) {
  block* nb = new_block();
  block* sentinel = nullptr;
  nb->addr = va;
  nb->size = size;
  nb->flags = f_free;
  if (freed_seq) {  // memory just freed on x (a huge block's): tagged like any free
    nb->flags = f_free | f_tagged;
    nb->stream = x;
    nb->free_seq = freed_seq;
  }
  auto it = span_ends.find(va);
  if (it != span_ends.end()) {
    block* s = it->second;
    block* tail = s->prev_phys;
    nb->prev_phys = tail;
    nb->next_phys = s;
    tail->next_phys = nb;
    s->prev_phys = nb;
    span_ends.erase(it);
    s->addr = va + size;
    span_ends[s->addr] = s;
    sentinel = s;
    link_page(nb);
    // A free tail x may use joins the range, as grow() planned, under the tail's tag (untagged,
    // x's, or one whose fence completed), or x's where the range may still be written.
    if ((tail->flags & f_free) && usable(tail, x)) {
      if (freed_seq) take_tag(tail, nb);
      else take_tag(nb, tail);
      remove_free(tail);
      absorb(tail, nb);
      nb = tail;
      // Tagged so, the tail may now also coalesce with its own left neighbour.
      if (block* l = nb->prev_phys; freed_seq && l && compatible(l, nb)) {
        remove_free(l);
        absorb(l, nb);
        nb = l;
      }
    }
  } else {
    block* s = new_block();
    s->addr = va + size;
    s->flags = f_sentinel;
    nb->next_phys = s;
    s->prev_phys = nb;
    span_ends[s->addr] = s;
    sentinel = s;
    link_page(nb);
  }
  insert_free(nb);
  join_next_span(sentinel, x);
}

heap::impl::block* heap::impl::span_head_at(std::uintptr_t p) const {
  if (!a.contains(p)) return nullptr;
  block* h = block_at(p);
  return h && !(h->flags & (f_huge | f_sentinel)) && !h->prev_phys ? h : nullptr;
}

void heap::impl::join_next_span(block* sentinel, stream_t x) {
  block* h = span_head_at(sentinel->addr);
  if (!h) return;
  block* t = sentinel->prev_phys;
  span_ends.erase(sentinel->addr);
  t->next_phys = h;
  h->prev_phys = t;
  delete_block(sentinel);
  // Tags whose fences completed go first on both sides of the seam, so that each side is untagged,
  // x's, or not usable by x. The two join only where x may use both: joining a block x may not
  // use yet would make the whole wait for it, and the request grown for would not fit.
  if (t->flags & f_free) t = drop_covered_tag(t, true);
  if (h->flags & f_free) h = drop_covered_tag(h, false);
  if (!(t->flags & f_free) || !(h->flags & f_free) || !usable(t, x) || !usable(h, x)) return;
  // The untagged one takes x's tag, then may coalesce with its other neighbour if that is x's.
  if (!(t->flags & f_tagged) && (h->flags & f_tagged)) {
    take_tag(t, h);
    if (block* l = t->prev_phys; l && compatible(l, t)) t = merge_free(l, t);
    merge_free(t, h);
  } else if ((t->flags & f_tagged) && !(h->flags & f_tagged)) {
    take_tag(h, t);
    t = merge_free(t, h);
    if (block* r = t->next_phys; r && compatible(t, r)) merge_free(t, r);
  } else {
    merge_free(t, h);
  }
}

heap::impl::block* heap::impl::drop_covered_tag(block* b, bool left) {
  if (!(b->flags & f_tagged) || !fence_covers(b->stream, b->free_seq)) return b;
  b->flags = static_cast<std::uint8_t>(b->flags & ~f_tagged);
  if (left) {
    block* l = b->prev_phys;
    return l && compatible(l, b) ? merge_free(l, b) : b;
  }
  block* r = b->next_phys;
  return r && compatible(b, r) ? merge_free(b, r) : b;
}

heap::impl::block* heap::impl::merge_free(block* l, block* r) {
  remove_free(l);
  remove_free(r);
  absorb(l, r);
  insert_free(l);
  return l;
}

status heap::impl::grow(std::size_t need, stream_t x) {
  if (mode == grow_mode::never) return {};
  std::size_t size = round_up(need, G);
  bool pressed = false;
  if (status e = prepare_growth(size, x, pressed); !e.ok()) return e;
  // Prefer extending a span whose free tail this stream may use: less new memory, one block.
  std::uintptr_t at = 0;
  std::size_t best_tail = 0, ext = size;
  bool found = false;
  for (auto& [end, s] : span_ends) {
    block* t = s->prev_phys;
    std::size_t tail = (t && (t->flags & f_free) && usable(t, x)) ? t->size : 0;
    std::size_t e = round_up(need - std::min(tail, need), G);
    if (e == 0) e = G;
    if ((!found || tail > best_tail) && a.hole_at(end, e)) {
      found = true, at = end, best_tail = tail, ext = e;
    }
  }
  // Less new memory still: a hole shorter than that between a span's free tail and the next
  // span's free head (a chunk given back from a span's middle) that the request fits across;
  // mapping the hole joins the spans (add_span_range). Without it such cuts accumulate and every
  // larger request maps its whole size elsewhere: 1.025 against 1.011 peak mapped / live on the
  // shared trace.
  std::uintptr_t join_at = 0;
  std::size_t join_ext = ext;
  for (auto& [end, s] : span_ends) {
    const std::size_t hole = a.hole_from(end);
    if (!hole || hole >= join_ext) continue;
    block* h = span_head_at(end + hole);
    if (!h || !(h->flags & f_free) || !usable(h, x)) continue;
    // What one free block the mapping leaves: the hole, the head and a free tail, each of which
    // x may use, join (add_span_range, join_next_span).
    block* t = s->prev_phys;
    std::size_t joined = hole + h->size;
    if ((t->flags & f_free) && usable(t, x)) joined += t->size;
    if (joined >= need) join_at = end, join_ext = hole;
  }
  // Repeated growth is geometric (driver cost is per call), capped by tuning::max_growth; after a
  // growth the driver refused, exactly what is needed.
  std::size_t geo = std::min(next_growth, std::max(a.tune().max_growth, G));
  if (mode == grow_mode::last_resort) geo = 0;
  std::size_t want = ext;
  if (join_at) at = join_at, want = ext = join_ext;
  else if (want < geo && (!found || a.hole_at(at, geo))) want = geo;
  const std::size_t piece = span_piece(ext);
  std::size_t got = 0;  // more than asked when a retired handle larger than the rest is mapped whole
  auto plan = [&](std::size_t n, std::uintptr_t where) { return a.map_range(n, where, kOwnerSpan, x, &got, hid, piece, pressed); };
  auto r = plan(want, at);
  // Planning fails only for lack of a hole or of room under the memory limit: try smaller.
  if (!r.ok() && want != ext) r = plan(want = ext, at);
  if (!r.ok() && at) r = plan(want = size, 0);  // the hole after the span is gone: a new span
  if (!r.ok() && r.st.kind == errc::out_of_memory && a.free_chunk_bytes(hid)) {
    status e = evict_free_chunks(~std::size_t{0}, true, false, &x);  // last resort: every idle-able chunk
    if (!e.ok()) return e;
    r = plan(want = size, 0);
  }
  if (pressed) a.release_idle(0);  // what the growth does not map goes back to the device
  if (!r.ok()) return r.st;
  planned = true;
  return {};
}

void heap::impl::grown(bool pressed) {
  // Repeated growth doubles (driver cost is per call) up to tuning::max_growth; pressure starts it over.
  next_growth = pressed ? G : std::min(next_growth * 2, std::max(a.tune().max_growth, G));
}

status heap::impl::prepare_growth(std::size_t size, stream_t x, bool& pressed) {
  pressed = relieve_pressure(size, x);
  if (pressed) return {};
  // Below the heap's allocated high-water mark, new memory costs a create where moving free
  // chunks costs an unmap and a map each: GPT-2's process on an H200 made about 19,000 driver
  // calls instead of 25,000-40,000, holding 1.017 x allocated instead of 1.011-1.016. Not under a
  // memory limit: there held memory is what the user rations.
  const bool unlimited = a.memory_limit() == std::numeric_limits<std::size_t>::max();
  if (unlimited && a.mapped_bytes(hid) + a.idle_bytes() + size <= top_allocated) return {};
  return evict_free_chunks(size, true, false, &x);  // reuse wholly free chunks' physical memory
}

status heap::impl::evict_free_chunks(std::size_t target, bool keep_handle, bool wait, const stream_t* for_stream) {
  if (private_pool) return {};
  std::uint32_t id = a.oldest_free_chunk(hid);
  // For a request (for_stream), only idle handles that fit it count: a larger one is released
  // before a new handle is created, unless it was retired (its stream still runs behind): then
  // map_range maps it whole for the request, and its old range goes once the stream caught up.
  auto have = [&] { return for_stream ? a.idle_bytes_at_most(target) : a.idle_bytes(); };
  while (id != arena::no_chunk && have() < target) {
    bool busy = false;
    const bool larger = for_stream && a.get(id).size > target - have();
    if (status s = release_chunk(id, keep_handle, wait, busy, for_stream); !s.ok()) return s;
    // A chunk larger than what is missing ends the eviction: evicting more would only cut up
    // other spans (and, under GPU lag, hold their memory twice). Replays of three PyTorch
    // traces with the GPU 100 and 1000 events behind: 1 to 10 % less peak memory.
    if (larger && !busy) break;
    // A release may unmap several chunks (a stitched huge block): restart from the list head,
    // past the busy ones.
    id = busy ? a.get(id).lru_next : a.oldest_free_chunk(hid);
    while (!busy && id != arena::no_chunk && pending(id, for_stream) == pending_other) id = a.get(id).lru_next;
  }
  return {};
}

int heap::impl::pending(std::uint32_t id, const stream_t* for_stream, bool note_streams) {
  auto& c = a.get(id);
  int p = pending_none;
  auto note = [&](block* b) {
    if (!(b->flags & f_tagged) || fence_covers(b->stream, b->free_seq)) return;
    p = (p != pending_other && for_stream && b->stream == *for_stream) ? pending_same : pending_other;
    if (note_streams) waits.push_back(b->stream);
  };
  if (c.owner == kOwnerHuge) {
    block* b = block_at(c.va);
    if (!b) b = block_containing(c.va);  // stitched huge block starting in an earlier chunk
    note(b);
    return p;
  }
  for (block* b = block_containing(c.va); b && b->addr < c.va + c.size && (p != pending_other || note_streams);
       b = b->next_phys)
    note(b);
  return p;
}

status heap::impl::release_chunk(std::uint32_t id, bool keep_handle, bool wait, bool& busy,
                                 const stream_t* for_stream) {
  // A chunk whose blocks only the requesting stream may still be using (the GPU running behind
  // the CPU) is retired rather than skipped: its handle serves this stream's request at once, its
  // old VA is unmapped once the stream's fence completes. Skipping it would create new memory
  // instead, a third more at the peak of a real training process.
  bool retire = false;
  if (wait && defer_waits && pending(id, nullptr, true) != pending_none) {
    busy = true;  // its streams are waited for outside the lock, then the call comes again
    return {};
  }
  if (!wait) {
    const int p = pending(id, for_stream);
    // The retired range's fence is recorded on the requesting stream: not while it captures.
    retire = p == pending_same && keep_handle && !a.drv().capturing(*for_stream);
    busy = p == pending_other || (p == pending_same && !retire);
    if (busy) return {};
  }
  auto& c = a.get(id);
  assert(c.used == 0);
  ++st.chunk_releases;
  next_growth = G;  // memory pressure: grow gently again
  if (c.owner == kOwnerHuge) {
    block* b = block_at(c.va);
    if (!b) b = block_containing(c.va);
    return release_huge(b, keep_handle, retire ? for_stream : nullptr);
  }
  std::uintptr_t cs = c.va, ce = c.va + c.size;
  block* first = block_containing(cs);
  block* last = first;
  while (last->addr + last->size < ce) last = last->next_phys;
  if (retire) {
    auto f = a.drv().record_fence(*for_stream);  // the unmap of the old VA waits for it
    if (!f.ok()) {
      busy = true;  // cannot order the reuse: leave the chunk as it is
      return {};
    }
    a.retire_chunk(id, f.value, *for_stream);
    ++st.chunks_retired;
  } else {
    for (block* b = first;; b = b->next_phys) {  // wait only for this chunk's streams
      assert(b->flags & f_free);
      if (b->flags & f_tagged) {
        status w = wait_covered(b->stream, b->free_seq);
        if (!w.ok()) return w;
      }
      if (b == last) break;
    }
    a.give_back_chunk(id, keep_handle);
  }
  // Cut [cs, ce) out of the span: split the edges, drop the middle, fix the span ends.
  for (block* b = first;; b = b->next_phys) {
    remove_free(b);
    if (b == last) break;
  }
  block* left = nullptr;
  block* right = nullptr;
  if (first->addr < cs) {
    left = first;
    first = split(first, cs);
    if (last == left) last = first;
  }
  if (last->addr + last->size > ce) right = split(last, ce);
  block* pred = first->prev_phys;
  block* succ = last->next_phys;
  for (block* b = first;;) {
    block* nx = b->next_phys;
    bool end = b == last;
    unlink_page(b);
    delete_block(b);
    if (end) break;
    b = nx;
  }
  bool succ_is_end = succ->flags & f_sentinel;
  if (pred) {
    block* s;
    if (succ_is_end) {  // nothing right of the chunk: the old sentinel moves to cs
      span_ends.erase(succ->addr);
      s = succ;
    } else {
      s = new_block();
      s->flags = f_sentinel;
      succ->prev_phys = nullptr;
    }
    s->addr = cs;
    s->prev_phys = pred;
    pred->next_phys = s;
    span_ends[cs] = s;
  } else if (succ_is_end) {
    span_ends.erase(succ->addr);
    delete_block(succ);
  } else {
    succ->prev_phys = nullptr;
  }
  if (left) insert_free(left);
  if (right) insert_free(right);
  return {};
}

void heap::impl::maybe_release() {
  if (private_pool) return;
  const std::size_t keep = a.opts().release_threshold;
  if (a.free_chunk_bytes() + a.idle_bytes() <= keep) return;  // the common case: two loads
  a.release_idle(keep > a.free_chunk_bytes() ? keep - a.free_chunk_bytes() : 0);  // allocator-wide: the option is
  std::uint32_t id = a.oldest_free_chunk(hid);
  while (a.free_chunk_bytes() + a.idle_bytes() > keep && id != arena::no_chunk) {
    bool busy = false;
    if (!release_chunk(id, false, false, busy).ok()) break;
    id = busy ? a.get(id).lru_next : a.oldest_free_chunk(hid);
  }
}

}  // namespace vmm
