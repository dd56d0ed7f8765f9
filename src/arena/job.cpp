// SPDX-License-Identifier: Apache-2.0
// The arena's driver work as one protocol: plan (under the caller's lock, no driver call), run
// (any thread, the lock not needed), commit (under the lock). See arena.hpp.
#include <algorithm>
#include <cassert>

#include "arena/arena.hpp"

namespace vmm {

namespace {
constexpr std::size_t round_up(std::size_t n, std::size_t g) { return (n + g - 1) / g * g; }
status fail(errc k, const char* op, const char* name) { return {k, 0, name, op}; }
}  // namespace

// ---- plan ---------------------------------------------------------------------------------------

result<std::uintptr_t> arena::map_range(std::size_t size, std::uintptr_t at, std::uint32_t owner, stream_t stream,
                                        std::size_t* mapped, std::uint16_t heap, std::size_t max_piece,
                                        bool pressed, std::size_t headroom) {
  if (size == 0 || size % gran_) return {0, fail(errc::invalid_value, "map", "size not a multiple of the granularity")};
  assert(!work_.maps());  // one mapping per job: the caller ran the last one
  (void)retry_strays();  // a stray mapping holds VA and physical memory: undo it first if the driver lets us
  // Retired ranges whose stream caught up give their VA back first: their unmaps run before the
  // mapping, in the same job; the VA itself is the job's until commit, so it is no hole yet.
  (void)poll_retiring(false);
  headroom = round_up(headroom, gran_);
  auto hole_for = [&](std::size_t n) -> std::uintptr_t {
    if (at) return hole_at(at, n) ? at : 0;
    // With headroom, from the top down: the lowest holes stay for the mappings without (spans
    // extend upwards), so those rarely land in a block's headroom.
    if (headroom)
      for (auto it = holes_.rbegin(); it != holes_.rend(); ++it)
        if (it->second >= n + headroom) return it->first + it->second - n - headroom;
    for (auto& [hs, hn] : holes_)
      if (hn >= n) return hs;
    return 0;
  };
  if (!hole_for(size)) {
    return {0, at ? fail(errc::out_of_memory, "map", "no hole at the requested address")
                  : fail(errc::out_of_memory, "cuMemAddressReserve", "reservation exhausted")};
  }

  // Pieces: idle handles first (largest that fit), then handles to create for the rest.
  std::vector<vm::piece> pieces;
  std::size_t taken = 0;  // physical bytes in `pieces`: still ours while they wait to be mapped
  // Idle handles to release before the create (into the job only if the plan holds).
  std::vector<std::multimap<std::size_t, mem_handle>::iterator> unfit;
  std::size_t releasing = 0;
  std::size_t total = 0;
  bool flight = false;  // a piece the stream's queued work may still write (job::in_flight)
  const std::size_t piece = max_piece ? std::max(round_up(max_piece, gran_), gran_) : 0;  // 0: no cap
  while (total < size) {
    const std::size_t want = size - total;
    // An idle handle is mapped when it fills a whole piece (max_piece, or what is left), or when
    // a retired range still holds its memory anyway. A smaller one is released below and the
    // range created in whole pieces: a handle moves with its block's memory, every move costs a
    // set-access and an unmap per mapping (~45 us), so a one-page handle (left by a one-page
    // growth) would move a page at a time for the rest of the process. One release and one
    // create repay at the first move: the T5 and GPT-2 replays make half the driver calls, for
    // 0.2-0.6 % more memory (handles wholly free less often).
    const std::size_t whole = piece ? std::min(piece, want) : 0;
    auto it = idle_.upper_bound(want);  // first idle handle larger than want
    auto fit = it;
    while (fit != idle_.begin() && !usable_for(std::prev(fit)->second, stream)) --fit;
    if (fit != idle_.begin() && (std::prev(fit)->first >= whole || aliased(std::prev(fit)->second, false, true))) {
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
      flight = flight || in_flight(it->second);
      pieces.push_back({it->first, it->second});
      taken += it->first;
      total += it->first;
      idle_bytes_ -= it->first;
      idle_.erase(it);
      continue;
    }
    // Idle handles that could not serve this request only add to the footprint: the job releases
    // them before it creates (peak physical stays close to peak mapped). One whose retired range
    // is still mapped stays idle (its memory is not freed yet).
    for (auto i = idle_.begin(); i != idle_.end(); ++i)
      if (!aliased(i->second, false, true) && std::find(unfit.begin(), unfit.end(), i) == unfit.end()) {
        unfit.push_back(i);
        releasing += i->first;
      }
    // The limit is checked before the create: everything held (mappings planned on other
    // threads included), the pieces taken for this range, plus what the create would add, less
    // what this job releases before it creates.
    const std::size_t physical = held_for_limit() + taken - releasing;
    const std::size_t limit = memory_limit();
    if (want > limit || physical > limit - want) {
      for (const auto& p : pieces) idle_put(p.h, p.size);
      return {0, fail(errc::out_of_memory, "options.memory_limit", "memory limit of the policy reached")};
    }
    const std::size_t cap = piece ? piece : want;
    for (std::size_t left = want; left;) {
      const std::size_t n = std::min(left, cap);
      pieces.push_back({n});  // created by run
      left -= n;
    }
    taken += want;
    total += want;
  }
  const std::uintptr_t va = hole_for(total);
  assert(va);  // checked for size, and for every larger total before a piece made it so

  // The hole and the handles are the job's from here: nobody else maps there or takes them.
  for (auto i : unfit) (void)release_later(i);
  take_hole(va, total);
  inflight_.emplace(va, total);
  inflight_bytes_ += total;
  for (const auto& p : pieces)
    if (p.h) inflight_lent_ += p.size;
  job& j = work_;
  j.va = va;
  j.size = total;
  j.owner = owner;
  j.heap = heap;
  j.stream = stream;
  j.in_flight = flight;
  j.pressed = pressed;
  j.pieces = std::move(pieces);
  j.pol = pol_;
  j.access = pol_.access;
  j.access_gen = pol_.access_changes;
  if (mapped) *mapped = total;
  return {va, {}};
}

void arena::retire(std::uint32_t id, fence_t fence, stream_t stream, bool doom) {
  chunk& c = chunks_[id];
  assert(c.size && c.used == 0);
  lru_remove(id);
  for (std::size_t pg = page_of(c.va), e = pg + c.size / gran_; pg < e; ++pg) page_map_[pg] = no_chunk;
  mapped_ -= c.size;
  count_mapped(c, false);
  if (c.compressed) compressed_bytes_ -= c.size;
  --chunk_count_;
  // A handle another retired range still maps (stitched from it) is not released with this range:
  // it goes idle, and a release marks its ranges held (plan_release, commit).
  if (doom && aliased(c.handle)) doom = false;
  retiring_.push_back({c.va, c.size, c.handle, fence, 0, stream, false, doom});
  if (doom) {
    plan_release(c.handle, c.size);
  } else {
    idle_put(c.handle, c.size);
  }
  c = chunk{};
  free_slots_.push_back(id);
}

void arena::give_back_chunk(std::uint32_t id, bool keep_handle) {
  retire(id, 0, nullptr, !keep_handle);
  retired& r = retiring_.back();
  r.unmapping = true;
  work_.unmaps.push_back({r.va, r.size, r.h, false});
}

void arena::retire_chunk(std::uint32_t id, fence_t fence, stream_t stream) {
  retire(id, fence, stream, false);
  ++retired_count_;
}

status arena::poll_retiring(bool wait, std::vector<stream_t>* wait_out) {
  status first{};
  for (retired& r : retiring_) {
    if (r.unmapping) continue;  // a job unmaps it
    if (r.fence && !drv_.fence_done(r.fence)) {
      if (!wait) continue;
      if (wait_out) {
        wait_out->push_back(r.stream);
        continue;
      }
      if (status w = drv_.wait_fence(r.fence); !w.ok()) {  // still running: stays retired
        if (first.ok()) first = w;
        continue;
      }
    }
    r.unmapping = true;
    work_.unmaps.push_back({r.va, r.size, r.h, false});
  }
  return first;
}

std::multimap<std::size_t, mem_handle>::iterator arena::release_later(
    std::multimap<std::size_t, mem_handle>::iterator it) {
  plan_release(it->second, it->first);
  idle_bytes_ -= it->first;
  return idle_.erase(it);
}

void arena::plan_release(mem_handle h, std::size_t size) {
  // The retired ranges that map h are named now, under the lock: once the job's release returns,
  // another thread's create may get h's value back and retire a range of it before this commit.
  const std::uint64_t id = ++release_ids_;
  for (auto& r : retiring_)
    if (r.h == h && r.names_live_handle()) r.releasing = id;
  work_.releases.push_back({h, size, id});
  releasing_bytes_ += size;
}

void arena::release_idle(std::size_t keep) {
  (void)retry_strays();
  (void)poll_retiring(false);
  // Largest first: fewest driver calls for the bytes returned.
  auto it = idle_.end();
  while (idle_bytes_ > keep && it != idle_.begin()) {
    --it;
    it = release_later(it);
  }
}

// ---- run ----------------------------------------------------------------------------------------

arena::job arena::take_work() {
  job j = std::move(work_);
  work_ = job{};
  return j;
}

void arena::run(job& j) {
  auto note = [&](const status& st) {
    if (!st.ok() && j.refused.ok()) j.refused = st;
    return st.ok();
  };
  // Retired ranges first: their unmaps succeed or fail on their own, whatever the mapping does.
  // Ranges side by side go in one call (cuMemUnmap takes several whole mappings): a move of a
  // freed block's chunks is one unmap, not one a handle. A refused run is retried range by range,
  // so what the driver refuses is still known per handle.
  std::vector<std::size_t> order(j.unmaps.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](std::size_t x, std::size_t y) { return j.unmaps[x].va < j.unmaps[y].va; });
  for (std::size_t b = 0; b < order.size();) {
    std::size_t e = b + 1;
    std::uintptr_t end = j.unmaps[order[b]].va + j.unmaps[order[b]].size;
    for (; e < order.size() && j.unmaps[order[e]].va == end; ++e) end += j.unmaps[order[e]].size;
    const std::uintptr_t va = j.unmaps[order[b]].va;
    if (e - b > 1 && drv_.unmap(va, end - va).ok()) {
      for (std::size_t k = b; k < e; ++k) j.unmaps[order[k]].done = true;
    } else {
      for (std::size_t k = b; k < e; ++k) {
        auto& u = j.unmaps[order[k]];
        u.done = note(vm::driver::twice([&] { return drv_.unmap(u.va, u.size); }));
      }
    }
    b = e;
  }
  // Then the releases, before any create: the memory is the device's again first. A handle whose
  // range the driver refused to unmap is parked instead (released by a later retry; the range
  // stays retired until it is unmapped).
  for (auto& l : j.releases) {
    const bool still_mapped = std::any_of(j.unmaps.begin(), j.unmaps.end(),
                                          [&](const job::unmap& u) { return u.h == l.h && !u.done; });
    l.done = !still_mapped && note(vm::driver::twice([&] { return drv_.release(l.h); }));
    if (!l.done) j.strays.add_handle(l.h, l.size);
  }
  if (!j.maps()) return;
  // The policies' create hooks work on the job's copy of their state: a fallback they decide
  // (fabric refused: POSIX fds) is applied to the arena's at commit.
  j.pol_after = j.pol;
  j.txn.emplace(drv_, j.strays);
  j.st = j.txn->place(j.va, j.pieces, j.access, [&](std::size_t n) {
    return policy::create_chunk(drv_, policies_, opt_, j.pol_after, n);
  });
  if (!j.st.ok()) {
    j.txn->rollback();
    return;
  }
  j.marked.assign(j.pieces.size(), false);
  for (std::size_t i = 0; i < j.pieces.size(); ++i)
    for (auto& pol : policies_) j.marked[i] = pol->mapped(drv_, j.pol_after, j.pieces[i].h) || j.marked[i];
}

// ---- commit -------------------------------------------------------------------------------------

status arena::commit(job& j) {
  for (const auto& u : j.unmaps)
    for (std::size_t i = 0; i < retiring_.size(); ++i) {
      retired& r = retiring_[i];
      if (r.va != u.va) continue;
      r.unmapping = false;
      // The fence goes with the entry, under the lock: until here other threads may still ask
      // about it (usable_for, poll_retiring), and a query of a destroyed event is undefined.
      if (u.done && r.fence) drv_.drop_fence(r.fence);
      if (u.done) drop_retired(i);
      break;
    }
  for (const auto& l : j.releases) {
    releasing_bytes_ -= l.size;  // released, or parked as a stray
    // The retired ranges still mapping it hold its memory until their unmap (counted once).
    bool held = false;
    for (auto& r : retiring_) {
      if (r.releasing != l.id) continue;
      r.releasing = 0;
      if (l.done) r.released = l.id, held = true;
    }
    if (held) retired_held_ += l.size;
  }
  if (!j.refused.ok() && parked_error_.ok()) parked_error_ = j.refused;
  if (!j.maps()) {
    strays_.take(j.strays);  // releases the driver refused
    return {};
  }
  inflight_.erase(j.va);
  inflight_bytes_ -= j.size;
  status st = j.st;
  if (st.ok()) {
    // What the create hooks decided outside the lock: a fallback counted once, here.
    pol_.compression_fallbacks += j.pol_after.compression_fallbacks - j.pol.compression_fallbacks;
    if (j.pol_after.props.ipc != j.pol.props.ipc && pol_.props.ipc == j.pol.props.ipc) {
      pol_.props.ipc = j.pol_after.props.ipc;
      pol_.ipc_fallbacks += j.pol_after.ipc_fallbacks - j.pol.ipc_fallbacks;
    }
  }
  if (st.ok() && pol_.access_changes != j.access_gen) {
    // A peer was granted or revoked while the driver calls ran: the new range gets the table of
    // now, device by device, as set_peer_access gave it to every mapped run. If that fails, the
    // mapping is undone as any failed one.
    auto mode_in = [](std::span<const access_desc> t, int d) {
      for (const auto& a : t)
        if (a.device == d) return a.mode;
      return access_mode::none;
    };
    std::vector<int> devices;
    for (const auto& a : j.access) devices.push_back(a.device);
    for (const auto& a : pol_.access) devices.push_back(a.device);
    for (int d : devices) {
      const access_mode now = mode_in(pol_.access, d);
      if (now == mode_in(j.access, d)) continue;
      const access_desc one[1] = {{d, now}};
      if (st = drv_.set_access(j.va, j.size, one); !st.ok()) break;
    }
    if (!st.ok()) j.txn->rollback();
  }
  for (const auto& p : j.pieces)  // the idle handles it took are mapped now, or back below
    if (p.h && !p.created) inflight_lent_ -= p.size;
  if (!st.ok()) {
    give_hole(j.va, j.size);
    if (j.txn)
      for (const auto& l : j.txn->returned()) idle_put(l.h, l.size);
    else  // planned and never run (teardown): every piece is an idle handle or none yet
      for (const auto& p : j.pieces)
        if (p.h) idle_put(p.h, p.size);
    for (const auto& e : j.strays.entries())
      if (e.mapped) take_hole(e.va, e.size);  // what the driver refused to unmap keeps its VA
    strays_.take(j.strays);
    note_peaks();
    return st;
  }
  j.txn->commit();
  strays_.take(j.strays);  // releases the driver refused
  install(j);
  return {};
}

void arena::install(const job& j) {
  std::size_t off = 0;
  for (std::size_t i = 0; i < j.pieces.size(); ++i) {
    const vm::piece& p = j.pieces[i];
    auto id = new_chunk_slot();
    const bool marked = i < j.marked.size() && j.marked[i];
    chunks_[id] = chunk{j.va + off, p.size, p.h, 0, no_chunk, no_chunk, j.owner, j.heap, marked};
    for (std::size_t pg = page_of(j.va + off), e = pg + p.size / gran_; pg < e; ++pg) page_map_[pg] = id;
    mapped_ += p.size;
    count_mapped(chunks_[id], true);
    if (marked) compressed_bytes_ += p.size;
    if (!p.created) ++stitched_;
    ++chunk_count_;
    lru_push(id);  // a new chunk holds no block yet; the heap's add_used takes it off the list
    off += p.size;
  }
  note_peaks();
}

}  // namespace vmm
