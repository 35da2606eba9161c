"""Device stop decisions (contract §5, S9, P2): one finish-code function over `[B, K]` tokens.

A plain decode step decides one token per row (K = 1); a speculative round decides its k + 1
candidate positions at once. Both call `finish_codes`, so the priority below exists once:

    model error (NaN logits) > grammar dead end (everything masked on a constrained row)
    > all tokens masked > EOS > stop id > grammar dead end (no edge) > grammar completion
    > max_tokens > context limit

The codes are `state.RUNNING` (the row goes on) or one of the device finish codes, mapped to
`FinishReason` / `ErrorCode` on the host by `FINISH_REASONS` and `ERRORS`.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from jaxdecode.device import constraints
from jaxdecode.device.state import (ALL_MASKED, CONTEXT_LIMIT, EOS, GRAMMAR_COMPLETE,
                                    GRAMMAR_DEAD_END, MAX_TOKENS, MODEL_ERROR, RUNNING,
                                    STOP_TOKEN, RowParams)
from jaxdecode.types import ErrorCode, FinishReason

Array = jax.Array

FINISH_REASONS = {EOS: FinishReason.EOS, STOP_TOKEN: FinishReason.STOP_SEQUENCE,
                  MAX_TOKENS: FinishReason.MAX_OUTPUT_TOKENS,
                  CONTEXT_LIMIT: FinishReason.CONTEXT_LIMIT,
                  ALL_MASKED: FinishReason.MODEL_ERROR, MODEL_ERROR: FinishReason.MODEL_ERROR,
                  GRAMMAR_COMPLETE: FinishReason.GRAMMAR_COMPLETE,
                  GRAMMAR_DEAD_END: FinishReason.MODEL_ERROR}
ERRORS = {ALL_MASKED: ErrorCode.ALL_TOKENS_MASKED, MODEL_ERROR: ErrorCode.MODEL_ERROR,
          GRAMMAR_DEAD_END: ErrorCode.GRAMMAR_DEAD_END}
FAILED_CODES = (ALL_MASKED, MODEL_ERROR, GRAMMAR_DEAD_END)


def finish_codes(rows: RowParams, tokens: Array, *, nan: Array, logprobs: Array, step: Array,
                 length: Array, max_len: int,
                 grammar: Optional[tuple[constraints.GrammarTables, Array, Array]] = None
                 ) -> Array:
    """int32[B, K]: the finish code of each candidate token, RUNNING where the row would go on.

    tokens int32[B, K] (position i is the i-th token chosen from here); nan bool[B, K] (the
    logits it was chosen from hold a NaN); logprobs f32[B, K, V] the processed distribution it
    was chosen from; step int32[B] tokens selected before position 0 (position i is output
    token step + i + 1); length int32[B] the sequence length before position 0 (position i is
    written at length + i); `grammar` = (tables, state before, state after) int32[B, K] each,
    for a batch with constrained rows."""
    i = jnp.arange(tokens.shape[1])[None, :]
    rowwise = lambda mask: jnp.take_along_axis(mask, tokens, axis=1)  # noqa: E731
    all_masked = jnp.all(jnp.isneginf(logprobs), axis=-1)
    dead_masked, dead_edge, complete = [], [], []
    if grammar is not None:
        tables, before, after = grammar
        bound = before >= 0
        dead_masked = [(GRAMMAR_DEAD_END, bound & all_masked)]
        # a token without an edge can only be EOS (ended above) or a failed step's
        dead_edge = [(GRAMMAR_DEAD_END, bound & (after == constraints.DEAD))]
        complete = [(GRAMMAR_COMPLETE, constraints.completes(
            tables, after.reshape(-1)).reshape(after.shape))]
    conditions = [(MODEL_ERROR, nan), *dead_masked, (ALL_MASKED, all_masked),
                  (EOS, rowwise(rows.eos_mask)), (STOP_TOKEN, rowwise(rows.stop_mask)),
                  *dead_edge, *complete,
                  (MAX_TOKENS, step[:, None] + i + 1 >= rows.max_tokens[:, None]),
                  (CONTEXT_LIMIT, length[:, None] + i >= max_len - 1)]
    code = jnp.full(tokens.shape, RUNNING, jnp.int32)
    for value, cond in reversed(conditions):
        code = jnp.where(cond, value, code)
    return code
