// SPDX-License-Identifier: Apache-2.0
// Kernels of the kv_cache GPU test; see kv_kernels.cuh.
#include "kv_kernels.cuh"

#include <cstdio>
#include <cstdlib>

#include "gpu_util.cuh"

namespace kvtest {
namespace {

constexpr int kThreads = 256;

// Word w of the region: token w / wpt, its word w % wpt, tokens R bytes apart.
__device__ std::uint64_t* word_at(unsigned char* p, std::size_t R, std::size_t wpt, std::size_t w) {
  return reinterpret_cast<std::uint64_t*>(p + (w / wpt) * R + (w % wpt) * 8);
}

__global__ void write_kernel(unsigned char* p, std::size_t R, std::size_t wpt, std::size_t w0, std::size_t w1,
                             std::uint64_t seed) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t w = w0 + static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; w < w1; w += stride)
    *word_at(p, R, wpt, w) = gpu::pattern_word(seed, w);
}

__global__ void check_kernel(unsigned char* p, std::size_t R, std::size_t wpt, std::size_t words, std::uint64_t seed,
                             unsigned long long* bad) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  unsigned long long n = 0;
  for (std::size_t w = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; w < words; w += stride)
    n += *word_at(p, R, wpt, w) != gpu::pattern_word(seed, w);
  if (n) atomicAdd(bad, n);
}

// One block per sequence of the step; its threads write the token's words.
__global__ void step_kernel(unsigned char* base, std::size_t S, std::size_t T, std::size_t R, step st) {
  const int i = blockIdx.x;
  if (i >= st.count) return;
  auto* tok = reinterpret_cast<std::uint64_t*>(base + st.slot[i] * S + st.pos[i] * R);
  const std::size_t words = T / 8, first = st.pos[i] * words;
  for (std::size_t w = threadIdx.x; w < words; w += blockDim.x) tok[w] = gpu::pattern_word(st.seed[i], first + w);
}

unsigned long long* g_counter = nullptr;  // check_tokens' mismatch counter, made by init()

unsigned grid(std::size_t words) {
  const std::size_t b = (words + kThreads - 1) / kThreads;
  return static_cast<unsigned>(b < 1 ? 1 : (b > 4096 ? 4096 : b));
}

}  // namespace

void init() {
  if (g_counter) return;
  // The counter and 4 KiB of scratch; every kernel launched once, so lazy module loading takes its
  // device memory now, not inside a test's cudaMemGetInfo window.
  void* mem = nullptr;
  GPU_CHECK(cudaMalloc(&mem, 4096 + 64));
  g_counter = static_cast<unsigned long long*>(mem);
  unsigned char* scratch = static_cast<unsigned char*>(mem) + 64;
  write_kernel<<<1, kThreads>>>(scratch, 4096, 4096 / 8, 0, 4096 / 8, 1);
  GPU_CHECK_LAUNCH("kvtest::write_kernel (warm-up)");
  step st;
  st.count = 1;
  st.seed[0] = 1;
  step_kernel<<<1, 128>>>(scratch, 0, 4096, 4096, st);
  GPU_CHECK_LAUNCH("kvtest::step_kernel (warm-up)");
  GPU_CHECK(cudaMemset(g_counter, 0, sizeof *g_counter));
  check_kernel<<<1, kThreads>>>(scratch, 4096, 4096 / 8, 4096 / 8, 1, g_counter);
  GPU_CHECK_LAUNCH("kvtest::check_kernel (warm-up)");
  unsigned long long bad = ~0ull;
  GPU_CHECK(cudaMemcpy(&bad, g_counter, sizeof bad, cudaMemcpyDeviceToHost));
  if (bad != 0) {
    std::fprintf(stderr, "kvtest: self-test failed: %llu wrong words in scratch\n", bad);
    std::abort();
  }
}

void write_tokens(void* p, std::size_t T, std::size_t t0, std::size_t t1, std::uint64_t seed, cudaStream_t s,
                  std::size_t R) {
  if (t1 <= t0) return;
  const std::size_t wpt = T / 8;
  write_kernel<<<grid((t1 - t0) * wpt), kThreads, 0, s>>>(static_cast<unsigned char*>(p), R ? R : T, wpt, t0 * wpt,
                                                          t1 * wpt, seed);
  GPU_CHECK_LAUNCH("kvtest::write_kernel");
}

std::uint64_t check_tokens(const void* p, std::size_t T, std::size_t n, std::uint64_t seed, cudaStream_t s,
                           std::size_t R) {
  if (n == 0) return 0;
  init();
  unsigned long long* counter = g_counter;
  GPU_CHECK(cudaMemsetAsync(counter, 0, sizeof *counter, s));
  const std::size_t words = n * (T / 8);
  check_kernel<<<grid(words), kThreads, 0, s>>>(static_cast<unsigned char*>(const_cast<void*>(p)), R ? R : T, T / 8,
                                                words, seed, counter);
  GPU_CHECK_LAUNCH("kvtest::check_kernel");
  unsigned long long bad = 0;
  GPU_CHECK(cudaMemcpyAsync(&bad, counter, sizeof bad, cudaMemcpyDeviceToHost, s));
  GPU_CHECK(cudaStreamSynchronize(s));
  return bad;
}

void write_step(void* layer_base, std::size_t S, std::size_t T, const step& st, cudaStream_t s, std::size_t R) {
  if (st.count <= 0) return;
  step_kernel<<<st.count, 128, 0, s>>>(static_cast<unsigned char*>(layer_base), S, T, R ? R : T, st);
  GPU_CHECK_LAUNCH("kvtest::step_kernel");
}

}  // namespace kvtest
