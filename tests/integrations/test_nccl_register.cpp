// SPDX-License-Identifier: Apache-2.0
// NCCL over vmmalloc memory: buffers from an exportable policy (POSIX fd handles, chunks of the
// recommended granularity, peers granted) register with ncclCommRegister, and an all-reduce (sum)
// over them gives the right values on every device. One process, up to two GPUs (ncclCommInitAll).
//
// NCCL is loaded at run time (dlopen): $VMM_NCCL_LIB, else the nvidia-nccl pip package found by
// python3 (nvidia/nccl/lib/libnccl.so.2), else the system's libnccl.so.2. nccl.h is used for
// types only. NVLS (multicast) stays off: NCCL_NVLS_ENABLE=0 is set before any NCCL call, so NCCL
// never calls cuMulticastCreate.
//
// Exit 0: two GPUs, all checks passed. Exit 77 (skipped): no NCCL library, no CUDA device, or one
// GPU only (then the one-rank register + all-reduce still runs first, and a failure there is 1).
// Exit 1: a failure, with the call and the reason printed.
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <nccl.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "vmmalloc/cuda_backend.hpp"
#include "vmmalloc/vmmalloc.hpp"

namespace {

struct nccl_api {
  void* lib = nullptr;
  decltype(&ncclGetVersion) GetVersion = nullptr;
  decltype(&ncclCommInitAll) CommInitAll = nullptr;
  decltype(&ncclCommDestroy) CommDestroy = nullptr;
  decltype(&ncclCommRegister) CommRegister = nullptr;
  decltype(&ncclCommDeregister) CommDeregister = nullptr;
  decltype(&ncclAllReduce) AllReduce = nullptr;
  decltype(&ncclGroupStart) GroupStart = nullptr;
  decltype(&ncclGroupEnd) GroupEnd = nullptr;
  decltype(&ncclGetErrorString) GetErrorString = nullptr;
  decltype(&ncclGetLastError) GetLastError = nullptr;  // optional
};
nccl_api nc;

[[noreturn]] void die(const std::string& m) {
  std::fprintf(stderr, "test_nccl_register: FAILED: %s\n", m.c_str());
  std::exit(1);
}

#define CUDA_OK(call)                                                                          \
  do {                                                                                         \
    cudaError_t e_ = (call);                                                                   \
    if (e_ != cudaSuccess)                                                                     \
      die(std::string(#call) + ": " + cudaGetErrorName(e_) + ": " + cudaGetErrorString(e_));   \
  } while (0)

#define NCCL_OK(call)                                                                          \
  do {                                                                                         \
    ncclResult_t r_ = (call);                                                                  \
    if (r_ != ncclSuccess)                                                                     \
      die(std::string(#call) + ": " + nc.GetErrorString(r_) +                                  \
          (nc.GetLastError ? std::string(" (") + nc.GetLastError(nullptr) + ")" : ""));        \
  } while (0)

// The nvidia-nccl pip package's lib folder, asked of python3 (nvidia.nccl may be a namespace
// package: __path__, not __file__).
std::string pip_nccl() {
  std::FILE* p = popen("python3 -c 'import nvidia.nccl as n; print(list(n.__path__)[0])' 2>/dev/null", "r");
  if (!p) return {};
  char buf[4096] = {};
  std::string dir = std::fgets(buf, sizeof buf, p) ? buf : "";
  pclose(p);
  while (!dir.empty() && (dir.back() == '\n' || dir.back() == '\r')) dir.pop_back();
  return dir.empty() ? dir : dir + "/lib/libnccl.so.2";
}

// Loads NCCL; false (with the reasons printed) when no library is found.
bool load_nccl() {
  std::vector<std::string> cands;
  if (const char* e = std::getenv("VMM_NCCL_LIB"); e && *e) cands.push_back(e);
  if (std::string p = pip_nccl(); !p.empty()) cands.push_back(p);
  cands.push_back("libnccl.so.2");
  for (auto& c : cands) {
    nc.lib = dlopen(c.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (nc.lib) {
      std::printf("NCCL library: %s\n", c.c_str());
      break;
    }
    std::printf("  no NCCL at %s: %s\n", c.c_str(), dlerror());
  }
  if (!nc.lib) return false;
  auto sym = [](const char* n, bool required) {
    void* s = dlsym(nc.lib, n);
    if (!s && required) die(std::string("NCCL library lacks ") + n + " (NCCL >= 2.19 is needed)");
    return s;
  };
#define NCCL_SYM(f) nc.f = reinterpret_cast<decltype(nc.f)>(sym("nccl" #f, true))
  NCCL_SYM(GetVersion);
  NCCL_SYM(CommInitAll);
  NCCL_SYM(CommDestroy);
  NCCL_SYM(CommRegister);
  NCCL_SYM(CommDeregister);
  NCCL_SYM(AllReduce);
  NCCL_SYM(GroupStart);
  NCCL_SYM(GroupEnd);
  NCCL_SYM(GetErrorString);
#undef NCCL_SYM
  nc.GetLastError = reinterpret_cast<decltype(nc.GetLastError)>(sym("ncclGetLastError", false));
  return true;
}

// One device's side: its allocator (exportable policy) and its registered buffers.
struct rank {
  int dev = 0;
  std::unique_ptr<vmm::allocator> a;
  cudaStream_t stream = nullptr;
  ncclComm_t comm = nullptr;
  struct buf {
    void* p = nullptr;
    std::size_t bytes = 0;
    void* reg = nullptr;  // ncclCommRegister's handle
  };
  std::vector<buf> bufs;  // [0] float send, [1] float recv, [2] int32 in place, [3] odd-size float
};

}  // namespace

int main() {
  // Before any NCCL call: no NVLS (multicast objects). Unless the caller chose its own debug
  // output, NCCL prints its registration messages (NCCL_DEBUG_SUBSYS=REG): the evidence that the
  // registered vmmalloc buffers were used, not copied through NCCL's own buffers.
  setenv("NCCL_NVLS_ENABLE", "0", 1);
  if (!std::getenv("NCCL_DEBUG")) {
    setenv("NCCL_DEBUG", "INFO", 1);
    setenv("NCCL_DEBUG_SUBSYS", "REG", 1);
  }

  int ndev_all = 0;
  if (cudaError_t e = cudaGetDeviceCount(&ndev_all); e != cudaSuccess || ndev_all == 0) {
    std::printf("test_nccl_register: skipped: no CUDA device (%s)\n",
                e == cudaSuccess ? "0 devices" : cudaGetErrorString(e));
    return 77;
  }
  if (!load_nccl()) {
    std::printf("test_nccl_register: skipped: no NCCL library (set VMM_NCCL_LIB, or pip install nvidia-nccl-cu13)\n");
    return 77;
  }
  int ver = 0;
  NCCL_OK(nc.GetVersion(&ver));
  std::printf("NCCL version %d (header %d.%d), %d CUDA device(s)\n", ver, NCCL_MAJOR, NCCL_MINOR, ndev_all);
  if (ver < 21900) {
    std::printf("test_nccl_register: skipped: NCCL %d has no ncclCommRegister (2.19+)\n", ver);
    return 77;
  }

  const int n = ndev_all >= 2 ? 2 : 1;
  std::vector<rank> ranks(n);
  std::vector<int> devs(n);
  for (int i = 0; i < n; ++i) ranks[i].dev = devs[i] = i;

  // Allocators: POSIX fd handles (what NCCL exports to map a registered buffer on the peer),
  // chunks in multiples of the recommended granularity, every other rank granted access.
  for (auto& r : ranks) {
    CUDA_OK(cudaSetDevice(r.dev));
    CUDA_OK(cudaStreamCreateWithFlags(&r.stream, cudaStreamNonBlocking));
    vmm::options o;
    o.device = r.dev;
    o.ipc = vmm::ipc_kind::posix_fd;
    o.reservation_size = std::size_t{8} << 30;
    {  // printed for the record: the allocator maps in multiples of the minimum (equal on H100/H200)
      vmm::cuda_backend probe(r.dev);
      if (!probe.available()) die("cuda_backend(" + std::to_string(r.dev) + "): " + probe.load_message());
      vmm::chunk_props props;
      props.id = r.dev;
      props.ipc = vmm::ipc_kind::posix_fd;
      auto g = probe.granularity(props);
      if (!g.ok()) die("granularity: " + g.st.message());
      std::printf("device %d: granularity minimum %zu, recommended %zu\n", r.dev, g.value.minimum,
                  g.value.recommended);
    }
    for (auto& p : ranks) {
      if (p.dev == r.dev) continue;
      int can = 0;
      CUDA_OK(cudaDeviceCanAccessPeer(&can, p.dev, r.dev));
      if (can) o.peers.push_back({p.dev, vmm::access_mode::read_write});
      else std::printf("device %d cannot access device %d: NCCL will not use P2P\n", p.dev, r.dev);
    }
    try {
      r.a = std::make_unique<vmm::allocator>(o);
    } catch (const std::exception& e) {
      die(std::string("vmm::allocator with ipc = posix_fd on device ") + std::to_string(r.dev) + ": " + e.what());
    }
  }

  std::vector<ncclComm_t> comms(n);
  NCCL_OK(nc.CommInitAll(comms.data(), n, devs.data()));
  for (int i = 0; i < n; ++i) ranks[i].comm = comms[i];

  const std::size_t count = std::size_t{8} << 20;  // 8 Mi elements: 32 MiB per buffer
  const std::size_t odd = 1000003;                  // not a multiple of anything
  for (auto& r : ranks) {
    CUDA_OK(cudaSetDevice(r.dev));
    r.bufs = {{nullptr, count * 4}, {nullptr, count * 4}, {nullptr, count * 4}, {nullptr, odd * 4}};
    for (auto& b : r.bufs) {
      try {
        b.p = r.a->allocate(b.bytes, 0, r.stream);
      } catch (const std::exception& e) {
        die(std::string("allocate on device ") + std::to_string(r.dev) + ": " + e.what());
      }
      NCCL_OK(nc.CommRegister(r.comm, b.p, b.bytes, &b.reg));
      if (!b.reg)  // NCCL_LOCAL_REGISTER=0 or NCCL_P2P_USE_CUDA_MEMCPY=1 in the environment
        die("NCCL skipped the registration (null handle): check NCCL_LOCAL_REGISTER / NCCL_P2P_USE_CUDA_MEMCPY");
    }
    std::printf("device %d: 4 vmmalloc buffers registered (%zu chunks mapped, %zu bytes)\n", r.dev,
                r.a->stats().chunks, r.a->stats().mapped);
  }

  // Inputs: rank i holds (k % 1013) * (i + 1) (floats, exact sums) and k + 7 * i (int32).
  for (int i = 0; i < n; ++i) {
    auto& r = ranks[i];
    CUDA_OK(cudaSetDevice(r.dev));
    std::vector<float> f(count);
    std::vector<std::int32_t> v(count);
    for (std::size_t k = 0; k < count; ++k) {
      f[k] = static_cast<float>((k % 1013) * (i + 1));
      v[k] = static_cast<std::int32_t>(k) + 7 * i;
    }
    CUDA_OK(cudaMemcpy(r.bufs[0].p, f.data(), count * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemset(r.bufs[1].p, 0xff, count * 4));  // NaN: an element not written shows
    CUDA_OK(cudaMemcpy(r.bufs[2].p, v.data(), count * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(r.bufs[3].p, f.data(), odd * 4, cudaMemcpyHostToDevice));
  }

  // Twice: the second round runs on buffers NCCL has already seen registered.
  for (int round = 0; round < 2; ++round) {
    NCCL_OK(nc.GroupStart());
    for (auto& r : ranks) {
      NCCL_OK(nc.AllReduce(r.bufs[0].p, r.bufs[1].p, count, ncclFloat, ncclSum, r.comm, r.stream));
      if (round == 0) {  // in place, once (a second sum would double it)
        NCCL_OK(nc.AllReduce(r.bufs[2].p, r.bufs[2].p, count, ncclInt32, ncclSum, r.comm, r.stream));
        NCCL_OK(nc.AllReduce(r.bufs[3].p, r.bufs[3].p, odd, ncclFloat, ncclSum, r.comm, r.stream));
      }
    }
    NCCL_OK(nc.GroupEnd());
    for (auto& r : ranks) {
      CUDA_OK(cudaSetDevice(r.dev));
      CUDA_OK(cudaStreamSynchronize(r.stream));
    }
  }

  const long tri = static_cast<long>(n) * (n + 1) / 2;  // sum of (i + 1)
  std::size_t bad = 0;
  for (auto& r : ranks) {
    CUDA_OK(cudaSetDevice(r.dev));
    std::vector<float> f(count), g(odd);
    std::vector<std::int32_t> v(count);
    CUDA_OK(cudaMemcpy(f.data(), r.bufs[1].p, count * 4, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(v.data(), r.bufs[2].p, count * 4, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(g.data(), r.bufs[3].p, odd * 4, cudaMemcpyDeviceToHost));
    std::size_t here = 0;
    for (std::size_t k = 0; k < count; ++k) {
      float ef = static_cast<float>((k % 1013) * tri);
      std::int64_t ev = static_cast<std::int64_t>(k) * n + 7 * (static_cast<std::int64_t>(n) * (n - 1) / 2);
      bool ok = f[k] == ef && v[k] == ev && (k >= odd || g[k] == ef);
      if (!ok && here++ < 5)
        std::printf("device %d element %zu: float %g (want %g), int %d (want %lld), odd %g\n", r.dev, k,
                    f[k], ef, v[k], static_cast<long long>(ev), k < odd ? g[k] : 0.0f);
    }
    bad += here;
    std::printf("device %d: %zu wrong elements of %zu + %zu + %zu\n", r.dev, here, count, count, odd);
  }

  // Teardown: deregister, destroy the communicators (they may hold imports of our chunks), then
  // free the buffers and check the allocators.
  for (auto& r : ranks) {
    CUDA_OK(cudaSetDevice(r.dev));
    for (auto& b : r.bufs) NCCL_OK(nc.CommDeregister(r.comm, b.reg));
  }
  for (auto& r : ranks) NCCL_OK(nc.CommDestroy(r.comm));
  for (auto& r : ranks) {
    for (auto& b : r.bufs) r.a->deallocate(b.p, r.stream);
    CUDA_OK(cudaStreamSynchronize(r.stream));
    std::string why = r.a->check();
    if (!why.empty()) die("allocator check on device " + std::to_string(r.dev) + ": " + why);
    auto s = r.a->stats();
    std::printf("device %d: after teardown live %llu, %llu driver calls (%llu failed)\n", r.dev,
                static_cast<unsigned long long>(s.live), static_cast<unsigned long long>(s.calls.total()),
                static_cast<unsigned long long>(s.calls.failures));
    if (s.live != 0) die("blocks still live after teardown");
    r.a.reset();
    CUDA_OK(cudaStreamDestroy(r.stream));
  }
  if (bad) die(std::to_string(bad) + " wrong elements after the all-reduce");

  if (n < 2) {
    std::printf("test_nccl_register: one-rank register + all-reduce passed; skipped: the two-GPU "
                "all-reduce needs 2 GPUs (%d present)\n", ndev_all);
    return 77;
  }
  std::printf("test_nccl_register: passed: all-reduce over registered vmmalloc buffers on 2 GPUs\n");
  return 0;
}
