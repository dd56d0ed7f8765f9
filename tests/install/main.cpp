// SPDX-License-Identifier: Apache-2.0
// Consumer check, C++ API: allocate, write, free on the host backend; bad input is reported and
// leaves the allocator intact. Built with no standard flag of its own: the C++20 comes from the
// installed target (CMake) or from pkg-config's cxxflags variable.
#ifndef CONSUMER_NAME
#define CONSUMER_NAME "consumer_cxx"
#endif
static_assert(__cplusplus >= 202002L, "not compiled as C++20: the usage requirement did not reach this consumer");

#include <cstdio>
#include <cstring>
#include <string>

#include <vmmalloc/vmmalloc.hpp>

int main() {
  vmm::options o;
  o.reservation_size = std::size_t{1} << 30;  // 1 GiB of VA is plenty here
  vmm::allocator a = vmm::allocator::host(o);

  void* p = a.allocate(1 << 20);
  std::memset(p, 0xab, 1 << 20);  // host backend memory is CPU-accessible
  a.deallocate(p);

  bool reported = false;
  try {
    a.deallocate(p);  // double free
  } catch (const vmm::error& e) {
    reported = e.code() == vmm::errc::invalid_pointer;
  }
  std::string why = a.check();
  if (!reported || !why.empty() || a.stats().live != 0) {
    std::printf(CONSUMER_NAME " FAILED: reported=%d check='%s'\n", reported, why.c_str());
    return 1;
  }
  std::printf(CONSUMER_NAME " ok\n");
  return 0;
}
