"""What one request may ask of an engine: checked once, at submission, on the values the engine
will actually use (`Admission.request`, called by `jd.LLM`'s `submit` / `generate` /
`submit_beams`, builds the engine's `Request` only once every check passed).

`SamplingParams` already holds every value to its device dtype and range; here come the limits
that need the engine (`EngineLimits`):

- max_tokens is capped to the room the prompt leaves in `max_len` (the engine's effective
  value), and min_tokens must fit under that cap -- checked here, never inside the engine;
- num_beams <= `max_num_beams` and n <= `max_n`.

KV budget (`EngineLimits.kv_positions`): the engine is sized for max(max_slots, max_num_beams)
x max_len cache positions -- its slots, or one beam search of the widest width over the whole
context. A beam search allocates num_beams rows of `beam_positions` each (the context rounded
up to its buckets, so at most about twice prompt + max_tokens) beside the slots; with num_beams
<= max_num_beams and prompt + max_tokens <= max_len every request fits the budget, so
`num_beams: 100000` is refused here instead of failing the device with an out-of-memory error,
and the beam lane forms its calls within the budget (rows beyond it wait for the next call).
Sampled n runs as n slot requests over the preallocated slot KV, so n x length needs no extra
memory: n waits for free slots, bounded by `max_n` and the queue.

A response_format is compiled here too, in the submitting thread, within the engine's
`CompileBudget` (time, memory and automaton states; `cancelled()` abandons it).

Every violation is `ValueError("<field>: ...")`.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from typing import Any, Callable, Optional, Sequence, Union

from jaxdecode.config import SamplingParams
from jaxdecode.device import constraints, decode
from jaxdecode.device.state import seed_key_data
from jaxdecode.engine import adapters as adapters_lib
from jaxdecode.engine.config import MAX_N, MAX_NUM_BEAMS
from jaxdecode.engine.request import Request
from jaxdecode.prompts import token_row
from jaxdecode.tokenization import encode

Prompt = Union[str, Sequence[int]]


@dataclasses.dataclass(frozen=True)
class EngineLimits:
    """The per-request bounds of an engine (its `EngineConfig`, validated there)."""

    max_len: int          # the engine's positions per sequence
    max_slots: int
    model_max_len: int    # the model's context (beam searches allocate up to it)
    max_num_beams: int = MAX_NUM_BEAMS
    max_n: int = MAX_N

    @property
    def kv_positions(self) -> int:
        """The KV budget (module docstring)."""
        return max(self.max_slots, self.max_num_beams) * self.max_len


def beam_positions(limits: EngineLimits, num_beams: int, longest_prompt: int,
                   max_new: int) -> int:
    """KV cache positions a beam search of one row allocates (`decode.cache_len` per beam)."""
    return num_beams * decode.cache_len(longest_prompt, max_new, limits.model_max_len)


def check(sp: SamplingParams, prompt_len: int, limits: EngineLimits) -> SamplingParams:
    """`sp` with max_tokens capped to the context, after the engine limits above (ValueError
    naming the field otherwise): within them, a beam search fits the KV budget."""
    if sp.num_beams > limits.max_num_beams:
        raise ValueError(f"num_beams: at most {limits.max_num_beams} (this engine's "
                         f"max_num_beams), got {sp.num_beams}")
    if sp.n > limits.max_n:
        raise ValueError(f"n: at most {limits.max_n} (this engine's max_n), got {sp.n}")
    room = limits.max_len - prompt_len
    max_new = min(sp.max_tokens, room)
    if sp.min_tokens > max_new:
        raise ValueError(f"min_tokens: must be <= max_tokens as the engine runs it ({max_new}: "
                         f"max_tokens {sp.max_tokens} capped to the {room} positions the "
                         f"{prompt_len}-token prompt leaves in max_len {limits.max_len}), "
                         f"got {sp.min_tokens}")
    return sp if max_new == sp.max_tokens else dataclasses.replace(sp, max_tokens=max_new)


def link_samples(requests: list) -> None:
    """Sample i >= 1 of a sampled prompt shares sample 0's prompt pages (engine/samples.py)."""
    first: dict = {}
    for r in requests:
        if not r.is_beam:
            lead = first.setdefault(r.prompt_index, r)
            r.share_with = lead if lead is not r else None


def per_prompt(params: Any, prompts: list) -> list:
    """`LLM.generate`'s settings: one SamplingParams for every prompt, or one per prompt."""
    if isinstance(params, (list, tuple)):
        if len(params) != len(prompts):
            raise ValueError(f"params: expected 1 or {len(prompts)} SamplingParams, "
                             f"got {len(params)}")
        return list(params)
    return [params if params is not None else SamplingParams()] * len(prompts)


def ending_ids(eos_token_ids: tuple, sp: SamplingParams) -> tuple:
    """The ids that end a beam: the engine's EOS ids (none with ignore_eos) and the single
    stop ids (the grammar vocabulary excludes them too)."""
    eos = () if sp.ignore_eos else tuple(eos_token_ids)
    return tuple(dict.fromkeys(eos + sp.single_stop_ids))


@dataclasses.dataclass
class Admission:
    """Builds the engine's requests (module docstring): the tokenizer, the vocabulary, the
    limits, the constraint budget and the speculative option's own request checks; `stream`
    holds the stream settings (max_buffered, backpressure) and `trace` the trace switch."""

    model: Any
    tokenizer: Any
    limits: EngineLimits
    budget: constraints.CompileBudget
    eos_token_ids: tuple
    stream: dict
    trace: bool = True
    speculative: Optional[Any] = None  # engine.speculative.SpeculativeConfig
    adapters: Optional[Any] = None     # engine.adapters.Adapters

    def __post_init__(self):
        self._ids = itertools.count()

    def encode(self, prompt: Prompt) -> list[int]:
        ids = encode(self.tokenizer, prompt) if isinstance(prompt, str) else token_row(
            prompt, "prompt")
        if not ids:
            raise ValueError("prompt: empty prompt (it encodes to no tokens)")
        vocab = self.model.config.vocab_size
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise ValueError(f"prompt: token id {bad[0]} is outside the vocabulary "
                             f"(size {vocab})")
        if len(ids) >= self.limits.max_len:
            raise ValueError(f"prompt: {len(ids)} tokens leave no room in max_len "
                             f"{self.limits.max_len}")
        return ids

    @staticmethod
    def seed_of(sp: SamplingParams) -> int:
        """The request's seed: its own, else a random one."""
        return sp.seed if sp.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1

    def new_id(self) -> str:
        return f"req-{next(self._ids)}"

    def request(self, prompt: Prompt, params: Optional[SamplingParams],
                request_id: Optional[str] = None, prompt_index: int = 0, index: int = 0,
                output_kind: Optional[str] = None,
                cancelled: Optional[Callable[[], bool]] = None,
                seed: Optional[int] = None) -> Request:
        """Every check a request gets, before it is queued: SamplingParams' own, the
        vocabulary, the engine limits (`check`), the constraint compile (within its budget).
        `seed`: the n samples' one seed (engine/samples.py), by default `seed_of(params)`."""
        sp = params if params is not None else SamplingParams()
        if not isinstance(sp, SamplingParams):
            raise ValueError(f"params: expected SamplingParams, got {type(sp).__name__}")
        if sp.n != 1 and output_kind is None:
            raise ValueError("n: submit() and stream() take one sample; use generate() for n > 1")
        prompt_ids = self.encode(prompt)
        sp.check_vocab(self.model.config.vocab_size)
        adapter = adapters_lib.index_of(self.adapters, sp.lora)
        device_sp = check(sp, len(prompt_ids), self.limits)  # before a compile
        if self.speculative is not None and sp.num_beams == 1:  # beams take the beam lane
            self.speculative.check_request(sp)
        grammar = None
        if sp.response_format is not None and sp.response_format.get("type") != "text":
            # the vocabulary its lane compiles with, so the beam lane finds it in the cache
            ending = (ending_ids(self.eos_token_ids, sp) if sp.num_beams > 1
                      else self.eos_token_ids)
            vocab = constraints.vocab_for(self.tokenizer, self.model.config.vocab_size,
                                          exclude_ids=ending)
            grammar = constraints.compile_format(sp.response_format, vocab, budget=self.budget,
                                                 cancelled=cancelled)
        seed = self.seed_of(sp) if seed is None else seed
        key = decode.sample_keys(seed_key_data(seed), sp.n)[index]  # as jd.generate does
        r = Request(request_id or self.new_id(), prompt_ids, sp, tokenizer=self.tokenizer,
                    prompt_text=prompt if isinstance(prompt, str) else None, seed=seed,
                    key_data=key, prompt_index=prompt_index, index=index,
                    output_kind=output_kind or sp.output_kind, trace=self.trace,
                    grammar=grammar, device_sampling=device_sp, **self.stream)
        if adapter:
            r.adapter, r.adapter_tag = adapter, self.adapters.tag(sp.lora)
        return r
