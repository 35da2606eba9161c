"""The token -> bytes table a grammar sees (`TokenVocab`), built once per tokenizer.

A constraint is a regex over the *bytes* of the output; each token contributes its exact bytes
(byte-level BPE: GPT-2's byte<->unicode map inverted; byte-fallback/Metaspace vocabularies:
`<0xNN>` tokens are one byte and `▁` is a space). Special and added tokens (EOS, chat markers)
and the model's EOS ids are never grammar tokens: the grammar allows EOS itself, exactly in
accepting states (`tables.py`). Ids >= the model's vocab_size are dropped (their logits do not
exist).

Caveat (Metaspace vocabularies): a decoder that strips the first token's leading space makes the
shown text differ from the grammar's bytes by that space; byte-level vocabularies are exact.
"""

from __future__ import annotations

import functools
import hashlib
import json
import threading
import weakref
from typing import Any, Optional, Sequence

from jaxdecode.response_format import fail
from jaxdecode.tokenization import bytes_to_unicode


_BYTE_DECODER = {c: b for b, c in bytes_to_unicode().items()}


# Candidates for the end mark (`TokenVocab.end_char`): noncharacters no text should hold.
_END_CHARS = ("\U0010ffff", "\U0010fffe", "\U000fffff", "\uffff")


class TokenVocab:
    """token_bytes[i]: the bytes of token i, or None when i may never appear in a grammar.

    `hash` identifies the table (the compiled-index cache key); `outlines()` is the matching
    `outlines_core.Vocabulary` and `mapping()` its input (each built lazily, once). The mapping
    also holds one token outside the table, `outlines_end`, spelling `end_char`: compiled
    patterns end with it (`index_worker.end_marked`), because outlines-core 0.2.14 drops
    every edge from a state where the pattern may end to one where it may not (``ab(cd)?``
    never reached ``abcd``); a state is accepting where the end token may follow."""

    def __init__(self, token_bytes: Sequence[Optional[bytes]]):
        self.token_bytes = tuple(None if b is None else bytes(b) for b in token_bytes)
        self.size = len(self.token_bytes)
        h = hashlib.sha256()
        for b in self.token_bytes:
            h.update(b"\xff\xff" if b is None else len(b).to_bytes(2, "little") + b)
        self.hash = h.hexdigest()[:32]
        self._outlines = None
        self._mapping: Optional[dict] = None
        self._lock = threading.Lock()

    def mapping(self) -> dict:
        """{token bytes: [ids]} of the tokens a grammar may use (what outlines-core takes)."""
        with self._lock:
            if self._mapping is None:
                mapping: dict = {}
                for i, b in enumerate(self.token_bytes):
                    if b:  # empty tokens can never advance a grammar
                        mapping.setdefault(b, []).append(i)
                if not mapping:
                    fail("the tokenizer has no token usable by a grammar")
                mapping[self.end_char.encode()] = [self.outlines_end]
                self._mapping = mapping
            return self._mapping

    def outlines(self):
        mapping = self.mapping()
        with self._lock:
            if self._outlines is None:
                from outlines_core import Vocabulary

                # outlines-core wants an EOS id; we give one outside the table and drop its edges.
                self._outlines = Vocabulary(self.size, mapping)
            return self._outlines

    @property
    def outlines_eos(self) -> int:
        return self.size

    @property
    def outlines_end(self) -> int:
        return self.size + 1

    @functools.cached_property
    def end_char(self) -> str:
        """The first of _END_CHARS that no token's bytes contain."""
        for c in _END_CHARS:
            if not any(b and c.encode() in b for b in self.token_bytes):
                return c
        fail("every end mark candidate occurs in the tokenizer's vocabulary")


def _backend(tokenizer: Any):
    import tokenizers

    for obj in (tokenizer, getattr(tokenizer, "backend_tokenizer", None),
                getattr(tokenizer, "_tokenizer", None)):
        if isinstance(obj, tokenizers.Tokenizer):
            return obj
    return None


def token_bytes_of(tokenizer: Any, vocab_size: int, exclude_ids: Sequence[int] = ()) -> list:
    """Bytes of every id < vocab_size (None for special/added/excluded/missing ids)."""
    backend = _backend(tokenizer)
    if backend is None:
        fail(f"constraints need a tokenizers.Tokenizer or a fast transformers tokenizer, got "
             f"{type(tokenizer).__name__}")
    spec = json.loads(backend.to_str())
    decoder = spec.get("decoder") or {}
    steps = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    types = {d.get("type") for d in steps}
    added = backend.get_added_tokens_decoder()
    out: list = [None] * vocab_size
    for tok, i in backend.get_vocab(with_added_tokens=False).items():
        if i >= vocab_size or i in added:
            continue
        if "ByteLevel" in types:
            try:
                out[i] = bytes(_BYTE_DECODER[c] for c in tok)
            except KeyError:
                out[i] = tok.encode("utf-8")
        elif "ByteFallback" in types or "Metaspace" in types or "Replace" in types:
            if len(tok) == 6 and tok.startswith("<0x") and tok.endswith(">"):
                out[i] = bytes([int(tok[3:5], 16)])
            else:
                out[i] = tok.replace("\u2581", " ").encode("utf-8")
        else:
            fail(f"cannot derive token bytes for a tokenizer whose decoder is {sorted(types)} "
                 "(byte-level and byte-fallback vocabularies are supported)")
    for i, t in added.items():
        if i < vocab_size and not t.special:
            out[i] = t.content.encode("utf-8")
    for i in exclude_ids:
        if 0 <= i < vocab_size:
            out[i] = None
    return out


_cache: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()
_by_id: dict = {}
_cache_lock = threading.Lock()


def vocab_for(tokenizer: Any, vocab_size: int, exclude_ids: Sequence[int] = ()) -> TokenVocab:
    """The (cached) TokenVocab of a tokenizer, or of an explicit token->bytes sequence."""
    if isinstance(tokenizer, TokenVocab):
        return tokenizer
    key = (int(vocab_size), tuple(sorted(set(int(i) for i in exclude_ids))))
    if isinstance(tokenizer, (list, tuple)):
        table = list(tokenizer[:vocab_size]) + [None] * max(0, vocab_size - len(tokenizer))
        for i in key[1]:
            if i < vocab_size:
                table[i] = None
        return TokenVocab(table)
    with _cache_lock:
        try:
            per = _cache.setdefault(tokenizer, {})
        except TypeError:  # not weak-referenceable: keep it for the process's life
            per = _by_id.setdefault(id(tokenizer), (tokenizer, {}))[1]  # holds it: no id reuse
        if key in per:
            return per[key]
    vocab = TokenVocab(token_bytes_of(tokenizer, vocab_size, key[1]))
    with _cache_lock:
        per.setdefault(key, vocab)
        return per[key]
