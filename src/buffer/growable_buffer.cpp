// growable_buffer: one reservation, chunks mapped and unmapped at its tail. See growable_buffer.hpp.
#include "vmmalloc/cuda_backend.hpp"
#include "vmmalloc/growable_buffer.hpp"

#include <algorithm>
#include <limits>
#include <string>
#include <utility>

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

// Calls f, and once more if the driver refused; counts both attempts and their failures.
template <class F>
static status twice(F&& f, std::uint64_t& counter, std::uint64_t& failures) {
  ++counter;
  status s = f();
  if (s.ok()) return s;
  ++failures;
  ++counter;
  s = f();
  if (!s.ok()) ++failures;
  return s;
}

growable_buffer::growable_buffer(std::unique_ptr<backend_iface> b, std::size_t capacity_limit,
                                 const growable_options& o)
    : b_(std::move(b)), opt_(o), limit_(capacity_limit) {
  const char* ctx = "vmm::growable_buffer";
  if (!b_) throw error(fail(errc::invalid_value, "growable_buffer", "no backend"), std::string(ctx) + ": no backend");
  if (capacity_limit == 0)
    throw error(fail(errc::invalid_value, "growable_buffer", "capacity_limit is 0"),
                std::string(ctx) + ": capacity_limit must be > 0");
  props_.location = location_kind::device;
  props_.id = opt_.device;

  // Granularity: the largest among the devices that will access the chunks (the arena's rule).
  auto g = b_->granularity(props_);
  if (!g.ok()) throw_status(g.st, std::string(ctx) + ": granularity");
  gran_ = g.value.minimum;
  access_.push_back({opt_.device, access_mode::read_write});
  for (const auto& p : opt_.peers) {
    if (p.device == opt_.device) continue;
    if (!b_->can_access_peer(p.device, opt_.device))
      throw error(fail(errc::invalid_value, "growable_buffer", "peer cannot access the owner"),
                  std::string(ctx) + ": device " + std::to_string(p.device) +
                      " cannot access device " + std::to_string(opt_.device));
    chunk_props pp = props_;
    pp.id = p.device;
    auto pg = b_->granularity(pp);
    if (!pg.ok()) throw_status(pg.st, std::string(ctx) + ": granularity of a peer");
    gran_ = std::max(gran_, pg.value.minimum);
    access_.push_back(p);
  }
  if (gran_ == 0) throw error(fail(errc::invalid_value, "growable_buffer", "bad granularity"), std::string(ctx) + ": granularity 0");
  if (capacity_limit > std::numeric_limits<std::size_t>::max() - gran_)
    throw out_of_memory(fail(errc::out_of_memory, "growable_buffer", "capacity_limit too large"),
                        std::string(ctx) + ": capacity_limit too large");
  opt_.min_chunk = round_up(std::max(opt_.min_chunk, gran_), gran_);

  // The one reservation: ~3 us on the driver even for 64 TiB, so reserving the limit up front
  // costs nothing and is what makes data() stable.
  reserved_ = round_up(capacity_limit, gran_);
  ++calls_.reserve;
  auto r = b_->reserve(reserved_, gran_);
  if (!r.ok()) {
    ++calls_.failures;
    throw_status(r.st, std::string(ctx) + ": reserving " + mib(reserved_) + " of address space");
  }
  base_ = r.value;
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
    : b_(std::move(o.b_)),
      opt_(std::move(o.opt_)),
      props_(o.props_),
      access_(std::move(o.access_)),
      gran_(std::exchange(o.gran_, 0)),
      limit_(std::exchange(o.limit_, 0)),
      reserved_(std::exchange(o.reserved_, 0)),
      base_(std::exchange(o.base_, 0)),
      size_(std::exchange(o.size_, 0)),
      mapped_(std::exchange(o.mapped_, 0)),
      chunks_(std::move(o.chunks_)),
      stray_(std::move(o.stray_)),
      calls_(std::exchange(o.calls_, {})) {
  o.chunks_.clear();
  o.stray_.clear();
}

growable_buffer& growable_buffer::operator=(growable_buffer&& o) noexcept {
  if (this == &o) return *this;
  destroy();
  b_ = std::move(o.b_);
  opt_ = std::move(o.opt_);
  props_ = o.props_;
  access_ = std::move(o.access_);
  gran_ = std::exchange(o.gran_, 0);
  limit_ = std::exchange(o.limit_, 0);
  reserved_ = std::exchange(o.reserved_, 0);
  base_ = std::exchange(o.base_, 0);
  size_ = std::exchange(o.size_, 0);
  mapped_ = std::exchange(o.mapped_, 0);
  chunks_ = std::move(o.chunks_);
  stray_ = std::move(o.stray_);
  calls_ = std::exchange(o.calls_, {});
  o.chunks_.clear();
  o.stray_.clear();
  return *this;
}

void growable_buffer::destroy() noexcept {
  if (!b_) return;
  // Teardown cannot report errors: each call is retried once (a driver that refuses once must not
  // leak a handle, a mapping or the reservation). Tail first, the reverse of growth.
  for (auto it = chunks_.rbegin(); it != chunks_.rend(); ++it) {
    twice([&] { return b_->unmap(it->va, it->size); }, calls_.unmap, calls_.failures);
    twice([&] { return b_->release(it->handle); }, calls_.release, calls_.failures);
  }
  chunks_.clear();
  (void)clean_strays();
  stray_.clear();
  if (reserved_)
    twice([&] { return b_->free_reservation(base_, reserved_); }, calls_.free_reservation, calls_.failures);
  b_.reset();
  base_ = 0;
  size_ = mapped_ = reserved_ = 0;
}

status growable_buffer::clean_strays() {
  // Work a refused call left behind: a rollback's mapping, or a handle whose release was refused.
  status first{};
  for (auto it = stray_.begin(); it != stray_.end();) {
    status s{};
    if (it->mapped) {
      s = twice([&] { return b_->unmap(it->va, it->size); }, calls_.unmap, calls_.failures);
      if (s.ok()) it->mapped = false;
    }
    if (s.ok()) s = twice([&] { return b_->release(it->handle); }, calls_.release, calls_.failures);
    if (s.ok()) {
      it = stray_.erase(it);
    } else {
      if (first.ok()) first = s;
      ++it;
    }
  }
  return first;
}

void growable_buffer::resize(std::size_t n) {
  if (!b_) throw error(fail(errc::invalid_value, "growable_buffer", "moved-from"), "vmm::growable_buffer::resize: moved-from buffer");
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
  if (!b_) throw error(fail(errc::invalid_value, "growable_buffer", "moved-from"), "vmm::growable_buffer::reserve: moved-from buffer");
  if (n > limit_)
    throw out_of_memory(fail(errc::out_of_memory, "growable_buffer", "capacity limit exceeded"),
                        "vmm::growable_buffer::reserve: " + mib(n) + " exceeds the capacity limit of " +
                            mib(limit_) + " (the reservation made at construction)");
  if (n > mapped_) grow_to(n, "vmm::growable_buffer::reserve");
}

void growable_buffer::shrink_to_fit() {
  if (!b_) return;
  trim_to(size_, "vmm::growable_buffer::shrink_to_fit");
}

void growable_buffer::grow_to(std::size_t n, const char* what) {
  // A mapping a refused rollback left at the tail would block the map below: retry it first.
  if (!stray_.empty()) {
    status s = clean_strays();
    if (!s.ok()) throw_status(s, std::string(what) + ": undoing an earlier failed step");
  }
  const std::size_t need = round_up(n, gran_) - mapped_;  // n <= limit_, so this fits the reservation
  // One chunk for the whole growth: one driver round, whatever the size.
  std::size_t want = std::max(need, opt_.min_chunk);
  if (opt_.geometric) want = std::max(want, round_up(mapped_ / 2, gran_));
  want = std::min(want, reserved_ - mapped_);  // never past the reservation (still >= need)
  const std::uintptr_t va = base_ + mapped_;
  auto ctx = [&](std::size_t bytes) {
    return std::string(what) + ": mapping " + mib(bytes) + " at offset " + mib(mapped_);
  };

  ++calls_.create;
  auto h = b_->create(want, props_);
  if (!h.ok() && h.st.kind == errc::out_of_memory && want > need) {
    // The policy's larger chunk does not fit; the exact need still might.
    ++calls_.failures;
    want = need;
    ++calls_.create;
    h = b_->create(want, props_);
  }
  if (!h.ok()) {
    ++calls_.failures;
    throw_status(h.st, ctx(want));
  }

  ++calls_.map;
  status st = b_->map(va, want, h.value, 0);
  if (!st.ok()) {
    ++calls_.failures;
    if (!twice([&] { return b_->release(h.value); }, calls_.release, calls_.failures).ok())
      stray_.push_back({va, want, h.value, false});
    throw_status(st, ctx(want));
  }

  // The chunk has no access until this call grants it (cuMemMap's rule); one call for all devices.
  ++calls_.set_access;
  st = b_->set_access(va, want, access_);
  if (!st.ok()) {
    ++calls_.failures;
    chunk c{va, want, h.value, true};
    if (twice([&] { return b_->unmap(va, want); }, calls_.unmap, calls_.failures).ok()) {
      c.mapped = false;
      if (twice([&] { return b_->release(h.value); }, calls_.release, calls_.failures).ok()) c.size = 0;
    }
    if (c.size) stray_.push_back(c);
    throw_status(st, ctx(want));
  }

  chunks_.push_back({va, want, h.value, true});
  mapped_ += want;
}

void growable_buffer::trim_to(std::size_t n, const char* what) {
  const std::uintptr_t keep_end = base_ + round_up(n, gran_);
  status err{};
  if (!stray_.empty()) err = clean_strays();
  // Tail first: only whole chunks past the end go (cuMemUnmap unmaps exactly one map()'s range).
  while (!chunks_.empty() && chunks_.back().va >= keep_end) {
    const chunk c = chunks_.back();
    status s = twice([&] { return b_->unmap(c.va, c.size); }, calls_.unmap, calls_.failures);
    if (!s.ok()) {
      err = s;  // still mapped and usable; stays a chunk of this buffer
      break;
    }
    chunks_.pop_back();
    mapped_ -= c.size;
    // After the unmap the VA is free; the physical memory returns with the release.
    s = twice([&] { return b_->release(c.handle); }, calls_.release, calls_.failures);
    if (!s.ok()) {
      stray_.push_back({c.va, c.size, c.handle, false});
      if (err.ok()) err = s;
    }
  }
  if (!err.ok())
    throw error(err, std::string(what) + ": size is now " + mib(size_) +
                         ", but returning memory was refused (kept, retried later): " + err.message());
}

}  // namespace vmm
