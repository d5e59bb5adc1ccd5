"""Shared readers for the §4.4 records: URIs, UUIDs, key lists, token ranges (spec §4.4, §6).

Every reader takes the JSON value and its JSON path and raises
:class:`~kvsp.errors.RecordError` naming that path. The record modules (``records_replica``,
``records_control``, ``records_session``, ``records_shard``) build on these; ``kvsp.records``
re-exports the records themselves.
"""

from __future__ import annotations

import functools
import re
import uuid
from collections.abc import Iterable, Sequence
from typing import Any
from urllib.parse import urlsplit

from kvsp.errors import RecordError
from kvsp.fields import Fields, check_int, parse_hex32_at, type_name
from kvsp.ids import BlockKey

UINT32_MAX = 2**32 - 1
MAX_KEYS = 1_000_000
"""Cap on block-key lists in one message (a 131k-token prompt at B=16 has 8,192 keys)."""
MAX_URI_LENGTH = 2048
MAX_NAME_LENGTH = 128

URI_SCHEMES = frozenset({"https", "http", "moqt"})
HTTP_SCHEMES = frozenset({"https", "http"})
CARRIER_SCHEMES = frozenset({"moqt+tls", "moqt+tcp", "moqt+unix"})
"""``moqt_carriers`` (DESIGN §4): the MOQT-over-QMux endpoints a holder offers beside its QUIC
``moqt://`` URI (TLS 1.3 over TCP, plain TCP, a Unix domain socket on the holder's host)."""
_UUID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")
_NAME = re.compile(r"[A-Za-z0-9._~-]+")
_URI_FORBIDDEN = re.compile(r"[\x00-\x20\x7f\"<>\\^`{|}]")
LABEL_PATTERN = "^[a-z0-9][a-z0-9-]{0,62}$"
"""A site or zone label (the extension members ``site``/``zone``, which peers that do not know
them ignore, spec §4.4): lowercase letters, digits and hyphens, at most 63 characters, not
starting with a hyphen."""
_LABEL = re.compile(LABEL_PATTERN[1:-1])

TokenRange = tuple[int, int]
"""A half-open token range ``[start, end)`` (§6.9)."""


def as_list(value: object, path: str) -> list[Any] | tuple[Any, ...]:
    """Return ``value`` if it is a JSON array.

    Raises:
        RecordError: not an array.
    """
    if not isinstance(value, list | tuple):
        raise RecordError(f"expected an array, got {type_name(value)}", path=path)
    return value


@functools.lru_cache(maxsize=4096)
def uri_scheme(value: str) -> str | None:
    """The lowercase scheme of an absolute URI with a host, or ``None`` if ``value`` is not one
    (cached: the same few holder and instance URIs recur in every lookup answer)."""
    if len(value) > MAX_URI_LENGTH or _URI_FORBIDDEN.search(value):
        return None
    try:
        parts = urlsplit(value)
        host = parts.hostname
    except ValueError:
        return None
    return parts.scheme if parts.scheme and host else None


def read_uri(value: object, path: str, schemes: frozenset[str] = URI_SCHEMES) -> str:
    """Check an absolute URI with one of ``schemes`` and a host (a holder or instance).

    Raises:
        RecordError: not a string, too long, not absolute, wrong scheme, no host, or
            characters that RFC 3986 does not allow.
    """
    if not isinstance(value, str):
        raise RecordError(f"expected a URI string, got {type_name(value)}", path=path)
    if uri_scheme(value) not in schemes:
        allowed = "/".join(sorted(schemes))
        raise RecordError(f"expected an absolute {allowed} URI with a host", path=path)
    return value


def read_uris(
    value: object,
    path: str,
    *,
    nonempty: bool = False,
    unique: bool = False,
    schemes: frozenset[str] = URI_SCHEMES,
) -> tuple[str, ...]:
    """Read an array of URIs.

    Raises:
        RecordError: not an array, empty when ``nonempty``, a repeated URI when ``unique``, or a
            bad URI (named by index).
    """
    items = as_list(value, path)
    if nonempty and not items:
        raise RecordError("must not be empty", path=path)
    uris = tuple(read_uri(item, f"{path}[{i}]", schemes) for i, item in enumerate(items))
    if unique:
        check_unique(uris, path)
    return uris


def check_unique(values: Sequence[str], path: str) -> None:
    """Reject a repeated value in ``values``; the error names the later index.

    Raises:
        RecordError: a value appears twice.
    """
    seen: set[str] = set()
    for i, item in enumerate(values):
        if item in seen:
            raise RecordError(f"duplicate {item!r}", path=f"{path}[{i}]")
        seen.add(item)


MAX_OPAQUE_LENGTH = 1024


def read_opaque(fields: Fields, key: str) -> str | None:
    """Read an optional opaque string (``request_ref``, ``detail``, ``hint``) of at most 1,024
    characters; absent and ``null`` both give ``None``.

    Raises:
        RecordError: not a string, or too long.
    """
    value: str | None = fields.string(key, optional=True, nullable=True)
    if value is not None and len(value) > MAX_OPAQUE_LENGTH:
        raise RecordError(f"at most {MAX_OPAQUE_LENGTH} characters", path=fields.at(key))
    return value


def read_name(value: object, path: str) -> str:
    """Read an opaque identifier used in resource paths (shard map, lease): URL-unreserved
    characters only, 1 to 128 of them.

    Raises:
        RecordError: not such a string.
    """
    if not isinstance(value, str):
        raise RecordError(f"expected a string, got {type_name(value)}", path=path)
    if len(value) > MAX_NAME_LENGTH or _NAME.fullmatch(value) is None:
        raise RecordError("expected 1-128 characters from [A-Za-z0-9._~-]", path=path)
    return value


def read_uuid(value: object, path: str) -> uuid.UUID:
    """Read an RFC 9562 UUID in its hyphenated form (either case; written back lowercase).

    The variant must be the RFC 9562 one and the version 1-8, which rules out the Nil and Max
    UUIDs as identifiers.

    Raises:
        RecordError: not a string of that form.
    """
    if not isinstance(value, str):
        raise RecordError(f"expected a UUID string, got {type_name(value)}", path=path)
    if _UUID.fullmatch(value) is None:
        raise RecordError("expected a UUID (8-4-4-4-12 hex digits)", path=path)
    parsed = uuid.UUID(value)
    if parsed.variant != uuid.RFC_4122 or not 1 <= (parsed.version or 0) <= 8:
        raise RecordError("not an RFC 9562 UUID (variant or version)", path=path)
    return parsed


def read_hex32_list(
    value: object, path: str, *, nonempty: bool = False, limit: int = MAX_KEYS
) -> tuple[bytes, ...]:
    """Read an array of hex32 strings (block keys, layer digests) as 32-octet values.

    Valid arrays are decoded in one pass; only a bad one is walked item by item, so the error
    names the first bad index.

    Raises:
        RecordError: not an array, empty when ``nonempty``, longer than ``limit``, or an item
            that is not 64 lowercase hex digits.
    """
    items = as_list(value, path)
    if nonempty and not items:
        raise RecordError("must not be empty", path=path)
    if len(items) > limit:
        raise RecordError(f"at most {limit} entries allowed, got {len(items)}", path=path)
    try:
        joined = "".join(items)  # TypeError unless every item is a string
        raw = bytes.fromhex(joined)  # ValueError unless hex (upper case and spaces pass)
    except (TypeError, ValueError):
        pass
    else:
        # Round-tripping rules out upper case and spaces; the lengths rule out misaligned items.
        if raw.hex() == joined and set(map(len, items)) <= {64}:
            return tuple([raw[i : i + 32] for i in range(0, len(raw), 32)])
    return tuple(parse_hex32_at(item, f"{path}[{i}]") for i, item in enumerate(items))


def read_block_keys(
    fields: Fields, key: str = "block_keys", *, nonempty: bool = False
) -> tuple[BlockKey, ...]:
    """Read a required array of hex32 Block Keys from ``fields``.

    Raises:
        RecordError: missing, or as :func:`read_hex32_list`.
    """
    values = read_hex32_list(fields.raw(key), fields.at(key), nonempty=nonempty)
    return tuple(BlockKey(v) for v in values)


def hex_list(values: Iterable[bytes]) -> list[str]:
    """Render octet strings as lowercase hex for JSON."""
    return [v.hex() for v in values]


def read_uint32_list(value: object, path: str) -> tuple[int, ...]:
    """Read an array of uint32 values (token identifiers, §4.2).

    Raises:
        RecordError: not an array or an item that is not an integer in [0, 2^32-1].
    """
    items = as_list(value, path)
    return tuple(
        check_int(item, f"{path}[{i}]", maximum=UINT32_MAX) for i, item in enumerate(items)
    )


def read_pair(value: object, path: str, *, half_open: bool) -> tuple[int, int]:
    """Read ``[a, b]`` of uint32 values with ``a < b`` (half-open) or ``a <= b`` (inclusive).

    Raises:
        RecordError: not a two-element array of uint32 values in that order.
    """
    items = as_list(value, path)
    if len(items) != 2:
        raise RecordError(f"expected [start, end], got {len(items)} elements", path=path)
    first, last = items
    if not (type(first) is int and type(last) is int and 0 <= first <= last <= UINT32_MAX):
        first = check_int(first, f"{path}[0]", maximum=UINT32_MAX)
        last = check_int(last, f"{path}[1]", maximum=UINT32_MAX)
    if first > last or (half_open and first == last):
        rule = "start < end" if half_open else "first <= last"
        raise RecordError(f"range must have {rule}, got [{first}, {last}]", path=path)
    return first, last


def check_disjoint(ranges: Iterable[tuple[int, int, str]]) -> None:
    """Reject overlapping half-open ranges given as ``(start, end, path)``.

    Raises:
        RecordError: two ranges overlap; the path is that of the one starting later.
    """
    previous: tuple[int, int, str] | None = None
    for current in sorted(ranges, key=lambda r: (r[0], r[1])):
        if previous is not None and current[0] < previous[1]:
            raise RecordError(f"range overlaps {previous[2]}", path=current[2])
        if previous is None or current[1] > previous[1]:
            previous = current


def number_json(value: float) -> int | float:
    """Write an integral float as a JSON integer (``400000``, not ``400000.0``)."""
    if value.is_integer() and abs(value) < 2**53:
        return int(value)
    return value


def read_rate(fields: Fields, key: str) -> float:
    """Read a required positive finite rate (Mbit/s): a rate of zero would make the §6.4
    estimates divide by zero, so a source that cannot be reached is left out instead.

    Raises:
        RecordError: missing, not a number, or not > 0.
    """
    rate: float = fields.number(key)
    if rate <= 0:
        raise RecordError("must be > 0", path=fields.at(key))
    return rate


def read_optional_rate(fields: Fields, key: str) -> float | None:
    """Read an optional positive finite rate (``None`` when absent).

    Raises:
        RecordError: ``null``, not a number, or not > 0.
    """
    return read_rate(fields, key) if fields.has(key) else None


def check_label(value: str, what: str = "label") -> str:
    """``value`` when it is a site or zone label (:data:`LABEL_PATTERN`).

    Raises:
        ValueError: anything else (the message names ``what`` and the pattern).
    """
    if not _LABEL.fullmatch(value):
        raise ValueError(f"{what} {value[:80]!r} does not match {LABEL_PATTERN}")
    return value


def read_label(fields: Fields, key: str) -> str | None:
    """The optional site or zone label ``key`` (absent: ``None``).

    Raises:
        RecordError: ``null``, not a string, or not a label, at the member's path.
    """
    value = fields.string(key, optional=True)
    if value is None:
        return None
    try:
        return check_label(value, key)
    except ValueError as exc:
        raise RecordError(str(exc), path=fields.at(key)) from None
