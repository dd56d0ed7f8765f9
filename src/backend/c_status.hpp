// SPDX-License-Identifier: Apache-2.0
// The C API's status and thread-local last error, shared by every C entry point (the allocator's
// in frontend/c_api.cpp, the growable buffer's and the KV cache's in their own folders), so
// vmm_last_error() reports whichever call ran last on this thread. Internal: not installed.
//
// guard() runs a body and turns every exception into a status with the exception's own message
// (the same text the C++ API throws), so no exception crosses the C boundary.
#pragma once

#include <cstring>
#include <new>
#include <stdexcept>
#include <string>
#include <utility>

#include "vmmalloc/error.hpp"
#include "vmmalloc/vmmalloc.h"

namespace vmm::c_api {

// inline: one definition per thread across every translation unit of the library.
inline thread_local vmm_status tl_status = VMM_SUCCESS;
inline thread_local std::string tl_message;

inline vmm_status to_c(errc e) { return static_cast<vmm_status>(static_cast<int>(e)); }

inline vmm_status set(vmm_status s, std::string msg) {
  tl_status = s;
  try {
    tl_message = std::move(msg);
  } catch (...) {  // no host memory for the text: the status still says what happened
    tl_message.clear();
  }
  return s;
}
inline vmm_status ok() { return set(VMM_SUCCESS, {}); }
inline vmm_status invalid(const char* what) { return set(VMM_ERROR_INVALID_VALUE, what); }

// A C caller may store any int in an enum field; reading it as the enum type would be undefined
// for out-of-range values, so the bytes are read as an int.
template <class E>
int enum_value(const E& e) {
  static_assert(sizeof(E) == sizeof(int));
  int v;
  std::memcpy(&v, &e, sizeof v);
  return v;
}

template <class F>
vmm_status guard(F&& body) noexcept {
  try {
    body();
  } catch (const vmm::error& e) {
    return set(to_c(e.st().kind), e.what());
  } catch (const vmm::out_of_memory& e) {
    return set(VMM_ERROR_OUT_OF_MEMORY, e.what());
  } catch (const std::bad_alloc&) {
    return set(VMM_ERROR_OUT_OF_MEMORY, "out of host memory");
  } catch (const std::exception& e) {
    return set(VMM_ERROR_OTHER, e.what());
  } catch (...) {
    return set(VMM_ERROR_OTHER, "unknown exception");
  }
  return ok();
}

}  // namespace vmm::c_api
