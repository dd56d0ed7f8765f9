// SPDX-License-Identifier: Apache-2.0
// The allocator's private state (vmm::allocator::impl): arena, heap, the lock that serialises
// them, the registry of thread caches and the trace writer. Shared by the front end's files:
//   allocator.cpp     construction, allocate / deallocate (fast and slow paths), policies, trim
//   thread_cache.cpp  per-thread caches of small slots
//   trace_writer.cpp  trace recording
//   stats.cpp         stats(), class_stats(), check()
//   graph_pools.cpp   graph pools: which heap an allocation comes from, which heap owns a block
//   c_api.cpp         the C API over all of it
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <unordered_map>
#include <mutex>
#include <vector>

#include "arena/arena.hpp"
#include "frontend/allocator_access.hpp"
#include "frontend/thread_cache.hpp"
#include "frontend/trace_writer.hpp"
#include "heap/heap.hpp"
#include "vm/handle_pool.hpp"
#include "vmmalloc/vmmalloc.hpp"

namespace vmm {

inline std::atomic<std::uint64_t> next_allocator_id{1};

// A graph pool: a heap of its own over the shared arena (memory from and back to the same idle
// handles), so nothing it holds goes to other work until it is released.
struct graph_pool {
  std::unique_ptr<heap> hp;
  int begun = 0;          // begin_pool calls not yet ended (captures allocating to it now)
  bool released = false;  // release_pool called: memory goes back as its blocks are freed
};
struct pool_capture {
  allocator::pool_id pool;
  std::function<bool(stream_t)> filter;  // empty: every stream
};

struct allocator::impl final : vm::handle_pool {
  std::unique_ptr<arena> ar;
  std::unique_ptr<heap> hp;  // the allocator's own heap (id 0)
  mutable std::mutex mu;
  std::uint64_t id = next_allocator_id.fetch_add(1);
  bool tc_enabled = false;
  bool large_cache = false;  // thread caches keep one large block too (not for exportable memory)
  std::size_t tc_cap = 32;
  std::size_t default_alignment = 256;  // options.alignment, read by the fast path without the arena
  std::size_t classes = 0;
  // The heap's size classes, copied so the hot path looks a class up without a call: the class
  // of n bytes is unit_class[(n + 255) / 256] for 0 < n <= small_limit.
  std::size_t small_limit = 0;
  std::vector<std::uint8_t> unit_class;
  int small_class(std::size_t n) const { return n - 1 < small_limit ? unit_class[(n + 255) >> 8] : -1; }
  // Whether a request of this alignment (0 resolved to the default) may use the thread caches.
  // Their slots are the own heap's: while a graph pool is begun, allocations take the locked
  // path, which decides between the pool and the own heap.
  bool cache_serves(std::size_t alignment) const {
    return tc_enabled && alignment <= 256 && (alignment & (alignment - 1)) == 0 &&
           capturing.load(std::memory_order_acquire) == 0;
  }
  // registry (under registry_mu): live caches, and the counters of caches whose thread ended
  std::vector<std::shared_ptr<tcache>> caches;
  std::uint64_t retired_req = 0, retired_allocs = 0, retired_frees = 0, retired_refilled = 0,
                retired_flushed = 0;
  int exiting = 0;                      // thread exits flushing a cache of this allocator now
  std::condition_variable exits_done;   // exiting fell to 0 (the destructor waits for it)
  std::unique_ptr<trace_writer> trace;  // null unless options.trace_path is set
  std::uint64_t exported = 0;           // under mu

  // Graph pools (graph_pools.cpp), under mu; `capturing` is also read without the lock by the
  // hot path: thread caches are bypassed while a pool is begun (their slots are the own heap's).
  std::unordered_map<pool_id, graph_pool> pools;
  std::vector<pool_capture> captures;      // begun pools, in begin order
  std::vector<heap*> heaps{nullptr};       // by heap id: [0] = hp, pools' heaps after it
  std::vector<std::uint16_t> free_heap_ids;
  std::atomic<int> capturing{0};
  heap& heap_for(stream_t s);              // where an allocation on s comes from
  heap& owner_of(std::uintptr_t p);        // the heap that owns the block at p (hp when none)
  void after_free(heap& h);                // a released pool whose last block went is dropped
  void drop_pool(pool_id id, graph_pool& gp);

  std::string out_of_memory_detail() const;
  tcache& my_cache() { return tl_cache_owner == id ? *tl_cache : my_cache_slow(); }
  tcache& my_cache_slow();  // first use on this thread, or another allocator's cache was last
  void flush_cache(tcache& c, bool all);  // caller holds mu
  void return_large(tcache& c);           // caller holds mu: the cached large block back to the heap
  // Caches whose large block the heap may take back (under mu: registered on a thread's first use,
  // removed at its exit). take_back_large(), before a request grows: every block cached now goes
  // back (a compare-exchange each; its thread finds out on its next request). A block a thread
  // keeps for its next request is otherwise memory no other thread can use.
  std::vector<tcache*> large_holders;
  bool take_back_large();

  // Runs the arena's pending job (arena.hpp): its driver calls (create, map, set_access, unmap,
  // release: microseconds to milliseconds each) without lk when `drop`, so they hold up no other
  // thread; then commits it under lk and hands a new mapping to its heap. Returns the mapping's
  // outcome (ok when the job had none). Every call into the heap is followed by one.
  status settle(std::unique_lock<std::mutex>& lk, bool drop);
  // Requests that a growth run and adopted under mu (so no other thread took its memory) did not
  // serve: a heap that plans what it then cannot use. Always 0 when the heap is right; the stress
  // test fails on any (allocator_access::unserved_growths).
  std::uint64_t unserved_growths = 0;
  // Waits without lk for the work queued so far on each stream (a fence recorded on each under
  // lk), then marks what those fences cover done in the own heap (heap::defer_waits). A stream
  // being captured, or whose fence the driver refuses, is left as it is.
  void wait_streams(std::unique_lock<std::mutex>& lk, std::vector<stream_t> streams);
  // vm::handle_pool: the arena's idle handles, lent and taken back under mu.
  backend_iface& backend() override { return ar->drv().backend(); }
  bool lend(std::size_t max, mem_handle& h, std::size_t& size) override {
    std::lock_guard g(mu);
    return ar->lend_idle(max, h, size);
  }
  bool take_back(mem_handle h, std::size_t size) override {
    std::lock_guard g(mu);
    return ar->take_back(h, size);
  }
};

}  // namespace vmm
