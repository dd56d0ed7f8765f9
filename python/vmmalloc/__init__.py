# SPDX-License-Identifier: Apache-2.0
"""vmmalloc from Python: growable buffers and a paged KV cache on CUDA's virtual memory API.

    import vmmalloc
    buf = vmmalloc.GrowableBuffer(64 << 30)              # VA only; memory mapped as it grows
    buf.resize(1 << 30)
    kv = vmmalloc.KVCache(layers=32, kv_heads=8, head_dim=128, max_seqs=64, max_tokens=4096)

ctypes over libvmmalloc.so (vmmalloc.h): nothing is compiled at import, and neither torch nor a GPU
is needed to import it (backend="host" runs on host memory with the driver's rules). Submodules,
imported on demand because they import their framework:
    vmmalloc.torch  vmmalloc as PyTorch's CUDA allocator (libvmmalloc_torch.so), its stats
    vmmalloc.cupy   vmmalloc as CuPy's allocator
    vmmalloc.hf     VmmCache: a transformers Cache whose K/V live in a vmmalloc KVCache
    vmmalloc.serve  Engine: continuous batching of a transformers decoder over a KVCache
    vmmalloc.batching  its scheduler (pure Python: admission, chunked prefill, preemption)
Errors: vmmalloc.Error (.status), OutOfMemoryError (also a MemoryError), InvalidValueError (also a
ValueError); their text is the C++ exception's message.
"""

from ._lib import Error, InvalidValueError, OutOfMemoryError, Status, find_library, last_error, library_path, load
from .buffer import GrowableBuffer
from .kv import KVCache

__all__ = ["GrowableBuffer", "KVCache", "Error", "OutOfMemoryError", "InvalidValueError", "Status",
           "find_library", "library_path", "load", "last_error"]
__version__ = "0.1.0"
