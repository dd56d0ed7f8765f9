// SPDX-License-Identifier: Apache-2.0
// Helpers of the IPC tests: patterns, fd and inode accounting through /proc, forked children that
// can never hang the run (alarm + bounded wait + SIGKILL), and an exporter that builds handles from
// host_backend chunks directly (what allocator::export_ipc does for an allocation).
#pragma once

#include <dirent.h>
#include <signal.h>
#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <poll.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <stdexcept>
#include <functional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "support/bulk_bytes.hpp"
#include "support/pattern.hpp"
#include "vmmalloc/ipc.hpp"

namespace ipct {

// The tests' pattern (support/pattern.hpp), a word at a time.
VMM_TEST_BULK inline void fill(void* p, std::size_t n, std::uint64_t seed) {
  auto* b = static_cast<std::uint8_t*>(p);
  for (std::size_t i = 0; i < n; i += 8) {
    const std::uint64_t w = vmm::test::pattern_word(seed, i / 8);
    for (std::size_t k = 0; k < 8 && i + k < n; ++k) b[i + k] = static_cast<std::uint8_t>(w >> (8 * k));
  }
}
// Bytes of [p, p + n) that differ from the pattern of seed.
VMM_TEST_BULK inline std::size_t mismatches(const void* p, std::size_t n, std::uint64_t seed) {
  auto* b = static_cast<const std::uint8_t*>(p);
  std::size_t bad = 0;
  for (std::size_t i = 0; i < n; i += 8) {
    const std::uint64_t w = vmm::test::pattern_word(seed, i / 8);
    for (std::size_t k = 0; k < 8 && i + k < n; ++k) bad += b[i + k] != static_cast<std::uint8_t>(w >> (8 * k));
  }
  return bad;
}

// Open file descriptors of this process (the directory's own fd is not counted).
inline int fd_count() {
  DIR* d = ::opendir("/proc/self/fd");
  if (!d) return -1;
  int n = 0;
  while (dirent* e = ::readdir(d))
    if (e->d_name[0] != '.') ++n;
  ::closedir(d);
  return n - 1;
}

// A memfd's identity (device + inode of the kernel's internal shmem mount).
struct file_id {
  dev_t dev = 0;
  ino_t ino = 0;
};
inline file_id inode_of(int fd) {
  struct stat st {};
  return ::fstat(fd, &st) == 0 ? file_id{st.st_dev, st.st_ino} : file_id{};
}

// References process `pid` holds to memfd inode `ino`: open fds plus mappings. When no process
// holds one, the kernel frees the memory: that is "the memory returns".
inline int inode_refs(pid_t pid, file_id id) {
  int refs = 0;
  const std::string base = "/proc/" + std::to_string(pid);
  if (DIR* d = ::opendir((base + "/fd").c_str())) {
    while (dirent* e = ::readdir(d)) {
      if (e->d_name[0] == '.') continue;
      struct stat st {};
      if (::stat((base + "/fd/" + e->d_name).c_str(), &st) == 0 && st.st_ino == id.ino && st.st_dev == id.dev)
        ++refs;
    }
    ::closedir(d);
  }
  std::ifstream maps(base + "/maps");
  std::string line;
  while (std::getline(maps, line)) {
    std::istringstream is(line);
    std::string range, perms, off, dev;
    unsigned long long inode = 0;
    is >> range >> perms >> off >> dev >> inode;
    if (inode == id.ino && line.find("memfd:") != std::string::npos) ++refs;
  }
  return refs;
}

// A child process running fn; exit code = fn's result. alarm() bounds it even if the parent dies.
inline pid_t spawn(const std::function<int()>& fn, unsigned alarm_s = 30) {
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::alarm(alarm_s);
    int rc = 99;
    try {
      rc = fn();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "child %d: exception: %s\n", ::getpid(), e.what());
      rc = 98;
    } catch (...) {
      rc = 97;
    }
    std::fflush(nullptr);
    ::_exit(rc);
  }
  return pid;
}

// Waits for pid at most timeout_ms, then SIGKILLs and reaps it (never leaves a zombie).
// Returns the exit code, 128 + signal for a signalled child, or -1 when it had to be killed.
inline int reap(pid_t pid, int timeout_ms = 20000) {
  int st = 0;
  for (int waited = 0;; waited += 5) {
    const pid_t r = ::waitpid(pid, &st, WNOHANG);
    if (r == pid) break;
    if (r < 0 && errno != EINTR) return -2;
    if (waited >= timeout_ms) {
      std::fprintf(stderr, "child %d did not finish in %d ms: killed\n", pid, timeout_ms);
      ::kill(pid, SIGKILL);
      while (::waitpid(pid, &st, 0) < 0 && errno == EINTR) {
      }
      return -1;
    }
    ::usleep(5000);
  }
  if (WIFEXITED(st)) return WEXITSTATUS(st);
  if (WIFSIGNALED(st)) return 128 + WTERMSIG(st);
  return -3;
}

// One control byte each way, with a timeout (false on timeout, EOF or error).
inline bool put(int sock, char c) {
  for (;;) {
    const ssize_t r = ::send(sock, &c, 1, MSG_NOSIGNAL);
    if (r == 1) return true;
    if (r < 0 && errno == EINTR) continue;
    return false;
  }
}
inline bool get(int sock, char& c, int timeout_ms = 10000) {
  pollfd p{sock, POLLIN, 0};
  int r;
  do r = ::poll(&p, 1, timeout_ms);
  while (r < 0 && errno == EINTR);
  if (r <= 0) return false;
  do r = static_cast<int>(::recv(sock, &c, 1, 0));
  while (r < 0 && errno == EINTR);
  return r == 1;
}
inline bool expect(int sock, char want, int timeout_ms = 10000) {
  char c = 0;
  if (!get(sock, c, timeout_ms)) return false;
  if (c != want) std::fprintf(stderr, "expected control byte '%c', got '%c'\n", want, c);
  return c == want;
}

// In a child: report a failed expectation and give the line as the exit code's reason.
#define CHILD_REQUIRE(cond)                                                                  \
  do {                                                                                       \
    if (!(cond)) {                                                                           \
      std::fprintf(stderr, "child %d: %s:%d: CHILD_REQUIRE(%s) failed\n", ::getpid(), __FILE__, \
                   __LINE__, #cond);                                                         \
      return 1;                                                                              \
    }                                                                                        \
  } while (0)

// An "allocation" made of whole host_backend chunks, as the allocator lays one out under an ipc
// policy: a reservation, chunks mapped back to back, the allocation at `offset` in the first.
// The bytes outside [offset, offset + size) are filled with `outside` (they belong to the chunks,
// so an importer sees them; they must never belong to another allocation).
struct host_allocation {
  vmm::backend_iface& b;
  std::vector<std::pair<vmm::mem_handle, std::size_t>> chunks;
  std::uintptr_t base = 0;
  std::size_t total = 0, offset = 0, size = 0;

  host_allocation(vmm::backend_iface& be, std::vector<std::size_t> sizes, std::size_t off, std::size_t n,
                  std::uint64_t seed, std::uint8_t outside = 0x5A)
      : b(be), offset(off), size(n) {
    for (auto s : sizes) total += s;
    auto g = b.granularity({});
    auto r = b.reserve(total, g.value.minimum);
    if (!r.ok()) throw std::runtime_error("reserve: " + r.st.message());
    base = r.value;
    std::uintptr_t va = base;
    for (auto s : sizes) {
      vmm::chunk_props p;
      p.ipc = vmm::ipc_kind::posix_fd;
      auto h = b.create(s, p);
      if (!h.ok()) throw std::runtime_error("create: " + h.st.message());
      if (auto st = b.map(va, s, h.value, 0); !st.ok()) throw std::runtime_error("map: " + st.message());
      chunks.emplace_back(h.value, s);
      va += s;
    }
    const vmm::access_desc rw{0, vmm::access_mode::read_write};
    if (auto st = b.set_access(base, total, {&rw, 1}); !st.ok()) throw std::runtime_error("set_access");
    std::memset(reinterpret_cast<void*>(base), outside, total);
    ipct::fill(ptr(), size, seed);
  }
  ~host_allocation() { free(); }
  void* ptr() const { return reinterpret_cast<void*>(base + offset); }

  // What export_ipc returns: dup'ed fds of every chunk, the offset and the size.
  vmm::ipc::export_handle export_handle(vmm::ipc_kind kind = vmm::ipc_kind::posix_fd) {
    vmm::ipc::export_handle h;
    h.kind = kind;
    h.device = 0;
    h.size = size;
    h.offset = offset;
    for (auto [mh, s] : chunks) {
      auto sh = b.export_handle(mh, vmm::ipc_kind::posix_fd);
      if (!sh.ok()) throw std::runtime_error("export: " + sh.st.message());
      h.chunks.push_back({s, sh.value});
    }
    return h;
  }
  std::vector<file_id> inodes() const {
    std::vector<file_id> v;
    for (auto [mh, s] : chunks) {  // an export is a dup of the chunk's file
      auto sh = b.export_handle(mh, vmm::ipc_kind::posix_fd);
      if (!sh.ok()) throw std::runtime_error("export: " + sh.st.message());
      v.push_back(inode_of(sh.value.fd));
      ::close(sh.value.fd);
    }
    return v;
  }
  // The exporter frees: unmaps, releases its handles, frees its reservation.
  void free() {
    if (!base) return;
    std::uintptr_t va = base;
    for (auto [mh, s] : chunks) {
      b.unmap(va, s);
      va += s;
    }
    for (auto [mh, s] : chunks) b.release(mh);
    b.free_reservation(base, total);
    chunks.clear();
    base = 0;
  }
};

}  // namespace ipct
