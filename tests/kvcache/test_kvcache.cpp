// SPDX-License-Identifier: Apache-2.0
// vmm::kv_cache on the host backend: layout and strides, pages mapped as sequences grow, the handle
// pool (reuse without create, trim), errors with state intact, fault injection on every mapping
// step (rollback, no leaks), a random workload checked against a model (mapped pages, pool counts,
// contents), and map-ahead (append makes no driver call once the thread caught up).
//
// Geometry of most cases: 64 KiB host granularity = page; T = 4 heads x 64 dims x 2 B = 512 B, so
// 128 tokens a page; 2 layers = 4 buffers (K0 V0 K1 V1). Memory stays small (a few MiB). The
// per_sequence layout puts the 4 side by side in one buffer per sequence: R = 2 KiB, 32 tokens a
// page. Shared prefixes (share_prefix) have their own cases and a random run against a model.
#include <doctest/doctest.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <map>
#include <new>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "support/fault_backend.hpp"
#include "support/pattern.hpp"
#include "vmmalloc/kv_cache.hpp"

namespace {

constexpr std::size_t KiB = 1024, PAGE = 64 * KiB;

using vmm::kv_cache;
using vmm::test::fault;
using vmm::test::fault_state;
using vmm::test::op;

vmm::kv_cache_config small_cfg(std::size_t max_seqs = 8, std::size_t max_tokens = 1000, std::size_t ahead = 0) {
  vmm::kv_cache_config c;
  c.layers = 2;
  c.kv_heads = 4;
  c.head_dim = 64;
  c.elem_bytes = 2;
  c.max_seqs = max_seqs;
  c.max_tokens = max_tokens;
  c.map_ahead_pages = ahead;
  return c;
}

vmm::host_backend_options host_opts(std::size_t physical_limit = std::size_t{1} << 30) {
  vmm::host_backend_options h;
  h.granularity = PAGE;
  h.physical_limit = physical_limit;
  return h;
}

// A cache over a fault-injecting host backend; the state outlives the cache (leak checks).
struct faulty {
  std::shared_ptr<fault_state> st = std::make_shared<fault_state>();
  kv_cache kv;
  explicit faulty(const vmm::kv_cache_config& c, vmm::host_backend_options h = host_opts())
      : kv(vmm::test::make_fault_host(st, h), c) {}
  vmm::host_backend& host() { return *vmm::test::as_fault(kv.backend())->host(); }
};

// K|V buffers of a sequence (what write_tokens fills), and the buffers its pages are mapped in.
std::size_t nbuf(const kv_cache& kv) { return (kv.config().fused_kv ? 1 : 2) * kv.config().layers; }
std::size_t nmapped(const kv_cache& kv) { return kv.config().layout == vmm::kv_layout::per_sequence ? 1 : nbuf(kv); }

unsigned char* buf_ptr(const kv_cache& kv, vmm::seq_id s, std::size_t buf) {
  if (kv.config().fused_kv) return static_cast<unsigned char*>(kv.k(s, buf));
  return static_cast<unsigned char*>(buf % 2 ? kv.v(s, buf / 2) : kv.k(s, buf / 2));
}

// Byte i of token t (of T bytes) in buffer `buf` of a sequence whose contents are tagged `tag`: the
// tests' pattern (support/pattern.hpp) of seed tag * 1000 + buf at byte t * T + i, as the GPU
// test's kernels write it.
std::uint8_t pat(std::uint64_t tag, std::size_t buf, std::size_t T, std::size_t t, std::size_t i) {
  return vmm::test::pattern_byte(tag * 1000 + buf, t * T + i);
}

void write_tokens(kv_cache& kv, vmm::seq_id s, std::uint64_t tag, std::size_t t0, std::size_t t1) {
  const std::size_t T = kv.token_bytes(), R = kv.token_stride();
  for (std::size_t b = 0; b < nbuf(kv); ++b) {
    unsigned char* p = buf_ptr(kv, s, b);
    for (std::size_t t = t0; t < t1; ++t)
      for (std::size_t i = 0; i < T; i += 8) p[t * R + i] = pat(tag, b, T, t, i);  // every 8th byte: fast enough
  }
}

// Number of wrong bytes among those write_tokens wrote for [t0, n).
std::size_t check_tokens(const kv_cache& kv, vmm::seq_id s, std::uint64_t tag, std::size_t n, std::size_t t0 = 0) {
  const std::size_t T = kv.token_bytes(), R = kv.token_stride();
  std::size_t bad = 0;
  for (std::size_t b = 0; b < nbuf(kv); ++b) {
    const unsigned char* p = buf_ptr(kv, s, b);
    for (std::size_t t = t0; t < n; ++t)
      for (std::size_t i = 0; i < T; i += 8) bad += p[t * R + i] != pat(tag, b, T, t, i);
  }
  return bad;
}

// Live objects agree with what the cache says.
void check_live(faulty& f) {
  f.kv.wait_map_ahead();  // the thread may be mid-job (mapped, not yet committed): let it finish
  auto s = f.kv.stats();
  CHECK(f.st->live_handles() == static_cast<std::int64_t>(s.pages_mapped + s.pages_pooled));
  CHECK(f.st->live_mappings() == static_cast<std::int64_t>(s.pages_mapped + s.pages_aliased));
  CHECK(f.st->live_reservations() == 1);
  CHECK(f.host().live_handles() == s.pages_mapped + s.pages_pooled);
  CHECK(f.host().live_mappings() == s.pages_mapped + s.pages_aliased);
  CHECK(s.mapped_bytes == s.pages_mapped * f.kv.page_size());
}

}  // namespace

TEST_CASE("layout: strides and pointers as documented; construction maps nothing") {
  faulty f(small_cfg(8, 1000));
  kv_cache& kv = f.kv;
  CHECK(kv.granularity() == PAGE);
  CHECK(kv.page_size() == PAGE);
  CHECK(kv.token_bytes() == 4 * 64 * 2);
  CHECK(kv.tokens_per_page() == 128);
  CHECK(kv.seq_stride() == 8 * PAGE);  // round_up(1000 * 512, 64 KiB) = 512 KiB
  CHECK(kv.max_pages() == 8);
  CHECK(kv.buffer_stride() == 8 * kv.seq_stride());
  CHECK(kv.reserved() == 4 * kv.buffer_stride());
  const auto base = reinterpret_cast<std::uintptr_t>(kv.base());
  CHECK(base % PAGE == 0);
  for (std::size_t s = 0; s < 8; ++s)
    for (std::size_t l = 0; l < 2; ++l) {
      CHECK(reinterpret_cast<std::uintptr_t>(kv.k(s, l)) == base + (2 * l) * kv.buffer_stride() + s * kv.seq_stride());
      CHECK(reinterpret_cast<std::uintptr_t>(kv.v(s, l)) == base + (2 * l + 1) * kv.buffer_stride() + s * kv.seq_stride());
    }
  CHECK(kv.k_base(1) == kv.k(0, 1));
  CHECK(kv.v_base(0) == kv.v(0, 0));
  CHECK(kv.pages_for(0) == 0);
  CHECK(kv.pages_for(1) == 1);
  CHECK(kv.pages_for(128) == 1);
  CHECK(kv.pages_for(129) == 2);
  CHECK_THROWS_AS(kv.k(8, 0), vmm::error);
  CHECK_THROWS_AS(kv.v(0, 2), vmm::error);
  CHECK(f.st->live_reservations() == 1);
  CHECK(f.st->live_handles() == 0);
  CHECK(f.st->live_mappings() == 0);
  CHECK(kv.stats().driver_calls == 2);  // granularity + reserve
}

TEST_CASE("fused_kv: one buffer per layer, half the pages; v() refused; contents and reuse as usual") {
  auto c = small_cfg(4, 1000);
  c.fused_kv = true;
  c.kv_heads = 8;  // the caller's K and V heads together: T = 1 KiB, 64 tokens a page
  faulty f(c);
  kv_cache& kv = f.kv;
  CHECK(kv.token_bytes() == 8 * 64 * 2);
  CHECK(kv.seq_stride() == 16 * PAGE);  // round_up(1000 KiB, 64 KiB)
  CHECK(kv.reserved() == 2 * kv.buffer_stride());  // layers buffers, not 2 x layers
  const auto base = reinterpret_cast<std::uintptr_t>(kv.base());
  for (std::size_t s = 0; s < 4; ++s)
    for (std::size_t l = 0; l < 2; ++l)
      CHECK(reinterpret_cast<std::uintptr_t>(kv.k(s, l)) == base + l * kv.buffer_stride() + s * kv.seq_stride());
  CHECK_THROWS_WITH_AS(kv.v(0, 0), doctest::Contains("fused_kv"), vmm::error);
  CHECK_THROWS_AS(kv.v_base(1), vmm::error);
  auto a = kv.open(), b = kv.open();
  kv.append(a, 100);  // 2 pages in each of the 2 buffers
  kv.append(b, 64);   // 1 page each
  write_tokens(kv, a, 1, 0, 100);
  write_tokens(kv, b, 2, 0, 64);
  auto s = kv.stats();
  CHECK(s.pages_mapped == (2 + 1) * 2);
  CHECK(s.used_bytes == (100 + 64) * kv.token_bytes() * 2);
  kv.close(b);
  kv.append(a, 28);  // 128 tokens: 2 pages still
  kv.append(a, 1);   // 3 pages: one from b's pool per buffer
  CHECK(check_tokens(kv, a, 1, 100) == 0);
  s = kv.stats();
  CHECK(s.pages_mapped == 3 * 2);
  CHECK(s.pages_reused == 2);
  CHECK(s.pages_created == (2 + 1) * 2);
  check_live(f);
}

TEST_CASE("configuration errors are clear and hold nothing") {
  auto st = std::make_shared<fault_state>();
  auto make = [&](vmm::kv_cache_config c, vmm::host_backend_options h = host_opts()) {
    kv_cache kv(vmm::test::make_fault_host(st, h), c);
  };
  for (int field = 0; field < 6; ++field) {
    auto c = small_cfg();
    std::size_t* f[] = {&c.layers, &c.kv_heads, &c.head_dim, &c.elem_bytes, &c.max_seqs, &c.max_tokens};
    *f[field] = 0;
    CHECK_THROWS_WITH_AS(make(c), doctest::Contains("must be > 0"), vmm::error);
  }
  auto c = small_cfg();
  c.page_size = PAGE + 4096;
  CHECK_THROWS_WITH_AS(make(c), doctest::Contains("not a multiple of the granularity"), vmm::error);
  c = small_cfg();
  c.peers = {{7, vmm::access_mode::read_write}};  // the host simulates 2 devices
  CHECK_THROWS_WITH_AS(make(c), doctest::Contains("cannot access device 0"), vmm::error);
  c = small_cfg();
  c.max_tokens = SIZE_MAX / 4;
  CHECK_THROWS_AS(make(c), vmm::out_of_memory);
  CHECK_THROWS_AS(kv_cache(nullptr, small_cfg()), vmm::error);
  // A refused reserve: nothing held.
  st->arm(op::reserve, 1, fault::out_of_memory);
  CHECK_THROWS_WITH_AS(make(small_cfg()), doctest::Contains("reserving"), vmm::out_of_memory);
  CHECK(st->nothing_live());
}

TEST_CASE("append maps pages on demand; contents survive other sequences' growth and closing") {
  faulty f(small_cfg(8, 1000));
  kv_cache& kv = f.kv;
  auto a = kv.open(), b = kv.open();
  CHECK(a == 0);
  CHECK(b == 1);
  CHECK(kv.mapped_pages(a) == 0);
  CHECK(kv.append(a, 100) == 0);
  CHECK(kv.mapped_pages(a) == 1);
  CHECK(kv.capacity(a) == 128);
  write_tokens(kv, a, 1, 0, 100);
  CHECK(kv.append(a, 100) == 100);  // crosses the page boundary at token 128
  CHECK(kv.mapped_pages(a) == 2);
  write_tokens(kv, a, 1, 100, 200);
  kv.append(b, 700);
  write_tokens(kv, b, 2, 0, 700);
  CHECK(kv.mapped_pages(b) == 6);
  auto c = kv.open();
  kv.append(c, 300);
  write_tokens(kv, c, 3, 0, 300);
  kv.close(b);
  kv.append(a, 800);  // 1000 tokens: 8 pages, 6 of them from b's pool
  write_tokens(kv, a, 1, 200, 1000);
  CHECK(check_tokens(kv, a, 1, 1000) == 0);
  CHECK(check_tokens(kv, c, 3, 300) == 0);
  auto s = kv.stats();
  CHECK(s.pages_reused == 6 * 4);
  CHECK(s.pages_created == (2 + 6 + 3) * 4);
  CHECK(s.pages_mapped == (8 + 3) * 4);
  CHECK(s.pages_pooled == 0);
  CHECK(s.used_bytes == (1000 + 300) * kv.token_bytes() * 4);
  CHECK(s.open_seqs == 2);
  CHECK(s.appends == 5);
  check_live(f);
  // Every mapping is read_write for the owner.
  CHECK(f.host().access_of(reinterpret_cast<std::uintptr_t>(kv.v(a, 1)) + 7 * PAGE, 0) == vmm::access_mode::read_write);
}

TEST_CASE("reuse: a closed sequence's pages are mapped again with map + set_access only") {
  faulty f(small_cfg(4, 1000));
  kv_cache& kv = f.kv;
  auto a = kv.open();
  kv.append(a, 1000);
  kv.close(a);
  CHECK(kv.stats().pages_pooled == 8 * 4);
  CHECK(f.st->live_mappings() == 0);
  const auto creates = f.st->calls(op::create), maps = f.st->calls(op::map), sa = f.st->calls(op::set_access);
  auto b = kv.open();
  kv.append(b, 1000);
  CHECK(f.st->calls(op::create) == creates);            // no create
  CHECK(f.st->calls(op::map) == maps + 8 * 4);          // one map per page
  CHECK(f.st->calls(op::set_access) == sa + 4);         // one set_access per buffer for the 8 pages
  CHECK(kv.stats().pages_reused == 8 * 4);
  check_live(f);
}

TEST_CASE("retain_closed: the next sequence takes a closed slot's mapped pages with no driver call") {
  auto c = small_cfg(4, 1000);
  c.retain_closed = true;
  faulty f(c);
  kv_cache& kv = f.kv;
  auto a = kv.open(), b = kv.open();
  kv.append(a, 1000);  // 8 pages x 4 buffers
  kv.append(b, 10);
  write_tokens(kv, b, 9, 0, 10);
  kv.close(a);
  CHECK(kv.stats().pages_retained == 8 * 4);
  CHECK(kv.stats().pages_pooled == 0);
  CHECK(f.st->live_mappings() == 9 * 4);  // still mapped
  const auto calls = kv.stats().driver_calls;
  auto n = kv.open();  // the closed slot with the most mapped pages: a's
  CHECK(n == a);
  CHECK(kv.mapped_pages(n) == 8);
  kv.append(n, 1000);
  CHECK(kv.stats().driver_calls == calls);  // open + a full prefill: no driver call at all
  CHECK(kv.stats().pages_retained_reused == 8 * 4);
  CHECK(kv.stats().pages_retained == 0);
  write_tokens(kv, n, 4, 0, 1000);
  CHECK(check_tokens(kv, n, 4, 1000) == 0);
  CHECK(check_tokens(kv, b, 9, 10) == 0);
  check_live(f);
}

TEST_CASE("retain_closed: retained pages go to other slots before anything is created; trim releases them") {
  // 40 pages of physical memory; a full sequence takes 8 x 4 = 32.
  auto c = small_cfg(4, 1000);
  c.retain_closed = true;
  faulty f(c, host_opts(40 * PAGE));
  kv_cache& kv = f.kv;
  auto a = kv.open();
  kv.append(a, 1000);
  kv.close(a);  // 32 pages retained in slot a
  auto b = kv.open(2);  // another slot, explicitly: must take a's pages through the pool
  const auto creates = f.st->calls(op::create);
  const auto before = kv.stats();
  kv.append(b, 1000);  // 32 pages: with the limit of 40, only reuse can serve them
  CHECK(f.st->calls(op::create) == creates);
  CHECK(kv.stats().pages_reclaimed == before.pages_reclaimed + 8 * 4);
  CHECK(kv.stats().append_driver_calls > before.append_driver_calls);  // the unmaps counted here
  CHECK(kv.stats().pages_retained == 0);
  write_tokens(kv, b, 7, 0, 1000);
  CHECK(check_tokens(kv, b, 7, 1000) == 0);
  kv.close(b);
  CHECK(kv.stats().pages_retained == 8 * 4);
  CHECK(kv.trim(0) == 8 * 4);  // retained pages are unmapped and released too
  CHECK(kv.stats().pages_retained == 0);
  CHECK(f.host().live_handles() == 0);
  CHECK(f.host().live_mappings() == 0);
  check_live(f);
}

TEST_CASE("retain_closed: a refused unmap while reclaiming is parked; the append still succeeds") {
  auto c = small_cfg(4, 1000);
  c.retain_closed = true;
  faulty f(c);
  kv_cache& kv = f.kv;
  auto a = kv.open();
  kv.append(a, 300);  // 3 pages x 4
  kv.close(a);
  auto b = kv.open(3);
  f.st->arm(op::unmap, 1, fault::invalid_value, true);  // every unmap refused
  kv.append(b, 300);  // reclaim fails (pages parked as strays): the job creates instead
  f.st->disarm();
  CHECK(kv.length(b) == 300);
  CHECK(kv.mapped_pages(b) == 3);
  write_tokens(kv, b, 3, 0, 300);
  CHECK(check_tokens(kv, b, 3, 300) == 0);
  kv.close(b);
  kv.trim(0);
  check_live(f);
}

TEST_CASE("retain_closed: destruction with retained pages leaves nothing behind") {
  auto st = std::make_shared<fault_state>();
  {
    auto c = small_cfg(4, 1000, 1);
    c.retain_closed = true;
    kv_cache kv(vmm::test::make_fault_host(st, host_opts()), c);
    auto a = kv.open();
    kv.append(a, 700);
    kv.close(a);
    auto b = kv.open();
    kv.append(b, 5);
    kv.wait_map_ahead();
    CHECK(st->live_handles() > 0);
  }
  CHECK(st->nothing_live());
}

TEST_CASE("truncate unmaps the pages past the new length; trim releases the pool beyond keep") {
  auto c = small_cfg(4, 1000);
  c.pool_keep_pages = 4;
  faulty f(c);
  kv_cache& kv = f.kv;
  auto a = kv.open();
  kv.append(a, 1000);
  write_tokens(kv, a, 9, 0, 1000);
  kv.truncate(a, 200);  // keeps 2 pages
  CHECK(kv.length(a) == 200);
  CHECK(kv.mapped_pages(a) == 2);
  CHECK(kv.stats().pages_pooled == 6 * 4);
  CHECK(check_tokens(kv, a, 9, 200) == 0);
  kv.truncate(a, 200);  // no-op
  CHECK_THROWS_WITH_AS(kv.truncate(a, 201), doctest::Contains("cannot truncate to 201"), vmm::error);
  check_live(f);
  CHECK(kv.trim() == 20);  // keeps config.pool_keep_pages = 4
  CHECK(kv.stats().pages_pooled == 4);
  CHECK(kv.stats().pages_released == 20);
  check_live(f);
  CHECK(kv.trim(0) == 4);
  CHECK(kv.trim(0) == 0);
  kv.close(a);
  CHECK(kv.trim(0) == 8);
  CHECK(f.host().live_handles() == 0);
  CHECK(f.host().live_mappings() == 0);
  CHECK(f.host().live_reservations() == 1);
}

TEST_CASE("errors: max_tokens, too many sequences, unknown or closed sequence; state intact") {
  faulty f(small_cfg(2, 1000));
  kv_cache& kv = f.kv;
  auto a = kv.open();
  kv.append(a, 900);
  const auto before = kv.stats();
  CHECK_THROWS_WITH_AS(kv.append(a, 101), doctest::Contains("exceed max_tokens 1000"), vmm::out_of_memory);
  CHECK(kv.length(a) == 900);
  CHECK(kv.stats().pages_mapped == before.pages_mapped);
  CHECK(kv.stats().driver_calls == before.driver_calls);
  CHECK_THROWS_AS(kv.append(a, SIZE_MAX), vmm::out_of_memory);  // no overflow
  kv.append(a, 100);  // exactly max_tokens is fine
  CHECK(kv.capacity(a) == 1000);
  kv.open();
  CHECK_THROWS_WITH_AS(kv.open(), doctest::Contains("all 2 sequence slots"), vmm::out_of_memory);
  CHECK_THROWS_WITH_AS(kv.open(1), doctest::Contains("already open"), vmm::error);
  CHECK_THROWS_WITH_AS(kv.open(2), doctest::Contains("out of range"), vmm::error);
  CHECK_THROWS_WITH_AS(kv.append(5, 1), doctest::Contains("out of range"), vmm::error);
  kv.close(1);
  CHECK_THROWS_WITH_AS(kv.append(1, 1), doctest::Contains("is not open"), vmm::error);
  CHECK_THROWS_AS(kv.close(1), vmm::error);
  CHECK_THROWS_AS(kv.truncate(1, 0), vmm::error);
  CHECK_THROWS_AS(kv.length(1), vmm::error);
  CHECK_FALSE(kv.is_open(1));
  CHECK(kv.is_open(0));
  bool thrown = false;
  try {
    kv.append(1, 1);
  } catch (const vmm::error& e) {
    thrown = true;
    CHECK(e.st().kind == vmm::errc::invalid_value);
  }
  CHECK(thrown);
  CHECK(kv.open(1) == 1);  // a closed slot opens again
  check_live(f);
}

TEST_CASE("out of physical memory: clear error, nothing new mapped, the pool is used first") {
  // 40 pages of physical memory; a full sequence takes 8 x 4 = 32.
  faulty f(small_cfg(4, 1000), host_opts(40 * PAGE));
  kv_cache& kv = f.kv;
  auto a = kv.open(), b = kv.open();
  kv.append(a, 1000);
  kv.append(b, 100);  // 4 pages: 36 in use
  write_tokens(kv, b, 5, 0, 100);
  const auto before = kv.stats();
  CHECK_THROWS_WITH_AS(kv.append(b, 200), doctest::Contains("memfd_create"), vmm::out_of_memory);
  CHECK(kv.length(b) == 100);
  CHECK(kv.mapped_pages(b) == 1);
  CHECK(kv.stats().pages_mapped == before.pages_mapped);
  CHECK(kv.stats().pages_pooled == 0);
  check_live(f);
  CHECK(check_tokens(kv, b, 5, 100) == 0);
  kv.close(a);  // 32 pages pooled: b can grow without creating
  kv.append(b, 900);
  CHECK(kv.mapped_pages(b) == 8);
  CHECK(check_tokens(kv, b, 5, 100) == 0);
  check_live(f);
}

TEST_CASE("fault injection on create / map / set_access: rolled back, state intact, no leak") {
  for (op which : {op::create, op::map, op::set_access}) {
    for (fault kind : {fault::out_of_memory, fault::invalid_value}) {
      // append(b, 300) maps pages 1..2 x 4 buffers: 8 maps, 4 set_access, 4 creates (4 pooled).
      const std::uint64_t calls = which == op::map ? 8 : 4;
      for (std::uint64_t k = 1; k <= calls; ++k) {
        CAPTURE(vmm::test::op_name(which));
        CAPTURE(k);
        faulty f(small_cfg(4, 1000));
        kv_cache& kv = f.kv;
        auto a = kv.open(), b = kv.open();
        kv.append(a, 128);  // 1 page
        kv.append(b, 10);
        write_tokens(kv, b, 7, 0, 10);
        kv.close(a);  // 4 pooled handles: the first 4 pages of the next append reuse them
        const auto s0 = kv.stats();
        const auto h0 = f.st->live_handles(), m0 = f.st->live_mappings();
        f.st->arm(which, k, kind);
        if (kind == fault::out_of_memory)
          CHECK_THROWS_AS(kv.append(b, 300), vmm::out_of_memory);
        else
          CHECK_THROWS_WITH_AS(kv.append(b, 300), doctest::Contains(vmm::test::driver_function(which)), vmm::error);
        CHECK(f.st->injected() == 1);
        const auto s1 = kv.stats();
        CHECK(kv.length(b) == 10);
        CHECK(kv.mapped_pages(b) == 1);
        CHECK(s1.pages_mapped == s0.pages_mapped);
        CHECK(s1.pages_pooled == s0.pages_pooled);
        CHECK(s1.appends == s0.appends);
        CHECK(f.st->live_handles() == h0);
        CHECK(f.st->live_mappings() == m0);
        check_live(f);
        CHECK(check_tokens(kv, b, 7, 10) == 0);
        // The same append works once the driver does.
        kv.append(b, 300);
        write_tokens(kv, b, 7, 10, 310);
        CHECK(check_tokens(kv, b, 7, 310) == 0);
        CHECK(kv.mapped_pages(b) == 3);
        check_live(f);
      }
    }
  }
}

TEST_CASE("fault injection: a refused unmap is retried, then parked; nothing leaks") {
  faulty f(small_cfg(4, 1000));
  {
    kv_cache& kv = f.kv;
    auto a = kv.open();
    kv.append(a, 300);
    // One refusal: the retry succeeds, close is clean.
    f.st->arm(op::unmap, 1, fault::not_permitted);
    kv.close(a);
    CHECK(f.st->injected() == 1);
    CHECK(kv.stats().pages_pooled == 12);
    check_live(f);
    // Refused for good: the sequence is closed anyway, the page parked, the error reported.
    a = kv.open();
    kv.append(a, 300);
    f.st->arm(op::unmap, 1, fault::not_permitted, /*sticky=*/true);
    CHECK_THROWS_WITH_AS(kv.close(a), doctest::Contains("refused"), vmm::error);
    f.st->disarm();
    CHECK_FALSE(kv.is_open(a));
    CHECK(kv.stats().pages_mapped == 0);
    // The next growth retries the parked work first (its page's VA is needed again).
    a = kv.open();
    kv.append(a, 1000);
    write_tokens(kv, a, 3, 0, 1000);
    CHECK(check_tokens(kv, a, 3, 1000) == 0);
    check_live(f);
    // A refused release in trim keeps the handle pooled.
    kv.close(a);
    f.st->arm(op::release, 1, fault::invalid_value, true);
    CHECK_THROWS_AS(kv.trim(0), vmm::error);
    f.st->disarm();
    CHECK(kv.stats().pages_pooled > 0);
    check_live(f);
  }
  f.kv = kv_cache(vmm::test::make_fault_host(std::make_shared<fault_state>(), host_opts()), small_cfg());
  CHECK(f.st->nothing_live());
}

TEST_CASE("random open / append / truncate / close against a model") {
  auto cfg = small_cfg(6, 1000);
  cfg.pool_keep_pages = 16;
  for (std::uint64_t seed : {1u, 2u, 3u, 4u}) {
    cfg.layout = seed % 2 ? vmm::kv_layout::per_layer : vmm::kv_layout::per_sequence;
    CAPTURE(seed);
    faulty f(cfg);
    kv_cache& kv = f.kv;
    const std::size_t nb = nmapped(kv);
    struct model_seq {
      std::size_t tokens = 0, mapped = 0;
      std::uint64_t tag = 0;
    };
    std::map<vmm::seq_id, model_seq> model;
    std::size_t pool = 0, created = 0, reused = 0, released = 0;
    std::uint64_t next_tag = 1;
    std::mt19937_64 rng(seed);
    auto pages_for = [&](std::size_t n) { return (n * kv.token_stride() + PAGE - 1) / PAGE; };
    for (int step = 0; step < 1500; ++step) {
      const int what = static_cast<int>(rng() % 100);
      if (what < 15 && model.size() < cfg.max_seqs) {
        auto s = kv.open();
        CHECK_FALSE(model.count(s));
        model[s] = {0, 0, next_tag++};
      } else if (model.empty()) {
        continue;
      } else {
        auto it = model.begin();
        std::advance(it, static_cast<long>(rng() % model.size()));
        const vmm::seq_id s = it->first;
        model_seq& m = it->second;
        if (what < 70) {
          const std::size_t n = rng() % 3 == 0 ? rng() % 400 : rng() % 8;
          if (m.tokens + n > cfg.max_tokens) {
            CHECK_THROWS_AS(kv.append(s, n), vmm::out_of_memory);
          } else {
            CHECK(kv.append(s, n) == m.tokens);
            const std::size_t need = pages_for(m.tokens + n);
            if (need > m.mapped) {
              const std::size_t want = (need - m.mapped) * nb, take = std::min(pool, want);
              pool -= take;
              reused += take;
              created += want - take;
              m.mapped = need;
            }
            write_tokens(kv, s, m.tag, m.tokens, m.tokens + n);
            m.tokens += n;
          }
        } else if (what < 85) {
          const std::size_t n = m.tokens ? rng() % (m.tokens + 1) : 0;
          kv.truncate(s, n);
          m.tokens = n;
          if (m.mapped > pages_for(n)) {
            pool += (m.mapped - pages_for(n)) * nb;
            m.mapped = pages_for(n);
          }
        } else if (what < 97) {
          CHECK(check_tokens(kv, s, m.tag, m.tokens) == 0);
          kv.close(s);
          pool += m.mapped * nb;
          model.erase(it);
        } else {
          const std::size_t r = kv.trim();
          CHECK(r == (pool > cfg.pool_keep_pages ? pool - cfg.pool_keep_pages : 0));
          released += r;
          pool -= r;
        }
      }
      if (step % 50 == 0 || step == 1499) {
        const auto st = kv.stats();
        std::size_t mapped = 0, used = 0;
        for (auto& [s, m] : model) {
          CHECK(kv.length(s) == m.tokens);
          CHECK(kv.mapped_pages(s) == m.mapped);
          CHECK(check_tokens(kv, s, m.tag, m.tokens) == 0);
          mapped += m.mapped * nb;
          used += m.tokens * kv.token_bytes() * nbuf(kv);
        }
        CHECK(st.pages_mapped == mapped);
        CHECK(st.used_bytes == used);
        CHECK(st.pages_pooled == pool);
        CHECK(st.pages_created == created);
        CHECK(st.pages_reused == reused);
        CHECK(st.pages_released == released);
        CHECK(st.open_seqs == model.size());
        CHECK(st.append_driver_calls <= st.driver_calls);
        check_live(f);
      }
    }
    CHECK(reused > 0);
  }
}

TEST_CASE("map-ahead: appends on the decode path make no driver call once the thread caught up") {
  faulty f(small_cfg(4, 1000, /*ahead=*/1));
  kv_cache& kv = f.kv;
  auto a = kv.open();
  kv.wait_map_ahead();
  CHECK(kv.mapped_pages(a) == 1);  // mapped before the first token
  auto s0 = kv.stats();
  CHECK(s0.append_driver_calls == 0);
  CHECK(s0.map_ahead_driver_calls > 0);
  CHECK(s0.map_ahead_pages == 1);
  // Decode: one token at a time to the end; the thread stays one page ahead.
  for (std::size_t t = 0; t < 1000; ++t) {
    kv.append(a, 1);
    if (t % 37 == 0) write_tokens(kv, a, 4, t, t + 1);
    kv.wait_map_ahead();
    CHECK(kv.mapped_pages(a) == std::min<std::size_t>(8, kv.pages_for(t + 1) + 1));
  }
  CHECK(check_tokens(kv, a, 4, 0) == 0);
  auto s1 = kv.stats();
  CHECK(s1.append_driver_calls == 0);
  CHECK(s1.appends == 1000);
  CHECK(s1.map_ahead_pages == 8);
  CHECK(s1.map_ahead_driver_calls == 8 * 4 * 3);  // per page and buffer: create + map + set_access
  // Truncate keeps the page ahead; close returns everything.
  kv.truncate(a, 100);
  CHECK(kv.mapped_pages(a) == 2);
  kv.close(a);
  // A new sequence's pages come from the pool (no create), still off the append path.
  const auto creates = f.st->calls(op::create);
  auto b = kv.open();
  kv.wait_map_ahead();
  kv.append(b, 128);
  CHECK(kv.stats().append_driver_calls == 0);
  kv.wait_map_ahead();
  CHECK(kv.mapped_pages(b) == 2);
  CHECK(f.st->calls(op::create) == creates);
  // A prefill bigger than the map-ahead window maps on the append path (counted there).
  kv.append(b, 600);
  CHECK(kv.stats().append_driver_calls > 0);
  check_live(f);
}

TEST_CASE("map-ahead in tokens: the next page is mapped only near the end of the mapped ones") {
  auto c = small_cfg(4, 1000);
  c.map_ahead_tokens = 16;  // 128 tokens a page
  faulty f(c);
  kv_cache& kv = f.kv;
  auto a = kv.open();
  kv.wait_map_ahead();
  CHECK(kv.mapped_pages(a) == 1);  // pages_for(0 + 16)
  for (std::size_t t = 1; t <= 1000; ++t) {
    kv.append(a, 1);
    kv.wait_map_ahead();
    // pages_for(t + 16), capped at max_tokens: page p + 1 appears at token 128 (p + 1) - 16.
    CHECK(kv.mapped_pages(a) == kv.pages_for(std::min<std::size_t>(t + 16, 1000)));
  }
  CHECK(kv.mapped_pages(a) == 8);
  auto s = kv.stats();
  CHECK(s.append_driver_calls == 0);
  CHECK(s.map_ahead_pages == 8);
  kv.truncate(a, 100);  // keeps pages_for(116) = 1
  CHECK(kv.mapped_pages(a) == 1);
  check_live(f);
}

TEST_CASE("map-ahead: a failing thread is parked; the append that needs the page reports it") {
  faulty f(small_cfg(4, 1000, 1), host_opts(6 * PAGE));  // 6 pages: one page group (4) + 2
  kv_cache& kv = f.kv;
  auto a = kv.open();
  kv.wait_map_ahead();
  CHECK(kv.mapped_pages(a) == 1);
  kv.append(a, 100);
  kv.wait_map_ahead();  // the second group does not fit: the thread fails and parks
  auto s = kv.stats();
  CHECK(s.map_ahead_failures == 1);
  CHECK(kv.mapped_pages(a) == 1);
  CHECK(s.pages_pooled == 0);
  check_live(f);
  write_tokens(kv, a, 6, 0, 100);
  CHECK_THROWS_AS(kv.append(a, 100), vmm::out_of_memory);
  CHECK(kv.length(a) == 100);
  CHECK(check_tokens(kv, a, 6, 100) == 0);
  kv.append(a, 28);  // still fits the mapped page
  check_live(f);
}

TEST_CASE("map-ahead under concurrency: sequences grow, shrink and close on several threads") {
  auto cfg = small_cfg(8, 1000, 2);
  faulty f(cfg);
  {
    kv_cache& kv = f.kv;
    std::atomic<std::size_t> bad{0};
    std::vector<std::thread> th;
    for (int w = 0; w < 4; ++w)
      th.emplace_back([&, w] {
        std::mt19937_64 rng(100 + w);
        for (int round = 0; round < 30; ++round) {
          const std::uint64_t tag = 1000 * w + round;
          auto s = kv.open();  // 4 threads x 1 sequence each of 8 slots
          std::size_t n = 0;
          const std::size_t target = 1 + rng() % 999;
          while (n < target) {
            const std::size_t k = std::min<std::size_t>(target - n, 1 + rng() % 16);
            kv.append(s, k);
            write_tokens(kv, s, tag, n, n + k);
            n += k;
            if (rng() % 50 == 0) {
              n = rng() % (n + 1);
              kv.truncate(s, n);
            }
          }
          bad += check_tokens(kv, s, tag, n);
          kv.close(s);
        }
      });
    for (auto& t : th) t.join();
    CHECK(bad == 0);
    kv.wait_map_ahead();
    auto s = kv.stats();
    CHECK(s.open_seqs == 0);
    CHECK(s.pages_mapped == 0);
    CHECK(s.map_ahead_pages > 0);
    CHECK(s.pages_reused > 0);
    check_live(f);
  }
}

TEST_CASE("peers get the access asked for on every page") {
  auto c = small_cfg(2, 1000);
  c.peers = {{1, vmm::access_mode::read}};
  faulty f(c);
  auto a = f.kv.open();
  f.kv.append(a, 300);
  for (std::size_t p = 0; p < 3; ++p) {
    const auto va = reinterpret_cast<std::uintptr_t>(f.kv.k(a, 1)) + p * PAGE;
    CHECK(f.host().access_of(va, 0) == vmm::access_mode::read_write);
    CHECK(f.host().access_of(va, 1) == vmm::access_mode::read);
  }
}

TEST_CASE("destructor and move: everything unmapped and released, with the thread running") {
  auto st = std::make_shared<fault_state>();
  {
    kv_cache kv(vmm::test::make_fault_host(st, host_opts()), small_cfg(4, 1000, 2));
    auto a = kv.open(), b = kv.open();
    kv.append(a, 500);
    kv.append(b, 20);
    kv.close(a);  // pooled pages
    kv.open();    // the thread maps for it (maybe still mapping when we move/destroy)
    kv_cache moved(std::move(kv));
    CHECK(kv.base() == nullptr);
    CHECK_THROWS_AS(kv.open(), vmm::error);
    CHECK(moved.length(b) == 20);
    CHECK(st->live_handles() > 0);
  }
  CHECK(st->nothing_live());
  // The factory: plain host backend.
  auto kv = kv_cache::host(small_cfg(), host_opts());
  auto s = kv.open();
  kv.append(s, 10);
  auto& h = dynamic_cast<vmm::backend_model<vmm::host_backend>&>(kv.backend()).get();
  CHECK(h.live_mappings() == 4);
  kv.close(s);
  kv.trim(0);
  CHECK(h.live_handles() == 0);
  CHECK(h.live_mappings() == 0);
  CHECK(h.live_reservations() == 1);
}

// ---- per_sequence layout -----------------------------------------------------------------------

namespace {
vmm::kv_cache_config serving_cfg(std::size_t max_seqs = 8, std::size_t max_tokens = 1000) {
  auto c = small_cfg(max_seqs, max_tokens);
  c.layout = vmm::kv_layout::per_sequence;
  return c;
}
}  // namespace

TEST_CASE("per_sequence: one buffer per sequence, a token's K and V of every layer side by side") {
  faulty f(serving_cfg(8, 1000));
  kv_cache& kv = f.kv;
  const std::size_t T = 512, R = 4 * T;  // 2 layers x K, V
  CHECK(kv.token_bytes() == T);
  CHECK(kv.token_stride() == R);
  CHECK(kv.tokens_per_page() == PAGE / R);
  CHECK(kv.seq_stride() == 32 * PAGE);  // round_up(1000 x 2 KiB, 64 KiB)
  CHECK(kv.reserved() == 8 * kv.seq_stride());
  CHECK(kv.layer_stride() == 2 * T);
  CHECK(kv.kv_stride() == T);
  const auto base = reinterpret_cast<std::uintptr_t>(kv.base());
  for (std::size_t s = 0; s < 8; ++s)
    for (std::size_t l = 0; l < 2; ++l) {
      CHECK(reinterpret_cast<std::uintptr_t>(kv.k(s, l)) == base + s * kv.seq_stride() + 2 * l * T);
      CHECK(reinterpret_cast<std::uintptr_t>(kv.v(s, l)) == base + s * kv.seq_stride() + (2 * l + 1) * T);
    }
  CHECK(kv.pages_for(32) == 1);
  CHECK(kv.pages_for(33) == 2);
  // A sequence maps one page per 32 tokens, whatever the layers: one map each, one set_access.
  auto a = kv.open(), b = kv.open();
  const auto calls0 = kv.stats().driver_calls;
  kv.append(a, 100);
  CHECK(kv.mapped_pages(a) == 4);
  CHECK(kv.stats().pages_mapped == 4);
  CHECK(kv.stats().driver_calls - calls0 == 4 + 4 + 1);  // create + map per page, one set_access
  kv.append(b, 33);
  write_tokens(kv, a, 1, 0, 100);
  write_tokens(kv, b, 2, 0, 33);
  kv.append(a, 400);
  write_tokens(kv, a, 1, 100, 500);
  CHECK(check_tokens(kv, a, 1, 500) == 0);
  CHECK(check_tokens(kv, b, 2, 33) == 0);
  kv.close(b);
  CHECK(check_tokens(kv, a, 1, 500) == 0);
  check_live(f);
}

TEST_CASE("per_sequence: mapped memory is within one page per sequence of what the tokens use") {
  for (auto layout : {vmm::kv_layout::per_layer, vmm::kv_layout::per_sequence}) {
    auto c = small_cfg(8, 1000);
    c.layout = layout;
    faulty f(c);
    kv_cache& kv = f.kv;
    std::mt19937_64 rng(7);
    std::vector<vmm::seq_id> open;
    std::size_t worst = 0;  // largest (mapped - used) seen, in bytes
    for (int step = 0; step < 400; ++step) {
      if (open.size() < 8 && rng() % 4 == 0) open.push_back(kv.open());
      if (open.empty()) continue;
      const std::size_t i = rng() % open.size();
      if (rng() % 10 == 0) {
        kv.close(open[i]);
        open.erase(open.begin() + static_cast<long>(i));
      } else if (kv.length(open[i]) + 40 <= 1000) {
        kv.append(open[i], 1 + rng() % 40);
      }
      const auto st = kv.stats();
      worst = std::max(worst, st.mapped_bytes - st.used_bytes);
      // The bound: one partly filled page per mapped buffer of each open sequence.
      CHECK(st.mapped_bytes - st.used_bytes < st.open_seqs * nmapped(kv) * PAGE + 1);
    }
    if (layout == vmm::kv_layout::per_sequence) CHECK(worst <= 8 * PAGE);
    else CHECK(worst > 8 * PAGE);  // 4 buffers each: the per_layer layout rounds up 4 pages a sequence
  }
}

// ---- shared prefixes ---------------------------------------------------------------------------

TEST_CASE("share_prefix: whole pages mapped again read-only, no copy; the rest the caller's; freed with the last") {
  for (auto layout : {vmm::kv_layout::per_layer, vmm::kv_layout::per_sequence}) {
    auto c = small_cfg(4, 1000);
    c.layout = layout;
    CAPTURE(static_cast<int>(layout));
    faulty f(c);
    kv_cache& kv = f.kv;
    const std::size_t per_page = kv.tokens_per_page(), nb = nmapped(kv);
    auto a = kv.open();
    kv.append(a, 3 * per_page + 10);
    write_tokens(kv, a, 1, 0, 3 * per_page + 10);
    const auto before = kv.stats();
    const auto creates = f.st->calls(op::create);
    const std::size_t n = 2 * per_page + 5;  // 2 whole pages, 5 tokens in a third
    auto b = kv.share_prefix(a, n);
    CHECK(b != a);
    CHECK(kv.length(b) == n);
    CHECK(kv.shared_tokens(b) == 2 * per_page);
    CHECK(kv.shared_tokens(a) == 0);
    CHECK(kv.mapped_pages(b) == 3);
    auto st = kv.stats();
    CHECK(st.pages_aliased == 2 * nb);
    CHECK(st.pages_mapped == before.pages_mapped + nb);  // only the third page is new memory
    CHECK(f.st->calls(op::create) == creates + nb);
    check_live(f);
    // Same memory: the shared tokens read what a wrote, at b's addresses; read-only there.
    CHECK(check_tokens(kv, b, 1, 2 * per_page) == 0);
    const auto kb = reinterpret_cast<std::uintptr_t>(kv.k(b, 0));
    CHECK(f.host().access_of(kb, 0) == vmm::access_mode::read);
    CHECK(f.host().access_of(kb + 2 * PAGE, 0) == vmm::access_mode::read_write);
    // The caller copies the rest; then both grow on their own.
    write_tokens(kv, b, 1, 2 * per_page, n);
    kv.append(b, 100);
    write_tokens(kv, b, 2, n, n + 100);
    kv.append(a, 50);
    write_tokens(kv, a, 3, 3 * per_page + 10, 3 * per_page + 60);
    CHECK(check_tokens(kv, a, 1, 3 * per_page + 10) == 0);
    CHECK(check_tokens(kv, b, 1, n) == 0);
    CHECK(check_tokens(kv, b, 2, n + 100, n) == 0);
    // Closing a keeps the pages b maps; b's tokens are intact.
    kv.close(a);
    st = kv.stats();
    CHECK(st.pages_aliased == 0);
    CHECK(st.pages_mapped == kv.mapped_pages(b) * nb);
    CHECK(check_tokens(kv, b, 1, n) == 0);
    check_live(f);
    // The last mapping's unmap pools them.
    kv.close(b);
    CHECK(kv.stats().pages_mapped == 0);
    const std::size_t released = kv.trim(0);
    CHECK(released == kv.stats().pages_released);
    CHECK(f.st->live_handles() == 0);
    check_live(f);
  }
}

TEST_CASE("share_prefix: memory for N sequences sharing a prompt against N copies") {
  auto c = serving_cfg(9, 1000);
  faulty f(c);
  kv_cache& kv = f.kv;
  auto a = kv.open();
  kv.append(a, 900);  // the prompt: 29 pages (28 whole, the 29th partly)
  const std::size_t copy_pages = kv.stats().pages_mapped;
  for (int i = 0; i < 8; ++i) (void)kv.share_prefix(a, 900);
  const auto st = kv.stats();
  CHECK(st.open_seqs == 9);
  CHECK(st.pages_mapped == copy_pages + 8 * (copy_pages - 28));  // each sharer: only its last page
  CHECK(st.pages_aliased == 8 * 28);
  CHECK(st.pages_mapped * 5 < 9 * copy_pages);  // under a fifth of nine copies
  check_live(f);
}

TEST_CASE("share_prefix errors: bad source, no slot, no memory, shared pages never written; state intact") {
  faulty f(serving_cfg(3, 1000), host_opts(10 * PAGE));
  kv_cache& kv = f.kv;
  auto a = kv.open();
  kv.append(a, 100);  // 4 pages (32 tokens a page)
  write_tokens(kv, a, 1, 0, 100);
  CHECK_THROWS_WITH_AS(kv.share_prefix(a, 101), doctest::Contains("has 100 tokens"), vmm::error);
  CHECK_THROWS_WITH_AS(kv.share_prefix(2, 10), doctest::Contains("not open"), vmm::error);
  CHECK_THROWS_AS(kv.share_prefix(7, 10), vmm::error);
  CHECK(kv.stats().open_seqs == 1);
  // Sharing a sequence with itself twice is two sharers; a third has no slot.
  auto b = kv.share_prefix(a, 96);  // 3 whole pages: nothing new
  CHECK(kv.stats().pages_mapped == 4);
  auto c2 = kv.share_prefix(b, 70);  // 2 whole pages of b (a's), a third of its own
  CHECK(kv.shared_tokens(c2) == 64);
  CHECK_THROWS_WITH_AS(kv.share_prefix(a, 10), doctest::Contains("are open"), vmm::out_of_memory);
  check_live(f);
  // A truncate that would write into a shared page is refused, on either side.
  CHECK_THROWS_WITH_AS(kv.truncate(a, 50), doctest::Contains("shared"), vmm::error);
  CHECK_THROWS_WITH_AS(kv.truncate(b, 40), doctest::Contains("shared"), vmm::error);
  CHECK(kv.length(a) == 100);
  CHECK(kv.length(b) == 96);
  kv.truncate(a, 97);  // the 4th page is a's own
  kv.truncate(c2, 64);  // down to the end of its shared pages: its own page goes
  CHECK(kv.mapped_pages(c2) == 2);
  CHECK(check_tokens(kv, c2, 1, 64) == 0);
  // No memory for the sharer's own pages: nothing stays open or mapped.
  kv.close(c2);
  kv.append(a, 150);  // a: 8 pages; 10 is the limit
  write_tokens(kv, a, 1, 97, 247);
  const auto st0 = kv.stats();
  kv.close(b);
  kv.trim(0);
  const auto st1 = kv.stats();
  CHECK(st1.pages_mapped == 8);
  CHECK(st0.open_seqs == 2);
  f.st->arm(op::create, 1, fault::out_of_memory, true);
  CHECK_THROWS_AS(kv.share_prefix(a, 200), vmm::out_of_memory);  // 6 shared, 1 of its own refused
  f.st->disarm();
  CHECK(kv.stats().open_seqs == 1);
  CHECK(kv.stats().pages_aliased == 0);
  CHECK(kv.stats().pages_mapped == 8);
  CHECK(check_tokens(kv, a, 1, 247) == 0);
  check_live(f);
  // A refused map of a shared page: rolled back, nothing aliased.
  f.st->arm(op::map, 3, fault::invalid_value);
  CHECK_THROWS_AS(kv.share_prefix(a, 192), vmm::error);
  CHECK(kv.stats().open_seqs == 1);
  CHECK(kv.stats().pages_aliased == 0);
  check_live(f);
  auto d = kv.share_prefix(a, 192);
  CHECK(kv.shared_tokens(d) == 192);
  CHECK(check_tokens(kv, d, 1, 192) == 0);
  kv.close(a);
  CHECK(check_tokens(kv, d, 1, 192) == 0);
  check_live(f);
}

TEST_CASE("share_prefix: random sharing, growth, truncation and closing against the contents") {
  for (auto layout : {vmm::kv_layout::per_layer, vmm::kv_layout::per_sequence}) {
    auto c = small_cfg(6, 600);
    c.layout = layout;
    c.retain_closed = layout == vmm::kv_layout::per_sequence;  // retained pages must never be shared ones
    faulty f(c);
    {
      kv_cache& kv = f.kv;
      // Each token of a sequence carries the tag of whoever wrote it: a sharer's prefix carries its
      // source's. tags[s][t]
      std::map<vmm::seq_id, std::vector<std::uint64_t>> tags;
      std::uint64_t next = 1;
      std::mt19937_64 rng(11 + static_cast<int>(layout));
      auto check_seq = [&](vmm::seq_id s) {
        const auto& v = tags[s];
        std::size_t bad = 0;
        for (std::size_t t = 0; t < v.size(); ++t) bad += check_tokens(kv, s, v[t], t + 1, t);
        return bad;
      };
      for (int step = 0; step < 600; ++step) {
        const int what = static_cast<int>(rng() % 100);
        if (tags.size() < 6 && what < 15) {
          tags[kv.open()] = {};
        } else if (tags.empty()) {
          continue;
        } else {
          auto it = tags.begin();
          std::advance(it, static_cast<long>(rng() % tags.size()));
          const vmm::seq_id s = it->first;
          auto& v = it->second;
          if (what < 55) {
            const std::size_t n = std::min<std::size_t>(rng() % 3 ? rng() % 6 : rng() % 150, 600 - v.size());
            kv.append(s, n);
            const std::uint64_t tag = next++;
            write_tokens(kv, s, tag, v.size(), v.size() + n);
            v.insert(v.end(), n, tag);
          } else if (what < 70 && tags.size() < 6 && !v.empty()) {
            const std::size_t n = rng() % (v.size() + 1);
            const auto src_tags = std::vector<std::uint64_t>(v.begin(), v.begin() + static_cast<long>(n));
            const auto d = kv.share_prefix(s, n);
            CHECK_FALSE(tags.count(d));
            for (std::size_t t = kv.shared_tokens(d); t < n; ++t) write_tokens(kv, d, src_tags[t], t, t + 1);
            tags[d] = src_tags;
          } else if (what < 82) {
            const std::size_t n = v.empty() ? 0 : rng() % (v.size() + 1);
            try {
              kv.truncate(s, n);
              v.resize(n);
            } catch (const vmm::error&) {
              CHECK(kv.length(s) == v.size());  // refused: a shared page would take new tokens
            }
          } else if (what < 95) {
            CHECK(check_seq(s) == 0);
            kv.close(s);
            tags.erase(it);
          } else {
            (void)kv.trim(0);
          }
        }
        if (step % 25 == 0) {
          for (auto& [s, v] : tags) CHECK(check_seq(s) == 0);
          check_live(f);
        }
      }
      for (auto& [s, v] : tags) {
        CHECK(check_seq(s) == 0);
        kv.close(s);
      }
      CHECK(kv.stats().pages_aliased == 0);
      check_live(f);
    }
    f.kv = kv_cache(vmm::test::make_fault_host(std::make_shared<fault_state>(), host_opts()), small_cfg());
    CHECK(f.st->nothing_live());
  }
}
