"""The Llama family (Llama 2/3, Mistral, Qwen2) as one batched, pure Flax-free JAX model.

Differences between the members are config flags: `attention_bias` (Qwen2's q/k/v biases),
`sliding_window` (Mistral when configured), `rope_scaling` (Llama 3's `llama3` rope type),
`tie_word_embeddings`. Layers are unrolled in Python: on CPU this beats `lax.scan` for decode.

Params pytree:
    embed [V, D]; final_norm [D]; lm_head [D, V] (absent when tied);
    layers: list of {attn_norm [D], q [D, H*hd], k [D, KVH*hd], v [D, KVH*hd], o [H*hd, D],
                     (q_bias, k_bias, v_bias when attention_bias), mlp_norm [D],
                     gate [D, F], up [D, F], down [F, D]}
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp

from jaxdecode.model_api import ModelConfig
from models import layers as L

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class LlamaConfig(ModelConfig):
    hidden_size: int = 512
    intermediate_size: int = 1376
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: tuple = ()          # sorted (key, value) items of HF's rope_scaling dict
    attention_bias: bool = False
    sliding_window: Optional[int] = None
    tie_word_embeddings: bool = False

    @property
    def rope_scaling_dict(self) -> Optional[dict]:
        return dict(self.rope_scaling) if self.rope_scaling else None


@dataclasses.dataclass(frozen=True)
class Llama(L.CachedDecoder):
    """Implements `jaxdecode.model_api.DecoderModel`."""

    config: LlamaConfig

    def init_params(self, key: Array, dtype: Any = jnp.float32, scale: float = 0.02) -> dict:
        """Random parameters (normal * scale, norms at 1): for tests, benchmarks and training."""
        c = self.config
        d, hd, f = c.hidden_size, c.head_dim, c.intermediate_size
        shapes = {"q": (d, c.num_heads * hd), "k": (d, c.num_kv_heads * hd),
                  "v": (d, c.num_kv_heads * hd), "o": (c.num_heads * hd, d),
                  "gate": (d, f), "up": (d, f), "down": (f, d)}
        keys = iter(jax.random.split(key, 2 + c.num_layers * len(shapes)))

        def normal(shape):
            return (scale * jax.random.normal(next(keys), shape, jnp.float32)).astype(dtype)

        layers = []
        for _ in range(c.num_layers):
            layer = {name: normal(shape) for name, shape in shapes.items()}
            layer["attn_norm"] = jnp.ones((d,), dtype)
            layer["mlp_norm"] = jnp.ones((d,), dtype)
            if c.attention_bias:
                layer["q_bias"] = jnp.zeros((c.num_heads * hd,), dtype)
                layer["k_bias"] = jnp.zeros((c.num_kv_heads * hd,), dtype)
                layer["v_bias"] = jnp.zeros((c.num_kv_heads * hd,), dtype)
            layers.append(layer)
        params = {"embed": normal((c.vocab_size, d)), "layers": layers,
                  "final_norm": jnp.ones((d,), dtype)}
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
        inv_freq = L.rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling_dict)
        x = params["embed"][tokens]
        if hook is not None:  # hook points (model_api.hook_points)
            x = hook("embed", x)
        for i, p in enumerate(params["layers"]):
            h = L.rms_norm(x, p["attn_norm"], c.rms_norm_eps, tile)
            q, k, v = (L.dense(h, p[name], tile) for name in ("q", "k", "v"))
            if c.attention_bias:
                q, k, v = q + p["q_bias"], k + p["k_bias"], v + p["v_bias"]
            q = L.apply_rope(q.reshape(b, t, c.num_heads, c.head_dim), positions, inv_freq)
            k = L.apply_rope(k.reshape(b, t, c.num_kv_heads, c.head_dim), positions, inv_freq)
            v = v.reshape(b, t, c.num_kv_heads, c.head_dim)
            attn = attend(i, q, k, v, c.sliding_window)
            x = x + L.dense(attn.reshape(b, t, -1), p["o"], tile)
            h = L.rms_norm(x, p["mlp_norm"], c.rms_norm_eps, tile)
            mlp = jax.nn.silu(L.dense(h, p["gate"], tile)) * L.dense(h, p["up"], tile)
            x = x + L.dense(mlp, p["down"], tile)
            if hook is not None:
                x = hook(f"resid.{i}", x)
        x = L.rms_norm(x, params["final_norm"], c.rms_norm_eps, tile)
        if hook is not None:
            x = hook("final_norm", x)
        return x
