// SPDX-License-Identifier: Apache-2.0
/* libvmmalloc_torch.so: vmmalloc behind PyTorch's CUDAPluggableAllocator (and CuPy, via ctypes).
 *
 * One vmm::allocator per CUDA device, created on first use (thread-safe), stream-ordered, with
 * access granted to every other device that can reach the owner (peers), because PyTorch's
 * pluggable path never calls cuMemSetAccess. No link to libtorch or libcuda: the driver is loaded
 * at run time by vmmalloc, so this header needs no CUDA header either (streams are void*).
 *
 * Python: vmmalloc.torch (python/vmmalloc/torch.py: enable(), stats(), trim(), reset_peaks(), check()),
 *         vmmalloc.cupy (enable()); tools/python/ keeps shims under the old module names.
 * PyTorch's CUDA-graph and record_stream hooks are C++ only: src/integrations/torch_ext/ builds
 * them (against an installed PyTorch) over the graph-pool functions below.
 *
 * Environment, read when a device's allocator is created (first allocation on that device): every
 * option with a variable in README.md's options table (VMMALLOC_MEMORY_LIMIT=8G, ...; the table is
 * generated from include/vmmalloc/options.def), values as vmm::set_option reads them: sizes take a
 * binary suffix (512M, 8G, 1T, 64KiB) or "max" where the table allows it, booleans 0/1. A bad value
 * makes creation fail with a message naming the variable (the allocation then fails; nothing is
 * guessed). Three mean more here:
 *   VMMALLOC_PEERS              "auto" (default: every device that can access the owner),
 *                               "none", or a comma list of device ordinals ("1,3")
 *   VMMALLOC_TRACE              one file per device: "%d" is replaced by the device ordinal, else
 *                               devices other than 0 append ".<device>". Written at exit and by
 *                               vmm_torch_flush_trace(). Trace format v2 (docs/trace-format.md):
 *                               every malloc/free with its stream, recording thread (1, 2, ... by
 *                               first event) and time (ns since the allocator was created); replay
 *                               it with vmm-replay (its threads and streams), plot it with vmm-plot
 *   VMMALLOC_OPTIONS            any row of the table by name, with or without a variable of its
 *                               own: "release_threshold=1G,peers=1,3" (an item with no
 *                               '=' continues the value before it). A row's own variable wins.
 * and one is not an option:
 *   VMMALLOC_TORCH_BACKEND      "cuda" (default) or "host": vmmalloc's host backend (host memory,
 *                               GPU rules, 8 simulated devices), for tests without a GPU
 */
#ifndef VMMALLOC_TORCH_H
#define VMMALLOC_TORCH_H

#include <stdint.h>
#include <sys/types.h>

#ifdef __cplusplus
extern "C" {
#endif

/* PyTorch's malloc: a block of `size` bytes on `device`, ordered on `stream` (a cudaStream_t).
 * size 0 returns NULL (PyTorch never frees a null pointer). On failure it THROWS a C++ exception
 * (vmm::out_of_memory, a std::bad_alloc, or vmm::error) whose message says why: PyTorch's
 * pluggable path does not check for NULL, and turns the exception into a Python RuntimeError
 * (torch.OutOfMemoryError through libvmmalloc_torch_ext.so). Out of memory reads
 * "CUDA out of memory. vmmalloc cannot allocate <size> on device <d>: <why> (...)", other
 * failures "vmmalloc: cannot allocate ...". */
void* vmm_torch_malloc(ssize_t size, int device, void* stream);
/* Same, never throws: NULL on failure, vmm_torch_last_error() says why (ctypes, CuPy). */
void* vmm_torch_try_malloc(ssize_t size, int device, void* stream);
/* PyTorch's free. NULL is a no-op. Never throws: a refused free (foreign pointer) is counted in
 * the stats ("free_failures") and recorded in vmm_torch_last_error(). size: the bytes asked for
 * at malloc (PyTorch and CuPy pass them): the stats' requested and allocated bytes subtract it. */
void vmm_torch_free(void* ptr, ssize_t size, int device, void* stream);

/* Creates the allocator of `device` now (else the first allocation does). 0, or -1 + last error. */
int vmm_torch_init(int device);
/* 1 when `device` has an allocator, 0 when not (yet). */
int vmm_torch_initialized(int device);

/* Stats of `device` as uint64 values in the order of vmm_torch_stat_names() (comma separated);
 * pools, pool_allocated and pool_held are the graph pools' (alive, live bytes, mapped bytes).
 * Writes min(n, count) values; returns count, 0 when the device has no allocator yet, -1 on a
 * bad argument. */
int vmm_torch_stats(int device, uint64_t* out, int n);
const char* vmm_torch_stat_names(void);

/* The device's free and total memory as the driver reports them (cuMemGetInfo; the host
 * backend's simulated limit). 0, or -1 + last error (no allocator on `device` yet, NULL). */
int vmm_torch_mem_info(int device, uint64_t* free_bytes, uint64_t* total_bytes);

/* PyTorch's per-process memory fraction (torch.cuda.set_per_process_memory_fraction): the
 * device's memory limit becomes fraction x its total memory (the allocator is created first if
 * need be). Lowered below what is held, free and idle memory goes back until it fits; past it
 * allocations fail as out of memory. fraction in [0, 1]. 0, or -1 + last error. */
int vmm_torch_set_memory_fraction(int device, double fraction);
/* The limit as a fraction of the device's total memory; 1 with no limit. 0, or -1 + last error. */
int vmm_torch_memory_fraction(int device, double* fraction);

/* device -1 = every device that has an allocator. 0, or -1 + last error. */
int vmm_torch_trim(int device);
int vmm_torch_reset_peaks(int device);
/* Walks all metadata: 0 = every invariant holds, 1 = broken (last error says what), -1 = error. */
int vmm_torch_check(int device);

/* Writes buffered trace events (VMMALLOC_TRACE) of every device now. 0, or -1 + last error. */
int vmm_torch_flush_trace(void);

/* ---- graph pools and record_stream (CUDA graphs: PyTorch's private pools) -------------------
 * What PyTorch's beginAllocateToPool / endAllocateToPool / releasePool / recordStream do, on
 * vmm::allocator::begin_pool / end_pool / release_pool / record_stream of `device`'s allocator
 * (include/vmmalloc/vmmalloc.hpp says what a pool keeps). A pool is a uint64 here: the caller
 * maps PyTorch's (uint64, uint64) MempoolId_t to one (src/integrations/torch_ext/ does). Each
 * returns 0, or -1 with vmm_torch_last_error() saying why; none throws.
 *
 * filter(stream, user) != 0 accepts an allocation on `stream` into the pool (NULL: every stream).
 * It runs with the allocator's lock held, on the allocating thread, until end_pool returns: it
 * must not call back into this library, and it must not throw. */
typedef int (*vmm_torch_stream_filter)(void* stream, void* user);
/* Creates the device's allocator when it has none yet. */
int vmm_torch_begin_pool(int device, uint64_t pool, vmm_torch_stream_filter filter, void* user);
int vmm_torch_end_pool(int device, uint64_t pool);     /* -1: not begun */
/* The pool's free memory goes back now, the rest as its blocks are freed. -1: unknown, or begun. */
int vmm_torch_release_pool(int device, uint64_t pool);
/* ptr is also used on stream: its memory is reused only after stream's work up to the free. The
 * device is found from the pointer. -1: no allocator owns ptr, or it is not a live block. */
int vmm_torch_record_stream(void* ptr, void* stream);
/* The device whose allocator's reservation holds ptr, or -1. No lock, no driver call. */
int vmm_torch_device_of(const void* ptr);
/* 1 and *pool set when ptr starts a live block of a graph pool, 0 when not (or no allocator owns
 * ptr). */
int vmm_torch_pool_of(const void* ptr, uint64_t* pool);
/* A pool's live blocks, their bytes and the mapped bytes it holds. 1 when the pool is alive, 0
 * when not (never begun, or dropped after its release), -1 on a bad device. */
int vmm_torch_pool_stats(int device, uint64_t pool, uint64_t* live, uint64_t* allocated, uint64_t* held);

/* The memory map of `device` (vmm::allocator::memory_map()): one record of VMM_TORCH_MAP_WORDS
 * uint64 per block, in address order: segment address, segment bytes, graph pool (0: none),
 * huge (1: a dedicated chunk), block address, block bytes, requested bytes, state (0 free, 1 live,
 * 2 thread-cached, 3 waiting for another stream). Writes min(n, count) records; returns count, 0
 * when the device has no allocator, -1 + last error on a bad argument. The map changes between
 * calls: when count > n, call again with room for more. */
#define VMM_TORCH_MAP_WORDS 8
int64_t vmm_torch_memory_map(int device, uint64_t* out, int64_t n);

/* ---- sharing with other processes (torch.multiprocessing's CUDA tensors) ----------------------
 * The extension's shareIpcHandle / getIpcDevPtr. Needs exportable memory: VMMALLOC_IPC=posix_fd
 * (set before the device's first allocation; blocks still share chunks here, as
 * the library makes them share chunks, as PyTorch's own sharing does). The handle names the chunks under the
 * block (neighbours' bytes too, as PyTorch's own sharing does), this process's pid and the fd
 * numbers of those chunks; the receiver copies the fds with pidfd_getfd (Linux 5.6, and ptrace
 * rights over the sender: the same user, and under Yama ptrace_scope 1 the sender must be the
 * receiver's descendant). The exporter keeps the fds open until the block is freed.
 *
 * vmm_torch_share: the handle of the live block starting at ptr; writes it when it fits in cap
 * bytes and returns its length (call again with room when it is larger), -1 + last error. The
 * same block gives the same bytes until it is freed. */
int64_t vmm_torch_share(const void* ptr, char* out, int64_t cap);
/* Maps a handle from vmm_torch_share (this or another process) on `device`: the block's address
 * here, or NULL + last error (the message says why: not a vmmalloc handle, the sender exited or
 * freed the block, no pidfd rights ...). Close it with vmm_torch_close_import, once per import.
 * Blocks on chunks already mapped here by an import not yet closed use that mapping (no driver
 * call, no fd taken); the same block imported twice gets the same address. */
void* vmm_torch_import(int device, const char* bytes, int64_t n);
/* Ends an import; the chunks are unmapped with the last import on them (no kernel may still use
 * them). 0, or -1 + last error. */
int vmm_torch_close_import(void* ptr);
/* Blocks shared and not yet freed, and imports not yet closed, in this process. Returns 0. */
int vmm_torch_share_counts(uint64_t* shared, uint64_t* imported);

/* The options in effect for `device` ("" when it has no allocator), for logs. Valid until the next
 * call of this function on the same thread. */
const char* vmm_torch_config(int device);
/* The last failure of any call above, from any thread ("" when none). Valid until the next call
 * of this function on the same thread. */
const char* vmm_torch_last_error(void);

#ifdef __cplusplus
}
#endif

#endif /* VMMALLOC_TORCH_H */
