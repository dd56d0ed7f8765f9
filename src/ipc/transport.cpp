// SPDX-License-Identifier: Apache-2.0
// vmmalloc IPC, the transport: unique_fd, peer credentials (SO_PEERCRED), a handle sent over a
// Unix socket as one frame with its fds attached (SCM_RIGHTS, in batches), socket pairs, and the
// listener / connect pair for a named socket. The handle's bytes come from handle.cpp.
#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "ipc/ipc_detail.hpp"
#include "vmmalloc/error.hpp"
#include "vmmalloc/ipc.hpp"

namespace vmm::ipc {

using detail::check_fields;
using detail::chunk_record_bytes;
using detail::errno_text;
using detail::fabric_bytes;
using detail::fail;
using detail::raise;

unique_fd& unique_fd::operator=(unique_fd&& o) noexcept {
  if (this != &o) reset(o.release());
  return *this;
}

void unique_fd::reset(int fd) noexcept {
  if (fd_ >= 0 && fd_ != fd) ::close(fd_);
  fd_ = fd;
}

result<peer_credentials> peer_of(int sock) noexcept {
  struct ucred cr {};
  socklen_t len = sizeof(cr);
  if (::getsockopt(sock, SOL_SOCKET, SO_PEERCRED, &cr, &len) != 0 || len != sizeof(cr)) {
    const int e = errno;
    return {{}, {errc::invalid_value, e, "SO_PEERCRED failed", "getsockopt"}};
  }
  return {{cr.pid, cr.uid, cr.gid}, {}};
}

status check_peer(int sock, const peer_policy& p, std::string* why) noexcept {
  auto cr = peer_of(sock);
  if (!cr.ok())
    return fail(why, cr.st.kind, cr.st.code, cr.st.name, "vmm::ipc::check_peer",
                "SO_PEERCRED: " + errno_text(cr.st.code) + " (not a connected Unix socket?)");
  bool ok = false;
  try {
    if (p.accept) {
      ok = p.accept(cr.value);
    } else if (p.allowed_uids.empty()) {
      ok = cr.value.uid == ::geteuid();
    } else {
      ok = std::find(p.allowed_uids.begin(), p.allowed_uids.end(), cr.value.uid) != p.allowed_uids.end();
    }
  } catch (...) {
    ok = false;  // a throwing callback refuses
  }
  if (!ok)
    return fail(why, errc::not_permitted, EPERM, "peer not allowed", "vmm::ipc::check_peer",
                "peer uid " + std::to_string(cr.value.uid) + " (pid " + std::to_string(cr.value.pid) +
                    ") is not allowed" +
                    (p.accept ? std::string(" by the accept callback")
                              : p.allowed_uids.empty() ? " (only our uid " + std::to_string(::geteuid()) + " is)"
                                                       : std::string(" (not in allowed_uids)")));
  return {};
}

namespace {

// The frame on the wire: this 16-byte header (carrying the first batch of fds), one marker byte
// per further batch of fds, then the serialised handle. Batches keep each recvmsg's control
// buffer small and stay far below the kernel's 253 fds per message (SCM_MAX_FD).
constexpr std::uint32_t frame_magic = 0x46494D56u;  // "VMIF"
constexpr std::size_t frame_header_bytes = 16;
constexpr std::size_t fd_batch = 64;
// Upper bound of a serialised handle, so a hostile length cannot make us allocate gigabytes.
constexpr std::size_t max_blob = header_bytes + std::size_t{max_chunks} * (chunk_record_bytes + fabric_bytes);

struct deadline {
  int timeout_ms;
  timespec start{};
  explicit deadline(int t) : timeout_ms(t) { clock_gettime(CLOCK_MONOTONIC, &start); }
  // Milliseconds left (-1 = unlimited, 0 = expired).
  int left() const {
    if (timeout_ms < 0) return -1;
    timespec now{};
    clock_gettime(CLOCK_MONOTONIC, &now);
    const long long el = (now.tv_sec - start.tv_sec) * 1000LL + (now.tv_nsec - start.tv_nsec) / 1000000;
    return el >= timeout_ms ? 0 : static_cast<int>(timeout_ms - el);
  }
};

// Waits until `sock` is readable/writable. ok, or a timeout / poll error.
status wait_for(int sock, short events, const deadline& d, const char* op, std::string* why) {
  for (;;) {
    const int left = d.left();
    if (left == 0)
      return fail(why, errc::other, ETIMEDOUT, "ETIMEDOUT", op,
                  "timed out after " + std::to_string(d.timeout_ms) + " ms");
    pollfd p{sock, events, 0};
    const int r = ::poll(&p, 1, left);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return fail(why, errc::other, errno, "poll failed", op, "poll: " + errno_text(errno));
    if (r == 0) continue;  // re-check the deadline
    return {};  // ready, or an error/hangup the next call reports
  }
}

// Sends [data, data + n) completely; `fds` ride with the first byte that goes out.
status send_all(int sock, const std::uint8_t* data, std::size_t n, std::span<const int> fds,
                const deadline& d, std::string* why) {
  constexpr const char* op = "vmm::ipc::send_handle";
  const int flags = MSG_NOSIGNAL | (d.timeout_ms >= 0 ? MSG_DONTWAIT : 0);
  alignas(cmsghdr) char ctl[CMSG_SPACE(sizeof(int) * fd_batch)];
  while (n > 0) {
    if (d.timeout_ms >= 0)
      if (status s = wait_for(sock, POLLOUT, d, op, why); !s.ok()) return s;
    iovec iov{const_cast<std::uint8_t*>(data), n};
    msghdr mh{};
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    if (!fds.empty()) {
      std::memset(ctl, 0, sizeof(ctl));
      mh.msg_control = ctl;
      mh.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
      cmsghdr* c = CMSG_FIRSTHDR(&mh);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
      std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
    }
    const ssize_t r = ::sendmsg(sock, &mh, flags);
    if (r < 0) {
      const int e = errno;
      if (e == EINTR || e == EAGAIN || e == EWOULDBLOCK) continue;
      const char* name = e == EPIPE || e == ECONNRESET ? "peer closed the connection" : "sendmsg failed";
      return fail(why, e == EBADF || e == ENOTSOCK ? errc::invalid_value : errc::other, e, name, op,
                  std::string("sendmsg: ") + errno_text(e));
    }
    fds = {};  // attached to the bytes just sent
    data += r;
    n -= static_cast<std::size_t>(r);
  }
  return {};
}

// Receives exactly n bytes into `data`, appending every fd that arrives to `fds` (owned by the
// caller, who closes them on error).
status recv_all(int sock, std::uint8_t* data, std::size_t n, std::vector<int>& fds,
                std::size_t max_fds, const deadline& d, std::string* why) {
  constexpr const char* op = "vmm::ipc::receive_handle";
  const int flags = MSG_CMSG_CLOEXEC | (d.timeout_ms >= 0 ? MSG_DONTWAIT : 0);
  alignas(cmsghdr) char ctl[CMSG_SPACE(sizeof(int) * fd_batch)];
  std::size_t got = 0;
  while (got < n) {
    if (d.timeout_ms >= 0)
      if (status s = wait_for(sock, POLLIN, d, op, why); !s.ok()) return s;
    iovec iov{data + got, n - got};
    msghdr mh{};
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    mh.msg_control = ctl;
    mh.msg_controllen = sizeof(ctl);
    const ssize_t r = ::recvmsg(sock, &mh, flags);
    if (r < 0) {
      const int e = errno;
      if (e == EINTR || e == EAGAIN || e == EWOULDBLOCK) continue;
      return fail(why, e == EBADF || e == ENOTSOCK ? errc::invalid_value : errc::other, e,
                  "recvmsg failed", op, std::string("recvmsg: ") + errno_text(e));
    }
    // Take every fd the kernel installed first, so that an error below still closes them.
    for (cmsghdr* c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c)) {
      if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
      const std::size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (std::size_t i = 0; i < k; ++i) {
        int fd;
        std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
        try {
          fds.push_back(fd);
        } catch (...) {
          ::close(fd);
          return {errc::out_of_memory, ENOMEM, "ENOMEM", op};
        }
      }
    }
    if (mh.msg_flags & MSG_CTRUNC)
      return fail(why, errc::invalid_value, EMSGSIZE, "too many fds", op,
                  "the peer sent more fds in one message than allowed (" + std::to_string(fd_batch) +
                      "); the kernel dropped the rest (MSG_CTRUNC)");
    if (fds.size() > max_fds)
      return fail(why, errc::invalid_value, EMSGSIZE, "too many fds", op,
                  "the peer sent " + std::to_string(fds.size()) + " fds, more than the " +
                      std::to_string(max_fds) + " announced/allowed");
    if (r == 0)
      return fail(why, errc::other, ECONNRESET, "peer closed the connection", op,
                  "the peer closed the connection after " + std::to_string(got) + " of " +
                      std::to_string(n) + " bytes");
    got += static_cast<std::size_t>(r);
  }
  return {};
}

void put_u32(std::uint8_t* p, std::uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<std::uint8_t>(v >> (8 * i));
}
std::uint32_t get_u32(const std::uint8_t* p) {
  std::uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= std::uint32_t{p[i]} << (8 * i);
  return v;
}

}  // namespace

status try_send_handle(int sock, const export_handle& h, const send_options& o, std::string* why) noexcept {
  constexpr const char* op = "vmm::ipc::send_handle";
  try {
    if (status s = check_fields(h, true, op, why); !s.ok()) return s;
    if (status s = check_peer(sock, o.peers, why); !s.ok()) return s;
    std::vector<std::uint8_t> blob;
    if (status s = try_serialize(h, blob); !s.ok()) return s;
    std::vector<int> fds;
    for (const auto& c : h.chunks)
      if (c.handle.kind == ipc_kind::posix_fd) fds.push_back(c.handle.fd);

    std::uint8_t hdr[frame_header_bytes] = {};
    put_u32(hdr, frame_magic);
    put_u32(hdr + 4, static_cast<std::uint32_t>(blob.size()));
    put_u32(hdr + 8, static_cast<std::uint32_t>(fds.size()));
    deadline d(o.timeout_ms);
    std::span<const int> all(fds);
    const std::size_t first = std::min(fds.size(), fd_batch);
    if (status s = send_all(sock, hdr, sizeof(hdr), all.first(first), d, why); !s.ok()) return s;
    for (std::size_t i = first; i < fds.size(); i += fd_batch) {
      const std::uint8_t marker = 0;
      if (status s = send_all(sock, &marker, 1, all.subspan(i, std::min(fd_batch, fds.size() - i)), d, why);
          !s.ok())
        return s;
    }
    return send_all(sock, blob.data(), blob.size(), {}, d, why);
  } catch (...) {
    return {errc::out_of_memory, ENOMEM, "ENOMEM", op};
  }
}

void send_handle(int sock, const export_handle& h, const send_options& o) {
  std::string why;
  if (status s = try_send_handle(sock, h, o, &why); !s.ok()) raise(s, why);
}

status try_receive_handle(int sock, export_handle& out, const receive_options& o, std::string* why) noexcept {
  constexpr const char* op = "vmm::ipc::receive_handle";
  std::vector<int> fds;
  auto close_all = [&] {
    for (int fd : fds) ::close(fd);
    fds.clear();
  };
  try {
    fds.reserve(fd_batch);
    // Refuse an unknown peer before reading anything: its fds stay in the socket and are dropped
    // by the kernel when the socket closes, never installed here.
    if (status s = check_peer(sock, o.peers, why); !s.ok()) return s;
    const std::size_t limit = std::min<std::size_t>(o.max_chunks, max_chunks);
    deadline d(o.timeout_ms);
    std::uint8_t hdr[frame_header_bytes];
    if (status s = recv_all(sock, hdr, sizeof(hdr), fds, std::min(limit, fd_batch), d, why); !s.ok()) {
      close_all();
      return s;
    }
    auto bad = [&](const char* name, const std::string& detail) {
      close_all();
      return fail(why, errc::invalid_value, EINVAL, name, op, detail);
    };
    if (get_u32(hdr) != frame_magic) return bad("bad frame", "not a vmmalloc IPC frame (bad magic)");
    const std::uint32_t blob_len = get_u32(hdr + 4);
    const std::uint32_t nfds = get_u32(hdr + 8);
    if (get_u32(hdr + 12) != 0) return bad("bad frame", "reserved frame bytes are not zero");
    if (blob_len < header_bytes || blob_len > max_blob)
      return bad("bad frame", "frame announces " + std::to_string(blob_len) + " bytes of handle (expected " +
                                  std::to_string(header_bytes) + " to " + std::to_string(max_blob) + ")");
    if (nfds > limit)
      return bad("too many fds", "frame announces " + std::to_string(nfds) + " fds (at most " +
                                     std::to_string(limit) + " allowed)");
    if (fds.size() != std::min<std::size_t>(nfds, fd_batch))
      return bad("fd count mismatch", "received " + std::to_string(fds.size()) + " fds with the header, expected " +
                                          std::to_string(std::min<std::size_t>(nfds, fd_batch)));
    for (std::size_t i = fd_batch; i < nfds; i += fd_batch) {
      std::uint8_t marker;
      if (status s = recv_all(sock, &marker, 1, fds, nfds, d, why); !s.ok()) {
        close_all();
        return s;
      }
    }
    std::vector<std::uint8_t> blob(blob_len);
    if (status s = recv_all(sock, blob.data(), blob.size(), fds, nfds, d, why); !s.ok()) {
      close_all();
      return s;
    }
    if (fds.size() != nfds)
      return bad("fd count mismatch", "received " + std::to_string(fds.size()) + " fds, the frame announced " +
                                          std::to_string(nfds));
    export_handle h;
    if (status s = try_deserialize(blob, h, why); !s.ok()) {
      close_all();
      return s;
    }
    if (h.chunks.size() > limit)
      return bad("too many chunks", std::to_string(h.chunks.size()) + " chunks (at most " +
                                        std::to_string(limit) + " allowed)");
    if (h.fd_count() != nfds)
      return bad("fd count mismatch", "the handle has " + std::to_string(h.fd_count()) +
                                          " posix_fd chunks but " + std::to_string(nfds) + " fds came");
    std::size_t k = 0;
    for (auto& c : h.chunks)
      if (c.handle.kind == ipc_kind::posix_fd) c.handle.fd = fds[k++];
    fds.clear();  // owned by h now
    out = std::move(h);
    return {};
  } catch (...) {
    close_all();
    return {errc::out_of_memory, ENOMEM, "ENOMEM", op};
  }
}

export_handle receive_handle(int sock, const receive_options& o) {
  std::string why;
  export_handle h;
  if (status s = try_receive_handle(sock, h, o, &why); !s.ok()) raise(s, why);
  return h;
}

std::pair<unique_fd, unique_fd> socket_pair() {
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) {
    const int e = errno;
    raise({errc::other, e, "socketpair failed", "socketpair"}, "vmm::ipc::socket_pair: " + errno_text(e));
  }
  return {unique_fd(sv[0]), unique_fd(sv[1])};
}

namespace {

// sockaddr for a path; "@name" is the abstract namespace. Throws for a path that does not fit.
socklen_t make_addr(const std::string& path, sockaddr_un& a, const char* op) {
  a = sockaddr_un{};
  a.sun_family = AF_UNIX;
  const bool abstract = !path.empty() && path[0] == '@';
  const std::size_t n = path.size();
  if (n == 0 || n >= sizeof(a.sun_path) || (abstract && n < 2))
    raise({errc::invalid_value, EINVAL, "bad socket path", op},
          std::string(op) + ": socket path '" + path + "' is empty or longer than " +
              std::to_string(sizeof(a.sun_path) - 1) + " bytes");
  std::memcpy(a.sun_path, path.data(), n);
  if (abstract) {
    a.sun_path[0] = '\0';
    return static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + n);  // no terminator
  }
  return static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + n + 1);
}

}  // namespace

listener::listener(const std::string& path, int backlog) {
  constexpr const char* op = "vmm::ipc::listener";
  sockaddr_un a;
  const socklen_t len = make_addr(path, a, op);
  unique_fd s(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!s) raise({errc::other, errno, "socket failed", op}, std::string(op) + ": socket: " + errno_text(errno));
  if (::bind(s.get(), reinterpret_cast<sockaddr*>(&a), len) != 0) {
    const int e = errno;
    raise({e == EACCES ? errc::not_permitted : errc::invalid_value, e, "bind failed", op},
          std::string(op) + ": bind '" + path + "': " + errno_text(e));
  }
  path_ = path;
  if (::listen(s.get(), backlog) != 0) {
    const int e = errno;
    if (path[0] != '@') ::unlink(path.c_str());
    raise({errc::other, e, "listen failed", op}, std::string(op) + ": listen: " + errno_text(e));
  }
  fd_ = std::move(s);
}

listener& listener::operator=(listener&& o) noexcept {
  if (this != &o) {
    if (fd_ && !path_.empty() && path_[0] != '@') ::unlink(path_.c_str());
    fd_ = std::move(o.fd_);
    path_ = std::move(o.path_);
  }
  return *this;
}

listener::~listener() {
  // Only the listener that bound the path removes it (a moved-from one holds no fd).
  if (fd_ && !path_.empty() && path_[0] != '@') ::unlink(path_.c_str());
}

unique_fd listener::accept(int timeout_ms) {
  constexpr const char* op = "vmm::ipc::listener::accept";
  std::string why;
  deadline d(timeout_ms);
  for (;;) {
    if (status s = wait_for(fd_.get(), POLLIN, d, op, &why); !s.ok()) raise(s, why);
    const int c = ::accept4(fd_.get(), nullptr, nullptr, SOCK_CLOEXEC);
    if (c >= 0) return unique_fd(c);
    const int e = errno;
    if (e == EINTR || e == EAGAIN || e == EWOULDBLOCK || e == ECONNABORTED) continue;
    raise({errc::other, e, "accept failed", op}, std::string(op) + ": accept: " + errno_text(e));
  }
}

unique_fd connect(const std::string& path, int timeout_ms) {
  constexpr const char* op = "vmm::ipc::connect";
  sockaddr_un a;
  const socklen_t len = make_addr(path, a, op);
  deadline d(timeout_ms);
  for (;;) {
    unique_fd s(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (!s) raise({errc::other, errno, "socket failed", op}, std::string(op) + ": socket: " + errno_text(errno));
    int r;
    do r = ::connect(s.get(), reinterpret_cast<sockaddr*>(&a), len);
    while (r != 0 && errno == EINTR);
    if (r == 0) return s;
    const int e = errno;
    // Not there yet, or its backlog is full: worth waiting for when a timeout was given.
    const bool retry = e == ENOENT || e == ECONNREFUSED || e == EAGAIN;
    if (!retry || d.left() == 0 || timeout_ms < 0)
      raise({e == EACCES ? errc::not_permitted : errc::other, e, "connect failed", op},
            std::string(op) + ": connect '" + path + "': " + errno_text(e));
    ::usleep(5000);
  }
}

}  // namespace vmm::ipc
