// SPDX-License-Identifier: Apache-2.0
// vm::mapping: create -> map -> set_access with one rollback rule, and one way to keep what a
// refused rollback leaves behind.
//
//   mapping_txn t(driver, strays);
//   t.map(va, n, h, /*created=*/true);         // each piece; any failure: stop and drop t
//   t.set_access(va, total, access);           // a mapping has no access until this (cuMemMap's rule)
//   t.commit();                                // or let t go: everything it did is undone
//
// The rollback rule, the same for every user (arena, growable_buffer, kv_cache, IPC import):
//   every mapping the transaction made is unmapped, newest first; a handle the caller created for
//   it is released, a handle the caller lent (pooled, idle, imported-and-kept) is handed back in
//   returned(). A call the driver refuses is made once more; if it is still refused, the work goes
//   to `strays`: a mapping still in place (its VA must not be used until retry() undoes it) or a
//   handle still to release. Nothing is lost and nothing is handed out twice.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "vm/driver.hpp"

namespace vmm::vm {

// Work a refused rollback or release left behind, retried by the owner before its next mapping,
// on trim and at teardown.
class strays {
 public:
  struct entry {
    std::uintptr_t va = 0;  // the mapping, when `mapped`
    std::size_t size = 0;
    mem_handle h = 0;
    bool mapped = false;    // the mapping still has to be undone before the release
  };
  void add_mapping(std::uintptr_t va, std::size_t size, mem_handle h) { v_.push_back({va, size, h, true}); }
  void add_handle(mem_handle h, std::size_t size) { v_.push_back({0, size, h, false}); }
  // Moves another list's entries here (a job's rollback work into its owner's list).
  void take(strays& o) {
    v_.insert(v_.end(), o.v_.begin(), o.v_.end());
    o.v_.clear();
  }
  // Unmaps (then releases) what is parked, each call made twice at most. Returns the first refusal;
  // what is still refused stays parked. released: bytes whose handle went back to the driver.
  status retry(driver& d, std::size_t* released = nullptr);
  bool empty() const noexcept { return v_.empty(); }
  // Whether a mapping the driver refused to undo is still in place (its reservation must stay).
  bool holds_mappings() const noexcept {
    for (const auto& e : v_)
      if (e.mapped) return true;
    return false;
  }
  std::size_t size() const noexcept { return v_.size(); }
  const std::vector<entry>& entries() const noexcept { return v_; }
  std::size_t bytes() const noexcept;  // physical bytes parked (still held)

 private:
  std::vector<entry> v_;
};

class mapping_txn {
 public:
  mapping_txn(driver& d, strays& s) noexcept : d_(d), s_(s) {}
  ~mapping_txn() { rollback(); }
  mapping_txn(const mapping_txn&) = delete;
  mapping_txn& operator=(const mapping_txn&) = delete;

  // Maps h (size bytes, offset 0) at va. created: the rollback releases h; else it is handed back.
  // On failure h is not mapped and is already handed back / released by the rule above.
  status map(std::uintptr_t va, std::size_t size, mem_handle h, bool created);
  status set_access(std::uintptr_t va, std::size_t size, std::span<const access_desc> acc) {
    return d_.set_access(va, size, acc);
  }
  void commit() noexcept { done_.clear(); }
  // Undoes every mapping made (see the rule). Called by the destructor when not committed.
  void rollback() noexcept;

  struct lent {
    mem_handle h;
    std::size_t size;
  };
  // Lent handles given back by a rollback (or a failed map): the caller's to pool again.
  std::vector<lent>& returned() noexcept { return back_; }
  // Bytes of handles the rollback released (created ones).
  std::size_t released_bytes() const noexcept { return released_; }

 private:
  struct piece {
    std::uintptr_t va;
    std::size_t size;
    mem_handle h;
    bool created;
  };
  void give_back(mem_handle h, std::size_t size, bool created) noexcept;

  driver& d_;
  strays& s_;
  std::vector<piece> done_;
  std::vector<lent> back_;
  std::size_t released_ = 0;
};

}  // namespace vmm::vm
