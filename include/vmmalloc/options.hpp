// SPDX-License-Identifier: Apache-2.0
// vmmalloc options: the policy of one allocator. The table itself, with every default and what
// it costs, is options.def; this header turns it into struct vmm::options, and gives the table's
// rows to code that reads or writes options as text (set_option, describe, option_table).
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "vmmalloc/error.hpp"

namespace vmm {

enum class location_kind : std::uint8_t { device, host_numa };
enum class compression_mode : std::uint8_t { off, prefer, require };
enum class ipc_kind : std::uint8_t { none, posix_fd, fabric };
enum class access_mode : std::uint8_t { none, read, read_write };

// Enumerator names in value order: what set_option reads and describe writes. Kept next to the
// enums: an enumerator added above needs its name here.
inline constexpr std::string_view location_kind_names[] = {"device", "host_numa"};
inline constexpr std::string_view compression_mode_names[] = {"off", "prefer", "require"};
inline constexpr std::string_view ipc_kind_names[] = {"none", "posix_fd", "fabric"};
inline constexpr std::string_view access_mode_names[] = {"none", "read", "read_write"};
constexpr std::span<const std::string_view> enum_names(location_kind) { return location_kind_names; }
constexpr std::span<const std::string_view> enum_names(compression_mode) { return compression_mode_names; }
constexpr std::span<const std::string_view> enum_names(ipc_kind) { return ipc_kind_names; }
constexpr std::span<const std::string_view> enum_names(access_mode) { return access_mode_names; }

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

// ---- the table's rows, and options as text ---------------------------------------------------

// How a value is written and parsed (options.def's kind column).
enum class option_kind : std::uint8_t {
  integer,      // "3", "-1"
  size,         // bytes with an optional K/M/G/T suffix (binary): "512M", "4096", "64 KiB"
  size_or_max,  // a size, or "max" = SIZE_MAX (no limit)
  pow2,         // a size that is a power of two
  boolean,      // 0/1, true/false, on/off, yes/no
  location,     // location_kind_names
  compression,  // compression_mode_names
  ipc,          // ipc_kind_names
  peers,        // "[1,3,cpu,2:read]": devices, read_write unless ":read"; "[]" or "none" = none
  path,         // as is; "" = off
};

// How the C API's vmm_policy carries an option (options.def's in_c column).
enum class c_field : std::uint8_t {
  none,          // not in vmm_policy
  zero_default,  // a member of the same name; 0 (NULL) there means the default
  as_is,         // a member of the same name, taken as is; vmm_policy_init writes the default
};

struct option_info {
  std::string_view name;          // the vmm::options member
  option_kind kind;
  std::string_view env;           // variable read by libvmmalloc_torch; "" = none
  c_field in_c;
  std::string_view doc;           // one line: what it does
  std::string default_text;       // the default, as describe writes it: "8M", "max", "true"
};

// Every row of options.def, in table order.
std::span<const option_info> option_table();
// The row of option `name`; nullptr when there is none.
const option_info* find_option(std::string_view name);

// Sets one option from text, parsed by its row's kind. Unknown name or bad value: errc::invalid_value,
// `o` untouched, and *why (when given) says which option and what was expected:
//   "memory_limit='lots': not a size (expected bytes with an optional K/M/G/T suffix, e.g. 512M, or max)"
// label replaces the option's name in that message (libvmmalloc_torch names the variable).
status set_option(options& o, std::string_view name, std::string_view value, std::string* why = nullptr);
status set_option(options& o, const option_info& row, std::string_view value, std::string* why = nullptr,
                  std::string_view label = {});

// One option's value as text that set_option reads back: "8M", "max", "host_numa", "[1,2]".
std::string option_value(const options& o, const option_info& row);
// "device=0 peers=[] ... trace_path=": every row, in table order, separated by spaces (a path
// holding spaces reads back only row by row, through option_value).
std::string describe(const options& o);

}  // namespace vmm
