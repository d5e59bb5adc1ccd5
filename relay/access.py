"""Who may do what at the relay (DESIGN.md §3 "Authentication and scope authorization").

Over MOQT the bearer token travels in the AUTHORIZATION TOKEN parameter with alias type
USE_VALUE: in CLIENT_SETUP for the session, and optionally on a request, where it replaces the
session's principal for that request. Rules:

* With principals configured, a session whose CLIENT_SETUP carries no valid token is closed
  with UNAUTHORIZED (0x2) right after the setup; nothing is served to anonymous peers.
* Each request kind needs a role that :data:`kvsp.web.roles.RULES` ``["relay-moqt"]`` allows
  for it (CLIENT_SETUP included: a ``metrics`` or ``pc`` principal gets no session); reading
  (SUBSCRIBE, FETCH, TRACK_STATUS, SUBSCRIBE_NAMESPACE) and announcing (PUBLISH_NAMESPACE,
  PUBLISH) have their own rules.
* A KV namespace (``"kvsp", "1", compat, scope[, key]``) is allowed when its scope is among
  the principal's scopes.
* A ``kvsp`` namespace that names no single scope, and any plain namespace, are for admins.
* In open mode (``--open``, no principals) every peer may do everything.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from kvsp.audience import origins
from kvsp.errors import Unauthorized
from kvsp.moqt_mapping import Scoped, classify
from kvsp.web.auth import Principal, Principals, may_use_scope
from kvsp.web.roles import may_request
from moqt.messages import AuthToken, TokenAliasType
from moqt.wire import TrackNamespace

ANONYMOUS = Principal(name="anonymous", roles=frozenset({"admin"}), scopes=None)
"""Everyone, in open mode."""


def _bearer(tokens: Sequence[AuthToken]) -> str | None:
    """The ``Authorization`` value for the first USE_VALUE token, or None."""
    for token in tokens:
        if token.alias_type == TokenAliasType.USE_VALUE and token.token_value is not None:
            try:
                return "Bearer " + token.token_value.decode("ascii")
            except UnicodeDecodeError:
                return "Bearer \x00"  # never matches: reported as an unknown token
    return None


def bind_audiences(
    principals: Principals | None, own_uris: Callable[[], Iterable[str | None]]
) -> Principals | None:
    """``principals`` accepting audience credentials (:mod:`kvsp.audience`) for the relay's own
    URIs as ``own_uris()`` names them once it listens: its ``moqt://`` URI, its QMux carriers
    and its HTTP face. A credential for the ``moqt://`` URI works on every carrier."""
    if principals is None:
        return None
    return principals.with_audiences(lambda: origins(own_uris()))


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


def may_access(
    principal: Principal,
    namespace: TrackNamespace,
    *,
    publish: bool = False,
    request: str | None = None,
) -> bool:
    """Whether ``principal`` may use ``namespace`` with the MOQT request kind ``request``
    (default: ``PUBLISH`` with ``publish``, else ``SUBSCRIBE``): the kind's role rule, then
    the namespace's scope."""
    if not may_request(principal, request or ("PUBLISH" if publish else "SUBSCRIBE")):
        return False
    kind = classify(namespace)
    if isinstance(kind, Scoped):
        return may_use_scope(principal, kind.scope_id)
    return "admin" in principal.roles


def may_open_session(principal: Principal) -> bool:
    """Whether ``principal`` may hold a MOQT session at the relay (its CLIENT_SETUP)."""
    return may_request(principal, "CLIENT_SETUP")


def check(principal: Principal, namespace: TrackNamespace, *, publish: bool = False) -> None:
    """Require :func:`may_access`.

    Raises:
        Unauthorized: it may not (carried to the peer as REQUEST_ERROR UNAUTHORIZED).
    """
    if not may_access(principal, namespace, publish=publish):
        raise Unauthorized("not authorized for this namespace")
