// SPDX-License-Identifier: Apache-2.0
// Access policy (options.device, options.peers, options.location): who may touch the memory. The
// owner gets read_write, pinned host memory (host_numa) the CPU too, and each peer its mode, on
// every mapping with one set_access per mapped range (the driver's cost is per call, not per
// chunk). grant/revoke change it at run time for every mapped run and every later mapping.
#include <algorithm>

#include "policy/policy.hpp"
#include "vm/granularity.hpp"

namespace vmm::policy {

namespace {
class access final : public policy {
 public:
  status open(vm::driver&, const options& o, state& s) override {
    s.props.location = o.location;
    s.props.id = o.device;
    s.access.clear();
    s.access.push_back({o.device, access_mode::read_write});
    // Pinned host memory is reachable from the CPU only once the host is granted too.
    if (o.location == location_kind::host_numa) s.access.push_back({cpu_device, access_mode::read_write});
    for (const access_desc& p : o.peers)
      if (p.device != o.device) s.access.push_back(p);
    return {};
  }
};
}  // namespace

std::unique_ptr<policy> make_access() { return std::make_unique<access>(); }

status set_peer_access(vm::driver& d, const options& o, state& s, std::size_t gran, int device, access_mode mode,
                       const std::vector<std::pair<std::uintptr_t, std::size_t>>& runs) {
  if (device == o.device)
    return {errc::invalid_value, 0, "the owner device's access cannot be changed", "set_peer_access"};
  if (device < 0) return {errc::invalid_value, 0, "negative device ordinal", "set_peer_access"};
  if (mode != access_mode::none) {
    const access_desc peer[1] = {{device, mode}};
    auto g = vm::granularity_for(d, s.props, peer);
    if (!g.ok()) return {g.st.kind, g.st.code, g.st.name, "set_peer_access"};
    if (g.value > gran)
      return {errc::invalid_value, 0, "peer granularity is larger than the arena's (name the peer in options.peers)",
              "set_peer_access"};
  }
  auto it = std::find_if(s.access.begin(), s.access.end(), [&](const access_desc& a) { return a.device == device; });
  const access_mode old = it == s.access.end() ? access_mode::none : it->mode;
  if (old == mode) return {};
  // One call per mapped run, naming only this device: the others' access is untouched.
  const access_desc now[1] = {{device, mode}};
  const access_desc before[1] = {{device, old}};
  for (std::size_t i = 0; i < runs.size(); ++i) {
    status st = d.set_access(runs[i].first, runs[i].second, now);
    if (!st.ok()) {
      for (std::size_t j = i; j-- > 0;) (void)d.set_access(runs[j].first, runs[j].second, before);
      return st;
    }
  }
  if (mode == access_mode::none) {
    if (it != s.access.end()) s.access.erase(it);
  } else if (it != s.access.end()) {
    it->mode = mode;
  } else {
    s.access.push_back({device, mode});
  }
  ++s.access_changes;
  return {};
}

}  // namespace vmm::policy
