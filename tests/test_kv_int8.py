"""The int8 KV cache (contract §12 "KV cache quantization", jaxdecode/kv_int8.py): the page
pool as int8 codes with a scale per (token, kv head), written and read back close to the float
pool, read as it is by the Pallas kernels (interpret mode), about twice the concurrent requests
of a bf16 cache at one memory budget, batch invariant (X1), deterministic and replayed bit for
bit, with the prefix cache, speculative decoding and save / restore, and its bad values
named."""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdecode as jd
from jaxdecode import kv_int8
from jaxdecode.model_api import PagedKVCache
from models import layers as L
from models import paged_attention
from serving.server import kv_options
from tests.host_fixtures import s4_tokenizer
from tests.scripted import Bigram
from tests.test_batch_invariance import _engine_logits, _prompt
from tests.test_paged import _mixed, _run, any_pending, watch


# -- the codec and the pool ---------------------------------------------------------------------

def test_quantize_is_absmax_per_token_and_head_within_half_a_step():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(3, 5, 2, 16)) * rng.uniform(0.01, 10, (3, 5, 2, 1)),
                    jnp.float32).at[0, 0, 0].set(0.0)   # one all-zero (token, head)
    q, scale = kv_int8.quantize(x)
    assert q.dtype == jnp.int8 and scale.shape == (3, 5, 2) and scale.dtype == jnp.bfloat16
    assert int(jnp.max(jnp.abs(q.astype(jnp.int32)))) == 127   # each absmax maps to +-127
    step = scale.astype(jnp.float32)[..., None]
    err = jnp.abs(kv_int8.dequantize(q, scale) - x)
    assert bool(jnp.all(err <= step * 0.5 + jnp.abs(x) * 2.0 ** -8))  # + the bf16 scale
    assert not bool(jnp.any(kv_int8.dequantize(q, scale)[0, 0, 0]))


def _int8_case(layer: int = 1):
    """A two-layer int8 pool (GQA, disjoint shuffled pages, rows of different lengths) written
    through `PagedKVCache.write`, its float twin, and a decode query per row."""
    rng = np.random.default_rng(1)
    b, h, kvh, d, ps, n, max_len = 3, 4, 2, 16, 16, 40, 128
    table = jnp.asarray(rng.permutation(np.arange(1, n))[:24].reshape(b, 8), jnp.int32)
    pools = [PagedKVCache.zeros(2, kvh, n, ps, d, b, max_len, dtype).replace(
        page_table=table, lengths=jnp.array([50, 100, 7], jnp.int32))
        for dtype in (jnp.int8, jnp.float32)]
    pos = jnp.broadcast_to(jnp.arange(max_len, dtype=jnp.int32), (b, max_len))
    for i in range(2):
        k, v = (jnp.asarray(rng.normal(size=(b, max_len, kvh, d)), jnp.float32) for _ in "kv")
        pools = [p.write(i, k, v, pos) for p in pools]
    q = jnp.asarray(rng.normal(size=(b, 1, h, d)), jnp.float32)
    return pools, q, jnp.array([[49], [99], [6]], jnp.int32)


def test_int8_pool_reads_back_the_float_pool_within_its_step():
    (quant, flat), _, _ = _int8_case()
    assert quant.k.dtype == jnp.int8 and set(quant.pools) == {"k", "v", "k_scale", "v_scale"}
    for layer in range(2):
        for a, b in zip(quant.read(layer, 128), flat.read(layer, 128)):
            assert a.dtype == jnp.float32
            assert 0 < float(jnp.max(jnp.abs(a - b))) < 0.05   # N(0, 1): steps of ~0.03
        index = jnp.asarray(np.random.default_rng(2).integers(0, 128, (3, 9)), jnp.int32)
        for a, b in zip(quant.read_positions(layer, index), quant.read(layer, 128)):
            np.testing.assert_array_equal(a, jnp.take_along_axis(b, index[:, None, :, None], 2))


@pytest.mark.parametrize("kernel,atol", [(paged_attention.gpu_decode, 2e-6),
                                         (paged_attention.tpu_decode, 1e-2)])
def test_pallas_kernels_read_the_int8_pool_as_the_xla_path_does(kernel, atol):
    """Both kernels in interpret mode, given the int8 pool and its scales as they are, against
    the XLA path over the dequantized pages (the TPU interpreter's arithmetic: see
    tests/test_paged.py); the float pool's answer is further off than either."""
    (quant, flat), q, pos = _int8_case()
    want = L.attention(q, *quant.read(1, 128), pos, jnp.arange(128), None)
    got = kernel(q, quant, 1, pos[:, 0] + 1, 128, interpret=True)
    np.testing.assert_allclose(got, want, atol=atol)
    floats = L.attention(q, *flat.read(1, 128), pos, jnp.arange(128), None)
    assert float(jnp.max(jnp.abs(floats - want))) > 10 * 2e-6


def test_bad_kv_cache_dtype_names_the_field():
    for bad in ("fp8", "float16", None, 8):
        with pytest.raises(ValueError, match="^kv_cache_dtype: "):
            jd.EngineConfig(max_len=128, kv_cache_dtype=bad)


# -- memory: about twice the requests of a bf16 cache at one budget -----------------------------

def _peak(model, params, tok, pages: int) -> int:
    """The most requests of 128 positions (8 pages) running at once in `pages` pages, of eight
    more requests than fit, with a slot for each (so the second wave waits for pages)."""
    sp = jd.SamplingParams(max_tokens=120, ignore_eos=True, temperature=0.0,
                           utf8_errors="replace")
    requests = pages // 8 + 8
    with jd.LLM(model, params, tok, max_slots=requests, max_len=256, kv_pages=pages,
                prefill_chunk=256, **_peak.kw) as llm:
        handles = [llm.submit([7, 8, 9], sp) for _ in range(requests)]
        running = set()
        watch(any_pending(handles), lambda: running.add(llm.num_running))
        assert all(len(h.result().token_ids) == 120 for h in handles)
        _peak.pool_bytes = sum(x.nbytes for x in llm._core.runner.state.cache.pools.values())
    return max(running)


def test_int8_pages_hold_about_twice_the_requests_of_bf16_at_one_budget():
    """One KV budget (16 requests of 128 positions in bf16, kv heads of 128): as pages of a
    bf16, an int8 and a float32 pool (`serve --kv-cache-memory`, int8 codes and their bf16
    scales counted), the int8 pool runs about twice the bf16 pool's requests at once and about
    four times the float32 pool's, in no more bytes than the budget."""
    base = Bigram.random(0, vocab=258)
    model = Bigram(dataclasses.replace(base.config, max_len=256, num_kv_heads=2,
                                       head_dim=128), base.table)
    tok = s4_tokenizer()
    args = argparse.Namespace(page_size=16, no_prefix_cache=False, prefill_chunk=256,
                              kv_cache_memory=None)
    bf16 = {"w": jnp.zeros((), jnp.bfloat16)}
    budget = 16 * 8 * 16 * 2 * 2 * 128 * 2  # 16 requests x 8 pages x 16 positions, K and V
    peaks = {}
    for name, params, kv_dtype in (("bf16", bf16, "auto"), ("int8", bf16, "int8"),
                                   ("float32", {}, "auto")):
        args.kv_cache_memory, args.kv_cache_dtype = budget, kv_dtype
        options = kv_options(args, model, params, None)
        _peak.kw = {"kv_cache_dtype": kv_dtype}
        peaks[name] = _peak(model, params, tok, options["kv_pages"])
        assert _peak.pool_bytes <= budget * (options["kv_pages"] + 1) / options["kv_pages"]
        assert peaks[name] == options["kv_pages"] // 8   # the pool, not the slots, binds
    assert peaks["bf16"] == 16
    assert 1.9 <= peaks["int8"] / peaks["bf16"] <= 2.0
    assert 3.8 <= peaks["int8"] / peaks["float32"] <= 4.0


# -- the engine with an int8 cache --------------------------------------------------------------

def test_int8_kv_engine_logits_are_bitwise_alone_and_in_a_crowded_batch():
    """X1 with the int8 cache: the probe's logits after its prefill and each decode step, alone
    at max_slots 1 and beside a long neighbour (kv_len 128 -> 512) and a short one, bitwise --
    and not those of the float cache (the int8 pool is what they read)."""
    from models import Llama, LlamaConfig

    model = Llama(LlamaConfig(vocab_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                              head_dim=16, max_len=512, hidden_size=64, intermediate_size=96,
                              eos_token_ids=(0,)))
    params = model.init_params(jax.random.key(2), scale=0.5)
    rng = np.random.default_rng(2)
    probe = _prompt(rng, 256, 3, 20)
    neighbours = [_prompt(rng, 256, 300, 320), _prompt(rng, 256)]
    ref = _engine_logits(model, params, 1, 512, probe, [], 0, kv_cache_dtype="int8")
    got = _engine_logits(model, params, 3, 512, probe, neighbours, 1, kv_cache_dtype="int8")
    for i, (a, b) in enumerate(zip(ref, got)):
        assert np.array_equal(a, b), f"logits after {'prefill' if i == 0 else f'step {i}'}"
    floats = _engine_logits(model, params, 1, 512, probe, [], 0)
    assert not np.array_equal(floats[-1], ref[-1])


def test_int8_kv_prefix_cache_on_equals_off_and_replays_bitwise(demo):
    """The prefix cache's promise with the int8 cache: a mixed batch (greedy, n=3 sampled, beams,
    structured) run twice with the cache on (the second run hits it) equals the same runs with
    it off, token for token; greedy int8 tokens are the same in both engines (deterministic);
    the records pin kv_cache_dtype and replay on an int8 engine is identical, while an "auto"
    engine reports the setting as a difference."""
    model, params, tok = demo
    prompts, settings = _mixed(tok)
    on_first, on_again, stats = _run(model, params, tok, prompts, settings,
                                     kv_cache_dtype="int8")
    off_first, off_again, _ = _run(model, params, tok, prompts, settings, prefix_cache=False,
                                   kv_cache_dtype="int8")
    assert stats["prefix_cache_hits"] > 0
    for a, b in zip(on_first + on_again, off_first + off_again):
        assert a.token_ids == b.token_ids and a.text == b.text, (a.request_id, b.request_id)
    assert on_first[0].token_ids == on_again[0].token_ids   # greedy: deterministic
    record = on_again[0].record
    assert record.data["layout"]["kv_cache_dtype"] == "int8"
    with jd.LLM(model, params, tok, max_slots=2, max_len=256, prefill_chunk=32,
                kv_cache_dtype="int8") as llm:
        report = jd.replay(record, llm)
        assert llm._core.runner.state.cache.k.dtype == jnp.int8
    assert report.identical and not report.environment_differences, report.describe()
    with jd.LLM(model, params, tok, max_slots=2, max_len=256, prefill_chunk=32) as llm:
        report = jd.replay(record, llm)
    assert any(d.startswith("kv_cache_dtype: recorded 'int8'")
               for d in report.environment_differences)


def test_int8_kv_beams_and_the_library_search_an_int8_cache(demo):
    """`kv_cache_dtype="int8"` reaches the contiguous cache of `jd.generate` and
    `jd.beam_search` (int8 codes with their scales, as the page pool holds them): the engine's
    beam lane searches that cache (its beams and scores equal `jd.beam_search`'s with the int8
    cache, and differ from the float search's), and `jd.generate`'s greedy tokens equal the
    int8 engine's paged ones; a bad value names the field."""
    from jaxdecode.device import decode

    model, params, tok = demo
    prompts, _ = _mixed(tok)
    prompts = prompts[:2]
    state = decode.prepare(model, params, prompts, jd.SamplingParams(max_tokens=4), 4, None,
                           kv_cache_dtype="int8")[0]
    assert state.cache.k.dtype == jnp.int8 and state.cache.k_scale.shape == state.cache.k.shape[:-1]
    search = lambda dtype: jd.beam_search(model, params, prompts, num_beams=3,  # noqa: E731
                                          max_new_tokens=8, num_return_sequences=2,
                                          kv_cache_dtype=dtype)
    int8, floats = search("int8"), search("auto")
    assert [s for row in int8.beams for _, s in row] != [s for row in floats.beams for _, s in row]
    greedy = jd.SamplingParams(max_tokens=12, temperature=0.0)
    library = jd.generate(model, params, prompts, greedy, kv_cache_dtype="int8")
    with jd.LLM(model, params, tok, max_slots=4, max_len=256, prefill_chunk=32,
                kv_cache_dtype="int8") as llm:
        beams = llm.generate(prompts, jd.SamplingParams(max_tokens=8, num_beams=3, n=2))
        plain = llm.generate(prompts, greedy)
    for r in range(len(prompts)):
        got = [(list(c.token_ids), c.score) for c in beams[2 * r:2 * r + 2]]
        assert got == [(list(ids), score) for ids, score in int8.beams[r]], r
        assert list(plain[r].token_ids) == library.token_ids[r][:library.lengths[r]].tolist(), r
    with pytest.raises(ValueError, match="^kv_cache_dtype: "):
        jd.generate(model, params, prompts, greedy, kv_cache_dtype="fp8")


def test_int8_kv_speculative_greedy_equals_the_plain_int8_engine(demo):
    """Speculative greedy with the int8 cache (the draft's pool int8 too) gives the plain int8
    engine's tokens (contract §10: greedy rows accept exactly the target's argmax; the verify
    pass reads the same quantized keys the decode step reads)."""
    import importlib

    model, params, tok = demo
    draft, dparams, _ = importlib.import_module("models.demo").load("draft")
    prompts, _ = _mixed(tok)
    sp = jd.SamplingParams(max_tokens=16, temperature=0.0)
    outs = []
    for spec in (None, {"draft": (draft, dparams), "k": 3}, {"draft": "prompt_lookup", "k": 3}):
        with jd.LLM(model, params, tok, max_slots=4, max_len=256, prefill_chunk=32,
                    kv_cache_dtype="int8", speculative=spec) as llm:
            outs.append([c.token_ids for c in llm.generate(prompts, sp)])
    assert outs[1] == outs[0] and outs[2] == outs[0]


def test_int8_kv_save_and_restore_continue_byte_for_byte(demo, tmp_path):
    """A request saved from an int8 engine (its codes and scales) and restored finishes as the
    uninterrupted run does; a float engine refuses the int8 save."""
    import time

    model, params, tok = demo
    prompt = _mixed(tok)[0][0]
    sp = jd.SamplingParams(max_tokens=160, temperature=0.0, ignore_eos=True)
    with jd.LLM(model, params, tok, max_slots=2, max_len=256, kv_cache_dtype="int8") as llm:
        want = llm.generate(prompt, sp)[0]
        handle = llm.submit(prompt, sp)
        while handle.selected < 8:
            time.sleep(0.001)
        llm.save_request(handle, str(tmp_path / "saved"))
        handle.cancel()
        got = llm.restore_request(str(tmp_path / "saved")).result(timeout=300)
    assert got.token_ids == want.token_ids and got.text == want.text
    with jd.LLM(model, params, tok, max_slots=2, max_len=256) as llm:
        with pytest.raises(ValueError, match="^path: .*kv_cache_dtype"):
            llm.restore_request(str(tmp_path / "saved"))


def test_server_with_int8_weights_and_int8_kv_serves_and_replays(tmp_path):
    """`serve --quantization int8 --kv-cache-dtype int8 --record-dir`: a completion is served,
    its record pins both settings, and `jaxdecode replay` rebuilds them and is identical."""
    import os
    import subprocess
    import sys

    import httpx

    from tests.serve_process import ROOT, serve

    records = tmp_path / "records"
    with serve(tmp_path / "serve.log", "--quantization", "int8", "--kv-cache-dtype", "int8",
               "--max-slots", "2", "--max-len", "256", "--record-dir", str(records)) as (_, url):
        r = httpx.post(url + "/v1/completions", json={
            "model": "demo", "prompt": "def fibonacci(n):", "max_tokens": 8, "seed": 5,
            "temperature": 0.7}, timeout=120)
        assert r.status_code == 200, r.text
    (path,) = records.glob("*.json")
    record = jd.GenerationRecord.load(str(path))
    assert record.data["model"]["quantization"] == "int8"
    assert record.data["layout"]["kv_cache_dtype"] == "int8" and len(record.token_ids) == 8
    out = subprocess.run([sys.executable, "-m", "jaxdecode.cli", "replay", str(path)], cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu"),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "identical" in out.stdout, out.stdout + out.stderr
