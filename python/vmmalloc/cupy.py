# SPDX-License-Identifier: Apache-2.0
"""vmmalloc as CuPy's device allocator.

    import vmmalloc.cupy as vc
    vc.enable()
    import cupy
    x = cupy.arange(1 << 20, dtype=cupy.float32)
    print(vc.stats(0)["live"])

Every CuPy allocation becomes one vmmalloc block on the current device, ordered on CuPy's current
stream; it is freed (on that stream) when CuPy drops its last reference. Uses libvmmalloc_torch.so
through vmmalloc.torch's loader (same search, same environment options), without torch.
The old module name, tools/python/vmmalloc_cupy.py, is a shim that imports this one.
Cost: one ctypes call per allocation and per free, which CuPy's own pool avoids for cached blocks.
"""

from . import torch as _vt
from .torch import check, config, last_error, reset_peaks, stats, trim  # noqa: F401

__all__ = ["enable", "disable", "stats", "trim", "reset_peaks", "check", "config", "last_error"]

_enabled = False


class _Block(object):
    """Owner of one vmmalloc block: frees it when CuPy's UnownedMemory lets go of it."""

    __slots__ = ("ptr", "size", "device", "stream", "free")

    def __init__(self, ptr, size, device, stream, free):
        self.ptr, self.size, self.device, self.stream, self.free = ptr, size, device, stream, free

    def __del__(self):
        # The free function is held here: module globals may already be gone at interpreter exit.
        if self.ptr and self.free is not None:
            self.free(self.ptr, self.size, self.device, self.stream)
            self.ptr = 0


def _oom_class(cupy):
    """A MemoryError CuPy recognises as out of memory (its OutOfMemoryError, which CuPy catches to
    free caches and retry), carrying vmmalloc's message."""
    base = getattr(getattr(cupy.cuda, "memory", None), "OutOfMemoryError", MemoryError)
    if not (isinstance(base, type) and issubclass(base, MemoryError)):
        base = MemoryError

    class VmmOutOfMemoryError(base):
        def __init__(self, msg):
            MemoryError.__init__(self, msg)  # not CuPy's (size, total) signature

        def __str__(self):
            return str(self.args[0])

    return VmmOutOfMemoryError


def _make_malloc(lib, cupy):
    try_malloc = lib.vmm_torch_try_malloc
    free = lib.vmm_torch_free
    get_device = cupy.cuda.runtime.getDevice
    current_stream = cupy.cuda.get_current_stream
    oom = _oom_class(cupy)

    def malloc(size):
        n = max(int(size), 1)  # CuPy asks for 0 bytes for empty arrays; vmmalloc rejects 0
        dev = get_device()
        stream = current_stream().ptr
        ptr = try_malloc(n, dev, stream)
        if not ptr:
            raise oom(_vt.last_error())  # "CUDA out of memory. vmmalloc cannot allocate ... on device d: why"
        owner = _Block(ptr, n, dev, stream, free)
        mem = cupy.cuda.UnownedMemory(ptr, n, owner, device_id=dev)
        return cupy.cuda.MemoryPointer(mem, 0)

    return malloc


def enable(lib_path=None):
    """Makes vmmalloc CuPy's allocator (cupy.cuda.set_allocator). Arrays allocated before keep
    their memory pool. Returns the library path."""
    global _enabled
    import cupy

    lib = _vt.load(lib_path)
    cupy.cuda.set_allocator(_make_malloc(lib, cupy))
    _enabled = True
    return _vt.library_path()


def disable():
    """Back to CuPy's default memory pool (blocks already handed out stay valid)."""
    global _enabled
    import cupy

    cupy.cuda.set_allocator(cupy.get_default_memory_pool().malloc)
    _enabled = False
