// SPDX-License-Identifier: Apache-2.0
// Private to src/interop: what the three parts of the Vulkan context share. The loader's function
// table, the VkResult checks that throw vmm::error, and the objects behind the public handles
// (context, buffer, semaphore, submission), each holding the context alive through shared_ptr.
//   vulkan_context.cpp  the loader, the instance, device selection by UUID, the device
//   vulkan_memory.cpp   buffers: created, exported as fds, imported from fds and IPC handles
//   vulkan_sync.cpp     semaphores, submissions and the command helpers
#pragma once

#define VK_NO_PROTOTYPES
#include <vulkan/vulkan.h>

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>

#include "vmmalloc/vulkan_interop.hpp"

namespace vmm::vk::detail {

// "VK_ERROR_OUT_OF_DEVICE_MEMORY" (static storage).
const char* vk_result_name(VkResult r);

// Throws vmm::error (out_of_memory where e says so) naming `op` and "vmm::vk::<context>".
[[noreturn]] void fail(errc e, const char* what, const char* op, const std::string& context);

// Throws for anything but VK_SUCCESS, with the result's name and its errc.
void check(VkResult r, const char* op, const std::string& context);

// Object creation: on failure the handle is reset (its contents are undefined after an error), so
// the owner's destructor never destroys garbage.
template <class H>
void created(VkResult r, H& h, const char* op, const std::string& context) {
  if (r != VK_SUCCESS) h = VK_NULL_HANDLE;
  check(r, op, context);
}

// Function table. Instance-level functions through vkGetInstanceProcAddr, device-level through
// vkGetDeviceProcAddr (no loader trampoline per call).
#define VMM_VK_INSTANCE_FNS(X)                                                                      \
  X(vkDestroyInstance) X(vkEnumeratePhysicalDevices) X(vkGetPhysicalDeviceProperties)              \
  X(vkGetPhysicalDeviceProperties2) X(vkGetPhysicalDeviceFeatures2)                                 \
  X(vkGetPhysicalDeviceQueueFamilyProperties) X(vkGetPhysicalDeviceMemoryProperties)                \
  X(vkEnumerateDeviceExtensionProperties) X(vkGetPhysicalDeviceExternalBufferProperties)            \
  X(vkGetPhysicalDeviceExternalSemaphoreProperties) X(vkCreateDevice) X(vkGetDeviceProcAddr)
#define VMM_VK_DEVICE_FNS(X)                                                                        \
  X(vkDestroyDevice) X(vkGetDeviceQueue) X(vkCreateCommandPool) X(vkDestroyCommandPool)             \
  X(vkAllocateCommandBuffers) X(vkFreeCommandBuffers) X(vkBeginCommandBuffer) X(vkEndCommandBuffer) \
  X(vkCmdFillBuffer) X(vkCmdCopyBuffer) X(vkCmdPipelineBarrier) X(vkQueueSubmit) X(vkCreateFence)   \
  X(vkDestroyFence) X(vkWaitForFences) X(vkGetFenceStatus) X(vkCreateBuffer) X(vkDestroyBuffer)     \
  X(vkGetBufferMemoryRequirements2) X(vkAllocateMemory) X(vkFreeMemory) X(vkBindBufferMemory)       \
  X(vkMapMemory) X(vkUnmapMemory) X(vkCreateSemaphore) X(vkDestroySemaphore) X(vkGetMemoryFdKHR)
// Present only with VK_KHR_external_semaphore_fd / Vulkan 1.2 timelines.
#define VMM_VK_OPTIONAL_DEVICE_FNS(X) \
  X(vkGetSemaphoreFdKHR) X(vkSignalSemaphore) X(vkWaitSemaphores) X(vkGetSemaphoreCounterValue)

struct fns {
  PFN_vkGetInstanceProcAddr vkGetInstanceProcAddr = nullptr;
  PFN_vkEnumerateInstanceVersion vkEnumerateInstanceVersion = nullptr;
  PFN_vkCreateInstance vkCreateInstance = nullptr;
#define X(n) PFN_##n n = nullptr;
  VMM_VK_INSTANCE_FNS(X)
  VMM_VK_DEVICE_FNS(X)
  VMM_VK_OPTIONAL_DEVICE_FNS(X)
#undef X
};

inline constexpr VkExternalMemoryHandleTypeFlagBits kMemFd = VK_EXTERNAL_MEMORY_HANDLE_TYPE_OPAQUE_FD_BIT;
inline constexpr VkExternalSemaphoreHandleTypeFlagBits kSemFd = VK_EXTERNAL_SEMAPHORE_HANDLE_TYPE_OPAQUE_FD_BIT;
inline constexpr VkBufferUsageFlags kUsage =
    VK_BUFFER_USAGE_TRANSFER_SRC_BIT | VK_BUFFER_USAGE_TRANSFER_DST_BIT | VK_BUFFER_USAGE_STORAGE_BUFFER_BIT;

}  // namespace vmm::vk::detail

namespace vmm::vk {

using detail::check;
using detail::created;
using detail::fail;
using detail::fns;
using detail::kMemFd;
using detail::kSemFd;
using detail::kUsage;
using detail::vk_result_name;

struct context::impl {
  void* lib = nullptr;  // never dlclosed: drivers register exit handlers inside their libraries
  fns f;
  VkInstance instance = VK_NULL_HANDLE;
  VkPhysicalDevice phys = VK_NULL_HANDLE;
  VkDevice device = VK_NULL_HANDLE;
  VkQueue queue = VK_NULL_HANDLE;
  VkCommandPool pool = VK_NULL_HANDLE;
  VkPhysicalDeviceMemoryProperties mem{};
  device_info info;
  // Submissions that did not finish in time and were left allocated: while any exists, nothing
  // the GPU may still use is destroyed (buffers, semaphores, the device itself are leaked).
  std::size_t stuck = 0;

  ~impl() {
    if (stuck) {
      std::fprintf(stderr, "vmm::vk::context: %zu submission(s) never finished: device left allocated\n", stuck);
      return;
    }
    if (pool && f.vkDestroyCommandPool) f.vkDestroyCommandPool(device, pool, nullptr);
    if (device && f.vkDestroyDevice) f.vkDestroyDevice(device, nullptr);
    if (instance && f.vkDestroyInstance) f.vkDestroyInstance(instance, nullptr);
  }

  // First memory type in `bits` with all of `want` and none of `avoid`; then without `avoid`.
  std::uint32_t pick_type(std::uint32_t bits, VkMemoryPropertyFlags want, VkMemoryPropertyFlags avoid) const {
    for (int pass = 0; pass < 2; ++pass)
      for (std::uint32_t i = 0; i < mem.memoryTypeCount; ++i) {
        const VkMemoryPropertyFlags fl = mem.memoryTypes[i].propertyFlags;
        if ((bits & (1u << i)) && (fl & want) == want && (pass == 1 || !(fl & avoid))) return i;
      }
    return UINT32_MAX;
  }

  VkExternalMemoryFeatureFlags buffer_features() const {
    VkPhysicalDeviceExternalBufferInfo bi{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_EXTERNAL_BUFFER_INFO};
    bi.usage = kUsage;
    bi.handleType = kMemFd;
    VkExternalBufferProperties bp{VK_STRUCTURE_TYPE_EXTERNAL_BUFFER_PROPERTIES};
    f.vkGetPhysicalDeviceExternalBufferProperties(phys, &bi, &bp);
    return bp.externalMemoryProperties.externalMemoryFeatures;
  }
};

struct buffer::impl {
  std::shared_ptr<context::impl> ctx;
  VkBuffer buf = VK_NULL_HANDLE;
  VkDeviceMemory mem = VK_NULL_HANDLE;
  std::uint64_t size = 0, allocation_size = 0;
  bool dedicated = false, exportable = false;
  void* mapped = nullptr;
  ~impl() {
    if (!ctx || ctx->stuck) return;  // a stuck submission may still use it
    auto& f = ctx->f;
    if (mapped) f.vkUnmapMemory(ctx->device, mem);
    if (buf) f.vkDestroyBuffer(ctx->device, buf, nullptr);
    if (mem) f.vkFreeMemory(ctx->device, mem, nullptr);
  }
};

struct semaphore::impl {
  std::shared_ptr<context::impl> ctx;
  VkSemaphore sem = VK_NULL_HANDLE;
  semaphore_kind kind = semaphore_kind::binary;
  bool exportable = false;
  ~impl() {
    if (ctx && !ctx->stuck && sem) ctx->f.vkDestroySemaphore(ctx->device, sem, nullptr);
  }
};

struct submission::impl {
  std::shared_ptr<context::impl> ctx;
  VkCommandBuffer cb = VK_NULL_HANDLE;
  VkFence fence = VK_NULL_HANDLE;
  bool done = false;
  bool submitted = false;

  ~impl() {
    if (!ctx) return;
    auto& f = ctx->f;
    if (submitted && !done) {
      const VkResult r = f.vkWaitForFences(ctx->device, 1, &fence, VK_TRUE, 10'000'000'000ull);
      if (r != VK_SUCCESS) {
        std::fprintf(stderr, "vmm::vk::submission: not finished after 10 s (%s): left allocated\n", vk_result_name(r));
        ++ctx->stuck;
        return;
      }
      done = true;
    }
    if (cb) f.vkFreeCommandBuffers(ctx->device, ctx->pool, 1, &cb);
    if (fence) f.vkDestroyFence(ctx->device, fence, nullptr);
  }
};

}  // namespace vmm::vk
