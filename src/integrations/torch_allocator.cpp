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
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <limits>
#include <mutex>
#include <new>
#include <string>
#include <vector>

#include "vmmalloc/cuda_backend.hpp"
#include "vmmalloc/vmmalloc.hpp"

namespace {

constexpr int kMaxDevices = 256;  // PyTorch's DeviceIndex is int8: 128 would do

struct device_slot {
  vmm::allocator* a = nullptr;       // written once under create_mu, then read through `ready`
  std::atomic<vmm::allocator*> ready{nullptr};
  std::atomic<std::uint64_t> malloc_failures{0}, free_failures{0};
  std::string config;                // written once under create_mu before `ready` is published
  std::size_t peers = 0;
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

// "512M", "8GiB", "1t", "4096", "64 KB": binary multiples. allow_max: "max" / "inf" = SIZE_MAX.
std::size_t parse_size(const char* name, const char* text, bool allow_max) {
  std::string t = lower(text);
  t.erase(0, t.find_first_not_of(" \t"));
  t.erase(t.find_last_not_of(" \t") + 1);
  if (allow_max && (t == "max" || t == "inf" || t == "none"))
    return std::numeric_limits<std::size_t>::max();
  auto bad = [&](const char* why) {
    return env_error(std::string(name) + "='" + text + "': " + why +
                     " (expected bytes with an optional K/M/G/T suffix, e.g. 512M" +
                     (allow_max ? ", or max)" : ")"));
  };
  if (t.empty() || !std::isdigit(static_cast<unsigned char>(t[0]))) throw bad("not a size");
  errno = 0;
  char* end = nullptr;
  unsigned long long v = std::strtoull(t.c_str(), &end, 10);
  if (errno == ERANGE) throw bad("too large");
  std::string suf(end);
  suf.erase(0, suf.find_first_not_of(" \t"));
  unsigned shift = 0;
  if (suf.empty() || suf == "b") shift = 0;
  else if (suf == "k" || suf == "kb" || suf == "kib") shift = 10;
  else if (suf == "m" || suf == "mb" || suf == "mib") shift = 20;
  else if (suf == "g" || suf == "gb" || suf == "gib") shift = 30;
  else if (suf == "t" || suf == "tb" || suf == "tib") shift = 40;
  else throw bad("unknown suffix");
  if (shift && v > (std::numeric_limits<std::size_t>::max() >> shift)) throw bad("too large");
  return static_cast<std::size_t>(v) << shift;
}

const char* env(const char* name) {
  const char* v = std::getenv(name);
  return v && *v ? v : nullptr;
}

bool parse_bool(const char* name, const char* text) {
  std::string t = lower(text);
  if (t == "1" || t == "true" || t == "on" || t == "yes") return true;
  if (t == "0" || t == "false" || t == "off" || t == "no") return false;
  throw env_error(std::string(name) + "='" + text + "': expected 0 or 1");
}

// VMMALLOC_PEERS: nullopt-like flag `automatic` or an explicit list.
struct peer_spec {
  bool automatic = true;
  std::vector<int> list;
};

peer_spec parse_peers(const char* text) {
  peer_spec p;
  std::string t = lower(text);
  if (t == "auto") return p;
  p.automatic = false;
  if (t == "none" || t == "") return p;
  std::size_t i = 0;
  while (i <= t.size()) {
    std::size_t j = t.find(',', i);
    if (j == std::string::npos) j = t.size();
    std::string item = t.substr(i, j - i);
    char* end = nullptr;
    errno = 0;
    long d = item.empty() ? -1 : std::strtol(item.c_str(), &end, 10);
    if (item.empty() || *end || errno || d < 0 || d >= kMaxDevices)
      throw env_error(std::string("VMMALLOC_PEERS='") + text +
                      "': expected auto, none, or a comma list of device ordinals");
    p.list.push_back(static_cast<int>(d));
    i = j + 1;
  }
  return p;
}

// The options of one device's allocator, from the environment. Throws env_error.
vmm::options options_from_env(int device) {
  vmm::options o;
  o.device = device;
  if (const char* v = env("VMMALLOC_RESERVATION")) o.reservation_size = parse_size("VMMALLOC_RESERVATION", v, false);
  if (const char* v = env("VMMALLOC_RELEASE_THRESHOLD"))
    o.release_threshold = parse_size("VMMALLOC_RELEASE_THRESHOLD", v, true);
  if (const char* v = env("VMMALLOC_MEMORY_LIMIT")) o.memory_limit = parse_size("VMMALLOC_MEMORY_LIMIT", v, true);
  if (const char* v = env("VMMALLOC_MAX_GROWTH")) o.max_growth = parse_size("VMMALLOC_MAX_GROWTH", v, false);
  if (const char* v = env("VMMALLOC_MIN_CHUNK")) o.min_chunk = parse_size("VMMALLOC_MIN_CHUNK", v, false);
  if (const char* v = env("VMMALLOC_THREAD_CACHE")) o.thread_cache = parse_bool("VMMALLOC_THREAD_CACHE", v);

  // ---- VMMALLOC_TRACE: trace recording (options.trace_path) ----------------------------------
  // One file per device: "%d" in the path is replaced by the device ordinal; without it device 0
  // writes the path itself and device d writes "<path>.<d>", so two devices never share a file.
  // Allocators live until exit, so buffered events are written by vmm_torch_flush_trace() and by an
  // atexit handler (frees after that, during the last teardown, are not recorded).
  if (const char* v = env("VMMALLOC_TRACE")) {
    std::string path = v;
    if (auto at = path.find("%d"); at != std::string::npos)
      path.replace(at, 2, std::to_string(device));
    else if (device != 0)
      path += "." + std::to_string(device);
    o.trace_path = path;
  }
  // ---- end VMMALLOC_TRACE ----------------------------------------------------------------------
  return o;
}

std::string describe(const vmm::allocator& a, const char* backend) {
  const vmm::options& o = a.opts();
  auto sz = [](std::size_t n) {
    return n == std::numeric_limits<std::size_t>::max() ? std::string("max") : std::to_string(n);
  };
  std::string s = "device=" + std::to_string(o.device) + " backend=" + backend +
                  " granularity=" + std::to_string(a.granularity()) +
                  " reservation=" + std::to_string(a.stats().reserved) +
                  " release_threshold=" + sz(o.release_threshold) +
                  " memory_limit=" + sz(o.memory_limit) + " max_growth=" + sz(o.max_growth) +
                  " min_chunk=" + sz(o.min_chunk) + " thread_cache=" + (o.thread_cache ? "1" : "0") +
                  (o.trace_path.empty() ? "" : " trace=" + o.trace_path) +
                  " peers=[";
  for (std::size_t i = 0; i < o.peers.size(); ++i)
    s += (i ? "," : "") + std::to_string(o.peers[i].device);
  return s + "]";
}

// Creates device d's allocator (caller holds create_mu). Throws vmm::error / env_error.
void create(int d) {
  device_slot& s = slots[d];
  vmm::options o = options_from_env(d);
  peer_spec ps;
  if (const char* v = env("VMMALLOC_PEERS")) ps = parse_peers(v);
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
  std::vector<int> want;
  if (ps.automatic) {
    for (int p = 0; p < count && p < kMaxDevices; ++p)
      if (p != d && b->can_access_peer(p, d)) want.push_back(p);
  } else {
    for (int p : ps.list) {
      if (p == d) continue;
      if (p >= count || !b->can_access_peer(p, d))
        throw env_error("VMMALLOC_PEERS: device " + std::to_string(p) + " cannot access device " +
                        std::to_string(d));
      want.push_back(p);
    }
  }
  for (int p : want) o.peers.push_back({p, vmm::access_mode::read_write});

  // Throws vmm::error when the arena cannot open; owned here until published, never freed after.
  auto a = std::make_unique<vmm::allocator>(std::move(b), o);
  std::string config = describe(*a, be.c_str());
  if (!o.trace_path.empty()) {
    static std::once_flag registered;
    std::call_once(registered, [] { std::atexit([] { vmm_torch_flush_trace(); }); });
  }
  s.peers = want.size();
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

#define VMM_TORCH_STATS(X)                                                                     \
  X(requested) X(allocated) X(mapped) X(physical) X(reserved) X(peak_requested)                \
  X(peak_allocated) X(peak_mapped) X(peak_physical) X(chunks) X(idle) X(free_chunk_bytes)      \
  X(slab_bytes) X(allocs) X(frees) X(live) X(deferred) X(grows) X(chunk_releases) X(trims)     \
  X(stitched) X(compression_fallbacks) X(traced_events)

#define VMM_TORCH_NAME(f) #f ","
constexpr char kStatNames[] = VMM_TORCH_STATS(VMM_TORCH_NAME)
    "driver_calls,driver_failures,granularity,peers,malloc_failures,free_failures";
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
  if (void* p = a->try_allocate(static_cast<std::size_t>(size), 0, stream)) return p;

  slots[device].malloc_failures.fetch_add(1, std::memory_order_relaxed);
  vmm::status st = vmm::last_error().st;
  std::string m;
  try {
    vmm::allocator_stats s = a->stats();
    m = "vmmalloc: cannot allocate " + human(static_cast<std::size_t>(size)) + " on device " +
        std::to_string(device) + ": " + vmm::last_error().message + " (mapped " + human(s.mapped) +
        ", requested " + human(s.requested) + ", " + std::to_string(s.live) + " live blocks)";
  } catch (...) {
    m = "vmmalloc: cannot allocate " + std::to_string(size) + " bytes";
  }
  set_error(m);
  if (!throwing) return nullptr;
  if (st.kind == vmm::errc::out_of_memory) throw vmm::out_of_memory(st, m);
  throw vmm::error(st, m);
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

void vmm_torch_free(void* ptr, ssize_t /*size*/, int device, void* stream) try {
  if (!ptr) return;
  vmm::allocator* a = existing(device);
  if (!a) {
    set_error("vmmalloc_torch: free on device " + std::to_string(device) +
              ", which has no allocator: pointer not from vmmalloc");
    if (device >= 0 && device < kMaxDevices) slots[device].free_failures.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  // The stream the block was allocated on (PyTorch and CuPy pass it back): reuse on that stream
  // is immediate, other streams wait for a fence recorded after this point.
  vmm::status st = a->try_deallocate(ptr, stream);
  if (!st.ok()) {
    slots[device].free_failures.fetch_add(1, std::memory_order_relaxed);
    set_error("vmmalloc_torch: free on device " + std::to_string(device) + ": " + vmm::last_error().message);
  }
} catch (...) {  // never throws into PyTorch's deleter: no memory for the message, nothing else
}

int vmm_torch_init(int device) { return get(device) ? 0 : -1; }

int vmm_torch_initialized(int device) { return existing(device) ? 1 : 0; }

const char* vmm_torch_stat_names(void) { return kStatNames; }

int vmm_torch_stats(int device, uint64_t* out, int n) try {
  if (device < 0 || device >= kMaxDevices || (n > 0 && !out) || n < 0) {
    set_error("vmmalloc_torch: stats: bad argument (device " + std::to_string(device) + ")");
    return -1;
  }
  vmm::allocator* a = existing(device);
  if (!a) return 0;
  try {
    vmm::allocator_stats s = a->stats();
    std::vector<std::uint64_t> v;
#define VMM_TORCH_VALUE(f) v.push_back(static_cast<std::uint64_t>(s.f));
    VMM_TORCH_STATS(VMM_TORCH_VALUE)
#undef VMM_TORCH_VALUE
    v.push_back(s.calls.total());
    v.push_back(s.calls.failures);
    v.push_back(a->granularity());
    v.push_back(slots[device].peers);
    v.push_back(slots[device].malloc_failures.load(std::memory_order_relaxed));
    v.push_back(slots[device].free_failures.load(std::memory_order_relaxed));
    std::copy_n(v.begin(), std::min<std::size_t>(v.size(), static_cast<std::size_t>(n)), out);
    return static_cast<int>(v.size());
  } catch (const std::exception& e) {
    set_error(std::string("vmmalloc_torch: stats: ") + e.what());
    return -1;
  }
} catch (...) {
  return -1;
}

int vmm_torch_trim(int device) {
  return for_devices(device, "trim", [](vmm::allocator& a) { a.trim(); });
}

int vmm_torch_reset_peaks(int device) {
  return for_devices(device, "reset_peaks", [](vmm::allocator& a) { a.reset_peaks(); });
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
