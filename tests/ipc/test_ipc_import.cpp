// SPDX-License-Identifier: Apache-2.0
// IPC import on the host backend: exact reservation, one set_access, rollback of every step, and
// the multi-process cases (fork over a socketpair and a named socket, exporter frees first,
// importer killed with SIGKILL, peer refused, fork + exec of a helper).
#include <doctest/doctest.h>

#include <signal.h>
#include <sys/socket.h>

#include <cstring>
#include <memory>
#include <string>

#include "ipc_test_util.hpp"
#include "support/fault_backend.hpp"
#include "vmmalloc/ipc.hpp"
#include "vmmalloc/vmmalloc.hpp"

#ifndef VMM_IPC_HELPER
#error "VMM_IPC_HELPER (path of the vmm_ipc_helper binary) must be defined by CMake"
#endif

using namespace vmm;

namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;
constexpr std::size_t G = 2 * MiB;  // the GPUs' granularity, mirrored by host_backend's default

host_backend& host_of(backend_iface& b) { return static_cast<backend_model<host_backend>&>(b).get(); }

// Records reserve() sizes and set_access() ranges on the way to the inner backend.
class spy_backend final : public forwarding_backend {
 public:
  explicit spy_backend(backend_iface& in) : forwarding_backend(in) {}
  std::vector<std::size_t> reserves;
  std::vector<std::pair<std::uintptr_t, std::size_t>> accesses;
  result<std::uintptr_t> reserve(std::size_t n, std::size_t a) override {
    reserves.push_back(n);
    return inner().reserve(n, a);
  }
  status set_access(std::uintptr_t va, std::size_t n, std::span<const access_desc> a) override {
    accesses.emplace_back(va, n);
    return inner().set_access(va, n, a);
  }
};

// The consumer's side, run in a child: receive, import, check the parent's bytes, write the reply
// pattern, close, and prove nothing is left (live counts, fds). Returns the exit code.
int consume(int sock, std::uint64_t seed, std::uint64_t reply_seed) {
  const int base_fds = ipct::fd_count();
  auto b = make_backend<host_backend>();
  auto& hb = host_of(*b);
  {
    ipc::receive_options ro;
    ro.timeout_ms = 10000;
    ipc::export_handle h = ipc::receive_handle(sock, ro);
    const std::size_t total = h.mapping_size();
    ipc::imported m = ipc::import(*b, std::move(h));
    CHILD_REQUIRE(m.mapping_size() == total);
    CHILD_REQUIRE(hb.live_reservations() == 1 && hb.live_mappings() == m.chunk_count());
    CHILD_REQUIRE(ipct::mismatches(m.get(), m.size(), seed) == 0);
    ipct::fill(m.get(), m.size(), reply_seed);
    CHILD_REQUIRE(m.close().ok());
    CHILD_REQUIRE(!m);
  }
  CHILD_REQUIRE(hb.live_handles() == 0 && hb.live_mappings() == 0 && hb.live_reservations() == 0);
  CHILD_REQUIRE(ipct::fd_count() == base_fds);
  CHILD_REQUIRE(ipct::put(sock, 'D'));
  return 0;
}

// The producer's side: export a 3-chunk allocation, send it, wait for 'D', check the reply.
void produce(int sock, pid_t child) {
  auto b = make_backend<host_backend>();
  const int base_fds = ipct::fd_count();
  {
    ipct::host_allocation a(*b, {G, 2 * G, G}, 12345, 3 * G + 777, 11);
    {
      ipc::send_options so;
      so.timeout_ms = 5000;
      ipc::send_handle(sock, a.export_handle(), so);
    }
    CHECK(ipct::expect(sock, 'D'));
    CHECK(ipct::mismatches(a.ptr(), a.size, 12) == 0);  // the child's writes, seen here
    // Only the allocation was written by the child; the rest of the chunks is as it was.
    auto* bytes = reinterpret_cast<const std::uint8_t*>(a.base);
    CHECK(bytes[0] == 0x5A);
    CHECK(bytes[a.total - 1] == 0x5A);
  }
  CHECK(ipct::reap(child) == 0);
  CHECK(host_of(*b).live_handles() == 0);
  CHECK(ipct::fd_count() == base_fds);
}

}  // namespace

TEST_CASE("import: reserves exactly the chunks, maps them contiguously, one set_access") {
  auto b = make_backend<host_backend>();
  auto& hb = host_of(*b);
  ipct::host_allocation a(*b, {G, 4 * G, G}, 100, 5 * G, 21);
  const int base_fds = ipct::fd_count();
  spy_backend spy(*b);
  {
    ipc::imported m = ipc::import(spy, a.export_handle());
    CHECK(spy.reserves == std::vector<std::size_t>{6 * G});
    REQUIRE(spy.accesses.size() == 1);
    CHECK(spy.accesses[0] == std::make_pair(m.base(), 6 * G));
    CHECK(m.mapping_size() == 6 * G);
    CHECK(m.chunk_count() == 3);
    CHECK(m.get() == reinterpret_cast<void*>(m.base() + 100));
    CHECK(m.size() == 5 * G);
    CHECK(hb.access_of(m.base() + 5 * G, 0) == access_mode::read_write);
    CHECK(ipct::mismatches(m.get(), m.size(), 21) == 0);
    ipct::fill(m.get(), m.size(), 22);  // shared memory: the exporter's view changes too
    CHECK(ipct::mismatches(a.ptr(), a.size, 22) == 0);
    CHECK(hb.live_reservations() == 2);
    CHECK(hb.live_handles() == 6);
    CHECK(ipct::fd_count() == base_fds + 3);  // the import's handles; the export's fds are closed
    ipc::imported moved = std::move(m);
    CHECK_FALSE(m);
    CHECK(moved.get() != nullptr);
  }  // destructor closes
  CHECK(hb.live_reservations() == 1);
  CHECK(hb.live_mappings() == 3);
  CHECK(hb.live_handles() == 3);
  CHECK(ipct::fd_count() == base_fds);
}

TEST_CASE("import: read-only access and peers go in the same set_access") {
  auto b = make_backend<host_backend>();
  auto& hb = host_of(*b);
  ipct::host_allocation a(*b, {G}, 0, G, 5);
  ipc::import_options o;
  o.mode = access_mode::read;
  o.peers = {{1, access_mode::read_write}};
  ipc::imported m = ipc::import(*b, a.export_handle(), o);
  CHECK(hb.access_of(m.base(), 0) == access_mode::read);
  CHECK(hb.access_of(m.base(), 1) == access_mode::read_write);
  CHECK(ipct::mismatches(m.get(), m.size(), 5) == 0);
}

TEST_CASE("import: every failing step rolls back completely") {
  auto inner = make_backend<host_backend>();
  auto& hb = host_of(*inner);
  ipct::host_allocation a(*inner, {G, G, G}, 0, 3 * G, 6);
  const std::size_t handles0 = hb.live_handles(), maps0 = hb.live_mappings(), res0 = hb.live_reservations();
  const int base_fds = ipct::fd_count();
  auto st = std::make_shared<test::fault_state>();
  // fault_backend owns its inner backend: give it a non-owning forwarder to `inner`.
  test::fault_backend fb(std::make_unique<spy_backend>(*inner), st);
  struct step {
    test::op o;
    std::uint64_t k;
  };
  for (step s : {step{test::op::granularity, 1}, step{test::op::reserve, 1}, step{test::op::import_handle, 1},
                 step{test::op::import_handle, 3}, step{test::op::map, 1}, step{test::op::map, 2},
                 step{test::op::map, 3}, step{test::op::set_access, 1}}) {
    CAPTURE(test::op_name(s.o));
    CAPTURE(s.k);
    ipc::export_handle h = a.export_handle();
    CHECK(ipct::fd_count() == base_fds + 3);
    st->arm(s.o, s.k, test::fault::out_of_memory);
    ipc::imported m;
    std::string why;
    status r = ipc::try_import(fb, std::move(h), {}, m, &why);
    CHECK(r.kind == errc::out_of_memory);
    CHECK(r.code == 2);
    CHECK(why.find("vmm::ipc::import") == 0);
    CHECK_FALSE(m);
    CHECK(st->nothing_live());
    CHECK(hb.live_handles() == handles0);
    CHECK(hb.live_mappings() == maps0);
    CHECK(hb.live_reservations() == res0);
    CHECK(ipct::fd_count() == base_fds);  // the consumed handle's fds are closed too
    st->disarm();
  }
  // The throwing form throws out_of_memory (a std::bad_alloc) for an out-of-memory failure.
  st->arm(test::op::reserve, 1, test::fault::out_of_memory);
  CHECK_THROWS_AS(ipc::import(fb, a.export_handle()), vmm::out_of_memory);
  st->arm(test::op::map, 2, test::fault::invalid_value);
  CHECK_THROWS_AS(ipc::import(fb, a.export_handle()), vmm::error);
  st->disarm();
  CHECK(st->nothing_live());
  // And without faults it works through the same decorator.
  ipc::imported ok = ipc::import(fb, a.export_handle());
  CHECK(ipct::mismatches(ok.get(), ok.size(), 6) == 0);
  CHECK(ok.close().ok());
  CHECK(st->nothing_live());
  CHECK(ipct::fd_count() == base_fds);
}

TEST_CASE("import: forged handles are refused and leak nothing") {
  auto b = make_backend<host_backend>();
  auto& hb = host_of(*b);
  const int base_fds = ipct::fd_count();
  {
    ipct::host_allocation a(*b, {G, G}, 0, 2 * G, 7);
    const std::size_t handles0 = hb.live_handles();

    ipc::export_handle big = a.export_handle();  // claims a chunk larger than its memfd
    big.chunks[1].size = 4 * G;
    std::string why;
    ipc::imported m;
    CHECK_FALSE(ipc::try_import(*b, std::move(big), {}, m, &why).ok());
    CHECK(why.find("map chunk 1") != std::string::npos);

    ipc::export_handle odd = a.export_handle();  // not a granularity multiple
    odd.chunks[0].size = G / 2;
    odd.size = G;
    CHECK(ipc::try_import(*b, std::move(odd), {}, m, &why).kind == errc::invalid_value);
    CHECK(why.find("granularity") != std::string::npos);

    ipc::export_handle nofd = a.export_handle();
    ::close(nofd.chunks[0].handle.fd);
    nofd.chunks[0].handle.fd = -1;
    CHECK(ipc::try_import(*b, std::move(nofd), {}, m, &why).kind == errc::invalid_value);
    CHECK(why.find("holds no fd") != std::string::npos);

    ipc::export_handle beyond = a.export_handle();
    beyond.size = 2 * G;
    beyond.offset = 1;
    CHECK_THROWS_AS(ipc::import(*b, std::move(beyond)), vmm::error);

    ipc::export_handle notmem = a.export_handle();  // an fd that is not a memfd of this size
    ::close(notmem.chunks[0].handle.fd);
    notmem.chunks[0].handle.fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    CHECK_FALSE(ipc::try_import(*b, std::move(notmem), {}, m, &why).ok());

    CHECK(hb.live_handles() == handles0);
    CHECK(hb.live_reservations() == 1);
  }
  CHECK(ipct::fd_count() == base_fds);
}

TEST_CASE("fork: the child imports over a socketpair, sees the parent's bytes, writes back") {
  auto [ps, cs] = ipc::socket_pair();
  const int child_sock = cs.get(), parent_sock = ps.get();
  const pid_t pid = ipct::spawn([&] {
    ::close(parent_sock);
    return consume(child_sock, 11, 12);
  });
  REQUIRE(pid > 0);
  cs.reset();
  produce(ps.get(), pid);
}

TEST_CASE("fork: over a named socket (filesystem and abstract)") {
  char dir[] = "/tmp/vmm-ipc-XXXXXX";
  REQUIRE(::mkdtemp(dir) != nullptr);
  for (const std::string& path : {std::string(dir) + "/s", "@vmm-ipc-fork-" + std::to_string(::getpid())}) {
    CAPTURE(path);
    ipc::listener l(path);
    const int lfd = l.fd();
    const pid_t pid = ipct::spawn([&] {
      ::close(lfd);
      auto s = ipc::connect(path, 5000);
      return consume(s.get(), 11, 12);
    });
    REQUIRE(pid > 0);
    auto s = l.accept(10000);
    CHECK(ipc::peer_of(s.get()).value.pid == pid);  // SO_PEERCRED names the real peer
    produce(s.get(), pid);
  }
  ::rmdir(dir);
}

TEST_CASE("fork: the exporter frees first; the importer's view stays; memory returns when both release") {
  auto [ps, cs] = ipc::socket_pair();
  const int child_sock = cs.get(), parent_sock = ps.get();
  // Forked before any chunk exists: the child inherits no reference to the memory.
  const pid_t pid = ipct::spawn([&]() -> int {
    ::close(parent_sock);
    auto b = make_backend<host_backend>();
    auto& hb = host_of(*b);
    const int base_fds = ipct::fd_count();
    {
      ipc::export_handle h = ipc::receive_handle(child_sock, {{}, 10000});
      std::vector<ipct::file_id> ids;
      for (auto& c : h.chunks) ids.push_back(ipct::inode_of(c.handle.fd));
      ipc::imported m = ipc::import(*b, std::move(h));
      CHILD_REQUIRE(ipct::put(child_sock, 'I'));
      CHILD_REQUIRE(ipct::expect(child_sock, 'F'));  // the parent has released everything
      CHILD_REQUIRE(ipct::mismatches(m.get(), m.size(), 31) == 0);
      ipct::fill(m.get(), m.size(), 32);
      CHILD_REQUIRE(ipct::mismatches(m.get(), m.size(), 32) == 0);
      for (auto id : ids) CHILD_REQUIRE(ipct::inode_refs(::getpid(), id) >= 2);  // import fd + mapping
      CHILD_REQUIRE(m.close().ok());
      for (auto id : ids) CHILD_REQUIRE(ipct::inode_refs(::getpid(), id) == 0);
    }
    CHILD_REQUIRE(hb.live_handles() == 0 && hb.live_mappings() == 0 && hb.live_reservations() == 0);
    CHILD_REQUIRE(ipct::fd_count() == base_fds);
    CHILD_REQUIRE(ipct::put(child_sock, 'C'));
    CHILD_REQUIRE(ipct::expect(child_sock, 'Q'));
    return 0;
  });
  REQUIRE(pid > 0);
  cs.reset();
  auto b = make_backend<host_backend>();
  const int base_fds = ipct::fd_count();
  std::vector<ipct::file_id> ids;
  {
    ipct::host_allocation a(*b, {G, G}, 64, 2 * G - 64, 31);
    ids = a.inodes();
    ipc::send_handle(ps.get(), a.export_handle());
    REQUIRE(ipct::expect(ps.get(), 'I'));
    a.free();  // unmapped, handles released, reservation freed; export fds closed above
  }
  CHECK(host_of(*b).live_handles() == 0);
  CHECK(ipct::fd_count() == base_fds);
  // /proc/<child>/maps needs ptrace read access, which a strict Yama policy may deny to tests.
  const bool see_child = ::access(("/proc/" + std::to_string(pid) + "/maps").c_str(), R_OK) == 0 &&
                         ipct::inode_refs(pid, ids[0]) > 0;
  if (!see_child) MESSAGE("cannot inspect the child's /proc entries; it checks its own references");
  for (auto id : ids) {
    CHECK(ipct::inode_refs(::getpid(), id) == 0);  // nothing here references the memory
    if (see_child) CHECK(ipct::inode_refs(pid, id) >= 2);  // the importer still does
  }
  CHECK(ipct::put(ps.get(), 'F'));
  CHECK(ipct::expect(ps.get(), 'C'));
  if (see_child)
    for (auto id : ids) CHECK(ipct::inode_refs(pid, id) == 0);  // released on both sides: memory freed
  CHECK(ipct::put(ps.get(), 'Q'));
  CHECK(ipct::reap(pid) == 0);
}

TEST_CASE("fork: an importer killed with SIGKILL leaves the exporter working") {
  auto b = make_backend<host_backend>();
  auto& hb = host_of(*b);
  const int base_fds = ipct::fd_count();
  {
    auto [ps, cs] = ipc::socket_pair();
    const int child_sock = cs.get(), parent_sock = ps.get();
    const pid_t victim = ipct::spawn([&]() -> int {
      ::close(parent_sock);
      auto cb = make_backend<host_backend>();
      ipc::imported m = ipc::import(*cb, ipc::receive_handle(child_sock, {{}, 10000}));
      CHILD_REQUIRE(ipct::put(child_sock, 'I'));
      for (;;) ::pause();  // holds the mapping until killed
    });
    REQUIRE(victim > 0);
    cs.reset();
    ipct::host_allocation a(*b, {G, G}, 0, 2 * G, 41);
    const auto ids = a.inodes();
    ipc::send_handle(ps.get(), a.export_handle());
    REQUIRE(ipct::expect(ps.get(), 'I'));
    REQUIRE(::kill(victim, SIGKILL) == 0);
    CHECK(ipct::reap(victim) == 128 + SIGKILL);

    // The exporter's memory and state are intact and usable.
    CHECK(ipct::mismatches(a.ptr(), a.size, 41) == 0);
    ipct::fill(a.ptr(), a.size, 42);
    CHECK(ipct::mismatches(a.ptr(), a.size, 42) == 0);
    std::string why;
    status s = ipc::try_send_handle(ps.get(), a.export_handle(), {}, &why);  // dead peer: an error
    CHECK_FALSE(s.ok());
    CHECK(std::string(s.name) == "peer closed the connection");

    // And it exports the same memory to a new importer.
    auto [ps2, cs2] = ipc::socket_pair();
    const int c2 = cs2.get(), p2 = ps2.get();
    const pid_t next = ipct::spawn([&] {
      ::close(p2);
      return consume(c2, 42, 43);
    });
    REQUIRE(next > 0);
    cs2.reset();
    ipc::send_handle(ps2.get(), a.export_handle());
    CHECK(ipct::expect(ps2.get(), 'D'));
    CHECK(ipct::mismatches(a.ptr(), a.size, 43) == 0);
    CHECK(ipct::reap(next) == 0);
  }
  CHECK(hb.live_handles() == 0);
  CHECK(hb.live_reservations() == 0);
  CHECK(ipct::fd_count() == base_fds);
}

TEST_CASE("fork: an importer that refuses the exporter's uid gets no fd") {
  auto [ps, cs] = ipc::socket_pair();
  const int child_sock = cs.get(), parent_sock = ps.get();
  const pid_t pid = ipct::spawn([&]() -> int {
    ::close(parent_sock);
    pollfd pf{child_sock, POLLIN, 0};
    CHILD_REQUIRE(::poll(&pf, 1, 10000) == 1);  // the handle (and its fds) is in flight now
    const int base_fds = ipct::fd_count();
    ipc::receive_options o;
    o.peers.allowed_uids = {::geteuid() + 1};
    o.timeout_ms = 5000;
    ipc::export_handle h;
    std::string why;
    status s = ipc::try_receive_handle(child_sock, h, o, &why);
    CHILD_REQUIRE(s.kind == errc::not_permitted);
    CHILD_REQUIRE(why.find("is not allowed") != std::string::npos);
    CHILD_REQUIRE(h.chunks.empty());
    CHILD_REQUIRE(ipct::fd_count() == base_fds);
    return 0;
  });
  REQUIRE(pid > 0);
  cs.reset();
  auto b = make_backend<host_backend>();
  ipct::host_allocation a(*b, {G}, 0, G, 51);
  // The child may refuse and exit before the whole frame is written: EPIPE here is fine.
  (void)ipc::try_send_handle(ps.get(), a.export_handle());
  CHECK(ipct::reap(pid) == 0);
}

TEST_CASE("fork + exec: a separate helper program connects, imports, verifies and replies") {
  char dir[] = "/tmp/vmm-ipc-XXXXXX";
  REQUIRE(::mkdtemp(dir) != nullptr);
  const std::string path = std::string(dir) + "/exec.sock";
  {
    ipc::listener l(path);
    std::fflush(nullptr);
    const pid_t pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      ::alarm(30);
      ::execl(VMM_IPC_HELPER, VMM_IPC_HELPER, path.c_str(), "61", "62", static_cast<char*>(nullptr));
      std::fprintf(stderr, "execl %s: %s\n", VMM_IPC_HELPER, std::strerror(errno));
      ::_exit(127);
    }
    auto b = make_backend<host_backend>();
    const int base_fds = ipct::fd_count();
    {
      ipct::host_allocation a(*b, {G, G, G}, 4096, 3 * G - 8192, 61);
      ipc::unique_fd s = l.accept(10000);
      CHECK(ipc::peer_of(s.get()).value.pid == pid);  // the exec'd program, same pid
      ipc::send_handle(s.get(), a.export_handle(), {{}, 5000});
      CHECK(ipct::expect(s.get(), 'D', 15000));
      CHECK(ipct::mismatches(a.ptr(), a.size, 62) == 0);
    }
    CHECK(ipct::reap(pid) == 0);
    CHECK(ipct::fd_count() == base_fds);
  }
  ::rmdir(dir);
}
