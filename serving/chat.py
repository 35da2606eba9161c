"""Chat messages -> prompt token ids.

A tokenizer with a chat template (a `transformers` tokenizer whose `chat_template` is set) renders
the messages with `apply_chat_template(..., add_generation_prompt=True)`; the text is then
encoded without adding special tokens again (the template writes BOS and friends itself).

Any other tokenizer (the demo model's `tokenizers.Tokenizer`, a transformers tokenizer without
a template) gets the simple documented template, encoded with the tokenizer's usual special
tokens:

    <|system|>\\n{content}\\n<|user|>\\n{content}\\n<|assistant|>\\n{content}\\n ... <|assistant|>\\n

i.e. each message as ``<|{role}|>\\n{content}\\n`` followed by ``<|assistant|>\\n``. Content may
be a string or a list of ``{"type": "text", "text": ...}`` parts (joined with newlines); other
part types are rejected. Role ``developer`` is treated as ``system``.

Tools (`serving.tools`; contract §12 "Tool calls"): a template of the tokenizer gets them as
``apply_chat_template(..., tools=[{"type": "function", "function": {...}}])`` and assistant
messages with ``tool_calls`` (arguments parsed into objects, as transformers' templates expect)
and ``role: "tool"`` messages as they are (a template that does not know tools ignores them).
The simple template renders, as its documented fallback, the tools first as
``<|tools|>\\n<JSON list of the tools>\\n``, each call of an assistant message after its content
in the Hermes format ``<tool_call>{"name": N, "arguments": A}</tool_call>`` (what the auto parser
reads back, `serving.tool_calls`), and a tool result as ``<|tool|>\\n{content}\\n``.
"""

from __future__ import annotations

import json
from typing import Any, Optional, Sequence

from jaxdecode.tokenization import encode

ROLES = ("system", "user", "assistant", "developer", "tool")


def normalise_messages(messages: Sequence[Any]) -> list[dict]:
    """Request messages (pydantic or dicts) -> [{"role", "content": str}]; ValueError naming
    ``messages`` for anything unsupported."""
    out = []
    for i, m in enumerate(messages):
        role = m.role if hasattr(m, "role") else m.get("role")
        content = m.content if hasattr(m, "content") else m.get("content")
        if role not in ROLES:
            raise ValueError(f"messages: messages[{i}].role must be one of {list(ROLES)}, "
                             f"got {role!r}")
        if role == "developer":
            role = "system"
        if content is None:
            text = ""
        elif isinstance(content, str):
            text = content
        else:
            parts = []
            for j, part in enumerate(content):
                ptype = part.type if hasattr(part, "type") else part.get("type")
                ptext = part.text if hasattr(part, "text") else part.get("text")
                if ptype != "text" or not isinstance(ptext, str):
                    raise ValueError(f"messages: messages[{i}].content[{j}] has type {ptype!r}; "
                                     "only text parts are supported")
                parts.append(ptext)
            text = "\n".join(parts)
        entry = {"role": role, "content": text}
        calls = m.tool_calls if hasattr(m, "tool_calls") else m.get("tool_calls")
        if calls:
            if role != "assistant":
                raise ValueError(f"messages: messages[{i}].tool_calls is for role 'assistant'")
            entry["tool_calls"] = [_tool_call(c, f"messages[{i}].tool_calls[{j}]")
                                   for j, c in enumerate(calls)]
        call_ref = m.tool_call_id if hasattr(m, "tool_call_id") else m.get("tool_call_id")
        if call_ref is not None:
            entry["tool_call_id"] = call_ref
        out.append(entry)
    if not out:
        raise ValueError("messages: at least one message is required")
    return out


def _tool_call(c: Any, where: str) -> dict:
    """An assistant message's call with its arguments parsed (ValueError naming it)."""
    function = c.function if hasattr(c, "function") else c.get("function") or {}
    name = function.name if hasattr(function, "name") else function.get("name")
    args = function.arguments if hasattr(function, "arguments") else function.get("arguments")
    try:
        parsed = json.loads(args) if isinstance(args, str) else args
    except ValueError:
        raise ValueError(f"messages: {where}.function.arguments is not JSON") from None
    cid = c.id if hasattr(c, "id") else c.get("id")
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": parsed}}


def hermes(call: dict) -> str:
    body = {"name": call["function"]["name"], "arguments": call["function"]["arguments"]}
    return f"<tool_call>{json.dumps(body, ensure_ascii=False)}</tool_call>"


def simple_template(messages: Sequence[dict], tools: Optional[Sequence[dict]] = None) -> str:
    head = (f"<|tools|>\n{json.dumps(list(tools), ensure_ascii=False)}\n" if tools else "")
    return head + "".join(
        f"<|{m['role']}|>\n{m['content']}"
        + "".join(hermes(c) for c in m.get("tool_calls", ())) + "\n"
        for m in messages) + "<|assistant|>\n"


def call_format_of(tokenizer: Any) -> Optional[str]:
    """The format the model writes tool calls in, for the auto grammar (`serving.tools`):
    "hermes" (``<tool_call>`` blocks: its chat template names them, or it has none -- the
    simple template renders calls so), "llama3" (a template that names ``<|python_tag|>`` or
    ``"parameters"``: the whole output one JSON call), else None (parsed only)."""
    if not has_chat_template(tokenizer):
        return "hermes"
    template = str(tokenizer.chat_template)
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or '"parameters"' in template:
        return "llama3"
    return None


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None)) and hasattr(
        tokenizer, "apply_chat_template")


def render(tokenizer: Any, messages: Sequence[dict], tools: Optional[Sequence[dict]] = None
           ) -> tuple[str, bool]:
    """(prompt text, whether the tokenizer's own template was used); `tools` in OpenAI's shape."""
    if has_chat_template(tokenizer):
        try:
            text = tokenizer.apply_chat_template(list(messages), tools=list(tools or ()) or None,
                                                 tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # jinja errors such as "roles must alternate"
            raise ValueError(f"messages: the model's chat template failed: {exc}") from None
        if not isinstance(text, str):
            raise ValueError("messages: the model's chat template did not produce text")
        return text, True
    return simple_template(messages, tools), False


def chat_prompt_ids(tokenizer: Any, messages: Sequence[Any],
                    tools: Optional[Sequence[dict]] = None) -> tuple[list[int], str]:
    """Token ids of the rendered conversation (with `tools`, OpenAI's shape), and the text."""
    text, templated = render(tokenizer, normalise_messages(messages), tools)
    return encode(tokenizer, text, add_special_tokens=not templated), text
