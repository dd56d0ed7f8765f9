// SPDX-License-Identifier: Apache-2.0
// CUDA backend: the driver's virtual memory management API, loaded at run time.
//
// No link-time dependency on libcuda: dlopen("libcuda.so.1") once per process, then every entry
// point through cuGetProcAddress at the CUDA 12.0 ABI (the PFN_ typedefs below are the 12.0
// variants, so a 12.x or 13.x driver gives the same signatures). <cuda.h> is included for types
// and constants only; no cu* function is called by name.
//
// Cost model: each method is one or two driver calls (1-100 us for VMM calls) plus a context
// switch-and-restore on the calling thread (two thread-local driver ops, tens of ns).
#include "vmmalloc/cuda_backend.hpp"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <dlfcn.h>

#include <cstring>
#include <mutex>
#include <new>
#include <string>
#include <unordered_map>
#include <vector>

namespace vmm {
namespace {

// The ABI version we ask cuGetProcAddress for; must match the PFN_..._vNNNN suffixes below.
constexpr int kCudaAbi = 12000;

// Every driver entry point we use: name, PFN version suffix valid at kCudaAbi.
// Members are named `cuXxx_` (trailing underscore) because <cuda.h> #defines some bare names
// (cuMemGetInfo -> cuMemGetInfo_v2); token pasting keeps the macro from expanding them.
#define VMM_CU_FUNCS(X)                              \
  X(cuInit, 2000)                                    \
  X(cuDriverGetVersion, 2020)                        \
  X(cuDeviceGet, 2000)                               \
  X(cuDeviceGetCount, 2000)                          \
  X(cuDeviceGetName, 2000)                           \
  X(cuDeviceGetAttribute, 2000)                      \
  X(cuDeviceCanAccessPeer, 4000)                     \
  X(cuDevicePrimaryCtxRetain, 7000)                  \
  X(cuDevicePrimaryCtxRelease, 11000)                \
  X(cuCtxGetCurrent, 4000)                           \
  X(cuCtxSetCurrent, 4000)                           \
  X(cuMemGetInfo, 3020)                              \
  X(cuMemGetAllocationGranularity, 10020)            \
  X(cuMemAddressReserve, 10020)                      \
  X(cuMemAddressFree, 10020)                         \
  X(cuMemCreate, 10020)                              \
  X(cuMemRelease, 10020)                             \
  X(cuMemGetAllocationPropertiesFromHandle, 10020)   \
  X(cuMemMap, 10020)                                 \
  X(cuMemUnmap, 10020)                               \
  X(cuMemSetAccess, 10020)                           \
  X(cuMemExportToShareableHandle, 10020)             \
  X(cuMemImportFromShareableHandle, 10020)           \
  X(cuEventCreate, 2000)                             \
  X(cuEventRecord, 2000)                             \
  X(cuEventQuery, 2000)                              \
  X(cuEventSynchronize, 2000)                        \
  X(cuEventDestroy, 4000)                             \
  X(cuStreamGetCaptureInfo, 11030)                   \
  X(cuThreadExchangeStreamCaptureMode, 10010)

errc kind_of(CUresult r) noexcept {
  switch (r) {
    case CUDA_SUCCESS: return errc::ok;
    case CUDA_ERROR_OUT_OF_MEMORY: return errc::out_of_memory;
    case CUDA_ERROR_INVALID_VALUE:
    case CUDA_ERROR_INVALID_HANDLE:
    case CUDA_ERROR_INVALID_DEVICE: return errc::invalid_value;
    case CUDA_ERROR_NOT_PERMITTED: return errc::not_permitted;
    case CUDA_ERROR_NOT_SUPPORTED: return errc::not_supported;
    case CUDA_ERROR_NO_DEVICE:
    case CUDA_ERROR_NOT_INITIALIZED:
    case CUDA_ERROR_DEINITIALIZED:
    case CUDA_ERROR_STUB_LIBRARY: return errc::no_driver;
    default: return errc::other;
  }
}

// Process-wide driver state: the library handle and resolved entry points. Built once (thread-safe
// static init), never destroyed and never dlclose'd: the driver dislikes being unloaded, and
// cuda_backend objects destroyed during static destruction may still need it.
struct driver {
  void* lib = nullptr;
  bool resolved = false;  // entry points present (driver_version works even if cuInit failed)
  status st{};            // ok() once cuInit succeeded
  std::string msg;
  PFN_cuGetErrorName_v6000 cuGetErrorName_ = nullptr;  // optional: only improves error names
#define VMM_DECLARE(fn, ver) PFN_##fn##_v##ver fn##_ = nullptr;
  VMM_CU_FUNCS(VMM_DECLARE)
#undef VMM_DECLARE

  driver() noexcept { load(); }

  // CUresult -> status. `op` must be a string literal (status keeps the pointer).
  status check(CUresult r, const char* op) const noexcept {
    if (r == CUDA_SUCCESS) return status::success();
    const char* name = nullptr;
    // cuGetErrorName hands back static storage; on unknown codes it fails and leaves name null.
    if (!cuGetErrorName_ || cuGetErrorName_(r, &name) != CUDA_SUCCESS || !name)
      name = "CUDA_ERROR_UNKNOWN";
    return status{kind_of(r), static_cast<int>(r), name, op};
  }

 private:
  void fail(status s, const char* what, const char* detail = nullptr) noexcept {
    st = s;
    try {
      msg = what;
      if (detail) msg += detail;
    } catch (...) {  // bad_alloc: keep the status, lose the text
    }
  }

  void load() noexcept {
    lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      const char* e = dlerror();
      fail({errc::no_driver, 0, "CUDA_ERROR_NO_DEVICE", "dlopen"}, "no CUDA driver: ",
           e ? e : "libcuda.so.1 not found");
      return;
    }
    // cuGetProcAddress_v2 (12.0+) takes a 5th "symbol status" argument; the 11.3 one does not.
    auto gpa2 = reinterpret_cast<PFN_cuGetProcAddress_v12000>(dlsym(lib, "cuGetProcAddress_v2"));
    auto gpa1 = gpa2 ? nullptr
                     : reinterpret_cast<PFN_cuGetProcAddress_v11030>(dlsym(lib, "cuGetProcAddress"));
    if (!gpa2 && !gpa1) {
      fail({errc::no_driver, 0, "CUDA_ERROR_NOT_SUPPORTED", "dlsym"},
           "no CUDA driver: libcuda.so.1 has no cuGetProcAddress (driver older than 11.3)");
      return;
    }
    auto resolve = [&](const char* sym, void** out) noexcept -> CUresult {
      *out = nullptr;
      CUresult r = gpa2 ? gpa2(sym, out, kCudaAbi, CU_GET_PROC_ADDRESS_DEFAULT, nullptr)
                        : gpa1(sym, out, kCudaAbi, CU_GET_PROC_ADDRESS_DEFAULT);
      // Success with a null pointer means "no ABI-compatible version": treat as not found.
      return r != CUDA_SUCCESS ? r : (*out ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND);
    };
    resolve("cuGetErrorName", reinterpret_cast<void**>(&cuGetErrorName_));
#define VMM_RESOLVE(fn, ver)                                                           \
  if (CUresult r = resolve(#fn, reinterpret_cast<void**>(&fn##_)); r != CUDA_SUCCESS) { \
    status s = check(r, "cuGetProcAddress");                                            \
    s.kind = errc::no_driver;                                                           \
    fail(s, "CUDA driver too old or broken: cannot resolve " #fn);                      \
    return;                                                                             \
  }
    VMM_CU_FUNCS(VMM_RESOLVE)
#undef VMM_RESOLVE
    resolved = true;

    if (CUresult r = cuInit_(0); r != CUDA_SUCCESS) {
      status s = check(r, "cuInit");
      if (r == CUDA_ERROR_NO_DEVICE) {
        fail(s, "no CUDA device (cuInit: CUDA_ERROR_NO_DEVICE)");
      } else {
        fail(s, "CUDA driver failed to initialize: cuInit returned ", s.name);
      }
    }
  }
};


// Built in static storage and never destroyed (see `driver`): no heap, no exit-time teardown.
const driver& drv() noexcept {
  alignas(driver) static unsigned char storage[sizeof(driver)];
  static const driver* d = new (storage) driver();
  return *d;
}

// One driver call with its name as the status' op: VMM_CU(d, cuMemCreate, &h, n, &prop, 0).
#define VMM_CU(d, fn, ...) (d).check((d).fn##_(__VA_ARGS__), #fn)

// Makes `want` current on the calling thread for one call, then restores the caller's context.
// Restoring matters: the CUDA runtime follows the thread's current context, so leaving ours
// current would silently move a caller's later kernel launches to our device.
class ctx_scope {
 public:
  explicit ctx_scope(CUcontext want) noexcept : d_(drv()) {
    if (d_.cuCtxGetCurrent_(&prev_) != CUDA_SUCCESS) prev_ = nullptr;
    if (prev_ == want) return;
    st_ = VMM_CU(d_, cuCtxSetCurrent, want);
    switched_ = st_.ok();
  }
  ~ctx_scope() {
    if (switched_) d_.cuCtxSetCurrent_(prev_);
  }
  ctx_scope(const ctx_scope&) = delete;
  ctx_scope& operator=(const ctx_scope&) = delete;
  const status& st() const noexcept { return st_; }

 private:
  const driver& d_;
  CUcontext prev_ = nullptr;
  status st_{};
  bool switched_ = false;
};

template <class T>
result<T> fail(const status& s) noexcept {
  return result<T>{T{}, s};
}

CUmemAllocationProp make_prop(const chunk_props& p) noexcept {
  CUmemAllocationProp prop{};  // zeroed: win32HandleMetaData and reserved bytes must be 0
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = p.location == location_kind::host_numa ? CU_MEM_LOCATION_TYPE_HOST_NUMA
                                                              : CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = p.id;
  switch (p.ipc) {
    case ipc_kind::posix_fd: prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR; break;
    case ipc_kind::fabric: prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_FABRIC; break;
    case ipc_kind::none: prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE; break;
  }
  // A hint: the driver may grant uncompressed memory; query() reads back what was granted.
  if (p.compressible) prop.allocFlags.compressionType = CU_MEM_ALLOCATION_COMP_GENERIC;
  return prop;
}

CUmemAccess_flags access_flags(access_mode m) noexcept {
  switch (m) {
    case access_mode::none: return CU_MEM_ACCESS_FLAGS_PROT_NONE;
    case access_mode::read: return CU_MEM_ACCESS_FLAGS_PROT_READ;
    case access_mode::read_write: return CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  }
  return CU_MEM_ACCESS_FLAGS_PROT_NONE;
}

// Device facts need only an initialized driver, not a usable backend device: vmm-info can list
// devices even when the backend's own ordinal is missing or lacks VMM.
bool driver_ready() noexcept { return drv().st.ok(); }

const status kNoState{errc::invalid_value, 0, "", "cuda_backend (moved-from)"};

}  // namespace

// ---- per-object state --------------------------------------------------------------------------

struct cuda_backend::impl {
  int ordinal = 0;
  CUdevice dev = 0;
  CUcontext ctx = nullptr;  // retained primary context; null until retained
  status st{};
  std::string msg;
  unsigned caps = 0;


  void fail(status s, const std::string& m) noexcept {
    st = s;
    try {
      msg = m;
    } catch (...) {
    }
  }

  void open(int device) noexcept {
    ordinal = device;
    const driver& d = drv();
    if (!d.st.ok()) {
      fail(d.st, d.msg);
      return;
    }
    try {
      int count = 0;
      if (status s = VMM_CU(d, cuDeviceGetCount, &count); !s.ok()) {
        fail(s, "cannot count CUDA devices: " + std::string(s.name));
        return;
      }
      if (status s = VMM_CU(d, cuDeviceGet, &dev, device); !s.ok()) {
        fail(s, count == 0 ? std::string("no CUDA device")
                           : "no CUDA device " + std::to_string(device) + " (" +
                                 std::to_string(count) + " present)");
        return;
      }
      int vmm = 0;
      if (status s = VMM_CU(d, cuDeviceGetAttribute, &vmm,
                            CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev);
          !s.ok() || !vmm) {
        if (s.ok())
          s = {errc::not_supported, CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED",
               "cuDeviceGetAttribute"};
        fail(s, "device " + std::to_string(device) +
                    " does not support virtual memory management");
        return;
      }
      // Retaining the primary context shares it with the CUDA runtime (the same context
      // cudaSetDevice uses), so streams and events from the runtime work with ours.
      if (status s = VMM_CU(d, cuDevicePrimaryCtxRetain, &ctx, dev); !s.ok()) {
        ctx = nullptr;
        fail(s, "cannot retain the primary context of device " + std::to_string(device) + ": " +
                    s.name);
        return;
      }
      caps = compute_caps(d);
    } catch (...) {  // bad_alloc from message text only
      if (st.ok()) st = {errc::out_of_memory, 0, "ENOMEM", "cuda_backend"};
    }
  }

  unsigned compute_caps(const driver& d) const noexcept {
    auto attr = [&](CUdevice_attribute a) {
      int v = 0;
      return d.cuDeviceGetAttribute_(&v, a, dev) == CUDA_SUCCESS && v != 0;
    };
    unsigned c = cap_async_fences | cap_capture;  // events can be pending; never cap_host_access
    if (attr(CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED)) c |= cap_export_posix_fd;
    if (attr(CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED)) c |= cap_export_fabric;
    if (attr(CU_DEVICE_ATTRIBUTE_GENERIC_COMPRESSION_SUPPORTED)) c |= cap_compression;
    int n = 0;
    if (d.cuDeviceGetCount_(&n) == CUDA_SUCCESS && n > 1) c |= cap_peer_access;
    return c;
  }
};

// ---- lifetime ----------------------------------------------------------------------------------

cuda_backend::cuda_backend(int device) : p_(new (std::nothrow) impl) {
  if (p_) p_->open(device);
}

cuda_backend::~cuda_backend() {
  // Errors ignored: at exit the driver may already be deinitialized, which frees it anyway.
  if (p_ && p_->ctx) drv().cuDevicePrimaryCtxRelease_(p_->dev);
}

cuda_backend::cuda_backend(cuda_backend&&) noexcept = default;

const status& cuda_backend::load_status() const { return p_ ? p_->st : kNoState; }

const std::string& cuda_backend::load_message() const {
  static const std::string moved = "cuda_backend: no state (moved-from object)";
  return p_ ? p_->msg : moved;
}

int cuda_backend::device() const { return p_ ? p_->ordinal : -1; }

unsigned cuda_backend::capabilities() { return available() ? p_->caps : 0u; }

// ---- memory ------------------------------------------------------------------------------------

result<granularity_info> cuda_backend::granularity(const chunk_props& props) {
  if (!available()) return fail<granularity_info>(load_status());
  const driver& d = drv();
  // A property query; the context is set anyway because some drivers want one (cost: noise).
  ctx_scope c(p_->ctx);
  if (!c.st().ok()) return fail<granularity_info>(c.st());
  const CUmemAllocationProp prop = make_prop(props);
  granularity_info g;
  if (status s = VMM_CU(d, cuMemGetAllocationGranularity, &g.minimum, &prop,
                        CU_MEM_ALLOC_GRANULARITY_MINIMUM);
      !s.ok())
    return fail<granularity_info>(s);
  if (status s = VMM_CU(d, cuMemGetAllocationGranularity, &g.recommended, &prop,
                        CU_MEM_ALLOC_GRANULARITY_RECOMMENDED);
      !s.ok())
    return fail<granularity_info>(s);
  return {g, {}};
}

result<std::uintptr_t> cuda_backend::reserve(std::size_t size, std::size_t align) {
  if (!available()) return fail<std::uintptr_t>(load_status());
  ctx_scope c(p_->ctx);
  if (!c.st().ok()) return fail<std::uintptr_t>(c.st());
  CUdeviceptr ptr = 0;
  if (status s = VMM_CU(drv(), cuMemAddressReserve, &ptr, size, align, 0, 0); !s.ok())
    return fail<std::uintptr_t>(s);
  return {static_cast<std::uintptr_t>(ptr), {}};
}

status cuda_backend::free_reservation(std::uintptr_t va, std::size_t size) {
  if (!available()) return load_status();
  ctx_scope c(p_->ctx);
  if (!c.st().ok()) return c.st();
  return VMM_CU(drv(), cuMemAddressFree, static_cast<CUdeviceptr>(va), size);
}

result<mem_handle> cuda_backend::create(std::size_t size, const chunk_props& props) {
  if (!available()) return fail<mem_handle>(load_status());
  const driver& d = drv();
  ctx_scope c(p_->ctx);
  if (!c.st().ok()) return fail<mem_handle>(c.st());
  const CUmemAllocationProp prop = make_prop(props);
  CUmemGenericAllocationHandle h = 0;
  if (status s = VMM_CU(d, cuMemCreate, &h, size, &prop, 0); !s.ok()) return fail<mem_handle>(s);
  return {static_cast<mem_handle>(h), {}};
}

status cuda_backend::release(mem_handle h) {
  if (!available()) return load_status();
  ctx_scope c(p_->ctx);
  if (!c.st().ok()) return c.st();
  return VMM_CU(drv(), cuMemRelease, static_cast<CUmemGenericAllocationHandle>(h));
}

result<chunk_info> cuda_backend::query(mem_handle h) {
  if (!available()) return fail<chunk_info>(load_status());
  ctx_scope c(p_->ctx);
  if (!c.st().ok()) return fail<chunk_info>(c.st());
  CUmemAllocationProp prop{};
  if (status s = VMM_CU(drv(), cuMemGetAllocationPropertiesFromHandle, &prop,
                        static_cast<CUmemGenericAllocationHandle>(h));
      !s.ok())
    return fail<chunk_info>(s);
  chunk_info info;
  info.compressible = prop.allocFlags.compressionType == CU_MEM_ALLOCATION_COMP_GENERIC;
  return {info, {}};
}

status cuda_backend::map(std::uintptr_t va, std::size_t size, mem_handle h, std::size_t offset) {
  if (!available()) return load_status();
  ctx_scope c(p_->ctx);
  if (!c.st().ok()) return c.st();
  return VMM_CU(drv(), cuMemMap, static_cast<CUdeviceptr>(va), size, offset,
                static_cast<CUmemGenericAllocationHandle>(h), 0);
}

status cuda_backend::unmap(std::uintptr_t va, std::size_t size) {
  if (!available()) return load_status();
  ctx_scope c(p_->ctx);
  if (!c.st().ok()) return c.st();
  return VMM_CU(drv(), cuMemUnmap, static_cast<CUdeviceptr>(va), size);
}

status cuda_backend::set_access(std::uintptr_t va, std::size_t size,
                                std::span<const access_desc> descs) {
  if (!available()) return load_status();
  if (descs.empty()) return status::success();  // nothing to change
  // One driver call for all devices: access changes cost a TLB shootdown each, so batch them.
  constexpr std::size_t kInline = 16;
  CUmemAccessDesc inline_buf[kInline];
  std::vector<CUmemAccessDesc> heap_buf;
  CUmemAccessDesc* a = inline_buf;
  if (descs.size() > kInline) {
    try {
      heap_buf.resize(descs.size());
    } catch (...) {
      return {errc::out_of_memory, 0, "ENOMEM", "cuda_backend::set_access"};
    }
    a = heap_buf.data();
  }
  for (std::size_t i = 0; i < descs.size(); ++i) {
    a[i] = CUmemAccessDesc{};
    if (descs[i].device == cpu_device) {  // host_numa chunks: the CPU's access (id ignored)
      a[i].location.type = CU_MEM_LOCATION_TYPE_HOST_NUMA;
      a[i].location.id = 0;
    } else {
      a[i].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
      a[i].location.id = descs[i].device;
    }
    a[i].flags = access_flags(descs[i].mode);
  }
  ctx_scope c(p_->ctx);
  if (!c.st().ok()) return c.st();
  return VMM_CU(drv(), cuMemSetAccess, static_cast<CUdeviceptr>(va), size, a, descs.size());
}

// ---- sharing -----------------------------------------------------------------------------------

result<shareable_handle> cuda_backend::export_handle(mem_handle h, ipc_kind kind) {
  if (!available()) return fail<shareable_handle>(load_status());
  const driver& d = drv();
  ctx_scope c(p_->ctx);
  if (!c.st().ok()) return fail<shareable_handle>(c.st());
  const auto ch = static_cast<CUmemGenericAllocationHandle>(h);
  shareable_handle sh;
  sh.kind = kind;
  if (kind == ipc_kind::posix_fd) {
    int fd = -1;
    if (status s = VMM_CU(d, cuMemExportToShareableHandle, &fd, ch,
                          CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
        !s.ok())
      return fail<shareable_handle>(s);
    sh.fd = fd;
  } else if (kind == ipc_kind::fabric) {
    static_assert(sizeof(CUmemFabricHandle) == sizeof(sh.fabric));
    CUmemFabricHandle fh{};
    if (status s = VMM_CU(d, cuMemExportToShareableHandle, &fh, ch, CU_MEM_HANDLE_TYPE_FABRIC, 0);
        !s.ok())
      return fail<shareable_handle>(s);
    std::memcpy(sh.fabric.data(), fh.data, sizeof(fh.data));
  } else {
    return fail<shareable_handle>(d.check(CUDA_ERROR_INVALID_VALUE, "cuMemExportToShareableHandle"));
  }
  return {sh, {}};
}

result<mem_handle> cuda_backend::import_handle(const shareable_handle& sh) {
  if (!available()) return fail<mem_handle>(load_status());
  const driver& d = drv();
  ctx_scope c(p_->ctx);
  if (!c.st().ok()) return fail<mem_handle>(c.st());
  CUmemGenericAllocationHandle h = 0;
  status s;
  if (sh.kind == ipc_kind::posix_fd && sh.fd >= 0) {
    // The driver takes the fd itself, smuggled in the pointer; it does not take ownership.
    void* os = reinterpret_cast<void*>(static_cast<std::uintptr_t>(sh.fd));
    s = VMM_CU(d, cuMemImportFromShareableHandle, &h, os, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  } else if (sh.kind == ipc_kind::fabric) {
    CUmemFabricHandle fh{};
    std::memcpy(fh.data, sh.fabric.data(), sizeof(fh.data));
    s = VMM_CU(d, cuMemImportFromShareableHandle, &h, &fh, CU_MEM_HANDLE_TYPE_FABRIC);
  } else {
    s = d.check(CUDA_ERROR_INVALID_VALUE, "cuMemImportFromShareableHandle");
  }
  if (!s.ok()) return fail<mem_handle>(s);
  // Size unknown here (an fd's lseek size is not reliable): query() reports 0 for imports.
  return {static_cast<mem_handle>(h), {}};
}

// ---- fences ------------------------------------------------------------------------------------
// A fence is a CUevent. Query/sync/destroy need no current context (the event carries its own),
// so the hot path fence_done() is a single cuEventQuery.

result<fence_t> cuda_backend::record_fence(stream_t stream) {
  if (!available()) return fail<fence_t>(load_status());
  const driver& d = drv();
  ctx_scope c(p_->ctx);
  if (!c.st().ok()) return fail<fence_t>(c.st());
  CUevent ev = nullptr;
  // Timing off: cheaper to record and lets cuEventQuery skip timestamp bookkeeping.
  if (status s = VMM_CU(d, cuEventCreate, &ev, CU_EVENT_DISABLE_TIMING); !s.ok())
    return fail<fence_t>(s);
  if (status s = VMM_CU(d, cuEventRecord, ev, static_cast<CUstream>(stream)); !s.ok()) {
    d.cuEventDestroy_(ev);
    return fail<fence_t>(s);
  }
  return {static_cast<fence_t>(reinterpret_cast<std::uintptr_t>(ev)), {}};
}

bool cuda_backend::fence_done(fence_t f) {
  // No backend means no fence could have been recorded: report done rather than spin forever.
  if (f == 0 || !available()) return true;
  const CUresult r = drv().cuEventQuery_(reinterpret_cast<CUevent>(static_cast<std::uintptr_t>(f)));
  // Any error other than NOT_READY means the stream is dead; its work will never "finish" later.
  return r != CUDA_ERROR_NOT_READY;
}

status cuda_backend::wait_fence(fence_t f) {
  if (f == 0) return status::success();
  if (!available()) return load_status();
  return VMM_CU(drv(), cuEventSynchronize, reinterpret_cast<CUevent>(static_cast<std::uintptr_t>(f)));
}

void cuda_backend::drop_fence(fence_t f) {
  if (f == 0 || !available()) return;
  drv().cuEventDestroy_(reinterpret_cast<CUevent>(static_cast<std::uintptr_t>(f)));
}

// ---- stream capture ----------------------------------------------------------------------------

result<capture_info> cuda_backend::capture_of(stream_t stream) {
  if (!available()) return {{}, {}};
  ctx_scope c(p_->ctx);  // the legacy stream (0) means the current context's: make it ours
  if (!c.st().ok()) return fail<capture_info>(c.st());
  CUstreamCaptureStatus cs = CU_STREAM_CAPTURE_STATUS_NONE;
  cuuint64_t id = 0;
  // At the 12.0 ABI this is the six-argument form: the graph outputs are asked for nothing (a
  // three-argument call would let the driver write through whatever the registers held).
  CUresult r = drv().cuStreamGetCaptureInfo_(static_cast<CUstream>(stream), &cs, &id, nullptr, nullptr, nullptr);
  // The legacy stream while another stream captures in global mode: any work on it would join
  // (and break) that capture, so it counts as captured.
  if (r == CUDA_ERROR_STREAM_CAPTURE_IMPLICIT) return {{capture_state::active, 0}, {}};
  if (status s = drv().check(r, "cuStreamGetCaptureInfo"); !s.ok()) return fail<capture_info>(s);
  capture_info ci;
  ci.state = cs == CU_STREAM_CAPTURE_STATUS_ACTIVE        ? capture_state::active
             : cs == CU_STREAM_CAPTURE_STATUS_INVALIDATED ? capture_state::invalidated
                                                          : capture_state::none;
  ci.id = ci.state == capture_state::none ? 0 : static_cast<std::uint64_t>(id);
  return {ci, {}};
}

capture_mode cuda_backend::exchange_capture_mode(capture_mode m) {
  if (!available()) return m;
  auto mode = static_cast<CUstreamCaptureMode>(static_cast<int>(m));
  if (drv().cuThreadExchangeStreamCaptureMode_(&mode) != CUDA_SUCCESS) return m;
  return static_cast<capture_mode>(static_cast<int>(mode));
}

// ---- device facts ------------------------------------------------------------------------------

result<memory_info> cuda_backend::mem_info() {
  if (!available()) return fail<memory_info>(load_status());
  ctx_scope c(p_->ctx);  // cuMemGetInfo reports the current context's device
  if (!c.st().ok()) return fail<memory_info>(c.st());
  memory_info m;
  if (status s = VMM_CU(drv(), cuMemGetInfo, &m.free, &m.total); !s.ok()) return fail<memory_info>(s);
  return {m, {}};
}

bool cuda_backend::can_access_peer(int device, int peer) {
  if (!available()) return false;
  if (device == peer) return true;
  const driver& d = drv();
  CUdevice a = 0, b = 0;
  int can = 0;
  if (!(d.cuDeviceGet_(&a, device) == CUDA_SUCCESS && d.cuDeviceGet_(&b, peer) == CUDA_SUCCESS &&
        d.cuDeviceCanAccessPeer_(&can, a, b) == CUDA_SUCCESS && can != 0))
    return false;
  // The accessing device must map VMM memory itself (cuMemSetAccess names it). 0 = no; -1 = the
  // attribute could not be read: leave the decision to cuMemSetAccess.
  return attribute(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, device) != 0;
}

int cuda_backend::attribute(int cu_attribute, int device) const {
  if (!driver_ready()) return -1;
  const driver& d = drv();
  CUdevice dev = 0;
  int v = 0;
  if (d.cuDeviceGet_(&dev, device) != CUDA_SUCCESS ||
      d.cuDeviceGetAttribute_(&v, static_cast<CUdevice_attribute>(cu_attribute), dev) != CUDA_SUCCESS)
    return -1;
  return v;
}

int cuda_backend::device_count() const {
  int n = 0;
  if (!driver_ready() || drv().cuDeviceGetCount_(&n) != CUDA_SUCCESS) return 0;
  return n;
}

std::string cuda_backend::device_name(int device) const {
  if (!driver_ready()) return {};
  const driver& d = drv();
  CUdevice dev = 0;
  char buf[256] = {};
  if (d.cuDeviceGet_(&dev, device) != CUDA_SUCCESS ||
      d.cuDeviceGetName_(buf, static_cast<int>(sizeof(buf) - 1), dev) != CUDA_SUCCESS)
    return {};
  try {
    return std::string(buf);
  } catch (...) {
    return {};
  }
}

int cuda_backend::driver_version() const {
  const driver& d = drv();
  int v = 0;  // works before/without cuInit, so it is reported even when no device is usable
  if (!d.resolved || d.cuDriverGetVersion_(&v) != CUDA_SUCCESS) return 0;
  return v;
}

#undef VMM_CU
#undef VMM_CU_FUNCS

}  // namespace vmm
