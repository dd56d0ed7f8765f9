// SPDX-License-Identifier: Apache-2.0
// GPU tests of the policies. main() is gpu_main.cpp: without a device this exits 77.
//
//   compression  require: kernels write and read compressible memory; stats count its bytes
//   fabric       ipc = fabric exports fabric handles, or falls back to POSIX fds (counted)
//   peer         (two GPUs, ctest gpu.peer with VMM_GPU_MIN_DEVICES=2) memory of device 0 is
//                written by a kernel on device 1 when granted read-write, read by one when
//                granted read-only; cuMemGetAccess follows grant and revoke
#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "gpu_util.cuh"
#include "vmmalloc/cuda_backend.hpp"
#include "vmmalloc/ipc.hpp"
#include "vmmalloc/vmmalloc.hpp"

namespace {
constexpr std::size_t MiB = std::size_t{1} << 20, GiB = std::size_t{1} << 30;
constexpr unsigned long long kNone = 0, kRead = 1, kReadWrite = 3;  // CU_MEM_ACCESS_FLAGS_PROT_*

vmm::options test_options() {
  vmm::options o;
  o.reservation_size = 16 * GiB;
  return o;
}

// Bytes of host copy `h` that differ from the pattern of seed.
std::size_t host_mismatches(const std::vector<std::uint8_t>& h, std::uint64_t seed) {
  std::size_t bad = 0;
  for (std::size_t i = 0; i < h.size(); ++i) bad += h[i] != gpu::pattern_byte(seed, i);
  return bad;
}
}  // namespace

TEST_CASE("gpu policy: compression require: kernels write and read compressible memory; stats count it") {
  bool supported;
  {
    vmm::cuda_backend probe(0);
    supported = probe.capabilities() & vmm::cap_compression;
  }
  vmm::options o = test_options();
  o.compression = vmm::compression_mode::require;
  if (!supported) {
    MESSAGE("device 0 has no generic compression: require must refuse");
    CHECK_THROWS_AS(vmm::allocator{o}, vmm::error);
    return;
  }
  vmm::allocator a(o);
  const std::size_t n = 256 * MiB;
  void* big = a.allocate(n);
  void* small = a.allocate(10000);
  gpu::fill(big, n, 21);
  gpu::fill(small, 10000, 22);
  CHECK(gpu::verify(big, n, 21) == 0);
  CHECK(gpu::verify(small, 10000, 22) == 0);
  // Zeros compress: write them, read them back.
  GPU_CHECK(cudaMemset(big, 0, n));
  std::vector<std::uint8_t> h(4 * MiB, 0xff);
  GPU_CHECK(cudaMemcpy(h.data(), static_cast<char*>(big) + n - h.size(), h.size(), cudaMemcpyDeviceToHost));
  bool zeros = true;
  for (auto b : h) zeros &= b == 0;
  CHECK(zeros);
  auto s = a.stats();
  MESSAGE("compressible: mapped " << (s.mapped >> 20) << " MiB, granted compressible " << (s.compressed >> 20)
                                  << " MiB, fallbacks " << s.compression_fallbacks);
  CHECK(s.compression_fallbacks == 0);
  CHECK(s.compressed == s.mapped);
  CHECK(s.compressed >= n);
  a.deallocate(big);
  a.deallocate(small);
  CHECK(a.check() == "");

  // prefer on the same device is granted too (no fallback), plain memory never shares a chunk:
  // each allocator has its own reservation and chunks.
  o.compression = vmm::compression_mode::prefer;
  vmm::allocator b(o);
  void* p = b.allocate(8 * MiB);
  gpu::fill(p, 8 * MiB, 23);
  CHECK(gpu::verify(p, 8 * MiB, 23) == 0);
  CHECK(b.stats().compression_fallbacks == 0);
  CHECK(b.stats().compressed == b.stats().mapped);
  b.deallocate(p);
}

TEST_CASE("gpu policy: ipc = fabric exports fabric handles or falls back to POSIX fds, counted") {
  vmm::options o = test_options();
  o.ipc = vmm::ipc_kind::fabric;
  vmm::allocator a(o);
  void* p = a.allocate(10 * MiB);
  gpu::fill(p, 10 * MiB, 31);
  auto h = a.export_ipc(p);
  auto s = a.stats();
  MESSAGE("fabric policy: export kind " << std::string(h.kind == vmm::ipc_kind::fabric ? "fabric" : "posix_fd")
                                         << ", ipc_fallbacks " << s.ipc_fallbacks << ", chunks "
                                         << h.chunks.size());
  REQUIRE(!h.chunks.empty());
  std::uint64_t total = 0;
  for (auto& c : h.chunks) total += c.size;
  CHECK(total >= 10 * MiB);
  CHECK(h.size == 10 * MiB);
  if (h.kind == vmm::ipc_kind::posix_fd) {
    CHECK(s.ipc_fallbacks == 1);
    for (auto& c : h.chunks) CHECK(c.handle.fd >= 0);
  } else {
    CHECK(h.kind == vmm::ipc_kind::fabric);
    CHECK(s.ipc_fallbacks == 0);
    bool nonzero = false;
    for (auto b : h.chunks[0].handle.fabric) nonzero |= b != 0;
    CHECK(nonzero);
  }
  CHECK(gpu::verify(p, 10 * MiB, 31) == 0);
  a.deallocate(p);
  CHECK(a.stats().exported_released == 1);
}

TEST_CASE("gpu peer: device 1 writes when granted read-write, reads when read-only; cuMemGetAccess follows") {
  REQUIRE(gpu::device_count() >= 2);
  int can = 0;
  GPU_CHECK(cudaDeviceCanAccessPeer(&can, 1, 0));
  REQUIRE_MESSAGE(can, "device 1 cannot access device 0");
  vmm::options o = test_options();
  o.device = 0;
  vmm::allocator a(o);
  const std::size_t n = 16 * MiB;
  void* p = a.allocate(n);
  void* q = a.allocate(3 * MiB + 512);
  CHECK(gpu::mem_access_flags(p, 0) == kReadWrite);
  CHECK(gpu::mem_access_flags(p, 1) == kNone);  // per allocation: nothing granted yet

  // read-write: a kernel on device 1 writes, device 0 verifies
  a.grant(1, vmm::access_mode::read_write);
  CHECK(gpu::mem_access_flags(p, 1) == kReadWrite);
  CHECK(gpu::mem_access_flags(q, 1) == kReadWrite);
  GPU_CHECK(cudaSetDevice(1));
  gpu::fill(p, n, 41);
  GPU_CHECK(cudaDeviceSynchronize());
  GPU_CHECK(cudaSetDevice(0));
  CHECK(gpu::verify(p, n, 41) == 0);

  // read-only: device 0 writes, a kernel on device 1 reads into its own memory
  a.grant(1, vmm::access_mode::read);
  CHECK(gpu::mem_access_flags(p, 1) == kRead);
  CHECK(gpu::mem_access_flags(p, 0) == kReadWrite);
  gpu::fill(p, n, 42);
  GPU_CHECK(cudaDeviceSynchronize());
  GPU_CHECK(cudaSetDevice(1));
  void* dst = nullptr;
  GPU_CHECK(cudaMalloc(&dst, n));
  gpu::copy_words(dst, p, n);
  std::vector<std::uint8_t> h(n);
  GPU_CHECK(cudaMemcpy(h.data(), dst, n, cudaMemcpyDeviceToHost));
  GPU_CHECK(cudaFree(dst));
  GPU_CHECK(cudaSetDevice(0));
  CHECK(host_mismatches(h, 42) == 0);

  // a mapping made after the grant carries it
  void* r = a.allocate(40 * MiB);
  CHECK(gpu::mem_access_flags(r, 1) == kRead);

  a.revoke(1);
  CHECK(gpu::mem_access_flags(p, 1) == kNone);
  CHECK(gpu::mem_access_flags(q, 1) == kNone);
  CHECK(gpu::mem_access_flags(r, 1) == kNone);
  CHECK(gpu::mem_access_flags(p, 0) == kReadWrite);
  void* t = a.allocate(5 * MiB);
  CHECK(gpu::mem_access_flags(t, 1) == kNone);
  CHECK(a.stats().access_changes == 3);
  CHECK_THROWS_AS(a.revoke(0), vmm::error);
  for (void* x : {p, q, r, t}) a.deallocate(x);
  CHECK(a.check() == "");
}
