// SPDX-License-Identifier: Apache-2.0
// The tests' pattern (pattern.hpp) on the device: one grid-stride pass that writes it and one that
// counts the bytes that differ from it. nvcc only; the GPU tests' kernels are thin wrappers, so
// every GPU program writes and checks the same bytes the host computes.
#pragma once

#include <cstddef>
#include <cstdint>

#include "support/pattern.hpp"

namespace vmm::test {

// One 8-byte word per thread and step: word stores where p is 8-byte aligned, byte stores at an
// unaligned start or the tail.
__device__ __forceinline__ void write_pattern(unsigned char* p, std::size_t n, std::uint64_t seed) {
  const std::size_t words = (n + 7) / 8;
  const bool aligned = (reinterpret_cast<std::uintptr_t>(p) % 8) == 0;
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t w = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; w < words;
       w += stride) {
    const std::uint64_t v = pattern_word(seed, w);
    const std::size_t b = w * 8;
    if (aligned && b + 8 <= n) {
      reinterpret_cast<std::uint64_t*>(p)[w] = v;
    } else {
      for (int k = 0; k < 8 && b + k < n; ++k) p[b + k] = static_cast<unsigned char>(v >> (8 * k));
    }
  }
}

// This thread's share of the bytes of [p, p + n) that differ from the pattern of `seed` (bytes,
// not words); the caller sums the threads' counts.
__device__ __forceinline__ unsigned long long count_mismatches(const unsigned char* p, std::size_t n,
                                                               std::uint64_t seed) {
  const std::size_t words = (n + 7) / 8;
  const bool aligned = (reinterpret_cast<std::uintptr_t>(p) % 8) == 0;
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  unsigned long long bad = 0;
  for (std::size_t w = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; w < words;
       w += stride) {
    const std::uint64_t v = pattern_word(seed, w);
    const std::size_t b = w * 8;
    if (aligned && b + 8 <= n) {
      const std::uint64_t x = reinterpret_cast<const std::uint64_t*>(p)[w] ^ v;
      for (int k = 0; k < 8; ++k) bad += ((x >> (8 * k)) & 0xFF) != 0;
    } else {
      for (int k = 0; k < 8 && b + k < n; ++k) bad += p[b + k] != static_cast<unsigned char>(v >> (8 * k));
    }
  }
  return bad;
}

}  // namespace vmm::test
