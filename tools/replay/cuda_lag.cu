// SPDX-License-Identifier: Apache-2.0
// vmm-replay --lag on the CUDA backend: a kernel that holds a stream back until the replay has
// moved N events further (see make_cuda_lag in replay_pass.hpp). One thread, polling the host's
// counter across the bus every ~2 us: it occupies one SM slot per stream while it waits, nothing
// else.
#include "cuda_lag.hpp"

namespace {

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void gate_kernel(const volatile unsigned long long* counter, unsigned long long until,
                            unsigned long long timeout_ns, unsigned long long* timeouts) {
  const unsigned long long t0 = global_ns();
  while (*counter < until) {
    if (global_ns() - t0 > timeout_ns) {
      atomicAdd(timeouts, 1ull);
      return;
    }
    __nanosleep(2000);
  }
}

}  // namespace

cudaError_t vmm_replay_launch_gate(void* stream, const unsigned long long* dev_counter, unsigned long long until,
                                   unsigned long long timeout_ns, unsigned long long* timeouts) {
  gate_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(dev_counter, until, timeout_ns, timeouts);
  return cudaGetLastError();
}
