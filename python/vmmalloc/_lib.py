# SPDX-License-Identifier: Apache-2.0
"""Loading libvmmalloc.so (the C API of vmmalloc.h) and libvmmalloc_torch.so, binding them with
ctypes, and turning a failed status into a Python exception carrying the C++ message.

Search order for each library (first hit wins):
  1. an explicit path (an argument, or $VMMALLOC_TORCH_LIB / $VMMALLOC_TORCH_EXT_LIB for the
     torch library / the PyTorch extension),
  2. _paths.LIB_DIRS, relative to this package's folder (set in an installed package),
  3. $VMMALLOC_LIB_DIR (one folder, or several joined by os.pathsep),
  4. the repository's build folders, newest first (build*/src/, build*/src/integrations/).
"""

import ctypes
import enum
import glob
import os
import threading

from . import _paths

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
# python/vmmalloc -> the repository root (meaningful in the source tree only).
REPO_ROOT = os.path.dirname(os.path.dirname(PACKAGE_DIR))


class Status(enum.IntEnum):
    """vmm_status."""

    SUCCESS = 0
    OUT_OF_MEMORY = 1
    INVALID_VALUE = 2
    NOT_PERMITTED = 3
    NOT_SUPPORTED = 4
    NO_DRIVER = 5
    INVALID_POINTER = 6
    OTHER = 7


class Error(Exception):
    """A vmmalloc failure. str(e) is the C++ exception's message; e.status says which kind."""

    def __init__(self, message, status=Status.OTHER):
        super().__init__(message)
        try:
            self.status = Status(int(status))
        except ValueError:
            self.status = Status.OTHER


class OutOfMemoryError(Error, MemoryError):
    """Physical memory, a capacity limit, max_tokens or the slots ran out (VMM_ERROR_OUT_OF_MEMORY)."""


class InvalidValueError(Error, ValueError):
    """A bad argument: unknown or closed sequence, wrong dtype or shape (VMM_ERROR_INVALID_VALUE)."""


def error_for(status, message):
    """The exception a failed status raises."""
    status = int(status)
    if status == Status.OUT_OF_MEMORY:
        return OutOfMemoryError(message, status)
    if status == Status.INVALID_VALUE:
        return InvalidValueError(message, status)
    return Error(message, status)


# ---- finding the libraries --------------------------------------------------------------------

_NAMES = {
    "vmmalloc": (("libvmmalloc.so", "libvmmalloc.so.0"), "src"),
    "torch": (("libvmmalloc_torch.so",), os.path.join("src", "integrations")),
    # Optional, built only where PyTorch is found (src/integrations/torch_ext/).
    "torch_ext": (("libvmmalloc_torch_ext.so",), os.path.join("src", "integrations", "torch_ext")),
}
_ENV = {"torch": "VMMALLOC_TORCH_LIB", "torch_ext": "VMMALLOC_TORCH_EXT_LIB"}


def search_dirs():
    """The folders searched, in order (build folders excluded)."""
    dirs = [os.path.normpath(os.path.join(PACKAGE_DIR, d)) for d in _paths.LIB_DIRS]
    env = os.environ.get("VMMALLOC_LIB_DIR", "")
    dirs += [d for d in env.split(os.pathsep) if d]
    return dirs


def find_library(which="vmmalloc", path=None):
    """The path of libvmmalloc.so (which="vmmalloc"), libvmmalloc_torch.so (which="torch") or
    libvmmalloc_torch_ext.so (which="torch_ext"). FileNotFoundError lists every place looked at."""
    names, sub = _NAMES[which]
    cands = []
    if path:
        cands.append(path)
    else:
        if which in _ENV and os.environ.get(_ENV[which]):
            cands.append(os.environ[_ENV[which]])
        for d in search_dirs():
            cands += [os.path.join(d, n) for n in names]
        for n in names:
            built = glob.glob(os.path.join(REPO_ROOT, "build*", sub, n))
            cands += sorted(built, key=os.path.getmtime, reverse=True)  # newest build first
    for c in cands:
        if os.path.isfile(c):
            return os.path.abspath(c)
    raise FileNotFoundError(
        "vmmalloc: %s not found (looked at: %s); build the library (cmake --build build) or set "
        "VMMALLOC_LIB_DIR to the folder holding it" % (names[0], ", ".join(cands) or "nothing"))


# ---- the C structs (vmmalloc.h; same order and types) -----------------------------------------

c_size_t, c_int, c_u64, c_void_p = ctypes.c_size_t, ctypes.c_int, ctypes.c_uint64, ctypes.c_void_p


class BufferOptions(ctypes.Structure):
    _fields_ = [("backend", c_int), ("device", c_int), ("capacity_limit", c_size_t), ("min_chunk", c_size_t),
                ("geometric", c_int), ("peers", ctypes.POINTER(c_int)), ("peer_count", c_size_t),
                ("host_granularity", c_size_t), ("host_physical_limit", c_size_t), ("keep_idle", c_size_t)]


class BufferInfo(ctypes.Structure):
    _fields_ = [("data", c_void_p), ("size", c_size_t), ("capacity", c_size_t), ("capacity_limit", c_size_t),
                ("reserved", c_size_t), ("granularity", c_size_t), ("chunks", c_size_t),
                ("reserve_calls", c_u64), ("create_calls", c_u64), ("map_calls", c_u64),
                ("set_access_calls", c_u64), ("unmap_calls", c_u64), ("release_calls", c_u64),
                ("failures", c_u64), ("live_handles", c_size_t), ("live_mappings", c_size_t),
                ("live_reservations", c_size_t), ("idle_bytes", c_size_t)]


class KVConfig(ctypes.Structure):
    _fields_ = [("backend", c_int), ("device", c_int), ("layers", c_size_t), ("kv_heads", c_size_t),
                ("head_dim", c_size_t), ("elem_bytes", c_size_t), ("max_seqs", c_size_t),
                ("max_tokens", c_size_t), ("page_size", c_size_t), ("map_ahead_pages", c_size_t),
                ("map_ahead_tokens", c_size_t), ("pool_keep_pages", c_size_t), ("retain_closed", c_int),
                ("peers", ctypes.POINTER(c_int)), ("peer_count", c_size_t), ("host_granularity", c_size_t),
                ("host_physical_limit", c_size_t), ("fused_kv", c_int), ("layout", c_int)]


class KVLayout(ctypes.Structure):
    _fields_ = [("base", c_void_p)] + [(n, c_size_t) for n in (
        "reserved", "token_bytes", "seq_stride", "buffer_stride", "page_size", "tokens_per_page", "max_pages",
        "granularity", "layers", "kv_heads", "head_dim", "elem_bytes", "max_seqs", "max_tokens",
        "token_stride", "layer_stride", "kv_stride")] + [("layout", c_int)]


class KVSeqInfo(ctypes.Structure):
    _fields_ = [("open", c_int), ("length", c_size_t), ("mapped_pages", c_size_t), ("capacity", c_size_t),
                ("shared_tokens", c_size_t)]


class KVStats(ctypes.Structure):
    _fields_ = [("pages_created", c_u64), ("pages_reused", c_u64), ("pages_released", c_u64),
                ("pages_mapped", c_size_t), ("pages_pooled", c_size_t), ("mapped_bytes", c_size_t),
                ("used_bytes", c_size_t), ("open_seqs", c_size_t), ("appends", c_u64), ("driver_calls", c_u64),
                ("append_driver_calls", c_u64), ("map_ahead_driver_calls", c_u64), ("map_ahead_pages", c_u64),
                ("map_ahead_failures", c_u64), ("append_waits", c_u64), ("failures", c_u64),
                ("pages_retained", c_size_t), ("pages_retained_reused", c_u64), ("pages_reclaimed", c_u64),
                ("live_handles", c_size_t), ("live_mappings", c_size_t), ("live_reservations", c_size_t),
                ("pages_aliased", c_size_t)]


def struct_dict(s):
    """A ctypes struct as a dict of ints (pointers as ints, NULL as 0)."""
    return {name: (getattr(s, name) or 0) for name, _ in s._fields_}


KV_KEEP_DEFAULT = ctypes.c_size_t(-1).value  # VMM_KV_KEEP_DEFAULT


def _bind(lib):
    P = ctypes.POINTER
    st = c_int  # vmm_status
    sig = {
        "vmm_last_status": (st, []),
        "vmm_last_error": (ctypes.c_char_p, []),
        "vmm_status_string": (ctypes.c_char_p, [st]),
        "vmm_buffer_options_init": (None, [P(BufferOptions)]),
        "vmm_buffer_create": (st, [P(BufferOptions), P(c_void_p)]),
        "vmm_buffer_destroy": (None, [c_void_p]),
        "vmm_buffer_resize": (st, [c_void_p, c_size_t]),
        "vmm_buffer_reserve": (st, [c_void_p, c_size_t]),
        "vmm_buffer_shrink_to_fit": (st, [c_void_p]),
        "vmm_buffer_release_idle": (st, [c_void_p]),
        "vmm_buffer_data": (c_void_p, [c_void_p]),
        "vmm_buffer_size": (c_size_t, [c_void_p]),
        "vmm_buffer_capacity": (c_size_t, [c_void_p]),
        "vmm_buffer_get_info": (st, [c_void_p, P(BufferInfo)]),
        "vmm_kv_config_init": (None, [P(KVConfig)]),
        "vmm_kv_create": (st, [P(KVConfig), P(c_void_p)]),
        "vmm_kv_destroy": (None, [c_void_p]),
        "vmm_kv_open": (st, [c_void_p, P(c_size_t)]),
        "vmm_kv_open_slot": (st, [c_void_p, c_size_t]),
        "vmm_kv_append": (st, [c_void_p, c_size_t, c_size_t, P(c_size_t)]),
        "vmm_kv_truncate": (st, [c_void_p, c_size_t, c_size_t]),
        "vmm_kv_close": (st, [c_void_p, c_size_t]),
        "vmm_kv_share_prefix": (st, [c_void_p, c_size_t, c_size_t, P(c_size_t)]),
        "vmm_kv_trim": (st, [c_void_p, c_size_t, P(c_size_t)]),
        "vmm_kv_wait_map_ahead": (st, [c_void_p]),
        "vmm_kv_k": (st, [c_void_p, c_size_t, c_size_t, P(c_void_p)]),
        "vmm_kv_v": (st, [c_void_p, c_size_t, c_size_t, P(c_void_p)]),
        "vmm_kv_get_seq": (st, [c_void_p, c_size_t, P(KVSeqInfo)]),
        "vmm_kv_get_layout": (st, [c_void_p, P(KVLayout)]),
        "vmm_kv_get_stats": (st, [c_void_p, P(KVStats)]),
    }
    missing = [n for n in sig if not hasattr(lib, n)]
    if missing:
        raise ImportError("vmmalloc: %s lacks %s: it predates this Python package; rebuild it"
                          % (getattr(lib, "_name", "the library"), ", ".join(missing)))
    for name, (res, args) in sig.items():
        f = getattr(lib, name)
        f.restype = res
        f.argtypes = args


_lock = threading.Lock()
_lib = None
_lib_path = None


def load(path=None):
    """The ctypes handle of libvmmalloc.so (loaded once per process)."""
    global _lib, _lib_path
    with _lock:
        if _lib is not None:
            if path and os.path.realpath(path) != os.path.realpath(_lib_path):
                raise RuntimeError("vmmalloc: already loaded from %s, not %s" % (_lib_path, path))
            return _lib
        p = find_library("vmmalloc", path)
        lib = ctypes.CDLL(p)
        _bind(lib)
        _lib, _lib_path = lib, p
        return lib


def library_path():
    """The path of the loaded libvmmalloc.so, or None before the first use."""
    return _lib_path


def last_error():
    """This thread's last failure in the C API ("" when the last call succeeded)."""
    return load().vmm_last_error().decode("utf-8", "replace")


def check(status):
    """Raises the exception for a failed vmm_status, with this thread's last error."""
    if status != 0:
        raise error_for(status, last_error() or "vmmalloc: %s" % load().vmm_status_string(status).decode())


def int_array(values):
    """(ctypes int array or None, count) for a C `const int*` + count pair."""
    values = [int(v) for v in values]
    if not values:
        return None, 0
    return (ctypes.c_int * len(values))(*values), len(values)


def backend_value(backend):
    """VMM_BACKEND_CUDA / VMM_BACKEND_HOST from "cuda" / "host"."""
    b = str(backend).lower()
    if b == "cuda":
        return 0
    if b == "host":
        return 1
    raise InvalidValueError("vmmalloc: backend must be \"cuda\" or \"host\", not %r" % (backend,),
                            Status.INVALID_VALUE)
