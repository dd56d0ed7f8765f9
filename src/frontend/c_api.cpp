// SPDX-License-Identifier: Apache-2.0
// C API over vmm::allocator. Exceptions never cross the boundary; every failure becomes a status
// and the thread-local last error.
#include "vmmalloc/vmmalloc.h"

#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <type_traits>

#include "backend/c_status.hpp"  // the last error, shared with the buffer's and KV cache's C API
#include "vmmalloc/vmmalloc.hpp"

struct vmm_allocator {
  vmm::allocator a;
};

vmm::allocator& vmm::from_c(vmm_allocator* a) noexcept { return a->a; }

namespace {
using vmm::c_api::invalid;
using vmm::c_api::ok;
using vmm::c_api::set;
using vmm::c_api::tl_message;
using vmm::c_api::tl_status;
using vmm::c_api::to_c;
vmm_status from_last() {
  auto& le = vmm::last_error();
  return set(to_c(le.st.kind), le.message);
}
// A C caller may store any int in an enum field; reading it as the C++ enum type would be
// undefined for out-of-range values, so read the bytes as an int.
template <class E>
int as_int(const E& e) {
  static_assert(sizeof(E) == sizeof(int));
  int v;
  std::memcpy(&v, &e, sizeof v);
  return v;
}

// ---- vmm_policy <-> vmm::options, by options.def's kind ----------------------------------------
// from_c_<kind>: nullptr, or what is wrong with the C value. A kind without one (peers) cannot be
// in_c: the row's expansion below does not compile.

// The C enums mirror the C++ ones value for value, so a range check and a cast convert them.
static_assert(VMM_LOCATION_DEVICE == int(vmm::location_kind::device) &&
              VMM_LOCATION_HOST_NUMA == int(vmm::location_kind::host_numa));
static_assert(VMM_COMPRESSION_OFF == int(vmm::compression_mode::off) &&
              VMM_COMPRESSION_PREFER == int(vmm::compression_mode::prefer) &&
              VMM_COMPRESSION_REQUIRE == int(vmm::compression_mode::require));
static_assert(VMM_IPC_NONE == int(vmm::ipc_kind::none) && VMM_IPC_POSIX_FD == int(vmm::ipc_kind::posix_fd) &&
              VMM_IPC_FABRIC == int(vmm::ipc_kind::fabric));
template <class C, class E>
const char* from_c_enum(const C& c, E& out) {
  const int v = as_int(c);
  if (v < 0 || static_cast<std::size_t>(v) >= vmm::enum_names(E{}).size()) return "is not one of its enumerators";
  out = static_cast<E>(v);
  return nullptr;
}
template <class C, class E>
const char* from_c_location(const C& c, E& out) { return from_c_enum(c, out); }
template <class C, class E>
const char* from_c_compression(const C& c, E& out) { return from_c_enum(c, out); }
template <class C, class E>
const char* from_c_ipc(const C& c, E& out) { return from_c_enum(c, out); }

template <class C, class T>
const char* from_c_value(const C& c, T& out) {
  out = c;
  return nullptr;
}
template <class C, class T>
const char* from_c_int(const C& c, T& out) { return from_c_value(c, out); }
template <class C, class T>
const char* from_c_size(const C& c, T& out) { return from_c_value(c, out); }
template <class C, class T>
const char* from_c_size_or_max(const C& c, T& out) { return from_c_value(c, out); }
template <class C, class T>
const char* from_c_bool(const C& c, T& out) { return from_c_value(c != 0, out); }
template <class C, class T>
const char* from_c_pow2(const C& c, T& out) {
  if (c == 0 || (c & (c - 1))) return "is not a power of two";
  return from_c_value(c, out);
}
const char* from_c_path(const char* c, std::string& out) {
  out = c ? c : "";
  return nullptr;
}

// in_c 1: 0 (NULL) means the default, so only other values are read.
template <class C>
bool is_zero(const C& c) {
  if constexpr (std::is_enum_v<C>) return as_int(c) == 0;
  else return c == C{};
}

// vmm_policy_init's value for an in_c 2 field: the C++ default.
template <class C, class T>
void init_c(C& c, const T& v) { c = static_cast<C>(v); }

vmm_status bad_field(const char* field, const char* what) {
  return set(VMM_ERROR_INVALID_VALUE, std::string("vmm_create: policy.") + field + " " + what);
}
}  // namespace

namespace {
// A call on the allocator: NULL refused, every exception turned into a status and message.
template <class F>
vmm_status allocator_call(vmm_allocator* a, const char* fn, F&& f) {
  if (!a) return set(VMM_ERROR_INVALID_VALUE, std::string(fn) + ": allocator is NULL");
  try {
    f();
  } catch (const vmm::error& e) {
    return set(to_c(e.st().kind), e.what());
  } catch (const vmm::out_of_memory& e) {
    return set(VMM_ERROR_OUT_OF_MEMORY, e.what());
  } catch (const std::exception& e) {
    return set(VMM_ERROR_OTHER, std::string(fn) + ": " + e.what());
  }
  return ok();
}
}  // namespace

extern "C" {

void vmm_policy_init(vmm_policy* p) {
  if (!p) return;
  *p = vmm_policy{};
  const vmm::options d;
#define VMM_C_INIT_0(name)
#define VMM_C_INIT_1(name)
#define VMM_C_INIT_2(name) init_c(p->name, d.name);
#define VMM_OPTION(kind, type, name, def, env, in_c, doc) VMM_C_INIT_##in_c(name)
#include "vmmalloc/options.def"
#undef VMM_OPTION
#undef VMM_C_INIT_0
#undef VMM_C_INIT_1
#undef VMM_C_INIT_2
}

vmm_status vmm_create(const vmm_policy* p, vmm_allocator** out) {
  if (!p || !out) return invalid("vmm_create: policy and out must not be NULL");
  *out = nullptr;
  vmm::options o;
  // Every row with in_c != 0 (options.def), converted by its kind.
#define VMM_C_READ_0(kind, name)
#define VMM_C_READ_1(kind, name) \
  if (!is_zero(p->name)) {         \
    VMM_C_READ_2(kind, name)       \
  }
#define VMM_C_READ_2(kind, name) \
  if (const char* bad = from_c_##kind(p->name, o.name)) return bad_field(#name, bad);
#define VMM_OPTION(kind, type, name, def, env, in_c, doc) VMM_C_READ_##in_c(kind, name)
#include "vmmalloc/options.def"
#undef VMM_OPTION
#undef VMM_C_READ_0
#undef VMM_C_READ_1
#undef VMM_C_READ_2
  const int backend = as_int(p->backend);
  try {
    if (backend == VMM_BACKEND_HOST) {
      vmm::host_backend_options h;
      if (p->host_granularity) h.granularity = p->host_granularity;
      if (p->host_physical_limit) h.physical_limit = p->host_physical_limit;
      *out = new vmm_allocator{vmm::allocator::host(o, h)};
    } else if (backend == VMM_BACKEND_CUDA) {
      *out = new vmm_allocator{vmm::allocator(o)};
    } else {
      return invalid("vmm_create: unknown backend");
    }
  } catch (const vmm::error& e) {
    return set(to_c(e.st().kind), e.what());
  } catch (const vmm::out_of_memory& e) {
    return set(VMM_ERROR_OUT_OF_MEMORY, e.what());
  } catch (const std::exception& e) {
    return set(VMM_ERROR_OTHER, e.what());
  }
  return ok();
}

void vmm_destroy(vmm_allocator* a) { delete a; }

void* vmm_malloc_async(vmm_allocator* a, size_t size, void* stream) {
  if (!a) return invalid("vmm_malloc: allocator is NULL"), nullptr;
  void* p = a->a.try_allocate(size, 0, stream);
  if (!p) from_last(); else ok();
  return p;
}
void* vmm_malloc(vmm_allocator* a, size_t size) { return vmm_malloc_async(a, size, nullptr); }

void* vmm_aligned_alloc(vmm_allocator* a, size_t alignment, size_t size) {
  if (!a) return invalid("vmm_aligned_alloc: allocator is NULL"), nullptr;
  if (alignment == 0) return invalid("vmm_aligned_alloc: alignment 0"), nullptr;
  void* p = a->a.try_allocate(size, alignment, nullptr);
  if (!p) from_last(); else ok();
  return p;
}

vmm_status vmm_free_async(vmm_allocator* a, void* ptr, void* stream) {
  if (!a) return invalid("vmm_free: allocator is NULL");
  return a->a.try_deallocate(ptr, stream).ok() ? ok() : from_last();
}
vmm_status vmm_free(vmm_allocator* a, void* ptr) { return vmm_free_async(a, ptr, nullptr); }

vmm_status vmm_record_stream(vmm_allocator* a, void* ptr, void* stream) {
  if (!a) return invalid("vmm_record_stream: allocator is NULL");
  try {
    a->a.record_stream(ptr, stream);
  } catch (const vmm::error& e) {
    return set(to_c(e.st().kind), e.what());
  }
  return ok();
}

void* vmm_calloc_n(vmm_allocator* a, size_t count, size_t size) {
  if (!a) return invalid("vmm_calloc_n: allocator is NULL"), nullptr;
  size_t bytes;
  if (__builtin_mul_overflow(count, size, &bytes))
    return set(VMM_ERROR_OUT_OF_MEMORY, "vmm_calloc_n: count * size overflows"), nullptr;
  return vmm_malloc(a, bytes);
}

vmm_status vmm_trim(vmm_allocator* a, size_t keep) {
  return allocator_call(a, "vmm_trim", [&] { a->a.trim(keep); });
}

vmm_status vmm_get_stats(vmm_allocator* a, vmm_stats* out) {
  if (!a || !out) return invalid("vmm_get_stats: NULL argument");
  auto s = a->a.stats();
  *out = vmm_stats{s.requested, s.allocated, s.mapped, s.physical, s.reserved,
                   s.peak_mapped, s.peak_physical,
                   s.chunks, s.allocs, s.frees, s.live,
                   s.calls.total(), s.calls.create, s.calls.map, s.calls.unmap, s.calls.set_access, s.calls.release,
                   s.idle, s.free_chunk_bytes, s.slab_bytes, s.deferred,
                   s.grows, s.chunk_releases, s.trims, s.stitched,
                   s.compression_fallbacks, s.ipc_fallbacks, s.access_changes, s.exported, s.exported_released,
                   s.traced_events, s.fragmentation, s.reclaims, s.chunks_retired, s.pools,
                   s.pool_allocated, s.pool_held, s.margin_trims,
                   s.calls.ns, s.calls.fence_ns};
  return ok();
}
vmm_status vmm_reset_peaks(vmm_allocator* a) {
  if (!a) return invalid("vmm_reset_peaks: allocator is NULL");
  a->a.reset_peaks();
  return ok();
}
vmm_status vmm_set_memory_limit(vmm_allocator* a, size_t bytes) {
  return allocator_call(a, "vmm_set_memory_limit",
                        [&] { a->a.set_memory_limit(bytes ? bytes : std::numeric_limits<std::size_t>::max()); });
}
vmm_status vmm_get_memory_limit(vmm_allocator* a, size_t* bytes) {
  if (!a || !bytes) return invalid("vmm_get_memory_limit: NULL argument");
  const std::size_t limit = a->a.memory_limit();
  *bytes = limit == std::numeric_limits<std::size_t>::max() ? 0 : limit;
  return ok();
}
vmm_status vmm_get_class_stats(vmm_allocator* a, vmm_class_stats* out, size_t cap, size_t* count) {
  if (!a || !count || (cap && !out)) return invalid("vmm_get_class_stats: NULL argument");
  try {
    auto v = a->a.class_stats();
    *count = v.size();
    for (size_t i = 0; i < v.size() && i < cap; ++i)
      out[i] = {v[i].slot_size, v[i].slabs, v[i].slots, v[i].used_slots, v[i].cached_slots, v[i].live_bytes};
  } catch (const std::bad_alloc&) {
    return set(VMM_ERROR_OUT_OF_MEMORY, "vmm_get_class_stats: host memory");
  }
  return ok();
}
vmm_status vmm_get_memory_map(vmm_allocator* a, vmm_block_record* out, size_t cap, size_t* count) {
  if (!a || !count || (cap && !out)) return invalid("vmm_get_memory_map: NULL argument");
  static_assert(static_cast<int>(vmm::block_state::pending_free) == VMM_BLOCK_PENDING_FREE);
  try {
    size_t n = 0;
    for (const auto& seg : a->a.memory_map())
      for (const auto& b : seg.blocks) {
        if (n < cap)
          out[n] = {seg.addr, seg.size, seg.pool, seg.huge ? 1 : 0, b.addr, b.size, b.requested,
                    static_cast<vmm_block_state>(b.state)};
        ++n;
      }
    *count = n;
  } catch (const std::bad_alloc&) {
    return set(VMM_ERROR_OUT_OF_MEMORY, "vmm_get_memory_map: host memory");
  }
  return ok();
}
static vmm_status set_access(vmm_allocator* a, int device, vmm::access_mode m, const char* fn) {
  return allocator_call(a, fn, [&] {
    if (m == vmm::access_mode::none) a->a.revoke(device); else a->a.grant(device, m);
  });
}
vmm_status vmm_grant(vmm_allocator* a, int device, int read_only) {
  return set_access(a, device, read_only ? vmm::access_mode::read : vmm::access_mode::read_write, "vmm_grant");
}
vmm_status vmm_revoke(vmm_allocator* a, int device) {
  return set_access(a, device, vmm::access_mode::none, "vmm_revoke");
}

vmm_status vmm_begin_pool(vmm_allocator* a, uint64_t pool, vmm_stream_filter filter, void* user) {
  return allocator_call(a, "vmm_begin_pool", [&] {
    std::function<bool(vmm::stream_t)> f;
    if (filter) f = [filter, user](vmm::stream_t s) { return filter(s, user) != 0; };
    a->a.begin_pool(pool, std::move(f));
  });
}
vmm_status vmm_end_pool(vmm_allocator* a, uint64_t pool) {
  return allocator_call(a, "vmm_end_pool", [&] { a->a.end_pool(pool); });
}
vmm_status vmm_release_pool(vmm_allocator* a, uint64_t pool) {
  return allocator_call(a, "vmm_release_pool", [&] { a->a.release_pool(pool); });
}

vmm_status vmm_check(vmm_allocator* a) {
  if (!a) return invalid("vmm_check: allocator is NULL");
  std::string why = a->a.check();
  return why.empty() ? ok() : set(VMM_ERROR_OTHER, "vmm_check: " + why);
}

vmm_status vmm_last_status(void) { return tl_status; }
const char* vmm_last_error(void) { return tl_message.c_str(); }

const char* vmm_status_string(vmm_status s) {
  const int v = as_int(s);
  if (v < VMM_SUCCESS || v > VMM_ERROR_OTHER) return "unknown status";
  return vmm::errc_name(static_cast<vmm::errc>(v));
}

}  // extern "C"
