# SPDX-License-Identifier: Apache-2.0
"""vmmalloc.GrowableBuffer: one buffer that grows and shrinks in place (vmm::growable_buffer).

    buf = vmmalloc.GrowableBuffer(64 << 30)            # CUDA device 0: reserves 64 GiB of VA only
    buf.resize(1 << 30)                                # maps 1 GiB at the tail: one driver round
    t = buf.tensor(torch.float16)                      # [0, size) as a torch tensor, no copy
    buf.resize(2 << 30)                                # maps more; buf.data_ptr and t unchanged
    t = buf.tensor(torch.float16)                      # a new, longer view of the same memory

The data pointer never changes: growth maps chunks after the old ones (the old bytes are never
copied), shrinking unmaps chunks wholly past the new size. A view is valid while the bytes under it
stay mapped: shrinking below it or destroy() leaves it dangling (like a freed pointer); dropping the
last reference to the buffer does not, since views keep the memory alive.

Views: tensor() (torch, CUDA or host backend), __cuda_array_interface__ (CUDA backend: CuPy, Numba),
memoryview() and __array_interface__ (host backend). Not thread-safe per view, but every call on the
buffer takes its lock in the library.
"""

import ctypes

from . import _dlpack
from ._lib import BufferInfo, BufferOptions, InvalidValueError, Status, backend_value, check, int_array, load, struct_dict
from ._owner import Owner, _Handle

__all__ = ["GrowableBuffer"]


class GrowableBuffer(Owner):
    """A growable buffer: capacity_limit bytes of VA reserved once, memory mapped as it grows.

    backend: "cuda" (device `device`) or "host" (memfd + mmap with the driver's rules: no GPU).
    min_chunk: smallest growth step in bytes (0: the granularity, 2 MiB); geometric: each growth maps
    at least half of what is mapped (O(log n) driver rounds for many small steps, up to 50 % unused).
    keep_idle: bytes of shrunk chunks kept as handles that the next growth maps again (no create,
    no release; the memory stays held until release_idle()); 0: a shrink gives memory back at once.
    peers: devices granted read-write access too. host_granularity / host_physical_limit: the host
    backend's simulated page size and device memory.
    Raises OutOfMemoryError, InvalidValueError or Error with the C++ message."""

    _gone = "the buffer was destroyed"

    def __init__(self, capacity_limit, backend="cuda", device=0, min_chunk=0, geometric=False, peers=(),
                 host_granularity=0, host_physical_limit=0, keep_idle=0):
        lib = load()
        o = BufferOptions()
        lib.vmm_buffer_options_init(ctypes.byref(o))
        o.backend = backend_value(backend)
        o.device = int(device)
        o.capacity_limit = _size(capacity_limit, "capacity_limit")
        o.min_chunk = _size(min_chunk, "min_chunk")
        o.geometric = 1 if geometric else 0
        arr, n = int_array(peers)
        o.peers = ctypes.cast(arr, ctypes.POINTER(ctypes.c_int)) if arr is not None else None
        o.peer_count = n
        o.host_granularity = _size(host_granularity, "host_granularity")
        o.host_physical_limit = _size(host_physical_limit, "host_physical_limit")
        o.keep_idle = _size(keep_idle, "keep_idle")
        out = ctypes.c_void_p()
        check(lib.vmm_buffer_create(ctypes.byref(o), ctypes.byref(out)))
        self._lib = lib
        self._h = _Handle(out.value, lib.vmm_buffer_destroy)
        self.backend = str(backend).lower()
        self.device = int(device)
        self._data = lib.vmm_buffer_data(out.value) or 0
        info = self.info()
        self._reserved = info["reserved"]
        self._base = None  # torch.uint8 over the whole reservation, made on first tensor()

    @classmethod
    def host(cls, capacity_limit, **kw):
        """On the host backend (no GPU needed)."""
        return cls(capacity_limit, backend="host", **kw)

    # ---- life ------------------------------------------------------------------------------

    def destroy(self):
        """Unmaps and releases everything now and frees the reservation. Views become dangling."""
        self._base = None
        self._free_handle()

    # ---- size ------------------------------------------------------------------------------

    def resize(self, size):
        """Sets the size in bytes. Growing maps one chunk at the tail (OutOfMemoryError past
        capacity_limit or physical memory, nothing changed); shrinking unmaps whole chunks."""
        check(self._lib.vmm_buffer_resize(self._ptr("resize"), _size(size, "size")))

    def reserve(self, nbytes):
        """Maps up to nbytes without changing the size; never unmaps."""
        check(self._lib.vmm_buffer_reserve(self._ptr("reserve"), _size(nbytes, "nbytes")))

    def shrink_to_fit(self):
        """Unmaps the chunks wholly past the size."""
        check(self._lib.vmm_buffer_shrink_to_fit(self._ptr("shrink_to_fit")))

    def release_idle(self):
        """Releases the handles that shrinks kept (keep_idle)."""
        check(self._lib.vmm_buffer_release_idle(self._ptr("release_idle")))

    def info(self):
        """Everything as a dict: data, size, capacity, capacity_limit, reserved, granularity, chunks,
        the backend calls made (*_calls, failures) and, on the host backend, the live objects
        (live_handles, live_mappings, live_reservations) and idle_bytes (keep_idle's kept handles)."""
        i = BufferInfo()
        check(self._lib.vmm_buffer_get_info(self._ptr("info"), ctypes.byref(i)))
        return struct_dict(i)

    @property
    def data_ptr(self):
        """The base address (an int): the same for the buffer's whole life."""
        return self._data

    @property
    def size(self):
        return self.info()["size"]

    @property
    def capacity(self):
        """Bytes mapped (>= size)."""
        return self.info()["capacity"]

    @property
    def capacity_limit(self):
        return self.info()["capacity_limit"]

    @property
    def reserved(self):
        return self._reserved

    def __len__(self):
        return self.size

    def __repr__(self):
        if self.closed:
            return "GrowableBuffer(destroyed)"
        i = self.info()
        return "GrowableBuffer(%s, size=%d, capacity=%d, limit=%d, data=0x%x)" % (
            self.backend, i["size"], i["capacity"], i["capacity_limit"], i["data"])

    # ---- views -----------------------------------------------------------------------------

    def tensor(self, dtype=None, shape=None):
        """[0, size) as a torch tensor (CUDA backend: on cuda:<device>; host: on the CPU), no copy.
        dtype: a torch dtype (default uint8); shape: optional, must fit in size. A new view of the
        same base after every resize: take a new one after growing."""
        import torch

        self._ptr("tensor")
        if self._base is None:
            dev = self.device if self.backend == "cuda" else None
            self._base = _dlpack.byte_tensor(self._data, self._reserved, dev, self._h)
        size = self.size
        t = self._base[:size]
        if dtype is not None and dtype != torch.uint8:
            item = torch.empty((), dtype=dtype).element_size()
            if size % item:
                raise InvalidValueError("vmmalloc.GrowableBuffer.tensor: size %d is not a multiple of %s's %d bytes"
                                        % (size, dtype, item), Status.INVALID_VALUE)
            t = t.view(dtype)
        if shape is not None:
            shape = tuple(int(s) for s in shape)
            n = 1
            for s in shape:
                n *= s
            if n > t.numel():
                raise InvalidValueError("vmmalloc.GrowableBuffer.tensor: shape %s needs %d elements; the buffer "
                                        "holds %d" % (shape, n, t.numel()), Status.INVALID_VALUE)
            t = t[:n].view(shape)
        return t

    def memoryview(self):
        """[0, size) as a writable memoryview of bytes (host backend only: CUDA memory is not
        addressable by the CPU)."""
        ptr = self._ptr("memoryview")
        if self.backend != "host":
            raise InvalidValueError("vmmalloc.GrowableBuffer.memoryview: CUDA memory; use tensor() or "
                                    "__cuda_array_interface__", Status.INVALID_VALUE)
        size = self._lib.vmm_buffer_size(ptr)
        if not size:
            return memoryview(bytearray())
        arr = (ctypes.c_char * size).from_address(self._data)
        arr._vmm_owner = self._h  # the view keeps the memory alive (not through destroy())
        return memoryview(arr).cast("B")

    def _interface(self, version):
        self._ptr("interface")
        size = self.size
        return {"shape": (size,), "typestr": "|u1", "data": (self._data if size else 0, False),
                "strides": None, "version": version}

    @property
    def __cuda_array_interface__(self):
        """CUDA backend: [0, size) as uint8 (CuPy, Numba). The consumer holds this buffer alive."""
        if self.backend != "cuda":
            raise AttributeError("__cuda_array_interface__: host-backend buffer (use __array_interface__)")
        d = self._interface(3)
        d["stream"] = None  # the library does no GPU work: nothing to order against
        return d

    @property
    def __array_interface__(self):
        """Host backend: [0, size) as uint8 (NumPy)."""
        if self.backend != "host":
            raise AttributeError("__array_interface__: CUDA buffer (use __cuda_array_interface__)")
        return self._interface(3)


def _size(v, what):
    v = int(v)
    if v < 0:
        raise InvalidValueError("vmmalloc: %s must not be negative (%d)" % (what, v), Status.INVALID_VALUE)
    return v
