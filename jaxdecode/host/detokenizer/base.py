"""`IncrementalDetokenizer`: the common base of the decoding modes and their factory (contract
§4: D1-D6). ``IncrementalDetokenizer(tokenizer, ...)`` builds the mode's class the tokenizer's
`VocabInfo` chose (``mode="auto"``) or the one asked for; each mode registers itself by name
(``class BytesDetokenizer(IncrementalDetokenizer, mode="bytes")``).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from jaxdecode.host.detokenizer.vocab import VocabInfo, vocab_info
from jaxdecode.types import DecodingError

_ERRORS = ("strict", "replace")
_MODES = ("auto", "bytes", "window")
_BY_MODE: dict = {}  # mode name -> its class


def _info(tokenizer: Any, errors: str, spaces_between_special_tokens: bool,
          mode: str) -> VocabInfo:
    if errors not in _ERRORS:
        raise ValueError(f"errors must be one of {_ERRORS}, got {errors!r}")
    if mode not in _MODES:
        raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")
    info = vocab_info(tokenizer, spaces_between_special_tokens)
    if mode == "bytes" and info.mode != "bytes":
        raise ValueError(f"bytes mode is not available for this tokenizer: {info.reason}")
    return info


class IncrementalDetokenizer:
    """Token ids in, complete characters out (contract §4).

    ``push(token_id) -> str``: the characters completed by this token (D1, eager).
    ``finish() -> str``: the legal tail (D4); strict raises `DecodingError`.
    ``discard()``: drop the undecoded tail after a stop hit (D5).
    ``mode``: ``"bytes"`` (token -> bytes table) or ``"window"`` (windowed re-decode).
    """

    __slots__ = ("errors", "skip_special_tokens", "info", "_tokenizer", "_done", "_failed")
    mode: str = ""

    def __init_subclass__(cls, mode: str = "", **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if mode:
            cls.mode = mode
            _BY_MODE[mode] = cls

    def __new__(cls, tokenizer: Any = None, prompt_ids: Sequence[int] = (),
                skip_special_tokens: bool = True, errors: str = "strict",
                spaces_between_special_tokens: bool = True, *, mode: str = "auto"):
        if cls is IncrementalDetokenizer:  # the factory (`copy` builds the class it copies)
            info = _info(tokenizer, errors, spaces_between_special_tokens, mode)
            cls = _BY_MODE[info.mode if mode == "auto" else mode]
        return object.__new__(cls)

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True, errors: str = "strict",
                 spaces_between_special_tokens: bool = True, *, mode: str = "auto"):
        if mode not in ("auto", self.mode):
            raise ValueError(f"mode: {type(self).__name__} decodes in {self.mode!r} mode, "
                             f"got {mode!r}")
        self.info = _info(tokenizer, errors, spaces_between_special_tokens,
                          "bytes" if self.mode == "bytes" else mode)
        self._tokenizer = tokenizer  # keeps the weakly cached VocabInfo's tokenizer alive
        self.errors = errors
        self.skip_special_tokens = bool(skip_special_tokens)
        self._done = False
        self._failed: Optional[DecodingError] = None
        self._start(prompt_ids)

    # ---- what a mode implements -------------------------------------------------------------
    def _start(self, prompt_ids: Sequence[int]) -> None:
        """Prime the mode's state with the prompt's end (D2b)."""
        raise NotImplementedError

    def push(self, token_id: int) -> str:
        """Append one selected token; return every character it completes (possibly "")."""
        raise NotImplementedError

    def _drain(self) -> str:
        """The tail at a non-stop ending (D4), after `_end`."""
        raise NotImplementedError

    def _drop_tail(self) -> None:
        """Forget the undecoded tail (D5), after `_end`."""
        raise NotImplementedError

    def _end(self) -> None:
        self._done = True

    # ---- shared -------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._failed is not None:
            raise self._failed
        if self._done:
            raise RuntimeError("push() after finish()/discard()")

    def push_many(self, token_ids: Sequence[int]) -> str:
        return "".join([self.push(t) for t in token_ids])

    def finish(self) -> str:
        """Drain the tail at a non-stop ending (D4). Idempotent; later pushes are refused."""
        if self._failed is not None:
            raise self._failed
        if self._done:
            return ""
        self._end()
        return self._drain()

    def discard(self) -> None:
        """Drop undecoded bytes after a stop hit or a cancel (D5): never an error."""
        self._end()
        self._drop_tail()

    @property
    def finished(self) -> bool:
        return self._done

    @property
    def pending_bytes(self) -> bytes:
        """Output bytes waiting to form a character (bytes mode; b"" in window mode)."""
        return b""

    def __repr__(self) -> str:
        return (
            f"IncrementalDetokenizer(mode={self.mode!r}, errors={self.errors!r}, "
            f"skip_special_tokens={self.skip_special_tokens})"
        )
