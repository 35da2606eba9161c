"""The scheduler: what runs next (no jax). It owns the admission queue, the slot table, the KV
page pool (pages.py) and one `Placement` per admitted request (placement.py: its slot, pages,
prefill progress, steps in flight; nothing of it lives on the `Request`), and turns them into one
decision per engine iteration, `schedule() -> Iteration`: the beam requests taken out of the
queue, which queued requests entered which free slots with which pages, the prompt chunks to
prefill (batched by program shape), and the decode step as a `StepPlan` (release / pause
flags, live rows, attention bucket, top-k of logprobs, decode steps, compacted rows). The
engine core (core.py) lowers the `Iteration` to step ops (lowering.py), runs them (runner.py)
and feeds the outputs to the output processor, which frees what ended (`free`); user threads
only enqueue and wake it.

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

from jaxdecode.engine.pages import PagePool
from jaxdecode.engine.placement import Placement, Placements
from jaxdecode.engine.request import Request
from jaxdecode.shapes import MIN_BUCKET, chunk_plan, kv_bucket, row_buckets


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
    attention bucket kv_len; `final`: the prompt's last chunk, after which `started` (the
    request and the samples sharing its pages, in row order) decode."""

    request: Request
    start: int
    t: int
    length: int
    kv_len: int
    final: bool
    started: tuple = ()


@dataclasses.dataclass(frozen=True)
class Iteration:
    """What one engine iteration runs (`Scheduler.schedule`), in order: the beam lane's
    requests; the requests placed into slots now (`placed`: (request, slot), a restored one
    written back, the others prefilled chunk by chunk); the prefill chunk batches, one device
    call each; the decode step (`plan`: flags first, then a step when rows are live)."""

    beams: list
    placed: list
    chunks: list
    plan: StepPlan


class Scheduler:
    """The queue, the slots and the pages (module docstring). `cond` guards the queue; the
    slot table, the pages and the masks belong to the engine thread."""

    def __init__(self, max_slots: int, max_len: int, max_queue: int, pool: PagePool,
                 prefill_chunk: int, extra_positions: int = 0,
                 namespace: Callable[[], str] = lambda: "", prefill_last: bool = True,
                 min_rows: int = 2):
        self.max_slots, self.max_len, self.max_queue = max_slots, max_len, max_queue
        self.pool, self.prefill_chunk = pool, prefill_chunk
        self.placements = Placements(pool, max_len, prefill_chunk, extra_positions,
                                     prefill_last, namespace)
        self.min_rows = min_rows                 # the fewest rows a step runs (no batch of 1)
        self.cond = threading.Condition()
        self.queue: collections.deque[Request] = collections.deque()
        self.slots: list[Optional[Request]] = [None] * max_slots
        self.prefilling: list[Request] = []      # admitted, prompt chunks pending
        self.release = np.zeros(max_slots, bool)
        self.paused = np.zeros(max_slots, bool)
        self.closed = False
        self.holding = False  # LLM.update_params: new submissions wait (engine/weights.py)

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
                if self.holding:  # weights are being swapped: queue behind the swap
                    self.cond.wait(0.05)
                    continue
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

    def schedule(self, kv_needed: Callable[[Request, Placement, int], int], logprobs_k: int,
                 decode_steps: int = 1, compact: bool = False) -> Iteration:
        """This iteration (module docstring): ended queued requests forgotten, the beam
        requests taken, queued requests placed (`admissions`: a restored one counts its
        tokens as dispatched and decodes now, the others prefill), this iteration's chunks
        (`chunks`) and the decode step (`plan`, which counts the rows whose last chunk runs
        now as live)."""
        self.drop_ended()
        beams = self.take_beams()
        placed = self.admissions()
        for r, slot in placed:
            if r.restored is not None:
                self.place(r, slot, r.selected, prefilling=False)
            else:  # a request requeued by core recovery goes on after its tokens
                self.place(r, slot, len(r.token_ids), prefilling=True)
        batches = self.chunks()
        return Iteration(beams, placed, batches,
                         self.plan(kv_needed, logprobs_k, decode_steps, compact))

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
                if not self.placements.take(group):
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
        p = self.placements[r]
        p.slot, p.dispatched, p.in_flight, p.prefilling = slot, dispatched, 0, prefilling
        self.slots[slot] = r
        if prefilling and p.sharers is not None:
            self.prefilling.append(r)

    def chunks(self) -> list[list[Chunk]]:
        """This iteration's prefill chunks: at most `prefill_chunk` tokens (at least one
        chunk), one chunk per request, the oldest admitted request first; batched by program
        shape (T, attention bucket), each batch one device call (so the chunks of one iteration
        never depend on each other), the shortest chunks first (their prompts' first tokens
        stream as soon as their own call ends: core.py). After a prompt's last chunk its
        request and the samples sharing its pages decode (`Chunk.started`): from this
        iteration's step on, since its chunk runs before."""
        out, budget = [], self.prefill_chunk
        for r in list(self.prefilling):
            p = self.placements[r]
            inputs = len(self.placements.prefill_inputs(r))
            start, t, length, kv = (chunk_plan(inputs, p.prefilled, self.prefill_chunk,
                                               self.max_len)
                                    or [(0, MIN_BUCKET, 0, kv_bucket(MIN_BUCKET, self.max_len))]
                                    )[0]  # (nothing to write: a chunk for the logits)
            if out and t > budget:
                break
            final = start + length == inputs
            started = tuple([r] + (p.sharers or [])) if final else ()
            out.append(Chunk(r, start, t, length, kv, final, started))
            budget -= t
            p.prefilled = start + length
            if final:
                self.prefilling.remove(r)
                for x in started:
                    self.placements[x].prefilling = False
        batches: dict = {}
        for c in out:
            batches.setdefault((c.t, c.kv_len), []).append(c)
        return [batches[shape] for shape in sorted(batches)]

    def free(self, r: Request) -> None:
        """Release `r`'s slot and pages (the device row is marked done before the next
        step). A request that ends while it prefills for samples sharing its pages sends them
        back to the head of the queue (they prefill on their own); a sample that ends leaves
        its prompt's group."""
        p = self.placements.release(r)
        if p is None:
            return
        if p.slot is not None and self.slots[p.slot] is r:
            self.slots[p.slot] = None
            self.release[p.slot] = True
        if r in self.prefilling:
            self.prefilling.remove(r)
        lead = self.placements.get(r.share_with)
        if lead is not None and lead.sharers and r in lead.sharers:
            lead.sharers.remove(r)
        if p.prefilling and p.sharers:
            for x in p.sharers:
                self.slots[self.placements.release(x).slot] = None
                x.share_with = None  # it prefills on its own
            self.requeue_front(p.sharers)

    def reset(self) -> None:
        """Forget every slot assignment and page (the device state was dropped)."""
        self.slots = [None] * self.max_slots
        self.prefilling = []
        self.placements.reset()
        self.release[:] = False
        self.paused[:] = False

    def plan(self, kv_needed: Callable[[Request, Placement, int], int], logprobs_k: int,
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
                if r is not None and not p and not self.placements[r].prefilling]
        steps = decode_steps if decode_steps > 1 and self._steady(live, decode_steps) else 1
        kv_len, top_k = self.step_shape(live, kv_needed, logprobs_k, steps)
        return StepPlan(owners=[r if r in live else None for r in owners], live=live,
                        flags=flags, kv_len=kv_len, top_k=top_k, steps=steps,
                        rows=self.compact_rows([self.placements[r].slot for r in live])
                        if compact else None)

    def compact_rows(self, live: list) -> Optional[np.ndarray]:
        """The slots a step runs when that is fewer than all (module docstring): the `live`
        slots and enough others, which select nothing, for the least of `compact_counts` that
        holds them; None when none does."""
        count = next((n for n in compact_counts(self.min_rows, self.max_slots)
                      if n >= len(live)), None)
        if count is None:
            return None
        mine = set(live)
        others = [s for s in range(self.max_slots) if s not in mine][:count - len(mine)]
        return np.array(sorted(mine.union(others)), np.int32)

    def _steady(self, live: list, steps: int) -> bool:
        """Nothing waits for the device, every live row has had its first step dispatched and
        each live stream has room for two calls of `steps` deltas (module docstring)."""
        with self.cond:
            if self.queue or self.prefilling:
                return False
        return all(self.placements[r].dispatched > 0 and r.lifecycle.stream.unsent + 2 * steps
                   <= r.lifecycle.stream.max_buffered for r in live)

    def step_shape(self, live: list, kv_needed: Callable[[Request, Placement, int], int],
                   logprobs_k: int, steps: int = 1) -> tuple[int, int]:
        """The attention bucket covering every live row over `steps` steps and the top-k of
        logprobs (0 unless one of them asked)."""
        longest = max((kv_needed(r, self.placements[r], steps) for r in live), default=1)
        top_k = logprobs_k if any(r.logprobs is not None for r in live) else 0
        return kv_bucket(longest, self.max_len), top_k
