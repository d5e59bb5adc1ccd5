"""Identifiers and their text forms (spec §4.1–4.4, DESIGN.md §3 "Encodings").

Identifiers are bytes inside the library and hex only at the edge: hex32 is 32 octets as 64
lowercase hex digits, hex16 is 16 octets as 32. Digests in records are ``"sha-256:<hex32>"``.
"""

from __future__ import annotations

import hashlib
import re
from typing import NewType

from kvsp.errors import InvalidIdentifier

CompatId = NewType("CompatId", bytes)
"""A Compatibility ID: 32 octets (§4.1)."""
ScopeId = NewType("ScopeId", bytes)
"""A Scope ID: 16 octets (§4.2)."""
BlockKey = NewType("BlockKey", bytes)
"""A Block Key: 32 octets (§4.2)."""
Digest = NewType("Digest", bytes)
"""A SHA-256 digest: 32 octets."""

DIGEST_PREFIX = "sha-256:"
_HEX32 = re.compile(r"[0-9a-f]{64}")
_HEX16 = re.compile(r"[0-9a-f]{32}")


def _parse_hex(text: object, pattern: re.Pattern[str], what: str, path: str | None) -> bytes:
    if not isinstance(text, str):
        raise InvalidIdentifier(f"expected {what}, got {type(text).__name__}", path=path)
    if pattern.fullmatch(text) is None:
        raise InvalidIdentifier(f"expected {what} (lowercase hex), got {text[:80]!r}", path=path)
    return bytes.fromhex(text)


def parse_hex32(text: object, path: str | None = None) -> bytes:
    """Parse 64 lowercase hex digits into 32 octets.

    Raises:
        InvalidIdentifier: not a string of exactly 64 lowercase hex digits.
    """
    return _parse_hex(text, _HEX32, "hex32", path)


def parse_hex16(text: object, path: str | None = None) -> bytes:
    """Parse 32 lowercase hex digits into 16 octets.

    Raises:
        InvalidIdentifier: not a string of exactly 32 lowercase hex digits.
    """
    return _parse_hex(text, _HEX16, "hex16", path)


def parse_compat_id(text: object, path: str | None = None) -> CompatId:
    """Parse a hex32 Compatibility ID.

    Raises:
        InvalidIdentifier: not hex32.
    """
    return CompatId(parse_hex32(text, path))


def parse_scope_id(text: object, path: str | None = None) -> ScopeId:
    """Parse a hex16 Scope ID.

    Raises:
        InvalidIdentifier: not hex16.
    """
    return ScopeId(parse_hex16(text, path))


def parse_block_key(text: object, path: str | None = None) -> BlockKey:
    """Parse a hex32 Block Key.

    Raises:
        InvalidIdentifier: not hex32.
    """
    return BlockKey(parse_hex32(text, path))


def parse_digest(text: object, path: str | None = None) -> Digest:
    """Parse ``"sha-256:<hex32>"`` into 32 octets.

    Raises:
        InvalidIdentifier: not of that form.
    """
    if not isinstance(text, str) or not text.startswith(DIGEST_PREFIX):
        shown = text[:80] if isinstance(text, str) else type(text).__name__
        raise InvalidIdentifier(f"expected 'sha-256:<hex32>', got {shown!r}", path=path)
    return Digest(parse_hex32(text[len(DIGEST_PREFIX) :], path))


def format_digest(digest: bytes) -> str:
    """Format 32 octets as ``"sha-256:<hex32>"``.

    Raises:
        InvalidIdentifier: not 32 octets.
    """
    if len(digest) != 32:
        raise InvalidIdentifier(f"a SHA-256 digest has 32 octets, got {len(digest)}")
    return DIGEST_PREFIX + digest.hex()


def check_length(value: bytes, length: int, what: str) -> bytes:
    """Return ``value`` if it has exactly ``length`` octets.

    Raises:
        InvalidIdentifier: wrong type or length.
    """
    if not isinstance(value, bytes | bytearray | memoryview) or len(value) != length:
        got = len(value) if isinstance(value, bytes | bytearray | memoryview) else type(value)
        raise InvalidIdentifier(f"{what} must be {length} octets, got {got}")
    return bytes(value)


def uri_id(uri: str) -> str:
    """Name a holder or instance URI in a resource path: hex16 of SHA-256(uri)[:16] (DESIGN §3)."""
    return hashlib.sha256(uri.encode("utf-8")).digest()[:16].hex()
