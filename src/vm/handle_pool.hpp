// SPDX-License-Identifier: Apache-2.0
// vm::handle_pool: idle physical handles an owner lends to another user of the same backend, and
// takes back. An allocator is one (its arena's idle handles); a growable_buffer made with
// growable_buffer::shared borrows from it. Each call takes the owner's own lock; a lent handle is
// the borrower's alone until it comes back, so no two users ever call the driver on it at once.
#pragma once

#include <cstddef>

#include "vmmalloc/backend.hpp"

namespace vmm::vm {

class handle_pool {
 public:
  virtual ~handle_pool() = default;
  // The backend the handles belong to (the borrower maps them through it).
  virtual backend_iface& backend() = 0;
  // Lends the largest idle handle of at most max bytes that no other work may still touch;
  // false when there is none.
  virtual bool lend(std::size_t max, mem_handle& h, std::size_t& size) = 0;
  // A handle the borrower no longer maps. false: the owner cannot hold it (its memory limit); the
  // borrower releases it.
  virtual bool take_back(mem_handle h, std::size_t size) = 0;
};

}  // namespace vmm::vm
