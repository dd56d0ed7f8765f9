#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""vmmalloc.hf.VmmCache against transformers' DynamicCache, on a GPU (and once on the CPU).

A small Llama from a LlamaConfig (random weights from a fixed seed, nothing downloaded) generates
greedily with DynamicCache and with VmmCache: the generated tokens, the prefill logits and every
layer's cached keys and values must be identical (the same kernels read the same numbers; only
the memory differs). Checked: batch 1 and a left-padded batch 4, SDPA and eager attention, the
views (stable addresses, no copy of old tokens), reset() reusing the pages with no driver call,
release() returning them, crop, batch_select_indices and beam search (reorder_cache), bf16 and
fp16, a CPU model on the host backend, and bad input (batch past max_batch_size, tokens past
max_cache_len, a dtype change): clear exceptions, state intact.

Exit 0: passed. 77: no torch, transformers or CUDA device. 1: a mismatch or an error.
Needs libvmmalloc.so: $VMMALLOC_LIB_DIR (set by ctest) or a build next to the sources.

    VMMALLOC_LIB_DIR=build/src python3 tests/kvcache/test_hf_cache.py
"""

import os
import sys
import time
import traceback
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.normpath(os.path.join(HERE, "..", "..", "python")))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

failures = []


def expect(cond, what):
    print(("ok    " if cond else "FAIL  ") + what, flush=True)
    if not cond:
        failures.append(what)
    return cond


def main():
    try:
        import torch
        import transformers
        from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
    except Exception as e:  # ImportError, or a broken install that fails on import
        print("test_hf_cache: skipped: torch/transformers not importable (%s)" % e)
        return 77
    if not torch.cuda.is_available():
        print("test_hf_cache: skipped: no CUDA device")
        return 77
    import vmmalloc
    from vmmalloc.hf import VmmCache

    print("torch %s, transformers %s, %s; library %s" % (torch.__version__, transformers.__version__,
                                                        torch.cuda.get_device_name(0), vmmalloc.find_library()))
    dev = torch.device("cuda", 0)
    torch.backends.cuda.matmul.allow_tf32 = False

    def model_for(attn, dtype, device, layers=4):
        cfg = LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
                          num_attention_heads=8, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
                          rms_norm_eps=1e-5, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
                          eos_token_id=None, attn_implementation=attn)
        torch.manual_seed(1234)
        m = LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()
        m.generation_config.eos_token_id = None  # fixed lengths: nothing stops early
        m.generation_config.pad_token_id = 0
        return m

    g = torch.Generator().manual_seed(7)

    def prompts(batch, lengths, device):
        """Left-padded prompts of the given lengths (the longest has no padding)."""
        n = max(lengths)
        ids = torch.zeros(batch, n, dtype=torch.long)
        mask = torch.zeros(batch, n, dtype=torch.long)
        for b, ln in enumerate(lengths):
            ids[b, n - ln:] = torch.randint(3, 1000, (ln,), generator=g)
            mask[b, n - ln:] = 1
        return ids.to(device), mask.to(device)

    def generate(model, ids, mask, cache, new, **kw):
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=new,
                                 do_sample=False, **kw)  # no EOS: always `new` tokens
        return out[:, ids.shape[1]:]

    def same_cache_views(vmm):
        """Every layer's keys and values are distinct views of the cache's one reservation."""
        ptrs = set()
        for layer in vmm.layers:
            ptrs.add(layer.keys.data_ptr())
            ptrs.add(layer.values.data_ptr())
        return len(ptrs) == 2 * len(vmm.layers)

    def same_cache(dyn, vmm, rows=None):
        for l in range(len(vmm.layers)):
            dk, dv = dyn.layers[l].keys, dyn.layers[l].values
            vk, vv = vmm.layers[l].keys, vmm.layers[l].values
            if rows is not None:
                dk, dv = dk[rows], dv[rows]
            if dk.shape != vk.shape or not torch.equal(dk, vk) or not torch.equal(dv, vv):
                return False
        return True

    # ---- 1. greedy generation: tokens, logits, caches identical ----------------------------------
    for attn in ("sdpa", "eager"):
        for dtype in (torch.bfloat16, torch.float16):
            model = model_for(attn, dtype, dev)
            for batch, lengths in ((1, [37]), (4, [50, 23, 50, 7])):
                ids, mask = prompts(batch, lengths, dev)
                tag = "%s %s batch %d" % (attn, str(dtype).replace("torch.", ""), batch)
                dyn = DynamicCache(config=model.config)
                want = generate(model, ids, mask, dyn, 40)
                vmm = VmmCache(model.config, max_batch_size=8, max_cache_len=512)
                got = generate(model, ids, mask, vmm, 40)
                expect(torch.equal(want, got), "%s: generated tokens equal DynamicCache's" % tag)
                expect(same_cache(dyn, vmm), "%s: every layer's keys and values equal DynamicCache's" % tag)
                n = ids.shape[1] + 40 - 1  # the last token is generated, never cached
                expect(vmm.get_seq_length() == dyn.get_seq_length() == n,
                       "%s: seq length %d == %d" % (tag, vmm.get_seq_length(), dyn.get_seq_length()))
                k0 = vmm.layers[0].keys
                expect(k0.data_ptr() == vmm.kv.k_ptr(0, 0) and k0.stride(-1) == 1 and
                       tuple(k0.shape) == (batch, 2, n, 32),
                       "%s: keys are a [B, H, T, D] view of the KV cache (stride %s)" % (tag, k0.stride()))
                # The prefill's logits through both caches.
                with torch.no_grad():
                    a = model(input_ids=ids, attention_mask=mask, past_key_values=DynamicCache(config=model.config)).logits
                    vmm.reset()
                    b = model(input_ids=ids, attention_mask=mask, past_key_values=vmm).logits
                expect(torch.equal(a, b), "%s: prefill logits equal" % tag)
                vmm.destroy()
            del model

    # ---- 2. views grow in place; reset reuses pages; release returns them -------------------------
    model = model_for("sdpa", torch.bfloat16, dev)
    ids, mask = prompts(2, [100, 60], dev)
    vmm = VmmCache(model.config, max_batch_size=2, max_cache_len=2048)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, past_key_values=vmm)
        ptr0 = vmm.layers[3].keys.data_ptr()
        nxt = out.logits[:, -1:].argmax(-1)
        m = mask
        moved = False
        for _ in range(30):
            m = torch.cat([m, torch.ones_like(nxt)], dim=1)
            out = model(input_ids=nxt, attention_mask=m, past_key_values=vmm)
            nxt = out.logits[:, -1:].argmax(-1)
            moved |= vmm.layers[3].keys.data_ptr() != ptr0
    expect(not moved and vmm.get_seq_length() == 130, "step by step: layer 3's keys never move (130 tokens)")
    mem = vmm.memory()
    T = vmm.kv.token_bytes
    # Packed: a token holds every layer's K and V rows (4 layers x 2 x 2 rows x 2 heads x 32 x bf16).
    expect(T == 4 * 2 * 2 * 2 * 32 * 2 and mem["used_bytes"] == 130 * T and
           mem["mapped_bytes"] == vmm.kv.page_size and mem["rows"] == 2,
           "memory: used %d, mapped %d (one page: 4 layers x K|V x 2 rows packed)" % (
               mem["used_bytes"], mem["mapped_bytes"]))
    stats0 = vmm.kv.stats()
    vmm.reset()
    expect(vmm.get_seq_length() == 0 and vmm.layers[0].keys is None, "reset: empty")
    want = generate(model, ids, mask, DynamicCache(config=model.config), 20)
    got = generate(model, ids, mask, vmm, 20)
    stats1 = vmm.kv.stats()
    expect(torch.equal(want, got), "after reset: a new generation matches DynamicCache")
    expect(stats1["pages_created"] == stats0["pages_created"] and stats1["pages_retained_reused"] >= 1,
           "after reset: the retained pages served it (created %d -> %d, reused %d)" % (
               stats0["pages_created"], stats1["pages_created"], stats1["pages_retained_reused"]))
    released = vmm.release()
    st = vmm.kv.stats()
    expect(released > 0 and st["pages_mapped"] == 0 and st["pages_pooled"] == 0 and
           st["pages_created"] == st["pages_released"] and vmm.memory()["mapped_bytes"] == 0,
           "release: every page returned (%d released, %d created)" % (released, st["pages_created"]))
    vmm.destroy()

    # ---- 3. crop, batch_select_indices, beam search ----------------------------------------------
    ids, mask = prompts(3, [30, 30, 18], dev)
    dyn = DynamicCache(config=model.config)
    generate(model, ids, mask, dyn, 10)
    vmm = VmmCache(model.config, max_batch_size=4, max_cache_len=256)
    generate(model, ids, mask, vmm, 10)
    dyn.crop(-5)
    vmm.crop(-5)
    expect(vmm.get_seq_length() == dyn.get_seq_length() == 34 and same_cache(dyn, vmm), "crop(-5): equal caches")
    sel = torch.tensor([2, 0], device=dev)
    dyn.batch_select_indices(sel)
    vmm.batch_select_indices(sel)
    expect(vmm.layers[0].keys.shape[0] == 2 and same_cache(dyn, vmm) and vmm.memory()["rows"] == 2,
           "batch_select_indices([2, 0]): equal caches, 2 rows")
    vmm.batch_repeat_interleave(2)
    dyn.batch_repeat_interleave(2)
    expect(vmm.layers[0].keys.shape[0] == 4 and same_cache(dyn, vmm), "batch_repeat_interleave(2): equal caches")
    vmm.destroy()
    ids, mask = prompts(2, [20, 12], dev)
    want = generate(model, ids, mask, DynamicCache(config=model.config), 12, num_beams=3)
    vmm = VmmCache(model.config, max_batch_size=6, max_cache_len=128)  # 2 prompts x 3 beams
    got = generate(model, ids, mask, vmm, 12, num_beams=3)
    expect(torch.equal(want, got), "beam search (3 beams, reorder_cache): tokens equal")
    # No max_batch_size: laid out for the first batch, re-laid out for a larger one between generations.
    auto = VmmCache(model.config, max_cache_len=256)
    ids1, mask1 = prompts(1, [25], dev)
    want1 = generate(model, ids1, mask1, DynamicCache(config=model.config), 8)
    got1 = generate(model, ids1, mask1, auto, 8)
    mapped1 = auto.memory()["mapped_bytes"]
    auto.reset()
    ids3, mask3 = prompts(3, [25, 11, 19], dev)
    want3 = generate(model, ids3, mask3, DynamicCache(config=model.config), 8)
    got3 = generate(model, ids3, mask3, auto, 8)
    expect(torch.equal(want1, got1) and torch.equal(want3, got3) and auto.max_batch_size == 3 and
           mapped1 == auto.kv.page_size,
           "no max_batch_size: batch 1 (%d bytes mapped) then batch 3 re-laid out, tokens equal" % mapped1)
    auto.destroy()
    # Two layer groups: two buffers (a page each), the same tokens.
    grouped = VmmCache(model.config, max_cache_len=256, layer_groups=2)
    got3 = generate(model, ids3, mask3, grouped, 8)
    expect(torch.equal(want3, got3) and grouped.layer_groups == 2 and
           grouped.memory()["mapped_bytes"] == 2 * grouped.kv.page_size and same_cache_views(grouped),
           "layer_groups=2: tokens equal, one page per group")
    grouped.destroy()

    # ---- 4. bad input: clear errors, state intact -------------------------------------------------
    small = VmmCache(model.config, max_batch_size=2, max_cache_len=64)
    ids4, mask4 = prompts(4, [10, 10, 10, 10], dev)
    try:
        generate(model, ids4, mask4, small, 5)
        expect(False, "batch 4 > max_batch_size 2 raises")
    except vmmalloc.OutOfMemoryError as e:
        expect("exceeds max_batch_size 2" in str(e), "batch 4 > max_batch_size 2: %s" % e)
    small.reset()
    ids2, mask2 = prompts(2, [60, 60], dev)
    try:
        generate(model, ids2, mask2, small, 10)
        expect(False, "70 tokens > max_cache_len 64 raises")
    except vmmalloc.OutOfMemoryError as e:
        expect("exceed max_tokens 64" in str(e), "70 tokens > max_cache_len 64: %s" % e)
    expect(small.memory()["rows"] == 2 and small.get_seq_length() == 64,
           "the refused append left 64 tokens in 2 rows (%d)" % small.get_seq_length())
    small.reset()
    try:
        with torch.no_grad():
            model.half()(input_ids=ids2, attention_mask=mask2, past_key_values=small)
        expect(False, "fp16 states into a bf16 cache raise")
    except vmmalloc.InvalidValueError as e:
        expect("the cache holds torch.bfloat16" in str(e), "dtype change: %s" % e)
    try:
        VmmCache(types.SimpleNamespace(num_hidden_layers=2, max_position_embeddings=128,
                                       layer_types=["full_attention", "sliding_attention"]))
        expect(False, "sliding layers are refused")
    except NotImplementedError as e:
        expect("sliding_attention" in str(e), "sliding layers refused: %s" % e)
    small.destroy()
    vmm.destroy()
    del model
    torch.cuda.synchronize()

    # ---- 5. CPU model, host backend ---------------------------------------------------------------
    cpu = torch.device("cpu")
    model = model_for("sdpa", torch.float32, cpu, layers=2)
    ids, mask = prompts(2, [16, 9], cpu)
    want = generate(model, ids, mask, DynamicCache(config=model.config), 12)
    hc = VmmCache(model.config, max_batch_size=2, max_cache_len=256)
    got = generate(model, ids, mask, hc, 12)
    expect(torch.equal(want, got) and hc.kv.backend == "host", "CPU model on the host backend: tokens equal")
    hc.destroy()

    print()
    if failures:
        print("test_hf_cache: %d FAILED" % len(failures))
        return 1
    print("test_hf_cache: passed")
    return 0


if __name__ == "__main__":
    t0 = time.time()
    try:
        rc = main()
    except Exception:
        traceback.print_exc()
        rc = 1
    print("(%.1f s)" % (time.time() - t0))
    sys.exit(rc)
