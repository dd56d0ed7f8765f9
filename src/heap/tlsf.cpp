// SPDX-License-Identifier: Apache-2.0
// Free lists of span blocks: TLSF good fit with a bounded exact-size scan first. See tlsf.hpp.
#include "heap/heap_impl.hpp"

namespace vmm {


heap::impl::block* heap::impl::find_good_fit(std::size_t size, stream_t x) {
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

span_free_stats heap::span_free() const {
  const auto& m = *p_;
  span_free_stats r;
  for (int fl = 0; fl < kFlCount; ++fl) {
    if (!(m.fl_bitmap & (std::uint64_t{1} << fl))) continue;
    for (int sl = 0; sl < kSlCount; ++sl)
      for (const impl::block* b = m.lists[fl][sl]; b; b = b->next_free) {
        r.bytes += b->size;
        ++r.blocks;
        r.largest = std::max(r.largest, b->size);
        const std::uintptr_t lo = align_up(b->addr, m.G), hi = (b->addr + b->size) / m.G * m.G;
        if (hi > lo) r.whole_pages += hi - lo;
      }
  }
  return r;
}

}  // namespace vmm
