"""`EngineConfig`: how an `LLM` engine is built -- its sizes, KV pages, prefill chunks, decode
steps per call, per-request bounds, streams, records and numerics -- frozen, and validated once,
on construction: this is where the engine's construction errors are raised (ValueError naming
the field). What needs the model or the other construction objects (the model's context, its
row tile, the EOS ids, which options go together, the default decode steps) is checked by
`EngineConfig.for_model`, `check_options` and `decode_steps`, called by `LLM.__init__`.

`jd.LLM(model, params, tokenizer, max_slots=..., ...)` builds one from its keyword arguments (a
thin front: the same names and defaults); `jd.LLM(..., config=EngineConfig(...))` takes one
built beforehand. Per-request checks are admission.py's.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

from jaxdecode import invariance, kv_int8
from jaxdecode.device import constraints, decode
from jaxdecode.engine import adapters
from jaxdecode.tokenization import eos_token_id

MAX_NUM_BEAMS = 16
MAX_N = 128
DECODE_STEPS = 8  # a plain engine's most decode steps per device call (scheduler.py)


def _integer(name: str, value: Any, low: int = 1, high: Optional[int] = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (
            high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else "a positive integer"
        raise ValueError(f"{name}: must be {bound}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """The KV cache in pages: `pages` allocatable pages of `page_size` positions, prefill in
    chunks of `chunk` tokens (max_len: no chunking), the prefix cache on or off."""

    pages: int
    page_size: int
    chunk: int
    prefix_cache: bool

    @classmethod
    def check(cls, max_slots: int, max_len: int, kv_pages: Optional[int], page_size: int,
              prefill_chunk: Optional[int], prefix_cache: bool) -> "KVLayout":
        """The layout of these settings (ValueError naming the setting): the page size must
        divide the chunk; the budget must hold one request of max_len positions (default:
        max_slots of them, the memory of contiguous slots)."""
        _integer("page_size", page_size, 1, max_len)
        per_request = -(-max_len // page_size)
        chunk = max_len if prefill_chunk is None else prefill_chunk
        _integer("prefill_chunk", chunk)
        if chunk % page_size:
            raise ValueError(f"prefill_chunk: {chunk} is not a multiple of page_size "
                             f"{page_size} (chunks must end on page boundaries)")
        pages = max_slots * per_request if kv_pages is None else kv_pages
        _integer("kv_pages", pages)
        if pages < per_request:
            raise ValueError(f"kv_pages: {pages} pages of {page_size} positions hold less than "
                             f"one request of max_len {max_len} ({per_request} pages)")
        if not isinstance(prefix_cache, bool):
            raise ValueError(f"prefix_cache: must be True or False, got {prefix_cache!r}")
        return cls(pages, page_size, chunk, prefix_cache)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """The engine's settings (module docstring; the meaning of each: `jd.LLM`); `kv`: their
    KV layout. `row_tile` and `batch_invariant` are checked against the model (`for_model`)."""

    max_slots: int = 8
    max_len: int = 2048
    eos_token_ids: Optional[Sequence[int]] = None
    max_queue: int = 1024
    max_buffered: int = 4096
    backpressure: str = "buffer"
    trace: bool = True
    model_source: Optional[str] = None
    max_num_beams: int = MAX_NUM_BEAMS
    max_n: int = MAX_N
    max_constraint_compile_s: float = 30.0
    max_constraint_states: int = constraints.limits.MAX_STATES
    params_hash: Optional[str] = None
    kv_pages: Optional[int] = None
    page_size: int = 16
    prefix_cache: bool = True
    prefill_chunk: Optional[int] = 256
    decode_steps: Optional[int] = None
    row_tile: Optional[int] = None
    batch_invariant: bool = True
    lora_modules: Optional[Any] = None
    max_loras: Optional[int] = None
    kv_cache_dtype: str = "auto"

    def __post_init__(self):
        _integer("max_slots", self.max_slots)
        _integer("max_len", self.max_len, 2)
        _integer("max_queue", self.max_queue)
        for name in ("max_num_beams", "max_n"):
            _integer(name, getattr(self, name))
        if self.decode_steps is not None:
            _integer("decode_steps", self.decode_steps, 1, decode.MAX_STEPS_PER_CALL)
        kv_int8.check(self.kv_cache_dtype)
        self.kv  # noqa: B018 (validates the KV settings)
        # {name: path} -> (name, path) pairs (adapters.py): frozen, like every other field
        object.__setattr__(self, "lora_modules",
                           adapters.check_modules(self.lora_modules, self.max_loras) or None)

    @property
    def kv(self) -> KVLayout:
        return KVLayout.check(self.max_slots, self.max_len, self.kv_pages, self.page_size,
                              self.prefill_chunk, self.prefix_cache)

    def for_model(self, model: Any) -> Any:
        """`model` on this config's row tile and numerics (`row_tiled`), after the checks that
        need it (max_len within its context)."""
        model = row_tiled(model, self.row_tile, self.batch_invariant)
        _integer("max_len", self.max_len, 2, model.config.max_len)
        return model


def row_tiled(model: Any, row_tile: Optional[int],
              batch_invariant: Optional[bool] = None) -> Any:
    """`model` on `row_tile`-row weight-product tiles (None: its own tile), without invariance
    where `batch_invariant` is False (`invariance.configure`; ValueError naming the field)."""
    return invariance.configure(model, batch_invariant, row_tile)


def decode_steps(value: Optional[int], spec: Any, research: Any) -> int:
    """The engine's decode steps per call: `value`, by default DECODE_STEPS for a plain engine
    and 1 for a speculative one (a step is a round) or one with custom processors (their
    per-step outputs); ValueError naming decode_steps otherwise."""
    single = spec is not None or research is not None
    if value is None:
        return 1 if single else DECODE_STEPS
    _integer("decode_steps", value, 1, decode.MAX_STEPS_PER_CALL)
    if value > 1 and single:
        raise ValueError(f"decode_steps: must be 1 with {'speculative' if spec else 'processors'}"
                         f" (one step per call), got {value}")
    return value


def check_options(spec: Any, research: Any, mesh: Any, step_hook: Any,
                  lora: bool = False) -> None:
    """The engine options that do not go together (ValueError naming one of them); `lora`:
    the engine has adapters."""
    if lora and (mesh is not None or step_hook is not None):
        raise ValueError("lora_modules: not supported together with mesh= or step_hook= yet")
    if spec is not None and mesh is not None:
        raise ValueError("speculative: not supported together with mesh yet")
    if research is not None and spec is not None:
        raise ValueError("processors: not supported together with speculative= in the "
                         "engine (jd.speculative_generate takes processors)")
    if research is not None and step_hook is not None:
        raise ValueError("processors: not supported with step_hook (multi-host followers "
                         "run no user code)")


def ending_tokens(model: Any, tokenizer: Any, eos_token_ids: Optional[Sequence[int]]) -> tuple:
    """The engine's EOS ids: the given ones, else the model's, else the tokenizer's."""
    if eos_token_ids is None:
        eos_token_ids = model.config.eos_token_ids
        if not eos_token_ids and eos_token_id(tokenizer) is not None:
            eos_token_ids = (eos_token_id(tokenizer),)
    return tuple(eos_token_ids)
