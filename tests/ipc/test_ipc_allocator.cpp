// SPDX-License-Identifier: Apache-2.0
// IPC through vmm::allocator::export_ipc on the host backend: what the handle holds, byte
// identity, bad pointers, the security property (the importer maps the exported allocation's own
// chunks and nothing else), and the exporter freeing while an importer maps.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <tuple>

#include "frontend/allocator_access.hpp"
#include "ipc_test_util.hpp"
#include "vmmalloc/host_backend.hpp"
#include "vmmalloc/ipc.hpp"
#include "vmmalloc/vmmalloc.hpp"

using namespace vmm;

namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;
constexpr std::size_t G = 2 * MiB;

options ipc_options(ipc_kind k = ipc_kind::posix_fd) {
  options o;
  o.ipc = k;
  o.reservation_size = std::size_t{1} << 30;
  return o;
}

std::size_t round_up(std::size_t n, std::size_t g) { return (n + g - 1) / g * g; }

// Longest run of byte v in [p, p + n).
std::size_t longest_run(const std::uint8_t* p, std::size_t n, std::uint8_t v) {
  std::size_t best = 0, cur = 0;
  for (std::size_t i = 0; i < n; ++i) {
    cur = p[i] == v ? cur + 1 : 0;
    best = std::max(best, cur);
  }
  return best;
}

}  // namespace

TEST_CASE("allocator export: whole chunks, the allocation's size and offset, byte-identical") {
  auto a = allocator::host(ipc_options());
  const std::size_t n = 3 * MiB + 100;
  void* p = a.allocate(n);
  ipct::fill(p, n, 71);
  ipc::export_handle h = a.export_ipc(p);
  CHECK(h.version == ipc::format_version);
  CHECK(h.kind == ipc_kind::posix_fd);
  CHECK(h.size == n);
  REQUIRE_FALSE(h.chunks.empty());
  CHECK(h.offset < h.chunks.front().size);
  CHECK(h.mapping_size() % G == 0);
  CHECK(h.mapping_size() == round_up(h.offset + n, G));  // nothing beyond the allocation's granules
  for (auto& c : h.chunks) CHECK(c.handle.fd >= 0);
  CHECK(ipc::validate(h, true).ok());
  ipc::export_handle h2 = a.export_ipc(p);
  CHECK(ipc::serialize(h) == ipc::serialize(h2));  // same allocation, same bytes
  CHECK(a.stats().exported >= 2);

  // Imported in the same process through a second backend: the bytes are the allocation's.
  auto b = make_backend<host_backend>();
  ipc::imported m = ipc::import(*b, std::move(h));
  CHECK(ipct::mismatches(m.get(), m.size(), 71) == 0);
  ipct::fill(m.get(), m.size(), 72);
  CHECK(ipct::mismatches(p, n, 72) == 0);
  m.close();
  a.deallocate(p);
  CHECK(a.check() == "");
}

TEST_CASE("allocator export: bad pointers and non-exportable policies are errors, state intact") {
  auto a = allocator::host(ipc_options());
  void* p = a.allocate(G);
  ipc::export_handle h;
  int local = 0;
  CHECK(a.try_export_ipc(&local, h).kind == errc::invalid_pointer);  // foreign
  CHECK(a.try_export_ipc(static_cast<char*>(p) + 256, h).kind == errc::invalid_pointer);  // interior
  CHECK(h.chunks.empty());
  CHECK_THROWS_AS((void)a.export_ipc(nullptr), vmm::error);
  void* q = a.allocate(G);
  a.deallocate(q);
  CHECK(a.try_export_ipc(q, h).kind == errc::invalid_pointer);  // freed
  CHECK(a.check() == "");
  a.deallocate(p);

  auto plain = allocator::host();  // options.ipc = none: nothing is exportable
  void* r = plain.allocate(G);
  CHECK_FALSE(plain.try_export_ipc(r, h).ok());
  CHECK(h.chunks.empty());
  plain.deallocate(r);
}

TEST_CASE("allocator export, shared chunks: the chunks under the block, at its offset, of any size") {
  tuning t;
  t.ipc_whole_chunks = false;  // blocks share chunks, as PyTorch's tensors do (libvmmalloc_torch)
  auto a = allocator_access::make(make_backend<host_backend>(), ipc_options(), t);
  // A slab slot, a span block and a huge block; small ones share one chunk.
  void* s1 = a.allocate(64);
  void* s2 = a.allocate(64);
  void* mid = a.allocate(MiB + 300);
  const std::size_t big = 300 * MiB;
  void* huge = a.allocate(big);
  {
    const std::uint64_t exports = a.stats().calls.export_handle;
    ipc::export_handle h1 = a.export_ipc(s1), h2 = a.export_ipc(s2);  // one slab: one chunk
    CHECK(h2.offset != h1.offset);
    CHECK(h2.mapping_size() == h1.mapping_size());
    CHECK(h1.chunks.front().handle.fd != h2.chunks.front().handle.fd);  // each handle owns its fd
    CHECK(a.stats().calls.export_handle == exports + 1);  // the chunk was exported once
  }
  for (const auto& c : {std::tuple{s2, std::size_t{64}, std::uint8_t{11}}, std::tuple{mid, MiB + 300, std::uint8_t{12}},
                        std::tuple{huge, big, std::uint8_t{13}}}) {
    const auto [p, n_, v] = c;  // clang 14 cannot capture a structured binding (CAPTURE): n is a copy
    const std::size_t n = n_;
    CAPTURE(n);
    std::memset(s1, 0x5A, 64);
    ipct::fill(p, n, v);
    ipc::export_handle h = a.export_ipc(p);
    CHECK(h.size == n);
    CHECK(h.offset < h.chunks.front().size);
    CHECK(h.offset + n <= h.mapping_size());
    CHECK(ipc::validate(h, true).ok());
    auto b = make_backend<host_backend>();
    ipc::imported m = ipc::import(*b, std::move(h));
    CHECK(ipct::mismatches(m.get(), n, v) == 0);  // the block's bytes at the handle's offset
    ipct::fill(m.get(), n, static_cast<std::uint8_t>(v + 100));
    CHECK(ipct::mismatches(p, n, static_cast<std::uint8_t>(v + 100)) == 0);
    const auto* n1 = static_cast<const std::uint8_t*>(s1);
    CHECK(std::count(n1, n1 + 64, std::uint8_t{0x5A}) == 64);  // the neighbour's bytes were not written
    m.close();
  }
  ipc::export_handle h;
  CHECK(a.try_export_ipc(static_cast<char*>(mid) + 256, h).kind == errc::invalid_pointer);  // interior
  a.deallocate(mid);
  CHECK(a.try_export_ipc(mid, h).kind == errc::invalid_pointer);  // freed
  CHECK(h.chunks.empty());
  // Freed shared blocks are reused as usual: nothing is marked exported.
  void* again = a.allocate(MiB + 300);
  CHECK(a.stats().exported_released == 0);
  for (void* p : {s1, s2, huge, again}) a.deallocate(p);
  CHECK(a.check() == "");
}

TEST_CASE("allocator export, security: the importer maps the allocation's own chunks and nothing else") {
  auto a = allocator::host(ipc_options());
  // Neighbours of every kind around the exported allocation, each filled with its own byte.
  void* small1 = a.allocate(64);
  void* before = a.allocate(MiB);
  const std::size_t n = 5 * MiB + 4000;
  void* x = a.allocate(n);
  void* after = a.allocate(3 * MiB);
  void* small2 = a.allocate(1000);
  std::memset(small1, 0xDD, 64);
  std::memset(before, 0xBB, MiB);
  std::memset(after, 0xCC, 3 * MiB);
  std::memset(small2, 0xEE, 1000);
  ipct::fill(x, n, 81);

  ipc::export_handle h = a.export_ipc(x);
  const std::uint64_t total = h.mapping_size();
  auto b = make_backend<host_backend>();
  auto& hb = static_cast<backend_model<host_backend>&>(*b).get();
  ipc::imported m = ipc::import(*b, std::move(h));
  CHECK(m.mapping_size() == total);
  const std::size_t head = reinterpret_cast<std::uintptr_t>(m.get()) - m.base();
  CHECK(m.mapping_size() == round_up(head + n, G));  // the allocation's granules, no more
  CHECK(hb.live_reservations() == 1);
  const auto* view = reinterpret_cast<const std::uint8_t*>(m.base());
  CHECK(ipct::mismatches(m.get(), n, 81) == 0);
  // Random pattern bytes make runs longer than a few bytes vanishingly rare; a neighbour would
  // show as a run of at least 64.
  for (std::uint8_t v : {0xBB, 0xCC, 0xDD, 0xEE}) {
    CAPTURE(int(v));
    CHECK(longest_run(view, m.mapping_size(), v) < 16);
  }
  std::size_t nonzero_outside = 0;
  for (std::size_t i = 0; i < m.mapping_size(); ++i)
    if ((i < head || i >= head + n) && view[i]) ++nonzero_outside;
  MESSAGE("bytes outside the allocation that are not zero: " << nonzero_outside << " of "
                                                             << m.mapping_size() - n);
  m.close();
  for (void* p : {small1, before, x, after, small2}) a.deallocate(p);
  CHECK(a.check() == "");
}

TEST_CASE("allocator export, fork: the exporter frees and reuses memory; the importer still sees its allocation") {
  auto [ps, cs] = ipc::socket_pair();
  const int child_sock = cs.get(), parent_sock = ps.get();
  const std::size_t n = 4 * MiB + 123;
  const pid_t pid = ipct::spawn([&]() -> int {  // forked before the allocator exists
    ::close(parent_sock);
    auto b = make_backend<host_backend>();
    auto& hb = static_cast<backend_model<host_backend>&>(*b).get();
    const int base_fds = ipct::fd_count();
    {
      ipc::imported m = ipc::import(*b, ipc::receive_handle(child_sock, {{}, 10000}));
      CHILD_REQUIRE(m.size() == n);
      CHILD_REQUIRE(ipct::mismatches(m.get(), n, 91) == 0);
      CHILD_REQUIRE(ipct::put(child_sock, 'I'));
      CHILD_REQUIRE(ipct::expect(child_sock, 'F'));
      // The exporter freed the allocation, trimmed, and allocated and filled a new one of the
      // same size: an exported chunk must not have been handed to it.
      const std::size_t bad = ipct::mismatches(m.get(), n, 91);
      if (bad) std::fprintf(stderr, "child: %zu bytes of the imported view changed after the exporter freed\n", bad);
      CHILD_REQUIRE(bad == 0);
      ipct::fill(m.get(), n, 93);
      CHILD_REQUIRE(ipct::mismatches(m.get(), n, 93) == 0);
    }
    CHILD_REQUIRE(hb.live_handles() == 0 && hb.live_mappings() == 0 && hb.live_reservations() == 0);
    CHILD_REQUIRE(ipct::fd_count() == base_fds);
    CHILD_REQUIRE(ipct::put(child_sock, 'C'));
    return 0;
  });
  REQUIRE(pid > 0);
  cs.reset();
  const int base_fds = ipct::fd_count();
  {
    auto a = allocator::host(ipc_options());
    void* x = a.allocate(n);
    ipct::fill(x, n, 91);
    ipc::send_handle(ps.get(), a.export_ipc(x), {{}, 5000});
    REQUIRE(ipct::expect(ps.get(), 'I'));
    const std::size_t physical_before = a.stats().physical;
    a.deallocate(x);
    a.trim(0);
    CHECK(a.stats().physical < physical_before);  // the exporter's own accounting let it go
    void* y = a.allocate(n);
    ipct::fill(y, n, 92);
    CHECK(ipct::put(ps.get(), 'F'));
    CHECK(ipct::expect(ps.get(), 'C'));
    CHECK(ipct::mismatches(y, n, 92) == 0);  // the importer's writes did not reach y
    a.deallocate(y);
    CHECK(a.check() == "");
  }
  CHECK(ipct::reap(pid) == 0);
  CHECK(ipct::fd_count() == base_fds);
}
