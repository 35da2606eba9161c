"""Sharding rules: one table from parameter paths and KV-cache fields to mesh axes.

Megatron-style tensor parallelism over the "model" axis, batch (data) parallelism over "data":

* q/k/v, gate/up (Llama), fc (GPT-2) and their biases: split on the output dimension;
* o, down (Llama), proj (GPT-2): split on the input dimension (one all-reduce after each);
  their biases, added after that all-reduce, are replicated;
* embed [V, D] and lm_head [D, V]: split on the vocabulary;
* mixture-of-experts weights (models/moe.py) [E, D, F] / [E, F, D]: experts on "expert", each
  expert's gate/up column parallel and down row parallel on "model"; the router replicated;
* norms, norm biases and GPT-2's position table: replicated;
* the KV cache (`jaxdecode.model_api.CACHE_RULES`, the same table): batch on "data", kv heads
  on "model".

A dimension not divisible by its axis size (or an axis the mesh lacks) falls back to replicated
along that dimension: never an error. Paths are the flattened key paths of the params pytree,
e.g. "layers/3/q", "embed"; a rule's regex must match the whole path.

Same code on one CPU, on 8 simulated CPU devices (XLA_FLAGS=
--xla_force_host_platform_device_count=8) and on a TPU slice: multi-host, call
`jax.distributed.initialize()` before `make_mesh`.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jaxdecode.model_api import CACHE_RULES, cache_sharding, fit_spec, match_rules

logger = logging.getLogger(__name__)

_LAYER = r"layers/\d+/"
PARAM_RULES: tuple = (
    (_LAYER + r"(q|k|v|gate|up|fc)", (None, "model")),    # [D, out]: column parallel
    (_LAYER + r"(q|k|v|gate|up|fc)_bias", ("model",)),
    (_LAYER + r"(o|down|proj)", ("model", None)),         # [in, D]: row parallel
    (_LAYER + r"(o|down|proj)_bias", ()),                 # added after the all-reduce
    (_LAYER + r"\w*norm(_bias)?", ()),
    (_LAYER + r"experts_(gate|up)", ("expert", None, "model")),
    (_LAYER + r"experts_down", ("expert", "model", None)),
    (_LAYER + r"router", ()),
    (r"embed", ("model", None)),                          # [V, D]: vocab parallel
    (r"lm_head", (None, "model")),                        # [D, V]
    (r"pos_embed", ()),
    (r"final_norm(_bias)?", ()),
)

# THE table: parameters, then the KV cache (kept in jaxdecode, which must not import models).
RULES: tuple = PARAM_RULES + CACHE_RULES


# The arrays of an int8 weight (`qwix.QArray`, models/quantization.py): each takes its
# weight's rule (a scale's axis of 1 is left whole by `fit_spec`).
QARRAY_FIELDS = ("qvalue", "scale")


def key_path(path: Sequence[Any]) -> str:
    """'layers/0/q' for the jax key path of a leaf (also of an int8 weight's values or
    scales)."""
    parts = []
    for k in path:
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    if len(parts) > 1 and parts[-1] in QARRAY_FIELDS:
        parts.pop()
    return "/".join(parts)


def param_spec(path: str, shape: Sequence[int], mesh: Mesh) -> Optional[PartitionSpec]:
    """The fitted spec of the parameter at `path`, or None when no rule matches it."""
    spec = match_rules(RULES, path)
    return None if spec is None else fit_spec(spec, shape, mesh)


def unmatched(params: Any) -> list:
    """Paths of the leaves no rule matches (these are replicated by `shard_params`)."""
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    return [key_path(p) for p, _ in leaves if match_rules(RULES, key_path(p)) is None]


def param_sharding(params: Any, mesh: Mesh) -> Any:
    """A pytree like `params` of `NamedSharding`s (arrays or shape structs as leaves)."""
    def one(path, leaf):
        name = key_path(path)
        spec = param_spec(name, np.shape(leaf), mesh)
        if spec is None:
            logger.warning("sharding: no rule for parameter %r; replicated", name)
            spec = PartitionSpec()
        return NamedSharding(mesh, spec)
    return jax.tree_util.tree_map_with_path(one, params)


def shard_params(params: Any, mesh: Mesh) -> Any:
    """`params` placed on `mesh` by the rules (`jax.device_put` with `NamedSharding`s)."""
    return jax.device_put(params, param_sharding(params, mesh))


def make_mesh(data: int = 1, model: Optional[int] = None,
              devices: Optional[Sequence[Any]] = None, expert: int = 1) -> Mesh:
    """A ("data", "model") mesh with Auto axes (GSPMD partitions the jitted steps from the
    shardings of their inputs), ("data", "expert", "model") with `expert` > 1 (the experts of
    an MoE model split over it). `model` defaults to all devices not used by the others."""
    devices = list(jax.devices() if devices is None else devices)
    if expert < 1:
        raise ValueError(f"expert={expert}: expected at least 1")
    if model is None:
        if len(devices) % (data * expert):
            raise ValueError(f"data={data} x expert={expert} does not divide the "
                             f"{len(devices)} devices")
        model = len(devices) // (data * expert)
    sizes, names = ((data, expert, model), ("data", "expert", "model")) if expert > 1 else (
        (data, model), ("data", "model"))
    count = int(np.prod(sizes))
    if count > len(devices):
        raise ValueError(f"mesh {' x '.join(f'{n}={s}' for n, s in zip(names, sizes))} needs "
                         f"{count} devices, have {len(devices)}")
    if devices == list(jax.devices()) and count == len(devices):
        return jax.make_mesh(sizes, names, axis_types=(AxisType.Auto,) * len(sizes))
    return Mesh(np.array(devices[:count], dtype=object).reshape(sizes), names)


def parse_mesh(text: str) -> Mesh:
    """`make_mesh` from a CLI value like "data=2,model=4" or "expert=2,model=2" (missing axes:
    data=1, expert=1, model=rest)."""
    sizes = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        if name.strip() not in ("data", "model", "expert") or not value.strip().isdigit():
            raise ValueError(f"--mesh: expected data=N,model=M[,expert=E], got {text!r}")
        sizes[name.strip()] = int(value)
    return make_mesh(sizes.get("data", 1), sizes.get("model"), expert=sizes.get("expert", 1))


__all__ = ["CACHE_RULES", "PARAM_RULES", "RULES", "cache_sharding", "make_mesh",
           "param_sharding", "param_spec", "parse_mesh", "shard_params", "unmatched"]
