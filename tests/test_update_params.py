"""`LLM.update_params` (contract R4): new weights give exactly a fresh engine's tokens, with no
compilation; the prefix cache never serves pages of other weights; requests in flight finish on
the weights they were queued with; bad trees are refused naming `params` and the engine serves
on; records name the weights and replay refuses other ones."""

from __future__ import annotations

import threading
import time

import jax
import jax.numpy as jnp
import pytest

import jaxdecode as jd
import models
from jaxdecode.replay import params_hash

GREEDY = jd.SamplingParams(temperature=0.0, max_tokens=12)
SEEDED = jd.SamplingParams(temperature=0.9, seed=5, max_tokens=12)
LONG = "def fibonacci(n):\n    if n < 2:\n        return n\n" * 6  # several full KV pages
SETTINGS = dict(max_slots=4, max_len=256, prefill_chunk=32)  # the cache serves whole chunks


@pytest.fixture(scope="module")
def demo():
    model, params, tokenizer = models.demo()
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(7), len(leaves))
    moved = jax.tree.unflatten(tree, [x + 0.1 * jnp.std(x) * jax.random.normal(k, x.shape)
                                      for x, k in zip(leaves, keys)])
    return model, params, moved, tokenizer


def serve(llm) -> list:
    prompts = ["def add(a, b):", "import os\n", LONG]
    return [c.token_ids for c in llm.generate(prompts, [GREEDY, SEEDED, GREEDY])]


def test_update_params_R4_tokens_of_a_fresh_engine_no_compile_no_stale_pages(demo):
    """R4, and R5: records name the weights they ran on and replay refuses other ones."""
    model, old, new, tokenizer = demo
    with jd.LLM(model, old, tokenizer, **SETTINGS) as llm:
        before = serve(llm)
        assert serve(llm) == before  # the second pass hits the prefix cache (LONG)
        record = llm.generate([LONG], GREEDY)[0].record
        hits, compiles = llm.kv_stats()["prefix_cache_hits"], jd.compilation_count()
        start = time.perf_counter()
        llm.update_params(new)
        print(f"update_params: {time.perf_counter() - start:.4f} s")
        after = serve(llm)
        assert llm.kv_stats()["prefix_cache_hits"] == hits  # nothing served from old pages
        assert serve(llm) == after
        assert llm.kv_stats()["prefix_cache_hits"] > hits   # the cache works on the new weights
        assert jd.compilation_count() == compiles
        fresh_record = llm.generate([LONG], GREEDY)[0].record
        with pytest.raises(ValueError, match="^record: made with weights"):
            jd.replay(record, llm)
        report = jd.replay(record, llm, allow_params_mismatch=True)
        assert "model: weights differ from the recorded snapshot hash" in (
            report.environment_differences)
    assert after != before
    assert record.data["model"]["hash"] == params_hash(old)
    assert fresh_record.data["model"]["hash"] == params_hash(new)
    with jd.LLM(model, new, tokenizer, **SETTINGS) as fresh:
        assert serve(fresh) == after


def test_update_params_R4_in_flight_requests_finish_on_their_weights(demo):
    """A running request keeps the old weights (update_params waits for it); a request
    submitted while the swap is pending waits for it and runs on the new weights."""
    model, old, new, tokenizer = demo
    long_run = jd.SamplingParams(temperature=0.0, max_tokens=60)
    with jd.LLM(model, old, tokenizer, **SETTINGS) as llm:
        reference_old = llm.generate(["class Stack:"], long_run)[0].token_ids
        h = llm.submit("class Stack:", long_run)
        while h.selected < 1:
            time.sleep(0.001)
        swap = threading.Thread(target=llm.update_params, args=(new,))
        swap.start()
        while not llm._scheduler.holding:
            time.sleep(0.001)
        late = llm.submit("class Stack:", long_run)  # waits behind the swap
        swap.join(timeout=120)
        assert not swap.is_alive()
        running = h.result(timeout=60)
        assert running.token_ids == reference_old
        assert running.record.data["model"]["hash"] == params_hash(old)
        late = late.result(timeout=60)
        assert late.record.data["model"]["hash"] == params_hash(new) == llm.params_hash
        reference_new = llm.generate(["class Stack:"], long_run)[0].token_ids
    assert late.token_ids == reference_new != reference_old


def test_update_params_R4_bad_trees_are_refused_and_the_engine_serves_on(demo):
    model, old, new, tokenizer = demo
    wrong_shape = jax.tree.map(lambda x: x, new)
    wrong_shape["embed"] = wrong_shape["embed"][:-1]
    missing = dict(new, layers=new["layers"][:-1])
    half = jax.tree.map(lambda x: x.astype(jnp.bfloat16), new)
    weak = jax.tree.map(lambda x: x, new)
    weak["final_norm"] = jnp.broadcast_to(jnp.asarray(1.0), new["final_norm"].shape)
    not_array = dict(new, final_norm=[1.0] * new["final_norm"].shape[0])
    with jd.LLM(model, old, tokenizer, **SETTINGS) as llm:
        before, hash_before = serve(llm), llm.params_hash
        for bad, says in [(wrong_shape, r"\['embed'\] is float32\[4095, 256\]"),
                          (missing, "the tree structure differs"),
                          (half, r"\['embed'\] is bfloat16"),
                          (not_array, "the tree structure differs"),
                          (weak, r"\['final_norm'\] differs from the engine's in its weak")]:
            with pytest.raises(ValueError, match=f"^params: ({says})"):
                llm.update_params(bad)
        assert serve(llm) == before and llm.params_hash == hash_before
        assert llm.health()["status"] == "ok"
    with pytest.raises(jd.EngineClosed):
        llm.update_params(new)
