"""The embedded demo models: a small Llama trained on Python source, and a smaller draft model.

Both share one byte-level BPE tokenizer (`tokenizer.json`, 4096 tokens, `<|endoftext|>` = id 0)
and were trained on CPU by `scripts/train_demo.py` (see MODEL_CARD.md; the measured held-out
loss and training record of each model are in `main.json` / `draft.json` under "training").

    model, params, tokenizer = load()              # the main demo model (= models.demo())
    draft, draft_params, _ = load("draft")         # same tokenizer, for speculative decoding

Files: `tokenizer.json`; `<kind>.safetensors` (flat names `embed`, `final_norm`, `layers.0.q`,
...; tied embeddings, so no `lm_head`); `<kind>.json` (LlamaConfig fields + "training").
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional

DEMO_DIR = os.path.dirname(os.path.abspath(__file__))
KINDS = ("main", "draft")
EOT = "<|endoftext|>"


def load_tokenizer(directory: Optional[str] = None):
    """The demo `tokenizers.Tokenizer`."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(os.path.join(directory or DEMO_DIR, "tokenizer.json"))


def load_config(kind: str = "main", directory: Optional[str] = None) -> dict:
    """The raw `<kind>.json` (LlamaConfig fields plus the "training" record)."""
    if kind not in KINDS:
        raise ValueError(f"kind: expected one of {KINDS}, got {kind!r}")
    with open(os.path.join(directory or DEMO_DIR, f"{kind}.json")) as f:
        return json.load(f)


def _unflatten(flat: dict, num_layers: int, dtype: Any) -> dict:
    """The nested parameter tree of host arrays cast to `dtype`."""
    import numpy as np

    params: dict = {"layers": [dict() for _ in range(num_layers)]}
    for name, arr in flat.items():
        value = np.asarray(arr, dtype)
        if name.startswith("layers."):
            _, i, leaf = name.split(".", 2)
            params["layers"][int(i)][leaf] = value
        else:
            params[name] = value
    return params


def load(kind: str = "main", directory: Optional[str] = None, dtype: Any = None,
         quantization: Optional[str] = None):
    """Returns `(model, params, tokenizer)` for the shipped `kind` ("main" or "draft").

    The model is a `models.llama.Llama` whose `eos_token_ids` is the tokenizer's `<|endoftext|>`.
    `directory` defaults to this package's folder (a training run's `--out` also works).
    `quantization` "int8": int8 linear weights and head (models/quantization.py, contract §12).
    """
    from models import quantization as quantize

    quantize.check(quantization)
    import dataclasses

    import jax.numpy as jnp
    from safetensors.numpy import load_file

    from models.llama import Llama, LlamaConfig

    directory = directory or DEMO_DIR
    raw = load_config(kind, directory)
    tokenizer = load_tokenizer(directory)
    eot = tokenizer.token_to_id(EOT)
    if eot is None:
        raise ValueError(f"{directory}/tokenizer.json has no {EOT} token")
    fields = {f.name for f in dataclasses.fields(LlamaConfig)}
    kwargs = {k: v for k, v in raw.items() if k in fields}
    kwargs["eos_token_ids"] = (eot,)
    kwargs["rope_scaling"] = tuple(tuple(x) for x in kwargs.get("rope_scaling", ()))
    config = LlamaConfig(**kwargs)
    flat = load_file(os.path.join(directory, f"{kind}.safetensors"))
    params = _unflatten(flat, config.num_layers, dtype or jnp.float32)
    params = quantize.to_device(params, quantization, config.tie_word_embeddings)
    return Llama(config), params, tokenizer

