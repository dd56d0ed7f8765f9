// SPDX-License-Identifier: Apache-2.0
// vk::context's buffers: created (device-local, host-visible or exportable as an opaque fd),
// exported, and imported from an fd or from every chunk of a vmmalloc IPC handle. The fd rule: an
// fd given is always still the caller's; the library imports a dup, which Vulkan owns once the
// import succeeded and the library closes when it failed.
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <string>
#include <utility>
#include <vector>

#include "vulkan_detail.hpp"
#include "vmmalloc/ipc.hpp"

namespace vmm::vk {

namespace {

int dup_fd(int fd, const char* context) {
  if (fd < 0) fail(errc::invalid_value, "fd < 0", "dup", context);
  int d = ::fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (d < 0) {
    const int e = errno;
    throw_status(status{e == EBADF ? errc::invalid_value : errc::other, e,
                        e == EBADF ? "EBADF: not an open fd" : "dup failed", "fcntl(F_DUPFD_CLOEXEC)"},
                 std::string("vmm::vk::") + context);
  }
  return d;
}

// Creates b.buf (able to hold external memory when `external`) and returns its memory
// requirements; sets `dedicated` when the driver requires a dedicated allocation.
VkMemoryRequirements new_buffer(context::impl& m, buffer::impl& b, bool external, bool& dedicated,
                                const std::string& where) {
  VkExternalMemoryBufferCreateInfo ebi{VK_STRUCTURE_TYPE_EXTERNAL_MEMORY_BUFFER_CREATE_INFO};
  ebi.handleTypes = kMemFd;
  VkBufferCreateInfo bci{VK_STRUCTURE_TYPE_BUFFER_CREATE_INFO};
  bci.pNext = external ? &ebi : nullptr;
  bci.size = b.size;
  bci.usage = kUsage;
  bci.sharingMode = VK_SHARING_MODE_EXCLUSIVE;
  created(m.f.vkCreateBuffer(m.device, &bci, nullptr, &b.buf), b.buf, "vkCreateBuffer", where);
  VkMemoryDedicatedRequirements dr{VK_STRUCTURE_TYPE_MEMORY_DEDICATED_REQUIREMENTS};
  VkMemoryRequirements2 r2{VK_STRUCTURE_TYPE_MEMORY_REQUIREMENTS_2};
  r2.pNext = &dr;
  VkBufferMemoryRequirementsInfo2 ri{VK_STRUCTURE_TYPE_BUFFER_MEMORY_REQUIREMENTS_INFO_2};
  ri.buffer = b.buf;
  m.f.vkGetBufferMemoryRequirements2(m.device, &ri, &r2);
  if (dr.requiresDedicatedAllocation) dedicated = true;
  return r2.memoryRequirements;
}

}  // namespace

buffer::buffer() = default;
buffer::buffer(buffer&&) noexcept = default;
buffer& buffer::operator=(buffer&&) noexcept = default;
buffer::~buffer() = default;
VkBuffer buffer::handle() const noexcept { return p_ ? p_->buf : VK_NULL_HANDLE; }
VkDeviceMemory buffer::memory() const noexcept { return p_ ? p_->mem : VK_NULL_HANDLE; }
std::uint64_t buffer::size() const noexcept { return p_ ? p_->size : 0; }
std::uint64_t buffer::allocation_size() const noexcept { return p_ ? p_->allocation_size : 0; }
bool buffer::dedicated() const noexcept { return p_ && p_->dedicated; }
void* buffer::mapped() const noexcept { return p_ ? p_->mapped : nullptr; }

int buffer::export_fd() const {
  if (!p_ || !p_->exportable) fail(errc::invalid_value, "buffer not exportable", "export_fd", "buffer::export_fd");
  VkMemoryGetFdInfoKHR gi{VK_STRUCTURE_TYPE_MEMORY_GET_FD_INFO_KHR};
  gi.memory = p_->mem;
  gi.handleType = kMemFd;
  int fd = -1;
  check(p_->ctx->f.vkGetMemoryFdKHR(p_->ctx->device, &gi, &fd), "vkGetMemoryFdKHR", "buffer::export_fd");
  return fd;
}

buffer context::create_buffer(std::uint64_t size, buffer_kind kind, bool dedicated) {
  static const std::string where = "context::create_buffer";
  auto& m = *p_;
  auto& f = m.f;
  if (size == 0) fail(errc::invalid_value, "size 0", "create_buffer", where);
  if (kind != buffer_kind::exportable && kind != buffer_kind::host_visible && kind != buffer_kind::device_local)
    fail(errc::invalid_value, "unknown buffer kind", "create_buffer", where);
  const bool exportable = kind == buffer_kind::exportable;
  if (exportable) {
    const VkExternalMemoryFeatureFlags fe = m.buffer_features();
    if (!(fe & VK_EXTERNAL_MEMORY_FEATURE_EXPORTABLE_BIT))
      fail(errc::not_supported, "opaque fd export of buffers not supported", "vkGetPhysicalDeviceExternalBufferProperties", where);
    if (fe & VK_EXTERNAL_MEMORY_FEATURE_DEDICATED_ONLY_BIT) dedicated = true;
  }

  auto b = std::make_unique<buffer::impl>();
  b->ctx = p_;
  b->exportable = exportable;
  b->size = size;
  const VkMemoryRequirements req = new_buffer(m, *b, exportable, dedicated, where);
  const bool host = kind == buffer_kind::host_visible;
  const std::uint32_t type =
      host ? m.pick_type(req.memoryTypeBits,
                         VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT | VK_MEMORY_PROPERTY_HOST_COHERENT_BIT, 0)
           : m.pick_type(req.memoryTypeBits, VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT,
                         VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT);
  if (type == UINT32_MAX)
    fail(errc::not_supported, host ? "no host-visible coherent memory type" : "no device-local memory type",
         "vkGetPhysicalDeviceMemoryProperties", where);

  VkMemoryDedicatedAllocateInfo dai{VK_STRUCTURE_TYPE_MEMORY_DEDICATED_ALLOCATE_INFO};
  dai.buffer = b->buf;
  VkExportMemoryAllocateInfo emi{VK_STRUCTURE_TYPE_EXPORT_MEMORY_ALLOCATE_INFO};
  emi.handleTypes = kMemFd;
  const void* chain = nullptr;
  if (dedicated) {
    dai.pNext = chain;
    chain = &dai;
  }
  if (exportable) {
    emi.pNext = chain;
    chain = &emi;
  }
  VkMemoryAllocateInfo mai{VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_INFO};
  mai.pNext = chain;
  mai.allocationSize = req.size;
  mai.memoryTypeIndex = type;
  created(f.vkAllocateMemory(m.device, &mai, nullptr, &b->mem), b->mem, "vkAllocateMemory", where);
  b->allocation_size = mai.allocationSize;
  b->dedicated = dedicated;
  check(f.vkBindBufferMemory(m.device, b->buf, b->mem, 0), "vkBindBufferMemory", where);
  if (host) check(f.vkMapMemory(m.device, b->mem, 0, VK_WHOLE_SIZE, 0, &b->mapped), "vkMapMemory", where);

  buffer out;
  out.p_ = std::move(b);
  return out;
}

buffer context::import_fd(int fd, std::uint64_t size) {
  static const std::string where = "context::import_fd";
  auto& m = *p_;
  auto& f = m.f;
  if (fd < 0) fail(errc::invalid_value, "fd < 0", "import_fd", where);
  if (size == 0) fail(errc::invalid_value, "size 0", "import_fd", where);
  const VkExternalMemoryFeatureFlags fe = m.buffer_features();
  if (!(fe & VK_EXTERNAL_MEMORY_FEATURE_IMPORTABLE_BIT))
    fail(errc::not_supported, "opaque fd import of buffers not supported", "vkGetPhysicalDeviceExternalBufferProperties", where);
  bool dedicated = (fe & VK_EXTERNAL_MEMORY_FEATURE_DEDICATED_ONLY_BIT) != 0;

  auto b = std::make_unique<buffer::impl>();
  b->ctx = p_;
  b->size = size;
  const VkMemoryRequirements req = new_buffer(m, *b, true, dedicated, where);
  // The payload is `size` bytes: the buffer must fit in it.
  if (req.size > size)
    fail(errc::invalid_value, "the buffer needs more memory than the imported payload", "vkGetBufferMemoryRequirements2",
         where + ": needs " + std::to_string(req.size) + " B, payload " + std::to_string(size) + " B");
  const std::uint32_t type = m.pick_type(req.memoryTypeBits, VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT,
                                         VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT);
  if (type == UINT32_MAX)
    fail(errc::not_supported, "no device-local memory type for the buffer", "vkGetPhysicalDeviceMemoryProperties", where);

  const int d = dup_fd(fd, "context::import_fd");
  VkImportMemoryFdInfoKHR imi{VK_STRUCTURE_TYPE_IMPORT_MEMORY_FD_INFO_KHR};
  imi.handleType = kMemFd;
  imi.fd = d;
  VkMemoryDedicatedAllocateInfo dai{VK_STRUCTURE_TYPE_MEMORY_DEDICATED_ALLOCATE_INFO};
  dai.buffer = b->buf;
  if (dedicated) imi.pNext = &dai;
  VkMemoryAllocateInfo mai{VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_INFO};
  mai.pNext = &imi;
  mai.allocationSize = size;
  mai.memoryTypeIndex = type;
  if (VkResult r = f.vkAllocateMemory(m.device, &mai, nullptr, &b->mem); r != VK_SUCCESS) {
    b->mem = VK_NULL_HANDLE;
    ::close(d);  // a failed import leaves the fd with us
    check(r, "vkAllocateMemory(VkImportMemoryFdInfoKHR)", where);
  }
  // From here Vulkan owns the dup: vkFreeMemory releases it.
  b->allocation_size = size;
  b->dedicated = dedicated;
  check(f.vkBindBufferMemory(m.device, b->buf, b->mem, 0), "vkBindBufferMemory", where);
  buffer out;
  out.p_ = std::move(b);
  return out;
}

std::vector<buffer> context::import_chunks(const ipc::export_handle& h) {
  static const std::string where = "context::import_chunks";
  if (h.kind != ipc_kind::posix_fd)
    fail(errc::invalid_value, "the handle is not a posix_fd export (options.ipc = posix_fd)", "import_chunks", where);
  if (h.chunks.empty()) fail(errc::invalid_value, "the handle has no chunks", "import_chunks", where);
  std::uint64_t total = 0;
  for (const auto& c : h.chunks) {
    if (c.size == 0 || c.handle.fd < 0) fail(errc::invalid_value, "a chunk without size or fd", "import_chunks", where);
    total += c.size;
  }
  if (h.offset >= h.chunks[0].size || h.size == 0 || h.offset + h.size > total)
    fail(errc::invalid_value, "offset / size outside the chunks", "import_chunks", where);
  std::vector<buffer> out;
  out.reserve(h.chunks.size());
  for (const auto& c : h.chunks) out.push_back(import_fd(c.handle.fd, c.size));
  return out;
}

}  // namespace vmm::vk
