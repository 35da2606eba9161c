"""jaxdecode: a JAX/XLA LLM decoder. Pure jitted device core; the host loop owns text and time."""

from jaxdecode.beam import beam_search
from jaxdecode.config import SamplingParams
from jaxdecode.consistency import assert_incremental_consistency
from jaxdecode.decode import GenerateOutput, compilation_count, generate
from jaxdecode.engine import LLM, EngineClosed, QueueFull, RequestHandle
from jaxdecode.hooks import Intervention, ablate, capture_activations, steer
from jaxdecode.model_api import DecoderModel, KVCache, ModelConfig
from jaxdecode.processors import PROCESSOR_ORDER, process_logits
from jaxdecode.replay import GenerationRecord, ReplayReport, replay
from jaxdecode.research import LogitProcessor, ProcessorContext
from jaxdecode.speculative import SpeculativeOutput, speculative_generate
from jaxdecode.state import StepState
from jaxdecode.types import (Completion, DecodingError, ErrorCode, Event, FinishReason,
                             RequestState, TokenLogprob, Usage)

__all__ = [
    "Completion", "DecoderModel", "DecodingError", "EngineClosed", "ErrorCode", "Event",
    "FinishReason", "GenerateOutput", "GenerationRecord", "Intervention", "KVCache", "LLM",
    "LogitProcessor", "ModelConfig", "PROCESSOR_ORDER", "ProcessorContext", "QueueFull",
    "ReplayReport", "RequestHandle", "RequestState", "SamplingParams", "SpeculativeOutput",
    "StepState", "TokenLogprob", "Usage", "ablate", "assert_incremental_consistency",
    "beam_search", "capture_activations", "compilation_count", "generate", "process_logits",
    "replay", "speculative_generate", "steer",
]
