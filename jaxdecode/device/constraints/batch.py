"""Submission-time glue for a batch (used by `decode.prepare`; the engine can call it too)."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

from jaxdecode.device.constraints.compile import IndexCache, compile_format
from jaxdecode.response_format import fail
from jaxdecode.device.constraints.tables import DENSE_MAX_ENTRIES, TableBundle, build_tables
from jaxdecode.device.constraints.vocab import vocab_for


def prepare_rows(sampling: Sequence[Any], tokenizer: Any, vocab_size: int,
                 eos_token_ids: Sequence[int] = (), *, cache: Optional[IndexCache] = None,
                 dense_max_entries: int = DENSE_MAX_ENTRIES
                 ) -> Optional[tuple[TableBundle, np.ndarray]]:
    """Compile every row's response_format; None when no row is constrained.

    Returns (bundle, initial grammar states int32[B], -1 for unconstrained rows). Raises
    ValueError naming `response_format` for a constraint that cannot be compiled (or when no
    tokenizer was given)."""
    formats = [getattr(s, "response_format", None) for s in sampling]
    if all(f is None or f.get("type") == "text" for f in formats):
        return None
    if tokenizer is None:
        fail("constrained decoding needs the tokenizer (pass tokenizer=... to generate)")
    vocab = vocab_for(tokenizer, vocab_size, exclude_ids=eos_token_ids)
    compiled = [None if f is None else compile_format(f, vocab, cache) for f in formats]
    bundle = build_tables(compiled, vocab_size, dense_max_entries)
    states = np.array([bundle.initial_state(c) for c in compiled], np.int32)
    return bundle, states
