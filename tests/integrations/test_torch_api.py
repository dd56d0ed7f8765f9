#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""vmmalloc as PyTorch's allocator: tensors, streams, out of memory, stats, trim, peers (GPU).

Exit 0: passed. 77: no torch or no CUDA device. 1: a failure (each check is printed).
Needs libvmmalloc_torch.so: $VMMALLOC_TORCH_LIB (set by ctest) or a build next to the sources.
"""

import gc
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools", "python"))

from checks import SKIP, expect, failures, torch_or_skip  # noqa: E402  (tests/integrations/checks.py)


def main():
    torch = torch_or_skip("test_torch_api")
    if torch is None:
        return SKIP
    import vmmalloc_torch as vt

    print("library:", vt.enable())
    expect(vt.enabled(), "enabled")
    print("config:", vt.config(0))
    s0 = vt.stats(0)
    expect(s0 is not None and s0["allocs"] == 0, "device 0's allocator exists, nothing allocated yet")

    # Tensors of many sizes: values right, blocks counted, all back after del.
    sizes = [1, 100, 4096, 65536, 1 << 20, 5 << 20, 64 << 20, 300 << 20]
    # int32: exact sums (float32 sums of 300 Mi elements would round)
    ts = [torch.full((n,), i + 1, dtype=torch.int32, device="cuda") for i, n in enumerate(sizes)]
    expect(all(t.sum().item() == (i + 1) * n for i, (t, n) in enumerate(zip(ts, sizes))),
           "tensors of 1 .. 300 Mi elements hold their values")
    s = vt.stats(0)
    want = sum(4 * n for n in sizes)
    expect(s["live"] >= len(sizes) and s["requested"] >= want,
           "stats: %d live, %d requested bytes >= %d" % (s["live"], s["requested"], want))
    expect(s["peak_mapped"] >= want and s["mapped"] >= want, "mapped %d >= the tensors' bytes" % s["mapped"])
    live_before = s["live"]
    del ts
    gc.collect()
    torch.cuda.synchronize()
    s = vt.stats(0)
    expect(s["live"] <= live_before - len(sizes), "del: %d live -> %d" % (live_before, s["live"]))

    # Empty tensors: size-0 requests never reach vmmalloc as failures.
    e = torch.empty(0, device="cuda")
    expect(e.numel() == 0 and vt.stats(0)["malloc_failures"] == 0, "empty tensor")

    # A side stream: allocated there, freed there, reused safely by the default stream.
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        y = torch.ones(1 << 22, dtype=torch.float64, device="cuda") * 3
        z = (y * 2).sum()
    side.synchronize()
    expect(z.item() == 6.0 * (1 << 22), "side-stream computation")
    del y, z
    w = torch.arange(1 << 22, device="cuda", dtype=torch.float64)
    expect(w.sum().item() == float((1 << 22) * ((1 << 22) - 1) // 2), "default stream after side-stream frees")
    del w

    # Out of memory: a clear error (torch.OutOfMemoryError through the extension, RuntimeError
    # under the plain pluggable allocator), worded as PyTorch's own begins ("CUDA out of memory.",
    # which batch-size finders match), the reason in last_error(), and the allocator keeps serving.
    try:
        torch.empty(1 << 48, dtype=torch.uint8, device="cuda")
        expect(False, "a 256 TiB tensor raises")
    except (RuntimeError, MemoryError) as ex:
        msg = str(ex)
        expect("CUDA out of memory. vmmalloc cannot allocate" in msg,
               "256 TiB raises %s: %s" % (type(ex).__name__, msg[:200]))
        if vt.mode() == "extension":
            expect(isinstance(ex, torch.OutOfMemoryError), "extension mode: torch.OutOfMemoryError (%s)" %
                   type(ex).__name__)
    expect("cannot allocate" in vt.last_error(), "last_error(): " + vt.last_error()[:200])
    expect(vt.stats(0)["malloc_failures"] == 1, "the failure is counted")
    a = torch.randn(1 << 20, device="cuda")
    expect(torch.isfinite(a).all().item(), "allocations work after the failure")
    del a

    # trim returns free chunks; peaks reset; invariants hold.
    gc.collect()
    torch.cuda.synchronize()
    before = vt.stats(0)
    vt.trim()
    after = vt.stats(0)
    expect(after["free_chunk_bytes"] == 0 and after["idle"] == 0 and
           before["mapped"] - after["mapped"] >= before["free_chunk_bytes"],
           "trim: mapped %d -> %d, free chunks %d -> 0, idle %d -> %d" % (
               before["mapped"], after["mapped"], before["free_chunk_bytes"], before["idle"], after["idle"]))
    vt.reset_peaks()
    expect(vt.stats(0)["peak_mapped"] == vt.stats(0)["mapped"], "reset_peaks")
    expect(vt.check() == "", "check()")

    # PyTorch's own memory statistics and empty_cache: vmmalloc's, through the extension (the plain
    # pluggable allocator refuses the statistics with an error and ignores empty_cache).
    if vt.mode() == "extension":
        n = 256 << 20
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        a0 = torch.cuda.memory_allocated()
        x = torch.empty(n, dtype=torch.uint8, device="cuda")
        a1 = torch.cuda.memory_allocated()
        expect(a1 - a0 >= n, "torch.cuda.memory_allocated: %d -> %d for a 256 MiB tensor" % (a0, a1))
        expect(torch.cuda.max_memory_allocated() >= a1, "max_memory_allocated %d >= %d" % (
            torch.cuda.max_memory_allocated(), a1))
        expect(torch.cuda.memory_reserved() >= a1, "memory_reserved %d >= allocated" % torch.cuda.memory_reserved())
        st = torch.cuda.memory_stats()
        expect(st.get("allocation.all.current", 0) >= 1 and st.get("requested_bytes.all.current", 0) >= n,
               "memory_stats: %d allocations, %d requested bytes" % (
                   st.get("allocation.all.current", 0), st.get("requested_bytes.all.current", 0)))
        expect("allocated" in torch.cuda.memory_summary().lower(), "memory_summary() prints")
        # torch.cuda.memory_snapshot() and memory._snapshot(): vmmalloc's memory map in PyTorch's
        # form (segments of mapped memory whose blocks tile them), as memory_viz reads it.
        torch.cuda.synchronize()
        expect(vt.extension_info()["snapshot"], "extension: snapshot() reaches vmmalloc in torch %s" % torch.__version__)
        snap = torch.cuda.memory._snapshot()
        segs = snap["segments"]
        found = [b for sg in segs for b in sg["blocks"] if b["address"] == x.data_ptr()]
        expect(len(found) == 1 and found[0]["state"] == "active_allocated" and found[0]["requested_size"] == n,
               "memory_snapshot: the 256 MiB tensor is one active_allocated block of %s requested bytes" %
               [b["requested_size"] for b in found])
        expect(all(sum(b["size"] for b in sg["blocks"]) == sg["total_size"] for sg in segs),
               "memory_snapshot: the blocks of each of %d segments tile it" % len(segs))
        alloc_sum = sum(sg["allocated_size"] for sg in segs)
        expect(alloc_sum == torch.cuda.memory_allocated(),
               "memory_snapshot: allocated_size sums to memory_allocated (%d, %d)" % (alloc_sum, torch.cuda.memory_allocated()))
        expect(sum(sg["total_size"] for sg in segs) <= torch.cuda.memory_reserved(),
               "memory_snapshot: segments within memory_reserved")
        expect(len(torch.cuda.memory_snapshot()) == len(segs), "torch.cuda.memory_snapshot() lists the same segments")
        from torch.cuda import _memory_viz
        html = _memory_viz.segment_plot(snap)
        expect(isinstance(html, str) and len(html) > 1000, "memory_viz.segment_plot renders the snapshot (%d chars)" % len(html))
        with tempfile.TemporaryDirectory() as d:
            torch.cuda.memory._dump_snapshot(os.path.join(d, "snap.pickle"))
            expect(os.path.getsize(os.path.join(d, "snap.pickle")) > 0, "memory._dump_snapshot writes a pickle")
        # _record_memory_history: the trace memory_viz's timelines draw, with Python stacks.
        torch.cuda.memory._record_memory_history(max_entries=1000, stacks="python")
        y = torch.empty(3 << 20, dtype=torch.uint8, device="cuda")
        yp = y.data_ptr()
        live = torch.cuda.memory._snapshot()
        yb = [b for sg in live["segments"] for b in sg["blocks"] if b["address"] == yp]
        expect(len(yb) == 1 and any("test_torch_api" in f.get("filename", "") for f in yb[0]["frames"]),
               "history: the live block carries the frame that allocated it")
        del y
        h = torch.cuda.memory._snapshot()
        trace = h["device_traces"][0] if h["device_traces"] else []
        allocs = [e for e in trace if e["action"] == "alloc" and e["addr"] == yp]
        frees = [e for e in trace if e["action"] == "free_completed" and e["addr"] == yp]
        expect(len(allocs) == 1 and len(frees) == 1 and allocs[0]["size"] == 3 << 20,
               "history: alloc and free_completed of the 3 MiB tensor (%d entries)" % len(trace))
        expect(bool(allocs) and any("test_torch_api" in f.get("filename", "") for f in allocs[0]["frames"]),
               "history: the alloc entry carries this file's Python frame")
        html = _memory_viz.trace_plot(h)
        expect(isinstance(html, str) and len(html) > 1000, "memory_viz.trace_plot renders the trace (%d chars)" % len(html))
        torch.cuda.memory._record_memory_history(enabled=None)
        z = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
        after = torch.cuda.memory._snapshot()["device_traces"]
        expect(not any(e["addr"] == z.data_ptr() and e["size"] == 1 << 20 for t in after for e in t),
               "history off: nothing more recorded")
        del z
        del x
        a2 = torch.cuda.memory_allocated()
        expect(a2 < a0 + n, "memory_allocated after del: %d" % a2)
        r0 = torch.cuda.memory_reserved()
        torch.cuda.empty_cache()
        r1 = torch.cuda.memory_reserved()
        expect(r1 <= r0 - n, "empty_cache gives the freed 256 MiB back: reserved %d -> %d" % (r0, r1))
        torch.cuda.reset_peak_memory_stats()
        expect(torch.cuda.max_memory_allocated() < a0 + n, "reset_peak_memory_stats: peak %d" %
               torch.cuda.max_memory_allocated())

        # cuDNN's benchmark mode asks the allocator for its largest free block before it searches
        # algorithms (cacheInfo); the plain pluggable allocator refuses, failing every convolution.
        torch.backends.cudnn.benchmark = True
        try:
            conv = torch.nn.Conv2d(16, 32, 3, padding=1).cuda()
            xin = torch.randn(8, 16, 64, 64, device="cuda", requires_grad=True)
            y = conv(xin)
            y.sum().backward()
            ref = torch.nn.functional.conv2d(xin.detach().double(), conv.weight.detach().double(),
                                             conv.bias.detach().double(), padding=1)
            expect(torch.allclose(y.detach().double(), ref, rtol=1e-2, atol=1e-2) and
                   xin.grad is not None and torch.isfinite(xin.grad).all().item(),
                   "cudnn.benchmark: a convolution's forward and backward run and match float64")
        except RuntimeError as ex:
            expect(False, "cudnn.benchmark convolution raised: %s" % str(ex)[:300])
        finally:
            torch.backends.cudnn.benchmark = False

        # set_per_process_memory_fraction: vmmalloc's limit on what it holds (the plain pluggable
        # allocator drops the setting); get_per_process_memory_fraction reads it back.
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(0).total_memory
        held = torch.cuda.memory_reserved()
        frac = (held + (512 << 20)) / total  # 512 MiB of room
        torch.cuda.set_per_process_memory_fraction(frac, 0)
        expect(abs(vt.memory_fraction(0) - frac) < 1e-6, "set_per_process_memory_fraction(%.5f): vmmalloc's "
               "limit reads %.5f" % (frac, vt.memory_fraction(0)))
        if hasattr(torch.cuda, "get_per_process_memory_fraction"):
            got = torch.cuda.get_per_process_memory_fraction(0)
            expect(abs(got - frac) < 1e-6, "get_per_process_memory_fraction: %.5f" % got)
        try:
            torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
            expect(False, "1 GiB past a 512 MiB room raises")
        except torch.OutOfMemoryError as ex:
            expect("limit" in str(ex), "1 GiB past the fraction raises %s: %s" % (type(ex).__name__, str(ex)[:200]))
        # (no .sum() here: a uint8 sum makes an int64 copy, 8x the tensor)
        x = torch.ones(256 << 20, dtype=torch.uint8, device="cuda")
        expect(x[-1].item() == 1 and torch.cuda.memory_reserved() <= frac * total,
               "256 MiB fits under the fraction; reserved %d <= %d" % (torch.cuda.memory_reserved(), frac * total))
        del x
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
        y = torch.ones(1 << 30, dtype=torch.uint8, device="cuda")
        expect(y[-1].item() == 1 and vt.memory_fraction(0) == 1.0, "fraction 1.0: 1 GiB fits")
        del y
        # Lowered below what is held: free memory goes back at once, the live tensor stays, and
        # new memory is refused while what is held is past the limit.
        keep = torch.ones(256 << 20, dtype=torch.uint8, device="cuda")
        spare = torch.ones(512 << 20, dtype=torch.uint8, device="cuda")
        del spare
        torch.cuda.synchronize()
        before = vt.stats(0)
        low = (before["allocated"] + (64 << 20)) / total
        torch.cuda.set_per_process_memory_fraction(low, 0)
        after = vt.stats(0)
        expect(after["physical"] + (512 << 20) <= before["physical"],
               "fraction lowered below what is held (%d bytes, %d live): the freed 512 MiB went back, "
               "held %d" % (before["physical"], before["allocated"], after["physical"]))
        expect(keep[-1].item() == 1 and after["allocated"] == before["allocated"],
               "the live 256 MiB tensor stays (allocated %d)" % after["allocated"])
        try:
            torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
            expect(False, "256 MiB past the lowered fraction raises")
        except torch.OutOfMemoryError as ex:
            expect("limit" in str(ex), "256 MiB past the lowered fraction raises: %s" % str(ex)[:200])
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
        z = torch.ones(256 << 20, dtype=torch.uint8, device="cuda")
        expect(z[-1].item() == 1 and keep[-1].item() == 1, "fraction raised again: 256 MiB fits")
        del z, keep
    else:
        print("skip  PyTorch memory statistics: mode %r" % vt.mode())

    # Peers: memory of device 1 read by device 0's copy engine needs the access vmmalloc grants.
    n = torch.cuda.device_count()
    if n >= 2:
        can = torch.cuda.can_device_access_peer(0, 1)  # may device 0 access device 1's memory
        want_peers = sum(torch.cuda.can_device_access_peer(p, 1) for p in range(n) if p != 1)
        x1 = torch.arange(1 << 22, device="cuda:1", dtype=torch.float32)
        s1 = vt.stats(1)
        expect(s1 is not None and s1["live"] >= 1, "device 1 has its own allocator: " + vt.config(1))
        expect(s1["peers"] == want_peers, "device 1 grants access to %d peer(s) (want %d)" % (s1["peers"], want_peers))
        x0 = x1.to("cuda:0")
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        expect(torch.equal(x0.cpu(), x1.cpu()), "cuda:1 -> cuda:0 copy (peer access %s)" % can)
        del x0, x1
        expect(vt.check() == "", "check() on both devices")
    else:
        print("skip  peer checks: one GPU")

    print()
    if failures:
        print("test_torch_api: %d FAILED" % len(failures))
        return 1
    print("test_torch_api: passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
