#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""MemPool mode: PyTorch's own allocator serves the process, vmmalloc serves one region of it.

    pool = vmmalloc.torch.mem_pool()     # torch.cuda.MemPool(CUDAPluggableAllocator(...).allocator())
    with torch.cuda.use_mem_pool(pool):
        ...                              # this thread's CUDA tensors come from vmmalloc

No enable() here. Checked (each printed): tensors made inside the context are vmmalloc's and those
outside are not; results are the same as outside; a CUDA graph captured into the pool
(torch.cuda.graph(pool=pool.id): PyTorch's allocator asks vmmalloc for segments DURING the capture)
replays right over fresh inputs; deleting everything and the pool gives every vmmalloc block back;
the process keeps working, and PyTorch's allocator stays "native".

Exit 0: passed. 77: no torch or no CUDA device. 1: a failure.
Needs libvmmalloc_torch.so ($VMMALLOC_TORCH_LIB, set by ctest, or a build next to the sources).
"""

import gc
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools", "python"))

from checks import SKIP, expect, failures, torch_or_skip  # noqa: E402  (tests/integrations/checks.py)


def main():
    torch = torch_or_skip("test_torch_mempool")
    if torch is None:
        return SKIP
    import torch.nn as nn
    if not hasattr(torch.cuda, "MemPool") or not hasattr(torch.cuda, "use_mem_pool"):
        expect(False, "torch %s has torch.cuda.MemPool and use_mem_pool" % torch.__version__)
        return 1
    import vmmalloc_torch as vt

    lib = vt.load()
    dev = torch.device("cuda", 0)

    def vmm(t):
        return lib.vmm_torch_device_of(t.data_ptr()) == 0

    def live():
        s = vt.stats(0)
        return 0 if s is None else s["live"]

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256)).to(dev)
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(64, 256, generator=gen).to(dev) for _ in range(12)]
    with torch.no_grad():
        ref = model(xs[0])
    expect(not vmm(ref), "outside the pool: PyTorch's allocator (not vmmalloc's memory)")
    expect(live() == 0, "nothing allocated from vmmalloc yet")

    pool = vt.mem_pool()
    with torch.no_grad(), torch.cuda.use_mem_pool(pool):
        y = model(xs[0])
        z = torch.empty(3 << 20, dtype=torch.uint8, device=dev)
    expect(vmm(y) and vmm(z), "inside use_mem_pool: tensors are vmmalloc's memory")
    expect(live() >= 1, "vmmalloc holds blocks now (%d live segments)" % live())
    expect(torch.equal(y, ref), "the same model gives the same result inside and outside the pool")
    w = torch.empty(1 << 20, device=dev)
    expect(not vmm(w), "after the context: PyTorch's allocator again")

    # A CUDA graph captured into the vmmalloc MemPool: PyTorch's allocator takes new segments from
    # vmmalloc while the stream captures (vmmalloc's allocations never invalidate a capture).
    static_x = xs[1].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(side):
        for _ in range(3):
            model(static_x)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    before = live()
    with torch.no_grad(), torch.cuda.graph(g, pool=pool.id):
        big = torch.empty(96 << 20, dtype=torch.uint8, device=dev)  # needs a new segment in capture
        big.fill_(7)
        static_y = model(static_x) + big[:1].float()
    expect(vmm(static_y) and vmm(big), "the graph's tensors are vmmalloc's memory")
    expect(live() > before, "segments taken from vmmalloc during the capture (%d -> %d live)" % (before, live()))
    ok = True
    with torch.no_grad():
        for i in range(1, 12):
            static_x.copy_(xs[i])
            g.replay()
            ok &= torch.allclose(static_y, model(xs[i]) + 7.0, rtol=1e-5, atol=1e-5)
    expect(ok, "11 replays of the graph in the vmmalloc pool == eager")

    del g, static_y, big, y, z
    gc.collect()
    torch.cuda.synchronize()
    # cuBLAS keeps a workspace per stream, made by PyTorch's allocator at the stream's first matmul:
    # the capture stream's was made inside the pool. Dropping them frees it.
    if hasattr(torch._C, "_cuda_clearCublasWorkspaces"):
        torch._C._cuda_clearCublasWorkspaces()
    del pool
    gc.collect()
    torch.cuda.synchronize()
    expect(live() == 0, "the pool deleted: every vmmalloc block given back (%d live)" % live())
    expect(vt.check(0) == "", "vmmalloc's invariants hold")
    s = vt.stats(0)
    expect(s is not None and s["free_failures"] == 0 and s["malloc_failures"] == 0, "no refused call")

    r = torch.randn(1 << 16, device=dev)
    d = torch.nn.functional.dropout(r, 0.5, training=True)
    expect(bool(torch.isfinite(d).all()), "random ops keep working after the graph")
    backend = torch.cuda.memory.get_allocator_backend()
    expect(backend == "native", "the process's allocator is still PyTorch's own (%s)" % backend)

    print()
    if failures:
        print("%d FAILED" % len(failures))
        return 1
    print("all passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
