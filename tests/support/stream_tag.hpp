// SPDX-License-Identifier: Apache-2.0
// A stream as the host backend and the heap see it: an opaque tag. Tests name streams by small
// integers (0 is the default stream, nullptr); no CUDA stream is made.
#pragma once

#include <cstdint>

#include "vmmalloc/backend.hpp"

namespace vmm::test {

inline stream_t stream_tag(std::uintptr_t i) { return reinterpret_cast<stream_t>(i); }

}  // namespace vmm::test
