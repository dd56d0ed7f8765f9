// SPDX-License-Identifier: Apache-2.0
// vmmalloc statistics: what allocator::stats() and class_stats() report.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace vmm {

// Backend calls, attempts counted (a retry is a second call), by kind. Counted in one place: the
// mapping layer's driver wrapper (src/vm/driver.hpp).
struct driver_counts {
  // Memory management: what total() sums (each ~1-600 us on the driver, docs/performance.md).
  std::uint64_t reserve = 0, free_reservation = 0, create = 0, release = 0, map = 0, unmap = 0,
                set_access = 0, export_handle = 0, import_handle = 0;
  // Queries and stream fences: cheap, counted apart.
  std::uint64_t granularity = 0, query = 0, mem_info = 0, record_fence = 0, fence_query = 0,
                wait_fence = 0;
  std::uint64_t failures = 0;  // calls of any kind the backend refused
  // Wall time inside the calls (a steady clock read around each, ~50 ns next to 1-600 us): where
  // a process's allocation time goes. fence_ns: recording, querying and waiting for fences (a wait
  // is the GPU catching up); ns: every other call.
  std::uint64_t ns = 0, fence_ns = 0;
  std::uint64_t total() const {
    return reserve + free_reservation + create + release + map + unmap + set_access +
           export_handle + import_handle;
  }
};

// Every value is exact. requested / allocated are the caches' and the heap's counters folded when
// read (exact when no other thread is allocating meanwhile). There is no peak of them: the thread
// caches serve an allocation without a write any other thread sees, and the peak of a sum over
// threads cannot be known without one (a shared counter costs 2-6x on the hot path's pair). The
// peaks of what the allocator holds (mapped, physical) are exact: they change under its lock.
// libvmmalloc_torch counts requested and allocated bytes of PyTorch's tensors, with their peaks,
// on each of its calls (what torch.cuda.max_memory_allocated reads).
struct allocator_stats {
  // bytes: current and peak
  std::size_t requested = 0, allocated = 0, mapped = 0, physical = 0, reserved = 0;
  std::size_t peak_mapped = 0, peak_physical = 0;
  std::size_t chunks = 0, idle = 0, free_chunk_bytes = 0, slab_bytes = 0;
  std::uint64_t allocs = 0, frees = 0, live = 0, deferred = 0;
  std::uint64_t grows = 0, chunk_releases = 0, trims = 0, stitched = 0, compression_fallbacks = 0;
  std::uint64_t reclaims = 0;           // out-of-memory paths that gave free memory back and retried
  std::uint64_t margin_trims = 0;       // growths that gave free memory back first because the
                                        // device's free memory was below options.free_memory_margin
  // Free chunks whose memory served a request of the stream that freed them while that stream's
  // work was still running (the GPU behind the CPU); their old VA stays mapped until it is done.
  std::uint64_t chunks_retired = 0;
  std::size_t retiring = 0;             // bytes of VA of such chunks not yet unmapped
  std::uint64_t pools = 0;              // graph pools alive (begun, or released with live blocks)
  std::size_t pool_allocated = 0;       // bytes of live blocks in graph pools (inside `allocated`)
  std::size_t pool_held = 0;            // mapped bytes owned by graph pools (inside `mapped`)
  std::size_t compressed = 0;           // mapped bytes the driver granted compression for
  std::uint64_t ipc_fallbacks = 0;      // fabric asked for, POSIX fds used
  std::uint64_t access_changes = 0;     // grant/revoke calls that changed the access table
  std::uint64_t exported = 0;           // export_ipc calls that succeeded
  std::uint64_t exported_released = 0;  // exported allocations freed (chunks released, never reused)
  std::uint64_t traced_events = 0;      // events written by trace recording (options.trace_path)
  // 1 - requested / mapped: the share of mapped memory not holding requested bytes (0 when
  // nothing is mapped). Rounding, free blocks in spans, slabs' free slots and cached chunks.
  double fragmentation = 0;
  driver_counts calls;                  // calls.map / calls.unmap: chunk maps and unmaps
};

// Occupancy of one size class (small path), for diagnostics.
struct class_occupancy {
  std::size_t slot_size = 0;      // bytes per slot
  std::size_t slabs = 0;          // slabs (one page each) of this class
  std::size_t slots = 0;          // slots in those slabs
  std::size_t used_slots = 0;     // slots not free in the heap: live, thread-cached or pending free
  std::size_t cached_slots = 0;   // of which held by thread caches
  std::size_t live_bytes = 0;     // bytes requested by the live slots
};

// Free blocks inside mapped spans (the large path), for diagnostics: what a request larger than
// `largest` cannot use without new memory, although `whole_pages` bytes of pages sit unused.
struct span_free_stats {
  std::size_t bytes = 0;        // free bytes in span blocks (any stream's)
  std::size_t blocks = 0;       // free span blocks
  std::size_t whole_pages = 0;  // bytes of granularity pages lying wholly inside a free block
  std::size_t largest = 0;      // the largest free block
};

// The memory map (allocator::memory_map()): what each mapped byte of the heaps holds now.
enum class block_state : std::uint8_t {
  free,          // in the heap's free lists or a slab's free slots (a slab's unused tail too)
  live,          // the user's
  cached,        // freed into a thread cache, or a free huge block kept mapped for reuse
  pending_free,  // freed, its reuse waiting for another stream's work (record_stream, cross-stream)
};

struct block_info {
  std::uintptr_t addr = 0;
  std::size_t size = 0;       // bytes it covers (a slot's bytes for a slab's slot)
  std::size_t requested = 0;  // bytes asked for (live blocks; 0 for the others)
  block_state state = block_state::free;
};

// A run of contiguous mapped memory of one heap: a span of the large path (slabs' pages inside it
// listed slot by slot) or the dedicated chunk of a huge block. Its blocks tile [addr, addr + size)
// in address order. Idle handles (physical memory not mapped) and retiring VA are in no segment.
struct segment_info {
  std::uintptr_t addr = 0;
  std::size_t size = 0;
  std::uint64_t pool = 0;  // the graph pool whose heap it is in; 0: the allocator's own heap
  bool huge = false;
  std::vector<block_info> blocks;
};

}  // namespace vmm
