// SPDX-License-Identifier: Apache-2.0
// libvmmalloc_torch.so: the C functions of vmmalloc_torch.h over one vmm::allocator per device.
//
// Allocators are created on first use under one mutex and published through an atomic pointer
// per device: the hot path is one acquire load plus vmm::allocator's own allocate/deallocate.
// They are never destroyed: PyTorch and CuPy free tensors during interpreter shutdown, after C++
// static destructors would have run, and the driver releases every mapping at process exit.
// Only the vmm_torch_* functions are exported: this file is built with -fvisibility=hidden and the
// static vmmalloc inside is linked with --exclude-libs, so it never clashes with another copy.
#pragma GCC visibility push(default)
#include "vmmalloc_torch.h"
#pragma GCC visibility pop

#include <algorithm>
#include <array>
#include <atomic>
#include <cctype>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <mutex>
#include <new>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <unistd.h>  // environ

#include "frontend/allocator_access.hpp"
#include "torch_lib.hpp"
#include "vmmalloc/cuda_backend.hpp"
#include "vmmalloc/vmmalloc.hpp"

namespace {

constexpr int kMaxDevices = 256;  // PyTorch's DeviceIndex is int8: 128 would do

// Bytes of PyTorch's live blocks and their peak, counted on every malloc and free of this library:
// exact whatever vmmalloc's thread caches do (vmm::allocator_stats has no such peaks). One locked
// add a call, next to PyTorch's own work around it.
struct live_bytes {
  std::atomic<std::uint64_t> now{0}, peak{0};
  void add(std::uint64_t n) {
    const std::uint64_t v = now.fetch_add(n, std::memory_order_relaxed) + n;
    std::uint64_t p = peak.load(std::memory_order_relaxed);
    while (v > p && !peak.compare_exchange_weak(p, v, std::memory_order_relaxed)) {
    }
  }
  void sub(std::uint64_t n) { now.fetch_sub(n, std::memory_order_relaxed); }
  void reset_peak() { peak.store(now.load(std::memory_order_relaxed), std::memory_order_relaxed); }
};

// What PyTorch's own allocator counts a request as: whole 512 B units (its kMinBlockSize), so that
// allocated bytes compare across allocators; vmmalloc's own rounding is in vmm::allocator_stats.
constexpr std::uint64_t torch_rounded(std::uint64_t n) { return (n + 511) / 512 * 512; }

struct device_slot {
  vmm::allocator* a = nullptr;       // written once under create_mu, then read through `ready`
  std::atomic<vmm::allocator*> ready{nullptr};
  std::atomic<std::uint64_t> malloc_failures{0}, free_failures{0};
  live_bytes requested, allocated;   // allocated: torch_rounded sizes
  std::string config;                // written once under create_mu before `ready` is published
  std::size_t peers = 0;
  vmm::backend_iface* backend = nullptr;  // a's backend (lives as long as a): device memory info
};

std::array<device_slot, kMaxDevices> slots;
std::mutex create_mu;

// Last error, process-wide: PyTorch allocates on autograd threads, Python reads on its own.
std::mutex err_mu;
std::string err_text;
thread_local std::string err_copy, config_copy;

void set_error(const std::string& s) noexcept {
  try {
    std::lock_guard g(err_mu);
    err_text = s;
  } catch (...) {  // bad_alloc while copying text: keep the previous message
  }
}

std::string human(std::size_t n) {
  char b[64];
  if (n >= (std::size_t{1} << 30))
    std::snprintf(b, sizeof b, "%.2f GiB", static_cast<double>(n) / (1 << 30));
  else
    std::snprintf(b, sizeof b, "%.2f MiB", static_cast<double>(n) / (1 << 20));
  return b;
}

// ---- environment ----------------------------------------------------------------------------

struct env_error : std::exception {
  std::string what_;
  explicit env_error(std::string w) : what_(std::move(w)) {}
  const char* what() const noexcept override { return what_.c_str(); }
};

std::string lower(std::string s) {
  for (auto& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

const char* env(const char* name) {
  const char* v = std::getenv(name);
  return v && *v ? v : nullptr;
}

// The peers row's variable (VMMALLOC_PEERS): "auto" or an explicit list.
struct peer_spec {
  bool automatic = true;
  std::vector<vmm::access_desc> list;
  std::string var;  // the variable, for messages
};

// "auto", else the list as vmm::set_option reads it ("none", "1,3"), of real device ordinals.
peer_spec parse_peers(const vmm::option_info& row, const char* text, const std::string& var) {
  peer_spec p;
  p.var = var;
  if (lower(text) == "auto") return p;
  p.automatic = false;
  vmm::options scratch;
  bool ok = vmm::set_option(scratch, row, text).ok();
  for (const vmm::access_desc& d : scratch.peers) ok = ok && d.device >= 0 && d.device < kMaxDevices;
  if (!ok)
    throw env_error(p.var + "='" + text + "': expected auto, none, or a comma list of device ordinals");
  p.list = std::move(scratch.peers);
  return p;
}

// VMMALLOC_OPTIONS: "name=value,name=value" for any row of the options table by name, also rows
// with no variable of their own (what PYTORCH_CUDA_ALLOC_CONF is to PyTorch's allocator). An item
// with no '=' continues the value before it, so lists keep their commas ("peers=1,3"). Returns
// (row, value) pairs in order; throws env_error naming the item.
std::vector<std::pair<const vmm::option_info*, std::string>> options_list(const char* text) {
  std::vector<std::pair<const vmm::option_info*, std::string>> out;
  std::string t = text;
  for (std::size_t i = 0; i <= t.size();) {
    std::size_t j = std::min(t.find(',', i), t.size());
    std::string item = t.substr(i, j - i);
    i = j + 1;
    auto eq = item.find('=');
    if (eq == std::string::npos) {
      if (out.empty())
        throw env_error("VMMALLOC_OPTIONS='" + t + "': '" + item + "' is not name=value");
      out.back().second += "," + item;
      continue;
    }
    std::string name = item.substr(0, eq);
    const vmm::option_info* row = vmm::find_option(name);
    if (!row) {  // set_option's message lists the names
      vmm::options scratch;
      std::string why;
      (void)vmm::set_option(scratch, name, item.substr(eq + 1), &why);
      throw env_error("VMMALLOC_OPTIONS: " + why);
    }
    if (row->name == "device")
      throw env_error("VMMALLOC_OPTIONS: 'device' is not an option here (each device has its allocator)");
    out.emplace_back(row, item.substr(eq + 1));
  }
  return out;
}

// A VMMALLOC_* variable that is neither a row's nor one of the library's own is refused, naming it
// (a typo, or a variable of another version), as PyTorch refuses an unknown
// PYTORCH_CUDA_ALLOC_CONF key. Throws env_error.
void refuse_unknown_variables() {
  static const char* const others[] = {"VMMALLOC_OPTIONS", "VMMALLOC_TORCH_BACKEND", "VMMALLOC_LIB_DIR",
                                       "VMMALLOC_TORCH_LIB", "VMMALLOC_TORCH_EXT_LIB"};
  for (char** e = environ; e && *e; ++e) {
    const std::string_view kv = *e;
    if (!kv.starts_with("VMMALLOC_")) continue;
    const std::string_view name = kv.substr(0, kv.find('='));
    bool known = std::any_of(std::begin(others), std::end(others), [&](const char* o) { return name == o; });
    for (const vmm::option_info& row : vmm::option_table()) known = known || (!row.env.empty() && name == row.env);
    if (!known)
      throw env_error(std::string(name) + ": not a vmmalloc variable; the options and their variables are "
                      "README.md's table (VMMALLOC_OPTIONS takes any of them by name)");
  }
}

// The options of one device's allocator from the environment: VMMALLOC_OPTIONS first, then every
// row of the options table (options.def, README.md) with a variable that is set and not empty
// (so a row's own variable wins over the list), parsed by vmm::set_option with messages naming
// the variable. Two kinds mean more here:
//   peers  "auto" (the default) = every device that can access the owner, resolved in create()
//   path   one file per device: "%d" is replaced by the device ordinal; without it device 0 uses
//          the path itself and device d "<path>.<d>", so two devices never share a file (the trace:
//          allocators live until exit, so buffered events are written by vmm_torch_flush_trace()
//          and by an atexit handler; frees after that, during the last teardown, are not recorded)
// A VMMALLOC_* variable that is none of these (nor one the library itself reads) is refused,
// naming it (refuse_unknown_variables). Throws env_error.
vmm::options options_from_env(int device, peer_spec& peers) {
  refuse_unknown_variables();
  vmm::options o;
  o.device = device;
  auto apply = [&](const vmm::option_info& row, std::string text, const std::string& label) {
    std::string why;
    if (row.kind == vmm::option_kind::peers) {
      peers = parse_peers(row, text.c_str(), label);
      return;
    }
    if (row.kind == vmm::option_kind::path) {
      if (auto at = text.find("%d"); at != std::string::npos)
        text.replace(at, 2, std::to_string(device));
      else if (device != 0)
        text += "." + std::to_string(device);
    }
    if (!vmm::set_option(o, row, text, &why, label).ok()) throw env_error(why);
  };
  if (const char* list = env("VMMALLOC_OPTIONS"))
    for (auto& [row, value] : options_list(list))
      apply(*row, value, "VMMALLOC_OPTIONS " + std::string(row->name));
  for (const vmm::option_info& row : vmm::option_table())
    if (const char* v = row.env.empty() ? nullptr : env(std::string(row.env).c_str()))
      apply(row, v, std::string(row.env));
  return o;
}

// vmm_torch_config's line: the backend, what the arena chose, then every option in effect.
std::string describe(const vmm::allocator& a, const char* backend) {
  return std::string("backend=") + backend + " granularity=" + std::to_string(a.granularity()) +
         " reservation=" + std::to_string(a.stats().reserved) + " " + vmm::describe(a.opts());
}

// Creates device d's allocator (caller holds create_mu). Throws vmm::error / env_error.
void create(int d) {
  device_slot& s = slots[d];
  peer_spec ps;
  vmm::options o = options_from_env(d, ps);
  std::string be = lower(env("VMMALLOC_TORCH_BACKEND") ? env("VMMALLOC_TORCH_BACKEND") : "cuda");

  std::unique_ptr<vmm::backend_iface> b;
  int count = 0;
  if (be == "cuda") {
    vmm::cuda_backend cb(d);
    if (!cb.available())
      throw vmm::error(cb.load_status(), "device " + std::to_string(d) + ": " + cb.load_message());
    count = cb.device_count();
    b = vmm::make_backend<vmm::cuda_backend>(std::move(cb));
  } else if (be == "host") {
    vmm::host_backend_options h;
    h.device_count = 8;  // simulated devices 0..7, all peers of each other (tests only)
    count = h.device_count;
    b = vmm::make_backend<vmm::host_backend>(h);
  } else {
    throw env_error("VMMALLOC_TORCH_BACKEND='" + be + "': expected cuda or host");
  }

  // Peers: PyTorch's pluggable allocator never calls cuMemSetAccess, so a tensor of device d read
  // by device p (a peer copy, NCCL's P2P) needs p granted here, on every mapping. Cost: one
  // access descriptor more per set_access call, and the granularity is the largest among them.
  if (ps.automatic) {
    for (int p = 0; p < count && p < kMaxDevices; ++p)
      if (p != d && b->can_access_peer(p, d)) o.peers.push_back({p, vmm::access_mode::read_write});
  } else {
    for (const vmm::access_desc& p : ps.list) {
      if (p.device == d) continue;
      if (p.device >= count || !b->can_access_peer(p.device, d))
        throw env_error(ps.var + ": device " + std::to_string(p.device) + " cannot access device " +
                        std::to_string(d));
      o.peers.push_back(p);
    }
  }

  // Throws vmm::error when the arena cannot open; owned here until published, never freed after.
  vmm::backend_iface* be_ptr = b.get();
  // Tensors share chunks also with VMMALLOC_IPC set (no 2 MiB floor per tensor); a shared
  // tensor's handle carries the chunks under it, as PyTorch's own sharing does.
  vmm::tuning t;
  t.ipc_whole_chunks = false;
  auto a = std::make_unique<vmm::allocator>(vmm::allocator_access::make(std::move(b), o, t));
  std::string config = describe(*a, be.c_str());
  if (!o.trace_path.empty()) {
    static std::once_flag registered;
    std::call_once(registered, [] { std::atexit([] { vmm_torch_flush_trace(); }); });
  }
  s.peers = o.peers.size();
  s.backend = be_ptr;
  s.config = std::move(config);
  s.a = a.release();
  s.ready.store(s.a, std::memory_order_release);
}

// The allocator of device d, created on first use. nullptr + last error on failure.
vmm::allocator* get(int d) noexcept {
  if (d >= 0 && d < kMaxDevices)
    if (vmm::allocator* a = slots[d].ready.load(std::memory_order_acquire)) return a;
  try {
    if (d < 0 || d >= kMaxDevices) {
      set_error("vmmalloc_torch: device " + std::to_string(d) + " out of range");
      return nullptr;
    }
    std::lock_guard g(create_mu);
    if (vmm::allocator* a = slots[d].ready.load(std::memory_order_acquire)) return a;
    create(d);
    return slots[d].a;
  } catch (const std::exception& e) {
    set_error(std::string("vmmalloc_torch: cannot create the allocator of device ") +
              std::to_string(d) + ": " + e.what());
  } catch (...) {
    set_error("vmmalloc_torch: cannot create the allocator of device " + std::to_string(d));
  }
  return nullptr;
}

// Only an existing allocator (stats and controls never create one).
vmm::allocator* existing(int d) noexcept {
  if (d < 0 || d >= kMaxDevices) return nullptr;
  return slots[d].ready.load(std::memory_order_acquire);
}

// Applies f to device d's allocator, or to every existing one for d == -1. 0 or -1.
template <class F>
int for_devices(int d, const char* what, F f) noexcept try {
  if (d < -1 || d >= kMaxDevices) {
    set_error(std::string("vmmalloc_torch: ") + what + ": device " + std::to_string(d) + " out of range");
    return -1;
  }
  int rc = 0;
  for (int i = d < 0 ? 0 : d; i < (d < 0 ? kMaxDevices : d + 1); ++i) {
    vmm::allocator* a = existing(i);
    if (!a) {
      if (d >= 0) {
        set_error(std::string("vmmalloc_torch: ") + what + ": device " + std::to_string(d) +
                  " has no allocator (nothing was allocated on it)");
        return -1;
      }
      continue;
    }
    try {
      f(*a);
    } catch (const std::exception& e) {
      try {
        set_error(std::string("vmmalloc_torch: ") + what + " on device " + std::to_string(i) + ": " + e.what());
      } catch (...) {  // no memory for the message
      }
      rc = -1;
    } catch (...) {
      rc = -1;
    }
  }
  return rc;
} catch (...) {  // no memory for a message
  return -1;
}

// for_devices on one device only: a negative one is out of range here, not "every device".
template <class F>
int for_device(int d, const char* what, F f) noexcept {
  return for_devices(d < 0 ? kMaxDevices : d, what, std::move(f));
}

// vmm::allocator_stats fields first; then this library's own counters (requested and allocated
// bytes of PyTorch's blocks and their peaks: live_bytes), the driver's and the failures.
#define VMM_TORCH_STATS(X)                                                                     \
  X(mapped) X(physical) X(reserved) X(peak_mapped) X(peak_physical) X(chunks) X(idle) X(free_chunk_bytes) \
  X(slab_bytes) X(allocs) X(frees) X(live) X(deferred) X(grows) X(chunk_releases) X(trims)     \
  X(stitched) X(compression_fallbacks) X(traced_events) X(pools) X(pool_allocated) X(pool_held)

#define VMM_TORCH_NAME(f) #f ","
constexpr char kStatNames[] = VMM_TORCH_STATS(VMM_TORCH_NAME)
    "requested,peak_requested,allocated,peak_allocated,"
    "driver_calls,driver_failures,granularity,peers,malloc_failures,free_failures,"
    "creates,maps,unmaps,set_access_calls,releases,record_fences,fence_queries,fence_waits,"
    "driver_ns,fence_ns,chunks_retired";
#undef VMM_TORCH_NAME

void* do_malloc(ssize_t size, int device, void* stream, bool throwing) {
  if (size <= 0) {
    if (size == 0) return nullptr;  // PyTorch asks for 0 bytes for empty tensors; it frees nothing
    std::string m = "vmmalloc_torch: negative size " + std::to_string(size);
    set_error(m);
    if (throwing) throw vmm::error({vmm::errc::invalid_value, 0, "EINVAL", "vmm_torch_malloc"}, m);
    return nullptr;
  }
  vmm::allocator* a = get(device);
  if (!a) {
    if (device >= 0 && device < kMaxDevices) slots[device].malloc_failures.fetch_add(1, std::memory_order_relaxed);
    if (!throwing) return nullptr;
    std::string m;
    {
      std::lock_guard g(err_mu);
      m = err_text;
    }
    throw vmm::error({vmm::errc::other, 0, "", "vmm_torch_malloc"}, m);
  }
  if (void* p = a->try_allocate(static_cast<std::size_t>(size), 0, stream)) {
    slots[device].requested.add(static_cast<std::uint64_t>(size));
    slots[device].allocated.add(torch_rounded(static_cast<std::uint64_t>(size)));
    return p;
  }

  slots[device].malloc_failures.fetch_add(1, std::memory_order_relaxed);
  vmm::status st = vmm::last_error().st;
  // Out of memory begins as PyTorch's own allocator words it: code that retries with a smaller
  // batch on it (accelerate's find_executable_batch_size, Lightning's batch-size finder) matches
  // "CUDA out of memory." in the message.
  const char* head = st.kind == vmm::errc::out_of_memory ? "CUDA out of memory. vmmalloc cannot allocate "
                                                          : "vmmalloc: cannot allocate ";
  std::string m;
  try {
    vmm::allocator_stats s = a->stats();
    m = head + human(static_cast<std::size_t>(size)) + " on device " + std::to_string(device) + ": " +
        vmm::last_error().message + " (mapped " + human(s.mapped) + ", requested " + human(s.requested) +
        ", " + std::to_string(s.live) + " live blocks)";
  } catch (...) {
    m = head + std::to_string(size) + " bytes";
  }
  set_error(m);
  if (!throwing) return nullptr;
  if (st.kind == vmm::errc::out_of_memory) throw vmm::out_of_memory(st, m);
  throw vmm::error(st, m);
}

}  // namespace

namespace vmm::torch_lib {
vmm::allocator* existing_allocator(int d) noexcept { return existing(d); }
vmm::allocator* allocator_of(int d) noexcept { return get(d); }
vmm::backend_iface* backend_of(int d) noexcept { return existing(d) ? slots[d].backend : nullptr; }
void set_last_error(const std::string& s) noexcept { set_error(s); }
}  // namespace vmm::torch_lib

namespace {
// Device d's free and total memory as the driver reports them (cuMemGetInfo; the host backend's
// simulated limit). Throws vmm::error.
vmm::memory_info device_memory(int d) {
  const auto m = slots[d].backend->mem_info();
  if (!m.ok()) throw vmm::error(m.st, "cuMemGetInfo");
  return m.value;
}
}  // namespace

extern "C" {

void* vmm_torch_malloc(ssize_t size, int device, void* stream) {
  return do_malloc(size, device, stream, true);
}

void* vmm_torch_try_malloc(ssize_t size, int device, void* stream) {
  try {
    return do_malloc(size, device, stream, false);
  } catch (...) {  // bad_alloc from message text
    return nullptr;
  }
}

void vmm_torch_free(void* ptr, ssize_t size, int device, void* stream) try {
  if (!ptr) return;
  vmm::allocator* a = existing(device);
  if (!a) {
    set_error("vmmalloc_torch: free on device " + std::to_string(device) +
              ", which has no allocator: pointer not from vmmalloc");
    if (device >= 0 && device < kMaxDevices) slots[device].free_failures.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  vmm::torch_lib::forget_share(ptr);  // its exported fds close before the block can be reused
  // The stream the block was allocated on (PyTorch and CuPy pass it back): reuse on that stream
  // is immediate, other streams wait for a fence recorded after this point.
  vmm::status st = a->try_deallocate(ptr, stream);
  if (st.ok() && size > 0) {  // size: what PyTorch asked for when it allocated
    slots[device].requested.sub(static_cast<std::uint64_t>(size));
    slots[device].allocated.sub(torch_rounded(static_cast<std::uint64_t>(size)));
  }
  if (!st.ok()) {
    slots[device].free_failures.fetch_add(1, std::memory_order_relaxed);
    set_error("vmmalloc_torch: free on device " + std::to_string(device) + ": " + vmm::last_error().message);
  }
} catch (...) {  // never throws into PyTorch's deleter: no memory for the message, nothing else
}

int vmm_torch_init(int device) { return get(device) ? 0 : -1; }

int vmm_torch_initialized(int device) { return existing(device) ? 1 : 0; }

const char* vmm_torch_stat_names(void) { return kStatNames; }

// The arguments of a call that copies up to n values of a device's allocator into out.
static bool bad_out_args(const char* what, int device, const void* out, std::int64_t n) {
  if (device >= 0 && device < kMaxDevices && (n == 0 || out) && n >= 0) return false;
  set_error(std::string("vmmalloc_torch: ") + what + ": bad argument (device " + std::to_string(device) + ")");
  return true;
}

static_assert(static_cast<int>(vmm::block_state::pending_free) == 3, "vmmalloc_torch.h numbers the states");

int64_t vmm_torch_memory_map(int device, uint64_t* out, int64_t n) try {
  if (bad_out_args("memory_map", device, out, n)) return -1;
  vmm::allocator* a = existing(device);
  if (!a) return 0;
  try {
    const std::vector<vmm::segment_info> map = a->memory_map();
    std::int64_t count = 0;
    for (const auto& seg : map)
      for (const auto& b : seg.blocks) {
        if (count < n) {
          std::uint64_t* r = out + count * VMM_TORCH_MAP_WORDS;
          r[0] = seg.addr;
          r[1] = seg.size;
          r[2] = seg.pool;
          r[3] = seg.huge ? 1 : 0;
          r[4] = b.addr;
          r[5] = b.size;
          r[6] = b.requested;
          r[7] = static_cast<std::uint64_t>(b.state);
        }
        ++count;
      }
    return count;
  } catch (const std::exception& e) {
    set_error(std::string("vmmalloc_torch: memory_map: ") + e.what());
    return -1;
  }
} catch (...) {
  return -1;
}

int vmm_torch_stats(int device, uint64_t* out, int n) try {
  if (bad_out_args("stats", device, out, n)) return -1;
  vmm::allocator* a = existing(device);
  if (!a) return 0;
  try {
    vmm::allocator_stats s = a->stats();
    std::vector<std::uint64_t> v;
#define VMM_TORCH_VALUE(f) v.push_back(static_cast<std::uint64_t>(s.f));
    VMM_TORCH_STATS(VMM_TORCH_VALUE)
#undef VMM_TORCH_VALUE
    const device_slot& d = slots[device];
    for (const live_bytes* c : {&d.requested, &d.allocated}) {
      v.push_back(c->now.load(std::memory_order_relaxed));
      v.push_back(c->peak.load(std::memory_order_relaxed));
    }
    v.push_back(s.calls.total());
    v.push_back(s.calls.failures);
    v.push_back(a->granularity());
    v.push_back(slots[device].peers);
    v.push_back(slots[device].malloc_failures.load(std::memory_order_relaxed));
    v.push_back(slots[device].free_failures.load(std::memory_order_relaxed));
    for (std::uint64_t x : {s.calls.create, s.calls.map, s.calls.unmap, s.calls.set_access, s.calls.release,
                            s.calls.record_fence, s.calls.fence_query, s.calls.wait_fence, s.calls.ns,
                            s.calls.fence_ns, s.chunks_retired})
      v.push_back(x);
    std::copy_n(v.begin(), std::min<std::size_t>(v.size(), static_cast<std::size_t>(n)), out);
    return static_cast<int>(v.size());
  } catch (const std::exception& e) {
    set_error(std::string("vmmalloc_torch: stats: ") + e.what());
    return -1;
  }
} catch (...) {
  return -1;
}


int vmm_torch_mem_info(int device, uint64_t* free_bytes, uint64_t* total_bytes) {
  if (!free_bytes || !total_bytes) {
    set_error("vmmalloc_torch: mem_info: free_bytes and total_bytes must not be NULL");
    return -1;
  }
  return for_device(device, "mem_info", [&](vmm::allocator&) {
    const auto m = device_memory(device);
    *free_bytes = m.free;
    *total_bytes = m.total;
  });
}

int vmm_torch_set_memory_fraction(int device, double fraction) try {
  if (!(fraction >= 0.0 && fraction <= 1.0)) {  // NaN too
    set_error("vmmalloc_torch: set_memory_fraction: fraction must lie in [0, 1], got " + std::to_string(fraction));
    return -1;
  }
  // The limit belongs to the device's allocator: created now if need be.
  if (device >= 0 && !get(device)) return -1;
  return for_device(device, "set_memory_fraction", [&](vmm::allocator& a) {
    a.set_memory_limit(static_cast<std::size_t>(fraction * static_cast<double>(device_memory(device).total)));
  });
} catch (...) {  // no memory for the message
  return -1;
}

int vmm_torch_memory_fraction(int device, double* fraction) {
  if (!fraction) {
    set_error("vmmalloc_torch: memory_fraction: fraction must not be NULL");
    return -1;
  }
  if (device >= 0 && !get(device)) return -1;
  return for_device(device, "memory_fraction", [&](vmm::allocator& a) {
    const std::size_t total = device_memory(device).total, limit = a.memory_limit();
    *fraction = limit >= total ? 1.0 : static_cast<double>(limit) / static_cast<double>(total);
  });
}

int vmm_torch_trim(int device) {
  return for_devices(device, "trim", [](vmm::allocator& a) { a.trim(); });
}

int vmm_torch_reset_peaks(int device) {
  return for_devices(device, "reset_peaks", [](vmm::allocator& a) {
    a.reset_peaks();
    for (device_slot& d : slots)
      if (d.a == &a) d.requested.reset_peak(), d.allocated.reset_peak();
  });
}

int vmm_torch_check(int device) try {
  std::string why;
  int rc = for_devices(device, "check", [&](vmm::allocator& a) {
    if (why.empty()) why = a.check();
  });
  if (rc) return -1;
  if (!why.empty()) {
    set_error("vmmalloc_torch: check: " + why);
    return 1;
  }
  return 0;
} catch (...) {
  return -1;
}

int vmm_torch_flush_trace(void) {
  return for_devices(-1, "flush_trace", [](vmm::allocator& a) { a.flush_trace(); });
}

int vmm_torch_begin_pool(int device, uint64_t pool, vmm_torch_stream_filter filter, void* user) try {
  vmm::allocator* a = get(device);  // a capture may begin before the device's first allocation
  if (!a) return -1;
  std::function<bool(vmm::stream_t)> f;
  if (filter) f = [filter, user](vmm::stream_t s) { return filter(s, user) != 0; };
  try {
    a->begin_pool(pool, std::move(f));
  } catch (const std::exception& e) {
    set_error(std::string("vmmalloc_torch: begin_pool on device ") + std::to_string(device) + ": " + e.what());
    return -1;
  }
  return 0;
} catch (...) {
  return -1;
}

int vmm_torch_end_pool(int device, uint64_t pool) {
  return for_device(device, "end_pool", [pool](vmm::allocator& a) { a.end_pool(pool); });
}

int vmm_torch_release_pool(int device, uint64_t pool) {
  return for_device(device, "release_pool",
                     [pool](vmm::allocator& a) { a.release_pool(pool); });
}

int vmm_torch_device_of(const void* ptr) {
  if (!ptr) return -1;
  for (int d = 0; d < kMaxDevices; ++d)
    if (vmm::allocator* a = existing(d); a && a->owns(ptr)) return d;
  return -1;
}

int vmm_torch_record_stream(void* ptr, void* stream) try {
  const int d = vmm_torch_device_of(ptr);
  if (d < 0) {
    set_error("vmmalloc_torch: record_stream: pointer not from vmmalloc");
    return -1;
  }
  try {
    slots[d].a->record_stream(ptr, stream);
  } catch (const std::exception& e) {
    set_error("vmmalloc_torch: record_stream on device " + std::to_string(d) + ": " + e.what());
    return -1;
  }
  return 0;
} catch (...) {
  return -1;
}

int vmm_torch_pool_of(const void* ptr, uint64_t* pool) try {
  const int d = vmm_torch_device_of(ptr);
  vmm::allocator::pool_id id = 0;
  if (d < 0 || !slots[d].a->pool_of(ptr, id)) return 0;
  if (pool) *pool = id;
  return 1;
} catch (...) {  // std::system_error from the lock
  return -1;
}

int vmm_torch_pool_stats(int device, uint64_t pool, uint64_t* live, uint64_t* allocated, uint64_t* held) try {
  if (device < 0 || device >= kMaxDevices) {
    set_error("vmmalloc_torch: pool_stats: device " + std::to_string(device) + " out of range");
    return -1;
  }
  vmm::allocator* a = existing(device);
  vmm::allocator::pool_info pi;
  if (!a || !a->pool_stats(pool, pi)) return 0;
  if (live) *live = pi.live;
  if (allocated) *allocated = pi.allocated;
  if (held) *held = pi.held;
  return 1;
} catch (...) {
  return -1;
}

const char* vmm_torch_config(int device) {
  try {
    vmm::allocator* a = existing(device);
    config_copy = a ? slots[device].config : std::string();
  } catch (...) {
    config_copy.clear();
  }
  return config_copy.c_str();
}

const char* vmm_torch_last_error(void) {
  try {
    std::lock_guard g(err_mu);
    err_copy = err_text;
  } catch (...) {
    err_copy.clear();
  }
  return err_copy.c_str();
}

}  // extern "C"
