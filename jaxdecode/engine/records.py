"""What a request leaves behind: its generation record (contract §11, jaxdecode/replay.py) with
the engine's content hashes, and its decoding state saved to disk and back (contract §7 B1: pause /
save / restore).

A saved request is its slice of the device state -- cache up to its length, logits, last
token, step, penalty counts, per-row settings and key, grammar state -- written with orbax, and
a JSON file with the host counters. The host pipeline's state (detokenizer bytes, stop-matcher
hold-back) is not serialized: it is a deterministic function of the output ids, so a restore
rebuilds it by pushing them again.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxdecode import replay as replay_lib
from jaxdecode.device import decode, numerics
from jaxdecode.engine.request import Request
from jaxdecode.model_api import params_quantization
from jaxdecode.types import ErrorCode, FinishReason, TokenLogprob

FORMAT = "jaxdecode.request/1"


def save(path: str | os.PathLike, arrays: dict, meta: dict) -> Path:
    path = Path(path).expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path / "arrays", arrays, force=True)
        ckptr.wait_until_finished()
    (path / "request.json").write_text(json.dumps(dict(meta, format=FORMAT), indent=2))
    return path


def load(path: str | os.PathLike) -> tuple[dict, dict]:
    path = Path(path).expanduser().resolve()
    meta_file = path / "request.json"
    if not meta_file.exists():
        raise FileNotFoundError(f"{path}: no saved request there (request.json missing)")
    meta = json.loads(meta_file.read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{meta_file}: format {meta.get('format')!r} is not {FORMAT!r}")
    with ocp.StandardCheckpointer() as ckptr:
        arrays = ckptr.restore(path / "arrays")
    return {k: np.asarray(v) for k, v in arrays.items()}, meta


class Records:
    """The engine's content hashes (computed once, on first use; `params_hash` may be given by
    a caller who read it with the checkpoint) and each request's generation record."""

    def __init__(self, model: Any, params: Any, tokenizer: Any, *, model_source: Optional[str],
                 max_slots: int, max_len: int, processor_order: Optional[tuple] = None,
                 params_hash: Optional[str] = None, kv: Optional[Any] = None,
                 adapters: Optional[Any] = None, kv_cache_dtype: str = "auto"):
        self.model, self.params, self.tokenizer = model, params, tokenizer
        self.adapters = adapters  # engine/adapters.py: a record names its request's (R7)
        self.model_source, self.max_slots, self.max_len = model_source, max_slots, max_len
        self.kv = kv  # config.KVLayout: pages, page size, prefill chunk, prefix cache
        self.kv_cache_dtype = kv_cache_dtype  # "auto" or "int8" (jaxdecode/kv_int8.py)
        self.processor_order = processor_order
        self._hashes: dict = {} if params_hash is None else {"params": params_hash}

    @property
    def params_hash(self) -> str:
        if "params" not in self._hashes:
            self._hashes["params"] = replay_lib.params_hash(self.params)
        return self._hashes["params"]

    def swap(self, params: Any, params_hash: Optional[str]) -> None:
        """New weights (`LLM.update_params`): their hash is computed on first use, or given."""
        self.params = params
        self._hashes.pop("params", None)
        if params_hash is not None:
            self._hashes["params"] = params_hash

    @property
    def tokenizer_hash(self) -> str:
        if "tokenizer" not in self._hashes:
            self._hashes["tokenizer"] = replay_lib.tokenizer_hash(self.tokenizer)
        return self._hashes["tokenizer"]

    @property
    def model_snapshot(self) -> str:
        """The first 16 hex digits of the weights' hash (every `start` event names it)."""
        return self.params_hash[:16]

    def record(self, r: Request, finish: Optional[FinishReason],
               error: Optional[ErrorCode]) -> replay_lib.GenerationRecord:
        return replay_lib.build_record(
            model_hash=r.params_hash or self.params_hash, model_config=self.model.config,
            model_source=self.model_source, tokenizer_hash_=self.tokenizer_hash,
            prompt_text=r.prompt_text, prompt_ids=r.prompt_ids, sampling=r.sampling,
            seed=r.seed, key_data=r.key_data, sample_index=r.index,
            layout={"engine": "LLM", "max_slots": self.max_slots, "max_len": self.max_len,
                    "prompt_bucket": decode.bucket(len(r.prompt_ids), self.max_len),
                    **({} if self.kv is None else {
                        "page_size": self.kv.page_size, "prefill_chunk": self.kv.chunk,
                        "prefix_cache": self.kv.prefix_cache}),
                    "kv_cache_dtype": self.kv_cache_dtype},
            batch_invariance=numerics.guarantee(self.model, jax.default_backend()),
            detokenizer_mode=r.pipeline.detokenizer.mode, token_ids=r.token_ids,
            text=r.pipeline.text, finish_reason=finish.value if finish else None,
            error=error.value if error else None, usage=dataclasses.asdict(r.usage()),
            processors=self.processor_order,
            quantization=params_quantization(self.params),
            lora=None if self.adapters is None else self.adapters.record(r.sampling.lora))


def row_arrays(state: Any, r: Request, placed: Any, grammar_offset: int = 0) -> dict:
    """Request r's slice of the engine's StepState (host arrays, module docstring; its K/V
    gathered from its pages, [layers, kv_heads, length, head_dim] as ever); `placed`: its
    scheduler `Placement`; `grammar_offset`: where its constraint starts in the live table
    set."""
    slot, pool = placed.slot, state.cache
    length = int(pool.lengths[slot])
    pages = np.asarray(placed.pages[:-(-length // pool.page_size)], np.int32)
    row = lambda x: np.asarray(x[slot])  # noqa: E731

    def kv(x):  # its pages, in order: [layers, kv_heads, length, ...]
        x = np.asarray(x[:, :, pages])
        return x.reshape(x.shape[:2] + (-1,) + x.shape[4:])[:, :, :length].swapaxes(0, 1)

    # an int8 pool's bf16 scales travel as float32 (exact; the wire takes numeric numpy only)
    arrays = {name: kv(x).astype(np.float32) if name.endswith("_scale") else kv(x)
              for name, x in pool.pools.items()}
    arrays.update({"length": np.int32(length), "logits": row(state.logits),
              "last_token": row(state.last_token), "step": row(state.step),
              "counts": row(state.counts), "seen": row(state.seen), "finish": row(state.finish)})
    for name, value in vars(state.rows).items():
        arrays["rows." + name] = row(value)
    if r.grammar is not None:
        arrays["grammar_local"] = np.int32(int(state.grammar_state[slot]) - grammar_offset)
    return arrays


def request_meta(r: Request, params_hash: str) -> dict:
    """The host side of a saved request (module docstring)."""
    return {"request_id": r.request_id, "prompt_ids": r.prompt_ids, "prompt_text": r.prompt_text,
            "sampling": replay_lib.sampling_to_json(dataclasses.replace(r.sampling,
                                                                        seed=r.seed)),
            "index": r.index, "prompt_index": r.prompt_index,
            "output_kind": r.lifecycle.stream.output_kind.value, "token_ids": r.token_ids,
            "selected": r.selected,
            "logprobs": (None if r.logprobs is None
                         else [dataclasses.astuple(e) for e in r.logprobs]),
            "processed": r.processed, "next_seq": r.lifecycle.stream.next_seq,
            "model_hash": params_hash}


def resume_host(r: Request, arrays: dict, meta: dict) -> None:
    """Rebuild a restored request's host state from its saved ids and counters: the output
    ids pushed through a fresh pipeline again, the logprobs already sent, the stream numbering
    continued; the arrays wait for a slot (`Request.restored`)."""
    if not np.array_equal(r.key_data, arrays["rows.keys"]):
        raise ValueError("path: the saved key does not match the request's seed")
    r.prompt_text = meta["prompt_text"]
    r.token_ids = list(meta["token_ids"])
    r.selected, r.processed = meta["selected"], meta["processed"]
    for token in r.token_ids:  # rebuild the detokenizer and stop-matcher state
        r.pipeline.push(token)
    if r.logprobs is not None:  # the returned tokens' logprobs were sent before the save
        r.logprobs = [TokenLogprob(i, lp, tuple(map(tuple, top)))
                      for i, lp, top in meta.get("logprobs") or ()]
        r.reported = r.pipeline.returned_tokens
    r.lifecycle.stream.continue_numbering(meta["next_seq"])
    r.lifecycle.record("request.restored", selected=r.selected)
    r.restored = arrays


def save_request(core: Any, handle: Any, path: str, params_hash: str, timeout: float) -> str:
    """`LLM.save_request`: pause the request, wait until no step of it is in flight, read its
    row on the engine thread and write it with its host counters. ValueError when it ended
    before the pause took effect (its steps in flight finished it)."""
    r = handle._request
    if handle.done or core.scheduler.placements.slot_of(r) is None:
        raise ValueError("request: only a running request (in a slot) can be saved")
    handle.pause()
    deadline = time.monotonic() + timeout
    while not r.settled.wait(0.01):
        if r.finished.is_set():
            raise ValueError("request: it ended before it could be paused (nothing saved)")
        if time.monotonic() > deadline:
            raise TimeoutError("request: a step of it is still in flight")
    runner = core.runner
    arrays = core.on_thread(lambda: row_arrays(
        runner.state, r, core.scheduler.placements[r],
        0 if r.grammar is None else runner.bundle.offsets[r.grammar.key]))
    return str(save(path, arrays, request_meta(r, params_hash)))


def restore_request(admission: Any, path: str, params_hash: str,
                    kv_cache_dtype: str = "auto") -> Request:
    """`LLM.restore_request`: the saved request rebuilt (checked like a new one), its device
    arrays waiting for a slot; its K/V must be of the engine's `kv_cache_dtype` (an int8
    row carries its scales)."""
    arrays, meta = load(path)
    if meta.get("model_hash") != params_hash:
        raise ValueError("path: the saved request was decoded with other weights")
    if ("k_scale" in arrays) != (kv_cache_dtype == "int8"):
        raise ValueError(f"path: the saved request's KV cache is not of this engine's "
                         f"kv_cache_dtype {kv_cache_dtype!r}")
    r = admission.request(meta["prompt_ids"], replay_lib.sampling_from_json(meta["sampling"]),
                          meta["request_id"], meta["prompt_index"], meta["index"],
                          meta["output_kind"])
    resume_host(r, arrays, meta)
    return r


def check_saveable(research: Any, spec: Any) -> None:
    """Save / restore need a plain engine: processor states and speculative rows are not part
    of a saved request (ValueError naming the option)."""
    if research is not None:
        raise ValueError("processors: save / restore is not supported with processors=")
    if spec is not None:
        raise ValueError("speculative: save / restore is not supported with speculative=")


def request_of(admission: Any, record: replay_lib.GenerationRecord) -> Request:
    """`LLM.run_record`: a record's request again -- its prompt ids, settings, seed and sample
    index (checked like a new one)."""
    sp = dataclasses.replace(record.sampling, seed=record.data["rng"]["seed"])
    r = admission.request(record.prompt_ids, sp, index=record.data["rng"]["sample_index"],
                          output_kind="final_only")
    r.prompt_text = record.data["prompt"]["text"]
    return r
