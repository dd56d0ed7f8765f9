// SPDX-License-Identifier: Apache-2.0
// heap: the entry points (allocate, deallocate, trim, stats). The state and its operations are
// split by concept; heap_impl.hpp says which file holds what.
#include "heap/heap_impl.hpp"

#include <utility>

namespace vmm {


heap::impl::impl(arena& ar, std::uint16_t id)
    : a(ar), hid(id), G(ar.granularity()), U(G / kUnitsPerPage), unit_shift(static_cast<unsigned>(std::countr_zero(U))),
      pages(ar.pages()), slabs_by_unit(ar.reservation_size() / U) {
  next_growth = G;
  // An ipc policy puts every allocation on chunks of its own (an importer must map nothing
  // else): no size classes, everything takes the huge path. Costs up to G - 1 bytes a block.
  std::size_t small_max = whole_chunks() ? 0 : std::min<std::size_t>(ar.tune().small_max, G / kUnitsPerPage);
  small_max = small_max / kUnit * kUnit;
  for (std::size_t s = kUnit; s <= std::min<std::size_t>(2048, small_max); s += kUnit)
    class_size.push_back(static_cast<std::uint32_t>(s));
  for (std::size_t oct = 2048; oct < small_max; oct *= 2)
    for (std::size_t i = 1; i <= 4; ++i) {
      std::size_t s = oct + oct / 4 * i;
      if (s <= small_max) class_size.push_back(static_cast<std::uint32_t>(s));
    }
  class_of_units.assign(small_max / kUnit + 1, 0);
  std::size_t c = 0;
  for (std::size_t u = 1; u < class_of_units.size(); ++u) {
    while (class_size[c] < u * kUnit) ++c;
    class_of_units[u] = static_cast<std::uint8_t>(c);
  }
}

heap::heap(arena& a, std::uint16_t id) : p_(std::make_unique<impl>(a, id)) {}

heap::~heap() {
  for (auto& d : p_->deferred_frees)
    p_->drop_fences(d.fences);
  for (auto& [s, ss] : p_->streams)
    if (ss.fence) p_->a.drv().drop_fence(ss.fence);
}

heap::outcome heap::allocate(std::size_t n, std::size_t align, stream_t s, grow_mode g) {
  auto& m = *p_;
  m.begin_request(g);
  // After a growth the driver refused, what this heap holds free goes back first: the growth
  // that follows maps those handles, and is exactly the request's size (grow()).
  if (g == grow_mode::last_resort && n <= m.a.reservation_size()) (void)m.reclaim();
  result<std::uintptr_t> r = allocate_once(n, align, s);
  // Out of memory (the policy's limit, the reservation) while memory this heap holds is free:
  // give it back and try once more, as PyTorch's caching allocator frees its cache before it
  // raises. Only on this failure path: the common path never pays for it.
  if (!r.ok() && r.st.kind == errc::out_of_memory && g != grow_mode::never && n <= m.a.reservation_size() &&
      m.reclaim())
    r = allocate_once(n, align, s);
  outcome o;
  if (!r.ok()) o.st = r.st;
  else o.addr = r.value;
  o.grows = !o.addr && o.st.ok() && m.planned;
  return o;
}

result<std::uintptr_t> heap::allocate_once(std::size_t n, std::size_t align, stream_t s) {
  auto& m = *p_;
  if (n == 0) return {0, fail(errc::invalid_value, "size 0")};
  if (align == 0 || (align & (align - 1))) return {0, fail(errc::invalid_value, "alignment is not a power of two")};
  if (align > m.G) return {0, fail(errc::invalid_value, "alignment larger than the granularity")};
  if (n > m.a.reservation_size()) return {0, fail(errc::out_of_memory, "size larger than the reservation")};
  align = std::max(align, kUnit);
  if (n <= m.small_limit() && align <= kUnit) return m.allocate_small(n, s);
  const bool huge = (n >= m.a.tune().huge_threshold || m.whole_chunks()) && align <= m.G;
  result<impl::block*> r = huge ? m.allocate_huge(n, align, s) : m.allocate_large(n, align, s);
  if (!r.ok() || !r.value) return {0, r.st};  // an error, or no block (a growth planned, or none)
  m.note_alloc(n, r.value->size);
  return {r.value->addr, {}};
}

status heap::deallocate(std::uintptr_t p, stream_t s) {
  auto& m = *p_;
  if (!m.a.contains(p)) return fail(errc::invalid_pointer, "pointer not from this allocator");
  if (impl::slab* sl = m.slab_of(p)) {
    std::uintptr_t off = p - sl->base;
    std::uint32_t i = static_cast<std::uint32_t>(off / sl->slot);
    if (off % sl->slot || i >= sl->nslots) return fail(errc::invalid_pointer, "interior pointer (not the start of an allocation)");
    const std::uint8_t state = sl->get(i);
    if (state == impl::slot_free) return fail(errc::invalid_pointer, "double free (block is not allocated)");
    if (state == impl::slot_cached)
      return fail(errc::invalid_pointer, "double free (block is already freed into a thread cache)");
    // Fences first: if one cannot be recorded the free is refused and the block stays allocated.
    // The slab's stream reuses slots at once, so a free on another stream waits for that stream.
    std::vector<stream_t> wait_on;
    auto extra = m.extra_streams.find(p);
    if (extra != m.extra_streams.end()) wait_on = extra->second;
    if (s != sl->stream) wait_on.push_back(s);
    std::vector<fence_t> fences;
    std::vector<stream_t> later;
    if (status r = m.record_fences(wait_on, fences, later); !r.ok()) return r;
    // Claim the slot: a thread-cache free of the same pointer racing this one (a caller's bug)
    // sees the state change and reports a double free instead of both succeeding.
    if (!sl->swap(i, state, impl::slot_free))
      return m.drop_fences(fences), fail(errc::invalid_pointer, "double free (freed concurrently by another thread)");
    if (extra != m.extra_streams.end()) m.extra_streams.erase(extra);
    m.note_free(sl->requested(i), sl->slot);
    sl->set_requested(i, 0);
    if (!fences.empty() || !later.empty()) {
      m.deferred_frees.push_back({p, s, std::move(fences), std::move(later)});
      ++m.st.deferred;
      return {};
    }
    m.release_slot(sl, i);
    return {};
  }
  impl::block* b = m.block_at(p);
  if (!b || (b->flags & (impl::f_slab | impl::f_sentinel)))
    return fail(errc::invalid_pointer,
                m.block_containing(p) ? "interior pointer or double free (no allocation starts here)"
                                      : "pointer not allocated");
  if (b->flags & impl::f_free) return fail(errc::invalid_pointer, "double free (block is not allocated)");
  for (auto& d : m.deferred_frees)
    if (d.p == p) return fail(errc::invalid_pointer, "double free (free already pending)");
  // A block a thread cache handed out: claim it from the cache protocol first (a racing fast-path
  // free of the same pointer, a caller's bug, then loses cleanly).
  if (std::uint64_t w = b->tword.load(std::memory_order_acquire); (w & 0xff) != 0) {
    if ((w & 0xff) >= 2) return fail(errc::invalid_pointer, "double free (block is already freed into a thread cache)");
    if (!b->tword.compare_exchange_strong(w, w & ~std::uint64_t{0xff}, std::memory_order_acq_rel))
      return fail(errc::invalid_pointer, "double free (freed concurrently by another thread)");
  }
  if (auto it = m.extra_streams.find(p); it != m.extra_streams.end()) {
    std::vector<fence_t> fences;  // refused: the block stays allocated, record_stream state intact
    std::vector<stream_t> later;
    if (status r = m.record_fences(it->second, fences, later); !r.ok()) return r;
    m.extra_streams.erase(it);
    m.note_free(b->requested(), b->size);
    if (!fences.empty() || !later.empty()) {
      b->set_requested(0);
      m.deferred_frees.push_back({p, s, std::move(fences), std::move(later)});
      ++m.st.deferred;
      return {};
    }
    if (b->flags & impl::f_huge) m.free_huge(b, s); else m.free_large(b, s);
    m.maybe_release();
    return {};
  }
  m.note_free(b->requested(), b->size);
  if (b->flags & impl::f_huge) m.free_huge(b, s); else m.free_large(b, s);
  m.maybe_release();
  return {};
}

std::size_t heap::usable_size(std::uintptr_t p) const {
  auto& m = *p_;
  if (!m.a.contains(p)) return 0;
  if (impl::slab* sl = m.slab_of(p)) {
    std::uintptr_t off = p - sl->base;
    std::uint32_t i = static_cast<std::uint32_t>(off / sl->slot);
    if (off % sl->slot || i >= sl->nslots) return 0;
    const auto state = sl->get(i);
    if (state != impl::slot_user && state != impl::slot_user_recorded) return 0;
    return sl->slot;
  }
  impl::block* b = m.block_at(p);
  if (!b || (b->flags & (impl::f_free | impl::f_slab | impl::f_sentinel))) return 0;
  if ((b->tword.load(std::memory_order_acquire) & 0xff) >= 2) return 0;  // freed into a thread cache
  for (auto& d : m.deferred_frees)
    if (d.p == p) return 0;
  return b->size;
}

std::size_t heap::requested_size(std::uintptr_t p) const {
  auto& m = *p_;
  if (!usable_size(p)) return 0;
  if (impl::slab* sl = m.slab_of(p))
    return sl->requested(static_cast<std::uint32_t>((p - sl->base) / sl->slot));
  return m.block_at(p)->requested();
}

bool heap::impl::reclaim() {
  if (private_pool) return false;
  const std::size_t before = a.idle_bytes() + a.free_chunk_bytes(hid);
  const std::uint64_t slabs_before = st.slabs, deferred_before = st.deferred;
  poll_deferred();
  (void)a.retry_strays();
  (void)a.poll_retiring(true, defer_waits ? &waits : nullptr);
  destroy_empty_slabs();
  // Every wholly free chunk becomes an idle handle (waiting for the fences of its blocks' streams:
  // this is the out-of-memory path, not the hot path); the retry maps those handles where it
  // needs them and releases the ones that do not fit before it creates anything.
  if (!evict_free_chunks(~std::size_t{0}, true, true).ok()) return false;
  ++st.reclaims;
  return a.idle_bytes() + a.free_chunk_bytes(hid) != before || st.slabs != slabs_before ||
         st.deferred != deferred_before || a.idle_bytes() != 0;
}

bool heap::impl::relieve_pressure(std::size_t want, stream_t x) {
  const std::size_t margin = a.opts().free_memory_margin;
  if (margin == 0 || private_pool) return false;
  auto mi = a.drv().mem_info();
  if (!mi.ok() || mi.value.free >= margin + want) return false;
  ++st.margin_trims;
  poll_deferred();
  destroy_empty_slabs();
  // Free chunks become idle handles (those of other streams' unfinished work stay): the growth
  // maps what fits its request, the rest is released after it.
  (void)evict_free_chunks(~std::size_t{0}, true, false, &x);
  return true;
}

void heap::impl::destroy_empty_slabs() {
  std::vector<slab*> empty;
  for (auto& s : slab_objects)
    if (s->bytes && s->used == 0) empty.push_back(s.get());
  for (auto* s : empty) destroy_slab(s);
}

status heap::trim(std::size_t keep) {
  auto& m = *p_;
  if (m.private_pool) return {};
  ++m.st.trims;
  m.grows_at_trim = m.st.grows;
  m.poll_deferred();
  const status retried = m.a.retry_strays();  // a refusal stays parked (retried again later)
  m.destroy_empty_slabs();  // first: they pin chunks that are otherwise free
  // Retired ranges: their streams' work first, then the VA back.
  status r = m.a.poll_retiring(true, m.defer_waits ? &m.waits : nullptr);
  const std::uint16_t h = m.hid;
  std::uint32_t id = m.a.oldest_free_chunk(h);
  while (r.ok() && m.a.free_chunk_bytes(h) + m.a.idle_bytes() > keep) {
    if (m.a.idle_bytes()) {
      m.a.release_idle(keep > m.a.free_chunk_bytes(h) ? keep - m.a.free_chunk_bytes(h) : 0);
      if (m.a.free_chunk_bytes(h) + m.a.idle_bytes() <= keep) break;
    }
    if (id == arena::no_chunk) break;
    bool busy = false;  // only while waits are deferred: a chunk a stream still uses is skipped
    r = m.release_chunk(id, false, true, busy);
    id = busy ? m.a.get(id).lru_next : m.a.oldest_free_chunk(h);
  }
  // The driver's refusals of the job this plans are the caller's to read once it ran
  // (arena::take_parked_error); the first error wins.
  return !r.ok() ? r : retried;
}

void heap::defer_waits(bool on) { p_->defer_waits = on && !p_->private_pool; }

std::vector<stream_t> heap::take_waits() { return std::exchange(p_->waits, {}); }

std::uint64_t heap::order_point() const { return p_->seq; }

void heap::note_waited(stream_t s, std::uint64_t point) {
  auto& ss = p_->streams[s];
  ss.completed_seq = std::max(ss.completed_seq, point + 1);  // a fence recorded at `point` completed
}

heap::outcome heap::allocate_cacheable(std::size_t n, std::size_t align, stream_t s, grow_mode g, block_ref& ref) {
  outcome r = allocate(n, align, s, g);
  if (!r.addr) return r;
  impl::block* b = p_->block_at(r.addr);
  if (!b) return r;  // a slot (small size): not cacheable here; ref stays empty
  ref.blk = b;
  // A new generation for every hand-out: a block freed and handed out again in the same struct
  // must not match a reference another thread's cache kept from before.
  ref.gen = ((b->tword.load(std::memory_order_relaxed) >> 8) + 1) << 8;
  ref.size = b->size;
  ref.stream = s;
  b->tword.store(ref.gen | 1, std::memory_order_release);  // the user's, through a thread cache
  // Its requested bytes are the thread cache's to count (as for the slots caches hand out): the
  // block keeps n, so a free on another thread's locked path subtracts it (mod 2^64, as there).
  p_->st.requested -= n;
  return r;
}

bool heap::cache_claim(const block_ref& r) {
  auto* b = static_cast<impl::block*>(r.blk);
  // 1 -> 3, then 2 in cache_publish: requested is 0 before the block can be taken back
  // (cache_return from another thread's growth frees it with the requested bytes it holds, which
  // the cache no longer counts).
  std::uint64_t e = r.gen | 1;
  if (!b->tword.compare_exchange_strong(e, r.gen | 3, std::memory_order_acq_rel)) return false;
  b->set_requested(0);
  return true;
}

void heap::cache_publish(const block_ref& r) {
  static_cast<impl::block*>(r.blk)->tword.store(r.gen | 2, std::memory_order_release);
}

bool heap::cache_reuse(const block_ref& r, std::size_t n) {
  auto* b = static_cast<impl::block*>(r.blk);
  // 2 -> 3 first: the heap may have taken the block back (cache_return from another thread), and
  // then n must not land on whatever the block is now. 3 -> 1 once n is set: a locked free that
  // sees state 1 reads n.
  std::uint64_t e = r.gen | 2;
  if (!b->tword.compare_exchange_strong(e, r.gen | 3, std::memory_order_acq_rel)) return false;
  b->set_requested(n);
  b->tword.store(r.gen | 1, std::memory_order_release);
  return true;
}

bool heap::cache_return(std::uintptr_t p, const block_ref& r) {
  auto* b = static_cast<impl::block*>(r.blk);
  std::uint64_t e = r.gen | 2;
  if (!b->tword.compare_exchange_strong(e, r.gen, std::memory_order_acq_rel)) return false;  // not cached
  (void)deallocate(p, r.stream);
  return true;
}


heap_stats heap::stats() const { return p_->st; }
std::uint16_t heap::id() const { return p_->hid; }
void heap::set_private(bool on) { p_->private_pool = on; }

void heap::reset_peaks() {
  p_->st.peak_requested = p_->st.requested;
  p_->st.peak_allocated = p_->st.allocated;
}

}  // namespace vmm
