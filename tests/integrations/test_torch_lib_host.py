#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""libvmmalloc_torch.so through tools/python/vmmalloc_torch.py on vmmalloc's host backend.

Runs in CI without a GPU or torch: the ctypes bindings, the stats dict, trim / reset_peaks /
check, the last error, environment options (good and bad), peers, VMMALLOC_TRACE. The memory is
real host memory (the host backend), so blocks are written and read back.
Needs VMMALLOC_TORCH_LIB (set by ctest) or a build next to the sources.
"""

import ctypes
import os
import sys
import tempfile

os.environ["VMMALLOC_TORCH_BACKEND"] = "host"  # read when each device's allocator is created
_KEEP = ("VMMALLOC_TORCH_LIB", "VMMALLOC_TORCH_BACKEND")
for k in [k for k in os.environ if k.startswith("VMMALLOC_") and k not in _KEEP]:
    os.environ.pop(k)  # every option's variable (README.md's options table)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools", "python"))
import vmmalloc_torch as vt  # noqa: E402

from checks import expect, failures  # noqa: E402  (tests/integrations/checks.py)

MiB = 1 << 20


lib = vt.load()
print("library:", vt.library_path())

# --- device 0: defaults, peers, stats, write/read, trim, peaks ------------------------------------
expect(vt.stats(0) is None, "no stats before the first allocation")
p = lib.vmm_torch_try_malloc(3 * MiB, 0, None)
expect(bool(p), "3 MiB allocated on device 0")
ctypes.memset(p, 0xA5, 3 * MiB)
expect(ctypes.string_at(p + 3 * MiB - 16, 16) == b"\xa5" * 16, "the block is writable and readable")
s = vt.stats(0)
expect(s["allocs"] == 1 and s["live"] == 1, "one allocation live: %d/%d" % (s["allocs"], s["live"]))
expect(s["requested"] == 3 * MiB, "requested == 3 MiB (%d)" % s["requested"])
expect(s["mapped"] >= 3 * MiB and s["peak_mapped"] >= s["mapped"], "mapped %d >= 3 MiB" % s["mapped"])
expect(s["granularity"] == 2 * MiB, "granularity 2 MiB")
expect(s["peers"] == 7, "auto peers: the 7 other simulated devices (%d)" % s["peers"])
cfg = vt.config(0)
expect("backend=host" in cfg and "peers=[1,2,3,4,5,6,7]" in cfg, "config: " + cfg)
q = lib.vmm_torch_try_malloc(40 * MiB, 0, None)
expect(bool(q), "40 MiB allocated on device 0")
peak = vt.stats(0)["peak_mapped"]
lib.vmm_torch_free(q, 40 * MiB, 0, None)
lib.vmm_torch_free(p, 3 * MiB, 0, None)
s = vt.stats(0)
expect(s["live"] == 0 and s["frees"] == 2 and s["requested"] == 0, "both freed")
expect(vt.check(0) == "", "check() holds after the frees")
vt.trim(0)
s = vt.stats(0)
expect(s["mapped"] == 0 and s["peak_mapped"] == peak, "trim unmaps all; the peak stays (%d)" % peak)
vt.reset_peaks()
expect(vt.stats(0)["peak_mapped"] == 0, "reset_peaks: peak back to current (0)")

# --- bad input: size 0, negative size, foreign pointer, bad device ------------------------------
expect(lib.vmm_torch_try_malloc(0, 0, None) is None, "size 0 -> NULL")
expect(vt.stats(0)["malloc_failures"] == 0, "size 0 is not a failure")
expect(lib.vmm_torch_try_malloc(-5, 0, None) is None and "negative size" in vt.last_error(),
       "negative size -> NULL: " + vt.last_error())
lib.vmm_torch_free(0x7000000, 64, 0, None)
expect(vt.stats(0)["free_failures"] == 1 and "free on device 0" in vt.last_error(),
       "foreign pointer: counted, " + vt.last_error())
expect(vt.check(0) == "", "check() still holds after the refused free")
expect(lib.vmm_torch_try_malloc(64, 300, None) is None and "out of range" in vt.last_error(),
       "device 300 -> NULL: " + vt.last_error())
try:
    vt.trim(3)  # no allocator there
    expect(False, "trim(3) without an allocator raises")
except RuntimeError as e:
    expect("has no allocator" in str(e), "trim(3) without an allocator raises: %s" % e)

# --- environment: memory limit (device 1), bad values (device 2), peers (devices 3, 4) -------------
os.environ["VMMALLOC_MEMORY_LIMIT"] = "8M"
os.environ["VMMALLOC_RELEASE_THRESHOLD"] = "max"
expect(lib.vmm_torch_init(1) == 0, "device 1 created with an 8 MiB limit")
del os.environ["VMMALLOC_MEMORY_LIMIT"], os.environ["VMMALLOC_RELEASE_THRESHOLD"]
expect("memory_limit=8M" in vt.config(1) and "release_threshold=max" in vt.config(1), vt.config(1))
expect(lib.vmm_torch_try_malloc(32 * MiB, 1, None) is None, "32 MiB past the 8 MiB limit -> NULL")
err = vt.last_error()
expect("cannot allocate 32.00 MiB on device 1" in err, "the reason: " + err)
expect(vt.stats(1)["malloc_failures"] == 1, "the failure is counted")
r = lib.vmm_torch_try_malloc(MiB, 1, None)
expect(bool(r), "1 MiB still fits after the failure")
lib.vmm_torch_free(r, MiB, 1, None)

for var, val in (("VMMALLOC_RESERVATION", "12Q"), ("VMMALLOC_FREE_MEMORY_MARGIN", "-3"),
                 ("VMMALLOC_PEERS", "1,x"), ("VMMALLOC_THREAD_CACHE", "maybe"),
                 ("VMMALLOC_TORCH_BACKEND", "opencl")):
    old = os.environ.get(var)
    os.environ[var] = val
    rc = lib.vmm_torch_init(2)
    expect(rc == -1 and var in vt.last_error() and lib.vmm_torch_initialized(2) == 0,
           "%s=%s refused: %s" % (var, val, vt.last_error()))
    if old is None:
        del os.environ[var]
    else:
        os.environ[var] = old
os.environ["VMMALLOC_RESERVATION"] = "4G"
expect(lib.vmm_torch_init(2) == 0 and vt.stats(2)["reserved"] == 4 << 30,
       "after the bad values, device 2 is created with a 4 GiB reservation")
del os.environ["VMMALLOC_RESERVATION"]

os.environ["VMMALLOC_PEERS"] = "9"
expect(lib.vmm_torch_init(3) == -1 and "cannot access" in vt.last_error(),
       "VMMALLOC_PEERS=9 (no such device) refused: " + vt.last_error())
os.environ["VMMALLOC_PEERS"] = "0,5"
expect(lib.vmm_torch_init(3) == 0 and vt.stats(3)["peers"] == 2 and "peers=[0,5]" in vt.config(3),
       "VMMALLOC_PEERS=0,5: " + vt.config(3))
os.environ["VMMALLOC_PEERS"] = "none"
expect(lib.vmm_torch_init(4) == 0 and vt.stats(4)["peers"] == 0, "VMMALLOC_PEERS=none: no peers")
del os.environ["VMMALLOC_PEERS"]

# --- VMMALLOC_TRACE (device 5): one file per device, written by flush_trace -----------------------
with tempfile.TemporaryDirectory() as d:
    os.environ["VMMALLOC_TRACE"] = os.path.join(d, "trace-%d.txt")
    a = [lib.vmm_torch_try_malloc(n, 5, None) for n in (1000, 70000, 5 * MiB)]
    del os.environ["VMMALLOC_TRACE"]
    expect(all(a), "three allocations on device 5 with tracing on")
    for x in a:
        lib.vmm_torch_free(x, 0, 5, None)
    vt.flush_trace()
    path = os.path.join(d, "trace-5.txt")
    text = open(path).read() if os.path.exists(path) else ""
    expect(text.startswith("# vmmalloc-trace v2"), "trace-5.txt starts with the v2 header")
    lines = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    kinds = [ln.split()[0] for ln in lines]
    expect(kinds.count("a") == 3 and kinds.count("f") == 3,
           "trace-5.txt holds 3 allocations and 3 frees (%d lines)" % len(lines))
    expect(all(len(ln.split()) == 6 for ln in lines), "every line has OP ADDR SIZE STREAM THREAD TIME")
    times = [int(ln.split()[5]) for ln in lines]
    expect(times == sorted(times), "TIME never decreases")
    expect(vt.stats(5)["traced_events"] == 6, "traced_events == 6")

# --- graph pools and record_stream (device 6) through ctypes -------------------------------------
FILTER = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
asked = []


def only_stream_0x10(stream, user):
    asked.append(stream)
    return 1 if stream == 0x10 else 0


keep_filter = FILTER(only_stream_0x10)  # alive until end_pool returns
expect(lib.vmm_torch_begin_pool(6, 11, keep_filter, None) == 0, "begin_pool(6, 11) with a Python filter")
a_in = lib.vmm_torch_try_malloc(5 * MiB, 6, 0x10)
a_out = lib.vmm_torch_try_malloc(5 * MiB, 6, 0x20)
expect(bool(a_in) and bool(a_out) and len(asked) >= 2, "the filter was asked (%d times)" % len(asked))
pool = ctypes.c_uint64(0)
expect(lib.vmm_torch_pool_of(a_in, ctypes.byref(pool)) == 1 and pool.value == 11, "pool_of: the capture's block is pool 11's")
expect(lib.vmm_torch_pool_of(a_out, ctypes.byref(pool)) == 0, "pool_of: another stream's block is no pool's")
s6 = vt.stats(6)
expect(s6["pools"] == 1 and s6["pool_allocated"] >= 5 * MiB and s6["pool_held"] >= 5 * MiB,
       "stats: pools %d, pool_allocated %d, pool_held %d" % (s6["pools"], s6["pool_allocated"], s6["pool_held"]))
expect(vt.pool_of(a_in) == 11 and vt.pool_of(a_out) is None, "vmmalloc.torch.pool_of: 11 / None")
expect(lib.vmm_torch_end_pool(6, 11) == 0, "end_pool(6, 11)")
expect(lib.vmm_torch_end_pool(6, 11) == -1 and "never begun" in vt.last_error(), "end_pool twice: " + vt.last_error())
expect(lib.vmm_torch_device_of(a_in) == 6, "device_of finds device 6")
segs = vt.memory_map(6)
blocks = {b["address"]: (b, seg) for seg in segs for b in seg["blocks"]}
expect(a_in in blocks and blocks[a_in][0]["state"] == "live" and blocks[a_in][0]["requested"] == 5 * MiB
       and blocks[a_in][1]["pool"] == 11, "memory_map: the capture's block, live, in pool 11's segment")
expect(a_out in blocks and blocks[a_out][1]["pool"] == 0, "memory_map: the other block in the device's own heap")
expect(all(seg["blocks"][0]["address"] == seg["address"] and
           sum(b["size"] for b in seg["blocks"]) == seg["size"] for seg in segs), "memory_map: blocks tile each segment")
expect(sum(seg["size"] for seg in segs) == vt.stats(6)["mapped"], "memory_map: the segments are the mapped bytes")
expect(vt.memory_map(9) == [], "memory_map: [] on a device with no allocator")
many = [lib.vmm_torch_try_malloc(1000, 6, 0x20) for _ in range(1500)]  # more records than the first buffer
live_many = sum(1 for seg in vt.memory_map(6) for b in seg["blocks"] if b["state"] == "live" and b["requested"] == 1000)
expect(live_many == 1500, "memory_map: a map larger than its first buffer comes whole (%d of 1500 blocks)" % live_many)
for q in many:
    lib.vmm_torch_free(q, 1000, 6, 0x20)
expect(lib.vmm_torch_record_stream(a_out, 0x30) == 0, "record_stream on a live block")
expect(lib.vmm_torch_record_stream(0x1000, 0x30) == -1 and "not from vmmalloc" in vt.last_error(),
       "record_stream on a foreign pointer: " + vt.last_error())
lib.vmm_torch_free(a_in, 0, 6, 0x10)
lib.vmm_torch_free(a_out, 0, 6, 0x20)
expect(lib.vmm_torch_release_pool(6, 11) == 0 and vt.stats(6)["pools"] == 0 and vt.stats(6)["pool_held"] == 0,
       "release_pool: pools and pool_held back to 0")
expect(lib.vmm_torch_pool_stats(6, 11, None, None, None) == 0, "pool_stats: the pool is gone")

# --- memory fraction (device 7): the limit set from Python, as the plain pluggable mode needs ------
expect(vt.memory_fraction(7) == 1.0, "memory_fraction(7) with no limit: 1.0")
total = ctypes.c_uint64(0)
free = ctypes.c_uint64(0)
expect(lib.vmm_torch_mem_info(7, ctypes.byref(free), ctypes.byref(total)) == 0, "mem_info(7)")
frac = (32 * MiB) / total.value
vt.set_memory_fraction(frac, 7)
expect(abs(vt.memory_fraction(7) - frac) < 1e-9, "memory_fraction(7) reads back %r" % vt.memory_fraction(7))
expect(not lib.vmm_torch_try_malloc(48 * MiB, 7, 0) and "limit" in vt.last_error(),
       "48 MiB past a 32 MiB fraction: " + vt.last_error())
try:
    vt.set_memory_fraction(1.5, 7)
    expect(False, "set_memory_fraction(1.5) raised nothing")
except RuntimeError as e:
    expect("fraction must lie in [0, 1], got 1.5" in str(e), "set_memory_fraction(1.5): " + str(e))
vt.set_memory_fraction(1.0, 7)
p7 = lib.vmm_torch_try_malloc(48 * MiB, 7, 0)
expect(bool(p7) and vt.memory_fraction(7) == 1.0, "fraction 1.0: 48 MiB fits")
lib.vmm_torch_free(p7, 0, 7, 0)

# --- without torch: no mode, and the fallback's warning names what does not work -----------------
expect(vt.mode() is None and not vt.enabled() and vt.extension_info() is None, "mode() is None before enable()")
w = vt.NO_EXTENSION_WARNING % "why"
expect("\n" not in w and "CUDA graphs" in w and "reduce-overhead" in w and "record_stream is a no-op" in w,
       "the fallback warning is one line naming graphs, torch.compile and record_stream")

expect(vt.check() == "", "check() over every device")
print()
if failures:
    print("%d FAILED" % len(failures))
    sys.exit(1)
print("all passed")
