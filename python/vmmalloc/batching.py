# SPDX-License-Identifier: Apache-2.0
"""vmmalloc.batching: continuous batching over a KVCache: which requests run in the next forward,
what each one feeds, and which pages that takes. Pure Python (no torch): vmmalloc.serve runs a
model with it; a caller with a model of its own can too.

    kv = KVCache(layers, kv_heads, head_dim, max_seqs, max_tokens, dtype=..., layout="per_sequence")
    sched = Scheduler(kv, kv_budget_bytes=8 << 30, max_batch_tokens=4096)
    rid = sched.add(prompt_ids, max_new_tokens=128)     # whenever a request arrives
    while sched.pending():
        batch = sched.schedule()       # admits, preempts, appends (maps pages) in the cache
        tokens = forward(batch)        # one token per batch.sampling() entry, in that order
        done = sched.complete(batch, tokens)             # finished requests; their slots closed

Each running request holds one sequence (slot) of the cache, so a batch's tokens are read in place
at kv's addresses: entry (request, slot, start, n) writes tokens [start, start + n) of the
request's context (prompt, then what it generated) at those positions of the slot and attends over
[0, start + n).

Policy, first come first served:
  * every running request that has finished its prompt decodes one token per step; prompts are
    prefilled in chunks with the rest of max_batch_tokens (oldest first), and a request samples its
    first token in the step that feeds the end of its prompt;
  * the KV budget counts pages: a sequence of n tokens holds kv.pages_for(n) pages (the
    per_sequence layout: one partly filled page per sequence). When the running requests' next
    tokens do not fit, the newest is preempted: its slot is closed (pages back to the cache's pool)
    and it waits at the head of the queue; admitted again, its prompt and the tokens it generated
    are prefilled anew (recompute, as vLLM; the tokens it generated are kept);
  * waiting requests are admitted in arrival order while a slot is free, the step has tokens left
    and the pages of their whole context fit beside the running ones; never in a step that
    preempted.
add() refuses a request that could not finish alone (longer than max_tokens, or more pages than
the budget): clear errors, nothing changed. A failed append (the device out of memory) undoes the
step's appends and admissions and re-raises: nothing is lost.

Threads: one thread schedules and completes (the serving loop); add() and cancel() take a lock,
so requests may arrive from others.
"""

import collections
import math
import threading

from ._lib import InvalidValueError, Status

__all__ = ["Batch", "Request", "Scheduler", "whole_page_tokens"]


def _invalid(msg):
    return InvalidValueError(msg, Status.INVALID_VALUE)


def whole_page_tokens(max_tokens, token_stride, page_size):
    """The least n >= max_tokens whose n * token_stride bytes are whole pages: a cache made with
    it has a sequence stride of exactly n tokens, so every sequence starts on a token row of one
    strided view (what one attention call over all sequences needs). Costs only address space."""
    step = page_size // math.gcd(int(token_stride), int(page_size))
    return -(-int(max_tokens) // step) * step


class Request:
    """One generation: prompt token ids, what it generated (output), where it is."""

    __slots__ = ("id", "prompt", "max_new_tokens", "eos", "output", "slot", "cached", "status", "finish_reason",
                 "preemptions", "arrival")

    def __init__(self, rid, prompt, max_new_tokens, eos, arrival):
        self.id = rid
        self.prompt = prompt
        self.max_new_tokens = max_new_tokens
        self.eos = eos
        self.output = []
        self.slot = None        # the cache's sequence while running
        self.cached = 0         # tokens of the context in the cache
        self.status = "waiting"  # running, finished, cancelled
        self.finish_reason = None  # "length" or "eos"
        self.preemptions = 0
        self.arrival = arrival

    @property
    def context_len(self):
        return len(self.prompt) + len(self.output)

    def tokens(self, start, n):
        """Tokens [start, start + n) of the context (prompt, then output)."""
        p = len(self.prompt)
        if start + n <= p:
            return self.prompt[start:start + n]
        if start >= p:
            return self.output[start - p:start - p + n]
        return self.prompt[start:] + self.output[:start + n - p]

    def __repr__(self):
        return "Request(%r, %s, prompt=%d, output=%d/%d, cached=%d)" % (
            self.id, self.status, len(self.prompt), len(self.output), self.max_new_tokens, self.cached)


class Batch:
    """One step: entries (request, slot, start, n), sorted by slot. An entry samples (its request
    gets a token) when it feeds the end of the context."""

    __slots__ = ("entries", "tokens", "preempted", "admitted")

    def __init__(self, entries, preempted, admitted):
        self.entries = entries
        self.tokens = sum(e[3] for e in entries)
        self.preempted = preempted
        self.admitted = admitted

    def sampling(self):
        """Indices of the entries whose request gets a token from this step."""
        return [i for i, (r, _, start, n) in enumerate(self.entries) if start + n == r.context_len]

    def __len__(self):
        return len(self.entries)


class Scheduler:
    """Continuous batching over `kv` (a KVCache with layout="per_sequence") within kv_budget_bytes
    of pages; at most max_batch_tokens tokens per step, max_running sequences (default: the
    cache's slots) and max_tokens tokens a sequence (default: the cache's)."""

    def __init__(self, kv, kv_budget_bytes, max_batch_tokens=4096, max_running=None, max_tokens=None):
        if getattr(kv, "layout_kind", None) != "per_sequence":
            raise _invalid("vmmalloc.Scheduler: the KVCache needs layout=\"per_sequence\" (one buffer, so one "
                           "partly filled page, per sequence)")
        self.kv = kv
        self.budget_pages = int(kv_budget_bytes) // kv.page_size
        if self.budget_pages < 1:
            raise _invalid("vmmalloc.Scheduler: kv_budget_bytes=%d is less than one page (%d bytes)"
                           % (kv_budget_bytes, kv.page_size))
        self.max_batch_tokens = int(max_batch_tokens)
        if self.max_batch_tokens < 1:
            raise _invalid("vmmalloc.Scheduler: max_batch_tokens must be at least 1")
        self.max_running = kv.max_seqs if max_running is None else min(int(max_running), kv.max_seqs)
        # Tokens a sequence may hold: the cache's, or less (a cache rounded up to whole pages).
        self.max_tokens = kv.max_tokens if max_tokens is None else min(int(max_tokens), kv.max_tokens)
        if self.max_running < 1:
            raise _invalid("vmmalloc.Scheduler: max_running must be at least 1")
        self._lock = threading.Lock()
        self._waiting = collections.deque()  # arrival order; preempted requests go back to the front
        self._running = []                   # admission order
        self._requests = {}                  # id -> Request, until finished or cancelled
        self._next_id = 0
        self._arrivals = 0
        self.counters = {"steps": 0, "preemptions": 0, "peak_running": 0, "peak_pages": 0, "generated": 0,
                         "fed": 0, "recomputed": 0, "finished": 0}

    # ---- requests --------------------------------------------------------------------------

    def add(self, prompt, max_new_tokens, request_id=None, eos_token_ids=()):
        """Queues a request; returns its id (request_id, or a new integer)."""
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise _invalid("vmmalloc.Scheduler.add: the prompt is empty")
        if min(prompt) < 0:
            raise _invalid("vmmalloc.Scheduler.add: token ids must be >= 0")
        if int(max_new_tokens) < 1:
            raise _invalid("vmmalloc.Scheduler.add: max_new_tokens must be at least 1, not %r" % (max_new_tokens,))
        max_new_tokens = int(max_new_tokens)
        # The last token generated is never fed back: the cache holds at most prompt + new - 1.
        longest = len(prompt) + max_new_tokens - 1
        if longest > self.max_tokens:
            raise _invalid("vmmalloc.Scheduler.add: a prompt of %d tokens and %d new ones need %d tokens of cache; "
                           "the KVCache holds %d per sequence" % (len(prompt), max_new_tokens, longest,
                                                                  self.max_tokens))
        if self.kv.pages_for(longest) > self.budget_pages:
            raise _invalid("vmmalloc.Scheduler.add: %d tokens need %d pages; the KV budget is %d pages"
                           % (longest, self.kv.pages_for(longest), self.budget_pages))
        eos = frozenset(int(t) for t in (eos_token_ids or ()))
        with self._lock:
            if request_id is None:
                while self._next_id in self._requests:
                    self._next_id += 1
                request_id = self._next_id
                self._next_id += 1
            elif request_id in self._requests:
                raise _invalid("vmmalloc.Scheduler.add: request %r is already queued or running" % (request_id,))
            r = Request(request_id, prompt, max_new_tokens, eos, self._arrivals)
            self._arrivals += 1
            self._requests[request_id] = r
            self._waiting.append(r)
        return request_id

    def cancel(self, request_id):
        """Drops a waiting or running request; its slot is closed at once, so no GPU work may still
        read it (call it between steps; a batch scheduled before drops its token). Returns the
        Request, or None when unknown or finished."""
        with self._lock:
            r = self._requests.pop(request_id, None)
            if r is None:
                return None
            if r.status == "waiting":
                self._waiting.remove(r)
            else:
                self._running.remove(r)
                self._close(r)
            r.status = "cancelled"
            return r

    def pending(self):
        """Requests waiting or running."""
        with self._lock:
            return bool(self._waiting or self._running)

    def running(self):
        with self._lock:
            return list(self._running)

    def waiting(self):
        with self._lock:
            return list(self._waiting)

    def pages_held(self):
        """Pages the running sequences hold now (what the budget counts)."""
        with self._lock:
            return sum(self.kv.pages_for(r.cached) for r in self._running)

    # ---- steps -----------------------------------------------------------------------------

    def _plan_running(self):
        """Tokens each running request feeds this step: decodes 1, then prompt chunks, oldest first."""
        left = self.max_batch_tokens
        plan = {}
        for r in self._running:
            if r.context_len - r.cached == 1:
                n = 1 if left >= 1 else 0
                plan[r.id] = n
                left -= n
        for r in self._running:
            if r.id not in plan:
                n = min(r.context_len - r.cached, left)
                plan[r.id] = n
                left -= n
        return plan, left

    def _close(self, r):
        self.kv.close(r.slot)
        r.slot = None
        r.cached = 0

    def schedule(self):
        """The next step's Batch (empty when nothing is pending). Maps the pages its tokens need."""
        with self._lock:
            return self._schedule()

    def _schedule(self):
        pages = self.kv.pages_for
        preempted = []
        while True:
            plan, left = self._plan_running()
            need = sum(pages(r.cached + plan[r.id]) for r in self._running)
            if need <= self.budget_pages or len(self._running) <= 1:
                break
            r = self._running.pop()  # the newest: it has the least work to lose
            self._close(r)
            r.status = "waiting"
            r.preemptions += 1
            preempted.append(r)
        for r in preempted:  # the oldest of them first
            self._waiting.appendleft(r)
        admitted = []
        if not preempted:
            # What the running requests hold after this step, plus each admitted one's whole context.
            committed = need
            while (self._waiting and left > 0 and len(self._running) + len(admitted) < self.max_running):
                r = self._waiting[0]
                if committed + pages(r.context_len) > self.budget_pages:
                    break  # first come first served: nobody overtakes it
                self._waiting.popleft()
                n = min(r.context_len, left)
                admitted.append((r, n))
                plan[r.id] = n
                left -= n
                committed += pages(r.context_len)
        # Appends first, state after: a failure leaves the scheduler and the cache as they were.
        opened, appended = [], []
        try:
            for r, _ in admitted:
                r.slot = self.kv.open()
                opened.append(r)
            for r in self._running + [a for a, _ in admitted]:
                n = plan[r.id]
                if n:
                    self.kv.append(r.slot, n)
                    appended.append(r)
        except BaseException:
            for r in appended:
                self.kv.truncate(r.slot, r.cached)
            for r in opened:
                self.kv.close(r.slot)
                r.slot = None
            for r, _ in reversed(admitted):
                self._waiting.appendleft(r)
            raise
        for r, _ in admitted:
            r.status = "running"
            self._running.append(r)
            if r.output:
                self.counters["recomputed"] += r.context_len
        entries = sorted(((r, r.slot, r.cached, plan[r.id]) for r in self._running if plan[r.id]),
                         key=lambda e: e[1])
        c = self.counters
        c["preemptions"] += len(preempted)
        c["peak_running"] = max(c["peak_running"], len(self._running))
        c["peak_pages"] = max(c["peak_pages"], sum(pages(r.cached + plan[r.id]) for r in self._running))
        if entries:
            c["steps"] += 1
        return Batch(entries, preempted, [a for a, _ in admitted])

    def complete(self, batch, tokens):
        """Records a step: `tokens` holds one token id per batch.sampling() entry, in that order.
        Returns the requests that finished (their slots closed: the step's GPU work must be done,
        as it is once its tokens are on the host)."""
        sampling = batch.sampling()
        tokens = [int(t) for t in tokens]
        if len(tokens) != len(sampling):
            raise _invalid("vmmalloc.Scheduler.complete: %d tokens for %d sampling entries"
                           % (len(tokens), len(sampling)))
        finished = []
        with self._lock:
            live = [r.status != "cancelled" for r, _, _, _ in batch.entries]
            for ok, (r, slot, start, n) in zip(live, batch.entries):
                if ok and (r.slot != slot or r.cached != start):
                    raise _invalid("vmmalloc.Scheduler.complete: request %r changed since the batch was scheduled"
                                   % (r.id,))
            for ok, (r, slot, start, n) in zip(live, batch.entries):
                if ok:
                    r.cached += n
                    self.counters["fed"] += n
            for i, tok in zip(sampling, tokens):
                r = batch.entries[i][0]
                if not live[i]:
                    continue  # cancelled during the step: its token is dropped
                r.output.append(tok)
                self.counters["generated"] += 1
                if tok in r.eos or len(r.output) >= r.max_new_tokens:
                    r.finish_reason = "eos" if tok in r.eos else "length"
                    r.status = "finished"
                    self._running.remove(r)
                    self._close(r)
                    del self._requests[r.id]
                    finished.append(r)
            self.counters["finished"] += len(finished)
        return finished
