// SPDX-License-Identifier: Apache-2.0
// vmmalloc errors: what every layer returns (status, result) and what the C++ API throws.
//
//   status      a failure's kind, the driver's own code and name, and the operation that failed;
//               returned by backends and internal layers, never thrown.
//   vmm::error  std::system_error carrying a status: "cuMemMap: CUDA_ERROR_INVALID_VALUE (1)".
//   vmm::out_of_memory  std::bad_alloc carrying a status (physical memory, the policy's limit,
//               or the reservation).
#pragma once

#include <new>
#include <string>
#include <system_error>

namespace vmm {

// What the core needs to know about a failure, independent of the backend.
enum class errc : int {
  ok = 0,
  out_of_memory,   // CUDA_ERROR_OUT_OF_MEMORY, ENOMEM, reservation exhausted
  invalid_value,   // bad argument (CUDA_ERROR_INVALID_VALUE, EINVAL)
  not_permitted,   // CUDA_ERROR_NOT_PERMITTED, EPERM/EACCES
  not_supported,   // CUDA_ERROR_NOT_SUPPORTED, ENOSYS
  no_driver,       // libcuda.so.1 missing, or cuInit failed with no device
  invalid_pointer, // front end: pointer not from this allocator / interior / double free
  other,
};
const char* errc_name(errc e) noexcept;

// A failure: generic kind + the driver's own code and name + the operation that failed.
struct status {
  errc kind = errc::ok;
  int code = 0;           // CUresult, or errno for the host backend
  const char* name = "";  // "CUDA_ERROR_OUT_OF_MEMORY", "ENOMEM" (static storage)
  const char* op = "";    // "cuMemCreate", "mmap" (static storage)

  constexpr bool ok() const noexcept { return kind == errc::ok; }
  static constexpr status success() noexcept { return {}; }
  std::string message() const;  // "cuMemCreate: CUDA_ERROR_OUT_OF_MEMORY (2)"
};

template <class T>
struct result {
  T value{};
  status st{};
  constexpr bool ok() const noexcept { return st.ok(); }
};

const std::error_category& category() noexcept;
inline std::error_code make_error_code(errc e) noexcept { return {static_cast<int>(e), category()}; }

// A failure with the driver's code and name: "cuMemMap: CUDA_ERROR_INVALID_VALUE (1)".
class error : public std::system_error {
 public:
  error(const status& s, const std::string& what);
  const char* what() const noexcept override { return what_.c_str(); }  // no category suffix
  const status& st() const noexcept { return st_; }

 private:
  status st_;
  std::string what_;
};

// Out of memory (physical, policy limit, or reservation). Catchable as std::bad_alloc.
class out_of_memory : public std::bad_alloc {
 public:
  out_of_memory(const status& s, std::string what) : st_(s), what_(std::move(what)) {}
  const char* what() const noexcept override { return what_.c_str(); }
  const status& st() const noexcept { return st_; }

 private:
  status st_;
  std::string what_;
};

// Throws the right exception for a failed status (out_of_memory for errc::out_of_memory).
[[noreturn]] void throw_status(const status& s, const std::string& context);

// The last error on this thread (try_* calls and the C API set it).
struct last_error_info {
  status st;
  std::string message;
};
const last_error_info& last_error() noexcept;
// Sets this thread's last error: "context: <status message><detail>" ("" when s is ok).
void set_last_error(const status& s, const char* context, const std::string& detail = {});
// Throws this thread's last error as out_of_memory / error, its message prefixed by `where`.
[[noreturn]] void throw_last_error(const std::string& where);

}  // namespace vmm

template <>
struct std::is_error_code_enum<vmm::errc> : std::true_type {};
