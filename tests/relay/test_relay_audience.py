"""Audience credentials over MOQT (:mod:`kvsp.audience`, DESIGN.md §3): the relay takes a
credential bound to one of its own URIs in CLIENT_SETUP and in a request's AUTHORIZATION TOKEN,
and refuses one bound to another origin (UNAUTHORIZED), as it refuses an unknown token."""

from __future__ import annotations

import asyncio

import pytest

from kvsp.audience import audience_credential
from kvsp.web.auth import Principals, principal_entry
from moqt.asyncio import RequestRejected, SessionClosedError
from moqt.certs import make_self_signed
from moqt.errors import RequestErrorCode, SessionError
from moqt.messages import AuthToken, MessageParameters, TokenAliasType
from tests.support.relay_kit import (
    SCOPE_A,
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
READER = "relay-audience-reader-token-0123456789abcdef"
PUBLISHER = "relay-audience-publisher-token-0123456789ab"
ELSEWHERE = "moqt://127.0.0.1:1/"


def principals() -> Principals:
    return Principals.from_entries(
        [
            principal_entry("reader", READER, ["client"], [SCOPE_A]),
            principal_entry("publisher", PUBLISHER, ["holder"], [SCOPE_A]),
        ]
    )


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_self_signed("localhost", tmp_path_factory.mktemp("audience-certs"))


def request_token(value: str) -> MessageParameters:
    token = AuthToken(alias_type=TokenAliasType.USE_VALUE, token_type=0, token_value=value.encode())
    return MessageParameters(authorization_tokens=(token,))


def test_a_credential_for_another_origin_closes_the_session(certs: Certs) -> None:
    async def scenario() -> None:
        async with running_relay(relay_config(certs, principals=principals())) as relay:
            wrong = audience_credential(READER, ELSEWHERE)
            try:
                async with client(relay.url, certs, token=wrong) as session:
                    closed = await asyncio.wait_for(session.wait_closed(), 5)
            except SessionClosedError as exc:
                closed = exc.closed
            assert closed.error_code == SessionError.UNAUTHORIZED

    run(scenario())


def test_a_credential_for_the_relay_reads_and_one_for_elsewhere_is_refused(certs: Certs) -> None:
    block = make_block(71)

    async def scenario() -> None:
        async with (
            running_relay(relay_config(certs, principals=principals())) as relay,
            publishing(
                relay.url,
                certs,
                block_track(block),
                [block.namespace[:4]],
                token=audience_credential(PUBLISHER, relay.url),
            ),
            client(relay.url, certs, token=audience_credential(READER, relay.url)) as reader,
        ):
            objects = await fetch_all(reader, block.track, len(block.layers))
            assert tuple(bytes(o.payload) for o in objects) == block.layers
            # a request token bound to another origin is refused, not replaced by the session's
            wrong = request_token(audience_credential(READER, ELSEWHERE))
            with pytest.raises(RequestRejected) as caught:
                await reader.subscribe(*block.track, parameters=wrong)
            assert caught.value.error_code == RequestErrorCode.UNAUTHORIZED

    run(scenario())
