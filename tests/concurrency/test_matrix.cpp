// SPDX-License-Identifier: Apache-2.0
// The growth/release matrix (tests/support/growth_matrix.hpp: every combination of the options
// that change growth and release, under threads, streams and cross-thread frees) on the host
// backend, as the GPU suite runs it on the device. The host backend here behaves as the driver
// does where the allocator's correctness depends on it: each call stays in flight for a while
// (two calls at once on one handle or range abort the run, naming both), a released handle's value
// names the next handle, and a thread holds the streams (the GPU behind the CPU): the kernels that
// fill the blocks land late, frees wait on fences, chunks are busy and trim() blocks until the
// stream completes.
//
// VMM_MATRIX_MS: run time of each cell (default 150 ms, 100 ms in sanitizer builds);
// VMM_MATRIX_CELLS=3,17 runs only those.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <random>
#include <thread>

#include "arena/tuning.hpp"
#include "support/pattern.hpp"
#include "frontend/allocator_access.hpp"
#include "support/fault_backend.hpp"
#include "support/growth_matrix.hpp"
#include "support/stream_tag.hpp"
#include "vmmalloc/host_backend.hpp"
#include "vmmalloc/vmmalloc.hpp"

using namespace vmm;
using vmm::test::stream_tag;

namespace {

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr int kDefaultMs = 100;
#else
constexpr int kDefaultMs = 150;
#endif

constexpr int kStreams = 16;  // thread i's stream is tag i + 1 (the cells have at most 16 threads)

struct host_env {
  using stream_type = stream_t;
  host_backend* hb = nullptr;
  std::shared_ptr<test::fault_state> objects;
  std::atomic<bool> stop{false};
  std::thread holder;

  allocator make(const options& o) {
    host_backend_options h;
    h.call_us = 10;            // the driver's calls take 1-600 us: windows for two calls at once
    h.reuse_handles = true;    // a stale handle value names a newer handle, as with the driver
    h.waits_block = true;      // a wait on a held fence blocks until the holder completes it
    objects = std::make_shared<test::fault_state>();  // unarmed: counts what the backend holds
    auto b = test::make_fault_host(objects, h);
    hb = objects->host;
    allocator a = allocator_access::make(std::move(b), o, tuning{});
    sync_failures = 0;
    stop = false;
    holder = std::thread([this] {  // the GPU running behind: a stream's fences pend 0.2-1 ms
      std::mt19937_64 r(0x401d);
      while (!stop.load()) {
        const stream_t s = stream_tag(1 + static_cast<int>(r() % kStreams));
        hb->hold_stream(s);
        std::this_thread::sleep_for(std::chrono::microseconds(200 + r() % 800));
        hb->complete_stream(s);
      }
    });
    return a;
  }
  stream_t stream(int i) { return stream_tag(i + 1); }
  // A kernel: writes the block when its stream runs, late while the holder holds it. A block the
  // allocator gave to another stream, or unmapped, before this landed shows as wrong bytes there
  // (or a fault here).
  void fill(void* p, std::size_t n, std::uint64_t seed, stream_t s) {
    hb->launch(s, [=] { test::fill_block(p, n, seed); });
  }
  std::uint64_t verify(const void* p, std::size_t n, std::uint64_t seed, stream_t s) {
    synchronize(s);
    std::size_t bad = 0;
    test::verify_block(p, n, seed, &bad);
    return bad != SIZE_MAX;  // one block that reads back wrong
  }
  void synchronize(stream_t s) {  // cudaStreamSynchronize: blocks until the holder completes s
    auto f = hb->record_fence(s);
    if (!f.ok()) {
      ++sync_failures;
      return;
    }
    if (!hb->wait_fence(f.value).ok()) ++sync_failures;
    hb->drop_fence(f.value);
  }
  std::atomic<std::uint64_t> sync_failures{0};
  void stop_holder() {
    stop = true;
    if (holder.joinable()) holder.join();
  }
  void quiesce() {
    stop_holder();
    for (int i = 0; i <= kStreams; ++i) hb->complete_stream(i ? stream_tag(i) : nullptr);
  }
  std::size_t free_memory() { return host_backend_options{}.physical_limit; }  // a fresh backend's
  // After the cell's allocator is destroyed: no handle, mapping or reservation left behind.
  void after() {
    CHECK(sync_failures.load() == 0);
    CHECK(objects->live_handles() == 0);
    CHECK(objects->live_mappings() == 0);
    CHECK(objects->live_reservations() == 0);
  }
  ~host_env() { stop_holder(); }  // a cell that failed before quiesce()
};

int run_ms() {
  const char* e = std::getenv("VMM_MATRIX_MS");
  return e && std::atoi(e) > 0 ? std::atoi(e) : kDefaultMs;
}

}  // namespace

TEST_CASE("matrix on the host backend: every option that changes growth and release, under threads, streams and cross-thread frees") {
  host_env env;
  test::matrix::run_all(env, std::chrono::milliseconds(run_ms()), "VMM_MATRIX_CELLS");
}
