"""Incremental detokenization (contract §4: D1-D6).

`IncrementalDetokenizer` turns selected token ids into text, one id at a time.

Two strategies, chosen once per tokenizer (and cached, see `vocab_info`):

``mode == "bytes"`` (fast path)
    The tokenizer's decoder is a chain we can model exactly -- ByteLevel (GPT-2, Llama-3, Qwen),
    or SentencePiece style (`Replace("▁", " ")`, `ByteFallback` for ``<0xNN>`` tokens, `Fuse`,
    `Strip`, `Metaspace`). Each token then maps to a fixed byte string (D3: such vocabularies are
    homomorphic), so a push is a table lookup plus an incremental UTF-8 decode
    (``codecs.getincrementaldecoder``). The table is filled lazily, shared by every request of
    the same tokenizer, and checked once against ``tokenizer.decode`` on a deterministic sample
    of ids and id sequences (singles, pairs, random runs, added/special tokens); a mismatch
    selects the window strategy instead.

    Context-dependent parts of those decoders are modelled as state of the byte stream:
    ``Strip(" ", n, 0)`` after ``Fuse`` (Llama-2) strips the first ``n`` spaces of the whole
    stream, and ``Metaspace`` with a prepend scheme drops ``▁`` from the first decoded token.
    "Stream" means prompt + output (as in ``decode(prompt + output)``): with an empty prompt the
    output is exactly ``decode(output)`` (leading space stripped like HF); with a prompt the
    output keeps its leading space, which is the text a user sees appended to the prompt.

``mode == "window"`` (general fallback)
    For decoders that are not provably byte-mappable (WordPiece, BPE ``</w>``, regex Replace,
    slow `transformers` tokenizers, anything unknown): vLLM-style windowed re-decode. The
    window holds a few context ids plus the undecided ones; each push decodes the window,
    releases everything up to a trailing run of U+FFFD (an unfinished byte sequence), and the
    window slides forward once it is clean. Limitations (documented, not hidden): errors are
    only visible through the tokenizer's own lossy decoder, so ``errors="strict"`` raises at
    ``finish()`` when the tail is still unfinished, never at ``push``; a prompt ending inside a
    character gives its completing character to the prompt (D2b) by dropping the first
    character produced after it.

Rules implemented
-----------------
- D1: eager release -- every complete character is returned by the push that completes it.
- D2a: ``errors="replace"`` gives exactly ``bytes.decode("utf-8", "replace")`` of the concatenated
  token bytes (the standard maximal-subpart rule; for byte-fallback vocabularies HF's decoder
  replaces every byte of an invalid run instead -- we follow the contract, not HF, there).
  ``errors="strict"`` raises `jaxdecode.types.DecodingError` from the push that reveals an
  invalid byte (bytes mode).
- D2b: prompt priming -- the output holds exactly the characters whose first byte comes from an
  output token. Only the last few prompt ids are examined (cost independent of prompt length).
- D2c: skipped special tokens (``special=True`` added tokens, when ``skip_special_tokens``) are
  transparent: bytes on either side join. Non-skipped special tokens and non-special added
  tokens contribute their content passed through the decoder, as ``tokenizers`` does.
- D4: ``finish()`` drains the tail; strict -> `DecodingError`, replace -> U+FFFD.
- D5: ``discard()`` drops the undecoded tail after a stop hit (never an error).
- Out-of-vocabulary or negative ids raise ``ValueError`` naming the id.

Not applied: ``clean_up_tokenization_spaces`` of `transformers` (a lossy, non-incremental
post-process; transformers itself disables it for BPE) and ``spaces_between_special_tokens``
for fast tokenizers (ignored by their decode too; passed through to slow tokenizers in window
mode). The reference for "decode" is therefore the backend ``tokenizers.Tokenizer.decode``.
"""

from __future__ import annotations

import codecs
import json
import random
import re
import threading
import weakref
from typing import Any, Callable, List, Optional, Sequence, Tuple

from jaxdecode.tokenization import bytes_to_unicode
from jaxdecode.types import DecodingError

__all__ = [
    "IncrementalDetokenizer",
    "VocabInfo",
    "vocab_info",
    "bytes_to_unicode",
]

_ERRORS = ("strict", "replace")
_MODES = ("auto", "bytes", "window")
_REPLACEMENT = "\ufffd"

_BYTE_DECODER = {c: b for b, c in bytes_to_unicode().items()}
_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


class _Unsupported(Exception):
    """The decoder chain cannot be modelled as a token -> bytes table."""


# --------------------------------------------------------------------------------------------
# Tokenizer adaptation
# --------------------------------------------------------------------------------------------


def _backend_of(tokenizer: Any):
    """The `tokenizers.Tokenizer` behind `tokenizer`, or None."""
    try:
        import tokenizers  # noqa: WPS433
    except ImportError:  # pragma: no cover - tokenizers is a dependency
        return None
    if isinstance(tokenizer, tokenizers.Tokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if isinstance(backend, tokenizers.Tokenizer):
        return backend
    backend = getattr(tokenizer, "_tokenizer", None)
    if isinstance(backend, tokenizers.Tokenizer):
        return backend
    return None


def _ref(obj: Any) -> Callable[[], Any]:
    if obj is None:
        return lambda: None
    try:
        return weakref.ref(obj)
    except TypeError:
        return lambda: obj


class VocabInfo:
    """Per-tokenizer facts shared by all requests: strategy, token byte tables, special ids.

    Built once per tokenizer object by `vocab_info` (cached weakly). Tables are lists indexed by
    token id, filled lazily; filling is idempotent, so concurrent requests may race on it safely.
    """

    def __init__(self, tokenizer: Any, spaces_between_special_tokens: bool = True):
        # Weak references: the cache is keyed weakly by the tokenizer, so its value must not keep
        # the tokenizer alive (each IncrementalDetokenizer holds a strong reference instead).
        backend = _backend_of(tokenizer)
        self._tokenizer_ref = _ref(tokenizer)
        self._backend_ref = _ref(backend)
        self.spaces_between_special_tokens = spaces_between_special_tokens
        if backend is not None:
            self.vocab_size = int(backend.get_vocab_size(with_added_tokens=True))
            added = backend.get_added_tokens_decoder()
            self.special_ids = frozenset(int(i) for i, t in added.items() if t.special)
            self.added_ids = frozenset(int(i) for i in added)
        else:
            size = None
            try:
                size = len(tokenizer)
            except TypeError:
                size = getattr(tokenizer, "vocab_size", None)
            if size is None:
                raise TypeError(
                    "tokenizer must be a tokenizers.Tokenizer, a transformers tokenizer, or an "
                    "object with decode(ids) and len()/vocab_size"
                )
            self.vocab_size = int(size)
            special = getattr(tokenizer, "all_special_ids", ()) or ()
            self.special_ids = frozenset(int(i) for i in special)
            self.added_ids = self.special_ids
        self.mode = "window"
        self.reason = ""
        self._steps: List[Tuple] = []
        self.has_first_variant = False
        self.strip_byte: Optional[int] = None
        self.strip_count = 0
        self.byte_level = False
        n = self.vocab_size
        self.table: List[Optional[bytes]] = []
        self.table_skip: List[Optional[bytes]] = []
        self.first_table: List[Optional[bytes]] = []
        if backend is None:
            self.reason = "no tokenizers backend (slow or custom tokenizer)"
            return
        try:
            self._parse_decoder(backend.decoder)
        except _Unsupported as exc:
            self.reason = str(exc)
            return
        self.table = [None] * n
        self.table_skip = [None] * n
        self.first_table = [None] * n if self.has_first_variant else []
        try:
            problem = self._self_check()
        except _Unsupported as exc:  # pragma: no cover - defensive
            problem = str(exc)
        if problem:
            self.reason = "self-check failed: " + problem
            self.table, self.table_skip, self.first_table = [], [], []
            return
        self.mode = "bytes"

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer_ref()

    @property
    def backend(self) -> Any:
        return self._backend_ref()

    # ---- reference decode -----------------------------------------------------------------
    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        """The reference ``decode`` (backend decode; no clean-up of tokenization spaces)."""
        ids = [int(i) for i in ids]
        if self.backend is not None:
            return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)
        tok = self.tokenizer
        try:
            return tok.decode(
                ids,
                skip_special_tokens=skip_special_tokens,
                spaces_between_special_tokens=self.spaces_between_special_tokens,
                clean_up_tokenization_spaces=False,
            )
        except TypeError:
            try:
                return tok.decode(ids, skip_special_tokens=skip_special_tokens)
            except TypeError:
                return tok.decode(ids)

    def check_id(self, token_id: int) -> int:
        try:
            tid = int(token_id)
        except (TypeError, ValueError):
            raise ValueError(f"token id {token_id!r} is not an integer") from None
        if tid < 0 or tid >= self.vocab_size:
            raise ValueError(
                f"token id {tid} is outside the tokenizer's vocabulary (0..{self.vocab_size - 1})"
            )
        if self.backend is not None and self.backend.id_to_token(tid) is None:
            raise ValueError(f"token id {tid} is not in the tokenizer's vocabulary")
        return tid

    # ---- decoder chain --------------------------------------------------------------------
    def _parse_decoder(self, decoder) -> None:
        if decoder is None:
            raise _Unsupported("tokenizer has no decoder (tokens joined by spaces)")
        try:
            spec = json.loads(decoder.__getstate__())
        except Exception as exc:  # pragma: no cover - defensive
            raise _Unsupported(f"cannot serialise decoder: {exc}") from None
        items = spec["decoders"] if spec.get("type") == "Sequence" else [spec]
        steps: List[Tuple] = []
        fused = False
        produced_bytes = False  # ByteLevel/ByteFallback seen: later string steps are unsafe
        stream_strip = False
        for it in items:
            kind = it.get("type")
            if stream_strip and kind != "Fuse":
                raise _Unsupported(f"{kind} after a stream-level Strip")
            if kind == "Fuse":
                fused = True
            elif kind == "ByteLevel":
                if produced_bytes:
                    raise _Unsupported("ByteLevel combined with another byte decoder")
                steps.append(("bytelevel",))
                produced_bytes = True
                self.byte_level = True
            elif kind == "ByteFallback":
                if fused or produced_bytes:
                    raise _Unsupported("ByteFallback after Fuse/ByteLevel")
                steps.append(("bytefallback",))
                produced_bytes = True
            elif kind == "Replace":
                pat = it.get("pattern", {})
                if "String" not in pat:
                    raise _Unsupported("Replace with a regex pattern")
                old, new = pat["String"], it.get("content", "")
                if produced_bytes and self.byte_level:
                    raise _Unsupported("Replace after ByteLevel")
                if fused and len(old) != 1:
                    raise _Unsupported("multi-character Replace after Fuse")
                if old:
                    steps.append(("replace", old, new))
            elif kind == "Strip":
                content, start, stop = it.get("content", " "), int(it.get("start", 0)), int(
                    it.get("stop", 0)
                )
                if self.byte_level:
                    raise _Unsupported("Strip after ByteLevel")
                if fused:
                    if stop:
                        raise _Unsupported("Strip of the stream end")
                    enc = content.encode("utf-8")
                    if len(enc) != 1:
                        raise _Unsupported("Strip of a multi-byte character")
                    if start:
                        self.strip_byte = enc[0]
                        self.strip_count = start
                        stream_strip = True
                elif start or stop:
                    steps.append(("strip", content, start, stop))
            elif kind == "Metaspace":
                if fused:
                    raise _Unsupported("Metaspace after Fuse")
                if self.byte_level:
                    raise _Unsupported("Metaspace after ByteLevel")
                repl = it.get("replacement", "▁")
                scheme = it.get("prepend_scheme")
                if scheme is None:
                    scheme = "always" if it.get("add_prefix_space", True) else "never"
                first = scheme != "never"
                steps.append(("metaspace", repl, first))
                if first:
                    self.has_first_variant = True
            else:
                raise _Unsupported(f"decoder {kind!r} is not modelled")
        self._steps = steps

    def _apply(self, token: str, first: bool) -> bytes:
        val: Any = token
        for step in self._steps:
            kind = step[0]
            if kind == "bytelevel":
                bd = _BYTE_DECODER
                out = bytearray()
                for ch in val:
                    b = bd.get(ch)
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

    def token_bytes(self, token_id: int, first: bool = False) -> bytes:
        """Bytes contributed by `token_id` (first decoded token variant when `first`)."""
        tid = token_id
        table = self.first_table if (first and self.has_first_variant) else self.table
        b = table[tid]
        if b is None:
            tok = self.backend.id_to_token(tid)
            if tok is None:
                raise ValueError(f"token id {tid} is not in the tokenizer's vocabulary")
            b = self._apply(tok, first and self.has_first_variant)
            table[tid] = b
        return b

    def fill_skip(self, token_id: int) -> bytes:
        """Entry of `table_skip` (special ids contribute nothing) for an in-range id."""
        if token_id in self.special_ids:
            b = b""
        else:
            b = self.token_bytes(token_id)
        self.table_skip[token_id] = b
        return b

    def fill(self, token_id: int) -> bytes:
        return self.token_bytes(token_id)

    def simulate(self, ids: Sequence[int], skip_special_tokens: bool) -> bytes:
        """Bytes of a whole sequence under the table model (used by the self-check and tests)."""
        out = bytearray()
        first = True
        strip_n = self.strip_count
        for t in ids:
            if skip_special_tokens and t in self.special_ids:
                continue
            b = self.token_bytes(t, first)
            first = False
            if strip_n and b:
                b, strip_n = _strip_stream(b, self.strip_byte, strip_n)
            out += b
        return bytes(out)

    def _self_check(self) -> str:
        backend = self.backend
        n = self.vocab_size
        rng = random.Random(0x5EED)
        pool = set(self.added_ids)
        valid = [i for i in range(n) if backend.id_to_token(i) is not None] if n <= 4096 else None
        if valid is not None:
            pool.update(valid if len(valid) <= 400 else rng.sample(valid, 400))
        else:
            tries = 0
            while len(pool) < 400 + len(self.added_ids) and tries < 4000:
                tries += 1
                i = rng.randrange(n)
                if backend.id_to_token(i) is not None:
                    pool.add(i)
        pool = sorted(i for i in pool if 0 <= i < n and backend.id_to_token(i) is not None)
        if not pool:
            return "empty vocabulary"
        lossy_ok = self.byte_level  # from_utf8_lossy follows the same maximal-subpart rule

        def check(ids: List[int], skip: bool) -> str:
            want = backend.decode(ids, skip_special_tokens=skip)
            raw = self.simulate(ids, skip)
            try:
                got = raw.decode("utf-8")
            except UnicodeDecodeError:
                if not lossy_ok:
                    return ""  # HF byte-fallback replaces per byte; not comparable (D2a)
                got = raw.decode("utf-8", "replace")
            if got != want:
                return f"ids {ids}: table gives {got!r}, decode gives {want!r}"
            return ""

        for i in pool:
            for skip in (False, True):
                msg = check([i], skip)
                if msg:
                    return msg
        anchor = pool[rng.randrange(len(pool))]
        for i in pool:
            msg = check([anchor, i], False) or check([i, anchor], True)
            if msg:
                return msg
        for _ in range(200):
            ids = [pool[rng.randrange(len(pool))] for _ in range(rng.randint(2, 8))]
            msg = check(ids, rng.random() < 0.5)
            if msg:
                return msg
        return ""


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
    raise _Unsupported(kind)  # pragma: no cover


def _strip_stream(b: bytes, strip_byte: int, n: int) -> Tuple[bytes, int]:
    i = 0
    while i < n and i < len(b) and b[i] == strip_byte:
        i += 1
    b = b[i:]
    n -= i
    if b:
        n = 0  # a non-strip byte reached: the stream start is over
    return b, n


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


_INFO_LOCK = threading.Lock()
_INFO_CACHE: "weakref.WeakKeyDictionary[Any, VocabInfo]" = weakref.WeakKeyDictionary()
_STRONG_CACHE: dict = {}  # id(tokenizer) -> (tokenizer, VocabInfo) for non-weakrefable objects


def vocab_info(tokenizer: Any, spaces_between_special_tokens: bool = True) -> VocabInfo:
    """The cached `VocabInfo` of `tokenizer` (rebuilt when its vocabulary size changed)."""
    backend = _backend_of(tokenizer)
    key = tokenizer
    with _INFO_LOCK:
        info = None
        try:
            info = _INFO_CACHE.get(key)
        except TypeError:
            entry = _STRONG_CACHE.get(id(key))
            if entry is not None and entry[0] is key:
                info = entry[1]
        if info is not None:
            size = (
                backend.get_vocab_size(with_added_tokens=True)
                if backend is not None
                else info.vocab_size
            )
            if size == info.vocab_size and (
                backend is not None or info.spaces_between_special_tokens
                == spaces_between_special_tokens
            ):
                return info
        info = VocabInfo(tokenizer, spaces_between_special_tokens)
        try:
            _INFO_CACHE[key] = info
        except TypeError:
            if len(_STRONG_CACHE) >= 16:
                _STRONG_CACHE.pop(next(iter(_STRONG_CACHE)))
            _STRONG_CACHE[id(key)] = (key, info)
        return info


# --------------------------------------------------------------------------------------------
# The detokenizer
# --------------------------------------------------------------------------------------------

_WINDOW_CONTEXT = 6  # context ids kept at the start of the window
_WINDOW_MAX_BACK = 24  # how far back the prompt window may reach to start on a clean character


class IncrementalDetokenizer:
    """Token ids in, complete characters out (contract §4).

    ``push(token_id) -> str``: the characters completed by this token (D1, eager).
    ``finish() -> str``: the legal tail (D4); strict raises `DecodingError`.
    ``discard()``: drop the undecoded tail after a stop hit (D5).
    ``mode``: ``"bytes"`` (token -> bytes table) or ``"window"`` (windowed re-decode).
    """

    __slots__ = (
        "mode",
        "errors",
        "skip_special_tokens",
        "info",
        "_slow",
        "_n",
        "_table",
        "_fill",
        "_codec",
        "_dec",
        "_first_pending",
        "_strip_n",
        "_prompt_pending",
        "_done",
        "_failed",
        "_ids",
        "_emitted",
        "_drop_next",
        "_ed_watch",
        "_tokenizer",
    )

    def __init__(
        self,
        tokenizer: Any,
        prompt_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
        errors: str = "strict",
        spaces_between_special_tokens: bool = True,
        *,
        mode: str = "auto",
    ):
        if errors not in _ERRORS:
            raise ValueError(f"errors must be one of {_ERRORS}, got {errors!r}")
        if mode not in _MODES:
            raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")
        info = vocab_info(tokenizer, spaces_between_special_tokens)
        if mode == "bytes" and info.mode != "bytes":
            raise ValueError(f"bytes mode is not available for this tokenizer: {info.reason}")
        self.info = info
        self._tokenizer = tokenizer  # keeps the weakly cached VocabInfo's tokenizer alive
        self.mode = info.mode if mode == "auto" else mode
        self.errors = errors
        self.skip_special_tokens = bool(skip_special_tokens)
        self._n = info.vocab_size
        self._done = False
        self._failed: Optional[DecodingError] = None
        self._prompt_pending = b""
        self._first_pending = False
        self._strip_n = 0
        self._ids: List[int] = []
        self._emitted = 0
        self._drop_next = False
        self._ed_watch = False
        if self.mode == "bytes":
            if self.skip_special_tokens and info.special_ids:
                self._table = info.table_skip
                self._fill = info.fill_skip
            else:
                self._table = info.table
                self._fill = info.fill
            self._codec = codecs.getincrementaldecoder("utf-8")(errors)
            self._dec = self._codec.decode
            self._first_pending = info.has_first_variant
            self._strip_n = info.strip_count
            self._prime_bytes(prompt_ids)
            self._slow = bool(self._first_pending or self._strip_n or self._prompt_pending)
        else:
            self._table = None
            self._fill = None
            self._codec = None
            self._dec = None
            self._slow = True
            self._prime_window(prompt_ids)

    # ---- public API -----------------------------------------------------------------------
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

    def push_many(self, token_ids: Sequence[int]) -> str:
        return "".join([self.push(t) for t in token_ids])

    def finish(self) -> str:
        """Drain the tail at a non-stop ending (D4). Idempotent; later pushes are refused."""
        if self._failed is not None:
            raise self._failed
        if self._done:
            return ""
        self._done = True
        self._slow = True
        if self.mode == "window":
            return self._finish_window()
        if self._prompt_pending:
            # The prompt's unfinished character never completed: it belongs to the prompt (D2b).
            self._prompt_pending = b""
            return ""
        try:
            return self._dec(b"", True)
        except UnicodeDecodeError as exc:
            raise self._fail(exc, None) from None

    def discard(self) -> None:
        """Drop undecoded bytes after a stop hit or a cancel (D5): never an error."""
        self._done = True
        self._slow = True
        self._prompt_pending = b""
        if self._codec is not None:
            self._codec.reset()
        self._ids = []

    @property
    def finished(self) -> bool:
        return self._done

    @property
    def pending_bytes(self) -> bytes:
        """Output bytes waiting to form a character (bytes mode; b"" in window mode)."""
        if self._codec is None or self._done:
            return b""
        return self._codec.getstate()[0]

    # ---- bytes mode internals -------------------------------------------------------------
    def _fail(self, exc: UnicodeDecodeError, token_id: Optional[int]) -> DecodingError:
        where = f"token {token_id}" if token_id is not None else "finish()"
        err = DecodingError(
            f"invalid UTF-8 in the output at {where}: {exc.reason} (byte {exc.object[exc.start:exc.end]!r})"
        )
        self._failed = err
        self._done = True
        self._slow = True
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
            b, self._strip_n = _strip_stream(b, info.strip_byte, self._strip_n)
        return b

    def _prime_bytes(self, prompt_ids: Sequence[int]) -> None:
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
        if self._failed is not None:
            raise self._failed
        if self._done:
            raise RuntimeError("push() after finish()/discard()")
        tid = self.info.check_id(token_id)
        if self.mode == "window":
            return self._push_window(tid)
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

    # ---- window mode internals ------------------------------------------------------------
    def _wdecode(self, ids: Sequence[int]) -> str:
        return self.info.decode(ids, self.skip_special_tokens)

    def _prime_window(self, prompt_ids: Sequence[int]) -> None:
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

    def _push_window(self, tid: int) -> str:
        ids = self._ids
        ids.append(tid)
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
            self._slide_window()
        return out

    def _slide_window(self) -> None:
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

    def _finish_window(self) -> str:
        text = self._wdecode(self._ids) if self._ids else ""
        rest = text[self._emitted :]
        self._ids = []
        if self._drop_next:
            self._drop_next = False
            return rest[1:]  # the prompt's unfinished character (D2b)
        if rest and self.errors == "strict":
            err = DecodingError("the output ends with an incomplete UTF-8 sequence")
            self._failed = err
            raise err
        return rest

    def __repr__(self) -> str:
        return (
            f"IncrementalDetokenizer(mode={self.mode!r}, errors={self.errors!r}, "
            f"skip_special_tokens={self.skip_special_tokens})"
        )
