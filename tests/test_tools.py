"""Tool calling on /v1/chat/completions (serving/tools.py, serving/tool_calls.py, contract §12
"Tool calls"), with the `openai` client against the demo model behind an in-process server
(and one real `jaxdecode serve`): named and required calls parse and validate against their
schemas over many seeds, streamed pieces concatenate to the same arguments, the follow-up turn
is accepted, auto reads Hermes blocks, bad tools are 400s and the server keeps serving."""

from __future__ import annotations

import json
import re

import httpx
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jaxdecode as jd
from serving.app import create_app
from serving.server import ServerThread
from serving.tool_calls import ToolStream, final_message
from serving.tools import plan_for
from tests.serve_process import require_demo_weights, serve

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "maxLength": 12},
                          "unit": {"enum": ["celsius", "fahrenheit"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 14}},
           "required": ["city", "unit", "days"], "additionalProperties": False}
ADD = {"type": "object",
       "properties": {"a": {"type": "integer", "minimum": -50, "maximum": 50},
                      "b": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 8}},
       "required": ["a", "b"], "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
SEEDS = (1, 2, 3)
N = 4  # choices per request: SEEDS x N samples per mode
MAX_TOKENS = 160
HERMES = ('Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", '
          '"unit": "celsius", "days": 3}}</tool_call>')


@pytest.fixture(scope="module")
def server():
    require_demo_weights()
    import models

    model, params, tok = models.demo()
    with jd.LLM(model, params, tok, max_slots=N, max_len=512) as llm, \
            ServerThread(create_app(llm, model_name="demo")) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _check_call(call, names=tuple(SCHEMAS)):
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in names
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return call.function.name, call.function.arguments


def _create(client, choice, seed, **kw):
    kw.setdefault("max_tokens", MAX_TOKENS)
    return client.chat.completions.create(model="demo", messages=ASK, tools=TOOLS,
                                          tool_choice=choice, seed=seed, temperature=1.0, **kw)


def _streamed(client, choice, seed):
    """(calls {index: (id, name, arguments)}, content, finish_reason) of one streamed choice."""
    calls, content, finish = {}, "", None
    for chunk in _create(client, choice, seed, stream=True):
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        finish = ch.finish_reason or finish
        content += ch.delta.content or ""
        for piece in ch.delta.tool_calls or ():
            if piece.id is not None:  # a call opens: id and name first
                assert piece.index not in calls and piece.function.name
                calls[piece.index] = (piece.id, piece.function.name, "")
            cid, name, args = calls[piece.index]
            calls[piece.index] = (cid, name, args + (piece.function.arguments or ""))
    return calls, content, finish


@pytest.mark.parametrize("mode", ["named", "required"])
def test_named_and_required_calls_validate_against_their_schemas_over_many_seeds(client,
                                                                               mode):
    choice = NAMED if mode == "named" else "required"
    names = ("get_weather",) if mode == "named" else tuple(SCHEMAS)
    seen = []
    for seed in SEEDS:
        resp = _create(client, choice, seed, n=N)
        for ch in resp.choices:
            assert ch.finish_reason == ("stop" if mode == "named" else "tool_calls")
            assert ch.message.content is None and len(ch.message.tool_calls) == 1
            seen.append(_check_call(ch.message.tool_calls[0], names))
    assert len(set(seen)) > 1  # sampled calls, not one fixed answer


@pytest.mark.parametrize("mode", ["named", "required"])
def test_streamed_pieces_concatenate_to_the_arguments_of_the_same_call(client, mode):
    choice = NAMED if mode == "named" else "required"
    for seed in SEEDS[:2]:
        calls, content, finish = _streamed(client, choice, seed)
        whole = _create(client, choice, seed).choices[0]
        assert content == "" and list(calls) == [0]
        _, name, args = calls[0]
        jsonschema.validate(json.loads(args), SCHEMAS[name])
        assert (name, args) == (whole.message.tool_calls[0].function.name,
                                whole.message.tool_calls[0].function.arguments)
        assert finish == whole.finish_reason


def test_auto_reads_hermes_tool_call_blocks_streaming_and_not(client):
    # the demo model does not call tools by itself: a regex makes it write one Hermes block
    rf = {"type": "choice", "choices": [HERMES]}
    resp = _create(client, "auto", 1, extra_body={"response_format": rf})
    ch = resp.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content == "Sure. "
    assert _check_call(ch.message.tool_calls[0]) == (
        "get_weather", '{"city": "Oslo", "unit": "celsius", "days": 3}')
    stream = client.chat.completions.create(model="demo", messages=ASK, tools=TOOLS, seed=1,
                                            max_tokens=MAX_TOKENS, stream=True,
                                            extra_body={"response_format": rf})
    content, pieces, finish = "", [], None
    for chunk in stream:
        ch = chunk.choices[0]
        content += ch.delta.content or ""
        pieces += ch.delta.tool_calls or []
        finish = ch.finish_reason or finish
    assert content == "Sure. " and finish == "tool_calls" and len(pieces) == 1
    assert pieces[0].function.arguments == '{"city": "Oslo", "unit": "celsius", "days": 3}'
    # "none" never parses (free text without a block: the parser tests below)
    none = _create(client, "none", 1, extra_body={"response_format": rf})
    assert none.choices[0].message.content == HERMES and not none.choices[0].message.tool_calls


def test_follow_up_turn_with_the_call_and_its_result_is_accepted(client, server):
    call = _create(client, NAMED, 5).choices[0].message.tool_calls[0]
    turn = ASK + [{"role": "assistant", "content": None,
                   "tool_calls": [{"id": call.id, "type": "function",
                                   "function": {"name": call.function.name,
                                                "arguments": call.function.arguments}}]},
                  {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 4}'}]
    resp = client.chat.completions.create(model="demo", messages=turn, tools=TOOLS,
                                          max_tokens=4, seed=1)
    assert resp.choices[0].message.role == "assistant"
    tok = httpx.post(server.url + "/tokenize", json={"messages": turn, "tools": TOOLS}).json()
    assert tok["count"] == resp.usage.prompt_tokens  # the same rendering as the chat route
    text = httpx.post(server.url + "/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"]
    assert text.startswith("<|tools|>\n[") and '"name": "get_weather"' in text
    assert f"<tool_call>{{\"name\": \"get_weather\", \"arguments\": " in text
    assert '<|tool|>\n{"temp_c": 4}\n<|assistant|>\n' in text


BAD = [  # (body, param, a fragment of the message)
    ({"tools": "get_weather"}, "tools", "array"),
    ({"tools": []}, "tools", "non-empty"),
    ({"tools": [{"type": "function"}]}, "tools", "tools[0].function"),
    ({"tools": [{"type": "retrieval", "function": {"name": "x"}}]}, "tools", "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools", "name"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools", "used twice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]}, "tools",
     "parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "multipleOf": 2}}}}}]},
     "tools", "multipleOf"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "number", "maximum": 1}}}}}]}, "tools",
     "'maximum' at #/properties/x"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "'nope'"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "sometimes"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice", "function"),
    ({"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice", "response_format"),
    ({"tools": TOOLS, "messages": ASK + [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "add", "arguments": "{oops"}}]}]},
     "messages", "not JSON"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"function": {"name": "add", "arguments": "{}"}}]}]}, "messages", "assistant"),
]


@pytest.mark.parametrize("body,param,fragment", BAD)
def test_bad_tools_are_400s_naming_the_field_and_the_server_keeps_serving(client, server,
                                                                          body, param,
                                                                          fragment):
    resp = httpx.post(server.url + "/v1/chat/completions",
                      json={"model": "demo", "messages": ASK, "max_tokens": 2, **body})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and fragment in error["message"], error
    ok = _create(client, NAMED, 1)
    _check_call(ok.choices[0].message.tool_calls[0])


def test_auto_calls_in_the_served_output_are_valid_or_absent(client):
    """Auto on a model that writes Hermes calls (the demo's simple template): the output runs
    under the auto grammar, so a `<tool_call>` that starts is a valid call and never text."""
    shots = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n' * 6
    resp = client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": shots}], tools=TOOLS, seed=3, n=N,
        temperature=1.0, max_tokens=96)
    for ch in resp.choices:
        assert "<tool_call>" not in (ch.message.content or "")
        for c in ch.message.tool_calls or ():
            _check_call(c)


# -- the auto grammar, on the demo vocabulary without a model ----------------------------------

@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="<tool_call>x\n", max_size=40))
def test_text_without_the_marker_is_every_text_that_lacks_it(text):
    from serving.tools import text_without

    assert (re.fullmatch(text_without("<tool_call>"), text) is not None) == (
        "<tool_call>" not in text)


@pytest.mark.parametrize("call_format,opening", [("hermes", "Sure. <tool_call>"),
                                                ("llama3", " {")])
def test_auto_grammar_keeps_a_started_call_valid_on_every_path(call_format, opening):
    """Random walks through the compiled auto grammar (demo vocabulary) from a call's opening
    (Hermes after text, Llama 3 at the start): every path that reaches an accepting state past
    the call holds one call that validates against its tool's schema; a token that breaks the
    JSON is masked right after the opening, while free text takes it."""
    import models
    from jaxdecode.device.constraints.compile import compile_format
    from jaxdecode.device.constraints.vocab import vocab_for
    from serving.chat import call_format_of

    model, _, tok = models.demo()
    assert call_format_of(tok) == "hermes"
    plan = plan_for(TOOLS, "auto", None, call_format=call_format)
    index = compile_format(plan.response_format(), vocab_for(tok, model.config.vocab_size))
    prefix = tok.encode(opening).ids
    start = index.walk(prefix)
    x = tok.encode("x").ids[0]
    assert index.walk(tok.encode("Sure. ").ids + [x]) >= 0 and start >= 0
    assert index.next_state(start, x) == -1 and not index.accepting[start]
    closing = "</tool_call>" if call_format == "hermes" else "}"
    rng, names = np.random.default_rng(0), set()
    for _ in range(12):
        ids, state = list(prefix), start
        while not (index.accepting[state] and closing in tok.decode(ids)):
            lo, hi = index.indptr[state], index.indptr[state + 1]
            assert hi > lo and len(ids) < 400, tok.decode(ids)
            k = rng.integers(lo, hi)
            ids.append(int(index.tokens[k]))
            state = int(index.targets[k])
        text = tok.decode(ids)  # the closing token may carry text on past the call
        message, has_calls = final_message(plan, text, True)
        assert has_calls, text
        if call_format == "hermes":
            assert message["content"] == "Sure. " + text.split("</tool_call>")[1]
        call = message["tool_calls"][0]["function"]
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
        names.add(call["name"])
    assert names == set(SCHEMAS)


def test_auto_grammar_applies_only_where_the_model_writes_a_known_call_format():
    plan = plan_for(TOOLS, "auto", None, call_format="hermes")
    assert plan.response_format()["type"] == "regex" and not plan.constrained
    assert plan_for(TOOLS, "auto", None).response_format() is None
    rf = {"type": "json_object"}
    assert plan_for(TOOLS, "auto", rf, call_format="hermes").response_format() is None
    assert plan_for(TOOLS, "none", None, call_format="llama3").response_format() is None
    from types import SimpleNamespace

    from serving.chat import call_format_of

    def template(text):
        return SimpleNamespace(chat_template=text, apply_chat_template=lambda *a, **k: "")

    assert call_format_of(template("{{ messages }} <|python_tag|>")) == "llama3"
    assert call_format_of(template("{{ '<tool_call>' }}")) == "hermes"
    assert call_format_of(template("[TOOL_CALLS] {{ messages }}")) is None


LLAMA3_TEXTS = [('{"name": "add", "parameters": {"a": 1, "b": 2}}', True),
                (' {"name":"get_weather", "parameters":{"city":"Rome", "unit":"celsius",'
                 ' "days":14}}\n', True),
                ("The answer is 3. {not json}", True), ("", True), ("  ", True),
                ('{"a": 1}', False), ('{"name": "add", "parameters": {"a": 1, "b": 9}}', False),
                ('{"name": "add", "arguments": {"a": 1, "b": 2}}', False)]


@pytest.mark.parametrize("text,ok", LLAMA3_TEXTS)
def test_llama3_auto_grammar_is_text_or_one_valid_call(text, ok):
    """Llama 3's auto grammar: an output that opens with `{` is one call of the tools (its
    parameters under the schema, `b` < 8 here); any other text is free."""
    from serving.tools import auto_regex, parse_tools

    pattern = auto_regex(parse_tools(TOOLS), "llama3")
    assert (re.fullmatch(pattern, text) is not None) == ok
    if ok and text.strip().startswith("{"):
        message, has_calls = final_message(plan_for(TOOLS, "auto", None, "llama3"), text, True)
        call = message["tool_calls"][0]["function"]
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


# -- the parsers, without a model ----------------------------------------------------------------

PLAN = plan_for(TOOLS, "auto", None)
REQUIRED = plan_for(TOOLS, "required", None)


def _replay(plan, text, cuts, complete=True):
    """Feed `text` cut at `cuts` into a ToolStream; (content, {index: (name, arguments)})."""
    stream, content, calls, last = ToolStream(plan), "", {}, 0
    deltas = [stream.feed(text[a:b]) for a, b in zip([0, *cuts], [*cuts, len(text)])]
    for delta in deltas + [stream.finish(complete)]:
        content += delta.get("content") or ""
        for piece in delta.get("tool_calls", ()):
            if "id" in piece:
                calls[piece["index"]] = (piece["function"]["name"], "")
            name, args = calls[piece["index"]]
            calls[piece["index"]] = (name, args + piece["function"]["arguments"])
    return content, calls


MISTRAL_LIST = ('[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1, "b": 2}}, '
                '{"name": "get_weather", "arguments": {"city": "Rome"}}]')
MISTRAL_ARGS_FORM = ('[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}'
                     '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}')
AUTO_TEXTS = [HERMES, "no call at all <tool_c", "<tool_call>not json</tool_call> then",
              HERMES + "\n" + HERMES.replace("Sure. ", "") + " done",
              '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>',
              '<tool_call>{"name": "add", "parameters": {"a": 1, "b": 2}}</tool_call>',
              "a < b <tool_call>{\"name\": \"add\", \"arguments\": {\"a\": 1}}",
              # Llama 3 JSON: the whole output is one call, after an optional <|python_tag|>
              ' {"name": "add", "parameters": {"a": 1, "b": 2}}\n',
              '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}',
              '{"name": "unknown", "parameters": {}}', '{"a": 1} and more', "<|pyth", "  ",
              '<|python_tag|> not json', '{"name": "add", "arguments": {}} <tool_call>'
              '{"name": "add", "arguments": {"a": 2}}</tool_call>',
              # Mistral: [TOOL_CALLS] and a JSON list (the marker may be skipped), or
              # [TOOL_CALLS]name[ARGS]{...} per call
              MISTRAL_LIST, MISTRAL_LIST.removeprefix("[TOOL_CALLS] "), MISTRAL_ARGS_FORM,
              '[TOOL_CALLS] [{"name": "unknown", "arguments": {}}]', "[1] a footnote",
              '[TOOL_CALLS]add[ARGS]not json', '[TOOL_CALLS]add{"a": 1}', "[TOOL_CAL"]


def test_auto_reads_both_mistral_formats():
    """Mistral's list and [ARGS] forms give the same two calls; a call naming no tool, or
    arguments that are not JSON, leave the whole output as text."""
    want = [("add", '{"a": 1, "b": 2}'), ("get_weather", '{"city": "Rome"}')]
    for text in (MISTRAL_LIST, MISTRAL_LIST.removeprefix("[TOOL_CALLS] "), MISTRAL_ARGS_FORM):
        message, has_calls = final_message(PLAN, text, complete=True)
        assert has_calls and message["content"] is None, text
        assert [(c["function"]["name"], c["function"]["arguments"])
                for c in message["tool_calls"]] == want
    for text in ('[TOOL_CALLS] [{"name": "unknown", "arguments": {}}]',
                 "[TOOL_CALLS]add[ARGS]not json", "[1] a footnote"):
        message, has_calls = final_message(PLAN, text, complete=True)
        assert not has_calls and message["content"] == text


@settings(max_examples=80, deadline=None)
@given(st.sampled_from(AUTO_TEXTS), st.lists(st.integers(0, 200), max_size=12))
def test_auto_stream_under_any_chunking_equals_the_final_message(text, cuts):
    """Hermes blocks and Llama 3 JSON outputs, cut anywhere: the streamed calls and text equal
    the non-streamed message's."""
    cuts = sorted({c for c in cuts if 0 < c < len(text)})
    content, calls = _replay(PLAN, text, cuts)
    message, _ = final_message(PLAN, text, complete=True)
    expected = [(c["function"]["name"], c["function"]["arguments"])
                for c in message.get("tool_calls", ())]
    assert [calls[i] for i in sorted(calls)] == expected
    assert content.strip() == (message["content"] or "").strip()
    if not expected:
        assert content == text  # nothing held back or lost


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 60), max_size=10))
def test_required_stream_under_any_chunking_equals_the_final_message(cuts):
    text = '{"name":"add","arguments":{"a":-3,"b":7}}'
    cuts = sorted({c for c in cuts if 0 < c < len(text)})
    content, calls = _replay(REQUIRED, text, cuts)
    message, has_calls = final_message(REQUIRED, text, complete=True)
    assert has_calls and content == "" and calls == {0: ("add", '{"a":-3,"b":7}')}
    assert message["tool_calls"][0]["function"]["arguments"] == '{"a":-3,"b":7}'


# -- a real `jaxdecode serve` -------------------------------------------------------------------

def test_real_serve_named_and_required_calls_and_a_bad_tool(tmp_path):
    with serve(tmp_path / "serve.log", "--max-slots", "2", "--max-len", "512") as (_, url):
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        for ch in _create(c, "required", 7, n=2).choices:
            _check_call(ch.message.tool_calls[0])
        with pytest.raises(openai.BadRequestError) as err:
            c.chat.completions.create(model="demo", messages=ASK, tools=TOOLS,
                                      tool_choice={"type": "function",
                                                   "function": {"name": "nope"}})
        assert err.value.body["param"] == "tool_choice"
        _check_call(_create(c, "required", 8).choices[0].message.tool_calls[0])


HERMES_TEMPLATE = (  # a Qwen-like template: tools in the system turn, calls as Hermes blocks
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}"
    "</tools><|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.content %}{{ m.content }}{% endif %}{% for c in m.tool_calls or [] %}<tool_call>"
    "{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}"
    "</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_tokenizer_template_gets_the_tools_and_parsed_call_arguments(hf_tokenizer_dir):
    from transformers import AutoTokenizer

    from serving.chat import chat_prompt_ids

    hf = AutoTokenizer.from_pretrained(hf_tokenizer_dir)
    hf.chat_template = HERMES_TEMPLATE
    turn = ASK + [{"role": "assistant", "content": None, "tool_calls": [
                      {"id": "call_1", "type": "function",
                       "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
    _, text = chat_prompt_ids(hf, turn, plan_for(TOOLS, "auto", None).templated())
    assert text.startswith('<|im_start|>system\n<tools>{"type": "function", "function": '
                           '{"name": "get_weather"')
    assert ('<|im_start|>assistant\n<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}'
            '</tool_call><|im_end|>\n<|im_start|>tool\n3<|im_end|>\n<|im_start|>assistant\n'
            ) in text
    # what such a model writes back, the auto parser reads
    message, has_calls = final_message(PLAN, '<tool_call>{"name": "add", "arguments": '
                                             '{"a": 1, "b": 2}}</tool_call>', complete=True)
    llama3, _ = final_message(PLAN, '<|python_tag|>{"name": "add", "parameters": {"a": 1, '
                                    '"b": 2}}', complete=True)
    assert llama3["tool_calls"][0]["function"] == message["tool_calls"][0]["function"]
    assert has_calls and message["content"] is None
    assert message["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 1, "b": 2}'}
