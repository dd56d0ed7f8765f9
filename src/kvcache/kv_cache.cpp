// SPDX-License-Identifier: Apache-2.0
// kv_cache: one reservation, buffers per (layer, K|V) or per sequence, pages mapped per sequence
// (shared between sequences for a common prefix), a handle pool and an optional map-ahead thread.
// See kv_cache.hpp for the layout and the contract.
#include "vmmalloc/cuda_backend.hpp"
#include "vmmalloc/kv_cache.hpp"

#include <algorithm>
#include <limits>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
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
  // T: one token of one layer's K|V; R: bytes from one token to the next in a buffer (T, or every
  // layer's K and V of a token per_sequence); nkv: K|V buffers of a sequence (2 L, fused_kv: L);
  // nbuf: buffers mapped per sequence (nkv, per_sequence: 1); layer_str / kv_str: k(s, l) and v's
  // offsets per layer and from K to V.
  std::size_t gran = 0, T = 0, R = 0, P = 0, S = 0, B = 0, nkv = 0, nbuf = 0, maxp = 0, reserved = 0;
  std::size_t layer_str = 0, kv_str = 0;
  std::uintptr_t base = 0;

  struct slot {
    bool open = false;
    bool busy = false;          // the map-ahead thread is mapping it (lock released)
    bool ahead_failed = false;  // the thread's last job here failed: not retried until things change
    std::size_t tokens = 0, mapped = 0;  // mapped: pages per buffer, a prefix [0, mapped)
    std::size_t shared = 0;              // pages [0, shared) map another sequence's (share_prefix)
    std::vector<mem_handle> h;           // [buf * maxp + page]
  };
  std::vector<slot> slots;
  std::vector<mem_handle> pool;  // created, unmapped
  // Pages mapped by more than one sequence: handle -> mappings beyond the first. An unmap of such
  // a page only unmaps; the last mapping's unmap pools it.
  std::unordered_map<mem_handle, std::size_t> aliases;
  std::size_t alias_count = 0;  // sum of aliases
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
  std::size_t pages_for(std::size_t tokens) const { return (tokens * R + P - 1) / P; }
  // Drops one mapping of h from the alias count; true when another mapping still holds h.
  bool unalias(mem_handle h) {
    auto it = aliases.find(h);
    if (it == aliases.end()) return false;
    if (--it->second == 0) aliases.erase(it);
    --alias_count;
    return true;
  }
  bool ahead() const { return cfg.map_ahead_pages || cfg.map_ahead_tokens; }
  // Pages the thread keeps a sequence at (without map-ahead: what its tokens need).
  std::size_t target(const slot& sl) const { return target_for(sl.tokens); }
  std::size_t target_for(std::size_t tokens) const {
    const std::size_t t = tokens + std::min(cfg.map_ahead_tokens, cfg.max_tokens - tokens);
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
  // The same, its driver calls counted and attributed to `path` (append, map-ahead; null: none).
  status clean_strays_on(std::uint64_t* path) {
    calls c;
    status x{};
    {
      counting k(c);
      x = clean_strays();
    }
    account(c, path);
    return x;
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
        const bool held_elsewhere = unalias(h);  // another sequence maps it: only unmapped here
        status x = vm::driver::twice([&] { return d.unmap(va, P); });
        if (x.ok()) {
          if (!held_elsewhere) pool.push_back(h);
        } else {
          if (held_elsewhere) strays.add_unmap(va, P);
          else strays.add_mapping(va, P, h);
          if (err.ok()) err = x;
        }
      }
    }
    sl.shared = std::min(sl.shared, keep);
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
        if (!clean_strays_on(&st.map_ahead_driver_calls).ok()) {
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
    return reinterpret_cast<void*>(base + layer * layer_str + kv * kv_str + s * S);
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

  // Under the lock: maps the missing pages for `need` pages of open slot s (append's path; the
  // caller waited for the thread on s). Throws what the driver refused; nothing new stays mapped.
  void grow_locked(seq_id s, std::size_t need, const char* what) {
    slot& sl = slots[s];
    if (need <= sl.mapped) return;
    const std::string ctx = std::string("vmm::kv_cache::") + what + ": sequence " + std::to_string(s) +
                            ", mapping pages " + std::to_string(sl.mapped) + ".." + std::to_string(need) + " (" +
                            std::to_string(nbuf) + " buffers)";
    if (!strays.empty())
      if (status x = clean_strays_on(&st.append_driver_calls); !x.ok())
        throw_status(x, ctx + ": undoing an earlier failed step");
    job j = plan(s, sl.mapped, need, &st.append_driver_calls);
    run(j);
    commit(j, &st.append_driver_calls);
    if (!j.st.ok()) {
      if (ahead()) cv.notify_all();  // handles went back to the pool
      throw_status(j.st, ctx);
    }
    sl.ahead_failed = false;
  }

  // Whether a page of sl from `from` on is mapped by another sequence too (it must not take new
  // tokens: they would land in the other's).
  bool aliased_from(const slot& sl, std::size_t from, std::size_t to) const {
    for (std::size_t p = from; p < std::min(to, sl.mapped); ++p)
      for (std::size_t buf = 0; buf < nbuf; ++buf)
        if (aliases.count(sl.h[buf * maxp + p])) return true;
    return false;
  }

  // Pages of a prefix of `tokens` tokens that end on a token boundary: what share_prefix maps
  // again. Every token is then wholly in shared pages or wholly in the sequence's own.
  std::size_t whole_pages(std::size_t tokens) const {
    std::size_t k = tokens * R / P;
    while (k && (k * P) % R) --k;
    return k;
  }

  // Under the lock: maps src's pages [0, k) in every buffer of slot s again, read-only for every
  // device. All or nothing; an unmap refused in the undo is parked (unmap only: src keeps h).
  status alias_pages(std::size_t src, std::size_t s, std::size_t k) {
    calls c;
    counting kk(c);
    std::vector<access_desc> ro = access;
    for (auto& a : ro) a.mode = access_mode::read;
    std::vector<std::uintptr_t> done;
    status err{};
    for (std::size_t buf = 0; buf < nbuf && err.ok(); ++buf) {
      for (std::size_t p = 0; p < k && err.ok(); ++p) {
        err = d.map(va_of(buf, s, p), P, slots[src].h[buf * maxp + p], 0);
        if (err.ok()) done.push_back(va_of(buf, s, p));
      }
      if (err.ok() && k) err = d.set_access(va_of(buf, s, 0), k * P, ro);
    }
    if (!err.ok())
      for (auto it = done.rbegin(); it != done.rend(); ++it)
        if (!vm::driver::twice([&] { return d.unmap(*it, P); }).ok()) strays.add_unmap(*it, P);
    account(c, &st.append_driver_calls);
    if (!err.ok()) return err;
    slot& sl = slots[s];
    for (std::size_t buf = 0; buf < nbuf; ++buf)
      for (std::size_t p = 0; p < k; ++p) {
        const mem_handle h = slots[src].h[buf * maxp + p];
        sl.h[buf * maxp + p] = h;
        ++aliases[h];
        ++alias_count;
      }
    sl.mapped = sl.shared = k;
    groups_mapped += k;
    return {};
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
            if (unalias(h)) continue;  // another sequence maps it: released with its last mapping
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
  auto g = vm::granularity_for(m.d, m.props, m.access, &why);
  if (!g.ok()) {
    if (g.st.kind == errc::invalid_value) bad("peer cannot access the owner", ": " + why);
    throw_status(g.st, "vmm::kv_cache: " + why);
  }
  m.gran = g.value;

  m.P = c.page_size ? c.page_size : m.gran;
  if (m.P % m.gran)
    bad("page_size not a multiple of the granularity",
        ": page_size " + std::to_string(m.P) + " is not a multiple of the granularity " + std::to_string(m.gran));

  if (c.layout != kv_layout::per_layer && c.layout != kv_layout::per_sequence)
    bad("unknown layout", ": config.layout is neither per_layer nor per_sequence");
  const bool per_seq = c.layout == kv_layout::per_sequence;
  // Geometry, overflow-checked: T; nkv = 2 L (fused_kv: L); R = T (per_sequence: nkv T);
  // S = round_up(max_tokens * R, P); B = max_seqs * S; reserved = nkv B (per_sequence: B).
  const std::size_t per_layer_bufs = c.fused_kv ? 1 : 2;
  std::size_t t1 = 0, t2 = 0, seq = 0, bufs = 0, row = 0;
  bool over = __builtin_mul_overflow(c.kv_heads, c.head_dim, &t1) || __builtin_mul_overflow(t1, c.elem_bytes, &t2) ||
              __builtin_mul_overflow(c.layers, per_layer_bufs, &bufs) ||
              __builtin_mul_overflow(t2, per_seq ? bufs : std::size_t{1}, &row) ||
              __builtin_mul_overflow(c.max_tokens, row, &seq) || seq > SIZE_MAX - m.P ||
              __builtin_mul_overflow(round_up(seq, m.P), c.max_seqs, &m.B) ||
              __builtin_mul_overflow(per_seq ? std::size_t{1} : bufs, m.B, &m.reserved);
  if (over)
    throw out_of_memory(fail(errc::out_of_memory, "layout overflows"),
                        "vmm::kv_cache: the layout (2 x layers x max_seqs x max_tokens x token bytes) overflows");
  m.T = t2;
  m.R = row;
  m.S = round_up(seq, m.P);
  m.nkv = bufs;
  m.nbuf = per_seq ? 1 : bufs;
  m.layer_str = per_seq ? per_layer_bufs * m.T : per_layer_bufs * m.B;
  m.kv_str = per_seq ? m.T : m.B;
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
  // An append that maps anyway (a prefill) maps the pages ahead too: the thread would otherwise
  // race the next decode steps for them.
  if (need > sl->mapped) m.grow_locked(s, m.ahead() ? std::max(need, m.target_for(old + n)) : need, "append");
  sl->tokens = old + n;
  m.tokens_used += n;
  ++m.st.appends;
  // Wake the thread only when this append left the slot short of its target (once per page).
  const bool wake = m.ahead() && !sl->ahead_failed && sl->mapped < m.target(*sl);
  lk.unlock();
  if (wake) m.cv.notify_all();
  return old;
}

seq_id kv_cache::share_prefix(seq_id src, std::size_t tokens) {
  impl& m = impl::live(p_);
  std::unique_lock lk(m.mu);
  const impl::slot& from = m.open_slot(src, "share_prefix");
  if (tokens > from.tokens)
    bad("prefix longer than the sequence", "::share_prefix: sequence " + std::to_string(src) + " has " +
                                               std::to_string(from.tokens) + " tokens, not " + std::to_string(tokens));
  // The lowest free slot with nothing mapped, else the lowest free one (retain_closed): what it
  // keeps mapped is unmapped first, as a reclaim, since the shared pages map from page 0.
  std::size_t s = m.slots.size();
  for (std::size_t o = 0; o < m.slots.size(); ++o)
    if (!m.slots[o].open && (s == m.slots.size() || (m.slots[s].mapped && !m.slots[o].mapped))) s = o;
  if (s == m.slots.size())
    throw out_of_memory(fail(errc::out_of_memory, "too many sequences"),
                        "vmm::kv_cache::share_prefix: all " + std::to_string(m.slots.size()) +
                            " sequence slots (max_seqs) are open");
  impl::slot& sl = m.slots[s];
  status err{};
  if (sl.mapped) {
    const std::size_t before = sl.mapped;
    err = m.unmap_down_to(sl, s, 0, &m.st.append_driver_calls);
    m.st.pages_reclaimed += (before - sl.mapped) * m.nbuf;
  }
  m.open_locked(lk, s);  // a closed slot is never busy: no wait, src is as checked
  const std::size_t k = m.whole_pages(tokens);
  auto abandon = [&] {  // on failure: nothing stays mapped or open
    (void)m.unmap_down_to(sl, s, 0);
    sl.open = false;
    --m.open_count;
  };
  if (err.ok()) err = m.alias_pages(src, s, k);
  if (err.ok()) {
    try {
      m.grow_locked(s, m.pages_for(tokens), "share_prefix");
    } catch (...) {
      abandon();
      throw;
    }
  }
  if (!err.ok()) {
    abandon();
    throw_status(err, "vmm::kv_cache::share_prefix: mapping sequence " + std::to_string(src) + "'s first " +
                          std::to_string(k) + " pages into slot " + std::to_string(s));
  }
  sl.tokens = tokens;
  m.tokens_used += tokens;
  const bool wake = m.ahead() && sl.mapped < m.target(sl);
  lk.unlock();
  if (wake) m.cv.notify_all();
  return s;
}

std::size_t kv_cache::shared_tokens(seq_id s) const {
  impl& m = impl::live(p_);
  std::lock_guard g(m.mu);
  return m.open_slot(s, "shared_tokens").shared * m.P / m.R;
}

void kv_cache::truncate(seq_id s, std::size_t n) {
  impl& m = impl::live(p_);
  std::unique_lock lk(m.mu);
  impl::slot& sl = m.open_slot(s, "truncate");
  if (n > sl.tokens)
    bad("truncate past the length", "::truncate: sequence " + std::to_string(s) + " has " +
                                        std::to_string(sl.tokens) + " tokens, cannot truncate to " + std::to_string(n));
  m.wait_not_busy(lk, s);  // the thread must not be mapping pages we are about to unmap
  // The pages kept from the one token n lands in on would take new tokens: none may be shared.
  impl::slot after = sl;
  after.tokens = n;
  const std::size_t keep = m.target(after);
  if (n * m.R < sl.shared * m.P || m.aliased_from(sl, n * m.R / m.P, keep))
    bad("truncate into shared pages",
        "::truncate: sequence " + std::to_string(s) + " to " + std::to_string(n) +
            " tokens: the page new tokens would go to is shared with another sequence (share_prefix); "
            "truncate past the shared pages, or close");
  m.tokens_used -= sl.tokens - n;
  sl.tokens = n;
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
  // retain_closed: the pages stay mapped for the next open() (or a reclaim, or trim); not shared
  // ones: they are read-only here, and the next sequence writes from its first token.
  const bool keep = m.cfg.retain_closed && sl.shared == 0 && !m.aliased_from(sl, 0, sl.mapped);
  status err = keep ? status{} : m.unmap_down_to(sl, s, 0);
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
  std::size_t released = 0;
  status err = m.clean_strays_on(nullptr);  // parked work first: giving memory back is why we are here
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
  return std::min(m.cfg.max_tokens, m.open_slot(s, "capacity").mapped * m.P / m.R);
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
std::size_t kv_cache::tokens_per_page() const noexcept { return p_ ? p_->P / p_->R : 0; }
std::size_t kv_cache::token_stride() const noexcept { return p_ ? p_->R : 0; }
std::size_t kv_cache::layer_stride() const noexcept { return p_ ? p_->layer_str : 0; }
std::size_t kv_cache::kv_stride() const noexcept { return p_ ? p_->kv_str : 0; }
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
  s.pages_mapped = m.groups_mapped * m.nbuf - m.alias_count;
  s.pages_aliased = m.alias_count;
  s.pages_pooled = m.pool.size();
  for (const auto& sl : m.slots)
    if (!sl.open) s.pages_retained += sl.mapped * m.nbuf;
  s.mapped_bytes = s.pages_mapped * m.P;
  s.used_bytes = m.tokens_used * m.T * m.nkv;
  s.open_seqs = m.open_count;
  return s;
}

}  // namespace vmm
