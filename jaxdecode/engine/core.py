"""The engine thread: one loop that owns the device state.

    jobs -> sweep the queue -> beam lane -> admit into free slots -> plan -> flags
    -> dispatch step t+1 -> process step t's tokens -> ...

Step t + 1 is dispatched before step t's tokens are processed, so the host's work for step t
(detokenizing, stop matching, streaming) overlaps the device's step t + 1 (JAX async dispatch).
Each dispatched step carries which request owned each slot (the output processor's duplicate
guard). Every device call is a step op (step_ops.py), published to the step hook first so that
`serve --distributed` followers apply the same op.

Faults (contract §1, "one bad request never hurts another"): a failed device step starts
`recover`: every running request is a suspect, rebuilt in a fresh state from its prompt and the
tokens it already selected, and groups of suspects are retried, halving
(`faults.find_culprits`), so the request that fails alone ends FAILED (`model_error`) and the
others go on selecting what they would have selected. When even an empty step fails, or no
single request explains the failure, the device is at fault: the running requests fail. A
request met by MAX_FAULTS failed steps fails too. `health` is degraded from a failed step until
one succeeds or recovery's empty step shows the device works (an idle degraded engine re-checks
its device every second).
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
import time
from typing import Any, Callable, Optional

import jax
import numpy as np

from jaxdecode.device import constraints, decode, numerics
from jaxdecode.device.state import RowParams
from jaxdecode.engine import admission, beam_lane, faults, step_ops
from jaxdecode.engine.output import Dispatched, OutputProcessor
from jaxdecode.engine.pages import PagePool
from jaxdecode.engine.request import Request
from jaxdecode.engine.scheduler import Scheduler
from jaxdecode.types import ErrorCode, RequestState

logger = logging.getLogger(__name__)

MAX_FAULTS = 3  # failed steps a request may be running in before it fails


class EngineCore:
    """The thread, its loop, admission onto the device, dispatch and recovery."""

    def __init__(self, ctx: step_ops.Context, scheduler: Scheduler,
                 limits: admission.EngineLimits, *, logprobs_k: int,
                 step_hook: Optional[Any] = None, stateful_processors: bool = False,
                 decode_steps: int = 1):
        self.ctx, self.scheduler, self.step_hook = ctx, scheduler, step_hook
        self.decode_steps = decode_steps  # the most decode steps per call (scheduler.plan)
        self.backend = ctx.backend
        self.logprobs_k, self.stateful_processors = logprobs_k, stateful_processors
        self.output = OutputProcessor(scheduler, self.backend, on_step=self._stepped)
        self.beams = beam_lane.BeamLane(self.device, self.output, limits, ctx.eos_token_ids)
        self.state: Any = None
        self.bundle: Optional[constraints.TableBundle] = None  # grammar tables of live slots
        self.error: Optional[str] = None     # the last engine failure
        self.degraded: Optional[str] = None  # why, from a failed step to the next good one
        self._next_probe = 0.0               # when an idle degraded engine checks its device
        self._admitting: list = []           # the batch being placed (suspects of a failure)
        self._jobs: collections.deque = collections.deque()
        self._thread: Optional[threading.Thread] = None

    @classmethod
    def build(cls, ctx: step_ops.Context, kv: admission.KVLayout, max_queue: int,
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
        self.degraded = None  # a step succeeded

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
        s = self.scheduler
        with s.cond:
            idle = in_flight is None and s.idle() and not self._jobs
            if idle and (self.degraded is None or time.monotonic() < self._next_probe):
                s.cond.wait(0.5)
                return True
        if idle:
            self._check_device()
        return idle

    def _run(self) -> None:
        in_flight: Optional[Dispatched] = None
        while not self.scheduler.closed:
            if self._wait_if_idle(in_flight):
                continue
            try:
                self._run_jobs()
                self.output.sweep(self.scheduler.queued())
                self.scheduler.drop_ended()
                self._run_beams()
                self._admit()
                first = self._prefill()
                dispatched = self._dispatch()
                if in_flight is not None:
                    self.output.process(in_flight)
                for tokens in first:
                    self.output.process_first(tokens)
                in_flight = dispatched
                if in_flight is None:
                    self._wait_for_readers()
            except Exception as exc:  # a failed step: isolate the request behind it
                in_flight = None
                self.recover(exc)
        self._shutdown()

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

    def device(self, op: step_ops.StepOp) -> Any:
        """Every device call of the engine thread: published to the step hook, then applied
        (`step_ops.apply`, which followers on other hosts run with the same op)."""
        if self.step_hook is not None:
            self.step_hook.publish(op)
        self.state, out = step_ops.apply(self.ctx, self.state, op)
        return out

    # -- the beam lane ------------------------------------------------------------------------

    def _run_beams(self) -> None:
        """The beam lane (beam_lane.py): every queued beam request runs now."""
        beams = self.scheduler.take_beams()
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

    # -- admission and chunked prefill --------------------------------------------------------

    def _init_state(self) -> None:
        ctx = self.ctx
        self.device(step_ops.init(ctx.max_slots, ctx.max_len, ctx.eos_token_ids, ctx.num_pages,
                                  ctx.page_size))

    def _admit(self) -> None:
        """Queued requests into free slots with their pages (scheduler.admissions); their
        prompts are prefilled chunk by chunk (`_prefill`), a restored one is written back."""
        placed = self.scheduler.admissions()
        if not placed:
            return
        self._admitting = [r for r, _ in placed]  # suspects, should a call below fail
        if self.state is None:
            self._init_state()
        for r, slot in placed:
            if r.restored is not None:
                self._insert_restored(r, slot)
            else:  # a request requeued by `recover` is DECODING already
                r.lifecycle.try_transition(RequestState.PREFILLING)
                self.scheduler.place(r, slot, len(r.token_ids), prefilling=True)
        self._admitting = []

    def _prefill(self) -> list[Dispatched]:
        """This iteration's prefill chunks (scheduler.chunks), one CHUNK op per batch; after a
        prompt's last chunk its rows start decoding. Returns, per batch, the first tokens of
        those rows (selected by the op when the backend does so), which the loop streams once
        the step in flight is processed, each batch as soon as its own call ends, before the
        step that selects them again ends."""
        first = []
        for batch in self.scheduler.chunks():
            self._admitting = [c.request for c in batch]
            started, top_k, out = self._run_chunks(batch)
            if out is not None:
                first.append(Dispatched(out=out, owners=started, top_k=top_k))
        self._admitting = []
        return first

    def _run_chunks(self, batch: list, activate: bool = True) -> tuple[list, int, Any]:
        """Chunks of one program shape in one call; after a prompt's last chunk its request
        (and its sharers) decode -- their lifecycle moves on unless this is a probe of
        `recover` (`activate` False). Returns the requests that start decoding, in the order
        of their rows, the top log-probabilities of their first tokens, and the op's output
        (those first tokens, or None)."""
        tokens = np.zeros((len(batch), batch[0].t), np.int32)
        for i, c in enumerate(batch):
            tokens[i, :c.length] = self.scheduler.prefill_inputs(c.request)[
                c.start:c.start + c.length]
        finals = [(i, self._new_rows(c.request, c.request.prompt_ids + c.request.token_ids))
                  for i, c in enumerate(batch) if c.final]
        started = [x for i, _ in finals for x in [batch[i].request] + (batch[i].request.sharers
                                                                        or [])]
        top_k = self.logprobs_k if any(r.logprobs is not None for r in started) else 0
        out = self.device(step_ops.chunk(
            tokens, np.array([c.start for c in batch], np.int32),
            np.array([c.length for c in batch], np.int32),
            np.stack([self.scheduler.table(c.request) for c in batch]), batch[0].kv_len,
            finals, top_k))
        for c in batch:
            self.scheduler.register(c)
        for x in started:
            x.is_prefilling = False
            if activate and not x.lifecycle.try_transition(RequestState.DECODING):
                x.lifecycle.record("engine.resumed", selected=x.selected,
                                   processor_states_reset=self.stateful_processors)
        return started, top_k, out

    def _new_rows(self, r: Request, inputs: list) -> step_ops.NewRows:
        """The rows that start decoding after r's prompt: r and the samples sharing its prompt
        pages (each its own copy of the partial last page). A request that already selected
        tokens (requeued by `recover`) goes on at its own step: its penalty counts, RNG step
        and grammar state are those it had, so it selects what it would have selected."""
        group = [r] + (r.sharers or [])
        for x in group:  # a rebuilt row goes on after every token the host has
            x.ahead = None
        n, vocab, ps = len(inputs), self.ctx.model.config.vocab_size, self.ctx.page_size
        prompt = np.zeros((decode.bucket(n, self.ctx.max_len),), np.int32)
        prompt[:n] = inputs
        rows = RowParams.build([x.device_sampling for x in group], vocab,
                               self.ctx.eos_token_ids, keys=np.stack([x.key_data for x in group]))
        initial, states = self.grammar_tables(group), None
        if initial is not None:
            states = np.array([s + x.grammar.walk(x.token_ids) if x.grammar is not None else s
                               for s, x in zip(initial, group)], np.int32)
        resume = None
        if r.token_ids:  # step, counts, last token, prompt length (only r selected any)
            counts = np.zeros((1, vocab), np.int32)
            np.add.at(counts[0], r.token_ids, 1)
            resume = (np.array([len(r.token_ids)], np.int32), counts,
                      np.array([r.token_ids[-1]], np.int32),
                      np.array([len(r.prompt_ids)], np.int32))
        written = len(self.scheduler.prefill_inputs(r))  # positions the prefill wrote
        partial = [(r.pages[written // ps], x.pages[written // ps]) for x in group[1:]
                   if written % ps]
        copies = tuple(np.array(c, np.int32) for c in zip(*partial)) if partial else (
            np.zeros((0,), np.int32), np.zeros((0,), np.int32))
        return step_ops.NewRows(prompt, n, np.array([x.slot for x in group], np.int32),
                                np.stack([self.scheduler.table(x) for x in group]), rows,
                                states, resume, copies)

    def _insert_restored(self, r: Request, slot: int) -> None:
        a = r.restored
        r.lifecycle.transition(RequestState.PREFILLING)
        self.scheduler.place(r, slot, r.selected, prefilling=False)
        initial = self.grammar_tables([r])
        state = None
        if initial is not None:
            local = int(a["grammar_local"]) if "grammar_local" in a else 0
            state = initial[0] + local if r.grammar is not None else -1
        pages = r.pages[:-(-int(a["length"]) // self.ctx.page_size)]
        self.device(step_ops.restore(a, slot, np.asarray(pages, np.int32),
                                     self.scheduler.table(r), state))
        r.restored = None
        r.lifecycle.transition(RequestState.DECODING)

    def grammar_tables(self, batch: list) -> Optional[np.ndarray]:
        """Keep one table set for the constraints of the live slots plus `batch` (existing ones
        first, so offsets rarely move; else the live rows' states are rebased). Returns the
        initial grammar state of each request in `batch`, or None while nothing was ever
        constrained (then the step carries no tables and pays nothing)."""
        slots = self.scheduler.slots
        wanted = [r.grammar for r in dict.fromkeys([r for r in slots if r is not None] + batch)
                  if r.grammar is not None]
        if not wanted and self.bundle is None:
            return None
        bundle = constraints.build_tables(wanted, self.ctx.model.config.vocab_size)
        if bundle is not self.bundle or self.state.grammar_state is None:
            # rebased on the device (no host read of the state: it may span other hosts); a
            # slot still prefilling (its grammar new to the tables) gets its state at insert
            old = self.bundle.offsets if self.bundle is not None else {}
            keys = [r.grammar.key if r is not None and r.grammar is not None
                    and r.grammar.key in old else None for r in slots]
            delta = [bundle.offsets[k] - old[k] if k is not None else 0 for k in keys]
            self.device(step_ops.grammar(
                np.array([k is not None for k in keys]), np.array(delta, np.int32),
                bundle.tables if bundle is not self.bundle else None))
            self.bundle = bundle
        return np.array([bundle.initial_state(r.grammar) for r in batch], np.int32)

    # -- dispatch ---------------------------------------------------------------------------------

    def _dispatch(self) -> Optional[Dispatched]:
        plan = self.scheduler.plan(self.backend.kv_needed, self.logprobs_k, self.decode_steps,
                                   self.backend.compacts)
        if self.state is not None and plan.flags is not None:
            self.device(step_ops.flags(*plan.flags))
        if not plan.live:
            return None
        for r in plan.live:
            r.lifecycle.record("decode.started", step=r.dispatched + 1,
                               **({"steps": plan.steps} if plan.steps > 1 else {}))
            r.dispatched += plan.steps
            r.in_flight += 1
        out = self.device(step_ops.step(plan.kv_len, plan.top_k, plan.steps, plan.rows))
        return Dispatched(out=out, owners=plan.owners, top_k=plan.top_k)

    # -- faults -------------------------------------------------------------------------------

    def health(self, closed: bool) -> dict:
        """{"status": "ok" | "degraded" | "closed", "reason": ...}."""
        if closed:
            return {"status": "closed", "reason": "the engine is closed"}
        if self.degraded is not None:
            return {"status": "degraded", "reason": self.degraded}
        return {"status": "ok", "reason": None}

    def recover(self, exc: Exception) -> None:
        """A step failed and took the device state with it (the module docstring)."""
        reason = f"{type(exc).__name__}: {exc}"
        logger.error("engine step failed: %s", reason, exc_info=exc)
        self.error = self.degraded = reason
        suspects = [r for r in dict.fromkeys(self._admitting + self.scheduler.slots)
                    if r is not None and not r.lifecycle.is_terminal]
        self._admitting = []
        # the failing step is one of those in flight, beyond what the host has processed (each
        # call up to decode_steps steps; the probe runs single steps)
        probe = functools.partial(self._probe, steps=(1 + max(
            (r.in_flight for r in suspects), default=0)) * self.decode_steps)
        for r in suspects:
            r.faults += 1
            r.lifecycle.record("engine.fault", error=reason)
        try:
            self._reset_device()
            for r in (r for r in suspects if r.faults > MAX_FAULTS):
                self.output.fail(r, ErrorCode.MODEL_ERROR, f"{r.faults} engine steps failed "
                                 f"while this request ran; the last: {reason}")
            suspects = [r for r in suspects if not r.lifecycle.is_terminal]
            found, reason = self._culprits(suspects, probe, reason)
        except Exception as recovery_exc:  # never leave a suspect hanging
            logger.exception("engine recovery failed")
            found, reason = [], f"{reason}; recovery: {recovery_exc!r}"
        if found == []:  # the device, or no single request explains it
            self.degraded = reason
            for r in suspects:
                self.output.fail(r, ErrorCode.MODEL_ERROR, "the engine step failed and no "
                                 f"single request explains it: {reason}")
        self.scheduler.requeue_front([r for r in suspects if not r.lifecycle.is_terminal])

    def _culprits(self, suspects: list, probe: Callable, reason: str) -> tuple:
        """Fail the requests that fail alone; ([] , why) when the device fails empty."""
        try:
            self._probe([])
            self.degraded = None  # an empty step works: healthy before any culprit's answer
            found = faults.find_culprits(suspects, probe) if suspects else None
        except Exception as device_exc:  # the device fails with no request on it
            return [], f"{type(device_exc).__name__}: {device_exc}"
        for r, culprit_exc in found or ():
            self.output.fail(r, ErrorCode.MODEL_ERROR, "the model failed on this request's "
                             f"data (other requests go on): {type(culprit_exc).__name__}: "
                             f"{culprit_exc}")
        return found, reason

    def _probe(self, group: list, steps: int = 1) -> None:
        """Rebuild `group` in a fresh state and run `steps` steps, as the engine would (raises
        what they raise); the state is discarded either way."""
        try:
            self._init_state()
            for slot, r in enumerate(group):  # each alone, its whole prompt prefilled now
                if not self.scheduler.take_pages([r]):
                    raise RuntimeError("the rebuilt requests do not fit the KV pages")
                self.scheduler.place(r, slot, len(r.token_ids), prefilling=True)
            while self.scheduler.prefilling:
                for batch in self.scheduler.chunks():
                    self._run_chunks(batch, activate=False)
            for _ in range(steps):
                kv_len, top_k = self.scheduler.step_shape(group, self.backend.kv_needed,
                                                          self.logprobs_k)
                jax.block_until_ready(self.device(step_ops.step(kv_len, top_k)))
                for r in group:
                    r.dispatched, r.in_flight = r.dispatched + 1, r.in_flight + 1
        finally:
            for r in group:
                r.slot, r.pages, r.is_prefilling = None, [], False
            self._reset_device()

    def _check_device(self) -> None:
        """Idle and degraded: an empty step tells whether the device works again."""
        try:
            self._probe([])
            self.degraded = None
        except Exception as exc:
            self.degraded = f"{type(exc).__name__}: {exc}"
            self._next_probe = time.monotonic() + 1.0

    def _reset_device(self) -> None:
        """Drop the device state and every slot assignment (the requests stay as they are)."""
        self.device(step_ops.reset())
        self.bundle = None
        self.scheduler.reset()

    def _shutdown(self) -> None:
        s = self.scheduler
        with s.cond:
            victims = list(s.queue) + [r for r in s.slots if r is not None]
            s.queue.clear()
        for r in victims:
            r.lifecycle.request_cancel()
            self.output.end_cancelled(r)
