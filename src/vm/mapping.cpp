// SPDX-License-Identifier: Apache-2.0
// vm::mapping: the one rollback rule. See mapping.hpp.
#include "vm/mapping.hpp"

namespace vmm::vm {

status strays::retry(driver& d, std::size_t* released) {
  status first{};
  for (auto it = v_.begin(); it != v_.end();) {
    status s{};
    if (it->mapped) {
      s = driver::twice([&] { return d.unmap(it->va, it->size); });
      if (s.ok()) it->mapped = false;
    }
    if (s.ok()) s = driver::twice([&] { return d.release(it->h); });
    if (s.ok()) {
      if (released) *released += it->size;
      it = v_.erase(it);
    } else {
      if (first.ok()) first = s;
      ++it;
    }
  }
  return first;
}

std::size_t strays::bytes() const noexcept {
  std::size_t n = 0;
  for (const auto& e : v_) n += e.size;
  return n;
}

void mapping_txn::give_back(mem_handle h, std::size_t size, bool created) noexcept {
  if (!created) {
    back_.push_back({h, size});
  } else if (driver::twice([&] { return d_.release(h); }).ok()) {
    released_ += size;
  } else {
    s_.add_handle(h, size);
  }
}

status mapping_txn::map(std::uintptr_t va, std::size_t size, mem_handle h, bool created) {
  done_.reserve(done_.size() + 1);  // before the map: a push_back that throws must not strand it
  status st = d_.map(va, size, h, 0);
  if (!st.ok()) {
    give_back(h, size, created);
    return st;
  }
  done_.push_back({va, size, h, created});
  return {};
}

void mapping_txn::rollback() noexcept {
  for (auto it = done_.rbegin(); it != done_.rend(); ++it) {
    if (!driver::twice([&] { return d_.unmap(it->va, it->size); }).ok()) {
      s_.add_mapping(it->va, it->size, it->h);  // still mapped: its VA stays out of use
      continue;
    }
    give_back(it->h, it->size, it->created);
  }
  done_.clear();
}

}  // namespace vmm::vm
