"""Tool calls out of a choice's text: the final ``message.tool_calls`` and the streamed
``delta.tool_calls`` pieces (contract §12 "Tool calls"; the plans: `serving.tools`).

    named     the text is the arguments JSON                      -> one call of the named tool
    required  the text is {"name":"<name>","arguments":<args>}    -> one call (compact JSON: the
              constraint uses whitespace pattern "", so the arguments are the text between
              the ``"arguments":`` frame and the closing brace)
    auto      free text; each Hermes / Qwen block ``<tool_call>{"name": N, "arguments": A}
              </tool_call>`` naming one of the tools is a call (``"parameters"`` is taken for
              ``"arguments"``), the rest stays ``content``; a block that does not parse, or
              names no tool, stays text. Or Llama 3's JSON: the whole output, after an
              optional ``<|python_tag|>``, is ``{"name": N, "parameters": A}`` naming a tool
              (streaming holds an output that begins ``{`` or the tag until its end). Or
              Mistral's: the whole output is ``[TOOL_CALLS] [{"name": N, "arguments": A},
              ...]`` (the marker may be missing: the detokenizer skips it where it is a
              special token) or ``[TOOL_CALLS]N[ARGS]A`` once per call (streaming holds an
              output that begins ``[`` until its end). Auto calls are parsed, not
              constrained.

A call is ``{"id": "call_...", "type": "function", "function": {"name", "arguments": <JSON
string>}}``; ``content`` is null when the message is calls only (auto: or only whitespace).
Streaming (`ToolStream`): the first piece of a call carries ``index``, ``id``, ``type``,
``function.name`` and the first ``function.arguments`` fragment, the next ones (``index`` and
``function.arguments``) the following fragments, and the fragments of a call concatenate to
the final message's ``arguments`` (an auto call comes whole, once its ``</tool_call>`` is
read; text that may begin a ``<tool_call>`` is held back until it is known not to).
finish_reason: ``tool_calls`` for required and auto calls, ``stop`` for a named call (as
OpenAI answers a forced function); ``length`` stays ``length``.
"""

from __future__ import annotations

import json
import re
from typing import Any, Optional

from serving.tools import ToolPlan, call_id

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_TAG, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"
_HERMES = re.compile(re.escape(HERMES_OPEN) + r"(.*?)" + re.escape(HERMES_CLOSE), re.DOTALL)
_REQUIRED_PREFIX = '{"name":"'
_REQUIRED_ARGS = '","arguments":'


def call(name: str, arguments: str) -> dict:
    return {"id": call_id(), "type": "function",
            "function": {"name": name, "arguments": arguments}}


def hermes_call(plan: ToolPlan, body: str) -> Optional[tuple[str, str]]:
    """(name, arguments JSON) of one ``<tool_call>`` body, or None when it is not a call of
    one of the plan's tools."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    return object_call(plan, obj)


def object_call(plan: ToolPlan, obj: Any) -> Optional[tuple[str, str]]:
    """(name, arguments JSON) of a parsed ``{"name": N, "arguments" | "parameters": A}``
    naming one of the plan's tools (A an object or a JSON string), else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if plan.tool(obj["name"]) is None:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return obj["name"], json.dumps(args, ensure_ascii=False)


def llama3_call(plan: ToolPlan, text: str) -> Optional[tuple[str, str]]:
    """Llama 3's JSON format: the whole output, after an optional ``<|python_tag|>``, is one
    ``{"name": N, "parameters": {...}}`` object naming one of the tools."""
    body = text.strip().removeprefix(PYTHON_TAG).strip()
    return hermes_call(plan, body) if body.startswith("{") else None


def mistral_calls(plan: ToolPlan, text: str) -> Optional[list]:
    """Mistral's formats (module docstring): the calls of the whole output, or None unless
    every call in it names one of the tools."""
    body = text.strip()
    tagged = body.startswith(MISTRAL_TAG)
    body = body.removeprefix(MISTRAL_TAG).strip()
    if body.startswith("["):  # the JSON list
        try:
            objs = json.loads(body)
        except ValueError:
            return None
        calls = [object_call(plan, o) for o in objs] if isinstance(objs, list) else []
        return calls if calls and None not in calls else None
    if not tagged:
        return None
    calls = []
    for part in body.split(MISTRAL_TAG):  # N[ARGS]A per call
        name, sep, args = part.partition(MISTRAL_ARGS)
        try:
            parsed = object_call(plan, {"name": name.strip(), "arguments": json.loads(args)})
        except ValueError:
            return None
        if not sep or parsed is None:
            return None
        calls.append(parsed)
    return calls


def whole_output_calls(plan: ToolPlan, text: str) -> Optional[list]:
    """The calls of an auto output that is one call as a whole: Llama 3's, or Mistral's."""
    parsed = llama3_call(plan, text)
    return [parsed] if parsed is not None else mistral_calls(plan, text)


def whole_output_format(head: str) -> Optional[bool]:
    """Whether an auto output that begins with `head` (stripped) may be a Llama 3 or Mistral
    call (held until the end); None while `head` could still begin ``<|python_tag|>``."""
    if head.startswith(("{", "[", PYTHON_TAG)):
        return True
    return None if PYTHON_TAG.startswith(head) else False


def split_required(text: str) -> tuple[Optional[str], str]:
    """(name or None while incomplete, the arguments text so far) of a required call's text."""
    if not text.startswith(_REQUIRED_PREFIX):
        return None, ""
    name, sep, rest = text[len(_REQUIRED_PREFIX):].partition(_REQUIRED_ARGS)
    return (name, rest) if sep else (None, "")


def completed(fields: dict) -> bool:
    """The choice's output ended whole (its grammar completed, or EOS), by its finish fields."""
    return fields.get("jaxdecode_finish_reason") in ("grammar_complete", "eos")


def reason(plan: ToolPlan, openai_reason: str, has_calls: bool) -> str:
    if openai_reason != "stop" or not has_calls:
        return openai_reason
    return "stop" if plan.mode == "named" else "tool_calls"


def final_message(plan: ToolPlan, text: str, complete: bool) -> tuple[dict, bool]:
    """(the assistant message of a finished choice, whether it holds calls); `complete`: the
    output ended normally (not cut at a length)."""
    calls, content = [], text
    if plan.mode == "named":
        calls, content = [call(plan.name, text)], None
    elif plan.mode == "required":
        name, args = split_required(text)
        if name is not None:
            calls, content = [call(name, args[:-1] if complete else args)], None
    elif plan.mode == "auto" and (whole := whole_output_calls(plan, text)) is not None:
        calls, content = [call(*c) for c in whole], None
    elif plan.mode == "auto":
        pieces, last = [], 0
        for m in _HERMES.finditer(text):
            parsed = hermes_call(plan, m.group(1).strip())
            if parsed is not None:
                pieces.append(text[last:m.start()])
                calls.append(call(*parsed))
                last = m.end()
        pieces.append(text[last:])
        if calls:
            joined = "".join(pieces)
            content = joined if joined.strip() else None
    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    return message, bool(calls)


class ToolStream:
    """One streamed choice's deltas under a plan: `feed(text)` per engine delta and
    `finish(complete)` at its end each return the delta dict to send ({} for nothing yet)."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.buffer = ""       # required: the whole text; auto: the unsent tail
        self.sent = 0          # required: argument characters sent
        self.calls = 0         # calls opened so far
        self.whole: Optional[bool] = None  # auto: held whole (a possible Llama 3 / Mistral call)

    def opening(self) -> dict:
        return {"role": "assistant", "content": None if self.plan.constrained else ""}

    def feed(self, text: str) -> dict:
        if self.plan.mode == "named":
            return self._named(text)
        if self.plan.mode == "required":
            self.buffer += text
            return self._required(final=False, complete=False)
        return self._auto(text, final=False)

    def finish(self, complete: bool) -> dict:
        if self.plan.mode == "required":
            return self._required(final=True, complete=complete)
        if self.plan.mode == "auto":
            return self._auto("", final=True)
        return {}

    @property
    def has_calls(self) -> bool:
        return self.calls > 0

    # -- the three shapes ---------------------------------------------------------------------

    def _piece(self, name: Optional[str], arguments: str) -> dict:
        if name is not None:  # a call opens
            self.calls += 1
            return {"index": self.calls - 1, "id": call_id(), "type": "function",
                    "function": {"name": name, "arguments": arguments}}
        return {"index": self.calls - 1, "function": {"arguments": arguments}}

    def _named(self, text: str) -> dict:
        if not self.calls:
            return {"tool_calls": [self._piece(self.plan.name, text)]}
        return {"tool_calls": [self._piece(None, text)]} if text else {}

    def _required(self, final: bool, complete: bool) -> dict:
        name, args = split_required(self.buffer)
        if name is None:
            return {"content": self.buffer} if final and self.buffer else {}
        end = len(args) - 1 if (not final or complete) else len(args)  # hold back the "}"
        fragment = args[self.sent:max(end, self.sent)]
        self.sent += len(fragment)
        if not self.calls:
            return {"tool_calls": [self._piece(name, fragment)]}
        return {"tool_calls": [self._piece(None, fragment)]} if fragment else {}

    def _auto(self, text: str, final: bool) -> dict:
        self.buffer += text
        if self.whole is not False:  # the output's start decides: a Llama 3 call or text
            head = self.buffer.strip()
            self.whole = whole_output_format(head) if head else None
            if not final and self.whole is not False:
                return {}
            whole = whole_output_calls(self.plan, self.buffer) if final else None
            if whole is not None:
                self.buffer = ""
                return {"tool_calls": [self._piece(*c) for c in whole]}
            self.whole = False
        content, calls = [], []
        while True:
            start = self.buffer.find(HERMES_OPEN)
            if start < 0:
                keep = 0 if final else _partial_suffix(self.buffer, HERMES_OPEN)
                content.append(self.buffer[:len(self.buffer) - keep])
                self.buffer = self.buffer[len(self.buffer) - keep:]
                break
            end = self.buffer.find(HERMES_CLOSE, start)
            if end < 0:  # a call in progress: wait for its end (or send it as text at the end)
                content.append(self.buffer[:start])
                self.buffer = self.buffer[start:]
                if final:
                    content.append(self.buffer)
                    self.buffer = ""
                break
            block = self.buffer[start:end + len(HERMES_CLOSE)]
            parsed = hermes_call(self.plan, block[len(HERMES_OPEN):-len(HERMES_CLOSE)].strip())
            content.append(self.buffer[:start])
            if parsed is None:
                content.append(block)
            else:
                calls.append(self._piece(*parsed))
            self.buffer = self.buffer[end + len(HERMES_CLOSE):]
        delta: dict[str, Any] = {}
        text_out = "".join(content)
        if text_out:
            delta["content"] = text_out
        if calls:
            delta["tool_calls"] = calls
        return delta


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0
