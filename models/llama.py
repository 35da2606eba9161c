"""The Llama family (Llama 2/3, Mistral, Qwen2, Qwen3, Phi-3) as one batched, pure Flax-free
JAX model.

Differences between the members are config flags: `attention_bias` (Qwen2's q/k/v biases),
`sliding_window` (Mistral when configured), `rope_scaling` (Llama 3's `llama3` rope type, Phi-3's
`longrope`), Phi-3's fused qkv_proj / gate_up_proj split at load (models/hf.py),
`tie_word_embeddings`, `qk_norm` (Qwen3's per-head q/k RMSNorm before RoPE). Layers are
unrolled in Python: on CPU this beats `lax.scan` for decode.

Params pytree:
    embed [V, D]; final_norm [D]; lm_head [D, V] (absent when tied);
    layers: list of {attn_norm [D], q [D, H*hd], k [D, KVH*hd], v [D, KVH*hd], o [H*hd, D],
                     (q_bias, k_bias, v_bias when attention_bias),
                     (q_norm [hd], k_norm [hd] when qk_norm), mlp_norm [D],
                     gate [D, F], up [D, F], down [F, D]}
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp

from jaxdecode.model_api import ModelConfig
from models import layers as L
from models import lora as lora_lib

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
    qk_norm: bool = False             # Qwen3: RMSNorm over each q and k head before RoPE

    @property
    def rope_scaling_dict(self) -> Optional[dict]:
        return dict(self.rope_scaling) if self.rope_scaling else None


@dataclasses.dataclass(frozen=True)
class Llama(L.CachedDecoder):
    """Implements `jaxdecode.model_api.DecoderModel`."""

    config: LlamaConfig

    def init_params(self, key: Array, dtype: Any = jnp.float32, scale: float = 0.02) -> dict:
        """Random parameters (normal * scale, norms at 1): for tests, benchmarks and training."""
        return L.random_decoder_params(self.config, key, dtype, scale, ("attn_norm", "mlp_norm"),
                                       1.0, self.config.attention_bias)

    # -- internals ----------------------------------------------------------------------------

    def load_adapter(self, name: str, path: str, params: dict) -> dict:
        """A PEFT LoRA adapter for `params` (models/lora.py; the `model_api` adapter
        protocol)."""
        return lora_lib.load_adapter(name, path, params)

    def stack_adapters(self, adapters: list, params: dict, max_loras: int) -> dict:
        """`params["lora"]` holding `adapters` at indices 1.. (models/lora.py)."""
        return lora_lib.stack_adapters(adapters, params, max_loras)

    def _adapters(self, params: dict, adapters: Optional[Array], tiles) -> dict:
        rows = lora_lib.adapters_of(params, adapters, tiles)
        return {} if rows is None else {"lora": rows}

    def _run(self, params: dict, tokens: Array, positions: Array, attend, tile,
             hook=None, lora: Optional[lora_lib.RowAdapters] = None) -> Array:
        """The hidden states after the final norm, [B, T, D] (`CachedDecoder._head` maps them
        to logits); `lora`: the rows' adapters, added to each targeted projection."""
        c = self.config
        b, t = tokens.shape
        inv_freq = L.rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling_dict)
        rope_scale = L.rope_attention_factor(c.rope_scaling_dict)
        x = L.embed_rows(params["embed"], tokens)
        if hook is not None:  # hook points (model_api.hook_points)
            x = hook("embed", x)
        def proj(i: int, names: tuple, h: Array) -> list:
            """The projections `names` of one input h, with the rows' adapter deltas."""
            ys = {name: L.dense(h, params["layers"][i][name], tile) for name in names}
            ys = ys if lora is None else lora.apply(i, ys, h)
            return [ys[name] for name in names]

        for i, p in enumerate(params["layers"]):
            h = L.rms_norm(x, p["attn_norm"], c.rms_norm_eps, tile)
            q, k, v = proj(i, ("q", "k", "v"), h)
            if c.attention_bias:
                q, k, v = q + p["q_bias"], k + p["k_bias"], v + p["v_bias"]
            q = q.reshape(b, t, c.num_heads, c.head_dim)
            k = k.reshape(b, t, c.num_kv_heads, c.head_dim)
            if c.qk_norm:
                q = L.qk_norm(q, p["q_norm"], c.rms_norm_eps, tile)
                k = L.qk_norm(k, p["k_norm"], c.rms_norm_eps, tile)
            q = L.apply_rope(q, positions, inv_freq, rope_scale)
            k = L.apply_rope(k, positions, inv_freq, rope_scale)
            v = v.reshape(b, t, c.num_kv_heads, c.head_dim)
            attn = attend(i, q, k, v, c.sliding_window)
            x = x + proj(i, ("o",), attn.reshape(b, t, -1))[0]
            h = L.rms_norm(x, p["mlp_norm"], c.rms_norm_eps, tile)
            x = x + self._mlp(i, p, h, tile, proj)
            if hook is not None:
                x = hook(f"resid.{i}", x)
        x = L.rms_norm(x, params["final_norm"], c.rms_norm_eps, tile)
        if hook is not None:
            x = hook("final_norm", x)
        return x

    def _mlp(self, i: int, p: dict, h: Array, tile, proj) -> Array:
        """Layer `i`'s SwiGLU MLP of the normed h through `proj` (the projections with the rows'
        adapter deltas; models/moe.py overrides it)."""
        gate, up = proj(i, ("gate", "up"), h)
        return proj(i, ("down",), jax.nn.silu(gate) * up)[0]
