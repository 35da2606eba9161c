"""`SamplingParams`: one request's decoding settings, validated on construction.

Every invalid value raises `ValueError` whose message starts with the field name, so the HTTP
layer can report `param`. Settings are plain host data; `jaxdecode.device.state.RowParams` turns a
batch of them into per-row device arrays, so new values never recompile.

Beam search (contract §10, HF `generate` names): `num_beams > 1` makes the engine run the request
by `jd.beam_search` (jaxdecode/engine/beam_lane.py) with `length_penalty` and `early_stopping`
(True / False / "never"); `n` is the number of beams returned (HF's `num_return_sequences`, the
`n` of vLLM's beam search), at most `num_beams`. Beam search ranks raw log-probabilities (HF
with `do_sample=False`), so a beam request takes no sampling processor: temperature must be 0
or 1 (either means "none"), and top_k, top_p, min_p, the penalties, logit_bias,
banned_token_ids and logprobs must keep their defaults. With `num_beams == 1` the two beam
fields are unused (HF ignores them too).

`lora`: the name of one of the engine's LoRA adapters (`LLM(lora_modules={name: path})`,
contract R6), None for the base model; not with beam search.

Device ranges (every value must be exact on the device, so one request can never make the
step compute inf/NaN or overflow an int32): integers fit int32; floats are finite in float32;
presence/frequency penalties are in [-2, 2] and logit_bias values in [-100, 100] (OpenAI's
and vLLM's ranges), repetition_penalty in [0.01, 100]; a temperature in (0, 1e-5) is greedy
(stored as 0, like vLLM: dividing by it would overflow float32). Bounded host work: at most
`MAX_STOP_STRINGS` stop strings of at most `MAX_STOP_CHARS` characters and `MAX_STOP_IDS` stop
ids. Limits that need the model or the engine (token ids and top_k within the vocabulary:
`check_vocab`; num_beams, n, the context) are checked by `jd.LLM` at submission.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Union

import numpy as np

from jaxdecode.response_format import validate_response_format

OUTPUT_KINDS = ("delta", "cumulative", "final_only")
MAX_LOGPROBS = 20  # the most top log-probabilities a request may ask for per token
UTF8_ERRORS = ("strict", "replace")
INT32_MAX = 2**31 - 1
F32_MAX = float(np.finfo(np.float32).max)
MIN_TEMPERATURE = 1e-5  # smaller positive temperatures are greedy (module docstring)
# the float fields: (low, high, how the range reads); also finite in float32
FLOAT_RANGES = {"temperature": (0.0, F32_MAX, ">= 0"), "top_p": (0.0, 1.0, "in (0, 1]"),
                "min_p": (0.0, 1.0, "in [0, 1]"),
                "repetition_penalty": (0.01, 100.0, "in [0.01, 100]"),
                "frequency_penalty": (-2.0, 2.0, "in [-2, 2]"),
                "presence_penalty": (-2.0, 2.0, "in [-2, 2]")}
MAX_LOGIT_BIAS = 100.0
MAX_STOP_STRINGS, MAX_STOP_CHARS, MAX_STOP_IDS = 64, 1024, 1024

StopTokenIds = tuple[Union[int, tuple[int, ...]], ...]


def _fail(field: str, message: str) -> None:
    raise ValueError(f"{field}: {message}")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _sequence(field: str, value: Any, limit: int) -> tuple:
    """`value` as a tuple of at most `limit` entries (ValueError naming `field` otherwise)."""
    if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__iter__"):
        _fail(field, f"must be a list, got {type(value).__name__}")
    items = tuple(value)
    if len(items) > limit:
        _fail(field, f"at most {limit} entries, got {len(items)}")
    return items


def _f32_finite(x: Any) -> bool:
    """A real number that stays finite as float32 (the device's dtype)."""
    return (not isinstance(x, bool) and isinstance(x, (int, float)) and math.isfinite(x)
            and abs(x) <= F32_MAX)



@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings (docs/architecture.md public API; contract §3, §5, §6, §8)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict = dataclasses.field(default_factory=dict)
    banned_token_ids: tuple = ()
    max_tokens: int = 16
    min_tokens: int = 0
    stop: tuple = ()
    stop_token_ids: StopTokenIds = ()
    include_stop_in_output: bool = False
    ignore_eos: bool = False
    seed: Optional[int] = None
    logprobs: int = 0
    n: int = 1
    skip_special_tokens: bool = True
    utf8_errors: str = "strict"
    deadline_s: Optional[float] = None
    output_kind: str = "delta"
    response_format: Optional[dict] = None
    num_beams: int = 1
    length_penalty: float = 1.0
    early_stopping: Union[bool, str] = False
    lora: Optional[str] = None

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        for name, (low, high, text) in FLOAT_RANGES.items():
            value = getattr(self, name)
            if not _f32_finite(value):
                _fail(name, f"must be a finite number (float32), got {value!r}")
            if not low <= value <= high or (name == "top_p" and not np.float32(value) > 0):
                _fail(name, f"must be {text}, got {value}")
            set_(name, float(value))
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            set_("temperature", 0.0)  # greedy (module docstring)
        for name, low in (("top_k", 0), ("max_tokens", 1), ("min_tokens", 0), ("logprobs", 0),
                          ("n", 1)):
            value = getattr(self, name)
            if not _is_int(value):
                _fail(name, f"must be an integer, got {value!r}")
            if not low <= value <= INT32_MAX:
                _fail(name, f"must be in [{low}, {INT32_MAX}]"
                      + (" (0 disables)" if name == "top_k" else "") + f", got {value}")
        if self.min_tokens > self.max_tokens:
            _fail("min_tokens", f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if self.logprobs > MAX_LOGPROBS:
            _fail("logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**63):
            _fail("seed", f"must be an integer in [0, 2**63) or None, got {self.seed!r}")
        if self.deadline_s is not None and (
                isinstance(self.deadline_s, bool) or not isinstance(self.deadline_s, (int, float))
                or not self.deadline_s > 0):
            _fail("deadline_s", f"must be a positive number of seconds or None, got {self.deadline_s!r}")
        if self.output_kind not in OUTPUT_KINDS:
            _fail("output_kind", f"must be one of {OUTPUT_KINDS}, got {self.output_kind!r}")
        if self.utf8_errors not in UTF8_ERRORS:
            _fail("utf8_errors", f"must be one of {UTF8_ERRORS}, got {self.utf8_errors!r}")
        set_("stop", self._normalise_stop(self.stop))
        set_("stop_token_ids", self._normalise_stop_ids(self.stop_token_ids))
        set_("banned_token_ids", self._normalise_ids("banned_token_ids", self.banned_token_ids))
        set_("logit_bias", self._normalise_bias(self.logit_bias))
        # shape only (cheap, no tokenizer); compiled at submission (jaxdecode/device/constraints)
        set_("response_format", validate_response_format(self.response_format))
        if self.lora is not None and (not isinstance(self.lora, str) or not self.lora):
            _fail("lora", f"must be an adapter name (a non-empty string) or None, got "
                  f"{self.lora!r}")
        self._check_beams()

    def _check_beams(self) -> None:
        """The beam-search fields (module docstring): values, and no sampling processor."""
        if not _is_int(self.num_beams) or not 1 <= self.num_beams <= INT32_MAX:
            _fail("num_beams", f"must be an integer in [1, {INT32_MAX}], got {self.num_beams!r}")
        lp = self.length_penalty
        if not _f32_finite(lp):
            _fail("length_penalty", f"must be a finite number (float32), got {lp!r}")
        object.__setattr__(self, "length_penalty", float(lp))
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            _fail("early_stopping", f"must be True, False or 'never', got {self.early_stopping!r}")
        if self.num_beams == 1:
            return
        if self.n > self.num_beams:
            _fail("n", f"the number of returned beams must be <= num_beams ({self.num_beams}), "
                  f"got {self.n}")
        if self.temperature not in (0.0, 1.0):
            _fail("temperature", f"beam search ranks raw log-probabilities; use 0 or 1 (no "
                  f"temperature) with num_beams > 1, got {self.temperature}")
        defaults = SamplingParams()
        for name in ("top_k", "top_p", "min_p", "repetition_penalty", "frequency_penalty",
                     "presence_penalty", "logit_bias", "banned_token_ids", "logprobs"):
            if getattr(self, name) != getattr(defaults, name):
                _fail(name, f"not available with beam search (num_beams > 1), got "
                      f"{getattr(self, name)!r}")

    @staticmethod
    def _normalise_stop(stop: Any) -> tuple[str, ...]:
        if stop is None:
            return ()
        items = (stop,) if isinstance(stop, str) else _sequence("stop", stop, MAX_STOP_STRINGS)
        for s in items:
            if not isinstance(s, str):
                _fail("stop", f"entries must be strings, got {s!r}")
            if s == "":
                _fail("stop", "empty stop string")
            if len(s) > MAX_STOP_CHARS:
                _fail("stop", f"a stop string may have at most {MAX_STOP_CHARS} characters, "
                      f"got {len(s)}")
        return items

    @staticmethod
    def _normalise_ids(field: str, ids: Any, limit: int = INT32_MAX) -> tuple[int, ...]:
        ids = (ids,) if _is_int(ids) else _sequence(field, ids or (), limit)
        for i in ids:
            if not _is_int(i) or not 0 <= i <= INT32_MAX:
                _fail(field, f"entries must be token ids in [0, {INT32_MAX}], got {i!r}")
        return ids

    @classmethod
    def _normalise_stop_ids(cls, ids: Any) -> StopTokenIds:
        out: list = []
        entries = (ids,) if _is_int(ids) else _sequence("stop_token_ids", ids or (), MAX_STOP_IDS)
        if sum(1 if _is_int(e) else len(e) if isinstance(e, (list, tuple)) else 1
               for e in entries) > MAX_STOP_IDS:
            _fail("stop_token_ids", f"at most {MAX_STOP_IDS} ids in all")
        for entry in entries:
            if _is_int(entry):
                out.append(cls._normalise_ids("stop_token_ids", (entry,))[0])
            else:
                seq = cls._normalise_ids("stop_token_ids", entry)
                if not seq:
                    _fail("stop_token_ids", "empty id sequence")
                out.append(seq[0] if len(seq) == 1 else seq)
        return tuple(out)

    @staticmethod
    def _normalise_bias(bias: Any) -> dict:
        if bias is None:
            return {}
        if not isinstance(bias, dict):
            _fail("logit_bias", f"must be a mapping of token id to bias, got {type(bias).__name__}")
        out = {}
        for k, v in bias.items():
            try:
                tok = int(k)
            except (TypeError, ValueError):
                _fail("logit_bias", f"keys must be token ids, got {k!r}")
            if not 0 <= tok <= INT32_MAX:
                _fail("logit_bias", f"keys must be token ids in [0, {INT32_MAX}], got {k!r}")
            if not _f32_finite(v) or abs(v) > MAX_LOGIT_BIAS:
                _fail("logit_bias", f"values must be numbers in [-{MAX_LOGIT_BIAS:g}, "
                      f"{MAX_LOGIT_BIAS:g}], got {v!r} for token {k!r}")
            out[tok] = float(v)
        return out

    @property
    def single_stop_ids(self) -> tuple[int, ...]:
        """Stop ids decided on the device (contract §5); sequences are matched on the host."""
        return tuple(i for i in self.stop_token_ids if _is_int(i))

    @property
    def stop_id_sequences(self) -> tuple[tuple[int, ...], ...]:
        return tuple(i for i in self.stop_token_ids if not _is_int(i))

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids and top_k must fit the model's vocabulary (checked once it is known)."""
        if self.top_k > vocab_size:
            _fail("top_k", f"must be <= the vocabulary size ({vocab_size}), got {self.top_k}")
        stop_ids = self.single_stop_ids + tuple(i for seq in self.stop_id_sequences for i in seq)
        for name, ids in (("banned_token_ids", self.banned_token_ids),
                          ("logit_bias", tuple(self.logit_bias)), ("stop_token_ids", stop_ids)):
            for i in ids:
                if i >= vocab_size:
                    _fail(name, f"token id {i} is outside the vocabulary (size {vocab_size})")
