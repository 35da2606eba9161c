"""Model families that implement `jaxdecode.model_api.DecoderModel`, and checkpoint loading."""
from models.llama import Llama, LlamaConfig
from models.gpt2 import GPT2, GPT2Config
from models.gemma import Gemma, GemmaConfig
from models.hf import CheckpointError, load
from models.checkpoint import restore_params, save_params
from models.sharding import make_mesh, shard_params
from models.demo import load as _load_demo  # binds the subpackage; `demo` below rebinds the name


def demo(kind: str = "main"):
    """The embedded default model (or its draft): `(model, params, tokenizer)`, no download.

    Files live in the subpackage `models.demo` (importable as a module via sys.modules)."""
    return _load_demo(kind)


__all__ = ["CheckpointError", "GPT2", "GPT2Config", "Gemma", "GemmaConfig", "Llama", "LlamaConfig", "demo", "load",
           "make_mesh", "restore_params", "save_params", "shard_params"]
