// SPDX-License-Identifier: Apache-2.0
// vmmalloc backend contract: the only layer that talks to a driver or the OS. Public for people
// who write backends; users of the allocator never need it.
//
// Contract (stated once, here; tests/backend/contract.hpp checks every rule on every backend):
//  R1 Every operation returns `status` (or `result<T>`), never throws, and on failure leaves no
//     half-done state behind: a failed create() holds no memory, a failed map() maps nothing.
//  R2 Sizes given to create/map/unmap/set_access are multiples of granularity().minimum; virtual
//     addresses are aligned to it; map() offsets are 0 (the CUDA driver supports no other: an
//     offset on the granularity into a larger handle is NOT_SUPPORTED too, H200, driver 580).
//     Callers round (the mapping layer's job); backends refuse the rest (invalid_value or
//     not_supported: the CUDA driver answers NOT_SUPPORTED for a size or offset off the granularity).
//  R3 unmap(va, size) must name exactly a range that one map() mapped (cuMemUnmap's rule); a part
//     of a mapping is refused. (Unmapping a reserved range that holds no mapping is a no-op for the
//     CUDA driver and refused by the host backend: callers never do it.)
//  R4 A mapped range has no access until set_access() grants it (cuMemMap's rule).
//  R5 release(h) may be called while h is still mapped: physical memory returns when the handle is
//     released AND every mapping of it is gone (driver reference counting; memfd has the same
//     rule). One handle may be mapped at several places at once.
//  R6 A reservation is freed whole; free_reservation of a range never reserved is refused.
//  Optional parts, each present only with its capability bits (capabilities() says which):
//  R7 ipc (cap_export_posix_fd / cap_export_fabric): export_handle() gives a shareable handle the
//     caller owns; import_handle() returns a new handle the caller owns, the shareable handle given
//     stays the caller's.
//  R8 fences (cap_async_fences): record_fence(stream) captures the stream's work so far;
//     fence_done() only queries (it is on the allocation path: must not block); wait_fence()
//     blocks (slow path only). Without the part work is synchronous: record_fence gives 0, and
//     fence 0 is always done.
//  R9 peers (cap_peer_access): can_access_peer(device, peer). Without it only the owner exists.
//  R10 compression (cap_compression): query(h) reads back what the driver granted.
//  R11 capture (cap_capture): capture_of(stream) tells whether the stream is being captured into a
//     graph (and the capture's id); exchange_capture_mode(m) swaps the calling thread's capture
//     interaction mode (cuThreadExchangeStreamCaptureMode). While a stream captures, fences are
//     not recorded or queried on it, and calls the driver counts as unsafe (memory management,
//     event queries) are made with the thread in relaxed mode. Without the part nothing captures.
//  A part a backend lacks answers errc::not_supported through the type-erased wrapper.
//
// Two backends ship: cuda_backend.hpp (driver API loaded at run time) and host_backend.hpp (memfd
// + mmap). Layers above work through `backend_iface`, a type-erased handle made by
// make_backend<B>(); test and decorator backends derive from `forwarding_backend` and override
// only what they change.
#pragma once

#include <array>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>

#include "vmmalloc/error.hpp"
#include "vmmalloc/options.hpp"  // location_kind, ipc_kind, access_desc

namespace vmm {

// ---- what crosses the seam -----------------------------------------------------------------------

// What a physical chunk is made of. One chunk never mixes property sets.
struct chunk_props {
  location_kind location = location_kind::device;
  int id = 0;                  // device ordinal, or NUMA node for host_numa
  bool compressible = false;   // ask for generic compression (a hint: read back what was granted)
  ipc_kind ipc = ipc_kind::none;
  friend bool operator==(const chunk_props&, const chunk_props&) = default;
};

struct granularity_info {
  std::size_t minimum = 0;
  std::size_t recommended = 0;
};

// What the driver actually granted for a created chunk.
struct chunk_info {
  bool compressible = false;
};

using mem_handle = std::uint64_t;  // CUmemGenericAllocationHandle, or a memfd for the host backend
using stream_t = void*;            // cudaStream_t / CUstream; host backend: any tag, nullptr = default
using fence_t = std::uint64_t;     // CUevent, or a host fence id; 0 = "no fence" (always done)

struct shareable_handle {
  ipc_kind kind = ipc_kind::none;
  int fd = -1;                                 // posix_fd: owned by whoever holds this struct
  std::array<std::uint8_t, 64> fabric{};       // CUmemFabricHandle bytes
  // Set by an allocator's export (posix_fd): the same in every export of one physical handle
  // while it lives, never reused in the process, so an importer can tell a chunk it has already
  // mapped. 0 = unknown. Not part of vmm::ipc::serialize's bytes.
  std::uint64_t export_id = 0;
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
  cap_capture = 1u << 6,       // streams can be captured into graphs (CUDA graphs)
};

// Stream capture (CUDA graphs). The values are the driver's CUstreamCaptureMode.
enum class capture_mode : int { global = 0, thread_local_ = 1, relaxed = 2 };
enum class capture_state : std::uint8_t { none, active, invalidated };
struct capture_info {
  capture_state state = capture_state::none;
  std::uint64_t id = 0;  // the capture sequence's id (unique in the process) while not none
};
inline constexpr unsigned cap_ipc = cap_export_posix_fd | cap_export_fabric;

// ---- the concepts: a core and optional parts -----------------------------------------------------

template <class B>
concept backend_core = requires(B& b, const chunk_props& p, std::size_t n, std::uintptr_t va,
                                mem_handle h, std::span<const access_desc> acc) {
  { b.name() } -> std::convertible_to<const char*>;
  { b.capabilities() } -> std::convertible_to<unsigned>;
  { b.granularity(p) } -> std::same_as<result<granularity_info>>;
  { b.reserve(n, n) } -> std::same_as<result<std::uintptr_t>>;
  { b.free_reservation(va, n) } -> std::same_as<status>;
  { b.create(n, p) } -> std::same_as<result<mem_handle>>;
  { b.release(h) } -> std::same_as<status>;
  { b.map(va, n, h, n) } -> std::same_as<status>;
  { b.unmap(va, n) } -> std::same_as<status>;
  { b.set_access(va, n, acc) } -> std::same_as<status>;
  { b.mem_info() } -> std::same_as<result<memory_info>>;
};

template <class B>
concept backend_ipc = requires(B& b, mem_handle h, ipc_kind k, const shareable_handle& sh) {
  { b.export_handle(h, k) } -> std::same_as<result<shareable_handle>>;
  { b.import_handle(sh) } -> std::same_as<result<mem_handle>>;
};

template <class B>
concept backend_fences = requires(B& b, stream_t s, fence_t f) {
  { b.record_fence(s) } -> std::same_as<result<fence_t>>;
  { b.fence_done(f) } -> std::same_as<bool>;
  { b.wait_fence(f) } -> std::same_as<status>;
  { b.drop_fence(f) } -> std::same_as<void>;
};

template <class B>
concept backend_peers = requires(B& b, int d) {
  { b.can_access_peer(d, d) } -> std::same_as<bool>;
};

template <class B>
concept backend_compression = requires(B& b, mem_handle h) {
  { b.query(h) } -> std::same_as<result<chunk_info>>;
};

template <class B>
concept backend_capture = requires(B& b, stream_t s, capture_mode m) {
  { b.capture_of(s) } -> std::same_as<result<capture_info>>;
  { b.exchange_capture_mode(m) } -> std::same_as<capture_mode>;
};

template <class B>
concept backend = backend_core<B>;

// The capability bits a type can honour: a bit whose part is missing is never reported.
template <class B>
constexpr unsigned implemented_capabilities() {
  unsigned c = cap_host_access;
  if constexpr (backend_ipc<B>) c |= cap_ipc;
  if constexpr (backend_fences<B>) c |= cap_async_fences;
  if constexpr (backend_peers<B>) c |= cap_peer_access;
  if constexpr (backend_compression<B>) c |= cap_compression;
  if constexpr (backend_capture<B>) c |= cap_capture;
  return c;
}

inline status not_supported(const char* op) { return {errc::not_supported, 0, "not supported by this backend", op}; }

// ---- type erasure ---------------------------------------------------------------------------------

// The virtual interface every layer above calls. Cost: one indirect call per driver operation,
// noise next to the driver's 1-100 us per call. fence_done() is the one call on the allocation
// path (a cross-stream reuse check), and it is a query.
struct backend_iface {
  virtual ~backend_iface() = default;
  virtual const char* name() = 0;
  virtual unsigned capabilities() = 0;
  virtual result<granularity_info> granularity(const chunk_props&) = 0;
  virtual result<std::uintptr_t> reserve(std::size_t size, std::size_t align) = 0;
  virtual status free_reservation(std::uintptr_t va, std::size_t size) = 0;
  virtual result<mem_handle> create(std::size_t size, const chunk_props&) = 0;
  virtual status release(mem_handle) = 0;
  virtual status map(std::uintptr_t va, std::size_t size, mem_handle, std::size_t offset) = 0;
  virtual status unmap(std::uintptr_t va, std::size_t size) = 0;
  virtual status set_access(std::uintptr_t va, std::size_t size, std::span<const access_desc>) = 0;
  virtual result<memory_info> mem_info() = 0;
  // optional parts (see the contract)
  virtual result<shareable_handle> export_handle(mem_handle, ipc_kind) = 0;
  virtual result<mem_handle> import_handle(const shareable_handle&) = 0;
  virtual result<fence_t> record_fence(stream_t) = 0;
  virtual bool fence_done(fence_t) = 0;
  virtual status wait_fence(fence_t) = 0;
  virtual void drop_fence(fence_t) = 0;
  virtual bool can_access_peer(int device, int peer) = 0;
  virtual result<chunk_info> query(mem_handle) = 0;
  virtual result<capture_info> capture_of(stream_t) = 0;
  virtual capture_mode exchange_capture_mode(capture_mode) = 0;
};

// Wraps a concrete backend B: forwards the parts B has, answers not_supported for the rest.
template <backend B>
class backend_model final : public backend_iface {
 public:
  template <class... A>
  explicit backend_model(A&&... a) : b_(std::forward<A>(a)...) {}
  B& get() noexcept { return b_; }
  const char* name() override { return b_.name(); }
  unsigned capabilities() override { return b_.capabilities() & implemented_capabilities<B>(); }
  result<granularity_info> granularity(const chunk_props& p) override { return b_.granularity(p); }
  result<std::uintptr_t> reserve(std::size_t n, std::size_t a) override { return b_.reserve(n, a); }
  status free_reservation(std::uintptr_t va, std::size_t n) override { return b_.free_reservation(va, n); }
  result<mem_handle> create(std::size_t n, const chunk_props& p) override { return b_.create(n, p); }
  status release(mem_handle h) override { return b_.release(h); }
  status map(std::uintptr_t va, std::size_t n, mem_handle h, std::size_t off) override { return b_.map(va, n, h, off); }
  status unmap(std::uintptr_t va, std::size_t n) override { return b_.unmap(va, n); }
  status set_access(std::uintptr_t va, std::size_t n, std::span<const access_desc> a) override { return b_.set_access(va, n, a); }
  result<memory_info> mem_info() override { return b_.mem_info(); }

  result<shareable_handle> export_handle(mem_handle h, ipc_kind k) override {
    if constexpr (backend_ipc<B>) return b_.export_handle(h, k);
    else return {{}, not_supported("export_handle")};
  }
  result<mem_handle> import_handle(const shareable_handle& s) override {
    if constexpr (backend_ipc<B>) return b_.import_handle(s);
    else return {0, not_supported("import_handle")};
  }
  result<fence_t> record_fence(stream_t s) override {
    if constexpr (backend_fences<B>) return b_.record_fence(s);
    else return {0, {}};  // synchronous: nothing is ever pending
  }
  bool fence_done(fence_t f) override {
    if constexpr (backend_fences<B>) return b_.fence_done(f);
    else return true;
  }
  status wait_fence(fence_t f) override {
    if constexpr (backend_fences<B>) return b_.wait_fence(f);
    else return {};
  }
  void drop_fence(fence_t f) override {
    if constexpr (backend_fences<B>) b_.drop_fence(f);
  }
  bool can_access_peer(int d, int p) override {
    if constexpr (backend_peers<B>) return b_.can_access_peer(d, p);
    else return d == p;
  }
  result<chunk_info> query(mem_handle h) override {
    if constexpr (backend_compression<B>) return b_.query(h);
    else return {{}, not_supported("query")};
  }
  result<capture_info> capture_of(stream_t s) override {
    if constexpr (backend_capture<B>) return b_.capture_of(s);
    else return {{}, {}};  // nothing ever captures
  }
  capture_mode exchange_capture_mode(capture_mode m) override {
    if constexpr (backend_capture<B>) return b_.exchange_capture_mode(m);
    else return m;
  }

 private:
  B b_;
};

// Makes a type-erased backend. `make_backend<host_backend>(opts)`.
template <backend B, class... A>
std::unique_ptr<backend_iface> make_backend(A&&... a) {
  return std::make_unique<backend_model<B>>(std::forward<A>(a)...);
}

// The concrete backend inside a type-erased one (nullptr when it is something else), e.g. a
// host_backend's test controls.
template <backend B>
B* backend_cast(backend_iface& b) {
  auto* m = dynamic_cast<backend_model<B>*>(&b);
  return m ? &m->get() : nullptr;
}

// A decorator base: forwards every call to an inner backend. Fault injection, spies and test
// devices derive from it and override only the calls they change.
class forwarding_backend : public backend_iface {
 public:
  explicit forwarding_backend(std::unique_ptr<backend_iface> inner) : own_(std::move(inner)), in_(own_.get()) {}
  explicit forwarding_backend(backend_iface& inner) : in_(&inner) {}  // not owned: must outlive this
  backend_iface& inner() noexcept { return *in_; }
  const char* name() override { return in_->name(); }
  unsigned capabilities() override { return in_->capabilities(); }
  result<granularity_info> granularity(const chunk_props& p) override { return in_->granularity(p); }
  result<std::uintptr_t> reserve(std::size_t n, std::size_t a) override { return in_->reserve(n, a); }
  status free_reservation(std::uintptr_t va, std::size_t n) override { return in_->free_reservation(va, n); }
  result<mem_handle> create(std::size_t n, const chunk_props& p) override { return in_->create(n, p); }
  status release(mem_handle h) override { return in_->release(h); }
  status map(std::uintptr_t va, std::size_t n, mem_handle h, std::size_t off) override { return in_->map(va, n, h, off); }
  status unmap(std::uintptr_t va, std::size_t n) override { return in_->unmap(va, n); }
  status set_access(std::uintptr_t va, std::size_t n, std::span<const access_desc> a) override { return in_->set_access(va, n, a); }
  result<memory_info> mem_info() override { return in_->mem_info(); }
  result<shareable_handle> export_handle(mem_handle h, ipc_kind k) override { return in_->export_handle(h, k); }
  result<mem_handle> import_handle(const shareable_handle& s) override { return in_->import_handle(s); }
  result<fence_t> record_fence(stream_t s) override { return in_->record_fence(s); }
  bool fence_done(fence_t f) override { return in_->fence_done(f); }
  status wait_fence(fence_t f) override { return in_->wait_fence(f); }
  void drop_fence(fence_t f) override { in_->drop_fence(f); }
  bool can_access_peer(int d, int p) override { return in_->can_access_peer(d, p); }
  result<chunk_info> query(mem_handle h) override { return in_->query(h); }
  result<capture_info> capture_of(stream_t s) override { return in_->capture_of(s); }
  capture_mode exchange_capture_mode(capture_mode m) override { return in_->exchange_capture_mode(m); }

 private:
  std::unique_ptr<backend_iface> own_;
  backend_iface* in_;
};

}  // namespace vmm
