// SPDX-License-Identifier: Apache-2.0
// The tests' one content pattern. Byte b of a range filled with `seed` is byte b % 8 (little
// endian) of pattern_word(seed, b / 8): any prefix or window verifies on its own, and host code
// computes what a kernel wrote (the words are __host__ __device__ under nvcc).
//
// Blocks of the fault sweep and the stress programs carry it too, derived from the block's id and
// checked when the block is freed, so a block handed out twice, an overlap, a stale mapping or a
// wrong unmap shows up as a mismatch. Coverage (stated honestly): blocks of at most `full_limit`
// bytes (64 KiB by default) are filled and checked in full. Larger blocks: the first 4 KiB, the
// last 4 KiB, one 4 KiB window at an id-derived offset in the middle, and 64 bytes at every 1 MiB
// boundary in between.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__CUDACC__)
#define VMM_TEST_HD __host__ __device__
#else
#define VMM_TEST_HD
#endif

namespace vmm::test {

VMM_TEST_HD inline std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Word w of the pattern of `seed`.
VMM_TEST_HD inline std::uint64_t pattern_word(std::uint64_t seed, std::uint64_t w) {
  return splitmix64(splitmix64(seed) ^ w);
}
// Byte b of the pattern of `seed`.
VMM_TEST_HD inline std::uint8_t pattern_byte(std::uint64_t seed, std::uint64_t b) {
  return static_cast<std::uint8_t>(pattern_word(seed, b / 8) >> (8 * (b % 8)));
}

struct region {
  std::size_t off, len;
};

inline constexpr std::size_t pattern_full_limit = std::size_t{64} << 10;

// The byte ranges of a block of `size` bytes that carry the pattern.
inline std::vector<region> pattern_regions(std::size_t size, std::uint64_t id,
                                           std::size_t full_limit = pattern_full_limit) {
  std::vector<region> r;
  if (size <= full_limit || size <= 3 * 4096) {
    r.push_back({0, size});
    return r;
  }
  constexpr std::size_t W = 4096, MiB = std::size_t{1} << 20;
  r.push_back({0, W});
  std::size_t span = size - 3 * W;  // the middle window lies in [W, size - 2W]
  std::size_t mid = W + (splitmix64(id ^ 0x5555) % (span + 1)) / 8 * 8;
  r.push_back({mid, W});
  for (std::size_t o = MiB; o + 64 <= size - W; o += MiB)
    if (o + 64 <= mid || o >= mid + W) r.push_back({o, 64});
  r.push_back({size - W, W});
  std::sort(r.begin(), r.end(), [](const region& a, const region& b) { return a.off < b.off; });
  return r;
}

inline void fill_region(unsigned char* p, std::size_t off, std::size_t len, std::uint64_t seed) {
  std::size_t o = off, end = off + len;
  for (; o < end && o % 8; ++o) p[o] = pattern_byte(seed, o);
  for (; o + 8 <= end; o += 8) {
    std::uint64_t w = pattern_word(seed, o / 8);
    std::memcpy(p + o, &w, 8);  // little endian: byte k of the word lands at o + k
  }
  for (; o < end; ++o) p[o] = pattern_byte(seed, o);
}

// Returns the offset of the first wrong byte, or SIZE_MAX when the region is intact.
inline std::size_t check_region(const unsigned char* p, std::size_t off, std::size_t len,
                                std::uint64_t seed) {
  std::size_t o = off, end = off + len;
  for (; o < end && o % 8; ++o)
    if (p[o] != pattern_byte(seed, o)) return o;
  for (; o + 8 <= end; o += 8) {
    std::uint64_t w;
    std::memcpy(&w, p + o, 8);
    if (w != pattern_word(seed, o / 8))
      for (std::size_t k = 0; k < 8; ++k)
        if (p[o + k] != pattern_byte(seed, o + k)) return o + k;
  }
  for (; o < end; ++o)
    if (p[o] != pattern_byte(seed, o)) return o;
  return SIZE_MAX;
}

// Fills the pattern regions of a block with the pattern of seed `id` (pattern_word hashes it);
// returns the bytes written.
inline std::size_t fill_block(void* p, std::size_t size, std::uint64_t id,
                              std::size_t full_limit = pattern_full_limit) {
  std::size_t n = 0;
  for (auto& r : pattern_regions(size, id, full_limit)) {
    fill_region(static_cast<unsigned char*>(p), r.off, r.len, id);
    n += r.len;
  }
  return n;
}

// Checks a block; returns the bytes verified, or sets *bad to the first wrong offset.
inline std::size_t verify_block(const void* p, std::size_t size, std::uint64_t id, std::size_t* bad,
                                std::size_t full_limit = pattern_full_limit) {
  std::size_t n = 0;
  *bad = SIZE_MAX;
  for (auto& r : pattern_regions(size, id, full_limit)) {
    std::size_t b = check_region(static_cast<const unsigned char*>(p), r.off, r.len, id);
    if (b != SIZE_MAX) {
      *bad = b;
      return n;
    }
    n += r.len;
  }
  return n;
}

}  // namespace vmm::test
