// SPDX-License-Identifier: Apache-2.0
// vk::context's synchronisation: binary and timeline semaphores (exportable as opaque fds),
// submissions (one command buffer and a fence each, waited with time limits; one that never ends is
// left allocated and freezes teardown rather than free what the GPU may still use), and the
// command helpers for record callbacks.
#include <chrono>
#include <cstdio>
#include <functional>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "vulkan_detail.hpp"

namespace vmm::vk {

semaphore::semaphore() = default;
semaphore::semaphore(semaphore&&) noexcept = default;
semaphore& semaphore::operator=(semaphore&&) noexcept = default;
semaphore::~semaphore() = default;
VkSemaphore semaphore::handle() const noexcept { return p_ ? p_->sem : VK_NULL_HANDLE; }
semaphore_kind semaphore::kind() const noexcept { return p_ ? p_->kind : semaphore_kind::binary; }

int semaphore::export_fd() const {
  if (!p_ || !p_->exportable) fail(errc::invalid_value, "semaphore not exportable", "export_fd", "semaphore::export_fd");
  VkSemaphoreGetFdInfoKHR gi{VK_STRUCTURE_TYPE_SEMAPHORE_GET_FD_INFO_KHR};
  gi.semaphore = p_->sem;
  gi.handleType = kSemFd;
  int fd = -1;
  check(p_->ctx->f.vkGetSemaphoreFdKHR(p_->ctx->device, &gi, &fd), "vkGetSemaphoreFdKHR", "semaphore::export_fd");
  return fd;
}

std::uint64_t semaphore::value() const {
  if (!p_ || p_->kind != semaphore_kind::timeline)
    fail(errc::invalid_value, "not a timeline semaphore", "value", "semaphore::value");
  std::uint64_t v = 0;
  check(p_->ctx->f.vkGetSemaphoreCounterValue(p_->ctx->device, p_->sem, &v), "vkGetSemaphoreCounterValue",
        "semaphore::value");
  return v;
}

void semaphore::signal(std::uint64_t value) {
  if (!p_ || p_->kind != semaphore_kind::timeline)
    fail(errc::invalid_value, "not a timeline semaphore", "signal", "semaphore::signal");
  VkSemaphoreSignalInfo si{VK_STRUCTURE_TYPE_SEMAPHORE_SIGNAL_INFO};
  si.semaphore = p_->sem;
  si.value = value;
  check(p_->ctx->f.vkSignalSemaphore(p_->ctx->device, &si), "vkSignalSemaphore", "semaphore::signal");
}

bool semaphore::wait(std::uint64_t value, std::chrono::nanoseconds timeout) const {
  if (!p_ || p_->kind != semaphore_kind::timeline)
    fail(errc::invalid_value, "not a timeline semaphore", "wait", "semaphore::wait");
  VkSemaphoreWaitInfo wi{VK_STRUCTURE_TYPE_SEMAPHORE_WAIT_INFO};
  wi.semaphoreCount = 1;
  wi.pSemaphores = &p_->sem;
  wi.pValues = &value;
  const VkResult r = p_->ctx->f.vkWaitSemaphores(p_->ctx->device, &wi,
                                                 static_cast<std::uint64_t>(timeout.count() < 0 ? 0 : timeout.count()));
  if (r == VK_TIMEOUT) return false;
  check(r, "vkWaitSemaphores", "semaphore::wait");
  return true;
}

semaphore context::create_semaphore(semaphore_kind kind, std::uint64_t initial, bool exportable) {
  static const std::string where = "context::create_semaphore";
  auto& m = *p_;
  auto& f = m.f;
  if (kind != semaphore_kind::binary && kind != semaphore_kind::timeline)
    fail(errc::invalid_value, "unknown semaphore kind", "create_semaphore", where);
  const bool timeline = kind == semaphore_kind::timeline;
  if (timeline && !m.info.timeline)
    fail(errc::not_supported, "timeline semaphores not supported", "create_semaphore", where);
  if (!timeline && initial != 0) fail(errc::invalid_value, "a binary semaphore starts at 0", "create_semaphore", where);
  VkSemaphoreTypeCreateInfo tci{VK_STRUCTURE_TYPE_SEMAPHORE_TYPE_CREATE_INFO};
  tci.semaphoreType = VK_SEMAPHORE_TYPE_TIMELINE;
  tci.initialValue = initial;
  if (exportable) {
    if (!m.info.semaphore_fd)
      fail(errc::not_supported, "VK_KHR_external_semaphore_fd missing", "create_semaphore", where);
    VkPhysicalDeviceExternalSemaphoreInfo si{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_EXTERNAL_SEMAPHORE_INFO};
    si.pNext = timeline ? &tci : nullptr;
    si.handleType = kSemFd;
    VkExternalSemaphoreProperties sp{VK_STRUCTURE_TYPE_EXTERNAL_SEMAPHORE_PROPERTIES};
    f.vkGetPhysicalDeviceExternalSemaphoreProperties(m.phys, &si, &sp);
    if (!(sp.externalSemaphoreFeatures & VK_EXTERNAL_SEMAPHORE_FEATURE_EXPORTABLE_BIT))
      fail(errc::not_supported, "opaque fd export of this semaphore kind not supported",
           "vkGetPhysicalDeviceExternalSemaphoreProperties", where + std::string(": ") + semaphore_kind_name(kind));
  }
  VkExportSemaphoreCreateInfo esi{VK_STRUCTURE_TYPE_EXPORT_SEMAPHORE_CREATE_INFO};
  esi.handleTypes = kSemFd;
  const void* chain = nullptr;
  if (timeline) {
    tci.pNext = chain;
    chain = &tci;
  }
  if (exportable) {
    esi.pNext = chain;
    chain = &esi;
  }
  VkSemaphoreCreateInfo sci{VK_STRUCTURE_TYPE_SEMAPHORE_CREATE_INFO};
  sci.pNext = chain;
  auto s = std::make_unique<semaphore::impl>();
  s->ctx = p_;
  s->kind = kind;
  s->exportable = exportable;
  created(f.vkCreateSemaphore(m.device, &sci, nullptr, &s->sem), s->sem, "vkCreateSemaphore", where);
  semaphore out;
  out.p_ = std::move(s);
  return out;
}

submission::submission() = default;
submission::submission(submission&&) noexcept = default;
submission& submission::operator=(submission&&) noexcept = default;
submission::~submission() = default;

bool submission::wait(std::chrono::nanoseconds timeout) {
  if (!p_ || p_->done) return true;
  const VkResult r = p_->ctx->f.vkWaitForFences(p_->ctx->device, 1, &p_->fence, VK_TRUE,
                                                static_cast<std::uint64_t>(timeout.count() < 0 ? 0 : timeout.count()));
  if (r == VK_TIMEOUT) return false;
  check(r, "vkWaitForFences", "submission::wait");
  p_->done = true;
  return true;
}

bool submission::done() const {
  if (!p_ || p_->done) return true;
  const VkResult r = p_->ctx->f.vkGetFenceStatus(p_->ctx->device, p_->fence);
  if (r == VK_NOT_READY) return false;
  check(r, "vkGetFenceStatus", "submission::done");
  p_->done = true;
  return true;
}

submission context::submit(const std::function<void(VkCommandBuffer)>& record,
                           std::initializer_list<semaphore_op> waits,
                           std::initializer_list<semaphore_op> signals) {
  static const std::string where = "context::submit";
  auto& m = *p_;
  auto& f = m.f;
  std::vector<VkSemaphore> ws, ss;
  std::vector<std::uint64_t> wv, sv;
  std::vector<VkPipelineStageFlags> stages;
  bool any_timeline = false;
  auto take = [&](const semaphore_op& op, std::vector<VkSemaphore>& h, std::vector<std::uint64_t>& v, bool signal) {
    if (!op.sem || !op.sem->handle()) fail(errc::invalid_value, "empty semaphore", "submit", where);
    if (op.sem->kind() == semaphore_kind::binary && op.value != 0)
      fail(errc::invalid_value, "a binary semaphore takes value 0", "submit", where);
    if (op.sem->kind() == semaphore_kind::timeline) {
      any_timeline = true;
      if (signal && op.value == 0) fail(errc::invalid_value, "a timeline signal needs a value > 0", "submit", where);
    }
    h.push_back(op.sem->handle());
    v.push_back(op.value);
  };
  for (const auto& w : waits) {
    take(w, ws, wv, false);
    stages.push_back(VK_PIPELINE_STAGE_ALL_COMMANDS_BIT);
  }
  for (const auto& s : signals) take(s, ss, sv, true);

  auto sub = std::make_unique<submission::impl>();
  sub->ctx = p_;
  VkCommandBufferAllocateInfo cai{VK_STRUCTURE_TYPE_COMMAND_BUFFER_ALLOCATE_INFO};
  cai.commandPool = m.pool;
  cai.level = VK_COMMAND_BUFFER_LEVEL_PRIMARY;
  cai.commandBufferCount = 1;
  created(f.vkAllocateCommandBuffers(m.device, &cai, &sub->cb), sub->cb, "vkAllocateCommandBuffers", where);
  VkFenceCreateInfo fci{VK_STRUCTURE_TYPE_FENCE_CREATE_INFO};
  created(f.vkCreateFence(m.device, &fci, nullptr, &sub->fence), sub->fence, "vkCreateFence", where);
  VkCommandBufferBeginInfo bi{VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO};
  bi.flags = VK_COMMAND_BUFFER_USAGE_ONE_TIME_SUBMIT_BIT;
  check(f.vkBeginCommandBuffer(sub->cb, &bi), "vkBeginCommandBuffer", where);
  if (record) record(sub->cb);  // may throw: sub frees the command buffer and fence
  VkMemoryBarrier mb{VK_STRUCTURE_TYPE_MEMORY_BARRIER};
  mb.srcAccessMask = VK_ACCESS_MEMORY_WRITE_BIT;
  mb.dstAccessMask = VK_ACCESS_HOST_READ_BIT;
  f.vkCmdPipelineBarrier(sub->cb, VK_PIPELINE_STAGE_ALL_COMMANDS_BIT, VK_PIPELINE_STAGE_HOST_BIT, 0, 1, &mb, 0,
                         nullptr, 0, nullptr);
  check(f.vkEndCommandBuffer(sub->cb), "vkEndCommandBuffer", where);

  VkTimelineSemaphoreSubmitInfo tsi{VK_STRUCTURE_TYPE_TIMELINE_SEMAPHORE_SUBMIT_INFO};
  tsi.waitSemaphoreValueCount = static_cast<std::uint32_t>(wv.size());
  tsi.pWaitSemaphoreValues = wv.data();
  tsi.signalSemaphoreValueCount = static_cast<std::uint32_t>(sv.size());
  tsi.pSignalSemaphoreValues = sv.data();
  VkSubmitInfo si{VK_STRUCTURE_TYPE_SUBMIT_INFO};
  si.pNext = any_timeline ? &tsi : nullptr;
  si.waitSemaphoreCount = static_cast<std::uint32_t>(ws.size());
  si.pWaitSemaphores = ws.data();
  si.pWaitDstStageMask = stages.data();
  si.commandBufferCount = 1;
  si.pCommandBuffers = &sub->cb;
  si.signalSemaphoreCount = static_cast<std::uint32_t>(ss.size());
  si.pSignalSemaphores = ss.data();
  check(f.vkQueueSubmit(m.queue, 1, &si, sub->fence), "vkQueueSubmit", where);
  sub->submitted = true;
  submission out;
  out.p_ = std::move(sub);
  return out;
}

namespace {
void check_range(const buffer& b, std::uint64_t off, std::uint64_t n, bool fill, const char* op) {
  if (!b.handle()) fail(errc::invalid_value, "empty buffer", op, op);
  if (n == 0 || off > b.size() || n > b.size() - off) fail(errc::invalid_value, "range outside the buffer", op, op);
  if (fill && (off % 4 || n % 4)) fail(errc::invalid_value, "offset and size must be multiples of 4", op, op);
}
}  // namespace

void context::cmd_fill(VkCommandBuffer cb, const buffer& b, std::uint64_t offset, std::uint64_t size,
                       std::uint32_t value) const {
  check_range(b, offset, size, true, "context::cmd_fill");
  p_->f.vkCmdFillBuffer(cb, b.handle(), offset, size, value);
}

void context::cmd_copy(VkCommandBuffer cb, const buffer& src, std::uint64_t src_offset, const buffer& dst,
                       std::uint64_t dst_offset, std::uint64_t size) const {
  check_range(src, src_offset, size, false, "context::cmd_copy");
  check_range(dst, dst_offset, size, false, "context::cmd_copy");
  VkBufferCopy r{src_offset, dst_offset, size};
  p_->f.vkCmdCopyBuffer(cb, src.handle(), dst.handle(), 1, &r);
}

void context::cmd_barrier(VkCommandBuffer cb) const {
  VkMemoryBarrier mb{VK_STRUCTURE_TYPE_MEMORY_BARRIER};
  mb.srcAccessMask = VK_ACCESS_MEMORY_WRITE_BIT;
  mb.dstAccessMask = VK_ACCESS_MEMORY_READ_BIT | VK_ACCESS_MEMORY_WRITE_BIT;
  p_->f.vkCmdPipelineBarrier(cb, VK_PIPELINE_STAGE_ALL_COMMANDS_BIT, VK_PIPELINE_STAGE_ALL_COMMANDS_BIT, 0, 1, &mb,
                             0, nullptr, 0, nullptr);
}

}  // namespace vmm::vk
