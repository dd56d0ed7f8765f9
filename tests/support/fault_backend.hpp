// SPDX-License-Identifier: Apache-2.0
// fault_backend: a vmm::backend_iface decorator for tests. Header-only.
//
//  * Forwards every call to an inner backend (normally a host_backend).
//  * Counts calls per operation kind.
//  * Fails the k-th call of one operation kind (k counted from arm(), 1-based) with the CUDA
//    driver's real error: CUDA_ERROR_OUT_OF_MEMORY (2), CUDA_ERROR_INVALID_VALUE (1) or
//    CUDA_ERROR_NOT_PERMITTED (800), named after the driver function ("cuMemCreate", ...).
//    One-shot (only the k-th call fails) or sticky (the k-th and every later call of that kind
//    fail until disarm()). An injected failure is NOT forwarded: like a driver that refused, the
//    inner backend's state is untouched.
//  * A combined fault (arm_then): when the first fault fires, a second one is armed at once on
//    another operation kind, failing its next `times` calls: a failure inside the rollback of the
//    first (a refused unmap or release while undoing a map). times 1 is absorbed by the rollback's
//    one retry (vm::driver::twice); times 2 refuses both attempts, so the work is parked as a stray;
//    then_sticky refuses every call until disarm().
//  * Keeps its own live counts of handles (create/import minus release), mappings (map minus
//    unmap) and reservations (reserve minus free_reservation), counting successful calls only.
//    They live in a shared fault_state the test keeps, so they stay readable after the allocator
//    (which owns the backend) is destroyed: that is the leak check.
//
// Only operations that return a status can fail: granularity, reserve, free_reservation, create,
// release, query, map, unmap, set_access, export_handle, import_handle, record_fence, wait_fence,
// mem_info. fence_done / drop_fence / can_access_peer / name / capabilities are forwarded as is.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "vmmalloc/backend.hpp"
#include "vmmalloc/host_backend.hpp"

namespace vmm::test {

enum class op : int {
  granularity,
  reserve,
  free_reservation,
  create,
  release,
  query,
  map,
  unmap,
  set_access,
  export_handle,
  import_handle,
  record_fence,
  wait_fence,
  mem_info,
};
inline constexpr int op_count = 14;

inline const char* op_name(op o) {
  static constexpr const char* n[op_count] = {
      "granularity", "reserve",       "free_reservation", "create",       "release",
      "query",       "map",           "unmap",            "set_access",   "export_handle",
      "import_handle", "record_fence", "wait_fence",      "mem_info"};
  return n[static_cast<int>(o)];
}

// The driver function each operation stands for (status::op of an injected failure).
inline const char* driver_function(op o) {
  static constexpr const char* n[op_count] = {
      "cuMemGetAllocationGranularity", "cuMemAddressReserve",   "cuMemAddressFree",
      "cuMemCreate",                   "cuMemRelease",          "cuMemGetAllocationPropertiesFromHandle",
      "cuMemMap",                      "cuMemUnmap",            "cuMemSetAccess",
      "cuMemExportToShareableHandle",  "cuMemImportFromShareableHandle",
      "cuEventRecord",                 "cuEventSynchronize",    "cuMemGetInfo"};
  return n[static_cast<int>(o)];
}

// The three driver errors injected, with their real CUresult codes and names.
enum class fault : int { out_of_memory, invalid_value, not_permitted };
inline constexpr int fault_count = 3;

inline const char* fault_name(fault f) {
  switch (f) {
    case fault::out_of_memory: return "CUDA_ERROR_OUT_OF_MEMORY";
    case fault::invalid_value: return "CUDA_ERROR_INVALID_VALUE";
    case fault::not_permitted: return "CUDA_ERROR_NOT_PERMITTED";
  }
  return "?";
}
inline int fault_code(fault f) {
  switch (f) {
    case fault::out_of_memory: return 2;    // CUDA_ERROR_OUT_OF_MEMORY
    case fault::invalid_value: return 1;    // CUDA_ERROR_INVALID_VALUE
    case fault::not_permitted: return 800;  // CUDA_ERROR_NOT_PERMITTED
  }
  return 999;
}
inline errc fault_errc(fault f) {
  switch (f) {
    case fault::out_of_memory: return errc::out_of_memory;
    case fault::invalid_value: return errc::invalid_value;
    case fault::not_permitted: return errc::not_permitted;
  }
  return errc::other;
}
inline status driver_error(fault f, op o) {
  return {fault_errc(f), fault_code(f), fault_name(f), driver_function(o)};
}

// Shared between the decorator (owned by the allocator) and the test. Thread-safe.
class fault_state {
 public:
  // Fail the k-th call (1-based, counted from now) of `which` with `f`; sticky: that call and
  // every later call of the same kind until disarm().
  void arm(op which, std::uint64_t k, fault f, bool sticky = false) {
    std::lock_guard g(mu_);
    armed_ = true;
    which_ = which;
    k_ = k;
    fault_ = f;
    sticky_ = sticky;
    since_arm_ = 0;
  }
  // Like arm(which, k, f) (one-shot), and when that fault fires, `then` fails its next `times`
  // calls with `f2` (then_sticky: every later call until disarm()).
  static constexpr std::uint64_t then_sticky = ~std::uint64_t{0};
  void arm_then(op which, std::uint64_t k, fault f, op then, fault f2, std::uint64_t times = 2) {
    std::lock_guard g(mu_);
    armed_ = true;
    which_ = which;
    k_ = k;
    fault_ = f;
    sticky_ = false;
    since_arm_ = 0;
    has_then_ = true;
    then_live_ = false;
    then_which_ = then;
    then_fault_ = f2;
    then_times_ = times;
  }
  // Disarms both the fault and a pending second fault.
  void disarm() {
    std::lock_guard g(mu_);
    armed_ = false;
    has_then_ = then_live_ = false;
  }
  bool armed() const {
    std::lock_guard g(mu_);
    return armed_ || then_live_;
  }
  // Failures of the second fault of arm_then (0 when it never fired).
  std::uint64_t injected_then() const { return injected_then_.load(); }
  // Whether s is one of the failures injected since this state was made (what a caller may see).
  bool was_injected(const status& s) const {
    std::lock_guard g(mu_);
    for (const auto& x : log_)
      if (x.kind == s.kind && x.code == s.code && std::string(x.name) == s.name && std::string(x.op) == s.op)
        return true;
    return false;
  }

  std::uint64_t calls(op o) const { return calls_[static_cast<int>(o)].load(); }
  std::array<std::uint64_t, op_count> all_calls() const {
    std::array<std::uint64_t, op_count> a{};
    for (int i = 0; i < op_count; ++i) a[i] = calls_[i].load();
    return a;
  }
  std::uint64_t injected() const { return injected_.load(); }
  status last_injected() const {
    std::lock_guard g(mu_);
    return last_;
  }

  // Live objects created through the decorator and not yet destroyed through it.
  std::int64_t live_handles() const { return handles_.load(); }
  std::int64_t live_mappings() const {
    std::lock_guard g(map_mu_);
    return static_cast<std::int64_t>(map_starts_.size());
  }
  std::int64_t live_reservations() const { return reservations_.load(); }
  bool nothing_live() const { return !live_handles() && !live_mappings() && !live_reservations(); }

  // --- used by fault_backend ---
  // Counts the call; returns true (and the error in `out`) when it must fail.
  bool on_call(op o, status& out) {
    calls_[static_cast<int>(o)].fetch_add(1);
    std::lock_guard g(mu_);
    if (then_live_ && o == then_which_) {  // the second fault of arm_then
      if (then_times_ != then_sticky && --then_times_ == 0) then_live_ = has_then_ = false;
      out = driver_error(then_fault_, o);
      note(out);
      injected_then_.fetch_add(1);
      return true;
    }
    if (!armed_ || o != which_) return false;
    ++since_arm_;
    if (since_arm_ < k_) return false;
    if (since_arm_ > k_ && !sticky_) return false;
    if (!sticky_) armed_ = false;  // spent
    out = driver_error(fault_, o);
    note(out);
    if (has_then_ && then_times_) then_live_ = true;
    return true;
  }
  std::atomic<std::int64_t> handles_{0}, reservations_{0};
  // Where the mappings start: one unmap may take several side by side (as cuMemUnmap does).
  void mapped(std::uintptr_t va) {
    std::lock_guard g(map_mu_);
    map_starts_.insert(va);
  }
  void unmapped(std::uintptr_t va, std::size_t n) {
    std::lock_guard g(map_mu_);
    map_starts_.erase(map_starts_.lower_bound(va), map_starts_.lower_bound(va + n));
  }
  mutable std::mutex map_mu_;
  std::set<std::uintptr_t> map_starts_;
  // The host backend under the decorator (set by fault_backend): its test controls (hold_stream,
  // live counts) stay reachable through the state the test keeps.
  host_backend* host = nullptr;

 private:
  void note(const status& s) {  // under mu_
    last_ = s;
    bool seen = false;
    for (const auto& x : log_) seen = seen || (x.code == s.code && std::string(x.op) == s.op);
    if (!seen) log_.push_back(s);
    injected_.fetch_add(1);
  }

  mutable std::mutex mu_;
  bool armed_ = false, sticky_ = false;
  op which_ = op::create;
  std::uint64_t k_ = 0, since_arm_ = 0;
  fault fault_ = fault::out_of_memory;
  bool has_then_ = false, then_live_ = false;
  op then_which_ = op::release;
  fault then_fault_ = fault::out_of_memory;
  std::uint64_t then_times_ = 0;
  status last_{};
  std::vector<status> log_;  // distinct injected failures (statuses hold static strings)
  std::array<std::atomic<std::uint64_t>, op_count> calls_{};
  std::atomic<std::uint64_t> injected_{0}, injected_then_{0};
};

class fault_backend final : public forwarding_backend {
 public:
  fault_backend(std::unique_ptr<backend_iface> inner, std::shared_ptr<fault_state> st)
      : forwarding_backend(std::move(inner)), in_(&this->inner()), st_(std::move(st)) {
    st_->host = backend_cast<host_backend>(*in_);  // the newest decorator on this state
  }

  // Over a backend the test keeps (not owned: it must outlive this decorator), so that its live
  // counts stay readable after the owner of the decorator is destroyed.
  fault_backend(backend_iface& inner, std::shared_ptr<fault_state> st)
      : forwarding_backend(inner), in_(&this->inner()), st_(std::move(st)) {
    st_->host = backend_cast<host_backend>(*in_);
  }

  fault_state& state() { return *st_; }
  // The inner host backend (test controls: hold_stream, live counts), or null.
  host_backend* host() { return backend_cast<host_backend>(*in_); }

  result<granularity_info> granularity(const chunk_props& p) override {
    status e;
    if (st_->on_call(op::granularity, e)) return {{}, e};
    return in_->granularity(p);
  }
  result<std::uintptr_t> reserve(std::size_t n, std::size_t a) override {
    status e;
    if (st_->on_call(op::reserve, e)) return {0, e};
    auto r = in_->reserve(n, a);
    if (r.ok()) ++st_->reservations_;
    return r;
  }
  status free_reservation(std::uintptr_t va, std::size_t n) override {
    status e;
    if (st_->on_call(op::free_reservation, e)) return e;
    status s = in_->free_reservation(va, n);
    if (s.ok()) --st_->reservations_;
    return s;
  }
  result<mem_handle> create(std::size_t n, const chunk_props& p) override {
    status e;
    if (st_->on_call(op::create, e)) return {0, e};
    auto r = in_->create(n, p);
    if (r.ok()) ++st_->handles_;
    return r;
  }
  status release(mem_handle h) override {
    status e;
    if (st_->on_call(op::release, e)) return e;
    status s = in_->release(h);
    if (s.ok()) --st_->handles_;
    return s;
  }
  result<chunk_info> query(mem_handle h) override {
    status e;
    if (st_->on_call(op::query, e)) return {{}, e};
    return in_->query(h);
  }
  status map(std::uintptr_t va, std::size_t n, mem_handle h, std::size_t off) override {
    status e;
    if (st_->on_call(op::map, e)) return e;
    status s = in_->map(va, n, h, off);
    if (s.ok()) st_->mapped(va);
    return s;
  }
  status unmap(std::uintptr_t va, std::size_t n) override {
    status e;
    if (st_->on_call(op::unmap, e)) return e;
    status s = in_->unmap(va, n);
    if (s.ok()) st_->unmapped(va, n);
    return s;
  }
  status set_access(std::uintptr_t va, std::size_t n, std::span<const access_desc> a) override {
    status e;
    if (st_->on_call(op::set_access, e)) return e;
    return in_->set_access(va, n, a);
  }
  result<shareable_handle> export_handle(mem_handle h, ipc_kind k) override {
    status e;
    if (st_->on_call(op::export_handle, e)) return {{}, e};
    return in_->export_handle(h, k);
  }
  result<mem_handle> import_handle(const shareable_handle& s) override {
    status e;
    if (st_->on_call(op::import_handle, e)) return {0, e};
    auto r = in_->import_handle(s);
    if (r.ok()) ++st_->handles_;
    return r;
  }
  result<fence_t> record_fence(stream_t s) override {
    status e;
    if (st_->on_call(op::record_fence, e)) return {0, e};
    return in_->record_fence(s);
  }
  status wait_fence(fence_t f) override {
    status e;
    if (st_->on_call(op::wait_fence, e)) return e;
    return in_->wait_fence(f);
  }
  result<memory_info> mem_info() override {
    status e;
    if (st_->on_call(op::mem_info, e)) return {{}, e};
    return in_->mem_info();
  }

 private:
  backend_iface* in_;
  std::shared_ptr<fault_state> st_;
};

// A fault-injecting host backend: make_fault_host(state, {.physical_limit = ...}).
inline std::unique_ptr<backend_iface> make_fault_host(std::shared_ptr<fault_state> st,
                                                      const host_backend_options& h = {}) {
  return std::make_unique<fault_backend>(make_backend<host_backend>(h), std::move(st));
}

// A fault-injecting decorator over a host backend the test keeps (see fault_backend's second
// constructor): `host` must outlive what the result is given to.
inline std::unique_ptr<backend_iface> make_fault_over(backend_iface& host, std::shared_ptr<fault_state> st) {
  return std::make_unique<fault_backend>(host, std::move(st));
}

// The decorator inside a growable_buffer's or kv_cache's backend() (null if it is something else).
inline fault_backend* as_fault(backend_iface& b) { return dynamic_cast<fault_backend*>(&b); }

}  // namespace vmm::test
