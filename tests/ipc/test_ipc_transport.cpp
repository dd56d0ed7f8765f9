// SPDX-License-Identifier: Apache-2.0
// IPC transport in one process: SCM_RIGHTS frames, fd batching, SO_PEERCRED policy, and every
// receive error closing the fds it got (fd counts back to baseline).
#include <doctest/doctest.h>

#include <sys/socket.h>

#include <cstring>
#include <string>

#include "ipc_test_util.hpp"
#include "vmmalloc/ipc.hpp"
#include "vmmalloc/vmmalloc.hpp"

using namespace vmm;

namespace {

constexpr std::size_t G = 64 << 10;  // small granularity: many chunks stay cheap

host_backend_options small_gran() {
  host_backend_options o;
  o.granularity = G;
  return o;
}

// Sends raw bytes with `nfds` copies of `fd` attached (a hand-made, possibly hostile frame).
void send_raw(int sock, const std::vector<std::uint8_t>& bytes, int fd, std::size_t nfds) {
  std::vector<int> fds(nfds, fd);
  iovec iov{const_cast<std::uint8_t*>(bytes.data()), bytes.size()};
  msghdr mh{};
  mh.msg_iov = &iov;
  mh.msg_iovlen = 1;
  std::vector<char> ctl(CMSG_SPACE(sizeof(int) * (nfds ? nfds : 1)));
  if (nfds) {
    mh.msg_control = ctl.data();
    mh.msg_controllen = CMSG_SPACE(sizeof(int) * nfds);
    cmsghdr* c = CMSG_FIRSTHDR(&mh);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * nfds);
    std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * nfds);
  }
  REQUIRE(::sendmsg(sock, &mh, MSG_NOSIGNAL) == static_cast<ssize_t>(bytes.size()));
}

std::vector<std::uint8_t> frame_header(std::uint32_t blob, std::uint32_t nfds, std::uint32_t magic = 0x46494D56u) {
  std::vector<std::uint8_t> h(16, 0);
  for (int i = 0; i < 4; ++i) {
    h[i] = static_cast<std::uint8_t>(magic >> (8 * i));
    h[4 + i] = static_cast<std::uint8_t>(blob >> (8 * i));
    h[8 + i] = static_cast<std::uint8_t>(nfds >> (8 * i));
  }
  return h;
}

// Receives expecting failure `name`; returns the message.
std::string receive_fails(int sock, const char* name, ipc::receive_options o = {}) {
  CAPTURE(name);
  if (o.timeout_ms < 0) o.timeout_ms = 2000;
  ipc::export_handle h;
  std::string why;
  status s = ipc::try_receive_handle(sock, h, o, &why);
  CHECK_FALSE(s.ok());
  CHECK(std::string(s.name) == name);
  CHECK(h.chunks.empty());
  return why;
}

}  // namespace

TEST_CASE("transport: a handle with 70 chunks crosses a socketpair; fds are the same files") {
  auto b = make_backend<host_backend>(small_gran());
  const int base_fds = ipct::fd_count();
  {
    std::vector<std::size_t> sizes(70, G);
    ipct::host_allocation a(*b, sizes, 512, 70 * G - 1000, 42);
    auto [s0, s1] = ipc::socket_pair();
    ipc::export_handle h = a.export_handle();
    const auto ids = a.inodes();
    ipc::send_handle(s0.get(), h, {{}, 2000});
    ipc::export_handle r = ipc::receive_handle(s1.get(), {{}, 2000});
    CHECK(r.kind == ipc_kind::posix_fd);
    CHECK(r.size == h.size);
    CHECK(r.offset == 512);
    REQUIRE(r.chunks.size() == 70);
    for (std::size_t i = 0; i < 70; ++i) {
      CHECK(r.chunks[i].size == G);
      REQUIRE(r.chunks[i].handle.fd >= 0);
      CHECK(r.chunks[i].handle.fd != h.chunks[i].handle.fd);
      const auto id = ipct::inode_of(r.chunks[i].handle.fd);
      CHECK(id.ino == ids[i].ino);  // in chunk order: fd i is chunk i's memfd
      CHECK((::fcntl(r.chunks[i].handle.fd, F_GETFD) & FD_CLOEXEC) != 0);
    }
    CHECK(ipct::fd_count() == base_fds + 2 + 70 + 70 + 70);  // sockets, chunks, h's and r's fds
  }
  CHECK(ipct::fd_count() == base_fds);
  auto& hb = static_cast<backend_model<host_backend>&>(*b).get();
  CHECK(hb.live_handles() == 0);
  CHECK(hb.live_reservations() == 0);
}

TEST_CASE("transport: two handles back to back on one stream stay apart") {
  auto b = make_backend<host_backend>(small_gran());
  ipct::host_allocation a1(*b, {G, G}, 0, G + 1, 1), a2(*b, {G}, 8, 100, 2);
  auto [s0, s1] = ipc::socket_pair();
  ipc::send_handle(s0.get(), a1.export_handle());
  ipc::send_handle(s0.get(), a2.export_handle());
  auto r1 = ipc::receive_handle(s1.get(), {{}, 2000});
  auto r2 = ipc::receive_handle(s1.get(), {{}, 2000});
  CHECK(r1.chunks.size() == 2);
  CHECK(r1.size == G + 1);
  CHECK(r2.chunks.size() == 1);
  CHECK(r2.size == 100);
  CHECK(ipct::inode_of(r2.chunks[0].handle.fd).ino == a2.inodes()[0].ino);
}

TEST_CASE("transport: SO_PEERCRED policy refuses other uids, before any fd is installed") {
  auto b = make_backend<host_backend>(small_gran());
  ipct::host_allocation a(*b, {G}, 0, 10, 3);
  const int base_fds = ipct::fd_count();
  {
    auto [s0, s1] = ipc::socket_pair();
    auto cr = ipc::peer_of(s1.get());
    REQUIRE(cr.ok());
    CHECK(cr.value.uid == ::geteuid());
    CHECK(cr.value.pid == ::getpid());
    ipc::send_handle(s0.get(), a.export_handle());
    const int with_sockets = ipct::fd_count();

    ipc::receive_options o;
    o.peers.allowed_uids = {::geteuid() + 1};  // anyone but us
    const std::string why = receive_fails(s1.get(), "peer not allowed", o);
    CHECK(why.find("peer uid " + std::to_string(::geteuid())) != std::string::npos);
    CHECK(why.find("not in allowed_uids") != std::string::npos);
    CHECK(ipct::fd_count() == with_sockets);  // nothing received
    try {
      (void)ipc::receive_handle(s1.get(), o);
      FAIL("refused peer accepted");
    } catch (const vmm::error& e) {
      CHECK(e.st().kind == errc::not_permitted);
    }

    ipc::receive_options cb;  // a callback decides alone
    int calls = 0;
    cb.peers.accept = [&](const ipc::peer_credentials& c) {
      ++calls;
      return c.pid != ::getpid();
    };
    receive_fails(s1.get(), "peer not allowed", cb);
    CHECK(calls == 1);
    cb.peers.accept = [](const ipc::peer_credentials&) -> bool { throw std::runtime_error("boom"); };
    receive_fails(s1.get(), "peer not allowed", cb);  // a throwing callback refuses

    // The exporter checks too: it does not hand memory to a refused peer.
    ipc::send_options so;
    so.peers.allowed_uids = {::geteuid() + 1};
    std::string swhy;
    status ss = ipc::try_send_handle(s0.get(), a.export_handle(), so, &swhy);
    CHECK(ss.kind == errc::not_permitted);

    // Our own uid listed explicitly: accepted (the message sent above is still waiting).
    ipc::receive_options ok;
    ok.peers.allowed_uids = {::geteuid() + 1, ::geteuid()};
    ok.timeout_ms = 2000;
    auto r = ipc::receive_handle(s1.get(), ok);
    CHECK(r.chunks.size() == 1);
  }
  CHECK(ipct::fd_count() == base_fds);
}

TEST_CASE("transport: receive errors close every fd received") {
  auto b = make_backend<host_backend>(small_gran());
  ipct::host_allocation a(*b, {G, G}, 0, G + 5, 4);
  ipc::export_handle h = a.export_handle();
  const int fd = h.chunks[0].handle.fd;
  const auto blob = ipc::serialize(h);
  const int base_fds = ipct::fd_count();

  SUBCASE("timeout with nothing sent") {
    auto [s0, s1] = ipc::socket_pair();
    ipc::receive_options o;
    o.timeout_ms = 100;
    receive_fails(s1.get(), "ETIMEDOUT", o);
  }
  SUBCASE("peer closes mid-frame") {
    auto [s0, s1] = ipc::socket_pair();
    auto hdr = frame_header(static_cast<std::uint32_t>(blob.size()), 2);
    send_raw(s0.get(), hdr, fd, 2);
    s0.reset();
    const std::string why = receive_fails(s1.get(), "peer closed the connection");
    CHECK(why.find("after 0 of") != std::string::npos);
  }
  SUBCASE("fewer fds than announced") {
    auto [s0, s1] = ipc::socket_pair();
    send_raw(s0.get(), frame_header(static_cast<std::uint32_t>(blob.size()), 2), fd, 1);
    receive_fails(s1.get(), "fd count mismatch");
  }
  SUBCASE("more fds in one message than a batch: MSG_CTRUNC") {
    auto [s0, s1] = ipc::socket_pair();
    send_raw(s0.get(), frame_header(static_cast<std::uint32_t>(blob.size()), 2), fd, 100);
    receive_fails(s1.get(), "too many fds");
  }
  SUBCASE("more fds than the receiver allows") {
    auto [s0, s1] = ipc::socket_pair();
    ipc::receive_options o;
    o.max_chunks = 1;
    ipc::send_handle(s0.get(), h);
    receive_fails(s1.get(), "too many fds", o);
  }
  SUBCASE("bad frame magic, absurd length") {
    auto [s0, s1] = ipc::socket_pair();
    send_raw(s0.get(), frame_header(static_cast<std::uint32_t>(blob.size()), 2, 0x12345678u), fd, 2);
    receive_fails(s1.get(), "bad frame");
    auto [t0, t1] = ipc::socket_pair();
    send_raw(t0.get(), frame_header(0xFFFFFFF0u, 2), fd, 2);
    receive_fails(t1.get(), "bad frame");
  }
  SUBCASE("garbage handle bytes after a good frame header") {
    auto [s0, s1] = ipc::socket_pair();
    auto bad = blob;
    bad[0] ^= 0xFF;
    send_raw(s0.get(), frame_header(static_cast<std::uint32_t>(bad.size()), 2), fd, 2);
    send_raw(s0.get(), bad, -1, 0);
    receive_fails(s1.get(), "bad magic");
  }
  SUBCASE("fd count disagrees with the handle's posix_fd chunks") {
    auto [s0, s1] = ipc::socket_pair();
    send_raw(s0.get(), frame_header(static_cast<std::uint32_t>(blob.size()), 1), fd, 1);
    send_raw(s0.get(), blob, -1, 0);
    receive_fails(s1.get(), "fd count mismatch");
  }
  SUBCASE("not a socket") {
    ipc::export_handle r;
    CHECK(ipc::try_receive_handle(fd, r).kind == errc::invalid_value);
    CHECK(ipc::try_send_handle(fd, h).kind == errc::invalid_value);
  }
  CHECK(ipct::fd_count() == base_fds);
}

TEST_CASE("transport: a dead peer is an error, not SIGPIPE") {
  auto b = make_backend<host_backend>(small_gran());
  ipct::host_allocation a(*b, {G}, 0, 10, 5);
  auto [s0, s1] = ipc::socket_pair();
  s1.reset();
  std::string why;
  status s = ipc::try_send_handle(s0.get(), a.export_handle(), {}, &why);
  CHECK_FALSE(s.ok());
  CHECK(std::string(s.name) == "peer closed the connection");
}

TEST_CASE("listener / connect: filesystem and abstract paths, clear errors") {
  char dir[] = "/tmp/vmm-ipc-XXXXXX";
  REQUIRE(::mkdtemp(dir) != nullptr);
  const std::string path = std::string(dir) + "/sock";
  {
    ipc::listener l(path);
    CHECK(::access(path.c_str(), F_OK) == 0);
    CHECK_THROWS_AS(ipc::listener{path}, vmm::error);  // in use: no silent unlink of someone's socket
    auto c = ipc::connect(path, 1000);
    auto s = l.accept(1000);
    CHECK(ipct::put(c.get(), 'x'));
    CHECK(ipct::expect(s.get(), 'x'));
    try {
      (void)l.accept(50);
      FAIL("accept without a client returned");
    } catch (const vmm::error& e) {
      CHECK(std::string(e.what()).find("timed out") != std::string::npos);
    }
  }
  CHECK(::access(path.c_str(), F_OK) != 0);  // the listener removed its path
  const std::string abs = "@vmm-ipc-test-" + std::to_string(::getpid());
  {
    ipc::listener l(abs);
    auto c = ipc::connect(abs, 1000);
    auto s = l.accept(1000);
    CHECK(ipc::peer_of(s.get()).value.pid == ::getpid());
  }
  CHECK_THROWS_AS(ipc::connect(path, 50), vmm::error);  // nobody listening
  CHECK_THROWS_AS(ipc::listener(std::string(200, 'x')), vmm::error);  // too long for sun_path
  CHECK_THROWS_AS(ipc::listener(""), vmm::error);
  ::rmdir(dir);
}
