"""Research API (issue #16, jaxdecode/device/research.py): custom logit processors with state on every
entry point, scores / logits outputs, step observers, the host callback, no recompiles."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdecode as jd
from jaxdecode.device import research
from tests.scripted import Bigram
from tests.test_decode import greedy, tiny  # noqa: F401  (tiny: a pytest fixture)
from tests.test_speculative import chi_square_pvalue, two_token_distribution

LOOKUP = "prompt_lookup"
PROMPTS = [[5, 6, 7, 5, 6, 7, 5], [30, 31, 32], [9]]


# processors used below: module-level functions, so equal processors hit the compile cache

def ban_token(logits, ctx, state):
    """Bans state["token"] (per row)."""
    return jnp.where(jnp.arange(logits.shape[-1]) == state["token"][:, None], -jnp.inf,
                     logits), state


def banning(token):
    return jd.LogitProcessor(ban_token, "first", init_state={"token": np.int32(token)})


def chain(logits, ctx, state):
    """Counts its calls and hashes (step, previous token): a wrong, repeated or skipped call,
    or a state that did not follow its row (beam reorder, speculative rollback), shows."""
    return logits, {"calls": state["calls"] + 1,
                    "hash": state["hash"] * 31 + ctx.last_token() + 7 * ctx.step}


def chaining():
    return jd.LogitProcessor(chain, "last", init_state={"calls": np.int32(0),
                                                        "hash": np.int32(0)})


def expected_hash(prompt, tokens):
    h, seq = 0, list(prompt) + list(tokens)
    for i in range(len(tokens)):
        h = (h * 31 + seq[len(prompt) + i - 1] + 7 * i) & 0xFFFFFFFF
    return int(np.array(h, np.uint32).astype(np.int32))


def check_chain(out, prompts, state_index=0):
    state = out.processor_states[state_index]
    for r, prompt in enumerate(prompts):
        tokens = out.tokens(r)
        assert state["calls"][r] == len(tokens), f"row {r}"
        assert state["hash"][r] == expected_hash(prompt, tokens), f"row {r}"


# -- a processor that bans a token is never violated -------------------------------------------

def test_custom_ban_never_violated_on_every_entry_point(tiny):
    model, params = tiny
    plain = jd.generate(model, params, PROMPTS, greedy(24, ignore_eos=True))
    banned = int(np.bincount(plain.token_ids.reshape(-1)).argmax())  # the most chosen token
    procs = [banning(banned)]
    outs = {"greedy": jd.generate(model, params, PROMPTS, greedy(24, ignore_eos=True),
                                  processors=procs)}
    for seed in range(3):
        outs[f"sampled {seed}"] = jd.generate(
            model, params, PROMPTS, jd.SamplingParams(seed=seed, max_tokens=24, ignore_eos=True,
                                                      temperature=1.5), processors=procs)
    outs["python loop"] = jd.generate(model, params, PROMPTS, greedy(24, ignore_eos=True),
                                      processors=procs, trace=False)
    outs["beam"] = jd.beam_search(model, params, PROMPTS, num_beams=3, max_new_tokens=16,
                                  processors=procs)
    for draft in (model, LOOKUP):
        for sp in (greedy(24, ignore_eos=True),
                   jd.SamplingParams(seed=4, max_tokens=24, ignore_eos=True)):
            outs[f"speculative {draft == LOOKUP} {sp.temperature}"] = jd.speculative_generate(
                model, params, draft, params, PROMPTS, sp, k=3, processors=procs)
    for name, out in outs.items():
        assert banned not in out.token_ids, name
        assert out.lengths.min() > 0, name
    for r in range(len(PROMPTS)):
        beams = [b for b, _ in outs["beam"].beams[r]]
        assert all(banned not in b for b in beams)


def test_custom_ban_in_the_engine_matches_generate():
    import models

    model, params, tok = models.demo()
    prompts = ["def parse(path):\n", "import os\n"]
    ids = [tok.encode(p).ids for p in prompts]
    sp = greedy(12, ignore_eos=True)
    plain = jd.generate(model, params, ids, sp)
    banned = int(plain.token_ids[0, 1])
    procs = [banning(banned), chaining()]
    ref = jd.generate(model, params, ids, sp, processors=procs)
    assert banned not in ref.token_ids
    sampled = [jd.SamplingParams(seed=s, max_tokens=12, ignore_eos=True) for s in (1, 2)]
    ref_sampled = jd.generate(model, params, ids, sampled, processors=procs)
    with jd.LLM(model, params, tok, max_slots=4, max_len=128, processors=procs) as llm:
        got = llm.generate(prompts, sp)
        got_sampled = llm.generate(prompts, sampled)
        record = got[0].record
        assert record.data["processors"] == list(ref.processor_order)
        assert jd.replay(record, llm).identical
        with pytest.raises(ValueError, match="processors"):
            handle = llm.submit(prompts[0], jd.SamplingParams(max_tokens=64))
            llm.save_request(handle, "/nonexistent")
    for r in range(2):
        assert list(got[r].token_ids) == ref.tokens(r)
        assert list(got_sampled[r].token_ids) == ref_sampled.tokens(r)
    with jd.LLM(model, params, tok, max_slots=2, max_len=128) as plain_llm:
        report = jd.replay(record, plain_llm)
        assert any(d.startswith("processors:") for d in report.environment_differences)
    with pytest.raises(ValueError, match="processors"):
        jd.LLM(model, params, tok, processors=procs, speculative={"draft": "prompt_lookup"})
    with pytest.raises(ValueError, match="processors"):
        jd.LLM(model, params, tok, processors=procs, step_hook=object())
    with pytest.raises(ValueError, match=r"processors\[0\]"):
        jd.LLM(model, params, tok, processors=[chain])


# -- a stateful processor's state advances exactly once per step --------------------------------

def test_state_advances_once_per_step_in_generate(tiny):
    model, params = tiny
    rows = [greedy(20), jd.SamplingParams(seed=3, max_tokens=9),
            jd.SamplingParams(seed=5, max_tokens=20, temperature=2.0)]
    for trace in (True, False):
        out = jd.generate(model, params, PROMPTS, rows, processors=[chaining()], trace=trace)
        assert len(set(out.lengths.tolist())) > 1  # rows end at different steps
        check_chain(out, PROMPTS)
    # n > 1: each sample carries its own copy from the shared prompt
    out = jd.generate(model, params, PROMPTS[:1], jd.SamplingParams(n=3, seed=1, max_tokens=12),
                      processors=[chaining()])
    assert len({tuple(out.tokens(r)) for r in range(3)}) > 1
    check_chain(out, PROMPTS[:1] * 3)


def test_state_follows_its_beam_across_reorders(tiny):
    model, params = tiny
    for width in (2, 4):
        out = jd.beam_search(model, params, PROMPTS, num_beams=width, max_new_tokens=12,
                             processors=[chaining()])
        check_chain(out, PROMPTS)
        plain = jd.beam_search(model, params, PROMPTS, num_beams=width, max_new_tokens=12)
        np.testing.assert_array_equal(out.token_ids, plain.token_ids)  # a no-op processor


def test_state_of_rejected_draft_positions_is_dropped(tiny):
    model, params = tiny
    # at odd steps the target removes its own top token; the draft (the same weights) does not
    # know, so its proposals are accepted at even steps and rejected at odd ones
    procs = [jd.LogitProcessor(drop_top_at_odd_steps, "first"), chaining()]
    for draft in (model, LOOKUP):
        for sp in (greedy(24, ignore_eos=True),
                   jd.SamplingParams(seed=2, max_tokens=24, ignore_eos=True)):
            out = jd.speculative_generate(model, params, draft, params, PROMPTS, sp, k=3,
                                          processors=procs)
            s = out.stats
            assert 0 < s["accepted"].sum() < s["proposed"].sum(), (draft, sp)
            check_chain(out, PROMPTS, state_index=1)
            if sp.temperature == 0:  # greedy: exactly the plain decoding with the processors
                ref = jd.generate(model, params, PROMPTS, sp, processors=procs)
                np.testing.assert_array_equal(out.token_ids, ref.token_ids)
    # several branches (greedy): the chosen branch's states are kept
    out = jd.speculative_generate(model, params, LOOKUP, None, PROMPTS,
                                  greedy(24, ignore_eos=True), k=3, num_branches=2,
                                  processors=procs)
    check_chain(out, PROMPTS, state_index=1)
    np.testing.assert_array_equal(out.token_ids, ref.token_ids)


def drop_top_at_odd_steps(logits, ctx):
    top = jnp.argmax(logits, -1)
    hit = (jnp.arange(logits.shape[-1]) == top[:, None]) & (ctx.step % 2 == 1)[:, None]
    return jnp.where(hit, -jnp.inf, logits)


def tilt(logits, ctx):
    """A context-dependent processor: favours token (previous + 1) mod V."""
    v = logits.shape[-1]
    return logits + 2.0 * jax.nn.one_hot((ctx.last_token() + 1) % v, v)


@pytest.mark.parametrize("kind,k", [("draft", 2), (LOOKUP, 2)])
def test_speculative_with_processor_preserves_target_distribution(kind, k):
    tm, dm = Bigram.random(0), Bigram.random(1)
    prompt = [1, 2, 3, 1, 2]
    sp = jd.SamplingParams(n=4000, seed=7, max_tokens=2, temperature=0.9)
    out = jd.speculative_generate(tm, {}, dm if kind == "draft" else LOOKUP, {}, [prompt], sp,
                                  k=k, processors=[jd.LogitProcessor(tilt, "first")])
    table = np.asarray(tm.table, np.float32)
    v = table.shape[0]
    tilted = table + 2.0 * np.eye(v, dtype=np.float32)[(np.arange(v) + 1) % v]
    pvalue, dof = chi_square_pvalue(out.token_ids, two_token_distribution(
        tilted[prompt[-1]], tilted, sp))
    assert pvalue > 1e-3, (pvalue, dof)
    # without the processor the distribution differs: the test can tell them apart
    assert chi_square_pvalue(out.token_ids, two_token_distribution(
        table[prompt[-1]], table, sp))[0] < 1e-6
    assert 0 < out.stats["accepted"].sum() < out.stats["proposed"].sum()


# -- positions, order, and the default path --------------------------------------------------------

def record_input(logits, ctx, state):
    """Keeps the logits it was given at the first step."""
    return logits, jnp.where((ctx.step == 0)[:, None], logits, state)


def test_positions_see_their_stage_of_the_pipeline(tiny):
    model, params = tiny
    v = model.config.vocab_size
    procs = [jd.LogitProcessor(record_input, pos, init_state=np.zeros(v, np.float32))
             for pos in research.POSITIONS]
    sp = jd.SamplingParams(seed=0, temperature=0.5, top_k=3, logit_bias={4: 1.5},
                           max_tokens=4)
    out = jd.generate(model, params, PROMPTS, sp, processors=procs, return_logits=True)
    first, after_pen, after_temp, last = (s for s in out.processor_states)
    raw = out.logits[:, 0]
    np.testing.assert_array_equal(first, raw)
    np.testing.assert_allclose(after_pen, raw + np.eye(v, dtype=np.float32)[4] * 1.5, rtol=1e-6)
    np.testing.assert_allclose(after_temp, after_pen / 0.5, rtol=1e-6)
    assert (np.isfinite(last).sum(-1) == 3).all()  # after top-k
    assert out.processor_order == (
        "custom:record_input@first", "penalties", "bias_and_bans", "masks",
        "custom:record_input@after_penalties", "temperature",
        "custom:record_input@after_temperature", "top_k", "top_p", "min_p",
        "custom:record_input@last", "renormalise", "select")


def identity(logits, ctx):
    return logits


def test_identity_processors_and_empty_options_change_nothing(tiny):
    model, params = tiny
    rows = [greedy(16), jd.SamplingParams(seed=3, max_tokens=16, top_p=0.9, logprobs=2),
            jd.SamplingParams(seed=5, max_tokens=16, repetition_penalty=1.3)]
    base = jd.generate(model, params, PROMPTS, rows)
    same = [jd.generate(model, params, PROMPTS, rows, processors=[]),
            jd.generate(model, params, PROMPTS, rows, processors=[
                jd.LogitProcessor(identity, pos) for pos in research.POSITIONS]),
            jd.generate(model, params, PROMPTS, rows, return_scores=True)]
    for out in same:
        np.testing.assert_array_equal(out.token_ids, base.token_ids)
        np.testing.assert_array_equal(out.logprobs, base.logprobs)
        np.testing.assert_array_equal(out.top_logprobs[1], base.top_logprobs[1])
    assert same[0].processor_order is None and same[0].scores is None


def test_ctx_carries_ids_counts_and_a_per_row_key(tiny):
    model, params = tiny

    def check(logits, ctx, bad):
        m = ctx.prompt_length
        out_ids = jnp.where((jnp.arange(ctx.ids.shape[1]) >= m[:, None])
                            & (ctx.ids >= 0), ctx.ids, logits.shape[-1])
        counts = jnp.zeros_like(ctx.counts).at[jnp.arange(out_ids.shape[0])[:, None],
                                               out_ids].add(1, mode="drop")
        ok = (jnp.all(counts == ctx.counts, -1) & (ctx.length == m + ctx.step)
              & jnp.all((ctx.ids >= 0) == (jnp.arange(ctx.ids.shape[1]) < ctx.length[:, None]),
                        -1))
        noise = jax.vmap(lambda k: jax.random.normal(k, (logits.shape[-1],)))(ctx.key)
        return logits + noise, bad + (~ok & ctx.live).astype(jnp.int32)

    proc = [jd.LogitProcessor(check, "first", init_state=np.int32(0))]
    sp = jd.SamplingParams(seed=11, max_tokens=10, ignore_eos=True)
    out = jd.generate(model, params, PROMPTS, [greedy(10, ignore_eos=True), sp, sp],
                      processors=proc)
    assert (out.processor_states[0] == 0).all()
    # ctx.key depends on the row's seed and step only (contract X1): the same row alone agrees
    alone = jd.generate(model, params, PROMPTS[2:], sp, processors=proc)
    assert alone.tokens(0) == out.tokens(2)
    assert out.tokens(1) != jd.generate(model, params, PROMPTS, sp).tokens(1)


# -- scores and logits -------------------------------------------------------------------------

SCORE_ROWS = [
    greedy(10),
    jd.SamplingParams(seed=1, temperature=0.7, top_k=5, max_tokens=10),
    jd.SamplingParams(seed=2, temperature=1.3, top_p=0.8, min_p=0.05, max_tokens=6),
    jd.SamplingParams(seed=3, frequency_penalty=0.8, presence_penalty=0.4, max_tokens=10),
]


def test_scores_and_logits_match_process_logits(tiny):
    model, params = tiny
    prompts = PROMPTS + [[40, 41]]
    out = jd.generate(model, params, prompts, SCORE_ROWS, return_scores=True,
                      return_logits=True)
    b, n, v = out.scores.shape
    assert out.logits.shape == (b, n, v) and out.scores.dtype == np.float32
    for t in range(n):
        live = out.lengths > t
        history = np.where(np.arange(t)[None, :] < out.lengths[:, None],
                           out.token_ids[:, :t], -1) if t else None
        ref = np.asarray(jd.process_logits(out.logits[:, t], SCORE_ROWS, output_ids=history))
        for r in np.nonzero(live)[0]:
            np.testing.assert_array_equal(np.isneginf(out.scores[r, t]), np.isneginf(ref[r]))
            fin = np.isfinite(ref[r])
            np.testing.assert_allclose(out.scores[r, t][fin], ref[r][fin], atol=1e-5)
            # the raw logits are the model's: a full recompute of prompt + output so far
            _, full = jd.capture_activations(model, params, [prompts[r] + out.tokens(r)[:t]], [],
                                             return_logits=True)
            np.testing.assert_allclose(out.logits[r, t], full[0, -1], atol=1e-4)
        assert (out.scores[~live, t] == 0).all() and (out.logits[~live, t] == 0).all()
    # the selected token is the argmax of the scores for the greedy row
    np.testing.assert_array_equal(out.scores[0].argmax(-1), out.token_ids[0])


def test_outputs_top_k_keeps_the_largest_entries(tiny):
    model, params = tiny
    full = jd.generate(model, params, PROMPTS, SCORE_ROWS[:3], return_scores=True,
                       return_logits=True)
    top = jd.generate(model, params, PROMPTS, SCORE_ROWS[:3], return_scores=True,
                      return_logits=True, outputs_top_k=4)
    assert top.scores.shape == full.scores.shape[:2] + (4,) and top.score_ids.shape[-1] == 4
    for r in range(3):
        for t in range(full.lengths[r]):
            np.testing.assert_array_equal(top.logits[r, t], np.sort(full.logits[r, t])[::-1][:4])
            np.testing.assert_array_equal(full.scores[r, t][top.score_ids[r, t]],
                                          top.scores[r, t])


# -- observers and the host callback --------------------------------------------------------------

def observe(state, out):
    return {"step": state.step, "token": out.token, "top": jnp.max(out.scores, -1)}


def test_observers_are_stacked_per_step_and_the_callback_sees_each_step(tiny):
    model, params = tiny
    rows = [greedy(9), jd.SamplingParams(seed=3, max_tokens=5), greedy(9)]
    for trace in (True, False):
        calls = []
        out = jd.generate(model, params, PROMPTS, rows, observers=[observe], return_scores=True,
                          host_callback=lambda i, tok, obs: calls.append((i, tok, obs)),
                          trace=trace)
        (obs,) = out.observations
        n = out.token_ids.shape[1]
        assert obs["step"].shape == (n, 3) and obs["token"].shape == (n, 3)
        steps = int(out.lengths.max())
        np.testing.assert_array_equal(obs["token"][:steps].T, out.token_ids[:, :steps])
        np.testing.assert_array_equal(obs["step"][:steps].T,
                                      np.minimum(np.arange(1, steps + 1)[None, :],
                                                 out.lengths[:, None]))
        assert [c[0] for c in calls] == list(range(steps))
        for i, tok, o in calls:
            np.testing.assert_array_equal(tok, obs["token"][i])
            np.testing.assert_array_equal(o[0]["top"], obs["top"][i])


# -- no recompiles ---------------------------------------------------------------------------------

def test_no_recompile_for_repeated_calls_with_the_same_processors(tiny):
    model, params = tiny
    sp = jd.SamplingParams(seed=1, max_tokens=10)

    def run(token):
        procs = [banning(token), chaining(), jd.LogitProcessor(identity, "after_temperature")]
        return (jd.generate(model, params, PROMPTS, sp, processors=procs, return_scores=True,
                            observers=[observe], host_callback=lambda *a: None),
                jd.beam_search(model, params, PROMPTS, num_beams=2, max_new_tokens=6,
                               processors=procs),
                jd.speculative_generate(model, params, LOOKUP, None, PROMPTS, sp, k=2,
                                        processors=procs))

    run(3)
    before = jd.compilation_count()
    outs = run(4)  # new processor objects, new state values, a new callback
    assert jd.compilation_count() == before
    assert all(4 not in o.token_ids for o in outs)


# -- bad input names the field -----------------------------------------------------------------

def wrong_shape(logits, ctx):
    return logits[:, :3]


def wrong_state(logits, ctx, state):
    return logits, state.astype(jnp.float32)


def test_bad_processors_and_options_name_the_field(tiny):
    model, params = tiny
    sp = greedy(4)
    cases = [
        (dict(processors=jd.LogitProcessor(identity)), "processors"),
        (dict(processors=[identity]), r"processors\[0\]"),
        (dict(processors=[jd.LogitProcessor(wrong_shape)]), r"processors\[0\] \(wrong_shape\)"),
        (dict(processors=[jd.LogitProcessor(wrong_state, init_state=np.int32(0))]),
         r"processors\[0\]"),
        (dict(observers=[3]), r"observers\[0\]"),
        (dict(host_callback=3), "host_callback"),
        (dict(return_scores="yes"), "return_scores"),
        (dict(outputs_top_k=1000), "outputs_top_k"),
        (dict(return_hidden_states=5), "return_hidden_states"),
        (dict(return_hidden_states=(3,)), "return_hidden_states"),
        (dict(return_hidden_states=("resid.9",)), "return_hidden_states"),
    ]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            jd.generate(model, params, PROMPTS, sp, **kwargs)
    with pytest.raises(ValueError, match="position"):
        jd.LogitProcessor(identity, position="middle")
    with pytest.raises(ValueError, match="fn"):
        jd.LogitProcessor(3)
    with pytest.raises(ValueError, match=r"processors\[1\]"):
        jd.beam_search(model, params, PROMPTS, num_beams=2, max_new_tokens=3,
                       processors=[chaining(), None])
