"""The engine core: one thread, one loop, as vLLM V1's `EngineCore.step` -- schedule, run,
update from the output:

    jobs -> sweep the queue -> scheduler.schedule() -> Iteration
         -> beam lane -> run the iteration (lowering.py -> step ops -> runner.py):
            restored rows, prefill chunk batches, flags, dispatch step t+1
         -> process step t's tokens, then the first tokens of prompts prefilled meanwhile
            (output.py, which frees what ended) -> ...

Step t + 1 is dispatched before step t's tokens are processed, so the host's work for step t
(detokenizing, stop matching, streaming) overlaps the device's step t + 1 (JAX async dispatch).
Each dispatched step carries which request owned each slot (the output processor's duplicate
guard). Every device call is a step op (step_ops.py) that the runner publishes to the step hook
first, so that `serve --distributed` followers apply the same op.

Faults (contract §1, "one bad request never hurts another"; faults.py `Recovery`): a failed
device step starts recovery: every running request is a suspect, rebuilt in a fresh state from
its prompt and the tokens it already selected, and groups of suspects are retried, halving
(`faults.find_culprits`), so the request that fails alone ends FAILED (`model_error`) and the
others go on selecting what they would have selected. When even an empty step fails, or no
single request explains the failure, the device is at fault: the running requests fail. A
request met by MAX_FAULTS failed steps fails too. `health` is degraded from a failed step until
one succeeds or recovery's empty step shows the device works (an idle degraded engine re-checks
its device every second).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any, Callable, Optional

from jaxdecode.device import numerics
from jaxdecode.engine import admission, beam_lane, faults, lowering, runner
from jaxdecode.engine.config import KVLayout
from jaxdecode.engine.output import Dispatched, OutputProcessor
from jaxdecode.engine.pages import PagePool
from jaxdecode.engine.request import Request
from jaxdecode.engine.scheduler import Iteration, Scheduler, StepPlan
from jaxdecode.types import ErrorCode, RequestState

logger = logging.getLogger(__name__)

MAX_FAULTS = 3  # failed steps a request may be running in before it fails


class EngineCore:
    """The thread and its loop: schedule, run, update from the output (module docstring)."""

    def __init__(self, ctx: runner.Context, scheduler: Scheduler,
                 limits: admission.EngineLimits, *, logprobs_k: int,
                 step_hook: Optional[Any] = None, stateful_processors: bool = False,
                 decode_steps: int = 1):
        self.runner, self.scheduler = runner.Runner(ctx, step_hook), scheduler
        self.decode_steps = decode_steps  # the most decode steps per call (scheduler.plan)
        self.backend = ctx.backend
        self.logprobs_k, self.stateful_processors = logprobs_k, stateful_processors
        self.output = OutputProcessor(scheduler, self.backend, on_step=self._stepped)
        self.beams = beam_lane.BeamLane(self.runner.run, self.output, limits, ctx.eos_token_ids)
        self.faults = faults.Recovery(self, MAX_FAULTS)
        self.error: Optional[str] = None     # the last engine failure
        self._jobs: collections.deque = collections.deque()
        self._thread: Optional[threading.Thread] = None

    @classmethod
    def build(cls, ctx: runner.Context, kv: KVLayout, max_queue: int,
              limits: admission.EngineLimits, namespace: Callable[[], str], **options: Any
              ) -> tuple[Scheduler, "EngineCore"]:
        """The scheduler over this context's page pool and the engine core that runs it;
        `namespace()` keys the prefix cache (the model snapshot)."""
        spec = ctx.spec
        scheduler = Scheduler(ctx.max_slots, ctx.max_len, max_queue,
                              PagePool(kv.pages, kv.page_size, kv.prefix_cache), kv.chunk,
                              0 if spec is None else spec.k + 1, namespace,
                              prefill_last=spec is None, min_rows=numerics.min_rows(ctx.model))
        return scheduler, cls(ctx, scheduler, limits, **options)

    def _stepped(self) -> None:
        self.faults.degraded = None  # a step succeeded

    # -- the thread -----------------------------------------------------------------------------

    def ensure_thread(self) -> None:
        """Start the engine thread unless it runs or the engine is closed (under the queue's
        lock: two callers never start two threads, and `is_alive` is true once `start`
        returns)."""
        with self.scheduler.cond:
            if not self.scheduler.closed and (self._thread is None
                                              or not self._thread.is_alive()):
                self._thread = threading.Thread(target=self._run, name="jaxdecode-engine",
                                                daemon=True)
                self._thread.start()

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def _wait_if_idle(self, in_flight: Optional[Dispatched]) -> bool:
        """True when there is nothing to do now (waits a little, or checks a degraded
        device)."""
        s, f = self.scheduler, self.faults
        with s.cond:
            idle = in_flight is None and s.idle() and not self._jobs
            if idle and (f.degraded is None or time.monotonic() < f.next_probe):
                s.cond.wait(0.5)
                return True
        if idle:
            f.check_device()
        return idle

    def _run(self) -> None:
        in_flight: Optional[Dispatched] = None
        while not self.scheduler.closed:
            if self._wait_if_idle(in_flight):
                continue
            try:
                in_flight = self.step(in_flight)
            except Exception as exc:  # a failed step: isolate the request behind it
                in_flight = None
                self.faults.recover(exc)
        self._shutdown()

    def step(self, in_flight: Optional[Dispatched]) -> Optional[Dispatched]:
        """One iteration: schedule, run (dispatching the next step), then update from the
        outputs (the step in flight, then this iteration's first tokens). Returns the step
        now in flight."""
        self._run_jobs()
        self.output.sweep(self.scheduler.queued())
        it = self.scheduler.schedule(self.backend.kv_needed, self.logprobs_k,
                                     self.decode_steps, self.backend.compacts)
        self._run_beams(it.beams)
        first = self.execute(it)
        dispatched = self._dispatch(it.plan)
        if in_flight is not None:
            self.output.process(in_flight)
        for tokens in first:
            self.output.process_first(tokens)
        if dispatched is None:
            self._wait_for_readers()
        return dispatched

    def _wait_for_readers(self) -> None:
        """Nothing was dispatched: observe cancels and deadlines, and when every live row is
        paused wait a moment for its reader."""
        s = self.scheduler
        self.output.sweep(list(s.slots))
        with s.cond:
            if any(s.slots) and not s.queue and not s.closed:
                s.cond.wait(0.01)

    def _run_jobs(self) -> None:
        while self._jobs:
            fn, box, done = self._jobs.popleft()
            try:
                box.append((True, fn()))
            except Exception as exc:  # handed back to the caller
                box.append((False, exc))
            done.set()

    def on_thread(self, fn: Callable[[], Any], timeout: float = 60.0) -> Any:
        """Run `fn` on the engine thread at its next safe point (it owns the device state)."""
        box: list = []
        done = threading.Event()
        with self.scheduler.cond:
            self._jobs.append((fn, box, done))
            self.ensure_thread()
            self.scheduler.cond.notify_all()
        if not done.wait(timeout):
            raise TimeoutError("the engine did not reach a safe point in time")
        ok, value = box[0]
        if not ok:
            raise value
        return value

    # -- the beam lane ------------------------------------------------------------------------

    def _run_beams(self, beams: list) -> None:
        """The beam lane (beam_lane.py): the iteration's beam requests run now."""
        if not beams:
            return
        try:
            self.beams.run(beams)  # isolates the rows behind a failed call itself
        except Exception as exc:  # anything else: the taken requests never hang
            logger.exception("beam lane failed")
            for r in beams:
                self.output.fail(r, ErrorCode.MODEL_ERROR, f"{type(exc).__name__}: {exc}")
        if self.beams.error is not None:
            self.error, self.beams.error = self.beams.error, None

    # -- running an iteration -----------------------------------------------------------------

    def execute(self, it: Iteration) -> list[Dispatched]:
        """The iteration's placements and prefill chunks on the device: a restored request is
        written back, the others start prefilling, then one CHUNK op per batch. Returns, per
        batch, the first tokens of the rows that start decoding (when the backend selects
        them), which the loop streams once the step in flight is processed, each batch as soon
        as its own call ends, before the step that selects them again ends."""
        if it.placed and self.runner.state is None:
            self.runner.init()
        for r, _ in it.placed:
            if r.restored is not None:
                self._restore(r)
            else:  # a request requeued by recovery is DECODING already
                r.lifecycle.try_transition(RequestState.PREFILLING)
        first = []
        for batch in it.chunks:
            started, top_k, out = self.run_chunks(batch)
            if out is not None:
                first.append(Dispatched(out=out, owners=started, top_k=top_k))
        return first

    def run_chunks(self, batch: list, activate: bool = True) -> tuple[list, int, Any]:
        """Chunks of one program shape in one call; after a prompt's last chunk its request
        (and its sharers) decode -- their lifecycle moves on unless this is a probe of
        recovery (`activate` False). Returns the requests that start decoding, in the order
        of their rows, the top log-probabilities of their first tokens, and the op's output
        (those first tokens, or None)."""
        started = [x for c in batch for x in c.started]
        for x in started:  # a rebuilt row goes on after every token the host has
            x.ahead = None
        initial = (self.runner.grammar_tables(self.scheduler.slots, started) if started
                   else None)
        top_k = lowering.top_k(started, self.logprobs_k)
        out = self.runner.run(lowering.chunk(self.runner.ctx, self.scheduler, batch, initial,
                                             top_k))
        for c in batch:
            self.scheduler.placements.register(c.request, c.start, c.length)
        for x in started:
            if activate and not x.lifecycle.try_transition(RequestState.DECODING):
                x.lifecycle.record("engine.resumed", selected=x.selected,
                                   processor_states_reset=self.stateful_processors)
        return started, top_k, out

    def _restore(self, r: Request) -> None:
        r.lifecycle.transition(RequestState.PREFILLING)
        initial = self.runner.grammar_tables(self.scheduler.slots, [r])
        self.runner.run(lowering.restore(self.runner.ctx, self.scheduler, r, initial))
        r.restored = None
        r.lifecycle.transition(RequestState.DECODING)

    def _dispatch(self, plan: StepPlan) -> Optional[Dispatched]:
        """The plan's flags, then its step when rows are live (the step in flight)."""
        flags = lowering.flags(plan)
        if self.runner.state is not None and flags is not None:
            self.runner.run(flags)
        if not plan.live:
            return None
        for r in plan.live:
            placed = self.scheduler.placements[r]
            r.lifecycle.record("decode.started", step=placed.dispatched + 1,
                               **({"steps": plan.steps} if plan.steps > 1 else {}))
            placed.dispatched += plan.steps
            placed.in_flight += 1
        out = self.runner.run(lowering.step(plan))
        return Dispatched(out=out, owners=plan.owners, top_k=plan.top_k)

    # -- health and shutdown --------------------------------------------------------------------

    def health(self, closed: bool) -> dict:
        """{"status": "ok" | "degraded" | "closed", "reason": ...}."""
        if closed:
            return {"status": "closed", "reason": "the engine is closed"}
        if self.faults.degraded is not None:
            return {"status": "degraded", "reason": self.faults.degraded}
        return {"status": "ok", "reason": None}

    def _shutdown(self) -> None:
        s = self.scheduler
        with s.cond:
            victims = list(s.queue) + [r for r in s.slots if r is not None]
            s.queue.clear()
        for r in victims:
            r.lifecycle.request_cancel()
            self.output.end_cancelled(r)
