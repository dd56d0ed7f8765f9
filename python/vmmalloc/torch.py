# SPDX-License-Identifier: Apache-2.0
"""vmmalloc as PyTorch's CUDA allocator, and vmmalloc's stats from Python.

    import vmmalloc.torch as vt
    vt.enable()                      # before the first CUDA allocation of the process
    import torch
    x = torch.randn(1 << 20, device="cuda")
    print(vt.stats(0)["peak_mapped"])

The library is libvmmalloc_torch.so (src/integrations/, target vmmalloc_torch). enable() finds it
through, in order: its argument, $VMMALLOC_TORCH_LIB, the package's library folders (_paths.py),
$VMMALLOC_LIB_DIR, the repository's build folders (build*/src/integrations/). Options come from the
environment (VMMALLOC_RESERVATION, VMMALLOC_RELEASE_THRESHOLD, VMMALLOC_MEMORY_LIMIT, VMMALLOC_PEERS,
VMMALLOC_TRACE, ...; VMMALLOC_OPTIONS="release_threshold=1G,thread_cache=0" for any option by name: see
src/integrations/vmmalloc_torch.h), read when a device's allocator is created.
VMMALLOC_TRACE=run.trace records every allocation and free (trace format v2, docs/trace-format.md:
stream, thread and time per event) for vmm-replay and vmm-plot; flush_trace() writes it mid-run.

enable() installs vmmalloc through the extension libvmmalloc_torch_ext.so when it was built (CMake
builds it where PyTorch with CUDA is found; $VMMALLOC_TORCH_EXT_LIB names it): CUDA graphs
(torch.cuda.graph, make_graphed_callables, torch.compile(mode="reduce-overhead")) then get graph
pools of their own, torch.cuda.use_mem_pool works, and Tensor.record_stream delays reuse. Without
it, enable() warns once and installs the plain pluggable allocator: a graph's memory is not kept for
its replays, record_stream does nothing. mode() says which is active.

MemPool mode keeps PyTorch's allocator for the process and serves one region from vmmalloc:

    pool = vt.mem_pool()                 # torch.cuda.MemPool over vmmalloc (no enable())
    with torch.cuda.use_mem_pool(pool):
        y = model(x)                     # these tensors' memory comes from vmmalloc

Only enable() and the MemPool helpers need torch; stats(), trim(), reset_peaks(), check() and the
loader work without it (vmmalloc.cupy uses them). An allocation that fails raises RuntimeError in PyTorch (its pluggable
allocator does not map it to torch.cuda.OutOfMemoryError); last_error() holds the message too.
The old module name, tools/python/vmmalloc_torch.py, is a shim that imports this one.
"""

import ctypes
import os

from ._lib import find_library as _find

__all__ = ["enable", "enabled", "mode", "extension_info", "find_library", "find_extension", "load",
           "stats", "trim", "reset_peaks", "check", "flush_trace", "config", "last_error",
           "library_path", "pluggable_allocator", "mem_pool", "pool_of", "extension_pool_count"]

_lib = None
_lib_path = None
_torch_allocator = None  # keeps the CUDAPluggableAllocator alive (plain mode)
_mode = None             # "extension" or "pluggable" once enable() succeeded
_ext = None              # ctypes handle of libvmmalloc_torch_ext.so (extension mode)
_ext_path = None
_pluggable = None        # the CUDAPluggableAllocator of MemPool mode

# The one-line warning of enable() without the extension: what does not work.
NO_EXTENSION_WARNING = (
    "vmmalloc.torch: libvmmalloc_torch_ext.so not found (%s): using the plain pluggable allocator, "
    "so CUDA graphs (torch.cuda.graph, torch.compile(mode=\"reduce-overhead\")) get no private pool "
    "(memory a capture frees goes to general use while replays still write it) and "
    "Tensor.record_stream is a no-op")


def find_library(lib_path=None):
    """The path of libvmmalloc_torch.so; FileNotFoundError listing where it looked."""
    return _find("torch", lib_path)


def _bind(lib):
    c = ctypes
    sig = {
        "vmm_torch_malloc": (c.c_void_p, [c.c_ssize_t, c.c_int, c.c_void_p]),
        "vmm_torch_try_malloc": (c.c_void_p, [c.c_ssize_t, c.c_int, c.c_void_p]),
        "vmm_torch_free": (None, [c.c_void_p, c.c_ssize_t, c.c_int, c.c_void_p]),
        "vmm_torch_init": (c.c_int, [c.c_int]),
        "vmm_torch_initialized": (c.c_int, [c.c_int]),
        "vmm_torch_stats": (c.c_int, [c.c_int, c.POINTER(c.c_uint64), c.c_int]),
        "vmm_torch_stat_names": (c.c_char_p, []),
        "vmm_torch_memory_map": (c.c_int64, [c.c_int, c.POINTER(c.c_uint64), c.c_int64]),
        "vmm_torch_trim": (c.c_int, [c.c_int]),
        "vmm_torch_reset_peaks": (c.c_int, [c.c_int]),
        "vmm_torch_mem_info": (c.c_int, [c.c_int, c.POINTER(c.c_uint64), c.POINTER(c.c_uint64)]),
        "vmm_torch_set_memory_fraction": (c.c_int, [c.c_int, c.c_double]),
        "vmm_torch_memory_fraction": (c.c_int, [c.c_int, c.POINTER(c.c_double)]),
        "vmm_torch_check": (c.c_int, [c.c_int]),
        "vmm_torch_flush_trace": (c.c_int, []),
        "vmm_torch_config": (c.c_char_p, [c.c_int]),
        "vmm_torch_last_error": (c.c_char_p, []),
        "vmm_torch_begin_pool": (c.c_int, [c.c_int, c.c_uint64, c.c_void_p, c.c_void_p]),
        "vmm_torch_end_pool": (c.c_int, [c.c_int, c.c_uint64]),
        "vmm_torch_release_pool": (c.c_int, [c.c_int, c.c_uint64]),
        "vmm_torch_record_stream": (c.c_int, [c.c_void_p, c.c_void_p]),
        "vmm_torch_device_of": (c.c_int, [c.c_void_p]),
        "vmm_torch_pool_of": (c.c_int, [c.c_void_p, c.POINTER(c.c_uint64)]),
        "vmm_torch_pool_stats": (c.c_int, [c.c_int, c.c_uint64, c.POINTER(c.c_uint64),
                                           c.POINTER(c.c_uint64), c.POINTER(c.c_uint64)]),
    }
    for name, (res, args) in sig.items():
        f = getattr(lib, name)
        f.restype = res
        f.argtypes = args


def load(lib_path=None):
    """The ctypes handle of the library (loaded once; the same copy PyTorch calls into)."""
    global _lib, _lib_path
    if _lib is not None:
        if lib_path and os.path.realpath(lib_path) != os.path.realpath(_lib_path):
            raise RuntimeError("vmmalloc.torch: already loaded from %s, not %s" % (_lib_path, lib_path))
        return _lib
    path = find_library(lib_path)
    lib = ctypes.CDLL(path)
    _bind(lib)
    _lib, _lib_path = lib, path
    return lib


def library_path():
    """The path loaded, or None."""
    return _lib_path


def last_error():
    """The last failure recorded by the library ("" when none)."""
    return load().vmm_torch_last_error().decode("utf-8", "replace")


def find_extension(ext_path=None):
    """The path of libvmmalloc_torch_ext.so; FileNotFoundError listing where it looked."""
    return _find("torch_ext", ext_path)


def _load_extension(path):
    lib = ctypes.CDLL(path)  # after `import torch`: its libtorch_cuda is the one already loaded
    c = ctypes
    for name, res, args in (("vmm_torch_ext_install", c.c_int, [c.c_char_p]),
                            ("vmm_torch_ext_installed", c.c_int, []),
                            ("vmm_torch_ext_features", c.c_int, []),
                            ("vmm_torch_ext_pool_count", c.c_int, []),
                            ("vmm_torch_ext_pool_id", c.c_uint64, [c.c_int, c.c_uint64, c.c_uint64]),
                            ("vmm_torch_ext_torch_version", c.c_char_p, []),
                            ("vmm_torch_ext_last_error", c.c_char_p, [])):
        f = getattr(lib, name)
        f.restype = res
        f.argtypes = args
    return lib


def enable(lib_path=None, init_device=0, extension=None):
    """Makes vmmalloc PyTorch's CUDA allocator. Must run before the process's first CUDA
    allocation (PyTorch cannot swap an allocator in use). init_device: the device whose allocator
    is created now, so that a bad option or a device without VMM support fails here, with the
    reason, rather than at the first tensor (None: create every allocator on first use).
    extension: None = through libvmmalloc_torch_ext.so when found (else warn and use the plain
    pluggable allocator), True = the extension or an error, False = the plain pluggable allocator,
    or a path to the extension. Returns the library path; mode() says which way it went."""
    global _torch_allocator, _mode, _ext, _ext_path
    import torch

    if _mode is not None:
        return _lib_path
    if not torch.cuda.is_available():  # counts devices only: does not initialize the allocator
        raise RuntimeError("vmmalloc.torch.enable(): PyTorch sees no CUDA device")
    lib = load(lib_path)
    if init_device is not None and lib.vmm_torch_init(int(init_device)) != 0:
        raise RuntimeError("vmmalloc.torch.enable(): " + last_error())

    ext_path, why = None, ""
    if extension is not False:
        try:
            ext_path = find_extension(extension if isinstance(extension, str) else None)
        except FileNotFoundError as e:
            if extension is not None:
                raise RuntimeError("vmmalloc.torch.enable(): %s" % e) from e
            why = "build it where PyTorch is installed, or set VMMALLOC_TORCH_EXT_LIB"
    if ext_path:
        try:
            ext = _load_extension(ext_path)
        except OSError as e:  # built against another PyTorch: undefined symbols
            if extension is not None:
                raise RuntimeError("vmmalloc.torch.enable(): cannot load %s: %s" % (ext_path, e)) from e
            ext, why = None, "%s does not load: %s" % (ext_path, e)
        if ext is not None:
            if ext.vmm_torch_ext_install(_lib_path.encode()) != 0:
                msg = ext.vmm_torch_ext_last_error().decode("utf-8", "replace")
                hint = (" (enable() must run before the first CUDA allocation of the process)"
                        if "already initialized" in msg else "")
                raise RuntimeError("vmmalloc.torch.enable(): %s%s" % (msg, hint))
            _ext, _ext_path, _mode = ext, ext_path, "extension"
            return _lib_path

    if extension is None:
        import warnings

        warnings.warn(NO_EXTENSION_WARNING % why, RuntimeWarning, stacklevel=2)
    alloc = torch.cuda.memory.CUDAPluggableAllocator(_lib_path, "vmm_torch_malloc", "vmm_torch_free")
    try:
        torch.cuda.memory.change_current_allocator(alloc)
    except RuntimeError as e:
        raise RuntimeError("vmmalloc.torch.enable() must run before the first CUDA allocation of "
                           "the process: %s" % e) from e
    _torch_allocator, _mode = alloc, "pluggable"
    return _lib_path


def enabled():
    """Whether enable() made vmmalloc PyTorch's allocator in this process."""
    return _mode is not None


def mode():
    """How enable() installed vmmalloc: "extension" (graph pools, MemPool and record_stream hooks
    set), "pluggable" (the plain CUDAPluggableAllocator, no hooks), or None (not enabled)."""
    return _mode


def extension_info():
    """In extension mode: {"path", "torch_version" (built against), "mempool" (torch.cuda.MemPool
    objects work), "snapshot" (torch.cuda.memory_snapshot() gives vmmalloc's memory map), "pools"
    (PyTorch pools mapped to vmmalloc pools now)}; else None."""
    if _ext is None:
        return None
    return {"path": _ext_path,
            "torch_version": _ext.vmm_torch_ext_torch_version().decode(),
            "mempool": bool(_ext.vmm_torch_ext_features() & 2),
            "snapshot": bool(_ext.vmm_torch_ext_features() & 4),
            "pools": int(_ext.vmm_torch_ext_pool_count())}


def extension_pool_count():
    """PyTorch pools the extension maps to vmmalloc pools now (None outside extension mode)."""
    return None if _ext is None else int(_ext.vmm_torch_ext_pool_count())


def pool_of(ptr):
    """The vmmalloc graph pool holding the block that starts at ptr (an int, or a tensor's
    data_ptr()), or None when the block is in no pool or not vmmalloc's."""
    if hasattr(ptr, "data_ptr"):
        ptr = ptr.data_ptr()
    out = ctypes.c_uint64(0)
    return int(out.value) if load().vmm_torch_pool_of(ptr, ctypes.byref(out)) == 1 else None


def pluggable_allocator():
    """A torch.cuda.memory.CUDAPluggableAllocator over vmmalloc (one per process), for MemPool
    mode: PyTorch's own allocator stays the process's, and a torch.cuda.MemPool built on this one
    takes its segments from vmmalloc. Not for change_current_allocator (use enable())."""
    global _pluggable
    import torch

    if _pluggable is None:
        load()
        _pluggable = torch.cuda.memory.CUDAPluggableAllocator(_lib_path, "vmm_torch_malloc", "vmm_torch_free")
    return _pluggable


def mem_pool(**kwargs):
    """torch.cuda.MemPool(pluggable_allocator().allocator(), **kwargs): inside
    `with torch.cuda.use_mem_pool(pool):` this thread's CUDA tensors come from vmmalloc, CUDA
    graphs captured there included, while PyTorch's allocator serves the rest of the program.
    PyTorch's allocator keeps the pool's segments cached until the pool is deleted."""
    import torch

    return torch.cuda.MemPool(pluggable_allocator().allocator(), **kwargs)


def stats(device=0):
    """vmmalloc's counters for `device` as a dict (bytes and counts: requested, allocated,
    mapped, physical, reserved, their peak_*, chunks, allocs, frees, live, grows, driver_calls,
    granularity, peers, malloc_failures, free_failures, calls by kind (creates, maps, unmaps, ...),
    driver_ns and fence_ns (wall time inside driver and fence calls), chunks_retired, ...), or None
    when nothing was allocated on that device yet."""
    lib = load()
    names = lib.vmm_torch_stat_names().decode().split(",")
    buf = (ctypes.c_uint64 * len(names))()
    n = lib.vmm_torch_stats(int(device), buf, len(names))
    if n < 0:
        raise RuntimeError(last_error())
    if n == 0:
        return None
    return {k: int(buf[i]) for i, k in enumerate(names[:n])}


_STATES = ("free", "live", "cached", "pending_free")


def memory_map(device=0):
    """What vmmalloc's mapped memory on `device` holds now: a list of segments in address order,
    each a dict with address, size, pool (a vmmalloc graph pool id, 0: none), huge, and blocks
    (address, size, requested, state: "live", "free", "cached" = freed into a thread cache, or
    "pending_free" = waiting for another stream's work) tiling the segment. [] before the device's
    first allocation. Works in both modes; in extension mode torch.cuda.memory_snapshot() gives the
    same memory in PyTorch's form."""
    lib = load()
    words = 8  # VMM_TORCH_MAP_WORDS
    room = 1024
    while True:  # one walk when the map fits; it may grow between two calls: room for some more
        buf = (ctypes.c_uint64 * (room * words))()
        n = lib.vmm_torch_memory_map(int(device), buf, room)
        if n < 0:
            raise RuntimeError(last_error())
        if n <= room:
            break
        room = n + n // 8 + 16
    segments = []
    for i in range(n):
        r = buf[i * words:(i + 1) * words]
        if not segments or segments[-1]["address"] != r[0]:
            segments.append({"address": r[0], "size": r[1], "pool": r[2], "huge": bool(r[3]), "blocks": []})
        segments[-1]["blocks"].append({"address": r[4], "size": r[5], "requested": r[6],
                                       "state": _STATES[r[7]] if r[7] < len(_STATES) else str(r[7])})
    return segments


def _rc(rc):
    if rc != 0:
        raise RuntimeError(last_error())


def trim(device=-1):
    """Unmaps and releases every free chunk (device -1: every device with an allocator). Call
    after the memory's last users finished (it waits only for the streams of freed blocks)."""
    _rc(load().vmm_torch_trim(int(device)))


def reset_peaks(device=-1):
    """Peak counters start again from the current values."""
    _rc(load().vmm_torch_reset_peaks(int(device)))


def set_memory_fraction(fraction, device=0):
    """Caps what vmmalloc holds on `device` (mapped and idle memory) at fraction x the device's
    memory, as torch.cuda.set_per_process_memory_fraction does for PyTorch's allocator (which
    reaches here too in extension mode; the plain pluggable allocator drops it). Lowered below
    what is held, free memory goes back until it fits; allocations past it raise
    torch.OutOfMemoryError. fraction in [0, 1]."""
    _rc(load().vmm_torch_set_memory_fraction(int(device), float(fraction)))


def memory_fraction(device=0):
    """The limit of `device` as a fraction of its memory (1.0 with no limit)."""
    f = ctypes.c_double()
    _rc(load().vmm_torch_memory_fraction(int(device), ctypes.byref(f)))
    return f.value


def check(device=-1):
    """Walks vmmalloc's metadata: "" when every invariant holds, else what is wrong."""
    rc = load().vmm_torch_check(int(device))
    if rc < 0:
        raise RuntimeError(last_error())
    return "" if rc == 0 else last_error()


def flush_trace():
    """Writes buffered VMMALLOC_TRACE events now (also done at exit)."""
    _rc(load().vmm_torch_flush_trace())


def config(device=0):
    """The options in effect on `device` ("" before its first allocation)."""
    return load().vmm_torch_config(int(device)).decode()
