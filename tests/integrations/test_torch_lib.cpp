// SPDX-License-Identifier: Apache-2.0
// libvmmalloc_torch.so on the host backend (CI, no GPU): what PyTorch sees through the C functions.
// The throwing malloc can only be tested from C++ (ctypes cannot catch a C++ exception); the rest
// of the C API is tested from Python in test_torch_lib_host.py.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
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
  std::vector<std::uint64_t> v(128);
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
  CHECK(what.rfind("CUDA out of memory. vmmalloc cannot allocate 64.00 MiB on device 6: ", 0) == 0);
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

namespace {
// The message of vmm_torch_malloc's exception on device d ("" when it did not throw).
std::string malloc_error(int d) {
  try {
    void* p = vmm_torch_malloc(4096, d, nullptr);
    vmm_torch_free(p, 4096, d, nullptr);
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST_CASE("VMMALLOC_OPTIONS: bad items throw naming the item and create nothing") {
  const int d = 1;
  const char* cases[][2] = {
      {"nope=1", "VMMALLOC_OPTIONS: unknown option 'nope'"},
      {"free_memory_margin=lots", "VMMALLOC_OPTIONS free_memory_margin='lots'"},
      {"alignment=512,reservation_size=16384T", "reservation size out of range"},  // refused by the arena
      {"max_growth=32M", "VMMALLOC_OPTIONS: unknown option 'max_growth'"},  // the allocator's own choice
      {"device=2", "'device' is not an option here"},
      {"32M", "'32M' is not name=value"},
  };
  for (auto& c : cases) {
    setenv("VMMALLOC_OPTIONS", c[0], 1);
    const std::string what = malloc_error(d);
    unsetenv("VMMALLOC_OPTIONS");
    const std::string item = c[0];
    CAPTURE(item);
    CAPTURE(what);
    CHECK(what.find(c[1]) != std::string::npos);
    CHECK(vmm_torch_initialized(d) == 0);
  }
}

TEST_CASE("a VMMALLOC_ variable that is not the library's is refused, naming it, and creates nothing") {
  const int d = 1;
  for (const char* var : {"VMMALLOC_MAX_GROWTH", "VMMALLOC_RELEASE_TRESHOLD"}) {
    CAPTURE(var);
    setenv(var, "32M", 1);
    const std::string what = malloc_error(d);
    unsetenv(var);
    CAPTURE(what);
    CHECK(what.find(std::string(var) + ": not a vmmalloc variable") != std::string::npos);
    CHECK(vmm_torch_initialized(d) == 0);
  }
}

TEST_CASE("VMMALLOC_OPTIONS sets rows without a variable of their own; a row's variable wins") {
  const int d = 1;
  setenv("VMMALLOC_OPTIONS", "alignment=1K,release_threshold=32M,peers=0,2,thread_cache=false", 1);
  setenv("VMMALLOC_RELEASE_THRESHOLD", "16M", 1);
  REQUIRE(vmm_torch_init(d) == 0);
  unsetenv("VMMALLOC_OPTIONS");
  unsetenv("VMMALLOC_RELEASE_THRESHOLD");
  const std::string config = vmm_torch_config(d);
  CAPTURE(config);
  CHECK(config.find("alignment=1K") != std::string::npos);
  CHECK(config.find("thread_cache=false") != std::string::npos);
  CHECK(config.find("release_threshold=16M") != std::string::npos);  // its variable over the list
  CHECK(config.find("peers=[0,2]") != std::string::npos);     // "2" continued the peers value
  void* p = vmm_torch_malloc(1 << 20, d, nullptr);
  REQUIRE(p != nullptr);
  vmm_torch_free(p, 1 << 20, d, nullptr);
  CHECK(vmm_torch_check(d) == 0);
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

// PyTorch allocates on its main thread and frees on the autograd thread; vmmalloc's thread caches
// serve both without a lock. The requested and allocated bytes PyTorch reads, and their peaks,
// must still be the exact figures of the program's blocks.
TEST_CASE("stats: requested and allocated peaks are exact while blocks move through thread caches") {
  const int d = 5;  // the racing case above made it: its peaks start from what lives there
  REQUIRE(vmm_torch_init(d) == 0);
  REQUIRE(vmm_torch_reset_peaks(d) == 0);
  const std::uint64_t r0 = stat(d, "requested"), a0 = stat(d, "allocated");
  CHECK(stat(d, "peak_requested") == r0);
  auto rounded = [](std::uint64_t n) { return (n + 511) / 512 * 512; };
  // One thread reuses one small block and one large block through its cache, many times.
  for (int i = 0; i < 5000; ++i) {
    void* p = vmm_torch_malloc(3000, d, nullptr);
    void* q = vmm_torch_malloc(1 << 20, d, nullptr);
    vmm_torch_free(q, 1 << 20, d, nullptr);
    vmm_torch_free(p, 3000, d, nullptr);
  }
  CHECK(stat(d, "requested") == r0);
  CHECK(stat(d, "peak_requested") == r0 + 3000 + (1 << 20));
  CHECK(stat(d, "peak_allocated") == a0 + rounded(3000) + (1 << 20));
  // Rounds of 1-8 MiB blocks allocated on one thread, all live at once, freed on another.
  std::uint64_t most = 0, most_rounded = 0;
  for (int round = 0; round < 3; ++round) {
    std::vector<std::pair<void*, std::uint64_t>> blocks;
    std::uint64_t sum = 0, sum_rounded = 0;
    std::thread([&] {
      for (int i = 0; i < 20 + 10 * round; ++i) {
        const std::uint64_t n = (std::uint64_t{1} << 20) * (1 + (i * 7 + round) % 8) + 100 * i;
        void* p = vmm_torch_malloc(static_cast<std::int64_t>(n), d, nullptr);
        blocks.emplace_back(p, n);
        sum += n;
        sum_rounded += rounded(n);
      }
    }).join();
    std::thread([&] {
      for (auto [p, n] : blocks) vmm_torch_free(p, static_cast<std::int64_t>(n), d, nullptr);
    }).join();
    most = std::max(most, sum);
    most_rounded = std::max(most_rounded, sum_rounded);
  }
  CHECK(stat(d, "requested") == r0);
  CHECK(stat(d, "allocated") == a0);
  CHECK(stat(d, "peak_requested") == r0 + most);
  CHECK(stat(d, "peak_allocated") == a0 + most_rounded);
  // reset_peaks starts them over from what is live now.
  void* keep = vmm_torch_malloc(5000, d, nullptr);
  CHECK(vmm_torch_reset_peaks(d) == 0);
  CHECK(stat(d, "peak_requested") == r0 + 5000);
  CHECK(stat(d, "peak_allocated") == a0 + rounded(5000));
  vmm_torch_free(keep, 5000, d, nullptr);
  CHECK(vmm_torch_check(d) == 0);
}

namespace {
void* S(std::uintptr_t i) { return reinterpret_cast<void*>(i); }
struct capture_ctx {
  void* stream;
  int calls = 0;
};
int accept_capture_stream(void* s, void* user) {
  auto* c = static_cast<capture_ctx*>(user);
  ++c->calls;
  return s == c->stream ? 1 : 0;
}
}  // namespace

TEST_CASE("graph pools through the C functions: begin, end, release, pool_of, pool_stats, stats") {
  const int d = 3;
  capture_ctx c{S(0x10)};
  void* before = vmm_torch_malloc(1 << 20, d, S(0x20));  // creates device 3's allocator
  REQUIRE(before != nullptr);
  CHECK(stat(d, "pools") == 0);
  REQUIRE(vmm_torch_begin_pool(d, 42, accept_capture_stream, &c) == 0);
  void* in = vmm_torch_malloc(3 << 20, d, c.stream);
  void* out = vmm_torch_malloc(3 << 20, d, S(0x20));
  REQUIRE(in != nullptr);
  REQUIRE(out != nullptr);
  CHECK(c.calls >= 2);  // asked for both allocations
  std::uint64_t pool = 0, live = 0, allocated = 0, held = 0;
  CHECK(vmm_torch_pool_of(in, &pool) == 1);
  CHECK(pool == 42);
  CHECK(vmm_torch_pool_of(out, &pool) == 0);
  CHECK(vmm_torch_pool_of(static_cast<char*>(in) + 256, &pool) == 0);
  CHECK(vmm_torch_pool_stats(d, 42, &live, &allocated, &held) == 1);
  CHECK(live == 1);
  CHECK(allocated >= (3u << 20));
  CHECK(held >= (3u << 20));
  CHECK(stat(d, "pools") == 1);
  CHECK(stat(d, "pool_allocated") == allocated);
  CHECK(stat(d, "pool_held") == held);

  CHECK(vmm_torch_release_pool(d, 42) == -1);  // still begun
  CHECK(std::string(vmm_torch_last_error()).find("still allocates") != std::string::npos);
  CHECK(vmm_torch_end_pool(d, 42) == 0);
  CHECK(vmm_torch_end_pool(d, 42) == -1);
  CHECK(std::string(vmm_torch_last_error()).find("never begun") != std::string::npos);
  CHECK(vmm_torch_end_pool(d, 43) == -1);
  CHECK(vmm_torch_end_pool(1000, 42) == -1);
  CHECK(std::string(vmm_torch_last_error()).find("out of range") != std::string::npos);

  vmm_torch_free(in, 3 << 20, d, c.stream);     // back to the pool, not to other work
  void* other = vmm_torch_malloc(3 << 20, d, c.stream);
  CHECK(other != in);
  CHECK(vmm_torch_pool_of(other, &pool) == 0);  // the pool is ended: no longer allocates
  CHECK(vmm_torch_pool_stats(d, 42, &live, &allocated, &held) == 1);
  CHECK(live == 0);
  CHECK(held >= (3u << 20));                    // its memory stays its own until released
  CHECK(vmm_torch_release_pool(d, 42) == 0);
  CHECK(vmm_torch_pool_stats(d, 42, &live, &allocated, &held) == 0);
  CHECK(stat(d, "pools") == 0);
  CHECK(stat(d, "pool_held") == 0);
  CHECK(vmm_torch_release_pool(d, 42) == -1);   // unknown now
  CHECK(std::string(vmm_torch_last_error()).find("no such pool") != std::string::npos);

  // A pool begun on a device with no allocator yet creates it; NULL filter = every stream.
  REQUIRE(vmm_torch_initialized(2) == 0);
  REQUIRE(vmm_torch_begin_pool(2, 7, nullptr, nullptr) == 0);
  CHECK(vmm_torch_initialized(2) == 1);
  void* any = vmm_torch_malloc(4096, 2, S(0x99));
  CHECK(vmm_torch_pool_of(any, &pool) == 1);
  CHECK(pool == 7);
  CHECK(vmm_torch_end_pool(2, 7) == 0);
  CHECK(vmm_torch_release_pool(2, 7) == 0);     // one live block keeps it alive
  CHECK(vmm_torch_pool_stats(2, 7, &live, nullptr, nullptr) == 1);
  CHECK(live == 1);
  vmm_torch_free(any, 4096, 2, S(0x99));
  CHECK(vmm_torch_pool_stats(2, 7, &live, nullptr, nullptr) == 0);  // dropped with its last block

  vmm_torch_free(other, 3 << 20, d, c.stream);
  vmm_torch_free(out, 3 << 20, d, S(0x20));
  vmm_torch_free(before, 1 << 20, d, S(0x20));
  CHECK(stat(d, "live") == 0);
  CHECK(vmm_torch_check(d) == 0);
  CHECK(vmm_torch_check(2) == 0);
}

TEST_CASE("record_stream finds the device from the pointer and refuses what is not a live block") {
  const int d = 4;
  void* p = vmm_torch_malloc(2 << 20, d, S(1));
  void* q = vmm_torch_malloc(1 << 20, 3, S(1));  // device 3's allocator exists (case above)
  REQUIRE(p != nullptr);
  REQUIRE(q != nullptr);
  CHECK(vmm_torch_device_of(p) == d);
  CHECK(vmm_torch_device_of(q) == 3);
  CHECK(vmm_torch_device_of(nullptr) == -1);
  int local = 0;
  CHECK(vmm_torch_device_of(&local) == -1);
  CHECK(vmm_torch_record_stream(p, S(2)) == 0);
  CHECK(vmm_torch_record_stream(q, S(2)) == 0);
  CHECK(vmm_torch_record_stream(&local, S(2)) == -1);
  CHECK(std::string(vmm_torch_last_error()).find("not from vmmalloc") != std::string::npos);
  CHECK(vmm_torch_record_stream(static_cast<char*>(p) + 4096, S(2)) == -1);  // interior
  CHECK(std::string(vmm_torch_last_error()).find("record_stream on device 4") != std::string::npos);
  vmm_torch_free(p, 2 << 20, d, S(1));
  vmm_torch_free(q, 1 << 20, 3, S(1));
  CHECK(vmm_torch_record_stream(p, S(2)) == -1);  // freed
  CHECK(stat(d, "live") == 0);
  CHECK(stat(d, "free_failures") == 0);
  CHECK(vmm_torch_check(d) == 0);
}

TEST_CASE("mem_info: the device's free and total memory; errors for a device without an allocator") {
  const int d = 0;
  std::uint64_t free0 = 0, total = 0, free1 = 0, total1 = 0;
  CHECK(vmm_torch_mem_info(d, &free0, &total) == -1);  // nothing allocated on device 0 yet
  CHECK(std::string(vmm_torch_last_error()).find("has no allocator") != std::string::npos);
  void* p = vmm_torch_malloc(64 << 20, d, nullptr);
  REQUIRE(p != nullptr);
  REQUIRE(vmm_torch_mem_info(d, &free0, &total) == 0);
  CHECK(total > 0);
  CHECK(free0 < total);  // the 64 MiB chunk is the device's memory in use
  vmm_torch_free(p, 64 << 20, d, nullptr);
  REQUIRE(vmm_torch_trim(d) == 0);
  REQUIRE(vmm_torch_mem_info(d, &free1, &total1) == 0);
  CHECK(total1 == total);
  CHECK(free1 >= free0 + (64u << 20));  // trim gave the chunk back
  CHECK(vmm_torch_mem_info(d, nullptr, &total) == -1);
  CHECK(vmm_torch_mem_info(-1, &free0, &total) == -1);
  CHECK(vmm_torch_mem_info(1000, &free0, &total) == -1);
}

TEST_CASE("set_memory_fraction: the device's limit as a fraction of its memory; bad input refused") {
  const int d = 2;
  std::uint64_t free = 0, total = 0;
  REQUIRE(vmm_torch_init(d) == 0);
  REQUIRE(vmm_torch_mem_info(d, &free, &total) == 0);
  double f = -1;
  REQUIRE(vmm_torch_memory_fraction(d, &f) == 0);
  CHECK(f == 1.0);  // no limit

  const double frac = static_cast<double>(64 << 20) / static_cast<double>(total);  // 64 MiB
  REQUIRE(vmm_torch_set_memory_fraction(d, frac) == 0);
  REQUIRE(vmm_torch_memory_fraction(d, &f) == 0);
  CHECK(f == doctest::Approx(frac).epsilon(1e-9));
  void* p = vmm_torch_try_malloc(48 << 20, d, nullptr);
  REQUIRE(p != nullptr);
  CHECK(vmm_torch_try_malloc(32 << 20, d, nullptr) == nullptr);  // 48 + 32 MiB > 64 MiB
  CHECK(std::string(vmm_torch_last_error()).find("limit") != std::string::npos);
  CHECK(stat(d, "peak_physical") <= (64u << 20));

  // Bad input: refused with the reason, the fraction unchanged.
  CHECK(vmm_torch_set_memory_fraction(d, 1.5) == -1);
  CHECK(std::string(vmm_torch_last_error()).find("fraction must lie in [0, 1], got 1.5") != std::string::npos);
  CHECK(vmm_torch_set_memory_fraction(d, -0.25) == -1);
  CHECK(vmm_torch_set_memory_fraction(d, std::numeric_limits<double>::quiet_NaN()) == -1);
  CHECK(vmm_torch_set_memory_fraction(-1, 0.5) == -1);
  CHECK(std::string(vmm_torch_last_error()).find("out of range") != std::string::npos);
  CHECK(vmm_torch_set_memory_fraction(1000, 0.5) == -1);
  CHECK(vmm_torch_memory_fraction(d, nullptr) == -1);
  CHECK(vmm_torch_memory_fraction(-1, &f) == -1);
  REQUIRE(vmm_torch_memory_fraction(d, &f) == 0);
  CHECK(f == doctest::Approx(frac).epsilon(1e-9));

  // Raised to the whole device: the 32 MiB block fits.
  REQUIRE(vmm_torch_set_memory_fraction(d, 1.0) == 0);
  REQUIRE(vmm_torch_memory_fraction(d, &f) == 0);
  CHECK(f == 1.0);
  void* q = vmm_torch_try_malloc(32 << 20, d, nullptr);
  CHECK(q != nullptr);
  vmm_torch_free(q, 32 << 20, d, nullptr);
  vmm_torch_free(p, 48 << 20, d, nullptr);
  CHECK(vmm_torch_check(d) == 0);
}

TEST_CASE("blocks on the same chunks are imported as one mapping; each import is closed on its own") {
  const int d = 7;  // exportable: no case before this one creates device 7's allocator
  setenv("VMMALLOC_IPC", "posix_fd", 1);
  REQUIRE(vmm_torch_init(d) == 0);
  unsetenv("VMMALLOC_IPC");
  auto* p1 = static_cast<unsigned char*>(vmm_torch_try_malloc(4096, d, nullptr));
  auto* p2 = static_cast<unsigned char*>(vmm_torch_try_malloc(4096, d, nullptr));
  REQUIRE(p1);
  REQUIRE(p2);
  std::memset(p1, 0x11, 4096);
  std::memset(p2, 0x22, 4096);
  auto share = [](const void* p) {
    std::string h(4096, '\0');
    const std::int64_t n = vmm_torch_share(p, h.data(), static_cast<std::int64_t>(h.size()));
    REQUIRE_MESSAGE(n > 0, std::string(vmm_torch_last_error()));
    REQUIRE(n <= 4096);
    h.resize(static_cast<std::size_t>(n));
    return h;
  };
  const std::string h1 = share(p1), h2 = share(p2);
  CHECK(h1 != h2);  // other offsets
  // Both name the same chunk: the export ids after the 24-byte header are equal.
  std::uint32_t n1 = 0, n2 = 0;
  std::memcpy(&n1, h1.data() + 12, 4);
  std::memcpy(&n2, h2.data() + 12, 4);
  REQUIRE(n1 >= 1);
  REQUIRE(n1 == n2);
  REQUIRE(h1.compare(24, 8 * n1, h2, 24, 8 * n1) == 0);

  auto import = [](const std::string& h) {  // d is a constant: no capture
    return static_cast<unsigned char*>(vmm_torch_import(d, h.data(), static_cast<std::int64_t>(h.size())));
  };
  unsigned char* q1 = import(h1);
  unsigned char* q2 = import(h2);
  REQUIRE(q1);
  REQUIRE(q2);
  CHECK(q2 - q1 == p2 - p1);  // one mapping of the chunk serves both
  CHECK(q1[0] == 0x11);
  CHECK(q2[4095] == 0x22);
  unsigned char* again = import(h1);  // the same block again: the same address, counted twice
  CHECK(again == q1);
  std::uint64_t shared = 0, imported = 0;
  CHECK(vmm_torch_share_counts(&shared, &imported) == 0);
  CHECK(shared == 2);
  CHECK(imported == 3);

  CHECK(vmm_torch_close_import(q1) == 0);
  CHECK(again[1] == 0x11);  // still mapped for the second import of the block
  CHECK(vmm_torch_close_import(again) == 0);
  CHECK(vmm_torch_close_import(q1) == -1);  // closed as often as imported
  CHECK(std::string(vmm_torch_last_error()).find("not an imported pointer") != std::string::npos);
  q2[7] = 0x5A;  // the other block's import keeps the chunk mapped
  CHECK(p2[7] == 0x5A);
  CHECK(vmm_torch_close_import(q2) == 0);
  CHECK(vmm_torch_share_counts(nullptr, &imported) == 0);
  CHECK(imported == 0);

  unsigned char* q3 = import(h2);  // mapped afresh after the last close
  REQUIRE(q3);
  CHECK(q3[7] == 0x5A);
  CHECK(vmm_torch_close_import(q3) == 0);

  // Another sender's chunks with the same export ids (a different nonce) are not these chunks: a
  // forged nonce maps its own copy of the fds named.
  std::string other = h2;
  other[16] = static_cast<char>(other[16] ^ 0x40);
  unsigned char* q4 = import(h2);
  unsigned char* q5 = import(other);
  REQUIRE(q4);
  REQUIRE(q5);
  CHECK(q5 != q4);
  CHECK(q5[7] == 0x5A);  // the fds it named are this block's
  CHECK(vmm_torch_close_import(q5) == 0);
  CHECK(vmm_torch_close_import(q4) == 0);

  vmm_torch_free(p1, 4096, d, nullptr);
  vmm_torch_free(p2, 4096, d, nullptr);
  CHECK(vmm_torch_share_counts(&shared, &imported) == 0);
  CHECK(shared == 0);
  CHECK(imported == 0);
  CHECK(vmm_torch_check(d) == 0);
}

TEST_CASE("threads share, import, close and free blocks at once: every import sees its block, nothing is left") {
  const int d = 7;  // exportable (made so by the case above, or here when run alone)
  setenv("VMMALLOC_IPC", "posix_fd", 1);
  REQUIRE(vmm_torch_init(d) == 0);
  unsetenv("VMMALLOC_IPC");
  // One block every thread imports too: one mapping, its import count moved by four threads.
  auto* anchor = static_cast<unsigned char*>(vmm_torch_try_malloc(4096, d, nullptr));
  REQUIRE(anchor);
  std::memset(anchor, 0x3C, 4096);
  std::string ah(4096, '\0');
  const std::int64_t alen = vmm_torch_share(anchor, ah.data(), static_cast<std::int64_t>(ah.size()));
  REQUIRE(alen > 0);
  REQUIRE(alen <= 4096);
  ah.resize(static_cast<std::size_t>(alen));
  std::vector<std::thread> ts;
  std::vector<int> bad(4, 0);
  for (int t = 0; t < 4; ++t)
    ts.emplace_back([t, &bad, &ah] {  // d is a constant: no capture
      std::string h(4096, '\0');
      for (int i = 0; i < 200; ++i) {
        const std::int64_t n = 256 + ((i * 7919 + t * 104729) % (4 << 20));  // slab, span and chunk-crossing blocks
        auto* p = static_cast<unsigned char*>(vmm_torch_try_malloc(n, d, nullptr));
        if (!p) { ++bad[t]; continue; }
        p[0] = static_cast<unsigned char>(t * 31 + i);
        const std::int64_t len = vmm_torch_share(p, h.data(), static_cast<std::int64_t>(h.size()));
        auto* q = len > 0 && len <= 4096 ? static_cast<unsigned char*>(vmm_torch_import(d, h.data(), len)) : nullptr;
        if (!q || q[0] != p[0]) ++bad[t];
        if (q) {
          q[n - 1] = 0x77;  // the import is the block's memory
          if (p[n - 1] != 0x77) ++bad[t];
          if (vmm_torch_close_import(q) != 0) ++bad[t];
        }
        vmm_torch_free(p, n, d, nullptr);
        auto* a = static_cast<unsigned char*>(vmm_torch_import(d, ah.data(), static_cast<std::int64_t>(ah.size())));
        if (!a || a[i % 4096] != 0x3C || vmm_torch_close_import(a) != 0) ++bad[t];
      }
    });
  for (auto& th : ts) th.join();
  for (int t = 0; t < 4; ++t) CHECK_MESSAGE(bad[t] == 0, "thread " << t << ": " << vmm_torch_last_error());
  vmm_torch_free(anchor, 4096, d, nullptr);
  std::uint64_t shared = 1, imported = 1;
  CHECK(vmm_torch_share_counts(&shared, &imported) == 0);
  CHECK(shared == 0);
  CHECK(imported == 0);
  CHECK(vmm_torch_check(d) == 0);
}
