// vmmalloc backend seam: the only layer that talks to a driver or the OS.
//
// Contract (stated once, here):
//  * Every operation returns `status` (or `result<T>`), never throws, and on failure leaves no
//    half-done state behind: a failed create() holds no memory, a failed map() maps nothing.
//  * Sizes and offsets given to create/map/unmap/set_access are multiples of granularity().minimum;
//    virtual addresses are aligned to it. Callers round (arena's job); backends check.
//  * unmap(va, size) must name exactly a range that one map() mapped (cuMemUnmap's rule).
//  * A mapped range has no access until set_access() grants it (cuMemMap's rule).
//  * release(h) may be called while h is still mapped: physical memory returns when the handle is
//    released AND every mapping of it is gone (driver reference counting; memfd has the same rule).
//  * import() returns a new handle the caller owns; the shareable handle given stays the caller's.
//  * Fences order work on streams: record_fence(stream) captures the stream's work so far;
//    fence_done() only queries (hot path); wait_fence() blocks (slow path only).
//
// Two backends ship: cuda_backend (driver API loaded at run time) and host_backend (memfd + mmap).
// Both satisfy the `backend` concept below; the arena works through `any_backend`, a type-erased
// handle, so arena and heap compile once. Optional parts are gated by capability bits.
#pragma once

#include <array>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

namespace vmm {

// ---- errors ------------------------------------------------------------------------------------

// What the core needs to know about a failure, independent of the backend.
enum class errc : int {
  ok = 0,
  out_of_memory,   // CUDA_ERROR_OUT_OF_MEMORY, ENOMEM, reservation exhausted
  invalid_value,   // bad argument (CUDA_ERROR_INVALID_VALUE, EINVAL)
  not_permitted,   // CUDA_ERROR_NOT_PERMITTED, EPERM/EACCES
  not_supported,   // CUDA_ERROR_NOT_SUPPORTED, ENOSYS
  no_driver,       // libcuda.so.1 missing, or cuInit failed with no device
  invalid_pointer, // front end: pointer not from this allocator / interior / double free
  other,
};
const char* errc_name(errc e) noexcept;

// A backend failure: generic kind + the driver's own code and name + the operation that failed.
struct status {
  errc kind = errc::ok;
  int code = 0;           // CUresult, or errno for the host backend
  const char* name = "";  // "CUDA_ERROR_OUT_OF_MEMORY", "ENOMEM" (static storage)
  const char* op = "";    // "cuMemCreate", "mmap" (static storage)

  constexpr bool ok() const noexcept { return kind == errc::ok; }
  static constexpr status success() noexcept { return {}; }
  std::string message() const;  // "cuMemCreate: CUDA_ERROR_OUT_OF_MEMORY (2)"
};

template <class T>
struct result {
  T value{};
  status st{};
  constexpr bool ok() const noexcept { return st.ok(); }
};

// ---- properties --------------------------------------------------------------------------------

enum class location_kind : std::uint8_t { device, host_numa };
enum class compression_mode : std::uint8_t { off, prefer, require };
enum class ipc_kind : std::uint8_t { none, posix_fd, fabric };
enum class access_mode : std::uint8_t { none, read, read_write };

// What a physical chunk is made of. One chunk never mixes property sets.
struct chunk_props {
  location_kind location = location_kind::device;
  int id = 0;                  // device ordinal, or NUMA node for host_numa
  bool compressible = false;   // ask for generic compression (a hint: read back what was granted)
  ipc_kind ipc = ipc_kind::none;
  friend bool operator==(const chunk_props&, const chunk_props&) = default;
};

// access_desc::device value naming the CPU: host_numa chunks are reachable from the CPU only
// after an access entry for the host (CU_MEM_LOCATION_TYPE_HOST_NUMA) is set.
inline constexpr int cpu_device = -1;

struct access_desc {
  int device = 0;   // device ordinal (host backend: simulated id), or cpu_device
  access_mode mode = access_mode::read_write;
};

struct granularity_info {
  std::size_t minimum = 0;
  std::size_t recommended = 0;
};

// What the driver actually granted for a created chunk.
struct chunk_info {
  std::size_t size = 0;
  bool compressible = false;
};

using mem_handle = std::uint64_t;  // CUmemGenericAllocationHandle, or a memfd for the host backend
using stream_t = void*;            // cudaStream_t / CUstream; host backend: any tag, nullptr = default
using fence_t = std::uint64_t;     // CUevent, or a host fence id; 0 = "no fence" (always done)

struct shareable_handle {
  ipc_kind kind = ipc_kind::none;
  int fd = -1;                                 // posix_fd: owned by whoever holds this struct
  std::array<std::uint8_t, 64> fabric{};       // CUmemFabricHandle bytes
};

struct memory_info {
  std::size_t free = 0;
  std::size_t total = 0;
};

// Optional parts of a backend. Platform differences are data, not #ifdefs.
enum capability : unsigned {
  cap_export_posix_fd = 1u << 0,
  cap_export_fabric = 1u << 1,
  cap_compression = 1u << 2,
  cap_peer_access = 1u << 3,
  cap_async_fences = 1u << 4,  // fences can be pending (GPU streams; host fences under test control)
  cap_host_access = 1u << 5,   // the CPU can read and write mapped memory (host backend)
};

// ---- the concept -------------------------------------------------------------------------------

template <class B>
concept backend = requires(B& b, const chunk_props& p, std::size_t n, std::uintptr_t va,
                           mem_handle h, std::span<const access_desc> acc, ipc_kind k,
                           const shareable_handle& sh, stream_t s, fence_t f) {
  { b.name() } -> std::convertible_to<const char*>;
  { b.capabilities() } -> std::convertible_to<unsigned>;
  { b.granularity(p) } -> std::same_as<result<granularity_info>>;
  { b.reserve(n, n) } -> std::same_as<result<std::uintptr_t>>;
  { b.free_reservation(va, n) } -> std::same_as<status>;
  { b.create(n, p) } -> std::same_as<result<mem_handle>>;
  { b.release(h) } -> std::same_as<status>;
  { b.query(h) } -> std::same_as<result<chunk_info>>;
  { b.map(va, n, h, n) } -> std::same_as<status>;
  { b.unmap(va, n) } -> std::same_as<status>;
  { b.set_access(va, n, acc) } -> std::same_as<status>;
  { b.export_handle(h, k) } -> std::same_as<result<shareable_handle>>;
  { b.import_handle(sh) } -> std::same_as<result<mem_handle>>;
  { b.record_fence(s) } -> std::same_as<result<fence_t>>;
  { b.fence_done(f) } -> std::same_as<bool>;
  { b.wait_fence(f) } -> std::same_as<status>;
  { b.drop_fence(f) } -> std::same_as<void>;
  { b.mem_info() } -> std::same_as<result<memory_info>>;
  { b.can_access_peer(0, 1) } -> std::same_as<bool>;
};

// ---- type erasure ------------------------------------------------------------------------------

// Virtual interface the arena calls. Cost: one indirect call per driver operation, which is
// noise next to the driver's 1-100 us per call. Not used on the allocation hot path.
struct backend_iface {
  virtual ~backend_iface() = default;
  virtual const char* name() = 0;
  virtual unsigned capabilities() = 0;
  virtual result<granularity_info> granularity(const chunk_props&) = 0;
  virtual result<std::uintptr_t> reserve(std::size_t size, std::size_t align) = 0;
  virtual status free_reservation(std::uintptr_t va, std::size_t size) = 0;
  virtual result<mem_handle> create(std::size_t size, const chunk_props&) = 0;
  virtual status release(mem_handle) = 0;
  virtual result<chunk_info> query(mem_handle) = 0;
  virtual status map(std::uintptr_t va, std::size_t size, mem_handle, std::size_t offset) = 0;
  virtual status unmap(std::uintptr_t va, std::size_t size) = 0;
  virtual status set_access(std::uintptr_t va, std::size_t size, std::span<const access_desc>) = 0;
  virtual result<shareable_handle> export_handle(mem_handle, ipc_kind) = 0;
  virtual result<mem_handle> import_handle(const shareable_handle&) = 0;
  virtual result<fence_t> record_fence(stream_t) = 0;
  virtual bool fence_done(fence_t) = 0;
  virtual status wait_fence(fence_t) = 0;
  virtual void drop_fence(fence_t) = 0;
  virtual result<memory_info> mem_info() = 0;
  virtual bool can_access_peer(int device, int peer) = 0;
};

template <backend B>
class backend_model final : public backend_iface {
 public:
  template <class... A>
  explicit backend_model(A&&... a) : b_(std::forward<A>(a)...) {}
  B& get() noexcept { return b_; }
  const char* name() override { return b_.name(); }
  unsigned capabilities() override { return b_.capabilities(); }
  result<granularity_info> granularity(const chunk_props& p) override { return b_.granularity(p); }
  result<std::uintptr_t> reserve(std::size_t n, std::size_t a) override { return b_.reserve(n, a); }
  status free_reservation(std::uintptr_t va, std::size_t n) override { return b_.free_reservation(va, n); }
  result<mem_handle> create(std::size_t n, const chunk_props& p) override { return b_.create(n, p); }
  status release(mem_handle h) override { return b_.release(h); }
  result<chunk_info> query(mem_handle h) override { return b_.query(h); }
  status map(std::uintptr_t va, std::size_t n, mem_handle h, std::size_t off) override { return b_.map(va, n, h, off); }
  status unmap(std::uintptr_t va, std::size_t n) override { return b_.unmap(va, n); }
  status set_access(std::uintptr_t va, std::size_t n, std::span<const access_desc> a) override { return b_.set_access(va, n, a); }
  result<shareable_handle> export_handle(mem_handle h, ipc_kind k) override { return b_.export_handle(h, k); }
  result<mem_handle> import_handle(const shareable_handle& s) override { return b_.import_handle(s); }
  result<fence_t> record_fence(stream_t s) override { return b_.record_fence(s); }
  bool fence_done(fence_t f) override { return b_.fence_done(f); }
  status wait_fence(fence_t f) override { return b_.wait_fence(f); }
  void drop_fence(fence_t f) override { b_.drop_fence(f); }
  result<memory_info> mem_info() override { return b_.mem_info(); }
  bool can_access_peer(int d, int p) override { return b_.can_access_peer(d, p); }

 private:
  B b_;
};

// ---- host backend ------------------------------------------------------------------------------

// Real host memory with the driver's semantics: memfd chunks, PROT_NONE reservations, MAP_FIXED
// mappings, mprotect for access, dup for export. Devices are simulated ids (0 = owner, others are
// peers); the CPU's page protection follows the owner's (device 0's) access mode.
struct host_backend_options {
  std::size_t granularity = std::size_t{2} << 20;  // mirrors the GPUs' 2 MiB
  std::size_t physical_limit = std::size_t{64} << 30;  // simulated device memory (create fails past it)
  int device_count = 2;                               // simulated devices, for access policies
  bool fabric_supported = false;                      // simulate fabric export (falls back otherwise)
};

class host_backend {
 public:
  explicit host_backend(host_backend_options o = {});
  ~host_backend();
  host_backend(host_backend&&) noexcept;
  host_backend& operator=(host_backend&&) = delete;

  const char* name() { return "host"; }
  unsigned capabilities();
  result<granularity_info> granularity(const chunk_props&);
  result<std::uintptr_t> reserve(std::size_t size, std::size_t align);
  status free_reservation(std::uintptr_t va, std::size_t size);
  result<mem_handle> create(std::size_t size, const chunk_props&);
  status release(mem_handle);
  result<chunk_info> query(mem_handle);
  status map(std::uintptr_t va, std::size_t size, mem_handle, std::size_t offset);
  status unmap(std::uintptr_t va, std::size_t size);
  status set_access(std::uintptr_t va, std::size_t size, std::span<const access_desc>);
  result<shareable_handle> export_handle(mem_handle, ipc_kind);
  result<mem_handle> import_handle(const shareable_handle&);
  result<fence_t> record_fence(stream_t);
  bool fence_done(fence_t);
  status wait_fence(fence_t);
  void drop_fence(fence_t);
  result<memory_info> mem_info();
  bool can_access_peer(int device, int peer);

  // --- test controls (no driver analogue) ---
  // While a stream is held, fences recorded on it stay pending until complete_stream().
  void hold_stream(stream_t);
  void complete_stream(stream_t);  // completes every pending fence of the stream and releases it
  // Simulated access a device has at va (what cuMemGetAccess would report).
  access_mode access_of(std::uintptr_t va, int device);
  // Live object counts, for leak checks.
  std::size_t live_handles();
  std::size_t live_mappings();
  std::size_t live_reservations();

 private:
  struct impl;
  std::unique_ptr<impl> p_;
};
static_assert(backend<host_backend>);

// ---- CUDA backend ------------------------------------------------------------------------------

// The driver API, loaded at run time with dlopen("libcuda.so.1") + cuGetProcAddress: the library
// has no link-time dependency on libcuda. Construction never fails hard; check `available()`.
class cuda_backend {
 public:
  explicit cuda_backend(int device = 0);
  ~cuda_backend();
  cuda_backend(cuda_backend&&) noexcept;
  cuda_backend& operator=(cuda_backend&&) = delete;

  // ok() when the driver loaded, cuInit succeeded and the device exists with VMM support;
  // otherwise the reason ("no CUDA driver: libcuda.so.1: cannot open shared object file").
  const status& load_status() const;
  bool available() const { return load_status().ok(); }
  const std::string& load_message() const;
  int device() const;

  const char* name() { return "cuda"; }
  unsigned capabilities();
  result<granularity_info> granularity(const chunk_props&);
  result<std::uintptr_t> reserve(std::size_t size, std::size_t align);
  status free_reservation(std::uintptr_t va, std::size_t size);
  result<mem_handle> create(std::size_t size, const chunk_props&);
  status release(mem_handle);
  result<chunk_info> query(mem_handle);
  status map(std::uintptr_t va, std::size_t size, mem_handle, std::size_t offset);
  status unmap(std::uintptr_t va, std::size_t size);
  status set_access(std::uintptr_t va, std::size_t size, std::span<const access_desc>);
  result<shareable_handle> export_handle(mem_handle, ipc_kind);
  result<mem_handle> import_handle(const shareable_handle&);
  result<fence_t> record_fence(stream_t);
  bool fence_done(fence_t);
  status wait_fence(fence_t);
  void drop_fence(fence_t);
  result<memory_info> mem_info();
  bool can_access_peer(int device, int peer);

  // Device facts for tools (vmm-info): attribute by CUdevice_attribute number; -1 when unknown.
  int attribute(int cu_attribute, int device) const;
  int device_count() const;
  std::string device_name(int device) const;
  int driver_version() const;

 private:
  struct impl;
  std::unique_ptr<impl> p_;
};
static_assert(backend<cuda_backend>);

// Makes a type-erased backend. `make_backend<host_backend>(opts)`.
template <backend B, class... A>
std::unique_ptr<backend_iface> make_backend(A&&... a) {
  return std::make_unique<backend_model<B>>(std::forward<A>(a)...);
}

}  // namespace vmm
