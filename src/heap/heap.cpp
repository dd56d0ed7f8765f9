// heap: size classes in slabs (small), TLSF good fit over spans (large), dedicated chunks (huge).
// See heap.hpp for the invariants and the stream rules.
#include "heap/heap.hpp"

#include <algorithm>
#include <atomic>
#include <bit>
#include <cassert>
#include <new>
#include <unordered_set>

namespace vmm {

namespace {
constexpr std::size_t kUnit = 256;  // minimum block size and alignment
constexpr int kSlLog2 = 5, kSlCount = 1 << kSlLog2, kFlCount = 48;
constexpr std::uint32_t kOwnerSpan = 0, kOwnerHuge = 1;

inline int msb(std::uint64_t x) { return 63 - __builtin_clzll(x); }
inline std::size_t align_up(std::size_t n, std::size_t a) { return (n + a - 1) & ~(a - 1); }
inline std::size_t round_up(std::size_t n, std::size_t g) { return (n + g - 1) / g * g; }
status fail(errc k, const char* name) { return {k, 0, name, "heap"}; }

// TLSF mapping over 256-byte units: sizes < 8 KiB map linearly, above that 32 lists per octave.
inline void mapping(std::size_t size, int& fl, int& sl) {
  std::uint64_t u = size / kUnit;
  if (u < kSlCount) {
    fl = 0;
    sl = static_cast<int>(u);
  } else {
    int m = msb(u);
    fl = m - kSlLog2 + 1;
    sl = static_cast<int>((u >> (m - kSlLog2)) - kSlCount);
  }
}
// Rounds up to the next list boundary so any block found there fits ("good fit", O(1)).
inline void search_mapping(std::size_t size, int& fl, int& sl) {
  std::uint64_t u = size / kUnit;
  if (u >= kSlCount) u += (std::uint64_t{1} << (msb(u) - kSlLog2)) - 1;
  mapping(u * kUnit, fl, sl);
}
}  // namespace

struct heap::impl {
  enum : std::uint8_t { f_free = 1, f_sentinel = 2, f_slab = 4, f_huge = 8, f_tagged = 16, f_exported = 32 };

  struct block {
    std::uintptr_t addr = 0;
    std::size_t size = 0;
    block* prev_phys = nullptr;  // neighbours in the span (null at the span's start)
    block* next_phys = nullptr;  // the span's sentinel after its last block
    block* prev_free = nullptr;  // TLSF list links (free blocks only)
    block* next_free = nullptr;
    block* page_prev = nullptr;  // chain of blocks starting in the same page (O(1) free lookup)
    block* page_next = nullptr;
    std::size_t requested = 0;   // bytes asked for (live blocks)
    stream_t stream = nullptr;   // live: allocating stream; free + f_tagged: freeing stream
    std::uint64_t free_seq = 0;  // value of seq when freed
    std::uint8_t flags = 0;
  };

  // Per-slot arrays written on the thread-cache hot path: each starts on its own cache line and
  // is padded to whole lines, so two threads' slabs never share a line (small classes have tiny
  // arrays that malloc would otherwise pack side by side: false sharing on every free).
  template <class T>
  struct line_array {
    T* p = nullptr;
    std::size_t bytes = 0;
    void reset(std::size_t n) {
      release();
      bytes = (n * sizeof(T) + 63) / 64 * 64;
      p = static_cast<T*>(::operator new(bytes, std::align_val_t{64}));
      for (std::size_t i = 0; i < n; ++i) new (&p[i]) T();
    }
    void release() {
      if (p) ::operator delete(p, std::align_val_t{64});
      p = nullptr;
    }
    ~line_array() { release(); }
    T& operator[](std::size_t i) const { return p[i]; }
  };

  struct alignas(64) slab {
    std::uintptr_t base = 0;
    block* blk = nullptr;
    stream_t stream = nullptr;
    std::uint32_t cls = 0, slot = 0, nslots = 0, used = 0;  // used counts live + deferred slots
    std::uint64_t inv = 0;  // ceil(2^40 / slot): index = off * inv >> 40, exact for off < 2^24
    std::uint32_t index(std::uintptr_t off) const { return static_cast<std::uint32_t>((off * inv) >> 40); }
    std::vector<std::uint32_t> free;   // stack of free slot indices: pop = O(1)
    // Per slot: 0 free, 1 the user's, 2 in a thread cache, 3 the user's with record_stream.
    // Atomic bytes: thread caches flip their own slots without the heap lock.
    line_array<std::atomic<std::uint8_t>> state;
    line_array<std::uint32_t> req;  // requested bytes per slot
    std::uint64_t owner = 0;  // thread cache that refills from it (0: none): no false sharing
    slab* prev = nullptr;              // class list of slabs with a free slot
    slab* next = nullptr;
    bool listed = false;
  };

  struct stream_state {
    fence_t fence = 0;
    std::uint64_t fence_seq = 0;  // the fence covers every free with free_seq < fence_seq
    bool done = true;
    // Frees with free_seq < completed_seq are known safe: a completed fence covered them. Kept
    // apart from the latest fence, so recording a newer one never makes them look busy again.
    std::uint64_t completed_seq = 0;
  };

  struct deferred {  // a free waiting for fences of extra streams (record_stream, cross-stream)
    std::uintptr_t p;
    stream_t s;
    std::vector<fence_t> fences;
  };

  struct page_entry {
    std::atomic<slab*> s{nullptr};  // read without the lock by the thread-cache free path
    block* starts = nullptr;
  };
  slab* slab_at(std::size_t pg) const { return pages[pg].s.load(std::memory_order_acquire); }

  arena& a;
  std::size_t G;
  std::vector<page_entry> pages;

  std::uint64_t fl_bitmap = 0;
  std::uint32_t sl_bitmap[kFlCount] = {};
  block* lists[kFlCount][kSlCount] = {};

  std::map<std::uintptr_t, block*> span_ends;        // sentinel address -> sentinel
  std::multimap<std::size_t, block*> huge_cache;     // free huge blocks by size
  std::unordered_map<stream_t, stream_state> streams;
  std::unordered_map<std::uintptr_t, std::vector<stream_t>> extra_streams;
  std::vector<deferred> deferred_frees;
  std::uint64_t seq = 0;
  std::size_t next_growth;

  // size classes: multiples of 256 up to 2 KiB, then 4 per octave, up to small_max
  std::vector<std::uint32_t> class_size;
  std::vector<std::uint8_t> class_of_units;  // index (n + 255) / 256
  std::unordered_map<stream_t, std::vector<slab*>> class_heads;
  stream_t last_stream = nullptr;
  std::vector<slab*>* last_heads = nullptr;

  // block pool: no malloc per split on the hot path
  std::vector<std::unique_ptr<block[]>> pool;
  std::vector<block*> pool_free;

  heap_stats st;

  explicit impl(arena& ar) : a(ar), G(ar.granularity()), pages(ar.pages()) {
    next_growth = ar.opts().min_chunk;
    // An ipc policy puts every allocation on chunks of its own (an importer must map nothing
    // else): no size classes, everything takes the huge path. Costs up to G - 1 bytes a block.
    std::size_t small_max = whole_chunks() ? 0 : std::min<std::size_t>(ar.opts().small_max, G / 8);
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

  std::size_t small_limit() const { return class_size.empty() ? 0 : class_size.back(); }
  bool whole_chunks() const { return a.whole_chunks(); }  // placement policy (ipc)

  // ---- block pool and page chains ----
  block* new_block() {
    if (pool_free.empty()) {
      constexpr std::size_t n = 256;
      pool.emplace_back(new block[n]);
      for (std::size_t i = 0; i < n; ++i) pool_free.push_back(&pool.back()[i]);
    }
    block* b = pool_free.back();
    pool_free.pop_back();
    *b = block{};
    return b;
  }
  void delete_block(block* b) { pool_free.push_back(b); }

  void link_page(block* b) {
    auto& e = pages[a.page_of(b->addr)];
    b->page_prev = nullptr;
    b->page_next = e.starts;
    if (e.starts) e.starts->page_prev = b;
    e.starts = b;
  }
  void unlink_page(block* b) {
    if (b->page_prev) b->page_prev->page_next = b->page_next;
    else pages[a.page_of(b->addr)].starts = b->page_next;
    if (b->page_next) b->page_next->page_prev = b->page_prev;
    b->page_prev = b->page_next = nullptr;
  }
  block* block_at(std::uintptr_t p) const {
    for (block* b = pages[a.page_of(p)].starts; b; b = b->page_next)
      if (b->addr == p) return b;
    return nullptr;
  }
  // Block whose range holds p (slow path: walks back over pages of a long block).
  block* block_containing(std::uintptr_t p) const {
    for (std::size_t pg = a.page_of(p);; --pg) {
      block* best = nullptr;
      for (block* b = pages[pg].starts; b; b = b->page_next)
        if (b->addr <= p && (!best || b->addr > best->addr)) best = b;
      if (best) return best->addr + best->size > p ? best : nullptr;
      if (pg == 0) return nullptr;
    }
  }

  // ---- TLSF free lists ----
  void insert_free(block* b) {
    int fl, sl;
    mapping(b->size, fl, sl);
    b->prev_free = nullptr;
    b->next_free = lists[fl][sl];
    if (b->next_free) b->next_free->prev_free = b;
    lists[fl][sl] = b;
    fl_bitmap |= std::uint64_t{1} << fl;
    sl_bitmap[fl] |= 1u << sl;
  }
  void remove_free(block* b) {
    int fl, sl;
    mapping(b->size, fl, sl);
    if (b->prev_free) b->prev_free->next_free = b->next_free;
    else lists[fl][sl] = b->next_free;
    if (b->next_free) b->next_free->prev_free = b->prev_free;
    b->prev_free = b->next_free = nullptr;
    if (!lists[fl][sl]) {
      sl_bitmap[fl] &= ~(1u << sl);
      if (!sl_bitmap[fl]) fl_bitmap &= ~(std::uint64_t{1} << fl);
    }
  }

  // ---- streams ----
  // Makes sure the stream's latest fence was recorded after free number seq_at_free.
  status fence_after(stream_state& ss, stream_t s, std::uint64_t seq_at_free) {
    if (ss.fence_seq > seq_at_free) return {};
    auto r = a.drv().record_fence(s);
    if (!r.ok()) return r.st;
    if (ss.fence) a.drv().drop_fence(ss.fence);
    ss.fence = r.value;
    ss.fence_seq = seq + 1;
    ss.done = false;
    return {};
  }
  void note_done(stream_state& ss) {
    ss.done = true;
    ss.completed_seq = std::max(ss.completed_seq, ss.fence_seq);
  }

  // Whether a fence recorded on s after free number `seq_at_free` has completed. Records the
  // fence lazily (first time another stream asks) and only queries it: never waits.
  bool fence_covers(stream_t s, std::uint64_t seq_at_free) {
    stream_state& ss = streams[s];
    if (seq_at_free < ss.completed_seq) return true;
    if (!fence_after(ss, s, seq_at_free).ok()) return false;
    if (ss.done || a.drv().fence_done(ss.fence)) note_done(ss);
    return ss.done;
  }
  // The same, but waits for that fence (slow path: unmapping). A fence that cannot be recorded is
  // an error, never "done".
  status wait_covered(stream_t s, std::uint64_t seq_at_free) {
    stream_state& ss = streams[s];
    if (seq_at_free < ss.completed_seq) return {};
    if (status r = fence_after(ss, s, seq_at_free); !r.ok()) return r;
    if (!ss.done && !a.drv().fence_done(ss.fence)) {
      status w = a.drv().wait_fence(ss.fence);  // only this stream, never the device
      if (!w.ok()) return w;
    }
    note_done(ss);
    return {};
  }
  bool usable(block* b, stream_t x) {
    if (b->flags & f_exported) return false;  // free but not yet released (see free_huge)
    return !(b->flags & f_tagged) || b->stream == x || fence_covers(b->stream, b->free_seq);
  }
  static bool compatible(const block* l, const block* r) {
    if (!(l->flags & f_free) || !(r->flags & f_free)) return false;
    if ((l->flags | r->flags) & f_sentinel) return false;
    bool lt = l->flags & f_tagged, rt = r->flags & f_tagged;
    return lt == rt && (!lt || l->stream == r->stream);
  }

  block* find_free(std::size_t size, stream_t x) {
    // The list holding `size` itself first (bounded scan): an exact or near-exact fit there keeps
    // big free blocks whole (closer to best fit than TLSF's good fit, which skips this list).
    int fl, sl, scanned = 0;
    mapping(size, fl, sl);
    for (block* b = lists[fl][sl]; b && scanned < 16; b = b->next_free, ++scanned)
      if (b->size >= size && usable(b, x)) return b;
    return find_good_fit(size, x);
  }

  block* find_good_fit(std::size_t size, stream_t x) {
    int fl, sl;
    search_mapping(size, fl, sl);
    while (fl < kFlCount) {
      std::uint32_t bits = sl_bitmap[fl] & (~0u << sl);
      if (!bits) {
        std::uint64_t fb = fl + 1 < 64 ? fl_bitmap & (~std::uint64_t{0} << (fl + 1)) : 0;
        if (!fb) return nullptr;
        fl = std::countr_zero(fb);
        bits = sl_bitmap[fl];
      }
      sl = std::countr_zero(bits);
      int scanned = 0;  // bounded scan: blocks held back by other streams' fences are skipped
      for (block* b = lists[fl][sl]; b && scanned < 16; b = b->next_free, ++scanned)
        if (b->size >= size && usable(b, x)) return b;
      if (++sl == kSlCount) sl = 0, ++fl;
    }
    return nullptr;
  }

  // ---- split, merge, chunk accounting ----
  block* split(block* b, std::uintptr_t at) {
    block* nb = new_block();
    nb->addr = at;
    nb->size = b->addr + b->size - at;
    nb->flags = b->flags & (f_free | f_tagged);
    nb->stream = b->stream;
    nb->free_seq = b->free_seq;
    nb->prev_phys = b;
    nb->next_phys = b->next_phys;
    if (b->next_phys) b->next_phys->prev_phys = nb;
    b->next_phys = nb;
    b->size = at - b->addr;
    link_page(nb);
    return nb;
  }
  void absorb(block* l, block* r) {  // l, r adjacent, neither in a free list
    l->size += r->size;
    l->free_seq = std::max(l->free_seq, r->free_seq);
    l->next_phys = r->next_phys;
    if (r->next_phys) r->next_phys->prev_phys = l;
    unlink_page(r);
    delete_block(r);
  }
  void account(std::uintptr_t addr, std::size_t size, bool add) {
    for (std::uintptr_t x = addr, end = addr + size; x < end;) {
      std::uint32_t id = a.chunk_at(x);
      auto& c = a.get(id);
      std::size_t n = std::min<std::uintptr_t>(end, c.va + c.size) - x;
      if (add) a.add_used(id, n); else a.sub_used(id, n);
      x += n;
    }
  }

  // ---- large path ----
  result<block*> allocate_large(std::size_t n, std::size_t align, stream_t x) {
    std::size_t size = align_up(std::max<std::size_t>(n, 1), kUnit);
    std::size_t need = size + (align > kUnit ? align - kUnit : 0);
    if (size < n || need < size) return {nullptr, fail(errc::out_of_memory, "size overflows")};
    block* b = find_free(need, x);
    if (!b) {
      status g = grow(need, x);
      if (!g.ok()) return {nullptr, g};
      b = find_free(need, x);
      if (!b) return {nullptr, fail(errc::out_of_memory, "no block fits after growth")};
    }
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
    b->requested = n;
    b->stream = x;
    account(b->addr, b->size, true);
    return {b, {}};
  }

  void free_large(block* b, stream_t s) {
    account(b->addr, b->size, false);
    b->flags = f_free | f_tagged;
    b->stream = s;
    b->free_seq = ++seq;
    b->requested = 0;
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

  // Adds mapped [va, va+size) to the spans: extends the span ending at va, or starts a new one.
  void add_span_range(std::uintptr_t va, std::size_t size, stream_t x) {
    block* nb = new_block();
    nb->addr = va;
    nb->size = size;
    nb->flags = f_free;
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
      link_page(nb);
      if ((tail->flags & f_free) && !(tail->flags & f_sentinel) && usable(tail, x)) {
        // Fresh memory takes the tail's stream tag so the two can serve one request.
        nb->flags = tail->flags & (f_free | f_tagged);
        nb->stream = tail->stream;
        nb->free_seq = tail->free_seq;
        remove_free(tail);
        absorb(tail, nb);
        nb = tail;
      }
    } else {
      block* s = new_block();
      s->addr = va + size;
      s->flags = f_sentinel;
      nb->next_phys = s;
      s->prev_phys = nb;
      span_ends[s->addr] = s;
      link_page(nb);
    }
    insert_free(nb);
  }

  status grow(std::size_t need, stream_t x) {
    ++st.grows;
    std::size_t size = round_up(need, G);
    if (a.opts().stitch_on_grow) {
      status e = evict_free_chunks(size, true);  // reuse wholly free chunks' physical memory
      if (!e.ok()) return e;
    }
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
    // Repeated growth is geometric (driver cost is per call), capped by max_growth.
    std::size_t geo = std::min(next_growth, std::max(a.opts().max_growth, G));
    std::size_t want = ext;
    if (want < geo && (!found || a.hole_at(at, geo))) want = geo;
    auto r = a.map_range(want, at, kOwnerSpan);
    if (!r.ok() && want != ext) {
      want = ext;
      r = a.map_range(want, at, kOwnerSpan);
    }
    if (!r.ok() && at) {  // the hole after the span is gone: start a new span
      want = size;
      r = a.map_range(want, 0, kOwnerSpan);
    }
    if (!r.ok() && r.st.kind == errc::out_of_memory && a.free_chunk_bytes()) {
      status e = evict_free_chunks(~std::size_t{0}, true);  // last resort: every idle-able chunk
      if (!e.ok()) return e;
      want = size;
      r = a.map_range(want, 0, kOwnerSpan);
    }
    if (!r.ok()) return r.st;
    add_span_range(r.value, want, x);
    next_growth = std::min(next_growth * 2, std::max(a.opts().max_growth, G));
    return {};
  }

  // ---- releasing chunks ----
  // Unmaps wholly free chunks, oldest first, until the arena holds `target` idle bytes (or none
  // are left). keep_handle: the physical memory stays for stitching; else it is released.
  // wait = false (growth, release threshold): chunks whose last stream is still running are
  // skipped, never waited for. wait = true (trim): waits for those chunks' fences only.
  status evict_free_chunks(std::size_t target, bool keep_handle, bool wait = false) {
    std::uint32_t id = a.oldest_free_chunk();
    while (id != arena::no_chunk && a.idle_bytes() < target) {
      bool busy = false;
      status s = release_chunk(id, keep_handle, wait, busy);
      if (!s.ok()) return s;
      // A release may unmap several chunks (a stitched huge block): restart from the list head,
      // past the busy ones.
      id = busy ? a.get(id).lru_next : a.oldest_free_chunk();
      while (!busy && id != arena::no_chunk && chunk_busy(id)) id = a.get(id).lru_next;
    }
    return {};
  }

  // Whether a free chunk still has a stream that may touch it (fence not known complete).
  bool chunk_busy(std::uint32_t id) {
    auto& c = a.get(id);
    if (c.owner == kOwnerHuge) {
      block* b = block_at(c.va);
      if (!b) b = block_containing(c.va);  // stitched huge block starting in an earlier chunk
      return (b->flags & f_tagged) && !fence_covers(b->stream, b->free_seq);
    }
    for (block* b = block_containing(c.va); b && b->addr < c.va + c.size; b = b->next_phys)
      if ((b->flags & f_tagged) && !fence_covers(b->stream, b->free_seq)) return true;
    return false;
  }

  status release_chunk(std::uint32_t id, bool keep_handle, bool wait, bool& busy) {
    busy = !wait && chunk_busy(id);
    if (busy) return {};
    auto& c = a.get(id);
    assert(c.used == 0);
    ++st.chunk_releases;
    next_growth = a.opts().min_chunk;  // memory pressure: grow gently again
    if (c.owner == kOwnerHuge) {
      block* b = block_at(c.va);
      if (!b) b = block_containing(c.va);
      return release_huge(b, keep_handle);
    }
    std::uintptr_t cs = c.va, ce = c.va + c.size;
    block* first = block_containing(cs);
    block* last = first;
    while (last->addr + last->size < ce) last = last->next_phys;
    for (block* b = first;; b = b->next_phys) {  // wait only for this chunk's streams
      assert(b->flags & f_free);
      if (b->flags & f_tagged) {
        status w = wait_covered(b->stream, b->free_seq);
        if (!w.ok()) return w;
      }
      if (b == last) break;
    }
    status u = a.unmap_chunk(id, keep_handle);
    if (!u.ok()) return u;
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

  status release_huge(block* b, bool keep_handle) {
    assert(b && (b->flags & f_huge) && (b->flags & f_free));
    if (b->flags & f_exported) keep_handle = false;  // an importer may still map it: never reuse
    if (b->flags & f_tagged) {
      status w = wait_covered(b->stream, b->free_seq);
      if (!w.ok()) return w;
    }
    // A huge block may be stitched from several chunks: unmap from the end, shrinking the block,
    // so a failure part-way leaves a consistent (smaller) cached block.
    while (b->size) {
      std::uint32_t id = a.chunk_at(b->addr + b->size - 1);
      std::size_t cs = a.get(id).size;
      status u = a.unmap_chunk(id, keep_handle);
      if (!u.ok()) return u;
      uncache_huge(b);
      b->size -= cs;
      if (b->size) huge_cache.emplace(b->size, b);
    }
    unlink_page(b);
    delete_block(b);
    return {};
  }
  void uncache_huge(block* b) {
    auto [lo, hi] = huge_cache.equal_range(b->size);
    for (auto it = lo; it != hi; ++it)
      if (it->second == b) {
        huge_cache.erase(it);
        return;
      }
  }

  // ---- huge path ----
  result<block*> allocate_huge(std::size_t n, stream_t x) {
    std::size_t size = round_up(n, G);
    if (size < n) return {nullptr, fail(errc::out_of_memory, "size overflows")};
    // A cached chunk of the same size (up to 1/8 larger) costs no driver call at all.
    for (auto it = huge_cache.lower_bound(size); it != huge_cache.end() && it->first <= size + size / 8; ++it) {
      block* b = it->second;
      if (!usable(b, x)) continue;
      huge_cache.erase(it);
      b->flags = f_huge;
      b->requested = n;
      b->stream = x;
      account(b->addr, b->size, true);
      return {b, {}};
    }
    if (a.opts().stitch_on_grow) {
      status e = evict_free_chunks(size, true);
      if (!e.ok()) return {nullptr, e};
    }
    auto r = a.map_range(size, 0, kOwnerHuge);
    if (!r.ok() && r.st.kind == errc::out_of_memory && a.free_chunk_bytes()) {
      status e = evict_free_chunks(~std::size_t{0}, true);
      if (!e.ok()) return {nullptr, e};
      r = a.map_range(size, 0, kOwnerHuge);
    }
    if (!r.ok()) return {nullptr, r.st};
    block* b = new_block();
    b->addr = r.value;
    b->size = size;
    b->flags = f_huge;
    b->requested = n;
    b->stream = x;
    link_page(b);
    account(b->addr, b->size, true);
    return {b, {}};
  }

  void free_huge(block* b, stream_t s) {
    account(b->addr, b->size, false);
    const bool exported = b->flags & f_exported;
    b->flags = f_huge | f_free | f_tagged;
    b->stream = s;
    b->free_seq = ++seq;
    b->requested = 0;
    huge_cache.emplace(b->size, b);
    if (exported) {
      // An importer may still map these chunks: they must never hold another allocation. Unmap
      // and release them now (waits for s's work on the block); the importer's own handle keeps
      // the memory alive until it closes. A failure leaves the block cached, never handed out:
      if (!release_huge(b, false).ok()) b->flags |= f_exported;  // usable() refuses it below
      else ++st.exported_released;
    }
  }

  // ---- small path ----
  std::vector<slab*>& heads_for(stream_t x) {
    if (last_heads && last_stream == x) return *last_heads;
    auto& v = class_heads[x];
    if (v.empty()) v.assign(class_size.size(), nullptr);
    last_stream = x;
    last_heads = &v;  // unordered_map references stay valid across rehash
    return v;
  }
  void list_push(std::vector<slab*>& heads, slab* s) {
    s->prev = nullptr;
    s->next = heads[s->cls];
    if (s->next) s->next->prev = s;
    heads[s->cls] = s;
    s->listed = true;
  }
  void list_remove(std::vector<slab*>& heads, slab* s) {
    if (s->prev) s->prev->next = s->next; else heads[s->cls] = s->next;
    if (s->next) s->next->prev = s->prev;
    s->prev = s->next = nullptr;
    s->listed = false;
  }

  result<slab*> new_slab(std::uint32_t cls, stream_t x) {
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

  void destroy_slab(slab* s) {
    auto& heads = heads_for(s->stream);
    if (s->listed) list_remove(heads, s);
    pages[a.page_of(s->base)].s.store(nullptr, std::memory_order_release);
    st.slab_bytes -= G;
    --st.slabs;
    free_large(s->blk, s->stream);
    delete s;
  }

  result<std::uintptr_t> allocate_small(std::size_t n, stream_t x, std::uint8_t state = 1) {
    std::uint32_t cls = class_of_units[(n + kUnit - 1) / kUnit];
    return allocate_class(cls, n, x, state);
  }
  // Thread caches refill from slabs they own, so two threads never write the same slab's
  // metadata lines on their hot paths. tag 0 (the locked path) takes any slab.
  std::unordered_set<std::uint64_t> live_tags;
  slab* pick_slab(slab* head, std::uint64_t tag) {
    if (!tag) return head;
    int scanned = 0;
    for (slab* s = head; s && scanned < 8; s = s->next, ++scanned)
      if (s->owner == tag || s->owner == 0 || !live_tags.count(s->owner)) {
        s->owner = tag;
        return s;
      }
    return nullptr;  // every candidate belongs to another live thread: make a new slab
  }

  result<std::uintptr_t> allocate_class(std::uint32_t cls, std::size_t n, stream_t x, std::uint8_t state,
                                        std::uint64_t tag = 0) {
    auto& heads = heads_for(x);
    slab* s = pick_slab(heads[cls], tag);
    if (!s) {
      if (!deferred_frees.empty()) poll_deferred(false);
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

  void release_slot(slab* s, std::uint32_t i) {
    auto& heads = heads_for(s->stream);
    s->free.push_back(i);
    --s->used;
    if (!s->listed) list_push(heads, s);
    // Keep one empty slab per class and stream; give further empty ones back to the large heap.
    if (s->used == 0 && (heads[s->cls] != s || s->next)) destroy_slab(s);
  }

  // ---- deferred frees (record_stream, cross-stream small frees) ----
  // Records a fence on each stream into `out`, all or nothing: if one cannot be recorded, the
  // ones already recorded are dropped, `out` is left empty and the driver's error returned.
  status record_fences(const std::vector<stream_t>& on, std::vector<fence_t>& out) {
    for (auto xs : on) {
      auto f = a.drv().record_fence(xs);
      if (!f.ok()) {
        drop_fences(out);
        return f.st;
      }
      if (f.value) out.push_back(f.value);  // 0: the stream is already idle
    }
    return {};
  }
  void drop_fences(std::vector<fence_t>& fs) {
    for (auto f : fs) a.drv().drop_fence(f);
    fs.clear();
  }

  void poll_deferred(bool wait) {
    for (std::size_t i = 0; i < deferred_frees.size();) {
      auto& d = deferred_frees[i];
      bool done = true;
      for (auto f : d.fences) {
        if (wait) a.drv().wait_fence(f);
        done = done && a.drv().fence_done(f);
      }
      if (!done) {
        ++i;
        continue;
      }
      drop_fences(d.fences);
      deferred d2 = std::move(d);
      deferred_frees[i] = std::move(deferred_frees.back());
      deferred_frees.pop_back();
      --st.deferred;
      complete_free(d2.p, d2.s);
    }
  }

  void complete_free(std::uintptr_t p, stream_t s) {
    if (slab* sl = slab_at(a.page_of(p))) {
      release_slot(sl, static_cast<std::uint32_t>((p - sl->base) / sl->slot));
    } else {
      block* b = block_at(p);
      if (b->flags & f_huge) free_huge(b, s); else free_large(b, s);
    }
    maybe_release();
  }

  void maybe_release() {
    const std::size_t keep = a.opts().release_threshold;
    if (a.free_chunk_bytes() + a.idle_bytes() <= keep) return;  // the common case: two loads
    a.release_idle(keep > a.free_chunk_bytes() ? keep - a.free_chunk_bytes() : 0);
    std::uint32_t id = a.oldest_free_chunk();
    while (a.free_chunk_bytes() + a.idle_bytes() > keep && id != arena::no_chunk) {
      bool busy = false;
      if (!release_chunk(id, false, false, busy).ok()) break;
      id = busy ? a.get(id).lru_next : a.oldest_free_chunk();
    }
  }

  void note_alloc(std::size_t n, std::size_t sz) {
    st.requested += n;
    st.allocated += sz;
    // With thread caches, requested bytes of cache-served blocks live in the caches' counters, so
    // this counter alone can dip "below zero" (mod 2^64) when such a block is freed here. Only a
    // non-wrapped value is a candidate for the peak.
    if (static_cast<std::int64_t>(st.requested) >= 0)
      st.peak_requested = std::max(st.peak_requested, st.requested);
    st.peak_allocated = std::max(st.peak_allocated, st.allocated);
    ++st.allocs;
    ++st.live;
  }
  void note_free(std::size_t n, std::size_t sz) {
    st.requested -= n;
    st.allocated -= sz;
    ++st.frees;
    --st.live;
  }
};

heap::heap(arena& a) : p_(std::make_unique<impl>(a)) {}

heap::~heap() {
  // Slabs are heap objects: collect them through the page map (every slab owns one page).
  for (auto& e : p_->pages) delete e.s.load();
  for (auto& d : p_->deferred_frees)
    p_->drop_fences(d.fences);
  for (auto& [s, ss] : p_->streams)
    if (ss.fence) p_->a.drv().drop_fence(ss.fence);
}

result<std::uintptr_t> heap::allocate(std::size_t n, std::size_t align, stream_t s) {
  auto& m = *p_;
  if (n == 0) return {0, fail(errc::invalid_value, "size 0")};
  if (align == 0 || (align & (align - 1))) return {0, fail(errc::invalid_value, "alignment is not a power of two")};
  if (align > m.G) return {0, fail(errc::invalid_value, "alignment larger than the granularity")};
  if (n > m.a.reservation_size()) return {0, fail(errc::out_of_memory, "size larger than the reservation")};
  align = std::max(align, kUnit);
  if (n <= m.small_limit() && align <= kUnit) return m.allocate_small(n, s);
  const bool huge = (n >= m.a.opts().huge_threshold || m.whole_chunks()) && align <= m.G;
  result<impl::block*> r = huge ? m.allocate_huge(n, s) : m.allocate_large(n, align, s);
  if (!r.ok()) return {0, r.st};
  m.note_alloc(n, r.value->size);
  return {r.value->addr, {}};
}

status heap::deallocate(std::uintptr_t p, stream_t s) {
  auto& m = *p_;
  if (!m.a.contains(p)) return fail(errc::invalid_pointer, "pointer not from this allocator");
  if (impl::slab* sl = m.slab_at(m.a.page_of(p))) {
    std::uintptr_t off = p - sl->base;
    std::uint32_t i = static_cast<std::uint32_t>(off / sl->slot);
    if (off % sl->slot || i >= sl->nslots) return fail(errc::invalid_pointer, "interior pointer (not the start of an allocation)");
    std::uint8_t state = sl->state[i].load(std::memory_order_relaxed);
    if (state == 0) return fail(errc::invalid_pointer, "double free (block is not allocated)");
    if (state == 2) return fail(errc::invalid_pointer, "double free (block is already freed into a thread cache)");
    // Fences first: if one cannot be recorded the free is refused and the block stays allocated.
    // The slab's stream reuses slots at once, so a free on another stream waits for that stream.
    std::vector<stream_t> wait_on;
    auto extra = m.extra_streams.find(p);
    if (extra != m.extra_streams.end()) wait_on = extra->second;
    if (s != sl->stream) wait_on.push_back(s);
    std::vector<fence_t> fences;
    if (status r = m.record_fences(wait_on, fences); !r.ok()) return r;
    // Claim the slot: a thread-cache free of the same pointer racing this one (a caller's bug)
    // sees the state change and reports a double free instead of both succeeding.
    if (!sl->state[i].compare_exchange_strong(state, 0, std::memory_order_acq_rel))
      return m.drop_fences(fences), fail(errc::invalid_pointer, "double free (freed concurrently by another thread)");
    if (extra != m.extra_streams.end()) m.extra_streams.erase(extra);
    m.note_free(sl->req[i], sl->slot);
    sl->req[i] = 0;
    if (!fences.empty()) {
      m.deferred_frees.push_back({p, s, std::move(fences)});
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
  if (auto it = m.extra_streams.find(p); it != m.extra_streams.end()) {
    std::vector<fence_t> fences;  // refused: the block stays allocated, record_stream state intact
    if (status r = m.record_fences(it->second, fences); !r.ok()) return r;
    m.extra_streams.erase(it);
    m.note_free(b->requested, b->size);
    if (!fences.empty()) {
      b->requested = 0;
      m.deferred_frees.push_back({p, s, std::move(fences)});
      ++m.st.deferred;
      return {};
    }
    if (b->flags & impl::f_huge) m.free_huge(b, s); else m.free_large(b, s);
    m.maybe_release();
    return {};
  }
  m.note_free(b->requested, b->size);
  if (b->flags & impl::f_huge) m.free_huge(b, s); else m.free_large(b, s);
  m.maybe_release();
  return {};
}

status heap::export_chunks(std::uintptr_t p, std::vector<std::uint32_t>& ids, std::size_t& bytes) {
  auto& m = *p_;
  if (!m.whole_chunks())
    return fail(errc::not_supported, "export: the policy is not exportable (options.ipc is none)");
  impl::block* b = m.a.contains(p) ? m.block_at(p) : nullptr;
  if (!b || !(b->flags & impl::f_huge) || (b->flags & impl::f_free))
    return fail(errc::invalid_pointer, "export: pointer is not the start of a live allocation");
  for (auto& d : m.deferred_frees)
    if (d.p == p) return fail(errc::invalid_pointer, "export: the allocation's free is pending");
  ids.clear();
  for (std::uintptr_t va = b->addr; va < b->addr + b->size;) {
    std::uint32_t id = m.a.chunk_at(va);
    ids.push_back(id);
    va += m.a.get(id).size;
  }
  bytes = b->requested;
  b->flags |= impl::f_exported;
  return {};
}

status heap::record_stream(std::uintptr_t p, stream_t s) {
  if (!usable_size(p)) return fail(errc::invalid_pointer, "record_stream: pointer not allocated");
  if (impl::slab* sl = p_->slab_at(p_->a.page_of(p)))  // thread caches must not take this free
    sl->state[(p - sl->base) / sl->slot].store(3, std::memory_order_relaxed);
  auto& v = p_->extra_streams[p];
  if (std::find(v.begin(), v.end(), s) == v.end()) v.push_back(s);
  return {};
}

std::size_t heap::usable_size(std::uintptr_t p) const {
  auto& m = *p_;
  if (!m.a.contains(p)) return 0;
  if (impl::slab* sl = m.slab_at(m.a.page_of(p))) {
    std::uintptr_t off = p - sl->base;
    std::uint32_t i = static_cast<std::uint32_t>(off / sl->slot);
    if (off % sl->slot || i >= sl->nslots) return 0;
    auto state = sl->state[i].load(std::memory_order_relaxed);
    if (state != 1 && state != 3) return 0;
    return sl->slot;
  }
  impl::block* b = m.block_at(p);
  if (!b || (b->flags & (impl::f_free | impl::f_slab | impl::f_sentinel))) return 0;
  for (auto& d : m.deferred_frees)
    if (d.p == p) return 0;
  return b->size;
}

std::size_t heap::requested_size(std::uintptr_t p) const {
  auto& m = *p_;
  if (!usable_size(p)) return 0;
  if (impl::slab* sl = m.slab_at(m.a.page_of(p))) return sl->req[(p - sl->base) / sl->slot];
  return m.block_at(p)->requested;
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

status heap::trim(std::size_t keep) {
  auto& m = *p_;
  ++m.st.trims;
  m.poll_deferred(false);
  (void)m.a.retry_strays();  // a refusal stays parked and is reported through take_parked_error
  // Empty slabs first: they pin chunks that are otherwise free.
  std::vector<impl::slab*> empty;
  for (auto& e : m.pages)
    if (impl::slab* s = e.s.load(); s && s->used == 0) empty.push_back(s);
  for (auto* s : empty) m.destroy_slab(s);
  status r;
  while (r.ok() && m.a.free_chunk_bytes() + m.a.idle_bytes() > keep) {
    if (m.a.idle_bytes()) {
      r = m.a.release_idle(keep > m.a.free_chunk_bytes() ? keep - m.a.free_chunk_bytes() : 0);
      if (!r.ok() || m.a.free_chunk_bytes() + m.a.idle_bytes() <= keep) break;
    }
    if (m.a.oldest_free_chunk() == arena::no_chunk) break;
    bool busy = false;
    r = m.release_chunk(m.a.oldest_free_chunk(), false, true, busy);
  }
  // A release refused during this call is reported by this call only (its handle stays parked and
  // is retried later); the first error wins.
  status parked = m.a.take_parked_error();
  return r.ok() ? parked : r;
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

heap_stats heap::stats() const { return p_->st; }

void heap::reset_peaks() {
  p_->st.peak_requested = p_->st.requested;
  p_->st.peak_allocated = p_->st.allocated;
}

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
            requested += b->requested;
            ++live;
          }
        }
      }
      expect = b->addr;
    }
  }
  if (free_blocks != listed) return "a free block is missing from the free lists";
  // 3. huge blocks, slabs, page chains
  std::size_t chained = 0, slabs = 0, huge_cached = 0, huge_seen = 0;
  for (std::size_t pg = 0; pg < m.pages.size(); ++pg) {
    for (block* b = m.pages[pg].starts; b; b = b->page_next) {
      ++chained;
      if (m.a.page_of(b->addr) != pg) return "block chained under the wrong page";
      if (b->flags & impl::f_huge) {
        ++huge_seen;
        if (b->flags & impl::f_free) {
          ++huge_cached;
          continue;
        }
        if (!add_used(b->addr, b->size)) return "huge block over unmapped memory";
        bool deferred = false;
        for (auto& d : m.deferred_frees) deferred |= d.p == b->addr;
        if (deferred) continue;  // freed, waiting for a fence: no longer counted as live
        allocated += b->size;
        requested += b->requested;
        ++live;
      }
    }
    if (impl::slab* s = m.slab_at(pg)) {
      ++slabs;
      if (s->base != m.a.base() + pg * m.G || s->blk->addr != s->base) return "slab not at its page";
      std::size_t held = 0, pending = 0;
      for (std::uint32_t i = 0; i < s->nslots; ++i)
        if (s->state[i].load(std::memory_order_relaxed) != 0) {
          ++held;
          allocated += s->slot;
          if (exact_requested) requested += s->req[i];  // others may be writing it
          ++live;
        } else if (s->req[i] != 0) {
          return "a free slot still records requested bytes";
        }
      for (auto& d : m.deferred_frees) pending += d.p - s->base < m.G;
      if (s->used != held + pending) return "slab used count is off";
      if (s->free.size() != s->nslots - s->used) return "slab free stack size is off";
      for (auto i : s->free)
        if (s->state[i].load(std::memory_order_relaxed) != 0) return "a live slot is on the free stack";
      if (s->listed != !s->free.empty()) return "slab class list membership is off";
    }
  }
  if (chained != blocks + huge_seen) return "page chains hold blocks that are in no span";
  if (huge_cached != m.huge_cache.size()) return "huge cache does not match the free huge blocks";
  if (slabs != m.st.slabs) return "slab count is off";
  if (allocated != m.st.allocated || live != m.st.live ||
      (exact_requested && requested != m.st.requested + requested_outside))
    return "heap stats do not add up (allocated/requested/live)";
  for (std::uint32_t id = 0; id < m.a.chunk_slots(); ++id) {
    auto& c = m.a.get(id);
    if (!c.size) continue;
    auto it = used.find(id);
    if ((it == used.end() ? 0 : it->second) != c.used) return "chunk used bytes do not match its live blocks";
  }
  return m.a.check();
}

}  // namespace vmm
