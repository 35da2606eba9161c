"""The HTTP server (serving/, docs/architecture.md "Command line and HTTP", contract §6 T1-T5, §7, §9).

One tiny engine and one uvicorn server on a loopback socket serve the whole module. The model is
a HookedModel (tests/scripted.py) over a byte-level tokenizer whose ids are the bytes themselves:
after the token at position p it predicts byte SCRIPT[p] with a peak so high that sampling at any
temperature replays the script, so every expected text is computed by hand. `CONTROL` slows,
blocks or fails the model's steps from inside the jitted forward.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import re
import threading
import time
from contextlib import ExitStack

import httpx
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import jaxdecode as jd
from serving.app import create_app
from serving.chat import chat_prompt_ids, simple_template
from serving.logs import JsonFormatter
from serving.server import ServerThread
from tests.host_fixtures import byte_tokenizer
from tests.scripted import HOOKS, HookedModel
from tests.serve_process import serve

KEY = "sk-test-key"
MODEL = "tiny"
EOS = 256
EOS_POS = 100  # the script predicts EOS after position 100
TEXT = ("Hello world! The quick brown fox jumps over the lazy dog. " * 3)[:128]
SCRIPT = [ord(c) for c in TEXT]
SCRIPT[EOS_POS] = EOS
MAX_LEN = 128
MAX_QUEUE = 4
MAX_BODY = 64 * 1024

CONTROL: dict = {}


def _reset_control():
    CONTROL.update(delay=0.0, gate=None, fail=False, entered=threading.Event())


def _hook(positions, lengths):
    CONTROL["entered"].set()
    gate = CONTROL["gate"]
    if gate is not None:
        gate.wait(20)
    if CONTROL["delay"]:
        time.sleep(CONTROL["delay"])
    if CONTROL["fail"]:
        raise RuntimeError("injected device failure")


def expected(prompt_len: int, n: int) -> str:
    """The text of n tokens after a prompt of prompt_len tokens (no EOS in between)."""
    out = SCRIPT[prompt_len - 1:prompt_len - 1 + n]
    assert EOS not in out
    return bytes(out).decode()


CHAT_HI = simple_template([{"role": "user", "content": "Hi"}])  # "<|user|>\nHi\n<|assistant|>\n"


@pytest.fixture(scope="module")
def llm():
    _reset_control()
    HOOKS["serving"] = _hook
    model = HookedModel.make(SCRIPT, "serving", vocab_size=257, max_len=MAX_LEN,
                             eos_token_ids=(EOS,), peak=40.0)
    with jd.LLM(model, {}, byte_tokenizer(), max_slots=4, max_len=MAX_LEN,
                max_queue=MAX_QUEUE) as engine:
        yield engine


@pytest.fixture(scope="module")
def server(llm):
    app = create_app(llm, model_name=MODEL, api_key=KEY, max_body_bytes=MAX_BODY,
                     keepalive_s=0.2)
    with ServerThread(app) as srv:
        srv.app = app
        yield srv


@pytest.fixture(autouse=True)
def control():
    _reset_control()
    yield CONTROL
    gate = CONTROL.get("gate")
    if gate is not None:
        gate.set()
    _reset_control()


@pytest.fixture
def client(server):
    # Streams carry SSE ids only on request (T1 resumable streams); these tests ask for them.
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}",
                                                    "X-Event-Ids": "true"},
                      timeout=30) as c:
        yield c


def sse(resp_or_lines):
    """Yield (id, data) per server-sent event as it arrives (comment lines are skipped)."""
    lines = resp_or_lines.iter_lines() if hasattr(resp_or_lines, "iter_lines") else resp_or_lines
    ev_id, data = None, []
    for line in lines:
        if line == "":
            if data:
                yield ev_id, "\n".join(data)
            ev_id, data = None, []
        elif line.startswith(":"):
            continue
        elif line.startswith("id:"):
            ev_id = int(line[3:].strip())
        elif line.startswith("data:"):
            data.append(line[5:][1:] if line[5:6] == " " else line[5:])
    if data:
        yield ev_id, "\n".join(data)


def stream_all(client, path, body, **kw):
    with client.stream("POST", path, json=body, **kw) as r:
        assert r.status_code == 200, r.read()
        return r, list(sse(r))


def chunks_of(events):
    return [json.loads(d) for _, d in events if d != "[DONE]"]


def metric(client, name, **labels) -> float:
    text = client.get("/metrics").text
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pat = re.escape(name) + (r"\{" + re.escape(want) + r"\}" if labels else "") + r" (\S+)"
    m = re.search(r"^" + pat + "$", text, re.M)
    return float(m.group(1)) if m else 0.0


def wait_until(pred, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return False


# -- the official client on a real socket -------------------------------------------------------

def test_openai_client_completions_chat_and_streaming(server):
    import openai

    oc = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in oc.models.list().data] == [MODEL]

    r = oc.completions.create(model=MODEL, prompt="Hi", max_tokens=5, temperature=0)
    assert r.choices[0].text == expected(2, 5) == "ello "
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == 2 and r.usage.completion_tokens == 5
    assert r.choices[0].model_extra["jaxdecode_finish_reason"] == "max_output_tokens"

    c = oc.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                   max_tokens=6, temperature=0.7, seed=3)
    assert c.choices[0].message.role == "assistant"
    assert c.choices[0].message.content == expected(len(CHAT_HI), 6)
    assert c.usage.prompt_tokens == len(CHAT_HI)

    stream = oc.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                        max_completion_tokens=7, stream=True,
                                        stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == expected(len(CHAT_HI), 7)
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 7

    stream = oc.completions.create(model=MODEL, prompt="Hi", max_tokens=4, stream=True)
    assert "".join(ch.choices[0].text for ch in stream) == expected(2, 4)

    with pytest.raises(openai.BadRequestError) as e:
        oc.completions.create(model=MODEL, prompt="Hi", temperature=-1)
    assert e.value.status_code == 400 and e.value.param == "temperature"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong",
                      max_retries=0).models.list()


# -- SSE framing, T1 ----------------------------------------------------------------------------

def test_stream_T1_ids_only_when_asked_so_plain_openai_clients_see_plain_data(server):
    """Clients that split on `data:` alone (vLLM's bench, many SDKs) get no `id:` lines;
    `stream_options.include_ids` or `X-Event-Ids: true` turn them on."""
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 4, "stream": True}
    auth = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=server.url, headers=auth, timeout=30) as plain:
        _, events = stream_all(plain, "/v1/completions", body)
        assert events and all(i is None for i, _ in events)
        _, events = stream_all(plain, "/v1/completions",
                               {**body, "stream_options": {"include_ids": True}})
        assert [i for i, _ in events if i is not None] and events[-1][1] == "[DONE]"
        _, events = stream_all(plain, "/v1/completions", body, headers={"X-Event-Ids": "true"})
        assert all(i is not None for i, d in events if d != "[DONE]")


def test_stream_T1_sse_ids_strictly_increase_and_done_is_last(client, server):
    r, events = stream_all(client, "/v1/completions",
                           {"model": MODEL, "prompt": "Hi", "max_tokens": 12, "stream": True})
    assert r.headers["content-type"].startswith("text/event-stream")
    rid = r.headers["x-request-id"]
    ids = [i for i, _ in events]
    assert None not in ids and ids == sorted(set(ids)) and ids == list(range(len(ids)))
    assert events[-1][1] == "[DONE]" and sum(d == "[DONE]" for _, d in events) == 1
    chunks = chunks_of(events)
    assert all(ch["id"] == rid and ch["object"] == "text_completion" for ch in chunks)
    assert "usage" not in chunks[0]
    assert "".join(ch["choices"][0]["text"] for ch in chunks) == expected(2, 12)
    finals = [ch["choices"][0]["finish_reason"] for ch in chunks]
    assert finals[:-1] == [None] * (len(finals) - 1) and finals[-1] == "length"
    # n = 1: the SSE id of every chunk is the engine stream's seq (start, deltas, terminal)
    handle = server.app.state.server.registry.get(rid).handles[0]
    engine_events = handle.events_after(-1)
    assert [e.seq for e in engine_events] == ids[:-1]
    assert [e.kind for e in engine_events][0] == "start"
    assert engine_events[-1].kind == "completed"


def test_logprobs_completions_and_chat_formats(client):
    """OpenAI's two logprobs objects, exact on the scripted model (peak 40: the chosen token has
    logprob ~0, every other -40, ties ranked by id)."""
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 5,
                                             "temperature": 0, "logprobs": 2})
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["tokens"] == list("ello ") and lp["text_offset"] == [0, 1, 2, 3, 4]
    assert all(-1e-3 < x <= 0 for x in lp["token_logprobs"])
    for token, top in zip(lp["tokens"], lp["top_logprobs"]):
        assert len(top) == 2 and top[token] == max(top.values())
        assert sorted(top.values()) == [pytest.approx(-40.0, abs=1e-3), top[token]]

    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": MSG,
                                                  "max_tokens": 4, "logprobs": True})
    content = r.json()["choices"][0]["logprobs"]["content"]
    want = expected(len(CHAT_HI), 4)
    assert [c["token"] for c in content] == list(want)
    assert [c["bytes"] for c in content] == [list(ch.encode()) for ch in want]
    assert all(c["top_logprobs"] == [] and c["logprob"] <= 0 for c in content)

    r, events = stream_all(client, "/v1/chat/completions", {
        "model": MODEL, "messages": MSG, "max_tokens": 6, "stream": True, "logprobs": True,
        "top_logprobs": 3})
    chunks = chunks_of(events)
    entries = [e for ch in chunks if ch["choices"] and ch["choices"][0]["logprobs"]
               for e in ch["choices"][0]["logprobs"]["content"]]
    assert "".join(e["token"] for e in entries) == expected(len(CHAT_HI), 6)
    for e in entries:
        tops = [t["logprob"] for t in e["top_logprobs"]]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert e["top_logprobs"][0]["token"] == e["token"]
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
    assert r.json()["choices"][0]["logprobs"] is None



def test_stream_include_usage_one_final_chunk(client):
    _, events = stream_all(client, "/v1/chat/completions",
                           {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                            "max_tokens": 3, "stream": True,
                            "stream_options": {"include_usage": True}})
    chunks = chunks_of(events)
    with_usage = [ch for ch in chunks if ch.get("usage") is not None]
    assert len(with_usage) == 1 and with_usage[0] is chunks[-1]
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {"prompt_tokens": len(CHAT_HI), "completion_tokens": 3,
                                   "total_tokens": len(CHAT_HI) + 3,
                                   "prompt_tokens_details": {"cached_tokens": 0}}
    assert all("usage" in ch and ch["usage"] is None for ch in chunks[:-1])
    assert events[-1][1] == "[DONE]"


def test_stream_opening_chunk_arrives_with_the_first_token(client):
    """A client timing the first chunk (vLLM's `bench serve` does) measures the time to the
    first token: the text-less opening chunk is held until the first token is out."""
    gate = CONTROL["gate"] = threading.Event()
    arrivals: list = []

    def read(path, body):
        with client.stream("POST", path, json={**body, "max_tokens": 3, "stream": True}) as r:
            arrivals.extend((time.perf_counter(), d) for _, d in sse(r))

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        done = [pool.submit(read, "/v1/completions", {"model": MODEL, "prompt": "Hi"}),
                pool.submit(read, "/v1/chat/completions",
                            {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]})]
        assert CONTROL["entered"].wait(10)  # the engine is held in the prefill
        time.sleep(0.3)
        released = time.perf_counter()
        gate.set()
        [f.result(30) for f in done]
    assert len(arrivals) == 2 * 6 and all(t > released for t, _ in arrivals)


# -- resume, T4 ---------------------------------------------------------------------------------

def test_stream_T4_resume_with_last_event_id_returns_exactly_the_rest(client):
    r, full = stream_all(client, "/v1/chat/completions",
                         {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                          "max_tokens": 8, "stream": True,
                          "stream_options": {"include_usage": True}})
    rid = r.headers["x-request-id"]
    last = full[-1][0]
    for k in (-1, 0, 3, last - 1, last):
        headers = {"Last-Event-ID": str(k)} if k >= 0 else {}
        with client.stream("GET", f"/v1/streams/{rid}", headers=headers) as rr:
            assert rr.status_code == 200 and rr.headers["x-request-id"] == rid
            assert list(sse(rr)) == full[k + 1:]
    bad = client.get(f"/v1/streams/{rid}", headers={"Last-Event-ID": str(last + 1)})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "Last-Event-ID"
    bad = client.get(f"/v1/streams/{rid}", headers={"Last-Event-ID": "x"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "Last-Event-ID"
    missing = client.get("/v1/streams/cmpl-nope")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "stream_not_found"


def test_stream_T4_T5_reconnect_after_a_drop_continues_without_duplicates(llm):
    """Policy `continue`: the dropped request keeps running; a reconnect with the last id seen
    gets the rest, each event once, in order."""
    app = create_app(llm, model_name=MODEL, on_disconnect="continue")
    CONTROL["delay"] = 0.01
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=30,
                                                headers={"X-Event-Ids": "true"}) as c:
        seen = []
        with c.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": "Hi",
                                                       "max_tokens": 30, "stream": True}) as r:
            rid = r.headers["x-request-id"]
            for ev in sse(r):
                seen.append(ev)
                if len(seen) == 3:
                    break  # drop the connection mid-stream
        log = app.state.server.registry.get(rid)
        assert not log.tracked.transport_error
        with c.stream("GET", f"/v1/streams/{rid}",
                      headers={"Last-Event-ID": str(seen[-1][0])}) as r2:
            rest = list(sse(r2))
        events = seen + rest
        assert [i for i, _ in events] == list(range(len(events)))
        assert events[-1][1] == "[DONE]"
        chunks = chunks_of(events)
        assert "".join(ch["choices"][0]["text"] for ch in chunks) == expected(2, 30)
        assert chunks[-1]["choices"][0]["jaxdecode_finish_reason"] == "max_output_tokens"
        assert log.handles[0].state == jd.RequestState.FINISHED


# -- disconnect, T5 -----------------------------------------------------------------------------

def test_stream_T5_disconnect_cancels_and_is_recorded_as_transport_error(client, server):
    before = metric(client, "jaxdecode_requests_total", finish_reason="transport_error")
    CONTROL["delay"] = 0.02
    with client.stream("POST", "/v1/completions",
                       json={"model": MODEL, "prompt": "Hi", "max_tokens": 120,
                             "ignore_eos": True, "stream": True}) as r:
        rid = r.headers["x-request-id"]
        it = sse(r)
        first = [next(it), next(it)]
    log = server.app.state.server.registry.get(rid)
    handle = log.handles[0]
    assert wait_until(lambda: handle.done, 10), "the request was not cancelled"
    assert handle.state == jd.RequestState.CANCELLED
    assert handle.completion().finish_reason == jd.FinishReason.CANCELLED  # never EOS
    assert handle.usage().selected_tokens < 120
    assert wait_until(lambda: metric(client, "jaxdecode_requests_total",
                                     finish_reason="transport_error") == before + 1, 5)
    assert log.tracked.transport_error
    # a reconnecting reader sees the ending as transport_error, never as eos / "stop"
    with client.stream("GET", f"/v1/streams/{rid}",
                       headers={"Last-Event-ID": str(first[-1][0])}) as r2:
        rest = chunks_of(list(sse(r2)))
    final = rest[-1]["choices"][0]
    assert final["jaxdecode_finish_reason"] == "transport_error"
    assert final["finish_reason"] == "abort"


def test_nonstream_disconnect_cancels_too(client, server):
    before = metric(client, "jaxdecode_requests_total", finish_reason="transport_error")
    CONTROL["delay"] = 0.03
    with pytest.raises(httpx.ReadTimeout):
        client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 120,
                                             "ignore_eos": True}, timeout=0.5)
    assert wait_until(lambda: metric(client, "jaxdecode_requests_total",
                                     finish_reason="transport_error") == before + 1, 10)
    assert wait_until(lambda: server.app.state.server.llm.num_running == 0, 5)


# -- errors -------------------------------------------------------------------------------------

MSG = [{"role": "user", "content": "Hi"}]
BAD = [
    ("/v1/completions", {"prompt": "Hi", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "Hi", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": "Hi", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": "5"}, "max_tokens"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": True}, "max_tokens"),
    ("/v1/completions", {"prompt": "Hi", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "Hi", "stop": ""}, "stop"),
    ("/v1/completions", {"prompt": "Hi", "stop": ["a", 3]}, "stop"),
    ("/v1/completions", {"prompt": "Hi", "seed": -1}, "seed"),
    ("/v1/completions", {"prompt": "Hi", "logit_bias": {"99999": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "Hi", "logit_bias": {"x": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "Hi", "top_k": -5}, "top_k"),
    ("/v1/completions", {"prompt": "Hi", "min_p": 2}, "min_p"),
    ("/v1/completions", {"prompt": "Hi", "repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"prompt": "Hi", "presence_penalty": None, "frequency_penalty": "x"},
     "frequency_penalty"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 5, "min_tokens": 9}, "min_tokens"),
    ("/v1/completions", {"prompt": "Hi", "include_stop_str_in_output": "yes"},
     "include_stop_str_in_output"),
    ("/v1/completions", {"prompt": "Hi", "response_format": {
        "type": "json_schema", "json_schema": {"schema": 3}}}, "response_format"),
    ("/v1/completions", {"prompt": "Hi", "response_format": {"type": "nope"}}, "response_format"),
    ("/v1/completions", {"prompt": "Hi", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "Hi", "logprobs": -1}, "logprobs"),
    ("/v1/completions", {"prompt": "Hi", "logprobs": True}, "logprobs"),
    ("/v1/completions", {"prompt": "Hi", "echo": True}, "echo"),
    ("/v1/completions", {"prompt": "Hi", "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": "Hi", "num_beams": 2, "stream": True}, "stream"),
    ("/v1/completions", {"prompt": "Hi", "num_beams": 0}, "num_beams"),
    ("/v1/completions", {"prompt": "Hi", "num_beams": 2, "n": 3}, "n"),
    ("/v1/completions", {"prompt": "Hi", "num_beams": 2, "early_stopping": "soon"},
     "early_stopping"),
    ("/v1/completions", {"prompt": "Hi", "num_beams": 2, "length_penalty": "x"},
     "length_penalty"),
    ("/v1/completions", {"prompt": "Hi", "num_beams": 2, "temperature": 0.5}, "temperature"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": [999]}, "prompt"),
    ("/v1/completions", {"prompt": ["a", "b"]}, "prompt"),
    ("/v1/completions", {"prompt": {"text": "Hi"}}, "prompt"),
    ("/v1/completions", {"max_tokens": 3}, "prompt"),
    ("/v1/completions", {"prompt": "a" * 300}, "prompt"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "x"}]}, "messages[0].role"),
    ("/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a" * 300}]}, "messages"),
    ("/v1/chat/completions", {"messages": MSG, "max_completion_tokens": 0},
     "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": MSG, "logprobs": 1}, "logprobs"),
    ("/v1/chat/completions", {"messages": MSG, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": MSG, "logprobs": True, "top_logprobs": 21},
     "top_logprobs"),
    ("/v1/chat/completions", {"messages": MSG, "tools": [{"type": "function"}]}, "tools"),
    ("/v1/chat/completions", {"messages": MSG, "stream_options": {"include_usage": 1}},
     "stream_options.include_usage"),
]


def test_bad_fields_get_400_with_the_openai_error_body_naming_param(client):
    for path, body, param in BAD:
        r = client.post(path, json={"model": MODEL, **body})
        assert r.status_code == 400, (body, r.status_code, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        assert err["type"] == "invalid_request_error"
        assert err["param"] == param, (body, err)
        assert err["message"].startswith(param.split("[")[0]), err
        assert r.headers["x-request-id"]
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "a" * 300})
    assert r.json()["error"]["code"] == "context_length_exceeded"
    r = client.post("/v1/completions", content=b'{"prompt": ', headers={"content-type": "x"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = client.post("/v1/completions", json={"model": "gpt-4", "prompt": "Hi"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = client.post("/v1/completions", content=b"x" * (MAX_BODY + 1))
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = client.get("/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    assert metric(client, "jaxdecode_requests_rejected_total", reason="invalid_value") > 0


def test_beam_search_S10_extension_fields_give_the_n_best_beams(client):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 6, "num_beams": 3, "n": 2,
            "length_penalty": 0.5, "early_stopping": "never"}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    assert choices[0]["text"] == expected(5, 6)  # the script's path is the best beam
    assert choices[1]["text"] != choices[0]["text"]
    assert choices[0]["score"] >= choices[1]["score"]
    assert r.json()["usage"]["completion_tokens"] == 12
    plain = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hello",
                                                 "max_tokens": 2})
    assert "score" not in plain.json()["choices"][0]


def test_auth_401_without_the_key_and_health_open(server):
    with httpx.Client(base_url=server.url, timeout=10) as c:
        for path, method in (("/v1/models", "GET"), ("/v1/completions", "POST"),
                             ("/v1/chat/completions", "POST"), ("/metrics", "GET"),
                             ("/v1/streams/x", "GET")):
            r = c.request(method, path, json={"prompt": "Hi"})
            assert r.status_code == 401, path
            assert r.json()["error"]["code"] == "invalid_api_key"
            assert r.headers["www-authenticate"] == "Bearer"
        r = c.get("/v1/models", headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
        r = c.get("/health")
        assert r.status_code == 200 and r.json()["status"] == "ok"
        r = c.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200 and r.json()["data"][0]["id"] == MODEL


def test_queue_full_gets_429_with_retry_after(client, server):
    gate = CONTROL["gate"] = threading.Event()
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "stream": True}
    with ExitStack() as stack:
        opened = [stack.enter_context(client.stream("POST", "/v1/completions", json=body))]
        assert CONTROL["entered"].wait(10)  # the engine is stuck in a step
        rejected = None
        for _ in range(4 + MAX_QUEUE + 2):
            r = stack.enter_context(client.stream("POST", "/v1/completions", json=body))
            if r.status_code == 429:
                rejected = r
                break
            assert r.status_code == 200
            opened.append(r)
        assert rejected is not None, "no 429 while the queue was full"
        rejected.read()
        assert rejected.headers["retry-after"] == "1"
        err = rejected.json()["error"]
        assert err["code"] == "queue_full" and err["type"] == "rate_limit_error"
        assert metric(client, "jaxdecode_requests_waiting") == MAX_QUEUE
        time.sleep(0.5)  # idle streams get keep-alive comments meanwhile
        gate.set()
        for k, r in enumerate(opened):
            lines = list(r.iter_lines())
            if k == len(opened) - 1:
                assert ": keep-alive" in lines
            events = list(sse(lines))
            assert events[-1][1] == "[DONE]"
            assert chunks_of(events)[-1]["choices"][0]["finish_reason"] == "length"


def test_device_failure_fails_the_running_set_and_health_degrades_then_recovers(client, llm):
    """Every step fails (the device itself: even an empty step): the running requests fail,
    /health is 503 degraded with the reason, and 200 again once a step succeeds."""
    try:
        CONTROL["fail"] = True
        r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 3})
        assert r.status_code == 500
        assert r.json()["error"]["type"] == "server_error"
        assert r.json()["error"]["code"] == "model_error"
        assert "no single request explains it" in r.json()["error"]["message"]
        _, events = stream_all(client, "/v1/completions",
                               {"model": MODEL, "prompt": "Hi", "max_tokens": 3, "stream": True})
        assert events[-1][1] == "[DONE]"
        assert json.loads(events[-2][1])["error"]["code"] == "model_error"
        h = client.get("/health")
        assert h.status_code == 503 and h.json()["status"] == "degraded"
        assert "injected device failure" in h.json()["reason"]
        CONTROL["fail"] = False
        r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected(2, 3)
    finally:
        CONTROL["fail"] = False
    h = client.get("/health")
    assert h.status_code == 200 and h.json()["status"] == "ok" and "reason" not in h.json()
    assert "injected device failure" in llm.error  # the last failure stays on record


# -- results ------------------------------------------------------------------------------------

def test_finish_reasons_map_to_openai_with_the_exact_reason_kept(client):
    def one(**body):
        r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", **body})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]

    eos = one(max_tokens=200)
    assert (eos["finish_reason"], eos["jaxdecode_finish_reason"]) == ("stop", "eos")
    assert eos["text"] == TEXT[1:EOS_POS]
    stop = one(max_tokens=50, stop=["quick", "zzz"])
    assert (stop["finish_reason"], stop["jaxdecode_finish_reason"]) == ("stop", "stop_sequence")
    assert stop["stop_reason"] == "quick" and stop["text"] == TEXT[1:TEXT.index("quick")]
    kept = one(max_tokens=50, stop="quick", include_stop_str_in_output=True)
    assert kept["text"].endswith("quick")
    length = one(max_tokens=4, ignore_eos=True)
    assert (length["finish_reason"], length["jaxdecode_finish_reason"]) == (
        "length", "max_output_tokens")
    ids = one(max_tokens=3, prompt=[72, 105])  # token ids
    assert ids["text"] == expected(2, 3)
    listed = one(max_tokens=3, prompt=["Hi"])
    assert listed["text"] == expected(2, 3)


def test_n_choices_get_indices_and_the_library_seed_rule(client, server):
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": MSG, "n": 3,
                                                  "max_tokens": 4, "seed": 11})
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert {c["message"]["content"] for c in body["choices"]} == {expected(len(CHAT_HI), 4)}
    assert body["usage"]["completion_tokens"] == 12
    assert body["usage"]["prompt_tokens"] == len(CHAT_HI)
    resp, events = stream_all(client, "/v1/completions",
                              {"model": MODEL, "prompt": "Hi", "n": 2, "max_tokens": 5,
                               "seed": 7, "stream": True})
    assert [i for i, _ in events] == list(range(len(events)))
    chunks = chunks_of(events)
    for i in (0, 1):
        mine = [ch["choices"][0] for ch in chunks if ch["choices"][0]["index"] == i]
        assert "".join(c["text"] for c in mine) == expected(2, 5)
        assert mine[-1]["finish_reason"] == "length"
    log = server.app.state.server.registry.get(resp.headers["x-request-id"])
    assert [h.sampling.seed for h in log.handles] == [7, 7]  # one seed, fold_in(key, i)
    assert [h._request.index for h in log.handles] == [0, 1]
    assert [h.request_id for h in log.handles] == [f"{log.request_id}-0", f"{log.request_id}-1"]


def test_metrics_exposes_every_name(client):
    client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 3})
    text = client.get("/metrics").text
    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name: f.type for f in text_string_to_metric_families(text)}
    assert families["jaxdecode_requests"] == "counter"
    assert families["jaxdecode_prompt_tokens"] == "counter"
    assert families["jaxdecode_generation_tokens"] == "counter"
    assert families["jaxdecode_compilations"] == "counter"
    assert families["jaxdecode_requests_running"] == "gauge"
    assert families["jaxdecode_requests_waiting"] == "gauge"
    for h in ("jaxdecode_time_to_first_token_seconds", "jaxdecode_inter_token_latency_seconds",
              "jaxdecode_queue_time_seconds"):
        assert families[h] == "histogram"
    for sample in ('jaxdecode_requests_total{finish_reason="max_output_tokens"}',
                   "jaxdecode_requests_running ", "jaxdecode_requests_waiting ",
                   "jaxdecode_prompt_tokens_total ", "jaxdecode_generation_tokens_total ",
                   "jaxdecode_time_to_first_token_seconds_count ",
                   "jaxdecode_inter_token_latency_seconds_count ",
                   "jaxdecode_queue_time_seconds_count ", "jaxdecode_compilations_total "):
        assert sample in text, sample
    assert metric(client, "jaxdecode_compilations_total") >= 1


def test_logs_are_json_with_the_request_id_and_no_prompt(client, caplog):
    secret = "Hi SECRET"
    with caplog.at_level(logging.INFO, logger="serving"):
        r = client.post("/v1/completions", json={"model": MODEL, "prompt": secret,
                                                 "max_tokens": 2})
        rid = r.headers["x-request-id"]
        assert wait_until(lambda: any(getattr(rec, "fields", {}).get("request_id") == rid
                                      and rec.getMessage() == "request.finished"
                                      for rec in caplog.records), 5)
    lines = [JsonFormatter().format(rec) for rec in caplog.records if rec.name == "serving"]
    mine = [json.loads(line) for line in lines if rid in line]
    assert {m["event"] for m in mine} >= {"request.received", "request.finished"}
    assert all(m["request_id"] == rid for m in mine)
    assert not any("SECRET" in line for line in lines)


def test_chat_template_from_the_tokenizer_or_the_simple_one(hf_tokenizer_dir):
    from transformers import AutoTokenizer

    tok = byte_tokenizer()
    ids, text = chat_prompt_ids(tok, [{"role": "system", "content": "S"},
                                      {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                   {"type": "text", "text": "b"}]}])
    assert text == "<|system|>\nS\n<|user|>\na\nb\n<|assistant|>\n" and ids == list(text.encode())
    hf = AutoTokenizer.from_pretrained(hf_tokenizer_dir)
    hf.chat_template = ("{% for m in messages %}{% if m.role == 'tool' %}"
                        "{{ raise_exception('no tools') }}{% endif %}<{{ m.role }}>{{ m.content }}"
                        "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
    ids, text = chat_prompt_ids(hf, [{"role": "developer", "content": "hello world"}])
    assert text == "<system>hello world<assistant>"
    assert ids == hf(text, add_special_tokens=False)["input_ids"]
    with pytest.raises(ValueError, match="^messages: "):
        chat_prompt_ids(hf, [{"role": "tool", "content": "x"}])


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2", "gemma3", "phi3", "mixtral",
                                    "qwen3_moe"])
def test_hf_checkpoint_dir_with_its_chat_template_in_process(tiny_hf_checkpoint, family):
    """What `jaxdecode serve --model DIR` serves: models.load + a transformers tokenizer whose
    chat template renders the prompt (httpx against the ASGI app, no socket); each family."""
    import asyncio

    import models

    model, params, tok = models.load(tiny_hf_checkpoint(family))
    tok.chat_template = "{% for m in messages %}{{ m.role }}: {{ m.content }} {% endfor %}"
    prompt = tok("user: hello world ", add_special_tokens=False)["input_ids"]
    # the model has 128 logits, the tokenizer 120 tokens: keep the sampler inside the tokenizer
    bias = {str(i): -100.0 for i in range(len(tok), model.config.vocab_size)}
    with jd.LLM(model, params, tok, max_slots=1, max_len=32) as engine:
        want = engine.generate(prompt, jd.SamplingParams(
            temperature=0, max_tokens=4, utf8_errors="replace", logit_bias=bias))[0]
        assert want.error is None
        app = create_app(engine, model_name="tiny-llama")

        async def go():
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
                return await c.post("/v1/chat/completions", json={
                    "model": "tiny-llama", "messages": [{"role": "user", "content": "hello world"}],
                    "max_tokens": 4, "temperature": 0, "logit_bias": bias})

        r = asyncio.run(go())
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["prompt_tokens"] == len(prompt)
    assert body["choices"][0]["message"]["content"] == want.text
    assert body["usage"]["completion_tokens"] == want.usage.selected_tokens


def test_http_n_equals_library_n_and_prefills_the_prompt_once():
    """HTTP `n` is LLM.generate's n (engine/samples.py): the same seed gives the same four
    completions (sample 0 the request alone, sample i fold_in(key, i)), and the four choices
    share one prefill of the prompt (one prefix-cache lookup of its tokens, not four)."""
    import asyncio

    from tests.scripted import ScriptedModel

    model = ScriptedModel.make(SCRIPT, vocab_size=257, max_len=64, peak=1.0)  # near uniform
    bias = {str(i): -100.0 for i in range(128, 257)}  # ASCII only: texts compare exactly
    body = {"model": MODEL, "prompt": "Hello", "n": 4, "max_tokens": 6, "seed": 5,
            "temperature": 1.0, "logit_bias": bias}
    with jd.LLM(model, {}, byte_tokenizer(), max_slots=4, max_len=64, page_size=4) as engine:
        app = create_app(engine, model_name=MODEL)

        async def go():
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
                before = engine.kv_stats()["prefix_cache_queries"]
                r = await c.post("/v1/completions", json=body)
                return r, engine.kv_stats()["prefix_cache_queries"] - before

        r, queried = asyncio.run(go())
        want = engine.generate("Hello", jd.SamplingParams(
            n=4, max_tokens=6, seed=5, temperature=1.0,
            logit_bias={int(k): v for k, v in bias.items()}))
    assert r.status_code == 200, r.text
    texts = [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]
    assert texts == [w.text for w in want]
    assert len(set(texts)) > 1  # the samples differ: the seed rule is what is compared
    assert queried == len("Hello")  # the prompt looked up (and prefilled) once for n = 4


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(base=st.sampled_from([{}, {"prompt": "Hi", "max_tokens": 3},
                             {"messages": MSG, "max_tokens": 3}]),
       extra=st.dictionaries(
    st.sampled_from(["prompt", "messages", "max_tokens", "temperature", "top_p", "n", "stop",
                     "seed", "logit_bias", "stream", "top_k", "min_p", "min_tokens",
                     "stream_options", "response_format", "ignore_eos", "logprobs"]),
    st.one_of(st.none(), st.booleans(), st.integers(-3, 40), st.floats(allow_nan=False),
              st.text(max_size=8), st.lists(st.integers(-2, 300), max_size=3),
              st.lists(st.text(max_size=3), max_size=2),
              st.dictionaries(st.text(max_size=3), st.integers(-1, 3), max_size=2)),
    max_size=6))
def test_no_input_gives_a_500_or_kills_the_engine(server, base, extra):
    body = {**base, **extra}
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=30) as c:
        for path in ("/v1/completions", "/v1/chat/completions"):
            with c.stream("POST", path, content=json.dumps(body),  # Infinity too
                          headers={"content-type": "application/json"}) as r:
                r.read()
                assert r.status_code in (200, 400, 404), (body, r.status_code, r.text)
                if r.status_code == 400:
                    assert r.json()["error"]["type"] == "invalid_request_error"
        assert c.get("/health").status_code == 200


def test_stream_registry_keeps_live_logs_and_bounds_finished_ones():
    from serving.streams import ResponseLog, StreamRegistry

    def log(rid, events=1, done=True):
        lg = ResponseLog(rid, [], chat=False, include_usage=False, created=0, prompt_tokens=1)
        for _ in range(events):
            lg.append("{}")
        if done:
            lg.close()
        return lg

    reg = StreamRegistry(max_finished=2, ttl_s=60.0, max_events=10)
    live = log("live", done=False)
    reg.add(live)
    for rid in ("a", "b", "c"):
        reg.add(log(rid))
    assert reg.get("a") is None and reg.get("b") and reg.get("c") and reg.get("live") is live
    reg.add(log("big", events=10))  # c (1) + big (10) > 10 events: the oldest finished go
    assert reg.get("b") is None and reg.get("c") is None and reg.get("big")
    reg.get("big").finished_at -= 61  # expired
    assert reg.get("big") is None and reg.get("live") is live
    with pytest.raises(RuntimeError):
        reg.get("live").close() or reg.get("live").append("x")


# -- the command line ---------------------------------------------------------------------------

def test_cli_serve_demo_model_with_api_key(tmp_path):
    with serve(tmp_path / "serve.log", "--max-slots", "1", "--max-len", "64",
               "--api-key", "k") as (_, url):
        assert httpx.get(url + "/health").status_code == 200  # open without the key
        with httpx.Client(base_url=url, timeout=60) as c:
            assert c.post("/v1/completions", json={"prompt": "def"}).status_code == 401
            r = c.post("/v1/completions", json={"model": "demo", "prompt": "def f(x):",
                                                "max_tokens": 3, "temperature": 0},
                       headers={"Authorization": "Bearer k"})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 3


def test_replay_X11_server_writes_records_that_replay_identically(llm, tmp_path):
    app = create_app(llm, model_name=MODEL, record_dir=str(tmp_path))
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 8,
                                            "seed": 5, "temperature": 0.7})
        assert r.status_code == 200
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1
    record = jd.GenerationRecord.load(str(files[0]))
    assert record.data["sampling"]["seed"] == 5 and len(record.token_ids) == 8
    assert jd.replay(record, llm).identical
