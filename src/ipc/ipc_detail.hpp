// SPDX-License-Identifier: Apache-2.0
// Private to src/ipc: what the handle, transport and import parts share. The handle part
// (handle.cpp) defines these; the wire format's sizes live here because the transport bounds a
// frame by them.
#pragma once

#include <cstddef>
#include <string>

#include "vmmalloc/ipc.hpp"

namespace vmm::ipc::detail {

// A status with a static reason (status::name) and, in `why`, the reason with the values.
status fail(std::string* why, errc k, int code, const char* name, const char* op,
            const std::string& detail) noexcept;

// "No such file or directory (errno 2)".
std::string errno_text(int e);

// Throws what a failed status stands for: out_of_memory for errc::out_of_memory, else error.
[[noreturn]] void raise(const status& s, const std::string& why);

// The checks shared by serialize, deserialize, send and import. `op` names the caller.
status check_fields(const export_handle& h, bool need_fds, const char* op, std::string* why) noexcept;

// Serialised sizes beyond the header (ipc.hpp has the header and the layout).
inline constexpr std::size_t chunk_record_bytes = 16;  // u64 size, u8 kind, u8[7] zero
inline constexpr std::size_t fabric_bytes = sizeof(shareable_handle{}.fabric);

}  // namespace vmm::ipc::detail
