// SPDX-License-Identifier: Apache-2.0
// A host-backend allocator together with its backend, whose test controls (hold_stream,
// complete_stream, live counts, access_of) the allocator does not expose.
#pragma once

#include <utility>

#include "vmmalloc/host_backend.hpp"
#include "vmmalloc/vmmalloc.hpp"

namespace vmm::test {

struct host_alloc {
  host_backend* hb;
  allocator a;
};

inline host_alloc make_host_alloc(const options& o = {}, const host_backend_options& h = {}) {
  auto b = make_backend<host_backend>(h);
  host_backend* hb = backend_cast<host_backend>(*b);
  return {hb, allocator(std::move(b), o)};
}

}  // namespace vmm::test
