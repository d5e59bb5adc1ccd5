"""The MOQT authorization matrix at the relay (DESIGN.md §3: the bearer token in the
AUTHORIZATION TOKEN setup/request parameter; rules in ``relay/access.py``).

* CLIENT_SETUP without a token, with an unknown, an expired or a non-ASCII one: the session is
  closed with UNAUTHORIZED (0x2).
* Each role × own/other scope × SUBSCRIBE, FETCH, SUBSCRIBE_NAMESPACE, PUBLISH_NAMESPACE,
  PUBLISH: reading needs the scope and role holder, instance, client or admin; announcing
  needs role instance, holder or admin (``kvsp.web.roles``).
  Refusals are REQUEST_ERROR UNAUTHORIZED (0x1); the session stays up.
* A request token replaces the session's principal for that request, never widens it: a token
  for another scope is refused, and an unknown or expired request token is refused even on a
  session whose own principal could have done it.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from kvsp.web.auth import Principals, principal_entry
from moqt.asyncio import RequestRejected, SessionClosedError
from moqt.backend import default_backend
from moqt.certs import make_self_signed
from moqt.errors import RequestErrorCode, SessionError
from moqt.messages import AuthToken, MessageParameters, TokenAliasType
from moqt.wire import Location
from tests.support.relay_kit import (
    SCOPE_A,
    SCOPE_B,
    Certs,
    block_track,
    client,
    fetch_all,
    make_block,
    publishing,
    relay_config,
    run,
    running_relay,
)

pytestmark = pytest.mark.timeout(120)
ROLES = ("holder", "instance", "pc", "client", "admin")
PUBLISHERS = frozenset({"holder", "instance", "admin"})
READERS = frozenset({"holder", "instance", "client", "admin"})
"""Roles that may read KV and hold a session (``kvsp.web.roles``: ``pc`` may not; every role
is in ``test_role_matrix.py``)."""
UNAUTHORIZED = RequestErrorCode.UNAUTHORIZED
SCOPES = {"own": SCOPE_A, "other": SCOPE_B}
BLOCKS = {side: make_block(60 + i, scope=scope) for i, (side, scope) in enumerate(SCOPES.items())}


def token(name: str) -> str:
    return f"moqt-authz-{name}-0123456789abcdef"


def principals() -> Principals:
    entries = [principal_entry(r, token(r), [r], [SCOPE_A]) for r in ROLES]
    entries.append(principal_entry("root", token("root"), ["admin"], None))
    expired_ms = int(time.time() * 1000) - 60_000
    entries.append(
        principal_entry("expired", token("expired"), ["admin"], None, expires_ms=expired_ms)
    )
    return Principals.from_entries(entries)


def request_token(name: str) -> MessageParameters:
    value = AuthToken(
        alias_type=TokenAliasType.USE_VALUE, token_type=0, token_value=token(name).encode()
    )
    return MessageParameters(authorization_tokens=(value,))


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_self_signed("localhost", tmp_path_factory.mktemp("authz-certs"))


async def outcome(request: object) -> str:
    """``ok`` or the REQUEST_ERROR code's name."""
    try:
        await request  # type: ignore[misc]
    except RequestRejected as exc:
        return RequestErrorCode(exc.error_code).name
    return "ok"


@pytest.mark.parametrize(
    "who", [None, "not-a-known-token-0123456789abcdef", token("expired"), "tök€n-not-ascii"]
)
def test_a_session_without_a_valid_setup_token_is_closed(certs: Certs, who: str | None) -> None:
    async def scenario() -> None:
        async with running_relay(relay_config(certs, principals=principals())) as relay:
            try:
                async with client(relay.url, certs, token=who) as anonymous:
                    closed = await asyncio.wait_for(anonymous.wait_closed(), 5)
            except SessionClosedError as exc:
                closed = exc.closed
            assert closed.error_code == SessionError.UNAUTHORIZED

    run(scenario())


def expected(role: str, side: str, op: str) -> str:
    announcing = op in ("publish_namespace", "publish")
    if side == "other" or role not in (PUBLISHERS if announcing else READERS):
        return "UNAUTHORIZED"
    return "ok"


async def attempt(connection: object, op: str, side: str, parameters: MessageParameters) -> str:
    block = BLOCKS[side]
    prefix = block.namespace[:4]
    conn = connection  # a MOQTConnection
    if op == "fetch":
        span = (Location(0, 0), Location(0, 4))
        return await outcome(conn.fetch(*block.track, *span, parameters=parameters))  # type: ignore[attr-defined]
    if op == "subscribe":
        return await outcome(conn.subscribe(*block.track, parameters=parameters))  # type: ignore[attr-defined]
    if op == "subscribe_namespace":
        return await outcome(conn.subscribe_namespace(prefix, parameters=parameters))  # type: ignore[attr-defined]
    if op == "publish_namespace":
        return await outcome(conn.publish_namespace(prefix, parameters=parameters))  # type: ignore[attr-defined]
    name = b"live-" + op.encode() + side.encode()
    return await outcome(conn.publish(block.namespace, name, parameters=parameters))  # type: ignore[attr-defined]


OPS = ("fetch", "subscribe", "subscribe_namespace", "publish_namespace", "publish")
SAME = default_backend()
"""The clients' QUIC library: the relay's (mixing libraries is tested in tests/moqt)."""


def test_roles_scopes_and_request_tokens(certs: Certs) -> None:
    async def scenario() -> None:
        tracks = {**block_track(BLOCKS["own"]), **block_track(BLOCKS["other"])}
        namespaces = [b.namespace[:4] for b in BLOCKS.values()]
        async with (
            running_relay(relay_config(certs, principals=principals())) as relay,
            publishing(
                relay.url, certs, tracks, namespaces, token=token("root"), backend=SAME
            ) as pub,
        ):
            pub.release.set()
            failures = []
            for role in ROLES:
                # the role's own session, and root's session carrying the role's request token
                sessions = [(token("root"), request_token(role))]
                if role in READERS:  # the others' CLIENT_SETUP is refused (test_role_matrix)
                    sessions.insert(0, (token(role), MessageParameters()))
                for session_token, params in sessions:
                    async with client(relay.url, certs, token=session_token, backend=SAME) as conn:
                        for side in SCOPES:
                            for op in OPS:
                                got = await attempt(conn, op, side, params)
                                want = expected(role, side, op)
                                if got != want:
                                    via = "request token" if params.authorization_tokens else ""
                                    failures.append(f"{role} {via} {op} {side}: {got}, not {want}")
            assert not failures, "\n".join(failures)
            # reading a block in its own scope delivers its layers
            async with client(relay.url, certs, token=token("client"), backend=SAME) as conn:
                objects = await fetch_all(conn, BLOCKS["own"].track, 4)
                assert [bytes(o.payload) for o in objects] == list(BLOCKS["own"].layers)

    run(scenario(), timeout=90)


@pytest.mark.parametrize("bad", ["not-a-known-token-0123456789abcdef", token("expired")])
def test_a_bad_request_token_never_falls_back_to_the_session(certs: Certs, bad: str) -> None:
    unknown = AuthToken(alias_type=TokenAliasType.USE_VALUE, token_type=0, token_value=bad.encode())
    params = MessageParameters(authorization_tokens=(unknown,))

    async def scenario() -> None:
        tracks = block_track(BLOCKS["own"])
        async with (
            running_relay(relay_config(certs, principals=principals())) as relay,
            publishing(
                relay.url, certs, tracks, [BLOCKS["own"].namespace[:4]], token=token("root")
            ),
            client(relay.url, certs, token=token("root")) as root,
        ):
            for op in OPS:
                assert await attempt(root, op, "own", params) == "UNAUTHORIZED", op
            # the session itself is still usable, with its own principal
            assert await attempt(root, "fetch", "own", MessageParameters()) == "ok"

    run(scenario())
