"""contract O3: prefill + repeated decode steps give the logits of a full recompute of each prefix."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import jax.numpy as jnp
import numpy as np

from jaxdecode.device.decode import bucket, params_dtype
from jaxdecode.model_api import DecoderModel

# Declared tolerances per parameter dtype: (rtol, atol) on logits. bfloat16's 8-bit mantissa
# rounds a one-pass and a many-pass prefix differently in every layer: the 8-layer demo model
# (logits up to ~20) differs by up to 0.21 between the two, the 4-layer one before it by 0.10.
TOLERANCES = {"float32": (1e-4, 1e-4), "bfloat16": (2e-2, 3e-1), "float16": (1e-2, 5e-2)}


def incremental_logits(model: DecoderModel, params: Any, prompt: Sequence[int],
                       continuation: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """(incremental, recomputed) logits f32[len(continuation) + 1, V] for every prefix
    prompt + continuation[:i], i = 0..len(continuation)."""
    prompt, continuation = list(prompt), list(continuation)
    total = len(prompt) + len(continuation)
    cache_len = min(model.config.max_len, bucket(total))
    dtype = params_dtype(params)

    def run(tokens, positions, cache, n):
        t = bucket(n, cache_len)
        toks = np.zeros((1, t), np.int32)
        pos = np.zeros((1, t), np.int32)
        toks[0, :n], pos[0, :n] = tokens, positions
        return model.forward(params, jnp.asarray(toks), jnp.asarray(pos), cache,
                             lengths=jnp.asarray([n], jnp.int32))

    logits, cache = run(prompt, range(len(prompt)), model.init_cache(1, cache_len, dtype),
                        len(prompt))
    incremental = [np.asarray(logits[0, len(prompt) - 1])]
    for i, tok in enumerate(continuation):
        step_logits, cache = model.forward(params, jnp.asarray([[tok]], jnp.int32),
                                           jnp.asarray([[len(prompt) + i]], jnp.int32), cache,
                                           lengths=jnp.asarray([1], jnp.int32))
        incremental.append(np.asarray(step_logits[0, 0]))
    full_tokens = prompt + continuation
    full, _ = run(full_tokens, range(total), model.init_cache(1, cache_len, dtype), total)
    recomputed = np.asarray(full[0, len(prompt) - 1: total])
    return np.stack(incremental).astype(np.float32), recomputed.astype(np.float32)


def assert_incremental_consistency(model: DecoderModel, params: Any, prompt: Sequence[int],
                                   continuation: Sequence[int], rtol: Optional[float] = None,
                                   atol: Optional[float] = None) -> float:
    """Raise AssertionError naming the first inconsistent position; return the max abs error.

    Default tolerances are declared per parameter dtype in `TOLERANCES`."""
    default_rtol, default_atol = TOLERANCES.get(str(jnp.dtype(params_dtype(params))), (1e-4, 1e-4))
    rtol = default_rtol if rtol is None else rtol
    atol = default_atol if atol is None else atol
    inc, full = incremental_logits(model, params, prompt, continuation)
    for i in range(len(inc)):
        if not np.allclose(inc[i], full[i], rtol=rtol, atol=atol):
            err = float(np.max(np.abs(inc[i] - full[i])))
            raise AssertionError(
                f"incremental logits diverge from a full recompute at prefix length "
                f"{len(prompt) + i} (continuation step {i}): max abs error {err:.3g} "
                f"> atol {atol} + rtol {rtol} * |logits|")
    return float(np.max(np.abs(inc - full)))
