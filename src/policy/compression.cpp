// SPDX-License-Identifier: Apache-2.0
// Compression policy (options.compression): compressible chunks are never mixed with plain ones.
// The driver treats compression as a hint, so what it granted is read back after every create and
// map (one cuMemGetAllocationPropertiesFromHandle, only when compression was asked for).
#include <atomic>

#include "policy/policy.hpp"

namespace vmm::policy {

namespace {
class compression final : public policy {
 public:
  status open(vm::driver& d, const options& o, state& s) override {
    s.props.compressible = o.compression != compression_mode::off;
    if (s.props.compressible && !(d.capabilities() & cap_compression)) {
      if (o.compression == compression_mode::require)
        return {errc::not_supported, 0, "compression not supported by this device", "arena"};
      s.props.compressible = false;  // prefer: fall back, counted
      ++s.compression_fallbacks;
    }
    return {};
  }
  status created(vm::driver& d, const options& o, state& s, mem_handle h) override {
    if (!s.props.compressible || granted(d, h)) return {};
    if (o.compression == compression_mode::require)
      return {errc::not_supported, 0, "compression requested but not granted", "cuMemCreate"};
    ++s.compression_fallbacks;  // a job's own copy of the state (arena::run), merged at commit
    return {};
  }
  bool mapped(vm::driver& d, const state& s, mem_handle h) override { return s.props.compressible && granted(d, h); }

 private:
  static bool granted(vm::driver& d, mem_handle h) {
    auto q = d.query(h);
    return q.ok() && q.value.compressible;
  }
};
}  // namespace

std::unique_ptr<policy> make_compression() { return std::make_unique<compression>(); }

}  // namespace vmm::policy
