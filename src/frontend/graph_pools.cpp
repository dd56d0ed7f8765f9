// SPDX-License-Identifier: Apache-2.0
// Graph pools (CUDA graphs; PyTorch's private pools). While a pool is begun, allocations on the
// streams its filter accepts come from the pool's own heap; a block of a pool, freed during the
// capture or after, returns to that heap; nothing of it goes to other work until the pool is
// released. Several captures may share a pool (begin it again), and several pools may be begun at
// once (the first filter that accepts the stream wins). Thread caches hold the own heap's slots,
// so they are bypassed while any pool is begun (`capturing`).
#include "frontend/allocator_impl.hpp"

#include <algorithm>
#include <limits>

namespace vmm {

heap& allocator_impl::heap_for(stream_t s) {
  for (const auto& c : captures)
    if (!c.filter || c.filter(s)) return *pools.at(c.pool).hp;
  return *hp;
}

heap& allocator_impl::owner_of(std::uintptr_t p) {
  const std::uint16_t id = ar->heap_at(p);  // 0 for a pointer in no chunk: the own heap reports it
  return id < heaps.size() && heaps[id] ? *heaps[id] : *hp;
}

void allocator_impl::drop_pool(pool_id id, graph_pool& gp) {
  // Its free memory goes back to the shared idle handles (waiting for its streams' fences first);
  // the heap itself goes once nothing is left in it.
  (void)gp.hp->trim(0);
  if (gp.hp->stats().live != 0 || ar->free_chunk_bytes(gp.hp->id()) != 0) return;
  const std::uint16_t hid = gp.hp->id();
  heaps[hid] = nullptr;
  free_heap_ids.push_back(hid);
  pools.erase(id);
}

void allocator_impl::after_free(heap& h) {
  for (auto& [id, gp] : pools)
    if (gp.hp.get() == &h) {
      if (gp.released && gp.hp->stats().live == 0) drop_pool(id, gp);
      return;
    }
}

void allocator::begin_pool(pool_id id, std::function<bool(stream_t)> filter) {
  impl& m = *p_;
  std::lock_guard g(m.mu);
  auto it = m.pools.find(id);
  if (it != m.pools.end() && it->second.released)
    throw error({errc::invalid_value, 0, "pool released", "begin_pool"},
                "vmm::allocator::begin_pool(" + std::to_string(id) + "): the pool was released");
  if (it == m.pools.end()) {
    std::uint16_t hid;
    if (!m.free_heap_ids.empty()) {
      hid = m.free_heap_ids.back();
      m.free_heap_ids.pop_back();
    } else {
      if (m.heaps.size() > std::numeric_limits<std::uint16_t>::max())
        throw error({errc::out_of_memory, 0, "too many pools", "begin_pool"},
                    "vmm::allocator::begin_pool: 65535 pools are alive; release some");
      hid = static_cast<std::uint16_t>(m.heaps.size());
      m.heaps.push_back(nullptr);
    }
    graph_pool gp;
    gp.hp = std::make_unique<heap>(*m.ar, hid);
    gp.hp->set_private(true);
    m.heaps[hid] = gp.hp.get();
    it = m.pools.emplace(id, std::move(gp)).first;
  }
  m.captures.push_back({id, std::move(filter)});
  ++it->second.begun;
  m.capturing.store(static_cast<int>(m.captures.size()), std::memory_order_release);
}

void allocator::end_pool(pool_id id) {
  impl& m = *p_;
  std::lock_guard g(m.mu);
  auto it = m.pools.find(id);
  if (it == m.pools.end() || it->second.begun == 0)
    throw error({errc::invalid_value, 0, "pool not begun", "end_pool"},
                "vmm::allocator::end_pool(" + std::to_string(id) + "): the pool was never begun (or already ended)");
  --it->second.begun;
  // The newest capture of this pool ends (captures of one pool end in reverse order of begin).
  auto c = std::find_if(m.captures.rbegin(), m.captures.rend(), [&](const pool_capture& x) { return x.pool == id; });
  m.captures.erase(std::next(c).base());
  m.capturing.store(static_cast<int>(m.captures.size()), std::memory_order_release);
}

void allocator::release_pool(pool_id id) {
  impl& m = *p_;
  std::unique_lock g(m.mu);
  auto it = m.pools.find(id);
  if (it == m.pools.end())
    throw error({errc::invalid_value, 0, "unknown pool", "release_pool"},
                "vmm::allocator::release_pool(" + std::to_string(id) + "): no such pool");
  if (it->second.begun)
    throw error({errc::invalid_value, 0, "pool in use", "release_pool"},
                "vmm::allocator::release_pool(" + std::to_string(id) +
                    "): a capture still allocates to it (end_pool first)");
  it->second.released = true;
  it->second.hp->set_private(false);
  m.drop_pool(id, it->second);
  (void)m.settle(g, true);  // the unmaps of what the pool gave back
}

bool allocator::pool_stats(pool_id id, pool_info& out) const {
  const impl& m = *p_;
  std::lock_guard g(m.mu);
  auto it = m.pools.find(id);
  if (it == m.pools.end()) return false;
  const heap_stats h = it->second.hp->stats();
  out.live = h.live;
  out.allocated = h.allocated;
  out.held = m.ar->mapped_bytes(it->second.hp->id());
  out.begun = it->second.begun;
  out.released = it->second.released;
  return true;
}

bool allocator::pool_of(const void* p, pool_id& id) const {
  impl& m = *p_;
  std::lock_guard g(m.mu);
  const auto u = reinterpret_cast<std::uintptr_t>(p);
  if (!m.ar->contains(u)) return false;
  const std::uint16_t hid = m.ar->heap_at(u);
  if (hid == 0) return false;  // the own heap's chunk, or none
  for (const auto& [pid, gp] : m.pools)
    if (gp.hp->id() == hid) {
      if (gp.hp->usable_size(u) == 0) return false;  // interior, free, or waiting on a fence
      id = pid;
      return true;
    }
  return false;
}

bool allocator::owns(const void* p) const noexcept {
  return p_ && p_->ar && p_->ar->contains(reinterpret_cast<std::uintptr_t>(p));
}

}  // namespace vmm
