// SPDX-License-Identifier: Apache-2.0
// Kernels of the IPC GPU test: pattern fill and verify (see gpu_ipc_kernels.cuh).
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "gpu_ipc_kernels.cuh"
#include "support/pattern_kernels.cuh"

namespace ipcg {

namespace {

void check(cudaError_t e, const char* what, const char* file, int line) {
  if (e == cudaSuccess) return;
  std::fprintf(stderr, "FAIL: %s at %s:%d: %s (%s)\n", what, file, line, cudaGetErrorName(e),
               cudaGetErrorString(e));
  std::fflush(stderr);
  std::exit(1);
}
#define IPCG_CHECK(call) check((call), #call, __FILE__, __LINE__)

__global__ void fill_kernel(unsigned char* p, std::size_t n, std::uint64_t seed) {
  vmm::test::write_pattern(p, n, seed);
}

__global__ void verify_kernel(const unsigned char* p, std::size_t n, std::uint64_t seed,
                              unsigned long long* bad) {
  const unsigned long long mine = vmm::test::count_mismatches(p, n, seed);
  if (mine) atomicAdd(bad, mine);
}

constexpr int kThreads = 256;
unsigned grid_for(std::size_t n) {
  const std::size_t words = (n + 7) / 8;
  const std::size_t blocks = (words + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < 1024 ? (blocks ? blocks : 1) : 1024);
}

}  // namespace

bool device_count(int& n, std::string& why) {
  n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    why = std::string("cudaGetDeviceCount: ") + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")";
    n = 0;
    return false;
  }
  if (n == 0) {
    why = "no CUDA device (count 0)";
    return false;
  }
  return true;
}

void set_device(int d) { IPCG_CHECK(cudaSetDevice(d)); }

bool can_access_peer(int device, int peer) {
  int ok = 0;
  IPCG_CHECK(cudaDeviceCanAccessPeer(&ok, device, peer));
  return ok != 0;
}

std::string describe(int d) {
  cudaDeviceProp prop{};
  IPCG_CHECK(cudaGetDeviceProperties(&prop, d));
  int drv = 0;
  IPCG_CHECK(cudaDriverGetVersion(&drv));
  char buf[512];
  std::snprintf(buf, sizeof(buf), "device %d: %s, cc %d.%d, %zu MiB, driver %d", d, prop.name, prop.major,
                prop.minor, static_cast<std::size_t>(prop.totalGlobalMem >> 20), drv);
  return buf;
}

void fill(void* p, std::size_t n, std::uint64_t seed) {
  fill_kernel<<<grid_for(n), kThreads>>>(static_cast<unsigned char*>(p), n, seed);
  IPCG_CHECK(cudaGetLastError());
  IPCG_CHECK(cudaDeviceSynchronize());
}

std::uint64_t verify(const void* p, std::size_t n, std::uint64_t seed) {
  unsigned long long* bad = nullptr;
  IPCG_CHECK(cudaMalloc(&bad, sizeof(*bad)));
  IPCG_CHECK(cudaMemset(bad, 0, sizeof(*bad)));
  verify_kernel<<<grid_for(n), kThreads>>>(static_cast<const unsigned char*>(p), n, seed, bad);
  IPCG_CHECK(cudaGetLastError());
  IPCG_CHECK(cudaDeviceSynchronize());
  unsigned long long h = 0;
  IPCG_CHECK(cudaMemcpy(&h, bad, sizeof(h), cudaMemcpyDeviceToHost));
  IPCG_CHECK(cudaFree(bad));
  return h;
}

void mem_info(std::size_t& free, std::size_t& total) { IPCG_CHECK(cudaMemGetInfo(&free, &total)); }

}  // namespace ipcg
