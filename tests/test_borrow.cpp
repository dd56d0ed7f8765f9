// SPDX-License-Identifier: Apache-2.0
// Borrowed free pages (options.borrow_free_pages) on the host backend: a huge request maps whole
// free pages of partly used chunks a second time instead of creating memory; the pages are held
// until that mapping goes, then serve the spans again. Data stays apart, bad frees are refused,
// and the stream-ordered path (a huge block retired while its stream runs behind) keeps order.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "support/host_alloc.hpp"
#include "vmmalloc/vmmalloc.hpp"

using namespace vmm;

namespace {
constexpr std::size_t MiB = std::size_t{1} << 20;

options borrow_options(bool on) {
  options o;
  o.reservation_size = 1024 * MiB;
  o.huge_threshold = 16 * MiB;  // small huge blocks keep the test's host memory low
  o.thread_cache = false;       // freed blocks go straight back to the spans
  o.max_growth = 32 * MiB;
  o.borrow_free_pages = on;
  return o;
}

// 1 MiB blocks filling chunks of 2, 4, 8, 16 and 32 MiB (geometric growth), every twelfth and
// the last kept: holes of 11 MiB in chunks that still hold live blocks (never wholly free, so
// stitching cannot take them), about 46 MiB of whole free pages in runs of two pages or more.
struct holes {
  std::vector<void*> keep;
  explicit holes(allocator& a) {
    std::vector<void*> gone;
    for (int i = 0; i < 62; ++i) (i % 12 == 0 || i == 61 ? keep : gone).push_back(a.allocate(1 * MiB));
    for (void* p : gone) a.deallocate(p);
    for (std::size_t i = 0; i < keep.size(); ++i) std::memset(keep[i], 0x10 + int(i), MiB);
  }
  bool intact() const {
    for (std::size_t i = 0; i < keep.size(); ++i) {
      const auto* b = static_cast<const unsigned char*>(keep[i]);
      for (std::size_t k = 0; k < MiB; k += 4096)
        if (b[k] != 0x10 + i || b[MiB - 1] != 0x10 + i) return false;
    }
    return true;
  }
  void release(allocator& a) {
    for (void* p : keep) a.deallocate(p);
    keep.clear();
  }
};

bool filled(const void* p, std::size_t n, unsigned char v) {
  const auto* b = static_cast<const unsigned char*>(p);
  for (std::size_t k = 0; k < n; k += 4096)
    if (b[k] != v) return false;
  return b[n - 1] == v;
}
}  // namespace

TEST_CASE("a huge request borrows whole free pages of partly used chunks: less new memory, data apart") {
  auto a = allocator::host(borrow_options(true));
  holes h(a);
  const auto before = a.stats();
  const auto free_before = a.span_free();
  REQUIRE(free_before.whole_pages >= 40 * MiB);  // the holes hold enough whole pages

  void* big = a.allocate(40 * MiB);
  const auto s = a.stats();
  CHECK(s.borrowed >= 4 * MiB);
  CHECK(s.borrows >= 1);
  CHECK(s.borrowed % (2 * MiB) == 0);
  // Only what was not borrowed is new physical memory; the borrowed VA counts as mapped.
  CHECK(s.physical - before.physical <= 40 * MiB - s.borrowed);
  CHECK(s.mapped - before.mapped >= 40 * MiB - before.free_chunk_bytes);  // a wholly free chunk is remapped
  CHECK(a.span_free().whole_pages + s.borrowed <= free_before.whole_pages);
  CHECK(a.usable_size(big) == 40 * MiB);
  CHECK(a.check() == "");

  // The borrowed pages are the huge block's alone now: writes on either side do not meet.
  std::memset(big, 0xAB, 40 * MiB);
  CHECK(h.intact());
  for (std::size_t i = 0; i < h.keep.size(); ++i) std::memset(h.keep[i], 0x10 + int(i), MiB);
  CHECK(filled(big, 40 * MiB, 0xAB));

  // Span requests while the pages are lent never land on them.
  std::vector<void*> more;
  for (int i = 0; i < 8; ++i) {
    more.push_back(a.allocate(3 * MiB));
    std::memset(more.back(), 0x5C, 3 * MiB);
  }
  CHECK(filled(big, 40 * MiB, 0xAB));
  for (void* p : more) a.deallocate(p);

  // Back: the second mapping goes with the huge block's chunks, the pages serve the spans again.
  a.deallocate(big);
  a.trim();
  CHECK(a.stats().borrowed == 0);
  void* again = a.allocate(3 * MiB);  // the heap takes the returned pages back on its next call
  a.deallocate(again);
  CHECK(a.span_free().bytes >= free_before.bytes - before.free_chunk_bytes);  // every borrowed byte is back
  // ... and can be borrowed again.
  const auto borrows = a.stats().borrows;
  void* big2 = a.allocate(40 * MiB);
  CHECK(a.stats().borrows > borrows);
  CHECK(a.stats().borrowed >= 4 * MiB);
  a.deallocate(big2);
  CHECK(a.check() == "");
  CHECK(h.intact());
  h.release(a);
  CHECK(a.stats().requested == 0);
  CHECK(a.check() == "");
}

TEST_CASE("without the option the same request creates all of its memory") {
  auto a = allocator::host(borrow_options(false));
  holes h(a);
  const auto before = a.stats();
  void* big = a.allocate(40 * MiB);
  CHECK(a.stats().borrowed == 0);
  CHECK(a.stats().borrows == 0);
  CHECK(a.stats().physical - before.physical >= 40 * MiB - before.free_chunk_bytes);
  a.deallocate(big);
  h.release(a);
  CHECK(a.check() == "");
}

TEST_CASE("borrowed pages cannot be freed or queried as allocations") {
  auto a = allocator::host(borrow_options(true));
  holes h(a);
  void* big = a.allocate(40 * MiB);
  REQUIRE(a.stats().borrowed > 0);
  // Every page start inside the holes: a placeholder starts at one of them, the rest are free.
  const auto start = reinterpret_cast<std::uintptr_t>(h.keep.front());
  const auto end = reinterpret_cast<std::uintptr_t>(h.keep.back());
  int refused = 0;
  for (std::uintptr_t p = (start + 2 * MiB - 1) / (2 * MiB) * (2 * MiB); p < end; p += 2 * MiB) {
    bool live = false;
    for (void* k : h.keep) live |= reinterpret_cast<std::uintptr_t>(k) == p;
    if (live) continue;
    CHECK(a.usable_size(reinterpret_cast<void*>(p)) == 0);
    CHECK(a.try_deallocate(reinterpret_cast<void*>(p)).kind == errc::invalid_pointer);
    ++refused;
  }
  CHECK(refused > 0);
  CHECK(a.check() == "");
  std::memset(big, 0x77, 40 * MiB);  // the huge block is untouched by the refusals, and whole
  CHECK(filled(big, 40 * MiB, 0x77));
  CHECK(h.intact());
  a.deallocate(big);
  h.release(a);
  CHECK(a.check() == "");
}

namespace {
// split: the cached block is split into the spans (the default), else its chunks are retired.
void stream_order_case(bool split) {
  options o = borrow_options(true);
  o.split_cached_huge = split;
  auto ha = test::make_host_alloc(o);
  auto& a = ha.a;
  auto s = reinterpret_cast<stream_t>(std::uintptr_t{0x51});
  holes h(a);
  ha.hb->hold_stream(s);  // fences on s stay pending: its work is still running
  void* big = a.allocate(40 * MiB, 0, s);
  REQUIRE(a.stats().borrowed > 0);
  std::memset(big, 0xAB, 40 * MiB);
  a.deallocate(big, s);
  // A different huge size on the same stream: the cached block does not fit; split into the spans
  // or with its chunks retired (their VA stays mapped until s catches up), its memory serves this
  // request at once.
  void* other = a.allocate(34 * MiB, 0, s);
  std::memset(other, 0xCD, 34 * MiB);
  if (!split) CHECK(a.stats().chunks_retired > 0);  // the retired path ran
  CHECK(a.check() == "");
  CHECK(h.intact());
  // Another stream may not take memory s may still be using: it gets memory of its own.
  auto t = reinterpret_cast<stream_t>(std::uintptr_t{0x52});
  void* third = a.allocate(34 * MiB, 0, t);
  std::memset(third, 0xEF, 34 * MiB);
  CHECK(filled(other, 34 * MiB, 0xCD));
  CHECK(h.intact());
  ha.hb->complete_stream(s);
  a.deallocate(other, s);
  a.deallocate(third, t);
  a.trim();
  CHECK(a.stats().borrowed == 0);
  CHECK(a.stats().retiring == 0);
  h.release(a);
  CHECK(a.check() == "");
  CHECK(a.stats().requested == 0);
}
}  // namespace

TEST_CASE("a huge block with borrowed pages freed while its stream runs behind: split into the spans") {
  stream_order_case(true);
}

TEST_CASE("a huge block with borrowed pages freed while its stream runs behind: chunks retired") {
  stream_order_case(false);
}
