"""Reproducible generation (contract §11): records, replay, and the first divergent step.

A `GenerationRecord` is a versioned JSON document (`"format": "jaxdecode.record/1"`) pinning
everything a request's output depends on: content hashes of the weights and the tokenizer,
the prompt (text, bytes hash, ids), the processor order, every `SamplingParams` field (the keys
of `"sampling"` are exactly its field names), the RNG (implementation, seed, the key actually
used and its per-step derivation `fold_in(key, t)`), jax/jaxlib versions, backend, device
kind and the XLA options the decoder compiled with (`numerics.compiler_options`: which CPU
product library made the bits), the engine layout (slots, cache length, prompt bucket), the stop and detokenization rules,
and the output (token ids, a hash of the returned bytes, finish reason, usage).

`replay(record, llm)` re-runs it and compares token ids, then bytes. It names every difference
of environment (backend, versions, PRNG, model or tokenizer hash) before comparing, and on a
mismatch reports the first divergent step (1-based) with both tokens and their raw logits and
processed probabilities at that step (recomputed from the prompt plus the common prefix).

Batch invariance (contract X1, docs/batch_invariance.md): a seeded request's tokens do not depend
on its slot, its neighbours or `max_slots`. The record says how far that holds for the run that
made it: `"batch_invariance": {"mode", "backend", "bitwise"}` (`numerics.guarantee`; bitwise
True for a batch-invariant model on a backend the suite checks, XLA:CPU; `row_tile`, the rows
per weight-product tile it holds for, compared on replay). Records written
before the field existed load unchanged (the key is then absent). The prompt bucket depends
on the prompt alone and is pinned in the record.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import time
from typing import Any, Optional

import jax
import numpy as np

from jaxdecode.config import SamplingParams
from jaxdecode.device import numerics
from jaxdecode.device.processors import PROCESSOR_ORDER
from jaxdecode.host.stop import STOP_RULE_VERSION
from jaxdecode.model_api import params_quantization

RECORD_FORMAT = "jaxdecode.record/1"


def params_hash(params: Any) -> str:
    """sha256 over every parameter's path, dtype, shape and bytes."""
    h = hashlib.sha256()
    for path, leaf in sorted(jax.tree_util.tree_flatten_with_path(params)[0],
                             key=lambda kv: jax.tree_util.keystr(kv[0])):
        arr = np.asarray(leaf)
        h.update(f"{jax.tree_util.keystr(path)}|{arr.dtype}|{arr.shape}|".encode())
        h.update(np.ascontiguousarray(arr).tobytes())
    return h.hexdigest()


def tokenizer_hash(tokenizer: Any) -> str:
    """sha256 of the tokenizer's serialized form (tokenizer.json)."""
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    text = backend.to_str() if hasattr(backend, "to_str") else repr(sorted(
        tokenizer.get_vocab().items()))
    return hashlib.sha256(text.encode()).hexdigest()


def environment() -> dict:
    dev = jax.devices()[0]
    return {"jax": jax.__version__, "jaxlib": getattr(jax.lib, "__version__", jax.__version__),
            "backend": jax.default_backend(), "device_kind": dev.device_kind,
            "prng_impl": str(jax.config.jax_default_prng_impl),
            "compiler_options": numerics.compiler_options()}


def sampling_to_json(sp: SamplingParams) -> dict:
    out = dataclasses.asdict(sp)
    out["logit_bias"] = {str(k): v for k, v in sp.logit_bias.items()}
    out["stop"] = list(sp.stop)
    out["banned_token_ids"] = list(sp.banned_token_ids)
    out["stop_token_ids"] = [list(x) if isinstance(x, tuple) else x for x in sp.stop_token_ids]
    return out


def sampling_from_json(d: dict) -> SamplingParams:
    d = dict(d)
    d["stop_token_ids"] = tuple(tuple(x) if isinstance(x, list) else x
                                for x in d.get("stop_token_ids", ()))
    return SamplingParams(**d)


@dataclasses.dataclass
class GenerationRecord:
    """contract §11 replay record; `data` is the JSON document (see the module docstring)."""

    data: dict

    def to_json(self, indent: Optional[int] = 2) -> str:
        return json.dumps(self.data, indent=indent, ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str) -> "GenerationRecord":
        data = json.loads(text)
        if data.get("format") != RECORD_FORMAT:
            raise ValueError(f"format: expected {RECORD_FORMAT!r}, got {data.get('format')!r}")
        return cls(data)

    def save(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.to_json())

    @classmethod
    def load(cls, path: str) -> "GenerationRecord":
        with open(path, encoding="utf-8") as f:
            return cls.from_json(f.read())

    @property
    def sampling(self) -> SamplingParams:
        return sampling_from_json(self.data["sampling"])

    @property
    def prompt_ids(self) -> list[int]:
        return list(self.data["prompt"]["ids"])

    @property
    def token_ids(self) -> list[int]:
        return list(self.data["output"]["token_ids"])


def build_record(*, model_hash: str, model_config: Any, model_source: Optional[str],
                 tokenizer_hash_: str, prompt_text: Optional[str], prompt_ids: list,
                 sampling: SamplingParams, seed: int, key_data: np.ndarray, sample_index: int,
                 layout: dict, detokenizer_mode: str, token_ids: list, text: str,
                 finish_reason: Optional[str], error: Optional[str], usage: dict,
                 messages: Optional[list] = None, chat_template_hash: Optional[str] = None,
                 processors: Optional[tuple] = None,
                 batch_invariance: Optional[dict] = None,
                 quantization: Optional[str] = None,
                 lora: Optional[dict] = None) -> GenerationRecord:
    """The record of one request; `processors`: the stage order with custom processors
    (jaxdecode/device/research.py), recorded only when there are some; `lora`: the LoRA
    adapter it ran with ({"name", "hash"}, contract R7), recorded only when it had one."""
    prompt = {"ids": list(prompt_ids), "text": prompt_text,
              "bytes_b64": (base64.b64encode(prompt_text.encode()).decode()
                            if prompt_text is not None else None),
              "messages": messages, "chat_template_hash": chat_template_hash}
    record = GenerationRecord({
        "format": RECORD_FORMAT,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "processor_order": PROCESSOR_ORDER,
        "model": {"hash": model_hash, "source": model_source, "quantization": quantization,
                  "class": type(model_config).__name__, "config": repr(model_config)},
        "tokenizer": {"hash": tokenizer_hash_},
        "prompt": prompt,
        "sampling": sampling_to_json(sampling),
        "rng": {"impl": str(jax.config.jax_default_prng_impl), "seed": seed,
                "sample_index": sample_index, "key_data": [int(x) for x in key_data],
                "step_key": "fold_in(key, t), t = 1, 2, ... (1-based step)",
                "sampler": "inverse CDF, one uniform per row and step"},
        "environment": environment(),
        "layout": dict(layout, mesh=None),
        "batch_invariance": batch_invariance,
        "rules": {"stop": STOP_RULE_VERSION, "detokenizer": detokenizer_mode,
                  "utf8_errors": sampling.utf8_errors,
                  "skip_special_tokens": sampling.skip_special_tokens},
        "output": {"token_ids": list(token_ids),
                   "text_sha256": hashlib.sha256(text.encode()).hexdigest(),
                   "finish_reason": finish_reason, "error": error, "usage": usage},
    })
    if processors is not None:
        record.data["processors"] = list(processors)
    if lora is not None:
        record.data["model"]["lora"] = dict(lora)
    return record


@dataclasses.dataclass
class ReplayReport:
    """What `replay` found. `first_divergence` is a 1-based step (None when identical)."""

    identical: bool
    completion: Any
    environment_differences: list
    first_divergence: Optional[int] = None
    expected_token: Optional[int] = None
    actual_token: Optional[int] = None
    details: Optional[dict] = None
    bytes_differ: bool = False
    recorded_mode: Optional[str] = None  # the record's batch_invariance.mode (None: absent)

    def describe(self) -> str:
        lines = [f"environment differs: {d}" for d in self.environment_differences]
        if self.identical:
            lines.append("identical: same token ids and bytes")
        elif self.first_divergence is not None:
            lines.append(f"first divergence at step {self.first_divergence}: recorded token "
                         f"{self.expected_token}, replayed token {self.actual_token}")
            if self.details:
                for who in ("recorded", "replayed"):
                    d = self.details.get(who)
                    if d:
                        lines.append(f"  {who} token {d['token']}: logit {d['logit']:.4f}, "
                                     f"probability after processors {d['probability']:.4g}")
            if self.recorded_mode == "none":
                lines.append("the original ran without batch invariance (batch_invariant="
                             "False): its tokens could depend on the other requests in its "
                             "batch, so a replay may diverge (docs/batch_invariance.md)")
        elif self.bytes_differ:
            lines.append("same token ids but the returned bytes differ")
        return "\n".join(lines)


def environment_differences(record: GenerationRecord, llm: Any) -> list:
    out = []
    now = environment()
    for key, was in record.data.get("environment", {}).items():
        if now.get(key) != was:
            out.append(f"{key}: recorded {was!r}, now {now.get(key)!r}")
    if record.data["model"]["hash"] != llm.params_hash:
        out.append("model: weights differ from the recorded snapshot hash")
    was_q, now_q = record.data["model"].get("quantization"), params_quantization(llm.params)
    if was_q != now_q:
        out.append(f"quantization: recorded {was_q!r}, now {now_q!r} (load the model with "
                   "quantization= as recorded)")
    out.extend(lora_differences(record, llm))
    was_kv = record.data.get("layout", {}).get("kv_cache_dtype", "auto")
    now_kv = getattr(getattr(llm, "config", None), "kv_cache_dtype", "auto")
    if was_kv != now_kv:
        out.append(f"kv_cache_dtype: recorded {was_kv!r}, now {now_kv!r} (replay with "
                   "LLM(kv_cache_dtype=...) as recorded)")
    if record.data["tokenizer"]["hash"] != llm.tokenizer_hash:
        out.append("tokenizer: differs from the recorded snapshot hash")
    was, now = (record.data.get("batch_invariance") or {},
                numerics.guarantee(llm.model, jax.default_backend()))
    if "mode" in was and was["mode"] != now["mode"]:
        out.append(f"batch_invariance: recorded {was['mode']!r}, now {now['mode']!r} (replay "
                   "with LLM(batch_invariant=...) as recorded)")
    was_tile, now_tile = was.get("row_tile"), now.get("row_tile")
    if was_tile is not None and was_tile != now_tile:
        out.append(f"row_tile: recorded {was_tile}, now {now_tile} (a row's bits hold for one "
                   "tile; replay with LLM(row_tile=...) as recorded)")
    now_processors = getattr(llm, "processor_order", None)
    was_processors = record.data.get("processors")
    if (list(now_processors) if now_processors else None) != was_processors:
        out.append(f"processors: recorded {was_processors!r}, now {now_processors!r}")
    return out


def lora_differences(record: GenerationRecord, llm: Any) -> list:
    """The record's LoRA adapter (contract R7; the replay selects it by name, `sampling.lora`)
    against the engine's adapter of that name: missing, or other weights."""
    was = record.data["model"].get("lora")
    if was is None:
        return []
    hashes = getattr(getattr(llm, "adapters", None), "hashes", None) or {}
    if was["name"] not in hashes:
        return [f"lora: the record ran with adapter {was['name']!r}, which the engine has not "
                "loaded (LLM(lora_modules=...))"]
    if hashes[was["name"]] != was["hash"]:
        return [f"lora: adapter {was['name']!r} holds other weights than the recorded ones"]
    return []


def divergence_details(llm: Any, record: GenerationRecord, step: int, actual: list) -> dict:
    """Raw logits and processed probabilities of both tokens at a divergent step."""
    from jaxdecode.device import decode
    from jaxdecode.device.processors import process_logits

    sp = record.sampling
    prefix = record.token_ids[:step - 1]
    state, _, _ = decode.prepare(llm.model, llm.params, [record.prompt_ids + prefix],
                                 SamplingParams(max_tokens=1), None, None)
    logits = np.asarray(state.logits)
    history = np.array([prefix if prefix else [-1]], np.int32)
    logprobs = np.asarray(process_logits(logits, dataclasses.replace(sp, n=1),
                                         output_ids=history))
    def info(token):
        if token is None or not 0 <= token < logits.shape[-1]:
            return None
        return {"token": int(token), "logit": float(logits[0, token]),
                "probability": float(np.exp(logprobs[0, token]))}
    expected = record.token_ids[step - 1] if step - 1 < len(record.token_ids) else None
    got = actual[step - 1] if step - 1 < len(actual) else None
    return {"recorded": info(expected), "replayed": info(got)}


def replay(record: GenerationRecord, llm: Any, *,
           allow_params_mismatch: bool = False) -> ReplayReport:
    """Re-run `record` on `llm` and compare (docs/architecture.md `jd.replay`). A record made
    with other weights than the engine holds (its `model.hash`, the weights the request ran on:
    contract R4) is refused with a ValueError naming `record`, unless `allow_params_mismatch`
    (then the difference is listed in `environment_differences`)."""
    if isinstance(record, (str, bytes)):
        record = GenerationRecord.from_json(record)
    if not allow_params_mismatch and record.data["model"]["hash"] != llm.params_hash:
        raise ValueError(f"record: made with weights {record.data['model']['hash'][:16]}, the "
                         f"engine holds {llm.params_hash[:16]} (a replay would compare other "
                         "weights' tokens; replay(..., allow_params_mismatch=True) runs it "
                         "anyway)")
    env = environment_differences(record, llm)
    completion = llm.run_record(record)
    expected, actual = record.token_ids, list(completion.token_ids)
    if expected == actual:
        same_bytes = (hashlib.sha256(completion.text.encode()).hexdigest()
                      == record.data["output"]["text_sha256"])
        return ReplayReport(identical=same_bytes, completion=completion,
                            environment_differences=env, bytes_differ=not same_bytes)
    step = next((i + 1 for i, (a, b) in enumerate(zip(expected, actual)) if a != b),
                min(len(expected), len(actual)) + 1)
    return ReplayReport(
        identical=False, completion=completion, environment_differences=env,
        first_divergence=step,
        recorded_mode=(record.data.get("batch_invariance") or {}).get("mode"),
        expected_token=expected[step - 1] if step - 1 < len(expected) else None,
        actual_token=actual[step - 1] if step - 1 < len(actual) else None,
        details=divergence_details(llm, record, step, actual))
