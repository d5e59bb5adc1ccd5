"""Who may call what: the roles allowed on every HTTP route of every KVSP service and on every
MOQT request at the relay (spec §6.1–§6.9 authorization; DESIGN.md §3 "Authentication and
scope authorization").

:data:`RULES` is the one table. For each service (``index``, ``pc``, ``control``, ``holder``,
``instance``, ``relay-http``, ``relay-moqt``) it maps each route, as ``(METHOD, path
template)`` the way the service's ``/openapi.json`` names it, or each MOQT request kind, to the
roles allowed. :data:`PUBLIC` marks the routes that need no token (liveness and the API
description). A route that the table does not name is refused (403) for everyone but is still
authenticated first, so a new route without a rule fails closed: :func:`install_roles`
refuses to build an app that has one, and one added later is refused at request time
(:func:`unruled_routes` lists them for the tests).

:func:`install_roles` enforces the table in an app: a middleware authenticates the principal
(401 ``kvsp-unauthorized``), looks the matched route up and answers 403 ``kvsp-forbidden``
when none of the principal's roles is allowed, before any handler reads the body. The
handlers keep their scope and resource checks (the scope of a block, the holder URI of a
record, the instance of a status, the owner of a lease).

The policy, by role:

* ``admin`` may do everything (it is listed in every rule).
* ``pc`` (the control plane) places, lists instances and changes their state, sends prefetch
  directives, resumes sessions, moves shard maps, reads instance status and descriptors and
  looks up replicas. It neither stores nor reads blocks.
* ``instance`` stores, reads and leases blocks, publishes records for its own URI, reports its
  status, checkpoints sessions, looks up, registers and reads descriptors.
* ``holder`` and ``relay`` store, read and lease blocks, publish records for their URIs, look
  up, register and read descriptors; over MOQT they announce and publish. ``relay`` is the role of
  a relay's own token (a relay minted with ``holder``, as before, keeps working).
* ``client`` looks up, places, generates, follows its sessions, reads and leases blocks and
  reads descriptors. It never stores a block: KV that others load comes only from parties
  that compute or hold it.
* ``metrics`` reads ``/metrics`` and nothing else.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.routing import BaseRoute, Match, Route
from starlette.types import ASGIApp, Receive, Scope, Send

from kvsp.errors import Forbidden, KVSPError
from kvsp.web.auth import Principal, principal_of
from kvsp.web.problems import problem_response

log = logging.getLogger(__name__)

ADMIN = "admin"
PC = "pc"
INSTANCE = "instance"
HOLDER = "holder"
RELAY = "relay"
CLIENT = "client"
METRICS = "metrics"
ALL_ROLES = frozenset({ADMIN, PC, INSTANCE, HOLDER, RELAY, CLIENT, METRICS})
"""Every role a principal may have (the principals file's ``roles``)."""

PUBLIC: frozenset[str] = frozenset({"*"})
"""The rule of a route that answers without a token."""


def _allow(*roles: str) -> frozenset[str]:
    return frozenset({ADMIN, *roles})


STORE = _allow(HOLDER, INSTANCE, RELAY)
"""Roles that may store a block (and announce or publish KV over MOQT)."""
READ_BLOCKS = _allow(HOLDER, INSTANCE, RELAY, CLIENT)
"""Roles that may read a block (and subscribe to or fetch KV over MOQT)."""
LEASE = _allow(HOLDER, INSTANCE, RELAY, CLIENT)
"""Roles that may take, renew and release leases."""
PUBLISH_RECORDS = _allow(HOLDER, INSTANCE, RELAY)
"""Roles that may publish or withdraw Replica Records (for the holder URIs they are named for)."""
LOOKUP = _allow(CLIENT, PC, INSTANCE, HOLDER, RELAY)
"""Roles that may look replicas up (in their scopes; holders and relays already hold the
scope's KV)."""
REGISTER_DESCRIPTORS = _allow(HOLDER, INSTANCE, RELAY, PC)
"""Roles that may register a model descriptor."""
READ_DESCRIPTORS = _allow(HOLDER, INSTANCE, RELAY, PC, CLIENT)
"""Roles that compute or verify blocks, or compute Block Keys, and so read descriptors."""
READ_METRICS = _allow(METRICS)
ADMIN_ONLY = _allow()

_OPERATIONS: dict[tuple[str, str], frozenset[str]] = {
    ("GET", "/healthz"): PUBLIC,
    ("GET", "/readyz"): PUBLIC,
    ("GET", "/openapi.json"): PUBLIC,
    ("GET", "/metrics"): READ_METRICS,
}
_DESCRIPTORS: dict[tuple[str, str], frozenset[str]] = {
    ("PUT", "/descriptors/{compat}"): REGISTER_DESCRIPTORS,
    ("GET", "/descriptors/{compat}"): READ_DESCRIPTORS,
}
_REPLICA = "/replicas/{compat}/{scope}/{key}/{holder_id}"
_STATUS = "/instances/{instance_id}/status"
_INDEX: dict[tuple[str, str], frozenset[str]] = {
    ("PUT", _REPLICA): PUBLISH_RECORDS,
    ("DELETE", _REPLICA): PUBLISH_RECORDS,
    ("POST", "/replicas"): PUBLISH_RECORDS,
    ("GET", "/replicas"): ADMIN_ONLY,
    ("DELETE", "/holders/{holder_id}/replicas"): _allow(HOLDER, INSTANCE, RELAY, PC),
    ("POST", "/lookup"): LOOKUP,
    ("PUT", _STATUS): _allow(INSTANCE, PC),
}
_PC: dict[tuple[str, str], frozenset[str]] = {
    ("PUT", _STATUS): _allow(INSTANCE),
    ("GET", "/instances"): _allow(PC),
    ("PUT", "/instances/{instance_id}/state"): _allow(PC),
    ("DELETE", "/instances/{instance_id}"): _allow(INSTANCE),
    ("POST", "/place"): _allow(CLIENT, PC),
    ("PUT", "/sessions/{session}/checkpoint"): _allow(INSTANCE),
    ("GET", "/sessions/{session}"): _allow(CLIENT, PC, INSTANCE),
    ("GET", "/sessions"): ADMIN_ONLY,
    ("POST", "/shardmaps"): _allow(PC),
    ("GET", "/shardmaps/{map}"): _allow(PC),
    ("POST", "/shardmaps/{map}/versions"): _allow(PC),
}
_BLOCK = "/blocks/{compat}/{scope}/{key}"
_HOLDER: dict[tuple[str, str], frozenset[str]] = {
    ("GET", _BLOCK): READ_BLOCKS,
    ("PUT", _BLOCK): STORE,
    ("POST", "/leases"): LEASE,
    ("PUT", "/leases/{lease}"): LEASE,
    ("DELETE", "/leases/{lease}"): LEASE,
}
_INSTANCE: dict[tuple[str, str], frozenset[str]] = {
    ("POST", "/prefetch"): _allow(PC),
    ("GET", "/prefetch/{directive}"): _allow(PC),
    ("PUT", "/state"): _allow(PC),
    ("POST", "/generate"): _allow(CLIENT),
    ("GET", "/sessions/{session}/tokens"): _allow(CLIENT),
    ("POST", "/sessions/{session}/resume"): _allow(PC),
    ("GET", "/sessions/{session}"): _allow(CLIENT, PC),
    ("GET", "/status"): _allow(PC, INSTANCE),
    ("POST", "/reshard"): _allow(PC),
    ("GET", "/shards"): _allow(INSTANCE, PC),
    ("GET", "/shards/{map}/{tokens}"): _allow(INSTANCE, PC),
    ("PUT", "/shards/{map}/{tokens}"): _allow(INSTANCE, PC),
}
_MOQT_SESSION = STORE | READ_BLOCKS
_RELAY_MOQT: dict[str, frozenset[str]] = {
    "CLIENT_SETUP": _MOQT_SESSION,
    "SUBSCRIBE": READ_BLOCKS,
    "FETCH": READ_BLOCKS,
    "TRACK_STATUS": READ_BLOCKS,
    "SUBSCRIBE_NAMESPACE": READ_BLOCKS,
    "PUBLISH_NAMESPACE": STORE,
    "PUBLISH": STORE,
    # Follow-ups to the session's own earlier requests: any principal that may hold a session.
    "UNSUBSCRIBE": _MOQT_SESSION,
    "PUBLISH_NAMESPACE_DONE": _MOQT_SESSION,
    "UNSUBSCRIBE_NAMESPACE": _MOQT_SESSION,
    "REQUEST_UPDATE": _MOQT_SESSION,
    "PUBLISH_OK": _MOQT_SESSION,
    "REQUEST_ERROR": _MOQT_SESSION,
}

RULES: Mapping[str, Mapping[tuple[str, str], frozenset[str]] | Mapping[str, frozenset[str]]] = {
    "index": {**_OPERATIONS, **_DESCRIPTORS, **_INDEX},
    "pc": {**_OPERATIONS, **_PC},
    # IS and PC in one process: the PC answers status reports there.
    "control": {**_OPERATIONS, **_DESCRIPTORS, **_INDEX, **_PC},
    "holder": {**_OPERATIONS, **_DESCRIPTORS, **_HOLDER},
    "instance": {**_OPERATIONS, **_DESCRIPTORS, **_HOLDER, **_INSTANCE},
    "relay-http": {**_OPERATIONS, **{k: v for k, v in _HOLDER.items() if "leases" in k[1]}},
    "relay-moqt": _RELAY_MOQT,
}
"""The roles allowed, per service, per ``(METHOD, path template)`` or MOQT request kind."""

HTTP_SERVICES = ("index", "pc", "control", "holder", "instance", "relay-http")
"""The services of :data:`RULES` that speak HTTP."""


def http_rules(service: str) -> Mapping[tuple[str, str], frozenset[str]]:
    """The HTTP rules of ``service`` (one of :data:`HTTP_SERVICES`).

    Raises:
        KeyError: no such HTTP service.
    """
    if service not in HTTP_SERVICES:
        raise KeyError(service)
    rules = RULES[service]
    return {k: v for k, v in rules.items() if isinstance(k, tuple)}


def moqt_rules() -> Mapping[str, frozenset[str]]:
    """The rules of the relay's MOQT requests, by request kind."""
    return {k: v for k, v in RULES["relay-moqt"].items() if isinstance(k, str)}


def rule_for(service: str, method: str, path: str) -> frozenset[str] | None:
    """The roles allowed on ``method path`` (a route template) of ``service``; :data:`PUBLIC`
    for a route that needs no token; None when the table has no rule (refused). HEAD follows
    GET."""
    if method == "HEAD":
        method = "GET"
    return http_rules(service).get((method, path))


def allows(rule: frozenset[str] | None, principal: Principal) -> bool:
    """Whether ``rule`` lets ``principal`` in (a missing rule lets nobody in)."""
    if rule is None:
        return False
    return rule is PUBLIC or not rule.isdisjoint(principal.roles)


def may_request(principal: Principal, kind: str) -> bool:
    """Whether ``principal`` may send the MOQT request ``kind`` to the relay (its scope and
    namespace are checked apart)."""
    return allows(moqt_rules().get(kind), principal)


def _operations(routes: Iterable[BaseRoute]) -> Iterable[tuple[str, str]]:
    for route in routes:
        if isinstance(route, Route):
            for method in sorted(route.methods or ()):
                if method != "HEAD":
                    yield method, route.path


def unruled_routes(app: Starlette, service: str) -> list[tuple[str, str]]:
    """The ``(method, path)`` pairs ``app`` serves that the table has no rule for."""
    rules = http_rules(service)
    return [key for key in _operations(app.routes) if key not in rules]


def _matched_route(app: Starlette, scope: Scope) -> Route | None:
    for route in app.router.routes:
        if isinstance(route, Route):
            match, _ = route.matches(scope)
            if match is Match.FULL:
                return route
    return None


class RoleMiddleware:
    """Authenticates every request to a ruled route and refuses the roles its rule does not
    allow; unmatched requests go on to the router (404/405)."""

    def __init__(
        self, app: ASGIApp, starlette: Starlette, service: str, anonymous: Principal | None
    ) -> None:
        self.app = app
        self.starlette = starlette
        self.service = service
        self.rules = http_rules(service)
        self.anonymous = anonymous

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = _matched_route(self.starlette, scope)
        if route is None:
            await self.app(scope, receive, send)
            return
        scope["route"] = route  # as the router sets it: metrics count refusals by template
        method = "GET" if scope["method"] == "HEAD" else scope["method"]
        rule = self.rules.get((method, route.path))
        if rule is PUBLIC:
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive)
        try:
            principal = self._principal(request)
            if not allows(rule, principal):
                if rule is None:
                    log.warning("%s %s has no role rule: refused", method, route.path)
                raise Forbidden(f"principal {principal.name!r} may not {method} {route.path}")
        except KVSPError as exc:
            response = problem_response(exc, instance=request.url.path)
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _principal(self, request: Request) -> Principal:
        if self.anonymous is not None and self.starlette.state.principals is None:
            request.state.principal = self.anonymous
            return self.anonymous
        return principal_of(request)


def install_roles(app: Starlette, service: str, *, anonymous: Principal | None = None) -> None:
    """Enforce :data:`RULES` ``[service]`` in ``app``. Call it before
    :func:`~kvsp.web.problems.install_problem_handlers`, so that the request metrics and
    access records see its answers. ``anonymous`` is the principal of every request when
    ``app.state.principals`` is None (the relay's open mode); otherwise a service without
    principals refuses everything.

    Raises:
        KeyError: ``service`` is not an HTTP service of the table.
        ValueError: ``app`` already has a route the table has no rule for (routes added later
            are refused at request time).
    """
    missing = unruled_routes(app, service)
    if missing:
        raise ValueError(f"no role rule in kvsp.web.roles.RULES[{service!r}] for {missing}")
    app.add_middleware(RoleMiddleware, starlette=app, service=service, anonymous=anonymous)
