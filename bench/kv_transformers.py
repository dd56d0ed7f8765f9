#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""transformers' generate() with DynamicCache, VmmCache (vmmalloc) and StaticCache, on a GPU.

A Llama built from a LlamaConfig (16 layers, hidden 512, 8 heads, 4 KV heads of 64, bf16; random
weights from a fixed seed, nothing downloaded) decodes greedily from left-padded prompts (batch
row b is shorter by b/16 of the prompt, so padding is exercised). Each (prompt, new tokens, batch)
point runs every cache in this one process, after a warm-up. Reported per run: wall time, tokens/s
(batch x new tokens / time), peak memory (the most torch.cuda.memory_allocated plus vmmalloc's mapped
bytes at one time: for VmmCache taken at every page mapping, as torch's peak of the interval that ended
plus what was mapped during it; also torch's peak plus vmmalloc's peak, an upper bound), the KV
cache's bytes, and whether the generated tokens equal DynamicCache's.

VmmCache's tokens must equal DynamicCache's (the same kernels read the same numbers): a mismatch
fails the run (exit 1). StaticCache attends over its whole max_cache_len, so its kernels sum in
another order and bf16 argmax ties may flip: its differences are reported, and fail only with
--strict-static. generate() would torch.compile the forward for a StaticCache; that is off
(--static-compile turns it on) so every cache runs the same eager model.

Attention is eager by default: with a padding mask, SDPA took ~54 ms a decode step against ~14 ms
for eager (H200, torch 2.11, transformers 5.17, DynamicCache; StaticCache's fixed-length mask
does not hit it), which would leave no time for the grid. --attn sdpa measures it anyway.
A decode step costs ~14 ms whatever the batch (launch-bound): 1,024 new tokens ~15 s a run,
16,384 ~4 minutes.

Grids (--quick, --full, --long, or your own with --prompts/--new-tokens/--batches):
  --quick   prompts 32, 16 new tokens, batch 1 and 4: seconds after the imports
  --full    prompts 128 and 4096 x 1024 new tokens x batch 1 and 8 (~4 minutes), then 16384 new
            tokens at (4096, batch 8) and (128, batch 1) while the time budget (--budget, default
            440 s for --full) allows: a run whose estimated time does not fit is reported as
            skipped (budget), so the whole run stays under 8 minutes.
  --long    prompt 4096, 16384 new tokens, batch 8, DynamicCache and VmmCache (~8-9 minutes: a
            call of its own; budget 590 s: if DynamicCache's run leaves too little, VmmCache's is
            reported as skipped and --budget 1200 is needed where a call may run longer)
  --grid all  the cross product of the lists (hours with 16384 new tokens everywhere)

--profile STEPS replaces the timed runs: each cache's generate() of STEPS new tokens at each
point runs under torch.profiler (after an unprofiled run of the same shapes, whose time is
printed), and the kernels' and host calls' totals go to profile-<cache>-<prompt>-<batch>.txt.

Output: a markdown table on stdout, and kv_transformers.json + kv_transformers.md in --out
(default $VMM_OUT when set, else ./kv-transformers-out).

One run at 16,384 new tokens takes 4-6 minutes, so a grid's caches can run in parallel processes,
one per GPU of a machine, each with --save-tokens and an --out of its own; --merge DIR... then
joins their rows into one table and compares each cache's tokens with DynamicCache's run of the
same point (saved as tokens-<cache>-<prompt>-<new>-<batch>.pt), with the same exit rule.
Exit 0: passed. 1: a VmmCache mismatch or error (or a StaticCache one with --strict-static).
77: no torch, transformers or CUDA device.

    VMMALLOC_LIB_DIR=build/src python3 bench/kv_transformers.py --quick
    VMMALLOC_LIB_DIR=build/src python3 bench/kv_transformers.py --full --out gpu-check-out
"""

import argparse
import gc
import json
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.normpath(os.path.join(HERE, "..", "python")))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

T_START = time.perf_counter()
CACHES = ("dynamic", "vmm", "static")  # run in this order: StaticCache is the one a tight budget drops
FULL_POINTS = [(128, 1024, 1), (128, 1024, 8), (4096, 1024, 1), (4096, 1024, 8), (4096, 16384, 8),
               (128, 16384, 1)]
LONG_POINTS = [(4096, 16384, 8)]
WARMUP = (16, 4, 2)  # prompt, new tokens, batch of the untimed first run of each cache


def token_file(kind, pl, nt, batch):
    return "tokens-%s-%d-%d-%d.pt" % (kind, pl, nt, batch)


def ints(s):
    return [int(x) for x in str(s).split(",") if x.strip()]


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="a few seconds: a smoke test")
    mode.add_argument("--full", action="store_true", help="the benchmark grid, under 8 minutes")
    mode.add_argument("--long", action="store_true", help="16384 new tokens, DynamicCache and VmmCache")
    p.add_argument("--prompts", type=ints, help="prompt lengths, e.g. 128,4096")
    p.add_argument("--new-tokens", type=ints, help="new tokens per sequence, e.g. 1024,16384")
    p.add_argument("--batches", type=ints, help="batch sizes, e.g. 1,8")
    p.add_argument("--grid", choices=("all",), help="all: the cross product of the lists")
    p.add_argument("--caches", help="comma list of dynamic,vmm,static (default all; --long: dynamic,vmm)")
    p.add_argument("--no-reference", action="store_true",
                   help="run only the caches listed (DynamicCache is otherwise added as the reference): "
                        "tokens are then not compared; for a point too long for one call")
    p.add_argument("--budget", type=float, help="seconds for the whole run (points that would not fit "
                                                "are skipped); default 440 for --full, none otherwise")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    p.add_argument("--attn", default="eager", choices=("eager", "sdpa"))
    p.add_argument("--map-ahead-tokens", type=int, default=0, help="VmmCache's map-ahead thread (0: off)")
    p.add_argument("--layer-groups", type=int, help="VmmCache's layer groups (default: its own choice)")
    p.add_argument("--static-compile", action="store_true", help="let generate() compile for StaticCache")
    p.add_argument("--strict-static", action="store_true", help="StaticCache token differences fail the run")
    p.add_argument("--out", default=os.environ.get("VMM_OUT") or "kv-transformers-out")
    p.add_argument("--save-tokens", action="store_true", help="write each run's generated tokens to --out")
    p.add_argument("--profile", type=int, default=0, metavar="STEPS",
                   help="instead of the timed runs: each cache's generate() of STEPS new tokens at every point "
                        "under torch.profiler; the kernels' and host calls' totals go to profile-*.txt in --out")
    p.add_argument("--merge", nargs="+", metavar="DIR",
                   help="join the results of runs made with --save-tokens (one process each) and compare tokens")
    a = p.parse_args()
    if a.merge:
        return a
    if a.caches is None:
        a.caches = "dynamic,vmm" if a.long else ",".join(CACHES)
    caches = [c.strip() for c in a.caches.split(",") if c.strip()]
    bad = [c for c in caches if c not in CACHES]
    if bad or not caches:
        p.error("--caches: unknown %s (choose from %s)" % (bad, ",".join(CACHES)))
    if "dynamic" not in caches and not a.no_reference:
        caches.insert(0, "dynamic")  # the reference every other cache is compared with
    a.caches = [c for c in CACHES if c in caches]
    if a.quick:
        points = [(32, 16, 1), (32, 16, 4)]
    elif a.long and not (a.prompts or a.new_tokens or a.batches or a.grid):
        points = list(LONG_POINTS)
        if a.budget is None:
            a.budget = 590.0
    elif a.full and not (a.prompts or a.new_tokens or a.batches or a.grid):
        points = list(FULL_POINTS)
        if a.budget is None:
            a.budget = 440.0
    else:
        prompts = a.prompts or [128, 4096]
        news = a.new_tokens or [1024, 16384]
        batches = a.batches or [1, 8]
        points = [(pl, nt, b) for nt in news for pl in prompts for b in batches]  # cheap ones first
    a.points = points
    return a


def profile(a, run, dev):
    """Where a decode step's time goes for each cache: torch.profiler over a short generate() per
    point (after the warm-up), GPU kernels by self device time and host calls by self CPU time."""
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    os.makedirs(a.out, exist_ok=True)
    for pl, _, batch in a.points:
        for kind in a.caches:
            run(kind, pl, a.profile, batch)  # unprofiled: this point's shapes warm
            t0 = time.perf_counter()
            run(kind, pl, a.profile, batch)
            plain = time.perf_counter() - t0
            with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                run(kind, pl, a.profile, batch)
            ev = prof.key_averages()
            dev_key = "self_device_time_total" if hasattr(ev[0], "self_device_time_total") else "self_cuda_time_total"
            gpu_us = sum(getattr(e, dev_key) for e in ev)
            head = ("%s prompt %d batch %d, %d new tokens: %.3f s unprofiled (%.2f ms a token step); "
                    "GPU kernels %.2f ms a step" % (kind, pl, batch, a.profile, plain, 1e3 * plain / a.profile,
                                                    gpu_us / 1e3 / a.profile))
            print(head, flush=True)
            name = os.path.join(a.out, "profile-%s-%d-%d.txt" % (kind, pl, batch))
            with open(name, "w") as f:
                f.write(head + "\n\n")
                f.write(ev.table(sort_by=dev_key, row_limit=25) + "\n\n")
                f.write(ev.table(sort_by="self_cpu_time_total", row_limit=40) + "\n")
    return 0


def main():
    a = parse()
    if a.merge:
        return merge(a)
    try:
        import torch
        import transformers
        from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, StaticCache
    except Exception as e:
        print("kv_transformers: skipped: torch/transformers not importable (%s)" % e)
        return 77
    if not torch.cuda.is_available():
        print("kv_transformers: skipped: no CUDA device")
        return 77
    import vmmalloc
    from vmmalloc.hf import VmmCache

    dev = torch.device("cuda", 0)
    dtype = getattr(torch, a.dtype)
    max_len = max(pl + nt for pl, nt, _ in a.points)
    cfg = LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.hidden * 11 // 4,
                      num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                      head_dim=a.hidden // a.heads, max_position_embeddings=max(max_len, 4096), rms_norm_eps=1e-5,
                      tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=None,
                      attn_implementation=a.attn)
    torch.manual_seed(1234)
    model = LlamaForCausalLM(cfg).to(device=dev, dtype=dtype).eval()
    gen_cfg = model.generation_config
    gen_cfg.eos_token_id = None  # fixed lengths: every run decodes exactly `new` tokens
    gen_cfg.pad_token_id = 0
    if hasattr(gen_cfg, "disable_compile"):
        gen_cfg.disable_compile = not a.static_compile
    token_bytes = a.kv_heads * (a.hidden // a.heads) * torch.empty((), dtype=dtype).element_size()
    meta = {
        "device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
        "transformers": transformers.__version__, "vmmalloc_library": vmmalloc.find_library(),
        "model": {"layers": a.layers, "hidden": a.hidden, "heads": a.heads, "kv_heads": a.kv_heads,
                  "head_dim": a.hidden // a.heads, "vocab": a.vocab, "dtype": a.dtype, "attn": a.attn,
                  "parameters": sum(p.numel() for p in model.parameters())},
        "token_bytes_per_layer_kv": token_bytes, "caches": a.caches, "budget_s": a.budget,
        "map_ahead_tokens": a.map_ahead_tokens, "layer_groups": a.layer_groups, "static_compile": a.static_compile,
    }
    print("%s; torch %s, transformers %s; Llama %d layers, hidden %d, %d/%d heads, %s, %s; %d parameters"
          % (meta["device"], meta["torch"], meta["transformers"], a.layers, a.hidden, a.heads, a.kv_heads,
             a.dtype, a.attn, meta["model"]["parameters"]), flush=True)

    def prompts(pl, batch):
        g = torch.Generator().manual_seed(pl * 1000 + batch)
        ids = torch.zeros(batch, pl, dtype=torch.long)
        mask = torch.zeros(batch, pl, dtype=torch.long)
        for b in range(batch):
            n = max(1, pl - (pl * b) // 16)  # row b is b/16 shorter: left padding
            ids[b, pl - n:] = torch.randint(3, a.vocab, (n,), generator=g)
            mask[b, pl - n:] = 1
        return ids.to(dev), mask.to(dev)

    class PeakCache(VmmCache):
        """VmmCache that also measures the peak of the sum torch + mapped. Its mapped bytes change
        only when pages are mapped: there the torch peak of the interval that ended is added to the
        bytes mapped during it, and torch's peak counter starts again (exact, not sampled)."""

        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            self.sum_peak = self.torch_peak = 0
            self._mapped_now = 0

        def _note_peak(self):  # VmmCache calls it whenever its mapped bytes may have changed
            super()._note_peak()
            self._interval_ends()

        def _interval_ends(self):
            t = torch.cuda.max_memory_allocated(dev)
            self.torch_peak = max(self.torch_peak, t)
            self.sum_peak = max(self.sum_peak, t + self._mapped_now)
            torch.cuda.reset_peak_memory_stats(dev)
            self._mapped_now = self._kv.stats()["mapped_bytes"] if self._kv is not None else 0

    def make_cache(kind, batch, length):
        if kind == "dynamic":
            return DynamicCache(config=model.config)
        if kind == "static":
            return StaticCache(config=model.config, max_cache_len=length)
        return PeakCache(model.config, max_batch_size=batch, max_cache_len=length,
                         map_ahead_tokens=a.map_ahead_tokens, layer_groups=a.layer_groups)

    def run(kind, pl, nt, batch):
        ids, mask = prompts(pl, batch)
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
        cache = make_cache(kind, batch, pl + nt)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=nt,
                                 do_sample=False)
        torch.cuda.synchronize()
        secs = time.perf_counter() - t0
        r = {"cache": kind, "prompt": pl, "new": nt, "batch": batch, "seconds": secs,
             "tokens_per_s": batch * nt / secs, "torch_peak_allocated": torch.cuda.max_memory_allocated(dev),
             "torch_peak_reserved": torch.cuda.max_memory_reserved(dev), "torch_base_allocated": base,
             "kv_logical_bytes": 2 * a.layers * batch * (pl + nt) * token_bytes}
        r["vmm_peak_mapped"] = 0
        if kind == "vmm":
            cache._interval_ends()
            r["peak_of_sum"] = cache.sum_peak
            r["torch_peak_allocated"] = cache.torch_peak  # over every interval
            m = cache.memory()
            r["vmm_peak_mapped"] = m["peak_mapped_bytes"]
            r["vmm_driver_calls"] = m["driver_calls"]
            r["vmm_used_bytes"] = m["used_bytes"]
            r["vmm_layer_groups"] = cache.layer_groups
            cache.destroy()
        if kind != "vmm":
            r["peak_of_sum"] = r["torch_peak_allocated"]
        r["peak_bytes"] = r["peak_of_sum"]
        r["sum_of_peaks"] = r["torch_peak_allocated"] + r["vmm_peak_mapped"]  # an upper bound of peak_bytes
        r["kv_bytes"] = r["vmm_peak_mapped"] if kind == "vmm" else (
            2 * a.layers * batch * (pl + nt) * token_bytes if kind == "static" else r["kv_logical_bytes"])
        tokens = out[:, pl:].cpu()
        if tokens.shape != (batch, nt):
            raise RuntimeError("%s generated %s tokens, not %s" % (kind, tuple(tokens.shape), (batch, nt)))
        if a.save_tokens and (pl, nt, batch) != WARMUP:
            os.makedirs(a.out, exist_ok=True)
            torch.save(tokens, os.path.join(a.out, token_file(kind, pl, nt, batch)))
        del cache, out
        return r, tokens

    # Warm-up: kernels, cuBLAS handles, the allocator's first segments, vmmalloc's library.
    for kind in a.caches:
        run(kind, *WARMUP)

    if a.profile:
        return profile(a, run, dev)

    rows, failures, notes = [], [], []
    per_step = {}    # batch -> seconds per generated token step (the slowest cache so far)
    point_secs = {}  # (prompt, new, batch) -> the slowest run of that point so far
    for pl, nt, batch in a.points:
        ref = None
        for kind in a.caches:
            elapsed = time.perf_counter() - T_START
            est = None
            if (pl, nt, batch) in point_secs:  # another cache ran this point: about the same time
                est = point_secs[(pl, nt, batch)] * 1.05 + 2.0
            elif per_step:  # seconds per decode step measured so far: the same batch, else the slowest
                sps = per_step.get(batch, max(per_step.values()))
                est = nt * sps * 1.15 + 2.0 + pl * batch / 20000.0  # decode + prefill, generous
            if a.budget is not None and est is not None and elapsed + est > a.budget:
                rows.append({"cache": kind, "prompt": pl, "new": nt, "batch": batch, "skipped": "budget",
                             "estimated_s": est})
                print("skip  %-7s prompt %5d new %5d batch %d: ~%.0f s does not fit the budget (%.0f of %.0f s used)"
                      % (kind, pl, nt, batch, est, elapsed, a.budget), flush=True)
                continue
            try:
                r, tokens = run(kind, pl, nt, batch)
            except Exception as e:
                traceback.print_exc()
                r = {"cache": kind, "prompt": pl, "new": nt, "batch": batch, "error": "%s: %s" % (type(e).__name__, e)}
                rows.append(r)
                if kind != "static" or a.strict_static:
                    failures.append("%s prompt %d new %d batch %d: %s" % (kind, pl, nt, batch, r["error"]))
                else:
                    notes.append("static prompt %d new %d batch %d failed: %s" % (pl, nt, batch, r["error"]))
                continue
            per_step[batch] = max(per_step.get(batch, 0.0), r["seconds"] / nt)
            point_secs[(pl, nt, batch)] = max(point_secs.get((pl, nt, batch), 0.0), r["seconds"])
            if kind == "dynamic":
                ref = tokens
                r["tokens_equal"] = True
            elif ref is None:
                r["tokens_equal"] = None
            else:
                compare(kind, pl, nt, batch, tokens, ref, r, failures, notes, a.strict_static)
            rows.append(r)
            print("%-7s prompt %5d new %5d batch %d: %7.2f s, %8.1f tok/s, peak %8.1f MiB, kv %8.1f MiB, equal %s"
                  % (kind, pl, nt, batch, r["seconds"], r["tokens_per_s"], r["peak_bytes"] / 2**20,
                     r["kv_bytes"] / 2**20, r["tokens_equal"]), flush=True)

    total = time.perf_counter() - T_START
    md = table(rows, meta, total, failures, notes)
    print()
    print(md)
    os.makedirs(a.out, exist_ok=True)
    result = {"meta": meta, "rows": rows, "failures": failures, "notes": notes, "seconds": total,
              "passed": not failures}
    with open(os.path.join(a.out, "kv_transformers.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(a.out, "kv_transformers.md"), "w") as f:
        f.write(md + "\n")
    print("written: %s/kv_transformers.{json,md}" % a.out)
    print("kv_transformers: %s (%.0f s)" % ("passed" if not failures else "FAILED", total))
    return 0 if not failures else 1


def compare(kind, pl, nt, batch, tokens, ref, r, failures, notes, strict_static):
    """Sets r["tokens_equal"] (and the first difference); a VmmCache mismatch is a failure."""
    import torch
    eq = torch.equal(tokens, ref)
    r["tokens_equal"] = bool(eq)
    if eq:
        return
    diff = (tokens != ref).nonzero()
    row, pos = int(diff[0, 0]), int(diff[0, 1])
    r["first_difference"] = {"row": row, "position": pos, "differing": int(diff.shape[0])}
    msg = ("%s prompt %d new %d batch %d: tokens differ from DynamicCache's (first at row %d, new token %d; "
           "%d of %d differ)" % (kind, pl, nt, batch, row, pos, diff.shape[0], tokens.numel()))
    if kind == "vmm" or strict_static:
        failures.append(msg)
    else:
        notes.append(msg + " -- StaticCache sums over max_cache_len: another order")


def merge(a):
    """Joins the rows of runs made in separate processes (--save-tokens) and compares their tokens."""
    import torch
    runs = []
    for d in a.merge:
        with open(os.path.join(d, "kv_transformers.json")) as f:
            runs.append((d, json.load(f)))
    meta = dict(runs[0][1]["meta"])
    devices = sorted({r["meta"]["device"] for _, r in runs})
    meta["device"] = " / ".join(devices)
    meta["caches"] = sorted({c for _, r in runs for c in r["meta"]["caches"]}, key=CACHES.index)
    rows, failures, notes = [], [], []
    where = {}  # (prompt, new, batch) -> the directory of DynamicCache's tokens
    for d, r in runs:
        failures += r["failures"]
        notes += r["notes"]
        for row in r["rows"]:
            row = dict(row, process=d)
            rows.append(row)
            if "seconds" in row and row["cache"] == "dynamic":
                where[(row["prompt"], row["new"], row["batch"])] = d
    for row in rows:
        if "seconds" not in row or row["cache"] == "dynamic":
            continue
        key = (row["prompt"], row["new"], row["batch"])
        if key not in where:
            row["tokens_equal"] = None
            continue
        mine = os.path.join(row["process"], token_file(row["cache"], *key))
        ref = os.path.join(where[key], token_file("dynamic", *key))
        if not (os.path.exists(mine) and os.path.exists(ref)):
            failures.append("%s prompt %d new %d batch %d: no saved tokens to compare (run with --save-tokens)"
                            % ((row["cache"],) + key))
            continue
        compare(row["cache"], *key, torch.load(mine), torch.load(ref), row, failures, notes, a.strict_static)
    rows.sort(key=lambda r: (r["new"], r["prompt"], r["batch"], CACHES.index(r["cache"])))
    total = max(r["seconds"] for _, r in runs)
    md = table(rows, meta, total, failures, notes)
    md += "\n\nMerged from %d processes (%s); whole run = the longest of them." % (len(runs), ", ".join(a.merge))
    print(md)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "kv_transformers.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows, "failures": failures, "notes": notes, "seconds": total,
                   "passed": not failures, "merged_from": a.merge}, f, indent=1)
    with open(os.path.join(a.out, "kv_transformers.md"), "w") as f:
        f.write(md + "\n")
    print("kv_transformers merge: %s" % ("passed" if not failures else "FAILED"))
    return 0 if not failures else 1


def mib(n):
    return "%.1f" % (n / 2**20)


def table(rows, meta, total, failures, notes):
    m = meta["model"]
    out = ["### transformers generate(): DynamicCache vs StaticCache vs VmmCache", "",
           "%s, torch %s, transformers %s. Llama %d layers, hidden %d, %d heads / %d KV heads of %d, %s, %s "
           "attention, greedy, left-padded prompts. Peak = the most torch.cuda.memory_allocated plus "
           "vmmalloc's mapped bytes held at one time (for VmmCache measured at every page mapping: torch's "
           "peak of each interval plus what was mapped during it; torch's peak alone for the others). "
           "KV = the cache's bytes (VmmCache: mapped; StaticCache: preallocated; DynamicCache: its tensors at the "
           "end)." % (meta["device"], meta["torch"], meta["transformers"],
                                                      m["layers"], m["hidden"], m["heads"], m["kv_heads"],
                                                      m["head_dim"], m["dtype"], m["attn"]), "",
           "| prompt | new | batch | cache | time s | tokens/s | peak MiB | torch peak + mapped peak MiB | KV MiB | "
           "tokens == Dynamic |",
           "|---:|---:|---:|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        head = "| %d | %d | %d | %s " % (r["prompt"], r["new"], r["batch"], r["cache"])
        if "skipped" in r:
            out.append(head + "| skipped (time budget: ~%.0f s) | | | | | |" % r["estimated_s"])
        elif "error" in r:
            out.append(head + "| error: %s | | | | | |" % r["error"].replace("|", "/")[:120])
        else:
            eq = {True: "yes", False: "**NO**", None: "-"}[r["tokens_equal"]]
            out.append(head + "| %.2f | %.1f | %s | %s | %s | %s |" % (
                r["seconds"], r["tokens_per_s"], mib(r["peak_bytes"]),
                mib(r["sum_of_peaks"]) if r["cache"] == "vmm" else "-", mib(r["kv_bytes"]), eq))
    out.append("")
    out.append("Whole run: %.0f s. %s" % (total, "PASSED" if not failures else "FAILED"))
    for f in failures:
        out.append("- FAIL: " + f)
    for n in notes:
        out.append("- note: " + n)
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
