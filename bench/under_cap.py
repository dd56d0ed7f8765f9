#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The largest training batch each CUDA allocator fits under one memory cap, in real processes.

What a user does when memory is the limit: cap the process
(torch.cuda.set_per_process_memory_fraction) and search the batch size, catching
torch.OutOfMemoryError, freeing, and trying again (accelerate's find_executable_batch_size,
Lightning's batch-size finder). The allocator that wastes less fits the larger batch; one whose
out-of-memory leaves it broken fails the search.

Every allocator runs in a process of its own (chosen before the first CUDA allocation), one after
the other, on GPU 0: caching, expandable, async, vmmalloc, as in bench/real_models.py (whose model
configs and batches this reuses: by default the llama model of --full, 357 M parameters, AdamW in
bf16 autocast with fp32 master weights, PyTorch's fused attention; --model moe or bert trains that
model of --full the same way).

Per process: the cap is set (--cap-gib, as a fraction of the device's memory), the model and its
AdamW state are made (one step at batch 1), then batches of --seq tokens are searched: doubled
from --start until a step fails, then bisected; each try runs two training steps; after a failure
the process frees what the step held (gradients, the exception's frames), calls
torch.cuda.empty_cache() and goes on. The largest batch found then runs --confirm-steps more
steps (their median time is reported) and the peaks are read:
  held       caching, expandable: torch.cuda.max_memory_reserved; vmmalloc: stats peak_physical;
             async: the pool's reserved high water (memory_stats), where PyTorch reports it
  device     device memory in use at the end of the confirm steps less that at the start
             (cudaMemGetInfo: every allocator the same way)
The cap binds what each allocator counts against the fraction: reserved memory for caching and
expandable, what vmmalloc holds (mapped and idle) for vmmalloc, and allocated bytes for
cudaMallocAsync (PyTorch checks its used bytes, not the pool's), so async's held memory may pass
the cap.

Output: a markdown table on stdout and under_cap.json in --out ($VMM_OUT, else ./under-cap-out).
Exit 0: every process ran; 1: one failed (an exception other than out of memory, a timeout);
2: usage; 77: no torch, transformers or CUDA device.

    cmake --build build --target vmmalloc_torch vmmalloc_torch_ext
    python3 bench/under_cap.py --cap-gib 24
    python3 bench/under_cap.py --self-test      # the search, against a stand-in (no GPU)
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.normpath(os.path.join(HERE, ".."))
sys.path.insert(0, HERE)
import real_models as rm  # noqa: E402  (model configs, batches, allocator settings)

GiB = float(1 << 30)


def search(fits, start, limit):
    """The largest b in [1, limit] with fits(b), given that fits(1) holds and that fitting is
    monotone: doubled from `start` until a failure, then bisected. Returns (best, tries) where
    tries lists (b, fitted) in the order asked."""
    tries = []

    def ask(b):
        ok = bool(fits(b))
        tries.append((b, ok))
        return ok

    lo, hi = 1, None  # lo fits; hi fails (None: none failed yet)
    b = max(1, min(start, limit))
    while hi is None:
        if ask(b):
            lo = b
            if b >= limit:
                return lo, tries
            b = min(limit, b * 2)
        else:
            hi = b
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ask(mid):
            lo = mid
        else:
            hi = mid
    return lo, tries


def self_test():
    failures = []
    for limit in (1, 2, 7, 64, 200):
        for cap in (1, 2, 3, 37, 57, 64, 199, 500):
            best, tries = search(lambda b: b <= cap, 8, limit)
            want = min(cap, limit)
            if best != want or len(set(b for b, _ in tries)) != len(tries):
                failures.append("limit %d cap %d: got %d (want %d), tries %s" % (limit, cap, best, want, tries))
    if parse_variant("tc0:VMMALLOC_THREAD_CACHE=0,VMMALLOC_RELEASE_THRESHOLD=0") != (
            "tc0", {"VMMALLOC_THREAD_CACHE": "0", "VMMALLOC_RELEASE_THRESHOLD": "0"}):
        failures.append("parse_variant")
    for bad in ("x", ":A=1", "x:", "x:A=1,B"):
        try:
            parse_variant(bad)
            failures.append("parse_variant(%r) accepted" % bad)
        except ValueError:
            pass
    if failures:
        print("\n".join(failures))
        return 1
    print("under_cap self-test: passed")
    return 0


# ---- the worker: one allocator in one process ----------------------------------------------------
def held_peak(torch, allocator, vt):
    if allocator == "vmmalloc":
        return vt.stats(0)["peak_physical"]
    if allocator == "async":
        st = torch.cuda.memory_stats()
        return st.get("reserved_bytes.all.peak") or None
    return torch.cuda.max_memory_reserved()


def worker(a):
    res = {"allocator": a.allocator, "status": "error", "cap_gib": a.cap_gib, "seq": a.seq}

    def save():
        with open(a.result, "w") as f:
            json.dump(res, f)

    try:
        import torch
        import transformers
    except Exception as e:
        res.update(status="skipped", reason="torch/transformers not importable (%s)" % e)
        save()
        return 77
    if not torch.cuda.is_available():
        res.update(status="skipped", reason="no CUDA device")
        save()
        return 77
    import gc

    vt = None
    if a.allocator == "vmmalloc":
        sys.path.insert(0, os.path.join(REPO, "python"))
        import vmmalloc.torch as vt

        res["vmm_library"] = vt.enable()
        res["vmm_mode"] = vt.mode()
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    torch.zeros(1, device=dev)
    free0, total = torch.cuda.mem_get_info(dev)
    fraction = a.cap_gib * GiB / total
    torch.cuda.set_per_process_memory_fraction(fraction, 0)
    if vt is not None and vt.mode() != "extension":
        vt.set_memory_fraction(fraction, 0)  # the plain pluggable allocator drops PyTorch's call
    res.update(device=torch.cuda.get_device_name(dev), torch=torch.__version__, fraction=fraction,
               alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""))

    spec = rm.MODELS[a.model]["full"]
    family = rm.MODELS[a.model]["family"]
    res["model"] = a.model
    torch.manual_seed(rm.SEED)
    model, cfg, vocab = rm.build_model(transformers, family, spec["config"], "sdpa")
    model = model.to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(rm.SEED)
    res["parameters"] = sum(p.numel() for p in model.parameters())

    def step(b):
        batch = {k: v.to(dev, non_blocking=True) for k, v in rm.make_batch(torch, family, (b, a.seq), vocab, None, g).items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    step(1)  # AdamW's state exists before the search (it is made at the first step)
    ooms = [0]
    res["oom_messages"] = []

    def oom(b, e):
        ooms[0] += 1
        note = {"batch": b, "message": str(e).split("\n")[0][:600]}
        if vt is not None:
            st = vt.stats(0)
            note["vmm"] = {k: st.get(k) for k in ("allocated", "mapped", "physical", "idle", "free_chunk_bytes",
                                                  "slab_bytes", "chunks", "live")}
        res["oom_messages"].append(note)

    def fits(b):
        try:
            for _ in range(2):
                step(b)
            return True
        except torch.OutOfMemoryError as e:
            oom(b, e)
        except RuntimeError as e:  # the plain pluggable allocator raises RuntimeError
            if "out of memory" not in str(e):
                raise
            oom(b, e)
        opt.zero_grad(set_to_none=True)
        gc.collect()
        torch.cuda.empty_cache()
        return False

    t0 = time.perf_counter()
    try:
        best, tries = search(fits, a.start, a.limit)
    except Exception as e:
        res.update(error="%s: %s" % (type(e).__name__, str(e)[:500]))
        save()
        return 1
    res.update(best=best, tries=tries, ooms=ooms[0], search_s=time.perf_counter() - t0)

    # The batch found, as a training loop would run it.
    torch.cuda.synchronize()
    if vt is not None:
        vt.reset_peaks()
    try:
        torch.cuda.reset_peak_memory_stats()
    except RuntimeError as e:  # an allocator backend without resettable peaks: say so
        res["reset_peaks"] = str(e)[:200]
    times, losses = [], []
    try:
        for _ in range(a.confirm_steps):
            torch.cuda.synchronize()
            t = time.perf_counter()
            losses.append(step(best))
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
    except Exception as e:
        res.update(error="confirm steps at batch %d: %s: %s" % (best, type(e).__name__, str(e)[:300]))
        save()
        return 1
    free1, _ = torch.cuda.mem_get_info(dev)
    res.update(status="ok", step_ms=1000 * statistics.median(times), losses=losses,
               held=held_peak(torch, a.allocator, vt), allocated=torch.cuda.max_memory_allocated()
               if a.allocator != "vmmalloc" else vt.stats(0)["peak_allocated"],
               device_used=(total - free1) - (total - free0), tokens=best * a.seq)
    if vt is not None:
        res["vmm_check"] = vt.check()
    save()
    return 0


# ---- the driver ------------------------------------------------------------------------------------
def run_one(a, allocator, out, variant=None):
    """variant: (name, {VMMALLOC_...: value}) for a vmmalloc run with options of its own."""
    tag = allocator + ("-" + variant[0] if variant else "")
    result = os.path.join(out, "under-cap-%s.json" % tag)
    log = os.path.join(out, "under-cap-%s.log" % tag)
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--allocator", allocator, "--result", result,
           "--model", a.model, "--cap-gib", str(a.cap_gib), "--seq", str(a.seq), "--start", str(a.start), "--limit", str(a.limit),
           "--confirm-steps", str(a.confirm_steps)]
    env = dict(os.environ)
    for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        env.pop(k, None)
    if rm.ALLOC_CONF[allocator]:
        env["PYTORCH_CUDA_ALLOC_CONF"] = rm.ALLOC_CONF[allocator]
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONDONTWRITEBYTECODE="1")
    if variant:
        env.update(variant[1])
    t0 = time.perf_counter()
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=a.timeout).returncode
        except subprocess.TimeoutExpired:
            rc = None
    res = {"allocator": allocator, "status": "error"}
    if os.path.exists(result):
        with open(result) as f:
            res = json.load(f)
    res["wall_s"] = time.perf_counter() - t0
    if variant:
        res["variant"] = {"name": variant[0], "env": variant[1]}
    if rc is None:
        res.update(status="timeout", error="killed after %d s" % a.timeout)
    elif rc not in (0, 77) and res.get("status") == "ok":
        res.update(status="error", error="exit %d after reporting success" % rc)
    if res.get("status") != "ok":
        with open(log, errors="replace") as f:
            res["log_tail"] = f.read()[-2000:]
    return res


def label(r):
    v = r.get("variant")
    return rm.LABEL[r["allocator"]] + (" " + " ".join("%s=%s" % kv for kv in v["env"].items()) if v else "")


def parse_variant(text):
    """NAME:KEY=VAL[,KEY=VAL...] -> (NAME, {KEY: VAL}); ValueError otherwise."""
    name, _, rest = text.partition(":")
    env = dict(kv.split("=", 1) for kv in rest.split(",") if "=" in kv)
    if not name or not env or len(env) != len([kv for kv in rest.split(",") if kv]):
        raise ValueError("--vmm-variant %r: expected NAME:KEY=VAL[,KEY=VAL...]" % text)
    return name, env


def table(runs):
    rows = ["| allocator | largest batch | tokens | out-of-memory tries | held peak GiB | device used GiB | "
            "step ms | process s |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in runs:
        if r.get("status") != "ok":
            rows.append("| %s | %s: %s | | | | | | %.0f |" % (label(r), r.get("status"),
                                                             str(r.get("error", r.get("reason", "")))[:80],
                                                             r.get("wall_s", 0)))
            continue
        held = "%.2f" % (r["held"] / GiB) if r.get("held") else "n/a"
        rows.append("| %s | %d | %d | %d | %s | %.2f | %.0f | %.0f |" % (
            label(r), r["best"], r["tokens"], r["ooms"], held, r["device_used"] / GiB,
            r["step_ms"], r["wall_s"]))
    return "\n".join(rows)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cap-gib", type=float, default=24.0)
    p.add_argument("--model", choices=["llama", "moe", "bert"], default="llama")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--start", type=int, default=8)
    p.add_argument("--limit", type=int, default=512)
    p.add_argument("--confirm-steps", type=int, default=5)
    p.add_argument("--allocators", default=",".join(rm.ALLOCATORS))
    p.add_argument("--vmm-variant", action="append", default=[],
                   help="NAME:KEY=VAL[,KEY=VAL...]: one more vmmalloc run with those variables (repeatable)")
    p.add_argument("--timeout", type=int, default=150, help="seconds per process")
    p.add_argument("--out", default=os.environ.get("VMM_OUT") or "under-cap-out")
    p.add_argument("--self-test", action="store_true")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--allocator", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.self_test:
        return self_test()
    if a.worker:
        return worker(a)
    try:
        allocators = [(al, None) for al in rm.pick(a.allocators, rm.ALLOCATORS, "allocator")]
        allocators += [("vmmalloc", parse_variant(v)) for v in a.vmm_variant]
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    os.makedirs(a.out, exist_ok=True)
    runs = []
    for al, variant in allocators:
        r = run_one(a, al, a.out, variant)
        print("%-10s %s best=%s ooms=%s held=%s (%.0f s)" % (al, r.get("status"), r.get("best"), r.get("ooms"),
                                                             r.get("held"), r["wall_s"]), flush=True)
        runs.append(r)
    md = table(runs)
    print()
    print("cap %.1f GiB, sequences of %d tokens, %s (real_models --full)" % (a.cap_gib, a.seq, a.model))
    print(md)
    with open(os.path.join(a.out, "under_cap.json"), "w") as f:
        json.dump({"model": a.model, "cap_gib": a.cap_gib, "seq": a.seq, "runs": runs}, f, indent=1)
    if all(r.get("status") == "skipped" for r in runs):
        return 77
    return 0 if all(r.get("status") == "ok" for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
