"""Placements: where each admitted request sits -- the scheduler's own record of it
(scheduler.py; no jax), kept off the `Request`: its KV pages in the page pool (pages.py), their
prefix-cache keys, its slot, its prefill progress, the samples sharing its prompt pages, the
steps dispatched and in flight.

Pages: a request holds the pages of its prompt and of `max_tokens` outputs (reserved up front,
scheduler.py "Admission"); a prompt prefix found in the prefix cache is mapped, not recomputed;
the samples of one prompt admitted together share its full prompt pages.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import numpy as np

from jaxdecode.engine.pages import NULL_PAGE, PagePool, page_keys
from jaxdecode.engine.request import Request
from jaxdecode.shapes import chunk_length


@dataclasses.dataclass
class Placement:
    """Where an admitted request sits (the scheduler's own record, module docstring): the
    physical page of each of its logical pages and their prefix-cache keys, its slot, the
    input tokens prefilled so far and whether prompt chunks are pending, the samples sharing
    its prompt pages (a list on a prompt's first sample, None on a sample that shares them),
    the steps dispatched while placed (may lead `selected`) and its calls not yet processed."""

    pages: list
    page_keys: list = dataclasses.field(default_factory=list)
    slot: Optional[int] = None
    prefilled: int = 0
    prefilling: bool = False
    sharers: Optional[list] = None
    dispatched: int = 0
    in_flight: int = 0


class Placements:
    """The placements of the admitted requests over one page pool (module docstring); the
    engine thread changes them, any thread may read one (`get`, `slot_of`: one dict read)."""

    def __init__(self, pool: PagePool, max_len: int, prefill_chunk: int,
                 extra_positions: int = 0, prefill_last: bool = True,
                 namespace: Callable[[], str] = lambda: ""):
        self.pool, self.max_len, self.prefill_chunk = pool, max_len, prefill_chunk
        self.extra_positions = extra_positions  # speculative rounds write k + 1 ahead
        # a speculative round writes the prompt's last token itself (it is pending): its
        # prefill stops one short, so no cached page ever holds a position a round rewrites
        self.prefill_last = prefill_last
        self.namespace = namespace               # the model snapshot (prefix cache keys)
        self.records: dict = {}                  # Request -> Placement

    @property
    def page_size(self) -> int:
        return self.pool.page_size

    @property
    def pages_per_row(self) -> int:
        return -(-self.max_len // self.page_size)

    def __getitem__(self, r: Request) -> Placement:
        return self.records[r]

    def get(self, r: Optional[Request]) -> Optional[Placement]:
        return self.records.get(r)

    def slot_of(self, r: Request) -> Optional[int]:
        """r's slot, None unless it is placed."""
        p = self.records.get(r)
        return None if p is None else p.slot

    def in_flight(self, r: Request) -> int:
        """r's dispatched calls not yet processed (0 unless placed)."""
        p = self.records.get(r)
        return 0 if p is None else p.in_flight

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

    def _cached(self, r: Request) -> tuple[list[int], list[bytes]]:
        """The pages of the longest cached prefix of r's inputs that ends on a chunk boundary
        before its last chunk (that one must run: it gives the logits), and the prefix-cache
        keys of r's pages."""
        inputs = self.prefill_inputs(r)
        per_chunk = self.prefill_chunk // self.page_size
        keys = page_keys(inputs, self.page_size, self.prefill_chunk,
                         chunk_length(len(inputs), self.prefill_chunk),
                         self.namespace() + r.adapter_tag)  # its adapter's pages (R7)
        usable = max(0, len(inputs) - 1) // self.prefill_chunk * per_chunk
        hits = self.pool.lookup(keys, usable)
        return hits[:len(hits) // per_chunk * per_chunk], keys

    def take(self, group: list) -> bool:
        """Pages for a request and the samples sharing its prompt (their placements), or
        False (nothing taken)."""
        lead = group[0]
        hits, keys = ([], []) if lead.restored is not None else self._cached(lead)
        shared = self._shared_pages(lead)
        need = self.reserved_pages(lead) - len(hits) + sum(
            self.reserved_pages(r) - shared for r in group[1:])
        if need > self.pool.available() - sum(1 for p in hits if self.pool.refs[p] == 0):
            return False
        self.pool.retain(hits)
        first = Placement(hits + self.pool.allocate(self.reserved_pages(lead) - len(hits)), keys,
                          prefilled=len(hits) * self.page_size, sharers=group[1:])
        self.records[lead] = first
        lead.cached_tokens = first.prefilled
        self.pool.queries += len(lead.prompt_ids)
        self.pool.hits += min(lead.cached_tokens, len(lead.prompt_ids))
        for r in group[1:]:
            self.pool.retain(first.pages[:shared])
            self.records[r] = Placement(first.pages[:shared] + self.pool.allocate(
                self.reserved_pages(r) - shared))
            r.cached_tokens = 0
        return True

    def table(self, r: Request) -> np.ndarray:
        """int32[pages_per_row]: r's pages, then the null page."""
        out = np.full((self.pages_per_row,), NULL_PAGE, np.int32)
        pages = self.records[r].pages
        out[:len(pages)] = pages
        return out

    def register(self, r: Request, start: int, length: int) -> None:
        """After a chunk of r ran (positions [start, start + length)): cache its full pages
        (prefix cache)."""
        p = self.records[r]
        first, end = start // self.page_size, (start + length) // self.page_size
        self.pool.register(p.pages[first:end], p.page_keys[first:end])

    def release(self, r: Request) -> Optional[Placement]:
        """Forget r's placement and release its pages; the placement (None: not placed)."""
        p = self.records.pop(r, None)
        if p is not None:
            self.pool.release(p.pages)
        return p

    def reset(self) -> None:
        """Forget every placement and page (the device state was dropped)."""
        self.records = {}
        self.pool.reset()
