#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Continuous batching on one stream of requests: vmmalloc.serve.Engine against transformers'
own continuous batching (a paged block table, attn_implementation="paged|sdpa"), at one KV budget.

The model: a Llama built from a LlamaConfig (random weights from a fixed seed, nothing downloaded;
default 16 layers, hidden 2048, 16 heads and 16 KV heads of 128: 128 KiB of K and V per token, the
width of a 7B model's), in bf16 (--dtype). The stream: --requests prompts of uniform random length
in [--prompt-min, --prompt-max] and random token ids, each with its own max_new_tokens in
[--new-min, --new-max], no EOS (every request generates exactly its max_new_tokens), all queued at
the start, in one order for both.

The KV budget (--kv-mib): transformers' cache gets num_blocks = budget / (block_size tokens of K and
V of every layer), block_size --block-size; the engine's scheduler keeps its mapped pages within
it. Both take at most --max-batch-tokens tokens per forward. Each engine first serves a short
warm-up stream (its CUDA graphs, kernels and pages), then the timed stream.

Reported per engine: wall time of the stream, generated tokens/s, peak concurrent sequences (the
most requests holding cache at one step), preemptions (engine) or offloads (transformers), peak KV
bytes held, peak memory (torch's peak reserved during the stream, plus the engine's KV pages, which
torch does not see), and tokens identical to the other engine's (requests whose outputs are equal,
and the tokens before the first difference). A check first: the engine's greedy tokens for
--ref-requests requests against model.generate() (DynamicCache, SDPA) one by one.

bf16 kernels sum in different orders (FlashAttention here, paged SDPA there, other GEMM shapes at
other batch sizes), and a random-weight model's top logits are close: a last-bit difference can flip
an argmax and the rest of that request then differs. --dtype float32 makes the same comparison where
rounding is ~65,000 times smaller.

Output: a markdown table on stdout and in --out (serve_transformers.md, .json). Exit 0: ran; 1: an
engine failed or (--strict) tokens differed; 77: no torch, transformers or CUDA.

    VMMALLOC_LIB_DIR=build/src python3 bench/serve_transformers.py --quick
"""

import argparse
import inspect
import json
import os
import random
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.normpath(os.path.join(HERE, "..", "python")))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="32 requests, 8 layers: about a minute")
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--prompt-min", type=int, default=16)
    p.add_argument("--prompt-max", type=int, default=1024)
    p.add_argument("--new-min", type=int, default=16)
    p.add_argument("--new-max", type=int, default=256)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--kv-mib", type=int, default=2048, help="KV budget of both engines (MiB)")
    p.add_argument("--block-size", type=int, default=32, help="transformers' block size (tokens)")
    p.add_argument("--max-batch-tokens", type=int, default=2048)
    p.add_argument("--max-seqs", type=int, default=256, help="the engine's slots")
    p.add_argument("--ref-requests", type=int, default=4, help="requests checked against model.generate()")
    p.add_argument("--engines", default="transformers,transformers-nographs,vmmalloc",
                   help="transformers (its defaults: CUDA graphs where it chooses), transformers-nographs "
                        "(use_cuda_graph=False), vmmalloc")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--strict", action="store_true", help="exit 1 when the engines' tokens differ")
    p.add_argument("--out", default=os.environ.get("VMM_OUT") or "serve-out")
    a = p.parse_args()
    if a.quick:
        a.requests, a.layers, a.prompt_max, a.new_max, a.kv_mib = 32, 8, 600, 64, 512
    return a


def make_stream(a, n, seed):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        pl = rng.randint(a.prompt_min, a.prompt_max)
        out.append(([rng.randrange(3, a.vocab) for _ in range(pl)], rng.randint(a.new_min, a.new_max)))
    return out


def filtered(fn, kw):
    """kw without the names fn does not take (APIs that moved between transformers versions)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return kw
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return kw
    return {k: v for k, v in kw.items() if k in params}


# ---- transformers' continuous batching ---------------------------------------------------------

class PeerProbe:
    """Counts the peer's concurrent requests: wraps its schedulers' schedule_batch."""

    def __init__(self):
        self.peak_active = 0
        self.peak_batch = 0
        self.calls = 0
        self._undo = []
        try:
            from transformers.generation.continuous_batching import scheduler as mod
        except Exception:  # noqa: BLE001
            return
        for obj in list(vars(mod).values()):
            if isinstance(obj, type) and "schedule_batch" in vars(obj):
                self._wrap(obj)

    def _wrap(self, cls):
        orig = vars(cls)["schedule_batch"]
        probe = self

        def schedule_batch(self, *args, **kw):
            res = orig(self, *args, **kw)
            probe.calls += 1
            act = getattr(self, "active_requests", None)
            if act is not None:
                probe.peak_active = max(probe.peak_active, len(act))
            first = res[0] if isinstance(res, tuple) and res else res
            if isinstance(first, (list, tuple)):
                probe.peak_batch = max(probe.peak_batch, len(first))
            return res

        cls.schedule_batch = schedule_batch
        self._undo.append((cls, orig))

    def reset(self):
        self.peak_active = self.peak_batch = self.calls = 0

    def close(self):
        for cls, orig in self._undo:
            cls.schedule_batch = orig


def peer_config(a, token_kv_bytes, graphs):
    """(GenerationConfig, ContinuousBatchingConfig or None, what was set)."""
    from transformers import GenerationConfig

    blocks = a.kv_mib * (1 << 20) // (a.block_size * token_kv_bytes)
    want = {"block_size": a.block_size, "num_blocks": blocks, "max_batch_tokens": a.max_batch_tokens}
    if graphs is not None:
        want["use_cuda_graph"] = graphs
    gc = GenerationConfig(do_sample=False, max_new_tokens=a.new_max, eos_token_id=None, pad_token_id=0)
    cbc = None
    cls = None
    for where in ("transformers", "transformers.generation.configuration_utils", "transformers.generation"):
        try:
            mod = __import__(where, fromlist=["ContinuousBatchingConfig"])
            cls = getattr(mod, "ContinuousBatchingConfig", None)
        except Exception:  # noqa: BLE001
            cls = None
        if cls is not None:
            break
    if cls is not None:
        cbc = cls(**filtered(cls, want))
    else:  # older API: the settings live on the GenerationConfig
        for k, v in want.items():
            setattr(gc, k, v)
    return gc, cbc, {"num_blocks": blocks, "block_size": a.block_size, "max_batch_tokens": a.max_batch_tokens,
                     "use_cuda_graph": "default" if graphs is None else graphs,
                     "config": "ContinuousBatchingConfig" if cbc is not None else "GenerationConfig"}


def run_peer(model, a, warm, stream, token_kv_bytes, graphs=None):
    import torch

    try:
        model.set_attn_implementation("paged|sdpa")
    except Exception as e:  # noqa: BLE001
        print("note: set_attn_implementation(\"paged|sdpa\"): %s" % e)
    gc, cbc, settings = peer_config(a, token_kv_bytes, graphs)
    probe = PeerProbe()
    kw = filtered(model.continuous_batching_context_manager,
                  {"generation_config": gc, "continuous_batching_config": cbc, "block": True, "timeout": 60,
                   "warmup": True})
    if cbc is None:
        kw.pop("continuous_batching_config", None)
    row = {"engine": "transformers paged|sdpa, %d-token blocks%s" % (a.block_size, "" if graphs is None else
                                                                      ", no CUDA graphs"), "settings": settings}
    try:
        with model.continuous_batching_context_manager(**kw) as manager:
            add_kw = inspect.signature(manager.add_request).parameters
            per_request = "max_new_tokens" in add_kw

            def serve(reqs, tag):
                for i, (prompt, new) in enumerate(reqs):
                    extra = {"max_new_tokens": new} if per_request else {}
                    manager.add_request(input_ids=prompt, request_id="%s%d" % (tag, i), **extra)
                out, t_end = {}, time.time() + 600
                while len(out) < len(reqs):
                    res = manager.get_result(timeout=1)
                    if res is None:
                        if not manager.is_running():
                            raise RuntimeError("transformers' generation thread stopped")
                        if time.time() > t_end:
                            raise RuntimeError("transformers: no result for 600 s")
                        continue
                    if res.is_finished():
                        if getattr(res, "error", None):
                            raise RuntimeError("transformers request %s: %s" % (res.request_id, res.error))
                        out[res.request_id] = list(res.generated_tokens)
                return [out["%s%d" % (tag, i)] for i in range(len(reqs))]

            serve(warm, "w")
            torch.cuda.synchronize()
            probe.reset()
            torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            tokens = serve(stream, "r")
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
            row["peak_reserved"] = torch.cuda.max_memory_reserved()
            row["peak_allocated"] = torch.cuda.max_memory_allocated()
            bp = getattr(manager, "batch_processor", None)
            cache = getattr(bp, "cache", None)
            kv_bytes = 0
            for name in ("key_cache", "value_cache"):
                for t in getattr(cache, name, None) or ():
                    kv_bytes += t.numel() * t.element_size()
            row["kv_bytes"] = kv_bytes or None
            row["cache_blocks"] = getattr(cache, "num_blocks", None)
            row["cache_block_size"] = getattr(cache, "block_size", None)
            om = getattr(bp, "offloading_manager", None)
            row["offloads"] = getattr(om, "num_offloaded", None) if om is not None else None
            if not per_request:
                row["note"] = "max_new_tokens per request not taken: every request got %d" % a.new_max
    finally:
        probe.close()
        try:
            model.set_attn_implementation("sdpa")
        except Exception:  # noqa: BLE001
            pass
    row.update(wall=wall, generated=sum(len(t) for t in tokens), peak_concurrent=probe.peak_active or None,
               peak_batch=probe.peak_batch or None, peak_memory=row["peak_reserved"])
    return row, tokens


# ---- vmmalloc.serve ---------------------------------------------------------------------------------

def run_engine(model, a, warm, stream):
    import torch

    from vmmalloc.serve import Engine

    eng = Engine(model, kv_budget_bytes=a.kv_mib << 20, max_seqs=a.max_seqs,
                 max_tokens=a.prompt_max + a.new_max, max_batch_tokens=a.max_batch_tokens)
    try:
        eng.generate([p for p, _ in warm], [n for _, n in warm])
        torch.cuda.synchronize()
        before = eng.stats()
        eng.scheduler.counters.update(peak_running=0, peak_pages=0, preemptions=0)
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        out = eng.generate([p for p, _ in stream], [n for _, n in stream])
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        s = eng.stats()
        tokens = [out[i] for i in sorted(out)]
        row = {"engine": "vmmalloc.serve (per_sequence KVCache, %s)" % s["attention"], "wall": wall,
               "generated": sum(len(t) for t in tokens), "peak_concurrent": s["peak_running"],
               "preemptions": s["preemptions"], "kv_bytes": s["kv_peak_bytes"],
               "kv_pages_held": s["kv_pages_held"], "peak_reserved": torch.cuda.max_memory_reserved(),
               "peak_allocated": torch.cuda.max_memory_allocated(), "flash_error": eng.flash_error,
               "kv_driver_calls": s["kv_driver_calls"] - before["kv_driver_calls"], "steps": s["steps"] - before["steps"],
               "settings": {"kv_budget_pages": s["kv_budget_pages"], "page_bytes": s["kv_page_bytes"],
                            "max_batch_tokens": a.max_batch_tokens, "max_seqs": a.max_seqs}}
        row["peak_memory"] = row["peak_reserved"] + s["kv_pages_held"] * s["kv_page_bytes"]
        return row, tokens
    finally:
        eng.close()


def reference(model, stream, n):
    """model.generate() (DynamicCache, SDPA, greedy) of the first n requests, one at a time."""
    import torch

    outs = []
    for prompt, new in stream[:n]:
        ids = torch.tensor([prompt], device=model.device)
        g = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, eos_token_id=None, pad_token_id=0)
        outs.append(g[0, len(prompt):].tolist())
    return outs


def agree(x, y):
    """(requests equal, tokens before the first difference, tokens)."""
    eq = same = total = 0
    for u, v in zip(x, y):
        eq += u == v
        k = 0
        while k < min(len(u), len(v)) and u[k] == v[k]:
            k += 1
        same += k
        total += max(len(u), len(v))
    return eq, same, total


def gib(b):
    return "%.2f" % (b / (1 << 30)) if b else "-"


def main():
    a = parse()
    try:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM
    except Exception as e:  # noqa: BLE001
        print("skipped: %s" % e)
        return 77
    if not torch.cuda.is_available():
        print("skipped: no CUDA device")
        return 77
    import transformers

    dtype = getattr(torch, a.dtype)
    dev = torch.device("cuda", 0)
    head_dim = a.hidden // a.heads
    cfg = LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.hidden * 11 // 4,
                      num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                      head_dim=head_dim, max_position_embeddings=max(4096, a.prompt_max + a.new_max),
                      rms_norm_eps=1e-5, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
                      eos_token_id=None, attn_implementation="sdpa")
    torch.manual_seed(a.seed)
    with torch.device(dev):
        model = LlamaForCausalLM(cfg).to(dtype=dtype).eval()
    token_kv_bytes = 2 * a.layers * a.kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
    warm = make_stream(a, 4, a.seed + 1)
    stream = make_stream(a, a.requests, a.seed)
    props = torch.cuda.get_device_properties(dev)
    info = {"card": props.name, "torch": torch.__version__, "transformers": transformers.__version__,
            "dtype": a.dtype, "layers": a.layers, "hidden": a.hidden, "heads": a.heads, "kv_heads": a.kv_heads,
            "head_dim": head_dim, "kv_bytes_per_token": token_kv_bytes, "kv_budget_mib": a.kv_mib,
            "requests": a.requests, "prompt": [a.prompt_min, a.prompt_max], "new": [a.new_min, a.new_max],
            "prompt_tokens": sum(len(p) for p, _ in stream), "new_tokens": sum(n for _, n in stream)}
    print(json.dumps(info))
    os.makedirs(a.out, exist_ok=True)
    rows, toks, rc = [], {}, 0
    for name in a.engines.split(","):
        try:
            t = time.perf_counter()
            if name == "transformers":
                row, tk = run_peer(model, a, warm, stream, token_kv_bytes)
            elif name == "transformers-nographs":
                row, tk = run_peer(model, a, warm, stream, token_kv_bytes, graphs=False)
            elif name == "vmmalloc":
                row, tk = run_engine(model, a, warm, stream)
            else:
                raise ValueError("unknown engine %r" % name)
            row["name"] = name
            row["tokens_per_s"] = row["generated"] / row["wall"]
            print("%s: %.1f s in all; %s" % (name, time.perf_counter() - t, json.dumps(row, default=str)))
            rows.append(row)
            toks[name] = tk
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            rows.append({"name": name, "engine": name, "error": traceback.format_exc(limit=3)})
            rc = 1
        torch.cuda.empty_cache()
    ref = None
    if a.ref_requests and toks:
        try:
            ref = reference(model, stream, a.ref_requests)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
    mine = toks.get("vmmalloc")
    for r in rows:
        tk = toks.get(r["name"])
        if tk is None:
            continue
        if ref is not None:
            r["vs_generate"] = agree(tk[:len(ref)], ref)
        if mine is not None and r["name"] != "vmmalloc":
            r["vs_vmmalloc"] = agree(tk, mine)
            if a.strict and r["vs_vmmalloc"][0] != len(tk):
                rc = 1

    def agreement(t, n):
        return "-" if t is None else "%d of %d (%d of %d tokens)" % (t[0], n, t[1], t[2])

    lines = ["| engine | tokens/s | stream s | peak concurrent seqs | preempted | KV GiB held (peak) | "
             "peak memory GiB | equal to vmmalloc.serve's | equal to generate()'s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append("| %s | failed | | | | | | | |" % r["engine"].replace("|", "\\|"))
            continue
        lines.append("| %s | %.0f | %.2f | %s | %s | %s | %s | %s | %s |" % (
            r["engine"].replace("|", "\\|"), r["tokens_per_s"], r["wall"], r.get("peak_concurrent") or "-",
            r.get("preemptions", "-"), gib(r.get("kv_bytes")), gib(r.get("peak_memory")),
            agreement(r.get("vs_vmmalloc"), a.requests), agreement(r.get("vs_generate"), len(ref or ()))))
    table = "\n".join(lines)
    head = ("%s, torch %s, transformers %s, %s; Llama %d layers, hidden %d, %d heads, %d KV heads of %d "
            "(%d KiB of K and V per token); %d requests, prompts %d-%d, new tokens %d-%d (%d prompt tokens, "
            "%d new); KV budget %d MiB" % (info["card"], info["torch"], info["transformers"], a.dtype, a.layers,
                                           a.hidden, a.heads, a.kv_heads, head_dim, token_kv_bytes // 1024,
                                           a.requests, a.prompt_min, a.prompt_max, a.new_min, a.new_max,
                                           info["prompt_tokens"], info["new_tokens"], a.kv_mib))
    md = head + "\n\n" + table + "\n"
    if ref is not None:
        md += ("\nEqual: requests whose tokens are all equal (tokens before each request's first difference, of "
               "all); generate(): model.generate() of the first %d requests one at a time (DynamicCache, SDPA).\n"
               % len(ref))
    print(md)
    with open(os.path.join(a.out, "serve_transformers.md"), "w") as f:
        f.write(md)
    with open(os.path.join(a.out, "serve_transformers.json"), "w") as f:
        json.dump({"info": info, "rows": rows}, f, indent=1, default=str)
    return rc


if __name__ == "__main__":
    sys.exit(main())
