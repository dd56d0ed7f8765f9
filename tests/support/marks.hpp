// SPDX-License-Identifier: Apache-2.0
// Marks a block's memory and checks the marks: every 64th byte and the last stand for the block
// (blocks are 256-aligned, so two blocks that overlap share such bytes). Writing whole blocks
// would cost gigabytes of stores a run.
#pragma once

#include <cstddef>

namespace vmm::test {

inline void put_mark(unsigned char* p, std::size_t n, unsigned char v) {
  for (std::size_t i = 0; i < n; i += 64) p[i] = v;
  p[n - 1] = v;
}

inline std::size_t wrong_marks(const unsigned char* p, std::size_t n, unsigned char v) {
  std::size_t w = p[n - 1] != v;
  for (std::size_t i = 0; i < n; i += 64) w += p[i] != v;
  return w;
}

}  // namespace vmm::test
