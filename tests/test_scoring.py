"""`jd.score` / `jd.score_padded` (contract R2, R3): the sampler's raw logprobs for the same
tokens on every family, a row's scores independent of the other rows, gradients that match
finite differences, bad input refused naming the argument."""

from __future__ import annotations

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdecode as jd
import models
from jaxdecode.host.detokenizer.vocab import vocab_info
from tests.conftest import HF_CHECKPOINTS

FAMILIES = ["demo"] + [name for name in HF_CHECKPOINTS if name != "llama_sharded"]
TOLERANCE = 2e-5
SAMPLED = jd.SamplingParams(temperature=0.9, seed=11, max_tokens=9, logprobs=1)


@functools.lru_cache(maxsize=None)
def _demo():
    return models.demo()


@pytest.fixture(scope="module")
def family(tiny_hf_checkpoint):
    def load(name):
        return _demo() if name == "demo" else models.load(tiny_hf_checkpoint(name))
    return load


def _prompts(vocab: int, seed: int) -> list:
    """Three prompts whose rows (prompt + 9 tokens) all read at most 16 tokens: one bucket,
    one scoring program per family."""
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, n).tolist() for n in (2, 4, 7)]


@pytest.mark.parametrize("name", FAMILIES)
def test_score_R2_equals_generate_logprobs_in_a_batch(family, name):
    model, params, _ = family(name)
    prompts = _prompts(model.config.vocab_size, FAMILIES.index(name))
    out = jd.generate(model, params, prompts, SAMPLED)
    completions = [out.tokens(r) for r in range(len(prompts))]
    scores = jd.score(model, params, prompts, completions)
    for r, c in enumerate(completions):
        assert scores[r].dtype == np.float32 and scores[r].shape == (len(c),)
        np.testing.assert_allclose(scores[r], out.logprobs[r, :len(c)], rtol=0, atol=TOLERANCE)


@pytest.mark.parametrize("name", FAMILIES)
def test_score_R2_equals_engine_logprobs(family, name):
    """The engine's per-token logprobs (three requests decoded side by side, over the paged
    pool) are scored back, on every family."""
    model, params, tokenizer = family(name)
    # Engine requests are detokenized: draw from the ids the tokenizer knows (the model's
    # vocabulary may be padded past it), seeded by the name so new families shift nothing.
    vocab = min(model.config.vocab_size, vocab_info(tokenizer).vocab_size)
    prompts = _prompts(vocab, 50 + zlib.crc32(name.encode()) % 1000)
    with jd.LLM(model, params, tokenizer, max_slots=4, max_len=64) as llm:
        handles = [llm.submit(p, SAMPLED) for p in prompts]
        done = [h.result(timeout=120) for h in handles]
    completions = [list(c.token_ids[:len(c.logprobs)]) for c in done]
    assert all(completions)
    for r, scored in enumerate(jd.score(model, params, prompts, completions)):
        np.testing.assert_allclose(scored, [e.logprob for e in done[r].logprobs], rtol=0,
                                   atol=TOLERANCE)


def test_score_R3_a_row_is_bitwise_the_same_alone_and_beside_others(family):
    """Rows of two buckets and a batch of five: each row's scores equal its own call's bits,
    and the padded form's values are the list form's."""
    model, params, _ = family("demo")
    rng = np.random.default_rng(3)
    vocab = model.config.vocab_size
    prompts = [rng.integers(3, vocab, n).tolist() for n in (3, 5, 20, 4, 6)]
    completions = [rng.integers(3, vocab, n).tolist() for n in (6, 9, 14, 1, 10)]
    together = jd.score(model, params, prompts, completions)
    padded, mask = jd.score_padded(model, params, prompts, completions)
    assert mask.sum(1).tolist() == [len(c) for c in completions]
    for r in range(len(prompts)):
        alone = jd.score(model, params, [prompts[r]], [completions[r]])[0]
        assert np.array_equal(alone, together[r]), r
        assert np.array_equal(np.asarray(padded)[r, mask[r]], together[r])
        assert not np.asarray(padded)[r, ~mask[r]].any()
    swapped = jd.score(model, params, prompts[::-1], completions[::-1])[::-1]
    assert all(np.array_equal(a, b) for a, b in zip(swapped, together))


def _tiny():
    config = models.LlamaConfig(vocab_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                                head_dim=8, max_len=64, hidden_size=16, intermediate_size=24)
    model = models.Llama(config)
    return model, model.init_params(jax.random.key(0), scale=0.3)


def test_score_R2_gradients_are_finite_and_match_finite_differences():
    model, params = _tiny()
    prompts, completions = [[1, 2, 3], [4, 5]], [[7, 8, 9, 10], [11, 3, 30]]

    def loss(p):
        logprobs, mask = jd.score_padded(model, p, prompts, completions)
        return jnp.sum(jnp.where(mask, logprobs, 0.0) * jnp.arange(1.0, 1.0 + mask.shape[1]))

    value, grad = jax.jit(jax.value_and_grad(loss))(params)
    plain = jd.score(model, params, prompts, completions, batch_invariant=False)
    for a, b in zip(plain, jd.score(model, params, prompts, completions)):
        np.testing.assert_allclose(a, b, rtol=0, atol=TOLERANCE)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grad))
    assert value == pytest.approx(float(loss(params)), abs=1e-4)
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    direction = jax.tree.unflatten(tree, [jax.random.normal(k, x.shape, x.dtype)
                                          for k, x in zip(keys, leaves)])
    eps = 1e-3  # central differences: off by 5% at 1e-2, by 0.03% at 1e-3
    shifted = lambda s: jax.tree.map(lambda p, d: p + s * eps * d, params, direction)  # noqa
    numeric = (float(loss(shifted(1.0))) - float(loss(shifted(-1.0)))) / (2 * eps)
    analytic = float(sum(jnp.vdot(g, d) for g, d in
                         zip(jax.tree.leaves(grad), jax.tree.leaves(direction))))
    assert abs(analytic) > 1e-2  # the check can fail
    assert analytic == pytest.approx(numeric, rel=5e-3)


@pytest.mark.parametrize("prompts,completions,field", [
    ([[1, 2]], [[]], "completions"),
    ([[1, 2]], [[3, 32]], "completions"),
    ([[1, -1]], [[3]], "prompts"),
    ([[1, 2], [3]], [[4]], "completions"),
    ([[]], [[4]], "prompts"),
    ([[1] * 60], [[2] * 10], "completions"),
])
def test_score_bad_input_names_the_argument(prompts, completions, field):
    model, params = _tiny()
    with pytest.raises(ValueError, match=f"^{field}"):
        jd.score(model, params, prompts, completions)
