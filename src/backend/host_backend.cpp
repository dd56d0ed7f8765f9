// SPDX-License-Identifier: Apache-2.0
// host_backend: real host memory with the CUDA VMM semantics, and the model of the driver's
// contract (see host_backend.hpp). reserve = mmap(PROT_NONE, MAP_NORESERVE); create = memfd_create
// + ftruncate; map = mmap(MAP_FIXED, fd) with PROT_NONE; set_access = mprotect; unmap = MAP_FIXED
// PROT_NONE anonymous remap (keeps the range reserved); export = dup.
//
// Every call that touches VA or a handle has three steps: under the mutex it checks the contract
// against the registry and against the calls in flight, and registers itself; without the mutex
// it makes the system calls (and stays in flight call_us); under the mutex again it updates the
// registry and leaves. Two calls that overlap in VA or share a handle are thus seen in flight
// together, whichever thread the scheduler runs first.
#include <cerrno>
#include <cinttypes>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
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

std::string hex(std::uintptr_t v) {
  char b[24];
  std::snprintf(b, sizeof b, "0x%" PRIxPTR, v);
  return b;
}

std::string bytes(std::size_t n) {
  constexpr std::size_t M = std::size_t{1} << 20;
  return n % M == 0 ? std::to_string(n / M) + " MiB" : std::to_string(n) + " B";
}

long thread_number() {
  thread_local const long tid = static_cast<long>(::syscall(SYS_gettid));  // a syscall once per thread
  return tid;
}

}  // namespace

struct host_backend::impl {
  host_backend_options opt;
  std::mutex mu;
  std::size_t page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  std::size_t created_bytes = 0;  // physical bytes of live handles (simulated device memory)

  struct handle_rec {
    int fd;
    std::size_t size;
    std::size_t accounted;  // bytes counted in created_bytes (0: imported, the exporter's memory)
  };
  struct mapping {
    std::size_t size;
    mem_handle handle;
    std::map<int, access_mode> access;  // simulated per-device access
  };
  std::map<std::uintptr_t, std::size_t> reservations;  // va -> size
  std::map<std::uintptr_t, mapping> mappings;          // va -> mapping
  // Handle values are never reused unless reuse_handles (the driver's are; never reusing them
  // catches a value used after its release, reusing them what mistakes it for a newer handle).
  std::unordered_map<mem_handle, handle_rec> handles;
  mem_handle next_handle = 0x10001;
  std::vector<mem_handle> released_values;  // reuse_handles: the last released is handed out first
  mem_handle new_handle() {
    if (opt.reuse_handles && !released_values.empty()) {
      const mem_handle h = released_values.back();
      released_values.pop_back();
      return h;
    }
    return next_handle++;
  }

  // A call in flight: the VA and the handles it touches.
  struct call {
    std::uint64_t id;
    const char* op;
    std::uintptr_t va;
    std::size_t size;  // 0: no VA
    std::vector<mem_handle> hs;
    long thread;
  };
  std::vector<call> flight;
  std::uint64_t next_call = 1;

  // Fences: a fence is pending while its stream is held. Ids are never reused; live until dropped
  // (a query, a wait or a drop of a dropped one is the driver's use of a destroyed event).
  fence_t next_fence = 1;
  std::unordered_set<fence_t> live_fences;
  std::unordered_set<stream_t> held;
  std::unordered_map<fence_t, stream_t> pending;
  std::unordered_map<stream_t, std::vector<std::function<void()>>> launched;  // held streams' work
  std::condition_variable completed;  // a held stream completed (waits_block)

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
  const handle_rec* handle(mem_handle h) const {
    auto it = handles.find(h);
    return it == handles.end() ? nullptr : &it->second;
  }

  static std::string describe(const call& c) {
    std::string s = std::string(c.op) + "(";
    if (c.size) s += "va " + hex(c.va) + ", " + bytes(c.size);
    for (std::size_t i = 0; i < c.hs.size(); ++i) s += (c.size || i ? ", handle " : "handle ") + hex(c.hs[i]);
    return s + ") on thread " + std::to_string(c.thread);
  }
  // Caller holds mu. Registers c in flight; "" or the violation: the call already in flight that
  // overlaps it in VA or shares a handle with it.
  std::string begin(call& c) {
    c.id = next_call++;
    c.thread = thread_number();
    for (const call& f : flight) {
      const bool va = c.size && f.size && c.va < f.va + f.size && f.va < c.va + c.size;
      bool h = false;
      for (mem_handle x : c.hs)
        for (mem_handle y : f.hs) h = h || x == y;
      if (va || h)
        return describe(c) + " began while " + describe(f) + " was in flight: two driver calls at once " +
               (h ? "on one handle" : "on overlapping VA");
    }
    flight.push_back(c);
    return {};
  }
  void end(std::uint64_t id) {
    for (std::size_t i = 0; i < flight.size(); ++i)
      if (flight[i].id == id) {
        flight[i] = std::move(flight.back());
        flight.pop_back();
        return;
      }
  }
  void dwell() const {
    if (opt.call_us) std::this_thread::sleep_for(std::chrono::microseconds(opt.call_us));
  }
  // A violation: reported (abort, or the handler) after mu is dropped; the call is refused.
  status violation(std::unique_lock<std::mutex>& g, const std::string& what, status refusal) {
    g.unlock();
    if (opt.on_violation) {
      opt.on_violation(what);
      return refusal;
    }
    std::fprintf(stderr, "vmmalloc host backend: the CUDA driver's contract was broken: %s\n", what.c_str());
    std::fflush(stderr);
    std::abort();
  }
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
  p_->opt = std::move(o);
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
  impl& m = *p_;
  std::unique_lock g(m.mu);
  if (status u = m.unsafe("cuMemAddressReserve"); !u.ok()) return {0, u};
  if (size == 0 || size % m.opt.granularity)
    return {0, m.violation(g, "cuMemAddressReserve of " + bytes(size) + ": not a multiple of the granularity",
                           errno_status(EINVAL, "mmap"))};
  if (align & (align - 1))
    return {0, m.violation(g, "cuMemAddressReserve aligned to " + std::to_string(align) + ": not a power of two",
                           errno_status(EINVAL, "mmap"))};
  g.unlock();
  if (align < m.page) align = m.page;
  std::size_t total = size + align;
  if (total < size) return {0, errno_status(ENOMEM, "mmap")};
  void* raw = ::mmap(nullptr, total, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (raw == MAP_FAILED) return {0, errno_status(errno, "mmap")};
  auto base = reinterpret_cast<std::uintptr_t>(raw);
  auto va = (base + align - 1) & ~(align - 1);
  if (va > base) ::munmap(raw, va - base);  // trim head and tail so the range is exact
  if (base + total > va + size) ::munmap(reinterpret_cast<void*>(va + size), base + total - va - size);
  g.lock();
  m.reservations[va] = size;
  return {va, {}};
}

status host_backend::free_reservation(std::uintptr_t va, std::size_t size) {
  impl& m = *p_;
  std::unique_lock g(m.mu);
  if (status u = m.unsafe("cuMemAddressFree"); !u.ok()) return u;
  auto it = m.reservations.find(va);
  if (it == m.reservations.end() || it->second != size)
    return m.violation(g, "cuMemAddressFree(va " + hex(va) + ", " + bytes(size) + "): no reservation is exactly that",
                       errno_status(EINVAL, "munmap"));
  if (m.overlaps_mapping(va, size))
    return m.violation(g, "cuMemAddressFree(va " + hex(va) + ", " + bytes(size) + ") while it still holds mappings",
                       errno_status(EINVAL, "munmap"));
  impl::call c{0, "cuMemAddressFree", va, size, {}, 0};
  if (std::string v = m.begin(c); !v.empty()) return m.violation(g, v, errno_status(EINVAL, "munmap"));
  g.unlock();
  m.dwell();
  g.lock();
  // Under the mutex: once the kernel has the VA back, a reserve on another thread may get it.
  ::munmap(reinterpret_cast<void*>(va), size);
  m.reservations.erase(va);
  m.end(c.id);
  return {};
}

result<mem_handle> host_backend::create(std::size_t size, const chunk_props& p) {
  impl& m = *p_;
  {
    std::unique_lock g(m.mu);
    if (status u = m.unsafe("cuMemCreate"); !u.ok()) return {0, u};
    if (size == 0 || size % m.opt.granularity)
      return {0, m.violation(g, "cuMemCreate of " + bytes(size) + ": not a multiple of the granularity",
                             errno_status(EINVAL, "memfd_create"))};
    if (p.location == location_kind::device && (p.id < 0 || p.id >= m.opt.device_count))
      return {0, errno_status(EINVAL, "memfd_create")};
    if (p.ipc == ipc_kind::fabric && !m.opt.fabric_supported) return {0, errno_status(EOPNOTSUPP, "memfd_create")};
    if (size > m.opt.physical_limit - std::min(m.created_bytes, m.opt.physical_limit))
      return {0, errno_status(ENOMEM, "memfd_create")};
    m.created_bytes += size;  // claim first, so concurrent creates cannot overshoot the limit
  }
  m.dwell();
  int fd = ::memfd_create("vmmalloc", MFD_CLOEXEC);
  int err = fd < 0 ? errno : 0;
  const char* failed = "memfd_create";
  if (fd >= 0 && ::ftruncate(fd, static_cast<off_t>(size)) != 0) {
    err = errno;
    failed = "ftruncate";
    ::close(fd);
    fd = -1;
  }
  std::lock_guard g(m.mu);
  if (fd < 0) {
    m.created_bytes -= size;
    return {0, errno_status(err, failed)};
  }
  const mem_handle h = m.new_handle();
  m.handles[h] = {fd, size, size};
  return {h, {}};
}

status host_backend::release(mem_handle h) {
  impl& m = *p_;
  std::unique_lock g(m.mu);
  if (status u = m.unsafe("cuMemRelease"); !u.ok()) return u;
  const impl::handle_rec* r = m.handle(h);
  if (!r)
    return m.violation(g, "cuMemRelease(handle " + hex(h) + "): not a live handle (released already, or never made)",
                       errno_status(EBADF, "close"));
  const int fd = r->fd;
  impl::call c{0, "cuMemRelease", 0, 0, {h}, 0};
  if (std::string v = m.begin(c); !v.empty()) return m.violation(g, v, errno_status(EBADF, "close"));
  g.unlock();
  m.dwell();
  // Memory stays while mapped (memfd keeps its pages for live mappings), like cuMemRelease. The
  // simulated device memory is given back here; mapped-but-released bytes are rare and short.
  ::close(fd);
  g.lock();
  m.created_bytes -= m.handles[h].accounted;
  m.handles.erase(h);
  if (m.opt.reuse_handles) m.released_values.push_back(h);
  m.end(c.id);
  return {};
}

result<chunk_info> host_backend::query(mem_handle h) {
  impl& m = *p_;
  std::unique_lock g(m.mu);
  if (!m.handle(h))
    return {{}, m.violation(g, "cuMemGetAllocationPropertiesFromHandle(handle " + hex(h) + "): not a live handle",
                            errno_status(EBADF, "fstat"))};
  return {{false}, {}};  // the host never grants compression
}

status host_backend::map(std::uintptr_t va, std::size_t size, mem_handle h, std::size_t offset) {
  impl& m = *p_;
  std::unique_lock g(m.mu);
  if (status u = m.unsafe("cuMemMap"); !u.ok()) return u;
  const std::string what = "cuMemMap(va " + hex(va) + ", " + bytes(size) + ", handle " + hex(h) + ")";
  const impl::handle_rec* r = m.handle(h);
  if (!r) return m.violation(g, what + ": not a live handle", errno_status(EBADF, "mmap"));
  if (size == 0 || !m.aligned(va) || !m.aligned(size) || !m.aligned(offset) || offset + size < offset)
    return m.violation(g, what + ": size, address or offset off the granularity", errno_status(EINVAL, "mmap"));
  if (offset + size > r->size) {
    // An imported handle's size is what another process claimed: refusing it is the driver's
    // check of that input, not a caller's bug.
    if (!r->accounted) return errno_status(EINVAL, "mmap");
    return m.violation(g, what + ": past the handle's " + bytes(r->size), errno_status(EINVAL, "mmap"));
  }
  // The driver maps a handle from its start only: an offset on the granularity is refused with
  // CUDA_ERROR_NOT_SUPPORTED (H200, driver 580; cuda.h no longer says so), and so is it here.
  if (offset != 0) return m.violation(g, what + ": offset " + bytes(offset) + " (only 0)", errno_status(EOPNOTSUPP, "mmap"));
  const int fd = r->fd;
  // Calls in flight first: a map over VA whose unmap has not returned is that race, not a map
  // over a mapping.
  impl::call c{0, "cuMemMap", va, size, {h}, 0};
  if (std::string v = m.begin(c); !v.empty()) return m.violation(g, v, errno_status(EINVAL, "mmap"));
  const char* bad = !m.inside_reservation(va, size) ? ": outside every reservation"
                    : m.overlaps_mapping(va, size)  ? ": over VA that is mapped"
                                                    : nullptr;
  if (bad) {
    m.end(c.id);
    return m.violation(g, what + bad, errno_status(EINVAL, "mmap"));
  }
  g.unlock();
  m.dwell();
  void* p = ::mmap(reinterpret_cast<void*>(va), size, PROT_NONE, MAP_SHARED | MAP_FIXED, fd, 0);
  const int err = errno;
  g.lock();
  m.end(c.id);
  if (p == MAP_FAILED) return errno_status(err, "mmap");
  m.mappings[va] = {size, h, {}};
  return {};
}

status host_backend::unmap(std::uintptr_t va, std::size_t size) {
  impl& m = *p_;
  std::unique_lock g(m.mu);
  if (status u = m.unsafe("cuMemUnmap"); !u.ok()) return u;
  // Like cuMemUnmap, the range is whole mappings, one or several side by side (the driver unmaps
  // them in one call); part of a mapping, or a gap, is refused.
  impl::call c{0, "cuMemUnmap", va, size, {}, 0};
  std::string why;
  auto it = m.mappings.find(va);
  if (size == 0 || it == m.mappings.end()) why = "no mapping starts there";
  for (std::uintptr_t cur = va; why.empty() && cur < va + size; ++it) {
    if (it == m.mappings.end() || it->first != cur) {
      why = "no mapping starts at " + hex(cur);
    } else if (it->first + it->second.size > va + size) {
      why = "the mapping at " + hex(cur) + " is " + bytes(it->second.size) + " and goes past the range";
    } else {
      c.hs.push_back(it->second.handle);
      cur += it->second.size;
    }
  }
  if (!why.empty())
    return m.violation(g, "cuMemUnmap(va " + hex(va) + ", " + bytes(size) + "): not whole mappings (" + why + ")",
                       errno_status(EINVAL, "munmap"));
  if (std::string v = m.begin(c); !v.empty()) return m.violation(g, v, errno_status(EINVAL, "munmap"));
  g.unlock();
  m.dwell();
  // Put the reservation back in place (PROT_NONE, no backing), atomically over the old mapping.
  void* r = ::mmap(reinterpret_cast<void*>(va), size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED,
                   -1, 0);
  const int err = errno;
  g.lock();
  m.end(c.id);
  if (r == MAP_FAILED) return errno_status(err, "mmap");
  m.mappings.erase(m.mappings.find(va), m.mappings.lower_bound(va + size));
  return {};
}

status host_backend::set_access(std::uintptr_t va, std::size_t size, std::span<const access_desc> acc) {
  impl& m = *p_;
  std::unique_lock g(m.mu);
  if (status u = m.unsafe("cuMemSetAccess"); !u.ok()) return u;
  const std::string what = "cuMemSetAccess(va " + hex(va) + ", " + bytes(size) + ")";
  if (size == 0 || !m.aligned(va) || !m.aligned(size))
    return m.violation(g, what + ": off the granularity", errno_status(EINVAL, "mprotect"));
  for (auto& a : acc)  // cpu_device: host memory is the CPU's anyway (accepted, nothing to do)
    if (a.device != cpu_device && (a.device < 0 || a.device >= m.opt.device_count))
      return m.violation(g, what + ": no device " + std::to_string(a.device), errno_status(EINVAL, "mprotect"));
  // Like cuMemSetAccess, the range must be fully covered by mappings (it may span several).
  impl::call c{0, "cuMemSetAccess", va, size, {}, 0};
  auto it = m.mappings.upper_bound(va);
  bool covered = it != m.mappings.begin();
  if (covered) {
    --it;
    covered = it->first <= va;
    for (std::uintptr_t cur = va; covered && cur < va + size; ++it) {
      covered = it != m.mappings.end() && it->first <= cur;
      if (!covered) break;
      cur = it->first + it->second.size;
      c.hs.push_back(it->second.handle);
    }
  }
  if (!covered) return m.violation(g, what + ": not wholly mapped", errno_status(EINVAL, "mprotect"));
  if (std::string v = m.begin(c); !v.empty()) return m.violation(g, v, errno_status(EINVAL, "mprotect"));
  g.unlock();
  m.dwell();
  int err = 0;
  for (auto& a : acc)
    if (a.device == 0 && ::mprotect(reinterpret_cast<void*>(va), size, prot_of(a.mode)) != 0) err = errno;
  g.lock();
  m.end(c.id);
  if (err) return errno_status(err, "mprotect");
  for (auto x = std::prev(m.mappings.upper_bound(va)); x != m.mappings.end() && x->first < va + size; ++x)
    for (auto& a : acc)
      if (a.device != cpu_device) x->second.access[a.device] = a.mode;
  return {};
}

result<shareable_handle> host_backend::export_handle(mem_handle h, ipc_kind k) {
  impl& m = *p_;
  std::unique_lock g(m.mu);
  if (status u = m.unsafe("cuMemExportToShareableHandle"); !u.ok()) return {{}, u};
  const impl::handle_rec* r = m.handle(h);
  if (!r)
    return {{}, m.violation(g, "cuMemExportToShareableHandle(handle " + hex(h) + "): not a live handle",
                            errno_status(EBADF, "dup"))};
  if (k == ipc_kind::none)
    return {{}, m.violation(g, "cuMemExportToShareableHandle(handle " + hex(h) + ") as no handle type",
                            errno_status(EINVAL, "dup"))};
  if (k == ipc_kind::fabric && !m.opt.fabric_supported) return {{}, errno_status(EOPNOTSUPP, "dup")};
  const int from = r->fd;
  impl::call c{0, "cuMemExportToShareableHandle", 0, 0, {h}, 0};
  if (std::string v = m.begin(c); !v.empty()) return {{}, m.violation(g, v, errno_status(EBADF, "dup"))};
  g.unlock();
  m.dwell();
  int fd = ::fcntl(from, F_DUPFD_CLOEXEC, 0);
  const int err = errno;
  g.lock();
  m.end(c.id);
  if (fd < 0) return {{}, errno_status(err, "dup")};
  shareable_handle s;
  s.kind = ipc_kind::posix_fd;  // a simulated fabric handle also travels as an fd on the host
  s.fd = fd;
  return {s, {}};
}

result<mem_handle> host_backend::import_handle(const shareable_handle& s) {
  // What arrives from another process is input, not the caller's bug: garbage is an error.
  if (s.kind == ipc_kind::none || s.fd < 0) return {0, errno_status(EINVAL, "dup")};
  struct stat st {};
  if (::fstat(s.fd, &st) != 0) return {0, errno_status(errno, "fstat")};
  if (st.st_size <= 0 || static_cast<std::size_t>(st.st_size) % p_->opt.granularity)
    return {0, errno_status(EINVAL, "fstat")};
  std::lock_guard g(p_->mu);
  if (status u = p_->unsafe("cuMemImportFromShareableHandle"); !u.ok()) return {{}, u};
  int fd = ::fcntl(s.fd, F_DUPFD_CLOEXEC, 0);
  if (fd < 0) return {0, errno_status(errno, "dup")};
  const mem_handle h = p_->new_handle();
  p_->handles[h] = {fd, static_cast<std::size_t>(st.st_size), 0};  // imported memory is the exporter's
  return {h, {}};
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
  p_->live_fences.insert(f);
  return {f, {}};
}

bool host_backend::fence_done(fence_t f) {
  if (f == 0) return true;
  std::unique_lock g(p_->mu);
  if (!p_->live_fences.count(f)) {
    (void)p_->violation(g, "cuEventQuery(event " + std::to_string(f) + "): the event was destroyed", {});
    return false;
  }
  if (!p_->unsafe("cuEventQuery").ok()) return false;  // refused: never taken for "done"
  return !p_->pending.count(f);
}

status host_backend::wait_fence(fence_t f) {
  if (f == 0) return {};
  {
    std::unique_lock g(p_->mu);
    if (!p_->live_fences.count(f))
      return p_->violation(g, "cuEventSynchronize(event " + std::to_string(f) + "): the event was destroyed",
                           errno_status(EINVAL, "wait_fence"));
    if (status u = p_->unsafe("cuEventSynchronize"); !u.ok()) return u;
  }
  // A held stream is completed only by the test: a wait blocks until it is (waits_block), or,
  // where no other thread would complete it, fails at once.
  if (fence_done(f)) return {};
  if (!p_->opt.waits_block) return errno_status(EPERM, "wait_fence");
  std::unique_lock g(p_->mu);
  p_->completed.wait(g, [&] { return !p_->live_fences.count(f) || !p_->pending.count(f); });
  return {};
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

void host_backend::drop_fence(fence_t f) {
  if (f == 0) return;
  std::unique_lock g(p_->mu);
  if (!p_->live_fences.erase(f)) {
    (void)p_->violation(g, "cuEventDestroy(event " + std::to_string(f) + "): destroyed already", {});
    return;
  }
  p_->pending.erase(f);
}

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
  // The stream's work lands before its fences complete; work launched meanwhile runs too.
  for (;;) {
    std::vector<std::function<void()>> work;
    {
      std::lock_guard g(p_->mu);
      auto it = p_->launched.find(s);
      if (it == p_->launched.end() || it->second.empty()) {
        p_->launched.erase(s);
        p_->held.erase(s);
        for (auto f = p_->pending.begin(); f != p_->pending.end();)
          f = f->second == s ? p_->pending.erase(f) : std::next(f);
        p_->completed.notify_all();
        return;
      }
      work.swap(it->second);
    }
    for (auto& w : work) w();
  }
}

void host_backend::launch(stream_t s, std::function<void()> work) {
  {
    std::lock_guard g(p_->mu);
    if (p_->held.count(s)) {
      p_->launched[s].push_back(std::move(work));
      return;
    }
  }
  work();
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

int host_backend::fd_of(mem_handle h) {
  std::lock_guard g(p_->mu);
  const impl::handle_rec* r = p_->handle(h);
  return r ? r->fd : -1;
}

mem_handle host_backend::handle_at(std::uintptr_t va) {
  std::lock_guard g(p_->mu);
  auto it = p_->mappings.upper_bound(va);
  if (it == p_->mappings.begin()) return 0;
  --it;
  return va < it->first + it->second.size ? it->second.handle : 0;
}

std::size_t host_backend::live_handles() { std::lock_guard g(p_->mu); return p_->handles.size(); }
std::size_t host_backend::live_mappings() { std::lock_guard g(p_->mu); return p_->mappings.size(); }
std::size_t host_backend::live_reservations() { std::lock_guard g(p_->mu); return p_->reservations.size(); }

}  // namespace vmm
