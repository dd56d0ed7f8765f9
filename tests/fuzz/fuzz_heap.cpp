// SPDX-License-Identifier: Apache-2.0
// libFuzzer target: bytes -> a sequence of allocator operations on the host backend, with every
// invariant checked after each one. Build: tools/run-fuzz (clang++ -fsanitize=fuzzer,address,undefined).
//
// Encoding, one op per 4 bytes: [op][a][b][c]
//   op % 8: 0-2 allocate (size from a,b,c: log-uniform 1 B .. 64 MiB; stream c % 3; align from b)
//           3-4 free slot (a % live) on stream c % 3     5 double/interior/foreign free (must fail)
//           6 trim(keep = a MiB), or with b odd set_memory_limit(16 + a % 64 MiB; a = 0: none)
//           7 record_stream(slot a, stream c % 3)
// The first byte picks options and the allocator's sizes: release threshold, cached huge blocks
// remapped instead of split, no large block in the thread cache, a 96 MiB memory limit from the
// start, limit_chunk 2 MiB or 0 (one handle a growth).
// Physical memory never grows past the memory limit.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "frontend/allocator_access.hpp"
#include "vmmalloc/host_backend.hpp"
#include "vmmalloc/vmmalloc.hpp"

namespace {
void die(const char* what, const std::string& why) {
  std::fprintf(stderr, "fuzz_heap: %s: %s\n", what, why.c_str());
  std::abort();
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  vmm::options o;
  o.reservation_size = std::size_t{1} << 30;
  vmm::tuning t;
  t.huge_threshold = std::size_t{32} << 20;  // reach the huge path with small inputs
  t.max_growth = std::size_t{4} << 20;
  if (size && data[0] & 1) o.release_threshold = std::size_t{8} << 20;
  if (size && data[0] & 2) t.split_cached_huge = false;  // cached huge blocks remapped on a miss
  if (size && data[0] & 4) t.thread_cache_large = false;
  if (size && data[0] & 8) o.memory_limit = std::size_t{96} << 20;
  if (size && data[0] & 16) t.limit_chunk = data[0] & 32 ? 0 : std::size_t{2} << 20;
  vmm::host_backend_options h;
  h.physical_limit = std::size_t{256} << 20;  // small: out-of-memory paths are reachable
  auto a = vmm::allocator_access::make(vmm::make_backend<vmm::host_backend>(h), o, t);
  std::vector<std::pair<void*, std::size_t>> live;
  auto stream = [](std::uint8_t c) { return reinterpret_cast<vmm::stream_t>(std::uintptr_t(c % 3)); };
  for (std::size_t i = 1; i + 4 <= size; i += 4) {
    const std::uint8_t op = data[i] % 8, x = data[i + 1], y = data[i + 2], z = data[i + 3];
    const std::size_t physical_before = a.stats().physical;
    if (op <= 2) {
      unsigned bits = (x % 27);  // 1 B .. 64 MiB, log-uniform
      std::size_t n = (std::size_t{1} << bits) + ((std::size_t(y) << 8 | z) % (std::size_t{1} << bits));
      std::size_t align = y % 7 == 0 ? std::size_t{4096} << (z % 10) : 0;  // up to 2 MiB
      void* p = a.try_allocate(n, align, stream(z));
      if (p) {
        if (align && reinterpret_cast<std::uintptr_t>(p) % align) die("alignment", std::to_string(align));
        static_cast<std::uint8_t*>(p)[0] = x;  // host memory: the bytes must be writable
        static_cast<std::uint8_t*>(p)[n - 1] = y;
        live.push_back({p, n});
      } else if (vmm::last_error().st.kind != vmm::errc::out_of_memory) {
        die("allocate failed with something other than out_of_memory", vmm::last_error().message);
      }
    } else if (op <= 4 && !live.empty()) {
      std::size_t k = x % live.size();
      if (!a.try_deallocate(live[k].first, stream(z)).ok()) die("free of a live block", vmm::last_error().message);
      live[k] = live.back();
      live.pop_back();
    } else if (op == 5 && !live.empty()) {
      auto* p = static_cast<std::uint8_t*>(live[x % live.size()].first);
      auto before = a.stats();
      if (a.try_deallocate(p + 1 + y % 255).ok()) die("interior free accepted", "");  // never 256-aligned
      int local = 0;
      if (a.try_deallocate(&local).ok()) die("foreign free accepted", "");
      if (a.stats().live != before.live) die("a refused free changed the stats", "");
    } else if (op == 6 && (y & 1)) {
      a.set_memory_limit(x ? (std::size_t{16} + x % 64) << 20 : SIZE_MAX);  // a = 0: none
    } else if (op == 6) {
      try {
        a.trim(std::size_t(x) << 20);
      } catch (const std::exception& e) {
        die("trim", e.what());
      }
    } else if (op == 7 && !live.empty()) {
      a.record_stream(live[x % live.size()].first, stream(z));
    }
    std::string why = a.check();
    if (!why.empty()) die("check", why);
    // A limit lowered below what is held gives back what it can; memory never grows past it.
    const std::size_t physical = a.stats().physical;
    if (physical > physical_before && physical > a.memory_limit())
      die("physical memory grew past the memory limit", std::to_string(physical));
  }
  for (auto& [p, n] : live) a.deallocate(p);
  a.trim(0);
  auto s = a.stats();
  if (s.live || s.requested || s.mapped) die("leak at the end", std::to_string(s.mapped));
  std::string why = a.check();
  if (!why.empty()) die("final check", why);
  return 0;
}
