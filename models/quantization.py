"""Weight-only int8 (`models.load(..., quantization="int8")`, `models.demo(quantization=...)`;
docs/contract.md §12, weight quantization): every linear weight becomes a `qwix.QArray` -- int8
values and one absmax scale per output channel -- and the products dequantize it inside the
step.

Which weights: the attention and MLP projections (`LINEAR`), the output head (`lm_head`) and,
where the head is tied to it, the embedding, with one scale per vocabulary row (its output
channel as the head; a lookup dequantizes the rows it reads: `embed_rows`). An untied
embedding, the norms, biases and position tables stay float.

Loading hands `to_device` a tree of host (numpy) arrays; each weight goes to the device alone
and is quantized there by `qwix.quantize` (absmax, symmetric), so the float model is never on
the device as a whole. The products are `qwix.dot_general` (`weight_product`): with float
activations it dequantizes the weight (q * scale, in the scale's dtype) and runs a float
product of the same shape, so the row tiles of `jaxdecode.invariance.dense` keep X1; the
dequantized weight is a temporary of that step, never a parameter.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
import qwix

Array = jax.Array

QUANTIZATIONS = ("int8",)
# leaf names of the families' weight matrices [K, N] (x @ w): one scale per column
LINEAR = frozenset({"q", "k", "v", "o", "gate", "up", "down", "fc", "proj", "lm_head"})


def check(quantization: Any) -> Optional[str]:
    """`quantization` if it is None or one of QUANTIZATIONS, else ValueError naming it."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization: expected None or one of {QUANTIZATIONS}, got "
                         f"{quantization!r}")
    return quantization


def is_quantized(w: Any) -> bool:
    return isinstance(w, qwix.QArray)


def quantize_int8(w: Any, channel_axis: int) -> qwix.QArray:
    """`w` (host or device array) as int8 with an absmax scale per index of `channel_axis`,
    scale in `w`'s dtype."""
    return qwix.quantize(jnp.asarray(w), jnp.int8, channelwise_axes=(channel_axis,))


def to_device(host: dict, quantization: Optional[str], tied: bool) -> dict:
    """The parameter tree `host` (numpy leaves) on the device, leaf by leaf; with
    `quantization` "int8" the linear weights (and a `tied` embedding) quantized as they go."""
    check(quantization)

    def place(name: str, leaf: Any):
        if quantization == "int8" and name in LINEAR:
            return quantize_int8(leaf, 1)
        if quantization == "int8" and name == "embed" and tied:
            return quantize_int8(leaf, 0)
        return jnp.asarray(leaf)

    def walk(tree: Any, name: str = ""):
        if isinstance(tree, dict):
            return {k: walk(v, k) for k, v in tree.items()}
        if isinstance(tree, list):
            return [walk(v) for v in tree]
        return place(name, tree)

    return walk(host)


def quantize_params(params: dict, quantization: Optional[str], tied: bool) -> dict:
    """Already-loaded float `params` (e.g. `init_params`) with `to_device`'s quantization."""
    return to_device(params, quantization, tied)


def weight_product(w: Any):
    """The `jax.lax.dot_general` drop-in for weight `w`: qwix's for a QArray, else None (the
    plain product)."""
    return qwix.dot_general if is_quantized(w) else None


def embed_rows(embed: Any, tokens: Array) -> Array:
    """The embedding rows of `tokens`: a lookup, dequantized where `embed` is a QArray."""
    if is_quantized(embed):
        return qwix.dequantize(embed[tokens])
    return embed[tokens]


def param_bytes(params: Any) -> int:
    """Bytes of every array in `params` (int8 values and scales of a QArray included)."""
    return int(sum(x.nbytes for x in jax.tree.leaves(params)))
