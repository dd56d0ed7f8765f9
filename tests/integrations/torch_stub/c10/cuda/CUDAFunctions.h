// SPDX-License-Identifier: Apache-2.0
// A stand-in for PyTorch's c10/cuda/CUDAFunctions.h: the current device, which the test sets
// (torch.cuda.set_device's part).
#pragma once
#include <c10/cuda/CUDACachingAllocator.h>

namespace c10::cuda {
inline DeviceIndex stub_current_device = 0;
inline DeviceIndex current_device() { return stub_current_device; }
}  // namespace c10::cuda
