#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""CUDA tensors sent to another process with torch.multiprocessing, per allocator.

    python3 bench/torch_share.py [--allocators caching,expandable,vmmalloc] [--rounds 5]
                                 [--workload activations|params]
    python3 bench/torch_share.py --probe     # vmmalloc's share / import / close, per block

For each allocator a parent process (PyTorch's caching allocator, expandable segments, or vmmalloc
in extension mode with VMMALLOC_IPC=posix_fd) spawns a child under the same allocator. Each round
the parent makes fresh tensors, pickles them as torch.multiprocessing's queues do (ForkingPickler:
this is where the sender shares them), puts the bytes on a queue, and the child unpickles them
(rebuild_cuda_tensor: the imports), sums them on the GPU and answers. Workloads:
  activations  64 tensors of 4 MiB and one of 300 MiB
  params       a model's parameters: 64 layers of a 1024 x 1024 weight (4 MiB) and a 1024 bias
The parent times pickle -> answer and checks the sums. One JSON line per allocator: median and all
rounds in ms, the first round apart (it maps the most), the medians of the phases (share: the
parent's pickling; import: the child's unpickling; sum: the child's kernels and reads; rest: the
queue both ways), and whether every sum was right.
"""

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools", "python"))

SMALL, NSMALL, BIG = 1 << 20, 64, 75 << 20  # float32 elements: 4 MiB x 64, 300 MiB
LAYERS, WIDTH = 64, 1024


def make(workload, r):
    """The round's tensors and the sum the child must find."""
    import torch

    if workload == "params":
        ts = []
        for i in range(LAYERS):
            ts.append(torch.full((WIDTH, WIDTH), float(i + r), device="cuda"))
            ts.append(torch.full((WIDTH,), 1.0, device="cuda"))
        return ts, sum(float(i + r) * WIDTH * WIDTH + WIDTH for i in range(LAYERS))
    ts = [torch.full((SMALL,), float(i + r), device="cuda") for i in range(NSMALL)]
    ts.append(torch.full((BIG,), 1.0, device="cuda"))
    return ts, sum(float(i + r) * SMALL for i in range(NSMALL)) + float(BIG)


def setup(allocator):
    if allocator == "vmmalloc":
        import vmmalloc_torch as vt

        vt.enable()
        return vt.mode()
    return "native"


def child(allocator, inbox, outbox):
    try:
        setup(allocator)
        import torch
        from multiprocessing.reduction import ForkingPickler

        while True:
            raw = inbox.get()
            if raw is None:
                break
            t0 = time.perf_counter()
            msg = ForkingPickler.loads(raw)
            t1 = time.perf_counter()
            total = sum(float(t.sum()) for t in msg)
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            outbox.put((total, t1 - t0, t2 - t1))
            del msg
    except Exception as e:
        outbox.put("error: %s: %s" % (type(e).__name__, e))


def parent(allocator, rounds, workload):
    mode = setup(allocator)
    import torch
    import torch.multiprocessing as mp
    from multiprocessing.reduction import ForkingPickler

    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=child, args=(allocator, inbox, outbox))
    p.start()
    times, phases, ok = [], [], True
    for r in range(rounds):
        ts, want = make(workload, r)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        raw = bytes(ForkingPickler.dumps(ts))
        t1 = time.perf_counter()
        inbox.put(raw)
        got = outbox.get(timeout=300)
        t2 = time.perf_counter()
        times.append((t2 - t0) * 1e3)
        if not isinstance(got, tuple) or got[0] != want:
            ok = False
            print("round %d: %s (want %s)" % (r, got, want), file=sys.stderr)
            break
        share, imp, sm = (t1 - t0) * 1e3, got[1] * 1e3, got[2] * 1e3
        phases.append((share, imp, sm, times[-1] - share - imp - sm))
        del ts, raw
        torch.cuda.ipc_collect()
    inbox.put(None)
    p.join(120)
    later = phases[1:] or phases
    med = {k: round(statistics.median(ph[i] for ph in later), 2) for i, k in enumerate(("share", "import", "sum", "rest"))} if later else None
    return {"allocator": allocator, "workload": workload, "mode": mode, "torch": torch.__version__,
            "first_ms": round(times[0], 2) if times else None,
            "median_ms": round(statistics.median(times[1:] or times), 2) if times else None,
            "phases_median_ms": med, "rounds_ms": [round(t, 2) for t in times], "sums_right": ok and p.exitcode == 0}


def probe(rounds):
    """In one process, through ctypes: what vmm_torch_share, vmm_torch_import (of this process's own
    handle: dup instead of pidfd_getfd) and vmm_torch_close_import cost per block, by size."""
    import ctypes

    os.environ["VMMALLOC_IPC"] = "posix_fd"
    import torch
    import vmmalloc_torch as vt

    vt.enable()
    lib = vt.load()
    lib.vmm_torch_share.restype = ctypes.c_int64
    lib.vmm_torch_share.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int64]
    lib.vmm_torch_import.restype = ctypes.c_void_p
    lib.vmm_torch_import.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int64]
    lib.vmm_torch_close_import.argtypes = [ctypes.c_void_p]
    lib.vmm_torch_last_error.restype = ctypes.c_char_p
    buf = ctypes.create_string_buffer(1 << 16)
    errors = []

    def share(p):
        n = lib.vmm_torch_share(p, buf, len(buf))
        if n < 0:
            errors.append("share: " + lib.vmm_torch_last_error().decode())
            return None
        return buf.raw[:n]

    def imp(h):
        q = lib.vmm_torch_import(0, h, len(h)) if h else None
        if h and not q:
            errors.append("import: " + lib.vmm_torch_last_error().decode())
        return q

    for size, n in ((4 << 20, 64), (64 << 10, 64), (300 << 20, 4)):
        for r in range(rounds):
            ts = [torch.empty(size, dtype=torch.uint8, device="cuda") for _ in range(n)]
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            del errors[:]
            hs = [share(t.data_ptr()) for t in ts]
            t1 = time.perf_counter()
            ps = [imp(h) for h in hs]
            t2 = time.perf_counter()
            for q in ps:
                if q:
                    lib.vmm_torch_close_import(q)
            t3 = time.perf_counter()
            fds = sum(int.from_bytes(h[12:16], "little") for h in hs if h)  # the handle's fd count
            print(json.dumps({"bytes": size, "blocks": n, "round": r, "share_us": round((t1 - t0) / n * 1e6, 1),
                              "import_us": round((t2 - t1) / n * 1e6, 1), "close_us": round((t3 - t2) / n * 1e6, 1),
                              "chunks_per_block": fds / n, "ok": all(ps), "errors": len(errors),
                              "first_errors": sorted(set(errors))[:3]}), flush=True)
            del ts


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--allocators", default="caching,expandable,vmmalloc")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--workload", choices=("activations", "params"), default="activations")
    ap.add_argument("--probe", action="store_true",
                    help="vmmalloc only, one process: share / import / close costs per block by size")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one allocator in this process
    a = ap.parse_args()
    if a.probe:
        probe(min(a.rounds, 3))
        return 0
    if a.one:
        print(json.dumps(parent(a.one, a.rounds, a.workload)), flush=True)
        return 0
    import subprocess

    rc = 0
    for name in a.allocators.split(","):
        env = dict(os.environ)
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        if name == "expandable":
            env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        if name == "vmmalloc":
            env["VMMALLOC_IPC"] = "posix_fd"
        r = subprocess.run([sys.executable, __file__, "--one", name, "--rounds", str(a.rounds),
                            "--workload", a.workload], env=env,
                           capture_output=True, text=True, timeout=600)
        line = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else json.dumps(
            {"allocator": name, "error": (r.stderr or "")[-800:]})
        print(line, flush=True)
        rc |= r.returncode
    return rc


if __name__ == "__main__":
    sys.exit(main())
