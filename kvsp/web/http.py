"""Reading requests and HTTP fields at the edge (spec §6.7 query parameters and Repr-Digest;
DESIGN.md §3 "Encodings"; RFC 9530, RFC 8941).

Bodies are read with a hard limit that is enforced while streaming, JSON bodies are checked for
media type, UTF-8, nesting depth and non-finite numbers before anything else sees them, and the
§6.7 query parameters and the ``Repr-Digest`` field are parsed into plain values or a
:class:`~kvsp.errors.BadRequest` naming the parameter. :func:`install_operations` mounts the
operator's resources every service has (metrics, request ids, OpenAPI).
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from typing import Any

import numpy as np
from starlette.applications import Starlette
from starlette.requests import Request

from kvsp.errors import BadRequest, PayloadTooLarge, UnsupportedMediaType
from kvsp.ids import check_length
from kvsp.web.logs import RequestContextMiddleware
from kvsp.web.metrics import install_metrics
from kvsp.web.openapi import install_openapi

JSON_MEDIA_TYPES = frozenset({"application/kvsp+json", "application/json"})
MAX_JSON_DEPTH = 64
UINT32_MAX = 2**32 - 1
UINT16_MAX = 2**16 - 1


async def read_body(request: Request, limit: int) -> bytes:
    """Read the whole request body, failing as soon as it passes ``limit`` octets.

    Raises:
        BadRequest: a Content-Length that is not a decimal integer.
        PayloadTooLarge: the declared or the received length is beyond ``limit``.
    """
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isascii() or not declared.isdigit():
            raise BadRequest("Content-Length must be a decimal integer", path="Content-Length")
        if len(declared) > 18 or int(declared) > limit:
            raise PayloadTooLarge(f"body of {declared} octets is over the limit of {limit}")
    chunks: list[bytes] = []
    received = 0
    async for chunk in request.stream():
        received += len(chunk)
        if received > limit:  # stop reading at once: the rest is never buffered
            raise PayloadTooLarge(f"body is over the limit of {limit} octets")
        chunks.append(chunk)
    return b"".join(chunks)


def media_type(content_type: str | None) -> str | None:
    """The lowercased ``type/subtype`` of a Content-Type field value, without parameters."""
    if content_type is None:
        return None
    return content_type.split(";", 1)[0].strip().lower() or None


async def read_json(request: Request, limit: int) -> Any:
    """Read and parse a JSON request body of at most ``limit`` octets.

    The media type must be ``application/kvsp+json`` or ``application/json``; a ``charset``
    parameter other than UTF-8 is refused too.

    Raises:
        UnsupportedMediaType: another (or no) media type.
        PayloadTooLarge: the body is over ``limit``.
        BadRequest: not UTF-8, not JSON, NaN/Infinity, or nested deeper than 64 (path ``$``).
    """
    content_type = request.headers.get("content-type")
    if media_type(content_type) not in JSON_MEDIA_TYPES:
        raise UnsupportedMediaType(
            f"expected application/kvsp+json, got {(content_type or 'no Content-Type')[:80]!r}"
        )
    charset = _charset(content_type or "")
    if charset is not None and charset not in ("utf-8", "utf8"):
        raise UnsupportedMediaType(f"JSON bodies are UTF-8, got charset {charset[:40]!r}")
    return parse_json(await read_body(request, limit))


def _charset(content_type: str) -> str | None:
    for param in content_type.split(";")[1:]:
        name, _, value = param.partition("=")
        if name.strip().lower() == "charset":
            return value.strip().strip('"').lower()
    return None


def _reject_constant(name: str) -> Any:
    raise BadRequest(f"{name} is not a JSON number", path="$")


# Octets that matter for nesting: quotes (to tell strings apart) and brackets.
_NOT_MARKS = bytes(b for b in range(256) if b not in b'"[]{}')
_STEPS = np.zeros(256, dtype=np.int8)
_STEPS[list(b"[{")] = 1
_STEPS[list(b"]}")] = -1


def json_depth(body: bytes) -> int:
    """How deeply ``body`` nests arrays/objects, found without parsing (C and numpy speed).

    Exact for valid JSON; for invalid JSON some number the parser then refuses anyway.
    Escapes are dropped first (``\\\\`` pairs, then ``\\"``), so every quote left delimits a
    string; a bracket counts when an even number of quotes precede it.
    """
    if b"\\" in body:
        body = body.replace(b"\\\\", b"").replace(b'\\"', b"")
    marks = np.frombuffer(body.translate(None, _NOT_MARKS), dtype=np.uint8)
    if marks.size == 0:
        return 0
    inside = (np.cumsum(marks == ord('"'), dtype=np.int32) & 1).astype(np.bool_)
    steps = np.where(inside, np.int8(0), _STEPS[marks])
    return int(np.cumsum(steps, dtype=np.int32).max())


def json_depth_exceeds(body: bytes, max_depth: int = MAX_JSON_DEPTH) -> bool:
    """Whether ``body`` nests arrays/objects deeper than ``max_depth`` (see :func:`json_depth`)."""
    return json_depth(body) > max_depth


def parse_json(body: bytes, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Parse a UTF-8 JSON text strictly (no NaN/Infinity, no BOM, depth ≤ ``max_depth``).

    Raises:
        BadRequest: with path ``$`` and the position of the first error.
    """
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRequest(f"body is not UTF-8 (octet {exc.start})", path="$") from None
    if json_depth_exceeds(body, max_depth):
        raise BadRequest(f"JSON nested deeper than {max_depth} levels", path="$")
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise BadRequest(
            f"malformed JSON: {exc.msg} at line {exc.lineno} column {exc.colno}", path="$"
        ) from None
    except ValueError as exc:  # an integer beyond the interpreter's 4,300-digit limit
        raise BadRequest(f"malformed JSON: {str(exc)[:80]}", path="$") from None
    except RecursionError:  # unreachable after the depth check; a bound all the same
        raise BadRequest(f"JSON nested deeper than {max_depth} levels", path="$") from None


_DECIMAL = re.compile(r"0|[1-9][0-9]{0,9}")


def _decimal(text: str, name: str, maximum: int) -> int:
    if _DECIMAL.fullmatch(text) is None or int(text) > maximum:
        raise BadRequest(
            f"query parameter {name!r} needs a decimal integer 0..{maximum}, got {text[:40]!r}",
            path=name,
        )
    return int(text)


def parse_layers_param(value: str, name: str = "layers") -> tuple[int, int]:
    """Parse the §6.7 ``layers=a-b`` parameter: an inclusive range of layer indices.

    ``a`` and ``b`` are decimal without sign or leading zeros, ``a ≤ b ≤ 2^32-1``.

    Raises:
        BadRequest: any other form; ``path`` names the parameter.
    """
    first, sep, last = value.partition("-")
    if not sep:
        raise BadRequest(f"query parameter {name!r} must be 'a-b', got {value[:40]!r}", path=name)
    a = _decimal(first, name, UINT32_MAX)
    b = _decimal(last, name, UINT32_MAX)
    if a > b:
        raise BadRequest(f"query parameter {name!r} has a > b ({a} > {b})", path=name)
    return a, b


def parse_codec_param(value: str, name: str = "codec") -> int:
    """Parse the §6.7 ``codec=n`` parameter: a decimal codec number of 16 bits (§4.3).

    Whether the codec is registered or producible is the holder's question (406), not this one.

    Raises:
        BadRequest: not a decimal integer 0..65535; ``path`` names the parameter.
    """
    return _decimal(value, name, UINT16_MAX)


def repr_digest(digest32: bytes) -> str:
    """The RFC 9530 ``Repr-Digest`` field value for a SHA-256 digest: ``sha-256=:<base64>:``.

    Raises:
        InvalidIdentifier: not 32 octets.
    """
    digest = check_length(digest32, 32, "a SHA-256 digest")
    return "sha-256=:" + base64.b64encode(digest).decode("ascii") + ":"


# RFC 8941 §3.3 bare items and §3.2 dictionaries, as regular expressions.
_KEY = r"[a-z*][a-z0-9_.*-]*"
_BARE = (
    r"(?:-?[0-9]{1,15}(?:\.[0-9]{1,3})?"  # integer or decimal
    r'|"(?:[\x20\x21\x23-\x5b\x5d-\x7e]|\\["\\])*"'  # string
    r"|[A-Za-z*][A-Za-z0-9!#$%&'*+.^_`|~:/-]*"  # token
    r"|:[A-Za-z0-9+/=]*:"  # byte sequence
    r"|\?[01])"  # boolean
)
_PARAMS = rf"(?:; *{_KEY}(?:={_BARE})?)*"
_ITEM = rf"{_BARE}{_PARAMS}"
_INNER_LIST = rf"\( *(?:{_ITEM}(?: +{_ITEM})*)? *\){_PARAMS}"
_MEMBER = re.compile(rf"({_KEY})(?:=({_ITEM}|{_INNER_LIST})|{_PARAMS})")
_SEPARATOR = re.compile(r"[ \t]*,[ \t]*")
_BYTES_ITEM = re.compile(rf":([A-Za-z0-9+/=]*):{_PARAMS}")


def parse_repr_digest(header: str | None) -> bytes | None:
    """The SHA-256 digest from a ``Repr-Digest`` field value (RFC 9530, an RFC 8941 dictionary).

    Several algorithms may be present (``sha-512=:…:, sha-256=:…:``); only ``sha-256`` is
    read, and a repeated key takes its last value (RFC 8941 §4.2.2). Fields sent on several
    lines must be joined with ``", "`` by the caller.

    Returns ``None`` when the field is absent or has no ``sha-256`` member, so a caller that
    must verify (§6.7 "Clients MUST verify Repr-Digest") treats ``None`` as a failure.

    Raises:
        BadRequest: the field is not a valid dictionary, or ``sha-256`` is not a byte sequence
            of 32 octets. A malformed integrity field is an error, never silently skipped.
    """
    if header is None:
        return None
    text = header.strip(" \t")
    if not text:
        return None  # an empty field is an empty dictionary (RFC 8941 §4.2)
    members = _dictionary(text)
    value = members.get("sha-256")
    if value is None:
        return None
    found = _BYTES_ITEM.fullmatch(value)
    if found is None:
        raise BadRequest("sha-256 must be a byte sequence (:base64:)", path="Repr-Digest")
    try:
        digest = base64.b64decode(found.group(1), validate=True)
    except binascii.Error:
        raise BadRequest("sha-256 is not valid base64", path="Repr-Digest") from None
    if len(digest) != 32:
        raise BadRequest(f"sha-256 must be 32 octets, got {len(digest)}", path="Repr-Digest")
    return digest


def _dictionary(text: str) -> dict[str, str]:
    members: dict[str, str] = {}
    pos = 0
    while True:
        member = _MEMBER.match(text, pos)
        if member is None:
            raise BadRequest(f"malformed dictionary at offset {pos}", path="Repr-Digest")
        members[member.group(1)] = member.group(2) or "?1"
        pos = member.end()
        if pos == len(text):
            return members
        separator = _SEPARATOR.match(text, pos)
        if separator is None or separator.end() == len(text):
            raise BadRequest(f"malformed dictionary at offset {pos}", path="Repr-Digest")
        pos = separator.end()


def install_operations(app: Starlette, service: str, title: str) -> None:
    """Mount what every service serves for its operators: ``/metrics`` and the request
    metrics (:mod:`kvsp.web.metrics`), request ids and access records
    (:mod:`kvsp.web.logs`), and ``/openapi.json`` (:mod:`kvsp.web.openapi`).

    Call it last while building the app, after :func:`~kvsp.web.problems.
    install_problem_handlers`, so that the middleware sees every answer, 500s included.
    """
    install_metrics(app, service)
    install_openapi(app, title)
    app.add_middleware(RequestContextMiddleware)  # outermost: ids on every answer
