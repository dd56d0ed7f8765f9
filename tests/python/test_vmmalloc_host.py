#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The vmmalloc Python package (python/vmmalloc/) on the host backend: no GPU, no torch needed.

GrowableBuffer and KVCache semantics (growth keeps the pointer and the contents, capacity limits,
strides and addresses), bad input (past a capacity, a closed sequence, wrong element sizes or
shapes: clear exceptions carrying the C++ messages) and leaks (the backend's live objects, and the
process's file descriptors and mappings, back to their baseline). Where torch is importable, the
torch views (CPU tensors over host-backend memory) are checked too.

Needs libvmmalloc.so: $VMMALLOC_LIB_DIR (set by ctest) or a build next to the sources.
"""

import array
import copy
import ctypes
import gc
import os
import pickle
import sys
import threading
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.normpath(os.path.join(HERE, "..", "..", "python")))

import vmmalloc  # noqa: E402
from vmmalloc import Error, GrowableBuffer, InvalidValueError, KVCache, OutOfMemoryError, Status  # noqa: E402

MiB = 1 << 20

try:
    import torch  # noqa: F401

    HAVE_TORCH = True
except Exception:
    HAVE_TORCH = False


def fds():
    return len(os.listdir("/proc/self/fd"))


def maps():
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


class Buffer(unittest.TestCase):
    def test_growth_keeps_pointer_and_contents(self):
        with GrowableBuffer.host(256 * MiB) as b:
            p = b.data_ptr
            self.assertNotEqual(p, 0)
            self.assertEqual((b.size, b.capacity), (0, 0))
            b.resize(3 * MiB)
            mv = b.memoryview()
            self.assertEqual(len(mv), 3 * MiB)
            mv[0:4] = b"head"
            mv[3 * MiB - 4:] = b"tail"
            del mv
            for size in (5 * MiB, 40 * MiB, 200 * MiB):
                b.resize(size)
                self.assertEqual(b.data_ptr, p, "the base never moves")
                self.assertEqual(b.size, size)
                self.assertGreaterEqual(b.capacity, size)
                mv = b.memoryview()
                self.assertEqual(bytes(mv[0:4]), b"head")
                self.assertEqual(bytes(mv[3 * MiB - 4:3 * MiB]), b"tail")
                mv[size - 1] = 7  # the new tail is mapped and writable
                del mv
            i = b.info()
            self.assertEqual(i["data"], p)
            self.assertEqual(i["reserved"], 256 * MiB)
            self.assertEqual(i["chunks"], 4)  # one chunk per growth: one driver round each
            self.assertEqual(i["live_handles"], 4)
            self.assertEqual(i["create_calls"], 4)

    def test_capacity_limit(self):
        with GrowableBuffer.host(8 * MiB) as b:
            b.resize(6 * MiB)
            before = b.info()
            with self.assertRaises(OutOfMemoryError) as cm:
                b.resize(8 * MiB + 1)
            e = cm.exception
            self.assertIsInstance(e, MemoryError)
            self.assertIsInstance(e, Error)
            self.assertEqual(e.status, Status.OUT_OF_MEMORY)
            self.assertIn("exceeds the capacity limit", str(e))
            self.assertIn("vmm::growable_buffer::resize", str(e))  # the C++ message
            self.assertEqual(b.info(), before, "a refused growth changes nothing")
            with self.assertRaises(OutOfMemoryError):
                b.reserve(9 * MiB)
            b.resize(8 * MiB)  # exactly the limit fits
            self.assertEqual(b.size, 8 * MiB)

    def test_physical_limit_rolls_back(self):
        with GrowableBuffer.host(64 * MiB, host_physical_limit=4 * MiB) as b:
            b.resize(4 * MiB)
            before = b.info()
            with self.assertRaises(OutOfMemoryError):
                b.resize(6 * MiB)
            after = b.info()
            self.assertEqual(after["size"], 4 * MiB)
            self.assertEqual(after["live_handles"], before["live_handles"])
            self.assertEqual(after["live_mappings"], before["live_mappings"])
            self.assertGreater(after["failures"], before["failures"])

    def test_shrink_returns_memory(self):
        with GrowableBuffer.host(64 * MiB, min_chunk=2 * MiB) as b:
            for s in (2, 4, 6, 8):
                b.resize(s * MiB)
            self.assertEqual(b.info()["live_handles"], 4)
            b.resize(3 * MiB)  # chunks wholly past round_up(3 MiB, 2 MiB) = 4 MiB go
            i = b.info()
            self.assertEqual((i["size"], i["capacity"], i["live_handles"]), (3 * MiB, 4 * MiB, 2))
            b.resize(0)
            i = b.info()
            self.assertEqual((i["capacity"], i["live_handles"], i["live_mappings"]), (0, 0, 0))
            self.assertEqual(len(b.memoryview()), 0)

    def test_keep_idle_maps_kept_handles_again(self):
        with GrowableBuffer.host(64 * MiB, keep_idle=8 * MiB) as b:
            b.resize(4 * MiB)
            b.resize(12 * MiB)  # one more chunk of 8 MiB
            b.resize(4 * MiB)   # kept, not released
            i = b.info()
            self.assertEqual((i["capacity"], i["idle_bytes"], i["live_handles"]), (4 * MiB, 8 * MiB, 2))
            creates = i["create_calls"]
            b.resize(12 * MiB)
            i = b.info()
            self.assertEqual((i["create_calls"], i["idle_bytes"], i["capacity"]), (creates, 0, 12 * MiB))
            b.resize(4 * MiB)
            b.release_idle()
            i = b.info()
            self.assertEqual((i["idle_bytes"], i["live_handles"]), (0, 1))

    def test_reserve_and_geometric(self):
        with GrowableBuffer.host(1 << 30) as b:
            b.reserve(10 * MiB)
            self.assertEqual((b.size, b.capacity), (0, 10 * MiB))
        chunks = {}
        for geometric in (False, True):
            with GrowableBuffer.host(1 << 30, geometric=geometric) as g:
                for n in range(1, 129):
                    g.resize(n * MiB)
                chunks[geometric] = g.info()["chunks"]
        # 128 growths of 1 MiB: one 2 MiB chunk per two without, x1.5 per growth with geometric.
        self.assertEqual(chunks[False], 64)
        self.assertLessEqual(chunks[True], 12, "geometric: O(log n) chunks")

    def test_interfaces(self):
        with GrowableBuffer.host(16 * MiB) as b:
            b.resize(3 * MiB)
            ai = b.__array_interface__
            self.assertEqual(ai["shape"], (3 * MiB,))
            self.assertEqual(ai["data"], (b.data_ptr, False))
            self.assertEqual(ai["typestr"], "|u1")
            with self.assertRaises(AttributeError):
                b.__cuda_array_interface__
            self.assertFalse(hasattr(b, "__cuda_array_interface__"))
            self.assertEqual(len(b), 3 * MiB)
            self.assertIn("size=3145728", repr(b))

    def test_bad_input(self):
        with self.assertRaises(InvalidValueError) as cm:
            GrowableBuffer.host(0)
        self.assertIn("capacity_limit must be > 0", str(cm.exception))
        self.assertIsInstance(cm.exception, ValueError)
        self.assertEqual(cm.exception.status, Status.INVALID_VALUE)
        with self.assertRaises(InvalidValueError):
            GrowableBuffer(1 << 20, backend="opencl")
        with self.assertRaises(InvalidValueError):
            GrowableBuffer.host(-1)
        b = GrowableBuffer.host(4 * MiB)
        with self.assertRaises(InvalidValueError):
            b.resize(-5)
        with self.assertRaises(TypeError):
            copy.deepcopy(b)
        with self.assertRaises(TypeError):
            copy.copy(b)
        with self.assertRaises(TypeError):
            pickle.dumps(b)
        b.destroy()
        self.assertTrue(b.closed)
        with self.assertRaises(InvalidValueError) as cm:
            b.resize(1)
        self.assertIn("vmmalloc.GrowableBuffer.resize: the buffer was destroyed", str(cm.exception))
        b.destroy()  # twice: no-op
        self.assertEqual(repr(b), "GrowableBuffer(destroyed)")

    def test_no_leak(self):
        gc.collect()
        f0, m0 = fds(), maps()
        for i in range(40):
            b = GrowableBuffer.host(32 * MiB)
            b.resize((i % 7 + 1) * MiB)
            b.memoryview()[0] = 1
            if i % 2:
                b.destroy()  # explicit
            del b            # or by the last reference
        gc.collect()
        self.assertEqual(fds(), f0, "every chunk's memfd closed")
        self.assertEqual(maps(), m0, "every reservation unmapped")

    def test_view_keeps_memory_alive(self):
        gc.collect()
        f0 = fds()
        b = GrowableBuffer.host(8 * MiB)
        b.resize(2 * MiB)
        mv = b.memoryview()
        mv[10] = 42
        del b
        gc.collect()
        self.assertEqual(mv[10], 42, "the view still reads the memory after the buffer is dropped")
        self.assertGreater(fds(), f0)
        del mv
        gc.collect()
        self.assertEqual(fds(), f0, "freed with the last view")

    def test_threads(self):
        with GrowableBuffer.host(64 * MiB) as b:
            errors = []

            def work(k):
                try:
                    for i in range(200):
                        b.resize(((i * 7 + k) % 32 + 1) * MiB)
                        b.info()
                except Exception as e:  # pragma: no cover - the failure is reported below
                    errors.append(e)

            ts = [threading.Thread(target=work, args=(k,)) for k in range(4)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            self.assertEqual(errors, [])
            i = b.info()
            self.assertLessEqual(i["size"], i["capacity"])
            self.assertEqual(i["live_handles"], i["chunks"])


class KV(unittest.TestCase):
    # T = 4 heads x 64 x 2 bytes = 512 bytes: 4096 tokens a 2 MiB page.
    GEOM = dict(layers=3, kv_heads=4, head_dim=64, max_seqs=4, max_tokens=10000)

    def make(self, **kw):
        g = dict(self.GEOM)
        g.update(kw)
        return KVCache.host(**g)

    def test_layout_and_addresses(self):
        with self.make() as kv:
            L = kv.layout
            self.assertEqual(kv.token_bytes, 512)
            self.assertEqual(kv.page_size, 2 * MiB)
            self.assertEqual(kv.seq_stride, 6 * MiB)  # round_up(10000 x 512, 2 MiB)
            self.assertEqual(kv.buffer_stride, 4 * 6 * MiB)
            self.assertEqual(kv.reserved, 2 * 3 * 4 * 6 * MiB)
            self.assertEqual(L["tokens_per_page"], 4096)
            self.assertEqual(L["max_pages"], 3)
            self.assertEqual(kv.strides(), (2 * 24 * MiB // 2, 24 * MiB // 2, 6 * MiB // 2, 256, 64, 1))
            for s in range(4):
                for l in range(3):
                    self.assertEqual(kv.k_ptr(s, l), L["base"] + 2 * l * kv.buffer_stride + s * kv.seq_stride)
                    self.assertEqual(kv.v_ptr(s, l), L["base"] + (2 * l + 1) * kv.buffer_stride + s * kv.seq_stride)
            with self.assertRaises(InvalidValueError):
                kv.k_ptr(0, 3)
            with self.assertRaises(InvalidValueError):
                kv.k_ptr(4, 0)
            self.assertEqual(kv.pages_for(4096), 1)
            self.assertEqual(kv.pages_for(4097), 2)

    def test_fused_kv_one_buffer_per_layer(self):
        # K and V of a token side by side in one buffer per layer: half the buffers, half the pages.
        with self.make(fused_kv=True, kv_heads=8) as kv:
            L = kv.layout
            self.assertEqual(kv.token_bytes, 1024)
            self.assertEqual(kv.reserved, 3 * kv.buffer_stride)
            self.assertEqual(kv.strides()[0], kv.buffer_stride // 2)
            for l in range(3):
                self.assertEqual(kv.k_ptr(1, l), L["base"] + l * kv.buffer_stride + kv.seq_stride)
            with self.assertRaisesRegex(InvalidValueError, "fused_kv"):
                kv.v_ptr(0, 0)
            s = kv.open()
            kv.append(s, 2049)  # 2 MiB + 1 KiB: 2 pages in each of the 3 buffers
            st = kv.stats()
            self.assertEqual(st["pages_mapped"], 2 * 3)
            self.assertEqual(st["used_bytes"], 2049 * 1024 * 3)
            with self.assertRaisesRegex(InvalidValueError, "fused_kv"):
                kv.memoryview(s, 0, "v")
            mv = kv.memoryview(s, 2, "k", "H")
            self.assertEqual(mv.shape, (2049, 8, 64))
            mv[2048, 7, 63] = 0xBEEF
            self.assertEqual(kv.memoryview(s, 2, "k", "H")[2048, 7, 63], 0xBEEF)
            del mv
            kv.close(s)

    def test_per_sequence_layout_and_shared_prefix(self):
        # One buffer per sequence: a token's K and V of the 3 layers side by side (R = 6 x 512 B).
        with self.make(layout="per_sequence", layers=2, max_tokens=5000) as kv:
            L = kv.layout
            self.assertEqual(kv.token_stride, 4 * 512)
            self.assertEqual((kv.layer_stride, kv.kv_stride), (2 * 512, 512))
            self.assertEqual(kv.strides(), (512, 256, kv.seq_stride // 2, 1024, 64, 1))
            self.assertEqual(kv.k_ptr(1, 1), L["base"] + kv.seq_stride + 2 * 512)
            self.assertEqual(kv.pages_for(1024), 1)
            self.assertEqual(kv.pages_for(1025), 2)
            a = kv.open()
            kv.append(a, 3000)  # 3 pages
            self.assertEqual(kv.stats()["pages_mapped"], 3)
            tok = bytes(range(256)) * 2
            kv.store(a, 1, 1500, k=memoryview(tok * 2).cast("H"))  # tokens 1500, 1501 of layer 1's K
            with self.assertRaisesRegex(InvalidValueError, "per_sequence"):
                kv.memoryview(a, 0)
            with self.assertRaisesRegex(InvalidValueError, "has 3000 tokens"):
                kv.share_prefix(a, 3001)
            b = kv.share_prefix(a, 2500)
            info = kv.seq_info(b)
            self.assertEqual((info["length"], info["shared_tokens"]), (2500, 2048))
            st = kv.stats()
            self.assertEqual((st["pages_mapped"], st["pages_aliased"]), (4, 2))
            kv.store(a, 0, 2100, k=memoryview(tok).cast("H"))  # a's own third page: not b's
            self.assertEqual(kv.copy_prefix(a, b), 2500 - 2048)
            ka, kb = kv.k_ptr(a, 1), kv.k_ptr(b, 1)
            self.assertEqual(ctypes.string_at(kb + 1500 * kv.token_stride, 512), tok)  # shared page
            self.assertEqual(ctypes.string_at(kv.k_ptr(b, 0) + 2100 * kv.token_stride, 512), tok)  # copied
            self.assertEqual(ctypes.string_at(ka + 1501 * kv.token_stride, 512), tok)
            with self.assertRaisesRegex(InvalidValueError, "shared"):
                kv.truncate(b, 1000)
            kv.close(a)
            self.assertEqual(ctypes.string_at(kb + 1501 * kv.token_stride, 512), tok)
            self.assertEqual(kv.stats()["pages_aliased"], 0)
            kv.close(b)
            self.assertEqual(kv.trim(0), 4)
            self.assertEqual(kv.stats()["live_handles"], 0)
        with self.assertRaisesRegex(InvalidValueError, "layout"):
            self.make(layout="by_token")

    def test_growth_keeps_addresses_and_contents(self):
        with self.make() as kv:
            s = kv.open()
            self.assertEqual(kv.append(s, 10), 0)
            tok = array.array("H", range(10 * 256))  # 10 tokens of 4 x 64 uint16
            self.assertEqual(kv.store(s, 1, 0, k=tok, v=tok), 10)
            k_addr = kv.k_ptr(s, 1)
            mv = kv.memoryview(s, 1, "k", "H")
            self.assertEqual(mv.shape, (10, 4, 64))
            self.assertEqual(mv[9, 3, 63], 10 * 256 - 1)
            del mv
            self.assertEqual(kv.append(s, 5000), 10)  # crosses into the second page
            self.assertEqual(kv.k_ptr(s, 1), k_addr)
            info = kv.seq_info(s)
            self.assertEqual((info["open"], info["length"], info["mapped_pages"], info["capacity"]),
                             (True, 5010, 2, 8192))
            mv = kv.memoryview(s, 1, "k", "H")
            self.assertEqual(mv.shape, (5010, 4, 64))
            self.assertEqual(mv[0, 0, 1], 1)
            self.assertEqual(mv[9, 3, 63], 10 * 256 - 1, "old tokens stay where they were")
            mv[5009, 3, 63] = 0xBEEF  # the last token, on page 2, is mapped
            vm = kv.memoryview(s, 1, "v", "H")
            self.assertEqual(vm[9, 3, 63], 10 * 256 - 1)
            # The byte view matches the documented address of token t.
            raw = ctypes.string_at(kv.k_ptr(s, 1) + 5009 * kv.token_bytes + 511, 1)
            self.assertEqual(raw, b"\xbe")
            del mv, vm
            st = kv.stats()
            self.assertEqual(st["pages_mapped"], 2 * 6)
            self.assertEqual(st["used_bytes"], 5010 * 512 * 6)
            self.assertEqual(st["open_seqs"], 1)

    def test_capacity_and_slots(self):
        with self.make() as kv:
            s = kv.open()
            kv.append(s, 9990)
            st0 = kv.stats()
            with self.assertRaises(OutOfMemoryError) as cm:
                kv.append(s, 11)
            self.assertIn("exceed max_tokens 10000", str(cm.exception))
            self.assertIn("vmm::kv_cache::append", str(cm.exception))
            self.assertEqual(kv.length(s), 9990, "a refused append changes nothing")
            st1 = kv.stats()
            self.assertEqual((st1["pages_mapped"], st1["live_handles"]), (st0["pages_mapped"], st0["live_handles"]))
            kv.append(s, 10)  # exactly max_tokens
            for _ in range(3):
                kv.open()
            with self.assertRaises(OutOfMemoryError) as cm:
                kv.open()
            self.assertIn("sequence slots", str(cm.exception))
            with self.assertRaises(InvalidValueError) as cm:
                kv.open(2)
            self.assertIn("already open", str(cm.exception))

    def test_closed_sequence(self):
        with self.make() as kv:
            s = kv.open(3)
            kv.append(s, 100)
            kv.close(s)
            self.assertFalse(kv.is_open(s))
            for call in (lambda: kv.append(s, 1), lambda: kv.truncate(s, 0), lambda: kv.close(s)):
                with self.assertRaises(InvalidValueError) as cm:
                    call()
                self.assertIn("sequence 3 is not open", str(cm.exception))
            with self.assertRaises(InvalidValueError):
                kv.memoryview(s, 0)
            with self.assertRaises(InvalidValueError):
                kv.store(s, 0, 0, k=array.array("H", [0] * 256))
            with self.assertRaises(InvalidValueError) as cm:
                kv.seq_info(9)
            self.assertIn("out of range", str(cm.exception))

    def test_mismatched_dtypes_and_shapes(self):
        with self.make() as kv:
            s = kv.open()
            kv.append(s, 4)
            cases = [
                (dict(k=array.array("f", [0.0] * 256)), "bytes per element"),      # 4-byte items, elem 2
                (dict(k=bytes(512)), "bytes per element"),                           # 1-byte items
                (dict(k=array.array("H", [0] * 300)), "whole number of tokens"),     # not n x 256
                (dict(k=array.array("H", [0] * 256 * 5)), "append first"),           # 5 tokens > 4
                (dict(k=array.array("H", [0] * 256), v=array.array("H", [0] * 512)), "k has 1 tokens but v has 2"),
                (dict(), "give k, v or both"),
            ]
            for kw, text in cases:
                with self.assertRaises(InvalidValueError) as cm:
                    kv.store(s, 0, 0, **kw)
                self.assertIn(text, str(cm.exception))
            shaped = memoryview(bytearray(2 * 3 * 64 * 2)).cast("H", (2, 3, 64))  # 3 heads, not 4
            with self.assertRaises(InvalidValueError) as cm:
                kv.store(s, 0, 0, k=shaped)
            self.assertIn("expected [n, 4, 64]", str(cm.exception))
            with self.assertRaises(InvalidValueError):
                kv.store(s, 0, -1, k=array.array("H", [0] * 256))
            with self.assertRaises(InvalidValueError) as cm:
                kv.memoryview(s, 0, "k", "f")
            self.assertIn("elem_bytes=2", str(cm.exception))
            with self.assertRaises(InvalidValueError):
                kv.memoryview(s, 3)
            with self.assertRaises(InvalidValueError):
                kv.memoryview(s, 0, "x")
            self.assertEqual(kv.store(s, 2, 3, v=array.array("H", [7] * 256)), 1)  # the good case still works
            self.assertEqual(kv.memoryview(s, 2, "v", "H")[3, 0, 0], 7)

    def test_bad_config(self):
        with self.assertRaises(InvalidValueError) as cm:
            KVCache.host(layers=0, kv_heads=1, head_dim=1, max_seqs=1, max_tokens=1)
        self.assertIn("config.layers must be > 0", str(cm.exception))
        with self.assertRaises(InvalidValueError) as cm:
            KVCache.host(layers=1, kv_heads=1, head_dim=64, max_seqs=1, max_tokens=1, page_size=3 * MiB)
        self.assertIn("not a multiple of the granularity", str(cm.exception))
        with self.assertRaises(OutOfMemoryError) as cm:
            KVCache.host(layers=1 << 40, kv_heads=1 << 20, head_dim=1 << 20, max_seqs=1, max_tokens=1 << 20)
        self.assertIn("overflows", str(cm.exception))
        with self.assertRaises(InvalidValueError):
            KVCache.host(layers=1, kv_heads=1, head_dim=1, max_seqs=1, max_tokens=1, elem_bytes=-2)

    def test_stats_back_to_baseline(self):
        gc.collect()
        f0, m0 = fds(), maps()
        kv = self.make()
        base = kv.stats()
        self.assertEqual((base["live_handles"], base["live_mappings"], base["live_reservations"]), (0, 0, 1))
        seqs = [kv.open() for _ in range(4)]
        for i, s in enumerate(seqs):
            kv.append(s, 1000 * (i + 1) + 3000)
        with self.assertRaises(OutOfMemoryError):
            kv.append(seqs[0], 10000)
        with self.assertRaises(InvalidValueError):
            kv.append(7, 1)
        kv.truncate(seqs[3], 5)
        for s in seqs:
            kv.close(s)
        st = kv.stats()
        self.assertEqual((st["pages_mapped"], st["open_seqs"], st["used_bytes"]), (0, 0, 0))
        self.assertGreater(st["pages_pooled"], 0)
        self.assertEqual(kv.trim(0), st["pages_pooled"])
        st = kv.stats()
        self.assertEqual((st["live_handles"], st["live_mappings"], st["pages_pooled"]), (0, 0, 0))
        self.assertEqual(st["pages_created"], st["pages_released"])
        kv.destroy()
        gc.collect()
        self.assertEqual((fds(), maps()), (f0, m0), "nothing left in the process")

    def test_pool_retain_and_map_ahead(self):
        with self.make(retain_closed=True) as kv:
            s = kv.open()
            kv.append(s, 5000)  # 2 pages per buffer
            kv.close(s)
            st = kv.stats()
            self.assertEqual((st["pages_retained"], st["pages_mapped"]), (12, 12))
            t = kv.open()
            self.assertEqual(t, s, "open() takes the slot with pages still mapped")
            calls = kv.stats()["driver_calls"]
            kv.append(t, 8000)
            st = kv.stats()
            self.assertEqual(st["driver_calls"], calls, "the retained pages serve the new sequence")
            self.assertEqual(st["pages_retained_reused"], 12)
            kv.close(t)
            self.assertEqual(kv.trim(0), 12)
            self.assertEqual(kv.stats()["live_handles"], 0)
        with self.make(map_ahead_tokens=128) as kv:
            s = kv.open()
            kv.append(s, 4000)  # within 128 tokens of the end of page 1
            kv.wait_map_ahead()
            self.assertEqual(kv.seq_info(s)["mapped_pages"], 2, "the thread mapped the next page")
            calls = kv.stats()["append_driver_calls"]
            kv.append(s, 96)
            self.assertEqual(kv.stats()["append_driver_calls"], calls, "append crossed the page without a driver call")

    def test_physical_limit(self):
        with self.make(host_physical_limit=6 * 2 * MiB) as kv:
            s = kv.open()
            kv.append(s, 4096)
            before = kv.stats()
            with self.assertRaises(OutOfMemoryError):
                kv.append(s, 1)
            after = kv.stats()
            self.assertEqual(kv.length(s), 4096)
            self.assertEqual((after["live_handles"], after["pages_mapped"]), (before["live_handles"], 6))

    def test_copy_refused(self):
        with self.make() as kv:
            with self.assertRaises(TypeError):
                copy.deepcopy(kv)
            with self.assertRaises(TypeError):
                pickle.dumps(kv)
        self.assertTrue(kv.closed)
        with self.assertRaises(InvalidValueError) as cm:
            kv.open()
        self.assertIn("vmmalloc.KVCache.open: the cache was destroyed", str(cm.exception))
        with self.assertRaises(TypeError):
            copy.copy(kv)


class Loader(unittest.TestCase):
    def test_paths(self):
        from vmmalloc import _lib, _paths

        path = vmmalloc.library_path()
        self.assertTrue(path and os.path.isfile(path), path)
        lib_dir = os.path.dirname(path)
        # LIB_DIRS entries are relative to the package folder (an installed package's _paths.py).
        saved_dirs, saved_env = list(_paths.LIB_DIRS), os.environ.pop("VMMALLOC_LIB_DIR", None)
        try:
            _paths.LIB_DIRS[:] = [os.path.relpath(lib_dir, _lib.PACKAGE_DIR)]
            self.assertEqual(_lib.search_dirs()[0], os.path.normpath(lib_dir))
            self.assertEqual(os.path.dirname(_lib.find_library()), os.path.normpath(lib_dir))
            _paths.LIB_DIRS[:] = []
            os.environ["VMMALLOC_LIB_DIR"] = os.pathsep.join(["/nonexistent", lib_dir])
            self.assertEqual(os.path.dirname(_lib.find_library()), os.path.normpath(lib_dir))
            with self.assertRaises(FileNotFoundError) as cm:
                _lib.find_library("vmmalloc", "/nonexistent/libvmmalloc.so")
            self.assertIn("/nonexistent/libvmmalloc.so", str(cm.exception))
        finally:
            _paths.LIB_DIRS[:] = saved_dirs
            if saved_env is None:
                os.environ.pop("VMMALLOC_LIB_DIR", None)
            else:
                os.environ["VMMALLOC_LIB_DIR"] = saved_env

    def test_last_error_is_per_call(self):
        with self.assertRaises(OutOfMemoryError):
            GrowableBuffer.host(MiB).resize(4 * MiB)
        self.assertIn("exceeds the capacity limit", vmmalloc.last_error())
        GrowableBuffer.host(MiB).resize(MiB)
        self.assertEqual(vmmalloc.last_error(), "", "a success clears the last error")

    def test_hf_without_torch(self):
        if HAVE_TORCH:
            self.skipTest("torch is importable here")
        with self.assertRaises(ImportError) as cm:
            import vmmalloc.hf  # noqa: F401
        self.assertIn("needs torch", str(cm.exception))


@unittest.skipUnless(HAVE_TORCH, "torch not importable")
class TorchOnHost(unittest.TestCase):
    """CPU tensors over host-backend memory: the same DLPack path as CUDA tensors."""

    def test_buffer_tensor(self):
        import torch

        from vmmalloc import _dlpack

        live0 = _dlpack.live_capsules()
        b = GrowableBuffer.host(64 * MiB)
        b.resize(4 * MiB)
        t = b.tensor(torch.float32)
        self.assertEqual(t.data_ptr(), b.data_ptr)
        self.assertEqual(t.numel(), MiB)
        t.fill_(1.5)
        b.resize(32 * MiB)
        t2 = b.tensor(torch.float32)
        self.assertEqual(t2.data_ptr(), b.data_ptr)
        self.assertEqual(t2.numel(), 8 * MiB)
        self.assertEqual(float(t2[: MiB].sum()), 1.5 * MiB, "contents survive growth")
        t2[-1] = 3.0
        self.assertEqual(b.tensor(torch.float32, (8, MiB))[7, -1].item(), 3.0)
        with self.assertRaises(InvalidValueError):
            b.tensor(torch.float32, (9, MiB))
        self.assertEqual(_dlpack.live_capsules(), live0 + 1, "one capsule for the base")
        del b
        gc.collect()
        self.assertEqual(float(t2[-1]), 3.0, "views keep the memory alive")
        del t, t2
        gc.collect()
        self.assertEqual(_dlpack.live_capsules(), live0)

    def test_kv_tensors(self):
        import torch

        with KVCache.host(layers=2, kv_heads=2, head_dim=8, max_seqs=3, max_tokens=100, dtype=torch.bfloat16) as kv:
            s = kv.open(1)
            kv.append(s, 5)
            k = kv.k(s, 1)
            self.assertEqual(tuple(k.shape), (5, 2, 8))
            self.assertEqual(k.data_ptr(), kv.k_ptr(s, 1))
            x = torch.arange(5 * 16).to(torch.bfloat16).view(5, 2, 8)  # integers < 256: exact in bf16
            kv.store(s, 1, 0, k=x, v=-x)
            kv.append(s, 50)
            self.assertTrue(torch.equal(kv.k(s, 1)[:5], x))
            self.assertTrue(torch.equal(kv.v(s, 1)[:5], -x))
            base = kv.base_tensor()
            self.assertEqual(tuple(base.shape), (2, 2, 3, 100, 2, 8))
            self.assertTrue(torch.equal(base[1, 0, s, :5], x))
            with self.assertRaises(InvalidValueError):
                kv.k(s, 0, torch.float32)
            with self.assertRaises(InvalidValueError):
                kv.store(s, 0, 0, k=x.float())
            with self.assertRaises(InvalidValueError):
                kv.store(s, 0, 0, k=x.view(5, 16))
            with self.assertRaises(InvalidValueError):
                kv.k(0, 0)  # slot 0 is not open


if __name__ == "__main__":
    print("library:", vmmalloc.find_library())
    unittest.main(verbosity=2)
