"""Activation capture and interventions at the model's named hook points (issue #16).

Every family in models/ calls `x = hook(name, x)` at the points of `model_api.hook_points`:
"embed", "resid.{i}" (the residual stream after layer i) and "final_norm". jaxdecode builds
that one function per forward from static parts (which points, which functions) and dynamic
arguments (steering vectors, per-row scales), so new vectors or scales never recompile:

    jd.capture_activations(model, params, prompts, ["resid.1"])  # {point: f32[B, T, hidden]}
    jd.generate(..., return_hidden_states=(0, 2))                # per step, HF indexing
    jd.generate(..., interventions=[jd.steer("resid.1", vector, scale)])

An intervention is `Intervention(point, fn, args)`: a pure `fn(x, args) -> x` applied to the
activation x [B, T, hidden] of every forward of the generation (the prompt pass, then one
position per step); `args` is a pytree of arrays passed to the compiled program as data.
`steer` adds `scale[b] * vector` to rows with a nonzero scale; `ablate` removes the component
along a direction on the chosen rows. Both leave the other rows' values untouched
(`jnp.where`), so those rows are bit-identical to a run without hooks. Interventions run first
at a point, in list order; a captured value is the one after them.

Hashing (no recompiles): an Intervention compares equal to another with the same point, the
same `fn` object and args of the same structure, shapes and dtypes -- define `fn` once (at
module level), not as a fresh lambda per call.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxdecode.device import numerics
from jaxdecode.model_api import DecoderModel, hook_points, params_dtype

Array = jax.Array


def static_signature(tree: Any) -> tuple:
    """(treedef, ((shape, dtype), ...)) of a pytree of arrays: what a compiled program depends
    on, without the values."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple((tuple(x.shape), str(x.dtype)) for x in leaves)


def as_arrays(tree: Any) -> Any:
    """Every leaf as a jax array (Python scalars get jax's default dtypes)."""
    return jax.tree.map(jnp.asarray, tree)


class Intervention:
    """`fn(x, args) -> x` applied at hook point `point` (module docstring)."""

    def __init__(self, point: str, fn: Callable, args: Any = ()):
        if not isinstance(point, str):
            raise ValueError(f"point: expected a hook point name, got {point!r}")
        if not callable(fn):
            raise ValueError(f"fn: expected a callable, got {type(fn).__name__}")
        self.point, self.fn, self.args = point, fn, as_arrays(args)
        self._key = (point, fn, static_signature(self.args))

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, Intervention) and self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)

    def __repr__(self) -> str:
        return f"Intervention({self.point!r}, {getattr(self.fn, '__qualname__', self.fn)!r})"


def _steer(x: Array, args) -> Array:
    vector, scale = args
    scale = jnp.broadcast_to(scale, x.shape[:1])[:, None, None]
    return jnp.where(scale != 0, x + (scale * vector).astype(x.dtype), x)


def _ablate(x: Array, args) -> Array:
    direction, rows = args
    unit = direction / jnp.maximum(jnp.linalg.norm(direction), 1e-12)
    xf = x.astype(jnp.float32)
    ablated = (xf - (xf @ unit)[..., None] * unit).astype(x.dtype)
    return jnp.where(jnp.broadcast_to(rows, x.shape[:1])[:, None, None], ablated, x)


def steer(point: str, vector, scale=1.0) -> Intervention:
    """Add `scale[b] * vector` (f32[hidden]) at `point` on every row b whose scale is nonzero;
    `scale` is one number or one per row (f32[B]). Rows with scale 0 keep their values."""
    vector = jnp.asarray(vector, jnp.float32)
    if vector.ndim != 1:
        raise ValueError(f"vector: expected f32[hidden], got shape {vector.shape}")
    return Intervention(point, _steer, (vector, jnp.asarray(scale, jnp.float32)))


def ablate(point: str, direction, rows=True) -> Intervention:
    """Project out `direction` (f32[hidden]) at `point`: x - (x . u) u with u the unit
    direction, on the rows where `rows` (one bool or bool[B]) is true."""
    direction = jnp.asarray(direction, jnp.float32)
    if direction.ndim != 1:
        raise ValueError(f"direction: expected f32[hidden], got shape {direction.shape}")
    return Intervention(point, _ablate, (direction, jnp.asarray(rows, bool)))


@functools.lru_cache(maxsize=None)
def accepts_hook(model_type: type) -> bool:
    """Whether a model's forward takes the optional `hook` keyword (model_api)."""
    return "hook" in inspect.signature(model_type.forward).parameters


def check_points(model: DecoderModel, points: Sequence[str], field: str) -> None:
    """ValueError naming `field` unless the model has hook points and every name is one."""
    if not points:
        return
    if not accepts_hook(type(model)):
        raise ValueError(f"{field}: {type(model).__name__} has no hook points (its forward "
                         "takes no `hook` keyword; see jaxdecode/model_api.py)")
    known = hook_points(model.config.num_layers)
    for p in points:
        if p not in known:
            raise ValueError(f"{field}: unknown hook point {p!r}; this model has "
                             f"{', '.join(known)}")


def make_hook(interventions: Sequence[Intervention], args: Sequence[Any],
              capture: Sequence[str], captured: dict,
              select: Callable[[Array], Array]) -> Callable[[str, Array], Array]:
    """The `hook(name, x)` of one forward: applies the interventions of a point (with their
    dynamic `args`, aligned with `interventions`), then stores `select(x)` into `captured`
    for points in `capture` (a trace-time dict the caller reads after the forward)."""

    def hook(name: str, x: Array) -> Array:
        for i, (iv, a) in enumerate(zip(interventions, args)):
            if iv.point == name:
                y = iv.fn(x, a)
                if getattr(y, "shape", None) != x.shape:
                    raise ValueError(f"interventions[{i}]: fn must return the activation's "
                                     f"shape {x.shape}, got {getattr(y, 'shape', type(y))}")
                x = y.astype(x.dtype)
        if name in capture:
            captured[name] = select(x).astype(jnp.float32)
        return x

    return hook


@dataclasses.dataclass(frozen=True)
class CaptureConfig:
    """Static part of a capture pass: the model, the points, the interventions, the dtype."""

    model: DecoderModel
    points: tuple
    interventions: tuple
    dtype: Any


@numerics.jit(static_argnums=(0,))
def _capture(config: CaptureConfig, params, tokens, lengths, args):
    model, points, interventions = config.model, config.points, config.interventions
    b, t = tokens.shape
    cache = model.init_cache(b, t, config.dtype)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    captured: dict = {}
    hook = make_hook(interventions, args, points, captured, lambda x: x)
    logits, _ = model.forward(params, tokens, positions, cache, lengths=lengths, hook=hook)
    real = (jnp.arange(t)[None, :] < lengths[:, None])[..., None]
    return {p: jnp.where(real, v, 0.0) for p, v in captured.items()}, jnp.where(real, logits, 0.0)


def capture_activations(model: DecoderModel, params: Any, prompt_ids: Sequence[Sequence[int]],
                        points: Sequence[str], *,
                        interventions: Sequence[Intervention] = (),
                        return_logits: bool = False):
    """One forward pass over ragged prompts; returns {point: f32[B, T, hidden]} for each hook
    point in `points` (T = the longest prompt; zeros past a row's length), after the given
    interventions. With `return_logits`, also the logits f32[B, T, V]: (activations, logits).
    Points: `model_api.hook_points` (HF's `output_hidden_states` entry l is
    `model_api.hidden_state_point(l, L)`)."""
    if not prompt_ids or not all(len(p) > 0 for p in prompt_ids):
        raise ValueError("prompt_ids: expected a non-empty list of non-empty token-id lists")
    points = tuple(points)
    interventions = tuple(interventions)
    check_points(model, points, "points")
    check_points(model, [iv.point for iv in interventions], "interventions")
    t = max(len(p) for p in prompt_ids)
    if t > model.config.max_len:
        raise ValueError(f"prompt_ids: a prompt of {t} tokens exceeds the model's max_len "
                         f"{model.config.max_len}")
    tokens = np.zeros((len(prompt_ids), t), np.int32)
    for r, p in enumerate(prompt_ids):
        tokens[r, :len(p)] = p
    lengths = np.array([len(p) for p in prompt_ids], np.int32)
    config = CaptureConfig(model, points, interventions, params_dtype(params))
    acts, logits = _capture(config, params, tokens, lengths, intervention_args(interventions))
    acts = {p: np.asarray(acts[p]) for p in points}
    return (acts, np.asarray(logits)) if return_logits else acts


def intervention_args(interventions: Sequence[Intervention]) -> tuple:
    return tuple(iv.args for iv in interventions)


def as_interventions(values: Optional[Sequence[Any]]) -> tuple:
    """ValueError naming `interventions` for anything but a sequence of Intervention."""
    values = tuple(values or ())
    for i, iv in enumerate(values):
        if not isinstance(iv, Intervention):
            raise ValueError(f"interventions[{i}]: expected jd.Intervention (jd.steer, "
                             f"jd.ablate), got {type(iv).__name__}")
    return values
