// SPDX-License-Identifier: Apache-2.0
// GPU test helpers: pattern kernels, device checks, a pool of real streams.
//
// This header is plain C++ (host declarations only) so the doctest sources can be compiled by the
// host compiler; the kernels live in gpu_util.cu (nvcc). Every CUDA call is checked: a failure
// aborts the process with the call, the file:line and the runtime's error name and text, because a
// CUDA error in a test (a faulting kernel, a sticky context error) leaves nothing to recover.
//
// The pattern is the tests' one (support/pattern.hpp): byte b of a region filled with `seed` is
// byte b % 8 of pattern_word(seed, b / 8), so a prefix verifies with the same seed and the host can
// compute every expected byte.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "support/pattern.hpp"

namespace gpu {

using vmm::test::pattern_byte;
using vmm::test::pattern_word;

// Aborts with a clear message when `e` is not cudaSuccess.
void check(cudaError_t e, const char* what, const char* file, int line);
#define GPU_CHECK(call) ::gpu::check((call), #call, __FILE__, __LINE__)
// After a kernel launch: the launch error (cudaGetLastError).
#define GPU_CHECK_LAUNCH(what) ::gpu::check(cudaGetLastError(), what, __FILE__, __LINE__)

// True when the CUDA runtime sees at least one device. Otherwise `why` says what failed
// ("cudaGetDeviceCount: cudaErrorInsufficientDriver (...)" or "no CUDA device (count 0)").
bool has_device(std::string* why = nullptr);

// Creates the counters, the stream pool and loads every kernel once (lazy module loading would
// otherwise take device memory later and disturb cudaMemGetInfo comparisons). Call once, after
// has_device(), before any other function here. shutdown() frees them; both are idempotent.
void init();
void shutdown();

// Writes the pattern of `seed` over [p, p + n). Asynchronous on s.
void fill(void* p, std::size_t n, std::uint64_t seed, cudaStream_t s = nullptr);
// Counts bytes of [p, p + n) that differ from the pattern of `seed`. Synchronises s.
std::uint64_t verify(const void* p, std::size_t n, std::uint64_t seed, cudaStream_t s = nullptr);
// Adds the number of bytes of [p, p + n) that differ from the pattern of `seed` to *counter (an
// unsigned long long in device memory). Asynchronous on s, no synchronisation and no host copy:
// a stream capture may record it, and each replay of the graph checks again.
void verify_into(const void* p, std::size_t n, std::uint64_t seed, unsigned long long* counter,
                 cudaStream_t s);
// Keeps writing the pattern of `seed` over [p, p + n) for about `ns` nanoseconds of GPU time (the
// global timer), then once more; few blocks, so other streams' kernels run beside it. Async on s.
void spin_fill(void* p, std::size_t n, std::uint64_t seed, std::uint64_t ns, cudaStream_t s);

// Copies n bytes (a multiple of 8) with a kernel on the CURRENT device, then synchronises s:
// the kernel itself reads src and writes dst (peer-access tests).
void copy_words(void* dst, const void* src, std::size_t n, cudaStream_t s = nullptr);
// Devices the runtime sees (0 on error).
int device_count();
// cuMemGetAccess for `device` at p (CU_MEM_ACCESS_FLAGS_PROT_NONE 0, READ 1, READWRITE 3).
unsigned long long mem_access_flags(const void* p, int device);

// cudaMemGetInfo; aborts on failure.
void device_memory(std::size_t& free, std::size_t& total);

// Pool of real non-blocking streams (cudaStreamNonBlocking), created by init(); i modulo the size.
constexpr int stream_pool_size = 8;
cudaStream_t stream(int i);

// "NVIDIA H100 80GB HBM3, cc 9.0, 81559 MiB, runtime 13000, driver 13000".
std::string describe_device();

// Environment knobs of the GPU tests.
std::uint64_t env_u64(const char* name, std::uint64_t fallback);
// VMM_GPU_SKIP_MEMINFO=1: cudaMemGetInfo comparisons are reported, not asserted (compute-sanitizer
// takes device memory of its own while it runs).
bool skip_meminfo_checks();

}  // namespace gpu
