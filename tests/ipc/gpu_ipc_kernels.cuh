// SPDX-License-Identifier: Apache-2.0
// Kernels and CUDA runtime helpers of the IPC GPU test (plain C++ declarations; gpu_ipc_kernels.cu
// holds the kernels). Every call is checked: a failure prints the call, file:line and the
// runtime's error, and exits 1 (a CUDA error in a test leaves nothing to recover).
//
// The pattern is the tests' one (support/pattern.hpp), written and counted by the kernels of
// support/pattern_kernels.cuh that the other GPU tests use.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace ipcg {

// Number of CUDA devices the runtime sees; false with `why` when there is no driver or device.
bool device_count(int& n, std::string& why);
void set_device(int d);
bool can_access_peer(int device, int peer);
// "NVIDIA H100 80GB HBM3, cc 9.0, 81559 MiB, driver 13000".
std::string describe(int d);
// Writes the pattern of seed over [p, p + n) from the current device; synchronous.
void fill(void* p, std::size_t n, std::uint64_t seed);
// Bytes of [p, p + n) that differ from the pattern of seed, counted by a kernel on the current
// device; synchronous. The counter lives on the current device (set_device first).
std::uint64_t verify(const void* p, std::size_t n, std::uint64_t seed);
// cudaMemGetInfo of the current device.
void mem_info(std::size_t& free, std::size_t& total);

}  // namespace ipcg
