// SPDX-License-Identifier: Apache-2.0
// How the front end's files name vmm::allocator's private state: allocator_access is the
// allocator's friend, allocator_impl its impl (defined in allocator_impl.hpp).
#pragma once

#include "vmmalloc/vmmalloc.hpp"

namespace vmm {
namespace vm {
class handle_pool;
}

struct allocator_access {
  using impl = allocator::impl;
  static impl& of(allocator& a) { return *a.p_; }
  // The allocator's idle handles, for a growable_buffer that shares them (growable_buffer::shared).
  static vm::handle_pool& pool(allocator& a);
};
using allocator_impl = allocator_access::impl;

}  // namespace vmm
