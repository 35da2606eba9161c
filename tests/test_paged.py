"""Paged KV, chunked prefill and automatic prefix caching (docs/serving.md "Paged KV").

The promise that sets the prefix cache apart: a cache hit gives the same tokens, bit for bit,
as no cache -- greedy and seeded sampling, n > 1, beams, speculative and structured requests,
mixed in one batch. Also: pages as the memory budget (more concurrent requests than contiguous
slots at one budget), chunked prefill interleaved with decode steps, a full pool that queues
and never corrupts a stream, the page layout itself and the Pallas kernels against the XLA
path, clear errors for bad settings.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
import time

import numpy as np
import jax
import jax.numpy as jnp
import pytest

import jaxdecode as jd
import models
from jaxdecode.engine.pages import PagePool, page_keys
from jaxdecode.model_api import KVCache, PagedKVCache
from models import layers as L
from models import paged_attention
from tests.host_fixtures import s4_tokenizer
from tests.scripted import Bigram

DEMO_PREFIX = "import os\nimport sys\n\n\ndef main(argv):\n    " * 6  # 80+ tokens


# -- the page layout ------------------------------------------------------------------------

def _pools(rng, layers=2, kvh=2, pages=12, ps=4, hd=3, b=3, max_len=16):
    paged = PagedKVCache.zeros(layers, kvh, pages + 1, ps, hd, b, max_len)
    table = rng.permutation(np.arange(1, pages + 1)).reshape(b, max_len // ps)  # disjoint rows
    paged = paged.replace(page_table=jnp.asarray(table, jnp.int32))
    return paged, KVCache.zeros(layers, b, max_len, kvh, hd)


def test_paged_cache_reads_what_a_contiguous_cache_reads():
    rng = np.random.default_rng(0)
    paged, flat = _pools(rng)
    for layer in range(2):
        for t in (5, 3, 1):  # several writes, the last rows of each padded (position 16 drops)
            k, v = (jnp.asarray(rng.normal(size=(3, t, 2, 3)), jnp.float32) for _ in range(2))
            pos = jnp.asarray(np.stack([rng.permutation(17)[:t] for _ in range(3)]), jnp.int32)
            paged, flat = paged.write(layer, k, v, pos), flat.write(layer, k, v, pos)
        for kv_len in (4, 12, 16):
            for a, b in zip(paged.read(layer, kv_len), flat.read(layer, kv_len)):
                np.testing.assert_array_equal(a, b)


def _kernel_case(layer: int = 1):
    """A two-layer pool with GQA, rows of different lengths and shuffled pages, a decode query
    per row, and the XLA path's answer for `layer` (gathered pages, layers.attention)."""
    rng = np.random.default_rng(1)
    b, h, kvh, d, ps, n = 3, 4, 2, 16, 16, 40
    k, v = (rng.normal(size=(kvh, 2, n, ps, d)).astype(np.float32) for _ in range(2))
    table = np.stack([rng.permutation(np.arange(1, n))[:8] for _ in range(b)]).astype(np.int32)
    cache = PagedKVCache(k=jnp.asarray(k), v=jnp.asarray(v), page_table=jnp.asarray(table),
                         lengths=jnp.array([50, 100, 7], jnp.int32), max_len=128)
    q = jnp.asarray(rng.normal(size=(b, 1, h, d)), jnp.float32)
    pos = jnp.array([[49], [99], [6]], jnp.int32)
    keys, values = cache.read(layer, 128)
    return q, cache, pos, L.attention(q, keys, values, pos, jnp.arange(128), None)


def test_pallas_gpu_kernel_in_interpret_mode_matches_the_xla_path():
    """jax.experimental.pallas.ops.gpu.paged_attention (interpret mode on CPU) reading the
    pool as it is (the second layer's pages through `kernel_pool`) against the XLA path."""
    q, cache, pos, want = _kernel_case()
    got = paged_attention.gpu_decode(q, cache, 1, pos[:, 0] + 1, 128, interpret=True)
    np.testing.assert_allclose(got, want, atol=2e-6)


def test_pallas_tpu_kernel_in_interpret_mode_matches_the_xla_path():
    """jax.experimental.pallas.ops.tpu.paged_attention under Pallas' TPU interpreter, on the
    same pool. The interpreter's arithmetic differs from XLA's by ~3e-3 here (its exp and
    reductions); a wrong page, layer or mask moves outputs by O(1)."""
    q, cache, pos, want = _kernel_case()
    got = paged_attention.tpu_decode(q, cache, 1, pos[:, 0] + 1, 128, interpret=True)
    np.testing.assert_allclose(got, want, atol=1e-2)
    wrong_layer = paged_attention.tpu_decode(q, cache, 0, pos[:, 0] + 1, 128, interpret=True)
    assert np.abs(np.asarray(wrong_layer) - np.asarray(want)).max() > 0.1


def test_kernels_are_dispatched_on_accelerators_only(monkeypatch):
    """Kernels on GPU and TPU decode steps only; the CPU and prefill chunks take the XLA path."""
    paged = PagedKVCache.zeros(1, 1, 4, 4, 2, 1, 16)
    assert paged_attention.kernel_for(paged, 1) is None  # CPU: the XLA path
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert paged_attention.kernel_for(paged, 1) is paged_attention.tpu_decode
    assert paged_attention.kernel_for(paged, 8) is None  # a prefill chunk: the XLA path
    assert paged_attention.kernel_for(KVCache.zeros(1, 1, 16, 1, 2), 1) is None
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert paged_attention.kernel_for(paged, 1) is paged_attention.gpu_decode
    monkeypatch.setenv("JAXDECODE_PAGED_KERNEL", "xla")
    assert paged_attention.kernel_for(paged, 1) is None


# -- the pool -----------------------------------------------------------------------------------

def test_pool_refcounts_cache_and_evicts_least_recently_used():
    pool = PagePool(4, 2)
    a = pool.allocate(2)
    assert a == [1, 2] and pool.available() == 2
    pool.register(a, [b"k1", b"k2"])
    pool.retain(a)               # shared by a second request
    pool.release(a)
    assert pool.used == 2 and pool.lookup([b"k1", b"k2", b"k3"], 3) == a
    pool.release(a)              # nobody holds them: cached and idle, still found
    assert pool.used == 0 and pool.available() == 4 and pool.lookup([b"k1"], 1) == [1]
    pool.retain([2])             # a hit takes an idle page back
    assert pool.available() == 3
    pool.release([2])
    b = pool.allocate(4)         # the free pages first, then the idle ones, oldest first
    assert b == [3, 4, 1, 2] and pool.lookup([b"k1"], 1) == []
    assert pool.allocate(1) is None


def test_page_keys_chain_and_name_the_program():
    toks = list(range(40))
    full = lambda c: 16  # noqa: E731
    keys = page_keys(toks, 8, 16, full, "m")
    assert len(keys) == 5 and len(set(keys)) == 5
    assert page_keys(toks[:16] + [99] * 24, 8, 16, full, "m")[:2] == keys[:2]
    assert page_keys(toks[:16] + [99] * 24, 8, 16, full, "m")[2] != keys[2]  # the chain
    assert page_keys(toks, 8, 16, lambda c: 32, "m")[0] != keys[0]        # the program
    assert page_keys(toks, 8, 16, full, "other")[0] != keys[0]            # the model


# -- exactness: cache on == cache off --------------------------------------------------------

def _mixed(tok):
    prefix = tok.encode(DEMO_PREFIX).ids
    assert len(prefix) >= 64
    suffixes = [" return 0\n", " print(argv)\n", " pass\n", "    x = 1\n"]
    prompts = [prefix + tok.encode(s).ids for s in suffixes]
    schema = {"type": "json_schema", "json_schema": {"schema": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}
    settings = [jd.SamplingParams(max_tokens=12, temperature=0.0),
                jd.SamplingParams(max_tokens=12, temperature=0.9, seed=7, n=3),
                jd.SamplingParams(max_tokens=8, num_beams=3, n=2),
                jd.SamplingParams(max_tokens=10, temperature=0.0, response_format=schema)]
    return prompts, settings


def _run(model, params, tok, prompts, settings, **kw):
    with jd.LLM(model, params, tok, max_slots=6, max_len=256, prefill_chunk=32, **kw) as llm:
        first = llm.generate(prompts, settings)   # fills the cache (when on)
        again = llm.generate(prompts, settings)   # hits it
        stats = llm.kv_stats()
    return first, again, stats


def test_prefix_cache_on_equals_off_token_for_token_in_a_mixed_batch(demo):
    model, params, tok = demo
    prompts, settings = _mixed(tok)
    on_first, on_again, stats = _run(model, params, tok, prompts, settings)
    off_first, off_again, off_stats = _run(model, params, tok, prompts, settings,
                                           prefix_cache=False)
    assert stats["prefix_cache_hits"] > 0 and off_stats["prefix_cache_hits"] == 0
    assert any(c.usage.cached_tokens >= 64 for c in on_again)
    assert all(c.usage.cached_tokens == 0 for c in off_first + off_again)
    for a, b in zip(on_first + on_again, off_first + off_again):
        assert a.token_ids == b.token_ids and a.text == b.text, (a.request_id, b.request_id)
        if a.score is not None:
            assert a.score == b.score


def test_prefix_cache_on_equals_off_speculative(demo):
    model, params, tok = demo
    draft, dparams, _ = importlib.import_module("models.demo").load("draft")
    prompts, _ = _mixed(tok)
    sp = [jd.SamplingParams(max_tokens=12, temperature=0.0),
          jd.SamplingParams(max_tokens=12, temperature=0.8, seed=3)] * 2
    outs = []
    for cache in (True, False):
        with jd.LLM(model, params, tok, max_slots=4, max_len=256, prefill_chunk=32,
                    prefix_cache=cache, speculative={"draft": (draft, dparams), "k": 3}) as llm:
            twice = llm.generate(prompts, sp) + llm.generate(prompts, sp)
            outs.append([c.token_ids for c in twice])
            hits = llm.kv_stats()["prefix_cache_hits"]
        assert (hits > 0) == cache
    assert outs[0] == outs[1]


def test_replay_of_a_cached_request_is_identical_with_the_cache_off(demo):
    model, params, tok = demo
    prompts, _ = _mixed(tok)
    sp = jd.SamplingParams(max_tokens=10, temperature=0.8, seed=11)
    with jd.LLM(model, params, tok, max_slots=2, max_len=256, prefill_chunk=32) as llm:
        llm.generate(prompts[:1], sp)
        cached = llm.generate(prompts[1:2], sp)[0]
    assert cached.usage.cached_tokens > 0
    assert cached.record.data["output"]["usage"]["cached_tokens"] == cached.usage.cached_tokens
    assert cached.record.data["layout"]["prefill_chunk"] == 32
    with jd.LLM(model, params, tok, max_slots=2, max_len=256, prefill_chunk=32,
                prefix_cache=False) as llm:
        report = jd.replay(cached.record, llm)
    assert report.identical, report.describe()


def watch(busy, observe) -> None:
    """Call `observe()` once, then again every 0.5 ms while `busy()`: a loop that never sleeps
    holds the GIL the engine thread needs and made these tests ~2x slower."""
    observe()
    while busy():
        time.sleep(0.0005)
        observe()


def any_pending(handles):
    """`watch`'s `busy` for requests: True while one of `handles` is not done."""
    return lambda: not all(h.done for h in handles)


# -- memory: pages are the budget -------------------------------------------------------------

@pytest.fixture(scope="module")
def bigram():
    return Bigram.random(0, vocab=258), s4_tokenizer()


def test_pages_hold_four_times_the_requests_of_contiguous_slots_at_one_budget(bigram):
    """A budget of 4 rows x 2048 positions (the contiguous engine runs 4 requests at
    max_len 2048): as 512 pages of 16, requests of 128 positions run 64 at once."""
    model, tok = bigram
    model = Bigram(dataclasses.replace(model.config, max_len=2048), model.table)
    sp = jd.SamplingParams(max_tokens=120, ignore_eos=True, temperature=0.0,
                           utf8_errors="replace")
    with jd.LLM(model, {}, tok, max_slots=64, max_len=2048, kv_pages=4 * 2048 // 16,
                prefill_chunk=256) as llm:
        handles = [llm.submit([7, 8, 9], sp) for _ in range(80)]
        running = set()
        watch(any_pending(handles), lambda: running.add(llm.num_running))
        assert all(len(h.result().token_ids) == 120 for h in handles)
        assert llm.kv_stats()["pages_used"] == 0
    assert max(running) == 64  # 64 x 8 pages = the whole budget; 16 x the contiguous engine


def test_a_full_pool_queues_and_corrupts_no_stream(bigram):
    """Pages for about two requests at a time, ten streams submitted at once: they wait for
    pages, and each gets exactly the tokens it gets alone."""
    model, tok = bigram
    prompts = [[5 + i, 6, 7 + i] for i in range(10)]
    sp = [jd.SamplingParams(max_tokens=40, temperature=0.9, seed=i, ignore_eos=True,
                            utf8_errors="replace") for i in range(10)]
    alone = [jd.generate(model, {}, [p], s, trace=False).tokens(0) for p, s in zip(prompts, sp)]
    with jd.LLM(model, {}, tok, max_slots=8, max_len=64, kv_pages=8, page_size=8,
                prefill_chunk=16) as llm:
        handles = [llm.submit(p, s) for p, s in zip(prompts, sp)]
        running, used = set(), set()
        watch(any_pending(handles), lambda: (running.add(llm.num_running),
                                          used.add(llm.kv_stats()["pages_used"])))
        got = [list(h.result().token_ids) for h in handles]
    assert got == alone and max(running) <= 2 and max(used) <= 8


def test_samples_of_one_prompt_share_its_pages(bigram):
    """n = 3 samples of a 40-token prompt with 24 new tokens each: 8 pages of 8 per sample
    alone (24 in all), 8 + 2 x 3 when the samples share the 5 full prompt pages. A budget of
    14 pages runs the three at once only if they share, and their tokens are those of three
    separate requests."""
    import threading

    model, tok = bigram
    prompt = list(range(3, 43))
    sp = jd.SamplingParams(max_tokens=24, temperature=1.0, seed=2, n=3, ignore_eos=True,
                           utf8_errors="replace")
    with jd.LLM(model, {}, tok, max_slots=4, max_len=64, page_size=8, prefill_chunk=16,
                kv_pages=14, prefix_cache=False) as llm:
        out, running = [], set()
        worker = threading.Thread(target=lambda: out.extend(llm.generate([prompt], sp)))
        worker.start()
        watch(worker.is_alive, lambda: running.add(llm.num_running))
        worker.join()
    separate = [jd.generate(model, {}, [prompt], sp, trace=False).tokens(i) for i in range(3)]
    assert [list(c.token_ids) for c in out] == separate
    assert max(running) == 3


def test_chunked_prefill_lets_running_streams_step_between_chunks(bigram):
    model, tok = bigram
    model = Bigram(dataclasses.replace(model.config, max_len=256), model.table)
    long_prompt = [9] * 200
    sp = jd.SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True,
                           utf8_errors="replace")
    with jd.LLM(model, {}, tok, max_slots=2, max_len=256, prefill_chunk=16) as llm:
        runner = llm.submit([5, 6], sp)
        while runner.selected < 3:
            pass
        late = llm.submit(long_prompt, jd.SamplingParams(max_tokens=2, utf8_errors="replace"))
        late.result(timeout=60)
        runner.result(timeout=60)
    times = {e.data["to"]: e.time for e in late.trace() if e.kind == "lifecycle"}
    during = [e for e in runner.trace() if e.kind == "token.selected"
              and times["PREFILLING"] <= e.time <= times["DECODING"]]
    assert len(during) >= 200 // 16 - 1  # a step between every two chunks


# -- bad settings -------------------------------------------------------------------------------

def test_bad_page_settings_name_the_setting(bigram):
    model, tok = bigram
    with pytest.raises(ValueError, match="prefill_chunk: 24 is not a multiple of page_size 16"):
        jd.LLM(model, {}, tok, max_len=64, prefill_chunk=24)
    with pytest.raises(ValueError, match="kv_pages: 3 pages of 16 positions hold less"):
        jd.LLM(model, {}, tok, max_len=64, kv_pages=3)
    with pytest.raises(ValueError, match="page_size"):
        jd.LLM(model, {}, tok, max_len=64, page_size=0)
    with pytest.raises(ValueError, match="prefix_cache"):
        jd.LLM(model, {}, tok, max_len=64, prefix_cache="yes")
    with jd.LLM(model, {}, tok, max_len=64) as llm:
        with pytest.raises(ValueError, match="prompt: 64 tokens leave no room"):
            llm.submit([5] * 64)


def test_samples_whose_first_ends_while_prefilling_still_end(bigram):
    """The request that prefills for its prompt's samples hits its deadline mid-prefill: the
    samples go back to the queue and end on their own (nothing hangs, no slot leaks)."""
    model, tok = bigram
    model = Bigram(dataclasses.replace(model.config, max_len=256), model.table)
    sp = jd.SamplingParams(max_tokens=4, n=3, deadline_s=0.05, utf8_errors="replace")
    with jd.LLM(model, {}, tok, max_slots=4, max_len=256, prefill_chunk=16) as llm:
        out = llm.generate([[9] * 200], sp)
        assert llm.num_running == 0 and llm.kv_stats()["pages_used"] == 0
    assert [c.finish_reason for c in out] == [jd.FinishReason.DEADLINE_EXCEEDED] * 3


def test_a_new_constraint_arriving_while_another_decodes_changes_neither(bigram):
    """S-constraints with chunked prefill: a request with a second grammar is placed in a slot
    (and prefills in chunks) while a constrained stream decodes. The tables grow; the running
    stream's state is rebased, the newcomer's is set at insert; each gets its tokens alone."""
    model, tok = bigram
    digits = jd.SamplingParams(max_tokens=30, temperature=1.0, seed=4, utf8_errors="replace",
                               response_format={"type": "regex", "pattern": "[0-9]{20,30}"})
    words = jd.SamplingParams(max_tokens=12, temperature=1.0, seed=5, utf8_errors="replace",
                              response_format={"type": "regex", "pattern": "(ab|cd)+x"})
    late_prompt = [9] * 40
    with jd.LLM(model, {}, tok, max_slots=2, max_len=64, prefill_chunk=16) as llm:
        alone = [llm.generate([[5, 6]], digits)[0].token_ids,
                 llm.generate([late_prompt], words)[0].token_ids]
    with jd.LLM(model, {}, tok, max_slots=2, max_len=64, prefill_chunk=16) as llm:
        runner = llm.submit([5, 6], digits)
        while runner.selected < 3:
            pass
        late = llm.submit(late_prompt, words)
        got = [late.result(timeout=60).token_ids, runner.result(timeout=60).token_ids]
        faults = [e for h in (runner, late) for e in h.trace() if e.kind == "engine.fault"]
    assert faults == []  # not even one recovered from
    assert [list(t) for t in got[::-1]] == [list(t) for t in alone]
    assert re.fullmatch("[0-9]{20,30}", tok.decode(list(alone[0])))
    assert re.fullmatch("(ab|cd)+x", tok.decode(list(alone[1])))
