// SPDX-License-Identifier: Apache-2.0
// vm::mapping: the one mapping path and its undo rule. See mapping.hpp.
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
    if (s.ok() && it->h) s = driver::twice([&] { return d.release(it->h); });
    if (s.ok()) {
      if (released && it->h) *released += it->size;
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
  for (const auto& e : v_)
    if (e.h) n += e.size;
  return n;
}

void mapping_txn::give_back(mem_handle h, std::size_t size, bool created) noexcept {
  if (!created) {
    back_.push_back({h, size});
  } else if (driver::twice([&] { return d_->release(h); }).ok()) {
    released_ += size;
  } else {
    s_->add_handle(h, size);
  }
}

status mapping_txn::map(std::uintptr_t va, std::size_t size, mem_handle h, bool created) {
  done_.reserve(done_.size() + 1);  // before the map: a push_back that throws must not strand it
  status st = d_->map(va, size, h, 0);
  if (!st.ok()) {
    give_back(h, size, created);
    return st;
  }
  done_.push_back({va, size, h, created});
  return {};
}

status mapping_txn::place(std::uintptr_t va, std::span<piece> pieces, std::span<const access_desc> access,
                          const create_fn& create, std::size_t* failed) {
  std::size_t off = 0;
  for (std::size_t i = 0; i < pieces.size(); ++i) {
    piece& p = pieces[i];
    status st{};
    if (!p.h) {
      auto h = create ? create(p.size) : result<mem_handle>{0, {errc::invalid_value, 0, "no handle", "place"}};
      if (h.ok()) p.h = h.value, p.created = true;
      else st = h.st;
    }
    if (st.ok()) st = map(va + off, p.size, p.h, p.created);  // a failed map handed p back already
    if (!st.ok()) {
      if (failed) *failed = i;
      for (std::size_t k = i + 1; k < pieces.size(); ++k)  // never reached
        if (pieces[k].h) give_back(pieces[k].h, pieces[k].size, pieces[k].created);
      return st;
    }
    off += p.size;
  }
  if (failed) *failed = pieces.size();
  return set_access(va, off, access);
}

void mapping_txn::rollback() noexcept {
  for (auto it = done_.rbegin(); it != done_.rend(); ++it) {
    if (!driver::twice([&] { return d_->unmap(it->va, it->size); }).ok()) {
      s_->add_mapping(it->va, it->size, it->h);  // still mapped: its VA stays out of use
      continue;
    }
    give_back(it->h, it->size, it->created);
  }
  done_.clear();
}

}  // namespace vmm::vm
