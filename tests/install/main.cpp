// Consumer check, C++ API: allocate, write, free on the host backend; bad input is reported and
// leaves the allocator intact.
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
    std::printf("consumer_cxx FAILED: reported=%d check='%s'\n", reported, why.c_str());
    return 1;
  }
  std::printf("consumer_cxx ok\n");
  return 0;
}
