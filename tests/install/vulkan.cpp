// SPDX-License-Identifier: Apache-2.0
// Consumer check, Vulkan interop: vulkan_interop.hpp's functions resolve from the installed
// libraries (vmmalloc::vulkan and the vmmalloc::interop_core it brings). Nothing needs a GPU or a
// Vulkan loader: the CUDA runtime's external_api is created, not used.
#include <cstdio>
#include <cstring>

#include <vmmalloc/vulkan_interop.hpp>

int main() {
  auto api = vmm::vk::cuda_external_api(0);  // vmmalloc_vulkan
  const char* kind = vmm::vk::semaphore_kind_name(vmm::vk::semaphore_kind::timeline);  // interop_core
  if (!api || !api->name() || std::strlen(api->name()) == 0 || std::strcmp(kind, "timeline") != 0) {
    std::printf("consumer_vulkan FAILED: api=%p kind=%s\n", static_cast<void*>(api.get()), kind);
    return 1;
  }
  std::printf("consumer_vulkan ok\n");
  return 0;
}
