"""The compile budget: outlines-core builds each Index in a child process with a deadline and an
address-space limit (`CompileBudget`), so no constraint can hold a core or memory past it.

Why a process: outlines-core compiles in Rust without a way to stop it, and its time is not
bounded by the pattern's size (a JSON-schema string with `maxLength` 16 takes seconds on a 4k
vocabulary, 20 takes minutes) -- a Python thread cannot be killed, a process can. The cheap
pre-checks of `limits.py` refuse what is obviously too large before a worker is involved; the
worker enforces the rest:

- time: the caller waits at most `seconds` (waiting for a free worker included), then the worker
  is killed (SIGKILL) and the compile refused;
- memory: each worker runs under RLIMIT_AS = `memory_mb`; an allocation beyond it fails and the
  compile is refused (the worker is replaced);
- states: an automaton with more than `max_states` states is refused (`index_worker.index_tables`);
- cancel: `cancelled()` (polled every 50 ms) true kills the worker at once (the HTTP server passes
  "the client disconnected").

Workers (`index_worker.py`, started with `python -I`: numpy and outlines-core only, ~0.2 s) are
kept warm and reused, at most `MAX_WORKERS` at a time per memory limit (more compiles wait, on
their own deadline); each keeps the vocabularies it was sent. Every refusal is
`ValueError("response_format: ...")`; `worker_info()` counts started / killed workers by cause.
"""

from __future__ import annotations

import atexit
import dataclasses
import math
import select
import subprocess
import sys
import threading
import time
from typing import Callable, Optional

from jaxdecode.device.constraints import index_worker, limits
from jaxdecode.response_format import fail

MAX_WORKERS = 2   # concurrent compiles per memory limit (each uses a core)
_POLL_S = 0.05


@dataclasses.dataclass(frozen=True)
class CompileBudget:
    """What one constraint compile may use (`jd.LLM(max_constraint_compile_s=...,
    max_constraint_states=...)`, `jaxdecode serve --max-constraint-compile-s ...`)."""

    seconds: float = 30.0
    max_states: int = limits.MAX_STATES
    memory_mb: int = 4096

    def __post_init__(self):
        for name, value, option in (("seconds", self.seconds, "max_constraint_compile_s"),
                                    ("max_states", self.max_states, "max_constraint_states"),
                                    ("memory_mb", self.memory_mb, "memory_mb")):
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{option}: must be a positive number, got {value!r}")


class _Stop(Exception):
    """The caller stops waiting: `reason` is "timeout" or "cancelled"."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class _Worker:
    def __init__(self, memory_bytes: int):
        self.proc = subprocess.Popen(
            [sys.executable, "-I", index_worker.__file__, str(memory_bytes)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self.vocabs: set = set()  # vocabulary keys the child holds

    def call(self, message, deadline: float, cancelled: Optional[Callable[[], bool]]):
        """Send one message and wait for the answer (None when the child died)."""
        try:
            index_worker.write_message(self.proc.stdin, message)
        except (BrokenPipeError, OSError):
            return None
        out = self.proc.stdout
        while True:
            if cancelled is not None and cancelled():
                raise _Stop("cancelled")
            left = deadline - time.monotonic()
            if left <= 0:
                raise _Stop("timeout")
            if select.select([out], [], [], min(_POLL_S, left))[0]:
                return index_worker.read_message(out)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass


class WorkerPool:
    """Warm compile workers for one memory limit (module docstring)."""

    def __init__(self, memory_bytes: int, max_workers: int = MAX_WORKERS):
        self.memory_bytes, self.max_workers = memory_bytes, max_workers
        self._idle: list = []
        self._busy = 0
        self._cond = threading.Condition()
        self.counts = {"started": 0, "compiled": 0, "timeout": 0, "cancelled": 0, "memory": 0}

    def compile(self, regex: str, vocab, budget: CompileBudget,
                cancelled: Optional[Callable[[], bool]] = None) -> dict:
        """`index_worker.index_tables` of `regex` over `vocab` (a TokenVocab), within `budget`."""
        deadline = time.monotonic() + budget.seconds
        try:
            worker = self._acquire(deadline, cancelled)
        except _Stop as stop:
            self._refuse(stop.reason, budget)
        try:
            answer = None
            if vocab.hash not in worker.vocabs:
                answer = worker.call(("vocab", vocab.hash, vocab.size, vocab.mapping()),
                                     deadline, cancelled)
                if answer is not None and answer[0] == "ok":
                    worker.vocabs.add(vocab.hash)
            if vocab.hash in worker.vocabs:
                marked = index_worker.end_marked(regex, vocab.end_char)
                answer = worker.call(("compile", marked, vocab.hash, vocab.outlines_eos,
                                      vocab.outlines_end, budget.max_states), deadline,
                                     cancelled)
        except _Stop as stop:
            self._release(worker, healthy=False)
            self._refuse(stop.reason, budget)
        except BaseException:
            self._release(worker, healthy=False)
            raise
        died = answer is None or answer[1:] == ("memory",)
        self._release(worker, healthy=not died)
        if died:
            self._refuse("memory", budget)
        if answer[0] == "refused":
            fail(answer[1])
        if answer[0] != "ok":
            msg = answer[1]
            if "incompatible" in msg:
                fail(f"the pattern cannot be matched with this tokenizer's vocabulary ({msg})")
            fail(f"outlines-core cannot compile the pattern: {msg}")
        self._count("compiled")
        return answer[1]

    def _count(self, name: str) -> None:
        with self._cond:
            self.counts[name] += 1

    def _refuse(self, reason: str, budget: CompileBudget) -> None:
        self._count(reason)
        if reason == "timeout":
            fail(f"compiling the constraint took longer than {budget.seconds:g} s "
                 "(max_constraint_compile_s); simplify it")
        if reason == "memory":
            fail(f"compiling the constraint needed more than {budget.memory_mb} MiB; "
                 "simplify it")
        fail("compiling the constraint was abandoned: the client went away")

    def _acquire(self, deadline: float, cancelled) -> _Worker:
        """A warm or new worker (counted busy), waiting for one on the caller's deadline."""
        with self._cond:
            while not self._idle and self._busy >= self.max_workers:
                if cancelled is not None and cancelled():
                    raise _Stop("cancelled")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise _Stop("timeout")
                self._cond.wait(min(_POLL_S, left))
            self._busy += 1
            if self._idle:
                return self._idle.pop()
        try:
            worker = _Worker(self.memory_bytes)
        except BaseException:
            with self._cond:
                self._busy -= 1
                self._cond.notify_all()
            raise
        self._count("started")
        return worker

    def _release(self, worker: _Worker, healthy: bool) -> None:
        if not healthy:
            worker.kill()
        with self._cond:
            self._busy -= 1
            if healthy:
                self._idle.append(worker)
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.kill()


_POOLS: dict = {}
_POOLS_LOCK = threading.Lock()


def pool_for(budget: CompileBudget) -> WorkerPool:
    memory = int(budget.memory_mb) << 20
    with _POOLS_LOCK:
        if memory not in _POOLS:
            _POOLS[memory] = WorkerPool(memory)
        return _POOLS[memory]


def compile_in_worker(regex: str, vocab, budget: CompileBudget,
                      cancelled: Optional[Callable[[], bool]] = None) -> dict:
    return pool_for(budget).compile(regex, vocab, budget, cancelled)


def worker_info() -> dict:
    """Per memory limit (MiB): counters of started workers, compiles, and refusals by cause."""
    with _POOLS_LOCK:
        return {memory >> 20: dict(pool.counts, idle=len(pool._idle))
                for memory, pool in _POOLS.items()}


@atexit.register
def _close_all() -> None:
    with _POOLS_LOCK:
        pools = list(_POOLS.values())
    for pool in pools:
        pool.close()

