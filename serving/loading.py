"""Model loading from command-line flags, shared by the `jaxdecode` command and the server
(serving/server.py): `--model`, the `--speculative` flags, and engine errors reported with the
flag that set the field.

It lives in `serving`, the lower of the two applications: the command imports `serving`, which
imports `models` and `jaxdecode` (docs/architecture.md), so both use this module without a
cycle, `serving` never imports the command's package, and nothing in `jaxdecode` outside the
command imports `models`. `models` is imported inside the functions (cheap to import).
"""

from __future__ import annotations

import os
from typing import Any, Optional


def load_model(spec: str, dtype: Optional[str] = None, quantization: Optional[str] = None):
    """(model, params, tokenizer) from "demo" or a local Hugging Face directory, with int8
    weights for `quantization` "int8" (contract §12, weight quantization)."""
    import models

    try:
        if spec == "demo":
            return models.demo(quantization=quantization)
        if not os.path.isdir(spec):
            raise SystemExit(f"--model: {spec!r} is neither 'demo' nor a checkpoint directory")
        return models.load(spec, dtype=dtype, quantization=quantization)
    except ValueError as e:
        if str(e).startswith("quantization:"):
            raise SystemExit(f"--quantization: {e}")
        raise


# the engine's `speculative=` fields (SpeculativeConfig.parse errors) -> the flags setting them
SPECULATIVE_FLAGS = {"speculative": "--speculative", "speculative.draft": "--speculative",
                     "speculative.k": "--num-speculative-tokens",
                     "speculative.ngram_max": "--ngram-max", "speculative.ngram_min": "--ngram-min"}


def flag_error(e: ValueError) -> SystemExit:
    """An engine or SamplingParams ValueError ("field: ...") as an exit naming the flag."""
    field = str(e).split(":")[0]
    return SystemExit(f"{SPECULATIVE_FLAGS.get(field, '--' + field.replace('_', '-'))}: {e}")


def _vocab(tokenizer) -> Optional[dict]:
    return None if tokenizer is None else tokenizer.get_vocab()


def speculative_from_args(args, model, tokenizer) -> tuple[Optional[dict], Optional[dict]]:
    """(the engine's `speculative=` option, the setting to report) from --speculative,
    --num-speculative-tokens, --ngram-max, --ngram-min; (None, None) without --speculative.
    The engine validates the numbers (errors mapped to the flags by `flag_error`)."""
    spec = args.speculative
    if spec is None:
        for flag in ("num_speculative_tokens", "ngram_max", "ngram_min"):
            if getattr(args, flag) is not None:
                raise SystemExit(f"--{flag.replace('_', '-')}: needs --speculative")
        return None, None
    setting = {"draft": spec, "k": 4 if args.num_speculative_tokens is None
               else args.num_speculative_tokens}
    if spec == "prompt_lookup":
        setting.update(ngram_max=3 if args.ngram_max is None else args.ngram_max,
                       ngram_min=1 if args.ngram_min is None else args.ngram_min)
        return dict(setting), setting
    for flag in ("ngram_max", "ngram_min"):
        if getattr(args, flag) is not None:
            raise SystemExit(f"--{flag.replace('_', '-')}: only with --speculative prompt_lookup")
    import models

    if spec == "demo-draft":
        draft, draft_params, draft_tokenizer = models.demo("draft")
    elif os.path.isdir(spec):
        try:
            draft, draft_params, draft_tokenizer = models.load(spec)
        except models.CheckpointError as e:
            raise SystemExit(f"--speculative: {e}")
    else:
        raise SystemExit(f"--speculative: {spec!r} is neither 'prompt_lookup', 'demo-draft' nor "
                         "a checkpoint directory")
    if draft.config.vocab_size != model.config.vocab_size:
        raise SystemExit(f"--speculative: the draft {spec!r} has {draft.config.vocab_size} "
                         f"token ids, the target {model.config.vocab_size}; a draft must share "
                         "the target's tokenizer")
    vocab, draft_vocab = _vocab(tokenizer), _vocab(draft_tokenizer)
    if None not in (vocab, draft_vocab) and vocab != draft_vocab:
        raise SystemExit(f"--speculative: the draft {spec!r} has another tokenizer than the "
                         "target; a draft must share the target's vocabulary")
    return dict(setting, draft=(draft, draft_params)), setting


def add_batch_invariance_argument(p: Any) -> None:
    """`generate`, `serve` and `bench`: the fast path (docs/batch_invariance.md, rule X1)."""
    p.add_argument("--no-batch-invariant", dest="batch_invariant", action="store_false",
                   help="XLA's plain products, reductions and attention: faster, but a row's "
                        "tokens may then depend on the batch it runs in (records say so, and "
                        "replay of such a record warns when it diverges)")


def add_quantization_argument(p: Any) -> None:
    """`generate`, `serve` and `bench`: int8 weights (contract §12, weight quantization)."""
    p.add_argument("--quantization", default=None, choices=("int8",),
                   help="load the weights as int8 with a scale per output channel (weight-only; "
                        "products dequantize in the step; records pin it, replay rebuilds it)")


def add_kv_cache_dtype_argument(p: Any) -> None:
    """`generate`, `serve` and `bench`: the KV cache's dtype (contract §12, KV cache
    quantization)."""
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "int8"),
                   help="int8: keys and values as int8 with a scale per (token, kv head), "
                        "about half the bytes of bf16 (auto: the weights' dtype; records pin "
                        "it, replay rebuilds it)")


def add_speculative_arguments(p: Any) -> None:
    """`generate` and `serve`: speculative decoding (contract §10, docs/decoding.md)."""
    p.add_argument("--speculative", default=None, metavar="prompt_lookup|demo-draft|DIR",
                   help="speculative decoding with this drafter: 'prompt_lookup' (n-grams of "
                        "the prompt and output), 'demo-draft' (the demo model's draft) or a "
                        "local HF checkpoint directory sharing the model's tokenizer")
    p.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K",
                   help="tokens proposed per round (default 4; with --speculative)")
    p.add_argument("--ngram-max", type=int, default=None,
                   help="longest n-gram matched (default 3; with --speculative prompt_lookup)")
    p.add_argument("--ngram-min", type=int, default=None,
                   help="shortest n-gram matched (default 1; with --speculative prompt_lookup)")
