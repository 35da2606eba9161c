"""Parallel sampling (`SamplingParams.n`) in the device core: one prefill, n adjacent rows,
sample 0 keyed by the request key, sample i >= 1 by fold_in(request key, i) (contract X1:
reproducible from the seed; sample 0 is the request with n = 1)."""

import dataclasses

import jax
import numpy as np
import pytest

import jaxdecode as jd
from jaxdecode.device import decode
from models import Llama, LlamaConfig


@pytest.fixture(scope="module")
def tiny():
    cfg = LlamaConfig(vocab_size=96, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                      max_len=128, hidden_size=32, intermediate_size=64, eos_token_ids=(1,))
    model = Llama(cfg)
    return model, model.init_params(jax.random.key(0), scale=0.3)


def test_n_rows_adjacent_distinct_and_reproducible(tiny):
    model, params = tiny
    prompts = [[5, 6, 7], [30, 31, 32, 33]]
    rows = [jd.SamplingParams(n=3, seed=11, max_tokens=12, ignore_eos=True),
            jd.SamplingParams(seed=5, max_tokens=12, ignore_eos=True)]
    out = jd.generate(model, params, prompts, rows)
    assert out.token_ids.shape[0] == 4 and len(out.finish_reasons) == 4
    samples = [out.tokens(i) for i in range(3)]
    assert len({tuple(s) for s in samples}) == 3          # different keys, different samples
    again = jd.generate(model, params, prompts, rows)
    np.testing.assert_array_equal(out.token_ids, again.token_ids)
    # the n == 1 request is unchanged by its neighbour's n, and equals it run alone
    alone = jd.generate(model, params, [prompts[1]], rows[1])
    assert out.tokens(3) == alone.tokens(0)


def test_n_sample_keys_fold_in_the_index(tiny):
    model, params = tiny
    sp = jd.SamplingParams(n=3, seed=7, max_tokens=4)
    state, rows_sp, _ = decode.prepare(model, params, [[5, 6]], sp, None, None)
    assert len(rows_sp) == 3
    base = jax.random.key(7)
    want = np.stack([jax.random.key_data(base)]
                    + [jax.random.key_data(jax.random.fold_in(base, i)) for i in (1, 2)])
    np.testing.assert_array_equal(np.asarray(state.rows.keys), want)


def test_n_sample_0_is_the_request_alone(tiny):
    model, params = tiny
    sp = jd.SamplingParams(seed=21, max_tokens=10, ignore_eos=True)
    alone = jd.generate(model, params, [[5, 6, 7]], sp)
    three = jd.generate(model, params, [[5, 6, 7]], dataclasses.replace(sp, n=3))
    assert three.tokens(0) == alone.tokens(0)
    assert three.tokens(1) != alone.tokens(0) or three.tokens(2) != alone.tokens(0)


def test_n_greedy_rows_share_the_prompt_cache(tiny):
    model, params = tiny
    prompts = [[5, 6, 7, 8, 9], [40, 41]]
    greedy = jd.SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    one = jd.generate(model, params, prompts, greedy)
    many = jd.generate(model, params, prompts,
                       [jd.SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, n=2),
                        jd.SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, n=3)])
    expect = [one.tokens(0)] * 2 + [one.tokens(1)] * 3
    assert [many.tokens(i) for i in range(5)] == expect
    np.testing.assert_allclose(many.logprobs, one.logprobs[[0, 0, 1, 1, 1]], atol=1e-6)
