// SPDX-License-Identifier: Apache-2.0
// The policy list and the create hook chain. See policy.hpp.
#include "policy/policy.hpp"

namespace vmm::policy {

std::unique_ptr<policy> make_access();
std::unique_ptr<policy> make_compression();
std::unique_ptr<policy> make_ipc();

list make_policies(const options&) {
  list l;
  l.push_back(make_access());
  l.push_back(make_compression());
  l.push_back(make_ipc());
  return l;
}

result<mem_handle> create_chunk(vm::driver& d, const list& ps, const options& o, state& s, std::size_t size) {
  auto h = d.create(size, s.props);
  if (!h.ok()) {
    bool again = false;
    for (auto& p : ps) again = p->retry(o, s, h.st) || again;
    if (again) h = d.create(size, s.props);
    if (!h.ok()) return h;
  }
  for (auto& p : ps) {
    if (status st = p->created(d, o, s, h.value); !st.ok()) {
      // Refused what the driver granted: give the handle back (once more if refused, then leaked
      // to the driver's teardown: a handle nobody maps holds no address and is counted nowhere).
      (void)vm::driver::twice([&] { return d.release(h.value); });
      return {0, st};
    }
  }
  return h;
}

}  // namespace vmm::policy
