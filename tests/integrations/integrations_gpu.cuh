// SPDX-License-Identifier: Apache-2.0
// Kernels and thrust calls of the integrations GPU test (integrations_gpu.cu, nvcc, C++20),
// declared for the doctest source (host compiler). Every CUDA call inside is checked with
// GPU_CHECK (abort with the call, file:line and the runtime's error text).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <string>

namespace vmm {
class allocator;
}

namespace itest {

// thrust::device_vector<int, vmm::thrust_allocator<int>> of n random ints, sorted by thrust::sort
// with its temporary storage from vmm too; checked against std::sort of the same ints copied
// back. "" on success, else what went wrong.
std::string thrust_sort_case(vmm::allocator& a, std::size_t n, unsigned seed);

// p[i] = float(i % 1024) for i in [first, last). Asynchronous on s.
void fill_index_mod(float* p, std::size_t first, std::size_t last, cudaStream_t s = nullptr);
// p[i] = v for i in [first, last). Asynchronous on s.
void fill_value(float* p, std::size_t first, std::size_t last, float v, cudaStream_t s = nullptr);
// Elements of [0, n) that differ from float(i % 1024). Synchronises.
unsigned long long count_index_mod_mismatches(const float* p, std::size_t n);
// thrust::reduce over thrust::device_pointer_cast(p) .. + n, summed in double. Synchronises.
double thrust_sum(const float* p, std::size_t n);

}  // namespace itest
