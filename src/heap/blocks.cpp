// SPDX-License-Identifier: Apache-2.0
// Block pool and page chains: no malloc per split on the hot path; free(p) finds its block
// through the page map in O(1). See heap_impl.hpp.
#include "heap/heap_impl.hpp"

namespace vmm {


heap::impl::block* heap::impl::block_containing(std::uintptr_t p) const {
  for (std::size_t pg = a.page_of(p);; --pg) {
    block* best = nullptr;
    for (block* b = pages[pg].starts; b; b = b->page_next)
      if (b->addr <= p && (!best || b->addr > best->addr)) best = b;
    if (best) return best->addr + best->size > p ? best : nullptr;
    if (pg == 0) return nullptr;
  }
}

}  // namespace vmm
