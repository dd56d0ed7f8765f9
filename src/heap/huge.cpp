// SPDX-License-Identifier: Apache-2.0
// Huge blocks: dedicated chunks per allocation (sizes from tuning::huge_threshold, and every
// allocation of an exportable policy), handles of at most tuning::max_handle side by side (one for
// an exportable policy), cached on free for a same-size request, grown in place for a slightly
// larger one (VA headroom after each block: tuning::huge_headroom_div).
#include "heap/heap_impl.hpp"

namespace vmm {

status heap::impl::release_huge(block* b, bool keep_handle, const stream_t* retire_for) {
  assert(b && (b->flags & f_huge) && (b->flags & f_free));
  if (b->flags & f_exported) keep_handle = false, retire_for = nullptr;  // an importer may map it: never reuse
  if ((b->flags & f_tagged) && !retire_for) {
    status w = wait_covered(b->stream, b->free_seq);
    if (!w.ok()) return w;
  }
  // A huge block may be stitched from several chunks: unmap (or retire) from the end, shrinking
  // the block, so a failure part-way leaves a consistent (smaller) cached block.
  while (b->size) {
    std::uint32_t id = a.chunk_at(b->addr + b->size - 1);
    std::size_t cs = a.get(id).size;
    if (retire_for) {
      auto f = a.drv().record_fence(*retire_for);  // one per chunk (each retired range owns its fence); the caller checked the stream does not capture
      if (!f.ok()) return f.st;
      a.retire_chunk(id, f.value, *retire_for);
      ++st.chunks_retired;
    } else {
      a.give_back_chunk(id, keep_handle);
    }
    uncache_huge(b);
    b->size -= cs;
    if (b->size) huge_cache.emplace(b->size, b);
  }
  unlink_page(b);
  delete_block(b);
  return {};
}

void heap::impl::huge_to_spans(block* b, stream_t x) {
  const std::uintptr_t va = b->addr;
  const std::size_t size = b->size;
  // A freed block keeps its stream order; a fresh one (never handed out) is untagged.
  const bool tagged = b->flags & f_tagged;
  const stream_t s = tagged ? b->stream : x;
  const std::uint64_t fs = tagged ? b->free_seq : 0;
  for (std::uintptr_t c = va; c < va + size;) {
    auto& ch = a.get(a.chunk_at(c));
    ch.owner = kOwnerSpan;
    c += ch.size;
  }
  unlink_page(b);
  delete_block(b);
  add_span_range(va, size, s, fs);
}

void heap::impl::uncache_huge(block* b) {
  auto [lo, hi] = huge_cache.equal_range(b->size);
  for (auto it = lo; it != hi; ++it)
    if (it->second == b) {
      huge_cache.erase(it);
      return;
    }
}

result<heap::impl::block*> heap::impl::allocate_huge(std::size_t n, std::size_t align, stream_t x) {
  std::size_t size = round_up(n, G);
  if (size < n) return {nullptr, fail(errc::out_of_memory, "size overflows")};
  // The chunks a growth mapped for this request (adopt), whatever their size: a retired handle
  // larger than the request may have been mapped whole. Only a hint: still cached, or not used.
  if (block* f = std::exchange(fresh_huge, nullptr); f && f->size >= size) {
    auto [lo, hi] = huge_cache.equal_range(f->size);
    for (auto it = lo; it != hi; ++it)
      if (it->second == f && usable(f, x)) {
        huge_cache.erase(it);
        f->flags = f_huge;
        f->set_requested(n);
        f->stream = x;
        account(f->addr, f->size, true);
        return {f, {}};
      }
  }
  // A cached chunk of the same size (up to 1/8 larger) costs no driver call at all.
  for (auto it = huge_cache.lower_bound(size); it != huge_cache.end() && it->first <= size + size / 8; ++it) {
    block* b = it->second;
    if (!usable(b, x)) continue;
    huge_cache.erase(it);
    b->flags = f_huge;
    b->set_requested(n);
    b->stream = x;
    account(b->addr, b->size, true);
    return {b, {}};
  }
  // A cached block up to 1/8 smaller with unmapped VA after it grows in place: only the pages it
  // lacks are mapped (a tensor grown by torch.cat a token at a time frees a block one page short
  // of the next request every few tokens), not the whole block again.
  if (!whole_chunks() && mode != grow_mode::never)
    for (auto it = huge_cache.lower_bound(size - size / 8); it != huge_cache.end() && it->first < size; ++it) {
      block* b = it->second;
      const std::uintptr_t end = b->addr + b->size;
      if (!usable(b, x) || !a.hole_at(end, size - b->size)) continue;
      huge_cache.erase(it);  // reserved for this growth (see extending)
      account(b->addr, b->size, true);
      bool pressed = false;
      status e = prepare_growth(size - b->size, x, pressed);
      result<std::uintptr_t> r{0, e};
      if (e.ok()) r = a.map_range(size - b->size, end, kOwnerHuge, x, nullptr, hid, huge_piece(size - b->size), pressed);
      if (pressed) a.release_idle(0);
      if (r.ok()) {
        extending.emplace(end, b);
        planned = true;
        return {nullptr, {}};
      }
      account(b->addr, b->size, false);
      huge_cache.emplace(b->size, b);
      if (!e.ok()) return {nullptr, e};
      break;  // no room for it under the limit: the paths below
    }
  // Free span memory that fits costs no driver call; chunks of its own would (remapping free
  // chunks, or creating). Real training processes change shapes every step, and with them the
  // sizes of their largest blocks: the cache above misses, span memory is there.
  if (!whole_chunks()) {
    // The smallest larger cached block is split instead of remapped: no driver call, and the
    // rest stays span memory for the next shapes (training changes its largest blocks' sizes
    // every step). Remapping holds the same memory but moves every handle the request does not
    // cover: a T5 encoder that reshapes 2.4-4.8 GB blocks every layer remapped ~1,000 handles
    // a layer when only blocks up to twice the size were split.
    if (a.tune().split_cached_huge)
      for (auto it = huge_cache.upper_bound(size + size / 8); it != huge_cache.end(); ++it) {
        block* b = it->second;
        if (!usable(b, x)) continue;
        huge_cache.erase(it);
        huge_to_spans(b, x);
        break;
      }
    auto sp = allocate_large(n, align, x, false);
    if (!sp.ok() || sp.value) return sp;
  }
  if (mode == grow_mode::never) return {nullptr, {}};
  bool pressed = false;
  if (status e = prepare_growth(size, x, pressed); !e.ok()) return {nullptr, e};
  // Several handles let a split block's free ones serve later requests. An exportable block is
  // never split or reused, and each handle would cost an export: one handle, exactly its size.
  // Otherwise a retired handle larger than the request may be mapped whole (`got`): its memory is
  // held until its old range goes anyway; what is left beyond the request joins the spans.
  const std::size_t piece = huge_piece(size);
  const std::size_t d = whole_chunks() ? 0 : a.tune().huge_headroom_div;
  const std::size_t headroom = d ? size / d + G : 0;  // room to grow in place later
  std::size_t got = size;
  auto plan = [&] {
    return a.map_range(size, 0, kOwnerHuge, x, whole_chunks() ? nullptr : &got, hid, piece, pressed, headroom);
  };
  auto r = plan();
  if (!r.ok() && r.st.kind == errc::out_of_memory && a.free_chunk_bytes(hid)) {
    status e = evict_free_chunks(~std::size_t{0}, true, false, &x);
    if (!e.ok()) return {nullptr, e};
    r = plan();
  }
  if (pressed) a.release_idle(0);  // what the growth does not map goes back to the device
  if (!r.ok()) return {nullptr, r.st};
  planned = true;
  return {nullptr, {}};
}

void heap::impl::free_huge(block* b, stream_t s) {
  account(b->addr, b->size, false);
  const bool exported = b->flags & f_exported;
  b->flags = f_huge | f_free | f_tagged;
  b->stream = s;
  b->free_seq = ++seq;
  b->set_requested(0);
  if (!exported && limited()) {  // under a limit freed huge blocks join the spans
    huge_to_spans(b, s);  // any later request may split it, with no driver call
    return;
  }
  huge_cache.emplace(b->size, b);
  if (exported) {
    // An importer may still map these chunks: they must never hold another allocation. Unmap
    // and release them now (waits for s's work on the block); the importer's own handle keeps
    // the memory alive until it closes. A failure leaves the block cached, never handed out:
    if (!release_huge(b, false).ok()) b->flags |= f_exported;  // usable() refuses it below
    else ++st.exported_released;
  }
}

heap::impl::block* heap::impl::take_extending(std::uintptr_t end) {
  auto it = extending.find(end);
  if (it == extending.end()) return nullptr;
  block* b = it->second;
  extending.erase(it);
  account(b->addr, b->size, false);
  return b;
}

void heap::adopt(const arena::job& j) {
  auto& m = *p_;
  ++m.st.grows;
  if (j.owner == heap_detail::kOwnerHuge) {
    // A cached block grown in place, or a dedicated chunk, fresh: in the huge cache the retried
    // request finds it. Untagged (or as freed, when grown), unless a piece may still be written by
    // the stream's queued work (job::in_flight): then the whole block is that stream's, as if
    // freed on it now, and another stream takes it only behind a fence.
    impl::block* b = m.take_extending(j.va);
    if (b) {
      b->size += j.size;
    } else {
      b = m.new_block();
      b->addr = j.va;
      b->size = j.size;
      b->flags = impl::f_huge | impl::f_free;
      m.link_page(b);
    }
    if (j.in_flight) {
      b->flags |= impl::f_tagged;
      b->stream = j.stream;
      b->free_seq = ++m.seq;
    }
    m.huge_cache.emplace(b->size, b);
    m.fresh_huge = b;
    return;
  }
  m.add_span_range(j.va, j.size, j.stream, j.in_flight ? ++m.seq : 0);
  m.grown(j.pressed);
}

void heap::growth_refused(const arena::job& j) {
  auto& m = *p_;
  m.next_growth = m.G;
  if (impl::block* b = m.take_extending(j.va)) m.huge_cache.emplace(b->size, b);  // as it was
}

status heap::export_chunks(std::uintptr_t p, std::vector<std::uint32_t>& ids, std::size_t& bytes,
                           std::size_t& offset) {
  auto& m = *p_;
  if (m.a.props().ipc == ipc_kind::none)
    return fail(errc::not_supported, "export: the policy is not exportable (options.ipc is none)");
  std::uintptr_t from = 0, to = 0;  // the chunks covering [from, to) are exported
  if (!m.whole_chunks()) {
    // Blocks share chunks (tuning::ipc_whole_chunks off): the chunks under the block, neighbours and all.
    // Nothing is marked: the block is freed and its chunks reused as any other.
    const std::size_t n = usable_size(p);
    if (!n) return fail(errc::invalid_pointer, "export: pointer is not the start of a live allocation");
    from = m.a.get(m.a.chunk_at(p)).va;
    to = p + n;
    bytes = requested_size(p);
  } else {
    impl::block* b = m.a.contains(p) ? m.block_at(p) : nullptr;
    if (!b || !(b->flags & impl::f_huge) || (b->flags & impl::f_free))
      return fail(errc::invalid_pointer, "export: pointer is not the start of a live allocation");
    for (auto& d : m.deferred_frees)
      if (d.p == p) return fail(errc::invalid_pointer, "export: the allocation's free is pending");
    from = b->addr;  // a whole-chunk allocation starts its first chunk
    to = b->addr + b->size;
    bytes = b->requested();
    b->flags |= impl::f_exported;
  }
  offset = p - from;
  ids.clear();
  for (std::uintptr_t va = from; va < to;) {
    std::uint32_t id = m.a.chunk_at(va);
    ids.push_back(id);
    va += m.a.get(id).size;
  }
  return {};
}

}  // namespace vmm
