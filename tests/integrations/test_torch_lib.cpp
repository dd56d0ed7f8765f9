// libvmmalloc_torch.so on the host backend (CI, no GPU): what PyTorch sees through the C functions.
// The throwing malloc can only be tested from C++ (ctypes cannot catch a C++ exception); the rest
// of the C API is tested from Python in test_torch_lib_host.py.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "vmmalloc_torch.h"

namespace {

// Stats by name (the order is vmm_torch_stat_names()).
std::uint64_t stat(int device, const char* name) {
  std::string names = vmm_torch_stat_names();
  std::vector<std::uint64_t> v(64);
  int n = vmm_torch_stats(device, v.data(), static_cast<int>(v.size()));
  REQUIRE(n > 0);
  int i = 0;
  std::size_t at = 0;
  while (at <= names.size()) {
    std::size_t end = names.find(',', at);
    if (end == std::string::npos) end = names.size();
    if (names.compare(at, end - at, name) == 0) return v[i];
    at = end + 1;
    ++i;
  }
  FAIL("no stat named " << name);
  return 0;
}

struct host_env {
  host_env() { setenv("VMMALLOC_TORCH_BACKEND", "host", 1); }
};
host_env set_before_any_case;

}  // namespace

TEST_CASE("malloc throws std::bad_alloc with the reason past the memory limit, and keeps working") {
  setenv("VMMALLOC_MEMORY_LIMIT", "16M", 1);
  REQUIRE(vmm_torch_init(6) == 0);  // the limit is read now, for device 6 only
  unsetenv("VMMALLOC_MEMORY_LIMIT");

  std::string what;
  try {
    vmm_torch_malloc(std::int64_t{64} << 20, 6, nullptr);
    FAIL("64 MiB past a 16 MiB limit did not throw");
  } catch (const std::bad_alloc& e) {
    what = e.what();
  }
  CHECK(what.find("cannot allocate 64.00 MiB on device 6") != std::string::npos);
  CHECK(std::string(vmm_torch_last_error()) == what);
  CHECK(stat(6, "malloc_failures") == 1);

  void* p = vmm_torch_malloc(1 << 20, 6, nullptr);  // within the limit: still serves
  REQUIRE(p != nullptr);
  std::memset(p, 0x5a, 1 << 20);  // host backend, device 0 is a peer: the CPU may write
  CHECK(stat(6, "live") == 1);
  vmm_torch_free(p, 1 << 20, 6, nullptr);
  CHECK(stat(6, "live") == 0);
  CHECK(vmm_torch_check(6) == 0);
}

TEST_CASE("malloc throws std::exception naming the variable for a bad option; size 0 is null") {
  setenv("VMMALLOC_RELEASE_THRESHOLD", "lots", 1);
  std::string what;
  try {
    vmm_torch_malloc(4096, 7, nullptr);
    FAIL("a bad VMMALLOC_RELEASE_THRESHOLD did not throw");
  } catch (const std::exception& e) {
    what = e.what();
  }
  unsetenv("VMMALLOC_RELEASE_THRESHOLD");
  CHECK(what.find("VMMALLOC_RELEASE_THRESHOLD='lots'") != std::string::npos);
  CHECK(vmm_torch_initialized(7) == 0);

  CHECK(vmm_torch_malloc(0, 7, nullptr) == nullptr);  // nothing created, nothing thrown
  CHECK(vmm_torch_initialized(7) == 0);
  CHECK_THROWS_AS(vmm_torch_malloc(-1, 7, nullptr), std::exception);
  CHECK_THROWS_AS(vmm_torch_malloc(4096, 1000, nullptr), std::exception);  // device out of range
}

TEST_CASE("threads racing to create one device's allocator get the same one") {
  constexpr int kThreads = 8, kEach = 200;
  std::vector<std::thread> ts;
  std::vector<int> bad(kThreads, 0);
  for (int t = 0; t < kThreads; ++t)
    ts.emplace_back([t, &bad] {
      std::vector<void*> ps;
      for (int i = 0; i < kEach; ++i) {
        void* p = vmm_torch_try_malloc(256 + 4096 * (i % 7), 5, nullptr);
        if (!p) ++bad[t];
        else ps.push_back(p);
      }
      for (void* p : ps) vmm_torch_free(p, 0, 5, nullptr);
    });
  for (auto& t : ts) t.join();
  for (int t = 0; t < kThreads; ++t) CHECK(bad[t] == 0);
  CHECK(stat(5, "allocs") == kThreads * kEach);  // one allocator counted every thread
  CHECK(stat(5, "live") == 0);
  CHECK(vmm_torch_check(5) == 0);
}
