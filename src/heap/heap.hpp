// SPDX-License-Identifier: Apache-2.0
// vmmalloc heap: sub-allocation over the arena. Three paths by size:
//
//   small  (<= tuning::small_max, 64 KiB, alignment <= 256): size classes, each served
//          from slabs (a block of 1-8 units of G / 8, aligned to its size, carved into equal
//          slots: at least 32); free = push the slot index.
//   large  (up to tuning::huge_threshold): TLSF-style good fit over "spans" (contiguous mapped VA), O(1)
//          search with two bitmaps, immediate coalescing with free neighbours.
//   huge   (>= huge_threshold, 128 MiB): dedicated chunks per allocation (handles of at
//          most tuning::max_handle), cached on free for a same-size request, grown in place for a
//          slightly larger one, unmapped beyond the release threshold.
//
// All metadata lives in host memory: device memory is not readable by the CPU. free(p) finds its
// block in O(1): the unit map (G / 8) gives the slab of p, else the page map (page = granularity
// G) a short chain of the blocks that start in that page (bounded: blocks in the large path are
// > small_max, free neighbours are coalesced, so at most ~2 * G / small_max + 1 starts per page).
//
// Streams: a block freed on stream S is tagged S. S reuses it at once; another stream reuses it
// only after a fence recorded on S after the free has completed. The fence is recorded lazily,
// when another stream first wants the block (query only, never a wait on the hot path), so the
// single-stream case costs nothing. Unmapping waits only for the fences of the chunk's blocks.
//
// Invariants (check()):
//   blocks of a span tile it:  b.addr + b.size == b.next_phys.addr
//   no span starts where another ends (they are one span)
//   no two adjacent free blocks with compatible stream tags (coalesced)
//   every free block is in the free list of its class, every listed block is free
//   chunk.used == sum of live block bytes overlapping the chunk
//   allocated == sum(live block sizes) + sum(live slot sizes), requested likewise
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "arena/arena.hpp"

namespace vmm {

struct heap_stats {
  std::size_t requested = 0, allocated = 0;            // live bytes asked for / handed out (rounded)
  std::size_t peak_requested = 0, peak_allocated = 0;
  std::uint64_t allocs = 0, frees = 0, live = 0;
  std::size_t slab_bytes = 0;                          // bytes of pages held by slabs
  std::uint64_t slabs = 0, huge_live = 0, deferred = 0;  // deferred: frees waiting on fences
  std::uint64_t grows = 0, chunk_releases = 0, trims = 0;
  std::uint64_t exported_released = 0;  // exported allocations freed (chunks released, not reused)
  std::uint64_t reclaims = 0;           // out-of-memory paths that gave free memory back and retried
  std::uint64_t chunks_retired = 0;     // free chunks reused while their stream still ran behind
  std::uint64_t margin_trims = 0;       // growths that gave free memory back first (free_memory_margin)
};

// How far a request may go for memory it does not find mapped.
enum class grow_mode : std::uint8_t {
  never,        // what is mapped, or nothing (the front end takes thread caches' blocks back first)
  normal,       // plans a growth in the arena's job: geometric, stitching free chunks' handles
  last_resort,  // after a growth the driver refused: everything free goes back first, then a
                // growth of exactly what the request needs
};

class heap {
 public:
  // id: this heap's tag on the arena's chunks (0: the allocator's; graph pools get their own).
  explicit heap(arena& a, std::uint16_t id = 0);
  ~heap();
  heap(const heap&) = delete;
  heap& operator=(const heap&) = delete;

  // What a request gets: the address; or a growth planned in the arena's pending job (grows: the
  // caller runs the job, commits it, hands the mapping to adopt() and asks again); or neither
  // (grow_mode::never found no fit); or an error.
  struct outcome {
    std::uintptr_t addr = 0;
    status st;
    bool grows = false;
  };
  // n >= 1, align a power of two >= 1 (raised to 256). Before it reports out_of_memory it
  // reclaims what it holds free (empty slabs, free chunks, idle handles, deferred frees whose
  // fences completed) and tries once more.
  outcome allocate(std::size_t n, std::size_t align, stream_t s, grow_mode g = grow_mode::normal);
  // Errors (state untouched): invalid_pointer for foreign, interior, or already-freed pointers.
  status deallocate(std::uintptr_t p, stream_t s);
  // The block is also used on `s`: its free waits for a fence on `s` too.
  status record_stream(std::uintptr_t p, stream_t s);
  // Export (ipc policy): the chunks under the live allocation starting at p, in VA order, its
  // requested bytes and where it starts in the first chunk. With whole chunks it marks the block
  // exported: when freed its chunks are released, never reused, so an importer that still maps
  // them sees nothing but this allocation. Without (tuning::ipc_whole_chunks off) the chunks hold
  // neighbours too, and are reused as usual once the block is freed.
  status export_chunks(std::uintptr_t p, std::vector<std::uint32_t>& chunk_ids, std::size_t& bytes,
                       std::size_t& offset);
  // Bytes usable at p (0 if p is not a live allocation) and bytes requested for it.
  std::size_t usable_size(std::uintptr_t p) const;

  // Bytes requested for the live allocation at p (0 if none).
  std::size_t requested_size(std::uintptr_t p) const;
  // Per size class: slabs, slots, used slots, live bytes. Walks the page map (slow path).
  std::vector<class_occupancy> occupancy() const;
  span_free_stats span_free() const;
  // Appends this heap's spans and huge blocks to `out` as segments tagged `pool` (in no order),
  // every block and slab slot with its state in address order. Walks all metadata: diagnostics.
  void memory_map(std::uint64_t pool, std::vector<segment_info>& out) const;

  // A growth this heap planned, run and committed: its memory joins the heap free, for the request
  // asked again. growth_refused: the driver refused it; the next growth starts small.
  void adopt(const arena::job& j);
  void growth_refused(const arena::job& j);

  // Releases empty slabs, wholly free chunks and idle handles until kept bytes <= keep.
  status trim(std::size_t keep);

  // Waits for streams, outside the front end's lock. While on, trim() and the out-of-memory
  // reclaim do not wait for a stream's fence: they skip what it still uses and note the stream;
  // take_waits() hands the streams over. The front end records a fence on each (order_point()
  // says which frees it covers), waits for it without the lock, then note_waited() marks those
  // frees safe, and the call is made again.
  void defer_waits(bool on);
  std::vector<stream_t> take_waits();
  std::uint64_t order_point() const;
  void note_waited(stream_t s, std::uint64_t point);

  heap_stats stats() const;
  std::uint16_t id() const;  // its tag on the arena's chunks
  // A graph pool's heap keeps every byte it mapped where it is until released: a captured graph
  // replays on the addresses of blocks freed during its capture too. No stitching, no release
  // threshold, no trim, no reclaim while private.
  void set_private(bool on);
  void reset_peaks();
  // Its own structures and chunks; the arena's invariants are arena::check().
  // requested_outside: requested bytes the front end's thread caches account for (mod 2^64).
  // exact_requested = false: skip the requested-bytes sum (thread caches may be changing it).
  std::string check(std::uint64_t requested_outside = 0, bool exact_requested = true) const;

  // ---- thread-cache support (front end) ----
  // A slab slot's metadata, readable without the lock while the slot is live or cached.
  struct slot_ref {
    std::atomic<std::uint16_t>* state = nullptr;  // tag | 0 free, 1 user, 2 thread cache, 3 user + record_stream
    std::atomic<std::uint32_t>* req = nullptr;    // requested bytes
    std::uint32_t size = 0, cls = 0;
    stream_t stream = nullptr;                    // the slab's stream
    std::uint16_t tag = 0;                        // the slab's tag (high byte of each state word)
    const std::atomic<std::uint32_t>* seq = nullptr;  // the slab's set-up count, and its value
    std::uint32_t seq_at = 0;                         // when this reference was read
    std::uint16_t word(std::uint8_t st) const { return static_cast<std::uint16_t>(tag | st); }
    // Whether the slab is still the one this reference was read from (a kept reference is
    // reused without the page-map lookup only then; the tag alone wraps after 256 set-ups).
    bool current() const { return seq->load(std::memory_order_acquire) == seq_at; }
  };
  int small_class(std::size_t n) const noexcept;  // -1: n takes another path
  std::size_t class_size(int cls) const noexcept;  // a slot's bytes in class cls
  // Lock-free: false when p is no slot start, or the slab changed while being read (then the
  // locked path decides).
  bool small_slot(std::uintptr_t p, slot_ref& r) const noexcept;
  // Under the caller's lock: hand out up to max slots of a class in state 2 (counted as allocated
  // with 0 requested bytes; got says how many), and take cached slots (state 2, req 0) back.
  // tag: the calling thread cache (see set_cache_tag); its refills come from slabs it owns. A new
  // slab's growth ends the refill (outcome::grows).
  outcome refill(int cls, stream_t s, std::uintptr_t* out, std::size_t max, std::uint64_t tag, grow_mode g,
                 std::size_t& got);
  void set_cache_tag(std::uint64_t tag, bool alive);
  void flush(const std::uintptr_t* p, std::size_t n);

  // ---- thread-cache support for large and huge blocks ----
  // A thread cache keeps the block it handed out last: freed by that thread, the block stays the
  // cache's (no lock), and the thread's next request of the same size takes it back (no lock).
  // Pairs of any size then scale with threads. The block word (see heap_impl.hpp) arbitrates
  // with frees on other threads and with double frees.
  struct block_ref {
    void* blk = nullptr;      // opaque: the block's metadata (type-stable)
    std::uint64_t gen = 0;    // its generation << 8
    std::size_t size = 0;     // usable bytes
    stream_t stream = nullptr;
  };
  // Under the lock: allocate() for a block a thread cache may take without the lock later. Its
  // requested bytes are left to the cache's counters.
  outcome allocate_cacheable(std::size_t n, std::size_t align, stream_t s, grow_mode g, block_ref& ref);
  // Lock-free, by the cache's thread: the user's block becomes the cache's (requested 0), or the
  // cache's the user's again (requested n). false: something changed it first (then lock).
  // A claimed block is the thread's alone until cache_publish() makes it one the heap may take
  // back (what must happen before that, the free's trace event, happens in between).
  static bool cache_claim(const block_ref& r);
  static void cache_publish(const block_ref& r);
  static bool cache_reuse(const block_ref& r, std::size_t n);
  // Under the lock: a cached block goes back to the heap (freed on its stream). false: it was
  // not cached (reused by its thread, or taken back already); nothing changes.
  bool cache_return(std::uintptr_t p, const block_ref& r);


 private:
  result<std::uintptr_t> allocate_once(std::size_t n, std::size_t align, stream_t s);
  struct impl;
  std::unique_ptr<impl> p_;
};

}  // namespace vmm
