// SPDX-License-Identifier: Apache-2.0
// vmm::cuda_resource in CCCL 3.1+'s form (allocate_sync, stream-first allocate, resource_with),
// compiled in CI against a STAND-IN for CCCL 3.1's headers (cccl31_standin/, see its README.md):
// the toolkit here has CCCL 3.0, and no Debian or npm package has 3.1+. The stand-in declares the
// renamed concepts with the shapes of CCCL 3.1's cuda/__memory_resource/resource.h; it has no
// resource_ref. The cases are cuda_mr_cases.hpp, shared with integrations.cccl.
#include <doctest/doctest.h>

#define VMM_TEST_NO_RESOURCE_REF  // the stand-in has only the concepts

#include "vmmalloc/adapters.hpp"

#ifndef VMM_TEST_CCCL_STANDIN
#error "expected the stand-in's <cuda/version> (tests/integrations/cccl31_standin) first on the include path"
#endif
static_assert(CCCL_VERSION == 3001000 && CCCL_MAJOR_VERSION == 3 && CCCL_MINOR_VERSION == 1);
static_assert(VMM_CUDA_MR_STREAM_FIRST == 1, "CCCL 3.1 must select the stream-first form");
#ifdef VMM_HAVE_THRUST_ALLOCATOR
#error "no thrust on this test's include path: the real CCCL leaked in"
#endif

#include "cuda_mr_cases.hpp"
