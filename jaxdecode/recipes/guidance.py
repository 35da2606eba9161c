"""Classifier-free guidance (Sanchez et al. 2023, "Stay on topic with Classifier-Free
Guidance"): each prompt decodes beside its negative (or empty) prompt, and the next-token
distribution is pushed away from the negative one,

    guided = log p(x | negative) + scale * (log p(x | prompt) - log p(x | negative))

(HF `generate(guidance_scale=..., negative_prompt_ids=...)`, whose
`UnbatchedClassifierFreeGuidanceLogitsProcessor` computes the same on log-softmaxed logits).
scale = 1 is plain decoding of the prompt; scale > 1 strengthens what the prompt adds over
the negative prompt.

Two processors do it inside one `jd.generate` over interleaved rows (prompt i at row 2i, its
negative prompt at row 2i + 1):

- `_guide` ("first", on the raw logits): both rows of a pair get the guided log-probabilities;
- `_sync` ("last", before selection): the negative row takes the prompt row's processed
  distribution, so with the same seed both select the same token and the negative context
  follows the generated text, as in HF.

The scale lives in the guide's `init_state` (data: another scale never recompiles).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxdecode.config import SamplingParams
from jaxdecode.device.decode import GenerateOutput, generate
from jaxdecode.device.research import LogitProcessor

Array = jax.Array


def _pairs(x: Array) -> tuple[Array, Array]:
    if x.shape[0] % 2:
        raise ValueError("processors: guidance needs rows in (prompt, negative prompt) pairs, "
                         f"got {x.shape[0]} rows")
    return x[0::2], x[1::2]


def _guide(logits: Array, ctx: Any, params: dict):
    cond, uncond = _pairs(jax.nn.log_softmax(logits, axis=-1))
    scale = params["scale"][0::2, None]
    guided = uncond + scale * (cond - uncond)
    return jnp.repeat(guided, 2, axis=0), params


def _sync(logits: Array, ctx: Any) -> Array:
    return jnp.repeat(_pairs(logits)[0], 2, axis=0)


def guidance_processors(scale: float) -> list:
    """The two processors for interleaved (prompt, negative prompt) rows."""
    return [LogitProcessor(_guide, "first", init_state={"scale": np.float32(scale)}),
            LogitProcessor(_sync, "last")]


def _take_rows(out: GenerateOutput, rows: slice) -> GenerateOutput:
    """`out` restricted to `rows` (every per-row field)."""
    b = len(out.lengths)

    def take(x):
        if isinstance(x, np.ndarray) and x.ndim and x.shape[0] == b:
            return x[rows]
        if isinstance(x, list) and len(x) == b:
            return x[rows]
        return x

    per_row = [f.name for f in dataclasses.fields(out)
               if f.name not in ("observations", "processor_order")]  # those are not per row
    return dataclasses.replace(out, **{name: jax.tree.map(take, getattr(out, name),
                                                          is_leaf=lambda v: isinstance(v, list))
                                       for name in per_row})


def guided_generate(model: Any, params: Any, prompt_ids: Sequence[Sequence[int]],
                    negative_prompt_ids: Sequence[Sequence[int]],
                    sampling: SamplingParams | Sequence[SamplingParams], *, scale: float = 1.5,
                    processors: Sequence[LogitProcessor] = (), **kwargs) -> GenerateOutput:
    """`jd.generate` with classifier-free guidance; returns the prompts' rows only.

    negative_prompt_ids: one per prompt (a single token such as BOS for "unconditional").
    Each pair shares its row's settings and seed (rows with seed=None use seed = the prompt's
    index, so results are reproducible); n must be 1. `processors` run after the guidance
    ones' "first" step, in their own positions; other keywords go to `jd.generate`."""
    b = len(prompt_ids)
    if len(negative_prompt_ids) != b:
        raise ValueError(f"negative_prompt_ids: expected one per prompt ({b}), "
                         f"got {len(negative_prompt_ids)}")
    rows = [sampling] * b if isinstance(sampling, SamplingParams) else list(sampling)
    if len(rows) != b:
        raise ValueError(f"sampling: expected 1 or {b} SamplingParams, got {len(rows)}")
    if any(sp.n != 1 for sp in rows):
        raise ValueError("n: guided_generate takes one sample per prompt")
    rows = [dataclasses.replace(sp, seed=i if sp.seed is None else sp.seed)
            for i, sp in enumerate(rows)]
    interleaved = [p for pair in zip(prompt_ids, negative_prompt_ids) for p in pair]
    out = generate(model, params, interleaved, [sp for sp in rows for _ in range(2)],
                   processors=guidance_processors(scale) + list(processors), **kwargs)
    return _take_rows(out, slice(0, None, 2))


__all__ = ["guidance_processors", "guided_generate"]
