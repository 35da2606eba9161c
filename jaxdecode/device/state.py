"""The decoding state pytrees (contract §2): per-row settings as arrays, and the step state.

Static vs dynamic: batch size, vocabulary and cache length are shapes (static); every
per-request value -- temperature, limits, seeds, stop ids -- is an array entry, so a new request
never recompiles.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import jax
import numpy as np
from flax import struct

from jaxdecode.config import SamplingParams
from jaxdecode.model_api import KVCache

Array = jax.Array

# Device finish codes (0 = still running). Mapped to FinishReason / ErrorCode on the host.
RUNNING, EOS, STOP_TOKEN, MAX_TOKENS, CONTEXT_LIMIT, ALL_MASKED, MODEL_ERROR = range(7)
# constraints (jaxdecode/device/constraints): the grammar accepted and allows nothing more; every token
# masked on a constrained row (contract P2, ErrorCode.GRAMMAR_DEAD_END)
GRAMMAR_COMPLETE, GRAMMAR_DEAD_END = 7, 8


@struct.dataclass
class RowParams:
    """Per-row sampling settings as device arrays (contract P3). B = rows, V = vocabulary.

    temperature, top_p, min_p, repetition_penalty, frequency_penalty, presence_penalty: f32[B]
    top_k, max_tokens, min_tokens: int32[B]
    bias:     f32[B, V]  logit_bias, with -inf at banned ids
    eos_mask: bool[B, V] ids that end the request with `eos` (empty when ignore_eos)
    stop_mask: bool[B, V] single stop_token_ids (`stop_sequence`)
    keys:     uint32[B, 2] per-request base PRNG key data (contract X1)
    adapter:  int32[B] the row's LoRA adapter index (0: the base model; contract R6), passed to
              a model whose forward takes `adapters` (model_api)
    """

    temperature: Array
    top_k: Array
    top_p: Array
    min_p: Array
    repetition_penalty: Array
    frequency_penalty: Array
    presence_penalty: Array
    max_tokens: Array
    min_tokens: Array
    bias: Array
    eos_mask: Array
    stop_mask: Array
    keys: Array
    adapter: Array

    @classmethod
    def build(cls, sampling: Sequence[SamplingParams], vocab_size: int,
              eos_token_ids: Sequence[int] = (), keys: Optional[np.ndarray] = None,
              adapters: Optional[Sequence[int]] = None) -> "RowParams":
        """Host-side assembly in numpy; one transfer per field. `adapters`: each row's adapter
        index (default 0, the base model)."""
        b = len(sampling)
        f32 = lambda name: np.array([getattr(s, name) for s in sampling], np.float32)  # noqa: E731
        i32 = lambda name: np.array([getattr(s, name) for s in sampling], np.int32)  # noqa: E731
        bias = np.zeros((b, vocab_size), np.float32)
        eos_mask = np.zeros((b, vocab_size), bool)
        stop_mask = np.zeros((b, vocab_size), bool)
        for r, s in enumerate(sampling):
            s.check_vocab(vocab_size)
            for tok, value in s.logit_bias.items():
                bias[r, tok] = value
            bias[r, list(s.banned_token_ids)] = -np.inf
            if not s.ignore_eos:
                eos_mask[r, [i for i in eos_token_ids if i < vocab_size]] = True
            stop_mask[r, list(s.single_stop_ids)] = True
        if keys is None:
            keys = np.stack([seed_key_data(s.seed or 0) for s in sampling])
        return cls(temperature=f32("temperature"), top_k=i32("top_k"), top_p=f32("top_p"),
                   min_p=f32("min_p"), repetition_penalty=f32("repetition_penalty"),
                   frequency_penalty=f32("frequency_penalty"),
                   presence_penalty=f32("presence_penalty"), max_tokens=i32("max_tokens"),
                   min_tokens=i32("min_tokens"), bias=bias, eos_mask=eos_mask,
                   stop_mask=stop_mask, keys=np.asarray(keys, np.uint32),
                   adapter=np.asarray(adapters if adapters is not None else [0] * b, np.int32))


def seed_key_data(seed: int) -> np.ndarray:
    """The raw key data of `jax.random.key(seed)` under the default PRNG implementation.

    For threefry2x32 (the default) it is computed on the host as [seed >> 32, seed & 0xffffffff]
    -- equal to `jax.random.key(seed)` for seeds < 2**32, and distinct for every 63-bit seed
    (with x64 disabled, jax itself would truncate larger seeds to their low 32 bits)."""
    if jax.config.jax_default_prng_impl == "threefry2x32":
        return np.array([(seed >> 32) & 0xFFFFFFFF, seed & 0xFFFFFFFF], np.uint32)
    return np.asarray(jax.random.key_data(jax.random.key(seed)), np.uint32)


@struct.dataclass
class RowState:
    """What every decoding state carries per row, B rows, V vocabulary (the plain `StepState`
    and the speculative `SpecState` extend it):

    rows:       RowParams
    step:       int32[B] tokens selected so far (t - 1; the RNG cursor)
    counts:     int32[B, V] occurrences of each id in the output (frequency/presence penalties)
    seen:       bool[B, V] ids present in prompt or output (repetition penalty, HF semantics)
    done:       bool[B] the row has ended (or its slot is empty); it selects and writes nothing
    paused:     bool[B] the row skips steps and stays exactly as it is (back-pressure, contract B1)
    finish:     int32[B] device finish code (RUNNING while live)
    """

    rows: RowParams
    step: Array
    counts: Array
    seen: Array
    done: Array
    paused: Array
    finish: Array

    @property
    def live(self) -> Array:
        return ~self.done & ~self.paused


@struct.dataclass
class StepState(RowState):
    """Everything the decode step needs before selecting token t of each row (contract §2): the
    per-row fields of `RowState` and

    cache:      KVCache covering prompt + y[1:t-1] of each row (its `lengths` is where y_t goes)
    logits:     f32[B, V] raw next-token logits for that prefix
    last_token: int32[B] the most recently selected token (-1 before the first)
    grammar_state: int32[B] automaton state of each row (-1 = unconstrained), or None when no
                row of the batch is constrained. Per row, it moves with the cache: beams gather
                it, speculative decoding rolls it back with `cache.lengths`.
    grammar:    constraints.GrammarTables shared by all rows (not per row: vmap in_axes=None),
                or None. See jaxdecode/device/constraints/__init__.py.
    research:   research.ResearchState (custom processor states, ids, captured activations;
                every leaf per row), or None when no research option is used.
    """

    cache: KVCache
    logits: Array
    last_token: Array
    # constraints and research: None = not used, the step is unchanged
    grammar_state: Optional[Array] = None
    grammar: Optional[Any] = None
    research: Optional[Any] = None


@struct.dataclass
class StepOutput:
    """What one decode step reports per row.

    token: int32[B] y_t (-1 for rows that were already done); finish: int32[B] code set this step;
    logprob: f32[B] raw model log-probability of y_t; top_ids/top_logprobs: [B, K] (K may be 0).
    Research options only (jaxdecode/device/research.py; None otherwise): scores f32[B, V] the processed
    log-probabilities selection used and logits f32[B, V] the raw logits (each (values, ids)
    [B, K] with a top K); hidden {point: f32[B, hidden]} at the position whose logits chose y_t;
    observed: one pytree per step observer.
    """

    token: Array
    finish: Array
    logprob: Array
    top_ids: Array
    top_logprobs: Array
    scores: Optional[Any] = None
    logits: Optional[Any] = None
    hidden: Optional[Any] = None
    observed: Optional[Any] = None
