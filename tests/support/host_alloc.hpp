// SPDX-License-Identifier: Apache-2.0
// A host-backend allocator together with its backend, whose test controls (hold_stream,
// complete_stream, live counts, access_of) the allocator does not expose.
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "frontend/allocator_access.hpp"
#include "vmmalloc/host_backend.hpp"
#include "vmmalloc/vmmalloc.hpp"

namespace vmm::test {

struct host_alloc {
  host_backend* hb;
  allocator a;
};

// t: the allocator's own sizes and thresholds (arena/tuning.hpp) where a test needs others.
inline host_alloc make_host_alloc(const options& o, const tuning& t, const host_backend_options& h = {}) {
  auto b = make_backend<host_backend>(h);
  host_backend* hb = backend_cast<host_backend>(*b);
  return {hb, allocator_access::make(std::move(b), o, t)};
}
inline host_alloc make_host_alloc(const options& o = {}, const host_backend_options& h = {}) {
  return make_host_alloc(o, tuning{}, h);
}

// Violations of the driver's contract, kept instead of aborting: for tests that break the contract
// on purpose and check that the host backend refuses the call and names it.
struct violation_log {
  std::mutex mu;
  std::vector<std::string> seen;
  std::size_t count() {
    std::lock_guard g(mu);
    return seen.size();
  }
  std::string last() {
    std::lock_guard g(mu);
    return seen.empty() ? std::string() : seen.back();
  }
};
inline host_backend_options recording(const std::shared_ptr<violation_log>& log, host_backend_options o = {}) {
  o.on_violation = [log](const std::string& what) {
    std::lock_guard g(log->mu);
    log->seen.push_back(what);
  };
  return o;
}

}  // namespace vmm::test
