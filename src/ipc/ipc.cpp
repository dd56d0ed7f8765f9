#include "vmmalloc/ipc.hpp"

#include <unistd.h>

#include <utility>

namespace vmm::ipc {

export_handle::export_handle(export_handle&& o) noexcept
    : version(o.version), kind(o.kind), device(o.device), size(o.size), offset(o.offset),
      chunks(std::move(o.chunks)) {
  o.chunks.clear();
}

export_handle& export_handle::operator=(export_handle&& o) noexcept {
  if (this != &o) {
    close_fds();
    version = o.version;
    kind = o.kind;
    device = o.device;
    size = o.size;
    offset = o.offset;
    chunks = std::move(o.chunks);
    o.chunks.clear();
  }
  return *this;
}

export_handle::~export_handle() { close_fds(); }

void export_handle::close_fds() noexcept {
  for (auto& c : chunks)
    if (c.handle.fd >= 0) {
      ::close(c.handle.fd);
      c.handle.fd = -1;
    }
}

}  // namespace vmm::ipc
