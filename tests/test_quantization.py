"""Weight-only int8 (contract §12 "Weight quantization", models/quantization.py): every linear
weight as int8 values with a scale per output channel, loaded for every family, close to the
float model, smaller, batch invariant with int8 operands (X1), sharded by the weights' rules,
through the CLI and its records, measured by `bench --quality`, and its bad values named."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwix

import jaxdecode as jd
from jaxdecode.replay import params_hash
import models
from models import quantization
from tests.conftest import HF_CHECKPOINTS
from tests.test_batch_invariance import PROBE_SP, _batch, _probe_logits, _prompt

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = sorted(set(HF_CHECKPOINTS) - {"llama_sharded"}) + ["demo"]


@functools.lru_cache(maxsize=None)
def _demo(q):
    return models.demo(quantization=q)


@pytest.fixture(scope="module")
def family(tiny_hf_checkpoint):
    """family(name, quantization) -> (model, params)."""
    def load(name, q):
        if name == "demo":
            return _demo(q)[:2]
        return models.load(tiny_hf_checkpoint(name), quantization=q)[:2]
    return load


def _linear_leaves(params):
    """(path, leaf) of every weight matrix the families multiply by (`quantization.LINEAR`)."""
    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(
            params, is_leaf=quantization.is_quantized)[0]:
        if str(getattr(path[-1], "key", "")) in quantization.LINEAR:
            out.append((jax.tree_util.keystr(path), leaf))
    return out


def _dequantized(params):
    """`params` with every QArray replaced by its float value (qwix.dequantize)."""
    return jax.tree.map(lambda w: qwix.dequantize(w) if quantization.is_quantized(w) else w,
                        params, is_leaf=quantization.is_quantized)


@pytest.mark.parametrize("name", FAMILIES)
def test_every_family_loads_int8_and_stays_close_to_float(family, name):
    """Contract §12: every linear weight is int8 with one scale per output channel (the tied
    embedding one per row); the int8 model's logits are those of the float model run on the
    dequantized weights (to 1e-5 of their range: only the order of float operations differs),
    and they differ from the float model's by at most 10% of the logit range. That bound: absmax
    rounding moves each weight by at most 1/254 of its channel's largest entry, which the tiny
    random models turn into 0.7-2.3% of the range, and 8.5% in Gemma 3 (the float model on
    dequantized weights shows the same, so it is the model's sensitivity, not the product: its
    final soft-cap of 3 shrinks the range the error is measured against)."""
    model, params = family(name, None)
    qmodel, qparams = family(name, "int8")
    linear = _linear_leaves(qparams)
    assert linear and all(quantization.is_quantized(w) for _, w in linear)
    for path, w in linear:
        assert w.qvalue.dtype == jnp.int8, path
        assert w.scale.shape == (1, w.shape[1]), path     # one scale per output column
    if model.config.tie_word_embeddings:                   # the head is the embedding
        embed = qparams["embed"]
        assert quantization.is_quantized(embed) and embed.scale.shape == (embed.shape[0], 1)
    tokens = jnp.asarray([_prompt(np.random.default_rng(0), model.config.vocab_size, 12, 12)])
    want = np.asarray(model.logits(params, tokens))
    got = np.asarray(qmodel.logits(qparams, tokens))
    fake = np.asarray(model.logits(_dequantized(qparams), tokens))
    span = np.ptp(want)
    assert np.max(np.abs(got - fake)) <= 1e-5 * span
    err = np.max(np.abs(got - want))
    assert 0 < err <= 0.10 * span, f"{name}: max |int8 - float| {err:.3g}, range {span:.3g}"


def test_parameter_bytes_at_most_040_of_float32():
    """Where the linear weights dominate (here 88% of the float parameters), int8 weights with
    f32 scales take at most 0.40x the float32 bytes (the float embedding stays)."""
    model = models.Llama(models.LlamaConfig(vocab_size=256, num_layers=2, num_heads=4,
                                            num_kv_heads=4, head_dim=32, max_len=64,
                                            hidden_size=128, intermediate_size=512))
    params = model.init_params(jax.random.key(0))
    qparams = models.quantize_params(params, "int8", tied=False)
    ratio = quantization.param_bytes(qparams) / quantization.param_bytes(params)
    assert ratio <= 0.40, ratio
    assert quantization.is_quantized(qparams["lm_head"])
    assert not quantization.is_quantized(qparams["embed"])   # untied: the lookup stays float


@pytest.mark.parametrize("name", ["llama", "demo"])
def test_int8_batch_invariance_probe_alone_and_in_a_batch_of_7(family, name):
    """X1 with int8 operands: a probe row's logits after the prefill and after the on-device
    loop are bitwise equal alone and in a batch of 7 (two row tiles, the second ragged)."""
    model, params = family(name, "int8")
    rng = np.random.default_rng(41)
    vocab = model.config.vocab_size
    probe = _prompt(rng, vocab, 1, 9)
    ref = None
    for size in (1, 7):
        prompts, settings_, slot = _batch(rng, vocab, probe, size)
        settings_[slot] = PROBE_SP
        logits, tokens = _probe_logits(model, params, prompts, settings_, slot)
        if ref is None:
            ref = logits, tokens
            continue
        for a, b in zip(ref[0], logits):
            assert np.array_equal(a, b), f"{name}: max |diff| {np.max(np.abs(a - b)):.3g}"
        assert tokens == ref[1]


def test_int8_demo_greedy_tokens_follow_the_float_model():
    """Greedy decoding of the int8 demo model starts as the float model's does (its first 8
    tokens; the quality section measures agreement over a prompt set)."""
    model, params, tokenizer = _demo(None)
    qmodel, qparams, _ = _demo("int8")
    prompt = tokenizer.encode("def fibonacci(n):").ids
    sp = jd.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    want = jd.generate(model, params, [prompt], sp).tokens(0)
    assert jd.generate(qmodel, qparams, [prompt], sp).tokens(0) == want


@pytest.mark.parametrize("value", ["int4", "fp8", "INT8", 8, True])
def test_bad_quantization_names_the_field(tiny_hf_checkpoint, value):
    with pytest.raises(ValueError, match="quantization"):
        models.demo(quantization=value)
    with pytest.raises(ValueError, match="quantization"):
        models.load(tiny_hf_checkpoint("llama"), quantization=value)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "jaxdecode.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))


def test_cli_generate_int8_records_the_quantization_and_replay_rebuilds_it(tmp_path):
    """`generate --quantization int8` on the demo model writes a record that pins "int8", and
    its replay loads int8 weights again: identical tokens, and the weights' hash (over the int8
    values and scales) matches the record's, so no "environment differs" line."""
    record = tmp_path / "int8.json"
    out = _cli("generate", "--prompt", "def add(a, b):", "--max-tokens", "8", "--temperature",
               "0", "--json", "--quantization", "int8", "--record", str(record))
    assert out.returncode == 0, out.stderr
    data = json.loads(record.read_text())
    assert data["model"]["quantization"] == "int8" and data["model"]["source"] == "demo"
    assert data["output"]["token_ids"] == json.loads(out.stdout)["token_ids"]
    _, qparams, _ = _demo("int8")
    assert data["model"]["hash"] == params_hash(qparams)
    again = _cli("replay", str(record))
    assert again.returncode == 0 and "identical" in again.stdout, again.stdout + again.stderr
    assert "environment differs" not in again.stdout


def test_cli_bad_quantization_names_the_flag():
    for command in ("generate", "serve", "bench"):
        out = _cli(command, "--quantization", "int4")
        assert out.returncode != 0 and "--quantization" in out.stderr, (command, out.stderr)


def test_bench_quality_section_runs_and_its_numbers_are_sane(tmp_path):
    """`bench --quality --quick`: finite held-out losses for float and int8 weights on the
    demo model's held-out text, the increase their difference, an agreement count in [0, 16];
    another bench flag beside it is named."""
    out_file = tmp_path / "quality.json"
    out = _cli("bench", "--quality", "--quick", "--json", str(out_file))
    assert out.returncode == 0, out.stderr
    report = json.loads(out_file.read_text())
    loss = report["loss_nats_per_token"]
    assert all(np.isfinite(v) and 0 < v < np.log(4096) for v in loss.values()), loss
    assert report["loss_increase"] == pytest.approx(loss["int8"] - loss["float"])
    assert set(loss) == {"float", "int8", "int8_kv", "int8_both"}   # the int8 KV cache too
    assert report["loss_increase_kv"] == pytest.approx(loss["int8_kv"] - loss["float"])
    assert report["loss_increase_both"] == pytest.approx(loss["int8_both"] - loss["float"])
    assert loss["int8_kv"] != loss["float"]   # the quantized keys and values were read
    for key in ("first_token_agreement", "first_token_agreement_kv",
                "first_token_agreement_both"):
        assert report["prompts"] == 16 and 0 <= report[key] <= 16
    assert report["held_out_tokens"] == 4096 and "first greedy token agrees" in out.stdout
    bad = _cli("bench", "--quality", "--batch", "4")
    assert bad.returncode != 0 and "--batch" in bad.stderr


SHARDED = """
import json
import jax, jax.numpy as jnp, numpy as np
import models
model, params, tokenizer = models.demo(quantization="int8")
mesh = models.make_mesh(1, 2)
sharded = models.shard_params(params, mesh)
q, o = sharded["layers"][0]["q"], sharded["layers"][0]["o"]
ids = jnp.asarray([tokenizer.encode("def f(x):").ids])
diff = np.max(np.abs(np.asarray(model.logits(params, ids))
                     - np.asarray(jax.jit(model.logits)(sharded, ids))))
print("RESULT" + json.dumps({"unmatched": models.sharding.unmatched(params),
    "q": [list(q.qvalue.sharding.spec), list(q.scale.sharding.spec)],
    "o": [list(o.qvalue.sharding.spec), list(o.scale.sharding.spec)], "diff": float(diff)}))
"""


def test_int8_weights_shard_by_their_weights_rules():
    """On a 1x2 mesh the int8 values and scales take their weight's rule (q column parallel,
    scale too; o row parallel, its [1, D] scale whole), and the sharded model's logits are the
    unsharded ones up to the order of the partial sums (float32 rounding)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT),
               XLA_FLAGS=(os.environ.get("XLA_FLAGS", "")
                          + " --xla_force_host_platform_device_count=2").strip())
    proc = subprocess.run([sys.executable, "-c", SHARDED], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads([x for x in proc.stdout.splitlines() if x.startswith("RESULT")][-1][6:])
    assert r["unmatched"] == []
    assert r["q"] == [[None, "model"], [None, "model"]] and r["o"] == [["model"], []]
    assert r["diff"] <= 1e-4
