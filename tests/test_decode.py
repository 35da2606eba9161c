"""contract §2, §3 (P2, P3), §5 (device stops), X1, and the jitted core's compile behaviour."""

import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

import jaxdecode as jd
from jaxdecode.device import decode
from jaxdecode.device import state as codes
from models import Llama, LlamaConfig
from tests.scripted import ScriptedModel

EOS = 1


@pytest.fixture(scope="module")
def tiny():
    cfg = LlamaConfig(vocab_size=96, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                      max_len=128, hidden_size=32, intermediate_size=64, eos_token_ids=(EOS,))
    model = Llama(cfg)
    return model, model.init_params(jax.random.key(0), scale=0.3)


def greedy(n, **kw):
    return jd.SamplingParams(temperature=0.0, max_tokens=n, **kw)


# -- X1, P3: a request's tokens depend on its own seed and settings only -----------------------

def test_sampling_X1_seeded_row_identical_alone_and_in_batch(tiny):
    model, params = tiny
    sp = jd.SamplingParams(temperature=1.0, top_k=40, top_p=0.95, seed=1234, max_tokens=24,
                           ignore_eos=True)
    alone = jd.generate(model, params, [[5, 6, 7, 8]], sp)
    others = [jd.SamplingParams(temperature=0.6, seed=s, max_tokens=30, repetition_penalty=1.2)
              for s in (1, 2)]
    for slot in range(3):
        rows = others[:slot] + [sp] + others[slot:]
        prompts = [[9, 10, 11], [3] * 20, [40, 41]][:slot] + [[5, 6, 7, 8]] + [[2, 2], [60]][slot:]
        batch = jd.generate(model, params, prompts, rows)
        assert batch.tokens(slot) == alone.tokens(0), f"slot {slot}"


def test_sampling_X1_seed_changes_tokens_and_repeats_exactly(tiny):
    model, params = tiny
    run = lambda seed: jd.generate(model, params, [[5, 6]], jd.SamplingParams(  # noqa: E731
        seed=seed, max_tokens=16, ignore_eos=True)).tokens(0)
    assert run(7) == run(7)
    assert run(7) != run(8)


def test_sampling_top_k_1_equals_greedy(tiny):
    model, params = tiny
    prompts = [[5, 6, 7], [30, 31]]
    g = jd.generate(model, params, prompts, greedy(12, ignore_eos=True))
    k1 = jd.generate(model, params, prompts, jd.SamplingParams(top_k=1, seed=3, max_tokens=12,
                                                               ignore_eos=True))
    np.testing.assert_array_equal(g.token_ids, k1.token_ids)


def test_decode_one_body_two_drivers_same_tokens(tiny):
    model, params = tiny
    prompts = [[5, 6, 7], [30, 31, 32, 33, 34]]
    rows = [jd.SamplingParams(seed=4, max_tokens=10), greedy(7)]
    a = jd.generate(model, params, prompts, rows)
    b = jd.generate(model, params, prompts, rows, trace=False)
    np.testing.assert_array_equal(a.token_ids, b.token_ids)
    assert a.finish_reasons == b.finish_reasons
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    assert np.all(a.logprobs[1, 7:] == 0)


def test_decode_no_recompile_for_new_requests_in_seen_bucket(tiny):
    model, params = tiny
    # the warm-up's shapes are the loop's: 2 rows, prompts in one bucket, 9 new tokens at most
    jd.generate(model, params, [[5, 6, 7], [8]],
                [greedy(9), jd.SamplingParams(seed=1, max_tokens=9)])
    before = jd.compilation_count()
    for i in range(3):
        jd.generate(model, params, [[5 + i] * (3 + i), [8, 9]],
                    [jd.SamplingParams(temperature=0.5 + i, top_k=i, top_p=0.9, seed=i,
                                       max_tokens=5 + i, stop_token_ids=(i + 2,)),
                     jd.SamplingParams(min_p=0.1, repetition_penalty=1.1 + i, max_tokens=9,
                                       logit_bias={3: 1.0}, banned_token_ids=(4,))])
    assert jd.compilation_count() == before


def test_compilation_count_counts_programs_loaded_from_the_persistent_cache(tmp_path):
    """A program loaded from JAX's persistent cache is a new program for the no-recompile
    checks (the test run keeps such a cache, tests/conftest.py)."""
    script = textwrap.dedent("""
        import os
        import jax, jax.numpy as jnp, jaxdecode as jd
        f = lambda x: jnp.sin(x) * 2 + 1
        x = jnp.ones(3)
        jax.jit(f)(x).block_until_ready()
        first = jd.compilation_count()
        jax.jit(f)(x).block_until_ready()
        again = jd.compilation_count()
        jax.clear_caches()
        jax.jit(f)(x).block_until_ready()
        print(first, again, jd.compilation_count(), len(os.listdir(%r)))
    """ % str(tmp_path))
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=str(tmp_path),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    first, again, loaded, entries = map(int, proc.stdout.split())
    assert entries >= 1 and first >= 1  # f was written to the cache
    assert again == first  # the in-memory cache: nothing new
    assert loaded == first + 1  # f loaded from disk counts once


def test_decode_logprobs_are_raw_model_logprobs(tiny):
    model, params = tiny
    out = jd.generate(model, params, [[5, 6, 7]], jd.SamplingParams(seed=0, max_tokens=3,
                                                                    logprobs=2, ignore_eos=True))
    ids, lps = out.top_logprobs
    assert ids.shape == (1, 3, 2)
    assert np.all(lps[0, :, 0] >= lps[0, :, 1])
    assert np.all(out.logprobs[0] <= lps[0, :, 0] + 1e-6)


# -- device-side stops (contract §5, O1, S9) with a hand-computable model --------------------------

def run_steps(model, prompt, sp, steps):
    state, _, _ = decode.prepare(model, {}, [prompt], sp, None, None)
    outs = []
    for _ in range(steps):
        state, out = decode.decode_step_jit(state, {}, config=decode.StepConfig(model))
        outs.append((int(out.token[0]), int(out.finish[0]), int(state.cache.lengths[0])))
    return state, outs


def test_stop_O1_eos_is_selected_but_never_written():
    model = ScriptedModel.make([0, 0, 5, 6, EOS, 7, 7, 7], eos_token_ids=(EOS,))
    state, outs = run_steps(model, [3, 4, 2], greedy(8), 4)
    # prompt of 3 -> cache length 3; y1=5 written (4), y2=6 written (5), y3=EOS not written
    assert outs[0] == (5, 0, 4)
    assert outs[1] == (6, 0, 5)
    assert outs[2] == (EOS, codes.EOS, 5)
    assert outs[3] == (-1, 0, 5)  # a finished row selects nothing more
    out = jd.generate(model, {}, [[3, 4, 2]], greedy(8))
    assert out.tokens(0) == [5, 6, EOS] and out.finish_reasons == [jd.FinishReason.EOS]


def test_stop_O1_max_tokens_last_token_not_written():
    model = ScriptedModel.make([0, 0, 5, 6, 7, 8], eos_token_ids=(EOS,))
    state, outs = run_steps(model, [3, 4, 2], greedy(3), 3)
    assert [o[0] for o in outs] == [5, 6, 7]
    assert outs[2][1] == codes.MAX_TOKENS and outs[2][2] == 5


def test_stop_S9_eos_on_last_allowed_token_reports_eos():
    model = ScriptedModel.make([0, 5, 6, EOS], eos_token_ids=(EOS,))
    out = jd.generate(model, {}, [[3, 4]], greedy(3))
    assert out.tokens(0) == [5, 6, EOS]
    assert out.finish_reasons == [jd.FinishReason.EOS]


def test_stop_S8_single_stop_id_on_device_and_ignore_eos():
    model = ScriptedModel.make([0, 5, EOS, 6, 9, 7], eos_token_ids=(EOS,))
    out = jd.generate(model, {}, [[3, 4]] * 2,
                      [greedy(10, stop_token_ids=(9,)), greedy(10, ignore_eos=True)])
    assert out.tokens(0) == [5, EOS] and out.finish_reasons[0] == jd.FinishReason.EOS
    assert out.tokens(1) == [5, EOS, 6, 9, 7, 7, 7, 7, 7, 7]
    out = jd.generate(model, {}, [[3, 4]], greedy(10, stop_token_ids=(9,), ignore_eos=True))
    assert out.tokens(0) == [5, EOS, 6, 9]
    assert out.finish_reasons == [jd.FinishReason.STOP_SEQUENCE]


def test_stop_min_tokens_masks_eos_until_reached():
    model = ScriptedModel.make([0, EOS, EOS, EOS, EOS], eos_token_ids=(EOS,))
    out = jd.generate(model, {}, [[3, 4]], greedy(10, min_tokens=2))
    assert out.lengths[0] == 3 and out.tokens(0)[2] == EOS
    assert EOS not in out.tokens(0)[:2]


def test_stop_context_limit_counts_prompt_and_output():
    model = ScriptedModel.make([5] * 40, max_len=16, eos_token_ids=(EOS,))
    out = jd.generate(model, {}, [[3] * 10], greedy(50))
    # prompt 10 + output 6 = the 16 positions of the context
    assert out.lengths[0] == 6
    assert out.finish_reasons == [jd.FinishReason.CONTEXT_LIMIT]


def test_processors_P2_all_tokens_masked_fails_the_row_only():
    model = ScriptedModel.make([0, 5, 6, 7], vocab_size=8)
    out = jd.generate(model, {}, [[3, 4], [3, 4]],
                      [greedy(4, banned_token_ids=tuple(range(8))), greedy(2)])
    assert out.errors == [jd.ErrorCode.ALL_TOKENS_MASKED, None]
    assert out.lengths.tolist() == [0, 2] and out.tokens(1) == [5, 6]
    assert out.finish_reasons[1] == jd.FinishReason.MAX_OUTPUT_TOKENS


@pytest.mark.parametrize("prompts,match", [([], "prompt_ids"), ([[]], "prompt_ids"),
                                            ([[99]], "prompt_ids"), ([[1] * 200], "prompt_ids")])
def test_generate_bad_prompt_names_the_field(tiny, prompts, match):
    model, params = tiny
    with pytest.raises(ValueError, match=match):
        jd.generate(model, params, prompts, greedy(2))


def test_generate_out_of_vocab_setting_names_the_field(tiny):
    model, params = tiny
    with pytest.raises(ValueError, match="^banned_token_ids"):
        jd.generate(model, params, [[1]], greedy(2, banned_token_ids=(500,)))


def test_consistency_O3_detects_a_broken_cache(tiny):
    model, params = tiny
    jd.assert_incremental_consistency(model, params, [5, 6, 7], [8, 9, 10])

    class Forgetful(Llama):  # drops the cache: every step sees only itself
        def forward(self, params, tokens, positions, cache, *, lengths):
            return super().forward(params, tokens, positions,
                                   cache.replace(k=cache.k * 0, v=cache.v * 0), lengths=lengths)

    with pytest.raises(AssertionError, match="prefix length 4"):
        jd.assert_incremental_consistency(Forgetful(model.config), params, [5, 6, 7], [8, 9])


def test_sampling_draws_follow_the_processed_distribution():
    from scipy.stats import chisquare

    from jaxdecode.device.sampling import inverse_cdf

    p = np.array([0.1, 0.0, 0.5, 0.15, 0.25])
    keys = jax.random.split(jax.random.key(0), 50000)
    with np.errstate(divide="ignore"):
        logp = np.log(p).astype(np.float32)
    draws = np.asarray(jax.jit(jax.vmap(inverse_cdf, (0, None)))(keys, logp))
    counts = np.bincount(draws, minlength=5)
    assert counts[1] == 0  # probability 0 is never drawn
    assert chisquare(counts[[0, 2, 3, 4]], p[[0, 2, 3, 4]] * len(draws)).pvalue > 1e-3


def test_sampling_truncation_is_respected_in_generate(tiny):
    model, params = tiny
    out = jd.generate(model, params, [[5, 6]] * 8,
                      [jd.SamplingParams(seed=s, top_k=2, max_tokens=6, ignore_eos=True)
                       for s in range(8)])
    state, _, _ = decode.prepare(model, params, [[5, 6]], greedy(1), None, None)
    top2 = set(np.argsort(-np.asarray(state.logits[0]))[:2].tolist())
    assert {int(t) for t in out.token_ids[:, 0]} <= top2
