"""Finding the request behind a failure: retry the work without it (contract §1 "one bad request
never hurts another").

`find_culprits(items, attempt)` runs `attempt(items)`; when it raises, it halves the group and
tries each half, down to single items, so the items that fail alone are found with
O(k log n) attempts for k culprits among n. The engine uses it twice:

- slots (`EngineCore.recover`, engine/core.py): after a failed device step every running
  request is a suspect; an
  attempt rebuilds the suspects in a fresh state (their prompts and the tokens they already
  selected) and runs one step;
- the beam lane (`BeamLane.run`): an attempt is the beam-search call itself, so halves that
  succeed deliver their results.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence


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
