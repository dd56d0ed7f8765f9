// SPDX-License-Identifier: Apache-2.0
// CUDA <-> Vulkan on the GPU: vmmalloc memory written by Vulkan and read by CUDA (export), Vulkan
// memory adopted as a CUDA arena (import, dedicated and not), binary semaphores both ways, and a
// timeline semaphore holding a freed block back from other streams until Vulkan signals.
//
// Exits 77 (skipped) without a CUDA device, a Vulkan loader, an ICD or a Vulkan device with the CUDA
// device's UUID; VMM_VK_REQUIRE=1 makes that a failure. Every wait is bounded: a stuck stream or
// submission ends the program at once (exit 3) with a message, since tearing down behind a GPU
// that waits on a semaphore nobody will signal would hang (cudaFree synchronises the device).
#include <cuda_runtime.h>
#include <vulkan/vulkan.h>

#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

#include "vk_test_main.hpp"

using namespace std::chrono_literals;
using vmm::vk::buffer_kind;
using vmm::vk::external_arena;
using vmm::vk::external_semaphore;
using vmm::vk::semaphore_kind;
using vktest::ctx;

namespace {

constexpr std::uint64_t MiB = 1ull << 20;

#define CU(call)                                                                                       \
  do {                                                                                                 \
    const cudaError_t e_ = (call);                                                                     \
    REQUIRE_MESSAGE(e_ == cudaSuccess, #call << ": " << cudaGetErrorName(e_) << " " << cudaGetErrorString(e_)); \
  } while (0)

[[noreturn]] void stuck(const char* what) {
  std::printf("FAIL: %s did not finish in time; exiting now (teardown would hang on the GPU)\n", what);
  std::fflush(stdout);
  std::_Exit(3);
}

// cudaStreamQuery until done, at most `limit`.
void wait_stream(cudaStream_t s, const char* what, std::chrono::milliseconds limit = 10s) {
  const auto end = std::chrono::steady_clock::now() + limit;
  for (;;) {
    const cudaError_t e = cudaStreamQuery(s);
    if (e == cudaSuccess) return;
    if (e != cudaErrorNotReady) {
      std::printf("FAIL: cudaStreamQuery(%s): %s %s\n", what, cudaGetErrorName(e), cudaGetErrorString(e));
      std::fflush(stdout);
      std::_Exit(3);
    }
    if (std::chrono::steady_clock::now() > end) stuck(what);
    std::this_thread::sleep_for(100us);
  }
}

void wait_vk(vmm::vk::submission& s, const char* what) {
  if (!s.wait(10s)) stuck(what);
}

struct stream {
  cudaStream_t s = nullptr;
  stream() { CU(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)); }
  ~stream() {
    if (s) cudaStreamDestroy(s);
  }
  operator cudaStream_t() const { return s; }
  vmm::stream_t tag() const { return static_cast<vmm::stream_t>(s); }
};

std::vector<std::uint32_t> cuda_read(const void* p, std::uint64_t n) {
  std::vector<std::uint32_t> v(n / 4);
  CU(cudaMemcpy(v.data(), p, n, cudaMemcpyDeviceToHost));
  return v;
}

std::vector<std::uint32_t> vk_read(const vmm::vk::buffer& b, std::uint64_t off, std::uint64_t n) {
  auto host = ctx().create_buffer(n, buffer_kind::host_visible);
  auto s = ctx().submit([&](VkCommandBuffer cb) { ctx().cmd_copy(cb, b, off, host, 0, n); });
  wait_vk(s, "Vulkan read-back");
  std::vector<std::uint32_t> v(n / 4);
  std::memcpy(v.data(), host.mapped(), n);
  return v;
}

std::size_t count_not(const std::vector<std::uint32_t>& v, std::uint32_t x, std::size_t from = 0,
                      std::size_t to = SIZE_MAX) {
  std::size_t k = 0;
  for (std::size_t i = from; i < v.size() && i < to; ++i) k += v[i] != x;
  return k;
}

// If a check throws while CUDA or Vulkan waits on a timeline value only the host would signal, the
// destructors would wait forever (cudaFree synchronises the device): this signals it on the way out.
// Declared after everything that waits, so it runs first.
struct unblock {
  vmm::vk::semaphore& tl;
  std::uint64_t value;
  ~unblock() {
    try {
      if (tl.value() < value) tl.signal(value);
    } catch (...) {
    }
  }
};

bool fd_open(int fd) { return fd >= 0 && ::fcntl(fd, F_GETFD) != -1; }

bool overlap(const void* a, std::uint64_t an, const void* b, std::uint64_t bn) {
  auto x = reinterpret_cast<std::uintptr_t>(a), y = reinterpret_cast<std::uintptr_t>(b);
  return x < y + bn && y < x + an;
}

// An exportable Vulkan buffer imported into CUDA as an arena. The caller's fd is closed here after
// the import (the fd rule: it stayed ours), and the test checks it was still open.
external_arena arena_over(const vmm::vk::buffer& b) {
  const int fd = b.export_fd();
  REQUIRE(fd >= 0);
  external_arena a = external_arena::import(vmm::vk::cuda_external_api(0), fd, b.allocation_size(), b.dedicated());
  CHECK(fd_open(fd));
  ::close(fd);
  return a;
}

external_semaphore import_sem(const vmm::vk::semaphore& s) {
  const int fd = s.export_fd();
  REQUIRE(fd >= 0);
  external_semaphore e = external_semaphore::import(vmm::vk::cuda_external_api(0), fd, s.kind());
  CHECK(fd_open(fd));
  ::close(fd);
  return e;
}

}  // namespace

TEST_CASE("export: vmmalloc memory (ipc = posix_fd) written by Vulkan, read by CUDA, and back") {
  vmm::options o;
  o.ipc = vmm::ipc_kind::posix_fd;
  vmm::allocator a(o);
  const std::uint64_t n = 3 * MiB + 4096;  // not a chunk multiple: the allocation starts/ends inside chunks
  void* p = a.allocate(n);
  CU(cudaMemset(p, 0, n));
  CU(cudaDeviceSynchronize());
  vmm::ipc::export_handle h = a.export_ipc(p);
  REQUIRE(h.kind == vmm::ipc_kind::posix_fd);
  MESSAGE("export: " << h.chunks.size() << " chunk(s), offset " << h.offset << ", size " << h.size);
  {
    std::vector<vmm::vk::buffer> bufs = ctx().import_chunks(h);
    REQUIRE(bufs.size() == h.chunks.size());
    for (const auto& c : h.chunks) CHECK(fd_open(c.handle.fd));  // the handle keeps its fds
    // Vulkan writes the allocation's bytes, a different word per chunk.
    auto s = ctx().submit([&](VkCommandBuffer cb) {
      std::uint64_t left = n, start = h.offset;
      for (std::size_t i = 0; i < bufs.size() && left; ++i) {
        const std::uint64_t len = std::min<std::uint64_t>(h.chunks[i].size - start, left);
        ctx().cmd_fill(cb, bufs[i], start, len, 0xC0DE0000u | static_cast<std::uint32_t>(i));
        left -= len;
        start = 0;
      }
    });
    wait_vk(s, "Vulkan fill of vmmalloc memory");
    // CUDA reads it through vmmalloc's pointer.
    auto v = cuda_read(p, n);
    std::size_t bad = 0, at = 0;
    std::uint64_t left = n, start = h.offset;
    for (std::size_t i = 0; i < bufs.size() && left; ++i) {
      const std::uint64_t len = std::min<std::uint64_t>(h.chunks[i].size - start, left);
      bad += count_not(v, 0xC0DE0000u | static_cast<std::uint32_t>(i), at, at + len / 4);
      at += len / 4;
      left -= len;
      start = 0;
    }
    CHECK(bad == 0);
    // CUDA writes, Vulkan reads the first chunk's part of the allocation.
    CU(cudaMemset(p, 0x3C, n));
    CU(cudaDeviceSynchronize());
    const std::uint64_t first = std::min<std::uint64_t>(h.chunks[0].size - h.offset, n);
    CHECK(count_not(vk_read(bufs[0], h.offset, first), 0x3C3C3C3Cu) == 0);
  }  // Vulkan's imports are released before the allocation is freed
  h.close_fds();
  a.deallocate(p);
  CHECK(a.check() == "");
}

TEST_CASE("import: Vulkan memory adopted as an arena; Vulkan writes, CUDA reads, CUDA writes, Vulkan reads") {
  for (bool dedicated : {false, true}) {
    CAPTURE(dedicated);
    auto vb = ctx().create_buffer(8 * MiB, buffer_kind::exportable, dedicated);
    REQUIRE(vb.dedicated() >= dedicated);
    external_arena arena = arena_over(vb);
    REQUIRE(arena.size() == vb.allocation_size());
    CHECK(arena.dedicated() == vb.dedicated());
    stream s1;
    void* x = arena.allocate(MiB, 0, s1.tag());
    void* y = arena.allocate(300000, 0, s1.tag());
    const std::uint64_t ox = arena.offset_of(x), oy = arena.offset_of(y);
    const std::uint32_t vx = 0x11110000u + dedicated, vy = 0x22220000u + dedicated;
    auto s = ctx().submit([&](VkCommandBuffer cb) {
      ctx().cmd_fill(cb, vb, 0, vb.size(), 0);
      ctx().cmd_barrier(cb);
      ctx().cmd_fill(cb, vb, ox, MiB, vx);
      ctx().cmd_fill(cb, vb, oy, 300000, vy);
    });
    wait_vk(s, "Vulkan fill of the arena's memory");
    CHECK(count_not(cuda_read(x, MiB), vx) == 0);
    CHECK(count_not(cuda_read(y, 300000), vy) == 0);
    CU(cudaMemsetAsync(x, 0x7E, MiB, s1));
    wait_stream(s1, "CUDA memset of an arena block");
    CHECK(count_not(vk_read(vb, ox, MiB), 0x7E7E7E7Eu) == 0);
    CHECK(count_not(vk_read(vb, oy, 300000), vy) == 0);  // y untouched: offsets agree on both sides
    arena.deallocate(x, s1.tag());
    arena.deallocate(y, s1.tag());
    const auto st = arena.stats();
    MESSAGE("arena " << st.capacity << " B, frees " << st.frees << ", deferred " << st.deferred);
    CHECK(arena.check() == "");
    CHECK(arena.close().ok());  // cudaFree of the mapped buffer, then cudaDestroyExternalMemory
  }
}

TEST_CASE("binary semaphores: Vulkan fill -> CUDA wait, read, write, signal -> Vulkan wait, read") {
  REQUIRE_MESSAGE(ctx().info().semaphore_fd, "VK_KHR_external_semaphore_fd missing");
  auto vk_done = ctx().create_semaphore(semaphore_kind::binary);
  auto cuda_done = ctx().create_semaphore(semaphore_kind::binary);
  external_semaphore c_vk_done = import_sem(vk_done), c_cuda_done = import_sem(cuda_done);
  auto vb = ctx().create_buffer(4 * MiB, buffer_kind::exportable);
  external_arena arena = arena_over(vb);
  stream s1;
  void* x = arena.allocate(MiB, 0, s1.tag());
  const std::uint64_t ox = arena.offset_of(x);
  std::uint32_t* pinned = nullptr;
  CU(cudaMallocHost(&pinned, MiB));
  std::memset(pinned, 0, MiB);

  // Vulkan writes and signals; CUDA waits on the GPU, copies out, overwrites half, signals back.
  auto fill = ctx().submit([&](VkCommandBuffer cb) { ctx().cmd_fill(cb, vb, ox, MiB, 0xABABABABu); }, {},
                           {{&vk_done, 0}});
  c_vk_done.wait(0, s1.tag());
  CU(cudaMemcpyAsync(pinned, x, MiB, cudaMemcpyDeviceToHost, s1));
  CU(cudaMemsetAsync(x, 0xCD, MiB / 2, s1));
  c_cuda_done.signal(0, s1.tag());
  auto host = ctx().create_buffer(MiB, buffer_kind::host_visible);
  auto back = ctx().submit([&](VkCommandBuffer cb) { ctx().cmd_copy(cb, vb, ox, host, 0, MiB); },
                           {{&cuda_done, 0}});
  wait_stream(s1, "CUDA stream waiting on Vulkan's binary semaphore");
  wait_vk(fill, "Vulkan fill signalling the binary semaphore");
  wait_vk(back, "Vulkan copy waiting on CUDA's binary semaphore");
  std::vector<std::uint32_t> got(pinned, pinned + MiB / 4);
  CHECK(count_not(got, 0xABABABABu) == 0);  // CUDA saw Vulkan's fill
  std::vector<std::uint32_t> vk(MiB / 4);
  std::memcpy(vk.data(), host.mapped(), MiB);
  CHECK(count_not(vk, 0xCDCDCDCDu, 0, MiB / 8) == 0);  // Vulkan saw CUDA's write
  CHECK(count_not(vk, 0xABABABABu, MiB / 8) == 0);
  CU(cudaFreeHost(pinned));
  arena.deallocate(x, s1.tag());
}

TEST_CASE("timeline semaphore + release_after (arena): a block Vulkan still uses is not handed to another stream") {
  REQUIRE_MESSAGE(ctx().info().semaphore_fd, "VK_KHR_external_semaphore_fd missing");
  REQUIRE_MESSAGE(ctx().info().timeline, "timeline semaphores missing");
  auto tl = ctx().create_semaphore(semaphore_kind::timeline, 0);
  external_semaphore ctl = import_sem(tl);
  auto vb = ctx().create_buffer(4 * MiB, buffer_kind::exportable);
  external_arena arena = arena_over(vb);
  stream s1, s2;
  void* p = arena.allocate(MiB, 0, s1.tag());
  const std::uint64_t op = arena.offset_of(p);
  // Vulkan: waits for the host's value 1, writes p's block, signals 2. Nothing runs yet.
  auto vk = ctx().submit([&](VkCommandBuffer cb) { ctx().cmd_fill(cb, vb, op, MiB, 0xF00DF00Du); }, {{&tl, 1}},
                         {{&tl, 2}});
  unblock guard{tl, 1};  // value 1 lets Vulkan run, which signals the 2 that s1 waits for
  vmm::vk::release_after(ctl, 2, arena, p, s1.tag());
  CHECK(cudaStreamQuery(s1) == cudaErrorNotReady);  // s1 waits for value 2 on the GPU

  // s2 takes every 1 MiB block it can get: none may be p's while Vulkan has not signalled.
  std::vector<void*> got;
  while (void* q = arena.try_allocate(MiB, 0, s2.tag())) {
    CHECK_FALSE(overlap(q, MiB, p, MiB));
    got.push_back(q);
    CU(cudaMemsetAsync(q, 0x99, MiB, s2));
  }
  CHECK(got.size() == arena.size() / MiB - 1);
  CHECK(arena.stats().deferred == MiB);
  wait_stream(s2, "CUDA stream s2 (must not depend on s1)");
  CHECK(cudaStreamQuery(s1) == cudaErrorNotReady);
  CHECK_FALSE(vk.done());

  std::this_thread::sleep_for(100ms);
  tl.signal(1);  // the host lets Vulkan run: fill, then 2
  wait_vk(vk, "Vulkan fill behind the timeline");
  wait_stream(s1, "CUDA stream s1 waiting for timeline value 2");
  CHECK(tl.value() == 2);
  CHECK(count_not(cuda_read(p, MiB), 0xF00DF00Du) == 0);
  for (void* q : got) CHECK(count_not(cuda_read(q, MiB), 0x99999999u) == 0);  // Vulkan's fill stayed in p
  // The fence behind the wait has completed: p's block is free for s2 now.
  void* again = arena.allocate(MiB, 0, s2.tag());
  CHECK(again == p);
  got.push_back(again);
  for (void* q : got) arena.deallocate(q, s2.tag());
  wait_stream(s2, "s2");
  CHECK(arena.check() == "");
}

TEST_CASE("timeline semaphore + release_after (vmm::allocator): stream-ordered free behind the wait") {
  REQUIRE_MESSAGE(ctx().info().semaphore_fd, "VK_KHR_external_semaphore_fd missing");
  REQUIRE_MESSAGE(ctx().info().timeline, "timeline semaphores missing");
  auto tl = ctx().create_semaphore(semaphore_kind::timeline, 0);
  external_semaphore ctl = import_sem(tl);
  vmm::allocator a;
  stream s1, s2;
  std::uint64_t value = 0;
  for (std::uint64_t n : {MiB, std::uint64_t{4096}}) {
    CAPTURE(n);
    ++value;
    void* p = a.allocate(n, 0, s1.tag());
    CU(cudaMemsetAsync(p, 0x11, n, s1));
    unblock guard{tl, value};
    vmm::vk::release_after(ctl, value, a, p, s1.tag());
    CHECK(cudaStreamQuery(s1) == cudaErrorNotReady);
    std::vector<void*> got;
    for (int i = 0; i < 16; ++i) {
      void* q = a.allocate(n, 0, s2.tag());
      CHECK_FALSE(overlap(q, n, p, n));
      CU(cudaMemsetAsync(q, 0x22, n, s2));
      got.push_back(q);
    }
    wait_stream(s2, "s2 beside a waiting s1");
    CHECK(cudaStreamQuery(s1) == cudaErrorNotReady);
    tl.signal(value);
    wait_stream(s1, "s1 waiting for the timeline");
    for (void* q : got) a.deallocate(q, s2.tag());
  }
  wait_stream(s2, "s2");
  CHECK(a.check() == "");
}

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  if (!vktest::listing(argc, argv)) {
    int count = 0;
    const cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess || count == 0)
      return vktest::skip(std::string("no CUDA device: cudaGetDeviceCount: ") + cudaGetErrorName(e) +
                          " (count " + std::to_string(count) + ")");
    cudaDeviceProp prop{};
    int drv = 0, rt = 0;
    if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess || cudaSetDevice(0) != cudaSuccess) {
      std::printf("FAIL: CUDA device 0 unusable\n");
      return 1;
    }
    cudaDriverGetVersion(&drv);
    cudaRuntimeGetVersion(&rt);
    std::printf("CUDA: %s, cc %d.%d, driver %d, runtime %d\n", prop.name, prop.major, prop.minor, drv, rt);
  }
  return vktest::run(argc, argv, [] { return vmm::vk::context::open_for_cuda(0); });
}
