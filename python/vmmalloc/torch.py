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
VMMALLOC_TRACE, ...: see src/integrations/vmmalloc_torch.h), read when a device's allocator is created.
VMMALLOC_TRACE=run.trace records every allocation and free (trace format v2, docs/trace-format.md:
stream, thread and time per event) for vmm-replay and vmm-plot; flush_trace() writes it mid-run.

Only enable() needs torch; stats(), trim(), reset_peaks(), check() and the loader work without it
(vmmalloc.cupy uses them). An allocation that fails raises RuntimeError in PyTorch (its pluggable
allocator does not map it to torch.cuda.OutOfMemoryError); last_error() holds the message too.
The old module name, tools/python/vmmalloc_torch.py, is a shim that imports this one.
"""

import ctypes
import os

from ._lib import find_library as _find

__all__ = ["enable", "enabled", "find_library", "load", "stats", "trim", "reset_peaks", "check",
           "flush_trace", "config", "last_error", "library_path"]

_lib = None
_lib_path = None
_torch_allocator = None  # keeps the CUDAPluggableAllocator alive


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
        "vmm_torch_trim": (c.c_int, [c.c_int]),
        "vmm_torch_reset_peaks": (c.c_int, [c.c_int]),
        "vmm_torch_check": (c.c_int, [c.c_int]),
        "vmm_torch_flush_trace": (c.c_int, []),
        "vmm_torch_config": (c.c_char_p, [c.c_int]),
        "vmm_torch_last_error": (c.c_char_p, []),
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


def enable(lib_path=None, init_device=0):
    """Makes vmmalloc PyTorch's CUDA allocator. Must run before the process's first CUDA
    allocation (PyTorch cannot swap an allocator in use). init_device: the device whose allocator
    is created now, so that a bad option or a device without VMM support fails here, with the
    reason, rather than at the first tensor (None: create every allocator on first use).
    Returns the library path."""
    global _torch_allocator
    import torch

    if _torch_allocator is not None:
        return _lib_path
    if not torch.cuda.is_available():  # counts devices only: does not initialize the allocator
        raise RuntimeError("vmmalloc.torch.enable(): PyTorch sees no CUDA device")
    lib = load(lib_path)
    if init_device is not None and lib.vmm_torch_init(int(init_device)) != 0:
        raise RuntimeError("vmmalloc.torch.enable(): " + last_error())
    alloc = torch.cuda.memory.CUDAPluggableAllocator(_lib_path, "vmm_torch_malloc", "vmm_torch_free")
    try:
        torch.cuda.memory.change_current_allocator(alloc)
    except RuntimeError as e:
        raise RuntimeError("vmmalloc.torch.enable() must run before the first CUDA allocation of "
                           "the process: %s" % e) from e
    _torch_allocator = alloc
    return _lib_path


def enabled():
    """Whether enable() made vmmalloc PyTorch's allocator in this process."""
    return _torch_allocator is not None


def stats(device=0):
    """vmmalloc's counters for `device` as a dict (bytes and counts: requested, allocated,
    mapped, physical, reserved, their peak_*, chunks, allocs, frees, live, grows, driver_calls,
    granularity, peers, malloc_failures, free_failures, ...), or None when nothing was allocated
    on that device yet."""
    lib = load()
    names = lib.vmm_torch_stat_names().decode().split(",")
    buf = (ctypes.c_uint64 * len(names))()
    n = lib.vmm_torch_stats(int(device), buf, len(names))
    if n < 0:
        raise RuntimeError(last_error())
    if n == 0:
        return None
    return {k: int(buf[i]) for i, k in enumerate(names[:n])}


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
