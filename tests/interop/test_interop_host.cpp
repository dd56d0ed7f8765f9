// SPDX-License-Identifier: Apache-2.0
// Host tests of the Vulkan interop's CUDA side (external_arena, external_semaphore, release_after)
// over a fake external_api: sub-allocation, stream-ordered reuse, the fd rule, teardown order,
// argument validation. No GPU, no Vulkan.
#include <doctest/doctest.h>

#include <sys/mman.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "fake_external_api.hpp"
#include "support/stream_tag.hpp"
#include "vmmalloc/vulkan_interop.hpp"

using vmm::test::stream_tag;

using vmm::errc;
using vmm::vk::external_arena;
using vmm::vk::external_semaphore;
using vmm::vk::semaphore_kind;

namespace {

constexpr std::uint64_t MiB = 1ull << 20;

// A real fd standing in for a Vulkan export (a memfd: what the host backend uses for chunks too).
struct test_fd {
  int fd = ::memfd_create("vk-export", MFD_CLOEXEC);
  ~test_fd() {
    if (fd >= 0) ::close(fd);
  }
};

errc kind_of_throw(const std::function<void()>& f) {
  try {
    f();
  } catch (const vmm::error& e) {
    return e.st().kind;
  } catch (const vmm::out_of_memory&) {
    return errc::out_of_memory;
  }
  return errc::ok;
}

bool overlap(const void* a, std::uint64_t an, const void* b, std::uint64_t bn) {
  auto x = reinterpret_cast<std::uintptr_t>(a), y = reinterpret_cast<std::uintptr_t>(b);
  return x < y + bn && y < x + an;
}

}  // namespace

TEST_CASE("import: argument validation, nothing imported and no fd leaked") {
  auto api = std::make_shared<fake::api>();
  test_fd f;
  const int before = fake::open_fds();
  external_arena a;
  CHECK(external_arena::try_import(nullptr, f.fd, 4 * MiB, false, a).kind == errc::invalid_value);
  CHECK(external_arena::try_import(api, -1, 4 * MiB, false, a).kind == errc::invalid_value);
  CHECK(external_arena::try_import(api, f.fd, 0, false, a).kind == errc::invalid_value);
  vmm::vk::arena_options bad;
  bad.alignment = 3;
  CHECK(external_arena::try_import(api, f.fd, 4 * MiB, false, a, bad).kind == errc::invalid_value);
  bad.alignment = 8 * MiB;
  CHECK(external_arena::try_import(api, f.fd, 4 * MiB, false, a, bad).kind == errc::invalid_value);
  // An fd number that is not open: EBADF from the dup, reported as invalid_value.
  int closed = ::memfd_create("closed", MFD_CLOEXEC);
  ::close(closed);
  vmm::status st = external_arena::try_import(api, closed, 4 * MiB, false, a);
  CHECK(st.kind == errc::invalid_value);
  CHECK(std::string(st.name).find("EBADF") != std::string::npos);
  CHECK(kind_of_throw([&] { external_arena::import(api, -1, MiB, false); }) == errc::invalid_value);
  CHECK(api->log.empty());  // nothing reached the API
  CHECK(a.size() == 0);
  CHECK(fake::open_fds() == before);
  CHECK(fake::fd_open(f.fd));
}

TEST_CASE("fd rule: a successful import keeps the caller's fd; CUDA owns a dup until destroy") {
  auto api = std::make_shared<fake::api>();
  test_fd f;
  const int before = fake::open_fds();
  {
    external_arena a = external_arena::import(api, f.fd, 8 * MiB, true);
    CHECK(fake::fd_open(f.fd));                  // the caller's fd is untouched
    CHECK(api->owned_memory_fd != f.fd);         // CUDA got a dup
    CHECK(fake::fd_open(api->owned_memory_fd));  // ... which the arena does not close
    CHECK(fake::open_fds() == before + 1);
    CHECK(api->imported_size == 8 * MiB);
    CHECK(api->imported_dedicated);
    CHECK(a.dedicated());
    CHECK(a.size() == 8 * MiB);
    CHECK(a.stats().capacity == 8 * MiB);
    CHECK(a.check() == "");
    // The caller may close its fd at once: the import holds its own.
    ::close(f.fd);
    f.fd = -1;
    void* p = a.allocate(MiB);
    CHECK(p == a.base());
  }
  CHECK(api->premature_close == 0);  // the dup was open until destroy_memory closed it
  CHECK(api->live_memories == 0);
  CHECK(api->live_buffers == 0);
  CHECK(fake::open_fds() == before - 1);  // only the caller's own close is missing
}

TEST_CASE("fd rule: a failed import leaves the caller's fd and leaks nothing") {
  auto api = std::make_shared<fake::api>();
  test_fd f;
  const int before = fake::open_fds();
  SUBCASE("import fails") {
    api->fail_import = true;
    external_arena a;
    vmm::status st = external_arena::try_import(api, f.fd, 4 * MiB, false, a);
    CHECK(st.kind == errc::invalid_value);
    CHECK(api->log == std::vector<std::string>{"import_memory"});
    CHECK(kind_of_throw([&] { external_arena::import(api, f.fd, 4 * MiB, false); }) == errc::invalid_value);
  }
  SUBCASE("map fails after the import: the memory is destroyed (closing CUDA's dup), not closed by us") {
    api->fail_map = true;
    external_arena a;
    vmm::status st = external_arena::try_import(api, f.fd, 4 * MiB, false, a);
    CHECK(st.kind == errc::out_of_memory);
    CHECK(api->log == std::vector<std::string>{"import_memory", "map_buffer", "destroy_memory"});
    CHECK(api->premature_close == 0);  // no double close
    CHECK(api->live_memories == 0);
  }
  CHECK(fake::fd_open(f.fd));
  CHECK(fake::open_fds() == before);
}

TEST_CASE("teardown order: the mapped buffer is freed, then the external memory destroyed") {
  auto api = std::make_shared<fake::api>();
  test_fd f;
  external_arena a = external_arena::import(api, f.fd, 4 * MiB, false);
  void* p = a.allocate(4096);
  a.deallocate(p, stream_tag(1));
  api->log.clear();
  CHECK(a.close().ok());
  CHECK(api->log == std::vector<std::string>{"free_buffer", "destroy_memory"});
  CHECK(api->live_fences == 0);  // the deferred block's fence was dropped
  CHECK(a.size() == 0);
  CHECK(a.close().ok());  // idempotent
  CHECK(api->log.size() == 2);
  CHECK(a.try_allocate(256) == nullptr);
}

TEST_CASE("moving an arena moves ownership; assigning over one tears the old one down") {
  auto api = std::make_shared<fake::api>();
  test_fd f;
  external_arena a = external_arena::import(api, f.fd, 4 * MiB, false);
  external_arena b = std::move(a);
  CHECK(a.size() == 0);
  CHECK(b.size() == 4 * MiB);
  b = external_arena::import(api, f.fd, 2 * MiB, false);
  CHECK(api->live_memories == 1);
  CHECK(b.size() == 2 * MiB);
}

TEST_CASE("sub-allocation: aligned, disjoint, contents kept, coalesced when freed") {
  auto api = std::make_shared<fake::api>();
  test_fd f;
  external_arena a = external_arena::import(api, f.fd, 4 * MiB, false);
  struct blk {
    void* p;
    std::uint64_t n;
    unsigned char tag;
  };
  std::vector<blk> live;
  const std::uint64_t sizes[] = {1, 255, 256, 257, 4096, 100000, 65536, 3};
  unsigned char tag = 1;
  for (std::uint64_t n : sizes) {
    void* p = a.allocate(n, 0, stream_tag(1));
    CHECK(reinterpret_cast<std::uintptr_t>(p) % 256 == 0);
    CHECK(a.owns(p));
    CHECK(a.offset_of(p) == static_cast<std::uint64_t>(static_cast<char*>(p) - static_cast<char*>(a.base())));
    std::memset(p, tag, n);
    live.push_back({p, n, tag++});
  }
  void* big = a.allocate(4096, 65536, stream_tag(1));  // explicit alignment
  CHECK(reinterpret_cast<std::uintptr_t>(big) % 65536 == 0);
  std::memset(big, 0xEE, 4096);
  live.push_back({big, 4096, 0xEE});
  for (std::size_t i = 0; i < live.size(); ++i)
    for (std::size_t j = i + 1; j < live.size(); ++j) CHECK_FALSE(overlap(live[i].p, live[i].n, live[j].p, live[j].n));
  for (const blk& b : live)
    for (std::uint64_t k = 0; k < b.n; ++k)
      if (static_cast<unsigned char*>(b.p)[k] != b.tag) FAIL("block contents overwritten");
  auto s = a.stats();
  CHECK(s.live == live.size());
  std::uint64_t req = 0;
  for (const blk& b : live) req += b.n;
  CHECK(s.requested == req);
  CHECK(s.allocated >= req);
  CHECK(s.allocated % 256 == 0);
  CHECK(a.check() == "");
  for (const blk& b : live) a.deallocate(b.p, stream_tag(1));
  CHECK(a.stats().live == 0);
  CHECK(a.stats().deferred == s.allocated);  // fenced, not yet free
  CHECK(a.synchronize().ok());
  s = a.stats();
  CHECK(s.deferred == 0);
  CHECK(s.free == 4 * MiB);
  CHECK(s.largest_free == 4 * MiB);  // merged back into one block
  CHECK(a.check() == "");
}

TEST_CASE("stream order: a block freed on s1 goes to s1 at once, to s2 only after s1's fence") {
  auto api = std::make_shared<fake::api>();
  test_fd f;
  external_arena a = external_arena::import(api, f.fd, 3 * MiB, false);  // p, q, r fill it
  void* p = a.allocate(MiB, 0, stream_tag(1));
  void* q = a.allocate(MiB, 0, stream_tag(1));
  api->hold(stream_tag(1));  // s1's work up to the free has not run
  a.deallocate(p, stream_tag(1));
  // Another stream must not get p's memory while s1's fence is pending.
  void* r = a.allocate(MiB, 0, stream_tag(2));
  CHECK_FALSE(overlap(r, MiB, p, MiB));
  // Nothing left for s2 of that size: the rest is p (deferred on s1).
  CHECK(a.try_allocate(MiB, 0, stream_tag(2)) == nullptr);
  try {
    a.allocate(MiB, 0, stream_tag(2));
    FAIL("expected out_of_memory");
  } catch (const vmm::out_of_memory& e) {
    CHECK(std::string(e.what()).find("deferred") != std::string::npos);
  }
  // s1 itself may reuse it: stream order puts the new use behind the free.
  void* again = a.allocate(MiB / 2, 0, stream_tag(1));
  CHECK(again == p);
  CHECK(a.stats().reused_same_stream == 1);
  CHECK(a.stats().deferred == MiB / 2);  // the other half stays deferred on s1
  CHECK(a.check() == "");
  CHECK(a.try_allocate(MiB / 2, 0, stream_tag(2)) == nullptr);
  api->release(stream_tag(1));  // the fence completes
  void* late = a.allocate(MiB / 2, 0, stream_tag(2));
  CHECK(late == static_cast<char*>(p) + MiB / 2);
  CHECK(a.stats().deferred == 0);
  CHECK(a.check() == "");
  a.deallocate(q, stream_tag(1));
  a.deallocate(r, stream_tag(2));
  a.deallocate(again, stream_tag(1));
  a.deallocate(late, stream_tag(2));
  CHECK(a.synchronize().ok());
  CHECK(a.stats().largest_free == 3 * MiB);
}

TEST_CASE("bad input leaves the arena intact") {
  auto api = std::make_shared<fake::api>();
  test_fd f;
  external_arena a = external_arena::import(api, f.fd, 4 * MiB, false);
  void* p = a.allocate(4096);
  const auto before = a.stats();
  int local = 0;
  CHECK(kind_of_throw([&] { a.allocate(0); }) == errc::invalid_value);
  CHECK(kind_of_throw([&] { a.allocate(256, 3); }) == errc::invalid_value);
  CHECK(kind_of_throw([&] { a.allocate(256, 8 * MiB); }) == errc::invalid_value);
  CHECK(kind_of_throw([&] { a.allocate(8 * MiB); }) == errc::out_of_memory);
  CHECK(kind_of_throw([&] { a.allocate(UINT64_MAX); }) == errc::out_of_memory);
  CHECK(kind_of_throw([&] { a.deallocate(&local); }) == errc::invalid_pointer);
  CHECK(kind_of_throw([&] { a.deallocate(static_cast<char*>(p) + 256); }) == errc::invalid_pointer);
  CHECK(kind_of_throw([&] { a.deallocate(static_cast<char*>(a.base()) + MiB); }) == errc::invalid_pointer);  // free space
  CHECK(kind_of_throw([&] { a.offset_of(&local); }) == errc::invalid_pointer);
  CHECK(a.try_deallocate(nullptr).ok());
  auto after = a.stats();
  CHECK(after.live == before.live);
  CHECK(after.allocated == before.allocated);
  CHECK(after.frees == before.frees);
  CHECK(a.check() == "");
  a.deallocate(p);
  CHECK(kind_of_throw([&] { a.deallocate(p); }) == errc::invalid_pointer);  // double free
  CHECK(a.stats().frees == 1);
  CHECK(a.check() == "");
}

TEST_CASE("a failed fence record leaves the block live") {
  auto api = std::make_shared<fake::api>();
  test_fd f;
  external_arena a = external_arena::import(api, f.fd, 4 * MiB, false);
  void* p = a.allocate(4096, 0, stream_tag(1));
  api->fail_fence = true;
  CHECK(a.try_deallocate(p, stream_tag(1)).kind == errc::other);
  CHECK(a.owns(p));
  CHECK(a.stats().live == 1);
  CHECK(a.check() == "");
  api->fail_fence = false;
  CHECK(a.try_deallocate(p, stream_tag(1)).ok());
  CHECK_FALSE(a.owns(p));
}

TEST_CASE("random allocate/free on three streams keeps every invariant") {
  auto api = std::make_shared<fake::api>();
  test_fd f;
  external_arena a = external_arena::import(api, f.fd, 8 * MiB, false);
  std::mt19937_64 rng(42);
  struct blk {
    void* p;
    std::uint64_t n;
    vmm::stream_t s;
  };
  std::vector<blk> live;
  for (int i = 0; i < 3000; ++i) {
    const vmm::stream_t s = stream_tag(1 + rng() % 3);
    if (rng() % 8 == 0) {
      if (rng() % 2) api->hold(s);
      else api->release(s);
    }
    if (live.empty() || rng() % 2) {
      const std::uint64_t n = 1 + rng() % (rng() % 4 == 0 ? MiB : 8192);
      const std::uint64_t al = rng() % 5 == 0 ? (256ull << (rng() % 6)) : 0;
      void* p = a.try_allocate(n, al, s);
      if (p) {
        if (al) CHECK(reinterpret_cast<std::uintptr_t>(p) % al == 0);
        for (const blk& b : live) CHECK_FALSE(overlap(p, n, b.p, b.n));
        live.push_back({p, n, s});
      }
    } else {
      const std::size_t k = rng() % live.size();
      CHECK(a.try_deallocate(live[k].p, rng() % 2 ? live[k].s : s).ok());
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(k));
    }
    if (i % 50 == 0) REQUIRE(a.check() == "");
  }
  REQUIRE(a.check() == "");
  for (const blk& b : live) a.deallocate(b.p, b.s);
  for (int s = 1; s <= 3; ++s) api->release(stream_tag(s));
  CHECK(a.synchronize().ok());
  CHECK(a.stats().largest_free == 8 * MiB);
  CHECK(a.check() == "");
}

TEST_CASE("external_semaphore: validation, value rules, fd rule") {
  auto api = std::make_shared<fake::api>();
  test_fd f;
  const int before = fake::open_fds();
  external_semaphore e;
  CHECK(external_semaphore::try_import(nullptr, f.fd, semaphore_kind::binary, e).kind == errc::invalid_value);
  CHECK(external_semaphore::try_import(api, -1, semaphore_kind::binary, e).kind == errc::invalid_value);
  CHECK(external_semaphore::try_import(api, f.fd, static_cast<semaphore_kind>(7), e).kind == errc::invalid_value);
  api->fail_sem_import = true;
  CHECK(external_semaphore::try_import(api, f.fd, semaphore_kind::timeline, e).kind == errc::not_supported);
  CHECK(fake::open_fds() == before);  // the dup of the failed import was closed
  CHECK_FALSE(e.valid());
  CHECK(e.try_wait(0, stream_tag(1)).kind == errc::invalid_value);  // empty
  api->fail_sem_import = false;

  external_semaphore bin = external_semaphore::import(api, f.fd, semaphore_kind::binary);
  CHECK(bin.valid());
  CHECK(fake::fd_open(f.fd));
  CHECK(fake::open_fds() == before + 1);  // the importer's dup
  CHECK(kind_of_throw([&] { bin.signal(1, stream_tag(1)); }) == errc::invalid_value);  // binary takes 0
  CHECK(kind_of_throw([&] { bin.wait(2, stream_tag(1)); }) == errc::invalid_value);
  bin.signal(0, stream_tag(1));
  bin.wait(0, stream_tag(2));
  external_semaphore tl = external_semaphore::import(api, f.fd, semaphore_kind::timeline);
  tl.signal(7, stream_tag(1));
  tl.wait(7, stream_tag(2));
  CHECK(std::count(api->log.begin(), api->log.end(), "wait 7 on s2") == 1);
  external_semaphore moved = std::move(tl);
  CHECK_FALSE(tl.valid());
  CHECK(moved.valid());
  CHECK(bin.close().ok());
  CHECK(moved.close().ok());
  CHECK(api->live_semaphores == 0);
  CHECK(api->premature_close == 0);
  CHECK(fake::open_fds() == before);
}

TEST_CASE("release_after (arena): the block returns to other streams only once the semaphore reached the value") {
  auto api = std::make_shared<fake::api>();
  test_fd f;
  external_arena a = external_arena::import(api, f.fd, 2 * MiB, false);
  external_semaphore sem = external_semaphore::import(api, f.fd, semaphore_kind::timeline);
  void* vk_sem = api->last_semaphore();
  void* p = a.allocate(MiB, 0, stream_tag(1));  // used by Vulkan, say
  void* q = a.allocate(MiB, 0, stream_tag(2));
  api->log.clear();
  vmm::vk::release_after(sem, 5, a, p, stream_tag(1));
  // The wait is queued before the fence that guards the block.
  CHECK(api->log == std::vector<std::string>{"wait 5 on s1", "record_fence on s1"});
  a.deallocate(q, stream_tag(2));
  CHECK(a.synchronize().kind == errc::other);  // p's fence cannot complete: the fake refuses to block
  // s2 gets q's block back, never p's, while the semaphore is below 5.
  void* r = a.allocate(MiB, 0, stream_tag(2));
  CHECK(r == q);
  CHECK(a.try_allocate(MiB, 0, stream_tag(2)) == nullptr);
  fake::api::set_value(vk_sem, 4);
  CHECK(a.try_allocate(MiB, 0, stream_tag(2)) == nullptr);
  fake::api::set_value(vk_sem, 5);  // Vulkan signalled
  void* late = a.allocate(MiB, 0, stream_tag(2));
  CHECK(late == p);
  CHECK(a.check() == "");
  // Bad pointers queue nothing.
  api->log.clear();
  int local = 0;
  CHECK(kind_of_throw([&] { vmm::vk::release_after(sem, 6, a, &local, stream_tag(1)); }) == errc::invalid_pointer);
  CHECK(kind_of_throw([&] { vmm::vk::release_after(sem, 6, a, static_cast<char*>(late) + 256, stream_tag(1)); }) ==
        errc::invalid_pointer);
  CHECK(api->log.empty());
  CHECK(api->waits_on(stream_tag(1)) == 1);
}

TEST_CASE("release_after (vmm::allocator): wait queued on the stream, then the stream-ordered free") {
  auto api = std::make_shared<fake::api>();
  test_fd f;
  vmm::allocator alloc = vmm::allocator::host();
  external_semaphore sem = external_semaphore::import(api, f.fd, semaphore_kind::timeline);
  void* p = alloc.allocate(MiB, 0, stream_tag(1));
  api->log.clear();
  vmm::vk::release_after(sem, 3, alloc, p, stream_tag(1));
  CHECK(api->log == std::vector<std::string>{"wait 3 on s1"});
  CHECK(alloc.usable_size(p) == 0);  // freed
  CHECK(alloc.stats().frees == 1);
  // Foreign or freed pointers: nothing queued, the allocator untouched.
  api->log.clear();
  int local = 0;
  CHECK(kind_of_throw([&] { vmm::vk::release_after(sem, 4, alloc, &local, stream_tag(1)); }) == errc::invalid_pointer);
  CHECK(kind_of_throw([&] { vmm::vk::release_after(sem, 4, alloc, p, stream_tag(1)); }) == errc::invalid_pointer);
  CHECK(kind_of_throw([&] { vmm::vk::release_after(sem, 4, alloc, nullptr, stream_tag(1)); }) == errc::invalid_pointer);
  CHECK(api->log.empty());
  CHECK(alloc.stats().frees == 1);
  CHECK(alloc.check() == "");
  // A binary semaphore with a value is refused before anything is queued or freed.
  external_semaphore bin = external_semaphore::import(api, f.fd, semaphore_kind::binary);
  void* r = alloc.allocate(4096, 0, stream_tag(1));
  CHECK(kind_of_throw([&] { vmm::vk::release_after(bin, 1, alloc, r, stream_tag(1)); }) == errc::invalid_value);
  CHECK(alloc.usable_size(r) != 0);
  alloc.deallocate(r, stream_tag(1));
}
