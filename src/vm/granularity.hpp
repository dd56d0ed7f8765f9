// SPDX-License-Identifier: Apache-2.0
// vm::granularity_for: the unit every size and address of a mapping is rounded to, for memory
// that one device owns and others access. It is the largest granularity among the devices (each
// must be able to map every chunk); a device that cannot access the owner is refused here, before
// anything is reserved.
#pragma once

#include <cstddef>
#include <span>
#include <string>

#include "vm/driver.hpp"

namespace vmm::vm {

// The driver's minimum granularity (2 MiB on H100/H200, equal to its recommended one there).
// why (optional) gets a full message naming the device that failed.
result<std::size_t> granularity_for(driver& d, const chunk_props& owner, std::span<const access_desc> others,
                                    std::string* why = nullptr);

}  // namespace vmm::vm
