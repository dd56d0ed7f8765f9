// SPDX-License-Identifier: Apache-2.0
// How the front end's files name vmm::allocator's private state: allocator_access is the
// allocator's friend, allocator_impl its impl (defined in allocator_impl.hpp).
#pragma once

#include "vmmalloc/vmmalloc.hpp"

namespace vmm {

struct allocator_access {
  using impl = allocator::impl;
  static impl& of(allocator& a) { return *a.p_; }
};
using allocator_impl = allocator_access::impl;

}  // namespace vmm
