"""`jd.score`: the log-probability of given completion tokens under the raw model distribution,
equal to what the sampler reports for them (contract R2), and differentiable (docs/research.md
"The RL loop").

Each row is prompt + completion; the model reads its tokens but the last in one prompt pass
(`forward` over an empty cache, as `decode.prefill` runs it) and completion token j is scored
by the logits after token len(prompt) - 1 + j, with the sampler's own log-softmax
(`numerics.log_softmax`) -- the raw log-probability, before temperature or any processor.

Rows are grouped by their own length bucket (`shapes.bucket` of the tokens they read) and each
group runs as one batch of at least `numerics.min_rows` rows: a row's program shape follows
its own length only, so with a batch-invariant model its scores are bitwise the same alone or
beside any other rows (X1 for a fixed T; contract R3). They equal the sampler's within 2e-5,
not bitwise: the sampler computes token j's logits in a decode step (one query, elementwise
attention, 4-row weight tiles) and this pass in one T-token prefill (block attention, T-row
tiles), two products that round differently.

Gradients (`score_padded` under `jax.grad`): the batch-invariant forward hides its tile loop's
trip count from XLA, which reverse-mode cannot differentiate, so the value is the invariant
pass and the gradient the vector-Jacobian product of the same function on XLA's plain
numerics (`batch_invariant=False`, `jax.custom_vjp`): one extra forward per gradient.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxdecode import invariance
from jaxdecode.device import numerics
from jaxdecode.device.decode import accepts
from jaxdecode.model_api import DecoderModel, params_dtype
from jaxdecode.prompts import token_rows
from jaxdecode.shapes import bucket, row_bucket

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class ScoreConfig:
    """The static part of a scoring program: the model, each group's (rows, T) and the output
    width (the longest completion)."""

    model: DecoderModel
    groups: tuple
    width: int


def _check(model: DecoderModel, prompts: Sequence[Sequence[int]],
           completions: Sequence[Sequence[int]]) -> None:
    cfg = model.config
    if len(prompts) != len(completions):
        raise ValueError(f"completions: {len(completions)} rows for {len(prompts)} prompts "
                         "(one completion per prompt)")
    for field, rows in (("prompts", prompts), ("completions", completions)):
        for r, row in enumerate(rows):
            bad = [int(i) for i in row if not 0 <= int(i) < cfg.vocab_size]
            if bad:
                raise ValueError(f"{field}: token id {bad[0]} of row {r} is outside the "
                                 f"vocabulary (size {cfg.vocab_size})")
    for r, (p, c) in enumerate(zip(prompts, completions)):
        if len(p) + len(c) - 1 > cfg.max_len:
            raise ValueError(f"completions: row {r} reads {len(p) + len(c) - 1} tokens, more "
                             f"than the model's max_len {cfg.max_len}")


def layout(model: DecoderModel, prompts: Any, completions: Any) -> tuple[ScoreConfig, dict]:
    """Validate ragged rows and lay them out: the static config and the host inputs (per
    group: tokens, lengths, targets, gather index, row ids)."""
    prompts = token_rows(prompts, "prompts")
    completions = token_rows(completions, "completions")  # empty rows raise naming the field
    _check(model, prompts, completions)
    max_len, rows_min = model.config.max_len, numerics.min_rows(model)
    width = bucket(max(map(len, completions)))
    by_t: dict = {}
    for r, (p, c) in enumerate(zip(prompts, completions)):
        by_t.setdefault(bucket(len(p) + len(c) - 1, max_len), []).append(r)
    groups, inputs = [], []
    for t, members in sorted(by_t.items()):
        n = max(rows_min, row_bucket(len(members)))
        tokens = np.zeros((n, t), np.int32)
        targets = np.zeros((n, t), np.int32)
        index = np.zeros((n, width), np.int32)
        lengths = np.zeros((n,), np.int32)
        for i, r in enumerate(members):
            seq = list(prompts[r]) + list(completions[r])
            tokens[i, :len(seq) - 1] = seq[:-1]
            targets[i, :len(seq) - 1] = seq[1:]
            lengths[i] = len(seq) - 1
            index[i, :len(completions[r])] = len(prompts[r]) - 1 + np.arange(len(completions[r]))
        row_ids = np.full((n,), len(prompts), np.int32)  # padding rows land past the output
        row_ids[:len(members)] = members
        groups.append((n, t))
        inputs.append({"tokens": tokens, "targets": targets, "index": index,
                       "lengths": lengths, "rows": row_ids})
    mask = np.zeros((len(prompts), width), bool)
    for r, c in enumerate(completions):
        mask[r, :len(c)] = True
    return ScoreConfig(model, tuple(groups), width), {"groups": inputs, "mask": mask}


def _group_logprobs(model: DecoderModel, params: Any, g: dict) -> Array:
    """f32[rows, width]: the scored tokens' raw log-probabilities of one group."""
    rows, t = g["tokens"].shape
    cache = model.init_cache(rows, t, params_dtype(params))
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (rows, t))
    extra = {"kv_len": t} if accepts(type(model), "kv_len") else {}
    logits, _ = model.forward(params, g["tokens"], positions, cache, lengths=g["lengths"],
                              **extra)
    raw = numerics.log_softmax(logits.astype(jnp.float32))
    per_token = jnp.take_along_axis(raw, g["targets"][..., None], axis=-1)[..., 0]
    return jnp.take_along_axis(per_token, g["index"], axis=1)


def _padded(config: ScoreConfig, params: Any, groups: list, mask: Array) -> Array:
    n = mask.shape[0]
    out = jnp.zeros((n + 1, config.width), jnp.float32)
    for g in groups:
        out = out.at[g["rows"]].set(_group_logprobs(config.model, params, g))
    return jnp.where(mask, out[:n], 0.0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _invariant_value_plain_gradient(config: ScoreConfig, params: Any, groups: list,
                                    mask: Array) -> Array:
    return _padded(config, params, groups, mask)


def _fwd(config, params, groups, mask):
    return _padded(config, params, groups, mask), (params, groups, mask)


def _bwd(config, residuals, cotangent):
    params, groups, mask = residuals
    plain = dataclasses.replace(config, model=invariance.configure(config.model, False))
    _, vjp = jax.vjp(lambda p: _padded(plain, p, groups, mask), params)
    zeros = lambda x: np.zeros(np.shape(x), jax.dtypes.float0)  # noqa: E731 (int inputs)
    return vjp(cotangent)[0], jax.tree.map(zeros, groups), zeros(mask)


_invariant_value_plain_gradient.defvjp(_fwd, _bwd)


def _program(config: ScoreConfig, params: Any, groups: list, mask: Array) -> Array:
    if getattr(config.model, "batch_invariant", False):
        return _invariant_value_plain_gradient(config, params, groups, mask)
    return _padded(config, params, groups, mask)


_top_level = numerics.jit(_program, static_argnums=(0,))   # the sampler's compiler options
_nested = jax.jit(_program, static_argnums=(0,))            # inside a caller's trace


def score_padded(model: DecoderModel, params: Any, prompts: Any, completions: Any, *,
                 batch_invariant: bool = True) -> tuple[Array, np.ndarray]:
    """`(logprobs f32[rows, W], mask bool[rows, W])`: row r's completion token j scored at
    [r, j] (W = the longest completion's bucket; 0 where `mask` is False). A jax array,
    differentiable with respect to `params` (`jax.grad`, `jax.value_and_grad`, inside
    `jax.jit` too: the ragged rows are host data, closed over). Concrete params run the program
    with the decoder's compiler options, so its values are `score`'s bits; traced ones run it
    inside the caller's trace (XLA's default product library on the CPU: within R2's
    tolerance, not bitwise). Module docstring for the gradient's numerics."""
    model = invariance.configure(model, batch_invariant)
    config, inputs = layout(model, prompts, completions)
    traced = any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(params))
    program = _nested if traced else _top_level
    return program(config, params, inputs["groups"], inputs["mask"]), inputs["mask"]


def score(model: DecoderModel, params: Any, prompts: Any, completions: Any, *,
          batch_invariant: bool = True) -> list[np.ndarray]:
    """One float32 array per row: the raw log-probability of each completion token given the
    prompt and the completion tokens before it (contract R2: the sampler's `logprobs` for the
    same tokens within 2e-5; R3: a row's values never depend on the other rows, bitwise with
    batch invariance). `prompts`, `completions`: equally many non-empty token-id lists (a
    ValueError names the argument otherwise: lengths, empty rows, ids outside the vocabulary,
    rows longer than the model's context). `batch_invariant=False`: XLA's plain numerics. For
    gradients use `score_padded`."""
    logprobs, mask = score_padded(model, params, prompts, completions,
                                  batch_invariant=batch_invariant)
    values = np.asarray(logprobs)
    return [values[r, :int(m.sum())] for r, m in enumerate(mask)]
