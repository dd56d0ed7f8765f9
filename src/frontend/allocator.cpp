// SPDX-License-Identifier: Apache-2.0
// allocator: the C++ front end.
//
// Locks, in the order they may be taken (never the reverse):
//   1. cache_registry_mutex() (global) thread-cache registration, the counters of a thread's exit,
//                    stats(), allocator destruction
//   2. impl::mu      (per allocator) heap and arena. The driver work a call into the heap
//                    plans (a growth's create / map / set_access, the unmaps and releases of
//                    frees, cache flushes and trim) runs after it is dropped (settle), and so do
//                    the waits of trim and the out-of-memory reclaim for a stream (wait_streams);
//                    fence records and queries, grant / revoke and exports call the driver under it
//   3. vm::driver's claims (one call at a time per handle and VA range), taken inside each call
//   4. backend's own registry mutex (host backend), taken inside backend calls
// The hot path (a small size whose thread-cache bin is non-empty, or a free into a bin with room)
// takes none of them: it pops or pushes a per-thread stack and flips the slot's state byte.
#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <limits>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "frontend/allocator_impl.hpp"
#include "vmmalloc/cuda_backend.hpp"
#include "vmmalloc/ipc.hpp"

namespace vmm {

allocator::allocator(std::unique_ptr<backend_iface> b, const options& o) : allocator(std::move(b), o, tuning{}) {}

allocator::allocator(std::unique_ptr<backend_iface> b, const options& o, const tuning& t)
    : p_(std::make_unique<impl>()) {
  p_->ar = std::make_unique<arena>(std::move(b), o, t);
  status s = p_->ar->open();
  if (!s.ok()) throw_status(s, "vmm::allocator");
  p_->hp = std::make_unique<heap>(*p_->ar);
  p_->heaps[0] = p_->hp.get();
  if (!o.trace_path.empty()) {
    p_->trace = std::make_unique<trace_writer>();
    if (status t = p_->trace->open(o.trace_path); !t.ok())
      throw_status(t, "vmm::allocator: trace file '" + o.trace_path + "': " + std::strerror(t.code));
  }
  p_->tc_enabled = o.thread_cache && t.thread_cache_slots >= 2;
  // A cached large block keeps its memory mapped: not where freed memory is to go back at once
  // (a release threshold) or where every allocation owns exportable chunks.
  p_->large_cache = p_->tc_enabled && t.thread_cache_large && !p_->ar->whole_chunks() &&
                    o.release_threshold == std::numeric_limits<std::size_t>::max();
  p_->tc_cap = std::max<std::size_t>(t.thread_cache_slots, 2);
  p_->default_alignment = p_->ar->opts().alignment;
  p_->unit_class.push_back(0);
  for (std::size_t n = 256; p_->hp->small_class(n) >= 0; n += 256) {
    p_->unit_class.push_back(static_cast<std::uint8_t>(p_->hp->small_class(n)));
    p_->small_limit = n;
    p_->classes = p_->unit_class.back() + std::size_t{1};
  }
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
    // Detach every thread's cache: their slots die with the arena below. A thread's exit that
    // already took its cache's owner finishes first (it flushes without the registry's lock).
    std::unique_lock g(cache_registry_mutex());
    for (auto& c : p_->caches) c->owner = nullptr;
    p_->caches.clear();
    p_->exits_done.wait(g, [&] { return p_->exiting == 0; });
  }
  forget_thread_cache(p_->id);
  p_->pools.clear();  // metadata first, then the arena unmaps and releases everything
  p_->hp.reset();
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

vm::handle_pool& allocator_access::pool(allocator& a) { return *a.p_; }
std::uint64_t allocator_access::unserved_growths(allocator& a) {
  std::lock_guard g(a.p_->mu);
  return a.p_->unserved_growths;
}

allocator allocator_access::make(std::unique_ptr<backend_iface> b, const options& o, const tuning& t) {
  return allocator(std::move(b), o, t);
}

allocator allocator::host(const options& o, const host_backend_options& h) {
  return allocator(make_backend<host_backend>(h), o);
}

std::string allocator_impl::out_of_memory_detail() const {
  // Caller holds mu. What the user needs to act: what is live, what the allocator holds, the limit.
  const auto h = hp->stats();
  const auto a = ar->stats();
  auto mib = [](std::size_t n) { return std::to_string(n >> 20) + " MiB"; };
  std::string d = " (live " + mib(h.allocated) + " in " + std::to_string(h.live) + " blocks; held " +
                  mib(a.physical) + ": mapped " + mib(a.mapped) + ", idle " + mib(a.idle) + ", free chunks " +
                  mib(a.free_chunk_bytes);
  // Free blocks inside chunks that also hold live blocks: what the reclaim cannot give back.
  if (const auto f = hp->span_free(); f.bytes)
    d += ", free in used chunks " + mib(f.bytes) + " (" + mib(f.whole_pages) + " in whole pages)";
  d += "; limit ";
  const std::size_t limit = ar->memory_limit();
  d += limit == std::numeric_limits<std::size_t>::max() ? std::string("none (the device's memory)") : mib(limit);
  return d + ")";
}

status allocator::impl::settle(std::unique_lock<std::mutex>& lk, bool drop) {
  if (!ar->has_work()) return {};
  arena::job j = ar->take_work();
  if (drop) lk.unlock();
  ar->run(j);
  if (drop) lk.lock();
  const status st = ar->commit(j);
  if (j.maps()) {
    heap* h = j.heap < heaps.size() ? heaps[j.heap] : nullptr;
    if (st.ok() && h) {
      h->adopt(j);
    } else if (st.ok()) {
      // The graph pool that asked was dropped meanwhile: its new chunks go back.
      for (std::uintptr_t va = j.va; va < j.va + j.size;) {
        const std::uint32_t id = ar->chunk_at(va);
        va += ar->get(id).size;
        ar->give_back_chunk(id, true);
      }
    } else if (h) {
      h->growth_refused(j);
    }
  }
  return st;
}

void allocator::impl::wait_streams(std::unique_lock<std::mutex>& lk, std::vector<stream_t> streams) {
  struct wait {
    stream_t s;
    fence_t f;
    bool done;
  };
  std::sort(streams.begin(), streams.end(), std::less<>{});  // noted once a block or range
  streams.erase(std::unique(streams.begin(), streams.end()), streams.end());
  std::vector<wait> ws;
  auto& d = ar->drv();
  const std::uint64_t point = hp->order_point();  // the own heap's frees the fences come after
  for (stream_t s : streams) {
    if (d.capturing(s)) continue;  // no fence into a capture: the locked path reports it
    auto f = d.record_fence(s);
    if (f.ok()) ws.push_back({s, f.value, false});
  }
  lk.unlock();
  for (auto& w : ws) w.done = d.wait_fence(w.f).ok();
  lk.lock();
  for (auto& w : ws) {
    if (w.done) hp->note_waited(w.s, point);
    d.drop_fence(w.f);
  }
}

namespace {
// The thread cache's moves, shared by the fast paths and the general ones: a slot popped or
// pushed, the large block taken or kept.

// Hands out the top slot of a bin that holds one: the slot becomes the user's.
void* pop_slot(tcache& c, tcache::bin& b, std::size_t bytes) {
  const std::uint64_t n = b.n.get();
  auto& e = b.e[n - 1];
  c.last = &e;
  b.n.set(n - 1);
  // The requested bytes first, then the state that makes the slot the user's (release): a stale
  // free of this address on another thread may claim it at once (claim_slot) and must take back
  // these bytes, not the 0 the last free left.
  e.r.req->store(static_cast<std::uint32_t>(bytes), std::memory_order_relaxed);
  e.r.state->store(e.r.word(1), std::memory_order_release);
  c.req_delta.add(bytes);
  c.fast_allocs.add(1);
  return reinterpret_cast<void*>(e.p);
}

// The cached large block, handed to this thread's request of `bytes` on stream s if it fits (up
// to 1/64 larger: what a reuse leaves unused is held as long as the block lives; with 1/8 the dev
// trace's replays held 0.2-1.9 % more at the peak). Null when it does not.
void* take_large(tcache& c, std::size_t bytes, stream_t s, trace_writer* trace) {
  auto& L = c.large;
  const std::size_t need = (bytes + 255) & ~std::size_t{255};
  if (!(L.cached && L.r.stream == s && L.r.size >= need && L.r.size - need <= std::max<std::size_t>(256, need / 64) &&
        need >= bytes && heap::cache_reuse(L.r, bytes)))
    return nullptr;
  L.cached = false;
  L.req = bytes;
  c.req_delta.add(bytes);
  c.large_cached.add(-std::uint64_t{L.r.size});
  c.fast_allocs.add(1);
  if (trace) [[unlikely]] trace->event('a', L.p, bytes, s);
  return reinterpret_cast<void*>(L.p);
}

// The large block this thread handed out last, freed by it on its stream: the cache keeps it.
// False when u is not that block (or the heap took it back).
bool keep_large(tcache& c, std::uintptr_t u, stream_t s, trace_writer* trace) {
  auto& L = c.large;
  if (!(u == L.p && !L.cached && s == L.r.stream && heap::cache_claim(L.r))) return false;
  L.cached = true;
  c.req_delta.add(-std::uint64_t{L.req});
  // The free is traced before the block can be taken back and handed out again (a trace must
  // never show the address allocated twice).
  if (trace) [[unlikely]] trace->event('f', u, L.req, s);
  heap::cache_publish(L.r);
  c.large_cached.add(L.r.size);
  c.fast_frees.add(1);
  return true;
}

// Claims a slot the user frees for this thread's bin b (state 1 -> 2), if b holds no other
// stream's slots. Atomic: two racing frees cannot both win, and the tag in the word fails a claim
// on a slab that was set up again since the reference was read.
bool claim_slot(const tcache::bin& b, const heap::slot_ref& r, stream_t s) {
  std::uint16_t expect = r.word(1);
  return (b.n.get() == 0 || b.stream == s) &&
         r.state->compare_exchange_strong(expect, r.word(2), std::memory_order_acq_rel);
}

// Puts a slot this thread claimed (state 2) on top of its bin, which has room.
void push_slot(tcache& c, tcache::bin& b, std::uintptr_t u, const heap::slot_ref& r, std::uint32_t req,
               stream_t s) {
  c.req_delta.add(-std::uint64_t{req});
  r.req->store(0, std::memory_order_relaxed);
  const std::uint64_t n = b.n.get();
  // Freed right after it was popped, the slot lands in the entry that still holds it.
  if (&b.e[n].r != &r) b.e[n] = {u, r};
  b.n.set(n + 1);
  b.stream = s;
  c.fast_frees.add(1);
}

// Under lk: attempt(mode) is one try of a heap's allocate (heap::outcome). The driver work it
// planned runs without lk (settle: one thread's create, map or set_access, tens of microseconds
// to milliseconds, holds up no other thread's allocation from mapped memory), then the request is
// asked again. A request that finds no fit first takes the thread caches' large blocks back
// (grow_mode::never, then normal); a growth the driver refused for lack of memory is asked once
// more as a last resort (everything free goes back first, then exactly the request); a request
// that found no memory but some a stream is still using waits for those streams without lk, then
// tries again (kWaitRounds). A growth is adopted and the request asked again under lk, so no
// other thread takes the new memory first; after tuning::unlocked_growths growths (a request the
// new memory did not serve) the jobs run under lk anyway.
constexpr int kWaitRounds = 2;
template <class F>
result<std::uintptr_t> allocate_growing(allocator_impl& m, std::unique_lock<std::mutex>& lk, F&& attempt) {
  grow_mode mode = m.large_cache ? grow_mode::never : grow_mode::normal;
  const int unlocked = m.ar->tune().unlocked_growths;
  int grown = 0, waited = 0;
  bool adopted_locked = false;  // the last round's growth was mapped and adopted under lk
  for (;;) {
    m.hp->defer_waits(waited < kWaitRounds);
    const heap::outcome o = attempt(mode);
    m.hp->defer_waits(false);
    std::vector<stream_t> waits = m.hp->take_waits();
    const status ran = m.settle(lk, grown < unlocked);
    if (o.addr) return {o.addr, {}};  // a refill may have planned a new slab after its slots
    if (adopted_locked) ++m.unserved_growths;
    adopted_locked = false;
    if (o.grows) {
      // Each growth maps memory for this request and it is asked again at once: many rounds are
      // a heap that plans what it cannot use. Said, rather than growing without end.
      if (++grown > 16) return {0, {errc::other, 0, "growth did not serve the request", "allocate"}};
      if (ran.ok()) {  // mapped and adopted under lk: asked again before anyone else can take it
        adopted_locked = grown > unlocked;  // the driver calls ran under lk too
        if (mode == grow_mode::last_resort) mode = grow_mode::normal;  // its reclaim is done
        continue;
      }
      if (ran.kind != errc::out_of_memory) return {0, ran};
      if (mode == grow_mode::last_resort) {
        if (waits.empty() || waited >= kWaitRounds) return {0, ran};
        ++waited;
        m.wait_streams(lk, std::move(waits));
      }
      mode = grow_mode::last_resort;
      continue;
    }
    if (!o.st.ok()) {
      if (o.st.kind != errc::out_of_memory || waits.empty() || waited >= kWaitRounds) return {0, o.st};
      ++waited;
      m.wait_streams(lk, std::move(waits));
      continue;
    }
    (void)m.take_back_large();  // no fit without growing (never): the caches' blocks, then grow
    mode = grow_mode::normal;
  }
}

// Runs f (a free, a cache flush: anything that may give chunks back) under lk, then the driver
// work it planned (settle). A refusal there leaves the range retired or the handle parked (and
// the error for trim to report): f itself succeeded.
template <class F>
void and_settle(allocator_impl& m, std::unique_lock<std::mutex>& lk, F&& f) {
  f();
  (void)m.settle(lk, true);
}
// The general paths: everything but the thread cache's pop and push (refills, flushes, large
// blocks, the locked heap). Out of line, so the fast paths save and restore few registers.

// A size above the small classes through the thread cache: the block this thread freed last, if
// it fits (no lock), else the heap (the cached block goes back first, under the same lock).
[[gnu::noinline]] void* allocate_large_cached(allocator_impl& m, std::size_t bytes, std::size_t alignment,
                                              stream_t s) noexcept {
  tcache& c = m.my_cache();
  auto& L = c.large;
  if (void* p = take_large(c, bytes, s, m.trace.get())) return p;
  result<std::uintptr_t> r;
  std::string why;
  {
    std::unique_lock g(m.mu);
    // The cached block goes back first: the heap may need its memory for this request. Not for a
    // request the heap refuses before looking (past the reservation): bad input changes nothing.
    if (bytes <= m.ar->reservation_size() && c.large.cached) and_settle(m, g, [&] { m.return_large(c); });
    heap::block_ref ref;
    auto attempt = [&](grow_mode mode) {
      if (m.captures.empty())  // a pool begun meanwhile: its heap decides, not the cache
        return m.hp->allocate_cacheable(bytes, alignment, s, mode, ref);
      return m.heap_for(s).allocate(bytes, alignment, s, mode);
    };
    r = allocate_growing(m, g, attempt);
    if (!r.ok() && r.st.kind == errc::out_of_memory && bytes <= m.ar->reservation_size()) {
      and_settle(m, g, [&] { m.flush_cache(c, true); });
      r = allocate_growing(m, g, attempt);
      if (!r.ok()) why = m.out_of_memory_detail();
    }
    if (r.ok() && ref.blk) {
      L.p = r.value;
      L.r = ref;
      L.req = bytes;
      L.cached = false;
      c.req_delta.add(bytes);  // the heap left the requested bytes to this cache
    }
  }
  if (!r.ok()) {
    set_last_error(r.st, ("allocate(" + std::to_string(bytes) + ")").c_str(), why);
    return nullptr;
  }
  if (m.trace) [[unlikely]] m.trace->event('a', r.value, bytes, s);
  return reinterpret_cast<void*>(r.value);
}

// alignment: resolved by try_allocate (never 0).
[[gnu::noinline]] void* allocate_general(allocator_impl& m, std::size_t bytes, std::size_t alignment,
                                         stream_t s) noexcept {
  if (m.cache_serves(alignment)) {
    int cls = m.small_class(bytes);
    if (cls >= 0) {
      tcache& c = m.my_cache();
      auto& b = c.bins[cls];
      if (b.n.get() == 0) {  // refill half a bin under the lock
        std::vector<std::uintptr_t> ps(m.tc_cap / 2);
        std::size_t got = 0;
        {
          // A new slab's growth runs outside the lock too (see allocate_growing); slots already
          // handed out end the rounds. If it fails, the locked path below tries again and reports
          // what is wrong.
          std::unique_lock g(m.mu);
          (void)allocate_growing(m, g, [&](grow_mode mode) {
            heap::outcome o = m.hp->refill(cls, s, ps.data(), ps.size(), c.tag, mode, got);
            if (got) o.addr = ps[0];  // slots handed out: done, whatever else the refill planned
            return o;
          });
        }
        for (std::size_t k = 0; k < got; ++k) {
          b.e[k].p = ps[k];
          m.hp->small_slot(ps[k], b.e[k].r);
        }
        b.n.set(got);
        b.stream = s;
        c.refilled.add(got);
      }
      if (b.n.get() && b.stream == s) {
        void* p = pop_slot(c, b, bytes);
        if (m.trace) [[unlikely]] m.trace->event('a', reinterpret_cast<std::uintptr_t>(p), bytes, s);
        return p;
      }
    } else if (m.large_cache && bytes != 0) {
      return allocate_large_cached(m, bytes, alignment, s);
    }
  }
  result<std::uintptr_t> r;
  std::string why;
  {
    std::unique_lock g(m.mu);
    auto attempt = [&](grow_mode mode) {
      return m.heap_for(s).allocate(bytes, alignment, s, mode);  // reclaims and retries once inside
    };
    r = allocate_growing(m, g, attempt);
    if (!r.ok() && r.st.kind == errc::out_of_memory) {
      // This thread's cached slots may pin slabs the heap could give back: return them (what
      // that gives back is unmapped and released outside the lock), try again.
      if (m.tc_enabled && tl_cache_owner == m.id && tl_cache->holds_any() &&
          bytes <= m.ar->reservation_size()) {
        and_settle(m, g, [&] { m.flush_cache(*tl_cache, true); });
        r = allocate_growing(m, g, attempt);
      }
      if (!r.ok()) why = m.out_of_memory_detail();
    }
  }
  if (!r.ok()) {
    set_last_error(r.st, ("allocate(" + std::to_string(bytes) + ")").c_str(), why);
    return nullptr;
  }
  if (m.trace) [[unlikely]] m.trace->event('a', r.value, bytes, s);
  return reinterpret_cast<void*>(r.value);
}

[[gnu::noinline]] status deallocate_general(allocator_impl& m, void* p, stream_t s) noexcept {
  if (!p) return {};
  auto u = reinterpret_cast<std::uintptr_t>(p);
  if (m.large_cache && tl_cache_owner == m.id && keep_large(*tl_cache, u, s, m.trace.get())) return {};
  // The slot this thread handed out last (the common allocate-then-free pattern) is found without
  // the page-map lookup: its bin entry still holds the reference, valid while the slab's set-up
  // count is unchanged. Any other address, or a slab set up again since, looks the slot up.
  heap::slot_ref looked;
  const heap::slot_ref* rp = nullptr;
  const tcache::entry* last = m.tc_enabled && tl_cache_owner == m.id ? tl_cache->last : nullptr;
  if (last && last->p == u && last->r.current()) rp = &last->r;
  else if (m.tc_enabled && m.hp->small_slot(u, looked)) rp = &looked;
  if (rp && rp->stream == s && rp->state->load(std::memory_order_relaxed) == rp->word(1)) {
    const heap::slot_ref& r = *rp;
    tcache& c = m.my_cache();
    auto& b = c.bins[r.cls];
    if (claim_slot(b, r, s)) {
      if (b.n.get() == m.tc_cap) {  // half the bin back (chunks it frees go back after the lock)
        std::unique_lock g(m.mu);
        and_settle(m, g, [&] { m.flush_cache(c, false); });
      }
      const std::uint32_t req = r.req->load(std::memory_order_relaxed);
      if (m.trace) [[unlikely]] m.trace->event('f', u, req, s);
      push_slot(c, b, u, r, req, s);
      return {};
    }
  }
  status st;
  {
    std::unique_lock g(m.mu);
    heap& h = m.owner_of(u);
    const std::size_t req = m.trace ? h.requested_size(u) : 0;
    // Chunks the free gives back (release_threshold, idle decay) are unmapped and released after
    // the lock is dropped, as a growth's driver calls are (see allocate_growing).
    and_settle(m, g, [&] {
      st = h.deallocate(u, s);
      if (st.ok() && &h != m.hp.get()) m.after_free(h);
      // Under mu: another thread cannot reuse the address and trace its allocation first.
      if (m.trace && st.ok()) [[unlikely]] m.trace->event('f', u, req, s);
    });
  }
  if (!st.ok()) set_last_error(st, "deallocate");
  return st;
}

}  // namespace

// The fast path: a pop from this thread's cache of this allocator, in the bin's stream, or its
// cached large block, with no trace. Anything else (no cache yet, an empty bin, another stream, a
// block that does not fit) takes allocate_general, which checks it all again.
void* allocator::try_allocate(std::size_t bytes, std::size_t alignment, stream_t s) noexcept {
  impl& m = *p_;
  if (alignment == 0) alignment = m.default_alignment;
  if (!m.trace && tl_cache_owner == m.id && m.cache_serves(alignment)) {
    if (const int cls = m.small_class(bytes); cls >= 0) {
      tcache& c = *tl_cache;
      auto& b = c.bins[cls];
      if (b.n.get() && b.stream == s) return pop_slot(c, b, bytes);
    } else if (m.large_cache && bytes != 0) {
      return allocate_large_cached(m, bytes, alignment, s);  // its cached block first
    }
  }
  return allocate_general(m, bytes, alignment, s);
}

void* allocator::allocate(std::size_t bytes, std::size_t alignment, stream_t s) {
  void* p = try_allocate(bytes, alignment, s);
  if (!p) throw_last_error("vmm::allocator");
  return p;
}

// The fast path: the slot this thread popped last, freed on its stream into a bin with room, with
// no trace. Anything else takes deallocate_general, which checks it all again (this thread's large
// block first; a lost claim there finds the slot no longer the user's and reports it).
status allocator::try_deallocate(void* p, stream_t s) noexcept {
  impl& m = *p_;
  const auto u = reinterpret_cast<std::uintptr_t>(p);
  if (u && m.tc_enabled && !m.trace && tl_cache_owner == m.id) {
    tcache& c = *tl_cache;
    const tcache::entry* last = c.last;
    if (last && last->p == u && last->r.stream == s && last->r.current()) {
      const heap::slot_ref& r = last->r;
      auto& b = c.bins[r.cls];
      const std::uint64_t n = b.n.get();
      if (n < m.tc_cap && &b.e[n] == last && claim_slot(b, r, s)) {
        push_slot(c, b, u, r, r.req->load(std::memory_order_relaxed), s);
        return {};
      }
    }
  }
  return deallocate_general(m, p, s);
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
    std::size_t bytes = 0, offset = 0;
    const auto u = reinterpret_cast<std::uintptr_t>(p);
    st = m.owner_of(u).export_chunks(u, ids, bytes, offset);
    if (st.ok()) {
      ipc::export_handle h;  // closes the fds already exported if a later chunk fails
      h.kind = m.ar->props().ipc;
      h.device = m.ar->opts().device;
      h.size = bytes;
      h.offset = offset;
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

void allocator::flush_trace() {
  if (p_->trace) p_->trace->flush();
}

void allocator::record_stream(void* p, stream_t s) {
  status st;
  {
    std::lock_guard g(p_->mu);
    const auto u = reinterpret_cast<std::uintptr_t>(p);
    st = p_->owner_of(u).record_stream(u, s);
  }
  if (!st.ok()) throw_status(st, "vmm::allocator::record_stream");
}

std::size_t allocator::usable_size(const void* p) const {
  std::lock_guard g(p_->mu);
  const auto u = reinterpret_cast<std::uintptr_t>(p);
  return p_->owner_of(u).usable_size(u);
}

void allocator::trim(std::size_t keep) {
  impl& m = *p_;
  // Before the trim gives anything back: a replay trims where the program did, between the same
  // allocations and frees.
  if (m.trace) [[unlikely]] m.trace->event('t', 0, keep, nullptr);
  status st;
  tcache* mine = m.tc_enabled ? &m.my_cache() : nullptr;  // may lock mu itself: first
  {
    std::unique_lock g(m.mu);
    // This thread's cache goes back first (other threads' caches are theirs: at most
    // tuning::thread_cache_slots per class each, returned when those threads end). The chunks and idle
    // handles trim gives back are unmapped and released after the lock is dropped, as a free's
    // are; trim returns once they are. Chunks a stream still uses are waited for without the
    // lock too: a first round skips them, the second gives them back once their streams caught up.
    (void)m.ar->take_parked_error();  // what earlier calls' work met was theirs to report
    for (int round = 0; round < 2; ++round) {
      if (mine && round == 0) m.flush_cache(*mine, true);
      m.hp->defer_waits(round == 0);
      st = m.hp->trim(keep);
      m.hp->defer_waits(false);
      (void)m.settle(g, true);
      if (status parked = m.ar->take_parked_error(); !parked.ok() && st.ok()) st = parked;  // a refused unmap or release
      std::vector<stream_t> waits = m.hp->take_waits();
      if (waits.empty() || !st.ok()) break;
      m.wait_streams(g, std::move(waits));
    }
  }
  if (!st.ok()) throw_status(st, "vmm::allocator::trim");
}

void allocator::reset_peaks() {
  std::lock_guard g(p_->mu);
  p_->hp->reset_peaks();
  p_->ar->reset_peaks();
}

void allocator::set_memory_limit(std::size_t bytes) {
  p_->ar->set_memory_limit(bytes);
  // Held past the new limit: free chunks and idle handles go back until it fits (as far as they
  // reach; live blocks stay). Without this a refused growth would leave them held past the limit.
  const allocator_stats s = stats();
  if (s.physical <= bytes) return;
  const std::size_t over = s.physical - bytes, spare = s.free_chunk_bytes + s.idle;
  trim(spare > over ? spare - over : 0);
}
std::size_t allocator::memory_limit() const noexcept { return p_->ar->memory_limit(); }

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
