// SPDX-License-Identifier: Apache-2.0
// IPC policy (options.ipc): exportable chunks. Every allocation owns whole chunks, so an export
// never shares a neighbour's bytes (placement), unless tuning::ipc_whole_chunks is off (the
// PyTorch integration: tensors share chunks, as PyTorch's own sharing does). Fabric handles need an IMEX channel: where the
// device or the driver refuses them, POSIX fds are used instead, as NCCL does (counted).
#include "policy/policy.hpp"

namespace vmm::policy {

namespace {
class ipc final : public policy {
 public:
  status open(vm::driver& d, const options& o, state& s) override {
    const unsigned caps = d.capabilities();
    posix_ok_ = caps & cap_export_posix_fd;
    s.props.ipc = o.ipc;
    if (s.props.ipc == ipc_kind::fabric && !(caps & cap_export_fabric)) {
      s.props.ipc = ipc_kind::posix_fd;
      ++s.ipc_fallbacks;
    }
    if (s.props.ipc == ipc_kind::posix_fd && !(caps & cap_export_posix_fd))
      return {errc::not_supported, 0, "POSIX fd export not supported by this device", "arena"};
    return {};
  }
  bool retry(const options&, state& s, const status& st) override {
    // Without an IMEX channel the driver refuses fabric handles (NOT_PERMITTED): fall back to POSIX
    // fds for this and every later chunk.
    if (s.props.ipc != ipc_kind::fabric || !posix_ok_ ||
        (st.kind != errc::not_permitted && st.kind != errc::not_supported))
      return false;
    s.props.ipc = ipc_kind::posix_fd;
    ++s.ipc_fallbacks;
    return true;
  }
  bool whole_chunks(const options& o) const override { return o.ipc != ipc_kind::none; }

 private:
  bool posix_ok_ = false;
};
}  // namespace

std::unique_ptr<policy> make_ipc() { return std::make_unique<ipc>(); }

}  // namespace vmm::policy
