// SPDX-License-Identifier: Apache-2.0
// vmmalloc IPC, the handle: export_handle's ownership of its fds, the field checks every part
// shares, and the fixed little-endian byte layout (see include/vmmalloc/ipc.hpp). Pure: no
// sockets, no backend. transport.cpp sends and receives it, import.cpp maps it.
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>
#include <utility>

#include "ipc/ipc_detail.hpp"
#include "vmmalloc/error.hpp"
#include "vmmalloc/ipc.hpp"

namespace vmm::ipc {

namespace {

bool valid_kind(std::uint8_t k) {
  return k == static_cast<std::uint8_t>(ipc_kind::posix_fd) ||
         k == static_cast<std::uint8_t>(ipc_kind::fabric);
}

}  // namespace

namespace detail {

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

}  // namespace detail

using detail::check_fields;
using detail::chunk_record_bytes;
using detail::fabric_bytes;
using detail::fail;
using detail::raise;

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

}  // namespace vmm::ipc
