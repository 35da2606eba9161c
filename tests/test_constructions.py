"""The three constructions of jaxdecode/invariance.py on the CPU (docs/batch_invariance.md
"Three constructions, one home", docs/contract.md X1): "fixed_shape" forced here keeps a row's
logits bitwise in any batch with one product per weight per decode step and no loop; "none"
(`batch_invariant=False`) is accepted by the library and the engine and recorded."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdecode as jd
from jaxdecode import invariance
from jaxdecode.device import numerics
from tests.test_batch_invariance import PROBE_SP, _batch, _probe_logits, _prompt


def test_invariance_X1_fixed_shape_keeps_prefill_and_loop_logits_bitwise(demo):
    """The accelerators' construction forced on the CPU: the probe row's prefill and device-loop
    logits are bitwise alone and in batches of 3, 16 (one 16-row product per weight) and 17 (two
    tiles, unrolled)."""
    model, params, _ = demo
    model = model.with_invariance("fixed_shape").with_row_tile(16)
    rng = np.random.default_rng(5)
    probe = _prompt(rng, model.config.vocab_size, 1, 9)
    ref = None
    for size in (1, 3, 16, 17):
        prompts, settings_, slot = _batch(rng, model.config.vocab_size, probe, size)
        settings_[slot] = PROBE_SP
        logits, tokens = _probe_logits(model, params, prompts, settings_, slot)
        if ref is None:
            ref = logits, tokens
            continue
        for a, b in zip(ref[0], logits):
            assert np.array_equal(a, b), f"batch of {size}: max |diff| {np.max(np.abs(a - b))}"
        assert tokens == ref[1]


def _dots(jaxpr) -> list:
    """The 2-D weight products (dot_general of two matrices) of a jaxpr, nested ones included."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general" and all(v.aval.ndim == 2 for v in eqn.invars):
            found.append(eqn.invars[0].aval.shape[0])
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    found += _dots(inner)
    return found


@pytest.mark.parametrize("rows,tiles", [(16, 1), (32, 2)])
def test_fixed_shape_decode_step_has_one_product_per_weight_per_tile_and_no_loop(demo, rows,
                                                                                  tiles,
                                                                                  monkeypatch):
    """A decode step of `rows` rows on 16-row fixed-shape tiles: one product per weight matrix
    per layer per tile (seven per Llama layer, plus the head), every one of 16 rows, and no
    while loop; "row_tiles" at 4 rows with the probe refusing to stack runs a loop instead."""
    model, params, _ = demo
    fixed = model.with_invariance("fixed_shape").with_row_tile(16)
    cache = fixed.init_cache(rows, 128)
    args = (params, jnp.ones((rows, 1), jnp.int32), jnp.full((rows, 1), 3, jnp.int32), cache)

    def step(m):
        return lambda p, t, pos, c: m.forward(p, t, pos, c, lengths=jnp.ones((rows,), jnp.int32))

    jaxpr = jax.make_jaxpr(step(fixed))(*args)
    dots = _dots(jaxpr.jaxpr)
    assert "while" not in str(jaxpr)
    assert len(dots) == (7 * model.config.num_layers + 1) * tiles and set(dots) == {16}
    monkeypatch.setattr(invariance, "stacked_tiles_agree", lambda *shape: False)
    looped = jax.make_jaxpr(step(model.with_invariance("row_tiles")))(*args)
    assert "while" in str(looped)


def test_plain_numerics_are_accepted_everywhere_and_recorded(demo):
    """`batch_invariant=False` on jd.generate and jd.LLM runs the plain construction; its greedy
    tokens equal the invariant ones except at near-ties (at most 1 of 8 rows may differ);
    records say "none"; a non-boolean names `batch_invariant`."""
    model, params, tok = demo
    rng = np.random.default_rng(9)
    prompts = [_prompt(rng, model.config.vocab_size, 4, 20) for _ in range(8)]
    sp = jd.SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    invariant = jd.generate(model, params, prompts, sp)
    plain = jd.generate(model, params, prompts, sp, batch_invariant=False)
    differ = sum(invariant.tokens(i) != plain.tokens(i) for i in range(len(prompts)))
    assert differ <= 1, f"{differ} of {len(prompts)} greedy rows differ"
    none = invariance.configure(model, batch_invariant=False)
    assert not none.batch_invariant and numerics.guarantee(none, "cpu")["mode"] == "none"
    assert numerics.guarantee(model.with_invariance("fixed_shape"), "cpu")["mode"] == "fixed_shape"
    with pytest.raises(ValueError, match="batch_invariant"):
        invariance.configure(model, batch_invariant="no")
    with jd.LLM(model, params, tok, max_slots=2, max_len=64, batch_invariant=False) as llm:
        out = llm.generate([prompts[0]], sp)[0]
        assert list(out.token_ids) == plain.tokens(0)
        assert llm.model.batch_invariant is False


def test_fast_path_runs_a_lone_row_as_one_row_everywhere(demo):
    """Without invariance a lone request is a one-row program (`numerics.min_rows`: no done
    padding row, so XLA takes its matrix-vector products): the engine's state has one row, and
    jd.generate, jd.beam_search and jd.speculative_generate take `batch_invariant=False` on a
    lone prompt; with invariance every program keeps two rows."""
    model, params, tok = demo
    fast = invariance.configure(model, batch_invariant=False)
    assert numerics.min_rows(fast) == 1 and numerics.min_rows(model) == numerics.MIN_ROWS == 2
    prompt = [_prompt(np.random.default_rng(3), model.config.vocab_size, 6, 7)]
    sp = jd.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    with jd.LLM(model, params, tok, max_slots=1, max_len=64, batch_invariant=False) as llm:
        assert llm._core.runner.ctx.rows == 1
        engine = list(llm.generate(prompt, sp)[0].token_ids)
    with jd.LLM(model, params, tok, max_slots=1, max_len=64) as llm:
        assert llm._core.runner.ctx.rows == 2
    alone = jd.generate(model, params, prompt, sp, batch_invariant=False).tokens(0)
    assert len(alone) == len(engine) == 6
    beams = jd.beam_search(model, params, prompt, num_beams=2, max_new_tokens=6,
                           batch_invariant=False)
    assert len(beams.tokens(0)) == 6
    spec = jd.speculative_generate(model, params, "prompt_lookup", None, prompt, sp,
                                   batch_invariant=False)
    assert len(spec.tokens(0)) == 6


def test_construction_env_names_the_variable(monkeypatch):
    monkeypatch.setenv(invariance.CONSTRUCTION_ENV, "fixed_shape")
    assert invariance.construction("auto") == "fixed_shape"
    assert invariance.construction("none") == "none"
    monkeypatch.setenv(invariance.CONSTRUCTION_ENV, "tiles")
    with pytest.raises(ValueError, match=invariance.CONSTRUCTION_ENV):
        invariance.construction("auto")
