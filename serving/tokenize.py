"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's routes; contract §12 "Tokenize").

    POST /tokenize    {"model"?, "prompt": str}
                      {"model"?, "messages": [...], "tools"?: [...]}
                      -> {"tokens", "count", "max_model_len"}
    POST /detokenize  {"model"?, "tokens": [int, ...]} -> {"prompt"}

The prompt form tokenizes exactly as ``/v1/completions`` does (special tokens added as the
tokenizer is configured), the messages form exactly as ``/v1/chat/completions`` renders its
conversation (`serving.chat`, tools included), so ``count`` equals the ``usage.prompt_tokens``
those routes report for the same input. Detokenize decodes with special tokens kept
(``skip_special_tokens=False``), so tokenize -> detokenize returns the text the model sees.
Bad input is a 400 naming the field (both or neither of ``prompt`` / ``messages``, an id
outside ``[0, vocab size)`` names ``tokens``); an unknown model is a 404 naming ``model``.
"""

from __future__ import annotations

from typing import Any, Optional

from pydantic import Field

from jaxdecode.tokenization import encode
from serving import chat as chat_mod
from serving.protocol import MAX_MESSAGES, ChatMessage, _Model, bad_request
from serving.tools import parse_tools

MAX_DETOKENIZE_IDS = 1 << 20  # ids in one /detokenize request


class TokenizeRequest(_Model):
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = Field(default=None, max_length=MAX_MESSAGES)
    tools: Optional[list[Any]] = None


class DetokenizeRequest(_Model):
    model: Optional[str] = None
    tokens: list[int] = Field(max_length=MAX_DETOKENIZE_IDS)


def vocab_size(tokenizer: Any) -> int:
    """Ids the tokenizer can decode (added tokens included)."""
    if hasattr(tokenizer, "get_vocab_size"):  # tokenizers.Tokenizer
        return int(tokenizer.get_vocab_size(with_added_tokens=True))
    return len(tokenizer)


def tokenize(llm: Any, req: TokenizeRequest) -> dict:
    """The /tokenize body of a parsed request (ValueError / ApiError naming the field)."""
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("prompt: send exactly one of 'prompt' and 'messages'", "prompt")
    if req.prompt is not None:
        if req.tools is not None:
            raise bad_request("tools: only the 'messages' form takes tools", "tools")
        ids = encode(llm.tokenizer, req.prompt)
    else:
        tools = [t.as_openai() for t in parse_tools(req.tools)] if req.tools is not None else None
        ids, _ = chat_mod.chat_prompt_ids(llm.tokenizer, req.messages, tools)
    return {"tokens": ids, "count": len(ids), "max_model_len": llm.max_len}


def detokenize(llm: Any, req: DetokenizeRequest) -> dict:
    """The /detokenize body of a parsed request (400 naming ``tokens`` for an unknown id)."""
    size = vocab_size(llm.tokenizer)
    for i, tid in enumerate(req.tokens):
        if not 0 <= tid < size:
            raise bad_request(f"tokens: tokens[{i}] = {tid} is outside the vocabulary "
                              f"[0, {size})", "tokens")
    return {"prompt": llm.tokenizer.decode(list(req.tokens), skip_special_tokens=False)}
