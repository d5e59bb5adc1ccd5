"""Authorization at the relay: session tokens in CLIENT_SETUP, scopes per request."""

from __future__ import annotations

import asyncio

import pytest

from kvsp.web.auth import Principals, principal_entry
from moqt.asyncio import RequestRejected, SessionClosedError
from moqt.certs import make_self_signed
from moqt.errors import RequestErrorCode, SessionError
from moqt.messages import AuthToken, MessageParameters, TokenAliasType
from moqt.session_events import NamespaceReceived
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

pytestmark = pytest.mark.timeout(60)
PRINCIPALS = {
    # name: (roles, scopes)
    "ca": (["client"], [SCOPE_A]),
    "cb": (["client"], [SCOPE_B]),
    "pub": (["instance"], [SCOPE_A, SCOPE_B]),
    "admin": (["admin"], None),
}
UNAUTHORIZED = RequestErrorCode.UNAUTHORIZED


def token(name: str) -> str:
    return f"relay-token-{name}-0123456789abcdef"


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_self_signed("localhost", tmp_path_factory.mktemp("relay-certs"))


def principals() -> Principals:
    return Principals.from_entries(
        [principal_entry(n, token(n), roles, scopes) for n, (roles, scopes) in PRINCIPALS.items()]
    )


async def refused(request: object) -> int:
    with pytest.raises(RequestRejected) as info:
        await request  # type: ignore[misc]
    return info.value.error_code


def test_a_scope_a_token_cannot_reach_scope_b(certs: Certs) -> None:
    in_a, in_b = make_block(30, scope=SCOPE_A), make_block(31, scope=SCOPE_B)

    async def scenario() -> None:
        async with running_relay(relay_config(certs, principals=principals())) as relay:
            tracks = {**block_track(in_a), **block_track(in_b)}
            namespaces = [in_a.namespace[:4], in_b.namespace[:4]]
            async with (
                publishing(relay.url, certs, tracks, namespaces, token=token("pub")) as pub,
                client(relay.url, certs, token=token("admin")) as admin,
                client(relay.url, certs, token=token("ca")) as ca,
            ):
                await fetch_all(admin, in_b.track, 4)  # scope B is now cached at the relay
                assert await refused(fetch_all(ca, in_b.track, 4)) == UNAUTHORIZED
                assert await refused(ca.subscribe(*in_b.track)) == UNAUTHORIZED
                uncached = make_block(32, scope=SCOPE_B)
                assert await refused(fetch_all(ca, uncached.track, 4)) == UNAUTHORIZED
                objects = await fetch_all(ca, in_a.track, 4)
                assert [bytes(o.payload) for o in objects] == list(in_a.layers)
                assert pub.fetches == 2

    run(scenario())


def test_a_request_token_replaces_the_session_principal(certs: Certs) -> None:
    in_a = make_block(33, scope=SCOPE_A)
    use_a = AuthToken(
        alias_type=TokenAliasType.USE_VALUE, token_type=0, token_value=token("ca").encode()
    )
    unknown = AuthToken(alias_type=TokenAliasType.USE_VALUE, token_type=0, token_value=b"nope")

    async def scenario() -> None:
        tracks = block_track(in_a)
        async with (
            running_relay(relay_config(certs, principals=principals())) as relay,
            publishing(relay.url, certs, tracks, [in_a.namespace], token=token("pub")),
            client(relay.url, certs, token=token("cb")) as cb,
        ):
            span = (Location(0, 0), Location(0, 4))
            assert await refused(cb.fetch(*in_a.track, *span)) == UNAUTHORIZED
            with_a = MessageParameters(authorization_tokens=(use_a,))
            response = await cb.fetch(*in_a.track, *span, parameters=with_a)
            assert len([o async for o in response.track.objects()]) == 4
            bad = MessageParameters(authorization_tokens=(unknown,))
            assert await refused(cb.fetch(*in_a.track, *span, parameters=bad)) == UNAUTHORIZED

    run(scenario())


@pytest.mark.parametrize("who", [None, "not-a-known-token-at-all"])
def test_a_session_without_a_valid_token_is_closed(certs: Certs, who: str | None) -> None:
    async def scenario() -> None:
        async with running_relay(relay_config(certs, principals=principals())) as relay:
            try:
                async with client(relay.url, certs, token=who) as anonymous:
                    closed = await asyncio.wait_for(anonymous.wait_closed(), 5)
            except SessionClosedError as exc:
                closed = exc.closed
            assert closed.error_code == SessionError.UNAUTHORIZED

    run(scenario())


def test_plain_namespaces_and_announcing_need_the_right_role(certs: Certs) -> None:
    in_a = make_block(34, scope=SCOPE_A)

    async def scenario() -> None:
        async with (
            running_relay(relay_config(certs, principals=principals())) as relay,
            client(relay.url, certs, token=token("ca")) as ca,
            client(relay.url, certs, token=token("admin")) as admin,
            client(relay.url, certs, token=token("pub")) as pub,
        ):
            assert await refused(ca.subscribe((b"plain",), b"t")) == UNAUTHORIZED
            missing = RequestErrorCode.DOES_NOT_EXIST
            assert await refused(admin.subscribe((b"plain",), b"t")) == missing
            assert await refused(ca.publish_namespace(in_a.namespace[:4])) == UNAUTHORIZED
            assert await refused(pub.publish_namespace((b"kvsp", b"1"))) == UNAUTHORIZED
            await pub.publish_namespace(in_a.namespace[:4])
            await admin.publish_namespace((b"plain",))

    run(scenario())


def test_namespace_notices_only_for_allowed_scopes(certs: Certs) -> None:
    in_a, in_b = make_block(35, scope=SCOPE_A), make_block(36, scope=SCOPE_B)

    async def scenario() -> None:
        async with (
            running_relay(relay_config(certs, principals=principals())) as relay,
            client(relay.url, certs, token=token("cb")) as cb,
        ):
            _, notices = await cb.subscribe_namespace((b"kvsp", b"1"))
            scope_a_prefix = in_a.namespace[:4]
            assert await refused(cb.subscribe_namespace(scope_a_prefix)) == UNAUTHORIZED
            namespaces = [in_a.namespace[:4], in_b.namespace[:4]]
            async with publishing(relay.url, certs, {}, namespaces, token=token("pub")):
                event = await asyncio.wait_for(notices.get(), 5)
                assert isinstance(event, NamespaceReceived)
                assert event.suffix == in_b.namespace[2:4]
                assert notices.empty()

    run(scenario())
