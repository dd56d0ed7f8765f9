// SPDX-License-Identifier: Apache-2.0
// How the front end's files name vmm::allocator's private state: allocator_access is the
// allocator's friend, allocator_impl its impl (defined in allocator_impl.hpp).
#pragma once

#include "arena/tuning.hpp"
#include "vmmalloc/vmmalloc.hpp"

namespace vmm {
namespace vm {
class handle_pool;
}

struct allocator_access {
  using impl = allocator::impl;
  // An allocator whose sizes and thresholds are `t` instead of the defaults (tuning.hpp): for
  // tests that reach a path with small sizes, and tools that compare a choice.
  static allocator make(std::unique_ptr<backend_iface> b, const options& o, const tuning& t);
  static impl& of(allocator& a) { return *a.p_; }
  // The allocator's idle handles, for a growable_buffer that shares them (growable_buffer::shared).
  static vm::handle_pool& pool(allocator& a);
  // Requests not served by a growth that ran under the allocator's lock (allocator_impl).
  static std::uint64_t unserved_growths(allocator& a);
};
using allocator_impl = allocator_access::impl;

}  // namespace vmm
