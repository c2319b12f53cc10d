"""Server logs: JSON lines (or plain text), each carrying the id of the request being served.

The request id lives in a context variable that the request middleware sets; every record logged while the
request is served (in its task, or in tasks that task starts) carries it. Structured fields go in
``extra={"fields": {...}}`` and become top-level keys of the JSON object (``key=value`` pairs as text).
Records logged on the engine thread carry no request id: one engine step serves many requests.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from contextvars import ContextVar
from typing import Any, Literal, TextIO

request_id_var: ContextVar[str | None] = ContextVar("specserve_request_id", default=None)

# Loggers of the libraries the server runs on: they go through our handler, in our format.
_LIBRARY_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access", "fastapi")


class RequestIdFilter(logging.Filter):
    """Stamp each record with the current request id (None outside a request)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = request_id_var.get()
        return True


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    fields = getattr(record, "fields", None)
    return dict(fields) if isinstance(fields, dict) else {}


class JsonFormatter(logging.Formatter):
    """One JSON object a line: ts, level, logger, msg, request_id (when serving one), fields, exc."""

    def format(self, record: logging.LogRecord) -> str:
        payload: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        request_id = getattr(record, "request_id", None)
        if request_id is not None:
            payload["request_id"] = request_id
        payload.update(_fields(record))
        if record.exc_info:
            payload["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            payload["stack"] = self.formatStack(record.stack_info)
        # ASCII: a client's text may hold lone surrogates, which a UTF-8 stream cannot encode.
        return json.dumps(payload, ensure_ascii=True, default=str)


class TextFormatter(logging.Formatter):
    """``time LEVEL logger [request id]: message key=value ...`` for people reading a terminal."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s%(rid)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        request_id = getattr(record, "request_id", None)
        record.rid = f" [{request_id}]" if request_id else ""
        text = super().format(record)
        extra = " ".join(f"{k}={json.dumps(v, default=str)}" for k, v in _fields(record).items())
        return f"{text} {extra}" if extra else text


def configure_logging(
    level: str = "info", fmt: Literal["json", "text"] = "json", stream: TextIO | None = None
) -> None:
    """Route every logger (ours, uvicorn's) to one handler on stderr in the chosen format."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for name in _LIBRARY_LOGGERS:
        library = logging.getLogger(name)
        library.handlers.clear()
        library.propagate = True
