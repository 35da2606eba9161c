"""Sliding-window attention reads only its window (models/layers.py `window_span`): the same bits
as attention over the whole cache -- so batch invariance, chunked prefill and the prefix cache
keep their exactness -- on contiguous and paged caches, with less work at long contexts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdecode as jd
from models import Llama, LlamaConfig, layers
from tests.host_fixtures import byte_level_from_table

WINDOW = 100


@pytest.mark.parametrize("t", [1, 3, 64])  # elementwise (T x G <= 8) and block products
def test_window_read_equals_whole_cache_bitwise(t):
    b, h, kvh, d, s = 3, 4, 2, 8, 1024
    rng = np.random.default_rng(t)
    q = jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(b, kvh, s, d)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(b, kvh, s, d)), jnp.float32)
    first = jnp.asarray([0, 517 - t, 1000 - t], jnp.int32)  # from the start, mid-block, the end
    q_pos = first[:, None] + jnp.arange(t, dtype=jnp.int32)
    whole = layers.attention(q, k, v, q_pos, jnp.arange(s, dtype=jnp.int32), WINDOW)
    index = (layers.window_start(q_pos, jnp.full((b,), t), WINDOW)[:, None]
             + jnp.arange(layers.window_span(t, WINDOW), dtype=jnp.int32))
    at = jnp.minimum(index, s - 1)[:, None, :, None]
    kw, vw = jnp.take_along_axis(k, at, axis=2), jnp.take_along_axis(v, at, axis=2)
    assert kw.shape[2] < s
    windowed = layers.attention(q, kw, vw, q_pos, index, WINDOW)
    np.testing.assert_array_equal(np.asarray(windowed), np.asarray(whole))


@pytest.fixture(scope="module")
def windowed_model():
    cfg = LlamaConfig(vocab_size=256, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                      max_len=1024, hidden_size=32, intermediate_size=48, eos_token_ids=(),
                      sliding_window=WINDOW)
    model = Llama(cfg)
    return model, model.init_params(jax.random.key(0), scale=0.3)


PROMPT_LENS = (700, 300, 5)


def _prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(3, 256, size=n).tolist() for n in PROMPT_LENS]


def test_windowed_model_reads_its_window_with_the_same_bits(windowed_model, monkeypatch):
    model, params = windowed_model
    sp = jd.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
    spans = []
    real_span = layers.window_span
    monkeypatch.setattr(layers, "window_span", lambda t, w: spans.append(t) or real_span(t, w))
    jax.clear_caches()
    windowed = jd.generate(model, params, _prompts(), sp)
    assert spans, "the window read was not used"
    monkeypatch.setattr(layers, "window_span", lambda t, w: 1 << 30)  # never narrower: whole cache
    jax.clear_caches()
    whole = jd.generate(model, params, _prompts(), sp)
    np.testing.assert_array_equal(windowed.token_ids, whole.token_ids)
    np.testing.assert_array_equal(np.asarray(windowed.logprobs), np.asarray(whole.logprobs))
    jax.clear_caches()


def test_sampling_X1_windowed_paged_engine_in_chunks_equals_generate(windowed_model):
    model, params = windowed_model
    sp = jd.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1,
                           utf8_errors="replace")
    want = jd.generate(model, params, _prompts(), sp)
    with jd.LLM(model, params, byte_level_from_table({}), max_slots=4, max_len=1024,
                prefill_chunk=128) as llm:
        got = llm.generate(_prompts(), sp)
    for r, c in enumerate(got):
        assert list(c.token_ids) == want.tokens(r), r
        assert [e.logprob for e in c.logprobs] == np.asarray(want.logprobs)[r, :6].tolist(), r
