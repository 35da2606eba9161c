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
"""

from __future__ import annotations

from typing import Any, Sequence

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
        out.append({"role": role, "content": text})
    if not out:
        raise ValueError("messages: at least one message is required")
    return out


def simple_template(messages: Sequence[dict]) -> str:
    return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None)) and hasattr(
        tokenizer, "apply_chat_template")


def render(tokenizer: Any, messages: Sequence[dict]) -> tuple[str, bool]:
    """(prompt text, whether the tokenizer's own template was used)."""
    if has_chat_template(tokenizer):
        try:
            text = tokenizer.apply_chat_template(list(messages), tokenize=False,
                                                 add_generation_prompt=True)
        except Exception as exc:  # jinja errors such as "roles must alternate"
            raise ValueError(f"messages: the model's chat template failed: {exc}") from None
        if not isinstance(text, str):
            raise ValueError("messages: the model's chat template did not produce text")
        return text, True
    return simple_template(messages), False


def chat_prompt_ids(tokenizer: Any, messages: Sequence[Any]) -> tuple[list[int], str]:
    """Token ids of the rendered conversation, and the rendered text."""
    text, templated = render(tokenizer, normalise_messages(messages))
    return encode(tokenizer, text, add_special_tokens=not templated), text
