// vmmalloc options: the policy of one allocator. The table itself, with every default and what
// it costs, is options.def; this header turns it into struct vmm::options.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

namespace vmm {

enum class location_kind : std::uint8_t { device, host_numa };
enum class compression_mode : std::uint8_t { off, prefer, require };
enum class ipc_kind : std::uint8_t { none, posix_fd, fabric };
enum class access_mode : std::uint8_t { none, read, read_write };

// access_desc::device value naming the CPU: host_numa chunks are reachable from the CPU only
// after an access entry for the host (CU_MEM_LOCATION_TYPE_HOST_NUMA) is set.
inline constexpr int cpu_device = -1;

struct access_desc {
  int device = 0;   // device ordinal (host backend: simulated id), or cpu_device
  access_mode mode = access_mode::read_write;
  friend bool operator==(const access_desc&, const access_desc&) = default;
};

struct options {
#define VMM_OPTION(kind, type, name, def, env, in_c, doc) type name = def;
#include "vmmalloc/options.def"
#undef VMM_OPTION
};

}  // namespace vmm
