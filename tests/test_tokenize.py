"""``POST /tokenize`` and ``/detokenize`` (serving/tokenize.py, contract §12 "Tokenize") on the
demo model behind an in-process server: counts equal the completions' ``usage.prompt_tokens``,
detokenize round-trips, bad input is a 400 naming the field and the server keeps serving."""

from __future__ import annotations

import httpx
import pytest

import jaxdecode as jd
from serving.app import create_app
from serving.server import ServerThread
from tests.serve_process import require_demo_weights

MAX_LEN = 256
PROMPTS = ["def f(x):", "Hello, world!\n  indented  ", "é ünïcödé ✓ <|endoftext|>", " "]
CONVERSATION = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Write a loop."},
                {"role": "assistant", "content": "for i in range(3):"},
                {"role": "user", "content": [{"type": "text", "text": "again"}]}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def client():
    require_demo_weights()
    import models

    model, params, tok = models.demo()
    with jd.LLM(model, params, tok, max_slots=2, max_len=MAX_LEN) as llm, \
            ServerThread(create_app(llm, model_name="demo")) as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as c:
        c.llm = llm
        yield c


def _ok(resp):
    assert resp.status_code == 200, resp.text
    return resp.json()


@pytest.mark.parametrize("prompt", PROMPTS)
def test_tokenize_counts_what_completions_count_and_detokenize_round_trips(client, prompt):
    tok = _ok(client.post("/tokenize", json={"model": "demo", "prompt": prompt}))
    assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] == MAX_LEN
    usage = _ok(client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1,
                                                     "temperature": 0}))["usage"]
    assert usage["prompt_tokens"] == tok["count"]
    back = _ok(client.post("/detokenize", json={"model": "demo", "tokens": tok["tokens"]}))
    assert back["prompt"] == prompt
    # the ids themselves are the completions' prompt: sending them counts the same
    usage = _ok(client.post("/v1/completions", json={"prompt": tok["tokens"], "max_tokens": 1,
                                                     "temperature": 0}))["usage"]
    assert usage["prompt_tokens"] == tok["count"]


def test_tokenize_messages_counts_what_chat_counts(client):
    tok = _ok(client.post("/tokenize", json={"messages": CONVERSATION}))
    usage = _ok(client.post("/v1/chat/completions", json={"messages": CONVERSATION,
                                                          "max_tokens": 1}))["usage"]
    assert usage["prompt_tokens"] == tok["count"]
    with_tools = _ok(client.post("/tokenize", json={"messages": CONVERSATION, "tools": [TOOL]}))
    usage = _ok(client.post("/v1/chat/completions", json={
        "messages": CONVERSATION, "tools": [TOOL], "tool_choice": "none",
        "max_tokens": 1}))["usage"]
    assert usage["prompt_tokens"] == with_tools["count"] > tok["count"]
    text = _ok(client.post("/detokenize", json={"tokens": tok["tokens"]}))["prompt"]
    assert "<|user|>\nWrite a loop.\n" in text and text.endswith("<|assistant|>\n")


@pytest.mark.parametrize("path,body,param,status", [
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt", 400),
    ("/tokenize", {}, "prompt", 400),
    ("/tokenize", {"prompt": 5}, "prompt", 400),
    ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, "messages", 400),
    ("/tokenize", {"messages": []}, "messages", 400),
    ("/tokenize", {"model": "other", "prompt": "a"}, "model", 404),
    ("/tokenize", {"prompt": "a", "tools": [TOOL]}, "tools", 400),
    ("/tokenize", {"messages": [{"role": "user", "content": "b"}], "tools": [{"type": "x"}]},
     "tools", 400),
    ("/detokenize", {"tokens": [1, 10 ** 9]}, "tokens", 400),
    ("/detokenize", {"tokens": [-1]}, "tokens", 400),
    ("/detokenize", {"tokens": ["a"]}, "tokens", 400),
    ("/detokenize", {"tokens": [1.5]}, "tokens", 400),
    ("/detokenize", {"tokens": [True]}, "tokens", 400),
    ("/detokenize", {}, "tokens", 400),
    ("/detokenize", {"model": "other", "tokens": [1]}, "model", 404),
])
def test_tokenize_bad_input_names_the_field_and_the_server_keeps_serving(client, path, body,
                                                                         param, status):
    resp = client.post(path, json=body)
    assert resp.status_code == status, resp.text
    assert resp.json()["error"]["param"].startswith(param)
    assert _ok(client.post("/tokenize", json={"prompt": "ok"}))["count"] > 0


def test_detokenize_the_last_id_of_the_vocabulary_and_nothing_past_it(client):
    from serving.tokenize import vocab_size

    size = vocab_size(client.llm.tokenizer)
    assert isinstance(_ok(client.post("/detokenize", json={"tokens": [size - 1]}))["prompt"],
                      str)
    resp = client.post("/detokenize", json={"tokens": [size]})
    assert resp.status_code == 400 and f"[0, {size})" in resp.json()["error"]["message"]
