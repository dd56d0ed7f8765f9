// SPDX-License-Identifier: Apache-2.0
// The conformance suite: every backend runs these same cases (host always; CUDA when a device is
// present). A Traits type supplies:
//   static constexpr const char* name;
//   static vmm::allocator make(vmm::options o, const vmm::tuning& t = {});  // fresh allocator on
//                                                      // this backend (t: allocator_access::make)
//   static void fill(void* p, std::size_t n, std::uint64_t seed);   // write a pattern (host: CPU,
//   static bool verify(const void* p, std::size_t n, std::uint64_t seed);  // GPU: kernels)
//   static bool device_memory(std::size_t& free, std::size_t& total);  // false: not applicable
//   static vmm::stream_t stream(int i);   // a real stream on the GPU, a tag on the host
// and may supply (where it can count its backend's objects, e.g. the host backend):
//   static vmm::allocator make_watched(vmm::options o, std::function<conf::live_counts()>& live);
//       like make(), and `live` reads the backend's live objects, also after the allocator is gone
// Include after doctest.h; instantiate with VMM_CONFORMANCE_INVOKE(Traits).
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <random>
#include <vector>

#include "arena/tuning.hpp"
#include "vmmalloc/vmmalloc.hpp"

namespace conf {

constexpr std::size_t KiB = 1024, MiB = 1024 * KiB, GiB = 1024 * MiB;

inline bool aligned(const void* p, std::size_t a) { return reinterpret_cast<std::uintptr_t>(p) % a == 0; }

inline vmm::options small_options() {
  vmm::options o;
  o.reservation_size = 16 * GiB;
  return o;
}

// Objects a backend holds: what must drop to zero once an allocator is destroyed.
struct live_counts {
  std::size_t handles = 0, mappings = 0, reservations = 0;
};

template <class T>
vmm::allocator make_watched(vmm::options o, std::function<live_counts()>& live) {
  if constexpr (requires { T::make_watched(o, live); })
    return T::make_watched(o, live);
  else
    return T::make(o);
}

template <class T>
vmm::errc errc_of_allocate(vmm::allocator& a, std::size_t n, std::size_t align = 0) {
  try {
    void* p = a.allocate(n, align);
    a.deallocate(p);
    return vmm::errc::ok;
  } catch (const vmm::out_of_memory&) {
    return vmm::errc::out_of_memory;
  } catch (const vmm::error& e) {
    return e.st().kind;
  }
}

}  // namespace conf

TEST_CASE_TEMPLATE_DEFINE("conformance: one small allocation is aligned, readable and writable", T, conf_01) {
  auto a = T::make(conf::small_options());
  void* p = a.allocate(1);
  REQUIRE(p != nullptr);
  CHECK(conf::aligned(p, 256));
  CHECK(a.usable_size(p) >= 1);
  T::fill(p, 1, 7);
  CHECK(T::verify(p, 1, 7));
  a.deallocate(p);
  CHECK(a.check() == "");
  CHECK(a.stats().live == 0);
}

TEST_CASE_TEMPLATE_DEFINE("conformance: sizes from 1 B to 1 GiB round-trip their contents", T, conf_02) {
  auto a = T::make(conf::small_options());
  std::vector<std::size_t> sizes;
  for (std::size_t n = 1; n <= conf::GiB; n *= 4) {
    sizes.push_back(n);
    sizes.push_back(n + 1);
    sizes.push_back(n * 3 - 1);
  }
  sizes.push_back(conf::GiB);
  for (std::size_t n : sizes) {
    if (n > conf::GiB) continue;
    CAPTURE(n);
    void* p = a.allocate(n);
    REQUIRE(conf::aligned(p, 256));
    REQUIRE(a.usable_size(p) >= n);
    T::fill(p, n, n);
    REQUIRE(T::verify(p, n, n));
    a.deallocate(p);
    REQUIRE(a.check() == "");
  }
}

TEST_CASE_TEMPLATE_DEFINE("conformance: alignments 256 B, 4 KiB and 2 MiB are honoured", T, conf_03) {
  auto a = T::make(conf::small_options());
  std::vector<void*> ps;
  for (std::size_t align : {std::size_t{256}, 4 * conf::KiB, 2 * conf::MiB})
    for (std::size_t n : {std::size_t{1}, std::size_t{3000}, 70 * conf::KiB, 3 * conf::MiB + 5, 300 * conf::MiB}) {
      CAPTURE(align);
      CAPTURE(n);
      void* p = a.allocate(n, align);
      CHECK(conf::aligned(p, align));
      T::fill(p, std::min(n, 4 * conf::MiB), align + n);
      ps.push_back(p);
    }
  CHECK(a.check() == "");
  for (void* p : ps) a.deallocate(p);
  CHECK(a.check() == "");
}

TEST_CASE_TEMPLATE_DEFINE("conformance: bad alignments are rejected and leave the allocator intact", T, conf_04) {
  auto a = T::make(conf::small_options());
  void* keep = a.allocate(1000);
  auto before = a.stats();
  CHECK(conf::errc_of_allocate<T>(a, 100, 3) == vmm::errc::invalid_value);
  CHECK(conf::errc_of_allocate<T>(a, 100, 768) == vmm::errc::invalid_value);
  CHECK(conf::errc_of_allocate<T>(a, 100, 4 * a.granularity()) == vmm::errc::invalid_value);
  CHECK(a.try_allocate(100, 3) == nullptr);
  CHECK(vmm::last_error().st.kind == vmm::errc::invalid_value);
  auto after = a.stats();
  CHECK(after.live == before.live);
  CHECK(after.requested == before.requested);
  CHECK(a.check() == "");
  a.deallocate(keep);
}

TEST_CASE_TEMPLATE_DEFINE("conformance: live allocations never overlap", T, conf_05) {
  auto a = T::make(conf::small_options());
  std::mt19937_64 rng(42);
  std::map<std::uintptr_t, std::size_t> live;
  for (int i = 0; i < 3000; ++i) {
    std::size_t n = std::size_t{1} << (rng() % 23);
    n += rng() % n;
    void* p = a.allocate(n);
    auto u = reinterpret_cast<std::uintptr_t>(p);
    auto it = live.lower_bound(u);
    if (it != live.end()) REQUIRE(u + n <= it->first);
    if (it != live.begin()) REQUIRE(std::prev(it)->first + std::prev(it)->second <= u);
    live[u] = n;
    if (rng() % 3 == 0) {
      auto victim = live.begin();
      std::advance(victim, rng() % live.size());
      a.deallocate(reinterpret_cast<void*>(victim->first));
      live.erase(victim);
    }
  }
  CHECK(a.check() == "");
  for (auto& [u, n] : live) a.deallocate(reinterpret_cast<void*>(u));
  CHECK(a.stats().live == 0);
}

TEST_CASE_TEMPLATE_DEFINE("conformance: random alloc/free sequences keep every invariant and every byte", T, conf_06) {
  for (std::uint64_t seed : {1u, 2u, 3u}) {
    CAPTURE(seed);
    auto a = T::make(conf::small_options());
    std::mt19937_64 rng(seed);
    struct live_block { void* p; std::size_t n; std::uint64_t id; };
    std::vector<live_block> live;
    std::uint64_t next_id = 1;
    for (int i = 0; i < 4000; ++i) {
      if (live.empty() || rng() % 100 < 55) {
        std::size_t n = std::size_t{1} << (rng() % 26);
        n += rng() % n;
        void* p = a.allocate(n);
        std::size_t check_n = std::min(n, 256 * conf::KiB);
        T::fill(p, check_n, next_id);
        live.push_back({p, n, next_id++});
      } else {
        std::size_t k = rng() % live.size();
        REQUIRE(T::verify(live[k].p, std::min(live[k].n, 256 * conf::KiB), live[k].id));
        a.deallocate(live[k].p);
        live[k] = live.back();
        live.pop_back();
      }
      if (i % 500 == 0) REQUIRE(a.check() == "");
      if (live.size() > 400) {
        for (auto& b : live) a.deallocate(b.p);
        live.clear();
      }
    }
    for (auto& b : live) {
      REQUIRE(T::verify(b.p, std::min(b.n, 256 * conf::KiB), b.id));
      a.deallocate(b.p);
    }
    CHECK(a.check() == "");
    auto s = a.stats();
    CHECK(s.requested == 0);
    CHECK(s.allocated == 0);
    CHECK(s.allocs == s.frees);
  }
}

TEST_CASE_TEMPLATE_DEFINE("conformance: growth across many chunks keeps earlier contents", T, conf_07) {
  vmm::tuning t;
  t.max_growth = 0;  // no geometric growth: one granule per growth, so many chunks
  auto a = T::make(conf::small_options(), t);
  std::vector<void*> ps;
  for (int i = 0; i < 64; ++i) {
    void* p = a.allocate(1536 * conf::KiB);
    T::fill(p, 1536 * conf::KiB, i);
    ps.push_back(p);
  }
  auto s = a.stats();
  CHECK(s.chunks >= 32);
  CHECK(s.mapped >= 64 * 1536 * conf::KiB);
  for (int i = 0; i < 64; ++i) CHECK(T::verify(ps[i], 1536 * conf::KiB, i));
  CHECK(a.check() == "");
  for (void* p : ps) a.deallocate(p);
}

TEST_CASE_TEMPLATE_DEFINE("conformance: repeated growth is geometric (few driver calls)", T, conf_08) {
  auto a = T::make(conf::small_options());
  std::vector<void*> ps;
  for (int i = 0; i < 400; ++i) ps.push_back(a.allocate(300 * conf::KiB));  // 120 MB total
  auto s = a.stats();
  // One 2 MiB chunk per growth would need ~58 creates; doubling up to 8 MiB needs about 17.
  CHECK(s.calls.create < 20);
  CHECK(s.mapped < 2 * s.allocated + 64 * conf::MiB);
  for (void* p : ps) a.deallocate(p);
  CHECK(a.check() == "");
}

TEST_CASE_TEMPLATE_DEFINE("conformance: a huge request is one mapping of handles of at most max_handle", T, conf_09) {
  for (std::size_t hc : {std::size_t{0}, vmm::tuning{}.max_handle}) {
    CAPTURE(hc);
    vmm::tuning t;
    t.max_handle = hc;
    auto a = T::make(conf::small_options(), t);
    void* p = a.allocate(700 * conf::MiB);
    auto s = a.stats();
    const std::size_t handles = hc ? (700 * conf::MiB + hc - 1) / hc : 1;
    CHECK(s.calls.create == handles);
    CHECK(s.calls.map == handles);
    CHECK(s.calls.set_access == 1);  // one call over the whole range
    CHECK(s.chunks == handles);
    CHECK(s.mapped == 700 * conf::MiB);
    T::fill(p, 700 * conf::MiB, 5);
    CHECK(T::verify(p, 700 * conf::MiB, 5));
    a.deallocate(p);
  }
}

TEST_CASE_TEMPLATE_DEFINE("conformance: a freed huge block is reused without driver calls", T, conf_10) {
  auto a = T::make(conf::small_options());
  void* p = a.allocate(300 * conf::MiB);
  a.deallocate(p);
  auto before = a.stats().calls.total();
  void* q = a.allocate(300 * conf::MiB - 12345);
  CHECK(q == p);
  CHECK(a.stats().calls.total() == before);
  a.deallocate(q);
  CHECK(a.check() == "");
}

TEST_CASE_TEMPLATE_DEFINE("conformance: trim returns mapped memory to the kept amount", T, conf_11) {
  auto a = T::make(conf::small_options());
  std::size_t dfree0 = 0, dtotal = 0;
  bool has_dev = T::device_memory(dfree0, dtotal);
  std::vector<void*> ps;
  for (std::size_t n : {100u, 5000u, 70000u, 3000000u, 50000000u, 300000000u})
    for (int i = 0; i < 8; ++i) ps.push_back(a.allocate(n));
  CHECK(a.stats().mapped > 0);
  for (void* p : ps) a.deallocate(p);
  CHECK(a.stats().mapped > 0);  // default policy keeps freed memory mapped for reuse
  a.trim(64 * conf::MiB);
  auto s = a.stats();
  CHECK(s.free_chunk_bytes + s.idle <= 64 * conf::MiB);
  a.trim(0);
  s = a.stats();
  CHECK(s.mapped == 0);
  CHECK(s.physical == 0);
  CHECK(s.chunks == 0);
  CHECK(a.check() == "");
  if (has_dev) {
    std::size_t dfree1 = 0;
    T::device_memory(dfree1, dtotal);
    CHECK(dfree1 + 64 * conf::MiB >= dfree0);  // the driver's own view agrees
  }
}

TEST_CASE_TEMPLATE_DEFINE("conformance: a release threshold of 0 unmaps free chunks at once", T, conf_12) {
  vmm::options o = conf::small_options();
  o.release_threshold = 0;
  auto a = T::make(o);
  void* p = a.allocate(300 * conf::MiB);
  CHECK(a.stats().mapped >= 300 * conf::MiB);
  a.deallocate(p);
  auto s = a.stats();
  CHECK(s.mapped == 0);
  CHECK(s.physical == 0);
  void* q = a.allocate(10 * conf::MiB);
  void* r = a.allocate(1000);
  a.deallocate(q);
  a.deallocate(r);
  s = a.stats();
  CHECK(s.physical <= s.slab_bytes + a.granularity());  // an empty slab stays for reuse
  CHECK(a.check() == "");
}

TEST_CASE_TEMPLATE_DEFINE("conformance: memory freed by one request is stitched into another", T, conf_13) {
  auto a = T::make(conf::small_options());
  void* p = a.allocate(300 * conf::MiB);
  a.deallocate(p);
  // A different huge size cannot reuse the cached block as is; its physical memory is reused
  // (unmap + map + set_access) instead of creating more.
  void* q = a.allocate(400 * conf::MiB);
  auto s = a.stats();
  CHECK(s.stitched >= 1);
  CHECK(s.physical <= 400 * conf::MiB);
  T::fill(q, 400 * conf::MiB, 9);
  CHECK(T::verify(q, 400 * conf::MiB, 9));
  a.deallocate(q);
  CHECK(a.check() == "");
}

TEST_CASE_TEMPLATE_DEFINE("conformance: a policy memory limit gives out_of_memory cleanly", T, conf_14) {
  vmm::options o = conf::small_options();
  o.memory_limit = 64 * conf::MiB;
  auto a = T::make(o);
  void* p = a.allocate(40 * conf::MiB);
  CHECK_THROWS_AS(a.allocate(40 * conf::MiB), vmm::out_of_memory);
  CHECK_THROWS_AS(a.allocate(40 * conf::MiB), std::bad_alloc);
  CHECK(a.try_allocate(40 * conf::MiB) == nullptr);
  CHECK(vmm::last_error().st.kind == vmm::errc::out_of_memory);
  CHECK(a.check() == "");
  CHECK(a.stats().physical <= 64 * conf::MiB);
  a.deallocate(p);
  void* q = a.allocate(60 * conf::MiB);  // the memory came back
  T::fill(q, 60 * conf::MiB, 3);
  CHECK(T::verify(q, 60 * conf::MiB, 3));
  a.deallocate(q);
  CHECK(a.check() == "");
}

TEST_CASE_TEMPLATE_DEFINE("conformance: reservation exhaustion is a clear out_of_memory", T, conf_15) {
  vmm::options o;
  o.reservation_size = 64 * conf::MiB;
  auto a = T::make(o);
  void* p = a.allocate(48 * conf::MiB);
  try {
    a.allocate(32 * conf::MiB);
    FAIL("allocation past the reservation succeeded");
  } catch (const vmm::out_of_memory& e) {
    CHECK(std::string(e.what()).find("reservation") != std::string::npos);
  }
  CHECK_THROWS_AS(a.allocate(65 * conf::MiB), vmm::out_of_memory);  // larger than the reservation
  CHECK_THROWS_AS(a.allocate(SIZE_MAX), vmm::out_of_memory);
  CHECK_THROWS_AS(a.allocate(SIZE_MAX - 255), vmm::out_of_memory);
  CHECK(a.check() == "");
  a.deallocate(p);
  void* q = a.allocate(60 * conf::MiB);
  a.deallocate(q);
  CHECK(a.check() == "");
}

TEST_CASE_TEMPLATE_DEFINE("conformance: stats add up and peaks reset", T, conf_16) {
  vmm::options o = conf::small_options();
  auto a = T::make(o);
  void* p1 = a.allocate(100);
  void* p2 = a.allocate(100 * conf::KiB);
  void* p3 = a.allocate(300 * conf::MiB);
  auto s = a.stats();
  CHECK(s.requested == 100 + 100 * conf::KiB + 300 * conf::MiB);
  CHECK(s.allocated >= s.requested);
  CHECK(s.allocated == a.usable_size(p1) + a.usable_size(p2) + a.usable_size(p3));
  CHECK(s.live == 3);
  CHECK(s.mapped >= s.allocated);
  CHECK(s.physical >= s.mapped);
  CHECK(s.reserved == 16 * conf::GiB);
  CHECK(s.peak_mapped == s.mapped);
  CHECK(s.peak_physical == s.physical);
  const std::size_t high = s.mapped;
  a.deallocate(p3);
  a.trim(0);
  s = a.stats();
  CHECK(s.requested == 100 + 100 * conf::KiB);
  CHECK(s.mapped < high);
  CHECK(s.peak_mapped == high);
  a.reset_peaks();
  s = a.stats();
  CHECK(s.peak_mapped == s.mapped);
  CHECK(s.peak_physical == s.physical);
  a.deallocate(p1);
  a.deallocate(p2);
  s = a.stats();
  CHECK(s.allocs == 3);
  CHECK(s.frees == 3);
  CHECK(s.calls.total() > 0);
}

TEST_CASE_TEMPLATE_DEFINE("conformance: double, foreign and interior frees are errors that change nothing", T, conf_17) {
  auto a = T::make(conf::small_options());
  for (std::size_t n : {std::size_t{100}, 200 * conf::KiB, 300 * conf::MiB}) {
    CAPTURE(n);
    void* keep = a.allocate(n);
    void* p = a.allocate(n);
    a.deallocate(p);
    auto before = a.stats();
    try {
      a.deallocate(p);
      FAIL("double free accepted");
    } catch (const vmm::error& e) {
      CHECK(e.st().kind == vmm::errc::invalid_pointer);
    }
    CHECK_THROWS_AS(a.deallocate(static_cast<char*>(keep) + 256), vmm::error);
    int local = 0;
    CHECK_THROWS_AS(a.deallocate(&local), vmm::error);
    CHECK(a.try_deallocate(&local).kind == vmm::errc::invalid_pointer);
    auto after = a.stats();
    CHECK(after.live == before.live);
    CHECK(after.requested == before.requested);
    CHECK(a.check() == "");
    a.deallocate(nullptr);  // a no-op
    T::fill(keep, std::min(n, conf::MiB), 1);
    CHECK(T::verify(keep, std::min(n, conf::MiB), 1));
    a.deallocate(keep);
  }
  CHECK(a.stats().live == 0);
}

TEST_CASE_TEMPLATE_DEFINE("conformance: size 0 is invalid_value", T, conf_18) {
  auto a = T::make(conf::small_options());
  CHECK(conf::errc_of_allocate<T>(a, 0) == vmm::errc::invalid_value);
  CHECK(a.try_allocate(0) == nullptr);
  CHECK(a.check() == "");
}

TEST_CASE_TEMPLATE_DEFINE("conformance: every small class hands out distinct slots", T, conf_19) {
  auto a = T::make(conf::small_options());
  std::vector<void*> ps;
  for (std::size_t n = 1; n <= 64 * conf::KiB; n += n / 3 + 1)
    for (int i = 0; i < 40; ++i) ps.push_back(a.allocate(n));
  std::vector<void*> sorted = ps;
  std::sort(sorted.begin(), sorted.end());
  CHECK(std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end());
  for (void* p : ps) CHECK(conf::aligned(p, 256));
  CHECK(a.check() == "");
  for (void* p : ps) a.deallocate(p);
  CHECK(a.check() == "");
  a.trim(0);
  CHECK(a.stats().mapped == 0);
}

TEST_CASE_TEMPLATE_DEFINE("conformance: a freed block is reused by the same stream at once", T, conf_20) {
  auto a = T::make(conf::small_options());
  auto s1 = T::stream(1);
  void* p = a.allocate(1 * conf::MiB, 0, s1);
  a.deallocate(p, s1);
  void* q = a.allocate(1 * conf::MiB, 0, s1);
  CHECK(q == p);
  a.deallocate(q, s1);
  void* r = a.allocate(100, 0, s1);
  a.deallocate(r, s1);
  CHECK(a.allocate(100, 0, s1) == r);
  a.deallocate(r, s1);
  CHECK(a.check() == "");
}

TEST_CASE_TEMPLATE_DEFINE("conformance: destroying an allocator with live blocks releases everything", T, conf_21) {
  std::size_t f0 = 0, total = 0;
  bool has_dev = T::device_memory(f0, total);
  std::function<conf::live_counts()> live;  // set where the Traits can count backend objects
  {
    auto a = conf::make_watched<T>(conf::small_options(), live);
    for (std::size_t n : {100u, 100000u, 5000000u, 400000000u}) a.allocate(n);
    if (live) {  // the probe sees this allocator's objects (else the zeros below prove nothing)
      auto c = live();
      CHECK(c.handles > 0);
      CHECK(c.mappings > 0);
      CHECK(c.reservations > 0);
    }
  }
  if (live) {
    auto c = live();
    CHECK(c.handles == 0);
    CHECK(c.mappings == 0);
    CHECK(c.reservations == 0);
  }
  if (has_dev) {
    std::size_t f1 = 0;
    T::device_memory(f1, total);
    CHECK(f1 + 64 * conf::MiB >= f0);
  }
  if (!live && !has_dev) MESSAGE(std::string(T::name) << ": no object counts and no device memory figures: nothing compared");
  auto b = T::make(conf::small_options());  // a fresh one works after
  b.deallocate(b.allocate(10));
}

TEST_CASE_TEMPLATE_DEFINE("conformance: a moved allocator keeps its blocks", T, conf_22) {
  auto a = T::make(conf::small_options());
  void* p = a.allocate(5000);
  T::fill(p, 5000, 11);
  vmm::allocator b = std::move(a);
  CHECK(T::verify(p, 5000, 11));
  CHECK(b.usable_size(p) >= 5000);
  b.deallocate(p);
  CHECK(b.check() == "");
}

TEST_CASE_TEMPLATE_DEFINE("conformance: record_stream on a live block, errors on a dead one", T, conf_23) {
  auto a = T::make(conf::small_options());
  auto s2 = T::stream(2);
  void* p = a.allocate(1 * conf::MiB);
  a.record_stream(p, s2);
  a.deallocate(p);
  CHECK(a.check() == "");
  CHECK_THROWS_AS(a.record_stream(p, s2), vmm::error);
}

// Instantiates every case above for one Traits type.
#define VMM_CONFORMANCE_INVOKE(Traits) \
  TEST_CASE_TEMPLATE_INVOKE(conf_01, Traits); \
  TEST_CASE_TEMPLATE_INVOKE(conf_02, Traits); \
  TEST_CASE_TEMPLATE_INVOKE(conf_03, Traits); \
  TEST_CASE_TEMPLATE_INVOKE(conf_04, Traits); \
  TEST_CASE_TEMPLATE_INVOKE(conf_05, Traits); \
  TEST_CASE_TEMPLATE_INVOKE(conf_06, Traits); \
  TEST_CASE_TEMPLATE_INVOKE(conf_07, Traits); \
  TEST_CASE_TEMPLATE_INVOKE(conf_08, Traits); \
  TEST_CASE_TEMPLATE_INVOKE(conf_09, Traits); \
  TEST_CASE_TEMPLATE_INVOKE(conf_10, Traits); \
  TEST_CASE_TEMPLATE_INVOKE(conf_11, Traits); \
  TEST_CASE_TEMPLATE_INVOKE(conf_12, Traits); \
  TEST_CASE_TEMPLATE_INVOKE(conf_13, Traits); \
  TEST_CASE_TEMPLATE_INVOKE(conf_14, Traits); \
  TEST_CASE_TEMPLATE_INVOKE(conf_15, Traits); \
  TEST_CASE_TEMPLATE_INVOKE(conf_16, Traits); \
  TEST_CASE_TEMPLATE_INVOKE(conf_17, Traits); \
  TEST_CASE_TEMPLATE_INVOKE(conf_18, Traits); \
  TEST_CASE_TEMPLATE_INVOKE(conf_19, Traits); \
  TEST_CASE_TEMPLATE_INVOKE(conf_20, Traits); \
  TEST_CASE_TEMPLATE_INVOKE(conf_21, Traits); \
  TEST_CASE_TEMPLATE_INVOKE(conf_22, Traits); \
  TEST_CASE_TEMPLATE_INVOKE(conf_23, Traits);
