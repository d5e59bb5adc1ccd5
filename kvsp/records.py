"""The JSON records of KVSP (spec §4.4; message bodies of §6.2, §6.3, §6.5, §6.6, §6.8, §6.9).

Every record is a frozen dataclass with ``from_json(obj, path="$")`` and ``to_json()``; unknown
members are ignored (§4.4), absent, ``null`` and empty stay distinct, and every error is a
:class:`~kvsp.errors.RecordError` naming the JSON path. The records live in
``records_replica`` (§4.4, §6.2), ``records_control`` (§6.3, §6.5, §6.6, place),
``records_session`` (§6.8) and ``records_shard`` (§6.9); this module re-exports them and turns
JSON bytes into Python values (:func:`loads`) and records into bytes (:func:`dumps`).
"""

from __future__ import annotations

import json
import math
from typing import Any, Protocol

from kvsp.errors import RecordError
from kvsp.records_common import TokenRange
from kvsp.records_control import (
    DirectiveBlock,
    DirectiveStatus,
    InstanceStatusRecord,
    LeaseGrant,
    LeaseRenewal,
    LeaseRequest,
    Link,
    PlaceRequest,
    PlaceResponse,
    PrefetchDirective,
    StateAnswer,
)
from kvsp.records_replica import (
    LookupRequest,
    LookupResponse,
    ReplicaRecord,
    Residency,
    TargetEstimate,
)
from kvsp.records_session import ResumeRequest, Sampler, SessionCheckpoint
from kvsp.records_shard import (
    ReshardAbort,
    ReshardCommit,
    ReshardFetch,
    ReshardMessage,
    ReshardPlan,
    Shard,
    ShardMap,
    parse_reshard_message,
)

__all__ = [
    "MAX_DEPTH",
    "DirectiveBlock",
    "DirectiveStatus",
    "InstanceStatusRecord",
    "LeaseGrant",
    "LeaseRenewal",
    "LeaseRequest",
    "Link",
    "LookupRequest",
    "LookupResponse",
    "PlaceRequest",
    "PlaceResponse",
    "PrefetchDirective",
    "ReplicaRecord",
    "ReshardAbort",
    "ReshardCommit",
    "ReshardFetch",
    "ReshardMessage",
    "ReshardPlan",
    "Residency",
    "ResumeRequest",
    "Sampler",
    "SessionCheckpoint",
    "Shard",
    "ShardMap",
    "StateAnswer",
    "TargetEstimate",
    "TokenRange",
    "dumps",
    "loads",
    "parse_reshard_message",
]

MAX_DEPTH = 64
"""Deepest nesting of arrays and objects :func:`loads` accepts."""
_NOT_STRUCTURE = bytes(range(256)).translate(None, b'"[]{}')
"""Every octet except quotes and brackets: deleted to get a document's bare structure."""
_AS_ARRAYS = bytes.maketrans(b"{}", b"[]")
"""Objects nest like arrays: mapping braces to brackets leaves one pair to peel per level."""


class SupportsToJson(Protocol):
    """Anything with a ``to_json()`` that returns JSON values (every record here)."""

    def to_json(self) -> Any:
        """Return the JSON value."""


def dumps(record: SupportsToJson | Any) -> bytes:
    """Serialize a record (anything with ``to_json``) or a plain JSON value as compact UTF-8.

    Raises:
        ValueError: a value that is not JSON (NaN, infinity, or a non-JSON type).
    """
    value = record.to_json() if hasattr(record, "to_json") else record
    text = json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return text.encode("utf-8")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} is out of range")
    return value


def _unique_members(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        # RFC 8259 §4 leaves duplicates to the parser; peers could read different values.
        raise ValueError("duplicate member name in object")
    return obj


def _too_deep(data: bytes) -> bool:
    """Whether the arrays and objects in ``data`` nest deeper than :data:`MAX_DEPTH`.

    Works on octets without recursion: drop escaped backslashes and quotes, keep only quotes
    and brackets (braces become brackets), drop string contents, then peel the innermost ``[]``
    pairs once per level. Malformed input may give either answer; the parser rejects it anyway.
    """
    if len(data) <= 2 * MAX_DEPTH:
        return False
    if b"\\" in data:
        data = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    # Adjacent quotes are an empty string or the seam between two strings: dropping them keeps
    # the open/close alternation, so what is left between quotes is still string content.
    shape = data.translate(_AS_ARRAYS, _NOT_STRUCTURE).replace(b'""', b"")
    if b'"' in shape:
        shape = b"".join(shape.split(b'"')[::2])
    for _ in range(MAX_DEPTH):
        shape = shape.replace(b"[]", b"")  # one level per pass: replace does not rescan
        if not shape:
            return False
    return True


def loads(data: bytes | bytearray | memoryview | str) -> Any:
    """Parse a JSON document (UTF-8) into Python values for the records' ``from_json``.

    Raises:
        RecordError: at ``$``, for bytes that are not UTF-8, malformed JSON, NaN or Infinity,
            numbers beyond a double, duplicate member names, or nesting deeper than
            :data:`MAX_DEPTH`.
    """
    try:
        raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    except UnicodeEncodeError:
        raise RecordError("malformed JSON: text with lone surrogates", path="$") from None
    if _too_deep(raw):
        raise RecordError(f"malformed JSON: nesting deeper than {MAX_DEPTH}", path="$")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RecordError(f"malformed JSON: not UTF-8 ({exc.reason})", path="$") from None
    try:
        return json.loads(
            text,
            parse_constant=_reject_constant,
            parse_float=_finite_float,
            object_pairs_hook=_unique_members,
        )
    except RecursionError:
        raise RecordError("malformed JSON: nesting too deep", path="$") from None
    except ValueError as exc:
        raise RecordError(f"malformed JSON: {exc}", path="$") from None
