// SPDX-License-Identifier: Apache-2.0
// torch.cuda.memory._record_memory_history under vmmalloc: the allocation trace PyTorch's
// snapshot carries (device_traces, what memory_viz's timelines draw) and the stack of each live
// block, recorded by the extension's malloc and free while history is on.
//
// What it records: "alloc" at each allocation, "free_requested" and "free_completed" together at
// each free (a free vmmalloc holds back for another stream's work still shows as
// active_pending_free in the snapshot's blocks); no segment events (vmmalloc maps memory under its
// own lock, which this trace never enters). Off, it costs malloc and free one relaxed load.
//
// TraceEntry's constructor and fields changed across PyTorch releases: everything that builds one
// is a template on the entry type, compiled only where PyTorch 2.11's form is there (older
// releases keep snapshots without history; recordHistory is then refused by the base class).
#pragma once

#include <c10/cuda/CUDACachingAllocator.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

namespace vmm_torch_history {

namespace cca = c10::cuda::CUDACachingAllocator;
using mempool_id = c10::cuda::MempoolId_t;
using context_ptr = std::shared_ptr<c10::GatheredContext>;

// PyTorch 2.11's TraceEntry: (action, device, addr, size, stream, pool, time, context) and a time
// union whose t_ the snapshot reads as microseconds.
template <class TE, class = void>
struct has_history : std::false_type {};
template <class TE>
struct has_history<TE, std::void_t<decltype(TE(TE::ALLOC, c10::DeviceIndex{0}, std::size_t{0}, std::size_t{0},
                                               cudaStream_t{}, mempool_id{},
                                               decltype(std::declval<TE&>().time_.approx_t_){}, context_ptr{})),
                                   decltype(std::declval<TE&>().time_.t_ = 0)>> : std::true_type {};
constexpr bool available = has_history<cca::TraceEntry>::value;

class recorder {
 public:
  bool on() const { return on_.load(std::memory_order_relaxed); }

  // recordHistory's arguments. when: NEVER no stacks, STATE stacks of live blocks, ALLOC also in
  // the trace's alloc entries, ALL also in its frees. skip: action names left out ("alloc", ...).
  void set(bool enabled, cca::CreateContextFn gather, std::size_t max_entries, cca::RecordContext when,
           bool clear, const std::vector<std::string>& skip) {
    std::lock_guard g(mu_);
    if (clear) {
      entries_.clear();
      stacks_.clear();
    }
    gather_ = enabled ? gather : nullptr;
    when_ = enabled ? when : cca::RecordContext::NEVER;
    max_entries_ = max_entries;
    skip_alloc_ = skip_free_requested_ = skip_free_completed_ = false;
    for (const auto& s : skip) {
      skip_alloc_ |= s == "alloc";
      skip_free_requested_ |= s == "free_requested";
      skip_free_completed_ |= s == "free_completed";
    }
    if (!enabled) stacks_.clear();
    while (entries_.size() > max_entries_) entries_.pop_front();
    on_.store(enabled && available, std::memory_order_relaxed);
  }

  template <class TE = cca::TraceEntry>
  void allocated(void* p, std::size_t n, int device, cudaStream_t s, mempool_id pool) {
    if constexpr (has_history<TE>::value) {
      const cca::CreateContextFn gather = gather_now(cca::RecordContext::STATE);
      context_ptr ctx = gather ? gather() : nullptr;  // outside the lock: it walks the Python stack
      std::lock_guard g(mu_);
      if (!on()) return;
      if (ctx) stacks_[p] = ctx;
      if (!skip_alloc_)
        push<TE>(TE::ALLOC, device, p, n, s, pool, when_ >= cca::RecordContext::ALLOC ? ctx : nullptr);
    }
  }

  template <class TE = cca::TraceEntry>
  void freed(void* p, std::size_t n, int device, cudaStream_t s, mempool_id pool) {
    if constexpr (has_history<TE>::value) {
      const cca::CreateContextFn gather = gather_now(cca::RecordContext::ALL);
      context_ptr ctx = gather ? gather() : nullptr;
      std::lock_guard g(mu_);
      stacks_.erase(p);
      if (!on()) return;
      if (!skip_free_requested_) push<TE>(TE::FREE_REQUESTED, device, p, n, s, pool, ctx);
      if (!skip_free_completed_) push<TE>(TE::FREE_COMPLETED, device, p, n, s, pool, ctx);
    }
  }

  // The stack recorded when the live block at p was allocated (null when none).
  context_ptr stack_of(std::uintptr_t p) {
    std::lock_guard g(mu_);
    auto it = stacks_.find(reinterpret_cast<void*>(p));
    return it == stacks_.end() ? nullptr : it->second;
  }

  // The trace of each device, oldest first, as the snapshot's device_traces.
  template <class TE = cca::TraceEntry>
  std::vector<std::vector<TE>> traces(std::size_t devices) {
    std::vector<std::vector<TE>> out(devices);
    if constexpr (has_history<TE>::value) {
      std::lock_guard g(mu_);
      for (const TE& e : entries_) {
        const auto d = static_cast<std::size_t>(e.device_);
        if (d >= out.size()) out.resize(d + 1);
        out[d].push_back(e);
      }
    }
    return out;
  }

 private:
  cca::CreateContextFn gather_now(cca::RecordContext least) {
    std::lock_guard g(mu_);
    return when_ >= least ? gather_ : nullptr;
  }

  template <class TE>
  void push(typename TE::Action action, int device, void* p, std::size_t n, cudaStream_t s, mempool_id pool,
            context_ptr ctx) {
    if (max_entries_ == 0) return;
    if (entries_.size() >= max_entries_) entries_.pop_front();
    TE& e = entries_.emplace_back(action, static_cast<c10::DeviceIndex>(device), reinterpret_cast<std::size_t>(p), n,
                                  s, pool, decltype(std::declval<TE&>().time_.approx_t_){}, std::move(ctx));
    const auto us = std::chrono::duration_cast<std::chrono::microseconds>(
        std::chrono::system_clock::now().time_since_epoch());
    e.time_.t_ = static_cast<decltype(e.time_.t_)>(us.count());  // what the snapshot reads (time_us)
  }

  std::atomic<bool> on_{false};
  std::mutex mu_;
  cca::CreateContextFn gather_ = nullptr;
  cca::RecordContext when_ = cca::RecordContext::NEVER;
  std::size_t max_entries_ = 0;
  bool skip_alloc_ = false, skip_free_requested_ = false, skip_free_completed_ = false;
  std::deque<cca::TraceEntry> entries_;
  std::unordered_map<void*, context_ptr> stacks_;  // live blocks allocated while history was on
};

}  // namespace vmm_torch_history
