// SPDX-License-Identifier: Apache-2.0
// Errors shared by every layer (error.hpp): names, messages, the error category, the exceptions
// and the thread's last error. Lives at the lowest layer because every layer returns a status.
#include "vmmalloc/error.hpp"

namespace vmm {

namespace {
class category_impl final : public std::error_category {
 public:
  const char* name() const noexcept override { return "vmmalloc"; }
  std::string message(int c) const override { return errc_name(static_cast<errc>(c)); }
};

thread_local last_error_info tl_last;
}  // namespace

const char* errc_name(errc e) noexcept {
  switch (e) {
    case errc::ok: return "ok";
    case errc::out_of_memory: return "out of memory";
    case errc::invalid_value: return "invalid value";
    case errc::not_permitted: return "not permitted";
    case errc::not_supported: return "not supported";
    case errc::no_driver: return "no CUDA driver";
    case errc::invalid_pointer: return "invalid pointer";
    case errc::other: return "error";
  }
  return "error";
}

std::string status::message() const {
  if (ok()) return "ok";
  std::string m = op && *op ? std::string(op) + ": " : std::string();
  m += name && *name ? name : errc_name(kind);
  if (code) m += " (" + std::to_string(code) + ")";
  return m;
}

const std::error_category& category() noexcept {
  static category_impl c;
  return c;
}

error::error(const status& s, const std::string& what)
    : std::system_error(make_error_code(s.kind), what), st_(s), what_(what) {}

void throw_status(const status& s, const std::string& context) {
  std::string msg = context + ": " + s.message();
  if (s.kind == errc::out_of_memory) throw out_of_memory(s, msg);
  throw error(s, msg);
}

const last_error_info& last_error() noexcept { return tl_last; }

void throw_last_error(const std::string& where) {
  const std::string msg = where + "::" + tl_last.message;
  if (tl_last.st.kind == errc::out_of_memory) throw out_of_memory(tl_last.st, msg);
  throw error(tl_last.st, msg);
}

void set_last_error(const status& s, const char* context, const std::string& detail) {
  tl_last.st = s;
  tl_last.message = s.ok() ? std::string() : std::string(context) + ": " + s.message() + detail;
}

}  // namespace vmm
