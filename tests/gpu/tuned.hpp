// SPDX-License-Identifier: Apache-2.0
// A CUDA-backend allocator whose own sizes and thresholds are `t` (arena/tuning.hpp), not the
// defaults: GPU cases that reach a path with smaller sizes than real processes use.
#pragma once

#include "frontend/allocator_access.hpp"
#include "vmmalloc/cuda_backend.hpp"
#include "vmmalloc/vmmalloc.hpp"

namespace gpu {

inline vmm::allocator tuned(const vmm::options& o, const vmm::tuning& t) {
  return vmm::allocator_access::make(vmm::make_backend<vmm::cuda_backend>(o.device), o, t);
}

}  // namespace gpu
