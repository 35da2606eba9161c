"""The scheduler: what runs next (no jax). It owns the admission queue, the slot table and the
KV page pool (pages.py), and turns them into decisions -- which queued requests enter which
free slots with which pages, which prompt chunks to prefill this iteration, which rows are
released or paused, and the next step as a `StepPlan` (live rows, attention bucket, top-k of
logprobs). The engine thread (core.py) carries the decisions out through the backend and the
output processor; user threads only enqueue and wake it.

Admission: in queue order, a request enters when a slot is free and its pages fit -- the pages
of its prompt and of `max_tokens` outputs (reserved up front, so a running request never waits
for memory; rows past a row's reservation are never read). A request's prompt prefix found in
the prefix cache is mapped, not recomputed; the samples of one prompt admitted together
(`LLM.generate` with n > 1) share its prompt pages and only the first prefills. When the
request at the head does not fit, admission waits (the queue keeps its order).

Multi-step decoding: a plain engine's step may run up to `decode_steps` decode steps in one
device call, fewer host round trips per token (the tokens are those of single steps). It
does so only when nothing waits for the device -- no queued request, no prompt prefilling, no
row before its first step (its first token comes after one step) -- and every live stream has
room for two such calls' deltas; otherwise one step per call, so a request that arrives waits
for at most one multi-step call.

Compaction: when few rows decode, a step runs only their slots (and enough idle ones for a
count of `min_rows` times a power of two): its cost follows the live rows, not max_slots, and
batch invariance keeps their tokens.

Chunked prefill: every iteration prefills at most `prefill_chunk` prompt tokens (at least one
chunk), before the running rows' decode step, so a long prompt delays the running streams by at
most one chunk per step. Chunks start at multiples of the chunk size (shapes.chunk_plan). The
chunks of one iteration that share a program shape run as one device call (a burst of short
prompts is one call, not one each); a row's bits do not depend on the rows beside it
(docs/batch_invariance.md), so the prefix cache stays exact.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Callable, Optional

import numpy as np

from jaxdecode.engine.pages import NULL_PAGE, PagePool, page_keys
from jaxdecode.engine.request import Request
from jaxdecode.shapes import MIN_BUCKET, chunk_length, chunk_plan, kv_bucket, row_buckets


def compact_counts(min_rows: int, max_slots: int) -> list[int]:
    """The row counts of a step over fewer rows than the slots (compaction): `min_rows` times
    a power of two, below max_slots."""
    return [n for n in (min_rows << i for i in range(max_slots.bit_length())) if n < max_slots]


def chunk_rows(t: int, prefill_chunk: int, max_slots: int) -> list[int]:
    """The row counts a prefill call of chunks of length T can run (shapes.row_bucket): one
    iteration's chunks hold at most `prefill_chunk` tokens and one chunk per slot."""
    return row_buckets(min(max_slots, max(1, prefill_chunk // t)))


class QueueFull(RuntimeError):
    """The admission queue is at `max_queue`; retry later (HTTP 429)."""


class EngineClosed(RuntimeError):
    """The engine was closed; it accepts no more requests."""


@dataclasses.dataclass
class StepPlan:
    """The next step: the owner of each slot when it is dispatched (None: empty, prefilling or
    not live), the live requests, the release / pause masks to apply first (None: unchanged),
    the attention bucket, the top-k of logprobs (0 or the engine's `logprobs_k`) and the
    decode steps it runs."""

    owners: list
    live: list
    flags: Optional[tuple[np.ndarray, np.ndarray]]
    kv_len: int
    top_k: int
    steps: int = 1
    rows: Optional[np.ndarray] = None


@dataclasses.dataclass
class Chunk:
    """One prefill chunk of a request: positions [start, start + length) run at length T with
    attention bucket kv_len; `final`: the prompt's last chunk (its rows start decoding)."""

    request: Request
    start: int
    t: int
    length: int
    kv_len: int
    final: bool


class Scheduler:
    """The queue, the slots and the pages (module docstring). `cond` guards the queue; the
    slot table, the pages and the masks belong to the engine thread."""

    def __init__(self, max_slots: int, max_len: int, max_queue: int, pool: PagePool,
                 prefill_chunk: int, extra_positions: int = 0,
                 namespace: Callable[[], str] = lambda: "", prefill_last: bool = True,
                 min_rows: int = 2):
        self.max_slots, self.max_len, self.max_queue = max_slots, max_len, max_queue
        self.pool, self.prefill_chunk = pool, prefill_chunk
        self.extra_positions = extra_positions  # speculative rounds write k + 1 ahead
        # a speculative round writes the prompt's last token itself (it is pending): its
        # prefill stops one short, so no cached page ever holds a position a round rewrites
        self.prefill_last = prefill_last
        self.namespace = namespace               # the model snapshot (prefix cache keys)
        self.min_rows = min_rows                 # the fewest rows a step runs (no batch of 1)
        self.cond = threading.Condition()
        self.queue: collections.deque[Request] = collections.deque()
        self.slots: list[Optional[Request]] = [None] * max_slots
        self.prefilling: list[Request] = []      # admitted, prompt chunks pending
        self.release = np.zeros(max_slots, bool)
        self.paused = np.zeros(max_slots, bool)
        self.closed = False

    @property
    def page_size(self) -> int:
        return self.pool.page_size

    @property
    def pages_per_row(self) -> int:
        return -(-self.max_len // self.page_size)

    # -- the queue (any thread) ---------------------------------------------------------------

    def enqueue(self, requests: list, block: bool, on_queued: Callable[[Request], None]) -> None:
        """Queue requests together, in order (`on_queued` marks each); `QueueFull` when there
        is no room for all of them (unless `block`: then they go in as room opens),
        `EngineClosed` once closed."""
        with self.cond:
            pending = list(requests)
            while pending:
                if self.closed:
                    raise EngineClosed("the engine is closed")
                room = self.max_queue - len(self.queue)
                if not block and room < len(pending):  # all or none
                    raise QueueFull(f"admission queue is full ({self.max_queue} requests)")
                if room <= 0:
                    self.cond.wait(0.05)
                    continue
                for r in pending[:room]:
                    on_queued(r)
                    self.queue.append(r)
                pending = pending[room:]
                self.cond.notify_all()

    def requeue_front(self, requests: list) -> None:
        """Put requests back at the head of the queue, in their order (after a failed step)."""
        with self.cond:
            self.queue.extendleft(reversed(requests))
            self.cond.notify_all()

    def wake(self) -> None:
        with self.cond:
            self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()

    @property
    def num_waiting(self) -> int:
        return len(self.queue)

    @property
    def num_running(self) -> int:
        return sum(r is not None for r in self.slots)

    def idle(self) -> bool:
        return not any(self.slots) and not self.queue

    # -- pages ----------------------------------------------------------------------------------

    def reserved_pages(self, r: Request) -> int:
        """Pages a request holds: its inputs and max_tokens outputs (module docstring)."""
        positions = len(r.prompt_ids) + r.device_sampling.max_tokens + self.extra_positions
        return -(-min(positions, self.max_len) // self.page_size)

    def prefill_inputs(self, r: Request) -> list[int]:
        """The tokens r's prefill writes: its prompt and the tokens it already selected (a
        request rebuilt after a failed step), but the last one for a speculative engine."""
        inputs = r.prompt_ids + r.token_ids
        return inputs if self.prefill_last else inputs[:-1]

    def _shared_pages(self, r: Request) -> int:
        """Full prefilled pages a sample shares with the first sample of its prompt."""
        return len(self.prefill_inputs(r)) // self.page_size

    def _cached(self, r: Request) -> list[int]:
        """The pages of the longest cached prefix of r's inputs that ends on a chunk boundary
        before its last chunk (that one must run: it gives the logits)."""
        inputs = self.prefill_inputs(r)
        per_chunk = self.prefill_chunk // self.page_size
        r.page_keys = page_keys(inputs, self.page_size, self.prefill_chunk,
                                chunk_length(len(inputs), self.prefill_chunk), self.namespace())
        usable = max(0, len(inputs) - 1) // self.prefill_chunk * per_chunk
        hits = self.pool.lookup(r.page_keys, usable)
        return hits[:len(hits) // per_chunk * per_chunk]

    def take_pages(self, group: list) -> bool:
        """Pages for a request and the samples sharing its prompt, or False (nothing taken)."""
        lead = group[0]
        hits = [] if lead.restored is not None else self._cached(lead)
        shared = self._shared_pages(lead)
        need = self.reserved_pages(lead) - len(hits) + sum(
            self.reserved_pages(r) - shared for r in group[1:])
        if need > self.pool.available() - sum(1 for p in hits if self.pool.refs[p] == 0):
            return False
        self.pool.retain(hits)
        lead.pages = hits + self.pool.allocate(self.reserved_pages(lead) - len(hits))
        lead.cached_tokens = lead.prefilled = len(hits) * self.page_size
        self.pool.queries += len(lead.prompt_ids)
        self.pool.hits += min(lead.cached_tokens, len(lead.prompt_ids))
        for r in group[1:]:
            self.pool.retain(lead.pages[:shared])
            r.pages = lead.pages[:shared] + self.pool.allocate(self.reserved_pages(r) - shared)
            r.cached_tokens = 0
        lead.sharers = group[1:]
        return True

    def table(self, r: Request) -> np.ndarray:
        """int32[pages_per_row]: r's pages, then the null page."""
        out = np.full((self.pages_per_row,), NULL_PAGE, np.int32)
        out[:len(r.pages)] = r.pages
        return out

    def register(self, chunk: Chunk) -> None:
        """After a chunk ran: cache its full pages (prefix cache)."""
        r = chunk.request
        first, end = chunk.start // self.page_size, (chunk.start + chunk.length) // self.page_size
        self.pool.register(r.pages[first:end], r.page_keys[first:end])

    # -- decisions (the engine thread) --------------------------------------------------------

    def queued(self) -> list:
        with self.cond:
            return list(self.queue)

    def drop_ended(self) -> None:
        """Forget queued requests that have ended (cancelled or expired before a slot)."""
        with self.cond:
            self.queue = collections.deque(r for r in self.queue if not r.lifecycle.is_terminal)
            self.cond.notify_all()

    def take_beams(self) -> list:
        """Every queued beam request, out of the queue (the beam lane runs them now)."""
        with self.cond:
            beams = [r for r in self.queue if r.is_beam]
            if beams:
                self.queue = collections.deque(r for r in self.queue if not r.is_beam)
                self.cond.notify_all()
            return beams

    def admissions(self) -> list[tuple[Request, int]]:
        """Queued requests for the free slots whose pages fit, in queue order (module
        docstring), with the samples of one prompt that come right after it: (request, slot)
        pairs. A restored request brings its own arrays (pages: prompt and outputs so far)."""
        free = [slot for slot, r in enumerate(self.slots) if r is None]
        placed: list = []
        with self.cond:
            while self.queue and len(placed) < len(free):
                group = [self.queue[0]]
                while (len(group) < min(len(self.queue), len(free) - len(placed))
                       and self.queue[len(group)].share_with is group[0]):
                    group.append(self.queue[len(group)])
                if not self.take_pages(group):
                    break
                for r in group:
                    self.queue.popleft()
                    placed.append((r, free[len(placed)]))
            self.cond.notify_all()
        return placed

    def place(self, r: Request, slot: int, dispatched: int, prefilling: bool) -> None:
        """`r` now owns `slot`, `dispatched` steps counted (its tokens so far); a request whose
        prompt chunks are pending is not live until its last chunk ran."""
        self.release[slot] = False
        r.slot, r.dispatched, r.in_flight = slot, dispatched, 0
        self.slots[slot] = r
        r.is_prefilling = prefilling
        if prefilling and r.sharers is not None:
            self.prefilling.append(r)

    def chunks(self) -> list[list[Chunk]]:
        """This iteration's prefill chunks: at most `prefill_chunk` tokens (at least one
        chunk), one chunk per request, the oldest admitted request first; batched by program
        shape (T, attention bucket), each batch one device call (so the chunks of one iteration
        never depend on each other), the shortest chunks first (their prompts' first tokens
        stream as soon as their own call ends: core.py)."""
        out, budget = [], self.prefill_chunk
        for r in list(self.prefilling):
            inputs = len(self.prefill_inputs(r))
            start, t, length, kv = (chunk_plan(inputs, r.prefilled, self.prefill_chunk,
                                               self.max_len)
                                    or [(0, MIN_BUCKET, 0, kv_bucket(MIN_BUCKET, self.max_len))]
                                    )[0]  # (nothing to write: a chunk for the logits)
            if out and t > budget:
                break
            out.append(Chunk(r, start, t, length, kv, start + length == inputs))
            budget -= t
            r.prefilled = start + length
            if r.prefilled == inputs:
                self.prefilling.remove(r)
        batches: dict = {}
        for c in out:
            batches.setdefault((c.t, c.kv_len), []).append(c)
        return [batches[shape] for shape in sorted(batches)]

    def free(self, r: Request) -> None:
        """Release `r`'s slot and pages (the device row is marked done before the next
        step). A request that ends while it prefills for samples sharing its pages sends them
        back to the head of the queue (they prefill on their own); a sample that ends leaves
        its prompt's group."""
        slot = r.slot
        if slot is not None and self.slots[slot] is r:
            self.slots[slot] = None
            self.release[slot] = True
        if r in self.prefilling:
            self.prefilling.remove(r)
        self.pool.release(r.pages)
        r.pages = []
        lead = r.share_with
        if lead is not None and lead.sharers and r in lead.sharers:
            lead.sharers.remove(r)
        if r.is_prefilling and r.sharers:
            for x in r.sharers:
                self.slots[x.slot] = None
                self.pool.release(x.pages)
                x.slot, x.pages, x.is_prefilling, x.share_with = None, [], False, None
            self.requeue_front(r.sharers)
            r.sharers = []

    def reset(self) -> None:
        """Forget every slot assignment and page (the device state was dropped)."""
        self.slots = [None] * self.max_slots
        self.prefilling = []
        self.release[:] = False
        self.paused[:] = False
        self.pool.reset()

    def plan(self, kv_needed: Callable[[Request, int], int], logprobs_k: int,
             decode_steps: int = 1, compact: bool = False) -> StepPlan:
        """The next step over the slots: rows paused by their user or by back-pressure skip it
        (their state untouched, contract B1); pause changes are recorded in the trace. It runs
        `decode_steps` steps when nothing waits, and with `compact` only the live rows' slots
        when they are few (module docstring)."""
        owners = list(self.slots)
        paused = np.array([r is not None and (r.user_paused or r.lifecycle.stream.should_pause)
                           for r in owners])
        for r, now, before in zip(owners, paused, self.paused):
            if r is not None and now != before:
                r.lifecycle.record("backpressure.paused" if now else "backpressure.resumed")
        flags = None
        if self.release.any() or paused.any() or self.paused.any():
            flags = (self.release.copy(), paused)
        self.release[:] = False
        self.paused = paused
        live = [r for r, p in zip(owners, paused)
                if r is not None and not p and not r.is_prefilling]
        steps = decode_steps if decode_steps > 1 and self._steady(live, decode_steps) else 1
        kv_len, top_k = self.step_shape(live, kv_needed, logprobs_k, steps)
        return StepPlan(owners=[r if r in live else None for r in owners], live=live,
                        flags=flags, kv_len=kv_len, top_k=top_k, steps=steps,
                        rows=self.compact_rows(live) if compact else None)

    def compact_rows(self, live: list) -> Optional[np.ndarray]:
        """The slots a step runs when that is fewer than all (module docstring): the live
        ones and enough others, which select nothing, for the least of `compact_counts` that
        holds them; None when none does."""
        count = next((n for n in compact_counts(self.min_rows, self.max_slots)
                      if n >= len(live)), None)
        if count is None:
            return None
        mine = {r.slot for r in live}
        others = [s for s in range(self.max_slots) if s not in mine][:count - len(mine)]
        return np.array(sorted(mine.union(others)), np.int32)

    def _steady(self, live: list, steps: int) -> bool:
        """Nothing waits for the device, every live row has had its first step dispatched and
        each live stream has room for two calls of `steps` deltas (module docstring)."""
        with self.cond:
            if self.queue or self.prefilling:
                return False
        return all(r.dispatched > 0 and r.lifecycle.stream.unsent + 2 * steps
                   <= r.lifecycle.stream.max_buffered for r in live)

    def step_shape(self, live: list, kv_needed: Callable[[Request, int], int],
                   logprobs_k: int, steps: int = 1) -> tuple[int, int]:
        """The attention bucket covering every live row over `steps` steps and the top-k of
        logprobs (0 unless one of them asked)."""
        longest = max((kv_needed(r, steps) for r in live), default=1)
        top_k = logprobs_k if any(r.logprobs is not None for r in live) else 0
        return kv_bucket(longest, self.max_len), top_k
