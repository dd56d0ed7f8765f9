// SPDX-License-Identifier: Apache-2.0
// The heap's state: blocks, slabs, spans, free lists, stream tags, and the operations on them.
// One struct, its members defined by concept:
//   blocks.cpp   block pool and page chains (free(p) finds its block in O(1))
//   tlsf.cpp     free lists of span blocks (TLSF good fit)
//   spans.cpp    spans of mapped VA: split, coalesce, grow, chunk release, release threshold
//   huge.cpp     dedicated chunks (huge sizes, exportable allocations)
//   slabs.cpp    size classes, slabs and the thread-cache protocol
//   streams.cpp  stream tags, fences, deferred frees, record_stream
//   check.cpp    the invariant checker
//   heap.cpp     the entry points (heap.hpp) and stats
#pragma once

#include <algorithm>
#include <atomic>
#include <bit>
#include <cassert>
#include <limits>
#include <map>
#include <memory>
#include <new>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <sys/mman.h>

#include "heap/heap.hpp"
#include "heap/tlsf.hpp"

namespace vmm {

namespace heap_detail {
constexpr std::uint32_t kOwnerSpan = 0, kOwnerHuge = 1;  // arena::chunk::owner tags

inline std::size_t align_up(std::size_t n, std::size_t a) { return (n + a - 1) & ~(a - 1); }
inline std::size_t round_up(std::size_t n, std::size_t g) { return (n + g - 1) / g * g; }
inline status fail(errc k, const char* name) { return {k, 0, name, "heap"}; }
}  // namespace heap_detail

struct heap::impl {
  static constexpr int kFlCount = heap_detail::kFlCount, kSlCount = heap_detail::kSlCount;

  enum : std::uint8_t { f_free = 1, f_sentinel = 2, f_slab = 4, f_huge = 8, f_tagged = 16, f_exported = 32 };

  // One cache line each (104 bytes -> 128): threads holding neighbouring blocks in their large
  // caches write req and tword without the lock, and must not share a line. 24 bytes a block.
  struct alignas(64) block {
    std::uintptr_t addr = 0;
    std::size_t size = 0;
    block* prev_phys = nullptr;  // neighbours in the span (null at the span's start)
    block* next_phys = nullptr;  // the span's sentinel after its last block
    block* prev_free = nullptr;  // TLSF list links (free blocks only)
    block* next_free = nullptr;
    block* page_prev = nullptr;  // chain of blocks starting in the same page (O(1) free lookup)
    block* page_next = nullptr;
    stream_t stream = nullptr;   // live: allocating stream; free + f_tagged: freeing stream
    std::uint64_t free_seq = 0;  // value of seq when freed
    std::uint8_t flags = 0;
    // Read and written without the lock by a thread cache holding the block (large sizes): bytes
    // asked for (live blocks), and the cache protocol word: gen << 8 | state, state 0 = the heap's,
    // 1 = handed out on a thread-cache path (the user's), 2 = cached in a thread cache, 3 = its
    // thread is moving it between 1 and 2 (its requested bytes change; nobody else may take it). gen
    // changes whenever the struct is reused for another block, so a cache's stale reference fails
    // its compare-exchange. Block structs are never freed while the heap lives (type-stable).
    std::atomic<std::size_t> req{0};
    std::atomic<std::uint64_t> tword{0};

    std::size_t requested() const { return req.load(std::memory_order_relaxed); }
    void set_requested(std::size_t n) { req.store(n, std::memory_order_relaxed); }
    void clear() {  // a fresh block in a reused struct: a new generation, state 0
      addr = 0;
      size = 0;
      prev_phys = next_phys = prev_free = next_free = page_prev = page_next = nullptr;
      stream = nullptr;
      free_seq = 0;
      flags = 0;
      req.store(0, std::memory_order_relaxed);
      tword.store(((tword.load(std::memory_order_relaxed) >> 8) + 1) << 8, std::memory_order_relaxed);
    }
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

  // Slot states, in the low byte of each slot's 16-bit state word. The high byte is the slab's
  // tag: it changes every time a slab object is set up for a range, so a lock-free free that read
  // an old incarnation's metadata fails its compare-exchange instead of touching a new owner's slot.
  enum : std::uint8_t { slot_free = 0, slot_user = 1, slot_cached = 2, slot_user_recorded = 3 };

  // A slab object is never freed while the heap lives: destroy_slab() parks it for the next
  // new_slab() (type-stable memory), and its arrays are sized once for the most slots a slab can
  // hold (G / 256), so a thread on the lock-free free path that raced a trim() still reads valid
  // memory. Fields the lock-free path reads (small_slot) are written with atomic stores while
  // `seq` is odd (a seqlock); everything else is under the heap lock.
  struct alignas(64) slab {
    std::atomic<std::uint32_t> seq{0};  // odd while being set up; the tag is (seq >> 1) & 0xff
    std::uint16_t tag = 0;              // current tag << 8
    std::uintptr_t base = 0;
    std::size_t bytes = 0;  // slab_size of its class; 0 while parked
    block* blk = nullptr;   // the slab page it lies in
    stream_t stream = nullptr;
    std::uint32_t cls = 0, slot = 0, nslots = 0, used = 0;  // used counts live + deferred slots
    std::uint64_t inv = 0;  // ceil(2^40 / slot): index = off * inv >> 40, exact for off < 2^24
    std::uint32_t index(std::uintptr_t off) const { return static_cast<std::uint32_t>((off * inv) >> 40); }
    std::vector<std::uint32_t> free;   // stack of free slot indices: pop = O(1)
    // Per slot: tag | state (slot_*). Atomic: thread caches flip their own slots without the lock.
    line_array<std::atomic<std::uint16_t>> state;
    line_array<std::atomic<std::uint32_t>> req;  // requested bytes per slot
    std::uint64_t owner = 0;  // thread cache that refills from it (0: none): no false sharing
    slab* prev = nullptr;              // class list of slabs with a free slot
    slab* next = nullptr;
    bool listed = false;

    std::uint8_t get(std::uint32_t i) const { return static_cast<std::uint8_t>(state[i].load(std::memory_order_relaxed)); }
    // Release: a thread whose claim (swap, acq_rel) sees the new state also sees what was written
    // before it, the slot's requested bytes among them.
    void set(std::uint32_t i, std::uint8_t st) { state[i].store(tag | st, std::memory_order_release); }
    // Moves slot i from `from` to `to` unless something else changed it first.
    bool swap(std::uint32_t i, std::uint8_t from, std::uint8_t to) {
      std::uint16_t e = tag | from;
      return state[i].compare_exchange_strong(e, static_cast<std::uint16_t>(tag | to), std::memory_order_acq_rel);
    }
    std::uint32_t requested(std::uint32_t i) const { return req[i].load(std::memory_order_relaxed); }
    void set_requested(std::uint32_t i, std::uint32_t n) { req[i].store(n, std::memory_order_relaxed); }
  };
  std::vector<std::unique_ptr<slab>> slab_objects;  // every slab object made (type-stable storage)
  std::vector<slab*> spare_slabs;                    // parked by destroy_slab, reused by new_slab

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
    std::vector<stream_t> later;  // streams capturing at the free: their fences are recorded after
  };

  struct page_entry {
    block* starts = nullptr;
  };
  // Slabs are one to eight units (G / 8) of a slab page: a G-aligned page of the large path that
  // holds only slabs, of any class and thread, for one stream (a unit freed by one slab serves
  // the next in stream order). A class with a few live slots holds a unit, not a page: a CNN's
  // peak held 22 pages of slabs, one or more per class and thread, for 3.7 MiB of live slots. The
  // page goes back to the span when its last slab does.
  static constexpr unsigned kUnitsPerPage = 8;  // slab_page::used has a bit for each
  struct slab_page {
    block* blk = nullptr;
    stream_t stream = nullptr;
    std::uint8_t used = 0;  // bit i: unit i is a slab's
  };
  std::map<std::uintptr_t, slab_page> slab_pages;  // by address
  // The bits of slab_page::used that `units` units from unit `at` take.
  static std::uint8_t unit_bits(unsigned units, unsigned at) {
    return static_cast<std::uint8_t>(((1u << units) - 1) << at);
  }
  // The slab that owns each unit of the reservation, or none. Read without the lock by the
  // thread-cache free path (atomic_ref). Anonymous memory: a unit never used costs nothing (a
  // device-sized reservation has about a million).
  class slab_map {
   public:
    explicit slab_map(std::size_t n) : n_(n) {
      constexpr int flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE;
      void* m = ::mmap(nullptr, n * sizeof(slab*), PROT_READ | PROT_WRITE, flags, -1, 0);
      if (m == MAP_FAILED) throw std::bad_alloc();
      p_ = static_cast<slab**>(m);
    }
    ~slab_map() {
      if (p_) ::munmap(p_, n_ * sizeof(slab*));
    }
    slab_map(const slab_map&) = delete;
    slab_map& operator=(const slab_map&) = delete;
    slab* get(std::size_t u) const { return std::atomic_ref(p_[u]).load(std::memory_order_acquire); }
    void set(std::size_t u, slab* s) { std::atomic_ref(p_[u]).store(s, std::memory_order_release); }

   private:
    slab** p_ = nullptr;
    std::size_t n_ = 0;
  };
  std::size_t unit_of(std::uintptr_t p) const { return (p - a.base()) >> unit_shift; }
  // The slab holding p (p inside the reservation), or nullptr.
  slab* slab_of(std::uintptr_t p) const { return slabs_by_unit.get(unit_of(p)); }
  // A class's slab: at least kSlabSlots slots, a power of two from one unit up to one page.
  static constexpr std::size_t kSlabSlots = 32;
  std::size_t slab_size(std::uint32_t cls) const {
    std::size_t n = U;
    while (n < G && n < std::size_t{class_size[cls]} * kSlabSlots) n *= 2;
    return n;
  }

  arena& a;
  // The request being served: how far it may grow, and whether it planned a growth.
  grow_mode mode = grow_mode::normal;
  bool planned = false;
  void begin_request(grow_mode g) {
    mode = g;
    planned = false;
  }
  block* fresh_huge = nullptr;  // the huge block adopt() made last (a hint: see allocate_huge)
  // Cached huge blocks a planned growth extends in place, by the VA where the growth maps (their
  // end): out of the huge cache and their chunks counted used, so no other thread takes or
  // evicts them while the job runs; adopt() or growth_refused() puts them back.
  std::map<std::uintptr_t, block*> extending;
  // The block a growth mapping at `end` extends, out of `extending`, its chunks no longer held
  // (nullptr when that growth extends none).
  block* take_extending(std::uintptr_t end);
  bool private_pool = false;  // a graph pool's: every mapped byte stays (see heap::set_private)
  std::uint16_t hid;  // this heap's id in the arena's chunk table (0: the allocator's own)
  std::size_t G;
  std::size_t U;         // slab unit: G / kUnitsPerPage
  unsigned unit_shift;   // log2(U)
  std::vector<page_entry> pages;
  slab_map slabs_by_unit;

  std::uint64_t fl_bitmap = 0;
  std::uint32_t sl_bitmap[kFlCount] = {};
  block* lists[kFlCount][kSlCount] = {};

  std::map<std::uintptr_t, block*> span_ends;        // sentinel address -> sentinel
  std::multimap<std::size_t, block*> huge_cache;     // free huge blocks by size
  std::unordered_map<stream_t, stream_state> streams;
  std::unordered_map<std::uintptr_t, std::vector<stream_t>> extra_streams;
  std::vector<deferred> deferred_frees;
  std::uint64_t seq = 0;
  bool defer_waits = false;      // see heap::defer_waits
  std::vector<stream_t> waits;   // streams trim / reclaim skipped instead of waiting for (repeats allowed)
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
  // The most this heap has had allocated at once; reset_peaks leaves it. A growth that keeps what
  // the heap holds within it creates memory instead of moving free chunks' handles (an unmap and
  // a map each): the process needed that much at once before, so its peak held cannot rise.
  std::size_t top_allocated = 0;

  impl(arena& ar, std::uint16_t id);

  std::size_t small_limit() const { return class_size.empty() ? 0 : class_size.back(); }
  bool whole_chunks() const { return a.whole_chunks(); }  // placement policy (ipc)
  // Under a memory limit (tuning::limit_chunk): smaller handles, freed huge blocks in the spans.
  // Read per growth or free: the limit may be set or lifted at any time (set_memory_limit).
  bool limited() const {
    return a.tune().limit_chunk && !whole_chunks() && a.memory_limit() != std::numeric_limits<std::size_t>::max();
  }
  // Largest handle a growth for `need` new bytes creates (0: one handle): for the spans, and for
  // huge blocks (an exportable block is one handle: each would cost an export). One page for the
  // growths that follow a trim, or `need` whole for a large request (tuning::trim_growths,
  // trim_own_handle).
  std::size_t span_piece(std::size_t need) const {
    const tuning& t = a.tune();
    const std::size_t h = t.max_handle, l = limited() ? t.limit_chunk : 0;
    if (h && st.trims && st.grows - grows_at_trim < t.trim_growths)
      return !l && t.trim_own_handle && need >= t.trim_own_handle ? need : G;
    return h && l ? std::min(h, l) : h | l;
  }
  std::uint64_t grows_at_trim = 0;  // st.grows at the last trim
  std::size_t huge_piece(std::size_t need) const { return whole_chunks() ? 0 : span_piece(need); }

  // ---- block pool and page chains ----
  block* new_block();
  void delete_block(block* b) { pool_free.push_back(b); }

  void link_page(block* b);
  void unlink_page(block* b);
  block* block_at(std::uintptr_t p) const;
  // Block whose range holds p (slow path: walks back over pages of a long block).
  block* block_containing(std::uintptr_t p) const;

  // ---- TLSF free lists ----
  void insert_free(block* b);
  void remove_free(block* b);

  // ---- streams ----
  // Makes sure the stream's latest fence was recorded after free number seq_at_free.
  status fence_after(stream_state& ss, stream_t s, std::uint64_t seq_at_free);
  void note_done(stream_state& ss);

  // Whether a fence recorded on s after free number `seq_at_free` has completed. Records the
  // fence lazily (first time another stream asks) and only queries it: never waits.
  bool fence_covers(stream_t s, std::uint64_t seq_at_free);
  // The same, but waits for that fence (slow path: unmapping). A fence that cannot be recorded is
  // an error, never "done".
  status wait_covered(stream_t s, std::uint64_t seq_at_free);
  bool usable(block* b, stream_t x);
  static bool compatible(const block* l, const block* r);

  block* find_free(std::size_t size, stream_t x);

  block* find_good_fit(std::size_t size, stream_t x);

  // ---- split, merge, chunk accounting ----
  block* split(block* b, std::uintptr_t at);
  void absorb(block* l, block* r);  // l, r adjacent, neither in a free list
  void account(std::uintptr_t addr, std::size_t size, bool add);

  // ---- large path ----
  // may_grow false: a free block that fits, or null (status ok) without a driver call.
  result<block*> allocate_large(std::size_t n, std::size_t align, stream_t x, bool may_grow = true);

  void free_large(block* b, stream_t s);

  // Adds mapped [va, va+size) to the spans: extends the span ending at va, or starts a new one.
  // freed_seq != 0: the range is memory freed on x at that sequence (tagged, not fresh).
  void add_span_range(std::uintptr_t va, std::size_t size, stream_t x, std::uint64_t freed_seq = 0);
  // A span that starts where the span ending at `sentinel` ends joins it, free blocks either side
  // coalescing (a chunk given back from a span's middle cut it in two; mapping that VA again
  // makes it one). x: the stream the new memory is for.
  void join_next_span(block* sentinel, stream_t x);
  // A span's first block starting at p (nullptr when none).
  block* span_head_at(std::uintptr_t p) const;
  // A free block whose stream's fence covers its free is free for every stream: its tag goes,
  // and it coalesces with an untagged free neighbour on the side named (the caller rebuilds the
  // other). Returns the block that holds it.
  block* drop_covered_tag(block* b, bool left);
  // Free listed blocks l and r, r right after l, become l (its list re-chosen for the new size).
  block* merge_free(block* l, block* r);
  // Fresh memory b (never handed out) takes `from`'s stream tag, so the two can serve one request.
  static void take_tag(block* b, const block* from) {
    b->flags = from->flags & (f_free | f_tagged);
    b->stream = from->stream;
    b->free_seq = from->free_seq;
  }

  // Plans a growth for a request of `need` bytes on x (sets `planned`); ok and nothing planned
  // under grow_mode::never.
  status grow(std::size_t need, stream_t x);
  void grown(bool pressed);  // the next growth's size after one that mapped memory

  // ---- releasing chunks ----
  // Unmaps wholly free chunks, oldest first, until the arena holds `target` idle bytes (or none
  // are left). keep_handle: the physical memory stays for stitching; else it is released.
  // wait = false (growth, release threshold): chunks whose last stream is still running are
  // skipped, never waited for. wait = true (trim): waits for those chunks' fences only.
  // for_stream: the stream the freed memory is for; chunks only it may still use are retired
  // (arena::retire_chunk) instead of skipped.
  status evict_free_chunks(std::size_t target, bool keep_handle, bool wait = false,
                           const stream_t* for_stream = nullptr);

  // Whether a free chunk still has a stream that may touch it (fence not known complete).
  // Streams that may still use a free chunk: none, only *for_stream, or another one. note: every
  // such stream goes to `waits`.
  enum { pending_none, pending_same, pending_other };
  int pending(std::uint32_t id, const stream_t* for_stream, bool note = false);

  status release_chunk(std::uint32_t id, bool keep_handle, bool wait, bool& busy,
                       const stream_t* for_stream = nullptr);

  status release_huge(block* b, bool keep_handle, const stream_t* retire_for = nullptr);
  void uncache_huge(block* b);
  void huge_to_spans(block* b, stream_t x);  // a free huge block's memory becomes span memory

  // ---- huge path ----
  // align <= G: chunks of its own are G-aligned; a span block is aligned as asked.
  result<block*> allocate_huge(std::size_t n, std::size_t align, stream_t x);

  void free_huge(block* b, stream_t s);

  // ---- small path ----
  std::vector<slab*>& heads_for(stream_t x);
  void list_push(std::vector<slab*>& heads, slab* s);
  void list_remove(std::vector<slab*>& heads, slab* s);

  result<slab*> new_slab(std::uint32_t cls, stream_t x);

  void destroy_slab(slab* s);

  result<std::uintptr_t> allocate_small(std::size_t n, stream_t x, std::uint8_t state = 1);
  // Thread caches refill from slabs they own, so two threads never write the same slab's
  // metadata lines on their hot paths. tag 0 (the locked path) takes any slab.
  std::unordered_set<std::uint64_t> live_tags;
  slab* pick_slab(slab* head, std::uint64_t tag);

  result<std::uintptr_t> allocate_class(std::uint32_t cls, std::size_t n, stream_t x, std::uint8_t state, std::uint64_t tag = 0);

  void release_slot(slab* s, std::uint32_t i);

  // ---- deferred frees (record_stream, cross-stream small frees) ----
  // Records a fence on each stream into `out`, all or nothing: if one cannot be recorded, the
  // ones already recorded are dropped, `out` is left empty and the driver's error returned.
  // Streams being captured get no fence now: they go to `later`.
  status record_fences(const std::vector<stream_t>& on, std::vector<fence_t>& out, std::vector<stream_t>& later);
  void drop_fences(std::vector<fence_t>& fs);

  void poll_deferred();  // completes deferred frees whose fences are done

  void complete_free(std::uintptr_t p, stream_t s);

  void maybe_release();
  // Out-of-memory path: empty slabs, free chunks (into idle handles), deferred frees. true when
  // something was given back or is now idle for the retry to map.
  bool reclaim();
  // free_memory_margin: true when the device's free memory less `want` is below the margin; then
  // free chunks have become idle handles (the growth maps those it can use, the caller releases
  // the rest once it has grown).
  bool relieve_pressure(std::size_t want, stream_t x);
  // Before a growth maps `size` (spans and huge chunks alike): relieve_pressure, or else wholly
  // free chunks become idle handles the growth maps (stitching), unless what the heap holds after
  // the growth stays within top_allocated. pressed: the caller releases the idle handles its
  // growth did not map.
  status prepare_growth(std::size_t size, stream_t x, bool& pressed);
  void destroy_empty_slabs();

  void note_alloc(std::size_t n, std::size_t sz);
  void note_free(std::size_t n, std::size_t sz);
};

using namespace heap_detail;  // inside namespace vmm: only the heap's own files include this header

// ---- hot primitives: inline, called on every allocation and free (out of line they cost ~5 %
// of the replay's ns/event: -O2 inlines only functions declared inline beyond a few insns) ----

inline heap::impl::block* heap::impl::new_block() {
  if (pool_free.empty()) {
    constexpr std::size_t n = 256;
    pool.emplace_back(new block[n]);
    for (std::size_t i = 0; i < n; ++i) pool_free.push_back(&pool.back()[i]);
  }
  block* b = pool_free.back();
  pool_free.pop_back();
  b->clear();
  return b;
}

inline void heap::impl::link_page(block* b) {
  auto& e = pages[a.page_of(b->addr)];
  b->page_prev = nullptr;
  b->page_next = e.starts;
  if (e.starts) e.starts->page_prev = b;
  e.starts = b;
}

inline void heap::impl::unlink_page(block* b) {
  if (b->page_prev) b->page_prev->page_next = b->page_next;
  else pages[a.page_of(b->addr)].starts = b->page_next;
  if (b->page_next) b->page_next->page_prev = b->page_prev;
  b->page_prev = b->page_next = nullptr;
}

inline heap::impl::block* heap::impl::block_at(std::uintptr_t p) const {
  for (block* b = pages[a.page_of(p)].starts; b; b = b->page_next)
    if (b->addr == p) return b;
  return nullptr;
}

inline void heap::impl::insert_free(block* b) {
  int fl, sl;
  mapping(b->size, fl, sl);
  b->prev_free = nullptr;
  b->next_free = lists[fl][sl];
  if (b->next_free) b->next_free->prev_free = b;
  lists[fl][sl] = b;
  fl_bitmap |= std::uint64_t{1} << fl;
  sl_bitmap[fl] |= 1u << sl;
}

inline void heap::impl::remove_free(block* b) {
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

inline bool heap::impl::usable(block* b, stream_t x) {
  if (b->flags & f_exported) return false;  // free but not yet released (see free_huge)
  return !(b->flags & f_tagged) || b->stream == x || fence_covers(b->stream, b->free_seq);
}

inline bool heap::impl::compatible(const block* l, const block* r) {
  if (!(l->flags & f_free) || !(r->flags & f_free)) return false;
  if ((l->flags | r->flags) & f_sentinel) return false;
  bool lt = l->flags & f_tagged, rt = r->flags & f_tagged;
  return lt == rt && (!lt || l->stream == r->stream);
}

inline void heap::impl::note_alloc(std::size_t n, std::size_t sz) {
  st.requested += n;
  st.allocated += sz;
  // With thread caches, requested bytes of cache-served blocks live in the caches' counters, so
  // this counter alone can dip "below zero" (mod 2^64) when such a block is freed here. Only a
  // non-wrapped value is a candidate for the peak.
  if (static_cast<std::int64_t>(st.requested) >= 0)
    st.peak_requested = std::max(st.peak_requested, st.requested);
  st.peak_allocated = std::max(st.peak_allocated, st.allocated);
  top_allocated = std::max(top_allocated, st.allocated);
  ++st.allocs;
  ++st.live;
}

inline void heap::impl::note_free(std::size_t n, std::size_t sz) {
  st.requested -= n;
  st.allocated -= sz;
  ++st.frees;
  --st.live;
}

inline void heap::impl::account(std::uintptr_t addr, std::size_t size, bool add) {
  for (std::uintptr_t x = addr, end = addr + size; x < end;) {
    std::uint32_t id = a.chunk_at(x);
    auto& c = a.get(id);
    std::size_t n = std::min<std::uintptr_t>(end, c.va + c.size) - x;
    if (add) a.add_used(id, n); else a.sub_used(id, n);
    x += n;
  }
}

inline heap::impl::block* heap::impl::split(block* b, std::uintptr_t at) {
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

inline void heap::impl::absorb(block* l, block* r) {
  l->size += r->size;
  l->free_seq = std::max(l->free_seq, r->free_seq);
  l->next_phys = r->next_phys;
  if (r->next_phys) r->next_phys->prev_phys = l;
  unlink_page(r);
  delete_block(r);
}

inline std::vector<heap::impl::slab*>& heap::impl::heads_for(stream_t x) {
  if (last_heads && last_stream == x) return *last_heads;
  auto& v = class_heads[x];
  if (v.empty()) v.assign(class_size.size(), nullptr);
  last_stream = x;
  last_heads = &v;  // unordered_map references stay valid across rehash
  return v;
}

inline void heap::impl::list_push(std::vector<slab*>& heads, slab* s) {
  s->prev = nullptr;
  s->next = heads[s->cls];
  if (s->next) s->next->prev = s;
  heads[s->cls] = s;
  s->listed = true;
}

inline void heap::impl::list_remove(std::vector<slab*>& heads, slab* s) {
  if (s->prev) s->prev->next = s->next; else heads[s->cls] = s->next;
  if (s->next) s->next->prev = s->prev;
  s->prev = s->next = nullptr;
  s->listed = false;
}

inline void heap::impl::release_slot(slab* s, std::uint32_t i) {
  auto& heads = heads_for(s->stream);
  s->free.push_back(i);
  --s->used;
  if (!s->listed) list_push(heads, s);
  // Keep one empty slab per class and stream; give further empty ones back to the large heap.
  if (s->used == 0 && (heads[s->cls] != s || s->next)) destroy_slab(s);
}

inline heap::impl::block* heap::impl::find_free(std::size_t size, stream_t x) {
  // The list holding `size` itself first (bounded scan): an exact or near-exact fit there keeps
  // big free blocks whole (closer to best fit than TLSF's good fit, which skips this list).
  int fl, sl, scanned = 0;
  mapping(size, fl, sl);
  for (block* b = lists[fl][sl]; b && scanned < 16; b = b->next_free, ++scanned)
    if (b->size >= size && usable(b, x)) return b;
  return find_good_fit(size, x);
}


}  // namespace vmm
