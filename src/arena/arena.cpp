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

arena::arena(std::unique_ptr<backend_iface> b, const options& o, const tuning& t)
    : b_(std::move(b)), drv_(b_.get()), opt_(o), tune_(t), limit_(o.memory_limit) {}

status arena::open() {
  if (!b_) return fail(errc::invalid_value, "arena", "no backend");
  policies_ = policy::make_policies(opt_);
  for (auto& p : policies_) {
    if (status s = p->open(drv_, opt_, pol_); !s.ok()) return s;
    whole_chunks_ = whole_chunks_ || (p->whole_chunks(opt_) && tune_.ipc_whole_chunks);
  }
  // Granularity: the largest among the devices involved (owner and peers).
  auto g = vm::granularity_for(drv_, pol_.props, pol_.access);
  if (!g.ok()) return g.st;
  gran_ = g.value;
  gran_shift_ = static_cast<unsigned>(__builtin_ctzll(gran_));

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
  // Work planned and not run yet goes first: it holds handles and ranges of its own.
  if (has_work()) {
    job j = take_work();
    run(j);
    (void)commit(j);
  }
  bool mapped = false;  // something the driver would not unmap: the reservation stays
  for (auto& c : chunks_) {
    if (!c.size) continue;
    mapped |= !vm::driver::twice([&] { return drv_.unmap(c.va, c.size); }).ok();
    (void)vm::driver::twice([&] { return drv_.release(c.handle); });
  }
  for (const auto& r : retiring_) {  // a doomed one's handle is in strays_: released below
    if (r.fence) {
      (void)drv_.wait_fence(r.fence);  // the stream's work on it first
      drv_.drop_fence(r.fence);
    }
    mapped |= !vm::driver::twice([&] { return drv_.unmap(r.va, r.size); }).ok();
  }
  for (auto& e : idle_) (void)vm::driver::twice([&] { return drv_.release(e.second); });
  (void)strays_.retry(drv_);
  (void)res_.close(mapped || strays_.holds_mappings());
}

void arena::idle_put(mem_handle h, std::size_t size) {
  idle_.emplace(size, h);
  idle_bytes_ += size;
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

std::size_t arena::hole_from(std::uintptr_t at) const {
  auto it = holes_.upper_bound(at);
  if (it == holes_.begin()) return 0;
  --it;
  return at >= it->first && at < it->first + it->second ? it->first + it->second - at : 0;
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
  // A range being unmapped had its fence complete before its job took it.
  for (const auto& r : retiring_)
    if (r.h == h && r.names_live_handle() && !r.unmapping && r.fence && r.stream != s &&
        !drv_.fence_done(r.fence))
      return false;
  return true;
}

bool arena::in_flight(mem_handle h) {
  for (const auto& r : retiring_)
    if (r.h == h && r.names_live_handle() && r.fence && !drv_.fence_done(r.fence)) return true;
  return false;
}

bool arena::aliased(mem_handle h, bool fenced_only, bool after_work) const {
  for (const auto& r : retiring_) {
    if (r.h != h || !r.names_live_handle() || (!r.fence && fenced_only)) continue;
    if (after_work && r.unmapping &&
        std::any_of(work_.unmaps.begin(), work_.unmaps.end(), [&](const job::unmap& u) { return u.va == r.va; }))
      continue;
    return true;
  }
  return false;
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
  s.compression_fallbacks = pol_.compression_fallbacks;
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
    if (!ranges.emplace(va, n).second) return "a planned mapping overlaps a hole, stray or retired range";
    inflight += n;
  }
  if (inflight != inflight_bytes_) return "bytes of planned mappings are off";
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
    if (va != cur) return "holes, chunks, strays, retired ranges and planned mappings do not tile the reservation";
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
