"""Fault recovery: finding the request behind a failure by retrying the work without it
(contract §1 "one bad request never hurts another"), and the slot lane's `Recovery`.

`find_culprits(items, attempt)` runs `attempt(items)`; when it raises, it halves the group and
tries each half, down to single items, so the items that fail alone are found with
O(k log n) attempts for k culprits among n. The engine uses it twice:

- slots (`Recovery.recover`, below; the rules in engine/core.py "Faults"): after a failed
  device step every running request is a suspect; an attempt (`Recovery.probe`) rebuilds the
  suspects in a fresh state (their prompts and the tokens they already selected) and runs the
  steps that were in flight;
- the beam lane (`BeamLane.run`): an attempt is the beam-search call itself, so halves that
  succeed deliver their results.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any, Callable, Optional, Sequence

import jax

from jaxdecode.engine import step_ops
from jaxdecode.types import ErrorCode

logger = logging.getLogger(__name__)


def find_culprits(items: Sequence, attempt: Callable[[list], object]) -> Optional[list]:
    """None when `attempt(items)` succeeds; else [(item, exception)] for every item whose
    attempt fails alone (empty when the group failed but every part of it succeeds: no single
    item explains the failure)."""
    try:
        attempt(list(items))
        return None
    except Exception as exc:
        if len(items) <= 1:
            return [(item, exc) for item in items]
    mid = len(items) // 2
    return [found for half in (items[:mid], items[mid:])
            for found in (find_culprits(half, attempt) or ())]


class Recovery:
    """The slot lane's recovery (engine/core.py "Faults"): `recover(exc)` after a failed step,
    `check_device()` while idle and degraded. `degraded`: why, from a failed step to the next
    good one (`core.health`)."""

    def __init__(self, core: Any, max_faults: int):
        self.core, self.max_faults = core, max_faults
        self.degraded: Optional[str] = None
        self.next_probe = 0.0  # when an idle degraded engine checks its device

    def recover(self, exc: Exception) -> None:
        """A step failed and took the device state with it (engine/core.py "Faults")."""
        core, s = self.core, self.core.scheduler
        reason = f"{type(exc).__name__}: {exc}"
        logger.error("engine step failed: %s", reason, exc_info=exc)
        core.error = self.degraded = reason
        suspects = [r for r in s.slots if r is not None and not r.lifecycle.is_terminal]
        # the failing step is one of those in flight, beyond what the host has processed (each
        # call up to decode_steps steps; the probe runs single steps)
        probe = functools.partial(self.probe, steps=(1 + max(
            (s.placements.in_flight(r) for r in suspects), default=0)) * core.decode_steps)
        for r in suspects:
            r.faults += 1
            r.lifecycle.record("engine.fault", error=reason)
        try:
            self.reset()
            for r in (r for r in suspects if r.faults > self.max_faults):
                core.output.fail(r, ErrorCode.MODEL_ERROR, f"{r.faults} engine steps failed "
                                 f"while this request ran; the last: {reason}")
            suspects = [r for r in suspects if not r.lifecycle.is_terminal]
            found, reason = self._culprits(suspects, probe, reason)
        except Exception as recovery_exc:  # never leave a suspect hanging
            logger.exception("engine recovery failed")
            found, reason = [], f"{reason}; recovery: {recovery_exc!r}"
        if found == []:  # the device, or no single request explains it
            self.degraded = reason
            for r in suspects:
                core.output.fail(r, ErrorCode.MODEL_ERROR, "the engine step failed and no "
                                 f"single request explains it: {reason}")
        s.requeue_front([r for r in suspects if not r.lifecycle.is_terminal])

    def _culprits(self, suspects: list, probe: Callable, reason: str) -> tuple:
        """Fail the requests that fail alone; ([] , why) when the device fails empty."""
        try:
            self.probe([])
            self.degraded = None  # an empty step works: healthy before any culprit's answer
            found = find_culprits(suspects, probe) if suspects else None
        except Exception as device_exc:  # the device fails with no request on it
            return [], f"{type(device_exc).__name__}: {device_exc}"
        for r, culprit_exc in found or ():
            self.core.output.fail(r, ErrorCode.MODEL_ERROR, "the model failed on this "
                                  "request's data (other requests go on): "
                                  f"{type(culprit_exc).__name__}: {culprit_exc}")
        return found, reason

    def probe(self, group: list, steps: int = 1) -> None:
        """Rebuild `group` in a fresh state and run `steps` steps, as the engine would (raises
        what they raise); the state is discarded either way."""
        core, s = self.core, self.core.scheduler
        try:
            core.runner.init()
            for slot, r in enumerate(group):  # each alone, its whole prompt prefilled now
                if not s.placements.take([r]):
                    raise RuntimeError("the rebuilt requests do not fit the KV pages")
                s.place(r, slot, len(r.token_ids), prefilling=True)
            while s.prefilling:
                for batch in s.chunks():
                    core.run_chunks(batch, activate=False)
            for _ in range(steps):
                kv_len, top_k = s.step_shape(group, core.backend.kv_needed, core.logprobs_k)
                jax.block_until_ready(core.runner.run(step_ops.step(kv_len, top_k)))
                for r in group:
                    placed = s.placements[r]
                    placed.dispatched, placed.in_flight = (placed.dispatched + 1,
                                                           placed.in_flight + 1)
        finally:
            self.reset()

    def check_device(self) -> None:
        """Idle and degraded: an empty step tells whether the device works again."""
        try:
            self.probe([])
            self.degraded = None
        except Exception as exc:
            self.degraded = f"{type(exc).__name__}: {exc}"
            self.next_probe = time.monotonic() + 1.0

    def reset(self) -> None:
        """Drop the device state and every placement (the requests stay as they are)."""
        self.core.runner.reset()
        self.core.scheduler.reset()
