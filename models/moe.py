"""Mixture-of-experts models (Mixtral, Qwen3-MoE): Llama's attention (models/llama.py) with
sparse MLP layers, each E SwiGLU experts and a router that picks `num_experts_per_tok` of them
per token (docs/moe.md).

The router (docs/contract.md §12, "Mixture of experts"): logits = h @ router, softmax in f32, the top k probabilities, divided
by their sum where `norm_topk_prob` (always for Mixtral). Every token's experts are computed in
one program of static shapes: no host round trip, and routing is data, so a new routing never
recompiles. Two dispatch forms (`MoeConfig.dispatch`):

- "dense" (the default): every expert on every token, each a `layers.dense` product on the
  call's tiles, weighted by a [B, T, E] gate matrix that is zero outside the token's top k, the
  experts' terms added in expert order (HF's order; a zero gate adds an exact zero);
- "gather": each token's k experts' weights gathered and applied as a batched product with the
  (token, slot) pair as a batch axis (two rows per product, as `invariance.attention` does, so
  XLA never rewrites it as a reduction whose order depends on the batch), then added in expert
  order.

Either way a token's experts and output depend on that token alone (no capacity, no dropping),
so the cached forward keeps X1 (docs/batch_invariance.md).

Params pytree: Llama's (models/llama.py), where a sparse layer holds, instead of gate/up/down,
    router [D, E]; experts_gate [E, D, F]; experts_up [E, D, F]; experts_down [E, F, D]
(F = `moe_intermediate_size`); dense layers (Qwen3-MoE's `mlp_only_layers`,
`decoder_sparse_step`) keep Llama's gate/up/down of `intermediate_size`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp

from jaxdecode import invariance
from models import layers as L
from models.llama import Llama, LlamaConfig

Array = jax.Array

DISPATCH = ("dense", "gather")
EXPERT_WEIGHTS = ("experts_gate", "experts_up", "experts_down")


@dataclasses.dataclass(frozen=True)
class MoeConfig(LlamaConfig):
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 688
    norm_topk_prob: bool = True       # Mixtral: always; Qwen3-MoE: its config's flag
    sparse_layers: tuple = ()         # per layer: True for an MoE MLP; () means every layer
    dispatch: str = "dense"

    def __post_init__(self):
        if self.dispatch not in DISPATCH:
            raise ValueError(f"dispatch: expected one of {DISPATCH}, got {self.dispatch!r}")
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok: {self.num_experts_per_tok} is not in "
                             f"[1, num_experts={self.num_experts}]")
        if self.sparse_layers and len(self.sparse_layers) != self.num_layers:
            raise ValueError(f"sparse_layers: {len(self.sparse_layers)} entries for "
                             f"{self.num_layers} layers")

    def is_sparse(self, layer: int) -> bool:
        return not self.sparse_layers or bool(self.sparse_layers[layer])


def route(h: Array, router: Array, top_k: int, renormalise: bool,
          tile: Optional[invariance.Tiles]) -> tuple[Array, Array]:
    """(expert ids int32[..., k] in ascending order, their f32 weights [..., k]) of each token
    of h [..., D] (contract §12): softmax of the router logits, top k, renormalised where
    asked. The softmax's and the renormalisation's sums are `fixed_sum`s with a `tile`, so a
    token's routing depends on that token alone."""
    logits = L.dense(h, router, tile).astype(jnp.float32)
    total = (lambda x: invariance.fixed_sum(x, -1, keepdims=True)) if tile is not None else (
        lambda x: jnp.sum(x, -1, keepdims=True))
    probs = jnp.exp(logits - jnp.max(logits, -1, keepdims=True))
    probs = probs / total(probs)
    weights, ids = jax.lax.top_k(probs, top_k)
    if renormalise:
        weights = weights / total(weights)
    order = jnp.argsort(ids, -1)  # expert order: the order HF adds the experts' terms in
    return (jnp.take_along_axis(ids, order, -1).astype(jnp.int32),
            jnp.take_along_axis(weights, order, -1))


def moe_mlp(h: Array, p: dict, c: MoeConfig, tile: Optional[invariance.Tiles]) -> Array:
    """The sparse MLP of h [B, T, D] with layer params `p`, by `c.dispatch`."""
    ids, weights = route(h, p["router"], c.num_experts_per_tok, c.norm_topk_prob, tile)
    if c.dispatch == "gather":
        return _gathered(h, p, ids, weights)
    gates = jnp.zeros(h.shape[:-1] + (c.num_experts,), jnp.float32)
    gates = jnp.put_along_axis(gates, ids, weights, -1, inplace=False)
    out = None
    for e in range(c.num_experts):
        act = (jax.nn.silu(L.dense(h, p["experts_gate"][e], tile))
               * L.dense(h, p["experts_up"][e], tile))
        term = (L.dense(act, p["experts_down"][e], tile) * gates[..., e:e + 1]).astype(h.dtype)
        out = term if out is None else out + term
    return out


def _gathered(h: Array, p: dict, ids: Array, weights: Array) -> Array:
    """Each (token, slot) pair's expert applied as one batched product of two rows (the second
    a zero row), the k terms then added in expert order."""
    *lead, d = h.shape
    k = ids.shape[-1]
    flat_ids = ids.reshape(-1)
    x = jnp.repeat(h.reshape(-1, 1, d), k, axis=0)                       # [N*k, 1, D]
    x = jnp.pad(x, ((0, 0), (0, 1), (0, 0)))
    prod = lambda a, name: jnp.einsum("nrd,ndf->nrf", a, p[name][flat_ids])  # noqa: E731
    act = jax.nn.silu(prod(x, "experts_gate")) * prod(x, "experts_up")
    y = prod(act, "experts_down")[:, 0].reshape(*lead, k, d)
    terms = (y * weights[..., None]).astype(h.dtype)
    out = terms[..., 0, :]
    for j in range(1, k):
        out = out + terms[..., j, :]
    return out


@dataclasses.dataclass(frozen=True)
class Moe(Llama):
    """Implements `jaxdecode.model_api.DecoderModel` (Mixtral, Qwen3-MoE)."""

    config: MoeConfig

    def init_params(self, key: Array, dtype: Any = jnp.float32, scale: float = 0.02) -> dict:
        """Random parameters: Llama's, with a router and stacked experts on sparse layers."""
        c = self.config
        key, sub = jax.random.split(key)
        params = super().init_params(sub, dtype, scale)
        d, e, f = c.hidden_size, c.num_experts, c.moe_intermediate_size
        shapes = {"router": (d, e), "experts_gate": (e, d, f), "experts_up": (e, d, f),
                  "experts_down": (e, f, d)}
        for i, layer in enumerate(params["layers"]):
            if not c.is_sparse(i):
                continue
            for name in ("gate", "up", "down"):
                del layer[name]
            for name, shape in shapes.items():
                key, sub = jax.random.split(key)
                layer[name] = (scale * jax.random.normal(sub, shape, jnp.float32)).astype(dtype)
        return params

    def load_adapter(self, name: str, path: str, params: dict) -> dict:
        """LoRA adapters are read for the dense Llama family only (contract R6)."""
        raise ValueError("lora_modules: LoRA adapters are supported for the dense Llama family, "
                         "not for a mixture-of-experts model")

    def _mlp(self, i: int, p: dict, h: Array, tile, proj) -> Array:
        if not self.config.is_sparse(i):
            return super()._mlp(i, p, h, tile, proj)
        return moe_mlp(h, p, self.config, tile)
