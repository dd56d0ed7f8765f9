// SPDX-License-Identifier: Apache-2.0
// Small sizes: size classes served from slabs (a block of one to eight units, G / 8 each, carved
// into equal slots), and the thread-cache protocol the front end uses to take and return slots
// without the heap lock.
#include "heap/heap_impl.hpp"

namespace vmm {


result<heap::impl::slab*> heap::impl::new_slab(std::uint32_t cls, stream_t x) {
  const std::size_t bytes = slab_size(cls);
  const auto units = static_cast<unsigned>(bytes / U);
  // The first run of free units, aligned to the slab's size, in a slab page of this stream.
  slab_page* pg = nullptr;
  unsigned at = 0;
  for (auto& [va, e] : slab_pages) {
    if (e.stream != x) continue;
    for (at = 0; at < kUnitsPerPage; at += units)
      if (!(e.used & unit_bits(units, at))) break;
    if (at < kUnitsPerPage) {
      pg = &e;
      break;
    }
  }
  if (!pg) {
    auto r = allocate_large(G, G, x);
    if (!r.ok() || !r.value) return {nullptr, r.st};  // no page: a growth planned, or an error
    r.value->flags = f_slab;
    pg = &slab_pages[r.value->addr];
    pg->blk = r.value;
    pg->stream = x;
    at = 0;
    st.slab_bytes += G;
  }
  pg->used |= unit_bits(units, at);
  block* b = pg->blk;
  const std::uintptr_t base = b->addr + at * U;
  slab* s = nullptr;
  if (!spare_slabs.empty()) {
    s = spare_slabs.back();
    spare_slabs.pop_back();
  } else {
    slab_objects.push_back(std::make_unique<slab>());  // host memory: G / 256 x 6 B of arrays
    s = slab_objects.back().get();
    s->state.reset(G / kUnit);
    s->req.reset(G / kUnit);
  }
  // Set up under the seqlock: a lock-free reader that sees seq change takes the locked path. The
  // fields are stored with release (not a fence, which TSan cannot follow): a reader that loads a
  // new value (acquire) then sees the odd seq. Plain stores and loads on x86.
  const std::uint32_t seq = s->seq.load(std::memory_order_relaxed) + 1;
  s->seq.store(seq, std::memory_order_relaxed);
  const std::uint32_t slot = class_size[cls];
  constexpr auto rel = std::memory_order_release;
  std::atomic_ref(s->base).store(base, rel);
  std::atomic_ref(s->stream).store(x, rel);
  std::atomic_ref(s->cls).store(cls, rel);
  std::atomic_ref(s->slot).store(slot, rel);
  std::atomic_ref(s->nslots).store(static_cast<std::uint32_t>(bytes / slot), rel);
  std::atomic_ref(s->inv).store(((std::uint64_t{1} << 40) + slot - 1) / slot, rel);
  s->tag = static_cast<std::uint16_t>((((seq + 1) >> 1) & 0xff) << 8);
  s->blk = b;
  s->bytes = bytes;
  s->used = 0;
  s->owner = 0;
  s->prev = s->next = nullptr;
  s->listed = false;
  s->free.resize(s->nslots);
  for (std::uint32_t i = 0; i < s->nslots; ++i) {
    s->free[i] = s->nslots - 1 - i;
    s->set(i, slot_free);
    s->set_requested(i, 0);
  }
  s->seq.store(seq + 1, std::memory_order_release);
  for (std::size_t u = unit_of(base), e = u + units; u < e; ++u) slabs_by_unit.set(u, s);
  ++st.slabs;
  return {s, {}};
}

void heap::impl::destroy_slab(slab* s) {
  auto& heads = heads_for(s->stream);
  if (s->listed) list_remove(heads, s);
  const auto units = static_cast<unsigned>(s->bytes / U);
  for (std::size_t u = unit_of(s->base), e = u + units; u < e; ++u) slabs_by_unit.set(u, nullptr);
  --st.slabs;
  auto it = slab_pages.find(s->blk->addr);
  assert(it != slab_pages.end());
  it->second.used &= static_cast<std::uint8_t>(~unit_bits(units, static_cast<unsigned>((s->base - s->blk->addr) / U)));
  s->bytes = 0;  // parked (destroy_empty_slabs, occupancy skip it)
  if (!it->second.used) {  // the page's last slab: back to the span
    st.slab_bytes -= G;
    block* b = it->second.blk;
    slab_pages.erase(it);
    free_large(b, s->stream);
  }
  spare_slabs.push_back(s);  // never freed: a racing lock-free free may still read it
}

result<std::uintptr_t> heap::impl::allocate_small(std::size_t n, stream_t x, std::uint8_t state) {
  std::uint32_t cls = class_of_units[(n + kUnit - 1) / kUnit];
  return allocate_class(cls, n, x, state);
}

heap::impl::slab* heap::impl::pick_slab(slab* head, std::uint64_t tag) {
  if (!tag) return head;
  int scanned = 0;
  for (slab* s = head; s && scanned < 8; s = s->next, ++scanned)
    if (s->owner == tag || s->owner == 0 || !live_tags.count(s->owner)) {
      s->owner = tag;
      return s;
    }
  return nullptr;  // every candidate belongs to another live thread: make a new slab
}

result<std::uintptr_t> heap::impl::allocate_class(std::uint32_t cls, std::size_t n, stream_t x, std::uint8_t state, std::uint64_t tag) {
  auto& heads = heads_for(x);
  slab* s = pick_slab(heads[cls], tag);
  if (!s) {
    if (!deferred_frees.empty()) poll_deferred();
    s = pick_slab(heads[cls], tag);
    if (!s) {
      auto r = new_slab(cls, x);
      if (!r.ok() || !r.value) return {0, r.st};
      s = r.value;
      s->owner = tag;
      list_push(heads, s);
    }
  }
  std::uint32_t i = s->free.back();  // pop a free slot: the fast path
  s->free.pop_back();
  ++s->used;
  s->set_requested(i, static_cast<std::uint32_t>(n));  // before the state: a stale free may claim the slot at once
  s->set(i, state);
  if (s->free.empty()) list_remove(heads, s);
  note_alloc(n, s->slot);
  return {s->base + std::uintptr_t{i} * s->slot, {}};
}

std::vector<class_occupancy> heap::occupancy() const {
  auto& m = *p_;
  std::vector<class_occupancy> v(m.class_size.size());
  for (std::size_t c = 0; c < v.size(); ++c) v[c].slot_size = m.class_size[c];
  for (auto& obj : m.slab_objects) {
    const impl::slab* s = obj.get();
    if (!s->bytes) continue;  // parked
    auto& o = v[s->cls];
    ++o.slabs;
    o.slots += s->nslots;
    o.used_slots += s->used;
    for (std::uint32_t i = 0; i < s->nslots; ++i) {
      const auto st = s->get(i);
      if (st == impl::slot_user || st == impl::slot_user_recorded) o.live_bytes += s->requested(i);
      if (st == impl::slot_cached) ++o.cached_slots;
    }
  }
  return v;
}

int heap::small_class(std::size_t n) const noexcept {
  if (n == 0 || n > p_->small_limit()) return -1;
  return p_->class_of_units[(n + kUnit - 1) / kUnit];
}

std::size_t heap::class_size(int cls) const noexcept { return p_->class_size[static_cast<std::size_t>(cls)]; }

bool heap::small_slot(std::uintptr_t p, slot_ref& r) const noexcept {
  auto& m = *p_;
  if (!m.a.contains(p)) return false;
  impl::slab* sl = m.slab_of(p);
  if (!sl) return false;
  // Seqlock read: the slab may be set up again for another page or class by a thread holding the
  // lock (trim, growth). A read that overlaps that returns false; the state word's tag then stops
  // a compare-exchange on an entry read from an older incarnation.
  const std::uint32_t seq = sl->seq.load(std::memory_order_acquire);
  if (seq & 1) return false;
  // Acquire loads (see new_slab): a value of a newer incarnation makes the seq below differ.
  constexpr auto acq = std::memory_order_acquire;
  const std::uintptr_t base = std::atomic_ref(sl->base).load(acq);
  const std::uint32_t slot = std::atomic_ref(sl->slot).load(acq);
  const std::uint32_t nslots = std::atomic_ref(sl->nslots).load(acq);
  const std::uint64_t inv = std::atomic_ref(sl->inv).load(acq);
  r.cls = std::atomic_ref(sl->cls).load(acq);
  r.stream = std::atomic_ref(sl->stream).load(acq);
  if (sl->seq.load(std::memory_order_relaxed) != seq) return false;
  const std::uintptr_t off = p - base;
  const auto i = static_cast<std::uint32_t>((off * inv) >> 40);  // no division on the free path
  if (off >= m.G || std::uintptr_t{i} * slot != off || i >= nslots) return false;
  r.state = &sl->state[i];
  r.req = &sl->req[i];
  r.size = slot;
  r.tag = static_cast<std::uint16_t>((((seq >> 1)) & 0xff) << 8);
  r.seq = &sl->seq;
  r.seq_at = seq;
  return true;
}

void heap::set_cache_tag(std::uint64_t tag, bool alive) {
  if (alive) p_->live_tags.insert(tag); else p_->live_tags.erase(tag);
}

heap::outcome heap::refill(int cls, stream_t s, std::uintptr_t* out, std::size_t max, std::uint64_t tag,
                           grow_mode g, std::size_t& got) {
  auto& m = *p_;
  m.begin_request(g);
  outcome o;
  for (got = 0; got < max; ++got) {
    auto r = m.allocate_class(static_cast<std::uint32_t>(cls), 0, s, 2, tag);
    if (!r.ok() || !r.value) {
      o.st = r.st;
      break;
    }
    out[got] = r.value;
  }
  if (got) o.st = {};  // the slots handed out stand, whatever stopped the refill
  o.grows = m.planned;
  return o;
}

void heap::flush(const std::uintptr_t* ps, std::size_t n) {
  auto& m = *p_;
  for (std::size_t k = 0; k < n; ++k) {
    impl::slab* sl = m.slab_of(ps[k]);
    auto i = static_cast<std::uint32_t>((ps[k] - sl->base) / sl->slot);
    assert(sl->get(i) == impl::slot_cached && sl->requested(i) == 0);
    sl->set(i, impl::slot_free);
    m.note_free(0, sl->slot);
    m.release_slot(sl, i);
  }
  m.maybe_release();
}

}  // namespace vmm
