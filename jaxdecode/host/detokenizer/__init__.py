"""Incremental detokenization (contract §4: D1-D6).

`IncrementalDetokenizer` turns selected token ids into text, one id at a time. Building one
builds the class of the decoding mode chosen once per tokenizer (and cached, see `vocab_info`):

``mode == "bytes"`` (fast path, `BytesDetokenizer`)
    The tokenizer's decoder is a chain we can model exactly -- ByteLevel (GPT-2, Llama-3, Qwen),
    or SentencePiece style (`Replace("▁", " ")`, `ByteFallback` for ``<0xNN>`` tokens, `Fuse`,
    `Strip`, `Metaspace`). Each token then maps to a fixed byte string (D3: such vocabularies are
    homomorphic), so a push is a table lookup plus an incremental UTF-8 decode. The table is
    filled lazily, shared by every request of the same tokenizer, and checked once against
    ``tokenizer.decode``; a mismatch selects the window strategy instead.

``mode == "window"`` (general fallback, `WindowDetokenizer`)
    For decoders that are not provably byte-mappable: vLLM-style windowed re-decode.

Modules: `vocab` (the vocabulary analysis: `VocabInfo`, `vocab_info`), `chain` (the decoder-chain
parser), `base` (the common base and its factory), `bytes_mode` and `window` (one class per mode).

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

from jaxdecode.host.detokenizer.base import IncrementalDetokenizer
from jaxdecode.host.detokenizer.bytes_mode import BytesDetokenizer
from jaxdecode.host.detokenizer.vocab import VocabInfo, vocab_info
from jaxdecode.host.detokenizer.window import WindowDetokenizer
from jaxdecode.tokenization import bytes_to_unicode

__all__ = [
    "IncrementalDetokenizer",
    "BytesDetokenizer",
    "WindowDetokenizer",
    "VocabInfo",
    "vocab_info",
    "bytes_to_unicode",
]
