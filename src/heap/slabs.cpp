// Small sizes: size classes served from slabs (one page carved into equal slots), and the
// thread-cache protocol the front end uses to take and return slots without the heap lock.
#include "heap/heap_impl.hpp"

namespace vmm {


result<heap::impl::slab*> heap::impl::new_slab(std::uint32_t cls, stream_t x) {
  auto r = allocate_large(G, G, x);
  if (!r.ok()) return {nullptr, r.st};
  block* b = r.value;
  b->flags = f_slab;
  auto s = std::make_unique<slab>();
  s->base = b->addr;
  s->blk = b;
  s->stream = x;
  s->cls = cls;
  s->slot = class_size[cls];
  s->nslots = static_cast<std::uint32_t>(G / s->slot);
  s->inv = ((std::uint64_t{1} << 40) + s->slot - 1) / s->slot;
  s->free.resize(s->nslots);
  for (std::uint32_t i = 0; i < s->nslots; ++i) s->free[i] = s->nslots - 1 - i;
  s->state.reset(s->nslots);  // zero-initialised: every slot free
  s->req.reset(s->nslots);
  pages[a.page_of(b->addr)].s.store(s.get(), std::memory_order_release);
  st.slab_bytes += G;
  ++st.slabs;
  return {s.release(), {}};
}

void heap::impl::destroy_slab(slab* s) {
  auto& heads = heads_for(s->stream);
  if (s->listed) list_remove(heads, s);
  pages[a.page_of(s->base)].s.store(nullptr, std::memory_order_release);
  st.slab_bytes -= G;
  --st.slabs;
  free_large(s->blk, s->stream);
  delete s;
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
      if (!r.ok()) return {0, r.st};
      s = r.value;
      s->owner = tag;
      list_push(heads, s);
    }
  }
  std::uint32_t i = s->free.back();  // pop a free slot: the fast path
  s->free.pop_back();
  ++s->used;
  s->state[i].store(state, std::memory_order_relaxed);
  s->req[i] = static_cast<std::uint32_t>(n);
  if (s->free.empty()) list_remove(heads, s);
  note_alloc(n, s->slot);
  return {s->base + std::uintptr_t{i} * s->slot, {}};
}

std::vector<class_occupancy> heap::occupancy() const {
  auto& m = *p_;
  std::vector<class_occupancy> v(m.class_size.size());
  for (std::size_t c = 0; c < v.size(); ++c) v[c].slot_size = m.class_size[c];
  // Every slab owns exactly one page: walking the page map visits each once. O(pages), a few
  // hundred microseconds for a device-sized reservation: a diagnostic, not for the hot path.
  for (auto& e : m.pages) {
    impl::slab* s = e.s.load(std::memory_order_acquire);
    if (!s) continue;
    auto& o = v[s->cls];
    ++o.slabs;
    o.slots += s->nslots;
    o.used_slots += s->used;
    for (std::uint32_t i = 0; i < s->nslots; ++i) {
      auto st = s->state[i].load(std::memory_order_relaxed);
      if (st == 1 || st == 3) o.live_bytes += s->req[i];
      if (st == 2) ++o.cached_slots;
    }
  }
  return v;
}

int heap::small_class(std::size_t n) const noexcept {
  if (n == 0 || n > p_->small_limit()) return -1;
  return p_->class_of_units[(n + kUnit - 1) / kUnit];
}

bool heap::small_slot(std::uintptr_t p, slot_ref& r) const noexcept {
  auto& m = *p_;
  if (!m.a.contains(p)) return false;
  impl::slab* sl = m.slab_at(m.a.page_of(p));
  if (!sl) return false;
  std::uintptr_t off = p - sl->base;
  std::uint32_t i = sl->index(off);  // no division on the free path
  if (std::uintptr_t{i} * sl->slot != off || i >= sl->nslots) return false;
  r.state = &sl->state[i];
  r.req = &sl->req[i];
  r.size = sl->slot;
  r.cls = sl->cls;
  r.stream = sl->stream;
  return true;
}

void heap::set_cache_tag(std::uint64_t tag, bool alive) {
  if (alive) p_->live_tags.insert(tag); else p_->live_tags.erase(tag);
}

std::size_t heap::refill(int cls, stream_t s, std::uintptr_t* out, std::size_t max, std::uint64_t tag) {
  std::size_t n = 0;
  for (; n < max; ++n) {
    auto r = p_->allocate_class(static_cast<std::uint32_t>(cls), 0, s, 2, tag);
    if (!r.ok()) break;
    out[n] = r.value;
  }
  return n;
}

void heap::flush(const std::uintptr_t* ps, std::size_t n) {
  auto& m = *p_;
  for (std::size_t k = 0; k < n; ++k) {
    impl::slab* sl = m.slab_at(m.a.page_of(ps[k]));
    auto i = static_cast<std::uint32_t>((ps[k] - sl->base) / sl->slot);
    assert(sl->state[i].load() == 2 && sl->req[i] == 0);
    sl->state[i].store(0, std::memory_order_relaxed);
    m.note_free(0, sl->slot);
    m.release_slot(sl, i);
  }
  m.maybe_release();
}

}  // namespace vmm
