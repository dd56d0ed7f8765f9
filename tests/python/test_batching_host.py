#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""vmmalloc.batching.Scheduler on the host backend (no GPU, no torch): a stand-in model writes each
fed token into the cache at its slot and position and derives the next token from everything the
cache holds for the sequence, so a token at the wrong place, a page freed under a running sequence
or a lost token after a preemption changes the outputs. Checked against the same function run one
request at a time: outputs, the KV budget at every step (the scheduler's count and the cache's
mapped pages), preemption and recompute, chunked prefill, arrivals between steps, cancel, bad input,
and a failed append that leaves everything as it was.
"""

import ctypes
import os
import random
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.normpath(os.path.join(HERE, "..", "..", "python")))

from vmmalloc import InvalidValueError, KVCache, OutOfMemoryError  # noqa: E402
from vmmalloc.batching import Scheduler, whole_page_tokens  # noqa: E402

GRAN = 4096  # host pages: 4 KiB; a token is 2 * 1 layer * 1 head * 4 dims * 2 bytes = 16 bytes: 256 per page


def make_kv(max_seqs=8, max_tokens=2048, **kw):
    return KVCache.host(1, 1, 4, max_seqs, max_tokens, elem_bytes=2, host_granularity=GRAN, layout="per_sequence",
                        **kw)


def next_token(context):
    h = 17
    for t in context:
        h = (h * 31 + t) % 1000003
    return h % 997


class Model:
    """Writes fed tokens into layer 0's K at their positions; samples from what the cache holds."""

    def __init__(self, kv):
        self.kv = kv

    def _at(self, slot, t):
        return self.kv.k_ptr(slot, 0) + t * self.kv.token_stride

    def forward(self, batch):
        for r, slot, start, n in batch.entries:
            for i, tok in enumerate(r.tokens(start, n)):
                ctypes.c_uint16.from_address(self._at(slot, start + i)).value = tok
        out = []
        for i in batch.sampling():
            r, slot, start, n = batch.entries[i]
            ctx = [ctypes.c_uint16.from_address(self._at(slot, t)).value for t in range(start + n)]
            out.append(next_token(ctx))
        return out


def alone(prompt, new):
    ctx, out = list(prompt), []
    for _ in range(new):
        out.append(next_token(ctx))
        ctx.append(out[-1])
    return out


def stream(n, seed, pmax=300, nmax=40):
    rng = random.Random(seed)
    return [([rng.randrange(1, 60000) for _ in range(rng.randint(1, pmax))], rng.randint(1, nmax)) for _ in range(n)]


def run(sched, model, kv, check_budget=True):
    steps = 0
    done = {}
    while sched.pending():
        batch = sched.schedule()
        if check_budget:
            assert sched.pages_held() <= sched.budget_pages
            assert kv.stats()["pages_mapped"] <= sched.budget_pages, kv.stats()
            assert batch.tokens <= sched.max_batch_tokens
        slots = [e[1] for e in batch.entries]
        assert slots == sorted(slots) and len(set(slots)) == len(slots)
        for r in sched.complete(batch, model.forward(batch)):
            done[r.id] = r
        steps += 1
        assert steps < 100000
    return done


class SchedulerTest(unittest.TestCase):
    def test_outputs_equal_one_at_a_time_within_the_budget(self):
        kv = make_kv()
        sched = Scheduler(kv, kv_budget_bytes=6 * GRAN, max_batch_tokens=256)
        reqs = stream(40, 1)
        ids = [sched.add(p, n) for p, n in reqs]
        done = run(sched, Model(kv), kv)
        self.assertEqual(sorted(done), sorted(ids))
        for rid, (p, n) in zip(ids, reqs):
            self.assertEqual(done[rid].output, alone(p, n), rid)
            self.assertEqual(done[rid].finish_reason, "length")
        c = sched.counters
        self.assertGreater(c["preemptions"], 0)   # 6 pages for up to 8 sequences of up to 2 pages
        self.assertGreater(c["recomputed"], 0)
        self.assertGreater(c["peak_running"], 1)
        self.assertLessEqual(c["peak_pages"], 6)
        self.assertEqual(c["generated"], sum(n for _, n in reqs))
        self.assertEqual(kv.stats()["open_seqs"], 0)
        self.assertLessEqual(kv.stats()["pages_created"], 6)  # the pool never held more than the budget

    def test_chunked_prefill_and_eos(self):
        kv = make_kv()
        sched = Scheduler(kv, kv_budget_bytes=64 * GRAN, max_batch_tokens=50)
        prompt = list(range(1, 301))
        first = alone(prompt, 5)
        rid = sched.add(prompt, 5, eos_token_ids=[first[2]])
        model = Model(kv)
        steps = 0
        while sched.pending():
            b = sched.schedule()
            self.assertLessEqual(b.tokens, 50)
            done = sched.complete(b, model.forward(b))
            steps += 1
        self.assertEqual(steps, 6 + 2)  # 300 prompt tokens in chunks of 50, then 2 decodes
        self.assertEqual(done[0].id, rid)
        self.assertEqual(done[0].output, first[:3])
        self.assertEqual(done[0].finish_reason, "eos")

    def test_arrivals_between_steps_and_cancel(self):
        kv = make_kv(max_seqs=4)
        sched = Scheduler(kv, kv_budget_bytes=32 * GRAN, max_batch_tokens=128)
        model = Model(kv)
        reqs = stream(12, 2)
        ids, done, k = [], {}, 0
        while k < len(reqs) or sched.pending():
            if k < len(reqs):
                ids.append(sched.add(*reqs[k], request_id="r%d" % k))
                k += 1
            b = sched.schedule()
            toks = model.forward(b)
            if len(sched.running()) == 4 and "r0" not in done:
                sched.cancel("r0")  # after the step's work, before complete(): its token is dropped
            for r in sched.complete(b, toks):
                done[r.id] = r
        self.assertNotIn("r0", done)
        for i in range(1, 12):
            self.assertEqual(done["r%d" % i].output, alone(*reqs[i]))
        self.assertLessEqual(sched.counters["peak_running"], 4)
        self.assertIsNone(sched.cancel("r5"))  # finished
        w = sched.add([1, 2, 3], 4, request_id="w")
        self.assertEqual(sched.cancel(w).status, "cancelled")
        self.assertFalse(sched.pending())
        self.assertEqual(kv.stats()["open_seqs"], 0)

    def test_bad_input(self):
        kv = make_kv(max_tokens=600)
        sched = Scheduler(kv, kv_budget_bytes=2 * GRAN)
        with self.assertRaisesRegex(InvalidValueError, "holds 600 per sequence"):
            sched.add([1] * 590, 20)
        with self.assertRaisesRegex(InvalidValueError, "KV budget is 2 pages"):
            sched.add([1] * 520, 10)
        with self.assertRaisesRegex(InvalidValueError, "empty"):
            sched.add([], 3)
        with self.assertRaisesRegex(InvalidValueError, "max_new_tokens"):
            sched.add([1], 0)
        with self.assertRaisesRegex(InvalidValueError, ">= 0"):
            sched.add([1, -2], 1)
        sched.add([1], 1, request_id="a")
        with self.assertRaisesRegex(InvalidValueError, "already queued"):
            sched.add([1], 1, request_id="a")
        self.assertEqual(len(sched.waiting()), 1)
        b = sched.schedule()
        with self.assertRaisesRegex(InvalidValueError, "1 sampling entries"):
            sched.complete(b, [])
        self.assertEqual(sched.complete(b, [5])[0].output, [5])
        with self.assertRaisesRegex(InvalidValueError, "per_sequence"):
            Scheduler(KVCache.host(1, 1, 4, 2, 64, elem_bytes=2, host_granularity=GRAN), GRAN)
        with self.assertRaisesRegex(InvalidValueError, "less than one page"):
            Scheduler(kv, GRAN - 1)
        with self.assertRaisesRegex(InvalidValueError, "max_batch_tokens"):
            Scheduler(kv, GRAN, max_batch_tokens=0)

    def test_whole_page_tokens(self):
        # 3 layers x 1 head x 4 dims x 2 bytes x K|V = 48-byte tokens: 4096 / 48 is not whole.
        odd = KVCache.host(3, 1, 4, 2, 100, elem_bytes=2, host_granularity=GRAN, layout="per_sequence")
        self.assertEqual(odd.token_stride, 48)
        self.assertNotEqual(odd.seq_stride % odd.token_stride, 0)
        n = whole_page_tokens(100, odd.token_stride, odd.page_size)
        self.assertEqual(n, 256)  # 4096 / gcd(48, 4096) = 256 tokens: 3 pages exactly
        kv = KVCache.host(3, 1, 4, 2, n, elem_bytes=2, host_granularity=GRAN, layout="per_sequence")
        self.assertEqual(kv.seq_stride, n * kv.token_stride)
        self.assertEqual(whole_page_tokens(256, 16, GRAN), 256)  # already whole: unchanged
        self.assertEqual(whole_page_tokens(1, 16, GRAN), 256)
        # The scheduler keeps the caller's limit when the cache was rounded up.
        sched = Scheduler(kv, 3 * GRAN, max_tokens=100)
        self.assertEqual(sched.max_tokens, 100)
        with self.assertRaisesRegex(InvalidValueError, "holds 100 per sequence"):
            sched.add([1] * 100, 2)
        sched.add([1] * 99, 2)

    def test_failed_append_changes_nothing(self):
        # The backend holds 3 pages; the budget says 8: the fourth page's append fails.
        kv = make_kv(max_seqs=4, host_physical_limit=3 * GRAN)
        sched = Scheduler(kv, kv_budget_bytes=8 * GRAN, max_batch_tokens=4096)
        model = Model(kv)
        a = sched.add([7] * 300, 2)  # 2 pages
        b = sched.schedule()
        sched.complete(b, model.forward(b))
        sched.add([9] * 300, 2)      # 2 more: past what the backend holds
        with self.assertRaises(OutOfMemoryError):
            sched.schedule()
        self.assertEqual([r.id for r in sched.running()], [a])
        self.assertEqual(len(sched.waiting()), 1)
        self.assertEqual(kv.stats()["open_seqs"], 1)
        self.assertEqual(kv.length(sched.running()[0].slot), 300)
        self.assertEqual(sched.running()[0].cached, 300)
        sched.cancel(sched.waiting()[0].id)
        done = run(sched, model, kv)   # the running request still finishes, with the right tokens
        self.assertEqual(done[a].output, alone([7] * 300, 2))


if __name__ == "__main__":
    unittest.main(verbosity=2)
