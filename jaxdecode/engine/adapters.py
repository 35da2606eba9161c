"""Multi-LoRA on the engine side (contract R6): named adapters at fixed indices of one stack.

`LLM(..., lora_modules={name: path}, max_loras=N)` loads each adapter through the model's
adapter protocol (`model_api`: `load_adapter`, `stack_adapters`; models/lora.py for the Llama
family) and attaches the stack to the engine's weights as `params["lora"]`, its shape fixed by
`max_loras` (the adapters resident, default: those given) and the largest rank. A request picks
one with `SamplingParams(lora=name)` (None: the base model); the index travels as a per-row
array (`RowParams.adapter`, a chunk's `adapters`), so any mix of adapters and base rows runs in
one program and a new selection never recompiles.

Each adapter is named in its records with a content hash of its weights, and the prefix cache
keys its pages on that hash (`tag`): the same prompt under another adapter never shares pages.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping, Optional

from jaxdecode import replay as replay_lib


def _fail(message: str) -> None:
    raise ValueError(f"lora_modules: {message}")


def check_modules(lora_modules: Any, max_loras: Any) -> tuple:
    """`lora_modules` ({name: path}) as (name, path) pairs in its order (the adapters' indices),
    after the checks that need no model (ValueError naming the field)."""
    if lora_modules is None:
        if max_loras is not None:
            raise ValueError("max_loras: given without lora_modules")
        return ()
    pairs = (tuple(lora_modules.items()) if isinstance(lora_modules, Mapping)
             else lora_modules if isinstance(lora_modules, tuple) else ())
    if not pairs:
        _fail(f"must be a non-empty mapping of adapter name to PEFT directory, got "
              f"{lora_modules!r}")
    for pair in pairs:
        if (not isinstance(pair, tuple) or len(pair) != 2 or not isinstance(pair[0], str)
                or not pair[0] or not isinstance(pair[1], (str, os.PathLike))):
            _fail(f"entries must be name -> path, got {pair!r}")
    if max_loras is not None and (isinstance(max_loras, bool) or not isinstance(max_loras, int)
                                  or max_loras < len(pairs)):
        raise ValueError(f"max_loras: must be an integer >= the {len(pairs)} adapters of "
                         f"lora_modules, got {max_loras!r}")
    if len({name for name, _ in pairs}) != len(pairs):
        _fail("adapter names must be distinct")
    return tuple((name, os.fspath(path)) for name, path in pairs)


@dataclasses.dataclass(frozen=True)
class Adapters:
    """The engine's adapters: `names[j]` at index j + 1, each with its weights' hash, and the
    stack (`params["lora"]`) of `max_loras` indices."""

    names: tuple
    hashes: dict
    stack: Any
    max_loras: int

    @classmethod
    def load(cls, model: Any, params: Any, modules: tuple,
             max_loras: Optional[int]) -> Optional["Adapters"]:
        """The adapters of `modules` (`check_modules`' pairs) for `model` and its base
        `params`, or None without any."""
        if not modules:
            return None
        if not hasattr(model, "load_adapter") or not hasattr(model, "stack_adapters"):
            _fail(f"the {type(model).__name__} family has no LoRA support (the Llama family "
                  "has: Llama, Mistral, Qwen2)")
        if not isinstance(params, Mapping) or "lora" in params:
            _fail("the base params must be a dict of weights without a 'lora' entry")
        loaded = [model.load_adapter(name, path, params) for name, path in modules]
        hashes = {name: replay_lib.params_hash(a["layers"])
                  for (name, _), a in zip(modules, loaded)}
        slots = len(modules) if max_loras is None else max_loras
        return cls(tuple(name for name, _ in modules), hashes,
                   model.stack_adapters(loaded, params, slots), slots)

    def attach(self, params: Any) -> Any:
        """The engine's weights: the base `params` with the stack as "lora"."""
        return {**params, "lora": self.stack}

    def index(self, name: Optional[str]) -> int:
        """The index of adapter `name` (0 for None, the base); ValueError naming lora."""
        if name is None:
            return 0
        if name not in self.names:
            raise ValueError(f"lora: unknown adapter {name!r} (this engine has "
                             f"{', '.join(self.names)})")
        return self.names.index(name) + 1

    def tag(self, name: Optional[str]) -> str:
        """What the prefix cache keys pages on besides the model: the adapter's hash."""
        return "" if name is None else f"|lora:{self.hashes[name]}"

    def record(self, name: Optional[str]) -> Optional[dict]:
        """A record's `"lora"` entry: the adapter's name and weights hash (None: the base)."""
        return None if name is None else {"name": name, "hash": self.hashes[name]}


def index_of(adapters: Optional[Adapters], name: Optional[str]) -> int:
    """`Adapters.index` for an engine with or without adapters (ValueError naming lora)."""
    if name is not None and adapters is None:
        raise ValueError(f"lora: this engine has no adapters (LLM(lora_modules=...)), got "
                         f"{name!r}")
    return 0 if adapters is None else adapters.index(name)
