"""Speculative decoding in the engine (contract §10): the `speculative=` option and its counters.

`jd.LLM(..., speculative={"draft": (draft_model, draft_params) | "prompt_lookup", "k": 4,
"ngram_max": 3, "ngram_min": 1, "num_branches": 1})` makes every engine step one
`speculative.spec_round` over all slots (the speculative backend, backend.py) -- the same
round as the body of `speculative_generate`'s while loop (one loop body, two drivers). The
n-gram bounds serve prompt lookup; num_branches > 1 verifies that many draft continuations per
row together, greedy requests only (a sampled request then raises ValueError naming
num_branches at submit). A bad value raises ValueError naming the field
(`speculative.draft`, `speculative.k`, ...). The draft must share the target's vocabulary and
hold at least `max_len` positions.

Each admitted request is prefilled alone at its own prompt bucket (batch invariance) -- the
target and the draft, their caches rolled back by one (the last prompt token is pending, the
round's convention), the prompt copied into the history -- and scattered into a free slot. A
paused row is not live in a round; nothing of it advances (contract B1). A row's keys are its
request's (`fold_in(request_key, t)` per output index t, contract X1), so a seeded request emits
exactly what `speculative_generate` emits for it, whatever its slot and neighbours. The output
processor feeds each emitted token through the usual per-token path in order, so stop strings,
detokenization, the duplicate guard, cancel and deadlines work unchanged; tokens after a
stop-string hit are dropped. Acceptance counters: engine totals (`LLM.speculative_stats()`),
per request in `Completion.timings["speculative"]`, and one `speculative.round` trace event per
round of a request (there, `decode.started`'s step counts the row's rounds, not its tokens).

Not supported together: `mesh` (sharded state), `save_request` / `restore_request`, custom
processors.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from jaxdecode.config import SamplingParams
from jaxdecode.device.speculative import (COUNTERS, PROMPT_LOOKUP, check_branches_greedy,
                                          check_draft, check_num_branches)
from jaxdecode.model_api import DecoderModel

__all__ = ["COUNTERS", "SpeculativeConfig"]


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """A validated `speculative=` option. draft None = prompt lookup; ngrams longest first."""

    draft: Optional[DecoderModel]
    draft_params: Any
    k: int
    ngrams: tuple
    num_branches: int = 1

    @classmethod
    def parse(cls, option: Any, target: DecoderModel, max_len: int) -> "SpeculativeConfig":
        if not isinstance(option, dict):
            raise ValueError(f"speculative: expected a dict with 'draft' and 'k', got "
                             f"{type(option).__name__}")
        unknown = sorted(set(option) - {"draft", "k", "ngram_max", "ngram_min", "num_branches"})
        if unknown:
            raise ValueError(f"speculative.{unknown[0]}: unknown option (expected draft, k, "
                             f"ngram_max, ngram_min, num_branches)")
        if "draft" not in option:
            raise ValueError("speculative.draft: required, (draft_model, draft_params) or "
                             f"{PROMPT_LOOKUP!r}")
        draft, draft_params = option["draft"], None
        if isinstance(draft, str):
            if draft != PROMPT_LOOKUP:
                raise ValueError(f"speculative.draft: (draft_model, draft_params) or "
                                 f"{PROMPT_LOOKUP!r}, got {draft!r}")
            draft = None
        elif (isinstance(draft, (tuple, list)) and len(draft) == 2
              and hasattr(draft[0], "forward") and hasattr(draft[0], "config")):
            draft, draft_params = draft
            check_draft(draft, target, "speculative.draft")
            if draft.config.max_len < max_len:
                raise ValueError(f"speculative.draft: its context {draft.config.max_len} is "
                                 f"shorter than max_len {max_len}")
        else:
            raise ValueError(f"speculative.draft: (draft_model, draft_params) or "
                             f"{PROMPT_LOOKUP!r}, got {type(draft).__name__}")
        values = {"k": option.get("k", 4), "ngram_max": option.get("ngram_max", 3),
                  "ngram_min": option.get("ngram_min", 1)}
        for name, value in values.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"speculative.{name}: must be an integer >= 1, got {value!r}")
        if values["ngram_min"] > values["ngram_max"]:
            raise ValueError(f"speculative.ngram_min: must be <= ngram_max, got "
                             f"{values['ngram_min']} > {values['ngram_max']}")
        if values["k"] + 2 > max_len:
            raise ValueError(f"speculative.k: {values['k']} leaves no room in max_len {max_len}")
        num_branches = option.get("num_branches", 1)
        check_num_branches(num_branches, target.config.vocab_size, "speculative.num_branches")
        return cls(draft, draft_params, values["k"],
                   tuple(range(values["ngram_max"], values["ngram_min"] - 1, -1)), num_branches)

    def check_request(self, sp: SamplingParams) -> None:
        """ValueError naming num_branches for a sampled request when num_branches > 1."""
        check_branches_greedy(self.num_branches, sp)
