"""Prompt token ids in every accepted form, as ragged rows of Python ints (docs/architecture.md: "prompts
everywhere"). The one normaliser behind `jd.generate`, `jd.beam_search`,
`jd.speculative_generate` and `jd.LLM`.

Accepted: a list or tuple of ints (one row); a list or tuple of rows, each a list or tuple of
ints or a 1-D integer array; a 1-D (one row) or 2-D (one row per line, taken whole: no padding
id) integer numpy or jax array. Python ints, numpy integers and 0-d integer arrays are ints;
bools are not. Anything else -- floats, strings, 3-D arrays, empty rows, no rows -- raises a
ValueError naming the caller's field (`prompt_ids`, or `prompt` for the engine). Token ids are
checked against the vocabulary by the callers, which know it. No jax import: arrays are read
with `np.asarray`.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def _is_array(x: Any) -> bool:  # numpy and jax arrays alike
    return hasattr(x, "__array__") and hasattr(x, "dtype") and hasattr(x, "ndim")


def _is_int_dtype(dtype: Any) -> bool:
    return np.issubdtype(dtype, np.integer) and dtype != np.bool_


def _is_id(x: Any) -> bool:
    if _is_array(x):
        return x.ndim == 0 and _is_int_dtype(x.dtype)
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _row(x: Any, field: str, r: int, text: bool) -> Any:
    if text and isinstance(x, str):
        return x
    if _is_array(x):
        a = np.asarray(x)
        if not _is_int_dtype(a.dtype):
            raise ValueError(f"{field}: token ids must be integers, got an array of {a.dtype}")
        if a.ndim != 1:
            raise ValueError(f"{field}: row {r} must be 1-D, got shape {a.shape}")
        ids = a.tolist()
    elif isinstance(x, (list, tuple)):
        bad = next((i for i in x if not _is_id(i)), None)
        if bad is not None:
            raise ValueError(f"{field}: token ids must be integers, got {bad!r} in row {r}")
        ids = [int(i) for i in x]
    else:
        kind = "integers" if isinstance(x, (float, np.floating, bool, np.bool_)) else (
            "lists of integers or 1-D integer arrays")
        raise ValueError(f"{field}: token ids must be {kind}, got {type(x).__name__} {x!r:.40}")
    if not ids:
        raise ValueError(f"{field}: row {r} is empty")
    return ids


def token_rows(prompt_ids: Any, field: str = "prompt_ids", *, text: bool = False) -> list:
    """Rows of token ids (`list[list[int]]`), one per prompt, from any accepted form.

    text=True is the engine's form (`LLM.generate`): a string is one prompt, a row may be a
    string (returned as is, encoded by the engine), and an empty list is no prompts."""
    if text and isinstance(prompt_ids, str):
        return [prompt_ids]
    if _is_array(prompt_ids):
        a = np.asarray(prompt_ids)
        if a.ndim not in (1, 2):
            raise ValueError(f"{field}: expected a 1-D or 2-D array of token ids, got shape "
                             f"{a.shape}")
        rows = [a] if a.ndim == 1 else list(a)
    elif isinstance(prompt_ids, (list, tuple)):
        if text and not prompt_ids:
            return []
        rows = [prompt_ids] if prompt_ids and _is_id(prompt_ids[0]) else list(prompt_ids)
    else:
        raise ValueError(f"{field}: expected token ids (a list of ints, a list of lists of ints, "
                         f"or a 1-D/2-D integer array), got {type(prompt_ids).__name__}")
    if not rows:
        raise ValueError(f"{field}: no prompts (an empty list)")
    return [_row(x, field, r, text) for r, x in enumerate(rows)]


def token_row(prompt_ids: Any, field: str = "prompt") -> list[int]:
    """One prompt's token ids (`LLM.submit`): any accepted form holding exactly one row."""
    rows = token_rows(prompt_ids, field)
    if len(rows) != 1:
        raise ValueError(f"{field}: one prompt expected, got {len(rows)} rows (generate() "
                         "takes several)")
    return rows[0]
