// SPDX-License-Identifier: Apache-2.0
// The backend contract (contract.hpp) on the backends a machine without a GPU has: the host
// backend, the fault-injecting decorator over it with nothing armed (a decorator must not change
// the contract), and a backend with only the core, wrapped by make_backend (the wrapper must answer
// for the optional parts it lacks).
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "backend/contract.hpp"
#include "support/fault_backend.hpp"
#include "support/host_alloc.hpp"
#include "support/pattern.hpp"
#include "vmmalloc/host_backend.hpp"

namespace {

// The "[refusals]" cases break the driver's contract on purpose: the host backend reports each
// violation here instead of aborting, and refuses the call as the cases expect.
std::shared_ptr<vmm::test::violation_log> violations = std::make_shared<vmm::test::violation_log>();
vmm::host_backend_options contract_options() { return vmm::test::recording(violations); }

// Only the core: the optional parts are missing from the type. It claims every capability bit, so
// the cases also show that backend_model masks bits a type cannot honour.
struct core_only_backend {
  vmm::host_backend host{contract_options()};
  const char* name() { return "core-only"; }
  unsigned capabilities() { return ~0u; }
  vmm::result<vmm::granularity_info> granularity(const vmm::chunk_props& p) { return host.granularity(p); }
  vmm::result<std::uintptr_t> reserve(std::size_t n, std::size_t a) { return host.reserve(n, a); }
  vmm::status free_reservation(std::uintptr_t va, std::size_t n) { return host.free_reservation(va, n); }
  vmm::result<vmm::mem_handle> create(std::size_t n, const vmm::chunk_props& p) { return host.create(n, p); }
  vmm::status release(vmm::mem_handle h) { return host.release(h); }
  vmm::status map(std::uintptr_t va, std::size_t n, vmm::mem_handle h, std::size_t off) { return host.map(va, n, h, off); }
  vmm::status unmap(std::uintptr_t va, std::size_t n) { return host.unmap(va, n); }
  vmm::status set_access(std::uintptr_t va, std::size_t n, std::span<const vmm::access_desc> a) {
    return host.set_access(va, n, a);
  }
  vmm::result<vmm::memory_info> mem_info() { return host.mem_info(); }
};
static_assert(vmm::backend_core<core_only_backend>);
static_assert(!vmm::backend_ipc<core_only_backend> && !vmm::backend_fences<core_only_backend> &&
              !vmm::backend_peers<core_only_backend> && !vmm::backend_compression<core_only_backend>);

// The host backend under any of the three wrappings (its test controls live there).
vmm::host_backend* host_of(vmm::backend_iface& b) {
  if (auto* h = vmm::backend_cast<vmm::host_backend>(b)) return h;
  if (auto* c = vmm::backend_cast<core_only_backend>(b)) return &c->host;
  if (auto* f = dynamic_cast<vmm::forwarding_backend*>(&b)) return host_of(f->inner());
  return nullptr;
}

// What every host wrapping shares: the CPU reads the memory, fences are held by the test.
struct host_common {
  static constexpr bool host_access = true;
  static void fill(vmm::backend_iface&, std::uintptr_t va, std::size_t n, std::uint64_t seed) {
    auto* p = reinterpret_cast<std::uint64_t*>(va);
    for (std::size_t w = 0; w < n / 8; ++w) p[w] = vmm::test::pattern_word(seed, w);
  }
  static bool verify(vmm::backend_iface&, std::uintptr_t va, std::size_t n, std::uint64_t seed) {
    auto* p = reinterpret_cast<const std::uint64_t*>(va);
    for (std::size_t w = 0; w < n / 8; ++w)
      if (p[w] != vmm::test::pattern_word(seed, w)) return false;
    return true;
  }
  static std::optional<vmm::access_mode> access_of(vmm::backend_iface& b, std::uintptr_t va, int device) {
    auto* h = host_of(b);
    REQUIRE(h != nullptr);
    return h->access_of(va, device);
  }
  static vmm::stream_t stream(int i) { return reinterpret_cast<vmm::stream_t>(std::uintptr_t(0x2000 + i)); }
  static void keep_busy(vmm::backend_iface& b, vmm::stream_t s, std::uintptr_t, std::size_t) {
    auto* h = host_of(b);
    REQUIRE(h != nullptr);
    h->hold_stream(s);
  }
  static void finish(vmm::backend_iface& b, vmm::stream_t s) {
    auto* h = host_of(b);
    REQUIRE(h != nullptr);
    h->complete_stream(s);
  }
  static int device_count() { return vmm::host_backend_options{}.device_count; }
  static bool peer_truth(int d, int p) { return d >= 0 && p >= 0 && d < device_count() && p < device_count(); }
  static std::optional<std::size_t> mem_slack() { return 0; }  // simulated memory: exact
};

struct host_traits : host_common {
  static constexpr const char* name = "host";
  static std::unique_ptr<vmm::backend_iface> make() { return vmm::make_backend<vmm::host_backend>(contract_options()); }
};

// Simulated fabric export on, so the fabric round trip runs somewhere without an IMEX channel.
struct fault_traits : host_common {
  static constexpr const char* name = "fault(host)";
  static std::unique_ptr<vmm::backend_iface> make() {
    vmm::host_backend_options o = contract_options();
    o.fabric_supported = true;
    return vmm::test::make_fault_host(std::make_shared<vmm::test::fault_state>(), o);
  }
};

struct core_only_traits : host_common {
  static constexpr const char* name = "core-only";
  static std::unique_ptr<vmm::backend_iface> make() { return vmm::make_backend<core_only_backend>(); }
};

}  // namespace

TYPE_TO_STRING(host_traits);
TYPE_TO_STRING(fault_traits);
TYPE_TO_STRING(core_only_traits);

VMM_CONTRACT_INVOKE(host_traits, fault_traits, core_only_traits);

// The generic cases take the "part absent" branches for core-only because the capability bits say
// so; this one checks the bits and the wrapper's answers directly.
TEST_CASE("contract R7-R10: a backend with only the core answers for the parts it lacks") {
  auto b = vmm::make_backend<core_only_backend>();
  auto* raw = vmm::backend_cast<core_only_backend>(*b);
  REQUIRE(raw != nullptr);
  CHECK(raw->capabilities() == ~0u);                // it claims everything,
  CHECK(b->capabilities() == vmm::cap_host_access);  // the wrapper reports only what it has
  auto h = b->create(std::size_t{2} << 20, {});
  REQUIRE(h.ok());
  // R7
  CHECK(b->export_handle(h.value, vmm::ipc_kind::posix_fd).st.kind == vmm::errc::not_supported);
  CHECK(b->export_handle(h.value, vmm::ipc_kind::fabric).st.kind == vmm::errc::not_supported);
  CHECK(b->import_handle({}).st.kind == vmm::errc::not_supported);
  // R8: synchronous, so every fence is done, whatever its id
  auto f = b->record_fence(host_common::stream(1));
  CHECK(f.ok());
  CHECK(f.value == 0);
  CHECK(b->fence_done(12345));
  CHECK(b->wait_fence(12345).ok());
  b->drop_fence(12345);
  // R9: only the owner
  CHECK(b->can_access_peer(0, 0));
  CHECK(b->can_access_peer(1, 1));
  CHECK_FALSE(b->can_access_peer(0, 1));
  // R10
  CHECK(b->query(h.value).st.kind == vmm::errc::not_supported);
  CHECK(b->release(h.value).ok());
  CHECK(raw->host.live_handles() == 0);
}

// The host backend's own bookkeeping after a full round of the core, through every wrapping: a
// wrapper that dropped or doubled a call would leave a count behind.
TEST_CASE_TEMPLATE("contract R1-R6: a round of the core leaves the host backend with nothing live", T, host_traits,
                   fault_traits, core_only_traits) {
  auto b = T::make();
  auto* h = host_of(*b);
  REQUIRE(h != nullptr);
  const std::size_t g = contract::granule(*b);
  {
    contract::reservation r(*b, 2 * g);
    contract::chunk c(*b, g);
    contract::mapping m1(*b, r.va, g, c.h), m2(*b, r.va + g, g, c.h);
    CHECK(h->live_reservations() == 1);
    CHECK(h->live_handles() == 1);
    CHECK(h->live_mappings() == 2);
    CHECK(c.release().ok());
    CHECK(h->live_handles() == 0);
    CHECK(m1.unmap().ok());
    CHECK(h->live_mappings() == 1);
  }
  CHECK(h->live_handles() == 0);
  CHECK(h->live_mappings() == 0);
  CHECK(h->live_reservations() == 0);
}

TEST_CASE("host backend: a held stream's kernels run at complete_stream, in order, before its fences complete") {
  vmm::host_backend_options o;
  o.waits_block = true;
  vmm::host_backend h(o);
  const auto s = reinterpret_cast<vmm::stream_t>(std::uintptr_t{0x3000});
  std::vector<int> ran;
  h.launch(s, [&] { ran.push_back(0); });  // not held: runs now
  CHECK(ran == std::vector<int>{0});
  h.hold_stream(s);
  auto f = h.record_fence(s);
  REQUIRE(f.ok());
  h.launch(s, [&] {
    ran.push_back(1);
    h.launch(s, [&] { ran.push_back(3); });  // launched while the stream completes: runs too
  });
  h.launch(s, [&] { ran.push_back(2); });
  CHECK(ran == std::vector<int>{0});
  CHECK_FALSE(h.fence_done(f.value));
  std::atomic<bool> waited{false}, wait_ok{false};
  std::thread w([&] {
    wait_ok = h.wait_fence(f.value).ok();  // blocks until the stream completes (waits_block)
    waited = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  CHECK_FALSE(waited.load());
  h.complete_stream(s);
  w.join();
  CHECK(wait_ok.load());
  CHECK(ran == std::vector<int>{0, 1, 2, 3});
  CHECK(h.fence_done(f.value));
  h.drop_fence(f.value);
}

TEST_CASE("host backend: without waits_block a wait on a held stream fails at once (EPERM)") {
  vmm::host_backend h;
  const auto s = reinterpret_cast<vmm::stream_t>(std::uintptr_t{0x3001});
  h.hold_stream(s);
  auto f = h.record_fence(s);
  REQUIRE(f.ok());
  CHECK_FALSE(h.wait_fence(f.value).ok());
  h.complete_stream(s);
  CHECK(h.wait_fence(f.value).ok());
  h.drop_fence(f.value);
}
