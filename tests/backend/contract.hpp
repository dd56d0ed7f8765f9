// SPDX-License-Identifier: Apache-2.0
// The backend contract suite: every rule of the contract in include/vmmalloc/backend.hpp (R1-R10),
// checked through backend_iface, the way every layer above sees a backend. Each case names its
// rule. Optional parts are checked both ways: with the capability bit the part must work, without
// it the type-erased wrapper's answers (not_supported, fence 0, only the owner) must come back.
//
// A Traits type supplies:
//   static constexpr const char* name;
//   static std::unique_ptr<vmm::backend_iface> make();
//   static constexpr bool host_access;   // the CPU may touch mapped memory: page protection is
//                                        // checked too (CUDA: the CPU never maps device memory)
//   static void fill(vmm::backend_iface&, std::uintptr_t va, std::size_t n, std::uint64_t seed);
//   static bool verify(vmm::backend_iface&, std::uintptr_t va, std::size_t n, std::uint64_t seed);
//       write / check a pattern (host: the CPU; CUDA: kernels), synchronously
//   static std::optional<vmm::access_mode> access_of(vmm::backend_iface&, std::uintptr_t va, int device);
//       the access the driver reports for device at va (host: the simulated table; CUDA:
//       cuMemGetAccess); nullopt when the driver gives no answer
//   static vmm::stream_t stream(int i);  // a stream (host: a tag; CUDA: a real stream)
//   static void keep_busy(vmm::backend_iface&, vmm::stream_t, std::uintptr_t va, std::size_t n);
//       queues work on the stream that stays pending until finish() (host: hold_stream; CUDA: a
//       kernel writing [va, va + n) for a few hundred ms); used only with cap_async_fences
//   static void finish(vmm::backend_iface&, vmm::stream_t);  // host: complete_stream; CUDA: nothing
//   static int device_count();
//   static bool peer_truth(int device, int peer);  // the same question answered outside the backend
//   static std::optional<std::size_t> mem_slack(); // tolerance of mem_info comparisons; nullopt:
//                                                  // report them only (compute-sanitizer runs)
// Include after doctest.h; instantiate with VMM_CONTRACT_INVOKE(Traits, ...).
//
// Case names ending in "[refusals]" make the driver refuse on purpose. compute-sanitizer's memcheck
// reports every refused driver call as an API error, so tools/gpu-check leaves those cases out.
#pragma once

#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>

#include <fcntl.h>
#include <unistd.h>

#include "vmmalloc/backend.hpp"

namespace contract {

using vmm::access_mode;
using vmm::errc;

inline constexpr vmm::access_desc rw0{0, access_mode::read_write};

inline std::size_t round_up(std::size_t n, std::size_t g) { return (n + g - 1) / g * g; }

// The minimum granularity, checked for sense on the way (R2 rounds to it).
inline std::size_t granule(vmm::backend_iface& b, const vmm::chunk_props& p = {}) {
  auto r = b.granularity(p);
  REQUIRE(r.ok());
  REQUIRE(r.value.minimum > 0);
  CHECK(r.value.recommended >= r.value.minimum);
  CHECK(r.value.recommended % r.value.minimum == 0);
  return r.value.minimum;
}

// Owners that undo at scope exit, so a failed CHECK leaks nothing into the next case (on the GPU
// a leak would disturb the mem_info comparisons of later cases). Destroyed in reverse order:
// declare the reservation first, then chunks, then mappings.
struct reservation {
  vmm::backend_iface& b;
  std::size_t size;
  std::uintptr_t va = 0;
  reservation(vmm::backend_iface& be, std::size_t n) : b(be), size(n) {
    auto r = b.reserve(n, granule(b));  // aligned to the granularity: R2 holds the caller to it
    REQUIRE(r.ok());
    va = r.value;
  }
  ~reservation() {
    if (va) b.free_reservation(va, size);
  }
  vmm::status free() {
    vmm::status s = b.free_reservation(va, size);
    if (s.ok()) va = 0;
    return s;
  }
};

struct chunk {
  vmm::backend_iface& b;
  vmm::mem_handle h = 0;
  bool live = false;
  chunk(vmm::backend_iface& be, std::size_t n, const vmm::chunk_props& p = {}) : b(be) {
    auto r = b.create(n, p);
    REQUIRE(r.ok());
    h = r.value;
    live = true;
  }
  struct adopt {};  // takes a handle made elsewhere (import)
  chunk(vmm::backend_iface& be, adopt, vmm::mem_handle made) : b(be), h(made), live(true) {}
  ~chunk() {
    if (live) b.release(h);
  }
  vmm::status release() {
    vmm::status s = b.release(h);
    if (s.ok()) live = false;
    return s;
  }
};

struct mapping {
  vmm::backend_iface& b;
  std::uintptr_t va;
  std::size_t size;
  bool live = false;
  mapping(vmm::backend_iface& be, std::uintptr_t a, std::size_t n, vmm::mem_handle h) : b(be), va(a), size(n) {
    vmm::status s = b.map(va, size, h, 0);
    REQUIRE(s.ok());
    live = true;
  }
  ~mapping() {
    if (live) b.unmap(va, size);
  }
  vmm::status unmap() {
    vmm::status s = b.unmap(va, size);
    if (s.ok()) live = false;
    return s;
  }
  vmm::status grant(access_mode m = access_mode::read_write, int device = 0) {
    vmm::access_desc d{device, m};
    return b.set_access(va, size, {&d, 1});
  }
};

// Whether the CPU may read / write the byte at p, asked of the kernel instead of touching it: a
// pipe write from p (read() into p) fails with EFAULT where the page forbids it. Host only.
inline bool cpu_can_read(std::uintptr_t p) {
  int fd[2];
  REQUIRE(::pipe(fd) == 0);
  const bool ok = ::write(fd[1], reinterpret_cast<const void*>(p), 1) == 1;
  ::close(fd[0]);
  ::close(fd[1]);
  return ok;
}
inline bool cpu_can_write(std::uintptr_t p) {  // overwrites the byte with itself when it can
  int fd[2];
  REQUIRE(::pipe(fd) == 0);
  unsigned char c = 0;
  if (cpu_can_read(p)) std::memcpy(&c, reinterpret_cast<const void*>(p), 1);
  REQUIRE(::write(fd[1], &c, 1) == 1);
  const bool ok = ::read(fd[0], reinterpret_cast<void*>(p), 1) == 1;
  ::close(fd[0]);
  ::close(fd[1]);
  return ok;
}

inline bool fd_open(int fd) { return fd >= 0 && ::fcntl(fd, F_GETFD) != -1; }

// "free now is at least `before` less the tolerance", or only reported where mem_info comparisons
// are off.
template <class T>
void check_free_at_least(vmm::backend_iface& b, std::size_t before, const char* what) {
  auto m = b.mem_info();
  REQUIRE(m.ok());
  const auto slack = T::mem_slack();
  if (!slack) {
    MESSAGE(std::string(T::name) << ": " << what << ": free " << m.value.free << " (was " << before << "), not compared");
    return;
  }
  INFO(what << ": free " << m.value.free << ", was " << before << ", slack " << *slack);
  CHECK(m.value.free + *slack >= before);
}

}  // namespace contract

// ---- R1: status, never exceptions; a failure leaves nothing half-done ----------------------------

TEST_CASE_TEMPLATE_DEFINE("contract R1: a failed create holds no memory [refusals]", T, contract_r1_create) {
  using namespace contract;
  auto b = T::make();
  const std::size_t g = granule(*b);
  auto before = b->mem_info();
  REQUIRE(before.ok());
  REQUIRE(before.value.total > 0);
  const std::size_t huge = round_up(before.value.total * 2, g);  // twice the device
  vmm::result<vmm::mem_handle> r;
  CHECK_NOTHROW(r = b->create(huge, {}));
  CHECK(r.st.kind == errc::out_of_memory);
  CHECK(r.value == 0);
  CHECK(std::strlen(r.st.op) > 0);  // names the refused operation
  check_free_at_least<T>(*b, before.value.free, "after a refused create");
  chunk c(*b, g);  // nothing was left claimed: an ordinary create still works
}

TEST_CASE_TEMPLATE_DEFINE("contract R1: a failed map maps nothing and leaves the range free [refusals]", T,
                          contract_r1_map) {
  using namespace contract;
  auto b = T::make();
  const std::size_t g = granule(*b);
  reservation r(*b, 3 * g);
  chunk one(*b, g), two(*b, 2 * g), three(*b, g);
  mapping m(*b, r.va + g, g, one.h);
  REQUIRE(m.grant().ok());
  T::fill(*b, r.va + g, g, 1);
  vmm::status s;
  CHECK_NOTHROW(s = b->map(r.va, 2 * g, two.h, 0));  // would overlap [va + g, va + 2g)
  CHECK(s.kind == errc::invalid_value);
  // The refused map left [va, va + g) unmapped (a new map fits there) and the old mapping whole.
  mapping fresh(*b, r.va, g, three.h);
  CHECK(T::verify(*b, r.va + g, g, 1));
  // ... and the refused handle is untouched: it maps elsewhere.
  reservation r2(*b, 2 * g);
  mapping again(*b, r2.va, 2 * g, two.h);
}

// ---- R2: granularity ------------------------------------------------------------------------------

TEST_CASE_TEMPLATE_DEFINE("contract R2: sizes, offsets and addresses off the granularity are refused [refusals]",
                          T, contract_r2) {
  using namespace contract;
  auto b = T::make();
  const std::size_t g = granule(*b);
  REQUIRE(g % 2 == 0);
  const std::size_t half = g / 2;
  CHECK(b->create(half, {}).st.kind == errc::invalid_value);
  CHECK(b->create(g + half, {}).st.kind == errc::invalid_value);
  reservation r(*b, 2 * g);
  chunk c(*b, g);
  // The driver refuses a size or offset off the granularity with CUDA_ERROR_NOT_SUPPORTED (seen on
  // an H200, driver 580): refused is the rule, the kind may be either.
  auto refused = [](vmm::status st) { return st.kind == errc::invalid_value || st.kind == errc::not_supported; };
  CHECK(b->map(r.va + half, g, c.h, 0).kind == errc::invalid_value);  // address
  CHECK(refused(b->map(r.va, half, c.h, 0)));                         // size
  CHECK(refused(b->map(r.va, g, c.h, half)));                         // offset
  mapping m(*b, r.va, g, c.h);                                        // the rounded call works
  CHECK(b->set_access(r.va, half, {&rw0, 1}).kind == errc::invalid_value);
  CHECK(b->set_access(r.va + half, half, {&rw0, 1}).kind == errc::invalid_value);
  CHECK(m.grant().ok());
  T::fill(*b, r.va, g, 2);
  CHECK(T::verify(*b, r.va, g, 2));
  // A handle maps from its start only: pages of a larger handle cannot be mapped a second time at
  // an offset on the granularity (CUDA_ERROR_NOT_SUPPORTED on an H200, driver 580.159.04), so a
  // chunk's free pages are reusable elsewhere only with the whole handle.
  chunk two(*b, 2 * g);
  reservation r2(*b, 2 * g);
  CHECK(b->map(r2.va, g, two.h, g).kind == errc::not_supported);
  CHECK(b->map(r2.va + g, g, two.h, g).kind == errc::not_supported);
}

// ---- R3: unmap exactly what one map mapped -------------------------------------------------------

TEST_CASE_TEMPLATE_DEFINE("contract R3: unmap of part of a mapping is refused and the mapping stays usable [refusals]",
                          T, contract_r3) {
  using namespace contract;
  auto b = T::make();
  const std::size_t g = granule(*b);
  reservation r(*b, 3 * g);
  chunk c(*b, 2 * g);
  mapping m(*b, r.va, 2 * g, c.h);
  REQUIRE(m.grant().ok());
  T::fill(*b, r.va, 2 * g, 3);
  CHECK(b->unmap(r.va, g).kind == errc::invalid_value);          // first half
  CHECK(b->unmap(r.va + g, g).kind == errc::invalid_value);      // second half
  // A reserved range never mapped: the host backend refuses it, the CUDA driver accepts it as a
  // no-op (seen on an H200, driver 580). Either way the mapping beside it is untouched.
  const vmm::status never = b->unmap(r.va + 2 * g, g);
  CHECK((never.ok() || never.kind == errc::invalid_value));
  CHECK(T::verify(*b, r.va, 2 * g, 3));                          // still mapped, still accessible
  T::fill(*b, r.va + g, g, 4);
  CHECK(T::verify(*b, r.va + g, g, 4));
  CHECK(m.unmap().ok());
  mapping again(*b, r.va, 2 * g, c.h);  // the whole range went back to the reservation
}

// ---- R4: no access until set_access --------------------------------------------------------------

TEST_CASE_TEMPLATE_DEFINE("contract R4: a new mapping has no access until set_access grants it", T, contract_r4) {
  using namespace contract;
  auto b = T::make();
  CHECK(((b->capabilities() & vmm::cap_host_access) != 0) == T::host_access);
  const std::size_t g = granule(*b);
  reservation r(*b, g);
  chunk c(*b, g);
  auto expect_none = [&](const char* when) {
    INFO(when);
    if (auto a = T::access_of(*b, r.va, 0))
      CHECK(*a == access_mode::none);
    else
      MESSAGE(std::string(T::name) << ": the driver reports no access state " << when << " (checked after set_access only)");
    if constexpr (T::host_access) CHECK_FALSE(cpu_can_read(r.va));
  };
  {
    mapping m(*b, r.va, g, c.h);
    expect_none("for a new mapping");
    if constexpr (!T::host_access)
      MESSAGE(std::string(T::name) << ": the CPU never maps this memory; page protection is not checked, only the driver's answer");
    REQUIRE(m.grant(access_mode::read_write).ok());
    auto a = T::access_of(*b, r.va, 0);
    REQUIRE(a.has_value());
    CHECK(*a == access_mode::read_write);
    if constexpr (T::host_access) {
      CHECK(cpu_can_read(r.va));
      CHECK(cpu_can_write(r.va));
    }
    T::fill(*b, r.va, g, 5);
    CHECK(T::verify(*b, r.va, g, 5));
    REQUIRE(m.grant(access_mode::read).ok());
    a = T::access_of(*b, r.va, 0);
    REQUIRE(a.has_value());
    CHECK(*a == access_mode::read);
    if constexpr (T::host_access) {
      CHECK(cpu_can_read(r.va));
      CHECK_FALSE(cpu_can_write(r.va));
    }
    CHECK(T::verify(*b, r.va, g, 5));
    CHECK(m.unmap().ok());
  }
  mapping again(*b, r.va, g, c.h);  // access belongs to the mapping, not the memory
  expect_none("for the same memory mapped again");
}

// ---- R5: release while mapped; several mappings of one handle ------------------------------------

TEST_CASE_TEMPLATE_DEFINE("contract R5: release while mapped keeps the bytes until unmap", T, contract_r5_release) {
  using namespace contract;
  auto b = T::make();
  const std::size_t g = granule(*b), n = 16 * g;
  auto before = b->mem_info();
  REQUIRE(before.ok());
  {
    reservation r(*b, n);
    chunk c(*b, n);
    auto held = b->mem_info();
    REQUIRE(held.ok());
    if (auto slack = T::mem_slack())  // the chunk is really taken from the device
      CHECK(held.value.free + n <= before.value.free + *slack);
    mapping m(*b, r.va, n, c.h);
    REQUIRE(m.grant().ok());
    T::fill(*b, r.va, n, 6);
    REQUIRE(c.release().ok());
    CHECK(T::verify(*b, r.va, n, 6));  // the mapping keeps the memory
    T::fill(*b, r.va + g, g, 7);  // and still writable
    CHECK(T::verify(*b, r.va + g, g, 7));
    CHECK(T::verify(*b, r.va, g, 6));  // (patterns run from where they start: a prefix verifies)
    CHECK(m.unmap().ok());
  }
  check_free_at_least<T>(*b, before.value.free, "after release and unmap");  // now it came back
}

TEST_CASE_TEMPLATE_DEFINE("contract R5: one handle mapped at two places shows the same bytes", T, contract_r5_alias) {
  using namespace contract;
  auto b = T::make();
  const std::size_t g = granule(*b);
  reservation r(*b, 2 * g);
  chunk c(*b, g);
  mapping a(*b, r.va, g, c.h), z(*b, r.va + g, g, c.h);
  REQUIRE(a.grant().ok());
  REQUIRE(z.grant().ok());
  T::fill(*b, r.va, g, 8);
  CHECK(T::verify(*b, r.va + g, g, 8));
  T::fill(*b, r.va + g, g, 9);
  CHECK(T::verify(*b, r.va, g, 9));
  REQUIRE(c.release().ok());
  CHECK(a.unmap().ok());
  CHECK(T::verify(*b, r.va + g, g, 9));  // the last mapping still holds the memory
}

// ---- R6: reservations ------------------------------------------------------------------------------

TEST_CASE_TEMPLATE_DEFINE("contract R6: a reservation is freed whole; unknown or partial ranges are refused [refusals]",
                          T, contract_r6) {
  using namespace contract;
  auto b = T::make();
  const std::size_t g = granule(*b);
  // Address g (2 MiB on every backend here) is never handed out by a reservation: the host's
  // mmap and the GPU's address space both start far above it.
  CHECK(b->free_reservation(g, g).kind == errc::invalid_value);
  reservation r(*b, 4 * g);
  CHECK(b->free_reservation(r.va, 2 * g).kind == errc::invalid_value);      // head
  CHECK(b->free_reservation(r.va + g, 3 * g).kind == errc::invalid_value);  // tail
  {
    chunk c(*b, g);  // the reservation is whole: its last granule still maps
    mapping m(*b, r.va + 3 * g, g, c.h);
    REQUIRE(m.grant().ok());
    T::fill(*b, r.va + 3 * g, g, 10);
    CHECK(T::verify(*b, r.va + 3 * g, g, 10));
  }
  const std::uintptr_t va = r.va;
  CHECK(r.free().ok());
  CHECK(b->free_reservation(va, 4 * g).kind == errc::invalid_value);  // twice
}

// ---- R7: ipc ---------------------------------------------------------------------------------------

namespace contract {

// Export, import, map both, and check the two views alias. Returns false when the driver refused
// to create a chunk of this kind (fabric without an IMEX channel), after checking how it refused.
template <class T>
bool ipc_round_trip(vmm::backend_iface& b, vmm::ipc_kind kind) {
  vmm::chunk_props p;
  p.ipc = kind;
  const std::size_t g = granule(b, p);
  auto made = b.create(g, p);
  if (!made.ok() && kind == vmm::ipc_kind::fabric) {
    CHECK((made.st.kind == errc::not_permitted || made.st.kind == errc::not_supported));
    MESSAGE(std::string(T::name) << ": a fabric chunk is refused here (" << made.st.message()
                    << "): the round trip is not checked");
    return false;
  }
  REQUIRE(made.ok());
  reservation r(b, 2 * g);
  chunk c(b, chunk::adopt{}, made.value);
  mapping m(b, r.va, g, c.h);
  REQUIRE(m.grant().ok());
  T::fill(b, r.va, g, 11);
  auto ex = b.export_handle(c.h, kind);
  REQUIRE(ex.ok());
  CHECK(ex.value.kind != vmm::ipc_kind::none);
  if (kind == vmm::ipc_kind::posix_fd) CHECK(ex.value.kind == vmm::ipc_kind::posix_fd);
  const bool has_fd = ex.value.kind == vmm::ipc_kind::posix_fd;
  if (has_fd) CHECK(fd_open(ex.value.fd));
  auto im = b.import_handle(ex.value);
  REQUIRE(im.ok());
  if (has_fd) CHECK(fd_open(ex.value.fd));  // import did not take the caller's fd
  {
    chunk ic(b, chunk::adopt{}, im.value);
    mapping mi(b, r.va + g, g, ic.h);
    REQUIRE(mi.grant().ok());
    CHECK(T::verify(b, r.va + g, g, 11));  // the imported handle is the same memory
    T::fill(b, r.va + g, g, 12);
    CHECK(T::verify(b, r.va, g, 12));
    // Each handle is its caller's own: releasing the original leaves the import working.
    REQUIRE(c.release().ok());
    CHECK(m.unmap().ok());
    CHECK(T::verify(b, r.va + g, g, 12));
  }
  if (has_fd) CHECK(::close(ex.value.fd) == 0);  // still the caller's to close
  return true;
}

}  // namespace contract

TEST_CASE_TEMPLATE_DEFINE("contract R7: a posix fd export imports as the same memory; the fd stays the caller's", T,
                          contract_r7_posix) {
  using namespace contract;
  auto b = T::make();
  const unsigned caps = b->capabilities();
  if (caps & vmm::cap_export_posix_fd) {
    CHECK(ipc_round_trip<T>(*b, vmm::ipc_kind::posix_fd));
    return;
  }
  const std::size_t g = granule(*b);
  chunk c(*b, g);
  if (caps & vmm::cap_ipc) {
    MESSAGE(std::string(T::name) << ": no posix fd export here (fabric only)");
    return;
  }
  // The part is absent: the wrapper answers not_supported, and the caller's fd is untouched.
  CHECK(b->export_handle(c.h, vmm::ipc_kind::posix_fd).st.kind == errc::not_supported);
  int p[2];
  REQUIRE(::pipe(p) == 0);
  vmm::shareable_handle sh;
  sh.kind = vmm::ipc_kind::posix_fd;
  sh.fd = p[0];
  CHECK(b->import_handle(sh).st.kind == errc::not_supported);
  CHECK(fd_open(p[0]));
  ::close(p[0]);
  ::close(p[1]);
}

TEST_CASE_TEMPLATE_DEFINE("contract R7: a fabric export imports as the same memory where the driver grants it [refusals]",
                          T, contract_r7_fabric) {
  using namespace contract;
  auto b = T::make();
  const unsigned caps = b->capabilities();
  if (caps & vmm::cap_export_fabric) {
    ipc_round_trip<T>(*b, vmm::ipc_kind::fabric);
    return;
  }
  if (caps & vmm::cap_ipc) {
    MESSAGE(std::string(T::name) << ": no fabric export here (posix fd only)");
    return;
  }
  const std::size_t g = granule(*b);
  chunk c(*b, g);
  CHECK(b->export_handle(c.h, vmm::ipc_kind::fabric).st.kind == errc::not_supported);
  vmm::shareable_handle sh;
  sh.kind = vmm::ipc_kind::fabric;
  CHECK(b->import_handle(sh).st.kind == errc::not_supported);
}

TEST_CASE_TEMPLATE_DEFINE("contract R7: exporting as no kind, or importing what is no handle, is refused [refusals]",
                          T, contract_r7_refused) {
  using namespace contract;
  auto b = T::make();
  const unsigned caps = b->capabilities();
  const std::size_t g = granule(*b);
  chunk c(*b, g);
  if (!(caps & vmm::cap_ipc)) {
    CHECK(b->export_handle(c.h, vmm::ipc_kind::none).st.kind == errc::not_supported);
    CHECK(b->import_handle({}).st.kind == errc::not_supported);
    return;
  }
  CHECK(b->export_handle(c.h, vmm::ipc_kind::none).st.kind == errc::invalid_value);
  CHECK(b->import_handle({}).st.kind == errc::invalid_value);  // kind none, no fd
  if (caps & vmm::cap_export_posix_fd) {
    int p[2];
    REQUIRE(::pipe(p) == 0);  // an fd, but not memory
    vmm::shareable_handle sh;
    sh.kind = vmm::ipc_kind::posix_fd;
    sh.fd = p[0];
    auto im = b->import_handle(sh);
    CHECK_FALSE(im.ok());
    if (im.ok()) b->release(im.value);
    CHECK(fd_open(p[0]));  // refused or not, the fd stays the caller's
    ::close(p[0]);
    ::close(p[1]);
  }
}

// ---- R8: fences ------------------------------------------------------------------------------------

TEST_CASE_TEMPLATE_DEFINE("contract R8: fence 0 is always done and waiting on it returns at once", T, contract_r8_zero) {
  auto b = T::make();
  CHECK(b->fence_done(0));
  CHECK(b->wait_fence(0).ok());
  b->drop_fence(0);
  CHECK(b->fence_done(0));
}

TEST_CASE_TEMPLATE_DEFINE("contract R8: a fence captures its stream's work so far", T, contract_r8) {
  using namespace contract;
  auto b = T::make();
  const vmm::stream_t s = T::stream(1), other = T::stream(2);
  if (!(b->capabilities() & vmm::cap_async_fences)) {
    // Synchronous: the work is done when the call returns, so there is nothing to wait for.
    auto f = b->record_fence(s);
    CHECK(f.ok());
    CHECK(f.value == 0);
    CHECK(b->fence_done(f.value));
    CHECK(b->wait_fence(f.value).ok());
    return;
  }
  const std::size_t g = granule(*b);
  reservation r(*b, g);
  chunk c(*b, g);
  mapping m(*b, r.va, g, c.h);
  REQUIRE(m.grant().ok());
  auto idle = b->record_fence(s);  // nothing queued: done once waited for
  REQUIRE(idle.ok());
  CHECK(b->wait_fence(idle.value).ok());
  CHECK(b->fence_done(idle.value));
  b->drop_fence(idle.value);

  T::keep_busy(*b, s, r.va, g);
  auto f = b->record_fence(s);
  REQUIRE(f.ok());
  CHECK(f.value != 0);
  CHECK_FALSE(b->fence_done(f.value));
  CHECK_FALSE(b->fence_done(f.value));  // a query changes nothing
  auto o = b->record_fence(other);      // another stream is not held up by s
  REQUIRE(o.ok());
  CHECK(b->wait_fence(o.value).ok());
  CHECK(b->fence_done(o.value));
  CHECK_FALSE(b->fence_done(f.value));
  T::finish(*b, s);
  CHECK(b->wait_fence(f.value).ok());
  CHECK(b->fence_done(f.value));
  b->drop_fence(f.value);
  b->drop_fence(o.value);
}

// ---- R9: peers -------------------------------------------------------------------------------------

TEST_CASE_TEMPLATE_DEFINE("contract R9: peer access follows the capability [refusals]", T, contract_r9) {
  using namespace contract;
  auto b = T::make();
  CHECK(b->can_access_peer(0, 0));  // the owner
  if (!(b->capabilities() & vmm::cap_peer_access)) {
    CHECK_FALSE(b->can_access_peer(0, 1));  // only the owner exists
    return;
  }
  const int n = T::device_count();
  REQUIRE(n >= 2);  // peers need a second device
  CHECK_FALSE(b->can_access_peer(0, n));  // no such device
  const std::size_t g = granule(*b);
  int reachable = 0;
  for (int p = 1; p < n; ++p) {
    CAPTURE(p);
    const bool can = b->can_access_peer(0, p);
    CHECK(can == T::peer_truth(0, p));
    if (!can) continue;
    ++reachable;
    reservation r(*b, g);
    chunk c(*b, g);
    mapping m(*b, r.va, g, c.h);
    const vmm::access_desc both[2] = {rw0, {p, access_mode::read_write}};
    REQUIRE(b->set_access(r.va, g, both).ok());
    auto a = T::access_of(*b, r.va, p);
    REQUIRE(a.has_value());
    CHECK(*a == access_mode::read_write);
  }
  MESSAGE(std::string(T::name) << ": " << reachable << " of " << n - 1 << " peers reachable from device 0");
}

// ---- R10: compression -------------------------------------------------------------------------------

TEST_CASE_TEMPLATE_DEFINE("contract R10: query reads back what the driver granted", T, contract_r10) {
  using namespace contract;
  auto b = T::make();
  const std::size_t g = granule(*b);
  chunk plain(*b, g);
  auto q = b->query(plain.h);
  if (!(b->capabilities() & vmm::cap_compression)) {
    // Without the part: not_supported, or an honest "not compressed" from a backend that can tell.
    CHECK((q.st.kind == errc::not_supported || (q.ok() && !q.value.compressible)));
    return;
  }
  REQUIRE(q.ok());
  CHECK_FALSE(q.value.compressible);  // nobody asked for it
  vmm::chunk_props p;
  p.compressible = true;
  const std::size_t gc = granule(*b, p);
  chunk c(*b, gc, p);
  auto qc = b->query(c.h);
  REQUIRE(qc.ok());
  MESSAGE(std::string(T::name) << ": compression asked for, " << (qc.value.compressible ? "granted" : "not granted"));
  reservation r(*b, gc);  // granted or not, the memory holds its bytes
  mapping m(*b, r.va, gc, c.h);
  REQUIRE(m.grant().ok());
  T::fill(*b, r.va, gc, 13);
  CHECK(T::verify(*b, r.va, gc, 13));
}

// Instantiates every case above for the Traits types given.
#define VMM_CONTRACT_INVOKE(...)                                  \
  TEST_CASE_TEMPLATE_INVOKE(contract_r1_create, __VA_ARGS__);     \
  TEST_CASE_TEMPLATE_INVOKE(contract_r1_map, __VA_ARGS__);        \
  TEST_CASE_TEMPLATE_INVOKE(contract_r2, __VA_ARGS__);            \
  TEST_CASE_TEMPLATE_INVOKE(contract_r3, __VA_ARGS__);            \
  TEST_CASE_TEMPLATE_INVOKE(contract_r4, __VA_ARGS__);            \
  TEST_CASE_TEMPLATE_INVOKE(contract_r5_release, __VA_ARGS__);    \
  TEST_CASE_TEMPLATE_INVOKE(contract_r5_alias, __VA_ARGS__);      \
  TEST_CASE_TEMPLATE_INVOKE(contract_r6, __VA_ARGS__);            \
  TEST_CASE_TEMPLATE_INVOKE(contract_r7_posix, __VA_ARGS__);      \
  TEST_CASE_TEMPLATE_INVOKE(contract_r7_fabric, __VA_ARGS__);     \
  TEST_CASE_TEMPLATE_INVOKE(contract_r7_refused, __VA_ARGS__);    \
  TEST_CASE_TEMPLATE_INVOKE(contract_r8_zero, __VA_ARGS__);       \
  TEST_CASE_TEMPLATE_INVOKE(contract_r8, __VA_ARGS__);            \
  TEST_CASE_TEMPLATE_INVOKE(contract_r9, __VA_ARGS__);            \
  TEST_CASE_TEMPLATE_INVOKE(contract_r10, __VA_ARGS__)
