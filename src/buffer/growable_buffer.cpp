// SPDX-License-Identifier: Apache-2.0
// growable_buffer: one reservation, chunks mapped and unmapped at its tail. See growable_buffer.hpp.
#include "vmmalloc/cuda_backend.hpp"
#include "vmmalloc/growable_buffer.hpp"

#include <algorithm>
#include <limits>
#include <string>
#include <utility>

#include "frontend/allocator_access.hpp"
#include "vm/granularity.hpp"
#include "vm/handle_pool.hpp"
#include "vm/mapping.hpp"
#include "vm/reservation.hpp"

namespace vmm {

namespace {

constexpr std::size_t round_up(std::size_t n, std::size_t g) { return (n + g - 1) / g * g; }

status fail(errc k, const char* op, const char* name) { return {k, 0, name, op}; }

std::string mib(std::size_t n) {
  // "1536 MiB" when exact, else bytes: messages stay readable for the usual sizes.
  constexpr std::size_t M = std::size_t{1} << 20;
  return n % M == 0 ? std::to_string(n / M) + " MiB" : std::to_string(n) + " B";
}

}  // namespace

struct growable_buffer::impl {
  struct chunk {
    std::uintptr_t va = 0;
    std::size_t size = 0;
    mem_handle handle = 0;
  };
  explicit impl(std::unique_ptr<backend_iface> bb) : b(std::move(bb)), bp(b.get()), d(bp) {}
  explicit impl(vm::handle_pool& p) : bp(&p.backend()), d(bp), pool(&p) {}
  std::unique_ptr<backend_iface> b;  // null when shared: the allocator's backend is used
  backend_iface* bp;
  vm::driver d;
  vm::handle_pool* pool = nullptr;   // shared(): the allocator whose idle handles this buffer shares

  // A shared buffer's unmapped handle goes to the allocator's idle pool; when the pool would pass
  // the allocator's memory_limit it is released instead (a refused release is parked: *st says
  // so). true: the pool took it.
  bool give_to_pool(mem_handle h, std::size_t size, status* st = nullptr) {
    if (pool->take_back(h, size)) return true;
    status s = vm::driver::twice([&] { return d.release(h); });
    if (!s.ok()) strays.add_handle(h, size);
    if (st) *st = s;
    return false;
  }
  vm::reservation res;
  chunk_props props;
  std::vector<access_desc> access;  // owner + peers, applied to every chunk with one set_access
  std::vector<chunk> chunks;        // tail order: chunks[i].va == base + sum of earlier sizes
  std::vector<chunk> idle;          // handles a shrink kept (va unused): the last one shrunk at back()
  vm::strays strays;                // refused rollback/release work, retried before the next change
};

growable_buffer::growable_buffer(std::unique_ptr<backend_iface> b, std::size_t capacity_limit,
                                 const growable_options& o)
    : opt_(o), limit_(capacity_limit) {
  if (!b) throw error(fail(errc::invalid_value, "growable_buffer", "no backend"), "vmm::growable_buffer: no backend");
  p_ = std::make_unique<impl>(std::move(b));
  open(0);
}

growable_buffer::growable_buffer(std::unique_ptr<impl> m, std::size_t capacity_limit, const growable_options& o,
                                 std::size_t min_granularity)
    : p_(std::move(m)), opt_(o), limit_(capacity_limit) {
  open(min_granularity);
}

void growable_buffer::open(std::size_t min_granularity) {
  const char* ctx = "vmm::growable_buffer";
  if (limit_ == 0)
    throw error(fail(errc::invalid_value, "growable_buffer", "capacity_limit is 0"),
                std::string(ctx) + ": capacity_limit must be > 0");
  impl& m = *p_;
  m.props.location = location_kind::device;
  m.props.id = opt_.device;
  m.access.push_back({opt_.device, access_mode::read_write});
  for (const auto& p : opt_.peers)
    if (p.device != opt_.device) m.access.push_back(p);

  // Granularity: the largest among the devices that will access the chunks (the arena's rule).
  std::string why;
  auto g = vm::granularity_for(m.d, m.props, m.access, &why);
  if (!g.ok()) throw_status(g.st, std::string(ctx) + ": " + why);
  gran_ = g.value;
  if (min_granularity) {  // shared: the allocator's handles must map at this buffer's granularity
    if (gran_ > min_granularity)
      throw error(fail(errc::invalid_value, "growable_buffer", "peer granularity larger than the allocator's"),
                  std::string(ctx) + ": a peer needs a granularity of " + mib(gran_) + ", the allocator's is " +
                      mib(min_granularity) + " (name the peer in the allocator's options.peers)");
    gran_ = min_granularity;
  }
  if (limit_ > std::numeric_limits<std::size_t>::max() - gran_)
    throw out_of_memory(fail(errc::out_of_memory, "growable_buffer", "capacity_limit too large"),
                        std::string(ctx) + ": capacity_limit too large");
  opt_.min_chunk = round_up(std::max(opt_.min_chunk, gran_), gran_);

  // The one reservation: ~3 us on the driver even for 64 TiB, so reserving the limit up front
  // costs nothing and is what makes data() stable.
  reserved_ = round_up(limit_, gran_);
  if (status s = m.res.open(m.d, reserved_, gran_); !s.ok())
    throw_status(s, std::string(ctx) + ": reserving " + mib(reserved_) + " of address space");
  base_ = m.res.base();
}

growable_buffer growable_buffer::shared(allocator& a, std::size_t capacity_limit, growable_options o) {
  const options& ao = a.opts();
  const char* ctx = "vmm::growable_buffer::shared";
  const char* why = nullptr;
  if (ao.location != location_kind::device) why = "the allocator's memory is not device memory";
  else if (ao.compression != compression_mode::off) why = "the allocator's memory is compressible";
  else if (ao.ipc != ipc_kind::none) why = "the allocator's memory is exportable (ipc)";
  if (why) throw error(fail(errc::invalid_value, "growable_buffer", why), std::string(ctx) + ": " + why);
  o.device = ao.device;
  return growable_buffer(std::make_unique<impl>(allocator_access::pool(a)), capacity_limit, o, a.granularity());
}

growable_buffer growable_buffer::host(std::size_t capacity_limit, const host_backend_options& h,
                                      const growable_options& o) {
  return growable_buffer(make_backend<host_backend>(h), capacity_limit, o);
}

growable_buffer growable_buffer::cuda(std::size_t capacity_limit, int device, growable_options o) {
  auto m = std::make_unique<backend_model<cuda_backend>>(device);
  if (!m->get().available()) throw error(m->get().load_status(), m->get().load_message());
  o.device = device;
  return growable_buffer(std::move(m), capacity_limit, o);
}

growable_buffer::~growable_buffer() { destroy(); }

growable_buffer::growable_buffer(growable_buffer&& o) noexcept
    : p_(std::move(o.p_)),
      opt_(std::move(o.opt_)),
      gran_(std::exchange(o.gran_, 0)),
      limit_(std::exchange(o.limit_, 0)),
      reserved_(std::exchange(o.reserved_, 0)),
      base_(std::exchange(o.base_, 0)),
      size_(std::exchange(o.size_, 0)),
      mapped_(std::exchange(o.mapped_, 0)),
      chunks_(std::exchange(o.chunks_, 0)),
      idle_(std::exchange(o.idle_, 0)) {}

growable_buffer& growable_buffer::operator=(growable_buffer&& o) noexcept {
  if (this == &o) return *this;
  destroy();
  p_ = std::move(o.p_);
  opt_ = std::move(o.opt_);
  gran_ = std::exchange(o.gran_, 0);
  limit_ = std::exchange(o.limit_, 0);
  reserved_ = std::exchange(o.reserved_, 0);
  base_ = std::exchange(o.base_, 0);
  size_ = std::exchange(o.size_, 0);
  mapped_ = std::exchange(o.mapped_, 0);
  chunks_ = std::exchange(o.chunks_, 0);
  idle_ = std::exchange(o.idle_, 0);
  return *this;
}

driver_counts growable_buffer::counts() const { return p_ ? p_->d.counts() : driver_counts{}; }
backend_iface& growable_buffer::backend() noexcept { return *p_->bp; }

void growable_buffer::destroy() noexcept {
  if (!p_) return;
  impl& m = *p_;
  // Teardown cannot report errors: each call is made once more if refused (a driver that refuses
  // once must not leak a handle, a mapping or the reservation). Tail first, the reverse of growth.
  bool mapped = false;  // something the driver would not unmap: the reservation stays
  for (auto it = m.chunks.rbegin(); it != m.chunks.rend(); ++it) {
    if (!vm::driver::twice([&] { return m.d.unmap(it->va, it->size); }).ok()) {
      mapped = true;  // cannot be reused
      continue;
    }
    if (m.pool) (void)m.give_to_pool(it->handle, it->size);  // shared: the allocator's to map again
    else (void)vm::driver::twice([&] { return m.d.release(it->handle); });
  }
  m.chunks.clear();
  for (const impl::chunk& c : m.idle) (void)vm::driver::twice([&] { return m.d.release(c.handle); });
  m.idle.clear();
  (void)m.strays.retry(m.d);
  (void)m.res.close(mapped || m.strays.holds_mappings());
  p_.reset();
  base_ = 0;
  size_ = mapped_ = reserved_ = chunks_ = idle_ = 0;
}

void growable_buffer::resize(std::size_t n) {
  if (!p_) throw error(fail(errc::invalid_value, "growable_buffer", "moved-from"), "vmm::growable_buffer::resize: moved-from buffer");
  if (n > limit_)
    throw out_of_memory(fail(errc::out_of_memory, "growable_buffer", "capacity limit exceeded"),
                        "vmm::growable_buffer::resize: " + mib(n) + " exceeds the capacity limit of " +
                            mib(limit_) + " (the reservation made at construction)");
  if (n > mapped_) {
    grow_to(n, "vmm::growable_buffer::resize");
    size_ = n;
    return;
  }
  const std::size_t old = size_;
  size_ = n;
  if (n < old) trim_to(n, "vmm::growable_buffer::resize");
}

void growable_buffer::reserve(std::size_t n) {
  if (!p_) throw error(fail(errc::invalid_value, "growable_buffer", "moved-from"), "vmm::growable_buffer::reserve: moved-from buffer");
  if (n > limit_)
    throw out_of_memory(fail(errc::out_of_memory, "growable_buffer", "capacity limit exceeded"),
                        "vmm::growable_buffer::reserve: " + mib(n) + " exceeds the capacity limit of " +
                            mib(limit_) + " (the reservation made at construction)");
  if (n > mapped_) grow_to(n, "vmm::growable_buffer::reserve");
}

void growable_buffer::shrink_to_fit() {
  if (!p_) return;
  trim_to(size_, "vmm::growable_buffer::shrink_to_fit");
}

void growable_buffer::release_idle() {
  if (!p_) return;
  impl& m = *p_;
  status err{};
  for (const impl::chunk& c : m.idle) {
    status s = vm::driver::twice([&] { return m.d.release(c.handle); });
    if (!s.ok()) {
      m.strays.add_handle(c.handle, c.size);
      if (err.ok()) err = s;
    }
  }
  m.idle.clear();
  idle_ = 0;
  if (!err.ok())
    throw error(err, "vmm::growable_buffer::release_idle: a release was refused (parked, retried later): " +
                         err.message());
}

void growable_buffer::grow_to(std::size_t n, const char* what) {
  impl& m = *p_;
  // A mapping a refused rollback left at the tail would block the map below: retry it first.
  if (!m.strays.empty()) {
    status s = m.strays.retry(m.d);
    if (!s.ok()) throw_status(s, std::string(what) + ": undoing an earlier failed step");
  }
  const std::size_t need = round_up(n, gran_) - mapped_;  // n <= limit_, so this fits the reservation
  const std::uintptr_t va = base_ + mapped_;
  auto ctx = [&](std::size_t bytes) {
    return std::string(what) + ": mapping " + mib(bytes) + " at offset " + mib(mapped_);
  };

  // Pieces, in order: handles a shrink kept (in the order they left the tail: a map each, no
  // create; they always fit, as mapped + kept bytes never exceed the reservation), the
  // allocator's idle handles when shared (largest first, at most 8), then one created handle for
  // the rest: one driver round, whatever the size.
  std::vector<vm::piece> pieces;
  std::vector<mem_handle> from_pool;
  std::size_t got = 0;
  while (got < need && !m.idle.empty()) {
    const impl::chunk c = m.idle.back();
    m.idle.pop_back();
    idle_ -= c.size;
    pieces.push_back({c.size, c.handle});
    got += c.size;
  }
  for (int k = 0; m.pool && k < 8 && got < need; ++k) {
    mem_handle h = 0;
    std::size_t n = 0;
    if (!m.pool->lend(need - got, h, n)) break;
    pieces.push_back({n, h});
    from_pool.push_back(h);
    got += n;
  }
  // A failure undoes every map (vm::mapping_txn): the created handle is released, the kept ones
  // go back to the idle list, the lent ones to the allocator.
  vm::mapping_txn txn(m.d, m.strays);
  auto undo = [&](const status& st, std::size_t bytes) {
    txn.rollback();
    for (const auto& l : txn.returned()) {
      if (std::find(from_pool.begin(), from_pool.end(), l.h) != from_pool.end()) m.give_to_pool(l.h, l.size);
      else m.idle.push_back({0, l.size, l.h});
    }
    txn.returned().clear();
    idle_ = 0;
    for (const impl::chunk& c : m.idle) idle_ += c.size;
    throw_status(st, ctx(bytes));
  };
  if (got < need) {
    const std::size_t rest = need - got;
    std::size_t want = std::max(rest, opt_.min_chunk);
    if (opt_.geometric) want = std::max(want, round_up((mapped_ + got) / 2, gran_));
    want = std::min(want, reserved_ - mapped_ - got);  // never past the reservation (still >= rest)
    auto h = m.d.create(want, m.props);
    if (!h.ok() && h.st.kind == errc::out_of_memory && want > rest) {
      // The policy's larger chunk does not fit; the exact need still might.
      want = rest;
      h = m.d.create(want, m.props);
    }
    if (!h.ok()) {  // nothing mapped yet: every piece is a lent one to hand back
      for (const vm::piece& p : pieces) txn.returned().push_back({p.h, p.size});
      undo(h.st, want);
    }
    pieces.push_back({want, h.value, true});
    got += want;
  }
  if (status st = txn.place(va, pieces, m.access); !st.ok()) undo(st, got);
  txn.commit();
  std::uintptr_t at = va;
  for (const vm::piece& p : pieces) {
    m.chunks.push_back({at, p.size, p.h});
    at += p.size;
  }
  mapped_ += got;
  chunks_ = m.chunks.size();
}

void growable_buffer::trim_to(std::size_t n, const char* what) {
  impl& m = *p_;
  const std::uintptr_t keep_end = base_ + round_up(n, gran_);
  status err{};
  if (!m.strays.empty()) err = m.strays.retry(m.d);
  // Tail first: only whole chunks past the end go (cuMemUnmap unmaps exactly one map()'s range).
  while (!m.chunks.empty() && m.chunks.back().va >= keep_end) {
    const impl::chunk c = m.chunks.back();
    status s = vm::driver::twice([&] { return m.d.unmap(c.va, c.size); });
    if (!s.ok()) {
      err = s;  // still mapped and usable; stays a chunk of this buffer
      break;
    }
    m.chunks.pop_back();
    mapped_ -= c.size;
    if (m.pool) {
      if (m.give_to_pool(c.handle, c.size, &s)) continue;
      if (!s.ok() && err.ok()) err = s;
      continue;
    }
    if (idle_ + c.size <= opt_.keep_idle) {  // kept for the next growth: no release now
      m.idle.push_back({0, c.size, c.handle});
      idle_ += c.size;
      continue;
    }
    // After the unmap the VA is free; the physical memory returns with the release.
    s = vm::driver::twice([&] { return m.d.release(c.handle); });
    if (!s.ok()) {
      m.strays.add_handle(c.handle, c.size);
      if (err.ok()) err = s;
    }
  }
  chunks_ = m.chunks.size();
  if (!err.ok())
    throw error(err, std::string(what) + ": size is now " + mib(size_) +
                         ", but returning memory was refused (kept, retried later): " + err.message());
}

}  // namespace vmm
