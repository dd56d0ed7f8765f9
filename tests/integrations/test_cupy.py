#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""CuPy on vmmalloc (cupy.cuda.set_allocator through tools/python/vmmalloc_cupy.py), on a GPU.

A matmul, an FFT, reductions and elementwise kernels, on the default stream and on a side stream,
checked against NumPy; vmmalloc's stats show CuPy's memory came from it and went back; an
impossible allocation raises a clear error and the allocator keeps serving.

Exit 0: passed. 77: no CuPy or no CUDA device. 1: a failure.
Needs libvmmalloc_torch.so: $VMMALLOC_TORCH_LIB (set by ctest) or a build next to the sources.
"""

import gc
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools", "python"))

from checks import expect, failures  # noqa: E402  (tests/integrations/checks.py)


def main():
    try:
        import cupy
        import numpy as np
    except Exception as e:
        print("test_cupy: skipped: cupy/numpy not importable (%s)" % e)
        return 77
    try:
        ndev = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:
        print("test_cupy: skipped: no CUDA device (%s)" % e)
        return 77
    if ndev < 1:
        print("test_cupy: skipped: no CUDA device")
        return 77
    import vmmalloc_cupy as vc

    print("library:", vc.enable())
    print("cupy", cupy.__version__)

    rng = np.random.default_rng(7)
    a_h = rng.standard_normal((512, 384))
    b_h = rng.standard_normal((384, 256))
    x_h = rng.standard_normal(1 << 16) + 1j * rng.standard_normal(1 << 16)

    a, b = cupy.asarray(a_h), cupy.asarray(b_h)
    c = a @ b
    expect(np.allclose(c.get(), a_h @ b_h, rtol=1e-10, atol=1e-10), "matmul 512x384 @ 384x256 (float64)")
    f = cupy.fft.fft(cupy.asarray(x_h))
    expect(np.allclose(f.get(), np.fft.fft(x_h), rtol=1e-9, atol=1e-6), "FFT of 65536 complex128")
    big = cupy.arange(1 << 26, dtype=cupy.float32)  # 256 MiB: grows the pool by a large chunk
    # float32 sums of ~5e11 and ~1e15: compared with a float32-sized tolerance
    expect(np.isclose(float(big[::4096].sum()), float(np.arange(1 << 26, dtype=np.float64)[::4096].sum()), rtol=1e-5),
           "strided sum over a 256 MiB array")
    expect(np.isclose(float((big * 0.5).sum()), 0.5 * (1 << 26) * ((1 << 26) - 1) / 2, rtol=1e-4),
           "elementwise + reduction over 256 MiB")

    s = vc.stats(0)
    expect(s is not None and s["allocs"] >= 5, "vmmalloc served CuPy: %d allocations" % (s["allocs"] if s else 0))
    expect(s["live"] >= 4 and s["requested"] >= (1 << 28), "live %d blocks, %d bytes requested" % (s["live"], s["requested"]))
    expect(s["peak_mapped"] >= (1 << 28), "peak mapped %d" % s["peak_mapped"])

    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        d = cupy.asarray(a_h) * 2.0
        e = (d @ cupy.asarray(b_h)).sum()
    stream.synchronize()
    expect(np.isclose(float(e), 2.0 * (a_h @ b_h).sum(), rtol=1e-10), "side-stream matmul + sum")

    live = vc.stats(0)["live"]
    del a, b, c, f, big, d, e
    gc.collect()
    cupy.cuda.Device().synchronize()
    s = vc.stats(0)
    expect(s["live"] <= live - 7, "freed when CuPy drops the arrays: %d -> %d live" % (live, s["live"]))

    try:
        cupy.empty(1 << 48, dtype=cupy.uint8)
        expect(False, "a 256 TiB array raises")
    except MemoryError as ex:  # cupy.cuda.memory.OutOfMemoryError is a MemoryError
        expect("vmmalloc" in str(ex), "256 TiB raises %s: %s" % (type(ex).__name__, str(ex)[:200]))
    z = cupy.ones(1000)
    expect(float(z.sum()) == 1000.0, "allocations work after the failure")
    del z
    expect(cupy.empty(0).size == 0, "empty array")

    vc.trim()
    expect(vc.check() == "", "check()")
    s = vc.stats(0)
    expect(s["free_failures"] == 0, "no refused frees")
    print("stats:", {k: s[k] for k in ("allocs", "frees", "live", "peak_mapped", "mapped", "driver_calls")})

    print()
    if failures:
        print("test_cupy: %d FAILED" % len(failures))
        return 1
    print("test_cupy: passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
