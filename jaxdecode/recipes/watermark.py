"""A green-list watermark (Kirchenbauer et al. 2023, "A Watermark for Large Language Models"),
as a custom processor and its detector.

At each step the vocabulary is split by a keyed hash of the previous token: a fraction `gamma`
of the ids is "green". The processor adds `delta` to the green logits (after the penalties and
masks, before temperature); a text written with it holds more green tokens than the gamma a
text written without it holds on average. The detector counts the green tokens of a token
sequence, each judged against its predecessor (a repeated pair once), and returns the
one-proportion z-score

    z = (green - gamma * T) / sqrt(T * gamma * (1 - gamma))

which is about N(0, 1) for text written without the key and large for watermarked text.

Green list: id v is green after id p when `(h(h(key ^ h(p)) ^ v) >> 8) < gamma * 2**24`, with
h the `lowbias32` integer hash on uint32 -- the same integer arithmetic on the device (the
processor, one [B, V] hash per step) and on the host (the detector, numpy). No permutation or
RNG: nothing depends on the platform's PRNG.

The key, gamma and delta live in the processor's `init_state` (data, not constants of the
compiled program), so another key never recompiles; the state is returned unchanged.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import jax.numpy as jnp
import numpy as np

from jaxdecode.device.research import LogitProcessor
from jaxdecode.tokenization import encode

SCALE = 16777216.0  # 2**24: gamma's resolution in the green test


def _h(x, xp):
    """lowbias32 on uint32 (wraps identically in numpy and XLA)."""
    x = x ^ (x >> 16)
    x = x * xp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * xp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def is_green(prev, token, key, gamma, xp=np):
    """bool array: `token` is green after `prev` under `key` (uint32 arrays, broadcast);
    `gamma` f32. `xp` is numpy (host) or jax.numpy (device)."""
    u32 = lambda a: xp.asarray(a).astype(xp.uint32)  # noqa: E731
    h = _h(_h(u32(key) ^ _h(u32(prev), xp), xp) ^ u32(token), xp)
    threshold = (xp.asarray(gamma, xp.float32) * xp.float32(SCALE)).astype(xp.uint32)
    return (h >> 8) < threshold


def _watermark(logits, ctx, params):
    prev = ctx.last_token()[:, None]
    ids = jnp.arange(logits.shape[-1], dtype=jnp.uint32)[None, :]
    green = is_green(prev, ids, params["key"][:, None], params["gamma"][:, None], jnp)
    return logits + params["delta"][:, None] * green, params


def watermark_processor(key: int, gamma: float = 0.25, delta: float = 2.0) -> LogitProcessor:
    """The watermarking processor for `jd.generate(..., processors=[...])` (any entry point).
    key: a secret integer in [0, 2**32); gamma in (0, 1): the green fraction; delta >= 0: the
    bias added to green logits."""
    if not 0 <= int(key) < 2**32:
        raise ValueError(f"key: must be in [0, 2**32), got {key}")
    if not 0.0 < gamma < 1.0:
        raise ValueError(f"gamma: must be in (0, 1), got {gamma}")
    if delta < 0:
        raise ValueError(f"delta: must be >= 0, got {delta}")
    state = {"key": np.uint32(key), "gamma": np.float32(gamma), "delta": np.float32(delta)}
    return LogitProcessor(_watermark, position="after_penalties", init_state=state)


@dataclasses.dataclass(frozen=True)
class Detection:
    """z: the z-score; green: green tokens counted; scored: tokens scored (T)."""

    z: float
    green: int
    scored: int


def detect(token_ids: Sequence[int], key: int, gamma: float = 0.25,
           prev: Optional[int] = None, ignore_repeats: bool = True) -> Detection:
    """Score a token sequence: each token against its predecessor (the first one against
    `prev`, e.g. the last prompt token, when given; else it is not scored). With
    `ignore_repeats` (the default) each distinct (predecessor, token) pair is scored once: a
    pair that comes back is judged the same way every time, so counting it again adds no
    evidence and lifts the z-score of repetitive text written without the key (Kirchenbauer et
    al., "On the Reliability of Watermarks for Large Language Models", 2023)."""
    ids = [int(t) for t in token_ids]
    if prev is not None:
        ids = [int(prev)] + ids
    if len(ids) < 2:
        raise ValueError("token_ids: need at least one scored token (two ids, or one and prev)")
    pairs = np.asarray(list(zip(ids[:-1], ids[1:])), np.int64)
    if ignore_repeats:
        pairs = np.unique(pairs, axis=0)
    green = int(np.sum(is_green(pairs[:, 0], pairs[:, 1], key, gamma)))
    return _score(green, len(pairs), gamma)


def _score(green: int, scored: int, gamma: float) -> Detection:
    z = (green - gamma * scored) / np.sqrt(scored * gamma * (1 - gamma))
    return Detection(z=float(z), green=green, scored=scored)


def pooled(detections: Sequence[Detection], gamma: float = 0.25) -> Detection:
    """One z-score over several scored sequences (their green and scored counts summed)."""
    return _score(sum(d.green for d in detections), sum(d.scored for d in detections), gamma)


def detect_text(text: str, tokenizer: Any, key: int, gamma: float = 0.25,
                ignore_repeats: bool = True) -> Detection:
    """`detect` on the tokenization of `text` (a `tokenizers.Tokenizer` or a transformers
    tokenizer)."""
    return detect(encode(tokenizer, text), key, gamma, ignore_repeats=ignore_repeats)


__all__ = ["Detection", "detect", "detect_text", "is_green", "pooled", "watermark_processor"]
