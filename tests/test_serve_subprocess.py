"""A real `jaxdecode serve` process on the demo model, driven by the official `openai` client:
completions and chat, plain and streamed, logprobs, n = 2, 32 concurrent streams, a stream
closed mid-way (its request is cancelled and counted as transport_error, contract T5), stop strings
in no chunk, seeds, 400s naming the field, raw SSE ids and resume with Last-Event-ID (T4).

One server for the module (started once, SIGINT at the end: it must exit 0); small max_tokens
keep the module fast.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import re
import time

import httpx
import pytest

from tests.serve_process import serve

openai = pytest.importorskip("openai")

PROMPT = "def add(a, b):"
CHAT = [{"role": "user", "content": "Write a function that adds two numbers."}]


def _metric(url: str, name: str, **labels) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pat = re.escape(name) + (r"\{" + re.escape(want) + r"\}" if labels else "") + r" (\S+)"
    m = re.search(r"^" + pat + "$", text, re.M)
    return float(m.group(1)) if m else 0.0


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "server.log"
    with serve(log, "--max-slots", "8", "--max-len", "256", "--max-num-beams", "8") as (_, base):
        yield base


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def _check_chat_entries(content, top_n: int) -> None:
    for e in content:
        assert e.logprob <= 0 and e.bytes == list(e.token.encode())
        tops = [t.logprob for t in e.top_logprobs]
        assert len(tops) == top_n and tops == sorted(tops, reverse=True)
        assert all(t <= 0 for t in tops)
        # temperature 0: the chosen token is the most likely one
        assert e.top_logprobs[0].token == e.token
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob, abs=1e-4)


def test_completions_logprobs(client):
    r = client.completions.create(model="demo", prompt=PROMPT, max_tokens=6, temperature=0,
                                  logprobs=3)
    choice = r.choices[0]
    lp = choice.logprobs
    n = len(lp.tokens)
    assert 0 < n <= r.usage.completion_tokens
    assert len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert all(x <= 0 for x in lp.token_logprobs)
    for token, x, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert token in top and top[token] == pytest.approx(x)
        assert top[token] == max(top.values()) and 1 <= len(top) <= 4
        assert list(top.values()) == sorted(top.values(), reverse=True)

    streamed = client.completions.create(model="demo", prompt=PROMPT, max_tokens=6,
                                         temperature=0, logprobs=3, stream=True)
    tokens, text = [], ""
    for chunk in streamed:
        c = chunk.choices[0]
        text += c.text
        if c.logprobs is not None:
            tokens += c.logprobs.tokens
    assert text == choice.text and tokens == lp.tokens


def test_chat_logprobs_plain_and_streamed(client):
    r = client.chat.completions.create(model="demo", messages=CHAT, max_tokens=6,
                                       temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert 0 < len(content) <= r.usage.completion_tokens
    _check_chat_entries(content, 2)

    stream = client.chat.completions.create(model="demo", messages=CHAT, max_tokens=6,
                                            temperature=0, logprobs=True, top_logprobs=2,
                                            stream=True)
    entries, finish = [], None
    for chunk in stream:
        c = chunk.choices[0]
        if c.logprobs is not None:
            entries += c.logprobs.content
        finish = c.finish_reason or finish
    _check_chat_entries(entries, 2)
    assert [e.token for e in entries] == [e.token for e in content]
    assert finish in ("length", "stop")

    plain = client.chat.completions.create(model="demo", messages=CHAT, max_tokens=3)
    assert plain.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="demo", messages=CHAT, max_tokens=3,
                                       top_logprobs=2)
    assert err.value.param == "top_logprobs"


def test_n2_gives_two_choices_each_with_its_logprobs(client):
    r = client.completions.create(model="demo", prompt=PROMPT, max_tokens=4, n=2, seed=1,
                                  temperature=0.8, logprobs=1)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert all(c.finish_reason in ("length", "stop") for c in r.choices)
    assert all(0 < len(c.logprobs.tokens) <= 4 for c in r.choices)

    stream = client.chat.completions.create(model="demo", messages=CHAT, max_tokens=4, n=2,
                                            seed=1, stream=True, logprobs=True)
    entries, finishes = {0: [], 1: []}, {}
    for chunk in stream:
        for c in chunk.choices:
            if c.logprobs is not None:
                entries[c.index] += c.logprobs.content
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert sorted(finishes) == [0, 1]
    assert all(0 < len(e) <= 4 for e in entries.values())


def test_32_concurrent_streams_all_finish(url):
    async def one(ac, i: int):
        stream = await ac.completions.create(model="demo", prompt=f"{PROMPT} # {i}",
                                             max_tokens=8, temperature=0.7, seed=i,
                                             stream=True)
        finish = None
        async for chunk in stream:
            if chunk.choices:
                finish = chunk.choices[0].finish_reason or finish
        return finish

    async def run():
        ac = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0,
                                timeout=120)
        try:
            return await asyncio.gather(*(one(ac, i) for i in range(32)))
        finally:
            await ac.close()

    finishes = asyncio.run(run())
    assert len(finishes) == 32 and all(f in ("length", "stop") for f in finishes), finishes


def test_closing_a_stream_cancels_its_request(client, url):
    before = _metric(url, "jaxdecode_requests_total", finish_reason="transport_error")
    stream = client.completions.create(model="demo", prompt=PROMPT, max_tokens=200,
                                       temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done = _metric(url, "jaxdecode_requests_total", finish_reason="transport_error")
        if done == before + 1 and _metric(url, "jaxdecode_requests_running") == 0:
            break
        time.sleep(0.1)
    assert _metric(url, "jaxdecode_requests_running") == 0
    assert _metric(url, "jaxdecode_requests_total",
                   finish_reason="transport_error") == before + 1


def _sse(response) -> list:
    """(id, data) pairs of a raw SSE response, in order."""
    events, seq = [], None
    for line in response.iter_lines():
        if line.startswith("id:"):
            seq = int(line[3:].strip())
        elif line.startswith("data:"):
            events.append((seq, line[5:].strip()))
            seq = None
    return events


def test_completions_and_chat_plain_and_streamed_agree(client):
    plain = client.completions.create(model="demo", prompt=PROMPT, max_tokens=12, temperature=0)
    streamed = client.completions.create(model="demo", prompt=PROMPT, max_tokens=12,
                                         temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == plain.choices[0].text
    chat = client.chat.completions.create(model="demo", messages=CHAT, max_tokens=12,
                                          temperature=0)
    chunks = client.chat.completions.create(model="demo", messages=CHAT, max_tokens=12,
                                            temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat.choices[0].message.content and chat.usage.completion_tokens == 12


def test_stop_string_never_appears_in_any_chunk(client):
    full = client.completions.create(model="demo", prompt=PROMPT, max_tokens=24,
                                     temperature=0).choices[0].text
    stop = full[len(full) // 2: len(full) // 2 + 3]
    assert len(stop) == 3
    chunks = [c.choices[0].text for c in client.completions.create(
        model="demo", prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop], stream=True)
        if c.choices]
    text = "".join(chunks)
    assert all(stop not in c for c in chunks) and stop not in text
    assert text == full[: full.index(stop)]


def test_seeded_sampling_reproduces(client):
    def sample(seed):
        return client.completions.create(model="demo", prompt=PROMPT, max_tokens=16,
                                         temperature=1.0, seed=seed).choices[0].text

    assert sample(7) == sample(7)
    assert len({sample(s) for s in (1, 2, 3)}) > 1


def test_bad_inputs_get_400_naming_param_and_the_server_keeps_serving(client):
    for kwargs, param in (({"temperature": -1}, "temperature"), ({"top_p": 2}, "top_p"),
                          ({"max_tokens": 0}, "max_tokens"), ({"logprobs": 99}, "logprobs"),
                          ({"prompt": "x" * 5000}, "prompt")):
        args = {"model": "demo", "prompt": PROMPT, "max_tokens": 4, **kwargs}
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(**args)
        assert err.value.status_code == 400
        body = err.value.body
        assert body["type"] == "invalid_request_error" and body["param"] == param, body
    ok = client.completions.create(model="demo", prompt=PROMPT, max_tokens=3, temperature=0)
    assert ok.usage.completion_tokens == 3


def test_issue_12_reproductions_get_400s_at_once_and_hurt_no_bystander(url):
    """The five measured requests of issue #12 against `jaxdecode serve --model demo`: each a
    400 naming its field within a second, /health 200 throughout, and streams running beside
    them get exactly the text they get alone."""
    from tests.hostile import REPRODUCTIONS

    bodies = [{"model": "demo", "prompt": f"{PROMPT} # {i}", "max_tokens": 200,
               "temperature": 0.8, "seed": i} for i in range(4)]
    alone = [httpx.post(url + "/v1/completions", json=b, timeout=120).json()["choices"][0]
             for b in bodies]

    def stream(body):
        text = ""
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True},
                          timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    assert "error" not in chunk, chunk
                    text += chunk["choices"][0]["text"] if chunk["choices"] else ""
        return text

    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        beside = [pool.submit(stream, b) for b in bodies]
        for extra, param in REPRODUCTIONS:
            t0 = time.perf_counter()
            r = httpx.post(url + "/v1/completions",
                           json={"model": "demo", "prompt": "def add(a, b):", **extra},
                           timeout=30)
            assert time.perf_counter() - t0 < 1.0, extra
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
            assert httpx.get(url + "/health", timeout=5).status_code == 200
        assert [f.result(120) for f in beside] == [c["text"] for c in alone]
    r = httpx.post(url + "/v1/completions", json={"model": "demo", "prompt": "x",
                                                  "num_beams": 9}, timeout=30)  # the flag
    assert r.status_code == 400 and "at most 8" in r.json()["error"]["message"]


def test_raw_sse_ids_increase_done_is_last_and_resume_with_last_event_id(url):
    body = {"model": "demo", "prompt": PROMPT, "max_tokens": 10, "temperature": 0,
            "stream": True}
    with httpx.Client(base_url=url, timeout=60, headers={"X-Event-Ids": "true"}) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            rid = r.headers["x-request-id"]
            full = _sse(r)
        ids = [i for i, _ in full[:-1]]
        assert ids == sorted(set(ids)) and full[-1][1] == "[DONE]"
        assert sum(d == "[DONE]" for _, d in full) == 1
        for last in (ids[0], ids[len(ids) // 2]):
            with c.stream("GET", f"/v1/streams/{rid}",
                          headers={"Last-Event-ID": str(last)}) as rr:
                assert rr.status_code == 200
                assert _sse(rr) == [e for e in full if e[0] is None or e[0] > last]
