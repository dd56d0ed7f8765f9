#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""CUDA tensors sent between processes with torch.multiprocessing, vmmalloc in both.

The parent runs with VMMALLOC_IPC=posix_fd and vmmalloc.torch.enable() (extension mode), and
spawns a child that does the same. Checked (each printed):
  * parent -> child: a small tensor (a slab slot), a 4 MiB one and a 300 MiB one (a huge block)
    arrive with their values; the child writes into one and the parent sees it (one memory);
  * child -> parent: a tensor the child made arrives with its values;
  * the parent's mapping of the child's tensor goes when it is dropped, and once the child is
    done every shared block's fds are closed (vmm_torch_share_counts back to 0), check() holds;
  * without VMMALLOC_IPC, sending a CUDA tensor raises with what to set.

Exit 0: passed. 77: no torch, no CUDA device, or no extension. 1: a failure.
"""

import ctypes
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools", "python"))

from checks import SKIP, expect, failures, torch_or_skip  # noqa: E402  (tests/integrations/checks.py)

BIG = 300 << 20  # bytes: past the huge threshold (256 MiB), its own chunks


def counts(lib):
    shared, imported = ctypes.c_uint64(), ctypes.c_uint64()
    lib.vmm_torch_share_counts.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64)]
    lib.vmm_torch_share_counts(ctypes.byref(shared), ctypes.byref(imported))
    return shared.value, imported.value


def child(to_child, to_parent):
    """The receiver: vmmalloc first, then the tensors."""
    try:
        import torch
        import vmmalloc_torch as vt

        vt.enable()
        small, mid, big = to_child.get(timeout=300)
        sums = [float(small.sum()), float(mid.sum()), float(big.sum())]
        ptrs_vmm = all(vt.load().vmm_torch_device_of(t.data_ptr()) < 0 for t in (small, mid, big))
        _, imported = counts(vt.load())
        mid[0] = 42.0  # the parent reads this through its own tensor
        torch.cuda.synchronize()
        mine = torch.full((4096,), 7.0, device="cuda")
        to_parent.put(("ok", sums, ptrs_vmm, imported, mine))
        to_child.get(timeout=300)  # the parent has read everything
        del small, mid, big, mine
        torch.cuda.synchronize()
        to_parent.put(("done",))
        to_child.get(timeout=300)  # keep the process (the sender of `mine`) until the parent is done
    except Exception as e:  # reported to the parent, which prints it
        to_parent.put(("error", "%s: %s" % (type(e).__name__, e)))


def child_without_ipc(to_parent):
    try:
        import torch
        import torch.multiprocessing.reductions as red
        import vmmalloc_torch as vt

        os.environ.pop("VMMALLOC_IPC", None)
        vt.enable()
        t = torch.ones(1024, device="cuda")
        try:
            red.reduce_tensor(t)
            to_parent.put(("shared without VMMALLOC_IPC",))
        except RuntimeError as e:
            to_parent.put(("refused", str(e)))
    except Exception as e:
        to_parent.put(("error", "%s: %s" % (type(e).__name__, e)))


def main():
    torch = torch_or_skip("test_torch_share")
    if torch is None:
        return SKIP
    import torch.multiprocessing as mp
    import vmmalloc_torch as vt

    os.environ["VMMALLOC_IPC"] = "posix_fd"  # before the first allocation; the child inherits it
    vt.enable()
    if vt.mode() != "extension":
        print("test_torch_share: skipped: no libvmmalloc_torch_ext.so (mode %s)" % vt.mode())
        return 77
    lib = vt.load()
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            print("Yama ptrace_scope: %s" % f.read().strip())
    except OSError:
        print("Yama ptrace_scope: none (no Yama)")

    dev = torch.device("cuda", 0)
    small = torch.arange(100, device=dev, dtype=torch.float32)
    mid = torch.full((1 << 20,), 3.0, device=dev)
    big = torch.full((BIG // 4,), 2.0, device=dev)
    expect(all(lib.vmm_torch_device_of(t.data_ptr()) == 0 for t in (small, mid, big)), "the tensors are vmmalloc's")

    ctx = mp.get_context("spawn")
    to_child, to_parent = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=child, args=(to_child, to_parent))
    p.start()
    to_child.put((small, mid, big))
    r = to_parent.get(timeout=300)
    if r[0] != "ok":
        expect(False, "child received the tensors: %s" % (r,))
        to_child.put("stop")
        to_child.put("stop")
        p.join(60)
        return 1
    _, sums, ptrs_vmm, imported, mine = r
    del r
    expect(sums == [4950.0, 3.0 * (1 << 20), 2.0 * (BIG // 4)], "child: values as sent (sums %s)" % sums)
    expect(ptrs_vmm, "child: the tensors are mappings of the parent's memory, not the child's heap")
    expect(imported >= 1, "child: %d import(s) open" % imported)
    torch.cuda.synchronize()
    expect(float(mid[0]) == 42.0, "parent: sees the child's write into the 4 MiB tensor (one memory)")
    expect(mine.device == dev and float(mine.sum()) == 7.0 * 4096, "parent: the child's tensor arrived")
    expect(lib.vmm_torch_device_of(mine.data_ptr()) < 0, "parent: the child's tensor is a mapping")
    _, imp = counts(lib)
    expect(imp == 1, "parent: one import open (%d)" % imp)
    del mine
    _, imp = counts(lib)
    expect(imp == 0, "parent: dropping the child's tensor unmaps it (%d open)" % imp)
    to_child.put("read")
    r = to_parent.get(timeout=300)
    expect(r[0] == "done", "child dropped its tensors: %s" % (r[0],))
    del small, mid, big
    torch.cuda.ipc_collect()  # PyTorch keeps sent storages until the receiver lets go
    shared, _ = counts(lib)
    expect(shared == 0, "parent: every shared block freed, its fds closed (%d left)" % shared)
    to_child.put("stop")
    p.join(120)
    expect(p.exitcode == 0, "child exit code %s" % p.exitcode)
    expect(vt.check(0) == "", "check() holds")

    q = ctx.Queue()
    p2 = ctx.Process(target=child_without_ipc, args=(q,))
    p2.start()
    r = q.get(timeout=300)
    p2.join(120)
    expect(r[0] == "refused" and "VMMALLOC_IPC=posix_fd" in r[1],
           "without VMMALLOC_IPC: sending a CUDA tensor raises with what to set (%s)" % (r,))

    if failures:
        print("test_torch_share: FAILED")
        return 1
    print("test_torch_share: passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
