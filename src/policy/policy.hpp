// SPDX-License-Identifier: Apache-2.0
// Policies: how chunks are made, who may access them, how allocations are placed. Each policy is
// one file here and one row (or a few) of the options table, called by the arena at fixed hooks:
//
//   open        before anything is reserved: chunk properties, capability checks, the devices
//               that get access (the granularity is the largest among them)
//   retry       a create failed: change the properties and try once more?
//   created     a create succeeded: keep what the driver granted, or refuse it
//   mapped      a chunk was mapped: read back what the driver granted (counted in stats)
//   placement   whether every allocation owns whole chunks
//
// Adding a policy: a file with a class derived from `policy`, its options row(s), and one line in
// make_policies() (policy.cpp).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "vm/driver.hpp"
#include "vmmalloc/options.hpp"

namespace vmm::policy {

// What the policies decide and count; owned by the arena.
struct state {
  chunk_props props;                 // what every chunk is created with
  std::vector<access_desc> access;   // owner first: granted on every mapping
  std::uint64_t compression_fallbacks = 0;
  std::uint64_t ipc_fallbacks = 0;
  std::uint64_t access_changes = 0;
};

class policy {
 public:
  virtual ~policy() = default;
  virtual status open(vm::driver&, const options&, state&) { return {}; }
  virtual bool retry(const options&, state&, const status& /*create failed with*/) { return false; }
  virtual status created(vm::driver&, const options&, state&, mem_handle) { return {}; }
  // true: the chunk is marked (one bit per policy that marks; compression marks granted chunks).
  virtual bool mapped(vm::driver&, const state&, mem_handle) { return false; }
  virtual bool whole_chunks(const options&) const { return false; }
};

using list = std::vector<std::unique_ptr<policy>>;
list make_policies(const options& o);

// Creates one chunk's handle through the hooks: create, retry on the policies' word, created.
result<mem_handle> create_chunk(vm::driver& d, const list& ps, const options& o, state& s, std::size_t size);

// The access policy's run-time half: gives `device` `mode` (none revokes) on every range in `runs`
// (one set_access each, naming only that device) and on all later mappings. All or nothing.
status set_peer_access(vm::driver& d, const options& o, state& s, std::size_t gran, int device, access_mode mode,
                       const std::vector<std::pair<std::uintptr_t, std::size_t>>& runs);

}  // namespace vmm::policy
