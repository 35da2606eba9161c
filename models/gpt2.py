"""GPT-2 as one batched, pure JAX model (same protocol and style as `models.llama`).

Learned absolute position embeddings, pre-LayerNorm blocks with biases, a GELU MLP and (by
default) the LM head tied to the token embedding. HF stores GPT-2's projections as `Conv1D`
([in, out], i.e. already `x @ w`) and fuses q/k/v into `c_attn`; `models.hf` splits it.

Params pytree:
    embed [V, D]; pos_embed [P, D]; final_norm [D]; final_norm_bias [D]; lm_head [D, V] (absent when tied);
    layers: list of {attn_norm [D], attn_norm_bias [D], q/k/v [D, H*hd], q_bias/k_bias/v_bias [H*hd],
                     o [H*hd, D], o_bias [D], mlp_norm [D], mlp_norm_bias [D],
                     fc [D, F], fc_bias [F], proj [F, D], proj_bias [D]}
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from jaxdecode.model_api import ModelConfig
from models import layers as L

Array = jax.Array

ACTIVATIONS = {
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_fast": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
}


@dataclasses.dataclass(frozen=True)
class GPT2Config(ModelConfig):
    hidden_size: int = 768
    intermediate_size: int = 3072
    layer_norm_eps: float = 1e-5
    activation: str = "gelu_new"
    scale_attn_weights: bool = True
    scale_attn_by_inverse_layer_idx: bool = False
    tie_word_embeddings: bool = True

    def __post_init__(self):
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation: unsupported {self.activation!r} "
                             f"(supported: {', '.join(sorted(ACTIVATIONS))})")


@dataclasses.dataclass(frozen=True)
class GPT2(L.CachedDecoder):
    """Implements `jaxdecode.model_api.DecoderModel`."""

    config: GPT2Config

    def init_params(self, key: Array, dtype: Any = jnp.float32, scale: float = 0.02) -> dict:
        """Random parameters (normal * scale, norms at 1, biases at 0)."""
        c = self.config
        d, f, hd = c.hidden_size, c.intermediate_size, c.num_heads * c.head_dim
        shapes = {"q": (d, hd), "k": (d, hd), "v": (d, hd), "o": (hd, d),
                  "fc": (d, f), "proj": (f, d)}
        keys = iter(jax.random.split(key, 3 + c.num_layers * len(shapes)))

        def normal(shape):
            return (scale * jax.random.normal(next(keys), shape, jnp.float32)).astype(dtype)

        layers = []
        for _ in range(c.num_layers):
            layer = {name: normal(shape) for name, shape in shapes.items()}
            for name, shape in shapes.items():
                layer[name + "_bias"] = jnp.zeros((shape[1],), dtype)
            for norm in ("attn_norm", "mlp_norm"):
                layer[norm] = jnp.ones((d,), dtype)
                layer[norm + "_bias"] = jnp.zeros((d,), dtype)
            layers.append(layer)
        params = {"embed": normal((c.vocab_size, d)), "pos_embed": normal((c.max_len, d)),
                  "layers": layers, "final_norm": jnp.ones((d,), dtype),
                  "final_norm_bias": jnp.zeros((d,), dtype)}
        if not c.tie_word_embeddings:
            params["lm_head"] = normal((d, c.vocab_size))
        return params

    # -- internals ----------------------------------------------------------------------------

    def _run(self, params: dict, tokens: Array, positions: Array, attend, tile,
             hook=None) -> Array:
        """The hidden states after the final norm, [B, T, D] (`CachedDecoder._head` maps them
        to logits)."""
        c = self.config
        b, t = tokens.shape
        act = ACTIVATIONS[c.activation]
        eps = c.layer_norm_eps
        # Padding may carry any position; clip so the lookup stays in the table.
        x = (L.embed_rows(params["embed"], tokens)
             + jnp.take(params["pos_embed"], positions, axis=0, mode="clip"))
        if hook is not None:  # hook points (model_api.hook_points)
            x = hook("embed", x)
        for i, p in enumerate(params["layers"]):
            h = L.layer_norm(x, p["attn_norm"], p["attn_norm_bias"], eps, tile)
            q, k, v = ((L.dense(h, p[name], tile) + p[name + "_bias"]).reshape(b, t, heads,
                                                                               c.head_dim)
                       for name, heads in (("q", c.num_heads), ("k", c.num_kv_heads),
                                           ("v", c.num_kv_heads)))
            scale = 1.0 / math.sqrt(c.head_dim) if c.scale_attn_weights else 1.0
            if c.scale_attn_by_inverse_layer_idx:
                scale /= float(i + 1)
            attn = attend(i, q, k, v, None, scale)
            x = x + L.dense(attn.reshape(b, t, -1), p["o"], tile) + p["o_bias"]
            h = L.layer_norm(x, p["mlp_norm"], p["mlp_norm_bias"], eps, tile)
            x = x + L.dense(act(L.dense(h, p["fc"], tile) + p["fc_bias"]), p["proj"],
                            tile) + p["proj_bias"]
            if hook is not None:
                x = hook(f"resid.{i}", x)
        x = L.layer_norm(x, params["final_norm"], params["final_norm_bias"], eps, tile)
        if hook is not None:
            x = hook("final_norm", x)
        return x
