// SPDX-License-Identifier: Apache-2.0
// vm::mapping: the one path every layer maps memory with (arena growth, growable_buffer, kv_cache
// pages, IPC import): create-or-lend -> map -> set_access, all or nothing, and one way to keep
// what a refused undo leaves behind.
//
//   mapping_txn t(driver, strays);
//   std::vector<piece> ps = {{2 MiB, idle_handle}, {8 MiB}};   // h == 0: created by place()
//   if (t.place(va, ps, access, create).ok()) t.commit();      // else let t go: undone
//
// The undo rule, the same for every user:
//   every mapping the transaction made is unmapped, newest first; a handle it created (or the
//   caller created for it: piece::created) is released, a handle the caller lent (pooled, idle,
//   kept) is handed back in returned(). A call the driver refuses is made once more; if it is
//   still refused, the work goes to `strays`: a mapping still in place (its VA must not be used
//   until retry() undoes it) or a handle still to release. Nothing is lost and nothing is handed
//   out twice.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "vm/driver.hpp"

namespace vmm::vm {

// Work a refused undo or release left behind, retried by the owner before its next mapping, on
// trim and at teardown.
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
  // A mapping of a handle that another mapping still holds: only the unmap is owed (h == 0).
  void add_unmap(std::uintptr_t va, std::size_t size) { v_.push_back({va, size, 0, true}); }
  // Moves another list's entries here (a job's undo work into its owner's list).
  void take(strays& o) {
    v_.insert(v_.end(), o.v_.begin(), o.v_.end());
    o.v_.clear();
  }
  // Unmaps (then releases) what is parked, each call made twice at most. Returns the first refusal;
  // what is still refused stays parked. released: bytes whose handle went back to the driver.
  status retry(driver& d, std::size_t* released = nullptr);
  bool empty() const noexcept { return v_.empty(); }
  std::size_t size() const noexcept { return v_.size(); }
  const std::vector<entry>& entries() const noexcept { return v_; }
  std::size_t bytes() const noexcept;  // physical bytes parked (still held)
  // Whether a mapping the driver refused to undo is still in place (its reservation must stay).
  bool holds_mappings() const noexcept {
    for (const auto& e : v_)
      if (e.mapped) return true;
    return false;
  }

 private:
  std::vector<entry> v_;
};

// One piece of a mapping: a handle to map, or none yet (h == 0: place() creates it).
struct piece {
  std::size_t size = 0;
  mem_handle h = 0;
  bool created = false;  // released by the undo (set by place() for what it creates); else lent
};
// Makes a handle of `size` bytes (the caller's properties and policies).
using create_fn = std::function<result<mem_handle>(std::size_t)>;

class mapping_txn {
 public:
  mapping_txn(driver& d, strays& s) noexcept : d_(&d), s_(&s) {}
  ~mapping_txn() { rollback(); }
  mapping_txn(mapping_txn&& o) noexcept
      : d_(o.d_), s_(o.s_), done_(std::move(o.done_)), back_(std::move(o.back_)), released_(o.released_) {
    o.done_.clear();
  }
  mapping_txn& operator=(mapping_txn&& o) noexcept {
    if (this != &o) {
      rollback();
      d_ = o.d_;
      s_ = o.s_;
      done_ = std::move(o.done_);
      back_ = std::move(o.back_);
      released_ = o.released_;
      o.done_.clear();
    }
    return *this;
  }
  mapping_txn(const mapping_txn&) = delete;
  mapping_txn& operator=(const mapping_txn&) = delete;

  // The sequence: for each piece in order, create it if it has no handle, map it after the one
  // before (from va); then one set_access over the whole range (a mapping has no access until
  // then: cuMemMap's rule). On failure the pieces not mapped are handed back (lent) or released
  // (created) at once, and what was mapped stays for rollback() or the destructor. failed: the
  // index of the piece whose create or map failed (pieces.size(): the set_access).
  status place(std::uintptr_t va, std::span<piece> pieces, std::span<const access_desc> access,
               const create_fn& create = {}, std::size_t* failed = nullptr);
  // One piece: maps h (size bytes, offset 0) at va. created: the undo releases h; else it is
  // handed back. On failure h is not mapped and is already handed back / released.
  status map(std::uintptr_t va, std::size_t size, mem_handle h, bool created);
  status set_access(std::uintptr_t va, std::size_t size, std::span<const access_desc> acc) {
    return d_->set_access(va, size, acc);
  }
  void commit() noexcept { done_.clear(); }
  // Undoes every mapping made (the rule above). Called by the destructor when not committed.
  void rollback() noexcept;

  struct lent {
    mem_handle h;
    std::size_t size;
  };
  // Lent handles given back by a failure or a rollback: the caller's to pool again.
  std::vector<lent>& returned() noexcept { return back_; }
  // Bytes of handles the undo released (created ones).
  std::size_t released_bytes() const noexcept { return released_; }

 private:
  void give_back(mem_handle h, std::size_t size, bool created) noexcept;

  struct mapped {
    std::uintptr_t va;
    std::size_t size;
    mem_handle h;
    bool created;
  };
  driver* d_;
  strays* s_;
  std::vector<mapped> done_;  // in the order they were made
  std::vector<lent> back_;
  std::size_t released_ = 0;
};

}  // namespace vmm::vm
