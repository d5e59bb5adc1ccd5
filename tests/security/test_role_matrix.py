"""The role matrix of :mod:`kvsp.web.roles`, checked exhaustively against the services (spec
§6.1–§6.9 authorization; DESIGN.md §3 "Authentication and scope authorization").

* Every route in every HTTP service's ``/openapi.json`` (the §6.9 reshard and shard-map routes
  mounted as ``kvsp serve`` mounts them) has a rule, and so does every route the app serves: a
  new route without a rule fails here, and is refused meanwhile.
* For every route × every role (a principal with that role only, every scope, named for the
  test holder and instances): allowed roles get past authorization (neither 401 nor 403),
  the others get 403 ``kvsp-forbidden``; public routes answer without a token.
* At a real relay over QUIC, every MOQT request kind × every role: CLIENT_SETUP of a role that
  may hold no session closes it with UNAUTHORIZED; a request (carrying the role's token on a
  root session) is REQUEST_ERROR UNAUTHORIZED exactly when the table denies it.
* Regressions: ``metrics`` stores, reads, leases and looks up nothing, over HTTP or MOQT; a
  ``client`` cannot plant a block at an instance; instance status and descriptors are for the
  roles that need them. One of them runs against a real uvicorn server.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.routing import Route

from kvsp.errors import PROBLEM_PREFIX
from kvsp.ids import uri_id
from kvsp.services.instance.reshard import agent_reshard_routes
from kvsp.services.pc.reshard import coordinator_for, reshard_routes
from kvsp.web import auth
from kvsp.web.auth import Principals, principal_entry
from kvsp.web.clock import ManualClock
from kvsp.web.roles import (
    ALL_ROLES,
    HTTP_SERVICES,
    PUBLIC,
    allows,
    http_rules,
    install_roles,
    moqt_rules,
    unruled_routes,
)
from kvsp.web.runner import bind_socket
from moqt.asyncio import RequestRejected, SessionClosedError
from moqt.backend import default_backend
from moqt.certs import make_self_signed
from moqt.errors import RequestErrorCode, SessionError
from moqt.messages import AuthToken, MessageParameters, TokenAliasType
from moqt.wire import Location
from relay.relay import Relay
from tests.security.test_authz_matrix import TABLE as BUILDERS
from tests.support.authz import (
    COMPAT,
    DIRECTIVES,
    ENVIRONMENTS,
    FRESH,
    H_URI,
    II_OTHER,
    II_URI,
    NOW,
    SCOPES,
    STORED,
    Env,
    block_path,
    container,
    holder_env,
    token,
)
from tests.support.polling import until
from tests.support.relay_kit import (
    SCOPE_A,
    Certs,
    block_track,
    client,
    make_block,
    publishing,
    relay_config,
    run,
    running_relay,
)

pytestmark = pytest.mark.timeout(180)

ROLES = sorted(ALL_ROLES)
SERVICE_OF = {
    "index": "index",
    "control": "control",
    "pc": "pc",
    "holder": "holder",
    "instance": "instance",
    "relay-http": "relay-face",
}
"""Each HTTP service of the table → its in-process environment (``tests.support.authz``)."""


def who(role: str) -> str:
    """The principal with role ``role`` only."""
    return f"only-{role}"


def bearer_of(name: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token(name)}"}


def matrix_principals() -> Principals:
    """One principal per role, each with every scope and named for the test holder and
    instances (so that scope and resource checks pass), and ``root``."""
    holders = [H_URI, II_URI, II_OTHER]
    entries = [principal_entry(who(r), token(who(r)), [r], None, holders) for r in ROLES]
    entries.append(principal_entry("root", token("root"), ["admin"], None))
    return Principals.from_entries(entries)


@asynccontextmanager
async def environment(service: str, tmp_path: Path) -> AsyncIterator[Env]:
    """The service in-process, as ``kvsp serve`` mounts it, with :func:`matrix_principals`."""
    async with ENVIRONMENTS[SERVICE_OF[service]](tmp_path) as env:
        app = env.http._transport.app
        if service in ("pc", "control"):
            app.router.routes.extend(reshard_routes(coordinator_for(None, ManualClock(NOW))))
        if service == "instance":
            app.router.routes.extend(agent_reshard_routes(app.state.agent, None))
        app.state.principals = matrix_principals()
        yield env


async def documented(env: Env) -> list[tuple[str, str]]:
    """The (METHOD, path template) pairs of the service's ``/openapi.json``."""
    answer = await env.http.get("openapi.json")
    assert answer.status_code == 200
    return sorted(
        (method.upper(), path)
        for path, operations in answer.json()["paths"].items()
        for method in operations
    )


def served(env: Env) -> list[tuple[str, str]]:
    """The (METHOD, path template) pairs the app routes (HEAD aside)."""
    app = env.http._transport.app  # type: ignore[attr-defined]
    return sorted(
        (method, route.path)
        for route in app.routes
        if isinstance(route, Route)
        for method in route.methods or ()
        if method != "HEAD"
    )


_FILL = {
    "compat": COMPAT.hex(),
    "scope": SCOPES["own"].hex(),
    "key": STORED.hex(),
    "holder_id": uri_id(H_URI),
    "instance_id": uri_id(II_URI),
    "lease": "no-such-lease",
    "directive": DIRECTIVES["own"],
    "session": str(uuid.UUID(int=7)),
    "map": str(uuid.UUID(int=8)),
    "tokens": "0-4",
}


def concrete(path: str) -> str:
    """A request path for a template, relative to the service's base."""
    return re.sub(r"\{(\w+)\}", lambda m: _FILL[m.group(1)], path).lstrip("/")


async def send(env: Env, service: str, key: tuple[str, str], role: str) -> httpx.Response:
    """The request of ``role`` on route ``key``: a well-formed one where the authorization
    matrix knows how to build it (so that a refusal can only be the role's), else a bare one."""
    row = BUILDERS[SERVICE_OF[service]].get(key)
    if row is not None and allows(http_rules(service)[key], _principal(role)):
        method, url, kwargs = await row.build(env, who(role), "own")
    else:
        method, url, kwargs = key[0], concrete(key[1]), {}
    headers = {**kwargs.pop("headers", {}), **bearer_of(who(role))}
    return await env.http.request(method, url, headers=headers, **kwargs)


def _principal(role: str) -> auth.Principal:
    return auth.Principal(name=who(role), roles=frozenset({role}), scopes=None)


def test_the_roles_of_the_table_are_the_roles_of_principals() -> None:
    assert ALL_ROLES == auth.ROLES
    for service in HTTP_SERVICES:
        for key, rule in http_rules(service).items():
            assert rule is PUBLIC or "admin" in rule, (service, key)
            assert rule is PUBLIC or rule <= ALL_ROLES, (service, key)


@pytest.mark.parametrize("service", HTTP_SERVICES)
def test_every_route_has_a_rule(service: str, tmp_path: Path) -> None:
    """Every operation in ``/openapi.json`` and every route served has a rule."""

    async def scenario() -> None:
        async with environment(service, tmp_path) as env:
            app = env.http._transport.app  # type: ignore[attr-defined]
            missing = [k for k in await documented(env) if k not in http_rules(service)]
            assert not missing, f"add rules to RULES[{service!r}] for {missing}"
            assert unruled_routes(app, service) == []

    asyncio.run(scenario())


def test_a_route_without_a_rule_is_refused_to_everyone(tmp_path: Path) -> None:
    async def unruled(request: Any) -> Any:
        raise AssertionError("a route without a rule ran")

    async def scenario() -> None:
        async with environment("holder", tmp_path) as env:
            app = env.http._transport.app  # type: ignore[attr-defined]
            app.router.routes.append(Route("/no-rule/{x}", unruled, methods=["POST"]))
            assert unruled_routes(app, "holder") == [("POST", "/no-rule/{x}")]
            for role in ROLES:
                answer = await env.http.post("no-rule/1", headers=bearer_of(who(role)))
                assert answer.status_code == 403, (role, answer.text)
            assert (await env.http.post("no-rule/1")).status_code == 401

    asyncio.run(scenario())
    # and an app that has one when its roles are installed is not built at all
    app = Starlette(routes=[Route("/no-rule", unruled, methods=["GET"])])
    with pytest.raises(ValueError, match="no-rule"):
        install_roles(app, "holder")


@pytest.mark.parametrize("service", HTTP_SERVICES)
def test_every_role_on_every_route(service: str, tmp_path: Path) -> None:
    """Allowed → past authorization (not 401/403); denied → 403 kvsp-forbidden."""

    async def scenario() -> list[str]:
        failures: list[str] = []
        async with environment(service, tmp_path) as env:
            routes = sorted({*await documented(env), *served(env)})
            assert len(routes) >= 4
            for key in routes:
                rule = http_rules(service)[key]
                if rule is PUBLIC:
                    answer = await env.http.request(key[0], concrete(key[1]))
                    ok = {200, 503} if key == ("GET", "/readyz") else {200}  # 503: not ready
                    if answer.status_code not in ok:
                        failures.append(f"{key} without a token: {answer.status_code}")
                    continue
                for role in ROLES:
                    answer = await send(env, service, key, role)
                    got = answer.status_code
                    if allows(rule, _principal(role)):
                        if got in (401, 403):
                            failures.append(f"{key} as {role}: {got} {answer.text[:200]}")
                    elif got != 403 or answer.json()["type"] != PROBLEM_PREFIX + "kvsp-forbidden":
                        failures.append(f"{key} as {role}: {got}, not 403")
        return failures

    failures = asyncio.run(scenario())
    assert not failures, "\n".join(failures)


# --- regressions ---------------------------------------------------------------------------


def assert_forbidden(answer: httpx.Response, what: str) -> None:
    assert answer.status_code == 403, f"{what}: {answer.status_code} {answer.text[:200]}"
    assert answer.headers["content-type"].startswith("application/problem+json"), what
    assert answer.json()["type"] == PROBLEM_PREFIX + "kvsp-forbidden", what


BLOCK_HEADERS = {"if-none-match": "*", "content-type": "application/kvsp-block"}


def test_metrics_reads_metrics_and_nothing_else(tmp_path: Path) -> None:
    """A ``metrics`` principal with scope ``*`` neither stores, reads nor leases blocks, looks
    nothing up and reads no descriptor; it does read ``/metrics``."""
    metrics = bearer_of(who("metrics"))
    lease = {
        "compat_id": COMPAT.hex(),
        "scope_id": SCOPES["other"].hex(),
        "block_keys": [STORED.hex()],
        "ttl_ms": 2000,
    }

    async def scenario() -> None:
        async with environment("holder", tmp_path) as env:
            put = await env.http.put(
                block_path("other", FRESH), content=container(3), headers=BLOCK_HEADERS | metrics
            )
            assert_forbidden(put, "PUT block")
            got = await env.http.get(block_path("other", FRESH), headers=bearer_of("root"))
            assert got.status_code == 404, got.text
            assert_forbidden(await env.http.get(block_path("other"), headers=metrics), "GET")
            assert_forbidden(await env.http.post("leases", json=lease, headers=metrics), "lease")
            assert (await env.http.get("metrics", headers=metrics)).status_code == 200
        async with environment("index", tmp_path) as env:
            body = {
                "scope_id": SCOPES["other"].hex(),
                "compat_id": COMPAT.hex(),
                "block_keys": [STORED.hex()],
            }
            assert_forbidden(await env.http.post("lookup", json=body, headers=metrics), "lookup")
            got = await env.http.get(f"descriptors/{COMPAT.hex()}", headers=metrics)
            assert_forbidden(got, "descriptor")

    asyncio.run(scenario())


def test_a_client_cannot_plant_a_block_at_an_instance(tmp_path: Path) -> None:
    """A client PUT of a valid container under a fresh key is refused and nothing is stored;
    the instance's own role may store it."""

    async def scenario() -> None:
        async with environment("instance", tmp_path) as env:
            for role in ("client", "metrics", "pc"):
                answer = await env.http.put(
                    block_path("own", FRESH),
                    content=container(5),
                    headers=BLOCK_HEADERS | bearer_of(who(role)),
                )
                assert_forbidden(answer, f"PUT block as {role}")
            missing = await env.http.get(block_path("own", FRESH), headers=bearer_of("root"))
            assert missing.status_code == 404, missing.text
            stored = await env.http.put(
                block_path("own", FRESH),
                content=container(5),
                headers=BLOCK_HEADERS | bearer_of(who("instance")),
            )
            assert stored.status_code == 201, stored.text

    asyncio.run(scenario())


def test_status_and_descriptors_are_for_the_roles_that_need_them(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with environment("instance", tmp_path) as env:
            for role in ("client", "holder", "relay", "metrics"):
                got = await env.http.get("status", headers=bearer_of(who(role)))
                assert_forbidden(got, f"GET status as {role}")
            for role in ("pc", "instance", "admin"):
                got = await env.http.get("status", headers=bearer_of(who(role)))
                assert got.status_code == 200, (role, got.text)
            descriptor = f"descriptors/{COMPAT.hex()}"
            got = await env.http.get(descriptor, headers=bearer_of(who("metrics")))
            assert_forbidden(got, "GET descriptor as metrics")
            for role in ("client", "holder", "instance", "relay", "pc"):
                got = await env.http.get(descriptor, headers=bearer_of(who(role)))
                assert got.status_code == 200, (role, got.text)

    asyncio.run(scenario())


def test_the_matrix_holds_on_a_real_server(tmp_path: Path) -> None:
    """The holder app behind uvicorn on a socket: roles are enforced there as in-process."""

    async def scenario() -> None:
        async with holder_env(tmp_path) as env:
            app = env.http._transport.app  # type: ignore[attr-defined]
            app.state.principals = matrix_principals()
            sock = bind_socket("127.0.0.1", 0)
            config = uvicorn.Config(app, log_level="warning", lifespan="off")
            server = uvicorn.Server(config)
            serving = asyncio.create_task(server.serve(sockets=[sock]))
            try:
                await until(lambda: server.started, 10, "uvicorn to start")
                base = f"http://127.0.0.1:{sock.getsockname()[1]}/"
                async with httpx.AsyncClient(base_url=base) as http:
                    for role in ROLES:
                        answer = await http.put(
                            block_path("own", FRESH),
                            content=container(9),
                            headers=BLOCK_HEADERS | bearer_of(who(role)),
                        )
                        if role in ("client", "metrics", "pc"):
                            assert_forbidden(answer, role)
                        else:
                            assert answer.status_code in (201, 412), (role, answer.text)
                    got = await http.get("metrics", headers=bearer_of(who("metrics")))
                    assert got.status_code == 200
                    client_metrics = await http.get("metrics", headers=bearer_of(who("client")))
                    assert_forbidden(client_metrics, "GET metrics as client")
            finally:
                server.should_exit = True
                await serving
                sock.close()

    asyncio.run(scenario())


# --- MOQT at a real relay --------------------------------------------------------------------

UNAUTHORIZED = "UNAUTHORIZED"
READS = ("SUBSCRIBE", "FETCH", "TRACK_STATUS", "SUBSCRIBE_NAMESPACE")
ANNOUNCES = ("PUBLISH_NAMESPACE", "PUBLISH")
FOLLOW_UPS = (
    "UNSUBSCRIBE",
    "PUBLISH_NAMESPACE_DONE",
    "UNSUBSCRIBE_NAMESPACE",
    "REQUEST_UPDATE",
    "PUBLISH_OK",
    "REQUEST_ERROR",
)
"""Kinds that act on the session's own earlier requests and carry no token of their own."""
BLOCK = make_block(71, scope=SCOPE_A)
SAME = default_backend()


def moqt_token(name: str) -> str:
    return f"role-matrix-{name}-0123456789abcdef"


def moqt_principals() -> Principals:
    entries = [principal_entry(who(r), moqt_token(who(r)), [r], [SCOPE_A]) for r in ROLES]
    entries.append(principal_entry("root", moqt_token("root"), ["admin"], None))
    return Principals.from_entries(entries)


def request_token(name: str) -> MessageParameters:
    value = AuthToken(
        alias_type=TokenAliasType.USE_VALUE, token_type=0, token_value=moqt_token(name).encode()
    )
    return MessageParameters(authorization_tokens=(value,))


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_self_signed("localhost", tmp_path_factory.mktemp("role-matrix-certs"))


def kind_of(event: type) -> str:
    """The MOQT request kind of a session event type (``FetchReceived`` → ``FETCH``)."""
    if event.__name__ == "SubscribeNamespaceEnded":
        return "UNSUBSCRIBE_NAMESPACE"
    return re.sub(r"(?<!^)([A-Z])", r"_\1", event.__name__.removesuffix("Received")).upper()


def test_the_moqt_table_names_every_request_the_relay_handles(certs: Certs) -> None:
    """The table has a rule for every request kind the relay dispatches, and no other."""
    handled = {kind_of(t) for t in Relay(relay_config(certs))._handlers}
    assert {"CLIENT_SETUP", *handled} == set(moqt_rules())
    assert set(moqt_rules()) == {"CLIENT_SETUP", *READS, *ANNOUNCES, *FOLLOW_UPS}
    for kind in FOLLOW_UPS:
        assert moqt_rules()[kind] == moqt_rules()["CLIENT_SETUP"], kind


async def outcome(request: Any) -> str:
    try:
        await request
    except RequestRejected as exc:
        return RequestErrorCode(exc.error_code).name
    return "ok"


async def attempt(conn: Any, kind: str, role: str, params: MessageParameters) -> str:
    prefix = BLOCK.namespace[:4]
    if kind == "FETCH":
        span = (Location(0, 0), Location(0, 4))
        return await outcome(conn.fetch(*BLOCK.track, *span, parameters=params))
    if kind == "SUBSCRIBE":
        return await outcome(conn.subscribe(*BLOCK.track, parameters=params))
    if kind == "TRACK_STATUS":
        return await outcome(conn.track_status(*BLOCK.track, parameters=params))
    if kind == "SUBSCRIBE_NAMESPACE":
        return await outcome(conn.subscribe_namespace(prefix[:1], parameters=params))
    if kind == "PUBLISH_NAMESPACE":
        return await outcome(conn.publish_namespace(prefix, parameters=params))
    name = f"live-{role}".encode()
    return await outcome(conn.publish(BLOCK.namespace, name, parameters=params))


def test_every_role_on_every_moqt_request(certs: Certs) -> None:
    rules = moqt_rules()

    async def scenario() -> list[str]:
        failures: list[str] = []
        config = relay_config(certs, principals=moqt_principals())
        async with (
            running_relay(config) as relay,
            publishing(
                relay.url,
                certs,
                block_track(BLOCK),
                [BLOCK.namespace[:4]],
                token=moqt_token("root"),
                backend=SAME,
            ) as pub,
        ):
            pub.release.set()
            for role in ROLES:
                principal = _principal(role)
                # CLIENT_SETUP with the role's own token
                async with client(
                    relay.url, certs, token=moqt_token(who(role)), backend=SAME
                ) as own:
                    if allows(rules["CLIENT_SETUP"], principal):
                        got = await attempt(own, "FETCH", role, MessageParameters())
                        want = "ok" if allows(rules["FETCH"], principal) else UNAUTHORIZED
                        if got != want:
                            failures.append(f"{role} own session FETCH: {got}")
                    else:
                        try:
                            closed = await asyncio.wait_for(own.wait_closed(), 5)
                        except SessionClosedError as exc:
                            closed = exc.closed
                        if closed.error_code != SessionError.UNAUTHORIZED:
                            failures.append(f"{role} CLIENT_SETUP: {closed}")
                # every request kind, with the role's token on a root session
                async with client(relay.url, certs, token=moqt_token("root"), backend=SAME) as c:
                    for kind in (*READS, *ANNOUNCES):
                        got = await attempt(c, kind, role, request_token(who(role)))
                        if allows(rules[kind], principal):
                            if got == UNAUTHORIZED:
                                failures.append(f"{role} {kind}: refused")
                        elif got != UNAUTHORIZED:
                            failures.append(f"{role} {kind}: {got}, not {UNAUTHORIZED}")
        return failures

    failures = run(scenario(), timeout=120)
    assert not failures, "\n".join(failures)


def test_metrics_gets_no_moqt_session_and_no_request(certs: Certs) -> None:
    """FETCH and SUBSCRIBE_NAMESPACE (a broad prefix too) are refused to a ``metrics`` token,
    and a ``metrics`` CLIENT_SETUP is closed."""

    async def scenario() -> None:
        config = relay_config(certs, principals=moqt_principals())
        async with (
            running_relay(config) as relay,
            publishing(
                relay.url,
                certs,
                block_track(BLOCK),
                [BLOCK.namespace[:4]],
                token=moqt_token("root"),
                backend=SAME,
            ) as pub,
        ):
            pub.release.set()
            params = request_token(who("metrics"))
            async with client(relay.url, certs, token=moqt_token("root"), backend=SAME) as c:
                for kind in ("FETCH", "SUBSCRIBE_NAMESPACE"):
                    assert await attempt(c, kind, "metrics", params) == UNAUTHORIZED, kind
                broad = await outcome(c.subscribe_namespace((b"kvsp",), parameters=params))
                assert broad == UNAUTHORIZED
            async with client(
                relay.url, certs, token=moqt_token(who("metrics")), backend=SAME
            ) as own:
                try:
                    closed = await asyncio.wait_for(own.wait_closed(), 5)
                except SessionClosedError as exc:
                    closed = exc.closed
            assert closed.error_code == SessionError.UNAUTHORIZED

    run(scenario())
