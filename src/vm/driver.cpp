// SPDX-License-Identifier: Apache-2.0
// vm::driver: counting. See driver.hpp.
#include "vm/driver.hpp"

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
