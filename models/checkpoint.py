"""Save and restore parameter pytrees with orbax-checkpoint (DESIGN: models/checkpoint.py)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import jax
import orbax.checkpoint as ocp


def _abs(path: str | os.PathLike) -> Path:
    return Path(path).expanduser().resolve()


def save_params(path: str | os.PathLike, params: Any) -> Path:
    """Write `params` (any pytree of arrays) to the directory `path`, replacing what is there.

    Blocks until the checkpoint is complete. Returns the absolute path.
    """
    path = _abs(path)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, params, force=True)
        ckptr.wait_until_finished()
    return path


def restore_params(path: str | os.PathLike, like: Optional[Any] = None) -> Any:
    """Read the params saved at `path`.

    With `like` (a pytree of arrays or `jax.ShapeDtypeStruct`s, e.g. the model's freshly
    initialised params), the result has its structure, shapes, dtypes and shardings, and a
    mismatch raises. Without it, orbax's stored structure is returned as is.
    """
    path = _abs(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no checkpoint there")
    with ocp.StandardCheckpointer() as ckptr:
        target = None
        if like is not None:
            target = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
            _check_matches(path, ckptr.metadata(path), target)
        return ckptr.restore(path, target)


def _check_matches(path: Path, metadata: Any, target: Any) -> None:
    """A clear ValueError naming the first leaf whose presence or shape differs from `like`."""
    stored = getattr(getattr(metadata, "item_metadata", metadata), "tree", None)
    if stored is None:
        return
    have = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(stored)}
    want = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(target)}
    for key in want.keys() - have.keys():
        raise ValueError(f"{path}: checkpoint has no leaf {key} that `like` has")
    for key in have.keys() - want.keys():
        raise ValueError(f"{path}: checkpoint leaf {key} is not in `like`")
    for key, w in want.items():
        shape = tuple(getattr(have[key], "shape", None) or ())
        if shape != tuple(w.shape):
            raise ValueError(f"{path}: leaf {key} has shape {shape}, `like` has {tuple(w.shape)}")
