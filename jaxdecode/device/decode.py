"""The jitted device core: `prefill`, `decode_step` and the on-device `generate` loop
(contract §2, §5).

One loop body, two drivers: `decode_step` is the body; `generate` runs it inside
`lax.while_loop` (one dispatch for the whole generation; the engine runs the same loop for a
few steps per call, `decode_steps_jit`) or, with `trace=False`, from a Python loop (for
debugging). Each driver is batch invariant (docs/batch_invariance.md); the two compile the step
differently, so their logits can differ in the last bit and a near-tie can pick another token.

Off-by-one convention (contract O1): `decode_step` selects y_t from the logits of prompt + y[1:t-1];
if y_t ends its row (EOS, stop id, max_tokens, context limit, a dead end) it is never written;
otherwise it is written at position m + t - 1 (= `cache.lengths`) and z_{t+1} is computed.

Token-level stops are decided here, with zero wasted steps, in this priority (contract S9): a model
error (NaN logits), every token masked (on a constrained row: grammar_dead_end), EOS, a stop
id, grammar completion, max_tokens, the context limit. Constraints: jaxdecode/device/constraints.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import threading
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxdecode import invariance, kv_int8
from jaxdecode.config import SamplingParams
from jaxdecode.device import cache_ops, constraints, hooks, numerics, outputs, processors
from jaxdecode.device import research as research_lib
from jaxdecode.device import sampling as sampling_lib
from jaxdecode.device import stops
from jaxdecode.device.outputs import GenerateOutput
from jaxdecode.device.state import RUNNING, RowParams, StepOutput, StepState, seed_key_data
from jaxdecode.model_api import DecoderModel, params_dtype
from jaxdecode.prompts import token_rows
from jaxdecode.shapes import MIN_BUCKET, bucket  # noqa: F401 (decode.bucket is public)

Array = jax.Array


def cache_len(longest_prompt: int, max_new: int, max_len: int) -> int:
    """The cache length `generate` / `beam_search` allocate for these prompts and new tokens."""
    return min(max_len, bucket(bucket(longest_prompt, max_len) + max_new))


# -- compilation counting (tests and benchmarks assert zero recompiles after warm-up) ----------

_compiles = 0
_compiles_lock = threading.Lock()


def _on_event(name: str, *args, **kwargs) -> None:
    global _compiles
    if name == "/jax/core/compile/backend_compile_duration":
        with _compiles_lock:
            _compiles += 1


jax.monitoring.register_event_duration_secs_listener(_on_event)


def compilation_count() -> int:
    """XLA programs this process has built so far: compiled by the backend or loaded from JAX's
    persistent compilation cache (`jax_compilation_cache_dir`; jax times a load as a backend
    compile) -- a program loaded from disk is a new program all the same."""
    return _compiles


# -- static configurations (one frozen, hashable object per jitted function) ------------------

@dataclasses.dataclass(frozen=True)
class PrefillConfig:
    """Static part of a prompt pass: the model, the cache length to allocate, research options,
    the cache's `kv_cache_dtype` ("auto": the weights' dtype; "int8": jaxdecode/kv_int8.py)."""

    model: DecoderModel
    cache_len: int
    research: Optional[research_lib.ResearchConfig] = None
    kv_cache_dtype: str = "auto"


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """Static part of a decode step: the model, how many raw top log-probabilities to report,
    the attention bucket (attend to the first `kv_len` cache positions; None: all), research
    options (jaxdecode/device/research.py)."""

    model: DecoderModel
    top_logprobs: int = 0
    kv_len: Optional[int] = None
    research: Optional[research_lib.ResearchConfig] = None


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    """Static part of the on-device generation loop: its step and the output buffer width."""

    step: StepConfig
    num_steps: int


# -- prefill and the step ----------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def accepts(model_type: type, keyword: str) -> bool:
    """Whether a model's forward takes an optional keyword (`kv_len`, `last_only`: model_api)."""
    return keyword in inspect.signature(model_type.forward).parameters


def kv_len_keyword(model: DecoderModel, kv_len: Optional[int]) -> dict:
    """The forward's `kv_len` keyword when there is a bound and the model takes one."""
    return {"kv_len": kv_len} if kv_len is not None and accepts(type(model), "kv_len") else {}


def adapter_keyword(model: DecoderModel, adapters: Optional[Array]) -> dict:
    """The forward's `adapters` keyword (each row's LoRA adapter index, contract R6) when the
    model takes one."""
    return ({"adapters": adapters} if adapters is not None and accepts(type(model), "adapters")
            else {})


def last_logits(model: DecoderModel, params: Any, tokens: Array, positions: Array, cache: Any,
                lengths: Array, **extra: Any) -> tuple[Array, Any]:
    """A prompt pass: the forward, and the f32 logits [B, V] after each row's last token
    (lengths int32[B]; a row without tokens gives its first position's). Asks the model for
    those logits only (`last_only`) when its forward takes the keyword (model_api)."""
    if accepts(type(model), "last_only"):
        logits, cache = model.forward(params, tokens, positions, cache, lengths=lengths,
                                      last_only=True, **extra)
        return logits[:, 0].astype(jnp.float32), cache
    logits, cache = model.forward(params, tokens, positions, cache, lengths=lengths, **extra)
    last = jnp.take_along_axis(logits, jnp.maximum(lengths - 1, 0)[:, None, None], axis=1)
    return last[:, 0].astype(jnp.float32), cache


def research_hook(research: Optional[research_lib.ResearchConfig], args: Any, captured: dict,
                  select) -> dict:
    """The forward's `hook` keyword for a research run with capture or interventions (captured
    points land in `captured`, each through `select`), else no keyword."""
    if research is None or not research.hooked:
        return {}
    return {"hook": hooks.make_hook(research.interventions, args.hook_args, research.capture,
                                    captured, select)}


@numerics.jit(static_argnums=(0,))
def prefill(config: PrefillConfig, params: Any, tokens: Array, lengths: Array, rows: RowParams,
            research_args: Optional[research_lib.ResearchArgs] = None) -> StepState:
    """Prompt pass: tokens int32[B, T] right-padded (T a bucket), lengths int32[B] >= 1.

    Returns the StepState before y_1: the cache holds the prompts, `logits` is the last real
    position's row of logits. The decoder calls it one prompt at a time, at the prompt's own
    bucket (`prefill_rows`), so a row's prefill never depends on its neighbours. With research
    options, interventions apply to the prompt and `StepState.research` starts."""
    model, research = config.model, config.research
    b, t = tokens.shape
    cache = model.init_cache(b, config.cache_len,
                             kv_int8.pool_dtype(config.kv_cache_dtype, params_dtype(params)))
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    # the cache is empty before the prompt: attend to the prompt bucket only
    extra = {**kv_len_keyword(model, t), **adapter_keyword(model, rows.adapter)}
    captured: dict = {}
    extra.update(research_hook(research, research_args, captured, lambda x: jnp.take_along_axis(
        x, (lengths - 1)[:, None, None], axis=1)[:, 0]))
    last, cache = last_logits(model, params, tokens, positions, cache, lengths, **extra)
    vocab = last.shape[-1]
    real = jnp.arange(t)[None, :] < lengths[:, None]
    seen = jnp.zeros((b, vocab), bool).at[jnp.arange(b)[:, None], tokens].max(real)
    state = StepState(cache=cache, logits=last,
                      last_token=jnp.full((b,), -1, jnp.int32), step=jnp.zeros((b,), jnp.int32),
                      counts=jnp.zeros((b, vocab), jnp.int32), seen=seen,
                      done=jnp.zeros((b,), bool), paused=jnp.zeros((b,), bool),
                      finish=jnp.zeros((b,), jnp.int32), rows=rows)
    if research is not None:
        state = state.replace(research=research_lib.initial_state(
            research, research_args, tokens, lengths, config.cache_len, captured))
    return state


def row_tokens(prompt: Sequence[int], max_len: int) -> np.ndarray:
    """int32[1, T]: one prompt right-padded to its own bucket T (capped at max_len)."""
    tokens = np.zeros((1, bucket(len(prompt), max_len)), np.int32)
    tokens[0, :len(prompt)] = prompt
    return tokens


def prefill_rows(config: PrefillConfig, params: Any, prompts: Sequence[Sequence[int]],
                 rows: RowParams, research_args: Optional[Any] = None) -> list[StepState]:
    """One-row StepStates, each prompt prefilled alone at its own bucket (batch invariance,
    docs/batch_invariance.md: the bucket of a batch would follow its longest prompt). `rows`
    holds numpy arrays, one row per prompt; research args without per-row interventions."""
    max_len = config.model.config.max_len
    return [prefill(config, params, row_tokens(prompt, max_len),
                    np.array([len(prompt)], np.int32), one_row(rows, r), research_args)
            for r, prompt in enumerate(prompts)]


def one_row(rows: RowParams, r: int) -> RowParams:
    """Row r of host-side RowParams (numpy arrays), as a batch of one."""
    return jax.tree.map(lambda x: x[r:r + 1], rows)


def finish_code(state: StepState, logprobs: Array, token: Array,
                grammar_next: Optional[Array] = None) -> Array:
    """`stops.finish_codes` for the one token y_t of each row (K = 1); RUNNING for rows that
    are done or paused."""
    grammar = None
    if grammar_next is not None:
        grammar = (state.grammar, state.grammar_state[:, None], grammar_next[:, None])
    code = stops.finish_codes(
        state.rows, token[:, None], nan=jnp.any(jnp.isnan(state.logits), -1)[:, None],
        logprobs=logprobs[:, None], step=state.step, length=state.cache.lengths,
        max_len=state.cache.max_len, grammar=grammar)[:, 0]
    return jnp.where(state.done | state.paused, RUNNING, code)


def _raw_logprobs(logits: Array, token: Array, top_logprobs: int) -> tuple:
    """The raw (pre-processor) log-probability of each row's token and its top N."""
    raw = numerics.log_softmax(logits)
    if top_logprobs:
        top_lp, top_ids = jax.lax.top_k(raw, top_logprobs)
    else:
        top_lp = jnp.zeros((token.shape[0], 0), jnp.float32)
        top_ids = jnp.zeros((token.shape[0], 0), jnp.int32)
    return jnp.take_along_axis(raw, token[:, None], axis=-1)[:, 0], top_ids, top_lp


def select(state: StepState, bound: Any = None) -> tuple[Array, Array, Optional[Array], Array]:
    """The selection half of a decode step: y_t for every live row from `state.logits` (the
    processed log-probabilities, the token, the grammar state after it or None, its finish
    code). Row-wise, so a row's token is the same in any batch (docs/batch_invariance.md)."""
    grammar = None if state.grammar is None else (state.grammar, state.grammar_state)
    logprobs = processors.process(state.logits, state.rows, state.counts, state.seen, state.step,
                                  grammar, bound)
    token = sampling_lib.select(logprobs, state.rows, state.step + 1, state.live)
    grammar_next = None if grammar is None else constraints.next_state(*grammar, token)
    return logprobs, token, grammar_next, finish_code(state, logprobs, token, grammar_next)


def first_tokens(rows: StepState, top_logprobs: int = 0) -> StepOutput:
    """y_1 of rows whose prefill just ended (a state of R >= numerics.min_rows(model) rows),
    selected exactly as their first `decode_step` will select it (`select` on the same row state),
    without running the model: the engine streams a prompt's first token as soon as its
    prefill ends, before the step that writes it (docs/serving.md "First token from the
    prefill"; `chunks.start_rows` runs it)."""
    _, token, _, finish = select(rows)
    logprob, top_ids, top_lp = _raw_logprobs(rows.logits, token, top_logprobs)
    return StepOutput(token=jnp.where(rows.live, token, -1), finish=finish, logprob=logprob,
                      top_ids=top_ids, top_logprobs=top_lp)


def decode_step(config: StepConfig, params: Any, state: StepState,
                research_args: Optional[research_lib.ResearchArgs] = None
                ) -> tuple[StepState, StepOutput]:
    """Select y_t for every live row, then write it and compute z_{t+1} where the row goes on.

    Paused rows neither select nor write. `config.kv_len` bounds attention to the first kv_len
    cache positions; the caller guarantees every live row's length stays below it. Research
    options (`config.research`, with their args): custom processors, interventions, captures,
    extra outputs and observers (jaxdecode/device/research.py)."""
    model, research = config.model, config.research
    live = state.live
    bound = None if research is None else research_lib.bind_step(
        research, state.research, state.rows.keys, state.step, state.counts, live)
    logprobs, token, grammar_next, finish = select(state, bound)
    goes_on = live & (finish == RUNNING)

    extra = kv_len_keyword(model, config.kv_len)
    extra.update(adapter_keyword(model, state.rows.adapter))
    captured: dict = {}
    extra.update(research_hook(research, research_args, captured, lambda x: x[:, 0]))
    logits, cache = model.forward(params, token[:, None], state.cache.lengths[:, None],
                                  state.cache, lengths=goes_on.astype(jnp.int32), **extra)
    rows_idx = jnp.arange(token.shape[0])
    logprob, top_ids, top_lp = _raw_logprobs(state.logits, token, config.top_logprobs)
    new_state = state.replace(
        cache=cache,
        logits=jnp.where(goes_on[:, None], logits[:, 0].astype(jnp.float32), state.logits),
        last_token=jnp.where(live, token, state.last_token),
        step=state.step + live,
        counts=state.counts.at[rows_idx, token].add(live.astype(jnp.int32)),
        seen=state.seen.at[rows_idx, token].max(live),
        done=state.done | (finish != RUNNING),
        finish=jnp.where(live, finish, state.finish),
    )
    if grammar_next is not None:  # constraints: advance rows that go on; ended rows keep theirs
        new_state = new_state.replace(
            grammar_state=jnp.where(goes_on, grammar_next, state.grammar_state))
    out = StepOutput(token=jnp.where(live, token, -1), finish=finish, logprob=logprob,
                     top_ids=top_ids, top_logprobs=top_lp)
    if research is not None:  # research: carry, extra outputs, observers (research.py)
        new_state = new_state.replace(research=research_lib.advance(
            state.research, bound, token, live, goes_on, captured))
        out = out.replace(**research_lib.step_outputs(research, state.research, state.logits,
                                                      logprobs))
        out = out.replace(observed=tuple(f(new_state, out) for f in research.observers))
    return new_state, out


@cache_ops.shared_tables
def decode_step_jit(state: StepState, params: Any,
                    research_args: Optional[research_lib.ResearchArgs] = None, *,
                    config: StepConfig) -> tuple[StepState, StepOutput]:
    """`decode_step`, jitted, with the state donated (the grammar tables kept)."""
    return decode_step(config, params, state, research_args)


# -- generate --------------------------------------------------------------------------------

def _loop(config: LoopConfig, params: Any, state: StepState,
          research_args: Optional[research_lib.ResearchArgs] = None,
          limit: Optional[Array] = None):
    """The while-loop driver: at most `config.num_steps` steps, until every row is done; with
    `limit` (a traced int32, the engine's call) at most `limit` steps and at least one, so an
    empty step still runs the model (the engine's device check after a failure).
    Returns the state, buffers (token, logprob, top ids, top logprobs) [B, num_steps, ...]
    (token -1 where a row selected nothing) and, with research options, step-major buffers
    [num_steps, ...] of each step's research outputs (`research.extras`; the host callback
    runs after each step)."""
    num_steps, research = config.num_steps, config.step.research
    b, k = state.step.shape[0], config.step.top_logprobs
    step = functools.partial(decode_step, config.step, params, research_args=research_args)
    buffers = (jnp.full((b, num_steps), -1, jnp.int32), jnp.zeros((b, num_steps), jnp.float32),
               jnp.zeros((b, num_steps, k), jnp.int32), jnp.zeros((b, num_steps, k), jnp.float32))
    extra = None
    if research is not None:
        template = research_lib.extras(jax.eval_shape(step, state)[1])
        extra = jax.tree.map(lambda x: jnp.zeros((num_steps,) + x.shape, x.dtype), template)

    def body(carry):
        i, state, bufs, extra = carry
        state, out = step(state)
        bufs = tuple(buf.at[:, i].set(value) for buf, value in
                     zip(bufs, (out.token, out.logprob, out.top_ids, out.top_logprobs)))
        if research is not None:
            extra = jax.tree.map(lambda buf, x: buf.at[i].set(x), extra,
                                 research_lib.extras(out))
            if research.host_callback:
                research_lib.emit(research_args.callback_id, i, out)
        return i + 1, state, bufs, extra

    def more(carry):
        i, state = carry[:2]
        if limit is None:
            return (i < num_steps) & ~jnp.all(state.done)
        return (i < num_steps) & (i < limit) & ((i == 0) | ~jnp.all(state.done))

    _, state, buffers, extra = jax.lax.while_loop(more, body,
                                                  (jnp.int32(0), state, buffers, extra))
    return state, buffers, extra


_generate_loop = numerics.jit(_loop, static_argnums=(0,))

MAX_STEPS_PER_CALL = 16  # the step axis of `decode_steps_jit` in the engine (one program)


def _steps(config: LoopConfig, params: Any, state: StepState, steps: Array
           ) -> tuple[StepState, StepOutput]:
    before = state.step
    state, (token, logprob, top_ids, top_lp), _ = _loop(config, params, state, limit=steps)
    finish = jnp.where(state.step > before, state.finish, RUNNING)
    return state, StepOutput(token=token, finish=finish, logprob=logprob, top_ids=top_ids,
                             top_logprobs=top_lp)


@cache_ops.shared_tables
def decode_steps_jit(state: StepState, params: Any, steps: Array, rows: Optional[Array] = None,
                     *, config: LoopConfig) -> tuple[StepState, StepOutput]:
    """`steps` (int32, at most `config.num_steps`) decode steps in one dispatch -- the engine's
    step without research options -- the state donated: a StepOutput whose token, logprob,
    top_ids and top_logprobs have a step axis [B, config.num_steps, ...] (token -1 where a row
    selected nothing) and whose finish is the code of each row's last token (RUNNING for a row
    that selected none). One program for every `steps` (a traced bound), so a row's tokens
    never depend on how many steps a call runs; `generate`'s loop body.

    `rows` (int32[R], distinct; R >= numerics.min_rows(model)): run only those rows -- gathered into
    a batch of R, stepped over the shared page pool, scattered back -- when the others select
    nothing (done, paused or empty): a step's cost follows the rows that decode, and batch
    invariance makes their tokens those of the whole batch. The outputs stay per slot (rows
    not run: token -1, finish RUNNING)."""
    if rows is None:
        return _steps(config, params, state, steps)
    sub, out = _steps(config, params, cache_ops.take_rows(state, rows), steps)
    merged = cache_ops.scatter_rows(state, sub, rows)
    state = merged.replace(cache=merged.cache.replace(**sub.cache.pools))

    def widen(x: Array, fill: int) -> Array:
        return jnp.full((state.step.shape[0],) + x.shape[1:], fill, x.dtype).at[rows].set(x)

    return state, out.replace(token=widen(out.token, -1), finish=widen(out.finish, RUNNING),
                              logprob=widen(out.logprob, 0), top_ids=widen(out.top_ids, 0),
                              top_logprobs=widen(out.top_logprobs, 0))


def iterate(config: StepConfig, params: Any, state: StepState, num_steps: int,
            research_args: Optional[research_lib.ResearchArgs] = None):
    """The Python-loop driver of `decode_step`: yields (state, host StepOutput) per step.

    Step t+1 is dispatched before step t's output is fetched, so host work on the yielded
    tokens overlaps the device step (JAX async dispatch). Stops once every row has ended; the
    one step dispatched past that changes nothing (finished rows select and write nothing).
    The yielded state is the newest one (already one step ahead of the output)."""
    done = np.array(state.done)
    if done.all() or num_steps < 1:
        return
    step = functools.partial(decode_step_jit, config=config)
    state, out = step(state, params, research_args)
    for i in range(num_steps):
        following = None
        if i + 1 < num_steps:
            state, following = step(state, params, research_args)
        host = jax.device_get(out)
        yield state, host
        done |= host.finish != RUNNING
        if done.all() or following is None:
            return
        out = following


def _check_prompts(cfg: Any, prompt_ids: Sequence[Sequence[int]]) -> None:
    if not prompt_ids or not all(len(p) > 0 for p in prompt_ids):
        raise ValueError("prompt_ids: expected a non-empty list of non-empty token-id lists")
    longest = max(len(p) for p in prompt_ids)
    if longest > cfg.max_len:
        raise ValueError(f"prompt_ids: a prompt of {longest} tokens exceeds the model's "
                         f"max_len {cfg.max_len}")
    for p in prompt_ids:
        bad = [i for i in p if not 0 <= int(i) < cfg.vocab_size]
        if bad:
            raise ValueError(f"prompt_ids: token id {bad[0]} is outside the vocabulary "
                             f"(size {cfg.vocab_size})")


def _row_keys(rows_sp: Sequence[SamplingParams], key: Optional[Array]) -> np.ndarray:
    """Base key data per row: its seed's, or fold_in(key, row) for rows without one."""
    key = jax.random.key(0) if key is None else key
    return np.stack([seed_key_data(s.seed) if s.seed is not None
                     else np.asarray(jax.random.key_data(jax.random.fold_in(key, r)), np.uint32)
                     for r, s in enumerate(rows_sp)])


def _prompt_pass(model: DecoderModel, params: Any, prompt_ids: Sequence[Sequence[int]],
                 rows: RowParams, size: int, research: Optional[research_lib.Setup],
                 n_samples: Sequence[int], kv_cache_dtype: str = "auto") -> StepState:
    """The prefilled state: each prompt alone at its own bucket, except with interventions,
    whose args may hold one value per row (one batched prompt pass; the batch-invariance
    promise excludes interventions, docs/batch_invariance.md)."""
    config = PrefillConfig(model, size, None if research is None else research.config,
                           kv_cache_dtype)
    args = None if research is None else research.args
    if research is None or not research.config.interventions:
        return cache_ops.stack_rows(prefill_rows(config, params, prompt_ids, rows, args))
    if any(n > 1 for n in n_samples):
        raise ValueError("interventions: not supported with n > 1 (the prompt pass is "
                         "shared by the samples; give each sample its own prompt row)")
    tokens = np.zeros((len(prompt_ids), bucket(max(map(len, prompt_ids)), model.config.max_len)),
                      np.int32)
    for r, p in enumerate(prompt_ids):
        tokens[r, : len(p)] = p
    return prefill(config, params, tokens, np.array([len(p) for p in prompt_ids], np.int32),
                   rows, args)


def prepare(model: DecoderModel, params: Any, prompt_ids: Sequence[Sequence[int]],
            sampling: SamplingParams | Sequence[SamplingParams], max_new_tokens: Optional[int],
            key: Optional[Array], eos_token_ids: Optional[Sequence[int]] = None,
            tokenizer: Any = None, research: Optional[research_lib.Setup] = None,
            kv_cache_dtype: str = "auto", adapters: Optional[Sequence[int]] = None):
    """Validate ragged prompts and settings; prefill. Returns (state, per-row params, N).

    Rows with a response_format are compiled against `tokenizer` (constraints.prepare_rows).
    `research`: the run's research options (research.configure), applied from the prefill on.
    `kv_cache_dtype`: the cache's ("auto" or "int8"; ValueError naming it otherwise);
    `adapters`: each row's LoRA adapter index (`RowParams.adapter`, applied from the prefill on)."""
    kv_int8.check(kv_cache_dtype)
    cfg = model.config
    _check_prompts(cfg, prompt_ids)
    b = len(prompt_ids)
    rows_sp = [sampling] * b if isinstance(sampling, SamplingParams) else list(sampling)
    if len(rows_sp) != b:
        raise ValueError(f"sampling: expected 1 or {b} SamplingParams, got {len(rows_sp)}")
    n = max(s.max_tokens for s in rows_sp) if max_new_tokens is None else int(max_new_tokens)
    if n < 1:
        raise ValueError(f"max_new_tokens: must be >= 1, got {max_new_tokens}")
    keys = _row_keys(rows_sp, key)
    rows_sp = [dataclasses.replace(s, max_tokens=min(s.max_tokens, n),
                                   min_tokens=min(s.min_tokens, n)) for s in rows_sp]
    eos = cfg.eos_token_ids if eos_token_ids is None else tuple(eos_token_ids)
    rows = RowParams.build(rows_sp, cfg.vocab_size, eos, keys=keys, adapters=adapters)
    grammar = constraints.prepare_rows(rows_sp, tokenizer, cfg.vocab_size, eos)  # before prefill
    size = cache_len(max(len(p) for p in prompt_ids), n, cfg.max_len)
    state = _prompt_pass(model, params, prompt_ids, rows, size, research,
                         [s.n for s in rows_sp], kv_cache_dtype)
    if grammar is not None:  # constraints: tables + initial per-row states
        state = state.replace(grammar_state=jnp.asarray(grammar[1]), grammar=grammar[0].tables)
    if any(s.n > 1 for s in rows_sp):
        state, rows_sp = expand_n(state, rows_sp, keys, cfg.vocab_size, eos)
    return state, rows_sp, n


def sample_keys(key_data: np.ndarray, n: int) -> np.ndarray:
    """Key data of the n samples of one request: sample 0 is the request's own key (so it is
    the request with n = 1, alone or in any batch), sample i >= 1 uses fold_in(request key, i).
    n = 1 runs nothing on the device (every submit calls this)."""
    own = np.asarray(key_data, np.uint32)
    if n == 1:
        return own[None]
    base = jax.random.wrap_key_data(jnp.asarray(own))
    return np.stack([own] + [np.asarray(jax.random.key_data(jax.random.fold_in(base, i)),
                                        np.uint32) for i in range(1, n)])


def expand_n(state: StepState, rows_sp: Sequence[SamplingParams], keys: np.ndarray,
             vocab_size: int, eos: Sequence[int]):
    """Parallel sampling (SamplingParams.n): request r becomes n_r adjacent rows that share its
    prefilled prompt cache (broadcast by a gather after the one prefill), keyed by
    `sample_keys`. Returns (state, per-row SamplingParams)."""
    index = np.repeat(np.arange(len(rows_sp)), [s.n for s in rows_sp])
    keys = np.concatenate([sample_keys(k, s.n) for k, s in zip(keys, rows_sp)])
    rows_sp = [rows_sp[r] for r in index]
    rows = RowParams.build(rows_sp, vocab_size, eos, keys=keys)
    state = cache_ops.take_rows(state, jnp.asarray(index, jnp.int32))
    return state.replace(rows=jax.tree.map(jnp.asarray, rows)), rows_sp


def _drive(config: StepConfig, params: Any, state: StepState, n: int, trace: bool,
           setup: Optional[research_lib.Setup]):
    """Run the steps with either driver. Returns (final state, host buffers (tokens, logprob,
    top ids, top logprobs) [B, M, ...], research extras)."""
    if trace:
        with contextlib.nullcontext() if setup is None else setup.callback_scope():
            args = None if setup is None else setup.args  # the scope sets the callback id
            state, bufs, extra = _generate_loop(LoopConfig(config, bucket(n)), params, state,
                                                args)
            return state, tuple(np.asarray(x) for x in bufs), extra
    args = None if setup is None else setup.args
    outs = []
    for state, out in iterate(config, params, state, n, args):
        if setup is not None:
            setup.host_step(len(outs), out)
        outs.append(out)
    extra = None if setup is None else research_lib.stack_host(outs)
    bufs = tuple(np.stack([getattr(o, name) for o in outs], 1)
                 for name in ("token", "logprob", "top_ids", "top_logprobs"))
    return state, bufs, extra


def generate(model: DecoderModel, params: Any, prompt_ids: Sequence[Sequence[int]],
             sampling: SamplingParams | Sequence[SamplingParams], *,
             max_new_tokens: Optional[int] = None, key: Optional[Array] = None,
             trace: bool = True, tokenizer: Any = None, processors: Sequence[Any] = (),
             return_scores: bool = False, return_logits: bool = False,
             return_hidden_states: Sequence[Any] = (), outputs_top_k: int = 0,
             observers: Sequence[Any] = (), host_callback: Any = None,
             interventions: Sequence[Any] = (), batch_invariant: bool = True,
             kv_cache_dtype: str = "auto") -> GenerateOutput:
    """Decode ragged prompts entirely on device (docs/architecture.md `jd.generate`).

    A row's randomness comes from its seed; `key` serves rows with seed=None (row r uses
    fold_in(key, r)). `max_new_tokens` defaults to the largest max_tokens and caps every row.
    A request with `n > 1` is prefilled once and returns n adjacent rows (output rows = sum of
    n over the prompts, in prompt order, samples by index); sample 0 uses the request key and
    sample i >= 1 fold_in(request key, i), so a seeded request's n samples are reproducible.
    `trace=False` drives the same step from a Python loop instead of `lax.while_loop`.
    `tokenizer` is needed when a row has a response_format (jaxdecode/device/constraints).
    Research options (jaxdecode/device/research.py, hooks.py): `processors` (custom
    jd.LogitProcessor), `return_scores`, `return_logits` (with `outputs_top_k`),
    `return_hidden_states`, step `observers`, `host_callback`, `interventions` (jd.steer,
    jd.ablate, jd.Intervention). `batch_invariant=False`: the model's plain XLA numerics (X1
    not kept; docs/batch_invariance.md). `kv_cache_dtype="int8"`: keys and values cached as
    int8 with a scale per (token, kv head), as `jd.LLM(kv_cache_dtype="int8")` pages them.
    """
    model = invariance.configure(model, batch_invariant)
    prompt_ids = token_rows(prompt_ids)
    setup = research_lib.configure(
        model, processors=processors, return_scores=return_scores, return_logits=return_logits,
        return_hidden_states=return_hidden_states, outputs_top_k=outputs_top_k,
        observers=observers, host_callback=host_callback, interventions=interventions)
    state, rows_sp, n = prepare(model, params, prompt_ids, sampling, max_new_tokens, key,
                                tokenizer=tokenizer, research=setup,
                                kv_cache_dtype=kv_cache_dtype)
    b, k = len(rows_sp), max(s.logprobs for s in rows_sp)
    config = StepConfig(model, k, None, None if setup is None else setup.config)
    state = cache_ops.pad_rows(state, b, config.research, numerics.min_rows(model))
    state, bufs, extra = _drive(config, params, state, n, trace, setup)
    tokens, logprob, top_ids, top_lp = (x[:b] for x in bufs)
    result = outputs.build(tokens, logprob, np.asarray(state.finish)[:b],
                           np.asarray(state.step)[:b], n,
                           top_logprobs=(top_ids, top_lp) if k else None)
    return result if setup is None else setup.finish(result, extra, state.research, n)
