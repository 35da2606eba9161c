"""The host result of an on-device generation (`GenerateOutput`) and its one builder.

`jd.generate`, `jd.speculative_generate` and `jd.beam_search` all end here: device buffers of
selected tokens and their raw log-probabilities, each row's final finish code and step, become
`token_ids` padded with -1 after each row's end, `lengths`, finish reasons and errors.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import numpy as np

from jaxdecode.device.stops import ERRORS, FAILED_CODES, FINISH_REASONS


@dataclasses.dataclass(frozen=True)
class GenerateOutput:
    """Host results of `generate` (docs/architecture.md).

    token_ids int32[B, N]: every selected token of each row, including the EOS / stop id that
    ended it (as HF `generate` does), padded with -1 after the row's end; lengths int32[B];
    finish_reasons: one FinishReason per row; errors: None per row, or the ErrorCode of a row that
    failed (`model_error` for NaN logits, `all_tokens_masked` -- contract P2 -- when every token was
    masked, `grammar_dead_end` when that happens on a constrained row; its finish reason is then
    `model_error`; a constrained row whose grammar accepts and allows nothing more ends with
    `grammar_complete`); logprobs f32[B, N]: the raw model log-probability of each selected token
    (before processors, as OpenAI and vLLM report), when asked; top_logprobs: (ids, logprobs)
    int32/f32[B, N, K] when some row asked for K > 0.
    Research options (jaxdecode/device/research.py): scores / logits f32[B, N, V] (with
    outputs_top_k K: [B, N, K] and score_ids / logit_ids), hidden_states {layer: f32[B, N,
    hidden]}, observations (one stacked pytree per observer), processor_states (each custom
    processor's final state, None when stateless) and processor_order (the stages in the order
    used).
    """

    token_ids: np.ndarray
    lengths: np.ndarray
    finish_reasons: list
    errors: list
    logprobs: Optional[np.ndarray] = None
    top_logprobs: Optional[tuple[np.ndarray, np.ndarray]] = None
    beams: Optional[list] = None
    # research options (jaxdecode/device/research.py): set only when asked
    scores: Optional[np.ndarray] = None
    logits: Optional[np.ndarray] = None
    score_ids: Optional[np.ndarray] = None
    logit_ids: Optional[np.ndarray] = None
    hidden_states: Optional[dict] = None
    observations: Optional[list] = None
    processor_states: Optional[tuple] = None
    processor_order: Optional[tuple] = None

    def tokens(self, row: int) -> list[int]:
        return self.token_ids[row, : self.lengths[row]].tolist()


def fit(x: np.ndarray, width: int) -> np.ndarray:
    """x [B, M, ...] cut or zero-padded to [B, width, ...] (a copy)."""
    if x.shape[1] >= width:
        return x[:, :width].copy()
    pad = [(0, 0), (0, width - x.shape[1])] + [(0, 0)] * (x.ndim - 2)
    return np.pad(x, pad)


def build(tokens: np.ndarray, logprobs: np.ndarray, finish: np.ndarray, step: np.ndarray,
          width: int, top_logprobs: Optional[tuple[np.ndarray, np.ndarray]] = None,
          cls: type = GenerateOutput, **extra: Any) -> Any:
    """`cls` (GenerateOutput or a subclass) from host arrays of B rows: tokens / logprobs
    [B, M] (output index j at column j), finish and step [B] (the device's final finish code
    and selected-token count). A failed row's last step chose nothing, so its length is
    step - 1. Columns past a row's length become -1 / 0; everything is `width` wide."""
    failed = np.isin(finish, FAILED_CODES)
    lengths = np.where(failed, step - 1, step).astype(np.int32)
    tokens, logprobs = fit(tokens, width), fit(logprobs, width)
    after_end = np.arange(width)[None, :] >= lengths[:, None]
    tokens[after_end], logprobs[after_end] = -1, 0.0
    top = None if top_logprobs is None else tuple(fit(x, width) for x in top_logprobs)
    return cls(token_ids=tokens.astype(np.int32), lengths=lengths,
               finish_reasons=[FINISH_REASONS[int(c)] for c in finish],
               errors=[ERRORS.get(int(c)) for c in finish], logprobs=logprobs,
               top_logprobs=top, **extra)
