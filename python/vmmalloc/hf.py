# SPDX-License-Identifier: Apache-2.0
"""VmmCache: a transformers Cache whose keys and values live in a vmmalloc KVCache.

    from vmmalloc.hf import VmmCache
    cache = VmmCache(model.config, max_cache_len=8192)
    out = model.generate(input_ids, attention_mask=mask, past_key_values=cache, max_new_tokens=512)
    cache.reset()     # the generation is over: pages kept mapped for the next one
    ...
    cache.release()   # physical memory back to the device (the address range stays reserved)

How it maps onto transformers' Cache API (written against transformers 5.17's cache_utils.py,
checked at run time; 4.56+ has the same layered API with older signatures, also accepted):
  * One vmmalloc KVCache sequence holds the whole cache, packed token-major: a group of layers
    is one buffer (fused_kv) in which token t of its layers, K|V and rows lies together, as
    [token][layer][K|V][row][kv_heads][head_dim]. Pages are mapped only as tokens arrive, and the
    waste is under one 2 MiB page per group (a per-layer, per-row layout wastes up to a page per
    layer, K|V and row: 64 MiB for 16 layers at batch 1). Groups keep a group's token within
    64 KiB, the stride at which attention reads a layer: one group for 16 layers of 4 KV heads of
    64 in bf16 up to batch 4, two at batch 8 (a 128 KiB stride decoded 30 % slower at 16 k
    tokens). Every row is as long as the longest, as with DynamicCache's [batch, heads, tokens,
    dim] tensors. The cache is created at the first update (dtype, device, kv_heads and head_dim
    come from the key states); only virtual address space is reserved up front (~3 us, whatever
    the size).
  * Rows: max_batch_size of them, every token holds all (pass it only when a later batch grows:
    beam search expanding after the first update; None = the first update's batch, re-laid out
    when a later generation brings a larger batch). Left padding needs nothing special: pad
    positions are masked by transformers, so each new token is one append for every row.
  * Cache.layers holds one VmmLayer per model layer (CacheLayerMixin). update() appends the new
    tokens when this layer is the first to pass the current length (mapping pages only when the
    cache crosses a page), copies the key/value states in (one copy kernel each, the same as
    DynamicLayer's torch.cat minus the copy of the old tokens), and returns views [B, H, 0:len, D]
    of the same memory: last dimension contiguous, strides (kv_heads * head_dim, head_dim,
    token_stride, 1), accepted by SDPA (flash, efficient, math) and eager attention. Old tokens
    never move.
  * get_seq_length / get_mask_sizes / get_max_length behave as DynamicLayer's (kv_length = cached +
    query, offset 0), so masks and positions are the ones DynamicCache gets: same numbers.
  * reset() ends the generation (the sequence closed; with retain_closed, the default, its pages
    stay mapped and the next generation reuses them with no driver call); release() also returns
    the physical memory; crop() truncates every row; reorder_cache / batch_select_indices /
    batch_repeat_interleave gather rows (a copy, like DynamicLayer's index_select).
  * Not supported (clear errors): sliding-window, chunked or linear-attention layers, keys and
    values of different head sizes, offloading, torch.compile (is_compileable is False, so
    generate() does not compile), deepcopy.
Before anything is unmapped (reset, crop, release, a smaller batch) the device is synchronised:
kernels still reading the tokens must finish first.
"""

import weakref

try:
    import torch
except ImportError as e:  # pragma: no cover - depends on the machine
    raise ImportError("vmmalloc.hf needs torch: %s" % e) from e
try:
    import transformers
    from transformers.cache_utils import Cache, CacheLayerMixin
except ImportError as e:
    raise ImportError("vmmalloc.hf needs transformers with the layered Cache API (transformers.cache_utils."
                      "CacheLayerMixin: 4.56 or later; written for 5.x): %s" % e) from e

from ._lib import InvalidValueError, OutOfMemoryError, Status
from .kv import KVCache

__all__ = ["VmmCache", "VmmLayer"]

_TRANSFORMERS_MAJOR = int(str(getattr(transformers, "__version__", "5")).split(".")[0] or 5)


def _invalid(msg):
    return InvalidValueError(msg, Status.INVALID_VALUE)


class VmmLayer(CacheLayerMixin):
    """One model layer's view of a VmmCache. The rows (sequences) are shared by all layers, so
    crop / reset / reorder on a layer act on the whole cache."""

    is_compileable = False
    is_sliding = False
    is_croppable = True
    supports_early_init = True

    def __init__(self, cache, layer_idx):
        super().__init__()
        self._cache_ref = weakref.ref(cache)  # the cache owns its layers: no cycle
        self.layer_idx = layer_idx
        self.cached = 0  # tokens this layer holds (layers catch up one by one within a forward)

    @property
    def _cache(self):
        c = self._cache_ref()
        if c is None:
            raise _invalid("VmmLayer %d: its VmmCache is gone" % self.layer_idx)
        return c

    def __repr__(self):
        return "VmmLayer(%d, tokens=%d)" % (self.layer_idx, self.cached)

    # ---- CacheLayerMixin ---------------------------------------------------------------------

    def lazy_initialization(self, key_states, value_states=None):
        self._cache._lazy_init(key_states, key_states if value_states is None else value_states)
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        # *args / **kwargs: cache_kwargs in transformers 4.x, nothing in 5.x; nothing is needed.
        return self._cache._update(self.layer_idx, key_states, value_states)

    def get_mask_sizes(self, query_length, *args, **kwargs):
        # 5.x passes the query length; 4.x passes cache_position (its length is the query length).
        q = query_length if isinstance(query_length, int) else int(query_length.shape[0])
        return self.cached + q, 0

    def get_seq_length(self, *args, **kwargs):
        return self.cached

    def get_max_length(self):
        return self._cache._max_cache_len

    def get_max_cache_shape(self, *args, **kwargs):  # 4.x name
        return self._cache._max_cache_len

    @property
    def batch_size(self):
        return self._cache._batch

    @property
    def max_batch_size(self):
        return self._cache.max_batch_size

    @property
    def max_cache_len(self):
        return self._cache._max_cache_len

    def crop(self, tokens_to_remove):
        self._cache.crop(tokens_to_remove)

    def reset(self):
        self._cache.reset()

    def reorder_cache(self, beam_idx):
        self._cache.reorder_cache(beam_idx)

    def batch_repeat_interleave(self, repeats):
        self._cache.batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices):
        self._cache.batch_select_indices(indices)

    def offload(self):
        pass  # the memory is the cache's own mapping: nothing to move

    def prefetch(self):
        pass


class VmmCache(Cache):
    """A transformers Cache on a vmmalloc KVCache (see the module's docstring).

    config: the model's config (num_hidden_layers, max_position_embeddings; its layer types are
      checked: only full attention). Or num_layers without a config.
    max_batch_size: rows every token holds; None = the batch size of the first update (a later,
      larger batch re-lays the cache out between generations). Rows beyond the batch cost memory.
    max_cache_len: tokens per row (prompt + new tokens); None = config.max_position_embeddings.
      Costs only virtual address space: round_up(len x layers x 2 x rows x token bytes, 2 MiB).
    backend: "cuda" or "host"; None = from the key states' device (cpu -> host memory).
    retain_closed (default True): reset() keeps the pages mapped for the next generation.
    map_ahead_tokens / map_ahead_pages: a background thread maps pages ahead of the rows, so
      decoding makes no driver call (costs the memory mapped ahead).
    page_size: 0 = the granularity (2 MiB). pool_keep_pages: what release() keeps pooled (default 0).
    layer_groups: buffers the layers are packed into (a divisor of the layers); None = the fewest
      whose token stays within 64 KiB (attention reads a layer at that stride). Each costs up to a
      page of waste.
    """

    def __init__(self, config=None, max_batch_size=None, max_cache_len=None, num_layers=None, backend=None,
                 retain_closed=True, map_ahead_tokens=0, map_ahead_pages=0, page_size=0, pool_keep_pages=0,
                 host_physical_limit=0, layer_groups=None):
        dec = None
        if config is not None:
            dec = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
            _check_layer_types(dec)
            if num_layers is None:
                num_layers = dec.num_hidden_layers
            if max_cache_len is None:
                max_cache_len = getattr(dec, "max_position_embeddings", None)
        if not num_layers:
            raise _invalid("VmmCache: give the model's config or num_layers")
        if not max_cache_len:
            raise _invalid("VmmCache: give max_cache_len (the config has no max_position_embeddings)")
        if max_batch_size is not None and int(max_batch_size) <= 0:
            raise _invalid("VmmCache: max_batch_size must be > 0 (%r)" % (max_batch_size,))
        self._max_cache_len = int(max_cache_len)
        self._max_batch_size = None if max_batch_size is None else int(max_batch_size)
        self._rows_given = max_batch_size is not None  # else a larger later batch re-lays the cache out
        self._backend = backend
        self._kv_opts = dict(retain_closed=retain_closed, map_ahead_tokens=map_ahead_tokens,
                             map_ahead_pages=map_ahead_pages, page_size=page_size, pool_keep_pages=pool_keep_pages,
                             host_physical_limit=host_physical_limit)
        if layer_groups is not None and (int(layer_groups) <= 0 or int(num_layers) % int(layer_groups)):
            raise _invalid("VmmCache: layer_groups must divide the %d layers (%r)" % (int(num_layers), layer_groups))
        self._groups = None if layer_groups is None else int(layer_groups)
        self.layer_groups = self._groups  # the buffers used, once the first update laid the cache out
        self._kv = None        # the vmmalloc KVCache, made at the first update
        self._flat = None      # its reservation as a 1-D tensor of the cache's dtype
        self._full = None      # per layer: (K, V) views [max rows, H, max_cache_len, D] over _flat
        self._batch = 0        # rows in use (0: no generation open)
        self._tokens = 0       # tokens appended to every open row
        self._peak_mapped = 0  # bytes, over the cache's life
        layers = [VmmLayer(self, i) for i in range(int(num_layers))]
        try:
            super().__init__(layers=layers)
        except TypeError as e:
            raise ImportError("vmmalloc.hf: transformers %s's Cache takes no layers (the layered Cache API "
                              "came in 4.56): %s" % (transformers.__version__, e)) from e

    # ---- creation ----------------------------------------------------------------------------

    def _lazy_init(self, k, v):
        if k.dim() != 4:
            raise _invalid("VmmCache: key states must be [batch, heads, tokens, head_dim], not %s" % (tuple(k.shape),))
        B, H, _, D = k.shape
        if v.shape[-1] != D:
            raise NotImplementedError("VmmCache: keys (head_dim %d) and values (head_dim %d) of different sizes"
                                      % (D, v.shape[-1]))
        if self._kv is not None:
            self._check_states(None, k, v)
            return
        dev = k.device
        backend = self._backend or ("cuda" if dev.type == "cuda" else "host" if dev.type == "cpu" else None)
        if backend is None:
            raise NotImplementedError("VmmCache: tensors on %s (only cuda and cpu)" % dev)
        if (backend == "cuda") != (dev.type == "cuda"):
            raise _invalid("VmmCache: backend %r cannot hold tensors on %s" % (backend, dev))
        index = (dev.index if dev.index is not None else torch.cuda.current_device()) if dev.type == "cuda" else 0
        rows = self._max_batch_size or int(B)
        L = len(self.layers)
        G = self._groups or _auto_groups(L, 2 * rows * int(H) * int(D) * k.element_size())
        per = L // G
        # One sequence; each group of `per` layers is one buffer whose "heads" are its layers' K
        # and V rows' heads: token t of a group is [layer][K|V][row][head][dim].
        self._kv = KVCache(layers=G, kv_heads=per * 2 * rows * int(H), head_dim=int(D), max_seqs=1,
                           max_tokens=self._max_cache_len, dtype=k.dtype, backend=backend, device=index,
                           fused_kv=True, **self._kv_opts)
        self.layer_groups = G
        self._max_batch_size = rows
        self._dtype, self._device = k.dtype, torch.device("cuda", index) if dev.type == "cuda" else dev
        self._H, self._D = int(H), int(D)
        self._flat = self._kv.flat_tensor(k.dtype)
        st = self._kv.strides()
        hd = int(H) * int(D)
        strides = (hd, int(D), st[3], 1)  # [row, head, token, dim] (st[3]: elements per token of a group)
        offsets = [((l // per) * st[0] + 2 * (l % per) * rows * hd,
                    (l // per) * st[0] + (2 * (l % per) + 1) * rows * hd) for l in range(L)]
        # Every view of a layer (_view) narrows these: the strided layout is built once per layout.
        full = (rows, int(H), self._max_cache_len, int(D))
        self._full = [(torch.as_strided(self._flat, full, strides, ok), torch.as_strided(self._flat, full, strides, ov))
                      for ok, ov in offsets]

    def _check_states(self, layer, k, v):
        if k.dim() != 4 or v.shape != k.shape:
            raise _invalid("VmmCache%s: key states %s and value states %s must both be [batch, heads, tokens, "
                           "head_dim]" % (_at(layer), tuple(k.shape), tuple(v.shape)))
        if k.shape[1] != self._H or k.shape[3] != self._D:
            raise _invalid("VmmCache%s: states have %d heads of %d; the cache holds %d heads of %d"
                           % (_at(layer), k.shape[1], k.shape[3], self._H, self._D))
        if k.dtype != self._dtype or v.dtype != self._dtype:
            raise _invalid("VmmCache%s: states of dtype %s / %s; the cache holds %s"
                           % (_at(layer), k.dtype, v.dtype, self._dtype))
        if k.device != self._device or v.device != self._device:
            raise _invalid("VmmCache%s: states on %s / %s; the cache is on %s" % (_at(layer), k.device, v.device,
                                                                                  self._device))

    # ---- the update path ---------------------------------------------------------------------

    def _view(self, layer, kind, rows, start, n):
        """[rows, H, n, D] over tokens [start, start + n) of K (kind 0) or V (1) of a layer."""
        t = self._full[layer][kind]
        if rows != self._max_batch_size:
            t = t.narrow(0, 0, rows)
        return t.narrow(2, start, n)

    def _update(self, l, k, v):
        layer = self.layers[l]
        if not layer.is_initialized or self._kv is None:
            layer.lazy_initialization(k, v)
        self._check_states(l, k, v)
        B, n = int(k.shape[0]), int(k.shape[2])
        if self._batch == 0:
            if B > self._max_batch_size and not self._rows_given:
                self._relayout(k, v)
            self._open_rows(B)
        elif B != self._batch:
            raise _invalid("VmmCache (layer %d): batch of %d rows, but %d are open; call reset() between "
                           "generations" % (l, B, self._batch))
        old = layer.cached
        new = old + n
        if new > self._tokens:
            self._grow(new)
        if n:
            # K and V in one op: a decode step's two writes are one multi-tensor kernel instead of
            # two copies (each a cudaMemcpyAsync, ~12 us of host time, 32 a step at 16 layers).
            _copy2(self._view(l, 0, B, old, n), self._view(l, 1, B, old, n), k, v)
        keys, values = self._view(l, 0, B, 0, new), self._view(l, 1, B, 0, new)
        layer.keys, layer.values, layer.cached = keys, values, new
        return keys, values

    def _relayout(self, k, v):
        """Between generations, a larger batch than the cache was laid out for: a new layout with
        that many rows (the old pages are released: every token holds every row)."""
        self._sync()
        self._note_peak()
        self._kv.destroy()
        self._kv, self._flat, self._full, self._max_batch_size = None, None, None, None
        self._lazy_init(k, v)

    def _open_rows(self, B):
        rows = self._max_batch_size
        if B > rows:
            raise OutOfMemoryError("VmmCache: a batch of %d rows exceeds max_batch_size %d" % (B, rows),
                                   Status.OUT_OF_MEMORY)
        self._kv.open(0)
        self._batch = B

    def _grow(self, new):
        """Appends tokens up to `new` (every row: they share each token's pages); all or nothing."""
        kv = self._kv
        kv.append(0, new - self._tokens)
        before = kv.pages_for(self._tokens)
        self._tokens = new
        if kv.pages_for(new) != before:  # pages were mapped: one stats call, not one per token
            self._note_peak()

    def _note_peak(self):
        if self._kv is not None:
            self._peak_mapped = max(self._peak_mapped, self._kv.stats()["mapped_bytes"])

    def _sync(self):
        if self._kv is not None and self._device.type == "cuda":
            torch.cuda.synchronize(self._device)

    # ---- Cache -------------------------------------------------------------------------------

    def get_seq_length(self, layer_idx=0):
        if layer_idx >= len(self.layers):
            return 0
        return self.layers[layer_idx].cached

    def get_mask_sizes(self, query_length, layer_idx=0):
        if layer_idx >= len(self.layers):
            q = query_length if isinstance(query_length, int) else int(query_length.shape[0])
            return q, 0
        return self.layers[layer_idx].get_mask_sizes(query_length)

    def get_max_length(self, layer_idx=None):
        return self._max_cache_len

    def get_max_cache_shape(self, layer_idx=0):  # 4.x name
        return self._max_cache_len

    @property
    def max_cache_len(self):
        return self._max_cache_len

    @property
    def max_batch_size(self):
        return self._max_batch_size if self._max_batch_size is not None else -1

    def reset(self):
        """Ends every sequence: rows closed, lengths 0. With retain_closed (default) the pages stay
        mapped in their slots and the next generation reuses them without a driver call."""
        if self._kv is not None and self._batch:
            self._sync()
            self._note_peak()
            self._kv.close(0)
        self._batch = 0
        self._tokens = 0
        for layer in self.layers:
            layer.cached = 0
            layer.keys = layer.values = None

    def release(self, keep_pages=0):
        """reset() and return the physical memory (pooled and retained pages beyond keep_pages).
        The address range stays reserved for the next generation. Returns the pages released."""
        self.reset()
        return self._kv.trim(keep_pages) if self._kv is not None else 0

    def destroy(self):
        """Unmaps and releases everything and frees the reservation; the next update starts over."""
        if self._kv is not None:
            self._sync()
            self._note_peak()
        self._batch = 0
        self._tokens = 0
        for layer in self.layers:
            layer.cached = 0
            layer.keys = layer.values = None
            layer.is_initialized = False
        self._flat = self._full = None
        if self._kv is not None:
            self._kv.destroy()
            self._kv = None

    def crop(self, tokens_to_remove):
        """Shortens every row. Negative: removes that many tokens; positive: keeps that many (the
        legacy meaning); 0: nothing (transformers 5), or everything (transformers 4)."""
        n = int(tokens_to_remove)
        cur = self._tokens
        if n < 0:
            new = max(cur + n, 0)
        elif n == 0:
            new = 0 if _TRANSFORMERS_MAJOR < 5 else cur
        else:
            new = min(n, cur)
        if new >= cur or self._kv is None:
            return
        self._sync()
        if self._batch:
            self._kv.truncate(0, new)
        self._tokens = new
        for l, layer in enumerate(self.layers):
            layer.cached = min(layer.cached, new)
            if layer.keys is not None:
                layer.keys = self._view(l, 0, self._batch, 0, layer.cached)
                layer.values = self._view(l, 1, self._batch, 0, layer.cached)

    def reorder_cache(self, beam_idx):
        self._gather(beam_idx)

    def batch_select_indices(self, indices):
        self._gather(indices)

    def batch_repeat_interleave(self, repeats):
        if self._batch:
            self._gather(torch.arange(self._batch, device=self._device).repeat_interleave(int(repeats)))

    def _gather(self, index):
        """Row r becomes old row index[r] in every layer (a copy through a temporary)."""
        if self._kv is None or self._batch == 0:
            return
        idx = torch.as_tensor(index, device=self._device)
        if idx.dtype == torch.bool:
            idx = idx.nonzero().flatten()
        idx = idx.long().flatten()
        new_b, old_b = int(idx.numel()), self._batch
        if new_b > self._max_batch_size:
            raise OutOfMemoryError("VmmCache: %d rows exceed max_batch_size %d" % (new_b, self._max_batch_size),
                                   Status.OUT_OF_MEMORY)
        if new_b and (int(idx.min()) < 0 or int(idx.max()) >= old_b):
            raise _invalid("VmmCache: row index out of range (%d rows open)" % old_b)
        if new_b == 0:
            self.reset()
            return
        saved = [(self._view(l, 0, old_b, 0, layer.cached).index_select(0, idx),
                  self._view(l, 1, old_b, 0, layer.cached).index_select(0, idx)) if layer.cached else None
                 for l, layer in enumerate(self.layers)]
        self._batch = new_b  # rows share every token's pages: nothing to map or unmap
        for l, layer in enumerate(self.layers):
            if saved[l] is None:
                continue
            k, v = saved[l]
            self._view(l, 0, new_b, 0, layer.cached).copy_(k)
            self._view(l, 1, new_b, 0, layer.cached).copy_(v)
            layer.keys = self._view(l, 0, new_b, 0, layer.cached)
            layer.values = self._view(l, 1, new_b, 0, layer.cached)

    # ---- vmmalloc's side ---------------------------------------------------------------------

    @property
    def kv(self):
        """The vmmalloc KVCache (None before the first update)."""
        return self._kv

    def memory(self):
        """{"mapped_bytes", "used_bytes", "peak_mapped_bytes", "reserved_bytes", "pages_mapped",
        "pages_pooled", "pages_retained", "driver_calls", "rows", "tokens"}: what the cache holds now
        and the most it mapped (bytes of the device's memory: not in torch.cuda.memory_allocated)."""
        if self._kv is None:
            return {"mapped_bytes": 0, "used_bytes": 0, "peak_mapped_bytes": self._peak_mapped, "reserved_bytes": 0,
                    "pages_mapped": 0, "pages_pooled": 0, "pages_retained": 0, "driver_calls": 0, "rows": 0,
                    "tokens": 0}
        s = self._kv.stats()
        self._peak_mapped = max(self._peak_mapped, s["mapped_bytes"])
        return {"mapped_bytes": s["mapped_bytes"], "used_bytes": s["used_bytes"],
                "peak_mapped_bytes": self._peak_mapped, "reserved_bytes": self._kv.reserved,
                "pages_mapped": s["pages_mapped"], "pages_pooled": s["pages_pooled"],
                "pages_retained": s["pages_retained"], "driver_calls": s["driver_calls"], "rows": self._batch,
                "tokens": self._tokens}

    def __repr__(self):
        return "VmmCache(layers=%d, rows=%d, tokens=%d, max_batch_size=%s, max_cache_len=%d)" % (
            len(self.layers), self._batch, self._tokens, self._max_batch_size, self._max_cache_len)

    def __deepcopy__(self, memo):
        raise NotImplementedError("VmmCache cannot be deep-copied: its memory is one vmmalloc reservation "
                                  "(copy the tensors of cache.layers[i].keys / values instead)")

    def __copy__(self):
        raise NotImplementedError("VmmCache cannot be copied: its memory is one vmmalloc reservation")

    def __reduce__(self):
        raise TypeError("VmmCache cannot be pickled: its memory is one vmmalloc reservation")


# Attention reads one layer's tokens at the group's token stride. At 16,384 new tokens, batch 8, on
# an H200: a 64 KiB stride decoded as fast as DynamicCache, a 128 KiB stride 30 % slower. Groups
# cost up to one 2 MiB page each of mapped waste.
_MAX_GROUP_TOKEN_BYTES = 64 << 10


_FOREACH_COPY = getattr(torch, "_foreach_copy_", None)


def _copy2(dk, dv, k, v):
    """dk <- k and dv <- v (torch's multi-tensor copy where it has one)."""
    if _FOREACH_COPY is not None:
        _FOREACH_COPY([dk, dv], [k, v])
    else:  # pragma: no cover - torch before 2.1
        dk.copy_(k)
        dv.copy_(v)


def _auto_groups(layers, layer_token_bytes):
    """The fewest layer groups (a divisor of layers) whose token is at most 64 KiB."""
    for g in range(1, layers + 1):
        if layers % g == 0 and (layers // g) * layer_token_bytes <= _MAX_GROUP_TOKEN_BYTES:
            return g
    return layers


def _at(layer):
    return "" if layer is None else " (layer %d)" % layer


def _check_layer_types(cfg):
    """Only full attention: a sliding window, chunked or linear-attention layer keeps a different
    set of tokens, which this cache does not model."""
    types = getattr(cfg, "layer_types", None)
    if types:
        other = sorted(set(t for t in types if t != "full_attention"))
        if other:
            raise NotImplementedError("VmmCache: layer types %s are not supported (only full_attention)" % other)
    elif getattr(cfg, "sliding_window", None) is not None and getattr(cfg, "use_sliding_window", True):
        raise NotImplementedError("VmmCache: sliding-window attention (config.sliding_window=%s) is not supported"
                                  % cfg.sliding_window)
    elif getattr(cfg, "attention_chunk_size", None) is not None:
        raise NotImplementedError("VmmCache: chunked attention is not supported")
    if getattr(cfg, "num_kv_shared_layers", None):
        raise NotImplementedError("VmmCache: shared KV layers (num_kv_shared_layers) are not supported")
