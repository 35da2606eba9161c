"""Saving one request's decoding state to disk and back (SPEC §7 B1, issue: pause / save /
restore). Arrays go through orbax; the host side (ids, settings, counters) is a JSON file.

The host pipeline's state (detokenizer bytes, stop-matcher hold-back) is not serialized: it is a
deterministic function of the output ids, so a restore rebuilds it by pushing them again.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import orbax.checkpoint as ocp

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


def as_numpy(tree: Any) -> Any:
    import jax

    return jax.tree.map(np.asarray, jax.device_get(tree))
