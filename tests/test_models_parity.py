"""Parity of models/ (loaded through models.load) with HF transformers PyTorch fp32 on CPU.

Tiny random checkpoints come from the `tiny_hf_checkpoint` fixture (tests/conftest.py).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdecode as jd
import models

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

FAMILIES = ["llama", "llama3", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "gpt2",
            "mixtral", "qwen3_moe", "llama_sharded"]
PROMPTS = ["the quick brown fox", "hello world this is a test"]
BUCKET = 16      # prompt bucket (T of the prefill call)
MAX_LEN = 32     # cache length
NEW_TOKENS = 10


@pytest.fixture(autouse=True)
def _full_f32_matmuls():
    # Accelerators may default to reduced-precision f32 matmuls (TF32); parity wants full f32.
    with jax.default_matmul_precision("highest"):
        yield


@functools.partial(jax.jit, static_argnums=0)
def _forward(model, params, tokens, positions, cache, lengths):
    return model.forward(params, tokens, positions, cache, lengths=lengths)


@functools.lru_cache(maxsize=None)
def _hf_model(path):
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()
    return m


def _load(tiny_hf_checkpoint, name):
    path = tiny_hf_checkpoint(name)
    model, params, tok = models.load(path)
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    return path, model, params, prompts


def _batch(prompts):
    tokens = np.zeros((len(prompts), BUCKET), np.int32)
    for b, p in enumerate(prompts):
        tokens[b, :len(p)] = p
    positions = np.broadcast_to(np.arange(BUCKET, dtype=np.int32), tokens.shape)
    lengths = np.array([len(p) for p in prompts], np.int32)
    return jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(lengths)


@pytest.mark.parametrize("name", FAMILIES)
def test_prefill_logits_match_hf(tiny_hf_checkpoint, name):
    path, model, params, prompts = _load(tiny_hf_checkpoint, name)
    lens = [len(p) for p in prompts]
    assert lens[0] != lens[1] and min(lens) > 4, lens  # ragged, longer than Mistral's window
    tokens, positions, lengths = _batch(prompts)
    cache = model.init_cache(2, MAX_LEN, jnp.float32)
    logits, cache = _forward(model, params, tokens, positions, cache, lengths)
    assert logits.shape == (2, BUCKET, model.config.vocab_size) and logits.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(cache.lengths), lens)

    hf = _hf_model(str(path))
    for b, p in enumerate(prompts):
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0].numpy()
        np.testing.assert_allclose(np.asarray(logits[b, :len(p)]), ref, atol=1e-4, rtol=1e-4,
                                   err_msg=f"{name} prompt {b}")


@pytest.mark.parametrize("name", [f for f in FAMILIES if f != "llama_sharded"])
def test_greedy_tokens_match_hf_generate(tiny_hf_checkpoint, name):
    path, model, params, prompts = _load(tiny_hf_checkpoint, name)
    tokens, positions, lengths = _batch(prompts)
    cache = model.init_cache(2, MAX_LEN, jnp.float32)
    logits, cache = _forward(model, params, tokens, positions, cache, lengths)
    nxt = jnp.argmax(logits[jnp.arange(2), lengths - 1], -1).astype(jnp.int32)
    ours = [nxt]
    for _ in range(NEW_TOKENS - 1):
        pos = cache.lengths[:, None]
        logits, cache = _forward(model, params, nxt[:, None], pos, cache, jnp.ones(2, jnp.int32))
        nxt = jnp.argmax(logits[:, 0], -1).astype(jnp.int32)
        ours.append(nxt)
    ours = np.stack([np.asarray(t) for t in ours], 1)
    np.testing.assert_array_equal(np.asarray(cache.lengths),
                                  np.asarray(lengths) + NEW_TOKENS - 1)

    via_generate = jd.generate(model, params, prompts,
                               jd.SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS,
                                                 ignore_eos=True))
    np.testing.assert_array_equal(via_generate.token_ids, ours)

    hf = _hf_model(str(path))
    hf.generation_config.eos_token_id = None   # never stop early
    hf.generation_config.pad_token_id = 0
    for b, p in enumerate(prompts):
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=0)
        ref = out[0, len(p):].tolist()
        assert len(ref) == NEW_TOKENS
        assert ours[b].tolist() == ref, f"{name} prompt {b}: ours {ours[b].tolist()} hf {ref}"


def test_mistral_sliding_window_matters(tiny_hf_checkpoint):
    """The mistral fixture's window changes HF's logits, so the parity above checks it."""
    path = tiny_hf_checkpoint("mistral")
    model, _, tok = models.load(path)
    assert model.config.sliding_window == 4
    ids = torch.tensor([tok(PROMPTS[0], add_special_tokens=False)["input_ids"]])
    hf = _hf_model(str(path))
    full = transformers.AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager", sliding_window=None).eval()
    with torch.no_grad():
        diff = (hf(ids).logits - full(ids).logits).abs().max().item()
    assert diff > 1e-2


@pytest.mark.parametrize("name,override", [
    ("gemma2", {"attn_logit_softcapping": None}), ("gemma2", {"final_logit_softcapping": None}),
    ("gemma3", {"sliding_window": 64}), ("phi3", {"sliding_window": None}),
    ("mixtral", {"num_experts_per_tok": 1}), ("qwen3_moe", {"norm_topk_prob": True}),
], ids=["gemma2-attn-softcap", "gemma2-final-softcap", "gemma3-window", "phi3-window",
        "mixtral-top-k", "qwen3_moe-norm-topk"])
def test_fixture_features_matter(tiny_hf_checkpoint, name, override):
    """Each feature the new fixtures configure changes HF's logits on the parity prompt, so the
    parity above checks it."""
    path = tiny_hf_checkpoint(name)
    _, _, tok = models.load(path)
    ids = torch.tensor([tok(PROMPTS[1], add_special_tokens=False)["input_ids"]])
    other = transformers.AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager", **override).eval()
    with torch.no_grad():
        diff = (_hf_model(str(path))(ids).logits - other(ids).logits).abs().max().item()
    assert diff > 1e-2


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_moe_gather_dispatch_equals_dense(tiny_hf_checkpoint, name):
    """The "gather" dispatch form (models/moe.py) computes what the default "dense" one does:
    prefill logits within 1e-5, the same routing (a dense layer between sparse ones for
    Qwen3-MoE, the top 2 of 4 experts renormalised for Mixtral only), the same greedy tokens."""
    _, model, params, prompts = _load(tiny_hf_checkpoint, name)
    c = model.config
    assert c.num_experts == 4 and c.num_experts_per_tok == 2 and c.dispatch == "dense"
    assert c.norm_topk_prob == (name == "mixtral")
    assert c.sparse_layers == (() if name == "mixtral" else (True, False, True))
    gather = dataclasses.replace(model, config=dataclasses.replace(c, dispatch="gather"))
    tokens, positions, lengths = _batch(prompts)
    dense, _ = _forward(model, params, tokens, positions, model.init_cache(2, MAX_LEN), lengths)
    other, _ = _forward(gather, params, tokens, positions, gather.init_cache(2, MAX_LEN), lengths)
    for b, p in enumerate(prompts):
        np.testing.assert_allclose(np.asarray(other[b, :len(p)]), np.asarray(dense[b, :len(p)]),
                                   atol=1e-5, rtol=1e-5)
    sp = jd.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    np.testing.assert_array_equal(jd.generate(gather, params, prompts, sp).token_ids,
                                  jd.generate(model, params, prompts, sp).token_ids)


def test_load_config_fields(tiny_hf_checkpoint):
    llama, params, tok = models.load(tiny_hf_checkpoint("llama"))
    c = llama.config
    assert isinstance(llama, models.Llama) and hash(llama) == hash(llama)
    assert (c.vocab_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.max_len) == \
        (128, 2, 4, 2, 8, 64)
    assert c.eos_token_ids == (3, 2)          # generation_config's [3, 2] merged with config's 2
    assert c.rope_scaling == () and not c.attention_bias and c.sliding_window is None
    assert params["embed"].dtype == jnp.float32
    assert tok.eos_token_id == 2

    llama3, _, _ = models.load(tiny_hf_checkpoint("llama3"))
    assert llama3.config.rope_scaling_dict["rope_type"] == "llama3"
    assert llama3.config.rope_theta == 500000.0
    qwen, qparams, _ = models.load(tiny_hf_checkpoint("qwen2"))
    assert qwen.config.attention_bias and qwen.config.tie_word_embeddings
    assert qwen.config.sliding_window is None and "lm_head" not in qparams
    assert float(jnp.abs(qparams["layers"][0]["q_bias"]).max()) > 0
    qwen3, q3params, _ = models.load(tiny_hf_checkpoint("qwen3"))
    assert qwen3.config.qk_norm and not qwen3.config.attention_bias
    assert qwen3.config.head_dim == 16 and q3params["layers"][1]["k_norm"].shape == (16,)
    gemma2, g2params, _ = models.load(tiny_hf_checkpoint("gemma2"))
    g2 = gemma2.config
    assert isinstance(gemma2, models.Gemma) and "lm_head" not in g2params
    assert g2.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    assert (g2.sliding_window, g2.query_pre_attn_scalar, g2.attn_logit_softcapping,
            g2.final_logit_softcapping, g2.rope_local_theta, g2.qk_norm) == (4, 12, 2, 3, None,
                                                                             False)
    gemma3, _, _ = models.load(tiny_hf_checkpoint("gemma3"))
    g3 = gemma3.config
    assert g3.qk_norm and g3.rope_local_theta == 10.0 and g3.rope_theta == 100000.0
    assert dict(g3.rope_scaling)["factor"] == 4.0 and g3.attn_logit_softcapping is None
    assert g3.layer_types == ("sliding_attention", "sliding_attention", "full_attention")
    phi3, _, _ = models.load(tiny_hf_checkpoint("phi3"))
    assert phi3.config.max_len == 64     # capped at original_max_position_embeddings
    assert phi3.config.rope_scaling_dict["factor"] == 2.0 and phi3.config.sliding_window == 6
    gpt2, gparams, _ = models.load(tiny_hf_checkpoint("gpt2"))
    assert isinstance(gpt2, models.GPT2) and gpt2.config.max_len == 64
    assert gpt2.config.eos_token_ids == (2,) and gparams["pos_embed"].shape == (64, 32)


def test_sharded_equals_single_file(tiny_hf_checkpoint):
    path = tiny_hf_checkpoint("llama_sharded")
    assert len(list(path.glob("model-*.safetensors"))) > 2
    model_a, a, _ = models.load(path)
    model_b, b, _ = models.load(tiny_hf_checkpoint("llama"))
    assert model_a.config.num_layers == model_b.config.num_layers
    jax.tree.map(np.testing.assert_array_equal, a, b)


def test_dtype_handling(tiny_hf_checkpoint, tmp_path):
    path = tiny_hf_checkpoint("llama")
    _, p32, _ = models.load(path)
    _, p16, _ = models.load(path, dtype=jnp.bfloat16)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(p16))
    # A bf16 checkpoint keeps bf16 with dtype=None, and holds the fp32 values rounded.
    hf = _hf_model(str(path))
    hf16 = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16)
    hf16.save_pretrained(tmp_path, safe_serialization=True)
    del hf
    _, pb, _ = models.load(tmp_path)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(pb))
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x, np.float32),
                                                            np.asarray(y, np.float32)), pb, p16)


# -- error cases ----------------------------------------------------------------------------------

def _copy(tiny_hf_checkpoint, name, tmp_path):
    dst = tmp_path / name
    shutil.copytree(tiny_hf_checkpoint(name), dst)
    return dst


def test_missing_shard_names_the_file(tiny_hf_checkpoint, tmp_path):
    path = _copy(tiny_hf_checkpoint, "llama_sharded", tmp_path)
    shard = sorted(path.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(ValueError, match=shard.name):
        models.load(path)


def _rewrite(file, edit):
    from safetensors.numpy import load_file, save_file
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def test_wrong_shape_names_file_and_tensor(tiny_hf_checkpoint, tmp_path):
    path = _copy(tiny_hf_checkpoint, "llama", tmp_path)
    name = "model.layers.1.mlp.up_proj.weight"

    def edit(t):
        t[name] = t[name][:, :-1].copy()
    _rewrite(path / "model.safetensors", edit)
    with pytest.raises(models.CheckpointError) as e:
        models.load(path)
    assert name in str(e.value) and "model.safetensors" in str(e.value)

    gpath = _copy(tiny_hf_checkpoint, "gpt2", tmp_path)
    gname = "transformer.h.0.attn.c_attn.weight"

    def gedit(t):
        t[gname] = t[gname].T.copy()   # [out, in] instead of Conv1D's [in, out]
    _rewrite(gpath / "model.safetensors", gedit)
    with pytest.raises(ValueError, match=gname.replace(".", r"\.")):
        models.load(gpath)


def test_missing_tensor_names_it(tiny_hf_checkpoint, tmp_path):
    path = _copy(tiny_hf_checkpoint, "mistral", tmp_path)
    name = "model.layers.0.self_attn.k_proj.weight"
    _rewrite(path / "model.safetensors", lambda t: t.pop(name))
    with pytest.raises(ValueError, match=name.replace(".", r"\.")) as e:
        models.load(path)
    assert "model.safetensors" in str(e.value)


def test_unknown_architecture_names_config(tiny_hf_checkpoint, tmp_path):
    path = _copy(tiny_hf_checkpoint, "llama", tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["FalconForCausalLM"], "falcon"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="FalconForCausalLM") as e:
        models.load(path)
    assert "config.json" in str(e.value)


def test_old_config_keys(tiny_hf_checkpoint, tmp_path):
    """transformers 4.x keys (rope_theta + rope_scaling, torch_dtype) read like 5.x's."""
    new, _, _ = models.load(tiny_hf_checkpoint("llama3"))
    path = _copy(tiny_hf_checkpoint, "llama3", tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = rope
    cfg["torch_dtype"] = cfg.pop("dtype")
    cfg["eos_token_id"] = [2, 5]
    (path / "config.json").write_text(json.dumps(cfg))
    (path / "generation_config.json").unlink()
    old, _, _ = models.load(path)
    assert old.config == dataclasses.replace(new.config, eos_token_ids=(2, 5))

    qpath = _copy(tiny_hf_checkpoint, "qwen2", tmp_path)
    cfg = json.loads((qpath / "config.json").read_text())
    cfg["sliding_window"] = 4     # ignored: use_sliding_window is false
    (qpath / "config.json").write_text(json.dumps(cfg))
    assert models.load(qpath)[0].config.sliding_window is None


def test_models_package_does_not_import_torch():
    code = ("import sys, models, models.hf, models.gpt2, models.checkpoint; "
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=str(Path(__file__).parents[1]))


@pytest.mark.parametrize("name", [f for f in FAMILIES if f != "llama_sharded"])
def test_consistency_O3_every_family(tiny_hf_checkpoint, name):
    _, model, params, prompts = _load(tiny_hf_checkpoint, name)
    continuation = prompts[1][:6]
    err = jd.assert_incremental_consistency(model, params, prompts[0], continuation)
    assert err < 1e-4
    # the no-cache path (training, full recompute) agrees with the cached protocol path
    full = np.asarray(model.logits(params, jnp.asarray([prompts[0] + continuation], jnp.int32)))
    tokens, positions, lengths = _batch([prompts[0] + continuation])
    cached, _ = _forward(model, params, tokens, positions,
                         model.init_cache(1, MAX_LEN, jnp.float32), lengths)
    n = len(prompts[0]) + len(continuation)
    np.testing.assert_allclose(np.asarray(cached[0, :n]), full[0], atol=1e-4, rtol=1e-4)
