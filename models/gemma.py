"""The Gemma family (Gemma 2, Gemma 3 text) as one batched, pure JAX model.

Differences from Llama: the embedding scaled by sqrt(hidden_size) in the embedding dtype;
RMSNorm with (1 + weight) (`layers.rms_norm_plus_one`); a GeGLU MLP (tanh GELU); norms before
and after both attention and the MLP; attention scores scaled by `query_pre_attn_scalar`**-0.5
and soft-capped (`attn_logit_softcapping`), final logits soft-capped (`final_logit_softcapping`,
in `CachedDecoder._head`); sliding-window layers among global ones (`layer_types`); tied
embeddings. Gemma 3 adds per-head q/k norms (`qk_norm`) and a rope base of its own for the
sliding layers (`rope_local_theta`, without scaling) while `rope_scaling` applies to the global
layers.

Params pytree:
    embed [V, D]; final_norm [D]; lm_head [D, V] (absent when tied);
    layers: list of {attn_norm [D], q [D, H*hd], k [D, KVH*hd], v [D, KVH*hd], o [H*hd, D],
                     post_attn_norm [D], mlp_norm [D], post_mlp_norm [D],
                     gate [D, F], up [D, F], down [F, D], (q_norm [hd], k_norm [hd]: qk_norm)}
Norm weights are stored as HF stores them (the scale is 1 + weight).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import jax
import jax.numpy as jnp

from jaxdecode.model_api import ModelConfig
from models import layers as L

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class GemmaConfig(ModelConfig):
    hidden_size: int = 512
    intermediate_size: int = 1376
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple = ()          # global layers: sorted items of HF's rope scaling dict
    rope_local_theta: Optional[float] = None   # sliding layers' base (Gemma 3); None: rope_theta
    query_pre_attn_scalar: float = 256.0
    attn_logit_softcapping: Optional[float] = None
    final_logit_softcapping: Optional[float] = None
    layer_types: tuple = ()           # per layer "sliding_attention" / "full_attention"
    sliding_window: Optional[int] = None
    qk_norm: bool = False             # Gemma 3
    tie_word_embeddings: bool = True

    def __post_init__(self):
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types: {len(self.layer_types)} entries for "
                             f"{self.num_layers} layers")
        unknown = set(self.layer_types) - {"sliding_attention", "full_attention"}
        if unknown:
            raise ValueError(f"layer_types: unsupported {sorted(unknown)}")


@dataclasses.dataclass(frozen=True)
class Gemma(L.CachedDecoder):
    """Implements `jaxdecode.model_api.DecoderModel` (Gemma 2 and Gemma 3 text)."""

    config: GemmaConfig

    def init_params(self, key: Array, dtype: Any = jnp.float32, scale: float = 0.02) -> dict:
        """Random parameters (normal * scale, norm weights 0: a scale of 1)."""
        return L.random_decoder_params(self.config, key, dtype, scale, (
            "attn_norm", "post_attn_norm", "mlp_norm", "post_mlp_norm"), 0.0)

    # -- internals ----------------------------------------------------------------------------

    def _run(self, params: dict, tokens: Array, positions: Array, attend, tile,
             hook=None) -> Array:
        c = self.config
        b, t = tokens.shape
        norm = lambda x, w: L.rms_norm_plus_one(x, w, c.rms_norm_eps, tile)  # noqa: E731
        windows = L.layer_windows(c.layer_types, c.sliding_window)
        global_freq = L.rope_inv_freq(c.head_dim, c.rope_theta, dict(c.rope_scaling) or None)
        local_freq = (global_freq if c.rope_local_theta is None
                      else L.rope_inv_freq(c.head_dim, c.rope_local_theta, None))
        scale = c.query_pre_attn_scalar ** -0.5
        embed = params["embed"]
        x = L.embed_rows(embed, tokens) * jnp.asarray(math.sqrt(c.hidden_size), embed.dtype)
        if hook is not None:  # hook points (model_api.hook_points)
            x = hook("embed", x)
        for i, p in enumerate(params["layers"]):
            inv_freq = global_freq if windows[i] is None else local_freq
            h = norm(x, p["attn_norm"])
            q, k, v = (L.dense(h, p[name], tile) for name in ("q", "k", "v"))
            q = q.reshape(b, t, c.num_heads, c.head_dim)
            k = k.reshape(b, t, c.num_kv_heads, c.head_dim)
            if c.qk_norm:
                q = L.qk_norm(q, p["q_norm"], c.rms_norm_eps, tile, plus_one=True)
                k = L.qk_norm(k, p["k_norm"], c.rms_norm_eps, tile, plus_one=True)
            q = L.apply_rope(q, positions, inv_freq)
            k = L.apply_rope(k, positions, inv_freq)
            v = v.reshape(b, t, c.num_kv_heads, c.head_dim)
            attn = attend(i, q, k, v, windows[i], scale, c.attn_logit_softcapping)
            x = x + norm(L.dense(attn.reshape(b, t, -1), p["o"], tile), p["post_attn_norm"])
            h = norm(x, p["mlp_norm"])
            mlp = (jax.nn.gelu(L.dense(h, p["gate"], tile), approximate=True)
                   * L.dense(h, p["up"], tile))
            x = x + norm(L.dense(mlp, p["down"], tile), p["post_mlp_norm"])
            if hook is not None:
                x = hook(f"resid.{i}", x)
        x = norm(x, params["final_norm"])
        if hook is not None:
            x = hook("final_norm", x)
        return x
