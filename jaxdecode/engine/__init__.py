"""The serving engine (docs/architecture.md "Engine"): `LLM` and the layers behind it."""

from jaxdecode.engine.llm import LLM, EngineClosed, QueueFull, RequestHandle

__all__ = ["EngineClosed", "LLM", "QueueFull", "RequestHandle"]
