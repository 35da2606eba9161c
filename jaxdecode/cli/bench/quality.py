"""`jaxdecode bench --quality`: what int8 weights and the int8 KV cache cost the embedded demo
model (contract §12, weight and KV cache quantization) -- its held-out loss in float, with int8
weights, with the int8 KV cache and with both, on its validation text, and how often each picks
the float model's first greedy token over `PROMPTS`.

The validation text is the demo model's own held-out split, rebuilt by the script that trained
it (scripts/train_demo.py: the standard-library files with sha1(path) % 100 < 2, each followed
by `<|endoftext|>`), cut into non-overlapping windows of its training context, scored as the
script scores it (mean next-token negative log-likelihood, nats/token).

Every figure comes from the cached forward the engine runs (`model.forward` over a page pool,
`PagedKVCache`): each layer writes a window's keys and values into the pool and attention reads
them back from it, so with `kv_cache_dtype="int8"` every query -- the first token's as the
last's -- attends to int8 keys and values with their scales, exactly what a decode step reads
(queries stay float, as in decode). The float figure runs the same path over a float pool.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Optional

import numpy as np

# 16 prompts of the demo model's domain (Python source): definitions, statements, docstrings.
PROMPTS = (
    "def fibonacci(n):", "import os\nimport sys\n", "class Stack:\n    def __init__(self):",
    "for i in range(", "    return", "if __name__ ==", "def read_file(path):\n    with open(",
    "try:\n    import json\nexcept", "    def __repr__(self):\n        return",
    '"""Utilities for', "x = [i * 2 for i in", "raise ValueError(", "while True:\n    line =",
    "@property\ndef name(self):", "from collections import", "    self.assertEqual(",
)


def _train_demo():
    """scripts/train_demo.py (not a package) by path, from the repository holding models/."""
    from models.demo import DEMO_DIR

    path = os.path.abspath(os.path.join(DEMO_DIR, os.pardir, os.pardir, "scripts",
                                        "train_demo.py"))
    if not os.path.exists(path):
        raise SystemExit(f"--quality: {path} (which defines the demo model's held-out split) "
                         "is missing; run from a checkout of the repository")
    spec = importlib.util.spec_from_file_location("_train_demo", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def held_out_ids(tokenizer, max_tokens: Optional[int] = None) -> np.ndarray:
    """The demo model's held-out token stream (its first `max_tokens` where given)."""
    script = _train_demo()
    _, val = script.split_corpus(script.corpus_files())
    ids = script.encode_stream(tokenizer, [text for _, text in val])
    return ids if max_tokens is None else ids[:max_tokens]


def cached_logits(model, params, tokens, lengths, kv_cache_dtype: str = "auto"):
    """Logits f32[B, T, V] of right-padded rows (tokens int32[B, T], real lengths int32[B])
    from one cached forward over a fresh page pool of `kv_cache_dtype` (module docstring)."""
    import jax.numpy as jnp

    from jaxdecode import kv_int8
    from jaxdecode.model_api import PagedKVCache, params_dtype

    c, (b, t), ps = model.config, tokens.shape, 16
    n = -(-t // ps)
    pool = PagedKVCache.zeros(c.num_layers, c.num_kv_heads, b * n + 1, ps, c.head_dim, b, n * ps,
                              kv_int8.pool_dtype(kv_cache_dtype, params_dtype(params)))
    pool = pool.replace(page_table=1 + jnp.arange(b * n, dtype=jnp.int32).reshape(b, n))
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    return model.forward(params, tokens, positions, pool, lengths=lengths, kv_len=n * ps)[0]


def held_out_loss(model, params, ids: np.ndarray, ctx: int, kv_cache_dtype: str = "auto",
                  batch: int = 8) -> float:
    """Mean next-token NLL (nats/token) over the non-overlapping windows of `ctx` + 1 tokens,
    through `cached_logits` with a pool of `kv_cache_dtype`."""
    import jax
    import jax.numpy as jnp

    windows = max(1, (len(ids) - 1) // ctx)
    x = np.stack([ids[i * ctx:(i + 1) * ctx] for i in range(windows)]).astype(np.int32)
    y = np.stack([ids[i * ctx + 1:(i + 1) * ctx + 1] for i in range(windows)]).astype(np.int32)

    @jax.jit
    def window_nll(p, xs, ys):  # [batch] sums of one batch of windows
        lengths = jnp.full((xs.shape[0],), xs.shape[1], jnp.int32)
        logp = jax.nn.log_softmax(cached_logits(model, p, xs, lengths, kv_cache_dtype), axis=-1)
        return -jnp.sum(jnp.take_along_axis(logp, ys[..., None], axis=-1)[..., 0], axis=-1)

    total = 0.0
    for i in range(0, windows, batch):
        real = min(batch, windows - i)  # one shape: the last batch padded with zero windows
        xs, ys = (np.pad(a[i:i + real], ((0, batch - real), (0, 0))) for a in (x, y))
        total += float(np.sum(np.asarray(window_nll(params, xs, ys))[:real]))
    return total / (windows * ctx)


def first_greedy_tokens(model, params, tokenizer, prompts=PROMPTS,
                        kv_cache_dtype: str = "auto") -> list[int]:
    """The argmax of the logits after each prompt (its first greedy token), all prompts in one
    cached forward, right-padded (padding is never written nor read)."""
    import jax
    import jax.numpy as jnp

    encoded = [tokenizer.encode(prompt).ids for prompt in prompts]
    width = max(len(ids) for ids in encoded)
    tokens = np.asarray([ids + [0] * (width - len(ids)) for ids in encoded], np.int32)
    lengths = np.asarray([len(ids) for ids in encoded], np.int32)
    logits = jax.jit(cached_logits, static_argnums=(0, 4))(model, params, jnp.asarray(tokens),
                                                            jnp.asarray(lengths), kv_cache_dtype)
    return [int(t) for t in jnp.argmax(logits[np.arange(len(prompts)), lengths - 1], axis=-1)]


# the report's variants: (name, int8 weights, kv_cache_dtype)
VARIANTS = (("float", False, "auto"), ("int8", True, "auto"), ("int8_kv", False, "int8"),
            ("int8_both", True, "int8"))


def run(quick: bool = False) -> dict:
    """Float against int8 weights, the int8 KV cache and both, on the demo model: held-out loss
    (all of the held-out text; its first 4096 tokens with `quick`) and first-token greedy
    agreement with the float model over PROMPTS."""
    import models
    from models.demo import load_config

    loaded = {False: models.demo()[:2], True: models.demo(quantization="int8")[:2]}
    tokenizer = models.demo()[2]
    ctx = int(load_config("main")["training"]["ctx"])
    ids = held_out_ids(tokenizer, 4096 if quick else None)
    loss, first = {}, {}
    for name, int8_weights, kv in VARIANTS:
        model, params = loaded[int8_weights]
        loss[name] = held_out_loss(model, params, ids, ctx, kv)
        first[name] = first_greedy_tokens(model, params, tokenizer, kv_cache_dtype=kv)
    agree = {name: sum(a == b for a, b in zip(first["float"], first[name]))
             for name, _, _ in VARIANTS[1:]}
    return {"model": "demo", "held_out_tokens": int(len(ids)), "ctx": ctx,
            "loss_nats_per_token": loss, "loss_increase": loss["int8"] - loss["float"],
            "loss_increase_kv": loss["int8_kv"] - loss["float"],
            "loss_increase_both": loss["int8_both"] - loss["float"],
            "first_token_agreement": agree["int8"], "first_token_agreement_kv": agree["int8_kv"],
            "first_token_agreement_both": agree["int8_both"], "prompts": len(PROMPTS)}


def format_quality(report: dict) -> str:
    loss, n = report["loss_nats_per_token"], report["prompts"]
    rows = (("float", "float32", "float32", None, None),
            ("int8", "int8", "float32", "loss_increase", "first_token_agreement"),
            ("int8_kv", "float32", "int8", "loss_increase_kv", "first_token_agreement_kv"),
            ("int8_both", "int8", "int8", "loss_increase_both", "first_token_agreement_both"))
    lines = [f"quality of int8 weights and KV cache on the demo model "
             f"({report['held_out_tokens']} held-out tokens, windows of {report['ctx']}, "
             "keys and values read back from the cache):",
             "| weights | KV cache | held-out loss (nats/token) | increase | first greedy token "
             "agrees |", "|---|---|---:|---:|---:|"]
    for name, weights, kv, increase, agree in rows:
        lines.append(f"| {weights} | {kv} | {loss[name]:.4f} | "
                     f"{'' if increase is None else format(report[increase], '+.4f')} | "
                     f"{'' if agree is None else f'{report[agree]}/{n}'} |")
    return "\n".join(lines)
