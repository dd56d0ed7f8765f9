// allocator: the C++ front end.
//
// Locks, in the order they may be taken (never the reverse):
//   1. registry_mu   (global) thread-cache registration, thread exit, allocator destruction
//   2. impl::mu      (per allocator) heap and arena; the arena's mapping work happens only here,
//                    inside heap growth or release (the slow path)
//   3. backend's own registry mutex (host backend), taken inside backend calls
// The hot path (a small size whose thread-cache bin is non-empty, or a free into a bin with room)
// takes none of them: it pops or pushes a per-thread stack and flips the slot's state byte.
#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "vmmalloc/cuda_backend.hpp"
#include "vmmalloc/vmmalloc.hpp"
#include "vmmalloc/ipc.hpp"
#include "heap/heap.hpp"

namespace vmm {

namespace {
// Counters written only by the owning thread, read by stats() from any thread: relaxed
// load + store, no locked instruction on the hot path.
struct owner_counter {
  std::atomic<std::uint64_t> v{0};
  void add(std::uint64_t d) { v.store(v.load(std::memory_order_relaxed) + d, std::memory_order_relaxed); }
  std::uint64_t get() const { return v.load(std::memory_order_relaxed); }
};

std::mutex registry_mu;
std::atomic<std::uint64_t> next_allocator_id{1};
}  // namespace

struct tcache;

// Internal code names the allocator's private state through this friend.
struct allocator_access {
  using impl = allocator::impl;
};
using allocator_impl = allocator_access::impl;

// Trace recording (options.trace_path): the shared trace format, one line per event, through a
// 1 MiB buffer. One mutex per event keeps the lines in the order the calls happened, which the
// replay needs (a free after its allocation). Stream handles become small ids in order of first use.
struct trace_writer {
  std::mutex mu;       // the buffer and the stream ids
  std::mutex file_mu;  // the file: taken after mu, held while a full buffer is written
  std::FILE* f = nullptr;
  std::string buf;
  std::unordered_map<stream_t, unsigned> ids;
  std::uint64_t events = 0;
  static constexpr std::size_t kFlushAt = std::size_t{1} << 20;

  status open(const std::string& path) {
    f = std::fopen(path.c_str(), "w");
    if (!f) return {errc::invalid_value, errno, "cannot open options.trace_path for writing", "fopen"};
    buf.reserve(kFlushAt + 128);
    return {};
  }
  void event(char kind, std::uintptr_t p, std::size_t n, stream_t s) {
    // Formatted outside the lock: the critical section is a map lookup and a short append, so
    // threads recording at once wait less (bench/RESULTS.md has the cost either way).
    char line[80];  // 1 + 16 hex + 20 + 10 digits + separators; to_chars stops short of the end
    char* e = line;
    *e++ = kind;
    *e++ = ' ';
    e = std::to_chars(e, line + sizeof line - 8, p, 16).ptr;
    *e++ = ' ';
    e = std::to_chars(e, line + sizeof line - 8, n).ptr;
    *e++ = ' ';
    std::unique_lock g(mu);
    unsigned id = 0;  // the default stream is 0, as in the traces; others 1, 2, ... by first use
    if (s) id = ids.try_emplace(s, static_cast<unsigned>(ids.size()) + 1).first->second;
    e = std::to_chars(e, line + sizeof line - 8, id).ptr;
    *e++ = '\n';
    buf.append(line, e);
    ++events;
    if (buf.size() >= kFlushAt) {
      // Hand the full buffer to the file outside the event lock; file_mu, taken before mu is
      // released, keeps the buffers in order.
      std::string out;
      out.swap(buf);
      buf.reserve(kFlushAt + 128);
      std::lock_guard fg(file_mu);
      g.unlock();
      write(out);
    }
  }
  void write(const std::string& out) {
    if (f && !out.empty()) std::fwrite(out.data(), 1, out.size(), f), std::fflush(f);
  }
  void flush_locked() {
    std::lock_guard fg(file_mu);
    write(buf);
    buf.clear();
  }
  void flush() {
    std::lock_guard g(mu);
    flush_locked();
  }
  ~trace_writer() {
    flush_locked();
    if (f) std::fclose(f);
  }
};

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

  tcache& my_cache();
  void flush_cache(tcache& c, bool all);  // caller holds mu
};

// One per (thread, allocator). Bins hold slot addresses of one stream each.
struct tcache {
  struct entry {
    std::uintptr_t p;
    heap::slot_ref r;
  };
  struct bin {
    stream_t stream = nullptr;
    std::uint32_t n = 0;
    std::vector<entry> e;
  };
  allocator_impl* owner;  // null once the allocator is gone (under registry_mu)
  std::uint64_t tag = 0;   // unique per cache: the heap gives each cache its own slabs
  std::vector<bin> bins;
  owner_counter req_delta, cached_bytes, cached_count, fast_allocs, fast_frees, refilled, flushed;
};

namespace {
// Thread exit: give each cache's slots back to its allocator, if that allocator still exists.
struct tl_caches {
  std::uint64_t last_id = 0;
  tcache* last = nullptr;
  std::vector<std::pair<std::uint64_t, std::shared_ptr<tcache>>> all;
  ~tl_caches() {
    std::lock_guard g(registry_mu);
    for (auto& [id, c] : all) {
      allocator_impl* o = c->owner;
      if (!o) continue;
      {
        std::lock_guard h(o->mu);
        o->flush_cache(*c, true);
        o->hp->set_cache_tag(c->tag, false);  // its slabs are free for others to take
      }
      o->retired_req += c->req_delta.get();
      o->retired_allocs += c->fast_allocs.get();
      o->retired_frees += c->fast_frees.get();
      o->retired_refilled += c->refilled.get();
      o->retired_flushed += c->flushed.get();
      std::erase(o->caches, c);
    }
  }
};
thread_local tl_caches tl;
}  // namespace

tcache& allocator::impl::my_cache() {
  if (tl.last_id == id) return *tl.last;
  for (auto& [cid, c] : tl.all)
    if (cid == id) {
      tl.last_id = id;
      tl.last = c.get();
      return *c;
    }
  static std::atomic<std::uint64_t> next_tag{1};
  auto c = std::make_shared<tcache>();
  c->owner = this;
  c->tag = next_tag.fetch_add(1);
  {
    std::lock_guard g(mu);
    hp->set_cache_tag(c->tag, true);
  }
  c->bins.resize(classes);
  for (auto& b : c->bins) b.e.resize(tc_cap);
  {
    std::lock_guard g(registry_mu);
    caches.push_back(c);
  }
  tl.all.emplace_back(id, c);
  tl.last_id = id;
  tl.last = c.get();
  return *c;
}

void allocator::impl::flush_cache(tcache& c, bool all) {
  std::vector<std::uintptr_t> ps;
  for (auto& b : c.bins) {
    std::uint32_t keep = all ? 0 : b.n / 2;
    std::uint64_t bytes = 0;
    for (std::uint32_t k = keep; k < b.n; ++k) {
      ps.push_back(b.e[k].p);
      bytes += b.e[k].r.size;
    }
    c.cached_bytes.add(-bytes);
    c.cached_count.add(-std::uint64_t(b.n - keep));
    c.flushed.add(b.n - keep);
    b.n = keep;
  }
  hp->flush(ps.data(), ps.size());
}

allocator::allocator(std::unique_ptr<backend_iface> b, const options& o) : p_(std::make_unique<impl>()) {
  p_->ar = std::make_unique<arena>(std::move(b), o);
  status s = p_->ar->open();
  if (!s.ok()) throw_status(s, "vmm::allocator");
  p_->hp = std::make_unique<heap>(*p_->ar);
  if (!o.trace_path.empty()) {
    p_->trace = std::make_unique<trace_writer>();
    if (status t = p_->trace->open(o.trace_path); !t.ok())
      throw_status(t, "vmm::allocator: trace file '" + o.trace_path + "': " + std::strerror(t.code));
  }
  p_->tc_enabled = o.thread_cache && o.thread_cache_slots >= 2;
  p_->tc_cap = std::max<std::size_t>(o.thread_cache_slots, 2);
  for (std::size_t n = 1; p_->hp->small_class(n) >= 0; n += 256)
    p_->classes = static_cast<std::size_t>(p_->hp->small_class(n)) + 1;
}

static std::unique_ptr<backend_iface> make_cuda(int device) {
  auto m = std::make_unique<backend_model<cuda_backend>>(device);
  if (!m->get().available()) throw error(m->get().load_status(), m->get().load_message());
  return m;
}

allocator::allocator(const options& o) : allocator(make_cuda(o.device), o) {}

allocator::~allocator() {
  if (!p_) return;
  {
    // Detach every thread's cache: their slots die with the arena below.
    std::lock_guard g(registry_mu);
    for (auto& c : p_->caches) c->owner = nullptr;
    p_->caches.clear();
  }
  if (tl.last_id == p_->id) tl.last_id = 0, tl.last = nullptr;
  std::erase_if(tl.all, [&](auto& e) { return e.first == p_->id; });
  p_->hp.reset();  // metadata first, then the arena unmaps and releases everything
  p_->ar.reset();
}
allocator::allocator(allocator&&) noexcept = default;
allocator& allocator::operator=(allocator&& o) noexcept {
  if (this != &o) {
    allocator dead(std::move(*this));  // runs the full teardown of what this held
    p_ = std::move(o.p_);
  }
  return *this;
}

allocator allocator::host(const options& o, const host_backend_options& h) {
  return allocator(make_backend<host_backend>(h), o);
}

void* allocator::try_allocate(std::size_t bytes, std::size_t alignment, stream_t s) noexcept {
  impl& m = *p_;
  if (alignment == 0) alignment = m.ar->opts().alignment;
  if (m.tc_enabled && alignment <= 256 && (alignment & (alignment - 1)) == 0) {
    int cls = m.hp->small_class(bytes);
    if (cls >= 0) {
      tcache& c = m.my_cache();
      auto& b = c.bins[cls];
      if (b.n == 0) {  // refill half a bin under the lock
        std::vector<std::uintptr_t> ps(m.tc_cap / 2);
        std::size_t got;
        {
          std::lock_guard g(m.mu);
          got = m.hp->refill(cls, s, ps.data(), ps.size(), c.tag);
        }
        std::uint64_t bytes_in = 0;
        for (std::size_t k = 0; k < got; ++k) {
          b.e[k].p = ps[k];
          m.hp->small_slot(ps[k], b.e[k].r);
          bytes_in += b.e[k].r.size;
        }
        b.n = static_cast<std::uint32_t>(got);
        b.stream = s;
        c.cached_bytes.add(bytes_in);
        c.cached_count.add(got);
        c.refilled.add(got);
      }
      if (b.n && b.stream == s) {  // the fast path: pop, mark the slot the user's
        auto& e = b.e[--b.n];
        e.r.state->store(1, std::memory_order_relaxed);
        *e.r.req = static_cast<std::uint32_t>(bytes);
        c.req_delta.add(bytes);
        c.cached_bytes.add(-std::uint64_t{e.r.size});
        c.cached_count.add(-std::uint64_t{1});
        c.fast_allocs.add(1);
        if (m.trace) [[unlikely]] m.trace->event('a', e.p, bytes, s);
        return reinterpret_cast<void*>(e.p);
      }
    }
  }
  result<std::uintptr_t> r;
  {
    std::lock_guard g(m.mu);
    r = m.hp->allocate(bytes, alignment, s);
  }
  if (!r.ok()) {
    set_last_error(r.st, "allocate");
    return nullptr;
  }
  if (m.trace) [[unlikely]] m.trace->event('a', r.value, bytes, s);
  return reinterpret_cast<void*>(r.value);
}

void* allocator::allocate(std::size_t bytes, std::size_t alignment, stream_t s) {
  void* p = try_allocate(bytes, alignment, s);
  if (!p) throw_status(last_error().st, "vmm::allocator::allocate(" + std::to_string(bytes) + ")");
  return p;
}

status allocator::try_deallocate(void* p, stream_t s) noexcept {
  if (!p) return {};
  impl& m = *p_;
  auto u = reinterpret_cast<std::uintptr_t>(p);
  heap::slot_ref r;
  if (m.tc_enabled && m.hp->small_slot(u, r) && r.stream == s &&
      r.state->load(std::memory_order_relaxed) == 1) {
    tcache& c = m.my_cache();
    auto& b = c.bins[r.cls];
    std::uint8_t expect = 1;  // claim the slot atomically: two racing frees cannot both win
    if ((b.n == 0 || b.stream == s) &&
        r.state->compare_exchange_strong(expect, 2, std::memory_order_acq_rel)) {  // the fast path
      if (b.n == m.tc_cap) {
        std::lock_guard g(m.mu);
        m.flush_cache(c, false);
      }
      c.req_delta.add(-std::uint64_t{*r.req});
      if (m.trace) [[unlikely]] m.trace->event('f', u, *r.req, s);
      *r.req = 0;
      b.e[b.n++] = {u, r};
      b.stream = s;
      c.cached_bytes.add(r.size);
      c.cached_count.add(1);
      c.fast_frees.add(1);
      return {};
    }
  }
  status st;
  {
    std::lock_guard g(m.mu);
    const std::size_t req = m.trace ? m.hp->requested_size(u) : 0;
    st = m.hp->deallocate(u, s);
    // Under mu: another thread cannot reuse the address and trace its allocation first.
    if (m.trace && st.ok()) [[unlikely]] m.trace->event('f', u, req, s);
  }
  if (!st.ok()) set_last_error(st, "deallocate");
  return st;
}

void allocator::deallocate(void* p, stream_t s) {
  status st = try_deallocate(p, s);
  if (!st.ok()) throw_status(st, "vmm::allocator::deallocate");
}

void allocator::grant(int device, access_mode mode) {
  status st;
  {
    std::lock_guard g(p_->mu);
    st = p_->ar->set_peer_access(device, mode);
  }
  if (!st.ok()) throw_status(st, "vmm::allocator::grant(device " + std::to_string(device) + ")");
}

void allocator::revoke(int device) {
  status st;
  {
    std::lock_guard g(p_->mu);
    st = p_->ar->set_peer_access(device, access_mode::none);
  }
  if (!st.ok()) throw_status(st, "vmm::allocator::revoke(device " + std::to_string(device) + ")");
}

std::vector<access_desc> allocator::access() const {
  std::lock_guard g(p_->mu);
  auto a = p_->ar->access();
  return {a.begin(), a.end()};
}

status allocator::try_export_ipc(void* p, ipc::export_handle& out) noexcept {
  impl& m = *p_;
  status st;
  try {
    std::lock_guard g(m.mu);
    std::vector<std::uint32_t> ids;
    std::size_t bytes = 0;
    st = m.hp->export_chunks(reinterpret_cast<std::uintptr_t>(p), ids, bytes);
    if (st.ok()) {
      ipc::export_handle h;  // closes the fds already exported if a later chunk fails
      h.kind = m.ar->props().ipc;
      h.device = m.ar->opts().device;
      h.size = bytes;
      h.offset = 0;  // whole-chunk allocations start at their first chunk
      for (auto id : ids) {
        auto r = m.ar->export_chunk(id);
        if (!r.ok()) {
          st = r.st;
          break;
        }
        h.chunks.push_back({m.ar->get(id).size, r.value});
        h.kind = r.value.kind;
      }
      if (st.ok()) {
        ++m.exported;
        out = std::move(h);
      }
    }
  } catch (const std::bad_alloc&) {
    st = {errc::out_of_memory, ENOMEM, "host memory for the export handle", "export_ipc"};
  }
  if (!st.ok()) set_last_error(st, "export_ipc");
  return st;
}

ipc::export_handle allocator::export_ipc(void* p) {
  ipc::export_handle h;
  status st = try_export_ipc(p, h);
  if (!st.ok()) throw_status(st, "vmm::allocator::export_ipc");
  return h;
}

std::vector<class_occupancy> allocator::class_stats() const {
  std::lock_guard g(p_->mu);
  return p_->hp->occupancy();
}

void allocator::flush_trace() {
  if (p_->trace) p_->trace->flush();
}

void allocator::record_stream(void* p, stream_t s) {
  status st;
  {
    std::lock_guard g(p_->mu);
    st = p_->hp->record_stream(reinterpret_cast<std::uintptr_t>(p), s);
  }
  if (!st.ok()) throw_status(st, "vmm::allocator::record_stream");
}

std::size_t allocator::usable_size(const void* p) const {
  std::lock_guard g(p_->mu);
  return p_->hp->usable_size(reinterpret_cast<std::uintptr_t>(p));
}

void allocator::trim(std::size_t keep) {
  status st;
  tcache* mine = p_->tc_enabled ? &p_->my_cache() : nullptr;  // may lock mu itself: first
  {
    std::lock_guard g(p_->mu);
    // This thread's cache goes back first (other threads' caches are theirs: at most
    // thread_cache_slots per class each, returned when those threads end).
    if (mine) p_->flush_cache(*mine, true);
    st = p_->hp->trim(keep);
  }
  if (!st.ok()) throw_status(st, "vmm::allocator::trim");
}

allocator_stats allocator::stats() const {
  std::lock_guard r(registry_mu);
  std::lock_guard g(p_->mu);
  heap_stats h = p_->hp->stats();
  arena_stats a = p_->ar->stats();
  // Slots in thread caches are allocated as far as the heap knows; the user sees them as free.
  std::uint64_t req = p_->retired_req, cached_b = 0, cached_n = 0, fa = p_->retired_allocs,
                ff = p_->retired_frees, rf = p_->retired_refilled, fl = p_->retired_flushed;
  for (auto& c : p_->caches) {
    req += c->req_delta.get();
    cached_b += c->cached_bytes.get();
    cached_n += c->cached_count.get();
    fa += c->fast_allocs.get();
    ff += c->fast_frees.get();
    rf += c->refilled.get();
    fl += c->flushed.get();
  }
  allocator_stats s;
  // While other threads run, their caches' counters are read at slightly different moments: a
  // block allocated through one cache and freed through another can make the sum dip below zero
  // for an instant. Clamp to what is possible (0 <= requested <= allocated).
  std::uint64_t total = h.requested + req;
  s.requested = static_cast<std::int64_t>(total) < 0 ? 0 : total;
  s.allocated = h.allocated - cached_b;
  s.live = h.live - cached_n;
  s.requested = std::min<std::size_t>(s.requested, s.allocated);
  s.allocs = h.allocs - rf + fa;
  s.frees = h.frees - fl + ff;
  // Peaks are exact without thread caches; with them they are sampled at refills and flushes.
  s.peak_allocated = std::max(h.peak_allocated, s.allocated);
  s.peak_requested = std::min(std::max(h.peak_requested, s.requested), s.peak_allocated);
  s.mapped = a.mapped;
  s.physical = a.physical;
  s.reserved = a.reserved;
  s.peak_mapped = a.peak_mapped;
  s.peak_physical = a.peak_physical;
  s.chunks = a.chunks;
  s.idle = a.idle;
  s.free_chunk_bytes = a.free_chunk_bytes;
  s.slab_bytes = h.slab_bytes;
  s.deferred = h.deferred;
  s.grows = h.grows;
  s.chunk_releases = h.chunk_releases;
  s.trims = h.trims;
  s.stitched = a.stitched;
  s.compression_fallbacks = a.compression_fallbacks;
  s.ipc_fallbacks = a.ipc_fallbacks;
  s.compressed = a.compressed;
  s.access_changes = a.access_changes;
  s.exported = p_->exported;
  s.exported_released = h.exported_released;
  if (p_->trace) {
    std::lock_guard t(p_->trace->mu);
    s.traced_events = p_->trace->events;
  }
  s.fragmentation = s.mapped ? 1.0 - static_cast<double>(s.requested) / static_cast<double>(s.mapped) : 0.0;
  s.calls = a.calls;
  return s;
}

void allocator::reset_peaks() {
  std::lock_guard g(p_->mu);
  p_->hp->reset_peaks();
  p_->ar->reset_peaks();
}

std::string allocator::check() const {
  // Structure, slab states, allocated/live bytes and chunk accounting are all changed under mu
  // only, so they are checked exactly even while other threads run. Other threads' caches are
  // theirs (bins are never read across threads); the bytes *requested* through them change
  // without the lock, so that one sum is checked only when no other thread holds a cache.
  std::lock_guard r(registry_mu);
  std::lock_guard g(p_->mu);
  std::uint64_t req = p_->retired_req;
  bool others = false;
  for (auto& c : p_->caches) {
    req += c->req_delta.get();
    if (tl.last_id == p_->id && c.get() == tl.last) {
      std::uint64_t n = 0;
      for (auto& b : c->bins) {
        for (std::uint32_t k = 0; k < b.n; ++k)
          if (b.e[k].r.state->load(std::memory_order_relaxed) != 2) return "a thread-cached slot is not in state 2";
        n += b.n;
      }
      if (n != c->cached_count.get()) return "thread cache count is off";
    } else {
      others = true;
    }
  }
  return p_->hp->check(req, !others);
}

std::size_t allocator::granularity() const { return p_->ar->granularity(); }
const options& allocator::opts() const { return p_->ar->opts(); }
const char* allocator::backend_name() const { return p_->ar->drv().name(); }

bool allocator::host_accessible() const {
  const options& o = opts();
  if (o.location == location_kind::host_numa) return true;
  if (!(p_->ar->drv().capabilities() & cap_host_access)) return false;
  if (o.device == 0) return true;
  return std::any_of(o.peers.begin(), o.peers.end(), [](const access_desc& p) {
    return p.device == 0 && p.mode == access_mode::read_write;
  });
}

}  // namespace vmm
