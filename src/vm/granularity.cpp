// SPDX-License-Identifier: Apache-2.0
// vm::granularity_for. See granularity.hpp.
#include "vm/granularity.hpp"

#include <algorithm>

namespace vmm::vm {

result<std::size_t> granularity_for(driver& d, const chunk_props& owner, std::span<const access_desc> others,
                                    std::string* why) {
  auto pick = [](const granularity_info& g) { return g.minimum; };
  auto g = d.granularity(owner);
  if (!g.ok()) {
    if (why) *why = "granularity of device " + std::to_string(owner.id);
    return {0, g.st};
  }
  std::size_t gran = pick(g.value);
  for (const access_desc& a : others) {
    if (a.device == owner.id || a.device == cpu_device) continue;
    if (!d.can_access_peer(a.device, owner.id)) {
      if (why) *why = "device " + std::to_string(a.device) + " cannot access device " + std::to_string(owner.id);
      return {0, {errc::invalid_value, 0,
                  "peer device cannot access the owner device (cuDeviceCanAccessPeer, or no VMM support)",
                  "granularity"}};
    }
    chunk_props p = owner;
    p.id = a.device;
    auto pg = d.granularity(p);
    if (!pg.ok()) {
      if (why) *why = "granularity of peer " + std::to_string(a.device);
      return {0, pg.st};
    }
    gran = std::max(gran, pick(pg.value));
  }
  if (gran == 0 || (gran & (gran - 1))) {
    if (why) *why = "granularity " + std::to_string(gran) + " is not a power of two";
    return {0, {errc::invalid_value, 0, "bad granularity", "granularity"}};
  }
  return {gran, {}};
}

}  // namespace vmm::vm
