"""models.save_params / models.restore_params (orbax) round trips."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from models import GPT2, GPT2Config, Llama, LlamaConfig

CFG = LlamaConfig(vocab_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, max_len=32,
                  hidden_size=32, intermediate_size=48, attention_bias=True)


def _assert_same(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.shape == y.shape and x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


def test_round_trip_llama_params(tmp_path):
    params = Llama(CFG).init_params(jax.random.key(0))
    path = models.save_params(tmp_path / "ckpt", params)
    assert path.is_absolute() and path.exists()
    restored = models.restore_params(tmp_path / "ckpt", like=params)
    assert isinstance(restored["layers"], list) and len(restored["layers"]) == 2
    _assert_same(params, restored)


def test_round_trip_bf16_and_gpt2(tmp_path):
    model = GPT2(GPT2Config(vocab_size=64, num_layers=1, num_heads=2, num_kv_heads=2, head_dim=8,
                            max_len=16, hidden_size=16, intermediate_size=32))
    params = model.init_params(jax.random.key(1), dtype=jnp.bfloat16)
    models.save_params(str(tmp_path / "g"), params)
    restored = models.restore_params(str(tmp_path / "g"), like=params)
    _assert_same(params, restored)
    assert restored["embed"].dtype == jnp.bfloat16


def test_relative_path_and_overwrite(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first = Llama(CFG).init_params(jax.random.key(0))
    second = Llama(CFG).init_params(jax.random.key(1))
    models.save_params("rel_ckpt", first)
    models.save_params("rel_ckpt", second)          # overwrite allowed
    assert (tmp_path / "rel_ckpt").exists()
    restored = models.restore_params("rel_ckpt", like=first)
    _assert_same(second, restored)
    with pytest.raises(AssertionError):
        _assert_same(first, restored)


def test_restore_without_like_and_restored_params_run(tmp_path):
    model = Llama(CFG)
    params = model.init_params(jax.random.key(2))
    models.save_params(tmp_path / "c", params)
    raw = models.restore_params(tmp_path / "c")
    np.testing.assert_array_equal(np.asarray(raw["embed"]), np.asarray(params["embed"]))
    restored = models.restore_params(tmp_path / "c", like=params)
    tokens = jnp.array([[1, 2, 3]], jnp.int32)
    np.testing.assert_array_equal(np.asarray(model.logits(restored, tokens)),
                                  np.asarray(model.logits(params, tokens)))


def test_restore_errors(tmp_path):
    params = Llama(CFG).init_params(jax.random.key(0))
    with pytest.raises(FileNotFoundError):
        models.restore_params(tmp_path / "nope", like=params)
    models.save_params(tmp_path / "c", params)
    bigger = Llama(LlamaConfig(**{**CFG.__dict__, "vocab_size": 80})).init_params(jax.random.key(0))
    with pytest.raises(ValueError, match="embed"):
        models.restore_params(tmp_path / "c", like=bigger)
    fewer = {k: v for k, v in params.items() if k != "lm_head"}
    with pytest.raises(ValueError, match="lm_head"):
        models.restore_params(tmp_path / "c", like=fewer)
