"""The serving engine (docs/architecture.md "Engine"): `LLM` and the layers behind it."""

from jaxdecode.engine.llm import LLM, EngineClosed, EngineConfig, QueueFull, RequestHandle

__all__ = ["EngineClosed", "EngineConfig", "LLM", "QueueFull", "RequestHandle"]
