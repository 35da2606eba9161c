"""models.load reads safetensors through `safetensors.safe_open`, one tensor at a time: dtypes
kept (bf16, fp8), unused tensors never read, and errors that name the file (and the tensor).
Checkpoints are written here with `safetensors.numpy` (no torch); HF parity of the loaded
models is tests/test_models_parity.py."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

import models

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32,
          "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 2,
          "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 64,
          "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "eos_token_id": 2}


def _tensors(dtype) -> dict:
    """Random HF-named Llama tensors for CONFIG, in `dtype`."""
    c = CONFIG
    d, f, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    kv = d // c["num_attention_heads"] * c["num_key_value_heads"]
    shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,),
              "lm_head.weight": (v, d)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                       p + "self_attn.q_proj.weight": (d, d), p + "self_attn.k_proj.weight": (kv, d),
                       p + "self_attn.v_proj.weight": (kv, d), p + "self_attn.o_proj.weight": (d, d),
                       p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
                       p + "mlp.down_proj.weight": (d, f)})
    rng = np.random.default_rng(0)
    return {k: rng.standard_normal(s, np.float32).astype(dtype) for k, s in shapes.items()}


def _write(path, tensors) -> None:
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(CONFIG))
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def test_bf16_checkpoint_keeps_bf16_and_casts_on_request(tmp_path):
    tensors = _tensors(ml_dtypes.bfloat16)
    _write(tmp_path / "ck", tensors)
    model, params, tokenizer = models.load(tmp_path / "ck")
    assert tokenizer is None and model.config.num_layers == 2
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}
    # values are the checkpoint's, in the model's layout ([in, out] for projections)
    np.testing.assert_array_equal(np.asarray(params["layers"][1]["k"]),
                                  tensors["model.layers.1.self_attn.k_proj.weight"].T)
    np.testing.assert_array_equal(np.asarray(params["embed"]), tensors["model.embed_tokens.weight"])
    _, p32, _ = models.load(tmp_path / "ck", dtype=jnp.float32)
    assert {x.dtype for x in jax.tree.leaves(p32)} == {jnp.dtype(jnp.float32)}
    np.testing.assert_array_equal(np.asarray(p32["lm_head"]),
                                  tensors["lm_head.weight"].astype(np.float32).T)
    logits = model.logits(params, jnp.array([[1, 2, 3]], jnp.int32))
    assert logits.shape == (1, 3, 32) and bool(jnp.isfinite(logits).all())


def test_unused_tensors_are_never_read(tmp_path, monkeypatch):
    """Reading is per tensor: an extra tensor no model needs is never read, so a dtype the reader
    cannot build there does not stop the load."""
    tensors = _tensors(np.float32)
    tensors["model.extra.weight"] = np.ones((4, 4), ml_dtypes.float8_e4m3fn)
    _write(tmp_path / "ck", tensors)
    monkeypatch.delattr(np, "float8_e4m3fn")  # the extra tensor is now unreadable
    _, params, _ = models.load(tmp_path / "ck")
    np.testing.assert_array_equal(np.asarray(params["final_norm"]), tensors["model.norm.weight"])


@pytest.mark.parametrize("fp8", ["float8_e4m3fn", "float8_e5m2"])
def test_fp8_tensor_loads(tmp_path, fp8):
    tensors = _tensors(np.float32)
    name = "model.layers.0.mlp.up_proj.weight"
    tensors[name] = tensors[name].astype(getattr(ml_dtypes, fp8))
    _write(tmp_path / "ck", tensors)
    _, params, _ = models.load(tmp_path / "ck", dtype=jnp.float32)
    np.testing.assert_array_equal(np.asarray(params["layers"][0]["up"]),
                                  tensors[name].astype(np.float32).T)


def test_unreadable_dtype_names_file_tensor_and_dtype(tmp_path, monkeypatch):
    tensors = _tensors(np.float32)
    name = "model.layers.0.mlp.up_proj.weight"
    tensors[name] = tensors[name].astype(ml_dtypes.float8_e4m3fn)
    _write(tmp_path / "ck", tensors)
    monkeypatch.delattr(np, "float8_e4m3fn")  # as safetensors' reader sees numpy on its own
    with pytest.raises(models.CheckpointError) as e:
        models.load(tmp_path / "ck")
    file = tmp_path / "ck" / "model.safetensors"
    assert str(file) in str(e.value) and repr(name) in str(e.value) and "F8_E4M3" in str(e.value)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_malformed_file_names_it(tmp_path, damage):
    _write(tmp_path / "ck", _tensors(np.float32))
    file = tmp_path / "ck" / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes({"truncated": data[:-100], "garbage": b"not a safetensors file" * 4,
                      "empty": b""}[damage])
    with pytest.raises(models.CheckpointError, match="not a readable safetensors file") as e:
        models.load(tmp_path / "ck")
    assert str(file) in str(e.value)


def test_shard_errors_name_file_and_tensor(tmp_path):
    """A sharded checkpoint: a tensor the index lists but its shard lacks, and a malformed shard."""
    tensors = _tensors(np.float32)
    names = sorted(tensors)
    root = tmp_path / "ck"
    root.mkdir()
    (root / "config.json").write_text(json.dumps(CONFIG))
    half = len(names) // 2
    weight_map = {n: ("model-00001-of-00002.safetensors" if i < half
                      else "model-00002-of-00002.safetensors") for i, n in enumerate(names)}
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    missing = "model.layers.1.self_attn.q_proj.weight"
    for shard in set(weight_map.values()):
        save_file({n: tensors[n] for n in names if weight_map[n] == shard and n != missing},
                  str(root / shard))
    with pytest.raises(models.CheckpointError) as e:
        models.load(root)
    assert weight_map[missing] in str(e.value) and repr(missing) in str(e.value)
    assert "listed in the index" in str(e.value)
    (root / weight_map[missing]).write_bytes(b"\x00" * 7)
    with pytest.raises(models.CheckpointError, match=weight_map[missing]):
        models.load(root)
