"""Reading requests and HTTP fields at the edge (spec §6.7 query parameters and Repr-Digest;
DESIGN.md §3 "Encodings"; RFC 9530, RFC 8941).

Bodies are read with a hard limit that is enforced while streaming, JSON bodies are checked for
media type, UTF-8, nesting depth and non-finite numbers before anything else sees them, and the
§6.7 query parameters and the ``Repr-Digest`` field are parsed into plain values or a
:class:`~kvsp.errors.BadRequest` naming the parameter. :func:`install_operations` mounts the
operator's resources every service has (metrics, request ids, OpenAPI).

**Bounded parsing.** Octets alone do not bound what a JSON body costs: ``{"x":[{},{},…]}``
turns three octets into a 64-octet dict, so a body of tens of MiB can cost a GiB and seconds
of parsing.
:class:`JsonLimits` bounds what the parser would build — values (items), arrays and objects
(containers), nesting depth, the octets of one string and the characters of one number — and
:func:`json_prescan` checks them over the raw octets (C-speed ``bytes`` and regex scans, no
object built) before ``json.loads`` runs; a body over a limit is a 413 ``kvsp-bad-request``
naming the limit. Each route passes the limits of what it takes (a lookup needs one array of
keys; a prompt one array of numbers), so parsing time and memory stay a small multiple of what
a valid body of that route costs.

**Client disconnects.** A client that goes away before its body is complete is not a server
failure: :func:`read_body` raises :class:`ClientDisconnected` (status 499, logged at info
without a traceback), which the metrics count under status ``499``, never as a 5xx.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import math
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from kvsp.errors import BadRequest, KVSPError, NotReady, PayloadTooLarge, UnsupportedMediaType
from kvsp.ids import check_length
from kvsp.web.logs import RequestContextMiddleware
from kvsp.web.metrics import install_metrics
from kvsp.web.openapi import install_openapi
from kvsp.web.problems import kvsp_json

Octets = bytes | bytearray
"""A body as read: :func:`read_json` reads into a ``bytearray``."""
JSON_MEDIA_TYPES = frozenset({"application/kvsp+json", "application/json"})
MAX_JSON_DEPTH = 64
UINT32_MAX = 2**32 - 1
UINT16_MAX = 2**16 - 1
CLIENT_CLOSED = 499
"""The status label of a request whose client went away before its body was complete."""

_log = logging.getLogger("kvsp.web.http")


class ClientDisconnected(KVSPError):
    """The client closed the connection before the request body was complete (499).

    Nobody reads the answer; the status is for the access record and the request metrics,
    which count it apart from server failures.
    """

    status: ClassVar[int] = CLIENT_CLOSED
    title: ClassVar[str] = "Client closed request"


_DEFAULT_MAX_ITEMS = 1 << 22
_DEFAULT_MAX_CONTAINERS = 1 << 20
_ARRAY_SLACK = 1 << 16  # octets of the members beside the array


@dataclass(frozen=True, slots=True, kw_only=True)
class JsonLimits:
    """What one JSON request body may hold: octets, and what parsing it would build.

    ``max_items`` counts values and keys (every array element, object key and member value,
    and the top value; an empty array or object counts twice);
    ``max_containers`` arrays and objects; ``max_string`` the octets of one string as sent
    (escapes included); ``max_number`` the characters of one number. :meth:`for_octets` gives
    the defaults of a route that says only its octet limit.
    """

    max_octets: int
    max_items: int
    max_containers: int
    max_depth: int = MAX_JSON_DEPTH
    max_string: int = 1 << 20
    max_number: int = 40
    max_strings: int | None = None
    """Strings (keys and values); ``None``: up to ``max_items``."""

    @classmethod
    def for_octets(cls, max_octets: int) -> JsonLimits:
        """Defaults scaled to ``max_octets``: an item per 4 octets (a short JSON number with
        its separator), an array or object per 64, never fewer than 1,024 of either nor more
        than 4M items and 1M arrays and objects; strings up to ``max_octets``."""
        return cls(
            max_octets=max_octets,
            max_items=min(_DEFAULT_MAX_ITEMS, max(1024, max_octets // 4)),
            max_containers=min(_DEFAULT_MAX_CONTAINERS, max(1024, max_octets // 64)),
            max_string=max_octets,
        )

    @classmethod
    def for_array(
        cls, max_elements: int, element_octets: int, max_octets: int, *, strings: bool
    ) -> JsonLimits:
        """Limits of a body whose bulk is one array of up to ``max_elements`` scalars of about
        ``element_octets`` each with separator and indentation (block keys, token ids) beside
        a few members: octets for that (at most ``max_octets``), an item per element, 64
        arrays and objects, strings of at most 64 KiB, and strings as elements only when
        ``strings`` (numbers otherwise)."""
        return cls(
            max_octets=min(max_octets, max_elements * element_octets + _ARRAY_SLACK),
            max_items=max_elements + 1024,
            max_containers=64,
            max_string=1 << 16,
            max_strings=max_elements + 1024 if strings else 1024,
        )


async def read_body(request: Request, limit: int) -> bytes:
    """Read the whole request body, failing as soon as it passes ``limit`` octets.

    Raises:
        BadRequest: a Content-Length that is not a decimal integer.
        PayloadTooLarge: the declared or the received length is beyond ``limit``.
        ClientDisconnected: the client went away before the body was complete.
    """
    return b"".join([chunk async for chunk in _body_chunks(request, limit)])


async def _read_growing(request: Request, limit: int) -> bytearray:
    """:func:`read_body` into one growing buffer: no second copy of the whole body (large
    buffers grow in place), so a body costs its own size while it is checked and parsed."""
    body = bytearray()
    async for chunk in _body_chunks(request, limit):
        body += chunk
    return body


async def _body_chunks(request: Request, limit: int) -> AsyncIterator[bytes]:
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isascii() or not declared.isdigit():
            raise BadRequest("Content-Length must be a decimal integer", path="Content-Length")
        if len(declared) > 18 or int(declared) > limit:
            raise PayloadTooLarge(f"body of {declared} octets is over the limit of {limit}")
    received = 0
    try:
        async for chunk in request.stream():
            received += len(chunk)
            if received > limit:  # stop reading at once: the rest is never buffered
                raise PayloadTooLarge(f"body is over the limit of {limit} octets")
            yield chunk
    except ClientDisconnect:
        _log.info("client closed the connection after %d octets of the body", received)
        raise ClientDisconnected(f"client closed the connection after {received} octets") from None


def media_type(content_type: str | None) -> str | None:
    """The lowercased ``type/subtype`` of a Content-Type field value, without parameters."""
    if content_type is None:
        return None
    return content_type.split(";", 1)[0].strip().lower() or None


async def read_json(request: Request, limit: int | JsonLimits) -> Any:
    """Read and parse a JSON request body within ``limit``: octets (with the
    :meth:`JsonLimits.for_octets` defaults for the rest) or the route's :class:`JsonLimits`.

    The media type must be ``application/kvsp+json`` or ``application/json``; a ``charset``
    parameter other than UTF-8 is refused too.

    Raises:
        UnsupportedMediaType: another (or no) media type.
        PayloadTooLarge: the body is over a limit (octets, items, containers, string or
            number length), found before it is parsed.
        BadRequest: not UTF-8, not JSON, a non-finite number, or nested deeper than the
            limit (path ``$``).
        ClientDisconnected: the client went away before the body was complete.
    """
    limits = limit if isinstance(limit, JsonLimits) else JsonLimits.for_octets(limit)
    content_type = request.headers.get("content-type")
    if media_type(content_type) not in JSON_MEDIA_TYPES:
        raise UnsupportedMediaType(
            f"expected application/kvsp+json, got {(content_type or 'no Content-Type')[:80]!r}"
        )
    charset = _charset(content_type or "")
    if charset is not None and charset not in ("utf-8", "utf8"):
        raise UnsupportedMediaType(f"JSON bodies are UTF-8, got charset {charset[:40]!r}")
    return parse_json(await _read_growing(request, limits.max_octets), limits=limits)


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


def json_depth(body: Octets) -> int:
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


def json_depth_exceeds(body: Octets, max_depth: int = MAX_JSON_DEPTH) -> bool:
    """Whether ``body`` nests arrays/objects deeper than ``max_depth`` (see :func:`json_depth`)."""
    return json_depth(body) > max_depth


# A string with its quotes (escaped quotes and backslashes are masked first, see _masked).
_STRING = re.compile(rb'"[^"]*"')
# Octets that may be part of a JSON number, mapped to one mark; everything else to another.
_NUMBER_MARKS = bytes(ord("n") if chr(b) in "+-.0123456789eE" else ord(" ") for b in range(256))


def _masked(body: Octets) -> Octets:
    """``body`` with ``\\\\`` and ``\\"`` replaced by two neutral octets: every quote left
    delimits a string, and every string keeps its length in octets."""
    if b"\\" not in body:
        return body
    return body.replace(b"\\\\", b"__").replace(b'\\"', b"__")


def json_prescan(body: Octets, limits: JsonLimits) -> None:
    """Check ``body`` against ``limits`` without parsing it (see :class:`JsonLimits`).

    Exact for valid JSON; for invalid JSON the counts are what the parser would refuse anyway.
    The checks run cheapest first, so an over-large body is refused before the costlier ones
    (string lengths, depth) look at it.

    Raises:
        PayloadTooLarge: over ``max_octets``, ``max_items``, ``max_strings``,
            ``max_containers``, ``max_string`` or ``max_number``; the detail names the limit.
        BadRequest: nested deeper than ``max_depth`` (path ``$``).
    """
    if len(body) > limits.max_octets:
        raise PayloadTooLarge(f"body is over the limit of {limits.max_octets} octets")
    masked = _masked(body)
    strings = masked.count(b'"') // 2
    if strings > limits.max_items:  # every string is an item (a key or a value)
        raise PayloadTooLarge(f"JSON body has more than {limits.max_items} items", path="$")
    if limits.max_strings is not None and strings > limits.max_strings:
        raise PayloadTooLarge(f"JSON body has more than {limits.max_strings} strings", path="$")
    bare: Octets | None = None
    longest: int | None = None
    if len(masked) < _LARGE_BODY:  # outside strings at even indices, inside at odd ones
        parts = masked.split(b'"')
        bare, longest = b"".join(parts[::2]), max(map(len, parts[1::2]), default=0)
        del parts
    containers, items, bare = _structure(masked, strings, bare)
    if containers > limits.max_containers:
        raise PayloadTooLarge(
            f"JSON body has more than {limits.max_containers} arrays and objects", path="$"
        )
    if items > limits.max_items:
        raise PayloadTooLarge(f"JSON body has more than {limits.max_items} items", path="$")
    if bare is None:  # structure and numbers only, now that the body passed the counts
        bare = _STRING.sub(b"", masked)
    if b"n" * (limits.max_number + 1) in bare.translate(_NUMBER_MARKS):
        raise PayloadTooLarge(
            f"a JSON number is longer than {limits.max_number} characters", path="$"
        )
    if longest is None:  # the octets of all strings together bound each one
        inside = len(masked) - len(bare)
        longest = _longest_string(masked) if inside > limits.max_string else inside
    if longest > limits.max_string:
        raise PayloadTooLarge(f"a JSON string is longer than {limits.max_string} octets", path="$")
    if _bare_depth(bare) > limits.max_depth:
        raise BadRequest(f"JSON nested deeper than {limits.max_depth} levels", path="$")


_SCAN_CHUNK = 1 << 22
_FEW_STRINGS = 64
_LARGE_BODY = 1 << 20
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_OPENS = frozenset(b"[{")


def _structure(masked: Octets, strings: int, bare: Octets | None) -> tuple[int, int, Octets | None]:
    """(arrays and objects, items, the body without its strings) of a masked body.

    ``bare`` is that body when the caller has it. A large body with few strings is counted
    without making it (``None`` back): the marks inside its strings are subtracted from
    whole-body counts, so a refused body never costs twice its size.
    """
    if bare is None and strings <= _FEW_STRINGS:
        spans = [m.span() for m in _STRING.finditer(masked)]
        opens = sum(_outside(masked, mark, spans) for mark in (b"[", b"{"))
        separators = sum(_outside(masked, mark, spans) for mark in (b",", b":"))
        return opens, separators + opens + 1, None
    if bare is None:
        bare = _STRING.sub(b"", masked) if strings else masked
    opens = bare.count(b"[") + bare.count(b"{")
    return opens, bare.count(b",") + bare.count(b":") + opens + 1, bare


def _bare_depth(bare: Octets) -> int:
    """:func:`json_depth` of a body without its strings (a loop when it has few brackets,
    numpy otherwise)."""
    marks = bare.translate(None, _NOT_BRACKETS)
    if len(marks) > 256:
        return int(np.cumsum(_STEPS[np.frombuffer(marks, dtype=np.uint8)], dtype=np.int32).max())
    depth = deepest = 0
    for mark in marks:
        depth += 1 if mark in _OPENS else -1
        deepest = max(deepest, depth)
    return deepest


def _outside(masked: Octets, mark: bytes, spans: list[tuple[int, int]]) -> int:
    total = masked.count(mark)
    if total:
        total -= sum(masked.count(mark, start, end) for start, end in spans)
    return total


def _longest_string(masked: Octets) -> int:
    """The octets inside the longest string of a masked body (quote positions, chunk by chunk,
    so the scan never holds more than a chunk's worth of flags)."""
    view = np.frombuffer(masked, dtype=np.uint8)
    positions = [
        np.flatnonzero(view[start : start + _SCAN_CHUNK] == ord('"')) + start
        for start in range(0, view.size, _SCAN_CHUNK)
    ]
    quotes = np.concatenate(positions) if positions else np.zeros(0, dtype=np.intp)
    pairs = quotes.size // 2
    if pairs == 0:
        return 0
    return int((quotes[1 : 2 * pairs : 2] - quotes[0 : 2 * pairs : 2]).max()) - 1


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise BadRequest(f"JSON number {text[:40]} is not finite", path="$")
    return value


def parse_json(
    body: Octets, max_depth: int = MAX_JSON_DEPTH, *, limits: JsonLimits | None = None
) -> Any:
    """Parse a UTF-8 JSON text strictly (no NaN/Infinity or numbers that overflow to them, no
    BOM, depth ≤ ``max_depth``), within ``limits`` when given (their ``max_depth`` then
    applies; see :func:`json_prescan`).

    Raises:
        PayloadTooLarge: over one of ``limits``.
        BadRequest: with path ``$`` and the position of the first error.
    """
    if limits is not None:  # first: its scratch copies are gone before the text is made
        max_depth = limits.max_depth
        json_prescan(body, limits)
    elif json_depth_exceeds(body, max_depth):
        raise BadRequest(f"JSON nested deeper than {max_depth} levels", path="$")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRequest(f"body is not UTF-8 (octet {exc.start})", path="$") from None
    try:
        return json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
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


Readiness = Callable[[], Awaitable[str | None]]
"""A service's readiness check: ``None`` when it is ready to serve, else why not."""

READYZ_PATH = "/readyz"


def store_readiness(*probes: Callable[[], Awaitable[object]]) -> Readiness:
    """A :data:`Readiness` that is ready when every probe (a cheap read of a service's store)
    answers; a :class:`~kvsp.errors.KVSPError` (such as ``StoreUnavailable``) is the reason."""

    async def check() -> str | None:
        for probe in probes:
            try:
                await probe()
            except KVSPError as exc:
                return f"its store does not answer: {exc}"
        return None

    return check


async def readyz(request: Request) -> Response:
    """``GET /readyz`` (no token): 200 when ``app.state.readiness`` (a :data:`Readiness`; none:
    ready once serving) finds the service ready, else a 503 ``kvsp-not-ready`` problem."""
    check: Readiness | None = getattr(request.app.state, "readiness", None)
    reason = None if check is None else await check()
    if reason is not None:
        raise NotReady(reason)
    return kvsp_json({"status": "ready"})


def install_operations(
    app: Starlette, service: str, title: str, readiness: Readiness | None = None
) -> None:
    """Mount what every service serves for its operators: ``/metrics`` and the request
    metrics (:mod:`kvsp.web.metrics`), request ids and access records
    (:mod:`kvsp.web.logs`), ``/readyz`` (:func:`readyz`, checked by ``readiness``) and
    ``/openapi.json`` (:mod:`kvsp.web.openapi`).

    Call it last while building the app, after :func:`~kvsp.web.problems.
    install_problem_handlers`, so that the middleware sees every answer, 500s included.
    """
    install_metrics(app, service)
    app.state.readiness = readiness
    app.router.routes.append(Route(READYZ_PATH, readyz, methods=["GET"]))
    install_openapi(app, title)
    app.add_middleware(RequestContextMiddleware)  # outermost: ids on every answer
