// vmmalloc IPC: the export handle, its byte layout, the Unix-socket transport and import.
// See include/vmmalloc/ipc.hpp for the contract. Three parts, top to bottom in this file:
// handle + serialisation (pure), transport (sockets, SCM_RIGHTS, SO_PEERCRED), import (backend).
#include "vmmalloc/cuda_backend.hpp"
#include "vmmalloc/ipc.hpp"

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
#include <new>
#include <string>
#include <utility>

#include "vmmalloc/vmmalloc.hpp"
#include "vm/driver.hpp"
#include "vm/granularity.hpp"
#include "vm/mapping.hpp"
#include "vm/reservation.hpp"

namespace vmm::ipc {

namespace {

// A status with a static reason (status::name) and, in `why`, the reason with the values.
status fail(std::string* why, errc k, int code, const char* name, const char* op,
            const std::string& detail) noexcept {
  if (why) {
    try {
      *why = std::string(op) + ": " + detail;
    } catch (...) {
    }
  }
  return {k, code, name, op};
}

std::string errno_text(int e) { return std::string(std::strerror(e)) + " (errno " + std::to_string(e) + ")"; }

[[noreturn]] void raise(const status& s, const std::string& why) {
  const std::string msg = why.empty() ? s.message() : why;
  if (s.kind == errc::out_of_memory) throw out_of_memory(s, msg);
  throw error(s, msg);
}

}  // namespace

// ---- the handle --------------------------------------------------------------------------------

export_handle::export_handle(export_handle&& o) noexcept
    : version(o.version), kind(o.kind), device(o.device), size(o.size), offset(o.offset),
      chunks(std::move(o.chunks)) {
  o.chunks.clear();
}

export_handle& export_handle::operator=(export_handle&& o) noexcept {
  if (this != &o) {
    close_fds();
    version = o.version;
    kind = o.kind;
    device = o.device;
    size = o.size;
    offset = o.offset;
    chunks = std::move(o.chunks);
    o.chunks.clear();
  }
  return *this;
}

export_handle::~export_handle() { close_fds(); }

void export_handle::close_fds() noexcept {
  for (auto& c : chunks)
    if (c.handle.fd >= 0) {
      ::close(c.handle.fd);
      c.handle.fd = -1;
    }
}

std::uint64_t export_handle::mapping_size() const noexcept {
  std::uint64_t total = 0;
  for (const auto& c : chunks)
    if (__builtin_add_overflow(total, c.size, &total)) return 0;
  return total;
}

std::size_t export_handle::fd_count() const noexcept {
  return static_cast<std::size_t>(std::count_if(chunks.begin(), chunks.end(), [](const auto& c) {
    return c.handle.kind == ipc_kind::posix_fd;
  }));
}

namespace {

bool valid_kind(std::uint8_t k) {
  return k == static_cast<std::uint8_t>(ipc_kind::posix_fd) ||
         k == static_cast<std::uint8_t>(ipc_kind::fabric);
}

// The checks shared by serialize, deserialize, send and import. `op` names the caller.
status check_fields(const export_handle& h, bool need_fds, const char* op, std::string* why) noexcept {
  auto bad = [&](const char* name, const std::string& detail) {
    return fail(why, errc::invalid_value, EINVAL, name, op, detail);
  };
  if (h.version != format_version)
    return bad("unsupported format version", "format version " + std::to_string(h.version) +
                                                 " (this build reads " + std::to_string(format_version) + ")");
  if (!valid_kind(static_cast<std::uint8_t>(h.kind)))
    return bad("bad handle kind", "handle kind " + std::to_string(static_cast<int>(h.kind)) +
                                      " is neither posix_fd (1) nor fabric (2)");
  if (h.device < 0) return bad("bad device", "negative device ordinal " + std::to_string(h.device));
  if (h.chunks.empty()) return bad("no chunks", "the handle has no chunks");
  if (h.chunks.size() > max_chunks)
    return bad("too many chunks", std::to_string(h.chunks.size()) + " chunks (at most " +
                                      std::to_string(max_chunks) + ")");
  std::uint64_t total = 0;
  for (std::size_t i = 0; i < h.chunks.size(); ++i) {
    const auto& c = h.chunks[i];
    if (c.size == 0) return bad("empty chunk", "chunk " + std::to_string(i) + " has size 0");
    if (__builtin_add_overflow(total, c.size, &total))
      return bad("chunk sizes overflow", "the chunk sizes overflow 64 bits at chunk " + std::to_string(i));
    if (!valid_kind(static_cast<std::uint8_t>(c.handle.kind)))
      return bad("bad chunk kind", "chunk " + std::to_string(i) + " has handle kind " +
                                       std::to_string(static_cast<int>(c.handle.kind)));
    if (need_fds && c.handle.kind == ipc_kind::posix_fd && c.handle.fd < 0)
      return bad("missing fd", "chunk " + std::to_string(i) + " is posix_fd but holds no fd");
  }
  if (h.size == 0) return bad("empty allocation", "the allocation's size is 0");
  if (h.offset >= h.chunks.front().size)
    return bad("offset outside first chunk", "offset " + std::to_string(h.offset) +
                                                 " is not inside the first chunk (" +
                                                 std::to_string(h.chunks.front().size) + " bytes)");
  std::uint64_t end = 0;
  if (__builtin_add_overflow(h.offset, h.size, &end) || end > total)
    return bad("allocation beyond chunks", "offset " + std::to_string(h.offset) + " + size " +
                                               std::to_string(h.size) + " exceeds the chunks' " +
                                               std::to_string(total) + " bytes");
  // Every chunk must hold part of the allocation: a trailing chunk would expose memory that is
  // not the allocation's.
  if (end <= total - h.chunks.back().size)
    return bad("chunk outside allocation", "the last chunk holds no byte of the allocation (ends at " +
                                               std::to_string(end) + " of " + std::to_string(total) + ")");
  return {};
}

// Little-endian, field by field: no struct is copied, so no padding byte ever leaves the process.
struct writer {
  std::vector<std::uint8_t>& out;
  void u8(std::uint8_t v) { out.push_back(v); }
  void u32(std::uint32_t v) {
    for (int i = 0; i < 4; ++i) out.push_back(static_cast<std::uint8_t>(v >> (8 * i)));
  }
  void u64(std::uint64_t v) {
    for (int i = 0; i < 8; ++i) out.push_back(static_cast<std::uint8_t>(v >> (8 * i)));
  }
  void zeros(std::size_t n) { out.insert(out.end(), n, 0); }
};

struct reader {
  std::span<const std::uint8_t> in;
  std::size_t pos = 0;
  bool has(std::size_t n) const { return in.size() - pos >= n; }
  std::uint8_t u8() { return in[pos++]; }
  std::uint32_t u32() {
    std::uint32_t v = 0;
    for (int i = 0; i < 4; ++i) v |= std::uint32_t{in[pos++]} << (8 * i);
    return v;
  }
  std::uint64_t u64() {
    std::uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v |= std::uint64_t{in[pos++]} << (8 * i);
    return v;
  }
  bool zeros(std::size_t n) {
    bool z = true;
    for (std::size_t i = 0; i < n; ++i) z &= in[pos++] == 0;
    return z;
  }
};

constexpr std::size_t chunk_record_bytes = 16;  // u64 size, u8 kind, u8[7] zero
constexpr std::size_t fabric_bytes = sizeof(shareable_handle{}.fabric);

}  // namespace

status validate(const export_handle& h, bool need_fds, std::string* why) noexcept {
  return check_fields(h, need_fds, "vmm::ipc::validate", why);
}

// ---- serialisation -----------------------------------------------------------------------------

status try_serialize(const export_handle& h, std::vector<std::uint8_t>& out) noexcept {
  {
    if (status s = check_fields(h, false, "vmm::ipc::serialize", nullptr); !s.ok()) return s;
    try {
      std::vector<std::uint8_t> v;
      v.reserve(header_bytes + h.chunks.size() * (chunk_record_bytes + fabric_bytes));
      writer w{v};
      w.u32(magic);
      w.u32(h.version);
      w.u8(static_cast<std::uint8_t>(h.kind));
      w.zeros(3);
      w.u32(static_cast<std::uint32_t>(h.device));
      w.u64(h.size);
      w.u64(h.offset);
      w.u32(static_cast<std::uint32_t>(h.chunks.size()));
      w.zeros(4);
      for (const auto& c : h.chunks) {
        w.u64(c.size);
        w.u8(static_cast<std::uint8_t>(c.handle.kind));
        w.zeros(7);
        if (c.handle.kind == ipc_kind::fabric) v.insert(v.end(), c.handle.fabric.begin(), c.handle.fabric.end());
      }
      out = std::move(v);
    } catch (...) {
      return {errc::out_of_memory, ENOMEM, "ENOMEM", "vmm::ipc::serialize"};
    }
    return {};
  }
}

std::vector<std::uint8_t> serialize(const export_handle& h) {
  std::string why;
  if (status s = check_fields(h, false, "vmm::ipc::serialize", &why); !s.ok()) raise(s, why);
  std::vector<std::uint8_t> out;
  if (status s = try_serialize(h, out); !s.ok()) raise(s, "");
  return out;
}

status try_deserialize(std::span<const std::uint8_t> bytes, export_handle& out, std::string* why) noexcept {
  constexpr const char* op = "vmm::ipc::deserialize";
  auto bad = [&](const char* name, const std::string& detail) {
    return fail(why, errc::invalid_value, EINVAL, name, op, detail);
  };
  try {
    reader r{bytes};
    if (!r.has(header_bytes))
      return bad("truncated", std::to_string(bytes.size()) + " bytes, shorter than the " +
                                  std::to_string(header_bytes) + "-byte header");
    export_handle h;
    const std::uint32_t m = r.u32();
    if (m != magic) return bad("bad magic", "not a vmmalloc IPC handle (bad magic)");
    h.version = r.u32();
    if (h.version != format_version)
      return bad("unsupported format version", "format version " + std::to_string(h.version) +
                                                   " (this build reads " + std::to_string(format_version) + ")");
    const std::uint8_t kind = r.u8();
    if (!valid_kind(kind)) return bad("bad handle kind", "handle kind " + std::to_string(kind));
    h.kind = static_cast<ipc_kind>(kind);
    if (!r.zeros(3)) return bad("reserved bytes set", "reserved header bytes are not zero");
    h.device = static_cast<int>(r.u32());
    h.size = r.u64();
    h.offset = r.u64();
    const std::uint32_t count = r.u32();
    if (!r.zeros(4)) return bad("reserved bytes set", "reserved header bytes are not zero");
    if (count == 0) return bad("no chunks", "the handle has no chunks");
    if (count > max_chunks)
      return bad("too many chunks", std::to_string(count) + " chunks (at most " + std::to_string(max_chunks) + ")");
    h.chunks.reserve(count);
    for (std::uint32_t i = 0; i < count; ++i) {
      if (!r.has(chunk_record_bytes))
        return bad("truncated", "truncated in chunk " + std::to_string(i) + " of " + std::to_string(count));
      exported_chunk c;
      c.size = r.u64();
      const std::uint8_t ck = r.u8();
      if (!valid_kind(ck))
        return bad("bad chunk kind", "chunk " + std::to_string(i) + " has handle kind " + std::to_string(ck));
      if (!r.zeros(7)) return bad("reserved bytes set", "reserved bytes of chunk " + std::to_string(i) + " are not zero");
      c.handle.kind = static_cast<ipc_kind>(ck);
      if (c.handle.kind == ipc_kind::fabric) {
        if (!r.has(fabric_bytes))
          return bad("truncated", "truncated in the fabric handle of chunk " + std::to_string(i));
        std::memcpy(c.handle.fabric.data(), bytes.data() + r.pos, fabric_bytes);
        r.pos += fabric_bytes;
      }
      h.chunks.push_back(c);
    }
    if (r.pos != bytes.size())
      return bad("trailing bytes", std::to_string(bytes.size() - r.pos) + " bytes after the last chunk");
    if (status s = check_fields(h, false, op, why); !s.ok()) return s;
    out = std::move(h);
    return {};
  } catch (...) {
    return {errc::out_of_memory, ENOMEM, "ENOMEM", op};
  }
}

export_handle deserialize(std::span<const std::uint8_t> bytes) {
  std::string why;
  export_handle h;
  if (status s = try_deserialize(bytes, h, &why); !s.ok()) raise(s, why);
  return h;
}

// ---- file descriptors and sockets --------------------------------------------------------------

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

// ---- import ------------------------------------------------------------------------------------

imported::imported(imported&& o) noexcept
    : b_(std::exchange(o.b_, nullptr)), owned_(std::move(o.owned_)), base_(std::exchange(o.base_, 0)),
      mapped_(std::exchange(o.mapped_, 0)), handles_(std::move(o.handles_)),
      ptr_(std::exchange(o.ptr_, nullptr)), size_(std::exchange(o.size_, 0)), kind_(o.kind_),
      exporter_device_(o.exporter_device_) {
  o.handles_.clear();
}

imported& imported::operator=(imported&& o) noexcept {
  if (this != &o) {
    close();
    b_ = std::exchange(o.b_, nullptr);
    owned_ = std::move(o.owned_);
    base_ = std::exchange(o.base_, 0);
    mapped_ = std::exchange(o.mapped_, 0);
    handles_ = std::move(o.handles_);
    o.handles_.clear();
    ptr_ = std::exchange(o.ptr_, nullptr);
    size_ = std::exchange(o.size_, 0);
    kind_ = o.kind_;
    exporter_device_ = o.exporter_device_;
  }
  return *this;
}

imported::~imported() { close(); }

status imported::close() noexcept {
  if (!b_) return {};
  status first;
  auto keep = [&](status s) {
    if (first.ok() && !s.ok()) first = s;
  };
  // Each call is made once more if refused (as every teardown does): one refusal must not leak.
  std::uintptr_t va = base_;
  for (const auto& [h, n] : handles_) {  // one unmap per map() made
    keep(vm::driver::twice([&] { return b_->unmap(va, n); }));
    va += n;
  }
  for (const auto& [h, n] : handles_) keep(vm::driver::twice([&] { return b_->release(h); }));
  if (mapped_) keep(vm::driver::twice([&] { return b_->free_reservation(base_, mapped_); }));
  handles_.clear();
  b_ = nullptr;
  base_ = 0;
  mapped_ = 0;
  ptr_ = nullptr;
  size_ = 0;
  owned_.reset();
  return first;
}

status try_import(backend_iface& b, export_handle&& hin, const import_options& o, imported& out,
                  std::string* why) noexcept {
  constexpr const char* op = "vmm::ipc::import";
  export_handle h(std::move(hin));  // consumed: its fds close when this returns
  if (status s = check_fields(h, true, op, why); !s.ok()) return s;
  auto backend_fail = [&](const status& s, const std::string& what) {
    if (why) {
      try {
        *why = std::string(op) + ": " + what + ": " + s.message();
      } catch (...) {
      }
    }
    return s;
  };

  // The granularity of the importing device and its peers: every chunk (and so the reservation)
  // must be a multiple of it.
  vm::driver d(&b);
  chunk_props props;
  props.location = location_kind::device;
  props.id = o.device;
  props.ipc = h.chunks.front().handle.kind;
  std::string gwhy;
  auto g = vm::granularity_for(d, props, o.peers, false, &gwhy);
  if (!g.ok()) return backend_fail(g.st, gwhy);
  const std::size_t gran = g.value;
  for (std::size_t i = 0; i < h.chunks.size(); ++i)
    if (h.chunks[i].size % gran)
      return fail(why, errc::invalid_value, EINVAL, "chunk not a granularity multiple", op,
                  "chunk " + std::to_string(i) + " (" + std::to_string(h.chunks[i].size) +
                      " bytes) is not a multiple of the importing device's granularity (" +
                      std::to_string(gran) + ")");
  const std::uint64_t total = h.mapping_size();
  if (total > std::uint64_t{SIZE_MAX})
    return fail(why, errc::invalid_value, EINVAL, "too large", op, "mapping does not fit size_t");

  imported m;
  std::vector<access_desc> acc;
  try {
    m.handles_.reserve(h.chunks.size());
    acc.reserve(1 + o.peers.size());
    acc.push_back({o.device, o.mode});
    acc.insert(acc.end(), o.peers.begin(), o.peers.end());
  } catch (...) {
    return {errc::out_of_memory, ENOMEM, "ENOMEM", op};
  }
  // Exactly the chunks' bytes: never a device-sized range per import.
  vm::reservation res;
  if (status s = res.open(d, static_cast<std::size_t>(total), gran); !s.ok())
    return backend_fail(s, "reserve " + std::to_string(total) + " bytes");

  // All or nothing: imported handles are the import's own (released on failure), mappings are
  // undone by the transaction, the reservation freed by `res`.
  vm::strays left;
  status err{};
  std::string what;
  {
    vm::mapping_txn txn(d, left);
    std::size_t i = 0;
    for (; i < h.chunks.size(); ++i) {
      auto ih = d.import_handle(h.chunks[i].handle);
      if (!ih.ok()) {
        err = ih.st;
        what = "import chunk " + std::to_string(i);
        break;
      }
      m.handles_.emplace_back(ih.value, static_cast<std::size_t>(h.chunks[i].size));  // reserved above
    }
    std::uintptr_t va = res.base();
    for (std::size_t k = 0; err.ok() && k < m.handles_.size(); ++k) {
      const auto [mh, n] = m.handles_[k];
      if (status s = txn.map(va, n, mh, true); !s.ok()) {
        err = s;
        what = "map chunk " + std::to_string(k) + " (" + std::to_string(n) + " bytes)";
        // txn released chunk k; the ones after it were never mapped
        for (std::size_t r = k + 1; r < m.handles_.size(); ++r)
          if (!vm::driver::twice([&] { return d.release(m.handles_[r].first); }).ok())
            left.add_handle(m.handles_[r].first, m.handles_[r].second);
        m.handles_.clear();
        break;
      }
      va += n;
    }
    // One set_access over the whole range, for every device at once.
    if (err.ok()) {
      err = txn.set_access(res.base(), res.size(), acc);
      if (!err.ok()) what = "set_access for device " + std::to_string(o.device);
    }
    if (err.ok()) {
      txn.commit();
    } else {
      txn.rollback();
      if (!m.handles_.empty() && i < h.chunks.size())  // an import failed: nothing was mapped yet
        for (const auto& [mh, n] : m.handles_)
          if (!vm::driver::twice([&] { return d.release(mh); }).ok()) left.add_handle(mh, n);
      m.handles_.clear();
    }
  }
  if (!err.ok()) {
    // What the driver still refused to undo cannot be kept by anyone: a mapping left in place
    // keeps its reservation too (freeing it under a live mapping is worse than the leak).
    if (!left.retry(d).ok()) {
      bool mapped = false;
      for (const auto& e : left.entries()) mapped = mapped || e.mapped;
      if (mapped) (void)res.release_without_freeing();
      what += " (and undoing it was refused: " + std::to_string(left.size()) + " driver objects leaked)";
    }
    return backend_fail(err, what);
  }
  m.b_ = &b;
  m.base_ = res.base();
  m.mapped_ = res.size();
  (void)res.release_without_freeing();  // m owns the range now: close() frees it
  m.ptr_ = reinterpret_cast<void*>(m.base_ + h.offset);
  m.size_ = static_cast<std::size_t>(h.size);
  m.kind_ = h.kind;
  m.exporter_device_ = h.device;
  out = std::move(m);
  return {};
}

imported import(backend_iface& b, export_handle&& h, const import_options& o) {
  std::string why;
  imported m;
  if (status s = try_import(b, std::move(h), o, m, &why); !s.ok()) raise(s, why);
  return m;
}

imported import_cuda(int device, export_handle&& h, import_options o) {
  export_handle own(std::move(h));  // closed on every path
  std::shared_ptr<backend_iface> b = make_backend<cuda_backend>(device);
  auto& cb = static_cast<backend_model<cuda_backend>&>(*b).get();
  if (!cb.available()) raise(cb.load_status(), "vmm::ipc::import_cuda: " + cb.load_message());
  o.device = device;
  imported m = import(*b, std::move(own), o);
  m.owned_ = std::move(b);
  return m;
}

}  // namespace vmm::ipc
