// SPDX-License-Identifier: Apache-2.0
// Kernels and host wrappers of the GPU tests; see gpu_util.cuh.
#include "gpu_util.cuh"

#include <cuda.h>

#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <vector>

#include "support/pattern_kernels.cuh"

namespace gpu {
namespace {

constexpr int kThreads = 256;
constexpr std::size_t kMaxBlocks = 8192;   // grid-stride beyond this
constexpr int kSpinBlocks = 16;            // leaves most SMs to other streams
constexpr int kCounters = 256;             // > threads that verify at once; more wait
constexpr std::size_t kScratch = 4096;

__device__ __forceinline__ std::uint64_t global_ns() {
  std::uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void fill_kernel(unsigned char* p, std::size_t n, std::uint64_t seed) {
  vmm::test::write_pattern(p, n, seed);
}

__global__ void spin_fill_kernel(unsigned char* p, std::size_t n, std::uint64_t seed,
                                 std::uint64_t ns) {
  const std::uint64_t t0 = global_ns();
  do {
    vmm::test::write_pattern(p, n, seed);  // at least one whole pass, the last one after the deadline
  } while (global_ns() - t0 < ns);
}

__global__ void verify_kernel(const unsigned char* p, std::size_t n, std::uint64_t seed,
                              unsigned long long* mismatches) {
  const unsigned long long bad = vmm::test::count_mismatches(p, n, seed);
  if (bad) atomicAdd(mismatches, bad);
}

__global__ void copy_kernel(std::uint64_t* dst, const std::uint64_t* src, std::size_t words) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t w = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; w < words; w += stride)
    dst[w] = src[w];
}

unsigned grid_for(std::size_t n, std::size_t max_blocks) {
  const std::size_t words = (n + 7) / 8;
  const std::size_t blocks = (words + kThreads - 1) / kThreads;
  return static_cast<unsigned>(std::clamp<std::size_t>(blocks, 1, max_blocks));
}

// Counters for verify(): one cudaMalloc at init, handed out one per verify() in flight.
struct state {
  std::mutex m;
  std::condition_variable cv;
  bool ready = false;
  unsigned long long* counters = nullptr;  // kCounters counters, then kScratch bytes
  std::vector<int> free_slots;
  std::vector<cudaStream_t> streams;
};

state& st() {
  static state* s = new state;  // never destroyed: usable from any thread until exit
  return *s;
}

int acquire_counter() {
  state& s = st();
  std::unique_lock lk(s.m);
  if (!s.ready) {
    std::fprintf(stderr, "gpu_util: init() was not called\n");
    std::abort();
  }
  s.cv.wait(lk, [&] { return !s.free_slots.empty(); });
  int i = s.free_slots.back();
  s.free_slots.pop_back();
  return i;
}

void release_counter(int i) {
  state& s = st();
  {
    std::lock_guard lk(s.m);
    s.free_slots.push_back(i);
  }
  s.cv.notify_one();
}

}  // namespace

void check(cudaError_t e, const char* what, const char* file, int line) {
  if (e == cudaSuccess) return;
  std::fprintf(stderr, "\nCUDA error: %s\n  at %s:%d\n  -> %s (%d): %s\n", what, file, line,
               cudaGetErrorName(e), static_cast<int>(e), cudaGetErrorString(e));
  std::fflush(stderr);
  std::abort();
}

bool has_device(std::string* why) {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    if (why)
      *why = std::string("cudaGetDeviceCount: ") + cudaGetErrorName(e) + " (" +
             cudaGetErrorString(e) + ")";
    (void)cudaGetLastError();  // not sticky; clear it anyway
    return false;
  }
  if (n <= 0) {
    if (why) *why = "no CUDA device (cudaGetDeviceCount returned 0)";
    return false;
  }
  return true;
}

void init() {
  state& s = st();
  std::lock_guard lk(s.m);
  if (s.ready) return;
  GPU_CHECK(cudaSetDevice(0));
  GPU_CHECK(cudaFree(nullptr));  // creates the primary context now
  void* mem = nullptr;
  GPU_CHECK(cudaMalloc(&mem, kCounters * sizeof(unsigned long long) + kScratch));
  s.counters = static_cast<unsigned long long*>(mem);
  s.free_slots.clear();
  for (int i = kCounters - 1; i >= 0; --i) s.free_slots.push_back(i);
  s.streams.resize(stream_pool_size);
  for (auto& x : s.streams) GPU_CHECK(cudaStreamCreateWithFlags(&x, cudaStreamNonBlocking));
  // Load every kernel now (CUDA_MODULE_LOADING=LAZY loads on first launch).
  auto* scratch = reinterpret_cast<unsigned char*>(s.counters + kCounters);
  fill_kernel<<<1, kThreads>>>(scratch, kScratch, 1);
  GPU_CHECK_LAUNCH("fill_kernel (warm-up)");
  spin_fill_kernel<<<1, kThreads>>>(scratch, kScratch, 2, 0);
  GPU_CHECK_LAUNCH("spin_fill_kernel (warm-up)");
  GPU_CHECK(cudaMemset(s.counters, 0, sizeof(unsigned long long)));
  verify_kernel<<<1, kThreads>>>(scratch, kScratch, 2, s.counters);
  GPU_CHECK_LAUNCH("verify_kernel (warm-up)");
  unsigned long long bad = ~0ull;
  GPU_CHECK(cudaMemcpy(&bad, s.counters, sizeof bad, cudaMemcpyDeviceToHost));
  GPU_CHECK(cudaDeviceSynchronize());
  if (bad != 0) {
    std::fprintf(stderr, "gpu_util: self-test failed: %llu mismatching bytes in scratch\n", bad);
    std::abort();
  }
  s.ready = true;
}

void verify_into(const void* p, std::size_t n, std::uint64_t seed, unsigned long long* counter,
                 cudaStream_t s) {
  verify_kernel<<<grid_for(n, kMaxBlocks), kThreads, 0, s>>>(static_cast<const unsigned char*>(p), n, seed,
                                                               counter);
  GPU_CHECK_LAUNCH("verify_kernel (verify_into)");
}

void shutdown() {
  state& s = st();
  std::lock_guard lk(s.m);
  if (!s.ready) return;
  GPU_CHECK(cudaDeviceSynchronize());
  for (auto x : s.streams) GPU_CHECK(cudaStreamDestroy(x));
  s.streams.clear();
  GPU_CHECK(cudaFree(s.counters));
  s.counters = nullptr;
  s.free_slots.clear();
  s.ready = false;
}

void fill(void* p, std::size_t n, std::uint64_t seed, cudaStream_t s) {
  if (n == 0) return;
  fill_kernel<<<grid_for(n, kMaxBlocks), kThreads, 0, s>>>(static_cast<unsigned char*>(p), n, seed);
  GPU_CHECK_LAUNCH("fill_kernel launch");
}

void spin_fill(void* p, std::size_t n, std::uint64_t seed, std::uint64_t ns, cudaStream_t s) {
  if (n == 0) return;
  spin_fill_kernel<<<grid_for(n, kSpinBlocks), kThreads, 0, s>>>(static_cast<unsigned char*>(p), n,
                                                                 seed, ns);
  GPU_CHECK_LAUNCH("spin_fill_kernel launch");
}

std::uint64_t verify(const void* p, std::size_t n, std::uint64_t seed, cudaStream_t s) {
  if (n == 0) return 0;
  const int slot = acquire_counter();
  unsigned long long* counter = st().counters + slot;
  unsigned long long bad = 0;
  GPU_CHECK(cudaMemsetAsync(counter, 0, sizeof *counter, s));
  verify_kernel<<<grid_for(n, kMaxBlocks), kThreads, 0, s>>>(static_cast<const unsigned char*>(p),
                                                             n, seed, counter);
  GPU_CHECK_LAUNCH("verify_kernel launch");
  GPU_CHECK(cudaMemcpyAsync(&bad, counter, sizeof bad, cudaMemcpyDeviceToHost, s));
  GPU_CHECK(cudaStreamSynchronize(s));
  release_counter(slot);
  return bad;
}

void device_memory(std::size_t& free, std::size_t& total) {
  GPU_CHECK(cudaMemGetInfo(&free, &total));
}

cudaStream_t stream(int i) {
  state& s = st();
  std::lock_guard lk(s.m);
  if (!s.ready) {
    std::fprintf(stderr, "gpu_util: init() was not called\n");
    std::abort();
  }
  return s.streams[static_cast<std::size_t>(i < 0 ? -i : i) % s.streams.size()];
}

std::string describe_device() {
  int dev = 0, rt = 0, drv = 0;
  GPU_CHECK(cudaGetDevice(&dev));
  cudaDeviceProp prop{};
  GPU_CHECK(cudaGetDeviceProperties(&prop, dev));
  GPU_CHECK(cudaRuntimeGetVersion(&rt));
  GPU_CHECK(cudaDriverGetVersion(&drv));
  char buf[512];
  std::snprintf(buf, sizeof buf, "%s, cc %d.%d, %zu MiB, %d SMs, runtime %d, driver API %d",
                prop.name, prop.major, prop.minor, prop.totalGlobalMem >> 20,
                prop.multiProcessorCount, rt, drv);
  return buf;
}

std::uint64_t env_u64(const char* name, std::uint64_t fallback) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  char* end = nullptr;
  unsigned long long x = std::strtoull(v, &end, 0);
  if (end == v || *end) {
    std::fprintf(stderr, "gpu tests: %s=%s is not a number; using %llu\n", name, v,
                 static_cast<unsigned long long>(fallback));
    return fallback;
  }
  return x;
}

bool skip_meminfo_checks() { return env_u64("VMM_GPU_SKIP_MEMINFO", 0) != 0; }

void copy_words(void* dst, const void* src, std::size_t n, cudaStream_t s) {
  if (n % 8) {
    std::fprintf(stderr, "gpu::copy_words: n (%zu) is not a multiple of 8\n", n);
    std::abort();
  }
  copy_kernel<<<grid_for(n, 1024), kThreads, 0, s>>>(static_cast<std::uint64_t*>(dst),
                                                     static_cast<const std::uint64_t*>(src), n / 8);
  GPU_CHECK_LAUNCH("copy_kernel");
  GPU_CHECK(cudaStreamSynchronize(s));
}

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
  return n;
}

unsigned long long mem_access_flags(const void* p, int device) {
  using fn_t = CUresult (*)(unsigned long long*, const CUmemLocation*, CUdeviceptr);
  static fn_t fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    GPU_CHECK(cudaGetDriverEntryPointByVersion("cuMemGetAccess", &f, 12000, cudaEnableDefault, &q));
    if (q != cudaDriverEntryPointSuccess || !f) {
      std::fprintf(stderr, "gpu::mem_access_flags: cuMemGetAccess not found\n");
      std::abort();
    }
    return reinterpret_cast<fn_t>(f);
  }();
  CUmemLocation loc{};
  loc.type = CU_MEM_LOCATION_TYPE_DEVICE;
  loc.id = device;
  unsigned long long flags = 0;
  CUresult r = fn(&flags, &loc, reinterpret_cast<CUdeviceptr>(p));
  if (r != CUDA_SUCCESS) {
    std::fprintf(stderr, "cuMemGetAccess(device %d) failed: %d\n", device, static_cast<int>(r));
    std::abort();
  }
  return flags;
}

}  // namespace gpu
