// SPDX-License-Identifier: Apache-2.0
// vm::driver: counting. See driver.hpp.
#include "vm/driver.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>

namespace vmm::vm {

namespace {
thread_local driver::scope* tl_scope = nullptr;
}

driver::scope::scope(std::uint64_t& calls, std::uint64_t& failures) noexcept
    : calls_(calls), failures_(failures), outer_(tl_scope) {
  tl_scope = this;
}

driver::scope::~scope() { tl_scope = outer_; }

void driver::bump(std::atomic<std::uint64_t>& c) noexcept {
  c.fetch_add(1, std::memory_order_relaxed);
  if (tl_scope) ++tl_scope->calls_;
}

void driver::failed() noexcept {
  n_.failures.fetch_add(1, std::memory_order_relaxed);
  if (tl_scope) ++tl_scope->failures_;
}

driver::claim::claim(driver& d, footprint f) : d_(d) {
  std::unique_lock g(d.claim_mu_);
  auto clashes = [&](const footprint& o) {
    if (f.n && o.n && f.va < o.va + o.n && o.va < f.va + f.n) return true;
    for (mem_handle x : f.hs)
      for (mem_handle y : o.hs)
        if (x == y) return true;
    return false;
  };
  d.claim_cv_.wait(g, [&] {
    for (const footprint& o : d.inflight_)
      if (clashes(o)) return false;
    return true;
  });
  it_ = d.inflight_.insert(d.inflight_.end(), std::move(f));
}

driver::claim::~claim() {
  {
    std::lock_guard g(d_.claim_mu_);
    d_.inflight_.erase(it_);
  }
  d_.claim_cv_.notify_all();
}

driver::footprint driver::under(std::uintptr_t va, std::size_t n) const {
  footprint f{va, n, {}};
  auto it = mapped_.upper_bound(va);
  if (it != mapped_.begin()) --it;
  for (; it != mapped_.end() && it->first < va + n; ++it)
    if (it->first + it->second.first > va) f.hs.push_back(it->second.second);
  return f;
}

status driver::map(std::uintptr_t va, std::size_t n, mem_handle h, std::size_t off) {
  claim c(*this, {va, n, {h}});
  status st;
  {
    relaxed r(*this, n_.ns);
    st = note(n_.map, b_->map(va, n, h, off));
  }
  if (st.ok()) {
    std::lock_guard g(claim_mu_);
    mapped_[va] = {n, h};
  }
  return st;
}

status driver::unmap(std::uintptr_t va, std::size_t n) {
  footprint f;
  {
    std::lock_guard g(claim_mu_);
    f = under(va, n);
  }
  claim c(*this, std::move(f));
  status st;
  {
    relaxed r(*this, n_.ns);
    st = note(n_.unmap, b_->unmap(va, n));
  }
  if (st.ok()) {
    std::lock_guard g(claim_mu_);
    mapped_.erase(va);
  }
  return st;
}

status driver::set_access(std::uintptr_t va, std::size_t n, std::span<const access_desc> a) {
  footprint f;
  {
    std::lock_guard g(claim_mu_);
    f = under(va, n);
  }
  claim c(*this, std::move(f));
  relaxed r(*this, n_.ns);
  return note(n_.set_access, b_->set_access(va, n, a));
}

status driver::free_reservation(std::uintptr_t va, std::size_t n) {
  claim c(*this, {va, n, {}});
  relaxed r(*this, n_.ns);
  return note(n_.free_reservation, b_->free_reservation(va, n));
}

driver::~driver() {
  for (auto& [h, e] : exported_) ::close(e.fd);
}

status driver::release(mem_handle h) {
  // An exported handle's kept fd goes with it, before another thread's create can be handed the
  // same handle value back (export_mu_ is held across the release then, before the claim).
  std::unique_lock ex(export_mu_, std::defer_lock);
  if (n_exported_.load(std::memory_order_acquire) != 0) ex.lock();
  status st;
  {
    claim c(*this, {0, 0, {h}});
    relaxed r(*this, n_.ns);
    st = note(n_.release, b_->release(h));
  }
  if (st.ok() && ex.owns_lock()) {
    if (auto it = exported_.find(h); it != exported_.end()) {
      ::close(it->second.fd);
      exported_.erase(it);
      n_exported_.fetch_sub(1, std::memory_order_release);
    }
  }
  return st;
}

result<shareable_handle> driver::export_handle(mem_handle h, ipc_kind k) {
  if (k != ipc_kind::posix_fd) {
    claim c(*this, {0, 0, {h}});
    relaxed r(*this, n_.ns);
    return note(n_.export_handle, b_->export_handle(h, k));
  }
  std::lock_guard g(export_mu_);
  auto it = exported_.find(h);
  if (it == exported_.end()) {
    result<shareable_handle> e;
    {
      claim c(*this, {0, 0, {h}});
      relaxed r(*this, n_.ns);
      e = note(n_.export_handle, b_->export_handle(h, k));
    }
    if (!e.ok() || e.value.kind != ipc_kind::posix_fd) return e;
    try {
      // Ids count across every driver of the process: two allocators' chunks never share one.
      static std::atomic<std::uint64_t> next_id{0};
      it = exported_.emplace(h, exported{e.value.fd, next_id.fetch_add(1, std::memory_order_relaxed) + 1})
               .first;  // kept; the caller gets a copy below
    } catch (...) {
      return e;  // no memory for the entry: the caller owns this fd, nothing is cached
    }
    n_exported_.fetch_add(1, std::memory_order_release);
  }
  shareable_handle out;
  out.kind = ipc_kind::posix_fd;
  out.export_id = it->second.id;
  out.fd = ::fcntl(it->second.fd, F_DUPFD_CLOEXEC, 0);
  if (out.fd < 0) {
    const int e = errno;
    return {{}, {errc::other, e, e == EMFILE ? "EMFILE" : "errno", "fcntl(F_DUPFD_CLOEXEC)"}};
  }
  return {out, {}};
}

driver_counts driver::counts() const {
  auto g = [](const std::atomic<std::uint64_t>& a) { return a.load(std::memory_order_relaxed); };
  driver_counts c;
  c.reserve = g(n_.reserve);
  c.free_reservation = g(n_.free_reservation);
  c.create = g(n_.create);
  c.release = g(n_.release);
  c.map = g(n_.map);
  c.unmap = g(n_.unmap);
  c.set_access = g(n_.set_access);
  c.export_handle = g(n_.export_handle);
  c.import_handle = g(n_.import_handle);
  c.granularity = g(n_.granularity);
  c.query = g(n_.query);
  c.mem_info = g(n_.mem_info);
  c.record_fence = g(n_.record_fence);
  c.fence_query = g(n_.fence_query);
  c.wait_fence = g(n_.wait_fence);
  c.failures = g(n_.failures);
  c.ns = g(n_.ns);
  c.fence_ns = g(n_.fence_ns);
  return c;
}

}  // namespace vmm::vm
