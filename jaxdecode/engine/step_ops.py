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

This module is the wire format only: the constructors, the readers of an op's parts
(`finals`), the serialization. What an op does to a state is `runner.apply`; which ops an
iteration sends is `lowering.py`.
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import json
from typing import Mapping, Optional, Sequence

import numpy as np

from jaxdecode.device.constraints.tables import GrammarTables
from jaxdecode.device.state import RowParams
from jaxdecode.engine.backend import NewRows

VERSION = 6
INIT, CHUNK, RESTORE, GRAMMAR, FLAGS, STEP, RESET, WARMUP, STOP, BEAM = range(1, 11)
NAMES = {INIT: "init", CHUNK: "chunk", RESTORE: "restore", GRAMMAR: "grammar", FLAGS: "flags",
         STEP: "step", RESET: "reset", WARMUP: "warmup", STOP: "stop", BEAM: "beam"}

TABLE_FIELDS = ("allowed", "accepting", "has_next", "dense_next", "indptr", "tokens", "targets")


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
          kv_len: int, finals: Sequence[tuple[int, NewRows]] = (), top_k: int = 0,
          adapters: Optional[np.ndarray] = None) -> StepOp:
    """Prefill tokens int32[n, T] (the first `length[i]` of row i real) at positions
    start[i].. of the rows whose page tables are `tables` int32[n, P], attending to `kv_len`
    positions, row i with LoRA adapter `adapters[i]` (default 0, the base); `finals` (chunk row, `NewRows`): the rows that start decoding after the prompt
    whose last chunk is that row, whose first tokens come with `top_k` top log-probabilities.
    Each final's arrays are named `final<j>.<name>`."""
    arrays = {"tokens": np.asarray(tokens, np.int32), "start": np.asarray(start, np.int32),
              "length": np.asarray(length, np.int32), "tables": np.asarray(tables, np.int32),
              "kv_len": _i32(kv_len), "top_k": _i32(top_k),
              "adapters": np.asarray(np.zeros(len(tokens)) if adapters is None else adapters,
                                     np.int32)}
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
        for f in TABLE_FIELDS:
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


def beam(prompt_ids: Sequence[Sequence[int]], widths: Sequence[int], settings: dict,
         adapters: Sequence[int] = ()) -> StepOp:
    """`jd.beam_search(prompts, num_beams=widths, **settings)`; the settings (JSON values:
    limits, penalties, ending ids, response_format) travel as UTF-8 JSON bytes; `adapters`
    (each row's LoRA index) only where a row has one."""
    tokens = np.zeros((len(prompt_ids), max(map(len, prompt_ids))), np.int32)
    for i, ids in enumerate(prompt_ids):
        tokens[i, :len(ids)] = ids
    text = json.dumps(settings, sort_keys=True).encode()
    arrays = {"tokens": tokens, "lengths": np.array([len(p) for p in prompt_ids], np.int32),
              "widths": np.asarray(widths, np.int32),
              "settings": np.frombuffer(text, np.uint8).copy()}
    if any(adapters):
        arrays["adapters"] = np.asarray(adapters, np.int32)
    return StepOp(BEAM, arrays)


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


def finals(op: StepOp) -> list[tuple[int, NewRows]]:
    """A CHUNK op's finals, in order: (chunk row, `NewRows`) each."""
    a = op.arrays
    return [_final(a, f"final{j}.") for j in
            itertools.takewhile(lambda j: f"final{j}.row" in a, itertools.count())]


def _final(a: Mapping[str, np.ndarray], prefix: str) -> tuple[int, NewRows]:
    """A CHUNK op's final named `prefix`: its chunk row and `NewRows`."""
    f = {k[len(prefix):]: v for k, v in a.items() if k.startswith(prefix)}
    rows = RowParams(**{k[5:]: v for k, v in f.items() if k.startswith("rows.")})
    resume = tuple(f[k] for k in _RESUME) if _RESUME[0] in f else None
    return int(f["row"]), NewRows(f["prompt"], int(f["prompt_length"]), f["slots"], f["tables"],
                                  rows, f.get("grammar_state"), resume,
                                  (f["copy_src"], f["copy_dst"]))
