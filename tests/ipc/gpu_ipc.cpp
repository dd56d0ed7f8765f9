// SPDX-License-Identifier: Apache-2.0
// test_gpu_ipc: two processes share GPU memory through vmmalloc's IPC.
//
//   test_gpu_ipc [--consumer-device=D] [--ipc=posix_fd|fabric] [--iterations=N]
//
// The producer (this process) allocates with vmm::allocator (options.ipc = posix_fd or fabric) on
// device 0; a kernel writes a pattern; export_ipc + send_handle over a socketpair to a consumer,
// which is this same binary exec'd (--consumer=FD --device=D) BEFORE the producer initialises
// CUDA (CUDA and fork do not mix). The consumer imports with a cuda_backend on device D (D = 1:
// device 1 maps device 0's memory), verifies with a kernel, writes a reply pattern; the producer
// checks it. Then: latency of export + send + receive + import (median of N), and the exporter
// freeing (and reusing memory) while the importer still maps.
//
// Exit 0 = pass, 1 = fail, 77 = skipped (no device; D = 1 with fewer than two GPUs or no peer
// access; vmmalloc's CUDA backend unavailable).
#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "gpu_ipc_kernels.cuh"
#include "ipc_test_util.hpp"
#include "vmmalloc/cuda_backend.hpp"
#include "vmmalloc/ipc.hpp"
#include "vmmalloc/vmmalloc.hpp"

namespace {

constexpr int kSkip = 77;
constexpr int kTimeoutMs = 60000;
constexpr std::size_t MiB = std::size_t{1} << 20;

// Control messages between producer and consumer (same binary on both ends).
struct ctl {
  std::uint32_t cmd = 0;
  std::uint32_t pad = 0;
  std::uint64_t a = 0, b = 0, c = 0;
};

bool io_all(int sock, void* buf, std::size_t n, bool write) {
  auto* p = static_cast<char*>(buf);
  while (n) {
    pollfd pf{sock, static_cast<short>(write ? POLLOUT : POLLIN), 0};
    int r = ::poll(&pf, 1, kTimeoutMs);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    const ssize_t k = write ? ::send(sock, p, n, MSG_NOSIGNAL) : ::recv(sock, p, n, 0);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return false;
    p += k;
    n -= static_cast<std::size_t>(k);
  }
  return true;
}
bool send_ctl(int sock, std::uint32_t cmd, std::uint64_t a = 0, std::uint64_t b = 0, std::uint64_t c = 0) {
  ctl m;
  m.cmd = cmd;
  m.a = a;
  m.b = b;
  m.c = c;
  return io_all(sock, &m, sizeof(m), true);
}
bool recv_ctl(int sock, ctl& m, std::uint32_t want) {
  if (!io_all(sock, &m, sizeof(m), false)) {
    std::fprintf(stderr, "FAIL: no control message '%c' (peer gone or %d ms timeout)\n", static_cast<char>(want), kTimeoutMs);
    return false;
  }
  if (m.cmd != want) {
    std::fprintf(stderr, "FAIL: control message '%c', expected '%c'\n", static_cast<char>(m.cmd), static_cast<char>(want));
    return false;
  }
  return true;
}

double us_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
}
double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}
const char* kind_name(vmm::ipc_kind k) {
  return k == vmm::ipc_kind::fabric ? "fabric" : k == vmm::ipc_kind::posix_fd ? "posix_fd" : "none";
}

int failures = 0;
#define EXPECT(cond, ...)                                                   \
  do {                                                                      \
    if (cond) {                                                             \
      std::printf("  ok: " __VA_ARGS__);                                    \
      std::printf("\n");                                                    \
    } else {                                                                \
      ++failures;                                                           \
      std::printf("  FAIL (%s:%d: %s): ", __FILE__, __LINE__, #cond);       \
      std::printf(__VA_ARGS__);                                             \
      std::printf("\n");                                                    \
    }                                                                       \
    std::fflush(stdout);                                                    \
  } while (0)

// ---- consumer (exec'd) -------------------------------------------------------------------------

int consumer(int sock, int device) {
  using namespace vmm;
  ctl m;
  // The first message decides: 'Q' before anything means the producer skipped.
  if (!io_all(sock, &m, sizeof(m), false)) return kSkip;
  if (m.cmd == 'Q') return 0;
  ipcg::set_device(device);
  ipc::receive_options ro;
  ro.timeout_ms = kTimeoutMs;

  // Round 1: import with import_cuda, verify the producer's pattern, write the reply.
  if (m.cmd != 'V') return 1;
  {
    ipc::imported im = ipc::import_cuda(device, ipc::receive_handle(sock, ro));
    const std::uint64_t bad = ipcg::verify(im.get(), im.size(), m.a);
    ipcg::fill(im.get(), im.size(), m.b);
    const std::size_t size = im.size(), mapped = im.mapping_size();
    if (!im.close().ok()) return 1;
    if (!send_ctl(sock, 'R', bad, size, mapped)) return 1;
  }

  // One backend for the rest, as a long-lived consumer would keep.
  auto b = make_backend<cuda_backend>(device);
  ipc::import_options io;
  io.device = device;
  const int base_fds = ipct::fd_count();  // after CUDA's own fds are open
  for (;;) {
    if (!io_all(sock, &m, sizeof(m), false)) return 1;
    if (m.cmd == 'Q') {
      const int now = ipct::fd_count();
      std::printf("  consumer: open fds %d at start of the rounds, %d at the end\n", base_fds, now);
      if (now > base_fds) std::fprintf(stderr, "consumer: FAIL: %d fds leaked\n", now - base_fds);
      return now > base_fds ? 1 : 0;
    }
    if (m.cmd == 'L') {  // latency round: receive + import, ack, then close
      const auto t0 = std::chrono::steady_clock::now();
      ipc::imported im = ipc::import(*b, ipc::receive_handle(sock, ro), io);
      const double us = us_since(t0);
      if (!send_ctl(sock, 'A', static_cast<std::uint64_t>(us * 1000))) return 1;
      if (!im.close().ok()) return 1;
      if (!send_ctl(sock, 'K')) return 1;
    } else if (m.cmd == 'F') {  // lifetime: the exporter frees while we map
      ipc::imported im = ipc::import(*b, ipc::receive_handle(sock, ro), io);
      const std::uint64_t bad1 = ipcg::verify(im.get(), im.size(), m.a);
      if (!send_ctl(sock, 'I', bad1)) return 1;
      ctl g;
      if (!recv_ctl(sock, g, 'G')) return 1;
      const std::uint64_t bad2 = ipcg::verify(im.get(), im.size(), m.a);  // still the old bytes
      ipcg::fill(im.get(), im.size(), m.b);
      const std::uint64_t bad3 = ipcg::verify(im.get(), im.size(), m.b);
      const status cs = im.close();
      if (!cs.ok()) std::fprintf(stderr, "consumer: close: %s\n", cs.message().c_str());
      if (!send_ctl(sock, 'C', bad2, bad3, cs.ok() ? 1 : 0)) return 1;
    } else {
      std::fprintf(stderr, "consumer: unknown command %u\n", m.cmd);
      return 1;
    }
  }
}

// ---- producer ----------------------------------------------------------------------------------

int producer(int sock, pid_t child, int cdev, vmm::ipc_kind kind, int iterations) {
  using namespace vmm;
  auto quit = [&](int rc) {
    send_ctl(sock, 'Q');
    ::shutdown(sock, SHUT_RDWR);
    const int crc = ipct::reap(child, 30000);
    if (rc == 0 && crc != 0) {
      std::printf("FAIL: consumer exited with %d\n", crc);
      return 1;
    }
    return rc;
  };

  // CUDA starts only now, after the consumer was forked and exec'd.
  int n = 0;
  std::string why;
  if (!ipcg::device_count(n, why)) {
    std::printf("SKIP (exit 77): %s\n", why.c_str());
    return quit(kSkip);
  }
  if (cdev >= n) {
    std::printf("SKIP (exit 77): the consumer needs device %d; %d device(s) present\n", cdev, n);
    return quit(kSkip);
  }
  if (cdev != 0 && !ipcg::can_access_peer(cdev, 0)) {
    std::printf("SKIP (exit 77): device %d cannot access device 0's memory (no peer access)\n", cdev);
    return quit(kSkip);
  }
  {
    cuda_backend probe(0);
    if (!probe.available()) {
      const bool skip = probe.load_status().kind == errc::no_driver || probe.load_status().kind == errc::not_supported;
      std::printf("%s: vmmalloc's CUDA backend: %s\n", skip ? "SKIP (exit 77)" : "FAIL", probe.load_message().c_str());
      return quit(skip ? kSkip : 1);
    }
  }
  std::printf("producer: %s\nconsumer: %s (separate process)\n", ipcg::describe(0).c_str(),
              ipcg::describe(cdev).c_str());
  ipcg::set_device(0);

  options o;
  o.device = 0;
  o.ipc = kind;
  o.reservation_size = std::size_t{8} << 30;
  allocator a(o);

  // Round 1: producer kernel writes, consumer imports and verifies, writes back.
  std::printf("[1] producer kernel writes, consumer imports (import_cuda on device %d) and verifies\n", cdev);
  const std::size_t n1 = 6 * MiB + 4096 + 77;
  void* p = a.allocate(n1);
  ipcg::fill(p, n1, 101);
  ipc::export_handle h = a.export_ipc(p);
  const ipc_kind got = h.kind;
  const std::size_t chunks = h.chunks.size();
  const std::uint64_t mapping = h.mapping_size();
  std::printf("  handle: kind %s (asked %s), %zu chunk(s), %llu bytes mapped, offset %llu, size %llu\n",
              kind_name(got), kind_name(kind), chunks, static_cast<unsigned long long>(mapping),
              static_cast<unsigned long long>(h.offset), static_cast<unsigned long long>(h.size));
  if (kind == ipc_kind::fabric)
    std::printf("  fabric: %s (stats.ipc_fallbacks = %llu)\n",
                got == ipc_kind::fabric ? "exported as fabric handles" : "FELL BACK to POSIX fds",
                static_cast<unsigned long long>(a.stats().ipc_fallbacks));
  EXPECT(h.size == n1, "exported size %llu == allocation %zu", static_cast<unsigned long long>(h.size), n1);
  EXPECT(mapping % (2 * MiB) == 0 && mapping < h.offset + n1 + 2 * MiB,
         "mapping %llu bytes: whole 2 MiB chunks, no more than the allocation needs",
         static_cast<unsigned long long>(mapping));
  if (!send_ctl(sock, 'V', 101, 102)) return quit(1);
  ipc::send_handle(sock, h, {{}, kTimeoutMs});
  h.close_fds();
  ctl r;
  if (!recv_ctl(sock, r, 'R')) return quit(1);
  EXPECT(r.a == 0, "consumer verified the producer's pattern on device %d: %llu bad bytes of %zu", cdev,
         static_cast<unsigned long long>(r.a), n1);
  EXPECT(r.b == n1 && r.c == mapping, "consumer's import: size %llu, mapping %llu",
         static_cast<unsigned long long>(r.b), static_cast<unsigned long long>(r.c));
  const std::uint64_t back = ipcg::verify(p, n1, 102);
  EXPECT(back == 0, "producer sees the consumer's reply pattern: %llu bad bytes", static_cast<unsigned long long>(back));

  const int base_fds = ipct::fd_count();  // CUDA's own fds are open by now

  // Round 2: latency.
  std::printf("[2] latency, %d rounds\n", iterations);
  std::vector<double> exp_us, imp_us, total_us;
  for (int i = 0; i < iterations; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    ipc::export_handle hl = a.export_ipc(p);
    exp_us.push_back(us_since(t0));
    if (!send_ctl(sock, 'L')) return quit(1);
    ipc::send_handle(sock, hl, {{}, kTimeoutMs});
    ctl ack;
    if (!recv_ctl(sock, ack, 'A')) return quit(1);
    total_us.push_back(us_since(t0));
    imp_us.push_back(static_cast<double>(ack.a) / 1000);
    if (!recv_ctl(sock, ack, 'K')) return quit(1);
  }
  std::printf("  LATENCY (median of %d, %zu chunk(s) of %s, %.1f MiB): export_ipc %.1f us; consumer "
              "receive+import %.1f us; export+send+receive+import (to the consumer's ack) %.1f us\n",
              iterations, chunks, kind_name(got), static_cast<double>(mapping) / MiB, median(exp_us),
              median(imp_us), median(total_us));

  // Round 3: the exporter frees (and allocates again) while the importer maps.
  std::printf("[3] exporter frees while the importer maps\n");
  const std::size_t n3 = 3 * MiB + 5;
  void* q = a.allocate(n3);
  ipcg::fill(q, n3, 301);
  ipc::export_handle hq = a.export_ipc(q);
  const std::uint64_t qmap = hq.mapping_size();
  if (!send_ctl(sock, 'F', 301, 302)) return quit(1);
  ipc::send_handle(sock, hq, {{}, kTimeoutMs});
  hq.close_fds();
  ctl im;
  if (!recv_ctl(sock, im, 'I')) return quit(1);
  EXPECT(im.a == 0, "consumer imported and verified: %llu bad bytes", static_cast<unsigned long long>(im.a));
  a.deallocate(q);
  a.trim(0);
  void* q2 = a.allocate(n3);  // must not get the exported (still imported) memory
  ipcg::fill(q2, n3, 303);
  std::size_t free0 = 0, free1 = 0, total = 0;
  ipcg::mem_info(free0, total);
  if (!send_ctl(sock, 'G')) return quit(1);
  ctl c;
  if (!recv_ctl(sock, c, 'C')) return quit(1);
  ipcg::mem_info(free1, total);
  EXPECT(c.a == 0, "after the exporter freed, the importer still reads its bytes: %llu bad",
         static_cast<unsigned long long>(c.a));
  EXPECT(c.b == 0, "and writes its own: %llu bad", static_cast<unsigned long long>(c.b));
  EXPECT(c.c == 1, "importer's close succeeded");
  const std::uint64_t q2bad = ipcg::verify(q2, n3, 303);
  EXPECT(q2bad == 0, "the exporter's new allocation was not touched by the importer: %llu bad",
         static_cast<unsigned long long>(q2bad));
  const long long returned = static_cast<long long>(free1) - static_cast<long long>(free0);
  const bool report_only = std::getenv("VMM_GPU_SKIP_MEMINFO") && std::string(std::getenv("VMM_GPU_SKIP_MEMINFO")) == "1";
  std::printf("  device 0 memory returned when the importer closed: %.1f MiB (exported mapping %.1f MiB)\n",
              static_cast<double>(returned) / MiB, static_cast<double>(qmap) / MiB);
  if (!report_only)
    EXPECT(returned + static_cast<long long>(2 * MiB) >= static_cast<long long>(qmap),
           "the memory returned once both sides released it (cudaMemGetInfo)");
  a.deallocate(q2);
  a.deallocate(p);
  const int end_fds = ipct::fd_count();
  EXPECT(end_fds <= base_fds, "producer's open fds back to baseline after %d exports: %d -> %d", iterations + 1,
         base_fds, end_fds);
  const std::string chk = a.check();
  EXPECT(chk.empty(), "allocator invariants hold: %s", chk.empty() ? "ok" : chk.c_str());

  const int rc = quit(failures ? 1 : 0);
  std::printf("%s: %d failure(s)\n", rc == 0 ? "PASS" : "FAIL", failures);
  return rc;
}

}  // namespace

int main(int argc, char** argv) {
  int cdev = 0, consumer_fd = -1, device = 0, iterations = 20;
  vmm::ipc_kind kind = vmm::ipc_kind::posix_fd;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto val = [&](const char* flag) { return arg.substr(std::strlen(flag)); };
    if (arg.rfind("--consumer-device=", 0) == 0) cdev = std::atoi(val("--consumer-device=").c_str());
    else if (arg.rfind("--consumer=", 0) == 0) consumer_fd = std::atoi(val("--consumer=").c_str());
    else if (arg.rfind("--device=", 0) == 0) device = std::atoi(val("--device=").c_str());
    else if (arg.rfind("--iterations=", 0) == 0) iterations = std::max(1, std::atoi(val("--iterations=").c_str()));
    else if (arg == "--ipc=fabric") kind = vmm::ipc_kind::fabric;
    else if (arg == "--ipc=posix_fd") kind = vmm::ipc_kind::posix_fd;
    else {
      std::fprintf(stderr, "usage: %s [--consumer-device=D] [--ipc=posix_fd|fabric] [--iterations=N]\n", argv[0]);
      return 2;
    }
  }
  ::signal(SIGPIPE, SIG_IGN);
  try {
    if (consumer_fd >= 0) {
      ::alarm(120);  // never outlive a hung producer
      const int rc = consumer(consumer_fd, device);
      if (rc != 0 && rc != kSkip) std::fprintf(stderr, "consumer: failed (exit %d)\n", rc);
      return rc;
    }
    // Fork + exec the consumer before this process touches CUDA.
    auto [mine, theirs] = vmm::ipc::socket_pair();
    std::fflush(nullptr);
    const pid_t pid = ::fork();
    if (pid < 0) {
      std::perror("fork");
      return 1;
    }
    if (pid == 0) {
      ::fcntl(theirs.get(), F_SETFD, 0);  // the consumer inherits this end across exec
      const std::string a1 = "--consumer=" + std::to_string(theirs.get());
      const std::string a2 = "--device=" + std::to_string(cdev);
      ::execl("/proc/self/exe", argv[0], a1.c_str(), a2.c_str(), static_cast<char*>(nullptr));
      std::fprintf(stderr, "exec /proc/self/exe: %s\n", std::strerror(errno));
      ::_exit(127);
    }
    theirs.reset();
    ::alarm(240);
    try {
      return producer(mine.get(), pid, cdev, kind, iterations);
    } catch (const std::exception& e) {
      std::printf("FAIL: producer: %s\n", e.what());
      ::shutdown(mine.get(), SHUT_RDWR);  // the consumer sees EOF and exits
      ipct::reap(pid, 30000);
      return 1;
    }
  } catch (const std::exception& e) {
    std::printf("FAIL: %s: %s\n", consumer_fd >= 0 ? "consumer" : "producer", e.what());
    return 1;
  }
}
