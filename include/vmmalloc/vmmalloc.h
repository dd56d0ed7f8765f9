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
  size_t min_chunk;           /* 0: granularity */
  size_t max_growth;          /* 0: 8 MiB */
  size_t alignment;           /* 0: 256 */
  size_t host_granularity;    /* host backend only; 0: 2 MiB */
  size_t host_physical_limit; /* host backend only; 0: 64 GiB simulated device memory */
  const char* trace_path;     /* NULL/"": off; else every malloc/free is written there (trace format) */
} vmm_policy;

typedef struct vmm_stats {
  size_t requested, allocated, mapped, physical, reserved;
  size_t peak_requested, peak_allocated, peak_mapped, peak_physical;
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
} vmm_stats;

/* Occupancy of one size class (small allocations live in slabs of equal slots). */
typedef struct vmm_class_stats {
  size_t slot_size, slabs, slots, used_slots, cached_slots, live_bytes;
} vmm_class_stats;

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
/* Writes up to cap classes to out; *count gets the number of classes (call with cap 0 to size). */
vmm_status vmm_get_class_stats(vmm_allocator* a, vmm_class_stats* out, size_t cap, size_t* count);
/* Run-time peer access: every mapped chunk and every later one, one driver call per mapped run. */
vmm_status vmm_grant(vmm_allocator* a, int device, int read_only);
vmm_status vmm_revoke(vmm_allocator* a, int device);

vmm_status vmm_last_status(void);
const char* vmm_last_error(void); /* "" when the last call on this thread succeeded */
const char* vmm_status_string(vmm_status s);

#ifdef __cplusplus
}
#endif
#endif
