"""Bytes mode (the fast path; contract §4 D1-D2c, D4, D5): each token maps to a fixed byte
string (the `VocabInfo` tables), so a push is a table lookup plus an incremental UTF-8 decode
(``codecs.getincrementaldecoder``).

Context-dependent parts of the decoders are state of the byte stream: ``Strip(" ", n, 0)``
after ``Fuse`` (Llama-2) strips the first ``n`` spaces of the whole stream, and ``Metaspace``
with a prepend scheme drops ``▁`` from the first decoded token. "Stream" means prompt + output
(as in ``decode(prompt + output)``): with an empty prompt the output is exactly
``decode(output)`` (leading space stripped like HF); with a prompt the output keeps its leading
space, which is the text a user sees appended to the prompt. A push takes the fast branch
(no stream state left, no prompt character pending) or `_push_slow`.
"""

from __future__ import annotations

import codecs
from typing import Optional, Sequence

from jaxdecode.host.detokenizer.base import IncrementalDetokenizer
from jaxdecode.host.detokenizer.chain import strip_stream
from jaxdecode.types import DecodingError


def _first_unit(buf: bytes) -> Optional[int]:
    """Byte length of the first character of `buf` -- a valid character or, when invalid, its
    maximal subpart (the unit one U+FFFD replaces) -- or None while it is still unfinished."""
    lead = buf[0]
    if lead < 0x80:
        return 1
    if 0xC2 <= lead <= 0xDF:
        need, lo, hi = 2, 0x80, 0xBF
    elif lead == 0xE0:
        need, lo, hi = 3, 0xA0, 0xBF
    elif lead == 0xED:
        need, lo, hi = 3, 0x80, 0x9F
    elif 0xE1 <= lead <= 0xEF:
        need, lo, hi = 3, 0x80, 0xBF
    elif lead == 0xF0:
        need, lo, hi = 4, 0x90, 0xBF
    elif 0xF1 <= lead <= 0xF3:
        need, lo, hi = 4, 0x80, 0xBF
    elif lead == 0xF4:
        need, lo, hi = 4, 0x80, 0x8F
    else:
        return 1  # invalid start byte
    for i in range(1, need):
        if i >= len(buf):
            return None
        b = buf[i]
        if not ((lo <= b <= hi) if i == 1 else (0x80 <= b <= 0xBF)):
            return i
    return need


def _pending_tail(data: bytes) -> bytes:
    """The trailing valid-but-unfinished UTF-8 sequence of `data` (b"" when none)."""
    for k in (1, 2, 3):
        if len(data) < k:
            break
        cand = data[len(data) - k :]
        if 0xC2 <= cand[0] <= 0xF4 and _first_unit(cand) is None:
            return bytes(cand)
    return b""


class BytesDetokenizer(IncrementalDetokenizer, mode="bytes"):
    """Bytes mode: the token -> bytes table and an incremental UTF-8 decoder."""

    __slots__ = ("_slow", "_n", "_table", "_fill", "_codec", "_dec", "_first_pending",
                 "_strip_n", "_prompt_pending", "_ed_watch")

    def _start(self, prompt_ids: Sequence[int]) -> None:
        info = self.info
        self._n = info.vocab_size
        self._ed_watch = False
        self._prompt_pending = b""
        if self.skip_special_tokens and info.special_ids:
            self._table = info.table_skip
            self._fill = info.fill_skip
        else:
            self._table = info.table
            self._fill = info.fill
        self._codec = codecs.getincrementaldecoder("utf-8")(self.errors)
        self._dec = self._codec.decode
        self._first_pending = info.has_first_variant
        self._strip_n = info.strip_count
        self._prime(prompt_ids)
        self._slow = bool(self._first_pending or self._strip_n or self._prompt_pending)

    def push(self, token_id: int) -> str:
        """Append one selected token; return every character it completes (possibly "")."""
        if self._slow:
            return self._push_slow(token_id)
        if not 0 <= token_id < self._n:
            self.info.check_id(token_id)  # raises a clear ValueError
        b = self._table[token_id]
        if b is None:
            b = self._fill(self.info.check_id(token_id))
        if not b:
            return ""
        try:
            text = self._dec(b)
        except UnicodeDecodeError as exc:
            raise self._fail(exc, token_id) from None
        if self._ed_watch or 0xED in b:
            return self._check_surrogate(text, token_id)
        return text

    def _end(self) -> None:
        self._done = True
        self._slow = True

    def _drain(self) -> str:
        if self._prompt_pending:
            # The prompt's unfinished character never completed: it belongs to the prompt (D2b).
            self._prompt_pending = b""
            return ""
        try:
            return self._dec(b"", True)
        except UnicodeDecodeError as exc:
            raise self._fail(exc, None) from None

    def _drop_tail(self) -> None:
        self._prompt_pending = b""
        self._codec.reset()

    @property
    def pending_bytes(self) -> bytes:
        """Output bytes waiting to form a character."""
        if self._done:
            return b""
        return self._codec.getstate()[0]

    def _fail(self, exc: UnicodeDecodeError, token_id: Optional[int]) -> DecodingError:
        where = f"token {token_id}" if token_id is not None else "finish()"
        bad = exc.object[exc.start:exc.end]
        err = DecodingError(f"invalid UTF-8 in the output at {where}: {exc.reason} (byte {bad!r})")
        self._failed = err
        self._end()
        return err

    def _is_skipped(self, tid: int) -> bool:
        return self.skip_special_tokens and tid in self.info.special_ids

    def _stream_bytes(self, tid: int) -> bytes:
        """Bytes of `tid` at the current stream position, updating first/strip state."""
        info = self.info
        if self._is_skipped(tid):
            return b""
        b = info.token_bytes(tid, self._first_pending)
        self._first_pending = False
        if self._strip_n and b:
            b, self._strip_n = strip_stream(b, info.strip_byte, self._strip_n)
        return b

    def _prime(self, prompt_ids: Sequence[int]) -> None:
        """Feed the prompt's end to the stream state without emitting it (D2b).

        Only the stream start (while the first-token/strip state is live) and the last few
        bytes are examined, so the cost does not grow with the prompt length.
        """
        ids = list(prompt_ids)
        if not ids:
            return
        info = self.info
        n = len(ids)
        head = bytearray()
        k = 0
        while k < n and (self._first_pending or self._strip_n):
            head += self._stream_bytes(info.check_id(ids[k]))
            k += 1
        j = n
        nbytes = 0
        while j > k and nbytes < 4:
            j -= 1
            t = info.check_id(ids[j])
            if not self._is_skipped(t):
                nbytes += len(info.token_bytes(t))
        tail = bytearray(head) if j == k else bytearray()
        for t in ids[j:]:
            tail += self._stream_bytes(info.check_id(t))
        self._prompt_pending = _pending_tail(bytes(tail))

    def _push_slow(self, token_id: int) -> str:
        self._check_open()
        tid = self.info.check_id(token_id)
        b = self._stream_bytes(tid)
        if self._prompt_pending:
            if not b:
                return ""
            b = self._resolve_prompt_char(b)
            if b is None:
                return ""
        self._slow = bool(self._first_pending or self._strip_n or self._prompt_pending)
        if not b:
            return ""
        try:
            text = self._dec(b)
        except UnicodeDecodeError as exc:
            raise self._fail(exc, tid) from None
        if self._ed_watch or 0xED in b:
            return self._check_surrogate(text, tid)
        return text

    def _check_surrogate(self, text: str, token_id: int) -> str:
        """CPython's incremental UTF-8 decoder keeps ``ED A0..BF`` (a surrogate, always invalid
        in UTF-8) pending until a third byte arrives. Resolve it now: strict raises from this
        push (D2a), replace releases its two U+FFFD eagerly (D1), as the one-shot codec does."""
        pending = self._codec.getstate()[0]
        self._ed_watch = pending == b"\xed"
        if len(pending) >= 2 and pending[0] == 0xED and pending[1] >= 0xA0:
            self._ed_watch = False
            if self.errors == "strict":
                try:
                    pending.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise self._fail(exc, token_id) from None
            self._codec.reset()
            return text + pending.decode("utf-8", "replace")
        return text

    def _resolve_prompt_char(self, b: bytes) -> Optional[bytes]:
        """Attribute the character begun in the prompt to the prompt (D2b).

        Returns the output bytes that follow that character (its completion, or the maximal
        invalid subpart U+FFFD replaces), or None while it is still unfinished.
        """
        buf = self._prompt_pending + b
        consumed = _first_unit(buf)
        if consumed is None:
            self._prompt_pending = buf
            return None
        self._prompt_pending = b""
        return buf[consumed:]
