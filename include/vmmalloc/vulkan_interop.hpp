// SPDX-License-Identifier: Apache-2.0
// vmmalloc <-> Vulkan: external memory and external semaphores (opaque POSIX fds).
//
//   export   vmmalloc memory -> Vulkan   ctx.import_chunks(alloc.export_ipc(p))  VkBuffers over p's chunks
//   import   Vulkan memory -> vmmalloc   external_arena::import(api, buf.export_fd(), ...)
//                                        sub-allocates the imported memory, stream-ordered
//   sync     Vulkan semaphores in CUDA   external_semaphore::import(api, sem.export_fd(), kind)
//                                        release_after(sem, value, arena_or_allocator, p, stream)
//
// Two libraries:
//  * vmmalloc_interop_core (always built; no Vulkan headers, no CUDA runtime): external_arena,
//    external_semaphore, release_after. The CUDA calls they make go through `external_api`, an
//    interface, so the bookkeeping and the fd rules are tested on a fake in CI.
//  * vmmalloc_vulkan (built when the Vulkan headers are found): cuda_external_api() (the CUDA
//    runtime's cudaImportExternalMemory & co., linked statically: it loads libcuda at run time) and
//    vk::context (the Vulkan loader loaded at run time with dlopen("libvulkan.so.1"): no link-time
//    dependency on libvulkan, so programs start where no loader is installed and say so).
//
// fd rule, for every function here that takes an fd: the fd given stays the caller's, whatever
// happens. The library imports a dup() of it; after a successful import the dup belongs to CUDA or
// Vulkan (the seed's rule: the importer owns the fd it was given and closes it itself), after a
// failed one the library closes the dup. So an RAII holder (ipc::export_handle) keeps working, and
// nothing leaks or is closed twice on any failure path. Cost: one dup()/close() per import.
//
// Errors: functions without try_ throw vmm::error / vmm::out_of_memory with the reason; try_
// functions return the status and never throw. Bad input leaves the object as it was.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "vmmalloc/ipc.hpp"
#include "vmmalloc/vmmalloc.hpp"

// Vulkan handles, declared exactly as vulkan_core.h declares them on 64-bit targets
// (VK_DEFINE_HANDLE / VK_DEFINE_NON_DISPATCHABLE_HANDLE), so this header needs no Vulkan headers.
// Repeating an identical typedef is allowed, so <vulkan/vulkan.h> may come before or after.
#ifndef VULKAN_CORE_H_
typedef struct VkInstance_T* VkInstance;
typedef struct VkPhysicalDevice_T* VkPhysicalDevice;
typedef struct VkDevice_T* VkDevice;
typedef struct VkQueue_T* VkQueue;
typedef struct VkCommandBuffer_T* VkCommandBuffer;
typedef struct VkBuffer_T* VkBuffer;
typedef struct VkDeviceMemory_T* VkDeviceMemory;
typedef struct VkSemaphore_T* VkSemaphore;
#endif

namespace vmm::vk {

enum class semaphore_kind : std::uint8_t { binary, timeline };
const char* semaphore_kind_name(semaphore_kind k) noexcept;

// ---- the CUDA side, behind an interface -----------------------------------------------------------

// The CUDA calls of external-resource interop. Every call returns a status and never throws.
// Handles are opaque pointers (cudaExternalMemory_t, cudaExternalSemaphore_t); fences are the
// backend's fence_t (a CUDA event). fd rule of the raw calls (CUDA's): import_memory /
// import_semaphore take ownership of the fd on success only.
class external_api {
 public:
  virtual ~external_api() = default;
  virtual const char* name() = 0;
  // cudaImportExternalMemory, handle type OpaqueFd; `dedicated` sets cudaExternalMemoryDedicated.
  virtual result<void*> import_memory(int fd, std::uint64_t size, bool dedicated) = 0;
  // cudaExternalMemoryGetMappedBuffer: a device pointer to [offset, offset + size) of the memory.
  virtual result<void*> map_buffer(void* memory, std::uint64_t offset, std::uint64_t size) = 0;
  virtual status free_buffer(void* ptr) = 0;        // cudaFree of a mapped buffer
  virtual status destroy_memory(void* memory) = 0;  // cudaDestroyExternalMemory (closes its fd)
  // cudaImportExternalSemaphore: OpaqueFd (binary) or TimelineSemaphoreFd (timeline).
  virtual result<void*> import_semaphore(int fd, semaphore_kind) = 0;
  // cudaSignal/WaitExternalSemaphoresAsync on a stream; binary semaphores ignore the value.
  virtual status signal_semaphore(void* sem, std::uint64_t value, stream_t) = 0;
  virtual status wait_semaphore(void* sem, std::uint64_t value, stream_t) = 0;
  virtual status destroy_semaphore(void* sem) = 0;  // cudaDestroyExternalSemaphore
  // Stream-ordered reuse: a fence captures a stream's work so far (cudaEventRecord).
  virtual result<fence_t> record_fence(stream_t) = 0;
  virtual bool fence_done(fence_t) = 0;  // query only (cudaEventQuery)
  virtual status wait_fence(fence_t) = 0;  // blocks (cudaEventSynchronize)
  virtual void drop_fence(fence_t) = 0;
};

// The CUDA runtime's implementation, on CUDA device `device` (each call makes it current and
// restores the caller's device). In vmmalloc_vulkan. Never throws; the first call that needs the
// driver reports a missing one (cudaErrorInsufficientDriver / cudaErrorNoDevice) as errc::no_driver.
std::shared_ptr<external_api> cuda_external_api(int device = 0);

// ---- import: external memory adopted as an arena --------------------------------------------------

struct arena_options {
  std::uint64_t alignment = 256;  // default and minimum alignment; block sizes round up to it
};

struct arena_stats {
  std::uint64_t capacity = 0;        // bytes of the mapped buffer
  std::uint64_t allocated = 0;       // bytes in live blocks (rounded sizes)
  std::uint64_t requested = 0;       // bytes asked for by the live blocks
  std::uint64_t deferred = 0;        // bytes freed on a stream whose fence has not completed
  std::uint64_t free = 0;            // capacity - allocated - deferred
  std::uint64_t largest_free = 0;    // largest free block (what any stream can get now)
  std::uint64_t live = 0;            // live blocks
  std::uint64_t deferred_blocks = 0;
  std::uint64_t allocs = 0, frees = 0, reused_same_stream = 0;
};

// Memory imported from an fd (a Vulkan VkDeviceMemory exported as an opaque fd), mapped once as one
// buffer, and sub-allocated. The sub-allocator is a first-fit over an address-ordered block map:
// O(blocks) per call, meant for tens to thousands of buffers shared with Vulkan, not for the hot
// path (vmm::allocator is for that). Adjacent free blocks merge at once.
//
// Stream order, as vmm::allocator: deallocate(p, s) records a fence on s; the block is reused by an
// allocation on s at once (stream order makes it safe) and by any other stream only after that
// fence has completed. Fences are queried on the allocation path, never waited on.
// offset_of(p) is p's offset in the imported memory: the offset to use in the Vulkan buffer that
// the memory is bound to. Thread-safe (one mutex).
//
// Teardown (destructor or close()): waits for the fences of deferred blocks, frees the mapped
// buffer, then destroys the external memory (the seed's order). Destroy it only after the streams
// that used it and the Vulkan work on the memory have finished: cudaFree synchronises the device.
class external_arena {
 public:
  // Imports a dup() of fd (see the fd rule at the top), maps [0, size) as one buffer.
  // size: the VkMemoryAllocateInfo::allocationSize of the exported memory. dedicated: the memory
  // was allocated with VkMemoryDedicatedAllocateInfo. Throws vmm::error on bad arguments (null api,
  // fd < 0, size 0, alignment not a power of two) or a failed import / map (nothing leaks).
  static external_arena import(std::shared_ptr<external_api> api, int fd, std::uint64_t size,
                               bool dedicated, const arena_options& o = {});
  static status try_import(std::shared_ptr<external_api> api, int fd, std::uint64_t size,
                           bool dedicated, external_arena& out, const arena_options& o = {}) noexcept;

  external_arena();  // empty: owns nothing
  external_arena(external_arena&&) noexcept;
  external_arena& operator=(external_arena&&) noexcept;
  ~external_arena();
  status close() noexcept;  // teardown now (see above); idempotent

  // alignment 0 = options.alignment; a power of two. Throws out_of_memory when no block fits (the
  // message says how much is deferred on other streams), error(invalid_value) for size 0 or a bad
  // alignment. Never returns null.
  void* allocate(std::uint64_t bytes, std::uint64_t alignment = 0, stream_t s = nullptr);
  void* try_allocate(std::uint64_t bytes, std::uint64_t alignment = 0, stream_t s = nullptr) noexcept;
  // nullptr is a no-op. A pointer that is not a live block's start: error(invalid_pointer), nothing
  // changed. A failed fence record leaves the block live.
  void deallocate(void* p, stream_t s = nullptr);
  status try_deallocate(void* p, stream_t s = nullptr) noexcept;

  bool owns(const void* p) const noexcept;             // p is the start of a live block
  std::uint64_t offset_of(const void* p) const;        // throws invalid_pointer outside the buffer
  void* base() const noexcept;                          // the mapped buffer (null when empty)
  std::uint64_t size() const noexcept;
  bool dedicated() const noexcept;
  arena_stats stats() const;
  // Waits for every deferred block's fence (blocking), then returns those blocks to the free list.
  status synchronize() noexcept;
  // Walks the block map: "" when every invariant holds (blocks tile [0, size), no two free
  // neighbours, deferred blocks hold a fence, the stats add up), else what is wrong.
  std::string check() const;

 private:
  struct impl;
  std::unique_ptr<impl> p_;
};

// ---- semaphores -----------------------------------------------------------------------------------

// A semaphore imported into CUDA (from a Vulkan semaphore exported as an opaque fd). Binary
// semaphores take value 0 (anything else is invalid_value: CUDA would ignore it silently); timeline
// semaphores take the counter value to signal / wait for. Vulkan's rule for binary semaphores holds:
// a wait must be queued after the signal it waits for has been submitted.
class external_semaphore {
 public:
  // Imports a dup() of fd (the fd rule above). Throws vmm::error.
  static external_semaphore import(std::shared_ptr<external_api> api, int fd, semaphore_kind kind);
  static status try_import(std::shared_ptr<external_api> api, int fd, semaphore_kind kind,
                           external_semaphore& out) noexcept;

  external_semaphore();
  external_semaphore(external_semaphore&&) noexcept;
  external_semaphore& operator=(external_semaphore&&) noexcept;
  ~external_semaphore();  // cudaDestroyExternalSemaphore
  status close() noexcept;

  semaphore_kind kind() const noexcept;
  bool valid() const noexcept;
  void signal(std::uint64_t value, stream_t s);  // queued on s
  void wait(std::uint64_t value, stream_t s);    // s waits on the GPU; the host does not block
  status try_signal(std::uint64_t value, stream_t s) noexcept;
  status try_wait(std::uint64_t value, stream_t s) noexcept;

 private:
  std::shared_ptr<external_api> api_;
  void* sem_ = nullptr;
  semaphore_kind kind_ = semaphore_kind::binary;
};

// "A block used by Vulkan is not reused until its semaphore has signalled": queues a wait for
// `value` on s, then frees p on s (stream-ordered). Another stream gets the block only after the
// fence recorded behind that wait completes, i.e. after the semaphore reached `value`; s itself may
// reuse it at once, ordered behind the wait. p is checked first: a foreign or freed pointer throws
// invalid_pointer with nothing queued.
void release_after(external_semaphore& sem, std::uint64_t value, external_arena& a, void* p, stream_t s);
void release_after(external_semaphore& sem, std::uint64_t value, allocator& a, void* p, stream_t s);

// ---- the Vulkan side (vmmalloc_vulkan) ------------------------------------------------------------

struct device_info {
  std::uint32_t loader_version = 0;   // vkEnumerateInstanceVersion (the loader's instance version)
  std::uint32_t api_version = 0;      // the physical device's
  std::uint32_t driver_version = 0;   // raw VkPhysicalDeviceProperties::driverVersion
  std::uint32_t vendor_id = 0, device_id = 0;
  std::string name, driver_name, driver_info;  // driver_*: VkPhysicalDeviceDriverProperties
  std::array<std::uint8_t, 16> uuid{};
  std::uint32_t queue_family = 0;
  bool semaphore_fd = false;          // VK_KHR_external_semaphore_fd enabled
  bool timeline = false;              // timeline semaphores enabled (Vulkan 1.2 feature)
};
std::string version_string(std::uint32_t vk_version);  // "1.3.239"
std::string describe(const device_info&);  // one line: name, driver, versions

// A Vulkan buffer with its memory. Device-local (exportable or imported) or host-visible (mapped).
class buffer {
 public:
  buffer();
  buffer(buffer&&) noexcept;
  buffer& operator=(buffer&&) noexcept;
  ~buffer();  // vkDestroyBuffer, vkFreeMemory
  VkBuffer handle() const noexcept;
  VkDeviceMemory memory() const noexcept;
  std::uint64_t size() const noexcept;             // the buffer's size
  std::uint64_t allocation_size() const noexcept;  // the memory's allocationSize (CUDA import size)
  bool dedicated() const noexcept;                 // allocated with VkMemoryDedicatedAllocateInfo
  void* mapped() const noexcept;                   // host-visible buffers: the mapping, else null
  // Exportable buffers: a new opaque fd (vkGetMemoryFdKHR), owned by the caller.
  int export_fd() const;

  struct impl;
 private:
  friend class context;
  std::unique_ptr<impl> p_;
};

class semaphore {
 public:
  semaphore();
  semaphore(semaphore&&) noexcept;
  semaphore& operator=(semaphore&&) noexcept;
  ~semaphore();
  VkSemaphore handle() const noexcept;
  semaphore_kind kind() const noexcept;
  int export_fd() const;  // a new opaque fd (vkGetSemaphoreFdKHR), owned by the caller
  // Timeline only: vkGetSemaphoreCounterValue, vkSignalSemaphore (host), vkWaitSemaphores (host,
  // false on timeout).
  std::uint64_t value() const;
  void signal(std::uint64_t value);
  bool wait(std::uint64_t value, std::chrono::nanoseconds timeout) const;

  struct impl;
 private:
  friend class context;
  std::unique_ptr<impl> p_;
};

// One queue submission with its fence. The destructor waits for it for at most 10 s; past that it
// leaves the command buffer and fence allocated (freeing them in use would be undefined) and says so
// on stderr.
class submission {
 public:
  submission();
  submission(submission&&) noexcept;
  submission& operator=(submission&&) noexcept;
  ~submission();
  bool wait(std::chrono::nanoseconds timeout);  // vkWaitForFences; false on timeout
  bool done() const;

  struct impl;
 private:
  friend class context;
  std::unique_ptr<impl> p_;
};

struct semaphore_op {
  const semaphore* sem = nullptr;
  std::uint64_t value = 0;  // timeline value; 0 for binary semaphores
};

enum class buffer_kind : std::uint8_t {
  exportable,    // device-local, exportable as an opaque fd (VkExportMemoryAllocateInfo)
  host_visible,  // host-visible + coherent, mapped (read-backs)
  device_local,  // device-local, not exportable
};

// A Vulkan instance and device on one physical device, with VK_KHR_external_memory_fd (and, where
// the driver has them, VK_KHR_external_semaphore_fd and timeline semaphores) enabled; one queue of a
// family with compute or graphics. The loader is dlopen'ed; every VkResult is checked and a failure
// throws vmm::error naming the call and the VkResult. Not thread-safe (one command pool).
// Objects made by a context keep its device alive: they may outlive the context object.
class context {
 public:
  // The physical device whose deviceUUID is `uuid`; with no uuid the first one. Throws vmm::error:
  // errc::no_driver when there is no loader, no ICD or no physical device (a reason to skip),
  // errc::not_supported when no device matches or lacks VK_KHR_external_memory_fd.
  static context open(const std::array<std::uint8_t, 16>* uuid = nullptr);
  // The physical device of CUDA device `cuda_device` (UUID from the CUDA runtime). vmmalloc_vulkan.
  static context open_for_cuda(int cuda_device);

  context(context&&) noexcept;
  context& operator=(context&&) noexcept;
  ~context();  // vkDeviceWaitIdle only when every submission has finished (no hang on a stuck one)

  const device_info& info() const noexcept;
  VkInstance instance() const noexcept;
  VkPhysicalDevice physical_device() const noexcept;
  VkDevice device() const noexcept;
  VkQueue queue() const noexcept;
  // A device-level (or instance-level) function: cast to the PFN_ type. Null when absent.
  using void_fn = void (*)();
  void_fn proc(const char* name) const;

  buffer create_buffer(std::uint64_t size, buffer_kind kind, bool dedicated = false);
  // Imports an opaque fd exported by CUDA (cuMemExportToShareableHandle) as device-local memory of
  // `size` bytes bound to a new buffer of that size; the fd rule above (a dup is imported).
  buffer import_fd(int fd, std::uint64_t size);
  // One buffer per chunk of a vmmalloc export (allocator::export_ipc with options.ipc = posix_fd):
  // chunk i's buffer covers the whole chunk; the allocation starts at h.offset in chunk 0.
  // The handle keeps its fds.
  std::vector<buffer> import_chunks(const ipc::export_handle& h);

  semaphore create_semaphore(semaphore_kind kind, std::uint64_t initial = 0, bool exportable = true);

  // Records `record` into a fresh command buffer and submits it with the given waits and signals;
  // a global memory barrier (all writes -> host reads) is appended so that host reads after the
  // fence see the results. Waits use VK_PIPELINE_STAGE_ALL_COMMANDS_BIT.
  submission submit(const std::function<void(VkCommandBuffer)>& record,
                    std::initializer_list<semaphore_op> waits = {},
                    std::initializer_list<semaphore_op> signals = {});

  // Command helpers for record callbacks (vkCmdFillBuffer: offset and size multiples of 4).
  void cmd_fill(VkCommandBuffer cb, const buffer& b, std::uint64_t offset, std::uint64_t size,
                std::uint32_t value) const;
  void cmd_copy(VkCommandBuffer cb, const buffer& src, std::uint64_t src_offset, const buffer& dst,
                std::uint64_t dst_offset, std::uint64_t size) const;
  // A full memory barrier between commands of one command buffer (transfer after transfer).
  void cmd_barrier(VkCommandBuffer cb) const;

  struct impl;
 private:
  context();
  std::shared_ptr<impl> p_;
};

}  // namespace vmm::vk
