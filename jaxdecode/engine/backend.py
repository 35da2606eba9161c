"""Slot backends: how the engine runs its device (JetStream's prefill / insert / generate).

A backend owns the device programs of one kind of step over a fixed batch of rows. The engine
never branches on the kind: every step returns up to K tokens per row (`StepResult`), plain
decoding being K = 1 and speculative decoding K = k + 1, and the output processor feeds them
through one per-token path.

    empty_state()                  every row done: a step over it selects and writes nothing
    prefill(tokens, lengths, rows) one prompt alone at its own bucket -> a one-row state
    insert(state, rows, slots)     scatter prefilled rows into slots
    set_flags(state, release, paused)
    step(state, kv_len, top_k)     one step over every row -> (state, device output)
    fetch(out, top_k)              the one host transfer of a step -> StepResult
    kv_needed(request)             the attention positions the next step needs for a request
    warmup(state, prompt buckets, kv buckets, top-ks)
    observe(request, result, slot) per-row bookkeeping once a step is processed

Both backends are pure device code over `jaxdecode.device`; they hold no request state except
the speculative acceptance counters.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional, Protocol, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxdecode.device import decode, slots
from jaxdecode.device.cache_ops import shared_tables
from jaxdecode.device.speculative import RoundConfig, spec_round
from jaxdecode.device.state import RowParams
from jaxdecode.engine.speculative import COUNTERS, SpeculativeConfig
from jaxdecode.model_api import DecoderModel, params_dtype


@dataclasses.dataclass
class StepResult:
    """One step's host output, B rows, K positions, N top logprobs (0 when not asked):
    tokens int32[B, K] in order (-1 past `counts`); counts int32[B] tokens emitted (0 for an
    empty, done or paused row); finish int32[B] the finish code of a row's last token (every
    earlier one is RUNNING); logprob f32[B, K] raw log-probabilities; top_ids / top_logprobs
    [B, K, N]; accepted int32[B] draft tokens among the emitted ones (speculative), or None."""

    tokens: np.ndarray
    counts: np.ndarray
    finish: np.ndarray
    logprob: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray
    accepted: Optional[np.ndarray] = None


class SlotBackend(Protocol):
    def empty_state(self) -> Any: ...
    def prefill(self, tokens: np.ndarray, lengths: np.ndarray, rows: RowParams) -> Any: ...
    def insert(self, state: Any, rows: Any, targets: np.ndarray) -> Any: ...
    def set_flags(self, state: Any, release: np.ndarray, paused: np.ndarray) -> Any: ...
    def step(self, state: Any, kv_len: int, top_k: int) -> tuple[Any, Any]: ...
    def fetch(self, out: Any, top_k: int) -> StepResult: ...
    def kv_needed(self, r: Any) -> int: ...
    def warmup(self, state: Any, prompt_buckets: Sequence[int], kv_buckets: Sequence[int],
               top_ks: Sequence[int]) -> Any: ...
    def observe(self, r: Any, result: StepResult, slot: int) -> None: ...


class _Rows:
    """What both backends share: the model, the slot count, the empty state, insert, flags.

    replicate_outputs: gather each step's output onto every device of `mesh`, so the leader
    can read it when the state is spread over other hosts' devices (a collective: the leader
    and its followers agree, step_ops.Context)."""

    def __init__(self, model: DecoderModel, params: Any, rows: int, max_len: int,
                 eos_token_ids: Sequence[int], research: Optional[Any] = None,
                 mesh: Optional[Any] = None, replicate_outputs: bool = False):
        self.model, self.params, self.rows, self.max_len = model, params, rows, max_len
        self.eos_token_ids, self.research, self.mesh = tuple(eos_token_ids), research, mesh
        self.replicate_outputs = replicate_outputs and mesh is not None

    def _output(self, out: Any) -> Any:
        return _replicator(self.mesh)(out) if self.replicate_outputs else out

    def _empty_rows(self) -> RowParams:
        return slots.empty_rows(self.rows, self.model.config.vocab_size, self.eos_token_ids)

    def insert(self, state: Any, rows: Any, targets: np.ndarray) -> Any:
        return slots.insert(state, rows, targets)

    def set_flags(self, state: Any, release: np.ndarray, paused: np.ndarray) -> Any:
        return slots.set_flags(state, release, paused)

    def observe(self, r: Any, result: StepResult, slot: int) -> None:
        return None

    def warmup(self, state: Any, prompt_buckets: Sequence[int], kv_buckets: Sequence[int],
               top_ks: Sequence[int]) -> Any:
        """Compile the one-row prefill + insert for each prompt bucket, the flags, and the
        step for each attention bucket and top-k (a row past the last is dropped)."""
        rows = slots.empty_rows(1, self.model.config.vocab_size, self.eos_token_ids)
        for t in prompt_buckets:
            fresh = self.prefill(np.zeros((1, t), np.int32), np.ones((1,), np.int32), rows)
            state = self.insert(state, fresh, np.full((1,), self.rows, np.int32))
        flags = np.zeros((self.rows,), bool)
        state = self.set_flags(state, flags, flags)
        for kv in kv_buckets:
            for top_k in top_ks:
                state, out = self.step(state, kv, top_k)
        return state


class PlainBackend(_Rows):
    """K = 1: one `decode.decode_step` per engine step (one loop body with `jd.generate`)."""

    tokens_per_step = 1

    def _research(self) -> dict:
        return {} if self.research is None else {"research_args": self.research.args}

    def _research_config(self) -> Optional[Any]:
        return None if self.research is None else self.research.config

    def empty_state(self) -> Any:
        config = slots.SlotConfig(self.model, params_dtype(self.params), self.max_len,
                                  self._research_config())
        return slots.empty_state(config, self._empty_rows(), mesh=self.mesh, **self._research())

    def prefill(self, tokens: np.ndarray, lengths: np.ndarray, rows: RowParams) -> Any:
        config = decode.PrefillConfig(self.model, self.max_len, self._research_config())
        return decode.prefill(config, self.params, tokens, lengths, rows, **self._research())

    def step(self, state: Any, kv_len: int, top_k: int) -> tuple[Any, Any]:
        config = decode.StepConfig(self.model, top_k, kv_len, self._research_config())
        state, out = decode.decode_step_jit(state, self.params, config=config, **self._research())
        return state, self._output(out)

    def fetch(self, out: Any, top_k: int) -> StepResult:
        arrays = (out.token, out.finish) + ((out.logprob, out.top_ids, out.top_logprobs)
                                            if top_k else ())
        fetched = jax.device_get(arrays)  # one transfer
        token, finish = fetched[:2]
        b = token.shape[0]
        logprob, top_ids, top_lp = (fetched[2:] if top_k else
                                    (np.zeros((b,), np.float32), np.zeros((b, 0), np.int32),
                                     np.zeros((b, 0), np.float32)))
        return StepResult(tokens=token[:, None], counts=(token >= 0).astype(np.int32),
                          finish=finish, logprob=logprob[:, None], top_ids=top_ids[:, None],
                          top_logprobs=top_lp[:, None])

    def kv_needed(self, r: Any) -> int:
        """Prompt, dispatched steps and the token this step writes."""
        return len(r.prompt_ids) + r.dispatched + 1


@functools.lru_cache(maxsize=None)
def _replicator(mesh: Any):
    """`tree` gathered onto every device of `mesh` (a collective: every process calls it)."""
    return jax.jit(lambda tree: tree, out_shardings=NamedSharding(mesh, PartitionSpec()))


@shared_tables
def _round(state: Any, tparams: Any, dparams: Any, *, config: RoundConfig):
    return spec_round(config, tparams, dparams, state)


class SpeculativeBackend(_Rows):
    """K = k + 1: one `speculative.spec_round` per engine step over every slot (one loop body
    with `jd.speculative_generate`). Keeps the acceptance counters (`stats`)."""

    def __init__(self, spec: SpeculativeConfig, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.spec = spec
        self.tokens_per_step = spec.k + 1
        self.totals = dict.fromkeys(COUNTERS, 0)
        self.slot_config = slots.SlotConfig(
            self.model, params_dtype(self.params), self.max_len, draft=spec.draft,
            draft_dtype=None if spec.draft is None else params_dtype(spec.draft_params))

    def empty_state(self) -> Any:
        return slots.empty_state(self.slot_config, self._empty_rows(), speculative=True)

    def prefill(self, tokens: np.ndarray, lengths: np.ndarray, rows: RowParams) -> Any:
        return slots.prefill_speculative(self.slot_config, self.params, self.spec.draft_params,
                                         tokens, lengths, rows)

    def step(self, state: Any, kv_len: int, top_k: int) -> tuple[Any, Any]:
        spec = self.spec
        config = RoundConfig(self.model, spec.draft, spec.k, spec.ngrams, kv_len, top_k,
                             spec.num_branches)
        state, out = _round(state, self.params, spec.draft_params, config=config)
        return state, self._output(out)

    def fetch(self, out: Any, top_k: int) -> StepResult:
        out = jax.device_get(out)  # one transfer (the top-k arrays are empty when 0)
        return StepResult(tokens=out.tokens, counts=out.count, finish=out.finish,
                          logprob=out.logprob, top_ids=out.top_ids,
                          top_logprobs=out.top_logprobs, accepted=out.accepted)

    def kv_needed(self, r: Any) -> int:
        """An upper bound of L + k + 1 for the round about to be dispatched: the prompt, the
        processed tokens and k + 1 tokens for each round in flight and this one."""
        return len(r.prompt_ids) + r.selected + (self.spec.k + 1) * (r.in_flight + 1)

    def observe(self, r: Any, result: StepResult, slot: int) -> None:
        """Add one processed round of `r` to its counters and the engine's."""
        emitted, accepted = int(result.counts[slot]), int(result.accepted[slot])
        if emitted == 0:
            return
        add = {"proposed": self.spec.k * self.spec.num_branches, "accepted": accepted,
               "target_tokens": emitted - accepted, "iterations": 1}
        mine = r.speculative if r.speculative is not None else dict.fromkeys(COUNTERS, 0)
        for name, value in add.items():
            self.totals[name] += value
            mine[name] += value
        r.speculative = mine
        r.lifecycle.record("speculative.round", round=mine["iterations"], emitted=emitted,
                           accepted=accepted)

    def stats(self) -> dict:
        """Engine totals over every processed round: proposed, accepted, target_tokens,
        iterations, and mean_accepted_length = tokens per round (1.0 = no gain)."""
        out = dict(self.totals)
        out["mean_accepted_length"] = ((out["accepted"] + out["target_tokens"])
                                       / max(1, out["iterations"]))
        return out
