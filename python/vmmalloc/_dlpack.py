# SPDX-License-Identifier: Apache-2.0
"""Torch tensors over vmmalloc memory, through DLPack capsules made with ctypes.

Why DLPack and not __cuda_array_interface__: PyTorch's import of the CUDA array interface asks the
driver which device the pointer is on (cudaPointerGetAttributes), and a reserved-but-unmapped
address answers "host memory": a tensor over a whole reservation, most of it not mapped yet, is
refused. A DLPack tensor names its device, so nothing is asked and nothing is touched.

One capsule per reservation: byte_tensor() gives a 1-D uint8 tensor over all of it, and every view
(a buffer's [0, size), a sequence's tokens) is a torch view of that base, so it keeps the owner
alive and grows without new capsules. Cost: ~10 us once per base, nothing per view.
"""

import ctypes
import itertools

kDLCPU, kDLCUDA = 1, 2
kDLUInt = 1


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int), ("dtype", _DLDataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    pass


_Deleter = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _Deleter)]

# key -> (managed tensor, shape, strides, owner): alive until the consumer calls the deleter.
_live = {}
_keys = itertools.count(1)


def _delete(p, _live=_live):  # defaults: still reachable while the interpreter shuts down
    try:
        _live.pop(p.contents.manager_ctx, None)  # drops the owner reference (dict ops hold the GIL)
    except Exception:
        pass


_deleter = _Deleter(_delete)

_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_capsule_valid = ctypes.pythonapi.PyCapsule_IsValid
_capsule_valid.restype = ctypes.c_int
_capsule_valid.argtypes = [ctypes.py_object, ctypes.c_char_p]


def byte_tensor(ptr, nbytes, device, owner):
    """A 1-D torch.uint8 tensor of `nbytes` at `ptr`, on the CPU (device None) or CUDA device
    `device`, holding a reference to `owner` until the tensor and all its views are gone."""
    from torch.utils.dlpack import from_dlpack

    key = next(_keys)
    shape = (ctypes.c_int64 * 1)(int(nbytes))
    strides = (ctypes.c_int64 * 1)(1)
    m = _DLManagedTensor()
    m.dl_tensor.data = ptr
    m.dl_tensor.device = _DLDevice(kDLCPU, 0) if device is None else _DLDevice(kDLCUDA, int(device))
    m.dl_tensor.ndim = 1
    m.dl_tensor.dtype = _DLDataType(kDLUInt, 8, 1)
    m.dl_tensor.shape = shape
    m.dl_tensor.strides = strides
    m.dl_tensor.byte_offset = 0
    m.manager_ctx = key
    m.deleter = _deleter
    _live[key] = (m, shape, strides, owner)
    cap = _capsule_new(ctypes.addressof(m), b"dltensor", None)
    try:
        return from_dlpack(cap)  # takes the capsule, renames it "used_dltensor", owns the deleter
    finally:
        if _capsule_valid(cap, b"dltensor"):  # not consumed (the import failed): no deleter will come
            _live.pop(key, None)


def live_capsules():
    """How many imported bases are still alive (tests)."""
    return len(_live)


def check_dtype(dtype, elem_bytes, what):
    """Raises InvalidValueError unless `dtype` (a torch dtype) has elem_bytes bytes."""
    from ._lib import InvalidValueError, Status

    size = dtype.itemsize if hasattr(dtype, "itemsize") else __import__("torch").empty((), dtype=dtype).element_size()
    if size != elem_bytes:
        raise InvalidValueError("%s: dtype %s has %d bytes per element; the region was made with elem_bytes=%d"
                                % (what, dtype, size, elem_bytes), Status.INVALID_VALUE)
