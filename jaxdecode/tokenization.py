"""Encoding text with either kind of tokenizer the project accepts (docs/architecture.md: a
`tokenizers.Tokenizer` or a `transformers` tokenizer)."""

from __future__ import annotations

from typing import Any, Optional


def encode(tokenizer: Any, text: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of `text`; special tokens (e.g. a BOS) are added as the tokenizer is configured."""
    if hasattr(tokenizer, "encode_batch"):  # tokenizers.Tokenizer
        return list(tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def eos_token_id(tokenizer: Any) -> Optional[int]:
    """The tokenizer's own end-of-sequence id, when it declares one."""
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is not None:
        return int(eos)
    if hasattr(tokenizer, "token_to_id"):
        for name in ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>"):
            tid = tokenizer.token_to_id(name)
            if tid is not None:
                return int(tid)
    return None


def bytes_to_unicode() -> dict:
    """GPT-2's byte -> printable character map used by ByteLevel vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1)
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}
