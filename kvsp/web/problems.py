"""Problem rendering at the HTTP edge (RFC 9457; DESIGN.md §3 "Encodings"; STYLE.md rule 3).

:func:`install_problem_handlers` registers the one Starlette handler that renders every
:class:`~kvsp.errors.KVSPError` as ``application/problem+json``. Starlette's own
``HTTPException`` (unknown route, wrong method) is rendered the same way, and any other exception
becomes a bare 500 problem: the traceback and message go to the log, never into the body.

KVSP bodies (not errors) use ``application/kvsp+json``; :func:`kvsp_json` renders them.
"""

from __future__ import annotations

import http
import json
import logging
from collections.abc import Callable, Mapping
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvsp import errors

KVSP_JSON = "application/kvsp+json"
PROBLEM_JSON = "application/problem+json"
ABOUT_BLANK = "about:blank"

_log = logging.getLogger("kvsp.services")

# Statuses Starlette raises itself that have a KVSP problem type of their own; the others are
# rendered with RFC 9457's "about:blank" type, whose title is the status phrase.
_HTTP_PROBLEMS: dict[int, type[errors.KVSPError]] = {
    400: errors.BadRequest,
    401: errors.Unauthorized,
    403: errors.Forbidden,
    404: errors.NotFound,
    409: errors.Conflict,
    413: errors.PayloadTooLarge,
}


def _dumps_stdlib(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def _pick_dumps() -> Callable[[Any], bytes]:
    try:
        import orjson  # a core dependency for speed (DESIGN.md §7); json if absent
    except ImportError:
        return _dumps_stdlib
    dumps: Callable[[Any], bytes] = orjson.dumps
    return dumps


dumps_json: Callable[[Any], bytes] = _pick_dumps()
"""Serialize a JSON value compactly as UTF-8 (orjson when importable, else stdlib ``json``)."""


def kvsp_json(obj: Any, status: int = 200, headers: Mapping[str, str] | None = None) -> Response:
    """A response carrying ``obj`` as ``application/kvsp+json``."""
    return Response(dumps_json(obj), status_code=status, headers=headers, media_type=KVSP_JSON)


def _problem(body: Mapping[str, Any], status: int, headers: Mapping[str, str] | None) -> Response:
    return Response(dumps_json(body), status_code=status, headers=headers, media_type=PROBLEM_JSON)


def problem_response(
    err: errors.KVSPError,
    instance: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> Response:
    """Render ``err`` as an RFC 9457 ``application/problem+json`` response with its status.

    A 401 carries ``WWW-Authenticate: Bearer`` (RFC 6750 §3), as HTTP requires.
    """
    merged = dict(headers or {})
    if err.status == 401:
        merged.setdefault("WWW-Authenticate", 'Bearer realm="kvsp"')
    return _problem(err.to_problem(instance=instance), err.status, merged)


def http_problem(
    status: int,
    detail: str | None = None,
    instance: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> Response:
    """A problem response for a bare HTTP status (KVSP type when one fits, else ``about:blank``)."""
    phrase = _phrase(status)
    cls = _HTTP_PROBLEMS.get(status)
    if cls is not None:
        return problem_response(cls(detail or phrase), instance=instance, headers=headers)
    body: dict[str, Any] = {"type": ABOUT_BLANK, "title": phrase, "status": status}
    if detail:
        body["detail"] = detail
    if instance is not None:
        body["instance"] = instance
    return _problem(body, status, headers)


def _phrase(status: int) -> str:
    try:
        return http.HTTPStatus(status).phrase
    except ValueError:
        return "Error"


async def _on_kvsp_error(request: Request, exc: Exception) -> Response:
    if not isinstance(exc, errors.KVSPError):  # registered for KVSPError only
        return await _on_unexpected(request, exc)
    return problem_response(exc, instance=request.url.path)


async def _on_http_exception(request: Request, exc: Exception) -> Response:
    if not isinstance(exc, HTTPException):  # registered for HTTPException only
        return await _on_unexpected(request, exc)
    detail = exc.detail if exc.detail != _phrase(exc.status_code) else None
    return http_problem(exc.status_code, detail, request.url.path, exc.headers)


async def _on_unexpected(request: Request, exc: Exception) -> Response:
    # The body says nothing about the failure: messages and tracebacks can leak internals.
    _log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return http_problem(500, "internal error", request.url.path)


class _UnexpectedErrors:
    """Answers an unexpected exception with the 500 problem, and does not re-raise it.

    Starlette's outermost middleware renders the 500 but then re-raises, and uvicorn answers
    that by closing the connection, so a client reusing it gets a reset. Raised after the
    response has started, the exception does propagate: the body is cut short, and only closing
    the connection tells the client so.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            if started:
                raise
            response = await _on_unexpected(Request(scope), exc)
            await response(scope, receive, send)


def install_problem_handlers(app: Starlette) -> None:
    """Register the problem handlers: KVSPError, Starlette HTTPException, and everything else.

    Call it while building the app, before it serves its first request.
    """
    app.add_exception_handler(errors.KVSPError, _on_kvsp_error)
    app.add_exception_handler(HTTPException, _on_http_exception)
    app.add_exception_handler(Exception, _on_unexpected)  # outside our middleware, if any
    app.add_middleware(_UnexpectedErrors)
