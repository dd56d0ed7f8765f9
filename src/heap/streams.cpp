// SPDX-License-Identifier: Apache-2.0
// Stream tags, fences and deferred frees: a block freed on stream S is reusable on S at once and
// on another stream only once a fence recorded on S after the free has completed (queried, never
// waited for on the allocation path). See heap.hpp for the rules.
#include "heap/heap_impl.hpp"

namespace vmm {


status heap::impl::fence_after(stream_state& ss, stream_t s, std::uint64_t seq_at_free) {
  if (ss.fence_seq > seq_at_free) return {};
  // An event recorded into a capture is a graph node, not a point the stream reaches: none is
  // recorded while s captures, and what waits on s waits until the capture is over.
  if (a.drv().capturing(s)) return {errc::other, 0, "the stream is being captured", "record_fence"};
  auto r = a.drv().record_fence(s);
  if (!r.ok()) return r.st;
  if (ss.fence) a.drv().drop_fence(ss.fence);
  ss.fence = r.value;
  ss.fence_seq = seq + 1;
  ss.done = false;
  return {};
}

void heap::impl::note_done(stream_state& ss) {
  ss.done = true;
  ss.completed_seq = std::max(ss.completed_seq, ss.fence_seq);
}

bool heap::impl::fence_covers(stream_t s, std::uint64_t seq_at_free) {
  stream_state& ss = streams[s];
  if (seq_at_free < ss.completed_seq) return true;
  if (!fence_after(ss, s, seq_at_free).ok()) return false;
  if (ss.done || a.drv().fence_done(ss.fence)) note_done(ss);
  return ss.done;
}

status heap::impl::wait_covered(stream_t s, std::uint64_t seq_at_free) {
  stream_state& ss = streams[s];
  if (seq_at_free < ss.completed_seq) return {};
  if (status r = fence_after(ss, s, seq_at_free); !r.ok()) return r;
  if (!ss.done && !a.drv().fence_done(ss.fence)) {
    status w = a.drv().wait_fence(ss.fence);  // only this stream, never the device
    if (!w.ok()) return w;
  }
  note_done(ss);
  return {};
}

status heap::impl::record_fences(const std::vector<stream_t>& on, std::vector<fence_t>& out,
                                 std::vector<stream_t>& later) {
  for (auto xs : on) {
    if (a.drv().capturing(xs)) {  // no fence into a capture: recorded once the capture is over
      later.push_back(xs);
      continue;
    }
    auto f = a.drv().record_fence(xs);
    if (!f.ok()) {
      drop_fences(out);
      return f.st;
    }
    if (f.value) out.push_back(f.value);  // 0: the stream is already idle
  }
  return {};
}

void heap::impl::drop_fences(std::vector<fence_t>& fs) {
  for (auto f : fs) a.drv().drop_fence(f);
  fs.clear();
}

void heap::impl::poll_deferred() {
  for (std::size_t i = 0; i < deferred_frees.size();) {
    auto& d = deferred_frees[i];
    for (std::size_t k = 0; k < d.later.size();) {  // streams that were capturing at the free
      stream_t xs = d.later[k];
      if (a.drv().capturing(xs)) {
        ++k;
        continue;
      }
      auto f = a.drv().record_fence(xs);
      if (!f.ok()) {
        ++k;
        continue;
      }
      if (f.value) d.fences.push_back(f.value);
      d.later[k] = d.later.back();
      d.later.pop_back();
    }
    bool done = d.later.empty();
    for (auto f : d.fences) done = done && a.drv().fence_done(f);  // queries only, never waits
    if (!done) {
      ++i;
      continue;
    }
    drop_fences(d.fences);
    deferred d2 = std::move(d);
    deferred_frees[i] = std::move(deferred_frees.back());
    deferred_frees.pop_back();
    --st.deferred;
    complete_free(d2.p, d2.s);
  }
}

void heap::impl::complete_free(std::uintptr_t p, stream_t s) {
  if (slab* sl = slab_of(p)) {
    release_slot(sl, static_cast<std::uint32_t>((p - sl->base) / sl->slot));
  } else {
    block* b = block_at(p);
    if (b->flags & f_huge) free_huge(b, s); else free_large(b, s);
  }
  maybe_release();
}

status heap::record_stream(std::uintptr_t p, stream_t s) {
  if (!usable_size(p)) return fail(errc::invalid_pointer, "record_stream: pointer not allocated");
  if (impl::block* b = p_->slab_of(p) ? nullptr : p_->block_at(p)) {
    // A thread cache must not take this free (it needs the extra stream's fence): back to the heap.
    std::uint64_t w = b->tword.load(std::memory_order_acquire);
    if ((w & 0xff) == 1 && !b->tword.compare_exchange_strong(w, w & ~std::uint64_t{0xff}, std::memory_order_acq_rel))
      return fail(errc::invalid_pointer, "record_stream: pointer freed concurrently");
  }
  if (impl::slab* sl = p_->slab_of(p)) {
    // Thread caches must not take this free. A compare-exchange: a lock-free free of p racing
    // this call (a use after free by the caller) wins or loses cleanly.
    const auto i = static_cast<std::uint32_t>((p - sl->base) / sl->slot);
    if (sl->get(i) == impl::slot_user && !sl->swap(i, impl::slot_user, impl::slot_user_recorded))
      return fail(errc::invalid_pointer, "record_stream: pointer freed concurrently");
  }
  auto& v = p_->extra_streams[p];
  if (std::find(v.begin(), v.end(), s) == v.end()) v.push_back(s);
  return {};
}

}  // namespace vmm
