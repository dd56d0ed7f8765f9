// SPDX-License-Identifier: Apache-2.0
// vmmalloc IPC, import: an export handle mapped into a reservation of exactly its chunks' size,
// all or nothing, through any backend (import_cuda makes the CUDA one); `imported` unmaps,
// releases and frees it again.
#include <cerrno>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "ipc/ipc_detail.hpp"
#include "vm/driver.hpp"
#include "vm/granularity.hpp"
#include "vm/mapping.hpp"
#include "vm/reservation.hpp"
#include "vmmalloc/cuda_backend.hpp"
#include "vmmalloc/error.hpp"
#include "vmmalloc/ipc.hpp"

namespace vmm::ipc {

using detail::check_fields;
using detail::fail;
using detail::raise;

imported::imported(imported&& o) noexcept
    : b_(std::exchange(o.b_, nullptr)), owned_(std::move(o.owned_)), base_(std::exchange(o.base_, 0)),
      mapped_(std::exchange(o.mapped_, 0)), handles_(std::move(o.handles_)),
      ptr_(std::exchange(o.ptr_, nullptr)), size_(std::exchange(o.size_, 0)), kind_(o.kind_),
      exporter_device_(o.exporter_device_) {
  o.handles_.clear();
}

imported& imported::operator=(imported&& o) noexcept {
  if (this != &o) {
    close();
    b_ = std::exchange(o.b_, nullptr);
    owned_ = std::move(o.owned_);
    base_ = std::exchange(o.base_, 0);
    mapped_ = std::exchange(o.mapped_, 0);
    handles_ = std::move(o.handles_);
    o.handles_.clear();
    ptr_ = std::exchange(o.ptr_, nullptr);
    size_ = std::exchange(o.size_, 0);
    kind_ = o.kind_;
    exporter_device_ = o.exporter_device_;
  }
  return *this;
}

imported::~imported() { close(); }

status imported::close() noexcept {
  if (!b_) return {};
  status first;
  auto keep = [&](status s) {
    if (first.ok() && !s.ok()) first = s;
  };
  // Each call is made once more if refused (as every teardown does): one refusal must not leak.
  std::uintptr_t va = base_;
  bool left = false;  // a mapping the driver would not undo: the reservation stays (see vm::reservation::close)
  // Pairs, not structured bindings: clang 14 (the fuzz build) cannot capture a binding.
  for (const auto& hn : handles_) {  // one unmap per map() made
    status u = vm::driver::twice([&] { return b_->unmap(va, hn.second); });
    left |= !u.ok();
    keep(u);
    va += hn.second;
  }
  for (const auto& hn : handles_) keep(vm::driver::twice([&] { return b_->release(hn.first); }));
  if (mapped_ && !left) keep(vm::driver::twice([&] { return b_->free_reservation(base_, mapped_); }));
  handles_.clear();
  b_ = nullptr;
  base_ = 0;
  mapped_ = 0;
  ptr_ = nullptr;
  size_ = 0;
  owned_.reset();
  return first;
}

status try_import(backend_iface& b, export_handle&& hin, const import_options& o, imported& out,
                  std::string* why) noexcept {
  constexpr const char* op = "vmm::ipc::import";
  export_handle h(std::move(hin));  // consumed: its fds close when this returns
  if (status s = check_fields(h, true, op, why); !s.ok()) return s;
  auto backend_fail = [&](const status& s, const std::string& what) {
    if (why) {
      try {
        *why = std::string(op) + ": " + what + ": " + s.message();
      } catch (...) {
      }
    }
    return s;
  };

  // The granularity of the importing device and its peers: every chunk (and so the reservation)
  // must be a multiple of it.
  vm::driver d(&b);
  chunk_props props;
  props.location = location_kind::device;
  props.id = o.device;
  props.ipc = h.chunks.front().handle.kind;
  std::string gwhy;
  auto g = vm::granularity_for(d, props, o.peers, &gwhy);
  if (!g.ok()) return backend_fail(g.st, gwhy);
  const std::size_t gran = g.value;
  for (std::size_t i = 0; i < h.chunks.size(); ++i)
    if (h.chunks[i].size % gran)
      return fail(why, errc::invalid_value, EINVAL, "chunk not a granularity multiple", op,
                  "chunk " + std::to_string(i) + " (" + std::to_string(h.chunks[i].size) +
                      " bytes) is not a multiple of the importing device's granularity (" +
                      std::to_string(gran) + ")");
  const std::uint64_t total = h.mapping_size();
  if (total > std::uint64_t{SIZE_MAX})
    return fail(why, errc::invalid_value, EINVAL, "too large", op, "mapping does not fit size_t");

  imported m;
  std::vector<access_desc> acc;
  try {
    m.handles_.reserve(h.chunks.size());
    acc.reserve(1 + o.peers.size());
    acc.push_back({o.device, o.mode});
    acc.insert(acc.end(), o.peers.begin(), o.peers.end());
  } catch (...) {
    return {errc::out_of_memory, ENOMEM, "ENOMEM", op};
  }
  // Exactly the chunks' bytes: never a device-sized range per import.
  vm::reservation res;
  if (status s = res.open(d, static_cast<std::size_t>(total), gran); !s.ok())
    return backend_fail(s, "reserve " + std::to_string(total) + " bytes");

  // All or nothing: imported handles are the import's own (released on failure), mappings are
  // undone by the transaction (vm::mapping_txn::place), the reservation freed by `res`.
  vm::strays left;
  status err{};
  std::string what;
  {
    std::vector<vm::piece> pieces;
    for (std::size_t i = 0; i < h.chunks.size(); ++i) {
      auto ih = d.import_handle(h.chunks[i].handle);
      if (!ih.ok()) {
        err = ih.st;
        what = "import chunk " + std::to_string(i);
        for (const vm::piece& p : pieces)  // nothing mapped yet: the imported handles go
          if (!vm::driver::twice([&] { return d.release(p.h); }).ok()) left.add_handle(p.h, p.size);
        break;
      }
      pieces.push_back({static_cast<std::size_t>(h.chunks[i].size), ih.value, true});
    }
    if (err.ok()) {
      vm::mapping_txn txn(d, left);
      // One set_access over the whole range, for every device at once.
      std::size_t k = 0;
      err = txn.place(res.base(), pieces, acc, {}, &k);
      if (err.ok()) {
        txn.commit();
        for (const vm::piece& p : pieces) m.handles_.emplace_back(p.h, p.size);  // reserved above
      } else if (k < pieces.size()) {
        what = "map chunk " + std::to_string(k) + " (" + std::to_string(pieces[k].size) + " bytes)";
      } else {
        what = "set_access for device " + std::to_string(o.device);
      }
    }
  }
  if (!err.ok()) {
    // What the driver still refused to undo cannot be kept by anyone: a mapping left in place
    // keeps its reservation too (freeing it under a live mapping is worse than the leak).
    if (!left.retry(d).ok()) {
      bool mapped = false;
      for (const auto& e : left.entries()) mapped = mapped || e.mapped;
      if (mapped) (void)res.release_without_freeing();
      what += " (and undoing it was refused: " + std::to_string(left.size()) + " driver objects leaked)";
    }
    return backend_fail(err, what);
  }
  m.b_ = &b;
  m.base_ = res.base();
  m.mapped_ = res.size();
  (void)res.release_without_freeing();  // m owns the range now: close() frees it
  m.ptr_ = reinterpret_cast<void*>(m.base_ + h.offset);
  m.size_ = static_cast<std::size_t>(h.size);
  m.kind_ = h.kind;
  m.exporter_device_ = h.device;
  out = std::move(m);
  return {};
}

imported import(backend_iface& b, export_handle&& h, const import_options& o) {
  std::string why;
  imported m;
  if (status s = try_import(b, std::move(h), o, m, &why); !s.ok()) raise(s, why);
  return m;
}

imported import_cuda(int device, export_handle&& h, import_options o) {
  export_handle own(std::move(h));  // closed on every path
  std::shared_ptr<backend_iface> b = make_backend<cuda_backend>(device);
  auto& cb = static_cast<backend_model<cuda_backend>&>(*b).get();
  if (!cb.available()) raise(cb.load_status(), "vmm::ipc::import_cuda: " + cb.load_message());
  o.device = device;
  imported m = import(*b, std::move(own), o);
  m.owned_ = std::move(b);
  return m;
}

}  // namespace vmm::ipc
