"""Model families that implement `jaxdecode.model_api.DecoderModel`, and checkpoint loading."""
from models.llama import Llama, LlamaConfig
