// arena: reservation, holes, chunk table, page map, idle-handle cache. See arena.hpp.
#include "arena/arena.hpp"

#include <algorithm>
#include <cassert>

namespace vmm {

namespace {
constexpr std::size_t round_up(std::size_t n, std::size_t g) { return (n + g - 1) / g * g; }
status fail(errc k, const char* op, const char* name) { return {k, 0, name, op}; }
}  // namespace

arena::arena(std::unique_ptr<backend_iface> b, const options& o) : b_(std::move(b)), opt_(o) {
  props_.location = opt_.location;
  props_.id = opt_.device;
  props_.compressible = opt_.compression != compression_mode::off;
  props_.ipc = opt_.ipc;
}

status arena::open() {
  if (!b_) return fail(errc::invalid_value, "arena", "no backend");
  unsigned caps = b_->capabilities();
  if (props_.compressible && !(caps & cap_compression)) {
    if (opt_.compression == compression_mode::require)
      return fail(errc::not_supported, "arena", "compression not supported by this device");
    props_.compressible = false;  // prefer: fall back, counted
    ++compression_fallbacks_;
  }
  if (props_.ipc == ipc_kind::fabric && !(caps & cap_export_fabric)) {
    props_.ipc = ipc_kind::posix_fd;  // as NCCL does: fabric where the device has it, else fds
    ++ipc_fallbacks_;
  }
  if (props_.ipc == ipc_kind::posix_fd && !(caps & cap_export_posix_fd))
    return fail(errc::not_supported, "arena", "POSIX fd export not supported by this device");

  // Granularity: the largest among the devices involved (owner and peers).
  auto g = b_->granularity(props_);
  if (!g.ok()) return g.st;
  auto pick = [&](const granularity_info& gi) {
    return opt_.recommended_granularity && gi.recommended ? gi.recommended : gi.minimum;
  };
  gran_ = pick(g.value);
  for (auto& p : opt_.peers) {
    if (p.device == opt_.device) continue;
    if (!b_->can_access_peer(p.device, opt_.device))
      return fail(errc::invalid_value, "arena", "peer device cannot access the owner device (cuDeviceCanAccessPeer, or no VMM support)");
    chunk_props pp = props_;
    pp.id = p.device;
    auto pg = b_->granularity(pp);
    if (!pg.ok()) return pg.st;
    gran_ = std::max(gran_, pick(pg.value));
  }
  if (gran_ == 0 || (gran_ & (gran_ - 1))) return fail(errc::invalid_value, "arena", "bad granularity");
  gran_shift_ = static_cast<unsigned>(__builtin_ctzll(gran_));
  if (opt_.min_chunk == 0) opt_.min_chunk = gran_;
  opt_.min_chunk = round_up(opt_.min_chunk, gran_);

  access_.push_back({opt_.device, access_mode::read_write});
  // Pinned host memory (host_numa) is reachable from the CPU only once the host is granted too.
  if (opt_.location == location_kind::host_numa) access_.push_back({cpu_device, access_mode::read_write});
  for (auto& p : opt_.peers)
    if (p.device != opt_.device) access_.push_back(p);

  std::size_t size = opt_.reservation_size;
  if (size == 0) {
    auto mi = b_->mem_info();
    size = mi.ok() && mi.value.total ? 2 * mi.value.total : std::size_t{64} << 30;
  }
  size = round_up(size, gran_);
  if (size < gran_ || size / gran_ > std::numeric_limits<std::uint32_t>::max())
    return fail(errc::invalid_value, "arena", "reservation size out of range");
  ++calls_.reserve;
  auto r = b_->reserve(size, gran_);
  if (!r.ok()) {
    ++calls_.failures;
    return r.st;
  }
  base_ = r.value;
  size_ = size;
  page_map_.assign(size / gran_, no_chunk);
  holes_.emplace(base_, size_);
  return {};
}

arena::~arena() {
  if (!b_) return;
  // Teardown cannot report errors: each step is retried once (a driver call refused once, as in
  // the fault-injection sweep, must not leak a handle, a mapping or the reservation).
  auto twice = [](auto&& f) { if (!f().ok()) f(); };
  for (std::uint32_t id = 0; id < chunks_.size(); ++id) {
    auto& c = chunks_[id];
    if (!c.size) continue;
    if (c.fence) b_->wait_fence(c.fence), b_->drop_fence(c.fence);
    twice([&] { return b_->unmap(c.va, c.size); });
    twice([&] { return b_->release(c.handle); });
  }
  for (auto& e : idle_) twice([&] { return b_->release(e.second); });
  if (size_) twice([&] { return b_->free_reservation(base_, size_); });
}

void arena::release_or_park(mem_handle h, std::size_t size) {
  ++calls_.release;
  status st = b_->release(h);
  if (st.ok()) return;
  // Refused: the handle is still ours. Keep it as idle memory; release_idle() or teardown retries.
  ++calls_.failures;
  idle_.emplace(size, h);
  idle_bytes_ += size;
  if (parked_error_.ok()) parked_error_ = st;
}

result<mem_handle> arena::create_handle(std::size_t size) {
  ++calls_.create;
  auto h = b_->create(size, props_);
  if (!h.ok() && props_.ipc == ipc_kind::fabric &&
      (h.st.kind == errc::not_permitted || h.st.kind == errc::not_supported) &&
      (b_->capabilities() & cap_export_posix_fd)) {
    // Fabric handles need an IMEX channel; without one the driver refuses (NOT_PERMITTED).
    // Fall back to POSIX fds for this and every later chunk, counted.
    ++calls_.failures;
    props_.ipc = ipc_kind::posix_fd;
    ++ipc_fallbacks_;
    ++calls_.create;
    h = b_->create(size, props_);
  }
  if (!h.ok()) {
    ++calls_.failures;
    return h;
  }
  if (props_.compressible) {
    auto q = b_->query(h.value);
    bool granted = q.ok() && q.value.compressible;
    if (!granted) {
      if (opt_.compression == compression_mode::require) {
        release_or_park(h.value, size);
        return {0, fail(errc::not_supported, "cuMemCreate", "compression requested but not granted")};
      }
      ++compression_fallbacks_;
    }
  }
  return h;
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

result<std::uintptr_t> arena::map_range(std::size_t size, std::uintptr_t at, std::uint32_t owner) {
  if (size == 0 || size % gran_) return {0, fail(errc::invalid_value, "map", "size not a multiple of the granularity")};
  // Physical budget: idle handles are already counted, new ones must fit the limit.
  std::uintptr_t va = 0;
  if (at) {
    if (!hole_at(at, size)) return {0, fail(errc::out_of_memory, "map", "no hole at the requested address")};
    va = at;
  } else {
    for (auto& [hs, hn] : holes_)
      if (hn >= size) { va = hs; break; }
    if (!va) return {0, fail(errc::out_of_memory, "cuMemAddressReserve", "reservation exhausted")};
  }

  // Pieces: idle handles first (largest that fit), then one created handle for the rest.
  struct piece { std::uintptr_t va; std::size_t size; mem_handle h; bool from_idle; std::uint32_t id; };
  std::vector<piece> done;
  std::size_t off = 0;
  auto rollback = [&](status st) -> result<std::uintptr_t> {
    for (auto it = done.rbegin(); it != done.rend(); ++it) {
      ++calls_.unmap;
      b_->unmap(it->va, it->size);
      chunks_[it->id] = chunk{};
      free_slots_.push_back(it->id);
      if (it->from_idle) {
        idle_.emplace(it->size, it->h);
        idle_bytes_ += it->size;
      } else {
        release_or_park(it->h, it->size);
      }
    }
    return {0, st};
  };

  while (off < size) {
    std::size_t want = size - off;
    mem_handle h = 0;
    std::size_t hsize = 0;
    bool from_idle = false;
    auto it = idle_.upper_bound(want);  // first idle handle larger than want
    if (it != idle_.begin()) {
      --it;  // largest idle handle <= want
      h = it->second;
      hsize = it->first;
      idle_.erase(it);
      idle_bytes_ -= hsize;
      from_idle = true;
    } else {
      // Idle handles that could not serve this request only add to the footprint: release them
      // before creating more (peak physical stays close to peak mapped).
      if (opt_.stitch_on_grow && idle_bytes_) {
        status r = release_idle(0);
        if (!r.ok()) return rollback(r);
      }
      std::size_t physical = mapped_ + idle_bytes_;
      if (want > opt_.memory_limit || physical > opt_.memory_limit - want)
        return rollback(fail(errc::out_of_memory, "options.memory_limit", "memory limit of the policy reached"));
      auto c = create_handle(want);
      if (!c.ok()) return rollback(c.st);
      h = c.value;
      hsize = want;
    }
    ++calls_.map;
    status st = b_->map(va + off, hsize, h, 0);
    if (!st.ok()) {
      ++calls_.failures;
      if (from_idle) {
        idle_.emplace(hsize, h);
        idle_bytes_ += hsize;
      } else {
        release_or_park(h, hsize);
      }
      return rollback(st);
    }
    // What the driver granted (compression is a hint): read back once per mapped chunk, only
    // when compression was asked for.
    bool compressed = false;
    if (props_.compressible) {
      auto q = b_->query(h);
      compressed = q.ok() && q.value.compressible;
    }
    auto id = new_chunk_slot();
    chunks_[id] = chunk{va + off, hsize, h, 0, 0, no_chunk, no_chunk, owner, compressed};
    done.push_back({va + off, hsize, h, from_idle, id});
    if (from_idle) ++stitched_;
    off += hsize;
  }
  // One set_access over the whole range: the driver's cost is per call, not per chunk.
  status st = call_set_access(va, size, access_);
  if (!st.ok()) return rollback(st);

  take_hole(va, size);
  for (auto& p : done) {
    for (std::size_t pg = page_of(p.va), e = pg + p.size / gran_; pg < e; ++pg) page_map_[pg] = p.id;
    mapped_ += p.size;
    if (chunks_[p.id].compressed) compressed_bytes_ += p.size;
    ++chunk_count_;
    lru_push(p.id);  // a new chunk holds no block yet; the heap's add_used takes it off the list
  }
  note_peaks();
  return {va, {}};
}

status arena::call_set_access(std::uintptr_t va, std::size_t size, std::span<const access_desc> a) {
  ++calls_.set_access;
  status st = b_->set_access(va, size, a);
  if (!st.ok()) ++calls_.failures;
  return st;
}

std::vector<std::pair<std::uintptr_t, std::size_t>> arena::mapped_runs() const {
  std::vector<std::pair<std::uintptr_t, std::size_t>> runs;
  std::uintptr_t cur = base_;
  // Holes are sorted: the mapped runs are exactly the gaps between them.
  for (auto& [hs, hn] : holes_) {
    if (hs > cur) runs.emplace_back(cur, hs - cur);
    cur = hs + hn;
  }
  if (size_ && cur < base_ + size_) runs.emplace_back(cur, base_ + size_ - cur);
  return runs;
}

status arena::set_peer_access(int device, access_mode mode) {
  if (device == opt_.device)
    return fail(errc::invalid_value, "set_peer_access", "the owner device's access cannot be changed");
  if (device < 0) return fail(errc::invalid_value, "set_peer_access", "negative device ordinal");
  if (mode != access_mode::none) {
    if (!b_->can_access_peer(device, opt_.device))
      return fail(errc::invalid_value, "set_peer_access", "peer device cannot access the owner device (cuDeviceCanAccessPeer, or no VMM support)");
    chunk_props pp = props_;
    pp.id = device;
    auto pg = b_->granularity(pp);
    if (!pg.ok()) return pg.st;
    if (pg.value.minimum > gran_)
      return fail(errc::invalid_value, "set_peer_access",
                  "peer granularity is larger than the arena's (name the peer in options.peers)");
  }
  auto it = std::find_if(access_.begin(), access_.end(), [&](const access_desc& a) { return a.device == device; });
  const access_mode old = it == access_.end() ? access_mode::none : it->mode;
  if (old == mode) return {};
  // One call per mapped run, naming only this device: the others' access is untouched.
  const access_desc now[1] = {{device, mode}};
  const access_desc before[1] = {{device, old}};
  auto runs = mapped_runs();
  for (std::size_t i = 0; i < runs.size(); ++i) {
    status st = call_set_access(runs[i].first, runs[i].second, now);
    if (!st.ok()) {
      for (std::size_t j = i; j-- > 0;) call_set_access(runs[j].first, runs[j].second, before);
      return st;
    }
  }
  if (mode == access_mode::none) {
    if (it != access_.end()) access_.erase(it);
  } else if (it != access_.end()) {
    it->mode = mode;
  } else {
    access_.push_back({device, mode});
  }
  ++access_changes_;
  return {};
}

result<shareable_handle> arena::export_chunk(std::uint32_t id) {
  if (id >= chunks_.size() || !chunks_[id].size)
    return {{}, fail(errc::invalid_value, "export", "no such chunk")};
  if (props_.ipc == ipc_kind::none)
    return {{}, fail(errc::not_supported, "export", "the policy is not exportable (options.ipc is none)")};
  ++calls_.export_handle;
  auto r = b_->export_handle(chunks_[id].handle, props_.ipc);
  if (!r.ok()) ++calls_.failures;
  return r;
}

status arena::unmap_chunk(std::uint32_t id, bool keep_handle) {
  chunk& c = chunks_[id];
  assert(c.size && c.used == 0);
  if (c.fence) {
    // Only this chunk's last user is waited for, never the whole device.
    status w = b_->wait_fence(c.fence);
    if (!w.ok()) return w;
    b_->drop_fence(c.fence);
    c.fence = 0;
  }
  ++calls_.unmap;
  status st = b_->unmap(c.va, c.size);
  if (!st.ok()) {
    ++calls_.failures;
    return st;
  }
  lru_remove(id);
  for (std::size_t pg = page_of(c.va), e = pg + c.size / gran_; pg < e; ++pg) page_map_[pg] = no_chunk;
  give_hole(c.va, c.size);
  mapped_ -= c.size;
  if (c.compressed) compressed_bytes_ -= c.size;
  --chunk_count_;
  // The unmap happened: from here on the chunk is gone whatever release() says.
  mem_handle h = c.handle;
  std::size_t size = c.size;
  c = chunk{};
  free_slots_.push_back(id);
  if (keep_handle) {
    idle_.emplace(size, h);
    idle_bytes_ += size;
  } else {
    release_or_park(h, size);
  }
  return {};
}

status arena::release_idle(std::size_t keep) {
  // Largest first: fewest driver calls for the bytes returned.
  while (idle_bytes_ > keep && !idle_.empty()) {
    auto it = std::prev(idle_.end());
    ++calls_.release;
    status st = b_->release(it->second);
    if (!st.ok()) {
      ++calls_.failures;
      return st;
    }
    idle_bytes_ -= it->first;
    idle_.erase(it);
  }
  return {};
}

void arena::lru_push(std::uint32_t id) {
  chunk& c = chunks_[id];
  c.lru_prev = lru_tail_;
  c.lru_next = no_chunk;
  if (lru_tail_ != no_chunk) chunks_[lru_tail_].lru_next = id; else lru_head_ = id;
  lru_tail_ = id;
  free_chunk_bytes_ += c.size;
}

void arena::lru_remove(std::uint32_t id) {
  chunk& c = chunks_[id];
  if (c.lru_prev == no_chunk && lru_head_ != id) return;  // not on the list
  if (c.lru_prev != no_chunk) chunks_[c.lru_prev].lru_next = c.lru_next; else lru_head_ = c.lru_next;
  if (c.lru_next != no_chunk) chunks_[c.lru_next].lru_prev = c.lru_prev; else lru_tail_ = c.lru_prev;
  c.lru_prev = c.lru_next = no_chunk;
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

void arena::set_fence(std::uint32_t id, fence_t f) {
  chunk& c = chunks_[id];
  if (c.fence && c.fence != f) b_->drop_fence(c.fence);  // a later fence on the same stream covers it
  c.fence = f;
}

void arena::note_peaks() {
  peak_mapped_ = std::max(peak_mapped_, mapped_);
  peak_physical_ = std::max(peak_physical_, mapped_ + idle_bytes_);
}

void arena::reset_peaks() {
  peak_mapped_ = mapped_;
  peak_physical_ = mapped_ + idle_bytes_;
}

arena_stats arena::stats() const {
  arena_stats s;
  s.reserved = size_;
  s.mapped = mapped_;
  s.idle = idle_bytes_;
  s.physical = mapped_ + idle_bytes_;
  s.free_chunk_bytes = free_chunk_bytes_;
  s.peak_mapped = peak_mapped_;
  s.peak_physical = peak_physical_;
  s.chunks = chunk_count_;
  s.stitched = stitched_;
  s.compression_fallbacks = compression_fallbacks_;
  s.ipc_fallbacks = ipc_fallbacks_;
  s.compressed = compressed_bytes_;
  s.access_changes = access_changes_;
  s.calls = calls_;
  return s;
}

std::string arena::check() const {
  // Walk chunks and holes in address order: they must tile the reservation.
  std::map<std::uintptr_t, std::size_t> ranges(holes_.begin(), holes_.end());
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
  std::uintptr_t cur = base_;
  for (auto& [va, sz] : ranges) {
    if (va != cur) return "holes and chunks do not tile the reservation";
    cur = va + sz;
  }
  if (size_ && cur != base_ + size_) return "holes and chunks do not cover the reservation";
  std::size_t mapped_pages = 0;
  for (auto p : page_map_) mapped_pages += p != no_chunk;
  if (mapped_pages * gran_ != mapped) return "page map marks pages outside chunks";
  if (mapped != mapped_ || n != chunk_count_) return "mapped byte count is off";
  if (freeb != free_chunk_bytes_) return "free chunk byte count is off";
  std::size_t idle = 0;
  for (auto& [sz, h] : idle_) idle += sz;
  if (idle != idle_bytes_) return "idle byte count is off";
  std::size_t lru = 0;
  for (auto id = lru_head_; id != no_chunk; id = chunks_[id].lru_next) {
    if (chunks_[id].used) return "a used chunk is on the free-chunk list";
    lru += chunks_[id].size;
  }
  if (lru != free_chunk_bytes_) return "free-chunk list does not hold every free chunk";
  return {};
}

}  // namespace vmm
