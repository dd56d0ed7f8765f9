// SPDX-License-Identifier: Apache-2.0
// The pages-touched bound of a replay: after each event, how many granularity pages of the
// allocator's address space hold at least one live requested byte. An allocator that maps whole
// pages can hold no less at that event whatever it does with the rest of its memory, so
//   peak live <= peak touched pages <= peak mapped,
// and touched / live is what the placement of blocks costs, mapped / touched what the allocator
// keeps mapped beyond the pages its blocks touch (cached free blocks, free pages inside them).
//
// Cost: a hash map entry per touched page; each allocation and free visits its pages
// (a 1 GiB block: 512 at 2 MiB).
#pragma once

#include <cstdint>
#include <unordered_map>

namespace vmm::replay {

class touched_pages {
 public:
  explicit touched_pages(std::uint64_t page) : page_(page) {}

  // The requested bytes [p, p + n) became live / stopped being live (n == 0: nothing).
  void add(std::uintptr_t p, std::uint64_t n) {
    if (!n) return;
    for (std::uint64_t pg = p / page_, last = (p + n - 1) / page_; pg <= last; ++pg)
      if (blocks_[pg]++ == 0) ++now_;
    if (now_ > peak_) peak_ = now_;
  }
  void remove(std::uintptr_t p, std::uint64_t n) {
    if (!n) return;
    for (std::uint64_t pg = p / page_, last = (p + n - 1) / page_; pg <= last; ++pg) {
      auto it = blocks_.find(pg);
      if (it != blocks_.end() && --it->second == 0) {
        blocks_.erase(it);
        --now_;
      }
    }
  }

  std::uint64_t page() const { return page_; }
  std::uint64_t pages() const { return now_; }       // touched now
  std::uint64_t peak_pages() const { return peak_; }  // most touched after any event so far

 private:
  std::uint64_t page_;
  std::unordered_map<std::uint64_t, std::uint32_t> blocks_;  // page -> live blocks on it
  std::uint64_t now_ = 0, peak_ = 0;
};

}  // namespace vmm::replay
