// The allocator's private state (vmm::allocator::impl): arena, heap, the lock that serialises
// them, the registry of thread caches and the trace writer. Shared by the front end's files:
//   allocator.cpp     construction, allocate / deallocate (fast and slow paths), policies, trim
//   thread_cache.cpp  per-thread caches of small slots
//   trace_writer.cpp  trace recording
//   stats.cpp         stats(), class_stats(), check()
//   c_api.cpp         the C API over all of it
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "arena/arena.hpp"
#include "frontend/allocator_access.hpp"
#include "frontend/thread_cache.hpp"
#include "frontend/trace_writer.hpp"
#include "heap/heap.hpp"
#include "vmmalloc/vmmalloc.hpp"

namespace vmm {

inline std::atomic<std::uint64_t> next_allocator_id{1};

struct allocator::impl {
  std::unique_ptr<arena> ar;
  std::unique_ptr<heap> hp;
  mutable std::mutex mu;
  std::uint64_t id = next_allocator_id.fetch_add(1);
  bool tc_enabled = false;
  std::size_t tc_cap = 32;
  std::size_t classes = 0;
  // registry (under registry_mu): live caches, and the counters of caches whose thread ended
  std::vector<std::shared_ptr<tcache>> caches;
  std::uint64_t retired_req = 0, retired_allocs = 0, retired_frees = 0, retired_refilled = 0,
                retired_flushed = 0;
  std::unique_ptr<trace_writer> trace;  // null unless options.trace_path is set
  std::uint64_t exported = 0;           // under mu

  std::string out_of_memory_detail() const;
  tcache& my_cache() { return tl_cache_owner == id ? *tl_cache : my_cache_slow(); }
  tcache& my_cache_slow();  // first use on this thread, or another allocator's cache was last
  void flush_cache(tcache& c, bool all);  // caller holds mu
};

}  // namespace vmm
