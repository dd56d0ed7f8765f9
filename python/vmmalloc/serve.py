# SPDX-License-Identifier: Apache-2.0
"""vmmalloc.serve: continuous batching of a transformers decoder whose KV cache is a vmmalloc
KVCache, read in place.

    from vmmalloc.serve import Engine
    engine = Engine(model, kv_budget_bytes=8 << 30, max_batch_tokens=4096)
    rid = engine.add(prompt_ids, max_new_tokens=256)   # whenever a request arrives
    while engine.pending():
        for req in engine.step():                       # one forward of the running batch
            print(req.id, req.output)
    # or: outputs = engine.generate(prompts, max_new_tokens)   # {id: [token ids]}

Greedy decoding (argmax), as generate(do_sample=False). The scheduler is vmmalloc.batching's
(admission, chunked prefill, preemption by recompute within the KV budget).

The model: a Llama-style decoder of transformers (LlamaForCausalLM, Mistral, Qwen2 and Qwen3
without sliding windows): embed_tokens, layers of input_layernorm / self_attn (q_proj, k_proj,
v_proj, o_proj, optional q_norm / k_norm) / post_attention_layernorm / mlp, norm, lm_head, rotary
embeddings. The engine runs those modules itself over one packed batch of every entry's tokens:
each layer writes the step's K and V (after rotary) into the cache with one index_copy_ each, and
one attention call reads every sequence's K and V where they lie. The cache uses the
per_sequence layout (one partly filled 2 MiB page per sequence), so sequence slot s's tokens of
layer l are rows s * rows_per_seq + t of one strided [rows, kv_heads, head_dim] view per layer (the
cache's max_tokens is rounded up so that a sequence's stride is whole tokens: address space only).

Attention ("auto"): FlashAttention's variable-length kernel (torch.ops.aten._flash_attention_forward
with seqused_k: each sequence starts at its slot's row and reads only its own tokens; causal with
the query at the end of the keys, which covers prefill chunks and decodes); checked at start
against scaled_dot_product_attention on a small case and used when it agrees; "sdpa" (and fp32,
which flash does not take): scaled_dot_product_attention per sequence over the same strided views.
Neither gathers the cache.

Memory: the cache holds at most kv_budget_bytes of pages (the scheduler counts them); activations
are the model's for max_batch_tokens tokens, from torch's allocator.
"""

import sys

try:
    import torch
    import torch.nn.functional as F
except ImportError as e:  # pragma: no cover - depends on the machine
    raise ImportError("vmmalloc.serve needs torch: %s" % e) from e

from ._lib import InvalidValueError, Status
from .batching import Scheduler, whole_page_tokens
from .kv import KVCache

__all__ = ["Engine"]


def _invalid(msg):
    return InvalidValueError(msg, Status.INVALID_VALUE)


def _decoder_parts(model):
    """(embed, layers, norm, rotary, lm_head, rope_fn) of a Llama-style CausalLM, or a clear error."""
    base = getattr(model, "model", None)
    need = ("embed_tokens", "layers", "norm", "rotary_emb")
    if base is None or not all(hasattr(base, n) for n in need) or not hasattr(model, "lm_head"):
        raise _invalid("vmmalloc.serve.Engine: %s is not a Llama-style decoder (model.model.{embed_tokens, layers, "
                       "norm, rotary_emb} and model.lm_head)" % type(model).__name__)
    cfg = model.config
    if getattr(cfg, "use_sliding_window", False) or any(
            t != "full_attention" for t in (getattr(cfg, "layer_types", None) or ())):
        raise _invalid("vmmalloc.serve.Engine: sliding-window layers are not supported")
    attn = base.layers[0].self_attn
    for n in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling"):
        if not hasattr(attn, n):
            raise _invalid("vmmalloc.serve.Engine: %s has no %s" % (type(attn).__name__, n))
    rope = getattr(sys.modules[type(attn).__module__], "apply_rotary_pos_emb", None)
    if rope is None:
        raise _invalid("vmmalloc.serve.Engine: %s's module has no apply_rotary_pos_emb" % type(attn).__name__)
    return base.embed_tokens, list(base.layers), base.norm, base.rotary_emb, model.lm_head, rope


class Engine:
    """Continuous batching of `model` (greedy) with a vmmalloc KVCache of at most kv_budget_bytes.

    max_seqs: sequences running at once (cache slots; virtual space only). max_tokens: per sequence
    (default: the model's max_position_embeddings). max_batch_tokens: tokens per forward (prompt
    chunks and decodes). attention: "auto", "flash" or "sdpa"."""

    def __init__(self, model, kv_budget_bytes, max_seqs=256, max_tokens=None, max_batch_tokens=4096,
                 attention="auto"):
        self.model = model
        (self._embed, self._layers, self._norm, self._rotary, self._lm_head,
         self._rope) = _decoder_parts(model)
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        if self.device.type != "cuda":
            raise _invalid("vmmalloc.serve.Engine: the model is on %s; it must be on a CUDA device" % self.device)
        attn0 = self._layers[0].self_attn
        cfg = model.config
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.head_dim = attn0.head_dim
        self.scaling = attn0.scaling
        if max_tokens is None:
            max_tokens = int(getattr(cfg, "max_position_embeddings", 0) or 4096)

        def cache(tokens):
            return KVCache(len(self._layers), self.kv_heads, self.head_dim, max_seqs, tokens, dtype=self.dtype,
                           device=self.device.index or 0, layout="per_sequence")

        self.kv = cache(max_tokens)
        if self.kv.seq_stride % self.kv.token_stride:  # e.g. 12 layers: sequences must start on a row
            rounded = whole_page_tokens(max_tokens, self.kv.token_stride, self.kv.page_size)
            self.kv.destroy()
            self.kv = cache(rounded)
        self.scheduler = Scheduler(self.kv, kv_budget_bytes, max_batch_tokens=max_batch_tokens, max_tokens=max_tokens)
        e = self.kv.elem_bytes
        self.rows_per_seq = self.kv.seq_stride // self.kv.token_stride
        rows = (self.kv.max_seqs - 1) * self.rows_per_seq + self.kv.max_tokens
        flat = self.kv.flat_tensor(self.dtype)
        st = (self.kv.token_stride // e, self.head_dim, 1)
        shape = (rows, self.kv_heads, self.head_dim)
        self._k = [torch.as_strided(flat, shape, st, l * self.kv.layer_stride // e) for l in range(len(self._layers))]
        self._v = [torch.as_strided(flat, shape, st, (l * self.kv.layer_stride + self.kv.kv_stride) // e)
                   for l in range(len(self._layers))]
        if attention not in ("auto", "flash", "sdpa"):
            raise _invalid("vmmalloc.serve.Engine: attention must be \"auto\", \"flash\" or \"sdpa\", not %r"
                           % (attention,))
        self.attention = attention
        self.flash_error = None
        if attention != "sdpa":
            self.flash_error = self._check_flash()
            if self.flash_error is None:
                self.attention = "flash"
            elif attention == "flash":
                raise _invalid("vmmalloc.serve.Engine: attention=\"flash\": %s" % self.flash_error)
            else:
                self.attention = "sdpa"

    # ---- requests -------------------------------------------------------------------------

    def add(self, prompt, max_new_tokens, request_id=None, eos_token_ids=()):
        return self.scheduler.add(prompt, max_new_tokens, request_id=request_id, eos_token_ids=eos_token_ids)

    def cancel(self, request_id):
        return self.scheduler.cancel(request_id)

    def pending(self):
        return self.scheduler.pending()

    def generate(self, prompts, max_new_tokens, eos_token_ids=()):
        """Every prompt to the end; {request id: generated token ids}. max_new_tokens: one for all,
        or one per prompt."""
        per = list(max_new_tokens) if hasattr(max_new_tokens, "__len__") else [max_new_tokens] * len(prompts)
        if len(per) != len(prompts):
            raise _invalid("vmmalloc.serve.Engine.generate: %d prompts, %d max_new_tokens" % (len(prompts), len(per)))
        ids = [self.add(p, n, eos_token_ids=eos_token_ids) for p, n in zip(prompts, per)]
        out = {}
        while self.pending():
            for r in self.step():
                out[r.id] = list(r.output)
        return {i: out[i] for i in ids if i in out}

    def stats(self):
        """The scheduler's counters, the cache's pages and what the engine chose."""
        s = dict(self.scheduler.counters)
        k = self.kv.stats()
        s.update(kv_page_bytes=self.kv.page_size, kv_budget_pages=self.scheduler.budget_pages,
                 kv_pages_held=k["pages_created"] - k["pages_released"], kv_pages_mapped=k["pages_mapped"],
                 kv_driver_calls=k["driver_calls"], attention=self.attention)
        s["kv_peak_bytes"] = s["peak_pages"] * self.kv.page_size
        return s

    def close(self):
        """Releases the cache (every request is dropped)."""
        torch.cuda.synchronize(self.device)
        self._k = self._v = []
        self.kv.destroy()

    # ---- one step -------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self):
        """Schedules and runs one forward; returns the requests that finished."""
        batch = self.scheduler.schedule()
        if not len(batch):
            return []
        toks = self._forward(batch)
        return self.scheduler.complete(batch, toks)

    def _forward(self, batch):
        ids, pos, rows, cu_q, cu_k, used = [], [], [], [0], [], []
        max_q = max_k = 0
        for r, slot, start, n in batch.entries:
            ids += r.tokens(start, n)
            pos += range(start, start + n)
            base = slot * self.rows_per_seq
            rows += range(base + start, base + start + n)
            cu_q.append(cu_q[-1] + n)
            cu_k.append(base)
            used.append(start + n)
            max_q, max_k = max(max_q, n), max(max_k, start + n)
        cu_k.append(cu_k[-1] + used[-1])
        dev = self.device
        T = len(ids)
        longs = torch.tensor(ids + pos + rows, dtype=torch.long).to(dev, non_blocking=True)
        ints = torch.tensor(cu_q + cu_k + used, dtype=torch.int32).to(dev, non_blocking=True)
        ids_t, pos_t, rows_t = longs[:T], longs[T:2 * T], longs[2 * T:]
        B = len(batch.entries)
        cu_q_t, cu_k_t, used_t = ints[:B + 1], ints[B + 1:2 * B + 2], ints[2 * B + 2:]
        meta = (batch.entries, cu_q, cu_q_t, cu_k_t, used_t, max_q, max_k)

        x = self._embed(ids_t)[None]                   # [1, T, hidden]
        cos, sin = self._rotary(x, pos_t[None])
        H, KH, D = self.heads, self.kv_heads, self.head_dim
        for l, layer in enumerate(self._layers):
            a = layer.self_attn
            h = layer.input_layernorm(x)
            q = a.q_proj(h).view(1, T, H, D)
            k = a.k_proj(h).view(1, T, KH, D)
            v = a.v_proj(h).view(T, KH, D)
            if hasattr(a, "q_norm"):
                q, k = a.q_norm(q), a.k_norm(k)
            q, k = self._rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            q = q.transpose(1, 2)[0].contiguous()      # [T, H, D]
            k = k.transpose(1, 2)[0]                   # [T, KH, D]
            self._k[l].index_copy_(0, rows_t, k)
            self._v[l].index_copy_(0, rows_t, v)
            o = self._attend(q, self._k[l], self._v[l], meta)
            x = x + a.o_proj(o.reshape(1, T, H * D))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        x = self._norm(x)[0]
        sample = batch.sampling()
        last = torch.tensor([cu_q[i + 1] - 1 for i in sample], dtype=torch.long).to(dev, non_blocking=True)
        logits = self._lm_head(x.index_select(0, last))
        return logits.argmax(-1).tolist()

    def _attend(self, q, K, V, meta):
        entries, cu_q, cu_q_t, cu_k_t, used_t, max_q, max_k = meta
        if self.attention == "flash":
            return torch.ops.aten._flash_attention_forward(q, K, V, cu_q_t, cu_k_t, max_q, max_k, 0.0, True, False,
                                                           scale=self.scaling, seqused_k=used_t)[0]
        out = torch.empty_like(q)
        for i, (r, slot, start, n) in enumerate(entries):
            base = slot * self.rows_per_seq
            out[cu_q[i]:cu_q[i + 1]] = _sdpa_one(q[cu_q[i]:cu_q[i + 1]], K[base:base + start + n],
                                                 V[base:base + start + n], start, self.scaling)
        return out

    def _check_flash(self):
        """None when the flash path agrees with per-sequence SDPA on strided rows with gaps (a
        decode and a prompt chunk after earlier tokens, garbage past each sequence); else why not."""
        if self.dtype not in (torch.float16, torch.bfloat16):
            return "FlashAttention takes fp16 and bf16, not %s" % self.dtype
        if not hasattr(torch.ops.aten, "_flash_attention_forward"):
            return "this torch has no aten._flash_attention_forward"
        try:
            g = torch.Generator(device=self.device).manual_seed(0)
            H, KH, D, rps = self.heads, self.kv_heads, self.head_dim, 64
            big = torch.randn(2 * rps, 3, KH, D, device=self.device, dtype=self.dtype, generator=g)
            K, V = big[:, 0], big[:, 1]                   # strided rows like the cache's
            big[:, 2] = 1e4
            K[5:rps] = 1e4                               # past each sequence: must not be read
            V[5:rps] = 1e4
            K[rps + 40:] = 1e4
            V[rps + 40:] = 1e4
            # sequence 0: a decode at position 4; sequence 1: a chunk of 16 tokens at 24..39
            entries = [(None, 0, 4, 1), (None, 1, 24, 16)]
            cu_q = [0, 1, 17]
            q = torch.randn(17, H, D, device=self.device, dtype=self.dtype, generator=g)
            ints = torch.tensor(cu_q + [0, rps, rps + 40] + [5, 40], dtype=torch.int32, device=self.device)
            meta = (entries, cu_q, ints[:3], ints[3:6], ints[6:], 16, 40)
            got = torch.ops.aten._flash_attention_forward(q, K, V, meta[2], meta[3], 16, 40, 0.0, True, False,
                                                          scale=self.scaling, seqused_k=meta[4])[0]
            want = torch.cat([_sdpa_one(q[0:1], K[0:5], V[0:5], 4, self.scaling),
                              _sdpa_one(q[1:17], K[rps:rps + 40], V[rps:rps + 40], 24, self.scaling)])
            err = (got.float() - want.float()).abs().max().item()
            if not err < 5e-2:
                return "flash differs from SDPA by %g on the check" % err
        except Exception as e:  # noqa: BLE001 - any failure means: do not use it
            return "%s: %s" % (type(e).__name__, e)
        return None


def _sdpa_one(q, k, v, start, scale):
    """q [n, H, D] at positions start..start+n-1 over k, v [start + n, KH, D]: causal, in place."""
    n, L = q.shape[0], k.shape[0]
    qq, kk, vv = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    mask = None
    if n > 1:
        mask = (torch.arange(L, device=q.device)[None, :]
                <= torch.arange(start, start + n, device=q.device)[:, None])
    o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=scale,
                                       enable_gqa=qq.shape[1] != kk.shape[1])
    return o[0].transpose(0, 1)
