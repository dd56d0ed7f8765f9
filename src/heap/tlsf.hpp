// SPDX-License-Identifier: Apache-2.0
// TLSF size mapping (two-level segregated fit): a size -> (first level, second level) list index
// in O(1) with two bitmaps. 256-byte units: sizes < 8 KiB map linearly, above that 32 lists per
// octave, so a list's blocks differ by at most 1/32 of their size.
#pragma once

#include <cstddef>
#include <cstdint>

namespace vmm::heap_detail {

constexpr std::size_t kUnit = 256;  // minimum block size and alignment
constexpr int kSlLog2 = 5, kSlCount = 1 << kSlLog2, kFlCount = 48;

inline int msb(std::uint64_t x) { return 63 - __builtin_clzll(x); }
// TLSF mapping over 256-byte units: sizes < 8 KiB map linearly, above that 32 lists per octave.
inline void mapping(std::size_t size, int& fl, int& sl) {
  std::uint64_t u = size / kUnit;
  if (u < kSlCount) {
    fl = 0;
    sl = static_cast<int>(u);
  } else {
    int m = msb(u);
    fl = m - kSlLog2 + 1;
    sl = static_cast<int>((u >> (m - kSlLog2)) - kSlCount);
  }
}
// Rounds up to the next list boundary so any block found there fits ("good fit", O(1)).
inline void search_mapping(std::size_t size, int& fl, int& sl) {
  std::uint64_t u = size / kUnit;
  if (u >= kSlCount) u += (std::uint64_t{1} << (msb(u) - kSlLog2)) - 1;
  mapping(u * kUnit, fl, sl);
}

}  // namespace vmm::heap_detail
