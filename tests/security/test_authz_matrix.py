"""The HTTP authorization matrix: every endpoint of every service × role × own/other scope, and
missing, malformed, unknown and expired tokens (spec §6.1, §6.2, §6.6, §6.7; DESIGN.md §3
"Authentication and scope authorization").

The expectations come from DESIGN.md §3 and the resource tables in the app docstrings
(``index_app``, ``pc_app``, ``holder_app``, ``instance_app``, ``relay.web``):

* no valid token (absent, not ``Bearer``, unknown, or past its ``expires``) → 401
  ``kvsp-unauthorized`` with ``WWW-Authenticate: Bearer``, on every route but the public ones;
* a role the route does not take → 403 ``kvsp-forbidden``;
* another scope → 403 ``kvsp-forbidden``, except a lookup, which answers as for a miss (§6.2:
  "MUST NOT return replicas of a scope for which the client is not authorized");
* another's resource: a record for a holder the principal may not publish for, a status for an
  instance it is not → 403; another principal's lease → 404 (as if there were none).

Each request runs against a fresh environment (``tests.support.authz``) seeded by a ``root``
principal, so outcomes never depend on order.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvsp.compat import compat_id
from kvsp.errors import PROBLEM_PREFIX
from kvsp.ids import uri_id
from tests.support.authz import (
    COMPAT,
    DIRECTIVES,
    ENVIRONMENTS,
    FRESH,
    H_URI,
    II_OTHER,
    II_URI,
    OTHER_DESCRIPTOR,
    ROLES,
    SCOPES,
    STORED,
    URIS,
    Env,
    bearer,
    block_path,
    container,
    directive_json,
    lease_json,
    record_json,
    replica_path,
    status_json,
    token,
)

pytestmark = pytest.mark.timeout(120)

Request = tuple[str, str, dict[str, Any]]
Builder = Callable[[Env, str, str], Awaitable[Request]]
ANY = frozenset(ROLES)
STORERS = frozenset({"holder", "instance", "admin"})
"""Roles that may store blocks and publish records (``kvsp.web.roles``; this matrix has no
``relay`` or ``metrics`` principal: ``test_role_matrix.py`` covers every role)."""
READERS = frozenset({"holder", "instance", "client", "admin"})
"""Roles that may read and lease blocks."""
PUBLIC = frozenset({("GET", "/healthz"), ("GET", "/readyz"), ("GET", "/openapi.json")})
"""Routes that answer without a token (liveness, readiness, the API description)."""
NOT_READY_OK = frozenset({("GET", "/readyz")})
"""Public routes that may answer 503 (not ready: an instance here reports to no PC)."""


@dataclass(frozen=True)
class Row:
    """One endpoint: who may call it, what success and the other side give, how to call it."""

    roles: frozenset[str]
    ok: int
    other: Callable[[str], int] | None
    """Status an allowed role gets on the other side (None: the same as its own side)."""
    build: Builder
    check: Callable[[httpx.Response, str, str], None] | None = None


def forbidden(role: str) -> int:
    return 403


def not_found(role: str) -> int:
    return 404


def req(method: str, url: str, **kwargs: Any) -> Builder:
    """A builder for a request that does not depend on the caller."""

    async def build(env: Env, who: str, side: str) -> Request:
        resolved = {k: (v(side) if callable(v) else v) for k, v in kwargs.items()}
        return method, url.format(side=side, scope=SCOPES[side].hex()), resolved

    return build


def sided(method: str, url: Callable[[str], str], **kwargs: Any) -> Builder:
    async def build(env: Env, who: str, side: str) -> Request:
        resolved = {k: (v(side) if callable(v) else v) for k, v in kwargs.items()}
        return method, url(side), resolved

    return build


def lease_of(method: str, body: dict[str, Any] | None = None) -> Builder:
    """A request on a lease: the caller's own (made first, in its scope) or root's."""

    async def build(env: Env, who: str, side: str) -> Request:
        if side == "own":
            made = await env.http.post("leases", json=lease_json("own"), headers=bearer(who))
            if made.status_code == 403:  # a role that may not lease: root's lease, refused too
                lease = env.notes["root_lease_own"]
            else:
                assert made.status_code == 201, made.text
                lease = made.json()["lease"]
        else:
            lease = env.notes["root_lease_own"]
        kwargs = {} if body is None else {"json": body}
        return method, f"leases/{lease}", kwargs

    return build


def check_lookup(answer: httpx.Response, role: str, side: str) -> None:
    assert answer.json()["matched"] == (1 if side == "own" else 0), answer.text


def check_batch(answer: httpx.Response, role: str, side: str) -> None:
    result = answer.json()["results"][0]
    if side == "own" and role in ("holder", "admin"):
        assert result["ok"] is True, result
    else:
        assert result["ok"] is False
        assert result["problem"]["type"] == PROBLEM_PREFIX + "kvsp-forbidden"


def _place(side: str) -> dict[str, Any]:
    return {
        "scope_id": SCOPES[side].hex(),
        "compat_id": COMPAT.hex(),
        "block_keys": [STORED.hex()],
        "prompt_tokens": 8,
    }


def _status_url(side: str) -> str:
    return f"instances/{uri_id(URIS[side])}/status"


def _new_directive(side: str) -> dict[str, Any]:
    return directive_json(side) | {"directive": str(uuid.uuid4())}


INDEX_ROWS: dict[tuple[str, str], Row] = {
    ("PUT", "/replicas/{compat}/{scope}/{key}/{holder_id}"): Row(
        frozenset({"holder", "admin"}),
        200,
        forbidden,
        sided("PUT", replica_path, json=record_json),
    ),
    ("DELETE", "/replicas/{compat}/{scope}/{key}/{holder_id}"): Row(
        frozenset({"holder", "admin"}), 204, forbidden, sided("DELETE", replica_path)
    ),
    ("POST", "/replicas"): Row(
        STORERS,
        200,
        None,
        req("POST", "replicas", json=lambda side: {"records": [record_json(side)]}),
        check_batch,
    ),
    ("POST", "/lookup"): Row(
        ANY,
        200,
        None,
        req(
            "POST",
            "lookup",
            json=lambda side: {
                "scope_id": SCOPES[side].hex(),
                "compat_id": COMPAT.hex(),
                "block_keys": [STORED.hex()],
            },
        ),
        check_lookup,
    ),
    ("PUT", "/descriptors/{compat}"): Row(
        frozenset({"holder", "instance", "pc", "admin"}),
        201,
        None,
        req(
            "PUT",
            f"descriptors/{compat_id(OTHER_DESCRIPTOR).hex()}",
            json=OTHER_DESCRIPTOR.to_json(),
        ),
    ),
    ("GET", "/descriptors/{compat}"): Row(
        ANY, 200, None, req("GET", f"descriptors/{COMPAT.hex()}")
    ),
    ("GET", "/metrics"): Row(frozenset({"admin"}), 200, None, req("GET", "metrics")),
    ("GET", "/replicas"): Row(frozenset({"admin"}), 200, None, req("GET", "replicas")),
    ("DELETE", "/holders/{holder_id}/replicas"): Row(  # own: the holder's; other: another's
        frozenset({"holder", "pc", "admin"}),
        200,
        lambda role: 403 if role == "holder" else 200,
        sided(
            "DELETE",
            lambda side: f"holders/{uri_id(H_URI if side == 'own' else II_OTHER)}/replicas",
        ),
    ),
}
IS_STATUS = Row(
    frozenset({"instance", "pc", "admin"}),
    200,
    lambda role: 403 if role == "instance" else 200,
    sided("PUT", _status_url, json=lambda side: status_json(URIS[side])),
)
PC_ROWS: dict[tuple[str, str], Row] = {
    ("PUT", "/instances/{instance_id}/status"): Row(
        frozenset({"instance", "admin"}),
        200,
        lambda role: 403 if role == "instance" else 200,
        sided("PUT", _status_url, json=lambda side: status_json(URIS[side])),
    ),
    ("GET", "/instances"): Row(frozenset({"pc", "admin"}), 200, None, req("GET", "instances")),
    ("GET", "/sessions"): Row(frozenset({"admin"}), 200, None, req("GET", "sessions")),
    ("PUT", "/instances/{instance_id}/state"): Row(
        frozenset({"pc", "admin"}),
        200,
        None,
        req("PUT", f"instances/{uri_id(II_URI)}/state", json={"state": "draining"}),
    ),
    ("POST", "/place"): Row(
        frozenset({"client", "pc", "admin"}), 200, forbidden, req("POST", "place", json=_place)
    ),
    ("DELETE", "/instances/{instance_id}"): Row(  # own: the registered instance; other: unknown
        frozenset({"instance", "admin"}),
        204,
        lambda role: 403 if role == "instance" else 404,
        sided("DELETE", lambda side: f"instances/{uri_id(URIS[side])}?epoch=1"),
    ),
    ("GET", "/metrics"): INDEX_ROWS[("GET", "/metrics")],
}
HOLDER_ROWS: dict[tuple[str, str], Row] = {
    ("GET", "/blocks/{compat}/{scope}/{key}"): Row(
        READERS, 200, forbidden, sided("GET", block_path)
    ),
    ("PUT", "/blocks/{compat}/{scope}/{key}"): Row(
        STORERS,
        201,
        forbidden,
        sided(
            "PUT",
            lambda side: block_path(side, FRESH),
            content=container(2),
            headers={"if-none-match": "*", "content-type": "application/kvsp-block"},
        ),
    ),
    ("POST", "/leases"): Row(READERS, 201, forbidden, req("POST", "leases", json=lease_json)),
    ("PUT", "/leases/{lease}"): Row(READERS, 200, not_found, lease_of("PUT", {"ttl_ms": 1000})),
    ("DELETE", "/leases/{lease}"): Row(READERS, 204, not_found, lease_of("DELETE")),
    ("PUT", "/descriptors/{compat}"): INDEX_ROWS[("PUT", "/descriptors/{compat}")],
    ("GET", "/descriptors/{compat}"): INDEX_ROWS[("GET", "/descriptors/{compat}")],
    ("GET", "/metrics"): INDEX_ROWS[("GET", "/metrics")],
}
INSTANCE_ROWS: dict[tuple[str, str], Row] = {
    **HOLDER_ROWS,
    ("POST", "/prefetch"): Row(
        frozenset({"pc", "admin"}), 202, forbidden, req("POST", "prefetch", json=_new_directive)
    ),
    ("GET", "/prefetch/{directive}"): Row(
        frozenset({"pc", "admin"}),
        200,
        forbidden,
        sided("GET", lambda side: f"prefetch/{DIRECTIVES[side]}"),
    ),
    ("PUT", "/state"): Row(
        frozenset({"pc", "admin"}), 200, None, req("PUT", "state", json={"state": "draining"})
    ),
    ("POST", "/generate"): Row(
        frozenset({"client", "admin"}),
        200,
        forbidden,
        req(
            "POST",
            "generate",
            json=lambda side: {
                "prompt": list(range(1, 9)),
                "max_tokens": 2,
                "scope_id": SCOPES[side].hex(),
            },
        ),
    ),
    ("GET", "/status"): Row(
        frozenset({"pc", "instance", "admin"}), 200, None, req("GET", "status")
    ),
}
RELAY_ROWS: dict[tuple[str, str], Row] = {
    key: HOLDER_ROWS[key]
    for key in [("POST", "/leases"), ("PUT", "/leases/{lease}"), ("DELETE", "/leases/{lease}")]
}
RELAY_ROWS[("GET", "/metrics")] = INDEX_ROWS[("GET", "/metrics")]
PENDING: dict[str, frozenset[tuple[str, str]]] = {
    "control": frozenset(
        {("PUT", "/sessions/{session}/checkpoint"), ("GET", "/sessions/{session}")}
    ),
    "pc": frozenset({("PUT", "/sessions/{session}/checkpoint"), ("GET", "/sessions/{session}")}),
    "instance": frozenset(
        {
            ("GET", "/sessions/{session}/tokens"),
            ("POST", "/sessions/{session}/resume"),
            ("GET", "/sessions/{session}"),
        }
    ),
}
"""Session routes (§6.8) that arrived while this matrix was written: they get the token checks
of ``test_no_valid_token_no_answer`` but no role × scope row yet. Give them rows and empty
this."""
TABLE: dict[str, dict[tuple[str, str], Row]] = {
    "index": {**INDEX_ROWS, ("PUT", "/instances/{instance_id}/status"): IS_STATUS},
    "control": {**INDEX_ROWS, **PC_ROWS},
    "pc": PC_ROWS,
    "holder": HOLDER_ROWS,
    "instance": INSTANCE_ROWS,
    "relay-face": RELAY_ROWS,
}
"""The expected answers, per service and (method, path template)."""


def served_routes(service: str, tmp_path: Path) -> list[tuple[str, str]]:
    """The (method, path) pairs the service's app really serves (HEAD aside)."""

    async def collect() -> list[tuple[str, str]]:
        async with ENVIRONMENTS[service](tmp_path) as env:
            app = env.http._transport.app  # type: ignore[attr-defined]
            return [
                (method, route.path)
                for route in app.routes
                for method in sorted(getattr(route, "methods", None) or ())
                if method != "HEAD"
            ]

    return asyncio.run(collect())


def expected(row: Row, role: str, side: str) -> int:
    if role not in row.roles:
        return 403
    if side == "own" or row.other is None:
        return row.ok
    return row.other(role)


def assert_answer(answer: httpx.Response, status: int, what: str) -> None:
    assert answer.status_code == status, f"{what}: {answer.status_code} {answer.text[:300]}"
    content_type = answer.headers.get("content-type", "")
    if status >= 400:
        assert content_type.startswith("application/problem+json"), what
        name = {401: "kvsp-unauthorized", 403: "kvsp-forbidden", 404: "kvsp-not-found"}[status]
        assert answer.json()["type"] == PROBLEM_PREFIX + name, f"{what}: {answer.text}"
    else:
        assert not content_type.startswith("application/problem+json"), what


async def call(service: str, tmp_path: Path, row: Row, who: str, side: str, auth: Any) -> Any:
    async with ENVIRONMENTS[service](tmp_path) as env:
        method, url, kwargs = await row.build(env, who, side)
        headers = {**kwargs.pop("headers", {}), **auth}
        return await env.http.request(method, url, headers=headers, **kwargs)


CASES = [(service, key) for service, rows in TABLE.items() for key in rows]


@pytest.mark.parametrize(("service", "key"), CASES, ids=[f"{s}:{m} {p}" for s, (m, p) in CASES])
def test_roles_and_scopes(service: str, key: tuple[str, str], tmp_path: Path) -> None:
    row = TABLE[service][key]
    if key not in served_routes(service, tmp_path):
        pytest.skip(f"{service} does not serve {key} in this build")

    async def run() -> None:
        for role in ROLES:
            for side in ("own", "other"):
                answer = await call(service, tmp_path, row, role, side, bearer(role))
                what = f"{service} {key} as {role}, {side} scope"
                assert_answer(answer, expected(row, role, side), what)
                if row.check is not None and answer.status_code < 300:
                    row.check(answer, role, side)

    asyncio.run(run())


BAD_AUTH = {
    "missing": {},
    "not bearer": {"authorization": f"Basic {token('admin')}"},
    "unknown": {"authorization": "Bearer " + token("admin")[:-1] + "X"},
    "expired": bearer("expired"),
    "empty": {"authorization": "Bearer "},
}


@pytest.mark.parametrize("service", list(TABLE))
def test_no_valid_token_no_answer(service: str, tmp_path: Path) -> None:
    """Every route the app serves, public ones aside, answers 401 without a valid token,
    whether or not the matrix has a row for it."""
    routes = [r for r in served_routes(service, tmp_path) if r not in PUBLIC]
    assert routes

    async def run() -> None:
        for key in routes:
            row = TABLE[service].get(key)
            # a refused request changes nothing, so one environment serves every bad token
            async with ENVIRONMENTS[service](tmp_path) as env:
                if row is not None:
                    method, url, kwargs = await row.build(env, "admin", "own")
                else:
                    method, url, kwargs = key[0], key[1].strip("/"), {}
                for name, auth in BAD_AUTH.items():
                    sent = dict(kwargs)
                    headers = {**sent.pop("headers", {}), **auth}
                    answer = await env.http.request(method, url, headers=headers, **sent)
                    what = f"{service} {key} with {name} token"
                    assert_answer(answer, 401, what)
                    assert answer.headers["www-authenticate"].startswith("Bearer"), what

    asyncio.run(run())


@pytest.mark.parametrize("service", list(TABLE))
def test_public_routes_need_no_token(service: str, tmp_path: Path) -> None:
    routes = served_routes(service, tmp_path)

    async def run() -> None:
        async with ENVIRONMENTS[service](tmp_path) as env:
            for method, path in sorted(PUBLIC & set(routes)):
                answer = await env.http.request(method, path.lstrip("/"))
                ok = {200, 503} if (method, path) in NOT_READY_OK else {200}
                assert answer.status_code in ok, (service, path, answer.text[:200])

    asyncio.run(run())


@pytest.mark.parametrize("service", list(TABLE))
def test_the_matrix_covers_every_route(service: str, tmp_path: Path) -> None:
    """A route added to a service needs a row here: who may call it, and on which scope."""
    pending = PENDING.get(service, frozenset())
    missing = [
        key
        for key in served_routes(service, tmp_path)
        if key not in PUBLIC and key not in TABLE[service] and key not in pending
    ]
    assert not missing, f"add rows to TABLE[{service!r}] for {missing}"
