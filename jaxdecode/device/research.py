"""Research API (issue #16): custom logit processors with their own state, analysis outputs,
step observers and a host callback -- all inside the jitted decoding loop.

Custom processors
-----------------
`LogitProcessor(fn, position="last", init_state=None)` wraps a pure function
`fn(logits f32[B, V], ctx) -> logits` or, with `init_state`, `fn(logits, ctx, state) ->
(logits, state)`. It runs at one point of the contract §3 order (`processors.process`):

    "first"              on the raw logits, before the penalties
    "after_penalties"    after penalties, logit bias, bans and masks (steps 1-2), before
                         temperature
    "after_temperature"  after temperature (greedy rows: unscaled), before truncation
    "last"               after truncation (greedy rows: none), before renormalisation and
                         selection

Several at one position run in list order. The order used is recorded: `describe_order`
(GenerateOutput.processor_order; the `processors` entry of an engine replay record). Rows
with temperature 0 still take the argmax of the result.

`ctx` (ProcessorContext) holds, per row: `step` (tokens already selected; this call chooses
output token step + 1), `ids` (prompt then output so far, -1 after `length`), `length`,
`prompt_length`, `counts` (output occurrences per id), `key` (this row's key for this step,
`fold_in(fold_in(request key, step + 1), PROCESSOR_KEY)`, independent of the selection's) and
`live` (rows still decoding; the others' results are discarded). The state is any pytree for
ONE row; it is broadcast to every row (a leading row axis) and carried in the decoding state:
`StepState.research.states` (generate, the engine), each beam (gathered with the beam on every
reorder), `SpecState.research` (speculative: the state after the last emitted token; the
states of rejected draft positions are dropped). It advances exactly once per selected token
of a live row; ended and paused rows keep theirs. The final states come back as
`GenerateOutput.processor_states`.

Entry points: `jd.generate`, `jd.beam_search` (applied to the log-probabilities after the
min_new_tokens and grammar masks, all positions in order, not renormalised: HF's beam
semantics), `jd.speculative_generate` (on the target's distribution p, so the output still
follows it exactly; the draft proposes without them) and `jd.LLM(processors=...)` at
construction (never over HTTP: the server runs no user code).

No recompiles: a LogitProcessor compares equal to another with the same `fn` object, position
and a state of the same structure, shapes and dtypes; the state's VALUES are data. So define
`fn` once (module level) and pass parameters that change between calls in `init_state`
(jaxdecode/recipes/watermark.py keeps its key there). A fresh lambda per call recompiles.

Outputs for analysis (`jd.generate`)
------------------------------------
`return_scores` / `return_logits`: the processed log-probabilities that selection used and the
raw logits, per step, as `scores` / `logits` f32[B, N, V] (0 after a row's end);
`outputs_top_k=K` keeps each step's K largest entries only ([B, N, K], with `score_ids` /
`logit_ids` int32[B, N, K]). `return_hidden_states=(layers...)`: per step, the activation at
the position whose logits chose the token (the last prompt position for step 1), as
`hidden_states[layer]` f32[B, N, hidden]; a layer is an int in HF `output_hidden_states`
indexing (0 = embeddings, L = after the final norm) or a hook point name (jaxdecode/device/hooks.py).

Step observers
--------------
`observers=[f]`: pure `f(state, out) -> pytree` evaluated after every step on the new
StepState and the StepOutput; results are stacked along a leading step axis and returned in
`GenerateOutput.observations` (one per observer; entries past the last step are zeros) -- t5x's
`state_callback_fn`, read-only. `host_callback=g`: `g(step, tokens, observations)` on the host
after every step (step is 0-based, tokens int32[B], -1 for ended rows) through
`jax.debug.callback` -- for live plots. Cost: each call copies its arguments to the host and
stalls the device loop until g returns (one host round trip per step, which the on-device loop
otherwise never makes); the callback is reached through a fixed dispatcher, so a new `g` never
recompiles.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import threading
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxdecode.device import hooks
from jaxdecode.device.hooks import static_signature
from jaxdecode.model_api import DecoderModel, hidden_state_point

Array = jax.Array

POSITIONS = ("first", "after_penalties", "after_temperature", "last")
PROCESSOR_KEY = 3  # fold_in purpose of ctx.key (speculative decoding uses 0, 1, 2)


class LogitProcessor:
    """A user-defined pure logit processor (module docstring)."""

    def __init__(self, fn: Callable, position: str = "last", init_state: Any = None):
        if not callable(fn):
            raise ValueError(f"fn: expected a callable, got {type(fn).__name__}")
        if position not in POSITIONS:
            raise ValueError(f"position: expected one of {', '.join(POSITIONS)}, "
                             f"got {position!r}")
        self.fn, self.position = fn, position
        self.init_state = None if init_state is None else hooks.as_arrays(init_state)
        self._key = (fn, position, init_state is not None, static_signature(self.init_state))

    @property
    def stateful(self) -> bool:
        return self.init_state is not None

    @property
    def name(self) -> str:
        return getattr(self.fn, "__qualname__", type(self.fn).__name__)

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, LogitProcessor) and self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)

    def __repr__(self) -> str:
        return (f"LogitProcessor({self.name}, position={self.position!r}"
                f"{', stateful' if self.stateful else ''})")


@struct.dataclass
class ProcessorContext:
    """What a custom processor sees for each of the B rows (module docstring)."""

    step: Array           # int32[B] tokens already selected
    ids: Array            # int32[B, L] prompt then output so far, -1 from `length` on
    length: Array         # int32[B] prompt_length + step
    prompt_length: Array  # int32[B]
    counts: Array         # int32[B, V] occurrences of each id in the output so far
    key: Array            # typed PRNG keys[B] of this row and step
    live: Array           # bool[B] rows still decoding

    def last_token(self) -> Array:
        """int32[B]: the last id of prompt + output (the token before the one chosen now)."""
        return jnp.take_along_axis(self.ids, jnp.maximum(self.length - 1, 0)[:, None], 1)[:, 0]


def processor_keys(keys: Array, t: Array) -> Array:
    """ctx.key for output index t (int32[B], 1-based) of rows with base key data `keys`."""
    base = jax.vmap(jax.random.wrap_key_data)(keys)
    kt = jax.vmap(jax.random.fold_in)(base, t)
    return jax.vmap(lambda k: jax.random.fold_in(k, PROCESSOR_KEY))(kt)


class Bound:
    """Custom processors bound to one step's context and states: `bound(position, x)` applies
    those at `position` in list order; `states` holds the states after the calls so far."""

    def __init__(self, processors: Sequence[LogitProcessor], ctx: ProcessorContext,
                 states: Sequence[Any]):
        self.processors, self.ctx, self.states = tuple(processors), ctx, list(states)

    def __call__(self, position: str, x: Array) -> Array:
        for i, p in enumerate(self.processors):
            if p.position == position:
                x = self._apply(i, p, x)
        return x

    def all_positions(self, x: Array) -> Array:
        for position in POSITIONS:
            x = self(position, x)
        return x

    def _apply(self, i: int, p: LogitProcessor, x: Array) -> Array:
        field = f"processors[{i}] ({p.name})"
        if p.stateful:
            result = p.fn(x, self.ctx, self.states[i])
            if not isinstance(result, tuple) or len(result) != 2:
                raise ValueError(f"{field}: a processor with init_state must return "
                                 "(logits, state)")
            y, new = result
            if static_signature(new) != static_signature(self.states[i]):
                raise ValueError(f"{field}: the returned state must keep the structure, "
                                 "shapes and dtypes of init_state (with a leading row axis)")
            self.states[i] = new
        else:
            y = p.fn(x, self.ctx)
        if getattr(y, "shape", None) != x.shape:
            raise ValueError(f"{field}: must return logits of shape {x.shape}, "
                             f"got {getattr(y, 'shape', type(y).__name__)}")
        return jnp.asarray(y, jnp.float32)


@dataclasses.dataclass(frozen=True)
class ResearchConfig:
    """The static part of a research run (hashable: it keys the compiled programs).

    processors: LogitProcessors in list order; capture: hook points kept per step;
    interventions: hooks.Intervention; scores / logits: record them per step (top_k > 0: only
    the K largest); observers: step observer functions; host_callback: call the dispatcher."""

    processors: tuple = ()
    capture: tuple = ()
    interventions: tuple = ()
    scores: bool = False
    logits: bool = False
    top_k: int = 0
    observers: tuple = ()
    host_callback: bool = False

    @property
    def hooked(self) -> bool:
        return bool(self.capture or self.interventions)


@struct.dataclass
class ResearchArgs:
    """The dynamic part: each processor's init_state (one row; () when stateless), each
    intervention's args, and the host callback's dispatcher id."""

    init_states: tuple
    hook_args: tuple
    callback_id: Array


@struct.dataclass
class ResearchState:
    """The per-row research carry (`StepState.research`, `SpecState.research`); every leaf has
    a leading row axis, so slot inserts, n-expansion and beam gathers move it with its row.

    ids:           int32[B, L] prompt then output so far, -1 after (None without processors)
    prompt_length: int32[B]
    states:        one pytree per processor, [B, ...] leaves (() for a stateless one)
    hidden:        {point: f32[B, hidden]} the captured activation at the position whose
                   logits are `StepState.logits` (aligned with them)
    """

    ids: Optional[Array]
    prompt_length: Array
    states: tuple
    hidden: dict


def broadcast_rows(tree: Any, b: int) -> Any:
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (b,) + x.shape), tree)


def initial_state(config: ResearchConfig, args: ResearchArgs, tokens: Array, lengths: Array,
                  width: int, hidden: dict) -> ResearchState:
    """The research carry after a prompt pass: tokens int32[B, T] right-padded, lengths
    int32[B]; `width` the ids buffer length (the cache length); `hidden` the captured points at
    each row's last prompt position."""
    b, t = tokens.shape
    ids = None
    if config.processors:
        padded = jnp.pad(tokens, ((0, 0), (0, max(0, width - t))))[:, :width]
        ids = jnp.where(jnp.arange(width)[None, :] < lengths[:, None], padded, -1)
    return ResearchState(ids=ids, prompt_length=lengths.astype(jnp.int32),
                         states=broadcast_rows(args.init_states, b), hidden=dict(hidden))


def where_rows(mask: Array, new: Any, old: Any) -> Any:
    """Per leaf: rows where `mask` (bool[B]) take `new`, the others keep `old`."""
    return jax.tree.map(lambda n, o: jnp.where(mask.reshape((-1,) + (1,) * (o.ndim - 1)), n, o),
                        new, old)


def bind_step(config: ResearchConfig, rs: ResearchState, keys: Array, step: Array,
              counts: Array, live: Array) -> Optional[Bound]:
    """The processors bound to a plain decode step (None when there are none)."""
    if not config.processors:
        return None
    ctx = ProcessorContext(step=step, ids=rs.ids, length=rs.prompt_length + step,
                           prompt_length=rs.prompt_length, counts=counts,
                           key=processor_keys(keys, step + 1), live=live)
    return Bound(config.processors, ctx, rs.states)


def advance(rs: ResearchState, bound: Optional[Bound], token: Array, live: Array,
            goes_on: Array, captured: dict) -> ResearchState:
    """After a decode step: live rows append their token and keep their new states; rows that
    go on take the activations captured for their next position."""
    if bound is not None:
        width = rs.ids.shape[1]
        at = jnp.where(live, bound.ctx.length, width)
        ids = rs.ids.at[jnp.arange(token.shape[0]), at].set(token, mode="drop")
        rs = rs.replace(ids=ids, states=where_rows(live, tuple(bound.states), rs.states))
    if captured:
        rs = rs.replace(hidden=where_rows(goes_on, captured, rs.hidden))
    return rs


def _top(x: Array, k: int):
    return x if not k else jax.lax.top_k(x, k)


def step_outputs(config: ResearchConfig, rs: Optional[ResearchState], raw_logits: Array,
                 logprobs: Array) -> dict:
    """The StepOutput fields a research step adds: scores, logits (values, or (values, ids)
    with top_k) and the hidden states aligned with the logits that chose the token."""
    return dict(scores=_top(logprobs, config.top_k) if config.scores else None,
                logits=_top(raw_logits, config.top_k) if config.logits else None,
                hidden=dict(rs.hidden) if config.capture else None)


def extras(out: Any) -> tuple:
    """The research fields of a StepOutput, in the order of `Setup.finish`."""
    return (out.scores, out.logits, out.hidden, out.observed)


# -- host callback (one fixed dispatcher: a new callback never recompiles) ----------------------

_callbacks: dict = {}
_callback_ids = itertools.count(1)
_callbacks_lock = threading.Lock()


def _dispatch(callback_id, step, tokens, observed) -> None:
    fn = _callbacks.get(int(callback_id))
    if fn is not None:
        fn(int(step), np.asarray(tokens), jax.tree.map(np.asarray, observed))


def emit(callback_id: Array, step: Array, out: Any) -> None:
    """Inside the jitted loop: hand step `step`'s tokens and observations to the host."""
    jax.debug.callback(_dispatch, callback_id, step, out.token, out.observed, ordered=True)


# -- host side: configuration and results --------------------------------------------------------

def as_processors(values: Optional[Sequence[Any]], field: str = "processors") -> tuple:
    """ValueError naming the entry for anything but a sequence of LogitProcessor."""
    if values is None:
        return ()
    if isinstance(values, LogitProcessor) or not isinstance(values, (list, tuple)):
        raise ValueError(f"{field}: expected a list of jd.LogitProcessor, got "
                         f"{type(values).__name__}")
    for i, p in enumerate(values):
        if not isinstance(p, LogitProcessor):
            raise ValueError(f"{field}[{i}]: expected jd.LogitProcessor, got {type(p).__name__}")
    return tuple(values)


def describe_order(processors: Sequence[LogitProcessor], beam: bool = False) -> tuple:
    """The processing order actually used, as stage names (recorded with the results)."""
    custom = {pos: tuple(f"custom:{p.name}@{pos}" for p in processors if p.position == pos)
              for pos in POSITIONS}
    if beam:
        return ("log_softmax", "min_new_tokens", "grammar") + sum(custom.values(), ())
    return (custom["first"] + ("penalties", "bias_and_bans", "masks") + custom["after_penalties"]
            + ("temperature",) + custom["after_temperature"] + ("top_k", "top_p", "min_p")
            + custom["last"] + ("renormalise", "select"))


@dataclasses.dataclass
class Setup:
    """One research run, host side: the static config, its dynamic args, and how to turn the
    device buffers into GenerateOutput fields."""

    config: ResearchConfig
    args: ResearchArgs
    hidden_keys: tuple = ()        # (user key, hook point) pairs
    callback: Optional[Callable] = None

    @property
    def processor_order(self) -> Optional[tuple]:
        return describe_order(self.config.processors) if self.config.processors else None

    @contextlib.contextmanager
    def callback_scope(self):
        """Registers the host callback for the duration of one generation."""
        if self.callback is None:
            yield
            return
        with _callbacks_lock:
            cid = next(_callback_ids)
            _callbacks[cid] = self.callback
        self.args = self.args.replace(callback_id=jnp.int32(cid))
        try:
            yield
        finally:
            with _callbacks_lock:
                _callbacks.pop(cid, None)

    def host_step(self, i: int, out: Any) -> None:
        """The Python-loop driver's counterpart of `emit`."""
        if self.callback is not None:
            self.callback(i, np.asarray(out.token), jax.tree.map(np.asarray, out.observed))

    def finish(self, result: Any, bufs: tuple, states: Optional[ResearchState], n: int) -> Any:
        """`result` (a GenerateOutput) with the research fields: step-major device buffers
        (scores, logits, hidden, observed) -> batch-major host arrays of N = n steps, zero after
        each row's end; the processors' final states. Rows past the result's (the padding row of
        a lone request, numerics.min_rows) are dropped; observers see the device state as is."""
        scores, logits, hidden, observed = jax.tree.map(np.asarray, bufs)
        b = len(result.lengths)
        after_end = np.arange(n)[None, :] >= result.lengths[:, None]

        def per_row(x):  # [steps, B, ...] -> [B, n, ...], zero after the row's end
            x = np.swapaxes(x, 0, 1)[:b, :n]
            x = np.pad(x, [(0, 0), (0, n - x.shape[1])] + [(0, 0)] * (x.ndim - 2)).copy()
            x[after_end] = 0
            return x

        fields: dict = {}
        for name, value in (("scores", scores), ("logits", logits)):
            if value is None:
                continue
            if self.config.top_k:
                fields[name], fields[name[:-1] + "_ids"] = per_row(value[0]), per_row(value[1])
            else:
                fields[name] = per_row(value)
        if hidden is not None:
            fields["hidden_states"] = {key: per_row(hidden[point])
                                       for key, point in self.hidden_keys}
        if self.config.observers:
            fields["observations"] = [jax.tree.map(lambda x: _fit_steps(x, n), o)
                                      for o in observed]
        if self.config.processors:
            fields["processor_order"] = self.processor_order
            fields["processor_states"] = final_states(self.config, jax.tree.map(
                lambda x: x[:b], states.states))
        return dataclasses.replace(result, **fields)


def final_states(config: ResearchConfig, states: Sequence[Any]) -> tuple:
    """Each processor's state as host arrays (None for a stateless one)."""
    return tuple(jax.tree.map(np.asarray, s) if p.stateful else None
                 for p, s in zip(config.processors, states))


def _fit_steps(x: np.ndarray, n: int) -> np.ndarray:
    x = x[:n]
    return np.pad(x, [(0, n - x.shape[0])] + [(0, 0)] * (x.ndim - 1))


def stack_host(outs: Sequence[Any]) -> tuple:
    """The Python-loop driver's buffers: each research field stacked over steps (step-major)."""
    return jax.tree.map(lambda *xs: np.stack(xs), *[extras(o) for o in outs])


def configure(model: DecoderModel, *, processors: Any = (), return_scores: bool = False,
              return_logits: bool = False, return_hidden_states: Sequence[Any] = (),
              outputs_top_k: int = 0, observers: Sequence[Callable] = (),
              host_callback: Optional[Callable] = None,
              interventions: Sequence[Any] = ()) -> Optional[Setup]:
    """Validate the research options of an entry point (ValueError naming the field); None
    when none is used, so the default path stays exactly as it is."""
    processors = as_processors(processors)
    interventions = hooks.as_interventions(interventions)
    observers = tuple(observers or ())
    for i, f in enumerate(observers):
        if not callable(f):
            raise ValueError(f"observers[{i}]: expected a callable (state, out) -> pytree")
    if host_callback is not None and not callable(host_callback):
        raise ValueError("host_callback: expected a callable (step, tokens, observations)")
    for name, flag in (("return_scores", return_scores), ("return_logits", return_logits)):
        if not isinstance(flag, (bool, np.bool_)):
            raise ValueError(f"{name}: expected True or False, got {flag!r}")
    vocab = model.config.vocab_size
    if (isinstance(outputs_top_k, bool) or not isinstance(outputs_top_k, (int, np.integer))
            or not 0 <= outputs_top_k <= vocab):
        raise ValueError(f"outputs_top_k: must be an integer in [0, {vocab}], "
                         f"got {outputs_top_k!r}")
    if isinstance(return_hidden_states, (int, str)):
        raise ValueError("return_hidden_states: expected a tuple of layers (ints in HF "
                         "output_hidden_states indexing, or hook point names)")
    hidden_keys = []
    for layer in return_hidden_states or ():
        if isinstance(layer, (int, np.integer)) and not isinstance(layer, bool):
            hidden_keys.append((int(layer), hidden_state_point(int(layer),
                                                               model.config.num_layers)))
        elif isinstance(layer, str):
            hidden_keys.append((layer, layer))
        else:
            raise ValueError(f"return_hidden_states: {layer!r} is neither a layer index nor "
                             "a hook point name")
    capture = tuple(dict.fromkeys(point for _, point in hidden_keys))
    hooks.check_points(model, capture, "return_hidden_states")
    hooks.check_points(model, [iv.point for iv in interventions], "interventions")
    if not (processors or interventions or observers or capture or return_scores
            or return_logits or host_callback is not None):
        return None
    config = ResearchConfig(processors=processors, capture=capture, interventions=interventions,
                            scores=bool(return_scores), logits=bool(return_logits),
                            top_k=int(outputs_top_k), observers=observers,
                            host_callback=host_callback is not None)
    args = ResearchArgs(init_states=tuple(p.init_state if p.stateful else ()
                                          for p in processors),
                        hook_args=hooks.intervention_args(interventions),
                        callback_id=jnp.int32(0))
    return Setup(config=config, args=args, hidden_keys=tuple(hidden_keys), callback=host_callback)
