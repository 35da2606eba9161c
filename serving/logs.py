"""Structured JSON logs: one object per line with the request id.

`log_event("request.finished", request_id=..., ...)` writes through the `serving` logger; the
fields go to the record's ``fields`` attribute and `JsonFormatter` merges them into the line.
Prompts and generated text are never logged unless the app was built with ``log_prompts=True``
(`jaxdecode serve --log-prompts`).
"""

from __future__ import annotations

import datetime
import json
import logging
import sys
from typing import Any

logger = logging.getLogger("serving")


def log_event(event: str, level: int = logging.INFO, **fields: Any) -> None:
    if logger.isEnabledFor(level):
        logger.log(level, event, extra={"fields": fields})


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc)
            .isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": record.getMessage(),
        }
        out.update(getattr(record, "fields", None) or {})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False, default=str)


def configure_logging(level: str = "info", stream: Any = None) -> None:
    """Route the root logger (and uvicorn's) through one JSON handler."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        lg = logging.getLogger(name)
        lg.handlers[:] = []
        lg.propagate = True
