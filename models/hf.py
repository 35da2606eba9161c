"""Load a local Hugging Face checkpoint directory as (model, params, tokenizer), with no network.

Reads `config.json` (old and transformers-5 keys: `rope_scaling`/`rope_theta` or
`rope_parameters`, `torch_dtype` or `dtype`), `generation_config.json` (EOS ids),
`model.safetensors` or a sharded `model.safetensors.index.json`, and the tokenizer files.
Tensors are read lazily, one at a time, with `safetensors.safe_open(framework="numpy")` (bf16
and fp8 through ml_dtypes): no torch, no flax import. safetensors' numpy reader looks fp8 dtypes
up as `numpy.float8_e4m3fn` / `numpy.float8_e5m2`, which numpy itself lacks (safetensors issue
#682), so `_register_fp8` names ml_dtypes' types there once (only where numpy has none).

Every problem with the directory raises `CheckpointError` (a `ValueError`) whose message names
the file and, where there is one, the tensor.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Optional

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open

from models import layers as L
from models import quantization as quantize
from models.gemma import Gemma, GemmaConfig
from models.gpt2 import ACTIVATIONS, GPT2, GPT2Config
from models.llama import Llama, LlamaConfig
from models.moe import Moe, MoeConfig


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded; the message names the file (and tensor)."""


# architecture class name -> family; model_type -> family
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "GPT2LMHeadModel": "gpt2",
}
MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
               "phi3": "phi3", "gemma2": "gemma2", "gemma3_text": "gemma3", "gpt2": "gpt2",
               "mixtral": "mixtral", "qwen3_moe": "qwen3_moe"}

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


# -- public entry point ---------------------------------------------------------------------------

def load(path: str | os.PathLike, dtype: Any = None, quantization: Optional[str] = None):
    """Load `path` (a local HF checkpoint directory) as `(model, params, tokenizer)`.

    dtype=None keeps each tensor's checkpoint dtype; otherwise floating tensors are cast to it.
    `quantization` "int8": int8 linear weights, quantized one by one on the way to the device
    (models/quantization.py, contract §12); None: float. The tokenizer is a `transformers`
    tokenizer loaded from local files only, or None when the directory holds no tokenizer files.
    """
    quantize.check(quantization)
    root = Path(path).expanduser()
    if not root.is_dir():
        raise CheckpointError(f"{root}: not a checkpoint directory")
    config_file = root / "config.json"
    config = _read_json(config_file, required=True)
    family = _family(config, config_file)
    gen_config = _read_json(root / "generation_config.json", required=False) or {}
    eos = _eos_ids(gen_config.get("eos_token_id"), config.get("eos_token_id"))

    with _TensorIndex(root) as tensors:
        if family == "gpt2":
            model = GPT2(_gpt2_config(config, config_file, eos))
            params = _gpt2_params(model.config, tensors, dtype)
        elif family in ("gemma2", "gemma3"):
            model = Gemma(_gemma_config(config, config_file, family, eos))
            params = _gemma_params(model.config, tensors, dtype)
        elif family in ("mixtral", "qwen3_moe"):
            model = Moe(_moe_config(config, config_file, family, eos))
            params = _llama_params(model.config, tensors, dtype)
        else:
            model = Llama(_llama_config(config, config_file, family, eos))
            params = _llama_params(model.config, tensors, dtype)
    params = quantize.to_device(params, quantization, model.config.tie_word_embeddings)
    return model, params, _load_tokenizer(root)


# -- config.json ----------------------------------------------------------------------------------

def _read_json(file: Path, required: bool) -> Optional[dict]:
    if not file.exists():
        if required:
            raise CheckpointError(f"{file}: file not found")
        return None
    try:
        with open(file, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{file}: cannot read JSON ({e})") from e


def _family(config: dict, config_file: Path) -> str:
    archs = config.get("architectures") or []
    for arch in archs:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    model_type = config.get("model_type")
    causal = all(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs)
    if model_type in MODEL_TYPES and causal:
        return MODEL_TYPES[model_type]
    raise CheckpointError(
        f"{config_file}: unsupported architecture {archs or None!r} (model_type {model_type!r}); "
        f"supported: {', '.join(ARCHITECTURES)} (model_type {', '.join(MODEL_TYPES)})")


def _ids(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


def _eos_ids(*values) -> tuple[int, ...]:
    out: list[int] = []
    for v in values:
        for i in _ids(v):
            if i not in out:
                out.append(i)
    return tuple(out)


def _hashable(v):
    if isinstance(v, list):
        return tuple(_hashable(x) for x in v)
    if isinstance(v, dict):
        return tuple(sorted((k, _hashable(x)) for k, x in v.items()))
    return v


def _rope(config: dict, config_file: Path, head_dim: int) -> tuple[float, tuple]:
    """(rope_theta, sorted rope_scaling items) from old (`rope_theta`, `rope_scaling`) or
    transformers-5 (`rope_parameters`) keys; the default rope type gives ()."""
    params = config.get("rope_parameters") or {}
    if params and all(isinstance(v, dict) for v in params.values()):  # per layer type
        if "full_attention" not in params:
            raise CheckpointError(f"{config_file}: unsupported rope_parameters {params!r}")
        params = params["full_attention"]
    scaling = config.get("rope_scaling")
    if scaling is None:
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    theta = config.get("rope_theta")
    if theta is None:
        theta = params.get("rope_theta", (scaling or {}).get("rope_theta", 10000.0))
    scaling = {k: v for k, v in (scaling or {}).items() if k != "rope_theta"}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in (None, "default"):
        return float(theta), ()
    try:
        L.rope_inv_freq(head_dim, float(theta), scaling)
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{config_file}: rope scaling {scaling!r}: {e}") from e
    return float(theta), _hashable(scaling)


def _llama_config(config: dict, config_file: Path, family: str, eos) -> LlamaConfig:
    def need(key):
        if config.get(key) is None:
            raise CheckpointError(f"{config_file}: missing {key!r}")
        return config[key]

    hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
    head_dim = int(config.get("head_dim") or hidden // heads)
    act = config.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise CheckpointError(f"{config_file}: unsupported hidden_act {act!r} (only silu)")
    if config.get("mlp_bias"):
        raise CheckpointError(f"{config_file}: mlp_bias=true is not supported")
    if family == "qwen2":
        bias = True  # Qwen2 always has q/k/v biases (and no o bias)
    elif family in ("qwen3", "qwen3_moe"):
        if config.get("attention_bias"):
            raise CheckpointError(f"{config_file}: attention_bias=true is not supported for "
                                  f"{family}")
        bias = False
    else:
        if config.get("attention_bias"):
            raise CheckpointError(f"{config_file}: attention_bias=true (with an o_proj bias) is "
                                  f"not supported for {family}")
        bias = False
    window = _sliding_window(config, config_file, family)
    theta, scaling = _rope(config, config_file, head_dim)
    max_len = int(config.get("max_position_embeddings") or 2048)
    if dict(scaling).get("rope_type", dict(scaling).get("type")) in ("longrope", "su"):
        scaling, max_len = _longrope(config, config_file, dict(scaling), max_len)
    return LlamaConfig(
        vocab_size=int(need("vocab_size")),
        num_layers=int(need("num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        max_len=max_len,
        eos_token_ids=eos,
        hidden_size=hidden,
        intermediate_size=int(need("intermediate_size")),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        attention_bias=bias,
        sliding_window=window,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        qk_norm=family in ("qwen3", "qwen3_moe"),
    )


def _moe_config(config: dict, config_file: Path, family: str, eos) -> MoeConfig:
    """Mixtral / Qwen3-MoE: Llama's config plus the experts (`num_local_experts` or
    `num_experts`, `num_experts_per_tok`), Qwen3-MoE's `moe_intermediate_size`,
    `norm_topk_prob` and dense layers (`mlp_only_layers`, `decoder_sparse_step`)."""
    base = _llama_config(config, config_file, family, eos)
    experts = config.get("num_local_experts", config.get("num_experts"))
    if not experts or not config.get("num_experts_per_tok"):
        raise CheckpointError(f"{config_file}: missing 'num_experts' / 'num_experts_per_tok'")
    if config.get("shared_expert_intermediate_size"):
        raise CheckpointError(f"{config_file}: shared experts are not supported")
    n, step = base.num_layers, int(config.get("decoder_sparse_step") or 1)
    dense = set(config.get("mlp_only_layers") or ())
    sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(n))
    try:
        return MoeConfig(
            **{f.name: getattr(base, f.name) for f in dataclasses.fields(base)},
            num_experts=int(experts), num_experts_per_tok=int(config["num_experts_per_tok"]),
            moe_intermediate_size=int(config.get("moe_intermediate_size")
                                      or base.intermediate_size),
            norm_topk_prob=family == "mixtral" or bool(config.get("norm_topk_prob", False)),
            sparse_layers=() if all(sparse) else sparse)
    except ValueError as e:
        raise CheckpointError(f"{config_file}: {e}") from e


def _longrope(config: dict, config_file: Path, scaling: dict, max_len: int):
    """Phi-3's longrope (`su`): its `factor` (by default max_position_embeddings / original, as
    HF) fixes the cos/sin scale, and the model's max_len is capped at
    `original_max_position_embeddings`, where HF switches from the short to the long factors
    (the long factors, past that length, are not supported)."""
    original = scaling.get("original_max_position_embeddings",
                           config.get("original_max_position_embeddings"))
    if original is None:
        raise CheckpointError(f"{config_file}: longrope needs original_max_position_embeddings")
    if float(scaling.get("partial_rotary_factor") or config.get("partial_rotary_factor")
             or 1.0) != 1.0:
        raise CheckpointError(f"{config_file}: partial_rotary_factor != 1 is not supported")
    scaling = dict(scaling, original_max_position_embeddings=int(original))
    if scaling.get("factor") is None:
        scaling["factor"] = max_len / int(original)
    return _hashable(scaling), min(max_len, int(original))


def _gemma_config(config: dict, config_file: Path, family: str, eos) -> GemmaConfig:
    """Gemma 2 / Gemma 3 text; Gemma 3's local rope base from `rope_parameters`'
    "sliding_attention" (transformers 5) or `rope_local_base_freq` (4.x), without scaling."""
    def need(key):
        if config.get(key) is None:
            raise CheckpointError(f"{config_file}: missing {key!r}")
        return config[key]

    hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
    head_dim = int(config.get("head_dim") or hidden // heads)
    n = int(need("num_hidden_layers"))
    act = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise CheckpointError(f"{config_file}: unsupported hidden_activation {act!r} "
                              "(only gelu_pytorch_tanh)")
    if config.get("attention_bias"):
        raise CheckpointError(f"{config_file}: attention_bias=true is not supported for {family}")
    pattern = 2 if family == "gemma2" else int(config.get("sliding_window_pattern") or 6)
    types = tuple(config.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)])
    theta, scaling = _rope(config, config_file, head_dim)
    local = None
    if family == "gemma3":
        per_type = config.get("rope_parameters") or {}
        sliding = per_type.get("sliding_attention") if isinstance(
            per_type.get("sliding_attention"), dict) else {}
        if sliding.get("rope_type", "default") != "default":
            raise CheckpointError(f"{config_file}: rope scaling on sliding layers "
                                  f"({sliding!r}) is not supported")
        local = float(sliding.get("rope_theta", config.get("rope_local_base_freq", 10000.0)))
    window = config.get("sliding_window")
    softcap = lambda key: None if config.get(key) is None else float(config[key])  # noqa: E731
    try:
        return GemmaConfig(
            vocab_size=int(need("vocab_size")), num_layers=n, num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads), head_dim=head_dim,
            max_len=int(config.get("max_position_embeddings") or 8192), eos_token_ids=eos,
            hidden_size=hidden, intermediate_size=int(need("intermediate_size")),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)), rope_theta=theta,
            rope_scaling=scaling, rope_local_theta=local,
            query_pre_attn_scalar=float(config.get("query_pre_attn_scalar") or head_dim),
            attn_logit_softcapping=softcap("attn_logit_softcapping"),
            final_logit_softcapping=softcap("final_logit_softcapping"),
            layer_types=types, sliding_window=None if window is None else int(window),
            qk_norm=family == "gemma3",
            tie_word_embeddings=bool(config.get("tie_word_embeddings", True)))
    except ValueError as e:
        raise CheckpointError(f"{config_file}: {e}") from e


def _sliding_window(config: dict, config_file: Path, family: str) -> Optional[int]:
    if family == "llama":
        return None
    window = config.get("sliding_window")
    if family in ("qwen2", "qwen3", "qwen3_moe"):
        if not config.get("use_sliding_window", False) or window is None:
            return None
        n = int(config["num_hidden_layers"])
        types = config.get("layer_types") or [
            "sliding_attention" if i >= int(config.get("max_window_layers", n)) else
            "full_attention" for i in range(n)]
        if all(t == "full_attention" for t in types):
            return None
        if not all(t == "sliding_attention" for t in types):
            raise CheckpointError(f"{config_file}: sliding window on only some layers "
                                  f"(layer_types {types}) is not supported")
    return int(window) if window is not None else None


def _gpt2_config(config: dict, config_file: Path, eos) -> GPT2Config:
    def need(*keys):
        for k in keys:
            if config.get(k) is not None:
                return config[k]
        raise CheckpointError(f"{config_file}: missing {keys[0]!r}")

    hidden, heads = int(need("n_embd", "hidden_size")), int(need("n_head", "num_attention_heads"))
    act = config.get("activation_function", "gelu_new")
    if act not in ACTIVATIONS:
        raise CheckpointError(f"{config_file}: unsupported activation_function {act!r}")
    return GPT2Config(
        vocab_size=int(need("vocab_size")),
        num_layers=int(need("n_layer", "num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden // heads,
        max_len=int(need("n_positions", "n_ctx", "max_position_embeddings")),
        eos_token_ids=eos,
        hidden_size=hidden,
        intermediate_size=int(config.get("n_inner") or 4 * hidden),
        layer_norm_eps=float(config.get("layer_norm_epsilon", 1e-5)),
        activation=act,
        scale_attn_weights=bool(config.get("scale_attn_weights", True)),
        scale_attn_by_inverse_layer_idx=bool(config.get("scale_attn_by_inverse_layer_idx", False)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
    )


# -- safetensors ----------------------------------------------------------------------------------

def _register_fp8() -> None:
    """Let safetensors' numpy reader build fp8 arrays: it resolves F8_E4M3 / F8_E5M2 as
    attributes of numpy, which has none; ml_dtypes' types are the ones jax uses."""
    for name in ("float8_e4m3fn", "float8_e5m2"):
        if not hasattr(np, name):
            setattr(np, name, getattr(ml_dtypes, name))


_register_fp8()

class _TensorIndex:
    """Name -> file over `model.safetensors` or its sharded index; tensors are read one at a time
    through `safetensors.safe_open` (memory-mapped by the library, nothing read before `get`).
    Use as a context manager: the files are closed on exit."""

    def __init__(self, root: Path):
        self.root = root
        single, index = root / "model.safetensors", root / "model.safetensors.index.json"
        self.where: dict[str, Path] = {}
        self.files: dict[Path, Any] = {}  # open safe_open handles
        self.names: dict[Path, set] = {}  # the tensors each opened file holds
        if index.exists():
            weight_map = (_read_json(index, required=True) or {}).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index}: no 'weight_map'")
            by_file: dict[str, list[str]] = {}
            for name, file in weight_map.items():
                by_file.setdefault(file, []).append(name)
            for file, names in by_file.items():
                shard = root / file
                if not shard.exists():
                    raise CheckpointError(
                        f"{shard}: shard file listed in {index.name} is missing "
                        f"(it holds {len(names)} tensors, e.g. {sorted(names)[0]!r})")
                for name in names:
                    self.where[name] = shard
            self.description = f"{index} (and its shards)"
        elif single.exists():
            self._open(single)
            self.where = dict.fromkeys(self.names[single], single)
            self.description = str(single)
        else:
            raise CheckpointError(f"{root}: no model.safetensors or model.safetensors.index.json")

    def _open(self, file: Path):
        if file not in self.files:
            try:
                self.files[file] = safe_open(str(file), framework="numpy")
            except (OSError, SafetensorError) as e:  # bad header, truncated, unreadable
                raise CheckpointError(f"{file}: not a readable safetensors file ({e})") from e
            self.names[file] = set(self.files[file].keys())
        return self.files[file]

    def __enter__(self) -> "_TensorIndex":
        return self

    def __exit__(self, *exc) -> None:
        for handle in self.files.values():
            handle.__exit__(None, None, None)
        self.files.clear()

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in self.where:
            raise CheckpointError(f"{self.description}: missing tensor {name!r}")
        file = self.where[name]
        handle = self._open(file)
        if name not in self.names[file]:
            raise CheckpointError(f"{file}: missing tensor {name!r} (listed in the index)")
        view = handle.get_slice(name)
        got = tuple(view.get_shape())
        if got != tuple(shape):
            raise CheckpointError(f"{file}: tensor {name!r} has shape {list(got)}, "
                                  f"expected {list(shape)} from config.json")
        try:
            return handle.get_tensor(name)
        except (AttributeError, TypeError, ValueError, SafetensorError) as e:
            # a dtype numpy cannot hold (none that checkpoints use today)
            raise CheckpointError(f"{file}: tensor {name!r} has dtype {view.get_dtype()}, which "
                                  f"cannot be read with numpy ({type(e).__name__}: {e})") from e


def _host(a: np.ndarray, dtype: Any) -> np.ndarray:
    """A tensor on the host, cast to `dtype`; `quantize.to_device` places the tree."""
    if dtype is not None and jnp.issubdtype(a.dtype, jnp.floating):
        a = a.astype(jnp.dtype(dtype))
    return np.ascontiguousarray(a)


def _llama_params(c: LlamaConfig, t: _TensorIndex, dtype) -> dict:
    """Llama-layout tensors; Phi-3's fused `qkv_proj` and `gate_up_proj` (found by name) are
    split here into q/k/v and gate/up (rows in that order), one tensor read each."""
    d, hd, f = c.hidden_size, c.head_dim, c.intermediate_size
    qd, kvd = c.num_heads * hd, c.num_kv_heads * hd

    def get(name, shape, transpose=False):
        a = t.get(name, shape)
        return _host(a.T if transpose else a, dtype)

    def split(name, shape, sizes):
        a = t.get(name, shape)
        cuts = np.cumsum(sizes)[:-1]
        return [_host(part.T, dtype) for part in np.split(a, cuts, axis=0)]

    layers = []
    for i in range(c.num_layers):
        pre = f"model.layers.{i}."
        attn, mlp = pre + "self_attn.", pre + "mlp."
        if attn + "qkv_proj.weight" in t:
            q, k, v = split(attn + "qkv_proj.weight", (qd + 2 * kvd, d), (qd, kvd, kvd))
        else:
            q, k, v = (get(attn + n + "_proj.weight", (size, d), True)
                       for n, size in (("q", qd), ("k", kvd), ("v", kvd)))
        if isinstance(c, MoeConfig) and c.is_sparse(i):
            gate, up = None, None
        elif mlp + "gate_up_proj.weight" in t:
            gate, up = split(mlp + "gate_up_proj.weight", (2 * f, d), (f, f))
        else:
            gate, up = (get(mlp + n + "_proj.weight", (f, d), True) for n in ("gate", "up"))
        layer = {
            "attn_norm": get(pre + "input_layernorm.weight", (d,)),
            "q": q, "k": k, "v": v,
            "o": get(attn + "o_proj.weight", (d, qd), True),
            "mlp_norm": get(pre + "post_attention_layernorm.weight", (d,)),
        }
        if gate is None:
            layer.update(_experts(c, t, pre, get, dtype))
        else:
            layer.update(gate=gate, up=up, down=get(mlp + "down_proj.weight", (d, f), True))
        if c.attention_bias:
            layer["q_bias"] = get(pre + "self_attn.q_proj.bias", (qd,))
            layer["k_bias"] = get(pre + "self_attn.k_proj.bias", (kvd,))
            layer["v_bias"] = get(pre + "self_attn.v_proj.bias", (kvd,))
        if c.qk_norm:
            layer.update(_qk_norms(get, pre, hd))
        layers.append(layer)
    return _decoder_params(c, get, layers)


def _experts(c: MoeConfig, t: _TensorIndex, pre: str, get, dtype) -> dict:
    """A sparse layer's router [D, E] and experts stacked as [E, D, F] (gate, up) and
    [E, F, D] (down), from Mixtral's `block_sparse_moe.experts.{e}.w1/w3/w2`, Qwen3-MoE's
    `mlp.experts.{e}.gate_proj/up_proj/down_proj` or fused `mlp.experts.gate_up_proj`
    [E, 2F, D] and `mlp.experts.down_proj` [E, D, F]; one tensor read at a time."""
    d, e, f = c.hidden_size, c.num_experts, c.moe_intermediate_size
    moe = pre + ("block_sparse_moe." if pre + "block_sparse_moe.gate.weight" in t else "mlp.")
    out = {"router": get(moe + "gate.weight", (e, d), True)}
    fused = moe + "experts.gate_up_proj"
    if fused in t:
        gate_up = t.get(fused, (e, 2 * f, d)).transpose(0, 2, 1)
        out.update(experts_gate=_host(gate_up[..., :f], dtype),
                   experts_up=_host(gate_up[..., f:], dtype),
                   experts_down=_host(t.get(moe + "experts.down_proj", (e, d, f))
                                      .transpose(0, 2, 1), dtype))
        return out
    names = ("w1", "w3", "w2") if moe + "experts.0.w1.weight" in t else (
        "gate_proj", "up_proj", "down_proj")
    for key, name, shape in zip(("experts_gate", "experts_up", "experts_down"), names,
                                ((f, d), (f, d), (d, f))):
        out[key] = np.stack([get(f"{moe}experts.{j}.{name}.weight", shape, True)
                             for j in range(e)])
    return out


def _qk_norms(get, pre: str, hd: int) -> dict:
    """Qwen3 / Gemma 3 per-head q and k norm weights of the layer at `pre`."""
    return {"q_norm": get(pre + "self_attn.q_norm.weight", (hd,)),
            "k_norm": get(pre + "self_attn.k_norm.weight", (hd,))}


def _decoder_params(c: Any, get, layers: list) -> dict:
    """A Llama-layout checkpoint's parameters around its `layers`: the embedding, the final
    norm and, unless tied, the output head."""
    d = c.hidden_size
    params = {"embed": get("model.embed_tokens.weight", (c.vocab_size, d)), "layers": layers,
              "final_norm": get("model.norm.weight", (d,))}
    if not c.tie_word_embeddings:
        params["lm_head"] = get("lm_head.weight", (c.vocab_size, d), True)
    return params


def _gemma_params(c: GemmaConfig, t: _TensorIndex, dtype) -> dict:
    d, hd, f = c.hidden_size, c.head_dim, c.intermediate_size
    qd, kvd = c.num_heads * hd, c.num_kv_heads * hd

    def get(name, shape, transpose=False):
        a = t.get(name, shape)
        return _host(a.T if transpose else a, dtype)

    layers = []
    for i in range(c.num_layers):
        pre = f"model.layers.{i}."
        layer = {
            "attn_norm": get(pre + "input_layernorm.weight", (d,)),
            "q": get(pre + "self_attn.q_proj.weight", (qd, d), True),
            "k": get(pre + "self_attn.k_proj.weight", (kvd, d), True),
            "v": get(pre + "self_attn.v_proj.weight", (kvd, d), True),
            "o": get(pre + "self_attn.o_proj.weight", (d, qd), True),
            "post_attn_norm": get(pre + "post_attention_layernorm.weight", (d,)),
            "mlp_norm": get(pre + "pre_feedforward_layernorm.weight", (d,)),
            "post_mlp_norm": get(pre + "post_feedforward_layernorm.weight", (d,)),
            "gate": get(pre + "mlp.gate_proj.weight", (f, d), True),
            "up": get(pre + "mlp.up_proj.weight", (f, d), True),
            "down": get(pre + "mlp.down_proj.weight", (d, f), True),
        }
        if c.qk_norm:
            layer.update(_qk_norms(get, pre, hd))
        layers.append(layer)
    return _decoder_params(c, get, layers)


def _gpt2_params(c: GPT2Config, t: _TensorIndex, dtype) -> dict:
    d, f = c.hidden_size, c.intermediate_size
    pre = "transformer." if "transformer.wte.weight" in t else ""

    def get(name, shape):
        return t.get(pre + name, shape)

    def jx(a):
        return _host(a, dtype)

    layers = []
    for i in range(c.num_layers):
        h = f"h.{i}."
        w = get(h + "attn.c_attn.weight", (d, 3 * d))      # Conv1D: [in, out]
        b = get(h + "attn.c_attn.bias", (3 * d,))
        layers.append({
            "attn_norm": jx(get(h + "ln_1.weight", (d,))),
            "attn_norm_bias": jx(get(h + "ln_1.bias", (d,))),
            "q": jx(w[:, :d]), "k": jx(w[:, d:2 * d]), "v": jx(w[:, 2 * d:]),
            "q_bias": jx(b[:d]), "k_bias": jx(b[d:2 * d]), "v_bias": jx(b[2 * d:]),
            "o": jx(get(h + "attn.c_proj.weight", (d, d))),
            "o_bias": jx(get(h + "attn.c_proj.bias", (d,))),
            "mlp_norm": jx(get(h + "ln_2.weight", (d,))),
            "mlp_norm_bias": jx(get(h + "ln_2.bias", (d,))),
            "fc": jx(get(h + "mlp.c_fc.weight", (d, f))),
            "fc_bias": jx(get(h + "mlp.c_fc.bias", (f,))),
            "proj": jx(get(h + "mlp.c_proj.weight", (f, d))),
            "proj_bias": jx(get(h + "mlp.c_proj.bias", (d,))),
        })
    params = {"embed": jx(get("wte.weight", (c.vocab_size, d))),
              "pos_embed": jx(get("wpe.weight", (c.max_len, d))),
              "layers": layers,
              "final_norm": jx(get("ln_f.weight", (d,))),
              "final_norm_bias": jx(get("ln_f.bias", (d,)))}
    if not c.tie_word_embeddings:
        params["lm_head"] = jx(t.get("lm_head.weight", (c.vocab_size, d)).T)
    return params


# -- tokenizer ------------------------------------------------------------------------------------

def _load_tokenizer(root: Path):
    if not any((root / name).exists() for name in _TOKENIZER_FILES):
        return None
    # Imported here: transformers is heavy (and imports torch when it is installed).
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(str(root), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - report which directory failed, keep the cause
        raise CheckpointError(f"{root}: cannot load the tokenizer ({type(e).__name__}: {e})") from e
