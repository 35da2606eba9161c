"""Logit processing in the versioned order of contract §3 (`processor_order="v1"`).

1. repetition (HF: divide positive / multiply negative logits of ids seen in prompt or output),
   frequency and presence (OpenAI: subtract count * f + [count > 0] * p over output ids),
   then logit_bias
2. banned ids (carried as -inf in the bias), the min_tokens mask of EOS / stop ids, and the
   grammar mask of constrained rows (jaxdecode/device/constraints; skipped when no row is
   constrained)
3. temperature (0 selects the greedy branch; the division uses 1 there, never 0)
4. top-k, then top-p, then min-p (HF semantics: ties at the k-th value are kept; top-p keeps the
   smallest set whose mass reaches p; min-p drops tokens below min_p * the top probability)
5. renormalisation (log-softmax)

Every processor is vectorised over rows with that row's own parameters (contract P3), and its sums
use `numerics` (a row's result never depends on the other rows: docs/batch_invariance.md).
Selection (step 6) lives in `sampling.py`. User-defined processors
(jaxdecode/device/research.py) run
at four named points of this order: "first" (before 1), "after_penalties" (after 2),
"after_temperature" (after 3) and "last" (after 4, before 5).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxdecode.device import numerics
from jaxdecode.config import SamplingParams
from jaxdecode.device.constraints import tables as constraint_tables
from jaxdecode.device.state import RowParams

PROCESSOR_ORDER = "v1"
Array = jax.Array


def apply_penalties(logits: Array, rows: RowParams, counts: Array, seen: Array) -> Array:
    rep = rows.repetition_penalty[:, None]
    penalised = jnp.where(logits < 0, logits * rep, logits / rep)
    logits = jnp.where(seen, penalised, logits)
    counts = counts.astype(logits.dtype)
    logits = logits - counts * rows.frequency_penalty[:, None]
    logits = logits - (counts > 0) * rows.presence_penalty[:, None]
    return logits + rows.bias


def apply_masks(logits: Array, rows: RowParams, step: Array) -> Array:
    """min_tokens: EOS and single stop ids are unavailable while fewer were selected."""
    early = (step < rows.min_tokens)[:, None] & (rows.eos_mask | rows.stop_mask)
    return jnp.where(early, -jnp.inf, logits)


def apply_temperature(logits: Array, rows: RowParams) -> Array:
    t = rows.temperature[:, None]
    return logits / jnp.where(t == 0, 1.0, t)


def apply_truncation(logits: Array, rows: RowParams) -> Array:
    """top-k, top-p, min-p on one descending sort; skipped entirely when no row asks for them."""

    def truncate(x):
        order = jnp.argsort(-x, axis=-1)
        sorted_x = jnp.take_along_axis(x, order, axis=-1)
        v = x.shape[-1]
        k = jnp.where(rows.top_k > 0, jnp.minimum(rows.top_k, v), v)
        kth = jnp.take_along_axis(sorted_x, (k - 1)[:, None], axis=-1)
        sorted_x = jnp.where(sorted_x < kth, -jnp.inf, sorted_x)
        probs = numerics.softmax(sorted_x)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        # rows with top_p == 1 keep everything: f32 cumulative sums reach 1 before the tail
        drop = ((mass_before >= rows.top_p[:, None]) & (rows.top_p[:, None] < 1.0)
                & (jnp.arange(v)[None, :] > 0))
        sorted_x = jnp.where(drop, -jnp.inf, sorted_x)
        probs = numerics.softmax(sorted_x)
        sorted_x = jnp.where(probs < rows.min_p[:, None] * probs[:, :1], -jnp.inf, sorted_x)
        inverse = jnp.argsort(order, axis=-1)
        return jnp.take_along_axis(sorted_x, inverse, axis=-1)

    needed = jnp.any((rows.top_k > 0) | (rows.top_p < 1.0) | (rows.min_p > 0.0))
    return jax.lax.cond(needed, truncate, lambda x: x, logits)


def process(logits: Array, rows: RowParams, counts: Array, seen: Array, step: Array,
            grammar: Optional[tuple] = None, custom: Optional[Callable] = None) -> Array:
    """contract §3 steps 1-5: raw logits f32[B, V] -> log-probabilities (-inf where removed).

    Rows with temperature 0 get their penalised and masked logits renormalised; their selection
    is the argmax (`sampling.select`). `grammar` = (GrammarTables, int32[B] states) or None.
    `custom(position, x) -> x`: user processors at their positions
    (jaxdecode/device/research.py)."""
    x = logits.astype(jnp.float32)
    if custom is not None:
        x = custom("first", x)
    x = apply_penalties(x, rows, counts, seen)
    x = apply_masks(x, rows, step)
    if grammar is not None:  # constraints: step 2, grammar mask
        x = constraint_tables.mask_logits(x, grammar[0], grammar[1], rows.eos_mask)
    greedy = (rows.temperature == 0)[:, None]
    if custom is None:
        x = jnp.where(greedy, x, apply_truncation(apply_temperature(x, rows), rows))
    else:  # temperature divides greedy rows by 1 (exact); truncation skips them
        x = custom("after_temperature", apply_temperature(custom("after_penalties", x), rows))
        x = custom("last", jnp.where(greedy, x, apply_truncation(x, rows)))
    all_masked = jnp.all(jnp.isneginf(x), axis=-1, keepdims=True)  # contract P2: -inf, never NaN
    return jnp.where(all_masked, -jnp.inf, numerics.log_softmax(x))


def history_arrays(output_ids: Optional[np.ndarray], batch: int, vocab_size: int):
    """counts int32[B, V] and seen bool[B, V] from an int32[B, N] history padded with -1."""
    counts = np.zeros((batch, vocab_size), np.int32)
    if output_ids is not None:
        ids = np.asarray(output_ids)
        rows, cols = np.nonzero(ids >= 0)
        np.add.at(counts, (rows, ids[rows, cols]), 1)
    return counts, counts > 0


@numerics.jit
def _process_jit(logits, rows, counts, seen, step):
    return process(logits, rows, counts, seen, step)


def process_logits(logits, sampling: Sequence[SamplingParams] | SamplingParams,
                   output_ids=None) -> Array:
    """Public pipeline of contract §3 for notebooks and tests (docs/architecture.md).

    logits f32[B, V]; one SamplingParams per row (or one for all); output_ids int32[B, N] padded
    with -1 is the history the penalties see. Returns log-probabilities f32[B, V]."""
    logits = jnp.asarray(logits, jnp.float32)
    b, v = logits.shape
    sampling = [sampling] * b if isinstance(sampling, SamplingParams) else list(sampling)
    if len(sampling) != b:
        raise ValueError(f"sampling: expected {b} SamplingParams (one per row), "
                         f"got {len(sampling)}")
    rows = RowParams.build(sampling, v, keys=np.zeros((b, 2), np.uint32))
    counts, seen = history_arrays(output_ids, b, v)
    step = np.full((b,), np.iinfo(np.int32).max, np.int32)  # min_tokens is satisfied here
    return _process_jit(logits, rows, counts, seen, step)
