// SPDX-License-Identifier: Apache-2.0
// arena: one reserved virtual range, a chunk table, mapping on demand.
//
// A chunk is one physical handle mapped by one backend map() call at one place in the
// reservation. The arena owns: the reservation, the holes (unmapped VA), the chunk table and its
// page map (page = granularity G; page -> chunk in O(1)), a cache of idle physical handles (created,
// not mapped: reused with map + set_access only, skipping create, GMLake's "stitching"), the
// policies applied at its hooks (policy/), and what a refused rollback left mapped (strays). It
// does not know about blocks: the heap tells it which chunks are in use (`used` bytes per chunk)
// and asks for chunks to be mapped or released. Every driver call goes through vm::driver, which
// counts it.
//
// Invariants (checked by check()):
//   holes + chunks + stray mappings tile the reservation exactly, without overlap
//   page_map[p] == id  <=>  page p lies inside chunk id
//   mapped_bytes == sum(chunk.size),  physical_bytes == mapped_bytes + idle_bytes + stray bytes
//   free_chunk_bytes == sum(chunk.size | chunk.used == 0)
//
// Every multi-step operation (create -> map -> set_access) is all or nothing (vm::mapping_txn):
// a failed map_range leaves chunks, idle handles and holes as before; what the driver refused to
// undo is parked as a stray, its VA kept out of the holes until a retry succeeds.
//
// Thread safety: the front end serialises heap and arena under its lock, except run_growth(): the
// driver calls of a growth the front end asked to defer, made without that lock (see below).
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "policy/policy.hpp"
#include "vm/driver.hpp"
#include "vm/mapping.hpp"
#include "vm/reservation.hpp"
#include "vmmalloc/backend.hpp"
#include "vmmalloc/options.hpp"
#include "vmmalloc/stats.hpp"

namespace vmm {

// Steady-clock nanoseconds: the timestamps of idle decay (options.idle_decay_ms).
inline std::int64_t steady_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

struct arena_stats {
  std::size_t reserved = 0, mapped = 0, physical = 0, idle = 0, free_chunk_bytes = 0;
  std::size_t peak_mapped = 0, peak_physical = 0;
  std::size_t chunks = 0;
  std::size_t stray_bytes = 0;         // held by work a refused rollback left (retried later)
  std::size_t retiring_bytes = 0;      // VA of retired chunks still mapped until their stream's fence
  std::uint64_t retired = 0;           // chunks retired (their memory reused while a stream ran behind)
  std::uint64_t stitched = 0;          // chunks mapped from idle handles (no create)
  std::uint64_t compression_fallbacks = 0;
  std::size_t compressed = 0;          // mapped bytes that the driver made compressible
  std::uint64_t ipc_fallbacks = 0;     // fabric asked, POSIX fd used (not supported / not permitted)
  std::uint64_t access_changes = 0;    // grant/revoke calls that changed the access table
  driver_counts calls;
};

class arena {
 public:
  static constexpr std::uint32_t no_chunk = std::numeric_limits<std::uint32_t>::max();

  struct chunk {
    std::uintptr_t va = 0;
    std::size_t size = 0;       // 0 = slot unused
    mem_handle handle = 0;
    std::size_t used = 0;       // bytes of live blocks in this chunk (maintained by the heap)
    std::uint32_t lru_prev = no_chunk, lru_next = no_chunk;  // list of wholly free chunks
    std::uint32_t owner = 0;    // heap's tag for this chunk (0 = heap-managed span, 1 = huge, ...)
    std::uint16_t heap = 0;     // which heap owns it (0: the allocator's; others: graph pools)
    bool compressed = false;    // what the driver granted (compression policy)
    std::int64_t free_since = 0;  // steady-clock ns when it joined the free list (idle_decay_ms only)
  };

  arena(std::unique_ptr<backend_iface> b, const options& o);
  ~arena();  // unmaps every chunk, releases every handle, frees the reservation
  arena(const arena&) = delete;
  arena& operator=(const arena&) = delete;

  // Runs the policies' open hooks and reserves the range. Must succeed before anything else.
  status open();

  std::size_t granularity() const { return gran_; }
  std::uintptr_t base() const { return res_.base(); }
  std::size_t reservation_size() const { return res_.size(); }
  bool contains(std::uintptr_t a) const { return res_.contains(a); }
  std::size_t page_of(std::uintptr_t a) const { return (a - res_.base()) >> gran_shift_; }  // G is 2^k
  std::size_t pages() const { return page_map_.size(); }

  // O(1): the chunk mapped at a (no_chunk if none).
  std::uint32_t chunk_at(std::uintptr_t a) const {
    return contains(a) ? page_map_[page_of(a)] : no_chunk;
  }
  chunk& get(std::uint32_t id) { return chunks_[id]; }
  std::uint32_t chunk_slots() const { return static_cast<std::uint32_t>(chunks_.size()); }
  const chunk& get(std::uint32_t id) const { return chunks_[id]; }

  // Maps `size` bytes (multiple of G) as one or more chunks, contiguous in VA. With at != 0 the
  // range must start exactly there (extending a span), else it goes in the lowest hole that fits.
  // Idle handles are used first (stitching); the rest is created. Returns the VA, or 0 + status.
  // With `mapped` given the range may come out larger: a retired handle (its memory held until its
  // old range is unmapped anyway) bigger than what is left to map is mapped whole rather than
  // released while a new one is created; *mapped says how much was mapped. With max_piece != 0
  // what is created comes as handles of at most that size (rounded up to G). `stream`: where the
  // memory will be used; an idle handle whose retired range another stream's queued work may
  // still touch is not mapped for it (see usable_for).
  result<std::uintptr_t> map_range(std::size_t size, std::uintptr_t at, std::uint32_t owner, stream_t stream,
                                   std::size_t* mapped = nullptr, std::uint16_t heap = 0,
                                   std::size_t max_piece = 0);
  // ---- growth outside the front end's lock ----
  // With defer_growth(true), a map_range that needs driver calls does only the bookkeeping: it
  // takes the hole and the idle handles it will map, counts what it will create against the
  // memory limit, parks the rest as a pending growth and fails with errc::other ("deferred").
  // The front end takes the growth, drops its lock, runs the driver calls (run_growth: create,
  // map, set_access), takes the lock again and installs the chunks (finish_growth). Other threads
  // allocate from what is mapped meanwhile; the hole and the handles are nobody else's. Without
  // defer_growth, map_range runs the same growth at once, under the caller's lock: one path for
  // the driver calls and their rollback.
  struct growth {
    struct piece {
      std::size_t size = 0;
      mem_handle h = 0;     // 0 until run_growth creates it
      bool created = false;  // created for this growth (else an idle handle)
      bool marked = false;   // the compression policy's word on the mapped handle
    };
    std::uintptr_t va = 0;
    std::size_t size = 0;
    std::uint32_t owner = 0;
    std::uint16_t heap = 0;
    std::vector<piece> pieces;
    std::vector<access_desc> access;  // the access table when it was taken
    std::uint64_t access_gen = 0;     // its version (policy state's access_changes)
    vm::strays strays;                // what a refused rollback left (moved to the arena's)
    std::vector<vm::mapping_txn::lent> returned;  // idle handles a rollback gave back
    status st;                        // run_growth's result
    // Retired ranges whose fences completed (or with none: evicted for stitching), unmapped by
    // run_growth in a round before the growth that needs their VA (pieces empty). Their VA
    // returns in finish_growth; one the driver refused stays retired for the next poll.
    struct unmap {
      std::uintptr_t va = 0;
      std::size_t size = 0;
      fence_t fence = 0;
      bool done = false;
      mem_handle h = 0;  // the handle it maps
    };
    std::vector<unmap> unmaps;
    // Handles to release (outside the lock: a release of a large handle takes up to ~0.6 ms):
    // idle ones that could not serve this growth, released before its creates, or the handles of
    // chunks a free gave back (park_releases). A refused one is parked as a stray.
    struct release {
      mem_handle h = 0;
      std::size_t size = 0;
    };
    std::vector<release> releases;
    // The requesting heap's own: the stream and whether the growth gave memory back first.
    stream_t stream = nullptr;
    bool pressed = false;
  };
  // While a free runs (release_threshold, idle decay): chunks it gives back are retired with no
  // fence and their handles set aside instead of unmapped and released under the lock;
  // park_releases() then makes those driver calls a growth of their own (pieces empty), which the
  // front end runs outside its lock.
  // ready_unmaps: also the unmaps of retired ranges whose streams caught up (trim), which a free
  // leaves to the next growth (each would cost a fence query).
  void defer_releases(bool on) { defer_rel_ = on && !whole_chunks_; }
  bool park_releases(bool ready_unmaps = false);
  // defer_growth(false) ends a try: a retry's eviction mark goes with it.
  void defer_growth(bool on) {
    defer_ = on;
    if (!on) evicted_ = false;
  }
  // After a round of unmaps alone: the try that parked it chose which chunks to evict; the retry
  // places the growth without evicting again (the same choice the locked path makes in one try).
  bool evicted_for_retry() const { return evicted_; }
  // An exportable policy maps under the lock: its IPC kind may fall back on a create.
  bool deferring() const { return defer_ && !whole_chunks_; }
  growth* pending_growth() { return pending_ ? &*pending_ : nullptr; }
  growth take_growth();
  // Releases, creates, maps and grants access, all or nothing (g.st); without the front end's
  // lock when the growth was deferred.
  void run_growth(growth& g);
  // Under the lock again: installs the chunks, or gives the hole and the handles back. Fails
  // when run_growth did, or the access table changed meanwhile and could not be applied.
  status finish_growth(growth& g);

  // Whether [at, at+size) is an unmapped hole right now.
  bool hole_at(std::uintptr_t at, std::size_t size) const;

  // Unmaps a chunk; its handle goes to the idle cache when keep_handle, else it is released. The
  // VA returns to the holes. The caller has made sure no stream still uses it.
  status unmap_chunk(std::uint32_t id, bool keep_handle);
  // Retires a free chunk that one stream may still be using: its handle goes to the idle cache at
  // once, to be mapped elsewhere for work later on that same stream (stream order keeps the old
  // work first); its VA stays mapped, out of the holes, until `fence` (recorded on that stream,
  // owned by the arena now) completes. No driver call but the fence; the unmap comes later.
  // doom: its handle is released once its range is unmapped (defer_releases), not kept idle.
  void retire_chunk(std::uint32_t id, fence_t fence, stream_t stream = nullptr, bool count = true,
                    bool doom = false);
  // A free chunk whose handle a growth is about to map elsewhere (stitching): unmap_chunk, or,
  // while a growth is being deferred, retired with no fence, so that growth unmaps the old range
  // with its own driver calls outside the lock (growth::unmaps). No stream uses it.
  status evict_chunk(std::uint32_t id, bool keep_handle);
  // Unmaps retired ranges whose fences completed (wait: waits for them first). Their VA returns to
  // the holes. Called before mapping, by release_idle, trim and teardown. wait_out: instead of
  // waiting, the stream of each unfinished fence is added there (waited for outside the lock). While
  // releases or a growth are deferred the unmaps are left to the parked round.
  status poll_retiring(bool wait, std::vector<stream_t>* wait_out = nullptr);

  // Heap bookkeeping: bytes of live blocks per chunk; a chunk at 0 joins the free-chunk LRU.
  void add_used(std::uint32_t id, std::size_t n);
  void sub_used(std::uint32_t id, std::size_t n);
  // Wholly free chunks, per owning heap (oldest first), and their bytes; without a heap, all.
  std::uint32_t oldest_free_chunk(std::uint16_t heap) const { return heap < lru_.size() ? lru_[heap].head : no_chunk; }
  std::size_t free_chunk_bytes(std::uint16_t heap) const { return heap < lru_.size() ? lru_[heap].bytes : 0; }
  std::size_t free_chunk_bytes() const { return free_chunk_bytes_; }
  std::size_t mapped_bytes(std::uint16_t heap) const { return heap < lru_.size() ? lru_[heap].mapped : 0; }
  // Which heap owns the chunk mapped at a (0 when none: the caller's heap then reports the pointer).
  std::uint16_t heap_at(std::uintptr_t a) const {
    const std::uint32_t id = chunk_at(a);
    return id == no_chunk ? 0 : chunks_[id].heap;
  }
  std::size_t idle_bytes() const { return idle_bytes_; }
  // Idle bytes in handles of at most n bytes each: what a range of n bytes can be stitched from.
  std::size_t idle_bytes_at_most(std::size_t n) const {
    std::size_t b = 0;
    for (auto it = idle_.begin(); it != idle_.end() && it->first <= n; ++it) b += it->first;
    return b;
  }

  // Lending idle handles to a growable_buffer that shares this arena's pool (growable_buffer::
  // shared). lend_idle: the largest idle handle of at most max bytes, not one whose retired range
  // is still mapped (its old work is ordered on a stream the buffer knows nothing of); false when
  // none. take_back: a handle the buffer no longer maps joins the idle cache, unless holding it
  // would pass memory_limit (false: the buffer releases it).
  bool lend_idle(std::size_t max, mem_handle& h, std::size_t& size);
  bool take_back(mem_handle h, std::size_t size);

  // Releases idle handles until idle_bytes() <= keep; retries parked strays first. keep_retired:
  // leave handles whose retired range is still mapped (releasing them frees nothing yet).
  status release_idle(std::size_t keep, bool keep_retired = false);
  // Retries what a refused rollback or release parked (trim, before mapping, teardown).
  status retry_strays();

  // The first release the backend refused since the last call (its handle was parked).
  status take_parked_error() { status s = parked_error_; parked_error_ = {}; return s; }

  arena_stats stats() const;
  void reset_peaks();
  // Verifies the invariants above; returns "" or what is wrong.
  std::string check() const;

  vm::driver& drv() { return drv_; }
  const options& opts() const { return opt_; }  // as constructed
  // The cap on physical bytes (held + growths in flight): options.memory_limit at construction,
  // then whatever set_memory_limit() stored last. Atomic so a set from any thread needs no lock;
  // a growth planned under the lock meanwhile checks the old or the new value.
  std::size_t memory_limit() const { return limit_.load(std::memory_order_relaxed); }
  void set_memory_limit(std::size_t bytes) { limit_.store(bytes, std::memory_order_relaxed); }
  const chunk_props& props() const { return pol_.props; }
  std::span<const access_desc> access() const { return pol_.access; }
  // Placement policy: every allocation owns whole chunks (an exportable policy).
  bool whole_chunks() const { return whole_chunks_; }

  // Run-time access policy: gives `device` `mode` (access_mode::none revokes) on every mapped
  // chunk and on all future mappings. One set_access per contiguous mapped run, not per chunk.
  // The owner device cannot be changed; a device that cannot access the owner, or whose
  // granularity is larger than the arena's, is refused with the table untouched. On a failure
  // part-way, runs already changed are set back (all or nothing).
  status set_peer_access(int device, access_mode mode);
  // Mapped runs (maximal VA ranges of adjacent chunks), in address order.
  std::vector<std::pair<std::uintptr_t, std::size_t>> mapped_runs() const;

  // The shareable handle of a chunk (ipc policy only): an fd the caller owns, or fabric bytes.
  result<shareable_handle> export_chunk(std::uint32_t id);

 private:
  std::uint32_t new_chunk_slot();
  void lru_push(std::uint32_t id);
  void lru_remove(std::uint32_t id);
  void take_hole(std::uintptr_t va, std::size_t size);
  void give_hole(std::uintptr_t va, std::size_t size);
  void idle_put(mem_handle h, std::size_t size);
  void release_or_park(mem_handle h, std::size_t size);  // a refused release parks h as a stray
  // Moves an idle handle onto a list a growth releases outside the lock; it counts as held
  // (releasing_bytes_) until then. Returns the next idle entry.
  std::multimap<std::size_t, mem_handle>::iterator doom_idle(std::multimap<std::size_t, mem_handle>::iterator it,
                                                             std::vector<growth::release>& to);
  void note_peaks();
  std::size_t physical_now() const {
    return mapped_ + idle_bytes_ + strays_.bytes() + retired_held_ + inflight_lent_ + releasing_bytes_;
  }
  // What memory_limit is checked against: everything held plus what growths in flight will create.
  std::size_t held_for_limit() const { return physical_now() + (inflight_bytes_ - inflight_lent_); }
  void install(std::uintptr_t va, const std::vector<growth::piece>& pieces, std::uint32_t owner, std::uint16_t heap);
  void finish_unmaps(growth& g);  // the VA of the retired ranges run_growth unmapped comes back
  void finish_releases(growth& g);  // the held bytes of what run_growth released (or parked)
  bool park_unmaps();             // a growth of the ready retired ranges' unmaps alone
  // The retired ranges whose fence completed (or that have none) join g.unmaps, marked unmapping.
  void take_ready_unmaps(growth& g);

  std::unique_ptr<backend_iface> b_;
  vm::driver drv_;
  options opt_;
  std::atomic<std::size_t> limit_;  // memory_limit()
  policy::list policies_;
  policy::state pol_;
  bool whole_chunks_ = false;
  std::size_t gran_ = 0;
  unsigned gran_shift_ = 0;
  vm::reservation res_;

  std::vector<std::uint32_t> page_map_;
  std::vector<chunk> chunks_;
  std::vector<std::uint32_t> free_slots_;
  std::map<std::uintptr_t, std::size_t> holes_;      // unmapped VA: start -> size
  std::multimap<std::size_t, mem_handle> idle_;      // created, unmapped handles by size
  vm::strays strays_;                                // refused rollback work; stray mappings are no holes
  // Retired chunks: VA still mapped (the handle also sits idle or maps elsewhere) until the fence.
  struct retired {
    std::uintptr_t va;
    std::size_t size;
    mem_handle h;
    fence_t fence;
    // The release of the handle meanwhile (0: none): its memory returns with the unmap of the
    // last range it marks. One handle may be mapped by several retired ranges (retired, mapped
    // elsewhere, retired again); a release marks them all with one id, and the driver may hand
    // the same handle value out again later, so ids, not handles, say what was freed together.
    std::uint64_t released = 0;
    stream_t stream = nullptr;  // where `fence` was recorded (a wait outside the lock records another)
    bool unmapping = false;  // a growth in flight unmaps it (see growth::unmaps)
    // Its handle is released by a growth after the unmap (doomed_): no other range or idle entry
    // holds it, and once released outside the lock its value may come back from a create before
    // the range leaves retiring_, so it must not match that new handle (aliased, note_release).
    bool doomed = false;
  };
  std::vector<retired> retiring_;
  std::size_t retired_held_ = 0;  // bytes of released handles still mapped by retired ranges
  std::uint64_t release_ids_ = 0;
  void drop_retired(std::size_t i);  // its range was unmapped: VA back, held bytes settled
  bool note_release_of_aliased(mem_handle h, std::size_t size);
  // Whether h is still mapped by a retired range (fenced_only: one that waits for a stream; an
  // evicted chunk's range, retired with no fence, is unmapped by the growth in flight).
  bool aliased(mem_handle h, bool fenced_only = false) const;
  // Whether idle handle h may be mapped for work on stream s now: no retired range of h waits for
  // another stream's fence. A retired handle serves its own stream at once (stream order puts the
  // old work first); any other stream's work could overlap the old work on the same memory.
  bool usable_for(mem_handle h, stream_t s);
  struct lru_list {  // per heap: its free chunks, and every byte it has mapped
    std::uint32_t head = no_chunk, tail = no_chunk;
    std::size_t bytes = 0, mapped = 0;
  };
  void count_mapped(const chunk& c, bool add);
  std::vector<lru_list> lru_;  // per heap

  // Growth outside the lock: the one map_range parked, and every growth taken and not finished
  // (its VA is no hole and no chunk). All its bytes count against the memory limit; as physical
  // memory (stats, peaks) only the idle handles it took, until it is installed.
  bool defer_ = false;
  bool evicted_ = false;  // see evicted_for_retry()
  std::optional<growth> pending_;
  std::map<std::uintptr_t, std::size_t> inflight_;
  std::size_t inflight_bytes_ = 0, inflight_lent_ = 0;
  std::size_t releasing_bytes_ = 0;  // handles set aside for release (doomed_, growths in flight): held until then
  bool defer_rel_ = false;           // see defer_releases()
  std::vector<growth::release> doomed_;  // handles of chunks a free gave back, released by park_releases' growth
  std::size_t compressed_bytes_ = 0;  // mapped bytes the driver granted compression for
  std::size_t mapped_ = 0, idle_bytes_ = 0, free_chunk_bytes_ = 0, chunk_count_ = 0;
  std::size_t peak_mapped_ = 0, peak_physical_ = 0;
  std::uint64_t stitched_ = 0, retired_count_ = 0;
  status parked_error_;
};

}  // namespace vmm
