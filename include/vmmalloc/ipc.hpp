// vmmalloc IPC: export an allocation to another process and import it there.
// (Being written: the handle below is the contract between allocator::export_ipc and the rest.)
#pragma once

#include <cstdint>
#include <vector>

#include "vmmalloc/backend.hpp"

namespace vmm::ipc {

inline constexpr std::uint32_t format_version = 1;

// One whole physical chunk of an exported allocation.
struct exported_chunk {
  std::uint64_t size = 0;     // bytes of the chunk (a granularity multiple)
  shareable_handle handle;    // posix_fd: an fd this struct owns; fabric: the 64 handle bytes
};

// What allocator::export_ipc(ptr) returns. Move-only; closes the fds it still owns.
// The allocation owns its chunks exclusively (an ipc policy puts every allocation on chunks of
// its own), so an importer maps nothing but the exported allocation.
struct export_handle {
  std::uint32_t version = format_version;
  ipc_kind kind = ipc_kind::none;
  int device = 0;                       // exporting device ordinal (host backend: simulated id)
  std::uint64_t size = 0;               // the allocation's usable bytes
  std::uint64_t offset = 0;             // where the allocation starts in the first chunk
  std::vector<exported_chunk> chunks;   // in virtual-address order; sizes sum to the mapping

  export_handle() = default;
  export_handle(export_handle&&) noexcept;
  export_handle& operator=(export_handle&&) noexcept;
  export_handle(const export_handle&) = delete;
  export_handle& operator=(const export_handle&) = delete;
  ~export_handle();
  void close_fds() noexcept;  // closes every owned fd (idempotent)
};

}  // namespace vmm::ipc
