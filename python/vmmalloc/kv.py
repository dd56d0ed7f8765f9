# SPDX-License-Identifier: Apache-2.0
"""vmmalloc.KVCache: a paged KV cache whose sequences stay virtually contiguous (vmm::kv_cache).

    kv = vmmalloc.KVCache(layers=32, kv_heads=8, head_dim=128, max_seqs=64, max_tokens=4096)
    s = kv.open()                       # a free slot: its index is its batch row
    kv.append(s, 1500)                  # maps the pages 1500 tokens need, in every layer
    k0 = kv.k(s, 0, torch.bfloat16)     # layer 0's K of s: [1500, 8, 128], no copy
    kv.append(s, 1)                     # k0's memory stays where it is; kv.k(s, 0) is now 1501 long
    kv.close(s)                         # the pages go to a pool (or stay mapped: retain_closed)

Layout (kv_cache.hpp): one reservation; T = token_bytes = kv_heads * head_dim * elem_bytes,
S = seq_stride. Token t of sequence s, layer l: K at base + l*layer_stride + s*S + t*token_stride,
V kv_stride further. layout="per_layer": a buffer per (layer, K|V) (token_stride T, layer_stride
2B, kv_stride B, B = buffer_stride = max_seqs * S); layout="per_sequence": one buffer per sequence,
a token's K and V of every layer side by side (token_stride 2 * layers * T, layer_stride 2T,
kv_stride T), so a sequence wastes at most one partly filled page. base_tensor() is the whole
layout as one torch tensor [layers, 2, max_seqs, max_tokens, kv_heads, head_dim] (the last
dimension contiguous): only the bytes of appended tokens are mapped, so only those may be touched.

share_prefix(src, n) opens a sequence whose first n tokens are src's: its whole pages are mapped
again (read-only, no copy), and the tokens past shared_tokens are copied by copy_prefix().

Errors carry the C++ messages: OutOfMemoryError past max_tokens, past physical memory or with every
slot open; InvalidValueError for an unknown or closed sequence, or a wrong dtype or shape.
"""

import ctypes

from . import _dlpack
from ._lib import (KV_KEEP_DEFAULT, InvalidValueError, KVConfig, KVLayout, KVSeqInfo, KVStats, Status,
                   backend_value, check, int_array, load, struct_dict)
from ._owner import Owner, _Handle
from .buffer import _size

__all__ = ["KVCache"]


def _invalid(msg):
    return InvalidValueError(msg, Status.INVALID_VALUE)


class KVCache(Owner):
    """A KV cache of `layers` x (K, V) buffers of `max_seqs` rows of `max_tokens` tokens.

    dtype: a torch dtype (sets elem_bytes and the default dtype of views), or elem_bytes alone.
    backend "cuda" (device `device`) or "host" (no GPU). page_size: 0 = the granularity (2 MiB).
    map_ahead_pages / map_ahead_tokens: a background thread keeps pages mapped ahead of each open
    sequence, so append() makes no driver call while it keeps up (costs the memory mapped ahead).
    retain_closed: close() keeps a slot's pages mapped for the next open() of it.
    pool_keep_pages: what trim() keeps. peers: devices granted read-write access too.
    fused_kv: one buffer per layer (no V: the caller lays K and V out in each token, kv_heads
    counting both), so a sequence rounds up half as many buffers to a page. layout: "per_layer"
    (default) or "per_sequence" (one buffer per sequence: at most one partly filled page each)."""

    _gone = "the cache was destroyed"

    def __init__(self, layers, kv_heads, head_dim, max_seqs, max_tokens, elem_bytes=None, dtype=None,
                 backend="cuda", device=0, page_size=0, map_ahead_pages=0, map_ahead_tokens=0, pool_keep_pages=0,
                 retain_closed=False, peers=(), host_granularity=0, host_physical_limit=0, fused_kv=False,
                 layout="per_layer"):
        if dtype is not None:
            size = _itemsize(dtype)
            if elem_bytes is not None and int(elem_bytes) != size:
                raise _invalid("vmmalloc.KVCache: elem_bytes=%d but dtype %s has %d bytes" % (elem_bytes, dtype, size))
            elem_bytes = size
        lib = load()
        c = KVConfig()
        lib.vmm_kv_config_init(ctypes.byref(c))
        c.backend = backend_value(backend)
        c.device = int(device)
        for name, v in (("layers", layers), ("kv_heads", kv_heads), ("head_dim", head_dim), ("max_seqs", max_seqs),
                        ("max_tokens", max_tokens), ("page_size", page_size), ("map_ahead_pages", map_ahead_pages),
                        ("map_ahead_tokens", map_ahead_tokens), ("pool_keep_pages", pool_keep_pages),
                        ("host_granularity", host_granularity), ("host_physical_limit", host_physical_limit)):
            setattr(c, name, _size(v, name))
        if elem_bytes is not None:
            c.elem_bytes = _size(elem_bytes, "elem_bytes")
        c.retain_closed = 1 if retain_closed else 0
        c.fused_kv = 1 if fused_kv else 0
        layouts = {"per_layer": 0, "per_sequence": 1}
        if layout not in layouts:
            raise _invalid("vmmalloc.KVCache: layout must be \"per_layer\" or \"per_sequence\", not %r" % (layout,))
        c.layout = layouts[layout]
        self.fused_kv = bool(fused_kv)
        self._nkv = 1 if fused_kv else 2  # buffers per layer
        arr, n = int_array(peers)
        c.peers = ctypes.cast(arr, ctypes.POINTER(ctypes.c_int)) if arr is not None else None
        c.peer_count = n
        out = ctypes.c_void_p()
        check(lib.vmm_kv_create(ctypes.byref(c), ctypes.byref(out)))
        self._lib = lib
        self._h = _Handle(out.value, lib.vmm_kv_destroy)
        self.backend = str(backend).lower()
        self.device = int(device)
        self.dtype = dtype
        lay = KVLayout()
        check(lib.vmm_kv_get_layout(out.value, ctypes.byref(lay)))
        self.layout = struct_dict(lay)  # fixed for the cache's life
        for k in ("layers", "kv_heads", "head_dim", "elem_bytes", "max_seqs", "max_tokens", "token_bytes",
                  "seq_stride", "buffer_stride", "page_size", "reserved", "token_stride", "layer_stride",
                  "kv_stride"):
            setattr(self, k, self.layout[k])
        self.layout_kind = layout
        self._bytes = None  # torch.uint8 over the whole reservation, made on first use
        self._flat = {}     # dtype -> 1-D typed view of it

    @classmethod
    def host(cls, *args, **kw):
        """On the host backend (no GPU needed)."""
        kw["backend"] = "host"
        return cls(*args, **kw)

    # ---- life ------------------------------------------------------------------------------

    def destroy(self):
        """Unmaps and releases every page and frees the reservation now. Views become dangling."""
        self._bytes = None
        self._flat = {}
        self._free_handle()

    # ---- sequences -------------------------------------------------------------------------

    def open(self, slot=None):
        """Opens a sequence of 0 tokens in the lowest free slot (retain_closed: the closed slot with
        the most pages mapped), or in `slot`. Returns its slot."""
        p = self._ptr("open")
        if slot is None:
            s = ctypes.c_size_t()
            check(self._lib.vmm_kv_open(p, ctypes.byref(s)))
            return s.value
        check(self._lib.vmm_kv_open_slot(p, _size(slot, "slot")))
        return int(slot)

    def append(self, seq, n):
        """Adds n tokens to seq (mapping the pages they need); returns where they start."""
        old = ctypes.c_size_t()
        check(self._lib.vmm_kv_append(self._ptr("append"), _size(seq, "seq"), _size(n, "n"), ctypes.byref(old)))
        return old.value

    def truncate(self, seq, n):
        """Shortens seq to n tokens; unmaps the pages past them. The caller makes sure no GPU work
        still reads those tokens."""
        check(self._lib.vmm_kv_truncate(self._ptr("truncate"), _size(seq, "seq"), _size(n, "n")))

    def close(self, seq):
        """Ends seq; its slot becomes free (pages pooled, or kept mapped with retain_closed)."""
        check(self._lib.vmm_kv_close(self._ptr("close"), _size(seq, "seq")))

    def share_prefix(self, src, tokens):
        """Opens a sequence of `tokens` tokens of src (<= its length) in the lowest free slot: src's
        whole pages of them are mapped again, read-only, with no copy; tokens [shared_tokens,
        tokens) (seq_info) sit in its own pages, for copy_prefix() or the caller to fill. Closing
        or truncating either never frees a page the other maps. Returns the new slot."""
        out = ctypes.c_size_t()
        check(self._lib.vmm_kv_share_prefix(self._ptr("share_prefix"), _size(src, "src"), _size(tokens, "tokens"),
                                            ctypes.byref(out)))
        return out.value

    def copy_prefix(self, src, dst):
        """Copies the tokens of dst (made by share_prefix(src, n)) that are not shared, from src, in
        every layer's K and V (torch; on the host backend, memmove). Returns how many."""
        info = self.seq_info(dst)
        first, n = info["shared_tokens"], self.length(dst, "copy_prefix")
        if n > self.length(src, "copy_prefix"):
            raise _invalid("vmmalloc.KVCache.copy_prefix: sequence %d has %d tokens, more than %d's" % (dst, n, src))
        if first == n:
            return 0
        if self.backend == "host":
            for layer in range(self.layers):
                for kind in (("k",) if self.fused_kv else ("k", "v")):
                    a, b = self._kv_ptr(src, layer, kind, "copy_prefix"), self._kv_ptr(dst, layer, kind, "copy_prefix")
                    for t in range(first, n):
                        ctypes.memmove(b + t * self.token_stride, a + t * self.token_stride, self.token_bytes)
            return n - first
        base = self.base_tensor()
        base[:, :, dst, first:n].copy_(base[:, :, src, first:n])
        return n - first

    def trim(self, keep_pages=None):
        """Releases pooled pages beyond keep_pages (None: the config's pool_keep_pages); with
        retain_closed, closed slots' pages first go to the pool. Returns how many were released."""
        out = ctypes.c_size_t()
        keep = KV_KEEP_DEFAULT if keep_pages is None else _size(keep_pages, "keep_pages")
        check(self._lib.vmm_kv_trim(self._ptr("trim"), keep, ctypes.byref(out)))
        return out.value

    def wait_map_ahead(self):
        """Blocks until the map-ahead thread is idle (no-op without it)."""
        check(self._lib.vmm_kv_wait_map_ahead(self._ptr("wait_map_ahead")))

    def seq_info(self, seq):
        """{"open", "length", "mapped_pages", "capacity"} of a slot (zeros for a free one)."""
        i = KVSeqInfo()
        check(self._lib.vmm_kv_get_seq(self._ptr("seq_info"), _size(seq, "seq"), ctypes.byref(i)))
        d = struct_dict(i)
        d["open"] = bool(d["open"])
        return d

    def is_open(self, seq):
        return self.seq_info(seq)["open"]

    def length(self, seq, what="length"):
        """Tokens in seq; InvalidValueError when it is not open."""
        i = self.seq_info(seq)
        if not i["open"]:
            raise _invalid("vmmalloc.KVCache.%s: sequence %d is not open" % (what, seq))
        return i["length"]

    def stats(self):
        """Counters and current state (kv_cache_stats), plus the host backend's live objects."""
        s = KVStats()
        check(self._lib.vmm_kv_get_stats(self._ptr("stats"), ctypes.byref(s)))
        return struct_dict(s)

    def pages_for(self, tokens):
        """Pages (per buffer) that `tokens` tokens need: ceil(tokens * token_stride / page_size)."""
        return (int(tokens) * self.token_stride + self.page_size - 1) // self.page_size

    # ---- addresses -------------------------------------------------------------------------

    def k_ptr(self, seq, layer):
        """Address of layer's K of slot seq (any slot: only its mapped bytes may be touched)."""
        out = ctypes.c_void_p()
        check(self._lib.vmm_kv_k(self._ptr("k_ptr"), _size(seq, "seq"), _size(layer, "layer"), ctypes.byref(out)))
        return out.value or 0

    def v_ptr(self, seq, layer):
        out = ctypes.c_void_p()
        check(self._lib.vmm_kv_v(self._ptr("v_ptr"), _size(seq, "seq"), _size(layer, "layer"), ctypes.byref(out)))
        return out.value or 0

    # ---- torch views -----------------------------------------------------------------------

    def _dtype(self, dtype, what):
        import torch

        dtype = dtype if dtype is not None else self.dtype
        if dtype is None:
            dtype = {1: torch.uint8, 2: torch.float16, 4: torch.float32, 8: torch.float64}.get(self.elem_bytes)
            if dtype is None:
                raise _invalid("vmmalloc.KVCache.%s: give a dtype (elem_bytes=%d)" % (what, self.elem_bytes))
        _dlpack.check_dtype(dtype, self.elem_bytes, "vmmalloc.KVCache." + what)
        return dtype

    def flat_tensor(self, dtype=None):
        """The whole reservation as a 1-D torch tensor of `dtype` (raw: mostly unmapped)."""
        self._ptr("flat_tensor")
        dtype = self._dtype(dtype, "flat_tensor")
        t = self._flat.get(dtype)
        if t is None:
            if self._bytes is None:
                dev = self.device if self.backend == "cuda" else None
                self._bytes = _dlpack.byte_tensor(self.layout["base"], self.reserved, dev, self._h)
            t = self._flat[dtype] = self._bytes.view(dtype)
        return t

    def strides(self):
        """Element strides (layer, K|V, seq, token, head, dim) of base_tensor()."""
        e = self.elem_bytes
        return (self.layer_stride // e, self.kv_stride // e, self.seq_stride // e, self.token_stride // e,
                self.head_dim, 1)

    def base_tensor(self, dtype=None):
        """[layers, 2, max_seqs, max_tokens, kv_heads, head_dim] over the whole layout (index 0 of
        the second dimension is K, 1 is V; fused_kv: 1 long). Raw: touch only appended tokens."""
        import torch

        f = self.flat_tensor(dtype)
        shape = (self.layers, self._nkv, self.max_seqs, self.max_tokens, self.kv_heads, self.head_dim)
        return torch.as_strided(f, shape, self.strides(), 0)

    def _region(self, seq, layer, kv, dtype, what):
        import torch

        n = self.length(seq, what)
        if not 0 <= int(layer) < self.layers:
            raise _invalid("vmmalloc.KVCache.%s: layer %d is out of range (layers %d)" % (what, layer, self.layers))
        if kv and self.fused_kv:
            raise _invalid("vmmalloc.KVCache.%s: fused_kv: the layer's one buffer holds K and V (use k)" % what)
        f = self.flat_tensor(self._dtype(dtype, what))
        st = self.strides()
        off = int(layer) * st[0] + kv * st[1] + int(seq) * st[2]
        return torch.as_strided(f, (n, self.kv_heads, self.head_dim), st[3:], off)

    def k(self, seq, layer, dtype=None):
        """Layer's K of seq: a torch tensor [length, kv_heads, head_dim] over its tokens, no copy.
        A later append does not lengthen it: take a new view (same memory, same address)."""
        return self._region(seq, layer, 0, dtype, "k")

    def v(self, seq, layer, dtype=None):
        return self._region(seq, layer, 1, dtype, "v")

    # ---- host views and copies (no torch needed) ------------------------------------------

    def memoryview(self, seq, layer, kind="k", fmt=None):
        """Host backend: tokens [0, length) of layer's K (kind "k") or V ("v") of seq as a writable
        memoryview: bytes, or with `fmt` (a struct code of elem_bytes bytes, e.g. "e" or "H") shaped
        [length, kv_heads, head_dim]."""
        if self.backend != "host":
            raise _invalid("vmmalloc.KVCache.memoryview: CUDA memory; use k() / v() (torch)")
        if self.token_stride != self.token_bytes:
            raise _invalid("vmmalloc.KVCache.memoryview: layout=\"per_sequence\": a layer's tokens are strided; "
                           "use k() / v() (torch) or store()")
        n = self.length(seq, "memoryview")
        ptr = self._kv_ptr(seq, layer, kind, "memoryview")
        nbytes = n * self.token_bytes
        if not nbytes:
            mv = memoryview(bytearray())
        else:
            arr = (ctypes.c_char * nbytes).from_address(ptr)
            arr._vmm_owner = self._h
            mv = memoryview(arr).cast("B")
        if fmt is None:
            return mv
        if ctypes.sizeof(_struct_ctype(fmt)) != self.elem_bytes:
            raise _invalid("vmmalloc.KVCache.memoryview: format %r has %d bytes per element; the cache was made "
                           "with elem_bytes=%d" % (fmt, ctypes.sizeof(_struct_ctype(fmt)), self.elem_bytes))
        return mv.cast(fmt, (n, self.kv_heads, self.head_dim)) if n else mv.cast(fmt)

    def _kv_ptr(self, seq, layer, kind, what):
        if kind not in ("k", "v"):
            raise _invalid("vmmalloc.KVCache.%s: kind must be \"k\" or \"v\", not %r" % (what, kind))
        if not 0 <= int(layer) < self.layers:
            raise _invalid("vmmalloc.KVCache.%s: layer %d is out of range (layers %d)" % (what, layer, self.layers))
        return self.k_ptr(seq, layer) if kind == "k" else self.v_ptr(seq, layer)

    def store(self, seq, layer, start, k=None, v=None):
        """Copies tokens into layer's K and/or V of seq at [start, start + n). k and v: torch tensors
        [n, kv_heads, head_dim] of the cache's element size (any backend), or, on the host backend,
        objects with the buffer protocol ([n, kv_heads, head_dim] or flat, elem_bytes per item).
        The tokens must have been appended: this never maps. Returns n."""
        n_ret = None
        for kind, x in (("k", k), ("v", v)):
            if x is None:
                continue
            n = self._store_one(seq, layer, int(start), kind, x)
            if n_ret is not None and n != n_ret:
                raise _invalid("vmmalloc.KVCache.store: k has %d tokens but v has %d" % (n_ret, n))
            n_ret = n
        if n_ret is None:
            raise _invalid("vmmalloc.KVCache.store: give k, v or both")
        return n_ret

    def _store_one(self, seq, layer, start, kind, x):
        what = "store"
        length = self.length(seq, what)
        H, D = self.kv_heads, self.head_dim
        if type(x).__module__.startswith("torch"):
            if tuple(x.shape[-2:]) != (H, D) or x.dim() != 3:
                raise _invalid("vmmalloc.KVCache.store: %s has shape %s; expected [n, %d, %d]"
                               % (kind, tuple(x.shape), H, D))
            if self.dtype is not None and x.dtype != self.dtype:
                raise _invalid("vmmalloc.KVCache.store: %s is %s; the cache holds %s" % (kind, x.dtype, self.dtype))
            n = x.shape[0]
            self._check_range(seq, start, n, length)
            dst = self._region(seq, layer, 0 if kind == "k" else 1, x.dtype, what)
            dst[start:start + n].copy_(x)
            return n
        mv = memoryview(x)
        if mv.itemsize != self.elem_bytes:
            raise _invalid("vmmalloc.KVCache.store: %s has %d bytes per element; the cache was made with "
                           "elem_bytes=%d" % (kind, mv.itemsize, self.elem_bytes))
        if (mv.ndim == 3 and tuple(mv.shape[1:]) != (H, D)) or mv.ndim not in (1, 3):
            raise _invalid("vmmalloc.KVCache.store: %s has shape %s; expected [n, %d, %d] or flat"
                           % (kind, tuple(mv.shape), H, D))
        count = mv.nbytes // self.elem_bytes
        if count % (H * D):
            raise _invalid("vmmalloc.KVCache.store: %s holds %d elements, not a whole number of tokens of %d"
                           % (kind, count, H * D))
        n = count // (H * D)
        self._check_range(seq, start, n, length)
        if self.backend != "host":
            raise _invalid("vmmalloc.KVCache.store: CUDA memory; give torch tensors")
        ptr = self._kv_ptr(seq, layer, kind, what) + start * self.token_stride
        data = bytes(mv.cast("B"))
        if self.token_stride == self.token_bytes:
            ctypes.memmove(ptr, data, mv.nbytes)
        else:  # per_sequence: token by token
            T = self.token_bytes
            for i in range(n):
                ctypes.memmove(ptr + i * self.token_stride, data[i * T:(i + 1) * T], T)
        return n

    def _check_range(self, seq, start, n, length):
        if start < 0 or start + n > length:
            raise _invalid("vmmalloc.KVCache.store: tokens [%d, %d) are past sequence %d's length %d (append "
                           "first)" % (start, start + n, seq, length))

    def __repr__(self):
        if self.closed:
            return "KVCache(destroyed)"
        s = self.stats()
        return ("KVCache(%s, layers=%d, kv_heads=%d, head_dim=%d, max_seqs=%d, max_tokens=%d, open=%d, "
                "mapped=%d bytes)" % (self.backend, self.layers, self.kv_heads, self.head_dim, self.max_seqs,
                                      self.max_tokens, s["open_seqs"], s["mapped_bytes"]))


def _itemsize(dtype):
    if hasattr(dtype, "itemsize"):
        return int(dtype.itemsize)
    import torch

    return torch.empty((), dtype=dtype).element_size()


def _struct_ctype(fmt):
    table = {"b": ctypes.c_int8, "B": ctypes.c_uint8, "h": ctypes.c_int16, "H": ctypes.c_uint16,
             "e": ctypes.c_uint16, "i": ctypes.c_int32, "I": ctypes.c_uint32, "f": ctypes.c_float,
             "q": ctypes.c_int64, "Q": ctypes.c_uint64, "d": ctypes.c_double}
    if fmt not in table:
        raise _invalid("vmmalloc.KVCache.memoryview: unsupported format %r" % (fmt,))
    return table[fmt]
