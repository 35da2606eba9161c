"""`LLM`: continuous batching over slots, with streaming, cancellation and deadlines -- the
thin front of the engine layers (docs/architecture.md "Engine"): config.py (`EngineConfig`,
the construction's checks), admission.py (every request's checks, before anything is queued),
request.py, scheduler.py (no jax), lowering.py, runner.py, backend.py (plain | speculative,
engine/speculative.py), core.py (the engine thread), faults.py, output.py, beam_lane.py,
records.py.

Custom processors (`processors=`, jaxdecode/device/research.py) are fixed for the engine's life
and apply to every request; not with `speculative=`, `step_hook` nor save / restore; after a
failed step a stateful processor's state restarts (its `engine.resumed` event says so).
`generate()` streams nothing (`final_only`); `submit()` keeps up to `max_buffered` unsent events
under the back-pressure policy.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator, Optional, Sequence, Union

from jaxdecode import replay as replay_lib
from jaxdecode.config import MAX_LOGPROBS, SamplingParams
from jaxdecode.device import constraints, research
from jaxdecode.engine import adapters, admission, records, runner, samples, weights
from jaxdecode.engine import config as engine_config
from jaxdecode.engine.config import EngineConfig
from jaxdecode.engine.core import EngineCore
from jaxdecode.engine.request import Request, RequestHandle
from jaxdecode.engine.scheduler import EngineClosed, QueueFull
from jaxdecode.engine.speculative import SpeculativeConfig
from jaxdecode.model_api import DecoderModel
from jaxdecode.prompts import token_rows
from jaxdecode.types import Completion, RequestState

__all__ = ["EngineClosed", "EngineConfig", "LLM", "QueueFull", "RequestHandle"]

Prompt = admission.Prompt


class LLM:
    """The engine of docs/architecture.md: `generate`, `stream`, `submit`, `close`; thread-safe.

    Built from an `EngineConfig` (engine/config.py, validated there): `config=`, or its fields
    as keyword arguments (`LLM(model, params, tokenizer, max_slots=4, ...)`, the same names and
    defaults; not both). The objects besides it: `mesh`, `speculative` (a dict,
    engine/speculative.py), `step_hook` (serving/distributed.py) and `processors`.

    Per-request bounds: `max_num_beams`, `max_n`; `max_constraint_compile_s` and
    `max_constraint_states` make the `CompileBudget` of a response_format compile.
    `params_hash`: the weights' content hash when the caller knows it (never recomputed);
    `decode_steps`: decode steps per device call while nothing waits (engine/config.py);
    `row_tile`: rows per weight-product tile of the model and its draft (None: the model's own,
    `invariance.ROW_TILE` by default). Wider tiles make full batches faster and a lone row
    slower; a row's tokens are invariant for one tile, not across two, and records pin it
    (docs/batch_invariance.md "Row tiles as a setting"); `batch_invariant=False`: the model and
    its draft on XLA's plain numerics (X1 not kept; records say `"mode": "none"`);
    `lora_modules` {name: PEFT directory} and `max_loras`: LoRA adapters a request selects with
    `SamplingParams(lora=name)`, all in one batch and one program (engine/adapters.py, contract
    R6; `adapters` holds them, None without);
    `kv_cache_dtype`: "auto" (the weights' dtype) or "int8" (the page pools as int8 codes with a
    scale per (token, kv head), jaxdecode/kv_int8.py; records pin it)."""

    def __init__(self, model: DecoderModel, params: Any, tokenizer: Any,
                 config: Optional[EngineConfig] = None, *, mesh: Optional[Any] = None,
                 speculative: Optional[dict] = None, step_hook: Optional[Any] = None,
                 processors: Optional[Sequence[Any]] = None, **settings: Any):
        if config is not None and settings:
            raise ValueError(f"config: given together with {sorted(settings)[0]}= (pass one)")
        cfg = self.config = config if config is not None else EngineConfig(**settings)
        model = cfg.for_model(model)
        params = weights.committed(params)  # update_params' trees compile alike (weights.py)
        self.model, self.params, self.tokenizer = model, params, tokenizer
        self.adapters = adapters.Adapters.load(model, params, cfg.lora_modules or (),
                                               cfg.max_loras)
        engine_params = weights.with_adapters(params, self.adapters)
        self.max_slots, self.max_len, self.max_queue = cfg.max_slots, cfg.max_len, cfg.max_queue
        self.limits = admission.EngineLimits(cfg.max_len, cfg.max_slots, model.config.max_len,
                                             cfg.max_num_beams, cfg.max_n)
        self.eos_token_ids = engine_config.ending_tokens(model, tokenizer, cfg.eos_token_ids)
        self.logprobs_k = min(MAX_LOGPROBS, model.config.vocab_size)  # the step's top-k
        spec = None if speculative is None else SpeculativeConfig.parse(speculative, model,
                                                                         cfg.max_len)
        if spec is not None and spec.draft is not None and (cfg.row_tile is not None
                                                             or cfg.batch_invariant is False):
            spec = dataclasses.replace(spec, draft=engine_config.row_tiled(
                spec.draft, cfg.row_tile, cfg.batch_invariant))
        self._research = research.configure(model, processors=processors)
        engine_config.check_options(spec, self._research, mesh, step_hook,
                                    lora=self.adapters is not None)
        budget = constraints.CompileBudget(seconds=cfg.max_constraint_compile_s,
                                           max_states=cfg.max_constraint_states)
        self._admission = admission.Admission(
            model, tokenizer, self.limits, budget, self.eos_token_ids, trace=cfg.trace,
            stream={"max_buffered": cfg.max_buffered, "backpressure": cfg.backpressure},
            speculative=spec, adapters=self.adapters)
        self.kv = cfg.kv
        # every device call is a step op, published to step_hook first (serving/distributed.py)
        ctx = runner.Context(model, engine_params, cfg.max_slots, cfg.max_len, self.eos_token_ids, mesh,
                             replicate_outputs=step_hook is not None, tokenizer=tokenizer,
                             spec=spec, research=self._research, pages=self.kv.pages,
                             page_size=self.kv.page_size, kv_cache_dtype=cfg.kv_cache_dtype)
        self._scheduler, self._core = EngineCore.build(
            ctx, self.kv, cfg.max_queue, self.limits, lambda: self.model_snapshot,
            logprobs_k=self.logprobs_k, step_hook=step_hook,
            decode_steps=engine_config.decode_steps(cfg.decode_steps, spec, self._research),
            stateful_processors=any(p.stateful for p in processors or ()))
        self._records = records.Records(
            model, params, tokenizer, model_source=cfg.model_source, max_slots=cfg.max_slots,
            max_len=cfg.max_len, params_hash=cfg.params_hash, kv=self.kv,
            kv_cache_dtype=cfg.kv_cache_dtype,
            processor_order=None if self._research is None else self._research.processor_order,
            adapters=self.adapters)
        self._spec, self.step_hook = spec, step_hook

    # -- requests -------------------------------------------------------------------------------

    def _handle(self, r: Request) -> RequestHandle:
        return RequestHandle(r, self._scheduler.wake, self._records.record)

    def _enqueue(self, reqs: list, block: bool) -> None:
        def queued(r: Request) -> None:
            r.lifecycle.transition(RequestState.QUEUED)
            r.params_hash = self.params_hash  # the weights it runs on (R4, engine/weights.py)
            r.lifecycle.emit_start(self.model_snapshot)

        self._core.ensure_thread()
        self._scheduler.enqueue(reqs, block, queued)

    def submit(self, prompt: Prompt, params: Optional[SamplingParams] = None, *,
               request_id: Optional[str] = None, block: bool = False,
               cancelled: Optional[Callable[[], bool]] = None) -> RequestHandle:
        """Queue one request (n must be 1; `generate` expands n). Raises ValueError naming the
        bad field, `QueueFull` when the admission queue is full (unless `block`). A
        response_format is compiled here, within the engine's compile budget; `cancelled()`
        true (polled meanwhile) abandons it with a ValueError naming response_format."""
        r = self._admission.request(prompt, params, request_id, cancelled=cancelled)
        self._enqueue([r], block)
        return self._handle(r)

    def submit_n(self, prompt: Prompt, params: SamplingParams, *,
                 request_id: Optional[str] = None, block: bool = False,
                 cancelled: Optional[Callable[[], bool]] = None) -> list:
        """Queue a prompt's n samples (or, with num_beams > 1, its n best beams) as n handles,
        expanded as `generate` expands them (engine/samples.py: one seed, sample 0 the request
        alone, samples sharing the prompt's pages), ids `<request_id>-<j>` when n > 1; all or
        none is queued. Raises like `submit`. The HTTP server's `n` (serving/app.py)."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params: expected SamplingParams, got {type(params).__name__}")
        reqs = samples.expand(self._admission, prompt, params,
                              request_id=request_id or self._admission.new_id(),
                              cancelled=cancelled)
        self._enqueue(reqs, block)
        return [self._handle(r) for r in reqs]

    def submit_beams(self, prompt: Prompt, params: SamplingParams, *,
                     request_id: Optional[str] = None, block: bool = False,
                     cancelled: Optional[Callable[[], bool]] = None) -> list:
        """Queue a beam-search request (num_beams > 1) as its n best beams: one handle per
        rank sharing one search row (beam_lane.py), ids `<request_id>-<rank>` when n > 1.
        Raises like `submit`."""
        if not isinstance(params, SamplingParams) or params.num_beams == 1:
            raise ValueError("num_beams: submit_beams() takes SamplingParams with num_beams > 1")
        return self.submit_n(prompt, params, request_id=request_id, block=block,
                             cancelled=cancelled)

    def stream(self, prompt: Prompt, params: Optional[SamplingParams] = None,
               timeout: Optional[float] = None) -> Iterator:
        """Yield the request's stream events: start, deltas, one terminal event."""
        handle = self.submit(prompt, params)
        try:
            yield from handle.events(timeout)
        finally:
            if not handle.done:  # the consumer stopped early
                handle.cancel()

    def generate(self, prompts: Union[Prompt, Sequence[Prompt]],
                 params: Union[None, SamplingParams, Sequence[SamplingParams]] = None, *,
                 use_tqdm: bool = False) -> list[Completion]:
        """Run prompts to completion: a flat list, len(prompts) * n, each prompt's n samples
        adjacent (`Completion.prompt_index`, `Completion.index`); with num_beams > 1 the n
        samples are the prompt's n best beams, by rank."""
        prompts = token_rows(prompts, "prompt", text=True)
        settings = admission.per_prompt(params, prompts)
        reqs = [r for i, (p, sp) in enumerate(zip(prompts, settings))
                for r in samples.expand(self._admission, p, sp, prompt_index=i,
                                        output_kind="final_only")]  # samples.py: n expanded
        self._enqueue(reqs, block=True)  # validated all before queueing any
        handles = [self._handle(r) for r in reqs]
        if not use_tqdm:
            return [h.result() for h in handles]
        from tqdm.auto import tqdm

        with tqdm(total=len(handles), desc="generate", unit="req") as bar:
            return [(h.result(), bar.update(1))[0] for h in handles]

    def run_record(self, record: replay_lib.GenerationRecord) -> Completion:
        """Run a record's request again: same prompt ids, settings, seed and sample index."""
        r = records.request_of(self._admission, record)
        self._enqueue([r], block=True)
        return self._handle(r).result()

    # -- pause, save, restore (contract B1, records.py) ---------------------------------------------

    def save_request(self, handle: RequestHandle, path: str, timeout: float = 60.0) -> str:
        """Pause `handle` and write its slice of the decoding state to `path` (records.py); the
        request stays paused (`resume()` or `cancel()` it); `restore_request` continues it."""
        records.check_saveable(self._research, self._spec)
        return records.save_request(self._core, handle, path, self.params_hash, timeout)

    def restore_request(self, path: str) -> RequestHandle:
        """Continue a request saved by `save_request` (in this or another process): the output
        equals an uninterrupted run's, byte for byte."""
        records.check_saveable(self._research, self._spec)
        r = records.restore_request(self._admission, path, self.params_hash,
                                    self.config.kv_cache_dtype)
        self._enqueue([r], block=True)
        return self._handle(r)

    # -- the engine -------------------------------------------------------------------------------

    def warmup(self, max_prompt_len: int = 64) -> int:
        """Compile every shape the engine can meet for prompts up to `max_prompt_len`
        (`runner.warmup_shapes`). Returns the compilations. With a step hook, call it
        before the first request (the op must not interleave with the engine thread's)."""
        return self._core.runner.warmup(max_prompt_len, self.logprobs_k, self.kv.chunk)

    def update_params(self, params: Any, *, params_hash: Optional[str] = None,
                      timeout: float = 600.0) -> None:
        """Swap the engine's weights between steps, without a restart or a recompile (contract
        R4, engine/weights.py): `params` must match the current tree, shapes, dtypes, weak
        types and shardings (else a ValueError naming `params`, and the engine keeps its
        weights). Requests queued or running finish on the old weights (this call waits for
        them, up to `timeout`; submissions made meanwhile wait and run on the new ones); the
        prefix cache is forgotten, and records name the weights each request ran on. A
        speculative draft keeps its own weights. `params_hash`: the new weights' content hash
        when the caller knows it."""
        if self.step_hook is not None:
            raise ValueError("params: update_params is not supported with a step hook (the "
                             "followers of serve --distributed hold their own weights)")
        weights.check_compatible(self.params, params)
        weights.swap(self, params, params_hash, timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the engine thread, waiting up to `timeout` seconds for it (a step that is running,
        or compiling, finishes first); requests still queued or running end CANCELLED."""
        self._scheduler.close()
        self._core.join(timeout)

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def health(self) -> dict:
        """{"status": "ok" | "degraded" | "closed", "reason": ...}: degraded from a failed step
        (reason: its error) until a step succeeds again."""
        return self._core.health(self._scheduler.closed)

    @property
    def error(self) -> Optional[str]:
        """The last engine failure (a failed step or beam call), or None."""
        return self._core.error

    def speculative_stats(self) -> dict:
        """Acceptance counters over every processed speculative round (backend.py). ValueError
        when the engine is not speculative."""
        if self._spec is None:
            raise ValueError("speculative: this engine was built without speculative=")
        return self._core.backend.stats()

    def kv_stats(self) -> dict:
        """KV pages (total, used) and prefix-cache counters in tokens (pages.PagePool.stats)."""
        return self._scheduler.pool.stats()

    @property
    def num_waiting(self) -> int:
        return self._scheduler.num_waiting

    @property
    def num_running(self) -> int:
        return self._scheduler.num_running

    # -- reproducibility (contract §11) ---------------------------------------------------------------

    @property
    def params_hash(self) -> str:
        return self._records.params_hash

    @property
    def tokenizer_hash(self) -> str:
        return self._records.tokenizer_hash

    @property
    def model_snapshot(self) -> str:
        return self._records.model_snapshot

    @property
    def processor_order(self) -> Optional[tuple]:
        """The processing stages with the engine's custom processors (None without them)."""
        return self._records.processor_order
