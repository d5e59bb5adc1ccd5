"""Audience-bound credentials and the origins they bind to (DESIGN.md §3 "Authentication and
scope authorization"; spec §6.1, §6.6, §6.7 authorization).

A bearer token works at the control plane (IS, PC) and anywhere else it is shown, so a holder,
relay or instance that received one could replay it. Everything that is not the control plane
therefore receives an *audience credential* instead::

    Bearer kvsp-aud1.<kid>.<mac>

where ``K`` is the principal's ``token_sha256`` (what the principals file stores), ``kid`` the
first 8 octets (hex) of ``SHA-256("kvsp-audience-kid-v1\\n" || K)`` so that the receiver finds
the principal without trying each one, and ``mac`` the base64url (no padding) of
``HMAC-SHA256(K, "kvsp-audience-v1\\n" || audience)``. The audience is the canonical origin
(:func:`canonical_origin`) of the service the credential is for: the holder URI the IS vouched
for in a record, or a URI the operator configured. A receiver accepts a credential only for one
of its own advertised origins; the IS and PC accept none, so a credential a holder received
opens nothing at the control plane nor at any other holder.

Whoever holds the principals file can mint any principal's audience credentials: the file is a
deployment secret, as the tokens are.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import hmac
from collections.abc import Iterable
from urllib.parse import urlsplit

from kvsp.errors import BadAudience

PREFIX = "kvsp-aud1."
"""How an audience credential starts; a minted token (base64url) never contains a dot."""
_KID_OCTETS = 8
_KID_LABEL = b"kvsp-audience-kid-v1\n"
_MAC_LABEL = b"kvsp-audience-v1\n"
_DEFAULT_PORTS = {"http": 80, "https": 443, "moqt": 443}
_SCHEMES = frozenset({"http", "https", "moqt", "moqt+tls", "moqt+tcp", "moqt+unix"})


@functools.lru_cache(maxsize=1024)  # the same few service URIs on every request
def canonical_origin(uri: str) -> str:
    """The audience of ``uri``: ``scheme://host[:port]`` in lowercase, default ports dropped;
    a ``moqt+unix`` URI keeps its socket path (``moqt+unix://localhost/run/r.sock``).

    Raises:
        BadAudience: not an http(s) or moqt URI with a host and a valid port.
    """
    parts = urlsplit(uri.strip())
    scheme = parts.scheme.lower()
    try:
        port = parts.port
    except ValueError:
        raise BadAudience(f"{uri[:120]!r}: not a valid port") from None
    host = parts.hostname
    if scheme not in _SCHEMES or not host:
        raise BadAudience(f"{uri[:120]!r} is not an http(s) or moqt URI with a host")
    shown = f"[{host}]" if ":" in host else host
    if scheme == "moqt+unix":
        return f"{scheme}://{shown}{parts.path}"
    if port is None or port == _DEFAULT_PORTS.get(scheme):
        return f"{scheme}://{shown}"
    return f"{scheme}://{shown}:{port}"


def same_origin(a: str, b: str) -> bool:
    """Whether ``a`` and ``b`` have the same canonical origin (False when either has none)."""
    try:
        return canonical_origin(a) == canonical_origin(b)
    except BadAudience:
        return False


@functools.lru_cache(maxsize=1024)
def lease_base_allowed(holder: str, lease_base: str) -> bool:
    """Whether a record naming ``holder`` may send lease requests to ``lease_base``: the same
    origin as an http(s) holder; for a ``moqt`` holder (a relay, whose HTTP face listens on
    another port) an http(s) base on the holder's own host. Remembered for recent pairs: every
    record of a relay's copy in a lookup answer names the same two."""
    try:
        home, base = urlsplit(holder), urlsplit(lease_base)
        home_host, base_host = home.hostname, base.hostname
    except ValueError:
        return False
    if base.scheme.lower() not in ("http", "https") or not base_host or not home_host:
        return False
    if home.scheme.lower() == "moqt":
        return base_host.lower() == home_host.lower()
    return same_origin(holder, lease_base)


def key_id(token_sha256: bytes) -> str:
    """The ``kid`` of the principal whose token hashes to ``token_sha256``: one-way, short."""
    return hashlib.sha256(_KID_LABEL + token_sha256).digest()[:_KID_OCTETS].hex()


def _mac(token_sha256: bytes, audience: str) -> str:
    digest = hmac.new(token_sha256, _MAC_LABEL + audience.encode("utf-8"), "sha256").digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")


def audience_credential(token: str, uri: str) -> str:
    """The credential ``token``'s owner shows to the service at ``uri`` (without ``Bearer``).

    Raises:
        BadAudience: ``uri`` has no origin.
    """
    return credential_for_key(hashlib.sha256(token.encode("ascii")).digest(), uri)


def credential_for_key(token_sha256: bytes, uri: str) -> str:
    """:func:`audience_credential` from the token's SHA-256 (as a principals file stores it).

    Raises:
        BadAudience: ``uri`` has no origin.
    """
    audience = canonical_origin(uri)
    return f"{PREFIX}{key_id(token_sha256)}.{_mac(token_sha256, audience)}"


def split_credential(value: str) -> tuple[str, str] | None:
    """``(kid, mac)`` of an audience credential, or None when ``value`` is not one."""
    if not value.startswith(PREFIX):
        return None
    kid, dot, mac = value[len(PREFIX) :].partition(".")
    if not dot or len(kid) != 2 * _KID_OCTETS or not mac or "." in mac:
        return ("", "")  # shaped like a credential but garbled: matches nothing
    return kid, mac


def verify_mac(token_sha256: bytes, mac: str, audiences: Iterable[str]) -> bool:
    """Whether ``mac`` binds ``token_sha256`` to one of ``audiences`` (canonical origins);
    each comparison is constant-time."""
    found = False
    for audience in audiences:
        found |= hmac.compare_digest(_mac(token_sha256, audience).encode(), mac.encode("ascii"))
    return found


def origins(uris: Iterable[str | None]) -> frozenset[str]:
    """The canonical origins of ``uris`` (None and URIs without an origin are skipped): what
    a service passes as the audiences it accepts."""
    out: set[str] = set()
    for uri in uris:
        if uri is None:
            continue
        try:
            out.add(canonical_origin(uri))
        except BadAudience:
            continue
    return frozenset(out)


class AudienceSigner:
    """Turns one bearer token into the ``Authorization`` value for each receiving URI, caching
    per origin; ``None`` token gives no header."""

    __slots__ = ("_cache", "_key")

    def __init__(self, token: str | None) -> None:
        self._key = None if token is None else hashlib.sha256(token.encode("ascii")).digest()
        self._cache: dict[str, str] = {}

    def __bool__(self) -> bool:
        return self._key is not None

    def authorization(self, uri: str) -> str | None:
        """``Bearer <credential for uri's origin>``, or None without a token.

        Raises:
            BadAudience: ``uri`` has no origin.
        """
        if self._key is None:
            return None
        audience = canonical_origin(uri)
        value = self._cache.get(audience)
        if value is None:
            value = "Bearer " + credential_for_key(self._key, audience)
            if len(self._cache) < 4096:
                self._cache[audience] = value
        return value

    def credential(self, uri: str) -> bytes | None:
        """The bare credential for ``uri`` as octets (the MOQT AUTHORIZATION TOKEN value).

        Raises:
            BadAudience: ``uri`` has no origin.
        """
        header = self.authorization(uri)
        return None if header is None else header[len("Bearer ") :].encode("ascii")


__all__ = [
    "PREFIX",
    "AudienceSigner",
    "BadAudience",
    "audience_credential",
    "canonical_origin",
    "credential_for_key",
    "key_id",
    "lease_base_allowed",
    "origins",
    "same_origin",
    "split_credential",
    "verify_mac",
]
