// SPDX-License-Identifier: Apache-2.0
// libvmmalloc_torch.so: a block shared with another process, as PyTorch shares CUDA tensors
// (torch.multiprocessing; the extension's shareIpcHandle / getIpcDevPtr call these).
//
// PyTorch carries the handle as bytes through a pickle, so the POSIX fds of the block's chunks
// cannot travel with it (no SCM_RIGHTS): the handle names the exporting pid and its fd numbers,
// and the importer takes copies with pidfd_getfd, as PyTorch's expandable segments do. The
// exporter keeps those fds open until the block is freed; PyTorch's sharing keeps a shared block
// alive until every receiver has dropped it, so a receiver imports while they are open.
//
// Handle bytes (native byte order, one machine): "VMTS", u32 version, i32 pid, u32 fd count,
// u64 process nonce (random per process: pids are reused), the chunks' export ids (u64 each, in
// chunk order), their fd numbers (i32 each), then the export handle as vmm::ipc::serialize writes
// it. The first byte differs from PyTorch's own handles' (a version byte), so a receiver without
// vmmalloc refuses it instead of misreading it.
//
// A receiver maps each set of chunks once while any import uses it (keyed by sender, nonce,
// device and export ids, which name physical memory for as long as it lives): blocks that lie on
// the same chunks, as tensors of one model do, cost one import, one map and one set_access
// together instead of one each (~75 us per block on an H200).
// PyTorch's expandable segments share whole segments for the same reason.
#include <sys/random.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#pragma GCC visibility push(default)
#include "vmmalloc_torch.h"
#pragma GCC visibility pop

#include "torch_lib.hpp"
#include "vmmalloc/ipc.hpp"

namespace vmm::torch_lib {
namespace {

constexpr char kMagic[4] = {'V', 'M', 'T', 'S'};
constexpr std::uint32_t kVersion = 2;
constexpr std::size_t kHeader = 4 + 4 + 4 + 4 + 8;
constexpr std::size_t kPerFd = 8 + 4;  // export id, fd number

struct shared_block {
  std::string bytes;        // what PyTorch carries
  ipc::export_handle h;     // owns the fds the bytes name
};

// One set of imported chunks and the imports on it.
struct set_key {
  pid_t pid = 0;
  std::uint64_t nonce = 0;
  int device = 0;
  std::vector<std::uint64_t> ids;
  bool operator<(const set_key& o) const {
    return std::tie(pid, nonce, device, ids) < std::tie(o.pid, o.nonce, o.device, o.ids);
  }
};
struct mapping;
using set_map = std::map<set_key, mapping*>;
struct mapping {
  ipc::imported m;
  std::uintptr_t base = 0;    // the first chunk here
  std::uint64_t bytes = 0;    // all its chunks
  std::size_t refs = 0;       // imports not yet closed
  std::optional<set_map::iterator> in_set;  // its entry in tables::by_set (none without export ids)
};
struct import_ref {
  mapping* m;
  std::size_t count;  // one block imported more than once: the same address each time
};

// Never destroyed: PyTorch frees shared tensors and drops imports during exit, after static
// destructors ran.
struct tables {
  std::mutex share_mu;
  std::unordered_map<const void*, shared_block> shares;  // live blocks shared, by address
  std::mutex import_mu;
  std::unordered_map<mapping*, std::unique_ptr<mapping>> mappings;
  set_map by_set;
  std::unordered_map<void*, import_ref> imports;  // by the address handed out
  std::uint64_t open_imports = 0;
};
tables& state() {
  static auto* t = new tables;
  return *t;
}
std::atomic<std::size_t> share_count{0};

// getrandom, not std::random_device: that may throw (a failing RDRAND), this cannot fail here.
std::uint64_t process_nonce() noexcept {
  static const std::uint64_t n = [] {
    std::uint64_t v = 0;
    if (::getrandom(&v, sizeof v, GRND_NONBLOCK) != static_cast<ssize_t>(sizeof v))
      v = static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
    return v ^ (static_cast<std::uint64_t>(::getpid()) << 32);
  }();
  return n;
}

template <class T>
void put(std::string& s, T v) {
  s.append(reinterpret_cast<const char*>(&v), sizeof v);
}
template <class T>
T get_at(const char* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

std::string errno_text(int e) { return std::string(std::strerror(e)); }

// A copy of fd `fd` of process `pid` (this process: dup). -1 + why.
int take_fd(int pidfd, pid_t pid, int fd, std::string& why) {
  int got = pid == ::getpid() ? ::dup(fd) : static_cast<int>(::syscall(SYS_pidfd_getfd, pidfd, fd, 0));
  if (got >= 0) return got;
  const int e = errno;
  why = "pidfd_getfd(pid " + std::to_string(pid) + ", fd " + std::to_string(fd) + "): " + errno_text(e);
  if (e == EPERM)
    why += " (the receiving process needs ptrace access to the sender: the same user, and where "
           "Yama's ptrace_scope is 1, the sender must be its descendant)";
  else if (e == ENOSYS)
    why += " (the kernel has no pidfd_getfd: Linux 5.6 or later is needed)";
  else if (e == EBADF)
    why += " (the sender no longer holds the block: it was freed before this import)";
  return -1;
}

}  // namespace

void forget_share(const void* ptr) noexcept {
  if (share_count.load(std::memory_order_acquire) == 0) return;
  tables& t = state();
  std::lock_guard g(t.share_mu);
  if (t.shares.erase(ptr)) share_count.fetch_sub(1, std::memory_order_release);
}

}  // namespace vmm::torch_lib

using namespace vmm::torch_lib;

extern "C" {

int64_t vmm_torch_share(const void* ptr, char* out, int64_t cap) try {
  if (!ptr || cap < 0 || (cap > 0 && !out)) {
    set_last_error("vmmalloc_torch: share: bad argument");
    return -1;
  }
  const int d = vmm_torch_device_of(ptr);
  vmm::allocator* a = d >= 0 ? existing_allocator(d) : nullptr;
  if (!a) {
    set_last_error("vmmalloc_torch: share: pointer not from vmmalloc");
    return -1;
  }
  tables& t = state();
  std::lock_guard g(t.share_mu);
  auto it = t.shares.find(ptr);
  if (it == t.shares.end()) {
    if (a->opts().ipc == vmm::ipc_kind::none) {
      set_last_error("vmmalloc_torch: share: device " + std::to_string(d) +
                     "'s memory is not exportable: set VMMALLOC_IPC=posix_fd before its first "
                     "allocation to share CUDA tensors with other processes");
      return -1;
    }
    shared_block s;
    if (vmm::status st = a->try_export_ipc(const_cast<void*>(ptr), s.h); !st.ok()) {
      set_last_error("vmmalloc_torch: share: " + vmm::last_error().message);
      return -1;
    }
    std::vector<std::uint8_t> body;
    if (vmm::status st = vmm::ipc::try_serialize(s.h, body); !st.ok()) {
      set_last_error("vmmalloc_torch: share: " + st.message());
      return -1;
    }
    s.bytes.append(kMagic, sizeof kMagic);
    put(s.bytes, kVersion);
    put(s.bytes, static_cast<std::int32_t>(::getpid()));
    put(s.bytes, static_cast<std::uint32_t>(s.h.fd_count()));
    put(s.bytes, process_nonce());
    for (const auto& c : s.h.chunks)
      if (c.handle.kind == vmm::ipc_kind::posix_fd) put(s.bytes, c.handle.export_id);
    for (const auto& c : s.h.chunks)
      if (c.handle.kind == vmm::ipc_kind::posix_fd) put(s.bytes, static_cast<std::int32_t>(c.handle.fd));
    s.bytes.append(reinterpret_cast<const char*>(body.data()), body.size());
    it = t.shares.emplace(ptr, std::move(s)).first;
    share_count.fetch_add(1, std::memory_order_release);
  }
  const std::string& b = it->second.bytes;
  if (static_cast<std::size_t>(cap) >= b.size()) std::memcpy(out, b.data(), b.size());
  return static_cast<int64_t>(b.size());
} catch (...) {  // bad_alloc
  set_last_error("vmmalloc_torch: share: out of host memory");
  return -1;
}

void* vmm_torch_import(int device, const char* bytes, int64_t n) try {
  if (!bytes || n < 0) {
    set_last_error("vmmalloc_torch: import: bad argument");
    return nullptr;
  }
  const auto len = static_cast<std::size_t>(n);
  if (len < kHeader || std::memcmp(bytes, kMagic, sizeof kMagic) != 0) {
    set_last_error("vmmalloc_torch: import: not a vmmalloc handle (the sender does not use vmmalloc, "
                   "or the bytes are damaged)");
    return nullptr;
  }
  const auto version = get_at<std::uint32_t>(bytes + 4);
  const auto pid = static_cast<pid_t>(get_at<std::int32_t>(bytes + 8));
  const auto nfd = get_at<std::uint32_t>(bytes + 12);
  if (version != kVersion || nfd > vmm::ipc::max_chunks || pid <= 0 || len < kHeader + kPerFd * nfd) {
    set_last_error("vmmalloc_torch: import: malformed handle (version " + std::to_string(version) + ", " +
                   std::to_string(nfd) + " fds, " + std::to_string(len) + " bytes)");
    return nullptr;
  }
  const char* ids = bytes + kHeader;
  const char* fds = ids + 8ull * nfd;
  vmm::ipc::export_handle h;
  std::string why;
  const char* body = fds + 4ull * nfd;
  if (!vmm::ipc::try_deserialize({reinterpret_cast<const std::uint8_t*>(body), len - (body - bytes)}, h, &why).ok()) {
    set_last_error("vmmalloc_torch: import: " + why);
    return nullptr;
  }
  if (h.fd_count() != nfd) {
    set_last_error("vmmalloc_torch: import: malformed handle (" + std::to_string(nfd) + " fds for " +
                   std::to_string(h.fd_count()) + " chunks)");
    return nullptr;
  }
  const std::uint64_t total = h.mapping_size();  // the deserialised handle's offset + size lie inside it
  const std::uint64_t offset = h.offset;
  set_key key;
  key.pid = pid;
  key.nonce = get_at<std::uint64_t>(bytes + 16);
  key.device = device;
  bool keyed = nfd > 0 && nfd == h.chunks.size();  // every chunk named by an export id
  key.ids.reserve(nfd);
  for (std::uint32_t i = 0; i < nfd; ++i) {
    key.ids.push_back(get_at<std::uint64_t>(ids + 8ull * i));
    keyed = keyed && key.ids.back() != 0;
  }
  tables& t = state();
  // Takes one more import on mapping m for this block; its address, or nullptr + why when the
  // handle does not fit the chunks m holds (forged: the same ids with other sizes).
  auto take = [&](mapping& m) -> void* {
    if (m.bytes != total) {
      set_last_error("vmmalloc_torch: import: malformed handle (its chunks hold " + std::to_string(total) +
                     " bytes; the same chunks imported before hold " + std::to_string(m.bytes) + ")");
      return nullptr;
    }
    auto* p = reinterpret_cast<void*>(m.base + offset);
    auto it = t.imports.try_emplace(p, import_ref{&m, 0}).first;  // may throw: nothing changed yet
    ++it->second.count;
    ++m.refs;
    ++t.open_imports;
    return p;
  };
  if (keyed) {
    std::lock_guard g(t.import_mu);
    if (auto it = t.by_set.find(key); it != t.by_set.end()) return take(*it->second);
  }

  vmm::allocator* a = allocator_of(device);  // its backend and peers (creates it if need be)
  vmm::backend_iface* be = a ? backend_of(device) : nullptr;
  if (!be) return nullptr;  // allocator_of said why
  int pidfd = -1;
  if (nfd && pid != ::getpid()) {
    pidfd = static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
    if (pidfd < 0) {
      const int e = errno;
      set_last_error("vmmalloc_torch: import: pidfd_open(pid " + std::to_string(pid) + "): " + errno_text(e) +
                     (e == ESRCH ? " (the sending process has exited)"
                                 : e == ENOSYS ? " (the kernel has no pidfd_open: Linux 5.3 or later is needed)" : ""));
      return nullptr;
    }
  }
  vmm::ipc::unique_fd pidfd_owner(pidfd);
  std::size_t k = 0;
  for (auto& c : h.chunks) {
    if (c.handle.kind != vmm::ipc_kind::posix_fd) continue;
    const int fd = get_at<std::int32_t>(fds + 4 * k++);
    c.handle.fd = take_fd(pidfd, pid, fd, why);
    if (c.handle.fd < 0) {  // h's destructor closes the copies taken so far
      set_last_error("vmmalloc_torch: import: " + why);
      return nullptr;
    }
  }
  vmm::ipc::import_options io;
  io.device = device;
  io.peers = a->opts().peers;  // the devices this process's tensors are readable from
  auto m = std::make_unique<mapping>();
  if (!vmm::ipc::try_import(*be, std::move(h), io, m->m, &why).ok()) {
    set_last_error("vmmalloc_torch: import on device " + std::to_string(device) + ": " + why);
    return nullptr;
  }
  m->base = reinterpret_cast<std::uintptr_t>(m->m.get()) - offset;
  m->bytes = total;
  std::unique_ptr<mapping> lost;  // another thread mapped the same chunks meanwhile: this one goes
  void* p = nullptr;
  {
    std::lock_guard g(t.import_mu);
    if (keyed)
      if (auto it = t.by_set.find(key); it != t.by_set.end()) {
        lost = std::move(m);
        p = take(*it->second);
      }
    if (!lost) {
      mapping& r = *m;
      auto [mit, ok] = t.mappings.emplace(&r, std::move(m));
      try {
        if (keyed) r.in_set = t.by_set.emplace(std::move(key), &r).first;
        p = take(r);
      } catch (...) {
        if (r.in_set) t.by_set.erase(*r.in_set);
        lost = std::move(mit->second);
        t.mappings.erase(mit);
        throw;  // lost's destructor unmaps
      }
    }
  }
  return p;
} catch (...) {  // bad_alloc
  set_last_error("vmmalloc_torch: import: out of host memory");
  return nullptr;
}

int vmm_torch_close_import(void* ptr) try {
  std::unique_ptr<mapping> last;
  {
    tables& t = state();
    std::lock_guard g(t.import_mu);
    auto it = t.imports.find(ptr);
    if (it == t.imports.end()) {
      set_last_error("vmmalloc_torch: close_import: not an imported pointer");
      return -1;
    }
    mapping* m = it->second.m;
    if (--it->second.count == 0) t.imports.erase(it);
    --t.open_imports;
    if (--m->refs == 0) {  // the last import on these chunks: unmapped below, outside the lock
      if (m->in_set) t.by_set.erase(*m->in_set);
      auto mit = t.mappings.find(m);
      last = std::move(mit->second);
      t.mappings.erase(mit);
    }
  }
  if (last)
    if (vmm::status st = last->m.close(); !st.ok()) {
      set_last_error("vmmalloc_torch: close_import: " + st.message());
      return -1;
    }
  return 0;
} catch (...) {
  return -1;
}

int vmm_torch_share_counts(uint64_t* shared, uint64_t* imported) {
  if (shared) *shared = share_count.load(std::memory_order_acquire);
  if (imported) {
    tables& t = state();
    std::lock_guard g(t.import_mu);
    *imported = t.open_imports;
  }
  return 0;
}

}  // extern "C"
