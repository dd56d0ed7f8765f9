// SPDX-License-Identifier: Apache-2.0
// arena: reservation, holes, chunk table, page map, idle-handle cache. See arena.hpp.
#include "arena/arena.hpp"

#include <algorithm>
#include <atomic>
#include <cassert>

#include "vm/granularity.hpp"

namespace vmm {

namespace {
constexpr std::size_t round_up(std::size_t n, std::size_t g) { return (n + g - 1) / g * g; }
status fail(errc k, const char* op, const char* name) { return {k, 0, name, op}; }
}  // namespace

arena::arena(std::unique_ptr<backend_iface> b, const options& o)
    : b_(std::move(b)), drv_(b_.get()), opt_(o), limit_(o.memory_limit) {}

status arena::open() {
  if (!b_) return fail(errc::invalid_value, "arena", "no backend");
  policies_ = policy::make_policies(opt_);
  for (auto& p : policies_) {
    if (status s = p->open(drv_, opt_, pol_); !s.ok()) return s;
    whole_chunks_ = whole_chunks_ || p->whole_chunks(opt_);
  }
  // Granularity: the largest among the devices involved (owner and peers).
  auto g = vm::granularity_for(drv_, pol_.props, pol_.access, opt_.recommended_granularity);
  if (!g.ok()) return g.st;
  gran_ = g.value;
  gran_shift_ = static_cast<unsigned>(__builtin_ctzll(gran_));
  if (opt_.peak_growth < 0 || opt_.peak_growth > 100)
    return fail(errc::invalid_value, "arena", "peak_growth out of range (a percent, 0-100)");
  if (opt_.min_chunk == 0) opt_.min_chunk = gran_;
  opt_.min_chunk = round_up(opt_.min_chunk, gran_);

  std::size_t size = opt_.reservation_size;
  if (size == 0) {
    auto mi = drv_.mem_info();
    size = mi.ok() && mi.value.total ? 2 * mi.value.total : std::size_t{64} << 30;
  }
  size = round_up(size, gran_);
  if (size < gran_ || size / gran_ > std::numeric_limits<std::uint32_t>::max())
    return fail(errc::invalid_value, "arena", "reservation size out of range");
  if (status s = res_.open(drv_, size, gran_); !s.ok()) return s;
  page_map_.assign(size / gran_, no_chunk);
  holes_.emplace(res_.base(), size);
  return {};
}

arena::~arena() {
  if (!b_) return;
  // Teardown cannot report errors: each step is made once more if refused (a driver call refused
  // once, as in the fault-injection sweep, must not leak a handle, a mapping or the reservation).
  bool mapped = false;  // something the driver would not unmap: the reservation stays
  for (auto& c : chunks_) {
    if (!c.size) continue;
    mapped |= !vm::driver::twice([&] { return drv_.unmap(c.va, c.size); }).ok();
    (void)vm::driver::twice([&] { return drv_.release(c.handle); });
  }
  (void)poll_retiring(true);
  for (const auto& r : retiring_) mapped |= !vm::driver::twice([&] { return drv_.unmap(r.va, r.size); }).ok();
  for (auto& e : idle_) (void)vm::driver::twice([&] { return drv_.release(e.second); });
  for (auto& d : doomed_) (void)vm::driver::twice([&] { return drv_.release(d.h); });
  (void)strays_.retry(drv_);
  (void)res_.close(mapped || strays_.holds_mappings());
}

void arena::idle_put(mem_handle h, std::size_t size) {
  idle_.emplace(size, h);
  idle_bytes_ += size;
}

std::multimap<std::size_t, mem_handle>::iterator arena::doom_idle(std::multimap<std::size_t, mem_handle>::iterator it,
                                                                  std::vector<growth::release>& to) {
  to.push_back({it->second, it->first});
  releasing_bytes_ += it->first;
  idle_bytes_ -= it->first;
  return idle_.erase(it);
}

bool arena::note_release_of_aliased(mem_handle h, std::size_t size) {
  const std::uint64_t id = ++release_ids_;
  bool any = false;
  for (auto& r : retiring_)
    if (r.h == h && !r.released && !r.doomed) {
      r.released = id;  // the memory stays until its last retired range is unmapped: still counted
      any = true;
    }
  if (any) retired_held_ += size;
  return any;
}

void arena::drop_retired(std::size_t i) {
  const retired r = retiring_[i];
  retiring_[i] = retiring_.back();
  retiring_.pop_back();
  give_hole(r.va, r.size);
  if (r.released && std::none_of(retiring_.begin(), retiring_.end(),
                                 [&](const retired& x) { return x.released == r.released; }))
    retired_held_ -= r.size;
}

void arena::release_or_park(mem_handle h, std::size_t size) {
  status st = drv_.release(h);
  if (st.ok()) {
    (void)note_release_of_aliased(h, size);
    return;
  }
  // Refused: the handle is still ours. Parked; release_idle(), the next mapping or teardown retry.
  strays_.add_handle(h, size);
  if (parked_error_.ok()) parked_error_ = st;
}

status arena::retry_strays() {
  if (strays_.empty()) return {};
  std::vector<vm::strays::entry> before = strays_.entries();
  status s = strays_.retry(drv_);
  // A stray mapping that is gone gives its VA back to the holes.
  for (const auto& e : before) {
    if (!e.mapped) continue;
    bool still = std::any_of(strays_.entries().begin(), strays_.entries().end(),
                             [&](const vm::strays::entry& x) { return x.mapped && x.va == e.va; });
    if (!still) give_hole(e.va, e.size);
  }
  return s;
}

std::uint32_t arena::new_chunk_slot() {
  if (!free_slots_.empty()) {
    auto id = free_slots_.back();
    free_slots_.pop_back();
    return id;
  }
  chunks_.emplace_back();
  return static_cast<std::uint32_t>(chunks_.size() - 1);
}

bool arena::hole_at(std::uintptr_t at, std::size_t size) const {
  auto it = holes_.upper_bound(at);
  if (it == holes_.begin()) return false;
  --it;
  return at >= it->first && at + size <= it->first + it->second;
}

void arena::take_hole(std::uintptr_t va, std::size_t size) {
  auto it = std::prev(holes_.upper_bound(va));
  auto [hs, hn] = *it;
  holes_.erase(it);
  if (va > hs) holes_.emplace(hs, va - hs);
  if (va + size < hs + hn) holes_.emplace(va + size, hs + hn - va - size);
}

void arena::give_hole(std::uintptr_t va, std::size_t size) {
  auto next = holes_.lower_bound(va);
  if (next != holes_.end() && next->first == va + size) {  // merge with the following hole
    size += next->second;
    next = holes_.erase(next);
  }
  if (next != holes_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == va) {  // merge with the preceding hole
      prev->second += size;
      return;
    }
  }
  holes_.emplace(va, size);
}

bool arena::usable_for(mem_handle h, stream_t s) {
  for (const auto& r : retiring_)
    if (r.h == h && !r.released && !r.doomed && r.fence && r.stream != s && !drv_.fence_done(r.fence)) return false;
  return true;
}

bool arena::aliased(mem_handle h, bool fenced_only) const {
  for (const auto& r : retiring_)
    if (r.h == h && !r.released && !r.doomed && (r.fence || !fenced_only)) return true;
  return false;
}

result<std::uintptr_t> arena::map_range(std::size_t size, std::uintptr_t at, std::uint32_t owner, stream_t stream,
                                        std::size_t* mapped, std::uint16_t heap, std::size_t max_piece) {
  if (size == 0 || size % gran_) return {0, fail(errc::invalid_value, "map", "size not a multiple of the granularity")};
  assert(!pending_);  // a deferred growth is taken before the next mapping
  (void)retry_strays();  // a stray mapping holds VA and physical memory: undo it first if the driver lets us
  const bool defer = deferring();
  // Retired ranges whose stream caught up (and chunks evicted for this growth) give their VA back
  // first, as holes the growth may take. Deferred, that is a round of its own: a growth with
  // only unmaps runs outside the lock, then the request is tried again.
  if (!defer) (void)poll_retiring(false);
  else if (park_unmaps()) return {0, {errc::other, 0, "unmaps deferred to run outside the lock", "map"}};
  auto hole_for = [&](std::size_t n) -> std::uintptr_t {
    if (at) return hole_at(at, n) ? at : 0;
    for (auto& [hs, hn] : holes_)
      if (hn >= n) return hs;
    return 0;
  };
  if (!hole_for(size)) {
    return {0, at ? fail(errc::out_of_memory, "map", "no hole at the requested address")
                  : fail(errc::out_of_memory, "cuMemAddressReserve", "reservation exhausted")};
  }

  // Pieces: idle handles first (largest that fit), then one handle to create for the rest.
  using piece = growth::piece;
  std::vector<piece> pieces;
  std::size_t taken = 0;  // physical bytes in `pieces`: still ours while they wait to be mapped
  // Idle handles to release before the create, and their bytes.
  std::vector<growth::release> releases;
  std::size_t releasing = 0;
  auto give_back = [&] {
    for (const auto& p : pieces)
      if (p.h) idle_put(p.h, p.size);  // the handle to create has none yet
    for (const auto& l : releases) idle_put(l.h, l.size);  // not released after all: idle again
    releasing_bytes_ -= releasing;
  };
  std::size_t total = 0;
  while (total < size) {
    const std::size_t want = size - total;
    auto it = idle_.upper_bound(want);  // first idle handle larger than want
    auto fit = it;
    while (fit != idle_.begin() && !usable_for(std::prev(fit)->second, stream)) --fit;
    if (fit != idle_.begin()) {
      it = std::prev(fit);  // largest idle handle <= want this stream may map
    } else if (mapped) {
      // Every idle handle is larger than what is left. A retired one holds its memory until its
      // old range goes: map the smallest such whole (the rest of the range is free span memory).
      while (it != idle_.end() &&
             !(aliased(it->second, true) && usable_for(it->second, stream) && hole_for(total + it->first)))
        ++it;
    } else {
      it = idle_.end();
    }
    if (it != idle_.end()) {
      pieces.push_back({it->first, it->second, false, false});
      idle_bytes_ -= it->first;
      taken += it->first;
      idle_.erase(it);
      total += pieces.back().size;
      continue;
    }
    // Idle handles that could not serve this request only add to the footprint: the growth
    // releases them before it creates (peak physical stays close to peak mapped); set aside
    // here, counted as held until then. One whose retired range is still mapped stays idle (its
    // memory is not freed yet).
    if (opt_.stitch_on_grow && idle_bytes_) {
      for (auto i = idle_.end(); i != idle_.begin();) {
        --i;
        if (aliased(i->second)) continue;
        releasing += i->first;
        i = doom_idle(i, releases);
      }
    }
    // The limit is checked before the create: everything held (growths in flight on other
    // threads included), the pieces taken for this range, plus what the create would add, less
    // what this growth releases before it creates.
    const std::size_t physical = held_for_limit() + taken - releasing;
    const std::size_t limit = memory_limit();
    if (want > limit || physical > limit - want) {
      give_back();
      return {0, fail(errc::out_of_memory, "options.memory_limit", "memory limit of the policy reached")};
    }
    const std::size_t cap = max_piece ? std::max(round_up(max_piece, gran_), gran_) : want;
    for (std::size_t left = want; left;) {
      const std::size_t n = std::min(left, cap);
      pieces.push_back({n, 0, true, false});  // created by run_growth
      left -= n;
    }
    taken += want;
    total += want;
  }
  const std::uintptr_t va = hole_for(total);
  assert(va);  // checked for size, and for every larger total before a piece made it so

  // The hole and the handles are the growth's from here: nobody else maps there or takes them.
  take_hole(va, total);
  inflight_.emplace(va, total);
  inflight_bytes_ += total;
  for (const auto& p : pieces)
    if (!p.created) inflight_lent_ += p.size;
  growth g;
  g.va = va;
  g.size = total;
  g.owner = owner;
  g.heap = heap;
  g.pieces = std::move(pieces);
  g.access = pol_.access;
  g.access_gen = pol_.access_changes;
  g.releases = std::move(releases);
  if (defer) {
    pending_.emplace(std::move(g));
    return {0, {errc::other, 0, "growth deferred to run outside the lock", "map"}};
  }
  // Under the lock (growth outside it off, an exportable policy, a graph pool): the same driver
  // calls and rollback, now.
  run_growth(g);
  if (status st = finish_growth(g); !st.ok()) return {0, st};
  if (mapped) *mapped = total;
  return {va, {}};
}

void arena::install(std::uintptr_t va, const std::vector<growth::piece>& pieces, std::uint32_t owner,
                    std::uint16_t heap) {
  std::size_t off = 0;
  for (const auto& p : pieces) {
    auto id = new_chunk_slot();
    chunks_[id] = chunk{va + off, p.size, p.h, 0, no_chunk, no_chunk, owner, heap, p.marked};
    for (std::size_t pg = page_of(va + off), e = pg + p.size / gran_; pg < e; ++pg) page_map_[pg] = id;
    mapped_ += p.size;
    count_mapped(chunks_[id], true);
    if (p.marked) compressed_bytes_ += p.size;
    if (!p.created) ++stitched_;
    ++chunk_count_;
    lru_push(id);  // a new chunk holds no block yet; the heap's add_used takes it off the list
    off += p.size;
  }
  note_peaks();
}

void arena::take_ready_unmaps(growth& g) {
  for (auto& r : retiring_)
    if (!r.unmapping && (!r.fence || drv_.fence_done(r.fence))) {
      r.unmapping = true;
      g.unmaps.push_back({r.va, r.size, r.fence, false, r.h});
    }
}

bool arena::park_releases(bool ready_unmaps) {
  if (pending_ || (doomed_.empty() && !ready_unmaps)) return false;
  growth g;
  take_ready_unmaps(g);
  if (doomed_.empty() && g.unmaps.empty()) return false;  // nothing was marked
  g.releases = std::move(doomed_);
  doomed_.clear();
  pending_.emplace(std::move(g));
  return true;
}

bool arena::park_unmaps() {
  growth g;
  take_ready_unmaps(g);
  if (g.unmaps.empty()) return false;
  pending_.emplace(std::move(g));
  return true;
}

arena::growth arena::take_growth() {
  assert(pending_);
  growth g = std::move(*pending_);
  pending_.reset();
  return g;
}

void arena::run_growth(growth& g) {
  // Retired ranges first: their unmaps succeed or fail on their own, whatever the growth does.
  // A round of unmaps and releases alone keeps the first refusal in g.st: finish_growth reports
  // it as a refusal under the lock would be (take_parked_error).
  auto note = [&](const status& st) {
    if (!st.ok() && g.pieces.empty() && g.st.ok()) g.st = st;
    return st.ok();
  };
  for (auto& u : g.unmaps) {
    u.done = note(vm::driver::twice([&] { return drv_.unmap(u.va, u.size); }));
    if (u.done && u.fence) drv_.drop_fence(u.fence);
  }
  // Then the releases, before any create: the memory is the device's again first. A handle whose
  // range the driver refused to unmap is parked instead (released by a later retry; the range
  // stays retired until it is unmapped).
  for (const auto& l : g.releases) {
    const bool still_mapped = std::any_of(g.unmaps.begin(), g.unmaps.end(),
                                          [&](const growth::unmap& u) { return u.h == l.h && !u.done; });
    if (still_mapped || !note(vm::driver::twice([&] { return drv_.release(l.h); }))) g.strays.add_handle(l.h, l.size);
  }
  if (g.pieces.empty()) return;  // unmaps and releases only
  auto release = [&](const growth::piece& p) {
    if (!vm::driver::twice([&] { return drv_.release(p.h); }).ok()) g.strays.add_handle(p.h, p.size);
  };
  for (auto& p : g.pieces) {
    if (!p.created) continue;
    // Outside the lock the policies' create hooks change no state but an atomic counter: the
    // IPC policy, whose kind may fall back on a refused create, runs its growths under the lock
    // (deferring()).
    auto c = policy::create_chunk(drv_, policies_, opt_, pol_, p.size);
    if (!c.ok()) {
      g.st = c.st;
      break;
    }
    p.h = c.value;
  }
  if (!g.st.ok()) {  // nothing mapped yet: created handles go, idle ones go back to the cache
    for (auto& p : g.pieces) {
      if (p.created && p.h) release(p);
      else if (!p.created) g.returned.push_back({p.h, p.size});
      p.h = 0;
    }
    return;
  }
  vm::mapping_txn txn(drv_, g.strays);
  std::size_t off = 0, i = 0;
  status st{};
  for (; i < g.pieces.size(); ++i) {
    st = txn.map(g.va + off, g.pieces[i].size, g.pieces[i].h, g.pieces[i].created);
    if (!st.ok()) break;
    off += g.pieces[i].size;
  }
  if (st.ok()) st = txn.set_access(g.va, g.size, g.access);
  if (st.ok()) {
    txn.commit();
    // The policy state read here (the props) is fixed once the arena is open.
    for (auto& p : g.pieces)
      for (auto& pol : policies_) p.marked = pol->mapped(drv_, pol_, p.h) || p.marked;
  } else {
    for (std::size_t k = i + 1; k < g.pieces.size(); ++k) {  // never mapped
      if (g.pieces[k].created) release(g.pieces[k]);
      else g.returned.push_back({g.pieces[k].h, g.pieces[k].size});
    }
    txn.rollback();
    for (auto& l : txn.returned()) g.returned.push_back(l);
  }
  g.st = st;
}

void arena::finish_unmaps(growth& g) {
  for (const auto& u : g.unmaps)
    for (std::size_t i = 0; i < retiring_.size(); ++i) {
      retired& r = retiring_[i];
      if (r.va != u.va) continue;
      r.unmapping = false;
      if (u.done) drop_retired(i);
      break;
    }
  g.unmaps.clear();
}

void arena::finish_releases(growth& g) {
  for (const auto& l : g.releases) releasing_bytes_ -= l.size;  // released, or parked as a stray
  g.releases.clear();
}

status arena::finish_growth(growth& g) {
  finish_unmaps(g);
  finish_releases(g);
  if (g.pieces.empty()) {  // unmaps and releases only: nothing was taken
    evicted_ = true;
    strays_.take(g.strays);  // releases the driver refused
    if (!g.st.ok() && parked_error_.ok()) parked_error_ = g.st;
    return {};
  }
  inflight_.erase(g.va);
  inflight_bytes_ -= g.size;
  for (const auto& p : g.pieces)
    if (!p.created) inflight_lent_ -= p.size;
  status st = g.st;
  if (st.ok() && pol_.access_changes != g.access_gen) {
    // A peer was granted or revoked while the driver calls ran: the new range gets the table of
    // now, device by device, as set_peer_access gave it to every mapped run.
    auto mode_in = [](const std::vector<access_desc>& t, int d) {
      for (const auto& a : t)
        if (a.device == d) return a.mode;
      return access_mode::none;
    };
    std::vector<int> devices;
    for (const auto& a : g.access) devices.push_back(a.device);
    for (const auto& a : pol_.access) devices.push_back(a.device);
    for (int d : devices) {
      const access_mode now = mode_in(pol_.access, d);
      if (now == mode_in(g.access, d)) continue;
      const access_desc one[1] = {{d, now}};
      if (st = drv_.set_access(g.va, g.size, one); !st.ok()) break;
    }
    if (!st.ok()) {  // undo the mappings, newest first, as a refused transaction does
      std::size_t off = g.size;
      for (auto it = g.pieces.rbegin(); it != g.pieces.rend(); ++it) {
        off -= it->size;
        if (!vm::driver::twice([&] { return drv_.unmap(g.va + off, it->size); }).ok()) {
          g.strays.add_mapping(g.va + off, it->size, it->h);
          continue;
        }
        if (it->created) {
          if (!vm::driver::twice([&] { return drv_.release(it->h); }).ok()) g.strays.add_handle(it->h, it->size);
        } else {
          g.returned.push_back({it->h, it->size});
        }
      }
    }
  }
  if (!st.ok()) {
    give_hole(g.va, g.size);
    for (const auto& e : g.strays.entries())
      if (e.mapped) take_hole(e.va, e.size);  // what the driver refused to unmap keeps its VA
    strays_.take(g.strays);
    for (auto& l : g.returned) idle_put(l.h, l.size);
    g.returned.clear();
    note_peaks();
    return st;
  }
  strays_.take(g.strays);  // empty after a success
  install(g.va, g.pieces, g.owner, g.heap);
  return {};
}

std::vector<std::pair<std::uintptr_t, std::size_t>> arena::mapped_runs() const {
  // Chunks are what is mapped and ours; the runs are maximal ranges of adjacent chunks.
  std::map<std::uintptr_t, std::size_t> by_va;
  for (const chunk& c : chunks_)
    if (c.size) by_va.emplace(c.va, c.size);
  std::vector<std::pair<std::uintptr_t, std::size_t>> runs;
  for (auto& [va, n] : by_va) {
    if (!runs.empty() && runs.back().first + runs.back().second == va) runs.back().second += n;
    else runs.emplace_back(va, n);
  }
  return runs;
}

status arena::set_peer_access(int device, access_mode mode) {
  return policy::set_peer_access(drv_, opt_, pol_, gran_, device, mode, mapped_runs());
}

result<shareable_handle> arena::export_chunk(std::uint32_t id) {
  if (id >= chunks_.size() || !chunks_[id].size)
    return {{}, fail(errc::invalid_value, "export", "no such chunk")};
  if (pol_.props.ipc == ipc_kind::none)
    return {{}, fail(errc::not_supported, "export", "the policy is not exportable (options.ipc is none)")};
  return drv_.export_handle(chunks_[id].handle, pol_.props.ipc);
}

status arena::unmap_chunk(std::uint32_t id, bool keep_handle) {
  chunk& c = chunks_[id];
  assert(c.size && c.used == 0);
  if (status st = drv_.unmap(c.va, c.size); !st.ok()) return st;  // still mapped: stays a chunk
  lru_remove(id);
  for (std::size_t pg = page_of(c.va), e = pg + c.size / gran_; pg < e; ++pg) page_map_[pg] = no_chunk;
  give_hole(c.va, c.size);
  mapped_ -= c.size;
  count_mapped(c, false);
  if (c.compressed) compressed_bytes_ -= c.size;
  --chunk_count_;
  // The unmap happened: from here on the chunk is gone whatever release() says.
  mem_handle h = c.handle;
  std::size_t size = c.size;
  c = chunk{};
  free_slots_.push_back(id);
  if (keep_handle) idle_put(h, size);
  else release_or_park(h, size);
  return {};
}

status arena::release_idle(std::size_t keep, bool keep_retired) {
  status parked = retry_strays();
  if (!deferring() && !defer_rel_) (void)poll_retiring(false);  // else a deferred growth unmaps them
  // Largest first: fewest driver calls for the bytes returned.
  auto it = idle_.end();
  while (idle_bytes_ > keep && it != idle_.begin()) {
    --it;
    if (keep_retired && aliased(it->second, true)) continue;
    if (defer_rel_ && !aliased(it->second)) {  // a free's: released by park_releases' growth
      it = doom_idle(it, doomed_);
      continue;
    }
    if (status st = drv_.release(it->second); !st.ok()) return st;
    (void)note_release_of_aliased(it->second, it->first);
    idle_bytes_ -= it->first;
    it = idle_.erase(it);
  }
  if (!parked.ok() && parked_error_.ok()) parked_error_ = parked;
  return {};
}

bool arena::lend_idle(std::size_t max, mem_handle& h, std::size_t& size) {
  for (auto it = idle_.upper_bound(max); it != idle_.begin();) {
    --it;
    if (aliased(it->second)) continue;
    h = it->second;
    size = it->first;
    idle_bytes_ -= size;
    idle_.erase(it);
    return true;
  }
  return false;
}

bool arena::take_back(mem_handle h, std::size_t size) {
  const std::size_t limit = memory_limit();
  if (size > limit || held_for_limit() > limit - size)
    return false;
  idle_put(h, size);
  note_peaks();
  return true;
}

status arena::evict_chunk(std::uint32_t id, bool keep_handle) {
  if (!keep_handle && defer_rel_) {  // given back by a free: unmapped and released after its lock
    retire_chunk(id, 0, nullptr, false, true);
    return {};
  }
  if (!keep_handle || !deferring()) return unmap_chunk(id, keep_handle);
  retire_chunk(id, 0, nullptr, false);
  return {};
}

void arena::retire_chunk(std::uint32_t id, fence_t fence, stream_t stream, bool count, bool doom) {
  chunk& c = chunks_[id];
  assert(c.size && c.used == 0);
  lru_remove(id);
  for (std::size_t pg = page_of(c.va), e = pg + c.size / gran_; pg < e; ++pg) page_map_[pg] = no_chunk;
  mapped_ -= c.size;
  count_mapped(c, false);
  if (c.compressed) compressed_bytes_ -= c.size;
  --chunk_count_;
  // A handle another retired range still maps (stitched from it) is not released with this range:
  // it goes idle, and a release under the lock marks its ranges held (note_release_of_aliased).
  if (doom && aliased(c.handle)) doom = false;
  retiring_.push_back({c.va, c.size, c.handle, fence, 0, stream, false, doom});
  if (count) ++retired_count_;
  if (doom) {
    doomed_.push_back({c.handle, c.size});
    releasing_bytes_ += c.size;
  } else {
    idle_put(c.handle, c.size);
  }
  c = chunk{};
  free_slots_.push_back(id);
}

status arena::poll_retiring(bool wait, std::vector<stream_t>* wait_out) {
  status first{};
  for (std::size_t i = 0; i < retiring_.size();) {
    retired& r = retiring_[i];
    if (r.unmapping) {  // a growth in flight unmaps it
      ++i;
      continue;
    }
    if (r.fence && !drv_.fence_done(r.fence)) {
      if (!wait || wait_out) {
        if (wait) wait_out->push_back(r.stream);
        ++i;
        continue;
      }
      if (status w = drv_.wait_fence(r.fence); !w.ok()) {  // still running: stays retired
        if (first.ok()) first = w;
        ++i;
        continue;
      }
    }
    if (defer_rel_ || deferring()) {  // the parked round unmaps it outside the lock
      ++i;
      continue;
    }
    if (status u = vm::driver::twice([&] { return drv_.unmap(r.va, r.size); }); !u.ok()) {
      if (first.ok()) first = u;  // stays mapped: retried by the next poll
      ++i;
      continue;
    }
    if (r.fence) drv_.drop_fence(r.fence);
    drop_retired(i);
  }
  return first;
}

void arena::count_mapped(const chunk& c, bool add) {
  if (c.heap >= lru_.size()) lru_.resize(c.heap + 1);
  if (add) lru_[c.heap].mapped += c.size;
  else lru_[c.heap].mapped -= c.size;
}

void arena::lru_push(std::uint32_t id) {
  chunk& c = chunks_[id];
  if (c.heap >= lru_.size()) lru_.resize(c.heap + 1);
  lru_list& l = lru_[c.heap];
  c.lru_prev = l.tail;
  c.lru_next = no_chunk;
  if (l.tail != no_chunk) chunks_[l.tail].lru_next = id; else l.head = id;
  l.tail = id;
  l.bytes += c.size;
  free_chunk_bytes_ += c.size;
  // Oldest at the head: idle decay walks from there. A clock read only where the option is set.
  if (opt_.idle_decay_ms > 0) c.free_since = steady_ns();
}

void arena::lru_remove(std::uint32_t id) {
  chunk& c = chunks_[id];
  lru_list& l = lru_[c.heap];
  if (c.lru_prev == no_chunk && l.head != id) return;  // not on the list
  if (c.lru_prev != no_chunk) chunks_[c.lru_prev].lru_next = c.lru_next; else l.head = c.lru_next;
  if (c.lru_next != no_chunk) chunks_[c.lru_next].lru_prev = c.lru_prev; else l.tail = c.lru_prev;
  c.lru_prev = c.lru_next = no_chunk;
  l.bytes -= c.size;
  free_chunk_bytes_ -= c.size;
}

void arena::add_used(std::uint32_t id, std::size_t n) {
  chunk& c = chunks_[id];
  if (c.used == 0) lru_remove(id);
  c.used += n;
}

void arena::sub_used(std::uint32_t id, std::size_t n) {
  chunk& c = chunks_[id];
  assert(c.used >= n);
  c.used -= n;
  if (c.used == 0) lru_push(id);
}

void arena::note_peaks() {
  const std::size_t physical = physical_now();
  peak_mapped_ = std::max(peak_mapped_, mapped_);
  peak_physical_ = std::max(peak_physical_, physical);
}

void arena::reset_peaks() {
  peak_mapped_ = mapped_;
  peak_physical_ = physical_now();
}

arena_stats arena::stats() const {
  arena_stats s;
  s.reserved = res_.size();
  s.mapped = mapped_;
  s.idle = idle_bytes_;
  s.stray_bytes = strays_.bytes();
  s.physical = physical_now();
  for (const auto& r : retiring_) s.retiring_bytes += r.size;
  s.retired = retired_count_;
  s.free_chunk_bytes = free_chunk_bytes_;
  s.peak_mapped = peak_mapped_;
  s.peak_physical = peak_physical_;
  s.chunks = chunk_count_;
  s.stitched = stitched_;
  // Counted by create hooks that may run outside the front end's lock.
  auto& fallbacks = const_cast<std::uint64_t&>(pol_.compression_fallbacks);
  s.compression_fallbacks = std::atomic_ref(fallbacks).load(std::memory_order_relaxed);
  s.ipc_fallbacks = pol_.ipc_fallbacks;
  s.compressed = compressed_bytes_;
  s.access_changes = pol_.access_changes;
  s.calls = drv_.counts();
  return s;
}

std::string arena::check() const {
  // Walk chunks, holes and stray mappings in address order: they must tile the reservation.
  std::map<std::uintptr_t, std::size_t> ranges(holes_.begin(), holes_.end());
  for (const auto& e : strays_.entries())
    if (e.mapped && !ranges.emplace(e.va, e.size).second) return "stray mapping overlaps a hole";
  std::map<std::uint64_t, std::size_t> releases;  // one release frees its handle's bytes once
  for (const auto& r : retiring_) {
    if (!ranges.emplace(r.va, r.size).second) return "retired range overlaps a hole, chunk or stray";
    if (r.released) releases[r.released] = r.size;
  }
  std::size_t held = 0;
  for (const auto& [id, n] : releases) held += n;
  if (held != retired_held_) return "retired held byte count is off";
  std::size_t inflight = 0;
  for (const auto& [va, n] : inflight_) {
    if (!ranges.emplace(va, n).second) return "a growth in flight overlaps a hole, stray or retired range";
    inflight += n;
  }
  if (inflight != inflight_bytes_) return "bytes of growths in flight are off";
  std::size_t mapped = 0, freeb = 0, n = 0;
  for (std::uint32_t id = 0; id < chunks_.size(); ++id) {
    const chunk& c = chunks_[id];
    if (!c.size) continue;
    ++n;
    mapped += c.size;
    if (c.used == 0) freeb += c.size;
    if (c.used > c.size) return "chunk used bytes exceed its size";
    if (!ranges.emplace(c.va, c.size).second) return "chunk overlaps a hole or chunk";
    for (std::size_t pg = page_of(c.va), e = pg + c.size / gran_; pg < e; ++pg)
      if (page_map_[pg] != id) return "page map does not match the chunk table";
  }
  std::uintptr_t cur = res_.base();
  for (auto& [va, sz] : ranges) {
    if (va != cur) return "holes, chunks, strays, retired ranges and growths in flight do not tile the reservation";
    cur = va + sz;
  }
  if (res_.size() && cur != res_.base() + res_.size()) return "holes, chunks and strays do not cover the reservation";
  std::size_t mapped_pages = 0;
  for (auto p : page_map_) mapped_pages += p != no_chunk;
  if (mapped_pages * gran_ != mapped) return "page map marks pages outside chunks";
  if (mapped != mapped_ || n != chunk_count_) return "mapped byte count is off";
  if (freeb != free_chunk_bytes_) return "free chunk byte count is off";
  std::size_t idle = 0;
  for (auto& [sz, h] : idle_) idle += sz;
  if (idle != idle_bytes_) return "idle byte count is off";
  std::size_t lru = 0;
  for (std::uint16_t h = 0; h < lru_.size(); ++h) {
    std::size_t mine = 0;
    for (auto id = lru_[h].head; id != no_chunk; id = chunks_[id].lru_next) {
      if (chunks_[id].used) return "a used chunk is on the free-chunk list";
      if (chunks_[id].heap != h) return "a free chunk is on another heap's list";
      mine += chunks_[id].size;
    }
    if (mine != lru_[h].bytes) return "a heap's free-chunk byte count is off";
    lru += mine;
  }
  if (lru != free_chunk_bytes_) return "free-chunk list does not hold every free chunk";
  return {};
}

}  // namespace vmm
