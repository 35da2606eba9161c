"""The HTTP server under hostile input (issue #12): one bad request never hurts another.

One engine -- a ScriptedModel over the byte tokenizer (ids are bytes, so every expected text is
computed by hand) -- behind the real app (`create_app`: the validation the server uses). The
fuzz drives it in-process over ASGI (`httpx.ASGITransport` on an event-loop thread), so
thousands of requests fit in about a minute; the keep-alive and disconnect checks use a real
uvicorn socket. Bystanders: well-formed streams running beside the hostile requests, whose text
must be exactly the script's.
"""

from __future__ import annotations

import asyncio
import collections
import json
import socket
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings

import jaxdecode as jd
from jaxdecode.device import constraints
from serving.app import create_app
from serving.server import ServerThread
from tests.host_fixtures import byte_tokenizer
from tests.hostile import REPRODUCTIONS, bodies
from tests.scripted import ScriptedModel

MODEL = "fuzz"
TEXT = ("Hello world! The quick brown fox jumps over the lazy dog. " * 3)[:128]
SCRIPT = [ord(c) for c in TEXT]
FUZZ_EXAMPLES = 2500
FUZZ_WARMUP = 200  # examples before the RSS baseline (first compilations)


def expected(prompt_len: int, n: int) -> str:
    """The text of n tokens after a prompt of prompt_len tokens (the token after position p
    is SCRIPT[p])."""
    return TEXT[prompt_len - 1:prompt_len - 1 + n]


@pytest.fixture(scope="module")
def llm():
    model = ScriptedModel.make(SCRIPT, vocab_size=257, max_len=128, eos_token_ids=(256,),
                               peak=40.0)
    with jd.LLM(model, {}, byte_tokenizer(), max_slots=4, max_len=128, max_queue=512,
                max_num_beams=4, max_n=8, max_constraint_compile_s=2.0) as engine:
        yield engine


@pytest.fixture(scope="module")
def app(llm):
    return create_app(llm, model_name=MODEL)


class InProcess:
    """The app over ASGI on an event loop of its own thread; `run(coro)` from test code."""

    def __init__(self, app):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                        base_url="http://in-process", timeout=60)

    def run(self, coro, timeout: float = 120):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self):
        self.run(self.client.aclose())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def inproc(app):
    harness = InProcess(app)
    yield harness
    harness.close()


@pytest.fixture(scope="module")
def server(app):
    with ServerThread(app) as srv:
        yield srv


def sse_events(text: str) -> list:
    return [line[6:] for line in text.splitlines() if line.startswith("data: ")]


class Bystanders:
    """Well-formed streams, `count` at a time, until stopped: each must stream exactly the
    script's text and end with finish_reason "length"."""

    def __init__(self, harness: InProcess, count: int = 2):
        self.harness, self.stop = harness, asyncio.Event()
        self.ok, self.failed = 0, []
        self.futures = [asyncio.run_coroutine_threadsafe(self._loop(i), harness.loop)
                        for i in range(count)]

    async def _loop(self, i: int) -> None:
        prompt = "Hello"[:2 + i]
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 24, "stream": True,
                "temperature": 0.9, "stream_options": {"include_usage": True}}
        while not self.stop.is_set():
            r = await self.harness.client.post("/v1/completions", json=body)
            events = sse_events(r.text)
            chunks = [json.loads(e) for e in events[:-1]]
            text = "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
            finish = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")]
            if (r.status_code == 200 and events[-1] == "[DONE]"
                    and text == expected(len(prompt), 24) and finish[-1] == "length"
                    and not any("error" in c for c in chunks)):
                self.ok += 1
            else:
                self.failed.append((r.status_code, r.text[-300:]))
            await asyncio.sleep(0.05)  # beside the fuzz, not instead of it

    def finish(self) -> None:
        self.harness.loop.call_soon_threadsafe(self.stop.set)
        for f in self.futures:
            f.result(60)


def health(harness: InProcess) -> int:
    return harness.run(harness.client.get("/health")).status_code


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS")).split()[1]) / 1024


def check_error_body(r: httpx.Response) -> str:
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["param"], str) and err["param"], err
    assert err["message"].startswith(err["param"].split("[")[0]), err
    return err["param"]


# -- the five measured reproductions ---------------------------------------------------------------

def test_the_reproductions_get_400_naming_the_field_at_once_bystanders_unaffected(inproc, llm):
    by = Bystanders(inproc)
    try:
        for extra, param in REPRODUCTIONS:
            body = {"model": MODEL, "prompt": "def add(a, b):", **extra}
            t0 = time.perf_counter()
            r = inproc.run(inproc.client.post("/v1/completions", json=body))
            seconds = time.perf_counter() - t0
            assert r.status_code == 400, (extra, r.text)
            assert check_error_body(r) == param, (extra, r.text)
            assert seconds < 1.0, (extra, seconds)
            assert health(inproc) == 200
    finally:
        by.finish()
    assert by.failed == [] and by.ok >= 2
    assert llm.error is None and llm.health()["status"] == "ok"


def test_deep_json_is_a_400_and_the_keep_alive_connection_survives(server):
    """A schema string of 1000 nested brackets (RecursionError in json.loads before), then a
    body nested past the JSON parser's limit, then a good request, on one connection."""
    good = json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 3}).encode()
    deep_string = json.dumps({"model": MODEL, "prompt": "x", "response_format": {
        "type": "json_schema", "json_schema": {"schema": "[" * 1000 + "]" * 1000}}}).encode()
    deep_body = (b'{"model": "fuzz", "prompt": "x", "messages_extra": '
                 + b"[" * 5000 + b"]" * 5000 + b"}")
    with socket.create_connection((server.host, server.port), timeout=30) as sock:
        f = sock.makefile("rb")
        answers = []
        for body in (deep_string, deep_body, good):
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                         b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
            status = int(f.readline().split()[1])
            headers = {}
            while (line := f.readline()) not in (b"\r\n", b""):
                k, _, v = line.decode().partition(":")
                headers[k.strip().lower()] = v.strip()
            answers.append((status, json.loads(f.read(int(headers["content-length"])))))
    assert answers[0][0] == 400 and answers[0][1]["error"]["param"] == "response_format"
    assert answers[1][0] == 400 and answers[1][1]["error"]["param"] == "messages_extra"
    assert answers[2][0] == 200 and answers[2][1]["choices"][0]["text"] == expected(5, 3)


def test_a_client_that_disconnects_abandons_its_constraint_compile(server, llm):
    """json_object takes seconds to compile here; the client goes away after 0.3 s and the
    compile worker is killed then, not at the 2 s budget."""
    counts = lambda: constraints.worker_info().get(4096, {}).get("cancelled", 0)  # noqa: E731
    before = counts()
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 3,
                       "response_format": {"type": "json_object"}}).encode()
    with socket.create_connection((server.host, server.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        time.sleep(0.3)
    t0 = time.monotonic()
    while counts() == before and time.monotonic() - t0 < 1.5:
        time.sleep(0.02)
    assert counts() == before + 1
    assert llm.health()["status"] == "ok"


# -- the fuzz -------------------------------------------------------------------------------------------

def test_fuzz_hostile_requests_never_5xx_name_the_field_and_hurt_no_bystander(inproc, llm):
    """Hypothesis over the request schema (tests/hostile.py), with well-formed streams beside:
    no 5xx, every error names a field, no bystander fails, /health stays 200, RSS bounded
    (measured after a warm-up of FUZZ_WARMUP examples, which compiles the engine's shapes)."""
    statuses: collections.Counter = collections.Counter()
    params: collections.Counter = collections.Counter()
    rss: list = []  # MiB: before, after the warm-up, at the end

    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(request=bodies(MODEL))
    def one(request):
        path, body = request
        r = inproc.run(inproc.client.post(path, json=body))
        statuses[r.status_code] += 1
        assert r.status_code in (200, 400), (body, r.status_code, r.text[-500:])
        if r.status_code == 400:
            params[check_error_body(r)] += 1
        elif body.get("stream") is True:
            events = sse_events(r.text)
            assert events[-1] == "[DONE]", r.text[-300:]
            for e in events[:-1]:
                if "error" in json.loads(e):  # a choice the request's own data ended
                    assert json.loads(e)["error"]["param"], e
        else:
            assert len(r.json()["choices"]) >= 1
        done = sum(statuses.values())
        if done % 250 == 0:
            assert health(inproc) == 200
        if done == FUZZ_WARMUP:
            rss.append(rss_mib())

    rss.append(rss_mib())
    t0 = time.perf_counter()
    by = Bystanders(inproc)
    try:
        one()
    finally:
        by.finish()
    seconds = time.perf_counter() - t0
    rss.append(rss_mib())
    figures = {"requests": sum(statuses.values()), "status": dict(sorted(statuses.items())),
               "5xx": sum(v for k, v in statuses.items() if k >= 500),
               "bystanders_ok": by.ok, "bystanders_failed": len(by.failed),
               "rss_mib": [round(x) for x in rss], "seconds": round(seconds, 1),
               "params": dict(params.most_common(15))}
    print("\nfuzz figures:", json.dumps(figures))
    assert figures["5xx"] == 0 and by.failed == [], figures
    assert by.ok > 0 and statuses[200] > 0 and statuses[400] > 0
    assert health(inproc) == 200 and llm.error is None
    # bounded: after the first compilations, thousands of requests add little
    assert rss[2] - rss[1] < 200, figures
