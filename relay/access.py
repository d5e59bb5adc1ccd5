"""Who may do what at the relay (DESIGN.md §3 "Authentication and scope authorization").

Over MOQT the bearer token travels in the AUTHORIZATION TOKEN parameter with alias type
USE_VALUE: in CLIENT_SETUP for the session, and optionally on a request, where it replaces the
session's principal for that request. Rules:

* With principals configured, a session whose CLIENT_SETUP carries no valid token is closed
  with UNAUTHORIZED (0x2) right after the setup; nothing is served to anonymous peers.
* A KV namespace (``"kvsp", "1", compat, scope[, key]``) is allowed when its scope is among
  the principal's scopes; announcing (PUBLISH_NAMESPACE, PUBLISH) also needs the role
  ``instance``, ``holder`` or ``admin``.
* A ``kvsp`` namespace that names no single scope, and any plain namespace, are for admins.
* In open mode (``--open``, no principals) every peer may do everything.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvsp.errors import Unauthorized
from kvsp.moqt_mapping import Scoped, classify
from kvsp.web.auth import Principal, Principals, has_role, may_use_scope
from moqt.messages import AuthToken, TokenAliasType
from moqt.wire import TrackNamespace

ANONYMOUS = Principal(name="anonymous", roles=frozenset({"admin"}), scopes=None)
"""Everyone, in open mode."""
PUBLISHER_ROLES = ("instance", "holder")


def _bearer(tokens: Sequence[AuthToken]) -> str | None:
    """The ``Authorization`` value for the first USE_VALUE token, or None."""
    for token in tokens:
        if token.alias_type == TokenAliasType.USE_VALUE and token.token_value is not None:
            try:
                return "Bearer " + token.token_value.decode("ascii")
            except UnicodeDecodeError:
                return "Bearer \x00"  # never matches: reported as an unknown token
    return None


def authenticate(
    principals: Principals | None, tokens: Sequence[AuthToken], now_ms: int
) -> Principal:
    """The principal of a session (its CLIENT_SETUP tokens); :data:`ANONYMOUS` in open mode.

    Raises:
        Unauthorized: principals are configured and no token, or an unknown or expired one.
    """
    if principals is None:
        return ANONYMOUS
    return principals.authenticate(_bearer(tokens), now_ms)


def request_principal(
    principals: Principals | None,
    session: Principal,
    tokens: Sequence[AuthToken],
    now_ms: int,
) -> Principal:
    """The principal of one request: its own token when it carries one, else the session's.

    Raises:
        Unauthorized: the request's token is unknown or expired.
    """
    if principals is None or _bearer(tokens) is None:
        return session
    return principals.authenticate(_bearer(tokens), now_ms)


def may_access(principal: Principal, namespace: TrackNamespace, *, publish: bool = False) -> bool:
    """Whether ``principal`` may use ``namespace`` (to read, or with ``publish`` to announce)."""
    kind = classify(namespace)
    if isinstance(kind, Scoped):
        if publish and not has_role(principal, *PUBLISHER_ROLES):
            return False
        return may_use_scope(principal, kind.scope_id)
    return "admin" in principal.roles


def check(principal: Principal, namespace: TrackNamespace, *, publish: bool = False) -> None:
    """Require :func:`may_access`.

    Raises:
        Unauthorized: it may not (carried to the peer as REQUEST_ERROR UNAUTHORIZED).
    """
    if not may_access(principal, namespace, publish=publish):
        raise Unauthorized("not authorized for this namespace")
