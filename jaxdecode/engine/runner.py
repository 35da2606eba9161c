"""The device side of the engine: the context every process shares, what a step op does to a
state (`apply`, the same on the leader and on every `serve --distributed` follower), warm-up,
and the leader's `Runner`, which owns the device state, publishes each op to the step hook
before it applies it, and keeps the grammar table set of the live slots.

The engine core (core.py) never touches the state itself: it hands the runner the ops that
lowering.py derives from the scheduler's `Iteration`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxdecode.device import chunks, constraints, decode, numerics
from jaxdecode.device.beam import beam_search
from jaxdecode.device.constraints.tables import GrammarTables
from jaxdecode.device.state import RowParams, StepState
from jaxdecode.engine import step_ops
from jaxdecode.engine.backend import Pages, PlainBackend, SlotBackend, SpeculativeBackend
from jaxdecode.engine.scheduler import chunk_plan, chunk_rows, compact_counts, kv_bucket
from jaxdecode.model_api import DecoderModel, PagedKVCache

POOLS = ("k", "v", "k_scale", "v_scale")  # a saved row's pool arrays (PagedKVCache.pools)


@dataclasses.dataclass(frozen=True)
class Context:
    """What `apply` needs besides the state; equal on every process.

    replicate_outputs: gather each step's output (tokens, finish codes, ...) onto every device,
    so the leader can read it when the state is spread over other hosts' devices. It is a
    collective, so the leader and its followers must agree: it is on exactly when a mesh is
    used with a step hook (the leader) or in a follower. `spec`: a SpeculativeConfig (steps are
    speculative rounds); `research`: the engine's custom processors (research.Setup);
    `pages` and `page_size` shape the KV page pool, `kv_cache_dtype` ("auto" or "int8",
    jaxdecode/kv_int8.py) sets its dtype."""

    model: DecoderModel
    params: Any
    max_slots: int
    max_len: int
    eos_token_ids: tuple
    mesh: Optional[Any] = None
    replicate_outputs: bool = False
    tokenizer: Any = None  # BEAM: compiles a response_format
    spec: Optional[Any] = None
    research: Optional[Any] = None
    pages: Optional[int] = None  # allocatable pages (default: max_slots rows of max_len)
    page_size: int = 16
    kv_cache_dtype: str = "auto"

    @property
    def num_pages(self) -> int:
        """Pages of the device pool: the allocatable ones and the null page."""
        return (self.max_slots * self.pages_per_row if self.pages is None else self.pages) + 1

    @property
    def rows(self) -> int:
        """Rows of the device state: max_slots, at least `numerics.min_rows` (no program of one
        row where batch invariant, docs/batch_invariance.md); a row past max_slots is never
        admitted (always done)."""
        return max(self.max_slots, numerics.min_rows(self.model))

    @property
    def pages_per_row(self) -> int:
        return -(-self.max_len // self.page_size)

    def per_row(self, mask: np.ndarray) -> np.ndarray:
        """A per-slot array ([max_slots]) extended with zeros to the state's rows."""
        return np.concatenate([mask, np.zeros((self.rows - len(mask),), mask.dtype)])

    @functools.cached_property
    def backend(self) -> SlotBackend:
        """The slot backend that runs this context's device (engine/backend.py)."""
        args = (self.model, self.params, self.rows, self.max_len, self.eos_token_ids,
                Pages(self.num_pages, self.page_size, self.kv_cache_dtype))
        if self.spec is not None:
            return SpeculativeBackend(self.spec, *args)
        return PlainBackend(*args, research=self.research, mesh=self.mesh,
                            replicate_outputs=self.replicate_outputs)


def apply(ctx: Context, state: Optional[Any], op: step_ops.StepOp) -> tuple[Optional[Any], Any]:
    """Apply `op` to `state`: returns the new state and the op's output (STEP: the backend's
    device output; CHUNK: the first tokens of the rows that start decoding, when the backend
    selects them early; BEAM: the GenerateOutput; WARMUP: the number of compilations;
    otherwise None). The state is donated."""
    a, backend = op.arrays, ctx.backend
    if op.code == step_ops.INIT:
        _check_config(ctx, op)
        return backend.empty_state(), None
    if op.code == step_ops.CHUNK:
        state, logits = backend.chunk(state, a["tokens"], a["start"], a["length"],
                                      a["tables"], op.scalar("kv_len"), a["adapters"])
        return backend.start(state, logits, step_ops.finals(op), op.scalar("top_k"))
    if op.code == step_ops.RESTORE:
        return _restore(ctx, state, a), None
    if op.code == step_ops.GRAMMAR:
        old = (state.grammar_state if state.grammar_state is not None
               else np.full((ctx.rows,), -1, np.int32))
        state = state.replace(grammar_state=_rebase(old, ctx.per_row(a["keep"]),
                                                    ctx.per_row(a["delta"])))
        if "tables.allowed" in a:
            state = state.replace(grammar=_tables(ctx, a))
        return state, None
    if op.code == step_ops.FLAGS:
        return backend.set_flags(state, ctx.per_row(a["release"]), ctx.per_row(a["paused"])), None
    if op.code == step_ops.STEP:
        return backend.step(state, op.scalar("kv_len"), op.scalar("top_logprobs"),
                            op.scalar("steps"), a.get("rows"))
    if op.code == step_ops.RESET:
        return None, None
    if op.code == step_ops.BEAM:
        return state, _beam(ctx, a)
    if op.code == step_ops.WARMUP:
        return state, warmup_shapes(ctx, op.scalar("max_prompt_len"), op.scalar("top_logprobs"),
                                    op.scalar("chunk"))
    raise ValueError(f"op: {op.name} is not applied to a state (the follower loop ends on it)")


def _restore(ctx: Context, state: Any, a: Mapping[str, np.ndarray]) -> Any:
    """RESTORE: the saved K/V into the row's pages, the saved row into its slot."""
    length, pages = int(a["length"]), a["pages"]
    width = len(pages) * ctx.page_size
    pad = lambda x: np.pad(x, ((0, 0), (0, 0), (0, width - length))  # noqa: E731
                           + ((0, 0),) * (x.ndim - 3))
    state = chunks.write_pages(state, pages, {name: pad(a[name]) for name in POOLS if name in a})
    return ctx.backend.insert(state, _saved_row(ctx, a),
                              np.array([int(a["slot"])], np.int32))


def _beam(ctx: Context, a: Mapping[str, np.ndarray]) -> Any:
    settings = json.loads(a["settings"].tobytes())
    settings["eos_token_ids"] = tuple(settings["eos_token_ids"])
    prompts = [t[:n].tolist() for t, n in zip(a["tokens"], a["lengths"])]
    processors = () if ctx.research is None else ctx.research.config.processors
    return beam_search(ctx.model, ctx.params, prompts, num_beams=a["widths"].tolist(),
                       tokenizer=ctx.tokenizer, processors=processors,
                       kv_cache_dtype=ctx.kv_cache_dtype,
                       adapters=a["adapters"].tolist() if "adapters" in a else None, **settings)


def kv_buckets(max_len: int) -> list:
    """Every attention bucket a step can use (scheduler.kv_bucket)."""
    return sorted({kv_bucket(1 << i, max_len) for i in range(max_len.bit_length() + 1)})


def warmup_shapes(ctx: Context, max_prompt_len: int, top_logprobs: int = 0,
                  chunk: Optional[int] = None) -> int:
    """Compile every shape the engine can meet for prompts up to `max_prompt_len`: each
    prefill chunk program (rows, length, attention bucket), the new rows of each prompt width, the
    flags and the step for each attention bucket, without logprobs and with `top_logprobs`
    (the engine's two step variants; one program for any decode steps per call), over every
    row and over each smaller row count a step may run (`compact_counts`). Returns the
    compilations."""
    before = decode.compilation_count()
    lengths = range(1, min(max_prompt_len, ctx.max_len - 1) + 1)
    chunk = chunk or ctx.max_len
    shapes = sorted({(rows, t, kv) for n in lengths
                     for _, t, _, kv in chunk_plan(n, 0, chunk, ctx.max_len)
                     for rows in chunk_rows(t, chunk, ctx.max_slots)})
    widths = sorted({decode.bucket(n, ctx.max_len) for n in lengths})
    state = ctx.backend.warmup(ctx.backend.empty_state(), shapes, widths,
                               kv_buckets(ctx.max_len), sorted({0, top_logprobs}),
                               compact_counts(numerics.min_rows(ctx.model), ctx.max_slots))
    jax.block_until_ready(state)
    return decode.compilation_count() - before


def _check_config(ctx: Context, op: step_ops.StepOp) -> None:
    theirs = {"max_slots": op.scalar("max_slots"), "max_len": op.scalar("max_len"),
              "eos_token_ids": tuple(int(i) for i in op.arrays["eos_token_ids"]),
              "num_pages": op.scalar("num_pages"), "page_size": op.scalar("page_size")}
    ours = {"max_slots": ctx.max_slots, "max_len": ctx.max_len,
            "eos_token_ids": tuple(ctx.eos_token_ids), "num_pages": ctx.num_pages,
            "page_size": ctx.page_size}
    for name, value in theirs.items():
        if ours[name] != value:
            raise ValueError(f"{name}: the leader uses {value!r}, this process {ours[name]!r} "
                             "(start every process with the same flags)")


def _saved_row(ctx: Context, a: Mapping[str, np.ndarray]) -> StepState:
    """A one-row StepState from `LLM.save_request`'s arrays, its cache the page table of its
    new pages. Numpy leaves only: jit places them like the state."""
    one = lambda x: np.asarray(x)[None]  # noqa: E731
    rows = RowParams(**{name[5:]: one(value) for name, value in a.items()
                        if name.startswith("rows.")})
    cache = PagedKVCache(k=None, v=None, page_table=one(a["table"]),
                         lengths=np.array([int(a["length"])], np.int32), max_len=ctx.max_len)
    row = StepState(cache=cache, logits=one(a["logits"]), last_token=one(a["last_token"]),
                    step=one(a["step"]), counts=one(a["counts"]), seen=one(a["seen"]),
                    done=np.zeros((1,), bool), paused=np.zeros((1,), bool),
                    finish=one(a["finish"]), rows=rows)
    if "grammar_state" in a:
        row = row.replace(grammar_state=np.array([int(a["grammar_state"])], np.int32))
    return row


@numerics.jit
def _rebase(old: jax.Array, keep: jax.Array, delta: jax.Array) -> jax.Array:
    return jnp.where(keep, jnp.where(old >= 0, old + delta, old), -1).astype(jnp.int32)


def _tables(ctx: Context, a: Mapping[str, np.ndarray]) -> GrammarTables:
    """The shared tables on the device(s): replicated over the mesh when there is one."""
    put = ((lambda x: jax.device_put(x, NamedSharding(ctx.mesh, PartitionSpec())))
           if ctx.mesh is not None else jnp.asarray)
    fields = {f: put(a["tables." + f]) for f in step_ops.TABLE_FIELDS if "tables." + f in a}
    return GrammarTables(vocab_size=int(a["tables.vocab_size"]), **fields)



class Runner:
    """The leader's device side (module docstring): `state` is the device state (None before
    INIT and after RESET), `bundle` the grammar tables of the live slots."""

    def __init__(self, ctx: Context, step_hook: Optional[Any] = None):
        self.ctx, self.step_hook = ctx, step_hook
        self.state: Any = None
        self.bundle: Optional[constraints.TableBundle] = None

    @property
    def backend(self) -> SlotBackend:
        return self.ctx.backend

    def run(self, op: step_ops.StepOp) -> Any:
        """Every device call of the engine thread: published to the step hook, then applied
        (`apply`, which followers on other hosts run with the same op)."""
        if self.step_hook is not None:
            self.step_hook.publish(op)
        self.state, out = apply(self.ctx, self.state, op)
        return out

    def init(self) -> None:
        """An empty slot state and page pool."""
        ctx = self.ctx
        self.run(step_ops.init(ctx.max_slots, ctx.max_len, ctx.eos_token_ids, ctx.num_pages,
                               ctx.page_size))

    def swap_params(self, params: Any) -> None:
        """New weights for every later op (`LLM.update_params`, engine/weights.py): the same
        backend -- its state, counters and compiled programs -- over them."""
        backend = self.ctx.backend
        self.ctx = dataclasses.replace(self.ctx, params=params)
        vars(self.ctx)["backend"] = backend  # the cached_property's slot
        backend.params = params

    def reset(self) -> None:
        """Drop the device state and the grammar tables (after a failure)."""
        self.run(step_ops.reset())
        self.bundle = None

    def warmup(self, max_prompt_len: int, top_logprobs: int, chunk: int) -> int:
        """WARMUP (`warmup_shapes`), published first; the state is untouched. Returns the
        compilations."""
        op = step_ops.warmup(max_prompt_len, top_logprobs, chunk)
        if self.step_hook is not None:
            self.step_hook.publish(op)
        return apply(self.ctx, None, op)[1]

    def grammar_tables(self, live: list, batch: list) -> Optional[np.ndarray]:
        """Keep one table set for the constraints of the `live` slots' requests plus `batch`
        (existing ones first, so offsets rarely move; else the live rows' states are rebased,
        one GRAMMAR op). `live`: one entry per slot, None where empty. Returns the initial
        grammar state of each request in `batch`, or None while nothing was ever constrained
        (then the step carries no tables and pays nothing)."""
        wanted = [r.grammar for r in dict.fromkeys([r for r in live if r is not None] + batch)
                  if r.grammar is not None]
        if not wanted and self.bundle is None:
            return None
        bundle = constraints.build_tables(wanted, self.ctx.model.config.vocab_size)
        if bundle is not self.bundle or self.state.grammar_state is None:
            # rebased on the device (no host read of the state: it may span other hosts); a
            # slot still prefilling (its grammar new to the tables) gets its state at insert
            old = self.bundle.offsets if self.bundle is not None else {}
            keys = [r.grammar.key if r is not None and r.grammar is not None
                    and r.grammar.key in old else None for r in live]
            delta = [bundle.offsets[k] - old[k] if k is not None else 0 for k in keys]
            self.run(step_ops.grammar(
                np.array([k is not None for k in keys]), np.array(delta, np.int32),
                bundle.tables if bundle is not self.bundle else None))
            self.bundle = bundle
        return np.array([bundle.initial_state(r.grammar) for r in batch], np.int32)
