// SPDX-License-Identifier: Apache-2.0
// The PyTorch extension's logic (src/integrations/torch_ext/vmm_torch_ext.cpp) in CI, without
// PyTorch: the extension is compiled against stand-ins of the two PyTorch headers it uses
// (torch_stub/, PyTorch 2.11's declarations; a second program with the older MemPool forms) and
// linked into this program, which plays PyTorch's part: it calls the hooks as CUDAGraph,
// make_graphed_callables (shared pools), use_mem_pool and MemPool objects do, on
// libvmmalloc_torch.so with the host backend. What this cannot show: that the real headers
// compile (the GPU machine builds the real extension) and PyTorch's own call sequences
// (gpu.torch_graphs runs those).
#include <doctest/doctest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <unordered_set>

#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>

#include "vmmalloc_torch.h"  // linked: the same copy the extension dlopens by its path

extern "C" {
int vmm_torch_ext_install(const char* lib_path);
int vmm_torch_ext_installed(void);
int vmm_torch_ext_features(void);
int vmm_torch_ext_pool_count(void);
std::uint64_t vmm_torch_ext_pool_id(int device, std::uint64_t first, std::uint64_t second);
const char* vmm_torch_ext_last_error(void);
}

namespace {

namespace tpa = torch::cuda::CUDAPluggableAllocator;
namespace cca = c10::cuda::CUDACachingAllocator;
using mempool_id = c10::cuda::MempoolId_t;

cudaStream_t S(std::uintptr_t i) { return reinterpret_cast<cudaStream_t>(i); }

struct installed {
  installed() {
    setenv("VMMALLOC_TORCH_BACKEND", "host", 1);
    REQUIRE_MESSAGE(vmm_torch_ext_install(VMM_TORCH_LIB_PATH) == 0, vmm_torch_ext_last_error());
  }
};

// PyTorch's side: the current allocator, through the base class PyTorch holds.
tpa::CUDAPluggableAllocator& pluggable() {
  static installed once;
  return static_cast<tpa::CUDAPluggableAllocator&>(*tpa::current_custom_allocator);
}
cca::CUDAAllocator& base() { return pluggable(); }

bool pool_alive(int device, mempool_id id) {
  const std::uint64_t v = vmm_torch_ext_pool_id(device, id.first, id.second);
  return v != 0 && vmm_torch_pool_stats(device, v, nullptr, nullptr, nullptr) == 1;
}

}  // namespace

TEST_CASE("install: once, a pluggable allocator with every hook, MemPool support detected") {
  tpa::CUDAPluggableAllocator& a = pluggable();
  CHECK(vmm_torch_ext_installed() == 1);
  CHECK(a.initialized_);
  CHECK(a.begin_allocate_to_pool_fn_);
  CHECK(a.end_allocate_to_pool_fn_);
  CHECK(a.relase_pool_fn_);
  CHECK(a.record_stream_fn_);
  CHECK(a.reset_fn_);
  CHECK(vmm_torch_ext_features() == 7);  // hooks + MemPool objects + memory snapshot
  CHECK(vmm_torch_ext_install(VMM_TORCH_LIB_PATH) == 0);  // a second call does nothing
  CHECK(vmm_torch_ext_pool_count() == 0);  // the install's probe left nothing behind
}

TEST_CASE("a CUDA graph's capture: its pool, checkPoolLiveAllocations, release as CUDAGraph::reset does") {
  tpa::CUDAPluggableAllocator& a = pluggable();
  const mempool_id id{1, 0};  // what graph_pool_handle(false) makes
  const cudaStream_t cs = S(0x10);
  a.begin_allocate_to_pool_fn_(0, id, [cs](cudaStream_t s) { return s == cs; });
  CHECK(vmm_torch_ext_pool_count() == 1);
  void* t = a.alloc_fn_(1 << 20, 0, cs);   // a temporary of the capture
  void* out = a.alloc_fn_(3 << 20, 0, cs); // the graph's output
  void* other = a.alloc_fn_(1 << 20, 0, S(0x20));
  const std::uint64_t v = vmm_torch_ext_pool_id(0, 1, 0);
  std::uint64_t in = 0;
  CHECK(v != 0);
  CHECK(vmm_torch_pool_of(out, &in) == 1);
  CHECK(in == v);
  CHECK(vmm_torch_pool_of(other, &in) == 0);
  a.free_fn_(t, 1 << 20, 0, cs);  // freed inside the capture
  a.end_allocate_to_pool_fn_(0, id);
  CHECK_THROWS_WITH_AS(a.end_allocate_to_pool_fn_(0, id), doctest::Contains("not currently allocating"), c10::Error);

  // torch.compile's graph trees ask these; the plain pluggable allocator refuses them.
  CHECK(base().checkPoolLiveAllocations(0, id, {out}));
  CHECK_FALSE(base().checkPoolLiveAllocations(0, id, {}));
  CHECK_FALSE(base().checkPoolLiveAllocations(0, id, {out, other}));
  CHECK(base().checkPoolLiveAllocations(0, mempool_id{99, 0}, {}));  // a pool that holds nothing
  CHECK(base().getCheckpointState(0, id) != nullptr);
  CHECK_THROWS_WITH_AS(base().setCheckpointPoolState(0, base().getCheckpointState(0, id)),
                       doctest::Contains("checkpoint"), c10::Error);

  a.relase_pool_fn_(0, id);                // CUDAGraph::reset
  CHECK(vmm_torch_ext_pool_count() == 0);  // PyTorch's use count reached 0
  CHECK(vmm_torch_pool_stats(0, v, nullptr, nullptr, nullptr) == 1);  // `out` keeps vmmalloc's pool
  a.free_fn_(out, 3 << 20, 0, cs);
  CHECK(vmm_torch_pool_stats(0, v, nullptr, nullptr, nullptr) == 0);  // gone with its last block
  a.free_fn_(other, 1 << 20, 0, S(0x20));
  a.relase_pool_fn_(0, id);  // again (a pool it no longer knows): ignored, never throws
}

TEST_CASE("two captures share a pool (make_graphed_callables): released when both graphs are") {
  tpa::CUDAPluggableAllocator& a = pluggable();
  const mempool_id id{0, 7};  // graph_pool_handle()
  const cudaStream_t cs = S(0x30);
  auto filter = [cs](cudaStream_t s) { return s == cs; };
  a.begin_allocate_to_pool_fn_(0, id, filter);
  void* x = a.alloc_fn_(2 << 20, 0, cs);
  a.end_allocate_to_pool_fn_(0, id);
  a.begin_allocate_to_pool_fn_(0, id, filter);  // the second graph, same pool
  void* y = a.alloc_fn_(2 << 20, 0, cs);
  a.end_allocate_to_pool_fn_(0, id);
  const std::uint64_t v = vmm_torch_ext_pool_id(0, 0, 7);
  std::uint64_t in = 0;
  CHECK(vmm_torch_pool_of(y, &in) == 1);
  CHECK(in == v);  // one vmmalloc pool for both
  a.relase_pool_fn_(0, id);  // the first graph goes
  CHECK(vmm_torch_ext_pool_count() == 1);
  a.free_fn_(x, 2 << 20, 0, cs);
  a.free_fn_(y, 2 << 20, 0, cs);
  CHECK(pool_alive(0, id));  // the second graph still replays into it: nothing goes back
  a.relase_pool_fn_(0, id);
  CHECK(vmm_torch_ext_pool_count() == 0);
  CHECK(vmm_torch_pool_stats(0, v, nullptr, nullptr, nullptr) == 0);
}

TEST_CASE("MemPool objects and use_mem_pool counted as PyTorch counts them") {
  tpa::CUDAPluggableAllocator& a = pluggable();
  const mempool_id id{0, 11};  // a user-created pool
  base().createOrIncrefPool(0, id, nullptr);  // MemPool()
  CHECK(base().getPoolUseCount(0, id) == 1);
  CHECK(vmm_torch_ext_pool_id(0, 0, 11) == 0);  // no vmmalloc pool until something is allocated
  // with use_mem_pool(pool): begin (this thread), end, release
  a.begin_allocate_to_pool_fn_(0, id, [](cudaStream_t) { return true; });
  CHECK(base().getPoolUseCount(0, id) == 2);
  void* p = a.alloc_fn_(5 << 20, 0, S(0x40));
  a.end_allocate_to_pool_fn_(0, id);
  a.relase_pool_fn_(0, id);
  CHECK(base().getPoolUseCount(0, id) == 1);
  CHECK(pool_alive(0, id));
  a.free_fn_(p, 5 << 20, 0, S(0x40));
  CHECK(pool_alive(0, id));  // the MemPool object still holds it
  // ~MemPool: setUseOnOOM(false), releasePool
#ifdef VMM_STUB_OLD_API
  CHECK_NOTHROW(base().setUseOnOOM(0, id));
#else
  CHECK_NOTHROW(base().setUseOnOOM(0, id, false));
#endif
  CHECK_NOTHROW(base().setNoSplit(0, id));
  const std::uint64_t v = vmm_torch_ext_pool_id(0, 0, 11);
  a.relase_pool_fn_(0, id);
  CHECK(base().getPoolUseCount(0, id) == 0);
  CHECK(vmm_torch_pool_stats(0, v, nullptr, nullptr, nullptr) == 0);
  CHECK(vmm_torch_ext_pool_count() == 0);

  // A MemPool with an allocator of its own cannot be honoured while vmmalloc is the allocator.
  struct foreign : tpa::CUDAPluggableAllocator {
    foreign() : tpa::CUDAPluggableAllocator(nullptr, nullptr) {}
  };
  auto f = std::make_shared<foreign>();
#ifdef VMM_STUB_OLD_API
  CHECK_THROWS_WITH_AS(base().createOrIncrefPool(0, mempool_id{0, 12}, f.get()),
                       doctest::Contains("allocator of its own"), c10::Error);
#else
  CHECK_THROWS_WITH_AS(base().createOrIncrefPool(0, mempool_id{0, 12}, f),
                       doctest::Contains("allocator of its own"), c10::Error);
#endif
  CHECK(vmm_torch_ext_pool_count() == 0);
}

TEST_CASE("record_stream reaches vmmalloc; a foreign pointer is ignored, never thrown") {
  tpa::CUDAPluggableAllocator& a = pluggable();
  void* p = a.alloc_fn_(1 << 20, 0, S(0x50));
  CHECK_NOTHROW(a.record_stream_fn_(p, S(0x51)));
  int local = 0;
  CHECK_NOTHROW(a.record_stream_fn_(&local, S(0x51)));
  a.free_fn_(p, 1 << 20, 0, S(0x50));
  std::uint64_t st[64] = {};
  REQUIRE(vmm_torch_stats(0, st, 64) > 0);
}

TEST_CASE("a failing begin throws PyTorch's error type with vmmalloc's reason and keeps no entry") {
  tpa::CUDAPluggableAllocator& a = pluggable();
  // Device -1 is out of range for the library: begin_pool fails.
  CHECK_THROWS_WITH_AS(a.begin_allocate_to_pool_fn_(-1, mempool_id{5, 0}, nullptr),
                       doctest::Contains("beginAllocateToPool"), c10::Error);
  CHECK(vmm_torch_ext_pool_count() == 0);
}

TEST_CASE("PyTorch's memory statistics and empty_cache come from vmmalloc") {
  tpa::CUDAPluggableAllocator& a = pluggable();
  cca::CUDAAllocator& b = base();  // torch.cuda.memory_stats & co. call through the base class
  const cudaStream_t s = S(0x60);
  a.free_fn_(a.alloc_fn_(1 << 20, 0, s), 1 << 20, 0, s);  // device 0 has an allocator
  b.emptyCache();
  b.resetAccumulatedStats(0);
  b.resetPeakStats(0);
  const auto s0 = b.getDeviceStats(0);
  CHECK(s0.allocation[0].allocated == 0);
  CHECK(s0.allocation[0].freed == 0);
  CHECK(s0.num_device_alloc == 0);
  CHECK(s0.allocated_bytes[0].peak >= s0.allocated_bytes[0].current);

  const std::int64_t n = std::int64_t{64} << 20;
  void* p = a.alloc_fn_(n, 0, s);
  REQUIRE(p != nullptr);
  const auto s1 = b.getDeviceStats(0);
  CHECK(s1.allocated_bytes[0].current >= s0.allocated_bytes[0].current + n);
  CHECK(s1.active_bytes[0].current == s1.allocated_bytes[0].current);
  CHECK(s1.requested_bytes[0].current >= s0.requested_bytes[0].current + n);
  CHECK(s1.allocated_bytes[0].peak >= s1.allocated_bytes[0].current);
  CHECK(s1.reserved_bytes[0].current >= s1.allocated_bytes[0].current);
  CHECK(s1.allocation[0].current == s0.allocation[0].current + 1);
  CHECK(s1.allocation[0].allocated == 1);
  CHECK(s1.segment[0].current >= 1);
  CHECK(s1.num_device_alloc >= 1);  // the 64 MiB came from a new chunk
  CHECK(s1.allocated_bytes[1].current == 0);  // no small or large pools in PyTorch's sense

  a.free_fn_(p, n, 0, s);
  const auto s2 = b.getDeviceStats(0);
  CHECK(s2.allocation[0].freed == 1);
  CHECK(s2.allocation[0].current == s0.allocation[0].current);
  CHECK(s2.allocated_bytes[0].current < s0.allocated_bytes[0].current + n);
  CHECK(s2.allocated_bytes[0].peak >= s0.allocated_bytes[0].current + n);  // the peak stays

  // torch.cuda.empty_cache: the freed chunk goes back to the device (the thread's cache too).
  b.emptyCache();
  const auto s3 = b.getDeviceStats(0);
  CHECK(s3.reserved_bytes[0].current + n <= s1.reserved_bytes[0].current);
  CHECK(s3.num_device_free >= 1);
  // torch.cuda.reset_peak_memory_stats: the peaks start over from what is live.
  b.resetPeakStats(0);
  CHECK(b.getDeviceStats(0).allocated_bytes[0].peak < s0.allocated_bytes[0].current + n);
  CHECK(b.getDeviceStats(0).reserved_bytes[0].peak == s3.reserved_bytes[0].current);

  // cuDNN's benchmark mode: the largest block = the device's free memory + what vmmalloc holds
  // free (the freed 64 MiB went back with empty_cache: it counts as the device's now).
  std::uint64_t dev_free = 0, dev_total = 0;
  REQUIRE(vmm_torch_mem_info(0, &dev_free, &dev_total) == 0);
  std::size_t largest = 0;
  b.cacheInfo(0, &largest);
  CHECK(largest >= dev_free);
  CHECK(dev_free >= static_cast<std::uint64_t>(n));
  CHECK(dev_free <= dev_total);

  // A device with no allocator: zeros, as PyTorch reports for a device it never used.
  const auto none = b.getDeviceStats(5);
  CHECK(none.allocated_bytes[0].current == 0);
  CHECK(none.reserved_bytes[0].peak == 0);
  CHECK_NOTHROW(b.resetPeakStats(5));
  CHECK_NOTHROW(b.resetAccumulatedStats(5));
  std::size_t none_largest = 1;
  b.cacheInfo(5, &none_largest);
  CHECK(none_largest == 0);
}

#ifdef VMM_STUB_OLD_API
cca::SnapshotInfo take_snapshot(mempool_id) { return base().snapshot(); }
#else
cca::SnapshotInfo take_snapshot(mempool_id id) { return base().snapshot(id, true); }
#endif

TEST_CASE("torch.cuda.memory_snapshot: vmmalloc's segments, blocks tiling them, a graph pool's own") {
  tpa::CUDAPluggableAllocator& a = pluggable();
  const cudaStream_t s = S(0x70), cs = S(0x71);
  const std::size_t n = std::size_t{5} << 20;
  void* live = a.alloc_fn_(n + 100, 0, s);
  void* gone = a.alloc_fn_(n, 0, s);
  a.free_fn_(gone, n, 0, s);
  const mempool_id pid{0, 77};
  a.begin_allocate_to_pool_fn_(0, pid, [cs](cudaStream_t x) { return x == cs; });
  void* pooled = a.alloc_fn_(1 << 20, 0, cs);
  a.end_allocate_to_pool_fn_(0, pid);

  const cca::SnapshotInfo snap = take_snapshot({0, 0});
  REQUIRE(!snap.segments.empty());
  CHECK(snap.device_traces.size() >= 1);
  std::uint64_t total = 0, allocated = 0, requested = 0, requested_units = 0;
  const cca::BlockInfo* live_block = nullptr;
  const cca::SegmentInfo* pooled_segment = nullptr;
  for (const auto& seg : snap.segments) {
    CHECK(seg.device == 0);
    std::uint64_t at = static_cast<std::uint64_t>(seg.address), seg_alloc = 0;
    for (const auto& b : seg.blocks) {  // Python's snapshot gives each block the address it reaches
      if (at == reinterpret_cast<std::uintptr_t>(live)) live_block = &b;
      if (at == reinterpret_cast<std::uintptr_t>(pooled)) pooled_segment = &seg;
      if (b.allocated) {
        CHECK(b.active);
        seg_alloc += static_cast<std::uint64_t>(b.size);
        requested += static_cast<std::uint64_t>(b.requested_size);
        requested_units += (static_cast<std::uint64_t>(b.requested_size) + 511) / 512 * 512;
      }
      at += static_cast<std::uint64_t>(b.size);
    }
    CHECK(at == static_cast<std::uint64_t>(seg.address) + static_cast<std::uint64_t>(seg.total_size));
    CHECK(static_cast<std::uint64_t>(seg.allocated_size) == seg_alloc);
    total += static_cast<std::uint64_t>(seg.total_size);
    allocated += seg_alloc;
  }
  REQUIRE(live_block != nullptr);
  CHECK(live_block->allocated);
  CHECK(static_cast<std::uint64_t>(live_block->requested_size) == n + 100);
  REQUIRE(pooled_segment != nullptr);
  CHECK(pooled_segment->owner_private_pool_id == pid);
  // The stats count PyTorch's requests (allocated: in its 512 B units); the snapshot shows
  // vmmalloc's blocks as they are, at least that large.
  const auto st = base().getDeviceStats(0);
  CHECK(requested == static_cast<std::uint64_t>(st.requested_bytes[0].current));
  CHECK(requested_units == static_cast<std::uint64_t>(st.allocated_bytes[0].current));
  CHECK(allocated >= requested);
  CHECK(total <= static_cast<std::uint64_t>(st.reserved_bytes[0].current));

#ifndef VMM_STUB_OLD_API
  const cca::SnapshotInfo only = take_snapshot(pid);  // the pool's segments alone
  REQUIRE(only.segments.size() == 1);
  CHECK(only.segments[0].owner_private_pool_id == pid);
  CHECK(only.segments[0].is_expandable);
#endif

  a.free_fn_(pooled, 1 << 20, 0, cs);
  a.relase_pool_fn_(0, pid);
  a.free_fn_(live, n + 100, 0, s);
  for (const auto& seg : take_snapshot({0, 0}).segments) {
    CHECK(seg.owner_private_pool_id == mempool_id{0, 0});
    if (static_cast<std::uint64_t>(seg.address) <= reinterpret_cast<std::uintptr_t>(live) &&
        reinterpret_cast<std::uintptr_t>(live) < static_cast<std::uint64_t>(seg.address + seg.total_size))
      CHECK(seg.allocated_size == 0);
  }
}

#ifndef VMM_STUB_OLD_API
struct test_stack : c10::GatheredContext {};
int stacks_gathered = 0;
std::shared_ptr<c10::GatheredContext> gather_stack() {
  ++stacks_gathered;
  return std::make_shared<test_stack>();
}

const cca::BlockInfo* block_at(const cca::SnapshotInfo& snap, const void* p) {
  for (const auto& seg : snap.segments) {
    std::uint64_t at = static_cast<std::uint64_t>(seg.address);
    for (const auto& b : seg.blocks) {
      if (at == reinterpret_cast<std::uintptr_t>(p)) return &b;
      at += static_cast<std::uint64_t>(b.size);
    }
  }
  return nullptr;
}

TEST_CASE("torch.cuda.memory._record_memory_history: the trace, its ring, skipped actions, stacks of live blocks") {
  tpa::CUDAPluggableAllocator& a = pluggable();
  cca::CUDAAllocator& b = base();
  const cudaStream_t s = S(0x80);
  CHECK_FALSE(b.isHistoryEnabled());
  b.recordHistory(true, &gather_stack, 100, cca::RecordContext::ALL, false, {});
  CHECK(b.isHistoryEnabled());
  void* p = a.alloc_fn_(3 << 20, 0, s);
  void* q = a.alloc_fn_(1000, 0, s);
  a.free_fn_(q, 1000, 0, s);
  auto snap = take_snapshot({0, 0});
  REQUIRE(snap.device_traces.size() >= 1);
  auto tr = snap.device_traces[0];
  REQUIRE(tr.size() == 4);  // alloc p, alloc q, free_requested q, free_completed q
  CHECK(tr[0].action_ == cca::TraceEntry::ALLOC);
  CHECK(tr[0].addr_ == reinterpret_cast<std::uintptr_t>(p));
  CHECK(tr[0].size_ == std::size_t{3} << 20);
  CHECK(tr[0].stream_ == s);
  CHECK(tr[0].context_ != nullptr);
  CHECK(tr[2].action_ == cca::TraceEntry::FREE_REQUESTED);
  CHECK(tr[3].action_ == cca::TraceEntry::FREE_COMPLETED);
  CHECK(tr[3].addr_ == reinterpret_cast<std::uintptr_t>(q));
  CHECK(tr[3].context_ != nullptr);  // RecordContext::ALL: frees carry stacks too
  CHECK(tr[0].time_.t_ > 1600000000000000);  // microseconds since 1970
  CHECK(tr[3].time_.t_ >= tr[0].time_.t_);
  const cca::BlockInfo* pb = block_at(snap, p);
  REQUIRE(pb != nullptr);
  CHECK(pb->allocated);
  CHECK(pb->context_when_allocated == tr[0].context_);  // the block's frames are its allocation's

  // max_entries 2: the newest two stay. STATE: stacks for live blocks, none in the trace.
  b.recordHistory(true, &gather_stack, 2, cca::RecordContext::STATE, false, {});
  CHECK(take_snapshot({0, 0}).device_traces[0].size() == 2);
  void* r = a.alloc_fn_(2 << 20, 0, s);
  snap = take_snapshot({0, 0});
  tr = snap.device_traces[0];
  REQUIRE(tr.size() == 2);
  CHECK(tr[1].action_ == cca::TraceEntry::ALLOC);
  CHECK(tr[1].addr_ == reinterpret_cast<std::uintptr_t>(r));
  CHECK(tr[1].context_ == nullptr);
  REQUIRE(block_at(snap, r) != nullptr);
  CHECK(block_at(snap, r)->context_when_allocated != nullptr);

  // Cleared, "free_requested" skipped: a free leaves free_completed alone.
  b.recordHistory(true, &gather_stack, 100, cca::RecordContext::ALLOC, true, {"free_requested"});
  CHECK(take_snapshot({0, 0}).device_traces[0].empty());
  a.free_fn_(r, 2 << 20, 0, s);
  tr = take_snapshot({0, 0}).device_traces[0];
  REQUIRE(tr.size() == 1);
  CHECK(tr[0].action_ == cca::TraceEntry::FREE_COMPLETED);
  CHECK(tr[0].context_ == nullptr);  // ALLOC: stacks for allocations only

  // Off: nothing more is recorded, no stack is gathered; the snapshot still works.
  b.recordHistory(false, nullptr, 0, cca::RecordContext::NEVER, true, {});
  CHECK_FALSE(b.isHistoryEnabled());
  const int gathered = stacks_gathered;
  void* t = a.alloc_fn_(1 << 20, 0, s);
  a.free_fn_(t, 1 << 20, 0, s);
  CHECK(stacks_gathered == gathered);
  snap = take_snapshot({0, 0});
  CHECK((snap.device_traces.empty() || snap.device_traces[0].empty()));
  REQUIRE(block_at(snap, p) != nullptr);
  CHECK(block_at(snap, p)->context_when_allocated == nullptr);
  a.free_fn_(p, 3 << 20, 0, s);
}
#endif

TEST_CASE("set_per_process_memory_fraction sets vmmalloc's limit; get_per_process_memory_fraction reads it") {
  tpa::CUDAPluggableAllocator& a = pluggable();
  cca::CUDAAllocator& b = base();  // torch.cuda.set_per_process_memory_fraction calls through it
  const int d = 6;
  const cudaStream_t s = S(0x70);
  std::uint64_t free = 0, total = 0;
  REQUIRE(vmm_torch_init(d) == 0);
  REQUIRE(vmm_torch_mem_info(d, &free, &total) == 0);
  const double frac = static_cast<double>(32 << 20) / static_cast<double>(total);  // 32 MiB
  b.setMemoryFraction(frac, d);
  double f = 0;
  REQUIRE(vmm_torch_memory_fraction(d, &f) == 0);
  CHECK(f == doctest::Approx(frac).epsilon(1e-9));
#ifndef VMM_STUB_OLD_API
  CHECK(b.getMemoryFraction(d) == doctest::Approx(frac).epsilon(1e-9));  // the base class would throw
#endif
  // Past the limit: c10::OutOfMemoryError (torch.OutOfMemoryError in Python) with vmmalloc's
  // reason, worded as PyTorch's own allocator begins it.
  try {
    (void)a.alloc_fn_(std::size_t{48} << 20, d, s);
    FAIL("48 MiB past a 32 MiB fraction did not throw");
  } catch (const c10::OutOfMemoryError& e) {
    const std::string what = e.what();
    CHECK(what.rfind("CUDA out of memory. vmmalloc cannot allocate 48.00 MiB on device 6: ", 0) == 0);
    CHECK(what.find("memory limit") != std::string::npos);
  }
  // A failure that is not out of memory (a size PyTorch never passes) stays a plain exception.
  try {
    (void)a.alloc_fn_(~std::size_t{0}, d, s);
    FAIL("a negative size did not throw");
  } catch (const c10::OutOfMemoryError&) {
    FAIL("a negative size raised out of memory");
  } catch (const std::exception& e) {
    CHECK(std::string(e.what()).find("negative size") != std::string::npos);
  }
  void* p = a.alloc_fn_(std::size_t{16} << 20, d, s);
  CHECK(p != nullptr);
  a.free_fn_(p, std::size_t{16} << 20, d, s);
  b.setMemoryFraction(1.0, d);
  void* q = a.alloc_fn_(std::size_t{48} << 20, d, s);
  CHECK(q != nullptr);
  a.free_fn_(q, std::size_t{48} << 20, d, s);
  // PyTorch range-checks the fraction in Python; a bad one reaching C++ is refused with the reason.
  CHECK_THROWS_WITH_AS(b.setMemoryFraction(2.0, d), doctest::Contains("fraction must lie in [0, 1]"), c10::Error);
  CHECK(vmm_torch_memory_fraction(d, &f) == 0);
  CHECK(f == 1.0);
}

TEST_CASE("torch.multiprocessing's CUDA tensors: shareIpcHandle and getIpcDevPtr, here and in a forked receiver") {
  tpa::CUDAPluggableAllocator& a = pluggable();
  cca::CUDAAllocator& b = base();  // torch's StorageSharing calls through it
  const cudaStream_t s = S(0x80);
  // Memory that is not exportable (no VMMALLOC_IPC) is refused with what to set.
  void* plain = a.alloc_fn_(4096, 0, s);
  CHECK_THROWS_WITH_AS(b.shareIpcHandle(plain), doctest::Contains("VMMALLOC_IPC=posix_fd"), c10::Error);
  a.free_fn_(plain, 4096, 0, s);

  const int d = 3;
  setenv("VMMALLOC_IPC", "posix_fd", 1);
  REQUIRE(vmm_torch_init(d) == 0);
  unsetenv("VMMALLOC_IPC");
  const std::size_t n = std::size_t{3} << 20;
  void* small = a.alloc_fn_(1000, d, s);  // tensors still share chunks
  void* t = a.alloc_fn_(n, d, s);
  void* t2 = a.alloc_fn_(n, d, s);
  auto* bytes = static_cast<unsigned char*>(t);
  for (std::size_t i = 0; i < n; ++i) bytes[i] = static_cast<unsigned char>(i * 131 + 7);
  std::memset(small, 0x33, 1000);

  const cca::ShareableHandle h = b.shareIpcHandle(t);
  CHECK(h.offset == 0);
  CHECK(h.handle.size() > 24);
  CHECK(b.shareIpcHandle(t).handle == h.handle);   // the same block, the same bytes
  CHECK(b.shareIpcHandle(t2).handle != h.handle);
  std::uint64_t shared = 0, imported = 0;
  CHECK(vmm_torch_share_counts(&shared, &imported) == 0);
  CHECK(shared == 2);
  CHECK_THROWS_AS(b.shareIpcHandle(static_cast<char*>(t) + 256), c10::Error);  // not a block start

  // A receiver in this process, on another device (torch sets the storage's device first).
  c10::cuda::stub_current_device = 4;
  {
    std::shared_ptr<void> m = b.getIpcDevPtr(h.handle);
    REQUIRE(m);
    CHECK(m.get() != t);
    CHECK(std::memcmp(m.get(), t, n) == 0);
    static_cast<unsigned char*>(m.get())[0] = 0xA5;  // one memory: the sender sees the write
    CHECK(bytes[0] == 0xA5);
    CHECK(b.getIpcDevPtr(h.handle).get() == m.get());  // one mapping while a storage uses it
    CHECK(vmm_torch_share_counts(nullptr, &imported) == 0);
    CHECK(imported == 1);
  }
  CHECK(vmm_torch_share_counts(nullptr, &imported) == 0);
  CHECK(imported == 0);  // unmapped with the last storage

  // A receiver in another process: the fds come through pidfd_getfd.
  const pid_t child = fork();
  if (child == 0) {
    int rc = 0;
    try {
      std::shared_ptr<void> m = b.getIpcDevPtr(h.handle);
      rc = std::memcmp(m.get(), t, n) == 0 ? 0 : 2;
      static_cast<unsigned char*>(m.get())[1] = 0x5A;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "receiver: %s\n", e.what());
      rc = 3;
    }
    _exit(rc);
  }
  int status = 0;
  REQUIRE(waitpid(child, &status, 0) == child);
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  CHECK(bytes[1] == 0x5A);  // the receiver wrote through its own mapping

  // Bad handles: PyTorch's error type with the reason; nothing is mapped.
  CHECK_THROWS_WITH_AS(b.getIpcDevPtr("not a handle"), doctest::Contains("not a vmmalloc handle"), c10::Error);
  CHECK_THROWS_AS(b.getIpcDevPtr(h.handle.substr(0, h.handle.size() - 3)), c10::Error);
  std::string forged = h.handle;
  forged[4] = static_cast<char>(forged[4] + 1);  // a format version this library does not know
  CHECK_THROWS_WITH_AS(b.getIpcDevPtr(forged), doctest::Contains("malformed"), c10::Error);
  forged = h.handle;
  forged[12] = static_cast<char>(forged[12] + 1);  // one fd more than the handle's chunks
  CHECK_THROWS_AS(b.getIpcDevPtr(forged), c10::Error);
  CHECK(vmm_torch_share_counts(nullptr, &imported) == 0);
  CHECK(imported == 0);

  // Freeing a shared block closes its fds.
  a.free_fn_(t, n, d, s);
  a.free_fn_(t2, n, d, s);
  CHECK(vmm_torch_share_counts(&shared, nullptr) == 0);
  CHECK(shared == 0);
  CHECK(static_cast<unsigned char*>(small)[999] == 0x33);
  a.free_fn_(small, 1000, d, s);
  CHECK(vmm_torch_check(d) == 0);
  c10::cuda::stub_current_device = 0;
}
