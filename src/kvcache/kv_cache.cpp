// SPDX-License-Identifier: Apache-2.0
// kv_cache: one reservation, per-(layer, K|V) buffers, pages mapped per sequence, a handle pool and
// an optional map-ahead thread. See kv_cache.hpp for the layout and the contract.
#include "vmmalloc/cuda_backend.hpp"
#include "vmmalloc/kv_cache.hpp"

#include <algorithm>
#include <limits>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include "vm/driver.hpp"
#include "vm/granularity.hpp"
#include "vm/mapping.hpp"
#include "vm/reservation.hpp"

namespace vmm {

namespace {

constexpr std::size_t round_up(std::size_t n, std::size_t g) { return (n + g - 1) / g * g; }

status fail(errc k, const char* name) { return {k, 0, name, "kv_cache"}; }

[[noreturn]] void bad(const char* name, const std::string& what) {
  throw error(fail(errc::invalid_value, name), "vmm::kv_cache" + what);
}

// Backend calls of one operation (attempts, retries included) and refusals, attributed to a path
// (append, map-ahead): vm::driver counts every call; a scope collects this thread's share.
struct calls {
  std::uint64_t n = 0, failures = 0;
};
struct counting {
  calls& c;
  vm::driver::scope sc{c.n, c.failures};
  explicit counting(calls& x) : c(x) {}
};

}  // namespace

struct kv_cache::impl {
  explicit impl(std::unique_ptr<backend_iface> bb) : b(std::move(bb)), d(b.get()) {}
  std::unique_ptr<backend_iface> b;
  vm::driver d;
  vm::reservation res;
  kv_cache_config cfg;
  chunk_props props;
  std::vector<access_desc> access;  // owner + peers: one set_access per buffer per mapping round
  std::size_t gran = 0, T = 0, P = 0, S = 0, B = 0, nbuf = 0, maxp = 0, reserved = 0;
  std::uintptr_t base = 0;

  struct slot {
    bool open = false;
    bool busy = false;          // the map-ahead thread is mapping it (lock released)
    bool ahead_failed = false;  // the thread's last job here failed: not retried until things change
    std::size_t tokens = 0, mapped = 0;  // mapped: pages per buffer, a prefix [0, mapped)
    std::vector<mem_handle> h;           // [buf * maxp + page]
  };
  std::vector<slot> slots;
  std::vector<mem_handle> pool;  // created, unmapped
  vm::strays strays;             // refused rollback / unmap work, retried before the next mapping

  mutable std::mutex mu;
  std::condition_variable cv;  // state changes: work for the thread, a slot no longer busy, idle
  bool stop = false;
  std::thread worker;

  kv_cache_stats st;  // counters; the current-state fields are computed by stats()
  std::size_t open_count = 0, groups_mapped = 0, tokens_used = 0;

  std::uintptr_t va_of(std::size_t buf, std::size_t s, std::size_t p) const {
    return base + buf * B + s * S + p * P;
  }
  std::size_t pages_for(std::size_t tokens) const { return (tokens * T + P - 1) / P; }
  bool ahead() const { return cfg.map_ahead_pages || cfg.map_ahead_tokens; }
  // Pages the thread keeps a sequence at (without map-ahead: what its tokens need).
  std::size_t target(const slot& sl) const {
    const std::size_t t = sl.tokens + std::min(cfg.map_ahead_tokens, cfg.max_tokens - sl.tokens);
    return std::min(maxp, pages_for(t) + cfg.map_ahead_pages);
  }
  void account(const calls& c, std::uint64_t* path) {
    st.driver_calls += c.n;
    st.failures += c.failures;
    if (path) *path += c.n;
  }

  slot& open_slot(seq_id s, const char* what) {
    if (s >= slots.size())
      bad("unknown sequence", std::string("::") + what + ": sequence " + std::to_string(s) +
                                  " is out of range (max_seqs " + std::to_string(slots.size()) + ")");
    if (!slots[s].open)
      bad("sequence not open", std::string("::") + what + ": sequence " + std::to_string(s) + " is not open");
    return slots[s];
  }
  void wait_not_busy(std::unique_lock<std::mutex>& lk, seq_id s) {
    cv.wait(lk, [&] { return !slots[s].busy; });
  }

  // ---- mapping a range of pages of one slot (no shared state touched but the backend) ----
  struct job {
    std::size_t s = 0, from = 0, to = 0;
    std::vector<mem_handle> pooled;  // in: handles to map first (taken from the back)
    std::vector<mem_handle> out;     // success: [buf * (to - from) + (p - from)]
    std::vector<mem_handle> back;    // failure (and leftovers): handles for the pool
    vm::strays strays;               // failure: rollback work the driver refused twice
    std::uint64_t created = 0, reused = 0, released = 0;
    calls c;
    status st;
  };

  // Maps pages [from, to) of slot s in every buffer: per buffer, one map per page and one
  // set_access over the range (vm::mapping_txn::place). All or nothing: on failure every mapping
  // made is unmapped, created handles are released and pooled ones handed back.
  void run(job& j) {
    counting k(j.c);
    const std::size_t n = j.to - j.from;
    vm::mapping_txn txn(d, j.strays);
    std::vector<vm::piece> placed;
    placed.reserve(nbuf * n);
    auto create = [&](std::size_t size) {
      auto r = d.create(size, props);
      if (r.ok()) ++j.created;
      return r;
    };
    status err{};
    for (std::size_t buf = 0; buf < nbuf && err.ok(); ++buf) {
      std::vector<vm::piece> pages(n, vm::piece{P});
      for (auto& pg : pages)
        if (!j.pooled.empty()) pg.h = j.pooled.back(), j.pooled.pop_back();
      err = txn.place(va_of(buf, j.s, j.from), pages, access, create);
      if (err.ok()) placed.insert(placed.end(), pages.begin(), pages.end());
    }
    if (err.ok()) {
      txn.commit();
      j.out.reserve(placed.size());
      for (const vm::piece& pg : placed) {
        j.out.push_back(pg.h);
        if (!pg.created) ++j.reused;
      }
    } else {
      j.st = err;
      txn.rollback();
      for (auto& l : txn.returned()) j.back.push_back(l.h);
      j.released += txn.released_bytes() / P;
    }
    j.back.insert(j.back.end(), j.pooled.begin(), j.pooled.end());
    j.pooled.clear();
  }

  // Under the lock: a job for [from, to) of slot s with as many pooled handles as it can use.
  // Under the lock (retain_closed): unmaps retained pages of closed slots other than `except`
  // into the pool until it holds `want` handles. A refused unmap parks that page as a stray.
  status reclaim(std::size_t want, std::size_t except, std::uint64_t* path) {
    status err{};
    for (std::size_t o = 0; o < slots.size() && pool.size() < want; ++o) {
      slot& sl = slots[o];
      if (o == except || sl.open || sl.busy || sl.mapped == 0) continue;
      const std::size_t before = sl.mapped;
      status x = unmap_down_to(sl, o, 0, path);
      st.pages_reclaimed += (before - sl.mapped) * nbuf;
      if (!x.ok() && err.ok()) err = x;
    }
    return err;
  }

  job plan(std::size_t s, std::size_t from, std::size_t to, std::uint64_t* path) {
    job j;
    j.s = s;
    j.from = from;
    j.to = to;
    // Retained pages are unmapped for reuse before anything is created (a refusal only parks
    // pages: the job then creates what the pool lacks).
    if (cfg.retain_closed && pool.size() < nbuf * (to - from)) (void)reclaim(nbuf * (to - from), s, path);
    const std::size_t want = std::min(pool.size(), nbuf * (to - from));
    j.pooled.assign(pool.end() - static_cast<std::ptrdiff_t>(want), pool.end());
    pool.resize(pool.size() - want);
    return j;
  }

  // Under the lock: the job's outcome into the slot, the pool and the counters.
  void commit(job& j, std::uint64_t* path) {
    account(j.c, path);
    st.pages_created += j.created;
    st.pages_released += j.released;
    pool.insert(pool.end(), j.back.begin(), j.back.end());
    strays.take(j.strays);
    if (!j.st.ok()) return;
    slot& sl = slots[j.s];
    const std::size_t n = j.to - j.from;
    for (std::size_t buf = 0; buf < nbuf; ++buf)
      for (std::size_t i = 0; i < n; ++i) sl.h[buf * maxp + j.from + i] = j.out[buf * n + i];
    sl.mapped = j.to;
    groups_mapped += n;
    st.pages_reused += j.reused;
  }

  // Under the lock: retries parked work. A stray mapping would block mapping its page again.
  status clean_strays() {
    std::size_t released = 0;
    status s = strays.retry(d, &released);
    st.pages_released += released / P;
    return s;
  }

  // Under the lock: unmaps pages [keep, mapped) of sl into the pool, top page first. A refused
  // unmap (twice) parks that page as a stray; the slot shrinks anyway. Returns the first refusal.
  status unmap_down_to(slot& sl, std::size_t s, std::size_t keep, std::uint64_t* path = nullptr) {
    calls c;
    counting k(c);
    status err{};
    for (std::size_t p = sl.mapped; p-- > keep;) {
      for (std::size_t buf = 0; buf < nbuf; ++buf) {
        const std::uintptr_t va = va_of(buf, s, p);
        const mem_handle h = sl.h[buf * maxp + p];
        status x = vm::driver::twice([&] { return d.unmap(va, P); });
        if (x.ok()) {
          pool.push_back(h);
        } else {
          strays.add_mapping(va, P, h);
          if (err.ok()) err = x;
        }
      }
    }
    if (sl.mapped > keep) {
      groups_mapped -= sl.mapped - keep;
      sl.mapped = keep;
      for (auto& o : slots) o.ahead_failed = false;  // the pool grew: a parked job may fit now
    }
    account(c, path);
    return err;
  }

  // ---- the map-ahead thread ----
  long find_work(std::size_t from) const {
    for (std::size_t i = 0; i < slots.size(); ++i) {
      const std::size_t s = (from + i) % slots.size();
      const slot& sl = slots[s];
      if (sl.open && !sl.busy && !sl.ahead_failed && sl.mapped < target(sl)) return static_cast<long>(s);
    }
    return -1;
  }
  bool any_busy() const {
    return std::any_of(slots.begin(), slots.end(), [](const slot& s) { return s.busy; });
  }

  void work() {
    std::unique_lock lk(mu);
    std::size_t next = 0;
    while (!stop) {
      const long w = find_work(next);
      if (w < 0) {
        cv.notify_all();  // idle: wait_map_ahead() may return
        cv.wait(lk);
        continue;
      }
      const auto s = static_cast<std::size_t>(w);
      next = s + 1;
      if (!strays.empty()) {
        calls c;
        status x{};
        {
          counting k(c);
          x = clean_strays();
        }
        account(c, &st.map_ahead_driver_calls);
        if (!x.ok()) {
          slots[s].ahead_failed = true;
          ++st.map_ahead_failures;
          continue;
        }
      }
      slots[s].busy = true;
      job j = plan(s, slots[s].mapped, target(slots[s]), &st.map_ahead_driver_calls);
      lk.unlock();
      run(j);  // the driver's time, with the lock released: append() and k() do not wait
      lk.lock();
      commit(j, &st.map_ahead_driver_calls);
      if (j.st.ok()) {
        st.map_ahead_pages += j.to - j.from;
      } else {
        slots[s].ahead_failed = true;
        ++st.map_ahead_failures;
      }
      slots[s].busy = false;
      cv.notify_all();
    }
  }

  static impl& live(const std::unique_ptr<impl>& p) {
    if (!p) bad("moved-from", ": moved-from kv_cache");
    return *p;
  }

  void* ptr_of(seq_id s, std::size_t layer, std::size_t kv, const char* what) const {
    if (s >= slots.size() || layer >= cfg.layers)
      bad("out of range", std::string("::") + what + ": sequence " + std::to_string(s) + " / layer " +
                              std::to_string(layer) + " out of range (max_seqs " + std::to_string(slots.size()) +
                              ", layers " + std::to_string(cfg.layers) + ")");
    if (kv && cfg.fused_kv)
      bad("no V buffer", std::string("::") + what + ": fused_kv: the layer's one buffer holds K and V (use k)");
    return reinterpret_cast<void*>(va_of((cfg.fused_kv ? 1 : 2) * layer + kv, s, 0));
  }

  // Under the lock: opens slot s (checked).
  void open_locked(std::unique_lock<std::mutex>& lk, seq_id s) {
    if (s >= slots.size())
      bad("unknown sequence", "::open: slot " + std::to_string(s) + " is out of range (max_seqs " +
                                  std::to_string(slots.size()) + ")");
    slot& sl = slots[s];
    if (sl.open) bad("sequence already open", "::open: slot " + std::to_string(s) + " is already open");
    wait_not_busy(lk, s);  // the thread never starts on a closed slot; a job it began before close ended
    if (sl.h.empty()) sl.h.assign(nbuf * maxp, 0);
    st.pages_retained_reused += sl.mapped * nbuf;  // retain_closed: mapped already, no driver call
    sl.open = true;
    sl.tokens = 0;
    sl.ahead_failed = false;
    ++open_count;
  }

  void destroy() noexcept {
    {
      std::lock_guard g(mu);
      stop = true;
    }
    cv.notify_all();
    if (worker.joinable()) worker.join();
    if (!b) return;
    // Teardown cannot report errors: each call is made once more if refused. A handle whose
    // mapping could not be undone is still released (memory returns when the mapping goes, the
    // driver's rule).
    calls c;
    {
      counting k(c);
      bool mapped = false;  // something the driver would not unmap: the reservation stays
      for (std::size_t s = 0; s < slots.size(); ++s) {
        slot& sl = slots[s];
        for (std::size_t p = sl.mapped; p-- > 0;)
          for (std::size_t buf = 0; buf < nbuf; ++buf) {
            const mem_handle h = sl.h[buf * maxp + p];
            mapped |= !vm::driver::twice([&] { return d.unmap(va_of(buf, s, p), P); }).ok();
            if (vm::driver::twice([&] { return d.release(h); }).ok()) ++st.pages_released;
          }
        sl.mapped = 0;
        sl.open = false;
      }
      for (mem_handle h : pool)
        if (vm::driver::twice([&] { return d.release(h); }).ok()) ++st.pages_released;
      pool.clear();
      (void)clean_strays();
      (void)res.close(mapped || strays.holds_mappings());
    }
    account(c, nullptr);
    b.reset();
  }
};

// ---- construction --------------------------------------------------------------------------------

kv_cache::kv_cache(std::unique_ptr<backend_iface> b, const kv_cache_config& c) {
  if (!b) bad("no backend", ": no backend");
  p_ = std::make_unique<impl>(std::move(b));
  impl& m = *p_;
  m.cfg = c;
  const struct {
    std::size_t v;
    const char* name;
  } dims[] = {{c.layers, "layers"},     {c.kv_heads, "kv_heads"},   {c.head_dim, "head_dim"},
              {c.elem_bytes, "elem_bytes"}, {c.max_seqs, "max_seqs"}, {c.max_tokens, "max_tokens"}};
  for (const auto& d : dims)
    if (d.v == 0) bad("zero dimension", std::string(": config.") + d.name + " must be > 0");

  m.props.location = location_kind::device;
  m.props.id = c.device;
  calls k;
  counting kk(k);
  m.access.push_back({c.device, access_mode::read_write});
  for (const auto& p : c.peers)
    if (p.device != c.device) m.access.push_back(p);
  std::string why;
  auto g = vm::granularity_for(m.d, m.props, m.access, false, &why);
  if (!g.ok()) {
    if (g.st.kind == errc::invalid_value) bad("peer cannot access the owner", ": " + why);
    throw_status(g.st, "vmm::kv_cache: " + why);
  }
  m.gran = g.value;

  m.P = c.page_size ? c.page_size : m.gran;
  if (m.P % m.gran)
    bad("page_size not a multiple of the granularity",
        ": page_size " + std::to_string(m.P) + " is not a multiple of the granularity " + std::to_string(m.gran));

  // Geometry, overflow-checked: T, S = round_up(max_tokens * T, P), B = max_seqs * S, 2 L B.
  std::size_t t1 = 0, t2 = 0, seq = 0, bufs = 0;
  bool over = __builtin_mul_overflow(c.kv_heads, c.head_dim, &t1) || __builtin_mul_overflow(t1, c.elem_bytes, &t2) ||
              __builtin_mul_overflow(c.max_tokens, t2, &seq) || seq > SIZE_MAX - m.P ||
              __builtin_mul_overflow(round_up(seq, m.P), c.max_seqs, &m.B) ||
              __builtin_mul_overflow(c.layers, c.fused_kv ? std::size_t{1} : std::size_t{2}, &bufs) ||
              __builtin_mul_overflow(bufs, m.B, &m.reserved);
  if (over)
    throw out_of_memory(fail(errc::out_of_memory, "layout overflows"),
                        "vmm::kv_cache: the layout (2 x layers x max_seqs x max_tokens x token bytes) overflows");
  m.T = t2;
  m.S = round_up(seq, m.P);
  m.nbuf = bufs;
  m.maxp = m.S / m.P;
  m.slots.resize(c.max_seqs);

  // The one reservation (~3 us on the driver even for TiBs).
  status r = m.res.open(m.d, m.reserved, m.P);
  m.account(k, nullptr);
  if (!r.ok())
    throw_status(r, "vmm::kv_cache: reserving " + std::to_string(m.reserved >> 20) + " MiB of address space");
  m.base = m.res.base();
  if (m.ahead()) m.worker = std::thread([&m] { m.work(); });
}

kv_cache kv_cache::host(const kv_cache_config& c, const host_backend_options& h) {
  return kv_cache(make_backend<host_backend>(h), c);
}

kv_cache kv_cache::cuda(const kv_cache_config& c) {
  auto m = std::make_unique<backend_model<cuda_backend>>(c.device);
  if (!m->get().available()) throw error(m->get().load_status(), m->get().load_message());
  return kv_cache(std::move(m), c);
}

kv_cache::~kv_cache() {
  if (p_) p_->destroy();
}
kv_cache::kv_cache(kv_cache&&) noexcept = default;
kv_cache& kv_cache::operator=(kv_cache&& o) noexcept {
  if (this != &o) {
    if (p_) p_->destroy();
    p_ = std::move(o.p_);
  }
  return *this;
}

// ---- sequences -------------------------------------------------------------------------------

seq_id kv_cache::open() {
  impl& m = impl::live(p_);
  std::unique_lock lk(m.mu);
  std::size_t s = 0;
  while (s < m.slots.size() && m.slots[s].open) ++s;
  if (m.cfg.retain_closed)  // the closed slot with the most pages still mapped
    for (std::size_t o = s + 1; o < m.slots.size(); ++o)
      if (!m.slots[o].open && m.slots[o].mapped > m.slots[s].mapped) s = o;
  if (s == m.slots.size())
    throw out_of_memory(fail(errc::out_of_memory, "too many sequences"),
                        "vmm::kv_cache::open: all " + std::to_string(m.slots.size()) +
                            " sequence slots (max_seqs) are open");
  m.open_locked(lk, s);
  lk.unlock();
  if (m.ahead()) m.cv.notify_all();
  return s;
}

seq_id kv_cache::open(seq_id s) {
  impl& m = impl::live(p_);
  std::unique_lock lk(m.mu);
  m.open_locked(lk, s);
  lk.unlock();
  if (m.ahead()) m.cv.notify_all();
  return s;
}

std::size_t kv_cache::append(seq_id s, std::size_t n) {
  impl& m = impl::live(p_);
  std::unique_lock lk(m.mu);
  impl::slot* sl = &m.open_slot(s, "append");
  const std::size_t old = sl->tokens;
  if (n > m.cfg.max_tokens - old)
    throw out_of_memory(fail(errc::out_of_memory, "max_tokens exceeded"),
                        "vmm::kv_cache::append: sequence " + std::to_string(s) + " has " + std::to_string(old) +
                            " tokens; " + std::to_string(n) + " more exceed max_tokens " +
                            std::to_string(m.cfg.max_tokens));
  const std::size_t need = m.pages_for(old + n);
  if (need > sl->mapped && sl->busy) {
    ++m.st.append_waits;  // the thread is mapping this slot: its pages are on the way
    m.wait_not_busy(lk, s);
    sl = &m.open_slot(s, "append");  // a concurrent close is the caller's race; still checked
  }
  if (need > sl->mapped) {
    const std::string ctx = "vmm::kv_cache::append: sequence " + std::to_string(s) + ", mapping pages " +
                            std::to_string(sl->mapped) + ".." + std::to_string(need) + " (" +
                            std::to_string(m.nbuf) + " buffers)";
    if (!m.strays.empty()) {
      calls c;
      status x{};
      {
        counting k(c);
        x = m.clean_strays();
      }
      m.account(c, &m.st.append_driver_calls);
      if (!x.ok()) throw_status(x, ctx + ": undoing an earlier failed step");
    }
    impl::job j = m.plan(s, sl->mapped, need, &m.st.append_driver_calls);
    m.run(j);
    m.commit(j, &m.st.append_driver_calls);
    if (!j.st.ok()) {
      if (m.ahead()) m.cv.notify_all();  // handles went back to the pool
      throw_status(j.st, ctx);
    }
    sl->ahead_failed = false;
  }
  sl->tokens = old + n;
  m.tokens_used += n;
  ++m.st.appends;
  // Wake the thread only when this append left the slot short of its target (once per page).
  const bool wake = m.ahead() && !sl->ahead_failed && sl->mapped < m.target(*sl);
  lk.unlock();
  if (wake) m.cv.notify_all();
  return old;
}

void kv_cache::truncate(seq_id s, std::size_t n) {
  impl& m = impl::live(p_);
  std::unique_lock lk(m.mu);
  impl::slot& sl = m.open_slot(s, "truncate");
  if (n > sl.tokens)
    bad("truncate past the length", "::truncate: sequence " + std::to_string(s) + " has " +
                                        std::to_string(sl.tokens) + " tokens, cannot truncate to " + std::to_string(n));
  m.wait_not_busy(lk, s);  // the thread must not be mapping pages we are about to unmap
  m.tokens_used -= sl.tokens - n;
  sl.tokens = n;
  const std::size_t keep = m.target(sl);
  status err = sl.mapped > keep ? m.unmap_down_to(sl, s, keep) : status{};
  lk.unlock();
  m.cv.notify_all();
  if (!err.ok())
    throw error(err, "vmm::kv_cache::truncate: sequence " + std::to_string(s) + " is now " + std::to_string(n) +
                         " tokens, but unmapping was refused (parked, retried later): " + err.message());
}

void kv_cache::close(seq_id s) {
  impl& m = impl::live(p_);
  std::unique_lock lk(m.mu);
  impl::slot& sl = m.open_slot(s, "close");
  m.wait_not_busy(lk, s);
  m.tokens_used -= sl.tokens;
  sl.tokens = 0;
  sl.open = false;
  --m.open_count;
  // retain_closed: the pages stay mapped for the next open() (or a reclaim, or trim).
  status err = m.cfg.retain_closed ? status{} : m.unmap_down_to(sl, s, 0);
  lk.unlock();
  m.cv.notify_all();
  if (!err.ok())
    throw error(err, "vmm::kv_cache::close: sequence " + std::to_string(s) +
                         " is closed, but unmapping was refused (parked, retried later): " + err.message());
}

std::size_t kv_cache::trim() { return trim(impl::live(p_).cfg.pool_keep_pages); }

std::size_t kv_cache::trim(std::size_t keep) {
  impl& m = impl::live(p_);
  std::lock_guard g(m.mu);
  calls c;
  std::size_t released = 0;
  status err{};
  {
    counting k(c);
    err = m.clean_strays();  // parked unmaps and releases first: giving memory back is why we are here
  }
  m.account(c, nullptr);
  if (err.ok() && m.cfg.retain_closed)  // retained pages are pooled memory too: unmap them first
    err = m.reclaim(std::numeric_limits<std::size_t>::max(), m.slots.size(), nullptr);
  calls r;
  {
    counting k(r);
    while (err.ok() && m.pool.size() > keep) {
      const mem_handle h = m.pool.back();
      err = vm::driver::twice([&] { return m.d.release(h); });
      if (!err.ok()) break;  // stays pooled: a later trim retries
      m.pool.pop_back();
      ++released;
    }
  }
  m.st.pages_released += released;
  m.account(r, nullptr);
  if (!err.ok())
    throw error(err, "vmm::kv_cache::trim: released " + std::to_string(released) +
                         " pages, then the driver refused: " + err.message());
  return released;
}

void kv_cache::wait_map_ahead() {
  impl& m = impl::live(p_);
  if (!m.ahead()) return;
  std::unique_lock lk(m.mu);
  m.cv.notify_all();
  m.cv.wait(lk, [&] { return m.stop || (m.find_work(0) < 0 && !m.any_busy()); });
}

// ---- queries ---------------------------------------------------------------------------------

bool kv_cache::is_open(seq_id s) const {
  const impl& m = impl::live(p_);
  std::lock_guard g(m.mu);
  return s < m.slots.size() && m.slots[s].open;
}
std::size_t kv_cache::length(seq_id s) const {
  impl& m = impl::live(p_);
  std::lock_guard g(m.mu);
  return m.open_slot(s, "length").tokens;
}
std::size_t kv_cache::mapped_pages(seq_id s) const {
  impl& m = impl::live(p_);
  std::lock_guard g(m.mu);
  return m.open_slot(s, "mapped_pages").mapped;
}
std::size_t kv_cache::capacity(seq_id s) const {
  impl& m = impl::live(p_);
  std::lock_guard g(m.mu);
  return std::min(m.cfg.max_tokens, m.open_slot(s, "capacity").mapped * m.P / m.T);
}

void* kv_cache::k(seq_id s, std::size_t layer) const { return impl::live(p_).ptr_of(s, layer, 0, "k"); }
void* kv_cache::v(seq_id s, std::size_t layer) const { return impl::live(p_).ptr_of(s, layer, 1, "v"); }
void* kv_cache::k_base(std::size_t layer) const { return impl::live(p_).ptr_of(0, layer, 0, "k_base"); }
void* kv_cache::v_base(std::size_t layer) const { return impl::live(p_).ptr_of(0, layer, 1, "v_base"); }

void* kv_cache::base() const noexcept { return p_ ? reinterpret_cast<void*>(p_->base) : nullptr; }
std::size_t kv_cache::reserved() const noexcept { return p_ ? p_->reserved : 0; }
std::size_t kv_cache::token_bytes() const noexcept { return p_ ? p_->T : 0; }
std::size_t kv_cache::seq_stride() const noexcept { return p_ ? p_->S : 0; }
std::size_t kv_cache::buffer_stride() const noexcept { return p_ ? p_->B : 0; }
std::size_t kv_cache::page_size() const noexcept { return p_ ? p_->P : 0; }
std::size_t kv_cache::tokens_per_page() const noexcept { return p_ ? p_->P / p_->T : 0; }
std::size_t kv_cache::max_pages() const noexcept { return p_ ? p_->maxp : 0; }
std::size_t kv_cache::pages_for(std::size_t tokens) const noexcept { return p_ ? p_->pages_for(tokens) : 0; }
std::size_t kv_cache::granularity() const noexcept { return p_ ? p_->gran : 0; }
const kv_cache_config& kv_cache::config() const noexcept {
  static const kv_cache_config empty{};
  return p_ ? p_->cfg : empty;
}
backend_iface& kv_cache::backend() noexcept { return *impl::live(p_).b; }

kv_cache_stats kv_cache::stats() const {
  const impl& m = impl::live(p_);
  std::lock_guard g(m.mu);
  kv_cache_stats s = m.st;
  s.pages_mapped = m.groups_mapped * m.nbuf;
  s.pages_pooled = m.pool.size();
  for (const auto& sl : m.slots)
    if (!sl.open) s.pages_retained += sl.mapped * m.nbuf;
  s.mapped_bytes = s.pages_mapped * m.P;
  s.used_bytes = m.tokens_used * m.T * m.nbuf;
  s.open_seqs = m.open_count;
  return s;
}

}  // namespace vmm
