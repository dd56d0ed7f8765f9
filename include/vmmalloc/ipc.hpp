// SPDX-License-Identifier: Apache-2.0
// vmmalloc IPC: export an allocation to another process and import it there.
//
//   producer                                     consumer
//   auto h = alloc.export_ipc(p);                auto s = ipc::connect("/run/app.sock");
//   auto c = listener.accept();                  auto h = ipc::receive_handle(s.get());
//   ipc::send_handle(c.get(), h);                auto m = ipc::import(backend, std::move(h));
//                                                use(m.get(), m.size()); m.close();
//
// Three pieces, each usable alone:
//  * serialize / deserialize: a fixed little-endian byte layout of an export_handle (no fds; POSIX
//    fds travel out of band with SCM_RIGHTS, in chunk order). Written field by field: no padding,
//    no uninitialised bytes, the same bytes for the same allocation. deserialize trusts nothing.
//  * send_handle / receive_handle over a connected Unix stream socket (socketpair, listener/connect
//    on a filesystem or abstract path). Both sides check the peer's credentials (SO_PEERCRED:
//    same uid by default). No pidfd_getfd, no ptrace: works in unprivileged containers.
//  * import: reserves exactly the sum of the chunk sizes (never a device-sized range), imports and
//    maps every chunk contiguously, one set_access over the whole range; `imported` unmaps,
//    releases and frees it on close(). Any failure rolls back everything, fds included.
//
// Lifetime follows the driver's reference counting (memfd's on the host backend): the exporter may
// free while an importer maps; the memory returns when both have released it.
//
// Errors: functions without try_ throw vmm::error (declared in vmmalloc.hpp) with the reason;
// try_ functions return the status and never throw.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "vmmalloc/backend.hpp"

namespace vmm::ipc {

inline constexpr std::uint32_t format_version = 1;
// Largest chunk count a handle may carry (deserialize / receive_handle refuse more). 4096 chunks of
// the 2 MiB minimum is 8 GiB; larger allocations use larger chunks.
inline constexpr std::uint32_t max_chunks = 4096;

// One whole physical chunk of an exported allocation.
struct exported_chunk {
  std::uint64_t size = 0;     // bytes of the chunk (a granularity multiple)
  shareable_handle handle;    // posix_fd: an fd this struct owns; fabric: the 64 handle bytes
};

// What allocator::export_ipc(ptr) returns. Move-only; closes the fds it still owns.
// The allocation owns its chunks exclusively (an ipc policy puts every allocation on chunks of
// its own), so an importer maps nothing but the exported allocation.
struct export_handle {
  std::uint32_t version = format_version;
  ipc_kind kind = ipc_kind::none;
  int device = 0;                       // exporting device ordinal (host backend: simulated id)
  std::uint64_t size = 0;               // the allocation's usable bytes
  std::uint64_t offset = 0;             // where the allocation starts in the first chunk
  std::vector<exported_chunk> chunks;   // in virtual-address order; sizes sum to the mapping

  export_handle() = default;
  export_handle(export_handle&&) noexcept;
  export_handle& operator=(export_handle&&) noexcept;
  export_handle(const export_handle&) = delete;
  export_handle& operator=(const export_handle&) = delete;
  ~export_handle();
  void close_fds() noexcept;  // closes every owned fd (idempotent)

  // Sum of the chunk sizes: what an importer reserves and maps. 0 on overflow (invalid handle).
  std::uint64_t mapping_size() const noexcept;
  // Chunks whose handle travels as an fd (posix_fd), i.e. the fds send_handle attaches.
  std::size_t fd_count() const noexcept;
};

// Checks a handle's fields (version, kinds, sizes, offset inside the chunks, chunk count, fds
// present for posix_fd chunks when need_fds). `why` (optional) gets the full reason.
status validate(const export_handle& h, bool need_fds, std::string* why = nullptr) noexcept;

// ---- serialisation -----------------------------------------------------------------------------
//
// Layout (little endian, every byte written):
//   0  u32 magic 'VMIP' (0x50494D56)   4  u32 format version
//   8  u8 kind, u8[3] zero             12 i32 device
//   16 u64 size                        24 u64 offset
//   32 u32 chunk count, u32 zero       then per chunk:
//      u64 size, u8 kind, u8[7] zero, and for fabric chunks the 64 handle bytes.
// The length must match exactly (no trailing bytes).
inline constexpr std::uint32_t magic = 0x50494D56u;  // "VMIP" read as little-endian bytes
inline constexpr std::size_t header_bytes = 40;

// Throws vmm::error (invalid_value) for a handle that validate(h, false) refuses.
std::vector<std::uint8_t> serialize(const export_handle& h);
status try_serialize(const export_handle& h, std::vector<std::uint8_t>& out) noexcept;

// The fields of a serialised handle; posix_fd chunks get fd -1 (receive_handle fills them in).
// Throws vmm::error (invalid_value) naming what is wrong.
export_handle deserialize(std::span<const std::uint8_t> bytes);
status try_deserialize(std::span<const std::uint8_t> bytes, export_handle& out,
                       std::string* why = nullptr) noexcept;

// ---- file descriptors --------------------------------------------------------------------------

// An owned file descriptor (closed on destruction).
class unique_fd {
 public:
  unique_fd() = default;
  explicit unique_fd(int fd) noexcept : fd_(fd) {}
  unique_fd(unique_fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  unique_fd& operator=(unique_fd&& o) noexcept;
  unique_fd(const unique_fd&) = delete;
  unique_fd& operator=(const unique_fd&) = delete;
  ~unique_fd() { reset(); }
  int get() const noexcept { return fd_; }
  explicit operator bool() const noexcept { return fd_ >= 0; }
  int release() noexcept { return std::exchange(fd_, -1); }
  void reset(int fd = -1) noexcept;

 private:
  int fd_ = -1;
};

// ---- transport ---------------------------------------------------------------------------------

struct peer_credentials {
  pid_t pid = 0;
  uid_t uid = 0;
  gid_t gid = 0;
};

// Who may be on the other end. Default: a process of our own effective uid.
struct peer_policy {
  std::vector<uid_t> allowed_uids;  // empty: only geteuid()
  // When set, decides alone (allowed_uids is ignored). Return false to refuse the peer.
  std::function<bool(const peer_credentials&)> accept;
};

struct send_options {
  peer_policy peers;    // the exporter checks whom it hands memory to, too
  int timeout_ms = -1;  // whole send; -1 = no limit
};

struct receive_options {
  peer_policy peers;
  int timeout_ms = -1;                   // whole receive; -1 = no limit
  std::uint32_t max_chunks = ipc::max_chunks;  // refuse handles with more chunks (or fds)
};

// SO_PEERCRED of a connected Unix socket (credentials at connect() / socketpair() time).
result<peer_credentials> peer_of(int sock) noexcept;
// ok, or not_permitted with the peer's uid and pid in `why`.
status check_peer(int sock, const peer_policy& p, std::string* why = nullptr) noexcept;

// Sends one handle: a frame header, the serialised bytes and the posix_fd chunks' fds
// (SCM_RIGHTS, in chunk order, in batches). The handle keeps its fds (the kernel duplicates them
// in flight). Retries EINTR and short writes; never raises SIGPIPE (a dead peer is an error).
void send_handle(int sock, const export_handle& h, const send_options& o = {});
status try_send_handle(int sock, const export_handle& h, const send_options& o = {},
                       std::string* why = nullptr) noexcept;

// Receives one handle; the returned handle owns the received fds. On any error (peer refused,
// truncated stream, MSG_CTRUNC, malformed bytes, fd count mismatch, timeout) every fd received so
// far is closed and nothing is returned.
export_handle receive_handle(int sock, const receive_options& o = {});
status try_receive_handle(int sock, export_handle& out, const receive_options& o = {},
                          std::string* why = nullptr) noexcept;

// A connected pair of Unix stream sockets (CLOEXEC), for fork tests and threads.
std::pair<unique_fd, unique_fd> socket_pair();

// A listening Unix stream socket. path: a filesystem path (unlinked again by the destructor), or
// "@name" for the Linux abstract namespace (no file, gone with the socket).
class listener {
 public:
  explicit listener(const std::string& path, int backlog = 16);
  listener(listener&&) noexcept = default;
  listener& operator=(listener&&) noexcept;
  ~listener();
  // Waits for one connection (timeout_ms -1 = forever); throws vmm::error on timeout or failure.
  unique_fd accept(int timeout_ms = -1);
  int fd() const noexcept { return fd_.get(); }
  const std::string& path() const noexcept { return path_; }

 private:
  unique_fd fd_;
  std::string path_;
};

// Connects to a listener's path ("@name" for abstract). Retries while the path does not exist yet
// or the backlog is full, up to timeout_ms (-1: no retry). Throws vmm::error.
unique_fd connect(const std::string& path, int timeout_ms = -1);

// ---- import ------------------------------------------------------------------------------------

struct import_options {
  int device = 0;                                // the importing device (host backend: 0 = CPU)
  access_mode mode = access_mode::read_write;    // its access
  std::vector<access_desc> peers;                // more devices to grant, in the same set_access
};

// An imported allocation mapped in this process. Move-only; the destructor calls close().
class imported {
 public:
  imported() = default;
  imported(imported&&) noexcept;
  imported& operator=(imported&&) noexcept;
  imported(const imported&) = delete;
  imported& operator=(const imported&) = delete;
  ~imported();

  void* get() const noexcept { return ptr_; }             // base() + offset
  std::size_t size() const noexcept { return size_; }     // the allocation's bytes
  std::uintptr_t base() const noexcept { return base_; }  // start of the mapping
  std::size_t mapping_size() const noexcept { return mapped_; }  // == sum of the chunk sizes
  std::size_t chunk_count() const noexcept { return handles_.size(); }
  ipc_kind kind() const noexcept { return kind_; }
  int exporter_device() const noexcept { return exporter_device_; }
  explicit operator bool() const noexcept { return ptr_ != nullptr; }

  // Unmaps every chunk, releases the imported handles and frees the reservation. Idempotent.
  // Keeps going after a failure and returns the first one. The caller makes sure no kernel still
  // uses the memory (as with cuMemUnmap).
  status close() noexcept;

 private:
  friend status try_import(backend_iface&, export_handle&&, const import_options&, imported&,
                           std::string*) noexcept;
  friend imported import_cuda(int, export_handle&&, import_options);
  backend_iface* b_ = nullptr;
  std::shared_ptr<backend_iface> owned_;  // set when this import made its own backend
  std::uintptr_t base_ = 0;
  std::size_t mapped_ = 0;
  std::vector<std::pair<mem_handle, std::size_t>> handles_;  // chunk handle, chunk size (VA order)
  void* ptr_ = nullptr;
  std::size_t size_ = 0;
  ipc_kind kind_ = ipc_kind::none;
  int exporter_device_ = 0;
};

// Imports `h` through `b` (which must outlive the result). Consumes h: its fds are closed when
// this returns, success or not (the backend keeps its own references). Throws vmm::error.
imported import(backend_iface& b, export_handle&& h, const import_options& o = {});
status try_import(backend_iface& b, export_handle&& h, const import_options& o, imported& out,
                  std::string* why = nullptr) noexcept;
// Imports on CUDA device `device` with a cuda_backend of its own (kept alive by the result);
// o.device is set to `device`. Throws vmm::error when the driver or device is unavailable.
imported import_cuda(int device, export_handle&& h, import_options o = {});

}  // namespace vmm::ipc
