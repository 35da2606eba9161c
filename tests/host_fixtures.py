"""Tokenizers built in-process for the host-pipeline tests (no model hub, no network).

- `byte_tokenizer()`: ids 0..255 are the bytes themselves, 256 = <|endoftext|> (special): the
  text of a scripted model's ids is computable by hand.
- `byte_level_tokenizer()`: GPT-2 style byte-level BPE (ByteLevel pre-tokenizer + decoder),
  trained on a few multilingual lines; all 256 single-byte tokens exist, so random id
  sequences produce arbitrary (valid and invalid) UTF-8.
- `byte_fallback_tokenizer(decoder="llama2"|"metaspace")`: SentencePiece style BPE with
  ``byte_fallback=True``, ``<0x00>``..``<0xFF>`` tokens and Metaspace pre-tokenization; decoder
  either Llama-2's ``Replace/ByteFallback/Fuse/Strip`` chain or ``ByteFallback + Metaspace``.
- `wordpiece_tokenizer()`: BERT style WordPiece (not byte-mappable -> window mode).
- `ScriptedTokenizer`: a tiny fake tokenizer with a fixed id -> bytes table (e.g. the S4 fixture).

Every builder is cached: a tokenizer is built once per test session.
"""

from __future__ import annotations

import functools
import json
from typing import Dict, List, Sequence

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

CORPUS = [
    "héllo 世界 😀",
    "hello world, hello there",
    "the quick brown fox jumps over the lazy dog",
    "Ünïcödé ñ ß 日本語のテキスト 🎉🎉 العربية",
    "def foo(x):\n    return x + 1",
    "Привет мир! Καλημέρα κόσμε",
    "stop words: STOP, END, User:",
]


def byte_tokenizer() -> Tokenizer:
    """ids 0..255 = the bytes, 256 = <|endoftext|> (special)."""
    from jaxdecode.host.detokenizer import bytes_to_unicode

    b2u = bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={b2u[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
    assert tok.token_to_id("<|endoftext|>") == 256
    return tok


@functools.lru_cache(maxsize=None)
def byte_level_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    tok.add_tokens([AddedToken("<tool>", special=False)])
    tok.add_special_tokens([AddedToken("<|im_end|>", special=True)])
    return tok


def byte_of(tok: Tokenizer, b: int) -> int:
    """Id of the single-byte token for byte `b` in `byte_level_tokenizer()`."""
    from jaxdecode.host.detokenizer import bytes_to_unicode

    return tok.token_to_id(bytes_to_unicode()[b])


@functools.lru_cache(maxsize=None)
def byte_fallback_tokenizer(decoder: str = "llama2") -> Tokenizer:
    base = Tokenizer(models.BPE(unk_token="<unk>"))
    base.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    base.train_from_iterator(
        [line for line in CORPUS if line.isascii()] * 4,
        trainers.BpeTrainer(
            vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
        ),
    )
    spec = json.loads(base.to_str())["model"]
    vocab: Dict[str, int] = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for token, _ in sorted(spec["vocab"].items(), key=lambda kv: kv[1]):
        if token not in vocab:
            vocab[token] = len(vocab)
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in spec["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    if decoder == "llama2":
        tok.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        )
    elif decoder == "metaspace":
        tok.decoder = decoders.Sequence(
            [decoders.ByteFallback(), decoders.Metaspace(replacement="▁", prepend_scheme="always")]
        )
    else:
        raise ValueError(decoder)
    return tok


def fallback_bytes(tok: Tokenizer, ids: Sequence[int], skip_special_tokens: bool = True) -> bytes:
    """Independent reference for byte-fallback vocabularies: the concatenated token bytes.

    ``<0xNN>`` -> that byte, otherwise ``▁`` -> space; the whole stream's first space stripped
    (Llama-2 ``Strip``) or ``▁`` dropped from the first token (Metaspace prepend scheme).
    """
    specials = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    out = bytearray()
    first = True
    metaspace = "Metaspace" in tok.decoder.__getstate__().decode()
    for i in ids:
        if skip_special_tokens and i in specials:
            continue
        t = tok.id_to_token(i)
        if t.startswith("<0x") and t.endswith(">") and len(t) == 6:
            out.append(int(t[3:5], 16))
        elif metaspace and first:
            out += t.replace("▁", "").encode()
        else:
            out += t.replace("▁", " ").encode()
        first = False
    if not metaspace and out[:1] == b" ":
        del out[0]
    return bytes(out)


@functools.lru_cache(maxsize=None)
def wordpiece_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(
        CORPUS * 4,
        trainers.WordPieceTrainer(vocab_size=300, special_tokens=["[UNK]", "[CLS]", "[SEP]"], show_progress=False),
    )
    return tok


class ScriptedTokenizer:
    """A fake tokenizer: ``decode`` concatenates fixed byte strings (window mode only)."""

    def __init__(self, table: Dict[int, bytes], specials: Sequence[int] = ()):
        self.table = dict(table)
        self.all_special_ids = list(specials)
        self._size = max(self.table) + 1

    def __len__(self) -> int:
        return self._size

    def decode(self, ids: List[int], skip_special_tokens: bool = False, **_: object) -> str:
        data = b"".join(
            self.table.get(i, b"")
            for i in ids
            if not (skip_special_tokens and i in self.all_special_ids)
        )
        return data.decode("utf-8", "replace")


def byte_level_from_table(custom: Dict[int, bytes]) -> Tokenizer:
    """A byte-level tokenizer whose ids in `custom` decode to the given bytes.

    The 256 single-byte tokens fill the remaining ids 0..255+len(custom) in order.
    """
    return _byte_level_from_items(tuple(sorted(custom.items())))


@functools.lru_cache(maxsize=None)
def _byte_level_from_items(items) -> Tokenizer:
    from jaxdecode.host.detokenizer import bytes_to_unicode

    b2u = bytes_to_unicode()
    custom = dict(items)
    n = 256 + len(custom)
    assert all(0 <= i < n for i in custom)
    vocab: Dict[str, int] = {"".join(b2u[b] for b in data): i for i, data in custom.items()}
    free = (i for i in range(n) if i not in custom)
    for b in range(256):
        vocab.setdefault(b2u[b], next(free))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def s4_tokenizer() -> Tokenizer:
    """contract S4: a real byte-level tokenizer with token 101 -> bytes "AB" and 102 -> "CD"."""
    return byte_level_from_table({101: b"AB", 102: b"CD"})
