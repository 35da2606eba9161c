"""LoRA adapters for the Llama family (Llama, Mistral, Qwen2): PEFT checkpoints loaded into one
stack, applied per row in one program (docs/architecture.md "Adapters", contract R6).

`load_adapter` reads a PEFT LoRA directory (adapter_config.json + adapter_model.safetensors)
into this family's layout: per layer and targeted projection (q/k/v/o_proj, gate/up/down_proj)
A [in, r] and B [r, out] with the scale (lora_alpha / r, or / sqrt(r) with use_rslora) folded
into B. `stack_adapters` puts up to `max_loras` of them side by side, zero padded to one rank R,
the targets that read one input grouped (GROUPS: q/k/v, o, gate/up, down):

    lora: {"slot": int32[max_loras * R]  -- the adapter index each column belongs to (1-based),
           "layers": list of {"q+k+v": {"a": [in, n * max_loras * R],
                                        "b": [n * max_loras * R, out_q + out_k + out_v]}, ...}}

per layer one entry per group, keyed by the targets of the group some adapter touches there
(n of them): `a` their A stacks side by side, `b` their B stacks block-diagonally. A forward
call with `adapters` int32[B] (0: the base model) adds, to each targeted projection y = x @ W
of row b, its columns of ((x @ a) * [slot == adapters[b]]) @ b: every row multiplies the whole
stack, so rows of different adapters run in one program and a new selection never recompiles,
with two products per group (four groups: eight a layer, not fourteen). Both are
`layers.dense` on the call's row tiles, so a row's delta, like its base product, does not
depend on the other rows (X1); a base row's mask is all zero and its delta exactly 0.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxdecode.model_api import params_dtype
from models import layers as L

Array = jax.Array

TARGETS = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o",
           "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
GROUPS = (("q", "k", "v"), ("o",), ("gate", "up"), ("down",))  # the targets of one input
_KEY = re.compile(r"(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?"
                  r"\.weight")
# adapter_config.json settings this loader cannot honour, with the value that is fine
_UNSUPPORTED = {"use_dora": False, "fan_in_fan_out": False, "bias": "none",
                "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {}}


def _fail(name: str, message: str) -> None:
    raise ValueError(f"lora_modules: {name}: {message}")


def _config(name: str, root: Path) -> dict:
    """adapter_config.json, checked: a LoRA adapter with settings this loader applies."""
    file = root / "adapter_config.json"
    if not file.is_file():
        _fail(name, f"{root} has no adapter_config.json (not a PEFT adapter directory)")
    config = json.loads(file.read_text())
    if config.get("peft_type", "LORA") != "LORA":
        _fail(name, f"peft_type {config.get('peft_type')!r} is not LORA")
    for key, fine in _UNSUPPORTED.items():
        if config.get(key, fine) not in (fine, None, [], {}):
            _fail(name, f"{key}={config[key]!r} is not supported")
    r = config.get("r")
    if not isinstance(r, int) or r < 1:
        _fail(name, f"adapter_config.json r must be a positive integer, got {r!r}")
    return config


def _tensors(name: str, root: Path) -> dict:
    from safetensors.numpy import load_file

    file = root / "adapter_model.safetensors"
    if not file.is_file():
        _fail(name, f"{root} has no adapter_model.safetensors")
    return load_file(str(file))


def load_adapter(name: str, path: str, params: dict) -> dict:
    """One PEFT LoRA adapter for the base `params` (module docstring): {"rank": r, "layers":
    [{target: (a f32[in, r], b f32[r, out] * scale)}]}. ValueError naming lora_modules for a
    directory that is not one, a target outside TARGETS, or shapes that do not fit the base."""
    root = Path(path).expanduser()
    config = _config(name, root)
    r, alpha = config["r"], config.get("lora_alpha", config["r"])
    scale = alpha / (math.sqrt(r) if config.get("use_rslora") else r)
    found: dict = {}
    for key, value in _tensors(name, root).items():
        m = _KEY.fullmatch(key)
        if m is None or m.group(2) not in TARGETS:
            _fail(name, f"tensor {key!r} is not a LoRA weight of "
                  f"{'/'.join(TARGETS)} (the targets supported)")
        layer, target, ab = int(m.group(1)), TARGETS[m.group(2)], m.group(3)
        found[(layer, target, ab)] = np.asarray(value, np.float32)
    base = params["layers"]
    layers: list = [{} for _ in base]
    for (layer, target, ab), value in found.items():
        if ab == "B":
            continue
        if layer >= len(base) or (layer, target, "B") not in found:
            _fail(name, f"layer {layer} {target}_proj: no such layer, or lora_B missing")
        a, b = value.T, found[(layer, target, "B")].T * scale
        w_in, w_out = np.shape(base[layer][target])
        if a.shape != (w_in, r) or b.shape != (r, w_out):
            _fail(name, f"layer {layer} {target}_proj: lora_A / lora_B of shapes "
                  f"{list(value.shape)} / {list(b.T.shape)} do not fit the base weight "
                  f"[{w_in}, {w_out}] with r={r}")
        layers[layer][target] = (a, b)
    if not any(layers):
        _fail(name, "no LoRA weights found in adapter_model.safetensors")
    return {"rank": r, "layers": layers}


def stack_adapters(adapters: list, params: dict, max_loras: int) -> dict:
    """The stack of the module docstring: adapter j (0-based in `adapters`) takes index j + 1,
    columns [j * R, (j + 1) * R); unused indices up to `max_loras` stay zero. Weights in the
    base's dtype."""
    rank = max(a["rank"] for a in adapters)
    dtype = params_dtype(params)
    layers = []
    for i, base in enumerate(params["layers"]):
        layer = {}
        for group in GROUPS:
            targets = [t for t in group if any(t in a["layers"][i] for a in adapters)]
            if targets:
                a_all, b_all = zip(*(_target_stack(adapters, i, t, np.shape(base[t]), rank,
                                                   max_loras) for t in targets))
                layer["+".join(targets)] = {
                    "a": jnp.asarray(np.concatenate(a_all, axis=1), dtype),
                    "b": jnp.asarray(_block_diagonal(b_all), dtype)}
        layers.append(layer)
    slot = np.repeat(np.arange(1, max_loras + 1, dtype=np.int32), rank)
    return {"slot": jnp.asarray(slot), "layers": layers}


def _target_stack(adapters: list, i: int, target: str, shape: tuple, rank: int,
                  max_loras: int) -> tuple:
    """(A f32[in, max_loras * rank], B f32[max_loras * rank, out]) of one target of layer i:
    adapter j's at columns / rows [j * rank, (j + 1) * rank), zeros elsewhere."""
    a_all = np.zeros((shape[0], max_loras * rank), np.float32)
    b_all = np.zeros((max_loras * rank, shape[1]), np.float32)
    for j, adapter in enumerate(adapters):
        if target in adapter["layers"][i]:
            a, b = adapter["layers"][i][target]
            a_all[:, j * rank:j * rank + a.shape[1]] = a
            b_all[j * rank:j * rank + b.shape[0]] = b
    return a_all, b_all


def _block_diagonal(blocks: tuple) -> np.ndarray:
    out = np.zeros((sum(b.shape[0] for b in blocks), sum(b.shape[1] for b in blocks)),
                   np.float32)
    r = c = 0
    for b in blocks:
        out[r:r + b.shape[0], c:c + b.shape[1]] = b
        r, c = r + b.shape[0], c + b.shape[1]
    return out


class RowAdapters:
    """The adapters of one forward call's rows: `stack` (params["lora"]), `index` int32[B] (0:
    the base) and the call's tiles; `apply(i, ys, x)` adds to the base outputs `ys` {target:
    y} of one group's input x the rows' deltas."""

    def __init__(self, stack: dict, index: Array, tile: Optional[Any]):
        self.layers, self.tile = stack["layers"], tile
        self.mask = (index[:, None] == stack["slot"][None, :])[:, None, :]  # [B, 1, L*R]

    def apply(self, i: int, ys: dict, x: Array) -> dict:
        key = next((k for k in self.layers[i] if k.split("+")[0] in ys), None)
        if key is None:
            return ys
        w, targets = self.layers[i][key], key.split("+")
        shrunk = L.dense(x, w["a"], self.tile)
        mask = jnp.tile(self.mask, (1, 1, len(targets)))
        shrunk = jnp.where(mask, shrunk, jnp.zeros((), shrunk.dtype))
        delta = L.dense(shrunk, w["b"], self.tile)
        ends = np.cumsum([ys[t].shape[-1] for t in targets])[:-1]
        out = dict(ys)
        for t, d in zip(targets, jnp.split(delta, ends, axis=-1)):
            out[t] = ys[t] + d.astype(ys[t].dtype)
        return out


def adapters_of(params: dict, adapters: Optional[Array], tile: Optional[Any]
                ) -> Optional[RowAdapters]:
    """The call's `RowAdapters` when it passes `adapters` and the weights carry a stack."""
    if adapters is None or "lora" not in params:
        return None
    return RowAdapters(params["lora"], adapters, tile)

