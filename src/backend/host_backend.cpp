// SPDX-License-Identifier: Apache-2.0
// host_backend: real host memory with the CUDA VMM semantics (see backend.hpp for the contract).
// reserve = mmap(PROT_NONE, MAP_NORESERVE); create = memfd_create + ftruncate; map = mmap(MAP_FIXED,
// fd) with PROT_NONE; set_access = mprotect; unmap = MAP_FIXED PROT_NONE anonymous remap (keeps the
// range reserved); export = dup. A registry checks the driver's rules (map only inside a
// reservation and only over unmapped pages; unmap exactly what one map mapped) so that bugs in the
// arena show up in CI exactly as they would on a GPU.
#include <cerrno>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <unordered_map>
#include <unordered_set>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "vmmalloc/host_backend.hpp"

namespace vmm {

namespace {

status errno_status(int e, const char* op) {
  errc k = errc::other;
  switch (e) {
    case ENOMEM: case ENOSPC: k = errc::out_of_memory; break;
    case EINVAL: case EBADF: k = errc::invalid_value; break;
    case EPERM: case EACCES: k = errc::not_permitted; break;
    case ENOSYS: case EOPNOTSUPP: k = errc::not_supported; break;
    default: break;
  }
  // strerrorname_np needs glibc 2.32; keep our own static names for the common ones.
  const char* n = "EUNKNOWN";
  switch (e) {
    case ENOMEM: n = "ENOMEM"; break;
    case ENOSPC: n = "ENOSPC"; break;
    case EINVAL: n = "EINVAL"; break;
    case EBADF: n = "EBADF"; break;
    case EPERM: n = "EPERM"; break;
    case EACCES: n = "EACCES"; break;
    case ENOSYS: n = "ENOSYS"; break;
    case EOPNOTSUPP: n = "EOPNOTSUPP"; break;
    case EMFILE: n = "EMFILE"; break;
    default: break;
  }
  return {k, e, n, op};
}

int prot_of(access_mode m) {
  switch (m) {
    case access_mode::read: return PROT_READ;
    case access_mode::read_write: return PROT_READ | PROT_WRITE;
    default: return PROT_NONE;
  }
}

}  // namespace

struct host_backend::impl {
  host_backend_options opt;
  std::mutex mu;
  std::size_t page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  std::size_t created_bytes = 0;  // physical bytes of live handles (simulated device memory)

  struct mapping {
    std::size_t size;
    mem_handle handle;
    std::map<int, access_mode> access;  // simulated per-device access
  };
  std::map<std::uintptr_t, std::size_t> reservations;  // va -> size
  std::map<std::uintptr_t, mapping> mappings;          // va -> mapping
  std::unordered_map<int, std::size_t> handles;        // fd -> size (created or imported)
  std::unordered_map<int, std::size_t> accounted;      // fd -> bytes counted in created_bytes

  // Fences: a fence is pending while its stream is held. Ids are never reused.
  fence_t next_fence = 1;
  std::unordered_set<stream_t> held;
  std::unordered_map<fence_t, stream_t> pending;

  // Stream capture, with the driver's rules: an event op on a capturing stream invalidates its
  // capture; a call the driver counts as unsafe (memory management, event query / wait) is
  // refused and invalidates the captures that prohibit it, unless the calling thread is in
  // relaxed mode.
  struct capture {
    std::uint64_t id;
    capture_mode mode;
    std::thread::id thread;
    bool invalidated = false;
    const char* why = "";
  };
  std::unordered_map<stream_t, capture> captures;
  std::uint64_t next_capture = 1;
  // Caller holds mu. An error (and invalidated captures) when this thread may not make an unsafe call.
  status unsafe(const char* op);

  bool inside_reservation(std::uintptr_t va, std::size_t n) const {
    auto it = reservations.upper_bound(va);
    if (it == reservations.begin()) return false;
    --it;
    return va >= it->first && va + n <= it->first + it->second && va + n >= va;
  }
  bool overlaps_mapping(std::uintptr_t va, std::size_t n) const {
    auto it = mappings.lower_bound(va);
    if (it != mappings.end() && it->first < va + n) return true;
    if (it != mappings.begin()) {
      --it;
      if (it->first + it->second.size > va) return true;
    }
    return false;
  }
  bool aligned(std::uintptr_t v) const { return v % opt.granularity == 0; }
};

namespace {
thread_local capture_mode tl_capture_mode = capture_mode::global;  // per thread, as the driver's
constexpr int kCaptureUnsupported = 900, kCaptureInvalidated = 901;  // CUDA's codes
}  // namespace

status host_backend::impl::unsafe(const char* op) {
  if (tl_capture_mode == capture_mode::relaxed) return {};
  const auto me = std::this_thread::get_id();
  bool prohibited = false;
  for (auto& [s, c] : captures) {
    if (c.invalidated || c.mode == capture_mode::relaxed) continue;
    if (c.thread == me || (tl_capture_mode == capture_mode::global && c.mode == capture_mode::global)) {
      c.invalidated = true;
      c.why = op;
      prohibited = true;
    }
  }
  if (!prohibited) return {};
  return {errc::other, kCaptureUnsupported, "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED", op};
}

host_backend::host_backend(host_backend_options o) : p_(std::make_unique<impl>()) {
  p_->opt = o;
  if (p_->opt.granularity == 0 || p_->opt.granularity % p_->page != 0) p_->opt.granularity = p_->page;
}
host_backend::~host_backend() = default;
host_backend::host_backend(host_backend&&) noexcept = default;

unsigned host_backend::capabilities() {
  unsigned c = cap_export_posix_fd | cap_async_fences | cap_host_access | cap_peer_access | cap_capture;
  if (p_->opt.fabric_supported) c |= cap_export_fabric;
  return c;
}

result<granularity_info> host_backend::granularity(const chunk_props& p) {
  if (p.location == location_kind::device && (p.id < 0 || p.id >= p_->opt.device_count))
    return {{}, {errc::invalid_value, EINVAL, "EINVAL", "granularity"}};
  return {{p_->opt.granularity, p_->opt.granularity}, {}};
}

result<std::uintptr_t> host_backend::reserve(std::size_t size, std::size_t align) {
  if (size == 0 || size % p_->opt.granularity) return {0, errno_status(EINVAL, "mmap")};
  if (align < p_->page) align = p_->page;
  if (align & (align - 1)) return {0, errno_status(EINVAL, "mmap")};
  std::size_t total = size + align;
  if (total < size) return {0, errno_status(ENOMEM, "mmap")};
  void* raw = ::mmap(nullptr, total, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (raw == MAP_FAILED) return {0, errno_status(errno, "mmap")};
  auto base = reinterpret_cast<std::uintptr_t>(raw);
  auto va = (base + align - 1) & ~(align - 1);
  if (va > base) ::munmap(raw, va - base);  // trim head and tail so the range is exact
  if (base + total > va + size) ::munmap(reinterpret_cast<void*>(va + size), base + total - va - size);
  std::lock_guard g(p_->mu);
  if (status u = p_->unsafe("cuMemAddressReserve"); !u.ok()) return {{}, u};
  p_->reservations[va] = size;
  return {va, {}};
}

status host_backend::free_reservation(std::uintptr_t va, std::size_t size) {
  std::lock_guard g(p_->mu);
  if (status u = p_->unsafe("cuMemAddressFree"); !u.ok()) return u;
  auto it = p_->reservations.find(va);
  if (it == p_->reservations.end() || it->second != size) return errno_status(EINVAL, "munmap");
  if (p_->overlaps_mapping(va, size)) return errno_status(EINVAL, "munmap");  // driver refuses too
  ::munmap(reinterpret_cast<void*>(va), size);
  p_->reservations.erase(it);
  return {};
}

result<mem_handle> host_backend::create(std::size_t size, const chunk_props& p) {
  if (size == 0 || size % p_->opt.granularity) return {0, errno_status(EINVAL, "memfd_create")};
  if (p.location == location_kind::device && (p.id < 0 || p.id >= p_->opt.device_count))
    return {0, errno_status(EINVAL, "memfd_create")};
  if (p.ipc == ipc_kind::fabric && !p_->opt.fabric_supported)
    return {0, errno_status(EOPNOTSUPP, "memfd_create")};
  {
    std::lock_guard g(p_->mu);
    if (status u = p_->unsafe("cuMemCreate"); !u.ok()) return {{}, u};
    if (size > p_->opt.physical_limit - std::min(p_->created_bytes, p_->opt.physical_limit))
      return {0, errno_status(ENOMEM, "memfd_create")};
    p_->created_bytes += size;  // claim first, so concurrent creates cannot overshoot the limit
  }
  int fd = ::memfd_create("vmmalloc", MFD_CLOEXEC);
  int err = fd < 0 ? errno : 0;
  const char* failed = "memfd_create";
  if (fd >= 0 && ::ftruncate(fd, static_cast<off_t>(size)) != 0) {
    err = errno;
    failed = "ftruncate";
    ::close(fd);
    fd = -1;
  }
  std::lock_guard g(p_->mu);
  if (fd < 0) {
    p_->created_bytes -= size;
    return {0, errno_status(err, failed)};
  }
  p_->handles[fd] = size;
  p_->accounted[fd] = size;
  return {static_cast<mem_handle>(fd), {}};
}

status host_backend::release(mem_handle h) {
  int fd = static_cast<int>(h);
  std::lock_guard g(p_->mu);
  if (status u = p_->unsafe("cuMemRelease"); !u.ok()) return u;
  auto it = p_->handles.find(fd);
  if (it == p_->handles.end()) return errno_status(EBADF, "close");
  // Memory stays while mapped (memfd keeps its pages for live mappings), like cuMemRelease.
  // The simulated device memory is given back here; mapped-but-released bytes are rare and short.
  if (auto a = p_->accounted.find(fd); a != p_->accounted.end()) {
    p_->created_bytes -= a->second;
    p_->accounted.erase(a);
  }
  p_->handles.erase(it);
  ::close(fd);
  return {};
}

result<chunk_info> host_backend::query(mem_handle h) {
  std::lock_guard g(p_->mu);
  auto it = p_->handles.find(static_cast<int>(h));
  if (it == p_->handles.end()) return {{}, errno_status(EBADF, "fstat")};
  return {{false}, {}};  // the host never grants compression
}

status host_backend::map(std::uintptr_t va, std::size_t size, mem_handle h, std::size_t offset) {
  std::lock_guard g(p_->mu);
  if (status u = p_->unsafe("cuMemMap"); !u.ok()) return u;
  int fd = static_cast<int>(h);
  auto hit = p_->handles.find(fd);
  if (hit == p_->handles.end()) return errno_status(EBADF, "mmap");
  if (size == 0 || !p_->aligned(va) || !p_->aligned(size) || !p_->aligned(offset) ||
      offset + size > hit->second || offset + size < offset)
    return errno_status(EINVAL, "mmap");
  // The driver maps a handle from its start only: an offset on the granularity is refused with
  // CUDA_ERROR_NOT_SUPPORTED (H200, driver 580; cuda.h no longer says so), and so is it here.
  if (offset != 0) return errno_status(EOPNOTSUPP, "mmap");
  if (!p_->inside_reservation(va, size) || p_->overlaps_mapping(va, size))
    return errno_status(EINVAL, "mmap");
  void* r = ::mmap(reinterpret_cast<void*>(va), size, PROT_NONE, MAP_SHARED | MAP_FIXED, fd,
                   static_cast<off_t>(offset));
  if (r == MAP_FAILED) return errno_status(errno, "mmap");
  p_->mappings[va] = {size, h, {}};
  return {};
}

status host_backend::unmap(std::uintptr_t va, std::size_t size) {
  std::lock_guard g(p_->mu);
  if (status u = p_->unsafe("cuMemUnmap"); !u.ok()) return u;
  auto it = p_->mappings.find(va);
  if (it == p_->mappings.end() || it->second.size != size) return errno_status(EINVAL, "munmap");
  // Put the reservation back in place (PROT_NONE, no backing), atomically over the old mapping.
  void* r = ::mmap(reinterpret_cast<void*>(va), size, PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
  if (r == MAP_FAILED) return errno_status(errno, "mmap");
  p_->mappings.erase(it);
  return {};
}

status host_backend::set_access(std::uintptr_t va, std::size_t size, std::span<const access_desc> acc) {
  std::lock_guard g(p_->mu);
  if (status u = p_->unsafe("cuMemSetAccess"); !u.ok()) return u;
  if (size == 0 || !p_->aligned(va) || !p_->aligned(size)) return errno_status(EINVAL, "mprotect");
  for (auto& a : acc)  // cpu_device: host memory is the CPU's anyway (accepted, nothing to do)
    if (a.device != cpu_device && (a.device < 0 || a.device >= p_->opt.device_count))
      return errno_status(EINVAL, "mprotect");
  // Like cuMemSetAccess, the range must be fully covered by mappings (it may span several).
  std::uintptr_t cur = va;
  auto it = p_->mappings.upper_bound(va);
  if (it == p_->mappings.begin()) return errno_status(EINVAL, "mprotect");
  --it;
  if (it->first > va) return errno_status(EINVAL, "mprotect");
  auto first = it;
  while (cur < va + size) {
    if (it == p_->mappings.end() || it->first > cur) return errno_status(EINVAL, "mprotect");
    cur = it->first + it->second.size;
    ++it;
  }
  for (auto& a : acc) {
    if (a.device != 0) continue;
    if (::mprotect(reinterpret_cast<void*>(va), size, prot_of(a.mode)) != 0)
      return errno_status(errno, "mprotect");
  }
  for (auto m = first; m != it; ++m)
    for (auto& a : acc)
      if (a.device != cpu_device) m->second.access[a.device] = a.mode;
  return {};
}

result<shareable_handle> host_backend::export_handle(mem_handle h, ipc_kind k) {
  std::lock_guard g(p_->mu);
  if (status u = p_->unsafe("cuMemExportToShareableHandle"); !u.ok()) return {{}, u};
  if (!p_->handles.count(static_cast<int>(h))) return {{}, errno_status(EBADF, "dup")};
  if (k == ipc_kind::none) return {{}, errno_status(EINVAL, "dup")};
  if (k == ipc_kind::fabric && !p_->opt.fabric_supported) return {{}, errno_status(EOPNOTSUPP, "dup")};
  int fd = ::fcntl(static_cast<int>(h), F_DUPFD_CLOEXEC, 0);
  if (fd < 0) return {{}, errno_status(errno, "dup")};
  shareable_handle s;
  s.kind = ipc_kind::posix_fd;  // a simulated fabric handle also travels as an fd on the host
  s.fd = fd;
  return {s, {}};
}

result<mem_handle> host_backend::import_handle(const shareable_handle& s) {
  if (s.kind == ipc_kind::none || s.fd < 0) return {0, errno_status(EINVAL, "dup")};
  struct stat st {};
  if (::fstat(s.fd, &st) != 0) return {0, errno_status(errno, "fstat")};
  if (st.st_size <= 0 || static_cast<std::size_t>(st.st_size) % p_->opt.granularity)
    return {0, errno_status(EINVAL, "fstat")};
  int fd = ::fcntl(s.fd, F_DUPFD_CLOEXEC, 0);
  if (fd < 0) return {0, errno_status(errno, "dup")};
  std::lock_guard g(p_->mu);
  if (status u = p_->unsafe("cuMemImportFromShareableHandle"); !u.ok()) return {{}, u};
  p_->handles[fd] = static_cast<std::size_t>(st.st_size);  // imported memory is the exporter's
  return {static_cast<mem_handle>(fd), {}};
}

result<fence_t> host_backend::record_fence(stream_t s) {
  std::lock_guard g(p_->mu);
  if (auto c = p_->captures.find(s); c != p_->captures.end() && !c->second.invalidated) {
    c->second.invalidated = true;  // an event recorded into a capture is no fence
    c->second.why = "an event recorded on the capturing stream";
    return {0, {errc::other, kCaptureInvalidated, "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED", "cuEventRecord"}};
  }
  if (!p_->held.count(s)) return {0, {}};  // host streams run synchronously: already complete
  fence_t f = p_->next_fence++;
  p_->pending[f] = s;
  return {f, {}};
}

bool host_backend::fence_done(fence_t f) {
  if (f == 0) return true;
  std::lock_guard g(p_->mu);
  if (!p_->unsafe("cuEventQuery").ok()) return false;  // refused: never taken for "done"
  return !p_->pending.count(f);
}

status host_backend::wait_fence(fence_t f) {
  if (f == 0) return {};
  {
    std::lock_guard g(p_->mu);
    if (status u = p_->unsafe("cuEventSynchronize"); !u.ok()) return u;
  }
  // A held stream is completed only by the test; waiting on it would deadlock, so say so.
  if (fence_done(f)) return {};
  return errno_status(EPERM, "wait_fence");
}

result<capture_info> host_backend::capture_of(stream_t s) {
  std::lock_guard g(p_->mu);
  auto it = p_->captures.find(s);
  if (it == p_->captures.end()) return {{}, {}};
  return {{it->second.invalidated ? capture_state::invalidated : capture_state::active, it->second.id}, {}};
}

capture_mode host_backend::exchange_capture_mode(capture_mode m) {
  return std::exchange(tl_capture_mode, m);
}

std::uint64_t host_backend::begin_capture(stream_t s, capture_mode m) {
  std::lock_guard g(p_->mu);
  auto [it, fresh] = p_->captures.try_emplace(s, impl::capture{p_->next_capture, m, std::this_thread::get_id()});
  if (!fresh) return 0;  // already capturing
  return p_->next_capture++;
}

status host_backend::end_capture(stream_t s, std::string* why) {
  std::lock_guard g(p_->mu);
  auto it = p_->captures.find(s);
  if (it == p_->captures.end())
    return {errc::invalid_value, 0, "CUDA_ERROR_ILLEGAL_STATE", "cuStreamEndCapture"};
  const impl::capture c = it->second;
  p_->captures.erase(it);
  if (!c.invalidated) return {};
  if (why) *why = c.why;
  return {errc::other, kCaptureInvalidated, "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED", "cuStreamEndCapture"};
}

void host_backend::drop_fence(fence_t) {}  // ids are never reused; completed ones hold nothing

result<memory_info> host_backend::mem_info() {
  std::lock_guard g(p_->mu);
  if (status u = p_->unsafe("cuMemGetInfo"); !u.ok()) return {{}, u};
  return {{p_->opt.physical_limit - std::min(p_->created_bytes, p_->opt.physical_limit), p_->opt.physical_limit}, {}};
}

bool host_backend::can_access_peer(int d, int p) {
  return d >= 0 && p >= 0 && d < p_->opt.device_count && p < p_->opt.device_count;
}

void host_backend::hold_stream(stream_t s) {
  std::lock_guard g(p_->mu);
  p_->held.insert(s);
}

void host_backend::complete_stream(stream_t s) {
  std::lock_guard g(p_->mu);
  p_->held.erase(s);
  for (auto it = p_->pending.begin(); it != p_->pending.end();)
    it = it->second == s ? p_->pending.erase(it) : std::next(it);
}

access_mode host_backend::access_of(std::uintptr_t va, int device) {
  std::lock_guard g(p_->mu);
  auto it = p_->mappings.upper_bound(va);
  if (it == p_->mappings.begin()) return access_mode::none;
  --it;
  if (va >= it->first + it->second.size) return access_mode::none;
  auto a = it->second.access.find(device);
  return a == it->second.access.end() ? access_mode::none : a->second;
}

std::size_t host_backend::live_handles() { std::lock_guard g(p_->mu); return p_->handles.size(); }
std::size_t host_backend::live_mappings() { std::lock_guard g(p_->mu); return p_->mappings.size(); }
std::size_t host_backend::live_reservations() { std::lock_guard g(p_->mu); return p_->reservations.size(); }

}  // namespace vmm
