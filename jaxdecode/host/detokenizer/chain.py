"""The decoder-chain parser (contract §4, D3): a `tokenizers` decoder serialised to JSON becomes
a `Chain` -- the steps that map one token's text to its bytes, and the stream-level state
(``Strip`` of the stream start after ``Fuse``, ``Metaspace``'s first-token variant) -- or
`Unsupported` when the chain cannot be modelled as a token -> bytes table.

Modelled: ByteLevel (GPT-2, Llama-3, Qwen); SentencePiece style ``Replace("▁", " ")``,
``ByteFallback`` for ``<0xNN>`` tokens, ``Fuse``, ``Strip``, ``Metaspace``.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Optional, Tuple

from jaxdecode.tokenization import bytes_to_unicode

_BYTE_DECODER = {c: b for b, c in bytes_to_unicode().items()}
_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


class Unsupported(Exception):
    """The decoder chain cannot be modelled as a token -> bytes table."""


@dataclasses.dataclass(frozen=True)
class Chain:
    """A modelled decoder chain: per-token `steps`, and the state of the byte stream."""

    steps: Tuple[Tuple, ...] = ()
    has_first_variant: bool = False    # Metaspace with a prepend scheme: the first token differs
    strip_byte: Optional[int] = None   # Strip(" ", n, 0) after Fuse: n bytes off the stream start
    strip_count: int = 0
    byte_level: bool = False

    def apply(self, token: str, first: bool) -> bytes:
        """The bytes of one token's text (its first-decoded-token variant when `first`)."""
        val: Any = token
        for step in self.steps:
            kind = step[0]
            if kind == "bytelevel":
                out = bytearray()
                for ch in val:
                    b = _BYTE_DECODER.get(ch)
                    if b is None:
                        out += ch.encode("utf-8")
                    else:
                        out.append(b)
                val = bytes(out)
            elif kind == "bytefallback":
                m = _BYTE_TOKEN.match(val)
                if m is not None:
                    val = bytes([int(m.group(1), 16)])
            elif isinstance(val, bytes):
                # String steps after ByteFallback only touch the text of a byte token when it
                # is a whole character (HF applies them to the decoded byte group).
                try:
                    s = val.decode("utf-8")
                except UnicodeDecodeError:
                    continue
                val = _string_step(step, s, first).encode("utf-8")
            else:
                val = _string_step(step, val, first)
        if isinstance(val, str):
            val = val.encode("utf-8")
        return val


class _Parser:
    """Reads the chain's items in order, with the state that decides what may follow what."""

    def __init__(self) -> None:
        self.steps: list = []
        self.fused = False
        self.produced_bytes = False  # ByteLevel/ByteFallback seen: later string steps are unsafe
        self.stream_strip = False
        self.byte_level = False
        self.has_first_variant = False
        self.strip_byte: Optional[int] = None
        self.strip_count = 0

    def item(self, it: dict) -> None:
        kind = it.get("type")
        if self.stream_strip and kind != "Fuse":
            raise Unsupported(f"{kind} after a stream-level Strip")
        handler = {"Fuse": self._fuse, "ByteLevel": self._byte_level,
                   "ByteFallback": self._byte_fallback, "Replace": self._replace,
                   "Strip": self._strip, "Metaspace": self._metaspace}.get(kind)
        if handler is None:
            raise Unsupported(f"decoder {kind!r} is not modelled")
        handler(it)

    def _fuse(self, it: dict) -> None:
        self.fused = True

    def _byte_level(self, it: dict) -> None:
        if self.produced_bytes:
            raise Unsupported("ByteLevel combined with another byte decoder")
        self.steps.append(("bytelevel",))
        self.produced_bytes = self.byte_level = True

    def _byte_fallback(self, it: dict) -> None:
        if self.fused or self.produced_bytes:
            raise Unsupported("ByteFallback after Fuse/ByteLevel")
        self.steps.append(("bytefallback",))
        self.produced_bytes = True

    def _replace(self, it: dict) -> None:
        pat = it.get("pattern", {})
        if "String" not in pat:
            raise Unsupported("Replace with a regex pattern")
        old, new = pat["String"], it.get("content", "")
        if self.produced_bytes and self.byte_level:
            raise Unsupported("Replace after ByteLevel")
        if self.fused and len(old) != 1:
            raise Unsupported("multi-character Replace after Fuse")
        if old:
            self.steps.append(("replace", old, new))

    def _strip(self, it: dict) -> None:
        content, start, stop = it.get("content", " "), int(it.get("start", 0)), int(
            it.get("stop", 0))
        if self.byte_level:
            raise Unsupported("Strip after ByteLevel")
        if not self.fused:
            if start or stop:
                self.steps.append(("strip", content, start, stop))
            return
        if stop:
            raise Unsupported("Strip of the stream end")
        enc = content.encode("utf-8")
        if len(enc) != 1:
            raise Unsupported("Strip of a multi-byte character")
        if start:
            self.strip_byte, self.strip_count = enc[0], start
            self.stream_strip = True

    def _metaspace(self, it: dict) -> None:
        if self.fused:
            raise Unsupported("Metaspace after Fuse")
        if self.byte_level:
            raise Unsupported("Metaspace after ByteLevel")
        repl = it.get("replacement", "▁")
        scheme = it.get("prepend_scheme")
        if scheme is None:
            scheme = "always" if it.get("add_prefix_space", True) else "never"
        first = scheme != "never"
        self.steps.append(("metaspace", repl, first))
        self.has_first_variant |= first

    def chain(self) -> Chain:
        return Chain(tuple(self.steps), self.has_first_variant, self.strip_byte,
                     self.strip_count, self.byte_level)


def parse_decoder(decoder: Any) -> Chain:
    """The `Chain` of a `tokenizers` decoder; `Unsupported` naming the part that is not
    modelled."""
    if decoder is None:
        raise Unsupported("tokenizer has no decoder (tokens joined by spaces)")
    try:
        spec = json.loads(decoder.__getstate__())
    except Exception as exc:  # pragma: no cover - defensive
        raise Unsupported(f"cannot serialise decoder: {exc}") from None
    parser = _Parser()
    for it in spec["decoders"] if spec.get("type") == "Sequence" else [spec]:
        parser.item(it)
    return parser.chain()


def _string_step(step: Tuple, s: str, first: bool) -> str:
    kind = step[0]
    if kind == "replace":
        return s.replace(step[1], step[2])
    if kind == "metaspace":
        return s.replace(step[1], "" if (first and step[2]) else " ")
    if kind == "strip":
        content, start, stop = step[1], step[2], step[3]
        i = 0
        while i < start and i < len(s) and s[i] == content:
            i += 1
        j = len(s)
        k = 0
        while k < stop and j > i and s[j - 1] == content:
            j -= 1
            k += 1
        return s[i:j]
    raise Unsupported(kind)  # pragma: no cover


def strip_stream(b: bytes, strip_byte: int, n: int) -> Tuple[bytes, int]:
    """`b` with up to `n` leading `strip_byte`s removed, and how many may still be stripped
    (0 once a non-strip byte is reached: the stream start is over)."""
    i = 0
    while i < n and i < len(b) and b[i] == strip_byte:
        i += 1
    b = b[i:]
    n -= i
    if b:
        n = 0
    return b, n
