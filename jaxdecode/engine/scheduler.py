"""The scheduler: what runs next (no jax). It owns the admission queue and the slot table and
turns them into decisions -- which queued requests enter which free slots, which rows are
released or paused, and the next step as a `StepPlan` (live rows, attention bucket, top-k of
logprobs). The engine thread (core.py) carries the decisions out through the backend and the
output processor; user threads only enqueue and wake it.

Attention bucket: a step attends to the first `kv_len` cache positions, a power of two >=
`KV_BUCKET_MIN` covering every live row (the backend bounds a row's need): few compiled
variants, and short requests never pay for a long `max_len`.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import Callable, Iterable, Optional

import numpy as np

from jaxdecode.engine.request import Request

KV_BUCKET_MIN = 256


class QueueFull(RuntimeError):
    """The admission queue is at `max_queue`; retry later (HTTP 429)."""


class EngineClosed(RuntimeError):
    """The engine was closed; it accepts no more requests."""


def kv_bucket(longest: int, max_len: int) -> int:
    """The attention bucket covering `longest` positions (module docstring)."""
    size = max(KV_BUCKET_MIN, 1 << max(0, int(longest) - 1).bit_length())
    return min(size, max_len)


@dataclasses.dataclass
class StepPlan:
    """The next step: the owner of each slot when it is dispatched (None: empty or not live),
    the live requests, the release / pause masks to apply first (None: unchanged), the attention
    bucket and the top-k of logprobs (0 or the engine's `logprobs_k`)."""

    owners: list
    live: list
    flags: Optional[tuple[np.ndarray, np.ndarray]]
    kv_len: int
    top_k: int


class Scheduler:
    """The queue and the slots (module docstring). `cond` guards the queue; the slot table and
    masks belong to the engine thread."""

    def __init__(self, max_slots: int, max_len: int, max_queue: int):
        self.max_slots, self.max_len, self.max_queue = max_slots, max_len, max_queue
        self.cond = threading.Condition()
        self.queue: collections.deque[Request] = collections.deque()
        self.slots: list[Optional[Request]] = [None] * max_slots
        self.release = np.zeros(max_slots, bool)
        self.paused = np.zeros(max_slots, bool)
        self.closed = False

    # -- the queue (any thread) ---------------------------------------------------------------

    def enqueue(self, requests: list, block: bool, on_queued: Callable[[Request], None]) -> None:
        """Queue requests together, in order (`on_queued` marks each); `QueueFull` when there
        is no room (unless `block`), `EngineClosed` once closed."""
        with self.cond:
            pending = list(requests)
            while pending:
                if self.closed:
                    raise EngineClosed("the engine is closed")
                room = self.max_queue - len(self.queue)
                if room <= 0:
                    if not block:
                        raise QueueFull(f"admission queue is full ({self.max_queue} requests)")
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

    def admissions(self) -> list[tuple[Request, int]]:
        """Queued requests for the free slots, in queue order: (request, slot) pairs."""
        free = [slot for slot, r in enumerate(self.slots) if r is None]
        with self.cond:
            batch = [self.queue.popleft() for _ in range(min(len(free), len(self.queue)))]
            self.cond.notify_all()
        return list(zip(batch, free))

    def place(self, r: Request, slot: int, dispatched: int) -> None:
        """`r` now owns `slot`, `dispatched` steps counted (its tokens so far)."""
        self.release[slot] = False
        r.slot, r.dispatched, r.in_flight = slot, dispatched, 0
        self.slots[slot] = r

    def free(self, r: Request) -> None:
        """Release `r`'s slot (the device row is marked done before the next step)."""
        slot = r.slot
        if slot is not None and self.slots[slot] is r:
            self.slots[slot] = None
            self.release[slot] = True

    def reset(self) -> None:
        """Forget every slot assignment (the device state was dropped)."""
        self.slots = [None] * self.max_slots
        self.release[:] = False
        self.paused[:] = False

    def expired(self, requests: Iterable[Request], now: Optional[float] = None) -> list:
        """The requests among these whose deadline has passed."""
        now = time.monotonic() if now is None else now
        return [r for r in requests if r.deadline is not None and now >= r.deadline]

    def plan(self, kv_needed: Callable[[Request], int], logprobs_k: int) -> StepPlan:
        """The next step over the slots: rows paused by their user or by back-pressure skip it
        (their state untouched, SPEC B1); pause changes are recorded in the trace."""
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
        live = [r for r, p in zip(owners, paused) if r is not None and not p]
        kv_len, top_k = self.step_shape(live, kv_needed, logprobs_k)
        return StepPlan(owners=[r if r in live else None for r in owners], live=live,
                        flags=flags, kv_len=kv_len, top_k=top_k)

    def step_shape(self, live: list, kv_needed: Callable[[Request], int],
                   logprobs_k: int) -> tuple[int, int]:
        """The attention bucket covering every live row and the top-k of logprobs (0 unless
        one of them asked)."""
        longest = max((kv_needed(r) for r in live), default=1)
        top_k = logprobs_k if any(r.logprobs is not None for r in live) else 0
        return kv_bucket(longest, self.max_len), top_k
