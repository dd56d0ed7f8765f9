// vk::context: a Vulkan device for interop, with the loader opened at run time (dlopen
// "libvulkan.so.1" + vkGetInstanceProcAddr), so nothing links libvulkan. Every VkResult is checked;
// a failure throws vmm::error naming the call and the result.
#define VK_NO_PROTOTYPES
#include <vulkan/vulkan.h>

#include <dlfcn.h>
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "vmmalloc/ipc.hpp"
#include "vmmalloc/vulkan_interop.hpp"

// The header's forward declarations and vulkan_core.h must name the same types.
static_assert(std::is_same_v<VkBuffer, VkBuffer_T*>, "64-bit Vulkan handle typedefs expected");

namespace vmm::vk {
namespace {

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

[[noreturn]] void fail(errc e, const char* what, const char* op, const std::string& context) {
  throw_status(status{e, 0, what, op}, "vmm::vk::" + context);
}

void check(VkResult r, const char* op, const std::string& context) {
  if (r == VK_SUCCESS) return;
  throw_status(status{kind_of(r), static_cast<int>(r), vk_result_name(r), op}, "vmm::vk::" + context);
}

// Object creation: on failure the handle is reset (its contents are undefined after an error), so
// the owner's destructor never destroys garbage.
template <class H>
void created(VkResult r, H& h, const char* op, const std::string& context) {
  if (r != VK_SUCCESS) h = VK_NULL_HANDLE;
  check(r, op, context);
}

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

constexpr VkExternalMemoryHandleTypeFlagBits kMemFd = VK_EXTERNAL_MEMORY_HANDLE_TYPE_OPAQUE_FD_BIT;
constexpr VkExternalSemaphoreHandleTypeFlagBits kSemFd = VK_EXTERNAL_SEMAPHORE_HANDLE_TYPE_OPAQUE_FD_BIT;
constexpr VkBufferUsageFlags kUsage =
    VK_BUFFER_USAGE_TRANSFER_SRC_BIT | VK_BUFFER_USAGE_TRANSFER_DST_BIT | VK_BUFFER_USAGE_STORAGE_BUFFER_BIT;

}  // namespace

// ---- context::impl -------------------------------------------------------------------------------

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

// ---- buffer --------------------------------------------------------------------------------------

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

// ---- semaphore -----------------------------------------------------------------------------------

struct semaphore::impl {
  std::shared_ptr<context::impl> ctx;
  VkSemaphore sem = VK_NULL_HANDLE;
  semaphore_kind kind = semaphore_kind::binary;
  bool exportable = false;
  ~impl() {
    if (ctx && !ctx->stuck && sem) ctx->f.vkDestroySemaphore(ctx->device, sem, nullptr);
  }
};

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

// ---- submission ----------------------------------------------------------------------------------

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

// ---- context -------------------------------------------------------------------------------------

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
  VkExternalMemoryBufferCreateInfo ebi{VK_STRUCTURE_TYPE_EXTERNAL_MEMORY_BUFFER_CREATE_INFO};
  ebi.handleTypes = kMemFd;
  VkBufferCreateInfo bci{VK_STRUCTURE_TYPE_BUFFER_CREATE_INFO};
  bci.pNext = exportable ? &ebi : nullptr;
  bci.size = size;
  bci.usage = kUsage;
  bci.sharingMode = VK_SHARING_MODE_EXCLUSIVE;
  created(f.vkCreateBuffer(m.device, &bci, nullptr, &b->buf), b->buf, "vkCreateBuffer", where);

  VkMemoryDedicatedRequirements dr{VK_STRUCTURE_TYPE_MEMORY_DEDICATED_REQUIREMENTS};
  VkMemoryRequirements2 r2{VK_STRUCTURE_TYPE_MEMORY_REQUIREMENTS_2};
  r2.pNext = &dr;
  VkBufferMemoryRequirementsInfo2 ri{VK_STRUCTURE_TYPE_BUFFER_MEMORY_REQUIREMENTS_INFO_2};
  ri.buffer = b->buf;
  f.vkGetBufferMemoryRequirements2(m.device, &ri, &r2);
  if (dr.requiresDedicatedAllocation) dedicated = true;
  const bool host = kind == buffer_kind::host_visible;
  const std::uint32_t type =
      host ? m.pick_type(r2.memoryRequirements.memoryTypeBits,
                         VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT | VK_MEMORY_PROPERTY_HOST_COHERENT_BIT, 0)
           : m.pick_type(r2.memoryRequirements.memoryTypeBits, VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT,
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
  mai.allocationSize = r2.memoryRequirements.size;
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
  VkExternalMemoryBufferCreateInfo ebi{VK_STRUCTURE_TYPE_EXTERNAL_MEMORY_BUFFER_CREATE_INFO};
  ebi.handleTypes = kMemFd;
  VkBufferCreateInfo bci{VK_STRUCTURE_TYPE_BUFFER_CREATE_INFO};
  bci.pNext = &ebi;
  bci.size = size;
  bci.usage = kUsage;
  bci.sharingMode = VK_SHARING_MODE_EXCLUSIVE;
  created(f.vkCreateBuffer(m.device, &bci, nullptr, &b->buf), b->buf, "vkCreateBuffer", where);
  VkMemoryDedicatedRequirements dr{VK_STRUCTURE_TYPE_MEMORY_DEDICATED_REQUIREMENTS};
  VkMemoryRequirements2 r2{VK_STRUCTURE_TYPE_MEMORY_REQUIREMENTS_2};
  r2.pNext = &dr;
  VkBufferMemoryRequirementsInfo2 ri{VK_STRUCTURE_TYPE_BUFFER_MEMORY_REQUIREMENTS_INFO_2};
  ri.buffer = b->buf;
  f.vkGetBufferMemoryRequirements2(m.device, &ri, &r2);
  if (dr.requiresDedicatedAllocation) dedicated = true;
  // The payload is `size` bytes: the buffer must fit in it.
  if (r2.memoryRequirements.size > size)
    fail(errc::invalid_value, "the buffer needs more memory than the imported payload", "vkGetBufferMemoryRequirements2",
         where + ": needs " + std::to_string(r2.memoryRequirements.size) + " B, payload " + std::to_string(size) + " B");
  const std::uint32_t type = m.pick_type(r2.memoryRequirements.memoryTypeBits, VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT,
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
