"""jaxdecode: a JAX/XLA LLM decoder. Pure jitted device core; the host loop owns text and time."""

from jaxdecode.beam import beam_search
from jaxdecode.config import SamplingParams
from jaxdecode.consistency import assert_incremental_consistency
from jaxdecode.decode import GenerateOutput, compilation_count, generate
from jaxdecode.model_api import DecoderModel, KVCache, ModelConfig
from jaxdecode.processors import PROCESSOR_ORDER, process_logits
from jaxdecode.speculative import SpeculativeOutput, speculative_generate
from jaxdecode.state import StepState
from jaxdecode.types import (DecodingError, ErrorCode, Event, FinishReason, RequestState,
                             Usage)

__all__ = [
    "DecoderModel", "DecodingError", "ErrorCode", "Event", "FinishReason", "GenerateOutput",
    "KVCache", "ModelConfig", "PROCESSOR_ORDER", "RequestState", "SamplingParams",
    "SpeculativeOutput", "StepState", "Usage", "assert_incremental_consistency", "beam_search",
    "compilation_count", "generate", "process_logits", "speculative_generate",
]
