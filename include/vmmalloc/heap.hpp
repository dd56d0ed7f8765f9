// vmmalloc heap: sub-allocation over the arena. Three paths by size:
//
//   small  (<= options.small_max, default 64 KiB, alignment <= 256): size classes, each served
//          from slabs (one G-aligned page carved into equal slots); free = push the slot index.
//   large  (up to huge_threshold): TLSF-style good fit over "spans" (contiguous mapped VA), O(1)
//          search with two bitmaps, immediate coalescing with free neighbours.
//   huge   (>= huge_threshold, default 256 MiB): a dedicated chunk per allocation, cached on free
//          for a same-size request, unmapped beyond the release threshold.
//
// All metadata lives in host memory: device memory is not readable by the CPU. free(p) finds its
// block in O(1): the page map (page = granularity G) gives the slab of p, or a short chain of the
// blocks that start in that page (bounded: blocks in the large path are > small_max, free
// neighbours are coalesced, so at most ~2 * G / small_max + 1 starts per page).
//
// Streams: a block freed on stream S is tagged S. S reuses it at once; another stream reuses it
// only after a fence recorded on S after the free has completed. The fence is recorded lazily,
// when another stream first wants the block (query only, never a wait on the hot path), so the
// single-stream case costs nothing. Unmapping waits only for the fences of the chunk's blocks.
//
// Invariants (check()):
//   blocks of a span tile it:  b.addr + b.size == b.next_phys.addr
//   no two adjacent free blocks with compatible stream tags (coalesced)
//   every free block is in the free list of its class, every listed block is free
//   chunk.used == sum of live block bytes overlapping the chunk
//   allocated == sum(live block sizes) + sum(live slot sizes), requested likewise
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "vmmalloc/arena.hpp"

namespace vmm {

struct heap_stats {
  std::size_t requested = 0, allocated = 0;            // live bytes asked for / handed out (rounded)
  std::size_t peak_requested = 0, peak_allocated = 0;
  std::uint64_t allocs = 0, frees = 0, live = 0;
  std::size_t slab_bytes = 0;                          // bytes of pages held by slabs
  std::uint64_t slabs = 0, huge_live = 0, deferred = 0;  // deferred: frees waiting on fences
  std::uint64_t grows = 0, chunk_releases = 0, trims = 0;
};

class heap {
 public:
  explicit heap(arena& a);
  ~heap();
  heap(const heap&) = delete;
  heap& operator=(const heap&) = delete;

  // n >= 1, align a power of two >= 1 (raised to 256). Returns the address or 0 + status.
  result<std::uintptr_t> allocate(std::size_t n, std::size_t align, stream_t s);
  // Errors (state untouched): invalid_pointer for foreign, interior, or already-freed pointers.
  status deallocate(std::uintptr_t p, stream_t s);
  // The block is also used on `s`: its free waits for a fence on `s` too.
  status record_stream(std::uintptr_t p, stream_t s);
  // Bytes usable at p (0 if p is not a live allocation) and bytes requested for it.
  std::size_t usable_size(std::uintptr_t p) const;

  // Releases empty slabs, wholly free chunks and idle handles until kept bytes <= keep.
  status trim(std::size_t keep);

  heap_stats stats() const;
  void reset_peaks();
  std::string check() const;


 private:
  struct impl;
  std::unique_ptr<impl> p_;
};

}  // namespace vmm
