"""Host-side request pipeline (docs/architecture.md "Host side"): pure Python, never calls ``jax.jit``.

Per request: ``token id -> IncrementalDetokenizer.push -> StopMatcher.push ->
OrderedStream.emit(delta) ... terminal event exactly once (Lifecycle)``; `TextPipeline` bundles
the text part (detokenizer + stop matchers + returned-token accounting).
"""

from .detokenizer import IncrementalDetokenizer, VocabInfo, bytes_to_unicode, vocab_info
from .lifecycle import (
    CANCELLABLE_STATES,
    TERMINAL_STATES,
    TRANSITIONS,
    IllegalTransition,
    Lifecycle,
    Trace,
    is_allowed,
)
from .pipeline import FinishResult, PushResult, TextPipeline
from .stop import (
    STOP_RULE_VERSION,
    IdStopResult,
    StopHit,
    StopMatcher,
    StopResult,
    StopSequenceMatcher,
)
from .stream import (
    TERMINAL_KINDS,
    BackpressurePolicy,
    OrderedStream,
    OutputKind,
    ResumeUnavailable,
    Timings,
)

__all__ = [
    "IncrementalDetokenizer",
    "VocabInfo",
    "vocab_info",
    "bytes_to_unicode",
    "StopMatcher",
    "StopSequenceMatcher",
    "StopResult",
    "IdStopResult",
    "StopHit",
    "STOP_RULE_VERSION",
    "OrderedStream",
    "OutputKind",
    "BackpressurePolicy",
    "Timings",
    "ResumeUnavailable",
    "TERMINAL_KINDS",
    "Lifecycle",
    "Trace",
    "IllegalTransition",
    "TRANSITIONS",
    "TERMINAL_STATES",
    "CANCELLABLE_STATES",
    "is_allowed",
    "TextPipeline",
    "PushResult",
    "FinishResult",
]
