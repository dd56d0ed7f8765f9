// SPDX-License-Identifier: Apache-2.0
// vmm::kv_cache: a paged KV cache whose sequences stay virtually contiguous (vAttention's idea).
//
//   vmm::kv_cache_config c;
//   c.layers = 32; c.kv_heads = 8; c.head_dim = 128; c.elem_bytes = 2;   // 2 KiB per token per K|V
//   c.max_seqs = 64; c.max_tokens = 4096; c.map_ahead_tokens = 128;
//   auto kv = vmm::kv_cache::cuda(c);          // one reservation for every sequence; maps nothing
//   auto s = kv.open();                         // a free slot: its index is its batch row
//   kv.append(s, 1500);                         // prefill: maps the pages 1500 tokens need
//   void* k0 = kv.k(s, 0);                      // layer 0's K of s: 1500 tokens, contiguous
//   kv.append(s, 1);                            // decode: no driver call while pages are ahead
//   kv.close(s);                                // unmaps; the pages go to a pool for the next one
//
// Layout (stated once, here). T = token_bytes() = kv_heads * head_dim * elem_bytes: one token of
// one layer's K (or V). P = page_size(). One reservation of 2 * layers * max_seqs * S bytes, where
//   S = seq_stride()    = round_up(max_tokens * T, P)       one sequence's K (or V) of one layer
//   B = buffer_stride() = max_seqs * S                      one layer's K (or V) of every sequence
//   k(s, l) = base() + (2 l    ) * B + s * S                token t at + t * T
//   v(s, l) = base() + (2 l + 1) * B + s * S
// So k_base(l) is a [max_seqs][max_tokens][kv_heads][head_dim] tensor with row stride S: an
// attention kernel indexes it directly, with no block table. Only mapped pages may be touched.
// fused_kv: one buffer per layer (k(s, l) = base() + l * B + s * S, no v()); the caller lays K
// and V out in its tokens (kv_heads counts both), so each sequence rounds up one buffer per layer
// to a page instead of two. "2 * layers buffers" below is then "layers buffers".
//
// layout = per_sequence (for serving many sequences): one buffer per sequence, a token's K and V
// of every layer side by side. R = token_stride() = 2 * layers * T (fused_kv: layers * T):
//   S = round_up(max_tokens * R, P),  k(s, l) = base() + s * S + 2 l T,  v(s, l) = k(s, l) + T
//   token t at + t * R;  reserved() = max_seqs * S
// A sequence then wastes at most one partly filled page (per_layer: one per buffer, 2 * layers),
// and a page holds P / R tokens (16 for 32 layers x 8 heads x 128 dims in bf16). k_base(l) is the
// same [max_seqs][max_tokens][kv_heads][head_dim] tensor with strides S, R, head_dim * elem, elem:
// the last dimension contiguous, as attention kernels and torch's as_strided views take it. In
// both layouts k(s, l) = base() + l * layer_stride() + s * S, v = k + kv_stride(), token t at
// + t * token_stride(); "buffers" below are then 1 per sequence.
//
// Contract:
//  * Pages: sequence s "has m pages" = page p in [0, m) is mapped in each of the 2 * layers buffers
//    (2 * layers physical pages of P bytes, one handle each: cuMemMap takes no offset into a
//    handle, so a page is one handle, one map). A sequence with n tokens needs pages_for(n) =
//    ceil(n * R / P) pages (R = T per_layer); appending maps the missing pages, 2 * layers * k maps plus 2 * layers
//    set_access calls for k pages (one set_access per buffer covers the k adjacent pages).
//  * Retain (retain_closed): close() leaves the pages mapped; open() picks the closed slot with
//    the most of them; a mapping that finds the pool short first unmaps retained pages of other
//    closed slots into it (counted on that path), so physical memory never grows past what the
//    pool would hold. A new sequence sees the old one's bytes until it writes (as with the pool).
//  * Pool: close() and truncate() unmap pages and keep their handles; later mappings take a pooled
//    handle first (map + set_access, no create: a cuMemCreate + cuMemRelease pair saved, ~27 us
//    for 2 MiB on an H200) and create only when the pool is empty. trim(keep) retries parked
//    work, unmaps retained pages (retain_closed) into the pool and releases pooled pages beyond
//    keep; physical memory returns only then.
//  * Map-ahead (map_ahead_pages = a or map_ahead_tokens = t, either > 0): a background thread
//    keeps each open sequence of n tokens at min(max pages, pages_for(n + t) + a) pages, so append()
//    makes no driver call while it keeps up. Cost: mapped memory ahead of use. a = 1 holds one
//    extra page per buffer per sequence all the time; t (e.g. 128) maps the next page only when a
//    sequence is within t tokens of its end, which holds far less for the same effect when the
//    thread has t decode steps of time to map (2 * layers pages: ~2-4 ms on an H100 for 64).
//    An append that has to map anyway (a prefill past the mapped pages) maps up to that target
//    too, so the thread never races the first decode steps after it. It maps with the lock released (append, k(), length() do not wait for the driver); the slot
//    it works on is marked busy, and close/truncate/append-that-needs-pages on that slot wait
//    for it. A thread failure (e.g. out of memory) is counted and parked: the next append that
//    needs the page maps it itself and throws the error.
//  * Shared prefixes (share_prefix(src, n)): a new sequence of n tokens whose first pages are
//    src's pages mapped a second time (same handles, no create, no copy), read-only for every
//    device: the whole pages of its first n tokens that end on a token boundary, shared_tokens()
//    tokens (a multiple of lcm(P, R) / R: 16 tokens for R = 128 KiB, 32 for 80 layers' 320 KiB). The caller copies tokens [shared_tokens(), n) from src (they sit in pages of the new
//    sequence's own). A page returns to the pool only with its last mapping: closing or
//    truncating either sequence never frees a page the other maps. A truncate() that would leave
//    a shared page to take new tokens is refused (either sequence: they would land in the
//    other's); close() of a sequence with shared pages unmaps them even with retain_closed.
//    stats().pages_mapped counts physical pages once.
//  * Errors leave state intact: append past max_tokens or out of physical memory throws
//    vmm::out_of_memory, open() with every slot open throws vmm::out_of_memory, an unknown or
//    closed sequence throws vmm::error (errc::invalid_value). A failed append maps nothing new:
//    every mapping it made is unmapped, created handles released, pooled ones put back.
//  * Returning memory (close, truncate) never fails logically: the sequence is closed/shortened.
//    An unmap the driver refuses twice is parked (retried by later calls and the destructor) and
//    vmm::error is thrown after the change.
//  * Contents: appended tokens are NOT zeroed. A truncated or closed sequence's bytes are gone;
//    pages a sequence keeps keep their bytes whatever other sequences do.
//  * Thread-safety: every member function may be called from any thread; one mutex guards the
//    state (driver calls of append/close/truncate/trim run under it; the map-ahead thread's do
//    not). Pointers from k()/v() stay valid while the sequence's tokens are not truncated.
//  * The destructor stops the thread, unmaps and releases everything and frees the reservation.
//  * Movable (the moved-from cache holds nothing), not copyable.
//
// Layering: like growable_buffer, a sibling of the arena on the backend seam (backend.hpp);
// vmmalloc.hpp is included for the exception types only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "vmmalloc/backend.hpp"
#include "vmmalloc/error.hpp"
#include "vmmalloc/host_backend.hpp"

namespace vmm {

// per_layer: a buffer per (layer, K|V), each sequence's tokens of one layer contiguous.
// per_sequence: one buffer per sequence (see Layout): at most one partly filled page each.
enum class kv_layout : std::uint8_t { per_layer, per_sequence };

struct kv_cache_config {
  std::size_t layers = 0;
  std::size_t kv_heads = 0;
  std::size_t head_dim = 0;
  std::size_t elem_bytes = 2;       // fp16 / bf16
  std::size_t max_seqs = 0;         // sequences open at once (slots)
  std::size_t max_tokens = 0;       // per sequence
  std::size_t page_size = 0;        // 0 = granularity (2 MiB on GPUs); else a multiple of it
  int device = 0;                   // owner device: every page is created there, read_write
  std::vector<access_desc> peers;   // extra devices granted on every mapping (checked at construction)
  std::size_t map_ahead_pages = 0;   // whole pages kept mapped ahead of need (see the contract)
  std::size_t map_ahead_tokens = 0;  // tokens kept mapped ahead of need; both 0 = no thread
  std::size_t pool_keep_pages = 0;  // what trim() keeps pooled
  // close() keeps the sequence's pages mapped in its slot (vAttention's reuse): the next open()
  // takes the closed slot with the most mapped pages, so a new sequence starts with them at no
  // driver call. They go back to the pool (unmapped) when a mapping finds the pool short, before
  // anything is created, and on trim(). Cost: closed slots' pages count as mapped until then.
  bool retain_closed = false;
  // One buffer per layer holding K and V as the caller lays them out (see Layout): half the
  // buffers, so half the page rounding per sequence. v() and v_base() are then refused.
  bool fused_kv = false;
  kv_layout layout = kv_layout::per_layer;
};

using seq_id = std::size_t;  // a slot: the sequence's row in k_base(l) / v_base(l)

// Counters since construction (calls are attempts, retries included) and current state.
struct kv_cache_stats {
  std::uint64_t pages_created = 0;    // cuMemCreate that succeeded
  std::uint64_t pages_reused = 0;     // mappings of a pooled handle (no create)
  std::uint64_t pages_released = 0;   // cuMemRelease that succeeded (trim, rollback, teardown)
  std::size_t pages_mapped = 0;       // now, over all sequences and buffers; a shared page once
  std::size_t pages_aliased = 0;      // now: mappings of a page another sequence maps (share_prefix)
  std::size_t pages_pooled = 0;       // now: created, unmapped, kept for reuse
  std::size_t mapped_bytes = 0;       // pages_mapped * page_size
  std::size_t used_bytes = 0;         // sum of tokens * token_bytes * buffers (2 * layers, fused_kv: layers)
  std::size_t open_seqs = 0;
  std::uint64_t appends = 0;          // append() calls that succeeded
  std::uint64_t driver_calls = 0;     // every backend call, all paths
  std::uint64_t append_driver_calls = 0;     // made inside append() (the decode path)
  std::uint64_t map_ahead_driver_calls = 0;  // made by the map-ahead thread
  std::uint64_t map_ahead_pages = 0;         // page groups (2 * layers pages) the thread mapped
  std::uint64_t map_ahead_failures = 0;      // jobs of the thread that failed and were rolled back
  std::uint64_t append_waits = 0;            // appends that waited for the thread on their slot
  std::uint64_t failures = 0;                // backend calls refused, all paths
  std::size_t pages_retained = 0;            // now: pages mapped in closed slots (retain_closed)
  std::uint64_t pages_retained_reused = 0;   // pages a new sequence found mapped at open()
  std::uint64_t pages_reclaimed = 0;         // retained pages unmapped into the pool for others
};

class kv_cache {
 public:
  // Reserves the whole layout on `b` (maps nothing) and starts the map-ahead thread if asked.
  // Throws vmm::error for a null backend, a zero dimension, a page size that is not a multiple of
  // the granularity, a peer that cannot access the owner, or a failed reserve; vmm::out_of_memory
  // when the layout overflows.
  kv_cache(std::unique_ptr<backend_iface> b, const kv_cache_config& c);
  // Host backend (memfd + mmap: host memory with the driver's rules, CI without a GPU).
  static kv_cache host(const kv_cache_config& c, const host_backend_options& h = {});
  // CUDA backend on c.device. Throws vmm::error "no CUDA driver ..." when unavailable.
  static kv_cache cuda(const kv_cache_config& c);

  ~kv_cache();
  kv_cache(kv_cache&&) noexcept;
  kv_cache& operator=(kv_cache&&) noexcept;
  kv_cache(const kv_cache&) = delete;
  kv_cache& operator=(const kv_cache&) = delete;

  // Opens a sequence of 0 tokens in the lowest free slot, or in `slot`. No driver call (with
  // map-ahead, the thread maps its first pages). Throws out_of_memory when every slot is open;
  // error when `slot` is out of range or already open.
  seq_id open();
  seq_id open(seq_id slot);
  // Adds n tokens; returns the old length (where the new tokens start). Maps the missing pages.
  std::size_t append(seq_id s, std::size_t n);
  // Shortens to n tokens (n <= length); unmaps pages past what n tokens need (plus map-ahead).
  void truncate(seq_id s, std::size_t n);
  // Unmaps every page of s into the pool; the slot becomes free.
  void close(seq_id s);
  // Opens a sequence of `tokens` tokens (<= src's length) in the lowest free slot whose first
  // shared_tokens() tokens are src's pages mapped again, read-only (see the contract); maps its
  // own pages for the rest. Throws error for a closed src or tokens past its length,
  // out_of_memory for no free slot or memory; on failure nothing stays mapped or open.
  seq_id share_prefix(seq_id src, std::size_t tokens);
  std::size_t shared_tokens(seq_id s) const;  // tokens of s in pages it shares (0: none)
  // Releases pooled pages beyond keep (default: config's pool_keep_pages); returns how many.
  std::size_t trim();
  std::size_t trim(std::size_t keep_pages);
  // Blocks until the map-ahead thread has nothing left to do (tests, benchmarks). No-op without it.
  void wait_map_ahead();

  bool is_open(seq_id s) const;
  std::size_t length(seq_id s) const;        // tokens
  std::size_t mapped_pages(seq_id s) const;  // per buffer (the sequence holds 2 * layers * this)
  std::size_t capacity(seq_id s) const;      // tokens the mapped pages hold (<= max_tokens)
  // Pointers into the layout (valid for any slot; only mapped bytes may be touched).
  void* k(seq_id s, std::size_t layer) const;
  void* v(seq_id s, std::size_t layer) const;
  void* k_base(std::size_t layer) const;
  void* v_base(std::size_t layer) const;

  void* base() const noexcept;
  std::size_t reserved() const noexcept;       // 2 * layers * buffer_stride() (per_sequence: B)
  std::size_t token_bytes() const noexcept;    // T
  std::size_t seq_stride() const noexcept;     // S
  std::size_t buffer_stride() const noexcept;  // B
  std::size_t page_size() const noexcept;      // P
  std::size_t tokens_per_page() const noexcept;  // P / R (rounded down; 0 when R > P)
  std::size_t token_stride() const noexcept;   // R: T, or per_sequence every buffer's T
  std::size_t layer_stride() const noexcept;   // k(s, l + 1) - k(s, l)
  std::size_t kv_stride() const noexcept;      // v(s, l) - k(s, l)
  std::size_t max_pages() const noexcept;      // S / P
  std::size_t pages_for(std::size_t tokens) const noexcept;
  std::size_t granularity() const noexcept;
  const kv_cache_config& config() const noexcept;
  kv_cache_stats stats() const;
  // The backend (e.g. dynamic_cast to backend_model<host_backend> for its live counts).
  backend_iface& backend() noexcept;

 private:
  struct impl;
  std::unique_ptr<impl> p_;
};

}  // namespace vmm
