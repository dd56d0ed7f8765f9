// SPDX-License-Identifier: Apache-2.0
// memset, memcpy and memcmp for a test's own bulk data (patterns in its blocks, memory it touches
// as a kernel would), and VMM_TEST_BULK for a test's own loops over such data. Under TSan they are
// uninstrumented: TSan checks every 8 bytes a loop or its interceptors touch, so a test that fills
// a GiB took minutes there, and a test's data in its own blocks is not what that tree looks for;
// the allocator's own accesses stay checked. Elsewhere they are the library calls.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__SANITIZE_THREAD__)
#define VMM_TEST_BULK [[gnu::no_sanitize("thread"), gnu::optimize("no-tree-loop-distribute-patterns")]]
#else
#define VMM_TEST_BULK
#endif

namespace vmm::test {

#if defined(__SANITIZE_THREAD__)
VMM_TEST_BULK inline void bulk_set(void* d, unsigned char v, std::size_t n) {
  auto* db = static_cast<unsigned char*>(d);
  const std::uint64_t w = v * 0x0101010101010101ull;
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) std::memcpy(db + i, &w, 8);  // one store: memcpy of a constant 8 bytes
  for (; i < n; ++i) db[i] = v;
}
VMM_TEST_BULK inline void bulk_copy(void* d, const void* s, std::size_t n) {
  auto* db = static_cast<unsigned char*>(d);
  auto* sb = static_cast<const unsigned char*>(s);
  std::size_t i = 0;
  for (std::uint64_t w; i + 8 <= n; i += 8) std::memcpy(&w, sb + i, 8), std::memcpy(db + i, &w, 8);
  for (; i < n; ++i) db[i] = sb[i];
}
VMM_TEST_BULK inline bool bulk_equal(const void* a, const void* b, std::size_t n) {
  auto* ab = static_cast<const unsigned char*>(a);
  auto* bb = static_cast<const unsigned char*>(b);
  std::uint64_t x = 0;
  std::size_t i = 0;
  for (std::uint64_t u, w; i + 8 <= n; i += 8) std::memcpy(&u, ab + i, 8), std::memcpy(&w, bb + i, 8), x |= u ^ w;
  for (; i < n; ++i) x |= ab[i] ^ bb[i];
  return x == 0;
}
#else
inline void bulk_set(void* d, unsigned char v, std::size_t n) { std::memset(d, v, n); }
inline void bulk_copy(void* d, const void* s, std::size_t n) { std::memcpy(d, s, n); }
inline bool bulk_equal(const void* a, const void* b, std::size_t n) { return std::memcmp(a, b, n) == 0; }
#endif

}  // namespace vmm::test
