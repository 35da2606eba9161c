"""`jaxdecode bench --quality`: what int8 weights cost the embedded demo model (contract §12,
weight quantization) -- its held-out loss in float and int8 on its validation text, and how
often the two pick the same first greedy token over `PROMPTS`.

The validation text is the demo model's own held-out split, rebuilt by the script that trained
it (scripts/train_demo.py: the standard-library files with sha1(path) % 100 < 2, each followed
by `<|endoftext|>`), cut into non-overlapping windows of its training context, scored as the
script scores it (mean next-token negative log-likelihood, nats/token).
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


def held_out_loss(model, params, ids: np.ndarray, ctx: int, batch: int = 8) -> float:
    """Mean next-token NLL (nats/token) over the non-overlapping windows of `ctx` + 1 tokens."""
    import jax
    import jax.numpy as jnp

    windows = max(1, (len(ids) - 1) // ctx)
    x = np.stack([ids[i * ctx:(i + 1) * ctx] for i in range(windows)]).astype(np.int32)
    y = np.stack([ids[i * ctx + 1:(i + 1) * ctx + 1] for i in range(windows)]).astype(np.int32)

    @jax.jit
    def window_nll(p, xs, ys):  # [batch] sums of one batch of windows
        logp = jax.nn.log_softmax(model.logits(p, xs), axis=-1)
        return -jnp.sum(jnp.take_along_axis(logp, ys[..., None], axis=-1)[..., 0], axis=-1)

    total = 0.0
    for i in range(0, windows, batch):
        real = min(batch, windows - i)  # one shape: the last batch padded with zero windows
        xs, ys = (np.pad(a[i:i + real], ((0, batch - real), (0, 0))) for a in (x, y))
        total += float(np.sum(np.asarray(window_nll(params, xs, ys))[:real]))
    return total / (windows * ctx)


def first_greedy_tokens(model, params, tokenizer, prompts=PROMPTS) -> list[int]:
    """The argmax of the logits after each prompt (its first greedy token), all prompts in one
    causal forward, right-padded (padding after a prompt's last token never reaches it)."""
    import jax
    import jax.numpy as jnp

    encoded = [tokenizer.encode(prompt).ids for prompt in prompts]
    width = max(len(ids) for ids in encoded)
    tokens = np.asarray([ids + [0] * (width - len(ids)) for ids in encoded], np.int32)
    last = np.asarray([len(ids) - 1 for ids in encoded], np.int32)
    logits = jax.jit(model.logits)(params, jnp.asarray(tokens))
    return [int(t) for t in jnp.argmax(logits[np.arange(len(prompts)), last], axis=-1)]


def run(quick: bool = False) -> dict:
    """Float against int8 weights on the demo model: held-out loss (all of the held-out text;
    its first 4096 tokens with `quick`) and first-token greedy agreement over PROMPTS."""
    import models
    from models.demo import load_config

    model, params, tokenizer = models.demo()
    qmodel, qparams, _ = models.demo(quantization="int8")
    ctx = int(load_config("main")["training"]["ctx"])
    ids = held_out_ids(tokenizer, 4096 if quick else None)
    loss = {"float": held_out_loss(model, params, ids, ctx),
            "int8": held_out_loss(qmodel, qparams, ids, ctx)}
    want = first_greedy_tokens(model, params, tokenizer)
    got = first_greedy_tokens(qmodel, qparams, tokenizer)
    return {"model": "demo", "held_out_tokens": int(len(ids)), "ctx": ctx,
            "loss_nats_per_token": loss, "loss_increase": loss["int8"] - loss["float"],
            "first_token_agreement": sum(a == b for a, b in zip(want, got)),
            "prompts": len(PROMPTS)}


def format_quality(report: dict) -> str:
    loss = report["loss_nats_per_token"]
    return "\n".join([
        f"quality of int8 weights on the demo model ({report['held_out_tokens']} held-out "
        f"tokens, windows of {report['ctx']}):",
        "| weights | held-out loss (nats/token) |", "|---|---:|",
        f"| float32 | {loss['float']:.4f} |", f"| int8 | {loss['int8']:.4f} |",
        f"loss increase {report['loss_increase']:+.4f} nats/token; first greedy token agrees "
        f"on {report['first_token_agreement']}/{report['prompts']} prompts"])
