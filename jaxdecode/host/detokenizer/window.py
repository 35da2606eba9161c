"""Window mode (the general fallback; contract §4 D1, D2b, D4, D5): for decoders that are not
provably byte-mappable (WordPiece, BPE ``</w>``, regex Replace, slow `transformers` tokenizers,
anything unknown), a vLLM-style windowed re-decode.

The window holds a few context ids plus the undecided ones; each push decodes the window,
releases everything up to a trailing run of U+FFFD (an unfinished byte sequence), and the
window slides forward once it is clean. Limitations (documented, not hidden): errors are only
visible through the tokenizer's own lossy decoder, so ``errors="strict"`` raises at
``finish()`` when the tail is still unfinished, never at ``push``; a prompt ending inside a
character gives its completing character to the prompt (D2b) by dropping the first character
produced after it.
"""

from __future__ import annotations

from typing import Sequence

from jaxdecode.host.detokenizer.base import IncrementalDetokenizer
from jaxdecode.types import DecodingError

_REPLACEMENT = "\ufffd"
_WINDOW_CONTEXT = 6  # context ids kept at the start of the window
_WINDOW_MAX_BACK = 24  # how far back the prompt window may reach to start on a clean character


class WindowDetokenizer(IncrementalDetokenizer, mode="window"):
    """Window mode: re-decode a short window of ids with the tokenizer's own decode."""

    __slots__ = ("_ids", "_emitted", "_drop_next")

    def _wdecode(self, ids: Sequence[int]) -> str:
        return self.info.decode(ids, self.skip_special_tokens)

    def _start(self, prompt_ids: Sequence[int]) -> None:
        self._ids: list = []
        self._emitted = 0
        self._drop_next = False
        if not len(prompt_ids):
            return
        ids = [self.info.check_id(t) for t in prompt_ids[-_WINDOW_MAX_BACK:]]
        start = max(0, len(ids) - _WINDOW_CONTEXT)
        text = self._wdecode(ids[start:])
        while start > 0 and text.startswith(_REPLACEMENT):
            start -= 1
            text = self._wdecode(ids[start:])
        self._ids = ids[start:]
        stable = text.rstrip(_REPLACEMENT)
        self._emitted = len(stable)
        self._drop_next = len(stable) < len(text)

    def push(self, token_id: int) -> str:
        """Append one selected token; return every character it completes (possibly "")."""
        self._check_open()
        ids = self._ids
        ids.append(self.info.check_id(token_id))
        text = self._wdecode(ids)
        end = len(text)
        emitted = self._emitted
        while end > emitted and text[end - 1] == _REPLACEMENT:
            end -= 1
        if end <= emitted:
            return ""
        out = text[emitted:end]
        self._emitted = end
        if self._drop_next:
            out = out[1:]
            self._drop_next = False
        if end == len(text) and len(ids) > 4 * _WINDOW_CONTEXT:
            self._slide()
        return out

    def _slide(self) -> None:
        ids = self._ids
        start = len(ids) - _WINDOW_CONTEXT
        lowest = max(0, len(ids) - _WINDOW_MAX_BACK)
        while start >= lowest:
            text = self._wdecode(ids[start:])
            if not text.startswith(_REPLACEMENT) and not text.endswith(_REPLACEMENT):
                self._ids = ids[start:]
                self._emitted = len(text)
                return
            start -= 1

    def _drain(self) -> str:
        text = self._wdecode(self._ids) if self._ids else ""
        rest = text[self._emitted:]
        self._ids = []
        if self._drop_next:
            self._drop_next = False
            return rest[1:]  # the prompt's unfinished character (D2b)
        if rest and self.errors == "strict":
            err = DecodingError("the output ends with an incomplete UTF-8 sequence")
            self._failed = err
            raise err
        return rest

    def _drop_tail(self) -> None:
        self._ids = []
