// SPDX-License-Identifier: Apache-2.0
// vk::context: a Vulkan device for interop, with the loader opened at run time (dlopen
// "libvulkan.so.1" + vkGetInstanceProcAddr), so nothing links libvulkan. Every VkResult is checked;
// a failure throws vmm::error naming the call and the result. This part opens the loader, picks
// the physical device (by the CUDA device's UUID) and creates the device; buffers are in
// vulkan_memory.cpp, semaphores and submissions in vulkan_sync.cpp.
#include <dlfcn.h>

#include <cstring>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "vulkan_detail.hpp"

// The header's forward declarations and vulkan_core.h must name the same types.
static_assert(std::is_same_v<VkBuffer, VkBuffer_T*>, "64-bit Vulkan handle typedefs expected");

namespace vmm::vk {

namespace detail {

const char* vk_result_name(VkResult r) {
  switch (r) {
#define R(x) case x: return #x;
    R(VK_SUCCESS) R(VK_NOT_READY) R(VK_TIMEOUT) R(VK_EVENT_SET) R(VK_EVENT_RESET) R(VK_INCOMPLETE)
    R(VK_ERROR_OUT_OF_HOST_MEMORY) R(VK_ERROR_OUT_OF_DEVICE_MEMORY) R(VK_ERROR_INITIALIZATION_FAILED)
    R(VK_ERROR_DEVICE_LOST) R(VK_ERROR_MEMORY_MAP_FAILED) R(VK_ERROR_LAYER_NOT_PRESENT)
    R(VK_ERROR_EXTENSION_NOT_PRESENT) R(VK_ERROR_FEATURE_NOT_PRESENT) R(VK_ERROR_INCOMPATIBLE_DRIVER)
    R(VK_ERROR_TOO_MANY_OBJECTS) R(VK_ERROR_FORMAT_NOT_SUPPORTED) R(VK_ERROR_FRAGMENTED_POOL)
    R(VK_ERROR_UNKNOWN) R(VK_ERROR_OUT_OF_POOL_MEMORY) R(VK_ERROR_INVALID_EXTERNAL_HANDLE)
    R(VK_ERROR_FRAGMENTATION) R(VK_ERROR_INVALID_OPAQUE_CAPTURE_ADDRESS)
#undef R
    default: return "VkResult (unnamed)";
  }
}

namespace {

errc kind_of(VkResult r) {
  switch (r) {
    case VK_SUCCESS: return errc::ok;
    case VK_ERROR_OUT_OF_HOST_MEMORY:
    case VK_ERROR_OUT_OF_DEVICE_MEMORY:
    case VK_ERROR_OUT_OF_POOL_MEMORY: return errc::out_of_memory;
    case VK_ERROR_INCOMPATIBLE_DRIVER:
    case VK_ERROR_INITIALIZATION_FAILED: return errc::no_driver;
    case VK_ERROR_EXTENSION_NOT_PRESENT:
    case VK_ERROR_FEATURE_NOT_PRESENT:
    case VK_ERROR_FORMAT_NOT_SUPPORTED: return errc::not_supported;
    case VK_ERROR_INVALID_EXTERNAL_HANDLE: return errc::invalid_value;
    default: return errc::other;
  }
}

}  // namespace

[[noreturn]] void fail(errc e, const char* what, const char* op, const std::string& context) {
  throw_status(status{e, 0, what, op}, "vmm::vk::" + context);
}

void check(VkResult r, const char* op, const std::string& context) {
  if (r == VK_SUCCESS) return;
  throw_status(status{kind_of(r), static_cast<int>(r), vk_result_name(r), op}, "vmm::vk::" + context);
}

}  // namespace detail

namespace {

std::string hex_uuid(const std::uint8_t* u) {
  static const char* x = "0123456789abcdef";
  std::string s;
  for (int i = 0; i < 16; ++i) {
    if (i == 4 || i == 6 || i == 8 || i == 10) s += '-';
    s += x[u[i] >> 4];
    s += x[u[i] & 15];
  }
  return s;
}

}  // namespace

std::string version_string(std::uint32_t v) {
  return std::to_string(VK_API_VERSION_MAJOR(v)) + "." + std::to_string(VK_API_VERSION_MINOR(v)) + "." +
         std::to_string(VK_API_VERSION_PATCH(v));
}

std::string describe(const device_info& i) {
  std::string s = i.name + ", driver " + (i.driver_name.empty() ? "?" : i.driver_name);
  if (!i.driver_info.empty()) s += " " + i.driver_info;
  s += ", Vulkan API " + version_string(i.api_version) + ", loader " + version_string(i.loader_version) +
       ", uuid " + hex_uuid(i.uuid.data());
  s += i.semaphore_fd ? ", semaphore fds" : ", no semaphore fds";
  s += i.timeline ? ", timelines" : ", no timelines";
  return s;
}

context::context() = default;
context::context(context&&) noexcept = default;
context& context::operator=(context&&) noexcept = default;
context::~context() = default;

const device_info& context::info() const noexcept { return p_->info; }
VkInstance context::instance() const noexcept { return p_->instance; }
VkPhysicalDevice context::physical_device() const noexcept { return p_->phys; }
VkDevice context::device() const noexcept { return p_->device; }
VkQueue context::queue() const noexcept { return p_->queue; }

context::void_fn context::proc(const char* name) const {
  if (auto fn = p_->f.vkGetDeviceProcAddr(p_->device, name)) return fn;
  return p_->f.vkGetInstanceProcAddr(p_->instance, name);
}

context context::open(const std::array<std::uint8_t, 16>* uuid) {
  static const std::string where = "context::open";
  auto m = std::make_shared<impl>();
  fns& f = m->f;

  m->lib = ::dlopen("libvulkan.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!m->lib) {
    const char* e = ::dlerror();
    fail(errc::no_driver, "no Vulkan loader", "dlopen(libvulkan.so.1)", where + ": " + (e ? e : "dlopen failed"));
  }
  f.vkGetInstanceProcAddr = reinterpret_cast<PFN_vkGetInstanceProcAddr>(::dlsym(m->lib, "vkGetInstanceProcAddr"));
  if (!f.vkGetInstanceProcAddr)
    fail(errc::no_driver, "the loader has no vkGetInstanceProcAddr", "dlsym", where);
  f.vkEnumerateInstanceVersion =
      reinterpret_cast<PFN_vkEnumerateInstanceVersion>(f.vkGetInstanceProcAddr(nullptr, "vkEnumerateInstanceVersion"));
  f.vkCreateInstance = reinterpret_cast<PFN_vkCreateInstance>(f.vkGetInstanceProcAddr(nullptr, "vkCreateInstance"));
  if (!f.vkCreateInstance) fail(errc::no_driver, "the loader has no vkCreateInstance", "vkGetInstanceProcAddr", where);
  std::uint32_t loader = VK_API_VERSION_1_0;
  if (f.vkEnumerateInstanceVersion)
    check(f.vkEnumerateInstanceVersion(&loader), "vkEnumerateInstanceVersion", where);
  m->info.loader_version = loader;
  if (loader < VK_API_VERSION_1_1)
    fail(errc::not_supported, "the Vulkan loader is older than 1.1 (external memory is core 1.1)",
         "vkEnumerateInstanceVersion", where + ": loader " + version_string(loader));
  const std::uint32_t instance_api = loader >= VK_API_VERSION_1_2 ? VK_API_VERSION_1_2 : VK_API_VERSION_1_1;

  VkApplicationInfo app{VK_STRUCTURE_TYPE_APPLICATION_INFO};
  app.pApplicationName = "vmmalloc";
  app.pEngineName = "vmmalloc";
  app.apiVersion = instance_api;
  VkInstanceCreateInfo ici{VK_STRUCTURE_TYPE_INSTANCE_CREATE_INFO};
  ici.pApplicationInfo = &app;
  if (VkResult r = f.vkCreateInstance(&ici, nullptr, &m->instance); r != VK_SUCCESS) {
    m->instance = VK_NULL_HANDLE;
    if (r == VK_ERROR_INCOMPATIBLE_DRIVER)
      fail(errc::no_driver, "VK_ERROR_INCOMPATIBLE_DRIVER", "vkCreateInstance",
           where + ": no Vulkan driver (ICD) found by the loader " + version_string(loader) +
               " (the NVIDIA ICD: VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json)");
    check(r, "vkCreateInstance", where);
  }
#define X(n)                                                                                    \
  f.n = reinterpret_cast<PFN_##n>(f.vkGetInstanceProcAddr(m->instance, #n));                   \
  if (!f.n) fail(errc::not_supported, "instance function missing", #n, where);
  VMM_VK_INSTANCE_FNS(X)
#undef X

  std::uint32_t n = 0;
  check(f.vkEnumeratePhysicalDevices(m->instance, &n, nullptr), "vkEnumeratePhysicalDevices", where);
  if (n == 0) fail(errc::no_driver, "no Vulkan physical device", "vkEnumeratePhysicalDevices", where);
  std::vector<VkPhysicalDevice> devs(n);
  if (VkResult r = f.vkEnumeratePhysicalDevices(m->instance, &n, devs.data()); r != VK_SUCCESS && r != VK_INCOMPLETE)
    check(r, "vkEnumeratePhysicalDevices", where);
  devs.resize(n);

  std::string seen;
  for (VkPhysicalDevice d : devs) {
    VkPhysicalDeviceProperties base{};
    f.vkGetPhysicalDeviceProperties(d, &base);
    VkPhysicalDeviceIDProperties id{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_ID_PROPERTIES};
    VkPhysicalDeviceDriverProperties drv{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_DRIVER_PROPERTIES};
    const bool v12 = base.apiVersion >= VK_API_VERSION_1_2 && instance_api >= VK_API_VERSION_1_2;
    if (v12) id.pNext = &drv;  // core 1.2: chained only where the device knows it
    VkPhysicalDeviceProperties2 p2{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PROPERTIES_2};
    p2.pNext = &id;
    f.vkGetPhysicalDeviceProperties2(d, &p2);
    seen += std::string(seen.empty() ? "" : "; ") + base.deviceName + " " + hex_uuid(id.deviceUUID);
    if (uuid && std::memcmp(id.deviceUUID, uuid->data(), 16) != 0) continue;
    m->phys = d;
    auto& i = m->info;
    i.api_version = base.apiVersion;
    i.driver_version = base.driverVersion;
    i.vendor_id = base.vendorID;
    i.device_id = base.deviceID;
    i.name = base.deviceName;
    if (v12) {
      i.driver_name = drv.driverName;
      i.driver_info = drv.driverInfo;
    }
    std::memcpy(i.uuid.data(), id.deviceUUID, 16);
    i.timeline = v12;  // confirmed against the feature below
    break;
  }
  if (!m->phys)
    fail(errc::not_supported, "no Vulkan physical device has the CUDA device's UUID", "vkEnumeratePhysicalDevices",
         where + ": wanted " + hex_uuid(uuid->data()) + ", seen: " + seen);

  // Extensions: external memory fd required, external semaphore fd optional.
  std::uint32_t ne = 0;
  check(f.vkEnumerateDeviceExtensionProperties(m->phys, nullptr, &ne, nullptr), "vkEnumerateDeviceExtensionProperties", where);
  std::vector<VkExtensionProperties> exts(ne);
  check(f.vkEnumerateDeviceExtensionProperties(m->phys, nullptr, &ne, exts.data()), "vkEnumerateDeviceExtensionProperties", where);
  auto has = [&](const char* e) {
    for (std::uint32_t k = 0; k < ne; ++k)
      if (std::strcmp(exts[k].extensionName, e) == 0) return true;
    return false;
  };
  std::vector<const char*> enable;
  if (!has(VK_KHR_EXTERNAL_MEMORY_FD_EXTENSION_NAME))
    fail(errc::not_supported, "VK_KHR_external_memory_fd missing", "vkEnumerateDeviceExtensionProperties",
         where + ": " + m->info.name);
  enable.push_back(VK_KHR_EXTERNAL_MEMORY_FD_EXTENSION_NAME);
  if (has(VK_KHR_EXTERNAL_SEMAPHORE_FD_EXTENSION_NAME)) {
    enable.push_back(VK_KHR_EXTERNAL_SEMAPHORE_FD_EXTENSION_NAME);
    m->info.semaphore_fd = true;
  }

  VkPhysicalDeviceTimelineSemaphoreFeatures tl{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_TIMELINE_SEMAPHORE_FEATURES};
  if (m->info.timeline) {
    VkPhysicalDeviceFeatures2 f2{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_FEATURES_2};
    f2.pNext = &tl;
    f.vkGetPhysicalDeviceFeatures2(m->phys, &f2);
    m->info.timeline = tl.timelineSemaphore == VK_TRUE;
    tl.pNext = nullptr;
  }

  // A queue family with compute or graphics (vkCmdFillBuffer needs one of them before 1.1's
  // maintenance1 relaxed it; both always have transfer).
  std::uint32_t nq = 0;
  f.vkGetPhysicalDeviceQueueFamilyProperties(m->phys, &nq, nullptr);
  std::vector<VkQueueFamilyProperties> qf(nq);
  f.vkGetPhysicalDeviceQueueFamilyProperties(m->phys, &nq, qf.data());
  std::uint32_t family = UINT32_MAX;
  for (std::uint32_t k = 0; k < nq && family == UINT32_MAX; ++k)
    if (qf[k].queueCount > 0 && (qf[k].queueFlags & (VK_QUEUE_COMPUTE_BIT | VK_QUEUE_GRAPHICS_BIT))) family = k;
  if (family == UINT32_MAX)
    fail(errc::not_supported, "no queue family with compute or graphics", "vkGetPhysicalDeviceQueueFamilyProperties", where);
  m->info.queue_family = family;

  const float prio = 1.0f;
  VkDeviceQueueCreateInfo qci{VK_STRUCTURE_TYPE_DEVICE_QUEUE_CREATE_INFO};
  qci.queueFamilyIndex = family;
  qci.queueCount = 1;
  qci.pQueuePriorities = &prio;
  VkDeviceCreateInfo dci{VK_STRUCTURE_TYPE_DEVICE_CREATE_INFO};
  dci.queueCreateInfoCount = 1;
  dci.pQueueCreateInfos = &qci;
  dci.enabledExtensionCount = static_cast<std::uint32_t>(enable.size());
  dci.ppEnabledExtensionNames = enable.data();
  if (m->info.timeline) dci.pNext = &tl;  // timelineSemaphore = VK_TRUE, as queried
  if (VkResult r = f.vkCreateDevice(m->phys, &dci, nullptr, &m->device); r != VK_SUCCESS) {
    m->device = VK_NULL_HANDLE;
    check(r, "vkCreateDevice", where + ": " + m->info.name);
  }
#define X(n)                                                                                    \
  f.n = reinterpret_cast<PFN_##n>(f.vkGetDeviceProcAddr(m->device, #n));                       \
  if (!f.n) fail(errc::not_supported, "device function missing", #n, where);
  VMM_VK_DEVICE_FNS(X)
#undef X
#define X(n) f.n = reinterpret_cast<PFN_##n>(f.vkGetDeviceProcAddr(m->device, #n));
  VMM_VK_OPTIONAL_DEVICE_FNS(X)
#undef X
  if (m->info.semaphore_fd && !f.vkGetSemaphoreFdKHR) m->info.semaphore_fd = false;
  if (m->info.timeline && (!f.vkSignalSemaphore || !f.vkWaitSemaphores || !f.vkGetSemaphoreCounterValue))
    m->info.timeline = false;

  f.vkGetDeviceQueue(m->device, family, 0, &m->queue);
  VkCommandPoolCreateInfo pci{VK_STRUCTURE_TYPE_COMMAND_POOL_CREATE_INFO};
  pci.flags = VK_COMMAND_POOL_CREATE_TRANSIENT_BIT | VK_COMMAND_POOL_CREATE_RESET_COMMAND_BUFFER_BIT;
  pci.queueFamilyIndex = family;
  created(f.vkCreateCommandPool(m->device, &pci, nullptr, &m->pool), m->pool, "vkCreateCommandPool", where);
  f.vkGetPhysicalDeviceMemoryProperties(m->phys, &m->mem);

  context c;
  c.p_ = std::move(m);
  return c;
}

}  // namespace vmm::vk
