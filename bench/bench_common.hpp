// SPDX-License-Identifier: Apache-2.0
// Shared by the bench_* binaries: which allocator peers exist here (decided at run time, so one
// binary runs on any machine), one factory per peer (RMM's BENCHMARK_CAPTURE style), and a
// helper to strip our own flags before Google Benchmark sees argv.
#pragma once

#include <benchmark/benchmark.h>

#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "peers.hpp"

namespace vmm::bench {

using vmm::replay::peer;
using factory = std::unique_ptr<peer> (*)();

struct peer_kind {
  const char* name;  // used in benchmark names: alloc_free/<name>/...
  factory make;
};

// One factory per peer.
inline std::unique_ptr<peer> make_vmmalloc_host() { return vmm::replay::make_vmmalloc_host(); }
inline std::unique_ptr<peer> make_malloc() { return vmm::replay::make_malloc(); }
inline std::unique_ptr<peer> make_vmmalloc_cuda() { return vmm::replay::make_vmmalloc_cuda(0); }
inline std::unique_ptr<peer> make_cuda_malloc() { return vmm::replay::make_cuda_malloc(0); }
inline std::unique_ptr<peer> make_cuda_malloc_async() { return vmm::replay::make_cuda_malloc_async(0); }
#ifdef VMM_REPLAY_TORCH
inline std::unique_ptr<peer> make_torch() { return vmm::replay::make_torch(0); }
#endif

// Host peers always (vmmalloc's host backend, glibc malloc as the host reference); the GPU peers
// only when vmmalloc's CUDA backend opens and cudart sees a device. Says on stderr what it left out.
inline const std::vector<peer_kind>& available_peers() {
  static const std::vector<peer_kind> kinds = [] {
    std::vector<peer_kind> k = {{"vmmalloc_host", make_vmmalloc_host}, {"malloc", make_malloc}};
    try {
      make_vmmalloc_cuda().reset();  // probe: driver + device + VMM support
      k.push_back({"vmmalloc_cuda", make_vmmalloc_cuda});
    } catch (const std::exception& e) {
      std::fprintf(stderr, "bench: vmmalloc_cuda left out: %s\n", e.what());
    }
    std::string why;
    if (vmm::replay::cuda_device_present(&why)) {
      k.push_back({"cudaMalloc", make_cuda_malloc});
      k.push_back({"cudaMallocAsync", make_cuda_malloc_async});
    } else {
      std::fprintf(stderr, "bench: cudaMalloc, cudaMallocAsync left out: %s\n", why.c_str());
    }
#ifdef VMM_REPLAY_TORCH  // a build against libtorch (-DVMM_WITH_TORCH=ON): PyTorch's caching allocator
    if (vmm::replay::have_torch_peer() && vmm::replay::cuda_device_present(&why)) k.push_back({"torch", make_torch});
#endif
    return k;
  }();
  return kinds;
}

inline void skip(benchmark::State& st, const std::string& what) {
  st.SkipWithError((what + ": " + peer::error()).c_str());
}

// Removes "--name=value" from argv (before benchmark::Initialize) and returns value, or def.
inline std::string take_flag(int& argc, char** argv, const char* name, const std::string& def) {
  const std::size_t len = std::strlen(name);
  std::string v = def;
  int out = 1;
  for (int i = 1; i < argc; ++i) {
    const char* a = argv[i];
    if (std::strncmp(a, "--", 2) == 0 && std::strncmp(a + 2, name, len) == 0 &&
        (a[2 + len] == '\0' || a[2 + len] == '=')) {
      v = a[2 + len] == '=' ? std::string(a + 3 + len) : std::string("1");
      continue;
    }
    argv[out++] = argv[i];
  }
  argc = out;
  argv[argc] = nullptr;
  return v;
}

}  // namespace vmm::bench
