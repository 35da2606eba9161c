"""One bad request never hurts another (issue #12): a request whose data makes the device step
fail is found and fails alone; the others go on with exactly the tokens they would have had
(contract X1: a row's tokens depend only on its own request). `MarkedModel` (tests/scripted.py)
raises inside the jitted forward for a marked input token, like a device fault."""

import json

import pytest

import jaxdecode as jd
from tests.host_fixtures import s4_tokenizer
from tests.scripted import MarkedModel

CHAIN = (16, 17, 18, 19, 20)  # a prompt ending in 16 reaches the mark (23) at step 5
MARK = 23


@pytest.fixture(scope="module")
def tok():
    return s4_tokenizer()


@pytest.fixture(scope="module")
def model():
    return MarkedModel.make(seed=3, chain=CHAIN, mark=MARK)


PROMPTS = [[1, 2], [3], [5, 6, 7]]
PARAMS = [jd.SamplingParams(temperature=0.0, max_tokens=40, utf8_errors="replace"),
          jd.SamplingParams(temperature=1.0, seed=7, max_tokens=40, utf8_errors="replace"),
          jd.SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=40,
                            frequency_penalty=0.5, repetition_penalty=1.2,
                            utf8_errors="replace")]
BAD = jd.SamplingParams(temperature=0.0, max_tokens=20, utf8_errors="replace")


def reference(model, tok, **kw):
    with jd.LLM(model, {}, tok, max_slots=4, max_len=64, **kw) as llm:
        return llm.generate(PROMPTS, PARAMS)


def check_bystanders(got, want):
    for g, w in zip(got, want):
        assert g.state == jd.RequestState.FINISHED, (g.error, g.events[-1])
        assert g.token_ids == w.token_ids and g.text == w.text
        assert g.finish_reason == w.finish_reason and g.usage == w.usage


def check_culprit(c):
    assert c.state == jd.RequestState.FAILED and c.error == jd.ErrorCode.MODEL_ERROR
    failed = [e for e in c.events if e.kind == "failed"][0]
    assert "marked token 23" in failed.data["message"]
    assert "this request's data" in failed.data["message"]


def test_fault_a_request_that_fails_the_step_mid_run_fails_alone(model, tok):
    want = reference(model, tok)
    # one decode step per call: the others have tokens when the mark fails step 5
    with jd.LLM(model, {}, tok, max_slots=4, max_len=64, decode_steps=1) as llm:
        handles = [llm.submit(p, sp) for p, sp in zip(PROMPTS, PARAMS)]
        bad = llm.submit([4, CHAIN[0]], BAD)  # selects the mark at step 5, with the others
        check_culprit(bad.result(30))
        got = [h.result(30) for h in handles]
        check_bystanders(got, want)
        assert llm.health() == {"status": "ok", "reason": None}
        assert "marked token" in llm.error  # the last failure stays on record
        resumed = [e for e in got[1].events if e.kind == "engine.resumed"]
        assert resumed and resumed[0].data["selected"] > 0  # they were mid-run
        assert [e.kind for e in got[1].events].count("engine.fault") == 1
        again = llm.generate([PROMPTS[0]], PARAMS[0])[0]  # the engine goes on serving
        assert again.token_ids == want[0].token_ids


def test_fault_a_prompt_that_fails_the_prefill_fails_alone_in_its_batch(model, tok):
    want = reference(model, tok)
    with jd.LLM(model, {}, tok, max_slots=4, max_len=64) as llm:
        out = llm.generate(PROMPTS + [[1, MARK, 2]], PARAMS + [BAD])  # one prefill batch
    check_bystanders(out[:3], want)
    check_culprit(out[3])


def test_fault_isolated_in_speculative_rounds(model, tok):
    spec = {"draft": "prompt_lookup", "k": 3}
    want = reference(model, tok, speculative=spec)
    with jd.LLM(model, {}, tok, max_slots=4, max_len=64, speculative=spec) as llm:
        handles = [llm.submit(p, sp) for p, sp in zip(PROMPTS, PARAMS)]
        bad = llm.submit([4, CHAIN[0]], BAD)
        check_culprit(bad.result(30))
        check_bystanders([h.result(30) for h in handles], want)
        assert llm.health()["status"] == "ok"


def test_fault_beam_call_is_retried_without_the_bad_row(model, tok):
    beam = jd.SamplingParams(num_beams=2, n=2, max_tokens=6, utf8_errors="replace")
    with jd.LLM(model, {}, tok, max_slots=4, max_len=64) as llm:
        want = llm.generate([[1, 2], [3]], beam)
        out = llm.generate([[1, 2], [1, MARK], [3]], beam)  # one beam_search call, then halves
        assert [(c.token_ids, c.score) for c in out[:2] + out[4:]] == [
            (c.token_ids, c.score) for c in want]
        assert {c.state for c in out[2:4]} == {jd.RequestState.FAILED}
        assert all(c.error == jd.ErrorCode.MODEL_ERROR for c in out[2:4])
        assert llm.health()["status"] == "ok"


def test_fault_over_http_the_culprit_gets_500_the_streams_their_text_health_200(model, tok):
    import asyncio

    import httpx

    from serving.app import create_app

    def body(prompt, **kw):
        return {"model": "m", "prompt": prompt, "max_tokens": 40, "temperature": 1.0,
                "seed": 5, **kw}

    async def run(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://t", timeout=60) as c:
            alone = [(await c.post("/v1/completions", json=body(p))).json() for p in PROMPTS]
            streams = [asyncio.create_task(c.post("/v1/completions", json=body(p, stream=True)))
                       for p in PROMPTS]
            await asyncio.sleep(0.05)  # the streams are running
            bad = await c.post("/v1/completions", json={"model": "m", "prompt": [4, CHAIN[0]],
                                                        "max_tokens": 10, "temperature": 0})
            got = [await t for t in streams]
            return alone, bad, got, await c.get("/health")

    with jd.LLM(model, {}, tok, max_slots=4, max_len=64) as llm:
        alone, bad, got, health = asyncio.run(run(create_app(llm, model_name="m")))
        assert "marked token" in llm.error
    assert bad.status_code == 500 and bad.json()["error"]["code"] == "model_error"
    assert "this request's data" in bad.json()["error"]["message"]
    for a, g in zip(alone, got):
        chunks = [json.loads(line[6:]) for line in g.text.splitlines()
                  if line.startswith("data: {")]
        assert not any("error" in c for c in chunks)
        assert "".join(c["choices"][0]["text"] for c in chunks) == a["choices"][0]["text"]
    assert health.status_code == 200 and health.json()["status"] == "ok"


def _by_prompt_position(logits, ctx):
    """A stateless custom processor that depends on the prompt length and the step."""
    import jax.numpy as jnp

    favoured = (ctx.prompt_length * 3 + ctx.step) % 16
    return logits + 4.0 * (jnp.arange(logits.shape[-1])[None, :] == favoured[:, None])


def test_fault_a_resumed_request_sees_its_own_prompt_length_in_custom_processors(model, tok):
    processors = [jd.LogitProcessor(_by_prompt_position, position="first")]
    want = reference(model, tok, processors=processors)
    with jd.LLM(model, {}, tok, max_slots=4, max_len=64, processors=processors) as llm:
        handles = [llm.submit(p, sp) for p, sp in zip(PROMPTS, PARAMS)]
        bad = llm.submit([4, CHAIN[0]], BAD)
        check_culprit(bad.result(30))
        got = [h.result(30) for h in handles]
    check_bystanders(got, want)
    resumed = [e for e in got[0].events if e.kind == "engine.resumed"]
    assert resumed and resumed[0].data == {"selected": resumed[0].data["selected"],
                                           "processor_states_reset": False}
