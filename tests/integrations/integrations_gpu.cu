// SPDX-License-Identifier: Apache-2.0
// Kernels and thrust calls of the integrations GPU test; see integrations_gpu.cuh. Compiled as
// C++20 (vmmalloc's headers need it) by nvcc.
#include "integrations_gpu.cuh"

#include <thrust/copy.h>
#include <thrust/device_ptr.h>
#include <thrust/device_vector.h>
#include <thrust/execution_policy.h>
#include <thrust/functional.h>
#include <thrust/reduce.h>
#include <thrust/sort.h>

#include <algorithm>
#include <exception>
#include <random>
#include <vector>

#include "gpu_util.cuh"
#include "vmmalloc/adapters.hpp"

namespace itest {
namespace {

constexpr int kThreads = 256;

unsigned blocks_for(std::size_t n) {
  const std::size_t b = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(std::min<std::size_t>(std::max<std::size_t>(b, 1), 65535));
}

__global__ void fill_index_mod_kernel(float* p, std::size_t first, std::size_t last) {
  for (std::size_t i = first + blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < last;
       i += std::size_t{gridDim.x} * blockDim.x)
    p[i] = static_cast<float>(i % 1024);
}

__global__ void fill_value_kernel(float* p, std::size_t first, std::size_t last, float v) {
  for (std::size_t i = first + blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < last;
       i += std::size_t{gridDim.x} * blockDim.x)
    p[i] = v;
}

__global__ void count_kernel(const float* p, std::size_t n, unsigned long long* bad) {
  unsigned long long k = 0;
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * blockDim.x)
    k += p[i] != static_cast<float>(i % 1024);
  if (k) atomicAdd(bad, k);
}

}  // namespace

std::string thrust_sort_case(vmm::allocator& a, std::size_t n, unsigned seed) {
  try {
    std::mt19937 rng(seed);
    std::vector<int> h(n);
    for (auto& x : h) x = static_cast<int>(rng());

    vmm::thrust_allocator<int> alloc(a);
    thrust::device_vector<int, vmm::thrust_allocator<int>> d(h.begin(), h.end(), alloc);
    int* raw = thrust::raw_pointer_cast(d.data());
    if (a.usable_size(raw) < n * sizeof(int))
      return "the device_vector's memory is not a vmmalloc allocation of n ints";

    const auto allocs_before = a.stats().allocs;
    // Temporary storage of the sort through vmm as well (thrust's own would be cudaMalloc).
    thrust::sort(thrust::cuda::par(vmm::thrust_allocator<char>(a)), d.begin(), d.end());
    GPU_CHECK(cudaGetLastError());
    GPU_CHECK(cudaDeviceSynchronize());
    if (a.stats().allocs == allocs_before)
      return "thrust::sort took no temporary storage from the vmm allocator";

    std::vector<int> back(n);
    thrust::copy(d.begin(), d.end(), back.begin());
    std::sort(h.begin(), h.end());
    if (!std::is_sorted(back.begin(), back.end())) return "the result is not sorted";
    if (back != h) return "the result is sorted but not a permutation of the input";
    return "";
  } catch (const std::exception& e) {
    return std::string("exception: ") + e.what();
  }
}

void fill_index_mod(float* p, std::size_t first, std::size_t last, cudaStream_t s) {
  if (last <= first) return;
  fill_index_mod_kernel<<<blocks_for(last - first), kThreads, 0, s>>>(p, first, last);
  GPU_CHECK_LAUNCH("fill_index_mod_kernel");
}

void fill_value(float* p, std::size_t first, std::size_t last, float v, cudaStream_t s) {
  if (last <= first) return;
  fill_value_kernel<<<blocks_for(last - first), kThreads, 0, s>>>(p, first, last, v);
  GPU_CHECK_LAUNCH("fill_value_kernel");
}

unsigned long long count_index_mod_mismatches(const float* p, std::size_t n) {
  unsigned long long* bad = nullptr;
  GPU_CHECK(cudaMalloc(&bad, sizeof(*bad)));
  GPU_CHECK(cudaMemset(bad, 0, sizeof(*bad)));
  count_kernel<<<blocks_for(n), kThreads>>>(p, n, bad);
  GPU_CHECK_LAUNCH("count_kernel");
  unsigned long long h = 0;
  GPU_CHECK(cudaMemcpy(&h, bad, sizeof(h), cudaMemcpyDeviceToHost));
  GPU_CHECK(cudaFree(bad));
  return h;
}

double thrust_sum(const float* p, std::size_t n) {
  auto first = thrust::device_pointer_cast(p);
  const double s = thrust::reduce(thrust::device, first, first + n, 0.0, thrust::plus<double>());
  GPU_CHECK(cudaGetLastError());
  GPU_CHECK(cudaDeviceSynchronize());
  return s;
}

}  // namespace itest
