// SPDX-License-Identifier: Apache-2.0
// Inside libvmmalloc_torch.so: what torch_share.cpp needs of torch_allocator.cpp (hidden
// symbols, like everything here but the vmm_torch_* functions).
#pragma once

#include <string>

#include "vmmalloc/vmmalloc.hpp"

namespace vmm::torch_lib {
vmm::allocator* existing_allocator(int device) noexcept;  // nullptr while it has none
vmm::allocator* allocator_of(int device) noexcept;        // created on first use; nullptr + last error
vmm::backend_iface* backend_of(int device) noexcept;      // the existing allocator's backend
void set_last_error(const std::string& s) noexcept;
// vmm_torch_free calls it first: closes the fds of the block's export, if it was shared. One
// relaxed load when nothing is shared.
void forget_share(const void* ptr) noexcept;
}  // namespace vmm::torch_lib
