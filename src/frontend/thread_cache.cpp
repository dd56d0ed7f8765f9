// SPDX-License-Identifier: Apache-2.0
// Thread caches: registration, thread exit, flushing. See thread_cache.hpp.
#include "frontend/thread_cache.hpp"

#include "frontend/allocator_impl.hpp"

namespace vmm {

std::mutex& cache_registry_mutex() {
  static std::mutex mu;
  return mu;
}

namespace {
// Thread exit: give each cache's slots back to its allocator, if that allocator still exists.
struct tl_caches {
  std::vector<std::pair<std::uint64_t, std::shared_ptr<tcache>>> all;
  ~tl_caches() {
    for (auto& [id, c] : all) {
      allocator_impl* o = nullptr;
      {
        std::lock_guard g(cache_registry_mutex());
        o = c->owner;
        if (!o) continue;
        ++o->exiting;  // the allocator's destructor waits for this exit to finish
      }
      {
        // Neither lock is held while the chunks the slots free are unmapped and released:
        // another thread's allocation, stats() or first use wait for no driver call here.
        std::unique_lock h(o->mu);
        tcache& mine = *c;  // a name the lambda can capture (clang 14 does not capture bindings)
        o->flush_cache(mine, true);
        (void)o->settle(h, true);
        o->hp->set_cache_tag(c->tag, false);  // its slabs are free for others to take
        std::erase(o->large_holders, c.get());
      }
      std::lock_guard g(cache_registry_mutex());
      o->retired_req += c->req_delta.get();
      o->retired_allocs += c->fast_allocs.get();
      o->retired_frees += c->fast_frees.get();
      o->retired_refilled += c->refilled.get();
      o->retired_flushed += c->flushed.get();
      std::erase(o->caches, c);
      if (--o->exiting == 0) o->exits_done.notify_all();
    }
  }
};
thread_local tl_caches tl;
}  // namespace

void forget_thread_cache(std::uint64_t id) {
  if (tl_cache_owner == id) tl_cache_owner = 0, tl_cache = nullptr;
  std::erase_if(tl.all, [&](auto& e) { return e.first == id; });
}

bool is_own_thread_cache(std::uint64_t id, const tcache* c) { return tl_cache_owner == id && c == tl_cache; }

tcache& allocator::impl::my_cache_slow() {
  for (auto& [cid, c] : tl.all)
    if (cid == id) {
      tl_cache_owner = id;
      tl_cache = c.get();
      return *c;
    }
  static std::atomic<std::uint64_t> next_tag{1};
  auto c = std::make_shared<tcache>();
  c->owner = this;
  c->tag = next_tag.fetch_add(1);
  {
    std::lock_guard g(mu);
    hp->set_cache_tag(c->tag, true);
    if (large_cache) large_holders.push_back(c.get());
  }
  c->bins.resize(classes);
  for (std::size_t k = 0; k < classes; ++k) {
    c->bins[k].e.resize(tc_cap);
    c->bins[k].slot_size = static_cast<std::uint32_t>(hp->class_size(static_cast<int>(k)));
  }
  {
    std::lock_guard g(cache_registry_mutex());
    caches.push_back(c);
  }
  tl.all.emplace_back(id, c);
  tl_cache_owner = id;
  tl_cache = c.get();
  return *c;
}

void allocator::impl::return_large(tcache& c) {
  if (!c.large.cached) return;
  (void)hp->cache_return(c.large.p, c.large.r);  // false: the heap took it back already
  c.large.cached = false;
  c.large.p = 0;
  c.large_cached.add(-std::uint64_t{c.large.r.size});
  c.large_taken = 0;
  c.flushed.add(1);
}

bool allocator::impl::take_back_large() {
  bool any = false;
  for (tcache* c : large_holders) {
    // large.p and large.r change under mu only; large.cached is its thread's (not read here):
    // the block word says whether the block is cached now.
    const auto& L = c->large;
    if (!L.p || c->large_taken) continue;
    if (hp->cache_return(L.p, L.r)) {
      c->large_taken = L.r.size;
      any = true;
    }
  }
  return any;
}

void allocator::impl::flush_cache(tcache& c, bool all) {
  if (all) return_large(c);
  std::vector<std::uintptr_t> ps;
  for (auto& b : c.bins) {
    const std::uint64_t n = b.n.get(), keep = all ? 0 : n / 2;
    for (std::uint64_t k = keep; k < n; ++k) ps.push_back(b.e[k].p);
    c.flushed.add(n - keep);
    b.n.set(keep);
  }
  hp->flush(ps.data(), ps.size());
}

}  // namespace vmm
