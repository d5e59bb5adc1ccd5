"""Service logs: one JSON object per line, each tied to its request (DESIGN.md §2 ``web/``).

:class:`RequestContextMiddleware` gives every HTTP request an id: the client's ``X-Request-Id``
when it is a short token (1-64 of ``A-Z a-z 0-9 . _ ~ -``), else a new random one. The id is
echoed in the response's ``X-Request-Id`` and kept in a context variable, so every record
logged while the request is handled (and by tasks it starts) carries it. When the response has
been sent, one access record (logger ``kvsp.access``, level INFO) states the method, the route
**template**, the status and the duration; never headers, query strings or bodies.

:class:`JsonFormatter` writes ``{"ts", "level", "logger", "msg", "request_id", "method",
"path", "status", "duration_ms", "exc"}`` (members without a value left out);
:func:`configure_logging` installs it (or a plain text line) on the root logger.
Both formats pass every message and traceback through :func:`redact`, which blanks bearer
tokens, ``Authorization`` values and principals-file token hashes, whoever logged them.
"""

from __future__ import annotations

import contextvars
import json
import logging
import re
import secrets
import sys
import time
from datetime import UTC, datetime
from typing import Any, TextIO

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

LOG_FORMATS = ("json", "text")
REQUEST_ID_HEADER = "x-request-id"
ACCESS_LOGGER = "kvsp.access"
_REQUEST_ID = re.compile(r"[A-Za-z0-9._~-]{1,64}")
_REDACTIONS = (
    # RFC 6750 bearer credentials wherever they appear ("Bearer <token68>").
    (re.compile(r"(?i)\b(bearer)(\s+)[A-Za-z0-9._~+/-]+=*"), r"\1\2[redacted]"),
    # Authorization / token members and fields: "authorization": "…", token=…, 'token': '…'.
    (
        re.compile(
            r"""(?i)(["']?(?:authorization|token|token_sha256)["']?\s*[:=]\s*)(["']?)"""
            r"""[^\s"',}\]]+"""
        ),
        r"\1\2[redacted]",
    ),
)

request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "kvsp_request_id", default=None
)
"""The id of the request being handled in this context (``None`` outside requests)."""


def redact(text: str) -> str:
    """``text`` with bearer tokens, Authorization values and token hashes blanked."""
    for pattern, replacement in _REDACTIONS:
        text = pattern.sub(replacement, text)
    return text


def new_request_id() -> str:
    """A fresh request id: 16 random hex digits."""
    return secrets.token_hex(8)


def accept_request_id(value: str | None) -> str:
    """The client's ``X-Request-Id`` when it is a short token, else a fresh id (a bad one is
    replaced, not refused: ids are for tracing, not a reason to fail a request)."""
    if value is not None and _REQUEST_ID.fullmatch(value) is not None:
        return value
    return new_request_id()


class RequestIdFilter(logging.Filter):
    """Puts the current request id on every record (``record.request_id``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = request_id_var.get()
        return True


_FIELDS = ("request_id", "method", "path", "status", "duration_ms")


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line; messages and tracebacks redacted."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "msg": redact(record.getMessage()),
        }
        for name in _FIELDS:
            value = getattr(record, name, None)
            if value is None and name == "request_id":
                value = request_id_var.get()
            if value is not None:
                out[name] = value
        if record.exc_info:
            out["exc"] = redact(self.formatException(record.exc_info))
        elif record.exc_text:
            out["exc"] = redact(record.exc_text)
        return json.dumps(out, ensure_ascii=False, default=str)


class TextFormatter(logging.Formatter):
    """A human line: ``time level logger [request id] message``, redacted like the JSON."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        if getattr(record, "request_id", None) is None:
            record.request_id = request_id_var.get() or "-"
        return redact(super().format(record))


def make_handler(log_format: str, stream: TextIO | None = None) -> logging.Handler:
    """A stream handler (stderr by default) writing ``log_format`` (``json`` or ``text``).

    Raises:
        ValueError: another format.
    """
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, not {log_format!r}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    handler.addFilter(RequestIdFilter())
    return handler


def configure_logging(log_format: str, level: str = "warning") -> None:
    """Send every logger's records to stderr in ``log_format`` at ``level`` and above
    (replacing the root logger's handlers). Called once, by ``kvsp serve``.

    Raises:
        ValueError: an unknown format or level.
    """
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}")
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(make_handler(log_format))
    root.setLevel(numeric)


class RequestContextMiddleware:
    """Assigns each request its id, echoes it in ``X-Request-Id`` and logs the access record."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._log = logging.getLogger(ACCESS_LOGGER)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = accept_request_id(_header(scope, b"x-request-id"))
        token = request_id_var.set(rid)
        began = time.perf_counter()
        status = 500

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                MutableHeaders(scope=message)[REQUEST_ID_HEADER] = rid
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            if self._log.isEnabledFor(logging.INFO):
                self._access(scope, status, time.perf_counter() - began)
            request_id_var.reset(token)

    def _access(self, scope: Scope, status: int, seconds: float) -> None:
        route = scope.get("route")
        path = getattr(route, "path", None)
        extra = {
            "method": scope["method"],
            "path": path if isinstance(path, str) else "<unmatched>",
            "status": status,
            "duration_ms": round(seconds * 1000, 3),
        }
        self._log.info("%s %s %d", extra["method"], extra["path"], status, extra=extra)


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            try:
                text: str = value.decode("ascii")
            except UnicodeDecodeError:
                return None
            return text
    return None
