"""The KVSP registries (spec §11.2; initial entries fixed in DESIGN.md §3).

Codecs, element types, positional encodings (with their parameter syntax), storage tiers and
instance states. Lookups that fail raise a typed :class:`~kvsp.errors.KVSPError`.
"""

from __future__ import annotations

import enum
import functools
import re
from dataclasses import dataclass

from kvsp.errors import BadRequest, DescriptorError


class Codec(enum.IntEnum):
    """ "KVSP Codecs" registry (§11.2.2)."""

    RAW = 0x0001


def codec_from_int(value: int) -> Codec:
    """Return the registered codec for ``value``.

    Raises:
        BadRequest: the codec is not registered.
    """
    try:
        return Codec(value)
    except ValueError:
        raise BadRequest(f"unknown codec 0x{value:04x}") from None


@dataclass(frozen=True, slots=True)
class ElementType:
    """An entry of the "KVSP Element Types" registry (§11.2.3): name, octets, numpy dtype."""

    name: str
    size: int
    numpy_dtype: str
    """The little-endian numpy dtype string; ``bf16``/fp8 have no numpy type and map to uints."""


ELEMENT_TYPES: dict[str, ElementType] = {
    e.name: e
    for e in (
        ElementType("fp32", 4, "<f4"),
        ElementType("fp16", 2, "<f2"),
        ElementType("bf16", 2, "<u2"),
        ElementType("fp8_e4m3", 1, "u1"),
        ElementType("fp8_e5m2", 1, "u1"),
        ElementType("int8", 1, "i1"),
    )
}


def element_type(name: str, path: str | None = None) -> ElementType:
    """Return the registered element type called ``name``.

    Raises:
        DescriptorError: ``name`` is not registered.
    """
    entry = ELEMENT_TYPES.get(name) if isinstance(name, str) else None
    if entry is None:
        known = ", ".join(ELEMENT_TYPES)
        raise DescriptorError(f"unknown kv_dtype {name!r} (registered: {known})", path=path)
    return entry


_NUM = r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"
_NAME = r"[a-z0-9][a-z0-9_.-]*"


@dataclass(frozen=True, slots=True)
class PositionalEncoding:
    """An entry of the "KVSP Positional Encodings" registry: its parameters and their syntax."""

    name: str
    params: dict[str, str]
    """Parameter name → regular expression its value must match."""


POSITIONAL_ENCODINGS: dict[str, PositionalEncoding] = {
    p.name: p
    for p in (
        PositionalEncoding("rope", {"theta": _NUM, "scaling": _NAME, "factor": _NUM}),
        PositionalEncoding("alibi", {}),
        PositionalEncoding("none", {}),
    )
}


def parse_positional(text: str, path: str | None = None) -> tuple[str, dict[str, str]]:
    """Parse ``name;key=value;key=value`` (keys sorted, each at most once) into its parts.

    Raises:
        DescriptorError: unknown encoding, unknown or repeated key, unsorted keys, or a value
            that does not match the registered syntax.
    """
    if not isinstance(text, str):
        raise DescriptorError(f"expected a string, got {type(text).__name__}", path=path)
    try:
        name, params = _parse_positional(text)
    except DescriptorError as exc:
        raise DescriptorError(exc.detail, path=path) from None
    return name, dict(params)


@functools.lru_cache(maxsize=256)
def _parse_positional(text: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    # Descriptors repeat the same few strings; validation dominates compat_id(dict) otherwise.
    name, *parts = text.split(";")
    entry = POSITIONAL_ENCODINGS.get(name)
    if entry is None:
        known = ", ".join(POSITIONAL_ENCODINGS)
        raise DescriptorError(f"unknown positional encoding {name!r} ({known})")
    params: dict[str, str] = {}
    for part in parts:
        key, sep, value = part.partition("=")
        if not sep or key not in entry.params:
            raise DescriptorError(f"{name}: unknown parameter {part!r}")
        if params and key <= max(params):
            raise DescriptorError(f"{name}: parameters must be sorted and unique")
        if re.fullmatch(entry.params[key], value) is None:
            raise DescriptorError(f"{name}: bad value for {key}: {value!r}")
        params[key] = value
    return name, tuple(params.items())


class Tier(enum.StrEnum):
    """Storage tiers named in residency entries (DESIGN.md §3)."""

    DEVICE = "device"
    HOST = "host"
    DISK = "disk"


class InstanceState(enum.StrEnum):
    """Instance lifecycle states (§6.3)."""

    ACTIVE = "active"
    DRAINING = "draining"
    SLEEPING = "sleeping"
    FAILED = "failed"


class DirectiveState(enum.StrEnum):
    """Prefetch directive states (§6.5)."""

    PENDING = "pending"
    PARTIAL = "partial"
    COMPLETE = "complete"
    FAILED = "failed"


LAYOUTS = frozenset({"kvsp-layout-1"})
"""Layout identifiers for codec raw (§4.3)."""
