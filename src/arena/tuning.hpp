// SPDX-License-Identifier: Apache-2.0
// The allocator's own choices of sizes and thresholds: not options (a user decides policy, the
// allocator the mechanism), fixed here from measurements on real PyTorch processes and recorded
// traces (bench/RESULTS.md). Each choice also reacts to what the allocator sees at run time, as
// its line says. Tests and tools that must reach a path with small sizes, or compare a choice,
// build an allocator with other values through allocator_access::make (frontend/allocator_access.hpp).
#pragma once

#include <cstddef>
#include <cstdint>

namespace vmm {

struct tuning {
  // Growth: repeated growth doubles from the granularity up to max_growth (driver cost is per
  // call); a refused or pressed growth starts over at the granularity; a request larger than the
  // step grows by its own size. 8 MiB: peak physical / live 1.011 on the shared trace, against
  // 1.018-1.055 for 16-64 MiB (larger chunks are wholly free less often).
  std::size_t max_growth = std::size_t{8} << 20;
  // Sizes up to this come from size classes in slabs (at most granularity / 8).
  std::size_t small_max = std::size_t{64} << 10;
  // Sizes from this up get chunks of their own, or a cached or span block that fits. 128 MiB:
  // a GPT-2 decoder's K/V cache grown by torch.cat (128-277 MiB a layer) is then served by huge
  // blocks that grow in place (huge_headroom_div) instead of new span memory a token.
  std::size_t huge_threshold = std::size_t{128} << 20;
  // New memory comes as handles of at most this size (0 = one handle a growth), spans and huge
  // blocks alike: a block freed beside a live one gives back the handles it covers whole. One
  // handle a growth held a mostly free 200 MiB handle for a 1 MiB block. GPT-2 on an H200: held /
  // allocated 1.092 with one handle, 1.038 with 32 MiB, 1.011 with 16 MiB (as many driver calls
  // as 32 MiB); 8 MiB: 8-16x the calls on its replay. A growth maps idle handles of this size
  // (or of what it still lacks) and releases smaller ones (arena::map_range).
  std::size_t max_handle = std::size_t{16} << 20;
  // After the program trims (PyTorch's empty_cache), this many growths create handles of one
  // granularity page: the program asked for its free memory back, and a trim can only give back
  // handles that are wholly free. cuDNN's benchmark mode empties the cache after every search: a
  // CNN held 1.032 x its live peak with 16 MiB handles, 1.023-1.025 with pages, for one create
  // and map a page regrown, as expandable segments pays. A process that trims once pays for 64
  // growths, then its handles are max_handle again. 0: off.
  std::uint64_t trim_growths = 64;
  // Except a request of at least this size, whose new pages come as one handle of its own: a
  // block that large is seldom split before the next trim, and it goes back in one call. The CNN's
  // replay: 1.014 x its live peak with 17,117 driver calls, against 60,776 with a handle a page;
  // 16 MiB: 1.017 with 8,354. In the CNN's process on an H100: 56-78 ms of driver calls and fences
  // a step, 179-181 with pages for every request. Not under a memory limit (limit_chunk). 0: pages
  // for every request.
  std::size_t trim_own_handle = std::size_t{32} << 20;
  // A huge block is placed with this fraction of its size (and one granularity page) of unmapped
  // VA after it, from the top of the reservation down, so that a freed block a little smaller
  // than the next request grows in place by the pages it lacks (one create or stitch, one map)
  // instead of being remapped whole. VA only: no physical memory. 2 (a half); 0: none.
  std::size_t huge_headroom_div = 2;
  // While a memory limit is set: handles of at most this size, and freed huge blocks join the
  // spans, so pages freed beside live blocks can go back when the limit binds.
  std::size_t limit_chunk = std::size_t{8} << 20;
  // A huge request nothing else serves splits the smallest larger cached huge block instead of
  // remapping: no driver call, the same memory (real processes: 2-7x fewer driver calls).
  bool split_cached_huge = true;
  // A request's first this many growths run their driver calls without the allocator's lock, so
  // other threads allocate meanwhile; one whose new memory then did not serve it (another thread
  // took the free tail it extends) grows again, and after this many the calls run under the lock.
  // 0 (tests): every growth runs under the lock and must serve its request.
  int unlocked_growths = 3;
  // Thread caches: slots per class and thread (a refill or flush moves half), and whether a
  // thread keeps the large block it freed last (off by itself under a release threshold or ipc).
  std::size_t thread_cache_slots = 32;
  bool thread_cache_large = true;
  // With options.ipc, every allocation owns whole chunks (an importer maps nothing else). The
  // PyTorch integration turns it off: tensors share chunks, as PyTorch's own sharing does.
  bool ipc_whole_chunks = true;
};

}  // namespace vmm
