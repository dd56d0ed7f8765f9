#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""CUDA graphs with vmmalloc as PyTorch's allocator, process-wide, through libvmmalloc_torch_ext.so.

The same deterministic workload runs twice, each in a process of its own: under PyTorch's own
caching allocator ("native") and under vmmalloc ("vmmalloc", vmmalloc.torch.enable() in extension
mode). Each process checks its CUDA graphs against eager runs of the same model; this process then
compares the two processes' results. The workload:
  1. torch.cuda.graph of an MLP training step (forward + backward + SGD step) replayed over fresh
     batches, against the same steps run eagerly (losses and final weights),
  2. torch.cuda.make_graphed_callables of a small module (outputs, input and weight gradients),
  3. torch.compile(mode="reduce-overhead") of a small transformer block (outputs),
and in the vmmalloc process also: the graphs' memory is in vmmalloc graph pools while they live,
deleting them brings pools back to the baseline, Tensor.record_stream delays reuse, and afterwards
random ops still work (no "Offset increment outside graph capture").

Deterministic: fixed seeds, data made on the CPU, TF32 off, torch.use_deterministic_algorithms and
CUBLAS_WORKSPACE_CONFIG set before CUDA starts. Results are compared with a tight tolerance
(rtol 1e-5, atol 1e-6) and reported as bitwise identical or not; the compiled block against eager
with 1e-4 (inductor fuses, so roundings differ).

Exit 0: passed. 77: no torch or no CUDA device. 1: a failure (each check is printed).
Needs libvmmalloc_torch.so and libvmmalloc_torch_ext.so ($VMMALLOC_TORCH_LIB and
$VMMALLOC_TORCH_EXT_LIB, set by ctest, or a build next to the sources).
"""

import gc
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tools", "python"))

from checks import SKIP, expect, failures, torch_or_skip  # noqa: E402  (tests/integrations/checks.py)


def close(a, b, rtol=1e-5, atol=1e-6):
    """(within tolerance, bitwise identical, max abs difference) of two tensors."""
    import torch

    a, b = a.detach().float().cpu(), b.detach().float().cpu()
    if a.shape != b.shape:
        return False, False, float("inf")
    diff = (a - b).abs().max().item() if a.numel() else 0.0
    ok = bool(torch.isfinite(a).all()) and bool(torch.allclose(a, b, rtol=rtol, atol=atol))
    return ok, bool(torch.equal(a, b)), diff


def expect_close(a, b, what, rtol=1e-5, atol=1e-6):
    ok, same, diff = close(a, b, rtol, atol)
    expect(ok, "%s (%s, max |diff| %.3g)" % (what, "bitwise identical" if same else "within tolerance", diff))


# ---- the workload (one process per allocator) ----------------------------------------------------

def worker(which, out_path):
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts
    import torch

    if not torch.cuda.is_available():
        print("test_torch_graphs: skipped: no CUDA device")
        return 77
    vt = None
    if which == "vmmalloc":
        import vmmalloc_torch as vt

        vt.enable()  # extension mode when libvmmalloc_torch_ext.so is found; else a warning
        expect(vt.mode() == "extension",
               "vmmalloc installed through libvmmalloc_torch_ext.so (mode %r; info %r)" % (vt.mode(), vt.extension_info()))
        if vt.mode() != "extension":
            return 1
        info = vt.extension_info()
        print("extension: %s (built against torch %s, running %s; MemPool objects %s)" % (
            info["path"], info["torch_version"], torch.__version__, "work" if info["mempool"] else "refused"))
    import torch.nn as nn

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.use_deterministic_algorithms(True)
    dev = torch.device("cuda", 0)
    results = {}

    def pools():
        if vt is None:
            return None
        s = vt.stats(0)
        return (s["pools"], s["pool_held"], vt.extension_pool_count()) if s else (0, 0, vt.extension_pool_count())

    def settle():
        gc.collect()
        torch.cuda.synchronize()
        # cuBLAS keeps a workspace per stream, made at the stream's first matmul: a capture
        # stream's is made inside the graph's pool and would keep it alive. Drop them.
        if hasattr(torch._C, "_cuda_clearCublasWorkspaces"):
            torch._C._cuda_clearCublasWorkspaces()
        gc.collect()

    settle()
    base = pools()

    # ---- 1. torch.cuda.graph: an MLP training step -------------------------------------------------
    steps, warm = 12, 3
    gen = torch.Generator().manual_seed(2)
    xs = [torch.randn(32, 64, generator=gen) for _ in range(steps)]
    ys = [torch.randint(0, 10, (32,), generator=gen) for _ in range(steps)]

    def make_mlp():
        torch.manual_seed(1)
        return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                             nn.Linear(256, 10)).to(dev)

    loss_fn = nn.CrossEntropyLoss()

    # Eager reference: the same steps.
    ref = make_mlp()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    eager_losses = []
    for i in range(steps):
        ref_opt.zero_grad(set_to_none=True)
        loss = loss_fn(ref(xs[i].to(dev)), ys[i].to(dev))
        loss.backward()
        ref_opt.step()
        eager_losses.append(loss.detach().clone())
    eager_losses = torch.stack(eager_losses[warm:]).cpu()

    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    static_x = torch.empty(32, 64, device=dev)
    static_y = torch.empty(32, dtype=torch.long, device=dev)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up steps, as the graph's users must
        for i in range(warm):
            static_x.copy_(xs[i])
            static_y.copy_(ys[i])
            opt.zero_grad(set_to_none=True)
            loss_fn(model(static_x), static_y).backward()
            opt.step()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(g):
        static_loss = loss_fn(model(static_x), static_y)
        static_loss.backward()
        opt.step()
    if vt is not None:
        p = pools()
        expect(p[0] > base[0] and p[1] > base[1],
               "torch.cuda.graph: its memory is a vmmalloc graph pool (pools %d -> %d, pool_held %d -> %d)"
               % (base[0], p[0], base[1], p[1]))
        expect(vt.pool_of(static_loss) is not None, "the captured loss tensor lives in the graph's pool")
        expect(vt.pool_of(static_x) is None, "a tensor made before the capture is in no pool")
    graph_losses = []
    for i in range(warm, steps):
        static_x.copy_(xs[i])
        static_y.copy_(ys[i])
        g.replay()
        graph_losses.append(static_loss.detach().clone())
    graph_losses = torch.stack(graph_losses).cpu()
    expect_close(graph_losses, eager_losses, "torch.cuda.graph: %d replayed training steps' losses == eager" % (steps - warm))
    w_graph = torch.cat([q.detach().flatten() for q in model.parameters()]).cpu()
    w_eager = torch.cat([q.detach().flatten() for q in ref.parameters()]).cpu()
    expect_close(w_graph, w_eager, "torch.cuda.graph: weights after the replays == eager weights")
    results["mlp_losses"], results["mlp_weights"] = graph_losses, w_graph
    del g, static_loss
    for q in model.parameters():
        q.grad = None  # the captured backward's gradients live in the graph's pool
    settle()
    if vt is not None:
        p = pools()
        expect(p == base, "graph, its outputs and gradients deleted: pools, pool_held and the extension's "
                          "pool table back to the baseline %r (now %r)" % (base, p))

    # ---- 2. make_graphed_callables -----------------------------------------------------------------
    torch.manual_seed(3)
    mod = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)).to(dev)
    twin = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)).to(dev)
    twin.load_state_dict(mod.state_dict())
    sample = torch.randn(16, 64, device=dev, requires_grad=True)
    graphed = torch.cuda.make_graphed_callables(mod, (sample,))
    gen = torch.Generator().manual_seed(4)
    outs, in_grads, w_grads = [], [], []
    for i in range(5):
        x = torch.randn(16, 64, generator=gen).to(dev)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        for m in (mod, twin):
            m.zero_grad(set_to_none=True)  # per call: a graphed backward's outputs are static memory
        ya = graphed(xa)
        ya.pow(2).sum().backward()
        yb = twin(xb)
        yb.pow(2).sum().backward()
        expect_close(ya, yb, "make_graphed_callables: call %d output == eager" % i)
        expect_close(xa.grad, xb.grad, "make_graphed_callables: call %d input gradient == eager" % i)
        wg = torch.cat([q.grad.flatten() for q in mod.parameters()]).cpu()
        we = torch.cat([q.grad.flatten() for q in twin.parameters()]).cpu()
        expect_close(wg, we, "make_graphed_callables: call %d weight gradients == eager" % i)
        outs.append(ya.detach().cpu())
        in_grads.append(xa.grad.cpu())
        w_grads.append(wg)
    results["graphed_out"], results["graphed_in_grad"], results["graphed_w_grad"] = (
        torch.stack(outs), torch.stack(in_grads), torch.stack(w_grads))
    if vt is not None:
        p = pools()
        expect(p[0] > base[0], "make_graphed_callables: its graphs' shared pool is vmmalloc's (pools %d)" % p[0])
    del graphed, mod, ya, yb, xa, xb  # the graphed module holds its graphs
    settle()
    if vt is not None:
        p = pools()
        expect(p == base, "graphed module deleted: pools back to the baseline %r (now %r)" % (base, p))

    # ---- 3. torch.compile(mode="reduce-overhead") of a transformer block ------------------------
    class Block(nn.Module):
        def __init__(self, d=64, heads=4):
            super().__init__()
            self.h, self.dh = heads, d // heads
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.h, self.dh).permute(2, 0, 3, 1, 4)
            att = torch.softmax(q @ k.transpose(-1, -2) / self.dh ** 0.5, dim=-1)
            x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
            return x + self.mlp(self.ln2(x))

    torch.manual_seed(5)
    block = Block().to(dev).eval()
    compiled = torch.compile(block, mode="reduce-overhead")
    gen = torch.Generator().manual_seed(6)
    comp_outs = []
    with torch.no_grad():
        for i in range(6):  # warm-up, recording, then replays
            x = torch.randn(4, 16, 64, generator=gen).to(dev)
            y = compiled(x).clone()  # a graph's output is overwritten by the next replay
            expect_close(y, block(x), "torch.compile(reduce-overhead): call %d == eager block" % i, rtol=1e-4, atol=1e-4)
            comp_outs.append(y.cpu())
    results["compiled_out"] = torch.stack(comp_outs)
    if vt is not None:
        p = pools()
        expect(p[0] > base[0], "torch.compile's CUDA graph trees allocate from a vmmalloc pool (pools %d)" % p[0])
    del compiled, y
    torch._dynamo.reset()
    trees = getattr(getattr(torch, "_inductor", None), "cudagraph_trees", None)
    if trees is not None and hasattr(trees, "reset_cudagraph_trees"):
        trees.reset_cudagraph_trees()
    settle()
    if vt is not None:
        p = pools()
        expect(p == base, "compiled block and its graph trees reset: pools back to the baseline %r (now %r)" % (base, p))

    # ---- 4. record_stream (vmmalloc only: PyTorch's allocator does it natively) ------------------
    if vt is not None:
        side = torch.cuda.Stream()
        x = torch.empty(8 << 20, dtype=torch.uint8, device=dev)
        x.fill_(1)
        ptr = x.data_ptr()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(200_000_000)  # keeps the side stream busy (~0.1 s)
            x.add_(1)
        x.record_stream(side)
        del x
        y = torch.empty(8 << 20, dtype=torch.uint8, device=dev)
        expect(y.data_ptr() != ptr, "record_stream: a block freed while another stream still uses it is not reused")
        torch.cuda.synchronize()
        del y

    # ---- 5. the process keeps working -----------------------------------------------------------
    try:
        r = torch.randn(1 << 16, device=dev)
        d = torch.nn.functional.dropout(r, 0.5, training=True)
        zeros = (d == 0).float().mean().item()
        expect(bool(torch.isfinite(d).all()) and 0.4 < zeros < 0.6,
               "random ops after the graphs: randn + dropout work (%.3f zeroed)" % zeros)
    except RuntimeError as e:
        expect(False, "random ops after the graphs: %s" % e)
    if vt is not None:
        expect(vt.check(0) == "", "vmmalloc's invariants hold after all of it")
        s = vt.stats(0)
        print("vmmalloc: live %d, mapped %.1f MiB, pools %d, malloc_failures %d, free_failures %d" % (
            s["live"], s["mapped"] / 2**20, s["pools"], s["malloc_failures"], s["free_failures"]))
        expect(s["free_failures"] == 0, "no refused frees")

    torch.save(results, out_path)
    print()
    if failures:
        print("%s: %d FAILED" % (which, len(failures)))
        return 1
    print("%s: all passed" % which)
    return 0


# ---- this process: run both, compare ---------------------------------------------------------------

def main():
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        return worker(sys.argv[2], sys.argv[3])
    torch = torch_or_skip("test_torch_graphs")  # CUDA is not started here
    if torch is None:
        return SKIP
    env = dict(os.environ, CUBLAS_WORKSPACE_CONFIG=":4096:8", PYTHONWARNINGS="default")
    res = {}
    with tempfile.TemporaryDirectory() as tmp:
        for which in ("native", "vmmalloc"):
            path = os.path.join(tmp, which + ".pt")
            print("==== %s process" % which, flush=True)
            rc = subprocess.call([sys.executable, os.path.abspath(__file__), "--worker", which, path], env=env)
            if rc == 77:
                return 77
            expect(rc == 0, "the %s process passed its own checks (exit %d)" % (which, rc))
            if rc == 0:
                res[which] = torch.load(path)
    print("==== native vs vmmalloc")
    if len(res) == 2:
        for key in sorted(res["native"]):
            tol = dict(rtol=1e-4, atol=1e-4) if key.startswith("compiled") else {}
            expect_close(res["vmmalloc"][key], res["native"][key], "%s: vmmalloc == PyTorch's allocator" % key, **tol)
    print()
    if failures:
        print("%d FAILED" % len(failures))
        return 1
    print("all passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
