// SPDX-License-Identifier: Apache-2.0
// The gate kernel behind make_cuda_lag() (replay_pass.hpp), compiled by nvcc in cuda_lag.cu; this
// header is plain C++ for the host code.
#pragma once

#include <cuda_runtime_api.h>

// Enqueues on `stream` one single-thread kernel that returns once *dev_counter >= until (the
// host's event counter, in mapped pinned memory), or after timeout_ns of GPU time, adding 1 to
// *timeouts (device memory) then. Returns the launch's error.
cudaError_t vmm_replay_launch_gate(void* stream, const unsigned long long* dev_counter, unsigned long long until,
                                   unsigned long long timeout_ns, unsigned long long* timeouts);
