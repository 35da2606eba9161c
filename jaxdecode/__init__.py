"""jaxdecode: a JAX/XLA LLM decoder. Pure jitted device core; the host loop owns text and time."""

from jaxdecode.device.beam import beam_search
from jaxdecode.config import SamplingParams
from jaxdecode.device.consistency import assert_incremental_consistency
from jaxdecode.device.decode import GenerateOutput, compilation_count, generate
from jaxdecode.engine import LLM, EngineClosed, EngineConfig, QueueFull, RequestHandle
from jaxdecode.device.hooks import Intervention, ablate, capture_activations, steer
from jaxdecode.model_api import DecoderModel, KVCache, ModelConfig
from jaxdecode.device.processors import PROCESSOR_ORDER, process_logits
from jaxdecode.replay import GenerationRecord, ReplayReport, replay
from jaxdecode.device.research import LogitProcessor, ProcessorContext
from jaxdecode.device.speculative import SpeculativeOutput, speculative_generate
from jaxdecode.scoring import score, score_padded
from jaxdecode.device.state import StepState
from jaxdecode.types import (Completion, DecodingError, ErrorCode, Event, FinishReason,
                             RequestState, TokenLogprob, Usage)

__all__ = [
    "Completion", "DecoderModel", "DecodingError", "EngineClosed", "EngineConfig", "ErrorCode",
    "Event", "FinishReason", "GenerateOutput", "GenerationRecord", "Intervention", "KVCache",
    "LLM", "LogitProcessor", "ModelConfig", "PROCESSOR_ORDER", "ProcessorContext", "QueueFull",
    "ReplayReport", "RequestHandle", "RequestState", "SamplingParams", "SpeculativeOutput",
    "StepState", "TokenLogprob", "Usage", "ablate", "assert_incremental_consistency",
    "beam_search", "capture_activations", "compilation_count", "generate", "process_logits",
    "replay", "score", "score_padded", "speculative_generate", "steer",
]
