"""Model families that implement `jaxdecode.model_api.DecoderModel`, and checkpoint loading."""
from typing import Optional

from models.llama import Llama, LlamaConfig
from models.gpt2 import GPT2, GPT2Config
from models.gemma import Gemma, GemmaConfig
from models.moe import Moe, MoeConfig
from models.hf import CheckpointError, load
from models.checkpoint import restore_params, save_params
from models.sharding import make_mesh, shard_params
from models.quantization import quantize_params
from models.demo import load as _load_demo  # binds the subpackage; `demo` below rebinds the name


def demo(kind: str = "main", quantization: Optional[str] = None):
    """The embedded default model (or its draft): `(model, params, tokenizer)`, no download;
    `quantization` "int8" for int8 weights (models/quantization.py, contract §12).

    Files live in the subpackage `models.demo` (importable as a module via sys.modules)."""
    return _load_demo(kind, quantization=quantization)


__all__ = ["CheckpointError", "GPT2", "GPT2Config", "Gemma", "GemmaConfig", "Llama", "LlamaConfig", "Moe", "MoeConfig", "demo", "load",
           "make_mesh", "quantize_params", "restore_params", "save_params", "shard_params"]
