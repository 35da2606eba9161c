"""The vocabulary analysis (contract §4, D3): per-tokenizer facts shared by every request --
the decoding mode, the token -> bytes tables (filled lazily), the special and added ids, and the
reference ``decode`` -- built once per tokenizer (`vocab_info`, cached weakly).

``mode`` is ``"bytes"`` when the decoder chain parses (`chain.parse_decoder`) and the table
model agrees with ``tokenizer.decode`` on a deterministic sample of ids and id sequences
(singles, pairs, random runs, added/special tokens; `VocabInfo._self_check`); else
``"window"``, with the reason in ``reason``.
"""

from __future__ import annotations

import random
import threading
import weakref
from typing import Any, Callable, List, Optional, Sequence

from jaxdecode.host.detokenizer.chain import Chain, Unsupported, parse_decoder, strip_stream

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


def _vocabulary(tokenizer: Any, backend: Any) -> tuple[int, frozenset, frozenset]:
    """(size with added tokens, special ids, added ids) of `tokenizer`."""
    if backend is not None:
        added = backend.get_added_tokens_decoder()
        return (int(backend.get_vocab_size(with_added_tokens=True)),
                frozenset(int(i) for i, t in added.items() if t.special),
                frozenset(int(i) for i in added))
    try:
        size = len(tokenizer)
    except TypeError:
        size = getattr(tokenizer, "vocab_size", None)
    if size is None:
        raise TypeError(
            "tokenizer must be a tokenizers.Tokenizer, a transformers tokenizer, or an "
            "object with decode(ids) and len()/vocab_size"
        )
    special = frozenset(int(i) for i in getattr(tokenizer, "all_special_ids", ()) or ())
    return int(size), special, special


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
        self.vocab_size, self.special_ids, self.added_ids = _vocabulary(tokenizer, backend)
        self.mode = "window"
        self.reason = ""
        self.chain = Chain()
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
            chain = parse_decoder(backend.decoder)
        except Unsupported as exc:
            self.reason = str(exc)
            return
        self.chain = chain
        self.has_first_variant = chain.has_first_variant
        self.strip_byte, self.strip_count = chain.strip_byte, chain.strip_count
        self.byte_level = chain.byte_level
        self.table = [None] * n
        self.table_skip = [None] * n
        self.first_table = [None] * n if self.has_first_variant else []
        try:
            problem = self._self_check()
        except Unsupported as exc:  # pragma: no cover - defensive
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
    def token_bytes(self, token_id: int, first: bool = False) -> bytes:
        """Bytes contributed by `token_id` (first decoded token variant when `first`)."""
        tid = token_id
        table = self.first_table if (first and self.has_first_variant) else self.table
        b = table[tid]
        if b is None:
            tok = self.backend.id_to_token(tid)
            if tok is None:
                raise ValueError(f"token id {tid} is not in the tokenizer's vocabulary")
            b = self.chain.apply(tok, first and self.has_first_variant)
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
                b, strip_n = strip_stream(b, self.strip_byte, strip_n)
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

