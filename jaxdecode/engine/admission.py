"""What one request may ask of an engine: checked once, at submission, on the values the engine
will actually use (`jd.LLM` calls `check` from `submit` / `generate` / `submit_beams`).

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

Every violation is `ValueError("<field>: ...")`.
"""

from __future__ import annotations

import dataclasses

from jaxdecode.device import decode
from jaxdecode.config import SamplingParams

MAX_NUM_BEAMS = 16
MAX_N = 128


@dataclasses.dataclass(frozen=True)
class EngineLimits:
    max_len: int          # the engine's positions per sequence
    max_slots: int
    model_max_len: int    # the model's context (beam searches allocate up to it)
    max_num_beams: int = MAX_NUM_BEAMS
    max_n: int = MAX_N

    def __post_init__(self):
        for name in ("max_num_beams", "max_n"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")

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
