// Error names and messages shared by every layer.
#include "vmmalloc/backend.hpp"

namespace vmm {

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

}  // namespace vmm
