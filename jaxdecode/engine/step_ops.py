"""Step ops: every device call of the `LLM` engine as a small record of host inputs.

The rule (multi-controller JAX): every process must issue the same jitted calls with the same
host inputs. The engine decides those inputs on the host -- which prompts to prefill into which
slots, which rows to release or pause, the attention bucket of the next step -- so it writes
each decision as a `StepOp` and applies it with `apply`; a follower process
(`serving/distributed.py`) receives the same ops and applies them with the same `apply` to its
own state, so leader and followers cannot drift. One op = one device action:

    INIT     empty slot state and page pool      CHUNK    one prefill chunk of each of n rows
                                                          into their pages; a prompt's last one
                                                          also sets up the rows that start
                                                          decoding after it (output: their
                                                          first tokens, or None)
    RESTORE  a saved row into pages and a slot   GRAMMAR  new grammar tables / rebased states
    FLAGS    release and pause masks             STEP     one engine step (kv_len, top_logprobs,
                                                          decode steps in the call)
    RESET    drop the state (after a failure)    WARMUP   compile every engine shape
    BEAM     one `jd.beam_search` call of the engine's beam lane (the slot state is untouched)
    STOP     the leader is shutting down (followers return)

An op is data only: an op code and named numpy arrays (scalars are 0-d arrays). `to_bytes` /
`from_bytes` serialize it with `np.savez` and load with `allow_pickle=False`, so bytes from the
network never run code. `VERSION` names the format; a mismatch is an error, never a guess.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import itertools
import json
from typing import Any, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxdecode.device import chunks, decode, numerics
from jaxdecode.device.beam import beam_search
from jaxdecode.device.constraints.tables import GrammarTables
from jaxdecode.device.state import RowParams, StepState
from jaxdecode.engine.backend import (NewRows, Pages, PlainBackend, SlotBackend,
                                      SpeculativeBackend)
from jaxdecode.engine.scheduler import chunk_plan, chunk_rows, compact_counts, kv_bucket
from jaxdecode.model_api import DecoderModel, PagedKVCache

VERSION = 5
INIT, CHUNK, RESTORE, GRAMMAR, FLAGS, STEP, RESET, WARMUP, STOP, BEAM = range(1, 11)
NAMES = {INIT: "init", CHUNK: "chunk", RESTORE: "restore", GRAMMAR: "grammar", FLAGS: "flags",
         STEP: "step", RESET: "reset", WARMUP: "warmup", STOP: "stop", BEAM: "beam"}

_TABLE_FIELDS = ("allowed", "accepting", "has_next", "dense_next", "indptr", "tokens", "targets")


@dataclasses.dataclass(frozen=True)
class StepOp:
    """One device action: `code` (INIT..STOP) and its host inputs as numpy arrays."""

    code: int
    arrays: Mapping[str, np.ndarray] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if self.code not in NAMES:
            raise ValueError(f"code: unknown step op {self.code!r}")
        for name, value in self.arrays.items():
            if not isinstance(value, np.ndarray) or value.dtype.kind not in "biuf":
                raise ValueError(f"arrays[{name!r}]: expected a numeric numpy array, "
                                 f"got {type(value).__name__}")

    @property
    def name(self) -> str:
        return NAMES[self.code]

    def scalar(self, name: str) -> int:
        return int(self.arrays[name])

    def equals(self, other: "StepOp") -> bool:
        """Same code, same names, and each array equal in dtype, shape and bytes."""
        return (self.code == other.code and self.arrays.keys() == other.arrays.keys()
                and all(a.dtype == other.arrays[k].dtype and a.shape == other.arrays[k].shape
                        and a.tobytes() == other.arrays[k].tobytes()
                        for k, a in self.arrays.items()))


# -- constructors (the engine calls these where it decides device inputs) ----------------------

def _i32(value: int) -> np.ndarray:
    return np.array(value, np.int32)


def init(max_slots: int, max_len: int, eos_token_ids: Sequence[int], num_pages: int,
         page_size: int) -> StepOp:
    """The config travels with INIT so a follower started with other flags fails loudly."""
    return StepOp(INIT, {"max_slots": _i32(max_slots), "max_len": _i32(max_len),
                         "eos_token_ids": np.asarray(eos_token_ids, np.int32).reshape(-1),
                         "num_pages": _i32(num_pages), "page_size": _i32(page_size)})


_RESUME = ("resume.step", "resume.counts", "resume.last_token", "resume.prompt_length")


def chunk(tokens: np.ndarray, start: np.ndarray, length: np.ndarray, tables: np.ndarray,
          kv_len: int, finals: Sequence[tuple[int, NewRows]] = (), top_k: int = 0) -> StepOp:
    """Prefill tokens int32[n, T] (the first `length[i]` of row i real) at positions
    start[i].. of the rows whose page tables are `tables` int32[n, P], attending to `kv_len`
    positions; `finals` (chunk row, `NewRows`): the rows that start decoding after the prompt
    whose last chunk is that row, whose first tokens come with `top_k` top log-probabilities.
    Each final's arrays are named `final<j>.<name>`."""
    arrays = {"tokens": np.asarray(tokens, np.int32), "start": np.asarray(start, np.int32),
              "length": np.asarray(length, np.int32), "tables": np.asarray(tables, np.int32),
              "kv_len": _i32(kv_len), "top_k": _i32(top_k)}
    for j, (row, final) in enumerate(finals):
        own = {"row": _i32(row), "prompt": final.prompt,
               "prompt_length": _i32(final.prompt_length),
               "slots": np.asarray(final.slots, np.int32),
               "tables": np.asarray(final.tables, np.int32),
               "copy_src": np.asarray(final.copies[0], np.int32),
               "copy_dst": np.asarray(final.copies[1], np.int32)}
        own.update({"rows." + k: np.asarray(v) for k, v in vars(final.rows).items()})
        if final.grammar_state is not None:
            own["grammar_state"] = np.asarray(final.grammar_state, np.int32)
        if final.resume is not None:
            own.update(zip(_RESUME, final.resume))
        arrays.update({f"final{j}.{k}": v for k, v in own.items()})
    return StepOp(CHUNK, arrays)


def restore(saved: Mapping[str, np.ndarray], slot: int, pages: np.ndarray, table: np.ndarray,
            grammar_state: Optional[int] = None) -> StepOp:
    """Write a row saved by `LLM.save_request` (its arrays) into `pages` and insert it into
    `slot` with page table `table`."""
    arrays = {k: np.asarray(v) for k, v in saved.items() if k != "grammar_local"}
    arrays.update(slot=_i32(slot), pages=np.asarray(pages, np.int32),
                  table=np.asarray(table, np.int32))
    if grammar_state is not None:
        arrays["grammar_state"] = _i32(grammar_state)
    return StepOp(RESTORE, arrays)


def grammar(keep: np.ndarray, delta: np.ndarray, tables: Optional[GrammarTables]) -> StepOp:
    """Per slot: constrained rows (`keep`) move their state by `delta` (new table offsets minus
    old ones), other rows become -1 (unconstrained); `tables` (when given) replace the shared
    table set."""
    arrays = {"keep": np.asarray(keep, bool), "delta": np.asarray(delta, np.int32)}
    if tables is not None:
        arrays["tables.vocab_size"] = _i32(tables.vocab_size)
        for f in _TABLE_FIELDS:
            if getattr(tables, f) is not None:
                arrays["tables." + f] = np.asarray(getattr(tables, f))
    return StepOp(GRAMMAR, arrays)


def flags(release: np.ndarray, paused: np.ndarray) -> StepOp:
    return StepOp(FLAGS, {"release": np.asarray(release, bool), "paused": np.asarray(paused, bool)})


def step(kv_len: int, top_logprobs: int = 0, steps: int = 1,
         rows: Optional[np.ndarray] = None) -> StepOp:
    """`rows`: the slots the step runs (all when None; backend.py)."""
    arrays = {"kv_len": _i32(kv_len), "top_logprobs": _i32(top_logprobs), "steps": _i32(steps)}
    if rows is not None:
        arrays["rows"] = np.asarray(rows, np.int32)
    return StepOp(STEP, arrays)


def reset() -> StepOp:
    return StepOp(RESET)


def warmup(max_prompt_len: int, top_logprobs: int = 0, chunk: int = 0) -> StepOp:
    return StepOp(WARMUP, {"max_prompt_len": _i32(max_prompt_len),
                           "top_logprobs": _i32(top_logprobs), "chunk": _i32(chunk)})


def stop() -> StepOp:
    return StepOp(STOP)


def beam(prompt_ids: Sequence[Sequence[int]], widths: Sequence[int], settings: dict) -> StepOp:
    """`jd.beam_search(prompts, num_beams=widths, **settings)`; the settings (JSON values:
    limits, penalties, ending ids, response_format) travel as UTF-8 JSON bytes."""
    tokens = np.zeros((len(prompt_ids), max(map(len, prompt_ids))), np.int32)
    for i, ids in enumerate(prompt_ids):
        tokens[i, :len(ids)] = ids
    text = json.dumps(settings, sort_keys=True).encode()
    return StepOp(BEAM, {"tokens": tokens,
                         "lengths": np.array([len(p) for p in prompt_ids], np.int32),
                         "widths": np.asarray(widths, np.int32),
                         "settings": np.frombuffer(text, np.uint8).copy()})


# -- serialization -----------------------------------------------------------------------------

def to_bytes(op: StepOp) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, __version__=_i32(VERSION), __code__=_i32(op.code), **op.arrays)
    return buf.getvalue()


def from_bytes(data: bytes) -> StepOp:
    """The op `to_bytes` wrote; ValueError naming the problem for anything else."""
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except Exception as exc:  # zip or npy errors: not a step op
        raise ValueError(f"payload: not a step op ({type(exc).__name__}: {exc})") from None
    version = int(arrays.pop("__version__", -1))
    if version != VERSION:
        raise ValueError(f"payload: step op format {version}, this build reads {VERSION}")
    return StepOp(int(arrays.pop("__code__")), arrays)


# -- application (the same on the leader and on every follower) --------------------------------

@dataclasses.dataclass(frozen=True)
class Context:
    """What `apply` needs besides the state; equal on every process.

    replicate_outputs: gather each step's output (tokens, finish codes, ...) onto every device,
    so the leader can read it when the state is spread over other hosts' devices. It is a
    collective, so the leader and its followers must agree: it is on exactly when a mesh is
    used with a step hook (the leader) or in a follower. `spec`: a SpeculativeConfig (steps are
    speculative rounds); `research`: the engine's custom processors (research.Setup);
    `pages` and `page_size` shape the KV page pool."""

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
                Pages(self.num_pages, self.page_size))
        if self.spec is not None:
            return SpeculativeBackend(self.spec, *args)
        return PlainBackend(*args, research=self.research, mesh=self.mesh,
                            replicate_outputs=self.replicate_outputs)


def apply(ctx: Context, state: Optional[Any], op: StepOp) -> tuple[Optional[Any], Any]:
    """Apply `op` to `state`: returns the new state and the op's output (STEP: the backend's
    device output; CHUNK: the first tokens of the rows that start decoding, when the backend
    selects them early; BEAM: the GenerateOutput; WARMUP: the number of compilations;
    otherwise None). The state is donated."""
    a, backend = op.arrays, ctx.backend
    if op.code == INIT:
        _check_config(ctx, op)
        return backend.empty_state(), None
    if op.code == CHUNK:
        state, logits = backend.chunk(state, a["tokens"], a["start"], a["length"],
                                      a["tables"], op.scalar("kv_len"))
        finals = [_final(a, f"final{j}.") for j in
                  itertools.takewhile(lambda j: f"final{j}.row" in a, itertools.count())]
        return backend.start(state, logits, finals, op.scalar("top_k"))
    if op.code == RESTORE:
        return _restore(ctx, state, a), None
    if op.code == GRAMMAR:
        old = (state.grammar_state if state.grammar_state is not None
               else np.full((ctx.rows,), -1, np.int32))
        state = state.replace(grammar_state=_rebase(old, ctx.per_row(a["keep"]),
                                                    ctx.per_row(a["delta"])))
        if "tables.allowed" in a:
            state = state.replace(grammar=_tables(ctx, a))
        return state, None
    if op.code == FLAGS:
        return backend.set_flags(state, ctx.per_row(a["release"]), ctx.per_row(a["paused"])), None
    if op.code == STEP:
        return backend.step(state, op.scalar("kv_len"), op.scalar("top_logprobs"),
                            op.scalar("steps"), a.get("rows"))
    if op.code == RESET:
        return None, None
    if op.code == BEAM:
        return state, _beam(ctx, a)
    if op.code == WARMUP:
        return state, warmup_shapes(ctx, op.scalar("max_prompt_len"), op.scalar("top_logprobs"),
                                    op.scalar("chunk"))
    raise ValueError(f"op: {op.name} is not applied to a state (the follower loop ends on it)")


def _final(a: Mapping[str, np.ndarray], prefix: str) -> tuple[int, NewRows]:
    """A CHUNK op's final named `prefix`: its chunk row and `NewRows`."""
    f = {k[len(prefix):]: v for k, v in a.items() if k.startswith(prefix)}
    rows = RowParams(**{k[5:]: v for k, v in f.items() if k.startswith("rows.")})
    resume = tuple(f[k] for k in _RESUME) if _RESUME[0] in f else None
    return int(f["row"]), NewRows(f["prompt"], int(f["prompt_length"]), f["slots"], f["tables"],
                                  rows, f.get("grammar_state"), resume,
                                  (f["copy_src"], f["copy_dst"]))


def _restore(ctx: Context, state: Any, a: Mapping[str, np.ndarray]) -> Any:
    """RESTORE: the saved K/V into the row's pages, the saved row into its slot."""
    length, pages = int(a["length"]), a["pages"]
    width = len(pages) * ctx.page_size
    pad = lambda x: np.pad(x, ((0, 0), (0, 0), (0, width - length), (0, 0)))  # noqa: E731
    state = chunks.write_pages(state, pages, pad(a["k"]), pad(a["v"]))
    return ctx.backend.insert(state, _saved_row(ctx, a),
                              np.array([int(a["slot"])], np.int32))


def _beam(ctx: Context, a: Mapping[str, np.ndarray]) -> Any:
    settings = json.loads(a["settings"].tobytes())
    settings["eos_token_ids"] = tuple(settings["eos_token_ids"])
    prompts = [t[:n].tolist() for t, n in zip(a["tokens"], a["lengths"])]
    processors = () if ctx.research is None else ctx.research.config.processors
    return beam_search(ctx.model, ctx.params, prompts, num_beams=a["widths"].tolist(),
                       tokenizer=ctx.tokenizer, processors=processors, **settings)


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


def _check_config(ctx: Context, op: StepOp) -> None:
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
    fields = {f: put(a["tables." + f]) for f in _TABLE_FIELDS if "tables." + f in a}
    return GrammarTables(vocab_size=int(a["tables.vocab_size"]), **fields)
