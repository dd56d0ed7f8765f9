// SPDX-License-Identifier: Apache-2.0
// arena: one reserved virtual range, a chunk table, mapping on demand.
//
// A chunk is one physical handle mapped by one backend map() call at one place in the
// reservation. The arena owns: the reservation, the holes (unmapped VA), the chunk table and its
// page map (page = granularity G; page -> chunk in O(1)), a cache of idle physical handles (created,
// not mapped: reused with map + set_access only, skipping create, GMLake's "stitching"), the
// policies applied at its hooks (policy/), and what a refused undo left mapped (strays). It does
// not know about blocks: the heap tells it which chunks are in use (`used` bytes per chunk) and
// asks for chunks to be mapped or given back.
//
// Driver work is a job: planned under the caller's lock, run by one thread with or without it,
// committed under it again (job.cpp).
//   plan     map_range takes a hole, idle handles and room under the memory limit for a mapping;
//            a chunk given back leaves the chunk table and its unmap (and release) joins the job;
//            idle handles to release and retired ranges whose fence completed join it too. No
//            driver call: the VA ranges and handles the job names are its own until commit.
//   run      unmaps, releases, then create -> map -> set_access (vm::mapping_txn::place).
//   commit   the chunks are installed, or the hole and the handles given back (undo); the VA of
//            the unmapped ranges becomes holes; refusals are parked as strays.
// The front end takes the job (take_work) after each call into the heap and runs it after
// dropping its lock: one thread's driver calls hold up no other thread's allocation.
//
// Invariants (checked by check()):
//   holes + chunks + stray mappings + retired ranges + mappings planned tile the reservation
//   page_map[p] == id  <=>  page p lies inside chunk id
//   mapped_bytes == sum(chunk.size),  physical_bytes == mapped + idle + strays + retired held
//                                                        + lent to a planned mapping + releasing
//   free_chunk_bytes == sum(chunk.size | chunk.used == 0)
//
// Thread safety: the caller serialises every call but run() (see above) under its lock.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "arena/tuning.hpp"
#include "policy/policy.hpp"
#include "vm/driver.hpp"
#include "vm/mapping.hpp"
#include "vm/reservation.hpp"
#include "vmmalloc/backend.hpp"
#include "vmmalloc/options.hpp"
#include "vmmalloc/stats.hpp"

namespace vmm {

struct arena_stats {
  std::size_t reserved = 0, mapped = 0, physical = 0, idle = 0, free_chunk_bytes = 0;
  std::size_t peak_mapped = 0, peak_physical = 0;
  std::size_t chunks = 0;
  std::size_t stray_bytes = 0;         // held by work a refused undo left (retried later)
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
  };

  // Driver work planned under the caller's lock (see the top). Everything it names is its own.
  struct job {
    struct unmap {  // a retired range (or a chunk given back), unmapped first
      std::uintptr_t va = 0;
      std::size_t size = 0;
      mem_handle h = 0;  // the handle it maps
      bool done = false;
    };
    struct release {  // a handle released after the unmaps, before any create
      mem_handle h = 0;
      std::size_t size = 0;
      std::uint64_t id = 0;  // the retired ranges of h at plan time carry it (retired::releasing)
      bool done = false;
    };
    std::vector<unmap> unmaps;
    std::vector<release> releases;
    // The mapping (none when size is 0): pieces side by side from va, idle handles first.
    std::uintptr_t va = 0;
    std::size_t size = 0;
    std::uint32_t owner = 0;
    std::uint16_t heap = 0;
    stream_t stream = nullptr;  // where the memory will be used (the requesting heap's)
    // A piece is a retired range's handle whose stream's queued work may still write it: the
    // whole mapping is that stream's until a fence on it completes (the heap tags it so).
    bool in_flight = false;
    bool pressed = false;       // the heap gave free memory back first (free_memory_margin)
    std::vector<vm::piece> pieces;
    std::vector<bool> marked;           // the policies' word on each mapped piece (compression)
    policy::state pol;                  // the policy state at plan time; run() works on a copy
    policy::state pol_after;            // what the create hooks decided (fallbacks), merged at commit
    std::vector<access_desc> access;    // the access table at plan time, and its version
    std::uint64_t access_gen = 0;
    vm::strays strays;                  // what a refused undo or release left (moved to the arena's)
    std::optional<vm::mapping_txn> txn;  // run's mappings, undone at commit if the access table changed
    status st;                          // the mapping's outcome; refusals of unmaps and releases: first
    status refused;
    bool maps() const { return size != 0; }
    bool empty() const { return unmaps.empty() && releases.empty() && !maps(); }
  };

  arena(std::unique_ptr<backend_iface> b, const options& o, const tuning& t = {});
  ~arena();  // runs the pending job, unmaps every chunk, releases every handle, frees the reservation
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

  // ---- plan (under the caller's lock; no driver call) ----
  // Plans mapping `size` bytes (multiple of G) as one or more chunks, contiguous in VA, into the
  // pending job; returns where. With at != 0 the range must start exactly there (extending a span),
  // else it goes in the lowest hole that fits. Idle handles are used first (stitching), those that
  // fill a whole piece (max_piece, or what is left) or are still held by a retired range; the rest
  // is created, smaller idle handles released first. With `mapped` given the range may come out
  // larger: a retired handle (its memory held until its old range is unmapped anyway) bigger
  // than what is left to map is mapped whole rather than released while a new one is created;
  // *mapped says how much. With max_piece != 0 what is created comes as handles of at most that
  // size (rounded up to G). `stream`: where the memory will be used; an idle handle whose retired
  // range another stream's queued work may still touch is not taken (usable_for). Fails
  // (out_of_memory) without a hole or room under the memory limit. One mapping per job: the
  // caller runs the job before planning another.
  // headroom != 0 (with at == 0): the range goes at the top of the highest hole that leaves that
  // many bytes unmapped after it (room to grow in place later), else where it would without.
  result<std::uintptr_t> map_range(std::size_t size, std::uintptr_t at, std::uint32_t owner, stream_t stream,
                                   std::size_t* mapped = nullptr, std::uint16_t heap = 0,
                                   std::size_t max_piece = 0, bool pressed = false, std::size_t headroom = 0);
  // Gives a wholly free chunk back: it leaves the chunk table at once; its handle goes idle
  // (keep_handle) or is released after its range is unmapped. The caller has made sure no stream
  // still uses it.
  void give_back_chunk(std::uint32_t id, bool keep_handle);
  // Retires a free chunk that one stream may still be using: its handle goes to the idle cache at
  // once, to be mapped elsewhere for work later on that same stream (stream order keeps the old
  // work first); its VA stays mapped, out of the holes, until `fence` (recorded on that stream,
  // owned by the arena now) completes, and is unmapped by a later job.
  void retire_chunk(std::uint32_t id, fence_t fence, stream_t stream);
  // The retired ranges whose fences completed join the pending job (wait: their fences are waited
  // for first; wait_out: instead of waiting, the stream of each unfinished fence is added there,
  // to be waited for outside the lock).
  status poll_retiring(bool wait, std::vector<stream_t>* wait_out = nullptr);
  // Releases idle handles (in the pending job) until idle_bytes() <= keep.
  void release_idle(std::size_t keep);
  // Retries what refused undo work parked (before planning, trim, teardown): under the lock, a
  // rare path.
  status retry_strays();

  // ---- run and commit ----
  bool has_work() const { return !work_.empty(); }
  job take_work();
  // The job's driver calls, all or nothing for its mapping; the caller's lock need not be held.
  void run(job& j);
  // Under the lock again: installs the mapping's chunks or undoes it (the access table changed
  // and could not be applied, or run failed), returns the unmapped VA to the holes, parks what the
  // driver refused. Returns the mapping's outcome (ok for a job without one).
  status commit(job& j);

  // Whether [at, at+size) is an unmapped hole right now.
  bool hole_at(std::uintptr_t at, std::size_t size) const;
  // Bytes of unmapped hole from `at` to the hole's end (0 when `at` is mapped).
  std::size_t hole_from(std::uintptr_t at) const;

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

  // The first refusal a job met since the last call (its work was parked).
  status take_parked_error() { status s = parked_error_; parked_error_ = {}; return s; }

  arena_stats stats() const;
  void reset_peaks();
  // Verifies the invariants above; returns "" or what is wrong.
  std::string check() const;

  vm::driver& drv() { return drv_; }
  const options& opts() const { return opt_; }  // as constructed
  const tuning& tune() const { return tune_; }
  // The cap on physical bytes (held + mappings planned): options.memory_limit at construction,
  // then whatever set_memory_limit() stored last. Atomic so a set from any thread needs no lock;
  // a mapping planned under the lock meanwhile checks the old or the new value.
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
  // Moves an idle handle into the pending job's releases; it counts as held (releasing_bytes_)
  // until the job ran. Returns the next idle entry.
  std::multimap<std::size_t, mem_handle>::iterator release_later(std::multimap<std::size_t, mem_handle>::iterator it);
  void note_peaks();
  std::size_t physical_now() const {
    return mapped_ + idle_bytes_ + strays_.bytes() + retired_held_ + inflight_lent_ + releasing_bytes_;
  }
  // What memory_limit is checked against: everything held plus what planned mappings will create.
  std::size_t held_for_limit() const { return physical_now() + (inflight_bytes_ - inflight_lent_); }
  // Takes a chunk out of the table, the page map and the free list: its VA becomes a retired range.
  void retire(std::uint32_t id, fence_t fence, stream_t stream, bool doom);
  void install(const job& j);
  void drop_retired(std::size_t i);  // its range was unmapped: VA back, held bytes settled
  // Queues the release of h (idle, or a doomed chunk's) for the pending job.
  void plan_release(mem_handle h, std::size_t size);
  // Whether h is still mapped by a retired range (fenced_only: one that waits for a stream;
  // after_work: not one the pending job unmaps, before its releases).
  bool aliased(mem_handle h, bool fenced_only = false, bool after_work = false) const;
  // Whether a retired range of h has a fence not yet complete (its stream's work may write h).
  bool in_flight(mem_handle h);
  // Whether idle handle h may be mapped for work on stream s now: no retired range of h waits for
  // another stream's fence. A retired handle serves its own stream at once (stream order puts the
  // old work first); any other stream's work could overlap the old work on the same memory.
  bool usable_for(mem_handle h, stream_t s);

  std::unique_ptr<backend_iface> b_;
  vm::driver drv_;
  options opt_;
  tuning tune_;
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
  vm::strays strays_;                                // refused undo work; stray mappings are no holes
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
    bool unmapping = false;     // a job unmaps it (its entry in job::unmaps)
    // Its handle is released by a job after the unmap: no other range or idle entry holds it, and
    // once released its value may come back from a create before the range leaves retiring_, so
    // it must not match that new handle (aliased, usable_for, plan_release).
    bool doomed = false;
    // A job releases its handle (that job's release id): from the driver's release on, its value
    // may be another handle's, so it matches nothing either; released at commit, or 0 if refused.
    std::uint64_t releasing = 0;
    bool names_live_handle() const { return !released && !releasing && !doomed; }
  };
  std::vector<retired> retiring_;
  std::size_t retired_held_ = 0;  // bytes of released handles still mapped by retired ranges
  std::uint64_t release_ids_ = 0;
  struct lru_list {  // per heap: its free chunks, and every byte it has mapped
    std::uint32_t head = no_chunk, tail = no_chunk;
    std::size_t bytes = 0, mapped = 0;
  };
  void count_mapped(const chunk& c, bool add);
  std::vector<lru_list> lru_;  // per heap

  // The pending job, and every mapping taken and not committed (its VA is no hole and no chunk).
  // All its bytes count against the memory limit; as physical memory (stats, peaks) only the
  // idle handles it took, until it is installed.
  job work_;
  std::map<std::uintptr_t, std::size_t> inflight_;
  std::size_t inflight_bytes_ = 0, inflight_lent_ = 0;
  std::size_t releasing_bytes_ = 0;  // handles set aside for release by a job: held until it ran
  std::size_t compressed_bytes_ = 0;  // mapped bytes the driver granted compression for
  std::size_t mapped_ = 0, idle_bytes_ = 0, free_chunk_bytes_ = 0, chunk_count_ = 0;
  std::size_t peak_mapped_ = 0, peak_physical_ = 0;
  std::uint64_t stitched_ = 0, retired_count_ = 0;
  status parked_error_;
};

}  // namespace vmm
