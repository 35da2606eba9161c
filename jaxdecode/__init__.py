"""jaxdecode: a JAX/XLA LLM decoder."""
from jaxdecode.model_api import DecoderModel, KVCache, ModelConfig
