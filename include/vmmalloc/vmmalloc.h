// SPDX-License-Identifier: Apache-2.0
/* vmmalloc C API: a growable GPU memory allocator on CUDA's virtual memory management API.
 *
 *   vmm_policy pol; vmm_policy_init(&pol);          // CUDA device 0 by default
 *   vmm_allocator* a;
 *   if (vmm_create(&pol, &a) != VMM_SUCCESS) fprintf(stderr, "%s\n", vmm_last_error());
 *   void* p = vmm_malloc(a, 1 << 20);               // NULL on failure, vmm_last_error() says why
 *   vmm_free(a, p);
 *   vmm_destroy(a);                                  // unmaps and releases everything
 *
 * Every call is thread-safe. Errors never abort: they return a status (or NULL) and set a
 * thread-local last error with the driver's code and name. */
#ifndef VMMALLOC_H
#define VMMALLOC_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum vmm_status {
  VMM_SUCCESS = 0,
  VMM_ERROR_OUT_OF_MEMORY = 1,
  VMM_ERROR_INVALID_VALUE = 2,
  VMM_ERROR_NOT_PERMITTED = 3,
  VMM_ERROR_NOT_SUPPORTED = 4,
  VMM_ERROR_NO_DRIVER = 5,
  VMM_ERROR_INVALID_POINTER = 6, /* foreign, interior or already-freed pointer */
  VMM_ERROR_OTHER = 7
} vmm_status;

typedef enum vmm_backend_kind { VMM_BACKEND_CUDA = 0, VMM_BACKEND_HOST = 1 } vmm_backend_kind;
typedef enum vmm_compression { VMM_COMPRESSION_OFF = 0, VMM_COMPRESSION_PREFER = 1, VMM_COMPRESSION_REQUIRE = 2 } vmm_compression;
typedef enum vmm_ipc { VMM_IPC_NONE = 0, VMM_IPC_POSIX_FD = 1, VMM_IPC_FABRIC = 2 } vmm_ipc;
typedef enum vmm_location { VMM_LOCATION_DEVICE = 0, VMM_LOCATION_HOST_NUMA = 1 } vmm_location;

/* The options of include/vmmalloc/options.def (README.md, "Options") that C can set, and the
 * backend's. 0 = default, except release_threshold (taken as is): start from vmm_policy_init(). */
typedef struct vmm_policy {
  vmm_backend_kind backend;
  int device;
  vmm_location location;
  vmm_compression compression;
  vmm_ipc ipc;
  size_t reservation_size;    /* 0: 2 x device memory */
  size_t memory_limit;        /* 0: no limit beyond the device's */
  size_t release_threshold;   /* free bytes kept mapped; SIZE_MAX: keep all (default) */
  size_t alignment;           /* 0: 256 */
  size_t host_granularity;    /* host backend only; 0: 2 MiB */
  size_t host_physical_limit; /* host backend only; 0: 64 GiB simulated device memory */
  const char* trace_path;     /* NULL/"": off; else every malloc/free is written there (trace format) */
  size_t free_memory_margin;  /* 0: off; else free memory is given back first when a growth would
                                 leave the device less than this */
} vmm_policy;

typedef struct vmm_stats {
  size_t requested, allocated, mapped, physical, reserved;
  size_t peak_mapped, peak_physical; /* exact; requested / allocated have no peak (vmmalloc.hpp) */
  size_t chunks;
  uint64_t allocs, frees, live;
  uint64_t driver_calls, creates, maps, unmaps, set_access, releases;
  /* memory the allocator holds that is not mapped / not in use */
  size_t idle;             /* created, unmapped physical memory kept for reuse */
  size_t free_chunk_bytes; /* mapped chunks holding no allocation */
  size_t slab_bytes;       /* pages held by size-class slabs */
  uint64_t deferred;       /* frees waiting for other streams */
  uint64_t grows, chunk_releases, trims, stitched;
  uint64_t compression_fallbacks, ipc_fallbacks, access_changes, exported, exported_released;
  uint64_t traced_events;
  double fragmentation;    /* 1 - requested / mapped (0 when nothing is mapped) */
  uint64_t reclaims;       /* out-of-memory paths that gave free memory back and retried */
  uint64_t chunks_retired; /* free chunks reused while their stream still ran behind */
  uint64_t pools;          /* graph pools alive */
  size_t pool_allocated;   /* bytes of live blocks in graph pools */
  size_t pool_held;        /* mapped bytes owned by graph pools */
  uint64_t margin_trims;   /* growths that gave free memory back first (free_memory_margin) */
  uint64_t driver_ns;      /* wall time inside driver calls other than fences */
  uint64_t fence_ns;       /* wall time recording, querying and waiting for stream fences */
} vmm_stats;

/* Occupancy of one size class (small allocations live in slabs of equal slots). */
typedef struct vmm_class_stats {
  size_t slot_size, slabs, slots, used_slots, cached_slots, live_bytes;
} vmm_class_stats;

/* One block of the memory map (vmm_get_memory_map): the segment of mapped memory it lies in
 * (a span, or a huge block's own chunk) and the block. Blocks tile their segment in address order. */
typedef enum vmm_block_state {
  VMM_BLOCK_FREE = 0,         /* free in the heap (a slab's free slot or unused tail too) */
  VMM_BLOCK_LIVE = 1,         /* the user's */
  VMM_BLOCK_CACHED = 2,       /* freed into a thread cache, or a free huge block kept mapped */
  VMM_BLOCK_PENDING_FREE = 3  /* freed, waiting for another stream's work */
} vmm_block_state;
typedef struct vmm_block_record {
  uintptr_t segment_addr;
  size_t segment_size;
  uint64_t pool; /* the graph pool whose heap holds it; 0: the allocator's own */
  int huge;      /* 1: a huge block's own chunk */
  uintptr_t addr;
  size_t size, requested; /* requested: live blocks only */
  vmm_block_state state;
} vmm_block_record;

typedef struct vmm_allocator vmm_allocator;

void vmm_policy_init(vmm_policy* policy);
vmm_status vmm_create(const vmm_policy* policy, vmm_allocator** out);
void vmm_destroy(vmm_allocator* a); /* NULL is a no-op */

void* vmm_malloc(vmm_allocator* a, size_t size);
void* vmm_aligned_alloc(vmm_allocator* a, size_t alignment, size_t size);
void* vmm_malloc_async(vmm_allocator* a, size_t size, void* stream);
vmm_status vmm_free(vmm_allocator* a, void* ptr); /* NULL is a no-op */
vmm_status vmm_free_async(vmm_allocator* a, void* ptr, void* stream);
/* ptr is also used on stream: its memory is reused only after stream's work up to the free. */
vmm_status vmm_record_stream(vmm_allocator* a, void* ptr, void* stream);
/* count * size bytes, NULL with VMM_ERROR_OUT_OF_MEMORY when the product overflows. */
void* vmm_calloc_n(vmm_allocator* a, size_t count, size_t size);

vmm_status vmm_trim(vmm_allocator* a, size_t keep);
vmm_status vmm_get_stats(vmm_allocator* a, vmm_stats* out);
vmm_status vmm_check(vmm_allocator* a); /* VMM_SUCCESS when every invariant holds */
vmm_status vmm_reset_peaks(vmm_allocator* a);
/* The cap on physical bytes at run time, as vmm_policy.memory_limit (0 = no limit beyond the
 * device's). Lowered below what is held, free and idle memory is released until it fits. */
vmm_status vmm_set_memory_limit(vmm_allocator* a, size_t bytes);
vmm_status vmm_get_memory_limit(vmm_allocator* a, size_t* bytes); /* 0 = no limit */
/* Writes up to cap classes to out; *count gets the number of classes (call with cap 0 to size). */
vmm_status vmm_get_class_stats(vmm_allocator* a, vmm_class_stats* out, size_t cap, size_t* count);
/* The memory map, one record per block in address order: up to cap records to out; *count gets
 * the number of blocks (call with cap 0 to size; the map may grow before the next call). Walks
 * every block under the allocator's lock: diagnostics. */
vmm_status vmm_get_memory_map(vmm_allocator* a, vmm_block_record* out, size_t cap, size_t* count);
/* Run-time peer access: every mapped chunk and every later one, one driver call per mapped run. */
vmm_status vmm_grant(vmm_allocator* a, int device, int read_only);
vmm_status vmm_revoke(vmm_allocator* a, int device);

/* Graph pools (CUDA graphs; PyTorch's private pools): between vmm_begin_pool and vmm_end_pool,
 * allocations on the streams `filter` accepts (every stream when filter is NULL) come from pool
 * `pool`, whose memory goes to no other work until vmm_release_pool. See vmm::allocator::begin_pool.
 * filter(stream, user) returns nonzero to accept; it is called with the allocator's lock held and
 * must not call back into the allocator. */
typedef int (*vmm_stream_filter)(void* stream, void* user);
vmm_status vmm_begin_pool(vmm_allocator* a, uint64_t pool, vmm_stream_filter filter, void* user);
vmm_status vmm_end_pool(vmm_allocator* a, uint64_t pool);     /* error: not begun */
vmm_status vmm_release_pool(vmm_allocator* a, uint64_t pool); /* error: unknown, or still begun */

vmm_status vmm_last_status(void);
const char* vmm_last_error(void); /* "" when the last call on this thread succeeded */
const char* vmm_status_string(vmm_status s);

/* ---- Growable buffer (vmm::growable_buffer, growable_buffer.hpp) -------------------------------
 * One buffer that grows and shrinks in place: its data pointer never changes, old bytes are never
 * copied (growth maps chunks at the tail of one reservation).
 *
 *   vmm_buffer_options o; vmm_buffer_options_init(&o);
 *   o.capacity_limit = (size_t)64 << 30;            // VA reserved once; nothing mapped yet
 *   vmm_buffer* b;
 *   if (vmm_buffer_create(&o, &b) != VMM_SUCCESS) fprintf(stderr, "%s\n", vmm_last_error());
 *   vmm_buffer_resize(b, 1 << 30);                  // maps 1 GiB; vmm_buffer_data(b) is stable
 *   vmm_buffer_destroy(b);                          // unmaps, releases, frees the reservation
 *
 * Same conventions as above: a status and the thread-local last error (the C++ exception's
 * message), a failed growth changes nothing. Calls on one buffer are serialised by a lock of its
 * own (the C++ class is single-threaded; the lock costs ~20 ns a call). */
typedef struct vmm_buffer vmm_buffer;

typedef struct vmm_buffer_options {
  vmm_backend_kind backend;   /* VMM_BACKEND_CUDA (default) or VMM_BACKEND_HOST */
  int device;                 /* owner device */
  size_t capacity_limit;      /* required (> 0): the most bytes the buffer will ever hold */
  size_t min_chunk;           /* smallest chunk one growth maps; 0: the granularity */
  int geometric;              /* nonzero: chunks of at least half the mapped bytes (O(log n) growths) */
  const int* peers;           /* peer_count devices granted read_write on every chunk (may be NULL) */
  size_t peer_count;
  size_t host_granularity;    /* host backend only; 0: 2 MiB */
  size_t host_physical_limit; /* host backend only; 0: 64 GiB simulated device memory */
  size_t keep_idle;           /* bytes of shrunk chunks kept as handles for the next growth; 0: none */
} vmm_buffer_options;

typedef struct vmm_buffer_info {
  void* data;                 /* the base: never changes for the buffer's life */
  size_t size;                /* bytes in use (what resize set) */
  size_t capacity;            /* bytes mapped (>= size) */
  size_t capacity_limit;      /* as created */
  size_t reserved;            /* VA reserved: capacity_limit rounded up to the granularity */
  size_t granularity;
  size_t chunks;              /* chunks mapped (one handle and one map each) */
  /* backend calls made (attempts, retries included); failures = calls refused */
  uint64_t reserve_calls, create_calls, map_calls, set_access_calls, unmap_calls, release_calls, failures;
  /* host backend only (0 on CUDA): the backend's live objects, for leak checks */
  size_t live_handles, live_mappings, live_reservations;
  size_t idle_bytes;          /* shrunk chunks kept as handles (keep_idle), unmapped */
} vmm_buffer_info;

void vmm_buffer_options_init(vmm_buffer_options* options); /* CUDA device 0, no limit set */
vmm_status vmm_buffer_create(const vmm_buffer_options* options, vmm_buffer** out);
void vmm_buffer_destroy(vmm_buffer* b); /* NULL is a no-op */
/* Sets the size: growing maps one chunk at the tail (VMM_ERROR_OUT_OF_MEMORY past capacity_limit
 * or physical memory, nothing changed); shrinking unmaps the chunks wholly past the new size. */
vmm_status vmm_buffer_resize(vmm_buffer* b, size_t size);
vmm_status vmm_buffer_reserve(vmm_buffer* b, size_t bytes); /* maps up to bytes; size unchanged */
vmm_status vmm_buffer_shrink_to_fit(vmm_buffer* b);         /* unmaps the chunks past the size */
vmm_status vmm_buffer_release_idle(vmm_buffer* b);          /* releases the handles keep_idle kept */
void* vmm_buffer_data(const vmm_buffer* b);  /* NULL (and the last error) for a NULL buffer */
size_t vmm_buffer_size(const vmm_buffer* b); /* 0 for NULL */
size_t vmm_buffer_capacity(const vmm_buffer* b);
vmm_status vmm_buffer_get_info(const vmm_buffer* b, vmm_buffer_info* out);

/* ---- KV cache (vmm::kv_cache, kv_cache.hpp) -----------------------------------------------------
 * One reservation of 2 x layers buffers, each max_seqs rows of one sequence's K (or V) of one
 * layer; a row's pages are mapped as its sequence grows. Token t of sequence s, layer l:
 *   K at base + (2 l) buffer_stride + s seq_stride + t token_bytes,   V at (2 l + 1) buffer_stride.
 *
 *   vmm_kv_config c; vmm_kv_config_init(&c);
 *   c.layers = 32; c.kv_heads = 8; c.head_dim = 128; c.max_seqs = 64; c.max_tokens = 4096;
 *   vmm_kv_cache* kv; vmm_kv_create(&c, &kv);
 *   size_t s; vmm_kv_open(kv, &s); vmm_kv_append(kv, s, 1500, NULL);
 *   void* k0; vmm_kv_k(kv, s, 0, &k0);               // 1500 tokens of layer 0's K, contiguous
 *   vmm_kv_close(kv, s); vmm_kv_destroy(kv);
 *
 * Every call is thread-safe. Errors: VMM_ERROR_OUT_OF_MEMORY past max_tokens, past physical memory
 * or with every slot open; VMM_ERROR_INVALID_VALUE for an unknown or closed sequence; state is
 * left as it was. */
typedef struct vmm_kv_cache vmm_kv_cache;

typedef struct vmm_kv_config {
  vmm_backend_kind backend;   /* VMM_BACKEND_CUDA (default) or VMM_BACKEND_HOST */
  int device;
  size_t layers, kv_heads, head_dim; /* required (> 0) */
  size_t elem_bytes;          /* default 2 (fp16 / bf16) */
  size_t max_seqs;            /* required: slots (sequences open at once) */
  size_t max_tokens;          /* required: per sequence */
  size_t page_size;           /* 0: the granularity; else a multiple of it */
  size_t map_ahead_pages;     /* map-ahead thread: whole pages kept mapped ahead of need */
  size_t map_ahead_tokens;    /* ... or tokens ahead; both 0: no thread */
  size_t pool_keep_pages;     /* what vmm_kv_trim(kv, VMM_KV_KEEP_DEFAULT, ...) keeps pooled */
  int retain_closed;          /* nonzero: a closed slot keeps its pages mapped for the next open */
  const int* peers;           /* peer_count devices granted read_write on every page (may be NULL) */
  size_t peer_count;
  size_t host_granularity;    /* host backend only; 0: 2 MiB */
  size_t host_physical_limit; /* host backend only; 0: 64 GiB simulated device memory */
  int fused_kv;               /* nonzero: one buffer per layer (k = base + l B + s S; no V: the
                                 caller lays K and V out in it): half the page rounding */
  int layout;                 /* VMM_KV_PER_LAYER (0) or VMM_KV_PER_SEQUENCE: one buffer per
                                 sequence, a token's K and V of every layer side by side */
} vmm_kv_config;

enum { VMM_KV_PER_LAYER = 0, VMM_KV_PER_SEQUENCE = 1 };

typedef struct vmm_kv_layout {
  void* base;                 /* the reservation; k(s, l) = base + 2 l B + s S (fused_kv: l B) */
  size_t reserved;            /* 2 x layers x buffer_stride (fused_kv: layers x) */
  size_t token_bytes;         /* T: one token of one layer's K (or V) */
  size_t seq_stride;          /* S: round_up(max_tokens x T, page_size) */
  size_t buffer_stride;       /* B: max_seqs x S */
  size_t page_size, tokens_per_page, max_pages, granularity;
  size_t layers, kv_heads, head_dim, elem_bytes, max_seqs, max_tokens; /* as configured */
  /* Either layout: k(s, l) = base + l layer_stride + s seq_stride, v = k + kv_stride, token t at
     + t token_stride (per_layer: token_bytes; per_sequence: every layer's K and V of a token) */
  size_t token_stride, layer_stride, kv_stride;
  int layout;
} vmm_kv_layout;

typedef struct vmm_kv_seq_info {
  int open;                   /* 0: the slot is free (the other fields are then 0) */
  size_t length;              /* tokens */
  size_t mapped_pages;        /* per buffer (the sequence holds 2 x layers x this) */
  size_t capacity;            /* tokens the mapped pages hold */
  size_t shared_tokens;       /* tokens in pages shared with another sequence (vmm_kv_share_prefix) */
} vmm_kv_seq_info;

typedef struct vmm_kv_stats {
  uint64_t pages_created, pages_reused, pages_released;
  size_t pages_mapped, pages_pooled, mapped_bytes, used_bytes, open_seqs;
  uint64_t appends, driver_calls, append_driver_calls, map_ahead_driver_calls, map_ahead_pages,
      map_ahead_failures, append_waits, failures;
  size_t pages_retained;
  uint64_t pages_retained_reused, pages_reclaimed;
  /* host backend only (0 on CUDA): the backend's live objects, for leak checks */
  size_t live_handles, live_mappings, live_reservations;
  size_t pages_aliased; /* mappings of a page another sequence maps too (pages_mapped counts it once) */
} vmm_kv_stats;

#define VMM_KV_KEEP_DEFAULT ((size_t)-1) /* vmm_kv_trim: keep the config's pool_keep_pages */

void vmm_kv_config_init(vmm_kv_config* config); /* CUDA device 0, elem_bytes 2, the rest 0 */
vmm_status vmm_kv_create(const vmm_kv_config* config, vmm_kv_cache** out);
void vmm_kv_destroy(vmm_kv_cache* kv); /* NULL is a no-op; unmaps and releases everything */
vmm_status vmm_kv_open(vmm_kv_cache* kv, size_t* seq);       /* the lowest free slot (see retain_closed) */
vmm_status vmm_kv_open_slot(vmm_kv_cache* kv, size_t slot);  /* that slot, which must be free */
/* Adds n tokens to seq, mapping the pages they need; *old_length (may be NULL) gets where they start. */
vmm_status vmm_kv_append(vmm_kv_cache* kv, size_t seq, size_t n, size_t* old_length);
vmm_status vmm_kv_truncate(vmm_kv_cache* kv, size_t seq, size_t n); /* n <= length */
vmm_status vmm_kv_close(vmm_kv_cache* kv, size_t seq);
/* A new sequence (lowest free slot, in *seq) of `tokens` tokens of src (<= its length): src's whole
 * pages of them mapped again read-only, no copy; the caller copies tokens [shared_tokens, tokens)
 * (vmm_kv_get_seq) from src. */
vmm_status vmm_kv_share_prefix(vmm_kv_cache* kv, size_t src, size_t tokens, size_t* seq);
/* Releases pooled pages beyond keep_pages; *released (may be NULL) gets how many. */
vmm_status vmm_kv_trim(vmm_kv_cache* kv, size_t keep_pages, size_t* released);
vmm_status vmm_kv_wait_map_ahead(vmm_kv_cache* kv);
/* Layer `layer`'s K (V) of slot seq (any slot in range: only mapped bytes may be touched). */
vmm_status vmm_kv_k(const vmm_kv_cache* kv, size_t seq, size_t layer, void** out);
vmm_status vmm_kv_v(const vmm_kv_cache* kv, size_t seq, size_t layer, void** out);
vmm_status vmm_kv_get_seq(const vmm_kv_cache* kv, size_t seq, vmm_kv_seq_info* out);
vmm_status vmm_kv_get_layout(const vmm_kv_cache* kv, vmm_kv_layout* out);
vmm_status vmm_kv_get_stats(const vmm_kv_cache* kv, vmm_kv_stats* out);

#ifdef __cplusplus
}
#endif
#endif
