// SPDX-License-Identifier: Apache-2.0
// Thread caches: per (thread, allocator) stacks of small slots, so the hot path takes no lock.
// The protocol with the heap (slot states, refill, flush) is in heap/slabs.cpp; the fast paths
// that pop and push are allocator::try_allocate / try_deallocate.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "frontend/allocator_access.hpp"
#include "heap/heap.hpp"

namespace vmm {

// Counters written only by the owning thread, read by stats() from any thread: relaxed
// load + store, no locked instruction on the hot path.
struct owner_counter {
  std::atomic<std::uint64_t> v{0};
  owner_counter() = default;
  owner_counter(const owner_counter& o) : v(o.get()) {}  // vector<bin>::resize
  void add(std::uint64_t d) { v.store(v.load(std::memory_order_relaxed) + d, std::memory_order_relaxed); }
  void set(std::uint64_t x) { v.store(x, std::memory_order_relaxed); }
  std::uint64_t get() const { return v.load(std::memory_order_relaxed); }
};

// One per (thread, allocator). Bins hold slot addresses of one stream each. What a cache holds
// is read from the bins' counts (stats() multiplies by the slot size): no separate byte and slot
// counters to keep on the hot path.
struct tcache {
  struct entry {
    std::uintptr_t p;
    heap::slot_ref r;
  };
  struct bin {
    stream_t stream = nullptr;
    owner_counter n;
    std::uint32_t slot_size = 0;  // set before the cache is registered, then constant
    std::vector<entry> e;
  };
  // The large or huge block this thread handed out last, or holds freed (cached): a pair of any
  // size takes no lock. At most one block: it goes back to the heap on the next request it does
  // not fit, on trim() and at thread exit (see heap::block_ref for the protocol).
  struct large_entry {
    std::uintptr_t p = 0;
    heap::block_ref r;
    std::size_t req = 0;  // bytes the user asked for, while handed out
    bool cached = false;
  } large;
  allocator_impl* owner;  // null once the allocator is gone (under registry_mu)
  std::uint64_t tag = 0;   // unique per cache: the heap gives each cache its own slabs
  std::vector<bin> bins;  // sized once: entries never move
  const entry* last = nullptr;  // the entry of the slot popped last (see try_deallocate)
  // large_cached: bytes of the cached large block (0 when none).
  owner_counter req_delta, large_cached, fast_allocs, fast_frees, refilled, flushed;
  // The cached block's bytes once the heap took it back (take_back_large), until its thread's
  // return_large sees it gone: stats() subtracts it from large_cached, which only the owning
  // thread writes. Written and read under the allocator's lock only.
  std::size_t large_taken = 0;
  bool holds_any() const {
    for (const auto& b : bins)
      if (b.n.get()) return true;
    return large.cached;
  }
};

// The calling thread's most recently used cache and its allocator's id: plain thread_locals
// (no TLS wrapper call), so finding the cache on the hot path is one compare. Initial-exec: the
// library is position independent, and the default model would call __tls_get_addr on every
// access from the shared library (the compiler saves registers around it even where the linker
// removes the call). The cost: 16 bytes of the static TLS block, which glibc keeps in reserve for
// libraries loaded later with dlopen, as mimalloc's and jemalloc's thread pointers are.
#define VMM_TLS_INITIAL_EXEC __attribute__((tls_model("initial-exec")))
inline thread_local std::uint64_t tl_cache_owner VMM_TLS_INITIAL_EXEC = 0;
inline thread_local tcache* tl_cache VMM_TLS_INITIAL_EXEC = nullptr;

// Lock 1 of the front end's order (see allocator.cpp): thread-cache registration, thread exit,
// allocator destruction.
std::mutex& cache_registry_mutex();
// This thread forgets its cache of allocator `id` (the allocator is being destroyed).
void forget_thread_cache(std::uint64_t id);
// Whether c is the calling thread's cache of allocator `id`.
bool is_own_thread_cache(std::uint64_t id, const tcache* c);

}  // namespace vmm
