"""`LLM.update_params`: new weights between steps, without a restart and without a recompile
(contract R4; docs/research.md "The RL loop").

The new tree must be the engine's exactly -- structure, shapes, dtypes, weak types and
shardings -- so every compiled program takes it as it is; anything else is a ValueError naming
`params` and the engine keeps serving on its weights.

In-flight policy: a request runs wholly on one set of weights, the one in place when it was
queued. `swap` holds new submissions (they wait, then queue behind the swap), waits until
every request queued or running has ended on the old weights, swaps on the engine thread at a
safe point (the runner's context and backend, the records' hash, the prefix cache forgotten:
no page computed with other weights is ever served), then lets the held submissions in. A
request paused by its user holds the swap until it ends; past `timeout` the swap is abandoned
(TimeoutError) and the old weights stay.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import jax
import numpy as np

from jaxdecode.engine.scheduler import EngineClosed


def committed(params: Any, like: Any = None) -> Any:
    """`params` with every jax array committed to its placement (to `like`'s leaf's sharding
    when given): jit keys its programs on committed placements, so an uncommitted tree and a
    committed one (an optimizer's output, a `device_put`) would compile apart. An array already
    there is aliased, not copied."""
    def place(leaf, old):
        return jax.device_put(leaf, old.sharding) if isinstance(old, jax.Array) else leaf
    return jax.tree.map(place, params, params if like is None else like)


def with_adapters(params: Any, adapters: Any) -> Any:
    """The weights the engine's programs take: `params`, with the LoRA stack of `adapters`
    (engine/adapters.py) when there is one, committed."""
    return params if adapters is None else committed(adapters.attach(params))


def check_compatible(current: Any, new: Any) -> None:
    """ValueError naming `params` unless `new` has `current`'s tree structure and, leaf by
    leaf, its shape, dtype, weak type and sharding (what the compiled programs were built
    for; a host array is placed like the engine's leaf)."""
    if jax.tree.structure(new) != jax.tree.structure(current):
        raise ValueError(f"params: the tree structure differs from the engine's weights "
                         f"({len(jax.tree.leaves(new))} leaves, the engine's "
                         f"{len(jax.tree.leaves(current))})")
    paths = jax.tree_util.tree_flatten_with_path(current)[0]
    for (path, old), leaf in zip(paths, jax.tree.leaves(new)):
        where = jax.tree_util.keystr(path)
        if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
            raise ValueError(f"params: {where} is a {type(leaf).__name__}, not an array")
        if tuple(leaf.shape) != tuple(old.shape) or np.dtype(leaf.dtype) != np.dtype(old.dtype):
            raise ValueError(f"params: {where} is {np.dtype(leaf.dtype)}{list(leaf.shape)}, the "
                             f"engine's is {np.dtype(old.dtype)}{list(old.shape)}")
        if getattr(leaf, "weak_type", False) != getattr(old, "weak_type", False):
            raise ValueError(f"params: {where} differs from the engine's in its weak type")
        if (isinstance(old, jax.Array) and isinstance(leaf, jax.Array)
                and not leaf.sharding.is_equivalent_to(old.sharding, old.ndim)):
            raise ValueError(f"params: {where} is placed as {leaf.sharding}, the engine's as "
                             f"{old.sharding} (jax.device_put it like the engine's weights)")


def swap(llm: Any, params: Any, params_hash: Optional[str], timeout: float) -> None:
    """The in-flight policy of the module docstring, then the swap on the engine thread."""
    scheduler, core = llm._scheduler, llm._core
    params = committed(params, llm.params)
    deadline = time.monotonic() + timeout
    with scheduler.cond:
        if scheduler.closed:
            raise EngineClosed("the engine is closed")
        if scheduler.holding:
            raise ValueError("params: another update_params is in progress")
        scheduler.holding = True
    try:
        with scheduler.cond:
            while not scheduler.idle():
                if scheduler.closed:
                    raise EngineClosed("the engine is closed")
                if time.monotonic() > deadline:
                    raise TimeoutError("params: requests still running after timeout; the "
                                       "engine keeps its weights")
                scheduler.cond.wait(0.01)

        def on_engine_thread() -> None:
            core.runner.swap_params(with_adapters(params, llm.adapters))
            scheduler.pool.forget_prefixes()
            llm._records.swap(params, params_hash)
            llm.params = params

        core.on_thread(on_engine_thread, max(1.0, deadline - time.monotonic()))
    finally:
        with scheduler.cond:
            scheduler.holding = False
            scheduler.cond.notify_all()
