"""Model families that implement `jaxdecode.model_api.DecoderModel`, and checkpoint loading."""
from models.llama import Llama, LlamaConfig
from models.gpt2 import GPT2, GPT2Config
from models.hf import CheckpointError, load
from models.checkpoint import restore_params, save_params
