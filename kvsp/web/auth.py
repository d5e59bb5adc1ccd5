"""Authentication and authorization of principals (spec §6.1, §6.2, §6.7 authorization;
DESIGN.md §3 "Authentication and scope authorization").

Every request carries ``Authorization: Bearer <token>``. A principals file (TOML) maps the
SHA-256 of each token to a :class:`Principal` with roles, the scopes it may use and the holder
URIs it may publish for; the token itself is stored nowhere but with its owner. The embedded
default creates a file with a single admin principal and never runs open
(:func:`ensure_default_principals`). Neither the loader nor this module logs tokens or file
contents.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
import tomllib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from starlette.requests import Request

from kvsp.audience import key_id, split_credential, verify_mac
from kvsp.errors import BadRequest, Forbidden, Unauthorized
from kvsp.web.clock import Clock

ROLES = frozenset({"holder", "instance", "pc", "relay", "client", "admin", "metrics"})
"""The roles a principal may have; what each may call is :data:`kvsp.web.roles.RULES`
(``metrics`` reads only ``/metrics``; admin may do everything)."""
ALL_SCOPES = "*"
PRINCIPALS_FILE = "principals.toml"
ADMIN_TOKEN_FILE = "admin.token"

_HEX32 = re.compile(r"[0-9a-f]{64}")
_HEX16 = re.compile(r"[0-9a-f]{32}")
# RFC 6750 §2.1: "Bearer" (any case), one or more spaces, a token68.
_BEARER = re.compile(r"[Bb][Ee][Aa][Rr][Ee][Rr] +([A-Za-z0-9._~+/-]+=*) *")


class PrincipalsError(BadRequest):
    """A principals file or entry list that is not valid; ``path`` is the TOML path."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Principal:
    """An authenticated party: its roles, scopes (``None`` = all) and publishable holders."""

    name: str
    roles: frozenset[str]
    scopes: frozenset[bytes] | None
    holders: frozenset[str] = frozenset()
    expires_ms: int | None = None
    token_sha256: bytes = field(default=b"", repr=False)


class Principals:
    """The principals known to a service, looked up by the SHA-256 of their bearer token."""

    __slots__ = ("_audiences", "_by_hash", "_by_kid")

    def __init__(self, principals: Iterable[Principal]) -> None:
        self._by_hash: dict[bytes, Principal] = {}
        self._by_kid: dict[str, list[Principal]] = {}
        self._audiences: Callable[[], frozenset[str]] = frozenset
        for p in principals:
            self._by_hash[p.token_sha256] = p
            self._by_kid.setdefault(key_id(p.token_sha256), []).append(p)

    def __len__(self) -> int:
        return len(self._by_hash)

    def replace_with(self, other: Principals) -> None:
        """Take ``other``'s principals in place (a reload): this object, and every
        :meth:`with_audiences` view of it, answers with the new tokens from now on."""
        by_hash, by_kid = dict(other._by_hash), {k: list(v) for k, v in other._by_kid.items()}
        self._by_hash.clear()
        self._by_hash.update(by_hash)
        self._by_kid.clear()
        self._by_kid.update(by_kid)

    def with_audiences(self, audiences: Callable[[], frozenset[str]]) -> Principals:
        """The same principals, accepting audience credentials for the origins ``audiences()``
        gives (a service whose own URIs are known only once it listens: the relay)."""
        bound = Principals(())
        bound._by_hash, bound._by_kid, bound._audiences = self._by_hash, self._by_kid, audiences
        return bound

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Principals:
        """Read a principals file.

        Raises:
            PrincipalsError: unreadable, not TOML, or an entry that is not valid; the message
                names the file and the TOML path, never the file's contents.
        """
        where = os.fspath(path)
        try:
            with open(where, "rb") as f:
                doc = tomllib.load(f)
        except OSError as exc:
            raise PrincipalsError(f"cannot read {where}: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise PrincipalsError(f"{where} is not valid TOML: {exc}") from None
        return cls.from_document(doc, source=where)

    @classmethod
    def from_document(cls, doc: Mapping[str, Any], source: str = "<principals>") -> Principals:
        """Build from a parsed principals document (``{"principal": [...]}``).

        Raises:
            PrincipalsError: a member is missing or of the wrong form.
        """
        entries = doc.get("principal", [])
        if not isinstance(entries, list):
            raise PrincipalsError(f"expected an array of tables (in {source})", path="principal")
        return cls.from_entries(entries, source=source)

    @classmethod
    def from_entries(
        cls, entries: Sequence[Mapping[str, Any]], source: str = "<principals>"
    ) -> Principals:
        """Build from principal entries shaped like the file's ``[[principal]]`` tables.

        Raises:
            PrincipalsError: a member is missing or of the wrong form, or two entries share a
                name or a token.
        """
        principals = [_parse_entry(e, f"principal[{i}]", source) for i, e in enumerate(entries)]
        names: set[str] = set()
        hashes: set[bytes] = set()
        for i, p in enumerate(principals):
            if p.name in names:
                raise PrincipalsError(f"duplicate name (in {source})", path=f"principal[{i}].name")
            if p.token_sha256 in hashes:
                where = f"principal[{i}].token_sha256"
                raise PrincipalsError(f"two principals share a token (in {source})", path=where)
            names.add(p.name)
            hashes.add(p.token_sha256)
        return cls(principals)

    def authenticate(
        self, authorization: str | None, now_ms: int, audiences: frozenset[str] | None = None
    ) -> Principal:
        """The principal whose bearer token, or audience credential for one of ``audiences``
        (this service's own canonical origins, :mod:`kvsp.audience`; default: those of
        :meth:`with_audiences`), is in the ``Authorization`` field value. With no audiences
        (the IS and PC) only tokens count.

        Raises:
            Unauthorized: the field is missing, not ``Bearer <token>``, or the token is unknown
                or expired, or a credential bound to another audience or principal.
        """
        if authorization is None:
            raise Unauthorized("missing Authorization: Bearer <token>")
        found = _BEARER.fullmatch(authorization)
        if found is None:
            raise Unauthorized("expected Authorization: Bearer <token>")
        presented = found.group(1)
        bound = split_credential(presented)
        if bound is not None:
            own = self._audiences() if audiences is None else audiences
            candidate = self._by_audience(bound, own)
        else:
            digest = hashlib.sha256(presented.encode("ascii")).digest()
            candidate = self._by_hash.get(digest)
            # The dict finds the entry; the decision itself is a constant-time comparison.
            if candidate is not None and not hmac.compare_digest(candidate.token_sha256, digest):
                candidate = None
        if candidate is None:
            raise Unauthorized("unknown token")
        if candidate.expires_ms is not None and now_ms >= candidate.expires_ms:
            raise Unauthorized("token expired")
        return candidate

    def _by_audience(self, bound: tuple[str, str], audiences: frozenset[str]) -> Principal | None:
        kid, mac = bound
        if not audiences:
            return None  # the control plane takes tokens only
        for candidate in self._by_kid.get(kid, ()):
            if verify_mac(candidate.token_sha256, mac, sorted(audiences)):
                return candidate
        return None


def _fail(detail: str, path: str, source: str) -> PrincipalsError:
    return PrincipalsError(f"{detail} (in {source})", path=path)


def _string_list(entry: Mapping[str, Any], key: str, path: str, source: str) -> list[str]:
    value = entry.get(key, [])
    if not isinstance(value, list):
        raise _fail("expected an array of strings", f"{path}.{key}", source)
    for i, item in enumerate(value):
        if not isinstance(item, str):
            raise _fail("expected a string", f"{path}.{key}[{i}]", source)
    return value


def _parse_scopes(entry: Mapping[str, Any], path: str, source: str) -> frozenset[bytes] | None:
    scopes = _string_list(entry, "scopes", path, source)
    if ALL_SCOPES in scopes:
        if len(scopes) != 1:
            raise _fail('"*" stands alone', f"{path}.scopes", source)
        return None
    for i, scope in enumerate(scopes):
        if _HEX16.fullmatch(scope) is None:
            raise _fail('expected hex16 or "*"', f"{path}.scopes[{i}]", source)
    return frozenset(bytes.fromhex(s) for s in scopes)


def _parse_expires(entry: Mapping[str, Any], path: str, source: str) -> int | None:
    value = entry.get("expires")
    if value is None:
        return None
    if isinstance(value, datetime) and value.tzinfo is not None:
        return int(value.timestamp() * 1000)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise _fail(
        "expected an offset date-time or milliseconds since the epoch", f"{path}.expires", source
    )


def _parse_entry(entry: Any, path: str, source: str) -> Principal:
    if not isinstance(entry, Mapping):
        raise _fail("expected a table", path, source)
    name = entry.get("name")
    if not isinstance(name, str) or not name:
        raise _fail("expected a non-empty string", f"{path}.name", source)
    token_hash = entry.get("token_sha256")
    # The value is not echoed: it is a hash, but it is still the key to a credential.
    if not isinstance(token_hash, str) or _HEX32.fullmatch(token_hash) is None:
        raise _fail("expected 64 lowercase hex digits", f"{path}.token_sha256", source)
    roles = _string_list(entry, "roles", path, source)
    for i, role in enumerate(roles):
        if role not in ROLES:
            known = ", ".join(sorted(ROLES))
            raise _fail(f"unknown role {role[:40]!r} ({known})", f"{path}.roles[{i}]", source)
    return Principal(
        name=name,
        roles=frozenset(roles),
        scopes=_parse_scopes(entry, path, source),
        holders=frozenset(_string_list(entry, "holders", path, source)),
        expires_ms=_parse_expires(entry, path, source),
        token_sha256=bytes.fromhex(token_hash),
    )


def may_use_scope(p: Principal, scope_id: bytes) -> bool:
    """Whether ``p`` may use scope ``scope_id`` (§6.1, §6.2, §6.7). Scopes are explicit, even
    for admins: the default admin entry lists ``"*"``."""
    return p.scopes is None or bytes(scope_id) in p.scopes


def require_scope(p: Principal, scope_id: bytes) -> None:
    """Require that ``p`` may use scope ``scope_id``.

    Raises:
        Forbidden: it may not.
    """
    if not may_use_scope(p, scope_id):
        raise Forbidden(f"principal {p.name!r} is not authorized for this scope")


def may_publish_for(p: Principal, holder_uri: str) -> bool:
    """Whether ``p`` may publish records naming ``holder_uri`` (§6.1): admin, or exact match."""
    return "admin" in p.roles or holder_uri in p.holders


def require_publish_for(p: Principal, holder_uri: str) -> None:
    """Require that ``p`` may publish for ``holder_uri`` (§6.1).

    Raises:
        Forbidden: it may not.
    """
    if not may_publish_for(p, holder_uri):
        raise Forbidden(f"principal {p.name!r} may not publish for holder {holder_uri[:200]!r}")


def has_role(p: Principal, *roles: str) -> bool:
    """Whether ``p`` has one of ``roles`` (admin has every role)."""
    return "admin" in p.roles or not p.roles.isdisjoint(roles)


def require_role(p: Principal, *roles: str) -> None:
    """Require that ``p`` has one of ``roles`` (admin has every role).

    Raises:
        Forbidden: it has none of them.
    """
    if not has_role(p, *roles):
        raise Forbidden(f"principal {p.name!r} lacks role {' or '.join(roles)}")


def mint_token() -> str:
    """A new bearer token: 32 random octets, base64url (a valid RFC 6750 token68)."""
    return secrets.token_urlsafe(32)


def token_sha256(token: str) -> str:
    """The hex32 SHA-256 of a bearer token, as the principals file stores it."""
    return hashlib.sha256(token.encode("ascii")).hexdigest()


def principal_entry(
    name: str,
    token: str,
    roles: Iterable[str],
    scopes: Iterable[bytes] | None,
    holders: Iterable[str] = (),
    expires_ms: int | None = None,
) -> dict[str, Any]:
    """A ``[[principal]]`` table for ``token`` (stored as its hash); ``scopes=None`` = all."""
    entry: dict[str, Any] = {
        "name": name,
        "token_sha256": token_sha256(token),
        "roles": sorted(roles),
        "scopes": [ALL_SCOPES] if scopes is None else sorted(bytes(s).hex() for s in scopes),
        "holders": sorted(holders),
    }
    if expires_ms is not None:
        entry["expires"] = expires_ms
    return entry


def _toml_string(text: str) -> str:
    out = ['"']
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch < " " or ch == "\x7f":  # TOML basic strings forbid raw control characters
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def _toml_value(value: Any) -> str:
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML form for {type(value).__name__}")


def dump_principals(entries: Iterable[Mapping[str, Any]]) -> str:
    """The TOML text of a principals file holding ``entries``."""
    parts = ["# KVSP principals: bearer tokens are stored as their SHA-256 only.\n"]
    for entry in entries:
        parts.append("\n[[principal]]\n")
        parts.extend(f"{k} = {_toml_value(v)}\n" for k, v in entry.items())
    return "".join(parts)


def _write_private(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_principals(path: str | os.PathLike[str], entries: Iterable[Mapping[str, Any]]) -> None:
    """Write a principals file atomically, readable by its owner only (mode 0600).

    Raises:
        PrincipalsError: the entries would not load back.
    """
    text = dump_principals(entries)
    Principals.from_document(tomllib.loads(text), source=os.fspath(path))
    _write_private(Path(path), text)


def ensure_default_principals(state_dir: str | os.PathLike[str]) -> tuple[Path, Path]:
    """The embedded default: make sure ``state_dir`` has a principals file.

    When there is none, create one with a single admin principal (all scopes) and write its
    token to ``state_dir/admin.token`` (mode 0600); an existing file is left alone. The service
    never runs without principals.

    Returns:
        The principals file's path and the admin token file's path.
    """
    folder = Path(state_dir)
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    principals_path = folder / PRINCIPALS_FILE
    token_path = folder / ADMIN_TOKEN_FILE
    if principals_path.exists():
        return principals_path, token_path
    token = mint_token()
    # Token first: a crash in between leaves no principals file, so the next start retries.
    _write_private(token_path, token + "\n")
    write_principals(principals_path, [principal_entry("admin", token, ["admin"], None)])
    return principals_path, token_path


def principal_of(request: Request) -> Principal:
    """The authenticated principal of a request (``app.state.principals``/``app.state.clock``;
    audience credentials when ``app.state.audiences()`` names the service's own origins).

    Raises:
        Unauthorized: no valid bearer token.
    """
    cached = getattr(request.state, "principal", None)
    if isinstance(cached, Principal):
        return cached
    principals: Principals = request.app.state.principals
    clock: Clock = request.app.state.clock
    # app.state.audiences() gives the service's own origins; the IS and PC set none (tokens only).
    own = getattr(request.app.state, "audiences", None)
    audiences: frozenset[str] | None = own() if callable(own) else None
    authorization = request.headers.get("authorization")
    principal = principals.authenticate(authorization, clock.now_ms(), audiences)
    request.state.principal = principal
    return principal
